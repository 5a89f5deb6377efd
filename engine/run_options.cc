// The translation of a config into the run's options (Note [Run options] in run_options.h).
#include "engine/run_options.h"

#include <algorithm>
#include <string>

#include "base/check.h"
#include "base/error.h"
#include "engine/model.h"
#include "engine/stage3.h"

namespace porter::engine {

std::string_view cost_source_name(CostSource s) {
  return s == CostSource::kAnalytic ? "analytic" : "profiled";
}

namespace {

memory::DeviceOptions device_options(const config::DeviceConfig& d) {
  memory::DeviceOptions o;
  switch (d.type) {
    case config::DeviceType::kCpu: o.kind = memory::DeviceKind::kCpu; break;
    case config::DeviceType::kCuda: o.kind = memory::DeviceKind::kCuda; break;
    case config::DeviceType::kAuto:
      o.kind = memory::cuda_available() ? memory::DeviceKind::kCuda : memory::DeviceKind::kCpu;
      break;
  }
  o.memory_limit_bytes = static_cast<size_t>(d.memory_limit_bytes.value_or(0));
  o.pinned_limit_bytes = static_cast<size_t>(d.pinned_limit_bytes.value_or(0));
  o.sim_link_gbps = d.sim_link_gbps.value_or(0.0);
  o.threads = static_cast<int>(d.threads);
  return o;
}

std::string selective_ops_name(const std::vector<std::string>& ops) {
  if (ops.empty()) return "attention";
  std::string s;
  for (const std::string& o : ops) s += (s.empty() ? "" : ",") + o;
  return s;
}

}  // namespace

checkpoint::OffloadOptions offload_options(const config::Config& config) {
  checkpoint::OffloadOptions o;
  if (config.activation_checkpointing) {
    o.enabled = config.activation_checkpointing->cpu_checkpointing;
    o.contiguous = config.activation_checkpointing->contiguous_memory_optimization;
  }
  o.prefetch_depth = static_cast<int>(config.porter.checkpointing.prefetch_depth);
  o.keep_last_on_device = static_cast<int>(config.porter.checkpointing.keep_last_on_device);
  o.link_bytes_per_s =
      config.porter.device.sim_link_gbps ? *config.porter.device.sim_link_gbps * 1e9 : 0.0;
  return o;
}

checkpoint::PartitionOptions partition_options(const config::Config& config) {
  checkpoint::PartitionOptions o;
  const bool on =
      config.activation_checkpointing && config.activation_checkpointing->partition_activations;
  if (on && !config.porter.model.sequence_parallel) {
    o.ways = static_cast<int>(config.porter.model.tensor_parallel);
  }
  o.min_bytes = static_cast<size_t>(
      std::max<int64_t>(0, config.porter.checkpointing.partition_min_bytes));
  o.tp_bytes_per_s = config.porter.comm.sim_tp_gbps ? *config.porter.comm.sim_tp_gbps * 1e9 : 0.0;
  return o;
}

RunOptions make_run_options(const config::Config& config) {
  RunOptions r;
  const config::PorterSection& p = config.porter;
  r.device = device_options(p.device);
  if (p.device.memory_limit_bytes) {
    r.capacity_bytes = static_cast<size_t>(*p.device.memory_limit_bytes);
  } else if (r.device.kind == memory::DeviceKind::kCpu) {
    r.capacity_bytes = memory::kDefaultCpuMemoryLimitBytes;
  }
  r.allocator.poison_freed = p.device.poison_freed;
  r.pinned_limit_bytes = static_cast<size_t>(p.device.pinned_limit_bytes.value_or(0));
  r.kernel_choice = p.device.kernel_choice == config::KernelChoice::kFastest
                        ? kernels::KernelChoice::kFastest
                        : kernels::KernelChoice::kExact;
  r.kernel_table_path = p.device.kernel_table;
  r.device_model = device_model_options(p.device);
  r.compute_dtype = config.fp16.enabled   ? tensor::DType::kF16
                    : config.bf16.enabled ? tensor::DType::kBF16
                                          : tensor::DType::kF32;
  {
    // Note [Gradient dtype]: the parser allows fp32 or the compute dtype.
    const std::optional<config::GradDType> g =
        config.data_types.grad_accum_dtype ? config.data_types.grad_accum_dtype
                                           : config.communication_data_type;
    r.grad_dtype = !g || *g == config::GradDType::kFp32 ? tensor::DType::kF32
                   : *g == config::GradDType::kBf16     ? tensor::DType::kBF16
                                                        : tensor::DType::kF16;
  }
  r.shape.model = p.model;
  r.shape.micro_batch = config.train_micro_batch_size_per_gpu;
  r.shape.seq = p.model.seq_len;
  r.shape.compute_dtype = r.compute_dtype;
  r.shape.device = r.device.kind;
  r.gradient_accumulation_steps = config.gradient_accumulation_steps;
  r.selective_policy = checkpoint::selective_policy(p.checkpointing.selective_ops);
  r.selective_name = selective_ops_name(p.checkpointing.selective_ops);

  r.plan.checkpointing = p.checkpointing;
  r.plan.partition = partition_options(config);
  r.plan.offload = offload_options(config);
  if (config.activation_checkpointing) {
    const config::ActivationCheckpointingConfig& ac = *config.activation_checkpointing;
    r.stash.contiguous = ac.contiguous_memory_optimization;
    r.stash.synchronize_boundary = ac.synchronize_checkpoint_boundary;
    r.keep_all_copy_records = ac.profile;
  }

  const config::ZeroConfig& z = config.zero_optimization;
  r.reducer.zero_stage = z.stage;
  r.reducer.grad_dtype = r.grad_dtype;
  r.reducer.overlap_comm = z.overlap_comm;
  r.reducer.reduce_scatter = z.reduce_scatter;
  r.reducer.prescale_gradients = config.prescale_gradients;
  r.reducer.predivide_factor = config.gradient_predivide_factor;
  r.reduce_bucket_elems = z.reduce_bucket_size_elems;
  // Note [Stage 3 sizing]: the config's knobs where it gives them; the rest sized below.
  r.stage3.prefetch_given = z.stage3_prefetch_bucket_size_elems.has_value();
  r.stage3.max_live_given = z.stage3_max_live_parameters_elems.has_value();
  r.stage3.max_reuse_distance_given = z.stage3_max_reuse_distance_elems.has_value();
  r.stage3.prefetch_elems = z.stage3_prefetch_bucket_size_elems.value_or(r.stage3.prefetch_elems);
  r.stage3.max_live_elems = z.stage3_max_live_parameters_elems.value_or(r.stage3.max_live_elems);
  r.stage3.max_reuse_distance_elems =
      z.stage3_max_reuse_distance_elems.value_or(r.stage3.max_reuse_distance_elems);
  r.stage3.persistence_threshold_elems = z.stage3_param_persistence_threshold_elems;
  r.stage3.gather_16bit_weights_on_model_save = z.stage3_gather_16bit_weights_on_model_save;
  r.stage3.dp_size = static_cast<int>(std::max<int64_t>(1, config.data_parallel_size()));
  r.stage3.shard_on_host = z.offload_param.device != config::OffloadDevice::kNone;
  r.optimizer.zero_stage = z.stage;
  r.optimizer.allgather_bucket_elems = z.allgather_bucket_size_elems;
  r.optimizer.adamw = config.optimizer.value_or(config::OptimizerConfig{});
  r.optimizer.gradient_clipping = config.gradient_clipping;
  r.optimizer.fp16 = config.fp16;
  // Note [Parameter groups] in zero/param_groups.h: resolved against the layout by the
  // optimizer, once, when the engine builds it.
  r.optimizer.param_groups = p.optimizer;
  // Note [Optimizer offload] ("nvme" reads as "cpu"); the host update uses porter.device.threads
  // threads (0: every core).
  r.optimizer.offload.enabled = z.offload_optimizer.device != config::OffloadDevice::kNone;
  r.optimizer.offload.pin_memory = z.offload_optimizer.pin_memory;
  r.optimizer.offload.ratio = z.offload_optimizer.ratio;  // Note [Partial offload]
  r.optimizer.offload.threads = static_cast<int>(p.device.threads);
  // Note [Parameter offload] (stage 3; "nvme" reads as "cpu").
  r.optimizer.param_offload.enabled = z.offload_param.device != config::OffloadDevice::kNone;
  r.optimizer.param_offload.pin_memory = z.offload_param.pin_memory;

  if (z.stage == 3) {
    // The built-in model's sizes (Note [Stage 3 sizing]); an Engine sizes its own model's.
    TransformerModel gpt(r.shape.model);  // layers and layout only; allocates nothing
    const checkpoint::ParamGather g = stage3_layout(gpt, r.stage3, r.compute_dtype).costs;
    r.stage3.prefetch_elems = g.prefetch_elems;
    r.stage3.max_live_elems = g.max_live_elems;
    r.stage3.max_reuse_distance_elems = g.max_reuse_distance;
  }

  r.batch_bytes = 2 * static_cast<size_t>(config.train_micro_batch_size_per_gpu) *
                  static_cast<size_t>(p.model.seq_len) * sizeof(int32_t);
  r.seed = p.train.seed;
  r.scheduler = config.scheduler;
  r.wall_clock_breakdown = config.wall_clock_breakdown;
  return r;
}

void check_supported(const config::Config& c, int dp_size, int tp_size) {
  const int64_t tp = c.porter.model.tensor_parallel;
  if (tp_size != tp) {
    throw InvalidArgument(
        "porter.model.tensor_parallel " + std::to_string(tp) + " but the tensor-parallel "
        "communicator has " + std::to_string(tp_size) + " rank(s): pass the tp group of " +
        std::to_string(tp) + " ranks (comm::make_process_groups) to the Engine");
  }
  if (c.world_size != static_cast<int64_t>(dp_size) * tp) {
    throw InvalidArgument(
        "world_size " + std::to_string(c.world_size) + " does not match the data-parallel "
        "communicator's " + std::to_string(dp_size) + " ranks times porter.model."
        "tensor_parallel " + std::to_string(tp) +
        ": parse the config with the launch's world size and pass the dp group of that world");
  }
  // The parser refuses these (Note [Run options]).
  const config::ZeroConfig& z = c.zero_optimization;
  PORTER_ASSERT(z.offload_param.device == config::OffloadDevice::kNone || z.stage == 3,
                "parameter offload below ZeRO stage 3 passed the parser");
  PORTER_ASSERT(z.offload_optimizer.device == config::OffloadDevice::kNone || z.stage != 0,
                "optimizer offload at ZeRO stage 0 passed the parser");
  PORTER_ASSERT(z.offload_optimizer.ratio >= 1.0 || z.stage == 3,
                "a partial optimizer offload below ZeRO stage 3 passed the parser");
  const config::OptimizerConfig opt = c.optimizer.value_or(config::OptimizerConfig{});
  for (size_t g = 0; g < c.porter.optimizer.param_groups.size(); ++g) {
    const std::optional<double> wd = c.porter.optimizer.param_groups[g].weight_decay;
    if (!opt.adam_w_mode && wd && *wd > 0.0) {
      throw InvalidArgument("porter.optimizer.param_groups[" + std::to_string(g) +
                            "].weight_decay: " + std::to_string(*wd) + " with optimizer.params."
                            "adam_w_mode false asks for Adam with L2 decay added to the "
                            "gradient; porter's optimizer implements decoupled decay only: set "
                            "adam_w_mode to true (AdamW) or the group's weight_decay to 0");
    }
  }
  if (!opt.adam_w_mode && opt.weight_decay > 0.0) {
    throw InvalidArgument("optimizer.params.adam_w_mode: false with weight_decay " +
                          std::to_string(opt.weight_decay) +
                          " asks for Adam with L2 decay added to the gradient; porter's "
                          "optimizer implements decoupled decay only: set adam_w_mode to true "
                          "(AdamW) or weight_decay to 0");
  }
}

CostSource RunOptions::cost_source(bool analytic_available, CostUse use) const {
  const config::CheckpointPolicy policy = plan.checkpointing.policy;
  const bool plan_needs_times = policy == config::CheckpointPolicy::kOptimal || offload_enabled();
  const bool report_needs_times =
      use == CostUse::kTraining && policy != config::CheckpointPolicy::kNone;
  return analytic_available && !plan_needs_times && !report_needs_times ? CostSource::kAnalytic
                                                                          : CostSource::kProfiled;
}

checkpoint::ChainCosts RunOptions::analytic_costs() const {
  return models::analytic_transformer_costs(shape, selective_policy);
}

size_t RunOptions::predicted_peak_bytes(size_t model_state_bytes,
                                        const checkpoint::Prediction& prediction) const {
  return model_state_bytes + batch_bytes + prediction.peak_total_bytes;
}

double recompute_flop_fraction(const checkpoint::Prediction& prediction,
                               const checkpoint::ChainCosts& analytic) {
  double forward = 0.0;
  for (const checkpoint::StageCost& s : analytic.stages) forward += s.forward_flops;
  return forward > 0.0 ? prediction.recompute_flops / (3.0 * forward) : 0.0;
}

nlohmann::ordered_json RunOptions::to_json() const {
  using J = nlohmann::ordered_json;
  auto opt = [](const auto& v) { return v ? J(*v) : J(); };
  J j;
  j["device"] = {{"kind", memory::DeviceKind::kCpu == device.kind ? "cpu" : "cuda"},
                 {"index", device.index},
                 {"memory_limit_bytes", device.memory_limit_bytes},
                 {"pinned_limit_bytes", device.pinned_limit_bytes},
                 {"sim_link_gbps", device.sim_link_gbps},
                 {"threads", device.threads}};
  j["capacity_bytes"] = opt(capacity_bytes);
  j["allocator"] = {{"record_timeline", allocator.record_timeline},
                    {"poison_freed", allocator.poison_freed},
                    {"timeline_capacity", allocator.timeline_capacity}};
  j["pinned_limit_bytes"] = pinned_limit_bytes;
  j["kernel_choice"] = std::string(kernels::kernel_choice_name(kernel_choice));
  j["kernel_table"] = kernel_table_path ? J(*kernel_table_path) : J();
  {
    const DeviceModelOverrides& o = device_model.overrides;
    j["device_model"] = {
        {"model", device_model.model ? J(config::to_string(*device_model.model)) : J()},
        {"overrides",
         {{"peak_tflops", opt(o.peak_tflops)}, {"hbm_gbps", opt(o.hbm_gbps)},
          {"host_link_gbps", opt(o.host_link_gbps)},
          {"interconnect_gbps", opt(o.interconnect_gbps)}}}};
  }
  j["compute_dtype"] = tensor::dtype_name(compute_dtype);
  const config::ModelConfig& m = shape.model;
  j["shape"] = {{"model",
                 {{"type", static_cast<int>(m.type)}, {"layers", m.layers},
                  {"hidden", m.hidden}, {"heads", m.heads}, {"seq_len", m.seq_len},
                  {"vocab", m.vocab}, {"dropout", m.dropout},
                  {"tie_embeddings", m.tie_embeddings}, {"kv_heads", m.kv_heads},
                  {"intermediate", m.intermediate}, {"norm_eps", m.norm_eps},
                  {"rope_theta", m.rope_theta}, {"max_positions", m.max_positions},
                  {"from", opt(m.from)}, {"tensor_parallel", m.tensor_parallel},
                  {"sequence_parallel", m.sequence_parallel},
                  {"attention", config::to_string(m.attention)},
                  {"loss_tiles", m.loss_tiles},
                  {"mlp_tiles", m.mlp_tiles}}},
                {"micro_batch", shape.micro_batch},
                {"seq", shape.seq},
                {"compute_dtype", tensor::dtype_name(shape.compute_dtype)},
                {"device", shape.device == memory::DeviceKind::kCpu ? "cpu" : "cuda"}};
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["selective_policy"] = selective_policy.to_string();
  j["selective_name"] = selective_name;
  const config::CheckpointingConfig& k = plan.checkpointing;
  J budget;
  if (k.memory_budget) budget = std::visit([](auto v) { return J(v); }, k.memory_budget->value);
  j["plan"] = {{"checkpointing",
                {{"policy", config::to_string(k.policy)},
                 {"every_n_layers", opt(k.every_n_layers)},
                 {"segments", opt(k.segments)},
                 {"block_layers", opt(k.block_layers)},
                 {"memory_budget", budget},
                 {"selective_ops", k.selective_ops},
                 {"prefetch_depth", k.prefetch_depth},
                 {"keep_last_on_device", k.keep_last_on_device}}},
               {"budget", plan.budget ? std::visit([](auto v) { return J(v); }, plan.budget->value)
                                      : J()},
               {"offload",
                {{"enabled", plan.offload.enabled},
                 {"prefetch_depth", plan.offload.prefetch_depth},
                 {"keep_last_on_device", plan.offload.keep_last_on_device},
                 {"contiguous", plan.offload.contiguous},
                 {"link_bytes_per_s", plan.offload.link_bytes_per_s}}},
               {"partition",
                {{"ways", plan.partition.ways},
                 {"min_bytes", plan.partition.min_bytes},
                 {"tp_bytes_per_s", plan.partition.tp_bytes_per_s}}}};
  j["stash"] = {{"contiguous", stash.contiguous},
                {"synchronize_boundary", stash.synchronize_boundary}};
  j["keep_all_copy_records"] = keep_all_copy_records;
  j["reducer"] = {{"zero_stage", reducer.zero_stage},
                  {"grad_dtype", tensor::dtype_name(reducer.grad_dtype)},
                  {"overlap_comm", reducer.overlap_comm},
                  {"reduce_scatter", reducer.reduce_scatter},
                  {"prescale_gradients", reducer.prescale_gradients},
                  {"predivide_factor", reducer.predivide_factor}};
  j["reduce_bucket_elems"] = reduce_bucket_elems;
  j["stage3"] = {{"prefetch_elems", stage3.prefetch_elems},
                 {"max_live_elems", stage3.max_live_elems},
                 {"max_reuse_distance_elems", stage3.max_reuse_distance_elems},
                 {"persistence_threshold_elems", stage3.persistence_threshold_elems},
                 {"gather_16bit_weights_on_model_save", stage3.gather_16bit_weights_on_model_save},
                 {"prefetch_given", stage3.prefetch_given},
                 {"max_live_given", stage3.max_live_given},
                 {"max_reuse_distance_given", stage3.max_reuse_distance_given},
                 {"dp_size", stage3.dp_size},
                 {"shard_on_host", stage3.shard_on_host}};
  const config::OptimizerConfig& a = optimizer.adamw;
  const config::Fp16Config& f = optimizer.fp16;
  j["optimizer"] = {{"zero_stage", optimizer.zero_stage},
                    {"allgather_bucket_elems", optimizer.allgather_bucket_elems},
                    {"adamw",
                     {{"type", static_cast<int>(a.type)}, {"lr", a.lr}, {"beta1", a.beta1},
                      {"beta2", a.beta2}, {"eps", a.eps}, {"weight_decay", a.weight_decay},
                      {"torch_adam", a.torch_adam}, {"adam_w_mode", a.adam_w_mode}}},
                    {"gradient_clipping", optimizer.gradient_clipping},
                    {"fp16",
                     {{"enabled", f.enabled}, {"loss_scale", f.loss_scale},
                      {"initial_scale_power", f.initial_scale_power},
                      {"loss_scale_window", f.loss_scale_window},
                      {"hysteresis", f.hysteresis}, {"min_loss_scale", f.min_loss_scale}}},
                    {"offload",
                     {{"enabled", optimizer.offload.enabled},
                      {"pin_memory", optimizer.offload.pin_memory},
                      {"ratio", optimizer.offload.ratio},
                      {"threads", optimizer.offload.threads}}},
                    {"param_offload",
                     {{"enabled", optimizer.param_offload.enabled},
                      {"pin_memory", optimizer.param_offload.pin_memory}}}};
  {
    J groups = J::array();
    for (const config::ParamGroupConfig& g : optimizer.param_groups.param_groups) {
      groups.push_back({{"params", g.params},
                        {"weight_decay", opt(g.weight_decay)},
                        {"lr_scale", g.lr_scale}});
    }
    j["optimizer"]["param_groups"] = groups;
    j["optimizer"]["no_decay"] = optimizer.param_groups.no_decay;
  }
  j["batch_bytes"] = batch_bytes;
  j["seed"] = seed;
  {
    const config::SchedulerConfig c = scheduler.value_or(config::SchedulerConfig{});
    j["scheduler"] = {{"present", scheduler.has_value()},
             {"type", static_cast<int>(c.type)},
             {"warmup_min_lr", c.warmup_min_lr},
             {"warmup_max_lr", c.warmup_max_lr},
             {"warmup_num_steps", c.warmup_num_steps},
             {"warmup_type", static_cast<int>(c.warmup_type)},
             {"last_batch_iteration", c.last_batch_iteration},
             {"total_num_steps", opt(c.total_num_steps)},
             {"warmup_min_ratio", c.warmup_min_ratio},
             {"cos_min_ratio", c.cos_min_ratio}};
  }
  j["wall_clock_breakdown"] = wall_clock_breakdown;
  return j;
}

}  // namespace porter::engine
