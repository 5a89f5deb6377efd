// A training checkpoint in host memory: what Engine::save_checkpoint writes, taken from the
// device first (Engine::snapshot_checkpoint) so that the files can be written while training
// goes on (Note [Background checkpoints] in engine/checkpointer.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/state_file.h"
#include "io/weights_file.h"

namespace porter::nn {
class ParamLayout;
}

namespace porter::engine {

// meta.json's "layout": {"total_elems", "params": [{"name", "shape", "offset"}...]}.
nlohmann::json checkpoint_layout_json(const nn::ParamLayout& layout);

struct CheckpointSnapshot {
  // Where this rank's files go below the checkpoint directory: "" with one rank, else
  // "rank<r>" (Note [Data-parallel checkpoints] in engine/state.cc).
  std::filesystem::path rank_subdir;
  nlohmann::json meta;                    // Note [Engine state]
  std::vector<io::StateSection> sections;  // params, master, exp_avg, exp_avg_sq
  // zero_optimization.stage3_gather_16bit_weights_on_model_save: the whole model's working
  // weights (this tensor-parallel rank's part), which data-parallel rank 0 writes beside the
  // rank directories; empty name on the other ranks and without the option.
  std::string weights_file;
  std::vector<io::WeightTensor> weights;
  io::WeightMetadata weights_metadata;

  uint64_t bytes() const;  // of the sections and weights: the host memory it holds
};

// Writes `snapshot` into the checkpoint directory `dir`: its sections and meta.json into
// dir / rank_subdir (io::write_state, atomic per directory), then the weights file. Needs no
// engine and no device, so it may run on any thread.
void write_snapshot(const CheckpointSnapshot& snapshot, const std::filesystem::path& dir);

}  // namespace porter::engine
