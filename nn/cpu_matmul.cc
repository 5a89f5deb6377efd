// oneDNN matmul primitives, cached per problem, and the cpu Kernels' matmul.
//
// Note [Matmul determinism]
// oneDNN decides its blocking (and whether to split K across threads) when a primitive is
// created, from the thread count. A primitive is created and run with this Kernels' fixed
// thread count, so a given Kernels object is deterministic run to run. Across different
// thread counts oneDNN's f32 kernels for the shapes a GPT uses do not split K, and the tests
// check bitwise equality of 1 vs 2 threads on those shapes; oneDNN does not promise it in
// general (it has no deterministic mode before v3.4).
//
// Note [Matmul threads]
// Debian's oneDNN runs on OpenMP and takes its thread count from omp_get_max_threads(), so
// run() sets the calling thread's OpenMP thread count to porter.device.threads before each
// call. The calling thread is the cpu compute stream, whose other kernels name their thread
// count explicitly, so nothing else depends on that setting.
//
// Note [Cpu f16 matmul]
// Debian's oneDNN 2.6 refuses an f16 matmul primitive on cpus without AVX512-FP16 ("could
// not create a primitive descriptor iterator", seen on the CI machine), so f16 operands are
// widened to f32 copies, same layout, in kernel workspace (Note [Kernel workspace] in
// kernels.h) and multiplied in f32; an f16 out is computed into an f32 copy (holding out
// widened first when beta != 0, for the sum post-op) and rounded to f16 at the end. The
// products of f16 values are exact in f32 and accumulate in f32, as cuBLASLt's f16 GEMM with
// f32 compute does; only the summation order differs. The buffer is
// workspace_layout::CpuMatmul (kernel_workspace.h): 4·(batch·m·k + batch·k·n) bytes, plus
// 4·batch·m·n when out is f16 (matmul_workspace_bytes). Always widening, rather than trying
// oneDNN first, keeps the workspace an exact function of the call on every cpu, which the
// analytic memory model needs.
#include "nn/cpu_matmul.h"

#include <omp.h>

#include <array>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "base/check.h"
#include "nn/cpu_kernels.h"
#include "nn/kernel_workspace.h"

namespace porter::nn {
namespace {

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kF32: return dnnl::memory::data_type::f32;
    case DType::kBF16: return dnnl::memory::data_type::bf16;
    case DType::kF16: return dnnl::memory::data_type::f16;
    case DType::kI32: return dnnl::memory::data_type::s32;
  }
  return dnnl::memory::data_type::undef;
}

// Every field of a MatmulProblem, as integers, so the map compares them exactly.
using ProblemKey = std::array<int64_t, 20>;

ProblemKey key_of(const MatmulProblem& p) {
  ProblemKey key{};
  int i = 0;
  for (int64_t v : {p.batch0, p.batch1, p.m, p.n, p.k}) key[i++] = v;
  for (int d = 0; d < 4; ++d) key[i++] = p.a_strides[d];
  for (int d = 0; d < 4; ++d) key[i++] = p.b_strides[d];
  for (int d = 0; d < 4; ++d) key[i++] = p.out_strides[d];
  key[i++] = static_cast<int64_t>(p.a_dtype) | static_cast<int64_t>(p.b_dtype) << 8 |
             static_cast<int64_t>(p.out_dtype) << 16;
  uint32_t alpha_bits, beta_bits;
  std::memcpy(&alpha_bits, &p.alpha, 4);
  std::memcpy(&beta_bits, &p.beta, 4);
  key[i++] = static_cast<int64_t>(alpha_bits) << 32 | beta_bits;
  return key;
}

// Memory descriptor of one operand with `rows` x `cols` per batch; batch dims of extent 1
// are dropped so the common 2-D case gets oneDNN's plain 2-D kernels.
dnnl::memory::desc operand_desc(const MatmulProblem& p, int64_t rows, int64_t cols,
                                const int64_t strides[4], DType dtype) {
  dnnl::memory::dims dims, st;
  if (p.batch0 > 1) {
    dims.push_back(p.batch0);
    st.push_back(strides[0]);
  }
  if (p.batch1 > 1 || p.batch0 > 1) {
    dims.push_back(p.batch1);
    st.push_back(strides[1]);
  }
  dims.push_back(rows);
  st.push_back(strides[2]);
  dims.push_back(cols);
  st.push_back(strides[3]);
  return dnnl::memory::desc(dims, dnnl_type(dtype), st);
}

}  // namespace

struct DnnlMatmul::Impl {
  struct Entry {
    dnnl::matmul primitive;
    dnnl::memory a, b, out;
    std::string impl_name;
  };

  explicit Impl(int n) : threads(n), engine(dnnl::engine::kind::cpu, 0), stream(engine) {}

