// Starting the ranks of a command that needs a whole job (benchmarks, calibration).
#pragma once

#include <string>

namespace terse::tools {

// Under a launcher (RANK is set) returns false: run this rank. Otherwise starts `ranks` local
// ranks of this same command line through `terse run` and returns true once they all exited;
// throws Error naming `what` if one failed.
bool relaunch_unless_launched(int ranks, const std::string& what);

}  // namespace terse::tools
