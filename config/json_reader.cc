// JSON text -> document (rejecting duplicate keys, with line and column in every syntax
// error), and the typed, path-naming reads of config/json_reader.h.
#include "config/json_reader.h"

#include <cmath>
#include <cstddef>
#include <iterator>
#include <sstream>

#include "base/units.h"
#include "config/suggest.h"

namespace porter::config {

ConfigError::ConfigError(std::string path, const std::string& message)
    : InvalidArgument(path.empty() ? message : path + ": " + message), path_(std::move(path)) {}
ConfigError::ConfigError(std::string path, const std::string& what, Verbatim)
    : InvalidArgument(what), path_(std::move(path)) {}

namespace detail {
namespace {

// Note [Duplicate keys]
// nlohmann's DOM parser silently keeps the last of two equal keys, which is exactly the silent
// typo-dropping this layer exists to prevent. So the document is built here from nlohmann's
// SAX events, and key() rejects a key its object already holds. SAX events carry no position,
// so the input is read through CountingIterator, which records how far the lexer has read: at
// key() that is just past the key's closing quote.
struct CountingIterator {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  const char* p = nullptr;
  const char** high_water = nullptr;  // not owned: the parser's read position

  reference operator*() const { return *p; }
  CountingIterator& operator++() {
    ++p;
    if (p > *high_water) *high_water = p;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator old = *this;
    ++*this;
    return old;
  }
  bool operator==(const CountingIterator& o) const { return p == o.p; }
  bool operator!=(const CountingIterator& o) const { return p != o.p; }
};

struct LineColumn {
  size_t line = 1;
  size_t column = 1;
};

LineColumn line_column(std::string_view text, size_t offset) {
  LineColumn lc;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++lc.line;
      lc.column = 1;
    } else {
      ++lc.column;
    }
  }
  return lc;
}

std::string at(std::string_view text, size_t offset) {
  LineColumn lc = line_column(text, offset);
  return "line " + std::to_string(lc.line) + ", column " + std::to_string(lc.column);
}

class DomBuilder {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  DomBuilder(std::string_view text, const char** high_water)
      : text_(text), high_water_(high_water) {}

  bool null() { return add(nullptr) != nullptr; }
  bool boolean(bool v) { return add(v) != nullptr; }
  bool number_integer(number_integer_t v) { return add(v) != nullptr; }
  bool number_unsigned(number_unsigned_t v) { return add(v) != nullptr; }
  bool number_float(number_float_t v, const string_t&) { return add(v) != nullptr; }
  bool string(string_t& v) { return add(v) != nullptr; }
  bool binary(binary_t&) {
    error_ = "malformed JSON: binary values are not JSON";
    return false;
  }
  bool start_object(std::size_t) { return open(Json::value_t::object); }
  bool start_array(std::size_t) { return open(Json::value_t::array); }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool end_array() {
    stack_.pop_back();
    return true;
  }
  bool key(string_t& k) {
    Open& object = stack_.back();
    pending_path_ = child_path(object.path, k);
    if (object.value->contains(k)) {
      size_t offset = key_start(static_cast<size_t>(*high_water_ - text_.data()));
      error_path_ = pending_path_;
      error_ = "duplicate key " + describe(Json(k)) + " at " + at(text_, offset) +
               ": give each key once (a JSON reader that keeps the last one would silently "
               "drop the first value)";
      return false;
    }
    pending_ = &(*object.value)[k];
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) {
    // nlohmann's text is "[json.exception.parse_error.101] parse error at line L, column C:
    // <reason>"; keep the reason and compute the position ourselves.
    std::string reason = ex.what();
    size_t colon = reason.find(": ", reason.find("column"));
    if (colon != std::string::npos) reason = reason.substr(colon + 2);
    size_t offset = position > 0 ? position - 1 : 0;
    error_ = "malformed JSON at " + at(text_, offset) + ": " + reason;
    return false;
  }

  Json& root() { return root_; }
  const std::string& error() const { return error_; }
  const std::string& error_path() const { return error_path_; }

