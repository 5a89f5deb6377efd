// The Llama's spec (models/llama.h): its block, its analytic block graph, its Hugging Face
// names and config.json mapping.
#include "models/llama.h"

#include "base/check.h"
#include "models/analytic.h"
#include "models/transformer.h"

namespace porter::models {

using checkpoint::GraphBuilder;
using checkpoint::kExternal;
using checkpoint::kStageInput;
using checkpoint::Ref;
using checkpoint::StageGraph;
using checkpoint::WorkspaceTrace;
using Json = nlohmann::json;

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int64_t LlamaSpec::intermediate(const config::ModelConfig& m) const {
  if (m.intermediate > 0) return m.intermediate;
  const int64_t f = (8 * m.hidden + 2) / 3;  // ceil(8C / 3)
  return (f + 255) / 256 * 256;
}

void LlamaSpec::check(const config::ModelConfig& m) const {
  const int64_t kv = kv_heads(m);
  PORTER_CHECK(kv >= 1 && m.heads % kv == 0, "porter.model.kv_heads = ", kv,
               " does not divide heads = ", m.heads);
  PORTER_CHECK(kv % m.tensor_parallel == 0, "porter.model.kv_heads = ", kv,
               " is not divisible by tensor_parallel = ", m.tensor_parallel,
               "; tensor parallelism splits the key/value heads evenly");
  PORTER_CHECK((m.hidden / m.heads) % 2 == 0, "porter.model: hidden / heads = ",
               m.hidden / m.heads, " is odd; rotary embeddings rotate channel pairs");
}

std::unique_ptr<nn::Layer> LlamaSpec::make_block(const config::ModelConfig& m,
                                                 const TpShard& tp) const {
  LlamaShape shape;
  shape.hidden = m.hidden;
  shape.heads = static_cast<int>(m.heads);
  shape.kv_heads = static_cast<int>(kv_heads(m));
  shape.intermediate = intermediate(m);
  shape.norm_eps = static_cast<float>(m.norm_eps);
  shape.rope_theta = m.rope_theta;
  shape.qkv_bias = qkv_bias();
  shape.flash = m.attention == config::AttentionKind::kFlash;
  shape.mlp_tiles = std::max<int64_t>(1, m.mlp_tiles);  // 0: not chosen, 1
  return std::make_unique<LlamaBlock>(shape, static_cast<float>(m.dropout), tp);
}

// Hugging Face's LlamaPreTrainedModel scheme: every matrix ~ normal(0, 0.02), biases 0, the
// RMSNorm weights 1.
InitRule LlamaSpec::init_rule(const std::string& name, const config::ModelConfig&) const {
  if (ends_with(name, ".bias")) return {InitRule::kZero};
  if (name.find("norm") != std::string::npos) return {InitRule::kOne};
  return {InitRule::kNormal, 0.02f};
}

// The RMSNorms; q, k and v (with their biases) are column-parallel, o and down row-parallel
// without bias.
bool LlamaSpec::replicated(const std::string& name) const {
  return name.find("norm") != std::string::npos;
}

// LlamaBlock (Note [Llama] in models/transformer.h), op by op as models/blocks.cc runs it.
StageGraph LlamaSpec::block_graph(const TransformerDims& d) const {
  GraphBuilder gb;
  const size_t r = d.res(), u = d.col(), kvb = d.kv_col(), fb = d.mlp(), st = d.stat();
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const double cs = static_cast<double>(d.cs), kvs = static_cast<double>(d.kvs);
  const double fs = static_cast<double>(d.fs);
  const double ncs = static_cast<double>(d.n) * cs;
  Ref n1 = gb.op(nn::OpKind::kLayerNorm, {r, st}, {kStageInput, kExternal});
  // q, k and v read their weight and, with qkv_bias (Qwen2), their bias: parameters, which
  // hold no activation bytes; bias_add and bias_backward allocate nothing.
  const std::vector<Ref> proj_in =
      qkv_bias() ? std::vector<Ref>{n1, kExternal, kExternal} : std::vector<Ref>{n1, kExternal};
  Ref q = gb.op(nn::OpKind::kMatmul, {u}, proj_in, 2.0 * nc * cs, d.sp_gather());
  Ref k = gb.op(nn::OpKind::kMatmul, {kvb}, proj_in, 2.0 * nc * kvs, d.sp_gather());
  Ref v = gb.op(nn::OpKind::kMatmul, {kvb}, proj_in, 2.0 * nc * kvs, d.sp_gather());
  Ref qkv = gb.op(nn::OpKind::kOther, {d.qkv()}, {q, k, v});
  // The forward drops q, k and v once the rotary op has read them.
  for (Ref t : {q, k, v}) gb.graph().ops[t.op].dies_after = qkv.op;
  Ref att = gb.op(nn::OpKind::kAttention, {u, d.attn_saved()}, {qkv},
                  4.0 * ncs * static_cast<double>(d.t),
                  attention_forward_workspace(d));
  Ref o = gb.op(nn::OpKind::kMatmul, {r}, {att, kExternal}, 2.0 * nc * cs, d.sp_gather());
  Ref x2 = gb.op(nn::OpKind::kAdd, {r}, {kStageInput, gb.dropout(o, r, d.drop, true)});
  Ref n2 = gb.op(nn::OpKind::kLayerNorm, {r, st}, {x2, kExternal});
  const bool tiled = d.mlp_tiles > 1;
  Ref gate, up, a, f;
  if (!tiled) {
    gate = gb.op(nn::OpKind::kMatmul, {fb}, {n2, kExternal}, 2.0 * nc * fs, d.sp_gather());
    up = gb.op(nn::OpKind::kMatmul, {fb}, {n2, kExternal}, 2.0 * nc * fs, d.sp_gather());
    a = gb.op(nn::OpKind::kGelu, {fb}, {gate, up});
    f = gb.op(nn::OpKind::kMatmul, {r}, {a, kExternal}, 2.0 * nc * fs, d.sp_gather());
  } else {
    // Note [MLP tiles] in models/blocks.cc: one op, a tile's gate, up and SwiGLU as its
    // workspace.
    f = gb.op(nn::OpKind::kMatmul, {r}, {n2, kExternal, kExternal, kExternal}, 6.0 * nc * fs,
              d.times(3, d.mlp_tile(d.fs)));
  }
  Ref y = gb.op(nn::OpKind::kAdd, {r}, {x2, gb.dropout(f, r, d.drop, true)});
  StageGraph& g = gb.graph();
  g.saves = {kStageInput, n1, GraphBuilder::slot(n1, 1), qkv, att, GraphBuilder::slot(att, 1),
             x2,  n2, GraphBuilder::slot(n2, 1)};
  if (!tiled) g.saves.insert(g.saves.end(), {gate, up, a});
  g.output = y;
  // LlamaBlock::backward.
  WorkspaceTrace w;
  if (d.sp) w.alloc(d.times(8, d.c));  // RowPartialGrads: the two RMSNorms' f32 partial gradients
  const int df = dropout_backward(w, d, r);
  int dn2 = WorkspaceTrace::kNone;
  if (!tiled) {
    const int da = row_linear_backward(w, d, fb);
    w.free(df);
    const int dgate = w.alloc(fb);
    const int dup = w.alloc(fb);
    w.free(da);
    dn2 = column_linear_backward(w, d, r);
    w.free(dgate);
    const int dn2_up = column_linear_backward(w, d, r);
    w.free(dup);
    w.free(dn2_up);
  } else {
    dn2 = w.alloc(r);
    // One tile: gate, up, a (then dgate), da and dup; da freed before dup's product with
    // up_proj, an (R, C) block of dn2's rows.
    const size_t tf = d.mlp_tile(d.fs);
    const int t_gate = w.alloc(tf), t_up = w.alloc(tf), t_a = w.alloc(tf);
    const int t_da = w.alloc(tf), t_dup = w.alloc(tf);
    w.free(t_da);
    const int t_dx = w.alloc(d.mlp_tile(d.c));
    for (int t : {t_gate, t_up, t_a, t_dup, t_dx}) w.free(t);
    w.free(df);
  }
  w.alloc(r);  // dx2
  w.free(dn2);
  const int dproj = dropout_backward(w, d, r);
  const int datt = row_linear_backward(w, d, u);
  w.free(dproj);
  const int dqkv = w.alloc(d.qkv());
  w.transient(attention_backward_workspace(d));
  w.free(datt);
  const int dq = w.alloc(u);
  const int dk = w.alloc(kvb);
  const int dv = w.alloc(kvb);
  w.free(dqkv);
  const int dn1 = column_linear_backward(w, d, r);
  w.free(dq);
  const int dn1_k = column_linear_backward(w, d, r);
  w.free(dk);
  w.free(dn1_k);
  const int dn1_v = column_linear_backward(w, d, r);
  w.free(dv);
  w.free(dn1_v);
  w.alloc(r);  // dx, the result
  w.free(dn1);
  g.backward_workspace_peak = w.peak();
  return g;
}

// A buffer, not a parameter: rotary_emb.inv_freq.
bool LlamaSpec::hf_is_buffer(const std::string& bare) const {
  return ends_with(bare, "rotary_emb.inv_freq");
}

std::vector<HfParam> LlamaSpec::hf_params(const config::ModelConfig& m) const {
  const int64_t c = m.hidden;
  const int64_t d = c / m.heads;
  const int64_t kv = kv_heads(m);
  const int64_t f = intermediate(m);  // the width rule when porter.model.intermediate is unset
  std::vector<HfParam> out;
  const std::string prefix(hf_prefix());
  auto linear = [&](const std::string& name, std::vector<int64_t> shape) {
    out.push_back({name, prefix + name, std::move(shape), false});
  };
  linear("embed_tokens.weight", {m.vocab, c});
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    linear(p + "input_layernorm.weight", {c});
    linear(p + "self_attn.q_proj.weight", {m.heads * d, c});
    linear(p + "self_attn.k_proj.weight", {kv * d, c});
    linear(p + "self_attn.v_proj.weight", {kv * d, c});
    linear(p + "self_attn.o_proj.weight", {c, m.heads * d});
    linear(p + "post_attention_layernorm.weight", {c});
    linear(p + "mlp.gate_proj.weight", {f, c});
    linear(p + "mlp.up_proj.weight", {f, c});
    linear(p + "mlp.down_proj.weight", {c, f});
    if (qkv_bias()) {  // after the block's weights, as LlamaBlock::params lists them
      linear(p + "self_attn.q_proj.bias", {m.heads * d});
      linear(p + "self_attn.k_proj.bias", {kv * d});
      linear(p + "self_attn.v_proj.bias", {kv * d});
    }
  }
  linear("norm.weight", {c});
  if (!m.tie_embeddings) out.push_back({"lm_head.weight", "lm_head.weight", {m.vocab, c}, false});
  return out;
}

