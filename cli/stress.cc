// The stress test's draws, runs and checks (Note [Stress limits] in stress.h).
#include "cli/stress.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include "base/error.h"
#include "base/units.h"
#include "models/analytic.h"
#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
#include "cli/common.h"
#include "engine/run_options.h"
#include "config/parse.h"
#include "io/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "memory/device.h"

namespace porter::cli {
namespace {

using config::CheckpointPolicy;

// Note [Stress draws]
// A run's variation is a pure function of (base config, seed, run index), so one failing run
// is reproduced alone with `--seed S --first R --runs 1`. The stream is mt19937_64 seeded
// through std::seed_seq with the four 32-bit halves of (seed, run); both are specified
// exactly by the C++ standard. Draws use `% n` rather than std::uniform_int_distribution,
// whose algorithm is left to each standard library: the same seed must give the same run
// with libstdc++ and libc++. The draws scale the base model down (at most 4 layers, 4 heads,
// head size 32, sequence 64, micro-batch 4, 2 micro-batches per step) so that a run takes
// well under a second on the cpu device; what the stress exercises is the engine's memory
// behaviour, which small models reach as well as large ones.
class Draw {
 public:
  Draw(uint64_t seed, int64_t run) {
    const uint64_t r = static_cast<uint64_t>(run);
    std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(r), static_cast<uint32_t>(r >> 32)};
    rng_.seed(seq);
  }
  // Uniform in [lo, hi] (hi >= lo).
  int64_t integer(int64_t lo, int64_t hi) {
    const uint64_t n = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(rng_() % n);
  }
  bool coin() { return (rng_() >> 63) != 0; }
  double unit() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }  // [0, 1)

 private:
  std::mt19937_64 rng_;
};

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// The fraction of the none plan's activation peak below which the optimal planner has no
// schedule (from the analytic model, whose bytes are the profiled ones: docs/memory-model.md).
double minimum_budget_fraction(const config::Config& cfg) {
  const engine::RunOptions run = engine::make_run_options(cfg);
  const checkpoint::ChainCosts costs = run.analytic_costs();
  const size_t none = checkpoint::simulate(checkpoint::schedule_none(costs), costs,
                                           run.plan.offload.sim())
                          .peak_activation_bytes;
  const size_t min = checkpoint::minimum_budget_bytes(costs, run.plan.offload);
  return none > 0 ? std::min(1.0, static_cast<double>(min) / static_cast<double>(none)) : 1.0;
}

// The reference of a variation: no memory limit, policy none, no offload.
config::Config reference_config(const config::Config& cfg) {
  config::Config ref = cfg;
  config::CheckpointingConfig& k = ref.porter.checkpointing;
  k.policy = CheckpointPolicy::kNone;
  k.every_n_layers.reset();
  k.segments.reset();
  k.block_layers.reset();
  k.memory_budget.reset();
  if (ref.activation_checkpointing) {
    ref.activation_checkpointing->cpu_checkpointing = false;
    ref.activation_checkpointing->contiguous_memory_optimization = false;
  }
  ref.porter.device.memory_limit_bytes.reset();
  return ref;
}

config::Config with_limit(const config::Config& cfg, std::optional<size_t> limit_bytes) {
  config::Config c = cfg;
  if (limit_bytes) {
    c.porter.device.memory_limit_bytes = *limit_bytes;
  } else {
    c.porter.device.memory_limit_bytes.reset();
  }
  return c;
}

// A fresh device and an Engine on it (members are destroyed in reverse: the engine first).
struct Rig {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<engine::Engine> engine;
  explicit Rig(const config::Config& cfg) {
    device = memory::make_device(engine::make_run_options(cfg).device);
    engine = std::make_unique<engine::Engine>(
        *device, std::make_unique<engine::TransformerModel>(cfg.porter.model), cfg);
  }
};

struct Baseline {
  size_t requested_bytes = 0;
  size_t pinned_in_use_bytes = 0;
};

Baseline baseline_of(engine::Engine& e) {
  return {e.allocator().stats().requested_bytes, e.pinned_pool().stats().in_use_bytes};
}

