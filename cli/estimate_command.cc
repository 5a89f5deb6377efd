// `porter estimate --config F [--world-size N] [--tensor-parallel T] [--budget B] [--json]`:
// per-rank model-state bytes of the built-in GPT for ZeRO stages 0..3 (porter's exact bytes
// beside the ZeRO paper's formulas), activation bytes under every checkpoint policy, and per
// tensor-parallel degree (beside Korthikanti et al.'s formula), without allocating.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iomanip>
#include <memory>
#include <numeric>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "models/analytic.h"
#include "checkpoint/planner.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/reports.h"
#include "comm/env.h"
#include "engine/forecast.h"
#include "engine/host_fit.h"
#include "engine/run_options.h"
#include "engine/stage3.h"
#include "models/factory.h"
#include "zero/partition.h"

namespace porter::cli {
namespace {

struct EstimateOptions {
  ConfigArgs config_args;  // --config files and --set overrides
  std::optional<int64_t> world_size;
  std::optional<int64_t> tensor_parallel;  // overrides porter.model.tensor_parallel
  std::string budget;
  std::optional<int64_t> ranks_per_node;   // Note [Host fit]: else the launcher's, else min(world, 8)
  std::string host_memory;                 // the node's memory; empty: this machine's
  bool json = false;
  bool strict = false;
  std::string config_name;  // the report's "config" in place of the files' names (estimate_report)
};

struct PolicyEstimate {
  config::CheckpointPolicy policy;
  std::string label;          // "uniform (every 1 layer)"
  std::string error;          // why the policy does not apply; empty when it does
  std::string description;    // the plan's own one-liner
  size_t activation_peak_bytes = 0;
  size_t gathered_peak_bytes = 0;  // ZeRO stage 3: gathered parameters alive at once, at most
  size_t total_peak_bytes = 0;  // model states + batch + activations + workspace
  size_t stash_pinned_bytes = 0;  // activation offload's pinned slots (Note [Host fit])
  double recompute_flop_fraction = 0.0;
};

// One ZeRO stage's per-rank model-state bytes: porter's exact ones and the paper's.
struct StageEstimate {
  int stage = 0;
  zero::StateBytes exact, paper;
  std::string formula;  // the paper's formula with porter's p, g, k and N substituted
  int64_t padding_bytes() const {
    return static_cast<int64_t>(exact.total()) - static_cast<int64_t>(paper.total());
  }
};

std::string stage_formula(int stage, const zero::StateDTypes& d, int n) {
  const std::string p = std::to_string(d.param_bytes()), g = std::to_string(d.grad_bytes()),
                    k = std::to_string(d.optimizer_bytes()), ns = std::to_string(n);
  switch (stage) {
    case 0: return "(" + p + "+" + g + "+" + k + ") Psi";
    case 1: return "(" + p + "+" + g + ") Psi + " + k + " Psi/" + ns;
    case 2: return p + " Psi + (" + g + "+" + k + ") Psi/" + ns;
    default: return "(" + p + "+" + g + "+" + k + ") Psi/" + ns;
  }
}

// Model states on the device and the host for one offload setting.
struct OffloadEstimate {
  bool optimizer = false, params = false;
  zero::StateBytes device;
  zero::HostStateBytes host;
};

nlohmann::ordered_json host_json(const zero::HostStateBytes& b) {
  return {{"optimizer", b.optimizer}, {"grads", b.grads}, {"params", b.params},
          {"total", b.total()}};
}

nlohmann::ordered_json bytes_json(const zero::StateBytes& b) {
  return {{"params", b.params}, {"grads", b.grads}, {"optimizer", b.optimizer},
          {"total", b.total()}};
}

void print_zero(std::ostream& out, const std::vector<StageEstimate>& stages,
                const zero::Partition& part, int64_t num_params, const zero::StateDTypes& d,
                tensor::DType dtype, int64_t world_size, int dp, int64_t tp) {
  out << "  ZeRO model states per rank at world size " << world_size;
  if (dp != world_size) {
    out << " (" << dp << " data-parallel rank" << (dp == 1 ? "" : "s");
    if (tp > 1) out << " x " << tp << " tensor-parallel";
    out << ")";
  }
  out << ": Psi = " << num_params << " parameters"
      << (tp > 1 ? " (tensor-parallel rank 0's part)" : "") << ";\n  the flat buffer has "
      << part.total_elems
      << " elements (tensors aligned to " << nn::kParamAlignElems << "), padded to "
      << part.padded_elems << " = " << dp << " shard" << (dp == 1 ? "" : "s") << " of "
      << part.shard_elems << ";\n  p = " << d.param_bytes() << " (" << tensor::dtype_name(dtype)
      << " params), g = " << d.grad_bytes() << " (" << tensor::dtype_name(d.grad) << " grads), k = " << d.optimizer_bytes()
      << " (AdamW moments" << (d.optimizer_bytes() == 12 ? " + f32 master" : "") << ")\n";
  Table t({"stage", "params", "grads", "optimizer", "total", "paper formula", "paper", "padding"});
  for (const StageEstimate& e : stages) {
    t.add({std::to_string(e.stage), format_bytes(e.exact.params), format_bytes(e.exact.grads),
           format_bytes(e.exact.optimizer), format_bytes(e.exact.total()), e.formula,
           format_bytes(e.paper.total()),
           (e.padding_bytes() < 0 ? "-" : "+") +
               format_bytes(static_cast<uint64_t>(std::llabs(e.padding_bytes())))});
  }
  t.print(out);
  out << "  total = porter's exact bytes per rank (padding included). paper = Rajbhandari et al.\n"
         "  2020 with porter's p, g, k for their 2, 2, K = 12 (stage 0 (2+2+K)Psi, 1 4Psi + K Psi/N,\n"
         "  2 2Psi + (2+K)Psi/N, 3 (2+2+K)Psi/N). padding = total - paper. The\n"
         "  reduce buckets of stages 2 and 3 are transient and count under comm (docs/zero.md).\n\n";
}

// Note [Estimate tensor parallelism]
// Every figure of porter estimate is one rank's. At porter.model.tensor_parallel t (or
// --tensor-parallel) a rank holds its part of the layout (models::Transformer at tp rank 0: 1/t of the
// split parameters, all of the replicated ones; every rank's part has the same size), which
// ZeRO partitions over the data-parallel ranks, and its activations are the analytic model's
// for one tensor-parallel rank. Without the flag a table also compares t = 1, 2, 4, 8 (those
// dividing heads), with and without sequence parallelism, at the config's data-parallel size:
// the world grows with t.
struct TpEstimate {
  int64_t t = 1;
  bool sequence_parallel = false;
  std::string error;         // why this t does not apply; empty when it does
  size_t layer_bytes = 0;    // models::layer_bytes
  double korthikanti_layer_bytes = 0.0;
  size_t none_peak_bytes = 0, full_peak_bytes = 0;  // activation peaks per micro-batch
  zero::StateBytes model_states;  // at the config's ZeRO stage and data-parallel size
};

std::vector<TpEstimate> tp_estimates(const config::Config& cfg) {
  std::vector<TpEstimate> rows;
  const config::ModelConfig& m = cfg.porter.model;
  const int64_t dp = cfg.data_parallel_size();
  std::vector<int64_t> degrees = {1, 2, 4, 8};
  if (std::find(degrees.begin(), degrees.end(), m.tensor_parallel) == degrees.end()) {
    degrees.push_back(m.tensor_parallel);
    std::sort(degrees.begin(), degrees.end());
  }
  int64_t elems_t = 0, elems = 0;  // the layout's elements at tensor_parallel elems_t
  for (int64_t t : degrees) {
    if (m.heads % t != 0) continue;
    for (bool sp : {false, true}) {
      if (sp && t == 1) continue;
      TpEstimate e;
      e.t = t;
      e.sequence_parallel = sp;
      // The config at this t, translated as a run of it would be (Note [Run options]).
      config::Config c = cfg;
      c.porter.model.tensor_parallel = t;
      c.porter.model.sequence_parallel = sp;
      c.world_size = dp * t;
      const engine::RunOptions run = engine::make_run_options(c);
      const int64_t rows_n = run.shape.micro_batch * run.shape.seq;
      if (sp && (rows_n % t != 0 || (rows_n / t * m.hidden) % 4 != 0)) {
        e.error = std::to_string(rows_n) + " token rows x hidden " + std::to_string(m.hidden) +
                  " do not split into " + std::to_string(t) +
                  " sequence-parallel shards of a multiple of 4 elements";
        rows.push_back(e);
        continue;
      }
      try {
        const checkpoint::ChainCosts costs = run.analytic_costs();
        e.layer_bytes = models::layer_bytes(run.shape);
        e.korthikanti_layer_bytes = models::korthikanti_layer_bytes(run.shape);
        // none and full as the policy table plans them (offload and partitioning included).
        for (auto [policy, into] :
             {std::pair{config::CheckpointPolicy::kNone, &e.none_peak_bytes},
              std::pair{config::CheckpointPolicy::kFull, &e.full_peak_bytes}}) {
          checkpoint::PlanOptions po = run.plan;
          po.checkpointing.policy = policy;
          *into = checkpoint::make_plan(po, costs).prediction.peak_activation_bytes;
        }
        // Tensor-parallel rank 0's layout only; allocates nothing. Sequence parallelism
        // moves activations, not parameters, so each t's layout is built once (at 100,000
        // layers a build is a good part of a second).
        if (elems_t != t) {
          elems = models::build_model(c.porter.model)->layout().total_elems();
          elems_t = t;
        }
        e.model_states = zero::exact_bytes(zero::make_partition(elems, static_cast<int>(dp)),
                                           run.zero_stage(), run.state_dtypes());
      } catch (const porter::Error& ex) {
        e.error = ex.what();
      }
      rows.push_back(e);
    }
  }
  return rows;
}

// Note [Estimate attention]
// One block's activations and the none and full activation peaks per micro-batch with each
// attention (Note [Attention choice] in engine/forecast.h), beside Korthikanti et al.'s
// formula with its 5as/h term (materialised) and without it (flash). The policy table below
// is the chosen attention's.
struct AttentionEstimate {
  config::AttentionKind kind = config::AttentionKind::kMaterialized;
  std::string error;
  size_t layer_bytes = 0;
  double korthikanti_layer_bytes = 0.0;
  size_t none_peak_bytes = 0, full_peak_bytes = 0;
};

std::vector<AttentionEstimate> attention_estimates(const config::Config& cfg) {
  std::vector<AttentionEstimate> rows;
  for (config::AttentionKind kind :
       {config::AttentionKind::kMaterialized, config::AttentionKind::kFlash}) {
    AttentionEstimate e;
    e.kind = kind;
    config::Config c = cfg;
    c.porter.model.attention = kind;
    try {
      const engine::RunOptions run = engine::make_run_options(c);
      e.layer_bytes = models::layer_bytes(run.shape);
      e.korthikanti_layer_bytes = models::korthikanti_layer_bytes(run.shape);
      const checkpoint::ChainCosts costs = run.analytic_costs();
      for (auto [policy, into] : {std::pair{config::CheckpointPolicy::kNone, &e.none_peak_bytes},
                                  std::pair{config::CheckpointPolicy::kFull, &e.full_peak_bytes}}) {
        checkpoint::PlanOptions po = run.plan;
        po.checkpointing.policy = policy;
        po.budget.reset();
        *into = checkpoint::make_plan(po, costs).prediction.peak_activation_bytes;
      }
    } catch (const porter::Error& ex) {
      e.error = ex.what();
    }
    rows.push_back(std::move(e));
  }
  return rows;
}

void print_attention(std::ostream& out, const std::vector<AttentionEstimate>& rows,
                     config::AttentionKind asked, config::AttentionKind chosen) {
  out << "  attention: " << config::to_string(chosen);
  if (asked == config::AttentionKind::kAuto) {
    out << " (porter.model.attention auto: "
        << (chosen == config::AttentionKind::kFlash
                ? "the run does not fit with the materialised probabilities"
                : "the run fits with the materialised probabilities")
        << ")";
  }
  out << "\n";
  Table t({"attention", "layer", "Korthikanti", "none peak", "full peak"});
  for (const AttentionEstimate& e : rows) {
    const std::string name =
        std::string(config::to_string(e.kind)) + (e.kind == chosen ? " *" : "");
    if (!e.error.empty()) {
      t.add({name, "-", "-", "-", "-"});
      continue;
    }
    t.add({name, format_bytes(e.layer_bytes),
           format_bytes(static_cast<uint64_t>(std::llround(e.korthikanti_layer_bytes))),
           format_bytes(e.none_peak_bytes), format_bytes(e.full_peak_bytes)});
  }
  t.print(out);
  for (const AttentionEstimate& e : rows) {
    if (!e.error.empty()) out << "  " << config::to_string(e.kind) << ": " << e.error << "\n";
  }
  out << "  * the run's. layer = one block's activations kept for backward, its input included;\n"
         "  materialized keeps the (B, H, T, T) f32 probabilities, flash the (B, H, T) f32 row\n"
         "  log-sum-exp. Korthikanti = sbh(34 + 5as/h), flash without the 5as/h term.\n\n";
}

void print_tp(std::ostream& out, const std::vector<TpEstimate>& rows, const config::Config& cfg,
              tensor::DType dtype) {
  const config::ModelConfig& m = cfg.porter.model;
  const int64_t dp = cfg.data_parallel_size();
  out << "  tensor parallelism, per rank (" << dp << " data-parallel rank" << (dp == 1 ? "" : "s")
      << " held fixed: the world is " << dp << " x t; ZeRO stage " << cfg.zero_optimization.stage
      << "):\n";
  Table t({"t", "sp", "layer", "Korthikanti", "none peak", "full peak", "model states"});
  for (const TpEstimate& e : rows) {
    const bool configured =
        e.t == m.tensor_parallel && (e.sequence_parallel == (m.sequence_parallel && e.t > 1));
    const std::string sp = e.t == 1 ? "-" : e.sequence_parallel ? "yes" : "no";
    if (!e.error.empty()) {
      t.add({std::to_string(e.t), sp, "-", "-", "-", "-", "-"});
      continue;
    }
    t.add({std::to_string(e.t) + (configured ? " *" : ""), sp, format_bytes(e.layer_bytes),
           format_bytes(static_cast<uint64_t>(std::llround(e.korthikanti_layer_bytes))),
           format_bytes(e.none_peak_bytes), format_bytes(e.full_peak_bytes),
           format_bytes(e.model_states.total())});
  }
  t.print(out);
  for (const TpEstimate& e : rows) {
    if (e.error.empty()) continue;
    out << "  t " << e.t << (e.sequence_parallel ? " with" : " without")
        << " sequence parallelism: " << e.error << "\n";
  }
  out << "  * the config's. layer = one block's activations kept for backward, its input "
         "included\n  (porter's exact bytes, "
      << tensor::dtype_name(dtype)
      << "). Korthikanti = Korthikanti et al. 2022's sbh(34 + 5as/h), with t\n"
         "  sbh(10 + 24/t + 5as/(ht)), with sp sbh(34 + 5as/h)/t, in their 16-bit units\n"
         "  (docs/memory-model.md says why they differ). none/full peak = activation peak per\n"
         "  micro-batch. model states = params + grads + optimizer of tp rank 0's part.\n\n";
}

// The estimate of a loaded config: the table on `out`, or with o.json the report into
// `*json_out` when it is given (estimate_report), else printed on `out`.
int estimate_config(const EstimateOptions& o, config::Config cfg, int64_t world_size,
                    std::ostream& out, std::ostream& err, nlohmann::ordered_json* json_out);

int estimate(const EstimateOptions& o, std::ostream& out, std::ostream& err) {
  const int64_t world_size = o.world_size.value_or(implied_world_size(o.config_args, o.tensor_parallel));
  config::Config cfg =
      o.tensor_parallel
          ? load_config(o.config_args, o.strict, err, world_size, *o.tensor_parallel, "--tensor-parallel")
          : load_config(o.config_args, o.strict, err, world_size);
  return estimate_config(o, std::move(cfg), world_size, out, err, nullptr);
}

int estimate_config(const EstimateOptions& o, config::Config cfg, int64_t world_size,
                    std::ostream& out, std::ostream& err, nlohmann::ordered_json* json_out) {
  // Note [Attention choice]: every figure below is the chosen attention's.
  const config::AttentionKind asked_attention = cfg.porter.model.attention;
  {
    engine::ForecastOptions fo;
    fo.time_host_update = false;
    cfg = engine::resolve_model_choices(cfg, fo);
  }
  const std::vector<AttentionEstimate> attention_rows = attention_estimates(cfg);
  const engine::RunOptions run = engine::make_run_options(cfg);
  const tensor::DType dtype = run.compute_dtype;
  checkpoint::ChainCosts costs = run.analytic_costs();
  // ZeRO stage 3's gathered parameters and the gradient buckets
  engine::add_zero_costs(costs, run, static_cast<int>(cfg.data_parallel_size()));
  const config::ModelConfig& model = run.shape.model;
  const int64_t tp = model.tensor_parallel;
  const bool sp = run.sequence_parallel();
  const std::vector<TpEstimate> tp_rows =
      o.tensor_parallel ? std::vector<TpEstimate>{} : tp_estimates(cfg);

  // ZeRO partitions this tensor-parallel rank's flat buffers over the data-parallel ranks
  // (Note [Model-state bytes per rank] in zero/partition.h; Note [Estimate tensor
  // parallelism]).
  // Tensor-parallel rank 0's layout only; allocates nothing.
  const std::unique_ptr<models::Transformer> built = models::build_model(model);
  const models::Transformer& gpt = *built;
  const int dp = static_cast<int>(cfg.data_parallel_size());
  const zero::Partition part = zero::make_partition(gpt.layout().total_elems(), dp);
  const int64_t num_params = gpt.layout().num_params();
  const zero::StateDTypes state_dtypes = run.state_dtypes();
  std::vector<StageEstimate> stages;
  for (int stage = 0; stage <= 3; ++stage) {
    StageEstimate e;
    e.stage = stage;
    e.exact = zero::exact_bytes(part, stage, state_dtypes);
    e.paper = zero::paper_bytes(num_params, dp, stage, state_dtypes);
    e.formula = stage_formula(stage, state_dtypes, dp);
    stages.push_back(e);
  }
  // The policies below use the configured stage's model states.
  const int config_stage = run.zero_stage();
  // At stage 3 the params hold the persistent stages too, between steps (docs/zero.md,
  // "Stage 3"); the gathered ones come and go within a step, in each plan's total peak.
  zero::StateBytes ms = stages[static_cast<size_t>(config_stage)].exact;
  const size_t persistent = costs.params.enabled ? costs.params.persistent_bytes() : 0;
  ms.params += persistent;
  // Offload (docs/zero.md, "Optimizer offload" and "Parameter offload"; Note [Host-state
  // bytes per rank]): every setting the configured stage allows, device and host bytes per
  // rank; the configured one sets the model states of the plans below.
  const zero::OptimizerOptions& zo = run.optimizer;
  const bool offload_optimizer = zo.offload.enabled;
  const bool offload_param = zo.param_offload.enabled;
  auto offload_row = [&](bool opt, bool params) {
    OffloadEstimate e;
    e.optimizer = opt;
    e.params = params;
    // Note [Partial offload]: offload_optimizer.ratio of the shard's optimizer on the host.
    const double ratio = opt ? zo.offload.ratio : 1.0;
    e.device = zero::device_state_bytes(stages[static_cast<size_t>(config_stage)].exact, part,
                                        config_stage, state_dtypes, opt, ratio, params);
    e.device.params += persistent;
    e.host = zero::host_state_bytes(part, config_stage, state_dtypes, opt, params,
                                    zo.offload.pin_memory, zo.param_offload.pin_memory,
                                    ratio);
    return e;
  };
  std::vector<OffloadEstimate> offload_rows;
  for (bool opt : {false, true}) {
    for (bool params : {false, true}) {
      if ((opt && config_stage == 0) || (params && config_stage != 3)) continue;
      offload_rows.push_back(offload_row(opt, params));
    }
  }
  const OffloadEstimate configured = offload_row(offload_optimizer, offload_param);
  ms = configured.device;
  const zero::HostStateBytes host = configured.host;
  const size_t model_state = ms.total();
  const size_t batch = run.batch_bytes;
  // A cuda device without a limit: the device model's memory (Note [Device models]; an H100
  // SXM when porter.device.model is not set, as porter plan assumes).
  bool default_gpu = false;
  std::optional<size_t> capacity = run.capacity_bytes;
  if (!capacity && run.device.kind != memory::DeviceKind::kCpu) {
    capacity = engine::forecast_device_model(run, config::GpuModel::kH100Sxm, &default_gpu).memory_bytes;
  }
  const int64_t layers = run.shape.model.layers;

  std::optional<config::MemoryBudget> budget = run.plan.checkpointing.memory_budget;
  if (!o.budget.empty()) budget = parse_budget_flag(o.budget);

  std::vector<PolicyEstimate> rows;
  const checkpoint::PlanProgressFn progress = plan_progress_printer(err, "porter estimate");
  auto add = [&](config::CheckpointPolicy policy, std::string label,
                 const std::function<void(checkpoint::PlanOptions&)>& tweak) {
    PolicyEstimate e;
    e.policy = policy;
    e.label = std::move(label);
    checkpoint::PlanOptions po = run.plan;
    po.checkpointing.policy = policy;
    tweak(po);
    try {
      checkpoint::Plan plan = checkpoint::make_plan(po, costs, progress);
      e.description = plan.description;
      e.activation_peak_bytes = plan.prediction.peak_activation_bytes;
      e.gathered_peak_bytes = plan.prediction.params.peak_gathered_bytes;
      e.total_peak_bytes = run.predicted_peak_bytes(model_state, plan.prediction);
      e.stash_pinned_bytes = plan.offload.pinned_bytes;
      e.recompute_flop_fraction = engine::recompute_flop_fraction(plan.prediction, costs);
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
    const auto& ck = run.plan.checkpointing;
    std::string label;
    std::optional<int64_t> every = ck.every_n_layers;
    const std::optional<int64_t> segments = ck.segments;
    if (!every && !segments) every = 1;
    label = every ? "uniform (every " + std::to_string(*every) + " layer" + (*every == 1 ? ")" : "s)")
                  : "uniform (" + std::to_string(*segments) + " checkpoints)";
    add(P::kUniform, label, [&](checkpoint::PlanOptions& po) {
      po.checkpointing.every_n_layers = every;
      po.checkpointing.segments = every ? std::nullopt : segments;
    });
  }
  {
    const int64_t n = run.plan.checkpointing.block_layers.value_or((layers + 1) / 2);
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
  const auto mine = std::find_if(rows.begin(), rows.end(), [&](const PolicyEstimate& e) {
    return e.policy == run.plan.checkpointing.policy && e.error.empty();
  });

  // Note [Host fit]: the host's bytes per rank and per node, against the node's memory.
  const comm::DistEnv launched = comm::dist_env_from_process();
  int ranks_per_node = 0;
  std::string ranks_source;
  if (o.ranks_per_node) {
    ranks_per_node = static_cast<int>(*o.ranks_per_node);
    ranks_source = "--ranks-per-node";
  } else if (launched.source != "none") {
    ranks_per_node = std::max(1, launched.local_world_size);
    ranks_source = "the launcher's local world size";
  } else {
    ranks_per_node = static_cast<int>(std::min<int64_t>(world_size, 8));
    ranks_source = "assumed: min(world size, 8); --ranks-per-node sets it";
  }
  size_t machine = engine::machine_memory_bytes();
  std::string machine_source = "this machine's";
  if (!o.host_memory.empty()) {
    const std::optional<uint64_t> b = parse_bytes(o.host_memory);
    if (!b || *b == 0) {
      throw InvalidArgument("--host-memory: expected a size such as \"512GiB\", got \"" +
                            o.host_memory + "\"");
    }
    machine = static_cast<size_t>(*b);
    machine_source = "--host-memory";
  }
  const engine::HostFit host_fit = engine::host_fit(
      run, host, mine != rows.end() ? mine->stash_pinned_bytes : 0,
      mine != rows.end() ? mine->total_peak_bytes : 0, ranks_per_node, machine);

  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.config_name.empty() ? o.config_args.display() : o.config_name;
    j["model"] = {{"layers", layers}, {"hidden", model.hidden},
                  {"heads", model.heads}, {"seq_len", model.seq_len},
                  {"vocab", model.vocab}, {"compute_dtype", tensor::dtype_name(dtype)},
                  {"micro_batch", run.shape.micro_batch},
                  {"gradient_accumulation_steps", run.gradient_accumulation_steps},
                  {"tensor_parallel", tp}, {"sequence_parallel", sp}};
    j["world_size"] = world_size;
    j["zero_stage"] = config_stage;
    j["model_state_bytes"] = bytes_json(ms);
    j["host_bytes"] = host_json(host);
    j["offload"] = nlohmann::ordered_json::array();
    for (const OffloadEstimate& e : offload_rows) {
      j["offload"].push_back({{"offload_optimizer", e.optimizer}, {"offload_param", e.params},
                              {"ratio", e.optimizer ? zo.offload.ratio : 0.0},
                              {"device", bytes_json(e.device)}, {"host", host_json(e.host)}});
    }
    nlohmann::ordered_json zj;
    zj["data_parallel_size"] = dp;
    zj["num_params"] = num_params;
    zj["flat_elems"] = part.total_elems;
    zj["padded_elems"] = part.padded_elems;
    zj["shard_elems"] = part.shard_elems;
    zj["param_dtype"] = tensor::dtype_name(dtype);
    zj["p"] = state_dtypes.param_bytes();
    zj["g"] = state_dtypes.grad_bytes();
    zj["k"] = state_dtypes.optimizer_bytes();
    zj["stages"] = nlohmann::ordered_json::array();
    for (const StageEstimate& e : stages) {
      zj["stages"].push_back({{"stage", e.stage}, {"exact", bytes_json(e.exact)},
                              {"paper", bytes_json(e.paper)}, {"formula", e.formula},
                              {"padding_bytes", e.padding_bytes()}});
    }
    j["zero"] = std::move(zj);
    nlohmann::ordered_json tj;
    tj["t"] = tp;
    tj["sequence_parallel"] = sp;
    tj["source"] = o.tensor_parallel ? "--tensor-parallel" : "config";
    tj["table"] = nullptr;
    if (!o.tensor_parallel) {
      tj["table"] = nlohmann::ordered_json::array();
      for (const TpEstimate& e : tp_rows) {
        nlohmann::ordered_json r;
        r["t"] = e.t;
        r["sequence_parallel"] = e.sequence_parallel;
        if (!e.error.empty()) {
          r["error"] = e.error;
        } else {
          r["layer_bytes"] = e.layer_bytes;
          r["korthikanti_layer_bytes"] = e.korthikanti_layer_bytes;
          r["none_activation_peak_bytes"] = e.none_peak_bytes;
          r["full_activation_peak_bytes"] = e.full_peak_bytes;
          r["model_state_bytes"] = bytes_json(e.model_states);
        }
        tj["table"].push_back(std::move(r));
      }
    }
    j["tensor_parallel"] = std::move(tj);
    nlohmann::ordered_json aj;
    aj["asked"] = config::to_string(asked_attention);
    aj["chosen"] = config::to_string(model.attention);
    aj["table"] = nlohmann::ordered_json::array();
    for (const AttentionEstimate& e : attention_rows) {
      nlohmann::ordered_json r;
      r["attention"] = config::to_string(e.kind);
      if (!e.error.empty()) {
        r["error"] = e.error;
      } else {
        r["layer_bytes"] = e.layer_bytes;
        r["korthikanti_layer_bytes"] = e.korthikanti_layer_bytes;
        r["none_activation_peak_bytes"] = e.none_peak_bytes;
        r["full_activation_peak_bytes"] = e.full_peak_bytes;
      }
      aj["table"].push_back(std::move(r));
    }
    j["attention"] = std::move(aj);
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
        p["gathered_params_peak_bytes"] = e.gathered_peak_bytes;
        p["total_peak_bytes"] = e.total_peak_bytes;
        p["recompute_flop_fraction"] = e.recompute_flop_fraction;
        std::optional<bool> f = fits(e);
        p["fits"] = f ? nlohmann::ordered_json(*f) : nlohmann::ordered_json();
      }
      j["policies"].push_back(std::move(p));
    }
    j["host"] = {{"per_rank_bytes", host_fit.per_rank_bytes()},
                 {"pinned_per_rank_bytes", host_fit.pinned_per_rank_bytes()},
                 {"ranks_per_node", ranks_per_node},
                 {"ranks_per_node_source", ranks_source},
                 {"per_node_bytes", host_fit.per_node_bytes()},
                 {"machine_bytes", machine},
                 {"pinned_limit_bytes", host_fit.in.pinned_limit
                                            ? nlohmann::ordered_json(*host_fit.in.pinned_limit)
                                            : nlohmann::ordered_json()},
                 {"fits", host_fit.fits()}};
    // The verdict: the configured policy's total against the device.
    j["verdict"] = nullptr;
    for (const PolicyEstimate& e : rows) {
      if (e.policy != run.plan.checkpointing.policy || !e.error.empty() || !capacity) continue;
      j["verdict"] = {{"policy", config::to_string(e.policy)},
                      {"total_peak_bytes", e.total_peak_bytes},
                      {"fits", e.total_peak_bytes <= *capacity},
                      {"margin_bytes", static_cast<int64_t>(*capacity) -
                                           static_cast<int64_t>(e.total_peak_bytes)}};
      break;
    }
    if (json_out) {
      *json_out = std::move(j);
    } else {
      out << j.dump(2) << "\n";
    }
    return kExitOk;
  }

