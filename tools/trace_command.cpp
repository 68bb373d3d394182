// terse trace merge DIR: one Chrome-trace timeline of a whole job from the per-rank traces that
// TERSE_TRACE=DIR makes the engine write (DIR/rank-R.json), with every rank's timestamps moved
// to rank 0's clock by the offset recorded in its file, and a summary of where the time went:
// per rank the busy time of each stage and how long its link sat idle, per tensor the rank that
// finished last (stragglers).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "terse/error.h"

namespace terse::tools {
namespace {

struct Options {
  std::string dir;
  std::string out;
};

using Interval = std::pair<double, double>;  // begin, end (microseconds)

// Total length of the union of intervals.
double covered(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  double total = 0, begin = 0, end = -std::numeric_limits<double>::infinity();
  for (const auto& [b, e] : v) {
    if (b > end) {
      if (end > begin) total += end - begin;
      begin = b;
      end = e;
    } else {
      end = std::max(end, e);
    }
  }
  if (end > begin) total += end - begin;
  return total;
}

struct RankTrace {
  int rank = 0;
  double offset_us = 0;
  nlohmann::json events;
};

void merge(const Options& opt) {
  std::vector<RankTrace> ranks;
  for (const auto& entry : std::filesystem::directory_iterator(opt.dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank-", 0) != 0 || entry.path().extension() != ".json") continue;
    std::ifstream f(entry.path());
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      throw InvalidArgument(fmt::format("trace merge: {}: {}", entry.path().string(), e.what()));
    }
    RankTrace t;
    const auto meta = j.value("otherData", nlohmann::json::object());
    t.rank = meta.value("rank", std::stoi(name.substr(5)));
    t.offset_us = meta.value("clock_offset_ns", 0.0) / 1e3;
    t.events = j.at("traceEvents");
    ranks.push_back(std::move(t));
  }
  if (ranks.empty()) {
    throw InvalidArgument(fmt::format("trace merge: no rank-*.json in {} (run with TERSE_TRACE={})",
                                      opt.dir, opt.dir));
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const auto& a, const auto& b) { return a.rank < b.rank; });

  // Aligned times, starting at the job's first event.
  double origin = std::numeric_limits<double>::infinity();
  for (const auto& t : ranks) {
    for (const auto& e : t.events) {
      if (e.value("ph", "") == "X")
        origin = std::min(origin, e.at("ts").get<double>() + t.offset_us);
    }
  }
  nlohmann::json merged;
  merged["displayTimeUnit"] = "ms";
  merged["otherData"]["ranks"] = ranks.size();
  merged["otherData"]["clock_offsets_ns"] = nlohmann::json::array();
  merged["traceEvents"] = nlohmann::json::array();
  fmt::print("terse trace merge: {} ranks from {}\n", ranks.size(), opt.dir);
  fmt::print("{:>5} {:>10} {:>11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "rank", "offset us",
             "span ms", "encode", "decode", "merge", "send", "recv", "link idle");
  std::map<std::string, std::vector<std::pair<int, double>>> tensor_end;  // per rank
  std::map<std::string, std::pair<double, double>> tensor_span;
  for (const auto& t : ranks) {
    merged["otherData"]["clock_offsets_ns"].push_back(t.offset_us * 1e3);
    std::map<std::string, std::vector<Interval>> stages;
    double first = std::numeric_limits<double>::infinity(), last = -first;
    std::map<std::string, double> ends;
    for (auto e : t.events) {
      if (e.value("ph", "") == "X") {
        const double ts = e.at("ts").get<double>() + t.offset_us - origin;
        const double end = ts + e.at("dur").get<double>();
        e["ts"] = ts;
        stages[e.at("name").get<std::string>()].push_back({ts, end});
        first = std::min(first, ts);
        last = std::max(last, end);
        const std::string tensor = e["args"].value("tensor", "");
        ends[tensor] = std::max(ends[tensor], end);
        auto [it, fresh] = tensor_span.emplace(tensor, Interval{ts, end});
        if (!fresh) it->second = {std::min(it->second.first, ts), std::max(it->second.second, end)};
      }
      merged["traceEvents"].push_back(std::move(e));
    }
    for (const auto& [tensor, end] : ends) tensor_end[tensor].push_back({t.rank, end});
    auto busy = [&](const char* stage) { return covered(stages[stage]) / 1e3; };
    std::vector<Interval> link = stages["send"];
    link.insert(link.end(), stages["recv"].begin(), stages["recv"].end());
    const double span = last > first ? (last - first) / 1e3 : 0;
    fmt::print(
        "{:>5} {:>10.1f} {:>11.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} "
        "{:>10.3f}\n",
        t.rank, t.offset_us, span, busy("encode"), busy("decode"), busy("merge"), busy("send"),
        busy("recv"), span - covered(link) / 1e3);
  }
  fmt::print(
      "(ms of wall time each stage was running on some worker thread; link idle: no send "
      "or receive waiting)\n");
  // Stragglers: per tensor, how much later than the first rank the last one finished.
  struct Lag {
    std::string tensor;
    int rank;
    double lag_ms;
    double span_ms;
  };
  std::vector<Lag> lags;
  for (const auto& [tensor, v] : tensor_end) {
    if (v.size() < 2) continue;
    auto [lo, hi] = std::minmax_element(
        v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    const auto& span = tensor_span[tensor];
    lags.push_back(
        {tensor, hi->first, (hi->second - lo->second) / 1e3, (span.second - span.first) / 1e3});
  }
  std::sort(lags.begin(), lags.end(),
            [](const Lag& a, const Lag& b) { return a.lag_ms > b.lag_ms; });
  if (!lags.empty()) {
    fmt::print("{:<40} {:>12} {:>14} {:>10}\n", "tensor (largest lag first)", "span ms",
               "last rank", "lag ms");
    for (std::size_t i = 0; i < std::min<std::size_t>(lags.size(), 8); ++i) {
      fmt::print("{:<40} {:>12.3f} {:>14} {:>10.3f}\n", lags[i].tensor.substr(0, 40),
                 lags[i].span_ms, lags[i].rank, lags[i].lag_ms);
    }
  }
  const std::string out = opt.out.empty() ? opt.dir + "/merged.json" : opt.out;
  std::ofstream(out) << merged.dump() << "\n";
  fmt::print("wrote {} ({} events; open in chrome://tracing or ui.perfetto.dev)\n", out,
             merged["traceEvents"].size());
}

}  // namespace

void add_trace_command(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  CLI::App* trace = app.add_subcommand("trace", "Work with traces written under TERSE_TRACE");
  trace->require_subcommand(1);
  CLI::App* cmd = trace->add_subcommand(
      "merge", "One timeline of the whole job from DIR/rank-*.json, clocks aligned");
  cmd->add_option("dir", opt->dir, "The TERSE_TRACE directory")->required();
  cmd->add_option("-o,--out", opt->out, "Merged trace (default: DIR/merged.json)");
  cmd->callback([opt] { merge(*opt); });
}

}  // namespace terse::tools
