// Reading a training checkpoint written at any layout, one section at a time, and consolidated
// weights: the full model's parameters assembled from the per-rank files (like DeepSpeed's
// zero_to_fp32.py), ready for write_safetensors.
//
// Note [Consolidating a checkpoint]
// A checkpoint written by W = dp * tp ranks (Note [Data-parallel checkpoints] in
// engine/state.cc) is `dir` itself when W = 1, else dir/rank0 .. dir/rank<W-1>, world rank
// r = dp_rank * tp + tp_rank; tp is meta.json's config.model.tensor_parallel (1 when absent).
// Every rank's section covers a range of its tp rank's padded flat buffer (Note [Flat
// partition] in zero/partition.h: padded = round_up(total_elems, dp * 64), S = padded / dp):
//   params   [params_range] when meta.json has one (ZeRO stage 3: the rank's shard), else
//            the whole padded buffer [0, padded)
//   master   the optimizer range: [0, padded) at stage 0, [d*S, (d+1)*S) above (d = dp rank);
//            exp_avg and exp_avg_sq the same
// inspect_checkpoint reads every rank's meta.json (no section) and checks that they agree
// with rank 0's: kind, step, dp_size, zero_stage, compute dtype and tensor_parallel, and the
// layout between the dp ranks of one tp rank. read_flat_section then lays the ranks' ranges of
// one section into a window of a tp rank's padded buffer, reading each rank's section file
// whole to check its size and CRC-32C (as io::read_state does) but keeping only the window's
// bytes, so a reader holds one window of one section at a time. With Replicas::kCompare it
// reads every dp rank and, where ranges overlap (the params of stages 0..2, the optimizer's
// sections at stage 0), the bytes must be equal; with kReadOnce each element comes from the
// first rank that holds it. Every parameter element of the window must be covered.
// consolidate_checkpoint consolidates one tp rank's part (ConsolidateOptions::tp_rank), or,
// for a tensor-parallel checkpoint without tp_rank, the whole model: each tp rank's part, joined
// through the model layer (join_tensor_parallel). The tensors are the buffer split by the
// layout (alignment padding dropped).
//
// Note [Tensor-parallel parts in bytes]
// A tensor-parallel rank's part of the model maps onto the whole model (the layout at
// tensor_parallel 1) in blocks of rows and columns, the cases of
// models::Transformer::shard_values that Transformer::shard_map lists (column-parallel rows,
// row-parallel columns, the q, k and v rows of a fused qkv, the vocabulary rows with the
// padding past V, replicated parameters whole). split_tensor_parallel copies a rank's blocks
// out of the whole model's buffer and place_tensor_parallel_part copies them back in (the
// inverse, as merge_shards; replicated parameters from tp rank 0), element bytes as they are:
// a working copy in bf16 stays the same bf16 bits, nothing is converted or rounded. The model
// config must be the checkpoint's (each part's layout is checked against the model's part
// before anything is read).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "io/weights_file.h"
#include "tensor/dtype.h"
#include "zero/partition.h"

namespace porter::io {

// What a training checkpoint holds, from its meta.json files alone (Note [Consolidating a
// checkpoint]).
struct CheckpointInfo {
  std::filesystem::path dir;
  int dp_size = 1;
  int tp_size = 1;
  int zero_stage = 0;
  int64_t step = 0;
  tensor::DType compute_dtype = tensor::DType::kF32;
  std::vector<std::filesystem::path> rank_dirs;  // by world rank dp_rank * tp + tp_rank
  std::vector<nlohmann::json> metas;             // the same ranks' meta.json

