// Memory-mapped token shards (llm.c .bin and raw uint16), their checks at open (Note [Shard
// checks]), the window layout (Note [Token windows]) and the window permutation (Note [Window
// permutation]).
#include "io/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/check.h"
#include "base/error.h"
#include "tensor/philox.h"

namespace porter::io {

// The mapped tokens are read in place as little-endian uint16 (both formats are).
static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian uint16; a big-endian host would need a byte swap");

namespace {

std::string quoted(const std::filesystem::path& p) { return "\"" + p.string() + "\""; }

int32_t read_i32(const unsigned char* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Closes a descriptor on every path out of the constructor; the mapping outlives it.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

const char* shard_format_name(ShardFormat f) {
  return f == ShardFormat::kLlmc ? "llm.c" : "raw uint16";
}

std::string format_token_count(int64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (n >= 1'000'000'000) {
    std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  } else if (n >= 1'000'000) {
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  } else if (n >= 10'000) {
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  }
  return buf;
}

TokenShard::TokenShard(const std::filesystem::path& path, const std::string& key, int64_t vocab,
                       int64_t seq)
    : path_(path) {
  const std::string where = key + ": " + quoted(path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(where + ": cannot open: " + std::strerror(errno));
  const FdGuard guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(where + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw IoError(where + " is not a regular file");
  const size_t size_bytes = static_cast<size_t>(st.st_size);
  if (size_bytes == 0) {
    throw IoError(where + " is empty (0 bytes); a token shard holds uint16 token ids, with or "
                  "without llm.c's 1024-byte header");
  }
  void* map = ::mmap(nullptr, size_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) {
    throw IoError(where + ": cannot map its " + std::to_string(size_bytes) +
                  " bytes: " + std::strerror(errno));
  }
  map_ = map;
  map_bytes_ = size_bytes;
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    const bool has_int = size_bytes >= sizeof(int32_t);
    const int32_t first = has_int ? read_i32(bytes) : 0;
    const std::string no_header =
        has_int ? "no llm.c header: its first int32 is " + std::to_string(first) +
                      ", not llm.c's magic " + std::to_string(kLlmcMagic)
                : "no llm.c header: it is shorter than one int32";
    if (has_int && first == kLlmcMagic) {
      format_ = ShardFormat::kLlmc;
      if (size_bytes < kLlmcHeaderBytes) {
        throw IoError(where + ": truncated llm.c header: the file starts with the magic " +
                      std::to_string(kLlmcMagic) + " but has " + std::to_string(size_bytes) +
                      " bytes, fewer than the header's " + std::to_string(kLlmcHeaderBytes));
      }
      const int32_t version = read_i32(bytes + 4);
      if (version != kLlmcVersion) {
        throw IoError(where + ": llm.c header version " + std::to_string(version) +
                      "; porter reads version " + std::to_string(kLlmcVersion) +
                      " (uint16 tokens)" +
                      (version == 2 ? "; version 2 holds uint32 tokens (llm.c's Llama 3 shards)"
                                    : std::string()));
      }
      const int32_t count = read_i32(bytes + 8);
      if (count < 0) {
        throw IoError(where + ": the llm.c header's token count (header[2]) is " +
                      std::to_string(count) + ", negative");
      }
      const size_t expected_bytes = kLlmcHeaderBytes + 2 * static_cast<size_t>(count);
      const std::string says = "its llm.c header says " + std::to_string(count) +
                               " tokens (" + std::to_string(kLlmcHeaderBytes) + " + 2 x " +
                               std::to_string(count) + " = " + std::to_string(expected_bytes) +
                               " bytes), the file has " + std::to_string(size_bytes) + " bytes";
      if (size_bytes < expected_bytes) {
        throw IoError(where + " is truncated: " + says + " (" +
                      std::to_string((size_bytes - kLlmcHeaderBytes) / 2) +
                      " whole tokens); copy or write it again");
      }
      if (size_bytes > expected_bytes) {
        throw IoError(where + " is oversized: " + says + ", " +
                      std::to_string(size_bytes - expected_bytes) +
                      " bytes past the last token; the header's count or the file is wrong");
      }
      if (count == 0) throw IoError(where + " holds no tokens (its llm.c header says 0)");
      tokens_ = reinterpret_cast<const uint16_t*>(bytes + kLlmcHeaderBytes);
      num_tokens_ = count;
    } else {
      format_ = ShardFormat::kRaw;
      if (size_bytes % 2 != 0) {
        throw IoError(where + " has " + std::to_string(size_bytes) +
                      " bytes, an odd number: it is read as raw uint16 tokens, 2 bytes each (" +
                      no_header + ")");
      }
      tokens_ = reinterpret_cast<const uint16_t*>(bytes);
      num_tokens_ = static_cast<int64_t>(size_bytes / 2);
    }
    if (num_tokens_ < seq + 1) {
      throw InvalidArgument(where + " has " + std::to_string(num_tokens_) +
                            " tokens, fewer than porter.model.seq_len + 1 = " +
                            std::to_string(seq + 1) +
                            "; a window of seq_len + 1 tokens never spans two shards: join it "
                            "with another shard, drop it from " + key +
                            ", or lower porter.model.seq_len");
    }
    // One pass over the mapping for the largest id (Note [Shard checks]); the kernel reads
    // ahead for it, and forgets that once the windows' random reads begin.
    ::madvise(map_, map_bytes_, MADV_SEQUENTIAL);
    uint16_t max_id = 0;
    for (int64_t i = 0; i < num_tokens_; ++i) max_id = std::max(max_id, tokens_[i]);
    ::madvise(map_, map_bytes_, MADV_NORMAL);
    max_token_ = max_id;
    if (static_cast<int64_t>(max_id) >= vocab) {
      const auto* bad = std::find_if(tokens_, tokens_ + num_tokens_,
                                     [&](uint16_t id) { return static_cast<int64_t>(id) >= vocab; });
      const int64_t pos = bad - tokens_;
      const size_t offset_bytes = (format_ == ShardFormat::kLlmc ? kLlmcHeaderBytes : 0) +
                                  2 * static_cast<size_t>(pos);
      std::string msg = where + ": token " + std::to_string(pos) + " (byte offset " +
                        std::to_string(offset_bytes) + ") is id " + std::to_string(*bad) +
                        ", not below porter.model.vocab = " + std::to_string(vocab) +
                        "; the shard's largest id is " + std::to_string(max_id) +
                        ": raise porter.model.vocab to at least " + std::to_string(max_id + 1) +
                        " (the tokenizer's vocabulary size)";
      if (format_ == ShardFormat::kRaw && offset_bytes < kLlmcHeaderBytes) {
        msg += "; the file is read as raw uint16 tokens (" + no_header +
               "), so if it is meant to be an llm.c shard its header is damaged";
      }
      throw InvalidArgument(msg);
    }
  } catch (...) {
    unmap();
    throw;
  }
}

TokenShard::~TokenShard() { unmap(); }

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      format_(other.format_),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      max_token_(other.max_token_) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    format_ = other.format_;
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    max_token_ = other.max_token_;
  }
  return *this;
}

void TokenShard::unmap() noexcept {
  // munmap fails only for arguments that mmap returned, i.e. never here; nothing to report.
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
}

TokenCorpus::TokenCorpus(const std::vector<std::filesystem::path>& files, const std::string& key,
                         int64_t vocab, int64_t seq)
    : seq_(seq) {
  PORTER_CHECK(seq > 0, "TokenCorpus: seq ", seq, " must be positive");
  PORTER_CHECK(!files.empty(), key, ": no token shards to read");
  shards_.reserve(files.size());
  window_starts_.push_back(0);
  for (const std::filesystem::path& f : files) {
    shards_.emplace_back(f, key, vocab, seq);
    const int64_t n = shards_.back().num_tokens();
    num_tokens_ += n;
    window_starts_.push_back(window_starts_.back() + (n - 1) / seq);
  }
}

std::pair<size_t, int64_t> TokenCorpus::locate(int64_t w) const {
  PORTER_ASSERT(w >= 0 && w < num_windows(), "window ", w, " of ", num_windows());
  const auto it = std::upper_bound(window_starts_.begin(), window_starts_.end(), w);
  const size_t s = static_cast<size_t>(it - window_starts_.begin()) - 1;
  return {s, (w - window_starts_[s]) * seq_};
}

void TokenCorpus::read_window(int64_t w, int32_t* tokens, int32_t* targets) const {
  const auto [s, offset] = locate(w);
  const uint16_t* p = shards_[s].tokens() + offset;
  for (int64_t t = 0; t < seq_; ++t) {
    tokens[t] = p[t];
    targets[t] = p[t + 1];
  }
}

std::string TokenCorpus::describe() const {
  size_t llmc = 0;
  for (const TokenShard& s : shards_) llmc += s.format() == ShardFormat::kLlmc ? 1 : 0;
  const size_t raw = shards_.size() - llmc;
  const size_t n = shards_.size();
  std::string out = format_token_count(num_tokens_) + " tokens in ";
  if (llmc == 0 || raw == 0) {
    out += std::to_string(n) + " " + (llmc > 0 ? "llm.c" : "raw uint16") + " shard" +
           (n == 1 ? "" : "s");
  } else {
    out += std::to_string(n) + " shards (" + std::to_string(llmc) + " llm.c, " +
           std::to_string(raw) + " raw uint16)";
  }
  return out;
}

uint64_t permute_window(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch) {
  PORTER_ASSERT(i < n, "permute_window: index ", i, " of ", n);
  // Note [Window permutation]: halves of h bits, 4^h >= n.
  const int bits = n > 1 ? std::bit_width(n - 1) : 1;
  const int h = std::max(1, (bits + 1) / 2);
  const uint64_t mask = (uint64_t{1} << h) - 1;
  constexpr int kRounds = 6;
  constexpr uint32_t kDomain = 0x57u;  // apart from the other Philox streams of io/data.cc
  auto feistel = [&](uint64_t x) {
    uint64_t left = x >> h, right = x & mask;
    for (int round = 0; round < kRounds; ++round) {
      const tensor::Philox4 ctr{{static_cast<uint32_t>(right), static_cast<uint32_t>(round) | (kDomain << 24),
                             static_cast<uint32_t>(epoch), static_cast<uint32_t>(epoch >> 32)}};
      const tensor::Philox4 r = tensor::philox4x32_10(ctr, static_cast<uint32_t>(seed),
                                              static_cast<uint32_t>(seed >> 32));
      const uint64_t f = ((static_cast<uint64_t>(r.v[0]) << 32) | r.v[1]) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << h) | right;
  };
  uint64_t x = i;
  do {
    x = feistel(x);
  } while (x >= n);
  return x;
}

}  // namespace porter::io
