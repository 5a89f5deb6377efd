// The typed, validated, immutable form of a porter run's JSON config (DeepSpeed keys plus
// porter's own "porter" section). Produced by parse_config_*() in config/parse.h.
//
// Every field holds a *resolved* value: defaults filled in, "auto" replaced, deprecated
// aliases mapped onto their replacements. std::optional marks what DeepSpeed calls "none".
// docs/config.md lists every key, its default and where porter differs from DeepSpeed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace porter::config {

// ---- DeepSpeed sections -------------------------------------------------------------------

enum class OptimizerType { kAdam, kAdamW };

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool torch_adam = false;
  // Decoupled weight decay (AdamW). Always true for type AdamW.
  bool adam_w_mode = true;
  bool operator==(const OptimizerConfig&) const = default;
};

enum class SchedulerType { kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };

// One struct for the three schedulers; fields a type does not use keep their defaults.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kWarmupLR;
  // WarmupLR and WarmupDecayLR.
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  // All three.
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  int64_t last_batch_iteration = -1;
  // WarmupDecayLR and WarmupCosineLR (required there).
  std::optional<int64_t> total_num_steps;
  // WarmupCosineLR.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  bool operator==(const SchedulerConfig&) const = default;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 = dynamic loss scaling
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double min_loss_scale = 1.0;
  bool operator==(const Fp16Config&) const = default;
};

struct Bf16Config {
  bool enabled = false;
  bool operator==(const Bf16Config&) const = default;
};

// The dtype gradients are kept and reduced in: data_types.grad_accum_dtype and
// communication_data_type ("fp32", "bf16", "fp16"). Note [Gradient dtype] in
// engine/run_options.h says which combinations run.
enum class GradDType { kFp32, kBf16, kFp16 };
struct DataTypesConfig {
  std::optional<GradDType> grad_accum_dtype;  // none: communication_data_type's, else fp32
  bool operator==(const DataTypesConfig&) const = default;
};

// "nvme" is read but not implemented yet: it resolves to kCpu with a warning.
enum class OffloadDevice { kNone, kCpu };

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  bool pin_memory = true;
  int64_t buffer_count = 4;
  bool fast_init = false;
  double ratio = 1.0;  // fraction of the optimizer state offloaded (stage 3 only below 1)
  bool operator==(const OffloadOptimizerConfig&) const = default;
};

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  bool pin_memory = true;
  int64_t buffer_count = 5;
  int64_t buffer_size_elems = 100'000'000;
  int64_t max_in_cpu_elems = 1'000'000'000;
  bool operator==(const OffloadParamConfig&) const = default;
};

// Bucket and threshold sizes are in elements, as in DeepSpeed.
struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size_elems = 500'000'000;
  int64_t allgather_bucket_size_elems = 500'000'000;
  bool overlap_comm = false;  // default: true at stage 3, false below
  bool round_robin_gradients = false;
  bool allgather_partitions = true;
  int64_t sub_group_size_elems = 1'000'000'000;
  // The three gather knobs are none when the config leaves them out (or gives "auto", or
  // null): porter sizes them at stage 3 (Note [Stage 3 sizing] in engine/stage3.h).
  // DeepSpeed's defaults are 5e7, 1e9 and 1e9.
  std::optional<int64_t> stage3_prefetch_bucket_size_elems;
  int64_t stage3_param_persistence_threshold_elems = 100'000;
  std::optional<int64_t> stage3_max_live_parameters_elems;
  std::optional<int64_t> stage3_max_reuse_distance_elems;
  bool stage3_gather_16bit_weights_on_model_save = false;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  bool operator==(const ZeroConfig&) const = default;
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
  std::optional<int64_t> number_checkpoints;
  bool operator==(const ActivationCheckpointingConfig&) const = default;
};

// ---- porter's own section ("porter") ------------------------------------------------------

enum class ModelType { kGpt, kLlama, kQwen2 };

// porter.model.attention: which attention kernels the blocks run (Note [Attention choice] in
// engine/forecast.h). kMaterialized keeps the (B, H, T, T) probabilities for backward;
// kFlash keeps only each row's log-sum-exp and recomputes the scores (Note [Flash attention]
// in kernels/kernels.cc); kAuto takes kMaterialized where the run fits with it, else kFlash.
enum class AttentionKind { kAuto, kFlash, kMaterialized };

