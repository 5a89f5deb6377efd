// The analytic activation model of porter's built-in GPT: every stage's bytes under every
// save option, for one rank of its tensor-parallel group, computed from the model shape, the
// micro-batch and the dtype without allocating anything. docs/memory-model.md derives the
// formulas; tests check that they equal what the allocator measures, to the byte.
#pragma once

#include <cstdint>

#include "checkpoint/costs.h"
#include "config/config.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "tensor/dtype.h"

namespace porter::checkpoint {

struct GptShape {
  // Its tensor_parallel t and sequence_parallel say which rank's share the figures are of
  // (Note [GPT tensor parallelism] in models/transformer.h); every rank of the group has the same.
  config::ModelConfig model;
  int64_t micro_batch = 1;  // B
  int64_t seq = 0;          // T; 0 = model.seq_len
  tensor::DType compute_dtype = tensor::DType::kF32;
  // The device the kernels run on: their workspace differs (Note [Kernel workspace] in
  // kernels/kernels.h), and with it the *_total_peak_bytes figures; the activation figures do not.
  memory::DeviceKind device = memory::DeviceKind::kCpu;
};

// Bytes (and forward FLOPs) of every stage and option on one rank; times are 0 (source
// "analytic").
ChainCosts analytic_gpt_costs(const GptShape& shape,
                              const nn::OpPolicy& selective = nn::OpPolicy::selective_attention());

// The closed form of the `none` policy's activation peak for one micro-batch on one rank
// (docs/memory-model.md, "The none peak").
size_t gpt_none_peak_bytes(const GptShape& shape);

// One block's activations kept for its backward, its input included (the keep option's
// saved bytes plus the input): porter's exact counterpart of korthikanti_layer_bytes.
size_t gpt_layer_bytes(const GptShape& shape);

// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
// the activation bytes of one transformer layer in their 16-bit accounting, with s = seq,
// b = micro-batch, h = hidden, a = heads, t = tensor_parallel:
//   sbh(34 + 5as/h)                 without tensor parallelism,
//   sbh(10 + 24/t + 5as/(ht))       with it,
//   sbh(34 + 5as/h) / t             with sequence parallelism too.
// For reports beside gpt_layer_bytes; docs/memory-model.md ("Against Korthikanti et al.")
// says why the two differ.
double korthikanti_layer_bytes(const GptShape& shape);

// Model-state bytes: parameters, gradients, optimizer state (master copy when the compute
// dtype is not f32, and two AdamW moments), for one rank without ZeRO. At tensor_parallel
// t > 1 a rank holds its 1/t of the split parameters and all of the replicated ones (its
// models::Gpt layout, padding included).
struct ModelStateBytes {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
};
ModelStateBytes gpt_model_state_bytes(const config::ModelConfig& model, tensor::DType compute_dtype);

}  // namespace porter::checkpoint
