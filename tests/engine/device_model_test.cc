// Device models (engine/device_model.h): the named GPUs and overrides from the config to
// RunOptions, the refusals, the roofline's scaling, and the cpu device's calibration.
#include "engine/device_model.h"

#include <chrono>
#include <cstdio>
#include <limits>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "checkpoint/planner.h"
#include "config/parse.h"
#include "engine/run_options.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;

nlohmann::json base_json() {
  return nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "bf16": {"enabled": true},
    "porter": {
      "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128},
      "device": {"type": "cpu"}
    }
  })");
}

RunOptions options_with_device(const nlohmann::json& device_patch) {
  nlohmann::json j = base_json();
  j["porter"]["device"].merge_patch(device_patch);
  return make_run_options(config::parse_config_string(j.dump()).config);
}

DeviceModel resolve_named(const RunOptions& run) {
  return resolve_device_model(run.device_model, run.device.kind, run.compute_dtype, []() -> DeviceModel {
    ADD_FAILURE() << "a named model must not calibrate the cpu device";
    return {};
  });
}

TEST(DeviceModel, EveryNamedGpuParsesAndReachesRunOptions) {
  const std::vector<DeviceModel> named = named_device_models();
  ASSERT_EQ(named.size(), 4u);
  for (const DeviceModel& want : named) {
    const RunOptions run = options_with_device({{"model", want.name}});
    ASSERT_TRUE(run.device_model.model.has_value()) << want.name;
    EXPECT_EQ(config::to_string(*run.device_model.model), want.name);
    EXPECT_TRUE(run.device_model.overrides.empty());
    EXPECT_EQ(run.to_json()["device_model"]["model"], want.name);
    EXPECT_EQ(resolve_named(run), want) << want.name;
    // Printed back by the config, and read again to the same model.
    nlohmann::json j = base_json();
    j["porter"]["device"]["model"] = want.name;
    const config::Config c = config::parse_config_string(j.dump()).config;
    EXPECT_EQ(config::to_json(c)["porter"]["device"]["model"], want.name);
  }
  // Without the key nothing is printed (the printed config of every existing run is unchanged).
  const config::Config plain = config::parse_config_string(base_json().dump()).config;
  EXPECT_FALSE(config::to_json(plain)["porter"]["device"].contains("model"));
  EXPECT_FALSE(config::to_json(plain)["porter"]["device"].contains("peak_tflops"));
}

TEST(DeviceModel, DatasheetFigures) {
  const DeviceModel h100 = gpu_device_model(config::GpuModel::kH100Sxm);
  EXPECT_DOUBLE_EQ(h100.bf16_flops_per_s, 989.5e12);
  EXPECT_DOUBLE_EQ(h100.fp16_flops_per_s, 989.5e12);
  EXPECT_DOUBLE_EQ(h100.f32_flops_per_s, 67e12);
  EXPECT_DOUBLE_EQ(h100.hbm_bytes_per_s, 3.35e12);
  EXPECT_DOUBLE_EQ(h100.host_link_bytes_per_s, 64e9);
  EXPECT_DOUBLE_EQ(h100.interconnect_bytes_per_s, 450e9);
  EXPECT_EQ(h100.memory_bytes, size_t{80} << 30);
  EXPECT_DOUBLE_EQ(h100.peak_flops_per_s(tensor::DType::kF32), 67e12);
  const DeviceModel h200 = gpu_device_model(config::GpuModel::kH200);
  EXPECT_DOUBLE_EQ(h200.bf16_flops_per_s, h100.bf16_flops_per_s);
  EXPECT_DOUBLE_EQ(h200.hbm_bytes_per_s, 4.8e12);
  EXPECT_EQ(h200.memory_bytes, size_t{141} << 30);
  const DeviceModel a100 = gpu_device_model(config::GpuModel::kA100_80gb);
  EXPECT_DOUBLE_EQ(a100.bf16_flops_per_s, 312e12);
  EXPECT_DOUBLE_EQ(a100.f32_flops_per_s, 19.5e12);
  EXPECT_DOUBLE_EQ(a100.hbm_bytes_per_s, 2.039e12);
  EXPECT_DOUBLE_EQ(a100.host_link_bytes_per_s, 32e9);
  EXPECT_DOUBLE_EQ(a100.interconnect_bytes_per_s, 300e9);
  // No NVLink: the collectives go over PCIe.
  const DeviceModel l40s = gpu_device_model(config::GpuModel::kL40s);
  EXPECT_DOUBLE_EQ(l40s.bf16_flops_per_s, 362.05e12);
  EXPECT_DOUBLE_EQ(l40s.f32_flops_per_s, 91.6e12);
  EXPECT_DOUBLE_EQ(l40s.hbm_bytes_per_s, 864e9);
  EXPECT_EQ(l40s.interconnect_bytes_per_s, 0.0);
  EXPECT_DOUBLE_EQ(l40s.collective_bytes_per_s(), 32e9);
  EXPECT_EQ(l40s.memory_bytes, size_t{48} << 30);
}

