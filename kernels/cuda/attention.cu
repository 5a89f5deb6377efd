// The non-matmul parts of causal attention on cuda: splitting the packed qkv into per-head
// f32 matrices and back, the causal softmax and its backward. The matmuls are cuBLASLt
// strided batches (kernels/cuda/cuda_kernels.cc, Note [Cuda attention]).
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace porter::kernels::cuda {
namespace {

// dst (B, H, T, hd) <- src (B, T, row_stride) columns [col_offset + h * hd + d]. One thread
// per destination element; d is innermost on both sides, so reads and writes coalesce.
__global__ void split_heads_kernel(DevPtr src, int64_t row_stride, int64_t col_offset, float* dst,
                                   int64_t n, int64_t seq, int64_t heads, int64_t head_dim) {
  PORTER_GRID_STRIDE(i, n) {
    const int64_t d = i % head_dim;
    const int64_t t = (i / head_dim) % seq;
    const int64_t h = (i / (head_dim * seq)) % heads;
    const int64_t b = i / (head_dim * seq * heads);
    dst[i] = ld(src, (b * seq + t) * row_stride + col_offset + h * head_dim + d);
  }
}

// One thread per element of the destination columns, indexed (B, T, H, hd) so writes coalesce.
__global__ void merge_heads_kernel(const float* src, DevPtr dst, int64_t row_stride,
                                   int64_t col_offset, int64_t n, int64_t seq, int64_t heads,
                                   int64_t head_dim) {
  PORTER_GRID_STRIDE(i, n) {
    const int64_t d = i % head_dim;
    const int64_t h = (i / head_dim) % heads;
    const int64_t t = (i / (head_dim * heads)) % seq;
    const int64_t b = i / (head_dim * heads * seq);
    st(dst, (b * seq + t) * row_stride + col_offset + h * head_dim + d,
       src[((b * heads + h) * seq + t) * head_dim + d]);
  }
}

constexpr int kRowsPerBlock = kBlock / kWarp;

// One warp per row i of a (T, T) score matrix: p_j = exp(s_j - max) / sum for j <= i, and
// p_j = 0 above the diagonal (those scores were computed by the matmul but are masked).
__global__ void causal_softmax_forward_kernel(float* s, int64_t rows, int64_t seq) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t i = row % seq;
  float* p = s + row * seq;
  float mx = -INFINITY;
  for (int64_t j = lane; j <= i; j += kWarp) mx = fmaxf(mx, p[j]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int64_t j = lane; j <= i; j += kWarp) {
    float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  for (int64_t j = lane; j < seq; j += kWarp) p[j] = j <= i ? p[j] / sum : 0.0f;
}

// dS_j = P_j * (dP_j - sum_k dP_k P_k), in place on dP; zero above the diagonal.
__global__ void softmax_backward_kernel(const float* probs, float* dp, int64_t rows, int64_t seq) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t i = row % seq;
  const float* p = probs + row * seq;
  float* g = dp + row * seq;
  float dot = 0.0f;
  for (int64_t j = lane; j <= i; j += kWarp) dot += g[j] * p[j];
  dot = warp_sum(dot);
  for (int64_t j = lane; j < seq; j += kWarp) g[j] = j <= i ? p[j] * (g[j] - dot) : 0.0f;
}

}  // namespace

void split_heads(const Launch& l, DevPtr src, int64_t row_stride, int64_t col_offset, float* dst,
                 int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  const int64_t n = batch * seq * heads * head_dim;
  if (n == 0) return;
  split_heads_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(src, row_stride, col_offset, dst, n,
                                                           seq, heads, head_dim);
  PORTER_GPU_CHECK_LAUNCH("split_heads_kernel", l.device);
}

void merge_heads(const Launch& l, const float* src, DevPtr dst, int64_t row_stride,
                 int64_t col_offset, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  const int64_t n = batch * seq * heads * head_dim;
  if (n == 0) return;
  merge_heads_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(src, dst, row_stride, col_offset, n,
                                                           seq, heads, head_dim);
  PORTER_GPU_CHECK_LAUNCH("merge_heads_kernel", l.device);
}

void causal_softmax_forward(const Launch& l, float* s, int64_t batch_heads, int64_t seq) {
  const int64_t rows = batch_heads * seq;
  if (rows == 0) return;
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  causal_softmax_forward_kernel<<<grid, kBlock, 0, l.stream>>>(s, rows, seq);
  PORTER_GPU_CHECK_LAUNCH("causal_softmax_forward_kernel", l.device);
}

void softmax_backward(const Launch& l, const float* probs, float* dp, int64_t batch_heads,
                      int64_t seq) {
  const int64_t rows = batch_heads * seq;
  if (rows == 0) return;
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  softmax_backward_kernel<<<grid, kBlock, 0, l.stream>>>(probs, dp, rows, seq);
  PORTER_GPU_CHECK_LAUNCH("softmax_backward_kernel", l.device);
}

}  // namespace porter::kernels::cuda
