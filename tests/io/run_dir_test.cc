// Run directories (Note [Run directory] in io/run_dir.h): names, publishing, pruning, and the
// order and checks of resume candidates.
#include "io/run_dir.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "base/error.h"
#include "io/state_file.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;

class RunDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("porter_run_dir_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A one-rank checkpoint of step `step` written as a save would: into the pending directory,
  // then published.
  void save(int64_t step, int64_t keep, int ranks = 1) {
    const fs::path pending = pending_checkpoint_dir(dir_, step);
    for (int r = 0; r < ranks; ++r) {
      const fs::path d = ranks == 1 ? pending : pending / ("rank" + std::to_string(r));
      nlohmann::json meta = {{"kind", "porter.engine"}, {"step", step}, {"dp_size", ranks}};
      write_state(d, meta, {{"params", std::vector<std::byte>(64, std::byte{7})}});
    }
    publish_checkpoint(dir_, step, keep);
  }

  fs::path dir_;
};

TEST(RunDirNames, StepDirectoriesHaveOneSpelling) {
  EXPECT_EQ(step_dir_name(0), "step-0");
  EXPECT_EQ(step_dir_name(12000), "step-12000");
  EXPECT_EQ(parse_step_dir_name("step-12000"), 12000);
  EXPECT_EQ(parse_step_dir_name("step-0"), 0);
  for (const char* bad : {"step-", "step-007", "step--1", "step-1a", "Step-1", "step-1.tmp",
                          "latest", "step-99999999999999999999"}) {
    EXPECT_FALSE(parse_step_dir_name(bad).has_value()) << bad;
  }
}

TEST_F(RunDirTest, PublishRenamesPointsLatestAndKeepsTheNewest) {
  save(2, 2);
  EXPECT_EQ(read_latest(dir_), 2);
  save(4, 2);
  save(6, 2);
  EXPECT_EQ(read_latest(dir_), 6);
  EXPECT_FALSE(fs::exists(dir_ / "step-2"));
  EXPECT_TRUE(fs::exists(dir_ / "step-4" / "meta.json"));
  EXPECT_TRUE(fs::exists(dir_ / "step-6" / "meta.json"));
  EXPECT_FALSE(fs::exists(pending_checkpoint_dir(dir_, 6)));
  EXPECT_FALSE(fs::exists(dir_ / ".latest.tmp"));
}

TEST_F(RunDirTest, LeftoversOfAnEarlierAttemptAreReplacedOrRemoved) {
  save(2, 3);
  // A write of step 3 that died part-way, and a step 4 published before latest was replaced.
  fs::create_directories(pending_checkpoint_dir(dir_, 3) / "rank0");
  save(4, 3);
  std::ofstream(dir_ / "step-4" / "stale") << "x";
  save(4, 3);  // the same step again (a restarted world)
  EXPECT_FALSE(fs::exists(dir_ / "step-4" / "stale"));
  EXPECT_FALSE(fs::exists(pending_checkpoint_dir(dir_, 3)));
  EXPECT_EQ(read_latest(dir_), 4);
}

TEST_F(RunDirTest, CandidatesAreLatestFirstThenNewestDown) {
  save(2, 10);
  save(4, 10);
  save(6, 10);
  std::ofstream(dir_ / "latest") << "step-4\n";  // as if step 6's latest were never written
  const std::vector<fs::path> c = resume_candidates(dir_);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0], dir_ / "step-4");
  EXPECT_EQ(c[1], dir_ / "step-6");
  EXPECT_EQ(c[2], dir_ / "step-2");
  // One checkpoint is its own only candidate.
  EXPECT_EQ(resume_candidates(dir_ / "step-2"), std::vector<fs::path>{dir_ / "step-2"});
}

TEST_F(RunDirTest, NeitherACheckpointNorARunDirectoryIsNamed) {
  try {
    resume_candidates(dir_);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("not a run directory (no latest or step-<N>)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(resume_candidates(dir_ / "missing"), IoError);
}

TEST_F(RunDirTest, ChecksFindTornAndCorruptSectionsOfTheirShare) {
  save(2, 10, /*ranks=*/3);
  const fs::path ckpt = dir_ / "step-2";
  EXPECT_EQ(check_checkpoint(ckpt, 0, 2), "");
  EXPECT_EQ(check_checkpoint(ckpt, 1, 2), "");
  // Rank 1 of 3 is checked by rank 1 of a 2-rank world (1 % 2), not by rank 0.
  fs::resize_file(ckpt / "rank1" / "params.bin", 10);
  EXPECT_EQ(check_checkpoint(ckpt, 0, 2), "");
  EXPECT_NE(check_checkpoint(ckpt, 1, 2).find("truncated"), std::string::npos);
  // One rank checks them all.
  EXPECT_NE(check_checkpoint(ckpt, 0, 1), "");
  // A flipped byte is a checksum mismatch.
  save(4, 10, 1);
  {
    std::fstream f(dir_ / "step-4" / "params.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x01');
  }
  EXPECT_NE(check_checkpoint(dir_ / "step-4", 0, 1).find("checksum mismatch"), std::string::npos);
  EXPECT_NE(check_checkpoint(dir_ / "missing", 0, 1), "");
}

}  // namespace
}  // namespace porter::io
