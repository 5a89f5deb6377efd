// Background checkpoints (Note [Background checkpoints] in engine/checkpointer.h): every rank
// of a thread-rank world saves after every step while the next step runs; the run directory
// ends with the newest keep_checkpoints, latest names the last, and each checkpoint holds the
// state of its step, from which training continues bit-identically. Sanitized: the writer
// thread, the store votes and the engine run concurrently.
#include "engine/checkpointer.h"

#include <filesystem>
#include <fstream>

#include <unistd.h>

#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "engine_test_util.h"
#include "io/run_dir.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("porter_checkpointer_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// Runs fn(rank, engine, store) on `c.world_size` thread ranks (one: store null).
void on_ranks(const config::Config& c,
              const std::function<void(int, Engine&, comm::Store*)>& fn) {
  const int ws = static_cast<int>(c.world_size);
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    std::shared_ptr<comm::Communicator> dp;
    if (ws > 1) {
      comm::CommOptions o;
      o.timeout = comm::Seconds{c.porter.comm.timeout_s};
      dp = comm::make_communicator(*device, store, rank, ws, o);
    }
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    fn(rank, e, ws > 1 ? store.get() : nullptr);
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

TEST(Checkpointer, SavesEveryStepInTheBackgroundKeepsTheNewestAndResumesBitIdentically) {
  for (int ws : {1, 2}) {
    SCOPED_TRACE("world size " + std::to_string(ws));
    const config::Config c = zero_config(ws, ws > 1 ? 2 : 0);
    const fs::path dir = temp_dir("run" + std::to_string(ws));
    const io::DataSource data(c.porter.data, c.porter.model.vocab,
                              c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
    constexpr int kSteps = 5;
    std::vector<SavedState> at4(static_cast<size_t>(ws)), at5(static_cast<size_t>(ws));
    std::vector<std::vector<CheckpointRecord>> records(static_cast<size_t>(ws));
    on_ranks(c, [&](int rank, Engine& e, comm::Store* store) {
      CheckpointerOptions o;
      o.run_dir = dir;
      o.keep = 2;
      o.store = store;
      o.rank = rank;
      o.world_size = ws;
      o.timeout = comm::Seconds{20};
      Checkpointer ck(o);
      for (int s = 0; s < kSteps; ++s) {
        e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, ws));
        ck.save(e);  // written while the next step runs
        if (e.step() == 4) {
          ck.wait();
          at4[static_cast<size_t>(rank)] = saved_state(e);
        }
      }
      ck.save(e);  // the same step again: nothing new
      ck.wait();
      at5[static_cast<size_t>(rank)] = saved_state(e);
      records[static_cast<size_t>(rank)] = ck.records();
    });
    EXPECT_EQ(io::read_latest(dir), kSteps);
    EXPECT_FALSE(fs::exists(dir / "step-3"));
    EXPECT_TRUE(io::is_checkpoint(dir / "step-4"));
    EXPECT_TRUE(io::is_checkpoint(dir / "step-5"));
    EXPECT_FALSE(fs::exists(io::pending_checkpoint_dir(dir, kSteps)));
    for (const std::vector<CheckpointRecord>& r : records) {
      ASSERT_EQ(r.size(), static_cast<size_t>(kSteps));
      for (size_t i = 0; i < r.size(); ++i) {
        EXPECT_EQ(r[i].step, static_cast<int64_t>(i) + 1);
        EXPECT_GT(r[i].bytes, 0u);
        EXPECT_GE(r[i].write_s, 0.0);
        EXPECT_EQ(r[i].path, dir / ("step-" + std::to_string(i + 1)));
      }
    }
    // Each checkpoint is its step's state; one more step from step 4 gives step 5's.
    std::vector<SavedState> loaded4(static_cast<size_t>(ws)), resumed5(static_cast<size_t>(ws));
    on_ranks(c, [&](int rank, Engine& e, comm::Store*) {
      e.load_checkpoint(dir / "step-4");
      loaded4[static_cast<size_t>(rank)] = saved_state(e);
      e.train_step(data.rank_batches(4, c.gradient_accumulation_steps, rank, ws));
      resumed5[static_cast<size_t>(rank)] = saved_state(e);
    });
    expect_same_state(at4, loaded4, "step-4 as saved");
    expect_same_state(at5, resumed5, "step 5 resumed from step-4");
    fs::remove_all(dir);
  }
}

TEST(Checkpointer, ARunDirectoryThatCannotBeWrittenIsAnErrorNamingIt) {
  const config::Config c = zero_config(1, 0);
  const fs::path dir = temp_dir("fails");
  std::ofstream(dir) << "a file where the run directory should be";
  on_ranks(c, [&](int, Engine& e, comm::Store*) {
    CheckpointerOptions o;
    o.run_dir = dir;
    Checkpointer ck(o);
    const io::DataSource data(c.porter.data, c.porter.model.vocab,
                              c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
    e.train_step(data.step_batches(0, 1));
    try {
      ck.save(e);
      ck.wait();
      ADD_FAILURE() << "no error";
    } catch (const IoError& err) {
      EXPECT_NE(std::string(err.what()).find(dir.string()), std::string::npos) << err.what();
    }
  });
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
