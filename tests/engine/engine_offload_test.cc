// Checkpoint offload through the Engine (docs/engine.md, Offload): bit-identical results with
// and without it under every policy that stores checkpoints, prefetch depths and arenas; the
// device bytes it saves, exactly; a slow link and poisoned frees; pinned exhaustion; baselines
// after every step, after out-of-memory, and over a long run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "base/units.h"
#include "engine_test_util.h"
#include "memory/cpu_device.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using ::testing::HasSubstr;
using config::CheckpointPolicy;

// The policies that store checkpoints (none holds nothing to offload).
const std::vector<CheckpointPolicy> kStoringPolicies = {
    CheckpointPolicy::kFull, CheckpointPolicy::kUniform,   CheckpointPolicy::kBlock,
    CheckpointPolicy::kSqrt, CheckpointPolicy::kSelective, CheckpointPolicy::kOptimal};

struct OffloadKnobs {
  bool offload = true;
  int depth = 1;
  bool contiguous = false;
  int keep_last = 1;
};

config::Config offload_config(CheckpointPolicy p, const OffloadKnobs& k, bool bf16 = false) {
  config::Config c = tiny_config(p, 0.1, 2, bf16);
  c.porter.checkpointing.every_n_layers = 2;
  c.porter.checkpointing.block_layers = 2;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.6};
  c.porter.checkpointing.prefetch_depth = k.depth;
  c.porter.checkpointing.keep_last_on_device = k.keep_last;
  c.activation_checkpointing = config::ActivationCheckpointingConfig{};
  c.activation_checkpointing->cpu_checkpointing = k.offload;
  c.activation_checkpointing->contiguous_memory_optimization = k.contiguous;
  return c;
}

std::string name_of(CheckpointPolicy p, const OffloadKnobs& k, bool bf16) {
  return std::string(config::to_string(p)) + " depth " + std::to_string(k.depth) +
         (k.contiguous ? " contiguous" : "") + " keep_last " + std::to_string(k.keep_last) +
         (bf16 ? " bf16" : " f32");
}

struct RunResult {
  std::vector<double> losses;
  std::vector<float> first_grads;
  std::vector<float> params;
  SavedState state;  // the whole training state after the steps
};

// Runs `steps` steps and checks, after each, that everything the step took went back.
RunResult run_steps(Engine& e, const config::Config& c, int steps) {
  const size_t requested = e.allocator().stats().requested_bytes;
  const size_t footprint = e.allocator().stats().activation_bytes;  // the staging arena
  const size_t pinned = e.pinned_pool().stats().in_use_bytes;       // the pinned arena
  RunResult r;
  for (int s = 0; s < steps; ++s) {
    r.losses.push_back(e.train_step(batches(c, s)).loss);
    if (s == 0) r.first_grads = e.grads_host();
    EXPECT_EQ(e.allocator().stats().requested_bytes, requested) << "step " << s;
    EXPECT_EQ(e.allocator().stats().activation_bytes, footprint) << "step " << s;
    EXPECT_EQ(e.pinned_pool().stats().in_use_bytes, pinned) << "step " << s;
  }
  r.params = e.params_host();
  r.state = saved_state(e);
  return r;
}

RunResult reference_run(bool bf16, int steps) {
  const config::Config c = offload_config(CheckpointPolicy::kNone, {.offload = false}, bf16);
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  return run_steps(*e, c, steps);
}

void expect_same(const RunResult& got, const RunResult& want) {
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_TRUE(bitwise_equal(got.first_grads, want.first_grads));
  EXPECT_TRUE(bitwise_equal(got.params, want.params));
  expect_same_state(got.state, want.state, "against the run without offload");
}

size_t read_back_bytes(const checkpoint::OffloadLayout& layout) {
  size_t n = 0;
  for (const checkpoint::StashEntry& x : layout.entries) n += x.use_op >= 0 ? x.bytes : 0;
  return n;
}