void LlamaSpec::hf_check_settings(const HfConfigReader& r) const {
  if (r.boolean("attention_bias", false)) {
    r.fail("attention_bias", "true: porter's Llama projections have no bias");
  }
  if (r.boolean("mlp_bias", false)) r.fail("mlp_bias", "true: porter's Llama MLP has no bias");
}

// Note [porter.model.from] (Llama, model_type "llama"): config.json's keys, with
// transformers' defaults where it leaves one out (HfDefaults): num_hidden_layers 32,
// hidden_size 4096, num_attention_heads 32, num_key_value_heads (the heads),
// intermediate_size 11008, vocab_size 32000, rms_norm_eps 1e-6, rope_theta 10000,
// max_position_embeddings 2048, tie_word_embeddings false; hidden_act "silu", rope_scaling
// null, attention_bias and mlp_bias false, head_dim null (or hidden_size /
// num_attention_heads).
HfModelKeys LlamaSpec::hf_read_config(const HfConfigReader& r) const {
  const HfDefaults def = hf_defaults();
  const int64_t layers = r.positive("num_hidden_layers", def.layers);
  const int64_t hidden = r.positive("hidden_size", def.hidden);
  const int64_t heads = r.positive("num_attention_heads", def.heads);
  const int64_t kv_heads = r.positive("num_key_value_heads", heads);
  const int64_t intermediate = r.positive("intermediate_size", def.intermediate);
  const int64_t vocab = r.positive("vocab_size", def.vocab);
  const int64_t positions = r.positive("max_position_embeddings", def.positions);
  const double eps = r.positive_real("rms_norm_eps", def.norm_eps);
  const double theta = r.positive_real("rope_theta", def.rope_theta);
  const bool tied = r.boolean("tie_word_embeddings", def.tied);
  const std::string act = r.string("hidden_act", "silu");
  if (act != "silu") {
    r.fail("hidden_act", "\"" + act + "\": porter's " + std::string(display_name()) +
                             " MLP computes SiLU (\"silu\")");
  }
  if (const Json* scaling = r.get("rope_scaling")) {
    r.fail("rope_scaling", scaling->dump() + ": porter's rotary embedding has no scaling (only "
                           "rope_theta); a model trained with one would compute otherwise");
  }
  hf_check_settings(r);
  if (hidden % heads != 0) {
    r.fail("hidden_size", std::to_string(hidden) + " is not divisible by num_attention_heads " +
                              std::to_string(heads));
  }
  if (const Json* head_dim = r.get("head_dim")) {
    if (!head_dim->is_number_integer() || head_dim->get<int64_t>() != hidden / heads) {
      r.fail("head_dim", head_dim->dump() + ": porter's heads are hidden_size / "
                         "num_attention_heads = " + std::to_string(hidden / heads) + " wide");
    }
  }
  HfModelKeys hf;
  hf.max_positions = positions;
  hf.model_keys = {{"arch", std::string(name())}, {"layers", layers},
                   {"hidden", hidden},           {"heads", heads},
                   {"vocab", vocab},             {"tie_embeddings", tied},
                   {"kv_heads", kv_heads},       {"intermediate", intermediate},
                   {"norm_eps", eps},            {"rope_theta", theta},
                   {"max_positions", positions}};
  hf.hf_key = {{"arch", "model_type"},            {"layers", "num_hidden_layers"},
               {"hidden", "hidden_size"},         {"heads", "num_attention_heads"},
               {"vocab", "vocab_size"},           {"tie_embeddings", "tie_word_embeddings"},
               {"kv_heads", "num_key_value_heads"}, {"intermediate", "intermediate_size"},
               {"norm_eps", "rms_norm_eps"},      {"rope_theta", "rope_theta"},
               {"max_positions", "max_position_embeddings"}};
  return hf;
}

nlohmann::ordered_json LlamaSpec::hf_write_config(const config::ModelConfig& m,
                                                  const Json& source) const {
  const int64_t kv = kv_heads(m);
  const int64_t f = intermediate(m);
  int64_t positions = m.max_positions > 0 ? m.max_positions : m.seq_len;
  if (m.max_positions == 0 && source.is_object()) {
    auto it = source.find("max_position_embeddings");
    if (it != source.end() && it->is_number_integer() && it->get<int64_t>() >= m.seq_len) {
      positions = it->get<int64_t>();
    }
  }
  nlohmann::ordered_json j;
  j["architectures"] = {std::string(hf_class())};
  j["model_type"] = std::string(hf_model_type());
  j["vocab_size"] = m.vocab;
  j["hidden_size"] = m.hidden;
  j["intermediate_size"] = f;
  j["num_hidden_layers"] = m.layers;
  j["num_attention_heads"] = m.heads;
  j["num_key_value_heads"] = kv;
  j["head_dim"] = m.hidden / m.heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = positions;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["rope_scaling"] = nullptr;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  return j;
}

}  // namespace porter::models