// Empty when `e` is back at `b`, else what differs.
std::string baseline_drift(engine::Engine& e, const Baseline& b) {
  const Baseline now = baseline_of(e);
  std::string s;
  if (now.requested_bytes != b.requested_bytes) {
    s += "allocator requested " + std::to_string(now.requested_bytes) + " B, baseline " +
         std::to_string(b.requested_bytes) + " B";
  }
  if (now.pinned_in_use_bytes != b.pinned_in_use_bytes) {
    s += std::string(s.empty() ? "" : "; ") + "pinned in use " +
         std::to_string(now.pinned_in_use_bytes) + " B, baseline " +
         std::to_string(b.pinned_in_use_bytes) + " B";
  }
  // The books balance: the categories sum to the requested total.
  const memory::MemoryStats st = e.allocator().stats();
  size_t sum = 0;
  for (const memory::CategoryStats& c : st.by_category) sum += c.current_bytes;
  if (sum != st.requested_bytes) {
    s += std::string(s.empty() ? "" : "; ") + "categories sum to " + std::to_string(sum) +
         " B, requested " + std::to_string(st.requested_bytes) + " B";
  }
  return s;
}

std::string describe(const config::Config& c) {
  const config::ModelConfig& m = c.porter.model;
  const config::CheckpointingConfig& k = c.porter.checkpointing;
  std::string s = "L" + std::to_string(m.layers) + " H" + std::to_string(m.hidden) + "/" +
                  std::to_string(m.heads) + " T" + std::to_string(m.seq_len) + " B" +
                  std::to_string(c.train_micro_batch_size_per_gpu) + "x" +
                  std::to_string(c.gradient_accumulation_steps);
  if (m.dropout > 0) s += " drop" + fixed(m.dropout, 2);
  s += " | " + std::string(config::to_string(k.policy));
  switch (k.policy) {
    case CheckpointPolicy::kUniform: s += "/" + std::to_string(k.every_n_layers.value_or(0)); break;
    case CheckpointPolicy::kBlock: s += "/" + std::to_string(k.block_layers.value_or(0)); break;
    case CheckpointPolicy::kSelective:
      for (const std::string& op : k.selective_ops) s += " " + op;
      break;
    case CheckpointPolicy::kOptimal:
      if (k.memory_budget && k.memory_budget->is_fraction()) {
        s += "@" + fixed(std::get<double>(k.memory_budget->value), 2);
      }
      break;
    default: break;
  }
  const auto& ac = c.activation_checkpointing;
  if (ac && ac->cpu_checkpointing) {
    s += " | offload d" + std::to_string(k.prefetch_depth) + " k" +
         std::to_string(k.keep_last_on_device);
  }
  if (ac && ac->contiguous_memory_optimization) s += " contiguous";
  return s;
}

}  // namespace

size_t limit_margin(size_t predicted_peak_bytes) {
  return predicted_peak_bytes + kMarginBytes +
         static_cast<size_t>(kMarginFraction * static_cast<double>(predicted_peak_bytes));
}

