// What the train, plan and estimate subcommands share: loading a config, budget flags, and
// aligned text tables. What a config implies (the device, dtypes, the planner's inputs) is
// engine::make_run_options (engine/run_options.h).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "checkpoint/planner.h"
#include "config/config.h"
#include "config/merge.h"

namespace porter::cli {

// Where a command's config comes from: the --config files, deep-merged in order, then the --set
// overrides (Note [Several config files] in config/merge.h).
struct ConfigArgs {
  std::vector<std::string> files;
  std::vector<std::string> sets;  // "porter.model.layers=8"
  // For headers and reports: "ds.json + model.json + --set porter.model.layers=8"; one file
  // alone is its name.
  std::string display() const;
  // To run it again: "--config ds.json --config model.json --set porter.model.layers=8", each
  // argument quoted for a POSIX shell where it needs it.
  std::string command_args() const;
};

// Adds --config FILE (required; repeat it to merge files) and --set key.path=JSON (repeatable)
// to `cmd`. A malformed --set is a usage error.
void add_config_options(CLI::App* cmd, ConfigArgs& args, const std::string& config_help);
// The --set option alone.
void add_set_option(CLI::App* cmd, std::vector<std::string>& sets);

// Reads and merges `args` and parses the result for `options`. Errors and warnings name the
// file or --set their key came from (a lone file: its name, as always). Throws porter::Error.
config::SourcedParseResult parse_config_args(const ConfigArgs& args,
                                             const config::ParseOptions& options);

// The warnings ("warning: <source>: ...") and then the notes ("note: <source>: ...", Note
// [Fixed behaviour] in config/parse.h) of a parsed config, one line each.
void print_diagnostics(const config::SourcedParseResult& result, std::ostream& err);

// parse_config_args, printing the warnings and notes to `err`.
config::Config load_config(const ConfigArgs& args, bool strict, std::ostream& err,
                           int64_t world_size = 1);
// The same with porter.model.tensor_parallel replaced by `tensor_parallel` (below).
config::Config load_config(const ConfigArgs& args, bool strict, std::ostream& err,
                           int64_t world_size, int64_t tensor_parallel, const std::string& flag);

// Parses one `file` for `world_size` ranks, printing the warnings to `err`. Throws porter::Error.
config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size = 1);

// The same with porter.model.tensor_parallel replaced by `tensor_parallel` (a command's
// `flag`) before the config is checked, so that every rule involving it (heads, the world
// size, sequence parallelism's rows) applies to the new value; the errors it causes name the
// flag. Throws porter::Error.
config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size, int64_t tensor_parallel, const std::string& flag);

// Note [Implied world size]
// A config file has no world size. When it states all three of train_batch_size,
// train_micro_batch_size_per_gpu and gradient_accumulation_steps, they imply
// train_batch_size / (micro-batch x accumulation) data-parallel ranks, else one; the world is
// that times porter.model.tensor_parallel, or times `tensor_parallel` when a flag overrides
// it. Of several files, the merged config's numbers count (Note [Several config files]). A file
// that cannot be read or parsed implies 1 (loading it then says why).
int64_t implied_world_size(const ConfigArgs& args,
                           std::optional<int64_t> tensor_parallel = std::nullopt);
int64_t implied_world_size(const std::string& file,
                           std::optional<int64_t> tensor_parallel = std::nullopt);

// A progress line on `err` for the optimal planner's solves ("porter plan: planning optimal:
// solve 2, 40%"), at most once a second and only once the planning has taken a second, so
// quick plans print nothing.
checkpoint::PlanProgressFn plan_progress_printer(std::ostream& err, const std::string& command);

// "--budget": a fraction in [0, 1] or bytes ("6GiB", "123456"). Throws InvalidArgument naming
// the flag.
config::MemoryBudget parse_budget_flag(const std::string& text);

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

// "GPT, 12 layers, hidden 768, 12 heads, seq 1024, vocab 50257" (Llama: "Llama, ..., 32
// heads (8 key/value), ..."): porter.model as the commands' headers show it.
std::string describe_model(const config::ModelConfig& model);

}  // namespace porter::cli
