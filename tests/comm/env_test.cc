// The launcher environment (comm/env.h): torchrun's variables, the OpenMPI fallback, the
// defaults, and every malformed or inconsistent case naming its variable.
#include "comm/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "base/error.h"

namespace porter::comm {
namespace {

using Vars = std::map<std::string, std::string>;

DistEnv env_of(const Vars& vars) { return dist_env_from(env_lookup(vars)); }

// The InvalidArgument message for `vars` (fails the test when none is thrown).
std::string error_of(const Vars& vars) {
  try {
    env_of(vars);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

TEST(DistEnv, NoLauncherIsRankZeroOfOne) {
  DistEnv d = env_of({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(d.local_world_size, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
  EXPECT_EQ(d.source, "none");
  // A world of one without a rank is still a single process.
  EXPECT_EQ(env_of({{"WORLD_SIZE", "1"}}).source, "none");
}

TEST(DistEnv, TorchrunVariables) {
  DistEnv d = env_of({{"RANK", "5"},
                      {"WORLD_SIZE", "8"},
                      {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "node0.cluster"},
                      {"MASTER_PORT", "12345"}});
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "node0.cluster");
  EXPECT_EQ(d.master_port, 12345);
  EXPECT_EQ(d.source, "torchrun");
}

TEST(DistEnv, TorchrunWithoutLocalVariablesAssumesOneHost) {
  DistEnv d = env_of({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(d.local_rank, 2);
  EXPECT_EQ(d.local_world_size, 3);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, OpenMpiFallback) {
  DistEnv d = env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                      {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                      {"MASTER_PORT", "29600"}});
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 4);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 2);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29600);
  EXPECT_EQ(d.source, "openmpi");
  d = env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(d.local_world_size, 2);
}

TEST(DistEnv, TorchrunWinsWhenBothAgree) {
  DistEnv d = env_of({{"RANK", "1"},
                      {"WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 1);
}

struct BadCase {
  const char* name;
  Vars vars;
  const char* names;  // the variable the message must name
};

TEST(DistEnv, MalformedValuesNameTheVariable) {
  const BadCase cases[] = {
      {"non-numeric rank", {{"RANK", "one"}, {"WORLD_SIZE", "2"}}, "RANK"},
      {"empty rank", {{"RANK", ""}, {"WORLD_SIZE", "2"}}, "RANK"},
      {"negative rank", {{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK"},
      {"rank with spaces", {{"RANK", " 1"}, {"WORLD_SIZE", "2"}}, "RANK"},
      {"rank overflows int", {{"RANK", "99999999999"}, {"WORLD_SIZE", "2"}}, "RANK"},
      {"rank == world size", {{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2"},
      {"rank > world size", {{"RANK", "7"}, {"WORLD_SIZE", "2"}}, "WORLD_SIZE=2"},
      {"rank without world size", {{"RANK", "0"}}, "WORLD_SIZE"},
      {"world size zero", {{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE"},
      {"non-numeric world size", {{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, "WORLD_SIZE"},
      {"world size without rank", {{"WORLD_SIZE", "4"}}, "WORLD_SIZE"},
      {"local rank >= local world size",
       {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK"},
      {"local rank beyond the world", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}},
       "LOCAL_RANK"},
      {"local world size > world size",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}},
       "LOCAL_WORLD_SIZE"},
      {"local world size zero", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "0"}},
       "LOCAL_WORLD_SIZE"},
      {"non-numeric local rank", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "a"}},
       "LOCAL_RANK"},
      {"non-numeric port", {{"MASTER_PORT", "http"}}, "MASTER_PORT"},
      {"port too large", {{"MASTER_PORT", "65536"}}, "MASTER_PORT"},
      {"port zero", {{"MASTER_PORT", "0"}}, "MASTER_PORT"},
      {"empty port", {{"MASTER_PORT", ""}}, "MASTER_PORT"},
      {"empty address", {{"MASTER_ADDR", ""}}, "MASTER_ADDR"},
      {"openmpi rank without size", {{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_SIZE"},
      {"openmpi rank >= size", {{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
       "OMPI_COMM_WORLD_RANK"},
      {"openmpi non-numeric size",
       {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "four"}},
       "OMPI_COMM_WORLD_SIZE"},
      {"openmpi local rank >= local size",
       {{"OMPI_COMM_WORLD_RANK", "0"},
        {"OMPI_COMM_WORLD_SIZE", "4"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
       "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"openmpi size without rank", {{"OMPI_COMM_WORLD_SIZE", "2"}}, "OMPI_COMM_WORLD_SIZE"},
      {"launchers disagree on rank",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"},
        {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK=1"},
      {"launchers disagree on size",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
        {"OMPI_COMM_WORLD_SIZE", "3"}},
       "WORLD_SIZE=2"},
      {"launchers disagree on local rank",
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
        {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
       "OMPI_COMM_WORLD_LOCAL_RANK=1"},
      {"openmpi and a stray WORLD_SIZE disagree",
       {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"WORLD_SIZE", "3"}},
       "WORLD_SIZE=3"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string msg = error_of(c.vars);
    EXPECT_NE(msg.find(c.names), std::string::npos) << msg;
  }
}

TEST(DistEnv, EnvLookupCopiesTheMap) {
  EnvLookup lookup;
  {
    Vars vars = {{"RANK", "0"}};
    lookup = env_lookup(vars);
  }
  EXPECT_EQ(lookup("RANK"), std::optional<std::string>("0"));
  EXPECT_EQ(lookup("WORLD_SIZE"), std::nullopt);
}

TEST(DistEnv, FromProcessReadsTheEnvironment) {
  // This binary's own environment: set, read, restore (tests in one binary run in sequence).
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
    ::unsetenv(n);
  }
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "29501", 1);
  DistEnv d = dist_env_from_process();
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.master_port, 29501);
  EXPECT_EQ(d.source, "torchrun");
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(dist_env_from_process(), InvalidArgument);
  for (const auto& [n, v] : saved) {
    if (v) {
      ::setenv(n.c_str(), v->c_str(), 1);
    } else {
      ::unsetenv(n.c_str());
    }
  }
}

}  // namespace
}  // namespace porter::comm
