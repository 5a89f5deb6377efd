// The analytic activation model of the built-in transformers: every stage's bytes under every
// save option, for one rank of its tensor-parallel group, computed from the model shape, the
// micro-batch and the dtype without allocating anything. The embedding and head graphs are
// shared; each block's graph is its spec's (ArchSpec::block_graph), written with the op graph
// of checkpoint/analytic.h. docs/memory-model.md derives the formulas; tests check that they
// equal what the allocator measures, to the byte.
#pragma once

#include <cstdint>
#include <string>

#include "base/checked.h"
#include "checkpoint/analytic.h"
#include "checkpoint/costs.h"
#include "config/config.h"
#include "kernels/kernels.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "tensor/dtype.h"

namespace porter::models {

struct TransformerShape {
  // Its tensor_parallel t and sequence_parallel say which rank's share the figures are of
  // (Note [GPT tensor parallelism] in models/transformer.h); every rank of the group has the
  // same.
  config::ModelConfig model;
  int64_t micro_batch = 1;  // B
  int64_t seq = 0;          // T; 0 = model.seq_len
  tensor::DType compute_dtype = tensor::DType::kF32;
  // The device the kernels run on: their workspace differs (Note [Kernel workspace] in
  // kernels/kernels.h), and with it the *_total_peak_bytes figures; the activation figures do
  // not.
  memory::DeviceKind device = memory::DeviceKind::kCpu;
};

// The sizes of one tensor-parallel rank's tensors (Note [GPT tensor parallelism] in
// models/transformer.h), which the stage graphs are written in. At tp 1 every per-rank size
// is the whole one. Every byte count below is a checked product (Note [Checked sizes] in
// base/checked.h): one that does not fit 64 bits throws InvalidArgument naming the config keys
// it is made of.
struct TransformerDims {
  size_t b, t, c, h, v, dt, n;  // n = b * t rows
  size_t tp;                    // ranks of the tensor-parallel group
  bool sp;                      // sequence parallelism (tp > 1 only)
  size_t rows;                  // token rows of the residual stream here: n, or n / tp under sp
  size_t cs, hs;                // this rank's channels C / tp and heads H / tp
  size_t vs;                    // this rank's logit columns: V, or ceil(V / tp) at tp > 1
  bool drop;
  tensor::DType dtype;
  memory::DeviceKind device;
  size_t kvs = 0;               // this rank's key/value channels Hkv * D / tp
  size_t fs = 0;                // this rank's MLP width F / tp
  bool flash = false;           // porter.model.attention "flash" (auto counts as materialized)
  size_t loss_tiles = 1;        // porter.model.loss_tiles (Note [Loss tiles] in models/transformer.cc)
  size_t mlp_tiles = 1;         // porter.model.mlp_tiles (Note [MLP tiles] in models/blocks.cc)
  size_t kv_col() const {  // (B, T, Hkv D / tp)
    return checked_product({kB(), kT(), {"porter.model.kv_heads x head dim / tensor_parallel", kvs}, kDt()},
                           "a block's key/value projection");
  }
  size_t mlp() const {  // (B, T, F / tp)
    return checked_product({kB(), kT(), {"porter.model.intermediate / tensor_parallel", fs}, kDt()},
                           "a block's MLP activation");
  }
  size_t whole() const {  // a (B, T, C) activation, A
    return checked_product({kB(), kT(), {"porter.model.hidden", c}, kDt()}, "a (B, T, C) activation");
  }
  size_t res() const {  // the residual stream's rows here
    return sp ? checked_product({{"token rows per sequence-parallel rank", rows}, {"porter.model.hidden", c}, kDt()},
                                "the residual stream")
              : whole();
  }
  size_t col() const {  // (B, T, C / tp): this rank's channels
    return checked_product({kB(), kT(), {"porter.model.hidden / tensor_parallel", cs}, kDt()},
                           "a (B, T, C / tp) activation");
  }
  size_t stat() const {  // a norm's mean or rstd (f32)
    return checked_product({{"token rows", rows}, {"bytes (f32)", 4}}, "a norm's statistics");
  }
  size_t probs() const {
    return checked_product({kB(), {"porter.model.heads / tensor_parallel", hs}, kT(), kT(), {"bytes (f32)", 4}},
                           "the attention probabilities (B, H / tp, T, T) of one block");
  }
  size_t lse() const {  // flash attention's row log-sum-exp (B, H / tp, T) f32
    return checked_product({kB(), {"porter.model.heads / tensor_parallel", hs}, kT(), {"bytes (f32)", 4}},
                           "the attention's row log-sum-exp (B, H / tp, T) of one block");
  }
  // What the attention keeps for backward besides its output: probs(), or lse() with flash.
  size_t attn_saved() const { return flash ? lse() : probs(); }
  // The attention's input: (B, T, 3C / tp), or with flash (B, T, (C + 2 Hkv D) / tp), the key
  // and value heads not expanded (Note [Rotary qkv] in kernels/kernels.cc). One for the GPT.
  size_t qkv() const {
    return flash ? checked_add(times(2, kv_col()), col(), "a block's qkv", shape_terms())
                 : times(3, col());
  }
  size_t logits() const {  // (B, T, V / tp)
    return checked_product({kB(), kT(), {"porter.model.vocab / tensor_parallel", vs}, kDt()},
                           "the logits (B, T, V / tp)");
  }
  // The rows of the largest loss tile, ceil(N / loss_tiles) (models::loss_tile_rows).
  size_t tile_rows() const { return (n + loss_tiles - 1) / loss_tiles; }
  size_t logits_tile() const {  // one loss tile's logits (ceil(N / k), V / tp)
    return checked_product({{"token rows per loss tile (porter.model.loss_tiles)", tile_rows()},
                            {"porter.model.vocab / tensor_parallel", vs}, kDt()},
                           "one loss tile's logits");
  }
  // The rows of the largest MLP tile, ceil(N / mlp_tiles).
  size_t mlp_tile_rows() const { return (n + mlp_tiles - 1) / mlp_tiles; }
  // One MLP tile's (ceil(N / mlp_tiles), width) tensor: width 4C / tp for the GPT's h and g,
  // F / tp for the Llama's gate, up and SwiGLU, C for a row block of the input gradient.
  size_t mlp_tile(size_t width) const {
    return checked_product({{"token rows per MLP tile (porter.model.mlp_tiles)", mlp_tile_rows()},
                            {"the MLP tile's width", width}, kDt()},
                           "one MLP tile's intermediate");
  }
  // Inside a sequence-parallel matmul: its gathered input (column-parallel) or its partial
  // output (row-parallel), both (N, C).
  size_t sp_gather() const { return sp ? whole() : 0; }
  // k x `bytes`, checked; for the graphs' fixed multiples (3 u for qkv, 4 u for the MLP).
  size_t times(size_t k, size_t bytes) const {
    return checked_mul(k, bytes, "a block's activations", shape_terms());
  }
  // Every shape key with its value, for an overflow message that cannot name fewer.
  std::string shape_terms() const;

