// porter.Engine: the Engine (engine/engine.h) on the config's device, training the built-in
// model, a Hugging Face checkpoint's or one composed from the layer library (porter.LayerModel),
// from NumPy micro-batches (Note [NumPy batches] in batch.cc), with train_step or DeepSpeed's
// step API; and porter.init_distributed, the process groups of a launched world.
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "base/error.h"
#include "engine/distributed.h"
#include "engine/engine.h"
#include "engine/forecast.h"
#include "engine/model.h"
#include "engine/run_options.h"
#include "engine/whole_params.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"
#include "memory/category.h"
#include "memory/device.h"
#include "models/factory.h"
#include "python/bindings.h"

namespace porter::python {
namespace {

using Json = nlohmann::ordered_json;

// porter.LayerModel: a model spec of the layer library (engine::layer_model_from_json), checked
// when it is made; every Engine builds its own model from it.
struct PyLayerModel {
  nlohmann::json spec;
};

// porter.init_distributed's result: the device the engine of this rank runs on and the
// process groups (Note [Joining the world] in engine/distributed.h).
struct PyDistributed {
  std::shared_ptr<memory::Device> device;
  Distributed dist;
};

// What porter.Engine's `model` names.
struct ModelChoice {
  std::optional<std::string> hf_dir;      // a Hugging Face model directory
  std::optional<nlohmann::json> layers;   // a layer-library spec
};

class PyEngine {
 public:
  PyEngine(const PyConfig& config, const ModelChoice& model,
           const std::shared_ptr<PyDistributed>& dist)
      : dist_(dist) {
    config::Config cfg = config.config;
    if (model.hf_dir) {
      // As porter.model.from does (Note [Config from a Hugging Face model] in cli/common.cc):
      // config.json gives the model's shape, the config its training keys.
      cfg.porter.model = io::hf_model_config(io::read_hf_config(*model.hf_dir), cfg.porter.model);
    }
    // As `porter train` builds its device and engine (cli/train_command.cc); a distributed
    // run's device is the one its communicators were built on.
    device_ = dist ? dist->device : std::shared_ptr<memory::Device>(
                                        memory::make_device(engine::make_run_options(cfg).device));
    const comm::ProcessGroups groups = dist ? dist->dist.groups : comm::ProcessGroups{};
    if (model.layers) {
      engine_ = std::make_unique<engine::Engine>(
          *device_, engine::layer_model_from_json(*model.layers), cfg, groups);
      return;
    }
    engine::ForecastOptions fo;  // Note [Attention choice]: before the model is built
    fo.capacity_bytes = device_->memory_capacity_bytes();
    fo.device = engine::nominal_cpu_device_model(*fo.capacity_bytes);
    fo.time_host_update = false;
    cfg = engine::resolve_model_choices(cfg, fo);
    engine_ = std::make_unique<engine::Engine>(
        *device_, std::make_unique<engine::TransformerModel>(cfg.porter.model, groups.tp_rank),
        cfg, groups);
    transformer_ = true;
    if (cfg.porter.model.from) {
      const std::string dir = *cfg.porter.model.from;
      const std::unique_ptr<models::Transformer> part =
          models::build_model(cfg.porter.model, groups.tp_rank);
      engine_->set_params_host_range([&](int64_t begin, std::span<float> values) {
        io::read_hf_weights_part(dir, *part, begin, values);
      });
      hf_source_ = io::read_hf_config(dir).json;
    }
  }

  // The engine may drop views of NumPy arrays on its own threads, whose owners take the GIL
  // (Note [NumPy batches] in batch.cc): it is torn down without holding it.
  ~PyEngine() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      engine_.reset();
    }
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  engine::Engine& engine() { return *engine_; }

  // Every rank calls it (the tensor-parallel parts are gathered); rank 0 writes.
  void save_hf(const std::filesystem::path& dir) {
    if (!transformer_) {
      throw UsageError("save_hf: only the built-in models have a Hugging Face layout; save a "
                       "layer-library model with save(dir)");
    }
    const std::vector<float> whole =
        engine::whole_params_host(*engine_, dist_ ? dist_->dist.groups.tp.get() : nullptr);
    if (engine_->world_rank() != 0) return;
    config::ModelConfig model = engine_->config().porter.model;
    model.tensor_parallel = 1;
    model.sequence_parallel = false;
    io::write_hf_checkpoint(dir, model, models::build_model(model)->layout(), whole,
                            engine_->compute_dtype(), hf_source_);
  }

