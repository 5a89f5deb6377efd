// `porter train --config F [--nproc N] [--steps N] [--report FILE] [--trace FILE]
// [--trace-rank R] [--memory-page FILE] [--dump-dir DIR] [--save DIR] [--resume DIR]
// [--save-hf DIR]`: trains the built-in GPT as the config says (from a Hugging Face model's
// weights with porter.model.from), with progress, a summary, and optional report, trace,
// memory page, tensor dump, training checkpoint and Hugging Face export; on one rank, or as
// one rank of a launched world (Note [Distributed train]).
#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "base/error.h"
#include "base/units.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "engine/run_options.h"
#include "cli/launch.h"
#include "cli/memory_page.h"
#include "cli/train_report.h"
#include "cli/train_resilience.h"
#include "cli/train_trace.h"
#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/store.h"
#include "io/data.h"
#include "engine/checkpointer.h"
#include "engine/distributed.h"
#include "engine/engine.h"
#include "engine/stage3.h"
#include "engine/forecast.h"
#include "engine/host_fit.h"
#include "engine/whole_params.h"
#include "io/hf_checkpoint.h"
#include "io/run_dir.h"
#include "engine/model.h"
#include "engine/trace.h"
#include "kernels/kernel_table.h"
#include "models/factory.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;

// Where the run's kernel choices come from (Note [Kernel table] in kernels/kernel_table.cc).
std::string describe_kernel_table(const kernels::KernelTable& table) {
  const std::string origin = table.origin();
  if (origin != "measured in this run") {
    return origin + " (" + std::to_string(table.size()) + " choices)";
  }
  return table.mode() == kernels::KernelChoice::kExact
             ? std::string("exact: measured in this run among candidates that give the same "
                           "bits (porter.device.kernel_choice)")
             : std::string("fastest: measured in this run among every candidate; pin the "
                           "report's kernel_table to repeat its bits (porter.device.kernel_table)");
}

// PORTER_RESTART, set by porter launch (Note [Restarts] in cli/launch.h); 0 when absent.
int restart_count() {
  const char* v = std::getenv("PORTER_RESTART");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > 1'000'000) {
    throw InvalidArgument(std::string("environment variable PORTER_RESTART=\"") + v +
                          "\" is not a restart count (porter launch sets it); unset it");
  }
  return static_cast<int>(n);
}

struct TrainOptions {
  ConfigArgs config_args;  // --config files and --set overrides
  std::optional<int> nproc;
  std::optional<int64_t> steps;
  std::optional<int> trace_rank;
  std::string report, trace, dump_dir, save, resume;
  std::string save_hf;  // a Hugging Face model directory written at the end
  std::optional<int64_t> save_every;  // porter.train.save_every
  std::optional<int> max_restarts;    // with --nproc: the launcher's
  std::string memory_page;  // the last step's, drawn by rank 0
  bool strict = false;
  bool no_preflight = false;
};

// Note [Preflight]
// Before anything is allocated, porter train forecasts the run's total peak per rank (Note
// [Forecast] in engine/forecast.h) against the opened device's memory and refuses a run that
// cannot fit, with the verdict and the way to find one that does, instead of failing in the
// middle of step 1 (or of hour 3). The forecast plans on nominal device figures, so a plan
// whose choice depends on times (optimal, offload) may differ from the profiled plan training
// makes; the bytes of a given plan are exact. The host's side comes first (Note [Host fit]
// in engine/host_fit.h): the ranks on this node (the launcher's local world size) must fit the
// machine's memory with their offloaded states (and, with periodic checkpoints, the snapshot
// a background write holds), and each rank's pinned bytes the pinned limit.
// --no-preflight skips both.
engine::ForecastOptions preflight_options(const memory::Device& device) {
  engine::ForecastOptions fo;
  fo.capacity_bytes = device.memory_capacity_bytes();
  fo.device = engine::nominal_cpu_device_model(*fo.capacity_bytes);
  fo.time_host_update = false;
  return fo;
}

