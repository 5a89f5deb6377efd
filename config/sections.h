// Internal to config/: the readers of each part of the document, and the JSON spelling of
// every enum (shared by parsing, printing and to_string).
#pragma once

#include "config/config.h"
#include "config/json_reader.h"

namespace porter::config::detail {

inline constexpr EnumName<OffloadDevice> kOffloadDevices[] = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}};
inline constexpr EnumName<SchedulerType> kSchedulerTypes[] = {
    {"WarmupLR", SchedulerType::kWarmupLR},
    {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
    {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}};
inline constexpr EnumName<WarmupType> kWarmupTypes[] = {{"log", WarmupType::kLog},
                                                        {"linear", WarmupType::kLinear}};
inline constexpr EnumName<ModelType> kModelTypes[] = {{"gpt", ModelType::kGpt}};
inline constexpr EnumName<DataType> kDataTypes[] = {{"synthetic", DataType::kSynthetic},
                                                    {"text", DataType::kText}};
inline constexpr EnumName<CommBackend> kCommBackends[] = {
    {"auto", CommBackend::kAuto}, {"gloo", CommBackend::kGloo}, {"nccl", CommBackend::kNccl}};
inline constexpr EnumName<DeviceType> kDeviceTypes[] = {
    {"auto", DeviceType::kAuto}, {"cpu", DeviceType::kCpu}, {"cuda", DeviceType::kCuda}};
inline constexpr EnumName<CheckpointPolicy> kCheckpointPolicies[] = {
    {"none", CheckpointPolicy::kNone},       {"full", CheckpointPolicy::kFull},
    {"uniform", CheckpointPolicy::kUniform}, {"block", CheckpointPolicy::kBlock},
    {"sqrt", CheckpointPolicy::kSqrt},       {"selective", CheckpointPolicy::kSelective},
    {"optimal", CheckpointPolicy::kOptimal}};

// What the porter section's reading leaves for the checks that need the DeepSpeed keys too.
struct PorterReadState {
  bool policy_given = false;  // porter.checkpointing.policy was in the file
};

// porter's own section. Read first: "auto" values in the DeepSpeed sections depend on the model.
PorterReadState read_porter_section(ObjectReader& root, Config& config);
// Every DeepSpeed key (deepspeed_keys.cc).
void read_deepspeed_keys(ObjectReader& root, Config& config);
// Resolves the checkpoint policy and checks combinations across sections (porter_keys.cc).
void check_across_sections(const PorterReadState& state, Config& config);

}  // namespace porter::config::detail
