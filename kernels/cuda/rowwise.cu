// Row- and column-wise cuda kernels: layernorm, bias and layernorm parameter gradients,
// embedding and cross-entropy (whole or vocabulary-parallel), sum, squared-norm and the
// non-finite count.
//
// Note [Deterministic cuda reductions]
// Every reduction here sums in an order fixed by the shapes alone: warp butterflies, then a
// fixed walk over warps or row-lanes, and grid sizes that depend only on the element count.
// No floating-point atomics, so two runs give bitwise-identical results (the checkpointing
// layer relies on gradients being bit-identical under every policy).
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace porter::kernels::cuda {
namespace {

constexpr int kColTile = 32;   // columns per block in column reductions
constexpr int kRowLanes = 16;  // rows summed in parallel per column, then combined in order

// For each column j: b[j] += sum_r dy[r, j]; when x is given (layernorm), also
// a[j] += sum_r dy[r, j] * (x[r, j] - mean[r]) * rstd[r]. blockDim = (kColTile, kRowLanes).
__global__ void column_reduce_kernel(DevPtr dy, DevPtr x, const float* mean, const float* rstd,
                                     DevPtr out_a, DevPtr out_b, int64_t rows, int64_t cols) {
  __shared__ float sa[kRowLanes][kColTile + 1];
  __shared__ float sb[kRowLanes][kColTile + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float a = 0.0f, b = 0.0f;
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) {
      float d = ld(dy, r * cols + col);
      b += d;
      if (x.data != nullptr) a += d * ((ld(x, r * cols + col) - mean[r]) * rstd[r]);
    }
  }
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float ta = 0.0f, tb = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) {
      ta += sa[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    st(out_b, col, ld(out_b, col) + tb);
    if (x.data != nullptr) st(out_a, col, ld(out_a, col) + ta);
  }
}

void launch_column_reduce(const Launch& l, DevPtr dy, DevPtr x, const float* mean,
                          const float* rstd, DevPtr out_a, DevPtr out_b, int64_t rows,
                          int64_t cols) {
  if (cols == 0) return;
  dim3 block(kColTile, kRowLanes);
  unsigned grid = static_cast<unsigned>((cols + kColTile - 1) / kColTile);
  column_reduce_kernel<<<grid, block, 0, l.stream>>>(dy, x, mean, rstd, out_a, out_b, rows, cols);
  PORTER_GPU_CHECK_LAUNCH("column_reduce_kernel", l.device);
}

constexpr int kRowsPerBlock = kBlock / kWarp;  // warp-per-row kernels

// One warp per row. Two passes for the variance (mean first), as the cpu does, for accuracy.
__global__ void layernorm_forward_kernel(DevPtr x, DevPtr gamma, DevPtr beta, DevPtr y,
                                         float* mean, float* rstd, int64_t rows, int64_t cols,
                                         float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;  // whole warps leave together
  const int64_t base = row * cols;
  float s = 0.0f;
  for (int64_t c = lane; c < cols; c += kWarp) s += ld(x, base + c);
  const float m = warp_sum(s) / static_cast<float>(cols);
  float v = 0.0f;
  for (int64_t c = lane; c < cols; c += kWarp) {
    float d = ld(x, base + c) - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(v) / static_cast<float>(cols) + eps);
  for (int64_t c = lane; c < cols; c += kWarp) {
    st(y, base + c, (ld(x, base + c) - m) * r * ld(gamma, c) + ld(beta, c));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma. Each element is read
// and written by the same lane, so dx may alias dy.
__global__ void layernorm_backward_kernel(DevPtr dy, DevPtr x, DevPtr gamma, const float* mean,
                                          const float* rstd, DevPtr dx, int64_t rows,
                                          int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float m = mean[row], r = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int64_t c = lane; c < cols; c += kWarp) {
    float g = ld(dy, base + c) * ld(gamma, c);
    s1 += g;
    s2 += g * ((ld(x, base + c) - m) * r);
  }
  const float mean_g = warp_sum(s1) / static_cast<float>(cols);
  const float mean_gx = warp_sum(s2) / static_cast<float>(cols);
  for (int64_t c = lane; c < cols; c += kWarp) {
    float g = ld(dy, base + c) * ld(gamma, c);
    float xhat = (ld(x, base + c) - m) * r;
    st(dx, base + c, r * (g - mean_g - xhat * mean_gx));
  }
}

__global__ void embedding_forward_kernel(const int32_t* tokens, DevPtr wte, DevPtr wpe,
                                         DevPtr out, int64_t n, int64_t seq, int64_t channels,
                                         int64_t vocab) {
  PORTER_GRID_STRIDE(i, n) {
    const int64_t row = i / channels, c = i % channels, t = row % seq;
    const int32_t tok = tokens[row];
    float v = (tok < 0 || tok >= vocab) ? NAN : ld(wte, tok * channels + c) + ld(wpe, t * channels + c);
    st(out, i, v);
  }
}

// The vocabulary-parallel forward: ids outside [vocab_begin, vocab_begin + vocab) add 0, and
// wpe is optional (wpe.data == nullptr). Same sums as the cpu, so the same bits.
__global__ void embedding_forward_vocab_range_kernel(const int32_t* tokens, DevPtr wte,
                                                     int64_t vocab_begin, DevPtr wpe, DevPtr out,
                                                     int64_t n, int64_t seq, int64_t channels,
                                                     int64_t vocab) {
  PORTER_GRID_STRIDE(i, n) {
    const int64_t row = i / channels, c = i % channels, t = row % seq;
    const int64_t v = static_cast<int64_t>(tokens[row]) - vocab_begin;
    const bool in_range = v >= 0 && v < vocab;
    float x;
    if (wpe.data == nullptr) {
      x = in_range ? ld(wte, v * channels + c) : 0.0f;
    } else {
      x = in_range ? ld(wte, v * channels + c) + ld(wpe, t * channels + c)
                   : ld(wpe, t * channels + c);
    }
    st(out, i, x);
  }
}

// Note [Deterministic embedding backward]
// Scattering rows of dout into dwte with atomics would make the sum order (and the bits)
// depend on scheduling. Instead one block owns one vocabulary row: it scans the tokens in
// chunks of blockDim, compacts the positions holding its token in increasing order (warp
// ballots plus a prefix over warps), and adds those rows of dout in that order. The scan is
// O(V * N / blockDim) compares, cheap next to the matmuls for any GPT-sized batch. In f32
// the additions happen in the cpu's order (token order), so the bits match the cpu; a bf16
// dwte is rounded once per chunk of positions instead of after every token.
// Unlike the cpu, which checks ids on the host, a token outside [0, V) is not reported here
// (reading device memory to check would need a synchronisation); its row is skipped, and
// the forward pass has already turned it into NaN. A vocabulary shard (dwte holding ids
// [vocab_begin, vocab_begin + V)) is the same scan, block v looking for id vocab_begin + v.
__global__ void embedding_backward_wte_kernel(DevPtr dout, const int32_t* tokens, DevPtr dwte,
                                              int64_t n_tokens, int64_t channels,
                                              int64_t vocab_begin) {
  __shared__ int32_t hits[kBlock];
  __shared__ int warp_counts[kBlock / kWarp];
  const int64_t v = blockIdx.x;
  const int64_t id = vocab_begin + v;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int64_t start = 0; start < n_tokens; start += kBlock) {
    const int64_t pos = start + threadIdx.x;
    const bool match = pos < n_tokens && static_cast<int64_t>(tokens[pos]) == id;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, total = 0;
    for (int w = 0; w < kBlock / kWarp; ++w) {
      if (w < warp) offset += warp_counts[w];
      total += warp_counts[w];
    }
    if (match) hits[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(pos);
    __syncthreads();
    if (total > 0) {
      for (int64_t c = threadIdx.x; c < channels; c += kBlock) {
        float acc = ld(dwte, v * channels + c);
        for (int k = 0; k < total; ++k) acc += ld(dout, hits[k] * channels + c);
        st(dwte, v * channels + c, acc);
      }
    }
    __syncthreads();  // hits and warp_counts are rewritten by the next chunk
  }
}

// dwpe[t, c] += sum over b of dout[b, t, c], b in order.
__global__ void embedding_backward_wpe_kernel(DevPtr dout, DevPtr dwpe, int64_t batch,
                                              int64_t seq, int64_t channels) {
  const int64_t n = seq * channels;
  PORTER_GRID_STRIDE(i, n) {
    float acc = ld(dwpe, i);
    for (int64_t b = 0; b < batch; ++b) acc += ld(dout, b * n + i);
    st(dwpe, i, acc);
  }
}

// One block per row; max subtraction for stability.
__global__ void cross_entropy_forward_kernel(DevPtr logits, const int32_t* targets, float* losses,
                                             int64_t vocab) {
  __shared__ float scratch[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * vocab;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, ld(logits, base + j));
  mx = block_reduce<true>(mx, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(ld(logits, base + j) - mx);
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) {
    const int32_t t = targets[blockIdx.x];
    losses[blockIdx.x] = (t < 0 || t >= vocab) ? NAN : logf(s) + mx - ld(logits, base + t);
  }
}

// dlogits may alias logits: each element is read and then written by the same thread, after
// the block's reductions have read every logit.
__global__ void cross_entropy_backward_kernel(DevPtr logits, const int32_t* targets,
                                              DevPtr dlogits, int64_t vocab, float scale) {
  __shared__ float scratch[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * vocab;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, ld(logits, base + j));
  mx = block_reduce<true>(mx, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(ld(logits, base + j) - mx);
  s = block_reduce<false>(s, scratch);
  const int32_t t = targets[blockIdx.x];
  const bool valid = t >= 0 && t < vocab;
  __syncthreads();  // every thread is past its last read of logits before any write
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float p = expf(ld(logits, base + j) - mx) / s;
    float g = valid ? (p - (j == t ? 1.0f : 0.0f)) * scale : NAN;
    st(dlogits, base + j, g);
  }
}

// Vocabulary-parallel cross-entropy (Note [Vocabulary-parallel kernels] in kernels.cc).
// One block per row, as the whole-vocabulary kernels; columns [valid, cols) are not read.
__global__ void cross_entropy_partial_kernel(DevPtr logits, const int32_t* targets,
                                             int64_t vocab_begin, int64_t valid, float* stats,
                                             int64_t cols) {
  __shared__ float scratch[kWarp];
  const int64_t row = blockIdx.x, base = row * cols;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, ld(logits, base + j));
  mx = block_reduce<true>(mx, scratch);
  // valid = 0 leaves mx = -inf and s = 0, and no exp(-inf - -inf) is evaluated.
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(ld(logits, base + j) - mx);
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) {
    const int64_t local = static_cast<int64_t>(targets[row]) - vocab_begin;
    stats[row * 3] = mx;
    stats[row * 3 + 1] = s;
    stats[row * 3 + 2] = local >= 0 && local < valid ? ld(logits, base + local) : 0.0f;
  }
}

