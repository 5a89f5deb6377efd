// The whole model's parameters, gathered from a running engine.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "engine/engine.h"

namespace porter::engine {

// Note [Whole parameters]
// The built-in GPT's parameters in the layout at tensor_parallel 1, from a running engine:
// every rank calls it (at ZeRO stage 3 Engine::params_host all-gathers the shards over the
// data-parallel ranks); the ranks of data-parallel rank 0 then all-gather their
// tensor-parallel parts over `tp` (null for tensor_parallel 1) in chunks of 2^20 elements
// through device buffers, and put every element where models::Transformer::shard_values took it from
// (replicated ones from tp rank 0). Returns the values on the ranks of data-parallel rank 0,
// an empty vector on the others.
std::vector<float> whole_params_host(Engine& engine, comm::Communicator* tp);

}  // namespace porter::engine
