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
#include <thread>
#include <optional>
#include <sstream>
#include <chrono>
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
#include "cli/reports.h"
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
  bool fit = false;
  int top = 8;
  std::string config_name;  // the report's "config" in place of the files' names (plan_report)
};

int plan_impl(const PlanCommandOptions& o, std::ostream& out, std::ostream& err);
// The plan of a loaded config: the text on `out`, or with o.json the report into `*json_out`
// when it is given (plan_report), else printed on `out`.
int plan_config(const PlanCommandOptions& o, config::Config cfg, std::ostream& out,
                std::ostream& err, nlohmann::ordered_json* json_out);

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
template <typename F>
int naming_budget_flag(const PlanCommandOptions& o, F&& run) {
  try {
    return run();
  } catch (const InvalidArgument& e) {
    if (o.budget.empty() || std::string(e.what()).find("memory_budget") == std::string::npos) throw;
    throw InvalidArgument("--budget " + o.budget + ": " + e.what());
  }
}

int plan(const PlanCommandOptions& o, std::ostream& out, std::ostream& err) {
  return naming_budget_flag(o, [&] { return plan_impl(o, out, err); });
}

// A budget only means something to the optimal planner.
void apply_budget_flag(const PlanCommandOptions& o, config::Config& cfg) {
  if (o.budget.empty()) return;
  cfg.porter.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  cfg.porter.checkpointing.memory_budget = parse_budget_flag(o.budget);
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

// Note [Plan fit]
// `porter plan --fit` searches the knobs a user turns to make a run fit, each given to the
// config as --set overrides, so that every candidate passes the same parser and rules as a
// config a user writes, and its fragment is what --config accepts: the micro-batch (halved
// down to 1, the accumulation steps doubled so the global batch stays), the checkpoint
// policy (none, selective, full, sqrt, and optimal at a budget of half or a quarter of
// none's peak), checkpoint offload (activation_checkpointing.cpu_checkpointing, with full
// and optimal), the ZeRO stage (1 to 3), optimizer offload (stages 1 to 3) and parameter
// offload (stage 3), and tensor parallelism (each t dividing the world and the heads, up to
// 8) with and without sequence parallelism. Each candidate is forecast (Note [Forecast]) on
// one device model, and those that fit are ranked by predicted tokens per second. For each
// fixed policy, the largest micro-batch and sequence length that fit, the rest of the config
// as given, are found by bisection.
struct FitCandidate {
  std::vector<std::string> sets;  // "key=JSON"
  std::string label;
  double tokens_per_s = 0.0;
  double step_s = 0.0;
  double mfu = 0.0;
  size_t total_peak_bytes = 0;
  int64_t margin_bytes = 0;
};

// The --set overrides as one JSON object, keys nested at their dots.
nlohmann::ordered_json sets_fragment(const std::vector<std::string>& sets) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const std::string& s : sets) {
    const size_t eq = s.find('=');
    const std::string key = s.substr(0, eq);
    nlohmann::ordered_json* at = &j;
    size_t start = 0;
    for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', start)) {
      at = &(*at)[key.substr(start, dot - start)];
      start = dot + 1;
    }
    (*at)[key.substr(start)] = nlohmann::ordered_json::parse(s.substr(eq + 1));
  }
  return j;
}

class FitSearch {
 public:
  FitSearch(const PlanCommandOptions& o, int64_t world_size, const engine::DeviceModel& device,
            double host_bytes_per_s)
      : o_(o), world_size_(world_size), device_(device), host_bytes_per_s_(host_bytes_per_s) {}

  // The forecast of the config with `sets` added, or nullopt when porter refuses it.
  std::optional<engine::Forecast> try_forecast(const std::vector<std::string>& sets) {
    ConfigArgs a = o_.config_args;
    a.sets.insert(a.sets.end(), sets.begin(), sets.end());
    std::ostringstream quiet;
    try {
      const config::Config c = load_config(a, false, quiet, world_size_);
      engine::ForecastOptions fo;
      fo.device = device_;
      fo.host_memory_bytes_per_s = host_bytes_per_s_;
      ++evaluated_;
      return engine::forecast(c, fo);
    } catch (const porter::Error&) {
      return std::nullopt;
    }
  }

