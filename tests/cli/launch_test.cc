// `porter launch`: the ranks' environment, prefixed output, failure reporting and killing,
// signal forwarding, usage errors (Note [Launcher] in cli/launch.h); and the multi-process
// training run through it and through `porter train --nproc`.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <regex>
#include <string>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "cli/launch.h"
#include "tests/cli/cli_test_util.h"
#include "tests/cli/trace_schema.h"

extern char** environ;

namespace porter::cli {
namespace {

using testing::CliRun;
using testing::contains;
using testing::porter;
namespace fs = std::filesystem;

// The port every rank saw, from lines "[rank r] ... port=P"; -1 when they differ.
int common_port(const std::string& out, int ranks) {
  int port = -1;
  for (int r = 0; r < ranks; ++r) {
    std::smatch m;
    const std::regex re("\\[rank " + std::to_string(r) + "\\] [^\n]*port=([0-9]+)");
    if (!std::regex_search(out, m, re)) return -1;
    const int p = std::stoi(m[1]);
    if (port != -1 && p != port) return -1;
    port = p;
  }
  return port;
}

TEST(Launch, EveryRankGetsTheEnvironmentAndPrefixedOutput) {
  CliRun r = porter({"launch", "-n", "2", "--", "sh", "-c",
                     "echo rank=$RANK ws=$WORLD_SIZE local=$LOCAL_RANK lws=$LOCAL_WORLD_SIZE "
                     "addr=$MASTER_ADDR port=$MASTER_PORT; echo to-stderr-$RANK >&2"});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] rank=0 ws=2 local=0 lws=2 addr=127.0.0.1 port=")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] rank=1 ws=2 local=1 lws=2 addr=127.0.0.1 port=")) << r.out;
  const int port = common_port(r.out, 2);
  EXPECT_GT(port, 0) << r.out;
  EXPECT_TRUE(contains(r.err, "[rank 0] to-stderr-0\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 1] to-stderr-1\n")) << r.err;
  EXPECT_FALSE(contains(r.out, "to-stderr")) << r.out;
  EXPECT_TRUE(contains(r.err, "MASTER_PORT=" + std::to_string(port))) << r.err;
}

TEST(Launch, GivenAddressAndPortAndAnUnterminatedLine) {
  CliRun r = porter({"launch", "-n", "3", "--master-addr", "localhost", "--master-port", "29123",
                     "--", "sh", "-c", "printf 'addr=%s port=%s' $MASTER_ADDR $MASTER_PORT"});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(contains(r.out, "[rank " + std::to_string(rank) + "] addr=localhost port=29123\n"))
        << r.out;
  }
}

TEST(Launch, LauncherVariablesReplaceInheritedOnes) {
  const std::vector<std::string> env = child_environment(
      {"PATH=/bin", "RANK=5", "WORLD_SIZE=9", "OMPI_COMM_WORLD_RANK=3", "MASTER_PORTX=1"}, 1, 2,
      "10.0.0.1", 4242);
  const std::vector<std::string> expected = {
      "PATH=/bin",         "MASTER_PORTX=1",        "RANK=1",         "WORLD_SIZE=2",
      "LOCAL_RANK=1",      "LOCAL_WORLD_SIZE=2",    "MASTER_ADDR=10.0.0.1", "MASTER_PORT=4242"};
  EXPECT_EQ(env, expected);
}

// Note [Restarts]: a failed world starts again with PORTER_RESTART counting the restarts.
TEST(Launch, AFailedWorldRestartsUpToMaxRestarts) {
  CliRun r = porter({"launch", "-n", "2", "--max-restarts", "2", "--", "sh", "-c",
                     "if [ \"$RANK\" = 1 ] && [ \"$PORTER_RESTART\" = 0 ]; then exit 7; fi; "
                     "echo ok-$RANK-$PORTER_RESTART"});
  EXPECT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.err, "launch: rank 1 failed (exit code 7)")) << r.err;
  EXPECT_TRUE(contains(r.err, "restarting the world from its latest checkpoint (restart 1 of 2)"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "restart 1 of 2: sh -c")) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] ok-0-1\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] ok-1-1\n")) << r.out;
}

TEST(Launch, RestartsEndAfterMaxRestartsWithTheLastWorldsCode) {
  CliRun r = porter({"launch", "-n", "2", "--max-restarts", "2", "--timeout", "0.5", "--", "sh",
                     "-c", "if [ \"$RANK\" = 0 ]; then exit 9; fi; exec sleep 60"});
  EXPECT_EQ(r.rc, 9) << r.err;
  EXPECT_TRUE(contains(r.err, "(restart 2 of 2)")) << r.err;
  EXPECT_FALSE(contains(r.err, "(restart 3 of 2)")) << r.err;
  EXPECT_TRUE(contains(r.err, "launch: gave up after 2 restarts (--max-restarts 2)")) << r.err;
  // In the worlds that restart, the sleeping rank is ended at once, not after --timeout.
  EXPECT_TRUE(contains(r.err, "ending the other 1 rank")) << r.err;
}

