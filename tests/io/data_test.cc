// io::DataSource: determinism per (seed, step, micro-batch), shifted targets, text windows taken
// from the corpus, and the errors for bad paths, vocab and corpus size. Token shards: llm.c and
// raw formats read back, every header and size check, ids outside the vocab, sampling without
// repeats per epoch and without overlap between ranks, resume positions, and the validation
// set's fixed windows split across ranks.
#include "io/data.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"
#include "io/token_shards.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("porter_data_test_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

config::DataConfig text_config(std::vector<std::string> paths, uint64_t seed = 7) {
  config::DataConfig c;
  c.type = config::DataType::kText;
  c.paths = std::move(paths);
  c.seed = seed;
  return c;
}

TEST(DataSource, SyntheticIsDeterministicAndShifted) {
  config::DataConfig c;
  c.seed = 11;
  io::DataSource a(c, 50, 2, 8), b(c, 50, 2, 8);
  auto x = a.step_batches(3, 2), y = b.step_batches(3, 2);
  ASSERT_EQ(x.size(), 2u);
  for (size_t m = 0; m < 2; ++m) {
    EXPECT_EQ(x[m].batch, 2);
    EXPECT_EQ(x[m].seq, 8);
    ASSERT_EQ(x[m].tokens.size(), 16u);
    EXPECT_EQ(x[m].tokens, y[m].tokens);
    EXPECT_EQ(x[m].targets, y[m].targets);
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t t = 0; t + 1 < 8; ++t) {
        EXPECT_EQ(x[m].targets[r * 8 + t], x[m].tokens[r * 8 + t + 1]);
      }
    }
    for (int32_t v : x[m].tokens) {
      EXPECT_GE(v, 0);
      EXPECT_LT(v, 50);
    }
  }
  // Different micro-batches, steps and seeds give different data.
  EXPECT_NE(x[0].tokens, x[1].tokens);
  EXPECT_NE(x[0].tokens, a.step_batches(4, 1)[0].tokens);
  c.seed = 12;
  EXPECT_NE(x[0].tokens, io::DataSource(c, 50, 2, 8).step_batches(3, 1)[0].tokens);
  // A step's micro-batch does not depend on how many micro-batches were asked for.
  EXPECT_EQ(a.step_batches(3, 1)[0].tokens, x[0].tokens);
  EXPECT_EQ(a.describe(), "synthetic (seed 11, vocab 50)");
}

TEST(DataSource, TextWindowsComeFromTheCorpusInSortedOrder) {
  fs::path d = temp_dir("text");
  write(d / "b.txt", "BBBBBBBBBB");
  write(d / "a" / "x.txt", "0123456789");
  write(d / ".hidden", "zzzzzzzzzz");
  io::DataSource src(text_config({d.string()}), 256, 3, 4);
  EXPECT_EQ(src.corpus_bytes(), 20u);
  EXPECT_EQ(src.describe(), "text: 20 B from 2 files");
  const std::string corpus = "0123456789BBBBBBBBBB";
  auto batches = src.step_batches(0, 2);
  for (const io::HostBatch& b : batches) {
    for (int64_t r = 0; r < 3; ++r) {
      std::string window;
      for (int64_t t = 0; t < 4; ++t) window += static_cast<char>(b.tokens[r * 4 + t]);
      window += static_cast<char>(b.targets[r * 4 + 3]);
      EXPECT_NE(corpus.find(window), std::string::npos) << window;
      for (int64_t t = 0; t + 1 < 4; ++t) EXPECT_EQ(b.targets[r * 4 + t], b.tokens[r * 4 + t + 1]);
    }
  }
  io::DataSource again(text_config({d.string()}), 256, 3, 4);
  EXPECT_EQ(again.step_batches(0, 2)[1].tokens, batches[1].tokens);
}

TEST(DataSource, FilesAndDirectoriesMix) {
  fs::path d = temp_dir("mix");
  write(d / "one.txt", "hello world, ");
  write(d / "dir" / "two.txt", "and more text");
  io::DataSource src(text_config({(d / "one.txt").string(), (d / "dir").string()}), 256, 1, 8);
  EXPECT_EQ(src.corpus_bytes(), 26u);
  EXPECT_EQ(src.describe(), "text: 26 B from 2 files");
}

