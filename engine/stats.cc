// The Engine's statistics: how a step's figures are read off the allocator, the stash, the
// communicators, the reducer, the optimizer and the gatherer (Engine::record, phase 5c of
// Note [One engine step]), how they accumulate (the stats types' operator+=), and the running
// totals' accessors.
#include <algorithm>
#include <cstdio>
#include <string>

#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

namespace {

// Of a comm-stream busy time, the fraction that ran while the compute stream went on:
// 1 - exposed / busy, in [0, 1]; 0 when nothing ran.
double hidden_fraction(double busy_s, double exposed_s) {
  return busy_s > 0.0 ? std::clamp(1.0 - exposed_s / busy_s, 0.0, 1.0) : 0.0;
}

// The plan's predictions of stage 3's gathers.
void set_gather_prediction(ZeroStats& z, const checkpoint::ParamPrediction& predicted) {
  z.predicted_peak_live_elems = predicted.peak_live_elems;
  z.predicted_gathered_bytes = predicted.peak_gathered_bytes;
  z.persistent_bytes = predicted.persistent_bytes;
}

// The offloaded state's host bytes (Note [Host-state bytes per rank]): the optimizer's arrays,
// and the parameter shard apart when the parameters are offloaded.
void set_host_state(ZeroStats& z, const zero::ShardedOptimizer& optimizer) {
  const zero::HostStateBytes h = optimizer.host_state();
  z.param_offload_host_bytes = optimizer.params_offloaded() ? h.params : 0;
  z.offload_host_bytes = h.total() - z.param_offload_host_bytes;
}

}  // namespace

// Counters add, peaks take the maximum, fractions follow the sums, and what describes the
// run now (layout, loss scale, predictions, host bytes) is the later operand's.
ZeroStats& operator+=(ZeroStats& a, const ZeroStats& b) {
  a.zero_stage = b.zero_stage;
  a.world_size = b.world_size;
  a.shard_elems = b.shard_elems;
  a.padded_elems = b.padded_elems;
  a.comm_bytes += b.comm_bytes;
  a.comm_busy_s += b.comm_busy_s;
  a.comm_exposed_s += b.comm_exposed_s;
  a.reduce_busy_s += b.reduce_busy_s;
  a.reduce_exposed_s += b.reduce_exposed_s;
  a.reduce_hidden_fraction = hidden_fraction(a.reduce_busy_s, a.reduce_exposed_s);
  a.loss_scale = b.loss_scale;
  a.skipped_steps += b.skipped_steps;
  a.gathers += b.gathers;
  a.gathered_bytes += b.gathered_bytes;
  a.gather_busy_s += b.gather_busy_s;
  a.gather_exposed_s += b.gather_exposed_s;
  a.gather_hidden_fraction = hidden_fraction(a.gather_busy_s, a.gather_exposed_s);
  a.peak_live_elems = std::max(a.peak_live_elems, b.peak_live_elems);
  a.peak_gathered_bytes = std::max(a.peak_gathered_bytes, b.peak_gathered_bytes);
  a.predicted_peak_live_elems = b.predicted_peak_live_elems;
  a.predicted_gathered_bytes = b.predicted_gathered_bytes;
  a.persistent_bytes = b.persistent_bytes;
  a.offload_d2h_bytes += b.offload_d2h_bytes;
  a.offload_d2h_overlapped_bytes += b.offload_d2h_overlapped_bytes;
  a.offload_d2h_wait_s += b.offload_d2h_wait_s;
  a.offload_h2d_bytes += b.offload_h2d_bytes;
  a.offload_cpu_update_s += b.offload_cpu_update_s;
  a.offload_exposed_s += b.offload_exposed_s;
  a.offload_host_bytes = b.offload_host_bytes;
  a.param_offload_host_bytes = b.param_offload_host_bytes;
  a.param_offload_h2d_bytes += b.param_offload_h2d_bytes;
  a.param_offload_d2h_bytes += b.param_offload_d2h_bytes;
  return a;
}

TensorParallelStats& operator+=(TensorParallelStats& a, const TensorParallelStats& b) {
  a.tp = b.tp;
  a.sequence_parallel = b.sequence_parallel;
  a.comm_bytes += b.comm_bytes;
  a.comm_busy_s += b.comm_busy_s;
  a.gathers += b.gathers;
  a.gathered_bytes += b.gathered_bytes;
  a.gather_busy_s += b.gather_busy_s;
  a.gather_exposed_s += b.gather_exposed_s;
  a.hidden_fraction = hidden_fraction(a.gather_busy_s, a.gather_exposed_s);
  a.partitioned_bytes = std::max(a.partitioned_bytes, b.partitioned_bytes);
  a.predicted_partitioned_bytes = b.predicted_partitioned_bytes;
  return a;
}

