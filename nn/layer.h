// The layer contract users implement to wrap their own model, the flat parameter layout
// that hands layers their storage, and the stage runners that drive a layer through a Ctx.
//
// Note [Layer contract]
// - A layer declares its parameters as (name, Shape) in params(). It never allocates them:
//   the engine lays all parameters of a model out in one flat buffer (and the gradients in
//   a second one with the same layout, ParamLayout) and calls bind() with views into both.
// - forward(ctx, x) runs every op through ctx and saves what backward needs with
//   ctx.save(); backward(ctx, dy) reads it back with ctx.saved(). Nothing produced in forward
//   is kept in a member: the same layer object then works under every checkpoint policy,
//   with several micro-batches in flight, and with recompute (Note [Save context]).
// - backward returns dx (freshly written, as kernels overwrite input gradients) and
//   *accumulates* into the bound parameter gradients, so micro-batches sum in the flat
//   gradient buffer. A layer whose input is not differentiable (token ids) returns an
//   undefined Tensor.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "memory/caching_allocator.h"
#include "nn/ctx.h"
#include "tensor/tensor.h"

namespace porter::nn {

struct ParamSpec {
  std::string name;  // unique within the layer, e.g. "qkv.weight"
  Shape shape;
};

class Layer {
 public:
  virtual ~Layer() = default;

  virtual std::vector<ParamSpec> params() const = 0;
  // Views into the flat buffers, one per params() entry, in that order. The engine keeps the
  // buffers alive for as long as the layer runs.
  virtual void bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
    params_.assign(params.begin(), params.end());
    grads_.assign(grads.begin(), grads.end());
  }
  virtual Tensor forward(Ctx& ctx, const Tensor& x) = 0;
  virtual Tensor backward(Ctx& ctx, const Tensor& dy) = 0;

 protected:
  const Tensor& param(size_t i) const { return params_.at(i); }
  Tensor& grad(size_t i) { return grads_.at(i); }

 private:
  std::vector<Tensor> params_;  // views into the engine's flat parameter buffer
  std::vector<Tensor> grads_;   // views into the engine's flat gradient buffer
};

// The last layer of a chain: its forward returns the loss (1) f32, and its backward ignores dy
// and scales the gradient of the loss by loss_scale() (1 / gradient_accumulation_steps, times
// the fp16 loss scale). The engine sets the micro-batch's targets before every forward and
// recompute of it.
class LossLayer : public Layer {
 public:
  void set_targets(const Tensor& targets) { targets_ = targets; }
  void set_loss_scale(float s) { loss_scale_ = s; }

 protected:
  const Tensor& targets() const { return targets_; }
  float loss_scale() const { return loss_scale_; }

 private:
  Tensor targets_;  // the current micro-batch's input, not saved state
  float loss_scale_ = 1.0f;
};

// Where each parameter lives in the flat buffers. Offsets are in elements; every tensor
// starts at a multiple of kParamAlignElems (64 elements = 256 bytes in f32, 128 in bf16),
// so each view is aligned for vector loads and cuBLAS.
inline constexpr int64_t kParamAlignElems = 64;

struct ParamEntry {
  std::string name;  // "<prefix>.<layer's name>", e.g. "h.3.fc1.weight"
  Shape shape;
  int64_t offset_elems = 0;
};

class ParamLayout {
 public:
  // Appends a layer's params(), each name prefixed by `prefix` ("" for none).
  void add(const std::string& prefix, const std::vector<ParamSpec>& specs);
  const std::vector<ParamEntry>& entries() const { return entries_; }
  int64_t total_elems() const { return total_elems_; }
  // The entry named `name`; throws InvalidArgument naming the close matches otherwise.
  const ParamEntry& find(const std::string& name) const;
  // Sum of the parameters' element counts (without alignment padding).
  int64_t num_params() const;

 private:
  std::vector<ParamEntry> entries_;
  // Name -> entry: binding looks every parameter up by name, and ZeRO rebinds the model
  // whenever a gradient bucket or a stage-3 gather changes a view.
  std::unordered_map<std::string, size_t> index_;
  int64_t total_elems_ = 0;
};

