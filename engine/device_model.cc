// The named GPUs' figures, the cpu device's calibration and the roofline of the analytic
// costs (engine/device_model.h).
#include "engine/device_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::engine {
namespace {

constexpr double kTera = 1e12;
constexpr double kGiga = 1e9;
constexpr size_t kGiB = size_t{1} << 30;

// Note [Datasheet figures]
// NVIDIA's datasheets, dense figures (the tensor-core rows are printed with 2:4 sparsity, "*";
// dense is half). Memory sizes are the datasheets' "GB" read as GiB, as NVIDIA counts HBM
// stacks (the driver reports a little less: ECC and the CUDA context take some). PCIe and
// NVLink are printed as both directions together; a ring collective or a one-way copy moves
// data at half of that each way.
//   - H100 SXM5 80GB ("NVIDIA H100 Tensor Core GPU" datasheet; its table is reproduced at
//     archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html, and the per-dtype peaks at
//     glennklockwood.com/garden/processors/h100): FP32 67 TF, TF32 989 TF* (494.5 dense),
//     BF16 and FP16 1,979 TF* (989.5 dense), 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5
//     128 GB/s.
//   - H200 SXM 141GB ("NVIDIA H200 Tensor Core GPU" datasheet): the H100's GH100 and its
//     compute figures, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
//   - A100 SXM4 80GB (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, as cited by
//     glennklockwood.com/garden/processors/A100): FP32 19.5 TF, TF32 156 TF, BF16 and FP16
//     312 TF, 2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s.
//   - L40S (the "NVIDIA L40S" datasheet; its table is reproduced at
//     mullet.se/product.html?product_id=355414): FP32 91.6 TF, TF32 183 TF (366*), BF16 and
//     FP16 362.05 TF (733*), 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 64 GB/s, no NVLink.
DeviceModel datasheet(std::string name, double bf16_tf, double f32_tf, double tf32_tf,
                      double hbm_gbps, double pcie_both_gbps, double nvlink_both_gbps,
                      size_t memory_gib) {
  DeviceModel m;
  m.name = std::move(name);
  m.bf16_flops_per_s = bf16_tf * kTera;
  m.fp16_flops_per_s = bf16_tf * kTera;
  m.f32_flops_per_s = f32_tf * kTera;
  m.tf32_flops_per_s = tf32_tf * kTera;
  m.hbm_bytes_per_s = hbm_gbps * kGiga;
  m.host_link_bytes_per_s = pcie_both_gbps / 2.0 * kGiga;
  m.interconnect_bytes_per_s = nvlink_both_gbps / 2.0 * kGiga;
  m.memory_bytes = memory_gib * kGiB;
  m.source = "datasheet";
  return m;
}

}  // namespace

double DeviceModel::peak_flops_per_s(tensor::DType dtype) const {
  switch (dtype) {
    case tensor::DType::kBF16: return bf16_flops_per_s;
    case tensor::DType::kF16: return fp16_flops_per_s;
    default: return f32_flops_per_s;
  }
}

nlohmann::ordered_json DeviceModel::to_json() const {
  return {{"name", name},
          {"bf16_flops_per_s", bf16_flops_per_s},
          {"fp16_flops_per_s", fp16_flops_per_s},
          {"f32_flops_per_s", f32_flops_per_s},
          {"tf32_flops_per_s", tf32_flops_per_s},
          {"hbm_bytes_per_s", hbm_bytes_per_s},
          {"host_link_bytes_per_s", host_link_bytes_per_s},
          {"interconnect_bytes_per_s", interconnect_bytes_per_s},
          {"memory_bytes", memory_bytes},
          {"source", source}};
}

DeviceModel gpu_device_model(config::GpuModel model) {
  // Note [Datasheet figures].
  switch (model) {
    case config::GpuModel::kH100Sxm:
      return datasheet("h100-sxm", 989.5, 67.0, 494.5, 3350.0, 128.0, 900.0, 80);
    case config::GpuModel::kH200:
      return datasheet("h200", 989.5, 67.0, 494.5, 4800.0, 128.0, 900.0, 141);
    case config::GpuModel::kA100_80gb:
      return datasheet("a100-80gb", 312.0, 19.5, 156.0, 2039.0, 64.0, 600.0, 80);
    case config::GpuModel::kL40s:
      return datasheet("l40s", 362.05, 91.6, 183.0, 864.0, 64.0, 0.0, 48);
  }
  PORTER_ASSERT(false, "a config::GpuModel without figures");
  return {};
}