Variation draw_variation(const config::Config& base, uint64_t seed, int64_t run) {
  Draw d(seed, run);
  config::Config c = base;
  config::ModelConfig& m = c.porter.model;
  const config::ModelConfig& b = base.porter.model;
  m.layers = d.integer(1, std::min<int64_t>(b.layers, 4));
  m.heads = d.integer(1, std::min<int64_t>(b.heads, 4));
  const int64_t head_max = std::min<int64_t>(b.hidden / b.heads, 32);
  m.hidden = m.heads * (head_max >= 4 ? 4 * d.integer(1, head_max / 4) : head_max);
  m.seq_len = d.integer(std::min<int64_t>(b.seq_len, 8), std::min<int64_t>(b.seq_len, 64));
  m.dropout = d.coin() ? b.dropout : 0.1;
  c.train_micro_batch_size_per_gpu =
      d.integer(1, std::min<int64_t>(base.train_micro_batch_size_per_gpu, 4));
  c.gradient_accumulation_steps = std::min<int64_t>(base.gradient_accumulation_steps, 2);
  c.train_batch_size = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps *
                       c.data_parallel_size();
  // Synthetic tokens: memory does not depend on their values, and the stress then needs no
  // files and runs from any directory.
  c.porter.data = config::DataConfig{};
  c.porter.data.seed = base.porter.data.seed;
  c.porter.trace.path.reset();
  c.porter.device.memory_limit_bytes.reset();

  config::CheckpointingConfig& k = c.porter.checkpointing;
  k.every_n_layers.reset();
  k.segments.reset();
  k.block_layers.reset();
  k.memory_budget.reset();
  k.selective_ops.clear();
  if (!c.activation_checkpointing) c.activation_checkpointing.emplace();
  config::ActivationCheckpointingConfig& ac = *c.activation_checkpointing;
  ac.partition_activations = false;
  ac.synchronize_checkpoint_boundary = false;
  ac.profile = false;
  constexpr CheckpointPolicy kPolicies[] = {
      CheckpointPolicy::kNone,  CheckpointPolicy::kFull,      CheckpointPolicy::kUniform,
      CheckpointPolicy::kBlock, CheckpointPolicy::kSqrt,      CheckpointPolicy::kSelective,
      CheckpointPolicy::kOptimal};
  k.policy = kPolicies[d.integer(0, 6)];
  const bool stores = k.policy != CheckpointPolicy::kNone;
  ac.cpu_checkpointing = stores && d.coin();
  ac.contiguous_memory_optimization = stores && d.coin();
  k.prefetch_depth = d.integer(0, 3);
  k.keep_last_on_device = d.integer(0, 1);
  switch (k.policy) {
    case CheckpointPolicy::kUniform: k.every_n_layers = d.integer(1, m.layers); break;
    case CheckpointPolicy::kBlock: k.block_layers = d.integer(1, m.layers); break;
    case CheckpointPolicy::kSelective: {
      // Core attention (the default, drawn twice as often), or one other op kind. Not
      // "dropout" alone: its output is saved for the next op anyway, so recomputing it saves
      // nothing and the planner rejects the policy (no block has a selective option).
      std::vector<std::string> kinds;
      for (const std::string& kind : config::selective_op_kinds()) {
        if (kind != "dropout") kinds.push_back(kind);
      }
      kinds.push_back("core_attention");
      k.selective_ops = {kinds[static_cast<size_t>(d.integer(0, static_cast<int64_t>(kinds.size()) - 1))]};
      break;
    }
    case CheckpointPolicy::kOptimal: {
      // A fraction between the feasible minimum (plus 5% of the gap, so that rounding of the
      // fraction never drops below it) and 1.
      const double lo = minimum_budget_fraction(c);
      const double f = lo + (1.0 - lo) * (0.05 + 0.95 * d.unit());
      k.memory_budget = config::MemoryBudget{std::min(1.0, f)};
      break;
    }
    default: break;
  }

  Variation v;
  v.run = run;
  v.check_below = run % kBelowEvery == kBelowEvery - 1;
  // Re-parsed, so the variation is a config porter accepts, with everything resolved.
  try {
    v.config = config::parse_config_string(config::to_json_string(c),
                                           config::ParseOptions{base.world_size, false})
                   .config;
  } catch (const porter::Error& e) {
    throw InternalError("porter stress: run " + std::to_string(run) +
                        " drew a config porter rejects (a bug in the draws): " + e.what());
  }
  v.label = describe(v.config);
  return v;
}

double RunResult::activation_error() const {
  if (predicted_activation_bytes == 0 || measured_activation_bytes == 0) return 0.0;
  return (static_cast<double>(measured_activation_bytes) -
          static_cast<double>(predicted_activation_bytes)) /
         static_cast<double>(predicted_activation_bytes);
}

double RunResult::total_error() const {
  if (predicted_peak_bytes == 0 || measured_peak_bytes == 0) return 0.0;
  return (static_cast<double>(measured_peak_bytes) - static_cast<double>(predicted_peak_bytes)) /
         static_cast<double>(predicted_peak_bytes);
}

int64_t StressSummary::passed() const {
  return std::count_if(runs.begin(), runs.end(), [](const RunResult& r) { return r.passed; });
}

