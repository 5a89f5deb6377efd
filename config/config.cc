// The JSON spelling of each config enum.
#include "config/config.h"

#include "config/sections.h"

namespace porter::config {
namespace {

template <typename E, size_t N>
std::string_view name_of(const detail::EnumName<E> (&table)[N], E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return "?";
}

}  // namespace

std::string_view to_string(OptimizerType v) { return v == OptimizerType::kAdam ? "Adam" : "AdamW"; }
std::string_view to_string(SchedulerType v) { return name_of(detail::kSchedulerTypes, v); }
std::string_view to_string(WarmupType v) { return name_of(detail::kWarmupTypes, v); }
std::string_view to_string(OffloadDevice v) { return name_of(detail::kOffloadDevices, v); }
std::string_view to_string(ModelType v) { return name_of(detail::kModelTypes, v); }
std::string_view to_string(DataType v) { return name_of(detail::kDataTypes, v); }
std::string_view to_string(DeviceType v) { return name_of(detail::kDeviceTypes, v); }
std::string_view to_string(CheckpointPolicy v) { return name_of(detail::kCheckpointPolicies, v); }
std::string_view to_string(CommBackend v) { return name_of(detail::kCommBackends, v); }

const std::vector<std::string>& selective_op_kinds() {
  // The ops of one GPT block, in forward order.
  static const std::vector<std::string> kinds = {"layernorm", "qkv", "core_attention", "proj",
                                                 "fc1",       "gelu", "fc2",           "dropout"};
  return kinds;
}

}  // namespace porter::config
