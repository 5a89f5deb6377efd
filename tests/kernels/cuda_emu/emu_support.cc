// EMULATION ONLY: a "cuda" device that is a cpu device reporting kind kCuda, cuBLASLt
// emulated by its column-major definition with the operand mapping of kernels/cuda/matmul.cc, and
// stubs for the few runtime calls the kernels make.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "memory/cpu_device.h"
#include "memory/device.h"
#include "kernels/cuda/matmul.h"
#include "tensor/dtype.h"

extern "C" {
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "emu"; }
const char* cudaGetErrorString(cudaError_t) { return "emu"; }
}

namespace porter::memory {
namespace {
class FakeCuda final : public Device {
 public:
  explicit FakeCuda(const DeviceOptions& o) {
    DeviceOptions c = o;
    c.kind = DeviceKind::kCpu;
    c.threads = 2;
    cpu_ = std::make_unique<CpuDevice>(c);
  }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int index() const override { return 0; }
  std::string description() const override { return "emulated cuda"; }
  bool host_accessible() const override { return true; }
  size_t memory_capacity_bytes() const override { return cpu_->memory_capacity_bytes(); }
  size_t segment_alignment() const override { return cpu_->segment_alignment(); }
  void* allocate_segment(size_t b) override { return cpu_->allocate_segment(b); }
  void free_segment(void* p, size_t b) override { cpu_->free_segment(p, b); }
  size_t pinned_capacity_bytes() const override { return cpu_->pinned_capacity_bytes(); }
  void* allocate_pinned(size_t b) override { return cpu_->allocate_pinned(b); }
  void free_pinned(void* p, size_t b) override { cpu_->free_pinned(p, b); }
  Stream& compute_stream() override { return cpu_->compute_stream(); }
  std::unique_ptr<Stream> create_stream(std::string n) override { return cpu_->create_stream(n); }
  std::unique_ptr<Event> create_event() override { return cpu_->create_event(); }
  int threads() const override { return 1; }

 private:
  std::unique_ptr<CpuDevice> cpu_;
};
}  // namespace

std::string_view device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCpu ? "cpu" : "cuda"; }
bool cuda_available() { return true; }
std::unique_ptr<Device> make_device(const DeviceOptions& o) {
  if (o.kind == DeviceKind::kCpu) return std::make_unique<CpuDevice>(o);
  return std::make_unique<FakeCuda>(o);
}
}  // namespace porter::memory

namespace porter::kernels::cuda {
struct CublasLtMatmul::Handle {};
struct CublasLtMatmul::Plan {};
CublasLtMatmul::CublasLtMatmul(memory::Device& device) : device_(device) {}
CublasLtMatmul::~CublasLtMatmul() = default;

static float ldv(const void* p, DType t, int64_t i) {
  if (t == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  if (t == DType::kF16) return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  throw std::runtime_error("emu gemm dtype");
}
static void stv(void* p, DType t, int64_t i, float v) {
  if (t == DType::kBF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else if (t == DType::kF16) static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
  else static_cast<float*>(p)[i] = v;
}

// cuBLASLt semantics, column-major: D (m' x n') = alpha opA(A) opB(B) + beta C, with the
// descriptors plan_for() builds: A = our b, B = our a, m' = n, n' = m.
void CublasLtMatmul::run(const GemmArgs& g, cudaStream_t) {
  const int64_t mm = g.n, nn = g.m, kk = g.k;
  const bool opA_t = g.trans_b, opB_t = g.trans_a;
  const int64_t ldA = g.trans_b ? g.k : g.n;  // rows of stored A
  const int64_t ldB = g.trans_a ? g.m : g.k;
  const int64_t ldD = g.n;
  for (int64_t bt = 0; bt < g.batch; ++bt) {
    const char* A = static_cast<const char*>(g.b) + bt * g.stride_b * dtype_size(g.ab_dtype);
    const char* B = static_cast<const char*>(g.a) + bt * g.stride_a * dtype_size(g.ab_dtype);
    char* D = static_cast<char*>(g.out) + bt * g.stride_out * dtype_size(g.out_dtype);
    for (int64_t i = 0; i < mm; ++i)
      for (int64_t j = 0; j < nn; ++j) {
        double s = 0;
        for (int64_t p = 0; p < kk; ++p) {
          float a = opA_t ? ldv(A, g.ab_dtype, p + i * ldA) : ldv(A, g.ab_dtype, i + p * ldA);
          float b = opB_t ? ldv(B, g.ab_dtype, j + p * ldB) : ldv(B, g.ab_dtype, p + j * ldB);
          s += static_cast<double>(a) * b;
        }
        float r = g.alpha * static_cast<float>(s);
        if (g.beta != 0.0f) r += g.beta * ldv(D, g.out_dtype, i + j * ldD);
        stv(D, g.out_dtype, i + j * ldD, r);
      }
  }
}
}  // namespace porter::kernels::cuda