 private:
  template <typename V>
  Json* add(V&& v) {
    if (stack_.empty()) {
      root_ = Json(std::forward<V>(v));
      return &root_;
    }
    Json* top = stack_.back().value;
    if (top->is_array()) {
      top->emplace_back(std::forward<V>(v));
      return &top->back();
    }
    *pending_ = Json(std::forward<V>(v));
    return pending_;
  }

  bool open(Json::value_t type) {
    if (stack_.size() >= static_cast<size_t>(kMaxJsonDepth)) {
      error_ = "malformed JSON at " +
               at(text_, static_cast<size_t>(*high_water_ - text_.data()) - 1) +
               ": nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels";
      return false;
    }
    std::string path;
    if (!stack_.empty()) {
      const Open& parent = stack_.back();
      path = parent.value->is_array()
                 ? parent.path + "[" + std::to_string(parent.value->size()) + "]"
                 : pending_path_;
    }
    stack_.push_back(Open{add(type), std::move(path)});
    return true;
  }

  // `end` is just past a key's closing quote; returns the offset of its opening quote.
  size_t key_start(size_t end) const {
    if (end < 2) return 0;
    size_t i = end - 1;  // the closing quote
    while (i > 0) {
      --i;
      if (text_[i] != '"') continue;
      size_t backslashes = 0;
      while (backslashes < i && text_[i - 1 - backslashes] == '\\') ++backslashes;
      if (backslashes % 2 == 0) return i;
    }
    return 0;
  }

  std::string_view text_;
  const char** high_water_;  // not owned: CountingIterator's read position
  Json root_;
  struct Open {
    Json* value;  // points into root_; stable while the container is open
    std::string path;
  };
  std::vector<Open> stack_;  // the open containers, outermost first
  Json* pending_ = nullptr;  // the object member the next value goes to
  std::string pending_path_;
  std::string error_;
  std::string error_path_;
};

std::string describe_range(const IntRange& r) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (r.min == kMin && r.max == kMax) return "an integer";
  if (r.max == kMax) return "an integer >= " + std::to_string(r.min);
  if (r.min == kMin) return "an integer <= " + std::to_string(r.max);
  return "an integer in " + std::to_string(r.min) + ".." + std::to_string(r.max);
}

std::string format_real(double v) { return Json(v).dump(); }

std::string describe_range(const RealRange& r) {
  bool has_min = std::isfinite(r.min), has_max = std::isfinite(r.max);
  if (!has_min && !has_max) return "a number";
  if (has_min && has_max) {
    return "a number in " + std::string(r.min_open ? "(" : "[") + format_real(r.min) + ", " +
           format_real(r.max) + (r.max_open ? ")" : "]");
  }
  if (has_min) return std::string("a number ") + (r.min_open ? "> " : ">= ") + format_real(r.min);
  return std::string("a number ") + (r.max_open ? "< " : "<= ") + format_real(r.max);
}

[[noreturn]] void fail_expected(const std::string& path, const std::string& expected,
                                const Json& value) {
  std::string message = "expected " + expected + ", got " + describe(value);
  if (is_auto(value)) message += " (\"auto\" is not accepted for this key)";
  fail(path, message);
}

}  // namespace

Json parse_json_text(std::string_view text) {
  const char* high_water = text.data();
  DomBuilder builder(text, &high_water);
  CountingIterator first{text.data(), &high_water};
  CountingIterator last{text.data() + text.size(), &high_water};
  bool ok = false;
  try {
    ok = Json::sax_parse(first, last, &builder);
  } catch (const nlohmann::json::exception& e) {
    fail("", std::string("malformed JSON: ") + e.what());
  }
  if (!ok) {
    fail(builder.error_path(), builder.error().empty() ? "malformed JSON" : builder.error());
  }
  return std::move(builder.root());
}

std::string describe(const Json& value) {
  constexpr size_t kMaxChars = 80;
  std::string s = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > kMaxChars) {
    size_t cut = kMaxChars;
    // Do not cut a UTF-8 sequence in half.
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
    s = s.substr(0, cut) + "...";
  }
  return s;
}

std::string child_path(std::string_view parent, std::string_view key) {
  std::string out(parent);
  if (!out.empty()) out += '.';
  out += key;
  return out;
}

void fail(const std::string& path, const std::string& message) { throw ConfigError(path, message); }

