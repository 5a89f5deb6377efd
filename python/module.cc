// The porter Python module, porter._porter (docs/python.md): the errors, the config and its
// reports, and the Engine.
#include "python/bindings.h"

PYBIND11_MODULE(_porter, m) {
  m.doc() = "porter: training within a memory budget (ZeRO, activation checkpointing, offload)";
  m.attr("__version__") = PORTER_VERSION;
  porter::python::bind_errors(m);
  porter::python::bind_config(m);
  porter::python::bind_engine(m);
}
