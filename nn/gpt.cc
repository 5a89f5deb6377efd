// The GPT model: configuration checks, the flat layout, deterministic init, and one
// micro-batch's forward and backward through its stages.
#include "nn/gpt.h"

#include <cmath>

#include "base/check.h"
#include "nn/philox.h"

namespace porter::nn {

Gpt::Gpt(const config::ModelConfig& config) : config_(config) {
  PORTER_CHECK(config.tensor_parallel == 1, "porter.model.tensor_parallel = ",
               config.tensor_parallel,
               ": tensor parallelism is not supported yet; set it to 1 (the built-in GPT runs "
               "whole on every rank)");
  PORTER_CHECK(config.layers >= 1 && config.hidden >= 1 && config.heads >= 1 &&
                   config.seq_len >= 1 && config.vocab >= 1,
               "porter.model: layers, hidden, heads, seq_len and vocab must be >= 1");
  PORTER_CHECK(config.hidden % config.heads == 0, "porter.model.hidden = ", config.hidden,
               " is not divisible by heads = ", config.heads);
  PORTER_CHECK(config.dropout >= 0.0 && config.dropout < 1.0, "porter.model.dropout = ",
               config.dropout, " must be in [0, 1)");
  const float p = static_cast<float>(config.dropout);
  auto emb = std::make_unique<GptEmbedding>(config.vocab, config.seq_len, config.hidden, p);
  embedding_ = emb.get();
  layout_.add("", emb->params());
  stages_.push_back(std::move(emb));
  for (int64_t l = 0; l < config.layers; ++l) {
    auto block = std::make_unique<GptBlock>(config.hidden, static_cast<int>(config.heads), p);
    layout_.add("h." + std::to_string(l), block->params());
    stages_.push_back(std::move(block));
  }
  auto head = std::make_unique<GptHead>(config.vocab, config.hidden, config.tie_embeddings);
  head_ = head.get();
  layout_.add("", head->params());
  stages_.push_back(std::move(head));
}

std::string Gpt::stage_name(int i) const {
  if (i == 0) return "embedding";
  if (i == num_stages() - 1) return "head";
  return "block." + std::to_string(i - 1);
}

void Gpt::bind(const FlatParams& flat) {
  PORTER_CHECK(&flat.layout() == &layout_ || flat.layout().total_elems() == layout_.total_elems(),
               "Gpt::bind: the flat buffers use another layout");
  bind_layer(*embedding_, "", flat);
  for (int l = 0; l < config_.layers; ++l) bind_layer(stage(l + 1), "h." + std::to_string(l), flat);
  bind_layer(*head_, "", flat);
  if (config_.tie_embeddings) {
    size_t wte = static_cast<size_t>(&layout_.find("wte") - layout_.entries().data());
    head_->bind_tied(flat.param(wte), flat.grad(wte));
  }
}

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<float> Gpt::init_values(uint64_t seed) const {
  // Note [GPT init]: GPT-2's scheme. Matrices ~ normal(0, 0.02), with the residual
  // projections (proj, fc2) scaled by 1/sqrt(2L); biases 0; layernorm weight 1, bias 0.
  // Normals come from Box-Muller over Philox keyed by (seed, FNV-1a of the parameter name),
  // so a parameter's values do not depend on the layout, thread count or device.
  std::vector<float> v(static_cast<size_t>(layout_.total_elems()), 0.0f);
  const float resid_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(config_.layers));
  for (const ParamEntry& e : layout_.entries()) {
    float* out = v.data() + e.offset_elems;
    const int64_t n = e.shape.numel();
    const bool ln = e.name.find("ln") != std::string::npos;
    if (ends_with(e.name, ".bias")) continue;
    if (ln) {
      for (int64_t i = 0; i < n; ++i) out[i] = 1.0f;
      continue;
    }
    float std_dev = 0.02f;
    if (ends_with(e.name, "proj.weight") || ends_with(e.name, "fc2.weight")) std_dev *= resid_scale;
    const uint64_t h = fnv1a(e.name);
    PhiloxKey key;
    key.seed = seed;
    key.stream[0] = static_cast<uint32_t>(h);
    key.stream[1] = static_cast<uint32_t>(h >> 32);
    key.stream[2] = 0x494e4954u;  // "INIT": disjoint from dropout streams' step bits
    for (int64_t i = 0; i < n; i += 4) {
      float u[4];
      philox_uniform4(key, static_cast<uint64_t>(i / 4), u);
      for (int j = 0; j < 4; j += 2) {
        const double r = std::sqrt(-2.0 * std::log(1.0 - static_cast<double>(u[j])));
        const double theta = 2.0 * M_PI * static_cast<double>(u[j + 1]);
        if (i + j < n) out[i + j] = static_cast<float>(std_dev * r * std::cos(theta));
        if (i + j + 1 < n) out[i + j + 1] = static_cast<float>(std_dev * r * std::sin(theta));
      }
    }
  }
  return v;
}

float Gpt::forward_backward(Ctx& ctx, const Tensor& tokens, const Tensor& targets,
                            std::span<const StagePlan> plans) {
  const int n = num_stages();
  PORTER_CHECK(plans.empty() || static_cast<int>(plans.size()) == n, "Gpt::forward_backward: ",
               plans.size(), " stage plans for ", n, " stages");
  PORTER_CHECK(targets.shape() == tokens.shape() && targets.dtype() == DType::kI32,
               "targets must be (B, T) i32 like tokens ", tokens.shape().to_string());
  const StagePlan kDefault;
  std::vector<Tape> tapes(static_cast<size_t>(n));
  std::vector<Tensor> inputs(static_cast<size_t>(n));
  head_->set_targets(targets);
  Tensor x = tokens;
  for (int s = 0; s < n; ++s) {
    const StagePlan& p = plans.empty() ? kDefault : plans[s];
    inputs[s] = x;
    x = forward_stage(ctx, stage(s), s, tapes[s], p.mode, x, p.policy);
  }
  const float loss = to_host_f32(ctx.allocator().device(), x)[0];
  x = Tensor();
  Tensor dy;  // the head ignores its dy (Note in gpt.h)
  for (int s = n - 1; s >= 0; --s) {
    const StagePlan& p = plans.empty() ? kDefault : plans[s];
    if (p.mode == SaveMode::kCheckpoint) recompute_stage(ctx, stage(s), s, tapes[s], inputs[s]);
    inputs[s] = Tensor();
    dy = backward_stage(ctx, stage(s), s, tapes[s], dy);
  }
  return loss;
}

}  // namespace porter::nn
