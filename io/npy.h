// .npy files (NumPy's format, versions 1.0, 2.0 and 3.0): how tests, users and debugging
// tools exchange tensors with porter. Little-endian f4, i4, and bf16 stored as '<u2' (its raw
// bits; NumPy has no bf16) or converted to f4.
//
// Note [npy dtypes]
// NumPy has no bfloat16, so a bf16 tensor is written either as its raw 16-bit patterns with
// descr '<u2' (exact, and numpy/torch code reinterprets it: torch.from_numpy(a.view(np.int16))
// .view(torch.bfloat16)), or widened to '<f4' (exact too, since every bf16 is an f32).
// Reading '<u2' into porter always means bf16 bits. Malformed files raise IoError naming
// the file and the byte offset where parsing failed.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace porter::io {

struct NpyArray {
  tensor::DType dtype = tensor::DType::kF32;         // kF32 ('<f4'), kI32 ('<i4') or kBF16 ('<u2')
  std::vector<int64_t> shape;        // () for a scalar
  std::vector<std::byte> data;       // little-endian, C order
  int64_t numel() const;
};

// Reads a whole .npy file; throws IoError on a missing, malformed or truncated file.
NpyArray read_npy(const std::string& path);
// Parses .npy bytes; `what` names the source in error messages.
NpyArray parse_npy(const std::byte* bytes, size_t size, const std::string& what);

// Writes `numel` elements of `dtype` with `shape` (bf16 as '<u2'). Throws IoError when the
// file cannot be written. Version 1.0 unless the header needs 2.0.
void write_npy(const std::string& path, const void* data, tensor::DType dtype,
               const std::vector<int64_t>& shape);
// The bytes of such a file (for tests).
std::vector<std::byte> encode_npy(const void* data, tensor::DType dtype, const std::vector<int64_t>& shape);

// The array as f32 values: f4 as is, bf16 ('<u2') widened, i4 converted.
std::vector<float> npy_to_f32(const NpyArray& a);

// Device tensors: save copies to the host first; bf16 is written as '<u2', or as '<f4' when
// `bf16_as_f32`. load allocates a tensor of `dtype` (converting f4 <-> bf16 as needed; i4
// only into i32) in `category`.
void save_tensor_npy(const std::string& path, memory::Device& device, const tensor::Tensor& t,
                     bool bf16_as_f32 = false);
tensor::Tensor load_tensor_npy(const std::string& path, memory::CachingAllocator& allocator, tensor::DType dtype,
                       memory::Category category = memory::Category::kWorkspace);

}  // namespace porter::io
