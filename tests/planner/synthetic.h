// A synthetic calibration for planner tests: known link and codec costs, so that predictions and
// decisions can be checked by hand.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "planner/calibration.h"
#include "terse/codec.h"

namespace terse::testing {

inline LinearFit line(double a, double b) {
  LinearFit f;
  f.a = a;
  f.b = b;
  return f;
}

// Links of `bytes_per_second` and `alpha` seconds of latency between every pair of `ranks`
// ranks; fp32 work and the codecs (fp16 and onebit:ef=1 unless given) at a few GB/s, each
// sending its max_encoded_bytes; an idle CPU.
inline Calibration synthetic(double bytes_per_second, double alpha, int ranks = 4,
                             const std::vector<std::string>& codecs = {"fp16", "onebit:ef=1"}) {
  Calibration c;
  c.host = "test";
  c.world_size = ranks;
  c.ranks_on_host = 1;
  c.cores = 8;
  c.alpha = alpha;
  c.beta = 1 / bytes_per_second;
  c.peer_alpha.assign(ranks, std::vector<double>(ranks, alpha));
  c.peer_beta.assign(ranks, std::vector<double>(ranks, c.beta));
  c.add = line(1e-6, 0.25e-9);
  c.divide = line(1e-6, 0.2e-9);
  c.cpu_slowdown = {1.0, 1.0, 1.0, 1.0};
  c.task_overhead = 5e-6;
  c.job_overhead = 20e-6;
  for (const auto& spec : codecs) {
    CodecCosts k;
    auto codec = make_codec(spec);
    k.spec = codec->spec();
    k.summable = codec->traits().summable;
    k.encode = line(2e-6, k.summable ? 0.3e-9 : 0.6e-9);
    k.decode = line(2e-6, 0.3e-9);
    k.accumulate = line(2e-6, 0.35e-9);
    k.combine = line(2e-6, 0.4e-9);
    constexpr std::size_t kProbe = std::size_t{1} << 20;
    k.bytes = line(24, static_cast<double>(codec->max_encoded_bytes(kProbe) - 24) / kProbe);
    c.codecs.push_back(k);
  }
  return c;
}

// Two classes of links on the hosts of `host_of` (a rank's host, as Topology::host_of): pairs
// on one host at intra_bytes_per_second and intra_alpha, pairs on different hosts at
// cross_bytes_per_second and cross_alpha; the model's alpha and beta the slowest pair's, as
// calibration measures them. Otherwise synthetic()'s.
inline Calibration synthetic_hosts(const std::vector<int>& host_of, double cross_bytes_per_second,
                                   double cross_alpha, double intra_bytes_per_second,
                                   double intra_alpha,
                                   const std::vector<std::string>& codecs = {"fp16",
                                                                             "onebit:ef=1"}) {
  const int ranks = static_cast<int>(host_of.size());
  Calibration c = synthetic(cross_bytes_per_second, cross_alpha, ranks, codecs);
  for (int i = 0; i < ranks; ++i) {
    for (int j = 0; j < ranks; ++j) {
      const bool same = host_of[i] == host_of[j];
      c.peer_alpha[i][j] = i == j ? 0 : same ? intra_alpha : cross_alpha;
      c.peer_beta[i][j] = i == j ? 0 : same ? 1 / intra_bytes_per_second : c.beta;
    }
  }
  c.alpha = std::max(cross_alpha, intra_alpha);
  c.beta = std::max(c.beta, 1 / intra_bytes_per_second);
  c.host_of = host_of;
  return c;
}

// Adds PowerSGD (rank 4) to a calibration: a multi-round codec whose rounds and finish() cost
// 50 us + 2 ns per element on one rank.
inline void add_powersgd(Calibration& c, const std::string& spec = "powersgd") {
  CodecCosts k;
  k.spec = make_codec(spec)->spec();
  k.multi_round = true;
  k.encode = line(50e-6, 2e-9);
  k.bytes = line(0, 0.01);  // reports only: the model counts the round contributions
  c.codecs.push_back(k);
}

}  // namespace terse::testing
