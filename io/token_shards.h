// Pre-tokenized data: memory-mapped uint16 token shards, in llm.c's .bin format (a header of
// 256 int32) or nanoGPT's raw train.bin / val.bin, checked once when they are opened, and the
// windows of seq + 1 tokens that training and validation read from them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace porter::io {

// llm.c's shard header (dev/data/data_common.py): 256 little-endian int32, then the tokens.
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;  // uint16 tokens (GPT-2); version 2 is uint32
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

enum class ShardFormat { kLlmc, kRaw };
const char* shard_format_name(ShardFormat f);  // "llm.c", "raw uint16"

// Note [Shard checks]
// A file whose first int32 is kLlmcMagic is an llm.c shard; any other file is raw uint16
// tokens (nanoGPT's prepare.py). Opening one checks, with the file in every message:
// - llm.c: the header is whole (1024 bytes), its version is 1, and the file is exactly
//   1024 + 2 * header[2] bytes (a shorter file is truncated, a longer one oversized; both name
//   the header's count and the bytes present);
// - raw: an even, nonzero size;
// - both: at least seq + 1 tokens, since a window never spans two shards;
// - both: every token id below porter.model.vocab. The largest id is found by one linear pass
//   over the mapped file at open, so a bad id fails at start, not at the step that draws it.
// Format errors are IoError; a shard too short for seq_len, or an id outside the vocab, is
// InvalidArgument (the fix is in the config).

// One read-only, memory-mapped shard; move-only, unmapped on destruction. The file is never
// read into memory as a whole: pages come in as windows touch them.
class TokenShard {
 public:
  // Maps `path` and checks it (Note [Shard checks]). `key` is the config key that named it
  // ("porter.data.paths"), for the messages.
  TokenShard(const std::filesystem::path& path, const std::string& key, int64_t vocab,
             int64_t seq);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::filesystem::path& path() const { return path_; }
  ShardFormat format() const { return format_; }
  int64_t num_tokens() const { return num_tokens_; }
  uint16_t max_token() const { return max_token_; }
  // Token i, 0 <= i < num_tokens().
  uint16_t token(int64_t i) const { return tokens_[i]; }
  const uint16_t* tokens() const { return tokens_; }  // num_tokens() of them, in the mapping

 private:
  void unmap() noexcept;

  std::filesystem::path path_;
  ShardFormat format_ = ShardFormat::kRaw;
  void* map_ = nullptr;          // owned: the mmap of the whole file, map_bytes_ long
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;  // into map_: past the header for llm.c
  int64_t num_tokens_ = 0;
  uint16_t max_token_ = 0;
};

// Note [Token windows]
// A window is seq + 1 consecutive tokens of one shard: the inputs are its first seq, the
// targets its last seq (the inputs shifted by one). The windows of a shard of n tokens start
// at 0, seq, 2 * seq, ...: floor((n - 1) / seq) of them, so consecutive windows share only
// the token that is one's last target and the next one's first input, and every token is a
// target at most once. Windows never span two shards. They are numbered across the shards in
// order: window w of the corpus is window w - first(s) of shard s, first(s) being the number
// of windows of the shards before s.
class TokenCorpus {
 public:
  // Opens `files` as shards, in this order (resolve_data_files in data.h lists them from
  // porter.data.paths). `key` names the config key in errors.
  TokenCorpus(const std::vector<std::filesystem::path>& files, const std::string& key,
              int64_t vocab, int64_t seq);

  int64_t seq() const { return seq_; }
  int64_t num_windows() const { return window_starts_.back(); }
  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<TokenShard>& shards() const { return shards_; }
  // (shard, offset of the window's first token in it) of window w, 0 <= w < num_windows().
  std::pair<size_t, int64_t> locate(int64_t w) const;
  // Window w's seq inputs and seq targets (Note [Token windows]).
  void read_window(int64_t w, int32_t* tokens, int32_t* targets) const;
  // "1.23M tokens in 4 llm.c shards", "600 tokens in 2 shards (1 llm.c, 1 raw uint16)".
  std::string describe() const;

 private:
  int64_t seq_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> window_starts_;  // shards_.size() + 1 prefix sums of windows per shard
  int64_t num_tokens_ = 0;
};

// Note [Window permutation]
// permute_window(i, n, seed, epoch) is a bijection of [0, n) for each (seed, epoch): a
// balanced Feistel network of 6 rounds over the smallest even number of bits 2h >= bits(n - 1)
// (h >= 1), whose round function is Philox4x32-10 keyed by the seed, counting (half, round,
// epoch); values that land in [n, 4^h) are walked through the network again until they fall
// below n (cycle walking keeps it a bijection of [0, n); fewer than 4 passes on average since
// 4^h < 4n). No table is built: a window index costs a few dozen Philox rounds, so an epoch
// over any number of windows is free to set up and every sample is a pure function.
uint64_t permute_window(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch);

// A compact count: "900", "12.3k", "4.56M", "1.20G".
std::string format_token_count(int64_t n);

}  // namespace porter::io
