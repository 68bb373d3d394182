// The parts of terse._C, one function per job; module.cpp calls them in this order (a class must
// be registered before signatures that name it are).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>

#include "terse/engine.h"

namespace terse::python {

namespace py = pybind11;

// codecs(), canonical_spec(), strategies(), default_timeout() (codec_binding.cpp).
void bind_codec_functions(py::module_& m);
// Store, file_store, tcp_store, prefix_store, python_store, bootstrap_from_env
// (store_binding.cpp).
void bind_stores(py::module_& m);
// Communicator (communicator_binding.cpp).
void bind_communicator(py::module_& m);
// AllreduceOptions, TensorPlan, EngineOptions (options_binding.cpp).
void bind_options(py::module_& m);
// Handle and Engine (engine_binding.cpp).
void bind_engine(py::module_& m);
// Codec, one stateless codec (codec_binding.cpp).
void bind_codec(py::module_& m);
// Channel (channel_binding.cpp).
void bind_channel(py::module_& m);

// Closes the engines and channels still open, before the interpreter finalizes: their threads
// take the GIL to run callbacks and drop references, which would crash then. Under the GIL.
void close_open_engines();
void close_open_channels();

// AllreduceOptions from Python's arguments (the strategy by name).
AllreduceOptions make_options(std::string codec, const std::string& strategy, int partitions,
                              bool average, std::size_t rows = 0,
                              const std::string& hierarchy = "auto");

}  // namespace terse::python
