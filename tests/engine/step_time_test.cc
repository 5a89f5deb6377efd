// A step's predicted time on a device model (engine/step_time.h): the components add up, the
// ring formulas, overlap, tensor parallelism, optimizer offload, MFU and the refusals.
#include "engine/step_time.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "config/parse.h"
#include "engine/stage3.h"
#include "models/factory.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;

struct Planned {
  config::Config config;
  RunOptions run;
  DeviceModel device;
  checkpoint::ChainCosts costs;
  checkpoint::Plan plan;
  StepTimeInputs inputs;
};

// A GPT of 4 blocks on an H100 (bf16), planned on its roofline costs; `patch` is merged into
// the config, which is parsed for `world` ranks.
Planned setup(const nlohmann::json& patch, int world = 4) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "bf16": {"enabled": true},
    "porter": {
      "model": {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 512},
      "device": {"type": "cpu", "model": "h100-sxm"},
      "checkpointing": {"policy": "full"}
    }
  })");
  j.merge_patch(patch);
  Planned s;
  s.config = config::parse_config_string(j.dump(), {world, false}).config;
  s.run = make_run_options(s.config);
  s.device = resolve_device_model(s.run.device_model, s.run.device.kind, s.run.compute_dtype,
                                  []() -> DeviceModel { return {}; });
  s.costs = roofline_costs(s.run.analytic_costs(), s.device, s.run.compute_dtype);
  add_stage3_params(s.costs, s.run);
  s.plan = checkpoint::make_plan(timed_plan_options(s.run, s.device), s.costs);
  s.inputs.dp_size = static_cast<int>(s.config.data_parallel_size());
  s.inputs.param_elems = models::build_model(s.config.porter.model)->layout().total_elems();
  return s;
}

StepTimePrediction predict(const Planned& s) {
  return predict_step_time(s.run, s.device, s.plan, s.costs, s.inputs);
}

void expect_adds_up(const StepTimePrediction& p) {
  EXPECT_DOUBLE_EQ(p.total_s, p.compute_s + p.recompute_s + p.exposed_dp_comm_s +
                                  p.exposed_tp_comm_s + p.exposed_activation_offload_s +
                                  p.exposed_optimizer_offload_s + p.optimizer_s);
  EXPECT_GT(p.mfu, 0.0);
  EXPECT_LE(p.mfu, 1.0);
  EXPECT_DOUBLE_EQ(p.tokens_per_s, static_cast<double>(p.tokens_per_step) / p.total_s);
}

TEST(StepTime, ComponentsAddUpAndMfuIsAFraction) {
  const Planned s = setup({{"zero_optimization", {{"stage", 2}}}});
  const StepTimePrediction p = predict(s);
  expect_adds_up(p);
  EXPECT_EQ(p.device, "h100-sxm");
  EXPECT_EQ(p.micro_batches, 2);
  // compute + recompute is the plan's compute over the step's micro-batches.
  EXPECT_DOUBLE_EQ(p.compute_s + p.recompute_s, 2.0 * s.plan.prediction.compute_s);
  EXPECT_DOUBLE_EQ(p.recompute_s, 2.0 * s.plan.prediction.recompute_s);
  EXPECT_GT(p.recompute_s, 0.0);  // full recomputes every block
  // 4 data-parallel ranks x 2 micro-batches x 4 x 128 tokens.
  EXPECT_EQ(p.tokens_per_step, 4 * 2 * 4 * 128);
  double forward_flops = 0.0;
  for (const checkpoint::StageCost& st : s.costs.stages) forward_flops += st.forward_flops;
  EXPECT_DOUBLE_EQ(p.model_flops, 3.0 * forward_flops * 2.0);
  EXPECT_DOUBLE_EQ(p.mfu, p.model_flops / (p.total_s * 989.5e12));
  // The device AdamW over the rank's shard: 30 bytes an element at 3.35 TB/s.
  EXPECT_DOUBLE_EQ(p.optimizer_s,
                   30.0 * std::ceil(static_cast<double>(s.inputs.param_elems) / 4.0) / 3.35e12);
  // Without recompute nor communication, a compute-bound step is at MFU 1 exactly.
  DeviceModel ideal = s.device;
  ideal.hbm_bytes_per_s = std::numeric_limits<double>::infinity();
  Planned one = setup({{"porter", {{"checkpointing", {{"policy", "none"}}}}}}, 1);
  one.costs = roofline_costs(one.run.analytic_costs(), ideal, one.run.compute_dtype);
  one.plan = checkpoint::make_plan(one.run.plan, one.costs);
  one.device = ideal;
  const StepTimePrediction q = predict(one);
  EXPECT_EQ(q.recompute_s, 0.0);
  EXPECT_EQ(q.exposed_comm_s(), 0.0);
  EXPECT_DOUBLE_EQ(q.mfu, 1.0);
}

