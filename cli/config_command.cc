// `porter config check FILE... [--config FILE]... [--set KEY=JSON]...`: validates a config (of
// several files, their merge), prints the resolved one (flattened, or JSON with --json) and the
// warnings; exit 0 when valid, 2 when not.
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "config/parse.h"

namespace porter::cli {
namespace {

struct CheckOptions {
  ConfigArgs config_args;  // the files in command-line order, FILE and --config alike
  std::vector<std::string> positional, flagged;  // as CLI11 parsed them
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
  const std::string shown = o.config_args.display();
  config::SourcedParseResult result;
  try {
    result = parse_config_args(o.config_args, config::ParseOptions{o.world_size, o.strict});
  } catch (const porter::Error& e) {
    // The message names the file (or --set) it is about.
    err << "error: " << e.what() << "\n";
    err << shown << ": invalid\n";
    return kExitInvalid;
  }
  print_diagnostics(result, err);
  if (o.json) {
    out << config::to_json_string(result.config) << "\n";
  } else {
    out << shown << ": valid at world size " << o.world_size << " ("
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
  CLI::Option* file_option = check_cmd->add_option(
      "FILE", options->positional,
      "The JSON config (DeepSpeed keys plus \"porter\"); several are merged, each over the ones "
      "before (objects merge key by key, other values replace)");
  CLI::Option* config_option =
      check_cmd->add_option("--config", options->flagged, "A config file, as FILE; repeatable")
          ->type_name("FILE")
          ->allow_extra_args(false);
  add_set_option(check_cmd, options->config_args.sets);
  check_cmd->add_option("--world-size", options->world_size,
                        "Ranks the run will have; the batch sizes are checked against it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_val(1);
  check_cmd->add_flag("--strict", options->strict, "Treat every warning as an error");
  check_cmd->add_flag("--json", options->json, "Print the resolved config as JSON");
  check_cmd->footer("Exit codes: 0 valid, 1 usage error, 2 invalid config.");
  check_cmd->callback([options, check_cmd, file_option, config_option, &context] {
    // FILE and --config may be mixed; the files merge in the order they were given.
    std::vector<std::string>& files = options->config_args.files;
    files.clear();
    size_t next_positional = 0, next_flagged = 0;
    for (const CLI::Option* opt : check_cmd->parse_order()) {
      if (opt == file_option && next_positional < options->positional.size()) {
        files.push_back(options->positional[next_positional++]);
      } else if (opt == config_option && next_flagged < options->flagged.size()) {
        files.push_back(options->flagged[next_flagged++]);
      }
    }
    if (files.empty()) throw CLI::RequiredError("FILE or --config");
    context.exit_code = check(*options, *context.out, *context.err);
  });
}

}  // namespace porter::cli
