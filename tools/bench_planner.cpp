// terse bench planner: how well the planner predicts and chooses, measured in one run.
//
// Every rank calibrates (as codec "auto" does at engine start), then for each --size: every
// candidate the planner considers (raw and each allowed codec x strategy x K) is predicted and
// measured, as in `terse bench allreduce` (median over --reps of the slowest rank's time, each
// run from the same input after a barrier, one warm-up first). Reported per configuration:
// predicted, measured, relative error; per size: the planner's choice (run through codec "auto",
// so the runtime's own plan is what is timed) against the best configuration measured
// (exhaustive search over the same candidates) and against raw with the engine's default K.
// Candidates predicted slower than --within times the fastest prediction or than --max-seconds
// are not run (they are listed as skipped); the choice and the raw default always are.
//
// Run under a launcher (scripts/cluster.sh, `terse run`), or alone: without RANK in the
// environment it starts --ranks local ranks of itself through `terse run`.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "commands.h"
// Internal headers: the benchmark reads the calibration and the cost model, which are no part
// of the public API, and calibrates before the engine's first "auto" allreduce would.
#include "engine/allreduce_probe.h"  // the probe calibration times the engine with
#include "launch.h"
#include "planner/calibration.h"  // Calibration records: this command prints and writes them
#include "planner/cost_model.h"  // per-candidate predictions, beside the measured times
#include "planner/planner_impl.h"  // PlannerAccess: a planner from a given calibration
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/planner.h"
#include "terse/testing/gradient.h"
#include "transport/topology.h"  // the engine's hosts, which the planner prices two levels on
#include "units.h"

namespace terse::tools {
namespace {

struct Options {
  int ranks = 2;
  std::vector<std::string> sizes = {"64KiB", "1MiB", "16MiB", "256MiB"};
  std::vector<std::string> codecs;
  std::vector<int> partitions;
  int reps = 5;
  int threads = 0;
  double max_seconds = 3.0;
  double within = 4.0;
  std::string link;
  std::string json;
  std::string cache = "-";
  std::string replay;
};

struct Measured {
  std::string label;
  TensorPlan plan;
  double predicted = 0;
  std::vector<double> times;
  double median = 0;
  bool candidate = true;  // one of the planner's candidates (not the auto run or raw default)
};

std::string label_of(const TensorPlan& p) {
  std::string codec = p.codec;
  if (codec.size() > 18) codec = codec.substr(0, 18);
  return fmt::format("{} {} K={}{}", to_string(p.strategy), codec, p.partitions,
                     p.hierarchical ? " hosts" : "");
}

// The search's best is the least of many noisy medians, so its figure is biased low (the
// winner's curse: among configurations within noise of each other, the least median beats
// a re-timing of itself). Where the best is not the choice, both are timed again in pairs
// (the choice through codec "auto"), each pair's ratio taken, and the median ratio is the
// figure: the machine's speed drifts over the seconds a size takes (the same
// 64 KiB allreduce took 0.08 ms in one minute and 0.14 ms in another), and a pair's two runs
// share its state. Pairs: as many as take about kAgainSeconds, at least twice the runs
// either had above and at most kMaxPairs. Each is timed on a tensor (and codec state) of
// its own: the same tensor switched between configurations would start each run afresh.
constexpr double kAgainSeconds = 10.0;
constexpr int kMaxPairs = 400;
struct Again {
  int pairs = 0;
  double a = 0, b = 0, ratio = 0;  // medians of each one's runs and of the pairs' a/b
};

// Do no harm is judged on codec "auto" against the raw default, measured in the same run:
// where the two are close, a few percent of the machine's drift, or of what the
// configuration run before each left in the cache, decides it (2 ranks on loopback, 1 MiB:
// auto 0.849 ms against 0.769 for the same raw plan as a candidate). There they
// are timed again in pairs, as the choice and the best are.
constexpr double kCloseToRaw = 0.9;

// What one size's runs say of the planner's choice.
struct Verdict {
  const Measured* auto_run = nullptr;
  const Measured* raw_run = nullptr;
  const Measured* chosen_run = nullptr;
  double choice = 0;  // the choice's median, over its runs as a candidate and through auto
  const Measured* best = nullptr;
  double best_median = 0;
  Again again, control, vs_raw;
};

// One --size: its buffers, the planner's decision, the configurations timed and their times.
// Every rank goes through the same steps in the same order (the same collectives).
struct SizeBench {
  const Options& opt;
  Communicator& comm;
  Engine& engine;
  Planner& planner;
  const transport::Topology& topology;  // the engine's: on hosts of several ranks, two levels
  int r = 0, n_ranks = 0, threads = 0;
  std::string size_text;
  std::size_t n = 0;
  kit::PageArray<float> input, data;
  PlanDecision d;
  double fastest = 0;
  bool interleave = false;
  std::string explore_name;
  int explored = 0;
  TensorPlan settled;
  std::map<std::string, double> explored_s;
  const PlanCandidate* settled_candidate = nullptr;
  std::vector<Measured> runs;
  std::vector<std::string> skipped;
  AllreduceOptions raw_default;
  std::vector<AllreduceOptions> options;

