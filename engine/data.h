// Training data for the built-in GPT: batches of token ids and next-token targets.
// - synthetic: tokens drawn from Philox, a pure function of (seed, step, micro-batch);
// - text: a byte-level corpus (vocab 256) made of the files in porter.data.paths (files, or
//   directories read recursively in sorted order); each micro-batch is B windows of T + 1
//   bytes at offsets drawn from Philox keyed by (seed, step, micro-batch).
// Both are pure functions of the step, so resuming from a training checkpoint needs no data
// loader state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace porter::engine {

// One micro-batch on the host: (batch, seq) token ids and targets, row-major.
struct HostBatch {
  int64_t batch = 0;
  int64_t seq = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

class DataSource {
 public:
  // Loads the corpus for text data (throws IoError for unreadable paths, InvalidArgument
  // for a corpus shorter than seq + 1 bytes or a vocab below 256).
  DataSource(const config::DataConfig& data, int64_t vocab, int64_t micro_batch, int64_t seq);
  // The micro-batches of optimizer step `step` (0-based).
  std::vector<HostBatch> step_batches(int64_t step, int64_t micro_batches) const;
  // Data-parallel rank dp_rank's share of step `step`: global micro-batches
  // [dp_rank * micro_batches, (dp_rank + 1) * micro_batches) of the step, so dp ranks with
  // micro_batches each see exactly what one rank with dp * micro_batches sees.
  std::vector<HostBatch> rank_batches(int64_t step, int64_t micro_batches, int dp_rank,
                                      int dp_size) const;
  size_t corpus_bytes() const { return corpus_.size(); }
  std::string describe() const;  // "text: 412 KiB from 57 files" / "synthetic (seed 7)"

 private:
  config::DataConfig config_;
  int64_t vocab_, micro_batch_, seq_;
  std::string corpus_;
  size_t num_files_ = 0;
};

}  // namespace porter::engine
