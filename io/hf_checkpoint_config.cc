// A Hugging Face config.json as porter.model keys, the checks of the user's porter.model
// against it, and config.json written for an exported model (io/hf_checkpoint.h).
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/error.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Note [porter.model.from]
// config.json's keys, with transformers' defaults where it leaves one out:
//   GPT-2 (model_type "gpt2")    n_layer 12, n_embd 768, n_head 12, n_positions 1024,
//                                vocab_size 50257, layer_norm_epsilon 1e-5,
//                                tie_word_embeddings true; n_inner null (4 x n_embd),
//                                activation_function "gelu_new" (or "gelu_pytorch_tanh", the
//                                same tanh form), scale_attn_weights true,
//                                scale_attn_by_inverse_layer_idx false, add_cross_attention
//                                false
//   Llama (model_type "llama")   num_hidden_layers 32, hidden_size 4096,
//                                num_attention_heads 32, num_key_value_heads (the heads),
//                                intermediate_size 11008, vocab_size 32000, rms_norm_eps 1e-6,
//                                rope_theta 10000, max_position_embeddings 2048,
//                                tie_word_embeddings false; hidden_act "silu", rope_scaling
//                                null, attention_bias and mlp_bias false, head_dim null (or
//                                hidden_size / num_attention_heads)
// porter.model.seq_len stays the user's (the training shape is usually shorter than the
// model's positions) and must be at most n_positions / max_position_embeddings. A user who
// gives none gets porter's default, 1024, or the positions when they are fewer: never the
// positions themselves, which for a Llama are often 8192 or more and would make a training
// shape nobody asked for.
constexpr int64_t kDefaultSeqLen = 1024;

class Reader {
 public:
  Reader(const Json& j, const fs::path& path) : j_(j), where_("\"" + path.string() + "\": ") {}

  [[noreturn]] void fail(const std::string& key, const std::string& message) const {
    throw IoError(where_ + key + ": " + message);
  }
  const Json* get(const std::string& key) const {
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t positive(const std::string& key, int64_t fallback) const {
    const Json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number_integer() || v->get<int64_t>() < 1) {
      fail(key, v->dump() + " is not a positive integer");
    }
    return v->get<int64_t>();
  }
  double positive_real(const std::string& key, double fallback) const {
    const Json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number() || !(v->get<double>() > 0.0) || !std::isfinite(v->get<double>())) {
      fail(key, v->dump() + " is not a positive number");
    }
    return v->get<double>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const Json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) fail(key, v->dump() + " is not true or false");
    return v->get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const Json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) fail(key, v->dump() + " is not a string");
    return v->get<std::string>();
  }

 private:
  const Json& j_;
  std::string where_;
};

void read_gpt2(const Reader& r, HfConfig& hf) {
  const int64_t layers = r.positive("n_layer", 12);
  const int64_t hidden = r.positive("n_embd", 768);
  const int64_t heads = r.positive("n_head", 12);
  const int64_t positions = r.positive("n_positions", 1024);
  const int64_t vocab = r.positive("vocab_size", 50257);
  const double eps = r.positive_real("layer_norm_epsilon", 1e-5);
  const bool tied = r.boolean("tie_word_embeddings", true);
  if (const Json* inner = r.get("n_inner")) {
    if (!inner->is_number_integer() || inner->get<int64_t>() != 4 * hidden) {
      r.fail("n_inner", inner->dump() + ": porter's GPT MLP is 4 x n_embd = " +
                            std::to_string(4 * hidden) + " wide (null means that width)");
    }
  }
  const std::string act = r.string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    r.fail("activation_function", "\"" + act + "\": porter's GPT computes the tanh form of GELU, "
                                  "which is \"gelu_new\" (or \"gelu_pytorch_tanh\")");
  }
  if (!r.boolean("scale_attn_weights", true)) {
    r.fail("scale_attn_weights", "false: porter's attention always scales the scores by "
                                 "1/sqrt(head size)");
  }
  if (r.boolean("scale_attn_by_inverse_layer_idx", false)) {
    r.fail("scale_attn_by_inverse_layer_idx", "true: porter's attention does not scale the "
                                              "scores by the layer index");
  }
  if (r.boolean("add_cross_attention", false)) {
    r.fail("add_cross_attention", "true: porter's GPT is a decoder without cross-attention");
  }
  hf.max_positions = positions;
  hf.model_keys = {{"arch", "gpt"},          {"layers", layers},
                   {"hidden", hidden},       {"heads", heads},
                   {"vocab", vocab},         {"tie_embeddings", tied},
                   {"kv_heads", heads},      {"intermediate", 4 * hidden},
                   {"norm_eps", eps},        {"max_positions", positions}};
  hf.hf_key = {{"arch", "model_type"},         {"layers", "n_layer"},
               {"hidden", "n_embd"},           {"heads", "n_head"},
               {"vocab", "vocab_size"},        {"tie_embeddings", "tie_word_embeddings"},
               {"kv_heads", "n_head"},         {"intermediate", "4 x n_embd ="},
               {"norm_eps", "layer_norm_epsilon"}, {"max_positions", "n_positions"}};
}