TEST(StepTime, RingFormulas) {
  EXPECT_DOUBLE_EQ(ring_all_reduce_s(8e9, 8, 100e9), 2.0 * 7.0 / 8.0 * 8e9 / 100e9);
  EXPECT_DOUBLE_EQ(ring_reduce_scatter_s(8e9, 8, 100e9), 7.0 / 8.0 * 8e9 / 100e9);
  EXPECT_EQ(ring_all_reduce_s(8e9, 1, 100e9), 0.0);
}

TEST(StepTime, ZeroCommunicationPerStage) {
  for (int stage : {0, 1, 2}) {
    const Planned s = setup({{"zero_optimization", {{"stage", stage}, {"overlap_comm", false}}}});
    const StepTimePrediction p = predict(s);
    const double pe = static_cast<double>(s.inputs.param_elems);
    const double bus = 450e9;
    double want = 0.0;
    if (stage == 0) want = ring_all_reduce_s(4.0 * pe, 4, bus);           // once, f32 grads
    if (stage == 1) want = ring_reduce_scatter_s(4.0 * pe, 4, bus) +      // once
                           ring_reduce_scatter_s(2.0 * pe, 4, bus);       // bf16 all-gather
    if (stage == 2) want = 2.0 * ring_reduce_scatter_s(4.0 * pe, 4, bus) +  // per micro-batch
                           ring_reduce_scatter_s(2.0 * pe, 4, bus);
    EXPECT_DOUBLE_EQ(p.dp_comm_s, want) << "stage " << stage;
    // Without overlap_comm the compute waits for all of it.
    EXPECT_DOUBLE_EQ(p.exposed_dp_comm_s, p.dp_comm_s) << "stage " << stage;
    expect_adds_up(p);
  }
  // reduce_scatter false: all-reduces instead.
  const Planned ar = setup({{"zero_optimization",
                           {{"stage", 2}, {"overlap_comm", false}, {"reduce_scatter", false}}}});
  const double pe = static_cast<double>(ar.inputs.param_elems);
  EXPECT_DOUBLE_EQ(predict(ar).dp_comm_s, 2.0 * ring_all_reduce_s(4.0 * pe, 4, 450e9) +
                                              ring_reduce_scatter_s(2.0 * pe, 4, 450e9));
  // One rank communicates nothing.
  EXPECT_EQ(predict(setup({{"zero_optimization", {{"stage", 2}}}}, 1)).dp_comm_s, 0.0);
}

TEST(StepTime, OverlappedReductionIsHiddenUntilItOutlastsTheBackward) {
  // Stage 0: one all-reduce in the last micro-batch, hidden behind its backward when it is
  // shorter (micro-batches of 32 x 128 tokens), and exposed whole without overlap_comm.
  Planned on = setup({{"train_micro_batch_size_per_gpu", 32},
                      {"zero_optimization", {{"stage", 0}, {"overlap_comm", true}}}});
  const StepTimePrediction hidden = predict(on);
  EXPECT_GT(hidden.dp_comm_s, 0.0);
  EXPECT_EQ(hidden.exposed_dp_comm_s, 0.0);
  Planned off = setup({{"train_micro_batch_size_per_gpu", 32},
                       {"zero_optimization", {{"stage", 0}, {"overlap_comm", false}}}});
  const StepTimePrediction exposed = predict(off);
  EXPECT_DOUBLE_EQ(exposed.exposed_dp_comm_s, exposed.dp_comm_s);
  EXPECT_DOUBLE_EQ(exposed.dp_comm_s, hidden.dp_comm_s);
  EXPECT_DOUBLE_EQ(exposed.total_s - hidden.total_s, exposed.dp_comm_s);
  // A slow bus: only what outlasts the backward and recompute shows.
  on.device.interconnect_bytes_per_s = 1e6;
  const StepTimePrediction slow = predict(on);
  double backward = 0.0;
  for (const checkpoint::StageCost& st : on.costs.stages) backward += st.backward_s;
  EXPECT_NEAR(slow.exposed_dp_comm_s,
              slow.dp_comm_s - (backward + on.plan.prediction.recompute_s), 1e-9 * slow.dp_comm_s);
  expect_adds_up(slow);
}

