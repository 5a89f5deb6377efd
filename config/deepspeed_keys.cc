// The DeepSpeed keys: the key tables of the top level, optimizer params, fp16/bf16,
// zero_optimization (with its offload sections) and activation_checkpointing, with the defaults
// of DeepSpeed's current code; and the readers of what needs more than a table.
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
    int64_t product =
        checked_product(checked_product(*micro.value, *accum.value, kTrain), dp, kTrain);
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

void read_betas(const Json& betas, const std::string& path, OptimizerConfig& o, Diagnostics&) {
  if (is_auto(betas)) return;
  if (!betas.is_array() || betas.size() != 2) {
    fail(path, "expected two numbers [beta1, beta2] in [0, 1), got " + describe(betas));
  }
  const RealRange beta_range{0.0, 1.0, false, true};
  o.beta1 = as_real(betas[0], path + "[0]", beta_range);
  o.beta2 = as_real(betas[1], path + "[1]", beta_range);
}

std::optional<OJson> write_betas(const OptimizerConfig& o) {
  return OJson::array({o.beta1, o.beta2});
}

void read_adam_w_mode(const Json& value, const std::string& path, OptimizerConfig& o,
                      Diagnostics& diag) {
  const bool w_mode = as_bool(value, path);
  if (o.type == OptimizerType::kAdamW && !w_mode) {
    diag.warn(path, "false is ignored: type AdamW always decouples weight decay (porter "
                    "implements decoupled decay only; L2-style decay, type \"Adam\" with "
                    "adam_w_mode false and weight_decay > 0, is refused by porter train)");
  } else {
    o.adam_w_mode = w_mode;
  }
}

std::optional<OJson> write_adam_w_mode(const OptimizerConfig& o) { return OJson(o.adam_w_mode); }

