// porter::zero::CpuAdam: AdamW over plain host arrays at memory speed, for ZeRO-Offload's
// host-side update: AVX-512, AVX2 or scalar code picked at run time, on its own std::thread
// pool, bit-identical to the cpu device's AdamW (kernels::Kernels::adamw).
//
// Note [CpuAdam bit identity]
// Every element is computed exactly as kernels/cpu/adamw.cc computes it, with each operation
// rounded to f32 in this order (the constants come from adamw_constants below):
//   grad  = load(g) * grad_scale                      load: exact widening of bf16 / f16
//   param = p * decay                                 decay = 1 - lr * wd
//   m     = m * beta1 + (1 - beta1) * grad
//   v     = v * beta2 + ((1 - beta2) * grad) * grad
//   denom = sqrt(v) / bc2_sqrt + eps                  bc2_sqrt = sqrt(1 - beta2^t)
//   param = param - step_size * (m / denom)           step_size = lr / (1 - beta1^t)
//   p, m, v = param, m, v;  out = round(param)        round: nearest-even (tensor/dtype.h)
// The vector code uses separate multiply, add, sqrt and divide instructions in that order and
// never an FMA: cpu_adam.cc (like kernels/cpu/adamw.cc) is compiled with -ffp-contract=off,
// since GCC's C++ default would fuse a multiply into the add that follows it. IEEE sqrt and
// division round correctly, so a lane gives the scalar bits. The bf16 and f16 conversions are
// the integer/float sequences of tensor/dtype.h, lane by lane (bf16 rounds to nearest-even and
// keeps NaN a NaN by setting bit 6; f16 keeps the top payload bits of a NaN, overflows to inf
// from 65520, rounds subnormals on the 2^-24 grid) rather than vcvtneps2bf16 (which flushes
// subnormals) or F16C, so they equal the reference for every input by construction. The
// result therefore does not depend on the ISA, the thread count or the tiling: the tests
// hold all three against the cpu device's kernel bitwise. One limit: when two different NaN
// payloads meet in one operation, x86 keeps the first operand's, and which operand is first
// is the compiler's choice in the reference; a NaN (or inf) from a single source, which is
// what an overflowing gradient gives, comes out identically.
//
// Note [CpuAdam roofline]
// An update reads every input once and writes every output once, with no reuse, so it is
// bound by memory bandwidth, not arithmetic (~16 flops per 28 bytes). Bytes per parameter:
//   read   grad 4 (2 for bf16/f16), master 4, m 4, v 4     = 16
//   write  master 4, m 4, v 4                              = 12   -> 28 bytes with f32 grads
//   + the working copy when written: 2 (bf16/f16) or 4 (f32)     -> 30 with bf16
// The target is this traffic at the machine's streaming bandwidth, which
// bench/cpu_adam_bench.cc measures in the same run as a STREAM triad (docs/benchmarks.md has
// the figures). The work is cut into tiles of kCpuAdamTileElems elements (240 KiB over the
// seven arrays): large enough that claiming one, an atomic add, costs nothing beside
// streaming it, and small enough that the threads finish together.
// Threads, the caller among them, claim tiles from an atomic counter, so a thread that was
// descheduled does not hold up the others.
//
// Note [CpuAdam working copy stores]
// The master, m and v are written to lines the update has just read, so their stores cost
// only the write-back. The working copy is written and not read: an ordinary store would
// first read each of its lines into the cache (write-allocate), a second 2 bytes per
// parameter, and leave them there, where the copy to the device does not need them. So a
// range whose working copy starts on a vector boundary writes it with non-temporal stores
// (vmovntdq, vmovntps), fenced (sfence) before the range returns; a misaligned one, and the last
// partial vector, use ordinary stores. The bits stored are the same either way.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "tensor/dtype.h"
#include "kernels/kernels.h"