// One thread per row, ranks in order (so every rank gets the same bits); a rank with s = 0 is
// skipped, since its m may be -inf.
__global__ void cross_entropy_combine_kernel(const float* gathered, float* losses, float* lse,
                                             int64_t ranks, int64_t rows) {
  PORTER_GRID_STRIDE(r, rows) {
    float mx = -INFINITY;
    for (int64_t k = 0; k < ranks; ++k) mx = fmaxf(mx, gathered[(k * rows + r) * 3]);
    float s = 0.0f, z = 0.0f;
    for (int64_t k = 0; k < ranks; ++k) {
      const float* st3 = gathered + (k * rows + r) * 3;
      if (st3[1] != 0.0f) s += st3[1] * expf(st3[0] - mx);
      z += st3[2];
    }
    const float l = mx + logf(s);
    lse[r] = l;
    losses[r] = l - z;
  }
}

// Elementwise given lse, so dlogits may alias logits (each element is read, then written, by
// one thread).
__global__ void cross_entropy_backward_partial_kernel(DevPtr logits, const int32_t* targets,
                                                      int64_t vocab_begin, int64_t valid,
                                                      const float* lse, DevPtr dlogits, int64_t n,
                                                      int64_t cols, float scale) {
  PORTER_GRID_STRIDE(i, n) {
    const int64_t row = i / cols, c = i % cols;
    float g = 0.0f;
    if (c < valid) {
      const int64_t local = static_cast<int64_t>(targets[row]) - vocab_begin;
      g = (expf(ld(logits, i) - lse[row]) - (c == local ? 1.0f : 0.0f)) * scale;
    }
    st(dlogits, i, g);
  }
}

