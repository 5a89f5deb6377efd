// The JSON spelling of each config enum.
#include "config/config.h"

#include "config/sections.h"

namespace porter::config {

using detail::enum_name;

std::string_view to_string(OptimizerType v) { return v == OptimizerType::kAdam ? "Adam" : "AdamW"; }
std::string_view to_string(SchedulerType v) { return enum_name(detail::kSchedulerTypes, v); }
std::string_view to_string(WarmupType v) { return enum_name(detail::kWarmupTypes, v); }
std::string_view to_string(OffloadDevice v) { return enum_name(detail::kOffloadDevices, v); }
std::string_view to_string(ModelType v) { return enum_name(detail::kModelTypes, v); }
std::string_view to_string(AttentionKind v) { return enum_name(detail::kAttentionKinds, v); }
std::string_view to_string(DataType v) { return enum_name(detail::kDataTypes, v); }
std::string_view to_string(DeviceType v) { return enum_name(detail::kDeviceTypes, v); }
std::string_view to_string(CheckpointPolicy v) { return enum_name(detail::kCheckpointPolicies, v); }
std::string_view to_string(CommBackend v) { return enum_name(detail::kCommBackends, v); }
std::string_view to_string(KernelChoice v) { return enum_name(detail::kKernelChoices, v); }
std::string_view to_string(GpuModel v) { return enum_name(detail::kGpuModels, v); }
std::string_view to_string(GradDType v) { return enum_name(detail::kGradDTypes, v); }

const std::vector<std::string>& selective_op_kinds() {
  // The ops of one GPT block, in forward order.
  static const std::vector<std::string> kinds = {"layernorm", "qkv", "core_attention", "proj",
                                                 "fc1",       "gelu", "fc2",           "dropout"};
  return kinds;
}

}  // namespace porter::config