// The stash's counters for one step: every entry goes out once per micro-batch, every
// read-back entry comes back once.
void expect_step_counters(const Engine& e, const StepResult& r, int64_t micro_batches) {
  const checkpoint::OffloadLayout& layout = e.plan().offload;
  const auto mb = static_cast<size_t>(micro_batches);
  EXPECT_EQ(r.offload.d2h_bytes, layout.offloaded_bytes * mb);
  EXPECT_EQ(r.offload.h2d_bytes, read_back_bytes(layout) * mb);
  size_t read_back = 0;
  for (const checkpoint::StashEntry& x : layout.entries) read_back += x.use_op >= 0 ? 1 : 0;
  EXPECT_EQ(e.last_copies().size(), (layout.entries.size() + read_back) * mb);
  EXPECT_EQ(e.last_waits().size(), read_back * mb);
}

// Rotor places host holds only where they buy time or memory under the budget, and on this
// small chain only near its minimum budget with per-load staging. The first such schedule, from the
// minimum up, becomes a hand-built plan under the config's own depth and arena setting.
checkpoint::Plan optimal_with_host_holds(Engine& e, const config::Config& c) {
  checkpoint::PlanOptions o;
  o.checkpointing = c.porter.checkpointing;
  o.offload = offload_options(c);
  // A link so fast that copies cost nothing: the choice then depends on bytes alone, not on
  // this machine's measured times (near its minimum, host holds are what fits).
  o.offload.link_bytes_per_s = 1e15;
  o.offload.contiguous = false;
  const size_t lo = checkpoint::minimum_budget_bytes(e.costs(), o.offload);
  const size_t hi = checkpoint::resolve_budget(config::MemoryBudget{1.0}, e.costs());
  for (int i = 0; i <= 16; ++i) {
    o.budget = config::MemoryBudget{static_cast<uint64_t>(lo + (hi - lo) * i / 16)};
    checkpoint::Plan plan = checkpoint::make_plan(o, e.costs());
    if (plan.offload.empty()) continue;
    const checkpoint::OffloadOptions own = offload_options(c);
    plan.sim = own.sim();
    plan.offload = checkpoint::plan_layout(plan.schedule, e.costs(), own);
    plan.prediction = checkpoint::predict(plan.schedule, e.costs(), own);
    return plan;
  }
  ADD_FAILURE() << "no budget gives the optimal planner a host hold";
  return e.plan();
}

TEST(EngineOffloadTest, BitIdenticalUnderEveryPolicyDepthAndArena) {
  const int kSteps = 3;
  for (bool bf16 : {false, true}) {
    const RunResult ref = reference_run(bf16, kSteps);
    for (CheckpointPolicy p : kStoringPolicies) {
      for (int depth = 0; depth <= 3; ++depth) {
        for (bool contiguous : {false, true}) {
          if (bf16 && depth != 1) continue;  // bf16: one depth per arena setting is enough
          const OffloadKnobs k{true, depth, contiguous, 0};
          SCOPED_TRACE(name_of(p, k, bf16));
          const config::Config c = offload_config(p, k, bf16);
          auto device = cpu_device();
          auto e = gpt_engine(*device, c);
          EXPECT_GT(e->link_bytes_per_s(), 0.0);  // measured: no sim_link_gbps
          if (p == CheckpointPolicy::kOptimal) e->set_plan(optimal_with_host_holds(*e, c));
          const checkpoint::Plan& plan = e->plan();
          EXPECT_FALSE(plan.offload.empty()) << plan.schedule.to_string();
          expect_same(run_steps(*e, c, kSteps), ref);
          // The footprint, staging included, is the one the planner predicted.
          EXPECT_EQ(e->memory_report().peak_activation_bytes,
                    plan.prediction.peak_activation_bytes)
              << plan.schedule.to_string();
        }
      }
    }
  }
}

