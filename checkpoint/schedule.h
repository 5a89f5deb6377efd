// A schedule: the exact sequence of stage forwards, recomputes and backwards of one
// micro-batch. Every policy compiles to one (checkpoint/planner.h); the engine executes it
// (engine/engine.cc) and the replay below predicts its activation peak and recompute time
// from a ChainCosts without running anything (checkpoint/simulate.h adds the offload).
//
// Note [Schedule semantics]
// Stage i maps activation a_i to a_{i+1}; a_0 is the token ids, and the last stage's output
// is the loss. The executor (engine or simulator) keeps this state:
//   cur      the activation the last forward produced, a_{cur_stage};
//   held[i]  a_i, held as a checkpoint (memory category `checkpoints`) until backward i;
//   tape[i]  empty, partial (a kSelective/kCheckpoint forward left a recompute plan), or
//            full (a kKeep forward, or a recompute, saved everything backward reads);
//   grad     the gradient of a_g, starting at g = n (the loss needs none).
// Ops:
//   Forward(i, save, hold)  input = cur if cur_stage == i, else held[i] (else invalid). If
//                           hold, held[i] = input. Runs the forward with `save`; tape[i]
//                           becomes full (kKeep) or partial. cur = a_{i+1}. The first
//                           forward of the last stage yields the micro-batch's loss.
//   Recompute(i)            tape[i] must be partial and a_i available (cur or held[i]).
//                           tape[i] becomes full; no output is produced.
//   Backward(i)             tape[i] full and g == i + 1. Drops cur if it is a_{i+1} (an
//                           unneeded output), runs the backward, clears tape[i], releases
//                           held[i]; g = i.
// Offload: Forward(i, save, hold, host) holds a_i on the host instead (Note [Offload
// semantics] in checkpoint/offload_plan.h): a D2H copy starts before the forward, a_i is not
// retagged to `checkpoints` and is dropped like an unheld cur, and it comes back into a
// staging slot (memory category `staging`, part of the footprint) before the first later
// op that reads held[i]; that slot is released by Backward(i). A host hold needs save !=
// kKeep (a full tape references its input, so nothing would be freed), i > 0 (token ids
// are not activations) and a_i not already held (a re-forward of a held input keeps it where
// it is).
// Partition: Forward(i, save, hold, offload, partition) keeps only this rank's 1/t slice of
// a_i (t = the tensor-parallel group's size; Note [Partition semantics] in
// checkpoint/offload_plan.h): on the device (category `checkpoints`), or with offload on the
// host, and the tp group all-gathers the whole a_i into a staging buffer before the first
// later op that reads held[i]. For this replay a partitioned hold is like a host hold: a_i is
// not retagged and is dropped like an unheld cur, and the stash's bytes (slice and staging)
// come in as windows (Note [One replay]). It has the host hold's requirements: save != kKeep,
// i > 0 and a_i not already held.
// `cur` is dropped when a forward replaces it and nothing else references it (held, or a
// tape's input/output reference), at the start of Backward(i) when it is a_{i+1}, and at
// once for the loss. A cur that is a_i stays alive through Backward(i) until the next op
// drops it; the engine must keep exactly these lifetimes for measured peaks to equal the
// simulated ones. A forward may replace a partial tape (Rotor's re-forwards) but never a
// full one.
// A valid schedule ends with g == 0, every tape empty and nothing held: Backward(i) runs
// exactly once per stage, in order n-1 .. 0. Forwards may repeat (Rotor's nested
// recompute); dropout masks depend only on (seed, stage, step, micro-batch, site), so a
// repeated forward reproduces them, and gradients are bit-identical under every schedule.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "checkpoint/costs.h"

namespace porter::checkpoint {

struct ScheduleOp {
  enum class Kind : uint8_t { kForward, kRecompute, kBackward };
  Kind kind = Kind::kForward;
  int stage = 0;
  SaveOption save = SaveOption::kKeep;  // kForward only
  bool hold_input = false;              // kForward only
  bool offload = false;                 // kForward with hold_input: held on the host
  bool partition = false;               // kForward with hold_input: only this rank's slice
                                        // is held (on the host too with offload)
  bool operator==(const ScheduleOp&) const = default;
  // Held by the checkpoint stash (offload/stash.h) rather than as a plain device tensor.
  bool stashed() const { return offload || partition; }

