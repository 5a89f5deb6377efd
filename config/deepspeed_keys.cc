// The DeepSpeed keys: batch sizes, top-level scalars, optimizer, scheduler, fp16/bf16,
// zero_optimization (with its offload sections and deprecated aliases) and
// activation_checkpointing, with the defaults of DeepSpeed's current code.
#include <cctype>
#include <string>

#include "config/sections.h"

namespace porter::config::detail {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr IntRange kPositive{1, kInt64Max};
constexpr IntRange kNonNegative{0, kInt64Max};
constexpr RealRange kNonNegativeReal{0.0};
constexpr RealRange kPositiveReal{0.0, std::numeric_limits<double>::infinity(), true};

std::optional<int64_t> nullable_integer(ObjectReader& r, std::string_view key, IntRange range) {
  if (r.is_null(key)) return std::nullopt;
  return r.integer(key, range);
}

// ---- batch sizes --------------------------------------------------------------------------

struct BatchValue {
  std::optional<int64_t> value;
  bool is_auto = false;
};

BatchValue read_batch_value(ObjectReader& root, std::string_view key) {
  BatchValue b;
  const Json* v = root.get(key);
  if (v == nullptr) return b;
  if (is_auto(*v)) {
    b.is_auto = true;
  } else {
    b.value = as_integer(*v, root.path_of(key), kPositive);
  }
  return b;
}

std::string describe_dp(const Config& c) {
  if (c.porter.model.tensor_parallel == 1) return "world size " + std::to_string(c.world_size);
  return "data-parallel size " + std::to_string(c.data_parallel_size()) + " (world size " +
         std::to_string(c.world_size) + " / porter.model.tensor_parallel " +
         std::to_string(c.porter.model.tensor_parallel) + ")";
}

int64_t checked_product(int64_t a, int64_t b, const std::string& path) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    fail(path, "the batch size " + std::to_string(a) + " x " + std::to_string(b) +
                   " does not fit in 64 bits");
  }
  return out;
}

// Note [Batch triple]
// DeepSpeed's rule: train_batch_size == micro * accumulation * dp, where dp is the
// data-parallel size. Any two determine the third. One alone: accumulation is 1. "auto" (the
// HF Trainer's spelling) is treated as absent, and an "auto" micro batch or accumulation that
// nothing determines is 1. Nothing at all is an error, as in DeepSpeed.
void read_batch(ObjectReader& root, Config& c) {
  const std::string kTrain = "train_batch_size", kMicro = "train_micro_batch_size_per_gpu",
                    kAccum = "gradient_accumulation_steps";
  BatchValue train = read_batch_value(root, kTrain);
  BatchValue micro = read_batch_value(root, kMicro);
  BatchValue accum = read_batch_value(root, kAccum);
  const int64_t dp = c.data_parallel_size();

  if (!train.value && !micro.value) {
    if (!train.is_auto && !micro.is_auto) {
      fail(kTrain, "no batch size given: set train_batch_size or train_micro_batch_size_per_gpu "
                   "(any two of train_batch_size, train_micro_batch_size_per_gpu and "
                   "gradient_accumulation_steps determine the third)");
    }
    micro.value = 1;
  }
  if (!train.value && !accum.value) accum.value = 1;  // micro alone
  if (!micro.value && !accum.value) accum.value = 1;  // train alone

  if (train.value && micro.value && accum.value) {
    int64_t product = checked_product(checked_product(*micro.value, *accum.value, kTrain), dp, kTrain);
    if (product != *train.value) {
      fail(kTrain, std::to_string(*train.value) + " != train_micro_batch_size_per_gpu " +
                       std::to_string(*micro.value) + " x gradient_accumulation_steps " +
                       std::to_string(*accum.value) + " x " + describe_dp(c) + " = " +
                       std::to_string(product) + "; change one of these numbers (or give only "
                       "two of the three batch keys)");
    }
  } else if (train.value && micro.value) {
    int64_t per_step = checked_product(*micro.value, dp, kTrain);
    if (*train.value % per_step != 0) {
      fail(kTrain, std::to_string(*train.value) + " is not a multiple of "
                   "train_micro_batch_size_per_gpu " + std::to_string(*micro.value) + " x " +
                   describe_dp(c) + " = " + std::to_string(per_step) +
                   ", so gradient_accumulation_steps cannot be inferred");
    }
    accum.value = *train.value / per_step;
  } else if (train.value && accum.value) {
    int64_t per_micro = checked_product(*accum.value, dp, kTrain);
    if (*train.value % per_micro != 0) {
      fail(kTrain, std::to_string(*train.value) + " is not a multiple of "
                   "gradient_accumulation_steps " + std::to_string(*accum.value) + " x " +
                   describe_dp(c) + " = " + std::to_string(per_micro) +
                   ", so train_micro_batch_size_per_gpu cannot be inferred");
    }
    micro.value = *train.value / per_micro;
  } else {
    train.value = checked_product(checked_product(*micro.value, *accum.value, kTrain), dp, kTrain);
  }
  c.train_batch_size = *train.value;
  c.train_micro_batch_size_per_gpu = *micro.value;
  c.gradient_accumulation_steps = *accum.value;
}

