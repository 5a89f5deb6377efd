// One training step's memory, recorded for plots (the memory page, cli/memory_page.h): the
// allocator's timeline during the step, each category's bytes when it began, the times of its
// schedule ops and optimizer update, and the pinned host bytes, all on one clock.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/pinned_pool.h"
#include "offload/stash.h"

namespace porter::engine {

// The parts of a step the memory page draws as bands. A Forward op of a stage that already
// ran forward in this micro-batch (Rotor's re-forwards) is a recompute, as in the trace.
enum class StepPhase : uint8_t { kForward, kRecompute, kBackward, kOptimizer };
std::string_view phase_name(StepPhase p);  // "forward", "recompute", "backward", "optimizer"

// Every time below is on the allocator's timeline clock (TimelineEntry::time_ns).
struct OpTime {
  int micro_batch = 0;
  int op = 0;  // index into the plan's schedule.ops
  StepPhase phase = StepPhase::kForward;
  int stage = 0;
  // From the top of the op's turn (its prefetches and fetch included) to its end, so that the
  // ops of a micro-batch tile it and the plan's footprint_after_op[op] holds from end_ns on.
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

struct PinnedSample {
  int64_t time_ns = 0;
  size_t bytes = 0;  // the pinned pool's in-use bytes (PinnedStats::in_use_bytes)
};

struct CopyTime {
  offload::CopyRecord::Direction direction = offload::CopyRecord::Direction::kD2H;
  int stage = 0;
  int micro_batch = 0;
  size_t bytes = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

struct StepMemory {
  int64_t step = 0;  // StepResult::step of the recorded step (1-based)
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  // Each category's current bytes just before the first entry; entries[i].category_bytes
  // then gives its bytes after each change.
  std::array<size_t, memory::kNumCategories> start_bytes{};
  std::vector<memory::TimelineEntry> entries;
  uint64_t dropped = 0;  // entries the timeline could not hold (its capacity reached)
  std::vector<OpTime> ops;
  std::optional<OpTime> optimizer;  // the update phase (stage -1), when it ran
  std::vector<PinnedSample> pinned;  // at the step's start and at every op's start and end
  std::vector<CopyTime> copies;      // the stash's D2H and H2D copies
};

// Note [Step memory record]
// Engine::record_step_memory(true) attaches a recorder that keeps the last completed step's
// StepMemory. At the start of every step it snapshots the categories and clears the
// allocator's timeline, so that a long run never fills the timeline (its entries past
// capacity would be dropped) and the record holds exactly one step; nothing else in the
// engine reads the timeline. The pinned pool has no timeline of its own: it is sampled at op
// boundaries, where the stash allocates and releases its pinned slots. A failed step leaves
// the previous record in place; unfinished() gives the failed step's record up to the moment
// it is asked for (the memory page of an out-of-memory step, cli/train_command.cc).
class StepMemoryRecorder {
 public:
  StepMemoryRecorder(memory::CachingAllocator& allocator, memory::PinnedPool& pinned)
      : allocator_(&allocator), pinned_(&pinned) {}

  void begin_step(int64_t step);
  // The current time, after sampling the pinned pool.
  int64_t op_start();
  void op_end(int micro_batch, int op, StepPhase phase, int stage, int64_t start_ns);
  void optimizer(int64_t start_ns, int64_t end_ns);
  void end_step(const std::vector<offload::CopyRecord>& copies);

  int64_t now_ns() const { return allocator_->timeline_now_ns(); }
  // The last completed step's record; null before one completes.
  const StepMemory* last() const { return last_ ? &*last_ : nullptr; }
  // The step begun and not completed (it threw), recorded until now: the ops that completed,
  // and the allocator's timeline to this moment, with what the failure's unwinding freed
  // (end_ns is now; no copies). nullopt when the last step begun completed.
  std::optional<StepMemory> unfinished() const;

 private:
  void sample_pinned();

  memory::CachingAllocator* allocator_;  // not owned; the engine's
  memory::PinnedPool* pinned_;           // not owned; the engine's
  StepMemory current_;
  bool in_step_ = false;  // between begin_step and end_step
  std::optional<StepMemory> last_;
};

}  // namespace porter::engine
