// Llama's own cuda kernels: RMSNorm, the rotary qkv (Note [Rotary qkv] in kernels.cc) and
// SwiGLU. The same formulas as kernels/cpu/rmsnorm_rope_swiglu.cc, with the reductions in a fixed order (Note
// [Deterministic cuda reductions] in kernels/cuda/rowwise.cu).
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace porter::kernels::cuda {
namespace {

constexpr int kRowsPerBlock = kBlock / kWarp;  // warp-per-row kernels
constexpr int kColTile = 32;
constexpr int kRowLanes = 16;

__global__ void rmsnorm_forward_kernel(DevPtr x, DevPtr gamma, DevPtr y, float* rstd,
                                       int64_t rows, int64_t cols, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  float ss = 0.0f;
  for (int64_t c = lane; c < cols; c += kWarp) {
    float v = ld(x, base + c);
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(cols) + eps);
  for (int64_t c = lane; c < cols; c += kWarp) st(y, base + c, ld(x, base + c) * r * ld(gamma, c));
  if (lane == 0) rstd[row] = r;
}

__global__ void rmsnorm_backward_kernel(DevPtr dy, DevPtr x, DevPtr gamma, const float* rstd,
                                        DevPtr dx, int64_t rows, int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float r = rstd[row];
  float s = 0.0f;
  for (int64_t c = lane; c < cols; c += kWarp) {
    s += ld(dy, base + c) * ld(gamma, c) * (ld(x, base + c) * r);
  }
  const float mgx = warp_sum(s) / static_cast<float>(cols);
  for (int64_t c = lane; c < cols; c += kWarp) {
    float g = ld(dy, base + c) * ld(gamma, c);
    st(dx, base + c, r * (g - ld(x, base + c) * r * mgx));
  }
}

// dgamma[j] += sum_r dy[r, j] * x[r, j] * rstd[r]. blockDim = (kColTile, kRowLanes).
__global__ void rmsnorm_gamma_kernel(DevPtr dy, DevPtr x, const float* rstd, DevPtr dgamma,
                                     int64_t rows, int64_t cols) {
  __shared__ float sa[kRowLanes][kColTile + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float a = 0.0f;
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) {
      a += ld(dy, r * cols + col) * (ld(x, r * cols + col) * rstd[r]);
    }
  }
  sa[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) t += sa[k][threadIdx.x];
    st(dgamma, col, ld(dgamma, col) + t);
  }
}

__device__ __forceinline__ void rope_angle(int64_t t, int64_t i, int64_t d, double theta,
                                           float* c, float* s) {
  const double a = static_cast<double>(t) *
                   pow(theta, -static_cast<double>(2 * i) / static_cast<double>(d));
  *c = static_cast<float>(cos(a));
  *s = static_cast<float>(sin(a));
}

// qkv's row is [q: heads heads | k: group * kv slots | v: group * kv slots] of d channels; slot
// s holds key/value head s / group (group = heads / kv expanded, 1 packed).
struct RopeLayout {
  int64_t heads, kv, d, group;
  __device__ __forceinline__ int64_t slots() const { return group * kv; }
  __device__ __forceinline__ int64_t width() const { return (heads + 2 * slots()) * d; }
  __device__ __forceinline__ int64_t koff() const { return heads * d; }
  __device__ __forceinline__ int64_t voff() const { return (heads + slots()) * d; }
};

// One thread per (row, query head h, pair i): writes q's pair of head h and, when h is a k/v
// slot (h < group * kv), k's and v's pair of that slot.
__global__ void rope_qkv_forward_kernel(DevPtr q, DevPtr k, DevPtr v, DevPtr qkv, int64_t n,
                                        int64_t seq, RopeLayout y, double theta) {
  const int64_t d = y.d, half = d / 2, c = y.heads * d, ckv = y.kv * d;
  PORTER_GRID_STRIDE(idx, n) {
    const int64_t i = idx % half, h = (idx / half) % y.heads, row = idx / (half * y.heads);
    float cs, sn;
    rope_angle(row % seq, i, d, theta, &cs, &sn);
    const int64_t out = row * y.width() + h * d + i;
    const int64_t qi = row * c + h * d + i;
    float a = ld(q, qi), b = ld(q, qi + half);
    st(qkv, out, a * cs - b * sn);
    st(qkv, out + half, b * cs + a * sn);
    if (h >= y.slots()) continue;
    const int64_t ki = row * ckv + (h / y.group) * d + i;
    const int64_t ko = row * y.width() + y.koff() + h * d + i;
    const int64_t vo = row * y.width() + y.voff() + h * d + i;
    a = ld(k, ki);
    b = ld(k, ki + half);
    st(qkv, ko, a * cs - b * sn);
    st(qkv, ko + half, b * cs + a * sn);
    st(qkv, vo, ld(v, ki));
    st(qkv, vo + half, ld(v, ki + half));
  }
}

// One thread per (row, query head, pair) for dq; per (row, kv head, pair) for dk and dv, each
// summing its group's slots in order.
__global__ void rope_q_backward_kernel(DevPtr dqkv, DevPtr dq, int64_t n, int64_t seq,
                                       RopeLayout y, double theta) {
  const int64_t d = y.d, half = d / 2, c = y.heads * d;
  PORTER_GRID_STRIDE(idx, n) {
    const int64_t i = idx % half, h = (idx / half) % y.heads, row = idx / (half * y.heads);
    float cs, sn;
    rope_angle(row % seq, i, d, theta, &cs, &sn);
    const int64_t g = row * y.width() + h * d + i, o = row * c + h * d + i;
    const float a = ld(dqkv, g), b = ld(dqkv, g + half);
    st(dq, o, a * cs + b * sn);
    st(dq, o + half, b * cs - a * sn);
  }
}