TEST(Launch, UsageErrorsAndPreemptionAreNotRestarted) {
  for (int code : {1, kExitPreempted}) {
    CliRun r = porter({"launch", "-n", "1", "--max-restarts", "3", "--", "sh", "-c",
                       "exit " + std::to_string(code)});
    EXPECT_EQ(r.rc, code) << r.err;
    EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
  }
}

// Note [Store token]: a fresh token per launch unless the environment gives one.
TEST(Launch, RanksGetAStoreToken) {
  CliRun r = porter({"launch", "-n", "2", "--", "sh", "-c",
                     "printf 'token=%s\\n' \"$PORTER_STORE_TOKEN\" | wc -c"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  // "token=" + 32 hex digits + newline.
  EXPECT_TRUE(contains(r.out, "[rank 0] 39\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] 39\n")) << r.out;
}

TEST(Launch, NodesTakeTheirRanksOfTheWorld) {
  CliRun r = porter({"launch", "--nnodes", "2", "--node-rank", "1", "-n", "2", "--master-addr",
                     "10.1.2.3", "--master-port", "29555", "--", "sh", "-c",
                     "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 2] 2/4/0/2/10.1.2.3\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 3] 3/4/1/2/10.1.2.3\n")) << r.out;
  EXPECT_TRUE(contains(r.err, "2 ranks (2..3 of 4, node 1 of 2)")) << r.err;
  EXPECT_TRUE(contains(r.err, "give every node the same token")) << r.err;
  CliRun no_port = porter({"launch", "--nnodes", "2", "-n", "1", "--", "true"});
  EXPECT_EQ(no_port.rc, kExitUsage);
  EXPECT_TRUE(contains(no_port.err, "--nnodes 2 needs --master-port")) << no_port.err;
  CliRun bad_rank = porter({"launch", "--nnodes", "2", "--node-rank", "2", "-n", "1",
                            "--master-port", "29555", "--", "true"});
  EXPECT_EQ(bad_rank.rc, kExitUsage);
  EXPECT_TRUE(contains(bad_rank.err, "--node-rank 2 must be in 0..1")) << bad_rank.err;
}

TEST(Launch, FreePortIsBindable) {
  const uint16_t port = free_port();
  EXPECT_GT(port, 0);
}

TEST(Launch, AFailedRankIsNamedAndTheOthersAreKilledAfterTheTimeout) {
  // Rank 1 fails at once; rank 0 would run for a minute, so the launcher must kill it.
  CliRun r = porter({"launch", "-n", "2", "--timeout", "0.5", "--", "sh", "-c",
                     "if [ \"$RANK\" = 1 ]; then echo dying >&2; exit 7; fi; exec sleep 60"});
  EXPECT_EQ(r.rc, 7) << r.err;  // the failed rank's code
  EXPECT_TRUE(contains(r.err, "[rank 1] dying")) << r.err;
  EXPECT_TRUE(contains(r.err, "launch: rank 1 failed (exit code 7)")) << r.err;
  EXPECT_TRUE(contains(r.err, "terminating: 0")) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 0 signal 15 (Terminated) (killed by the launcher)")) << r.err;
  EXPECT_TRUE(contains(r.err, "first failure: rank 1")) << r.err;
}

TEST(Launch, OtherRanksMayFinishOnTheirOwnWithinTheTimeout) {
  CliRun r = porter({"launch", "-n", "3", "--timeout", "60", "--", "sh", "-c",
                     "if [ \"$RANK\" = 2 ]; then exit 3; fi; sleep 0.2; echo done-$RANK"});
  EXPECT_EQ(r.rc, 3) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] done-0")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] done-1")) << r.out;
  EXPECT_TRUE(contains(r.err, "launch: failed: rank 0 ok; rank 1 ok; rank 2 exit code 3;"))
      << r.err;
  EXPECT_FALSE(contains(r.err, "terminating")) << r.err;
}

TEST(Launch, ARankKilledByASignalIsReportedWithTheSignal) {
  CliRun r = porter({"launch", "-n", "2", "--timeout", "5", "--", "sh", "-c",
                     "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exit 0"});
  EXPECT_EQ(r.rc, 128 + 9) << r.err;  // as a shell reports a killed command
  EXPECT_TRUE(contains(r.err, "launch: rank 0 failed (signal 9 (Killed))")) << r.err;
}

// Exit codes mean one thing everywhere: launch's own usage errors are 1, as every other
// subcommand's (a failed rank's code is passed on instead, above).
TEST(Launch, UsageErrorsExit1) {
  CliRun none = porter({"launch", "-n", "2"});
  EXPECT_EQ(none.rc, kExitUsage);
  EXPECT_TRUE(contains(none.err, "no command: give it after --")) << none.err;
  CliRun zero = porter({"launch", "-n", "0", "--", "true"});
  EXPECT_EQ(zero.rc, kExitUsage) << zero.err;
  CliRun missing_n = porter({"launch", "--", "true"});
  EXPECT_EQ(missing_n.rc, kExitUsage) << missing_n.err;
  CliRun bad_flag = porter({"launch", "-n", "2", "--bogus", "--", "true"});
  EXPECT_EQ(bad_flag.rc, kExitUsage) << bad_flag.err;
  CliRun bad_port = porter({"launch", "-n", "2", "--master-port", "70000", "--", "true"});
  EXPECT_EQ(bad_port.rc, kExitUsage) << bad_port.err;
  CliRun no_such = porter({"launch", "-n", "2", "--", "/no/such/program", "x"});
  EXPECT_EQ(no_such.rc, kExitUsage);
  EXPECT_TRUE(contains(no_such.err, "cannot start rank 0: \"/no/such/program\"")) << no_such.err;
  EXPECT_EQ(porter({"estimate", "--bogus"}).rc, kExitUsage);
}