// porter.model: the built-in decoder. `type` is the architecture (the key porter.model.arch;
// "type" is its older spelling): the pre-LN GPT (GPT-2's layout), the Llama or Qwen2 (a Llama
// with q, k and v biases); each is a spec in models/ (docs/models.md). With `from` set, the
// shape comes from a Hugging Face model directory's config.json (io/hf_checkpoint.h), before
// the engine is built.
struct ModelConfig {
  ModelType type = ModelType::kGpt;
  int64_t layers = 12;
  int64_t hidden = 768;
  int64_t heads = 12;
  int64_t seq_len = 1024;
  int64_t vocab = 50257;
  double dropout = 0.0;
  bool tie_embeddings = true;
  // Llama: grouped-query attention with kv_heads key/value heads (num_key_value_heads); 0
  // means heads (full multi-head attention). The GPT takes only 0 or heads.
  int64_t kv_heads = 0;
  // The MLP's inner width; 0 means the architecture's default (GPT 4 * hidden; Llama
  // 8/3 * hidden rounded up to a multiple of 256). The GPT takes only 0 or 4 * hidden.
  int64_t intermediate = 0;
  // The normalisation epsilon (GPT-2 layer_norm_epsilon, Llama rms_norm_eps).
  double norm_eps = 1e-5;
  // Llama: the rotary embedding base (rope_theta).
  double rope_theta = 10000.0;
  // The context length, >= seq_len; 0 means seq_len. GPT: the rows of the position table
  // wpe (n_positions); Llama: max_position_embeddings (no table: positions are rotary).
  int64_t max_positions = 0;
  // A Hugging Face model directory (config.json, model.safetensors or sharded files with
  // model.safetensors.index.json) to start from.
  std::optional<std::string> from;
  int64_t tensor_parallel = 1;
  // Megatron's sequence parallelism: layernorm, dropout and the residual stream hold 1/t of
  // the token rows (docs/tensor-parallel.md). No effect at tensor_parallel 1.
  bool sequence_parallel = false;
  AttentionKind attention = AttentionKind::kAuto;
  // porter.model.loss_tiles: the head and cross-entropy run over this many contiguous tiles
  // of the token rows, so only one tile's logits exist at a time (Note [Loss tiles] in
  // models/transformer.cc). 1 computes the whole (B*T, V) logits at once; 0 lets porter
  // choose the fewest tiles (1, 2, 4, ...) with which the run fits its device (Note [Attention
  // choice] in engine/forecast.h); an Engine built without that choice takes 0 as 1.
  int64_t loss_tiles = 1;
  // porter.model.mlp_tiles: each block's MLP runs as one op over this many contiguous tiles of
  // the token rows, so only one tile's intermediates (4C, or the Llama's gate, up and SwiGLU)
  // exist at a time and backward recomputes them from the kept MLP input (Note [MLP tiles]
  // in models/blocks.cc). 1 computes the whole intermediates at once and keeps them; 0 lets
  // porter choose, as loss_tiles 0 does (1 with sequence parallelism).
  int64_t mlp_tiles = 1;
  bool operator==(const ModelConfig&) const = default;
};

enum class DataType { kSynthetic, kText, kTokens };

// porter.data. tokens: pre-tokenized shards (llm.c's .bin with its 256-int32 header, or
// nanoGPT's raw uint16 train.bin), engine/data.h. val_paths: a validation set of the same
// type (text or tokens), evaluated every porter.train.eval_every steps.
struct DataConfig {
  DataType type = DataType::kSynthetic;
  std::vector<std::string> paths;
  std::vector<std::string> val_paths;
  uint64_t seed = 1234;
  bool operator==(const DataConfig&) const = default;
};

enum class DeviceType { kAuto, kCpu, kCuda };

// Which candidates a kernel choice made by timing may pick (Note [Kernel table] in
// kernels/kernel_table.cc): only those that give the default's bits, or every one.
enum class KernelChoice { kExact, kFastest };

