// The explorer: the model errs by more than the gaps between its best few plans, so a new tensor
// size first times them in the job itself and keeps the fastest measured.
//
// The rule (docs/planner.md, Exploration, says the same): the contenders are the model's choice and
// its next best plans expected within kWithin times the choice's time (at most kMaxContenders
// in all), plus the best raw plan where it is within that factor too; beyond the choice and
// raw, a contender joins only while the first round's least runs (kMinRuns each, at its
// expected time) fit the budget. They run in rounds of sequential halving: what is left of the
// budget is split evenly over the rounds still to come (ceil(log2) of the contenders left) and
// each round's share evenly over its contenders, so each runs as many allreduces as its share
// buys at its expected time (kMinRuns to kMaxRuns). Within a round they take turns, one
// submission each, in an order shuffled alike on every rank; after the round every rank agrees
// on each run's time (the slowest rank's), exchanged at the same submission. Exploration
// settles when the fastest contender (by the median of its runs) beats every other by more
// than kConfidence standard errors of their paired log-ratios (runs paired in order within
// each round), when one contender is left, or when the budget is spent (the rounds so far, at
// their measured times, plus the next round's least runs exceed it); otherwise the slower half
// is eliminated and the next round runs. It settles on the fastest measured, except that a
// compressed plan must beat the best raw plan (its measured time, else its expected one) by
// min_gain.
//
// Pure logic: no communication and no clocks, so every rank that feeds it the same agreed
// times takes the same steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "terse/planner.h"

namespace terse::planner {

// Contenders are expected within this factor of the model's choice: the model's median error is
// about 10% and its worst tens of percent, so plans further off are rarely the best, and each
// run of one costs the job that much more.
inline constexpr double kWithin = 1.5;
// At most this many contenders besides the best raw plan. The plans within kWithin of the
// choice are mostly one codec's strategies at neighbouring partition counts, where the model's
// error is largest (its partition-count term prices pipelining, which the cores' contention
// bends either way); eight admit two strategies at three or four counts each, and sequential
// halving spends one round per halving, three after the first.
inline constexpr int kMaxContenders = 8;
// The paired test's bound: two standard errors leave about one wrong early stop in forty
// comparisons (one-sided), and a wrong stop costs at most the gap it could not resolve.
inline constexpr double kConfidence = 2.0;
// Runs of a contender in a round: at least kMinRuns (the engine does not time a
// configuration's first run, and a median and paired ratios need three), at most kMaxRuns (so
// that exploring fast tensors ends within a few hundred submissions).
inline constexpr int kMinRuns = 4;
inline constexpr int kMaxRuns = 32;

// The contenders of decision `d` (its `ranked` candidates, fastest expected first, and its
// choice) under `budget_seconds`: the choice first, the best raw plan (if any) last.
std::vector<PlanCandidate> pick_contenders(const PlanDecision& d, double budget_seconds);

class Explorer {
 public:
  // contenders: as pick_contenders() returns them (at least two). The choice (the first) runs
  // first: its first submission is the one that asked for the plan.
  Explorer(std::vector<PlanCandidate> contenders, double budget_seconds, double min_gain);

  const std::vector<PlanCandidate>& contenders() const { return contenders_; }
  bool settled() const { return settled_; }
  // Whether every live contender has had its runs this round (time for the exchange).
  bool round_done() const;
  // The contender for the next submission, counting `uses` runs for it (the tensors of this
  // size in that submission). Where the round is done, the last one again (nothing counted).
  std::size_t next(int uses = 1);
  // The contender the latest submission ran.
  std::size_t current() const { return current_; }
  // Ends the round with each contender's agreed run times of this round (indexed as
  // contenders(); empty for none) and decides what comes next: the next round, or settling.
  void end_round(const std::vector<std::vector<double>>& runs);
  // Once settled: the chosen contender and why ("one left", "confident", "budget").
  std::size_t winner() const { return winner_; }
  const std::string& why() const { return why_; }
  // A contender's measured time so far (the median of its agreed runs), if it has one.
  std::optional<double> time(std::size_t i) const;
  // Expected seconds spent on the rounds that ended (their runs at the measured times).
  double spent() const { return spent_; }
  // How many runs each contender has this round (0: eliminated).
  const std::vector<int>& runs() const { return runs_; }
  int round() const { return round_; }

 private:
  double expected(std::size_t i) const;
  // Runs for each live contender in the next round: their share of what is left of the budget.
  void plan_round();
  void start_pass();
  void settle(std::size_t leader, const char* why);

  std::vector<PlanCandidate> contenders_;
  double budget_;
  double min_gain_;
  std::vector<bool> alive_;
  std::vector<int> runs_;                 // this round's runs per contender (0: not in it)
  std::vector<int> uses_;                 // this round's uses per contender
  std::vector<std::vector<double>> all_;  // every agreed run, per contender
  std::vector<std::vector<std::vector<double>>> rounds_;  // per round, per contender
  std::vector<std::size_t> order_;                        // this pass's order
  std::size_t next_ = 0;                                  // position in order_
  std::uint64_t passes_ = 0;  // seeds each pass's shuffle alike on every rank
  std::size_t current_ = 0;
  int round_ = 0;
  double spent_ = 0;
  bool settled_ = false;
  std::size_t winner_ = 0;
  std::string why_;
};

}  // namespace terse::planner
