// TransformerModel's capabilities (Note [Model capabilities] in model.h), and ChainModel: a chain of
// user layers ending in a LossLayer.
#include "engine/model.h"

#include <cmath>

#include "base/check.h"
#include "tensor/philox.h"

#include <nlohmann/json.hpp>

namespace porter::engine {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

uint64_t fnv1a(std::string_view s, uint64_t h = 1469598103934665603ull) {
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

void TransformerModel::check_config(const config::Config& config) const {
  PORTER_CHECK(model_->config() == config.porter.model,
               "Engine: the TransformerModel was built from another model config than porter.model "
               "(the plan and the checkpoints describe porter.model); build it from "
               "config.porter.model");
}

std::optional<checkpoint::ChainCosts> TransformerModel::analytic_costs(const RunOptions& run) const {
  // run.shape describes porter.model, which check_config has found to be this model; its
  // tensor_parallel and sequence_parallel make the costs this rank's (every rank of the
  // group has the same).
  return run.analytic_costs();
}

std::vector<bool> TransformerModel::tp_replicated() const {
  if (model_->tp().size == 1) return {};
  std::vector<bool> out;
  for (const nn::ParamEntry& e : model_->layout().entries()) {
    out.push_back(model_->replicated(e.name));
  }
  return out;
}

std::vector<BatchField> Model::batch_spec(const RunOptions& run) const {
  const tensor::Shape ids{run.shape.micro_batch, run.shape.seq};
  return {{"tokens", tensor::DType::kI32, ids}, {"targets", tensor::DType::kI32, ids}};
}

ChainModel::ChainModel(std::vector<std::unique_ptr<nn::Layer>> layers,
                       std::unique_ptr<LossLayer> loss, Init init)
    : init_(std::move(init)) {
  PORTER_CHECK(loss != nullptr, "ChainModel needs a loss layer");
  for (auto& l : layers) PORTER_CHECK(l != nullptr, "ChainModel: layer ", stages_.size(), " is null");
  stages_ = std::move(layers);
  loss_ = loss.get();
  stages_.push_back(std::move(loss));
  for (size_t i = 0; i < stages_.size(); ++i) layout_.add(std::to_string(i), stages_[i]->params());
}

std::string ChainModel::stage_name(int i) const {
  return i == num_stages() - 1 ? "loss" : "layer." + std::to_string(i);
}

void ChainModel::bind(const nn::FlatParams& flat) {
  for (size_t i = 0; i < stages_.size(); ++i) nn::bind_layer(*stages_[i], std::to_string(i), flat);
}

void Model::init_values_range(uint64_t seed, int64_t begin, std::span<float> out) const {
  const std::vector<float> all = init_values(seed);
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t at = begin + static_cast<int64_t>(i);
    out[i] = at < static_cast<int64_t>(all.size()) ? all[static_cast<size_t>(at)] : 0.0f;
  }
}

std::vector<float> ChainModel::init_values(uint64_t seed) const {
  std::vector<float> v(static_cast<size_t>(layout_.total_elems()), 0.0f);
  for (size_t i = 0; i < stages_.size(); ++i) {
    for (const nn::ParamSpec& spec : stages_[i]->params()) {
      const nn::ParamEntry& e = layout_.find(std::to_string(i) + "." + spec.name);
      std::vector<float> values = init_(static_cast<int>(i), spec, seed);
      PORTER_CHECK_EQ(static_cast<int64_t>(values.size()), spec.shape.numel(),
                      "initial values of parameter '", e.name, "'");
      std::copy(values.begin(), values.end(), v.begin() + e.offset_elems);
    }
  }
  return v;
}

std::vector<float> ChainModel::default_init(int stage, const nn::ParamSpec& spec, uint64_t seed) {
  const int64_t n = spec.shape.numel();
  std::vector<float> out(static_cast<size_t>(n), 0.0f);
  if (spec.name.find("norm") != std::string::npos || spec.name.find("scale") != std::string::npos) {
    std::fill(out.begin(), out.end(), 1.0f);
    return out;
  }
  if (spec.shape.rank() < 2 || !ends_with(spec.name, "weight")) return out;
  const uint64_t h = fnv1a(spec.name, fnv1a(std::to_string(stage)));
  tensor::PhiloxKey key;
  key.seed = seed;
  key.stream[0] = static_cast<uint32_t>(h);
  key.stream[1] = static_cast<uint32_t>(h >> 32);
  key.stream[2] = 0x43484e49u;  // "CHNI": disjoint from dropout and GPT init streams
  for (int64_t i = 0; i < n; i += 4) {
    float u[4];
    tensor::philox_uniform4(key, static_cast<uint64_t>(i / 4), u);
    for (int j = 0; j < 4; j += 2) {  // Box-Muller, as the GPT init (Note [GPT init])
      const double r = std::sqrt(-2.0 * std::log(1.0 - static_cast<double>(u[j])));
      const double theta = 2.0 * M_PI * static_cast<double>(u[j + 1]);
      if (i + j < n) out[i + j] = static_cast<float>(0.02 * r * std::cos(theta));
      if (i + j + 1 < n) out[i + j + 1] = static_cast<float>(0.02 * r * std::sin(theta));
    }
  }
  return out;
}

namespace {

std::vector<std::unique_ptr<nn::Layer>> as_layers(std::vector<std::unique_ptr<nn::Module>>& stages) {
  std::vector<std::unique_ptr<nn::Layer>> out;
  for (auto& m : stages) out.push_back(std::move(m));
  return out;
}

// Each stage's initial values come from its module (stage i of `modules`; the loss has none).
ChainModel::Init module_init(std::vector<const nn::Module*> modules) {
  return [modules = std::move(modules)](int stage, const nn::ParamSpec& spec, uint64_t seed) {
    const nn::Module& m = *modules.at(static_cast<size_t>(stage));
    const std::vector<nn::ParamSpec> specs = m.params();
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].name == spec.name) {
        return m.init_param(i, std::to_string(stage) + "." + spec.name, seed);
      }
    }
    throw InternalError("LayerModel: stage " + std::to_string(stage) + " has no parameter " +
                        spec.name);
  };
}