// optimizer.params. The type is read first: adam_w_mode depends on it.
constexpr Key<OptimizerConfig> kOptimizerParamKeys[] = {
    {"lr", &OptimizerConfig::lr, kNonNegativeReal, kAutoIsDefault},
    {"betas", Custom<OptimizerConfig>{&read_betas, &write_betas}},
    {"eps", &OptimizerConfig::eps, kPositiveReal, kAutoIsDefault},
    {"weight_decay", &OptimizerConfig::weight_decay, kNonNegativeReal, kAutoIsDefault},
    {"torch_adam", &OptimizerConfig::torch_adam},
    {"adam_w_mode", Custom<OptimizerConfig>{&read_adam_w_mode, &write_adam_w_mode}},
};

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
    read_keys(*p, o, c);
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
    fail(r->path_of("type"),
         "missing; porter implements WarmupLR, WarmupDecayLR and WarmupCosineLR");
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
    s.warmup_min_ratio = p->real("warmup_min_ratio", RealRange{0.0, 1.0}, s.warmup_min_ratio)
                             .value_or(s.warmup_min_ratio);
    s.cos_min_ratio =
        p->real("cos_min_ratio", RealRange{0.0, 1.0}, s.cos_min_ratio).value_or(s.cos_min_ratio);
  } else {
    s.warmup_min_lr = p->real("warmup_min_lr", kNonNegativeReal, 0.0).value_or(s.warmup_min_lr);
    double lr_default = c.optimizer ? c.optimizer->lr : s.warmup_max_lr;
    s.warmup_max_lr =
        p->real("warmup_max_lr", kNonNegativeReal, lr_default).value_or(s.warmup_max_lr);
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

constexpr Key<Fp16Config> kFp16Keys[] = {
    {"enabled", &Fp16Config::enabled, kAutoIsDefault},
    {"loss_scale", &Fp16Config::loss_scale, kNonNegativeReal},
    // 2^power must be a finite float32.
    {"initial_scale_power", &Fp16Config::initial_scale_power, IntRange{0, 127}},
    {"loss_scale_window", &Fp16Config::loss_scale_window, kPositive},
    {"hysteresis", &Fp16Config::hysteresis, kPositive},
    {"min_loss_scale", &Fp16Config::min_loss_scale, kPositiveReal},
};

constexpr Key<Bf16Config> kBf16Keys[] = {
    {"enabled", &Bf16Config::enabled, kAutoIsDefault},
};

void read_precision(ObjectReader& root, Config& c) {
  if (std::optional<ObjectReader> r = root.object("fp16")) {
    read_keys(*r, c.fp16, c);
    r->not_implemented("auto_cast", false, "autocasting fp32 inputs");
    r->not_implemented("consecutive_hysteresis", false, "consecutive hysteresis");
    r->not_implemented("fp16_master_weights_and_grads", false, "fp16 master weights");
    r->finish();
  }
  // "bfloat16" is DeepSpeed's old name for the section.
  const bool has_old = root.has("bfloat16");
  if (has_old && root.has("bf16")) {
    fail("bfloat16",
         "deprecated alias of \"bf16\", given together with \"bf16\"; keep only \"bf16\"");
  }
  if (has_old) root.diag().warn("bfloat16", "deprecated; use \"bf16\" instead");
  if (std::optional<ObjectReader> r = root.object(has_old ? "bfloat16" : "bf16")) {
    read_keys(*r, c.bf16, c);
    r->finish();
  }
  if (c.fp16.enabled && c.bf16.enabled) {
    fail(has_old ? "bfloat16.enabled" : "bf16.enabled",
         "true, but fp16.enabled is true too; enable one of fp16 and bf16");
  }
  // The gradients' dtype (Note [Gradient dtype] in engine/run_options.h): fp32 or the compute
  // dtype, reduced in that same dtype.
  if (std::optional<ObjectReader> r = root.object("data_types")) {
    if (!r->is_null("grad_accum_dtype")) {
      c.data_types.grad_accum_dtype = r->enumeration("grad_accum_dtype", kGradDTypes);
    }
    r->finish();
  }
  if (!root.is_null("communication_data_type")) {
    c.communication_data_type = root.enumeration("communication_data_type", kGradDTypes);
  }
  const GradDType compute = c.bf16.enabled   ? GradDType::kBf16
                            : c.fp16.enabled ? GradDType::kFp16
                                             : GradDType::kFp32;
  const GradDType grads =
      c.data_types.grad_accum_dtype.value_or(c.communication_data_type.value_or(GradDType::kFp32));
  if (grads != GradDType::kFp32 && grads != compute) {
    fail(c.data_types.grad_accum_dtype ? "data_types.grad_accum_dtype" : "communication_data_type",
         "\"" + std::string(to_string(grads)) + "\" with " +
             (compute == GradDType::kFp32 ? std::string("fp32 compute")
                                          : std::string(to_string(compute)) + ".enabled") +
             ": porter keeps gradients in fp32 or in the compute dtype; use \"fp32\"" +
             (compute == GradDType::kFp32 ? "" : " or \"" + std::string(to_string(compute)) + "\""));
  }
  if (c.communication_data_type && *c.communication_data_type != grads) {
    fail("communication_data_type",
         "\"" + std::string(to_string(*c.communication_data_type)) + "\" with gradients kept in " +
             std::string(to_string(grads)) +
             " (data_types.grad_accum_dtype): porter reduces the gradients in the dtype it keeps "
             "them in; set both to the same dtype, or leave communication_data_type out");
  }
}

// ---- zero_optimization --------------------------------------------------------------------

// Offload device: "nvme" is accepted but not implemented; it resolves to "cpu".
template <typename S>
void read_offload_device(const Json& v, const std::string& path, S& o, Diagnostics& diag) {
  if (v.is_string() && v.get_ref<const std::string&>() == "nvme") {
    diag.warn(path, "\"nvme\": porter does not offload to NVMe; it reads this as \"cpu\" "
                    "(host memory), which needs the same state to fit in host memory; use \"cpu\"");
    o.device = OffloadDevice::kCpu;
    return;
  }
  static constexpr std::string_view kNames[] = {"none", "cpu", "nvme"};
  o.device = as_enum_index(v, path, kNames) == 0 ? OffloadDevice::kNone : OffloadDevice::kCpu;
}

template <typename S>
std::optional<OJson> write_offload_device(const S& o) {
  return OJson(to_string(o.device));
}

// nvme_path is used by NVMe offload only: checked to be a string, not kept, not printed.
template <typename S>
void read_nvme_path(const Json& v, const std::string& path, S&, Diagnostics&) {
  as_string(v, path);
}

template <typename S>
std::optional<OJson> no_output(const S&) {
  return std::nullopt;
}

template <typename S>
constexpr Custom<S> kOffloadDevice{&read_offload_device<S>, &write_offload_device<S>};
template <typename S>
constexpr Custom<S> kNvmePath{&read_nvme_path<S>, &no_output<S>};

using OffloadOptimizer = OffloadOptimizerConfig;
constexpr Key<OffloadOptimizer> kOffloadOptimizerKeys[] = {
    {"device", kOffloadDevice<OffloadOptimizer>},
    {"pin_memory", &OffloadOptimizer::pin_memory, kAutoIsDefault},
    {"buffer_count", &OffloadOptimizer::buffer_count, kPositive, kAutoIsDefault},
    {"fast_init", &OffloadOptimizer::fast_init, kAutoIsDefault},
    {"ratio", &OffloadOptimizer::ratio, RealRange{0.0, 1.0}, kAutoIsDefault},
    {"nvme_path", kNvmePath<OffloadOptimizer>},
};

using OffloadParam = OffloadParamConfig;
constexpr Key<OffloadParam> kOffloadParamKeys[] = {
    {"device", kOffloadDevice<OffloadParam>},
    {"pin_memory", &OffloadParam::pin_memory, kAutoIsDefault},
    {"buffer_count", &OffloadParam::buffer_count, kPositive, kAutoIsDefault},
    {"buffer_size", &OffloadParam::buffer_size_elems, kPositive, kAutoIsDefault},
    {"max_in_cpu", &OffloadParam::max_in_cpu_elems, kNonNegative, kAutoIsDefault},
    {"nvme_path", kNvmePath<OffloadParam>},
};

// Note [Auto in ZeRO]: DeepSpeed drops "auto" values in its pydantic sections, so they take
// the default; the three the HF Trainer sizes from the model take its rules (hidden^2,
// 0.9 hidden^2 and 10 hidden).
int64_t hidden_squared(const ZeroConfig&, const Config& c) {
  return c.porter.model.hidden * c.porter.model.hidden;
}
int64_t nine_tenths_hidden_squared(const ZeroConfig&, const Config& c) {
  return c.porter.model.hidden * c.porter.model.hidden * 9 / 10;
}
int64_t ten_hidden(const ZeroConfig&, const Config& c) { return 10 * c.porter.model.hidden; }
bool overlap_at_stage3(const ZeroConfig& z, const Config&) { return z.stage == 3; }

void check_even(const int64_t& n, const std::string& path) {
  if (n % 2 != 0) {
    fail(path, std::to_string(n) + " is odd; it must be a multiple of 2 (all-gather partitions "
                                   "are aligned to 2 elements), e.g. " + std::to_string(n + 1));
  }
}

// Note [Fixed behaviour] in config/parse.h: the zero_optimization keys whose choice porter
// makes one way, said once each when the config gives them (any value, "auto" included).
// - contiguous_gradients: the gradients live in one flat buffer at stages 0 and 1, and at
//   stages 2 and 3 each bucket is reduced into the rank's flat f32 gradient shard
//   (Note [Gradient reduction] in zero/reducer.h); nothing is fragmented to defragment.
// - sub_group_size: ShardedOptimizer::update steps the rank's whole range in one AdamW call,
//   on the device or (offloaded) in one CpuAdam::update over the host threads; its state is
//   allocated for the whole run, so there is nothing to bound by sub-group.
// - nvme_path and offload_optimizer.fast_init: NVMe offload does not exist in porter ("nvme"
//   devices read as "cpu").
// - round_robin_gradients: with optimizer offload each bucket's part of the shard goes to the
//   host as soon as it is final (Note [Optimizer offload] in zero/sharded_optimizer.h).
// - allgather_partitions: stages 1 and 2 all-gather the updated shards (Note [Bucketed
//   parameter all-gather]); stage 3 gathers as Note [Stage 3 gather] says, which DeepSpeed's
//   key does not govern either.
void note_fixed_zero_behaviour(ObjectReader& r) {
  if (r.has("contiguous_gradients")) {
    r.diag().note(r.path_of("contiguous_gradients"),
                  "porter always keeps gradients contiguous: they accumulate in one flat buffer "
                  "(at ZeRO stages 2 and 3, the rank's gradient shard), whatever the value (the "
                  "key has no effect)");
  }
  if (r.has("sub_group_size")) {
    r.diag().note(r.path_of("sub_group_size"),
                  "porter's AdamW steps the rank's whole optimizer shard at once (offloaded, the "
                  "host AdamW updates it in one pass over its threads), with all of its state "
                  "allocated for the run; there are no sub-groups (the key has no effect)");
  }
  if (r.has("round_robin_gradients")) {
    r.diag().note(r.path_of("round_robin_gradients"),
                  "porter's optimizer offload copies each bucket's part of the rank's gradient "
                  "shard to the host as soon as it is reduced, whatever the value (the key has no "
                  "effect)");
  }
  if (r.has("allgather_partitions")) {
    r.diag().note(r.path_of("allgather_partitions"),
                  "porter always all-gathers the updated parameters at stages 1 and 2, never a "
                  "series of broadcasts, whatever the value (the key has no effect)");
  }
  if (const Json* o = r.get("offload_optimizer");
      o != nullptr && o->is_object() && o->contains("fast_init")) {
    r.diag().note(r.path_of("offload_optimizer") + ".fast_init",
                  "speeds up NVMe offload's set-up, and porter has no NVMe offload (the key has "
                  "no effect)");
  }
  std::vector<std::string> nvme_paths;
  for (const char* section : {"offload_optimizer", "offload_param"}) {
    const Json* s = r.get(section);
    if (s != nullptr && s->is_object() && s->contains("nvme_path")) {
      nvme_paths.push_back(r.path_of(section) + ".nvme_path");
    }
  }
  if (!nvme_paths.empty()) {
    r.diag().note(nvme_paths[0],
                  std::string("porter has no NVMe offload, so the path is not used") +
                      (nvme_paths.size() > 1 ? " (nor " + nvme_paths[1] + ")" : "") +
                      "; offload to host memory instead, with \"device\": \"cpu\"");
  }
}

using Zero = ZeroConfig;
constexpr Key<Zero> kZeroKeys[] = {
    {"stage", &Zero::stage, IntRange{0, 3}},
    {"contiguous_gradients", &Zero::contiguous_gradients, kAutoIsDefault},
    {"reduce_scatter", &Zero::reduce_scatter, kAutoIsDefault},
    {"reduce_bucket_size", &Zero::reduce_bucket_size_elems, kPositive, AutoIs{&hidden_squared}},
    {"allgather_bucket_size", &Zero::allgather_bucket_size_elems, kPositive, kAutoIsDefault,
     Check{&check_even}},
    {"overlap_comm", &Zero::overlap_comm, DefaultIs{&overlap_at_stage3}},
    {"round_robin_gradients", &Zero::round_robin_gradients, kAutoIsDefault},
    {"allgather_partitions", &Zero::allgather_partitions, kAutoIsDefault},
    {"sub_group_size", &Zero::sub_group_size_elems, kPositive, kAutoIsDefault},
    {"stage3_prefetch_bucket_size", &Zero::stage3_prefetch_bucket_size_elems, kNonNegative,
     AutoIs{&nine_tenths_hidden_squared}},
    {"stage3_param_persistence_threshold", &Zero::stage3_param_persistence_threshold_elems,
     kNonNegative, AutoIs{&ten_hidden}},
    {"stage3_max_live_parameters", &Zero::stage3_max_live_parameters_elems, kNonNegative,
     kAutoIsDefault},
    {"stage3_max_reuse_distance", &Zero::stage3_max_reuse_distance_elems, kNonNegative,
     kAutoIsDefault},
    {"stage3_gather_16bit_weights_on_model_save", &Zero::stage3_gather_16bit_weights_on_model_save,
     kAutoIsDefault, Alias{"stage3_gather_fp16_weights_on_model_save"}},
};

void read_zero(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("zero_optimization");
  if (!r) return;
  ZeroConfig& z = c.zero_optimization;
  read_keys(*r, z, c);

  // Offload sections and their deprecated boolean forms.
  if (r->deprecated("cpu_offload", "offload_optimizer",
                    "\"offload_optimizer\": {\"device\": \"cpu\"}")) {
    if (*r->boolean("cpu_offload")) z.offload_optimizer.device = OffloadDevice::kCpu;
  }
  // The NVMe swap-buffer sizes mean nothing for host memory, where porter keeps the state:
  // a warning when one is set to other than DeepSpeed's default (as for keys porter does not
  // implement: JsonReader::not_implemented).
  auto nvme_only = [](ObjectReader& o, const char* key, bool is_default, const char* meaning) {
    if (!is_default) {
      o.diag().warn(o.path_of(key), std::string(meaning) + ", for NVMe offload only; porter keeps "
                                    "this state in host memory, so it has no effect");
    }
  };
  if (std::optional<ObjectReader> o = r->object("offload_optimizer")) {
    read_keys(*o, z.offload_optimizer, c);
    nvme_only(*o, "buffer_count",
              z.offload_optimizer.buffer_count == OffloadOptimizerConfig{}.buffer_count,
              "sets the number of optimizer-state swap buffers");
    o->not_implemented("pipeline_read", false, "NVMe read pipelining");
    o->not_implemented("pipeline_write", false, "NVMe write pipelining");
    o->not_implemented("pipeline", false, "NVMe pipelining");
    o->finish();
  }
  if (r->deprecated("cpu_offload_param", "offload_param",
                    "\"offload_param\": {\"device\": \"cpu\"}")) {
    if (*r->boolean("cpu_offload_param")) z.offload_param.device = OffloadDevice::kCpu;
  }
  if (std::optional<ObjectReader> o = r->object("offload_param")) {
    read_keys(*o, z.offload_param, c);
    const OffloadParamConfig d;
    nvme_only(*o, "buffer_count", z.offload_param.buffer_count == d.buffer_count,
              "sets the number of parameter swap buffers");
    nvme_only(*o, "buffer_size", z.offload_param.buffer_size_elems == d.buffer_size_elems,
              "sets the size of each parameter swap buffer");
    nvme_only(*o, "max_in_cpu", z.offload_param.max_in_cpu_elems == d.max_in_cpu_elems,
              "caps the parameter elements kept in host memory");
    o->finish();
  }
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
  if (z.offload_optimizer.ratio < 1.0 && z.stage < 3) {
    fail(r->path_of("offload_optimizer.ratio"),
         describe(Json(z.offload_optimizer.ratio)) +
             " < 1 (partial offload) needs ZeRO stage 3, but zero_optimization.stage is " +
             std::to_string(z.stage) + "; use ratio 1 or stage 3");
  }

  note_fixed_zero_behaviour(*r);

  // DeepSpeed keys porter reads but does not implement; harmless at these values.
  r->not_implemented("load_from_fp32_weights", true, "loading from 16-bit weights");
  r->not_implemented("elastic_checkpoint", false, "elastic checkpoints");
  r->not_implemented("ignore_unused_parameters", true, "failing on unused parameters");
  r->not_implemented("legacy_stage1", false, "DeepSpeed's legacy stage 1");
  r->not_implemented("stage3_model_persistence_threshold", kInt64Max,
                     "model persistence threshold");
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

using Activation = ActivationCheckpointingConfig;
constexpr Key<Activation> kActivationCheckpointingKeys[] = {
    {"partition_activations", &Activation::partition_activations},
    {"cpu_checkpointing", &Activation::cpu_checkpointing},
    {"contiguous_memory_optimization", &Activation::contiguous_memory_optimization},
    {"number_checkpoints", &Activation::number_checkpoints, kPositive},
    {"synchronize_checkpoint_boundary", &Activation::synchronize_checkpoint_boundary},
    {"profile", &Activation::profile},
};

void read_activation_checkpointing(ObjectReader& root, Config& c) {
  std::optional<ObjectReader> r = root.object("activation_checkpointing");
  if (!r) return;
  ActivationCheckpointingConfig a;
  read_keys(*r, a, c);
  r->finish();
  c.activation_checkpointing = a;
}

// ---- top level ----------------------------------------------------------------------------

// The scalars after the batch triple (read_batch).
constexpr Key<Config> kTopLevelKeys[] = {
    {"gradient_clipping", &Config::gradient_clipping, kNonNegativeReal, kAutoIsDefault},
    {"steps_per_print", &Config::steps_per_print, kPositive},
    {"wall_clock_breakdown", &Config::wall_clock_breakdown},
    {"prescale_gradients", &Config::prescale_gradients},
    {"gradient_predivide_factor", &Config::gradient_predivide_factor, kPositiveReal},
};

void read_not_implemented_top_level(ObjectReader& root) {
  root.not_implemented("zero_allow_untested_optimizer", false, "optimizers other than Adam/AdamW");
  root.not_implemented("zero_force_ds_cpu_optimizer", true, "client optimizers with offload");
  root.not_implemented("memory_breakdown", false, "DeepSpeed's memory breakdown log");
  root.not_implemented("dump_state", false, "DeepSpeed's state dump");
  root.not_implemented("sparse_gradients", false, "sparse gradients");
  root.not_implemented("dataloader_drop_last", false, "DeepSpeed's data loader");
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

const DeepSpeedKeyTables& deepspeed_key_tables() {
  static const DeepSpeedKeyTables tables{kTopLevelKeys,         kOptimizerParamKeys, kFp16Keys,
                                         kBf16Keys,             kZeroKeys,
                                         kOffloadOptimizerKeys, kOffloadParamKeys,
                                         kActivationCheckpointingKeys};
  return tables;
}

void read_deepspeed_keys(ObjectReader& root, Config& c) {
  read_batch(root, c);
  read_keys(root, c, c);
  read_optimizer(root, c);
  read_scheduler(root, c);
  read_precision(root, c);
  read_zero(root, c);
  read_activation_checkpointing(root, c);
  read_not_implemented_top_level(root);
}

}  // namespace porter::config::detail
