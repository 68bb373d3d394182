// terse._C: the Python binding of terse's public C++ API (codecs, stores, Communicator, Engine,
// the point-to-point Channel), one file per part (bindings.h lists them).
// The pure-Python package terse re-exports it; terse.torch builds the DDP hook on top.
//
// Tensors are borrowed zero-copy: a contiguous float32 CPU torch.Tensor (float16 and bfloat16
// too, for the engine) is read through its data_ptr() and numel() (so the module does not link
// libtorch, whose C++ ABI is tied to one torch build), any other object through the buffer
// protocol (numpy arrays of float32, or float16 for the engine; array('f')); convert.h. The
// binding keeps every submitted object alive until its submission completes.
//
// GIL: released around every call that can block or talk to other ranks (communicator creation,
// barrier, submission, whose first-use check exchanges messages, wait, synchronize, state
// save/load, calibration, engine shutdown). Engine threads take it only to run Python callbacks
// and to drop references, so a thread that holds the GIL while waiting for the engine would
// deadlock; the binding never does.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "errors.h"
#include "terse/environment.h"

namespace terse::python {
namespace {

void bind(py::module_& m) {
  m.doc() = "terse's C++ core: codecs, stores, Communicator and the allreduce Engine.";
  m.attr("__version__") = TERSE_VERSION;
  register_errors(m);
  bind_codec_functions(m);
  bind_stores(m);
  bind_communicator(m);
  bind_options(m);
  bind_engine(m);
  bind_codec(m);
  bind_channel(m);
  // Close channels and engines still open before the interpreter finalizes (bindings.h).
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    close_open_channels();
    close_open_engines();
  }));
}

}  // namespace
}  // namespace terse::python

PYBIND11_MODULE(_C, m) {
  // The environment's process-wide settings, before any thread or buffer of terse.
  terse::set_process_options(terse::process_options_from_environment());
  terse::python::bind(m);
}
