// Tensor shapes, views and host transfers.
#include "tensor/tensor.h"

#include <cstring>

#include "base/check.h"

namespace porter::tensor {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::vector<int64_t>(dims)) {}

Shape::Shape(const std::vector<int64_t>& dims) {
  PORTER_CHECK_LE(dims.size(), size_t{kMaxRank}, "tensor rank");
  rank_ = static_cast<int>(dims.size());
  for (int i = 0; i < rank_; ++i) {
    PORTER_CHECK_GE(dims[i], 0, "tensor dimension ", i);
    dims_[i] = dims[i];
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

std::string Shape::to_string() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Tensor Tensor::empty(memory::CachingAllocator& allocator, Shape shape, DType dtype,
                     memory::Category category) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.category_ = category;
  if (t.nbytes() > 0) {
    t.storage_ = std::make_shared<memory::DeviceBuffer>(allocator.allocate(t.nbytes(), category));
    t.data_ = t.storage_->data();
  }
  return t;
}

void Tensor::retag(memory::Category category) {
  if (storage_) storage_->retag(category);
  category_ = category;
}

void Tensor::record_stream(memory::Stream& stream) const {
  if (storage_) storage_->record_stream(stream);
}

Tensor Tensor::from_blob(void* data, Shape shape, DType dtype, memory::Category category) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.category_ = category;
  t.data_ = data;
  PORTER_CHECK(data != nullptr || t.nbytes() == 0, "from_blob of ", shape.to_string(),
               " with a null pointer");
  return t;
}

template <typename T>
T* Tensor::data_as() const {
  bool ok = false;
  if constexpr (std::is_same_v<T, float>) ok = dtype_ == DType::kF32;
  else if constexpr (std::is_same_v<T, uint16_t>) ok = dtype_ == DType::kBF16 || dtype_ == DType::kF16;
  else if constexpr (std::is_same_v<T, int32_t>) ok = dtype_ == DType::kI32;
  PORTER_CHECK(ok, "tensor of dtype ", dtype_name(dtype_), " accessed as another element type");
  return static_cast<T*>(data_);
}

template float* Tensor::data_as<float>() const;
template uint16_t* Tensor::data_as<uint16_t>() const;
template int32_t* Tensor::data_as<int32_t>() const;

Tensor Tensor::reshape(Shape shape) const {
  PORTER_CHECK_EQ(shape.numel(), numel(), "reshape ", shape_.to_string(), " -> ", shape.to_string());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::reinterpret(Shape shape, DType dtype) const {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  PORTER_CHECK(bytes <= nbytes(), "reinterpret of ", nbytes(), " bytes (", shape_.to_string(), " ",
               dtype_name(dtype_), ") as ", shape.to_string(), " ", dtype_name(dtype), ", which needs ",
               bytes, " bytes");
  Tensor t = *this;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  PORTER_CHECK_GE(rank(), 1, "slice of a scalar");
  PORTER_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
               ") of dimension 0 of ", shape_.to_string());
  std::vector<int64_t> dims = shape_.to_vector();
  int64_t row_elems = dims[0] == 0 ? 0 : numel() / dims[0];
  dims[0] = end - begin;
  Tensor t = *this;
  t.shape_ = Shape(dims);
  t.data_ = static_cast<std::byte*>(data_) + begin * row_elems * static_cast<int64_t>(dtype_size(dtype_));
  return t;
}

std::vector<float> to_host_f32(memory::Device& device, const Tensor& t) {
  std::vector<std::byte> raw(t.nbytes());
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (raw.empty()) return out;  // an empty tensor (no data pointer to copy from)
  device.copy_sync(raw.data(), t.data(), raw.size());
  switch (t.dtype()) {
    case DType::kF32:
      std::memcpy(out.data(), raw.data(), raw.size());
      break;
    case DType::kBF16:
    case DType::kF16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, raw.data() + 2 * i, 2);
        out[i] = t.dtype() == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      break;
    case DType::kI32:
      for (size_t i = 0; i < out.size(); ++i) {
        int32_t v;
        std::memcpy(&v, raw.data() + 4 * i, 4);
        out[i] = static_cast<float>(v);
      }
      break;
    case DType::kI64:
      for (size_t i = 0; i < out.size(); ++i) {
        int64_t v;
        std::memcpy(&v, raw.data() + 8 * i, 8);
        out[i] = static_cast<float>(v);
      }
      break;
    case DType::kBool:
      for (size_t i = 0; i < out.size(); ++i) out[i] = raw[i] != std::byte{0} ? 1.0f : 0.0f;
      break;
  }
  return out;
}

void from_host_f32(memory::Device& device, const std::vector<float>& values, Tensor& t) {
  PORTER_CHECK_EQ(static_cast<int64_t>(values.size()), t.numel(), "from_host_f32 element count");
  if (values.empty()) return;
  if (t.dtype() == DType::kF32) {
    device.copy_sync(t.data(), values.data(), t.nbytes());
    return;
  }
  const bool bf16 = t.dtype() == DType::kBF16;
  PORTER_CHECK(bf16 || t.dtype() == DType::kF16, "from_host_f32 into ", dtype_name(t.dtype()));
  std::vector<uint16_t> h(values.size());
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = bf16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
  }
  device.copy_sync(t.data(), h.data(), t.nbytes());
}

}  // namespace porter::tensor