TEST(DeviceModel, OverridesReachRunOptionsAndReplaceTheirFigure) {
  const RunOptions run = options_with_device({{"model", "a100-80gb"},
                                              {"peak_tflops", 250},
                                              {"hbm_gbps", 1500},
                                              {"host_link_gbps", 20},
                                              {"interconnect_gbps", 200}});
  EXPECT_EQ(run.device_model.overrides.peak_tflops, 250.0);
  EXPECT_EQ(run.to_json()["device_model"]["overrides"]["interconnect_gbps"], 200.0);
  const DeviceModel m = resolve_named(run);
  const DeviceModel a100 = gpu_device_model(config::GpuModel::kA100_80gb);
  // The peak at the run's compute dtype (bf16) only.
  EXPECT_DOUBLE_EQ(m.bf16_flops_per_s, 250e12);
  EXPECT_DOUBLE_EQ(m.fp16_flops_per_s, a100.fp16_flops_per_s);
  EXPECT_DOUBLE_EQ(m.f32_flops_per_s, a100.f32_flops_per_s);
  EXPECT_DOUBLE_EQ(m.hbm_bytes_per_s, 1.5e12);
  EXPECT_DOUBLE_EQ(m.host_link_bytes_per_s, 20e9);
  EXPECT_DOUBLE_EQ(m.interconnect_bytes_per_s, 200e9);
  EXPECT_EQ(m.memory_bytes, a100.memory_bytes);
  EXPECT_EQ(m.source, "datasheet, overridden: peak_tflops, hbm_gbps, host_link_gbps, "
                      "interconnect_gbps");
  // In f32 the override replaces the f32 peak.
  const DeviceModel f32 = with_overrides(a100, {.peak_tflops = 10.0}, tensor::DType::kF32);
  EXPECT_DOUBLE_EQ(f32.f32_flops_per_s, 10e12);
  EXPECT_DOUBLE_EQ(f32.bf16_flops_per_s, a100.bf16_flops_per_s);
}

TEST(DeviceModel, UnknownNameIsRefusedNamingTheKeyAndTheKnownNames) {
  nlohmann::json j = base_json();
  j["porter"]["device"]["model"] = "h100";
  try {
    config::parse_config_string(j.dump());
    FAIL() << "an unknown model was accepted";
  } catch (const config::ConfigError& e) {
    EXPECT_EQ(e.path(), "porter.device.model");
    EXPECT_THAT(e.what(), HasSubstr("h100-sxm | h200 | a100-80gb | l40s"));
    EXPECT_THAT(e.what(), HasSubstr("\"h100\""));
  }
  j["porter"]["device"]["model"] = 3;
  EXPECT_THROW(config::parse_config_string(j.dump()), config::ConfigError);
}

TEST(DeviceModel, OverridesOutOfRangeAreRefusedNamingTheKey) {
  for (const char* key : {"peak_tflops", "hbm_gbps", "host_link_gbps", "interconnect_gbps"}) {
    nlohmann::json j = base_json();
    j["porter"]["device"][key] = 0;
    try {
      config::parse_config_string(j.dump());
      ADD_FAILURE() << key << " 0 was accepted";
    } catch (const config::ConfigError& e) {
      EXPECT_EQ(e.path(), std::string("porter.device.") + key);
    }
  }
}

