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
#include <utility>

#include <sys/mman.h>
#include <unistd.h>

#include "base/check.h"
#include "base/error.h"
#include "base/units.h"
#include "comm/communicator.h"
#include "io/weights_file.h"
#include "nn/ctx.h"
#include "models/factory.h"
#include "models/transformer.h"
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

// The checks of `e` that need only its header: a dtype porter reads and the shape config.json
// implies for `p`.
void check_tensor(const SafetensorsFile& file, const SafetensorsEntry& e, const HfParam& p) {
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
}

[[noreturn]] void throw_not_finite(const SafetensorsFile& file, const SafetensorsEntry& e,
                                   int64_t i, float v) {
  throw IoError(quoted(file.path()) + ": tensor '" + e.name + "': element " + std::to_string(i) +
                " " + index_string(i, e.shape) + " is " +
                (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf") +
                "; porter refuses weights that are not finite");
}

// Note [Sharded loading] in io/hf_checkpoint.h: the pages of a mapped tensor that have been
// read leave this process's resident set every kReleaseBytes (madvise MADV_DONTNEED; they
// stay in the page cache, and a later touch maps them in again), and all of them when it is
// done. The mapping is read-only, so nothing is lost; a failing madvise only leaves the pages
// resident.
constexpr size_t kReleaseBytes = size_t{16} << 20;

class PageRelease {
 public:
  explicit PageRelease(std::span<const std::byte> bytes)
      : page_(static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE))),
        done_(down(reinterpret_cast<uintptr_t>(bytes.data()))),
        end_(reinterpret_cast<uintptr_t>(bytes.data() + bytes.size())) {}
  PageRelease(const PageRelease&) = delete;
  PageRelease& operator=(const PageRelease&) = delete;
  ~PageRelease() { release((end_ + page_ - 1) / page_ * page_); }
  // Every byte before `p` has been read.
  void read_to(const std::byte* p) {
    const uintptr_t to = down(reinterpret_cast<uintptr_t>(p));
    if (to >= done_ + kReleaseBytes) release(to);
  }

 private:
  uintptr_t down(uintptr_t a) const { return a / page_ * page_; }
  void release(uintptr_t to) {
    if (to > done_) ::madvise(reinterpret_cast<void*>(done_), to - done_, MADV_DONTNEED);
    done_ = std::max(done_, to);
  }
  uintptr_t page_;
  uintptr_t done_;  // pages before it are released
  uintptr_t end_;
};

// `n` elements of `dtype` from `src` as f32 into dst[0], dst[stride], ...; `first` is the
// first one's index in the file's tensor, for the message when one is not finite.
template <tensor::DType D>
void convert_run(const std::byte* src, int64_t n, float* dst, int64_t stride,
                 const SafetensorsFile& file, const SafetensorsEntry& e, int64_t first) {
  constexpr size_t size = D == tensor::DType::kF32 ? 4 : 2;
  for (int64_t k = 0; k < n; ++k) {
    const float v = element(src + static_cast<size_t>(k) * size, D);
    if (!std::isfinite(v)) throw_not_finite(file, e, first + k, v);
    dst[k * stride] = v;
  }
}

void convert(const std::byte* src, tensor::DType dtype, int64_t n, float* dst, int64_t stride,
             const SafetensorsFile& file, const SafetensorsEntry& e, int64_t first) {
  switch (dtype) {
    case tensor::DType::kF32:
      return convert_run<tensor::DType::kF32>(src, n, dst, stride, file, e, first);
    case tensor::DType::kBF16:
      return convert_run<tensor::DType::kBF16>(src, n, dst, stride, file, e, first);
    default:
      return convert_run<tensor::DType::kF16>(src, n, dst, stride, file, e, first);
  }
}

// One porter parameter to read: its tensor in the files, and where its values go in the
// buffer being filled (a rank's part, Transformer::shard_map; the whole parameter at
// tensor_parallel 1).
struct Target {
  const HfParam* param = nullptr;  // at tensor_parallel 1
  Found found;
  int64_t offset_elems = 0;  // of the parameter in the buffer
  int64_t rows = 0, cols = 1;  // of the parameter in the buffer
  std::vector<models::ParamShard::Block> blocks;
};

