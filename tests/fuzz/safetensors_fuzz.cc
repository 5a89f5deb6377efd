// libFuzzer target for the safetensors reader (SafetensorsFile, porter::io::read_safetensors):
// the bytes of a file porter may be handed from anywhere. Any input must either open or throw
// IoError; when it opens, the tensors must tile the data in offset order with numel x dtype
// size bytes each, every byte must be readable, find() must return each tensor, and
// porter::io::read_safetensors must give the same tensors (or refuse a dtype porter does not compute in,
// by name). Anything else (another exception, a sanitizer report, a crash, a hang) is a bug.
// Built as a fuzzer with -DPORTER_FUZZ=ON (clang); replay_test.cc runs the committed corpus
// (tests/fuzz/safetensors_corpus) through the same function in the normal build.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "base/error.h"
#include "io/weights_file.h"

namespace {

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) throw std::logic_error(std::string("safetensors fuzz invariant broken: ") + what + "\n" + detail);
}

size_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  return 1;
}

void fuzz_file(const std::filesystem::path& path, uint64_t size) {
  using namespace porter::io;
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(path);
  } catch (const porter::IoError&) {
    return;  // refused with a message: fine
  }
  check(file->file_bytes() == size, "file_bytes", std::to_string(file->file_bytes()));
  const std::byte* next = nullptr;
  uint64_t data_bytes = 0;
  unsigned sum = 0;
  bool porter_dtypes = true;
  for (const SafetensorsEntry& e : file->tensors()) {
    const std::span<const std::byte> bytes = file->bytes(e);
    check(bytes.size() == e.end - e.begin, "bytes() size", e.name);
    check(bytes.size() == static_cast<uint64_t>(e.numel) * dtype_bytes(e.dtype), "numel x dtype size", e.name);
    check(next == nullptr || bytes.data() == next, "tensors do not tile the data", e.name);
    next = bytes.data() + bytes.size();
    data_bytes += bytes.size();
    for (std::byte b : bytes) sum += std::to_integer<unsigned>(b);  // every byte readable
    check(file->find(e.name) == &e, "find()", e.name);
    porter_dtypes = porter_dtypes && e.porter_dtype.has_value();
  }
  check(data_bytes <= size, "more data than the file", std::to_string(data_bytes));
  try {
    const std::vector<porter::io::WeightTensor> read = porter::io::read_safetensors(path);
    check(porter_dtypes, "read_safetensors read a dtype porter does not compute in", "");
    check(read.size() == file->tensors().size(), "read_safetensors tensor count", "");
    for (size_t i = 0; i < read.size(); ++i) {
      const SafetensorsEntry& e = file->tensors()[i];
      const std::span<const std::byte> bytes = file->bytes(e);
      check(read[i].name == e.name && read[i].shape == e.shape, "read_safetensors tensor", e.name);
      check(std::equal(bytes.begin(), bytes.end(), read[i].bytes.begin(), read[i].bytes.end()),
            "read_safetensors bytes", e.name);
    }
  } catch (const porter::IoError& err) {
    check(!porter_dtypes, "read_safetensors refused a file SafetensorsFile opened", err.what());
  }
  (void)sum;
}

}  // namespace

// The reader maps a file: each input goes to one of this process's own, removed at exit.
struct InputFile {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
      ("porter_safetensors_fuzz_" + std::to_string(::getpid()) + ".safetensors");
  ~InputFile() {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
  }
};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const InputFile input;
  const std::filesystem::path& path = input.path;
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) throw std::runtime_error("safetensors fuzz: cannot write " + path.string());
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  fuzz_file(path, size);
  return 0;
}
