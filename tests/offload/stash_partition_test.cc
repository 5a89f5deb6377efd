// Partitioned checkpoints in the stash (Note [Stash partition]) with tensor-parallel ranks as
// threads, each with its own cpu device and a Gloo communicator: every rank gets back exactly
// the bytes it held, for device and host slices, contiguous or not, at prefetch depths 0..3,
// float and i32 tensors of odd sizes; the allocator's measured peak equals the simulator's to
// the byte; and a rank that fails mid-gather makes its peers' fetch fail, naming the op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/units.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/planner.h"
#include "checkpoint/simulate.h"
#include "comm/communicator.h"
#include "memory/cpu_device.h"
#include "offload/stash.h"

namespace porter::offload {
namespace {

using checkpoint::ChainCosts;
using checkpoint::OffloadLayout;
using checkpoint::Schedule;
using checkpoint::ScheduleOp;
using memory::Category;
using ::testing::HasSubstr;

constexpr double kTimeoutS = 5.0;

// The checkpoints: a_1..a_5 of odd sizes, f32 and i32 (a_0 is the token ids).
struct Input {
  tensor::Shape shape;
  tensor::DType dtype;
};
const std::vector<Input>& inputs() {
  static const std::vector<Input> in = {
      {tensor::Shape{4}, tensor::DType::kI32},          // token ids (workspace, not in the footprint)
      {tensor::Shape{7, 13}, tensor::DType::kF32},      // 364 bytes
      {tensor::Shape{5, 11}, tensor::DType::kI32},      // 220 bytes
      {tensor::Shape{64, 1024}, tensor::DType::kF32},   // 256 KiB
      {tensor::Shape{3, 3}, tensor::DType::kI32},       // 36 bytes: at 4 ways ranks 2 and 3 are padding
      {tensor::Shape{33}, tensor::DType::kF32},         // 132 bytes
  };
  return in;
}
constexpr int kStages = 6;
constexpr size_t kLossBytes = 4;

size_t input_bytes(int stage) {
  const Input& in = inputs()[static_cast<size_t>(stage)];
  return static_cast<size_t>(in.shape.numel()) * tensor::dtype_size(in.dtype);
}

// The chain whose stages read those inputs. A forward peaks at its output (and saves nothing),
// a recompute costs nothing, and no tape references its input or output, so that the
// executor below needs only cur and the holds for its footprint to be the simulator's.
ChainCosts chain() {
  ChainCosts c;
  c.source = "analytic";
  for (int i = 0; i < kStages; ++i) {
    checkpoint::StageCost s;
    s.name = "s" + std::to_string(i);
    s.is_block = i > 0 && i < kStages - 1;
    s.input_bytes = i == 0 ? 0 : input_bytes(i);
    s.output_bytes = i + 1 < kStages ? input_bytes(i + 1) : kLossBytes;
    checkpoint::OptionCost& k = s.option(checkpoint::SaveOption::kKeep);
    k.available = true;
    k.forward_peak_bytes = s.output_bytes;
    checkpoint::OptionCost& ck = s.option(checkpoint::SaveOption::kCheckpoint);
    ck = k;
    c.stages.push_back(s);
  }
  return c;
}

// The same bytes on every rank (the ranks of a tp group compute the same activation),
// different per stage and micro-batch.
std::vector<std::byte> pattern(int stage, int micro_batch) {
  std::vector<std::byte> b(input_bytes(stage));
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] = static_cast<std::byte>((i * 131 + static_cast<size_t>(stage) * 17 + static_cast<size_t>(micro_batch) * 7) & 0xFF);
  }
  return b;
}

tensor::Tensor make_input(memory::CachingAllocator& a, int stage, int micro_batch) {
  const Input& in = inputs()[static_cast<size_t>(stage)];
  const Category category = stage == 0 ? Category::kWorkspace : Category::kActivations;
  tensor::Tensor t = tensor::Tensor::empty(a, in.shape, in.dtype, category);
  const std::vector<std::byte> b = pattern(stage, micro_batch);
  std::memcpy(t.data(), b.data(), b.size());
  return t;
}

// One tensor-parallel rank: a cpu device, its allocator (freed memory poisoned), its pinned
// pool, a Gloo communicator named "tp" and the stash on it.
struct Rank {
  Rank(int rank, int ways, std::shared_ptr<comm::Store> store, bool contiguous, bool with_tp = true)
      : device(make_device()), allocator(*device, poisoned()), pinned(*device),
        tp(comm::make_communicator(*device, std::move(store), rank, ways, comm_options())),
        stash(allocator, pinned, StashOptions{contiguous, false, with_tp ? tp.get() : nullptr}) {}

