// Entry points: text or file -> ParseResult. Reads porter's section first (the DeepSpeed
// sections resolve "auto" from the model), then the DeepSpeed keys, then checks across them.
#include "config/parse.h"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "config/json_reader.h"
#include "config/sections.h"

namespace porter::config {

namespace detail {
namespace {

void check_world_size(const ParseOptions& options) {
  if (options.world_size < 1) {
    throw ConfigError("", "world size " + std::to_string(options.world_size) +
                              " is not valid: it must be at least 1");
  }
}

}  // namespace

Json parse_config_text(std::string_view json_text) {
  bool blank = true;
  for (char ch : json_text) blank = blank && std::isspace(static_cast<unsigned char>(ch));
  if (blank) {
    fail("", "the config is empty: expected a JSON object such as {\"train_batch_size\": 8}");
  }
  Json document = parse_json_text(json_text);
  if (!document.is_object()) {
    fail("", "expected a JSON object at the top level, got " + describe(document));
  }
  return document;
}

std::string read_config_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw IoError("cannot read config file " + path.string() + ": " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw IoError("error while reading config file " + path.string());
  return text.str();
}

ParseResult parse_config_document(const Json& document, const ParseOptions& options) {
  check_world_size(options);
  if (!document.is_object()) {
    fail("", "expected a JSON object at the top level, got " + describe(document));
  }
  Diagnostics diag;
  ObjectReader root(document, "", &diag);
  ParseResult result;
  Config& config = result.config;
  config.world_size = options.world_size;
  PorterReadState state = read_porter_section(root, config);
  read_deepspeed_keys(root, config);
  check_across_sections(state, config, diag);
  root.finish();

  result.warnings = diag.warnings();
  result.notes = diag.notes();
  if (options.strict && !result.warnings.empty()) {
    std::string message = std::to_string(result.warnings.size()) +
                          " warning(s), which strict mode makes errors:";
    for (const Warning& w : result.warnings) message += "\n  " + w.text();
    throw ConfigError(result.warnings.front().path, message, ConfigError::Verbatim{});
  }
  return result;
}

}  // namespace detail

ParseResult parse_config_string(std::string_view json_text, const ParseOptions& options) {
  // The world size is checked before the text, as it always was.
  detail::check_world_size(options);
  return detail::parse_config_document(detail::parse_config_text(json_text), options);
}

ParseResult parse_config_file(const std::filesystem::path& path, const ParseOptions& options) {
  return parse_config_string(detail::read_config_text(path), options);
}

}  // namespace porter::config
