// `porter train --config F [--steps N] [--report FILE] [--trace FILE] [--dump-dir DIR]
// [--save DIR] [--resume DIR]`: trains the built-in GPT as the config says, with progress,
// a summary, and optional report, trace, tensor dump and training checkpoint.
#include <algorithm>
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
#include "cli/train_report.h"
#include "engine/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/trace.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;

struct TrainOptions {
  std::string file;
  std::optional<int64_t> steps;
  std::string report, trace, dump_dir, save, resume;
  bool strict = false;
};

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

int train(const TrainOptions& o, const CommandContext& ctx) {
  std::ostream& out = *ctx.out;
  std::ostream& err = *ctx.err;
  config::Config cfg = load_config(o.file, o.strict, err);
  if (o.steps) cfg.porter.train.steps = *o.steps;
  const std::string trace_path = !o.trace.empty() ? o.trace : cfg.porter.trace.path.value_or("");

  std::unique_ptr<memory::Device> device = memory::make_device(device_options(cfg));
  engine::DataSource data(cfg.porter.data, cfg.porter.model.vocab,
                          cfg.train_micro_batch_size_per_gpu, cfg.porter.model.seq_len);
  engine::Engine eng(*device, std::make_unique<engine::GptModel>(cfg.porter.model), cfg);
  std::unique_ptr<engine::TraceRecorder> trace;
  if (!trace_path.empty()) {
    trace = std::make_unique<engine::TraceRecorder>();
    eng.set_trace(trace.get());
  }
  if (!o.resume.empty()) eng.load_checkpoint(o.resume);

  TrainRun run;
  run.config_file = o.file;
  run.device = device->description();
  run.data = data.describe();
  run.start_step = eng.step();
  const int64_t last = cfg.porter.train.steps;
  const int64_t micro_batches = cfg.gradient_accumulation_steps;

  out << "porter train: " << o.file << "\n"
      << "  model: GPT, " << cfg.porter.model.layers << " layers, hidden " << cfg.porter.model.hidden
      << ", " << cfg.porter.model.heads << " heads, seq " << cfg.porter.model.seq_len << ", vocab "
      << cfg.porter.model.vocab << ": " << format_count(static_cast<double>(eng.model().layout().num_params()))
      << " parameters, " << nn::dtype_name(eng.compute_dtype()) << "\n"
      << "  data: " << run.data << "; " << micro_batches << " x " << cfg.train_micro_batch_size_per_gpu
      << " x " << cfg.porter.model.seq_len << " tokens per step\n"
      << "  device: " << run.device << "\n"
      << "  checkpointing: " << eng.plan().description << "\n";
  if (run.start_step > 0) out << "  resumed from " << o.resume << " at step " << run.start_step << "\n";
  out << std::flush;
  {
    const engine::MemoryReport mem = eng.memory_report();
    if (mem.capacity_bytes > 0 && mem.predicted_peak_bytes > mem.capacity_bytes) {
      err << "warning: the plan's predicted peak, " << format_bytes(mem.predicted_peak_bytes)
          << ", exceeds the device's " << format_bytes(mem.capacity_bytes)
          << "; expect out of memory (porter estimate --config " << o.file
          << " compares the policies)\n";
    }
  }

  Progress progress(err, ctx.err_is_tty, run.start_step, last, cfg.porter.train.log_every);
  std::vector<float> dump_params;
  eng.reset_peaks();  // peaks of the training steps, not of set-up or profiling
  const auto t0 = std::chrono::steady_clock::now();
  auto write_trace = [&] {
    if (trace) trace->write_file(trace_path);
  };
  try {
    while (eng.step() < last) {
      const int64_t step = eng.step();
      std::vector<engine::HostBatch> batches = data.step_batches(step, micro_batches);
      if (!o.dump_dir.empty() && step == last - 1) dump_params = eng.params_host();
      engine::StepResult r = eng.train_step(batches);
      run.steps.push_back(r);
      if (!std::isfinite(r.loss)) {
        progress.interrupt();
        err << "warning: step " << r.step << ": the loss is " << r.loss
            << "; lower the learning rate or enable gradient_clipping\n";
      }
      progress.step(r, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  } catch (...) {
    progress.interrupt();
    try {
      write_trace();
      if (trace) err << "trace (up to the error) written to " << trace_path << "\n";
    } catch (const porter::Error& e) {
      err << "warning: " << e.what() << "\n";
    }
    throw;
  }
  run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  print_summary(run, eng, out);
  if (!o.report.empty()) {
    std::ofstream f(o.report);
    f << train_report(run, eng).dump(2) << "\n";
    if (!f) throw IoError("--report: cannot write \"" + o.report + "\"");
    out << "\nreport: " << o.report << "\n";
  }
  if (trace) {
    write_trace();
    out << "trace: " << trace_path << " (open in ui.perfetto.dev or chrome://tracing)\n";
  }
  if (!o.dump_dir.empty()) {
    if (run.steps.empty()) {
      err << "warning: --dump-dir: no step ran, nothing dumped\n";
    } else {
      write_dump(o.dump_dir, eng, dump_params, run.steps.back());
      out << "dump: " << o.dump_dir << " (step " << run.steps.back().step - 1 << ")\n";
    }
  }
  if (!o.save.empty()) {
    eng.save_checkpoint(o.save);
    out << "saved: " << o.save << " (step " << eng.step() << ")\n";
  }
  return kExitOk;
}

}  // namespace

void add_train_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the built-in GPT as a JSON config says");
  cmd->add_option("--config", o->file, "The JSON config (DeepSpeed keys plus \"porter\")")->required();
  cmd->add_option("--steps", o->steps, "Train until this many steps are done (default porter.train.steps)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->add_option("--report", o->report, "Write a JSON report of the run to this file");
  cmd->add_option("--trace", o->trace, "Write a Chrome/Perfetto trace to this file (default porter.trace.path)");
  cmd->add_option("--dump-dir", o->dump_dir,
                  "Dump the last step's parameters, gradients and inputs as .npy (docs/dump-format.md)");
  cmd->add_option("--save", o->save, "Save a training checkpoint to this directory at the end");
  cmd->add_option("--resume", o->resume, "Resume from a training checkpoint directory");
  cmd->add_flag("--strict", o->strict, "Treat config warnings as errors");
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid config or input, 3 out of memory.");
  cmd->callback([o, &context] { context.exit_code = train(*o, context); });
}

}  // namespace porter::cli
