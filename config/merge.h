// Several config files merged into one document, "--set key.path=JSON" overrides on top, and
// every error and warning attributed to the file (or --set) its key came from.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/parse.h"

namespace porter::config {

// Note [Several config files]
// Published DeepSpeed configs have no model: DeepSpeed takes it from the training script. So a
// run may name several files, e.g. ds_config.json then model.json, which adds "porter" (and the
// batch sizes the published file leaves to the script):
// 1. Every file is read alone first, so that its syntax errors and duplicate keys give its own
//    name, line and column (a merged document has neither).
// 2. The files are deep-merged in order: objects merge key by key, recursively; any other value
//    (arrays and null included) replaces what earlier files had.
// 3. Then each override sets one key, creating the objects on its path; a path through a value
//    that is not an object (or null) is an error.
// 4. The merged document is parsed as one config. Each error and warning names where its key
//    came from: the last source that set it, found by the longest prefix of its JSON path
//    (Provenance). A path that is a whole section names every source under it; the empty path
//    (or a key nobody gave, outside any section given) names every file; and a message that
//    mentions other keys given in the config (a rule across keys) names their sources too:
//    "ds.json + model.json: train_batch_size: ...".
// With one file and no override, every message is exactly what parse_config_file gives, after
// the file's name.

// One input: a file's JSON object under the name messages give it.
struct ConfigSource {
  std::string name;     // the path as the user wrote it: "ds_config.json"
  nlohmann::json json;  // an object
};

// One "--set key.path=JSON": a key set after every file.
struct ConfigOverride {
  std::string name;               // how messages name it: "--set porter.model.layers"
  std::vector<std::string> path;  // {"porter", "model", "layers"}
  nlohmann::json value;
};

// A ConfigError attributed to its source(s): what() is "<source>: " + the error's own text.
class SourcedConfigError : public ConfigError {
 public:
  SourcedConfigError(std::string source, const ConfigError& error);
  // "model.json", or several joined by " + ".
  const std::string& source() const { return source_; }
  // The error's text without the source (ConfigError's what()).
  const std::string& message() const { return message_; }

 private:
  std::string source_;
  std::string message_;
};

// A file's text -> its source. Throws SourcedConfigError naming `name` for an empty text,
// malformed JSON or a duplicate key (with line and column), or a top level that is not an
// object. read_config_source throws IoError when the file cannot be read.
ConfigSource config_source_from_string(std::string name, std::string_view json_text);
ConfigSource read_config_source(const std::filesystem::path& path);

// "porter.model.layers=8" -> the override. The value is JSON when it parses as JSON, else the
// text itself as a string ("policy=uniform"); a value that starts like JSON ('{', '[' or '"')
// must parse. Throws ConfigError for a missing '=', an empty path or key, or a list index.
ConfigOverride parse_config_override(std::string_view assignment);

// Where each key of a merged document came from (Note [Several config files]). Holds one entry
// per leaf: a value that is not an object, or an empty object. Paths are JSON paths as
// ConfigError and Warning spell them: "zero_optimization.stage".
class Provenance {
 public:
  // `names`: every source in merge order; a label lists its sources in this order.
  // `untraced`: what a path no source gave is attributed to (merge_config_sources: the files,
  // since no override gave it either); empty: every name.
  explicit Provenance(std::vector<std::string> names = {}, std::vector<std::string> untraced = {});

  // `source` set `path` to `value`: its leaves replace whatever was at or under `path`.
  void record(const std::string& path, const nlohmann::json& value, const std::string& source);

  // The sources of `path`: the source of the leaf at `path` or at its longest prefix; for a
  // section, every source of a leaf under it; for the empty path or a key that no source gave
  // (under a section none gave), the untraced sources.
  std::vector<std::string> sources_of(std::string_view path) const;
  // sources_of(path), plus the sources of the other given keys `message` mentions outside
  // quotes (words holding a '.' or '_' that name a leaf or a section), in merge order.
  std::vector<std::string> sources_of(std::string_view path, std::string_view message) const;
  // The same joined by " + ": "ds.json + model.json".
  std::string label(std::string_view path, std::string_view message = {}) const;
  // `sources` as they stand in merge order.
  std::vector<std::string> in_merge_order(const std::vector<std::string>& sources) const;

  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string, std::less<>>& leaves() const { return leaves_; }

 private:
  // The sources of `path` if it is a leaf or a section; empty otherwise.
  std::vector<std::string> sources_at(std::string_view path) const;

  std::vector<std::string> names_;
  std::vector<std::string> untraced_;
  std::map<std::string, std::string, std::less<>> leaves_;  // leaf path -> its source
};

// "a.json + b.json".
std::string join_sources(const std::vector<std::string>& sources);

struct MergedConfig {
  nlohmann::json json;  // the merged document
  Provenance provenance;
};

// Deep-merges `sources` in order, then applies `overrides` in order (Note [Several config
// files]). Throws SourcedConfigError naming the override that sets a key through a value that is
// not an object.
MergedConfig merge_config_sources(const std::vector<ConfigSource>& sources,
                                  const std::vector<ConfigOverride>& overrides = {});

// A warning with where its key came from.
struct SourcedWarning {
  std::string source;  // a label: "model.json", "--set porter.model.layer", "a.json + b.json"
  Warning warning;
  std::string text() const { return source + ": " + warning.text(); }
};

struct SourcedParseResult {
  Config config;
  std::vector<SourcedWarning> warnings;  // in the order the keys were read
  std::vector<SourcedWarning> notes;     // ParseResult::notes, with their sources
};

// Note [Set keys]
// A key in a file that porter does not read is a warning (with a did-you-mean): published
// configs carry keys of other DeepSpeed versions, and they must still load. A key given with
// --set is typed by the user for this run, so a key porter does not read is an error: a typo
// ("--set zero_optimisation.stage=3") would otherwise run with the setting it meant unchanged.
// The error names the --set, the key, the rule and the closest known key. A --set that puts
// something under an unknown key a file gave is refused the same way. A value of the wrong type
// is an error wherever it comes from.

// Merges, then parses the result as parse_config_string would. Throws SourcedConfigError for
// any invalid input, attributed to its source(s), and for a key given by an override that porter
// does not read (Note [Set keys]); under options.strict, the warnings become one error that
// lists each with its source (just the text when all have the same one).
SourcedParseResult parse_config_sources(const std::vector<ConfigSource>& sources,
                                        const std::vector<ConfigOverride>& overrides,
                                        const ParseOptions& options = {});

}  // namespace porter::config
