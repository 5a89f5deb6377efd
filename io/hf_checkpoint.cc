// Hugging Face weights (Note [Hugging Face checkpoints] in io/hf_checkpoint.h): the name map, the
// checked import into porter's layout, the export, and the whole parameters of a running
// engine.
#include "io/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include "base/check.h"
#include "base/error.h"
#include "base/units.h"
#include "comm/communicator.h"
#include "io/weights_file.h"
#include "nn/ctx.h"
#include "models/factory.h"
#include "tensor/tensor.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kWeightsFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kLmHead = "lm_head.weight";

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A file's tensor name without the spec's prefix (Note [Hugging Face checkpoints]).
std::string bare_name(const std::string& name, config::ModelType type) {
  const std::string_view prefix = models::arch_spec(type).hf_prefix();
  return starts_with(name, prefix) ? name.substr(prefix.size()) : name;
}

// A buffer, not a parameter (ArchSpec::hf_is_buffer).
bool is_buffer(const std::string& bare, config::ModelType type) {
  return models::arch_spec(type).hf_is_buffer(bare);
}

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// One tensor found in the directory's files.
struct Found {
  const SafetensorsFile* file = nullptr;  // owned by the WeightFiles that found it
  const SafetensorsEntry* entry = nullptr;
};

// The directory's safetensors files, open, and each bare tensor name's place in them.
struct WeightFiles {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, Found> tensors;  // by bare name
};

void add_file_tensors(WeightFiles& w, const SafetensorsFile& file, config::ModelType type) {
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::string bare = bare_name(e.name, type);
    auto [it, fresh] = w.tensors.emplace(bare, Found{&file, &e});
    if (!fresh) {
      throw IoError("Hugging Face weights: tensor '" + bare + "' appears twice: as '" +
                    it->second.entry->name + "' in " + quoted(it->second.file->path()) +
                    " and as '" + e.name + "' in " + quoted(file.path()));
    }
  }
}

// model.safetensors.index.json: {"weight_map": {name: file}, ...}. Every file it names is
// opened once; each must hold exactly the tensors the map gives it.
WeightFiles open_sharded(const fs::path& dir, const fs::path& index_path, config::ModelType type) {
  const std::string where = "safetensors index " + quoted(index_path) + ": ";
  std::ifstream in(index_path);
  if (!in) throw IoError(where + "cannot read: " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  Json index;
  try {
    index = Json::parse(text.str());
  } catch (const Json::exception& e) {
    throw IoError(where + "not valid JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw IoError(where + "needs \"weight_map\", an object of tensor name -> file name");
  }
  const Json& map = index["weight_map"];
  if (map.empty()) throw IoError(where + "\"weight_map\" lists no tensor");
  std::map<std::string, std::vector<std::string>> names_of;  // file -> its tensors
  for (const auto& [name, file] : map.items()) {
    if (!file.is_string()) {
      throw IoError(where + "weight_map[\"" + name + "\"] is " + file.dump() + ", not a file name");
    }
    const std::string f = file.get<std::string>();
    // The shards lie beside the index: a name that leaves the directory is refused.
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos) {
      throw IoError(where + "weight_map[\"" + name + "\"] is \"" + f + "\", not the name of a "
                    "file beside the index");
    }
    names_of[f].push_back(name);
  }
  WeightFiles w;
  for (const auto& [f, names] : names_of) {
    w.files.push_back(std::make_unique<SafetensorsFile>(dir / f));
    const SafetensorsFile& file = *w.files.back();
    for (const std::string& name : names) {
      if (file.find(name) == nullptr) {
        throw IoError(where + "maps '" + name + "' to " + quoted(file.path()) +
                      ", which does not hold it");
      }
    }
    for (const SafetensorsEntry& e : file.tensors()) {
      auto it = map.find(e.name);
      if (it == map.end() || it->get<std::string>() != f) {
        throw IoError(where + quoted(file.path()) + " holds '" + e.name + "', which the index " +
                      (it == map.end() ? std::string("does not list")
                                       : "maps to \"" + it->get<std::string>() + "\""));
      }
    }
    add_file_tensors(w, file, type);
  }
  return w;
}

