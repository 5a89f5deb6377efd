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
// meta.json also holds "dp_size", "zero_stage", "optimizer_steps" (steps that updated: fp16
// overflow skips some) and "loss_scaler" {scale, iteration, last_overflow, hysteresis_left,
// skipped}. The sections hold the padded buffers (Note [Flat partition]): params the whole
// padded buffer (at ZeRO stage 3 the rank's shard, whose [begin, end) meta.json gives as
// "params_range"), master and the moments the rank's optimizer range. With one rank the
// files sit in `dir` itself, as before. With N > 1 ranks each rank writes its own state into
// `dir`/rank<r>, r the world rank dp_rank * tp + tp_rank (every rank calls save_checkpoint
// with the same dir; at stage 0 the copies of a tp rank are identical; a tensor-parallel
// rank's layout is its part of the model, which the layout check compares), and load_checkpoint reads `dir`/rank<r> and refuses a checkpoint written by
// another number of ranks or another stage (porter does not reshard; the error names both).
#include <cstring>
#include <fstream>
#include <sstream>

#include "base/error.h"
#include "config/parse.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/checkpoint_snapshot.h"
#include "io/state_file.h"
#include "io/weights_file.h"

namespace porter::engine {

namespace {

std::string shape_string(const nlohmann::json& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].dump();
  return s + ")";
}

// Throws InvalidArgument naming the first difference between the checkpoint's layout and
// this engine's.
void check_layout(const std::filesystem::path& dir, const nlohmann::json& saved,
                  const nlohmann::json& mine) {
  const std::string where = dir.string() + ": ";
  const nlohmann::json& sp = saved.at("params");
  const nlohmann::json& mp = mine.at("params");
  for (size_t i = 0; i < std::min(sp.size(), mp.size()); ++i) {
    const nlohmann::json& a = sp[i];
    const nlohmann::json& b = mp[i];
    if (a.at("name") != b.at("name") || a.at("shape") != b.at("shape") ||
        a.at("offset") != b.at("offset")) {
      throw InvalidArgument(where + "model layout differs at parameter " + std::to_string(i) +
                            ": the checkpoint has '" + a.at("name").get<std::string>() + "' " +
                            shape_string(a.at("shape")) + " at offset " + a.at("offset").dump() +
                            ", this model has '" + b.at("name").get<std::string>() + "' " +
                            shape_string(b.at("shape")) + " at offset " + b.at("offset").dump() +
                            "; load it into an engine built from the same model config");
    }
  }
  if (sp.size() != mp.size() || saved.at("total_elems") != mine.at("total_elems")) {
    throw InvalidArgument(where + "model layout differs: the checkpoint has " +
                          std::to_string(sp.size()) + " parameters (" +
                          saved.at("total_elems").dump() + " elements), this model has " +
                          std::to_string(mp.size()) + " (" + mine.at("total_elems").dump() +
                          " elements)");
  }
}

}  // namespace

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
  Impl& im = *impl_;
  const std::filesystem::path dir = rank_dir(dir_in, world_rank(), dp_size() * tp_size());
  const io::LoadedState state = io::read_state(dir);
  const nlohmann::json& meta = state.meta;
  const std::string where = dir.string() + ": ";
  // Check everything before changing anything.
  if (!meta.contains("kind") || meta.at("kind") != "porter.engine" || !meta.contains("step") ||
      !meta.contains("compute_dtype") || !meta.contains("layout")) {
    throw InvalidArgument(where + "meta.json is not an engine checkpoint (needs kind "
                          "\"porter.engine\", step, compute_dtype and layout)");
  }
  const std::string dtype = meta.at("compute_dtype").get<std::string>();
  const std::string mine(tensor::dtype_name(compute_dtype()));
  if (dtype != mine) {
    throw InvalidArgument(where + "compute dtype differs: the checkpoint was trained in " + dtype +
                          ", this engine computes in " + mine + " (bf16.enabled must match)");
  }
  check_layout(dir, meta.at("layout"), checkpoint_layout_json(model_->layout()));
  const int64_t step = meta.at("step").get<int64_t>();
  if (step < 0) throw InvalidArgument(where + "step " + std::to_string(step) + " is negative");
  const int saved_dp = meta.value("dp_size", 1);
  const int saved_stage = meta.value("zero_stage", 0);
  if (saved_dp != dp_size() || (dp_size() > 1 && saved_stage != run_.zero_stage())) {
    throw InvalidArgument(where + "written by " + std::to_string(saved_dp) +
                          " data-parallel ranks at ZeRO stage " + std::to_string(saved_stage) +
                          ", this engine runs " + std::to_string(dp_size()) + " at stage " +
                          std::to_string(run_.zero_stage()) +
                          "; resume with the same world size and zero_optimization.stage");
  }
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

  using Target = zero::ShardedOptimizer::StateTensor;
  std::vector<Target> targets = {
      {"params", im.gatherer ? im.optimizer->working() : im.flat->params()}};
  for (const Target& t : im.optimizer->state_tensors()) targets.push_back(t);
  auto bytes_of = [](const Target& t) {
    return static_cast<size_t>(t.tensor.nbytes()) +
           (t.rest.defined() ? static_cast<size_t>(t.rest.nbytes()) : 0);
  };
  for (const Target& t : targets) {
    const io::StateSection& s = state.section(t.name);
    if (s.bytes.size() != bytes_of(t)) {
      throw InvalidArgument(where + "section '" + t.name + "' has " +
                            std::to_string(s.bytes.size()) + " bytes, this engine needs " +
                            std::to_string(bytes_of(t)));
    }
  }
  for (const Target& t : targets) {
    const io::StateSection& s = state.section(t.name);
    const size_t first = static_cast<size_t>(t.tensor.nbytes());
    if (first > 0) device_->copy_sync(t.tensor.data(), s.bytes.data(), first);
    if (t.rest.defined() && s.bytes.size() > first) {  // Note [Partial offload]
      device_->copy_sync(t.rest.data(), s.bytes.data() + first, s.bytes.size() - first);
    }
  }
  im.optimizer->state_loaded();
  if (im.gatherer) im.gatherer->refresh_persistent();  // a collective at stage 3
  // The choices the checkpointed run computed with, unless the config pins a table itself.
  if (meta.contains("kernel_table") && !run_.kernel_table_path) {
    kernels_->kernel_table().pin(meta.at("kernel_table"), "resumed from " + dir_in.string());
  }
  step_ = step;
  im.optimizer->set_steps(optimizer_steps);
  im.optimizer->loss_scaler().set_state(ls);
  last_batches_.clear();
}

}  // namespace porter::engine
