// One rank of the planner's multi-process tests, started by `terse run`. Scenarios:
//   auto    codec "auto" with the engine's own planner (calibrated on first use, or loaded from
//           the cache every rank agrees on), each size run until it has explored its
//           contenders and settled: plans are identical on every rank, tiny tensors go raw,
//           results are identical on every rank and close to the exact average
//   loses   codec "auto" with a calibration in which compression cannot pay (a link faster than
//           any codec): every size goes raw and the results are exact
//   powersgd  codec "auto" with PowerSGD allowed and a 100 Mbit/s calibration: the large
//           matrix goes PowerSGD (its rounds on the raw ring, one partition), the small tensor
//           does not, and results are identical on every rank
//   matrix  the same with rows given (AllreduceOptions::rows): PowerSGD views the tensor as its
//           own rows; rows that do not divide the tensor are refused
//   tiers   one tensor switching between codec "auto" and "auto:heavy" (Accordion's levels over
//           auto), with a calibration where each tier plans another codec: results identical on
//           every rank and equal to the same codecs given as specs, whose error-feedback
//           residual carries over each switch
//   trace   a few compressed allreduces under TERSE_TRACE (set by the caller): every rank writes
//           its trace with its clock offset, for `terse trace merge`
//   links   planner::check_link_probes where the links paced the engine's raw allreduce: a
//           links' measurement made 1000x slow (a disturbed sweep) is measured again and the
//           faster kept; so is an engine byte made 1000x slow; the same on every rank. Not
//           paced, both are kept
//   collectives  codec "auto" reduce_scatter and all_gather: plans agree, results equal the
//           chosen plan's run with its codec named; exploration settles on the real links with
//           every contender measured, apart from an allreduce's decisions of the same size
//   collective_mismatch  one rank "auto", the others a codec: MismatchError naming the
//           operation on every rank
//   hosts   4 ranks under TERSE_TOPOLOGY=2,2: a pair's link disturbed inside a host is measured
//           again against its class's pairs; codec "auto" with a calibration of two link
//           classes (slow across hosts, fast inside): the large tensor goes two levels, a tiny
//           one flat, the decision priced both levels and the engine runs its choice;
//           hierarchy flat and hosts restrict it; plans and results identical on every rank
//   hosts_auto  codec "auto" with the engine's own planner under the job's topology
//           (TERSE_TOPOLOGY): calibrated (or cached for that topology), explored and settled,
//           plans identical on every rank; two levels priced where the topology has them
// Prints "OK rank R SCENARIO" on success; "CHECK FAILED: ..." and exit 2 otherwise.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/allreduce_probe.h"
#include "kit/hash.h"
#include "planner/calibration.h"
#include "planner/exchange.h"
#include "planner/planner_impl.h"
#include "planner/synthetic.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/planner.h"
#include "transport/topology.h"
#include "worker_check.h"

namespace {

using namespace terse;

using testing::check;
using testing::fail;

constexpr int kThreads = 4;  // engine workers (the planner's decisions are per thread count)

// Different on every (rank, tensor, step, element); every rank can compute every rank's input.
float value(int rank, std::uint64_t key, std::size_t i) {
  const std::uint64_t h = kit::mix64(kit::combine_keys(key, rank) + i * 0x9e3779b97f4a7c15ull);
  return (static_cast<float>(h & 0xffffff) / 16777216.0f - 0.5f) * 0.01f;
}

std::uint64_t digest(std::span<const float> y) {
  return fnv1a64(std::string_view(reinterpret_cast<const char*>(y.data()), y.size_bytes()));
}

// Every rank's text must equal this rank's.
void check_same_everywhere(Communicator& comm, const std::string& text, const std::string& what) {
  const std::uint64_t mine = fnv1a64(text);
  std::vector<std::uint64_t> all(comm.size());
  std::vector<std::size_t> sizes(comm.size(), 8);
  comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)), sizes,
                  "check");
  for (int i = 0; i < comm.size(); ++i) {
    check(all[i] == mine,
          fmt::format("{}: rank {} differs from rank {} (mine: {})", what, i, comm.rank(), text));
  }
}

