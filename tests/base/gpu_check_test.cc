// PORTER_GPU_CHECK and PORTER_GPU_WARN over a fake library's status type: the messages of
// CUDA, cuBLAS and NCCL failures, checked without a GPU.
#include "base/gpu_check.h"

#include <memory>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "base/log.h"

namespace {

enum class FakeStatus { kOk, kBusy, kBad, kNoName };
enum class FakeCommStatus { kOk, kBad };

const char* fake_comm_name(FakeCommStatus) { return "fake comm error"; }
const char* fake_comm_detail(FakeCommStatus) { return "peer gone"; }

int calls = 0;
FakeStatus fake_call(FakeStatus s) {
  ++calls;
  return s;
}

}  // namespace

namespace porter {

template <>
struct GpuStatus<FakeStatus> {
  using Error = CudaError;
  // kBusy stands for ncclInProgress: a status that is not a failure.
  static bool ok(FakeStatus s) { return s == FakeStatus::kOk || s == FakeStatus::kBusy; }
  static const char* name(FakeStatus s) { return s == FakeStatus::kNoName ? nullptr : "fakeBad"; }
  static const char* detail(FakeStatus) { return "it went bad"; }
};

template <>
struct GpuStatus<FakeCommStatus> : GpuStatusOf<FakeCommStatus, FakeCommStatus::kOk, NcclError,
                                               fake_comm_name, fake_comm_detail> {};

namespace {

std::string here(int line) { return std::string(__FILE__) + ":" + std::to_string(line); }

TEST(GpuCheckTest, SuccessEvaluatesTheStatementOnce) {
  calls = 0;
  PORTER_GPU_CHECK(fake_call(FakeStatus::kOk), 0);
  PORTER_GPU_CHECK(fake_call(FakeStatus::kBusy), 0);
  EXPECT_EQ(calls, 2);
}

TEST(GpuCheckTest, FailureThrowsTheLibrarysErrorWithStatementDeviceAndPlace) {
  calls = 0;
  int line = 0;
  try {
    line = __LINE__ + 1;
    PORTER_GPU_CHECK(fake_call(FakeStatus::kBad), 3);
    FAIL() << "no throw";
  } catch (const CudaError& e) {
    EXPECT_EQ(std::string(e.what()), "fake_call(FakeStatus::kBad) failed on cuda:3 at " +
                                         here(line) + ": fakeBad (it went bad)");
  }
  EXPECT_EQ(calls, 1);
}

TEST(GpuCheckTest, EachLibraryThrowsItsOwnErrorType) {
  const FakeCommStatus s = FakeCommStatus::kBad;
  try {
    PORTER_GPU_CHECK(s, 1);
    FAIL() << "no throw";
  } catch (const NcclError& e) {
    EXPECT_THAT(e.what(), ::testing::StartsWith("s failed on cuda:1 at "));
    EXPECT_THAT(e.what(), ::testing::EndsWith(": fake comm error (peer gone)"));
  }
}

TEST(GpuCheckTest, NullNamesPrintAsNull) {
  try {
    PORTER_GPU_CHECK(FakeStatus::kNoName, 0);
    FAIL() << "no throw";
  } catch (const CudaError& e) {
    EXPECT_THAT(e.what(), ::testing::EndsWith(": (null) (it went bad)"));
  }
}

TEST(GpuCheckTest, WarnLogsAndSwallows) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto& lg = log::logger();
  lg.sinks().push_back(sink);
  calls = 0;
  PORTER_GPU_WARN(fake_call(FakeStatus::kOk));
  const int line = __LINE__ + 1;
  PORTER_GPU_WARN(fake_call(FakeStatus::kBad));
  lg.flush();
  lg.sinks().pop_back();
  EXPECT_EQ(calls, 2);
  const std::string text = out.str();
  EXPECT_THAT(text, ::testing::HasSubstr("fake_call(FakeStatus::kBad) failed at " + here(line) +
                                         ": fakeBad (it went bad)"));
  EXPECT_EQ(text.find("kOk"), std::string::npos) << text;
}

}  // namespace
}  // namespace porter
