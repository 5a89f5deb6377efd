// ZeRO stage 3's gather units of a model: each stage's flat parameter range, which stages read
// which units, and the knobs, for the planner (checkpoint::ParamGather, Note [Gathered
// parameters] in checkpoint/costs.h) and for the gatherer (zero::ParamUnit, Note [Stage 3
// gather] in zero/param_gatherer.h), from one computation so the two cannot disagree.
#pragma once

#include <vector>

#include "checkpoint/costs.h"
#include "config/config.h"
#include "engine/model.h"
#include "tensor/dtype.h"
#include "zero/param_gatherer.h"

namespace porter::engine {

struct Stage3Layout {
  checkpoint::ParamGather costs;       // enabled
  std::vector<zero::ParamUnit> units;  // one per stage, in stage order
};

// Unit s is stage s's range (zero::stage_layout); stage s reads its own unit and every unit
// whose gradients it writes (Model::grad_writers: the head reads the tied embedding). A unit
// with fewer elements than zero.stage3_param_persistence_threshold is persistent.
Stage3Layout stage3_layout(Model& model, const config::ZeroConfig& zero, tensor::DType dtype);

// For planning without an Engine (porter plan, porter estimate): at zero_optimization.stage 3
// sets costs.params to the built-in GPT's units (tp rank 0's part, which every rank's equals
// in size), as the Engine does; below stage 3 leaves the costs as they are.
void add_stage3_params(checkpoint::ChainCosts& costs, const config::Config& config, tensor::DType dtype);

}  // namespace porter::engine