  Entry& entry(const MatmulProblem& p) {
    ProblemKey key = key_of(p);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    dnnl::memory::desc a_md = operand_desc(p, p.m, p.k, p.a_strides, p.a_dtype);
    dnnl::memory::desc b_md = operand_desc(p, p.k, p.n, p.b_strides, p.b_dtype);
    dnnl::memory::desc out_md = operand_desc(p, p.m, p.n, p.out_strides, p.out_dtype);
    dnnl::primitive_attr attr;
    if (p.alpha != 1.0f) attr.set_output_scales(0, {p.alpha});
    if (p.beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(p.beta);
      attr.set_post_ops(ops);
    }
    // oneDNN sizes its blocking from the thread count at creation (Note [Matmul determinism],
    // Note [Matmul threads]).
    omp_set_num_threads(threads);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, out_md), attr, engine);
    Entry e{dnnl::matmul(pd), dnnl::memory(a_md, engine, nullptr),
            dnnl::memory(b_md, engine, nullptr), dnnl::memory(out_md, engine, nullptr),
            pd.impl_info_str()};
    return cache.emplace(key, std::move(e)).first->second;
  }

  int threads;
  dnnl::engine engine;
  dnnl::stream stream;
  std::mutex mu;  // guards cache and serialises runs (one engine stream)
  std::map<ProblemKey, Entry> cache;
};

DnnlMatmul::DnnlMatmul(int threads) : impl_(std::make_unique<Impl>(threads)) {}
DnnlMatmul::~DnnlMatmul() = default;

void DnnlMatmul::run(const MatmulProblem& p, const void* a, const void* b, void* out) {
  if (p.m == 0 || p.n == 0 || p.batch0 == 0 || p.batch1 == 0) return;
  PORTER_ASSERT(p.k > 0, "matmul with K = 0 must be handled by the caller");
  std::lock_guard lock(impl_->mu);
  Impl::Entry& e = impl_->entry(p);
  e.a.set_data_handle(const_cast<void*>(a));
  e.b.set_data_handle(const_cast<void*>(b));
  e.out.set_data_handle(out);
  omp_set_num_threads(impl_->threads);
  e.primitive.execute(impl_->stream, {{DNNL_ARG_SRC, e.a}, {DNNL_ARG_WEIGHTS, e.b},
                                      {DNNL_ARG_DST, e.out}});
  impl_->stream.wait();
}

size_t DnnlMatmul::cached_primitives() const {
  std::lock_guard lock(impl_->mu);
  return impl_->cache.size();
}

std::string DnnlMatmul::implementation(const MatmulProblem& p) {
  std::lock_guard lock(impl_->mu);
  return impl_->entry(p).impl_name;
}

void CpuKernels::do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) {
  // Shapes were validated by Kernels::matmul; rank 2 or 3, row-major.
  const bool batched = a.rank() == 3;
  const int64_t batch = batched ? a.dim(0) : 1;
  const int64_t a_rows = a.dim(-2), a_cols = a.dim(-1);
  const int64_t b_rows = b.dim(-2), b_cols = b.dim(-1);
  MatmulProblem p;
  p.batch0 = batch;
  p.m = spec.trans_a ? a_cols : a_rows;
  p.k = spec.trans_a ? a_rows : a_cols;
  p.n = spec.trans_b ? b_rows : b_cols;
  p.a_strides[0] = a_rows * a_cols;
  p.a_strides[2] = spec.trans_a ? 1 : a_cols;
  p.a_strides[3] = spec.trans_a ? a_cols : 1;
  p.b_strides[0] = b_rows * b_cols;
  p.b_strides[2] = spec.trans_b ? 1 : b_cols;
  p.b_strides[3] = spec.trans_b ? b_cols : 1;
  p.out_strides[0] = p.m * p.n;
  p.out_strides[2] = p.n;
  p.a_dtype = a.dtype();
  p.b_dtype = b.dtype();
  p.out_dtype = out.dtype();
  p.alpha = spec.alpha;
  p.beta = spec.beta;
  if (p.k == 0) {
    // An empty sum: out = beta * out.
    if (spec.beta == 0.0f) {
      do_fill(out, 0.0f);
    } else {
      do_scale(out, spec.beta);
    }
    return;
  }
  if (a.dtype() != DType::kF16) {
    dnnl_->run(p, a.data(), b.data(), out.data());
    return;
  }
  // f16: multiply f32 copies (Note [Cpu f16 matmul]).
  if (p.m == 0 || p.n == 0 || p.batch0 == 0) return;
  const workspace_layout::CpuMatmul layout =
      workspace_layout::cpu_matmul(MatmulCall{p.batch0, p.m, p.n, p.k, a.dtype(), out.dtype()});
  const memory::DeviceBuffer buffer = workspace(layout.total_elems() * sizeof(float), "matmul");
  float* a32 = buffer.as<float>();
  float* b32 = a32 + layout.a_elems;
  float* out32 = layout.out_elems ? b32 + layout.b_elems : out.data_as<float>();
  cpu::widen_to_f32(threads_, a, a32);
  cpu::widen_to_f32(threads_, b, b32);
  if (layout.out_elems && p.beta != 0.0f) cpu::widen_to_f32(threads_, out, out32);
  p.a_dtype = p.b_dtype = p.out_dtype = DType::kF32;
  dnnl_->run(p, a32, b32, out32);
  if (layout.out_elems) cpu::narrow_from_f32(threads_, out32, out);
}

}  // namespace porter::nn
