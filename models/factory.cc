// The table of built-in architectures (models/factory.h).
#include "models/factory.h"

#include <array>

#include "base/check.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/qwen2.h"

namespace porter::models {
namespace {

const GptSpec kGpt;
const LlamaSpec kLlama;
const Qwen2Spec kQwen2;

// In config::ModelType order: arch_spec indexes it by the enum's value.
const std::array<const ArchSpec*, 3> kSpecs = {&kGpt, &kLlama, &kQwen2};

}  // namespace

std::span<const ArchSpec* const> arch_specs() { return kSpecs; }

const ArchSpec& arch_spec(config::ModelType type) {
  const size_t i = static_cast<size_t>(type);
  PORTER_ASSERT(i < kSpecs.size() && kSpecs[i]->type() == type,
                "config::ModelType without a spec in models/factory.cc");
  return *kSpecs[i];
}

const ArchSpec* arch_spec_for_hf(std::string_view model_type) {
  for (const ArchSpec* s : kSpecs)
    if (s->hf_model_type() == model_type) return s;
  return nullptr;
}

std::unique_ptr<Transformer> build_model(const config::ModelConfig& config, int tp_rank) {
  return std::make_unique<Transformer>(config, tp_rank);
}

}  // namespace porter::models
