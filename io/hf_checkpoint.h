// Hugging Face checkpoints of every built-in architecture (GPT2LMHeadModel, LlamaForCausalLM,
// Qwen2ForCausalLM, ...): a model directory's config.json as porter.model keys, its
// safetensors weights as porter's parameter values, and the same two files written back
// (docs/formats.md). The names, shapes and config.json keys are the architecture's spec's
// (Note [Architecture spec] in models/spec.h); this file reads and writes them.
//
// Note [Hugging Face checkpoints]
// A model directory holds config.json and either model.safetensors or sharded files listed in
// model.safetensors.index.json ({"weight_map": {tensor: file}}); model.safetensors wins when
// both are there, as in transformers. Every tensor of a porter parameter (hf_param_map) maps
// to one Hugging Face tensor:
// - Names appear bare (the published gpt2 files: "h.0.attn.c_attn.weight") or under the
//   spec's prefix (what save_pretrained writes): "transformer." (GPT-2), "model." (others);
//   lm_head.weight never has a prefix. porter writes the prefixed form, which is what
//   save_pretrained writes and what the Hugging Face classes' state_dict use.
// - GPT-2's Conv1D weights (c_attn, c_proj, c_fc, mlp.c_proj) are (in, out): the transpose
//   of porter's nn.Linear (out, in). Llama's weights are nn.Linear already, and its rotary
//   embedding is rotate_half's in both, so q_proj and k_proj are copied as they are.
// - Buffers (ArchSpec::hf_is_buffer) are skipped: GPT-2's h.<l>.attn.bias and
//   h.<l>.attn.masked_bias, the rotary models' *.rotary_emb.inv_freq. With tied embeddings a file may still hold lm_head.weight; it must
//   then equal the embedding.
// Reading refuses, each with its own message naming the file and the tensor: tensors missing
// and tensors porter does not know (one message listing all of them), a shape other than
// config.json implies (both shapes), a dtype other than F32, BF16 and F16 (which widen to f32
// exactly), a non-finite value (its first index), and every malformed safetensors header
// (SafetensorsFile) or index.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "models/spec.h"
#include "tensor/dtype.h"
#include "nn/layer.h"

namespace porter::comm {
class Communicator;
}
namespace porter::models {
class Transformer;
}