constexpr int64_t kMaxPartials = 1024;
constexpr int64_t kElemsPerThread = 8;  // below this much work per thread, use fewer blocks

__global__ void sum_partials_kernel(DevPtr x, int64_t n, SumOf what, float* partials) {
  __shared__ float scratch[kWarp];
  float s = 0.0f;
  PORTER_GRID_STRIDE(i, n) {
    float v = ld(x, i);
    // Counts are whole numbers, so their f32 sums are exact up to 2^24.
    if (what == SumOf::kSquares) v = v * v;
    // |v| <= FLT_MAX is false exactly for inf and NaN (a NaN compares false).
    if (what == SumOf::kNonfinite) v = fabsf(v) <= 3.40282347e38f ? 0.0f : 1.0f;
    s += v;
  }
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void sum_final_kernel(const float* partials, int64_t count, float* out) {
  __shared__ float scratch[kWarp];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) out[0] = s;
}

}  // namespace

void bias_backward(const Launch& l, DevPtr dy, DevPtr dbias, int64_t rows, int64_t cols) {
  launch_column_reduce(l, dy, DevPtr{}, nullptr, nullptr, DevPtr{}, dbias, rows, cols);
}

void layernorm_forward(const Launch& l, DevPtr x, DevPtr gamma, DevPtr beta, DevPtr y,
                       float* mean, float* rstd, int64_t rows, int64_t cols, float eps) {
  if (rows == 0) return;
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  layernorm_forward_kernel<<<grid, kBlock, 0, l.stream>>>(x, gamma, beta, y, mean, rstd, rows,
                                                          cols, eps);
  PORTER_GPU_CHECK_LAUNCH("layernorm_forward_kernel", l.device);
}