std::vector<DeviceModel> named_device_models() {
  return {gpu_device_model(config::GpuModel::kH100Sxm), gpu_device_model(config::GpuModel::kH200),
          gpu_device_model(config::GpuModel::kA100_80gb),
          gpu_device_model(config::GpuModel::kL40s)};
}

DeviceModelOptions device_model_options(const config::DeviceConfig& d) {
  DeviceModelOptions o;
  o.model = d.model;
  o.overrides.peak_tflops = d.peak_tflops;
  o.overrides.hbm_gbps = d.hbm_gbps;
  o.overrides.host_link_gbps = d.host_link_gbps;
  o.overrides.interconnect_gbps = d.interconnect_gbps;
  return o;
}

DeviceModel with_overrides(DeviceModel m, const DeviceModelOverrides& o,
                           tensor::DType compute_dtype) {
  std::string keys;
  auto note = [&keys](const char* key) { keys += (keys.empty() ? "" : ", ") + std::string(key); };
  if (o.peak_tflops) {
    const double v = *o.peak_tflops * kTera;
    switch (compute_dtype) {
      case tensor::DType::kBF16: m.bf16_flops_per_s = v; break;
      case tensor::DType::kF16: m.fp16_flops_per_s = v; break;
      default: m.f32_flops_per_s = v; break;
    }
    note("peak_tflops");
  }
  if (o.hbm_gbps) {
    m.hbm_bytes_per_s = *o.hbm_gbps * kGiga;
    note("hbm_gbps");
  }
  if (o.host_link_gbps) {
    m.host_link_bytes_per_s = *o.host_link_gbps * kGiga;
    note("host_link_gbps");
  }
  if (o.interconnect_gbps) {
    m.interconnect_bytes_per_s = *o.interconnect_gbps * kGiga;
    note("interconnect_gbps");
  }
  if (!keys.empty()) m.source += ", overridden: " + keys;
  return m;
}

void throw_no_device_model() {
  std::string names;
  for (const DeviceModel& m : named_device_models()) {
    names += (names.empty() ? "" : ", ") + m.name;
  }
  throw InvalidArgument(
      "porter.device.model: none, on the cuda device: porter does not read a GPU's figures "
      "from the driver; name the GPU to time the run with (one of " + names + ")");
}