int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }

// The values of `t`'s elements that lie in [begin, begin + out.size()) of the buffer into
// `out` (indexed from begin), converted from the mapping and checked finite, in the file's
// order (so the first element that is not finite is the one reported).
void read_target(const Target& t, int64_t begin, std::span<float> out) {
  const int64_t end = begin + static_cast<int64_t>(out.size());
  const int64_t off = t.offset_elems, cols = t.cols;
  const int64_t lo = std::max(begin, off), hi = std::min(end, off + t.rows * cols);
  if (lo >= hi) return;
  const SafetensorsFile& file = *t.found.file;
  const SafetensorsEntry& e = *t.found.entry;
  const tensor::DType dtype = *e.porter_dtype;
  const size_t size = tensor::dtype_size(dtype);
  const std::span<const std::byte> bytes = file.bytes(e);
  PageRelease pages(bytes);
  const HfParam& p = *t.param;
  const int64_t whole_rows = p.shape.empty() ? 1 : p.shape[0];
  const int64_t whole_cols = p.shape.size() == 2 ? p.shape[1] : 1;
  // This rank's rows with an element in [lo, hi).
  const int64_t row_lo = (lo - off) / cols, row_hi = ceil_div(hi - off, cols);
  // Element (i, c) of the parameter is out[at(i, c)].
  auto at = [&](int64_t i, int64_t c) { return out.data() + (off + i * cols + c - begin); };
  if (!p.transposed) {
    // File element (R, C) of (whole_rows, whole_cols): R * whole_cols + C.
    for (const models::ParamShard::Block& b : t.blocks) {
      for (int64_t i = std::max(b.row, row_lo); i < std::min(b.row + b.rows, row_hi); ++i) {
        const int64_t c0 = std::max<int64_t>(0, lo - off - i * cols);
        const int64_t c1 = std::min<int64_t>(cols, hi - off - i * cols);
        if (c0 >= c1) continue;
        const int64_t from = (b.whole_row + i - b.row) * whole_cols + b.whole_col + c0;
        const std::byte* src = bytes.data() + static_cast<size_t>(from) * size;
        convert(src, dtype, c1 - c0, at(i, c0), 1, file, e, from);
        pages.read_to(src + static_cast<size_t>(c1 - c0) * size);
      }
    }
    return;
  }
  // Transposed (GPT-2's Conv1D): file element (C, R) of (whole_cols, whole_rows) is porter's
  // (R, C), at C * whole_rows + R. Column by column, then the blocks' rows: the file's order.
  for (int64_t c = 0; c < cols; ++c) {
    // The rows i whose element (i, c) lies in [lo, hi).
    const int64_t i_lo = std::max(row_lo, ceil_div(lo - off - c, cols));
    const int64_t i_hi = std::min(row_hi, ceil_div(hi - off - c, cols));
    for (const models::ParamShard::Block& b : t.blocks) {
      const int64_t i0 = std::max(b.row, i_lo), i1 = std::min(b.row + b.rows, i_hi);
      if (i0 >= i1) continue;
      const int64_t C = b.whole_col + c;
      const int64_t from = C * whole_rows + b.whole_row + i0 - b.row;
      const std::byte* src = bytes.data() + static_cast<size_t>(from) * size;
      convert(src, dtype, i1 - i0, at(i0, c), cols, file, e, from);
      pages.read_to(src + static_cast<size_t>(i1 - i0) * size);
    }
  }
}

// The files' tensors checked against the model's: what every read does before any value.
struct Prepared {
  WeightFiles w;
  std::vector<HfParam> params;
  std::map<std::string, const HfParam*> by_porter;
  bool tied_head = false;  // tie_embeddings, and the files have lm_head.weight
  HfWeights info;          // skipped so far
};

void prepare(const config::ModelConfig& model, Prepared& r) {
  r.params = hf_param_map(model);
  for (const HfParam& p : r.params) r.by_porter[p.porter_name] = &p;
}