std::vector<const nn::Module*> module_pointers(const std::vector<std::unique_ptr<nn::Module>>& stages) {
  std::vector<const nn::Module*> out;
  for (const auto& m : stages) {
    PORTER_CHECK(m != nullptr, "LayerModel: stage ", out.size(), " is null");
    out.push_back(m.get());
  }
  return out;
}

}  // namespace

LayerModel::Parts LayerModel::parts(std::vector<std::unique_ptr<nn::Module>>& stages) {
  PORTER_CHECK(!stages.empty(), "LayerModel: no stages; give at least one module");
  Parts p;
  p.init = module_init(module_pointers(stages));  // the modules stay where they are
  p.layers = as_layers(stages);
  return p;
}

LayerModel::LayerModel(std::vector<std::unique_ptr<nn::Module>> stages,
                       std::unique_ptr<nn::LossLayer> loss, std::vector<BatchField> batch,
                       std::string input, std::string target)
    : LayerModel(parts(stages), std::move(loss), std::move(batch), std::move(input),
                 std::move(target)) {}

LayerModel::LayerModel(Parts parts, std::unique_ptr<nn::LossLayer> loss,
                       std::vector<BatchField> batch, std::string input, std::string target)
    : ChainModel(std::move(parts.layers), std::move(loss), std::move(parts.init)),
      batch_(std::move(batch)),
      input_(std::move(input)),
      target_(std::move(target)) {
  bool has_input = false, has_target = false;
  for (const BatchField& f : batch_) {
    PORTER_CHECK(!f.name.empty(), "LayerModel: a batch tensor has no name");
    has_input |= f.name == input_;
    has_target |= f.name == target_;
  }
  PORTER_CHECK(has_input, "LayerModel: the input \"", input_, "\" is not one of the batch's tensors");
  PORTER_CHECK(has_target, "LayerModel: the target \"", target_,
               "\" is not one of the batch's tensors");
}