// Runs the porter binary with `args`, stdout and stderr merged; calls on_line for each line
// as it arrives (it may return false to stop listening and just wait). Returns the wait status.
struct BinaryRun {
  int status = 0;
  std::string output;
};
BinaryRun run_program(std::vector<std::string> full,
                      const std::function<void(pid_t pid, const std::string& output)>& on_output = {}) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  std::vector<char*> argv;
  for (std::string& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = -1;
  EXPECT_EQ(::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  BinaryRun run;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    run.output.append(buf, static_cast<size_t>(n));
    if (on_output) on_output(pid, run.output);
  }
  ::close(fds[0]);
  ::waitpid(pid, &run.status, 0);
  return run;
}

BinaryRun run_binary(const std::vector<std::string>& args,
                     const std::function<void(pid_t pid, const std::string& output)>& on_output = {}) {
  std::vector<std::string> full = {PORTER_EXE};
  full.insert(full.end(), args.begin(), args.end());
  return run_program(std::move(full), on_output);
}

TEST(LaunchBinary, SigtermIsForwardedToEveryRank) {
  bool sent = false;
  BinaryRun run = run_binary(
      {"launch", "-n", "2", "--timeout", "10", "--", "sh", "-c",
       "trap 'echo got-term-$RANK; exit 5' TERM; echo ready-$RANK; "
       "while true; do sleep 0.05; done"},
      [&](pid_t pid, const std::string& output) {
        if (!sent && contains(output, "ready-0") && contains(output, "ready-1")) {
          ::kill(pid, SIGTERM);
          sent = true;
        }
      });
  ASSERT_TRUE(sent) << run.output;
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  EXPECT_EQ(WEXITSTATUS(run.status), 5) << run.output;  // the ranks' own code
  EXPECT_TRUE(contains(run.output, "forwarding it to the 2 running ranks")) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0] got-term-0")) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 1] got-term-1")) << run.output;
  EXPECT_TRUE(contains(run.output, "rank 0 exit code 5; rank 1 exit code 5;")) << run.output;
}

// A 2-layer GPT for 2 ranks with ZeRO stage 2 and buckets small enough that backward
// reduce-scatters several of them.
const char* kZero2Config = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 20000},
  "porter": {
    "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 16, "vocab": 64},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
    "checkpointing": {"policy": "uniform", "every_n_layers": 1},
    "comm": {"timeout_s": 20},
    "train": {"steps": 3, "log_every": 1}
  }
})";

class LaunchTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_launch_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    config_ = (dir_ / "zero2.json").string();
    std::ofstream(config_) << kZero2Config;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  std::string config_;
};

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// THE multi-process test: two porter processes train with ZeRO-2 over Gloo through the
// launcher; rank 0's report has both ranks' memory and the zero section.
TEST_F(LaunchTrain, TwoProcessesTrainWithZero2) {
  const std::string report = (dir_ / "r.json").string();
  CliRun r = porter({"launch", "-n", "2", "--", PORTER_EXE, "train", "--config", config_,
                     "--steps", "3", "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] summary")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 0] memory per rank")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 0] zero: stage 2 over 2 ranks (gloo)")) << r.out;
  EXPECT_FALSE(contains(r.out, "[rank 1] ")) << r.out;  // rank 1 prints only errors
  EXPECT_TRUE(contains(r.err, "[rank 0] step 3/3")) << r.err;
  const nlohmann::json j = read_json(report);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["comm_backend"], "gloo");
  EXPECT_EQ(j["zero"]["stage"], 2);
  EXPECT_EQ(j["zero"]["world_size"], 2);
  EXPECT_GT(j["zero"]["comm_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["steps"], 3);
  ASSERT_EQ(j["ranks"].size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const nlohmann::json& rj = j["ranks"][static_cast<size_t>(rank)];
    EXPECT_EQ(rj["rank"], rank);
    EXPECT_EQ(rj["zero"]["stage"], 2);
    EXPECT_EQ(rj["zero"]["shard_elems"], j["zero"]["shard_elems"]);
    // Each rank holds the whole parameters and its shard of the gradients and of the AdamW
    // moments: exactly porter estimate's stage-2 bytes.
    EXPECT_EQ(rj["memory"]["peak_by_category"]["params"],
              rj["zero"]["model_state_bytes"]["params"]) << rank;
    EXPECT_EQ(rj["memory"]["peak_by_category"]["optimizer"],
              rj["zero"]["model_state_bytes"]["optimizer"]) << rank;
    EXPECT_EQ(rj["memory"]["peak_by_category"]["grads"],
              rj["zero"]["model_state_bytes"]["grads"]) << rank;
  }
  EXPECT_EQ(j["memory"], j["ranks"][0]["memory"]);
}

// `train --nproc 2` re-executes porter under the launcher.
TEST_F(LaunchTrain, NprocIsTheLaunchShorthand) {
  BinaryRun run = run_binary({"train", "--nproc", "2", "--config", config_, "--steps", "1"});
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  EXPECT_EQ(WEXITSTATUS(run.status), 0) << run.output;
  EXPECT_TRUE(contains(run.output, "launch: 2 ranks")) << run.output;
  EXPECT_TRUE(contains(run.output, "train --config " + config_ + " --steps 1\n")) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0] step 1/1")) << run.output;
}