// Note [Cpu calibration]
// The cpu device's figures are measured, not looked up: 0.6 s on a 2-core AMD EPYC shared
// with builds, most of it the matmuls' first calls, which choose their layouts by timing.
// Each figure is the best of `repeats`, so that a busy moment on a shared machine
// understates it less:
//   - f32 and bf16 peaks: square matmuls through porter's own cpu kernels (kernels::Kernels
//     on this device, with its thread count), at matmul_dim (1024 by default: 2.1 GFLOP, far
//     above the size under which the matmul stops choosing its layout by timing, Note [Matmul
//     weight layout] in kernels/cpu/matmul.cc). The first call of each dtype also pays that
//     choice and is not timed. fp16 on the cpu is widened to f32 copies before it is
//     multiplied (Note [Cpu f16 matmul]), so its figure is the f32 one (the widening's extra
//     traffic is not charged); there is no TF32.
//   - hbm_bytes_per_s: the "device memory" is host memory, so this is a parallel memcpy of
//     copy_bytes (32 MiB, beyond the caches) on the device's threads, counted as reads +
//     writes (2 x bytes / time), which is how a roofline's bytes are counted.
//   - host_link_bytes_per_s: porter.device.sim_link_gbps when set (the copy streams are
//     throttled to it); else the cpu device's copy streams are plain memcpys on one worker
//     thread each, so the one-thread copy's one-way rate (bytes / time). The engine's link
//     probe (Note [Link probe] in offload/link_probe.h) measures the same copies on the
//     stash's streams, which need an engine.
//   - interconnect_bytes_per_s: 0 (none): ranks of the cpu device talk through Gloo over
//     loopback TCP, which this does not measure; collectives are then charged at the host
//     link (collective_bytes_per_s).
//   - memory_bytes: the device's capacity (porter.device.memory_limit, 8 GiB by default).
// The matmul operands are shrunk (halving the dimension, 128 at least) until they take at
// most a quarter of the device's capacity, so a small memory_limit still calibrates.
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double matmul_flops_per_s(memory::Device& device, kernels::Kernels& k, int64_t dim,
                          tensor::DType dtype, int repeats) {
  memory::CachingAllocator& alloc = k.workspace_allocator();
  const tensor::Shape shape{dim, dim};
  tensor::Tensor a = tensor::Tensor::empty(alloc, shape, dtype, memory::Category::kWorkspace);
  tensor::Tensor b = tensor::Tensor::empty(alloc, shape, dtype, memory::Category::kWorkspace);
  tensor::Tensor out = tensor::Tensor::empty(alloc, shape, dtype, memory::Category::kWorkspace);
  // Small values of either dtype's bit pattern: 0x3C00 is 1.0 in f16, 0x3C00xxxx ~0.0078 in
  // f32 and bf16; no denormals, no overflow over dim products.
  std::memset(a.data(), 0x3C, a.nbytes());
  std::memset(b.data(), 0x3C, b.nbytes());
  k.matmul(a, b, out);  // the layout choice and oneDNN's primitive creation: not timed
  device.compute_stream().synchronize();
  double best = 0.0;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    const Clock::time_point t0 = Clock::now();
    k.matmul(a, b, out);
    device.compute_stream().synchronize();
    const double s = seconds_since(t0);
    if (s > 0.0) best = std::max(best, 2.0 * static_cast<double>(dim * dim * dim) / s);
  }
  return best;
}

}  // namespace

namespace {

// Best-of-`repeats` rates (reads + writes per second) of a memcpy of `bytes` split over
// `threads` threads, for each thread count in `thread_counts`, on one pair of buffers (their
// pages are touched once, before any timing).
std::vector<double> host_copy_rates(size_t bytes, const std::vector<int>& thread_counts,
                                    int repeats) {
  std::vector<double> rates(thread_counts.size(), 0.0);
  if (bytes == 0) return rates;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (size_t i = 0; i < thread_counts.size(); ++i) {
    const size_t threads = static_cast<size_t>(std::max(1, thread_counts[i]));
    const size_t part = (bytes + threads - 1) / threads;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      const Clock::time_point t0 = Clock::now();
      std::vector<std::thread> pool;
      for (size_t t = 1; t < threads; ++t) {
        const size_t begin = std::min(bytes, part * t);
        const size_t n = std::min(bytes, begin + part) - begin;
        pool.emplace_back(
            [&, begin, n] { std::memcpy(dst.data() + begin, src.data() + begin, n); });
      }
      std::memcpy(dst.data(), src.data(), std::min(part, bytes));
      for (std::thread& th : pool) th.join();
      const double s = seconds_since(t0);
      if (s > 0.0) rates[i] = std::max(rates[i], 2.0 * static_cast<double>(bytes) / s);
    }
  }
  return rates;
}

}  // namespace

double measure_host_copy_bytes_per_s(size_t bytes, int threads, int repeats) {
  return host_copy_rates(bytes, {threads}, repeats)[0];
}