// ---- optimizer and scheduler --------------------------------------------------------------

void read_optimizer(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("optimizer");
  if (!r) return;
  OptimizerConfig o;
  const Json* type = r->get("type");
  if (type == nullptr) {
    fail(r->path_of("type"), "missing; porter implements \"Adam\" and \"AdamW\"");
  }
  // DeepSpeed compares optimizer names case-insensitively.
  std::string name = as_string(*type, r->path_of("type"));
  std::string lower = name;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower == "adam") {
    o.type = OptimizerType::kAdam;
  } else if (lower == "adamw") {
    o.type = OptimizerType::kAdamW;
  } else {
    fail(r->path_of("type"), "expected one of Adam | AdamW, got " + describe(*type) +
                                 " (porter implements no other optimizer)");
  }
  r->not_implemented("legacy_fusion", false, "DeepSpeed's legacy fused-optimizer switch");
  if (std::optional<ObjectReader> p = r->object("params")) {
    o.lr = p->real("lr", kNonNegativeReal, o.lr).value_or(o.lr);
    if (const Json* betas = p->get("betas"); betas != nullptr && !is_auto(*betas)) {
      if (!betas->is_array() || betas->size() != 2) {
        fail(p->path_of("betas"), "expected two numbers [beta1, beta2] in [0, 1), got " +
                                      describe(*betas));
      }
      const RealRange beta_range{0.0, 1.0, false, true};
      o.beta1 = as_real((*betas)[0], p->path_of("betas") + "[0]", beta_range);
      o.beta2 = as_real((*betas)[1], p->path_of("betas") + "[1]", beta_range);
    }
    o.eps = p->real("eps", kPositiveReal, o.eps).value_or(o.eps);
    o.weight_decay = p->real("weight_decay", kNonNegativeReal, o.weight_decay).value_or(o.weight_decay);
    o.torch_adam = p->boolean("torch_adam").value_or(o.torch_adam);
    std::optional<bool> w_mode = p->boolean("adam_w_mode");
    if (o.type == OptimizerType::kAdamW && w_mode == false) {
      p->diag().warn(p->path_of("adam_w_mode"),
                     "false is ignored: type AdamW always decouples weight decay (use type "
                     "\"Adam\" with adam_w_mode false for L2-style weight decay)");
    } else if (w_mode) {
      o.adam_w_mode = *w_mode;
    }
    p->not_implemented("bias_correction", true, "Adam without bias correction");
    p->not_implemented("amsgrad", false, "AMSGrad");
    p->finish();
  }
  r->finish();
  c.optimizer = o;
}

