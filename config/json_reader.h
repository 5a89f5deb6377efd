// Path-tracking reads of a parsed JSON document: typed getters that name the JSON path, the
// value and the rule when they fail, and that remember which keys a level knows, so that the
// rest can be warned about with a did-you-mean. Internal to config/.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/parse.h"

namespace porter::config::detail {

using Json = nlohmann::json;

// Deeper nesting than this is rejected while parsing: no config needs it, and it keeps every
// later walk over the document (printing values in messages) shallow.
inline constexpr int kMaxJsonDepth = 64;

// Parses JSON text into a document. Malformed JSON, duplicate keys and over-deep nesting throw
// ConfigError with the line and column.
Json parse_json_text(std::string_view text);

// A value as it appears in messages: compact JSON, cut to a readable length.
std::string describe(const Json& value);
std::string child_path(std::string_view parent, std::string_view key);
[[noreturn]] void fail(const std::string& path, const std::string& message);

class Diagnostics {
 public:
  void warn(std::string path, std::string message);
  // ObjectReader::finish's warning about a key no getter asked for.
  void warn_unknown(std::string path, std::string message);
  // Note [Fixed behaviour] in config/parse.h.
  void note(std::string path, std::string message);
  const std::vector<Warning>& warnings() const { return warnings_; }
  const std::vector<Warning>& notes() const { return notes_; }

 private:
  std::vector<Warning> warnings_;
  std::vector<Warning> notes_;
};

struct IntRange {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
};

struct RealRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // min itself excluded
  bool max_open = false;  // max itself excluded
};

template <typename E>
struct EnumName {
  std::string_view name;
  E value;
};

bool is_auto(const Json& value);

// Conversions of one value; `path` names it in errors.
bool as_bool(const Json& value, const std::string& path);
int64_t as_integer(const Json& value, const std::string& path, IntRange range);
double as_real(const Json& value, const std::string& path, RealRange range);
std::string as_string(const Json& value, const std::string& path);
// A byte count: an integer, or a string with a unit ("2GiB", "512MB").
uint64_t as_bytes(const Json& value, const std::string& path, uint64_t min);
// `names` lists the accepted spellings; the error lists them all.
int as_enum_index(const Json& value, const std::string& path,
                  std::span<const std::string_view> names);

template <typename E, size_t N>
std::string_view enum_name(const EnumName<E> (&table)[N], E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return "?";
}

template <typename E, size_t N>
E as_enum(const Json& value, const std::string& path, const EnumName<E> (&table)[N]) {
  std::string_view names[N];
  for (size_t i = 0; i < N; ++i) names[i] = table[i].name;
  return table[as_enum_index(value, path, names)].value;
}

// One JSON object being read. Every getter registers its key as known at this level, whether
// or not it is present; finish() then warns about every other key (except "_comments").
class ObjectReader {
 public:
  ObjectReader(const Json& object, std::string path, Diagnostics* diag);

  const std::string& path() const { return path_; }
  std::string path_of(std::string_view key) const { return child_path(path_, key); }
  Diagnostics& diag() { return *diag_; }

  // The value of `key`, or nullptr when absent. Registers the key.
  const Json* get(std::string_view key);
  bool has(std::string_view key) { return get(key) != nullptr; }
  // True when `key` is present and null ("none"). Registers the key.
  bool is_null(std::string_view key);

  // Typed getters: nullopt when absent. "auto" yields auto_value, or is an error when none is
  // given (the key does not take "auto").
  std::optional<bool> boolean(std::string_view key, std::optional<bool> auto_value = {});
  std::optional<int64_t> integer(std::string_view key, IntRange range,
                                 std::optional<int64_t> auto_value = {});
  std::optional<double> real(std::string_view key, RealRange range,
                             std::optional<double> auto_value = {});
  std::optional<std::string> string(std::string_view key);
  std::optional<uint64_t> bytes(std::string_view key, uint64_t min = 0);
  template <typename E, size_t N>
  std::optional<E> enumeration(std::string_view key, const EnumName<E> (&table)[N]) {
    const Json* v = get(key);
    if (v == nullptr) return std::nullopt;
    return as_enum(*v, path_of(key), table);
  }
  // A deprecated key, `old_key`, replaced by `new_key`: false when absent; otherwise warns
  // "deprecated; use <replacement> instead", or fails when `new_key` is given too.
  bool deprecated(std::string_view old_key, std::string_view new_key,
                  std::string_view replacement);
  // A nested object; nullopt when absent or null. Any other type is an error.
  std::optional<ObjectReader> object(std::string_view key);

  // A DeepSpeed key porter knows but does not implement yet. Warns when the value differs from
  // `harmless` (the value under which ignoring the key changes nothing).
  void not_implemented(std::string_view key, const Json& harmless, std::string_view note);
  // A DeepSpeed section porter does not implement yet. Warns when it is present, unless it is
  // an object with "enabled": false.
  void not_implemented_section(std::string_view key, std::string_view note);

  // Warns about every key no getter asked for, suggesting the closest known one.
  void finish();

 private:
  void note_known(std::string_view key);

  const Json* object_;  // not owned: the document outlives every reader
  std::string path_;
  Diagnostics* diag_;   // not owned: lives for the whole parse
  std::vector<std::string> known_;
};

}  // namespace porter::config::detail
