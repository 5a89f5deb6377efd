// PORTER_CHECK* print both operands and throw the right type; PORTER_ASSERT means a bug.
#include "base/check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace porter {
namespace {

using ::testing::HasSubstr;

TEST(CheckTest, CheckThrowsInvalidArgumentWithMessage) {
  try {
    int stage = 7;
    PORTER_CHECK(stage <= 3, "zero_optimization.stage must be 0..3, got ", stage);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("zero_optimization.stage must be 0..3, got 7"));
    EXPECT_THAT(e.what(), HasSubstr("stage <= 3"));
  }
}

TEST(CheckTest, ComparisonChecksPrintBothOperands) {
  size_t a = 12, b = 40;
  try {
    PORTER_CHECK_EQ(a, b, "sizes differ");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("a == b (12 vs 40)"));
    EXPECT_THAT(e.what(), HasSubstr("sizes differ"));
  }
  EXPECT_THROW(PORTER_CHECK_GT(a, b), InvalidArgument);
  EXPECT_THROW(PORTER_CHECK_GE(a, b), InvalidArgument);
  EXPECT_THROW(PORTER_CHECK_LT(b, a), InvalidArgument);
  EXPECT_THROW(PORTER_CHECK_LE(b, a), InvalidArgument);
  EXPECT_THROW(PORTER_CHECK_NE(a, a), InvalidArgument);
  EXPECT_NO_THROW(PORTER_CHECK_LT(a, b));
  EXPECT_NO_THROW(PORTER_CHECK_NE(a, b));
}

TEST(CheckTest, OperandsAreEvaluatedOnce) {
  int calls = 0;
  auto next = [&] { return ++calls; };
  PORTER_CHECK_EQ(next(), 1);
  EXPECT_EQ(calls, 1);
}

TEST(CheckTest, CStringsPrintAsTextAndPointersAsAddresses) {
  const char* op = "release";
  const char* none = nullptr;
  std::string s = str_cat("op ", op, " at ", static_cast<void*>(nullptr), " ", none);
  EXPECT_EQ(s, "op release at 0 (null)");
}

TEST(CheckTest, TypedCheckThrowsGivenType) {
  EXPECT_THROW(PORTER_CHECK_T(UsageError, false, "double free"), UsageError);
}

TEST(CheckTest, AssertIsAlwaysOnAndNamesABug) {
  try {
    PORTER_ASSERT(1 + 1 == 3, "arithmetic");
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("bug in porter"));
    EXPECT_THAT(e.what(), HasSubstr("1 + 1 == 3"));
  }
}

TEST(CheckTest, ErrorsShareOneBase) {
  EXPECT_THROW(throw OutOfMemoryError("oom", 5), Error);
  EXPECT_THROW(throw TimeoutError("t"), Error);
  EXPECT_THROW(throw PeerError("p"), Error);
  EXPECT_THROW(throw CudaError("c"), Error);
  EXPECT_EQ(OutOfMemoryError("oom", 5).requested_bytes(), 5u);
}

}  // namespace
}  // namespace porter
