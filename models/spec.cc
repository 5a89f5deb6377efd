// The pieces every spec shares: a Hugging Face parameter's file shape and the config.json
// reader (models/spec.h).
#include "models/spec.h"

#include <cmath>

#include "base/error.h"

namespace porter::models {

using Json = nlohmann::json;

std::vector<int64_t> HfParam::hf_shape() const {
  if (!transposed) return shape;
  return {shape[1], shape[0]};
}

void HfConfigReader::fail(const std::string& key, const std::string& message) const {
  throw IoError("\"" + path_ + "\": " + key + ": " + message);
}

const Json* HfConfigReader::get(const std::string& key) const {
  auto it = j_.find(key);
  return it == j_.end() || it->is_null() ? nullptr : &*it;
}

int64_t HfConfigReader::positive(const std::string& key, int64_t fallback) const {
  const Json* v = get(key);
  if (v == nullptr) return fallback;
  if (!v->is_number_integer() || v->get<int64_t>() < 1) {
    fail(key, v->dump() + " is not a positive integer");
  }
  return v->get<int64_t>();
}

double HfConfigReader::positive_real(const std::string& key, double fallback) const {
  const Json* v = get(key);
  if (v == nullptr) return fallback;
  if (!v->is_number() || !(v->get<double>() > 0.0) || !std::isfinite(v->get<double>())) {
    fail(key, v->dump() + " is not a positive number");
  }
  return v->get<double>();
}

bool HfConfigReader::boolean(const std::string& key, bool fallback) const {
  const Json* v = get(key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) fail(key, v->dump() + " is not true or false");
  return v->get<bool>();
}

std::string HfConfigReader::string(const std::string& key, const std::string& fallback) const {
  const Json* v = get(key);
  if (v == nullptr) return fallback;
  if (!v->is_string()) fail(key, v->dump() + " is not a string");
  return v->get<std::string>();
}

}  // namespace porter::models