void layernorm_backward(const Launch& l, DevPtr dy, DevPtr x, DevPtr gamma, const float* mean,
                        const float* rstd, DevPtr dx, DevPtr dgamma, DevPtr dbeta, int64_t rows,
                        int64_t cols) {
  if (rows == 0) return;
  // Parameter gradients first: they read dy, which the dx kernel may overwrite (aliasing).
  launch_column_reduce(l, dy, x, mean, rstd, dgamma, dbeta, rows, cols);
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  layernorm_backward_kernel<<<grid, kBlock, 0, l.stream>>>(dy, x, gamma, mean, rstd, dx, rows,
                                                           cols);
  PORTER_GPU_CHECK_LAUNCH("layernorm_backward_kernel", l.device);
}

void embedding_forward(const Launch& l, const int32_t* tokens, DevPtr wte, DevPtr wpe,
                       DevPtr out, int64_t batch, int64_t seq, int64_t channels, int64_t vocab) {
  const int64_t n = batch * seq * channels;
  if (n == 0) return;
  embedding_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(tokens, wte, wpe, out, n, seq,
                                                                 channels, vocab);
  PORTER_GPU_CHECK_LAUNCH("embedding_forward_kernel", l.device);
}

void embedding_forward_vocab_range(const Launch& l, const int32_t* tokens, DevPtr wte,
                                   int64_t vocab_begin, DevPtr wpe, DevPtr out, int64_t batch,
                                   int64_t seq, int64_t channels, int64_t vocab) {
  const int64_t n = batch * seq * channels;
  if (n == 0) return;
  embedding_forward_vocab_range_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(
      tokens, wte, vocab_begin, wpe, out, n, seq, channels, vocab);
  PORTER_GPU_CHECK_LAUNCH("embedding_forward_vocab_range_kernel", l.device);
}

