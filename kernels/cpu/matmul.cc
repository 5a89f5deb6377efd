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
// workspace_layout::CpuMatmul (kernels/workspace.h): 4·(batch·m·k + batch·k·n) bytes, plus
// 4·batch·m·n when out is f16 (matmul_workspace_bytes). Always widening, rather than trying
// oneDNN first, keeps the workspace an exact function of the call on every cpu, which the
// analytic memory model needs.
//
// Note [Matmul weight layout]
// oneDNN's brgemm matmul reads B (its "weights") either where the caller keeps it, in the
// plain row-major or transposed layout, or from the blocked layout its kernel prefers
// (format_tag::any), which a reorder writes first; and a 2-D f32 problem can also go through
// oneDNN's sgemm (its gemm:jit kernel, which packs both operands itself). Which is fastest
// depends on the shape and on the cpu. On a 2-core Intel Xeon with AMX, a plain f32 B with
// rows of 3072 floats (12 KiB, a multiple of the 4 KiB page) ran at 100-115 GFLOP/s, and the
// same product with B blocked, reorder included, at 210-220 (the MLP's fc2 dgrad and wgrad);
// on most other GPT shapes plain was as fast or faster, and the fc2 forward lost 15% blocked.
// On a Xeon without AMX the same two products took 99 and 103 ms plain, 49 and 38 blocked and
// 45 and 33 through sgemm. A weight gradient (dW = dY^T X) reads its A transposed; a row-major
// copy of it first (a reorder of the token rows, a few MB) is a fourth candidate, with B then
// read as oneDNN prefers: on a 2-core AMD EPYC (Zen 5) the MLP's fc2 weight gradient in bf16
// ran at 0.66-0.81 of the bf16 peak with A transposed and 0.85-0.90 in the row-major form.
// So the choice is measured, not assumed: the first time a problem (every MatmulProblem field,
// and the thread count) is seen, each candidate is timed on scratch operands of its shape (the
// best of three runs each, interleaved), and the fastest is kept where it is at least 10%
// faster than plain. Problems under kMinMeasuredFlops are not worth the timing and stay plain.
// Which candidates are timed, and how the choice is recorded, pinned and kept for the run, is
// Note [Kernel table] (kernels/kernel_table.cc): by default only those that give plain's bits.
//
// In f32 plain, blocked and the row-major copy of A give identical bits: oneDNN runs the same
// brgemm kernel over the same K blocks, only the panel copies of A and B differ (matmul_test
// checks this on the transformer's shapes, hidden 768 included). sgemm sums in its own order,
// and in bf16 with long K (2048 and up) the blocked kernel can too, so those are candidates
// only under porter.device.kernel_choice "fastest". PORTER_MATMUL_LAYOUT=plain (or blocked,
// gemm, widened, rows) forces the choice for every problem, and the table records it.
//
// Note [Widened bf16 matmul]
// A bf16 x bf16 matmul runs on the cpu's bf16 units: AMX tiles (brg:avx512_core_amx_bf16) or
// AVX512-BF16 dot products (brg:avx512_core_bf16). Without AMX the latter can be slower than
// the f32 kernels: on a 2-core Intel Xeon with AVX512-BF16 but no AMX, oneDNN's best bf16
// GEMM reached 167 GFLOP/s where its sgemm reached 314. So, measured like the weight layout
// and in the same table, a bf16 problem can instead run widened: A and B (and out, when out is
// 16-bit and beta != 0) are reordered into f32 copies with the same strides, the f32 problem
// runs on them (itself plain, blocked or through sgemm, as chosen for it), and a 16-bit out is
// rounded once, to nearest even, from the f32 result. The products of bf16 values are exact
// in f32 and accumulate in f32 either way, so the two differ only in summation order, as the
// blocked and plain bf16 kernels do; under kernel_choice "fastest" widened is kept when it is
// at least 10% faster, reorders included. The copies live in a second host buffer (widened_buffer_bytes), like the blocked
// copy of B below. PORTER_MATMUL_LAYOUT=widened always widens; plain and blocked never do.
//
// The blocked copy of B lives in one host buffer per DnnlMatmul, grown to the largest copy
// needed (blocked_buffer_bytes), beside oneDNN's own scratchpad and like it outside the
// device's capacity: it is the kernel's internal packing, not a tensor, and depends on a
// measurement, where kernel workspace must be an exact function of the call (Note [Kernel
// workspace] in kernels.h).
#include "kernels/cpu/matmul.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <spdlog/fmt/fmt.h>
#include <string>
#include <string_view>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernel_table.h"
#include "kernels/workspace.h"

