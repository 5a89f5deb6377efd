// Training and validation data for the built-in GPT: batches of token ids and next-token
// targets.
// - synthetic: tokens drawn from Philox, a pure function of (seed, step, micro-batch);
// - text: a byte-level corpus (vocab 256) made of the files in porter.data.paths; each
//   micro-batch is B windows of T + 1 bytes at offsets drawn from Philox keyed by (seed, step,
//   micro-batch);
// - tokens: pre-tokenized uint16 shards (llm.c .bin or nanoGPT's raw train.bin,
//   io/token_shards.h), memory-mapped; windows drawn as Note [Token sampling] says.
// All three are pure functions of the step, so resuming from a training checkpoint needs no
// data loader state. ValidationSet reads porter.data.val_paths: the same windows at every
// evaluation (Note [Validation set]).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "tensor/tensor.h"
#include "io/token_shards.h"

namespace porter::io {

// Note [Batch tensors]
// A micro-batch is a set of named host tensors of any shape and dtype (f32, bf16, i32, i64,
// bool): a model's features, labels, masks, several inputs. The engine copies each to the
// device (category workspace: the batch, not an activation) before the micro-batch's first
// op and hands the stages an nn::Batch of them (Ctx::batch(name)); the model names which one
// is its first stage's input and which one its loss stage's targets (Model::input_name,
// Model::target_name), and which it expects (Model::batch_spec, checked before every step).
// A token batch is the case the built-in models take: its `tokens` and `targets` vectors
// become the (batch, seq) i32 tensors "tokens" and "targets". A HostTensor either owns its
// bytes or views memory that `owner` keeps alive (a NumPy array: no copy before the device).
struct HostTensor {
  std::string name;
  tensor::Shape shape;
  tensor::DType dtype = tensor::DType::kF32;
  const void* data = nullptr;          // shape.numel() elements of dtype, row-major
  std::shared_ptr<const void> owner;   // keeps `data` alive

  size_t nbytes() const { return static_cast<size_t>(shape.numel()) * tensor::dtype_size(dtype); }
  // A tensor that owns a copy of `values` (their count must be shape.numel()). T is float
  // (f32), int32_t, int64_t, or bool (bool).
  template <typename T>
  static HostTensor of(std::string name, tensor::Shape shape, std::vector<T> values);
  // Raw bytes of `dtype` (bf16 as uint16 bit patterns), copied.
  static HostTensor of_bytes(std::string name, tensor::Shape shape, tensor::DType dtype,
                             const void* bytes);
};

// One micro-batch on the host: (batch, seq) token ids and targets, row-major, and any named
// tensors besides (Note [Batch tensors]).
struct HostBatch {
  int64_t batch = 0;
  int64_t seq = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
  std::vector<HostTensor> tensors;

  // The named tensor, or null.
  const HostTensor* find(std::string_view name) const;
};

// The files that the entries of porter.data.paths (or val_paths; `key` names which, for the
// messages) stand for, in order: a file as given; a directory's files, recursively, in sorted
// order, hidden ones skipped (for tokens only *.bin); a glob in the last component
// ("data/fineweb_train_*.bin": *, ? and [...]) as the sorted files of that directory it
// matches. Relative paths resolve against the working directory. Throws IoError for a path
// that does not exist, a directory without such files and a glob that matches nothing.
std::vector<std::filesystem::path> resolve_data_files(const std::vector<std::string>& paths,
                                                      const std::string& key,
                                                      config::DataType type);

// Note [Token sampling]
// A step of tokens data reads G = dp_size * micro_batches global micro-batches of B rows each
// (rank r takes global micro-batches [r * micro_batches, (r + 1) * micro_batches), as for
// every data type). Row b of global micro-batch g of step s is training sample
//   j = (s * G + g) * B + b,
// which lies in epoch e = j / W, W being the corpus's windows (Note [Token windows]), and
// reads window permute_window(j mod W, W, porter.data.seed, e) (Note [Window permutation]).
// So:
// - within an epoch no window is drawn twice, and every window is drawn once per epoch;
// - dp ranks of m micro-batches each see exactly what one rank of dp * m sees, without
//   overlap between the ranks;
// - step s's batches depend on s alone: a run resumed at step s (or a fresh DataSource)
//   reads what the uninterrupted run read. The position depends on the global batch G * B,
//   so a run resumed with another global batch reads other windows (without repeats only
//   within each part).
// Each epoch has its own order; an epoch boundary may fall inside a step.

class DataSource {
 public:
  // Loads the corpus for text data and maps and checks the shards for tokens data (Note
  // [Shard checks]). Throws IoError for unreadable or malformed files, InvalidArgument for a
  // corpus or shard shorter than seq + 1 tokens, a token id outside the vocab, or (text) a
  // vocab below 256.
  DataSource(const config::DataConfig& data, int64_t vocab, int64_t micro_batch, int64_t seq);
  // The micro-batches of optimizer step `step` (0-based).
  std::vector<HostBatch> step_batches(int64_t step, int64_t micro_batches) const;
  // Data-parallel rank dp_rank's share of step `step`: global micro-batches
  // [dp_rank * micro_batches, (dp_rank + 1) * micro_batches) of the step, so dp ranks with
  // micro_batches each see exactly what one rank with dp * micro_batches sees.
  std::vector<HostBatch> rank_batches(int64_t step, int64_t micro_batches, int dp_rank,
                                      int dp_size) const;