void read_scheduler(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("scheduler");
  if (!r) return;
  SchedulerConfig s;
  if (!r->has("type")) {
    fail(r->path_of("type"), "missing; porter implements WarmupLR, WarmupDecayLR and WarmupCosineLR");
  }
  s.type = *r->enumeration("type", kSchedulerTypes);
  std::optional<ObjectReader> p = r->object("params");
  if (!p) {
    if (s.type != SchedulerType::kWarmupLR) {
      fail(r->path_of("params"), "missing; " + std::string(to_string(s.type)) +
                                     " needs params.total_num_steps");
    }
    r->finish();
    c.scheduler = s;
    return;
  }
  const IntRange steps_range{0, kInt64Max};
  if (s.type != SchedulerType::kWarmupLR) {
    if (!p->has("total_num_steps")) {
      fail(p->path_of("total_num_steps"),
           "missing; " + std::string(to_string(s.type)) + " needs the total number of steps");
    }
    s.total_num_steps = p->integer("total_num_steps", kPositive, c.porter.train.steps);
  }
  if (s.type == SchedulerType::kWarmupCosineLR) {
    s.warmup_min_ratio =
        p->real("warmup_min_ratio", RealRange{0.0, 1.0}, s.warmup_min_ratio).value_or(s.warmup_min_ratio);
    s.cos_min_ratio =
        p->real("cos_min_ratio", RealRange{0.0, 1.0}, s.cos_min_ratio).value_or(s.cos_min_ratio);
  } else {
    s.warmup_min_lr = p->real("warmup_min_lr", kNonNegativeReal, 0.0).value_or(s.warmup_min_lr);
    double lr_default = c.optimizer ? c.optimizer->lr : s.warmup_max_lr;
    s.warmup_max_lr = p->real("warmup_max_lr", kNonNegativeReal, lr_default).value_or(s.warmup_max_lr);
    if (s.warmup_min_lr > s.warmup_max_lr) {
      fail(p->path_of("warmup_min_lr"), describe(Json(s.warmup_min_lr)) +
                                            " is above warmup_max_lr " +
                                            describe(Json(s.warmup_max_lr)) +
                                            "; warmup goes from the min to the max");
    }
  }
  // Default and "auto" warmup: DeepSpeed's 1000 steps, but never longer than the schedule.
  int64_t warmup_default = s.warmup_num_steps;
  if (s.total_num_steps) warmup_default = std::min(warmup_default, *s.total_num_steps);
  s.warmup_num_steps =
      p->integer("warmup_num_steps", steps_range, warmup_default).value_or(warmup_default);
  if (s.total_num_steps && s.warmup_num_steps > *s.total_num_steps) {
    fail(p->path_of("warmup_num_steps"),
         std::to_string(s.warmup_num_steps) + " is more than total_num_steps " +
             std::to_string(*s.total_num_steps) + "; warmup must fit in the schedule");
  }
  s.warmup_type = p->enumeration("warmup_type", kWarmupTypes).value_or(s.warmup_type);
  s.last_batch_iteration =
      p->integer("last_batch_iteration", IntRange{-1, kInt64Max}).value_or(s.last_batch_iteration);
  p->finish();
  r->finish();
  c.scheduler = s;
}

// ---- mixed precision ----------------------------------------------------------------------

void read_precision(ObjectReader& root, Config& c) {
  if (std::optional<ObjectReader> r = root.object("fp16")) {
    Fp16Config& f = c.fp16;
    f.enabled = r->boolean("enabled", false).value_or(f.enabled);
    f.loss_scale = r->real("loss_scale", kNonNegativeReal).value_or(f.loss_scale);
    // 2^power must be a finite float32.
    f.initial_scale_power = r->integer("initial_scale_power", IntRange{0, 127}).value_or(f.initial_scale_power);
    f.loss_scale_window = r->integer("loss_scale_window", kPositive).value_or(f.loss_scale_window);
    f.hysteresis = r->integer("hysteresis", kPositive).value_or(f.hysteresis);
    f.min_loss_scale = r->real("min_loss_scale", kPositiveReal).value_or(f.min_loss_scale);
    r->not_implemented("auto_cast", false, "autocasting fp32 inputs");
    r->not_implemented("consecutive_hysteresis", false, "consecutive hysteresis");
    r->not_implemented("fp16_master_weights_and_grads", false, "fp16 master weights");
    r->finish();
  }
  // "bfloat16" is DeepSpeed's old name for the section.
  const bool has_old = root.has("bfloat16");
  if (has_old && root.has("bf16")) {
    fail("bfloat16", "deprecated alias of \"bf16\", given together with \"bf16\"; keep only \"bf16\"");
  }
  if (has_old) root.diag().warn("bfloat16", "deprecated; use \"bf16\" instead");
  if (std::optional<ObjectReader> r = root.object(has_old ? "bfloat16" : "bf16")) {
    c.bf16.enabled = r->boolean("enabled", false).value_or(c.bf16.enabled);
    r->finish();
  }
  if (c.fp16.enabled && c.bf16.enabled) {
    fail(has_old ? "bfloat16.enabled" : "bf16.enabled",
         "true, but fp16.enabled is true too; enable one of fp16 and bf16");
  }
}

