// porter::zero::ParamGatherer: ZeRO stage 3's parameter gathers. Every rank holds only its
// shard of the working parameters (ShardedOptimizer::working()); a stage's parameters are
// gathered from the shards into a buffer of their own before the stage runs and freed after,
// at the points the gather plan names (Note [Gather plan] in checkpoint/param_gather.h; the
// engine calls gather, wait and release). See docs/zero.md, "Stage 3".
//
// Note [Stage 3 gather]
// A unit is one stage's flat range [lo, hi) (Note [Gradient buckets]); it straddles the
// shards of the ranks q whose [q*S, (q+1)*S) it meets, usually one or two of them (Note
// [Flat partition]). gather(u) allocates the unit's buffer (hi - lo elements, compute dtype,
// category `params`), copies this rank's part I_r = [lo, hi) ∩ [r*S, (r+1)*S) into it on
// the compute stream, and issues on the comm stream one broadcast per owner q of I_q, rooted
// at q, in place in the buffer: every rank then receives exactly the unit's bytes (no padding
// to equal blocks, as an all-gather of the unit would need), in owner order. The values are
// the shards' working copies, which AdamW wrote in the same pass as at stage 2, so a gathered
// stage is bitwise the stage-2 stage. wait(u) makes the compute stream wait for the
// broadcasts and binds the unit's entries to views of the buffer (Note [Gradient views]);
// release(u) unbinds them and frees the buffer. The layers never keep a parameter in a tape
// (Note [Layer contract]), so the buffer's bytes go back to the allocator at once.
// A persistent unit (smaller than stage3_param_persistence_threshold) keeps its buffer for
// the engine's lifetime: refresh_persistent() gathers it again after every update.
// Live elements (gathered or in flight, persistent ones aside) are checked against
// stage3_max_live_parameters at every gather.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "nn/layer.h"
#include "zero/partition.h"

namespace porter::zero {

struct ParamUnit {
  std::string name;              // the stage's
  int64_t lo = 0, hi = 0;        // flat range
  std::vector<size_t> entries;   // layout entries inside it
  bool persistent = false;
  int64_t elems() const { return hi - lo; }
};

// Since the last take_stats().
struct GatherStats {
  int64_t gathers = 0;
  uint64_t gathered_bytes = 0;  // received from other ranks
  double busy_s = 0.0;          // comm-stream time of the broadcasts
  double exposed_s = 0.0;       // host time the compute stream waited for them
  int64_t peak_live_elems = 0;  // gathered elements alive at once (persistent aside), at most
  size_t peak_live_bytes = 0;
};

class ParamGatherer {
 public:
  // `shard` is the rank's working shard [r*S, (r+1)*S) (the whole buffer with one rank); `dp`
  // may be null (one rank). `rebind` binds the model to `flat` again after views change.
  ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator, comm::Communicator* dp,
                const Partition& part, nn::Tensor shard, std::vector<ParamUnit> units,
                int64_t max_live_elems, std::function<void()> rebind);
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;
  ~ParamGatherer();

  int num_units() const { return static_cast<int>(units_.size()); }
  const ParamUnit& unit(int u) const { return units_.at(static_cast<size_t>(u)); }
  bool live(int u) const { return state_.at(static_cast<size_t>(u)).buffer.defined(); }
  int64_t live_elems() const { return live_elems_; }

  // Note [Stage 3 gather]. gather(u) of a live unit, wait or release of one that is not,
  // throws InternalError (the plan and the engine disagree).
  void gather(int u);
  void wait(int u);
  void release(int u);
  // Every persistent unit gathered (again) and bound: after the parameters changed.
  void refresh_persistent();
  // Every non-persistent unit gathered and bound, or released (profiling and evaluation run
  // stages outside a schedule).
  void gather_all();
  void release_all();
  // After a failure: every non-persistent buffer dropped without waiting on the comm stream
  // (the communicator is aborted).
  void abort();

  GatherStats take_stats();

 private:
  struct UnitState {
    nn::Tensor buffer;
    std::vector<comm::Work> works;
    bool bound = false;
  };
  void issue(int u, nn::Tensor buffer);
  void bind(int u);
  void unbind(int u);

  nn::FlatParams* flat_;                 // not owned
  memory::CachingAllocator* allocator_;  // not owned
  comm::Communicator* dp_;               // not owned; null with one rank
  Partition part_;
  int rank_ = 0;
  nn::Tensor shard_;
  std::vector<ParamUnit> units_;
  std::vector<UnitState> state_;
  int64_t max_live_elems_;
  int64_t live_elems_ = 0;
  size_t live_bytes_ = 0;
  std::function<void()> rebind_;
  GatherStats stats_;
};

}  // namespace porter::zero