namespace porter::zero {

// Instruction sets the kernel has code for, lowest first.
enum class CpuIsa : uint8_t {
  kScalar,  // baseline x86-64 (or any other CPU): one element at a time
  kAvx2,    // 8 lanes
  kAvx512,  // 16 lanes; AVX-512F, and BW for the masked 16-bit loads of the tail
};

// "scalar", "avx2" or "avx512".
std::string_view cpu_isa_name(CpuIsa isa);
// The best ISA this CPU runs (kernels::cpu::cpu_runs, Note [Cpu ISA dispatch]).
CpuIsa best_cpu_isa();
// Every ISA this CPU runs, lowest first; always starts with kScalar.
std::vector<CpuIsa> supported_cpu_isas();

// The per-step constants of Note [CpuAdam bit identity]: kernels::adamw_constants, which every
// AdamW implementation takes its constants from.
using kernels::AdamWConstants;
using kernels::adamw_constants;

// The arrays of one update, each of `elems` elements, on the host. None may overlap another.
struct CpuAdamArrays {
  float* params = nullptr;      // f32 master weights, updated in place
  float* exp_avg = nullptr;     // AdamW m, f32, updated in place
  float* exp_avg_sq = nullptr;  // AdamW v, f32, updated in place
  const void* grad = nullptr;   // grad_dtype (f32, bf16 or f16), read only
  tensor::DType grad_dtype = tensor::DType::kF32;
  void* out = nullptr;  // optional working copy (out_dtype); null: none
  tensor::DType out_dtype = tensor::DType::kBF16;
  int64_t elems = 0;
};

// The bytes an update over `a` moves (Note [CpuAdam roofline]): 28 per element with f32
// gradients and no working copy.
int64_t cpu_adam_bytes(const CpuAdamArrays& a);

// Updates elements [begin, end) of `a` on the calling thread with `isa`, which this CPU must
// run (InvalidArgument otherwise). No other validation: CpuAdam::update checks the arrays.
void cpu_adamw_range(CpuIsa isa, const CpuAdamArrays& a, const AdamWConstants& k, int64_t begin,
                     int64_t end);

// Elements per tile (Note [CpuAdam roofline]); a multiple of every ISA's vector width.
inline constexpr int64_t kCpuAdamTileElems = 8192;

struct CpuAdamOptions {
  int threads = 0;                   // threads that run an update, the caller included; 0:
                                     // std::thread::hardware_concurrency()
  CpuIsa max_isa = CpuIsa::kAvx512;  // use min(max_isa, best_cpu_isa()): tests force lower ones
  int64_t tile_elems = kCpuAdamTileElems;  // > 0; any value gives the same bits
};

// Owns threads() - 1 worker threads, started in the constructor and joined in the destructor;
// update() runs on them and on the calling thread, and returns when every element is written.
// Concurrent update() calls on one CpuAdam are serialised (each still uses every thread).
class CpuAdam {
 public:
  explicit CpuAdam(const CpuAdamOptions& options = {});
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  int threads() const { return threads_; }
  // The ISA the kernel runs: "avx512", "avx2" or "scalar".
  std::string_view isa() const { return cpu_isa_name(isa_); }
  CpuIsa isa_level() const { return isa_; }
  int64_t tile_elems() const { return tile_elems_; }

  // One AdamW step over `a` with `args` (Note [CpuAdam bit identity]). Throws InvalidArgument,
  // before touching any array, for a negative size, a null array (out excepted), a dtype
  // other than f32/bf16/f16, overlapping arrays, step < 1, lr < 0, eps <= 0 or a beta outside
  // [0, 1) -- the checks of kernels::Kernels::adamw.
  void update(const CpuAdamArrays& a, const kernels::AdamWArgs& args);

 private:
  class Pool;
  int threads_;
  CpuIsa isa_;
  int64_t tile_elems_;
  std::unique_ptr<Pool> pool_;  // owned; null when threads_ == 1
  std::mutex update_mu_;        // held for the whole of update(): one update at a time
};

}  // namespace porter::zero