void preflight(const config::Config& cfg, const memory::Device& device, const ConfigArgs& args,
               int ranks_per_node, bool periodic_saves) {
  const engine::Forecast f = engine::forecast(cfg, preflight_options(device));
  const size_t machine = engine::machine_memory_bytes();
  if (machine > 0) {
    engine::HostFit h = engine::host_fit(f, ranks_per_node, machine);
    if (periodic_saves) h.in.checkpoint_snapshot_bytes = engine::checkpoint_snapshot_bytes(f);
    if (!h.fits()) {
      throw OutOfMemoryError(
          "out of host memory before step 1 (preflight): " + h.verdict() + ". Per rank: " +
              format_bytes(h.in.states.total()) + " of offloaded model states (optimizer " +
              format_bytes(h.in.states.optimizer) + ", grads " + format_bytes(h.in.states.grads) +
              ", params " + format_bytes(h.in.states.params) + ")" +
              (h.in.stash_pinned_bytes > 0
                   ? ", " + format_bytes(h.in.stash_pinned_bytes) + " of offloaded activations"
                   : "") +
              (h.in.simulated_device_bytes > 0
                   ? ", " + format_bytes(h.in.simulated_device_bytes) +
                         " of simulated device memory"
                   : "") +
              (h.in.checkpoint_snapshot_bytes > 0
                   ? ", " + format_bytes(h.in.checkpoint_snapshot_bytes) +
                         " of checkpoint snapshot (porter.train.save_every)"
                   : "") +
              ". `porter estimate " + args.command_args() +
              " --ranks-per-node N` shows the host's figures; --no-preflight skips this check",
          h.per_node_bytes());
    }
  }
  if (f.fits()) return;
  throw OutOfMemoryError(
      "out of memory on " + device.description() + " before step 1 (preflight): " +
          f.plan.description + "; " + f.verdict() + " (model states " +
          format_bytes(f.model_states.total()) + ", activations and the rest of the step " +
          format_bytes(f.plan.prediction.peak_total_bytes) + "). `porter plan --fit " + args.command_args() + " --world-size " +
          std::to_string(cfg.world_size) + "` lists configurations that fit; --no-preflight "
          "skips this check",
      f.total_peak_bytes);
}

// Note [Progress output]
// On a terminal, one line rewritten in place (\r, erase to end of line) after every step; on
// anything else (a file, a pipe, a CI log), one plain line every porter.train.log_every steps
// and on the last step, so logs stay greppable and are not flooded with carriage returns.
class Progress {
 public:
  Progress(std::ostream& err, bool tty, int64_t first, int64_t last, int64_t log_every)
      : err_(err), tty_(tty), first_(first), last_(last), log_every_(log_every) {}

  void step(const engine::StepResult& r, double elapsed_s) {
    const int64_t done = r.step - first_;
    const int64_t left = last_ - r.step;
    const double eta_s = done > 0 ? elapsed_s / static_cast<double>(done) * static_cast<double>(left) : 0;
    const double tok_s = r.time_s > 0 ? static_cast<double>(r.tokens) / r.time_s : 0;
    char line[256];
    if (tty_) {
      constexpr int kWidth = 24;
      const int filled = static_cast<int>(
          kWidth * static_cast<double>(done) / static_cast<double>(std::max<int64_t>(1, last_ - first_)));
      std::string bar(static_cast<size_t>(filled), '#');
      bar.resize(kWidth, '.');
      std::snprintf(line, sizeof line, "\r[%s] step %lld/%lld  loss %.4f  %s tok/s  ETA %s\033[K",
                    bar.c_str(), static_cast<long long>(r.step), static_cast<long long>(last_),
                    r.loss, format_count(tok_s).c_str(), clock(eta_s).c_str());
      err_ << line << std::flush;
      if (r.step == last_) err_ << "\n";
      return;
    }
    if (r.step % log_every_ != 0 && r.step != last_) return;
    std::snprintf(line, sizeof line,
                  "step %lld/%lld  loss %.4f  lr %.3g  grad_norm %.3f  %s tok/s  %s/step  "
                  "act peak %s  ETA %s\n",
                  static_cast<long long>(r.step), static_cast<long long>(last_), r.loss, r.lr,
                  r.grad_norm, format_count(tok_s).c_str(), format_seconds(r.time_s).c_str(),
                  format_bytes(r.peak_activation_bytes).c_str(), clock(eta_s).c_str());
    err_ << line << std::flush;
  }

  // wall_clock_breakdown: DeepSpeed's timing line under each step's progress line (Note
  // [Wall-clock breakdown] in engine/engine.h).
  void wall_clock(const engine::StepResult& r, int rank) {
    if (!r.wall_clock.enabled || (!tty_ && r.step % log_every_ != 0 && r.step != last_)) return;
    note(r.wall_clock.format(rank));
  }

  // A line of its own between steps; on a terminal the next step redraws the bar below it.
  void note(const std::string& line) {
    err_ << (tty_ ? "\r\033[K" : "") << line << "\n" << std::flush;
  }

  // Ends a half-written bar line before an error message.
  void interrupt() {
    if (tty_) err_ << "\n";
  }

 private:
  static std::string clock(double s) {
    const long long t = std::llround(s);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%lld:%02lld", t / 60, t % 60);
    return buf;
  }
  std::ostream& err_;
  bool tty_;
  int64_t first_, last_, log_every_;
};

