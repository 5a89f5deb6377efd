// kernels::Kernels' shape, dtype and aliasing checks (kernels/kernels.cc): each bad call throws
// InvalidArgument whose message names the op and the offending shape, before any device work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "base/error.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using testing::Env;

struct BadCall {
  std::string name;
  std::vector<std::string> message_parts;
  std::function<void(Env&, kernels::Kernels&)> call;
};

TEST(ValidationTest, EveryOpRejectsBadArgumentsNamingItself) {
  Env env;
  const BadCall calls[] = {
      {"bias_add", {"bias_add", "bias", "(5)", "(4)"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor x = e.empty({3, 4}); k.bias_add(x, e.empty({5})); }},
      {"bias_backward", {"bias_backward", "dbias"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor db = e.empty({3}); k.bias_backward(e.empty({2, 4}), db); }},
      {"layernorm_forward", {"layernorm_forward", "mean", "(2)", "(3)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor y = e.empty({3, 4}), mean = e.empty({2}), rstd = e.empty({3});
         k.layernorm_forward(e.empty({3, 4}), e.empty({4}), e.empty({4}), y, mean, rstd);
       }},
      {"layernorm_forward in place", {"layernorm_forward", "overlaps"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor x = e.empty({3, 4}), mean = e.empty({3}), rstd = e.empty({3});
         k.layernorm_forward(x, e.empty({4}), e.empty({4}), x, mean, rstd);
       }},
      {"layernorm_backward", {"layernorm_backward", "dgamma"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dx = e.empty({3, 4}), dg = e.empty({4}, DType::kBF16), db = e.empty({4});
         k.layernorm_backward(e.empty({3, 4}), e.empty({3, 4}), e.empty({4}), e.empty({3}),
                              e.empty({3}), dx, dg, db);
       }},
      {"gelu_forward", {"gelu_forward", "(3, 5)"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor y = e.empty({3, 5}); k.gelu_forward(e.empty({3, 4}), y); }},
      {"gelu_forward partial overlap", {"gelu_forward", "partially overlaps"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor x = e.empty({4, 4});
         tensor::Tensor y = x.slice(1, 4), xs = x.slice(0, 3);
         k.gelu_forward(xs, y);
       }},
      {"gelu_backward", {"gelu_backward", "dy"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dx = e.empty({4});
         k.gelu_backward(e.empty({4}), e.empty({5}), dx);
       }},
      {"attention_forward", {"attention_forward", "heads"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor out = e.empty({1, 2, 4}), probs = e.empty({1, 0, 2, 2});
         k.attention_forward(e.empty({1, 2, 12}), out, probs, 0);
       }},
      {"attention_backward", {"attention_backward", "dqkv"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dqkv = e.empty({1, 2, 4});
         k.attention_backward(e.empty({1, 2, 4}), e.empty({1, 2, 12}), e.empty({1, 2, 2, 2}), dqkv, 2);
       }},
      {"dropout_forward", {"dropout_forward", "p = 1"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor y = e.empty({4}); k.dropout_forward(e.empty({4}), y, 1.0f, {}); }},
      {"dropout_backward", {"dropout_backward", "(4)", "(3)"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor dx = e.empty({3}); k.dropout_backward(e.empty({4}), dx, 0.1f, {}); }},
      {"add", {"add", "b", "(2, 3)"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor o = e.empty({3, 2}); k.add(e.empty({3, 2}), e.empty({2, 3}), o); }},
      {"accumulate", {"accumulate", "i32"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor acc = e.empty({3}, DType::kI32); k.accumulate(acc, e.empty({3})); }},
      {"embedding_forward", {"embedding_forward", "tokens", "f32"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor out = e.empty({1, 2, 3});
         k.embedding_forward(e.empty({1, 2}), e.empty({5, 3}), e.empty({4, 3}), out);
       }},
      {"embedding_forward positions", {"embedding_forward", "more positions"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor out = e.empty({1, 5, 3});
         k.embedding_forward(e.ids({0, 0, 0, 0, 0}, {1, 5}), e.empty({5, 3}), e.empty({4, 3}), out);
       }},
      {"embedding_backward", {"embedding_backward", "dwpe"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dwte = e.empty({5, 3}), dwpe = e.empty({4, 2});
         k.embedding_backward(e.empty({1, 2, 3}), e.ids({0, 1}, {1, 2}), dwte, dwpe);
       }},
      {"embedding_forward_vocab_range", {"embedding_forward_vocab_range", "same number of columns"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor out = e.empty({1, 2, 3});
         k.embedding_forward_vocab_range(e.ids({0, 1}, {1, 2}), e.empty({5, 3}), 5,
                                         e.empty({4, 2}), out);
       }},
      {"embedding_forward_vocab_range begin", {"embedding_forward_vocab_range", "vocab_begin -1"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor out = e.empty({1, 2, 3});
         k.embedding_forward_vocab_range(e.ids({0, 1}, {1, 2}), e.empty({5, 3}), -1, tensor::Tensor(), out);
       }},
      {"embedding_backward_vocab_range", {"embedding_backward_vocab_range", "dout", "(1, 2, 4)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dwte = e.empty({5, 3}), dwpe;
         k.embedding_backward_vocab_range(e.empty({1, 2, 4}), e.ids({0, 1}, {1, 2}), 0, dwte, dwpe);
       }},
      {"cross_entropy_partial valid", {"cross_entropy_partial", "valid 6", "[0, 5]"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor stats = e.empty({2, 3});
         k.cross_entropy_partial(e.empty({2, 5}), e.ids({0, 1}, {2}), 0, 6, stats);
       }},
      {"cross_entropy_partial stats", {"cross_entropy_partial", "stats", "(2, 2)", "(2, 3)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor stats = e.empty({2, 2});
         k.cross_entropy_partial(e.empty({2, 5}), e.ids({0, 1}, {2}), 0, 5, stats);
       }},
      {"cross_entropy_combine", {"cross_entropy_combine", "gathered", "(2, 3, 2)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor losses = e.empty({3}), lse = e.empty({3});
         k.cross_entropy_combine(e.empty({2, 3, 2}), losses, lse);
       }},
      {"cross_entropy_backward_partial", {"cross_entropy_backward_partial", "lse", "(3)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dl = e.empty({2, 5});
         k.cross_entropy_backward_partial(e.empty({2, 5}), e.ids({0, 1}, {2}), 5, 4, e.empty({3}),
                                          dl, 1.0f);
       }},
      {"cross_entropy_forward", {"cross_entropy_forward", "targets", "(3)"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor losses = e.empty({2});
         k.cross_entropy_forward(e.empty({2, 5}), e.ids({0, 1, 2}, {3}), losses);
       }},
      {"cross_entropy_backward", {"cross_entropy_backward", "dlogits"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor dl = e.empty({2, 4});
         k.cross_entropy_backward(e.empty({2, 5}), e.ids({0, 1}, {2}), dl, 1.0f);
       }},
      {"adamw", {"adamw", "same number of elements"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor p = e.empty({4}), m = e.empty({4}), v = e.empty({3});
         k.adamw(p, e.empty({4}), m, v, {});
       }},
      {"adamw step", {"adamw", "step 0"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor p = e.empty({4}), m = e.empty({4}), v = e.empty({4});
         kernels::AdamWArgs args;
         args.step = 0;
         k.adamw(p, e.empty({4}), m, v, args);
       }},
      {"sum", {"sum", "1 element"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor out = e.empty({2}); k.sum(e.empty({4}), out); }},
      {"squared_norm", {"squared_norm", "bf16"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor out = e.empty({1}, DType::kBF16); k.squared_norm(e.empty({4}), out); }},
      {"cast", {"cast", "(4)", "(5)"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor y = e.empty({5}, DType::kBF16); k.cast(e.empty({4}), y); }},
      {"fill", {"fill", "i32"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor x = e.empty({2}, DType::kI32); k.fill(x, 1.0f); }},
      {"scale", {"scale", "undefined"},
       [](Env&, kernels::Kernels& k) { tensor::Tensor x; k.scale(x, 1.0f); }},
      {"nonfinite_count", {"nonfinite_count", "1 element"},
       [](Env& e, kernels::Kernels& k) { tensor::Tensor out = e.empty({2}); k.nonfinite_count(e.empty({4}), out); }},
      {"cpu bf16 with f16", {"mixes bf16 and f16", "Note [Cpu dtype combinations]"},
       [](Env& e, kernels::Kernels& k) {
         tensor::Tensor x = e.empty({2}, DType::kF16);
         k.bias_add(x, e.empty({2}, DType::kBF16));
       }},
  };
  for (const BadCall& c : calls) {
    try {
      c.call(env, *env.kernels);
      ADD_FAILURE() << c.name << ": expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      for (const std::string& part : c.message_parts) {
        EXPECT_THAT(e.what(), HasSubstr(part)) << c.name;
      }
    }
  }
}

TEST(ValidationTest, MakeKernelsGivesCpuKernelsForCpu) {
  Env env;
  EXPECT_EQ(env.kernels->kind(), memory::DeviceKind::kCpu);
}

}  // namespace
}  // namespace porter::nn
