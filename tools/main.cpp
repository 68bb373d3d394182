// The `terse` command: benchmarks, planning, calibration, the local launcher and the demo.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"
#include "terse/environment.h"
#include "terse/error.h"

namespace terse::tools {
namespace {
std::vector<std::string> arguments;
}  // namespace

void set_command_line(int argc, char** argv) { arguments.assign(argv + 1, argv + argc); }
const std::vector<std::string>& command_line() { return arguments; }
std::string self_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string("terse");
}
}  // namespace terse::tools

int main(int argc, char** argv) {
  terse::tools::set_command_line(argc, argv);
  CLI::App app{"terse: compression-aware collective communication for distributed training"};
  app.require_subcommand(1);
  terse::tools::add_codecs_command(app);
  terse::tools::add_run_command(app);
  terse::tools::add_calibrate_command(app);
  terse::tools::add_plan_command(app);
  terse::tools::add_plan_pipeline_command(app);
  terse::tools::add_trace_command(app);
  CLI::App* bench = app.add_subcommand("bench", "Run a benchmark");
  bench->require_subcommand(1);
  terse::tools::add_bench_codecs_command(*bench);
  terse::tools::add_bench_powersgd_command(*bench);
  terse::tools::add_bench_allreduce_command(*bench);
  terse::tools::add_bench_collectives_command(*bench);
  terse::tools::add_bench_planner_command(*bench);
  // `terse plan --pipeline ...` is the pipeline's planner: the same as `terse plan-pipeline ...`.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "plan" && args[1] == "--pipeline") {
    args.erase(args.begin() + 1);
    args[0] = "plan-pipeline";
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
  try {
    // The environment's process-wide settings (TERSE_SCHED, TERSE_RETAIN_MB, the BLAS's
    // threads) before any thread or buffer of terse; each command reads the rest where it makes
    // its communicators, planners and engines.
    terse::set_process_options(terse::process_options_from_environment());
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const terse::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
