// Config -> JSON: the resolved config, every key spelled as the parser reads it, so that
// to_json(parse(to_json(c))) == to_json(c). "none" values print as null to show the key exists.
#include "config/parse.h"

namespace porter::config {
namespace {

using OJson = nlohmann::ordered_json;

template <typename T>
OJson or_null(const std::optional<T>& v) {
  return v ? OJson(*v) : OJson(nullptr);
}

OJson optimizer_json(const OptimizerConfig& o) {
  OJson params;
  params["lr"] = o.lr;
  params["betas"] = {o.beta1, o.beta2};
  params["eps"] = o.eps;
  params["weight_decay"] = o.weight_decay;
  params["torch_adam"] = o.torch_adam;
  params["adam_w_mode"] = o.adam_w_mode;
  OJson j;
  j["type"] = to_string(o.type);
  j["params"] = params;
  return j;
}

OJson scheduler_json(const SchedulerConfig& s) {
  OJson params;
  if (s.type == SchedulerType::kWarmupCosineLR) {
    params["total_num_steps"] = or_null(s.total_num_steps);
    params["warmup_min_ratio"] = s.warmup_min_ratio;
    params["cos_min_ratio"] = s.cos_min_ratio;
  } else {
    if (s.type == SchedulerType::kWarmupDecayLR) params["total_num_steps"] = or_null(s.total_num_steps);
    params["warmup_min_lr"] = s.warmup_min_lr;
    params["warmup_max_lr"] = s.warmup_max_lr;
  }
  params["warmup_num_steps"] = s.warmup_num_steps;
  params["warmup_type"] = to_string(s.warmup_type);
  params["last_batch_iteration"] = s.last_batch_iteration;
  OJson j;
  j["type"] = to_string(s.type);
  j["params"] = params;
  return j;
}

OJson zero_json(const ZeroConfig& z) {
  OJson j;
  j["stage"] = z.stage;
  j["contiguous_gradients"] = z.contiguous_gradients;
  j["reduce_scatter"] = z.reduce_scatter;
  j["reduce_bucket_size"] = z.reduce_bucket_size_elems;
  j["allgather_bucket_size"] = z.allgather_bucket_size_elems;
  j["overlap_comm"] = z.overlap_comm;
  j["round_robin_gradients"] = z.round_robin_gradients;
  j["allgather_partitions"] = z.allgather_partitions;
  j["sub_group_size"] = z.sub_group_size_elems;
  j["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size_elems;
  j["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold_elems;
  j["stage3_max_live_parameters"] = z.stage3_max_live_parameters_elems;
  j["stage3_max_reuse_distance"] = z.stage3_max_reuse_distance_elems;
  j["stage3_gather_16bit_weights_on_model_save"] = z.stage3_gather_16bit_weights_on_model_save;
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  j["offload_optimizer"] = {{"device", to_string(oo.device)},
                            {"pin_memory", oo.pin_memory},
                            {"buffer_count", oo.buffer_count},
                            {"fast_init", oo.fast_init},
                            {"ratio", oo.ratio}};
  const OffloadParamConfig& op = z.offload_param;
  j["offload_param"] = {{"device", to_string(op.device)},
                        {"pin_memory", op.pin_memory},
                        {"buffer_count", op.buffer_count},
                        {"buffer_size", op.buffer_size_elems},
                        {"max_in_cpu", op.max_in_cpu_elems}};
  return j;
}

OJson activation_checkpointing_json(const ActivationCheckpointingConfig& a) {
  OJson j;
  j["partition_activations"] = a.partition_activations;
  j["cpu_checkpointing"] = a.cpu_checkpointing;
  j["contiguous_memory_optimization"] = a.contiguous_memory_optimization;
  j["number_checkpoints"] = or_null(a.number_checkpoints);
  j["synchronize_checkpoint_boundary"] = a.synchronize_checkpoint_boundary;
  j["profile"] = a.profile;
  return j;
}

OJson porter_json(const PorterSection& p) {
  OJson j;
  const ModelConfig& m = p.model;
  j["model"] = {{"type", to_string(m.type)}, {"layers", m.layers},   {"hidden", m.hidden},
                {"heads", m.heads},          {"seq_len", m.seq_len}, {"vocab", m.vocab},
                {"dropout", m.dropout},      {"tie_embeddings", m.tie_embeddings},
                {"tensor_parallel", m.tensor_parallel}};
  j["data"] = {{"type", to_string(p.data.type)}, {"paths", p.data.paths}, {"seed", p.data.seed}};
  if (p.data.paths.empty()) j["data"].erase("paths");
  const DeviceConfig& d = p.device;
  j["device"] = {{"type", to_string(d.type)},
                 {"memory_limit", or_null(d.memory_limit_bytes)},
                 {"pinned_limit", or_null(d.pinned_limit_bytes)},
                 {"sim_link_gbps", or_null(d.sim_link_gbps)},
                 {"threads", d.threads},
                 {"poison_freed", d.poison_freed}};
  const CheckpointingConfig& k = p.checkpointing;
  OJson ck;
  ck["policy"] = to_string(k.policy);
  if (k.every_n_layers) ck["every_n_layers"] = *k.every_n_layers;
  if (k.block_layers) ck["block_layers"] = *k.block_layers;
  if (k.memory_budget) {
    ck["memory_budget"] = std::visit([](auto v) { return OJson(v); }, k.memory_budget->value);
  }
  if (!k.selective_ops.empty()) ck["selective_ops"] = k.selective_ops;
  ck["prefetch_depth"] = k.prefetch_depth;
  ck["keep_last_on_device"] = k.keep_last_on_device;
  j["checkpointing"] = ck;
  j["train"] = {{"steps", p.train.steps}, {"seed", p.train.seed}, {"log_every", p.train.log_every}};
  j["trace"] = {{"path", or_null(p.trace.path)}};
  j["comm"] = {{"backend", to_string(p.comm.backend)}, {"timeout_s", p.comm.timeout_s}};
  return j;
}

}  // namespace

nlohmann::ordered_json to_json(const Config& c) {
  OJson j;
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["gradient_clipping"] = c.gradient_clipping;
  j["steps_per_print"] = or_null(c.steps_per_print);
  j["wall_clock_breakdown"] = c.wall_clock_breakdown;
  j["prescale_gradients"] = c.prescale_gradients;
  j["gradient_predivide_factor"] = c.gradient_predivide_factor;
  if (c.optimizer) j["optimizer"] = optimizer_json(*c.optimizer);
  if (c.scheduler) j["scheduler"] = scheduler_json(*c.scheduler);
  j["fp16"] = {{"enabled", c.fp16.enabled},
               {"loss_scale", c.fp16.loss_scale},
               {"initial_scale_power", c.fp16.initial_scale_power},
               {"loss_scale_window", c.fp16.loss_scale_window},
               {"hysteresis", c.fp16.hysteresis},
               {"min_loss_scale", c.fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", c.bf16.enabled}};
  j["zero_optimization"] = zero_json(c.zero_optimization);
  if (c.activation_checkpointing) {
    j["activation_checkpointing"] = activation_checkpointing_json(*c.activation_checkpointing);
  }
  j["porter"] = porter_json(c.porter);
  return j;
}

std::string to_json_string(const Config& config, int indent) {
  return to_json(config).dump(indent, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace porter::config
