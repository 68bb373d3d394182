#include "errors.h"

#include <new>
#include <string>

#include "terse/error.h"

namespace terse::python {
namespace {

// Borrowed for the life of the process: exception classes must outlive every module object that
// might raise them, including during interpreter shutdown.
struct ErrorTypes {
  PyObject* error = nullptr;
  PyObject* spec = nullptr;
  PyObject* invalid = nullptr;
  PyObject* decode = nullptr;
  PyObject* mismatch = nullptr;
  PyObject* timeout = nullptr;
  PyObject* transport = nullptr;
  PyObject* authentication = nullptr;
};
ErrorTypes types;

PyObject* make_type(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  // The qualified name says terse.X (not terse._C.X): that is where users import it from.
  const std::string qualified = std::string("terse.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));
  return type;
}

py::object instance(PyObject* type, const char* message) {
  return py::reinterpret_borrow<py::object>(type)(message);
}

}  // namespace

void register_errors(py::module_& m) {
  auto builtin = [](const char* name) { return py::module_::import("builtins").attr(name); };
  types.error = make_type(m, "Error", py::make_tuple(builtin("RuntimeError")),
                          "Base of every terse error; the message names rank, tensor and peer.");
  py::handle base(types.error);
  types.spec = make_type(m, "SpecError", py::make_tuple(base, builtin("ValueError")),
                         "A codec spec or option is malformed, unknown or out of range.");
  types.invalid = make_type(m, "InvalidArgument", py::make_tuple(base, builtin("ValueError")),
                            "Arguments that cannot be honoured (sizes, NaN or Inf input).");
  types.decode = make_type(m, "DecodeError", py::make_tuple(base),
                           "A payload or saved state is truncated, corrupt or foreign.");
  types.mismatch = make_type(m, "MismatchError", py::make_tuple(base),
                             "Ranks submitted different tensors, sizes or options.");
  types.timeout = make_type(m, "TimeoutError", py::make_tuple(base, builtin("TimeoutError")),
                            "A wait ran past its deadline (a dead or stalled peer).");
  types.transport = make_type(m, "TransportError", py::make_tuple(base, builtin("ConnectionError")),
                              "A peer closed its connection or could not be reached.");
  types.authentication =
      make_type(m, "AuthenticationError", py::make_tuple(py::handle(types.transport)),
                "A store or peer did not prove the job secret, or refused this process's.");
  // Local: torch is built with the same pybind11 and shares its internals; its functions never
  // throw terse errors, so they need not pass through this translator.
  py::register_local_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error&) {
      py::object e = to_python_error(p);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
    }
  });
}

py::object to_python_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const SpecError& e) {
    return instance(types.spec, e.what());
  } catch (const InvalidArgument& e) {
    return instance(types.invalid, e.what());
  } catch (const DecodeError& e) {
    return instance(types.decode, e.what());
  } catch (const MismatchError& e) {
    return instance(types.mismatch, e.what());
  } catch (const TimeoutError& e) {
    return instance(types.timeout, e.what());
  } catch (const AuthenticationError& e) {
    return instance(types.authentication, e.what());
  } catch (const TransportError& e) {
    return instance(types.transport, e.what());
  } catch (const Error& e) {
    return instance(types.error, e.what());
  } catch (py::error_already_set& e) {
    return e.value();
  } catch (const std::bad_alloc&) {
    return instance(PyExc_MemoryError, "terse: out of memory");
  } catch (const std::exception& e) {
    return instance(PyExc_RuntimeError, e.what());
  } catch (...) {
    return instance(PyExc_RuntimeError, "terse: unknown C++ exception");
  }
}

}  // namespace terse::python
