// The one factory: the spec of every built-in architecture (models/spec.h), looked up by
// porter.model.arch or by a Hugging Face config.json's model_type, and the model a
// config::ModelConfig describes. Adding an architecture adds its spec to the table in
// models/factory.cc (docs/models.md).
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "config/config.h"
#include "models/spec.h"
#include "models/transformer.h"

namespace porter::models {

// Every built-in architecture's spec, in config::ModelType order.
std::span<const ArchSpec* const> arch_specs();

// The spec of `type`; every config::ModelType has one.
const ArchSpec& arch_spec(config::ModelType type);

// The spec whose Hugging Face model_type is `model_type`, or nullptr.
const ArchSpec* arch_spec_for_hf(std::string_view model_type);

// Rank tp_rank's part of the model `config` describes (Note [GPT tensor parallelism] in
// models/transformer.h). Throws InvalidArgument for configs it cannot build.
std::unique_ptr<Transformer> build_model(const config::ModelConfig& config, int tp_rank = 0);

}  // namespace porter::models
