// What the Engine trains: a chain of stages (nn::Layer) whose last stage computes the loss.
// The built-in architectures are one (TransformerModel, built by models::build_model); any
// chain of user layers ending in a LossLayer is another (ChainModel). See docs/engine.md.
//
// Note [Model capabilities]
// What only some models can do is an optional method with a default, never a type test: the
// Engine asks every model the same questions and a user's model answers them too.
//   check_config    the model is the one the config describes (the transformer's shape must
//                   be porter.model, which the plan, estimate and checkpoints describe).
//   analytic_costs  exact per-stage bytes and FLOPs without running anything (the
//                   transformer's analytic model, models/analytic.h); the Engine plans from them where no times are needed
//                   (Note [Engine costs] in run_options.h) and takes the FLOPs from them
//                   after a profile. Default: none, so the chain is profiled.
//   vocab_size      token ids and targets must lie in [0, vocab); default: no check.
//   batch_spec      the tensors of a micro-batch, by name (Note [Batch tensors] in
//                   io/data.h), checked before every step; input_name and target_name say
//                   which is the first stage's input and which the loss stage's targets.
//                   Default: a token batch, "tokens" and "targets" (micro_batch, seq_len) i32.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <span>
#include <vector>

#include "checkpoint/costs.h"
#include "config/config.h"
#include "engine/run_options.h"
#include "models/factory.h"
#include "nn/layer.h"
#include "nn/library.h"

namespace porter::engine {

// One tensor of every micro-batch (Note [Batch tensors] in io/data.h): its name, dtype and
// shape (the micro-batch's, leading dimension first).
struct BatchField {
  std::string name;
  tensor::DType dtype = tensor::DType::kF32;
  tensor::Shape shape;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual int num_stages() const = 0;
  virtual nn::Layer& stage(int i) = 0;
  virtual std::string stage_name(int i) const = 0;
  // Whether stage i is a repeated layer (uniform and block policies count these).
  virtual bool is_block(int i) const = 0;
  virtual const nn::ParamLayout& layout() const = 0;
  // Binds every stage to views of the flat buffers (laid out by layout()).
  virtual void bind(const nn::FlatParams& flat) = 0;
  // Initial parameter values in layout order (padding zero).
  virtual std::vector<float> init_values(uint64_t seed) const = 0;
  // Elements [begin, begin + out.size()) of init_values(seed), 0 past the layout. The engine
  // initialises through it (set_params_host_range), so a model that computes a range without
  // the whole (the built-in transformer) never holds the whole model in host memory; the
  // default computes init_values and copies the range.
  virtual void init_values_range(uint64_t seed, int64_t begin, std::span<float> out) const;
  // The micro-batch's targets, for the loss stage; called before every forward of it.
  virtual void set_targets(const tensor::Tensor& targets) = 0;
  // The gradient scale of the loss stage (1 / gradient_accumulation_steps, times the fp16
  // loss scale).
  virtual void set_loss_scale(float scale) = 0;
  // The stages whose backward writes into stage i's parameter gradients: i itself, plus any
  // other (Note [Gradient buckets] in zero/buckets.h). ZeRO-2 needs it to know when a bucket
  // is complete. TransformerModel with tied embeddings reports the head as a writer of stage 0's.
  virtual std::vector<int> grad_writers(int i) const { return {i}; }

  // Note [Model capabilities]. check_config throws InvalidArgument naming the mismatch.
  virtual void check_config(const config::Config& /*config*/) const {}
  virtual std::optional<checkpoint::ChainCosts> analytic_costs(const RunOptions& /*run*/) const {
    return std::nullopt;
  }
  virtual std::optional<int64_t> vocab_size() const { return std::nullopt; }
  virtual std::vector<BatchField> batch_spec(const RunOptions& run) const;
  virtual std::string input_name() const { return "tokens"; }
  virtual std::string target_name() const { return "targets"; }
  // Under tensor parallelism (Note [GPT tensor parallelism] in models/transformer.h): per layout entry,
  // whether the parameter is the same on every rank of the tp group (the global gradient
  // norm counts those once). Empty: the model is not split.
  virtual std::vector<bool> tp_replicated() const { return {}; }
};

class TransformerModel : public Model {
 public:
  // Rank tp_rank's part of the model under porter.model.tensor_parallel (0 for one rank),
  // built by the factory (models::build_model) for porter.model.arch.
  explicit TransformerModel(const config::ModelConfig& config, int tp_rank = 0)
      : model_(models::build_model(config, tp_rank)) {}
  int num_stages() const override { return model_->num_stages(); }
  nn::Layer& stage(int i) override { return model_->stage(i); }
  std::string stage_name(int i) const override { return model_->stage_name(i); }
  bool is_block(int i) const override { return i > 0 && i < model_->num_stages() - 1; }
  const nn::ParamLayout& layout() const override { return model_->layout(); }
  void bind(const nn::FlatParams& flat) override { model_->bind(flat); }
  std::vector<float> init_values(uint64_t seed) const override {
    return model_->init_values(seed);
  }
  void init_values_range(uint64_t seed, int64_t begin, std::span<float> out) const override {
    model_->init_values_range(seed, begin, out);
  }
  void set_targets(const tensor::Tensor& targets) override { model_->head().set_targets(targets); }
  void set_loss_scale(float scale) override { model_->head().set_loss_scale(scale); }
  std::vector<int> grad_writers(int i) const override {
    if (i == 0 && model_->config().tie_embeddings) return {0, model_->num_stages() - 1};
    return {i};
  }
  void check_config(const config::Config& config) const override;
  std::optional<checkpoint::ChainCosts> analytic_costs(const RunOptions& run) const override;
  std::optional<int64_t> vocab_size() const override { return model_->config().vocab; }
  std::vector<bool> tp_replicated() const override;
  models::Transformer& transformer() { return *model_; }

