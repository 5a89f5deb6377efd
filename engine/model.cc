// TransformerModel's capabilities (Note [Model capabilities] in model.h), and ChainModel: a chain of
// user layers ending in a LossLayer.
#include "engine/model.h"

#include <cmath>

#include "base/check.h"
#include "tensor/philox.h"

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

}  // namespace porter::engine
