// In-memory trace recording and Chrome-trace JSON output.
#include "terse/trace.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "terse/error.h"

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
  fmt::print(f.get(), "{{\"traceEvents\":[\n");
  fmt::print(f.get(),
             "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{0},\"args\":{{\"name\":\"rank "
             "{0}\"}}}}",
             rank);
  for (const auto& e : events) {
    fmt::print(f.get(),
               ",\n{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":{},"
               "\"ts\":{:.3f},\"dur\":{:.3f},\"args\":{{\"tensor\":\"{}\",\"partition\":{},"
               "\"peer\":{},\"bytes\":{}}}}}",
               e.stage, e.stage, rank, e.thread, (e.begin_ns + offset_ns) / 1e3,
               (e.end_ns - e.begin_ns) / 1e3, json_escape(e.tensor), e.partition, e.peer,
               e.bytes);
  }
  fmt::print(f.get(), "\n]}}\n");
}

}  // namespace terse
