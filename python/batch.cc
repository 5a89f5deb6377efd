// Micro-batches from NumPy: a dict name -> array becomes an io::HostBatch (Note [Batch
// tensors] in io/data.h).
//
// Note [NumPy batches]
// - "tokens" and "targets" are the built-in models' (batch, seq) token ids: any integer array
//   of two dimensions, copied into HostBatch::tokens / targets as int32 (the engine copies
//   them to the device anyway, and checks them against the vocab).
// - Any other name becomes a HostTensor of its dtype: float32 (f32), bfloat16 (bf16, from
//   ml_dtypes), int32, int64 or bool. A C-contiguous array is not copied: the HostTensor views
//   its memory, and its owner holds a reference to the array, released under the GIL
//   whenever the last copy of the HostBatch goes (the Engine keeps the last step's batches),
//   so the array outlives every use. Other arrays (strided views, Fortran order) are copied
//   into a new C-contiguous array first. Any other dtype is an error naming the ones that
//   work; porter never converts values silently.
// Changing a viewed array while a step runs changes the batch: the step reads it then.
#include <string>

#include <pybind11/numpy.h>

#include "base/error.h"
#include "python/bindings.h"

namespace porter::python {
namespace {

std::string type_name(py::handle v) {
  return py::str(v.get_type().attr("__name__")).cast<std::string>();
}

std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

py::array as_array(py::handle v, const std::string& where) {
  if (py::isinstance<py::array>(v)) return py::reinterpret_borrow<py::array>(v);
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    return py::reinterpret_steal<py::array>(py::module_::import("numpy").attr("asarray")(v).release());
  }
  throw InvalidArgument(where + ": expected a NumPy array, got a " + type_name(v));
}

// (batch, seq) token ids as int32.
std::vector<int32_t> token_ids(const py::array& a, const std::string& where, int64_t& batch,
                               int64_t& seq) {
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    throw InvalidArgument(where + ": token ids must be integers (int32), got dtype " +
                          a.dtype().attr("name").cast<std::string>());
  }
  if (a.ndim() != 2) {
    throw InvalidArgument(where + ": expected a (batch, seq) array, got shape " + shape_text(a));
  }
  batch = a.shape(0);
  seq = a.shape(1);
  // Other integer types are cast; a value outside int32 would wrap (and might then pass the
  // engine's vocab check), so it is refused here.
  if (a.dtype().itemsize() > 4 || (kind == 'u' && a.dtype().itemsize() == 4)) {
    const py::module_ np = py::module_::import("numpy");
    const py::object outside = np.attr("any")(np.attr("logical_or")(
        np.attr("less")(a, py::int_(INT32_MIN)), np.attr("greater")(a, py::int_(INT32_MAX))));
    if (outside.cast<bool>()) {
      throw InvalidArgument(where + ": a token id does not fit int32");
    }
  }
  auto ids = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!ids) throw py::error_already_set();
  return std::vector<int32_t>(ids.data(), ids.data() + ids.size());
}

tensor::DType dtype_of(const py::array& a, const std::string& where) {
  const py::dtype d = a.dtype();
  const std::string name = d.attr("name").cast<std::string>();
  if (name == "float32") return tensor::DType::kF32;
  if (name == "bfloat16" && d.itemsize() == 2) return tensor::DType::kBF16;
  if (name == "int32") return tensor::DType::kI32;
  if (name == "int64") return tensor::DType::kI64;
  if (name == "bool") return tensor::DType::kBool;
  throw InvalidArgument(where + ": dtype " + name +
                        " is not one a batch tensor can have (float32, bfloat16, int32, int64, "
                        "bool); convert it, e.g. with .astype(numpy.float32)");
}

io::HostTensor host_tensor(const std::string& name, py::array a, const std::string& where) {
  io::HostTensor t;
  t.name = name;
  t.dtype = dtype_of(a, where);
  if (a.ndim() > tensor::kMaxRank) {
    throw InvalidArgument(where + ": shape " + shape_text(a) + " has " + std::to_string(a.ndim()) +
                          " dimensions; a batch tensor has at most " +
                          std::to_string(tensor::kMaxRank));
  }
  if (!(a.flags() & py::array::c_style)) {
    a = py::reinterpret_steal<py::array>(
        py::module_::import("numpy").attr("ascontiguousarray")(a).release());
  }
  std::vector<int64_t> dims;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) dims.push_back(a.shape(i));
  t.shape = tensor::Shape(dims);
  t.data = a.data();
  // The owner keeps a reference to the array; it may be released on any thread, so it takes
  // the GIL (Note [NumPy batches]).
  auto* held = new py::object(std::move(a));
  t.owner = std::shared_ptr<const void>(t.data, [held](const void*) {
    if (!Py_IsInitialized()) {
      // The interpreter is gone with the array; nothing to release.
      held->release();
      delete held;
      return;
    }
    py::gil_scoped_acquire gil;
    delete held;
  });
  return t;
}

}  // namespace

io::HostBatch to_host_batch(py::handle batch, const std::string& where) {
  if (!py::isinstance<py::dict>(batch)) {
    throw InvalidArgument(where + ": a micro-batch is a dict of name -> NumPy array, got a " +
                          type_name(batch));
  }
  io::HostBatch b;
  int64_t tokens_shape[2] = {-1, -1};
  int64_t targets_shape[2] = {-1, -1};
  for (auto [key, value] : batch.cast<py::dict>()) {
    if (!py::isinstance<py::str>(key)) {
      throw InvalidArgument(where + ": the key " + py::repr(key).cast<std::string>() +
                            " is not a string; a batch tensor's name is");
    }
    const std::string name = key.cast<std::string>();
    const std::string at = where + "[\"" + name + "\"]";
    const py::array a = as_array(value, at);
    if (name == "tokens") {
      b.tokens = token_ids(a, at, tokens_shape[0], tokens_shape[1]);
    } else if (name == "targets") {
      b.targets = token_ids(a, at, targets_shape[0], targets_shape[1]);
    } else {
      b.tensors.push_back(host_tensor(name, a, at));
    }
  }
  if (tokens_shape[0] >= 0 && targets_shape[0] >= 0 &&
      (tokens_shape[0] != targets_shape[0] || tokens_shape[1] != targets_shape[1])) {
    throw InvalidArgument(where + ": tokens (" + std::to_string(tokens_shape[0]) + ", " +
                          std::to_string(tokens_shape[1]) + ") and targets (" +
                          std::to_string(targets_shape[0]) + ", " +
                          std::to_string(targets_shape[1]) + ") must have the same shape");
  }
  if (tokens_shape[0] >= 0) {
    b.batch = tokens_shape[0];
    b.seq = tokens_shape[1];
  } else if (targets_shape[0] >= 0) {
    b.batch = targets_shape[0];
    b.seq = targets_shape[1];
  }
  return b;
}

std::vector<io::HostBatch> to_host_batches(py::handle batches) {
  std::vector<io::HostBatch> out;
  if (py::isinstance<py::dict>(batches)) {
    out.push_back(to_host_batch(batches, "batch"));
    return out;
  }
  if (!py::isinstance<py::list>(batches) && !py::isinstance<py::tuple>(batches)) {
    throw InvalidArgument("batches: expected a list of micro-batches (dicts of name -> NumPy "
                          "array), or one dict, got a " + type_name(batches));
  }
  size_t i = 0;
  for (py::handle b : batches) {
    out.push_back(to_host_batch(b, "batches[" + std::to_string(i++) + "]"));
  }
  return out;
}

}  // namespace porter::python
