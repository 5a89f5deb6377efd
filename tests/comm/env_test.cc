// The launcher environment (comm/env.h): torchrun's variables, the OpenMPI and Slurm fallbacks,
// the defaults, the store token, and every malformed or inconsistent case naming its variable.
#include "comm/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "base/error.h"
#include "comm/store.h"

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

// --- Slurm -------------------------------------------------------------------------------

TEST(DistEnv, SlurmVariablesInAnSrunTask) {
  DistEnv d = env_of({{"SLURM_STEP_ID", "0"},
                      {"SLURM_PROCID", "5"},
                      {"SLURM_NTASKS", "8"},
                      {"SLURM_LOCALID", "1"},
                      {"SLURM_TASKS_PER_NODE", "4(x2)"},
                      {"SLURM_JOB_NODELIST", "node[01-04,07]"},
                      {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "node01");
  EXPECT_EQ(d.master_port, 10000 + 123456 % 50000);
  EXPECT_EQ(d.master_port, 33456);
}

TEST(DistEnv, SlurmStepNodeListAndPerNodeCountAndOverrides) {
  Vars base = {{"SLURM_STEPID", "3"},  // the older spelling
               {"SLURM_PROCID", "2"},
               {"SLURM_NTASKS", "3"},
               {"SLURM_LOCALID", "0"},
               {"SLURM_NTASKS_PER_NODE", "2"},
               {"SLURM_JOB_NODELIST", "a,b,c"},
               {"SLURM_STEP_NODELIST", "gpu-[3-5]"},
               {"SLURM_JOB_ID", "7"}};
  DistEnv d = env_of(base);
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.local_world_size, 2);  // SLURM_NTASKS_PER_NODE when SLURM_TASKS_PER_NODE is unset
  EXPECT_EQ(d.master_addr, "gpu-3");  // the step's first node, where srun places task 0
  EXPECT_EQ(d.master_port, 10007);
  base.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(env_of(base).master_addr, "a");
  // Uneven nodes: the busiest one's count.
  base["SLURM_TASKS_PER_NODE"] = "2,1";
  EXPECT_EQ(env_of(base).local_world_size, 2);
  // MASTER_ADDR and MASTER_PORT, when set, win over what Slurm's variables imply.
  base["MASTER_ADDR"] = "head";
  base["MASTER_PORT"] = "29999";
  d = env_of(base);
  EXPECT_EQ(d.master_addr, "head");
  EXPECT_EQ(d.master_port, 29999);
  // Without a node list or job id, the defaults.
  d = env_of({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(d.local_world_size, 2);
}

TEST(DistEnv, SlurmBatchScriptIsOneProcess) {
  // A batch script (no srun step) carries the allocation's variables but is one process.
  DistEnv d = env_of({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "4"},
                      {"SLURM_LOCALID", "0"},
                      {"SLURM_JOB_NODELIST", "node[1-4]"},
                      {"SLURM_JOB_ID", "99"}});
  EXPECT_EQ(d.source, "none");
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, LaunchersInsideSlurm) {
  // porter launch (or mpirun) run from a batch script: every rank inherits SLURM_PROCID=0.
  DistEnv d = env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 3);
  d = env_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
              {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
  EXPECT_EQ(d.source, "openmpi");
  EXPECT_EQ(d.rank, 2);
  // srun starting one torchrun per node: Slurm's rank and size are the launcher's.
  d = env_of({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
              {"LOCAL_WORLD_SIZE", "4"}, {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"},
              {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.local_rank, 1);
  // srun started these very ranks and torchrun's variables agree: torchrun's win.
  d = env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_STEP_ID", "0"},
              {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.master_addr, "127.0.0.1");  // MASTER_ADDR is derived only when Slurm is the source
}

TEST(SlurmNodeList, FirstHost) {
  const std::pair<const char*, const char*> cases[] = {
      {"node[01-04,07]", "node01"},
      {"a,b", "a"},
      {"gpu-[3-5]", "gpu-3"},
      {"single", "single"},
      {"node[7]", "node7"},
      {"node[09,10-12]", "node09"},
      {"node[01-04,07],gpu[1-2]", "node01"},
      {"rack[1-2]-n[05-06]", "rack1-n05"},
      {"host.example.org,other", "host.example.org"},
  };
  for (const auto& [list, first] : cases) {
    EXPECT_EQ(slurm_first_host("SLURM_JOB_NODELIST", list), first) << list;
  }
  for (const char* bad : {"", "node[01-04", "node]", "node[]", "node[a-b]", "[,]", "x[[1]]"}) {
    try {
      slurm_first_host("SLURM_JOB_NODELIST", bad);
      ADD_FAILURE() << "expected InvalidArgument for \"" << bad << "\"";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_JOB_NODELIST"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
    }
  }
}

TEST(SlurmNodeList, TasksPerNodeAndPortFromJobId) {
  EXPECT_EQ(slurm_max_tasks_per_node("SLURM_TASKS_PER_NODE", "4"), 4);
  EXPECT_EQ(slurm_max_tasks_per_node("SLURM_TASKS_PER_NODE", "4(x2)"), 4);
  EXPECT_EQ(slurm_max_tasks_per_node("SLURM_TASKS_PER_NODE", "4(x2),3"), 4);
  EXPECT_EQ(slurm_max_tasks_per_node("SLURM_TASKS_PER_NODE", "1,8(x3),2"), 8);
  for (const char* bad : {"", "x", "4(x)", "4(2)", "4(x2", "4,", "-1"}) {
    EXPECT_THROW(slurm_max_tasks_per_node("SLURM_TASKS_PER_NODE", bad), InvalidArgument) << bad;
  }
  EXPECT_EQ(slurm_port_from_job_id(0), 10000);
  EXPECT_EQ(slurm_port_from_job_id(49999), 59999);
  EXPECT_EQ(slurm_port_from_job_id(50000), 10000);
  EXPECT_EQ(slurm_port_from_job_id(123456), 33456);
  EXPECT_EQ(slurm_port_from_job_id(18446744073709551615ull),
            10000 + 18446744073709551615ull % 50000);
}

TEST(DistEnv, SlurmMalformedAndDisagreeingValuesNameTheVariable) {
  const Vars srun = {{"SLURM_STEP_ID", "0"}};
  auto with = [&](Vars extra) {
    Vars v = srun;
    v.insert(extra.begin(), extra.end());
    return v;
  };
  const BadCase cases[] = {
      {"non-numeric procid", with({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}),
       "SLURM_PROCID"},
      {"procid without ntasks", with({{"SLURM_PROCID", "0"}}), "SLURM_NTASKS"},
      {"procid >= ntasks", with({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}),
       "SLURM_PROCID=2"},
      {"ntasks zero", with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}), "SLURM_NTASKS"},
      {"localid >= tasks per node",
       with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "2"},
             {"SLURM_TASKS_PER_NODE", "2(x2)"}}),
       "SLURM_LOCALID=2"},
      {"malformed tasks per node",
       with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(x"}}),
       "SLURM_TASKS_PER_NODE"},
      {"tasks per node > ntasks",
       with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "4"}}),
       "SLURM_TASKS_PER_NODE=4"},
      {"malformed job id",
       with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "j1"}}),
       "SLURM_JOB_ID"},
      {"malformed node list",
       with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[1-"}}),
       "SLURM_JOB_NODELIST"},
      {"torchrun and srun disagree on rank",
       with({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}}),
       "SLURM_PROCID=2"},
      {"torchrun and srun disagree on local rank",
       with({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"SLURM_PROCID", "1"},
             {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}}),
       "SLURM_LOCALID=0"},
      {"openmpi and srun disagree on rank",
       with({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
             {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}),
       "OMPI_COMM_WORLD_RANK=3"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string msg = error_of(c.vars);
    EXPECT_NE(msg.find(c.names), std::string::npos) << msg;
  }
  EXPECT_NE(error_of(cases[9].vars).find("srun"), std::string::npos);
}

