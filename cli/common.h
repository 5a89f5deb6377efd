// What the train, plan and estimate subcommands share: loading a config, the device and the
// planner inputs it implies, budget flags, and aligned text tables.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "checkpoint/analytic.h"
#include "checkpoint/planner.h"
#include "config/config.h"
#include "memory/device.h"
#include "nn/dtype.h"

namespace porter::cli {

// Parses `file` for `world_size` ranks, printing the warnings to `err`. Throws porter::Error.
config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size = 1);

// f32, or bf16 / f16 when the config enables them.
nn::DType compute_dtype(const config::Config& config);

// porter.device as DeviceOptions ("auto" is cuda when available, else cpu).
memory::DeviceOptions device_options(const config::Config& config);
// The device's capacity without creating it: the configured limit, else the default (cpu),
// or nullopt (cuda without a limit: the GPU's memory, unknown until it is opened).
std::optional<size_t> planned_capacity_bytes(const config::Config& config);

// The analytic model's shape of one micro-batch.
checkpoint::GptShape gpt_shape(const config::Config& config);
// The planner's options from the config, offload included (offload_options: the link is
// sim_link_gbps, or unknown; the Engine measures it instead).
checkpoint::PlanOptions plan_options(const config::Config& config);

// "--budget": a fraction in [0, 1] or bytes ("6GiB", "123456"). Throws InvalidArgument naming
// the flag.
config::MemoryBudget parse_budget_flag(const std::string& text);

// Bytes of one micro-batch's tokens and targets on the device (two (B, T) i32 tensors).
size_t batch_bytes(const config::Config& config);

// A left-aligned first column, the rest right-aligned, columns two spaces apart. A header of
// empty strings is not printed.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& out, const std::string& indent = "  ") const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "1.23 s", "45.6 ms", "789 us".
std::string format_seconds(double s);
// "12.3k", "4.56M".
std::string format_count(double v);

}  // namespace porter::cli
