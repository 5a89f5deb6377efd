// porter's first promise where users meet it: memory settings, resume and repetition never
// change the training state, at a real size (hidden 768, seq 256, every product above the
// kernels' measurement threshold of 2^27 flops), in separate `porter train` processes, on one
// and two ranks, with default settings and no environment variables. Each pair of runs is
// compared by the whole state `--save` writes (working parameters, f32 master, both AdamW
// moments, loss scaler and step), bit for bit.
//
// Note [Exact suite cost]: most of a run's cost here does not depend on its steps (building
// and profiling the model, timing the kernel candidates, saving: about ten seconds of CPU on
// a 2-core machine), so the suite keeps its runs few and short: 2 steps (1 + 1 resumed),
// micro-batch 2 (the smallest that keeps every product above 2^27), and one run serving as
// the reference of several checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/state_file.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A 2-layer transformer at hidden 768 and seq 256 with micro-batch 2: its smallest products
// (the head's, 512 x 256 x 768, and its weight gradient) are 0.2 GFLOP and the attention
// call 0.2 GFLOP, all above 2^27 (expect_whole_state checks that no choice was fixed for
// being under it); dropout 0.1 so the Philox masks are exercised too. 2 kernel threads on
// one rank, 1 on each of two (a 2-core machine).
nlohmann::json real_size_config(const std::string& arch, bool bf16) {
  nlohmann::json model = {{"arch", arch}, {"layers", 2},    {"hidden", 768},
                          {"heads", 12},  {"seq_len", 256}, {"vocab", 256},
                          {"dropout", arch == "gpt" ? 0.1 : 0.0}};
  if (arch == "llama") model["kv_heads"] = 4;
  nlohmann::json c = {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 1},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
      {"porter",
       {{"model", model},
        {"data", {{"type", "synthetic"}, {"seed", 1}}},
        {"device", {{"type", "cpu"}, {"threads", 2}}},
        {"checkpointing", {{"policy", "full"}}},
        {"train", {{"steps", 2}, {"seed", 42}, {"log_every", 1}}}}}};
  if (bf16) c["bf16"] = {{"enabled", true}};
  return c;
}

class ExactTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("porter_exact_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  fs::path write_config(const std::string& name, const nlohmann::json& c) {
    const fs::path p = dir_ / (name + ".json");
    std::ofstream(p) << c.dump(2);
    return p;
  }

  // `porter train --config <config> <args>` as its own process, with no PORTER_* variable
  // that forces a kernel; returns its output (and fails the test on a nonzero exit).
  std::string train(const fs::path& config, const std::string& args, const std::string& tag) {
    const fs::path log = dir_ / (tag + ".log");
    const std::string cmd = "env -u PORTER_MATMUL_LAYOUT -u PORTER_CPU_ATTENTION " +
                            std::string(PORTER_EXE) + " train --config " + config.string() + " " +
                            args + " > " + log.string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(log);
    std::stringstream out;
    out << in.rdbuf();
    EXPECT_EQ(rc, 0) << cmd << "\n" << out.str();
    return out.str();
  }

  fs::path dir_;
};

// Every section and the optimizer's counters of two checkpoints (one rank's directory each),
// bit for bit; `a_range`, when given, is the element range of b's params that a's params (a
// ZeRO-3 shard) hold.
void expect_same_state(const fs::path& a_dir, const fs::path& b_dir, bool a_is_shard = false) {
  SCOPED_TRACE(a_dir.string() + " against " + b_dir.string());
  const io::LoadedState a = io::read_state(a_dir);
  const io::LoadedState b = io::read_state(b_dir);
  for (const char* key : {"step", "optimizer_steps", "loss_scaler", "compute_dtype", "layout"}) {
    EXPECT_EQ(a.meta.at(key), b.meta.at(key)) << key;
  }
  ASSERT_EQ(a.sections.size(), b.sections.size());
  for (const io::StateSection& sa : a.sections) {
    const io::StateSection& sb = b.section(sa.name);
    if (sa.name == "params" && a_is_shard) {
      const int64_t begin = a.meta.at("params_range").at(0).get<int64_t>();
      const size_t elem = sb.bytes.size() / b.meta.at("layout").at("total_elems").get<size_t>();
      ASSERT_GE(sb.bytes.size(), (static_cast<size_t>(begin) * elem) + sa.bytes.size());
      EXPECT_TRUE(std::equal(sa.bytes.begin(), sa.bytes.end(),
                             sb.bytes.begin() + static_cast<std::ptrdiff_t>(begin * elem)))
          << "params shard differs";
      continue;
    }
    ASSERT_EQ(sa.bytes.size(), sb.bytes.size()) << sa.name;
    size_t differ = 0;
    for (size_t i = 0; i < sa.bytes.size(); ++i) differ += sa.bytes[i] != sb.bytes[i] ? 1 : 0;
    EXPECT_EQ(differ, 0u) << "section " << sa.name << ": " << differ << " of " << sa.bytes.size()
                          << " bytes differ";
  }
}

