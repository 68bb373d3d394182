#include "launch.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "commands.h"
#include "terse/error.h"

namespace terse::tools {

bool relaunch_unless_launched(int ranks, const std::string& what) {
  if (std::getenv("RANK") != nullptr) return false;
  std::vector<std::string> args = {self_path(),           "run", "-n",
                                   std::to_string(ranks), "--",  self_path()};
  for (const auto& a : command_line()) args.push_back(a);
  std::string line;
  for (const auto& a : args) line += "'" + a + "' ";
  const int rc = std::system(line.c_str());
  if (rc != 0) throw Error(fmt::format("{}: ranks failed (status {})", what, rc));
  return true;
}

}  // namespace terse::tools