// The flat parameter and gradient buffers of a layout, allocated once (categories params
// and grads). Gradients may use another dtype than parameters (f32 gradients for bf16
// compute).
//
// Note [Gradient views]
// Both buffers hold `padded_elems` >= layout.total_elems() elements (ZeRO pads them, Note
// [Flat partition] in zero/partition.h; the tail is never a parameter). With
// allocate_grads false there is no gradient buffer (ZeRO stage 2 keeps only a shard): every
// entry's gradient view is then whatever set_grad_view gave it, and undefined (a Tensor()
// that any kernel rejects) otherwise. set_grad_view also overrides a view of an allocated
// buffer; clear_grad_view returns entry i to the default. A layer sees a change only when it
// is bound again (Model::bind), so an engine that moves gradient storage rebinds the model.
class FlatParams {
 public:
  FlatParams(memory::CachingAllocator& allocator, const ParamLayout& layout, DType param_dtype,
             DType grad_dtype, int64_t padded_elems = 0, bool allocate_grads = true,
             bool allocate_params = true);
  // (padded_elems), undefined without. Both throw UsageError while the buffers are away.
  const Tensor& params() const {
    if (!away_.empty()) throw_away("FlatParams::params");
    return params_;
  }
  const Tensor& grads() const {
    if (!away_.empty()) throw_away("FlatParams::grads");
    return grads_;
  }
  int64_t padded_elems() const { return padded_elems_; }
  DType param_dtype() const { return param_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }
  // Views of entry i.
  Tensor param(size_t i) const;
  Tensor grad(size_t i) const;
  // Note [Gradient views]: `view` must have entry i's shape, or be undefined (unbound).
  void set_grad_view(size_t i, Tensor view);
  void clear_grad_view(size_t i);
  // The same for parameters: with allocate_params false (ZeRO stage 3 keeps only a shard and
  // gathers each stage's parameters into a buffer of their own) an entry's parameter is
  // whatever set_param_view gave it, undefined otherwise.
  void set_param_view(size_t i, Tensor view);
  void clear_param_view(size_t i);
  const ParamLayout& layout() const { return *layout_; }

  // Moving the buffers to host memory and back (Note [Offloaded model states] in
  // engine/states_offload.cc): for_each_buffer calls `f` on the parameter buffer, then the
  // gradient buffer (defined or not), which it may replace or drop; set_away(why) marks them
  // away (params() and grads() then throw UsageError(why)), set_away("") back. Views taken
  // before (param(i), grad(i), the layers' bindings) keep the old storage: bind again after.
  void for_each_buffer(const std::function<void(Tensor&)>& f);
  void set_away(std::string why) { away_ = std::move(why); }

 private:
  [[noreturn]] void throw_away(const char* what) const;
  const ParamLayout* layout_;  // not owned; outlives this
  DType param_dtype_;
  DType grad_dtype_;
  int64_t padded_elems_ = 0;
  Tensor params_;
  Tensor grads_;
  std::vector<Tensor> grad_views_;   // per entry: the override, when has_view_[i]
  std::vector<bool> has_view_;
  std::vector<Tensor> param_views_;  // per entry: the override, when has_param_view_[i]
  std::vector<bool> has_param_view_;
  std::string away_;  // non-empty: the buffers are in host memory (set_away)
};

// Binds `layer`, whose params() were added to the layout under `prefix`, to views of `flat`.
void bind_layer(Layer& layer, const std::string& prefix, const FlatParams& flat);

// Stage runners: one stage's forward, recompute and backward through ctx, with the stage's
// tape. forward_stage with kCheckpoint keeps what `policy` keeps (Note [Save context]).
Tensor forward_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, SaveMode mode,
                     const Tensor& x, const OpPolicy& policy = OpPolicy::keep_none());
void recompute_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, const Tensor& x);
// Runs backward, then clears the tape.
Tensor backward_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, const Tensor& dy);

}  // namespace porter::nn