// Out of memory is exit code 3 on one rank and under --nproc: the launcher passes the first
// failed rank's code on (Note [Launcher]); an invalid config is 2 the same way.
TEST_F(LaunchTrain, OutOfMemoryUnderNprocExitsThree) {
  // 256 KiB holds neither the model states nor the activations of the 2-layer GPT.
  const std::vector<std::string> oom = {"train", "--config", config_, "--steps", "2", "--set",
                                        "porter.device.memory_limit=\"256KiB\""};
  CliRun one = porter(oom);
  EXPECT_EQ(one.rc, kExitOom) << one.err;
  EXPECT_TRUE(contains(one.err, "error: out of memory on cpu:0")) << one.err;
  std::vector<std::string> two = oom;
  two.insert(two.begin() + 1, {"--nproc", "2"});
  BinaryRun run = run_binary(two);
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  EXPECT_EQ(WEXITSTATUS(run.status), kExitOom) << run.output;
  EXPECT_TRUE(std::regex_search(run.output,
                                std::regex(R"(\[rank [01]\] error: rank [01] of 2: out of memory)")))
      << run.output;
  EXPECT_TRUE(std::regex_search(run.output, std::regex(R"(launch: rank [01] failed \(exit code 3\))")))
      << run.output;
  // The same through porter launch.
  std::vector<std::string> launched = {"launch", "-n", "2", "--", PORTER_EXE};
  launched.insert(launched.end(), oom.begin(), oom.end());
  BinaryRun via_launch = run_binary(launched);
  ASSERT_TRUE(WIFEXITED(via_launch.status)) << via_launch.output;
  EXPECT_EQ(WEXITSTATUS(via_launch.status), kExitOom) << via_launch.output;
  // Invalid input on every rank: 2.
  BinaryRun invalid = run_binary({"train", "--nproc", "2", "--config", config_, "--set",
                                  "zero_optimization.stage=two"});
  ASSERT_TRUE(WIFEXITED(invalid.status)) << invalid.output;
  EXPECT_EQ(WEXITSTATUS(invalid.status), kExitInvalid) << invalid.output;
}

// Every rank gets every --config file and --set, in order: the ranks merge the same config.
TEST_F(LaunchTrain, NprocPassesEveryConfigFileAndSet) {
  const std::string overlay = (dir_ / "overlay.json").string();
  std::ofstream(overlay) << R"({"porter": {"model": {"layers": 3}}})";
  BinaryRun run = run_binary({"train", "--nproc", "2", "--config", config_, "--config", overlay,
                              "--set", "porter.model.layers=1", "--steps", "1"});
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  EXPECT_EQ(WEXITSTATUS(run.status), 0) << run.output;
  EXPECT_TRUE(contains(run.output, "train --config " + config_ + " --config " + overlay +
                                       " --set porter.model.layers=1 --steps 1\n"))
      << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0] porter train: " + config_ + " + " + overlay +
                                       " + --set porter.model.layers=1\n"))
      << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0]   model: GPT, 1 layers")) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0] step 1/1")) << run.output;
}

// A rank that fails before the rendezvous leaves rank 0 waiting for it in the store, which
// gives up after porter.comm.timeout_s; the launcher names the rank that failed first.
TEST_F(LaunchTrain, ARankThatFailsMakesTheOthersFailWithinTheTimeout) {
  std::string text = kZero2Config;
  const std::string from = "\"timeout_s\": 20";
  text.replace(text.find(from), from.size(), "\"timeout_s\": 1");
  std::ofstream(config_) << text;
  const std::string script = std::string("if [ \"$RANK\" = 1 ]; then exec \"$0\" train --config ") +
                             (dir_ / "missing.json").string() + "; fi; exec \"$0\" train --config " +
                             config_;
  CliRun r = porter({"launch", "-n", "2", "--", "sh", "-c", script, PORTER_EXE});
  EXPECT_EQ(r.rc, kExitInvalid) << r.err;  // rank 1's: its config cannot be read
  EXPECT_TRUE(contains(r.err, "[rank 1] error: rank 1 of 2: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "cannot read config file")) << r.err;
  EXPECT_TRUE(contains(r.err, "launch: rank 1 failed (exit code 2)")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 0] error: rank 0 of 2: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "first failure: rank 1")) << r.err;
  EXPECT_FALSE(contains(r.err, "killed by the launcher")) << r.err;
}

