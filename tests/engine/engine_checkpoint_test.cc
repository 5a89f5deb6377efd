// Training checkpoints: save and resume continue bit-identically (f32 and bf16); truncated,
// corrupted and mismatched checkpoints fail with messages that say what is wrong.
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include <gmock/gmock.h>
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
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 2, bf16);
    c.scheduler = config::SchedulerConfig{};  // WarmupLR: the lr depends on the step
    c.scheduler->warmup_num_steps = 4;
    const fs::path dir = temp_dir(bf16 ? "bf16" : "f32");
    std::vector<double> expected;
    std::vector<float> expected_params;
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      for (int s = 0; s < 3; ++s) e->train_step(batches(c, s));
      e->save_checkpoint(dir);
      for (int s = 3; s < 5; ++s) expected.push_back(e->train_step(batches(c, s)).loss);
      expected_params = e->params_host();
    }
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    e->load_checkpoint(dir);
    EXPECT_EQ(e->step(), 3);
    std::vector<double> got;
    for (int s = 3; s < 5; ++s) got.push_back(e->train_step(batches(c, s)).loss);
    EXPECT_EQ(got, expected);
    EXPECT_TRUE(bitwise_equal(e->params_host(), expected_params));
    fs::remove_all(dir);
  }
}

TEST(EngineCheckpointTest, DamagedAndMismatchedCheckpointsAreRefused) {
  const config::Config c = tiny_config();
  const fs::path dir = temp_dir("damaged");
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  e->train_step(batches(c, 0));
  e->save_checkpoint(dir);
  const std::vector<float> params = e->params_host();

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
  fs::remove_all(dir);
  EXPECT_THAT(error_of<IoError>([&] { e->load_checkpoint(dir); }), HasSubstr("no such directory"));
}

}  // namespace
}  // namespace porter::engine
