// porter.Engine: the Engine (engine/engine.h) on the config's device, training the built-in
// model or a Hugging Face checkpoint's, from NumPy micro-batches (Note [NumPy batches] in
// batch.cc). One rank: the process groups of a distributed run are not bound.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "base/error.h"
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

class PyEngine {
 public:
  PyEngine(const PyConfig& config, const std::optional<std::string>& hf_dir) {
    config::Config cfg = config.config;
    if (hf_dir) {
      // As porter.model.from does (Note [Config from a Hugging Face model] in cli/common.cc):
      // config.json gives the model's shape, the config its training keys.
      cfg.porter.model = io::hf_model_config(io::read_hf_config(*hf_dir), cfg.porter.model);
    }
    // As `porter train` builds its device and engine (cli/train_command.cc).
    device_ = memory::make_device(engine::make_run_options(cfg).device);
    engine::ForecastOptions fo;  // Note [Attention choice]: before the model is built
    fo.capacity_bytes = device_->memory_capacity_bytes();
    fo.device = engine::nominal_cpu_device_model(*fo.capacity_bytes);
    fo.time_host_update = false;
    cfg = engine::resolve_model_choices(cfg, fo);
    engine_ = std::make_unique<engine::Engine>(
        *device_, std::make_unique<engine::TransformerModel>(cfg.porter.model), cfg);
    if (cfg.porter.model.from) {
      const std::string dir = *cfg.porter.model.from;
      const std::unique_ptr<models::Transformer> part = models::build_model(cfg.porter.model);
      engine_->set_params_host_range([&](int64_t begin, std::span<float> values) {
        io::read_hf_weights_part(dir, *part, begin, values);
      });
      hf_source_ = io::read_hf_config(dir).json;
    }
  }

  engine::Engine& engine() { return *engine_; }

  void save_hf(const std::filesystem::path& dir) {
    const std::vector<float> whole = engine::whole_params_host(*engine_, nullptr);
    config::ModelConfig model = engine_->config().porter.model;
    model.tensor_parallel = 1;
    model.sequence_parallel = false;
    io::write_hf_checkpoint(dir, model, models::build_model(model)->layout(), whole,
                            engine_->compute_dtype(), hf_source_);
  }

 private:
  std::unique_ptr<memory::Device> device_;          // outlives the engine
  std::unique_ptr<engine::Engine> engine_;
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

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<PyEngine>(m, "Engine",
                       "Trains a model on one device under the config's memory plan "
                       "(porter::engine::Engine).")
      .def(py::init([](py::handle config, py::object model) {
             std::optional<std::string> hf_dir;
             if (!model.is_none()) {
               if (!py::isinstance<py::str>(model) &&
                   !py::isinstance(model, py::module_::import("os").attr("PathLike"))) {
                 throw InvalidArgument(
                     "porter.Engine: model must be None (the config's porter.model) or a Hugging "
                     "Face model directory, got a " +
                     py::str(model.get_type().attr("__name__")).cast<std::string>());
               }
               hf_dir = py::str(model).cast<std::string>();
             }
             const PyConfig c = as_config(config);
             py::gil_scoped_release release;
             return std::make_unique<PyEngine>(c, hf_dir);
           }),
           py::arg("config"), py::arg("model") = py::none(),
           "config: a porter.Config or a dict. model: None for the config's porter.model (with "
           "its weights when porter.model.from names a Hugging Face directory), or a Hugging "
           "Face model directory whose config.json gives the model and whose safetensors its "
           "weights.")
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
      .def("memory_report", [](const PyEngine& e) {
        return to_python(memory_json(const_cast<PyEngine&>(e).engine().memory_report()));
      }, "The memory report (per-category peaks, predictions) as a dict.")
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
           "The checkpoint plan, in one line.");
}

}  // namespace porter::python
