// The decoder the built-in architectures share (models::Transformer) and its layers, which
// follow the layer contract: the embedding, the pre-LN GPT block (GPT-2's layout), the Llama
// block (Note [Llama] below) and the head. What differs between architectures is asked of
// their spec (models/spec.h). The stages (embedding, each block, head) are the unit of
// checkpoint planning. The parameter order and the init are documented in docs/layers.md.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/config.h"
#include "models/spec.h"
#include "nn/ctx.h"
#include "nn/layer.h"

namespace porter::models {

// A model is built from the layer library: nn's names (and the tensors' and kernels' that
// nn uses) are the models' vocabulary.
using namespace porter::nn;

// Note [GPT tensor parallelism]
// With porter.model.tensor_parallel = t > 1 each rank of the tensor-parallel group (the Ctx's
// communicator, Note [Tensor-parallel collectives] in ctx.h) holds 1/t of the GPT, as in
// Megatron-LM (docs/tensor-parallel.md):
// - qkv and fc1 are column-parallel: rank r holds heads [r*H/t, (r+1)*H/t) (its rows of q, k
//   and v) and rows [r*4C/t, (r+1)*4C/t) of fc1, with their biases. proj and fc2 are
//   row-parallel: rank r holds the matching columns; their partial outputs are all-reduced
//   and the (replicated) bias is added after.
// - wte (and the untied head) is vocabulary-parallel: rank r holds rows [r*Vs, (r+1)*Vs) with
//   Vs = ceil(V/t); rows past V are padding, zero and never read. The embedding looks up the
//   tokens in its range (0 elsewhere; rank 0 adds wpe) and all-reduces. The head's logits are
//   (N, Vs) per rank and the cross-entropy is vocabulary-parallel (one all-gather of three
//   floats per row): no rank holds the full logits.
// - Input gradients of column-parallel matmuls are all-reduced on the comm stream while the
//   weight gradient is computed.
// - Sequence parallelism (porter.model.sequence_parallel): layernorm, dropout and the residual
//   stream hold this rank's block of the N = B*T token rows, (N/t, C). Each column-parallel
//   matmul all-gathers its input first and each row-parallel one reduce-scatters its output
//   (the same volume as the all-reduce it replaces); backward re-gathers the saved shard
//   instead of keeping the gathered input. Layernorm weight gradients are then partial over
//   the rows: each stage all-reduces them (one buffer per stage and micro-batch) before
//   accumulating. Stage inputs and outputs of blocks and the head are (N/t, C).
// - Dropout draws each element's mask from its global index (PhiloxKey::group_offset), so the
//   masks, and the losses, are those of t = 1 at every t, with or without sequence
//   parallelism; results differ from t = 1 only by the order of the partial sums.
// Parameter names are those of t = 1 with this rank's shapes; Transformer::shard_values maps t = 1
// values onto them (init, pretrained weights, tests).
struct TpShard {
  int rank = 0;
  int size = 1;
  bool sequence_parallel = false;  // only with size > 1
  int64_t vocab = 0;               // V
  int64_t vocab_shard = 0;         // Vs = ceil(V / size)
  int64_t vocab_begin() const { return rank * vocab_shard; }
  // Real (not padding) rows of this rank's shard.
  int64_t vocab_valid() const;
};

// Note [Llama]
// porter.model.arch "llama" builds Hugging Face's LlamaForCausalLM (models/llama.h): a token
// embedding (embed_tokens, no position table), blocks of
//   x2 = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1))), n1 = rms(x)
//   y  = x2 + down_proj(silu(gate_proj(n2)) * up_proj(n2)),                     n2 = rms(x2)
// and a head of RMSNorm (norm) and lm_head (tied to embed_tokens or its own), with no biases
// (Qwen2, models/qwen2.h, is this block with biases on q_proj, k_proj and v_proj).
// Attention is grouped-query: kv_heads key/value heads, each serving heads / kv_heads query
// heads; rope and the expansion of k and v to every query head are one op (Note [Rotary
// qkv] in kernels.cc), whose output is the GPT's (B, T, 3C) qkv, so the attention kernels,
// the checkpoint policies and the memory model are shared with the GPT. Parameter names are
// Hugging Face's without the "model." prefix. Tensor parallelism splits q, k, v (by heads,
// with their biases), gate and up (by rows) as column-parallel and o and down as
// row-parallel, as in Megatron; kv_heads must divide by t. Dropout (porter.model.dropout)
// sits where the GPT's does, after o_proj and down_proj, and is 0 for a Hugging Face model.

// Stage 0: token embedding (+ a learned position table when the architecture has one), then
// dropout. Input tokens (B, T) i32.
class TransformerEmbedding : public Layer {
 public:
  // positions 0: no position table (rotary positions). Parameter names: token_name
  // ("wte", "embed_tokens.weight"), then position_name ("wpe") with positions.
  TransformerEmbedding(int64_t vocab, int64_t positions, int64_t hidden, float dropout,
                       const TpShard& tp, std::string token_name, std::string position_name);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& tokens) override;  // -> (B, T, C)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;     // -> undefined (tokens)