TEST(EngineOffloadTest, CheckpointPeakFallsByExactlyTheOffloadedBytes) {
  for (bool bf16 : {false, true}) {
    for (CheckpointPolicy p : {CheckpointPolicy::kFull, CheckpointPolicy::kUniform}) {
      for (bool contiguous : {false, true}) {
        const OffloadKnobs on{true, 1, contiguous, 1};
        SCOPED_TRACE(name_of(p, on, bf16));
        size_t peak_checkpoints[2] = {0, 0};
        for (bool offload : {false, true}) {
          OffloadKnobs k = on;
          k.offload = offload;
          const config::Config c = offload_config(p, k, bf16);
          auto device = cpu_device();
          auto e = gpt_engine(*device, c);
          const StepResult r = e->train_step(batches(c, 0));
          const MemoryReport m = e->memory_report();
          peak_checkpoints[offload] =
              m.peak_by_category[memory::index_of(memory::Category::kCheckpoints)];
          EXPECT_EQ(r.peak_activation_bytes, e->plan().prediction.peak_activation_bytes)
              << e->plan().schedule.to_string();
          if (!offload) {
            EXPECT_TRUE(e->plan().offload.empty());
            EXPECT_EQ(r.offload.d2h_bytes, 0u);
            continue;
          }
          const checkpoint::OffloadLayout& layout = e->plan().offload;
          ASSERT_FALSE(layout.empty());
          EXPECT_EQ(peak_checkpoints[0] - peak_checkpoints[1], layout.offloaded_bytes);
          expect_step_counters(*e, r, c.gradient_accumulation_steps);
          EXPECT_EQ(m.offloaded_bytes, layout.offloaded_bytes);
          EXPECT_EQ(m.predicted_pinned_bytes, layout.pinned_bytes);
          EXPECT_GE(m.peak_pinned_bytes, layout.offloaded_bytes);
          EXPECT_LE(m.peak_pinned_bytes, layout.pinned_bytes);
          EXPECT_GT(m.peak_by_category[memory::index_of(memory::Category::kStaging)], 0u);
          EXPECT_THAT(m.format(), HasSubstr("offload: "));
          EXPECT_THAT(m.format(), HasSubstr("pinned peak"));
        }
      }
    }
  }
}

TEST(EngineOffloadTest, SlowLinkAndPoisonedFreesStayBitIdentical) {
  const RunResult ref = reference_run(false, 3);
  for (int depth : {0, 1, 2}) {
    for (bool contiguous : {false, true}) {
      const OffloadKnobs k{true, depth, contiguous, 0};
      SCOPED_TRACE(name_of(CheckpointPolicy::kFull, k, false));
      config::Config c = offload_config(CheckpointPolicy::kFull, k);
      c.porter.device.sim_link_gbps = 0.5;
      c.porter.device.poison_freed = true;
      memory::DeviceOptions o;
      o.memory_limit_bytes = size_t{256} << 20;
      o.threads = 1;
      o.sim_link_gbps = 0.5;
      auto device = memory::make_device(o);
      auto e = gpt_engine(*device, c);
      EXPECT_EQ(e->link_bytes_per_s(), 0.5e9);
      TraceRecorder trace;
      e->set_trace(&trace);
      expect_same(run_steps(*e, c, 3), ref);
      // The last step's records, and their spans on the copy lanes.
      const StepResult r = e->train_step(batches(c, 3));
      expect_step_counters(*e, r, c.gradient_accumulation_steps);
      EXPECT_GT(r.offload.copy_busy_s, 0.0);
      EXPECT_GE(r.offload.exposed_wait_s, 0.0);
      size_t d2h = 0, h2d = 0, waits = 0;
      for (const TraceSpan& s : trace.spans()) {
        if (s.step != 3) continue;
        if (s.lane == "d2h") {
          ++d2h;
          EXPECT_THAT(s.name, HasSubstr("d2h "));
          ASSERT_EQ(s.args.size(), 1u);
          EXPECT_EQ(s.args[0].first, "bytes");
        }
        if (s.lane == "h2d") ++h2d;
        if (s.category == "wait") ++waits;
      }
      size_t exposed = 0;
      for (const offload::WaitRecord& w : e->last_waits()) exposed += w.exposed_s > 0 ? 1 : 0;
      const size_t entries = e->plan().offload.entries.size();
      EXPECT_EQ(d2h, entries * 2);
      EXPECT_EQ(h2d, e->last_waits().size());
      EXPECT_EQ(waits, exposed);
      // Cumulative statistics sum the steps; reset_peaks clears them.
      EXPECT_EQ(e->offload_stats().d2h_bytes, 4 * r.offload.d2h_bytes);
      e->reset_peaks();
      EXPECT_EQ(e->offload_stats().d2h_bytes, 0u);
    }
  }
}