void open_and_match(const fs::path& dir, const config::ModelConfig& model, Prepared& r) {
  r.w = open_weights(dir, model.type);
  const WeightFiles& w = r.w;
  // One message for every tensor missing and every one porter does not know.
  std::vector<std::string> missing, unexpected;
  std::set<std::string> wanted;
  for (const HfParam& p : r.params) {
    const std::string bare = bare_name(p.hf_name, model.type);
    wanted.insert(bare);
    if (!w.tensors.count(bare)) missing.push_back(p.hf_name);
  }
  r.tied_head = model.tie_embeddings && w.tensors.count(kLmHead);
  for (const auto& [bare, found] : w.tensors) {
    if (wanted.count(bare) || (r.tied_head && bare == kLmHead)) continue;
    if (is_buffer(bare, model.type)) {
      ++r.info.skipped;
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
}

// Reads `targets` (in layout order; each one's header checked first, as the old whole read
// did) into out, then checks a tied lm_head.weight against the embedding, and returns the
// counts.
HfWeights read_targets(Prepared& r, const config::ModelConfig& model,
                       const std::vector<Target>& targets, int64_t begin, std::span<float> out) {
  HfWeights result = std::move(r.info);
  std::set<std::string> dtypes;
  for (const Target& t : targets) {
    check_tensor(*t.found.file, *t.found.entry, *t.param);
    read_target(t, begin, out);
    dtypes.insert(t.found.entry->dtype);
    result.bytes += t.found.entry->end - t.found.entry->begin;
    ++result.tensors;
  }
  if (r.tied_head) {
    // The file's lm_head.weight must be the embedding porter ties it to. Both are read here
    // whole, from the files (a rank holds only part of the embedding), page by page.
    const std::string embedding = models::arch_spec(model.type).token_table_name();
    const HfParam& p = *r.by_porter.at(embedding);
    const Found& head = r.w.tensors.at(kLmHead);
    const Found& table = r.w.tensors.at(bare_name(p.hf_name, model.type));
    HfParam as_head = p;
    as_head.porter_name = kLmHead;
    check_tensor(*head.file, *head.entry, as_head);
    PORTER_ASSERT(!p.transposed, "the token table is never stored transposed");
    const std::span<const std::byte> hb = head.file->bytes(*head.entry);
    const std::span<const std::byte> tb = table.file->bytes(*table.entry);
    const tensor::DType hd = *head.entry->porter_dtype, td = *table.entry->porter_dtype;
    const size_t hs = tensor::dtype_size(hd), ts = tensor::dtype_size(td);
    PageRelease head_pages(hb), table_pages(tb);
    // As the whole read reported them: a table element that is not finite (it was read
    // first), then a head element that is not, then the first difference.
    const int64_t n = head.entry->numel;
    int64_t differs = -1;
    float hv_at = 0.0f, tv_at = 0.0f;
    std::optional<std::pair<int64_t, float>> head_bad;
    for (int64_t i = 0; i < n; ++i) {
      const float hv = element(hb.data() + static_cast<size_t>(i) * hs, hd);
      const float tv = element(tb.data() + static_cast<size_t>(i) * ts, td);
      if (!std::isfinite(tv)) throw_not_finite(*table.file, *table.entry, i, tv);
      if (!std::isfinite(hv) && !head_bad) head_bad = std::make_pair(i, hv);
      if (differs < 0 && std::memcmp(&hv, &tv, sizeof(float)) != 0) {
        differs = i;
        hv_at = hv;
        tv_at = tv;
      }
      if ((i & 0xfffff) == 0xfffff) {
        head_pages.read_to(hb.data() + static_cast<size_t>(i + 1) * hs);
        table_pages.read_to(tb.data() + static_cast<size_t>(i + 1) * ts);
      }
    }
    if (head_bad) throw_not_finite(*head.file, *head.entry, head_bad->first, head_bad->second);
    if (differs >= 0) {
      throw IoError(quoted(head.file->path()) + ": tensor '" + head.entry->name + "' differs from '" +
                    table.entry->name + "' at element " + std::to_string(differs) + " " +
                    index_string(differs, head.entry->shape) + " (" + std::to_string(hv_at) +
                    " against " + std::to_string(tv_at) + "), but config.json has "
                    "tie_word_embeddings true: porter would train one matrix for both; set "
                    "tie_word_embeddings false in config.json to keep them apart");
    }
    ++result.skipped;
  }
  for (const auto& f : r.w.files) result.files.push_back(f->path());
  result.dtypes.assign(dtypes.begin(), dtypes.end());
  return result;
}

}  // namespace

std::vector<HfParam> hf_param_map(const config::ModelConfig& m) {
  return models::arch_spec(m.type).hf_params(m);
}

HfWeights read_hf_weights(const fs::path& dir, const config::ModelConfig& model,
                          const nn::ParamLayout& layout) {
  Prepared r;
  prepare(model, r);
  // The layout must be the map's model (a bug or a model of another architecture otherwise).
  for (const nn::ParamEntry& e : layout.entries()) {
    auto it = r.by_porter.find(e.name);
    if (it == r.by_porter.end()) {
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
  if (layout.entries().size() != r.params.size()) {
    std::vector<std::string> absent;
    for (const HfParam& p : r.params) {
      bool found = false;
      for (const nn::ParamEntry& e : layout.entries()) found = found || e.name == p.porter_name;
      if (!found) absent.push_back(p.porter_name);
    }
    throw InvalidArgument("Hugging Face weights: porter's layout lacks " + join(absent));
  }
  open_and_match(dir, model, r);
  std::vector<Target> targets;
  for (const nn::ParamEntry& e : layout.entries()) {
    Target t;
    t.param = r.by_porter.at(e.name);
    t.found = r.w.tensors.at(bare_name(t.param->hf_name, model.type));
    t.offset_elems = e.offset_elems;
    t.rows = e.shape.rank() >= 1 ? e.shape[0] : 1;
    t.cols = e.shape.rank() == 2 ? e.shape[1] : 1;
    t.blocks.push_back({0, 0, t.rows, 0});
    targets.push_back(std::move(t));
  }
  std::vector<float> values(static_cast<size_t>(layout.total_elems()), 0.0f);
  HfWeights out = read_targets(r, model, targets, 0, values);
  out.values = std::move(values);
  return out;
}

HfWeights read_hf_weights(const fs::path& dir, const config::ModelConfig& model) {
  config::ModelConfig whole = model;
  whole.tensor_parallel = 1;
  whole.sequence_parallel = false;
  const std::unique_ptr<models::Transformer> built = models::build_model(whole);
  return read_hf_weights(dir, whole, built->layout());
}

HfWeights read_hf_weights_part(const fs::path& dir, const models::Transformer& part,
                               int64_t begin, std::span<float> out) {
  PORTER_CHECK(begin >= 0, "read_hf_weights_part: begin ", begin);
  std::fill(out.begin(), out.end(), 0.0f);  // the padding, and rows no block holds
  config::ModelConfig whole = part.config();
  whole.tensor_parallel = 1;
  whole.sequence_parallel = false;
  Prepared r;
  prepare(whole, r);
  open_and_match(dir, whole, r);
  std::vector<Target> targets;
  for (models::ParamShard& s : part.shard_map()) {
    const nn::ParamEntry& e = *s.entry;
    Target t;
    auto it = r.by_porter.find(e.name);
    PORTER_ASSERT(it != r.by_porter.end() && it->second->shape == s.whole_shape,
                  "read_hf_weights_part: '", e.name, "' is not the name map's");
    t.param = it->second;
    t.found = r.w.tensors.at(bare_name(t.param->hf_name, whole.type));
    t.offset_elems = e.offset_elems;
    t.rows = e.shape.rank() >= 1 ? e.shape[0] : 1;
    t.cols = s.cols;
    t.blocks = std::move(s.blocks);
    targets.push_back(std::move(t));
  }
  PORTER_ASSERT(targets.size() == r.params.size(), "read_hf_weights_part: ", targets.size(),
                " parameters in the part, ", r.params.size(), " in the name map");
  return read_targets(r, whole, targets, begin, out);
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
