// Reading a porter config: JSON text or file -> validated Config plus warnings; and printing
// a Config back as JSON (the resolved config).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "config/config.h"

namespace porter::config {

// A config that breaks a rule. The message reads "<json path>: <what was found and the rule>";
// path() is the JSON path alone ("zero_optimization.stage"; empty for the whole document).
class ConfigError : public InvalidArgument {
 public:
  ConfigError(std::string path, const std::string& message);
  // A message that does not start with the path (e.g. several warnings under --strict).
  struct Verbatim {};
  ConfigError(std::string path, const std::string& what, Verbatim);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct ParseOptions {
  // The number of ranks the run will have; the batch triple is checked against it (divided by
  // porter.model.tensor_parallel) so that a config can be checked before launch.
  int64_t world_size = 1;
  // Every warning becomes an error (a ConfigError listing all of them).
  bool strict = false;
};

// Something porter accepted but the user should know: an unknown key (with a did-you-mean), a
// deprecated alias, a DeepSpeed feature porter does not implement yet. Also the form of a note
// (ParseResult::notes).
struct Warning {
  std::string path;
  std::string message;
  // The key is not one porter reads (ObjectReader::finish); given with --set it is an error
  // (Note [Set keys] in config/merge.h).
  bool unknown_key = false;
  std::string text() const { return path.empty() ? message : path + ": " + message; }
  bool operator==(const Warning&) const = default;
};

struct ParseResult {
  Config config;
  std::vector<Warning> warnings;  // in the order the keys were read
  // Note [Fixed behaviour]: what porter does in place of a key the config gives, where porter's
  // behaviour is fixed (zero_optimization.contiguous_gradients, sub_group_size, nvme_path and
  // the others note_fixed_zero_behaviour in deepspeed_keys.cc lists), once per key and only
  // when given; and which model a config without porter.model trains. Never errors, not even
  // under strict.
  std::vector<Warning> notes;
};

// Throws ConfigError for any invalid input, including malformed JSON (with line and column)
// and duplicate keys. parse_config_file throws IoError when the file cannot be read.
ParseResult parse_config_string(std::string_view json_text, const ParseOptions& options = {});
ParseResult parse_config_file(const std::filesystem::path& path,
                              const ParseOptions& options = {});

// The resolved config, keys in the order DeepSpeed documents them. Parsing it again (with the
// same world size) gives an equal Config and no warnings.
nlohmann::ordered_json to_json(const Config& config);
std::string to_json_string(const Config& config, int indent = 2);

}  // namespace porter::config