TEST(StepTime, Stage3GathersOverlapTheMicroBatchWithPrefetch) {
  const nlohmann::json z3 = {{"zero_optimization", {{"stage", 3}, {"overlap_comm", false}}}};
  const Planned s = setup(z3);
  ASSERT_GT(s.plan.prediction.params.gathered_bytes, 0u);
  const StepTimePrediction p = predict(s);
  const double gathers = 2.0 * ring_reduce_scatter_s(
                                   static_cast<double>(s.plan.prediction.params.gathered_bytes),
                                   4, 450e9);
  const double reduces =
      2.0 * ring_reduce_scatter_s(4.0 * static_cast<double>(s.inputs.param_elems), 4, 450e9);
  const double refresh = ring_reduce_scatter_s(
      static_cast<double>(s.plan.prediction.params.persistent_bytes), 4, 450e9);
  EXPECT_DOUBLE_EQ(p.dp_comm_s, gathers + reduces + refresh);
  // Prefetched gathers hide behind the compute; the reductions (overlap_comm off) do not.
  EXPECT_DOUBLE_EQ(p.exposed_dp_comm_s, reduces + refresh);
  nlohmann::json no_prefetch = z3;
  no_prefetch["zero_optimization"]["stage3_prefetch_bucket_size"] = 0;
  const StepTimePrediction q = predict(setup(no_prefetch));
  EXPECT_DOUBLE_EQ(q.exposed_dp_comm_s, q.dp_comm_s);
  expect_adds_up(p);
  expect_adds_up(q);
}

TEST(StepTime, TensorParallelAllReducesAreExposed) {
  const Planned s = setup({{"porter", {{"model", {{"tensor_parallel", 2}}}}}}, 2);
  EXPECT_EQ(s.inputs.dp_size, 1);
  const StepTimePrediction p = predict(s);
  // Per micro-batch: 4 blocks x (2 per forward, 2 forwards each under full, + 2 backward),
  // one per forward of the embedding, one for the head's backward; each of a (4, 128, 256)
  // bf16 activation.
  int64_t block_all_reduces = 0;
  for (size_t i = 0; i < s.plan.stages.size(); ++i) {
    block_all_reduces += s.costs.stages[i].is_block ? 2 * s.plan.stages[i].forwards + 2 : 0;
  }
  EXPECT_EQ(block_all_reduces, 4 * (2 * 2 + 2));
  const int64_t all_reduces = block_all_reduces + s.plan.stages.front().forwards + 1;
  const double whole = 4.0 * 128.0 * 256.0 * 2.0;
  EXPECT_DOUBLE_EQ(p.tp_comm_s, 2.0 * static_cast<double>(all_reduces) *
                                    ring_all_reduce_s(whole, 2, 450e9));
  EXPECT_DOUBLE_EQ(p.exposed_tp_comm_s, p.tp_comm_s);
  EXPECT_EQ(p.dp_comm_s, 0.0);
  expect_adds_up(p);
}