TEST(DataSource, Errors) {
  fs::path d = temp_dir("errors");
  write(d / "short.txt", "abc");
  const std::string missing = (d / "nope").string();
  std::string e = error_of([&] { io::DataSource(text_config({missing}), 256, 1, 4); });
  EXPECT_NE(e.find("porter.data.paths: \"" + missing + "\" does not exist"), std::string::npos) << e;
  EXPECT_THROW(io::DataSource(text_config({missing}), 256, 1, 4), IoError);

  e = error_of([&] { io::DataSource(text_config({d.string()}), 128, 1, 2); });
  EXPECT_NE(e.find("porter.model.vocab: text data is byte-level and needs a vocab of at least "
                   "256, got 128"), std::string::npos) << e;
  EXPECT_THROW(io::DataSource(text_config({d.string()}), 128, 1, 2), InvalidArgument);

  e = error_of([&] { io::DataSource(text_config({d.string()}), 256, 1, 3); });
  EXPECT_NE(e.find("the text corpus has 3 bytes, fewer than seq_len + 1 = 4"), std::string::npos) << e;
  EXPECT_THROW(io::DataSource(text_config({d.string()}), 256, 1, 3), InvalidArgument);
  EXPECT_NO_THROW(io::DataSource(text_config({d.string()}), 256, 1, 2));

  EXPECT_THROW(io::DataSource(text_config({}), 256, 1, 2), InvalidArgument);
}

// --- Token shards ---------------------------------------------------------------------

// An llm.c shard: a header of 256 int32 (magic, version, count; the rest zero), then the
// tokens as uint16. `count` < 0 writes tokens.size().
void write_llmc(const fs::path& p, const std::vector<uint16_t>& tokens,
                int32_t magic = io::kLlmcMagic, int32_t version = io::kLlmcVersion, int64_t count = -1) {
  std::vector<int32_t> header(io::kLlmcHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(count < 0 ? static_cast<int64_t>(tokens.size()) : count);
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(io::kLlmcHeaderBytes));
  f.write(reinterpret_cast<const char*>(tokens.data()),
          static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
}

// nanoGPT's train.bin: the tokens alone.
void write_raw(const fs::path& p, const std::vector<uint16_t>& tokens) {
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(tokens.data()),
          static_cast<std::streamsize>(tokens.size() * sizeof(uint16_t)));
}

