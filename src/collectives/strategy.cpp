// Strategies and operations by name, for specs, plans and logs.
#include <fmt/format.h>

#include <string_view>
#include <utility>

#include "terse/error.h"
#include "terse/plan.h"

namespace terse {

namespace {
constexpr std::pair<Strategy, std::string_view> kStrategyNames[] = {
    {Strategy::kAuto, "auto"},       {Strategy::kRaw, "raw"},   {Strategy::kAllgather, "allgather"},
    {Strategy::kSharded, "sharded"}, {Strategy::kRing, "ring"}, {Strategy::kSummable, "summable"},
    {Strategy::kAllToAll, "alltoall"},
};
}  // namespace

std::string_view to_string(Strategy s) {
  for (const auto& [v, name] : kStrategyNames) {
    if (v == s) return name;
  }
  return "?";
}

Strategy parse_strategy(std::string_view name) {
  for (const auto& [v, n] : kStrategyNames) {
    if (n == name) return v;
  }
  throw SpecError(fmt::format(
      "unknown strategy '{}' (allowed: auto, raw, allgather, sharded, ring, summable, alltoall)", name));
}

std::string_view to_string(Hierarchy h) {
  switch (h) {
    case Hierarchy::kAuto: return "auto";
    case Hierarchy::kFlat: return "flat";
    case Hierarchy::kHosts: return "hosts";
  }
  return "?";
}

Hierarchy parse_hierarchy(std::string_view name) {
  for (Hierarchy h : {Hierarchy::kAuto, Hierarchy::kFlat, Hierarchy::kHosts}) {
    if (to_string(h) == name) return h;
  }
  throw SpecError(fmt::format("unknown hierarchy '{}' (allowed: auto, flat, hosts)", name));
}

std::string_view to_string(Operation op) {
  switch (op) {
    case Operation::kAllreduce: return "allreduce";
    case Operation::kReduceScatter: return "reduce_scatter";
    case Operation::kAllGather: return "all_gather";
    case Operation::kAllToAll: return "all_to_all";
  }
  return "?";
}

}  // namespace terse