  out << "porter estimate: " << o.config_args.display() << "\n";
  out << "  model: " << describe_model(model) << ", " << tensor::dtype_name(dtype)
      << "\n";
  if (tp > 1) {
    out << "  tensor parallel " << tp << (sp ? " with sequence parallelism" : "")
        << (o.tensor_parallel ? " (--tensor-parallel)" : "")
        << ": every figure below is one tensor-parallel rank's\n";
  }
  out << "  micro-batch " << run.shape.micro_batch << " x "
      << run.shape.seq << " tokens, " << run.gradient_accumulation_steps
      << " per step; device memory "
      << (capacity ? format_bytes(*capacity) : std::string("(the GPU's, not known without it)"))
      << (default_gpu ? " (an H100 SXM's: porter.device.model is not set)" : "") << "\n\n";
  print_zero(out, stages, part, num_params, state_dtypes, dtype, world_size, dp, tp);
  print_attention(out, attention_rows, asked_attention, model.attention);
  if (!tp_rows.empty()) print_tp(out, tp_rows, cfg, dtype);
  out << "  model states per rank (ZeRO stage " << config_stage << ", every policy): params "
      << format_bytes(ms.params) << ", grads " << format_bytes(ms.grads) << ", optimizer "
      << format_bytes(ms.optimizer) << " = " << format_bytes(model_state) << "; batch "
      << format_bytes(batch) << "\n";
  if (offload_rows.size() > 1) {
    out << "  offload (model states per rank; host: optimizer = master + moments, grads = the "
           "gradient shard (streamed at stages 2 and 3) and its staging, params = working copy / "
           "shard):\n";
    for (const OffloadEstimate& e : offload_rows) {
      const bool mine = e.optimizer == offload_optimizer && e.params == offload_param;
      std::string name = e.optimizer && e.params ? "optimizer + params"
                         : e.optimizer           ? "optimizer"
                         : e.params              ? "params"
                                                 : "none";
      if (e.optimizer && zo.offload.ratio < 1.0) {
        char r[48];
        std::snprintf(r, sizeof r, " (ratio %g)", zo.offload.ratio);
        name += r;
      }
      out << "    " << (mine ? "* " : "  ") << std::left << std::setw(30) << name << std::right
          << " device " << std::setw(10) << format_bytes(e.device.total()) << "  host "
          << std::setw(10) << format_bytes(e.host.total());
      if (e.host.total() > 0) {
        out << " (optimizer " << format_bytes(e.host.optimizer) << ", grads "
            << format_bytes(e.host.grads) << ", params " << format_bytes(e.host.params) << ")";
      }
      out << "\n";
    }
    out << "    (* the config's: zero_optimization.offload_optimizer / offload_param; host bytes "
           "are pinned as their pin_memory says)\n";
  }
  if (costs.params.enabled) {
    out << "  stage 3: params are the shard plus " << format_bytes(persistent)
        << " of persistent stages (stage3_param_persistence_threshold); each policy's total "
           "peak\n  adds the stages gathered at its peak (stage3_prefetch_bucket_size, "
           "max_live_parameters, max_reuse_distance):";
    for (const PolicyEstimate& e : rows) {
      if (e.error.empty()) out << " " << config::to_string(e.policy) << " " << format_bytes(e.gathered_peak_bytes) << ";";
    }
    out << "\n";
  }
  out << "\n";
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
  // The verdict: the configured policy's row against the device (Note [Forecast]).
  if (capacity && mine != rows.end()) {
    const int64_t margin =
        static_cast<int64_t>(*capacity) - static_cast<int64_t>(mine->total_peak_bytes);
    out << "\n  verdict (" << mine->label << ", the config's policy): "
        << (margin >= 0 ? "fits: " + format_bytes(mine->total_peak_bytes) + " of " +
                              format_bytes(*capacity) + " per rank (" +
                              format_bytes(static_cast<uint64_t>(margin)) + " free)"
                        : "does not fit: needs " + format_bytes(mine->total_peak_bytes) +
                              " per rank, " + format_bytes(static_cast<uint64_t>(-margin)) +
                              " more than the " + format_bytes(*capacity) + " device")
        << "\n";
    const bool any = std::any_of(rows.begin(), rows.end(), [&](const PolicyEstimate& e) {
      return fits(e).value_or(false);
    });
    if (margin < 0) {
      out << "  " << (any ? "another policy above fits; " : "no policy fits at this micro-batch, "
                                                          "ZeRO stage and offload; ")
          << "porter plan --fit " << o.config_args.command_args() << " --world-size "
          << world_size << " searches the micro-batch, policy, offload, ZeRO stage and tensor "
                           "parallelism for the fastest configurations that fit\n";
    }
  }
  out << "  host per rank " << format_bytes(host_fit.per_rank_bytes()) << ": offloaded model states "
      << format_bytes(host.total());
  if (host_fit.in.stash_pinned_bytes > 0) {
    out << ", offloaded activations " << format_bytes(host_fit.in.stash_pinned_bytes);
  }
  if (host_fit.in.simulated_device_bytes > 0) {
    out << ", the simulated device's peak " << format_bytes(host_fit.in.simulated_device_bytes);
  }
  out << "; pinned " << format_bytes(host_fit.pinned_per_rank_bytes());
  if (host_fit.in.pinned_limit) out << " of " << format_bytes(*host_fit.in.pinned_limit);
  out << "\n  host per node " << format_bytes(host_fit.per_node_bytes()) << ": " << ranks_per_node
      << " rank" << (ranks_per_node == 1 ? "" : "s") << " per node (" << ranks_source
      << "), against " << machine_source << " memory, " << format_bytes(machine) << "\n  "
      << host_fit.verdict() << "\n";
  out << "\n  total peak = model states + batch + the plan's predicted peak of activations, "
         "checkpoints,\n  workspace, stage 3's gathered parameters and the gradient buckets (requested bytes; the\n"
         "  allocator's rounding adds a little).\n"
         "  recompute = extra forward FLOPs over one step's forward + backward (3 x forward).\n";
  return kExitOk;
}

}  // namespace

