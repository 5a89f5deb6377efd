// The Llama family (Hugging Face's LlamaForCausalLM, Note [Llama] in models/transformer.h): a
// token table embed_tokens without positions (rotary), LlamaBlocks ("layers.<l>."), an
// RMSNorm head (norm) and lm_head.weight when untied. Grouped-query attention; the MLP
// (SwiGLU) is porter.model.intermediate wide, by default 8/3 x hidden rounded up to a
// multiple of 256. Qwen2 (models/qwen2.h) is this spec with biases on q, k and v.
#pragma once

#include "models/spec.h"

namespace porter::models {

class LlamaSpec : public ArchSpec {
 public:
  config::ModelType type() const override { return config::ModelType::kLlama; }
  std::string_view name() const override { return "llama"; }
  std::string_view display_name() const override { return "Llama"; }

  // Meta's width: 8/3 x hidden rounded up to a multiple of 256, when intermediate is 0.
  int64_t intermediate(const config::ModelConfig& m) const override;
  void check(const config::ModelConfig& m) const override;

  int64_t position_rows(const config::ModelConfig&) const override { return 0; }
  std::string token_table_name() const override { return "embed_tokens.weight"; }
  std::string block_prefix() const override { return "layers."; }
  Norm norm() const override { return Norm::kRmsNorm; }
  std::string final_norm_name() const override { return "norm"; }
  std::string head_name() const override { return "lm_head.weight"; }
  std::unique_ptr<nn::Layer> make_block(const config::ModelConfig& m,
                                        const TpShard& tp) const override;
  InitRule init_rule(const std::string& name, const config::ModelConfig& m) const override;
  bool replicated(const std::string& name) const override;

  checkpoint::StageGraph block_graph(const TransformerDims& d) const override;

  std::string_view hf_model_type() const override { return "llama"; }
  std::string_view hf_class() const override { return "LlamaForCausalLM"; }
  std::string_view hf_prefix() const override { return "model."; }
  bool hf_is_buffer(const std::string& bare) const override;
  std::vector<HfParam> hf_params(const config::ModelConfig& m) const override;
  HfModelKeys hf_read_config(const HfConfigReader& r) const override;
  std::string_view hf_positions_key() const override { return "max_position_embeddings"; }
  nlohmann::ordered_json hf_write_config(const config::ModelConfig& m,
                                         const nlohmann::json& source) const override;

 protected:
  // Biases on q_proj, k_proj and v_proj (LlamaShape::qkv_bias).
  virtual bool qkv_bias() const { return false; }
  // transformers' defaults for the keys config.json leaves out.
  struct HfDefaults {
    int64_t layers = 32, hidden = 4096, heads = 32, intermediate = 11008, vocab = 32000;
    int64_t positions = 2048;
    double norm_eps = 1e-6, rope_theta = 10000.0;
    bool tied = false;
  };
  virtual HfDefaults hf_defaults() const { return {}; }
  // The settings of this family's config.json that porter's block does not compute, beyond
  // the shared ones (hidden_act, rope_scaling, head_dim): throws through r.fail.
  virtual void hf_check_settings(const HfConfigReader& r) const;
};

}  // namespace porter::models