namespace porter::kernels {
namespace {

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kF32: return dnnl::memory::data_type::f32;
    case DType::kBF16: return dnnl::memory::data_type::bf16;
    case DType::kF16: return dnnl::memory::data_type::f16;
    case DType::kI32: return dnnl::memory::data_type::s32;
    case DType::kI64:
    case DType::kBool: break;
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

// Problems smaller than this many flops are multiplied with B plain, unmeasured: timing
// them would cost more than any layout could win back.
constexpr double kMinMeasuredFlops = double{1 << 27};

// Elements an operand spans: one past its farthest element.
int64_t extent(const MatmulProblem& p, int64_t rows, int64_t cols, const int64_t strides[4]) {
  return 1 + (p.batch0 - 1) * strides[0] + (p.batch1 - 1) * strides[1] + (rows - 1) * strides[2] +
         (cols - 1) * strides[3];
}

size_t round_up_64(size_t bytes) { return (bytes + 63) / 64 * 64; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

MatmulLayout matmul_layout_from_env() {
  const char* v = std::getenv("PORTER_MATMUL_LAYOUT");
  if (v == nullptr || *v == '\0') return MatmulLayout::kMeasure;
  const std::string_view s(v);
  if (s == "measure") return MatmulLayout::kMeasure;
  if (s == "plain") return MatmulLayout::kPlain;
  if (s == "blocked") return MatmulLayout::kBlocked;
  if (s == "gemm") return MatmulLayout::kGemm;
  if (s == "widened") return MatmulLayout::kWidened;
  if (s == "rows") return MatmulLayout::kRows;
  throw InvalidArgument("PORTER_MATMUL_LAYOUT is \"" + std::string(s) +
                        "\"; use measure (the default), plain, blocked, gemm, widened or rows");
}

std::string_view layout_name(MatmulLayout layout) {
  switch (layout) {
    case MatmulLayout::kMeasure: return "measure";
    case MatmulLayout::kPlain: return "plain";
    case MatmulLayout::kBlocked: return "blocked";
    case MatmulLayout::kGemm: return "gemm";
    case MatmulLayout::kWidened: return "widened";
    case MatmulLayout::kRows: return "rows";
  }
  return "plain";
}

struct DnnlMatmul::Impl {
  struct Entry {
    dnnl::matmul primitive;
    dnnl::memory a, b, out;
    std::string impl_name;
    // With blocked weights: plain B is reordered into b_blocked, which the primitive reads.
    bool blocked = false;
    dnnl::reorder to_blocked;
    dnnl::memory b_blocked;
    size_t blocked_bytes = 0;
    // With A copied (Note [Matmul weight layout]): A, stored transposed, is reordered into the
    // row-major a_rows, which the primitive reads; a_rows_bytes is a multiple of 64, and the
    // copy comes first in the buffer it shares with b_blocked.
    bool a_copied = false;
    dnnl::reorder to_rows;
    dnnl::memory a_rows;
    size_t a_rows_bytes = 0;
    // With widened operands (Note [Widened bf16 matmul]): a, b and out are the caller's bf16
    // tensors, reordered into and out of the f32 copies a32, b32 and out32 (out32 only when
    // out is not f32), and the f32 problem f32_key runs on the copies.
    bool widened = false;
    ProblemKey f32_key{};
    dnnl::reorder a_to_f32, b_to_f32, out_to_f32, out_from_f32;
    dnnl::memory a32, b32, out32;
    size_t a32_bytes = 0, b32_bytes = 0, out32_bytes = 0;
    bool widen_out_first = false;  // out is 16-bit and beta != 0
    // Run through dnnl_sgemm (gemm_entry) rather than the primitive.
    struct Sgemm {
      bool on = false;
      char ta = 'N', tb = 'N';
      int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
      float alpha = 1.0f, beta = 0.0f;
    } gemm;
  };

  Impl(int n, MatmulLayout l, KernelTable* t)
      : threads(n),
        layout(l),
        own_table(t == nullptr ? std::make_unique<KernelTable>() : nullptr),
        table(t == nullptr ? own_table.get() : t),
        engine(dnnl::engine::kind::cpu, 0),
        stream(engine) {}

  static constexpr std::string_view kKind = "matmul";

  Entry& entry(const MatmulProblem& p) {
    // A pinned table replaces the choices: look every problem up again (Note [Kernel table]).
    if (const uint64_t g = table->generation(); g != table_generation) {
      cache.clear();
      table_generation = g;
    }
    ProblemKey key = key_of(p);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    const dnnl::memory::desc a_md = operand_desc(p, p.m, p.k, p.a_strides, p.a_dtype);
    const dnnl::memory::desc b_md = operand_desc(p, p.k, p.n, p.b_strides, p.b_dtype);
    const dnnl::memory::desc out_md = operand_desc(p, p.m, p.n, p.out_strides, p.out_dtype);
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
    // The candidate named `name`, or nullopt where it has no form for p.
    auto build = [&](std::string_view name) -> std::optional<Entry> {
      if (name == "plain") {
        return primitive_entry(
            dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, out_md), attr, engine),
            a_md, b_md, out_md);
      }
      if (name == "blocked") {
        Entry e = blocked_entry(p, a_md, b_md, out_md, attr);
        return e.blocked ? std::optional<Entry>(std::move(e)) : std::nullopt;
      }
      if (name == "gemm") {
        Entry e = gemm_entry(p);
        return e.gemm.on ? std::optional<Entry>(std::move(e)) : std::nullopt;
      }
      if (name == "rows") {
        Entry e = rows_entry(p, a_md, b_md, out_md, attr);
        return e.a_copied ? std::optional<Entry>(std::move(e)) : std::nullopt;
      }
      if (name == "widened" && p.a_dtype == DType::kBF16 && p.b_dtype == DType::kBF16) {
        return widened_entry(p, a_md, b_md, out_md);
      }
      return std::nullopt;
    };
    Entry chosen = choose(p, build);
    return cache.emplace(key, std::move(chosen)).first->second;
  }

