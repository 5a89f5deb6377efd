// The vocabulary-parallel embedding and cross-entropy kernels on cpu (Note
// [Vocabulary-parallel kernels] in kernels.cc): a table or logits split into column shards,
// each shard run on its own as a rank would, and the pieces put back together must give the
// whole-vocabulary kernels' results (bit for bit where the arithmetic is the same).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::max_rel_error;
using testing::random_values;

// Rows [begin, begin + count) of a row-major (rows, cols) host matrix.
std::vector<float> row_range(const std::vector<float>& m, int64_t cols, int64_t begin,
                           int64_t count) {
  return {m.begin() + begin * cols, m.begin() + (begin + count) * cols};
}

// A V-row table split over t ranks of ceil(V / t) rows each: rank r holds ids
// [r * rows, r * rows + valid(r)), the rest of its rows are padding.
struct Split {
  int64_t vocab;
  int64_t ranks;
  int64_t shard() const { return (vocab + ranks - 1) / ranks; }
  int64_t begin(int64_t r) const { return r * shard(); }
  int64_t valid(int64_t r) const { return std::clamp(vocab - begin(r), int64_t{0}, shard()); }
};

// ---- embedding ------------------------------------------------------------------------------

TEST(EmbeddingVocabRangeTest, FullTableEqualsEmbeddingBitForBit) {
  Env env;
  const int64_t batch = 3, seq = 5, vocab = 11, cols = 70, t_max = 7;
  std::vector<int32_t> tok = {1, 1, 2, 10, 0, 1, 2, 2, 2, 5, 10, 6, 0, 1, 3};
  for (tensor::DType table : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    for (tensor::DType act : {tensor::DType::kF32, table}) {
      const auto wte = random_values(vocab * cols, 1), wpe = random_values(t_max * cols, 2);
      tensor::Tensor twte = env.from(wte, {vocab, cols}, table), twpe = env.from(wpe, {t_max, cols}, table);
      tensor::Tensor tokens = env.ids(tok, {batch, seq});
      tensor::Tensor want = env.empty({batch, seq, cols}, act), got = env.empty({batch, seq, cols}, act);
      env.kernels->embedding_forward(tokens, twte, twpe, want);
      env.kernels->embedding_forward_vocab_range(tokens, twte, 0, twpe, got);
      EXPECT_EQ(env.host(got), env.host(want)) << tensor::dtype_name(table) << " " << tensor::dtype_name(act);

      const auto dout = random_values(batch * seq * cols, 3);
      const auto dwte0 = random_values(vocab * cols, 4), dwpe0 = random_values(t_max * cols, 5);
      tensor::Tensor tdout = env.from(dout, {batch, seq, cols}, act);
      tensor::Tensor dwte_want = env.from(dwte0, {vocab, cols}, table);
      tensor::Tensor dwpe_want = env.from(dwpe0, {t_max, cols}, table);
      tensor::Tensor dwte_got = env.from(dwte0, {vocab, cols}, table);
      tensor::Tensor dwpe_got = env.from(dwpe0, {t_max, cols}, table);
      env.kernels->embedding_backward(tdout, tokens, dwte_want, dwpe_want);
      env.kernels->embedding_backward_vocab_range(tdout, tokens, 0, dwte_got, dwpe_got);
      EXPECT_EQ(env.host(dwte_got), env.host(dwte_want)) << tensor::dtype_name(table);
      EXPECT_EQ(env.host(dwpe_got), env.host(dwpe_want)) << tensor::dtype_name(table);
    }
  }
}