 private:
  std::unique_ptr<models::Transformer> model_;
};

// The last stage of a user chain (nn/layer.h).
using LossLayer = nn::LossLayer;

// A chain of user layers: stage i is layers[i], the last one a LossLayer. Parameter names
// are prefixed "<i>." (e.g. "0.fc1.weight"). Every stage counts as a block. `init` gives
// one parameter's initial values.
class ChainModel : public Model {
 public:
  using Init = std::function<std::vector<float>(int stage, const nn::ParamSpec& spec,
                                                uint64_t seed)>;
  ChainModel(std::vector<std::unique_ptr<nn::Layer>> layers, std::unique_ptr<LossLayer> loss,
             Init init = default_init);
  // normal(0, 0.02) from Philox keyed by (seed, stage, name) for tensors of rank >= 2 and
  // names ending in "weight"; 1 for names containing "norm" or "scale"; 0 otherwise.
  static std::vector<float> default_init(int stage, const nn::ParamSpec& spec, uint64_t seed);

  int num_stages() const override { return static_cast<int>(stages_.size()); }
  nn::Layer& stage(int i) override { return *stages_.at(static_cast<size_t>(i)); }
  std::string stage_name(int i) const override;
  bool is_block(int) const override { return true; }
  const nn::ParamLayout& layout() const override { return layout_; }
  void bind(const nn::FlatParams& flat) override;
  std::vector<float> init_values(uint64_t seed) const override;
  void set_targets(const tensor::Tensor& targets) override { loss_->set_targets(targets); }
  void set_loss_scale(float scale) override { loss_->set_loss_scale(scale); }

 private:
  std::vector<std::unique_ptr<nn::Layer>> stages_;  // the layers, then the loss
  LossLayer* loss_;                                 // owned by stages_
  nn::ParamLayout layout_;
  Init init_;
};

// A model composed from the layer library (nn/library.h, docs/layers.md), fed by a batch of
// named tensors (Note [Batch tensors] in io/data.h): each stage an nn::Module (a Sequential
// of layers, usually), then a loss. Its backward is the modules' own: nothing is
// hand-written, and every checkpoint policy, offload, ZeRO stage and the planner apply
// (profiled costs, as for any ChainModel). Parameters are "<stage>.<module's name>",
// initialised by each module's init_param. `batch` gives each tensor's dtype and its shape
// per sample: the micro-batch's is (train_micro_batch_size_per_gpu, shape...). `input` names
// the first stage's input and `target` the loss's targets.
class LayerModel : public ChainModel {
 public:
  LayerModel(std::vector<std::unique_ptr<nn::Module>> stages, std::unique_ptr<nn::LossLayer> loss,
             std::vector<BatchField> batch, std::string input, std::string target);
  std::vector<BatchField> batch_spec(const RunOptions& run) const override;
  std::string input_name() const override { return input_; }
  std::string target_name() const override { return target_; }

 private:
  struct Parts {
    std::vector<std::unique_ptr<nn::Layer>> layers;
    Init init;  // each stage's module's init_param
  };
  static Parts parts(std::vector<std::unique_ptr<nn::Module>>& stages);
  LayerModel(Parts parts, std::unique_ptr<nn::LossLayer> loss, std::vector<BatchField> batch,
             std::string input, std::string target);

  std::vector<BatchField> batch_;  // per-sample shapes
  std::string input_;
  std::string target_;
};

// The JSON form (docs/layers.md, "A model from JSON"), as the Python module passes it:
//   {"stages": [<module>, ...], "loss": <loss>,
//    "batch": {"x": {"dtype": "f32", "shape": [16]}, "y": {"dtype": "f32", "shape": [1]}},
//    "input": "x", "target": "y"}
// with modules and losses as nn::module_from_json and nn::loss_from_json read them. Throws
// InvalidArgument naming the key for anything missing, mistyped or unknown.
std::unique_ptr<LayerModel> layer_model_from_json(const nlohmann::json& spec);

}  // namespace porter::engine