  // The entry p runs with, and its record in the kernel table (Note [Kernel table]): forced by
  // the layout policy, as the table already says (pinned, or recorded by another user of the
  // table), plain under kMinMeasuredFlops, or the fastest of the candidates kernel_choice
  // allows, kept where it is at least 10% faster than plain (Note [Matmul weight layout]).
  template <typename Build>
  Entry choose(const MatmulProblem& p, Build& build) {
    const std::string tkey = table_key(p);
    auto plain_or = [&](std::string_view name) {
      if (name != "plain") {
        if (std::optional<Entry> e = build(name)) return std::move(*e);
      }
      return std::move(*build("plain"));
    };
    if (layout != MatmulLayout::kMeasure) {
      std::string name(layout_name(layout));
      Entry e = plain_or(name);
      table->replace(kKind, tkey, {std::string(chosen_name(e)), KernelTable::Source::kEnv,
                                   "PORTER_MATMUL_LAYOUT=" + name});
      return e;
    }
    if (std::optional<KernelTable::Entry> known = table->find(kKind, tkey)) {
      Entry e = plain_or(known->choice);
      if (chosen_name(e) != known->choice) {
        PORTER_LOG_WARN("the kernel table ({}) runs matmul {} as '{}', which this cpu cannot; "
                        "it runs plain",
                        table->origin(), tkey, known->choice);
      }
      return e;
    }
    if (flops_of(p) < kMinMeasuredFlops) {
      Entry e = std::move(*build("plain"));
      table->record(kKind, tkey, {"plain", KernelTable::Source::kFixed, "under 2^27 flops"});
      return e;
    }
    const bool all_f32 =
        p.a_dtype == DType::kF32 && p.b_dtype == DType::kF32 && p.out_dtype == DType::kF32;
    std::vector<std::string_view> allowed = {"plain"};
    if (table->mode() == KernelChoice::kFastest) {
      allowed.insert(allowed.end(), {"blocked", "rows", "gemm", "widened"});
    } else if (all_f32) {
      allowed.insert(allowed.end(), {"blocked", "rows"});  // plain's bits in f32
    }
    std::vector<Entry> candidates;
    std::vector<std::string_view> names;
    for (std::string_view name : allowed) {
      std::optional<Entry> e = build(name);
      if (!e) continue;
      // Under exact, the blocked B and the copied A give plain's bits only where both run
      // oneDNN's brgemm (Note [Matmul weight layout]); another kernel is no candidate.
      if (table->mode() == KernelChoice::kExact && !candidates.empty() &&
          (!candidates[0].impl_name.starts_with("brg") || !e->impl_name.starts_with("brg"))) {
        continue;
      }
      candidates.push_back(std::move(*e));
      names.push_back(name);
    }
    if (candidates.size() == 1) {
      table->record(kKind, tkey,
                    {"plain", KernelTable::Source::kFixed,
                     std::string("kernel_choice ") +
                         std::string(kernel_choice_name(table->mode())) + ": no other candidate"});
      return std::move(candidates[0]);
    }
    // One measurement at a time in the process, and never twice for one problem of a table.
    std::lock_guard measuring(KernelTable::measurement_mutex());
    if (std::optional<KernelTable::Entry> known = table->find(kKind, tkey)) {
      for (size_t i = 0; i < names.size(); ++i) {
        if (names[i] == known->choice) return std::move(candidates[i]);
      }
      return std::move(candidates[0]);
    }
    std::vector<Entry*> timed;
    for (Entry& e : candidates) timed.push_back(&e);
    const std::vector<double> seconds = time_all(p, timed);
    size_t best = 0;
    std::string timings;
    for (size_t i = 0; i < seconds.size(); ++i) {
      if (i > 0 && seconds[i] < 0.9 * seconds[0] && seconds[i] < seconds[best]) best = i;
      timings += fmt::format("{}{} {:.3f} ms", i > 0 ? ", " : "", names[i], seconds[i] * 1e3);
    }
    PORTER_LOG_DEBUG("matmul {}: {}: {}", tkey, timings, candidates[best].impl_name);
    table->record(kKind, tkey,
                  {std::string(names[best]), KernelTable::Source::kMeasured, timings});
    return std::move(candidates[best]);
  }

