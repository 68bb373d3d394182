// In-memory trace recording and Chrome-trace JSON output.
#include "terse/trace.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>

#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/tags.h"

namespace terse {

std::int64_t trace_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceRecorder::record(TraceEvent event) {
  std::lock_guard lock(mu_);
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> TraceRecorder::events() const {
  std::lock_guard lock(mu_);
  return events_;
}

void TraceRecorder::clear() {
  std::lock_guard lock(mu_);
  events_.clear();
}

namespace {

std::string json_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void TraceRecorder::write_chrome_json(const std::string& path, int rank,
                                      std::int64_t offset_ns) const {
  auto events = this->events();
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "w"), &std::fclose);
  if (!f) throw InvalidArgument(fmt::format("trace: cannot write {}", path));
  fmt::print(f.get(), "{{\"otherData\":{{\"rank\":{},\"clock_offset_ns\":{}}},\n", rank,
             offset_ns);
  fmt::print(f.get(), "\"traceEvents\":[\n");
  fmt::print(f.get(),
             "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{0},\"args\":{{\"name\":\"rank "
             "{0}\"}}}}",
             rank);
  for (const auto& e : events) {
    fmt::print(f.get(),
               ",\n{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":{},"
               "\"ts\":{:.3f},\"dur\":{:.3f},\"args\":{{\"tensor\":\"{}\",\"partition\":{},"
               "\"peer\":{},\"bytes\":{}}}}}",
               e.stage, e.stage, rank, e.thread, e.begin_ns / 1e3,
               (e.end_ns - e.begin_ns) / 1e3, json_escape(e.tensor), e.partition, e.peer,
               e.bytes);
  }
  fmt::print(f.get(), "\n]}}\n");
}

std::int64_t measure_clock_offset(Communicator& comm, int rounds) {
  const int n = comm.size(), r = comm.rank();
  std::int64_t mine = 0;
  for (int peer = 1; peer < n; ++peer) {
    if (r != 0 && r != peer) continue;
    const int other = r == 0 ? peer : 0;
    std::int64_t best_delay = INT64_MAX, best_offset = 0;
    for (int i = 0; i < rounds; ++i) {
      const std::uint64_t tag = tags::reserved(tags::kClockSignature, peer, i);
      if (r == 0) {
        std::int64_t sent[1], reply[2];
        Request rx = comm.recv(other, tag, std::as_writable_bytes(std::span(reply)), "clock");
        sent[0] = trace_now_ns();
        comm.send(other, tag, std::as_bytes(std::span(sent)), "clock").wait();
        rx.wait();
        const std::int64_t t3 = trace_now_ns();
        // reply = {t1: peer received, t2: peer replied}, on the peer's clock.
        const std::int64_t delay = (t3 - sent[0]) - (reply[1] - reply[0]);
        if (delay < best_delay) {
          best_delay = delay;
          best_offset = ((reply[0] - sent[0]) + (reply[1] - t3)) / 2;  // peer ahead of rank 0
        }
      } else {
        std::int64_t got[1], reply[2];
        comm.recv(other, tag, std::as_writable_bytes(std::span(got)), "clock").wait();
        reply[0] = trace_now_ns();
        reply[1] = trace_now_ns();
        comm.send(other, tag, std::as_bytes(std::span(reply)), "clock").wait();
      }
    }
    // Rank 0 tells the peer its estimate: the peer adds minus its lead to reach rank 0's clock.
    const std::uint64_t tag = tags::reserved(tags::kClockSignature, peer, rounds);
    std::int64_t result[1] = {-best_offset};
    if (r == 0) {
      comm.send(other, tag, std::as_bytes(std::span(result)), "clock").wait();
    } else {
      comm.recv(other, tag, std::as_writable_bytes(std::span(result)), "clock").wait();
      mine = result[0];
    }
  }
  return mine;
}

}  // namespace terse
