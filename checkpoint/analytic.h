// The analytic activation model of porter's built-in GPT: every stage's bytes under every
// save option, computed from the model shape, the micro-batch and the dtype without
// allocating anything. docs/memory-model.md derives the formulas; tests check that they
// equal what the allocator measures, to the byte.
#pragma once

#include <cstdint>

#include "checkpoint/costs.h"
#include "config/config.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "nn/dtype.h"

namespace porter::checkpoint {

struct GptShape {
  config::ModelConfig model;
  int64_t micro_batch = 1;  // B
  int64_t seq = 0;          // T; 0 = model.seq_len
  nn::DType compute_dtype = nn::DType::kF32;
  // The device the kernels run on: their workspace differs (Note [Kernel workspace] in
  // nn/kernels.h), and with it the *_total_peak_bytes figures; the activation figures do not.
  memory::DeviceKind device = memory::DeviceKind::kCpu;
};

// Bytes (and forward FLOPs) of every stage and option; times are 0 (source "analytic").
ChainCosts analytic_gpt_costs(const GptShape& shape,
                              const nn::OpPolicy& selective = nn::OpPolicy::selective_attention());

// The closed form of the `none` policy's activation peak for one micro-batch
// (docs/memory-model.md, "The formula").
size_t gpt_none_peak_bytes(const GptShape& shape);

// Model-state bytes: parameters, gradients, optimizer state (master copy when the compute
// dtype is not f32, and two AdamW moments), for one rank without ZeRO.
struct ModelStateBytes {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
};
ModelStateBytes gpt_model_state_bytes(const config::ModelConfig& model, nn::DType compute_dtype);

}  // namespace porter::checkpoint
