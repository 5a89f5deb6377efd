// The cost model of a chain of stages: what each stage's forward, recompute and backward cost
// in time and in activation bytes, under each save option. Costs come from a profiling pass
// (engine/costs.h) or from the analytic model of the built-in transformers (models/analytic.h);
// the planner and the simulator only read them.
//
// Note [Activation bytes]
// Every byte figure here is of the activation footprint: the allocator's activations +
// checkpoints categories (memory::MemoryStats::activation_bytes). Figures are *deltas*,
// measured on one stage in isolation, relative to the moment the operation starts. Because
// the footprint is a plain sum of requested bytes, deltas add exactly: the simulator
// (checkpoint/simulate.h) reproduces a whole step's peak from them to the byte. Stage
// inputs and outputs are accounted as separate objects (input_bytes, output_bytes), so a
// delta never counts them twice:
//   forward_peak_bytes   peak above the start of the forward (input alive), including the
//                        output while it is being produced;
//   saved_bytes          what the stage's tape holds after its forward, not counting the
//                        stage's input or output even when the tape references them (those
//                        are the tape_refs_* flags);
//   recompute_*          the same for the recompute that completes a partial tape.
// Workspace (backward temporaries, activation gradients) is tracked separately in
// *_total_peak_bytes, the peak of all categories above the start, for the total-peak
// prediction.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace porter::checkpoint {

// How a stage's forward saves for its backward (Rockmate's per-stage options).
enum class SaveOption : uint8_t {
  kKeep,        // save everything backward reads (nn::SaveMode::kSaveAll); no recompute
  kSelective,   // keep the outputs of the op kinds the selective OpPolicy keeps; the rest is
                // recomputed just before the stage's backward
  kCheckpoint,  // keep nothing (OpPolicy::keep_none); the whole stage is recomputed
};
inline constexpr int kNumSaveOptions = 3;
std::string_view save_option_name(SaveOption o);  // "keep", "selective", "checkpoint"

// One stage under one save option.
struct OptionCost {
  bool available = false;  // e.g. selective is unavailable for a stage without attention
  double forward_s = 0.0;
  size_t forward_peak_bytes = 0;
  size_t forward_total_peak_bytes = 0;
  size_t saved_bytes = 0;
  bool tape_refs_input = false;   // after the forward (kKeep only; partial tapes never do)
  bool tape_refs_output = false;
  // kSelective and kCheckpoint: the recompute before backward, starting from the saved tape
  // with the input alive. Zero for kKeep.
  double recompute_s = 0.0;
  size_t recompute_peak_bytes = 0;     // above (start + saved_bytes)
  size_t recompute_total_peak_bytes = 0;
  size_t recompute_saved_bytes = 0;    // added to the tape by the recompute
  double recompute_flops = 0.0;        // FLOPs of the recompute (analytic; 0 when unknown)
  bool operator==(const OptionCost&) const = default;
};

struct StageCost {
  std::string name;         // "embedding", "block.3", "head"
  bool is_block = false;    // a repeated layer (uniform/block count these)
  size_t input_bytes = 0;   // of the stage's input in the footprint (0 for token ids)
  size_t output_bytes = 0;  // of its output
  double backward_s = 0.0;
  size_t backward_total_peak_bytes = 0;  // all categories above the start of backward
  // Forward FLOPs (analytic model; 0 when unknown). Recompute FLOPs scale with it.
  double forward_flops = 0.0;
  std::array<OptionCost, kNumSaveOptions> options{};

  const OptionCost& option(SaveOption o) const { return options[static_cast<size_t>(o)]; }
  OptionCost& option(SaveOption o) { return options[static_cast<size_t>(o)]; }
  bool operator==(const StageCost&) const = default;
};

