// Tensor: a dtype, a shape and a view into memory from porter's allocator (or a view into
// memory someone else owns, such as the flat parameter buffer). Row-major and contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/category.h"
#include "memory/device.h"
#include "tensor/dtype.h"

namespace porter::tensor {

inline constexpr int kMaxRank = 4;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t numel() const;
  std::vector<int64_t> to_vector() const { return {dims_.begin(), dims_.begin() + rank_}; }
  std::string to_string() const;  // "(4, 512, 768)"
  bool operator==(const Shape& o) const = default;

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;

  // Allocates from `allocator`; the memory lives as long as any Tensor viewing it.
  static Tensor empty(memory::CachingAllocator& allocator, Shape shape, DType dtype,
                      memory::Category category);
  // A view of memory owned elsewhere (flat buffers, arena slots). The caller keeps it alive.
  static Tensor from_blob(void* data, Shape shape, DType dtype,
                          memory::Category category = memory::Category::kWorkspace);

  bool defined() const { return data_ != nullptr || shape_.numel() == 0; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t dim(int i) const { return shape_[i < 0 ? i + shape_.rank() : i]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  // The category of the memory (of the whole allocation, for views of one).
  memory::Category category() const { return storage_ ? storage_->category() : category_; }
  // Moves the whole underlying allocation to `category` (memory::CachingAllocator::retag);
  // for a view of foreign memory only this Tensor's label changes.
  void retag(memory::Category category);
  // Tells the allocator that `stream` uses this tensor's memory, so freeing it waits for
  // the stream's queued work (Note [Deferred free]). No-op for views of foreign memory.
  void record_stream(memory::Stream& stream) const;

  void* data() const { return data_; }
  // Typed access; throws InvalidArgument when T does not match the dtype
  // (float: f32, uint16_t: bf16/f16, int32_t: i32).
  template <typename T>
  T* data_as() const;

  // Same memory, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along dimension 0.
  Tensor slice(int64_t begin, int64_t end) const;
  // Same memory (ownership shared), its first shape.numel() x dtype_size(dtype) bytes as
  // `shape` and `dtype`: a byte buffer seen as the tensor it holds (the gathered copy of a
  // partitioned checkpoint). Throws InvalidArgument when that is more than nbytes().
  Tensor reinterpret(Shape shape, DType dtype) const;

  // Whether this tensor owns (shares ownership of) its memory.
  bool owns_memory() const { return storage_ != nullptr; }

 private:
  std::shared_ptr<memory::DeviceBuffer> storage_;  // null for views of foreign memory
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kF32;
  memory::Category category_ = memory::Category::kWorkspace;
};

// Copies a tensor's bytes to the host (through the compute stream, then waits), converting
// bf16/f16 to f32 when asked. For tests, .npy dumps and debugging, not for the hot path.
std::vector<float> to_host_f32(memory::Device& device, const Tensor& t);
// Copies host floats into a tensor (f32, or rounded to bf16 or f16), through the compute
// stream.
void from_host_f32(memory::Device& device, const std::vector<float>& values, Tensor& t);

}  // namespace porter::tensor
