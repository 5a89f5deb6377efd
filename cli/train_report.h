// What `porter train` writes besides progress: the end-of-run summary table, the --report
// JSON and the --dump-dir tensors (docs/cli.md, docs/dump-format.md).
#pragma once

#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpointer.h"
#include "engine/engine.h"

namespace porter::cli {

// One evaluation of the validation set (Note [Validation loss] in train_command.cc): the mean
// loss over every data-parallel rank's share, after optimizer step `step` (1-based, as the
// progress lines count).
struct ValidationLoss {
  int64_t step = 0;
  double loss = 0.0;
};

// What one `porter train` run did, beyond what the engine reports.
struct TrainRun {
  std::string config_file;
  std::string device;        // the device's description
  std::string data;          // io::DataSource::describe()
  int64_t start_step = 0;    // the engine's step before the first train_step (resume)
  std::vector<engine::StepResult> steps;
  std::string validation_data;            // io::ValidationSet::describe(); empty without val_paths
  int64_t validation_micro_batches = 0;   // per data-parallel rank
  std::vector<ValidationLoss> validation;
  double wall_s = 0.0;       // of the training loop
  int world_size = 1;        // ranks of the run (WORLD_SIZE)
  std::string comm_backend;  // "gloo", "nccl"; empty for one rank
  // Every rank's rank_json(), by rank (this rank's alone when it runs alone); Note [Per-rank
  // report].
  std::vector<nlohmann::ordered_json> ranks;
  int restarts = 0;          // worlds started before this one (PORTER_RESTART)
  std::string resumed_from;  // the checkpoint loaded; empty when none
  std::vector<engine::CheckpointRecord> checkpoints;  // rank 0's saves, oldest first
  std::string stopped_by;    // "SIGTERM" when preempted; empty when the run finished
};

struct StepTimes {
  double median_s = 0.0, min_s = 0.0, max_s = 0.0;
};
StepTimes step_times(const std::vector<engine::StepResult>& steps);
// Tokens over the sum of the steps' times.
double tokens_per_s(const std::vector<engine::StepResult>& steps);
// The mean loss of the last (up to) `n` steps: one step's loss is one batch's, and noisy.
double mean_last_loss(const std::vector<engine::StepResult>& steps, size_t n = 10);

// The offload statistics of the run's steps, summed (the peaks: the largest of any step).
offload::StashStats offload_totals(const std::vector<engine::StepResult>& steps);
// The report's "offload" section: measured, the plan's prediction, and with
// activation_checkpointing.profile the last step's per-checkpoint copy and wait records.
nlohmann::ordered_json offload_report(const TrainRun& run, engine::Engine& engine);

// The report's "memory" section: this rank's measured and predicted bytes.
nlohmann::ordered_json memory_json(const engine::MemoryReport& mem);
// The report's "zero" section: Engine::zero_stats() (cumulative over the run) and the exact
// per-rank model-state bytes of its partition (zero::exact_bytes).
nlohmann::ordered_json zero_json(engine::Engine& engine);

// Note [Per-rank report]
// The memory report is per rank. Every rank builds rank_json() = {rank, memory, zero} after
// its last step; with several ranks each one set()s it in the run's store under
// "porter/train/rank/<r>" and rank 0 get()s them all (within porter.comm.timeout_s), so rank
// 0's summary prints a peak column per rank and its --report has them under "ranks". The
// top-level "memory" and "zero" sections are rank 0's.
nlohmann::ordered_json rank_json(int rank, engine::Engine& engine);

// The report (docs/cli.md, "The report").
nlohmann::ordered_json train_report(const TrainRun& run, engine::Engine& engine);
// The summary table printed at the end.
void print_summary(const TrainRun& run, engine::Engine& engine, std::ostream& out);

// Writes the last step's parameters (`params`, taken before the step), gradients and
// micro-batches, and manifest.json, into `dir` (docs/dump-format.md).
void write_dump(const std::filesystem::path& dir, engine::Engine& engine,
                const std::vector<float>& params, const engine::StepResult& step);

}  // namespace porter::cli
