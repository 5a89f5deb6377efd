// Several --config files and --set overrides on the command line (Note [Several config files]
// in config/merge.h): a published DeepSpeed config plus a file that adds the model, messages
// that name the file (or --set) of their key, and the files recorded where the config is.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "cli/common.h"
#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::contains;
using testing::CliRun;
using testing::porter;

const fs::path kRealWorld = PORTER_REALWORLD_CONFIG_DIR;

// What a user adds to a published config: the model, the device, and the micro-batch that the
// published file leaves to the training script.
const char* kModel = R"({
  "train_micro_batch_size_per_gpu": 2,
  "porter": {
    "model": {"layers": 3, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "device": {"type": "cpu", "threads": 1}
  }
})";

class ConfigMerge : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_merge_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // A copy of a published DeepSpeed config ("auto" batch sizes, no model).
    ds_ = (dir_ / "ds_config.json").string();
    fs::copy_file(kRealWorld / "transformers__tests__deepspeed__ds_config_zero3.json", ds_);
    model_ = write("model.json", kModel);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  fs::path dir_;
  std::string ds_, model_;
};

TEST_F(ConfigMerge, APublishedConfigPlusAModelFileIsValid) {
  // Alone, the published config has no model and gets porter's default.
  CliRun alone = porter({"config", "check", "--config", ds_});
  ASSERT_EQ(alone.rc, kExitOk) << alone.err;
  EXPECT_FALSE(contains(alone.out, "porter.model.layers = 3")) << alone.out;

  CliRun r = porter({"config", "check", "--config", ds_, "--config", model_});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, ds_ + " + " + model_ + ": valid at world size 1")) << r.out;
  EXPECT_TRUE(contains(r.out, "\nporter.model.layers = 3\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "\ntrain_micro_batch_size_per_gpu = 2\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "\ntrain_batch_size = 2\n")) << r.out;  // "auto" from the others
  EXPECT_TRUE(contains(r.out, "\nzero_optimization.stage = 3\n")) << r.out;  // the published one's
  // The published file's own warning still names it.
  EXPECT_TRUE(contains(r.err, "warning: " + ds_ + ": zero_optimization."
                              "stage3_gather_fp16_weights_on_model_save: deprecated"))
      << r.err;
  // The same files as FILE arguments, or mixed, give the same config.
  CliRun positional = porter({"config", "check", ds_, model_, "--json"});
  CliRun mixed = porter({"config", "check", ds_, "--config", model_, "--json"});
  CliRun flagged = porter({"config", "check", "--config", ds_, "--config", model_, "--json"});
  ASSERT_EQ(flagged.rc, kExitOk) << flagged.err;
  EXPECT_EQ(positional.out, flagged.out);
  EXPECT_EQ(mixed.out, flagged.out);
}

TEST_F(ConfigMerge, LaterFilesWinInCommandLineOrder) {
  const std::string four = write("four.json", R"({"porter": {"model": {"layers": 4}}})");
  CliRun a = porter({"config", "check", model_, "--config", four});
  ASSERT_EQ(a.rc, kExitOk) << a.err;
  EXPECT_TRUE(contains(a.out, "\nporter.model.layers = 4\n")) << a.out;
  EXPECT_TRUE(contains(a.out, "\nporter.model.hidden = 32\n")) << a.out;  // merged, not replaced
  // --config before FILE: the FILE comes last.
  CliRun b = porter({"config", "check", "--config", four, model_});
  ASSERT_EQ(b.rc, kExitOk) << b.err;
  EXPECT_TRUE(contains(b.out, "\nporter.model.layers = 3\n")) << b.out;
}

TEST_F(ConfigMerge, AnUnknownKeyIsWarnedWithItsFilesName) {
  const std::string typo = write("typo.json", R"({"porter": {"model": {"layer": 8}}})");
  CliRun r = porter({"config", "check", "--config", ds_, "--config", model_, "--config", typo});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.err, "warning: " + typo +
                              ": porter.model.layer: unknown key, ignored (did you mean "
                              "\"layers\"?)\n"))
      << r.err;
  CliRun strict = porter({"config", "check", "--config", ds_, "--config", typo, "--strict"});
  EXPECT_EQ(strict.rc, kExitInvalid);
  EXPECT_TRUE(contains(strict.err, "\n  " + typo + ": porter.model.layer: unknown key")) << strict.err;
}

TEST_F(ConfigMerge, AnErrorNamesTheFileOfItsKey) {
  const std::string bad = write("bad.json", R"({"zero_optimization": {"stage": "two"}})");
  CliRun r = porter({"config", "check", "--config", ds_, "--config", bad, "--config", model_});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "error: " + bad +
                              ": zero_optimization.stage: expected an integer in 0..3, got "
                              "\"two\"\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, ds_ + " + " + bad + " + " + model_ + ": invalid\n")) << r.err;
  EXPECT_EQ(r.out, "");
}