// The sections a whole training state has: the moments always, the master in bf16; and a
// kernel table in which every problem was a real-size one (none fixed for being under the
// measurement threshold) unless `all_measured` is false.
void expect_whole_state(const fs::path& dir, bool bf16, bool all_measured = true) {
  const io::LoadedState s = io::read_state(dir);
  std::vector<std::string> names;
  for (const io::StateSection& sec : s.sections) names.push_back(sec.name);
  EXPECT_THAT(names, ::testing::IsSupersetOf({"params", "exp_avg", "exp_avg_sq"}));
  if (bf16) {
    EXPECT_THAT(names, ::testing::Contains("master"));
  }
  EXPECT_EQ(s.meta.at("optimizer_steps"), s.meta.at("step"));  // every step was applied
  ASSERT_TRUE(s.meta.contains("kernel_table"));
  EXPECT_FALSE(s.meta.at("kernel_table").at("entries").empty());
  if (!all_measured) return;
  for (const nlohmann::json& e : s.meta.at("kernel_table").at("entries")) {
    EXPECT_THAT(e.at("detail").get<std::string>(), ::testing::Not(HasSubstr("under 2^27")))
        << e.at("key");
  }
}

// Optimizer offload (ZeRO-2 with AdamW on the host, in pinned memory) gives the state of the
// device's update, bit for bit, each run measuring its own kernel choices in its own process.
// Repeating and resuming a GPT run at this size, on two ranks with dropout, is
// tests/cli/restart_test.sh's (the cli.restart test): a run killed and restarted, or stopped
// by SIGTERM and resumed, ends in the uninterrupted run's state.
TEST_F(ExactTest, GptOptimizerOffloadGivesTheDevicesState) {
  nlohmann::json c = real_size_config("gpt", false);
  const fs::path cfg = write_config("gpt", c);
  c["zero_optimization"] = {{"stage", 2},
                            {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}}};
  const fs::path offload = write_config("offload", c);
  const std::string out = train(cfg, "--save " + (dir_ / "a").string(), "a");
  EXPECT_THAT(out, HasSubstr("kernel choices: exact"));
  train(offload, "--save " + (dir_ / "offload").string(), "offload");
  expect_whole_state(dir_ / "a", false);
  expect_same_state(dir_ / "offload", dir_ / "a");
}

// The same for a Llama (grouped-query attention, RMSNorm, SwiGLU) in bf16: the master copy is
// compared too.
TEST_F(ExactTest, LlamaBf16RepeatAndResumeGiveOneState) {
  const fs::path cfg = write_config("llama", real_size_config("llama", true));
  train(cfg, "--save " + (dir_ / "a").string(), "a");
  train(cfg, "--steps 1 --save " + (dir_ / "half").string(), "half");
  train(cfg, "--resume " + (dir_ / "half").string() + " --save " + (dir_ / "resumed").string(),
        "resumed");
  expect_whole_state(dir_ / "a", true);
  expect_same_state(dir_ / "a", dir_ / "resumed");
}

