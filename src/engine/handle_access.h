// Lets the parts of the engine and other producers of handles (the Channel) create and complete
// them.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <utility>

#include "terse/engine.h"

namespace terse {

struct HandleAccess {
  // A fresh handle and the function that completes it (call it exactly once).
  static std::pair<Handle, std::function<void(std::exception_ptr)>> make();
  // A handle of a state that its producer completes (Handle::State::complete).
  static Handle of(std::shared_ptr<Handle::State> state);
};

}  // namespace terse
