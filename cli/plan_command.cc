// `porter plan --config F [--world-size N] [--tensor-parallel T] [--budget B] [--profile]
// [--json] [--memory-page FILE]`: one rank's plan of a run, from the config alone: per stage
// what is kept, held and recomputed and where held inputs live (device or host), the predicted
// peak by category with the model states against the device's capacity and a verdict, and the
// predicted step time (compute, recompute, exposed communication and offload, MFU). Bytes come
// from the analytic model and times from a device model (Note [Forecast] in engine/forecast.h):
// nothing of the model is allocated and no GPU is needed, at any world size. --profile plans
// from times measured by Engines on the cpu device instead, one thread rank per rank of the
// configured world, each holding its shard. Every figure is one rank's, of a tensor-parallel
// group at porter.model.tensor_parallel > 1.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "models/analytic.h"
#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/memory_page.h"
#include "comm/communicator.h"
#include "engine/run_options.h"
#include "engine/engine.h"
#include "engine/forecast.h"
#include "engine/stage3.h"
#include "engine/model.h"
#include "models/factory.h"
#include "zero/partition.h"

namespace porter::cli {
namespace {

struct PlanCommandOptions {
  ConfigArgs config_args;  // --config files and --set overrides
  std::optional<int64_t> world_size;
  std::optional<int64_t> tensor_parallel;  // overrides porter.model.tensor_parallel
  bool profile = false;
  std::string budget;
  std::string memory_page;
  bool json = false;
  bool strict = false;
};

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err);

// The plan page (cli/memory_page.h) of a forecast (Note [Forecast]): model states are this
// rank's at the configured ZeRO stage, world size and offload, of tensor-parallel rank 0's part
// of the model, which every rank's equals in size (Note [Estimate tensor parallelism] in
// cli/estimate_command.cc).
void write_plan_page(const PlanCommandOptions& o, const engine::Forecast& f) {
  // The layout and names only; allocates nothing.
  const std::unique_ptr<models::Transformer> model = models::build_model(f.config.porter.model);
  const models::Transformer& gpt = *model;
  PlanPageInput in;
  in.config_file = o.config_args.display();
  in.plan = &f.plan;
  in.costs = &f.costs;
  in.stage_name = [&gpt](int s) { return gpt.stage_name(s); };
  in.model_state_bytes = f.model_states.total();
  in.batch_bytes = f.batch_bytes;
  in.capacity_bytes = f.capacity_bytes;
  in.predicted_peak_bytes = f.total_peak_bytes;
  write_memory_page(o.memory_page, plan_page_data(in), "--memory-page");
}

// Bytes each stage's held input sends to the host per micro-batch (0: none).
std::vector<size_t> offloaded_by_stage(const checkpoint::Plan& plan) {
  std::vector<size_t> v(plan.stages.size(), 0);
  for (const checkpoint::StashEntry& e : plan.offload.entries) {
    if (!e.on_host) continue;  // a partitioned slice on the device is not offloaded
    if (e.stage >= 0 && static_cast<size_t>(e.stage) < v.size()) {
      v[static_cast<size_t>(e.stage)] += plan.offload.host_bytes(e);
    }
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
          {"hidden_fraction", timed(p.hidden_fraction())},
          {"partition",
           {{"ways", l.ways},
            {"partitioned_checkpoints",
             std::count_if(l.entries.begin(), l.entries.end(),
                           [](const checkpoint::StashEntry& e) { return e.partitioned; })},
            {"peak_slice_bytes", p.peak_slice_bytes},
            {"gathers", p.gathers},
            {"gathered_bytes", p.gathered_bytes},
            {"timed", p.gather_timed},
            {"gather_busy_s", p.gather_timed ? ordered_json(p.gather_busy_s) : ordered_json()},
            {"gather_exposed_s",
             p.gather_timed ? ordered_json(p.gather_exposed_s) : ordered_json()}}}};
}

// The offload lines of the text output (nothing without host holds).
void print_offload(const checkpoint::Plan& plan, double link_bytes_per_s, int64_t micro_batches,
                   std::ostream& out) {
  const checkpoint::OffloadLayout& l = plan.offload;
  if (l.empty()) return;
  const checkpoint::OffloadPrediction& p = plan.prediction.offload;
  const auto partitioned = std::count_if(l.entries.begin(), l.entries.end(),
                                         [](const checkpoint::StashEntry& e) { return e.partitioned; });
  if (partitioned > 0) {
    out << "  partitioned: " << partitioned << " checkpoint" << (partitioned == 1 ? "" : "s")
        << " kept as 1/" << l.ways << " slices (" << format_bytes(p.peak_slice_bytes)
        << " of slices at most); " << p.gathers << " all-gather" << (p.gathers == 1 ? "" : "s")
        << " per micro-batch receive "
        << format_bytes(p.gathered_bytes) << "; ";
    if (p.gather_timed) {
      out << "predicted " << format_seconds(p.gather_busy_s * static_cast<double>(micro_batches))
          << " on the tp link per step, "
          << format_seconds(p.gather_exposed_s * static_cast<double>(micro_batches))
          << " exposed\n";
    } else {
      out << "gathers untimed (" << (plan.sim.tp_bytes_per_s > 0
                                          ? "the analytic model has no compute times"
                                          : "no tp link bandwidth: set porter.comm.sim_tp_gbps")
          << ")\n";
    }
  }
  const auto host = std::count_if(l.entries.begin(), l.entries.end(),
                                  [](const checkpoint::StashEntry& e) { return e.on_host; });
  if (host == 0) return;
  out << "  offload: " << host << " checkpoint" << (host == 1 ? "" : "s")
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

// Note [Plan profiling]
// `porter plan --profile` plans from measured times, as training does (Note [Engine costs]).
// The Engines are built at the configured world size, never as one rank holding the whole
// model's states: porter plan runs every rank of the world as a thread of this process, each
// with its own device and its data-parallel and tensor-parallel Gloo groups, so each holds
// its ZeRO shard; the ranks agree on the slowest rank's times (Note [Agreed costs]) and rank 0's
// costs and plan are reported. On cuda that would put several NCCL ranks on one GPU, which
// NCCL refuses, so there porter plan profiles one-rank worlds only and says so otherwise.
struct ProfiledPlan {
  std::vector<std::unique_ptr<memory::Device>> devices;  // outlive the engines
  std::vector<std::unique_ptr<engine::Engine>> engines;  // rank r's
};

ProfiledPlan profile_plan(const config::Config& cfg, const engine::RunOptions& run) {
  const int ws = static_cast<int>(cfg.world_size);
  const int t = static_cast<int>(cfg.porter.model.tensor_parallel);
  ProfiledPlan p;
  p.devices.resize(static_cast<size_t>(ws));
  p.engines.resize(static_cast<size_t>(ws));
  if (ws == 1) {
    p.devices[0] = memory::make_device(run.device);
    p.engines[0] = std::make_unique<engine::Engine>(
        *p.devices[0], std::make_unique<engine::TransformerModel>(cfg.porter.model), cfg);
    return p;
  }
  if (run.device.kind != memory::DeviceKind::kCpu) {
    throw InvalidArgument(
        "porter plan --profile: a world of " + std::to_string(ws) + " ranks is profiled as " +
        std::to_string(ws) + " thread ranks of this process, on the cpu device only (NCCL refuses "
        "two ranks on one GPU): set porter.device.type to \"cpu\" to profile there, or plan "
        "without --profile (the analytic model timed on porter.device.model)");
  }
  std::vector<std::exception_ptr> errors =
      comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
        const size_t r = static_cast<size_t>(rank);
        p.devices[r] = memory::make_device(run.device);
        comm::CommOptions co;
        co.timeout = comm::Seconds(cfg.porter.comm.timeout_s);
        std::shared_ptr<comm::Communicator> world =
            comm::make_communicator(*p.devices[r], std::move(store), rank, ws, co);
        try {
          const comm::ProcessGroups groups = comm::make_process_groups(world, t);
          p.engines[r] = std::make_unique<engine::Engine>(
              *p.devices[r],
              std::make_unique<engine::TransformerModel>(cfg.porter.model, groups.tp_rank), cfg,
              groups);
        } catch (const std::exception& e) {
          world->abort("rank " + std::to_string(rank) + " of porter plan's profiling: " + e.what());
          throw;
        }
      });
  // A failing rank aborts the group, so its peers fail with PeerError: report the cause.
  std::exception_ptr first;
  for (std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const PeerError&) {
      if (!first) first = e;
    } catch (...) {
      throw;
    }
  }
  if (first) std::rethrow_exception(first);
  return p;
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