// Note [Distributed train]
// `porter train --nproc N ARGS` is `porter launch -n N -- <this porter> train ARGS` (without
// --nproc): the launcher re-executes /proc/self/exe. A `porter train` whose environment says
// WORLD_SIZE > 1 (comm::dist_env_from_process: torchrun's or OpenMPI's variables) is one rank:
// - the config is parsed for that world size (its batch sizes are checked against it);
// - it joins a TcpStore on MASTER_ADDR:MASTER_PORT (rank 0 runs the server, and the store
//   waits for all WORLD_SIZE clients), builds the world communicator from it
//   (comm::make_communicator, porter.comm.timeout_s) and the data-parallel and
//   tensor-parallel groups (rank = dp_rank * tp + tp_rank), and gives them to the Engine with
//   its part of the model; it trains on DataSource::rank_batches of its dp rank, its slice of
//   every step (the tp ranks of one dp rank train on the same micro-batches);
// - only rank 0 prints the header, the progress and the summary and writes --report and
//   --trace, whose file has every rank's events (or --trace-rank's; Note [Train trace] in
//   cli/train_trace.h); config warnings are printed by rank 0 only. --save and --resume are every
//   rank's (each saves and loads its own `DIR`/rank<r>); --dump-dir is refused (a rank holds
//   only its gradient shard);
// - with porter.model.from every rank reads the Hugging Face weights itself and keeps its
//   tensor-parallel part (load_hf_weights); --save-hf gathers the whole model (Note [Whole
//   parameters] in io/hf_checkpoint.h) and rank 0 writes it;
// - after the last step every rank hands its memory report to rank 0 (Note [Per-rank
//   report] in cli/train_report.h);
// - a rank that fails aborts its communicator (so its peers fail at once rather than at the
//   timeout) and prints "error: rank r of N: ..." with the usual exit code.

// porter train --nproc N: the arguments of this invocation without --nproc.
std::vector<std::string> without_nproc(const std::vector<std::string>& args) {
  std::vector<std::string> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc" || args[i] == "--max-restarts") {
      ++i;  // and its value
      continue;
    }
    if (args[i].rfind("--nproc=", 0) == 0 || args[i].rfind("--max-restarts=", 0) == 0) continue;
    kept.push_back(args[i]);
  }
  return kept;
}

int train_nproc(const TrainOptions& o, const CommandContext& ctx) {
  const comm::DistEnv env = comm::dist_env_from_process();
  if (env.source != "none") {
    throw UsageError("--nproc " + std::to_string(*o.nproc) + ": this process is already rank " +
                     std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                     " (a launcher set " +
                     (env.source == "openmpi" ? "OMPI_COMM_WORLD_*"
                      : env.source == "slurm" ? "SLURM_PROCID (srun)"
                                              : "RANK") +
                     "); drop --nproc");
  }
  LaunchOptions lo;
  lo.nproc = *o.nproc;
  lo.max_restarts = o.max_restarts.value_or(0);
  lo.command = {self_executable()};
  for (std::string& a : without_nproc(ctx.args)) lo.command.push_back(std::move(a));
  return launch(lo, *ctx.out, *ctx.err).exit_code();  // the first failed rank's code
}

// This process's place in the world and what connects it to the others (Note [Joining the
// world] in engine/distributed.h).
struct World {
  comm::DistEnv env;
  std::shared_ptr<comm::Store> store;             // null for one rank
  std::shared_ptr<comm::Communicator> world, dp, tp;  // null for one rank
  int tp_rank = 0;
  comm::ProcessGroups groups;                     // the Engine's: dp and tp (default: one rank)
  bool leader() const { return env.rank == 0; }
  bool distributed() const { return env.world_size > 1; }
};

World join_world(const comm::DistEnv& env, const config::Config& cfg, memory::Device& device) {
  DistributedOptions o;
  o.tensor_parallel = static_cast<int>(cfg.porter.model.tensor_parallel);
  o.timeout_s = cfg.porter.comm.timeout_s;
  Distributed d = init_distributed(device, env, o);
  World w;
  w.env = env;
  w.store = std::move(d.store);
  w.world = std::move(d.world);
  w.groups = std::move(d.groups);
  w.dp = w.groups.dp;
  w.tp = w.groups.tp;
  w.tp_rank = w.groups.tp_rank;
  return w;
}

// Every rank's rank_json, by rank, on rank 0 (Note [Per-rank report]); this rank's alone
// elsewhere.
std::vector<nlohmann::ordered_json> gather_rank_reports(const World& w, engine::Engine& eng,
                                                        double timeout_s) {
  nlohmann::ordered_json mine = rank_json(w.env.rank, eng);
  if (!w.distributed()) return {mine};
  const std::string prefix = "porter/train/rank/";
  w.store->set_string(prefix + std::to_string(w.env.rank), mine.dump());
  if (!w.leader()) return {mine};
  std::vector<nlohmann::ordered_json> all;
  for (int r = 0; r < w.env.world_size; ++r) {
    all.push_back(nlohmann::ordered_json::parse(
        w.store->get_string(prefix + std::to_string(r), comm::Seconds(timeout_s))));
  }
  return all;
}

