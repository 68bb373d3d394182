// terse plan-pipeline: the pipeline cost model (python/terse/pipeline_model.py), which predicts
// the step time of a pipeline-parallel model for each boundary compressor before a run. The
// model and its calibration (a short measured run of the stages, micro-benchmarks of each
// compressor with torch tensors) live in Python, next to the runtime they describe, so this
// command only execs `python3 -m terse.plan_pipeline ARGS...`. In a build tree it puts the
// build's package on PYTHONPATH and, where the source tree's benchmark harness is, runs
// `python3 -m terse_harness.plan_pipeline` instead: the same planner whose --model calibrates
// on the pipeline benchmark's workloads.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"

namespace terse::tools {
namespace {

// TERSE_PYTHON if set. A command that pip installed into a virtual environment has that
// environment's interpreter beside it, the one that imports its package. Otherwise (the build
// tree, /usr/local/bin, ~/.local/bin) /usr/bin/python3, the only one Debian's torch imports
// into (docs/python.md).
std::string python_interpreter() {
  const char* env = std::getenv("TERSE_PYTHON");
  if (env != nullptr && *env != '\0') return env;
  const std::filesystem::path beside = std::filesystem::path(self_path()).parent_path() / "python3";
  if (::access(beside.c_str(), X_OK) == 0) return beside.string();
  return "/usr/bin/python3";
}

[[noreturn]] void exec_planner(const std::vector<std::string>& args) {
  // The build tree keeps the package beside the executable (build/python/terse), and the
  // harness stays in the source tree it was built from; an installed terse relies on the
  // interpreter's own path (site-packages).
  const std::filesystem::path package = std::filesystem::path(self_path()).parent_path() / "python";
  std::string module = "terse.plan_pipeline";
  if (std::filesystem::exists(package / "terse" / "plan_pipeline.py")) {
    std::string path = package.string();
    const std::filesystem::path harness = TERSE_HARNESS_DIR;
    if (std::filesystem::exists(harness / "terse_harness" / "plan_pipeline.py")) {
      path += ":" + harness.string();
      module = "terse_harness.plan_pipeline";
    }
    const char* old = std::getenv("PYTHONPATH");
    if (old != nullptr && *old != '\0') path += ":" + std::string(old);
    ::setenv("PYTHONPATH", path.c_str(), 1);
  }
  const std::string python = python_interpreter();
  std::vector<std::string> argv_strings = {python, "-m", module};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execv(python.c_str(), argv.data());
  std::fprintf(stderr, "terse plan-pipeline: cannot run %s: %s (set TERSE_PYTHON)\n",
               python.c_str(), std::strerror(errno));
  std::_Exit(127);
}

}  // namespace

void add_plan_pipeline_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "plan-pipeline",
      "Predict a pipeline's step time for each boundary compressor (runs python3 -m "
      "terse.plan_pipeline; its --help lists the options)");
  // Every argument, --help included, belongs to the Python planner.
  cmd->set_help_flag();
  cmd->prefix_command();
  cmd->callback([cmd] { exec_planner(cmd->remaining()); });
}

}  // namespace terse::tools