// Runs codec "auto" on each size for a few steps, and on until the planner has explored its
// contenders and settled; checks identical results and their accuracy (exact up to summation
// order when the plan is raw). Returns the settled plans and the step each settled at, one line
// per size (the same on every rank: every rank settles at the same submission).
std::string run_sizes(Communicator& comm, Engine& engine, const std::vector<std::size_t>& sizes,
                      const Planner& planner, std::size_t rows = 0,
                      const transport::Topology* topology = nullptr) {
  AllreduceOptions o;
  o.codec = "auto";
  o.rows = rows;
  std::string plans;
  for (std::size_t n : sizes) {
    const std::string name = fmt::format("t{}", n);
    TensorPlan plan;
    std::vector<PlanCandidate> contenders;
    // What the engine asks the planner about this size (on hosts: both levels priced).
    planner::Use use{n, kThreads};
    use.topology = topology;
    std::uint64_t step = 0;
    for (; step < 3 || planner::exploring(planner, use); ++step) {
      check(step < 400, fmt::format("{}: still exploring after 400 steps", name));
      const std::uint64_t key = kit::combine_keys(fnv1a64(name), step);
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = value(comm.rank(), key, i);
      engine.allreduce(name, x, o).wait();
      if (step == 0) contenders = planner::decide(planner, use, comm.size()).contenders;
      // The plan that ran (an exchange before the submission may have moved it on).
      plan = engine.plan(n, o);
      check_same_everywhere(comm, std::to_string(digest(x)), fmt::format("result of {}", name));
      double err = 0, norm = 0;
      for (std::size_t i = 0; i < n; ++i) {
        double exact = 0;
        for (int r = 0; r < comm.size(); ++r) exact += value(r, key, i);
        exact /= comm.size();
        check(std::isfinite(x[i]), fmt::format("{}: element {} is not finite", name, i));
        err += (x[i] - exact) * (x[i] - exact);
        norm += exact * exact;
      }
      const double rel = std::sqrt(err / std::max(norm, 1e-30));
      // Raw: float sums in another order. Compressed: at most what one-bit signs lose.
      const double bound = plan.codec == "none" ? 1e-5 : 1.5;
      check(rel <= bound,
            fmt::format("{} ({}): relative error {} above {}", name, plan_key(plan), rel, bound));
    }
    // Every contender explored has a measured time: the contenders took turns, and the engine
    // kept each one's state between its turns, so that only its first run went unmeasured.
    if (contenders.size() > 1) {
      const PlanDecision d = planner::decide(planner, use, comm.size());
      for (const auto& c : contenders) {
        const auto m = std::find_if(d.ranked.begin(), d.ranked.end(), [&](const auto& r) {
          return plan_key(r.plan) == plan_key(c.plan);
        });
        check(
            m != d.ranked.end() && m->measured.has_value(),
            fmt::format("{}: contender {} was explored but not measured", name, plan_key(c.plan)));
      }
    }
    plans += fmt::format("{} {} after {} steps\n", n, plan_key(plan), step);
  }
  check_same_everywhere(comm, plans, "plans");
  return plans;
}

// An engine of kThreads workers whose codec "auto" is decided by `planner`.
Engine engine_with(Communicator& comm, std::shared_ptr<Planner> planner) {
  EngineOptions eo = engine_options_from_environment();
  eo.threads = kThreads;
  eo.planner = std::move(planner);
  return Engine(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), eo);
}

int scenario_auto(Communicator& comm) {
  // The engine's default planner, but with short explorations.
  PlannerOptions po;
  po.explore_seconds = 0.05;
  auto planner = std::make_shared<Planner>(planner_options_from_environment(po));
  Engine engine = engine_with(comm, planner);
  const std::string plans =
      run_sizes(comm, engine, {100, 3000, 100000, std::size_t{1} << 21}, *planner);
  check(plans.find("100 none/raw/") != std::string::npos,
        "a tiny tensor did not go raw:\n" + plans);
  std::printf("OK rank %d auto\n%s", comm.rank(), comm.rank() == 0 ? plans.c_str() : "");
  engine.synchronize();
  return 0;
}

int scenario_loses(Communicator& comm) {
  // Links of 1 TB/s and codecs at 0.2 GB/s: compression only adds work.
  Calibration c = testing::synthetic(1e12, 10e-6, comm.size());
  for (auto& k : c.codecs) k.encode = testing::line(2e-6, 20e-9);
  PlannerOptions po;
  po.allowed = {"fp16", "onebit:ef=1"};
  po.heavy = {"none"};
  // A budget the first round alone overruns (its least runs, 4 each): this calibration predicts
  // a raw allreduce far faster than loopback runs it, and the runs' count comes from the
  // predictions.
  po.explore_seconds = 1e-4;
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), c);
  Engine engine = engine_with(comm, planner);
  const std::string plans =
      run_sizes(comm, engine, {20000, 300000, std::size_t{1} << 21}, *planner);
  std::size_t lines = 0, raw = 0;
  for (std::size_t at = 0; (at = plans.find('\n', at)) != std::string::npos; ++at) ++lines;
  for (std::size_t at = 0; (at = plans.find(" none/raw/", at)) != std::string::npos; ++at) ++raw;
  check(lines == raw, "compression was chosen where it cannot pay:\n" + plans);
  std::printf("OK rank %d loses\n", comm.rank());
  engine.synchronize();
  return 0;
}

int scenario_powersgd(Communicator& comm) {
  Calibration c = testing::synthetic(12.5e6, 100e-6, comm.size());
  testing::add_powersgd(c);
  PlannerOptions po;
  po.allowed = {"fp16", "powersgd"};
  // The model's choice under this calibration: measured times on the real links here would
  // overturn it.
  po.explore_seconds = 0;
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), c);
  Engine engine = engine_with(comm, planner);
  const std::string plans = run_sizes(comm, engine, {3000, std::size_t{1} << 20}, *planner);
  const std::string powersgd = make_codec("powersgd")->spec();
  // Its rounds' sums on rings or gathered: which one depends on N and the links.
  check(plans.find(fmt::format("{} {}/summable/1", std::size_t{1} << 20, powersgd)) !=
                std::string::npos ||
            plans.find(fmt::format("{} {}/allgather/1", std::size_t{1} << 20, powersgd)) !=
                std::string::npos,
        "the large matrix did not go PowerSGD:\n" + plans);
  check(plans.find(fmt::format("3000 {}", powersgd)) == std::string::npos,
        "a small tensor went PowerSGD:\n" + plans);
  std::printf("OK rank %d powersgd\n%s", comm.rank(), comm.rank() == 0 ? plans.c_str() : "");
  engine.synchronize();
  return 0;
}