WeightFiles open_weights(const fs::path& dir, config::ModelType type) {
  std::error_code ec;
  if (fs::exists(dir / kWeightsFile, ec)) {
    WeightFiles w;
    w.files.push_back(std::make_unique<SafetensorsFile>(dir / kWeightsFile));
    add_file_tensors(w, *w.files.back(), type);
    return w;
  }
  if (fs::exists(dir / kIndexFile, ec)) return open_sharded(dir, dir / kIndexFile, type);
  std::string hint;
  if (fs::exists(dir / "pytorch_model.bin", ec) || fs::exists(dir / "pytorch_model.bin.index.json", ec)) {
    hint = " (it has pytorch_model.bin: porter reads safetensors only; convert it, e.g. by "
           "loading the model in transformers and saving it with save_pretrained, whose "
           "default is safetensors)";
  }
  throw IoError("Hugging Face weights: " + quoted(dir) + " has neither " + kWeightsFile +
                " nor " + kIndexFile + hint);
}

// One element of a tensor of `dtype` (F32, BF16 or F16) as f32.
float element(const std::byte* p, tensor::DType dtype) {
  if (dtype == tensor::DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == tensor::DType::kBF16 ? tensor::bf16_to_f32(h) : tensor::f16_to_f32(h);
}

std::string index_string(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  std::string s = "[";
  for (size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

// `e`'s values as f32 in porter's orientation into `out` (shape p.shape), checked finite.
void read_tensor(const SafetensorsFile& file, const SafetensorsEntry& e, const HfParam& p,
                 float* out) {
  const std::string what = quoted(file.path()) + ": tensor '" + e.name + "': ";
  if (!e.porter_dtype || *e.porter_dtype == tensor::DType::kI32) {
    throw IoError(what + "dtype " + e.dtype + ": porter loads weights stored as F32, BF16 or "
                  "F16; convert the checkpoint to one of them");
  }
  const std::vector<int64_t> want = p.hf_shape();
  if (e.shape != want) {
    throw IoError(what + "shape " + shape_string(e.shape) + ", but the model's config.json gives " +
                  shape_string(want) + " for it (porter's '" + p.porter_name + "' " +
                  shape_string(p.shape) + (p.transposed ? ", stored transposed" : "") +
                  "); the weights are not config.json's model");
  }
  const tensor::DType dtype = *e.porter_dtype;
  const size_t size = tensor::dtype_size(dtype);
  const std::span<const std::byte> bytes = file.bytes(e);
  const int64_t n = e.numel;
  const int64_t rows = p.transposed ? e.shape[0] : 1;  // the file's (in, out)
  const int64_t cols = p.transposed ? e.shape[1] : n;
  for (int64_t i = 0; i < n; ++i) {
    const float v = element(bytes.data() + static_cast<size_t>(i) * size, dtype);
    if (!std::isfinite(v)) {
      throw IoError(what + "element " + std::to_string(i) + " " + index_string(i, e.shape) +
                    " is " + (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf") +
                    "; porter refuses weights that are not finite");
    }
    // File element (a, b) of (in, out) is porter's (b, a) of (out, in).
    out[p.transposed ? (i % cols) * rows + i / cols : i] = v;
  }
}

}  // namespace

std::vector<HfParam> hf_param_map(const config::ModelConfig& m) {
  return models::arch_spec(m.type).hf_params(m);
}

HfWeights read_hf_weights(const fs::path& dir, const config::ModelConfig& model,
                          const nn::ParamLayout& layout) {
  const std::vector<HfParam> params = hf_param_map(model);
  // The layout must be the map's model (a bug or a model of another architecture otherwise).
  std::map<std::string, const HfParam*> by_porter;
  for (const HfParam& p : params) by_porter[p.porter_name] = &p;
  for (const nn::ParamEntry& e : layout.entries()) {
    auto it = by_porter.find(e.name);
    if (it == by_porter.end()) {
      throw InvalidArgument("Hugging Face weights: porter's layout has a parameter '" + e.name +
                            "' that the " + std::string(models::arch_spec(model.type).hf_class()) +
                            " name map does not know (the model built is not the one "
                            "porter.model describes)");
    }
    if (e.shape.to_vector() != it->second->shape) {
      throw InvalidArgument("Hugging Face weights: porter's layout has '" + e.name + "' " +
                            shape_string(e.shape.to_vector()) + ", config.json's model " +
                            shape_string(it->second->shape) + " (the model built is not the "
                            "one porter.model describes)");
    }
  }
  if (layout.entries().size() != params.size()) {
    std::vector<std::string> absent;
    for (const HfParam& p : params) {
      bool found = false;
      for (const nn::ParamEntry& e : layout.entries()) found = found || e.name == p.porter_name;
      if (!found) absent.push_back(p.porter_name);
    }
    throw InvalidArgument("Hugging Face weights: porter's layout lacks " + join(absent));
  }

  WeightFiles w = open_weights(dir, model.type);
  // One message for every tensor missing and every one porter does not know.
  std::vector<std::string> missing, unexpected;
  std::set<std::string> wanted;
  for (const HfParam& p : params) {
    const std::string bare = bare_name(p.hf_name, model.type);
    wanted.insert(bare);
    if (!w.tensors.count(bare)) missing.push_back(p.hf_name);
  }
  HfWeights out;
  const bool tied_head = model.tie_embeddings && w.tensors.count(kLmHead);
  for (const auto& [bare, found] : w.tensors) {
    if (wanted.count(bare) || (tied_head && bare == kLmHead)) continue;
    if (is_buffer(bare, model.type)) {
      ++out.skipped;
      continue;
    }
    unexpected.push_back(found.entry->name);
  }
  if (!missing.empty() || !unexpected.empty()) {
    std::string files;
    for (const auto& f : w.files) files += (files.empty() ? "" : ", ") + quoted(f->path());
    std::string msg = "Hugging Face weights " + files + ": ";
    if (!missing.empty()) {
      msg += std::to_string(missing.size()) + " tensor(s) of config.json's model missing: " +
             join(missing);
    }
    if (!unexpected.empty()) {
      msg += std::string(missing.empty() ? "" : "; ") + std::to_string(unexpected.size()) +
             " tensor(s) porter does not know: " + join(unexpected);
    }
    throw IoError(msg + " (docs/formats.md lists the names porter reads)");
  }

  out.values.assign(static_cast<size_t>(layout.total_elems()), 0.0f);
  std::set<std::string> dtypes;
  for (const nn::ParamEntry& e : layout.entries()) {
    const HfParam& p = *by_porter.at(e.name);
    const Found& f = w.tensors.at(bare_name(p.hf_name, model.type));
    read_tensor(*f.file, *f.entry, p, out.values.data() + e.offset_elems);
    dtypes.insert(f.entry->dtype);
    out.bytes += f.entry->end - f.entry->begin;
    ++out.tensors;
  }
  if (tied_head) {
    // The file's lm_head.weight must be the embedding porter ties it to.
    const std::string embedding = models::arch_spec(model.type).token_table_name();
    const nn::ParamEntry& emb = layout.find(embedding);
    const HfParam& p = *by_porter.at(embedding);
    const Found& f = w.tensors.at(kLmHead);
    std::vector<float> head(static_cast<size_t>(emb.shape.numel()));
    HfParam as_head = p;
    as_head.porter_name = kLmHead;
    read_tensor(*f.file, *f.entry, as_head, head.data());
    const float* wte = out.values.data() + emb.offset_elems;
    for (size_t i = 0; i < head.size(); ++i) {
      if (std::memcmp(&head[i], &wte[i], sizeof(float)) != 0) {
        throw IoError(quoted(f.file->path()) + ": tensor '" + f.entry->name + "' differs from '" +
                      w.tensors.at(bare_name(p.hf_name, model.type)).entry->name +
                      "' at element " + std::to_string(i) + " " +
                      index_string(static_cast<int64_t>(i), f.entry->shape) + " (" +
                      std::to_string(head[i]) + " against " + std::to_string(wte[i]) +
                      "), but config.json has tie_word_embeddings true: porter would train "
                      "one matrix for both; set tie_word_embeddings false in config.json to "
                      "keep them apart");
      }
    }
    ++out.skipped;
  }
  for (const auto& f : w.files) out.files.push_back(f->path());
  out.dtypes.assign(dtypes.begin(), dtypes.end());
  return out;
}

HfWeights read_hf_weights(const fs::path& dir, const config::ModelConfig& model) {
  config::ModelConfig whole = model;
  whole.tensor_parallel = 1;
  whole.sequence_parallel = false;
  const std::unique_ptr<models::Transformer> built = models::build_model(whole);
  return read_hf_weights(dir, whole, built->layout());
}

HfExport write_hf_checkpoint(const fs::path& dir, const config::ModelConfig& model,
                             const nn::ParamLayout& layout, std::span<const float> values,
                             tensor::DType dtype, const Json& source_config) {
  if (dtype != tensor::DType::kF32 && dtype != tensor::DType::kBF16 && dtype != tensor::DType::kF16) {
    throw InvalidArgument("write_hf_checkpoint: weights are written as f32, bf16 or f16, not " +
                          std::string(tensor::dtype_name(dtype)));
  }
  if (static_cast<int64_t>(values.size()) != layout.total_elems()) {
    throw InvalidArgument("write_hf_checkpoint: " + std::to_string(values.size()) +
                          " values for a layout of " + std::to_string(layout.total_elems()) +
                          " elements (padding included)");
  }
  const std::vector<HfParam> params = hf_param_map(model);
  const size_t size = tensor::dtype_size(dtype);
  HfExport result;
  std::vector<WeightTensor> tensors;
  tensors.reserve(params.size());
  for (const HfParam& p : params) {
    const nn::ParamEntry& e = layout.find(p.porter_name);
    if (e.shape.to_vector() != p.shape) {
      throw InvalidArgument("write_hf_checkpoint: porter's layout has '" + e.name + "' " +
                            shape_string(e.shape.to_vector()) + ", porter.model gives " +
                            shape_string(p.shape));
    }
    WeightTensor t;
    t.name = p.hf_name;
    t.shape = p.hf_shape();
    t.dtype = dtype;
    const int64_t n = e.shape.numel();
    t.bytes.resize(static_cast<size_t>(n) * size);
    const float* src = values.data() + e.offset_elems;
    const int64_t rows = p.shape[0], cols = p.shape.size() == 2 ? p.shape[1] : 1;
    for (int64_t i = 0; i < n; ++i) {
      // porter's (r, c) of (out, in) is the file's (c, r) of (in, out).
      const float v = src[i];
      if (!std::isfinite(v)) {
        throw InvalidArgument("write_hf_checkpoint: parameter '" + e.name + "' element " +
                              std::to_string(i) + " " + index_string(i, p.shape) + " is " +
                              (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf") +
                              "; a model that is not finite is not written (the run diverged)");
      }
      const int64_t at = p.transposed ? (i % cols) * rows + i / cols : i;
      std::byte* dst = t.bytes.data() + static_cast<size_t>(at) * size;
      if (dtype == tensor::DType::kF32) {
        std::memcpy(dst, &v, 4);
      } else {
        const uint16_t h = dtype == tensor::DType::kBF16 ? tensor::f32_to_bf16(v) : tensor::f32_to_f16(v);
        std::memcpy(dst, &h, 2);
      }
    }
    result.num_params += n;
    tensors.push_back(std::move(t));
  }
  result.tensors = static_cast<int64_t>(tensors.size());
  result.weights_file = dir / kWeightsFile;
  result.config_file = dir / "config.json";
  write_safetensors(result.weights_file, tensors, {{"format", "pt"}});
  std::error_code ec;
  result.bytes = fs::file_size(result.weights_file, ec);

  // config.json, written beside it the same way: a temporary file renamed over it.
  const std::string text = hf_config_json(model, dtype, source_config).dump(2) + "\n";
  const fs::path tmp = dir / ".config.json.tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.close();
    if (!f) throw IoError("Hugging Face export: cannot write " + quoted(tmp));
  }
  fs::rename(tmp, result.config_file, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw IoError("Hugging Face export: cannot rename " + quoted(tmp) + " to " +
                  quoted(result.config_file));
  }
  return result;
}

}  // namespace porter::io
