// What the files of the porter Python module share: each binds one part of the API into the
// module (docs/python.md), and the conversions between NumPy, Python and porter's types.
#pragma once

#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "io/data.h"

namespace porter::python {

namespace py = pybind11;

// A parsed config and where it came from (porter.Config).
struct PyConfig {
  config::Config config;
  std::string source;                  // the report's "config": a file's path, or "<dict>"
  std::vector<std::string> warnings;   // the parser's warnings, "path: message"
  std::vector<std::string> notes;      // and its notes (Note [Fixed behaviour])
};

// porter.Error and its subclasses, one per porter::Error subclass (base/error.h), and the
// translator that raises them with porter's message.
void bind_errors(py::module_& m);
// porter.Config, porter.estimate, porter.plan.
void bind_config(py::module_& m);
// porter.Engine.
void bind_engine(py::module_& m);

// JSON <-> Python: objects are dicts (keys in order), arrays lists, numbers int or float.
py::object to_python(const nlohmann::ordered_json& j);
py::object to_python(const nlohmann::json& j);
// Throws porter::InvalidArgument naming `where` for a value JSON cannot hold (a set, an
// object, a dict key that is not a string, a float that is not finite).
nlohmann::ordered_json to_json(py::handle value, const std::string& where);

// One micro-batch from a dict name -> array (Note [NumPy batches] in batch.cc).
io::HostBatch to_host_batch(py::handle batch, const std::string& where);
// A list of dicts, or one dict: the micro-batches of a step.
std::vector<io::HostBatch> to_host_batches(py::handle batches);

}  // namespace porter::python
