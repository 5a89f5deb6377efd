// The table of a run's kernel choices, and its JSON form (checkpoints, reports, pinned files).
//
// Note [Kernel table]
// Some kernels have several implementations of one problem and pick by timing them at first
// use: the cpu matmul's operand layouts (Note [Matmul weight layout] in kernels/cpu/matmul.cc) and the
// cpu attention's head tiles against oneDNN (Note [Attention head tiles]). Timings differ
// between processes, so a choice made by timing alone can differ between two runs, or two
// ranks, of one config; where the candidates sum in different orders, so do the results.
//
// porter's promise is that two runs of one config on one machine agree bit for bit with
// nothing pinned, so by default (porter.device.kernel_choice "exact") a measurement only
// chooses among candidates that give the same bits:
// - f32 matmul: B plain, B blocked and A copied row-major, which run oneDNN's brgemm over the
//   same K blocks and differ only in how the panels are copied (matmul_test checks their bits
//   on the transformer's shapes at hidden 768); not sgemm, which sums in its own order;
// - bf16 and f16 matmul: plain only (the blocked bf16 kernel and the widened f32 path can sum
//   in another order at long K);
// - cpu attention: the head tiles wherever the cpu has their instructions, oneDNN elsewhere,
//   both without timing.
// So each rank may time the f32 candidates for itself and still compute the same bits as any
// other rank or process; the table it records is the same up to which equivalent candidate
// won. kernel_choice "fastest" also times sgemm, the widened bf16 path, bf16 blocked and
// row-copied B and oneDNN's attention; its choices change bits, so two such runs agree only
// when the second pins the first's table (porter.device.kernel_table names a file that
// holds one: a table, a report, or a training checkpoint), and a resumed run pins the table
// its checkpoint holds. With several ranks, rank 0's table replaces the others' after the
// first step, so from the second step on every rank computes the same way (in the first
// step of a fastest run, ranks may choose differently; with exact, nothing changes).
//
// Why not a per-machine cache: the first run on a new machine would still measure, and two
// ranks (or two concurrent runs) measuring at once could disagree; the cache would also make a
// run's bits depend on a file outside its config. A pinned table is that file, named.
//
// The cost of exact against fastest is what the left-out candidates win where they are
// fastest; bench/compare_step.sh measures the GPT step under both (docs/benchmarks.md,
// "Kernel choice").
//
// The environment overrides (PORTER_MATMUL_LAYOUT, PORTER_CPU_ATTENTION) still force a
// choice, recorded with source "env"; a choice pinned for a problem the cpu cannot run that
// way (another cpu's table) is replaced by the default, with a warning.
#include "kernels/kernel_table.h"

#include "base/error.h"

namespace porter::kernels {

std::string_view kernel_choice_name(KernelChoice c) {
  return c == KernelChoice::kFastest ? "fastest" : "exact";
}

KernelChoice kernel_choice_from_name(std::string_view name, std::string_view what) {
  if (name == "exact") return KernelChoice::kExact;
  if (name == "fastest") return KernelChoice::kFastest;
  throw InvalidArgument(std::string(what) + ": expected \"exact\" or \"fastest\", got \"" +
                        std::string(name) + "\"");
}

std::string_view source_name(KernelTable::Source s) {
  switch (s) {
    case KernelTable::Source::kFixed: return "fixed";
    case KernelTable::Source::kMeasured: return "measured";
    case KernelTable::Source::kEnv: return "env";
    case KernelTable::Source::kPinned: return "pinned";
  }
  return "fixed";
}

KernelChoice KernelTable::mode() const {
  std::lock_guard lock(mu_);
  return mode_;
}

void KernelTable::set_mode(KernelChoice mode) {
  std::lock_guard lock(mu_);
  mode_ = mode;
}

std::optional<KernelTable::Entry> KernelTable::find(std::string_view kind,
                                                    const std::string& key) const {
  std::lock_guard lock(mu_);
  const auto it = entries_.find({std::string(kind), key});
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

KernelTable::Entry KernelTable::record(std::string_view kind, const std::string& key,
                                       Entry entry) {
  std::lock_guard lock(mu_);
  return entries_.try_emplace({std::string(kind), key}, std::move(entry)).first->second;
}

void KernelTable::replace(std::string_view kind, const std::string& key, Entry entry) {
  std::lock_guard lock(mu_);
  entries_[{std::string(kind), key}] = std::move(entry);
}

void KernelTable::pin(const nlohmann::json& table, const std::string& origin) {
  const std::string where = origin + ": ";
  if (!table.is_object() || !table.contains("entries") || !table.at("entries").is_array()) {
    throw InvalidArgument(where + "not a kernel table (needs an \"entries\" array, as porter "
                          "writes in a report's \"kernel_table\" or a checkpoint's meta.json)");
  }
  std::map<std::pair<std::string, std::string>, Entry> pinned;
  for (const nlohmann::json& e : table.at("entries")) {
    if (!e.is_object() || !e.contains("kind") || !e.contains("key") || !e.contains("choice") ||
        !e.at("kind").is_string() || !e.at("key").is_string() || !e.at("choice").is_string()) {
      throw InvalidArgument(where + "kernel table entry " + e.dump() +
                            " needs string \"kind\", \"key\" and \"choice\"");
    }
    Entry entry{e.at("choice").get<std::string>(), Source::kPinned,
                e.value("source", std::string("measured"))};
    pinned[{e.at("kind").get<std::string>(), e.at("key").get<std::string>()}] = std::move(entry);
  }
  std::lock_guard lock(mu_);
  entries_ = std::move(pinned);
  origin_ = origin;
  ++generation_;
}

nlohmann::json KernelTable::to_json() const {
  std::lock_guard lock(mu_);
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& [key, e] : entries_) {
    entries.push_back({{"kind", key.first},
                       {"key", key.second},
                       {"choice", e.choice},
                       {"source", std::string(source_name(e.source))},
                       {"detail", e.detail}});
  }
  return {{"kernel_choice", std::string(kernel_choice_name(mode_))},
          {"origin", origin_.empty() ? std::string("measured in this run") : origin_},
          {"entries", std::move(entries)}};
}

std::string KernelTable::origin() const {
  std::lock_guard lock(mu_);
  return origin_.empty() ? "measured in this run" : origin_;
}

size_t KernelTable::size() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

size_t KernelTable::count(Source source) const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [key, e] : entries_) n += e.source == source ? 1 : 0;
  return n;
}

uint64_t KernelTable::generation() const {
  std::lock_guard lock(mu_);
  return generation_;
}

std::recursive_mutex& KernelTable::measurement_mutex() {
  static std::recursive_mutex mu;
  return mu;
}

}  // namespace porter::kernels
