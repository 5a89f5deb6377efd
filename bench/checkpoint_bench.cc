// Each checkpoint policy's training-step time relative to `none`, and its activation peak,
// on the GPT step model of bench/gpt_step_bench.cc (layers 6, hidden 768, heads 12, seq 512,
// micro-batch 4, vocab 8192, f32, dropout 0, 2 threads). A step here is Engine::train_step:
// forward, recompute, backward and AdamW; bench/compare_checkpoint.sh runs PyTorch 1.13's
// torch.utils.checkpoint on the same model and step, and prints the ratios side by side.
//
// Counters per policy: peak_act_MiB (measured footprint peak), predicted_act_MiB (the
// plan's), recompute_s (measured per step) and predicted_recompute_s. "optimal@half" runs at
// half of the `none` peak, and "uniform@half" is the fastest uniform plan whose peak fits
// that same budget, for a like-for-like comparison. BM_Policy/* time one policy after
// another; BM_Interleaved times them round-robin, which is what the ratios should come from
// on a noisy machine.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_engine.h"
#include "checkpoint/planner.h"
#include "config/parse.h"
#include "io/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "memory/device.h"

namespace {

using namespace porter;

int bench_threads() {
  const char* s = std::getenv("PORTER_BENCH_THREADS");
  return s != nullptr ? std::atoi(s) : 2;
}

config::Config bench_config(const std::string& checkpointing) {
  const std::string json = R"({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "porter": {
      "model": {"layers": 6, "hidden": 768, "heads": 12, "seq_len": 512, "vocab": 8192,
                "dropout": 0.0},
      "device": {"type": "cpu", "memory_limit": "12GiB", "threads": )" +
                           std::to_string(bench_threads()) + R"(},
      "checkpointing": )" + checkpointing + R"(
    }})";
  return config::parse_config_string(json).config;
}

using Run = bench::EngineRun;

Run make_run(const config::Config& cfg) { return bench::make_engine_run(cfg); }

// The `none` plan's predicted peak (analytic bytes are exact), for the half budget.
size_t none_peak() {
  static const size_t peak = [] {
    Run r = make_run(bench_config(R"({"policy": "none"})"));
    return r.engine->plan().prediction.peak_activation_bytes;
  }();
  return peak;
}

void run_policy(benchmark::State& state, const config::Config& cfg,
                std::optional<checkpoint::Plan> plan = std::nullopt) {
  Run r = make_run(cfg);
  if (plan) r.engine->set_plan(*plan);
  int64_t step = 0;
  r.engine->train_step(r.data->step_batches(step++, 1));  // warm-up (oneDNN primitives)
  double recompute = 0.0;
  size_t peak = 0;
  int n = 0;
  for (auto _ : state) {
    engine::StepResult s = r.engine->train_step(r.data->step_batches(step++, 1));
    recompute += s.recompute_s;
    peak = std::max(peak, s.peak_activation_bytes);
    ++n;
  }
  const checkpoint::Plan& p = r.engine->plan();
  state.counters["peak_act_MiB"] = static_cast<double>(peak) / (1 << 20);
  state.counters["predicted_act_MiB"] =
      static_cast<double>(p.prediction.peak_activation_bytes) / (1 << 20);
  state.counters["recompute_s"] = n > 0 ? recompute / n : 0.0;
  state.counters["predicted_recompute_s"] = p.prediction.recompute_s;
  state.SetLabel(p.description);
}

void BM_Policy(benchmark::State& state, const std::string& checkpointing) {
  run_policy(state, bench_config(checkpointing));
}

// The fastest uniform plan (any segment size) whose predicted peak fits half the none peak.
std::optional<checkpoint::Plan> uniform_at_half(const config::Config& cfg) {
  const size_t budget = none_peak() / 2;
  std::optional<checkpoint::Plan> best;
  Run probe = make_run(cfg);  // profiled costs
  const checkpoint::ChainCosts& costs = probe.engine->costs();
  for (int k = 1; k <= static_cast<int>(cfg.porter.model.layers); ++k) {
    checkpoint::Plan p;
    p.policy = config::CheckpointPolicy::kUniform;
    p.schedule = checkpoint::schedule_uniform(costs, k);
    p.prediction = checkpoint::simulate(p.schedule, costs);
    p.stages = checkpoint::summarize(p.schedule, costs);
    p.description = "uniform, " + std::to_string(k) + " blocks per segment";
    if (p.prediction.peak_activation_bytes > budget) continue;
    if (!best || p.prediction.compute_s < best->prediction.compute_s) best = p;
  }
  return best;
}

