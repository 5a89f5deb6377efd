// tensor::Tensor: shapes, reshape, slice, reinterpret, from_blob, typed access and host transfers.
#include "tensor/tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using testing::Env;

TEST(TensorTest, ShapeBasics) {
  tensor::Shape s{4, 512, 768};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel(), 4 * 512 * 768);
  EXPECT_EQ(s.to_string(), "(4, 512, 768)");
  EXPECT_EQ(tensor::Shape{}.numel(), 1);
  EXPECT_THROW((tensor::Shape{1, 2, 3, 4, 5}), InvalidArgument);
  EXPECT_THROW((tensor::Shape{2, -1}), InvalidArgument);
}

TEST(TensorTest, EmptyAllocatesFromTheAllocatorWithItsCategory) {
  Env env;
  tensor::Tensor t = tensor::Tensor::empty(*env.allocator, {3, 5}, DType::kBF16, memory::Category::kActivations);
  EXPECT_TRUE(t.owns_memory());
  EXPECT_EQ(t.nbytes(), 30u);
  EXPECT_EQ(t.category(), memory::Category::kActivations);
  EXPECT_EQ(t.dim(-1), 5);
  EXPECT_NE(t.data(), nullptr);
}

TEST(TensorTest, ReshapeAndSliceShareMemory) {
  Env env;
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = static_cast<float>(i);
  tensor::Tensor t = env.from(v, {4, 6});
  tensor::Tensor r = t.reshape({2, 3, 4});
  EXPECT_EQ(r.data(), t.data());
  EXPECT_EQ(r.shape(), (tensor::Shape{2, 3, 4}));
  EXPECT_THROW(t.reshape({5, 5}), InvalidArgument);
  tensor::Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (tensor::Shape{2, 6}));
  EXPECT_EQ(env.host(s), std::vector<float>(v.begin() + 6, v.begin() + 18));
  EXPECT_THROW(t.slice(3, 5), InvalidArgument);
  tensor::Tensor e = t.slice(2, 2);
  EXPECT_EQ(e.numel(), 0);
}

TEST(TensorTest, ReinterpretViewsTheFirstBytesAsAnotherTensor) {
  Env env;
  tensor::Tensor words = tensor::Tensor::empty(*env.allocator, {8}, DType::kI32, memory::Category::kStaging);
  for (int i = 0; i < 8; ++i) words.data_as<int32_t>()[i] = i;
  tensor::Tensor f = words.reinterpret({2, 5}, DType::kBF16);  // 20 of the 32 bytes
  EXPECT_EQ(f.data(), words.data());
  EXPECT_TRUE(f.owns_memory());
  EXPECT_EQ(f.category(), memory::Category::kStaging);
  EXPECT_EQ(f.shape(), (tensor::Shape{2, 5}));
  EXPECT_EQ(f.dtype(), DType::kBF16);
  words = tensor::Tensor();
  EXPECT_EQ(f.data_as<uint16_t>()[2], 1u);  // still alive through the view (little endian)
  try {
    f.reinterpret({3, 4}, DType::kF32);
    ADD_FAILURE() << "48 bytes out of 20";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("which needs 48 bytes"));
  }
}

TEST(TensorTest, FromBlobViewsForeignMemory) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  tensor::Tensor t = tensor::Tensor::from_blob(buf.data(), {2, 3}, DType::kF32);
  EXPECT_FALSE(t.owns_memory());
  EXPECT_EQ(t.data_as<float>()[4], 5.0f);
  EXPECT_THROW(t.data_as<int32_t>(), InvalidArgument);
  EXPECT_THROW(tensor::Tensor::from_blob(nullptr, {2}, DType::kF32), InvalidArgument);
  Env env;
  env.kernels->scale(t, 2.0f);  // kernels run on foreign memory too (cpu)
  EXPECT_EQ(buf[5], 12.0f);
}

TEST(TensorTest, HostTransfersRoundTripF32Bf16AndI32) {
  Env env;
  std::vector<float> v = {1.0f, -2.5f, 3.140625f, 1e-3f};
  EXPECT_EQ(env.host(env.from(v, {4})), v);
  std::vector<float> h = env.host(env.from(v, {2, 2}, DType::kBF16));
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(h[i], tensor::bf16_to_f32(tensor::f32_to_bf16(v[i])));
  EXPECT_EQ(env.host(env.ids({7, -1}, {2})), (std::vector<float>{7.0f, -1.0f}));
  tensor::Tensor t = env.empty({3});
  try {
    tensor::from_host_f32(*env.device, v, t);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("from_host_f32"));
  }
}

}  // namespace
}  // namespace porter::nn