TEST(DeviceModel, CudaWithoutAModelIsRefusedNamingTheKey) {
  try {
    resolve_device_model({}, memory::DeviceKind::kCuda, tensor::DType::kBF16,
                         []() -> DeviceModel { return {}; });
    FAIL() << "a cuda device without a model resolved";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.device.model"));
    EXPECT_THAT(e.what(), HasSubstr("h100-sxm, h200, a100-80gb, l40s"));
  }
}

// A model with the given peak and bandwidth (everything else the H100's).
DeviceModel with(double peak, double hbm) {
  DeviceModel m = gpu_device_model(config::GpuModel::kH100Sxm);
  m.bf16_flops_per_s = peak;
  m.hbm_bytes_per_s = hbm;
  return m;
}

void expect_scaled(const checkpoint::ChainCosts& a, const checkpoint::ChainCosts& b, double k) {
  ASSERT_EQ(a.stages.size(), b.stages.size());
  for (size_t s = 0; s < a.stages.size(); ++s) {
    EXPECT_DOUBLE_EQ(b.stages[s].backward_s, k * a.stages[s].backward_s) << a.stages[s].name;
    for (size_t o = 0; o < a.stages[s].options.size(); ++o) {
      EXPECT_DOUBLE_EQ(b.stages[s].options[o].forward_s, k * a.stages[s].options[o].forward_s);
      EXPECT_DOUBLE_EQ(b.stages[s].options[o].recompute_s, k * a.stages[s].options[o].recompute_s);
    }
  }
}

TEST(DeviceModel, RooflineTimesScaleWithTheBindingFigure) {
  const RunOptions run = options_with_device(nlohmann::json::object());
  const checkpoint::ChainCosts analytic = run.analytic_costs();
  ASSERT_FALSE(analytic.has_times());
  // Compute-bound: bandwidth without limit; doubling the peak halves every time.
  const double unbound = std::numeric_limits<double>::infinity();
  const checkpoint::ChainCosts c1 = roofline_costs(analytic, with(1e12, unbound), tensor::DType::kBF16);
  const checkpoint::ChainCosts c2 = roofline_costs(analytic, with(2e12, unbound), tensor::DType::kBF16);
  expect_scaled(c1, c2, 0.5);
  // Memory-bound: the same with the bandwidth.
  const checkpoint::ChainCosts m1 = roofline_costs(analytic, with(unbound, 1e9), tensor::DType::kBF16);
  const checkpoint::ChainCosts m2 = roofline_costs(analytic, with(unbound, 2e9), tensor::DType::kBF16);
  expect_scaled(m1, m2, 0.5);
  // There the forward moves its input, its tape and its output once.
  for (const checkpoint::StageCost& st : m1.stages) {
    EXPECT_DOUBLE_EQ(st.option(checkpoint::SaveOption::kKeep).forward_s,
                     static_cast<double>(st.input_bytes +
                                         st.option(checkpoint::SaveOption::kKeep).saved_bytes +
                                         st.output_bytes) / 1e9)
        << st.name;
  }
  // The compute-bound times are the FLOPs over the peak exactly; backward is twice forward.
  double recomputed = 0.0;
  for (const checkpoint::StageCost& st : c1.stages) {
    const checkpoint::OptionCost& keep = st.option(checkpoint::SaveOption::kKeep);
    EXPECT_DOUBLE_EQ(keep.forward_s, st.forward_flops / 1e12) << st.name;
    EXPECT_DOUBLE_EQ(st.backward_s, 2.0 * keep.forward_s) << st.name;
    EXPECT_EQ(keep.recompute_s, 0.0);
    const checkpoint::OptionCost& ckpt = st.option(checkpoint::SaveOption::kCheckpoint);
    if (ckpt.available) {
      EXPECT_DOUBLE_EQ(ckpt.recompute_s, ckpt.recompute_flops / 1e12) << st.name;
      recomputed += ckpt.recompute_s;
    }
  }
  EXPECT_GT(recomputed, 0.0);
  // Bytes unchanged; the source names the model and counts as times.
  EXPECT_EQ(c1.stages[1].option(checkpoint::SaveOption::kKeep).saved_bytes,
            analytic.stages[1].option(checkpoint::SaveOption::kKeep).saved_bytes);
  EXPECT_EQ(c1.source, "device model h100-sxm");
  EXPECT_TRUE(c1.has_times());
  // The planner times a plan on them.
  checkpoint::PlanOptions po = run.plan;
  po.checkpointing.policy = config::CheckpointPolicy::kFull;
  const checkpoint::Plan plan = checkpoint::make_plan(po, c1);
  EXPECT_GT(plan.prediction.compute_s, 0.0);
  EXPECT_GT(plan.prediction.recompute_s, 0.0);
}

