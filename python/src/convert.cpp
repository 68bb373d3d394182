#include "convert.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>

#include "terse/communicator.h"
#include "terse/environment.h"
#include "terse/error.h"

namespace terse::python {

using std::chrono::milliseconds;

milliseconds to_timeout(std::optional<double> seconds) {
  if (!seconds) return milliseconds(0);
  if (!std::isfinite(*seconds) || *seconds <= 0) {
    throw InvalidArgument(
        fmt::format("timeout must be a positive number of seconds, not {}", *seconds));
  }
  return milliseconds(static_cast<std::int64_t>(std::ceil(*seconds * 1000)));
}
milliseconds environment_timeout() {
  const milliseconds t = communicator_options_from_environment().timeout;
  return t.count() > 0 ? t : default_timeout();
}
milliseconds resolved_timeout(std::optional<double> seconds) {
  const milliseconds t = to_timeout(seconds);
  return t.count() > 0 ? t : environment_timeout();
}
double to_seconds(milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }
std::string resolved_secret(const std::optional<std::string>& secret) {
  CommunicatorOptions o;
  if (secret) o.secret = *secret;
  return communicator_options_from_environment(std::move(o)).secret;
}

std::string type_name(py::handle obj) {
  return py::type::of(obj).attr("__name__").cast<std::string>();
}

namespace {

constexpr const char* kEngineDtypes = "torch.float32, torch.float16 and torch.bfloat16";

// dtypes the engine reduces (float32 only where `half` is false).
TensorView torch_tensor_view(py::handle tensor, const std::string& name, bool half) {
  // torch's dtypes, looked up once and kept for the life of the process (no destructor at exit).
  static PyObject* float32 =
      py::object(py::module_::import("torch").attr("float32")).release().ptr();
  static PyObject* float16 =
      py::object(py::module_::import("torch").attr("float16")).release().ptr();
  static PyObject* bfloat16 =
      py::object(py::module_::import("torch").attr("bfloat16")).release().ptr();
  py::object dtype = tensor.attr("dtype");
  DType type = DType::kFloat32;
  if (half && dtype.is(py::handle(float16))) {
    type = DType::kFloat16;
  } else if (half && dtype.is(py::handle(bfloat16))) {
    type = DType::kBFloat16;
  } else if (!dtype.is(py::handle(float32))) {
    throw py::type_error(fmt::format("tensor '{}': dtype is {}, terse reduces {}", name,
                                     std::string(py::str(dtype)),
                                     half ? kEngineDtypes : "torch.float32"));
  }
  const auto device = tensor.attr("device").attr("type").cast<std::string>();
  if (device != "cpu") {
    throw InvalidArgument(
        fmt::format("tensor '{}' is on {}; terse reduces CPU tensors", name, device));
  }
  if (!tensor.attr("is_contiguous")().cast<bool>()) {
    throw InvalidArgument(
        fmt::format("tensor '{}' is not contiguous; pass .contiguous() and "
                    "copy the result back",
                    name));
  }
  const auto n = tensor.attr("numel")().cast<std::size_t>();
  const auto address = tensor.attr("data_ptr")().cast<std::uintptr_t>();
  return TensorView(n == 0 ? nullptr : reinterpret_cast<void*>(address), n, type);
}

TensorView buffer_view(py::handle obj, const std::string& name, bool half) {
  py::buffer_info info;
  try {
    info = py::reinterpret_borrow<py::buffer>(obj).request(/*writable=*/true);
  } catch (py::error_already_set& e) {
    // Results are written in place, so a read-only buffer cannot take part.
    throw InvalidArgument(fmt::format("tensor '{}': not a writable buffer ({})", name, e.what()));
  }
  const std::string& f = info.format;
  const bool is_float = info.itemsize == 4 && (f == "f" || f == "<f" || f == "=f" || f == "@f");
  const bool is_half =
      half && info.itemsize == 2 && (f == "e" || f == "<e" || f == "=e" || f == "@e");
  if (!is_float && !is_half) {
    throw py::type_error(fmt::format("tensor '{}': buffer holds '{}' items of {} bytes, terse "
                                     "reduces {}",
                                     name, f, info.itemsize,
                                     half ? "float32 and float16" : "float32"));
  }
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      throw InvalidArgument(fmt::format("tensor '{}': buffer is not C-contiguous", name));
    }
    expected *= info.shape[d];
  }
  return TensorView(info.size == 0 ? nullptr : info.ptr, static_cast<std::size_t>(info.size),
                    is_half ? DType::kFloat16 : DType::kFloat32);
}

}  // namespace

TensorView tensor_view(py::handle obj, const std::string& name) {
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "numel")) {
    return torch_tensor_view(obj, name, true);
  }
  if (PyObject_CheckBuffer(obj.ptr()) != 0) return buffer_view(obj, name, true);
  throw py::type_error(fmt::format("tensor '{}': expected a torch.Tensor ({}) or a writable "
                                   "float32 or float16 buffer, got {}",
                                   name, kEngineDtypes, type_name(obj)));
}

std::span<float> float_span(py::handle obj, const std::string& name) {
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "numel")) {
    return torch_tensor_view(obj, name, false).floats();
  }
  if (PyObject_CheckBuffer(obj.ptr()) != 0) return buffer_view(obj, name, false).floats();
  throw py::type_error(
      fmt::format("tensor '{}': expected a float32 torch.Tensor or a writable "
                  "float32 buffer, got {}",
                  name, type_name(obj)));
}

DType parse_dtype(py::handle dtype) {
  std::string s = py::str(dtype);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float32" || s == "float") return DType::kFloat32;
  if (s == "float16" || s == "half") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  throw py::type_error(fmt::format("dtype {} is not one terse reduces ({})", s, kEngineDtypes));
}

}  // namespace terse::python
