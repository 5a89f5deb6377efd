// The cpu feature query of Note [Cpu ISA dispatch] (kernels/cpu/isa.h).
#include "kernels/cpu/isa.h"

#include <array>
#include <utility>

#include "base/error.h"

namespace porter::kernels::cpu {
namespace {

using Field = bool CpuFeatures::*;

// Each feature's name in the target attribute's spelling, and its field.
constexpr std::array<std::pair<std::string_view, Field>, 11> kFeatures{{
    {"sse4.2", &CpuFeatures::sse42},
    {"avx2", &CpuFeatures::avx2},
    {"fma", &CpuFeatures::fma},
    {"f16c", &CpuFeatures::f16c},
    {"avx512f", &CpuFeatures::avx512f},
    {"avx512bw", &CpuFeatures::avx512bw},
    {"avx512dq", &CpuFeatures::avx512dq},
    {"avx512vl", &CpuFeatures::avx512vl},
    {"avx512bf16", &CpuFeatures::avx512bf16},
    {"amx-tile", &CpuFeatures::amx_tile},
    {"amx-bf16", &CpuFeatures::amx_bf16},
}};

CpuFeatures read_features() {
  CpuFeatures f;
#if PORTER_CPU_X86
  // __builtin_cpu_supports takes only literals, hence one line per feature.
  __builtin_cpu_init();
  f.sse42 = __builtin_cpu_supports("sse4.2");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  f.amx_tile = __builtin_cpu_supports("amx-tile");
  f.amx_bf16 = __builtin_cpu_supports("amx-bf16");
#endif
  return f;
}

Field field_of(std::string_view name) {
  for (const auto& [n, field] : kFeatures) {
    if (n == name) return field;
  }
  std::string known;
  for (const auto& [n, field] : kFeatures) known += (known.empty() ? "" : " ") + std::string(n);
  throw InvalidArgument("cpu_runs: unknown cpu feature \"" + std::string(name) +
                        "\"; the known ones are " + known);
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = read_features();
  return features;
}

bool cpu_runs(std::string_view isa) {
  const CpuFeatures& f = cpu_features();
  bool runs = true;
  while (!isa.empty()) {
    const size_t comma = isa.find(',');
    const std::string_view name = isa.substr(0, comma);
    runs = f.*field_of(name) && runs;  // every name is checked, known or not
    isa = comma == std::string_view::npos ? std::string_view{} : isa.substr(comma + 1);
  }
  return runs;
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string out;
  for (const auto& [name, field] : kFeatures) {
    if (!(f.*field)) continue;
    if (!out.empty()) out += ' ';
    out += name;
  }
  return out;
}

}  // namespace porter::kernels::cpu