  // Tokens data: the window that row `row` of global micro-batch `micro_batch` of step
  // `step` reads, with `global_micro_batches` per step, and its epoch (Note [Token sampling]).
  struct WindowPosition {
    int64_t epoch = 0;
    int64_t window = 0;
  };
  WindowPosition window_of(int64_t step, int64_t global_micro_batches, int64_t micro_batch,
                           int64_t row) const;
  // Tokens data: the shards; null for other types.
  const TokenCorpus* tokens() const { return tokens_.get(); }

  size_t corpus_bytes() const { return corpus_.size(); }  // text
  // "text: 412 KiB from 57 files", "synthetic (seed 7, vocab 64)",
  // "tokens: 12.30M tokens in 4 llm.c shards, 48.0k windows of 257".
  std::string describe() const;

 private:
  config::DataConfig config_;
  int64_t vocab_, micro_batch_, seq_;
  std::string corpus_;                        // text
  size_t num_files_ = 0;                      // text
  std::shared_ptr<const TokenCorpus> tokens_;  // tokens; shared by copies, read-only
};

// Note [Validation set]
// The validation data is porter.data.val_paths, of the training data's type (text or
// tokens), cut into windows of seq + 1 tokens the same way (Note [Token windows]; a text
// corpus is one sequence of bytes, its files concatenated). An evaluation reads
// V = dp_size * micro_batches micro-batches of B rows; micro_batches is per rank, like
// gradient_accumulation_steps. Row b of validation micro-batch v is sample k = v * B + b of
// K = V * B, and reads window floor(k * W / K) of the W windows: K windows spread evenly over
// the whole set, none twice, and the same ones at every evaluation, so successive validation
// losses are comparable. Rank r evaluates micro-batches [r * micro_batches, (r + 1) *
// micro_batches): the ranks' windows are disjoint, their mean losses weigh the same, and the
// mean of the ranks' means is the loss of the K windows. K > W is an error (it names the
// largest micro_batches that fits).
class ValidationSet {
 public:
  // Reads porter.data.val_paths (data.type text or tokens). Throws as DataSource does, and
  // InvalidArgument when a validation file is also a training file (porter.data.paths) or
  // the set has fewer windows than dp_size * micro_batches * micro_batch.
  ValidationSet(const config::DataConfig& data, int64_t vocab, int64_t micro_batch, int64_t seq,
                int64_t micro_batches, int dp_size);
  // Data-parallel rank dp_rank's micro_batches() validation micro-batches.
  std::vector<HostBatch> rank_batches(int dp_rank) const;
  // The window that row `row` of rank dp_rank's validation micro-batch `micro_batch` reads.
  int64_t window_of(int dp_rank, int64_t micro_batch, int64_t row) const;

  int64_t micro_batches() const { return micro_batches_; }  // per rank
  int dp_size() const { return dp_size_; }
  int64_t num_windows() const { return num_windows_; }
  const TokenCorpus* tokens() const { return tokens_.get(); }
  // "tokens: 40.0k tokens in 1 raw uint16 shard, 64 of its 156 windows of 257".
  std::string describe() const;

 private:
  void read_window(int64_t w, int32_t* tokens, int32_t* targets) const;

  config::DataType type_;
  int64_t micro_batch_, seq_, micro_batches_;
  int dp_size_;
  int64_t num_windows_ = 0;
  std::string corpus_;  // text
  size_t num_files_ = 0;  // text
  std::shared_ptr<const TokenCorpus> tokens_;  // tokens
};

}  // namespace porter::io
