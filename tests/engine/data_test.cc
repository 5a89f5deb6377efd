// DataSource: determinism per (seed, step, micro-batch), shifted targets, text windows taken
// from the corpus, and the errors for bad paths, vocab and corpus size.
#include "engine/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "base/error.h"

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
  DataSource a(c, 50, 2, 8), b(c, 50, 2, 8);
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
  EXPECT_NE(x[0].tokens, DataSource(c, 50, 2, 8).step_batches(3, 1)[0].tokens);
  // A step's micro-batch does not depend on how many micro-batches were asked for.
  EXPECT_EQ(a.step_batches(3, 1)[0].tokens, x[0].tokens);
  EXPECT_EQ(a.describe(), "synthetic (seed 11, vocab 50)");
}

TEST(DataSource, TextWindowsComeFromTheCorpusInSortedOrder) {
  fs::path d = temp_dir("text");
  write(d / "b.txt", "BBBBBBBBBB");
  write(d / "a" / "x.txt", "0123456789");
  write(d / ".hidden", "zzzzzzzzzz");
  DataSource src(text_config({d.string()}), 256, 3, 4);
  EXPECT_EQ(src.corpus_bytes(), 20u);
  EXPECT_EQ(src.describe(), "text: 20 B from 2 files");
  const std::string corpus = "0123456789BBBBBBBBBB";
  auto batches = src.step_batches(0, 2);
  for (const HostBatch& b : batches) {
    for (int64_t r = 0; r < 3; ++r) {
      std::string window;
      for (int64_t t = 0; t < 4; ++t) window += static_cast<char>(b.tokens[r * 4 + t]);
      window += static_cast<char>(b.targets[r * 4 + 3]);
      EXPECT_NE(corpus.find(window), std::string::npos) << window;
      for (int64_t t = 0; t + 1 < 4; ++t) EXPECT_EQ(b.targets[r * 4 + t], b.tokens[r * 4 + t + 1]);
    }
  }
  DataSource again(text_config({d.string()}), 256, 3, 4);
  EXPECT_EQ(again.step_batches(0, 2)[1].tokens, batches[1].tokens);
}

TEST(DataSource, FilesAndDirectoriesMix) {
  fs::path d = temp_dir("mix");
  write(d / "one.txt", "hello world, ");
  write(d / "dir" / "two.txt", "and more text");
  DataSource src(text_config({(d / "one.txt").string(), (d / "dir").string()}), 256, 1, 8);
  EXPECT_EQ(src.corpus_bytes(), 26u);
  EXPECT_EQ(src.describe(), "text: 26 B from 2 files");
}

TEST(DataSource, Errors) {
  fs::path d = temp_dir("errors");
  write(d / "short.txt", "abc");
  const std::string missing = (d / "nope").string();
  std::string e = error_of([&] { DataSource(text_config({missing}), 256, 1, 4); });
  EXPECT_NE(e.find("porter.data.paths: \"" + missing + "\" does not exist"), std::string::npos) << e;
  EXPECT_THROW(DataSource(text_config({missing}), 256, 1, 4), IoError);

  e = error_of([&] { DataSource(text_config({d.string()}), 128, 1, 2); });
  EXPECT_NE(e.find("porter.model.vocab: text data is byte-level and needs a vocab of at least "
                   "256, got 128"), std::string::npos) << e;
  EXPECT_THROW(DataSource(text_config({d.string()}), 128, 1, 2), InvalidArgument);

  e = error_of([&] { DataSource(text_config({d.string()}), 256, 1, 3); });
  EXPECT_NE(e.find("the text corpus has 3 bytes, fewer than seq_len + 1 = 4"), std::string::npos) << e;
  EXPECT_THROW(DataSource(text_config({d.string()}), 256, 1, 3), InvalidArgument);
  EXPECT_NO_THROW(DataSource(text_config({d.string()}), 256, 1, 2));

  EXPECT_THROW(DataSource(text_config({}), 256, 1, 2), InvalidArgument);
}

}  // namespace
}  // namespace porter::engine
