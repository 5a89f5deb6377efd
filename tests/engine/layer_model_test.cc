// Models composed from the layer library (engine::LayerModel, nn/library.h) and fed by
// batches of named tensors (Note [Batch tensors] in io/data.h): an MLP regressor on float
// features and a small attention classifier with int64 labels train (the loss falls) under
// every checkpoint policy, activation and optimizer offload and ZeRO 0-3 on two ranks, bit
// for bit the same; and the batch is checked against the model's spec.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace testing;
using ::testing::HasSubstr;
using json = nlohmann::json;

const json kRegressor = json::parse(R"({
  "stages": [
    {"type": "sequential", "layers": [{"type": "linear", "in": 16, "out": 64}, {"type": "relu"}]},
    {"type": "sequential", "layers": [
      {"type": "residual", "inner": {"type": "sequential", "layers": [
        {"type": "layernorm", "dim": 64}, {"type": "linear", "in": 64, "out": 64},
        {"type": "silu"}, {"type": "linear", "in": 64, "out": 64}]}},
      {"type": "dropout", "p": 0.1}]},
    {"type": "sequential", "layers": [{"type": "rmsnorm", "dim": 64}, {"type": "linear", "in": 64, "out": 1}]}
  ],
  "loss": {"type": "mse"},
  "batch": {"x": {"dtype": "f32", "shape": [16]}, "y": {"dtype": "f32", "shape": [1]}},
  "input": "x", "target": "y"
})");

const json kClassifier = json::parse(R"({
  "stages": [
    {"type": "sequential", "layers": [{"type": "linear", "in": 16, "out": 32}, {"type": "gelu"}]},
    {"type": "attention", "dim": 32, "heads": 4},
    {"type": "mlp", "dim": 32, "hidden": 64},
    {"type": "sequential", "layers": [{"type": "layernorm", "dim": 32}, {"type": "linear", "in": 32, "out": 4}]}
  ],
  "loss": {"type": "cross_entropy"},
  "batch": {"x": {"dtype": "f32", "shape": [8, 16]}, "label": {"dtype": "i32", "shape": [8]}},
  "input": "x", "target": "label"
})");

config::Config layer_config(int world_size, int stage) {
  config::Config c;
  c.world_size = world_size;
  // One micro-batch a step: stage 2 reduces every micro-batch's gradients where stages 0 and 1
  // reduce their sum, so with accumulation the sums' order (and last bits) depend on the stage.
  c.train_micro_batch_size_per_gpu = 8;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 8 * world_size;
  // No clipping: stage 0 takes the global norm over the whole buffer, stages 1-3 sum the
  // shards' (docs/zero.md, "Global norm"), so a clipped step's last bits depend on the stage.
  c.gradient_clipping = 0.0;
  config::OptimizerConfig opt;
  opt.lr = 3e-3;
  opt.weight_decay = 0.01;
  c.optimizer = opt;
  c.porter.train.seed = 3;
  c.porter.comm.timeout_s = 20.0;
  c.zero_optimization.stage = stage;
  c.zero_optimization.reduce_bucket_size_elems = 3000;
  c.zero_optimization.overlap_comm = true;
  return c;
}

