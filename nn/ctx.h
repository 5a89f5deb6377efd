// Ctx: the context every layer op runs through. It allocates op outputs with the right
// memory category, saves what backward needs, and makes checkpointing and selective recompute
// generic: a checkpointed forward keeps only what an op-kind policy keeps, and a recompute
// re-runs the layer's forward, replaying kept outputs and recomputing the rest.
//
// Note [Save context]
// A layer's forward is a sequence of ops, each run through `ctx.op(kind, name, inputs,
// outputs, compute)` (or a named helper such as ctx.linear). The layer calls `ctx.save(name,
// t)` for each tensor its backward reads, and backward reads them with `ctx.saved(name)`.
// The stage's saved state lives in a Tape that the engine owns, never in the layer. A forward
// runs in one of three modes:
//
// - kSaveAll: ops compute; saves are stored in the tape. This is "no checkpointing".
// - kCheckpoint: ops compute, but the tape keeps only the outputs of ops whose kind the
//   OpPolicy keeps (PyTorch's MUST_SAVE; every other kind is PREFER_RECOMPUTE). ctx also
//   records the op graph: which op produced each input and each saved tensor (by address
//   range, newest producer first, so reused memory resolves correctly). At the end,
//   `finish_checkpoint` walks the graph backwards from the saved tensors and gives every op
//   an action for the recompute:
//     replay  - its kind is kept and some output is needed: the tape holds those outputs;
//     compute - some output is needed and its kind is not kept: its op-produced inputs
//               become needed in turn;
//     skip    - nothing backward reads depends on it (e.g. a block's final fc2, dropout and
//               residual), so recompute does not run it at all.
//   Stage inputs and parameters are never stored: the engine hands the stage input back.
// - kRecompute: the engine re-runs the same forward on the same stage input. Op i must
//   have the kind and name it had in the checkpointed forward (else InternalError: the
//   layer is not deterministic in its op sequence). Replayed ops return the kept tensors,
//   computed ops run, skipped ops return placeholders (shape and dtype, no memory; never
//   read, because every computed op's inputs are needed and so are real). The saves
//   then land in the tape exactly as in kSaveAll, and backward runs unchanged.
//
// Gradients are bit-identical across modes because every tensor backward reads is either
// the same bytes (replayed) or produced by the same kernels on the same inputs (computed),
// and dropout masks are a pure function of (seed, stage, step, micro-batch, site) where the
// site is the dropout's ordinal within the stage (Note [Dropout keys] in philox.h).
//
// Memory categories: every op output of a forward (any mode) is `activations`, whether it is
// saved or transient, so the allocator's activation footprint (MemoryStats::
// peak_activation_bytes) is exactly what a policy spends; backward temporaries and
// activation gradients are `workspace`. The engine retags stage inputs it holds as
// checkpoints to `checkpoints`. After a forward, the tape's bytes are exactly the
// stage's saved activations (Tape::saved_bytes counts each allocation once).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::nn {

// Layers speak in tensors and the kernels' ops: their names are nn's vocabulary too.
using namespace porter::tensor;
using namespace porter::kernels;

// What an op computes, for checkpoint policies. kAttention is the core attention only
// (softmax(QK^T)V), the part Korthikanti et al. recompute selectively.
enum class OpKind : uint8_t {
  kMatmul,     // matmuls and linear layers (matmul + bias fused)
  kLayerNorm,
  kGelu,
  kAttention,
  kDropout,
  kAdd,        // residual adds
  kBias,
  kEmbedding,
  kLoss,
  kOther,      // user ops that fit none of the above
};
inline constexpr int kNumOpKinds = 10;
std::string_view op_kind_name(OpKind kind);

// Which op kinds a checkpointed forward keeps (MUST_SAVE); the rest are recomputed.
class OpPolicy {
 public:
  static OpPolicy keep_none();                                  // full recompute
  static OpPolicy keep_all();                                   // recompute nothing needed
  static OpPolicy keep_only(std::initializer_list<OpKind> kinds);
  static OpPolicy recompute_only(std::initializer_list<OpKind> kinds);
  // Korthikanti et al.'s selective recompute: only core attention is recomputed.
  static OpPolicy selective_attention() { return recompute_only({OpKind::kAttention}); }

  bool keeps(OpKind kind) const { return keep_[static_cast<size_t>(kind)]; }
  std::string to_string() const;  // "keep {matmul}" or "recompute {attention}", the shorter

 private:
  std::array<bool, kNumOpKinds> keep_{};
};

enum class SaveMode { kSaveAll, kCheckpoint, kRecompute, kBackward };
std::string_view save_mode_name(SaveMode mode);

// Shape and dtype of one op output.
struct OutSpec {
  Shape shape;
  DType dtype = DType::kF32;
};