  std::vector<FitCandidate> search(const config::Config& base, std::ostream& err) {
    const config::ModelConfig& m = base.porter.model;
    const int64_t global = base.train_batch_size;
    std::vector<FitCandidate> fits;
    std::vector<int64_t> tps = {1};
    for (int64_t t = 2; t <= 8; t *= 2)
      if (world_size_ % t == 0 && m.heads % t == 0 && (m.kv_heads == 0 || m.kv_heads % t == 0)) tps.push_back(t);
    struct Policy {
      std::string name;
      std::vector<std::string> sets;
    };
    std::vector<Policy> policies = {
        {"none", {"porter.checkpointing.policy=\"none\""}},
        {"selective", {"porter.checkpointing.policy=\"selective\""}},
        {"full", {"porter.checkpointing.policy=\"full\""}},
        {"sqrt", {"porter.checkpointing.policy=\"sqrt\""}},
        {"optimal 0.5", {"porter.checkpointing.policy=\"optimal\"", "porter.checkpointing.memory_budget=0.5"}},
        {"optimal 0.25", {"porter.checkpointing.policy=\"optimal\"", "porter.checkpointing.memory_budget=0.25"}}};
    const auto start = std::chrono::steady_clock::now();
    auto last_note = start;
    for (int64_t t : tps) {
      for (bool sp : {false, true}) {
        if (sp && t == 1) continue;
        const int64_t dp = world_size_ / t;
        for (int64_t mb = base.train_micro_batch_size_per_gpu; mb >= 1; mb /= 2) {
          if (global % (mb * dp) != 0) continue;
          const int64_t gas = global / (mb * dp);
          for (int stage = 1; stage <= 3; ++stage) {
            for (bool opt : {false, true}) {
              for (bool param : {false, true}) {
                if (param && stage != 3) continue;
                for (const Policy& p : policies) {
                  const bool ckpt = p.name != "none" && p.name != "selective";
                  for (bool act : {false, true}) {
                    if (act && !ckpt) continue;
                    std::vector<std::string> sets = {
                        "train_batch_size=" + std::to_string(global),
                        "train_micro_batch_size_per_gpu=" + std::to_string(mb),
                        "gradient_accumulation_steps=" + std::to_string(gas),
                        "zero_optimization.stage=" + std::to_string(stage),
                        std::string("zero_optimization.offload_optimizer={\"device\": \"") +
                            (opt ? "cpu" : "none") + "\"}",
                        std::string("zero_optimization.offload_param={\"device\": \"") +
                            (param ? "cpu" : "none") + "\"}",
                        std::string("activation_checkpointing.cpu_checkpointing=") + (act ? "true" : "false"),
                        "porter.model.tensor_parallel=" + std::to_string(t),
                        std::string("porter.model.sequence_parallel=") + (sp ? "true" : "false")};
                    if (p.name.rfind("optimal", 0) != 0) sets.push_back("porter.checkpointing.memory_budget=null");
                    sets.insert(sets.end(), p.sets.begin(), p.sets.end());
                    const std::optional<engine::Forecast> f = try_forecast(sets);
                    const auto now = std::chrono::steady_clock::now();
                    if (now - last_note > std::chrono::seconds(2)) {
                      err << "porter plan --fit: " << evaluated_ << " configurations forecast, "
                          << fits.size() << " fit ("
                          << format_seconds(std::chrono::duration<double>(now - start).count())
                          << ")\n";
                      last_note = now;
                    }
                    if (!f || !f->fits()) continue;
                    FitCandidate c;
                    c.sets = sets;
                    c.label = "mb " + std::to_string(mb) + " x " + std::to_string(gas) +
                              ", ZeRO " + std::to_string(stage) + (opt ? " +opt offload" : "") +
                              (param ? " +param offload" : "") + ", " + p.name +
                              (act ? " +ckpt offload" : "") +
                              (t > 1 ? ", tp " + std::to_string(t) + (sp ? " sp" : "") : "");
                    c.tokens_per_s = f->time.tokens_per_s;
                    c.step_s = f->time.total_s;
                    c.mfu = f->time.mfu;
                    c.total_peak_bytes = f->total_peak_bytes;
                    c.margin_bytes = f->margin_bytes();
                    fits.push_back(std::move(c));
                  }
                }
              }
            }
          }
        }
      }
    }
    std::stable_sort(fits.begin(), fits.end(), [](const FitCandidate& a, const FitCandidate& b) {
      return a.tokens_per_s > b.tokens_per_s;
    });
    return fits;
  }

