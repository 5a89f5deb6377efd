// Several config sources -> one document with the provenance of every key, --set overrides,
// and the attribution of parse errors and warnings (Note [Several config files] in merge.h).
#include "config/merge.h"

#include <algorithm>
#include <cctype>

#include "config/json_reader.h"
#include "config/sections.h"

namespace porter::config {

using detail::child_path;
using detail::describe;
using detail::Json;

SourcedConfigError::SourcedConfigError(std::string source, const ConfigError& error)
    : ConfigError(error.path(), source + ": " + error.what(), Verbatim{}),
      source_(std::move(source)),
      message_(error.what()) {}

ConfigSource config_source_from_string(std::string name, std::string_view json_text) {
  try {
    Json document = detail::parse_config_text(json_text);
    return ConfigSource{std::move(name), std::move(document)};
  } catch (const ConfigError& e) {
    throw SourcedConfigError(name, e);
  }
}

ConfigSource read_config_source(const std::filesystem::path& path) {
  return config_source_from_string(path.string(), detail::read_config_text(path));
}

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

constexpr const char* kSetExample = "e.g. --set porter.model.layers=8";

// Levels of nesting of `value`: 0 for a scalar.
int depth_of(const Json& value) {
  int deepest = 0;
  if (value.is_structured()) {
    for (const Json& child : value) deepest = std::max(deepest, depth_of(child));
    return deepest + 1;
  }
  return 0;
}

}  // namespace

ConfigOverride parse_config_override(std::string_view assignment) {
  const std::string shown = "--set \"" + std::string(assignment) + "\"";
  const size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    throw ConfigError("", shown + ": expected key.path=VALUE (no \"=\" found), " + kSetExample);
  }
  const std::string_view path_text = trim(assignment.substr(0, eq));
  if (path_text.empty()) {
    throw ConfigError("", shown + ": the key path before \"=\" is empty; expected " +
                              "key.path=VALUE, " + kSetExample);
  }
  ConfigOverride o;
  size_t start = 0;
  while (true) {
    const size_t dot = path_text.find('.', start);
    const size_t length = dot == std::string_view::npos ? std::string_view::npos : dot - start;
    const std::string_view key = path_text.substr(start, length);
    if (key.empty()) {
      throw ConfigError("", shown + ": empty key in the path \"" + std::string(path_text) +
                                "\"; separate keys with single dots, " + kSetExample);
    }
    if (key.find_first_of("[]") != std::string_view::npos) {
      throw ConfigError("", shown + ": \"" + std::string(key) +
                                "\": a list element cannot be set on its own; set the whole list, "
                                "e.g. --set 'optimizer.params.betas=[0.9,0.95]'");
    }
    o.path.emplace_back(key);
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  o.name = "--set " + std::string(path_text);

  // Note [Set values]: JSON first, so numbers, booleans, null, lists and objects keep their
  // type; a bare word that is not JSON ("uniform", "cpu", "2GiB") is meant as a string, which
  // saves quoting it twice in a shell. Text that starts like JSON is JSON that went wrong, and
  // turning it into a string would hide the mistake.
  const std::string_view value_text = assignment.substr(eq + 1);
  const std::string_view head = trim(value_text);
  const bool looks_like_json =
      !head.empty() && (head[0] == '{' || head[0] == '[' || head[0] == '"');
  try {
    o.value = detail::parse_json_text(value_text);
  } catch (const ConfigError& e) {
    if (looks_like_json) {
      throw ConfigError("", shown + ": the value is not valid JSON (" + std::string(e.what()) +
                                ")");
    }
    o.value = std::string(head);
  }
  if (static_cast<int>(o.path.size()) + depth_of(o.value) > detail::kMaxJsonDepth) {
    throw ConfigError("", shown + ": nesting deeper than " +
                              std::to_string(detail::kMaxJsonDepth) + " levels");
  }
  return o;
}

// --- Provenance -----------------------------------------------------------------------------

namespace {

// "a.b[2]" -> "a.b", "a.b" -> "a", "a" -> "".
std::string_view parent_of(std::string_view path) {
  const size_t cut = path.find_last_of(".[");
  return cut == std::string_view::npos ? std::string_view() : path.substr(0, cut);
}

bool is_key_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
}

}  // namespace

Provenance::Provenance(std::vector<std::string> names, std::vector<std::string> untraced)
    : names_(std::move(names)), untraced_(std::move(untraced)) {}

void Provenance::record(const std::string& path, const Json& value, const std::string& source) {
  // An ancestor that was a leaf (null, {}) is now a section holding `path`.
  for (std::string_view p = parent_of(path); !p.empty(); p = parent_of(p)) {
    if (auto it = leaves_.find(p); it != leaves_.end()) leaves_.erase(it);
  }
  // Whatever was at or under `path` is replaced.
  leaves_.erase(path);
  const std::string under = path + ".";
  for (auto it = leaves_.lower_bound(under);
       it != leaves_.end() && it->first.compare(0, under.size(), under) == 0;) {
    it = leaves_.erase(it);
  }
  if (value.is_object() && !value.empty()) {
    for (auto it = value.begin(); it != value.end(); ++it) {
      record(child_path(path, it.key()), it.value(), source);
    }
    return;
  }
  leaves_[path] = source;
  if (std::find(names_.begin(), names_.end(), source) == names_.end()) names_.push_back(source);
}