int scenario_matrix(Communicator& comm) {
  // The light tier's PowerSGD, chosen by the model, on a tensor whose rows are given: it runs
  // the tensor's own matrix view; rows that do not divide it are refused before any exchange.
  Calibration c = testing::synthetic(12.5e6, 100e-6, comm.size());
  testing::add_powersgd(c, "powersgd:rank=8");
  PlannerOptions po;
  po.allowed = {"fp16", "powersgd:rank=8"};
  po.heavy = {"none"};
  po.explore_seconds = 0;
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), c);
  Engine engine = engine_with(comm, planner);
  const std::size_t n = std::size_t{1} << 20;
  const std::string plans = run_sizes(comm, engine, {n}, *planner, 512);
  AllreduceOptions o;
  o.codec = "auto";
  o.rows = 512;
  const std::string ran = engine.plan(n, o).codec;
  check(ran == make_codec("powersgd:rank=8,rows=512")->spec(),
        "the matrix did not run PowerSGD with its own rows: " + ran + "\n" + plans);
  o.rows = 0;
  check(engine.plan(n, o).codec == make_codec("powersgd:rank=8")->spec(),
        "without rows, not the planner's own view");
  o.rows = 3;
  try {
    engine.plan(n, o);
    check(false, "rows=3 of 2^20 elements was accepted");
  } catch (const InvalidArgument& e) {
    check(std::string(e.what()).find("rows=3") != std::string::npos,
          std::string("unclear error: ") + e.what());
  }
  // Submitted, on every rank alike: refused naming the rank and the tensor, nothing sent.
  std::vector<float> x(n, 1.0f);
  try {
    engine.allreduce("bad_rows", x, o).wait();
    check(false, "an allreduce with rows=3 of 2^20 elements was accepted");
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    check(m.find(fmt::format("rank {}: allreduce of tensor 'bad_rows'", comm.rank())) !=
                  std::string::npos &&
              m.find("rows=3") != std::string::npos,
          "unclear error: " + m);
  }
  check(x[0] == 1.0f, "a refused allreduce changed its tensor");
  std::printf("OK rank %d matrix\n", comm.rank());
  engine.synchronize();
  return 0;
}

// The results of one tensor over a schedule of codecs: each step's input from value(), reduced
// under the step's codec (sharded, two partitions), one digest per step, checked the same on
// every rank. `restart`: a tensor of its own (fresh codec state) wherever the codec changes.
std::vector<std::uint64_t> run_schedule(Communicator& comm, Engine& engine,
                                        const std::vector<std::string>& codecs, std::size_t n,
                                        bool restart = false) {
  std::vector<std::uint64_t> out;
  int segment = 0;
  for (std::size_t step = 0; step < codecs.size(); ++step) {
    AllreduceOptions o;
    o.codec = codecs[step];
    o.strategy = Strategy::kSharded;
    o.partitions = 2;
    segment += step > 0 && codecs[step] != codecs[step - 1];
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = value(comm.rank(), step, i);
    engine.allreduce(restart ? fmt::format("t{}", segment) : "t", x, o).wait();
    out.push_back(digest(x));
    check_same_everywhere(comm, std::to_string(out.back()),
                          fmt::format("step {} ({})", step, codecs[step]));
  }
  return out;
}

