// The `porter` app: global flags, the subcommands, and the mapping of errors to exit codes.
#include "cli/app.h"

#include <exception>

#include "base/build_config.h"
#include "base/error.h"
#include "cli/commands.h"

namespace porter::cli {

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
        bool err_is_tty) {
  CLI::App app{"porter: train models that do not fit, within a memory budget (ZeRO, activation "
               "checkpointing, offload)",
               "porter"};
  app.set_version_flag("--version", std::string("porter ") + PORTER_VERSION);
  app.require_subcommand(1);
  app.footer("Exit codes: 0 success, 1 usage error, 2 invalid input (e.g. an invalid config), "
             "3 out of memory; porter launch and train --nproc: the code of the first rank that "
             "failed.");

  CommandContext context;
  context.out = &out;
  context.err = &err;
  context.err_is_tty = err_is_tty;
  for (int i = 1; i < argc; ++i) context.args.emplace_back(argv[i]);
  add_train_command(app, context);
  add_plan_command(app, context);
  add_estimate_command(app, context);
  add_stress_command(app, context);
  add_consolidate_command(app, context);
  add_config_command(app, context);
  add_launch_command(app, context);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive here too, with exit code 0.
    int code = app.exit(e, out, err);
    return code == 0 ? kExitOk : kExitUsage;
  } catch (const porter::OutOfMemoryError& e) {
    // The allocator's message accounts for every byte and ends with a hint.
    err << "error: " << context.error_prefix << e.what() << "\n";
    return kExitOom;
  } catch (const porter::UsageError& e) {
    // Flags that parse but do not go together (--trace-rank without a trace, launch with no
    // command): usage, as CLI11's own errors.
    err << "error: " << context.error_prefix << e.what() << "\n";
    return kExitUsage;
  } catch (const porter::Error& e) {
    err << "error: " << context.error_prefix << e.what() << "\n";
    return kExitInvalid;
  } catch (const std::exception& e) {
    err << "error: " << context.error_prefix << "unexpected failure (a bug in porter): "
        << e.what() << "\n";
    return kExitInvalid;
  }
  return context.exit_code;
}

}  // namespace porter::cli
