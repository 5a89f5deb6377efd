// Config -> JSON: the resolved config, printed from the same key tables the parser reads
// (Note [Key tables]), so that to_json(parse(to_json(c))) == to_json(c). "none" values print
// as null to show the key exists.
#include "config/parse.h"
#include "config/sections.h"

namespace porter::config {
namespace {

using detail::keys_json;
using detail::OJson;

template <typename T>
OJson or_null(const std::optional<T>& v) {
  return v ? OJson(*v) : OJson(nullptr);
}

// The scheduler has no key table: which params it takes depends on its type.
OJson scheduler_params_json(const SchedulerConfig& s) {
  OJson params;
  if (s.type == SchedulerType::kWarmupCosineLR) {
    params["total_num_steps"] = or_null(s.total_num_steps);
    params["warmup_min_ratio"] = s.warmup_min_ratio;
    params["cos_min_ratio"] = s.cos_min_ratio;
  } else {
    if (s.type == SchedulerType::kWarmupDecayLR) {
      params["total_num_steps"] = or_null(s.total_num_steps);
    }
    params["warmup_min_lr"] = s.warmup_min_lr;
    params["warmup_max_lr"] = s.warmup_max_lr;
  }
  params["warmup_num_steps"] = s.warmup_num_steps;
  params["warmup_type"] = to_string(s.warmup_type);
  params["last_batch_iteration"] = s.last_batch_iteration;
  return params;
}

OJson zero_json(const ZeroConfig& z) {
  OJson j = keys_json(z);
  j["offload_optimizer"] = keys_json(z.offload_optimizer);
  j["offload_param"] = keys_json(z.offload_param);
  return j;
}

OJson porter_json(const PorterSection& p) {
  OJson j;
  j["model"] = keys_json(p.model);
  j["data"] = keys_json(p.data);
  j["device"] = keys_json(p.device);
  j["checkpointing"] = keys_json(p.checkpointing);
  j["train"] = keys_json(p.train);
  j["trace"] = keys_json(p.trace);
  j["comm"] = keys_json(p.comm);
  j["optimizer"] = keys_json(p.optimizer);
  return j;
}

}  // namespace

nlohmann::ordered_json to_json(const Config& c) {
  OJson j;
  // The batch triple is resolved by hand (Note [Batch triple]); printed as resolved.
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  detail::write_keys(j, c);
  if (c.optimizer) {
    j["optimizer"] = {{"type", to_string(c.optimizer->type)},
                      {"params", keys_json(*c.optimizer)}};
  }
  if (c.scheduler) {
    j["scheduler"] = {{"type", to_string(c.scheduler->type)},
                      {"params", scheduler_params_json(*c.scheduler)}};
  }
  j["fp16"] = keys_json(c.fp16);
  j["bf16"] = keys_json(c.bf16);
  j["data_types"] = {{"grad_accum_dtype", c.data_types.grad_accum_dtype
                                               ? OJson(to_string(*c.data_types.grad_accum_dtype))
                                               : OJson()}};
  j["communication_data_type"] =
      c.communication_data_type ? OJson(to_string(*c.communication_data_type)) : OJson();
  j["zero_optimization"] = zero_json(c.zero_optimization);
  if (c.activation_checkpointing) {
    j["activation_checkpointing"] = keys_json(*c.activation_checkpointing);
  }
  j["porter"] = porter_json(c.porter);
  return j;
}

std::string to_json_string(const Config& config, int indent) {
  return to_json(config).dump(indent, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace porter::config