// Note [Validation loss]
// With porter.data.val_paths every rank evaluates its dp rank's share of the validation set
// (io::ValidationSet, Note [Validation set] in io/data.h) after every
// porter.train.eval_every-th step and after the last one; every rank calls Engine::evaluate,
// since its forward may communicate (tensor-parallel layers, stage-3 gathers). The dp ranks'
// shares are equally large, so the set's loss is the mean of their means. The tp ranks of a
// dp rank evaluate the same micro-batches to the same loss, so the first of them speaks for
// it: it set()s its mean in the run's store under "porter/train/val/<step>/<dp rank>" and rank
// 0 get()s them (within porter.comm.timeout_s). The store, not the dp communicator, carries
// the means: they are host values, and an NCCL collective reads device memory.
double validation_loss(const World& w, engine::Engine& eng, const io::ValidationSet& val,
                       int64_t step, double timeout_s) {
  const double mine = eng.evaluate(val.rank_batches(eng.dp_rank()));
  if (!w.distributed() || eng.dp_size() == 1) return mine;
  const std::string prefix = "porter/train/val/" + std::to_string(step) + "/";
  if (!w.leader()) {
    if (eng.tp_rank() == 0) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", mine);
      w.store->set_string(prefix + std::to_string(eng.dp_rank()), buf);
    }
    return mine;
  }
  double sum = mine;
  for (int r = 1; r < eng.dp_size(); ++r) {
    sum += std::stod(w.store->get_string(prefix + std::to_string(r), comm::Seconds(timeout_s)));
  }
  return sum / static_cast<double>(eng.dp_size());
}

int train_rank(const TrainOptions& o, const CommandContext& ctx, const config::Config& cfg,
               const std::string& trace_path, memory::Device& dev, const World& w,
               std::ostream& out, std::ostream& err);

// A step that ran out of memory: its page (Note [Out-of-memory page] in cli/memory_page.h),
// on every rank that fails so, and the error again with the page's path at its end (or why
// it could not be written). The error is unchanged when no step was being recorded.
OutOfMemoryError with_memory_page(const OutOfMemoryError& e, engine::Engine& eng,
                                  const TrainOptions& o, const World& w,
                                  const std::string& config_file) {
  const std::optional<engine::StepMemory> step = eng.unfinished_step_memory();
  if (!step) return e;
  const std::string path = oom_page_path(o.memory_page, o.report, w.env.rank, w.env.world_size);
  std::string line;
  try {
    write_memory_page(path, oom_page_data(eng, *step, e, config_file, w.env.rank),
                      o.memory_page.empty() ? "the out-of-memory page" : "--memory-page");
    line = "memory page of the failed step: " + path;
  } catch (const porter::Error& failed) {
    line = std::string("the failed step's memory page was not written: ") + failed.what();
  }
  return OutOfMemoryError(std::string(e.what()) + "\n" + line, e.requested_bytes());
}

// porter.model.from's weights in place of the random init: this rank's tensor-parallel part
// of them, and at ZeRO stage 3 only its shard of that, read straight from the files (Note
// [Sharded loading] in io/hf_checkpoint.h; every rank calls set_params_host_range: a
// collective at ZeRO stage 3). Returns the header line that says so.
std::string load_hf_weights(const config::Config& cfg, engine::Engine& eng, int tp_rank) {
  const std::string& dir = *cfg.porter.model.from;
  const std::unique_ptr<models::Transformer> part = models::build_model(cfg.porter.model, tp_rank);
  io::HfWeights hf;
  eng.set_params_host_range([&](int64_t begin, std::span<float> values) {
    hf = io::read_hf_weights_part(dir, *part, begin, values);
  });
  std::string dtypes;
  for (const std::string& d : hf.dtypes) dtypes += (dtypes.empty() ? "" : "+") + d;
  return "  weights: " + dir + " (Hugging Face, " + std::to_string(hf.tensors) + " tensors in " +
         std::to_string(hf.files.size()) + " file" + (hf.files.size() == 1 ? "" : "s") + ", " +
         dtypes + ", " + format_bytes(hf.bytes) + ")\n";
}

