// The memory page (`porter train --memory-page`, `porter plan --memory-page`; docs/cli.md):
// one self-contained HTML file that draws where one step's memory goes, measured and
// predicted, from data it embeds as JSON.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/planner.h"
#include "engine/engine.h"
#include "engine/step_memory.h"

namespace porter::cli {

// Note [Memory page data]
// Everything the page draws is in one JSON object ("porter-memory-page", version 1), embedded
// in the page as <script type="application/json" id="porter-data">, so that the static SVG,
// the script and tests read the same numbers (docs/cli.md lists the fields). Times are
// milliseconds from the step's start ("time_unit": "ms") on a train page; on a plan page,
// where nothing ran, op k of the schedule spans [k, k + 1] ("time_unit": "op"). The
// predicted curve is the plan's footprint_after_op[k] over a baseline of model states and
// the batch (the terms RunOptions::predicted_peak_bytes adds), holding from the end of op k;
// the measured series is every allocator event of the step, each category's bytes after it.

// The page data of `step`, recorded by `engine` (Engine::last_step_memory).
nlohmann::ordered_json train_page_data(engine::Engine& engine, const engine::StepMemory& step,
                                       const std::string& config_file);

// What a plan page needs: the plan and what the configured run would add to it.
struct PlanPageInput {
  std::string config_file;
  const checkpoint::Plan* plan = nullptr;       // not owned
  const checkpoint::ChainCosts* costs = nullptr;  // not owned; the plan's
  std::function<std::string(int)> stage_name;
  size_t model_state_bytes = 0;  // params + grads + optimizer of this rank
  size_t batch_bytes = 0;        // RunOptions::batch_bytes
  std::optional<size_t> capacity_bytes;
  size_t predicted_peak_bytes = 0;  // RunOptions::predicted_peak_bytes
};
nlohmann::ordered_json plan_page_data(const PlanPageInput& in);

// The page: the data, the static SVG of it and the script that redraws it interactively.
std::string render_memory_page(const nlohmann::ordered_json& data);
// render_memory_page into `path`; IoError naming `flag` and the file.
void write_memory_page(const std::string& path, const nlohmann::ordered_json& data,
                       std::string_view flag);

// The chart drawn without script (Note [Static fallback] in memory_page_svg.cc).
std::string static_svg(const nlohmann::ordered_json& data);
// `text` with <, >, & and " as entities.
std::string html_escape(std::string_view text);
// The HTML, CSS and script of the page, with the placeholders render_memory_page fills.
std::string_view memory_page_template();

}  // namespace porter::cli