// The saved state of one stage between its forward and its backward. Owned by the engine;
// one per stage (per micro-batch in flight). See Note [Save context].
class Tape {
 public:
  // Drops everything (after backward, or to abandon a step).
  void clear();
  // Bytes of distinct allocations the tape holds (saved tensors and kept op outputs).
  size_t saved_bytes() const;
  size_t num_saved() const { return saved_.size(); }
  // Whether a checkpointed forward left a recompute plan.
  bool has_plan() const { return !plan_.empty(); }
  // Per op of the plan: "replay", "compute" or "skip" (for tests and reports).
  std::vector<std::string> plan_actions() const;

 private:
  friend class Ctx;
  enum class Action : uint8_t { kCompute, kReplay, kSkip };
  struct Ref {  // a tensor identified by the op that produced it; op < 0 means external
    int op = -1;
    int slot = 0;
  };
  struct OpRecord {
    OpKind kind;
    std::string name;
    std::vector<Ref> inputs;
    std::vector<const void*> out_begin;  // address ranges of the outputs
    std::vector<size_t> out_bytes;
    std::vector<Tensor> kept;            // outputs, held only for kept kinds
    Action action = Action::kCompute;
  };
  std::vector<std::pair<std::string, Tensor>> saved_;
  std::vector<OpRecord> plan_;      // kCheckpoint records, then the recompute plan
  std::vector<Ref> saved_refs_;     // kCheckpoint: producers of the saved tensors
};

// Per-run identity for dropout keys, and the micro-batch's shape: under sequence parallelism
// a stage sees only its rank's token rows and takes (batch, seq) from here (0: not given).
struct RunInfo {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t micro_batch = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  // Evaluation (Engine::evaluate): dropout is the identity, as in PyTorch's eval mode.
  bool eval = false;
};

// A micro-batch's tensors on the device, by name (Note [Batch tensors] in io/data.h): a token
// batch is {"tokens", "targets"}. The engine sets it on the Ctx for every forward, recompute
// and backward of the micro-batch, so a stage may read any of them (a mask, a second input)
// besides the activation it is handed.
struct Batch {
  std::vector<std::pair<std::string, Tensor>> tensors;
  const Tensor* find(std::string_view name) const;
  // Throws InvalidArgument naming the batch's tensors when there is no `name`.
  const Tensor& get(std::string_view name) const;
};

// The element type collectives use for a tensor of `dtype`.
comm::ElemType comm_type(DType dtype);

// Note [Tensor-parallel collectives]
// A Ctx may carry the tensor-parallel group's communicator (set_tensor_parallel; null or a
// group of one: no tensor parallelism). Layers call the collectives below inside an op's
// compute (forward, recompute) or in backward; each is queued on the group's comm stream
// after the work already queued on the compute stream (Note [Comm stream] in
// comm/communicator.h) and returns the Work, so a layer can overlap it with compute before
// tp_wait (e.g. the all-reduce of a column-parallel input gradient runs while the weight
// gradient is computed). Every rank of the group must issue the same collectives in the same
// order: the ops a recompute skips or replays are the same on every rank because the ranks
// run the same plan. Sums follow Note [Collective semantics]: fixed order, so runs are
// reproducible. The ops are labelled "<stage name> <op name>" for the trace when the caller
// labels them (comm::CommLabel).
class Ctx;

class Ctx {
 public:
  Ctx(Kernels& kernels, memory::CachingAllocator& allocator, DType compute_dtype = DType::kF32);

  // Starts a stage's forward (kSaveAll, kCheckpoint, kRecompute) or backward on `tape`.
  // kCheckpoint uses `policy`; kRecompute requires the plan a kCheckpoint left in `tape`.
  void begin(int stage, Tape& tape, SaveMode mode, const OpPolicy& policy = OpPolicy::keep_none());
  // Ends the stage. After kCheckpoint this computes the recompute plan; after kRecompute it
  // drops the plan; it checks that recompute ran every op of the plan.
  void end();
  // Ends the stage after an error without planning; the tape is left cleared.
  void abort() noexcept;

  void set_run(const RunInfo& run) { run_ = run; }
  // Note [Tensor-parallel collectives]. Not owned; outlives the ctx's use of it.
  void set_tensor_parallel(comm::Communicator* tp) { tp_ = tp; }
  comm::Communicator* tensor_parallel() const { return tp_; }
  int tp_rank() const { return tp_ != nullptr ? tp_->rank() : 0; }
  int tp_size() const { return tp_ != nullptr ? tp_->size() : 1; }
  // In place: t <- sum over the group of t.
  comm::Work tp_all_reduce(Tensor& t);
  // out (size() * in.numel() elements, same dtype) block r <- rank r's in.
  comm::Work tp_all_gather(const Tensor& in, Tensor& out);
  // out (in.numel() / size()) <- sum over the group of this rank's block of in.
  comm::Work tp_reduce_scatter(const Tensor& in, Tensor& out);
  // The compute stream waits for `work` (on cpu: the calling thread blocks); rethrows its
  // error.
  void tp_wait(comm::Work& work);
  const RunInfo& run() const { return run_; }
  // The micro-batch being run (not owned; null outside a step). batch(name) throws
  // InvalidArgument when there is none or it has no such tensor.
  void set_batch(const Batch* batch) { batch_ = batch; }
  const Tensor& batch(std::string_view name) const;
  SaveMode mode() const { return mode_; }
  int stage() const { return stage_; }
  DType compute_dtype() const { return dtype_; }
  Kernels& kernels() { return *kernels_; }
  memory::CachingAllocator& allocator() { return *allocator_; }