TEST(EngineOffloadTest, ProfileKeepsEveryStepsRecordsAndBoundarySyncChangesNothing) {
  const RunResult ref = reference_run(false, 3);
  for (bool profile : {false, true}) {
    SCOPED_TRACE(profile ? "profile" : "last step only");
    config::Config c = offload_config(CheckpointPolicy::kFull, {true, 1, false, 0});
    c.activation_checkpointing->profile = profile;
    c.activation_checkpointing->synchronize_checkpoint_boundary = true;
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    expect_same(run_steps(*e, c, 3), ref);
    const checkpoint::OffloadLayout& layout = e->plan().offload;
    size_t read_back = 0;
    for (const checkpoint::StashEntry& x : layout.entries) read_back += x.use_op >= 0 ? 1 : 0;
    const size_t per_step = (layout.entries.size() + read_back) * 2;
    EXPECT_EQ(e->last_copies().size(), profile ? 3 * per_step : per_step);
    // One wait per fetch, and with the boundary synchronised one per D2H copy.
    EXPECT_EQ(e->last_waits().size(), (profile ? 3 : 1) * (read_back + layout.entries.size()) * 2);
    for (const offload::CopyRecord& r : e->last_copies()) {
      EXPECT_TRUE(r.micro_batch == 0 || r.micro_batch == 1);
      EXPECT_LE(r.start, r.end);
    }
  }
}

TEST(EngineOffloadTest, PoisonMakesAReadAfterReleaseVisible) {
  // The negative control of the test above: with poison_freed, memory read after its buffer
  // was released holds 0xFF bytes (NaN in f32), so a stash that let a slot be read after
  // release could not produce bit-identical results.
  for (bool poison : {false, true}) {
    config::Config c = offload_config(CheckpointPolicy::kFull, {});
    c.porter.device.poison_freed = poison;
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    const size_t bytes = 4096;
    const unsigned char* raw = nullptr;
    {
      memory::DeviceBuffer b = e->allocator().allocate(bytes, memory::Category::kWorkspace);
      std::memset(b.data(), 0x11, bytes);
      raw = static_cast<const unsigned char*>(b.data());
    }
    // The block went back to the allocator's cache; its segment is still mapped.
    const size_t ff = static_cast<size_t>(std::count(raw, raw + bytes, 0xFF));
    const size_t kept = static_cast<size_t>(std::count(raw, raw + bytes, 0x11));
    EXPECT_EQ(ff, poison ? bytes : 0u);
    EXPECT_EQ(kept, poison ? 0u : bytes);
    float f;
    std::memcpy(&f, raw, sizeof f);
    EXPECT_EQ(std::isnan(f), poison);
  }
}