std::vector<BatchField> LayerModel::batch_spec(const RunOptions& run) const {
  std::vector<BatchField> out;
  for (const BatchField& f : batch_) {
    std::vector<int64_t> dims{run.shape.micro_batch};
    for (int64_t d : f.shape.to_vector()) dims.push_back(d);
    out.push_back({f.name, f.dtype, tensor::Shape(dims)});
  }
  return out;
}

namespace {

tensor::DType batch_dtype(const nlohmann::json& j, const std::string& path) {
  PORTER_CHECK(j.is_string(), path, " must be a string: f32, bf16, i32, i64 or bool");
  const std::string s = j.get<std::string>();
  if (s == "f32" || s == "float32") return tensor::DType::kF32;
  if (s == "bf16" || s == "bfloat16") return tensor::DType::kBF16;
  if (s == "i32" || s == "int32") return tensor::DType::kI32;
  if (s == "i64" || s == "int64") return tensor::DType::kI64;
  if (s == "bool") return tensor::DType::kBool;
  PORTER_CHECK(false, path, " is \"", s, "\"; the batch's dtypes are f32, bf16, i32, i64, bool");
  return tensor::DType::kF32;
}

void only_keys(const nlohmann::json& j, const std::string& path,
               std::initializer_list<const char*> keys) {
  PORTER_CHECK(j.is_object(), path, " must be an object");
  for (const auto& [k, v] : j.items()) {
    bool known = false;
    std::string list;
    for (const char* key : keys) {
      known |= k == key;
      list += (list.empty() ? "" : ", ") + std::string(key);
    }
    PORTER_CHECK(known, path, ": unknown key \"", k, "\"; the keys are ", list);
  }
}

}  // namespace

std::unique_ptr<LayerModel> layer_model_from_json(const nlohmann::json& spec) {
  only_keys(spec, "model", {"stages", "loss", "batch", "input", "target"});
  for (const char* key : {"stages", "loss", "batch", "input", "target"}) {
    PORTER_CHECK(spec.contains(key), "model: \"", key, "\" is missing");
  }
  PORTER_CHECK(spec["stages"].is_array() && !spec["stages"].empty(),
               "model.stages must be a non-empty array of modules");
  std::vector<std::unique_ptr<nn::Module>> stages;
  for (const nlohmann::json& m : spec["stages"]) stages.push_back(nn::module_from_json(m));
  std::unique_ptr<nn::LossLayer> loss = nn::loss_from_json(spec["loss"]);
  PORTER_CHECK(spec["batch"].is_object() && !spec["batch"].empty(),
               "model.batch must be an object of the batch's tensors: {\"x\": {\"dtype\": "
               "\"f32\", \"shape\": [16]}, ...}");
  std::vector<BatchField> batch;
  for (const auto& [name, f] : spec["batch"].items()) {
    const std::string path = "model.batch." + name;
    only_keys(f, path, {"dtype", "shape"});
    PORTER_CHECK(f.contains("dtype") && f.contains("shape"), path, " needs dtype and shape");
    PORTER_CHECK(f["shape"].is_array(), path, ".shape must be an array of sizes per sample");
    std::vector<int64_t> dims;
    for (const nlohmann::json& d : f["shape"]) {
      PORTER_CHECK(d.is_number_integer() && d.get<int64_t>() > 0, path,
                   ".shape must hold positive integers");
      dims.push_back(d.get<int64_t>());
    }
    batch.push_back({name, batch_dtype(f["dtype"], path + ".dtype"), tensor::Shape(dims)});
  }
  PORTER_CHECK(spec["input"].is_string() && spec["target"].is_string(),
               "model.input and model.target must name tensors of model.batch");
  return std::make_unique<LayerModel>(std::move(stages), std::move(loss), std::move(batch),
                                      spec["input"].get<std::string>(),
                                      spec["target"].get<std::string>());
}

}  // namespace porter::engine