  static std::unique_ptr<memory::CpuDevice> make_device() {
    memory::DeviceOptions o;
    o.memory_limit_bytes = 64 * kMiB;
    o.pinned_limit_bytes = 16 * kMiB;
    o.threads = 1;
    return std::make_unique<memory::CpuDevice>(o);
  }
  static memory::AllocatorOptions poisoned() {
    memory::AllocatorOptions o;
    o.poison_freed = true;
    return o;
  }
  static comm::CommOptions comm_options() {
    comm::CommOptions o;
    o.group_name = "tp";
    o.timeout = comm::Seconds{kTimeoutS};
    return o;
  }

  std::unique_ptr<memory::CpuDevice> device;
  memory::CachingAllocator allocator;
  memory::PinnedPool pinned;
  std::unique_ptr<comm::Communicator> tp;
  CheckpointStash stash;
};

// The engine's executor reduced to what the footprint sees (Note [Schedule semantics] with the
// chain above): cur, the holds, and the stash's calls at the ops the layout names. Every
// fetched checkpoint is compared with the bytes held. `before_op(k)` runs before op k.
void run_micro_batch(Rank& r, const Schedule& s, int micro_batch,
                     const std::function<void(size_t)>& before_op = {}) {
  const OffloadLayout& l = r.stash.layout();
  const size_t n_ops = s.ops.size();
  std::vector<int> hold(n_ops, -1), use(n_ops, -1);
  std::vector<std::vector<int>> prefetch(n_ops), release(n_ops);
  for (size_t e = 0; e < l.entries.size(); ++e) {
    const checkpoint::StashEntry& x = l.entries[e];
    hold[static_cast<size_t>(x.hold_op)] = static_cast<int>(e);
    release[static_cast<size_t>(x.release_op)].push_back(static_cast<int>(e));
    if (x.use_op < 0) continue;
    use[static_cast<size_t>(x.use_op)] = static_cast<int>(e);
    prefetch[static_cast<size_t>(x.prefetch_op)].push_back(static_cast<int>(e));
  }
  for (std::vector<int>& p : prefetch) {
    std::sort(p.begin(), p.end(), [&](int a, int b) {
      return l.entries[static_cast<size_t>(a)].use_op < l.entries[static_cast<size_t>(b)].use_op;
    });
  }
  std::vector<tensor::Tensor> held(kStages);
  std::vector<bool> is_held(kStages, false);
  tensor::Tensor cur = make_input(r.allocator, 0, micro_batch);
  int cur_stage = 0;
  r.stash.begin(micro_batch);
  try {
    for (size_t k = 0; k < n_ops; ++k) {
      if (before_op) before_op(k);
      const ScheduleOp& op = s.ops[k];
      const auto i = static_cast<size_t>(op.stage);
      for (int e : prefetch[k]) r.stash.prefetch(e);
      if (use[k] >= 0) {
        held[i] = r.stash.fetch(use[k]);
        const Input& in = inputs()[i];
        ASSERT_EQ(held[i].shape(), in.shape);
        ASSERT_EQ(held[i].dtype(), in.dtype);
        ASSERT_EQ(held[i].category(), Category::kStaging);
        const std::vector<std::byte> want = pattern(op.stage, micro_batch);
        ASSERT_EQ(std::memcmp(held[i].data(), want.data(), want.size()), 0)
            << "stage " << op.stage << ", micro-batch " << micro_batch << ", rank " << r.tp->rank();
      }
      switch (op.kind) {
        case ScheduleOp::Kind::kForward: {
          tensor::Tensor input = cur_stage == op.stage ? cur : held[i];
          ASSERT_TRUE(input.defined() && input.data() != nullptr) << "op " << k;
          if (op.hold_input && !is_held[i]) {
            if (op.stashed()) {
              r.stash.offload(hold[k], input);
            } else {
              if (op.stage > 0) input.retag(Category::kCheckpoints);
              held[i] = input;
            }
            is_held[i] = true;
          }
          if (op.stage + 1 < kStages) {
            tensor::Tensor out = make_input(r.allocator, op.stage + 1, micro_batch);
            input = tensor::Tensor();
            cur = std::move(out);
            cur_stage = op.stage + 1;
          } else {
            tensor::Tensor loss = tensor::Tensor::empty(r.allocator, tensor::Shape{1}, tensor::DType::kF32, Category::kActivations);
            loss = tensor::Tensor();
            input = tensor::Tensor();
            cur = tensor::Tensor();
            cur_stage = -1;
          }
          break;
        }
        case ScheduleOp::Kind::kRecompute:
          ASSERT_TRUE(cur_stage == op.stage || is_held[i]);
          break;
        case ScheduleOp::Kind::kBackward:
          if (cur_stage == op.stage + 1) {
            cur = tensor::Tensor();
            cur_stage = -1;
          }
          held[i] = tensor::Tensor();
          is_held[i] = false;
          for (int e : release[k]) r.stash.release(e);
          break;
      }
    }
    r.stash.end();
  } catch (...) {
    held.clear();
    cur = tensor::Tensor();
    r.stash.abort();
    throw;
  }
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  }
}

