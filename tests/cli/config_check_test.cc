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
