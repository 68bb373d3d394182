// Lets producers of handles other than the engine (the Channel) create and complete them.
#pragma once

#include <exception>
#include <functional>
#include <utility>

#include "terse/engine.h"

namespace terse {

struct HandleAccess {
  // A fresh handle and the function that completes it (call it exactly once).
  static std::pair<Handle, std::function<void(std::exception_ptr)>> make();
};

}  // namespace terse