int scenario_tiers(Communicator& comm) {
  // 100 Mbit/s: minmax8 is the light tier's fastest codec, onebit the heavy tier's; no
  // exploration, so the model's choices stand.
  const Calibration c =
      testing::synthetic(12.5e6, 100e-6, comm.size(), {"minmax8:ef=1", "onebit:ef=1"});
  PlannerOptions po;
  po.allowed = {"minmax8:ef=1"};
  po.heavy = {"onebit:ef=1"};
  po.explore_seconds = 0;
  po.cache_path = "-";
  const std::string light = make_codec("minmax8:ef=1")->spec();
  const std::string heavy = make_codec("onebit:ef=1")->spec();
  // Accordion's levels over auto: critical and regular windows in turn.
  const std::vector<std::string> tiers = {"auto",       "auto",       "auto:heavy", "auto:heavy",
                                          "auto:heavy", "auto",       "auto:heavy", "auto",
                                          "auto",       "auto:heavy", "auto:heavy", "auto"};
  std::vector<std::string> fixed;
  for (const auto& t : tiers) fixed.push_back(t == "auto" ? light : heavy);
  const std::size_t n = std::size_t{1} << 18;
  std::vector<std::uint64_t> planned, by_spec, fresh;
  {
    std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), c);
    PlannerAccess::set_recheck_interval(*planner, 0);
    Engine engine = engine_with(comm, planner);
    planned = run_schedule(comm, engine, tiers, n);
    // Each tier kept its own decision for the one size.
    AllreduceOptions o;
    o.strategy = Strategy::kSharded;
    o.partitions = 2;
    o.codec = "auto";
    check(engine.plan(n, o).codec == light, "auto did not plan " + light);
    o.codec = "auto:heavy";
    check(engine.plan(n, o).codec == heavy, "auto:heavy did not plan " + heavy);
    engine.synchronize();
  }
  {
    // The same schedule as fixed specs: a change of spec alone hands the error-feedback
    // residual over (Plans::commit), so the planned run must match it bit for bit.
    Engine engine(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                  engine_options_from_environment());
    by_spec = run_schedule(comm, engine, fixed, n);
    // Every switch starting afresh: no residual carried over.
    fresh = run_schedule(comm, engine, fixed, n, /*restart=*/true);
    engine.synchronize();
  }
  for (std::size_t step = 0; step < tiers.size(); ++step) {
    check(planned[step] == by_spec[step],
          fmt::format("step {} ({}): the planned run differs from the same specs given", step,
                      tiers[step]));
  }
  // The carried residual shows: at the first switch, the results differ from fresh state's.
  check(planned[1] == fresh[1] && planned[2] != fresh[2],
        "the residual carried over a switch made no difference");
  std::printf("OK rank %d tiers\n", comm.rank());
  return 0;
}

int scenario_trace(Communicator& comm) {
  {
    Engine engine(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                  engine_options_from_environment());
    AllreduceOptions o;
    o.codec = "onebit:ef=1";
    o.partitions = 2;
    std::vector<float> x(100000);
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(comm.rank(), step, i);
      engine.allreduce("traced", x, o).wait();
    }
  }  // the engine writes its trace here
  std::printf("OK rank %d trace\n", comm.rank());
  return 0;
}

int scenario_links(Communicator& comm) {
  CalibrationOptions o;
  o.quiet = true;
  Calibration c = testing::synthetic(1e9, 50e-6, comm.size());
  planner::measure_links(comm, o, c);
  const double measured = c.beta;
  check(measured > 0, "the links were not measured");
  // measure_links set alpha to its exchanges' intercept, which calibrate() replaces with the
  // engine's round latency before the probes are checked. Under load that intercept reached
  // 1.2 ms on 4 ranks here, and the ring's 6 rounds of it then explained a whole engine probe
  // (its byte came out 0). No latency: the engine's byte is the probe's time less its adds.
  c.alpha = 0;
  // A disturbance far beyond any measurement's spread under load (measured again with ctest
  // -j2 and both cores busy, the links took up to 6x and the engine's byte up to 10x the
  // first measurement), so that keeping the faster of the two is seen on every run.
  constexpr double kDisturbance = 1000;
  Calibration disturbed = c;
  disturbed.beta = kDisturbance * measured;
  for (auto& row : disturbed.peer_beta) {
    for (auto& b : row) b *= kDisturbance;
  }
  disturbed.engine_beta = measured;  // what a raw allreduce moved
  const auto probe = make_allreduce_probe(comm, engine_options_from_environment().threads);
  Calibration kept = disturbed;
  planner::check_link_probes(comm, o, kept, /*paced=*/false, *probe);
  check(kept.beta == disturbed.beta && kept.engine_beta == disturbed.engine_beta,
        "links were measured again where the links did not pace the allreduce");
  planner::check_link_probes(comm, o, disturbed, /*paced=*/true, *probe);
  check(disturbed.beta < kDisturbance * measured,
        fmt::format("disturbed links kept: {} s/B against {} s/B measured", disturbed.beta,
                    measured));
  double slowest = 0;
  for (const auto& row : disturbed.peer_beta) {
    for (double b : row) slowest = std::max(slowest, b);
  }
  check(slowest == disturbed.beta, "peer_beta was not replaced with beta");
  check(disturbed.engine_beta > 0 && disturbed.engine_beta != measured,
        fmt::format("the engine's byte was not measured again: {} s/B (the links' {} s/B, "
                    "first measured {} s/B)",
                    disturbed.engine_beta, disturbed.beta, measured));
  check(planner::agree_max(comm, {disturbed.beta})[0] == disturbed.beta,
        "ranks disagree on the links measured again");
  // The engine's byte far slower than the links: the allreduce was disturbed.
  Calibration slow_engine = disturbed;
  slow_engine.engine_beta = kDisturbance * disturbed.beta;
  planner::check_link_probes(comm, o, slow_engine, /*paced=*/true, *probe);
  check(slow_engine.engine_beta > 0 && slow_engine.engine_beta < kDisturbance * disturbed.beta,
        fmt::format("a disturbed engine byte kept: {} s/B over links of {} s/B",
                    slow_engine.engine_beta, disturbed.beta));
  check(slow_engine.beta == disturbed.beta, "the links changed with the engine's byte");
  check(planner::agree_max(comm, {slow_engine.engine_beta})[0] == slow_engine.engine_beta,
        "ranks disagree on the engine's byte measured again");
  // One pair disturbed in the tournament: measured again, alone, and restored; the other
  // pairs keep their figures. With two ranks the lone pair is its own median: nothing to do.
  Calibration one_slow = c;
  const double pair = one_slow.peer_beta[0][1];
  one_slow.peer_beta[0][1] = one_slow.peer_beta[1][0] = kDisturbance * pair;
  one_slow.beta = kDisturbance * pair;
  std::vector<double> before;
  for (int i = 0; i < comm.size(); ++i) {
    for (int j = i + 1; j < comm.size(); ++j) before.push_back(one_slow.peer_beta[i][j]);
  }
  const double slow_above = 2 * planner::median(before);  // other pairs slow under load too
  planner::recheck_slow_pairs(comm, o, one_slow);
  if (comm.size() == 2) {
    check(one_slow.peer_beta[0][1] == kDisturbance * pair,
          "the only pair was measured again against itself");
  } else {
    check(one_slow.peer_beta[0][1] < kDisturbance * pair / 10,
          fmt::format("a pair measured at {} s/B among pairs of {} s/B was not measured "
                      "again: {} s/B",
                      kDisturbance * pair, measured, one_slow.peer_beta[0][1]));
    check(one_slow.peer_beta[0][1] == one_slow.peer_beta[1][0], "the pair's figures differ");
    double slowest = 0;
    for (int i = 0; i < comm.size(); ++i) {
      for (int j = 0; j < comm.size(); ++j) {
        slowest = std::max(slowest, one_slow.peer_beta[i][j]);
        const double was = c.peer_beta[i][j], now = one_slow.peer_beta[i][j];
        if ((i > 1 || j > 1) && now != was && (was <= slow_above || now > was)) {
          check(false, fmt::format("pair {}-{} changed from {} to {} s/B though it was not "
                                   "slow (above {} s/B)",
                                   i, j, was, now, slow_above));
        }
      }
    }
    check(one_slow.beta == slowest, "beta is not the slowest pair's");
    check(planner::agree_max(comm, {one_slow.beta})[0] == one_slow.beta,
          "ranks disagree on the pair measured again");
  }
  std::printf("OK rank %d links\n", comm.rank());
  return 0;
}

