// Engine::offload_states / reload_states (Note [Offloaded model states] in
// engine/states_offload.cc): a run that moves its model states to host memory and back between
// steps is bitwise the run that does not, at every ZeRO stage, with optimizer and parameter
// offload, on one and two thread ranks; the device's model-state categories read 0 while they
// are away; misuse is refused with the fix.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "base/error.h"
#include "engine/checkpoint_snapshot.h"
#include "engine/trace.h"
#include "engine_test_util.h"
#include "faulty_device.h"

namespace porter::engine::testing {
namespace {

using memory::Category;

size_t current(const MemoryReport& m, Category c) {
  return m.current_by_category[static_cast<size_t>(c)];
}

struct Case {
  int world_size = 1;
  int stage = 0;
  bool optimizer_offload = false;
  double ratio = 1.0;
  bool param_offload = false;
  bool bf16 = false;
  bool pin_memory = true;
  std::string name() const {
    return "ws" + std::to_string(world_size) + " stage " + std::to_string(stage) +
           (optimizer_offload ? " optimizer offload ratio " + std::to_string(ratio) : "") +
           (param_offload ? " param offload" : "") + (bf16 ? " bf16" : " f32") +
           (pin_memory ? " pinned" : " pageable");
  }
  config::Config config() const {
    config::Config c = offload_config(world_size, stage, 2);
    c.bf16.enabled = bf16;
    c.porter.device.poison_freed = true;  // a read of a freed block shows up as NaN
    if (optimizer_offload) {
      c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
      c.zero_optimization.offload_optimizer.ratio = ratio;
    }
    if (param_offload) c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
    return c;
  }
};

// One rank's record of run(): the loss of every step, the gradients and parameters after the
// last step, the whole saved state, and what the offloads measured.
struct RankRun {
  std::vector<double> losses;
  std::vector<float> grads;
  std::vector<float> params;
  double eval_loss = 0.0;
  SavedState state;
  std::vector<StatesOffloadStats> offloads;  // after each offload_states()
  std::vector<MemoryReport> away;            // memory_report() while the states are away
  int back_at_old_addresses = 0;             // model-state blocks reloaded where they were
};

constexpr int kSteps = 3;

// A cpu device that never hands out an address twice: a freed segment stays mapped, filled
// with 0xFF bytes (NaN), until the device goes. States reloaded after empty_cache() land at
// new addresses, and a pointer left at an old one reads NaN instead of the right values by
// luck.
class QuarantineDevice final : public memory::Device {
 public:
  QuarantineDevice() : inner_(cpu_device()) {}
  ~QuarantineDevice() override {
    for (const auto& [ptr, bytes] : freed_) inner_->free_segment(ptr, bytes);
  }
  memory::DeviceKind kind() const override { return inner_->kind(); }
  int index() const override { return inner_->index(); }
  std::string description() const override { return "quarantine " + inner_->description(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  size_t memory_capacity_bytes() const override { return inner_->memory_capacity_bytes(); }
  size_t segment_alignment() const override { return inner_->segment_alignment(); }
  void* allocate_segment(size_t bytes) override { return inner_->allocate_segment(bytes); }
  void free_segment(void* ptr, size_t bytes) override {
    std::memset(ptr, 0xFF, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    freed_.emplace_back(ptr, bytes);
  }
  size_t pinned_capacity_bytes() const override { return inner_->pinned_capacity_bytes(); }
  void* allocate_pinned(size_t bytes) override { return inner_->allocate_pinned(bytes); }
  void free_pinned(void* ptr, size_t bytes) override { inner_->free_pinned(ptr, bytes); }
  memory::Stream& compute_stream() override { return inner_->compute_stream(); }
  std::unique_ptr<memory::Stream> create_stream(std::string name) override {
    return inner_->create_stream(std::move(name));
  }
  std::unique_ptr<memory::Event> create_event() override { return inner_->create_event(); }
  int threads() const override { return inner_->threads(); }

 private:
  std::unique_ptr<memory::Device> inner_;
  std::mutex mu_;  // guards freed_
  std::vector<std::pair<void*, size_t>> freed_;
};

// Takes every free block the allocator caches, filled with 0xFF bytes: another phase using
// the device. Small-pool space goes in pieces of at most 1 MiB (a larger request would be
// served from the large pool), large-pool blocks whole.
void take_cached_blocks(memory::CachingAllocator& a, std::vector<memory::DeviceBuffer>& out) {
  constexpr size_t kSmall = size_t{1} << 20;
  for (int guard = 0; guard < 100000; ++guard) {
    size_t small = 0, large = 0;
    for (const memory::SegmentInfo& s : a.snapshot()) {
      for (const memory::SegmentInfo::BlockInfo& b : s.blocks) {
        if (b.allocated || b.pending) continue;
        size_t& m = s.small_pool ? small : large;
        m = std::max(m, b.size_bytes);
      }
    }
    if (small == 0 && large == 0) return;
    const size_t bytes = small > 0 ? std::min(small, kSmall) : large;
    memory::DeviceBuffer& b = out.emplace_back(a.allocate(bytes, Category::kWorkspace));
    std::memset(b.data(), 0xFF, bytes);
  }
  ADD_FAILURE() << "take_cached_blocks: the free blocks do not run out";
}

// Runs fn(rank, device, dp) on c.world_size thread ranks, each with its own QuarantineDevice
// and a Gloo communicator on it (one rank: on the calling thread, dp null).
void for_each_rank(const config::Config& c,
                   const std::function<void(int rank, memory::Device& device,
                                            std::shared_ptr<comm::Communicator> dp)>& fn) {
  const int ws = static_cast<int>(c.world_size);
  if (ws == 1) {
    QuarantineDevice device;
    fn(0, device, nullptr);
    return;
  }
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    QuarantineDevice device;
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    fn(rank, device, comm::make_communicator(device, store, rank, ws, o));
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

// The allocator's live blocks: address -> requested bytes.
std::map<uintptr_t, size_t> allocated_blocks(Engine& e) {
  std::map<uintptr_t, size_t> out;
  for (const memory::SegmentInfo& s : e.allocator().snapshot()) {
    for (const memory::SegmentInfo::BlockInfo& b : s.blocks) {
      if (b.allocated) out[b.address] = b.requested_bytes;
    }
  }
  return out;
}

// kSteps steps on every rank; with `offload`, the states go to host memory and back before
// every step and before the final reads.
std::vector<RankRun> run(const Case& k, bool offload) {
  const config::Config c = k.config();
  std::vector<RankRun> runs(static_cast<size_t>(k.world_size));
  for_each_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
    Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    RankRun& r = runs[static_cast<size_t>(rank)];
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    auto away_and_back = [&] {
      const std::map<uintptr_t, size_t> before = allocated_blocks(e);
      e.offload_states(k.pin_memory);
      r.offloads.push_back(e.states_offload_stats());
      r.away.push_back(e.memory_report());
      // Another phase takes the device meanwhile: every block the allocator kept, so the
      // states come back in new segments, at new addresses (QuarantineDevice).
      std::set<uintptr_t> old;
      const std::map<uintptr_t, size_t> away = allocated_blocks(e);
      for (const auto& [at, bytes] : before) {
        if (away.count(at) == 0) old.insert(at);
      }
      std::vector<memory::DeviceBuffer> phase;
      take_cached_blocks(e.allocator(), phase);
      std::set<uintptr_t> taken;
      for (const memory::DeviceBuffer& b : phase) {
        taken.insert(reinterpret_cast<uintptr_t>(b.data()));
      }
      e.reload_states();
      int back_at_old = 0;
      for (const auto& [at, bytes] : allocated_blocks(e)) {
        back_at_old += old.count(at) != 0 && taken.count(at) == 0 ? 1 : 0;
      }
      r.back_at_old_addresses += back_at_old;
    };
    for (int s = 0; s < kSteps; ++s) {
      if (offload) away_and_back();
      const std::vector<io::HostBatch> mbs =
          data.rank_batches(s, c.gradient_accumulation_steps, rank, k.world_size);
      r.losses.push_back(e.train_step(mbs).loss);
    }
    if (offload) away_and_back();
    r.grads = e.grads_host();
    r.eval_loss = e.evaluate(data.rank_batches(kSteps, 1, rank, k.world_size));
    r.params = e.params_host();
    r.state = saved_state(e);
  });
  return runs;
}

void expect_same_runs(const Case& k) {
  SCOPED_TRACE(k.name());
  const std::vector<RankRun> plain = run(k, false);
  const std::vector<RankRun> moved = run(k, true);
  std::vector<SavedState> a, b;
  for (int rank = 0; rank < k.world_size; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const RankRun& p = plain[static_cast<size_t>(rank)];
    const RankRun& m = moved[static_cast<size_t>(rank)];
    EXPECT_EQ(p.losses, m.losses);
    EXPECT_TRUE(bitwise_equal(p.grads, m.grads));
    EXPECT_TRUE(bitwise_equal(p.params, m.params));
    EXPECT_EQ(p.eval_loss, m.eval_loss);
    a.push_back(p.state);
    b.push_back(m.state);
    EXPECT_EQ(m.back_at_old_addresses, 0);
    ASSERT_EQ(m.offloads.size(), static_cast<size_t>(kSteps + 1));
    for (size_t i = 0; i < m.offloads.size(); ++i) {
      const StatesOffloadStats& st = m.offloads[i];
      const MemoryReport& away = m.away[i];
      EXPECT_TRUE(st.offloaded);
      EXPECT_EQ(st.pinned, k.pin_memory);
      EXPECT_EQ(st.offloads, static_cast<int64_t>(i + 1));
      EXPECT_EQ(st.reloads, static_cast<int64_t>(i));
      EXPECT_GT(st.device_bytes_before, 0u);
      EXPECT_EQ(st.device_bytes_after, 0u);
      EXPECT_EQ(st.offload_bytes, st.device_bytes_before);  // the categories count requests
      EXPECT_GE(st.host_bytes, st.offload_bytes);
      EXPECT_LT(st.reserved_bytes_after, st.reserved_bytes_before);
      EXPECT_EQ(st.reload_bytes, i == 0 ? 0u : st.offload_bytes);  // the previous reload's
      EXPECT_EQ(current(away, Category::kParams), 0u);
      EXPECT_EQ(current(away, Category::kGrads), 0u);
      EXPECT_EQ(current(away, Category::kOptimizer), 0u);
      EXPECT_EQ(away.model_state_bytes, 0u);
    }
  }
  expect_same_state(a, b, k.name());
}

TEST(StatesOffload, BitwiseAcrossStagesAndRanks) {
  for (int ws : {1, 2}) {
    for (int stage = 0; stage <= 3; ++stage) {
      Case k;
      k.world_size = ws;
      k.stage = stage;
      k.pin_memory = stage % 2 == 0;
      expect_same_runs(k);
    }
  }
}

TEST(StatesOffload, BitwiseWithOptimizerAndParameterOffload) {
  for (int ws : {1, 2}) {
    for (int stage = 1; stage <= 3; ++stage) {
      Case k;
      k.world_size = ws;
      k.stage = stage;
      k.optimizer_offload = true;
      expect_same_runs(k);
    }
    Case partial;  // Note [Partial offload]: master and moments half on the device
    partial.world_size = ws;
    partial.stage = 3;
    partial.optimizer_offload = true;
    partial.ratio = 0.5;
    partial.bf16 = true;
    expect_same_runs(partial);
    Case params;  // Note [Parameter offload]: the shard stays in host memory
    params.world_size = ws;
    params.stage = 3;
    params.param_offload = true;
    params.pin_memory = false;
    expect_same_runs(params);
    Case both = params;
    both.optimizer_offload = true;
    expect_same_runs(both);
  }
}

TEST(StatesOffload, Bf16) {
  for (int stage : {0, 2}) {
    Case k;
    k.world_size = 2;
    k.stage = stage;
    k.bf16 = true;
    expect_same_runs(k);
  }
}

// Tensor parallelism changes nothing of the above: each rank's part of the model moves.
TEST(StatesOffload, TensorParallel) {
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    config::Config c = zero_config(4, stage, 1);
    c.porter.model.tensor_parallel = 2;
    c.train_batch_size = c.train_micro_batch_size_per_gpu * 2;
    struct TpRun {
      std::vector<double> losses;
      std::vector<float> params;
      SavedState state;
    };
    auto run_tp = [&](bool offload) {
      std::vector<TpRun> runs(4);
      auto errors = comm::run_thread_ranks(4, [&](int rank, std::shared_ptr<comm::Store> store) {
        QuarantineDevice device;
        comm::CommOptions o;
        o.timeout = comm::Seconds{c.porter.comm.timeout_s};
        comm::ProcessGroups g =
            comm::make_process_groups(comm::make_communicator(device, store, rank, 4, o), 2);
        Engine e(device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c, g);
        const io::DataSource data(c.porter.data, c.porter.model.vocab,
                                  c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
        TpRun& r = runs[static_cast<size_t>(rank)];
        for (int s = 0; s < kSteps; ++s) {
          if (offload) {
            e.offload_states(rank % 2 == 0);
            EXPECT_EQ(e.memory_report().model_state_bytes, 0u);
            e.reload_states();
          }
          r.losses.push_back(e.train_step(data.rank_batches(s, 1, g.dp_rank, g.dp_size)).loss);
        }
        r.params = e.params_host();
        r.state = saved_state(e);
      });
      for (auto& err : errors) {
        if (err) std::rethrow_exception(err);
      }
      return runs;
    };
    const std::vector<TpRun> plain = run_tp(false);
    const std::vector<TpRun> moved = run_tp(true);
    std::vector<SavedState> a, b;
    for (size_t rank = 0; rank < plain.size(); ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      EXPECT_EQ(plain[rank].losses, moved[rank].losses);
      EXPECT_TRUE(bitwise_equal(plain[rank].params, moved[rank].params));
      a.push_back(plain[rank].state);
      b.push_back(moved[rank].state);
    }
    expect_same_state(a, b, "tensor parallel");
  }
}

// Everything that reads or writes the states while they are away is refused with the fix, and
// changes nothing: the run goes on bitwise after reload_states().
TEST(StatesOffload, UseWhileAwayIsRefused) {
  for (int stage : {0, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    Case k;
    k.stage = stage;
    const config::Config c = k.config();
    auto device = cpu_device();
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    e.train_step(data.rank_batches(0, 2, 0, 1));
    const std::vector<float> params = e.params_host();
    const std::vector<float> grads = e.grads_host();
    const std::string early = error_of<UsageError>([&] { e.reload_states(); });
    EXPECT_NE(early.find("Engine::reload_states: the model states are on the device"),
              std::string::npos) << early;
    const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                      ("porter_states_offload_" + std::to_string(getpid()));
    const std::filesystem::path saved = dir / "saved";
    e.save_checkpoint(saved);
    e.offload_states();
    EXPECT_TRUE(e.states_offloaded());
    const std::string fix = "call reload_states() first";
    int filled = 0;
    std::vector<std::pair<std::string, std::function<void()>>> calls = {
        {"Engine::train_step", [&] { e.train_step(data.rank_batches(1, 2, 0, 1)); }},
        {"Engine::evaluate", [&] { e.evaluate(data.rank_batches(1, 1, 0, 1)); }},
        {"", [&] { e.params_host(); }},
        {"", [&] { e.grads_host(); }},
        {"", [&] { e.set_params_host(params); }},
        {"", [&] { e.set_params_host_range([&](int64_t, std::span<float>) { ++filled; }); }},
        {"", [&] { e.save_checkpoint(dir / "away"); }},
        {"", [&] { e.load_checkpoint(saved); }},
        {"", [&] { e.snapshot_checkpoint(); }},
        {"", [&] { e.profile(); }},
        {"Engine::offload_states", [&] { e.offload_states(); }},
    };
    for (const auto& [prefix, call] : calls) {
      const std::string msg = error_of<UsageError>(call);
      EXPECT_NE(msg.find(fix), std::string::npos) << msg;
      EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
    }
    EXPECT_FALSE(std::filesystem::exists(dir / "away"));
    std::filesystem::remove_all(dir);
    // The memory report and the statistics still answer.
    EXPECT_EQ(e.memory_report().model_state_bytes, 0u);
    EXPECT_EQ(e.states_offload_stats().offloads, 1);
    e.reload_states();
    EXPECT_FALSE(e.states_offloaded());
    EXPECT_TRUE(bitwise_equal(e.params_host(), params));
    EXPECT_TRUE(bitwise_equal(e.grads_host(), grads));

    Engine ref(*device, std::make_unique<TransformerModel>(c.porter.model), c);
    ref.train_step(data.rank_batches(0, 2, 0, 1));
    const double want = ref.train_step(data.rank_batches(1, 2, 0, 1)).loss;
    EXPECT_EQ(e.train_step(data.rank_batches(1, 2, 0, 1)).loss, want);
    expect_same_state(saved_state(e), saved_state(ref), "after the refused calls");
  }
}

// The point of it: a phase that needs the device's memory gets what the states held, and
// the states come back afterwards. A reload that does not fit leaves them in host memory.
TEST(StatesOffload, FreesTheDeviceForAnotherPhase) {
  Case k;
  k.stage = 2;
  const config::Config c = k.config();
  auto device = cpu_device(size_t{64} << 20);
  Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
  const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                            c.porter.model.seq_len);
  e.train_step(data.rank_batches(0, 2, 0, 1));
  const std::vector<float> params = e.params_host();
  e.allocator().empty_cache();
  const memory::MemoryStats before = e.allocator().stats();
  e.offload_states();
  const memory::MemoryStats away = e.allocator().stats();
  const StatesOffloadStats st = e.states_offload_stats();
  EXPECT_EQ(st.reserved_bytes_before, before.reserved_bytes);
  EXPECT_EQ(st.reserved_bytes_after, away.reserved_bytes);
  EXPECT_GE(before.reserved_bytes - away.reserved_bytes, st.device_bytes_before);
  // All the device has left now, which is more than it had left before.
  const size_t free_now = away.capacity_bytes - away.reserved_bytes;
  ASSERT_GT(free_now, before.capacity_bytes - before.reserved_bytes);
  {
    // The device filled up, its cached free blocks too.
    std::vector<memory::DeviceBuffer> generation;
    generation.push_back(e.allocator().allocate(free_now, Category::kWorkspace));
    while (e.allocator().stats().largest_free_block_bytes >= 4096) {
      generation.push_back(e.allocator().allocate(e.allocator().stats().largest_free_block_bytes,
                                                  Category::kWorkspace));
    }
    const std::string msg = error_of<OutOfMemoryError>([&] { e.reload_states(); });
    EXPECT_NE(msg, "(no error)");
    EXPECT_TRUE(e.states_offloaded());
    EXPECT_EQ(e.memory_report().model_state_bytes, 0u);
  }
  e.reload_states();
  EXPECT_TRUE(bitwise_equal(e.params_host(), params));
  EXPECT_EQ(e.states_offload_stats().device_bytes_reloaded, st.device_bytes_before);
  e.train_step(data.rank_batches(1, 2, 0, 1));
}

// A copy that fails on the way out puts every buffer back as it was; one that fails on the
// way back leaves the states in host memory, intact, for another try. Either way the run goes
// on bitwise.
TEST(StatesOffload, CopyFailures) {
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    Case k;
    k.stage = stage;
    const config::Config c = k.config();
    FaultyDevice device(cpu_device());
    Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c);
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    e.train_step(data.rank_batches(0, 2, 0, 1));
    const size_t states = e.memory_report().model_state_bytes;
    device.fail_copy("states offload", 2);
    EXPECT_NE(error_of<std::exception>([&] { e.offload_states(); }).find("injected copy failure"),
              std::string::npos);
    EXPECT_EQ(device.failures(), 1);
    EXPECT_FALSE(e.states_offloaded());
    EXPECT_EQ(e.memory_report().model_state_bytes, states);
    EXPECT_EQ(e.pinned_pool().stats().in_use_bytes, 0u);
    e.train_step(data.rank_batches(1, 2, 0, 1));

    e.offload_states();
    device.fail_copy("states offload", 1);
    EXPECT_NE(error_of<std::exception>([&] { e.reload_states(); }).find("injected copy failure"),
              std::string::npos);
    EXPECT_EQ(device.failures(), 2);
    EXPECT_TRUE(e.states_offloaded());
    EXPECT_EQ(e.memory_report().model_state_bytes, 0u);
    e.reload_states();
    const double loss = e.train_step(data.rank_batches(2, 2, 0, 1)).loss;

    auto plain_device = cpu_device();
    Engine ref(*plain_device, std::make_unique<TransformerModel>(c.porter.model), c);
    for (int s = 0; s < 2; ++s) ref.train_step(data.rank_batches(s, 2, 0, 1));
    EXPECT_EQ(ref.train_step(data.rank_batches(2, 2, 0, 1)).loss, loss);
    expect_same_state(saved_state(e), saved_state(ref), "after the failed copies");
  }
}

// Pinned blocks come from the engine's pool within porter.device.pinned_limit; a shortfall is
// refused before anything moves, and pageable memory is the way out.
TEST(StatesOffload, PinnedLimit) {
  Case k;
  k.stage = 1;
  config::Config c = k.config();
  c.porter.device.pinned_limit_bytes = 64 << 10;
  auto device = cpu_device();
  Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
  const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                            c.porter.model.seq_len);
  e.train_step(data.rank_batches(0, 2, 0, 1));
  const size_t states = e.memory_report().model_state_bytes;
  const std::string msg = error_of<OutOfMemoryError>([&] { e.offload_states(); });
  EXPECT_NE(msg.find("porter.device.pinned_limit"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offload_states(false)"), std::string::npos) << msg;
  EXPECT_FALSE(e.states_offloaded());
  EXPECT_EQ(e.memory_report().model_state_bytes, states);
  EXPECT_EQ(e.pinned_pool().stats().in_use_bytes, 0u);
  e.offload_states(false);
  EXPECT_FALSE(e.states_offload_stats().pinned);
  EXPECT_EQ(e.pinned_pool().stats().in_use_bytes, 0u);
  e.reload_states();
  e.train_step(data.rank_batches(1, 2, 0, 1));

  // Within the limit the blocks are the pool's while the states are away, and return after.
  config::Config big = k.config();
  Engine f(*device, std::make_unique<TransformerModel>(big.porter.model), big);
  f.train_step(data.rank_batches(0, 2, 0, 1));
  f.offload_states();
  EXPECT_EQ(f.pinned_pool().stats().in_use_bytes, f.states_offload_stats().host_bytes);
  f.reload_states();
  EXPECT_EQ(f.pinned_pool().stats().in_use_bytes, 0u);
}

TEST(StatesOffload, TraceSpans) {
  Case k;
  k.stage = 3;
  const config::Config c = k.config();
  auto device = cpu_device();
  Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
  TraceRecorder trace;
  e.set_trace(&trace);
  e.offload_states();
  e.reload_states();
  const std::vector<TraceSpan> spans = trace.spans();
  auto find = [&](const std::string& name) {
    return std::find_if(spans.begin(), spans.end(),
                        [&](const TraceSpan& s) { return s.name == name; });
  };
  const StatesOffloadStats st = e.states_offload_stats();
  for (const char* name : {"offload states", "reload states"}) {
    const auto it = find(name);
    ASSERT_NE(it, spans.end()) << name;
    EXPECT_EQ(it->lane, "compute");
    ASSERT_FALSE(it->args.empty());
    EXPECT_EQ(it->args[0].first, "bytes");
    EXPECT_EQ(it->args[0].second, static_cast<double>(st.offload_bytes));
  }
  EXPECT_EQ(st.reload_bytes, st.offload_bytes);
  EXPECT_GE(st.offload_s, 0.0);
  EXPECT_GE(st.reload_s, 0.0);
}

}  // namespace
}  // namespace porter::engine::testing
