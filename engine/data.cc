// Synthetic and byte-level text data for the built-in GPT; every micro-batch is a pure
// function of (seed, step, micro-batch), so a resumed run sees the same data.
#include "engine/data.h"

#include "base/check.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "base/error.h"
#include "base/units.h"
#include "nn/philox.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;

// Note [Data keys]
// One Philox4x32-10 call per (step, micro-batch, index, domain): the counter holds the index
// (an element for synthetic tokens, a row for text windows), the micro-batch, the domain and
// the low 32 bits of the step; the key is the seed with the step's high bits folded in.
// Returns 64 random bits.
uint64_t draw(uint64_t seed, int64_t step, int64_t micro_batch, uint64_t index, uint32_t domain) {
  const uint64_t s = static_cast<uint64_t>(step);
  nn::Philox4 ctr{{static_cast<uint32_t>(index),
                   static_cast<uint32_t>(index >> 32) ^ (domain << 24),
                   static_cast<uint32_t>(micro_batch), static_cast<uint32_t>(s)}};
  nn::Philox4 r = nn::philox4x32_10(ctr, static_cast<uint32_t>(seed),
                                    static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(s >> 32));
  return (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
}

constexpr uint32_t kDomainTokens = 1;
constexpr uint32_t kDomainOffsets = 2;

void read_file_into(const fs::path& path, std::string& corpus) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("porter.data.paths: cannot read \"" + path.string() + "\"");
  corpus.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError("porter.data.paths: error while reading \"" + path.string() + "\"");
}

bool hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

}  // namespace

DataSource::DataSource(const config::DataConfig& data, int64_t vocab, int64_t micro_batch,
                       int64_t seq)
    : config_(data), vocab_(vocab), micro_batch_(micro_batch), seq_(seq) {
  if (micro_batch <= 0 || seq <= 0 || vocab <= 0) {
    throw InvalidArgument("data: micro-batch (" + std::to_string(micro_batch) + "), seq (" +
                          std::to_string(seq) + ") and vocab (" + std::to_string(vocab) +
                          ") must be positive");
  }
  if (data.type != config::DataType::kText) return;
  if (vocab < 256) {
    throw InvalidArgument("porter.model.vocab: text data is byte-level and needs a vocab of at "
                          "least 256, got " + std::to_string(vocab) +
                          "; set porter.model.vocab to 256");
  }
  if (data.paths.empty()) {
    throw InvalidArgument("porter.data.paths: text data needs at least one file or directory");
  }
  // Relative paths resolve against the working directory of the process.
  for (const std::string& p : data.paths) {
    const fs::path path(p);
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (ec || !fs::exists(st)) {
      throw IoError("porter.data.paths: \"" + p + "\" does not exist (relative paths are "
                    "resolved against the working directory, " + fs::current_path().string() + ")");
    }
    if (fs::is_directory(st)) {
      std::vector<fs::path> files;
      for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
        if (hidden(it->path())) {
          if (it->is_directory()) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file()) files.push_back(it->path());
      }
      if (ec) throw IoError("porter.data.paths: cannot list \"" + p + "\": " + ec.message());
      std::sort(files.begin(), files.end());
      for (const fs::path& f : files) read_file_into(f, corpus_);
      num_files_ += files.size();
    } else {
      read_file_into(path, corpus_);
      ++num_files_;
    }
  }
  if (corpus_.size() < static_cast<size_t>(seq) + 1) {
    throw InvalidArgument("porter.data.paths: the text corpus has " +
                          std::to_string(corpus_.size()) + " bytes, fewer than seq_len + 1 = " +
                          std::to_string(seq + 1) + "; add files or lower porter.model.seq_len");
  }
}

std::vector<HostBatch> DataSource::step_batches(int64_t step, int64_t micro_batches) const {
  return rank_batches(step, micro_batches, 0, 1);
}

std::vector<HostBatch> DataSource::rank_batches(int64_t step, int64_t micro_batches, int dp_rank,
                                                int dp_size) const {
  PORTER_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "rank_batches: dp rank ",
               dp_rank, " of ", dp_size);
  std::vector<HostBatch> out(static_cast<size_t>(micro_batches));
  const size_t n = static_cast<size_t>(micro_batch_ * seq_);
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
      if (config_.type == config::DataType::kText) {
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
  if (config_.type == config::DataType::kText) {
    s << "text: " << format_bytes(corpus_.size()) << " from " << num_files_ << " file"
      << (num_files_ == 1 ? "" : "s");
  } else {
    s << "synthetic (seed " << config_.seed << ", vocab " << vocab_ << ")";
  }
  return s.str();
}

}  // namespace porter::engine
