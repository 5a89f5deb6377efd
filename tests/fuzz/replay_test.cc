// Replays every file of tests/fuzz/corpus through the fuzz target, so that the normal build's
// ctest keeps every input the fuzzer has ever found interesting passing.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

TEST(ConfigFuzzCorpus, EveryInputPasses) {
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
  EXPECT_GE(files, 20u) << "the corpus in " << dir << " went missing";
}

TEST(ConfigFuzzCorpus, EmptyInput) { EXPECT_NO_THROW(LLVMFuzzerTestOneInput(nullptr, 0)); }

}  // namespace
