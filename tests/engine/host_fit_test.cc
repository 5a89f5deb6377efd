// Note [Host fit]: the host's bytes per rank and per node, and the verdict against the
// machine's memory and the pinned limit.
#include <gtest/gtest.h>

#include "engine/host_fit.h"
#include "engine/run_options.h"

namespace porter::engine {
namespace {

RunOptions offload_run(bool pin_opt, bool pin_params, memory::DeviceKind kind) {
  RunOptions r;
  r.device.kind = kind;
  r.optimizer.zero_stage = 3;
  r.optimizer.offload.enabled = true;
  r.optimizer.offload.pin_memory = pin_opt;
  r.optimizer.param_offload.enabled = true;
  r.optimizer.param_offload.pin_memory = pin_params;
  r.pinned_limit_bytes = size_t{1} << 40;
  return r;
}

constexpr size_t kGiB = size_t{1} << 30;

TEST(HostFit, PerNodeIsRanksTimesPerRankWithTheSimulatedDeviceOnCpuOnly) {
  const zero::HostStateBytes states{12 * kGiB, 4 * kGiB, 2 * kGiB};
  const HostFit cpu =
      host_fit(offload_run(true, false, memory::DeviceKind::kCpu), states, kGiB, kGiB, 8, 512 * kGiB);
  EXPECT_EQ(cpu.per_rank_bytes(), 20 * kGiB);  // states 18 + stash 1 + device 1
  EXPECT_EQ(cpu.pinned_per_rank_bytes(), 17 * kGiB);  // optimizer, grads and the stash
  EXPECT_EQ(cpu.per_node_bytes(), 160 * kGiB);
  EXPECT_TRUE(cpu.fits());
  EXPECT_EQ(cpu.verdict(), "host fits: 160.00 GiB per node (8 ranks x 20.00 GiB) of the machine's 512.00 GiB");
  const HostFit gpu =
      host_fit(offload_run(true, true, memory::DeviceKind::kCuda), states, 0, kGiB, 8, 128 * kGiB);
  EXPECT_EQ(gpu.per_rank_bytes(), 18 * kGiB);  // the GPU's memory is not the host's
  EXPECT_EQ(gpu.pinned_per_rank_bytes(), 18 * kGiB);
  EXPECT_FALSE(gpu.fits());
  EXPECT_EQ(gpu.verdict(), "host does not fit: needs 144.00 GiB per node (8 ranks x 18.00 GiB), "
                           "16.00 GiB more than the machine's 128.00 GiB");
}

TEST(HostFit, PinnedBytesOverThePinnedLimitDoNotFit) {
  RunOptions r = offload_run(true, true, memory::DeviceKind::kCuda);
  r.pinned_limit_bytes = 16 * kGiB;
  const HostFit h = host_fit(r, zero::HostStateBytes{12 * kGiB, 4 * kGiB, 2 * kGiB}, 0, 0, 1, 64 * kGiB);
  EXPECT_TRUE(h.fits_machine());
  EXPECT_FALSE(h.fits());
  EXPECT_NE(h.verdict().find("18.00 GiB pinned per rank, over porter.device.pinned_limit 16.00 GiB"),
            std::string::npos)
      << h.verdict();
  r.optimizer.offload.pin_memory = false;  // pageable optimizer arrays
  EXPECT_TRUE(host_fit(r, zero::HostStateBytes{12 * kGiB, 4 * kGiB, 2 * kGiB}, 0, 0, 1, 64 * kGiB).fits());
  // Unset, the limit is the devices' default (8 GiB): 9 GiB pinned does not fit.
  r.pinned_limit_bytes = 0;
  r.optimizer.offload.pin_memory = true;
  const HostFit d = host_fit(r, zero::HostStateBytes{6 * kGiB, 2 * kGiB, kGiB}, 0, 0, 1, 64 * kGiB);
  EXPECT_EQ(d.in.pinned_limit, memory::kDefaultPinnedLimitBytes);
  EXPECT_FALSE(d.fits_pinned());
}

// With periodic checkpoints the snapshot a background write holds is host memory too: the
// rank's parameters and optimizer state, on the device and on the host (not its gradients).
TEST(HostFit, ACheckpointSnapshotCountsParamsAndOptimizerStateWhereverTheyLive) {
  Forecast f;
  f.model_states.params = 2 * kGiB;
  f.model_states.grads = 2 * kGiB;
  f.model_states.optimizer = 3 * kGiB;
  f.host_states = zero::HostStateBytes{5 * kGiB, 7 * kGiB, 11 * kGiB};  // optimizer, grads, params
  EXPECT_EQ(checkpoint_snapshot_bytes(f), (2 + 3 + 5 + 11) * kGiB);
  HostFit h = host_fit(offload_run(true, true, memory::DeviceKind::kCuda), f.host_states, 0, 0, 2,
                       512 * kGiB);
  const size_t without = h.per_rank_bytes();
  h.in.checkpoint_snapshot_bytes = checkpoint_snapshot_bytes(f);
  EXPECT_EQ(h.per_rank_bytes(), without + 21 * kGiB);
  EXPECT_EQ(h.per_node_bytes(), 2 * (without + 21 * kGiB));
}

TEST(HostFit, ThisMachineHasMemory) { EXPECT_GT(machine_memory_bytes(), size_t{1} << 28); }

}  // namespace
}  // namespace porter::engine
