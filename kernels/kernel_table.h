// The kernel choices a run makes by measurement (matmul layouts, the cpu attention's
// implementation), recorded once per problem and then fixed for the run (Note [Kernel table]).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace porter::kernels {

// Which candidates a measured choice may pick from (porter.device.kernel_choice).
enum class KernelChoice {
  kExact,    // only candidates that give the bits of the unmeasured default (the default)
  kFastest,  // every candidate; two runs agree bit for bit only with the table pinned
};

// "exact" or "fastest".
std::string_view kernel_choice_name(KernelChoice c);
// Throws InvalidArgument naming `what` and the accepted values on another value.
KernelChoice kernel_choice_from_name(std::string_view name, std::string_view what);

// One kernels object's table of choices, keyed by (kind, problem). Thread-safe.
//
// Invariant: a key's choice never changes once recorded, except by pin(), which replaces the
// whole table before the choices it pins are used (generation() tells users to look again).
class KernelTable {
 public:
  // How an entry's choice was made.
  enum class Source {
    kFixed,     // one candidate only (below the measurement threshold, or by kernel_choice)
    kMeasured,  // timed against the other candidates on this machine
    kEnv,       // an environment variable forced it (PORTER_MATMUL_LAYOUT, PORTER_CPU_ATTENTION)
    kPinned,    // taken from a pinned table (porter.device.kernel_table, or a resumed checkpoint)
  };
  struct Entry {
    std::string choice;
    Source source = Source::kFixed;
    std::string detail;  // the timings, or the variable, that decided it
  };

  explicit KernelTable(KernelChoice mode = KernelChoice::kExact) : mode_(mode) {}
  KernelTable(const KernelTable&) = delete;
  KernelTable& operator=(const KernelTable&) = delete;

  KernelChoice mode() const;
  void set_mode(KernelChoice mode);

  // The entry for (kind, key), if one is recorded or pinned.
  std::optional<Entry> find(std::string_view kind, const std::string& key) const;
  // Records the entry for (kind, key) unless one exists; returns the one in the table.
  Entry record(std::string_view kind, const std::string& key, Entry entry);

  // Sets the entry for (kind, key), replacing any: for a choice forced by the environment,
  // which holds for the whole process.
  void replace(std::string_view kind, const std::string& key, Entry entry);

  // Replaces the table's entries by those of `table` (as to_json writes it), each with
  // source kPinned, and notes `origin` ("pinned from FILE", "resumed from DIR"). Throws
  // InvalidArgument naming `origin` on a malformed table.
  void pin(const nlohmann::json& table, const std::string& origin);
  // {"kernel_choice": ..., "origin": ..., "entries": [{"kind", "key", "choice", "source",
  // "detail"}...]}, in key order.
  nlohmann::json to_json() const;
  // Where the choices come from: "measured in this run", or pin()'s origin.
  std::string origin() const;
  size_t size() const;
  size_t count(Source source) const;
  // Bumped by pin(): a user caching choices looks them up again when it changes.
  uint64_t generation() const;

  // Serialises measurements across every table of the process, so that two ranks run as
  // threads do not time their candidates on shared cores at once. Recursive: timing oneDNN's
  // attention runs its batched matmuls, whose first call measures their own candidates.
  static std::recursive_mutex& measurement_mutex();

 private:
  mutable std::mutex mu_;  // guards everything below
  KernelChoice mode_;
  std::map<std::pair<std::string, std::string>, Entry> entries_;
  std::string origin_;
  uint64_t generation_ = 0;
};

std::string_view source_name(KernelTable::Source s);

}  // namespace porter::kernels
