// What the planner's parts share: agreeing on numbers across ranks, medians, link probes.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "planner/calibration.h"
#include "terse/communicator.h"

namespace terse::planner {

// Every rank's vector (all of the same length), in rank order. A collective.
std::vector<std::vector<double>> gather(Communicator& comm, std::span<const double> mine);
// Element-wise largest over ranks: the same vector on every rank. A collective.
std::vector<double> agree_max(Communicator& comm, std::vector<double> mine);
// Element-wise median over ranks (mean of the middle two for an even count). A collective.
std::vector<double> agree_median(Communicator& comm, std::vector<double> mine);
// Every rank's text, in rank order. A collective.
std::vector<std::string> gather_text(Communicator& comm, const std::string& mine);

// The median of a sample (the upper middle one for an even count); 0 for an empty sample.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// The standard error of a sample's median, from its spread: 1.2533 sigma / sqrt(size), sigma
// estimated robustly as the interquartile range over 1.349 (both exact for a normal sample), so
// that a few runs slowed by outside load do not make every gap look like noise. 0 for fewer
// than 4 values (no spread to speak of).
inline double median_standard_error(std::vector<double> v) {
  if (v.size() < 4) return 0;
  std::sort(v.begin(), v.end());
  auto quantile = [&](double q) {  // linear between order statistics
    const double at = q * static_cast<double>(v.size() - 1);
    const auto i = static_cast<std::size_t>(at);
    const double f = at - static_cast<double>(i);
    return i + 1 < v.size() ? v[i] + f * (v[i + 1] - v[i]) : v[i];
  };
  const double sigma = (quantile(0.75) - quantile(0.25)) / 1.349;
  return 1.2533 * sigma / std::sqrt(static_cast<double>(v.size()));
}

// Measures per-peer latency and time per byte (a collective); fills the link fields.
void measure_links(Communicator& comm, const CalibrationOptions& options, Calibration& out);
// Measures again, alone, each pair of out.peer_beta more than twice as slow a byte as the
// median pair (of its class, inside a host or across hosts, where out.host_of gives the job's
// hosts), and keeps each one's fastest measurement (then out.alpha and out.beta, the slowest
// pair's). A collective; every rank must hold the same figures.
void recheck_slow_pairs(Communicator& comm, const CalibrationOptions& options, Calibration& out);

// Times a raw allreduce through `probe` and sets calibration.engine_beta from what alpha,
// beta and the CPU fits leave unexplained (a collective; needs the links and the engine's
// overheads measured). Returns whether the links paced that allreduce (the cores idled most of
// it), the same on every rank.
bool measure_engine_beta(Communicator& comm, Calibration& calibration, AllreduceProbe& probe);

// Where the links paced the raw allreduce of measure_engine_beta (`paced`, its result), that
// allreduce and the links' exchange probe measure the same bytes. If the allreduce moved them
// clearly faster than the links were measured to allow, the links' measurement was disturbed:
// measures the links again, keeps the faster, and then the engine's byte again. If it moved
// them clearly slower, the allreduce was: measures the engine's byte again and keeps the
// faster. A collective; every rank takes the same branch (the figures compared are agreed).
void check_link_probes(Communicator& comm, const CalibrationOptions& options,
                       Calibration& calibration, bool paced, AllreduceProbe& probe);

// Times a ring exchange (every rank sends to the next and receives from the previous at once)
// of a size the calibration predicts to take about options.link_target_seconds, and returns
// measured / predicted, agreed over ranks (1 for one rank). A collective.
double probe_links(Communicator& comm, const Calibration& calibration,
                   const CalibrationOptions& options);

}  // namespace terse::planner