  SizeBench(const Options& opt_, Communicator& comm_, Engine& engine_, Planner& planner_,
            const transport::Topology& topology_, int threads_, std::string size_text_)
      : opt(opt_),
        comm(comm_),
        engine(engine_),
        planner(planner_),
        topology(topology_),
        r(comm_.rank()),
        n_ranks(comm_.size()),
        threads(threads_),
        size_text(std::move(size_text_)) {}
  void prepare();
  // What the engine asks the planner about this size (codec "auto", its topology).
  planner::Use use() const {
    planner::Use u{n, threads};
    u.topology = &topology;
    return u;
  }
  bool timed(const PlanCandidate& c) const {
    return c.predicted.seconds <= opt.within * fastest && c.predicted.seconds <= opt.max_seconds;
  }
  void explore();
  void list_runs();
  std::string name(std::size_t i) const {
    return interleave ? fmt::format("gradient-{}-{}", n, i) : fmt::format("gradient-{}", n);
  }
  // Fast configurations get more runs, up to 5x --reps, so that each is timed for about
  // 100 ms in all: with several ranks per core, single runs of a few ms vary by 2x and more,
  // and a median of 5 of them does not tell configurations 5% apart.
  int reps_of(const Measured& m) const {
    if (m.predicted > 2.0) return std::min(opt.reps, 3);
    const double more = std::floor(0.1 / std::max(m.predicted * opt.reps, 1e-6));
    return opt.reps * static_cast<int>(std::clamp(more, 1.0, 5.0));
  }
  void warm_up(std::size_t i, const std::string& tensor);
  void time_runs();
  Again time_pairs(std::size_t ia, std::size_t ib, const char* tag, bool control);
  Verdict judge();
  void print(const Verdict& v) const;
  nlohmann::json to_json(const Verdict& v) const;
};

void SizeBench::prepare() {
  n = parse_size(size_text) / sizeof(float);
  input = touched<float>(n);
  data = touched<float>(n);
  testing::GradientShape shape = testing::kBenchmarkGradient;
  shape.first_outlier = static_cast<std::size_t>(r);
  testing::fill_gradient(input.all(), 1000 + r, shape);
  d = planner::decide(planner, use(), n_ranks);
  fastest = d.ranked.front().predicted.seconds;
  // Runs alternate between configurations, rep by rep, so that a burst of load from outside
  // the job slows several configurations a little rather than one a lot. Each configuration
  // keeps its own tensor (and codec state) for that, unless that would take too much memory:
  // then one tensor, configuration after configuration (exploration's too).
  const auto is_timed = [this](const PlanCandidate& c) { return timed(c); };
  const std::size_t tensors = std::count_if(d.ranked.begin(), d.ranked.end(), is_timed) +
                              4;  // choice, auto, raw, control
  interleave = n * sizeof(float) * tensors <= (std::size_t{1} << 30);
  explore_name =
      interleave ? fmt::format("gradient-{}-explore", n) : fmt::format("gradient-{}", n);
}

// Codec "auto" first explores what the model cannot tell apart (planner/explorer.h)
// and settles on the fastest measured: the plan it settles on is its choice. (All ranks
// leave the loop together: exploration's state is the same on every rank.)
void SizeBench::explore() {
  AllreduceOptions auto_options;
  auto_options.codec = "auto";
  // Each run starts at a barrier, as this benchmark's timed runs do (time_allreduce), so that
  // exploration ranks the contenders under the conditions they are timed in below: run back
  // to back, a rank's span would also hold its wait for the slowest rank's previous run.
  do {
    std::copy(input.begin(), input.end(), data.begin());
    comm.barrier("explore");
    engine.allreduce(explore_name, data, auto_options).wait();
    ++explored;
    // A guard only: sequential halving of five contenders runs at most 320 allreduces.
  } while (planner::exploring(planner, use()) && explored < 1000);
  settled = engine.plan(n, auto_options);
  // What exploration measured of each contender (the agreed times it settled on), to set
  // against this benchmark's own timing of the same configurations.
  for (const auto& c : planner::decide(planner, use(), n_ranks).ranked) {
    if (c.measured) explored_s[plan_key(c.plan)] = *c.measured;
  }
  settled_candidate = &d.chosen;
  for (const auto& c : d.ranked) {
    if (plan_key(c.plan) == plan_key(settled)) settled_candidate = &c;
  }
}

// The configurations to time: the candidates predicted fast enough and the choice, then the
// runtime's own choice through codec "auto" and raw as the engine does it by default.
void SizeBench::list_runs() {
  for (const auto& c : d.ranked) {
    if (plan_key(c.plan) != plan_key(settled) && !timed(c)) {
      skipped.push_back(label_of(c.plan));
      continue;
    }
    runs.push_back({label_of(c.plan), c.plan, c.predicted.seconds, {}, 0, true});
  }
  const TensorPlan raw_plan = engine.plan(n, raw_default);
  runs.push_back({"codec auto: " + label_of(settled),
                  settled,
                  settled_candidate->predicted.seconds,
                  {},
                  0,
                  false});
  const CostModel& model = PlannerAccess::model(planner);
  runs.push_back({"raw default " + label_of(raw_plan),
                  raw_plan,
                  raw_plan.hierarchical
                      ? model
                            .predict_hosts(n, "none", Strategy::kRaw, raw_plan.partitions,
                                           planner::host_layout(model.calibration(), topology),
                                           threads)
                            .seconds
                      : model.predict(n, "none", Strategy::kRaw, raw_plan.partitions, n_ranks,
                                      threads)
                            .seconds,
                  {},
                  0,
                  false});
  if (r == 0) {
    fmt::print("\n{} ({} floats): {} configurations, {} skipped by prediction\n", size_text, n,
               runs.size(), skipped.size());
    fmt::print("{:<40} {:>12} {:>12} {:>8}\n", "configuration", "predicted ms", "measured ms",
               "error");
    std::fflush(stdout);
  }
  options.resize(runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const Measured& m = runs[i];
    AllreduceOptions& o = options[i];
    if (m.label.rfind("codec auto", 0) == 0) {
      o.codec = "auto";
    } else if (m.label.rfind("raw default", 0) == 0) {
      o = raw_default;
    } else {
      o.codec = m.plan.codec;
      o.strategy = m.plan.strategy;
      o.partitions = m.plan.partitions;
      o.hierarchy = m.plan.hierarchical ? Hierarchy::kHosts : Hierarchy::kFlat;
    }
  }
}

// Warm-up: the first use, then extra_warm_ups() more, judged by the predicted time.
void SizeBench::warm_up(std::size_t i, const std::string& tensor) {
  const int rounds = 1 + extra_warm_ups(runs[i].plan.partitions, runs[i].predicted);
  for (int w = 0; w < rounds; ++w) {
    std::copy(input.begin(), input.end(), data.begin());
    engine.allreduce(tensor, data, options[i]).wait();
  }
}

void SizeBench::time_runs() {
  int max_reps = 0;
  for (const auto& m : runs) max_reps = std::max(max_reps, reps_of(m));
  if (interleave) {
    for (std::size_t i = 0; i < runs.size(); ++i) warm_up(i, name(i));
    // Each rep in its own order (the same on every rank: one seed), so that no configuration
    // always follows the same one: a run right after another configuration's pays for what
    // that one evicted from the cache, and in a fixed order codec "auto" always came after
    // the slowest candidate (2 ranks on loopback, 1 MiB: auto 0.631-0.676 ms against
    // 0.580-0.637 for the same raw plan as a candidate and 0.585-0.643 as the raw default
    // right after it).
    std::vector<std::size_t> order(runs.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::mt19937 shuffler(12345);
    for (int rep = 0; rep < max_reps; ++rep) {
      std::shuffle(order.begin(), order.end(), shuffler);
      for (const std::size_t i : order) {
        if (rep >= reps_of(runs[i])) continue;
        const auto t = time_allreduce(engine, comm, name(i), data, input, options[i], 1);
        runs[i].times.push_back(t[0]);
      }
    }
  } else {
    for (std::size_t i = 0; i < runs.size(); ++i) {
      warm_up(i, name(i));
      runs[i].times =
          time_allreduce(engine, comm, name(i), data, input, options[i], reps_of(runs[i]));
    }
  }
  for (auto& m : runs) {
    m.median = median(m.times);
    if (r == 0) {
      fmt::print("{:<40} {:>12.3f} {:>12.3f} {:>+7.1f}%\n", m.label, m.predicted * 1e3,
                 m.median * 1e3, (m.predicted / m.median - 1) * 100);
    }
  }
  if (r == 0) std::fflush(stdout);
}

// Pairs of runs of runs[ia] and runs[ib], on their tensors (`tag` names them where all
// configurations share one), each pair's order the other way round from the last's: the
// second of two runs found the cache as the first left it, which would favour one side.
// A control times runs[ia] against itself, the second side on a tensor of its own.
Again SizeBench::time_pairs(std::size_t ia, std::size_t ib, const char* tag, bool control) {
  Again g;
  const double pair_seconds = std::max(runs[ia].median + runs[ib].median, 1e-6);
  g.pairs = std::clamp(static_cast<int>(std::ceil(kAgainSeconds / pair_seconds)),
                       2 * std::max(reps_of(runs[ia]), reps_of(runs[ib])), kMaxPairs);
  const bool own_b = interleave && !control;
  const std::string a_name = interleave ? name(ia) : fmt::format("gradient-{}-{}-a", n, tag);
  const std::string b_name = own_b ? name(ib) : fmt::format("gradient-{}-{}-b", n, tag);
  if (!interleave) warm_up(ia, a_name);
  if (!own_b) warm_up(ib, b_name);
  std::vector<double> ta, tb, ratios;
  for (int pair = 0; pair < g.pairs; ++pair) {
    auto run_a = [&] {
      ta.push_back(time_allreduce(engine, comm, a_name, data, input, options[ia], 1)[0]);
    };
    auto run_b = [&] {
      tb.push_back(time_allreduce(engine, comm, b_name, data, input, options[ib], 1)[0]);
    };
    if (pair % 2 == 0) {
      run_a(), run_b();
    } else {
      run_b(), run_a();
    }
    ratios.push_back(ta.back() / tb.back());
  }
  g.a = median(ta);
  g.b = median(tb);
  g.ratio = median(ratios);
  return g;
}

Verdict SizeBench::judge() {
  Verdict v;
  for (auto& m : runs) {
    if (m.label.rfind("codec auto", 0) == 0) v.auto_run = &m;
    if (m.label.rfind("raw default", 0) == 0) v.raw_run = &m;
    if (m.candidate && plan_key(m.plan) == plan_key(settled)) v.chosen_run = &m;
  }
  // The choice was timed twice: as a candidate and through codec "auto" (the same
  // configuration, as the runtime plans it). Its figure is the median of both samples, so
  // that it is not judged on fewer runs than the best of the candidates it is compared with.
  std::vector<double> both = v.auto_run->times;
  if (v.chosen_run != nullptr)
    both.insert(both.end(), v.chosen_run->times.begin(), v.chosen_run->times.end());
  v.choice = median(both);
  for (const auto& m : runs) {
    if (!m.candidate) continue;
    const double x = &m == v.chosen_run ? v.choice : m.median;
    if (v.best == nullptr || x < v.best_median) {
      v.best = &m;
      v.best_median = x;
    }
  }
  const auto index = [&](const Measured* m) { return static_cast<std::size_t>(m - &runs[0]); };
  if (v.best != v.chosen_run) {
    v.again = time_pairs(index(v.auto_run), index(v.best), "again", false);
    // The pairs' own resolution, measured alongside: the best against itself on a second
    // tensor, as many pairs, so that a miss can be told from the machine's spread at that
    // point (0.6% from 1 at the median, at most 3.4%, over 17 points of one grid).
    v.control = time_pairs(index(v.best), index(v.best), "control", true);
  }
  if (v.choice > kCloseToRaw * v.raw_run->median) {
    v.vs_raw = time_pairs(index(v.auto_run), index(v.raw_run), "raw", false);
  }
  return v;
}

void SizeBench::print(const Verdict& v) const {
  fmt::print(
      "choice {} (the model's: {}; {} contenders explored in {} runs): {:.3f} ms; best "
      "measured {}: {:.3f} ms (choice/best {:.3f}); raw default {:.3f} ms (auto/raw "
      "{:.3f})\n",
      label_of(settled), label_of(d.chosen.plan), d.contenders.size(), explored,
      v.choice * 1e3, v.best->label, v.best_median * 1e3, v.choice / v.best_median,
      v.raw_run->median * 1e3, v.choice / v.raw_run->median);
  if (v.again.pairs > 0) {
    fmt::print(
        "  timed again in {} pairs: choice {:.3f} ms, best {:.3f} ms (median of the "
        "pairs' choice/best {:.3f})\n",
        v.again.pairs, v.again.a * 1e3, v.again.b * 1e3, v.again.ratio);
    fmt::print(
        "  control: the best against itself on a second tensor in {} pairs: {:.3f} ms, "
        "{:.3f} ms (median of the pairs' ratios {:.3f})\n",
        v.control.pairs, v.control.a * 1e3, v.control.b * 1e3, v.control.ratio);
  }
  if (v.vs_raw.pairs > 0) {
    fmt::print(
        "  auto and raw default timed again in {} pairs: {:.3f} ms, {:.3f} ms (median of "
        "the pairs' auto/raw {:.3f})\n",
        v.vs_raw.pairs, v.vs_raw.a * 1e3, v.vs_raw.b * 1e3, v.vs_raw.ratio);
  }
  std::fflush(stdout);
}

nlohmann::json SizeBench::to_json(const Verdict& v) const {
  nlohmann::json js;
  js["size"] = size_text;
  js["elements"] = n;
  js["chosen"] = label_of(settled);
  js["predicted_choice"] = label_of(d.chosen.plan);
  js["explore_runs"] = explored;
  js["contenders"] = nlohmann::json::array();
  for (const auto& c : d.contenders) js["contenders"].push_back(label_of(c.plan));
  js["best"] = v.best->label;
  js["auto_median_s"] = v.choice;
  js["best_median_s"] = v.best_median;
  js["raw_default_median_s"] = v.raw_run->median;
  if (v.again.pairs > 0) {
    js["again_choice_median_s"] = v.again.a;
    js["again_best_median_s"] = v.again.b;
    js["again_pairs"] = v.again.pairs;
    js["again_pair_ratio"] = v.again.ratio;
    js["control_pairs"] = v.control.pairs;
    js["control_pair_ratio"] = v.control.ratio;
  }
  if (v.vs_raw.pairs > 0) {
    js["raw_again_auto_median_s"] = v.vs_raw.a;
    js["raw_again_raw_median_s"] = v.vs_raw.b;
    js["raw_again_pairs"] = v.vs_raw.pairs;
    js["raw_again_pair_ratio"] = v.vs_raw.ratio;
  }
  js["skipped"] = skipped;
  js["configs"] = nlohmann::json::array();
  for (const auto& m : runs) {
    js["configs"].push_back({{"label", m.label},
                             {"codec", m.plan.codec},
                             {"strategy", std::string(to_string(m.plan.strategy))},
                             {"partitions", m.plan.partitions},
                             {"hierarchical", m.plan.hierarchical},
                             {"candidate", m.candidate},
                             {"predicted_s", m.predicted},
                             {"times_s", m.times},
                             {"median_s", m.median}});
    if (auto e = explored_s.find(plan_key(m.plan)); m.candidate && e != explored_s.end()) {
      js["configs"].back()["explored_s"] = e->second;
    }
  }
  return js;
}

void run_rank(const Options& opt) {
  std::shared_ptr<Communicator> comm =
      Communicator::from_env(communicator_options_from_environment());
  const int r = comm->rank(), n_ranks = comm->size();
  EngineOptions eo;
  eo.threads = opt.threads;
  eo = engine_options_from_environment(eo);
  const int threads = eo.threads > 0 ? eo.threads : kDefaultEngineThreads;
  PlannerOptions po;
  po.allowed = opt.codecs;
  po.heavy = {"none"};  // it measures codec "auto", the light tier: no need to calibrate more
  po.cache_path = opt.cache;
  std::shared_ptr<Planner> planner =
      std::make_shared<Planner>(planner_options_from_environment(po));
  if (!opt.partitions.empty()) PlannerAccess::set_partitions(*planner, opt.partitions);
  PlannerAccess::set_recheck_interval(*planner, 0);  // the benchmark compares the first choice
  PlannerAccess::set_allreduce_probe(*planner, allreduce_probes(threads));
  eo.planner = planner;
  Engine engine(comm, eo);
  engine.calibrate();  // through the engine: the calibration records its topology
  const transport::Topology topology = transport::topology_of_hosts(engine.hosts(), n_ranks);
  const Calibration& cal = PlannerAccess::model(*planner).calibration();
  if (r == 0) {
    fmt::print(
        "terse bench planner: {} ranks{}, {} threads, median of {} runs; calibrated in "
        "{:.2f} s: alpha {:.1f} us, {:.1f} MB/s (in the engine {:.1f} MB/s), slowdown x{:.2f} at "
        "4 threads\n",
        n_ranks, opt.link.empty() ? "" : ", links " + opt.link, threads, opt.reps, cal.seconds,
        cal.alpha * 1e6, cal.beta > 0 ? 1e-6 / cal.beta : 0.0,
        cal.engine_beta > 0 ? 1e-6 / cal.engine_beta : 0.0, cal.slowdown(4));
    std::fflush(stdout);
  }

  nlohmann::json report;
  report["ranks"] = n_ranks;
  report["link"] = opt.link;
  report["threads"] = threads;
  report["reps"] = opt.reps;
  report["calibration"] = nlohmann::json::parse(cal.to_json());
  report["sizes"] = nlohmann::json::array();

  for (const auto& size_text : opt.sizes) {
    SizeBench b(opt, *comm, engine, *planner, topology, threads, size_text);
    b.prepare();
    b.explore();
    b.list_runs();
    b.time_runs();
    const Verdict v = b.judge();
    if (r == 0) b.print(v);
    report["sizes"].push_back(b.to_json(v));
  }
  if (r == 0 && !opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json);
  }
  engine.synchronize();
  comm->barrier("end");
}

nlohmann::json read_json(const std::string& what, const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InvalidArgument(fmt::format("{}: cannot read {}", what, path));
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{} {}: not JSON: {}", what, path, e.what()));
  }
}

// --replay: the predictions of the current cost model for the configurations a recorded run
// measured, from that run's own calibration, so that a change to the model can be judged on
// recorded grids (bench/planner_accuracy.sh) before a new one is run. Writes the record with
// predicted_s replaced (--json, for bench/planner_summary.py) and prints the median error.
// With --cache FILE (a calibration cache, or another record, whose calibration is taken), the
// predictions come from that calibration instead: how much a prediction depends on which
// calibration the job happened to measure (the same machine, minutes apart).
void replay(const Options& opt) {
  nlohmann::json report = read_json("--replay", opt.replay);
  if (!report.is_object() || !report.contains("calibration") || !report.contains("sizes") ||
      !report.contains("ranks")) {
    throw InvalidArgument(
        fmt::format("--replay {}: not a record of `terse bench planner --json`", opt.replay));
  }
  const int ranks = report["ranks"].get<int>();
  Calibration calibration = Calibration::from_json(report["calibration"].dump());
  if (opt.cache != "-") {
    nlohmann::json other = read_json("--cache", opt.cache);
    if (other.is_object() && other.contains("calibration")) other = other["calibration"];
    calibration = Calibration::from_json(other.dump());
    if (calibration.world_size != ranks) {
      throw InvalidArgument(
          fmt::format("--cache {}: a calibration of {} ranks cannot predict {}'s {} ranks",
                      opt.cache, calibration.world_size, opt.replay, ranks));
    }
  }
  const int threads = report.value("threads", 4);
  // Two-level configurations are priced on the hosts the record's calibration was measured on.
  std::optional<planner::HostLayout> hosts;
  if (const auto& of = calibration.host_of; static_cast<int>(of.size()) == ranks) {
    std::vector<std::vector<int>> by_host;
    for (int r = 0; r < ranks; ++r) {
      if (of[r] >= static_cast<int>(by_host.size())) by_host.resize(of[r] + 1);
      by_host[of[r]].push_back(r);
    }
    hosts = planner::host_layout(calibration, transport::topology_of_hosts(by_host, ranks));
  }
  const CostModel model(std::move(calibration));
  std::vector<double> before, after;
  for (auto& size : report["sizes"]) {
    const auto n = size["elements"].get<std::size_t>();
    for (auto& c : size["configs"]) {
      const double measured = c["median_s"].get<double>();
      const std::string codec = c["codec"].get<std::string>();
      const Strategy strategy = parse_strategy(c["strategy"].get<std::string>());
      const int k = c["partitions"].get<int>();
      if (c.value("hierarchical", false) && !hosts) {
        throw InvalidArgument(fmt::format(
            "--replay {}: a two-level configuration, and a calibration without the job's hosts",
            opt.replay));
      }
      const Prediction p = c.value("hierarchical", false)
                               ? model.predict_hosts(n, codec, strategy, k, *hosts, threads)
                               : model.predict(n, codec, strategy, k, ranks, threads);
      const double predicted = p.seconds;
      // The host's CPU bound as the model set it (CostModel::predict): where it equals the
      // prediction, the cores decided, and measured / host_cpu_s is the host's efficiency.
      c["host_cpu_s"] = p.host_cpu;
      c["host_bound_s"] = p.host_bound;
      if (measured > 0) {
        before.push_back(std::abs(c["predicted_s"].get<double>() / measured - 1));
        after.push_back(std::abs(predicted / measured - 1));
      }
      c["predicted_s"] = predicted;
    }
  }
  fmt::print("{}: {} configurations, median |error| {:.1f}% as recorded, {:.1f}% now{}\n",
             opt.replay, after.size(), 100 * median(before), 100 * median(after),
             opt.cache == "-" ? std::string() : fmt::format(" (calibration of {})", opt.cache));
  if (!opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json);
  }
}

}  // namespace

