// Synthetic, byte-level text and token-shard data for the built-in GPT, and the validation
// set; every micro-batch is a pure function of (seed, step, micro-batch), so a resumed run
// sees the same data.
#include "io/data.h"

#include <fnmatch.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "base/check.h"
#include "base/error.h"
#include "base/units.h"
#include "tensor/philox.h"

namespace porter::io {

template <typename T>
HostTensor HostTensor::of(std::string name, tensor::Shape shape, std::vector<T> values) {
  using tensor::DType;
  DType dtype;
  if constexpr (std::is_same_v<T, float>) dtype = DType::kF32;
  else if constexpr (std::is_same_v<T, int32_t>) dtype = DType::kI32;
  else if constexpr (std::is_same_v<T, int64_t>) dtype = DType::kI64;
  else dtype = DType::kBool;
  PORTER_CHECK(static_cast<int64_t>(values.size()) == shape.numel(), "HostTensor \"", name,
               "\": ", values.size(), " values for shape ", shape.to_string());
  HostTensor t;
  t.name = std::move(name);
  t.shape = shape;
  t.dtype = dtype;
  if constexpr (std::is_same_v<T, bool>) {  // vector<bool> is packed: one byte each
    auto bytes = std::make_shared<std::vector<uint8_t>>(values.begin(), values.end());
    t.data = bytes->data();
    t.owner = std::move(bytes);
  } else {
    auto owned = std::make_shared<std::vector<T>>(std::move(values));
    t.data = owned->data();
    t.owner = std::move(owned);
  }
  return t;
}
template HostTensor HostTensor::of<float>(std::string, tensor::Shape, std::vector<float>);
template HostTensor HostTensor::of<int32_t>(std::string, tensor::Shape, std::vector<int32_t>);
template HostTensor HostTensor::of<int64_t>(std::string, tensor::Shape, std::vector<int64_t>);
template HostTensor HostTensor::of<bool>(std::string, tensor::Shape, std::vector<bool>);

HostTensor HostTensor::of_bytes(std::string name, tensor::Shape shape, tensor::DType dtype,
                                const void* bytes) {
  HostTensor t;
  t.name = std::move(name);
  t.shape = shape;
  t.dtype = dtype;
  auto owned = std::make_shared<std::vector<std::byte>>(t.nbytes());
  if (t.nbytes() > 0) std::memcpy(owned->data(), bytes, t.nbytes());
  t.data = owned->data();
  t.owner = std::move(owned);
  return t;
}

const HostTensor* HostBatch::find(std::string_view name) const {
  for (const HostTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}
namespace {

namespace fs = std::filesystem;

// Note [Data keys]
// One Philox4x32-10 call per (step, micro-batch, index, domain): the counter holds the index
// (an element for synthetic tokens, a row for text windows), the micro-batch, the domain and
// the low 32 bits of the step; the key is the seed with the step's high bits folded in.
// Returns 64 random bits.
uint64_t draw(uint64_t seed, int64_t step, int64_t micro_batch, uint64_t index, uint32_t domain) {
  const uint64_t s = static_cast<uint64_t>(step);
  tensor::Philox4 ctr{{static_cast<uint32_t>(index),
                   static_cast<uint32_t>(index >> 32) ^ (domain << 24),
                   static_cast<uint32_t>(micro_batch), static_cast<uint32_t>(s)}};
  tensor::Philox4 r = tensor::philox4x32_10(ctr, static_cast<uint32_t>(seed),
                                    static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(s >> 32));
  return (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
}

constexpr uint32_t kDomainTokens = 1;
constexpr uint32_t kDomainOffsets = 2;

void read_file_into(const fs::path& path, const std::string& key, std::string& corpus) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(key + ": cannot read \"" + path.string() + "\"");
  corpus.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError(key + ": error while reading \"" + path.string() + "\"");
}

bool hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

bool is_glob(const std::string& name) {
  return name.find_first_of("*?[") != std::string::npos;
}

std::string type_name(config::DataType t) { return std::string(config::to_string(t)); }

// A text corpus: the files' bytes, concatenated in order.
std::string load_text(const std::vector<fs::path>& files, const std::string& key) {
  std::string corpus;
  for (const fs::path& f : files) read_file_into(f, key, corpus);
  return corpus;
}

void check_vocab_for_text(int64_t vocab) {
  if (vocab < 256) {
    throw InvalidArgument("porter.model.vocab: text data is byte-level and needs a vocab of at "
                          "least 256, got " + std::to_string(vocab) +
                          "; set porter.model.vocab to 256");
  }
}

void check_shape(int64_t micro_batch, int64_t seq, int64_t vocab) {
  if (micro_batch <= 0 || seq <= 0 || vocab <= 0) {
    throw InvalidArgument("data: micro-batch (" + std::to_string(micro_batch) + "), seq (" +
                          std::to_string(seq) + ") and vocab (" + std::to_string(vocab) +
                          ") must be positive");
  }
}

}  // namespace

std::vector<fs::path> resolve_data_files(const std::vector<std::string>& paths,
                                         const std::string& key, config::DataType type) {
  const bool tokens = type == config::DataType::kTokens;
  auto wanted = [&](const fs::path& p) { return !tokens || p.extension() == ".bin"; };
  const std::string kind = tokens ? "*.bin files" : "files";
  std::vector<fs::path> out;
  for (const std::string& p : paths) {
    const fs::path path(p);
    const std::string leaf = path.filename().string();
    std::error_code ec;
    if (is_glob(leaf)) {
      // A glob in the last component only: the files of that directory it matches.
      const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
      std::vector<fs::path> files;
      for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (it->is_regular_file() && ::fnmatch(leaf.c_str(), name.c_str(), FNM_PERIOD) == 0) {
          files.push_back(it->path());
        }
      }
      if (ec) {
        throw IoError(key + ": \"" + p + "\": cannot list \"" + dir.string() + "\": " +
                      ec.message() + " (relative paths are resolved against the working "
                      "directory, " + fs::current_path().string() + ")");
      }
      if (files.empty()) {
        throw IoError(key + ": \"" + p + "\" matches no file in \"" + dir.string() + "\"");
      }
      std::sort(files.begin(), files.end());
      out.insert(out.end(), files.begin(), files.end());
      continue;
    }
    const fs::file_status st = fs::status(path, ec);
    if (ec || !fs::exists(st)) {
      throw IoError(key + ": \"" + p + "\" does not exist (relative paths are resolved against "
                    "the working directory, " + fs::current_path().string() + ")");
    }
    if (!fs::is_directory(st)) {
      out.push_back(path);
      continue;
    }
    std::vector<fs::path> files;
    for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      if (hidden(it->path())) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file() && wanted(it->path())) files.push_back(it->path());
    }
    if (ec) throw IoError(key + ": cannot list \"" + p + "\": " + ec.message());
    if (files.empty()) {
      throw IoError(key + ": the directory \"" + p + "\" holds no " + kind + " (porter.data.type "
                    "is \"" + type_name(type) + "\"); name the files, or a glob");
    }
    std::sort(files.begin(), files.end());
    out.insert(out.end(), files.begin(), files.end());
  }
  return out;
}

