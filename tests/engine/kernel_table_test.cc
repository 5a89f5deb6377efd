// The engine's kernel table (Note [Kernel table] in kernels/kernel_table.cc): measured at a size
// above the measurement threshold, carried by training checkpoints, pinned by a resume and
// by porter.device.kernel_table (a checkpoint, a report or a bare table).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "base/error.h"
#include "engine_test_util.h"
#include "kernels/kernel_table.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::batches;
using testing::cpu_device;
using testing::gpt_engine;

// Hidden 256 and 512 tokens per micro-batch: the qkv, MLP and head products (2 x 512 x 256 x
// 768 flops and up) are above the 2^27 flops under which nothing is measured.
config::Config measured_config() {
  config::Config c = testing::tiny_config(config::CheckpointPolicy::kNone, 0.0, 1);
  c.train_micro_batch_size_per_gpu = 4;
  c.train_batch_size = 4;
  c.porter.model.layers = 1;
  c.porter.model.hidden = 256;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = 128;
  c.porter.model.vocab = 256;
  return c;
}

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("porter_kernel_table_" + name);
  fs::remove_all(p);
  return p;
}

// (kind, key, choice) of every entry: what decides how the kernels compute.
std::vector<std::string> choices(const kernels::KernelTable& t) {
  std::vector<std::string> out;
  const nlohmann::json table = t.to_json();
  for (const nlohmann::json& e : table.at("entries")) {
    out.push_back(e.at("kind").get<std::string>() + " | " + e.at("key").get<std::string>() +
                  " | " + e.at("choice").get<std::string>());
  }
  return out;
}

TEST(KernelTableEngineTest, CheckpointCarriesTheTableAndAResumePinsIt) {
  const config::Config c = measured_config();
  auto device = cpu_device(size_t{1} << 30);
  const fs::path dir = temp_dir("resume");
  std::vector<std::string> saved;
  {
    auto eng = gpt_engine(*device, c);
    EXPECT_EQ(eng->kernel_table().origin(), "measured in this run");
    eng->train_step(batches(c, 0));
    EXPECT_GT(eng->kernel_table().count(kernels::KernelTable::Source::kMeasured), 0u);
    saved = choices(eng->kernel_table());
    eng->save_checkpoint(dir);
  }
  auto resumed = gpt_engine(*device, c);
  resumed->load_checkpoint(dir);
  EXPECT_EQ(resumed->kernel_table().origin(), "resumed from " + dir.string());
  EXPECT_FALSE(saved.empty());
  EXPECT_EQ(choices(resumed->kernel_table()), saved);
  EXPECT_EQ(resumed->kernel_table().count(kernels::KernelTable::Source::kPinned), saved.size());
  fs::remove_all(dir);
}

TEST(KernelTableEngineTest, ConfigPinsATableFromACheckpointAReportOrATable) {
  config::Config c = measured_config();
  auto device = cpu_device(size_t{1} << 30);
  const fs::path dir = temp_dir("pin");
  nlohmann::json table;
  {
    auto eng = gpt_engine(*device, c);
    eng->train_step(batches(c, 0));
    table = eng->kernel_table().to_json();
    eng->save_checkpoint(dir / "ckpt");
  }
  std::ofstream(dir / "report.json") << nlohmann::json{{"losses", {1.0}}, {"kernel_table", table}};
  std::ofstream(dir / "table.json") << table;
  for (const fs::path& source : {dir / "ckpt", dir / "report.json", dir / "table.json"}) {
    SCOPED_TRACE(source.string());
    c.porter.device.kernel_table = source.string();
    auto eng = gpt_engine(*device, c);
    EXPECT_EQ(eng->kernel_table().origin(), "pinned from " + source.string());
    EXPECT_EQ(eng->kernel_table().to_json().at("entries").size(), table.at("entries").size());
    // A pinned table wins over the one a resumed checkpoint holds.
    eng->load_checkpoint(dir / "ckpt");
    EXPECT_EQ(eng->kernel_table().origin(), "pinned from " + source.string());
  }
  c.porter.device.kernel_table = (dir / "missing.json").string();
  try {
    gpt_engine(*device, c);
    FAIL() << "a missing kernel table was accepted";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("missing.json: cannot read the kernel table"));
  }
  std::ofstream(dir / "other.json") << R"({"losses": [1.0]})";
  c.porter.device.kernel_table = (dir / "other.json").string();
  try {
    gpt_engine(*device, c);
    FAIL() << "a file without a kernel table was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("other.json: holds no kernel table"));
  }
  fs::remove_all(dir);
}

// kernel_choice reaches the kernels, and exact records no choice that changes bits.
TEST(KernelTableEngineTest, KernelChoiceReachesTheKernels) {
  config::Config c = measured_config();
  auto device = cpu_device(size_t{1} << 30);
  auto exact = gpt_engine(*device, c);
  EXPECT_EQ(exact->kernel_table().mode(), kernels::KernelChoice::kExact);
  exact->train_step(batches(c, 0));
  const nlohmann::json table = exact->kernel_table().to_json();
  EXPECT_FALSE(table.at("entries").empty());
  for (const nlohmann::json& e : table.at("entries")) {
    EXPECT_THAT(e.at("choice").get<std::string>(),
                ::testing::AnyOf("plain", "blocked", "rows", "tiles"))
        << e.at("key");
  }
  c.porter.device.kernel_choice = config::KernelChoice::kFastest;
  auto fastest = gpt_engine(*device, c);
  EXPECT_EQ(fastest->kernel_table().mode(), kernels::KernelChoice::kFastest);
  EXPECT_EQ(fastest->kernel_table().to_json().at("kernel_choice"), "fastest");
}

}  // namespace
}  // namespace porter::engine
