// The cpu feature query of Note [Cpu ISA dispatch] (kernels/cpu/isa.h): cpu_runs agrees with
// cpu_features field by field and for the lists porter's code is compiled for, and a name it
// does not know is an error rather than a silent "no".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "base/error.h"
#include "kernels/cpu/isa.h"

namespace porter::kernels::cpu {
namespace {

TEST(CpuIsa, RunsAgreesWithFeatures) {
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(cpu_runs("avx2"), f.avx2);
  EXPECT_EQ(cpu_runs("fma"), f.fma);
  EXPECT_EQ(cpu_runs("avx512f"), f.avx512f);
  EXPECT_EQ(cpu_runs("avx512bf16"), f.avx512bf16);
  EXPECT_EQ(cpu_runs("amx-bf16"), f.amx_bf16);
  EXPECT_EQ(cpu_runs(PORTER_ISA_AVX512), f.avx512f && f.avx512bw);
  EXPECT_EQ(cpu_runs(PORTER_ISA_TILES_F32),
            f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl && f.fma);
  EXPECT_EQ(cpu_runs(PORTER_ISA_TILES_BF16), cpu_runs(PORTER_ISA_TILES_F32) && f.avx512bf16);
  EXPECT_TRUE(cpu_runs(""));
}

TEST(CpuIsa, WiderListsImplyNarrowerOnes) {
  if (cpu_runs(PORTER_ISA_TILES_BF16)) EXPECT_TRUE(cpu_runs(PORTER_ISA_TILES_F32));
  if (cpu_runs(PORTER_ISA_TILES_F32)) EXPECT_TRUE(cpu_runs(PORTER_ISA_AVX512));
  if (cpu_runs(PORTER_ISA_AVX512)) EXPECT_TRUE(cpu_runs(PORTER_ISA_AVX2));
}

TEST(CpuIsa, FeaturesStringListsWhatItHas) {
  const std::string s = cpu_features_string();
  EXPECT_EQ(s.find("avx2") != std::string::npos, cpu_features().avx2) << s;
  EXPECT_EQ(s.find("avx512f") != std::string::npos, cpu_features().avx512f) << s;
}

TEST(CpuIsa, UnknownFeatureThrows) {
  try {
    cpu_runs("avx2,sse9");
    ADD_FAILURE() << "no error for an unknown feature";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("\"sse9\""));
  }
}

}  // namespace
}  // namespace porter::kernels::cpu