// Phase 5c: the step's figures, and the running totals.
void Engine::record(const std::vector<io::HostBatch>& micro_batches, const comm::CommStats& comm0,
                    const zero::ReducerStats& reduced, StepResult& r) {
  Impl& im = *impl_;
  ++step_;
  last_batches_ = micro_batches;
  const memory::MemoryStats s = allocator_->stats();
  r.step = step_;
  ZeroStats& z = r.zero;
  z.zero_stage = run_.zero_stage();
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  if (comm::Communicator* comm = im.comm()) {
    const comm::CommStats comm1 = comm->stats();
    z.comm_bytes = comm1.payload_bytes - comm0.payload_bytes;
    z.comm_busy_s = comm1.busy_s - comm0.busy_s;
  }
  z.comm_exposed_s = im.optimizer->take_exposed_s() + reduced.reduce_exposed_s;
  z.reduce_busy_s = reduced.reduce_busy_s;
  z.reduce_exposed_s = reduced.reduce_exposed_s;
  z.reduce_hidden_fraction = hidden_fraction(reduced.reduce_busy_s, reduced.reduce_exposed_s);
  z.loss_scale = im.optimizer->loss_scale();
  z.skipped_steps = r.skipped ? 1 : 0;
  if (im.optimizer->offloaded() || im.optimizer->params_offloaded()) {
    const zero::OffloadStats o = im.optimizer->take_offload_stats();
    z.param_offload_d2h_bytes = o.param_d2h_bytes;
    z.offload_d2h_bytes = o.d2h_bytes;
    z.offload_d2h_overlapped_bytes = o.d2h_overlapped_bytes;
    z.offload_d2h_wait_s = o.d2h_wait_s;
    z.offload_h2d_bytes = o.h2d_bytes;
    z.offload_cpu_update_s = o.cpu_update_s;
    z.offload_exposed_s = o.exposed_s;
  }
  set_host_state(z, *im.optimizer);
  set_gather_prediction(z, im.plan.prediction.params);
  if (im.gatherer) {
    const zero::GatherStats g = im.gatherer->take_stats();
    z.param_offload_h2d_bytes = g.h2d_bytes;
    z.gathers = g.gathers;
    z.gathered_bytes = g.gathered_bytes;
    z.gather_busy_s = g.busy_s;
    z.gather_exposed_s = g.exposed_s;
    z.gather_hidden_fraction = hidden_fraction(g.busy_s, g.exposed_s);
    z.peak_live_elems = g.peak_live_elems;
    z.peak_gathered_bytes = g.peak_live_bytes;
    z.comm_exposed_s += g.exposed_s;
  }
  im.zero_total += z;
  TensorParallelStats& tps = r.tensor_parallel;
  tps.tp = tp_size();
  tps.sequence_parallel = run_.sequence_parallel();
  if (comm::Communicator* tp = im.tp_comm()) {
    const comm::CommStats tp1 = tp->stats();
    tps.comm_bytes = tp1.payload_bytes - im.tp_comm0.payload_bytes;
    tps.comm_busy_s = tp1.busy_s - im.tp_comm0.busy_s;
  }
  tps.gathers = r.offload.gathers;
  tps.gathered_bytes = r.offload.gathered_bytes;
  tps.gather_busy_s = r.offload.gather_busy_s;
  tps.gather_exposed_s = r.offload.gather_exposed_s;
  tps.hidden_fraction = hidden_fraction(tps.gather_busy_s, tps.gather_exposed_s);
  tps.partitioned_bytes = r.offload.slice_peak_bytes;
  tps.predicted_partitioned_bytes = im.plan.prediction.offload.peak_slice_bytes;
  im.tp_total += tps;
  // Token batches count tokens; a batch of named tensors counts its input's rows (samples).
  const int64_t per_micro_batch =
      micro_batches[0].batch * micro_batches[0].seq > 0
          ? micro_batches[0].batch * micro_batches[0].seq
          : run_.shape.micro_batch;
  r.tokens = static_cast<int64_t>(micro_batches.size()) * per_micro_batch;
  r.peak_activation_bytes = s.peak_activation_bytes;
  r.peak_bytes = s.peak_requested_bytes;
  im.recompute_s_per_step.push_back(r.recompute_s);
}

TensorParallelStats Engine::tp_stats() const { return impl_->tp_total; }

ZeroStats Engine::zero_stats() const {
  const Impl& im = *impl_;
  ZeroStats z = im.zero_total;
  z.zero_stage = run_.zero_stage();
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  z.loss_scale = im.optimizer->loss_scale();
  set_gather_prediction(z, im.plan.prediction.params);
  set_host_state(z, *im.optimizer);
  return z;
}

void Engine::reset_peaks() {
  impl_->peak_by_category.fill(0);
  impl_->peak_requested_bytes = 0;
  impl_->peak_activation_bytes = 0;
  impl_->offload_total = offload::StashStats{};
  impl_->zero_total = ZeroStats{};
  impl_->tp_total = TensorParallelStats{};
  impl_->stash->reset_stats();
  allocator_->reset_peak();
}

void Engine::record_step_memory(bool on) {
  Impl& im = *impl_;
  if (!on) {
    im.step_memory.reset();
  } else if (!im.step_memory) {
    im.step_memory = std::make_unique<StepMemoryRecorder>(*allocator_, *im.pinned);
  }
}

const StepMemory* Engine::last_step_memory() const {
  return impl_->step_memory ? impl_->step_memory->last() : nullptr;
}

std::optional<StepMemory> Engine::unfinished_step_memory() const {
  return impl_->step_memory ? impl_->step_memory->unfinished() : std::nullopt;
}

offload::StashStats Engine::offload_stats() const { return impl_->offload_total; }
const std::vector<offload::CopyRecord>& Engine::last_copies() const { return impl_->copies; }
const std::vector<offload::WaitRecord>& Engine::last_waits() const { return impl_->waits; }
double Engine::link_bytes_per_s() const { return impl_->link_bytes_per_s; }
memory::PinnedPool& Engine::pinned_pool() { return *impl_->pinned; }

std::string WallClockBreakdown::format(int rank) const {
  char line[320];
  std::snprintf(line, sizeof line,
                "[Rank %d] time (ms) | fwd: %.2f | bwd: %.2f | bwd_inner: %.2f | "
                "bwd_allreduce: %.2f | step: %.2f | recompute: %.2f | offload_wait: %.2f",
                rank, forward_ms, backward_ms(), backward_inner_ms, reduce_ms, optimizer_ms,
                recompute_ms, offload_wait_ms);
  return line;
}

}  // namespace porter::engine
