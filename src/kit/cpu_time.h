// The process's CPU clock, as the calibration and the benchmarks read it (one definition, so
// that the planner's CPU figures and `terse bench`'s "CPU s" are the same measure).
#pragma once

#include <sys/resource.h>
#include <time.h>

namespace terse::kit {

// CPU seconds (user + system) this process has used: every thread, and the kernel's work on
// its behalf. getrusage counts microseconds.
inline double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// The same clock at nanosecond resolution (clock_gettime), for runs of a few microseconds.
inline double process_cpu_clock() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace terse::kit
