// A submission's Handle as Python sees it: the terse Handle and the Python objects it borrows.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <utility>

#include "errors.h"
#include "gil.h"
#include "terse/engine.h"

namespace terse::python {

class PyHandle {
 public:
  PyHandle(Handle handle, py::list borrowed)
      : handle_(std::move(handle)), borrowed_(std::make_shared<PythonRef>(std::move(borrowed))) {
    // The engine may write into the tensors until the submission completes, even if Python
    // drops this handle first: the completion callback holds them until then.
    handle_.on_complete([keep = borrowed_](std::exception_ptr) {});
  }

  void wait() const {
    py::gil_scoped_release release;
    handle_.wait();
  }
  bool ready() const { return handle_.ready(); }

  void on_complete(py::function f) const {
    auto callback = std::make_shared<PythonRef>(std::move(f));
    handle_.on_complete([callback](std::exception_ptr error) {
      PythonOnOwnThread own;
      py::gil_scoped_acquire gil;
      try {
        callback->get()(error ? to_python_error(error) : py::none());
      } catch (py::error_already_set& e) {
        // Nobody up this (engine) thread's stack could handle it: report it like Python does
        // for exceptions in __del__ and carry on.
        e.discard_as_unraisable("terse: Handle.on_complete callback");
      }
    });
  }

 private:
  Handle handle_;
  std::shared_ptr<PythonRef> borrowed_;
};

}  // namespace terse::python
