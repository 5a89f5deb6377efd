// The categories every allocation carries, so that memory can be accounted by purpose.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>

namespace porter::memory {

enum class Category : int {
  kParams = 0,    // working-precision parameters
  kGrads,         // parameter gradients
  kOptimizer,     // fp32 master weights and AdamW moments
  kActivations,   // tensors saved for backward
  kCheckpoints,   // device-resident checkpoint inputs
  kStaging,       // offload / prefetch slots
  kWorkspace,     // temporaries of a kernel or an op
  kComm,          // communication buckets
};
inline constexpr size_t kNumCategories = 8;

inline constexpr std::array<Category, kNumCategories> kAllCategories = {
    Category::kParams,      Category::kGrads,   Category::kOptimizer, Category::kActivations,
    Category::kCheckpoints, Category::kStaging, Category::kWorkspace, Category::kComm};

constexpr std::string_view category_name(Category c) {
  constexpr std::array<std::string_view, kNumCategories> kNames = {
      "params", "grads", "optimizer", "activations", "checkpoints", "staging", "workspace", "comm"};
  return kNames[static_cast<size_t>(c)];
}

std::optional<Category> category_from_name(std::string_view name);

// The configuration knob that lowers a category's use; ends an out-of-memory message.
std::string_view category_hint(Category c);

constexpr size_t index_of(Category c) { return static_cast<size_t>(c); }

// Whether bytes of `c` count toward the activation footprint: activations, device-resident
// checkpoints, and the staging slots that offloaded checkpoints come back into (zero
// without offload). The planner's byte model predicts exactly this sum.
constexpr bool is_activation(Category c) {
  return c == Category::kActivations || c == Category::kCheckpoints || c == Category::kStaging;
}

}  // namespace porter::memory