std::vector<std::string> Provenance::in_merge_order(const std::vector<std::string>& sources) const {
  std::vector<std::string> out;
  for (const std::string& n : names_) {
    if (std::find(sources.begin(), sources.end(), n) != sources.end()) out.push_back(n);
  }
  return out;
}

std::vector<std::string> Provenance::sources_at(std::string_view path) const {
  if (auto it = leaves_.find(path); it != leaves_.end()) return {it->second};
  std::vector<std::string> found;
  const std::string under = std::string(path) + ".";
  for (auto it = leaves_.lower_bound(under);
       it != leaves_.end() && it->first.compare(0, under.size(), under) == 0; ++it) {
    if (std::find(found.begin(), found.end(), it->second) == found.end()) {
      found.push_back(it->second);
    }
  }
  return in_merge_order(found);
}

std::vector<std::string> Provenance::sources_of(std::string_view path) const {
  for (std::string_view p = path; !p.empty(); p = parent_of(p)) {
    std::vector<std::string> found = sources_at(p);
    if (!found.empty()) return found;
  }
  return untraced_.empty() ? names_ : untraced_;
}

std::vector<std::string> Provenance::sources_of(std::string_view path,
                                               std::string_view message) const {
  std::vector<std::string> sources = sources_of(path);
  // The other keys the message names, as words outside quotes that hold a '.' or a '_' (so
  // that prose such as "porter" or "optimizer" is not read as a key, nor a quoted value or
  // did-you-mean suggestion).
  bool quoted = false;
  for (size_t i = 0; i < message.size();) {
    const char c = message[i];
    if (c == '"') {
      quoted = !quoted;
      ++i;
      continue;
    }
    if (quoted || !is_key_char(c) || (i > 0 && is_key_char(message[i - 1]))) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < message.size() && is_key_char(message[end])) ++end;
    std::string_view word = message.substr(i, end - i);
    while (!word.empty() && word.back() == '.') word.remove_suffix(1);
    i = end;
    if (word.find_first_of("._") == std::string_view::npos) continue;
    for (std::string& s : sources_at(word)) {
      if (std::find(sources.begin(), sources.end(), s) == sources.end()) sources.push_back(s);
    }
  }
  return in_merge_order(sources);
}

std::string Provenance::label(std::string_view path, std::string_view message) const {
  return join_sources(sources_of(path, message));
}

std::string join_sources(const std::vector<std::string>& sources) {
  std::string out;
  for (const std::string& s : sources) out += (out.empty() ? "" : " + ") + s;
  return out;
}

// --- Merging --------------------------------------------------------------------------------

namespace {

void merge_into(Json& into, const Json& from, const std::string& path, const std::string& source,
                Provenance& provenance) {
  for (auto it = from.begin(); it != from.end(); ++it) {
    const std::string child = child_path(path, it.key());
    auto at = into.find(it.key());
    if (at != into.end() && at->is_object() && it->is_object()) {
      merge_into(*at, *it, child, source, provenance);
      continue;
    }
    into[it.key()] = *it;
    provenance.record(child, *it, source);
  }
}

void apply_override(Json& document, const ConfigOverride& o, Provenance& provenance) {
  Json* node = &document;
  std::string path;
  for (size_t i = 0; i + 1 < o.path.size(); ++i) {
    path = child_path(path, o.path[i]);
    Json& next = (*node)[o.path[i]];  // null when absent
    // A null section ("scheduler": null) is as good as absent: the override gives it content.
    if (next.is_null()) next = Json::object();
    if (!next.is_object()) {
      const std::string from = join_sources(provenance.sources_of(path));
      throw SourcedConfigError(
          o.name, ConfigError(path, describe(next) + " (from " + from +
                                        ") is not a JSON object, so it has no key \"" +
                                        o.path[i + 1] + "\" to set; set " + path +
                                        " itself instead"));
    }
    node = &next;
  }
  (*node)[o.path.back()] = o.value;
  provenance.record(child_path(path, o.path.back()), o.value, o.name);
}

}  // namespace