  // The table's name for the candidate e is.
  static std::string_view chosen_name(const Entry& e) {
    if (e.widened) return "widened";
    if (e.gemm.on) return "gemm";
    if (e.a_copied) return "rows";
    if (e.blocked) return "blocked";
    return "plain";
  }

  // The problem as the kernel table keys it: every MatmulProblem field and the thread count,
  // readable.
  std::string table_key(const MatmulProblem& p) const {
    auto st = [](const int64_t (&s)[4]) { return fmt::format("{},{},{},{}", s[0], s[1], s[2], s[3]); };
    return fmt::format("{}x{}->{} m {} n {} k {} batch {}x{} a ({}) b ({}) out ({}) alpha {} beta {} "
                       "threads {}",
                       dtype_name(p.a_dtype), dtype_name(p.b_dtype), dtype_name(p.out_dtype), p.m,
                       p.n, p.k, p.batch0, p.batch1, st(p.a_strides), st(p.b_strides),
                       st(p.out_strides), p.alpha, p.beta, threads);
  }

  // The entry that runs bf16 problem p on f32 copies of its operands (Note [Widened bf16
  // matmul]); creates the f32 problem's entry first.
  Entry widened_entry(const MatmulProblem& p, const dnnl::memory::desc& a_md,
                      const dnnl::memory::desc& b_md, const dnnl::memory::desc& out_md) {
    MatmulProblem p32 = p;
    p32.a_dtype = p32.b_dtype = p32.out_dtype = DType::kF32;
    const Entry& f32 = entry(p32);
    Entry e;
    e.widened = true;
    e.f32_key = key_of(p32);
    e.impl_name = f32.impl_name + ", bf16 widened to f32";
    const dnnl::memory::desc a32_md = operand_desc(p32, p.m, p.k, p.a_strides, DType::kF32);
    const dnnl::memory::desc b32_md = operand_desc(p32, p.k, p.n, p.b_strides, DType::kF32);
    const dnnl::memory::desc out32_md = operand_desc(p32, p.m, p.n, p.out_strides, DType::kF32);
    e.a = dnnl::memory(a_md, engine, nullptr);
    e.b = dnnl::memory(b_md, engine, nullptr);
    e.out = dnnl::memory(out_md, engine, nullptr);
    e.a32 = dnnl::memory(a32_md, engine, nullptr);
    e.b32 = dnnl::memory(b32_md, engine, nullptr);
    e.a_to_f32 = dnnl::reorder(e.a, e.a32);
    e.b_to_f32 = dnnl::reorder(e.b, e.b32);
    e.a32_bytes = round_up_64(a32_md.get_size());
    e.b32_bytes = round_up_64(b32_md.get_size());
    if (p.out_dtype != DType::kF32) {
      e.out32 = dnnl::memory(out32_md, engine, nullptr);
      e.out32_bytes = round_up_64(out32_md.get_size());
      e.out_from_f32 = dnnl::reorder(e.out32, e.out);
      e.widen_out_first = p.beta != 0.0f;
      if (e.widen_out_first) e.out_to_f32 = dnnl::reorder(e.out, e.out32);
    }
    return e;
  }

