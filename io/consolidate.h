// Consolidated weights: the full model's parameters assembled from the per-rank files of a
// training checkpoint (like DeepSpeed's zero_to_fp32.py), ready for write_safetensors.
//
// Note [Consolidating a checkpoint]
// A checkpoint written by W = dp * tp ranks (Note [Data-parallel checkpoints] in
// engine/state.cc) is `dir` itself when W = 1, else dir/rank0 .. dir/rank<W-1>, world rank
// r = dp_rank * tp + tp_rank; tp is meta.json's config.model.tensor_parallel (1 when absent).
// Every rank's section covers a range of the padded flat buffer (Note [Flat partition] in
// zero/partition.h: padded = round_up(total_elems, dp * 64), S = padded / dp):
//   params   [params_range] when meta.json has one (ZeRO stage 3: the rank's shard), else
//            the whole padded buffer [0, padded)
//   master   the optimizer range: [0, padded) at stage 0, [d*S, (d+1)*S) above (d = dp rank)
// consolidate_checkpoint reads the dp ranks of one tp rank (all of them when tp = 1) through
// read_state, which verifies every section's checksum, and checks that they agree with the
// first: kind, step, dp_size, zero_stage, compute dtype, tensor_parallel and layout. It then
// lays each rank's range into one padded buffer; where ranges overlap (replicas: the params
// of stages 0..2, master at stage 0) the bytes must be equal. Every parameter element must be
// covered. The tensors are that buffer split by the layout (alignment padding dropped).
// A tensor-parallel checkpoint's tp ranks hold different parts of the model (each its own
// layout), so one rank's part is consolidated at a time (ConsolidateOptions::tp_rank).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/weights_file.h"
#include "tensor/dtype.h"

namespace porter::io {

enum class WeightsDType {
  kWorking,  // the compute dtype, from `params` (what the model computed with)
  kF32,      // f32: the master copy when there is one (exact), else `params` widened
};

struct ConsolidateOptions {
  WeightsDType dtype = WeightsDType::kWorking;
  // Required when the checkpoint is tensor-parallel: the tp rank whose part to consolidate.
  std::optional<int> tp_rank;
  // Called after each rank's state is read and checked: (ranks read so far, ranks to read,
  // the rank's directory). May be empty.
  std::function<void(int done, int count, const std::filesystem::path& rank_dir)> on_rank_read;
};

struct ConsolidateResult {
  std::vector<WeightTensor> tensors;  // layout order
  tensor::DType dtype = tensor::DType::kF32;  // of every tensor
  std::string section;                // where they came from: "params" or "master"
  tensor::DType compute_dtype = tensor::DType::kF32;
  int64_t step = 0;
  int dp_size = 1;
  int tp_size = 1;
  int tp_rank = 0;
  int zero_stage = 0;
  std::vector<std::filesystem::path> rank_dirs;  // read, in dp-rank order
  int64_t num_params = 0;                        // elements of all tensors
  uint64_t data_bytes = 0;                       // bytes of all tensors
};

// Note [Consolidating a checkpoint]. Throws IoError for a directory that is not a porter
// checkpoint, missing rank directories (named), unreadable or corrupt files (read_state),
// ranks whose meta.json disagree (the field and both values), sections of the wrong size,
// replicas that differ and elements no rank holds; InvalidArgument for a tensor-parallel
// checkpoint without tp_rank and a tp_rank out of range.
ConsolidateResult consolidate_checkpoint(const std::filesystem::path& dir,
                                         const ConsolidateOptions& options = {});

}  // namespace porter::io
