// porter's error types as Python exceptions (base/error.h, Note [Error policy]): every one is a
// porter.Error, and each also derives from the built-in exception a Python user would catch
// for it (InvalidArgument is a ValueError, IoError an OSError, ...). The message is porter's.
#include <exception>

#include "base/error.h"
#include "python/bindings.h"

namespace porter::python {
namespace {

// The exception classes, created once at import; owned by the module (a new reference each,
// never released: the module lives until the interpreter ends).
struct ErrorTypes {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* usage_error = nullptr;
  PyObject* io_error = nullptr;
  PyObject* out_of_memory = nullptr;
  PyObject* cuda_error = nullptr;
  PyObject* nccl_error = nullptr;
  PyObject* timeout_error = nullptr;
  PyObject* peer_error = nullptr;
  PyObject* internal_error = nullptr;
};
ErrorTypes types;

PyObject* make_type(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  const std::string qualified = std::string("porter.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!t) throw py::error_already_set();
  m.add_object(name, py::handle(t));  // add_object takes its own reference
  return t;
}

void raise(PyObject* type, const std::exception& e) { PyErr_SetString(type, e.what()); }

}  // namespace

void bind_errors(py::module_& m) {
  const py::object builtins = py::module_::import("builtins");
  auto base = [&](const char* name) { return builtins.attr(name); };
  types.error = make_type(m, "Error", py::make_tuple(base("RuntimeError")),
                          "Every error porter raises (porter::Error).");
  const py::handle error(types.error);
  types.invalid_argument =
      make_type(m, "InvalidArgument", py::make_tuple(error, base("ValueError")),
                "Bad input: a config value, an argument or a batch that breaks a documented rule.");
  types.usage_error = make_type(m, "UsageError", py::make_tuple(error),
                                "An API used in the wrong order or state.");
  types.io_error = make_type(m, "IoError", py::make_tuple(error, base("OSError")),
                             "A file that cannot be read or written, or whose contents are corrupt.");
  types.out_of_memory =
      make_type(m, "OutOfMemoryError", py::make_tuple(error, base("MemoryError")),
                "Device or pinned memory exhausted; the message carries the full accounting and "
                "requested_bytes the allocation that failed.");
  types.cuda_error = make_type(m, "CudaError", py::make_tuple(error), "A CUDA call failed.");
  types.nccl_error = make_type(m, "NcclError", py::make_tuple(error), "An NCCL call failed.");
  types.timeout_error = make_type(m, "TimeoutError", py::make_tuple(error, base("TimeoutError")),
                                  "A blocking call that did not finish in time.");
  types.peer_error = make_type(m, "PeerError", py::make_tuple(error),
                               "A peer rank failed or disconnected.");
  types.internal_error = make_type(m, "InternalError", py::make_tuple(error),
                                   "A bug in porter: an invariant that must always hold did not.");

  // The most derived class first; anything else stays pybind11's.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      raise(types.invalid_argument, e);
    } catch (const UsageError& e) {
      raise(types.usage_error, e);
    } catch (const IoError& e) {
      raise(types.io_error, e);
    } catch (const OutOfMemoryError& e) {
      py::object value = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(types.out_of_memory, "s", e.what()));
      if (!value) throw py::error_already_set();
      value.attr("requested_bytes") = py::int_(e.requested_bytes());
      PyErr_SetObject(types.out_of_memory, value.ptr());
    } catch (const CudaError& e) {
      raise(types.cuda_error, e);
    } catch (const NcclError& e) {
      raise(types.nccl_error, e);
    } catch (const TimeoutError& e) {
      raise(types.timeout_error, e);
    } catch (const PeerError& e) {
      raise(types.peer_error, e);
    } catch (const InternalError& e) {
      raise(types.internal_error, e);
    } catch (const Error& e) {
      raise(types.error, e);
    }
  });
}

}  // namespace porter::python