  static double flops_of(const MatmulProblem& p) {
    return 2.0 * static_cast<double>(p.batch0 * p.batch1) * static_cast<double>(p.m) *
           static_cast<double>(p.n) * static_cast<double>(p.k);
  }

  // The entry that runs primitive pd on the caller's operands, as a_md, b_md and out_md lay
  // them out (pd may read A or B from copies: see read_b_blocked and rows_entry).
  Entry primitive_entry(const dnnl::matmul::primitive_desc& pd, const dnnl::memory::desc& a_md,
                        const dnnl::memory::desc& b_md, const dnnl::memory::desc& out_md) {
    Entry e;
    e.primitive = dnnl::matmul(pd);
    e.a = dnnl::memory(a_md, engine, nullptr);
    e.b = dnnl::memory(b_md, engine, nullptr);
    e.out = dnnl::memory(out_md, engine, nullptr);
    e.impl_name = pd.impl_info_str();
    return e;
  }

  // Makes e reorder the caller's B into blocked_md (the layout e's primitive reads) first.
  void read_b_blocked(Entry& e, const dnnl::memory::desc& blocked_md) {
    e.blocked = true;
    e.b_blocked = dnnl::memory(blocked_md, engine, nullptr);
    e.to_blocked = dnnl::reorder(e.b, e.b_blocked);
    e.blocked_bytes = blocked_md.get_size();
    e.impl_name += ", blocked weights";
  }

