// The GPT's spec (models/gpt.h): its block, its analytic block graph, its Hugging Face names
// and config.json mapping.
#include "models/gpt.h"

#include <cmath>

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

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void GptSpec::check(const config::ModelConfig& m) const {
  PORTER_CHECK(kv_heads(m) == m.heads, "porter.model.kv_heads = ", m.kv_heads,
               ": the GPT has one key/value head per query head");
  PORTER_CHECK(m.intermediate == 0 || m.intermediate == 4 * m.hidden,
               "porter.model.intermediate = ", m.intermediate, ": the GPT's MLP is 4 x "
               "hidden wide");
  PORTER_CHECK(position_rows(m) >= m.seq_len, "porter.model.max_positions = ", m.max_positions,
               " is below seq_len = ", m.seq_len);
}

int64_t GptSpec::position_rows(const config::ModelConfig& m) const {
  return m.max_positions > 0 ? m.max_positions : m.seq_len;
}

std::unique_ptr<nn::Layer> GptSpec::make_block(const config::ModelConfig& m,
                                               const TpShard& tp) const {
  return std::make_unique<GptBlock>(m.hidden, static_cast<int>(m.heads),
                                    static_cast<float>(m.dropout), tp,
                                    static_cast<float>(m.norm_eps),
                                    m.attention == config::AttentionKind::kFlash,
                                    std::max<int64_t>(1, m.mlp_tiles));  // 0: not chosen, 1
}

// Note [GPT init]: GPT-2's scheme. Matrices ~ normal(0, 0.02), with the residual projections
// (proj, fc2) scaled by 1/sqrt(2L); biases 0; layernorm weight 1, bias 0.
InitRule GptSpec::init_rule(const std::string& name, const config::ModelConfig& m) const {
  if (ends_with(name, ".bias")) return {InitRule::kZero};
  if (name.find("ln") != std::string::npos) return {InitRule::kOne};
  float std_dev = 0.02f;
  if (ends_with(name, "proj.weight") || ends_with(name, "fc2.weight")) {
    std_dev *= 1.0f / std::sqrt(2.0f * static_cast<float>(m.layers));
  }
  return {InitRule::kNormal, std_dev};
}

bool GptSpec::replicated(const std::string& name) const {
  return name == "wpe" || starts_with(name, "lnf.") || name.find(".ln1.") != std::string::npos ||
         name.find(".ln2.") != std::string::npos || ends_with(name, "proj.bias") ||
         ends_with(name, "fc2.bias");
}

