// Internal to config/: the readers of each part of the document, the key table of each
// section (shared by parsing and printing), and the JSON spelling of every enum.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "config/config.h"
#include "config/json_reader.h"
#include "config/key_table.h"

namespace porter::config::detail {

inline constexpr EnumName<OffloadDevice> kOffloadDevices[] = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}};
inline constexpr EnumName<SchedulerType> kSchedulerTypes[] = {
    {"WarmupLR", SchedulerType::kWarmupLR},
    {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
    {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}};
inline constexpr EnumName<WarmupType> kWarmupTypes[] = {{"log", WarmupType::kLog},
                                                        {"linear", WarmupType::kLinear}};
inline constexpr EnumName<ModelType> kModelTypes[] = {{"gpt", ModelType::kGpt},
                                                      {"llama", ModelType::kLlama},
                                                      {"qwen2", ModelType::kQwen2}};
inline constexpr EnumName<DataType> kDataTypes[] = {{"synthetic", DataType::kSynthetic},
                                                    {"text", DataType::kText},
                                                    {"tokens", DataType::kTokens}};
inline constexpr EnumName<CommBackend> kCommBackends[] = {
    {"auto", CommBackend::kAuto}, {"gloo", CommBackend::kGloo}, {"nccl", CommBackend::kNccl}};
inline constexpr EnumName<DeviceType> kDeviceTypes[] = {
    {"auto", DeviceType::kAuto}, {"cpu", DeviceType::kCpu}, {"cuda", DeviceType::kCuda}};
inline constexpr EnumName<AttentionKind> kAttentionKinds[] = {
    {"auto", AttentionKind::kAuto},
    {"flash", AttentionKind::kFlash},
    {"materialized", AttentionKind::kMaterialized}};
inline constexpr EnumName<KernelChoice> kKernelChoices[] = {{"exact", KernelChoice::kExact},
                                                            {"fastest", KernelChoice::kFastest}};
inline constexpr EnumName<GradDType> kGradDTypes[] = {
    {"fp32", GradDType::kFp32}, {"bf16", GradDType::kBf16}, {"fp16", GradDType::kFp16}};
inline constexpr EnumName<GpuModel> kGpuModels[] = {{"h100-sxm", GpuModel::kH100Sxm},
                                                    {"h200", GpuModel::kH200},
                                                    {"a100-80gb", GpuModel::kA100_80gb},
                                                    {"l40s", GpuModel::kL40s}};
inline constexpr EnumName<CheckpointPolicy> kCheckpointPolicies[] = {
    {"none", CheckpointPolicy::kNone},       {"full", CheckpointPolicy::kFull},
    {"uniform", CheckpointPolicy::kUniform}, {"block", CheckpointPolicy::kBlock},
    {"sqrt", CheckpointPolicy::kSqrt},       {"selective", CheckpointPolicy::kSelective},
    {"optimal", CheckpointPolicy::kOptimal}};

// The key tables (Note [Key tables]): the DeepSpeed sections' in deepspeed_keys.cc, porter's
// in porter_keys.cc. Config's own table holds the top-level scalars, OptimizerConfig's the
// optimizer params. The scheduler has none: which keys it takes depends on its type.
using DeepSpeedKeyTables =
    std::tuple<KeyTable<Config>, KeyTable<OptimizerConfig>, KeyTable<Fp16Config>,
               KeyTable<Bf16Config>, KeyTable<ZeroConfig>, KeyTable<OffloadOptimizerConfig>,
               KeyTable<OffloadParamConfig>, KeyTable<ActivationCheckpointingConfig>>;
using PorterKeyTables =
    std::tuple<KeyTable<ModelConfig>, KeyTable<DataConfig>, KeyTable<DeviceConfig>,
               KeyTable<CheckpointingConfig>, KeyTable<TrainConfig>, KeyTable<TraceConfig>,
               KeyTable<CommConfig>, KeyTable<PorterOptimizerConfig>>;
const DeepSpeedKeyTables& deepspeed_key_tables();
const PorterKeyTables& porter_key_tables();

template <typename T, typename Tuple>
inline constexpr bool kTupleHolds = false;
template <typename T, typename... Ts>
inline constexpr bool kTupleHolds<T, std::tuple<Ts...>> = (std::is_same_v<T, Ts> || ...);

template <typename S>
KeyTable<S> keys_of() {
  if constexpr (kTupleHolds<KeyTable<S>, DeepSpeedKeyTables>) {
    return std::get<KeyTable<S>>(deepspeed_key_tables());
  } else {
    return std::get<KeyTable<S>>(porter_key_tables());
  }
}

// What the porter section's reading leaves for the checks that need the DeepSpeed keys too.
struct PorterReadState {
  bool policy_given = false;     // porter.checkpointing.policy was in the file
  bool log_every_given = false;  // porter.train.log_every was (Note [Progress cadence])
  bool model_given = false;      // porter.model was, and not null
};

// porter's own section. Read first: "auto" values in the DeepSpeed sections depend on the model.
PorterReadState read_porter_section(ObjectReader& root, Config& config);
// Every DeepSpeed key (deepspeed_keys.cc).
void read_deepspeed_keys(ObjectReader& root, Config& config);
// Resolves the checkpoint policy and checks combinations across sections (porter_keys.cc).
void check_across_sections(const PorterReadState& state, Config& config, Diagnostics& diag);

// The whole-document steps of parse_config_string (parse.cc), shared with the merge of several
// sources (merge.cc, Note [Several config files] in config/merge.h).
// Text -> document: an empty text, malformed JSON, duplicate keys and a top level that is not an
// object are errors.
Json parse_config_text(std::string_view json_text);
// The file's bytes; IoError when it cannot be read.
std::string read_config_text(const std::filesystem::path& path);
// Document -> config: every section read and checked; warnings, or under options.strict one
// error listing them.
ParseResult parse_config_document(const Json& document, const ParseOptions& options);

}  // namespace porter::config::detail