// first, first + 1, ..., first + n - 1: a window's first token says where it starts.
std::vector<uint16_t> iota_tokens(size_t n, uint16_t first = 0) {
  std::vector<uint16_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

config::DataConfig tokens_config(std::vector<std::string> paths, uint64_t seed = 5,
                                 std::vector<std::string> val_paths = {}) {
  config::DataConfig c;
  c.type = config::DataType::kTokens;
  c.paths = std::move(paths);
  c.val_paths = std::move(val_paths);
  c.seed = seed;
  return c;
}

TEST(TokenShards, LlmcAndRawReadBackTheirTokens) {
  fs::path d = temp_dir("shards_read");
  // seq 4: 41 tokens are 10 windows, 40 are 9 (the last window needs its target).
  write_llmc(d / "a.bin", iota_tokens(41, 100));
  write_raw(d / "b.bin", iota_tokens(40, 1000));
  io::TokenCorpus corpus({d / "a.bin", d / "b.bin"}, "porter.data.paths", 2000, 4);
  ASSERT_EQ(corpus.shards().size(), 2u);
  EXPECT_EQ(corpus.shards()[0].format(), io::ShardFormat::kLlmc);
  EXPECT_EQ(corpus.shards()[1].format(), io::ShardFormat::kRaw);
  EXPECT_EQ(corpus.shards()[0].num_tokens(), 41);
  EXPECT_EQ(corpus.shards()[1].num_tokens(), 40);
  EXPECT_EQ(corpus.shards()[0].max_token(), 140);
  EXPECT_EQ(corpus.shards()[1].max_token(), 1039);
  EXPECT_EQ(corpus.num_tokens(), 81);
  EXPECT_EQ(corpus.num_windows(), 19);
  EXPECT_EQ(corpus.describe(), "81 tokens in 2 shards (1 llm.c, 1 raw uint16)");
  for (int64_t w = 0; w < corpus.num_windows(); ++w) {
    const bool first = w < 10;
    const int32_t start = first ? 100 + 4 * static_cast<int32_t>(w) : 1000 + 4 * static_cast<int32_t>(w - 10);
    EXPECT_EQ(corpus.locate(w), (std::pair<size_t, int64_t>{first ? 0u : 1u, (first ? w : w - 10) * 4}));
    int32_t tok[4], tgt[4];
    corpus.read_window(w, tok, tgt);
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(tok[t], start + t) << "window " << w;
      EXPECT_EQ(tgt[t], start + t + 1) << "window " << w;
    }
  }
  EXPECT_EQ(io::TokenCorpus({d / "a.bin"}, "k", 2000, 4).describe(), "41 tokens in 1 llm.c shard");
  write_raw(d / "big.bin", std::vector<uint16_t>(123'456, 7));
  EXPECT_EQ(io::TokenCorpus({d / "big.bin", d / "b.bin"}, "k", 2000, 4).describe(),
            "123.5k tokens in 2 raw uint16 shards");
}

TEST(TokenShards, HeaderAndSizeChecks) {
  fs::path d = temp_dir("shards_errors");
  const std::string key = "porter.data.paths";
  auto open = [&](const fs::path& p, int64_t vocab = 1000, int64_t seq = 4) {
    return error_of([&] { io::TokenShard(p, key, vocab, seq); });
  };
  auto expect_has = [](const std::string& e, const std::string& part) {
    EXPECT_NE(e.find(part), std::string::npos) << "expected \"" << part << "\" in: " << e;
  };
  const std::string q = "porter.data.paths: \"" + d.string();

  write_llmc(d / "v2.bin", iota_tokens(10), io::kLlmcMagic, 2);
  std::string e = open(d / "v2.bin");
  expect_has(e, q + "/v2.bin\": llm.c header version 2; porter reads version 1 (uint16 tokens); "
                "version 2 holds uint32 tokens");
  EXPECT_THROW(io::TokenShard(d / "v2.bin", key, 1000, 4), IoError);

  // A header that says 100 tokens over a file with 38.
  write_llmc(d / "short.bin", iota_tokens(38), io::kLlmcMagic, 1, 100);
  e = open(d / "short.bin");
  expect_has(e, q + "/short.bin\" is truncated: its llm.c header says 100 tokens (1024 + 2 x 100 "
                "= 1224 bytes), the file has 1100 bytes (38 whole tokens)");
  EXPECT_THROW(io::TokenShard(d / "short.bin", key, 1000, 4), IoError);

  write_llmc(d / "long.bin", iota_tokens(12), io::kLlmcMagic, 1, 10);
  e = open(d / "long.bin");
  expect_has(e, q + "/long.bin\" is oversized: its llm.c header says 10 tokens (1024 + 2 x 10 = "
                "1044 bytes), the file has 1048 bytes, 4 bytes past the last token");
  EXPECT_THROW(io::TokenShard(d / "long.bin", key, 1000, 4), IoError);

  {
    std::ofstream f(d / "cut_header.bin", std::ios::binary);
    const int32_t magic = io::kLlmcMagic;
    f.write(reinterpret_cast<const char*>(&magic), sizeof magic);
    f << std::string(96, '\0');
  }
  e = open(d / "cut_header.bin");
  expect_has(e, "cut_header.bin\": truncated llm.c header: the file starts with the magic "
                "20240520 but has 100 bytes, fewer than the header's 1024");

  write_llmc(d / "none.bin", {}, io::kLlmcMagic, 1, 0);
  expect_has(open(d / "none.bin"), "none.bin\" holds no tokens (its llm.c header says 0)");

  write(d / "odd.bin", std::string(21, 'a'));
  e = open(d / "odd.bin");
  expect_has(e, q + "/odd.bin\" has 21 bytes, an odd number: it is read as raw uint16 tokens, 2 "
                "bytes each (no llm.c header: its first int32 is 1633771873, not llm.c's magic "
                "20240520)");
  EXPECT_THROW(io::TokenShard(d / "odd.bin", key, 1000, 4), IoError);

  write(d / "empty.bin", "");
  expect_has(open(d / "empty.bin"), q + "/empty.bin\" is empty (0 bytes)");
  EXPECT_THROW(io::TokenShard(d / "empty.bin", key, 1000, 4), IoError);

  expect_has(open(d / "missing.bin"), q + "/missing.bin\": cannot open: No such file");

  // Too short for one window: 4 tokens with seq 4.
  write_raw(d / "tiny.bin", iota_tokens(4));
  e = open(d / "tiny.bin");
  expect_has(e, q + "/tiny.bin\" has 4 tokens, fewer than porter.model.seq_len + 1 = 5; a window "
                "of seq_len + 1 tokens never spans two shards: join it with another shard, drop "
                "it from porter.data.paths, or lower porter.model.seq_len");
  EXPECT_THROW(io::TokenShard(d / "tiny.bin", key, 1000, 4), InvalidArgument);
  EXPECT_NO_THROW(io::TokenShard(d / "tiny.bin", key, 1000, 3));
}

TEST(TokenShards, TokenIdsOutsideTheVocabFailAtOpen) {
  fs::path d = temp_dir("shards_vocab");
  const std::string key = "porter.data.paths";
  std::vector<uint16_t> t = iota_tokens(50);
  t[30] = 700;
  t[40] = 900;
  write_llmc(d / "a.bin", t);
  std::string e = error_of([&] { io::TokenShard(d / "a.bin", key, 512, 4); });
  EXPECT_NE(e.find("porter.data.paths: \"" + (d / "a.bin").string() + "\": token 30 (byte offset "
                   "1084) is id 700, not below porter.model.vocab = 512; the shard's largest id "
                   "is 900: raise porter.model.vocab to at least 901"), std::string::npos) << e;
  EXPECT_EQ(e.find("damaged"), std::string::npos) << e;
  EXPECT_THROW(io::TokenShard(d / "a.bin", key, 512, 4), InvalidArgument);
  EXPECT_NO_THROW(io::TokenShard(d / "a.bin", key, 901, 4));

  // A header with the wrong magic is not a header: the file is raw uint16, and its first
  // "tokens" are the header's halves.
  write_llmc(d / "bad_magic.bin", iota_tokens(50), io::kLlmcMagic + 1);
  e = error_of([&] { io::TokenShard(d / "bad_magic.bin", key, 50, 4); });
  EXPECT_NE(e.find("bad_magic.bin\": token 0 (byte offset 0) is id 55433, not below "
                   "porter.model.vocab = 50"), std::string::npos) << e;
  EXPECT_NE(e.find("the file is read as raw uint16 tokens (no llm.c header: its first int32 is "
                   "20240521, not llm.c's magic 20240520), so if it is meant to be an llm.c shard "
                   "its header is damaged"), std::string::npos) << e;
  io::TokenShard raw(d / "bad_magic.bin", key, 65536, 4);
  EXPECT_EQ(raw.format(), io::ShardFormat::kRaw);
  EXPECT_EQ(raw.num_tokens(), 512 + 50);
  EXPECT_EQ(raw.token(0), (io::kLlmcMagic + 1) & 0xffff);
  EXPECT_EQ(raw.token(512 + 7), 7);
}

TEST(TokenShards, ShardsMoveAndStayMapped) {
  fs::path d = temp_dir("shards_move");
  write_raw(d / "a.bin", iota_tokens(20, 3));
  io::TokenShard a(d / "a.bin", "k", 100, 4);
  io::TokenShard b(std::move(a));
  EXPECT_EQ(b.num_tokens(), 20);
  EXPECT_EQ(b.token(19), 22);
  std::vector<io::TokenShard> v;
  v.push_back(std::move(b));
  v.emplace_back(d / "a.bin", "k", 100, 4);
  v[0] = std::move(v[1]);
  EXPECT_EQ(v[0].token(5), 8);
}

TEST(TokenShards, PermutationIsABijectionPerEpoch) {
  for (uint64_t n : {1u, 2u, 3u, 5u, 16u, 17u, 255u, 1000u, 4097u}) {
    for (uint64_t epoch : {0u, 1u, 7u}) {
      std::vector<uint64_t> seen;
      for (uint64_t i = 0; i < n; ++i) seen.push_back(io::permute_window(i, n, 42, epoch));
      std::sort(seen.begin(), seen.end());
      std::vector<uint64_t> all(n);
      std::iota(all.begin(), all.end(), 0u);
      EXPECT_EQ(seen, all) << "n " << n << ", epoch " << epoch;
    }
  }
  // Each epoch and each seed has its own order; none is the identity.
  std::vector<uint64_t> e0, e1, s1, id(1000);
  std::iota(id.begin(), id.end(), 0u);
  for (uint64_t i = 0; i < 1000; ++i) {
    e0.push_back(io::permute_window(i, 1000, 42, 0));
    e1.push_back(io::permute_window(i, 1000, 42, 1));
    s1.push_back(io::permute_window(i, 1000, 43, 0));
  }
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, s1);
  EXPECT_NE(e0, id);
  // Large domains stay in range.
  const uint64_t big = (uint64_t{1} << 40) + 12345;
  for (uint64_t i : {uint64_t{0}, uint64_t{1}, big / 2, big - 1}) EXPECT_LT(io::permute_window(i, big, 9, 3), big);
}

// The window a row reads, from its first token (the shards hold 0, 1, 2, ...).
std::vector<int64_t> windows_of(const std::vector<io::HostBatch>& batches, int64_t seq) {
  std::vector<int64_t> w;
  for (const io::HostBatch& b : batches) {
    for (int64_t r = 0; r < b.batch; ++r) {
      EXPECT_EQ(b.tokens[static_cast<size_t>(r * seq)] % seq, 0);
      for (int64_t t = 0; t < seq; ++t) {
        const size_t i = static_cast<size_t>(r * seq + t);
        EXPECT_EQ(b.targets[i], b.tokens[i] + 1);
        if (t > 0) {
          EXPECT_EQ(b.tokens[i], b.tokens[i - 1] + 1);
        }
      }
      w.push_back(b.tokens[static_cast<size_t>(r * seq)] / seq);
    }
  }
  return w;
}

TEST(TokenShards, RanksTakeDisjointBlocksOfTheStep) {
  fs::path d = temp_dir("shards_ranks");
  // Two shards of 121 tokens: seq 4 gives 30 windows each, 60 in all. The second holds
  // 120, 121, ..., so a window's first token / 4 is its index in the corpus in both shards.
  write_raw(d / "a.bin", iota_tokens(121, 0));
  write_llmc(d / "b.bin", iota_tokens(121, 120));
  io::DataSource src(tokens_config({d.string()}), 1000, 3, 4);
  ASSERT_NE(src.tokens(), nullptr);
  EXPECT_EQ(src.tokens()->num_windows(), 60);
  EXPECT_EQ(src.describe(), "tokens: 242 tokens in 2 shards (1 llm.c, 1 raw uint16), 60 windows of 5");
  for (int64_t step : {0, 1, 5}) {
    const std::vector<io::HostBatch> one = src.step_batches(step, 6);
    for (int dp : {2, 3, 6}) {
      std::vector<io::HostBatch> joined;
      for (int r = 0; r < dp; ++r) {
        for (io::HostBatch& b : src.rank_batches(step, 6 / dp, r, dp)) joined.push_back(std::move(b));
      }
      ASSERT_EQ(joined.size(), one.size());
      for (size_t m = 0; m < one.size(); ++m) {
        EXPECT_EQ(joined[m].tokens, one[m].tokens) << "step " << step << ", dp " << dp << ", mb " << m;
        EXPECT_EQ(joined[m].targets, one[m].targets);
      }
    }
    // The rows are the windows window_of names.
    const std::vector<int64_t> w = windows_of(one, 4);
    std::vector<int64_t> expected;
    for (int64_t m = 0; m < 6; ++m) {
      for (int64_t r = 0; r < 3; ++r) expected.push_back(src.window_of(step, 6, m, r).window);
    }
    EXPECT_EQ(w, expected);
    // 18 rows of one step: no window twice (60 per epoch).
    EXPECT_EQ(std::set<int64_t>(w.begin(), w.end()).size(), w.size());
  }
}

TEST(TokenShards, EveryWindowOncePerEpoch) {
  fs::path d = temp_dir("shards_epoch");
  // 61 windows of seq 4: an epoch is not a whole number of steps of 2 x 3 rows.
  write_raw(d / "a.bin", iota_tokens(61 * 4 + 1));
  io::DataSource src(tokens_config({(d / "a.bin").string()}), 1000, 3, 4);
  ASSERT_EQ(src.tokens()->num_windows(), 61);
  std::vector<int64_t> drawn;
  std::vector<int64_t> epochs;
  for (int64_t step = 0; step < 21; ++step) {
    for (int64_t w : windows_of(src.step_batches(step, 2), 4)) drawn.push_back(w);
    for (int64_t m = 0; m < 2; ++m) {
      for (int64_t r = 0; r < 3; ++r) epochs.push_back(src.window_of(step, 2, m, r).epoch);
    }
  }
  ASSERT_EQ(drawn.size(), 126u);  // two epochs of 61, and 4 samples of the third
  for (int e = 0; e < 2; ++e) {
    std::vector<int64_t> epoch(drawn.begin() + 61 * e, drawn.begin() + 61 * (e + 1));
    std::sort(epoch.begin(), epoch.end());
    std::vector<int64_t> all(61);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(epoch, all) << "epoch " << e;
    EXPECT_EQ(epochs[static_cast<size_t>(61 * e)], e);
    EXPECT_EQ(epochs[static_cast<size_t>(61 * e + 60)], e);
  }
  EXPECT_EQ(epochs[122], 2);
  // The two epochs are in different orders.
  EXPECT_NE(std::vector<int64_t>(drawn.begin(), drawn.begin() + 61),
            std::vector<int64_t>(drawn.begin() + 61, drawn.begin() + 122));
}

TEST(TokenShards, StepAloneGivesThePosition) {
  fs::path d = temp_dir("shards_resume");
  write_llmc(d / "a.bin", iota_tokens(401));
  const config::DataConfig c = tokens_config({(d / "a.bin").string()}, 17);
  io::DataSource run(c, 1000, 2, 4);
  std::vector<std::vector<io::HostBatch>> steps;
  for (int64_t s = 0; s < 8; ++s) steps.push_back(run.rank_batches(s, 2, 1, 2));
  // A fresh source (a resumed run) at step 5 first, then the others in another order.
  io::DataSource resumed(c, 1000, 2, 4);
  for (int64_t s : {5, 7, 0, 6, 1, 2, 3, 4}) {
    const std::vector<io::HostBatch> b = resumed.rank_batches(s, 2, 1, 2);
    for (size_t m = 0; m < b.size(); ++m) {
      EXPECT_EQ(b[m].tokens, steps[static_cast<size_t>(s)][m].tokens) << "step " << s;
      EXPECT_EQ(b[m].targets, steps[static_cast<size_t>(s)][m].targets) << "step " << s;
    }
  }
  // Another seed, another order.
  io::DataSource other(tokens_config({(d / "a.bin").string()}, 18), 1000, 2, 4);
  EXPECT_NE(other.rank_batches(5, 2, 1, 2)[0].tokens, steps[5][0].tokens);
}

TEST(TokenShards, DirectoriesAndGlobs) {
  fs::path d = temp_dir("shards_paths");
  write_raw(d / "data" / "b_train_1.bin", iota_tokens(9));
  write_raw(d / "data" / "a_train_0.bin", iota_tokens(9));
  write_raw(d / "data" / "c_val_0.bin", iota_tokens(9));
  write_raw(d / "data" / ".hidden.bin", iota_tokens(9));
  write(d / "data" / "README.txt", "not a shard");
  const std::string key = "porter.data.paths";
  const std::vector<fs::path> all =
      io::resolve_data_files({(d / "data").string()}, key, config::DataType::kTokens);
  EXPECT_EQ(all, (std::vector<fs::path>{d / "data" / "a_train_0.bin", d / "data" / "b_train_1.bin",
                                        d / "data" / "c_val_0.bin"}));
  const std::vector<fs::path> train =
      io::resolve_data_files({(d / "data" / "*_train_*.bin").string()}, key, config::DataType::kTokens);
  EXPECT_EQ(train, (std::vector<fs::path>{d / "data" / "a_train_0.bin", d / "data" / "b_train_1.bin"}));
  // Text reads every file of a directory.
  EXPECT_EQ(io::resolve_data_files({(d / "data").string()}, key, config::DataType::kText).size(), 4u);

  std::string e = error_of([&] {
    io::resolve_data_files({(d / "data" / "*_test_*.bin").string()}, key, config::DataType::kTokens);
  });
  EXPECT_NE(e.find("porter.data.paths: \"" + (d / "data" / "*_test_*.bin").string() +
                   "\" matches no file in \"" + (d / "data").string() + "\""), std::string::npos) << e;
  write(d / "text" / "x.txt", "abc");
  e = error_of([&] { io::resolve_data_files({(d / "text").string()}, key, config::DataType::kTokens); });
  EXPECT_NE(e.find("porter.data.paths: the directory \"" + (d / "text").string() + "\" holds no "
                   "*.bin files (porter.data.type is \"tokens\")"), std::string::npos) << e;
  EXPECT_THROW(io::resolve_data_files({(d / "nope").string()}, key, config::DataType::kTokens), IoError);

  io::DataSource src(tokens_config({(d / "data" / "*_train_*.bin").string()}), 100, 1, 4);
  EXPECT_EQ(src.tokens()->shards().size(), 2u);
  EXPECT_EQ(src.tokens()->num_windows(), 4);
}

TEST(ValidationSet, FixedEvenlySpacedWindowsSplitAcrossRanks) {
  fs::path d = temp_dir("val_split");
  write_raw(d / "train.bin", iota_tokens(401));
  write_raw(d / "val.bin", iota_tokens(4 * 50 + 1));  // 50 windows of seq 4
  const config::DataConfig c =
      tokens_config({(d / "train.bin").string()}, 3, {(d / "val.bin").string()});
  // 2 ranks x 4 micro-batches x 3 rows = 24 of the 50 windows: floor(k * 50 / 24).
  io::ValidationSet two(c, 1000, 3, 4, 4, 2);
  EXPECT_EQ(two.num_windows(), 50);
  EXPECT_EQ(two.micro_batches(), 4);
  EXPECT_EQ(two.describe(), "tokens: 201 tokens in 1 raw uint16 shard, 24 of its 50 windows of 5");
  std::vector<int64_t> all;
  for (int r = 0; r < 2; ++r) {
    const std::vector<io::HostBatch> b = two.rank_batches(r);
    ASSERT_EQ(b.size(), 4u);
    const std::vector<int64_t> w = windows_of(b, 4);
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_EQ(w[i], two.window_of(r, static_cast<int64_t>(i) / 3, static_cast<int64_t>(i) % 3));
    }
    all.insert(all.end(), w.begin(), w.end());
    // The same windows at every evaluation, and from a fresh set.
    const std::vector<io::HostBatch> again = io::ValidationSet(c, 1000, 3, 4, 4, 2).rank_batches(r);
    for (size_t m = 0; m < b.size(); ++m) EXPECT_EQ(again[m].tokens, b[m].tokens);
    for (size_t m = 0; m < b.size(); ++m) EXPECT_EQ(two.rank_batches(r)[m].targets, b[m].targets);
  }
  std::vector<int64_t> expected;
  for (int64_t k = 0; k < 24; ++k) expected.push_back(k * 50 / 24);
  EXPECT_EQ(all, expected);  // evenly spaced, in order, none twice
  // One rank of 8 micro-batches evaluates exactly what two ranks of 4 do.
  EXPECT_EQ(windows_of(io::ValidationSet(c, 1000, 3, 4, 8, 1).rank_batches(0), 4), all);

  // A set too small for the request names what fits.
  std::string e = error_of([&] { io::ValidationSet(c, 1000, 3, 4, 9, 2); });
  EXPECT_NE(e.find("porter.data.val_paths: the validation set has 50 windows of seq_len + 1 = 5 "
                   "tokens; porter.train.eval_micro_batches = 9 x train_micro_batch_size_per_gpu "
                   "= 3 x 2 data-parallel ranks needs 54; lower porter.train.eval_micro_batches "
                   "to 8 or add validation data"), std::string::npos) << e;
  EXPECT_THROW(io::ValidationSet(c, 1000, 3, 4, 9, 2), InvalidArgument);
  EXPECT_NO_THROW(io::ValidationSet(c, 1000, 3, 4, 8, 2));  // 48 of 50
}