namespace porter::io {


// config.json, read and checked (read_hf_config).
struct HfConfig {
  // The architecture whose spec's hf_model_type() is config.json's model_type.
  config::ModelType arch = config::ModelType::kGpt;
  std::filesystem::path path;  // dir/config.json
  // The porter.model keys config.json fixes, spelt as porter.model spells them: arch, layers,
  // hidden, heads, vocab, tie_embeddings, kv_heads, intermediate, norm_eps, max_positions
  // (n_positions, max_position_embeddings) and, for Llama, rope_theta.
  nlohmann::ordered_json model_keys;
  // Each of those keys' config.json key, for messages: "layers" -> "n_layer".
  std::map<std::string, std::string> hf_key;
  // n_positions (GPT-2) or max_position_embeddings (others): porter.model.seq_len's bound.
  int64_t max_positions = 0;
  nlohmann::json json;  // the file as read
};

// Reads dir/config.json (Note [porter.model.from] in each spec's file, models/gpt.cc,
// models/llama.cc, ..., lists the keys and their defaults). Throws IoError naming the file,
// the key, its value and the rule: an unreadable file, malformed JSON, a model_type no spec
// has, a shape key that is not a positive integer, and the settings porter's models do not
// compute (GPT-2: an activation_function other than gelu_new, n_inner other than null or
// 4 x n_embd, attention scaling switched; Llama: hidden_act other than silu, rope_scaling,
// attention_bias or mlp_bias, a head_dim other than hidden_size / num_attention_heads).
HfConfig read_hf_config(const std::filesystem::path& dir);

// The keys to set over the user's porter.model (`user_model`: the merged porter.model object
// of the user's files and --set, or null) so that it is config.json's model: config.json's
// model_keys, and seq_len = max_positions when the user gave no seq_len and porter's default
// (1024) is longer. Training keys (seq_len, dropout, tensor_parallel, sequence_parallel) stay
// the user's. Throws ConfigError at porter.model.<key> for a key the user set to another
// value than config.json's (0 for kv_heads, intermediate and max_positions means their
// default), naming both values and the config.json key, and for a seq_len above
// max_positions.
nlohmann::ordered_json hf_model_overrides(const HfConfig& hf, const nlohmann::json& user_model);

// `base` with config.json's model (for a program that builds its Config itself rather than
// through the config parser): every field of model_keys set from config.json, `from` set to
// the directory, the training fields (seq_len, dropout, tensor_parallel, sequence_parallel)
// kept. Throws InvalidArgument when base.seq_len is above max_positions.
config::ModelConfig hf_model_config(const HfConfig& hf, const config::ModelConfig& base);

// config.json for `model` (tensor_parallel ignored) with weights of `dtype` (torch_dtype): the
// keys transformers reads for the spec's class (ArchSpec::hf_write_config). From `source`
// (the config.json the model was read from, or null) it keeps bos_token_id, eos_token_id,
// pad_token_id and, for the rotary models, max_position_embeddings when it is at least
// seq_len (they have no position table, so seq_len is written otherwise).
nlohmann::ordered_json hf_config_json(const config::ModelConfig& model, tensor::DType dtype,
                                      const nlohmann::json& source = nullptr);

// One porter parameter (tensor_parallel 1) and its Hugging Face tensor.
using HfParam = models::HfParam;

// Every parameter of `model` in porter's layout order (ArchSpec::hf_params; docs/formats.md
// lists them).
std::vector<HfParam> hf_param_map(const config::ModelConfig& model);

struct HfWeights {
  std::vector<float> values;                // in the layout's order, padding zero
  std::vector<std::filesystem::path> files;  // the safetensors files read
  int64_t tensors = 0;                      // read into a parameter
  int64_t skipped = 0;                      // buffers skipped
  std::vector<std::string> dtypes;          // of the tensors read: "BF16", ...
  uint64_t bytes = 0;                       // of the tensors read
};

// Reads `dir`'s weights (Note [Hugging Face checkpoints]) for `model` (its config.json's; the
// tensor-parallel keys are ignored) into `layout`, the layout of the same model at
// tensor_parallel 1. Throws IoError for the files (naming them and the tensor), and
// InvalidArgument when `layout` is not the model's (a parameter hf_param_map does not have,
// or has with another shape).
HfWeights read_hf_weights(const std::filesystem::path& dir, const config::ModelConfig& model,
                          const nn::ParamLayout& layout);
// The same into the layout of models::build_model(model at tensor_parallel 1).
HfWeights read_hf_weights(const std::filesystem::path& dir, const config::ModelConfig& model);

// Note [Sharded loading]
// read_hf_weights holds the whole model in f32, which every rank of a run would then hold at
// once (a 7B model is 28 GB a rank). read_hf_weights_part reads only what one rank keeps: a
// range [begin, begin + out.size()) of the padded flat buffer of its tensor-parallel part,
// `part` (models::build_model(model, tp_rank)): the whole buffer below ZeRO stage 3, the
// rank's shard of it at stage 3 (Engine::set_params_host_range calls for one or the other).
// Each element is converted from the memory-mapped file's dtype straight into its place in
// `out`, through Transformer::shard_map, which says where shard_values takes each parameter's
// rows and columns from: the values are those of shard_values(read_hf_weights(...).values)
// in that range, bit for bit, and nothing of the model is held besides `out`. The pages of the
// files that have been read are dropped from the resident set as the read goes (madvise
// MADV_DONTNEED on the read-only mapping; they stay in the page cache), at most 16 MiB behind
// it, so a rank's peak host memory is its part plus a few MiB, whatever the model's size.
// Every check of read_hf_weights is made, with the same messages, on every rank (the names,
// dtypes and shapes of all tensors from the headers; a tied lm_head.weight against the whole
// embedding), except that a rank finds only the values that are not finite within what it
// reads (some rank reads each element, so a run still refuses them). The counts returned (files,
// tensors, skipped, dtypes, bytes) are those of read_hf_weights; `values` stays empty.
HfWeights read_hf_weights_part(const std::filesystem::path& dir, const models::Transformer& part,
                               int64_t begin, std::span<float> out);

struct HfExport {
  std::filesystem::path config_file, weights_file;
  int64_t tensors = 0;
  int64_t num_params = 0;
  uint64_t bytes = 0;  // of model.safetensors
};

// Writes dir/config.json (hf_config_json) and dir/model.safetensors from `values`, the whole
// model's parameters in `layout` (tensor_parallel 1) order, as `dtype` (f32, bf16 or f16;
// rounded to nearest even), with "__metadata__": {"format": "pt"}. Each file is written
// atomically. Throws InvalidArgument for values that do not fit the layout and for a
// non-finite value (naming the parameter and its index), IoError when a file cannot be
// written.
HfExport write_hf_checkpoint(const std::filesystem::path& dir, const config::ModelConfig& model,
                             const nn::ParamLayout& layout, std::span<const float> values,
                             tensor::DType dtype, const nlohmann::json& source_config = nullptr);


}  // namespace porter::io