void add_bench_planner_command(CLI::App& bench) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "planner", "Planner: predicted against measured allreduce times, auto against exhaustive");
  cmd->add_option("--ranks", opt->ranks, "Local ranks to start when not under a launcher")
      ->capture_default_str();
  cmd->add_option("--size,--sizes", opt->sizes, "Tensor sizes (B, KB, MB, KiB, MiB, ...)")
      ->capture_default_str();
  cmd->add_option("--codecs", opt->codecs,
                  "The light tier's codecs, what codec auto chooses from (default: "
                  "TERSE_PLAN_CODECS, else fp16 minmax8:ef=1)");
  cmd->add_option("--partitions", opt->partitions, "Partition counts the planner tries");
  cmd->add_option("--reps", opt->reps,
                  "Timed runs per configuration (median); fast ones get up to 5x as many")
      ->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Engine worker threads (0: default)");
  cmd->add_option("--max-seconds", opt->max_seconds,
                  "Skip candidates predicted to take longer than this")
      ->capture_default_str();
  cmd->add_option("--within", opt->within,
                  "Skip candidates predicted slower than this factor times the fastest")
      ->capture_default_str();
  cmd->add_option("--link", opt->link, "Link rate of the emulated cluster (a label)");
  cmd->add_option("--json", opt->json, "Write results as JSON to this file (rank 0)");
  cmd->add_option("--cache", opt->cache,
                  "Calibration cache file ('-': calibrate in this run, the default; with "
                  "--replay, predict from it, or from another record's calibration)")
      ->capture_default_str();
  cmd->add_option("--replay", opt->replay,
                  "Predict a recorded run's configurations again with this build's cost model "
                  "and that run's calibration, or --cache's (no ranks, no measuring)");
  cmd->callback([opt] {
    if (!opt->replay.empty()) {
      replay(*opt);
      return;
    }
    if (!relaunch_unless_launched(opt->ranks, "bench planner")) run_rank(*opt);
  });
}

}  // namespace terse::tools
