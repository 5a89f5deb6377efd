// Qwen2's spec (models/qwen2.h): what differs from the Llama's, its biases aside (LlamaBlock
// and LlamaSpec take them through qkv_bias), is its config.json.
#include "models/qwen2.h"

namespace porter::models {

// Note [porter.model.from] (Qwen2, model_type "qwen2"): config.json's keys are the Llama's,
// with Qwen2Config's defaults where it leaves one out: num_hidden_layers 32, hidden_size 4096,
// num_attention_heads 32, num_key_value_heads (the heads), intermediate_size 22016,
// vocab_size 151936, rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings 32768,
// tie_word_embeddings false; hidden_act "silu", rope_scaling null, use_sliding_window false.
// q_proj, k_proj and v_proj always have biases (there is no attention_bias key). With
// porter.model.intermediate 0 the MLP width is the Llama's rule.
LlamaSpec::HfDefaults Qwen2Spec::hf_defaults() const {
  HfDefaults d;
  d.intermediate = 22016;
  d.vocab = 151936;
  d.positions = 32768;
  return d;
}

void Qwen2Spec::hf_check_settings(const HfConfigReader& r) const {
  if (r.boolean("use_sliding_window", false)) {
    r.fail("use_sliding_window", "true: porter's attention is fully causal, without a sliding "
                                 "window; a model that uses one computes otherwise");
  }
}

nlohmann::ordered_json Qwen2Spec::hf_write_config(const config::ModelConfig& m,
                                                  const nlohmann::json& source) const {
  nlohmann::ordered_json j = LlamaSpec::hf_write_config(m, source);
  // Qwen2Config has no attention_bias, mlp_bias, pretraining_tp or head_dim: the biases are
  // always there and the heads are hidden_size / num_attention_heads wide.
  for (const char* key : {"attention_bias", "mlp_bias", "pretraining_tp", "head_dim"}) {
    j.erase(key);
  }
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = m.layers;
  return j;
}

}  // namespace porter::models