 private:
  SizeFactor kB() const { return {"micro-batch (train_micro_batch_size_per_gpu)", b}; }
  SizeFactor kT() const { return {"porter.model.seq_len", t}; }
  SizeFactor kDt() const { return {"bytes per element", dt}; }
};

TransformerDims dims_of(const TransformerShape& shape);

// The attention call of a block: this rank's heads, qkv, out, dout and dqkv all in the
// compute dtype.
kernels::AttentionCall attention_call(const TransformerDims& d);
kernels::FlashAttentionCall flash_attention_call(const TransformerDims& d);
// The workspace of the block's attention calls, materialised or flash as d.flash says.
size_t attention_forward_workspace(const TransformerDims& d);
size_t attention_backward_workspace(const TransformerDims& d);

// models/blocks.cc's backward helpers as workspace traces: each returns its result, dx, whose
// input x has x_bytes; the gathered tensors of sequence parallelism are freed when the helper
// returns.
int column_linear_backward(checkpoint::WorkspaceTrace& w, const TransformerDims& d,
                           size_t x_bytes);
int row_linear_backward(checkpoint::WorkspaceTrace& w, const TransformerDims& d, size_t x_bytes);
int dropout_backward(checkpoint::WorkspaceTrace& w, const TransformerDims& d, size_t bytes);

// Bytes (and forward FLOPs) of every stage and option on one rank; times are 0 (source
// "analytic").
checkpoint::ChainCosts analytic_transformer_costs(
    const TransformerShape& shape,
    const nn::OpPolicy& selective = nn::OpPolicy::selective_attention());

// The `none` policy's activation peak for one micro-batch on one rank (docs/memory-model.md,
// "The none peak").
size_t none_peak_bytes(const TransformerShape& shape);

// One block's activations kept for its backward, its input included (the keep option's
// saved bytes plus the input): porter's exact counterpart of korthikanti_layer_bytes.
size_t layer_bytes(const TransformerShape& shape);

// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
// the activation bytes of one transformer layer in their 16-bit accounting, with s = seq,
// b = micro-batch, h = hidden, a = heads, t = tensor_parallel:
//   sbh(34 + 5as/h)                 without tensor parallelism,
//   sbh(10 + 24/t + 5as/(ht))       with it,
//   sbh(34 + 5as/h) / t             with sequence parallelism too;
// with porter.model.attention "flash" the 5as/h term (the (s, s) matrices) is dropped.
// For reports beside layer_bytes; docs/memory-model.md ("Against Korthikanti et al.") says
// why the two differ.
double korthikanti_layer_bytes(const TransformerShape& shape);

// Model-state bytes: parameters, gradients, optimizer state (master copy when the compute
// dtype is not f32, and two AdamW moments), for one rank without ZeRO. At tensor_parallel
// t > 1 a rank holds its 1/t of the split parameters and all of the replicated ones (its
// models::Transformer layout, padding included).
struct ModelStateBytes {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
};
ModelStateBytes model_state_bytes(const config::ModelConfig& model, tensor::DType compute_dtype);

}  // namespace porter::models