// --- the store token ---------------------------------------------------------------------

std::string write_file(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + "/porter_env_test_" + name;
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

TEST(DistEnv, StoreTokenFromTheVariableOrAFile) {
  EXPECT_EQ(env_of({}).store_token, "");
  EXPECT_EQ(env_of({{"PORTER_STORE_TOKEN", "s3cret"}}).store_token, "s3cret");
  const std::string lf = write_file("lf", "from-file\n");
  EXPECT_EQ(env_of({{"PORTER_STORE_TOKEN_FILE", lf}}).store_token, "from-file");
  const std::string crlf = write_file("crlf", "from-file\r\n");
  EXPECT_EQ(env_of({{"PORTER_STORE_TOKEN_FILE", crlf}}).store_token, "from-file");
  const std::string bare = write_file("bare", "from-file");
  EXPECT_EQ(env_of({{"PORTER_STORE_TOKEN_FILE", bare}}).store_token, "from-file");
  // Both set and equal: fine.
  EXPECT_EQ(env_of({{"PORTER_STORE_TOKEN", "from-file"}, {"PORTER_STORE_TOKEN_FILE", lf}})
                .store_token,
            "from-file");
  // The token does not depend on the launcher.
  EXPECT_EQ(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"PORTER_STORE_TOKEN", "t"}}).store_token,
            "t");
}