// The memory lines: each category's predicted peak, the total against the capacity, and the
// verdict (Note [Forecast]).
nlohmann::ordered_json memory_json(const engine::Forecast& f) {
  using J = nlohmann::ordered_json;
  const checkpoint::Prediction& p = f.plan.prediction;
  return {{"params_bytes", f.model_states.params},
          {"grads_bytes", f.model_states.grads},
          {"optimizer_bytes", f.model_states.optimizer},
          {"model_state_bytes", f.model_states.total()},
          {"host_state_bytes", f.host_states.total()},
          {"batch_bytes", f.batch_bytes},
          {"activation_peak_bytes", p.peak_activation_bytes},
          {"staging_peak_bytes", p.offload.peak_staging_bytes},
          {"gathered_params_peak_bytes", p.params.peak_gathered_bytes},
          {"comm_peak_bytes", p.peak_comm_bytes},
          {"step_peak_bytes", p.peak_total_bytes},
          {"total_peak_bytes", f.total_peak_bytes},
          {"capacity_bytes", f.capacity_bytes ? J(*f.capacity_bytes) : J()},
          {"fits", f.capacity_bytes ? J(f.fits()) : J()},
          {"margin_bytes", f.capacity_bytes ? J(f.margin_bytes()) : J()},
          {"verdict", f.verdict()}};
}

