// GPT step time for ZeRO stages 0, 1 and 2 at world size 2 over thread ranks (each rank its
// own cpu device with one kernel thread and a Gloo communicator on loopback), with the
// communication figures as counters: comm bytes per step and rank, the time the compute
// stream waited on collectives, and the fraction of the gradient reductions' busy time hidden
// behind backward (docs/zero.md, "Stats"). One iteration runs every rank for warm-up plus
// timed steps; the reported time is the median timed step of rank 0.
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "bench/bench_engine.h"
#include "comm/communicator.h"

namespace porter::bench {
namespace {

constexpr int kWorld = 2;
constexpr int kWarmup = 2;
constexpr int kSteps = 6;

config::Config zero_bench_config(int stage, bool overlap) {
  config::Config c;
  c.world_size = kWorld;
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 4 * kWorld;
  c.gradient_clipping = 1.0;
  c.optimizer = config::OptimizerConfig{};
  c.porter.model.layers = 4;
  c.porter.model.hidden = 256;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = 128;
  c.porter.model.vocab = 1024;
  c.porter.model.dropout = 0.0;
  c.porter.device.threads = 1;
  c.porter.comm.timeout_s = 60.0;
  c.zero_optimization.stage = stage;
  c.zero_optimization.overlap_comm = overlap;
  c.zero_optimization.reduce_bucket_size_elems = 1'000'000;  // about one block per bucket
  return c;
}

void BM_ZeroStep(benchmark::State& state) {
  const int stage = static_cast<int>(state.range(0));
  const bool overlap = state.range(1) != 0;
  const config::Config c = zero_bench_config(stage, overlap);
  for (auto _ : state) {
    std::vector<double> times;
    engine::ZeroStats z;
    auto errors = comm::run_thread_ranks(kWorld, [&](int rank, std::shared_ptr<comm::Store> store) {
      memory::DeviceOptions o;
      o.threads = 1;
      auto device = memory::make_device(o);
      comm::CommOptions co;
      co.timeout = comm::Seconds{c.porter.comm.timeout_s};
      std::shared_ptr<comm::Communicator> dp =
          comm::make_communicator(*device, store, rank, kWorld, co);
      engine::Engine e(*device, std::make_unique<engine::TransformerModel>(c.porter.model), c,
                       engine::data_parallel(dp));
      const io::DataSource data(c.porter.data, c.porter.model.vocab,
                                    c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
      std::vector<double> mine;
      for (int s = 0; s < kWarmup + kSteps; ++s) {
        if (s == kWarmup) e.reset_peaks();
        const engine::StepResult r = e.train_step(data.rank_batches(s, 1, rank, kWorld));
        if (s >= kWarmup) mine.push_back(r.time_s);
      }
      if (rank == 0) {
        times = mine;
        z = e.zero_stats();
      }
    });
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
    state.SetIterationTime(median(times));
    state.counters["comm_MB_per_step"] = static_cast<double>(z.comm_bytes) / kSteps / 1e6;
    state.counters["comm_exposed_ms_per_step"] = z.comm_exposed_s / kSteps * 1e3;
    state.counters["comm_busy_ms_per_step"] = z.comm_busy_s / kSteps * 1e3;
    state.counters["reduce_hidden_fraction"] = z.reduce_hidden_fraction;
  }
}

BENCHMARK(BM_ZeroStep)
    ->ArgNames({"stage", "overlap"})
    ->ArgsProduct({{0, 1, 2}, {0, 1}})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace porter::bench

BENCHMARK_MAIN();