void BM_UniformAtHalf(benchmark::State& state) {
  const config::Config cfg = bench_config(R"({"policy": "full"})");
  std::optional<checkpoint::Plan> best = uniform_at_half(cfg);
  if (!best) {
    state.SkipWithError("no uniform plan fits half of the none peak");
    return;
  }
  run_policy(state, cfg, best);
}

std::string optimal_at_half() {
  return R"({"policy": "optimal", "memory_budget": )" + std::to_string(none_peak() / 2) + "}";
}

void BM_OptimalAtHalf(benchmark::State& state) { run_policy(state, bench_config(optimal_at_half())); }

const std::vector<std::pair<std::string, std::string>>& policies() {
  static const std::vector<std::pair<std::string, std::string>> p = {
      {"none", R"({"policy": "none"})"},
      {"full", R"({"policy": "full"})"},
      {"uniform_3", R"({"policy": "uniform", "every_n_layers": 3})"},
      {"block_3", R"({"policy": "block", "block_layers": 3})"},
      {"sqrt", R"({"policy": "sqrt"})"},
      {"selective", R"({"policy": "selective"})"},
  };
  return p;
}

using bench::median;

// Every policy side by side: each iteration is one round of one step per policy, the order
// rotated every round, so that machine noise hits all policies alike. Counters per policy:
// <name>_s, the median step time, and <name>_x, the median over rounds of the step time
// divided by `none`'s in the same round.
void BM_Interleaved(benchmark::State& state) {
  std::vector<std::string> names;
  std::vector<Run> runs;
  for (const auto& [name, ck] : policies()) {
    names.push_back(name);
    runs.push_back(make_run(bench_config(ck)));
  }
  const config::Config full = bench_config(R"({"policy": "full"})");
  if (std::optional<checkpoint::Plan> u = uniform_at_half(full)) {
    names.push_back("uniform@half");
    runs.push_back(make_run(full));
    runs.back().engine->set_plan(*u);
  }
  names.push_back("optimal@half");
  runs.push_back(make_run(bench_config(optimal_at_half())));
  const size_t n = runs.size();
  int64_t step = 0;
  for (Run& r : runs) r.engine->train_step(r.data->step_batches(step, 1));  // warm-up
  std::vector<std::vector<double>> times(n), ratios(n);
  size_t round = 0;
  for (auto _ : state) {
    ++step;
    std::vector<double> t(n);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = (j + round) % n;
      t[i] = runs[i].engine->train_step(runs[i].data->step_batches(step, 1)).time_s;
    }
    for (size_t i = 0; i < n; ++i) {
      times[i].push_back(t[i]);
      ratios[i].push_back(t[i] / t[0]);
    }
    ++round;
  }
  for (size_t i = 0; i < n; ++i) {
    state.counters[names[i] + "_s"] = median(times[i]);
    state.counters[names[i] + "_x"] = median(ratios[i]);
  }
}

void register_all() {
  for (const auto& [name, ck] : policies()) {
    benchmark::RegisterBenchmark(("BM_Policy/" + name).c_str(), BM_Policy, ck)
        ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3)->Repetitions(3)
        ->ReportAggregatesOnly(true);
  }
  benchmark::RegisterBenchmark("BM_Policy/uniform@half", BM_UniformAtHalf)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3)->Repetitions(3)
      ->ReportAggregatesOnly(true);
  benchmark::RegisterBenchmark("BM_Policy/optimal@half", BM_OptimalAtHalf)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3)->Repetitions(3)
      ->ReportAggregatesOnly(true);
  benchmark::RegisterBenchmark("BM_Interleaved", BM_Interleaved)
      ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
