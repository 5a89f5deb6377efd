// The layer library's JSON factory (nn/library.h, docs/layers.md): module_from_json and
// loss_from_json, with every key checked and errors naming the JSON path.
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/check.h"
#include "base/error.h"
#include "nn/library.h"

namespace porter::nn {
namespace {

// One JSON object being read: the constructor checks that every key is one the type knows
// (nothing is silently ignored), and the typed getters name the JSON path in their errors.
class JsonObject {
 public:
  JsonObject(const nlohmann::json& j, std::string path, const std::string& type,
             std::vector<std::string> keys)
      : j_(j), path_(std::move(path)), type_(type), keys_(std::move(keys)) {
    keys_.push_back("type");
    for (const auto& [key, _] : j_.items()) {
      bool known = false;
      for (const std::string& k : keys_) known = known || k == key;
      if (!known) {
        std::string valid;
        for (const std::string& k : keys_) valid += (valid.empty() ? "" : ", ") + k;
        throw InvalidArgument(str_cat(path_, ".", key, ": unknown key for type \"", type_,
                                      "\"; valid keys: ", valid));
      }
    }
  }

  const nlohmann::json* find(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  const nlohmann::json& need(const char* key) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) {
      throw InvalidArgument(str_cat(path_, ".", key, ": missing; type \"", type_,
                                    "\" needs it"));
    }
    return *v;
  }
  std::string at(const char* key) const { return path_ + "." + key; }

  int64_t positive_int(const char* key) const {
    const nlohmann::json& v = need(key);
    if (!v.is_number_integer() || v.get<int64_t>() <= 0) {
      throw InvalidArgument(str_cat(at(key), ": ", v.dump(), " must be a positive integer"));
    }
    return v.get<int64_t>();
  }
  float number(const char* key, float fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number()) throw InvalidArgument(str_cat(at(key), ": ", v->dump(), " must be a number"));
    return v->get<float>();
  }
  bool boolean(const char* key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) {
      throw InvalidArgument(str_cat(at(key), ": ", v->dump(), " must be true or false"));
    }
    return v->get<bool>();
  }

 private:
  const nlohmann::json& j_;
  std::string path_;
  std::string type_;
  std::vector<std::string> keys_;
};

constexpr const char* kModuleTypes =
    "linear, embedding, layernorm, rmsnorm, gelu, relu, silu, dropout, attention, mlp, "
    "residual, sequential";
constexpr const char* kLossTypes = "cross_entropy, mse";

std::string type_of(const nlohmann::json& j, const std::string& path, const char* valid) {
  if (!j.is_object()) {
    throw InvalidArgument(str_cat(path, ": ", j.dump(), " must be an object with a \"type\" (",
                                  valid, ")"));
  }
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) {
    throw InvalidArgument(str_cat(path, ".type: missing or not a string; valid types: ", valid));
  }
  return it->get<std::string>();
}

std::unique_ptr<Module> build_module(const nlohmann::json& j, const std::string& path);

// A constructor's own check (heads dividing dim, p in [0, 1), a duplicate child name) gets the
// JSON path in front; the factory's messages start with their path already.
std::unique_ptr<Module> module_at(const nlohmann::json& j, const std::string& path) {
  try {
    return build_module(j, path);
  } catch (const InvalidArgument& e) {
    if (std::string_view(e.what()).starts_with("$")) throw;
    throw InvalidArgument(str_cat(path, ": ", e.what()));
  }
}

std::unique_ptr<Module> build_module(const nlohmann::json& j, const std::string& path) {
  const std::string type = type_of(j, path, kModuleTypes);
  // Evaluation order matters: the key check runs first, in the JsonObject constructor.
  if (type == "linear") {
    JsonObject o(j, path, type, {"in", "out", "bias"});
    return std::make_unique<Linear>(o.positive_int("in"), o.positive_int("out"),
                                    o.boolean("bias", true));
  }
  if (type == "embedding") {
    JsonObject o(j, path, type, {"num", "dim"});
    return std::make_unique<Embedding>(o.positive_int("num"), o.positive_int("dim"));
  }
  if (type == "layernorm") {
    JsonObject o(j, path, type, {"dim", "eps"});
    return std::make_unique<LayerNorm>(o.positive_int("dim"), o.number("eps", 1e-5f));
  }
  if (type == "rmsnorm") {
    JsonObject o(j, path, type, {"dim", "eps"});
    return std::make_unique<RMSNorm>(o.positive_int("dim"), o.number("eps", 1e-6f));
  }
  if (type == "gelu" || type == "relu" || type == "silu") {
    JsonObject o(j, path, type, {});
    if (type == "gelu") return std::make_unique<GELU>();
    if (type == "relu") return std::make_unique<ReLU>();
    return std::make_unique<SiLU>();
  }
  if (type == "dropout") {
    JsonObject o(j, path, type, {"p"});
    o.need("p");
    return std::make_unique<Dropout>(o.number("p", 0.0f));
  }
  if (type == "attention") {
    JsonObject o(j, path, type, {"dim", "heads", "dropout", "flash", "eps"});
    const int64_t dim = o.positive_int("dim");
    const int64_t heads = o.positive_int("heads");
    return std::make_unique<AttentionBlock>(dim, static_cast<int>(heads),
                                            o.number("dropout", 0.0f), o.boolean("flash", false),
                                            o.number("eps", 1e-5f));
  }
  if (type == "mlp") {
    JsonObject o(j, path, type, {"dim", "hidden", "dropout", "eps"});
    const int64_t dim = o.positive_int("dim");
    const int64_t hidden = o.positive_int("hidden");
    return std::make_unique<MlpBlock>(dim, hidden, o.number("dropout", 0.0f),
                                      o.number("eps", 1e-5f));
  }
  if (type == "residual") {
    JsonObject o(j, path, type, {"inner"});
    return std::make_unique<Residual>(module_at(o.need("inner"), o.at("inner")));
  }
  if (type == "sequential") {
    JsonObject o(j, path, type, {"layers"});
    const nlohmann::json& layers = o.need("layers");
    if (!layers.is_array() || layers.empty()) {
      throw InvalidArgument(str_cat(o.at("layers"), ": must be a non-empty array of layers"));
    }
    auto seq = std::make_unique<Sequential>();
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string at = str_cat(o.at("layers"), "[", i, "]");
      // A child's optional "name" is the sequential's business, not the child's type's.
      nlohmann::json child = layers[i];
      std::string name = std::to_string(i);
      if (child.is_object() && child.contains("name")) {
        if (!child["name"].is_string()) {
          throw InvalidArgument(str_cat(at, ".name: ", child["name"].dump(), " must be a string"));
        }
        name = child["name"].get<std::string>();
        child.erase("name");
      }
      seq->add(name, module_at(child, at));
    }
    return seq;
  }
  throw InvalidArgument(str_cat(path, ".type: unknown module type \"", type, "\"; valid types: ",
                                kModuleTypes));
}

}  // namespace

std::unique_ptr<Module> module_from_json(const nlohmann::json& j) { return module_at(j, "$"); }

std::unique_ptr<LossLayer> loss_from_json(const nlohmann::json& j) {
  const std::string type = type_of(j, "$", kLossTypes);
  if (type == "cross_entropy") {
    JsonObject o(j, "$", type, {});
    return std::make_unique<CrossEntropyLoss>();
  }
  if (type == "mse") {
    JsonObject o(j, "$", type, {});
    return std::make_unique<MseLoss>();
  }
  throw InvalidArgument(str_cat("$.type: unknown loss type \"", type, "\"; valid types: ",
                                kLossTypes));
}

}  // namespace porter::nn
