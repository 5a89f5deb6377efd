// Training checkpoints of the Engine: what goes into the state file (io/state_file.h)
// and the checks on the way back. docs/engine.md, "Training checkpoints".
//
// Note [Engine state]
// meta.json holds {"kind": "porter.engine", "step", "compute_dtype", "seed", "layout":
// {"total_elems", "params": [{"name", "shape", "offset"}...]}, "config": {"model",
// "optimizer"}}; the sections are the raw device bytes, in layout order with padding:
//   params      the working parameters (compute dtype)
//   master      the f32 master copy (bf16 compute only)
//   exp_avg     AdamW m (f32)
//   exp_avg_sq  AdamW v (f32)
// meta.json also holds "kernel_table", the run's kernel choices (Note [Kernel table] in
// kernels/kernel_table.cc), which a resume pins so that it computes as the run it continues.
// Gradients are not saved: every step starts by zeroing them. Loading restores all of these
// and the step, so the next train_step computes exactly what it would have without the
// save (the LR schedule and the data are pure functions of the step).
//
// Note [Data-parallel checkpoints]
// meta.json also holds "dp_size", "zero_stage", "tp_size", "tp_rank", "optimizer_steps"
// (steps that updated: fp16 overflow skips some) and "loss_scaler" {scale, iteration,
// last_overflow, hysteresis_left, skipped}. The sections hold the padded buffers (Note [Flat
// partition]): params the whole padded buffer (at ZeRO stage 3 the rank's shard, whose
// [begin, end) meta.json gives as "params_range"), master and the moments the rank's
// optimizer range ("optimizer_range"). With one rank the files sit in `dir` itself. With
// N > 1 ranks each rank writes its own state into `dir`/rank<r>, r the world rank
// dp_rank * tp + tp_rank (every rank calls save_checkpoint with the same dir; at stage 0 the
// copies of a tp rank are identical; a tensor-parallel rank's layout is its part of the
// model). load_checkpoint reads `dir`/rank<r> when the checkpoint was written at this run's
// layout (the same dp size, tensor-parallel degree and, above one dp rank, stage) and checks
// its layout against this rank's; at any other layout it reshards: every rank reads the
// saved ranks' ranges it needs (Note [Resharding a checkpoint] in engine/reshard.h). Either
// way everything is read and checked before the engine changes.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"
#include "config/parse.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/checkpoint_snapshot.h"
#include "engine/reshard.h"
#include "io/consolidate.h"
#include "io/state_file.h"
#include "io/weights_file.h"