void print_memory(const engine::Forecast& f, std::ostream& out) {
  const checkpoint::Prediction& p = f.plan.prediction;
  out << "  memory per rank (predicted peaks):\n";
  Table t({"category", "peak", "note"});
  t.add({"params", format_bytes(f.model_states.params),
         f.run.zero_stage() == 3 ? "the shard and persistent stages; gathered stages below" : "model state"});
  t.add({"grads", format_bytes(f.model_states.grads), "model state"});
  t.add({"optimizer", format_bytes(f.model_states.optimizer),
         f.host_states.total() > 0 ? "on the device; " + format_bytes(f.host_states.total()) + " on the host"
                                   : "model state"});
  t.add({"batch", format_bytes(f.batch_bytes), "token ids and targets"});
  t.add({"activations + checkpoints", format_bytes(p.peak_activation_bytes),
         "the plan's footprint, staging included"});
  if (p.offload.peak_staging_bytes > 0)
    t.add({"staging", format_bytes(p.offload.peak_staging_bytes), "offloaded checkpoints on their way back"});
  if (p.params.peak_gathered_bytes > 0)
    t.add({"gathered params", format_bytes(p.params.peak_gathered_bytes), "ZeRO stage 3's gathered stages"});
  if (p.peak_comm_bytes > 0)
    t.add({"comm", format_bytes(p.peak_comm_bytes), "gradient buckets (reduce_bucket_size)"});
  t.add({"total peak", format_bytes(f.total_peak_bytes),
         "all categories at their joint peak, workspace included"});
  t.print(out);
  out << "  verdict: " << f.verdict() << "\n";
}