TEST(EngineOffloadTest, PinnedLimitBelowThePlanIsAClearErrorBeforeTraining) {
  for (bool contiguous : {false, true}) {
    SCOPED_TRACE(contiguous ? "contiguous" : "slots");
    const OffloadKnobs k{true, 1, contiguous, 0};
    config::Config c = offload_config(CheckpointPolicy::kFull, k);
    size_t needed = 0;
    {
      auto device = cpu_device();
      needed = gpt_engine(*device, c)->plan().offload.pinned_bytes;
    }
    ASSERT_GT(needed, memory::PinnedPool::kGranularity);
    // At construction: the plan needs more than the limit.
    c.porter.device.pinned_limit_bytes = needed - memory::PinnedPool::kGranularity;
    {
      auto device = cpu_device();
      const std::string msg = error_of<OutOfMemoryError>([&] { gpt_engine(*device, c); });
      EXPECT_THAT(msg, HasSubstr("porter.device.pinned_limit"));
      EXPECT_THAT(msg, HasSubstr(format_bytes(needed)));
      EXPECT_THAT(msg, HasSubstr(format_bytes(needed - memory::PinnedPool::kGranularity)));
      EXPECT_EQ(static_cast<memory::CpuDevice&>(*device).pinned_bytes_in_use(), 0u);
    }
    // At set_plan: an engine whose plan fits (the last hold stays on the device) is asked to
    // offload every hold. Nothing new stays allocated and the old plan keeps training.
    OffloadKnobs fits = k;
    fits.keep_last = 1;
    config::Config fc = offload_config(CheckpointPolicy::kFull, fits);
    fc.porter.device.pinned_limit_bytes = needed - memory::PinnedPool::kGranularity;
    auto device = cpu_device();
    auto e = gpt_engine(*device, fc);
    const checkpoint::Plan before = e->plan();
    ASSERT_LE(before.offload.pinned_bytes, *fc.porter.device.pinned_limit_bytes);
    const size_t in_use = e->pinned_pool().stats().in_use_bytes;
    EXPECT_EQ(in_use, contiguous ? before.offload.pinned_bytes : 0u);
    checkpoint::PlanOptions all;
    all.checkpointing = c.porter.checkpointing;
    all.offload = offload_options(c);
    all.offload.link_bytes_per_s = e->link_bytes_per_s();
    const std::string msg =
        error_of<OutOfMemoryError>([&] { e->set_plan(checkpoint::make_plan(all, e->costs())); });
    EXPECT_THAT(msg, HasSubstr("porter.device.pinned_limit"));
    EXPECT_EQ(e->pinned_pool().stats().in_use_bytes, in_use);
    EXPECT_EQ(e->plan().offload, before.offload);
    const RunResult ref = reference_run(false, 2);
    expect_same(run_steps(*e, fc, 2), ref);
  }
}

// The engine's stash runs the config's contiguous_memory_optimization; a plan made under the
// other one is refused by set_plan, and the old plan, its arenas and its training stay.
TEST(EngineOffloadTest, APlanOfTheOtherContiguityIsRefusedAndTheOldPlanStays) {
  const RunResult ref = reference_run(false, 2);
  for (bool contiguous : {false, true}) {
    SCOPED_TRACE(contiguous ? "contiguous engine" : "slots engine");
    const config::Config c = offload_config(CheckpointPolicy::kFull, {true, 1, contiguous, 0});
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    const checkpoint::Plan before = e->plan();
    ASSERT_FALSE(before.offload.empty());
    EXPECT_EQ(before.offload.contiguous, contiguous);
    const size_t requested = e->allocator().stats().requested_bytes;
    const size_t pinned = e->pinned_pool().stats().in_use_bytes;
    checkpoint::PlanOptions other;
    other.checkpointing = c.porter.checkpointing;
    other.offload = offload_options(c);
    other.offload.link_bytes_per_s = e->link_bytes_per_s();
    other.offload.contiguous = !contiguous;
    const checkpoint::Plan plan = checkpoint::make_plan(other, e->costs());
    ASSERT_EQ(plan.offload.contiguous, !contiguous);
    const std::string msg = error_of<InvalidArgument>([&] { e->set_plan(plan); });
    auto name = [](bool b) { return std::string(b ? "true" : "false"); };
    EXPECT_THAT(msg, HasSubstr("activation_checkpointing.contiguous_memory_optimization = " +
                               name(!contiguous) + " but the stash runs with " + name(contiguous)));
    EXPECT_THAT(msg, HasSubstr("plan with the engine's offload options"));
    EXPECT_EQ(e->plan().schedule, before.schedule);
    EXPECT_EQ(e->plan().offload, before.offload);
    EXPECT_EQ(e->allocator().stats().requested_bytes, requested);
    EXPECT_EQ(e->pinned_pool().stats().in_use_bytes, pinned);
    expect_same(run_steps(*e, c, 2), ref);
  }
}