// Codec "auto" reduce_scatter and all_gather. First with the model's choice under a 100 Mbit/s
// calibration (no exploration): every rank plans the same, the tiny shards go raw and the large
// ones compressed, and the results equal those of the chosen plan run with its codec named,
// on a fresh engine (the same name, step and state: bit for bit), all_gather's on every rank.
// Then with exploration on the real links: each operation explores, settles at the same step on
// every rank, every contender is measured, and no allreduce decision of the same size saw
// those measurements.
int scenario_collectives(Communicator& comm) {
  const int N = comm.size(), r = comm.rank();
  const auto rs = Operation::kReduceScatter, ag = Operation::kAllGather;
  PlannerOptions po;
  po.allowed = {"fp16", "onebit:ef=1"};
  po.heavy = {"none"};
  po.explore_seconds = 0;
  const Calibration slow = testing::synthetic(12.5e6, 100e-6, N);
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), slow);
  std::string plans;
  {
    Engine engine = engine_with(comm, planner);
    EngineOptions eo;
    eo.threads = kThreads;
    Engine fixed(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                 engine_options_from_environment(eo));
    for (const std::size_t shard : {std::size_t{100}, std::size_t{1} << 16}) {
      const std::size_t total = N * shard;
      const std::string name = fmt::format("s{}", shard);
      const std::uint64_t key = fnv1a64(name);
      CollectiveOptions o;
      o.codec = "auto";
      auto same_as_named = [&](const TensorPlan& p) {
        CollectiveOptions f;
        f.codec = p.codec;
        f.strategy = p.strategy;
        f.partitions = p.partitions;
        return f;
      };
      std::vector<float> x(total), y(shard), z(shard);
      for (std::size_t i = 0; i < total; ++i) x[i] = value(r, key, i);
      engine.reduce_scatter(name, TensorView(std::span(x)), TensorView(std::span(y)), o).wait();
      const TensorPlan p =
          planner::plan(*planner, comm, {total, kThreads, Strategy::kAuto, 0, Tier::kLight, rs});
      comm.barrier("fixed");
      fixed
          .reduce_scatter(name, TensorView(std::span(x)), TensorView(std::span(z)),
                          same_as_named(p))
          .wait();
      check(y == z, fmt::format("reduce_scatter of {} with auto ({}) differs from the plan named",
                                name, plan_key(p)));
      double err = 0, norm = 0;
      for (std::size_t i = 0; i < shard; ++i) {
        double exact = 0;
        for (int q = 0; q < N; ++q) exact += value(q, key, r * shard + i);
        exact /= N;
        err += (y[i] - exact) * (y[i] - exact);
        norm += exact * exact;
      }
      const double rel = std::sqrt(err / std::max(norm, 1e-30));
      check(rel <= (p.codec == "none" ? 1e-5 : 1.5),
            fmt::format("reduce_scatter of {} ({}): relative error {}", name, plan_key(p), rel));
      plans += fmt::format("reduce_scatter {} {}\n", total, plan_key(p));

      std::vector<float> in(x.begin(), x.begin() + shard), out(total), out2(total);
      engine.all_gather(name, TensorView(std::span(in)), TensorView(std::span(out)), o).wait();
      const TensorPlan g =
          planner::plan(*planner, comm, {total, kThreads, Strategy::kAuto, 0, Tier::kLight, ag});
      comm.barrier("fixed");
      fixed
          .all_gather(name, TensorView(std::span(in)), TensorView(std::span(out2)),
                      same_as_named(g))
          .wait();
      check(out == out2, fmt::format("all_gather of {} with auto ({}) differs from the plan named",
                                     name, plan_key(g)));
      check_same_everywhere(comm, std::to_string(digest(out)),
                            fmt::format("all_gather of {}", name));
      plans += fmt::format("all_gather {} {}\n", total, plan_key(g));
    }
    // A strategy and partitions given with "auto" restrict the search to them.
    {
      const std::size_t shard = std::size_t{1} << 16, total = N * shard;
      std::vector<float> x(total, 0.5f), y(shard);
      CollectiveOptions o;
      o.codec = "auto";
      o.strategy = Strategy::kRing;
      o.partitions = 3;
      engine.reduce_scatter("restricted", TensorView(std::span(x)), TensorView(std::span(y)), o)
          .wait();
      const auto& decisions = PlannerAccess::impl(*planner).decisions;
      const auto d = decisions.find(Planner::Impl::key_of(
          {total, kThreads, Strategy::kRing, 3, Tier::kLight, rs, kDefaultPartitionBytes}));
      check(d != decisions.end(), "the engine did not ask for a ring of 3 partitions");
      const TensorPlan& p = d->second.chosen.plan;
      check(p.strategy == Strategy::kRing && p.partitions == 3 && p.codec != "none",
            "a restricted reduce_scatter went " + plan_key(p));
    }
    engine.synchronize();
    fixed.synchronize();
  }
  check_same_everywhere(comm, plans, "plans");
  const std::size_t large = N * (std::size_t{1} << 16);
  check(plans.find(fmt::format("reduce_scatter {} none/raw/", N * 100)) != std::string::npos &&
            plans.find(fmt::format("all_gather {} none/raw/", N * 100)) != std::string::npos,
        "a tiny shard did not go raw:\n" + plans);
  check(plans.find(fmt::format("reduce_scatter {} none/", large)) == std::string::npos &&
            plans.find(fmt::format("all_gather {} none/", large)) == std::string::npos,
        "a large shard at 100 Mbit/s did not compress:\n" + plans);

  // Exploration, measured on this machine's links.
  po.explore_seconds = 0.05;
  planner = PlannerAccess::with_calibration(planner_options_from_environment(po), slow);
  std::string settled;
  {
    Engine engine = engine_with(comm, planner);
    for (const Operation op : {rs, ag}) {
      const std::string name = fmt::format("explored {}", to_string(op));
      const std::size_t shard = std::size_t{1} << 16, total = N * shard;
      const std::vector<PlanCandidate> contenders =
          planner->decide(total, N, kThreads, Strategy::kAuto, 0, Tier::kLight, op).contenders;
      CollectiveOptions o;
      o.codec = "auto";
      std::vector<float> x(total), y(total);
      std::uint64_t step = 0;
      for (; step < 3 ||
             planner::exploring(*planner, {total, kThreads, Strategy::kAuto, 0, Tier::kLight, op});
           ++step) {
        check(step < 400, name + ": still exploring after 400 steps");
        for (std::size_t i = 0; i < total; ++i) x[i] = value(r, step, i);
        if (op == rs) {
          engine
              .reduce_scatter(name, TensorView(std::span(x)), TensorView(std::span(y).first(shard)),
                              o)
              .wait();
        } else {
          engine
              .all_gather(name, TensorView(std::span(x).first(shard)), TensorView(std::span(y)), o)
              .wait();
          check_same_everywhere(comm, std::to_string(digest(y)), name + ": result");
        }
      }
      const PlanDecision d =
          planner->decide(total, N, kThreads, Strategy::kAuto, 0, Tier::kLight, op);
      for (const auto& c : contenders) {
        const auto m = std::find_if(d.ranked.begin(), d.ranked.end(), [&](const auto& cand) {
          return plan_key(cand.plan) == plan_key(c.plan);
        });
        check(
            m != d.ranked.end() && m->measured.has_value(),
            fmt::format("{}: contender {} was explored but not measured", name, plan_key(c.plan)));
      }
      check(contenders.size() > 1, name + ": nothing to explore");
      settled +=
          fmt::format("{} {} after {} steps\n", name,
                      plan_key(planner::plan(
                          *planner, comm, {total, kThreads, Strategy::kAuto, 0, Tier::kLight, op})),
                      step);
    }
    engine.synchronize();
  }
  // No allreduce ran: none of its candidates of that size has a measured time.
  for (const auto& c : planner->decide(large, N, kThreads).ranked) {
    check(!c.measured,
          "an allreduce candidate took a collective's measurement: " + plan_key(c.plan));
  }
  check_same_everywhere(comm, settled, "settled plans");
  std::printf("OK rank %d collectives\n%s%s", r, r == 0 ? plans.c_str() : "",
              r == 0 ? settled.c_str() : "");
  return 0;
}