  // The largest value of `key` in [1, hi] for which the config with `sets` and key=value fits
  // (0: not even 1), by bisection (fitting is monotone in the micro-batch and the sequence).
  int64_t largest(const config::Config& base, const std::vector<std::string>& sets,
                  const std::string& key, int64_t hi) {
    auto fits_at = [&](int64_t v) {
      std::vector<std::string> s = sets;
      s.push_back(key + "=" + std::to_string(v));
      if (key == "train_micro_batch_size_per_gpu") {  // the batch sizes stay consistent
        s.push_back("train_batch_size=" +
                    std::to_string(v * base.gradient_accumulation_steps * base.data_parallel_size()));
      }
      const std::optional<engine::Forecast> f = try_forecast(s);
      return f && f->fits();
    };
    if (!fits_at(1)) return 0;
    int64_t lo = 1;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (fits_at(mid)) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  int64_t evaluated() const { return evaluated_; }

 private:
  const PlanCommandOptions& o_;
  int64_t world_size_;
  engine::DeviceModel device_;
  double host_bytes_per_s_;
  int64_t evaluated_ = 0;
};

int plan_fit(const PlanCommandOptions& o, const config::Config& cfg, int64_t world_size,
             std::ostream& out, std::ostream& err) {
  const engine::Forecast given = engine::forecast(cfg);
  // The host update of optimizer offload is timed on this machine's memory bandwidth.
  FitSearch search(o, world_size, given.device,
                   engine::measure_host_copy_bytes_per_s(size_t{32} << 20, engine::host_threads(given.run)));
  const std::vector<FitCandidate> fits = search.search(cfg, err);
  struct Limit {
    std::string policy;
    int64_t micro_batch = 0, seq_len = 0;
  };
  std::vector<Limit> limits;
  const int64_t seq_hi = std::max<int64_t>(cfg.porter.model.max_positions, cfg.porter.model.seq_len);
  for (const char* policy : {"none", "selective", "full", "sqrt"}) {
    std::vector<std::string> sets = {
        std::string("porter.checkpointing.policy=\"") + policy + "\"",
        "porter.checkpointing.memory_budget=null"};
    // Checkpoint offload holds the inputs of recomputed stages: none there to hold.
    if (std::string(policy) == "none") sets.push_back("activation_checkpointing.cpu_checkpointing=false");
    Limit l;
    l.policy = policy;
    l.micro_batch = search.largest(cfg, sets, "train_micro_batch_size_per_gpu", 4096);
    l.seq_len = search.largest(cfg, sets, "porter.model.seq_len", std::max<int64_t>(seq_hi, 1));
    limits.push_back(l);
  }
  const size_t shown = std::min(fits.size(), static_cast<size_t>(std::max(o.top, 1)));
  if (o.json) {
    nlohmann::ordered_json j;
    j["config"] = o.config_args.display();
    j["world_size"] = world_size;
    j["device"] = given.device.to_json();
    j["given"] = {{"fits", given.capacity_bytes ? nlohmann::ordered_json(given.fits()) : nlohmann::ordered_json()},
                  {"total_peak_bytes", given.total_peak_bytes},
                  {"verdict", given.verdict()}};
    j["evaluated"] = search.evaluated();
    j["fitting"] = fits.size();
    j["candidates"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < shown; ++i) {
      const FitCandidate& c = fits[i];
      j["candidates"].push_back({{"label", c.label}, {"tokens_per_s", c.tokens_per_s},
                                 {"step_s", c.step_s}, {"mfu", c.mfu},
                                 {"total_peak_bytes", c.total_peak_bytes},
                                 {"margin_bytes", c.margin_bytes},
                                 {"config", sets_fragment(c.sets)}});
    }
    j["largest"] = nlohmann::ordered_json::array();
    for (const Limit& l : limits) {
      j["largest"].push_back({{"policy", l.policy}, {"micro_batch", l.micro_batch},
                              {"seq_len", l.seq_len}});
    }
    out << j.dump(2) << "\n";
    return kExitOk;
  }
  out << "porter plan --fit: " << o.config_args.display() << "\n";
  out << "  world: " << world_size << " rank" << (world_size == 1 ? "" : "s") << "; device "
      << given.device.name << " (" << given.device.source << ")\n";
  out << "  as given: " << given.plan.description << "; " << given.verdict() << "\n";
  out << "  " << search.evaluated() << " configurations forecast, " << fits.size()
      << " fit; the fastest (predicted tokens/s, a roofline floor on the step time):\n\n";
  if (fits.empty()) {
    out << "  none fits: the model states alone may exceed the device; try more ranks "
           "(--world-size) or a device with more memory\n";
  } else {
    Table t({"#", "configuration", "tokens/s", "step", "MFU", "total peak", "free"});
    for (size_t i = 0; i < shown; ++i) {
      const FitCandidate& c = fits[i];
      char mfu[32];
      std::snprintf(mfu, sizeof mfu, "%.1f%%", 100.0 * c.mfu);
      t.add({std::to_string(i + 1), c.label, format_count(c.tokens_per_s), format_seconds(c.step_s),
             mfu, format_bytes(c.total_peak_bytes),
             format_bytes(static_cast<uint64_t>(std::max<int64_t>(c.margin_bytes, 0)))});
    }
    t.print(out);
    out << "\n  the first as a config fragment (merge it with --config, after yours):\n"
        << sets_fragment(fits[0].sets).dump(2) << "\n";
  }
  out << "\n  the largest that fit, the rest of the config as given:\n";
  Table lt({"policy", "micro-batch", "sequence length"});
  for (const Limit& l : limits) {
    lt.add({l.policy, l.micro_batch ? std::to_string(l.micro_batch) : "none fits",
            l.seq_len ? std::to_string(l.seq_len) : "none fits"});
  }
  lt.print(out);
  return kExitOk;
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
  apply_budget_flag(o, cfg);
  if (o.fit) return plan_fit(o, cfg, world_size, out, err);  // Note [Plan fit]
  return plan_config(o, std::move(cfg), out, err, nullptr);
}

int plan_config(const PlanCommandOptions& o, config::Config cfg, std::ostream& out,
                std::ostream& err, nlohmann::ordered_json* json_out) {
  const int64_t micro_batches = cfg.gradient_accumulation_steps;

  // Note [Forecast]: bytes from the analytic model, times from the device model.
  engine::ForecastOptions fo;
  fo.progress = plan_progress_printer(err, "porter plan");
  engine::Forecast f = engine::forecast(cfg, fo);
  cfg.porter.model.attention = f.config.porter.model.attention;  // Note [Attention choice]
  cfg.porter.model.loss_tiles = f.config.porter.model.loss_tiles;
  cfg.porter.model.mlp_tiles = f.config.porter.model.mlp_tiles;
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
    j["config"] = o.config_name.empty() ? o.config_args.display() : o.config_name;
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
    if (json_out) {
      *json_out = std::move(j);
    } else {
      out << j.dump(2) << "\n";
    }
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
  // Note [Stage 3 sizing]: the gather knobs in effect, and a warning when stage 3 would hold
  // more parameter bytes than stage 2.
  if (const std::optional<engine::Stage3Report> s3 = engine::stage3_report(run, plan.schedule)) {
    out << "  " << s3->line() << "\n";
    if (!s3->warning.empty()) err << "warning: " << s3->warning << "\n";
  }
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

nlohmann::ordered_json plan_report(const config::Config& cfg, const PlanReportOptions& options,
                                   std::ostream& err) {
  PlanCommandOptions o;
  o.json = true;
  o.config_name = options.config_name;
  o.budget = options.budget;
  o.profile = options.profile;
  std::ostream unused(nullptr);  // the text's stream; a JSON report prints nothing there
  nlohmann::ordered_json j;
  naming_budget_flag(o, [&] {
    config::Config c = cfg;
    apply_budget_flag(o, c);
    return plan_config(o, std::move(c), unused, err, &j);
  });
  return j;
}

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
  cmd->add_flag("--fit", o->fit,
                "Search micro-batch, checkpoint policy and offload, ZeRO stage, optimizer and "
                "parameter offload and tensor parallelism for the fastest configurations that "
                "fit, and the largest micro-batch and sequence length per policy");
  cmd->add_option("--top", o->top, "With --fit: how many configurations to list (default 8)")
      ->check(CLI::Range(1, 1000));
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
