// The edge: every environment variable the library honours, one parser each (terse/environment.h).
#include "terse/environment.h"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "kit/blas.h"
#include "kit/memory.h"
#include "terse/codec.h"
#include "terse/error.h"
#include "transport/scheduling.h"

namespace terse {
namespace {

// The variable's value; nothing where it is unset or empty (both mean "not given").
std::optional<std::string> variable(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

[[noreturn]] void bad(const char* name, std::string_view value, std::string_view allowed) {
  throw InvalidArgument(
      fmt::format("environment variable {}='{}' is not allowed: {}", name, value, allowed));
}

long long whole_number(const char* name, const std::string& v, long long lo, long long hi,
                       std::string_view allowed) {
  long long x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || p != v.data() + v.size() || x < lo || x > hi) bad(name, v, allowed);
  return x;
}

double seconds(const char* name, const std::string& v, bool zero_allowed, double hi,
               std::string_view allowed) {
  char* end = nullptr;
  const double s = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0' || !std::isfinite(s) || s < 0 || (s == 0 && !zero_allowed) ||
      s > hi) {
    bad(name, v, allowed);
  }
  return s;
}

// Codec specs separated by ';' or spaces (specs hold commas: "onebit:ef=1,scale=max"), each
// checked here so that a bad one names the variable.
std::vector<std::string> codec_list(const char* name, const std::string& v) {
  std::vector<std::string> out;
  std::string cur;
  for (std::size_t i = 0; i <= v.size(); ++i) {
    if (i == v.size() || v[i] == ';' || v[i] == ' ') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += v[i];
    }
  }
  if (out.empty()) bad(name, v, "codec specs separated by ';' or spaces");
  for (const auto& spec : out) {
    try {
      make_codec(spec);
    } catch (const Error& e) {
      bad(name, v, fmt::format("codec specs separated by ';' or spaces ({})", e.what()));
    }
  }
  return out;
}

// A topology spec's form (the world size checks the counts later): auto, flat, A,B,... or HxR
// with whole numbers of at least 1.
bool topology_spec(const std::string& v) {
  if (v == "auto" || v == "flat") return true;
  auto counts = [](std::string_view s, char sep, int most) {
    int parts = 0;
    while (true) {
      const auto at = s.find(sep);
      const std::string_view c = s.substr(0, at);
      int x = 0;
      const auto [p, ec] = std::from_chars(c.data(), c.data() + c.size(), x);
      if (ec != std::errc() || p != c.data() + c.size() || x < 1 || ++parts > most) return false;
      if (at == std::string_view::npos) return true;
      s.remove_prefix(at + 1);
    }
  };
  return v.find('x') != std::string::npos ? counts(v, 'x', 2) && v.find(',') == std::string::npos
                                          : counts(v, ',', 1 << 20);
}

constexpr std::string_view kThreads = "a whole number of worker threads in 1..256";

std::optional<int> threads_variable() {
  const auto v = variable("TERSE_THREADS");
  if (!v) return std::nullopt;
  return static_cast<int>(whole_number("TERSE_THREADS", *v, 1, 256, kThreads));
}

}  // namespace

void set_process_options(const ProcessOptions& options) {
  transport::set_batch_scheduling(options.batch_scheduling);
  kit::set_retained_budget(options.retained_bytes);
  kit::set_blas_threads_chosen(options.blas_threads_chosen);
}

ProcessOptions process_options_from_environment() {
  ProcessOptions o;
  if (const auto v = variable("TERSE_SCHED")) {
    if (*v == "normal") {
      o.batch_scheduling = false;
    } else if (*v != "batch") {
      bad("TERSE_SCHED", *v, "normal (threads keep their policy) or batch (the default)");
    }
  }
  if (const auto v = variable("TERSE_RETAIN_MB")) {
    constexpr long long kMaxMb = (std::int64_t{1} << 44);  // 16 EiB / 1 MiB: fits size_t bytes
    o.retained_bytes = static_cast<std::size_t>(whole_number(
                           "TERSE_RETAIN_MB", *v, 0, kMaxMb - 1,
                           "a whole number of MiB, 0 or more (0 keeps no freed block)"))
                       << 20;
  }
  for (const char* name : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (variable(name)) o.blas_threads_chosen = true;
  }
  return o;
}