void read_llama(const Reader& r, HfConfig& hf) {
  const int64_t layers = r.positive("num_hidden_layers", 32);
  const int64_t hidden = r.positive("hidden_size", 4096);
  const int64_t heads = r.positive("num_attention_heads", 32);
  const int64_t kv_heads = r.positive("num_key_value_heads", heads);
  const int64_t intermediate = r.positive("intermediate_size", 11008);
  const int64_t vocab = r.positive("vocab_size", 32000);
  const int64_t positions = r.positive("max_position_embeddings", 2048);
  const double eps = r.positive_real("rms_norm_eps", 1e-6);
  const double theta = r.positive_real("rope_theta", 10000.0);
  const bool tied = r.boolean("tie_word_embeddings", false);
  const std::string act = r.string("hidden_act", "silu");
  if (act != "silu") {
    r.fail("hidden_act", "\"" + act + "\": porter's Llama MLP computes SiLU (\"silu\")");
  }
  if (const Json* scaling = r.get("rope_scaling")) {
    r.fail("rope_scaling", scaling->dump() + ": porter's rotary embedding has no scaling (only "
                           "rope_theta); a model trained with one would compute otherwise");
  }
  if (r.boolean("attention_bias", false)) {
    r.fail("attention_bias", "true: porter's Llama projections have no bias");
  }
  if (r.boolean("mlp_bias", false)) r.fail("mlp_bias", "true: porter's Llama MLP has no bias");
  if (hidden % heads != 0) {
    r.fail("hidden_size", std::to_string(hidden) + " is not divisible by num_attention_heads " +
                              std::to_string(heads));
  }
  if (const Json* head_dim = r.get("head_dim")) {
    if (!head_dim->is_number_integer() || head_dim->get<int64_t>() != hidden / heads) {
      r.fail("head_dim", head_dim->dump() + ": porter's heads are hidden_size / "
                         "num_attention_heads = " + std::to_string(hidden / heads) + " wide");
    }
  }
  hf.max_positions = positions;
  hf.model_keys = {{"arch", "llama"},        {"layers", layers},
                   {"hidden", hidden},       {"heads", heads},
                   {"vocab", vocab},         {"tie_embeddings", tied},
                   {"kv_heads", kv_heads},   {"intermediate", intermediate},
                   {"norm_eps", eps},        {"rope_theta", theta},
                   {"max_positions", positions}};
  hf.hf_key = {{"arch", "model_type"},            {"layers", "num_hidden_layers"},
               {"hidden", "hidden_size"},         {"heads", "num_attention_heads"},
               {"vocab", "vocab_size"},           {"tie_embeddings", "tie_word_embeddings"},
               {"kv_heads", "num_key_value_heads"}, {"intermediate", "intermediate_size"},
               {"norm_eps", "rms_norm_eps"},      {"rope_theta", "rope_theta"},
               {"max_positions", "max_position_embeddings"}};
}

// Meta's width of a Llama MLP: 8/3 x hidden rounded up to a multiple of 256.
int64_t llama_default_intermediate(int64_t hidden) {
  const int64_t f = 8 * hidden / 3;
  return (f + 255) / 256 * 256;
}

