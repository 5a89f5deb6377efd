// What `porter train` writes besides progress: the end-of-run summary table, the --report
// JSON and the --dump-dir tensors (docs/cli.md, docs/dump-format.md).
#pragma once

#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"

namespace porter::cli {

// What one `porter train` run did, beyond what the engine reports.
struct TrainRun {
  std::string config_file;
  std::string device;        // the device's description
  std::string data;          // DataSource::describe()
  int64_t start_step = 0;    // the engine's step before the first train_step (resume)
  std::vector<engine::StepResult> steps;
  double wall_s = 0.0;       // of the training loop
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

// The report (docs/cli.md, "The report").
nlohmann::ordered_json train_report(const TrainRun& run, engine::Engine& engine);
// The summary table printed at the end.
void print_summary(const TrainRun& run, engine::Engine& engine, std::ostream& out);

// Writes the last step's parameters (`params`, taken before the step), gradients and
// micro-batches, and manifest.json, into `dir` (docs/dump-format.md).
void write_dump(const std::filesystem::path& dir, engine::Engine& engine,
                const std::vector<float>& params, const engine::StepResult& step);

}  // namespace porter::cli