TEST_F(ConfigMerge, ASyntaxErrorInTheSecondFileNamesItWithLineAndColumn) {
  const std::string broken = write("broken.json", "{\n  \"porter\": [1,\n}");
  CliRun r = porter({"config", "check", "--config", ds_, "--config", broken});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "error: " + broken + ": malformed JSON at line 3, column 1")) << r.err;
  const std::string twice = write("twice.json", "{\"porter\": {},\n \"porter\": {}}");
  CliRun d = porter({"config", "check", ds_, twice});
  EXPECT_EQ(d.rc, kExitInvalid);
  EXPECT_TRUE(contains(d.err, "error: " + twice + ": porter: duplicate key \"porter\" at line 2, "
                              "column 2"))
      << d.err;
  CliRun missing = porter({"config", "check", ds_, (dir_ / "nope.json").string()});
  EXPECT_EQ(missing.rc, kExitInvalid);
  EXPECT_TRUE(contains(missing.err, "error: " + (dir_ / "nope.json").string() +
                                        ": cannot read config file"))
      << missing.err;
}

TEST_F(ConfigMerge, SetOverridesAKeyAndIsNamedInMessages) {
  CliRun r = porter({"config", "check", ds_, model_, "--set", "porter.model.layers=8", "--set",
                     "porter.checkpointing.policy=uniform", "--set",
                     "porter.checkpointing.every_n_layers=2", "--set", "optimizer.params.lr=1e-4"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, "\nporter.model.layers = 8\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "\nporter.checkpointing.policy = \"uniform\"\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "\noptimizer.params.lr = 0.0001\n")) << r.out;

  CliRun bad = porter({"config", "check", ds_, model_, "--set", "zero_optimization.stage=two"});
  EXPECT_EQ(bad.rc, kExitInvalid);
  EXPECT_TRUE(contains(bad.err, "error: --set zero_optimization.stage: zero_optimization.stage: "
                                "expected an integer in 0..3, got \"two\"\n"))
      << bad.err;
  // Note [Set keys]: a typo given with --set is an error, not a warning.
  CliRun typo = porter({"config", "check", ds_, model_, "--set", "porter.model.layer=8"});
  EXPECT_EQ(typo.rc, kExitInvalid);
  EXPECT_TRUE(contains(typo.err, "error: --set porter.model.layer: porter.model.layer: unknown "
                                 "key (did you mean \"layers\"?); a key given with --set must be "
                                 "one porter reads (a key in a config file is only warned "
                                 "about)\n"))
      << typo.err;
  EXPECT_EQ(typo.out, "");
  CliRun through = porter({"config", "check", ds_, model_, "--set", "porter.model.layers.x=1"});
  EXPECT_EQ(through.rc, kExitInvalid);
  EXPECT_TRUE(contains(through.err, "error: --set porter.model.layers.x: porter.model.layers: 3 "
                                    "(from " + model_ + ") is not a JSON object"))
      << through.err;
}

// Every command that takes --set refuses an unknown, misspelt or wrongly typed key with exit
// code 2, naming the flag, the key, the rule and the closest known key.
TEST_F(ConfigMerge, ASetTypoIsAnErrorInEveryCommand) {
  const std::string typo_error =
      "error: --set zero_optimisation.stage: zero_optimisation: unknown key (did you mean "
      "\"zero_optimization\"?); a key given with --set must be one porter reads";
  const std::string type_error =
      "error: --set porter.model.layers: porter.model.layers: expected an integer in 1..100000, "
      "got \"eight\"";
  const std::vector<std::vector<std::string>> commands = {
      {"config", "check", ds_, model_},
      {"train", "--config", ds_, "--config", model_, "--steps", "1"},
      {"estimate", "--config", ds_, "--config", model_},
      {"plan", "--config", ds_, "--config", model_},
      {"stress", "--config", ds_, "--config", model_, "--runs", "1"},
  };
  for (const std::vector<std::string>& command : commands) {
    SCOPED_TRACE(command[0]);
    std::vector<std::string> typo = command;
    typo.insert(typo.end(), {"--set", "zero_optimisation.stage=3"});
    CliRun r = porter(typo);
    EXPECT_EQ(r.rc, kExitInvalid) << r.err;
    EXPECT_TRUE(contains(r.err, typo_error)) << r.err;
    std::vector<std::string> wrong = command;
    wrong.insert(wrong.end(), {"--set", "porter.model.layers=eight"});
    CliRun w = porter(wrong);
    EXPECT_EQ(w.rc, kExitInvalid) << w.err;
    EXPECT_TRUE(contains(w.err, type_error)) << w.err;
  }
  // The same key in a file is a warning, and the run goes on.
  const std::string file_typo = write("typo.json", R"({"zero_optimisation": {"stage": 3}})");
  CliRun f = porter({"config", "check", ds_, model_, file_typo});
  EXPECT_EQ(f.rc, kExitOk) << f.err;
  EXPECT_TRUE(contains(f.err, "warning: " + file_typo + ": zero_optimisation: unknown key, "
                              "ignored (did you mean \"zero_optimization\"?)\n"))
      << f.err;
}

TEST_F(ConfigMerge, AMalformedSetIsAUsageError) {
  for (const std::string set : {"porter.model.layers", "=8", "a..b=1"}) {
    SCOPED_TRACE(set);
    CliRun r = porter({"config", "check", ds_, "--set", set});
    EXPECT_EQ(r.rc, kExitUsage);
    EXPECT_TRUE(contains(r.err, "--set: \"" + set + "\": ")) << r.err;
  }
  CliRun r = porter({"plan", "--config", ds_, "--set", "porter.model.layers"});
  EXPECT_EQ(r.rc, kExitUsage);
  EXPECT_TRUE(contains(r.err, "expected key.path=VALUE (no \"=\" found)")) << r.err;
  // Each --config takes one file.
  EXPECT_EQ(porter({"plan", "--config", ds_, model_}).rc, kExitUsage);
  EXPECT_EQ(porter({"config", "check", "--set", "a=1"}).rc, kExitUsage);
}

TEST_F(ConfigMerge, PlanRecordsEveryFileAndTheSets) {
  CliRun r = porter({"plan", "--config", ds_, "--config", model_, "--set",
                     "porter.model.layers=2", "--set", "zero_optimization.stage=2", "--set",
                     "zero_optimization.offload_param=null", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["config"], ds_ + " + " + model_ + " + --set porter.model.layers=2 + --set "
                         "zero_optimization.stage=2 + --set zero_optimization.offload_param=null");
  // The plan is of the 2-layer model --set asked for, not the file's 3.
  CliRun three = porter({"plan", "--config", ds_, "--config", model_, "--json"});
  ASSERT_EQ(three.rc, kExitOk) << three.err;
  EXPECT_EQ(json::parse(three.out)["stages"].size(), j["stages"].size() + 1);

  CliRun text = porter({"plan", "--config", ds_, "--config", model_});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "porter plan: " + ds_ + " + " + model_ + "\n")) << text.out;
}

// The implied world size (Note [Implied world size]) comes from the merged batch sizes: the
// published file's train_batch_size 16 over the added micro-batch 4 is 4 ranks.
TEST_F(ConfigMerge, EstimateImpliesTheWorldSizeOfTheMergedConfig) {
  const std::string ds2 = (dir_ / "ds_zero2.json").string();
  fs::copy_file(kRealWorld / "deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json", ds2);
  CliRun alone = porter({"estimate", "--config", ds2, "--json"});
  ASSERT_EQ(alone.rc, kExitOk) << alone.err;
  EXPECT_EQ(json::parse(alone.out)["world_size"], 1);
  CliRun r = porter({"estimate", "--config", ds2, "--config", model_, "--set",
                     "train_micro_batch_size_per_gpu=4", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["model"]["layers"], 3);
  EXPECT_EQ(j["config"], ds2 + " + " + model_ + " + --set train_micro_batch_size_per_gpu=4");
  // A rule across the files names both.
  CliRun bad = porter({"estimate", "--config", ds2, "--config", model_, "--world-size", "3"});
  EXPECT_EQ(bad.rc, kExitInvalid);
  EXPECT_TRUE(contains(bad.err, "error: " + ds2 + " + " + model_ + ": train_batch_size: 16 ")) << bad.err;
}

TEST_F(ConfigMerge, TrainShowsEveryFile) {
  const std::string ds2 = (dir_ / "ds_zero2.json").string();
  fs::copy_file(kRealWorld / "deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json", ds2);
  const std::string report = (dir_ / "r.json").string();
  CliRun r = porter({"train", "--config", ds2, "--config", model_, "--set", "train_batch_size=2",
                     "--set", "porter.model.layers=1", "--steps", "1", "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const std::string shown =
      ds2 + " + " + model_ + " + --set train_batch_size=2 + --set porter.model.layers=1";
  EXPECT_TRUE(contains(r.out, "porter train: " + shown + "\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "model: GPT, 1 layers")) << r.out;
  std::ifstream in(report);
  EXPECT_EQ(json::parse(in)["config"], shown);
}

TEST_F(ConfigMerge, StressRecordsEveryFile) {
  const std::string ds2 = (dir_ / "ds_zero2.json").string();
  fs::copy_file(kRealWorld / "deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json", ds2);
  CliRun r = porter({"stress", "--config", ds2, "--config", model_, "--set", "train_batch_size=2",
                     "--runs", "1", "--steps", "1", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(json::parse(r.out)["config"], ds2 + " + " + model_ + " + --set train_batch_size=2");
}

TEST(ConfigArgs, DisplayAndCommandArgs) {
  const ConfigArgs one{{"ds.json"}, {}};
  EXPECT_EQ(one.display(), "ds.json");
  EXPECT_EQ(one.command_args(), "--config ds.json");
  const ConfigArgs many{{"ds.json", "my dir/model.json"},
                        {"porter.model.layers=8", "porter.model={\"heads\": 2}", "a='b'"}};
  EXPECT_EQ(many.display(), "ds.json + my dir/model.json + --set porter.model.layers=8 + --set "
                            "porter.model={\"heads\": 2} + --set a='b'");
  EXPECT_EQ(many.command_args(),
            "--config ds.json --config 'my dir/model.json' --set porter.model.layers=8 --set "
            "'porter.model={\"heads\": 2}' --set 'a='\\''b'\\'''");
}

}  // namespace
}  // namespace porter::cli