CommunicatorOptions communicator_options_from_environment(CommunicatorOptions options) {
  // Parsed even where the caller's value stands: a bad value is an error wherever it is read.
  if (const auto v = variable("TERSE_TIMEOUT")) {
    const double s =
        seconds("TERSE_TIMEOUT", *v, false, 1e7, "a number of seconds above 0, at most 1e7");
    if (options.timeout.count() <= 0) {
      options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000 + 0.5));
    }
  }
  if (options.interface.empty()) {
    if (const auto v = variable("TERSE_IFNAME")) {
      options.interface = *v;
    } else if (const auto g = variable("GLOO_SOCKET_IFNAME")) {
      options.interface = *g;
    }
  }
  if (options.secret.empty()) {
    if (const auto v = variable("TERSE_JOB_SECRET")) options.secret = *v;
  }
  return options;
}

PlannerOptions planner_options_from_environment(PlannerOptions options) {
  if (const auto v = variable("TERSE_PLAN_CODECS")) {
    auto specs = codec_list("TERSE_PLAN_CODECS", *v);
    if (options.allowed.empty()) options.allowed = std::move(specs);
  }
  if (const auto v = variable("TERSE_PLAN_HEAVY_CODECS")) {
    auto specs = codec_list("TERSE_PLAN_HEAVY_CODECS", *v);
    if (options.heavy.empty()) options.heavy = std::move(specs);
  }
  if (const auto v = variable("TERSE_PLAN_LOG")) {
    if (*v == "1") {
      options.log = true;
    } else if (*v != "0") {
      bad("TERSE_PLAN_LOG", *v, "1 (print the calibration and decisions on rank 0) or 0");
    }
  }
  if (const auto v = variable("TERSE_PLAN_EXPLORE")) {
    options.explore_seconds = seconds("TERSE_PLAN_EXPLORE", *v, true, 1e7,
                                      "a number of seconds, 0 (no exploration) or more");
  }
  if (options.cache_directory.empty()) {
    if (const auto x = variable("XDG_CACHE_HOME")) {
      options.cache_directory = *x + "/terse";
    } else if (const auto h = variable("HOME")) {
      options.cache_directory = *h + "/.cache/terse";
    }
  }
  return options;
}

EngineOptions engine_options_from_environment(EngineOptions options) {
  if (const auto t = threads_variable(); t && options.threads == 0) options.threads = *t;
  if (options.trace_directory.empty() && !options.tracer) {
    if (const auto v = variable("TERSE_TRACE")) options.trace_directory = *v;
  }
  if (const auto v = variable("TERSE_TOPOLOGY"); v && options.topology == "auto") {
    if (!topology_spec(*v)) {
      bad("TERSE_TOPOLOGY", *v,
          "auto, flat, ranks per host as A,B,... (hosts of consecutive ranks) or HxR (H hosts "
          "of R ranks)");
    }
    options.topology = *v;
  }
  if (options.host.empty()) {
    if (const auto v = variable("TERSE_HOST")) {
      options.host = *v;
    } else if (const auto g = variable("GROUP_RANK")) {
      options.host = "node " + *g;  // torchrun's node index
    }
  }
  if (const auto v = variable("TERSE_INTRA_HOST"); v && options.intra_host == "auto") {
    if (*v != "auto" && *v != "tcp") bad("TERSE_INTRA_HOST", *v, "auto or tcp");
    options.intra_host = *v;
  }
  if (const auto v = variable("LOCAL_WORLD_SIZE"); v && options.local_ranks == 0) {
    options.local_ranks = static_cast<int>(
        whole_number("LOCAL_WORLD_SIZE", *v, 1, 1 << 20, "a whole number of ranks, 1 or more"));
  }
  if (const auto v = variable("WORLD_SIZE"); v && options.launched_ranks == 0) {
    options.launched_ranks = static_cast<int>(
        whole_number("WORLD_SIZE", *v, 1, 1 << 20, "a whole number of ranks, 1 or more"));
  }
  options.planner_options = planner_options_from_environment(std::move(options.planner_options));
  return options;
}

}  // namespace terse
