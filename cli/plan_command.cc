// `porter plan --config F [--budget B] [--json] [--memory-page FILE]`: the checkpoint plan of
// a config: per stage what is kept, held and recomputed and where held inputs live (device or
// host), with the predicted activation peak, recompute cost and, with offload, the copies.
// Costs come from the analytic model (no allocation) unless the policy is optimal or offload
// is on, which need measured times: then the Engine is built on the configured device and
// profiles (and, with offload, measures the link unless sim_link_gbps sets it).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "checkpoint/analytic.h"
#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/memory_page.h"
#include "engine/run_options.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "nn/gpt.h"
#include "zero/partition.h"

namespace porter::cli {
namespace {

struct PlanCommandOptions {
  std::string file;
  std::string budget;
  std::string memory_page;
  bool json = false;
  bool strict = false;
};

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err);

// The plan page (cli/memory_page.h). Model states are this rank's params, grads and
// optimizer state at the configured ZeRO stage: the Engine's when it was built, else exact
// without allocating (Note [Model-state bytes per rank] in zero/partition.h).
void write_plan_page(const PlanCommandOptions& o, const config::Config& cfg,
                     const engine::RunOptions& run, const checkpoint::Plan& plan,
                     const checkpoint::ChainCosts& costs, engine::Engine* eng) {
  config::ModelConfig whole = cfg.porter.model;
  whole.tensor_parallel = 1;  // not modelled, as in porter estimate
  const nn::Gpt gpt(whole);   // the layout and names only; allocates nothing
  PlanPageInput in;
  in.config_file = o.file;
  in.plan = &plan;
  in.costs = &costs;
  in.stage_name = [&gpt](int s) { return gpt.stage_name(s); };
  if (eng != nullptr) {
    in.model_state_bytes = eng->memory_report().model_state_bytes;
  } else {
    const zero::Partition part = zero::make_partition(
        gpt.layout().total_elems(), static_cast<int>(cfg.data_parallel_size()));
    in.model_state_bytes = zero::exact_bytes(part, cfg.zero_optimization.stage,
                                             zero::StateDTypes{run.compute_dtype})
                               .total();
  }
  in.batch_bytes = run.batch_bytes;
  in.capacity_bytes = run.capacity_bytes;
  in.predicted_peak_bytes = run.predicted_peak_bytes(in.model_state_bytes, plan.prediction);
  write_memory_page(o.memory_page, plan_page_data(in), "--memory-page");
}

// Bytes each stage's held input sends to the host per micro-batch (0: none).
std::vector<size_t> offloaded_by_stage(const checkpoint::Plan& plan) {
  std::vector<size_t> v(plan.stages.size(), 0);
  for (const checkpoint::StashEntry& e : plan.offload.entries) {
    if (e.stage >= 0 && static_cast<size_t>(e.stage) < v.size()) v[static_cast<size_t>(e.stage)] += e.bytes;
  }
  return v;
}

nlohmann::ordered_json offload_json(const checkpoint::Plan& plan, double link_bytes_per_s) {
  using nlohmann::ordered_json;
  const checkpoint::OffloadPrediction& p = plan.prediction.offload;
  const checkpoint::OffloadLayout& l = plan.offload;
  auto timed = [&](double v) { return p.timed ? ordered_json(v) : ordered_json(); };
  return {{"enabled", !l.empty()},
          {"checkpoints", l.entries.size()},
          {"offloaded_bytes", l.offloaded_bytes},
          {"pinned_bytes", l.pinned_bytes},
          {"staging_peak_bytes", p.peak_staging_bytes},
          {"staging_slots", l.staging_slots},
          {"staging_slot_bytes", l.staging_slot_bytes},
          {"contiguous", plan.offload.contiguous},
          {"prefetch_depth", plan.sim.prefetch_depth},
          {"d2h_bytes", p.d2h_bytes},
          {"h2d_bytes", p.h2d_bytes},
          {"link_bytes_per_s", link_bytes_per_s > 0 ? ordered_json(link_bytes_per_s) : ordered_json()},
          {"timed", p.timed},
          {"copy_busy_s", timed(p.copy_busy_s)},
          {"exposed_s", timed(p.exposed_s)},
          {"hidden_fraction", timed(p.hidden_fraction())}};
}

// The offload lines of the text output (nothing without host holds).
void print_offload(const checkpoint::Plan& plan, double link_bytes_per_s, int64_t micro_batches,
                   std::ostream& out) {
  const checkpoint::OffloadLayout& l = plan.offload;
  if (l.empty()) return;
  const checkpoint::OffloadPrediction& p = plan.prediction.offload;
  out << "  offload: " << l.entries.size() << " checkpoint" << (l.entries.size() == 1 ? "" : "s")
      << ", " << format_bytes(l.offloaded_bytes) << " to the host per micro-batch ("
      << format_bytes(p.h2d_bytes) << " back); pinned " << format_bytes(l.pinned_bytes)
      << "; staging " << format_bytes(p.peak_staging_bytes) << " at most ("
      << l.staging_slots << " slot" << (l.staging_slots == 1 ? "" : "s") << " of "
      << format_bytes(l.staging_slot_bytes) << (l.contiguous ? ", one contiguous arena" : "")
      << "); prefetch depth " << plan.sim.prefetch_depth << "\n";
  if (p.timed) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * p.hidden_fraction());
    out << "  predicted copies: " << format_seconds(p.copy_busy_s * static_cast<double>(micro_batches))
        << " on the link per step, " << format_seconds(p.exposed_s * static_cast<double>(micro_batches))
        << " exposed (" << buf << " hidden) at " << format_bytes(static_cast<uint64_t>(link_bytes_per_s))
        << "/s each way\n";
  } else {
    out << "  predicted copies: untimed ("
        << (link_bytes_per_s > 0 ? "the analytic model has no compute times"
                                 : "no link bandwidth: set porter.device.sim_link_gbps")
        << ")\n";
  }
}

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

  const engine::RunOptions run = engine::make_run_options(cfg);
  const checkpoint::ChainCosts analytic = run.analytic_costs();
  checkpoint::ChainCosts costs;
  checkpoint::Plan plan;
  std::string where_from;
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<engine::Engine> eng;
  // Note [Engine costs]: optimal needs measured times, and so does the exposed copy time of
  // an offloading plan; the Engine profiles and plans exactly as training would.
  if (run.cost_source(true, engine::CostUse::kPlan) == engine::CostSource::kProfiled) {
    device = memory::make_device(run.device);
    eng = std::make_unique<engine::Engine>(
        *device, std::make_unique<engine::GptModel>(cfg.porter.model), cfg);
    costs = eng->costs();
    plan = eng->plan();
    where_from = "profiled on " + device->description();
  } else {
    costs = analytic;
    plan = checkpoint::make_plan(run.plan, costs);
    where_from = "analytic model (nothing allocated)";
  }
  const checkpoint::Prediction none =
      checkpoint::simulate(checkpoint::schedule_none(costs), costs);
  // FLOPs come from the analytic model whatever the costs' source (profiles measure times,
  // not FLOPs): the plan's schedule replayed on analytic costs counts its extra forwards.
  const checkpoint::Prediction flops = checkpoint::simulate(plan.schedule, analytic);
  const double flop_fraction = engine::recompute_flop_fraction(flops, analytic);
  // Measured-cost overhead: recompute time over the rest of the micro-batch's compute.
  const double base_s = plan.prediction.compute_s - plan.prediction.recompute_s;
  const double time_fraction = base_s > 0.0 ? plan.prediction.recompute_s / base_s : 0.0;
  const std::string policy(config::to_string(plan.policy));
  // Offload: the engine's link (measured, or sim_link_gbps) when it planned, else the config's.
  const double link_bytes_per_s = eng ? eng->link_bytes_per_s() : plan.sim.link_bytes_per_s;
  const bool timed = plan.prediction.offload.timed;
  const std::vector<size_t> offloaded = offloaded_by_stage(plan);

  if (!o.memory_page.empty()) write_plan_page(o, cfg, run, plan, costs, eng.get());

  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.file;
    j["policy"] = policy;
    j["description"] = plan.description;
    j["budget_bytes"] = plan.budget_bytes ? nlohmann::ordered_json(*plan.budget_bytes)
                                          : nlohmann::ordered_json();
    j["costs"] = costs.source;
    j["stages"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < plan.stages.size(); ++i) {
      const checkpoint::StagePlan& s = plan.stages[i];
      j["stages"].push_back({{"name", s.name}, {"action", s.action},
                             {"holds_input", s.holds_input}, {"forwards", s.forwards},
                             {"where", checkpoint::where_name(s.where)},
                             {"offloaded_bytes", offloaded[i]},
                             {"exposed_copy_s", timed ? nlohmann::ordered_json(s.exposed_copy_s)
                                                      : nlohmann::ordered_json()}});
    }
    j["predicted_activation_peak_bytes"] = plan.prediction.peak_activation_bytes;
    j["predicted_total_peak_bytes"] = plan.prediction.peak_total_bytes;
    j["none_activation_peak_bytes"] = none.peak_activation_bytes;
    j["micro_batches_per_step"] = micro_batches;
    j["predicted_recompute_s"] =
        costs.has_times() ? nlohmann::ordered_json(plan.prediction.recompute_s * micro_batches)
                          : nlohmann::ordered_json();
    j["recompute_time_fraction"] =
        costs.has_times() ? nlohmann::ordered_json(time_fraction) : nlohmann::ordered_json();
    j["recompute_flops"] = flops.recompute_flops * static_cast<double>(micro_batches);
    j["recompute_flop_fraction"] = flop_fraction;
    j["offload"] = offload_json(plan, link_bytes_per_s);
    j["schedule"] = plan.schedule.to_string();
    out << j.dump(2) << "\n";
    return kExitOk;
  }

  out << "porter plan: " << o.file << "\n";
  out << "  " << plan.description << "\n";
  if (plan.budget_bytes) out << "  budget " << format_bytes(*plan.budget_bytes) << "\n";
  out << "  costs: " << where_from << "\n\n";
  const bool offload = !plan.offload.empty();
  std::vector<std::string> header = {"stage", "action", "holds input", "forwards", "where"};
  if (offload) header.push_back("offloaded");
  if (offload && timed) header.push_back("exposed copy");
  Table t(header);
  for (size_t i = 0; i < plan.stages.size(); ++i) {
    const checkpoint::StagePlan& s = plan.stages[i];
    std::vector<std::string> row = {s.name, s.action, s.holds_input ? "yes" : "no",
                                    std::to_string(s.forwards),
                                    std::string(checkpoint::where_name(s.where))};
    if (offload) row.push_back(offloaded[i] ? format_bytes(offloaded[i]) : "-");
    if (offload && timed) row.push_back(s.where == checkpoint::Where::kHost ? format_seconds(s.exposed_copy_s) : "-");
    t.add(row);
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
    char tpct[32];
    std::snprintf(tpct, sizeof tpct, "+%.1f%%", 100.0 * time_fraction);
    out << format_seconds(plan.prediction.recompute_s * static_cast<double>(micro_batches))
        << " per step (" << micro_batches << " micro-batch" << (micro_batches == 1 ? "" : "es")
        << "): " << tpct << " of the step's compute time, " << pct << " of its FLOPs\n";
  } else {
    out << pct << " of the step's FLOPs (forward + backward = 3 x forward; the analytic model "
           "has no times)\n";
  }
  print_offload(plan, link_bytes_per_s, micro_batches, out);
  out << "  schedule: " << plan.schedule.to_string() << "\n";
  if (!o.memory_page.empty()) out << "  memory page: " << o.memory_page << "\n";
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
  cmd->add_option("--memory-page", o->memory_page,
                  "Write the predicted memory of one micro-batch as one HTML page");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config or budget, 3 out of "
              "memory while profiling.");
  cmd->callback([o, &context] { context.exit_code = plan(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
