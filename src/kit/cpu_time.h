// The process's CPU clock, as the calibration and the benchmarks read it (one definition, so
// that the planner's CPU figures and `terse bench`'s "CPU s" are the same measure).
#pragma once

#include <time.h>

namespace terse::kit {

// CPU seconds (user + system) this process has used: every thread, and the kernel's work on
// its behalf, at nanosecond resolution (CLOCK_PROCESS_CPUTIME_ID; getrusage's total is the
// same clock rounded to microseconds), so that runs of a few microseconds can be timed.
inline double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace terse::kit