void Diagnostics::warn(std::string path, std::string message) {
  warnings_.push_back(Warning{std::move(path), std::move(message)});
}

void Diagnostics::warn_unknown(std::string path, std::string message) {
  warnings_.push_back(Warning{std::move(path), std::move(message), /*unknown_key=*/true});
}

void Diagnostics::note(std::string path, std::string message) {
  notes_.push_back(Warning{std::move(path), std::move(message)});
}

bool is_auto(const Json& value) {
  return value.is_string() && value.get_ref<const std::string&>() == "auto";
}

bool as_bool(const Json& value, const std::string& path) {
  if (!value.is_boolean()) fail_expected(path, "true or false", value);
  return value.get<bool>();
}

int64_t as_integer(const Json& value, const std::string& path, IntRange range) {
  int64_t n = 0;
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail_expected(path, describe_range(range), value);
    }
    n = static_cast<int64_t>(u);
  } else if (value.is_number_integer()) {
    n = value.get<int64_t>();
  } else if (value.is_number_float()) {
    // An integer written as a float ("1e9", 6.039798e+07) is fine; a fraction is not.
    double d = value.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) {
      fail(path, "expected " + describe_range(range) + ", got " + describe(value) +
                     " (not a whole number)");
    }
    // 2^63 is exactly representable; anything at or past it does not fit.
    if (d < -9.223372036854775808e18 || d >= 9.223372036854775808e18) {
      fail_expected(path, describe_range(range), value);
    }
    n = static_cast<int64_t>(d);
  } else {
    fail_expected(path, describe_range(range), value);
  }
  if (n < range.min || n > range.max) fail_expected(path, describe_range(range), value);
  return n;
}

double as_real(const Json& value, const std::string& path, RealRange range) {
  if (!value.is_number()) fail_expected(path, describe_range(range), value);
  double d = value.get<double>();
  bool below = range.min_open ? !(d > range.min) : !(d >= range.min);
  bool above = range.max_open ? !(d < range.max) : !(d <= range.max);
  if (below || above) fail_expected(path, describe_range(range), value);
  return d;
}

std::string as_string(const Json& value, const std::string& path) {
  if (!value.is_string()) fail_expected(path, "a string", value);
  return value.get<std::string>();
}

uint64_t as_bytes(const Json& value, const std::string& path, uint64_t min) {
  const std::string rule = "a byte count >= " + std::to_string(min) +
                           " (an integer, or a string with a unit such as \"2GiB\" or \"512MB\")";
  uint64_t n = 0;
  if (value.is_string()) {
    // No byte count needs more characters than this, and parse_bytes (std::stod) throws
    // std::out_of_range on a fraction with hundreds of digits.
    constexpr size_t kMaxBytesText = 64;
    if (value.get_ref<const std::string&>().size() > kMaxBytesText) {
      fail_expected(path, rule, value);
    }
    std::optional<uint64_t> parsed = parse_bytes(value.get_ref<const std::string&>());
    if (!parsed) fail_expected(path, rule, value);
    n = *parsed;
  } else if (value.is_number_unsigned()) {
    n = value.get<uint64_t>();
  } else if (value.is_number_integer() || value.is_number_float()) {
    int64_t i = as_integer(value, path, IntRange{0, std::numeric_limits<int64_t>::max()});
    n = static_cast<uint64_t>(i);
  } else {
    fail_expected(path, rule, value);
  }
  if (n < min) fail_expected(path, rule, value);
  return n;
}

int as_enum_index(const Json& value, const std::string& path,
                  std::span<const std::string_view> names) {
  std::string list;
  std::vector<std::string> candidates;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) list += " | ";
    list += names[i];
    candidates.emplace_back(names[i]);
  }
  if (value.is_string()) {
    const std::string& s = value.get_ref<const std::string&>();
    for (size_t i = 0; i < names.size(); ++i) {
      if (s == names[i]) return static_cast<int>(i);
    }
    std::string message = "expected one of " + list + ", got " + describe(value);
    if (std::optional<std::string> near = suggest(s, candidates)) {
      message += " (did you mean \"" + *near + "\"?)";
    }
    fail(path, message);
  }
  fail_expected(path, "one of " + list, value);
}