// A GPU whose published figures porter knows, to time a run without it (Note [Device models]
// in engine/device_model.h).
enum class GpuModel { kH100Sxm, kH200, kA100_80gb, kL40s };

struct DeviceConfig {
  DeviceType type = DeviceType::kAuto;
  std::optional<uint64_t> memory_limit_bytes;  // none: the device's (or host's) capacity
  std::optional<uint64_t> pinned_limit_bytes;  // none: no limit beyond the host's
  std::optional<double> sim_link_gbps;         // none: copies are not throttled (cpu)
  int64_t threads = 0;                         // 0: one per core
  bool poison_freed = false;                   // debug: NaN-fill released device memory (cpu)
  KernelChoice kernel_choice = KernelChoice::kExact;
  // A kernel table to pin (a table, a report, or a training checkpoint directory); relative
  // paths resolve against the working directory.
  std::optional<std::string> kernel_table;
  // The figures a run is timed with (Note [Device models] in engine/device_model.h): a named
  // GPU's, else the configured device's own (the cpu device's measured), then each override.
  std::optional<GpuModel> model;
  std::optional<double> peak_tflops;        // dense, at the run's compute dtype
  std::optional<double> hbm_gbps;           // device memory bandwidth
  std::optional<double> host_link_gbps;     // device <-> host, each direction
  std::optional<double> interconnect_gbps;  // the collectives' bus, each direction
  bool operator==(const DeviceConfig&) const = default;
};

enum class CheckpointPolicy { kNone, kFull, kUniform, kBlock, kSqrt, kSelective, kOptimal };

// A checkpoint memory budget: absolute bytes, or a fraction 0..1 of what keeping every
// activation would need (PyTorch's memory_budget).
struct MemoryBudget {
  std::variant<uint64_t, double> value;  // bytes, or fraction
  bool is_fraction() const { return std::holds_alternative<double>(value); }
  bool operator==(const MemoryBudget&) const = default;
};

struct CheckpointingConfig {
  CheckpointPolicy policy = CheckpointPolicy::kNone;
  // uniform: segments of every_n_layers blocks, or the blocks split into `segments` segments
  // of ceil(blocks / segments) (DeepSpeed's activation_checkpointing.number_checkpoints,
  // folded in by the parser under any policy). At most one of the two is set.
  std::optional<int64_t> every_n_layers;
  std::optional<int64_t> segments;
  std::optional<int64_t> block_layers;    // block
  std::optional<MemoryBudget> memory_budget;  // optimal
  std::vector<std::string> selective_ops;     // selective: op kinds recomputed, not saved
  int64_t prefetch_depth = 1;
  int64_t keep_last_on_device = 1;
  // partition_activations: a held checkpoint smaller than this stays whole on every rank.
  int64_t partition_min_bytes = 64 * 1024;
  bool operator==(const CheckpointingConfig&) const = default;
};

struct TrainConfig {
  int64_t steps = 10;
  uint64_t seed = 42;
  int64_t log_every = 1;
  // With porter.data.val_paths: the validation loss every eval_every steps (0: after the
  // last step only), over eval_micro_batches micro-batches of the training shape.
  int64_t eval_every = 0;
  int64_t eval_micro_batches = 8;
  // With --save DIR: a checkpoint DIR/step-<N> every save_every steps and after the last
  // (0: after the last only), of which the newest keep_checkpoints stay (Note [Run
  // directory] in io/run_dir.h).
  int64_t save_every = 0;
  int64_t keep_checkpoints = 2;
  bool operator==(const TrainConfig&) const = default;
};

// Collective communication (comm/). Every blocking call (store get/wait, collectives,
// rendezvous) gives up after timeout_s with an error naming the rank and the operation.
enum class CommBackend { kAuto, kGloo, kNccl };  // auto: gloo on cpu, nccl on cuda

struct CommConfig {
  CommBackend backend = CommBackend::kAuto;
  double timeout_s = 300.0;
  // The tensor-parallel link the planner charges all-gathers to, GB/s; none: measured at
  // engine start.
  std::optional<double> sim_tp_gbps;
  bool operator==(const CommConfig&) const = default;
};

