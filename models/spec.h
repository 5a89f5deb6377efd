// An architecture is a spec: everything that differs between the decoders porter builds is
// answered by one ArchSpec per architecture (models/gpt.h, models/llama.h, models/qwen2.h),
// looked up through the factory (models/factory.h). Code outside models/ asks the spec and
// never branches on config::ModelType. docs/models.md says how to add an architecture.
//
// Note [Architecture spec]
// A spec owns, for its architecture:
//   - its derived sizes and checks: the MLP width (written once, here), the key/value heads,
//     what porter.model values it builds;
//   - its layers: the block of every layer, the embedding's and the head's parameter names
//     and norm, the parameter-name prefix of the blocks, the init rule, which parameters are
//     replicated under tensor parallelism;
//   - its analytic memory graph: the op graph of one block on one tensor-parallel rank
//     (checkpoint/analytic.h's pieces; the embedding and head graphs are shared, in
//     models/analytic.cc, and read the spec's norm);
//   - its Hugging Face names and config.json mapping: the model_type and class, the tensor
//     names and layout of every parameter, the buffers a file may hold, config.json read
//     into porter.model keys (with transformers' defaults) and written back.
// The shared machinery (models::Transformer, the layers in models/transformer.h, the
// analytic replay, the safetensors reader in io/) is written once and asks the spec.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/analytic.h"
#include "config/config.h"
#include "nn/layer.h"

namespace porter::models {

struct TpShard;
struct TransformerDims;

// The final (and per-block) normalisation: LayerNorm with weight and bias (two statistics,
// mean and rstd) or RMSNorm with a weight only (one statistic, rstd).
enum class Norm { kLayerNorm, kRmsNorm };

// Where an initial value comes from (Note [Transformer init] in models/transformer.cc).
struct InitRule {
  enum Kind { kZero, kOne, kNormal } kind = kNormal;
  float std_dev = 0.02f;
};

// One porter parameter (tensor_parallel 1) and its Hugging Face tensor.
struct HfParam {
  std::string porter_name;     // "h.0.qkv.weight"
  std::string hf_name;         // as porter writes it: "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // porter's: (3C, C)
  bool transposed = false;     // the file holds (in, out): GPT-2's Conv1D
  std::vector<int64_t> hf_shape() const;
};

// A config.json read into porter.model keys (ArchSpec::hf_read_config).
struct HfModelKeys {
  // The porter.model keys config.json fixes, spelt as porter.model spells them: arch, layers,
  // hidden, heads, vocab, tie_embeddings, kv_heads, intermediate, norm_eps, max_positions and,
  // with rotary positions, rope_theta.
  nlohmann::ordered_json model_keys;
  // Each of those keys' config.json key, for messages: "layers" -> "n_layer".
  std::map<std::string, std::string> hf_key;
  // porter.model.seq_len's bound: n_positions (GPT-2), max_position_embeddings (others).
  int64_t max_positions = 0;
};

// Reads config.json's values with their defaults; a value of the wrong kind throws IoError
// naming the file and the key.
class HfConfigReader {
 public:
  HfConfigReader(const nlohmann::json& j, std::string path) : j_(j), path_(std::move(path)) {}
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;
  const nlohmann::json* get(const std::string& key) const;
  int64_t positive(const std::string& key, int64_t fallback) const;
  double positive_real(const std::string& key, double fallback) const;
  bool boolean(const std::string& key, bool fallback) const;
  std::string string(const std::string& key, const std::string& fallback) const;

 private:
  const nlohmann::json& j_;
  std::string path_;
};

class ArchSpec {
 public:
  virtual ~ArchSpec() = default;

  // ---- identity ----
  virtual config::ModelType type() const = 0;
  // porter.model.arch's spelling: "gpt", "llama", "qwen2".
  virtual std::string_view name() const = 0;
  // For messages: "GPT-2", "Llama", "Qwen2".
  virtual std::string_view display_name() const = 0;

  // ---- derived sizes and checks ----
  // The MLP's width: porter.model.intermediate, or the architecture's default when it is 0.
  virtual int64_t intermediate(const config::ModelConfig& m) const = 0;
  // The key/value heads: porter.model.kv_heads, or the heads when it is 0.
  int64_t kv_heads(const config::ModelConfig& m) const {
    return m.kv_heads == 0 ? m.heads : m.kv_heads;
  }
  // Throws InvalidArgument for a porter.model this architecture cannot build (the shared
  // checks of models::Transformer come first).
  virtual void check(const config::ModelConfig& m) const = 0;

  // ---- layers ----
  // Rows of the learned position table (0: none; positions are rotary).
  virtual int64_t position_rows(const config::ModelConfig& m) const = 0;
  // The token table's name ("wte", "embed_tokens.weight"); with positions, the table's
  // ("wpe").
  virtual std::string token_table_name() const = 0;
  virtual std::string position_table_name() const { return ""; }
  // The blocks' parameter-name prefix: "h." (block l is "h.<l>.") or "layers.".
  virtual std::string block_prefix() const = 0;
  // The final norm: its kind and its parameter-name prefix ("lnf", "norm"); the untied head's
  // weight ("head.weight", "lm_head.weight").
  virtual Norm norm() const = 0;
  virtual std::string final_norm_name() const = 0;
  virtual std::string head_name() const = 0;
  // Block l of this tensor-parallel rank.
  virtual std::unique_ptr<nn::Layer> make_block(const config::ModelConfig& m,
                                                const TpShard& tp) const = 0;
  // The initial value rule of parameter `name` (a layout entry's name).
  virtual InitRule init_rule(const std::string& name, const config::ModelConfig& m) const = 0;
  // Whether parameter `name` is whole on every tensor-parallel rank (norms, position table,
  // the row-parallel biases) rather than split.
  virtual bool replicated(const std::string& name) const = 0;

  // ---- analytic memory graph (models/analytic.h) ----
  // One block's forward graph on one rank, with its backward's workspace peak, op by op as
  // the block's layer runs.
  virtual checkpoint::StageGraph block_graph(const TransformerDims& d) const = 0;

  // ---- Hugging Face ----
  virtual std::string_view hf_model_type() const = 0;  // config.json's "model_type"
  virtual std::string_view hf_class() const = 0;       // "GPT2LMHeadModel", ...
  // The prefix of every tensor name but lm_head.weight: "transformer.", "model.".
  virtual std::string_view hf_prefix() const = 0;
  // Whether a file's tensor (its name without the prefix) is a buffer, not a parameter.
  virtual bool hf_is_buffer(const std::string& bare) const = 0;
  // Every parameter of `m` in porter's layout order (docs/formats.md lists them).
  virtual std::vector<HfParam> hf_params(const config::ModelConfig& m) const = 0;
  // config.json's model as porter.model keys (Note [porter.model.from] in the spec's file);
  // throws IoError for a setting porter's model does not compute.
  virtual HfModelKeys hf_read_config(const HfConfigReader& r) const = 0;
  // config.json's key for porter.model.max_positions.
  virtual std::string_view hf_positions_key() const = 0;
  // config.json for `m` (without tie_word_embeddings, token ids and torch_dtype, which
  // io/ adds): the keys transformers reads for hf_class().
  virtual nlohmann::ordered_json hf_write_config(const config::ModelConfig& m,
                                                 const nlohmann::json& source) const = 0;
};

}  // namespace porter::models