void embedding_backward(const Launch& l, DevPtr dout, const int32_t* tokens, DevPtr dwte,
                        DevPtr dwpe, int64_t batch, int64_t seq, int64_t channels, int64_t vocab,
                        int64_t vocab_begin) {
  if (batch * seq * channels == 0) return;
  if (vocab > 0) {
    embedding_backward_wte_kernel<<<static_cast<unsigned>(vocab), kBlock, 0, l.stream>>>(
        dout, tokens, dwte, batch * seq, channels, vocab_begin);
    PORTER_GPU_CHECK_LAUNCH("embedding_backward_wte_kernel", l.device);
  }
  if (dwpe.data != nullptr) {
    embedding_backward_wpe_kernel<<<grid_for(seq * channels), kBlock, 0, l.stream>>>(
        dout, dwpe, batch, seq, channels);
    PORTER_GPU_CHECK_LAUNCH("embedding_backward_wpe_kernel", l.device);
  }
}

void cross_entropy_forward(const Launch& l, DevPtr logits, const int32_t* targets, float* losses,
                           int64_t rows, int64_t vocab) {
  if (rows == 0) return;
  cross_entropy_forward_kernel<<<static_cast<unsigned>(rows), kBlock, 0, l.stream>>>(
      logits, targets, losses, vocab);
  PORTER_GPU_CHECK_LAUNCH("cross_entropy_forward_kernel", l.device);
}

void cross_entropy_backward(const Launch& l, DevPtr logits, const int32_t* targets,
                            DevPtr dlogits, int64_t rows, int64_t vocab, float scale) {
  if (rows == 0) return;
  cross_entropy_backward_kernel<<<static_cast<unsigned>(rows), kBlock, 0, l.stream>>>(
      logits, targets, dlogits, vocab, scale);
  PORTER_GPU_CHECK_LAUNCH("cross_entropy_backward_kernel", l.device);
}

void cross_entropy_partial(const Launch& l, DevPtr logits, const int32_t* targets,
                           int64_t vocab_begin, int64_t valid, float* stats, int64_t rows,
                           int64_t cols) {
  if (rows == 0) return;
  cross_entropy_partial_kernel<<<static_cast<unsigned>(rows), kBlock, 0, l.stream>>>(
      logits, targets, vocab_begin, valid, stats, cols);
  PORTER_GPU_CHECK_LAUNCH("cross_entropy_partial_kernel", l.device);
}

void cross_entropy_combine(const Launch& l, const float* gathered, float* losses, float* lse,
                           int64_t ranks, int64_t rows) {
  if (rows == 0) return;
  cross_entropy_combine_kernel<<<grid_for(rows), kBlock, 0, l.stream>>>(gathered, losses, lse,
                                                                        ranks, rows);
  PORTER_GPU_CHECK_LAUNCH("cross_entropy_combine_kernel", l.device);
}

void cross_entropy_backward_partial(const Launch& l, DevPtr logits, const int32_t* targets,
                                    int64_t vocab_begin, int64_t valid, const float* lse,
                                    DevPtr dlogits, int64_t rows, int64_t cols, float scale) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  cross_entropy_backward_partial_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(
      logits, targets, vocab_begin, valid, lse, dlogits, n, cols, scale);
  PORTER_GPU_CHECK_LAUNCH("cross_entropy_backward_partial_kernel", l.device);
}

int64_t reduction_partials_count() { return kMaxPartials; }

void sum(const Launch& l, DevPtr x, int64_t n, SumOf what, float* partials, float* out) {
  int64_t blocks = (n + kBlock * kElemsPerThread - 1) / (kBlock * kElemsPerThread);
  blocks = blocks < 1 ? 1 : (blocks > kMaxPartials ? kMaxPartials : blocks);
  sum_partials_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, l.stream>>>(x, n, what,
                                                                             partials);
  PORTER_GPU_CHECK_LAUNCH("sum_partials_kernel", l.device);
  sum_final_kernel<<<1, kBlock, 0, l.stream>>>(partials, blocks, out);
  PORTER_GPU_CHECK_LAUNCH("sum_final_kernel", l.device);
}

}  // namespace porter::kernels::cuda
