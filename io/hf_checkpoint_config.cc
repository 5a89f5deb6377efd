// A Hugging Face config.json as porter.model keys, the checks of the user's porter.model
// against it, and config.json written for an exported model (io/hf_checkpoint.h).
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/error.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"
#include "models/factory.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Note [porter.model.from]
// config.json's keys and transformers' defaults where it leaves one out are the spec's
// (ArchSpec::hf_read_config; the Note of the same name in models/gpt.cc, models/llama.cc, ...).
// porter.model.seq_len stays the user's (the training shape is usually shorter than the
// model's positions) and must be at most n_positions / max_position_embeddings. A user who
// gives none gets porter's default, 1024, or the positions when they are fewer: never the
// positions themselves, which for a Llama are often 8192 or more and would make a training
// shape nobody asked for.
constexpr int64_t kDefaultSeqLen = 1024;

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
    config::ModelConfig m;
    m.type = hf.arch;
    m.hidden = user_int("hidden");
    m.intermediate = 0;
    return models::arch_spec(hf.arch).intermediate(m);
  }
  if (key == "max_positions") return user_int("seq_len");
  return v;
}

bool same(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

std::string known_model_types() {
  std::string s;
  const auto specs = models::arch_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    s += i == 0 ? "" : i + 1 == specs.size() ? " and " : ", ";
    s += "\"" + std::string(specs[i]->hf_model_type()) + "\" (" +
         std::string(specs[i]->hf_class()) + ")";
  }
  return s;
}

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
  const models::HfConfigReader r(hf.json, hf.path.string());
  const Json* type = r.get("model_type");
  if (type == nullptr) {
    r.fail("model_type", "missing; porter reads " + known_model_types() + " models");
  }
  const std::string model_type = type->is_string() ? type->get<std::string>() : type->dump();
  const models::ArchSpec* spec = models::arch_spec_for_hf(model_type);
  if (spec == nullptr) {
    r.fail("model_type", "\"" + model_type + "\": porter reads " + known_model_types() +
                             " models only");
  }
  hf.arch = spec->type();
  models::HfModelKeys keys = spec->hf_read_config(r);
  hf.model_keys = std::move(keys.model_keys);
  hf.hf_key = std::move(keys.hf_key);
  hf.max_positions = keys.max_positions;
  return hf;
}

nlohmann::ordered_json hf_model_overrides(const HfConfig& hf, const Json& user_model) {
  const Json user = user_model.is_object() ? user_model : Json::object();
  const std::string file = "\"" + hf.path.string() + "\"";
  auto conflict = [&](const std::string& user_key, const Json& given, const std::string& key) {
    const Json& theirs = hf.model_keys[key];
    const std::string& hf_key = hf.hf_key.at(key);
    std::string theirs_text = theirs.dump();
    if (key == "arch") {
      theirs_text = "\"" + std::string(models::arch_spec(hf.arch).hf_model_type()) + "\"";
    }
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
      const std::string hf_key(models::arch_spec(hf.arch).hf_positions_key());
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
  m.type = hf.arch;
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
  nlohmann::ordered_json j = models::arch_spec(m.type).hf_write_config(m, source);
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
