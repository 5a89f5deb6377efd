// Replays every file of a committed corpus (PORTER_FUZZ_CORPUS_DIR) through the fuzz target it
// is linked with, so that the normal build's ctest keeps every input the fuzzer has ever found
// interesting passing. PORTER_FUZZ_SUITE names the test suite and PORTER_FUZZ_MIN_FILES is
// how many files the corpus must at least hold (the config parser's by default).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#ifndef PORTER_FUZZ_SUITE
#define PORTER_FUZZ_SUITE ConfigFuzzCorpus
#endif
#ifndef PORTER_FUZZ_MIN_FILES
#define PORTER_FUZZ_MIN_FILES 20
#endif

namespace {

TEST(PORTER_FUZZ_SUITE, EveryInputPasses) {
  const std::filesystem::path dir = PORTER_FUZZ_CORPUS_DIR;
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    SCOPED_TRACE(entry.path().string());
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NO_THROW(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                           bytes.size()));
    ++files;
  }
  EXPECT_GE(files, size_t{PORTER_FUZZ_MIN_FILES}) << "the corpus in " << dir << " went missing";
}

TEST(PORTER_FUZZ_SUITE, EmptyInput) { EXPECT_NO_THROW(LLVMFuzzerTestOneInput(nullptr, 0)); }

}  // namespace