// The user's value of porter.model.<key> in config.json's terms: 0 means the default for
// kv_heads, intermediate and max_positions.
Json effective(const std::string& key, const Json& v, const Json& user_model,
               const HfConfig& hf) {
  if (!v.is_number_integer() || v.get<int64_t>() != 0) return v;
  auto user_int = [&](const char* k) {
    auto it = user_model.find(k);
    return it != user_model.end() && it->is_number_integer() ? it->get<int64_t>()
                                                             : hf.model_keys[k].get<int64_t>();
  };
  if (key == "kv_heads") return user_int("heads");
  if (key == "intermediate") {
    const int64_t c = user_int("hidden");
    return hf.arch == HfArch::kGpt2 ? 4 * c : llama_default_intermediate(c);
  }
  if (key == "max_positions") return user_int("seq_len");
  return v;
}

bool same(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

std::string hf_arch_name(HfArch a) { return a == HfArch::kGpt2 ? "gpt2" : "llama"; }

}  // namespace

HfConfig read_hf_config(const fs::path& dir) {
  HfConfig hf;
  hf.path = dir / "config.json";
  const std::string where = "\"" + hf.path.string() + "\": ";
  std::ifstream in(hf.path);
  if (!in) {
    std::error_code ec;
    const bool is_dir = fs::is_directory(dir, ec);
    throw IoError(where + "cannot read" +
                  (is_dir ? std::string(" (porter.model.from names a directory without a "
                                        "config.json; it needs a Hugging Face model directory)")
                          : std::string(": porter.model.from must name a Hugging Face model "
                                        "directory (config.json and model.safetensors)")));
  }
  std::stringstream text;
  text << in.rdbuf();
  try {
    hf.json = Json::parse(text.str());
  } catch (const Json::exception& e) {
    throw IoError(where + "not valid JSON: " + e.what());
  }
  if (!hf.json.is_object()) throw IoError(where + "not a JSON object");
  const Reader r(hf.json, hf.path);
  const Json* type = r.get("model_type");
  if (type == nullptr) {
    r.fail("model_type", "missing; porter reads \"gpt2\" (GPT2LMHeadModel) and \"llama\" "
                         "(LlamaForCausalLM) models");
  }
  const std::string model_type = type->is_string() ? type->get<std::string>() : type->dump();
  if (model_type == "gpt2") {
    hf.arch = HfArch::kGpt2;
    read_gpt2(r, hf);
  } else if (model_type == "llama") {
    hf.arch = HfArch::kLlama;
    read_llama(r, hf);
  } else {
    r.fail("model_type", "\"" + model_type + "\": porter reads \"gpt2\" (GPT2LMHeadModel) and "
                         "\"llama\" (LlamaForCausalLM) models only");
  }
  return hf;
}

nlohmann::ordered_json hf_model_overrides(const HfConfig& hf, const Json& user_model) {
  const Json user = user_model.is_object() ? user_model : Json::object();
  const std::string file = "\"" + hf.path.string() + "\"";
  auto conflict = [&](const std::string& user_key, const Json& given, const std::string& key) {
    const Json& theirs = hf.model_keys[key];
    const std::string& hf_key = hf.hf_key.at(key);
    std::string theirs_text = theirs.dump();
    if (key == "arch") theirs_text = "\"" + hf_arch_name(hf.arch) + "\"";
    throw config::ConfigError(
        "porter.model." + user_key,
        given.dump() + " contradicts the model porter.model.from names: " + file + " has " +
            hf_key + " " + theirs_text + " (porter.model." + key + " " + theirs.dump() +
            "); drop porter.model." + user_key + " (the shape comes from config.json) or point "
            "porter.model.from at another model");
  };
  nlohmann::ordered_json out;
  for (const auto& [key, theirs] : hf.model_keys.items()) {
    // porter.model.arch's older spelling is "type": set the one the user wrote.
    std::string user_key = key;
    if (key == "arch" && !user.contains("arch") && user.contains("type")) user_key = "type";
    auto it = user.find(user_key);
    if (it != user.end() && !it->is_null()) {
      if (!same(effective(key, *it, user, hf), theirs)) conflict(user_key, *it, key);
    }
    out[user_key] = theirs;
  }
  auto seq = user.find("seq_len");
  if (seq != user.end() && !seq->is_null()) {
    if (seq->is_number_integer() && seq->get<int64_t>() > hf.max_positions) {
      const std::string& hf_key = hf.arch == HfArch::kGpt2 ? "n_positions" : "max_position_embeddings";
      throw config::ConfigError(
          "porter.model.seq_len",
          seq->dump() + " is longer than the model porter.model.from names was made for: \"" +
              hf.path.string() + "\" has " + hf_key + " " + std::to_string(hf.max_positions) +
              "; train on at most " + std::to_string(hf.max_positions) + " tokens per row");
    }
  } else if (kDefaultSeqLen > hf.max_positions) {
    out["seq_len"] = hf.max_positions;
  }
  return out;
}

