// The Engine's private state (engine.h), shared by engine.cc and state.cc.
#pragma once

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "checkpoint/planner.h"
#include "engine/engine.h"
#include "engine/lr_schedule.h"
#include "nn/ctx.h"
#include "nn/layer.h"
#include "offload/stash.h"

namespace porter::engine {

struct Engine::Impl {
  // The pinned pool before the stash: the stash returns its slots to it when destroyed.
  std::unique_ptr<memory::PinnedPool> pinned;
  std::unique_ptr<offload::CheckpointStash> stash;
  double link_bytes_per_s = 0.0;  // Engine::link_bytes_per_s
  offload::StashStats offload_total;  // since construction or reset_peaks()
  std::vector<offload::CopyRecord> copies;  // the last step's (every step's with profile)
  std::vector<offload::WaitRecord> waits;
  bool keep_all_records = false;  // activation_checkpointing.profile
  std::unique_ptr<nn::FlatParams> flat;  // params (compute dtype) and grads (f32)
  bool has_master = false;               // bf16 compute
  nn::Tensor master;                     // (P) f32 master copy, category optimizer; bf16 only
  nn::Tensor exp_avg;                    // (P) f32 AdamW m, category optimizer
  nn::Tensor exp_avg_sq;                 // (P) f32 AdamW v, category optimizer
  std::unique_ptr<nn::Ctx> ctx;
  config::OptimizerConfig optimizer;
  std::unique_ptr<LrSchedule> lr;
  checkpoint::ChainCosts costs;
  checkpoint::Plan plan;
  std::vector<double> recompute_s_per_step;
  // Peaks of earlier windows: train_step and profile reset the allocator's peaks to measure
  // themselves, so the report keeps the running maximum here.
  std::array<size_t, memory::kNumCategories> peak_by_category{};
  size_t peak_requested_bytes = 0;
  size_t peak_activation_bytes = 0;

  // The f32 tensor AdamW updates: the master copy for bf16, else the parameters.
  nn::Tensor update_target() const { return has_master ? master : flat->params(); }
  void fold_peaks(const memory::MemoryStats& s) {
    for (size_t c = 0; c < memory::kNumCategories; ++c)
      peak_by_category[c] = std::max(peak_by_category[c], s.by_category[c].peak_bytes);
    peak_requested_bytes = std::max(peak_requested_bytes, s.peak_requested_bytes);
    peak_activation_bytes = std::max(peak_activation_bytes, s.peak_activation_bytes);
  }
};

}  // namespace porter::engine