  // The primitive that reads B in oneDNN's preferred layout, and the reorder into it; an
  // entry with blocked = false when that layout is B's own or oneDNN cannot reorder into it.
  Entry blocked_entry(const MatmulProblem& p, const dnnl::memory::desc& a_md,
                      const dnnl::memory::desc& b_md, const dnnl::memory::desc& out_md,
                      const dnnl::primitive_attr& attr) {
    try {
      const dnnl::memory::desc any_md(b_md.dims(), dnnl_type(p.b_dtype),
                                      dnnl::memory::format_tag::any);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, any_md, out_md), attr, engine);
      if (pd.weights_desc() == b_md) return {};
      Entry e = primitive_entry(pd, a_md, b_md, out_md);
      read_b_blocked(e, pd.weights_desc());
      return e;
    } catch (const dnnl::error&) {
      return {};  // no blocked form for this problem: it stays plain
    }
  }

  // The primitive that reads a row-major copy of A, where p stores A transposed (the weight
  // gradient's form, dW = dY^T X), and B in oneDNN's preferred layout, reordered as in
  // blocked_entry where that is not B's own; an entry with a_copied = false otherwise.
  Entry rows_entry(const MatmulProblem& p, const dnnl::memory::desc& a_md,
                   const dnnl::memory::desc& b_md, const dnnl::memory::desc& out_md,
                   const dnnl::primitive_attr& attr) {
    if (p.a_strides[3] == 1 || p.a_strides[2] != 1) return {};  // A is not stored transposed
    try {
      const dnnl::memory::dims dims = a_md.dims();
      dnnl::memory::dims st(dims.size());
      int64_t stride = 1;
      for (size_t d = dims.size(); d-- > 0;) {
        st[d] = stride;
        stride *= dims[d];
      }
      const dnnl::memory::desc rows_md(dims, dnnl_type(p.a_dtype), st);
      const dnnl::memory::desc any_md(b_md.dims(), dnnl_type(p.b_dtype),
                                      dnnl::memory::format_tag::any);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(rows_md, any_md, out_md), attr,
                                            engine);
      Entry e = primitive_entry(pd, a_md, b_md, out_md);
      e.a_copied = true;
      e.a_rows = dnnl::memory(rows_md, engine, nullptr);
      e.to_rows = dnnl::reorder(e.a, e.a_rows);
      e.a_rows_bytes = round_up_64(rows_md.get_size());
      e.impl_name += ", A copied row-major";
      if (pd.weights_desc() != b_md) read_b_blocked(e, pd.weights_desc());
      return e;
    } catch (const dnnl::error&) {
      return {};  // oneDNN cannot copy or multiply this form: it is not a candidate
    }
  }

  // p through oneDNN's sgemm (the gemm:jit kernel) instead of its matmul primitive: f32, one
  // batch, each operand with a unit stride; an entry with gemm.on = false otherwise.
  Entry gemm_entry(const MatmulProblem& p) {
    if (p.a_dtype != DType::kF32 || p.b_dtype != DType::kF32 || p.out_dtype != DType::kF32) return {};
    if (p.batch0 != 1 || p.batch1 != 1 || p.out_strides[3] != 1) return {};
    Entry e;
    auto form = [](const int64_t (&st)[4], char* trans, int64_t* ld) {
      if (st[3] == 1) {
        *trans = 'N';
        *ld = st[2];
      } else if (st[2] == 1) {
        *trans = 'T';
        *ld = st[3];
      } else {
        return false;
      }
      return true;
    };
    if (!form(p.a_strides, &e.gemm.ta, &e.gemm.lda) || !form(p.b_strides, &e.gemm.tb, &e.gemm.ldb)) {
      return {};
    }
    // sgemm wants ld at least the stored row's length.
    if (e.gemm.lda < (e.gemm.ta == 'N' ? p.k : p.m) || e.gemm.ldb < (e.gemm.tb == 'N' ? p.n : p.k) ||
        p.out_strides[2] < p.n) {
      return {};
    }
    e.gemm.on = true;
    e.gemm.m = p.m;
    e.gemm.n = p.n;
    e.gemm.k = p.k;
    e.gemm.ldc = p.out_strides[2];
    e.gemm.alpha = p.alpha;
    e.gemm.beta = p.beta;
    e.impl_name = "sgemm";
    return e;
  }

  // The fastest of three runs of each entry, interleaved so that a busy moment on a shared
  // machine slows all alike, after one untimed run of each; on scratch operands of p's shape
  // (bytes 0x3c: 0.0115 in f32 and in bf16, no denormals or infinities).
  std::vector<double> time_all(const MatmulProblem& p, const std::vector<Entry*>& entries) {
    auto scratch = [](int64_t elems, DType dtype) {
      return std::vector<char>(static_cast<size_t>(elems) * dtype_size(dtype), 0x3c);
    };
    std::vector<char> a = scratch(extent(p, p.m, p.k, p.a_strides), p.a_dtype);
    std::vector<char> b = scratch(extent(p, p.k, p.n, p.b_strides), p.b_dtype);
    std::vector<char> out = scratch(extent(p, p.m, p.n, p.out_strides), p.out_dtype);
    std::vector<double> best(entries.size(), 1e30);
    for (int run = 0; run < 4; ++run) {
      for (size_t which = 0; which < entries.size(); ++which) {
        const auto t0 = std::chrono::steady_clock::now();
        execute(*entries[which], a.data(), b.data(), out.data());
        if (run > 0) best[which] = std::min(best[which], seconds_since(t0));
      }
    }
    return best;
  }

  void execute(Entry& e, const void* a, const void* b, void* out) {
    omp_set_num_threads(threads);
    if (e.gemm.on) {
      const Entry::Sgemm& g = e.gemm;
      const dnnl_status_t status =
          dnnl_sgemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, static_cast<const float*>(a), g.lda,
                     static_cast<const float*>(b), g.ldb, g.beta, static_cast<float*>(out), g.ldc);
      PORTER_ASSERT(status == dnnl_success, "dnnl_sgemm failed with status ", status);
      return;
    }
    e.a.set_data_handle(const_cast<void*>(a));
    e.b.set_data_handle(const_cast<void*>(b));
    e.out.set_data_handle(out);
    if (e.widened) {
      execute_widened(e);
      return;
    }
    if (e.a_copied || e.blocked) {
      char* base = cpu::aligned_bytes(blocked_buffer, e.a_rows_bytes + e.blocked_bytes);
      if (e.a_copied) {
        e.a_rows.set_data_handle(base);
        e.to_rows.execute(stream, e.a, e.a_rows);
      }
      if (e.blocked) {
        e.b_blocked.set_data_handle(base + e.a_rows_bytes);
        e.to_blocked.execute(stream, e.b, e.b_blocked);
      }
    }
    e.primitive.execute(stream, {{DNNL_ARG_SRC, e.a_copied ? e.a_rows : e.a},
                                 {DNNL_ARG_WEIGHTS, e.blocked ? e.b_blocked : e.b},
                                 {DNNL_ARG_DST, e.out}});
    stream.wait();
  }

  // Note [Widened bf16 matmul]: e's operands are bound; widen them, run the f32 problem and
  // round a 16-bit out.
  void execute_widened(Entry& e) {
    char* base = cpu::aligned_bytes(widened_buffer, e.a32_bytes + e.b32_bytes + e.out32_bytes);
    e.a32.set_data_handle(base);
    e.b32.set_data_handle(base + e.a32_bytes);
    e.a_to_f32.execute(stream, e.a, e.a32);
    e.b_to_f32.execute(stream, e.b, e.b32);
    void* out32 = e.out.get_data_handle();
    if (e.out32_bytes != 0) {
      out32 = base + e.a32_bytes + e.b32_bytes;
      e.out32.set_data_handle(out32);
      if (e.widen_out_first) e.out_to_f32.execute(stream, e.out, e.out32);
    }
    stream.wait();
    execute(cache.at(e.f32_key), e.a32.get_data_handle(), e.b32.get_data_handle(), out32);
    if (e.out32_bytes != 0) {
      e.out_from_f32.execute(stream, e.out32, e.out);
      stream.wait();
    }
  }

  int threads;
  MatmulLayout layout;
  std::unique_ptr<KernelTable> own_table;  // when the caller gave none
  KernelTable* table;                      // own_table or the caller's; outlives this
  uint64_t table_generation = 0;           // the table's generation the cache was chosen at
  dnnl::engine engine;
  dnnl::stream stream;
  mutable std::mutex mu;  // guards cache and blocked_buffer, and serialises runs (one stream)
  std::map<ProblemKey, Entry> cache;
  std::vector<std::byte> blocked_buffer;
  std::vector<std::byte> widened_buffer;  // Note [Widened bf16 matmul]
};