// ---- zero_optimization --------------------------------------------------------------------

// Offload device: "nvme" is accepted but not implemented; it resolves to "cpu".
OffloadDevice read_offload_device(ObjectReader& r) {
  const Json* v = r.get("device");
  if (v == nullptr) return OffloadDevice::kNone;
  if (v->is_string() && v->get_ref<const std::string&>() == "nvme") {
    r.diag().warn(r.path_of("device"),
                  "\"nvme\": NVMe offload is not implemented in porter yet; porter offloads to "
                  "cpu memory instead");
    return OffloadDevice::kCpu;
  }
  static constexpr std::string_view kNames[] = {"none", "cpu", "nvme"};
  return as_enum_index(*v, r.path_of("device"), kNames) == 0 ? OffloadDevice::kNone
                                                              : OffloadDevice::kCpu;
}

void read_offload_optimizer(ObjectReader& r, ZeroConfig& z) {
  OffloadOptimizerConfig& o = z.offload_optimizer;
  o.device = read_offload_device(r);
  o.pin_memory = r.boolean("pin_memory", o.pin_memory).value_or(o.pin_memory);
  o.buffer_count = r.integer("buffer_count", kPositive, o.buffer_count).value_or(o.buffer_count);
  o.fast_init = r.boolean("fast_init", o.fast_init).value_or(o.fast_init);
  o.ratio = r.real("ratio", RealRange{0.0, 1.0}, o.ratio).value_or(o.ratio);
  r.string("nvme_path");  // used by NVMe offload only
  r.not_implemented("pipeline_read", false, "NVMe read pipelining");
  r.not_implemented("pipeline_write", false, "NVMe write pipelining");
  r.not_implemented("pipeline", false, "NVMe pipelining");
  r.finish();
}

void read_offload_param(ObjectReader& r, ZeroConfig& z) {
  OffloadParamConfig& o = z.offload_param;
  o.device = read_offload_device(r);
  o.pin_memory = r.boolean("pin_memory", o.pin_memory).value_or(o.pin_memory);
  o.buffer_count = r.integer("buffer_count", kPositive, o.buffer_count).value_or(o.buffer_count);
  o.buffer_size_elems = r.integer("buffer_size", kPositive, o.buffer_size_elems).value_or(o.buffer_size_elems);
  o.max_in_cpu_elems = r.integer("max_in_cpu", kNonNegative, o.max_in_cpu_elems).value_or(o.max_in_cpu_elems);
  r.string("nvme_path");
  r.finish();
}

// A deprecated key: warns naming the replacement; an error when both are given.
bool deprecated_key(ObjectReader& r, std::string_view old_key, std::string_view new_key,
                    std::string_view replacement) {
  if (!r.has(old_key)) return false;
  if (r.has(new_key)) {
    fail(r.path_of(old_key), "deprecated alias of " + r.path_of(new_key) +
                                 ", given together with it; keep only " + std::string(new_key));
  }
  r.diag().warn(r.path_of(old_key), "deprecated; use " + std::string(replacement) + " instead");
  return true;
}