void print_step_time(const engine::Forecast& f, std::ostream& out) {
  const engine::StepTimePrediction& s = f.time;
  char mfu[32];
  std::snprintf(mfu, sizeof mfu, "%.1f%%", 100.0 * s.mfu);
  out << "  predicted step time on " << f.device.name << " (a roofline floor, docs/planning.md): "
      << format_seconds(s.total_s) << " = compute " << format_seconds(s.compute_s)
      << " + recompute " << format_seconds(s.recompute_s) << " + exposed comm "
      << format_seconds(s.exposed_comm_s()) << " + exposed offload "
      << format_seconds(s.exposed_offload_s()) << "; " << format_count(s.tokens_per_s)
      << " tokens/s over " << f.dp_size << " data-parallel rank" << (f.dp_size == 1 ? "" : "s")
      << ", MFU " << mfu << "\n";
}

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  // Note [Implied world size] in cli/common.h: at tensor_parallel t the world is t ranks at
  // least.
  const int64_t world_size =
      o.world_size.value_or(implied_world_size(o.config_args, o.tensor_parallel));
  config::Config cfg =
      o.tensor_parallel ? load_config(o.config_args, o.strict, err, world_size, *o.tensor_parallel,
                                      "--tensor-parallel")
                        : load_config(o.config_args, o.strict, err, world_size);
  if (!o.budget.empty()) {
    // A budget only means something to the optimal planner.
    cfg.porter.checkpointing.policy = config::CheckpointPolicy::kOptimal;
    cfg.porter.checkpointing.memory_budget = parse_budget_flag(o.budget);
  }
  const int64_t micro_batches = cfg.gradient_accumulation_steps;

  // Note [Forecast]: bytes from the analytic model, times from the device model.
  engine::Forecast f = engine::forecast(cfg);
  const engine::RunOptions& run = f.run;
  const checkpoint::ChainCosts analytic = run.analytic_costs();
  checkpoint::ChainCosts costs = f.costs;
  checkpoint::Plan plan = f.plan;
  std::string where_from = "the analytic model (nothing allocated), timed on " + f.device.name +
                           " (" + f.device.source + ")";
  ProfiledPlan profiled;
  engine::Engine* eng = nullptr;  // rank 0's, owned by `profiled`
  if (o.profile) {  // Note [Plan profiling]
    profiled = profile_plan(cfg, run);
    eng = profiled.engines[0].get();
    costs = eng->costs();
    plan = eng->plan();
    where_from = "profiled on " + profiled.devices[0]->description();
    if (profiled.engines.size() > 1) {
      where_from += " (rank 0 of " + std::to_string(profiled.engines.size()) + " thread ranks)";
    }
    f.costs = costs;
    f.plan = plan;
    f.total_peak_bytes = run.predicted_peak_bytes(f.model_states.total(), plan.prediction);
    engine::StepTimeInputs in;
    in.dp_size = f.dp_size;
    in.param_elems = f.param_elems;
    f.time = engine::predict_step_time(run, f.device, plan, costs, in);
  }
  const checkpoint::Prediction none =
      checkpoint::simulate(checkpoint::schedule_none(costs), costs);
  // FLOPs come from the analytic model whatever the costs' source (profiles measure times,
  // not FLOPs): the plan's schedule replayed on analytic costs counts its extra forwards.
  const checkpoint::Prediction flops = checkpoint::simulate(plan.schedule, analytic, plan.sim);
  const double flop_fraction = engine::recompute_flop_fraction(flops, analytic);
  // Recompute time over the rest of the micro-batch's compute.
  const double base_s = plan.prediction.compute_s - plan.prediction.recompute_s;
  const double time_fraction = base_s > 0.0 ? plan.prediction.recompute_s / base_s : 0.0;
  const std::string policy(config::to_string(plan.policy));
  const double link_bytes_per_s = eng ? eng->link_bytes_per_s() : plan.sim.link_bytes_per_s;
  const bool timed = plan.prediction.offload.timed && !plan.offload.empty();
  const std::vector<size_t> offloaded = offloaded_by_stage(plan);
  const int64_t tp = cfg.porter.model.tensor_parallel;
  const bool sp = cfg.porter.model.sequence_parallel && tp > 1;

  if (!o.memory_page.empty()) write_plan_page(o, f);

  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.config_args.display();
    j["world_size"] = cfg.world_size;
    j["data_parallel_size"] = f.dp_size;
    j["zero_stage"] = run.zero_stage();
    j["policy"] = policy;
    j["description"] = plan.description;
    j["budget_bytes"] = plan.budget_bytes ? nlohmann::ordered_json(*plan.budget_bytes)
                                          : nlohmann::ordered_json();
    j["costs"] = costs.source;
    j["device"] = f.device.to_json();
    j["device"]["default"] = f.default_device;
    j["tensor_parallel"] = tp;
    j["sequence_parallel"] = sp;
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
    j["predicted_total_peak_bytes"] = f.total_peak_bytes;  // model states included
    j["memory"] = memory_json(f);
    j["none_activation_peak_bytes"] = none.peak_activation_bytes;
    j["micro_batches_per_step"] = micro_batches;
    j["predicted_recompute_s"] =
        costs.has_times() ? nlohmann::ordered_json(plan.prediction.recompute_s * micro_batches)
                          : nlohmann::ordered_json();
    j["recompute_time_fraction"] =
        costs.has_times() ? nlohmann::ordered_json(time_fraction) : nlohmann::ordered_json();
    j["recompute_flops"] = flops.recompute_flops * static_cast<double>(micro_batches);
    j["recompute_flop_fraction"] = flop_fraction;
    j["step_time"] = f.time.to_json();
    j["offload"] = offload_json(plan, link_bytes_per_s);
    const checkpoint::ParamPrediction& pp = plan.prediction.params;
    j["stage3"] = costs.params.enabled
                      ? nlohmann::ordered_json{{"peak_gathered_bytes", pp.peak_gathered_bytes},
                                               {"peak_live_elems", pp.peak_live_elems},
                                               {"gathers_per_micro_batch", pp.gathers},
                                               {"gathered_bytes_per_micro_batch", pp.gathered_bytes},
                                               {"persistent_bytes", pp.persistent_bytes},
                                               {"predicted_budget_peak_bytes",
                                                plan.prediction.peak_budget_bytes}}
                      : nlohmann::ordered_json();
    j["schedule"] = plan.schedule.to_string();
    out << j.dump(2) << "\n";
    return kExitOk;
  }

  out << "porter plan: " << o.config_args.display() << "\n";
  out << "  model: " << describe_model(cfg.porter.model) << ", "
      << tensor::dtype_name(run.compute_dtype) << "; micro-batch " << run.shape.micro_batch
      << " x " << run.shape.seq << " tokens, " << micro_batches << " per step\n";
  out << "  world: " << cfg.world_size << " rank" << (cfg.world_size == 1 ? "" : "s") << " = "
      << f.dp_size << " data-parallel x " << tp << " tensor-parallel; ZeRO stage "
      << run.zero_stage() << "\n";
  out << "  device: " << f.device.name << " (" << f.device.source << ")";
  if (f.default_device) {
    out << "; porter.device.model is not set, so a cuda run is planned for " << f.device.name;
  }
  out << "\n  " << plan.description << "\n";
  if (plan.budget_bytes) out << "  budget " << format_bytes(*plan.budget_bytes) << "\n";
  out << "  costs: " << where_from << "\n";
  if (costs.params.enabled) {
    const checkpoint::ParamPrediction& pp = plan.prediction.params;
    out << "  ZeRO stage 3: " << pp.gathers << " parameter gathers per micro-batch ("
        << format_bytes(pp.gathered_bytes) << "), at most "
        << format_count(static_cast<double>(pp.peak_live_elems)) << " elements ("
        << format_bytes(pp.peak_gathered_bytes) << ") gathered at once; persistent "
        << format_bytes(pp.persistent_bytes) << "; activations + gathered parameters peak at "
        << format_bytes(plan.prediction.peak_budget_bytes) << "\n";
  }
  if (tp > 1) {
    out << "  tensor parallel " << tp << (sp ? " with sequence parallelism" : "")
        << ": every figure is one tensor-parallel rank's\n";
  }
  out << "\n";
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
    out << pct << " of the step's FLOPs (forward + backward = 3 x forward)\n";
  }
  print_offload(plan, link_bytes_per_s, micro_batches, out);
  out << "  schedule: " << plan.schedule.to_string() << "\n\n";
  print_memory(f, out);
  print_step_time(f, out);
  if (!o.memory_page.empty()) out << "  memory page: " << o.memory_page << "\n";
  return kExitOk;
}

}  // namespace

void add_plan_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<PlanCommandOptions>();
  CLI::App* cmd = app.add_subcommand("plan", "Print the checkpoint plan of a config");
  add_config_options(cmd, o->config_args, "The JSON config");
  cmd->add_option("--world-size", o->world_size,
                  "Ranks to plan for (default: the world size the config's batch sizes imply, "
                  "else 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--tensor-parallel", o->tensor_parallel,
                  "Plan one rank of a tensor-parallel group of T ranks (overrides "
                  "porter.model.tensor_parallel; must divide heads)");
  cmd->add_flag("--profile", o->profile,
                "Plan from times measured by Engines on the configured device, one thread rank "
                "per rank of the world (cpu device), instead of the device model's");
  cmd->add_option("--budget", o->budget,
                  "Plan 'optimal' under this activation budget: bytes (\"6GiB\") or a fraction "
                  "of the none policy's peak (overrides the config's policy)");
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->add_option("--memory-page", o->memory_page,
                  "Write the predicted memory of one micro-batch as one HTML page");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success (whether or not the plan fits: see the verdict), 1 usage "
              "error, 2 invalid config or budget, 3 out of memory while profiling.");
  cmd->callback([o, &context] { context.exit_code = plan(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