// Rank 0 adds the positions, the others pass tensor::Tensor(); the ranks' outputs summed in rank
// order (the caller's all-reduce) are the whole embedding exactly: each token's row adds
// wte + wpe once and zeros otherwise. The concatenated dwte shards are the whole dwte, and
// the shards' padding rows are never touched.
TEST(EmbeddingVocabRangeTest, ShardsSumToTheWholeEmbedding) {
  Env env;
  const int64_t batch = 2, seq = 9, cols = 33, t_max = 12;
  for (Split split : {Split{37, 1}, Split{37, 2}, Split{37, 4}}) {
    const int64_t vocab = split.vocab, shard = split.shard();
    std::vector<int32_t> tok(static_cast<size_t>(batch * seq));
    for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>((i * 11 + 3) % vocab);
    tok[4] = static_cast<int32_t>(vocab - 1);  // in the last, partly padded, shard
    tok[5] = tok[4];
    const auto wte = random_values(vocab * cols, 6), wpe = random_values(t_max * cols, 7);
    const auto dout = random_values(batch * seq * cols, 8);
    tensor::Tensor tokens = env.ids(tok, {batch, seq});
    tensor::Tensor twpe = env.from(wpe, {t_max, cols}), tdout = env.from(dout, {batch, seq, cols});
    tensor::Tensor want = env.empty({batch, seq, cols});
    env.kernels->embedding_forward(tokens, env.from(wte, {vocab, cols}), twpe, want);
    tensor::Tensor dwte_want = env.from(std::vector<float>(vocab * cols, 0.0f), {vocab, cols});
    tensor::Tensor dwpe_want = env.from(std::vector<float>(t_max * cols, 0.0f), {t_max, cols});
    env.kernels->embedding_backward(tdout, tokens, dwte_want, dwpe_want);

    std::vector<float> sum(static_cast<size_t>(batch * seq * cols), 0.0f), dwte_cat;
    for (int64_t r = 0; r < split.ranks; ++r) {
      // Padding rows hold garbage, which no in-range token may read.
      std::vector<float> rows(static_cast<size_t>(shard * cols), 1e4f);
      const std::vector<float> real = row_range(wte, cols, split.begin(r), split.valid(r));
      std::copy(real.begin(), real.end(), rows.begin());
      tensor::Tensor out = env.empty({batch, seq, cols});
      tensor::Tensor pe = r == 0 ? twpe : tensor::Tensor();
      env.kernels->embedding_forward_vocab_range(tokens, env.from(rows, {shard, cols}),
                                                 split.begin(r), pe, out);
      const std::vector<float> got = env.host(out);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += got[i];

      // dwte: zeros in the valid rows, the garbage padding rows kept.
      std::fill(rows.begin(), rows.begin() + split.valid(r) * cols, 0.0f);
      tensor::Tensor dwte = env.from(rows, {shard, cols});
      tensor::Tensor dwpe = r == 0 ? env.from(std::vector<float>(t_max * cols, 0.0f), {t_max, cols})
                           : tensor::Tensor();
      env.kernels->embedding_backward_vocab_range(tdout, tokens, split.begin(r), dwte, dwpe);
      const std::vector<float> g = env.host(dwte);
      dwte_cat.insert(dwte_cat.end(), g.begin(), g.begin() + split.valid(r) * cols);
      for (int64_t i = split.valid(r) * cols; i < shard * cols; ++i) {
        ASSERT_EQ(g[i], 1e4f) << "padding row element " << i << " of rank " << r;
      }
      if (r == 0) {
        EXPECT_EQ(env.host(dwpe), env.host(dwpe_want)) << split.ranks << " ranks";
      }
    }
    EXPECT_EQ(sum, env.host(want)) << split.ranks << " ranks";
    EXPECT_EQ(dwte_cat, env.host(dwte_want)) << split.ranks << " ranks";
  }
}