DataSource::DataSource(const config::DataConfig& data, int64_t vocab, int64_t micro_batch,
                       int64_t seq)
    : config_(data), vocab_(vocab), micro_batch_(micro_batch), seq_(seq) {
  check_shape(micro_batch, seq, vocab);
  if (data.type == config::DataType::kSynthetic) return;
  const std::string key = "porter.data.paths";
  if (data.type == config::DataType::kText) check_vocab_for_text(vocab);
  if (data.paths.empty()) {
    throw InvalidArgument(key + ": " + type_name(data.type) +
                          " data needs at least one file or directory");
  }
  const std::vector<fs::path> files = resolve_data_files(data.paths, key, data.type);
  if (data.type == config::DataType::kTokens) {
    tokens_ = std::make_shared<const TokenCorpus>(files, key, vocab, seq);
    return;
  }
  corpus_ = load_text(files, key);
  num_files_ = files.size();
  if (corpus_.size() < static_cast<size_t>(seq) + 1) {
    throw InvalidArgument(key + ": the text corpus has " + std::to_string(corpus_.size()) +
                          " bytes, fewer than seq_len + 1 = " + std::to_string(seq + 1) +
                          "; add files or lower porter.model.seq_len");
  }
}

std::vector<HostBatch> DataSource::step_batches(int64_t step, int64_t micro_batches) const {
  return rank_batches(step, micro_batches, 0, 1);
}

DataSource::WindowPosition DataSource::window_of(int64_t step, int64_t global_micro_batches,
                                                 int64_t micro_batch, int64_t row) const {
  PORTER_CHECK(tokens_ != nullptr, "window_of: porter.data.type is \"", type_name(config_.type),
               "\", not \"tokens\"");
  PORTER_CHECK(step >= 0 && micro_batch >= 0 && micro_batch < global_micro_batches && row >= 0 &&
                   row < micro_batch_,
               "window_of: step ", step, ", micro-batch ", micro_batch, " of ",
               global_micro_batches, ", row ", row, " of ", micro_batch_);
  // Note [Token sampling].
  const uint64_t w = static_cast<uint64_t>(tokens_->num_windows());
  const uint64_t j = (static_cast<uint64_t>(step) * static_cast<uint64_t>(global_micro_batches) +
                      static_cast<uint64_t>(micro_batch)) *
                         static_cast<uint64_t>(micro_batch_) +
                     static_cast<uint64_t>(row);
  const uint64_t epoch = j / w;
  return {static_cast<int64_t>(epoch),
          static_cast<int64_t>(permute_window(j % w, w, config_.seed, epoch))};
}

