// Flat parameter layout, buffers and the stage runners of the layer contract.
#include "nn/layer.h"

#include <algorithm>

#include "base/check.h"
#include "base/error.h"

namespace porter::nn {

void ParamLayout::add(const std::string& prefix, const std::vector<ParamSpec>& specs) {
  for (const ParamSpec& s : specs) {
    std::string name = prefix.empty() ? s.name : prefix + "." + s.name;
    PORTER_CHECK(index_.emplace(name, entries_.size()).second, "parameter '", name,
                 "' declared twice");
    entries_.push_back({name, s.shape, total_elems_});
    int64_t n = s.shape.numel();
    total_elems_ += (n + kParamAlignElems - 1) / kParamAlignElems * kParamAlignElems;
  }
}

const ParamEntry& ParamLayout::find(const std::string& name) const {
  if (const auto it = index_.find(name); it != index_.end()) return entries_[it->second];
  std::string near;
  for (const ParamEntry& e : entries_) {
    if (e.name.find(name) != std::string::npos || name.find(e.name) != std::string::npos)
      near += (near.empty() ? "" : ", ") + e.name;
  }
  throw InvalidArgument("no parameter named '" + name + "' in the layout" +
                        (near.empty() ? "" : " (similar: " + near + ")"));
}

int64_t ParamLayout::num_params() const {
  int64_t n = 0;
  for (const ParamEntry& e : entries_) n += e.shape.numel();
  return n;
}

FlatParams::FlatParams(memory::CachingAllocator& allocator, const ParamLayout& layout,
                       DType param_dtype, DType grad_dtype, int64_t padded_elems,
                       bool allocate_grads, bool allocate_params)
    : layout_(&layout), param_dtype_(param_dtype), grad_dtype_(grad_dtype) {
  padded_elems_ = std::max(padded_elems, layout.total_elems());
  if (allocate_params) {
    params_ = Tensor::empty(allocator, Shape{padded_elems_}, param_dtype, memory::Category::kParams);
  }
  if (allocate_grads) {
    grads_ = Tensor::empty(allocator, Shape{padded_elems_}, grad_dtype, memory::Category::kGrads);
  }
  grad_views_.resize(layout.entries().size());
  has_view_.assign(layout.entries().size(), false);
  param_views_.resize(layout.entries().size());
  has_param_view_.assign(layout.entries().size(), false);
}

Tensor FlatParams::param(size_t i) const {
  const ParamEntry& e = layout_->entries().at(i);
  if (has_param_view_.at(i)) return param_views_[i];
  if (!params_.defined()) return Tensor();
  return params_.slice(e.offset_elems, e.offset_elems + e.shape.numel()).reshape(e.shape);
}

void FlatParams::set_param_view(size_t i, Tensor view) {
  const ParamEntry& e = layout_->entries().at(i);
  PORTER_CHECK(!view.defined() || (view.shape() == e.shape && view.dtype() == param_dtype_),
               "set_param_view: parameter '", e.name, "' is ", e.shape.to_string(),
               ", the view ", view.shape().to_string());
  param_views_[i] = std::move(view);
  has_param_view_[i] = true;
}

void FlatParams::clear_param_view(size_t i) {
  param_views_.at(i) = Tensor();
  has_param_view_[i] = false;
}

Tensor FlatParams::grad(size_t i) const {
  const ParamEntry& e = layout_->entries().at(i);
  if (has_view_.at(i)) return grad_views_[i];
  if (!grads_.defined() || grads_.numel() == 0) return Tensor();
  return grads_.slice(e.offset_elems, e.offset_elems + e.shape.numel()).reshape(e.shape);
}

void FlatParams::set_grad_view(size_t i, Tensor view) {
  const ParamEntry& e = layout_->entries().at(i);
  PORTER_CHECK(!view.defined() || (view.shape() == e.shape && view.dtype() == grad_dtype_),
               "set_grad_view: parameter '", e.name, "' is ", e.shape.to_string(),
               ", the view ", view.shape().to_string());
  grad_views_[i] = std::move(view);
  has_view_[i] = true;
}

void FlatParams::clear_grad_view(size_t i) {
  grad_views_.at(i) = Tensor();
  has_view_[i] = false;
}

void FlatParams::for_each_buffer(const std::function<void(Tensor&)>& f) {
  f(params_);
  f(grads_);
}

void FlatParams::throw_away(const char* what) const {
  throw UsageError(std::string(what) + ": " + away_);
}

void bind_layer(Layer& layer, const std::string& prefix, const FlatParams& flat) {
  std::vector<Tensor> p, g;
  const auto& entries = flat.layout().entries();
  for (const ParamSpec& s : layer.params()) {
    std::string name = prefix.empty() ? s.name : prefix + "." + s.name;
    const ParamEntry& e = flat.layout().find(name);
    PORTER_CHECK(e.shape == s.shape, "parameter '", name, "' is ", s.shape.to_string(),
                 " but the layout has ", e.shape.to_string());
    size_t i = static_cast<size_t>(&e - entries.data());
    p.push_back(flat.param(i));
    g.push_back(flat.grad(i));
  }
  layer.bind(p, g);
}

Tensor forward_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, SaveMode mode,
                     const Tensor& x, const OpPolicy& policy) {
  PORTER_CHECK(mode == SaveMode::kSaveAll || mode == SaveMode::kCheckpoint,
               "forward_stage runs kSaveAll or kCheckpoint, not ", save_mode_name(mode));
  ctx.begin(stage, tape, mode, policy);
  try {
    Tensor y = layer.forward(ctx, x);
    ctx.end();
    return y;
  } catch (...) {
    ctx.abort();
    throw;
  }
}

void recompute_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, const Tensor& x) {
  ctx.begin(stage, tape, SaveMode::kRecompute);
  try {
    layer.forward(ctx, x);  // its output is the next stage's input, which the engine has
    ctx.end();
  } catch (...) {
    ctx.abort();
    throw;
  }
}

Tensor backward_stage(Ctx& ctx, Layer& layer, int stage, Tape& tape, const Tensor& dy) {
  ctx.begin(stage, tape, SaveMode::kBackward);
  try {
    Tensor dx = layer.backward(ctx, dy);
    ctx.end();
    tape.clear();
    return dx;
  } catch (...) {
    ctx.abort();
    throw;
  }
}

}  // namespace porter::nn
