// Model weights as safetensors files (the format of Hugging Face's safetensors library): a
// writer, a validating reader, and the split of a flat parameter buffer into its tensors.
//
// Note [Safetensors format]
// A file is
//   [8 bytes] N, the header length, u64 little-endian
//   [N bytes] a JSON object: {"__metadata__": {string: string, ...},
//             "<name>": {"dtype": "F32"|"BF16"|"F16"|"I32", "shape": [d0, ...],
//                        "data_offsets": [begin, end]}, ...}
//             padded with spaces (0x20) so that 8 + N is a multiple of 8
//   [rest]    the data: each tensor's bytes, little-endian, C order, at [begin, end) relative
//             to the start of the data
// The tensors tile the data exactly: sorted by offset, the first begins at 0, each begins
// where the previous ends, and the last ends at the end of the file; end - begin is
// numel * dtype size. porter writes them in the order given, "__metadata__" first (omitted
// when empty), and reads them back in offset order, which for its own files is that order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tensor/dtype.h"
#include "nn/layer.h"

namespace porter::io {

struct WeightTensor {
  std::string name;              // e.g. "h.3.fc1.weight"
  std::vector<int64_t> shape;    // () for a scalar
  tensor::DType dtype = tensor::DType::kF32;
  std::vector<std::byte> bytes;  // numel * dtype_size, little-endian, C order
  int64_t numel() const;  // -1 for a negative dimension or a product that overflows
};

using WeightMetadata = std::map<std::string, std::string>;

// "F32", "BF16", "F16", "I32".
std::string_view safetensors_dtype_name(tensor::DType dtype);

// Writes `tensors` (in this order) and `metadata` to `path`, atomically: the bytes go to a
// temporary file beside it, which is flushed and renamed over `path`; the parent directory is
// created. Throws InvalidArgument for an empty, repeated or reserved ("__metadata__") name or
// a byte count that is not numel * dtype size, and IoError naming the path when a file cannot
// be written.
void write_safetensors(const std::filesystem::path& path, const std::vector<WeightTensor>& tensors,
                       const WeightMetadata& metadata = {});

// Reads a whole file, tensors in offset order, and its "__metadata__" into `metadata` when
// given. Throws IoError naming the file and the problem: missing or unreadable, shorter than
// 8 bytes, a header length beyond the file or above 100 MB, a header that is not a JSON
// object, metadata that is not strings, an unknown dtype, a bad shape, data offsets out of
// the data, overlapping, leaving a gap or not matching numel * dtype size. Only porter's
// dtypes (F32, BF16, F16, I32) are read; SafetensorsFile also maps files with the others.
std::vector<WeightTensor> read_safetensors(const std::filesystem::path& path,
                                           WeightMetadata* metadata = nullptr);

// One tensor of a SafetensorsFile, as its header describes it (checked against the file).
struct SafetensorsEntry {
  std::string name;
  std::string dtype;                      // as the header spells it: "F32", "BF16", "F64", ...
  std::optional<tensor::DType> porter_dtype;  // F32, BF16, F16, I32; none for the other dtypes
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0, end = 0;  // bytes, relative to the start of the data
};

// A safetensors file mapped read-only (mmap), for weights too large to copy whole: opening it
// reads and checks only the header, by every rule of read_safetensors (Note [Safetensors
// format]), with the byte sizes of every dtype the safetensors format defines (BOOL, U8, I8,
// F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64), so that a
// caller can refuse an unsupported one by name. A tensor's bytes are read from the page cache
// only when bytes() is touched. The file must not shrink while it is mapped (reading a page
// past its new end raises SIGBUS, as for any mapping). Move-only; unmaps on destruction.
class SafetensorsFile {
 public:
  // Throws IoError naming the file and the problem, as read_safetensors does, and for a path
  // that is not a regular file.
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint64_t file_bytes() const { return file_bytes_; }
  // In offset order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const WeightMetadata& metadata() const { return metadata_; }
  // The tensor named `name`; null when the file has none.
  const SafetensorsEntry* find(std::string_view name) const;
  // A view of `e`'s bytes (little-endian, C order) in the mapping, valid while this lives.
  std::span<const std::byte> bytes(const SafetensorsEntry& e) const;

 private:
  void unmap() noexcept;
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;  // owned: the mapping of the whole file, map_bytes_ long
  size_t map_bytes_ = 0;
  uint64_t file_bytes_ = 0;
  uint64_t data_begin_ = 0;  // 8 + the header length
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  WeightMetadata metadata_;
};

// One parameter of a flat buffer (nn::ParamLayout's entries; meta.json's "layout").
struct FlatTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset_elems = 0;
};

std::vector<FlatTensorSpec> layout_specs(const nn::ParamLayout& layout);
// From a training checkpoint's "layout" ({"total_elems", "params": [{"name", "shape",
// "offset"}, ...]}, Note [Engine state] in engine/state.cc). Throws IoError starting with
// `what` (the meta.json it came from) naming the field that is missing or malformed, or a
// parameter that does not fit in total_elems.
std::vector<FlatTensorSpec> layout_specs(const nlohmann::json& layout, const std::string& what);

// The tensors of a host copy of a flat buffer whose elements are `dtype` (the alignment
// padding between tensors and the tail past the last one are skipped). Throws
// InvalidArgument when `flat_bytes` is shorter than the last tensor's end or is not a whole
// number of elements.
std::vector<WeightTensor> layout_tensors(std::span<const FlatTensorSpec> specs, tensor::DType dtype,
                                         std::span<const std::byte> flat_bytes);
std::vector<WeightTensor> layout_tensors(const nn::ParamLayout& layout, tensor::DType dtype,
                                         std::span<const std::byte> flat_bytes);

// `bytes` of `from` elements as f32 (bf16 and f16 widen exactly; f32 is copied).
std::vector<std::byte> to_f32_bytes(tensor::DType from, std::span<const std::byte> bytes);

}  // namespace porter::io
