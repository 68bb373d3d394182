// The `terse` command: benchmarks, planning, calibration, the local launcher and the demo.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "terse/error.h"

int main(int argc, char** argv) {
  CLI::App app{"terse: compression-aware collective communication for distributed training"};
  app.require_subcommand(1);
  terse::tools::add_codecs_command(app);
  terse::tools::add_run_command(app);
  CLI::App* bench = app.add_subcommand("bench", "Run a benchmark");
  bench->require_subcommand(1);
  terse::tools::add_bench_codecs_command(*bench);
  terse::tools::add_bench_powersgd_command(*bench);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const terse::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
