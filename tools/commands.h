// Subcommands of the `terse` tool. Each lives in its own file and adds itself to the app.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace terse::tools {

// The arguments this process was started with (without the program name), and the path of
// its executable, for commands that start more ranks of themselves.
void set_command_line(int argc, char** argv);
const std::vector<std::string>& command_line();
std::string self_path();

// terse codecs: list the registered codecs.
void add_codecs_command(CLI::App& app);
// terse bench codecs: single-thread codec throughput against a memory copy.
void add_bench_codecs_command(CLI::App& bench);
// terse bench powersgd: PowerSGD step time against the BLAS's sgemm peak.
void add_bench_powersgd_command(CLI::App& bench);
// terse bench allreduce: Gloo's rings, terse raw and compressed strategies, same processes.
void add_bench_allreduce_command(CLI::App& bench);
// terse bench collectives: reduce-scatter, all-gather, all-to-all against Gloo's, same processes.
void add_bench_collectives_command(CLI::App& bench);
// terse calibrate: links and codec costs for the planner, written to the cache.
void add_calibrate_command(CLI::App& app);
// terse plan: per-tensor decisions and predicted speedup before a job runs.
void add_plan_command(CLI::App& app);
// terse trace merge: one timeline of a whole job from the ranks' traces.
void add_trace_command(CLI::App& app);
// terse bench planner: predicted against measured allreduce times; auto against exhaustive.
void add_bench_planner_command(CLI::App& bench);
// terse run: the local launcher (N ranks with torchrun's environment).
void add_run_command(CLI::App& app);
void add_plan_pipeline_command(CLI::App& app);  // terse plan-pipeline (Python cost model)

}  // namespace terse::tools