 private:
  std::shared_ptr<PyDistributed> dist_;             // the process groups' communicators
  std::shared_ptr<memory::Device> device_;          // outlives the engine
  std::unique_ptr<engine::Engine> engine_;
  bool transformer_ = false;  // the built-in model (save_hf)
  nlohmann::json hf_source_;  // the config.json save_hf carries token ids over from
};

Json stash_json(const offload::StashStats& s) {
  return {{"d2h_bytes", s.d2h_bytes},
          {"h2d_bytes", s.h2d_bytes},
          {"copy_busy_s", s.copy_busy_s},
          {"exposed_wait_s", s.exposed_wait_s},
          {"hidden_fraction", s.hidden_fraction()},
          {"pinned_peak_bytes", s.pinned_peak_bytes},
          {"staging_peak_bytes", s.staging_peak_bytes}};
}

Json host_state_json(const zero::HostStateBytes& b) {
  return {{"optimizer", b.optimizer}, {"grads", b.grads}, {"params", b.params},
          {"total", b.total()}};
}

Json step_json(const engine::StepResult& r) {
  return {{"step", r.step},
          {"loss", r.loss},
          {"grad_norm", r.grad_norm},
          {"clip_coef", r.clip_coef},
          {"lr", r.lr},
          {"time_s", r.time_s},
          {"recompute_s", r.recompute_s},
          {"tokens", r.tokens},
          {"peak_activation_bytes", r.peak_activation_bytes},
          {"peak_bytes", r.peak_bytes},
          {"skipped", r.skipped},
          {"loss_scale", r.zero.loss_scale},
          {"offload", stash_json(r.offload)}};
}

Json memory_json(const engine::MemoryReport& m) {
  Json peak = Json::object(), current = Json::object();
  for (memory::Category c : memory::kAllCategories) {
    const std::string name(memory::category_name(c));
    peak[name] = m.peak_by_category[memory::index_of(c)];
    current[name] = m.current_by_category[memory::index_of(c)];
  }
  return {{"capacity_bytes", m.capacity_bytes},
          {"peak_bytes", m.peak_bytes},
          {"peak_by_category", peak},
          {"current_by_category", current},
          {"peak_activation_bytes", m.peak_activation_bytes},
          {"predicted_activation_bytes", m.predicted_activation_bytes},
          {"model_state_bytes", m.model_state_bytes},
          {"predicted_peak_bytes", m.predicted_peak_bytes},
          {"predicted_recompute_s", m.predicted_recompute_s},
          {"measured_recompute_s", m.measured_recompute_s},
          {"peak_pinned_bytes", m.peak_pinned_bytes},
          {"pinned_limit_bytes", m.pinned_limit_bytes},
          {"predicted_pinned_bytes", m.predicted_pinned_bytes},
          {"offloaded_bytes", m.offloaded_bytes},
          {"offload", stash_json(m.offload)},
          {"predicted_host_state", host_state_json(m.predicted_host_state)},
          {"host_state", host_state_json(m.host_state)},
          {"pinned_in_use_bytes", m.pinned_in_use_bytes},
          {"table", m.format()}};
}

// A float32 array that owns `values`.
py::array_t<float> to_numpy(std::vector<float> values) {
  auto* held = new std::vector<float>(std::move(values));
  py::capsule owner(held, [](void* p) { delete static_cast<std::vector<float>*>(p); });
  return py::array_t<float>({static_cast<py::ssize_t>(held->size())}, {sizeof(float)},
                            held->data(), owner);
}

PyConfig as_config(py::handle config) {
  if (py::isinstance<PyConfig>(config)) return config.cast<PyConfig>();
  return py::module_::import("porter._porter").attr("Config")(config).cast<PyConfig>();
}

std::string type_name(py::handle v) {
  return py::str(v.get_type().attr("__name__")).cast<std::string>();
}

ModelChoice model_choice(py::handle model) {
  ModelChoice c;
  if (model.is_none()) return c;
  if (py::isinstance<PyLayerModel>(model)) {
    c.layers = model.cast<const PyLayerModel&>().spec;
  } else if (py::isinstance<py::dict>(model)) {
    c.layers = nlohmann::json(to_json(model, "model"));
  } else if (py::isinstance<py::str>(model) ||
             py::isinstance(model, py::module_::import("os").attr("PathLike"))) {
    c.hf_dir = py::str(model).cast<std::string>();
  } else {
    throw InvalidArgument(
        "porter.Engine: model must be None (the config's porter.model), a Hugging Face model "
        "directory, a porter.LayerModel or its spec as a dict, got a " + type_name(model));
  }
  return c;
}

// A copy of a host tensor as an array of its shape (f32, i32, i64, bool; bf16 as uint16 bits).
py::array host_tensor_to_numpy(const io::HostTensor& t) {
  std::string dtype;
  switch (t.dtype) {
    case tensor::DType::kF32: dtype = "float32"; break;
    case tensor::DType::kI32: dtype = "int32"; break;
    case tensor::DType::kI64: dtype = "int64"; break;
    case tensor::DType::kBool: dtype = "bool"; break;
    case tensor::DType::kBF16:
    case tensor::DType::kF16: dtype = "uint16"; break;
  }
  std::vector<py::ssize_t> shape;
  for (int64_t d : t.shape.to_vector()) shape.push_back(static_cast<py::ssize_t>(d));
  py::array a(py::dtype(dtype), shape);
  std::memcpy(a.mutable_data(), t.data, t.nbytes());
  return a;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<PyEngine>(m, "Engine",
                       "Trains a model on one device under the config's memory plan "
                       "(porter::engine::Engine).")
      .def(py::init([](py::handle config, py::handle model,
                       std::shared_ptr<PyDistributed> distributed) {
             const ModelChoice choice = model_choice(model);
             const PyConfig c = as_config(config);
             py::gil_scoped_release release;
             return std::make_unique<PyEngine>(c, choice, distributed);
           }),
           py::arg("config"), py::arg("model") = py::none(), py::kw_only(),
           py::arg("distributed") = py::none(),
           "config: a porter.Config or a dict. model: None for the config's porter.model (with "
           "its weights when porter.model.from names a Hugging Face directory), a Hugging "
           "Face model directory whose config.json gives the model and whose safetensors its "
           "weights, or a porter.LayerModel (or its spec as a dict). distributed: "
           "porter.init_distributed()'s result, for one rank of a launched world.")
      .def(
          "train_step",
          [](PyEngine& e, py::handle batches) {
            const std::vector<io::HostBatch> b = to_host_batches(batches);
            engine::StepResult r;
            {
              py::gil_scoped_release release;
              r = e.engine().train_step(b);
            }
            return to_python(step_json(r));
          },
          py::arg("batches"),
          "One optimizer step over gradient_accumulation_steps micro-batches (a list of dicts "
          "name -> array; one dict when there is one). Returns the step's figures as a dict.")
      .def(
          "evaluate",
          [](PyEngine& e, py::handle batches) {
            const std::vector<io::HostBatch> b = to_host_batches(batches);
            py::gil_scoped_release release;
            return e.engine().evaluate(b);
          },
          py::arg("batches"), "The mean loss of the micro-batches, forward only.")
      .def(
          "memory_report",
          [](PyEngine& e) { return to_python(memory_json(e.engine().memory_report())); },
          "The memory report (per-category peaks, predictions) as a dict.")
      .def("reset_peaks", [](PyEngine& e) { e.engine().reset_peaks(); })
      .def(
          "save",
          [](PyEngine& e, const std::filesystem::path& dir) {
            py::gil_scoped_release release;
            e.engine().save_checkpoint(dir);
          },
          py::arg("dir"), "Writes a training checkpoint (porter's format) to dir.")
      .def(
          "load",
          [](PyEngine& e, const std::filesystem::path& dir) {
            py::gil_scoped_release release;
            e.engine().load_checkpoint(dir);
          },
          py::arg("dir"),
          "Resumes from a training checkpoint; training then continues bit for bit.")
      .def(
          "save_hf",
          [](PyEngine& e, const std::filesystem::path& dir) {
            py::gil_scoped_release release;
            e.save_hf(dir);
          },
          py::arg("dir"), "Writes the model in Hugging Face's layout (config.json, model.safetensors).")
      .def(
          "forward",
          [](PyEngine& e, py::handle batch, bool keep_output) {
            const io::HostBatch b = to_host_batch(batch, "batch");
            py::gil_scoped_release release;
            return e.engine().forward(b, keep_output);
          },
          py::arg("batch"), py::arg("keep_output") = false,
          "DeepSpeed's engine(batch): runs one micro-batch's forward and returns its loss. "
          "keep_output keeps the model's outputs for output().")
      .def(
          "backward",
          [](PyEngine& e) {
            py::gil_scoped_release release;
            e.engine().backward();
          },
          "The backward of the last forward, its gradients accumulated (and reduced).")
      .def(
          "step",
          [](PyEngine& e) -> py::object {
            std::optional<engine::StepResult> r;
            {
              py::gil_scoped_release release;
              r = e.engine().optimizer_step();
            }
            if (!r) return py::none();
            return to_python(step_json(*r));
          },
          "DeepSpeed's engine.step(): at the accumulation boundary the optimizer update, "
          "returning the step's figures as a dict; before it nothing, returning None.")
      .def("is_gradient_accumulation_boundary",
           [](PyEngine& e) { return e.engine().is_gradient_accumulation_boundary(); })
      .def(
          "output", [](PyEngine& e) { return host_tensor_to_numpy(e.engine().output()); },
          "The model's outputs of the last forward(batch, keep_output=True), a copy.")
      .def_property_readonly("global_steps", [](PyEngine& e) { return e.engine().step(); },
                             "Optimizer steps completed.")
      .def(
          "params",
          [](PyEngine& e) {
            std::vector<float> v;
            {
              py::gil_scoped_release release;
              v = e.engine().params_host();
            }
            return to_numpy(std::move(v));
          },
          "The working parameters as float32, in layout order (a copy).")
      .def("config", [](PyEngine& e) { return to_python(config::to_json(e.engine().config())); },
           "The config the engine runs, with porter's choices resolved, as a dict.")
      .def("plan_description", [](PyEngine& e) { return e.engine().plan().description; },
           "The checkpoint plan, in one line.")
      .def_property_readonly("rank", [](PyEngine& e) { return e.engine().world_rank(); })
      .def_property_readonly("world_size",
                             [](PyEngine& e) { return e.engine().config().world_size; });

  py::class_<PyLayerModel>(m, "LayerModel",
                           "A model composed from the layer library (docs/layers.md), for "
                           "porter.Engine(config, model=...).")
      .def(py::init([](py::dict spec) {
             PyLayerModel l{nlohmann::json(to_json(spec, "model"))};
             engine::layer_model_from_json(l.spec);  // its errors now, not at the Engine
             return l;
           }),
           py::arg("spec"),
           "spec: {\"stages\": [module, ...], \"loss\": loss, \"batch\": {name: {\"dtype\", "
           "\"shape\" (per sample)}}, \"input\": name, \"target\": name}.")
      .def("to_dict", [](const PyLayerModel& l) { return to_python(l.spec); });

  py::class_<PyDistributed, std::shared_ptr<PyDistributed>>(
      m, "Distributed", "This process's place in a launched world and its process groups.")
      .def_property_readonly("rank", [](const PyDistributed& d) { return d.dist.rank(); })
      .def_property_readonly("world_size",
                             [](const PyDistributed& d) { return d.dist.world_size(); })
      .def_property_readonly("local_rank",
                             [](const PyDistributed& d) { return d.dist.env.local_rank; })
      .def_property_readonly("dp_rank", [](const PyDistributed& d) { return d.dist.groups.dp_rank; })
      .def_property_readonly("dp_size", [](const PyDistributed& d) { return d.dist.groups.dp_size; })
      .def_property_readonly("tp_rank", [](const PyDistributed& d) { return d.dist.groups.tp_rank; })
      .def_property_readonly("tp_size", [](const PyDistributed& d) { return d.dist.groups.tp_size; })
      .def_property_readonly("distributed",
                             [](const PyDistributed& d) { return d.dist.distributed(); })
      .def_property_readonly("source", [](const PyDistributed& d) { return d.dist.env.source; })
      .def("__repr__", [](const PyDistributed& d) {
        return "porter.Distributed(rank " + std::to_string(d.dist.rank()) + " of " +
               std::to_string(d.dist.world_size()) + ")";
      });

  m.def(
      "init_distributed",
      [](py::handle config) {
        const PyConfig c = as_config(config);
        auto d = std::make_shared<PyDistributed>();
        py::gil_scoped_release release;
        d->device = memory::make_device(engine::make_run_options(c.config).device);
        d->dist = porter::init_distributed(*d->device, c.config);
        return d;
      },
      py::arg("config"),
      "Joins the world a launcher started (porter launch, torchrun, mpirun, srun) on the "
      "config's device, with its tensor_parallel and timeout; one process without a launcher "
      "is a world of one. Pass the result to porter.Engine(..., distributed=...).");
}

}  // namespace porter::python