nlohmann::ordered_json estimate_report(const config::Config& cfg,
                                       const EstimateReportOptions& options, std::ostream& err) {
  EstimateOptions o;
  o.json = true;
  o.config_name = options.config_name;
  o.budget = options.budget;
  o.ranks_per_node = options.ranks_per_node;
  o.host_memory = options.host_memory;
  std::ostream unused(nullptr);  // the table's stream; a JSON report prints nothing there
  nlohmann::ordered_json j;
  estimate_config(o, cfg, cfg.world_size, unused, err, &j);
  return j;
}

void add_estimate_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<EstimateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "Per-rank model-state memory for ZeRO stages 0..3 and activation memory under every "
      "checkpoint policy, without allocating");
  add_config_options(cmd, o->config_args, "The JSON config");
  cmd->add_option("--world-size", o->world_size,
                  "Ranks to estimate for (default: the world size the config's batch sizes "
                  "imply, else 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--tensor-parallel", o->tensor_parallel,
                  "Estimate one rank of a tensor-parallel group of T ranks (overrides "
                  "porter.model.tensor_parallel; must divide heads)");
  cmd->add_option("--budget", o->budget,
                  "Also plan 'optimal' under this activation budget: bytes (\"6GiB\") or a "
                  "fraction of the none policy's peak");
  cmd->add_option("--ranks-per-node", o->ranks_per_node,
                  "Ranks on one node, for the host's bytes per node (default: the launcher's "
                  "local world size, else min(world size, 8))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--host-memory", o->host_memory,
                  "The node's memory to check the host's bytes against (\"512GiB\"; default: "
                  "this machine's)");
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config.");
  cmd->callback([o, &context] { context.exit_code = estimate(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