TEST(DeviceModel, CpuCalibrationMeasuresPositiveFigures) {
  memory::DeviceOptions o;
  o.kind = memory::DeviceKind::kCpu;
  o.memory_limit_bytes = size_t{256} << 20;
  const std::unique_ptr<memory::Device> device = memory::make_device(o);
  auto seconds = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  DeviceModel m;
  const double s = seconds([&] { m = calibrate_cpu_device(*device); });
  const double copy_s = seconds([&] {
    measure_host_copy_bytes_per_s(CpuCalibrationOptions{}.copy_bytes, device->threads());
  });
  std::printf("cpu calibration (%d threads, %.3f s, of which the copies %.3f s): f32 %.1f "
              "GFLOP/s, bf16 %.1f GFLOP/s, memory %.1f GB/s, link %.1f GB/s\n",
              device->threads(), s, copy_s, m.f32_flops_per_s / 1e9, m.bf16_flops_per_s / 1e9,
              m.hbm_bytes_per_s / 1e9, m.host_link_bytes_per_s / 1e9);
  EXPECT_EQ(m.name, "cpu");
  EXPECT_EQ(m.source, "measured");
  EXPECT_GT(m.f32_flops_per_s, 0.0);
  EXPECT_GT(m.bf16_flops_per_s, 0.0);
  EXPECT_EQ(m.fp16_flops_per_s, m.f32_flops_per_s);
  EXPECT_EQ(m.tf32_flops_per_s, 0.0);
  EXPECT_GT(m.hbm_bytes_per_s, 0.0);
  EXPECT_GT(m.host_link_bytes_per_s, 0.0);
  EXPECT_EQ(m.interconnect_bytes_per_s, 0.0);
  EXPECT_EQ(m.memory_bytes, device->memory_capacity_bytes());
  // A configured link is taken as given; a small capacity shrinks the matmuls.
  memory::DeviceOptions small = o;
  small.memory_limit_bytes = size_t{4} << 20;
  const std::unique_ptr<memory::Device> tiny = memory::make_device(small);
  const DeviceModel t = calibrate_cpu_device(
      *tiny, {.matmul_dim = 1024, .repeats = 1, .copy_bytes = size_t{1} << 20,
              .link_bytes_per_s = 2.5e9});
  EXPECT_GT(t.f32_flops_per_s, 0.0);
  EXPECT_EQ(t.host_link_bytes_per_s, 2.5e9);
  EXPECT_EQ(t.memory_bytes, size_t{4} << 20);
}

TEST(DeviceModel, TheCpuDeviceWithoutAModelIsCalibratedThenOverridden) {
  bool calibrated = false;
  const DeviceModel m = resolve_device_model({}, memory::DeviceKind::kCpu, tensor::DType::kF32,
                                             [&] {
                                               calibrated = true;
                                               DeviceModel c;
                                               c.name = "cpu";
                                               c.f32_flops_per_s = 1e9;
                                               c.source = "measured";
                                               return c;
                                             });
  EXPECT_TRUE(calibrated);
  EXPECT_EQ(m.f32_flops_per_s, 1e9);
  const DeviceModel o = resolve_device_model({.overrides = {.peak_tflops = 2.0}},
                                             memory::DeviceKind::kCpu, tensor::DType::kF32,
                                             [] { return DeviceModel{}; });
  EXPECT_EQ(o.f32_flops_per_s, 2e12);
}

}  // namespace
}  // namespace porter::engine
