// `porter estimate --config F [--budget B] [--json]`: model-state and activation bytes of the
// built-in GPT under every checkpoint policy, from the analytic model, without allocating.
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "checkpoint/analytic.h"
#include "checkpoint/planner.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace porter::cli {
namespace {

struct EstimateOptions {
  std::string file;
  std::string budget;
  bool json = false;
  bool strict = false;
};

struct PolicyEstimate {
  config::CheckpointPolicy policy;
  std::string label;          // "uniform (every 1 layer)"
  std::string error;          // why the policy does not apply; empty when it does
  std::string description;    // the plan's own one-liner
  size_t activation_peak_bytes = 0;
  size_t total_peak_bytes = 0;  // model states + batch + activations + workspace
  double recompute_flop_fraction = 0.0;
};

// Recompute FLOPs over one step's forward + backward FLOPs (backward = 2 x forward).
double flop_fraction(const checkpoint::Prediction& p, const checkpoint::ChainCosts& costs) {
  double forward = 0.0;
  for (const checkpoint::StageCost& s : costs.stages) forward += s.forward_flops;
  return forward > 0.0 ? p.recompute_flops / (3.0 * forward) : 0.0;
}

int estimate(const EstimateOptions& o, std::ostream& out, std::ostream& err) {
  const config::Config cfg = load_config(o.file, o.strict, err);
  const checkpoint::GptShape shape = gpt_shape(cfg);
  const nn::DType dtype = shape.compute_dtype;
  const checkpoint::ChainCosts costs = checkpoint::analytic_gpt_costs(
      shape, checkpoint::selective_policy(cfg.porter.checkpointing.selective_ops));
  const checkpoint::ModelStateBytes ms = checkpoint::gpt_model_state_bytes(cfg.porter.model, dtype);
  const size_t model_state = ms.params + ms.grads + ms.optimizer;
  const size_t batch = batch_bytes(cfg);
  const std::optional<size_t> capacity = planned_capacity_bytes(cfg);
  const int64_t layers = cfg.porter.model.layers;

  std::optional<config::MemoryBudget> budget = cfg.porter.checkpointing.memory_budget;
  if (!o.budget.empty()) budget = parse_budget_flag(o.budget);

  std::vector<PolicyEstimate> rows;
  auto add = [&](config::CheckpointPolicy policy, std::string label,
                 const std::function<void(checkpoint::PlanOptions&)>& tweak) {
    PolicyEstimate e;
    e.policy = policy;
    e.label = std::move(label);
    checkpoint::PlanOptions po = plan_options(cfg);
    po.checkpointing.policy = policy;
    tweak(po);
    try {
      checkpoint::Plan plan = checkpoint::make_plan(po, costs);
      e.description = plan.description;
      e.activation_peak_bytes = plan.prediction.peak_activation_bytes;
      e.total_peak_bytes = model_state + batch + plan.prediction.peak_total_bytes;
      e.recompute_flop_fraction = flop_fraction(plan.prediction, costs);
    } catch (const porter::Error& ex) {
      e.error = ex.what();
    }
    rows.push_back(std::move(e));
  };
  using P = config::CheckpointPolicy;
  add(P::kNone, "none", [](auto&) {});
  add(P::kFull, "full", [](auto&) {});
  {
    // uniform: the config's segments when it names them, else Megatron's default of one
    // layer per segment.
    const auto& ck = cfg.porter.checkpointing;
    std::string label;
    std::optional<int64_t> every = ck.every_n_layers;
    std::optional<int64_t> number;
    if (!every && cfg.activation_checkpointing) number = cfg.activation_checkpointing->number_checkpoints;
    if (!every && !number) every = 1;
    label = every ? "uniform (every " + std::to_string(*every) + " layer" + (*every == 1 ? ")" : "s)")
                  : "uniform (" + std::to_string(*number) + " checkpoints)";
    add(P::kUniform, label, [&](checkpoint::PlanOptions& po) {
      po.checkpointing.every_n_layers = every;
      po.number_checkpoints = every ? std::nullopt : number;
    });
  }
  {
    const int64_t n = cfg.porter.checkpointing.block_layers.value_or((layers + 1) / 2);
    add(P::kBlock, "block (first " + std::to_string(n) + " of " + std::to_string(layers) + " layers)",
        [&](checkpoint::PlanOptions& po) { po.checkpointing.block_layers = n; });
  }
  add(P::kSqrt, "sqrt", [](auto&) {});
  add(P::kSelective, "selective", [](auto&) {});
  if (budget) {
    const size_t budget_bytes = checkpoint::resolve_budget(*budget, costs);
    std::string label = "optimal (budget " + format_bytes(budget_bytes);
    if (budget->is_fraction()) {
      char frac[48];
      std::snprintf(frac, sizeof frac, ", %.2f of none's peak", std::get<double>(budget->value));
      label += frac;
    }
    label += ")";
    add(P::kOptimal, label, [&](checkpoint::PlanOptions& po) { po.budget = budget; });
  }

  auto fits = [&](const PolicyEstimate& e) -> std::optional<bool> {
    if (!capacity || !e.error.empty()) return std::nullopt;
    return e.total_peak_bytes <= *capacity;
  };

  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.file;
    j["model"] = {{"layers", layers}, {"hidden", cfg.porter.model.hidden},
                  {"heads", cfg.porter.model.heads}, {"seq_len", cfg.porter.model.seq_len},
                  {"vocab", cfg.porter.model.vocab}, {"compute_dtype", nn::dtype_name(dtype)},
                  {"micro_batch", cfg.train_micro_batch_size_per_gpu},
                  {"gradient_accumulation_steps", cfg.gradient_accumulation_steps}};
    j["model_state_bytes"] = {{"params", ms.params}, {"grads", ms.grads},
                              {"optimizer", ms.optimizer}, {"total", model_state}};
    j["batch_bytes"] = batch;
    j["capacity_bytes"] = capacity ? nlohmann::ordered_json(*capacity) : nlohmann::ordered_json();
    j["policies"] = nlohmann::ordered_json::array();
    for (const PolicyEstimate& e : rows) {
      nlohmann::ordered_json p;
      p["policy"] = config::to_string(e.policy);
      p["label"] = e.label;
      if (!e.error.empty()) {
        p["error"] = e.error;
      } else {
        p["description"] = e.description;
        p["params_bytes"] = ms.params;
        p["grads_bytes"] = ms.grads;
        p["optimizer_bytes"] = ms.optimizer;
        p["activation_peak_bytes"] = e.activation_peak_bytes;
        p["total_peak_bytes"] = e.total_peak_bytes;
        p["recompute_flop_fraction"] = e.recompute_flop_fraction;
        std::optional<bool> f = fits(e);
        p["fits"] = f ? nlohmann::ordered_json(*f) : nlohmann::ordered_json();
      }
      j["policies"].push_back(std::move(p));
    }
    out << j.dump(2) << "\n";
    return kExitOk;
  }