int train(const TrainOptions& o, CommandContext& ctx) {
  if (o.nproc) return train_nproc(o, ctx);
  const comm::DistEnv env = comm::dist_env_from_process();
  if (env.world_size > 1) {
    ctx.error_prefix = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + ": ";
  }
  // Ranks other than 0 print only their errors.
  std::ostream quiet(nullptr);
  std::ostream& out = env.rank == 0 ? *ctx.out : quiet;
  std::ostream& err = env.rank == 0 ? *ctx.err : quiet;
  config::Config cfg = load_config(o.config_args, o.strict, err, env.world_size);
  if (o.steps) cfg.porter.train.steps = *o.steps;
  if (o.max_restarts) {
    throw UsageError("--max-restarts: only with --nproc (porter train starts the world then); "
                     "under another launcher give it to porter launch");
  }
  if (o.save_every) cfg.porter.train.save_every = *o.save_every;
  if (cfg.porter.train.save_every > 0 && o.save.empty()) {
    err << "warning: porter.train.save_every " << cfg.porter.train.save_every
        << " without --save: no checkpoint is written; give --save DIR\n";
  }
  // Every output is checked before anything is built (Note [Preemption]'s sibling: a run
  // must not train for hours and then find it cannot write). Rank 0 writes the files; every
  // rank writes its part of --save.
  std::vector<OutputPath> outputs = {{"--save", o.save, true}};
  if (env.rank == 0) {
    const std::string trace_file = !o.trace.empty() ? o.trace : cfg.porter.trace.path.value_or("");
    outputs.push_back({"--save-hf", o.save_hf, true});
    outputs.push_back({"--report", o.report, false});
    outputs.push_back({"--trace", trace_file, false});
    outputs.push_back({"--memory-page", o.memory_page, false});
    outputs.push_back({"--dump-dir", o.dump_dir, true});
  }
  check_output_paths(outputs);
  const std::string trace_path = !o.trace.empty() ? o.trace : cfg.porter.trace.path.value_or("");

  std::unique_ptr<memory::Device> device = memory::make_device(engine::make_run_options(cfg).device);
  // Note [Attention choice]: decided before the model is built, the same on every rank.
  cfg = engine::resolve_model_choices(cfg, preflight_options(*device));
  if (!o.no_preflight) {  // Note [Preflight]
    preflight(cfg, *device, o.config_args, std::max(1, env.local_world_size),
              !o.save.empty() && cfg.porter.train.save_every > 0);
  }
  const World w = join_world(env, cfg, *device);
  try {
    return train_rank(o, ctx, cfg, trace_path, *device, w, out, err);
  } catch (const std::exception& e) {
    if (w.dp) w.dp->abort(ctx.error_prefix + e.what());
    if (w.tp && w.tp != w.dp && w.tp != w.world) w.tp->abort(ctx.error_prefix + e.what());
    if (w.world && w.world != w.dp) w.world->abort(ctx.error_prefix + e.what());
    throw;
  }
}

