// `porter config check FILE`: validates a config, prints the resolved one (flattened, or JSON
// with --json) and the warnings; exit 0 when valid, 2 when not.
#include <string>

#include "base/error.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "config/parse.h"

namespace porter::cli {
namespace {

struct CheckOptions {
  std::string file;
  int64_t world_size = 1;
  bool strict = false;
  bool json = false;
};

// "zero_optimization.offload_optimizer.device = "cpu"", one line per leaf.
void print_flat(const nlohmann::ordered_json& j, const std::string& path, std::ostream& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      print_flat(it.value(), path.empty() ? it.key() : path + "." + it.key(), out);
    }
    return;
  }
  out << path << " = " << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
      << "\n";
}

int check(const CheckOptions& o, std::ostream& out, std::ostream& err) {
  config::ParseResult result;
  try {
    result = config::parse_config_file(o.file, config::ParseOptions{o.world_size, o.strict});
  } catch (const porter::Error& e) {
    err << "error: " << o.file << ": " << e.what() << "\n";
    err << o.file << ": invalid\n";
    return kExitInvalid;
  }
  for (const config::Warning& w : result.warnings) {
    err << "warning: " << o.file << ": " << w.text() << "\n";
  }
  if (o.json) {
    out << config::to_json_string(result.config) << "\n";
  } else {
    out << o.file << ": valid at world size " << o.world_size << " ("
        << result.warnings.size() << " warning" << (result.warnings.size() == 1 ? "" : "s")
        << "); resolved config:\n";
    print_flat(config::to_json(result.config), "", out);
  }
  return kExitOk;
}

}  // namespace

void add_config_command(CLI::App& app, CommandContext& context) {
  CLI::App* config = app.add_subcommand("config", "Work with porter's JSON configs");
  config->require_subcommand(1);
  auto options = std::make_shared<CheckOptions>();
  CLI::App* check_cmd = config->add_subcommand(
      "check", "Validate a config; print the resolved config and the warnings");
  check_cmd->add_option("FILE", options->file, "The JSON config (DeepSpeed keys plus \"porter\")")
      ->required();
  check_cmd->add_option("--world-size", options->world_size,
                        "Ranks the run will have; the batch sizes are checked against it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_val(1);
  check_cmd->add_flag("--strict", options->strict, "Treat every warning as an error");
  check_cmd->add_flag("--json", options->json, "Print the resolved config as JSON");
  check_cmd->footer("Exit codes: 0 valid, 1 usage error, 2 invalid config.");
  check_cmd->callback([options, &context] {
    context.exit_code = check(*options, *context.out, *context.err);
  });
}

}  // namespace porter::cli
