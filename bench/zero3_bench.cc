// ZeRO stage 3 against stage 2 at world size 2 over thread ranks (each rank its own cpu
// devices with one kernel thread, Gloo on loopback): step time, the parameter gathers' busy
// and exposed time and hidden fraction, with prefetch on and off, and each rank's peak memory
// next to the gather plan's prediction (docs/zero.md, "Stage 3"; Note [Gather plan] in
// checkpoint/param_gather.h).
//
// Note [Interleaved session]
// One session runs every variant side by side: each rank thread builds one engine per variant
// (its own device and communicator, so memory is accounted per engine), warms them all up,
// then times rounds of one step per variant, the order rotated every round, so that machine
// noise hits all variants alike. A session is run once per repetition and shared: the k-th
// call of BM_Step/<v> or BM_Memory/<v> reads the k-th session, so the rows of one repetition
// come from the same interleaved steps. Before any figure is reported, the session checks
// that every variant's losses are bitwise those of stage 2 on both ranks (stage 3 gathers the
// same working copies that stage 2 all-gathers).
#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_engine.h"
#include "comm/communicator.h"

namespace porter::bench {
namespace {

constexpr int kWorld = 2;
constexpr int kWarmup = 2;
constexpr int kSteps = 6;
constexpr double kMiB = 1 << 20;

// One block is 12·256² + 13·256 ≈ 790k elements: a prefetch bucket and a reuse distance of
// 1M hold one block ahead and keep a recomputed block for its own backward, while a forward's
// block (read again only by a backward several blocks later) is freed.
constexpr int64_t kBlockSizedElems = 1'000'000;

config::Config base_config() {
  config::Config c;
  c.world_size = kWorld;
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 4 * kWorld;
  c.gradient_clipping = 1.0;
  c.optimizer = config::OptimizerConfig{};
  c.porter.model.layers = 8;
  c.porter.model.hidden = 256;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = 128;
  c.porter.model.vocab = 1024;
  c.porter.model.dropout = 0.0;
  c.porter.device.threads = 1;
  c.porter.comm.timeout_s = 120.0;
  c.porter.checkpointing.policy = config::CheckpointPolicy::kUniform;
  c.porter.checkpointing.every_n_layers = 2;
  c.zero_optimization.overlap_comm = true;
  c.zero_optimization.reduce_bucket_size_elems = kBlockSizedElems;
  return c;
}

struct Variant {
  std::string name;
  std::function<void(config::ZeroConfig&)> apply;
};

// The first is the reference that the others' losses and step-time ratios are taken against.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"stage2", [](config::ZeroConfig& z) { z.stage = 2; }},
      {"stage3", [](config::ZeroConfig& z) {
         z.stage = 3;
         z.stage3_prefetch_bucket_size_elems = kBlockSizedElems;
         z.stage3_max_reuse_distance_elems = kBlockSizedElems;
       }},
      {"stage3_no_prefetch", [](config::ZeroConfig& z) {
         z.stage = 3;
         z.stage3_prefetch_bucket_size_elems = 0;
         z.stage3_max_reuse_distance_elems = kBlockSizedElems;
       }},
      // Nothing kept or prefetched: a recomputed stage is gathered again for its backward.
      {"stage3_min", [](config::ZeroConfig& z) {
         z.stage = 3;
         z.stage3_prefetch_bucket_size_elems = 0;
         z.stage3_max_reuse_distance_elems = 0;
       }},
      // DeepSpeed's defaults (config::ZeroConfig's): prefetch 5e7, max_live and
      // max_reuse_distance 1e9, persistence 1e5.
      {"stage3_defaults", [](config::ZeroConfig& z) { z.stage = 3; }},
  };
  return v;
}

config::Config variant_config(const Variant& v) {
  config::Config c = base_config();
  v.apply(c.zero_optimization);
  return c;
}

