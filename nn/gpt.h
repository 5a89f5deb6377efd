// The built-in pre-LN GPT decoder, built from layers that follow the layer contract. Its
// stages (embedding, each block, head) are the unit of checkpoint planning. The parameter
// order and the init are documented in docs/layers.md.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/config.h"
#include "nn/ctx.h"
#include "nn/layer.h"

namespace porter::nn {

// Stage 0: token + position embedding, then dropout. Input tokens (B, T) i32.
class GptEmbedding : public Layer {
 public:
  GptEmbedding(int64_t vocab, int64_t max_seq, int64_t hidden, float dropout);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& tokens) override;  // -> (B, T, C)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;     // -> undefined (tokens)

 private:
  int64_t vocab_, max_seq_, hidden_;
  float dropout_;
};

// One pre-LN block: x + drop(proj(attn(qkv(ln1(x))))), then + drop(fc2(gelu(fc1(ln2(.))))).
class GptBlock : public Layer {
 public:
  GptBlock(int64_t hidden, int heads, float dropout);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t hidden_;
  int heads_;
  float dropout_;
};

// Final layernorm, the vocabulary projection (no bias; tied to wte or its own weight) and
// the mean cross-entropy. Output: the loss (1) f32. Backward ignores dy's values: the
// gradient of the mean loss is scaled by loss_scale (1 unless fp16 loss scaling).
class GptHead : public Layer {
 public:
  GptHead(int64_t vocab, int64_t hidden, bool tied);
  std::vector<ParamSpec> params() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  // The tied weight: views of the embedding's wte and its gradient.
  void bind_tied(const Tensor& wte, const Tensor& dwte);
  // Targets (B, T) i32 of the micro-batch; set before forward and again before recompute.
  void set_targets(const Tensor& targets) { targets_ = targets; }
  void set_loss_scale(float s) { loss_scale_ = s; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;  // (B, T, C) -> (1)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t vocab_, hidden_;
  bool tied_;
  Tensor lnf_w_, lnf_b_, head_w_;     // views into the flat parameter buffer
  Tensor dlnf_w_, dlnf_b_, dhead_w_;  // views into the flat gradient buffer
  Tensor targets_;                    // the current micro-batch's input, not a saved tensor
  float loss_scale_ = 1.0f;
};

// How one stage runs in Gpt::forward_backward.
struct StagePlan {
  SaveMode mode = SaveMode::kSaveAll;  // kSaveAll or kCheckpoint (then recompute)
  OpPolicy policy = OpPolicy::keep_none();
};

class Gpt {
 public:
  // Throws InvalidArgument for configs it cannot build (tensor_parallel > 1, hidden not
  // divisible by heads, ...).
  explicit Gpt(const config::ModelConfig& config);

  const config::ModelConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int num_stages() const { return static_cast<int>(stages_.size()); }
  Layer& stage(int i) { return *stages_.at(i); }
  std::string stage_name(int i) const;  // "embedding", "block.3", "head"
  GptHead& head() { return *head_; }

  // Binds every stage to views of `flat` (which must use layout()).
  void bind(const FlatParams& flat);
  // Deterministic initial values in layout order, padding zero (docs/layers.md, "Init").
  std::vector<float> init_values(uint64_t seed) const;

  // Forward and backward of one micro-batch through every stage, stage by stage, as
  // `plans` says (empty: all kSaveAll). Returns the mean loss; gradients accumulate into
  // the bound gradient buffer. tokens and targets are (B, T) i32 with T <= seq_len.
  float forward_backward(Ctx& ctx, const Tensor& tokens, const Tensor& targets,
                         std::span<const StagePlan> plans = {});

 private:
  config::ModelConfig config_;
  ParamLayout layout_;
  std::vector<std::unique_ptr<Layer>> stages_;
  GptEmbedding* embedding_;  // owned by stages_
  GptHead* head_;            // owned by stages_
};

}  // namespace porter::nn