TEST(StepTime, OptimizerOffloadChargesTheHostUpdateAndTheCopies) {
  const nlohmann::json off = {
      {"zero_optimization",
       {{"stage", 2}, {"overlap_comm", false}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  Planned s = setup(off);
  s.inputs.host_memory_bytes_per_s = 20e9;
  const StepTimePrediction p = predict(s);
  const double shard = std::ceil(static_cast<double>(s.inputs.param_elems) / 4.0);
  EXPECT_TRUE(p.host_adam_timed);
  EXPECT_DOUBLE_EQ(p.host_adam_s, 30.0 * shard / 20e9);
  // Gradients down (f32) after the backward, the update, the bf16 working copy back up.
  EXPECT_DOUBLE_EQ(p.exposed_optimizer_offload_s,
                   4.0 * shard / 64e9 + p.host_adam_s + 2.0 * shard / 64e9);
  EXPECT_EQ(p.optimizer_s, 0.0);  // nothing is updated on the device
  expect_adds_up(p);
  // Without a host bandwidth the update is untimed, the copies still count.
  s.inputs.host_memory_bytes_per_s = 0.0;
  const StepTimePrediction q = predict(s);
  EXPECT_FALSE(q.host_adam_timed);
  EXPECT_DOUBLE_EQ(q.exposed_optimizer_offload_s, 6.0 * shard / 64e9);
}

TEST(StepTime, ActivationOffloadIsTimedOnTheModelsHostLink) {
  const Planned s = setup({{"activation_checkpointing", {{"cpu_checkpointing", true}}}});
  EXPECT_DOUBLE_EQ(s.plan.sim.link_bytes_per_s, 64e9);
  const StepTimePrediction p = predict(s);
  EXPECT_TRUE(p.offload_timed);
  EXPECT_DOUBLE_EQ(p.exposed_activation_offload_s, 2.0 * s.plan.prediction.offload.exposed_s);
  expect_adds_up(p);
  EXPECT_TRUE(p.to_json()["exposed_activation_offload_s"].is_number());
}

// GPT-2 small (124M), micro-batches of 8 x 1024 tokens, 2 per step, bf16, ZeRO stage 2 with
// overlap_comm over 8 ranks, selective recompute: the same step on each named GPU. The H200
// is the H100 with faster memory, so it is no slower; the A100 has a third of the peak.
TEST(StepTime, Gpt2SmallOnEachNamedGpu) {
  double h100 = 0.0, h200 = 0.0, a100 = 0.0;
  for (const char* gpu : {"h100-sxm", "h200", "a100-80gb", "l40s"}) {
    const Planned s = setup(
        {{"train_micro_batch_size_per_gpu", 8},
         {"zero_optimization", {{"stage", 2}, {"overlap_comm", true}}},
         {"porter",
          {{"model", {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"seq_len", 1024},
                      {"vocab", 50257}}},
           {"device", {{"model", gpu}}},
           {"checkpointing", {{"policy", "selective"}}}}}},
        8);
    const StepTimePrediction p = predict(s);
    expect_adds_up(p);
    std::printf("%-9s step %.1f ms: compute %.1f, recompute %.1f, exposed comm %.2f (of %.2f), "
                "optimizer %.2f; %.0f tokens/s, MFU %.1f%%\n",
                gpu, 1e3 * p.total_s, 1e3 * p.compute_s, 1e3 * p.recompute_s,
                1e3 * p.exposed_comm_s(), 1e3 * p.dp_comm_s, 1e3 * p.optimizer_s, p.tokens_per_s,
                100.0 * p.mfu);
    if (std::string(gpu) == "h100-sxm") h100 = p.total_s;
    if (std::string(gpu) == "h200") h200 = p.total_s;
    if (std::string(gpu) == "a100-80gb") a100 = p.total_s;
  }
  EXPECT_LE(h200, h100);
  EXPECT_GT(a100, h100);
}

TEST(StepTime, CostsWithoutTimesAreRefused) {
  const Planned s = setup(nlohmann::json::object());
  const checkpoint::ChainCosts analytic = s.run.analytic_costs();
  const checkpoint::Plan plan = checkpoint::make_plan(s.run.plan, analytic);
  try {
    predict_step_time(s.run, s.device, plan, analytic, s.inputs);
    FAIL() << "analytic costs were timed";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("analytic"));
  }
}

TEST(StepTime, RunDeviceModelCalibratesTheCpuDevice) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 1,
    "porter": {"model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 8, "vocab": 64},
               "device": {"type": "cpu", "sim_link_gbps": 3, "hbm_gbps": 7}}})");
  const RunOptions run = make_run_options(config::parse_config_string(j.dump()).config);
  const DeviceModel m = run_device_model(run, {.matmul_dim = 256, .repeats = 1,
                                               .copy_bytes = size_t{1} << 20});
  EXPECT_EQ(m.name, "cpu");
  EXPECT_GT(m.f32_flops_per_s, 0.0);
  EXPECT_EQ(m.host_link_bytes_per_s, 3e9);   // sim_link_gbps
  EXPECT_EQ(m.hbm_bytes_per_s, 7e9);         // the override
  EXPECT_EQ(m.source, "measured, overridden: hbm_gbps");
}

}  // namespace
}  // namespace porter::engine