DnnlMatmul::DnnlMatmul(int threads, MatmulLayout layout, KernelTable* table)
    : impl_(std::make_unique<Impl>(threads, layout, table)) {}
DnnlMatmul::~DnnlMatmul() = default;

void DnnlMatmul::run(const MatmulProblem& p, const void* a, const void* b, void* out) {
  if (p.m == 0 || p.n == 0 || p.batch0 == 0 || p.batch1 == 0) return;
  PORTER_ASSERT(p.k > 0, "matmul with K = 0 must be handled by the caller");
  std::lock_guard lock(impl_->mu);
  impl_->execute(impl_->entry(p), a, b, out);
}

size_t DnnlMatmul::cached_primitives() const {
  std::lock_guard lock(impl_->mu);
  return impl_->cache.size();
}

std::string DnnlMatmul::implementation(const MatmulProblem& p) {
  std::lock_guard lock(impl_->mu);
  return impl_->entry(p).impl_name;
}

bool DnnlMatmul::blocked_weights(const MatmulProblem& p) {
  std::lock_guard lock(impl_->mu);
  return impl_->entry(p).blocked;
}

size_t DnnlMatmul::blocked_buffer_bytes() const {
  std::lock_guard lock(impl_->mu);
  return impl_->blocked_buffer.size();
}

bool DnnlMatmul::widened_operands(const MatmulProblem& p) {
  std::lock_guard lock(impl_->mu);
  return impl_->entry(p).widened;
}

size_t DnnlMatmul::widened_buffer_bytes() const {
  std::lock_guard lock(impl_->mu);
  return impl_->widened_buffer.size();
}

MatmulProblem matmul_problem(const Tensor& a, const Tensor& b, const Tensor& out,
                             const MatmulSpec& spec) {
  const int64_t a_rows = a.dim(-2), a_cols = a.dim(-1);
  const int64_t b_rows = b.dim(-2), b_cols = b.dim(-1);
  MatmulProblem p;
  p.batch0 = a.rank() == 3 ? a.dim(0) : 1;
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
  return p;
}

void CpuKernels::do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) {
  // Shapes were validated by Kernels::matmul; rank 2 or 3, row-major.
  MatmulProblem p = matmul_problem(a, b, out, spec);
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

}  // namespace porter::kernels