// One rank asks for codec "auto", the others name a codec: every rank fails with a
// MismatchError naming the operation, before any of them plans (nobody waits in the planner).
int scenario_collective_mismatch(Communicator& comm) {
  PlannerOptions po;
  po.allowed = {"fp16", "onebit:ef=1"};
  po.heavy = {"none"};
  po.explore_seconds = 0;
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po),
                                      testing::synthetic(12.5e6, 100e-6, comm.size()));
  Engine engine = engine_with(comm, planner);
  const std::size_t shard = 4096, total = comm.size() * shard;
  std::vector<float> x(total, 1.0f), y(total);
  CollectiveOptions o;
  o.codec = comm.rank() == 0 ? "auto" : "fp16";
  for (const char* op : {"reduce_scatter", "all_gather"}) {
    try {
      if (std::string(op) == "reduce_scatter") {
        engine
            .reduce_scatter("m", TensorView(std::span(x)), TensorView(std::span(y).first(shard)), o)
            .wait();
      } else {
        engine.all_gather("m", TensorView(std::span(x).first(shard)), TensorView(std::span(y)), o)
            .wait();
      }
      fail(fmt::format("{} with codec auto against {}: no error", op, o.codec));
    } catch (const MismatchError& e) {
      check(std::string(e.what()).find(op) != std::string::npos &&
                std::string(e.what()).find("codec auto") != std::string::npos,
            fmt::format("the mismatch does not name {} and codec auto: {}", op, e.what()));
    }
  }
  // The communicator is still usable, and the planner was never asked.
  check(!planner::exploring(*planner, {total, kThreads, Strategy::kAuto, 0, Tier::kLight,
                                        Operation::kReduceScatter}),
        "the planner was asked");
  comm.barrier("after");
  std::printf("OK rank %d collective_mismatch\n", comm.rank());
  engine.synchronize();
  return 0;
}