 private:
  int64_t vocab_, max_seq_, hidden_;
  float dropout_;
  TpShard tp_;
  std::string token_name_, position_name_;
};

// One pre-LN block: x + drop(proj(attn(qkv(ln1(x))))), then + drop(fc2(gelu(fc1(ln2(.))))).
class GptBlock : public Layer {
 public:
  // flash: the block runs flash_attention (its saves hold each row's log-sum-exp, not the
  // (B, H, T, T) probabilities; Note [Flash attention] in kernels/kernels.cc). mlp_tiles > 1:
  // fc1, GELU and fc2 run as one op over that many tiles of the token rows and keep no
  // (.., 4C/t) intermediate (Note [MLP tiles] in models/blocks.cc); not under sequence
  // parallelism.
  GptBlock(int64_t hidden, int heads, float dropout, const TpShard& tp = {},
           float norm_eps = 1e-5f, bool flash = false, int64_t mlp_tiles = 1);
  std::vector<ParamSpec> params() const override;
  // (B, T, C) -> (B, T, C); (N/t, C) -> (N/t, C) under sequence parallelism.
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t hidden_;
  int heads_;
  float dropout_;
  TpShard tp_;
  float eps_;
  bool flash_;
  int64_t mlp_tiles_;  // >= 1
};

// One Llama block (Note [Llama]).
struct LlamaShape {
  int64_t hidden = 0;
  int heads = 1;
  int kv_heads = 1;
  int64_t intermediate = 0;
  float norm_eps = 1e-5f;
  double rope_theta = 10000.0;
  // Biases on q_proj, k_proj and v_proj (Qwen2), after the block's weights in its
  // parameters.
  bool qkv_bias = false;
  // Flash attention on the packed (B, T, (H + 2 Hkv) D) qkv, as GptBlock's flash.
  bool flash = false;
  // gate, up, SwiGLU and down as one op over this many tiles of the token rows, as GptBlock's
  // mlp_tiles (Note [MLP tiles] in models/blocks.cc).
  int64_t mlp_tiles = 1;
};

class LlamaBlock : public Layer {
 public:
  LlamaBlock(const LlamaShape& shape, float dropout, const TpShard& tp = {});
  std::vector<ParamSpec> params() const override;
  // (B, T, C) -> (B, T, C); (N/t, C) -> (N/t, C) under sequence parallelism.
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  LlamaShape shape_;
  float dropout_;
  TpShard tp_;
};

// The final norm, the vocabulary projection (no bias; tied to the token table or its own
// weight) and the mean cross-entropy. Output: the loss (1) f32. Backward ignores dy's values:
// the gradient of the mean loss is scaled by loss_scale (1 unless fp16 loss scaling).
class TransformerHead : public Layer {
 public:
  // Parameter names: norm_name + ".weight" (and ".bias" for a LayerNorm), then head_name
  // when untied.
  TransformerHead(int64_t vocab, int64_t hidden, bool tied, const TpShard& tp, Norm norm,
                  float norm_eps, std::string norm_name, std::string head_name);
  std::vector<ParamSpec> params() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  // The tied weight: views of the embedding's token table and its gradient.
  void bind_tied(const Tensor& wte, const Tensor& dwte);
  // Targets (B, T) i32 of the micro-batch; set before forward and again before recompute.
  void set_targets(const Tensor& targets) { targets_ = targets; }
  void set_loss_scale(float s) { loss_scale_ = s; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;  // (B, T, C) -> (1)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  // The final norm and the projection without the loss: (B, T, C) -> (B, T, V), or this
  // rank's vocabulary columns (N, Vs) under tensor parallelism. Inside a stage's forward
  // (Ctx::begin); saves nothing.
  Tensor logits(Ctx& ctx, const Tensor& x);

 protected:
  int64_t vocab_, hidden_;
  bool tied_;
  TpShard tp_;
  Norm norm_;
  float eps_;
  std::string norm_name_, head_name_;
  Tensor lnf_w_, lnf_b_, head_w_;     // views into the flat parameter buffer
  Tensor dlnf_w_, dlnf_b_, dhead_w_;  // views into the flat gradient buffer
  Tensor targets_;                    // the current micro-batch's input, not a saved tensor
  float loss_scale_ = 1.0f;
};

// The head with porter.model.loss_tiles = k > 1 (Note [Loss tiles] in models/transformer.cc):
// the logits and the cross-entropy run over k contiguous tiles of the token rows, so only one
// tile's (rows, V) logits, or (rows, Vs) under tensor parallelism, exist at a time; it keeps
// the rows' f32 log-sum-exp instead of the logits, and backward recomputes each tile's logits.
// The same parameters, layout and loss as TransformerHead.
class TiledLossHead final : public TransformerHead {
 public:
  TiledLossHead(int64_t vocab, int64_t hidden, bool tied, const TpShard& tp, Norm norm,
                float norm_eps, std::string norm_name, std::string head_name, int64_t tiles);
  Tensor forward(Ctx& ctx, const Tensor& x) override;  // (B, T, C) -> (1)
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t tiles_;  // k >= 1
};

// The rows of each loss tile but the last (Note [Loss tiles]): ceil(rows / tiles).
inline int64_t loss_tile_rows(int64_t rows, int64_t tiles) { return (rows + tiles - 1) / tiles; }

// One parameter of a rank's part and where its values lie in the same parameter at
// tensor_parallel 1 (Transformer::shard_map): each block's rows [row, row + rows) of the
// rank's parameter, all of its columns (cols, 1 for a vector), are the t = 1 parameter's rows
// [whole_row, whole_row + rows), columns [whole_col, whole_col + cols). Rows in no block are
// padding (the vocabulary rows past V): 0. Blocks are in increasing whole_row order.
struct ParamShard {
  struct Block {
    int64_t row = 0, whole_row = 0, rows = 0, whole_col = 0;
  };
  const ParamEntry* entry = nullptr;  // the rank's, in Transformer::layout()
  std::vector<int64_t> whole_shape;   // at t = 1
  int64_t cols = 1;                   // of the rank's parameter (1 for a vector)
  std::vector<Block> blocks;
};

// How one stage runs in Transformer::forward_backward.
struct StagePlan {
  SaveMode mode = SaveMode::kSaveAll;  // kSaveAll or kCheckpoint (then recompute)
  OpPolicy policy = OpPolicy::keep_none();
};

// The decoder of every built-in architecture: an embedding, config.layers blocks and a head,
// each built as the architecture's spec says (Note [Architecture spec] in models/spec.h).
// models::build_model (models/factory.h) makes one.
class Transformer {
 public:
  // This rank's part of the model (Note [GPT tensor parallelism]); tp_rank in
  // [0, config.tensor_parallel). Throws InvalidArgument for configs it cannot build (hidden
  // not divisible by heads, heads not divisible by tensor_parallel, ...).
  explicit Transformer(const config::ModelConfig& config, int tp_rank = 0);

