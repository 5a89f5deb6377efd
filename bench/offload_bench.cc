// Activation offload on the GPT step model of bench/gpt_step_bench.cc (layers 6, hidden 768,
// heads 12, seq 512, micro-batch 4, vocab 8192, f32, dropout 0, 2 threads): the step time
// with offload relative to without, the hidden fraction of the copies, and the device peak
// reduction, for `full` and `uniform` (2 blocks per segment), at simulated links of 4, 12 and
// 25 GB/s and unthrottled (a worker thread's memcpy), plus 0.25 and 1 GB/s, where a block's
// checkpoint copy starts to outlast compute it can hide behind.
//
// BM_Offload/<link> runs four engines side by side (full and uniform, offload off and on),
// one step each per round, the order rotated every round, and reports medians over rounds:
//   <policy>_off_s, <policy>_on_s   step times
//   <policy>_x                      on / off in the same round (the offload overhead)
//   <policy>_hidden                 1 - exposed wait / copy busy time (measured)
//   <policy>_pred_hidden            the planner's prediction of the same
//   <policy>_ckpt_saved_MiB         device checkpoint bytes offload saves (measured peak of
//                                   `checkpoints` off minus on)
//   <policy>_act_peak_off_MiB, <policy>_act_peak_on_MiB   activation footprint peaks
//   fwd_over_copy                   a block's forward time / its checkpoint's copy time
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_engine.h"
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

config::Config bench_config(const std::string& checkpointing, bool offload, double link_gbps) {
  const std::string link = link_gbps > 0 ? R"(, "sim_link_gbps": )" + std::to_string(link_gbps) : "";
  const std::string json = R"({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "activation_checkpointing": {"cpu_checkpointing": )" + std::string(offload ? "true" : "false") +
                           R"(},
    "porter": {
      "model": {"layers": 6, "hidden": 768, "heads": 12, "seq_len": 512, "vocab": 8192,
                "dropout": 0.0},
      "device": {"type": "cpu", "memory_limit": "12GiB", "pinned_limit": "4GiB", "threads": )" +
                           std::to_string(bench_threads()) + link + R"(},
      "checkpointing": )" + checkpointing + R"(
    }})";
  return config::parse_config_string(json).config;
}

using Run = bench::EngineRun;

Run make_run(const config::Config& cfg) { return bench::make_engine_run(cfg); }

using bench::median;

constexpr double kMiB = 1 << 20;

void BM_Offload(benchmark::State& state, double link_gbps) {
  struct Policy {
    std::string name;
    std::string checkpointing;
  };
  const std::vector<Policy> policies = {
      {"full", R"({"policy": "full"})"},
      {"uniform", R"({"policy": "uniform", "every_n_layers": 2})"},
  };
  // runs[2p] is policy p without offload, runs[2p + 1] with it.
  std::vector<Run> runs;
  for (const Policy& p : policies) {
    runs.push_back(make_run(bench_config(p.checkpointing, false, link_gbps)));
    runs.push_back(make_run(bench_config(p.checkpointing, true, link_gbps)));
  }
  const size_t n = runs.size();
  int64_t step = 0;
  for (Run& r : runs) {
    r.engine->train_step(r.data->step_batches(step, 1));  // warm-up (oneDNN primitives)
    r.engine->reset_peaks();
  }
  std::vector<std::vector<double>> times(n), hidden(n);
  std::vector<size_t> ckpt_peak(n, 0), act_peak(n, 0);
  size_t round = 0;
  for (auto _ : state) {
    ++step;
    for (size_t j = 0; j < n; ++j) {
      const size_t i = (j + round) % n;
      const engine::StepResult s = runs[i].engine->train_step(runs[i].data->step_batches(step, 1));
      times[i].push_back(s.time_s);
      if (i % 2 == 1) hidden[i].push_back(s.offload.hidden_fraction());
      act_peak[i] = std::max(act_peak[i], s.peak_activation_bytes);
    }
    ++round;
  }
  for (size_t i = 0; i < n; ++i) {
    const engine::MemoryReport m = runs[i].engine->memory_report();
    ckpt_peak[i] = m.peak_by_category[memory::index_of(memory::Category::kCheckpoints)];
  }
  for (size_t p = 0; p < policies.size(); ++p) {
    const std::string& name = policies[p].name;
    const size_t off = 2 * p, on = 2 * p + 1;
    std::vector<double> ratio;
    for (size_t k = 0; k < times[off].size(); ++k) ratio.push_back(times[on][k] / times[off][k]);
    state.counters[name + "_off_s"] = median(times[off]);
    state.counters[name + "_on_s"] = median(times[on]);
    state.counters[name + "_x"] = median(ratio);
    state.counters[name + "_hidden"] = median(hidden[on]);
    const checkpoint::Plan& plan = runs[on].engine->plan();
    state.counters[name + "_pred_hidden"] = plan.prediction.offload.hidden_fraction();
    state.counters[name + "_ckpt_saved_MiB"] =
        (static_cast<double>(ckpt_peak[off]) - static_cast<double>(ckpt_peak[on])) / kMiB;
    state.counters[name + "_act_peak_off_MiB"] = static_cast<double>(act_peak[off]) / kMiB;
    state.counters[name + "_act_peak_on_MiB"] = static_cast<double>(act_peak[on]) / kMiB;
  }
  // A block's forward time against its checkpoint's copy at the link the planner used.
  const engine::Engine& e = *runs[1].engine;
  const checkpoint::ChainCosts& costs = e.costs();
  for (const checkpoint::StageCost& st : costs.stages) {
    if (!st.is_block) continue;
    const double copy_s = static_cast<double>(st.input_bytes) / e.link_bytes_per_s();
    state.counters["fwd_over_copy"] =
        st.option(checkpoint::SaveOption::kCheckpoint).forward_s / copy_s;
    state.counters["link_GBps"] = e.link_bytes_per_s() / 1e9;
    break;
  }
  state.SetLabel(link_gbps > 0 ? std::to_string(link_gbps).substr(0, 4) + " GB/s simulated"
                               : "unthrottled");
}

}  // namespace

int main(int argc, char** argv) {
  for (double link : {0.25, 1.0, 4.0, 12.0, 25.0, 0.0}) {
    const std::string name =
        link > 0 ? "BM_Offload/" + std::to_string(link).substr(0, 4) + "GBps" : "BM_Offload/unthrottled";
    benchmark::RegisterBenchmark(name.c_str(), BM_Offload, link)
        ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