  out << "porter estimate: " << o.file << "\n";
  out << "  model: GPT, " << layers << " layers, hidden " << cfg.porter.model.hidden << ", "
      << cfg.porter.model.heads << " heads, seq " << cfg.porter.model.seq_len << ", vocab "
      << cfg.porter.model.vocab << ", " << nn::dtype_name(dtype) << "\n";
  out << "  micro-batch " << cfg.train_micro_batch_size_per_gpu << " x "
      << cfg.porter.model.seq_len << " tokens, " << cfg.gradient_accumulation_steps
      << " per step; device memory "
      << (capacity ? format_bytes(*capacity) : std::string("(the GPU's, not known without it)"))
      << "\n\n";
  out << "  model states (every policy): params " << format_bytes(ms.params) << ", grads "
      << format_bytes(ms.grads) << ", optimizer " << format_bytes(ms.optimizer) << " = "
      << format_bytes(model_state) << "; batch " << format_bytes(batch) << "\n\n";
  Table t({"policy", "activation peak", "total peak", "recompute", "fits"});
  for (const PolicyEstimate& e : rows) {
    if (!e.error.empty()) {
      t.add({e.label, "-", "-", "-", "n/a"});
      continue;
    }
    char pct[32];
    std::snprintf(pct, sizeof pct, "+%.1f%% FLOPs", 100.0 * e.recompute_flop_fraction);
    std::optional<bool> f = fits(e);
    t.add({e.label, format_bytes(e.activation_peak_bytes), format_bytes(e.total_peak_bytes), pct,
           f ? (*f ? "yes" : "NO") : "?"});
  }
  t.print(out);
  for (const PolicyEstimate& e : rows) {
    if (!e.error.empty()) out << "  " << e.label << ": " << e.error << "\n";
  }
  if (!budget) {
    out << "  optimal: give --budget (bytes or a fraction of none's peak) or "
           "porter.checkpointing.memory_budget to include it\n";
  }
  out << "\n  total peak = model states + batch + the plan's predicted peak of activations, "
         "checkpoints and workspace (requested bytes; the allocator's rounding adds a little).\n"
         "  recompute = extra forward FLOPs over one step's forward + backward (3 x forward).\n";
  return kExitOk;
}

}  // namespace

void add_estimate_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<EstimateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "estimate", "Model-state and activation memory under every checkpoint policy, without allocating");
  cmd->add_option("--config", o->file, "The JSON config")->required();
  cmd->add_option("--budget", o->budget,
                  "Also plan 'optimal' under this activation budget: bytes (\"6GiB\") or a "
                  "fraction of the none policy's peak");
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config.");
  cmd->callback([o, &context] { context.exit_code = estimate(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
