// Converting between nlohmann::json and Python objects, for configs and reports.
#include <cmath>

#include "base/error.h"
#include "python/bindings.h"

namespace porter::python {
namespace {

template <typename Json>
py::object json_to_python(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return py::none();
    case Json::value_t::boolean: return py::bool_(j.template get<bool>());
    case Json::value_t::number_integer: return py::int_(j.template get<int64_t>());
    case Json::value_t::number_unsigned: return py::int_(j.template get<uint64_t>());
    case Json::value_t::number_float: return py::float_(j.template get<double>());
    case Json::value_t::string: return py::str(j.template get_ref<const std::string&>());
    case Json::value_t::array: {
      py::list l;
      for (const Json& e : j) l.append(json_to_python(e));
      return l;
    }
    case Json::value_t::object: {
      py::dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d[py::str(it.key())] = json_to_python(*it);
      return d;
    }
    default: throw InternalError("a JSON value of an unexpected type reached the Python module");
  }
}

}  // namespace

py::object to_python(const nlohmann::ordered_json& j) { return json_to_python(j); }
py::object to_python(const nlohmann::json& j) { return json_to_python(j); }

nlohmann::ordered_json to_json(py::handle value, const std::string& where) {
  using J = nlohmann::ordered_json;
  if (value.is_none()) return nullptr;
  // bool before int: Python's bool is an int.
  if (py::isinstance<py::bool_>(value)) return value.cast<bool>();
  if (py::isinstance<py::int_>(value)) {
    // Negative values as int64, others as uint64 so that large sizes survive.
    if (value.cast<py::int_>() < py::int_(0)) return value.cast<int64_t>();
    return value.cast<uint64_t>();
  }
  if (py::isinstance<py::float_>(value)) {
    const double d = value.cast<double>();
    if (!std::isfinite(d)) {
      throw InvalidArgument(where + ": " + std::to_string(d) + " is not a JSON number; give a finite one");
    }
    return d;
  }
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  if (py::isinstance<py::dict>(value)) {
    J j = J::object();
    for (auto [k, v] : value.cast<py::dict>()) {
      if (!py::isinstance<py::str>(k)) {
        throw InvalidArgument(where + ": the key " + py::repr(k).cast<std::string>() +
                              " is not a string; JSON keys are strings");
      }
      const std::string key = k.cast<std::string>();
      j[key] = to_json(v, where.empty() ? key : where + "." + key);
    }
    return j;
  }
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    J j = J::array();
    size_t i = 0;
    for (py::handle v : value) j.push_back(to_json(v, where + "[" + std::to_string(i++) + "]"));
    return j;
  }
  // NumPy scalars and anything else with an exact int or float value.
  if (py::hasattr(value, "item")) return to_json(value.attr("item")(), where);
  throw InvalidArgument((where.empty() ? std::string("the config") : where) + ": a " +
                        py::str(value.get_type().attr("__name__")).cast<std::string>() +
                        " is not a JSON value; give a dict, list, str, int, float, bool or None");
}

}  // namespace porter::python
