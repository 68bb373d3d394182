// Conversions at the binding's edge: Python timeouts to milliseconds, and Python objects to the
// tensor views the engine, the codecs and the channel read and write in place.
//
// Tensors are borrowed zero-copy: a contiguous CPU torch.Tensor is read through its data_ptr()
// and numel() (so the module does not link libtorch, whose C++ ABI is tied to one torch build),
// any other object through the buffer protocol (numpy arrays, array('f')). The caller keeps the
// object alive for as long as the view is used.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <optional>
#include <span>
#include <string>

#include "terse/dtype.h"

namespace terse::python {

namespace py = pybind11;

// Seconds from Python (None: the default, TERSE_TIMEOUT or 60 s) to the C++ convention, where
// zero means the default. Throws InvalidArgument for a value that is not a positive number.
std::chrono::milliseconds to_timeout(std::optional<double> seconds);
// The environment's timeout (TERSE_TIMEOUT), else default_timeout().
std::chrono::milliseconds environment_timeout();
// The same with the default resolved.
std::chrono::milliseconds resolved_timeout(std::optional<double> seconds);
double to_seconds(std::chrono::milliseconds t);
// The job secret from Python (None or empty: TERSE_JOB_SECRET, else none).
std::string resolved_secret(const std::optional<std::string>& secret);

// The Python type name of obj, for error messages.
std::string type_name(py::handle obj);

// A tensor for the engine: float32, float16 or bfloat16 (a torch.Tensor, or a float32 or
// float16 buffer). Errors name the tensor.
TensorView tensor_view(py::handle obj, const std::string& name);
// A float32 tensor or buffer, for the codecs and the channel.
std::span<float> float_span(py::handle obj, const std::string& name);
// A torch dtype (or its name) the engine reduces.
DType parse_dtype(py::handle dtype);

}  // namespace terse::python