const RunResult* StressSummary::worst_activation() const {
  const RunResult* w = nullptr;
  for (const RunResult& r : runs) {
    if (r.measured_activation_bytes == 0) continue;
    if (!w || std::abs(r.activation_error()) > std::abs(w->activation_error())) w = &r;
  }
  return w;
}

const RunResult* StressSummary::worst_total() const {
  const RunResult* w = nullptr;
  for (const RunResult& r : runs) {
    if (r.measured_peak_bytes == 0) continue;
    if (!w || std::abs(r.total_error()) > std::abs(w->total_error())) w = &r;
  }
  return w;
}

RunResult run_variation(const Variation& v, int64_t steps) {
  const auto t0 = std::chrono::steady_clock::now();
  RunResult res;
  res.variation = v;
  const config::Config& cfg = v.config;
  const int64_t micro_batches = cfg.gradient_accumulation_steps;
  auto fail = [&](const std::string& what) { res.failures.push_back(what); };
  auto done = [&] {
    res.passed = res.failures.empty();
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return res;
  };
  const io::DataSource data(cfg.porter.data, cfg.porter.model.vocab,
                                cfg.train_micro_batch_size_per_gpu, cfg.porter.model.seq_len);

  // Reference.
  std::vector<double> ref_losses;
  std::vector<float> ref_params;
  try {
    Rig ref(reference_config(cfg));
    for (int64_t s = 0; s < steps; ++s) {
      ref_losses.push_back(ref.engine->train_step(data.step_batches(s, micro_batches)).loss);
    }
    ref_params = ref.engine->params_host();
  } catch (const porter::Error& e) {
    fail("reference run (policy none, no limit): " + first_line(e.what()));
    return done();
  }

  // Probe: the engine's prediction and plan without a limit.
  checkpoint::Plan plan;
  try {
    Rig probe(with_limit(cfg, std::nullopt));
    const engine::MemoryReport mem = probe.engine->memory_report();
    res.predicted_peak_bytes = mem.predicted_peak_bytes;
    res.predicted_activation_bytes = mem.predicted_activation_bytes;
    plan = probe.engine->plan();
    res.offloaded_bytes = plan.offload.offloaded_bytes;
  } catch (const porter::Error& e) {
    fail("building the engine without a limit: " + first_line(e.what()));
    return done();
  }

  // Constrained.
  res.limit_bytes = limit_margin(res.predicted_peak_bytes);
  const std::string at_limit = " under a limit of " + std::to_string(res.limit_bytes) +
                               " B (predicted peak " +
                               std::to_string(res.predicted_peak_bytes) + " B + margin)";
  try {
    Rig rig(with_limit(cfg, res.limit_bytes));
    engine::Engine& e = *rig.engine;
    if (!(e.plan().schedule == plan.schedule)) {
      e.set_plan(plan);
      res.replanned = true;
    }
    const Baseline base = baseline_of(e);
    e.reset_peaks();
    const size_t d2h = plan.prediction.offload.d2h_bytes * static_cast<size_t>(micro_batches);
    const size_t h2d = plan.prediction.offload.h2d_bytes * static_cast<size_t>(micro_batches);
    for (int64_t s = 0; s < steps; ++s) {
      const engine::StepResult r = e.train_step(data.step_batches(s, micro_batches));
      const std::string step = "step " + std::to_string(s + 1) + ": ";
      const double ref_loss = ref_losses[static_cast<size_t>(s)];
      if (std::bit_cast<uint64_t>(r.loss) != std::bit_cast<uint64_t>(ref_loss)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "loss %.17g differs from the reference's %.17g", r.loss,
                      ref_loss);
        fail(step + buf);
      }
      if (const std::string drift = baseline_drift(e, base); !drift.empty()) {
        fail(step + "not back at the baseline after the step: " + drift);
      }
      if (r.offload.d2h_bytes != d2h || r.offload.h2d_bytes != h2d) {
        fail(step + "copied " + std::to_string(r.offload.d2h_bytes) + " B to the host and " +
             std::to_string(r.offload.h2d_bytes) + " B back; the plan says " +
             std::to_string(d2h) + " and " + std::to_string(h2d));
      }
    }
    const std::vector<float> params = e.params_host();
    if (params.size() != ref_params.size() ||
        std::memcmp(params.data(), ref_params.data(), params.size() * sizeof(float)) != 0) {
      fail("the parameters after step " + std::to_string(steps) +
           " differ from the reference's");
    }
    const engine::MemoryReport mem = e.memory_report();
    res.measured_peak_bytes = mem.peak_bytes;
    res.measured_activation_bytes = mem.peak_activation_bytes;
    res.reserved_peak_bytes = e.allocator().stats().peak_reserved_bytes;
    // The prediction counts every requested byte (model states, batch, activations,
    // checkpoints, staging, workspace, gathered parameters, gradient buckets): no margin.
    if (res.measured_peak_bytes != res.predicted_peak_bytes) {
      fail("measured total peak " + std::to_string(res.measured_peak_bytes) +
           " B requested, predicted " + std::to_string(res.predicted_peak_bytes) + " B");
    }
    if (res.measured_peak_bytes > res.limit_bytes || res.reserved_peak_bytes > res.limit_bytes) {
      fail("measured peak " + std::to_string(res.measured_peak_bytes) + " B requested, " +
           std::to_string(res.reserved_peak_bytes) + " B reserved, over the limit " +
           std::to_string(res.limit_bytes) + " B");
    }
  } catch (const OutOfMemoryError& e) {
    fail("out of memory" + at_limit + ": " + first_line(e.what()));
    return done();
  } catch (const porter::Error& e) {
    fail("constrained run" + at_limit + ": " + first_line(e.what()));
    return done();
  }

  // Below the measured peak: must run out of memory, cleanly.
  if (v.check_below && res.measured_peak_bytes > kBelowBytes) {
    const size_t limit = res.measured_peak_bytes - kBelowBytes;
    res.below_limit_bytes = limit;
    std::unique_ptr<Rig> rig;
    try {
      rig = std::make_unique<Rig>(with_limit(cfg, limit));
      if (!(rig->engine->plan().schedule == plan.schedule)) rig->engine->set_plan(plan);
    } catch (const OutOfMemoryError&) {
      res.below_outcome = "out of memory at construction";
    } catch (const porter::Error& e) {
      fail("below the peak (limit " + std::to_string(limit) + " B), at construction: " +
           first_line(e.what()));
    }
    if (rig) {
      engine::Engine& e = *rig->engine;
      const Baseline base = baseline_of(e);
      const int64_t step_before = e.step();
      try {
        for (int64_t s = 0; s < steps && res.below_outcome.empty(); ++s) {
          try {
            e.train_step(data.step_batches(s, micro_batches));
          } catch (const OutOfMemoryError&) {
            res.below_outcome = "out of memory in step " + std::to_string(s + 1);
            if (e.step() != step_before + s) {
              fail("below the peak: the failed step " + std::to_string(s + 1) +
                   " advanced the engine to step " + std::to_string(e.step()));
            }
            if (const std::string drift = baseline_drift(e, base); !drift.empty()) {
              fail("below the peak: after out of memory in step " + std::to_string(s + 1) +
                   ", not back at the baseline: " + drift);
            }
          }
        }
        if (res.below_outcome.empty()) {
          fail("below the peak: " + std::to_string(steps) + " steps ran under a limit of " +
               std::to_string(limit) + " B, below the measured requested peak of " +
               std::to_string(res.measured_peak_bytes) + " B");
        }
      } catch (const porter::Error& ex) {
        fail("below the peak (limit " + std::to_string(limit) + " B): not out of memory but: " +
             first_line(ex.what()));
      }
    }
  }
  return done();
}

StressSummary run_stress(const config::Config& base, const StressOptions& o,
                         const std::function<void(const RunResult&)>& on_run) {
  StressSummary summary;
  for (int64_t r = o.first; r < o.first + o.runs; ++r) {
    summary.runs.push_back(run_variation(draw_variation(base, o.seed, r), o.steps));
    if (on_run) on_run(summary.runs.back());
  }
  return summary;
}

}  // namespace porter::cli
