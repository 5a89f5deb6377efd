// Training checkpoints: save and resume continue bit-identically (f32, bf16 and fp16 with its
// loss scaler), to the whole saved state; truncated, corrupted and mismatched checkpoints fail
// with messages that say what is wrong and load nothing. The whole-state comparison itself
// catches one flipped bit in any section and any difference in the step or loss scaler.
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;
using namespace porter::engine::testing;
namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("porter_engine_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

TEST(EngineCheckpointTest, ResumeContinuesBitIdentically) {
  for (const std::string precision : {"f32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 2, precision == "bf16");
    c.scheduler = config::SchedulerConfig{};  // WarmupLR: the lr depends on the step
    c.scheduler->warmup_num_steps = 4;
    if (precision == "fp16") {
      // A scale that overflows first, then grows every 2 clean steps: at the save the scaler
      // has skipped, lowered and raised, and the resumed run must carry all of it on.
      c.fp16.enabled = true;
      c.fp16.initial_scale_power = 22;
      c.fp16.loss_scale_window = 2;
      c.fp16.hysteresis = 1;
    }
    const fs::path dir = temp_dir(precision);
    std::vector<double> expected;
    std::vector<float> expected_params;
    SavedState expected_state;
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      for (int s = 0; s < 3; ++s) e->train_step(batches(c, s));
      e->save_checkpoint(dir);
      for (int s = 3; s < 6; ++s) expected.push_back(e->train_step(batches(c, s)).loss);
      expected_params = e->params_host();
      expected_state = saved_state(*e);
    }
    if (precision == "fp16") {
      const nlohmann::json meta = io::read_state(dir).meta;
      const int64_t applied = meta.at("optimizer_steps").get<int64_t>();
      EXPECT_GT(meta.at("loss_scaler").at("skipped").get<int64_t>(), 0) << meta.dump();
      EXPECT_GT(applied, 0) << meta.dump();
      EXPECT_GT(expected_state.optimizer_steps, applied) << expected_state.loss_scaler.dump();
    }
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    e->load_checkpoint(dir);
    EXPECT_EQ(e->step(), 3);
    std::vector<double> got;
    for (int s = 3; s < 6; ++s) got.push_back(e->train_step(batches(c, s)).loss);
    EXPECT_EQ(got, expected);
    EXPECT_TRUE(bitwise_equal(e->params_host(), expected_params));
    expect_same_state(saved_state(*e), expected_state, precision);
    fs::remove_all(dir);
  }
}

// expect_same_state fails on one flipped bit in any section, on the step and on the loss
// scaler, and on states that no step updated.
TEST(EngineCheckpointTest, TheWholeStateComparisonCatchesOneBit) {
  config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 1, /*bf16=*/true);
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  e->train_step(batches(c, 0));
  const SavedState a = saved_state(*e);
  std::vector<std::string> names;
  for (const SavedState::Section& s : a.sections) names.push_back(s.name);
  EXPECT_EQ(names, (std::vector<std::string>{"params", "master", "exp_avg", "exp_avg_sq"}));
  expect_same_state(a, a, "itself");
  for (size_t i = 0; i < a.sections.size(); ++i) {
    SavedState b = a;
    b.sections[i].bytes[b.sections[i].bytes.size() / 3] ^= std::byte{1};
    EXPECT_NONFATAL_FAILURE(expect_same_state(a, b, "flipped"),
                            b.sections[i].name + " differs in 1 of");
  }
  SavedState b = a;
  b.loss_scaler["scale"] = 2.0;
  EXPECT_NONFATAL_FAILURE(expect_same_state(a, b, "scaler"), "loss_scaler");
  b = a;
  b.step = 2;
  EXPECT_NONFATAL_FAILURE(expect_same_state(a, b, "step"), "step");
  auto fresh = gpt_engine(*device, c);
  const SavedState never = saved_state(*fresh);
  EXPECT_NONFATAL_FAILURE(expect_same_state(never, never, "fresh"), "never updated");
}

TEST(EngineCheckpointTest, DamagedAndMismatchedCheckpointsAreRefused) {
  const config::Config c = tiny_config();
  const fs::path dir = temp_dir("damaged");
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  e->train_step(batches(c, 0));
  e->save_checkpoint(dir);
  const std::vector<float> params = e->params_host();
  const SavedState state = saved_state(*e);

  // A different model: one more layer.
  {
    config::Config other = c;
    other.porter.model.layers = 2;
    auto d2 = cpu_device();
    auto e2 = gpt_engine(*d2, other);
    const std::string msg = error_of<InvalidArgument>([&] { e2->load_checkpoint(dir); });
    EXPECT_THAT(msg, HasSubstr("model layout differs"));
  }
  {
    config::Config other = c;
    other.porter.model.hidden = 64;
    auto d2 = cpu_device();
    auto e2 = gpt_engine(*d2, other);
    const std::string msg = error_of<InvalidArgument>([&] { e2->load_checkpoint(dir); });
    EXPECT_THAT(msg, HasSubstr("model layout differs at parameter 0: the checkpoint has 'wte' (64, 32)"));
    EXPECT_THAT(msg, HasSubstr("this model has 'wte' (64, 64)"));
  }
  {
    config::Config other = c;
    other.bf16.enabled = true;
    auto d2 = cpu_device();
    auto e2 = gpt_engine(*d2, other);
    const std::string msg = error_of<InvalidArgument>([&] { e2->load_checkpoint(dir); });
    EXPECT_THAT(msg, HasSubstr("compute dtype differs: the checkpoint was trained in f32"));
    EXPECT_EQ(e2->step(), 0);
  }
  // Corrupt one byte of the moments.
  {
    std::fstream f(dir / "exp_avg.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  EXPECT_THAT(error_of<IoError>([&] { e->load_checkpoint(dir); }), HasSubstr("checksum mismatch"));
  // Truncate the parameters.
  fs::resize_file(dir / "params.bin", 1000);
  EXPECT_THAT(error_of<IoError>([&] { e->load_checkpoint(dir); }), HasSubstr("truncated"));
  // Nothing was loaded by the failed attempts.
  EXPECT_EQ(e->step(), 1);
  EXPECT_TRUE(bitwise_equal(e->params_host(), params));
  expect_same_state(saved_state(*e), state, "after the refused loads");
  fs::remove_all(dir);
  EXPECT_THAT(error_of<IoError>([&] { e->load_checkpoint(dir); }), HasSubstr("no such directory"));
}

}  // namespace
}  // namespace porter::engine
