// Stage events of the engine (encode, send, recv, decode, merge, wait, copy), for timelines and
// for the planner's measured stage times. A Tracer is shared by the engine's threads.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "terse/export.h"

namespace terse {

class Communicator;

struct TraceEvent {
  const char* stage = "";  // a string literal: "encode", "send", "recv", ...
  std::string tensor;      // tensor name (or the fused group's label)
  int partition = -1;
  int peer = -1;           // the other rank of a send or recv; -1 for local work
  std::uint64_t bytes = 0;
  std::int64_t begin_ns = 0;  // steady_clock, nanoseconds
  std::int64_t end_ns = 0;
  std::uint32_t thread = 0;   // small id of the worker thread
};

class TERSE_API Tracer {
 public:
  virtual ~Tracer() = default;
  // Called from any engine thread; must be thread-safe and cheap.
  virtual void record(TraceEvent event) = 0;
};

// Keeps every event in memory; writes them as Chrome-trace JSON (chrome://tracing, Perfetto).
class TERSE_API TraceRecorder final : public Tracer {
 public:
  void record(TraceEvent event) override;
  std::vector<TraceEvent> events() const;
  void clear();
  // One process (pid = rank) with one track per worker thread; times in microseconds of this
  // process's steady clock, as recorded. offset_ns (from measure_clock_offset) goes into the
  // file's metadata ("otherData": {"rank", "clock_offset_ns"}); `terse trace merge` adds it
  // to every timestamp to put all ranks on rank 0's clock.
  void write_chrome_json(const std::string& path, int rank, std::int64_t offset_ns = 0) const;

 private:
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
};

// steady_clock now, in nanoseconds (the time base of TraceEvent).
TERSE_API std::int64_t trace_now_ns();

// How far rank 0's steady clock is ahead of this rank's, in nanoseconds (0 on rank 0): add it
// to this rank's trace_now_ns() values to express them on rank 0's clock. Rank 0 exchanges
// `rounds` timestamp ping-pongs with each rank in turn and keeps, per rank, NTP's estimate
// ((t1 - t0) + (t2 - t3)) / 2 from the round trip with the least delay; the error is at most
// half that delay. A collective; every wait is bounded by the communicator's timeout.
TERSE_API std::int64_t measure_clock_offset(Communicator& comm, int rounds = 16);

}  // namespace terse