// Note [Gathered parameters]
// At ZeRO stage 3 (docs/zero.md, "Stage 3") every rank holds only its shard of the working
// parameters; a stage's parameters are all-gathered into a buffer of their own (memory
// category `params`) before an op of the stage runs and freed after it, as the gather plan
// of the schedule says (checkpoint/param_gather.h). Those buffers count against the same
// budget as the activations (Prediction::peak_budget_bytes). A gather unit is one stage's
// flat parameter range (its entries, each aligned, Note [Gradient buckets] in
// zero/buckets.h); a stage may read other units too (the head reads the tied embedding), so
// `reads` lists, per stage, the units its forward, recompute and backward need. A persistent
// unit (smaller than stage3_param_persistence_threshold) stays gathered for the whole run and
// is not planned.
struct GatherUnit {
  std::string name;       // the stage's, e.g. "block.3"
  int64_t elems = 0;      // of the gathered buffer (the stage's flat range)
  size_t bytes = 0;       // elems x the working dtype's size
  bool persistent = false;
  bool operator==(const GatherUnit&) const = default;
};
struct ParamGather {
  bool enabled = false;                 // ZeRO stage 3
  std::vector<GatherUnit> units;        // one per stage
  std::vector<std::vector<int>> reads;  // per stage: the units it reads, its own first
  // zero_optimization's stage3_* knobs, in elements (Note [Gather plan]).
  int64_t prefetch_elems = 50'000'000;       // stage3_prefetch_bucket_size
  int64_t max_live_elems = 1'000'000'000;    // stage3_max_live_parameters
  int64_t max_reuse_distance = 1'000'000'000;  // stage3_max_reuse_distance
  size_t persistent_bytes() const {
    size_t b = 0;
    for (const GatherUnit& u : units) b += u.persistent ? u.bytes : 0;
    return b;
  }
  bool operator==(const ParamGather&) const = default;
};

// Note [Gradient buckets in the footprint]
// ZeRO's gradient reducer (zero/reducer.h) allocates buffers of category `comm` around the
// backward: at stages 2 and 3 a contiguous buffer per gradient bucket, allocated just before
// the backward of the bucket's highest writing stage and released once the bucket is issued
// or reduced; and a packed copy per bucket that a reduce-scatter sends, alive until its
// collective completes. Backward runs once per stage, from the last stage down to 0, whatever
// the schedule, so the bytes alive depend only on which backward ran last: per stage s,
//   between  the buffers alive during the forwards and recomputes that run after the
//            backward of stage s + 1 and before that of stage s (0 before the first backward);
//   during   those alive during the backward of stage s;
//   after    the most alive at any moment right after the backward of stage s, while the
//            reducer issues and completes buckets (for stage 0 this includes the flush at the
//            end of the micro-batch).
// They count in the total peak only (not in the activation footprint or a memory budget).
// zero/bucket_model.h computes them from the reducer's buckets for one micro-batch that
// reduces (every micro-batch at stages 2 and 3, the last one of a step below), so the
// prediction is the step's worst micro-batch.
struct CommStage {
  size_t between = 0;
  size_t during = 0;
  size_t after = 0;
  bool operator==(const CommStage&) const = default;
};

// The source of costs whose times a device model predicted: the prefix, then its name.
inline constexpr std::string_view kDeviceModelSourcePrefix = "device model ";

struct ChainCosts {
  std::vector<StageCost> stages;
  // ZeRO stage 3's gathered parameters (Note [Gathered parameters]); disabled otherwise.
  ParamGather params;
  // ZeRO's gradient buckets per stage (Note [Gradient buckets in the footprint]); empty for
  // none.
  std::vector<CommStage> comm;
  // "profiled" (times measured), "analytic" (bytes exact, times unknown: 0), or "device
  // model <name>" (the analytic model's, with times predicted from a device's figures:
  // docs/planning.md).
  std::string source;
  // The op kinds selective recompute recomputes, e.g. "attention".
  std::string selective_ops;
  // Measured or predicted times (the planner, simulator and reports use them alike).
  bool has_times() const {
    return source == "profiled" || source.starts_with(kDeviceModelSourcePrefix);
  }
  int num_stages() const { return static_cast<int>(stages.size()); }
};

}  // namespace porter::checkpoint
