// Tensor parallelism (docs/tensor-parallel.md) over thread ranks, each rank its own cpu
// device with one kernel thread and a Gloo group on loopback:
// - BM_TpStep/t/sp/partition/prefetch: the GPT step time at t = 1, 2, 4, with and without
//   sequence parallelism, with and without partitioned checkpoints (policy full; prefetch 0
//   gathers each checkpoint on demand, the way DeepSpeed's synchronous gather does, prefetch 1
//   one segment ahead), and as counters the
//   per-rank activation peak (measured and the plan's prediction), the tp group's traffic and,
//   with partitioning, the gathers' busy and exposed time and the fraction hidden behind
//   recompute.
// - layer_KiB and korthikanti_layer_KiB: one block's activation bytes per rank, porter's
//   exact figure (f32) and Korthikanti et al.'s sbh(34 + 5as/h) family (16-bit accounting).
// One iteration runs every rank for warm-up plus timed steps; the reported time is the median
// timed step of rank 0.
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "bench/bench_engine.h"
#include "models/analytic.h"
#include "comm/communicator.h"

namespace porter::bench {
namespace {

constexpr int kWarmup = 1;
constexpr int kSteps = 4;

config::Config tp_bench_config(int t, bool sp, bool partition, int prefetch) {
  config::Config c;
  c.world_size = t;
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 4;
  c.gradient_clipping = 1.0;
  c.optimizer = config::OptimizerConfig{};
  c.porter.model.layers = 4;
  c.porter.model.hidden = 256;
  c.porter.model.heads = 8;
  c.porter.model.seq_len = 128;
  c.porter.model.vocab = 1024;
  c.porter.model.dropout = 0.1;
  c.porter.model.tensor_parallel = t;
  c.porter.model.sequence_parallel = sp;
  c.porter.device.threads = 1;
  c.porter.comm.timeout_s = 120.0;
  c.porter.checkpointing.policy = config::CheckpointPolicy::kFull;
  c.porter.checkpointing.prefetch_depth = prefetch;
  config::ActivationCheckpointingConfig ac;
  ac.partition_activations = partition;
  c.activation_checkpointing = ac;
  return c;
}

void BM_TpStep(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const bool sp = state.range(1) != 0;
  const bool partition = state.range(2) != 0;
  const int prefetch = static_cast<int>(state.range(3));
  const config::Config c = tp_bench_config(t, sp, partition, prefetch);
  for (auto _ : state) {
    std::vector<double> times;
    engine::TensorParallelStats tp;
    engine::MemoryReport mem;
    auto errors = comm::run_thread_ranks(t, [&](int rank, std::shared_ptr<comm::Store> store) {
      memory::DeviceOptions o;
      o.threads = 1;
      auto device = memory::make_device(o);
      comm::CommOptions co;
      co.timeout = comm::Seconds{c.porter.comm.timeout_s};
      std::shared_ptr<comm::Communicator> world =
          comm::make_communicator(*device, store, rank, t, co);
      comm::ProcessGroups g = comm::make_process_groups(world, t);
      engine::Engine e(*device, std::make_unique<engine::TransformerModel>(c.porter.model, g.tp_rank), c,
                       t > 1 ? g : engine::data_parallel(g.dp));
      const io::DataSource data(c.porter.data, c.porter.model.vocab,
                                    c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
      std::vector<double> mine;
      for (int s = 0; s < kWarmup + kSteps; ++s) {
        if (s == kWarmup) e.reset_peaks();
        const engine::StepResult r = e.train_step(data.rank_batches(s, 1, 0, 1));
        if (s >= kWarmup) mine.push_back(r.time_s);
      }
      if (rank == 0) {
        times = mine;
        tp = e.tp_stats();
        mem = e.memory_report();
      }
    });
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
    state.SetIterationTime(median(times));
    state.counters["act_peak_MiB"] = static_cast<double>(mem.peak_activation_bytes) / (1 << 20);
    state.counters["act_predicted_MiB"] =
        static_cast<double>(mem.predicted_activation_bytes) / (1 << 20);
    models::TransformerShape shape;
    shape.model = c.porter.model;
    shape.micro_batch = c.train_micro_batch_size_per_gpu;
    // One block kept with its input, porter's exact bytes and Korthikanti et al.'s formula
    // (16-bit accounting) for the same shape.
    state.counters["layer_KiB"] = static_cast<double>(models::layer_bytes(shape)) / 1024;
    state.counters["korthikanti_layer_KiB"] = models::korthikanti_layer_bytes(shape) / 1024;
    state.counters["tp_comm_MB_per_step"] = static_cast<double>(tp.comm_bytes) / kSteps / 1e6;
    state.counters["gather_busy_ms_per_step"] = tp.gather_busy_s / kSteps * 1e3;
    state.counters["gather_exposed_ms_per_step"] = tp.gather_exposed_s / kSteps * 1e3;
    state.counters["gather_hidden_fraction"] = tp.hidden_fraction;
  }
}
BENCHMARK(BM_TpStep)
    ->ArgNames({"t", "sp", "partition", "prefetch"})
    ->Args({1, 0, 0, 1})
    ->Args({2, 0, 0, 1})
    ->Args({2, 0, 1, 0})
    ->Args({2, 0, 1, 1})
    ->Args({2, 1, 0, 1})
    ->Args({4, 0, 0, 1})
    ->Args({4, 0, 1, 0})
    ->Args({4, 0, 1, 1})
    ->Args({4, 1, 0, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);

}  // namespace
}  // namespace porter::bench

BENCHMARK_MAIN();