TEST(EngineOffloadTest, TwoHundredStepsReturnToTheBaselineEveryStep) {
  for (bool contiguous : {false, true}) {
    SCOPED_TRACE(contiguous ? "contiguous" : "slots");
    config::Config c = offload_config(CheckpointPolicy::kFull, {true, 1, contiguous, 0});
    c.porter.model.layers = 2;
    c.porter.model.hidden = 16;
    c.porter.model.heads = 2;
    c.porter.model.seq_len = 8;
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    ASSERT_FALSE(e->plan().offload.empty());
    const size_t requested = e->allocator().stats().requested_bytes;
    const size_t pinned = e->pinned_pool().stats().in_use_bytes;
    const size_t device_pinned = static_cast<memory::CpuDevice&>(*device).pinned_bytes_in_use();
    const size_t micro_batches = static_cast<size_t>(c.gradient_accumulation_steps);
    for (int s = 0; s < 200; ++s) {
      const StepResult r = e->train_step(batches(c, s));
      ASSERT_EQ(e->allocator().stats().requested_bytes, requested) << "step " << s;
      ASSERT_EQ(e->pinned_pool().stats().in_use_bytes, pinned) << "step " << s;
      ASSERT_EQ(r.offload.d2h_bytes, 2 * e->plan().offload.offloaded_bytes) << "step " << s;
    }
    // The pool reuses its buffers: the device was never asked for more pinned memory than
    // one step's worth (a micro-batch may start before the last one's slots are collected).
    EXPECT_LE(static_cast<memory::CpuDevice&>(*device).pinned_bytes_in_use(),
              device_pinned + micro_batches * e->plan().offload.pinned_bytes);
    EXPECT_EQ(e->offload_stats().d2h_bytes, 200 * 2 * e->plan().offload.offloaded_bytes);
  }
}

TEST(EngineOffloadTest, OutOfMemoryMidStepLeavesBaselinesAndTheNextStepSucceeds) {
  // A one-segment uniform plan re-forwards all blocks at once; full recomputes one at a time.
  // Both offload every hold. A device between their peaks fails uniform mid-step, after its
  // copies went out.
  OffloadKnobs k{true, 1, false, 0};
  for (bool contiguous : {false, true}) {
    k.contiguous = contiguous;
    SCOPED_TRACE(contiguous ? "contiguous" : "slots");
    config::Config uc = offload_config(CheckpointPolicy::kUniform, k);
    uc.porter.checkpointing.every_n_layers = 3;
    const config::Config fc = offload_config(CheckpointPolicy::kFull, k);
    size_t uniform_peak = 0, full_peak = 0;
    double ref_loss = 0;
    std::vector<float> ref_params;
    SavedState ref_state;
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, uc);
      ASSERT_FALSE(e->plan().offload.empty()) << e->plan().schedule.to_string();
      uniform_peak = e->train_step(batches(uc, 0)).peak_bytes;
    }
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, fc);
      const StepResult r = e->train_step(batches(fc, 0));
      full_peak = r.peak_bytes;
      ref_loss = r.loss;
      ref_params = e->params_host();
      ref_state = saved_state(*e);
    }
    ASSERT_LT(full_peak, uniform_peak);
    auto device = cpu_device((uniform_peak + full_peak) / 2);
    auto e = gpt_engine(*device, uc);
    const std::vector<float> before = e->params_host();
    const size_t requested = e->allocator().stats().requested_bytes;
    const size_t pinned = e->pinned_pool().stats().in_use_bytes;
    for (int attempt = 0; attempt < 2; ++attempt) {
      EXPECT_THROW(e->train_step(batches(uc, 0)), OutOfMemoryError);
      EXPECT_EQ(e->step(), 0);
      EXPECT_TRUE(bitwise_equal(e->params_host(), before));
      EXPECT_EQ(e->allocator().stats().requested_bytes, requested);
      EXPECT_EQ(e->pinned_pool().stats().in_use_bytes, pinned);
    }
    checkpoint::PlanOptions full;
    full.checkpointing = fc.porter.checkpointing;
    full.offload = offload_options(fc);
    full.offload.link_bytes_per_s = e->link_bytes_per_s();
    e->set_plan(checkpoint::make_plan(full, e->costs()));
    // With contiguous the staging arena was resized for the new plan.
    const size_t replanned = e->allocator().stats().requested_bytes;
    if (!contiguous) {
      EXPECT_EQ(replanned, requested);
    }
    const StepResult r = e->train_step(batches(uc, 0));
    expect_step_counters(*e, r, uc.gradient_accumulation_steps);
    EXPECT_EQ(r.loss, ref_loss);
    EXPECT_TRUE(bitwise_equal(e->params_host(), ref_params));
    expect_same_state(saved_state(*e), ref_state, "after the failed steps");
    EXPECT_EQ(e->step(), 1);
    EXPECT_EQ(e->allocator().stats().requested_bytes, replanned);
    EXPECT_EQ(e->pinned_pool().stats().in_use_bytes, e->plan().offload.pinned_bytes * contiguous);
  }
}

