// Subcommands of the `terse` tool. Each lives in its own file and adds itself to the app.
#pragma once

#include <CLI/CLI.hpp>

namespace terse::tools {

// terse codecs: list the registered codecs.
void add_codecs_command(CLI::App& app);
// terse bench codecs: single-thread codec throughput against a memory copy.
void add_bench_codecs_command(CLI::App& bench);
// terse bench powersgd: PowerSGD step time against the BLAS's sgemm peak.
void add_bench_powersgd_command(CLI::App& bench);
// terse run: the local launcher (N ranks with torchrun's environment).
void add_run_command(CLI::App& app);

}  // namespace terse::tools