struct TraceConfig {
  std::optional<std::string> path;
  bool operator==(const TraceConfig&) const = default;
};

// porter.optimizer: which parameters decay and at what learning rate (Note [Parameter groups]
// in zero/param_groups.h). A pattern is an fnmatch glob over a parameter's layout name
// ("h.3.attn.qkv.bias", "wpe") or a rank selector "ndim<N" (also <=, ==, >=, >).
struct ParamGroupConfig {
  std::vector<std::string> params;     // patterns; a parameter matching any is in the group
  std::optional<double> weight_decay;  // none: the optimizer's weight_decay
  double lr_scale = 1.0;               // the group's lr = the schedule's lr x lr_scale
  bool operator==(const ParamGroupConfig&) const = default;
};

struct PorterOptimizerConfig {
  // Weight decay 0 for the parameters no group matched and that match one of these. The
  // default decays only matrices, and not the GPT's position table (nanoGPT's and Hugging
  // Face Trainer's rule); [] decays every parameter.
  std::vector<std::string> no_decay = {"ndim<2", "wpe"};
  std::vector<ParamGroupConfig> param_groups;  // first match wins
  bool operator==(const PorterOptimizerConfig&) const = default;
};

// The rank selector of a parameter pattern ("ndim<2"): nullopt for a glob. Throws ConfigError
// naming `path` for a malformed selector.
struct RankSelector {
  enum class Op { kLt, kLe, kEq, kGe, kGt } op = Op::kLt;
  int64_t ndim = 0;
  bool matches(int64_t rank) const;
};
std::optional<RankSelector> rank_selector(const std::string& pattern, const std::string& path);
// Checks a pattern (a non-empty glob with balanced brackets, or a well-formed selector);
// throws ConfigError naming `path`.
void check_param_pattern(const std::string& pattern, const std::string& path);
// Whether a parameter named `name` of rank `rank` matches a checked pattern.
bool param_pattern_matches(const std::string& pattern, const std::string& name, int64_t rank);

struct PorterSection {
  ModelConfig model;
  DataConfig data;
  DeviceConfig device;
  CheckpointingConfig checkpointing;
  TrainConfig train;
  TraceConfig trace;
  CommConfig comm;
  PorterOptimizerConfig optimizer;
  bool operator==(const PorterSection&) const = default;
};

// ---- the whole config ---------------------------------------------------------------------

// Invariants after parsing:
//   train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp
//   dp == world_size / porter.model.tensor_parallel
//   !(fp16.enabled && bf16.enabled)
struct Config {
  int64_t world_size = 1;  // from ParseOptions, not from the file
  int64_t train_batch_size = 1;
  int64_t train_micro_batch_size_per_gpu = 1;
  int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 1.0;  // 0 = off
  std::optional<int64_t> steps_per_print;
  bool wall_clock_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  std::optional<OptimizerConfig> optimizer;
  std::optional<SchedulerConfig> scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  DataTypesConfig data_types;
  std::optional<GradDType> communication_data_type;  // none: the gradients' dtype
  ZeroConfig zero_optimization;
  std::optional<ActivationCheckpointingConfig> activation_checkpointing;
  PorterSection porter;

  int64_t data_parallel_size() const { return world_size / porter.model.tensor_parallel; }
  bool operator==(const Config&) const = default;
};

// The JSON spelling of each enum value ("AdamW", "cpu", "uniform", ...).
std::string_view to_string(OptimizerType v);
std::string_view to_string(SchedulerType v);
std::string_view to_string(WarmupType v);
std::string_view to_string(OffloadDevice v);
std::string_view to_string(ModelType v);
std::string_view to_string(AttentionKind v);
std::string_view to_string(DataType v);
std::string_view to_string(DeviceType v);
std::string_view to_string(CheckpointPolicy v);
std::string_view to_string(CommBackend v);
std::string_view to_string(KernelChoice v);
std::string_view to_string(GpuModel v);
std::string_view to_string(GradDType v);

// The op kinds `porter.checkpointing.selective_ops` may name.
const std::vector<std::string>& selective_op_kinds();

}  // namespace porter::config