// A rank that leaves mid-run (rank 1 trains 2 steps and exits 0; rank 0 wants 1000) makes
// rank 0's next collective fail at once with an error that names the rank, the operation
// and the peer, not a hang; the launcher reports rank 0's failure.
TEST_F(LaunchTrain, ARankThatLeavesMidRunFailsItsPeerAtTheNextCollective) {
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then exec \"$0\" train --config \"$1\" --steps 2; fi; "
      "exec \"$0\" train --config \"$1\" --steps 1000";
  CliRun r = porter({"launch", "-n", "2", "--", "sh", "-c", script, PORTER_EXE, config_});
  EXPECT_EQ(r.rc, kExitInvalid) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 0] step 2/1000")) << r.err;
  EXPECT_FALSE(contains(r.err, "[rank 0] step 4/1000")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 0] error: rank 0 of 2: rank 0 of world: ")) << r.err;
  // The op that saw the peer go (a later op may report it as "failed earlier: ...").
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(rank 0 of world: [a-z_]+ of [0-9]+ f32 failed: rank 1 closed the )"
                        R"(connection)")))
      << r.err;
  EXPECT_TRUE(contains(r.err, "launch: failed: rank 0 exit code 2; rank 1 ok; first failure: rank 0"))
      << r.err;
}

TEST_F(LaunchTrain, NprocInsideALaunchedRankIsRefused) {
  CliRun r = porter({"launch", "-n", "1", "--", PORTER_EXE, "train", "--nproc", "2", "--config",
                     config_});
  EXPECT_EQ(r.rc, kExitUsage) << r.err;  // the rank's usage error, passed on
  EXPECT_TRUE(contains(r.err, "--nproc 2: this process is already rank 0 of 1")) << r.err;
}

// What a --trace file of a 2-rank run holds, per pid.
struct RankEvents {
  std::string name;             // process_name
  int comm_spans = 0;
  std::map<int64_t, uint64_t> comm_bytes_per_step;
  uint64_t comm_bytes = 0;
  std::set<std::string> lanes;  // with at least one span
};

std::map<int, RankEvents> rank_events(const nlohmann::json& trace) {
  std::map<int, RankEvents> out;
  std::map<std::pair<int, int>, std::string> lane_of;  // (pid, tid) -> lane
  for (const nlohmann::json& e : trace["traceEvents"]) {
    if (e["name"] == "thread_name") lane_of[{e["pid"], e["tid"]}] = e["args"]["name"];
  }
  for (const nlohmann::json& e : trace["traceEvents"]) {
    RankEvents& r = out[e["pid"].get<int>()];
    if (e["name"] == "process_name") r.name = e["args"]["name"];
    if (e["ph"] != "X") continue;
    r.lanes.insert(lane_of[{e["pid"], e["tid"]}]);
    if (e["cat"] != "comm") continue;
    ++r.comm_spans;
    const auto bytes = static_cast<uint64_t>(e["args"]["bytes"].get<double>());
    r.comm_bytes += bytes;
    r.comm_bytes_per_step[e["args"]["step"].get<int64_t>()] += bytes;
  }
  return out;
}

// Raw uint16 tokens: `n` of them, token i = f(i).
template <typename F>
void write_tokens(const fs::path& p, size_t n, F&& f) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(f(i));
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(n * 2));
}

// The validation loss of 2 ranks is the loss of the whole set, not rank 0's share: it matches
// one rank that evaluates both shares. The set's first half continues the training pattern
// (rank 0's windows) and its second half is noise (rank 1's), so the shares' losses differ.
TEST_F(LaunchTrain, ValidationLossIsTheMeanOverTheRanks) {
  write_tokens(dir_ / "train.bin", 4000, [](size_t i) { return i % 8; });
  uint32_t x = 12345;
  write_tokens(dir_ / "val.bin", 16 * 16 + 1, [&](size_t i) {
    x = x * 1664525u + 1013904223u;
    return i <= 128 ? i % 8 : (x >> 16) % 64;
  });
  auto make = [&](const std::string& name, int accumulation, int eval_micro_batches) {
    std::string text = kZero2Config;
    auto replace = [&](const std::string& from, const std::string& to) {
      ASSERT_NE(text.find(from), std::string::npos) << from;
      text.replace(text.find(from), from.size(), to);
    };
    replace("\"gradient_accumulation_steps\": 2", "\"gradient_accumulation_steps\": " +
                                                   std::to_string(accumulation));
    replace("\"lr\": 1e-3", "\"lr\": 1e-2");
    replace("\"data\": {\"type\": \"synthetic\", \"seed\": 3}",
            "\"data\": {\"type\": \"tokens\", \"paths\": \"" + (dir_ / "train.bin").string() +
                "\", \"val_paths\": \"" + (dir_ / "val.bin").string() + "\"}");
    replace("\"train\": {\"steps\": 3, \"log_every\": 1}",
            "\"train\": {\"steps\": 8, \"log_every\": 4, \"eval_every\": 4, "
            "\"eval_micro_batches\": " + std::to_string(eval_micro_batches) + "}");
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  };
  const std::string two = make("two.json", 2, 2), one = make("one.json", 4, 4);
  const std::string report_two = (dir_ / "two_report.json").string();
  const std::string report_one = (dir_ / "one_report.json").string();
  CliRun r = porter({"launch", "-n", "2", "--", PORTER_EXE, "train", "--config", two, "--report",
                     report_two});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0]   validation: tokens: 257 tokens in 1 raw uint16 shard, 8 "
                              "of its 16 windows of 17; 2 micro-batches on each data-parallel "
                              "rank, every 4 steps and after the last")) << r.out;
  EXPECT_TRUE(contains(r.err, " (step 8, 2 micro-batches on each data-parallel rank)")) << r.err;
  CliRun single = porter({"train", "--config", one, "--report", report_one});
  ASSERT_EQ(single.rc, kExitOk) << single.err;

  const nlohmann::json v2 = read_json(report_two)["validation"];
  const nlohmann::json v1 = read_json(report_one)["validation"];
  ASSERT_EQ(v2.size(), 2u);
  ASSERT_EQ(v1.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(v2[i]["step"], 4 * (i + 1));
    EXPECT_EQ(v1[i]["step"], v2[i]["step"]);
    // The same windows and (up to the order of the gradient sums) the same parameters.
    EXPECT_NEAR(v2[i]["loss"].get<double>(), v1[i]["loss"].get<double>(), 2e-3) << i;
  }
}

