// `porter config check` run in-process: exit codes, what goes to stdout and to stderr.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/app.h"
#include "tests/cli/cli_test_util.h"
#include "config/parse.h"

namespace porter::cli {
namespace {

using testing::contains;
using testing::CliRun;
using testing::porter;

const std::filesystem::path kRealWorld = PORTER_REALWORLD_CONFIG_DIR;

std::string write_temp(const std::string& name, const std::string& text) {
  std::filesystem::path p = std::filesystem::temp_directory_path() / ("porter_cli_test_" + name);
  std::ofstream(p) << text;
  return p.string();
}

TEST(ConfigCheck, EveryRealWorldConfigIsValid) {
  for (const auto& entry : std::filesystem::directory_iterator(kRealWorld)) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    CliRun r = porter({"config", "check", entry.path().string()});
    EXPECT_EQ(r.rc, kExitOk) << r.err;
    EXPECT_TRUE(contains(r.out, "valid at world size 1")) << r.out;
    EXPECT_TRUE(contains(r.out, "zero_optimization.stage = ")) << r.out;
  }
}

TEST(ConfigCheck, WarningsGoToStderr) {
  CliRun r = porter({"config", "check",
                  (kRealWorld / "deepspeedexamples__megatron-lm__scripts__ds_zero-offload_10b_config.json").string()});
  EXPECT_EQ(r.rc, kExitOk);
  EXPECT_TRUE(contains(r.err, "warning: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "zero_optimization.comm_overlap: unknown key, ignored (did you mean "
                              "\"overlap_comm\"?)"))
      << r.err;
  EXPECT_FALSE(contains(r.out, "warning: ")) << r.out;
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

// Note [Fixed behaviour] in config/parse.h: each fixed key is noted once, on stderr, after the
// warnings; both nvme_path keys in one note.
TEST(ConfigCheck, FixedKeysAreNotedOnceEach) {
  const std::string file =
      (kRealWorld /
       "deepspeedexamples__megatron-lm-v1.1.5-zero3__examples__ds_zero_stage_infinity_config.json")
          .string();
  CliRun r = porter({"config", "check", file});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(count(r.err, "note: "), 4u) << r.err;
  EXPECT_TRUE(contains(r.err, "\nnote: " + file +
                                  ": zero_optimization.contiguous_gradients: porter always keeps "
                                  "gradients contiguous: they accumulate in one flat buffer (at "
                                  "ZeRO stages 2 and 3, the rank's gradient shard), whatever the "
                                  "value (the key has no effect)\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "\nnote: " + file +
                                  ": zero_optimization.sub_group_size: porter's AdamW steps the "
                                  "rank's whole optimizer shard at once"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "\nnote: " + file +
                                  ": zero_optimization.offload_optimizer.nvme_path: porter has no "
                                  "NVMe offload, so the path is not used (nor "
                                  "zero_optimization.offload_param.nvme_path); offload to host "
                                  "memory instead, with \"device\": \"cpu\"\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "\nnote: " + file + ": porter.model: not given, so porter trains its "
                                  "default model, a GPT of 12 layers, hidden 768"))
      << r.err;
  EXPECT_EQ(count(r.err, "nvme_path"), 2u) << r.err;  // one note names both
  EXPECT_FALSE(contains(r.out, "note: ")) << r.out;

  // Notes are not warnings: --strict accepts a config that has only notes.
  const std::string quiet = write_temp("notes_only.json", R"({"train_batch_size": 2,
      "zero_optimization": {"stage": 2, "contiguous_gradients": false, "sub_group_size": 1e9},
      "porter": {"model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64}}})");
  CliRun strict = porter({"config", "check", quiet, "--strict"});
  EXPECT_EQ(strict.rc, kExitOk) << strict.err;
  EXPECT_TRUE(contains(strict.out, "(0 warnings)")) << strict.out;
  EXPECT_EQ(count(strict.err, "note: "), 2u) << strict.err;
  EXPECT_FALSE(contains(strict.err, "warning: ")) << strict.err;
  // Without the keys, nothing is noted.
  const std::string plain = write_temp("no_notes.json", R"({"train_batch_size": 2,
      "zero_optimization": {"stage": 2},
      "porter": {"model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64}}})");
  CliRun none = porter({"config", "check", plain});
  EXPECT_EQ(none.rc, kExitOk) << none.err;
  EXPECT_EQ(none.err, "");
}

TEST(ConfigCheck, JsonOutputIsTheResolvedConfig) {
  const std::string file = (kRealWorld / "transformers__tests__deepspeed__ds_config_zero3.json").string();
  CliRun r = porter({"config", "check", file, "--json", "--world-size", "4"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  config::ParseResult direct = config::parse_config_file(file, config::ParseOptions{4, false});
  EXPECT_EQ(r.out, config::to_json_string(direct.config) + "\n");
  // What it printed is itself a valid config, equal to the original's resolution.
  config::ParseResult printed = config::parse_config_string(r.out, config::ParseOptions{4, true});
  EXPECT_EQ(printed.config, direct.config);
}

TEST(ConfigCheck, InvalidConfigExitsTwoWithTheError) {
  std::string file = write_temp("invalid.json", R"({"train_batch_size": 8,
      "zero_optimization": {"stage": "two"}})");
  CliRun r = porter({"config", "check", file});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "zero_optimization.stage: expected an integer in 0..3, got \"two\""))
      << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(ConfigCheck, MalformedAndEmptyFilesExitTwo) {
  CliRun malformed = porter({"config", "check", write_temp("malformed.json", "{\n  \"a\": [1,\n}")});
  EXPECT_EQ(malformed.rc, kExitInvalid);
  EXPECT_TRUE(contains(malformed.err, "malformed JSON at line 3, column 1")) << malformed.err;
  CliRun empty = porter({"config", "check", write_temp("empty.json", "")});
  EXPECT_EQ(empty.rc, kExitInvalid);
  EXPECT_TRUE(contains(empty.err, "empty")) << empty.err;
}

TEST(ConfigCheck, StrictTurnsWarningsIntoErrors) {
  std::string file = write_temp("typo.json", R"({"train_batch_size": 8, "gradient_cliping": 1})");
  EXPECT_EQ(porter({"config", "check", file}).rc, kExitOk);
  CliRun strict = porter({"config", "check", file, "--strict"});
  EXPECT_EQ(strict.rc, kExitInvalid);
  EXPECT_TRUE(contains(strict.err, "did you mean \"gradient_clipping\"")) << strict.err;
}

TEST(ConfigCheck, WorldSizeIsChecked) {
  std::string file = write_temp("batch.json", R"({"train_batch_size": 8, "gradient_accumulation_steps": 2})");
  EXPECT_EQ(porter({"config", "check", file, "--world-size", "4"}).rc, kExitOk);
  CliRun bad = porter({"config", "check", file, "--world-size", "3"});
  EXPECT_EQ(bad.rc, kExitInvalid);
  EXPECT_TRUE(contains(bad.err, "world size 3")) << bad.err;
  EXPECT_EQ(porter({"config", "check", file, "--world-size", "0"}).rc, kExitUsage);
  EXPECT_EQ(porter({"config", "check", file, "--world-size", "two"}).rc, kExitUsage);
}

TEST(ConfigCheck, UsageErrorsAndHelp) {
  EXPECT_EQ(porter({}).rc, kExitUsage);
  EXPECT_EQ(porter({"config"}).rc, kExitUsage);
  EXPECT_EQ(porter({"config", "check"}).rc, kExitUsage);
  EXPECT_EQ(porter({"config", "check", "a.json", "--bogus"}).rc, kExitUsage);
  CliRun help = porter({"config", "check", "--help"});
  EXPECT_EQ(help.rc, kExitOk);
  EXPECT_TRUE(contains(help.out, "--strict")) << help.out;
  CliRun version = porter({"--version"});
  EXPECT_EQ(version.rc, kExitOk);
  EXPECT_TRUE(contains(version.out, "porter 0.")) << version.out;
}

}  // namespace
}  // namespace porter::cli