void expect_all_ok(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << (errors[r] ? what_of(errors[r]) : "");
  }
}

struct Case {
  int ways;
  bool host;         // offload on: slices on the host, the last hold on the device
  bool contiguous;
  int depth;
  bool uniform;      // uniform (re-forwards read the holds) instead of full
  size_t min_bytes;  // partition_min_bytes
};

std::string case_name(const Case& c) {
  return std::to_string(c.ways) + "ways_" + (c.host ? "host" : "device") + "_" +
         (c.contiguous ? "contiguous" : "separate") + "_depth" + std::to_string(c.depth) +
         (c.uniform ? "_uniform" : "_full") + (c.min_bytes > 0 ? "_min" + std::to_string(c.min_bytes) : "");
}
std::string name_of(const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

class StashPartitionTest : public ::testing::TestWithParam<Case> {};

// The schedule and layout as make_plan lays them out.
Schedule schedule_of(const Case& c, const ChainCosts& costs) {
  Schedule s = c.uniform ? checkpoint::schedule_uniform(costs, 2) : checkpoint::schedule_full(costs);
  if (c.host) checkpoint::place_offload(s, costs, 1);
  checkpoint::PartitionOptions p;
  p.ways = c.ways;
  p.min_bytes = c.min_bytes;
  checkpoint::place_partition(s, costs, p);
  return s;
}

TEST_P(StashPartitionTest, EveryRankGetsBackItsBytesAndTheMeasuredPeakIsThePredicted) {
  const Case c = GetParam();
  const ChainCosts costs = chain();
  const Schedule s = schedule_of(c, costs);
  const OffloadLayout layout = checkpoint::layout_offload(s, costs, c.depth, c.contiguous, c.ways);
  ASSERT_TRUE(layout.any_partitioned()) << s.to_string();
  const checkpoint::Prediction p = checkpoint::simulate(s, costs, layout);
  constexpr int kMicroBatches = 2;
  const auto errors = comm::run_thread_ranks(c.ways, [&](int rank, std::shared_ptr<comm::Store> store) {
    Rank r(rank, c.ways, std::move(store), c.contiguous);
    r.stash.prepare(layout);
    const size_t baseline = r.allocator.stats().requested_bytes;
    const size_t pinned_baseline = r.pinned.stats().in_use_bytes;
    r.allocator.reset_peak();
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      run_micro_batch(r, s, mb);
      if (::testing::Test::HasFatalFailure()) return;
    }
    r.stash.synchronize();
    const memory::MemoryStats m = r.allocator.stats();
    // Note [Partition semantics]: what the simulator predicts, to the byte, on every rank.
    EXPECT_EQ(m.peak_activation_bytes, p.peak_activation_bytes) << "rank " << rank << ": " << s.to_string();
    EXPECT_EQ(m.requested_bytes, baseline);
    EXPECT_EQ(r.pinned.stats().in_use_bytes, pinned_baseline);
    const StashStats st = r.stash.stats();
    EXPECT_EQ(st.slice_peak_bytes, p.offload.peak_slice_bytes);
    EXPECT_EQ(st.staging_peak_bytes, p.offload.peak_staging_bytes);
    EXPECT_EQ(st.d2h_bytes, kMicroBatches * p.offload.d2h_bytes);
    EXPECT_EQ(st.h2d_bytes, kMicroBatches * p.offload.h2d_bytes);
    EXPECT_EQ(st.gathers, kMicroBatches * p.offload.gathers);
    EXPECT_EQ(st.gathered_bytes, kMicroBatches * p.offload.gathered_bytes);
    EXPECT_GE(st.gather_busy_s, 0.0);
    EXPECT_EQ(r.stash.take_gathers().size(), static_cast<size_t>(kMicroBatches * p.offload.gathers));
    // A wait record per read-back: the gathers' and the plain host holds'.
    size_t reads = 0;
    for (const checkpoint::StashEntry& e : layout.entries) reads += e.use_op >= 0 ? 1 : 0;
    EXPECT_EQ(r.stash.take_waits().size(), kMicroBatches * reads);
  });
  expect_all_ok(errors);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool host : {false, true})
    for (bool contiguous : {false, true})
      for (int depth = 0; depth <= 3; ++depth) out.push_back({2, host, contiguous, depth, false, 0});
  for (bool host : {false, true})
    for (bool contiguous : {false, true}) out.push_back({4, host, contiguous, 1, false, 0});
  out.push_back({2, false, false, 1, true, 0});
  out.push_back({4, true, true, 2, true, 0});
  // Holds below the threshold stay whole on the device (a_4, a_5) or go to the host whole.
  out.push_back({2, false, false, 1, false, 200});
  out.push_back({3, true, false, 1, false, 200});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, StashPartitionTest, ::testing::ValuesIn(cases()), name_of);