ObjectReader::ObjectReader(const Json& object, std::string path, Diagnostics* diag)
    : object_(&object), path_(std::move(path)), diag_(diag) {}

void ObjectReader::note_known(std::string_view key) {
  for (const std::string& k : known_) {
    if (k == key) return;
  }
  known_.emplace_back(key);
}

const Json* ObjectReader::get(std::string_view key) {
  note_known(key);
  auto it = object_->find(key);
  return it == object_->end() ? nullptr : &*it;
}

bool ObjectReader::is_null(std::string_view key) {
  const Json* v = get(key);
  return v != nullptr && v->is_null();
}

std::optional<bool> ObjectReader::boolean(std::string_view key, std::optional<bool> auto_value) {
  const Json* v = get(key);
  if (v == nullptr) return std::nullopt;
  if (auto_value && is_auto(*v)) return auto_value;
  return as_bool(*v, path_of(key));
}

std::optional<int64_t> ObjectReader::integer(std::string_view key, IntRange range,
                                             std::optional<int64_t> auto_value) {
  const Json* v = get(key);
  if (v == nullptr) return std::nullopt;
  if (auto_value && is_auto(*v)) return auto_value;
  return as_integer(*v, path_of(key), range);
}

std::optional<double> ObjectReader::real(std::string_view key, RealRange range,
                                         std::optional<double> auto_value) {
  const Json* v = get(key);
  if (v == nullptr) return std::nullopt;
  if (auto_value && is_auto(*v)) return auto_value;
  return as_real(*v, path_of(key), range);
}

std::optional<std::string> ObjectReader::string(std::string_view key) {
  const Json* v = get(key);
  if (v == nullptr) return std::nullopt;
  return as_string(*v, path_of(key));
}

std::optional<uint64_t> ObjectReader::bytes(std::string_view key, uint64_t min) {
  const Json* v = get(key);
  if (v == nullptr) return std::nullopt;
  return as_bytes(*v, path_of(key), min);
}

bool ObjectReader::deprecated(std::string_view old_key, std::string_view new_key,
                              std::string_view replacement) {
  if (!has(old_key)) return false;
  if (has(new_key)) {
    fail(path_of(old_key), "deprecated alias of " + path_of(new_key) +
                               ", given together with it; keep only " + std::string(new_key));
  }
  diag_->warn(path_of(old_key), "deprecated; use " + std::string(replacement) + " instead");
  return true;
}

std::optional<ObjectReader> ObjectReader::object(std::string_view key) {
  const Json* v = get(key);
  if (v == nullptr || v->is_null()) return std::nullopt;
  if (!v->is_object()) fail_expected(path_of(key), "a JSON object", *v);
  return ObjectReader(*v, path_of(key), diag_);
}

void ObjectReader::not_implemented(std::string_view key, const Json& harmless,
                                   std::string_view note) {
  const Json* v = get(key);
  if (v == nullptr || *v == harmless) return;
  diag_->warn(path_of(key), "set to " + describe(*v) + ", but porter does not implement it (" +
                                std::string(note) + "); ignored");
}

void ObjectReader::not_implemented_section(std::string_view key, std::string_view note) {
  const Json* v = get(key);
  if (v == nullptr || v->is_null()) return;
  if (v->is_object()) {
    auto enabled = v->find("enabled");
    if (enabled != v->end() && *enabled == false) return;
  }
  diag_->warn(path_of(key),
              "porter does not implement this section (" + std::string(note) + "); ignored");
}

void ObjectReader::finish() {
  for (auto it = object_->begin(); it != object_->end(); ++it) {
    const std::string& key = it.key();
    if (!key.empty() && key[0] == '_') continue;  // "_comment" keys are comments
    bool known = false;
    for (const std::string& k : known_) known = known || k == key;
    if (known) continue;
    std::string message = "unknown key, ignored";
    if (std::optional<std::string> near = suggest(key, known_)) {
      message += " (did you mean \"" + *near + "\"?)";
    }
    diag_->warn_unknown(path_of(key), message);
  }
}

}  // namespace detail
}  // namespace porter::config
