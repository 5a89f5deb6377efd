// Note [Cpu determinism]: every cpu kernel gives the same bits with 1, 2 and 3 threads, at
// sizes large enough that each thread gets several blocks, rows and column blocks.
#include <gtest/gtest.h>

#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::random_values;

// Runs every kernel on fixed inputs and returns all outputs, concatenated.
std::vector<float> run_all(Env& env) {
  const int64_t b = 2, t = 70, c = 96, heads = 3, vocab = 50, n = b * t;
  std::vector<float> all;
  auto keep = [&](const tensor::Tensor& x) {
    std::vector<float> h = env.host(x);
    all.insert(all.end(), h.begin(), h.end());
  };
  tensor::Tensor x = env.from(random_values(n * c, 1), {n, c});
  tensor::Tensor dy = env.from(random_values(n * c, 2), {n, c});
  tensor::Tensor gamma = env.from(random_values(c, 3), {c}), beta = env.from(random_values(c, 4), {c});
  tensor::Tensor y = env.empty({n, c}), mean = env.empty({n}), rstd = env.empty({n}), dx = env.empty({n, c});
  tensor::Tensor dg = env.from(random_values(c, 5), {c}), db = env.from(random_values(c, 6), {c});
  env.kernels->layernorm_forward(x, gamma, beta, y, mean, rstd);
  env.kernels->layernorm_backward(dy, x, gamma, mean, rstd, dx, dg, db);
  keep(y); keep(mean); keep(rstd); keep(dx); keep(dg); keep(db);

  env.kernels->bias_backward(dy, dg);
  env.kernels->bias_add(y, gamma);
  env.kernels->gelu_forward(x, y);
  env.kernels->gelu_backward(x, dy, dx);
  keep(dg); keep(y); keep(dx);
  env.kernels->dropout_forward(x, y, 0.2f, tensor::dropout_key(5, 1, 2, 3, 4));
  keep(y);

  std::vector<int32_t> tok(n);
  for (int64_t i = 0; i < n; ++i) tok[i] = static_cast<int32_t>((i * 13) % vocab);
  tensor::Tensor tokens = env.ids(tok, {b, t});
  tensor::Tensor wte = env.from(random_values(vocab * c, 7), {vocab, c});
  tensor::Tensor wpe = env.from(random_values(t * c, 8), {t, c});
  tensor::Tensor emb = env.empty({b, t, c});
  env.kernels->embedding_forward(tokens, wte, wpe, emb);
  env.kernels->embedding_backward(dy.reshape({b, t, c}), tokens, wte, wpe);
  keep(emb); keep(wte); keep(wpe);

  tensor::Tensor logits = env.from(random_values(n * vocab, 9, -4.0f, 4.0f), {n, vocab});
  tensor::Tensor targets = env.ids(std::vector<int32_t>(tok.begin(), tok.end()), {n});
  tensor::Tensor losses = env.empty({n}), dlogits = env.empty({n, vocab});
  env.kernels->cross_entropy_forward(logits, targets, losses);
  env.kernels->cross_entropy_backward(logits, targets, dlogits, 0.5f);
  keep(losses); keep(dlogits);

  tensor::Tensor qkv = env.from(random_values(b * t * 3 * c, 10), {b, t, 3 * c});
  tensor::Tensor out = env.empty({b, t, c}), probs = env.empty({b, heads, t, t});
  tensor::Tensor dqkv = env.empty({b, t, 3 * c});
  env.kernels->attention_forward(qkv, out, probs, static_cast<int>(heads));
  env.kernels->attention_backward(dy.reshape({b, t, c}), qkv, probs, dqkv, static_cast<int>(heads));
  keep(out); keep(probs); keep(dqkv);

  tensor::Tensor big = env.from(random_values(300001, 11), {300001});
  tensor::Tensor s = env.empty({1});
  env.kernels->sum(big, s);
  keep(s);
  env.kernels->squared_norm(big, s);
  keep(s);

  tensor::Tensor p = env.from(random_values(50001, 12), {50001}), g = env.from(random_values(50001, 13), {50001});
  tensor::Tensor m = env.from(std::vector<float>(50001, 0.0f), {50001}), v = m;
  v = env.from(std::vector<float>(50001, 0.0f), {50001});
  kernels::AdamWArgs args;
  args.weight_decay = 0.1f;
  env.kernels->adamw(p, g, m, v, args);
  keep(p); keep(m); keep(v);

  tensor::Tensor w = env.from(random_values(c * 3 * c, 14), {c, 3 * c}), h = env.empty({n, 3 * c});
  env.kernels->matmul(x, w, h);
  keep(h);
  return all;
}

TEST(DeterminismTest, EveryKernelBitIdenticalFor1To3Threads) {
  Env one(1), two(2), three(3);
  std::vector<float> a = run_all(one);
  std::vector<float> b = run_all(two);
  std::vector<float> c = run_all(three);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "output element " << i;
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], c[i]) << "output element " << i;
  // And run to run on the same kernels.
  EXPECT_EQ(run_all(two), b);
}

}  // namespace
}  // namespace porter::nn
