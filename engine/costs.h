// How the engine acquires the costs it plans from (Note [Engine costs] in run_options.h):
// the profiler that measures a chain's stages (Note [Profiling]), what the ranks agree on
// before they plan (Note [Agreed costs]) and the link and tensor-parallel probes. Internal to
// the engine; Engine::profile, Engine::plan_from_costs and the agreement live in costs.cc
// with it.
#pragma once

#include <functional>
#include <string>

#include "checkpoint/costs.h"
#include "engine/model.h"
#include "nn/ctx.h"
#include "tensor/tensor.h"

namespace porter::engine {

// Profiles every stage of `model` under every save option on (tokens, targets). Gradients
// accumulate into the bound gradient buffer: the caller saves and restores it. `stage_hook`
// (when set) runs before a stage's measurements (begin true) and after them, outside every
// measured window: ZeRO stage 3 gathers the stage's parameters there (Note [Stage 3 driver]
// in stage3.h).
checkpoint::ChainCosts profile_chain(Model& model, nn::Ctx& ctx, const tensor::Tensor& tokens,
                                     const tensor::Tensor& targets,
                                     const nn::OpPolicy& selective_policy,
                                     const std::string& selective_ops,
                                     const std::function<void(int stage, bool begin)>& stage_hook = {});

}  // namespace porter::engine