// A rank that gives up before a gather: it aborts its communicator (as the engine does when a
// step throws, Note [Comm failure]) and throws. The peer's fetch fails with the comm error,
// naming this rank, the group and the op, well within the timeout, and its stash returns
// every byte.
void peer_failure(bool abort_comm) {
  const ChainCosts costs = chain();
  const Schedule s = schedule_of({2, false, false, 1, false, 0}, costs);
  const OffloadLayout layout = checkpoint::layout_offload(s, costs, 1, false, 2);
  // The first op that prefetches.
  int first = static_cast<int>(s.ops.size());
  for (const checkpoint::StashEntry& e : layout.entries) first = std::min(first, e.prefetch_op);
  struct RankThrew : std::runtime_error {
    RankThrew() : std::runtime_error("rank 1 threw before the gather") {}
  };
  double failed_after_s = 0.0;
  size_t leftover = 1, pinned_leftover = 1;
  const auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    Rank r(rank, 2, std::move(store), false);
    r.stash.prepare(layout);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      run_micro_batch(r, s, 0, [&](size_t k) {
        if (rank != 1 || static_cast<int>(k) != first) return;
        if (abort_comm) r.tp->abort("rank 1 gave up");
        throw RankThrew();
      });
    } catch (...) {
      if (rank == 0) {
        failed_after_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        leftover = r.allocator.stats().requested_bytes;
        pinned_leftover = r.pinned.stats().in_use_bytes;
      }
      throw;
    }
  });
  ASSERT_TRUE(errors[1]);
  EXPECT_EQ(what_of(errors[1]), "rank 1 threw before the gather");
  ASSERT_TRUE(errors[0]) << "rank 0 finished although rank 1 never gathered";
  const std::string msg = what_of(errors[0]);
  EXPECT_THAT(msg, HasSubstr("rank 0 of tp: all_gather of "));
  EXPECT_THAT(msg, HasSubstr(" u8 failed"));
  try {
    std::rethrow_exception(errors[0]);
  } catch (const PeerError&) {
  } catch (const TimeoutError&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank 0 ended with neither PeerError nor TimeoutError: " << e.what();
  }
  EXPECT_LT(failed_after_s, kTimeoutS + 2.0);
  EXPECT_EQ(leftover, 0u);  // abort() returned every device byte
  EXPECT_EQ(pinned_leftover, 0u);
}

TEST(StashPartitionFailure, PeerThatAbortsItsCommunicatorFailsTheGather) { peer_failure(true); }
TEST(StashPartitionFailure, PeerThatThrowsFailsTheGather) { peer_failure(false); }

TEST(StashPartitionMisuse, PartitionedLayoutsNeedTheTpCommunicatorOfTheirSize) {
  const ChainCosts costs = chain();
  const Schedule s = schedule_of({2, false, false, 1, false, 0}, costs);
  const auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    {
      Rank none(rank, 2, store, false, /*with_tp=*/false);
      try {
        none.stash.prepare(checkpoint::layout_offload(s, costs, 1, false, 2));
        ADD_FAILURE() << "prepare without a tp communicator";
      } catch (const InvalidArgument& e) {
        EXPECT_THAT(e.what(), HasSubstr("StashOptions::tp"));
        EXPECT_THAT(e.what(), HasSubstr("activation_checkpointing.partition_activations"));
      }
      EXPECT_TRUE(none.stash.layout().empty());
      // A layout without partitioned entries needs none.
      EXPECT_NO_THROW(none.stash.prepare(OffloadLayout{}));
    }
  });
  expect_all_ok(errors);
  const auto sized = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    Rank r(rank, 2, std::move(store), false);
    try {
      r.stash.prepare(checkpoint::layout_offload(s, costs, 1, false, 4));
      ADD_FAILURE() << "prepare of a 4-way layout on a group of 2";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("partitions 5 checkpoints 4 ways"));
      EXPECT_THAT(e.what(), HasSubstr("group 'tp') has 2 ranks"));
    }
    EXPECT_EQ(r.allocator.stats().requested_bytes, 0u);
    // A partitioned hold must be the planned size on every rank (each cuts the same blocks).
    r.stash.prepare(checkpoint::layout_offload(s, costs, 1, false, 2));
    r.stash.begin(0);
    tensor::Tensor small = tensor::Tensor::empty(r.allocator, tensor::Shape{7, 12}, tensor::DType::kF32, Category::kActivations);
    EXPECT_THROW(r.stash.offload(0, small), InvalidArgument);
    r.stash.abort();
  });
  expect_all_ok(sized);
}

}  // namespace
}  // namespace porter::offload
