// porter::engine::DeviceModel: the figures a training step is timed with when it is planned
// away from its hardware (a named GPU's published figures, or the cpu device's measured on
// this machine), and the roofline that turns the analytic model's FLOPs and bytes into
// per-stage seconds. docs/planning.md describes both.
//
// Note [Device models]
// The analytic model (models/analytic.h) gives every stage's bytes exactly and its forward
// FLOPs, but no times; measured times need the hardware. A device model is the few figures
// that turn one into the other: the dense peak per compute dtype, the device memory's
// bandwidth, the device <-> host link and the collectives' bus, each direction, and the
// memory. Where they come from, in order (resolve_device_model):
//   1. porter.device.model names a GPU: its datasheet figures (device_model.cc cites them).
//      This plans a cuda run from any machine.
//   2. else, on the cpu device: this machine's, measured at start through porter's own
//      kernels (calibrate_cpu_device, Note [Cpu calibration] in device_model.cc).
//   3. else (cuda without a model) an error naming porter.device.model: porter does not read
//      a GPU's figures from the driver.
// Then each override replaces one figure: porter.device.peak_tflops the peak at the run's
// compute dtype, hbm_gbps, host_link_gbps and interconnect_gbps their bandwidths (GB/s are
// 1e9 bytes/s). A GPU without NVLink (l40s) has no interconnect figure: its collectives run
// over PCIe, the host link (collective_bytes_per_s).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/costs.h"
#include "config/config.h"
#include "memory/device.h"
#include "tensor/dtype.h"

namespace porter::engine {

struct DeviceModel {
  std::string name;                      // "h100-sxm", or "cpu" for the measured cpu device
  double bf16_flops_per_s = 0.0;         // dense (no sparsity) peak of each compute dtype
  double fp16_flops_per_s = 0.0;
  double f32_flops_per_s = 0.0;          // plain FP32, not tensor-core TF32
  double tf32_flops_per_s = 0.0;         // dense tensor-core TF32; 0: none (cpu)
  double hbm_bytes_per_s = 0.0;          // device memory, reads + writes
  double host_link_bytes_per_s = 0.0;    // device <-> host, each direction (PCIe)
  double interconnect_bytes_per_s = 0.0; // intra-node collective bus, each direction; 0: none
  size_t memory_bytes = 0;               // device memory capacity
  // Where the figures come from: "datasheet", "measured", with ", overridden: <keys>".
  std::string source;

  // The dense peak porter's matmuls run at in `dtype` (f32 runs without TF32).
  double peak_flops_per_s(tensor::DType dtype) const;
  // The collectives' bus: the interconnect, else the host link (PCIe peer to peer).
  double collective_bytes_per_s() const {
    return interconnect_bytes_per_s > 0.0 ? interconnect_bytes_per_s : host_link_bytes_per_s;
  }
  nlohmann::ordered_json to_json() const;
  bool operator==(const DeviceModel&) const = default;
};

// The datasheet figures of a named GPU (Note [Device models]).
DeviceModel gpu_device_model(config::GpuModel model);
// Every named GPU, in porter.device.model's order.
std::vector<DeviceModel> named_device_models();

// porter.device.peak_tflops, hbm_gbps, host_link_gbps and interconnect_gbps.
struct DeviceModelOverrides {
  std::optional<double> peak_tflops;        // at the run's compute dtype
  std::optional<double> hbm_gbps;
  std::optional<double> host_link_gbps;
  std::optional<double> interconnect_gbps;
  bool empty() const {
    return !peak_tflops && !hbm_gbps && !host_link_gbps && !interconnect_gbps;
  }
  bool operator==(const DeviceModelOverrides&) const = default;
};

// What the config says about the device model (RunOptions::device_model).
struct DeviceModelOptions {
  std::optional<config::GpuModel> model;  // porter.device.model; none: the device's own
  DeviceModelOverrides overrides;
  bool operator==(const DeviceModelOptions&) const = default;
};
DeviceModelOptions device_model_options(const config::DeviceConfig& device);

// `m` with each given override in place; the peak override replaces `compute_dtype`'s.
DeviceModel with_overrides(DeviceModel m, const DeviceModelOverrides& overrides,
                           tensor::DType compute_dtype);

// The cpu device's measurement (Note [Cpu calibration] in device_model.cc).
struct CpuCalibrationOptions {
  int64_t matmul_dim = 1024;     // square matmuls of this size (above the kernel thresholds)
  int repeats = 3;               // best of
  size_t copy_bytes = size_t{32} << 20;  // the memory-bandwidth copy (beyond the caches)
  double link_bytes_per_s = 0.0; // the host link: porter.device.sim_link_gbps; 0: the copy's
};
// This machine's figures, measured on `device` (the cpu device); memory_bytes is its
// capacity. Throws InvalidArgument for another device.
DeviceModel calibrate_cpu_device(memory::Device& device, const CpuCalibrationOptions& options = {});
// Bytes per second of a parallel host memcpy of `bytes` on `threads` threads (reads + writes),
// best of `repeats`: the host memory's bandwidth.
double measure_host_copy_bytes_per_s(size_t bytes, int threads, int repeats = 3);

// Note [Device models]: the named GPU's figures, or those `calibrate` gives for the cpu
// device (called only then), then the overrides. Throws InvalidArgument naming
// porter.device.model for a cuda device without one.
template <typename Calibrate>
DeviceModel resolve_device_model(const DeviceModelOptions& options, memory::DeviceKind kind,
                                 tensor::DType compute_dtype, Calibrate&& calibrate);

// Note [Roofline times]: `costs` (the analytic model's: FLOPs and bytes, no times) with every
// stage's forward, recompute and backward seconds predicted on `device` at `compute_dtype`,
// and source device_model_source(device.name), so that ChainCosts::has_times() holds.
checkpoint::ChainCosts roofline_costs(const checkpoint::ChainCosts& costs, const DeviceModel& device,
                                      tensor::DType compute_dtype);
// "device model <name>"
std::string device_model_source(std::string_view name);

// ---- implementation -------------------------------------------------------------------

[[noreturn]] void throw_no_device_model();

template <typename Calibrate>
DeviceModel resolve_device_model(const DeviceModelOptions& options, memory::DeviceKind kind,
                                 tensor::DType compute_dtype, Calibrate&& calibrate) {
  DeviceModel m;
  if (options.model) {
    m = gpu_device_model(*options.model);
  } else if (kind == memory::DeviceKind::kCpu) {
    m = calibrate();
  } else {
    throw_no_device_model();
  }
  return with_overrides(std::move(m), options.overrides, compute_dtype);
}

}  // namespace porter::engine
