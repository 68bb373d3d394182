// terse's C++ exceptions as Python exceptions with the same message text.
//
//   terse.Error(RuntimeError)                     every terse failure
//   terse.SpecError(Error, ValueError)            malformed or unknown codec spec / option
//   terse.InvalidArgument(Error, ValueError)      arguments that cannot be honoured, NaN input
//   terse.DecodeError(Error)                      corrupt or foreign payload or state bytes
//   terse.MismatchError(Error)                    ranks submitted different things
//   terse.TimeoutError(Error, TimeoutError)       a dead or stalled peer
//   terse.TransportError(Error, ConnectionError)  a peer closed its connection
//   terse.AuthenticationError(TransportError)     a store or peer did not prove the job secret
//
// The second bases let code that knows nothing of terse catch them idiomatically.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

namespace terse::python {

namespace py = pybind11;

// Creates the exception classes in module m and installs the translator.
void register_errors(py::module_& m);

// The Python exception object for a C++ exception (terse errors map to their classes, Python
// errors raised in callbacks pass through, anything else becomes RuntimeError). GIL required.
py::object to_python_error(std::exception_ptr error);

}  // namespace terse::python