// `make demo`'s shape: ZeRO-2 on 2 processes. The trace is one valid file with both ranks as
// processes, every rank's collectives on its comm lane, and their bytes the report's.
TEST_F(LaunchTrain, TheTraceOfTwoProcessesHasBothRanksAndTheirCollectives) {
  const fs::path trace = dir_ / "t.json";
  const fs::path report = dir_ / "r.json";
  BinaryRun run = run_binary({"train", "--nproc", "2", "--config", config_, "--steps", "3",
                              "--trace", trace.string(), "--report", report.string()});
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  ASSERT_EQ(WEXITSTATUS(run.status), 0) << run.output;
  EXPECT_TRUE(contains(run.output, "[rank 0] trace: " + trace.string())) << run.output;
  const nlohmann::json t = read_json(trace);
  EXPECT_EQ(testing::trace_schema_errors(t), std::vector<std::string>{});
  const nlohmann::json rep = read_json(report);
  const std::map<int, RankEvents> ranks = rank_events(t);
  ASSERT_EQ(ranks.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const RankEvents& r = ranks.at(rank + 1);
    EXPECT_EQ(r.name, "rank " + std::to_string(rank));
    EXPECT_EQ(r.lanes, (std::set<std::string>{"compute", "comm"})) << rank;
    EXPECT_GT(r.comm_spans, 3 * 3) << rank;
    EXPECT_EQ(r.comm_bytes_per_step.size(), 3u) << rank;
    // Each rank's comm bytes, in the trace and in the report.
    EXPECT_EQ(r.comm_bytes, rep["ranks"][static_cast<size_t>(rank)]["zero"]["comm_bytes"])
        << rank;
    // Every step moves the same bytes.
    for (const auto& [step, bytes] : r.comm_bytes_per_step) {
      EXPECT_EQ(bytes, r.comm_bytes / 3) << "rank " << rank << " step " << step;
    }
  }
  EXPECT_EQ(ranks.at(1).comm_bytes, rep["zero"]["comm_bytes"]);
}

TEST_F(LaunchTrain, TraceRankKeepsOneRank) {
  const fs::path trace = dir_ / "t1.json";
  BinaryRun run = run_binary({"train", "--nproc", "2", "--config", config_, "--steps", "1",
                              "--trace", trace.string(), "--trace-rank", "1"});
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  ASSERT_EQ(WEXITSTATUS(run.status), 0) << run.output;
  const nlohmann::json t = read_json(trace);
  EXPECT_EQ(testing::trace_schema_errors(t), std::vector<std::string>{});
  const std::map<int, RankEvents> ranks = rank_events(t);
  ASSERT_EQ(ranks.size(), 1u);
  EXPECT_EQ(ranks.begin()->first, 2);  // rank 1
  EXPECT_EQ(ranks.begin()->second.name, "rank 1");
  EXPECT_GT(ranks.begin()->second.comm_spans, 3);

  BinaryRun bad = run_binary({"train", "--nproc", "2", "--config", config_, "--steps", "1",
                              "--trace", trace.string(), "--trace-rank", "2"});
  ASSERT_TRUE(WIFEXITED(bad.status)) << bad.output;
  EXPECT_NE(WEXITSTATUS(bad.status), 0) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--trace-rank 2: the run has 2 rank(s), 0..1")) << bad.output;
}


