// The memory-pressure stress test behind `porter stress`: random variations of a config, each
// trained under a device memory limit placed from the engine's own prediction, with the checks
// of docs/cli.md ("porter stress"). The command (stress_command.cc) only parses flags and
// prints; everything here is testable in-process.
//
// Note [Stress limits]
// Each variation runs three (or four) times, on fresh devices:
//   reference    policy none, no offload, no memory limit: the losses and the parameters
//                every constrained run must reproduce bit for bit.
//   probe        the variation itself, no memory limit: builds the Engine only (profiling
//                and planning), for MemoryReport::predicted_peak_bytes and the plan.
//   constrained  the variation under porter.device.memory_limit = predicted_peak_bytes +
//                limit_margin(predicted). The engine plans again from its own profile; an
//                optimal plan depends on measured times, so when its schedule differs from
//                the probe's, the probe's plan is set (Engine::set_plan) and the limit
//                stays that plan's.
//   below        every kBelowEvery-th run: the same under a limit kBelowBytes under the
//                constrained run's measured requested peak. Requested bytes never exceed
//                reserved bytes, and the sequence of requests is the same as in the
//                constrained run (it does not depend on copy timing: a buffer's requested
//                bytes leave the books when it is freed, not when a deferred free lands), so
//                the run must stop with OutOfMemoryError: at construction or in a step,
//                never a crash, and a failed step leaves the allocator and the pinned pool
//                at their baseline.
// The total: the predicted total peak of requested bytes must equal the measured one exactly.
// The margin: the prediction counts requested bytes; the device limits reserved segments.
// Between them lie the allocator's 512-byte rounding of every live block, blocks that cannot
// be split off a segment (Note [Size classes] in memory/allocator_policy.h) and holes between
// live blocks. kMarginBytes + kMarginFraction x predicted covers them with room to spare on the
// configurations the stress draws; the largest shortfall seen while choosing it is in
// docs/cli.md ("porter stress").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"

namespace porter::cli {

inline constexpr size_t kMarginBytes = size_t{1} << 20;
inline constexpr double kMarginFraction = 0.02;
inline constexpr int kBelowEvery = 4;       // runs 3, 7, 11, ... also check below the peak
inline constexpr size_t kBelowBytes = 512;  // one allocator block under the measured peak

// The device memory limit of a constrained run whose engine predicts `predicted_peak_bytes`.
size_t limit_margin(size_t predicted_peak_bytes);

// One drawn variation of a config: the config the constrained run trains, and a short label.
struct Variation {
  int64_t run = 0;
  config::Config config;  // validated (re-parsed from its JSON)
  std::string label;      // "L2 H64/4 T32 B2 | uniform/1 | offload d2 contiguous"
  bool check_below = false;
};

// The variation of run `run` under `seed`: a pure function of (base, seed, run), drawn from
// an mt19937_64 stream seeded with (seed, run) (Note [Stress draws] in stress.cc).
Variation draw_variation(const config::Config& base, uint64_t seed, int64_t run);

struct StressOptions {
  uint64_t seed = 1;
  int64_t runs = 10;
  int64_t first = 0;  // the first run index (reproduction of one run: --first R --runs 1)
  int64_t steps = 3;  // steps per training run
};

struct RunResult {
  Variation variation;
  bool passed = false;
  std::vector<std::string> failures;  // one line each; empty when passed
  size_t limit_bytes = 0;
  size_t predicted_peak_bytes = 0;
  size_t measured_peak_bytes = 0;       // requested, over the constrained run's steps
  size_t reserved_peak_bytes = 0;       // the allocator's segments, at most the limit
  size_t predicted_activation_bytes = 0;
  size_t measured_activation_bytes = 0;
  size_t offloaded_bytes = 0;           // per micro-batch, as planned
  bool replanned = false;               // the probe's optimal plan was set (Note [Stress limits])
  std::optional<size_t> below_limit_bytes;
  std::string below_outcome;            // "out of memory in step 1", "at construction"
  double seconds = 0.0;
  // (measured - predicted) / predicted; 0 when nothing was measured.
  double activation_error() const;
  double total_error() const;
};

struct StressSummary {
  std::vector<RunResult> runs;
  int64_t passed() const;
  int64_t failed() const { return static_cast<int64_t>(runs.size()) - passed(); }
  // The run with the largest |error| of each kind (nullptr when no run measured one).
  const RunResult* worst_activation() const;
  const RunResult* worst_total() const;
};

// Runs one variation (every phase of Note [Stress limits]) and its checks. Never throws for a
// failure of the run itself: errors become failure lines.
RunResult run_variation(const Variation& variation, int64_t steps);

// Runs options.runs variations of `base`, calling `on_run` after each.
StressSummary run_stress(const config::Config& base, const StressOptions& options,
                         const std::function<void(const RunResult&)>& on_run = {});

}  // namespace porter::cli