// The job's hosts as the engine agreed them (TERSE_TOPOLOGY), for the planner's uses.
transport::Topology topology_of(const Engine& engine, const Communicator& comm) {
  return transport::topology_of_hosts(engine.hosts(), comm.size());
}

// A pair disturbed inside a host is measured again against its class's median pair, not
// against the pairs across hosts, which are far slower (here: 1000x; the disturbed pair 100x,
// below the median of all pairs). Hosts {0, 1, 2} and {3}: three pairs in each class.
void check_slow_pairs_by_class(Communicator& comm) {
  CalibrationOptions o;
  o.quiet = true;
  Calibration c = testing::synthetic(1e9, 50e-6, comm.size());
  planner::measure_links(comm, o, c);
  const std::vector<int> host_of = {0, 0, 0, 1};
  Calibration shaped = c;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      if (host_of[i] != host_of[j]) shaped.peer_beta[i][j] *= 1000;
    }
  }
  const double pair = shaped.peer_beta[0][1];
  shaped.peer_beta[0][1] = shaped.peer_beta[1][0] = 100 * pair;
  Calibration flat = shaped;  // hosts unknown: judged against every pair, kept
  planner::recheck_slow_pairs(comm, o, flat);
  check(flat.peer_beta[0][1] == 100 * pair, "without hosts, the pair was measured again");
  shaped.host_of = host_of;
  planner::recheck_slow_pairs(comm, o, shaped);
  check(shaped.peer_beta[0][1] < 10 * pair,
        fmt::format("a pair inside a host at {} s/B among its class's {} s/B was not measured "
                    "again: {} s/B",
                    100 * pair, pair, shaped.peer_beta[0][1]));
  check(shaped.peer_beta[0][3] == 1000 * c.peer_beta[0][3], "a pair across hosts changed");
  check(planner::agree_max(comm, {shaped.peer_beta[0][1]})[0] == shaped.peer_beta[0][1],
        "ranks disagree on the pair measured again");
}