TEST(ValidationSet, TextAndItsChecks) {
  fs::path d = temp_dir("val_text");
  write(d / "train" / "a.txt", "the training text, long enough");
  write(d / "val.txt", "abcdefghijklmnopq");  // 17 bytes: 4 windows of seq 4
  config::DataConfig c = text_config({(d / "train").string()});
  c.val_paths = {(d / "val.txt").string()};
  io::ValidationSet v(c, 256, 2, 4, 1, 2);
  EXPECT_EQ(v.num_windows(), 4);
  EXPECT_EQ(v.describe(), "text: 17 B from 1 file, 4 of its 4 windows of 5");
  auto text_of = [](const io::HostBatch& b, int64_t row) {
    std::string s;
    for (int64_t t = 0; t < b.seq; ++t) s += static_cast<char>(b.tokens[static_cast<size_t>(row * b.seq + t)]);
    return s + static_cast<char>(b.targets[static_cast<size_t>(row * b.seq + b.seq - 1)]);
  };
  const std::vector<io::HostBatch> r0 = v.rank_batches(0), r1 = v.rank_batches(1);
  EXPECT_EQ(text_of(r0[0], 0), "abcde");
  EXPECT_EQ(text_of(r0[0], 1), "efghi");
  EXPECT_EQ(text_of(r1[0], 0), "ijklm");
  EXPECT_EQ(text_of(r1[0], 1), "mnopq");

  // A validation file that is also trained on.
  c.val_paths = {(d / "train" / "a.txt").string()};
  std::string e = error_of([&] { io::ValidationSet(c, 256, 1, 4, 1, 1); });
  EXPECT_NE(e.find("porter.data.val_paths: \"" + (d / "train" / "a.txt").string() +
                   "\" is also a training file (listed by porter.data.paths)"), std::string::npos) << e;
  c.val_paths = {(d / "missing.txt").string()};
  e = error_of([&] { io::ValidationSet(c, 256, 1, 4, 1, 1); });
  EXPECT_NE(e.find("porter.data.val_paths: \"" + (d / "missing.txt").string() + "\" does not exist"),
            std::string::npos) << e;
  c.val_paths = {(d / "val.txt").string()};
  EXPECT_THROW(io::ValidationSet(c, 128, 1, 4, 1, 1), InvalidArgument);  // text needs vocab 256
  c.type = config::DataType::kSynthetic;
  EXPECT_THROW(io::ValidationSet(c, 256, 1, 4, 1, 1), InvalidArgument);
}

TEST(ValidationSet, TokenShardChecksNameValPaths) {
  fs::path d = temp_dir("val_tokens");
  write_raw(d / "train.bin", iota_tokens(41));
  std::vector<uint16_t> val = iota_tokens(41);
  val[3] = 5000;
  write_raw(d / "val.bin", val);
  const config::DataConfig c =
      tokens_config({(d / "train.bin").string()}, 3, {(d / "val.bin").string()});
  std::string e = error_of([&] { io::ValidationSet(c, 1000, 1, 4, 1, 1); });
  EXPECT_NE(e.find("porter.data.val_paths: \"" + (d / "val.bin").string() + "\": token 3 (byte "
                   "offset 6) is id 5000, not below porter.model.vocab = 1000"), std::string::npos) << e;
}

}  // namespace
}  // namespace porter::engine
