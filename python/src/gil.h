// Ownership helpers for objects that cross between Python and terse's own threads.
//
// Engine worker threads complete submissions and run callbacks; they hold no GIL. Two rules keep
// that safe: a Python reference dropped on such a thread must take the GIL first (PythonRef),
// and a C++ object whose destructor joins threads that may be waiting for the GIL must be
// destroyed with the GIL released (release_gil_deleter), or the two wait on each other forever.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

namespace terse::python {

namespace py = pybind11;

// A strong reference to a Python object that may be released on any thread.
class PythonRef {
 public:
  explicit PythonRef(py::object object) : object_(std::move(object)) {}
  ~PythonRef() {
    // After interpreter shutdown the reference is leaked rather than touched.
    if (!object_ || !Py_IsInitialized()) {
      object_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    object_ = py::object();
  }
  PythonRef(const PythonRef&) = delete;
  PythonRef& operator=(const PythonRef&) = delete;

  // Call only with the GIL held.
  const py::object& get() const { return object_; }

 private:
  py::object object_;
};

// Deletes a T with the GIL released if the calling thread holds it.
template <typename T>
void release_gil_and_delete(T* p) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release release;
    delete p;
  } else {
    delete p;
  }
}

template <typename T>
std::shared_ptr<T> share_releasing_gil(std::unique_ptr<T> p) {
  return std::shared_ptr<T>(p.release(), &release_gil_and_delete<T>);
}

}  // namespace terse::python
