// The Engine at tensor_parallel 2, on thread ranks: it plans from the GPT's per-rank analytic
// costs where no times are needed, its measured step peaks equal their predictions on every
// rank, and its profiled bytes equal the analytic model's, with and without sequence
// parallelism.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/analytic.h"
#include "comm/communicator.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using config::CheckpointPolicy;

config::Config tp_config(CheckpointPolicy policy, bool sp) {
  config::Config c = tiny_config(policy, 0.1, /*accumulation=*/1);
  c.porter.model.tensor_parallel = 2;
  c.porter.model.sequence_parallel = sp;
  c.world_size = 2;  // one data-parallel rank of 2 tensor-parallel ones
  return c;
}

models::TransformerShape shape_of(const config::Config& c) {
  return {c.porter.model, c.train_micro_batch_size_per_gpu, c.porter.model.seq_len,
          tensor::DType::kF32};
}

// fn(engine) on each of the 2 ranks' Engines; rethrows the first failure.
void run_tp_ranks(const config::Config& c, const std::function<void(int, Engine&)>& fn) {
  const int t = static_cast<int>(c.porter.model.tensor_parallel);
  auto errors = comm::run_thread_ranks(t, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.group_name = "tp";
    o.timeout = comm::Seconds{60};
    std::shared_ptr<comm::Communicator> tp = comm::make_communicator(*device, store, rank, t, o);
    comm::ProcessGroups g;  // one data-parallel rank: the world is the tp group
    g.world = tp;
    g.tp = tp;
    g.tp_rank = rank;
    g.tp_size = t;
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, rank), c, g);
    fn(rank, e);
  });
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

TEST(EngineTpCostsTest, NonePlansFromAnalyticCostsAndPredictsTheMeasuredPeak) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sp" : "no sp");
    const config::Config c = tp_config(CheckpointPolicy::kNone, sp);
    std::vector<size_t> peaks(2), predicted(2);
    std::vector<std::string> sources(2);
    run_tp_ranks(c, [&](int rank, Engine& e) {
      sources[static_cast<size_t>(rank)] = e.costs().source;
      const StepResult r = e.train_step(batches(c, 0));
      peaks[static_cast<size_t>(rank)] = r.peak_activation_bytes;
      predicted[static_cast<size_t>(rank)] = e.memory_report().predicted_activation_bytes;
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(sources[static_cast<size_t>(r)], "analytic") << "rank " << r;
      EXPECT_EQ(peaks[static_cast<size_t>(r)], models::none_peak_bytes(shape_of(c)))
          << "rank " << r;
      EXPECT_EQ(predicted[static_cast<size_t>(r)], peaks[static_cast<size_t>(r)]) << "rank " << r;
    }
  }
}

TEST(EngineTpCostsTest, ProfiledBytesEqualTheAnalyticModelOnEveryRank) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sp" : "no sp");
    const config::Config c = tp_config(CheckpointPolicy::kFull, sp);
    std::vector<checkpoint::ChainCosts> prof(2);
    std::vector<size_t> peaks(2), predicted(2);
    run_tp_ranks(c, [&](int rank, Engine& e) {
      prof[static_cast<size_t>(rank)] = e.profile();
      const StepResult r = e.train_step(batches(c, 0));
      peaks[static_cast<size_t>(rank)] = r.peak_activation_bytes;
      predicted[static_cast<size_t>(rank)] = e.memory_report().predicted_activation_bytes;
    });
    const checkpoint::ChainCosts ana = models::analytic_transformer_costs(shape_of(c));
    for (int r = 0; r < 2; ++r) {
      const checkpoint::ChainCosts& p = prof[static_cast<size_t>(r)];
      EXPECT_EQ(predicted[static_cast<size_t>(r)], peaks[static_cast<size_t>(r)]) << "rank " << r;
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_costs_match(p, ana);
    }
  }
}

}  // namespace
}  // namespace porter::engine