__global__ void rope_kv_backward_kernel(DevPtr dqkv, DevPtr dk, DevPtr dv, int64_t n,
                                        int64_t seq, RopeLayout y, double theta) {
  const int64_t d = y.d, half = d / 2, ckv = y.kv * d;
  PORTER_GRID_STRIDE(idx, n) {
    const int64_t i = idx % half, g = (idx / half) % y.kv, row = idx / (half * y.kv);
    float cs, sn;
    rope_angle(row % seq, i, d, theta, &cs, &sn);
    const int64_t kbase = row * y.width() + y.koff() + g * y.group * d + i;
    const int64_t vbase = row * y.width() + y.voff() + g * y.group * d + i;
    float ka = 0.0f, kb = 0.0f, va = 0.0f, vb = 0.0f;
    for (int64_t j = 0; j < y.group; ++j) {
      ka += ld(dqkv, kbase + j * d);
      kb += ld(dqkv, kbase + j * d + half);
      va += ld(dqkv, vbase + j * d);
      vb += ld(dqkv, vbase + j * d + half);
    }
    const int64_t o = row * ckv + g * d + i;
    st(dk, o, ka * cs + kb * sn);
    st(dk, o + half, kb * cs - ka * sn);
    st(dv, o, va);
    st(dv, o + half, vb);
  }
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

__global__ void swiglu_forward_kernel(DevPtr gate, DevPtr up, DevPtr y, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    const float g = ld(gate, i);
    st(y, i, g * sigmoid(g) * ld(up, i));
  }
}

__global__ void swiglu_backward_kernel(DevPtr gate, DevPtr up, DevPtr dy, DevPtr dgate,
                                       DevPtr dup, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    const float g = ld(gate, i), d = ld(dy, i), s = sigmoid(g);
    st(dgate, i, d * ld(up, i) * (s * (1.0f + g * (1.0f - s))));
    st(dup, i, d * g * s);
  }
}

}  // namespace

void rmsnorm_forward(const Launch& l, DevPtr x, DevPtr gamma, DevPtr y, float* rstd,
                     int64_t rows, int64_t cols, float eps) {
  if (rows == 0) return;
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  rmsnorm_forward_kernel<<<grid, kBlock, 0, l.stream>>>(x, gamma, y, rstd, rows, cols, eps);
  PORTER_GPU_CHECK_LAUNCH("rmsnorm_forward_kernel", l.device);
}

void rmsnorm_backward(const Launch& l, DevPtr dy, DevPtr x, DevPtr gamma, const float* rstd,
                      DevPtr dx, DevPtr dgamma, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  dim3 block(kColTile, kRowLanes);
  unsigned cgrid = static_cast<unsigned>((cols + kColTile - 1) / kColTile);
  rmsnorm_gamma_kernel<<<cgrid, block, 0, l.stream>>>(dy, x, rstd, dgamma, rows, cols);
  PORTER_GPU_CHECK_LAUNCH("rmsnorm_gamma_kernel", l.device);
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  rmsnorm_backward_kernel<<<grid, kBlock, 0, l.stream>>>(dy, x, gamma, rstd, dx, rows, cols);
  PORTER_GPU_CHECK_LAUNCH("rmsnorm_backward_kernel", l.device);
}

void rope_qkv_forward(const Launch& l, DevPtr q, DevPtr k, DevPtr v, DevPtr qkv, int64_t rows,
                      int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t group, double theta) {
  const int64_t n = rows * heads * (head_dim / 2);
  if (n == 0) return;
  const RopeLayout y{heads, kv_heads, head_dim, group};
  rope_qkv_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(q, k, v, qkv, n, seq, y, theta);
  PORTER_GPU_CHECK_LAUNCH("rope_qkv_forward_kernel", l.device);
}

void rope_qkv_backward(const Launch& l, DevPtr dqkv, DevPtr dq, DevPtr dk, DevPtr dv,
                       int64_t rows, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t group, double theta) {
  const int64_t nq = rows * heads * (head_dim / 2), nkv = rows * kv_heads * (head_dim / 2);
  if (nq == 0) return;
  const RopeLayout y{heads, kv_heads, head_dim, group};
  rope_q_backward_kernel<<<grid_for(nq), kBlock, 0, l.stream>>>(dqkv, dq, nq, seq, y, theta);
  PORTER_GPU_CHECK_LAUNCH("rope_q_backward_kernel", l.device);
  rope_kv_backward_kernel<<<grid_for(nkv), kBlock, 0, l.stream>>>(dqkv, dk, dv, nkv, seq, y,
                                                                  theta);
  PORTER_GPU_CHECK_LAUNCH("rope_kv_backward_kernel", l.device);
}

void swiglu_forward(const Launch& l, DevPtr gate, DevPtr up, DevPtr y, int64_t n) {
  if (n == 0) return;
  swiglu_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(gate, up, y, n);
  PORTER_GPU_CHECK_LAUNCH("swiglu_forward_kernel", l.device);
}

void swiglu_backward(const Launch& l, DevPtr gate, DevPtr up, DevPtr dy, DevPtr dgate,
                     DevPtr dup, int64_t n) {
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(gate, up, dy, dgate, dup, n);
  PORTER_GPU_CHECK_LAUNCH("swiglu_backward_kernel", l.device);
}

}  // namespace porter::kernels::cuda