// DeepSpeedExamples' Megatron ZeRO-2 config (partition_activations, fp16, stage 2) with a
// model beside it: 4 ranks = 2 data-parallel x 2 tensor-parallel, every held checkpoint
// partitioned. Returns the merged config's path.
std::string megatron_tp2_config(const fs::path& dir) {
  std::ifstream in(std::string(PORTER_REALWORLD_CONFIG_DIR) +
                   "/deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j.merge_patch(nlohmann::json::parse(R"({
    "porter": {
      "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 96,
                "tensor_parallel": 2},
      "device": {"type": "cpu", "memory_limit": "256MiB", "threads": 1},
      "checkpointing": {"partition_min_bytes": 0},
      "comm": {"timeout_s": 30}
    }
  })"));
  const fs::path path = dir / "megatron_tp2.json";
  std::ofstream(path) << j.dump(2);
  return path.string();
}

void expect_tp2_report(const nlohmann::json& j) {
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["tensor_parallel"]["t"], 2);
  EXPECT_EQ(j["zero"]["world_size"], 2);  // data-parallel ranks
  ASSERT_EQ(j["ranks"].size(), 4u);
  for (size_t r = 0; r < 4; ++r) {
    const nlohmann::json& tp = j["ranks"][r]["tensor_parallel"];
    EXPECT_EQ(tp["tp_rank"], static_cast<int>(r % 2)) << r;
    EXPECT_GT(tp["gathers"].get<int64_t>(), 0) << r;
    // The partitioned checkpoints this rank held: exactly the plan's 1/t share.
    EXPECT_EQ(tp["partitioned_bytes"], tp["predicted_partitioned_bytes"]) << r;
    EXPECT_GT(tp["partitioned_bytes"].get<uint64_t>(), 0u) << r;
    EXPECT_EQ(j["ranks"][r]["memory"]["activation_peak_bytes"],
              j["ranks"][r]["memory"]["predicted_activation_peak_bytes"]) << r;
  }
}

// The published config trains with t = 2 through the launcher.
TEST_F(LaunchTrain, MegatronZero2ConfigTrainsTensorParallel) {
  const std::string cfg = megatron_tp2_config(dir_);
  const std::string report = (dir_ / "tp2.json").string();
  CliRun r = porter({"launch", "-n", "4", "--", PORTER_EXE, "train", "--config", cfg,
                     "--steps", "2", "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] tensor parallel: 2 ranks")) << r.out;
  EXPECT_TRUE(contains(r.out, "2 data-parallel x 2 tensor-parallel")) << r.out;
  expect_tp2_report(read_json(report));
}

// The same run started by OpenMPI's launcher: porter reads OMPI_COMM_WORLD_* (rank 0 serves
// the store on 127.0.0.1:MASTER_PORT). make test installs mpirun (scripts/install-deps.sh,
// openmpi-bin), so a build without it fails here, saying so.
TEST_F(LaunchTrain, MpirunStartsATensorParallelRun) {
  const char* mpirun = PORTER_MPIRUN;
  ASSERT_FALSE(std::string(mpirun).empty())
      << "mpirun was not found when the build was configured: run scripts/install-deps.sh "
         "(openmpi-bin), then configure again";
  const std::string cfg = megatron_tp2_config(dir_);
  const std::string report = (dir_ / "mpi.json").string();
  BinaryRun run = run_program(
      // isolated: start the local ranks without ssh (a bare machine may have none).
      {mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "plm", "isolated", "-n", "4", "-x",
       "MASTER_PORT=" + std::to_string(free_port()), PORTER_EXE, "train", "--config", cfg,
       "--steps", "2", "--report", report});
  ASSERT_TRUE(WIFEXITED(run.status)) << run.output;
  ASSERT_EQ(WEXITSTATUS(run.status), 0) << run.output;
  EXPECT_TRUE(contains(run.output, "4 (2 data-parallel x 2 tensor-parallel")) << run.output;
  expect_tp2_report(read_json(report));
}

}  // namespace
}  // namespace porter::cli