// Ids of other shards and negative ids are legal and contribute nothing; without wpe such a
// row is 0, and backward leaves dwte as it was.
TEST(EmbeddingVocabRangeTest, OtherShardsAndNegativeIdsContributeNothing) {
  Env env;
  const int64_t cols = 5, t_max = 4;
  const std::vector<int32_t> tok = {-1, 3, 20, -2147483647 - 1, 21, 0};
  const auto wte = random_values(2 * cols, 9), wpe = random_values(t_max * cols, 10);
  tensor::Tensor tokens = env.ids(tok, {2, 3}), twte = env.from(wte, {2, cols});
  tensor::Tensor out = env.empty({2, 3, cols});
  env.kernels->embedding_forward_vocab_range(tokens, twte, 20, tensor::Tensor(), out);
  std::vector<float> got = env.host(out);
  for (int64_t n = 0; n < 6; ++n) {
    const int64_t v = static_cast<int64_t>(tok[n]) - 20;
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(got[n * cols + c], v == 0 || v == 1 ? wte[v * cols + c] : 0.0f) << n << " " << c;
    }
  }
  env.kernels->embedding_forward_vocab_range(tokens, twte, 20, env.from(wpe, {t_max, cols}), out);
  got = env.host(out);
  for (int64_t n = 0; n < 6; ++n) {
    const int64_t v = static_cast<int64_t>(tok[n]) - 20;
    for (int64_t c = 0; c < cols; ++c) {
      const float pos = wpe[(n % 3) * cols + c];
      ASSERT_EQ(got[n * cols + c], v == 0 || v == 1 ? wte[v * cols + c] + pos : pos);
    }
  }
  tensor::Tensor dwte = env.from(wte, {2, cols}), dwpe;
  const auto dout = random_values(6 * cols, 11);
  env.kernels->embedding_backward_vocab_range(env.from(dout, {2, 3, cols}), tokens, 30, dwte,
                                              dwpe);
  EXPECT_EQ(env.host(dwte), wte);
}

// ---- cross-entropy --------------------------------------------------------------------------

// losses and dlogits in double over the whole (rows, V) logits.
void cross_entropy_ref(const std::vector<float>& logits, const std::vector<int32_t>& tgt,
                       int64_t rows, int64_t classes, float scale, std::vector<double>* losses,
                       std::vector<double>* dlogits) {
  losses->assign(rows, 0.0);
  dlogits->assign(logits.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY, s = 0;
    for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, double{logits[r * classes + c]});
    for (int64_t c = 0; c < classes; ++c) s += std::exp(logits[r * classes + c] - mx);
    (*losses)[r] = std::log(s) + mx - logits[r * classes + tgt[r]];
    for (int64_t c = 0; c < classes; ++c) {
      double p = std::exp(logits[r * classes + c] - mx) / s;
      (*dlogits)[r * classes + c] = (p - (c == tgt[r] ? 1.0 : 0.0)) * scale;
    }
  }
}

// What t ranks compute: partial per shard, the all-gather (on the host), combine, and
// backward_partial; dlogits concatenated over the valid columns.
struct Sharded {
  std::vector<float> losses, lse, dlogits;
  std::vector<std::vector<float>> stats;    // per rank, (N, 3)
  std::vector<std::vector<float>> padding;  // per rank, dlogits of the padding columns
};