  static ScheduleOp forward(int stage, SaveOption save, bool hold_input, bool offload = false,
                            bool partition = false) {
    return {Kind::kForward, stage, save, hold_input, hold_input && offload,
            hold_input && partition};
  }
  static ScheduleOp recompute(int stage) { return {Kind::kRecompute, stage}; }
  static ScheduleOp backward(int stage) { return {Kind::kBackward, stage}; }
};

struct Schedule {
  int num_stages = 0;
  std::vector<ScheduleOp> ops;
  // "F0k+ F1c^ F2c+/ F3c^/ F4c R4 B4 ..." (k/s/c = keep/selective/checkpoint, + = hold input
  // on device, ^ = hold input on host, a trailing / = only this rank's 1/t slice is held:
  // partitioned across the tensor-parallel group).
  std::string to_string() const;
  bool operator==(const Schedule&) const = default;
};

// Throws InvalidArgument naming the first op that breaks Note [Schedule semantics].
void validate(const Schedule& schedule);

// What the simulator predicts for the offload of one micro-batch (zero without host holds),
// per rank. replay() sets peak_staging_bytes and peak_slice_bytes; simulate()
// (checkpoint/simulate.h) the rest.
struct OffloadPrediction {
  size_t d2h_bytes = 0;             // bytes copied to host (= offloaded bytes; a partitioned
                                    // host hold copies its slice)
  size_t h2d_bytes = 0;             // bytes copied back (a hold never read back is not)
  size_t pinned_bytes = 0;          // pinned host memory the micro-batch needs
  size_t peak_staging_bytes = 0;    // staging bytes in the footprint at once, at most
                                    // (the whole arena with contiguous staging)
  size_t peak_slice_bytes = 0;      // partition slices on the device at once, at most
                                    // (category `checkpoints`; the whole slice arena with
                                    // contiguous staging)
  int gathers = 0;                  // all-gathers of partitioned holds (one per read-back)
  size_t gathered_bytes = 0;        // payload this rank receives: (t-1) x slice per gather
  // Only when the costs have times and the link bandwidth is known (SimOptions). The model
  // (Note [Offload timing] in simulate.cc, docs/offload.md): a compute clock T advances by
  // each op's time (forward_s of its option, recompute_s, backward_s). Entry e's D2H copy
  // starts at max(T at the start of its hold_op, the D2H stream free) and lasts bytes / link;
  // its H2D copy is issued at the start of prefetch_op and starts at max(T there, the D2H
  // end, the H2D stream free), lasting bytes / link. At the start of use_op the compute
  // stream waits max(0, H2D end - T), which is added to T, to exposed_s and to
  // exposed_by_stage[e.stage]. Prediction::compute_s and recompute_s never include waits;
  // the step's predicted time is compute_s + exposed_s + gather_exposed_s.
  // Partitioned holds (Note [Partition timing] in simulate.cc): a host slice's copies are
  // timed as above, with the slice's bytes; the gather then runs on the tp link, and the
  // wait at use_op is split into the part before the H2D copy ends (exposed_s) and the rest
  // (gather_exposed_s).
  bool timed = false;
  double copy_busy_s = 0.0;         // D2H + H2D link time (sum of copy durations)
  double exposed_s = 0.0;           // time the compute stream waits for copies
  std::vector<double> exposed_by_stage;  // per stage (the stage whose input waited)
  // Only when the costs have times and the tp link's bandwidth is known.
  bool gather_timed = false;
  double gather_busy_s = 0.0;       // tp comm-stream time of the gathers
  double gather_exposed_s = 0.0;    // time the compute stream waits for gathers
  std::vector<double> gather_exposed_by_stage;
  // 1 - exposed / copy_busy (1 when there is nothing to copy).
  double hidden_fraction() const {
    return copy_busy_s > 0 ? 1.0 - exposed_s / copy_busy_s : 1.0;
  }
};

// What the simulator predicts for one micro-batch of a schedule.
// ZeRO stage 3's gathered parameters in one micro-batch (Note [Gather plan] in
// checkpoint/param_gather.h); zero otherwise.
struct ParamPrediction {
  size_t peak_gathered_bytes = 0;  // gathered buffers alive at once, at most
  int64_t peak_live_elems = 0;     // their elements
  int gathers = 0;
  size_t gathered_bytes = 0;       // of the gathered buffers, summed over gathers
  size_t persistent_bytes = 0;     // persistent units: gathered for the whole run
};

struct Prediction {
  size_t peak_activation_bytes = 0;  // peak of the footprint (staging included)
  // What a memory budget bounds: the activation footprint plus ZeRO stage 3's gathered
  // parameters alive at the same moment, at most (= peak_activation_bytes without stage 3).
  size_t peak_budget_bytes = 0;
  ParamPrediction params;
  // The same for all categories, excluding model states: at each op, the footprint at its
  // start + the activation gradient alive between stages (that of a_g: stage g's
  // input_bytes, none before the loss's backward) + the op's *_total_peak_bytes.
  size_t peak_total_bytes = 0;
  // ZeRO's gradient buckets (category comm) alive at once, at most (Note [Gradient buckets in
  // the footprint] in costs.h); included in peak_total_bytes.
  size_t peak_comm_bytes = 0;
  int peak_op = -1;                  // index of the op at which the footprint peaks
  double compute_s = 0.0;            // forwards + recomputes + backwards
  double recompute_s = 0.0;          // compute_s minus one forward per stage and backwards
  double recompute_flops = 0.0;      // FLOPs of the forwards beyond one per stage, plus the
                                     // Recompute ops' OptionCost::recompute_flops
  // Activation footprint after each op (for plots and tests).
  std::vector<size_t> footprint_after_op;
  // The peak_total_bytes moment of each op, alone: the most the op holds at once, of all
  // categories but model states (what the memory page draws over the op; its maximum is
  // peak_total_bytes).
  std::vector<size_t> peak_total_during_op;
  OffloadPrediction offload;
};

// Note [One replay]
// One state machine both checks a schedule (validate) and predicts its footprint (replay), so
// the rules and the bytes cannot drift apart. It lives here, below the offload layout
// (checkpoint/offload_plan.h validates before laying out), and the simulator above both
// (checkpoint/simulate.h) hands it the layout's staging as plain windows, so that this module
// needs nothing of the layout.
//
// The stash's bytes that replay() adds to the footprint: the host holds' copies on their way
// back and the partitioned holds' slices and gathered copies (Note [Offload semantics] and
// Note [Partition semantics] in checkpoint/offload_plan.h say which ops bound them). A
// window counts `bytes` from just before op `first_op` to just after op `last_op`; with
// `until_fetch` it counts until just before op `last_op` instead, after the allocations
// made before that op (a slice freed by fetch(), after that op's prefetches): the replay
// then also checks the footprint at that moment, start of `last_op` + `bytes`, as a peak of
// the op. `slice` windows are partition slices (category `checkpoints`), the others staging.
// `arena_bytes` and `slice_arena_bytes` count for the whole micro-batch (contiguous staging).
// `params` windows are ZeRO stage 3's gathered parameter buffers (checkpoint/param_gather.h;
// category `params`): outside the activation footprint, they count in peak_total_bytes and
// peak_budget_bytes.
struct StagingWindow {
  int first_op = 0;
  int last_op = 0;
  size_t bytes = 0;
  bool slice = false;
  bool until_fetch = false;
  bool params = false;
};
struct Staging {
  size_t arena_bytes = 0;
  size_t slice_arena_bytes = 0;
  std::vector<StagingWindow> windows;
};

// The replay behind validate() and simulate(): checks Note [Schedule semantics] op by op and
// predicts the footprint (Note [Activation bytes]) and compute of `schedule` over `costs`,
// with `staging` added. Each op's compute time goes to `op_seconds` when given.
Prediction replay(const Schedule& schedule, const ChainCosts& costs, const Staging& staging = {},
                  std::vector<double>* op_seconds = nullptr);

}  // namespace porter::checkpoint
