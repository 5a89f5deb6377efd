// Qwen2 (Hugging Face's Qwen2ForCausalLM): the Llama (models/llama.h) with biases on q_proj,
// k_proj and v_proj, under the same names ("model." prefix, "layers.<l>."). config.json's
// model_type is "qwen2"; its defaults are Qwen2Config's (Note [porter.model.from] in
// models/qwen2.cc). Sliding-window attention is refused (porter's attention is fully causal).
#pragma once

#include "models/llama.h"

namespace porter::models {

class Qwen2Spec : public LlamaSpec {
 public:
  config::ModelType type() const override { return config::ModelType::kQwen2; }
  std::string_view name() const override { return "qwen2"; }
  std::string_view display_name() const override { return "Qwen2"; }

  std::string_view hf_model_type() const override { return "qwen2"; }
  std::string_view hf_class() const override { return "Qwen2ForCausalLM"; }
  nlohmann::ordered_json hf_write_config(const config::ModelConfig& m,
                                         const nlohmann::json& source) const override;

 protected:
  bool qkv_bias() const override { return true; }
  HfDefaults hf_defaults() const override;
  void hf_check_settings(const HfConfigReader& r) const override;
};

}  // namespace porter::models