void read_zero(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("zero_optimization");
  ZeroConfig& z = c.zero_optimization;
  const int64_t hidden = c.porter.model.hidden;
  if (!r) {
    z.overlap_comm = false;
    return;
  }
  z.stage = static_cast<int>(r->integer("stage", IntRange{0, 3}).value_or(z.stage));
  // Note [Auto in ZeRO]: DeepSpeed drops "auto" values in its pydantic sections, so they take
  // the default; the three the HF Trainer sizes from the model take its rules (hidden^2,
  // 0.9 hidden^2 and 10 hidden).
  z.contiguous_gradients = r->boolean("contiguous_gradients", true).value_or(z.contiguous_gradients);
  z.reduce_scatter = r->boolean("reduce_scatter", true).value_or(z.reduce_scatter);
  z.reduce_bucket_size_elems =
      r->integer("reduce_bucket_size", kPositive, hidden * hidden).value_or(z.reduce_bucket_size_elems);
  z.allgather_bucket_size_elems =
      r->integer("allgather_bucket_size", kPositive, z.allgather_bucket_size_elems)
          .value_or(z.allgather_bucket_size_elems);
  if (z.allgather_bucket_size_elems % 2 != 0) {
    fail(r->path_of("allgather_bucket_size"),
         std::to_string(z.allgather_bucket_size_elems) +
             " is odd; it must be a multiple of 2 (all-gather partitions are aligned to 2 "
             "elements), e.g. " + std::to_string(z.allgather_bucket_size_elems + 1));
  }
  const bool overlap_default = z.stage == 3;
  z.overlap_comm = r->boolean("overlap_comm", overlap_default).value_or(overlap_default);
  z.round_robin_gradients = r->boolean("round_robin_gradients", false).value_or(z.round_robin_gradients);
  z.allgather_partitions = r->boolean("allgather_partitions", true).value_or(z.allgather_partitions);
  z.sub_group_size_elems =
      r->integer("sub_group_size", kPositive, z.sub_group_size_elems).value_or(z.sub_group_size_elems);
  z.stage3_prefetch_bucket_size_elems =
      r->integer("stage3_prefetch_bucket_size", kNonNegative, hidden * hidden * 9 / 10)
          .value_or(z.stage3_prefetch_bucket_size_elems);
  z.stage3_param_persistence_threshold_elems =
      r->integer("stage3_param_persistence_threshold", kNonNegative, 10 * hidden)
          .value_or(z.stage3_param_persistence_threshold_elems);
  z.stage3_max_live_parameters_elems =
      r->integer("stage3_max_live_parameters", kNonNegative, z.stage3_max_live_parameters_elems)
          .value_or(z.stage3_max_live_parameters_elems);
  z.stage3_max_reuse_distance_elems =
      r->integer("stage3_max_reuse_distance", kNonNegative, z.stage3_max_reuse_distance_elems)
          .value_or(z.stage3_max_reuse_distance_elems);

  const std::string kGather16 = "stage3_gather_16bit_weights_on_model_save";
  const std::string kGatherFp16 = "stage3_gather_fp16_weights_on_model_save";
  const std::string gather_key =
      deprecated_key(*r, kGatherFp16, kGather16, "\"" + kGather16 + "\"") ? kGatherFp16 : kGather16;
  z.stage3_gather_16bit_weights_on_model_save =
      r->boolean(gather_key, false).value_or(z.stage3_gather_16bit_weights_on_model_save);

  // Offload sections and their deprecated boolean forms.
  if (deprecated_key(*r, "cpu_offload", "offload_optimizer",
                     "\"offload_optimizer\": {\"device\": \"cpu\"}")) {
    if (*r->boolean("cpu_offload")) z.offload_optimizer.device = OffloadDevice::kCpu;
  }
  if (std::optional<ObjectReader> o = r->object("offload_optimizer")) read_offload_optimizer(*o, z);
  if (deprecated_key(*r, "cpu_offload_param", "offload_param",
                     "\"offload_param\": {\"device\": \"cpu\"}")) {
    if (*r->boolean("cpu_offload_param")) z.offload_param.device = OffloadDevice::kCpu;
  }
  if (std::optional<ObjectReader> o = r->object("offload_param")) read_offload_param(*o, z);
  if (r->has("cpu_offload_use_pin_memory")) {
    bool pin = *r->boolean("cpu_offload_use_pin_memory");
    for (const char* section : {"offload_optimizer", "offload_param"}) {
      const Json* s = r->get(section);
      if (s != nullptr && s->is_object() && s->contains("pin_memory")) {
        fail(r->path_of("cpu_offload_use_pin_memory"),
             "deprecated alias of " + r->path_of(section) + ".pin_memory, given together with "
             "it; keep only pin_memory");
      }
    }
    r->diag().warn(r->path_of("cpu_offload_use_pin_memory"),
                   "deprecated; use \"pin_memory\" in offload_optimizer / offload_param instead");
    z.offload_optimizer.pin_memory = pin;
    z.offload_param.pin_memory = pin;
  }

  // Combinations that cannot work. The path named is the key that asked for the offload.
  auto offload_source = [&](const char* section, const char* alias) {
    const Json* s = r->get(section);
    if (s != nullptr && s->is_object() && s->contains("device")) {
      return std::pair{r->path_of(section) + ".device", describe(s->at("device"))};
    }
    return std::pair{r->path_of(alias), std::string("true")};
  };
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    auto [path, value] = offload_source("offload_optimizer", "cpu_offload");
    fail(path, value + ": optimizer offload needs ZeRO stage 1, 2 or 3, but "
                       "zero_optimization.stage is 0; raise the stage or drop the offload");
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    auto [path, value] = offload_source("offload_param", "cpu_offload_param");
    fail(path, value + ": parameter offload needs ZeRO stage 3 (only stage 3 partitions "
                       "parameters), but zero_optimization.stage is " + std::to_string(z.stage));
  }
  if (z.offload_optimizer.ratio < 1.0) {
    if (z.stage < 3) {
      fail(r->path_of("offload_optimizer.ratio"),
           describe(Json(z.offload_optimizer.ratio)) + " < 1 (partial offload) needs ZeRO stage 3, "
           "but zero_optimization.stage is " + std::to_string(z.stage) + "; use ratio 1 or stage 3");
    }
    r->diag().warn(r->path_of("offload_optimizer.ratio"),
                   describe(Json(z.offload_optimizer.ratio)) +
                       ": partial optimizer offload is not implemented in porter yet; porter "
                       "offloads all of the optimizer state (ratio 1)");
    z.offload_optimizer.ratio = 1.0;
  }

  // DeepSpeed keys porter reads but does not implement; harmless at these values.
  r->not_implemented("load_from_fp32_weights", true, "loading from 16-bit weights");
  r->not_implemented("elastic_checkpoint", false, "elastic checkpoints");
  r->not_implemented("ignore_unused_parameters", true, "failing on unused parameters");
  r->not_implemented("legacy_stage1", false, "DeepSpeed's legacy stage 1");
  r->not_implemented("stage3_model_persistence_threshold", kInt64Max, "model persistence threshold");
  r->not_implemented("zero_hpz_partition_size", 1, "ZeRO++ hierarchical partitioning");
  r->not_implemented("zero_quantized_weights", false, "ZeRO++ quantized weights");
  r->not_implemented("zero_quantized_nontrainable_weights", false, "ZeRO++ quantized weights");
  r->not_implemented("zero_quantized_gradients", false, "ZeRO++ quantized gradients");
  r->not_implemented("mics_shard_size", -1, "MiCS");
  r->not_implemented("mics_hierarchical_params_gather", false, "MiCS");
  r->not_implemented("memory_efficient_linear", true, "DeepSpeed's linear-layer override");
  r->not_implemented("pipeline_loading_checkpoint", false, "pipelined checkpoint loading");
  r->not_implemented("override_module_apply", true, "module.apply override");
  r->not_implemented("use_multi_rank_bucket_allreduce", true, "multi-rank bucket all-reduce");
  r->not_implemented("stage3_use_all_reduce_for_fetch_params", false, "all-reduce parameter fetch");
  r->not_implemented("log_trace_cache_warnings", false, "trace-cache warnings");
  r->finish();
}

