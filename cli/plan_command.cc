// `porter plan --config F [--budget B] [--json]`: the checkpoint plan of a config: per stage
// what is kept, held and recomputed, with the predicted activation peak and recompute cost.
// Costs come from the analytic model (no allocation) unless the policy is optimal, which
// needs measured times: then the Engine is built on the configured device and profiles.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "checkpoint/analytic.h"
#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "engine/engine.h"
#include "engine/model.h"

namespace porter::cli {
namespace {

struct PlanCommandOptions {
  std::string file;
  std::string budget;
  bool json = false;
  bool strict = false;
};

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err);

// Errors about the budget name the flag when the budget came from it.
int plan(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  try {
    return plan_impl(o, out, err);
  } catch (const InvalidArgument& e) {
    if (o.budget.empty() || std::string(e.what()).find("memory_budget") == std::string::npos) throw;
    throw InvalidArgument("--budget " + o.budget + ": " + e.what());
  }
}

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  config::Config cfg = load_config(o.file, o.strict, err);
  if (!o.budget.empty()) {
    // A budget only means something to the optimal planner.
    cfg.porter.checkpointing.policy = config::CheckpointPolicy::kOptimal;
    cfg.porter.checkpointing.memory_budget = parse_budget_flag(o.budget);
  }
  const int64_t micro_batches = cfg.gradient_accumulation_steps;

  checkpoint::ChainCosts costs;
  checkpoint::Plan plan;
  std::string where_from;
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<engine::Engine> eng;
  if (cfg.porter.checkpointing.policy == config::CheckpointPolicy::kOptimal) {
    device = memory::make_device(device_options(cfg));
    eng = std::make_unique<engine::Engine>(
        *device, std::make_unique<engine::GptModel>(cfg.porter.model), cfg);
    costs = eng->costs();
    plan = eng->plan();
    where_from = "profiled on " + device->description();
  } else {
    costs = checkpoint::analytic_gpt_costs(
        gpt_shape(cfg), checkpoint::selective_policy(cfg.porter.checkpointing.selective_ops));
    plan = checkpoint::make_plan(plan_options(cfg), costs);
    where_from = "analytic model (nothing allocated)";
  }
  const checkpoint::Prediction none =
      checkpoint::simulate(checkpoint::schedule_none(costs), costs);
  double forward_flops = 0.0;
  for (const checkpoint::StageCost& s : costs.stages) forward_flops += s.forward_flops;
  const double flop_fraction =
      forward_flops > 0.0 ? plan.prediction.recompute_flops / (3.0 * forward_flops) : 0.0;
  const std::string policy(config::to_string(plan.policy));

  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.file;
    j["policy"] = policy;
    j["description"] = plan.description;
    j["budget_bytes"] = plan.budget_bytes ? nlohmann::ordered_json(*plan.budget_bytes)
                                          : nlohmann::ordered_json();
    j["costs"] = costs.source;
    j["stages"] = nlohmann::ordered_json::array();
    for (const checkpoint::StagePlan& s : plan.stages) {
      j["stages"].push_back({{"name", s.name}, {"action", s.action},
                             {"holds_input", s.holds_input}, {"forwards", s.forwards},
                             {"where", checkpoint::where_name(s.where)}});
    }
    j["predicted_activation_peak_bytes"] = plan.prediction.peak_activation_bytes;
    j["predicted_total_peak_bytes"] = plan.prediction.peak_total_bytes;
    j["none_activation_peak_bytes"] = none.peak_activation_bytes;
    j["micro_batches_per_step"] = micro_batches;
    j["predicted_recompute_s"] =
        costs.has_times() ? nlohmann::ordered_json(plan.prediction.recompute_s * micro_batches)
                          : nlohmann::ordered_json();
    j["recompute_flops"] = plan.prediction.recompute_flops * static_cast<double>(micro_batches);
    j["recompute_flop_fraction"] = flop_fraction;
    j["schedule"] = plan.schedule.to_string();
    out << j.dump(2) << "\n";
    return kExitOk;
  }

  out << "porter plan: " << o.file << "\n";
  out << "  " << plan.description << "\n";
  if (plan.budget_bytes) out << "  budget " << format_bytes(*plan.budget_bytes) << "\n";
  out << "  costs: " << where_from << "\n\n";
  Table t({"stage", "action", "holds input", "forwards", "where"});
  for (const checkpoint::StagePlan& s : plan.stages) {
    t.add({s.name, s.action, s.holds_input ? "yes" : "no", std::to_string(s.forwards),
           std::string(checkpoint::where_name(s.where))});
  }
  t.print(out);
  char pct[64];
  std::snprintf(pct, sizeof pct, "%.1f%%",
                none.peak_activation_bytes
                    ? 100.0 * static_cast<double>(plan.prediction.peak_activation_bytes) /
                          static_cast<double>(none.peak_activation_bytes)
                    : 0.0);
  out << "\n  predicted activation peak: " << format_bytes(plan.prediction.peak_activation_bytes)
      << " per micro-batch (" << pct << " of none's " << format_bytes(none.peak_activation_bytes)
      << ")\n";
  std::snprintf(pct, sizeof pct, "+%.1f%%", 100.0 * flop_fraction);
  out << "  predicted recompute: ";
  if (costs.has_times()) {
    out << format_seconds(plan.prediction.recompute_s * static_cast<double>(micro_batches))
        << " per step (" << micro_batches << " micro-batch" << (micro_batches == 1 ? "" : "es")
        << "), " << pct << " of the step's FLOPs\n";
  } else {
    out << pct << " of the step's FLOPs (forward + backward = 3 x forward; the analytic model "
           "has no times)\n";
  }
  out << "  schedule: " << plan.schedule.to_string() << "\n";
  return kExitOk;
}

}  // namespace

void add_plan_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<PlanCommandOptions>();
  CLI::App* cmd = app.add_subcommand("plan", "Print the checkpoint plan of a config");
  cmd->add_option("--config", o->file, "The JSON config")->required();
  cmd->add_option("--budget", o->budget,
                  "Plan 'optimal' under this activation budget: bytes (\"6GiB\") or a fraction "
                  "of the none policy's peak (overrides the config's policy)");
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config or budget, 3 out of "
              "memory while profiling.");
  cmd->callback([o, &context] { context.exit_code = plan(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