int scenario_hosts(Communicator& comm) {
  check(comm.size() == 4, "hosts: 4 ranks");
  check_slow_pairs_by_class(comm);
  const EngineOptions eo = engine_options_from_environment();
  // The calibration's links are split by the topology the engine will agree (TERSE_TOPOLOGY).
  const transport::Topology t =
      transport::agree_topology(comm, eo.topology, eo.host, eo.local_ranks);
  check(t.two_level(), "hosts: run it with TERSE_TOPOLOGY=2,2 (got " + t.describe() + ")");
  // 100 Mbit/s across hosts, 10 Gbit/s inside them; the model's choices stand (no exploring:
  // this machine's loopback would measure otherwise).
  const Calibration c = testing::synthetic_hosts(t.host_of, 12.5e6, 100e-6, 1.25e9, 20e-6);
  PlannerOptions po;
  po.allowed = {"fp16", "onebit:ef=1"};
  po.heavy = {"none"};
  po.explore_seconds = 0;
  std::shared_ptr<Planner> planner =
      PlannerAccess::with_calibration(planner_options_from_environment(po), c);
  Engine engine = engine_with(comm, planner);
  const std::size_t large = std::size_t{1} << 20, tiny = 64;
  const std::string plans = run_sizes(comm, engine, {tiny, 5000, large}, *planner, 0, &t);
  AllreduceOptions o;
  o.codec = "auto";
  // A large tensor crosses the slow links once per host: two levels, by the planner's choice.
  check(engine.plan(large, o).hierarchical, "the large tensor planned flat:\n" + plans);
  check(!engine.plan(tiny, o).hierarchical, "a tiny tensor planned in two levels:\n" + plans);
  planner::Use use{large, kThreads};
  use.topology = &t;
  const PlanDecision d = planner::decide(*planner, use, comm.size());
  const auto levels = std::count_if(d.ranked.begin(), d.ranked.end(),
                                    [](const PlanCandidate& x) { return x.plan.hierarchical; });
  check(levels > 0 && levels < static_cast<long>(d.ranked.size()),
        "the decision did not price both levels");
  check(plan_key(d.chosen.plan) == plan_key(engine.plan(large, o)),
        "the engine runs another plan than the decision's");
  // Restrictions: hierarchy flat and hosts are the planner's too, each decided apart.
  o.hierarchy = Hierarchy::kFlat;
  check(!engine.plan(large, o).hierarchical, "hierarchy flat planned in two levels");
  o.hierarchy = Hierarchy::kHosts;
  check(engine.plan(tiny, o).hierarchical, "hierarchy hosts planned flat");
  std::string restricted;
  for (const Hierarchy h : {Hierarchy::kFlat, Hierarchy::kHosts}) {
    o.hierarchy = h;
    std::vector<float> x(large);
    for (std::size_t i = 0; i < large; ++i) x[i] = value(comm.rank(), 7, i);
    engine.allreduce(fmt::format("r{}", to_string(h)), x, o).wait();
    check_same_everywhere(comm, std::to_string(digest(x)),
                          fmt::format("hierarchy {}", to_string(h)));
    restricted += plan_key(engine.plan(large, o)) + "\n";
  }
  check_same_everywhere(comm, plans + restricted, "plans");
  std::printf("OK rank %d hosts\n%s%s", comm.rank(), comm.rank() == 0 ? plans.c_str() : "",
              comm.rank() == 0 ? restricted.c_str() : "");
  engine.synchronize();
  return 0;
}

int scenario_hosts_auto(Communicator& comm) {
  // The engine's default planner (calibrated on first use under the job's topology, or from the
  // cache of that topology), with short explorations that may time both levels.
  PlannerOptions po;
  po.allowed = {"fp16", "onebit:ef=1"};
  po.heavy = {"none"};
  po.explore_seconds = 0.05;
  auto planner = std::make_shared<Planner>(planner_options_from_environment(po));
  Engine engine = engine_with(comm, planner);
  const transport::Topology t = topology_of(engine, comm);
  const std::string plans =
      run_sizes(comm, engine, {100, 100000, std::size_t{1} << 21}, *planner, 0, &t);
  planner::Use use{std::size_t{1} << 21, kThreads};
  use.topology = &t;
  const PlanDecision d = planner::decide(*planner, use, comm.size());
  const bool both = std::any_of(d.ranked.begin(), d.ranked.end(),
                                [](const PlanCandidate& x) { return x.plan.hierarchical; });
  check(both == t.two_level(), "two levels priced on " + t.describe());
  std::printf("OK rank %d hosts_auto\n%s", comm.rank(), comm.rank() == 0 ? plans.c_str() : "");
  engine.synchronize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: planner_worker "
                 "auto|loses|powersgd|matrix|tiers|trace|links|collectives|collective_mismatch|"
                 "hosts|hosts_auto\n");
    return 2;
  }
  const std::string scenario = argv[1];
  try {
    set_process_options(process_options_from_environment());
    std::unique_ptr<Communicator> comm =
        Communicator::from_env(communicator_options_from_environment());
    int rc = 2;
    if (scenario == "auto") {
      rc = scenario_auto(*comm);
    } else if (scenario == "loses") {
      rc = scenario_loses(*comm);
    } else if (scenario == "powersgd") {
      rc = scenario_powersgd(*comm);
    } else if (scenario == "matrix") {
      rc = scenario_matrix(*comm);
    } else if (scenario == "tiers") {
      rc = scenario_tiers(*comm);
    } else if (scenario == "trace") {
      rc = scenario_trace(*comm);
    } else if (scenario == "links") {
      rc = scenario_links(*comm);
    } else if (scenario == "collectives") {
      rc = scenario_collectives(*comm);
    } else if (scenario == "collective_mismatch") {
      rc = scenario_collective_mismatch(*comm);
    } else if (scenario == "hosts") {
      rc = scenario_hosts(*comm);
    } else if (scenario == "hosts_auto") {
      rc = scenario_hosts_auto(*comm);
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    }
    comm->barrier("end");
    std::fflush(stdout);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 1;
  }
}