// ---- activation_checkpointing -------------------------------------------------------------

void read_activation_checkpointing(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("activation_checkpointing");
  if (!r) return;
  ActivationCheckpointingConfig a;
  a.partition_activations = r->boolean("partition_activations").value_or(false);
  a.cpu_checkpointing = r->boolean("cpu_checkpointing").value_or(false);
  a.contiguous_memory_optimization = r->boolean("contiguous_memory_optimization").value_or(false);
  a.synchronize_checkpoint_boundary = r->boolean("synchronize_checkpoint_boundary").value_or(false);
  a.profile = r->boolean("profile").value_or(false);
  a.number_checkpoints = nullable_integer(*r, "number_checkpoints", kPositive);
  r->finish();
  c.activation_checkpointing = a;
}

// ---- top level ----------------------------------------------------------------------------

void read_top_level_scalars(ObjectReader& root, Config& c) {
  c.gradient_clipping = root.real("gradient_clipping", kNonNegativeReal, 1.0).value_or(c.gradient_clipping);
  c.steps_per_print = nullable_integer(root, "steps_per_print", kPositive);
  c.wall_clock_breakdown = root.boolean("wall_clock_breakdown").value_or(false);
  c.prescale_gradients = root.boolean("prescale_gradients").value_or(false);
  c.gradient_predivide_factor =
      root.real("gradient_predivide_factor", kPositiveReal).value_or(c.gradient_predivide_factor);
}