std::vector<HostBatch> DataSource::rank_batches(int64_t step, int64_t micro_batches, int dp_rank,
                                                int dp_size) const {
  PORTER_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "rank_batches: dp rank ",
               dp_rank, " of ", dp_size);
  std::vector<HostBatch> out(static_cast<size_t>(micro_batches));
  const size_t n = static_cast<size_t>(micro_batch_ * seq_);
  const int64_t global_micro_batches = static_cast<int64_t>(dp_size) * micro_batches;
  for (int64_t local = 0; local < micro_batches; ++local) {
    // The global micro-batch index: rank r takes [r * micro_batches, (r + 1) * micro_batches).
    const int64_t m = static_cast<int64_t>(dp_rank) * micro_batches + local;
    HostBatch& b = out[static_cast<size_t>(local)];
    b.batch = micro_batch_;
    b.seq = seq_;
    b.tokens.resize(n);
    b.targets.resize(n);
    for (int64_t row = 0; row < micro_batch_; ++row) {
      int32_t* tok = b.tokens.data() + row * seq_;
      int32_t* tgt = b.targets.data() + row * seq_;
      if (config_.type == config::DataType::kTokens) {
        tokens_->read_window(window_of(step, global_micro_batches, m, row).window, tok, tgt);
      } else if (config_.type == config::DataType::kText) {
        // A window of seq + 1 bytes; targets are the tokens shifted by one.
        const uint64_t positions = corpus_.size() - static_cast<size_t>(seq_);
        const size_t offset = static_cast<size_t>(
            draw(config_.seed, step, m, static_cast<uint64_t>(row), kDomainOffsets) % positions);
        const auto* bytes = reinterpret_cast<const unsigned char*>(corpus_.data()) + offset;
        for (int64_t t = 0; t < seq_; ++t) {
          tok[t] = bytes[t];
          tgt[t] = bytes[t + 1];
        }
      } else {
        // seq + 1 random tokens per row, shifted the same way.
        auto token = [&](int64_t t) {
          const uint64_t index = static_cast<uint64_t>(row * (seq_ + 1) + t);
          return static_cast<int32_t>(draw(config_.seed, step, m, index, kDomainTokens) %
                                      static_cast<uint64_t>(vocab_));
        };
        int32_t prev = token(0);
        for (int64_t t = 0; t < seq_; ++t) {
          const int32_t next = token(t + 1);
          tok[t] = prev;
          tgt[t] = next;
          prev = next;
        }
      }
    }
  }
  return out;
}

std::string DataSource::describe() const {
  std::ostringstream s;
  if (config_.type == config::DataType::kTokens) {
    s << "tokens: " << tokens_->describe() << ", " << format_token_count(tokens_->num_windows())
      << " windows of " << seq_ + 1;
  } else if (config_.type == config::DataType::kText) {
    s << "text: " << format_bytes(corpus_.size()) << " from " << num_files_ << " file"
      << (num_files_ == 1 ? "" : "s");
  } else {
    s << "synthetic (seed " << config_.seed << ", vocab " << vocab_ << ")";
  }
  return s.str();
}

