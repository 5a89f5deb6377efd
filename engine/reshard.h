// Resharding a training checkpoint: this rank's part of the state a checkpoint written at
// another layout holds (data-parallel size, tensor-parallel degree, ZeRO stage, offload), for
// Engine::load_checkpoint (engine/state.cc).
//
// Note [Resharding a checkpoint]
// A checkpoint is a set of flat buffers per tensor-parallel rank (Notes [Data-parallel
// checkpoints] in engine/state.cc and [Flat partition] in zero/partition.h): each section
// (params in the compute dtype; master, exp_avg, exp_avg_sq in f32) is the padded flat buffer
// of the tp rank's part of the model, cut into the ranges its dp ranks held. Offload changes
// where a rank keeps its range, never what the checkpoint holds (Notes [Partial offload] and
// [Parameter offload] in zero/sharded_optimizer.h), so a checkpoint's layout is (dp, tp,
// stage), and any two layouts hold the same values of the same whole model.
// load_checkpoint reads its own rank directory as before when the checkpoint's (dp, tp) are
// this run's and so is its stage (any stage with one data-parallel rank): the fast path.
// Otherwise, per section, one at a time:
//   1. same tensor-parallel degree: the rank's part of the model has the same layout in the
//      checkpoint, so its targets' element ranges [begin, end) of this run's padded buffer
//      are read directly from the saved ranks of the same tp rank whose ranges overlap them
//      (io::read_flat_section, Replicas::kReadOnce: each element from the first rank holding
//      it, every file it reads checked whole against its size and CRC-32C). The tail past the
//      checkpoint's padded buffer is padding, 0.
//   2. another degree (the built-in transformer only): the section's whole model, the layout
//      at tensor_parallel 1, is assembled from every saved tp rank's part [0, total_elems),
//      read one part at a time and placed through the inverse of
//      models::Transformer::shard_values (io::place_tensor_parallel_part; replicated
//      parameters from tp rank 0); this rank's part of it is shard_values' for its tp rank
//      (io::split_tensor_parallel), and its targets' ranges are cut from that. Elements move
//      as raw bytes (Note [Tensor-parallel parts in bytes] in io/consolidate.h): bf16 params
//      stay the same bf16 bits, nothing is converted or rounded.
// The targets are those the fast path fills: params over the whole padded buffer (stages
// 0-2) or the rank's shard (stage 3, Note [Stage 3 gather]), and the optimizer's sections
// over its range (host part then device part with a partial offload). The step,
// optimizer_steps, loss scaler and kernel table come from world rank 0's meta.json (every
// rank saves the same). Every section is read and checked before anything is written to the
// engine, as on the fast path.
// Host memory at the peak: the rank's own targets (its whole training state, which the fast
// path holds too, reading its rank directory whole) plus one 4 MiB block of the file being
// read; with another tensor-parallel degree also, while one section is resharded, that
// section of the whole model, one saved part and this rank's part (for a section of e-byte
// elements and a model of P elements at tensor_parallel 1, about e * P * (1 + 1/t_saved +
// 1/t)), all freed before the next section.
// What must match: the model (its layout at the checkpoint's degree, checked parameter by
// parameter against every saved tp rank's) and the compute dtype. What may differ: dp size,
// tp degree (1 or more, dividing the heads as always), ZeRO stage, optimizer offload and its
// ratio, parameter offload, the config's batch sizes and the world size.
//
// The kernel table (Note [Kernel table] in kernels/kernel_table.cc): a resharded resume pins
// world rank 0's table like the fast path (after the first step every rank held rank 0's).
// A pinned table never blocks a problem it lacks: a kernel that finds no entry measures (or
// fixes) its choice and records it, as in a run with nothing pinned. At another tensor-parallel
// degree the matmul shapes differ, so the new shapes are measured at first use; under
// kernel_choice "exact" (the default) every candidate gives the same bits, so this changes
// nothing, and under "fastest" the run computes as a fresh run at this layout would. The
// engine says so in an info line.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "io/consolidate.h"
#include "nn/layer.h"
#include "tensor/dtype.h"

namespace porter::engine {

// What a rank of this run holds its state in.
struct RankLayout {
  config::ModelConfig model;              // the run's; its tensor_parallel is the run's degree
  const nn::ParamLayout* layout = nullptr;  // this rank's part of the model; not owned
  bool transformer = false;  // the built-in transformer (another tensor-parallel degree needs it)
  int dp_size = 1, dp_rank = 0, tp_size = 1, tp_rank = 0, zero_stage = 0;
  tensor::DType compute_dtype = tensor::DType::kF32;
};

// The layout a checkpoint was written at, from its first meta.json (dir/meta.json or
// dir/rank0/meta.json), before any section is read. found is false when neither parses as a
// porter checkpoint's (the fast path's io::read_state then names what is wrong).
struct SavedLayout {
  bool found = false;
  int dp_size = 1, tp_size = 1, zero_stage = 0;
  bool rank_dirs = false;  // the states are dir/rank<r>
  int world() const { return dp_size * tp_size; }
};
// Throws InvalidArgument when `dir` is one rank's directory of a checkpoint of several ranks
// (naming them and the directory to load instead).
SavedLayout peek_saved_layout(const std::filesystem::path& dir);
// Whether load_checkpoint reads this rank's own directory (Note [Resharding a checkpoint]).
bool same_layout(const SavedLayout& saved, const RankLayout& mine);

// Throws InvalidArgument starting with `where` naming the first difference between the
// checkpoint's layout and this model's (both as checkpoint_layout_json writes them, engine/
// checkpoint_snapshot.h), and `fix`.
void check_checkpoint_layout(const std::string& where, const nlohmann::json& saved,
                             const nlohmann::json& mine, const std::string& fix);

// One state tensor of this rank: `section` over elements [begin, end) of its padded flat
// buffer.
struct ReshardTarget {
  std::string section;
  int64_t begin = 0, end = 0;
};

// Note [Resharding a checkpoint]: each target's bytes ((end - begin) elements of the
// section's dtype), in order. Checks first that `saved` can be resharded into `mine` (compute
// dtype, model layout; InvalidArgument naming what differs and what to do); throws IoError
// for files that are missing, truncated or corrupt, or that do not cover the targets.
std::vector<std::vector<std::byte>> reshard_sections(const io::CheckpointInfo& saved,
                                                     const RankLayout& mine,
                                                     const std::vector<ReshardTarget>& targets);

// The whole model's values of one section of the checkpoint in `dir`, at any layout: the
// layout at tensor_parallel 1, its total_elems elements (padding 0), raw in the section's
// dtype (elem_bytes each). `model` is the checkpoint's model at any tensor_parallel (used when
// the checkpoint's is above 1). For tests and tools; reads the ranks' files like
// reshard_sections.
struct WholeSection {
  size_t elem_bytes = 4;
  std::vector<std::byte> bytes;
};
WholeSection read_whole_section(const std::filesystem::path& dir, const std::string& section,
                                const config::ModelConfig& model);

}  // namespace porter::engine