// ZeRO stage 2 against stage 3 on two ranks (separate processes, Gloo): every rank's master
// and moments, and its params (stage 3 holds a shard of them), bit for bit. The two ranks
// end with one kernel table (Note [Kernel table agreement]).
TEST_F(ExactTest, ZeroStage2And3OnTwoRanksGiveOneState) {
  nlohmann::json c = real_size_config("gpt", false);
  c["porter"]["device"]["threads"] = 1;
  c["zero_optimization"] = {{"stage", 2}};
  const fs::path two = write_config("stage2", c);
  c["zero_optimization"] = {{"stage", 3}};
  const fs::path three = write_config("stage3", c);
  train(two, "--nproc 2 --save " + (dir_ / "s2").string(), "s2");
  train(three, "--nproc 2 --save " + (dir_ / "s3").string(), "s3");
  for (const char* rank : {"rank0", "rank1"}) {
    expect_whole_state(dir_ / "s2" / rank, false);
    expect_same_state(dir_ / "s3" / rank, dir_ / "s2" / rank, /*a_is_shard=*/true);
  }
  const nlohmann::json t0 = io::read_state(dir_ / "s2" / "rank0").meta.at("kernel_table");
  const nlohmann::json t1 = io::read_state(dir_ / "s2" / "rank1").meta.at("kernel_table");
  ASSERT_EQ(t0.at("entries").size(), t1.at("entries").size());
  for (size_t i = 0; i < t0.at("entries").size(); ++i) {
    EXPECT_EQ(t0.at("entries")[i].at("key"), t1.at("entries")[i].at("key"));
    EXPECT_EQ(t0.at("entries")[i].at("choice"), t1.at("entries")[i].at("choice"));
  }
}

// Flash attention (porter.model.attention "flash") on two ranks: a run that keeps every
// activation and one that recomputes every block end in one state, bit for bit, for a
// grouped-query Llama in bf16 (the recompute runs the same flash kernel on the same input).
TEST_F(ExactTest, FlashAttentionAcrossPoliciesOnTwoRanksGivesOneState) {
  nlohmann::json c = real_size_config("llama", true);
  c["porter"]["model"]["attention"] = "flash";
  c["porter"]["device"]["threads"] = 1;
  c["zero_optimization"] = {{"stage", 2}};
  c["porter"]["checkpointing"]["policy"] = "none";
  const fs::path none = write_config("none", c);
  c["porter"]["checkpointing"]["policy"] = "full";
  const fs::path full = write_config("full", c);
  const std::string out = train(none, "--nproc 2 --save " + (dir_ / "none").string(), "none");
  EXPECT_THAT(out, HasSubstr("flash attention"));
  train(full, "--nproc 2 --save " + (dir_ / "full").string(), "full");
  for (const char* rank : {"rank0", "rank1"}) {
    expect_whole_state(dir_ / "none" / rank, true);
    expect_same_state(dir_ / "full" / rank, dir_ / "none" / rank);
  }
}

// Loss and MLP tiles on two ranks: a run that keeps every activation and one that recomputes
// every block end in one state, bit for bit, for the same Llama (the tiles' recompute in
// backward runs in the same fixed order under every policy).
TEST_F(ExactTest, LossAndMlpTilesAcrossPoliciesOnTwoRanksGiveOneState) {
  nlohmann::json c = real_size_config("llama", true);
  c["porter"]["model"]["attention"] = "flash";
  c["porter"]["model"]["loss_tiles"] = 3;
  c["porter"]["model"]["mlp_tiles"] = 3;
  c["porter"]["device"]["threads"] = 1;
  c["zero_optimization"] = {{"stage", 2}};
  c["porter"]["checkpointing"]["policy"] = "none";
  const fs::path none = write_config("none", c);
  c["porter"]["checkpointing"]["policy"] = "full";
  const fs::path full = write_config("full", c);
  const std::string out = train(none, "--nproc 2 --save " + (dir_ / "none").string(), "none");
  EXPECT_THAT(out, HasSubstr("loss in 3 tiles, MLP in 3 tiles"));
  train(full, "--nproc 2 --save " + (dir_ / "full").string(), "full");
  for (const char* rank : {"rank0", "rank1"}) {
    // A tile's head products (171 rows x vocab 256 x 768) are under the measurement
    // threshold by construction; the blocks' are above it.
    expect_whole_state(dir_ / "none" / rank, true, /*all_measured=*/false);
    expect_same_state(dir_ / "full" / rank, dir_ / "none" / rank);
  }
}

