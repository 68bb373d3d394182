// A terse::Store backed by a Python object with torch.distributed.Store's methods:
//   set(key: str, value: bytes), get(key: str) -> bytes, wait(keys: list[str], timeout: timedelta)
// so that terse bootstraps through the rendezvous store a PyTorch job already has (TCPStore under
// torchrun, FileStore with file:// init, a PrefixStore over either).
//
// Gloo calls the store from whatever thread creates the communicator, with the GIL released by
// the binding; each call takes the GIL, and torch's own store methods release it again while they
// block on the network.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "terse/communicator.h"

namespace terse::python {

std::shared_ptr<Store> make_python_store(pybind11::object store);

}  // namespace terse::python