config::ModelConfig hf_model_config(const HfConfig& hf, const config::ModelConfig& base) {
  if (base.seq_len > hf.max_positions) {
    throw InvalidArgument("porter.model.seq_len " + std::to_string(base.seq_len) +
                          " is longer than the " + std::to_string(hf.max_positions) +
                          " positions of \"" + hf.path.string() + "\"");
  }
  config::ModelConfig m = base;
  const nlohmann::ordered_json& k = hf.model_keys;
  m.type = hf.arch == HfArch::kGpt2 ? config::ModelType::kGpt : config::ModelType::kLlama;
  m.layers = k["layers"].get<int64_t>();
  m.hidden = k["hidden"].get<int64_t>();
  m.heads = k["heads"].get<int64_t>();
  m.vocab = k["vocab"].get<int64_t>();
  m.tie_embeddings = k["tie_embeddings"].get<bool>();
  m.kv_heads = k["kv_heads"].get<int64_t>();
  m.intermediate = k["intermediate"].get<int64_t>();
  m.norm_eps = k["norm_eps"].get<double>();
  m.rope_theta = k.contains("rope_theta") ? k["rope_theta"].get<double>() : 10000.0;
  m.max_positions = k.contains("max_positions") ? k["max_positions"].get<int64_t>() : 0;
  m.from = hf.path.parent_path().string();
  return m;
}

nlohmann::ordered_json hf_config_json(const config::ModelConfig& m, tensor::DType dtype,
                                      const Json& source) {
  const char* torch_dtype = dtype == tensor::DType::kBF16  ? "bfloat16"
                            : dtype == tensor::DType::kF16 ? "float16"
                                                       : "float32";
  nlohmann::ordered_json j;
  if (m.type == config::ModelType::kGpt) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["vocab_size"] = m.vocab;
    j["n_positions"] = m.max_positions > 0 ? m.max_positions : m.seq_len;
    j["n_embd"] = m.hidden;
    j["n_layer"] = m.layers;
    j["n_head"] = m.heads;
    j["n_inner"] = nullptr;
    j["activation_function"] = "gelu_new";
    // porter drops after the embedding and each residual branch, never attention weights.
    j["resid_pdrop"] = m.dropout;
    j["embd_pdrop"] = m.dropout;
    j["attn_pdrop"] = 0.0;
    j["layer_norm_epsilon"] = m.norm_eps;
    j["initializer_range"] = 0.02;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    j["use_cache"] = true;
  } else {
    const int64_t kv = m.kv_heads > 0 ? m.kv_heads : m.heads;
    const int64_t f = m.intermediate > 0 ? m.intermediate : llama_default_intermediate(m.hidden);
    int64_t positions = m.max_positions > 0 ? m.max_positions : m.seq_len;
    if (m.max_positions == 0 && source.is_object()) {
      auto it = source.find("max_position_embeddings");
      if (it != source.end() && it->is_number_integer() && it->get<int64_t>() >= m.seq_len) {
        positions = it->get<int64_t>();
      }
    }
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["vocab_size"] = m.vocab;
    j["hidden_size"] = m.hidden;
    j["intermediate_size"] = f;
    j["num_hidden_layers"] = m.layers;
    j["num_attention_heads"] = m.heads;
    j["num_key_value_heads"] = kv;
    j["head_dim"] = m.hidden / m.heads;
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = positions;
    j["rms_norm_eps"] = m.norm_eps;
    j["rope_theta"] = m.rope_theta;
    j["rope_scaling"] = nullptr;
    j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
    j["initializer_range"] = 0.02;
    j["use_cache"] = true;
  }
  j["tie_word_embeddings"] = m.tie_embeddings;
  if (source.is_object()) {
    for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      auto it = source.find(k);
      if (it != source.end()) j[k] = *it;
    }
  }
  j["torch_dtype"] = torch_dtype;
  return j;
}

}  // namespace porter::io