// A learnable batch: features from a fixed pattern of (step, rank, micro-batch, element);
// the regressor's target is a fixed smooth function of them, the classifier's label the signs
// of two features (int64, as a data pipeline writes labels).
std::vector<io::HostBatch> layer_batches(bool classifier, int64_t step, int rank, int64_t b,
                                         int64_t accumulation) {
  std::vector<io::HostBatch> out;
  for (int m = 0; m < accumulation; ++m) {
    const int64_t rows = classifier ? b * 8 : b;
    std::vector<float> x(static_cast<size_t>(rows * 16));
    for (size_t i = 0; i < x.size(); ++i) {
      const double u = std::sin(0.37 * static_cast<double>(i) + 1.3 * static_cast<double>(step * 4 + rank * 2 + m));
      x[i] = static_cast<float>(u);
    }
    io::HostBatch mb;
    if (classifier) {
      std::vector<int64_t> label(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        label[static_cast<size_t>(r)] = (x[static_cast<size_t>(r * 16)] > 0 ? 1 : 0) +
                                        (x[static_cast<size_t>(r * 16 + 1)] > 0 ? 2 : 0);
      }
      mb.tensors.push_back(io::HostTensor::of("x", tensor::Shape{b, 8, 16}, std::move(x)));
      mb.tensors.push_back(io::HostTensor::of("label", tensor::Shape{b, 8}, std::move(label)));
    } else {
      std::vector<float> y(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0;
        for (int j = 0; j < 16; ++j) s += (j % 3 - 1) * 0.25 * x[static_cast<size_t>(r * 16 + j)];
        y[static_cast<size_t>(r)] = static_cast<float>(std::tanh(s));
      }
      mb.tensors.push_back(io::HostTensor::of("x", tensor::Shape{b, 16}, std::move(x)));
      mb.tensors.push_back(io::HostTensor::of("y", tensor::Shape{b, 1}, std::move(y)));
    }
    out.push_back(std::move(mb));
  }
  return out;
}

struct LayerRun {
  std::vector<double> losses;
  std::vector<float> params;
};

std::vector<LayerRun> train(bool classifier, const config::Config& c, int steps) {
  std::vector<LayerRun> runs(static_cast<size_t>(c.world_size));
  for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
    Engine e(device, layer_model_from_json(classifier ? kClassifier : kRegressor), c,
             data_parallel(dp));
    LayerRun& r = runs[static_cast<size_t>(rank)];
    for (int s = 0; s < steps; ++s) {
      r.losses.push_back(
          e.train_step(layer_batches(classifier, s, rank, c.train_micro_batch_size_per_gpu,
                                     c.gradient_accumulation_steps))
              .loss);
    }
    r.params = e.params_host();
  });
  return runs;
}

TEST(LayerModel, TrainsBitwiseAcrossPoliciesOffloadAndZeroStagesOnTwoRanks) {
  for (bool classifier : {false, true}) {
    const std::string model = classifier ? "classifier" : "regressor";
    const std::vector<LayerRun> base = train(classifier, layer_config(2, 0), 12);
    for (const LayerRun& r : base) {
      EXPECT_LT(r.losses.back(), 0.7 * r.losses.front()) << model << ": the loss did not fall";
    }
    struct Variant {
      std::string name;
      std::function<void(config::Config&)> set;
    };
    std::vector<Variant> variants = {
        {"full checkpoints", [](config::Config& c) { c.porter.checkpointing.policy = config::CheckpointPolicy::kFull; }},
        {"uniform, every 2", [](config::Config& c) {
           c.porter.checkpointing.policy = config::CheckpointPolicy::kUniform;
           c.porter.checkpointing.every_n_layers = 2;
         }},
        {"optimal at 0.8 of the activations", [](config::Config& c) {
           c.porter.checkpointing.policy = config::CheckpointPolicy::kOptimal;
           c.porter.checkpointing.memory_budget = config::MemoryBudget{0.8};
         }},
        {"full checkpoints offloaded", [](config::Config& c) {
           c.porter.checkpointing.policy = config::CheckpointPolicy::kFull;
           config::ActivationCheckpointingConfig ac;
           ac.cpu_checkpointing = true;
           c.activation_checkpointing = ac;
         }},
        {"ZeRO-1", [](config::Config& c) { c.zero_optimization.stage = 1; }},
        {"ZeRO-2", [](config::Config& c) { c.zero_optimization.stage = 2; }},
        {"ZeRO-3", [](config::Config& c) { c.zero_optimization.stage = 3; }},
        {"ZeRO-2, optimizer offload", [](config::Config& c) {
           c.zero_optimization.stage = 2;
           c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
         }},
    };
    if (classifier) {  // only the classifier has attention to recompute
      variants.push_back({"selective", [](config::Config& c) {
                            c.porter.checkpointing.policy = config::CheckpointPolicy::kSelective;
                          }});
    }
    for (const Variant& v : variants) {
      config::Config c = layer_config(2, 0);
      v.set(c);
      const std::vector<LayerRun> got = train(classifier, c, 12);
      for (size_t r = 0; r < got.size(); ++r) {
        EXPECT_EQ(got[r].losses, base[r].losses) << model << ", " << v.name << ", rank " << r;
        EXPECT_TRUE(bitwise_equal(got[r].params, base[r].params)) << model << ", " << v.name;
      }
    }
  }
}