TEST(DistEnv, StoreTokenErrors) {
  const std::string lf = write_file("lf2", "from-file\n");
  std::string msg = error_of({{"PORTER_STORE_TOKEN", "other"}, {"PORTER_STORE_TOKEN_FILE", lf}});
  EXPECT_NE(msg.find("differ"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("other"), std::string::npos) << "a token must never be printed: " << msg;
  EXPECT_EQ(msg.find("from-file"), std::string::npos) << "a token must never be printed: " << msg;

  const std::string missing = ::testing::TempDir() + "/porter_env_test_no_such_file";
  msg = error_of({{"PORTER_STORE_TOKEN_FILE", missing}});
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot be read"), std::string::npos) << msg;

  msg = error_of({{"PORTER_STORE_TOKEN_FILE", write_file("empty", "")}});
  EXPECT_NE(msg.find("is empty"), std::string::npos) << msg;
  msg = error_of({{"PORTER_STORE_TOKEN_FILE", write_file("newline", "\n")}});
  EXPECT_NE(msg.find("is empty"), std::string::npos) << msg;
  msg = error_of({{"PORTER_STORE_TOKEN_FILE", ::testing::TempDir()}});
  EXPECT_NE(msg.find("directory"), std::string::npos) << msg;

  msg = error_of({{"PORTER_STORE_TOKEN", ""}});
  EXPECT_NE(msg.find("PORTER_STORE_TOKEN is set but empty"), std::string::npos) << msg;
  msg = error_of({{"PORTER_STORE_TOKEN_FILE", ""}});
  EXPECT_NE(msg.find("PORTER_STORE_TOKEN_FILE is set but empty"), std::string::npos) << msg;
  msg = error_of({{"PORTER_STORE_TOKEN", std::string(kMaxStoreTokenBytes + 1, 'x')}});
  EXPECT_NE(msg.find(std::to_string(kMaxStoreTokenBytes)), std::string::npos) << msg;
  msg = error_of({{"PORTER_STORE_TOKEN_FILE",
                   write_file("long", std::string(kMaxStoreTokenBytes + 1, 'x'))}});
  EXPECT_NE(msg.find("PORTER_STORE_TOKEN_FILE"), std::string::npos) << msg;
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
                         "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_NTASKS",
                         "SLURM_LOCALID", "PORTER_STORE_TOKEN", "PORTER_STORE_TOKEN_FILE"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
    ::unsetenv(n);
  }
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "29501", 1);
  ::setenv("PORTER_STORE_TOKEN", "tok", 1);
  DistEnv d = dist_env_from_process();
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.master_port, 29501);
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.store_token, "tok");
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