Sharded run_sharded(Env& env, const std::vector<float>& logits, const std::vector<int32_t>& tgt,
                    int64_t rows, Split split, float scale, tensor::DType dtype) {
  const int64_t vocab = split.vocab, shard = split.shard();
  Sharded out;
  tensor::Tensor targets = env.ids(tgt, {rows});
  std::vector<tensor::Tensor> shards;
  std::vector<float> gathered;
  for (int64_t r = 0; r < split.ranks; ++r) {
    // Columns [begin, begin + valid) of the logits; padding columns hold a huge garbage
    // value, which would dominate the max and the sum if any kernel read it.
    std::vector<float> cols(static_cast<size_t>(rows * shard), 1e4f);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < split.valid(r); ++c) {
        cols[i * shard + c] = logits[i * vocab + split.begin(r) + c];
      }
    }
    shards.push_back(env.from(cols, {rows, shard}, dtype));
    tensor::Tensor stats = env.from(std::vector<float>(rows * 3, NAN), {rows, 3});
    env.kernels->cross_entropy_partial(shards.back(), targets, split.begin(r), split.valid(r),
                                       stats);
    out.stats.push_back(env.host(stats));
    gathered.insert(gathered.end(), out.stats.back().begin(), out.stats.back().end());
  }
  tensor::Tensor losses = env.empty({rows}), lse = env.empty({rows});
  env.kernels->cross_entropy_combine(env.from(gathered, {split.ranks, rows, 3}), losses, lse);
  out.losses = env.host(losses);
  out.lse = env.host(lse);
  for (int64_t r = 0; r < split.ranks; ++r) {
    tensor::Tensor d = env.from(std::vector<float>(rows * shard, NAN), {rows, shard}, dtype);
    env.kernels->cross_entropy_backward_partial(shards[r], targets, split.begin(r),
                                                split.valid(r), lse, d, scale);
    const std::vector<float> got = env.host(d);
    // In place (dlogits = logits) gives the same bits.
    env.kernels->cross_entropy_backward_partial(shards[r], targets, split.begin(r),
                                                split.valid(r), lse, shards[r], scale);
    EXPECT_EQ(env.host(shards[r]), got) << "in place, rank " << r;
    out.padding.emplace_back();
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < shard; ++c) {
        (c < split.valid(r) ? out.dlogits : out.padding.back()).push_back(got[i * shard + c]);
      }
    }
  }
  // Back to (N, V) order: the shards' valid columns side by side.
  std::vector<float> full(static_cast<size_t>(rows * vocab));
  size_t k = 0;
  for (int64_t r = 0; r < split.ranks; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < split.valid(r); ++c) {
        full[i * vocab + split.begin(r) + c] = out.dlogits[k++];
      }
    }
  }
  out.dlogits = full;
  return out;
}

// V = 37 over 1, 2 and 4 ranks (shards of 37, 19 and 10 columns: the last 18 and 7 valid),
// and V = 30 over 4 ranks of 10 columns, whose last shard is all padding (valid = 0).
TEST(CrossEntropyVocabParallelTest, ShardedMatchesTheWholeCrossEntropy) {
  Env env;
  const int64_t rows = 7;
  const float scale = 0.37f;
  for (Split split : {Split{37, 1}, Split{37, 2}, Split{37, 4}, Split{30, 4}}) {
    const int64_t vocab = split.vocab;
    auto logits = random_values(static_cast<size_t>(rows * vocab), 12, -5.0f, 5.0f);
    logits[2 * vocab + 1] = 60.0f;  // exp() would overflow without max subtraction
    std::vector<int32_t> tgt = {0, static_cast<int32_t>(vocab - 1), 1, 12, 29, 18, 9};
    tensor::Tensor tl = env.from(logits, {rows, vocab}), tt = env.ids(tgt, {rows});
    tensor::Tensor want_loss = env.empty({rows}), want_d = env.empty({rows, vocab});
    env.kernels->cross_entropy_forward(tl, tt, want_loss);
    env.kernels->cross_entropy_backward(tl, tt, want_d, scale);
    std::vector<double> ref_loss, ref_d;
    cross_entropy_ref(logits, tgt, rows, vocab, scale, &ref_loss, &ref_d);

    const Sharded got = run_sharded(env, logits, tgt, rows, split, scale, tensor::DType::kF32);
    const std::vector<float> whole_loss = env.host(want_loss), whole_d = env.host(want_d);
    const std::string what = std::to_string(vocab) + " over " + std::to_string(split.ranks);
    // Relative to max(|value|, 1): row 2's loss is ~0 (its target is the 60 logit).
    for (int64_t i = 0; i < rows; ++i) {
      const double want_lse = ref_loss[i] + logits[i * vocab + tgt[i]];
      EXPECT_NEAR(got.losses[i], whole_loss[i], 1e-6 * std::max(1.0f, std::abs(whole_loss[i])))
          << what << " row " << i;
      EXPECT_NEAR(got.lse[i], want_lse, 1e-6 * std::max(1.0, std::abs(want_lse)))
          << what << " row " << i;
    }
    EXPECT_LT(max_rel_error(got.losses, ref_loss), 1e-6) << what;
    EXPECT_LT(max_rel_error(got.dlogits, testing::to_double(whole_d)), 1e-6) << what;
    EXPECT_LT(max_rel_error(got.dlogits, ref_d), 1e-6) << what;
    for (const std::vector<float>& pad : got.padding) {
      for (float v : pad) ASSERT_EQ(v, 0.0f) << what << ": padding gradient";
    }
    if (split.ranks == 1) {
      // One shard is cross_entropy_forward's arithmetic: S = s exp(0) = s.
      EXPECT_EQ(got.losses, whole_loss);
    }
    if (split.valid(split.ranks - 1) == 0) {
      const std::vector<float>& last = got.stats.back();
      for (int64_t i = 0; i < rows; ++i) {
        EXPECT_EQ(last[i * 3], -INFINITY);
        EXPECT_EQ(last[i * 3 + 1], 0.0f);
        EXPECT_EQ(last[i * 3 + 2], 0.0f);
      }
    }
  }
}