namespace porter::cli {
namespace {

// Every published DeepSpeed config in tests/config/realworld (copies of
// ../shared/realworld-configs and SOURCES.md's others) trains unchanged, with only a model file
// beside it (--config ds.json --config model.json), through porter launch at the world size its
// batch numbers imply (2: the model file sets the micro-batch to half of train_batch_size /
// gradient_accumulation_steps). It really trains: the report's losses are finite and fall (the
// data repeat a period-8 pattern the model learns within a few steps; five steps, since Hugging
// Face's WarmupLR starts from a learning rate of 0), an fp16 run applies at least one step (the
// report's zero.skipped_steps counts those an overflow skipped), and every stage-3 config runs
// at stage 3. Optimizer offload trains with the host AdamW, parameter offload with the stage-3
// shards in host memory.
TEST(PublishedConfigs, EachTrainsWithAFallingLossThroughLaunch) {
  constexpr int64_t kSteps = 5;
  const fs::path dir = fs::temp_directory_path() / "porter_cli_published_configs";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path tokens = dir / "train.bin";
  write_tokens(tokens, 20000, [](size_t i) { return i % 8; });
  // The stage-3 configs, counted from the files alone, to compare with the runs.
  int stage3_configs = 0;
  for (const fs::directory_entry& f : fs::directory_iterator(PORTER_REALWORLD_CONFIG_DIR)) {
    if (f.path().extension() != ".json") continue;
    std::ifstream in(f.path());
    const nlohmann::json ds = nlohmann::json::parse(in, nullptr, true, /*ignore_comments=*/true);
    if (ds.value("zero_optimization", nlohmann::json::object()).value("stage", 0) == 3) {
      ++stage3_configs;
    }
  }
  int trained = 0, stage3 = 0, offloading = 0, param_offloading = 0, fp16 = 0;
  for (const fs::directory_entry& f : fs::directory_iterator(PORTER_REALWORLD_CONFIG_DIR)) {
    if (f.path().extension() != ".json") continue;
    std::ifstream in(f.path());
    const nlohmann::json ds = nlohmann::json::parse(in, nullptr, true, /*ignore_comments=*/true);
    const nlohmann::json z = ds.value("zero_optimization", nlohmann::json::object());
    auto offloaded = [&](const char* key) {
      return z.contains(key) && z[key].value("device", std::string("none")) != "none";
    };
    const bool offload = offloaded("offload_param");
    const bool optimizer_offload = z.value("cpu_offload", false) || offloaded("offload_optimizer");
    const nlohmann::json fp16_section = ds.value("fp16", nlohmann::json::object());
    const bool half = fp16_section.contains("enabled") && fp16_section["enabled"] == true;
    const std::string name = f.path().filename().string();
    const fs::path model = dir / ("model-" + name);
    const fs::path report = dir / ("report-" + name);
    nlohmann::json m = {
        {"porter",
         {{"model", {{"layers", 2}, {"hidden", 64}, {"heads", 2}, {"seq_len", 16}, {"vocab", 128}}},
          {"data", {{"type", "tokens"}, {"paths", tokens.string()}, {"seed", 1}}},
          {"device", {{"type", "cpu"}, {"memory_limit", "128MiB"}, {"threads", 1}}},
          {"comm", {{"timeout_s", 30}}},
          {"train", {{"steps", kSteps}, {"log_every", 1}}}}}};
    if (ds.contains("train_batch_size") && ds["train_batch_size"].is_number_integer()) {
      const int64_t gas = ds.value("gradient_accumulation_steps", int64_t{1});
      m["train_micro_batch_size_per_gpu"] = ds["train_batch_size"].get<int64_t>() / gas / 2;
    } else {
      m["train_batch_size"] = 4;
      m["train_micro_batch_size_per_gpu"] = 2;
      m["gradient_accumulation_steps"] = 1;
    }
    std::ofstream(model) << m.dump();
    BinaryRun run = run_binary({"launch", "-n", "2", "--", PORTER_EXE, "train", "--config",
                                f.path().string(), "--config", model.string(), "--report",
                                report.string()});
    ASSERT_TRUE(WIFEXITED(run.status)) << name << "\n" << run.output;
    EXPECT_EQ(WEXITSTATUS(run.status), 0) << name << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, "[rank 0] step 5/5")) << name << "\n" << run.output;
    ASSERT_TRUE(fs::exists(report)) << name << "\n" << run.output;
    const nlohmann::json r = read_json(report);
    ++trained;

    // A finite loss that falls.
    const nlohmann::json& losses = r["losses"];
    ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps)) << name << "\n" << r.dump();
    for (const nlohmann::json& l : losses) {
      ASSERT_TRUE(l.is_number() && std::isfinite(l.get<double>())) << name << "\n" << losses;
    }
    EXPECT_LT(losses.back().get<double>(), losses.front().get<double>() - 0.05)
        << name << "\n" << losses;

    // fp16: the run is in f16, and an overflow did not skip every step.
    EXPECT_EQ(r["compute_dtype"], half ? "f16" : "f32") << name;
    if (half) {
      ++fp16;
      const int64_t skipped = r["zero"]["skipped_steps"].get<int64_t>();
      EXPECT_GE(r["steps"].get<int64_t>() - skipped, 1) << name << ": every step skipped";
    }
    if (optimizer_offload) {
      ++offloading;
      EXPECT_TRUE(contains(run.output, "optimizer offload: ")) << name << "\n" << run.output;
    }
    if (offload) {
      ++param_offloading;
      EXPECT_TRUE(contains(run.output, "parameter offload: ")) << name << "\n" << run.output;
    }
    if (r["zero"]["stage"] == 3) {
      ++stage3;
      EXPECT_TRUE(contains(run.output, "[rank 0] zero: stage 3 over 2 ranks")) << run.output;
      EXPECT_TRUE(contains(run.output, "parameter gathers: ")) << run.output;
    }
  }
  // Megatron's ZeRO-2, ZeRO-3, ZeRO-Offload and ZeRO-Infinity, DeepSpeed's bs8 offload and
  // Hugging Face's ZeRO-3: every one.
  EXPECT_GE(trained, 6);
  EXPECT_GE(offloading, 4);
  EXPECT_GE(param_offloading, 2);
  EXPECT_GE(fp16, 5);  // all but Hugging Face's ("auto": fp32 without the Trainer)
  // Every stage-3 config ran at stage 3: Megatron's ZeRO-3 and ZeRO-Infinity, Hugging Face's.
  EXPECT_GE(stage3, 1);
  EXPECT_EQ(stage3, stage3_configs);
  EXPECT_GE(stage3_configs, 3);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::cli
