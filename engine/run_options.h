// porter::engine::RunOptions: everything a run derives from its config, translated once: the
// device, dtypes, the analytic shape, the planner's (offload and partition included), stash's,
// reducer's (with its buckets), optimizer's and stage 3's options, the batch bytes and where
// the planner's costs come from. The Engine and the `train`, `plan`, `estimate` and `stress`
// commands all read these instead of the config.
//
// Note [Run options]
// The config (config/config.h) is what the user wrote, validated. RunOptions is what the
// layers below the engine take, each in its own option struct; make_run_options is the only
// code that maps one to the other, so two readers cannot disagree on a rule (which dtype wins
// when both fp16 and bf16 are on, which costs a plan is made from, what counts in the
// predicted peak). The parser (config/) checks each rule between keys once and refuses a
// config that breaks it; below it such a rule is an assertion (check_supported), never a
// second message. A knob of the config reaches exactly the fields it names, and to_json lists
// every field, so a test can check that by comparing two runs' options; the same test lists
// every key of the config and fails for one that reaches no field and is not named as
// another layer's (the data, the training loop's steps and logs, the launch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "models/analytic.h"
#include "checkpoint/planner.h"
#include "config/config.h"
#include "engine/device_model.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "tensor/dtype.h"
#include "kernels/kernel_table.h"
#include "offload/stash.h"
#include "zero/reducer.h"
#include "zero/sharded_optimizer.h"

namespace porter::engine {

// Note [Engine costs]
// Where the planner's per-stage costs come from. A model with an analytic memory model (the
// built-in GPT: Model::analytic_costs) gives exact bytes and FLOPs without allocating, but no
// times. Times are measured by a profiling pass (Engine::profile), which every other model
// needs anyway to know its bytes at all. They are needed by the optimal policy (it minimises
// compute time), by offload (exposed copy time), and in training by every policy that
// recomputes, so that the predicted recompute time in the memory report is a measured one.
// `porter plan` asks for a plan alone and stays analytic (nothing allocated) unless the plan
// itself depends on times. RunOptions::cost_source is that rule, for every caller.
enum class CostSource { kAnalytic, kProfiled };
std::string_view cost_source_name(CostSource s);  // "analytic", "profiled"

// What the costs are for: a plan alone (`porter plan`), or a training run, which also reports
// the predicted recompute time beside the measured one.
enum class CostUse { kPlan, kTraining };

// ZeRO stage 3's gather knobs (zero_optimization.stage3_*; Note [Gather plan] in
// checkpoint/param_gather.h), for the gather units of engine/stage3.h. The three gather knobs
// hold the values in effect: the config's where it set them (`*_given`), else porter's
// (Note [Stage 3 sizing] in engine/stage3.h), sized by make_run_options for the built-in
// model at stage 3, and again by stage3_layout for the model the Engine runs. Built by hand,
// the knobs count as given (DeepSpeed's defaults).
struct Stage3Options {
  int64_t prefetch_elems = 50'000'000;
  int64_t max_live_elems = 1'000'000'000;
  int64_t max_reuse_distance_elems = 1'000'000'000;
  int64_t persistence_threshold_elems = 100'000;  // a smaller unit stays gathered
  bool gather_16bit_weights_on_model_save = false;  // save_checkpoint's consolidated file
  bool prefetch_given = true;
  bool max_live_given = true;
  bool max_reuse_distance_given = true;
  // What the sizing compares against: the data-parallel ranks the parameters are sharded over
  // (world_size / tensor_parallel), and whether the shard lives on the host (offload_param).
  int dp_size = 1;
  bool shard_on_host = false;
};

struct RunOptions {
  // porter.device; "auto" is cuda when a GPU is present, else cpu.
  memory::DeviceOptions device;
  // The device's capacity without opening it: the configured limit, else the cpu default, or
  // nullopt (cuda without a limit: the GPU's memory, unknown until it is opened).
  std::optional<size_t> capacity_bytes;
  memory::AllocatorOptions allocator;   // porter.device.poison_freed
  size_t pinned_limit_bytes = 0;        // porter.device.pinned_limit; 0: the device's
  // porter.device.kernel_choice and kernel_table (Note [Kernel table] in kernels/kernel_table.cc).
  kernels::KernelChoice kernel_choice = kernels::KernelChoice::kExact;
  std::optional<std::string> kernel_table_path;
  // porter.device.model and its overrides: the figures a plan is timed with (Note [Device
  // models] in engine/device_model.h; resolve_device_model turns them into a DeviceModel).
  DeviceModelOptions device_model;
  // fp16.enabled: f16, else bf16.enabled: bf16, else f32 (the parser refuses both).
  tensor::DType compute_dtype = tensor::DType::kF32;
  // Note [Gradient dtype]
  // data_types.grad_accum_dtype, else communication_data_type, else fp32: the dtype of the
  // gradients wherever they are kept (the flat gradient buffer of stages 0 and 1, the reduce
  // buckets, the shard, the host copy under offload) and reduced (every gradient collective),
  // as DeepSpeed's two keys define them. The parser allows fp32 or the compute dtype (the
  // kernels' parameter gradients are f32 or the activations' 16-bit type, Note [Cpu dtype
  // combinations]) and a communication_data_type equal to it. With 16 bits, every gradient
  // byte halves (g = 2 in Note [Model-state bytes per rank]: buckets, shard, communication,
  // host copy), the backward accumulates each parameter's gradient in 16 bits (rounded on every
  // add, as in DeepSpeed's bf16/fp16 gradients), the reductions sum in 16 bits, and the
  // optimizer widens each gradient to f32 as it reads it (the master weights and moments stay
  // f32). docs/zero.md, "Gradient dtype", has the loss against f32 gradients.
  tensor::DType grad_dtype = tensor::DType::kF32;
  zero::StateDTypes state_dtypes() const { return {compute_dtype, grad_dtype}; }
  // One micro-batch of the built-in GPT for the analytic model (porter.model, the micro-batch
  // size, the sequence length, the dtype and the device kind).
  models::TransformerShape shape;
  int64_t gradient_accumulation_steps = 1;
  // porter.checkpointing.selective_ops as an op policy, and its name in profiles.
  nn::OpPolicy selective_policy = nn::OpPolicy::selective_attention();
  std::string selective_name = "attention";
  // The planner's options, offload included; the link bandwidth is sim_link_gbps, else 0
  // (the Engine measures it: Note [Link probe] in offload/link_probe.h).
  checkpoint::PlanOptions plan;
  offload::StashOptions stash;          // activation_checkpointing's storage knobs
  bool keep_all_copy_records = false;   // activation_checkpointing.profile
  zero::ReducerOptions reducer;         // zero_optimization's reduction knobs
  int64_t reduce_bucket_elems = 500'000'000;  // zero_optimization.reduce_bucket_size
  Stage3Options stage3;                 // zero_optimization.stage3_* (read at stage 3 only)
  zero::OptimizerOptions optimizer;     // optimizer, gradient_clipping, fp16, zero stage
  // One micro-batch's token ids and targets on the device: two (B, T) i32 tensors.
  size_t batch_bytes = 0;
  uint64_t seed = 0;                    // porter.train.seed: parameters and dropout
  std::optional<config::SchedulerConfig> scheduler;  // scheduler: the learning rate per step
  bool wall_clock_breakdown = false;    // Note [Wall-clock breakdown] in engine.h

