// Engine::snapshot_checkpoint and save_checkpoint: the state a training checkpoint holds
// (Notes [Engine state] and [Data-parallel checkpoints] in engine/state.cc), copied to host
// memory, and the writing of such a copy.
#include "engine/checkpoint_snapshot.h"

#include "config/parse.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

namespace {

// `t`'s bytes into `into` from byte `offset` on; `into` already has the room.
void download(memory::Device& device, const tensor::Tensor& t, std::vector<std::byte>& into,
              size_t offset = 0) {
  if (t.nbytes() > 0) device.copy_sync(into.data() + offset, t.data(), t.nbytes());
}

// The section `name` of `snap`, `bytes` long: the one a previous snapshot left (its memory
// reused: resizing to the size it has touches nothing), else a new one.
std::vector<std::byte>& section_buffer(CheckpointSnapshot& snap,
                                       std::vector<io::StateSection>& previous,
                                       const std::string& name, size_t bytes) {
  std::vector<std::byte> buffer;
  for (io::StateSection& s : previous) {
    if (s.name == name) {
      buffer = std::move(s.bytes);
      break;
    }
  }
  buffer.resize(bytes);
  snap.sections.push_back({name, std::move(buffer)});
  return snap.sections.back().bytes;
}

}  // namespace

nlohmann::json checkpoint_layout_json(const nn::ParamLayout& layout) {
  nlohmann::json params = nlohmann::json::array();
  for (const nn::ParamEntry& e : layout.entries()) {
    params.push_back({{"name", e.name}, {"shape", e.shape.to_vector()}, {"offset", e.offset_elems}});
  }
  return {{"total_elems", layout.total_elems()}, {"params", params}};
}

uint64_t CheckpointSnapshot::bytes() const {
  uint64_t n = 0;
  for (const io::StateSection& s : sections) n += s.bytes.size();
  for (const io::WeightTensor& t : weights) n += t.bytes.size();
  return n;
}

CheckpointSnapshot Engine::snapshot_checkpoint() const {
  CheckpointSnapshot snap;
  snapshot_checkpoint(snap);
  return snap;
}

void Engine::snapshot_checkpoint(CheckpointSnapshot& snap) const {
  check_states_on_device("snapshot_checkpoint");
  const Impl& im = *impl_;
  std::vector<io::StateSection> previous = std::move(snap.sections);
  snap = CheckpointSnapshot{};
  if (dp_size() * tp_size() > 1) snap.rank_subdir = "rank" + std::to_string(world_rank());
  const nlohmann::ordered_json cfg = config::to_json(config_);
  nlohmann::json& meta = snap.meta;
  meta["kind"] = "porter.engine";
  meta["step"] = step_;
  meta["compute_dtype"] = std::string(tensor::dtype_name(compute_dtype()));
  meta["seed"] = run_.seed;
  meta["layout"] = checkpoint_layout_json(model_->layout());
  meta["dp_size"] = dp_size();
  meta["zero_stage"] = run_.zero_stage();
  meta["tp_size"] = tp_size();
  meta["tp_rank"] = tp_rank();
  meta["optimizer_range"] = {im.optimizer->begin(), im.optimizer->end()};
  meta["optimizer_steps"] = im.optimizer->steps();
  const zero::LossScaler::State ls = im.optimizer->loss_scaler().state();
  meta["loss_scaler"] = {{"scale", ls.scale},
                         {"iteration", ls.iteration},
                         {"last_overflow", ls.last_overflow_iteration},
                         {"hysteresis_left", ls.hysteresis_left},
                         {"skipped", ls.skipped}};
  nlohmann::json sections_config;
  sections_config["model"] = nlohmann::json::parse(cfg.at("porter").at("model").dump());
  if (cfg.contains("optimizer")) {
    sections_config["optimizer"] = nlohmann::json::parse(cfg.at("optimizer").dump());
  }
  meta["config"] = sections_config;
  meta["kernel_table"] = kernels_->kernel_table().to_json();  // Note [Kernel table]
  // Stage 3 holds only the rank's shard of the working parameters (Note [Stage 3 gather]).
  if (im.gatherer) meta["params_range"] = {im.optimizer->begin(), im.optimizer->end()};
  const tensor::Tensor& params = im.gatherer ? im.optimizer->working() : im.flat->params();
  download(*device_, params, section_buffer(snap, previous, "params", params.nbytes()));
  for (const zero::ShardedOptimizer::StateTensor& t : im.optimizer->state_tensors()) {
    const size_t first = t.tensor.nbytes();
    const size_t rest = t.rest.defined() ? t.rest.nbytes() : 0;
    std::vector<std::byte>& bytes = section_buffer(snap, previous, t.name, first + rest);
    download(*device_, t.tensor, bytes);
    // Note [Partial offload]: the host's part, then the device's.
    if (t.rest.defined()) download(*device_, t.rest, bytes, first);
  }
  // zero_optimization.stage3_gather_16bit_weights_on_model_save: the working weights of the
  // whole model (this tp rank's part), gathered from the shards, in one safetensors file that
  // dp rank 0 writes beside the rank directories. A collective: every rank gathers.
  if (im.gatherer && run_.stage3.gather_16bit_weights_on_model_save) {
    const std::vector<float> full = params_host();
    if (dp_rank() == 0) {
      tensor::Tensor host = tensor::Tensor::empty(
          *allocator_, tensor::Shape{static_cast<int64_t>(full.size())}, compute_dtype(),
          memory::Category::kWorkspace);
      tensor::from_host_f32(*device_, full, host);
      std::vector<std::byte> bytes(host.nbytes());
      download(*device_, host, bytes);
      snap.weights_file = tp_size() > 1 ? "model-tp" + std::to_string(tp_rank()) + ".safetensors"
                                        : std::string("model.safetensors");
      snap.weights = io::layout_tensors(model_->layout(), compute_dtype(), bytes);
      snap.weights_metadata = {{"format", "pt"}, {"porter.step", std::to_string(step_)}};
    }
  }
}

void write_snapshot(const CheckpointSnapshot& snapshot, const std::filesystem::path& dir) {
  io::write_state(dir / snapshot.rank_subdir, snapshot.meta, snapshot.sections);
  if (!snapshot.weights_file.empty()) {
    io::write_safetensors(dir / snapshot.weights_file, snapshot.weights, snapshot.weights_metadata);
  }
}

void Engine::save_checkpoint(const std::filesystem::path& dir) const {
  write_snapshot(snapshot_checkpoint(), dir);
}

}  // namespace porter::engine
