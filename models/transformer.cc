// The transformer: configuration checks, the flat layout, deterministic init, and one
// micro-batch's forward and backward through its stages; what differs between
// architectures comes from the spec (models/spec.h).
#include "models/transformer.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "models/factory.h"
#include "tensor/philox.h"

namespace porter::models {

int64_t TpShard::vocab_valid() const {
  return std::clamp<int64_t>(vocab - vocab_begin(), 0, vocab_shard);
}

Transformer::Transformer(const config::ModelConfig& config, int tp_rank)
    : config_(config), spec_(&arch_spec(config.type)) {
  PORTER_CHECK(config.tensor_parallel >= 1 && tp_rank >= 0 && tp_rank < config.tensor_parallel,
               "tensor-parallel rank ", tp_rank, " of porter.model.tensor_parallel = ",
               config.tensor_parallel);
  PORTER_CHECK(config.heads % config.tensor_parallel == 0, "porter.model.heads = ", config.heads,
               " is not divisible by tensor_parallel = ", config.tensor_parallel,
               "; tensor parallelism splits the heads evenly");
  PORTER_CHECK(config.layers >= 1 && config.hidden >= 1 && config.heads >= 1 &&
                   config.seq_len >= 1 && config.vocab >= 1,
               "porter.model: layers, hidden, heads, seq_len and vocab must be >= 1");
  PORTER_CHECK(config.hidden % config.heads == 0, "porter.model.hidden = ", config.hidden,
               " is not divisible by heads = ", config.heads);
  PORTER_CHECK(config.dropout >= 0.0 && config.dropout < 1.0, "porter.model.dropout = ",
               config.dropout, " must be in [0, 1)");
  PORTER_CHECK(config.norm_eps > 0.0, "porter.model.norm_eps = ", config.norm_eps,
               " must be positive");
  spec_->check(config);
  const int64_t intermediate = spec_->intermediate(config);
  PORTER_CHECK(intermediate % config.tensor_parallel == 0, "porter.model.intermediate = ",
               intermediate, " is not divisible by tensor_parallel = ", config.tensor_parallel);
  tp_.rank = tp_rank;
  tp_.size = static_cast<int>(config.tensor_parallel);
  tp_.sequence_parallel = config.sequence_parallel && tp_.size > 1;
  tp_.vocab = config.vocab;
  tp_.vocab_shard = (config.vocab + tp_.size - 1) / tp_.size;
  const float p = static_cast<float>(config.dropout);
  const float eps = static_cast<float>(config.norm_eps);
  auto emb = std::make_unique<TransformerEmbedding>(
      config.vocab, spec_->position_rows(config), config.hidden, p, tp_,
      spec_->token_table_name(), spec_->position_table_name());
  embedding_ = emb.get();
  layout_.add("", emb->params());
  stages_.push_back(std::move(emb));
  for (int64_t l = 0; l < config.layers; ++l) {
    std::unique_ptr<Layer> block = spec_->make_block(config, tp_);
    layout_.add(spec_->block_prefix() + std::to_string(l), block->params());
    stages_.push_back(std::move(block));
  }
  // 0 is porter's choice (engine::resolve_loss_tiles); not made, it is 1.
  PORTER_CHECK(config.loss_tiles >= 0, "porter.model.loss_tiles = ", config.loss_tiles,
               " must be >= 0");
  std::unique_ptr<TransformerHead> head;
  if (config.loss_tiles > 1) {
    head = std::make_unique<TiledLossHead>(config.vocab, config.hidden, config.tie_embeddings,
                                           tp_, spec_->norm(), eps, spec_->final_norm_name(),
                                           spec_->head_name(), config.loss_tiles);
  } else {
    head = std::make_unique<TransformerHead>(config.vocab, config.hidden, config.tie_embeddings,
                                             tp_, spec_->norm(), eps, spec_->final_norm_name(),
                                             spec_->head_name());
  }
  head_ = head.get();
  layout_.add("", head->params());
  stages_.push_back(std::move(head));
}

std::string Transformer::embedding_name() const { return spec_->token_table_name(); }

bool Transformer::vocab_parallel(const std::string& name) const {
  return name == spec_->token_table_name() || name == spec_->head_name();
}

std::string Transformer::stage_name(int i) const {
  if (i == 0) return "embedding";
  if (i == num_stages() - 1) return "head";
  return "block." + std::to_string(i - 1);
}

void Transformer::bind(const FlatParams& flat) {
  PORTER_CHECK(&flat.layout() == &layout_ || flat.layout().total_elems() == layout_.total_elems(),
               "Transformer::bind: the flat buffers use another layout");
  bind_layer(*embedding_, "", flat);
  const std::string prefix = spec_->block_prefix();
  for (int l = 0; l < config_.layers; ++l) bind_layer(stage(l + 1), prefix + std::to_string(l), flat);
  bind_layer(*head_, "", flat);
  if (config_.tie_embeddings) {
    size_t wte =
        static_cast<size_t>(&layout_.find(embedding_name()) - layout_.entries().data());
    head_->bind_tied(flat.param(wte), flat.grad(wte));
  }
}

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<float> Transformer::init_values(uint64_t seed) const {
  if (tp_.size > 1) {
    config::ModelConfig whole = config_;
    whole.tensor_parallel = 1;
    whole.sequence_parallel = false;
    return shard_values(Transformer(whole).init_values(seed));
  }
  // Note [Transformer init]: each parameter's rule is its spec's (ArchSpec::init_rule): a
  // constant (0 for biases, 1 for norm weights) or normal(0, std_dev) (GPT-2's scheme scales
  // the residual projections' 0.02 by 1/sqrt(2L); the Llama's is 0.02 for every matrix).
  // Normals come from Box-Muller over Philox keyed by (seed, FNV-1a of the parameter name),
  // so a parameter's values do not depend on the layout, thread count or device.
  std::vector<float> v(static_cast<size_t>(layout_.total_elems()), 0.0f);
  for (const ParamEntry& e : layout_.entries()) {
    float* out = v.data() + e.offset_elems;
    const int64_t n = e.shape.numel();
    const InitRule rule = spec_->init_rule(e.name, config_);
    if (rule.kind == InitRule::kZero) continue;
    if (rule.kind == InitRule::kOne) {
      for (int64_t i = 0; i < n; ++i) out[i] = 1.0f;
      continue;
    }
    const float std_dev = rule.std_dev;
    const uint64_t h = fnv1a(e.name);
    PhiloxKey key;
    key.seed = seed;
    key.stream[0] = static_cast<uint32_t>(h);
    key.stream[1] = static_cast<uint32_t>(h >> 32);
    key.stream[2] = 0x494e4954u;  // "INIT": disjoint from dropout streams' step bits
    for (int64_t i = 0; i < n; i += 4) {
      float u[4];
      philox_uniform4(key, static_cast<uint64_t>(i / 4), u);
      for (int j = 0; j < 4; j += 2) {
        const double r = std::sqrt(-2.0 * std::log(1.0 - static_cast<double>(u[j])));
        const double theta = 2.0 * M_PI * static_cast<double>(u[j + 1]);
        if (i + j < n) out[i + j] = static_cast<float>(std_dev * r * std::cos(theta));
        if (i + j + 1 < n) out[i + j + 1] = static_cast<float>(std_dev * r * std::sin(theta));
      }
    }
  }
  return v;
}

void Transformer::init_values_range(uint64_t seed, int64_t begin, std::span<float> out) const {
  // init_values' element by element (Note [Transformer init]): element w of a parameter at
  // tensor_parallel 1 is one half of the Box-Muller pair (w % 4) / 2 of Philox block w / 4.
  std::fill(out.begin(), out.end(), 0.0f);
  config::ModelConfig whole = config_;
  whole.tensor_parallel = 1;
  whole.sequence_parallel = false;
  const int64_t end = begin + static_cast<int64_t>(out.size());
  for (const ParamShard& s : shard_map()) {
    const ParamEntry& e = *s.entry;
    const int64_t off = e.offset_elems;
    const int64_t lo = std::max(begin, off), hi = std::min(end, off + e.shape.numel());
    if (lo >= hi) continue;
    const InitRule rule = spec_->init_rule(e.name, whole);
    if (rule.kind == InitRule::kZero) continue;
    const float std_dev = rule.std_dev;
    const uint64_t h = fnv1a(e.name);
    PhiloxKey key;
    key.seed = seed;
    key.stream[0] = static_cast<uint32_t>(h);
    key.stream[1] = static_cast<uint32_t>(h >> 32);
    key.stream[2] = 0x494e4954u;  // "INIT", as init_values
    const int64_t whole_cols = s.whole_shape.size() == 2 ? s.whole_shape[1] : 1;
    uint64_t block = ~uint64_t{0};
    float u[4];
    for (const ParamShard::Block& b : s.blocks) {
      for (int64_t i = b.row; i < b.row + b.rows; ++i) {
        const int64_t c0 = std::max<int64_t>(0, lo - off - i * s.cols);
        const int64_t c1 = std::min<int64_t>(s.cols, hi - off - i * s.cols);
        for (int64_t c = c0; c < c1; ++c) {
          float& v = out[static_cast<size_t>(off + i * s.cols + c - begin)];
          if (rule.kind == InitRule::kOne) {
            v = 1.0f;
            continue;
          }
          const int64_t w = (b.whole_row + i - b.row) * whole_cols + b.whole_col + c;
          if (static_cast<uint64_t>(w / 4) != block) {
            block = static_cast<uint64_t>(w / 4);
            philox_uniform4(key, block, u);
          }
          const int j = static_cast<int>(w % 4) / 2 * 2;
          const double r = std::sqrt(-2.0 * std::log(1.0 - static_cast<double>(u[j])));
          const double theta = 2.0 * M_PI * static_cast<double>(u[j + 1]);
          v = static_cast<float>(std_dev * r * (w % 2 == 0 ? std::cos(theta) : std::sin(theta)));
        }
      }
    }
  }
}

std::vector<float> Transformer::shard_values(std::span<const float> whole) const {
  if (tp_.size == 1) {
    PORTER_CHECK_EQ(static_cast<int64_t>(whole.size()), layout_.total_elems(),
                    "Transformer::shard_values: values of the whole layout");
    return std::vector<float>(whole.begin(), whole.end());
  }
  config::ModelConfig whole_config = config_;
  whole_config.tensor_parallel = 1;
  whole_config.sequence_parallel = false;
  const Transformer full(whole_config);
  PORTER_CHECK_EQ(static_cast<int64_t>(whole.size()), full.layout().total_elems(),
                  "Transformer::shard_values: values of the layout at tensor_parallel 1");
  const int64_t t = tp_.size, r = tp_.rank;
  std::vector<float> out(static_cast<size_t>(layout_.total_elems()), 0.0f);
  for (const ParamEntry& e : layout_.entries()) {
    const ParamEntry& w = full.layout().find(e.name);
    const float* src = whole.data() + w.offset_elems;
    float* dst = out.data() + e.offset_elems;
    const int64_t cols = e.shape.rank() == 2 ? e.shape[1] : 1;
    const int64_t rows = e.shape[0];
    auto copy_rows = [&](int64_t from_row, int64_t to_row, int64_t count) {
      std::copy(src + from_row * cols, src + (from_row + count) * cols, dst + to_row * cols);
    };
    if (e.shape == w.shape) {
      std::copy(src, src + e.shape.numel(), dst);
    } else if (ends_with(e.name, "qkv.weight") || ends_with(e.name, "qkv.bias")) {
      const int64_t part = rows / 3, c = w.shape[0] / 3;  // this rank's heads of q, k, v
      for (int j = 0; j < 3; ++j) copy_rows(j * c + r * part, j * part, part);
    } else if (vocab_parallel(e.name)) {
      const int64_t begin = tp_.vocab_begin();
      copy_rows(begin, 0, tp_.vocab_valid());  // the padding rows stay 0
    } else if (e.shape.rank() == 2 && e.shape[0] == w.shape[0]) {
      // Row-parallel (proj, fc2): this rank's columns.
      const int64_t full_cols = w.shape[1];
      for (int64_t i = 0; i < rows; ++i) {
        std::copy(src + i * full_cols + r * cols, src + i * full_cols + (r + 1) * cols,
                  dst + i * cols);
      }
    } else {
      // Column-parallel (fc1 weight and bias): this rank's rows.
      PORTER_CHECK_EQ(rows * t, w.shape[0], "Transformer::shard_values: ", e.name);
      copy_rows(r * rows, 0, rows);
    }
  }
  return out;
}

std::vector<ParamShard> Transformer::shard_map() const {
  // The cases of shard_values, as blocks of rows.
  std::unique_ptr<Transformer> whole_model;
  if (tp_.size > 1) {
    config::ModelConfig whole_config = config_;
    whole_config.tensor_parallel = 1;
    whole_config.sequence_parallel = false;
    whole_model = std::make_unique<Transformer>(whole_config);
  }
  const ParamLayout& full = whole_model ? whole_model->layout() : layout_;
  const int64_t t = tp_.size, r = tp_.rank;
  std::vector<ParamShard> out;
  out.reserve(layout_.entries().size());
  for (const ParamEntry& e : layout_.entries()) {
    const ParamEntry& w = full.find(e.name);
    ParamShard s;
    s.entry = &e;
    s.whole_shape = w.shape.to_vector();
    s.cols = e.shape.rank() == 2 ? e.shape[1] : 1;
    const int64_t rows = e.shape.rank() >= 1 ? e.shape[0] : 1;
    if (e.shape == w.shape) {
      s.blocks.push_back({0, 0, rows, 0});
    } else if (ends_with(e.name, "qkv.weight") || ends_with(e.name, "qkv.bias")) {
      const int64_t part = rows / 3, c = w.shape[0] / 3;  // this rank's heads of q, k, v
      for (int64_t j = 0; j < 3; ++j) s.blocks.push_back({j * part, j * c + r * part, part, 0});
    } else if (vocab_parallel(e.name)) {
      if (tp_.vocab_valid() > 0) s.blocks.push_back({0, tp_.vocab_begin(), tp_.vocab_valid(), 0});
    } else if (e.shape.rank() == 2 && e.shape[0] == w.shape[0]) {
      s.blocks.push_back({0, 0, rows, r * s.cols});  // row-parallel: this rank's columns
    } else {
      PORTER_CHECK_EQ(rows * t, w.shape[0], "Transformer::shard_map: ", e.name);
      s.blocks.push_back({0, r * rows, rows, 0});  // column-parallel: this rank's rows
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<float> Transformer::merge_shards(const std::vector<std::vector<float>>& shards) const {
  const int64_t t = tp_.size;
  PORTER_CHECK_EQ(static_cast<int64_t>(shards.size()), t, "Transformer::merge_shards: one part per "
                  "tensor-parallel rank");
  for (const std::vector<float>& part : shards) {
    PORTER_CHECK_EQ(static_cast<int64_t>(part.size()), layout_.total_elems(),
                    "Transformer::merge_shards: a rank's values in its layout");
  }
  if (t == 1) return shards[0];
  config::ModelConfig whole_config = config_;
  whole_config.tensor_parallel = 1;
  whole_config.sequence_parallel = false;
  const Transformer full(whole_config);
  std::vector<float> out(static_cast<size_t>(full.layout().total_elems()), 0.0f);
  for (int r = 0; r < t; ++r) {
    // Every rank's layout has the same entries and shapes; rank r's own offsets and vocabulary
    // range come from its layout, which is this one's shape with rank r.
    config::ModelConfig rank_config = config_;
    const Transformer rank_model(rank_config, r);
    const TpShard& tp = rank_model.tp();
    for (const ParamEntry& e : rank_model.layout().entries()) {
      const ParamEntry& w = full.layout().find(e.name);
      const float* src = shards[static_cast<size_t>(r)].data() + e.offset_elems;
      float* dst = out.data() + w.offset_elems;
      const int64_t cols = e.shape.rank() == 2 ? e.shape[1] : 1;
      const int64_t rows = e.shape[0];
      auto copy_rows = [&](int64_t from_row, int64_t to_row, int64_t count) {
        std::copy(src + from_row * cols, src + (from_row + count) * cols, dst + to_row * cols);
      };
      if (e.shape == w.shape) {
        if (r == 0) std::copy(src, src + e.shape.numel(), dst);
      } else if (ends_with(e.name, "qkv.weight") || ends_with(e.name, "qkv.bias")) {
        const int64_t part = rows / 3, c = w.shape[0] / 3;
        for (int j = 0; j < 3; ++j) copy_rows(j * part, j * c + r * part, part);
      } else if (vocab_parallel(e.name)) {
        copy_rows(0, tp.vocab_begin(), tp.vocab_valid());
      } else if (e.shape.rank() == 2 && e.shape[0] == w.shape[0]) {
        const int64_t full_cols = w.shape[1];
        for (int64_t i = 0; i < rows; ++i) {
          std::copy(src + i * cols, src + (i + 1) * cols, dst + i * full_cols + r * cols);
        }
      } else {
        copy_rows(0, r * rows, rows);
      }
    }
  }
  return out;
}

// Note [Loss tiles]
// With porter.model.loss_tiles = k > 1 the head (TiledLossHead) never holds the logits of
// every token row: it splits the N = B*T rows (all of them under sequence parallelism, whose
// head gathers its input rows as the untiled head's matmul does) into contiguous tiles of
// R = ceil(N/k) rows, [i*R, min((i+1)*R, N)), the last one shorter. When R*(k-1) >= N the
// tiles past N are empty and skipped: k > N runs N tiles of one row, and e.g. N = 10, k = 7
// runs 5 tiles of 2. Per tile, in one op of kind loss:
//   forward:  logits (R, Vs) = lnf[tile] @ W^T, workspace freed at the end of the tile; the
//             tile's (max, sum of exp, target logit) rows (cross_entropy_partial), all-gathered
//             over the tensor-parallel group, give the rows' log-sum-exp (cross_entropy_combine,
//             a group of one at t = 1) and their losses; at t = 1 the losses are then
//             overwritten by cross_entropy_forward, the untiled head's kernel.
//   backward: logits recomputed from the saved lnf, dlogits = cross_entropy_backward_partial
//             in place (from the saved log-sum-exp), dW += dlogits^T lnf[tile] and
//             dlnf[tile] = dlogits W, tile after tile in row order; then, as untiled, the
//             all-reduce (or reduce-scatter under sequence parallelism) of dlnf and the norm's
//             backward over the whole rows.
// The stage saves its input, lnf, the norm's statistics and the log-sum-exp (N x 4 bytes) but
// no logits; forward's workspace is one tile's logits and stats beside the (N) losses, and
// backward's dlnf beside one tile's logits (models/analytic.cc, head_graph, to the byte).
// The cost is the head's matmul run twice more per tile: once in backward to rebuild the
// logits (the untiled head reads its saved ones) on top of the two backward matmuls.
//
// What is bit-identical: every per-row loss is computed by the same kernels on the same row
// of lnf, and the (N) losses are summed once by the same reduction as untiled, so the loss is
// the same bits for every k > 1 and, given matmul rows that do not depend on how many rows are
// multiplied with them (the cpu kernels' case), the same as k = 1's: at t = 1 through
// cross_entropy_forward, at t > 1 because the untiled head runs the same partial and combine.
// The log-sum-exp of a row, and so dlogits, is likewise the same for every k > 1; it differs
// from k = 1's cross_entropy_backward at t = 1 in the last bits. dW sums over the rows in
// tiles (the matmul's inner dimension split, partial sums added in tile order), so dW, and
// through it every gradient upstream of the tied table, agree across k only within f32
// rounding; the order is fixed, so each k is deterministic and bit-identical across
// checkpoint policies.

namespace {

// TiledLossHead's per-rank view of the group, as the other layers check it.
void check_head_group(const Ctx& ctx, const TpShard& tp) {
  PORTER_CHECK(ctx.tp_size() == tp.size && ctx.tp_rank() == tp.rank,
               "TiledLossHead was built as tensor-parallel rank ", tp.rank, " of ", tp.size,
               ", but the ctx's group is rank ", ctx.tp_rank(), " of ", ctx.tp_size(),
               " (Ctx::set_tensor_parallel)");
}

Tensor as_rows(const Tensor& t) { return t.reshape({t.numel() / t.dim(-1), t.dim(-1)}); }

}  // namespace

TiledLossHead::TiledLossHead(int64_t vocab, int64_t hidden, bool tied, const TpShard& tp,
                             Norm norm, float norm_eps, std::string norm_name,
                             std::string head_name, int64_t tiles)
    : TransformerHead(vocab, hidden, tied, tp, norm, norm_eps, std::move(norm_name),
                      std::move(head_name)),
      tiles_(tiles) {
  PORTER_CHECK(tiles >= 1, "porter.model.loss_tiles = ", tiles, " must be >= 1");
}

Tensor TiledLossHead::forward(Ctx& ctx, const Tensor& x) {
  check_head_group(ctx, tp_);
  const int64_t n = targets_.defined() ? targets_.numel() : 0;
  const int64_t rows_here = tp_.sequence_parallel ? n / tp_.size : n;
  PORTER_CHECK(targets_.defined() && rows_here * hidden_ == x.numel(),
               "TransformerHead: set_targets with the micro-batch's (B, T) targets before forward");
  Tensor lnf, mean, rstd;
  if (norm_ == Norm::kRmsNorm) {
    auto outs = ctx.rmsnorm(norm_name_, x, lnf_w_, eps_);
    lnf = outs[0];
    rstd = outs[1];
  } else {
    auto outs = ctx.layernorm(norm_name_, x, lnf_w_, lnf_b_, eps_);
    lnf = outs[0];
    mean = outs[1];
    rstd = outs[2];
  }
  Tensor targets = targets_.reshape({n});
  const Tensor w = head_w_;
  const int64_t tile = loss_tile_rows(n, tiles_), vs = w.dim(0);
  auto outs = ctx.op(
      OpKind::kLoss, "loss", {lnf, w, targets}, {{Shape{1}, DType::kF32}, {Shape{n}, DType::kF32}},
      [&](std::span<Tensor> out) {
        Kernels& k = ctx.kernels();
        Tensor xg = as_rows(lnf);  // (N, C): under sequence parallelism gathered
        if (tp_.sequence_parallel) {
          xg = ctx.workspace(Shape{n, hidden_}, lnf.dtype());
          comm::Work gather = ctx.tp_all_gather(as_rows(lnf), xg);
          ctx.tp_wait(gather);
        }
        Tensor losses = ctx.workspace(Shape{n}, DType::kF32);
        for (int64_t r0 = 0; r0 < n; r0 += tile) {
          const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
          Tensor logits = ctx.workspace(Shape{m, vs}, lnf.dtype());
          k.matmul(xg.slice(r0, r1), w, logits, MatmulSpec{false, true});
          const Tensor rows_targets = targets.slice(r0, r1);
          Tensor rows_losses = losses.slice(r0, r1), rows_lse = out[1].slice(r0, r1);
          Tensor stats = ctx.workspace(Shape{m, 3}, DType::kF32);
          k.cross_entropy_partial(logits, rows_targets, tp_.vocab_begin(),
                                  tp_.size == 1 ? vocab_ : tp_.vocab_valid(), stats);
          if (tp_.size == 1) {
            k.cross_entropy_combine(stats.reshape({1, m, 3}), rows_losses, rows_lse);
            k.cross_entropy_forward(logits, rows_targets, rows_losses);
          } else {
            Tensor all = ctx.workspace(Shape{tp_.size, m, 3}, DType::kF32);
            comm::Work gather = ctx.tp_all_gather(stats, all);
            ctx.tp_wait(gather);
            k.cross_entropy_combine(all, rows_losses, rows_lse);
          }
        }
        k.sum(losses, out[0]);
        k.scale(out[0], 1.0f / static_cast<float>(n));
      });
  ctx.save("x", x);
  ctx.save("lnf", lnf);
  if (mean.defined()) ctx.save("mean", mean);
  ctx.save("rstd", rstd);
  ctx.save("targets", targets);
  ctx.save("lse", outs[1]);
  return outs[0];
}

Tensor TiledLossHead::backward(Ctx& ctx, const Tensor& /*dy*/) {
  Kernels& k = ctx.kernels();
  const Tensor& targets = ctx.saved("targets");
  const Tensor& lse = ctx.saved("lse");
  const Tensor& lnf = ctx.saved("lnf");
  const int64_t n = targets.numel();
  const float scale = loss_scale_ / static_cast<float>(n);
  const int64_t tile = loss_tile_rows(n, tiles_), vs = head_w_.dim(0);
  const int64_t valid = tp_.size == 1 ? vocab_ : tp_.vocab_valid();
  Tensor xg = as_rows(lnf);  // (N, C): under sequence parallelism gathered again
  if (tp_.sequence_parallel) {
    xg = ctx.workspace(Shape{n, hidden_}, lnf.dtype());
    comm::Work gather = ctx.tp_all_gather(as_rows(lnf), xg);
    ctx.tp_wait(gather);
  }
  Tensor dlnf = ctx.workspace(Shape{n, hidden_}, lnf.dtype());  // every row's, this rank's part
  for (int64_t r0 = 0; r0 < n; r0 += tile) {
    const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
    const Tensor x_rows = xg.slice(r0, r1);
    Tensor dlogits = ctx.workspace(Shape{m, vs}, lnf.dtype());
    k.matmul(x_rows, head_w_, dlogits, MatmulSpec{false, true});
    k.cross_entropy_backward_partial(dlogits, targets.slice(r0, r1), tp_.vocab_begin(), valid,
                                     lse.slice(r0, r1), dlogits, scale);
    k.matmul(dlogits, x_rows, dhead_w_, MatmulSpec{true, false, 1.0f, 1.0f});
    Tensor dlnf_rows = dlnf.slice(r0, r1);
    k.matmul(dlogits, head_w_, dlnf_rows);
  }
  if (tp_.sequence_parallel) {
    Tensor shard = ctx.workspace(Shape{n / tp_.size, hidden_}, lnf.dtype());
    comm::Work sum = ctx.tp_reduce_scatter(dlnf, shard);
    ctx.tp_wait(sum);
    xg = Tensor();
    dlnf = shard;
  } else if (tp_.size > 1) {
    comm::Work sum = ctx.tp_all_reduce(dlnf);
    ctx.tp_wait(sum);
  }
  const Tensor& x = ctx.saved("x");
  Tensor dx = ctx.grad_like(x);
  Tensor dx_rows = as_rows(dx);
  // Under sequence parallelism the norm's weight gradients are partial over this rank's rows:
  // into one zeroed buffer, summed over the group, then accumulated (as the other layers).
  const bool rms = norm_ == Norm::kRmsNorm;
  Tensor partial;
  Tensor dgamma = dlnf_w_, dbeta = dlnf_b_;
  if (tp_.sequence_parallel) {
    const int64_t c = dlnf_w_.numel();
    partial = ctx.workspace(Shape{rms ? c : 2 * c}, dlnf_w_.dtype());
    k.fill(partial, 0.0f);
    dgamma = partial.slice(0, c);
    if (!rms) dbeta = partial.slice(c, 2 * c);
  }
  if (rms) {
    k.rmsnorm_backward(as_rows(dlnf), as_rows(x), lnf_w_, ctx.saved("rstd"), dx_rows, dgamma);
  } else {
    k.layernorm_backward(as_rows(dlnf), as_rows(x), lnf_w_, ctx.saved("mean"), ctx.saved("rstd"),
                         dx_rows, dgamma, dbeta);
  }
  if (partial.defined()) {
    comm::Work sum = ctx.tp_all_reduce(partial);
    ctx.tp_wait(sum);
    k.accumulate(dlnf_w_, dgamma);
    if (!rms) k.accumulate(dlnf_b_, dbeta);
  }
  return dx;
}

Tensor Transformer::forward_logits(Ctx& ctx, const Tensor& tokens) {
  RunInfo run = ctx.run();
  run.batch = tokens.dim(0);
  run.seq = tokens.dim(1);
  run.eval = true;
  ctx.set_run(run);
  Tensor x = tokens;
  const int n = num_stages();
  for (int s = 0; s + 1 < n; ++s) {
    Tape tape;  // dropped at once: nothing is kept
    x = forward_stage(ctx, stage(s), s, tape, SaveMode::kSaveAll, x);
  }
  Tape tape;
  ctx.begin(n - 1, tape, SaveMode::kSaveAll);
  try {
    Tensor logits = head_->logits(ctx, x);
    ctx.end();
    return logits;
  } catch (...) {
    ctx.abort();
    throw;
  }
}

float Transformer::forward_backward(Ctx& ctx, const Tensor& tokens, const Tensor& targets,
                            std::span<const StagePlan> plans) {
  const int n = num_stages();
  PORTER_CHECK(plans.empty() || static_cast<int>(plans.size()) == n, "Transformer::forward_backward: ",
               plans.size(), " stage plans for ", n, " stages");
  PORTER_CHECK(targets.shape() == tokens.shape() && targets.dtype() == DType::kI32,
               "targets must be (B, T) i32 like tokens ", tokens.shape().to_string());
  const StagePlan kDefault;
  std::vector<Tape> tapes(static_cast<size_t>(n));
  std::vector<Tensor> inputs(static_cast<size_t>(n));
  head_->set_targets(targets);
  RunInfo run = ctx.run();
  run.batch = tokens.dim(0);
  run.seq = tokens.dim(1);
  ctx.set_run(run);
  Tensor x = tokens;
  for (int s = 0; s < n; ++s) {
    const StagePlan& p = plans.empty() ? kDefault : plans[s];
    inputs[s] = x;
    x = forward_stage(ctx, stage(s), s, tapes[s], p.mode, x, p.policy);
  }
  const float loss = to_host_f32(ctx.allocator().device(), x)[0];
  x = Tensor();
  Tensor dy;  // the head ignores its dy (Note in models/transformer.h)
  for (int s = n - 1; s >= 0; --s) {
    const StagePlan& p = plans.empty() ? kDefault : plans[s];
    if (p.mode == SaveMode::kCheckpoint) recompute_stage(ctx, stage(s), s, tapes[s], inputs[s]);
    inputs[s] = Tensor();
    dy = backward_stage(ctx, stage(s), s, tapes[s], dy);
  }
  return loss;
}

}  // namespace porter::models