// The stats themselves: m and s over the shard's valid columns, z only on the target's rank.
TEST(CrossEntropyVocabParallelTest, PartialStatsPerShard) {
  Env env;
  const Split split{37, 4};
  const int64_t rows = 3, vocab = split.vocab;
  const auto logits = random_values(static_cast<size_t>(rows * vocab), 13, -3.0f, 3.0f);
  const std::vector<int32_t> tgt = {36, 5, -1};
  const Sharded got = run_sharded(env, logits, tgt, rows, split, 1.0f, tensor::DType::kF32);
  for (int64_t r = 0; r < split.ranks; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      double mx = -INFINITY, s = 0;
      for (int64_t c = 0; c < split.valid(r); ++c) {
        mx = std::max(mx, double{logits[i * vocab + split.begin(r) + c]});
      }
      for (int64_t c = 0; c < split.valid(r); ++c) {
        s += std::exp(logits[i * vocab + split.begin(r) + c] - mx);
      }
      const int64_t local = tgt[i] - split.begin(r);
      const float z = local >= 0 && local < split.valid(r) ? logits[i * vocab + tgt[i]] : 0.0f;
      EXPECT_EQ(got.stats[r][i * 3], static_cast<float>(mx)) << "rank " << r << " row " << i;
      EXPECT_NEAR(got.stats[r][i * 3 + 1], s, 1e-6 * s) << "rank " << r << " row " << i;
      EXPECT_EQ(got.stats[r][i * 3 + 2], z) << "rank " << r << " row " << i;
    }
  }
}

// 16-bit logits and dlogits, against the double reference on the rounded logits.
TEST(CrossEntropyVocabParallelTest, SixteenBitLogitsAndGradients) {
  Env env;
  const Split split{37, 4};
  const int64_t rows = 4, vocab = split.vocab;
  const std::vector<int32_t> tgt = {0, 36, 5, 17};
  for (tensor::DType dt : {tensor::DType::kBF16, tensor::DType::kF16}) {
    const auto logits = testing::round_to(dt, random_values(rows * vocab, 14, -3.0f, 3.0f));
    std::vector<double> ref_loss, ref_d;
    cross_entropy_ref(logits, tgt, rows, vocab, 1.0f, &ref_loss, &ref_d);
    const Sharded got = run_sharded(env, logits, tgt, rows, split, 1.0f, dt);
    EXPECT_LT(max_rel_error(got.losses, ref_loss), 1e-6) << tensor::dtype_name(dt);
    // One rounding of dlogits to the dtype, as the whole-vocabulary tests allow.
    EXPECT_LT(max_rel_error(got.dlogits, ref_d), dt == tensor::DType::kBF16 ? 8e-3 : 1e-3)
        << tensor::dtype_name(dt);
  }
}

}  // namespace
}  // namespace porter::nn