namespace porter::engine {

namespace {

std::filesystem::path rank_dir(const std::filesystem::path& dir, int rank, int size) {
  return size > 1 ? dir / ("rank" + std::to_string(rank)) : dir;
}

}  // namespace

nlohmann::json read_kernel_table(const std::filesystem::path& path, int world_rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file = path;
  if (fs::is_directory(path, ec)) {
    file = path / "meta.json";
    for (const fs::path& candidate : {path / ("rank" + std::to_string(world_rank)) / "meta.json",
                                      path / "meta.json", path / "rank0" / "meta.json"}) {
      if (fs::exists(candidate, ec)) {
        file = candidate;
        break;
      }
    }
  }
  std::ifstream in(file);
  if (!in) {
    throw IoError(file.string() + ": cannot read the kernel table (porter.device.kernel_table "
                  "names a table, a report written by --report, or a checkpoint directory "
                  "written by --save)");
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw InvalidArgument(file.string() + ": not JSON: " + e.what());
  }
  if (j.is_object() && j.contains("kernel_table")) return j.at("kernel_table");
  if (j.is_object() && j.contains("entries")) return j;
  throw InvalidArgument(file.string() + ": holds no kernel table (a report or checkpoint "
                        "written before porter recorded its kernel choices?); porter.device."
                        "kernel_table names a table, a report or a checkpoint directory");
}

void Engine::load_checkpoint(const std::filesystem::path& dir_in) {
  if (pending_ != nullptr) throw_step_begun("load_checkpoint");
  Impl& im = *impl_;
  // What the checkpoint fills: the working parameters and the optimizer's state tensors.
  using Target = zero::ShardedOptimizer::StateTensor;
  std::vector<Target> targets = {
      {"params", im.gatherer ? im.optimizer->working() : im.flat->params()}};
  for (const Target& t : im.optimizer->state_tensors()) targets.push_back(t);
  auto bytes_of = [](const Target& t) {
    return static_cast<size_t>(t.tensor.nbytes()) +
           (t.rest.defined() ? static_cast<size_t>(t.rest.nbytes()) : 0);
  };
  RankLayout mine;
  mine.model = config_.porter.model;
  mine.layout = &model_->layout();
  mine.transformer = dynamic_cast<TransformerModel*>(model_.get()) != nullptr;
  mine.dp_size = dp_size();
  mine.dp_rank = dp_rank();
  mine.tp_size = tp_size();
  mine.tp_rank = tp_rank();
  mine.zero_stage = run_.zero_stage();
  mine.compute_dtype = compute_dtype();
  const SavedLayout saved = peek_saved_layout(dir_in);
  const bool reshard = saved.found && !same_layout(saved, mine);

  // Check and read everything before changing anything.
  nlohmann::json meta;                     // this rank's meta.json, or rank 0's when resharding
  std::vector<std::vector<std::byte>> bytes;  // per target
  std::string where;
  if (!reshard) {
    const std::filesystem::path dir = rank_dir(dir_in, world_rank(), dp_size() * tp_size());
    io::LoadedState state = io::read_state(dir);
    meta = std::move(state.meta);
    where = dir.string() + ": ";
    if (!meta.contains("kind") || meta.at("kind") != "porter.engine" || !meta.contains("step") ||
        !meta.contains("compute_dtype") || !meta.contains("layout")) {
      throw InvalidArgument(where + "meta.json is not an engine checkpoint (needs kind "
                            "\"porter.engine\", step, compute_dtype and layout)");
    }
    const std::string dtype = meta.at("compute_dtype").get<std::string>();
    const std::string my_dtype(tensor::dtype_name(compute_dtype()));
    if (dtype != my_dtype) {
      throw InvalidArgument(where + "compute dtype differs: the checkpoint was trained in " +
                            dtype + ", this engine computes in " + my_dtype +
                            " (bf16.enabled must match)");
    }
    check_checkpoint_layout(where, meta.at("layout"), checkpoint_layout_json(model_->layout()),
                            "load it into an engine built from the same model config");
    // peek_saved_layout read rank 0's meta.json; this rank's must say the same.
    const int saved_dp = meta.value("dp_size", 1);
    const int saved_stage = meta.value("zero_stage", 0);
    if (saved_dp != dp_size() || (dp_size() > 1 && saved_stage != run_.zero_stage())) {
      throw InvalidArgument(where + "written by " + std::to_string(saved_dp) +
                            " data-parallel ranks at ZeRO stage " + std::to_string(saved_stage) +
                            ", but its rank 0 says " + std::to_string(saved.dp_size) +
                            " at stage " + std::to_string(saved.zero_stage) +
                            ": the rank directories do not come from one save");
    }
    for (const Target& t : targets) {
      const auto it = std::find_if(state.sections.begin(), state.sections.end(),
                                   [&](const io::StateSection& s) { return s.name == t.name; });
      if (it == state.sections.end()) state.section(t.name);  // throws IoError naming it
      io::StateSection& s = *it;
      if (s.bytes.size() != bytes_of(t)) {
        throw InvalidArgument(where + "section '" + t.name + "' has " +
                              std::to_string(s.bytes.size()) + " bytes, this engine needs " +
                              std::to_string(bytes_of(t)));
      }
      bytes.push_back(std::move(s.bytes));
    }
  } else {
    // Note [Resharding a checkpoint] in engine/reshard.h.
    const io::CheckpointInfo info = io::inspect_checkpoint(dir_in, "load_checkpoint");
    meta = info.meta(0);
    where = dir_in.string() + ": ";
    std::vector<ReshardTarget> wanted;
    for (const Target& t : targets) {
      const bool whole_params = std::string_view(t.name) == "params" && !im.gatherer;
      const int64_t begin = whole_params ? 0 : im.optimizer->begin();
      const size_t elem = std::string_view(t.name) == "params" ? tensor::dtype_size(compute_dtype()) : 4;
      wanted.push_back({t.name, begin, begin + static_cast<int64_t>(bytes_of(t) / elem)});
    }
    bytes = reshard_sections(info, mine, wanted);
    if (world_rank() == 0) {
      PORTER_LOG_INFO("resuming {}: written by {} data-parallel x {} tensor-parallel ranks at ZeRO "
                      "stage {}, resharded to this run's {} x {} at stage {}",
                      dir_in.string(), info.dp_size, info.tp_size, info.zero_stage, dp_size(),
                      tp_size(), run_.zero_stage());
    }
  }
  const int64_t step = meta.at("step").get<int64_t>();
  if (step < 0) throw InvalidArgument(where + "step " + std::to_string(step) + " is negative");
  const int64_t optimizer_steps = meta.value("optimizer_steps", step);
  zero::LossScaler::State ls = im.optimizer->loss_scaler().state();
  if (meta.contains("loss_scaler") && run_.optimizer.fp16.enabled) {
    const nlohmann::json& j = meta.at("loss_scaler");
    ls.scale = j.at("scale").get<double>();
    ls.iteration = j.at("iteration").get<int64_t>();
    ls.last_overflow_iteration = j.at("last_overflow").get<int64_t>();
    ls.hysteresis_left = j.at("hysteresis_left").get<int64_t>();
    ls.skipped = j.at("skipped").get<int64_t>();
  }

  for (size_t i = 0; i < targets.size(); ++i) {
    const Target& t = targets[i];
    const std::vector<std::byte>& s = bytes[i];
    PORTER_ASSERT(s.size() == bytes_of(t), "load_checkpoint: section '", t.name, "' of ",
                  s.size(), " bytes for ", bytes_of(t));
    const size_t first = static_cast<size_t>(t.tensor.nbytes());
    if (first > 0) device_->copy_sync(t.tensor.data(), s.data(), first);
    if (t.rest.defined() && s.size() > first) {  // Note [Partial offload]
      device_->copy_sync(t.rest.data(), s.data() + first, s.size() - first);
    }
  }
  bytes.clear();
  im.optimizer->state_loaded();
  if (im.gatherer) im.gatherer->refresh_persistent();  // a collective at stage 3
  // The choices the checkpointed run computed with, unless the config pins a table itself.
  if (meta.contains("kernel_table") && !run_.kernel_table_path) {
    kernels_->kernel_table().pin(meta.at("kernel_table"), "resumed from " + dir_in.string());
    if (reshard && saved.tp_size != tp_size() && world_rank() == 0) {
      // Note [Resharding a checkpoint]: the shapes it lacks are measured at first use.
      PORTER_LOG_INFO("resuming {}: its kernel table was recorded at tensor_parallel {}; the "
                      "matmul shapes of tensor_parallel {} it lacks are chosen at first use, as "
                      "in a fresh run", dir_in.string(), saved.tp_size, tp_size());
    }
  }
  step_ = step;
  im.optimizer->set_steps(optimizer_steps);
  im.optimizer->loss_scaler().set_state(ls);
  last_batches_.clear();
}

}  // namespace porter::engine
