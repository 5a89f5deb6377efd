// EMULATION ONLY: runs kernels on host threads, one std::thread per CUDA thread, one block
// at a time (so function-static "shared" memory is per block).
#pragma once
#include <cuda_runtime_api.h>
#include <barrier>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline

namespace emu {
struct WarpCtx {
  float f[32];
  unsigned u[32];
  std::barrier<> bar{32};
};
inline thread_local std::barrier<>* block_bar = nullptr;
inline thread_local WarpCtx* warp_ctx = nullptr;
inline thread_local int lane_id = 0;
}  // namespace emu

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  auto* w = emu::warp_ctx;
  w->f[emu::lane_id] = v;
  w->bar.arrive_and_wait();
  float r = w->f[emu::lane_id ^ off];
  w->bar.arrive_and_wait();
  return r;
}
inline unsigned __ballot_sync(unsigned, bool p) {
  auto* w = emu::warp_ctx;
  w->u[emu::lane_id] = p ? 1u : 0u;
  w->bar.arrive_and_wait();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) if (w->u[i]) r |= 1u << i;
  w->bar.arrive_and_wait();
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// The round-to-nearest intrinsics: one f32 operation each. run.sh builds with
// -ffp-contract=off, so the host compiler does not fuse them either.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

template <typename K, typename... A>
void emu_launch(K kernel, dim3 grid, dim3 block, A... args) {
  const unsigned nt = block.x * block.y * block.z;
  if (nt % 32 != 0) throw std::runtime_error("emu: block not a multiple of 32");
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(nt);
        std::unique_ptr<emu::WarpCtx[]> warps(new emu::WarpCtx[nt / 32]);
        std::vector<std::thread> threads;
        threads.reserve(nt);
        for (unsigned t = 0; t < nt; ++t) {
          threads.emplace_back([&, t] {
            threadIdx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            blockIdx = uint3{bx, by, bz};
            blockDim = block;
            gridDim = grid;
            emu::block_bar = &bar;
            emu::warp_ctx = &warps[t / 32];
            emu::lane_id = static_cast<int>(t % 32);
            kernel(args...);
          });
        }
        for (auto& th : threads) th.join();
      }
}
