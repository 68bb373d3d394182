// The explorer's rule: src/planner/explorer.h.
#include "planner/explorer.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "planner/exchange.h"

namespace terse::planner {

std::vector<PlanCandidate> pick_contenders(const PlanDecision& d, double budget_seconds) {
  std::vector<PlanCandidate> out = {d.chosen};
  if (budget_seconds <= 0) return out;
  const double limit = kWithin * PlanDecision::expected(d.chosen);
  // The best raw plan: the first raw one of `ranked`, fastest expected first.
  const auto raw = std::find_if(d.ranked.begin(), d.ranked.end(), [](const PlanCandidate& c) {
    return c.plan.strategy == Strategy::kRaw;
  });
  const bool raw_joins = raw != d.ranked.end() && plan_key(raw->plan) != plan_key(d.chosen.plan) &&
                         PlanDecision::expected(*raw) <= limit;
  // The first round's least cost of the contenders taken so far.
  double least = kMinRuns * PlanDecision::expected(d.chosen);
  if (raw_joins) least += kMinRuns * PlanDecision::expected(*raw);
  for (const auto& c : d.ranked) {
    if (static_cast<int>(out.size()) >= kMaxContenders) break;
    const double t = PlanDecision::expected(c);
    if (t > limit) break;  // fastest expected first: the rest are slower still
    if (plan_key(c.plan) == plan_key(d.chosen.plan) || (raw_joins && &c == &*raw)) continue;
    if (least + kMinRuns * t > budget_seconds) break;
    least += kMinRuns * t;
    out.push_back(c);
  }
  if (raw_joins) out.push_back(*raw);
  return out;
}

Explorer::Explorer(std::vector<PlanCandidate> contenders, double budget_seconds, double min_gain)
    : contenders_(std::move(contenders)),
      budget_(budget_seconds),
      min_gain_(min_gain),
      alive_(contenders_.size(), true),
      runs_(contenders_.size(), 0),
      uses_(contenders_.size(), 0),
      all_(contenders_.size()) {
  plan_round();
  start_pass();
}

double Explorer::expected(std::size_t i) const {
  const auto t = time(i);
  return t ? *t : PlanDecision::expected(contenders_[i]);
}

std::optional<double> Explorer::time(std::size_t i) const {
  if (all_[i].empty()) return std::nullopt;
  return median(all_[i]);
}

void Explorer::plan_round() {
  int live = 0;
  for (bool a : alive_) live += a;
  const int rounds_left = std::max(1, static_cast<int>(std::ceil(std::log2(std::max(live, 1)))));
  const double share = std::max(0.0, budget_ - spent_) / rounds_left / std::max(live, 1);
  for (std::size_t i = 0; i < contenders_.size(); ++i) {
    const double t = expected(i);
    const double buys = t > 0 ? std::floor(share / t) : kMaxRuns;
    runs_[i] = alive_[i] ? static_cast<int>(std::clamp<double>(buys, kMinRuns, kMaxRuns)) : 0;
  }
  uses_.assign(contenders_.size(), 0);
}

void Explorer::start_pass() {
  order_.resize(contenders_.size());
  for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = i;
  // The very first pass starts with the choice: it runs in the submission that asked for a
  // plan. Fisher-Yates by the generator's raw output (std::shuffle's use of it is the standard
  // library's own, and ranks must agree).
  const std::size_t first = passes_ == 0 ? 1 : 0;
  std::mt19937_64 gen(++passes_);
  for (std::size_t j = order_.size(); j > first + 1; --j) {
    std::swap(order_[j - 1], order_[first + gen() % (j - first)]);
  }
  next_ = 0;
}

bool Explorer::round_done() const {
  for (std::size_t i = 0; i < contenders_.size(); ++i) {
    if (uses_[i] < runs_[i]) return false;
  }
  return true;
}

std::size_t Explorer::next(int uses) {
  if (settled_ || round_done()) return current_;
  for (;;) {  // a fresh pass has one: the round is not done
    while (next_ < order_.size()) {
      const std::size_t i = order_[next_++];
      if (uses_[i] < runs_[i]) {
        current_ = i;
        uses_[i] += uses;
        return i;
      }
    }
    start_pass();
  }
}

void Explorer::end_round(const std::vector<std::vector<double>>& runs) {
  if (settled_) return;
  const std::size_t n = contenders_.size();
  rounds_.emplace_back(n);
  for (std::size_t i = 0; i < n && i < runs.size(); ++i) {
    if (runs_[i] == 0) continue;
    all_[i].insert(all_[i].end(), runs[i].begin(), runs[i].end());
    rounds_.back()[i] = runs[i];
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (runs_[i] == 0) continue;
    spent_ += uses_[i] * expected(i);
    // A contender that has never been timed (it travelled fused, say) cannot compete.
    if (all_[i].empty()) alive_[i] = false;
  }
  std::vector<std::size_t> live;
  for (std::size_t i = 0; i < n; ++i) {
    if (alive_[i]) live.push_back(i);
  }
  if (live.empty()) return settle(0, "unmeasured");
  // Fastest first (the earlier contender on a tie: the model's order).
  std::stable_sort(live.begin(), live.end(),
                   [&](std::size_t a, std::size_t b) { return *time(a) < *time(b); });
  const std::size_t leader = live.front();
  if (live.size() == 1) return settle(leader, "one left");
  // The paired test: each other contender's runs against the leader's, paired in order within
  // each round (they ran in the same passes), as log-ratios.
  bool confident = true;
  for (std::size_t k = 1; k < live.size() && confident; ++k) {
    std::vector<double> d;
    for (const auto& round : rounds_) {
      const auto& a = round[leader];
      const auto& b = round[live[k]];
      for (std::size_t j = 0; j < std::min(a.size(), b.size()); ++j) {
        if (a[j] > 0 && b[j] > 0) d.push_back(std::log(b[j] / a[j]));
      }
    }
    if (d.size() < 3) {
      confident = false;
      break;
    }
    double mean = 0;
    for (double x : d) mean += x;
    mean /= static_cast<double>(d.size());
    double var = 0;
    for (double x : d) var += (x - mean) * (x - mean);
    var /= static_cast<double>(d.size() - 1);
    const double se = std::sqrt(var / static_cast<double>(d.size()));
    confident = mean > 0 && mean > kConfidence * se;
  }
  if (confident) return settle(leader, "confident");
  // Successive halving: the faster half goes on (the larger half of an odd count).
  const std::size_t keep = (live.size() + 1) / 2;
  for (std::size_t k = keep; k < live.size(); ++k) alive_[live[k]] = false;
  if (keep == 1) return settle(leader, "one left");
  double least = 0;
  for (std::size_t k = 0; k < keep; ++k) least += kMinRuns * expected(live[k]);
  if (spent_ + least > budget_) return settle(leader, "budget");
  ++round_;
  plan_round();
  start_pass();
}

void Explorer::settle(std::size_t leader, const char* why) {
  settled_ = true;
  winner_ = leader;
  why_ = why;
  // Do no harm: a compressed plan must beat the best raw one by min_gain.
  std::optional<std::size_t> raw;
  for (std::size_t i = 0; i < contenders_.size(); ++i) {
    if (contenders_[i].plan.strategy != Strategy::kRaw) continue;
    if (!raw || expected(i) < expected(*raw)) raw = i;
  }
  if (raw && contenders_[leader].plan.strategy != Strategy::kRaw &&
      expected(leader) > (1 - min_gain_) * expected(*raw)) {
    winner_ = *raw;
    why_ += ", raw by min_gain";
  }
  std::fill(runs_.begin(), runs_.end(), 0);
}

}  // namespace terse::planner
