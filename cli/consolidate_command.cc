// `porter consolidate --checkpoint DIR --out FILE [--dtype working|f32] [--tp-rank K]`: the
// full model's weights from a training checkpoint's per-rank files, at any data-parallel
// size, ZeRO stage and tensor-parallel degree, as one safetensors file (io/consolidate.h,
// Note [Consolidating a checkpoint]; docs/engine.md). A tensor-parallel checkpoint gives the
// whole model, its tp ranks joined, or with --tp-rank one rank's part.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "base/units.h"
#include "cli/app.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "io/consolidate.h"
#include "io/run_dir.h"
#include "io/weights_file.h"

namespace porter::cli {
namespace {

struct ConsolidateCommandOptions {
  std::string checkpoint;
  std::string out;
  std::string dtype = "working";
  std::optional<int> tp_rank;
};

int consolidate(const ConsolidateCommandOptions& o, std::ostream& out, std::ostream& err) {
  io::ConsolidateOptions co;
  co.dtype = o.dtype == "f32" ? io::WeightsDType::kF32 : io::WeightsDType::kWorking;
  co.tp_rank = o.tp_rank;
  // Reading a rank means reading and checksumming its whole state: name each as it is done.
  co.on_rank_read = [&err](int done, int count, const std::filesystem::path& dir) {
    if (count > 1) err << "read " << dir.string() << " (" << done << "/" << count << ")\n";
  };
  // A run directory (porter train --save DIR --save-every N) stands for its newest checkpoint
  // (Note [Run directory] in io/run_dir.h); the checks below refuse a damaged one.
  std::string checkpoint = o.checkpoint;
  if (!io::is_checkpoint(checkpoint) && io::is_run_dir(checkpoint)) {
    checkpoint = io::resume_candidates(checkpoint).front().string();
    err << "run directory " << o.checkpoint << ": its newest checkpoint is " << checkpoint << "\n";
  }
  const io::ConsolidateResult r = io::consolidate_checkpoint(checkpoint, co);

  io::WeightMetadata metadata = {{"format", "pt"},
                                     {"porter.step", std::to_string(r.step)},
                                     {"porter.source", checkpoint}};
  if (r.tp_size > 1 && !r.whole) metadata["porter.tp_rank"] = std::to_string(r.tp_rank);
  io::write_safetensors(o.out, r.tensors, metadata);

  const std::string dtype(tensor::dtype_name(r.dtype));
  std::string origin;
  if (r.section == "master") {
    origin = "the f32 master weights; trained in " + std::string(tensor::dtype_name(r.compute_dtype));
  } else if (r.dtype == r.compute_dtype) {
    origin = "the working parameters";
  } else {
    origin = "the " + std::string(tensor::dtype_name(r.compute_dtype)) + " working parameters, widened";
  }
  std::string ranks = std::to_string(r.rank_dirs.size());
  if (r.tp_size > 1 && r.whole) {
    ranks += " (dp " + std::to_string(r.dp_size) + " x tp " + std::to_string(r.tp_size) +
             ": the tp ranks' parts joined into the whole model";
  } else if (r.tp_size > 1) {
    ranks += " of " + std::to_string(r.dp_size * r.tp_size) + " (dp " + std::to_string(r.dp_size) +
             " x tp " + std::to_string(r.tp_size) + ": tp rank " + std::to_string(r.tp_rank) + "'s";
  } else {
    ranks += " (dp " + std::to_string(r.dp_size);
  }
  ranks += ", ZeRO stage " + std::to_string(r.zero_stage) + ")";

  out << "consolidated " << checkpoint << " -> " << o.out << "\n";
  const std::pair<const char*, std::string> rows[] = {
      {"step", std::to_string(r.step)},
      {"ranks read", ranks},
      {"dtype", dtype + " (" + origin + ")"},
      {"tensors", std::to_string(r.tensors.size())},
      {"parameters", std::to_string(r.num_params) + " (" +
                         format_count(static_cast<double>(r.num_params)) + ")"},
      {"bytes", std::to_string(r.data_bytes) + " (" + format_bytes(r.data_bytes) + ")"},
  };
  for (const auto& [name, value] : rows) {
    out << "  " << name << std::string(12 - std::string_view(name).size(), ' ') << value << "\n";
  }
  return kExitOk;
}

}  // namespace

void add_consolidate_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<ConsolidateCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "consolidate",
      "Write the full model's weights from a training checkpoint's per-rank files as one "
      "safetensors file");
  cmd->add_option("--checkpoint", o->checkpoint,
                  "The training checkpoint directory (porter train --save DIR), or a run "
                  "directory (--save-every), for its newest checkpoint")
      ->required();
  cmd->add_option("--out", o->out, "The safetensors file to write")->required();
  cmd->add_option("--dtype", o->dtype,
                  "working: the compute dtype's parameters; f32: the f32 master weights "
                  "(the parameters themselves when training in f32)")
      ->check(CLI::IsMember({"working", "f32"}))
      ->capture_default_str();
  cmd->add_option("--tp-rank", o->tp_rank,
                  "Of a tensor-parallel checkpoint, write this tensor-parallel rank's part "
                  "(without it: the whole model, every rank's part joined)")
      ->check(CLI::NonNegativeNumber);
  cmd->footer("Exit codes: 0 success, 1 usage error, 2 invalid or incomplete checkpoint, or a "
              "file that cannot be written.");
  cmd->callback(
      [o, &context] { context.exit_code = consolidate(*o, *context.out, *context.err); });
}

}  // namespace porter::cli
