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
  auto head = std::make_unique<TransformerHead>(config.vocab, config.hidden,
                                                config.tie_embeddings, tp_, spec_->norm(), eps,
                                                spec_->final_norm_name(), spec_->head_name());
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