int train_rank(const TrainOptions& o, const CommandContext& ctx, const config::Config& cfg,
               const std::string& trace_path, memory::Device& dev, const World& w,
               std::ostream& out, std::ostream& err) {
  memory::Device* device = &dev;
  if (w.distributed() && !o.dump_dir.empty()) {
    throw InvalidArgument("--dump-dir: not available with WORLD_SIZE > 1 (at ZeRO stages 1 and 2 "
                          "each rank holds only its shard of the gradients); dump a one-rank run "
                          "of the same global batch instead");
  }
  io::DataSource data(cfg.porter.data, cfg.porter.model.vocab,
                          cfg.train_micro_batch_size_per_gpu, cfg.porter.model.seq_len);
  std::optional<io::ValidationSet> val;
  if (!cfg.porter.data.val_paths.empty()) {
    val.emplace(cfg.porter.data, cfg.porter.model.vocab, cfg.train_micro_batch_size_per_gpu,
                cfg.porter.model.seq_len, cfg.porter.train.eval_micro_batches,
                static_cast<int>(cfg.data_parallel_size()));
  }
  engine::Engine eng(*device, std::make_unique<engine::TransformerModel>(cfg.porter.model, w.tp_rank), cfg,
                     w.groups);
  // Note [Train trace]: every rank records (unless --trace-rank keeps another) and notes its
  // clock after a barrier.
  std::unique_ptr<engine::TraceRecorder> trace;
  TraceShare share{w.store.get(), w.env.rank, w.env.world_size, o.trace_rank,
                   comm::Seconds(cfg.porter.comm.timeout_s)};
  int64_t trace_sync_us = 0;
  if (!trace_path.empty()) {
    if (o.trace_rank && *o.trace_rank >= w.env.world_size) {
      throw UsageError("--trace-rank " + std::to_string(*o.trace_rank) + ": the run has " +
                       std::to_string(w.env.world_size) + " rank(s), 0.." +
                       std::to_string(w.env.world_size - 1));
    }
    trace = std::make_unique<engine::TraceRecorder>();
    trace_sync_us = sync_trace_clock(w.world.get(), *trace);
    if (share.kept(w.env.rank)) eng.set_trace(trace.get());
  } else if (o.trace_rank) {
    throw UsageError("--trace-rank: there is no trace to write; give --trace FILE (or set "
                     "porter.trace.path)");
  }
  // Note [Restarts] in cli/launch.h: a restarted world resumes from its own run directory.
  const int restart = restart_count();
  std::string resume_arg = o.resume;
  if (resume_arg.empty() && restart > 0 && !o.save.empty() &&
      (io::is_run_dir(o.save) || io::is_checkpoint(o.save))) {
    resume_arg = o.save;
  }
  std::string resume_dir;
  if (!resume_arg.empty()) {
    resume_dir = choose_resume(resume_arg, w.store.get(), w.env.rank, w.env.world_size,
                               comm::Seconds(cfg.porter.comm.timeout_s), err)
                     .string();
  }
  std::string weights_line;
  nlohmann::json hf_source;  // the config.json that --save-hf carries token ids over from
  if (cfg.porter.model.from) {
    if (resume_dir.empty()) {
      weights_line = load_hf_weights(cfg, eng, w.tp_rank);
    } else {
      weights_line = "  weights: from --resume " + resume_dir + " (" + *cfg.porter.model.from +
                     " gave the model's shape)\n";
    }
    if (!o.save_hf.empty()) hf_source = io::read_hf_config(*cfg.porter.model.from).json;
  }
  if (!resume_dir.empty()) eng.load_checkpoint(resume_dir);
  // Every rank records its steps: rank 0's last one is --memory-page's, and any rank's step
  // that runs out of memory is drawn up to the failure (Note [Out-of-memory page]).
  eng.record_step_memory(true);

  TrainRun run;
  run.config_file = o.config_args.display();
  run.device = device->description();
  run.data = data.describe();
  if (val) {
    run.validation_data = val->describe();
    run.validation_micro_batches = val->micro_batches();
  }
  run.start_step = eng.step();
  run.restarts = restart;
  run.resumed_from = resume_dir;
  run.world_size = w.env.world_size;
  if (w.world) run.comm_backend = std::string(w.world->backend());
  const int64_t last = cfg.porter.train.steps;
  const int64_t micro_batches = cfg.gradient_accumulation_steps;

  out << "porter train: " << run.config_file << "\n"
      << "  model: " << describe_model(cfg.porter.model) << ": "
      << format_count(static_cast<double>(eng.model().layout().num_params()))
      << (eng.tp_size() > 1 ? " parameters on each of " + std::to_string(eng.tp_size()) +
                                  " tensor-parallel ranks" +
                                  (cfg.porter.model.sequence_parallel ? " (sequence-parallel)" : "")
                            : std::string(" parameters"))
      << ", " << tensor::dtype_name(eng.compute_dtype()) << "\n"
      << "  data: " << run.data << "; " << micro_batches << " x " << cfg.train_micro_batch_size_per_gpu
      << " x " << cfg.porter.model.seq_len << " tokens per step"
      << (eng.dp_size() > 1 ? " on each of " + std::to_string(eng.dp_size()) + " data-parallel ranks"
                            : std::string())
      << "\n";
  if (val) {
    const int64_t every = cfg.porter.train.eval_every;
    out << "  validation: " << run.validation_data << "; " << val->micro_batches()
        << " micro-batches" << (eng.dp_size() > 1 ? " on each data-parallel rank" : "")
        << (every > 0 ? ", every " + std::to_string(every) + " steps and after the last"
                      : std::string(", after the last step"))
        << "\n";
  }
  out << weights_line
      << "  device: " << run.device << "\n"
      << "  kernel choices: " << describe_kernel_table(eng.kernel_table()) << "\n"
      << "  checkpointing: " << eng.plan().description << "\n";
  if (w.distributed() || cfg.zero_optimization.stage > 0) {
    out << "  ranks: " << w.env.world_size << " (" << eng.dp_size() << " data-parallel"
        << (eng.tp_size() > 1 ? " x " + std::to_string(eng.tp_size()) + " tensor-parallel"
                              : std::string())
        << (w.world ? ", " + run.comm_backend : std::string()) << "), ZeRO stage "
        << cfg.zero_optimization.stage << "; memory figures are per rank\n";
  }
  if (!resume_dir.empty()) {
    out << "  resumed from " << resume_dir << " at step " << run.start_step
        << (restart > 0 ? " (restart " + std::to_string(restart) + ")" : std::string()) << "\n";
  } else if (restart > 0) {
    out << "  restart " << restart << ": no checkpoint in " << (o.save.empty() ? "--save" : o.save)
        << " yet, starting from step 0\n";
  }
  const int64_t save_every = cfg.porter.train.save_every;
  std::unique_ptr<engine::Checkpointer> checkpointer;
  if (!o.save.empty() && save_every > 0) {
    engine::CheckpointerOptions co;
    co.run_dir = o.save;
    co.keep = cfg.porter.train.keep_checkpoints;
    co.store = w.store.get();
    co.rank = w.env.rank;
    co.world_size = w.env.world_size;
    co.timeout = comm::Seconds(cfg.porter.comm.timeout_s);
    checkpointer = std::make_unique<engine::Checkpointer>(co);
    // Resumed from this run directory's own checkpoint: that step is saved already.
    std::error_code ec;
    if (!resume_dir.empty() &&
        fs::equivalent(fs::path(resume_dir).parent_path(), fs::path(o.save), ec)) {
      checkpointer->mark_saved(eng.step());
    }
    out << "  checkpoints: " << o.save << "/step-<N> every " << save_every
        << " steps and after the last, the newest " << co.keep << " kept\n";
  }
  if (const auto s3 = engine::stage3_report(eng)) { out << "  " << s3->line() << "\n"; if (!s3->warning.empty()) err << "warning: " << s3->warning << "\n"; }  // Note [Stage 3 sizing]
  out << std::flush;
  {
    const engine::MemoryReport mem = eng.memory_report();
    if (mem.capacity_bytes > 0 && mem.predicted_peak_bytes > mem.capacity_bytes) {
      err << "warning: the plan's predicted peak, " << format_bytes(mem.predicted_peak_bytes)
          << ", exceeds the device's " << format_bytes(mem.capacity_bytes)
          << "; expect out of memory (porter estimate " << o.config_args.command_args()
          << " compares the policies)\n";
    }
  }

  Progress progress(err, ctx.err_is_tty, run.start_step, last, cfg.porter.train.log_every);
  std::vector<float> dump_params;
  eng.reset_peaks();  // peaks of the training steps, not of set-up or profiling
  const auto t0 = std::chrono::steady_clock::now();
  // After a failure peers may be gone: rank 0 writes its own events alone.
  auto write_trace = [&] {
    if (!trace || !w.leader() || !share.kept(0)) return false;
    trace->write_file(trace_path);
    return true;
  };
  StopSignals stop;  // Note [Preemption]
  int stopped_by = 0;
  try {
    while (eng.step() < last) {
      const int64_t step = eng.step();
      std::vector<io::HostBatch> batches =
          w.distributed() ? data.rank_batches(step, micro_batches, eng.dp_rank(), eng.dp_size())
                          : data.step_batches(step, micro_batches);
      if (!o.dump_dir.empty() && step == last - 1) dump_params = eng.params_host();
      engine::StepResult r = eng.train_step(batches);
      run.steps.push_back(r);
      if (!std::isfinite(r.loss)) {
        progress.interrupt();
        err << "warning: step " << r.step << ": the loss is " << r.loss
            << "; lower the learning rate or enable gradient_clipping\n";
      }
      progress.step(r, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      progress.wall_clock(r, eng.world_rank());
      const int64_t every = cfg.porter.train.eval_every;
      if (val && (r.step == last || (every > 0 && r.step % every == 0))) {
        const double loss = validation_loss(w, eng, *val, r.step, cfg.porter.comm.timeout_s);
        run.validation.push_back({r.step, loss});
        char line[160];
        std::snprintf(line, sizeof line, "val loss %.4f (step %lld, %lld micro-batches%s)", loss,
                      static_cast<long long>(r.step), static_cast<long long>(val->micro_batches()),
                      eng.dp_size() > 1 ? " on each data-parallel rank" : "");
        progress.note(line);
      }
      if (checkpointer && r.step % save_every == 0 && r.step < last) {
        checkpointer->save(eng);
      }
      // After the last step the run is complete: a signal then changes nothing.
      if (r.step < last && stop.stop_agreed(w.store.get(), r.step)) {
        stopped_by = stop.signal() != 0 ? stop.signal() : SIGTERM;
        break;
      }
    }
  } catch (...) {
    progress.interrupt();
    try {
      if (write_trace()) err << "trace (up to the error) written to " << trace_path << "\n";
    } catch (const porter::Error& e) {
      err << "warning: " << e.what() << "\n";
    }
    // A step that ran out of memory leaves its page; any other error goes on as it is.
    try {
      throw;
    } catch (const OutOfMemoryError& e) {
      throw with_memory_page(e, eng, o, w, run.config_file);
    }
  }
  run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Every rank saves its own state (engine/state.cc: `dir`/rank<r> with several ranks).
  if (checkpointer) {
    checkpointer->save(eng);
    checkpointer->wait();
    run.checkpoints = checkpointer->records();
  } else if (!o.save.empty()) {
    eng.save_checkpoint(o.save);
  }
  if (stopped_by != 0) {
    progress.interrupt();
    run.stopped_by = signal_name(stopped_by);
    if (w.leader()) {
      err << "porter train: stopped by " << run.stopped_by << " after step " << eng.step()
          << " of " << last;
      if (o.save.empty()) {
        err << "; nothing saved (no --save)\n";
      } else {
        const std::string where =
            checkpointer ? (fs::path(o.save) / io::step_dir_name(eng.step())).string() : o.save;
        err << "; saved " << where << ". Resume with the same command and --resume " << o.save
            << "\n";
      }
    }
  }
  std::optional<io::HfExport> hf_export;
  if (!o.save_hf.empty()) {
    // Every rank takes part in the gather; rank 0 writes.
    const std::vector<float> whole = engine::whole_params_host(eng, w.tp.get());
    if (w.leader()) {
      config::ModelConfig model = cfg.porter.model;
      model.tensor_parallel = 1;
      model.sequence_parallel = false;
      hf_export = io::write_hf_checkpoint(o.save_hf, model, models::build_model(model)->layout(),
                                          whole, eng.compute_dtype(), hf_source);
    }
  }
  run.ranks = gather_rank_reports(w, eng, cfg.porter.comm.timeout_s);
  if (trace) share_trace(share, *trace, trace_sync_us, trace_path);
  if (!w.leader()) return kExitOk;
  print_summary(run, eng, out);
  if (!o.report.empty()) {
    std::ofstream f(o.report);
    f << train_report(run, eng).dump(2) << "\n";
    if (!f) throw IoError("--report: cannot write \"" + o.report + "\"");
    out << "\nreport: " << o.report << "\n";
  }
  if (trace) {
    out << "trace: " << trace_path << " (open in ui.perfetto.dev or chrome://tracing)"
        << (w.distributed() ? (o.trace_rank ? ", rank " + std::to_string(*o.trace_rank)
                                            : ", every rank")
                            : std::string())
        << "\n";
  }
  if (!o.memory_page.empty()) {
    if (const engine::StepMemory* step = eng.last_step_memory()) {
      write_memory_page(o.memory_page, train_page_data(eng, *step, run.config_file), "--memory-page");
      out << "memory page: " << o.memory_page << " (step " << step->step << ")\n";
    } else {
      err << "warning: --memory-page: no step ran, nothing drawn\n";
    }
  }
  if (!o.dump_dir.empty()) {
    if (run.steps.empty()) {
      err << "warning: --dump-dir: no step ran, nothing dumped\n";
    } else {
      write_dump(o.dump_dir, eng, dump_params, run.steps.back());
      out << "dump: " << o.dump_dir << " (step " << run.steps.back().step - 1 << ")\n";
    }
  }
  if (checkpointer && !checkpointer->records().empty() &&
      checkpointer->records().back().step == eng.step()) {
    const engine::CheckpointRecord& c = checkpointer->records().back();
    out << "saved: " << c.path.string() << " (step " << c.step << "; latest in " << o.save
        << "; snapshot " << format_seconds(c.snapshot_s) << ", write " << format_seconds(c.write_s)
        << ")" << "\n";
  } else if (checkpointer) {
    out << "saved: " << (fs::path(o.save) / io::step_dir_name(eng.step())).string()
        << " already holds step " << eng.step() << " (resumed from it; no step ran)\n";
  } else if (!o.save.empty()) {
    out << "saved: " << o.save << " (step " << eng.step() << ")"
        << (w.distributed() ? ", one rank<r> folder per rank" : "") << "\n";
  }
  if (hf_export) {
    out << "saved Hugging Face model: " << o.save_hf << " (step " << eng.step() << "; "
        << hf_export->config_file.filename().string() << ", "
        << hf_export->weights_file.filename().string() << ": " << hf_export->tensors
        << " tensors, " << format_count(static_cast<double>(hf_export->num_params))
        << " parameters, " << tensor::dtype_name(eng.compute_dtype()) << ", "
        << format_bytes(hf_export->bytes) << ")\n";
  }
  return stopped_by != 0 ? kExitPreempted : kExitOk;
}

}  // namespace