  int zero_stage() const { return optimizer.zero_stage; }
  // porter.model.sequence_parallel with more than one tensor-parallel rank.
  bool sequence_parallel() const {
    return shape.model.sequence_parallel && shape.model.tensor_parallel > 1;
  }
  bool offload_enabled() const { return plan.offload.enabled; }

  // Note [Engine costs].
  CostSource cost_source(bool analytic_available, CostUse use) const;
  // The built-in transformer's analytic costs of one micro-batch (models/analytic.h).
  checkpoint::ChainCosts analytic_costs() const;
  // The predicted peak of all categories: model states, the batch, and the plan's predicted
  // peak of activations, checkpoints, staging and workspace.
  size_t predicted_peak_bytes(size_t model_state_bytes,
                              const checkpoint::Prediction& prediction) const;

  // Every field, by the name of the struct member path ("plan.offload.prefetch_depth").
  nlohmann::ordered_json to_json() const;
};

// Translates a validated config (Note [Run options]).
RunOptions make_run_options(const config::Config& config);

// The planner's offload options of a config (link_bytes_per_s from sim_link_gbps, else 0),
// as make_run_options sets RunOptions::plan.offload.
checkpoint::OffloadOptions offload_options(const config::Config& config);
// The planner's partition options of a config: ways = porter.model.tensor_parallel with
// partition_activations on and sequence_parallel off (under sequence_parallel the checkpoints
// are already sharded), else 1; tp_bytes_per_s from porter.comm.sim_tp_gbps, else 0.
checkpoint::PartitionOptions partition_options(const config::Config& config);

// Note [What the engine runs]
// One device per rank; data parallelism over a dp communicator with ZeRO stages 0 to 3
// (docs/zero.md). A config asking for what porter does not run is refused, naming the key
// and what to use instead, rather than silently run differently. The parser refuses parameter
// offload below stage 3, optimizer offload at stage 0 and a partial offload ratio below stage
// 3 (Note [Run options]); here they are asserted. Optimizer and parameter offload run
// (docs/zero.md). Tensor parallelism (porter.model.tensor_parallel,
// sequence_parallel) runs over a tp communicator, and partition_activations partitions the
// held checkpoints over it (docs/tensor-parallel.md). fp16 runs with loss scaling
// (zero/loss_scaler.h) on both devices; checkpoint offload
// (activation_checkpointing.cpu_checkpointing) runs (docs/engine.md, Offload). Weight decay
// is decoupled (AdamW) and applies to the parameters porter.optimizer says (Note [Parameter
// groups] in zero/param_groups.h; by default the matrices except the GPT's position table,
// as nanoGPT and Hugging Face's Trainer do); Adam with coupled L2 decay (adam_w_mode false)
// is refused when weight_decay or a group's weight_decay is > 0, because the kernel
// implements only the decoupled form. The world size must be dp_size ranks times
// tensor_parallel, and the tp communicator's size (1 without one) tensor_parallel. Throws
// InvalidArgument.
void check_supported(const config::Config& config, int dp_size, int tp_size = 1);

// Recompute FLOPs over one step's forward + backward FLOPs (backward = 2 x forward), from the
// schedule's prediction on analytic costs (profiles measure times, not FLOPs).
double recompute_flop_fraction(const checkpoint::Prediction& prediction,
                               const checkpoint::ChainCosts& analytic);

}  // namespace porter::engine
