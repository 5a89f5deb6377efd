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
// With parameter offload the shard is in host memory (Note [Parameter offload] in
// zero/sharded_optimizer.h): this rank's part then goes to the buffer on the gatherer's own
// lane of the shard's host tier ("param h2d", Note [Host tier] in memory/host_tier.h), an
// event marks its end, and the comm stream waits for that event
// before the broadcasts (the one rooted here sends those bytes), and the compute stream at
// wait(u). So a prefetched unit's upload, like its broadcasts, overlaps the ops before it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "memory/host_tier.h"
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
  // Parameter offload: this rank's parts uploaded from the host (the lane's
  // memory::HostTierStats::h2d_bytes).
  uint64_t h2d_bytes = 0;
  double busy_s = 0.0;          // comm-stream time of the broadcasts
  double exposed_s = 0.0;       // host time the compute stream waited for them (and uploads)
  int64_t peak_live_elems = 0;  // gathered elements alive at once (persistent aside), at most
  size_t peak_live_bytes = 0;
  // Folds a later window in: counts, bytes and times add, the peaks take the larger.
  GatherStats& operator+=(const GatherStats& s);
};

class ParamGatherer {
 public:
  // `shard` is the rank's working shard [r*S, (r+1)*S) (the whole buffer with one rank), in
  // device memory, or in host memory of `shard_tier` (not owned; outlives the gatherer:
  // ShardedOptimizer::param_tier()), on whose lane it is uploaded; `dp` may be null (one
  // rank). `rebind` binds the model to `flat` again after views change.
  ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator, comm::Communicator* dp,
                const Partition& part, tensor::Tensor shard, std::vector<ParamUnit> units,
                int64_t max_live_elems, std::function<void()> rebind,
                memory::HostTier* shard_tier = nullptr);
  // The same for a shard in host memory of a kind not named (`shard_on_host`): its lane is
  // then one of a PageableHostTier the gatherer keeps (its copies are plain copies all the
  // same).
  ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator, comm::Communicator* dp,
                const Partition& part, tensor::Tensor shard, std::vector<ParamUnit> units,
                int64_t max_live_elems, std::function<void()> rebind, bool shard_on_host);
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

  // Parameter offload: rethrows the first error of an upload since the last call (a copy
  // stream reports errors when it is synchronized); the engine calls it before the update,
  // so a failed upload fails the step before any state changes.
  void check();

  GatherStats take_stats();

  // Moving the persistent units to host memory and back (Note [Offloaded model states] in
  // engine/states_offload.cc), between steps only (no other unit live): for_each_state calls
  // `f` on every persistent unit's buffer, gathered or not, which it may replace or drop.
  // set_away(why) unbinds them and drops the working shard when it is device memory (the
  // optimizer's, which moves it); gather(), gather_all() and refresh_persistent() then throw
  // UsageError(why). set_away("", shard) takes the shard back (ShardedOptimizer::working(),
  // returned first) and binds the units whose buffers are back.
  void for_each_state(const std::function<void(tensor::Tensor&)>& f);
  void set_away(std::string why, tensor::Tensor shard = {});
  // The upload lane's traffic and waits since construction (zero with the shard on the device).
  memory::HostTierStats host_tier_stats() const;

 private:
  ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator, comm::Communicator* dp,
                const Partition& part, tensor::Tensor shard, std::vector<ParamUnit> units,
                int64_t max_live_elems, std::function<void()> rebind,
                std::unique_ptr<memory::HostTier> owned_tier, memory::HostTier* shard_tier);
  struct UnitState {
    tensor::Tensor buffer;
    std::vector<comm::Work> works;
    std::unique_ptr<memory::Event> uploaded;  // shard on the host: this rank's part is in
    bool uploading = false;                   // the buffer once `uploaded` completes
    bool bound = false;
  };
  void wait_upload(UnitState& st);
  void issue(int u, tensor::Tensor buffer);
  void bind(int u);
  void unbind(int u);
  [[noreturn]] void throw_away(const char* what) const;

  nn::FlatParams* flat_;                 // not owned
  memory::CachingAllocator* allocator_;  // not owned
  comm::Communicator* dp_;               // not owned; null with one rank
  Partition part_;
  int rank_ = 0;
  tensor::Tensor shard_;
  std::vector<ParamUnit> units_;
  std::vector<UnitState> state_;
  int64_t max_live_elems_;
  int64_t live_elems_ = 0;
  size_t live_bytes_ = 0;
  std::function<void()> rebind_;
  std::unique_ptr<memory::HostTier> owned_tier_;  // the bool constructor's; before h2d_
  std::unique_ptr<memory::HostLane> h2d_;  // shard on the host; null otherwise
  uint64_t h2d_taken_bytes_ = 0;  // h2d_'s bytes up to the last take_stats()
  GatherStats stats_;
  std::string away_;  // non-empty: the persistent units are in host memory (set_away)
};

}  // namespace porter::zero