  int world() const { return dp_size * tp_size; }
  // dp rank 0's meta.json of tensor-parallel rank `tp_rank`.
  const nlohmann::json& meta(int tp_rank = 0) const { return metas.at(static_cast<size_t>(tp_rank)); }
  // The tp rank's layout's total_elems and its partition over dp_size ranks.
  int64_t total_elems(int tp_rank) const;
  zero::Partition partition(int tp_rank) const;
  bool has_section(std::string_view name) const;  // in rank 0's meta.json
};

// Throws IoError, its message starting with `who`, for a directory that is not a porter
// checkpoint, missing rank directories (all named), one rank's directory of a multi-rank
// checkpoint, and ranks whose meta.json disagree (the field and both values).
CheckpointInfo inspect_checkpoint(const std::filesystem::path& dir,
                                  std::string_view who = "consolidate");

// Bytes of one element of `section`: the compute dtype's for params, 4 (f32) for the others.
size_t section_elem_bytes(const CheckpointInfo& info, std::string_view section);
// The elements [begin, end) of its tp rank's padded flat buffer that world rank `rank`'s
// `section` holds. Throws IoError for a malformed params_range.
std::pair<int64_t, int64_t> section_range(const CheckpointInfo& info, int rank,
                                          std::string_view section);

enum class Replicas {
  kReadOnce,  // each element from the first rank that holds it; the others are not read
  kCompare,   // every dp rank read; the copies of an element must be equal
};

// Elements [begin, end) of `section` of tensor-parallel rank `tp_rank`'s padded flat buffer, raw
// (section_elem_bytes each); elements past the checkpoint's padded buffer are 0. Reads each
// rank's section file whole (its size and CRC-32C checked against meta.json) and keeps the
// window's part. `on_rank_read` (may be empty) is called after each rank's file. Throws
// IoError naming the file for a missing, truncated or corrupt section, a section of the wrong
// size for its range, replicas that differ (kCompare) and parameter elements no rank holds.
std::vector<std::byte> read_flat_section(
    const CheckpointInfo& info, int tp_rank, std::string_view section, int64_t begin, int64_t end,
    Replicas replicas, const std::function<void(const std::filesystem::path&)>& on_rank_read = {},
    std::string_view who = "consolidate");

// The model config meta.json's config.model describes, at its tensor_parallel. Throws IoError
// starting with `who` when it holds none or one porter cannot build.
config::ModelConfig checkpoint_model_config(const CheckpointInfo& info,
                                            std::string_view who = "consolidate");

// Note [Tensor-parallel parts in bytes]. `model` is the model at the tensor_parallel of the
// parts; buffers hold elements of elem_bytes, at least their layout's total_elems. The whole
// model's elements (total_elems of the layout at tensor_parallel 1):
int64_t whole_model_elems(const config::ModelConfig& model);
// Copies rank tp_rank's `part` (its layout) into `whole`; replicated parameters only from
// rank 0. Throws InvalidArgument for buffers too small.
void place_tensor_parallel_part(const config::ModelConfig& model, int tp_rank,
                                std::span<const std::byte> part, std::span<std::byte> whole,
                                size_t elem_bytes);
// The whole model's buffer from every rank's part (taken, each freed once placed).
std::vector<std::byte> join_tensor_parallel(const config::ModelConfig& model,
                                            std::vector<std::vector<std::byte>> parts,
                                            size_t elem_bytes);
// Rank tp_rank's part of the whole model's buffer, in its layout (the vocabulary padding 0).
std::vector<std::byte> split_tensor_parallel(const config::ModelConfig& model, int tp_rank,
                                             std::span<const std::byte> whole, size_t elem_bytes);

enum class WeightsDType {
  kWorking,  // the compute dtype, from `params` (what the model computed with)
  kF32,      // f32: the master copy when there is one (exact), else `params` widened
};

struct ConsolidateOptions {
  WeightsDType dtype = WeightsDType::kWorking;
  // Of a tensor-parallel checkpoint, the tp rank whose part to consolidate; without it, the
  // whole model (Note [Tensor-parallel parts in bytes]).
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
  int tp_rank = 0;               // the part consolidated (0 when whole)
  bool whole = true;             // every tp rank's part, joined (always with tp_size 1)
  int zero_stage = 0;
  std::vector<std::filesystem::path> rank_dirs;  // read: tp rank by tp rank, in dp-rank order
  int64_t num_params = 0;                        // elements of all tensors
  uint64_t data_bytes = 0;                       // bytes of all tensors
};

// Note [Consolidating a checkpoint]. Throws IoError for a directory that is not a porter
// checkpoint, missing rank directories (named), unreadable or corrupt files, ranks whose
// meta.json disagree (the field and both values), sections of the wrong size, replicas that
// differ, elements no rank holds, and a tensor-parallel checkpoint whose config.model does
// not build the parts its ranks hold (then --tp-rank still works); InvalidArgument for a
// tp_rank out of range.
ConsolidateResult consolidate_checkpoint(const std::filesystem::path& dir,
                                         const ConsolidateOptions& options = {});

}  // namespace porter::io