// kernel_choice fastest times every candidate, whose choices change bits; a second run that
// pins the first one's table (from its report) computes the same state.
TEST_F(ExactTest, PinnedTableRepeatsAFastestRun) {
  nlohmann::json c = real_size_config("gpt", true);
  c["porter"]["device"]["kernel_choice"] = "fastest";
  c["porter"]["train"]["steps"] = 1;
  const fs::path cfg = write_config("fastest", c);
  train(cfg, "--save " + (dir_ / "a").string() + " --report " + (dir_ / "a.json").string(), "a");
  const std::string out =
      train(cfg, "--set porter.device.kernel_table=" + (dir_ / "a.json").string() + " --save " +
                     (dir_ / "b").string(),
            "b");
  EXPECT_THAT(out, HasSubstr("kernel choices: pinned from " + (dir_ / "a.json").string()));
  expect_same_state(dir_ / "a", dir_ / "b");
  std::ifstream report(dir_ / "a.json");
  const nlohmann::json r = nlohmann::json::parse(report);
  size_t measured = 0;
  for (const nlohmann::json& e : r.at("kernel_table").at("entries")) {
    measured += e.at("source") == "measured" ? 1 : 0;
  }
  EXPECT_GT(measured, 0u);
}

// ZeRO-Offload's headline on one rank, in the shipped examples: a model whose states (2 + 4 +
// 12 bytes per parameter) are 15 times the device with the optimizer and the parameters
// offloaded (stage 3) and 6 times with the optimizer alone (stage 2), where the device keeps no
// gradient shard (Note [Streamed gradients] in zero/host_grads.h), trains bit for bit as the
// same model on a device that holds it all (stage 2, nothing offloaded).
TEST_F(ExactTest, OneRankOffloadTrainsAsAnUnconstrainedRun) {
  const fs::path examples = fs::path(PORTER_SOURCE_DIR) / "examples";
  const fs::path three = examples / "gpt-offload-one-rank.json";
  const fs::path two = examples / "gpt-offload-stage2-one-rank.json";
  auto run = [&](const fs::path& cfg, const std::string& tag, const std::string& sets) {
    // One step: the 1.2 GB states' saves dominate this test's time; several steps of the same
    // paths are compared bit for bit in-process (EngineOptimizerOffload, world sizes 1 and 2).
    train(cfg, "--steps 1 " + sets + " --save " + (dir_ / tag).string() + " --report " +
                   (dir_ / (tag + ".json")).string(),
          tag);
    std::ifstream in(dir_ / (tag + ".json"));
    return nlohmann::json::parse(in);
  };
  const nlohmann::json r3 = run(three, "s3", "");
  const nlohmann::json r2 = run(two, "s2", "");
  const nlohmann::json ref = run(two, "ref",
                                 "--set zero_optimization.offload_optimizer.device=none --set "
                                 "porter.device.memory_limit=4GiB");
  const double states = 18.0 * r3.at("num_params").get<double>();
  EXPECT_GE(states / r3.at("memory").at("capacity_bytes").get<double>(), 12.0);
  EXPECT_GE(states / r2.at("memory").at("capacity_bytes").get<double>(), 6.0);
  for (const nlohmann::json* r : {&r3, &r2}) {
    // The device held no gradient shard and no optimizer state; its peak was the prediction.
    const nlohmann::json& m = r->at("memory");
    EXPECT_EQ(m.at("peak_bytes"), m.at("predicted_peak_bytes"));
    EXPECT_EQ(m.at("peak_by_category").at("grads"), 0);
    EXPECT_EQ(m.at("peak_by_category").at("optimizer"), 0);
  }
  // Micro-batch 1 keeps the attention call (0.1 GFLOP) under the measurement threshold; every
  // matmul is above it.
  expect_whole_state(dir_ / "ref", true, /*all_measured=*/false);
  expect_same_state(dir_ / "s3", dir_ / "ref");
  expect_same_state(dir_ / "s2", dir_ / "ref");
}

}  // namespace
}  // namespace porter::cli
