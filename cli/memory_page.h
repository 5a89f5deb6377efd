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

#include "base/error.h"
#include "checkpoint/planner.h"
#include "engine/engine.h"
#include "engine/step_memory.h"

namespace porter::cli {

// Note [Memory page data]
// Everything the page draws is in one JSON object ("porter-memory-page", version 2), embedded
// in the page as <script type="application/json" id="porter-data">, so that the static SVG,
// the script and tests read the same numbers (docs/cli.md lists the fields). Times are
// milliseconds from the step's start ("time_unit": "ms") on a train page; on a plan page,
// where nothing ran, op k of the schedule spans [k, k + 1] ("time_unit": "op"). The
// measured series is every allocator event of the step, each category's bytes after it.
//
// Note [Predicted envelope]
// The predicted curve is, over each op's span, that op's predicted peak: the plan's
// peak_total_during_op[k] (the simulator's peak_total_bytes moment of op k alone) over a
// baseline of model states and the batch (the terms RunOptions::predicted_peak_bytes adds),
// so its highest point is the predicted peak, and where the prediction holds the measured
// stack touches it during every op. The footprint between ops (footprint_after_op) is lower
// than what an op holds while it runs (its workspace, its gradient, its saved tensors being
// made): drawn as the curve it read as a misprediction of every op.
//
// Note [Chart scale]
// The y-axis fits the data, not the device: its top is the first tick of a 1-2-2.5-5 series
// (in the binary unit of the bytes) at or above 1.1 x the highest thing drawn (measured stack,
// predicted envelope and peak, and on a failure page the live bytes plus the failed request).
// The device's capacity is a labelled line when it is under that top, and otherwise a label
// at the chart's top that gives its value. The left margin fits the longest lane name (the
// checkpoint lanes share the main chart's time axis). "chart" in the data holds the layout,
// so that the static SVG and the script draw the same axes.

// The page data of `step`, recorded by `engine` (Engine::last_step_memory).
nlohmann::ordered_json train_page_data(engine::Engine& engine, const engine::StepMemory& step,
                                       const std::string& config_file);

// Note [Out-of-memory page]
// When a step of `porter train` runs out of memory, its page is drawn up to the failed
// allocation: the measured series stops at the allocator's state when the request failed
// (the unwinding's frees are not drawn), the failed request stands on top of it at that
// moment, and "failure" names its bytes, its category, the op and stage it was in, what was
// live by category, and the error's message. That moment is found in the step's timeline: the
// allocator's message gives every category's bytes at the failure, and the latest timeline
// state equal to them is it ("live_from": "allocator"). Where the message has no such
// accounting (the pinned pool's, the stash's), the latest allocation of the timeline stands
// for it ("live_from": "timeline"). The op is the first one of the schedule the step did not
// complete; past the last micro-batch's ops, the optimizer's update.
nlohmann::ordered_json oom_page_data(engine::Engine& engine, const engine::StepMemory& unfinished,
                                     const OutOfMemoryError& error,
                                     const std::string& config_file, int rank);
// Where `porter train` writes the page of a step that ran out of memory: `memory_page`
// (--memory-page) if given, else `report` (--report) with the extension .html, else
// porter-oom-memory.html in the working directory; with several ranks, the rank goes in
// before the extension (page.rank1.html).
std::string oom_page_path(const std::string& memory_page, const std::string& report, int rank,
                          int world_size);

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
