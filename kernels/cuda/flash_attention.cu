// Memory-efficient causal attention on cuda (Note [Flash attention] in kernels.cc for the
// semantics, Note [Cuda flash attention] below for this implementation): a forward kernel,
// the backward's row dots D = sum(dout * out), and the two backward kernels, one for dK and dV,
// one for dQ.
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace porter::kernels::cuda {
namespace {

// Note [Cuda flash attention]
// Plain shared-memory tiles, written for clarity over peak speed (no tensor cores).
// - Tiles. A query block and a key tile have the same `tile` rows: min(kMaxTileRows,
//   kTileFloats / D), so one (tile, D) f32 tile of q, k, v or dout fits kTileFloats floats
//   whatever D is (32 rows for D <= 64, 16 for D = 128, 8 for D = 256). Rows are stored with a
//   stride of D + 1 floats so that threads reading one column of consecutive rows hit
//   different banks. Every tile is static shared memory (the forward's four take ~29 KiB,
//   the dK/dV kernel's six ~41 KiB, under the 48 KiB a block gets without opting in).
//   Rows past T load as zeros and are never stored, so any T works.
// - Threads. kFlashThreads per block. The (tile, tile) scores go one entry per thread in
//   turn, each a sequential dot over D. The (tile, D) accumulators (out, dQ, dK, dV) are
//   registers: thread x owns the elements x + j * kFlashThreads, j < kAccPerThread, of the
//   row-major tile, and sums into them in row (or key) order.
// - Forward: one block per (b, head, query block); the key tiles 0..diagonal go in order.
//   Per tile, one thread per query row takes the new row max m, rescales its running sum l
//   by alpha = exp(m_old - m) and turns the tile's scores into exp(s - m) (keys in order);
//   then every accumulator is rescaled by its row's alpha and gains P V. Finally
//   out = acc / l, lse = m + log l. A row that has seen no key yet (m = -inf: only padded
//   rows past T) keeps alpha = 1 and P = 0.
// - Backward: D = sum(dout * out) per (b, head, row) into the workspace, a warp per row. Then
//   P = exp(s - lse) and dS = P (dP - D) / sqrt(D) are recomputed per tile, as in the
//   forward, by two kernels that never write the same element (no atomics):
//   - dK, dV: one block per (b, kv head, key block); its group's query heads in head order,
//     for each the query blocks from the diagonal on in order, each tile's rows in order:
//     dV += P^T dout, dK += dS^T q.
//   - dQ: one block per (b, head, query block); key tiles 0..diagonal in order: dQ += dS k.
//   Each sum's order depends on the shapes alone, so the bits are the same on every run and
//   every GPU. They are not the cpu kernel's bits (its tiles and summation order are its own).
constexpr int kFlashThreads = 128;
constexpr int kTileFloats = 2048;
constexpr int kMaxTileRows = 32;
constexpr int kTileStorage = kTileFloats + kMaxTileRows;  // tile * (D + 1) <= this
constexpr int kAccPerThread = kTileFloats / kFlashThreads;
static_assert(kFlashMaxHeadDim <= kTileFloats, "a tile holds at least one row");
constexpr int kRowsPerDotBlock = kBlock / kWarp;

struct FlashShape {
  int64_t seq, heads, kv_heads, d;
  int64_t width;   // qkv's row: (heads + 2 kv_heads) d
  int64_t tile;    // rows of a query block and of a key tile
  int64_t blocks;  // query (or key) blocks per sequence: ceil(seq / tile)
  float scale;     // 1 / sqrt(d)
};

// dst (tile, d) with row stride d + 1 = rows [row0, row0 + tile) of batch b of a (B, T, width)
// tensor, columns [col, col + d), in f32; rows past seq are zero.
__device__ __forceinline__ void load_tile(DevPtr src, int64_t width, int64_t col, int64_t b,
                                          int64_t row0, const FlashShape& s, float* dst) {
  const int64_t n = s.tile * s.d;
  for (int64_t e = threadIdx.x; e < n; e += kFlashThreads) {
    const int64_t r = e / s.d, c = e % s.d, t = row0 + r;
    dst[r * (s.d + 1) + c] = t < s.seq ? ld(src, (b * s.seq + t) * width + col + c) : 0.0f;
  }
}

// Row r of a, dotted with row j of b (both (tile, d) with stride d + 1), in column order.
__device__ __forceinline__ float row_dot(const float* a, int64_t r, const float* b, int64_t j,
                                         int64_t d) {
  const float* x = a + r * (d + 1);
  const float* y = b + j * (d + 1);
  float acc = 0.0f;
  for (int64_t c = 0; c < d; ++c) acc += x[c] * y[c];
  return acc;
}

// Whether query row q0 + r may read key k0 + j: causal, and the query row exists (a key at or
// before an existing query exists too).
__device__ __forceinline__ bool visible(const FlashShape& s, int64_t q0, int64_t r, int64_t k0,
                                        int64_t j) {
  return k0 + j <= q0 + r && q0 + r < s.seq;
}

// The backward's recomputed tile: p = exp(scale q k^T - lse) and ds = p (dout v^T - D) scale,
// both (tile, tile) with stride tile, zero where the key is not visible.
__device__ __forceinline__ void grad_scores(const float* q, const float* k, const float* dout,
                                            const float* v, const float* row_lse,
                                            const float* row_d, float* p, float* ds,
                                            int64_t q0, int64_t k0, const FlashShape& s) {
  const int64_t n = s.tile * s.tile;
  for (int64_t e = threadIdx.x; e < n; e += kFlashThreads) {
    const int64_t r = e / s.tile, j = e % s.tile;
    float pe = 0.0f, dse = 0.0f;
    if (visible(s, q0, r, k0, j)) {
      pe = expf(row_dot(q, r, k, j, s.d) * s.scale - row_lse[r]);
      dse = pe * (row_dot(dout, r, v, j, s.d) - row_d[r]) * s.scale;
    }
    p[e] = pe;
    ds[e] = dse;
  }
}

__global__ void flash_forward_kernel(DevPtr qkv, DevPtr out, float* lse, FlashShape s) {
  __shared__ float q[kTileStorage];
  __shared__ float k[kTileStorage];
  __shared__ float v[kTileStorage];
  __shared__ float p[kMaxTileRows * kMaxTileRows];
  __shared__ float row_max[kMaxTileRows];
  __shared__ float row_sum[kMaxTileRows];
  __shared__ float row_alpha[kMaxTileRows];
  const int64_t qb = blockIdx.x % s.blocks;
  const int64_t h = (blockIdx.x / s.blocks) % s.heads;
  const int64_t b = blockIdx.x / (s.blocks * s.heads);
  const int64_t kvh = h / (s.heads / s.kv_heads);
  const int64_t d = s.d, tile = s.tile, q0 = qb * tile;
  const int x = threadIdx.x;

  load_tile(qkv, s.width, h * d, b, q0, s, q);
  if (x < tile) {
    row_max[x] = -INFINITY;
    row_sum[x] = 0.0f;
  }
  float acc[kAccPerThread] = {};
  for (int64_t kb = 0; kb <= qb; ++kb) {
    const int64_t k0 = kb * tile;
    __syncthreads();  // the previous tile's k, v and p are read
    load_tile(qkv, s.width, (s.heads + kvh) * d, b, k0, s, k);
    load_tile(qkv, s.width, (s.heads + s.kv_heads + kvh) * d, b, k0, s, v);
    __syncthreads();
    for (int64_t e = x; e < tile * tile; e += kFlashThreads) {
      const int64_t r = e / tile, j = e % tile;
      p[e] = visible(s, q0, r, k0, j) ? row_dot(q, r, k, j, d) * s.scale : -INFINITY;
    }
    __syncthreads();
    if (x < tile) {
      float* pr = p + x * tile;
      float m = row_max[x];
      for (int64_t j = 0; j < tile; ++j) m = fmaxf(m, pr[j]);
      const bool empty = m == -INFINITY;
      const float alpha = empty ? 1.0f : expf(row_max[x] - m);
      float sum = 0.0f;
      for (int64_t j = 0; j < tile; ++j) {
        const float e = empty ? 0.0f : expf(pr[j] - m);
        pr[j] = e;
        sum += e;
      }
      row_sum[x] = row_sum[x] * alpha + sum;
      row_max[x] = m;
      row_alpha[x] = alpha;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) {
      const int64_t e = x + i * kFlashThreads;
      if (e < tile * d) {
        const int64_t r = e / d, c = e % d;
        float a = acc[i] * row_alpha[r];
        for (int64_t j = 0; j < tile; ++j) a += p[r * tile + j] * v[j * (d + 1) + c];
        acc[i] = a;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) {
    const int64_t e = x + i * kFlashThreads;
    if (e < tile * d && q0 + e / d < s.seq) {
      const int64_t r = e / d, c = e % d;
      st(out, (b * s.seq + q0 + r) * s.heads * d + h * d + c, acc[i] / row_sum[r]);
    }
  }
  if (x < tile && q0 + x < s.seq) {
    lse[(b * s.heads + h) * s.seq + q0 + x] = row_max[x] + logf(row_sum[x]);
  }
}

// drow (B, H, T) = sum over the head's d columns of dout * out; a warp per row.
__global__ void flash_row_dot_kernel(DevPtr dout, DevPtr out, float* drow, int64_t rows,
                                     FlashShape s) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerDotBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;  // whole warps leave together
  const int64_t t = row % s.seq, h = (row / s.seq) % s.heads, b = row / (s.seq * s.heads);
  const int64_t base = (b * s.seq + t) * s.heads * s.d + h * s.d;
  float acc = 0.0f;
  for (int64_t c = lane; c < s.d; c += kWarp) acc += ld(dout, base + c) * ld(out, base + c);
  acc = warp_sum(acc);
  if (lane == 0) drow[row] = acc;
}

// The query rows' lse and D of query block q0 of (b, h) into shared memory.
__device__ __forceinline__ void load_row_stats(const float* lse, const float* drow, int64_t b,
                                               int64_t h, int64_t q0, const FlashShape& s,
                                               float* row_lse, float* row_d) {
  const int x = threadIdx.x;
  if (x < s.tile) {
    const int64_t t = q0 + x, i = (b * s.heads + h) * s.seq + t;
    row_lse[x] = t < s.seq ? lse[i] : 0.0f;
    row_d[x] = t < s.seq ? drow[i] : 0.0f;
  }
}

__global__ void flash_backward_kv_kernel(DevPtr dout, DevPtr qkv, const float* lse,
                                         const float* drow, DevPtr dqkv, FlashShape s) {
  __shared__ float k[kTileStorage];
  __shared__ float v[kTileStorage];
  __shared__ float q[kTileStorage];
  __shared__ float dout_tile[kTileStorage];
  __shared__ float p[kMaxTileRows * kMaxTileRows];
  __shared__ float ds[kMaxTileRows * kMaxTileRows];
  __shared__ float row_lse[kMaxTileRows];
  __shared__ float row_d[kMaxTileRows];
  const int64_t kb = blockIdx.x % s.blocks;
  const int64_t g = (blockIdx.x / s.blocks) % s.kv_heads;
  const int64_t b = blockIdx.x / (s.blocks * s.kv_heads);
  const int64_t group = s.heads / s.kv_heads;
  const int64_t d = s.d, tile = s.tile, k0 = kb * tile;
  const int x = threadIdx.x;

  load_tile(qkv, s.width, (s.heads + g) * d, b, k0, s, k);
  load_tile(qkv, s.width, (s.heads + s.kv_heads + g) * d, b, k0, s, v);
  float dk[kAccPerThread] = {};
  float dv[kAccPerThread] = {};
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t qb = kb; qb < s.blocks; ++qb) {
      const int64_t q0 = qb * tile;
      __syncthreads();  // the previous tile's q, dout, p and ds are read
      load_tile(qkv, s.width, h * d, b, q0, s, q);
      load_tile(dout, s.heads * d, h * d, b, q0, s, dout_tile);
      load_row_stats(lse, drow, b, h, q0, s, row_lse, row_d);
      __syncthreads();
      grad_scores(q, k, dout_tile, v, row_lse, row_d, p, ds, q0, k0, s);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kAccPerThread; ++i) {
        const int64_t e = x + i * kFlashThreads;
        if (e < tile * d) {
          const int64_t j = e / d, c = e % d;
          float a = dv[i], bk = dk[i];
          for (int64_t r = 0; r < tile; ++r) {
            a += p[r * tile + j] * dout_tile[r * (d + 1) + c];
            bk += ds[r * tile + j] * q[r * (d + 1) + c];
          }
          dv[i] = a;
          dk[i] = bk;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) {
    const int64_t e = x + i * kFlashThreads;
    if (e < tile * d && k0 + e / d < s.seq) {
      const int64_t row = (b * s.seq + k0 + e / d) * s.width, c = e % d;
      st(dqkv, row + (s.heads + g) * d + c, dk[i]);
      st(dqkv, row + (s.heads + s.kv_heads + g) * d + c, dv[i]);
    }
  }
}

__global__ void flash_backward_q_kernel(DevPtr dout, DevPtr qkv, const float* lse,
                                        const float* drow, DevPtr dqkv, FlashShape s) {
  __shared__ float q[kTileStorage];
  __shared__ float dout_tile[kTileStorage];
  __shared__ float k[kTileStorage];
  __shared__ float v[kTileStorage];
  __shared__ float p[kMaxTileRows * kMaxTileRows];
  __shared__ float ds[kMaxTileRows * kMaxTileRows];
  __shared__ float row_lse[kMaxTileRows];
  __shared__ float row_d[kMaxTileRows];
  const int64_t qb = blockIdx.x % s.blocks;
  const int64_t h = (blockIdx.x / s.blocks) % s.heads;
  const int64_t b = blockIdx.x / (s.blocks * s.heads);
  const int64_t kvh = h / (s.heads / s.kv_heads);
  const int64_t d = s.d, tile = s.tile, q0 = qb * tile;
  const int x = threadIdx.x;

  load_tile(qkv, s.width, h * d, b, q0, s, q);
  load_tile(dout, s.heads * d, h * d, b, q0, s, dout_tile);
  load_row_stats(lse, drow, b, h, q0, s, row_lse, row_d);
  float dq[kAccPerThread] = {};
  for (int64_t kb = 0; kb <= qb; ++kb) {
    const int64_t k0 = kb * tile;
    __syncthreads();  // the previous tile's k and ds are read
    load_tile(qkv, s.width, (s.heads + kvh) * d, b, k0, s, k);
    load_tile(qkv, s.width, (s.heads + s.kv_heads + kvh) * d, b, k0, s, v);
    __syncthreads();
    grad_scores(q, k, dout_tile, v, row_lse, row_d, p, ds, q0, k0, s);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) {
      const int64_t e = x + i * kFlashThreads;
      if (e < tile * d) {
        const int64_t r = e / d, c = e % d;
        float a = dq[i];
        for (int64_t j = 0; j < tile; ++j) a += ds[r * tile + j] * k[j * (d + 1) + c];
        dq[i] = a;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) {
    const int64_t e = x + i * kFlashThreads;
    if (e < tile * d && q0 + e / d < s.seq) {
      st(dqkv, (b * s.seq + q0 + e / d) * s.width + h * d + e % d, dq[i]);
    }
  }
}

FlashShape flash_shape(int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  FlashShape s{};
  s.seq = seq;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.d = head_dim;
  s.width = (heads + 2 * kv_heads) * head_dim;
  s.tile = kTileFloats / head_dim < kMaxTileRows ? kTileFloats / head_dim : kMaxTileRows;
  s.blocks = (seq + s.tile - 1) / s.tile;
  s.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return s;
}

// The caller (kernels/cuda/cuda_kernels.cc) has checked that every grid fits in gridDim.x.
unsigned flash_grid(int64_t blocks) { return static_cast<unsigned>(blocks); }

}  // namespace

void flash_attention_forward(const Launch& l, DevPtr qkv, DevPtr out, float* lse, int64_t batch,
                             int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (batch == 0 || seq == 0 || head_dim == 0) return;
  const FlashShape s = flash_shape(seq, heads, kv_heads, head_dim);
  const unsigned grid = flash_grid(batch * heads * s.blocks);
  flash_forward_kernel<<<grid, kFlashThreads, 0, l.stream>>>(qkv, out, lse, s);
  PORTER_GPU_CHECK_LAUNCH("flash_forward_kernel", l.device);
}

void flash_attention_backward(const Launch& l, DevPtr dout, DevPtr qkv, DevPtr out,
                              const float* lse, float* drow, DevPtr dqkv, int64_t batch,
                              int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (batch == 0 || seq == 0 || head_dim == 0) return;
  const FlashShape s = flash_shape(seq, heads, kv_heads, head_dim);
  const int64_t rows = batch * heads * seq;
  const unsigned dot_grid = flash_grid((rows + kRowsPerDotBlock - 1) / kRowsPerDotBlock);
  flash_row_dot_kernel<<<dot_grid, kBlock, 0, l.stream>>>(dout, out, drow, rows, s);
  PORTER_GPU_CHECK_LAUNCH("flash_row_dot_kernel", l.device);
  const unsigned kv_grid = flash_grid(batch * kv_heads * s.blocks);
  flash_backward_kv_kernel<<<kv_grid, kFlashThreads, 0, l.stream>>>(dout, qkv, lse, drow, dqkv,
                                                                    s);
  PORTER_GPU_CHECK_LAUNCH("flash_backward_kv_kernel", l.device);
  const unsigned q_grid = flash_grid(batch * heads * s.blocks);
  flash_backward_q_kernel<<<q_grid, kFlashThreads, 0, l.stream>>>(dout, qkv, lse, drow, dqkv, s);
  PORTER_GPU_CHECK_LAUNCH("flash_backward_q_kernel", l.device);
}

}  // namespace porter::kernels::cuda
