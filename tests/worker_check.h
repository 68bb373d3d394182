// The checks of the multi-process tests' worker programs (tests/<layer>/worker/): a failed
// check prints "CHECK FAILED: ..." and ends the process with status 2 at once (no destructors:
// other threads may hold the communicator), which the test that started it reports.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace terse::testing {

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "CHECK FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

inline void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

}  // namespace terse::testing
