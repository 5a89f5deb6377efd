// The GPT (GPT-2's pre-LN layout, Hugging Face's GPT2LMHeadModel): a token table wte and a
// learned position table wpe, GptBlocks ("h.<l>."), a LayerNorm head (lnf) and head.weight
// when untied. Its MLP is 4 x hidden wide and every key/value head serves one query head.
#pragma once

#include "models/spec.h"

namespace porter::models {

class GptSpec : public ArchSpec {
 public:
  config::ModelType type() const override { return config::ModelType::kGpt; }
  std::string_view name() const override { return "gpt"; }
  std::string_view display_name() const override { return "GPT"; }

  int64_t intermediate(const config::ModelConfig& m) const override { return 4 * m.hidden; }
  void check(const config::ModelConfig& m) const override;

  int64_t position_rows(const config::ModelConfig& m) const override;
  std::string token_table_name() const override { return "wte"; }
  std::string position_table_name() const override { return "wpe"; }
  std::string block_prefix() const override { return "h."; }
  Norm norm() const override { return Norm::kLayerNorm; }
  std::string final_norm_name() const override { return "lnf"; }
  std::string head_name() const override { return "head.weight"; }
  std::unique_ptr<nn::Layer> make_block(const config::ModelConfig& m,
                                        const TpShard& tp) const override;
  InitRule init_rule(const std::string& name, const config::ModelConfig& m) const override;
  bool replicated(const std::string& name) const override;

  checkpoint::StageGraph block_graph(const TransformerDims& d) const override;

  std::string_view hf_model_type() const override { return "gpt2"; }
  std::string_view hf_class() const override { return "GPT2LMHeadModel"; }
  std::string_view hf_prefix() const override { return "transformer."; }
  bool hf_is_buffer(const std::string& bare) const override;
  std::vector<HfParam> hf_params(const config::ModelConfig& m) const override;
  HfModelKeys hf_read_config(const HfConfigReader& r) const override;
  std::string_view hf_positions_key() const override { return "n_positions"; }
  nlohmann::ordered_json hf_write_config(const config::ModelConfig& m,
                                         const nlohmann::json& source) const override;
};

}  // namespace porter::models