  // The generic op: allocates `outputs`, then calls compute(outputs) unless the mode says
  // to replay or skip it. `inputs` are every tensor compute reads (activations and
  // parameters alike); checkpoint planning depends on this list being complete.
  using Compute = std::function<void(std::span<Tensor> outputs)>;
  std::vector<Tensor> op(OpKind kind, std::string_view name,
                         std::initializer_list<Tensor> inputs,
                         std::initializer_list<OutSpec> outputs, const Compute& compute);

  // Saves `t` for backward under `name` (unique within the stage).
  void save(std::string_view name, const Tensor& t);
  // In backward: the tensor saved under `name`.
  const Tensor& saved(std::string_view name) const;

  // Named helpers over op(), for the ops a transformer needs.
  // y (N, out) = x (N, in) @ w (out, in)^T + b (out); b may be undefined (no bias).
  Tensor linear(std::string_view name, const Tensor& x, const Tensor& w, const Tensor& b);
  // Returns {y, mean, rstd}.
  std::array<Tensor, 3> layernorm(std::string_view name, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, float eps = 1e-5f);
  // Returns {y, rstd}; kind layernorm (the normalisation).
  std::array<Tensor, 2> rmsnorm(std::string_view name, const Tensor& x, const Tensor& gamma,
                                float eps);
  // silu(gate) * up; kind gelu (the MLP's activation).
  Tensor swiglu(std::string_view name, const Tensor& gate, const Tensor& up);
  // Kernels::rope_qkv_forward: q (B, T, H*D), k and v (B, T, Hkv*D) -> (B, T, 3*H*D), or with
  // `packed` (B, T, (H + 2 Hkv) D), flash attention's layout; kind other.
  Tensor rope_qkv(std::string_view name, const Tensor& q, const Tensor& k, const Tensor& v,
                  int heads, int kv_heads, double theta, bool packed = false);
  Tensor gelu(std::string_view name, const Tensor& x);
  // Returns {out (B, T, C), probs (B, heads, T, T) f32}.
  std::array<Tensor, 2> attention(std::string_view name, const Tensor& qkv, int heads);
  // Flash attention (Note [Flash attention] in kernels/kernels.cc): qkv (B, T, (H + 2 Hkv) D)
  // -> {out (B, T, H D), lse (B, H, T) f32}; an op of kind kAttention like attention().
  std::array<Tensor, 2> flash_attention(std::string_view name, const Tensor& qkv, int heads,
                                        int kv_heads);
  // The mask's key is this stage's next dropout site (Note [Save context]). p == 0, or an
  // evaluation run (RunInfo::eval), copies nothing: it returns x itself without an op.
  Tensor dropout(std::string_view name, const Tensor& x, float p, int64_t element_offset = 0);
  Tensor add(std::string_view name, const Tensor& a, const Tensor& b);
  // The PhiloxKey the n-th dropout of this stage uses (for backward). element_offset (a
  // multiple of 4) is where x starts in the whole tensor whose masks it draws: a rank holding
  // rows of a sequence-parallel tensor draws exactly those rows' masks (Note [Dropout keys]).
  PhiloxKey dropout_key_for(int site, int64_t element_offset = 0) const;

  // A temporary for backward or inside an op (category workspace).
  Tensor workspace(Shape shape, DType dtype);
  // An activation gradient handed between stages (category workspace: it is transient).
  Tensor grad_like(const Tensor& x) { return workspace(x.shape(), x.dtype()); }

 private:
  Tape::Ref find_producer(const Tensor& t) const;
  void plan_recompute();

  Kernels* kernels_;                       // not owned; outlives the ctx
  memory::CachingAllocator* allocator_;    // not owned; outlives the ctx
  DType dtype_;
  RunInfo run_;
  comm::Communicator* tp_ = nullptr;       // not owned; null: no tensor parallelism
  const Batch* batch_ = nullptr;           // not owned; the engine's micro-batch
  Tape* tape_ = nullptr;                   // not owned; the engine's, for the current stage
  SaveMode mode_ = SaveMode::kSaveAll;
  OpPolicy policy_ = OpPolicy::keep_none();
  int stage_ = -1;
  int op_index_ = 0;
  int dropout_site_ = 0;
  bool active_ = false;
};

}  // namespace porter::nn