  const config::ModelConfig& config() const { return config_; }
  const ArchSpec& spec() const { return *spec_; }
  const TpShard& tp() const { return tp_; }
  const ParamLayout& layout() const { return layout_; }
  int num_stages() const { return static_cast<int>(stages_.size()); }
  Layer& stage(int i) { return *stages_.at(i); }
  std::string stage_name(int i) const;  // "embedding", "block.3", "head"
  TransformerHead& head() { return *head_; }

  // Binds every stage to views of `flat` (which must use layout()).
  void bind(const FlatParams& flat);
  // Deterministic initial values in layout order, padding zero (docs/layers.md, "Init"):
  // this rank's part of the t = 1 values.
  std::vector<float> init_values(uint64_t seed) const;
  // Elements [begin, begin + out.size()) of init_values(seed) (0 past the layout), computed
  // for those elements only, through shard_map: no buffer of the whole model or of the part.
  void init_values_range(uint64_t seed, int64_t begin, std::span<float> out) const;
  // This rank's part (in layout() order) of `whole`, values in the layout of the same model
  // at tensor_parallel 1 (Note [GPT tensor parallelism]).
  std::vector<float> shard_values(std::span<const float> whole) const;
  // Where shard_values takes each parameter's values from, for reading them from a file
  // without the t = 1 values in memory (io::read_hf_weights_part). One ParamShard per entry
  // of layout(), in its order.
  std::vector<ParamShard> shard_map() const;
  // The inverse: the t = 1 values from every rank's (shards[r] in rank r's layout order, as
  // Engine::params_host gives them). Replicated parameters are taken from rank 0.
  std::vector<float> merge_shards(const std::vector<std::vector<float>>& shards) const;
  // The name of the token table: "wte" (GPT) or "embed_tokens.weight" (Llama).
  std::string embedding_name() const;
  // Whether the parameter named `name` is whole on every tensor-parallel rank (layernorms,
  // RMSNorms, wpe, the row-parallel biases) rather than split (ArchSpec::replicated).
  bool replicated(const std::string& name) const { return spec_->replicated(name); }

  // Forward and backward of one micro-batch through every stage, stage by stage, as
  // `plans` says (empty: all kSaveAll). Returns the mean loss; gradients accumulate into
  // the bound gradient buffer. tokens and targets are (B, T) i32 with T <= seq_len.
  float forward_backward(Ctx& ctx, const Tensor& tokens, const Tensor& targets,
                         std::span<const StagePlan> plans = {});
  // The logits of tokens (B, T) i32, forward only (TransformerHead::logits): for comparing a model
  // with a reference, and for inference. Nothing is kept.
  Tensor forward_logits(Ctx& ctx, const Tensor& tokens);

 private:
  // Whether `name` is the token table or the untied head: split by vocabulary rows.
  bool vocab_parallel(const std::string& name) const;

  config::ModelConfig config_;
  const ArchSpec* spec_;  // a static of models/factory.cc
  TpShard tp_;
  ParamLayout layout_;
  std::vector<std::unique_ptr<Layer>> stages_;
  TransformerEmbedding* embedding_;  // owned by stages_
  TransformerHead* head_;            // owned by stages_
};

}  // namespace porter::models
