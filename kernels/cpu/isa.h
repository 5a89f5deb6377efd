// The cpu ISA dispatch: how porter's own vector code targets more than the x86-64 baseline,
// and which instructions this cpu runs. Every cpu kernel file and the host AdamW
// (zero/cpu_adam.cc) take both from here.
//
// Note [Cpu ISA dispatch]
// The project builds for the x86-64 baseline. Code for a wider ISA is compiled in one of two
// ways, both spelled here and nowhere else:
// - PORTER_CPU_CLONES on a `#pragma omp simd` loop compiles it three times (x86-64-v4,
//   x86-64-v3 and the baseline); the loader's ifunc resolver picks one clone per process.
//   A clone changes the vector width, not the arithmetic: the loops give the same bits in
//   every clone (Note [Cpu vectorisation] in kernels/cpu/cpu_kernels.h; the AdamW loops are
//   compiled with -ffp-contract=off so that no clone fuses a multiply-add, Note [CpuAdam bit
//   identity] in zero/cpu_adam.h).
// - PORTER_CPU_TARGET(isa) on a function written with intrinsics compiles it for the feature
//   list `isa` (one of the PORTER_ISA_* strings). Such a function runs only after
//   cpu_runs(isa) said yes for the same string, so the attribute and the run-time check cannot
//   disagree: the host AdamW's AVX2 and AVX-512 kernels (PORTER_ISA_AVX2, PORTER_ISA_AVX512)
//   and the attention head tiles (PORTER_ISA_TILES_F32, PORTER_ISA_TILES_BF16, Note [Attention
//   head tiles] in kernels/cpu/attention_heads.cc), and the state files' CRC-32C
//   (PORTER_ISA_CRC32, io/state_file.cc).
// cpu_features() reads the cpu's feature bits once (__builtin_cpu_supports) for both and for
// anything that reports them. The matmul (kernels/cpu/matmul.cc) runs oneDNN, which
// dispatches on the same cpu itself (AMX, AVX512-BF16, AVX-512, AVX2); its implementation
// name says which kernel it took ("brg:avx512_core_amx_bf16", ...), and the measured choices
// of Note [Kernel table] depend on the cpu only through those timings.
#pragma once

#include <string>
#include <string_view>

#if defined(__x86_64__) && defined(__GNUC__)
#define PORTER_CPU_X86 1
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves, which
// -Wmaybe-uninitialized reports at every use (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define PORTER_CPU_X86 0
#endif

// Not under the sanitizers: a clone's ifunc resolver runs while the dynamic loader relocates
// the binary, before the sanitizer's runtime is up, and ThreadSanitizer's instrumented
// resolvers crashed there on a Zen 5 cpu (SIGSEGV before main).
#if PORTER_CPU_X86 && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define PORTER_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PORTER_CPU_CLONES
#endif

// The feature lists porter's intrinsics code is written for, in the target attribute's
// spelling; cpu_runs() takes the same strings.
#define PORTER_ISA_CRC32 "sse4.2"
#define PORTER_ISA_AVX2 "avx2"
#define PORTER_ISA_AVX512 "avx512f,avx512bw"
#define PORTER_ISA_TILES_F32 "avx512f,avx512dq,avx512bw,avx512vl,fma"
#define PORTER_ISA_TILES_BF16 PORTER_ISA_TILES_F32 ",avx512bf16"

#if PORTER_CPU_X86
#define PORTER_CPU_TARGET(isa) __attribute__((target(isa)))
#endif

namespace porter::kernels::cpu {

// The instruction-set features porter's code and oneDNN choose between, as this cpu reports
// them. All false off x86-64.
struct CpuFeatures {
  bool sse42 = false;  // crc32 (the training-state files' CRC-32C, io/state_file.cc)
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
};

// This cpu's features, read once.
const CpuFeatures& cpu_features();

// Whether this cpu runs every feature in `isa`, a comma-separated list in the target
// attribute's spelling (a PORTER_ISA_* string: "avx512f,avx512bw"). Throws InvalidArgument on
// a feature name CpuFeatures does not hold. False for any non-empty list off x86-64.
bool cpu_runs(std::string_view isa);

// The features this cpu has, space-separated in the target attribute's spelling ("avx2 fma
// f16c avx512f ..."); empty when it has none of them.
std::string cpu_features_string();

}  // namespace porter::kernels::cpu