TEST(LayerModel, StepApiGivesTrainStepsBits) {
  config::Config c = layer_config(1, 0);
  c.gradient_accumulation_steps = 2;
  c.train_batch_size = 16;
  c.gradient_clipping = 1.0;
  auto d1 = cpu_device();
  auto d2 = cpu_device();
  Engine a(*d1, layer_model_from_json(kRegressor), c);
  Engine b(*d2, layer_model_from_json(kRegressor), c);
  for (int s = 0; s < 3; ++s) {
    const std::vector<io::HostBatch> mbs = layer_batches(false, s, 0, 8, 2);
    const double la = a.train_step(mbs).loss;
    std::optional<StepResult> rb;
    for (const io::HostBatch& mb : mbs) {
      (void)b.forward(mb, /*keep_output=*/true);
      EXPECT_EQ(b.output().shape, (tensor::Shape{8, 1}));
      b.backward();
      rb = b.optimizer_step();
    }
    ASSERT_TRUE(rb.has_value());
    EXPECT_EQ(la, rb->loss);
  }
  EXPECT_TRUE(bitwise_equal(a.params_host(), b.params_host()));
}

TEST(LayerModel, BatchesAreCheckedAgainstTheModelsTensors) {
  config::Config c = layer_config(1, 0);
  c.gradient_accumulation_steps = 2;
  c.train_batch_size = 16;
  auto d = cpu_device();
  Engine e(*d, layer_model_from_json(kRegressor), c);
  std::vector<io::HostBatch> mbs = layer_batches(false, 0, 0, 8, 2);
  std::vector<io::HostBatch> missing = mbs;
  missing[1].tensors.pop_back();
  EXPECT_THAT(error_of<InvalidArgument>([&] { (void)e.train_step(missing); }),
              HasSubstr("micro-batch 1 has no tensor \"y\""));
  std::vector<io::HostBatch> shape = mbs;
  shape[0].tensors[0] = io::HostTensor::of("x", tensor::Shape{8, 15}, std::vector<float>(8 * 15));
  EXPECT_THAT(error_of<InvalidArgument>([&] { (void)e.train_step(shape); }),
              HasSubstr("tensor \"x\" is (8, 15); the model takes (8, 16)"));
  std::vector<io::HostBatch> dtype = mbs;
  dtype[0].tensors[1] = io::HostTensor::of("y", tensor::Shape{8, 1}, std::vector<int32_t>(8));
  EXPECT_THAT(error_of<InvalidArgument>([&] { (void)e.train_step(dtype); }),
              HasSubstr("tensor \"y\" is i32; the model takes f32"));
  EXPECT_GT(e.train_step(mbs).loss, 0.0);  // nothing changed by the rejected steps
  EXPECT_THAT(error_of<InvalidArgument>([&] {
                json bad = kRegressor;
                bad["input"] = "features";
                (void)layer_model_from_json(bad);
              }),
              HasSubstr("the input \"features\" is not one of the batch's tensors"));
  EXPECT_THAT(error_of<InvalidArgument>([&] {
                json bad = kRegressor;
                bad["batch"]["x"]["dtype"] = "f64";
                (void)layer_model_from_json(bad);
              }),
              HasSubstr("model.batch.x.dtype is \"f64\""));
}

}  // namespace
}  // namespace porter::engine
