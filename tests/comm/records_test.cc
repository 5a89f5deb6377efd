// Comm records (Note [Comm records]): one per finished op with its group, label, count, type
// and bytes, timed on the comm stream; nothing kept while recording is off; CommLabel scopes.
#include <gtest/gtest.h>

#include <vector>

#include "comm_test_util.h"

namespace porter::comm {
namespace {

using testing::run_world_ok;

TEST(CommRecords, OneRecordPerOpWithItsLabelCountTypeAndBytes) {
  for (int ws : {1, 2, 3}) {
    run_world_ok(ws, [ws](Communicator& comm, memory::Device&) {
      constexpr size_t kCount = 5;
      std::vector<float> buf(kCount * static_cast<size_t>(ws), 1.0f);
      std::vector<float> out(kCount * static_cast<size_t>(ws), 0.0f);
      std::vector<int32_t> ids(3, comm.rank());
      comm.all_reduce(buf.data(), 1, ElemType::kF32, ReduceOp::kSum).wait();  // not recorded
      comm.reset_stats();
      comm.record_ops(true);
      const auto before = std::chrono::steady_clock::now();
      {
        const CommLabel label(&comm, "bucket 3");
        comm.reduce_scatter(buf.data(), out.data(), kCount, ElemType::kF32, ReduceOp::kSum).wait();
        {
          const CommLabel inner(&comm, "grad norm");
          comm.all_reduce(out.data(), 1, ElemType::kF32, ReduceOp::kMax).wait();
        }
        comm.all_gather(out.data(), buf.data(), kCount, ElemType::kF32).wait();
      }
      EXPECT_EQ(comm.label(), "");
      comm.broadcast(ids.data(), ids.size(), ElemType::kI32, 0).wait();
      comm.barrier().wait();
      const auto after = std::chrono::steady_clock::now();
      const std::vector<CommRecord> records = comm.take_records();
      ASSERT_EQ(records.size(), 5u) << "world " << ws;
      const char* ops[] = {"reduce_scatter", "all_reduce", "all_gather", "broadcast", "barrier"};
      const char* labels[] = {"bucket 3", "grad norm", "bucket 3", "", ""};
      const size_t counts[] = {kCount, 1, kCount, 3, 0};
      const uint64_t bytes[] = {kCount * 4 * static_cast<uint64_t>(ws), 4, kCount * 4, 12, 0};
      uint64_t sum = 0;
      for (size_t i = 0; i < records.size(); ++i) {
        const CommRecord& r = records[i];
        EXPECT_EQ(r.op, ops[i]) << i;
        EXPECT_EQ(r.group, "world") << i;
        EXPECT_EQ(r.label, labels[i]) << i;
        EXPECT_EQ(r.count, counts[i]) << i;
        EXPECT_EQ(r.bytes, bytes[i]) << i;
        EXPECT_EQ(r.has_payload, i != 4) << i;
        EXPECT_FALSE(r.failed) << i;
        EXPECT_LE(before, r.start) << i;
        EXPECT_LE(r.start, r.end) << i;
        EXPECT_LE(r.end, after) << i;
        if (i > 0) {
          EXPECT_LE(records[i - 1].end, r.start) << i;  // one comm stream, in order
        }
        sum += r.bytes;
      }
      EXPECT_EQ(records[3].type, ElemType::kI32);
      EXPECT_EQ(records[0].type, ElemType::kF32);
      EXPECT_EQ(sum, comm.stats().payload_bytes);
      EXPECT_TRUE(comm.take_records().empty());  // handed over once
      EXPECT_EQ(comm.dropped_records(), 0u);
    });
  }
}

TEST(CommRecords, NothingIsKeptWhileRecordingIsOff) {
  run_world_ok(2, [](Communicator& comm, memory::Device&) {
    float x = 1.0f;
    comm.all_reduce(&x, 1, ElemType::kF32, ReduceOp::kSum).wait();
    EXPECT_TRUE(comm.take_records().empty());
    comm.record_ops(true);
    comm.all_reduce(&x, 1, ElemType::kF32, ReduceOp::kSum).wait();
    comm.record_ops(false);
    comm.all_reduce(&x, 1, ElemType::kF32, ReduceOp::kSum).wait();
    EXPECT_EQ(comm.take_records().size(), 1u);
  });
}

TEST(CommRecords, ASplitGroupNamesItself) {
  run_world_ok(2, [](Communicator& world, memory::Device&) {
    std::unique_ptr<Communicator> dp = world.split({0, 1}, "dp");
    dp->record_ops(true);
    float x = 1.0f;
    CommLabel null_comm(nullptr, "ignored");  // one rank: no communicator, nothing to label
    dp->all_reduce(&x, 1, ElemType::kF32, ReduceOp::kSum).wait();
    const std::vector<CommRecord> records = dp->take_records();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].group, "dp");
    EXPECT_TRUE(world.take_records().empty());
  });
}

}  // namespace
}  // namespace porter::comm