void read_not_implemented_top_level(ObjectReader& root) {
  root.not_implemented("zero_allow_untested_optimizer", false, "optimizers other than Adam/AdamW");
  root.not_implemented("zero_force_ds_cpu_optimizer", true, "client optimizers with offload");
  root.not_implemented("memory_breakdown", false, "DeepSpeed's memory breakdown log");
  root.not_implemented("dump_state", false, "DeepSpeed's state dump");
  root.not_implemented("sparse_gradients", false, "sparse gradients");
  root.not_implemented("dataloader_drop_last", false, "DeepSpeed's data loader");
  root.not_implemented("communication_data_type", nullptr, "a separate communication dtype");
  root.not_implemented("disable_allgather", false, "disabling all-gather");
  struct Section {
    const char* key;
    const char* note;
  };
  static constexpr Section kSections[] = {
      {"aio", "asynchronous I/O for NVMe offload"},
      {"tensorboard", "TensorBoard logging"},
      {"wandb", "Weights & Biases logging"},
      {"csv_monitor", "CSV logging"},
      {"comet", "Comet logging"},
      {"flops_profiler", "the FLOPs profiler"},
      {"comms_logger", "the communication logger"},
      {"autotuning", "autotuning"},
      {"elasticity", "elastic training"},
      {"amp", "NVIDIA Apex AMP"},
      {"torch_autocast", "torch autocast"},
      {"curriculum_learning", "curriculum learning"},
      {"data_efficiency", "data efficiency"},
      {"compression_training", "compression training"},
      {"pipeline", "pipeline parallelism"},
      {"sparse_attention", "sparse attention"},
      {"checkpoint", "DeepSpeed's checkpoint options"},
      {"data_types", "separate gradient-accumulation dtypes"},
      {"eigenvalue", "eigenvalue computation"},
      {"progressive_layer_drop", "progressive layer drop"},
      {"quantize_training", "quantized training"},
      {"weight_quantization", "weight quantization"},
      {"nebula", "Nebula checkpointing"},
      {"hybrid_engine", "the hybrid engine"},
  };
  for (const Section& s : kSections) root.not_implemented_section(s.key, s.note);
}

}  // namespace

void read_deepspeed_keys(ObjectReader& root, Config& c) {
  read_batch(root, c);
  read_top_level_scalars(root, c);
  read_optimizer(root, c);
  read_scheduler(root, c);
  read_precision(root, c);
  read_zero(root, c);
  read_activation_checkpointing(root, c);
  read_not_implemented_top_level(root);
}

}  // namespace porter::config::detail
