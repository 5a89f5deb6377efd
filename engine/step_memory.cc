// The step memory recorder (Note [Step memory record] in step_memory.h).
#include "engine/step_memory.h"

#include <utility>

namespace porter::engine {

std::string_view phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::kForward: return "forward";
    case StepPhase::kRecompute: return "recompute";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kOptimizer: return "optimizer";
  }
  return "?";
}

void StepMemoryRecorder::begin_step(int64_t step) {
  current_ = StepMemory{};
  current_.step = step;
  const memory::MemoryStats s = allocator_->stats();
  for (size_t c = 0; c < memory::kNumCategories; ++c) {
    current_.start_bytes[c] = s.by_category[c].current_bytes;
  }
  allocator_->clear_timeline();
  current_.start_ns = now_ns();
  in_step_ = true;
  sample_pinned();
}

std::optional<StepMemory> StepMemoryRecorder::unfinished() const {
  if (!in_step_) return std::nullopt;
  StepMemory s = current_;
  s.end_ns = now_ns();
  s.entries = allocator_->timeline();
  s.dropped = allocator_->timeline_dropped();
  return s;
}

void StepMemoryRecorder::sample_pinned() {
  current_.pinned.push_back({now_ns(), pinned_->stats().in_use_bytes});
}

int64_t StepMemoryRecorder::op_start() {
  sample_pinned();
  return current_.pinned.back().time_ns;
}

void StepMemoryRecorder::op_end(int micro_batch, int op, StepPhase phase, int stage,
                                int64_t start_ns) {
  sample_pinned();
  current_.ops.push_back({micro_batch, op, phase, stage, start_ns, current_.pinned.back().time_ns});
}

void StepMemoryRecorder::optimizer(int64_t start_ns, int64_t end_ns) {
  current_.optimizer = OpTime{0, -1, StepPhase::kOptimizer, -1, start_ns, end_ns};
}

void StepMemoryRecorder::end_step(const std::vector<offload::CopyRecord>& copies) {
  sample_pinned();
  current_.end_ns = current_.pinned.back().time_ns;
  current_.entries = allocator_->timeline();
  current_.dropped = allocator_->timeline_dropped();
  for (const offload::CopyRecord& c : copies) {
    current_.copies.push_back({c.direction, c.stage, c.micro_batch, c.bytes,
                               allocator_->timeline_ns(c.start), allocator_->timeline_ns(c.end)});
  }
  last_ = std::move(current_);
  current_ = StepMemory{};
  in_step_ = false;
}

}  // namespace porter::engine