ValidationSet::ValidationSet(const config::DataConfig& data, int64_t vocab, int64_t micro_batch,
                             int64_t seq, int64_t micro_batches, int dp_size)
    : type_(data.type),
      micro_batch_(micro_batch),
      seq_(seq),
      micro_batches_(micro_batches),
      dp_size_(dp_size) {
  check_shape(micro_batch, seq, vocab);
  const std::string key = "porter.data.val_paths";
  PORTER_CHECK(micro_batches >= 1 && dp_size >= 1, "ValidationSet: ", micro_batches,
               " micro-batches on each of ", dp_size, " ranks");
  if (data.type == config::DataType::kSynthetic) {
    throw InvalidArgument(key + ": porter.data.type is \"synthetic\"; a validation set is files "
                          "of the training data's type (\"text\" or \"tokens\")");
  }
  if (data.val_paths.empty()) {
    throw InvalidArgument(key + ": no validation files; name one or more files or directories");
  }
  if (data.type == config::DataType::kText) check_vocab_for_text(vocab);
  const std::vector<fs::path> files = resolve_data_files(data.val_paths, key, data.type);
  // A validation file that is also trained on measures memorisation, not generalisation.
  if (!data.paths.empty()) {
    std::set<fs::path> train;
    for (const fs::path& f : resolve_data_files(data.paths, "porter.data.paths", data.type)) {
      train.insert(fs::weakly_canonical(f));
    }
    for (const fs::path& f : files) {
      if (train.count(fs::weakly_canonical(f)) > 0) {
        throw InvalidArgument(key + ": \"" + f.string() + "\" is also a training file (listed by "
                              "porter.data.paths); keep the validation files apart, e.g. name "
                              "the training shards with a glob such as \"dir/*_train_*.bin\"");
      }
    }
  }
  if (data.type == config::DataType::kTokens) {
    tokens_ = std::make_shared<const TokenCorpus>(files, key, vocab, seq);
    num_windows_ = tokens_->num_windows();
  } else {
    corpus_ = load_text(files, key);
    num_files_ = files.size();
    if (corpus_.size() < static_cast<size_t>(seq) + 1) {
      throw InvalidArgument(key + ": the validation text has " + std::to_string(corpus_.size()) +
                            " bytes, fewer than seq_len + 1 = " + std::to_string(seq + 1) +
                            "; add files or lower porter.model.seq_len");
    }
    num_windows_ = static_cast<int64_t>((corpus_.size() - 1) / static_cast<size_t>(seq));
  }
  // Note [Validation set]: K windows, none twice.
  const int64_t rows_per_micro_batch = micro_batch * dp_size;
  const int64_t needed = micro_batches * rows_per_micro_batch;
  if (needed > num_windows_) {
    const int64_t fits = num_windows_ / rows_per_micro_batch;
    throw InvalidArgument(
        key + ": the validation set has " + std::to_string(num_windows_) + " windows of seq_len + 1 = " +
        std::to_string(seq + 1) + " tokens; porter.train.eval_micro_batches = " +
        std::to_string(micro_batches) + " x train_micro_batch_size_per_gpu = " +
        std::to_string(micro_batch) + (dp_size > 1 ? " x " + std::to_string(dp_size) + " data-parallel ranks" : std::string()) +
        " needs " + std::to_string(needed) + "; " +
        (fits > 0 ? "lower porter.train.eval_micro_batches to " + std::to_string(fits) + " or add"
                  : "add") +
        " validation data");
  }
}

int64_t ValidationSet::window_of(int dp_rank, int64_t micro_batch, int64_t row) const {
  PORTER_CHECK(dp_rank >= 0 && dp_rank < dp_size_ && micro_batch >= 0 &&
                   micro_batch < micro_batches_ && row >= 0 && row < micro_batch_,
               "ValidationSet::window_of: rank ", dp_rank, " of ", dp_size_, ", micro-batch ",
               micro_batch, " of ", micro_batches_, ", row ", row, " of ", micro_batch_);
  // Note [Validation set]: sample k of K reads window floor(k * W / K).
  const int64_t v = static_cast<int64_t>(dp_rank) * micro_batches_ + micro_batch;
  // k * W can pass 2^64 for a large set; 128 bits hold it.
  __extension__ typedef unsigned __int128 U128;
  const auto k = static_cast<U128>(v * micro_batch_ + row);
  const auto big_k = static_cast<U128>(micro_batches_ * dp_size_ * micro_batch_);
  return static_cast<int64_t>(k * static_cast<U128>(num_windows_) / big_k);
}

void ValidationSet::read_window(int64_t w, int32_t* tokens, int32_t* targets) const {
  if (tokens_ != nullptr) {
    tokens_->read_window(w, tokens, targets);
    return;
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(corpus_.data()) + w * seq_;
  for (int64_t t = 0; t < seq_; ++t) {
    tokens[t] = bytes[t];
    targets[t] = bytes[t + 1];
  }
}

std::vector<HostBatch> ValidationSet::rank_batches(int dp_rank) const {
  PORTER_CHECK(dp_rank >= 0 && dp_rank < dp_size_, "ValidationSet::rank_batches: dp rank ",
               dp_rank, " of ", dp_size_);
  std::vector<HostBatch> out(static_cast<size_t>(micro_batches_));
  const size_t n = static_cast<size_t>(micro_batch_ * seq_);
  for (int64_t m = 0; m < micro_batches_; ++m) {
    HostBatch& b = out[static_cast<size_t>(m)];
    b.batch = micro_batch_;
    b.seq = seq_;
    b.tokens.resize(n);
    b.targets.resize(n);
    for (int64_t row = 0; row < micro_batch_; ++row) {
      read_window(window_of(dp_rank, m, row), b.tokens.data() + row * seq_,
                  b.targets.data() + row * seq_);
    }
  }
  return out;
}

std::string ValidationSet::describe() const {
  std::ostringstream s;
  const int64_t used = micro_batches_ * dp_size_ * micro_batch_;
  if (tokens_ != nullptr) {
    s << "tokens: " << tokens_->describe();
  } else {
    s << "text: " << format_bytes(corpus_.size()) << " from " << num_files_ << " file"
      << (num_files_ == 1 ? "" : "s");
  }
  s << ", " << used << " of its " << num_windows_ << " windows of " << seq_ + 1;
  return s.str();
}

}  // namespace porter::io