// GptBlock, op by op as models/blocks.cc runs it.
StageGraph GptSpec::block_graph(const TransformerDims& d) const {
  GraphBuilder gb;
  const size_t r = d.res(), u = d.col(), st = d.stat();
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const double cs = static_cast<double>(d.cs);
  const double ncs = static_cast<double>(d.n) * cs;
  Ref ln1 = gb.op(nn::OpKind::kLayerNorm, {r, st, st}, {kStageInput, kExternal, kExternal});
  Ref qkv = gb.op(nn::OpKind::kMatmul, {d.qkv()}, {ln1, kExternal, kExternal}, 2.0 * nc * 3.0 * cs,
                  d.sp_gather());
  // The kernel's scratch is workspace inside the op (Note [Kernel workspace]).
  Ref att = gb.op(nn::OpKind::kAttention, {u, d.attn_saved()}, {qkv},
                  4.0 * ncs * static_cast<double>(d.t),
                  attention_forward_workspace(d));
  Ref proj = gb.op(nn::OpKind::kMatmul, {r}, {att, kExternal, kExternal}, 2.0 * nc * cs, d.sp_gather());
  Ref x2 = gb.op(nn::OpKind::kAdd, {r}, {kStageInput, gb.dropout(proj, r, d.drop, true)});
  Ref ln2 = gb.op(nn::OpKind::kLayerNorm, {r, st, st}, {x2, kExternal, kExternal});
  const bool tiled = d.mlp_tiles > 1;
  Ref h, gl, f;
  if (!tiled) {
    h = gb.op(nn::OpKind::kMatmul, {d.times(4, u)}, {ln2, kExternal, kExternal}, 8.0 * nc * cs,
              d.sp_gather());
    gl = gb.op(nn::OpKind::kGelu, {d.times(4, u)}, {h});
    f = gb.op(nn::OpKind::kMatmul, {r}, {gl, kExternal, kExternal}, 8.0 * nc * cs, d.sp_gather());
  } else {
    // Note [MLP tiles] in models/blocks.cc: one op, a tile's h and g as its workspace.
    const size_t tile = d.mlp_tile(4 * d.cs);
    f = gb.op(nn::OpKind::kMatmul, {r}, {ln2, kExternal, kExternal, kExternal, kExternal},
              16.0 * nc * cs, d.times(2, tile));
  }
  Ref y = gb.op(nn::OpKind::kAdd, {r}, {x2, gb.dropout(f, r, d.drop, true)});
  StageGraph& g = gb.graph();
  g.saves = {kStageInput,
             ln1, GraphBuilder::slot(ln1, 1), GraphBuilder::slot(ln1, 2),
             qkv,
             att, GraphBuilder::slot(att, 1),
             x2,
             ln2, GraphBuilder::slot(ln2, 1), GraphBuilder::slot(ln2, 2)};
  if (!tiled) g.saves.insert(g.saves.end(), {h, gl});
  g.output = y;
  // GptBlock::backward (docs/memory-model.md, "porter's GPT, op by op").
  WorkspaceTrace w;
  if (d.sp) w.alloc(d.times(16, d.c));  // RowPartialGrads: the layernorms' f32 partial gradients
  const int df = dropout_backward(w, d, r);
  if (!tiled) {
    const int dg = row_linear_backward(w, d, d.times(4, u));
    w.free(df);
    const int dh = w.alloc(d.times(4, u));
    w.free(dg);
    column_linear_backward(w, d, r);  // dln2
    w.free(dh);
  } else {
    w.alloc(r);  // dln2
    w.transient(d.times(3, d.mlp_tile(4 * d.cs)));  // one tile's h, g (then dh) and dg
    w.free(df);
  }
  w.alloc(r);  // dx2
  const int dproj = dropout_backward(w, d, r);
  const int datt = row_linear_backward(w, d, u);
  w.free(dproj);
  const int dqkv = w.alloc(d.qkv());
  w.transient(attention_backward_workspace(d));
  w.free(datt);
  column_linear_backward(w, d, r);  // dln1
  w.free(dqkv);
  w.alloc(r);  // dx, the result
  g.backward_workspace_peak = w.peak();
  return g;
}

// A buffer, not a parameter: h.<l>.attn.bias and h.<l>.attn.masked_bias (the causal mask).
bool GptSpec::hf_is_buffer(const std::string& bare) const {
  if (!starts_with(bare, "h.")) return false;
  const size_t dot = bare.find('.', 2);
  if (dot == std::string::npos || dot == 2) return false;
  for (size_t i = 2; i < dot; ++i) {
    if (bare[i] < '0' || bare[i] > '9') return false;
  }
  const std::string rest = bare.substr(dot);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

std::vector<HfParam> GptSpec::hf_params(const config::ModelConfig& m) const {
  const int64_t c = m.hidden;
  std::vector<HfParam> out;
  const std::string t = "transformer.";
  const int64_t positions = position_rows(m);
  out.push_back({"wte", t + "wte.weight", {m.vocab, c}, false});
  out.push_back({"wpe", t + "wpe.weight", {positions, c}, false});
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    const std::string h = t + p;
    out.push_back({p + "ln1.weight", h + "ln_1.weight", {c}, false});
    out.push_back({p + "ln1.bias", h + "ln_1.bias", {c}, false});
    out.push_back({p + "qkv.weight", h + "attn.c_attn.weight", {3 * c, c}, true});
    out.push_back({p + "qkv.bias", h + "attn.c_attn.bias", {3 * c}, false});
    out.push_back({p + "proj.weight", h + "attn.c_proj.weight", {c, c}, true});
    out.push_back({p + "proj.bias", h + "attn.c_proj.bias", {c}, false});
    out.push_back({p + "ln2.weight", h + "ln_2.weight", {c}, false});
    out.push_back({p + "ln2.bias", h + "ln_2.bias", {c}, false});
    out.push_back({p + "fc1.weight", h + "mlp.c_fc.weight", {4 * c, c}, true});
    out.push_back({p + "fc1.bias", h + "mlp.c_fc.bias", {4 * c}, false});
    out.push_back({p + "fc2.weight", h + "mlp.c_proj.weight", {c, 4 * c}, true});
    out.push_back({p + "fc2.bias", h + "mlp.c_proj.bias", {c}, false});
  }
  out.push_back({"lnf.weight", t + "ln_f.weight", {c}, false});
  out.push_back({"lnf.bias", t + "ln_f.bias", {c}, false});
  if (!m.tie_embeddings) out.push_back({"head.weight", "lm_head.weight", {m.vocab, c}, false});
  return out;
}