MergedConfig merge_config_sources(const std::vector<ConfigSource>& sources,
                                  const std::vector<ConfigOverride>& overrides) {
  // A name given twice (the same file, the same --set key) is one source.
  std::vector<std::string> names, files;
  auto add = [](std::vector<std::string>& list, const std::string& name) {
    if (std::find(list.begin(), list.end(), name) == list.end()) list.push_back(name);
  };
  for (const ConfigSource& s : sources) add(names, s.name);
  files = names;
  for (const ConfigOverride& o : overrides) add(names, o.name);
  MergedConfig m{Json::object(), Provenance(std::move(names), std::move(files))};
  for (const ConfigSource& s : sources) {
    if (!s.json.is_object()) {
      throw SourcedConfigError(
          s.name,
          ConfigError("", "expected a JSON object at the top level, got " + describe(s.json)));
    }
    merge_into(m.json, s.json, "", s.name, m.provenance);
  }
  for (const ConfigOverride& o : overrides) {
    if (o.path.empty()) {
      throw SourcedConfigError(o.name, ConfigError("", "the key path is empty"));
    }
    apply_override(m.json, o, m.provenance);
  }
  return m;
}

// --- Parsing --------------------------------------------------------------------------------

namespace {

// Note [Set keys]: the unknown keys an override gave are one error.
void refuse_unknown_set_keys(const std::vector<Warning>& warnings,
                             const std::vector<ConfigOverride>& overrides,
                             const Provenance& provenance) {
  struct Refused {
    std::string source;
    const Warning* warning;
  };
  std::vector<Refused> refused;
  for (const Warning& w : warnings) {
    if (!w.unknown_key) continue;
    for (const std::string& s : provenance.sources_of(w.path)) {
      const bool is_override =
          std::any_of(overrides.begin(), overrides.end(),
                      [&](const ConfigOverride& o) { return o.name == s; });
      if (is_override) {
        refused.push_back(Refused{s, &w});
        break;
      }
    }
  }
  if (refused.empty()) return;
  // "unknown key, ignored (did you mean ...)": nothing is ignored here.
  auto message_of = [](const Warning& w) {
    constexpr std::string_view kIgnored = "unknown key, ignored";
    std::string message = w.message;
    if (message.rfind(kIgnored, 0) == 0) message = "unknown key" + message.substr(kIgnored.size());
    return message;
  };
  constexpr const char* kRule =
      "a key given with --set must be one porter reads (a key in a config file is only warned "
      "about)";
  if (refused.size() == 1) {
    const Warning& w = *refused[0].warning;
    throw SourcedConfigError(refused[0].source,
                             ConfigError(w.path, message_of(w) + "; " + kRule));
  }
  std::vector<std::string> sources;
  std::string message =
      std::to_string(refused.size()) + " keys given with --set are unknown; " + kRule + ":";
  for (const Refused& r : refused) {
    sources.push_back(r.source);
    message += "\n  " + r.source + ": " + Warning{r.warning->path, message_of(*r.warning)}.text();
  }
  throw SourcedConfigError(join_sources(provenance.in_merge_order(sources)),
                           ConfigError(refused[0].warning->path, message,
                                       ConfigError::Verbatim{}));
}

}  // namespace

SourcedParseResult parse_config_sources(const std::vector<ConfigSource>& sources,
                                        const std::vector<ConfigOverride>& overrides,
                                        const ParseOptions& options) {
  if (sources.empty()) {
    throw ConfigError("", "no config given: give at least one config file");
  }
  const MergedConfig merged = merge_config_sources(sources, overrides);
  const Provenance& provenance = merged.provenance;
  ParseOptions lenient = options;
  lenient.strict = false;  // the strict error is made below, with each warning's source
  ParseResult parsed;
  try {
    parsed = detail::parse_config_document(merged.json, lenient);
  } catch (const ConfigError& e) {
    throw SourcedConfigError(provenance.label(e.path(), e.what()), e);
  }
  refuse_unknown_set_keys(parsed.warnings, overrides, provenance);
  SourcedParseResult result;
  result.config = std::move(parsed.config);
  for (Warning& n : parsed.notes) {
    result.notes.push_back(SourcedWarning{provenance.label(n.path, n.message), std::move(n)});
  }
  std::vector<std::string> sources_of_warnings;  // in merge order
  for (Warning& w : parsed.warnings) {
    const std::vector<std::string> from = provenance.sources_of(w.path, w.message);
    for (const std::string& s : from) {
      if (std::find(sources_of_warnings.begin(), sources_of_warnings.end(), s) ==
          sources_of_warnings.end()) {
        sources_of_warnings.push_back(s);
      }
    }
    result.warnings.push_back(SourcedWarning{join_sources(from), std::move(w)});
  }
  if (options.strict && !result.warnings.empty()) {
    // When every warning has the same source, the text is parse_config_string's after it.
    bool one = true;
    for (const SourcedWarning& w : result.warnings) {
      one = one && w.source == result.warnings[0].source;
    }
    std::string message = std::to_string(result.warnings.size()) +
                          " warning(s), which strict mode makes errors:";
    for (const SourcedWarning& w : result.warnings) {
      message += "\n  " + (one ? w.warning.text() : w.text());
    }
    throw SourcedConfigError(
        join_sources(provenance.in_merge_order(sources_of_warnings)),
        ConfigError(result.warnings.front().warning.path, message, ConfigError::Verbatim{}));
  }
  return result;
}

}  // namespace porter::config
