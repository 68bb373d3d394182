// Helpers shared by the `terse bench` commands: pre-touched buffers and medians of timed runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "kit/cpu_time.h"  // the CPU clock the planner reads, so "CPU s" agree
#include "kit/memory.h"    // page-touched buffers, as the engine allocates them
#include "terse/communicator.h"
#include "terse/engine.h"

namespace terse::tools {

// A zeroed buffer whose pages are touched once before timing, so figures exclude first-touch
// faults (about 10 µs per 4 KiB page on the machines we target; see shared/CLUSTER.md). Large
// ones are in transparent huge pages, advised before that first touch (kit/memory.h), as the
// engine's own buffers are.
template <typename T>
kit::PageArray<T> touched(std::size_t n) {
  return kit::PageArray<T>(n);
}

// The median of a sample (the upper middle one for an even count); 0 for an empty sample.
inline double median(std::vector<double> t) {
  if (t.empty()) return 0;
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Runs f once to warm up, then `reps` timed times; returns the median in seconds.
template <typename F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  f();
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(std::move(t));
}

// Every rank's value, gathered (through the communicator's own collectives).
inline std::vector<double> gather(Communicator& comm, double v) {
  std::vector<double> all(comm.size());
  std::vector<std::size_t> sizes(comm.size(), sizeof(double));
  comm.allgatherv(std::as_bytes(std::span(&v, 1)), std::as_writable_bytes(std::span(all)), sizes,
                  "bench");
  return all;
}

inline double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

// Warm-up runs to make after an allreduce's first use (the cross-rank check, buffers), so that
// every worker thread has met the configuration before it is timed: a thread's scratch memory
// is touched on its first task of a size (about 10 us a page here; error feedback's scratch is
// a copy of the partition), and which thread takes a partition is up to the queue. About 8
// tasks; none for configurations that take over 0.5 s a run.
inline int extra_warm_ups(int partitions, double seconds_per_run) {
  return seconds_per_run > 0.5 ? 0 : std::clamp(8 / std::max(partitions, 1), 1, 8);
}

// `reps` timed allreduces of `data` through the engine, each starting from `input` after a
// barrier; each figure is the slowest rank's time in seconds. Warm up before calling. With
// `cpu`, this process's CPU seconds (all threads) during the allreduces are added to it.
inline std::vector<double> time_allreduce(Engine& engine, Communicator& comm,
                                          const std::string& name, std::span<float> data,
                                          std::span<const float> input,
                                          const AllreduceOptions& options, int reps,
                                          double* cpu = nullptr) {
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    std::copy(input.begin(), input.end(), data.begin());
    comm.barrier("bench");
    const double c0 = cpu ? kit::process_cpu_seconds() : 0;
    const auto t0 = std::chrono::steady_clock::now();
    engine.allreduce(name, data, options).wait();
    if (cpu) *cpu += kit::process_cpu_seconds() - c0;
    times.push_back(max_of(gather(
        comm, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count())));
  }
  return times;
}

}  // namespace terse::tools