void add_train_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the built-in GPT as a JSON config says");
  add_config_options(cmd, o->config_args, "The JSON config (DeepSpeed keys plus \"porter\")");
  cmd->add_option("--nproc", o->nproc,
                  "Train on N local ranks: porter launch -n N -- porter train ... (without --nproc)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--steps", o->steps, "Train until this many steps are done (default porter.train.steps)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->add_option("--report", o->report, "Write a JSON report of the run to this file");
  cmd->add_option("--trace", o->trace,
                  "Write a Chrome/Perfetto trace to this file (default porter.trace.path); with "
                  "several ranks, one file with every rank as a process");
  cmd->add_option("--trace-rank", o->trace_rank,
                  "With several ranks, keep only this rank's events in the --trace file")
      ->check(CLI::Range(0, 4095));
  cmd->add_option("--memory-page", o->memory_page,
                  "Write the last step's memory, measured and predicted, as one HTML page");
  cmd->add_option("--dump-dir", o->dump_dir,
                  "Dump the last step's parameters, gradients and inputs as .npy (docs/dump-format.md)");
  cmd->add_option("--save", o->save,
                  "Save a training checkpoint to this directory at the end (with --save-every, "
                  "DIR/step-<N> every N steps, DIR/latest naming the newest)");
  cmd->add_option("--save-every", o->save_every,
                  "With --save: a checkpoint every N steps and at the end (porter.train.save_every)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--resume", o->resume,
                  "Resume from a training checkpoint, or from the newest good one of a --save "
                  "run directory");
  cmd->add_option("--max-restarts", o->max_restarts,
                  "With --nproc: start the world again after a rank fails, at most N times, "
                  "from --save's latest checkpoint")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--save-hf", o->save_hf,
                  "Write the trained model to this directory at the end as a Hugging Face model "
                  "(config.json and model.safetensors, in the compute dtype)")
      ->type_name("DIR");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->add_flag("--no-preflight", o->no_preflight,
                "Start even when the forecast total peak per rank exceeds the device's memory");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config or input, 3 out of "
              "memory, 5 stopped by SIGTERM or SIGINT after saving (resume with --resume); with "
              "--nproc, the code of the first rank that failed.");
  cmd->callback([o, &context] { context.exit_code = train(*o, context); });
}

}  // namespace porter::cli