struct VariantRun {
  std::vector<double> times_s;  // rank 0's timed steps
  std::vector<double> ratios;   // per round: this variant's step / the reference's
  engine::ZeroStats zero;       // rank 0, summed over the timed steps
  std::array<size_t, kWorld> peak_bytes{};
  std::array<size_t, kWorld> params_peak_bytes{};
  size_t grads_peak_bytes = 0;       // rank 0's, by category
  size_t optimizer_peak_bytes = 0;
  size_t activation_peak_bytes = 0;  // activations + checkpoints + staging
  checkpoint::ParamPrediction predicted;  // rank 0's plan
};

struct Session {
  std::vector<VariantRun> runs;  // per variant
  std::string error;             // non-empty: the check failed
};

// Note [Interleaved session].
Session run_session() {
  const std::vector<Variant>& vs = variants();
  const size_t n = vs.size();
  Session out;
  out.runs.resize(n);
  // losses[rank][variant][step]
  std::vector<std::vector<std::vector<double>>> losses(
      kWorld, std::vector<std::vector<double>>(n));
  auto errors = comm::run_thread_ranks(kWorld, [&](int rank, std::shared_ptr<comm::Store> store) {
    struct Rig {
      std::unique_ptr<memory::Device> device;
      std::shared_ptr<comm::Communicator> dp;
      std::unique_ptr<engine::Engine> engine;
    };
    // Destroyed in reverse: engines before their communicators and devices.
    std::vector<Rig> rigs(n);
    for (size_t i = 0; i < n; ++i) {
      const config::Config c = variant_config(vs[i]);
      memory::DeviceOptions o;
      o.threads = static_cast<int>(c.porter.device.threads);
      rigs[i].device = memory::make_device(o);
      comm::CommOptions co;
      co.group_name = "zero3_bench/" + vs[i].name;
      co.timeout = comm::Seconds{c.porter.comm.timeout_s};
      rigs[i].dp = comm::make_communicator(*rigs[i].device, store, rank, kWorld, co);
      rigs[i].engine = std::make_unique<engine::Engine>(
          *rigs[i].device, std::make_unique<engine::TransformerModel>(c.porter.model), c,
          engine::data_parallel(rigs[i].dp));
    }
    const config::Config c = base_config();
    const io::DataSource data(c.porter.data, c.porter.model.vocab,
                                  c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
    auto& my_losses = losses[static_cast<size_t>(rank)];
    for (int s = 0; s < kWarmup; ++s) {
      for (size_t i = 0; i < n; ++i) {
        my_losses[i].push_back(
            rigs[i].engine->train_step(data.rank_batches(s, 1, rank, kWorld)).loss);
      }
    }
    for (Rig& r : rigs) r.engine->reset_peaks();
    std::vector<std::vector<double>> times(n), ratios(n);
    for (int round = 0; round < kSteps; ++round) {
      const int s = kWarmup + round;
      std::vector<double> t(n);
      for (size_t j = 0; j < n; ++j) {
        const size_t i = (j + static_cast<size_t>(round)) % n;
        const engine::StepResult r =
            rigs[i].engine->train_step(data.rank_batches(s, 1, rank, kWorld));
        t[i] = r.time_s;
        my_losses[i].push_back(r.loss);
      }
      for (size_t i = 0; i < n; ++i) {
        times[i].push_back(t[i]);
        ratios[i].push_back(t[i] / t[0]);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      VariantRun& run = out.runs[i];
      const engine::MemoryReport m = rigs[i].engine->memory_report();
      run.peak_bytes[static_cast<size_t>(rank)] = m.peak_bytes;
      run.params_peak_bytes[static_cast<size_t>(rank)] =
          m.peak_by_category[static_cast<size_t>(memory::Category::kParams)];
      if (rank == 0) {
        run.grads_peak_bytes = m.peak_by_category[static_cast<size_t>(memory::Category::kGrads)];
        run.optimizer_peak_bytes =
            m.peak_by_category[static_cast<size_t>(memory::Category::kOptimizer)];
        run.activation_peak_bytes = m.peak_activation_bytes;
        run.times_s = times[i];
        run.ratios = ratios[i];
        run.zero = rigs[i].engine->zero_stats();
        run.predicted = rigs[i].engine->plan().prediction.params;
      }
    }
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  for (size_t r = 0; r < losses.size(); ++r) {
    for (size_t i = 1; i < n; ++i) {
      if (losses[r][i] != losses[r][0]) {
        out.error = "rank " + std::to_string(r) + ": " + vs[i].name +
                    "'s losses are not bitwise " + vs[0].name + "'s";
      }
    }
  }
  return out;
}

// The k-th call of a benchmark reads the k-th session, running it if no benchmark has yet.
const Session& session(int k) {
  static std::vector<Session> sessions;
  while (static_cast<int>(sessions.size()) <= k) sessions.push_back(run_session());
  return sessions[static_cast<size_t>(k)];
}

// Step time (the median timed step of rank 0) and the gathers, per step.
void BM_Step(benchmark::State& state, size_t variant, std::shared_ptr<int> calls) {
  for (auto _ : state) {
    const Session& s = session((*calls)++);
    if (!s.error.empty()) {
      state.SkipWithError(s.error.c_str());
      return;
    }
    const VariantRun& r = s.runs[variant];
    const engine::ZeroStats& z = r.zero;
    state.SetIterationTime(median(r.times_s));
    state.counters["x_stage2"] = median(r.ratios);
    state.counters["comm_MB"] = static_cast<double>(z.comm_bytes) / kSteps / 1e6;
    state.counters["gather_MB"] = static_cast<double>(z.gathered_bytes) / kSteps / 1e6;
    state.counters["gather_busy_ms"] = z.gather_busy_s / kSteps * 1e3;
    state.counters["gather_exposed_ms"] = z.gather_exposed_s / kSteps * 1e3;
    state.counters["gather_hidden"] = z.gather_hidden_fraction;
    state.counters["comm_exposed_ms"] = z.comm_exposed_s / kSteps * 1e3;
  }
}

// Each rank's peak over the timed steps (all categories, and `params`), and the gathered
// buffers' peak measured beside the plan's prediction. The time is the step's, as BM_Step's.
void BM_Memory(benchmark::State& state, size_t variant, std::shared_ptr<int> calls) {
  for (auto _ : state) {
    const Session& s = session((*calls)++);
    if (!s.error.empty()) {
      state.SkipWithError(s.error.c_str());
      return;
    }
    const VariantRun& r = s.runs[variant];
    state.SetIterationTime(median(r.times_s));
    state.counters["peak_MiB_r0"] = static_cast<double>(r.peak_bytes[0]) / kMiB;
    state.counters["peak_MiB_r1"] = static_cast<double>(r.peak_bytes[1]) / kMiB;
    state.counters["params_MiB_r0"] = static_cast<double>(r.params_peak_bytes[0]) / kMiB;
    state.counters["params_MiB_r1"] = static_cast<double>(r.params_peak_bytes[1]) / kMiB;
    state.counters["grads_MiB"] = static_cast<double>(r.grads_peak_bytes) / kMiB;
    state.counters["optimizer_MiB"] = static_cast<double>(r.optimizer_peak_bytes) / kMiB;
    state.counters["act_MiB"] = static_cast<double>(r.activation_peak_bytes) / kMiB;
    state.counters["gathered_MiB"] = static_cast<double>(r.zero.peak_gathered_bytes) / kMiB;
    state.counters["predicted_gathered_MiB"] =
        static_cast<double>(r.predicted.peak_gathered_bytes) / kMiB;
    state.counters["persistent_MiB"] = static_cast<double>(r.predicted.persistent_bytes) / kMiB;
  }
}

void register_all() {
  const std::vector<Variant>& vs = variants();
  for (const char* kind : {"BM_Step", "BM_Memory"}) {
    for (size_t i = 0; i < vs.size(); ++i) {
      const std::string name = std::string(kind) + "/" + vs[i].name;
      auto calls = std::make_shared<int>(0);
      auto* b = std::string(kind) == "BM_Step"
                    ? benchmark::RegisterBenchmark(name.c_str(), BM_Step, i, calls)
                    : benchmark::RegisterBenchmark(name.c_str(), BM_Memory, i, calls);
      b->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace
}  // namespace porter::bench

int main(int argc, char** argv) {
  porter::bench::register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