DeviceModel calibrate_cpu_device(memory::Device& device, const CpuCalibrationOptions& o) {
  if (device.kind() != memory::DeviceKind::kCpu) {
    throw InvalidArgument("calibrate_cpu_device: " + device.description() +
                          " is not the cpu device; a GPU is timed with porter.device.model");
  }
  PORTER_CHECK(o.matmul_dim >= 1, "matmul_dim ", o.matmul_dim, " must be >= 1");
  int64_t dim = o.matmul_dim;
  // Three f32 operands within a quarter of the capacity.
  while (dim > 128 && static_cast<size_t>(3 * dim * dim * 4) > device.memory_capacity_bytes() / 4) {
    dim /= 2;
  }
  DeviceModel m;
  m.name = "cpu";
  {
    const std::unique_ptr<kernels::Kernels> k = kernels::make_kernels(device);
    m.f32_flops_per_s = matmul_flops_per_s(device, *k, dim, tensor::DType::kF32, o.repeats);
    m.bf16_flops_per_s = matmul_flops_per_s(device, *k, dim, tensor::DType::kBF16, o.repeats);
  }
  m.fp16_flops_per_s = m.f32_flops_per_s;
  const bool link_given = o.link_bytes_per_s > 0.0;
  const std::vector<double> rates =
      host_copy_rates(o.copy_bytes, link_given ? std::vector<int>{device.threads()}
                                               : std::vector<int>{device.threads(), 1},
                      o.repeats);
  m.hbm_bytes_per_s = rates[0];
  m.host_link_bytes_per_s = link_given ? o.link_bytes_per_s : rates[1] / 2.0;
  m.memory_bytes = device.memory_capacity_bytes();
  m.source = "measured";
  return m;
}

// Note [Roofline times]
// A stage's time on a device model is the roofline's: max(FLOPs / peak, bytes / bandwidth),
// the larger of the time its arithmetic needs at the dense peak of the compute dtype and
// the time its memory traffic needs at the device memory's bandwidth. Both are lower bounds
// (no kernel reaches the peak; launch and synchronisation costs are not charged), so the
// predicted time is a floor, reached by large, matmul-bound stages more closely than by
// small ones. The bytes are the stage's activation traffic from the analytic model (Note
// [Activation bytes] in checkpoint/costs.h), each tensor written once and read once:
//   forward    FLOPs forward_flops; bytes input_bytes + the keep option's saved_bytes (every
//              intermediate it produces) + output_bytes. Every available option's forward
//              runs the same ops, so has the same time.
//   recompute  FLOPs the option's recompute_flops; bytes input_bytes + the option's
//              recompute_saved_bytes (what it writes back to the tape).
//   backward   twice the forward, in FLOPs (an input and a weight gradient per product)
//              and bytes (it reads the tape and the output gradient and writes the input's
//              and the intermediates' gradients): 2 x the forward's time.
// Weights are not in the bytes: they are read once per matmul and are few next to the
// activations at the batch sizes training runs; the model's FLOPs dominate there anyway.
namespace {

double roofline_s(double flops, double bytes, double peak, double bandwidth) {
  const double compute = peak > 0.0 ? flops / peak : 0.0;
  const double memory = bandwidth > 0.0 ? bytes / bandwidth : 0.0;
  return std::max(compute, memory);
}

}  // namespace

std::string device_model_source(std::string_view name) {
  return std::string(checkpoint::kDeviceModelSourcePrefix) + std::string(name);
}

checkpoint::ChainCosts roofline_costs(const checkpoint::ChainCosts& costs, const DeviceModel& device,
                                      tensor::DType compute_dtype) {
  using checkpoint::OptionCost;
  using checkpoint::SaveOption;
  const double peak = device.peak_flops_per_s(compute_dtype);
  const double bw = device.hbm_bytes_per_s;
  PORTER_CHECK(peak > 0.0 && bw > 0.0, "device model ", device.name,
               ": its peak and memory bandwidth must be > 0 to time a stage");
  checkpoint::ChainCosts out = costs;
  for (checkpoint::StageCost& st : out.stages) {
    const double forward_bytes = static_cast<double>(
        st.input_bytes + st.option(SaveOption::kKeep).saved_bytes + st.output_bytes);
    const double forward_s = roofline_s(st.forward_flops, forward_bytes, peak, bw);
    st.backward_s = 2.0 * forward_s;
    for (OptionCost& c : st.options) {
      if (!c.available) continue;
      c.forward_s = forward_s;
      c.recompute_s = 0.0;
    }
    for (SaveOption o : {SaveOption::kSelective, SaveOption::kCheckpoint}) {
      OptionCost& c = st.option(o);
      if (!c.available) continue;
      c.recompute_s = roofline_s(c.recompute_flops,
                                 static_cast<double>(st.input_bytes + c.recompute_saved_bytes),
                                 peak, bw);
    }
  }
  out.source = device_model_source(device.name);
  return out;
}

}  // namespace porter::engine
