// libFuzzer target for the config parser. Any input must either parse or throw ConfigError;
// when it parses, the printed config must parse back to an equal Config and print
// identically, with no warning other than those about what the settings mean ("has no
// effect", e.g. partition_activations at tensor_parallel 1): the printed spelling is canonical. Anything else (another exception, a sanitizer report, a
// hang) is a bug. Built as a fuzzer with -DPORTER_FUZZ=ON (clang); replay_test.cc runs the
// committed corpus through the same function in the normal build.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "config/parse.h"

namespace {

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) throw std::logic_error(std::string("config fuzz invariant broken: ") + what + "\n" + detail);
}

void fuzz_one(std::string_view text, int64_t world_size) {
  using namespace porter::config;
  ParseResult first;
  try {
    first = parse_config_string(text, ParseOptions{world_size, false});
  } catch (const ConfigError&) {
    return;  // rejected with a message: fine
  }
  const std::string printed = to_json_string(first.config);
  ParseResult second = parse_config_string(printed, ParseOptions{world_size, false});
  for (const Warning& w : second.warnings) {
    check(w.message.find("has no effect") != std::string::npos,
          "the printed config has a spelling warning", w.path + ": " + w.message);
  }
  check(second.config == first.config, "round trip changed the config", printed);
  check(to_json_string(second.config) == printed, "round trip changed the printed config", printed);
  for (const Warning& w : first.warnings) {
    check(!w.message.empty(), "empty warning", w.path);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  // Two world sizes: the batch triple and tensor-parallel checks depend on it.
  fuzz_one(text, 1);
  fuzz_one(text, 6);
  return 0;
}