// Note [porter.model.from] (GPT-2, model_type "gpt2"): config.json's keys, with transformers'
// defaults where it leaves one out: n_layer 12, n_embd 768, n_head 12, n_positions 1024,
// vocab_size 50257, layer_norm_epsilon 1e-5, tie_word_embeddings true; n_inner null
// (4 x n_embd), activation_function "gelu_new" (or "gelu_pytorch_tanh", the same tanh form),
// scale_attn_weights true, scale_attn_by_inverse_layer_idx false, add_cross_attention false.
HfModelKeys GptSpec::hf_read_config(const HfConfigReader& r) const {
  HfModelKeys hf;
  const int64_t layers = r.positive("n_layer", 12);
  const int64_t hidden = r.positive("n_embd", 768);
  const int64_t heads = r.positive("n_head", 12);
  const int64_t positions = r.positive("n_positions", 1024);
  const int64_t vocab = r.positive("vocab_size", 50257);
  const double eps = r.positive_real("layer_norm_epsilon", 1e-5);
  const bool tied = r.boolean("tie_word_embeddings", true);
  if (const Json* inner = r.get("n_inner")) {
    if (!inner->is_number_integer() || inner->get<int64_t>() != 4 * hidden) {
      r.fail("n_inner", inner->dump() + ": porter's GPT MLP is 4 x n_embd = " +
                            std::to_string(4 * hidden) + " wide (null means that width)");
    }
  }
  const std::string act = r.string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    r.fail("activation_function", "\"" + act + "\": porter's GPT computes the tanh form of GELU, "
                                  "which is \"gelu_new\" (or \"gelu_pytorch_tanh\")");
  }
  if (!r.boolean("scale_attn_weights", true)) {
    r.fail("scale_attn_weights", "false: porter's attention always scales the scores by "
                                 "1/sqrt(head size)");
  }
  if (r.boolean("scale_attn_by_inverse_layer_idx", false)) {
    r.fail("scale_attn_by_inverse_layer_idx", "true: porter's attention does not scale the "
                                              "scores by the layer index");
  }
  if (r.boolean("add_cross_attention", false)) {
    r.fail("add_cross_attention", "true: porter's GPT is a decoder without cross-attention");
  }
  hf.max_positions = positions;
  hf.model_keys = {{"arch", "gpt"},          {"layers", layers},
                   {"hidden", hidden},       {"heads", heads},
                   {"vocab", vocab},         {"tie_embeddings", tied},
                   {"kv_heads", heads},      {"intermediate", 4 * hidden},
                   {"norm_eps", eps},        {"max_positions", positions}};
  hf.hf_key = {{"arch", "model_type"},         {"layers", "n_layer"},
               {"hidden", "n_embd"},           {"heads", "n_head"},
               {"vocab", "vocab_size"},        {"tie_embeddings", "tie_word_embeddings"},
               {"kv_heads", "n_head"},         {"intermediate", "4 x n_embd ="},
               {"norm_eps", "layer_norm_epsilon"}, {"max_positions", "n_positions"}};
  return hf;
}

nlohmann::ordered_json GptSpec::hf_write_config(const config::ModelConfig& m,
                                                const Json& /*source*/) const {
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = m.vocab;
  j["n_positions"] = m.max_positions > 0 ? m.max_positions : m.seq_len;
  j["n_embd"] = m.hidden;
  j["n_layer"] = m.layers;
  j["n_head"] = m.heads;
  j["n_inner"] = nullptr;
  j["activation_function"] = "gelu_new";
  // porter drops after the embedding and each residual branch, never attention weights.
  j["resid_pdrop"] = m.dropout;
  j["embd_pdrop"] = m.dropout;
  j["attn_pdrop"] = 0.0;
  j["layer_norm_epsilon"] = m.norm_eps;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["use_cache"] = true;
  return j;
}

}  // namespace porter::models
