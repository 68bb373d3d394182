// What calibrate()'s parts share (calibration.cpp, cpu_meter.cpp, engine_probes.cpp,
// link_probes.cpp): the clock, progress lines, and the CPU and engine measurements.
// Internal to the planner.
#pragma once

#include <chrono>
#include <string>

#include "planner/calibration.h"

namespace terse::planner {

using Clock = std::chrono::steady_clock;

// A progress line on stderr, from rank 0 only, unless `quiet`.
void log_line(bool quiet, int rank, const std::string& line);

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Measures everything on the CPU side: the strategies' fp32 work, every codec of
// options.codecs, and the CPU contention of several threads per rank. With a communicator,
// ranks measure in lockstep and the per-point times are agreed (median over ranks) before
// fitting; without one, this process alone.
void measure_cpu(Communicator* comm, const CalibrationOptions& options, Calibration& out);

// Measures the engine's round latency (alpha), its fixed costs per task and per allreduce, its
// CPU per message, and then its cost per byte (measure_engine_beta). A collective. Returns
// what measure_engine_beta does: whether the links paced its raw allreduce.
bool measure_engine(Communicator& comm, Calibration& c, AllreduceProbe& probe);

}  // namespace terse::planner
