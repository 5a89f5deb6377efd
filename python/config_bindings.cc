// porter.Config (a validated config from a dict or from files), and porter.estimate and
// porter.plan: the reports `porter estimate --json` and `porter plan --json` print
// (cli/reports.h).
#include <sstream>

#include <pybind11/stl.h>

#include "base/error.h"
#include "cli/common.h"
#include "cli/reports.h"
#include "config/merge.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"
#include "python/bindings.h"

namespace porter::python {
namespace {

// Note [Implied world size] in cli/common.h, for a dict: all three of train_batch_size,
// train_micro_batch_size_per_gpu and gradient_accumulation_steps imply
// train_batch_size / (micro-batch x accumulation) data-parallel ranks, else one; times
// porter.model.tensor_parallel.
int64_t implied_world_size(const nlohmann::ordered_json& j) {
  auto integer = [](const nlohmann::ordered_json& o, const char* key) -> int64_t {
    auto it = o.find(key);
    return it != o.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
  };
  const int64_t tbs = integer(j, "train_batch_size");
  const int64_t mbs = integer(j, "train_micro_batch_size_per_gpu");
  const int64_t gas = integer(j, "gradient_accumulation_steps");
  int64_t tp = 1;
  if (auto p = j.find("porter"); p != j.end() && p->is_object()) {
    if (auto m = p->find("model"); m != p->end() && m->is_object()) {
      tp = std::max<int64_t>(1, integer(*m, "tensor_parallel"));
    }
  }
  const bool implied = tbs > 0 && mbs > 0 && gas > 0 && tbs % (mbs * gas) == 0;
  return (implied ? tbs / (mbs * gas) : 1) * tp;
}

// Note [Config from a Hugging Face model] in cli/common.cc, for a dict: config.json's model
// keys set over porter.model, a key the user set to another value being an error.
void apply_model_from(nlohmann::ordered_json& j) {
  if (!j.is_object()) return;
  auto p = j.find("porter");
  if (p == j.end() || !p->is_object()) return;
  auto m = p->find("model");
  if (m == p->end() || !m->is_object()) return;
  auto from = m->find("from");
  if (from == m->end() || !from->is_string()) return;  // anything else is the parser's to refuse
  io::HfConfig hf;
  try {
    hf = io::read_hf_config(from->get<std::string>());
  } catch (const IoError& e) {
    throw IoError(std::string("porter.model.from: ") + e.what());
  }
  const nlohmann::ordered_json overrides = io::hf_model_overrides(hf, nlohmann::json(*m));
  for (const auto& [key, value] : overrides.items()) (*m)[key] = value;
}

PyConfig config_from_dict(py::handle d, std::optional<int64_t> world_size, bool strict) {
  if (!py::isinstance<py::dict>(d)) {
    throw InvalidArgument("porter.Config: expected a dict (the JSON config's object), got a " +
                          py::str(d.get_type().attr("__name__")).cast<std::string>() +
                          "; porter.Config.from_file reads a file");
  }
  nlohmann::ordered_json j = to_json(d, "");
  apply_model_from(j);
  const int64_t ws = world_size.value_or(implied_world_size(j));
  config::ParseResult r = config::parse_config_string(j.dump(), config::ParseOptions{ws, strict});
  PyConfig c;
  c.config = std::move(r.config);
  c.source = "<dict>";
  for (const config::Warning& w : r.warnings) c.warnings.push_back(w.text());
  for (const config::Warning& n : r.notes) c.notes.push_back(n.text());
  return c;
}

PyConfig config_from_files(const std::vector<std::string>& files,
                           const std::vector<std::string>& sets, std::optional<int64_t> world_size,
                           bool strict) {
  if (files.empty()) throw InvalidArgument("porter.Config.from_file: give at least one file");
  // A file that cannot be read is an IoError (an OSError) here; the CLI's reading reports it
  // as invalid input, exit code 2.
  for (const std::string& f : files) config::read_config_source(f);
  const cli::ConfigArgs args{files, sets};
  const int64_t ws = world_size.value_or(cli::implied_world_size(args));
  const config::SourcedParseResult r =
      cli::parse_config_args(args, config::ParseOptions{ws, strict});
  PyConfig c;
  c.config = r.config;
  c.source = args.display();
  for (const config::SourcedWarning& w : r.warnings) c.warnings.push_back(w.text());
  for (const config::SourcedWarning& n : r.notes) c.notes.push_back(n.text());
  return c;
}

// Each of the parser's warnings as a porter.ConfigWarning (a UserWarning), where `porter
// config check` prints "warning: ..." lines: an unknown key is otherwise easy to miss.
void warn(const PyConfig& c) {
  if (c.warnings.empty()) return;
  const py::object category = py::module_::import("porter._porter").attr("ConfigWarning");
  const py::object warnings = py::module_::import("warnings");
  for (const std::string& w : c.warnings) warnings.attr("warn")(w, category, 1);
}

// porter.estimate(config) and porter.plan(config) take a Config or a dict.
PyConfig as_config(py::handle config) {
  if (py::isinstance<PyConfig>(config)) return config.cast<PyConfig>();
  PyConfig c = config_from_dict(config, std::nullopt, false);
  warn(c);
  return c;
}

}  // namespace

void bind_config(py::module_& m) {
  m.attr("ConfigWarning") = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "porter.ConfigWarning",
      "A config warning: a key porter does not read, a deprecated alias, a DeepSpeed feature "
      "porter does not implement.",
      PyExc_UserWarning, nullptr));
  py::class_<PyConfig>(m, "Config",
                       "A validated porter config (DeepSpeed's JSON with porter's section).")
      .def(py::init([](py::dict d, std::optional<int64_t> world_size, bool strict) {
             PyConfig c = config_from_dict(d, world_size, strict);
             warn(c);
             return c;
           }),
           py::arg("config"), py::kw_only(), py::arg("world_size") = py::none(),
           py::arg("strict") = false,
           "Parses and checks a config given as a dict. world_size defaults to the one the "
           "batch sizes imply (train_batch_size / (micro-batch x accumulation) x "
           "tensor_parallel), else 1. strict makes every warning an error.")
      .def_static(
          "from_file",
          [](py::object path, std::optional<int64_t> world_size, bool strict,
             std::vector<std::string> sets) {
            std::vector<std::string> files;
            if (py::isinstance<py::list>(path) || py::isinstance<py::tuple>(path)) {
              for (py::handle p : path) files.push_back(py::str(p).cast<std::string>());
            } else {
              files.push_back(py::str(path).cast<std::string>());
            }
            PyConfig c = config_from_files(files, sets, world_size, strict);
            warn(c);
            return c;
          },
          py::arg("path"), py::kw_only(), py::arg("world_size") = py::none(),
          py::arg("strict") = false, py::arg("set") = std::vector<std::string>{},
          "Reads a config file (or a list of files, merged as porter's --config does) with "
          "--set style overrides (\"porter.model.layers=4\").")
      .def("to_dict", [](const PyConfig& c) { return to_python(config::to_json(c.config)); },
           "The resolved config as a dict, as `porter config check --json` prints it.")
      .def_property_readonly("world_size", [](const PyConfig& c) { return c.config.world_size; })
      .def_property_readonly("source", [](const PyConfig& c) { return c.source; },
                             "Where the config came from: the files' names, or \"<dict>\".")
      .def_property_readonly("warnings", [](const PyConfig& c) { return c.warnings; })
      .def_property_readonly("notes", [](const PyConfig& c) { return c.notes; })
      .def("__repr__", [](const PyConfig& c) {
        return "porter.Config(" + c.source + ", world_size=" +
               std::to_string(c.config.world_size) + ")";
      });

  m.def(
      "estimate",
      [](py::handle config, std::optional<std::string> budget,
         std::optional<int64_t> ranks_per_node, std::optional<std::string> host_memory) {
        const PyConfig c = as_config(config);
        cli::EstimateReportOptions o;
        o.config_name = c.source;
        o.budget = budget.value_or("");
        o.ranks_per_node = ranks_per_node;
        o.host_memory = host_memory.value_or("");
        std::ostringstream progress;
        nlohmann::ordered_json j;
        {
          py::gil_scoped_release release;
          j = cli::estimate_report(c.config, o, progress);
        }
        return to_python(j);
      },
      py::arg("config"), py::kw_only(), py::arg("budget") = py::none(),
      py::arg("ranks_per_node") = py::none(), py::arg("host_memory") = py::none(),
      "The report `porter estimate --json` prints, as a dict.");
  m.def(
      "plan",
      [](py::handle config, std::optional<std::string> budget, bool profile) {
        const PyConfig c = as_config(config);
        cli::PlanReportOptions o;
        o.config_name = c.source;
        o.budget = budget.value_or("");
        o.profile = profile;
        std::ostringstream progress;
        nlohmann::ordered_json j;
        {
          py::gil_scoped_release release;
          j = cli::plan_report(c.config, o, progress);
        }
        return to_python(j);
      },
      py::arg("config"), py::kw_only(), py::arg("budget") = py::none(),
      py::arg("profile") = false, "The report `porter plan --json` prints, as a dict.");
}

}  // namespace porter::python
