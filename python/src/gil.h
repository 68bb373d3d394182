// Ownership helpers for objects that cross between Python and terse's own threads.
//
// Engine worker threads complete submissions and run callbacks; they hold no GIL. Two rules keep
// that safe: a Python reference dropped on such a thread must take the GIL first (PythonRef),
// and a C++ object whose destructor joins threads that may be waiting for the GIL must be
// destroyed with the GIL released (release_gil_deleter), or the two wait on each other forever.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <thread>
#include <utility>

namespace terse::python {

namespace py = pybind11;

// Python code running on one of terse's own threads (a completion callback, a reference being
// dropped there) may release the last reference to an engine, whose destructor joins that very
// thread: such a deletion is handed to a thread of its own. Counted by PythonOnOwnThread.
inline thread_local int python_on_own_thread = 0;

class PythonOnOwnThread {
 public:
  PythonOnOwnThread() { ++python_on_own_thread; }
  ~PythonOnOwnThread() { --python_on_own_thread; }
  PythonOnOwnThread(const PythonOnOwnThread&) = delete;
  PythonOnOwnThread& operator=(const PythonOnOwnThread&) = delete;
};

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
    PythonOnOwnThread own;
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

// Deletes a T with the GIL released if the calling thread holds it; on one of terse's own
// threads running Python, on a new thread (the destructor may join the calling thread).
template <typename T>
void release_gil_and_delete(T* p) {
  if (python_on_own_thread > 0) {
    std::thread([p] { delete p; }).detach();
  } else if (Py_IsInitialized() && PyGILState_Check()) {
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