TEST(EngineOffloadTest, ResumeAcrossOffloadSettings) {
  // Offload keeps nothing between steps: a state saved with it on resumes with it off, and
  // the reverse, bit-identically to an uninterrupted run.
  const RunResult ref = reference_run(false, 4);
  for (bool save_with_offload : {false, true}) {
    SCOPED_TRACE(save_with_offload ? "saved with offload" : "saved without");
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() /
        ("porter_engine_offload_resume_" + std::to_string(::getpid()) + "_" +
         std::to_string(save_with_offload));
    std::filesystem::remove_all(dir);
    const config::Config saver =
        offload_config(CheckpointPolicy::kFull, {save_with_offload, 1, false, 0});
    const config::Config loader =
        offload_config(CheckpointPolicy::kFull, {!save_with_offload, 1, false, 0});
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, saver);
      for (int s = 0; s < 2; ++s) e->train_step(batches(saver, s));
      e->save_checkpoint(dir);
    }
    auto device = cpu_device();
    auto e = gpt_engine(*device, loader);
    e->load_checkpoint(dir);
    std::vector<double> losses = {ref.losses[0], ref.losses[1]};
    for (int s = 2; s < 4; ++s) losses.push_back(e->train_step(batches(loader, s)).loss);
    EXPECT_EQ(losses, ref.losses);
    EXPECT_TRUE(bitwise_equal(e->params_host(), ref.params));
    expect_same_state(saved_state(*e), ref.state, "resumed");
    std::filesystem::remove_all(dir);
  }
}

// At tensor_parallel 1 there is no group to partition over: partition_activations changes
// nothing (the parser warns that it has no effect).
TEST(EngineOffloadTest, PartitionActivationsAtOneRankHasNoEffect) {
  config::Config c = offload_config(CheckpointPolicy::kFull, {});
  config::Config p = c;
  p.activation_checkpointing->partition_activations = true;
  auto device = cpu_device();
  auto a = gpt_engine(*device, c);
  auto b = gpt_engine(*device, p);
  EXPECT_EQ(a->plan().schedule, b->plan().schedule);
  EXPECT_FALSE(b->plan().offload.any_partitioned());
  for (int64_t s = 0; s < 2; ++s) {
    EXPECT_EQ(a->train_step(batches(c, s)).loss, b->train_step(batches(p, s)).loss);
  }
  EXPECT_TRUE(bitwise_equal(a->params_host(), b->params_host()));
  expect_same_state(saved_state(*b), saved_state(*a), "partition_activations");
}

}  // namespace
}  // namespace porter::engine
