// `porter stress --config F [--runs N] [--seed S] [--first R] [--steps K] [--json]`: the
// memory-pressure stress test (cli/stress.h, docs/cli.md): a progress line per run on stderr,
// then a summary (or JSON) on stdout. Exit 0 when every run passes, 1 when any fails.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/stress.h"

namespace porter::cli {
namespace {

using nlohmann::ordered_json;

struct StressCommandOptions {
  ConfigArgs config_args;  // --config files and --set overrides
  int64_t runs = 10;
  uint64_t seed = 1;
  int64_t first = 0;
  int64_t steps = 3;
  bool json = false;
  bool strict = false;
};

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.1f%%", 100.0 * fraction);
  return buf;
}

std::string repro(const StressCommandOptions& o, int64_t run) {
  return "porter stress " + o.config_args.command_args() + " --seed " + std::to_string(o.seed) + " --first " +
         std::to_string(run) + " --runs 1 --steps " + std::to_string(o.steps);
}

std::string progress_line(const RunResult& r, int64_t index, int64_t runs) {
  std::string s = "run " + std::to_string(r.variation.run) + " (" + std::to_string(index) + "/" +
                  std::to_string(runs) + ")  " + r.variation.label;
  if (r.limit_bytes) s += "  limit " + format_bytes(r.limit_bytes);
  if (r.measured_peak_bytes) {
    s += "  peak " + format_bytes(r.measured_peak_bytes) + " (" + percent(r.total_error()) +
         ", act " + percent(r.activation_error()) + ")";
  }
  if (!r.below_outcome.empty()) s += "  below: " + r.below_outcome;
  char t[32];
  std::snprintf(t, sizeof t, "  %.2f s", r.seconds);
  s += std::string("  ") + (r.passed ? "pass" : "FAIL") + t + "\n";
  for (const std::string& f : r.failures) s += "    " + f + "\n";
  return s;
}

ordered_json worst_json(const RunResult* r, bool activation) {
  if (!r) return ordered_json();
  return {{"run", r->variation.run},
          {"predicted_bytes", activation ? r->predicted_activation_bytes : r->predicted_peak_bytes},
          {"measured_bytes", activation ? r->measured_activation_bytes : r->measured_peak_bytes},
          {"error", activation ? r->activation_error() : r->total_error()}};
}

ordered_json run_json(const RunResult& r) {
  return {{"run", r.variation.run},
          {"variation", r.variation.label},
          {"passed", r.passed},
          {"failures", r.failures},
          {"limit_bytes", r.limit_bytes},
          {"predicted_peak_bytes", r.predicted_peak_bytes},
          {"measured_peak_bytes", r.measured_peak_bytes},
          {"reserved_peak_bytes", r.reserved_peak_bytes},
          {"predicted_activation_bytes", r.predicted_activation_bytes},
          {"measured_activation_bytes", r.measured_activation_bytes},
          {"offloaded_bytes", r.offloaded_bytes},
          {"replanned", r.replanned},
          {"below_limit_bytes",
           r.below_limit_bytes ? ordered_json(*r.below_limit_bytes) : ordered_json()},
          {"below_outcome", r.below_outcome.empty() ? ordered_json() : ordered_json(r.below_outcome)},
          {"seconds", r.seconds}};
}

std::string worst_text(const RunResult* r, bool activation) {
  if (!r) return "(nothing measured)";
  const size_t p = activation ? r->predicted_activation_bytes : r->predicted_peak_bytes;
  const size_t m = activation ? r->measured_activation_bytes : r->measured_peak_bytes;
  return percent(activation ? r->activation_error() : r->total_error()) + " (run " +
         std::to_string(r->variation.run) + ": predicted " + format_bytes(p) + ", measured " +
         format_bytes(m) + ")";
}

int stress(const StressCommandOptions& o, std::ostream& out, std::ostream& err) {
  if (o.runs < 1) throw InvalidArgument("--runs: expected at least 1, got " + std::to_string(o.runs));
  if (o.steps < 1) throw InvalidArgument("--steps: expected at least 1, got " + std::to_string(o.steps));
  if (o.first < 0) throw InvalidArgument("--first: expected a run index >= 0, got " + std::to_string(o.first));
  const config::Config base = load_config(o.config_args, o.strict, err);
  StressOptions so;
  so.seed = o.seed;
  so.runs = o.runs;
  so.first = o.first;
  so.steps = o.steps;

  const auto t0 = std::chrono::steady_clock::now();
  int64_t index = 0;
  const StressSummary summary = run_stress(base, so, [&](const RunResult& r) {
    err << progress_line(r, ++index, o.runs) << std::flush;
  });
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t below = 0, below_oom = 0;
  for (const RunResult& r : summary.runs) {
    if (r.below_limit_bytes) ++below;
    if (!r.below_outcome.empty()) ++below_oom;
  }
  const int rc = summary.failed() == 0 ? kExitOk : kExitChecksFailed;

  if (o.json) {
    ordered_json j;
    j["config"] = o.config_args.display();
    j["seed"] = o.seed;
    j["first"] = o.first;
    j["runs"] = o.runs;
    j["steps"] = o.steps;
    j["margin"] = {{"bytes", kMarginBytes}, {"fraction", kMarginFraction}};
    j["passed"] = summary.passed();
    j["failed"] = summary.failed();
    j["below_peak_checks"] = below;
    j["below_peak_out_of_memory"] = below_oom;
    j["worst_activation_peak_error"] = worst_json(summary.worst_activation(), true);
    j["worst_total_peak_error"] = worst_json(summary.worst_total(), false);
    j["wall_s"] = wall_s;
    j["results"] = ordered_json::array();
    j["failures"] = ordered_json::array();
    for (const RunResult& r : summary.runs) {
      j["results"].push_back(run_json(r));
      if (!r.passed) {
        j["failures"].push_back({{"run", r.variation.run}, {"seed", o.seed},
                                 {"variation", r.variation.label}, {"reasons", r.failures},
                                 {"repro", repro(o, r.variation.run)}});
      }
    }
    out << j.dump(2) << "\n";
    return rc;
  }

  out << "porter stress: " << o.config_args.display() << ", seed " << o.seed << ", runs " << o.first << ".."
      << o.first + o.runs - 1 << ", " << o.steps << " step" << (o.steps == 1 ? "" : "s")
      << " each\n\nsummary\n";
  // Two columns, both left-aligned: the values are phrases, not numbers.
  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("runs", std::to_string(summary.runs.size()));
  rows.emplace_back("passed", std::to_string(summary.passed()));
  rows.emplace_back("failed", std::to_string(summary.failed()));
  rows.emplace_back("below-peak checks", std::to_string(below) + " (" + std::to_string(below_oom) +
                                             " out of memory, cleanly)");
  rows.emplace_back("worst activation peak error", worst_text(summary.worst_activation(), true));
  rows.emplace_back("worst total peak error", worst_text(summary.worst_total(), false));
  char margin[96];
  std::snprintf(margin, sizeof margin, "predicted peak + %s + %.0f%%",
                format_bytes(kMarginBytes).c_str(), 100.0 * kMarginFraction);
  rows.emplace_back("limit", margin);
  char wall[32];
  std::snprintf(wall, sizeof wall, "%.1f s", wall_s);
  rows.emplace_back("wall time", wall);
  size_t width = 0;
  for (const auto& [k, v] : rows) width = std::max(width, k.size());
  for (const auto& [k, v] : rows) out << "  " << k << std::string(width - k.size() + 2, ' ') << v << "\n";
  if (summary.failed() > 0) {
    out << "\nfailures\n";
    for (const RunResult& r : summary.runs) {
      if (r.passed) continue;
      out << "  run " << r.variation.run << " (seed " << o.seed << "): " << r.variation.label
          << "\n";
      for (const std::string& f : r.failures) out << "    " << f << "\n";
      out << "    reproduce: " << repro(o, r.variation.run) << "\n";
    }
  }
  return rc;
}

}  // namespace

void add_stress_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<StressCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "stress", "Train random variations of a config under tight memory limits and check them");
  add_config_options(cmd, o->config_args, "The JSON config the variations are drawn from");
  cmd->add_option("--runs", o->runs, "Number of variations (default 10)");
  cmd->add_option("--seed", o->seed, "Seed of the draws (default 1)");
  cmd->add_option("--first", o->first, "Index of the first run (reproduce run R: --first R --runs 1)");
  cmd->add_option("--steps", o->steps, "Training steps per run (default 3)");
  cmd->add_flag("--json", o->json, "Print the summary as JSON");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 every run passed, 1 a run failed (or a usage error), 2 invalid "
              "config or flag values.");
  cmd->callback([o, &context] { context.exit_code = stress(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
