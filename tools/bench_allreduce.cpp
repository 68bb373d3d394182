// terse bench allreduce: allreduce time of one large gradient, in the same processes and the
// same run, for Gloo's own ring algorithms, terse's raw ring and terse's compressed strategies.
//
// Run under a launcher (scripts/cluster.sh or `terse run`), or alone: without RANK in the
// environment it starts --ranks local ranks of itself through `terse run`. Every figure is the
// median over --reps timed runs of the slowest rank's time; each run starts from the same input
// after a barrier. With --link RATE (the emulated link's rate) it reports the ideal time, the
// bytes on the busiest link over the link rate, and the measured time against it. On hosts of
// several ranks (scripts/cluster.sh -l, TERSE_TOPOLOGY), every terse configuration runs flat and
// in two levels over the hosts (--hierarchy), the busiest link is a host's (the bytes its ranks
// send to other hosts), and "vs flat" compares each two-level run with the flat one of the same
// codec, strategy and K.
#include <fmt/format.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "launch.h"
#include "units.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/spec.h"
#include "terse/testing/gradient.h"

namespace terse::tools {
namespace {

using Clock = std::chrono::steady_clock;

std::string hosts_text(const std::vector<std::vector<int>>& hosts) {
  std::string out;
  for (const auto& h : hosts) {
    if (!out.empty()) out += " | ";
    out += h.size() == 1 ? std::to_string(h[0]) : fmt::format("{}-{}", h.front(), h.back());
  }
  return out;
}

struct Options {
  int ranks = 4;
  std::string size = "100MB";
  std::vector<std::string> codecs;
  std::vector<std::string> strategies;
  std::vector<int> partitions;
  std::vector<std::string> hierarchies;
  int reps = 5;
  int threads = 0;
  std::string link;
  std::string json;
  bool no_gloo = false;
};

struct Config {
  std::string label;  // e.g. "sharded onebit K=8"
  std::string kind;   // "gloo-ring", "gloo-ring-chunked", "terse"
  AllreduceOptions options;
};

std::vector<Config> configs(const Options& opt, bool two_level) {
  std::vector<Config> out;
  std::vector<Hierarchy> levels;
  for (const auto& h : opt.hierarchies) levels.push_back(parse_hierarchy(h));
  if (levels.empty() && two_level) levels = {Hierarchy::kFlat, Hierarchy::kHosts};
  if (levels.empty()) levels = {Hierarchy::kAuto};
  if (!opt.no_gloo) {
    out.push_back({"gloo AllreduceRing (fp32)", "gloo-ring", {}});
    out.push_back({"gloo AllreduceRingChunked (fp32)", "gloo-ring-chunked", {}});
  }
  auto add = [&](const std::string& codec, Strategy s, int k) {
    for (Hierarchy h : levels) {
      AllreduceOptions o;
      o.codec = codec;
      o.strategy = s;
      o.partitions = k;
      o.hierarchy = h;
      out.push_back({"", "terse", o});
    }
  };
  if (opt.codecs.empty() && opt.strategies.empty() && opt.partitions.empty()) {
    add("none", Strategy::kRaw, 1);
    add("none", Strategy::kRaw, 0);
    for (const char* c : {"onebit", "terngrad"}) {
      add(c, Strategy::kSharded, 1);
      add(c, Strategy::kSharded, 0);
    }
    add("onebit", Strategy::kAllgather, 0);
    add("onebit", Strategy::kRing, 0);
    add("fp16", Strategy::kSummable, 1);
    add("fp16", Strategy::kSummable, 0);
    add("bf16", Strategy::kSummable, 0);
    return out;
  }
  std::vector<std::string> codecs = opt.codecs.empty() ? std::vector<std::string>{"none"}
                                                       : opt.codecs;
  std::vector<Strategy> strategies;
  for (const auto& s : opt.strategies) strategies.push_back(parse_strategy(s));
  if (strategies.empty()) strategies.push_back(Strategy::kAuto);
  std::vector<int> parts = opt.partitions.empty() ? std::vector<int>{0} : opt.partitions;
  for (const auto& c : codecs) {
    for (Strategy s : strategies) {
      for (int k : parts) add(c, s, k);
    }
  }
  return out;
}

// One configuration's timed runs on this rank; cpu is this rank's total over the runs.
struct Measured {
  std::vector<double> times;
  double bytes_per_rank = 0;
  double bytes_across = 0;  // this rank's bytes to other hosts, per run
  double cpu = 0;
};

// A terse configuration, as the engine's tensor name; fills in cfg.label from the engine's plan.
Measured measure_terse(Engine& engine, Communicator& comm, Config& cfg, const std::string& name,
                       const kit::PageArray<float>& input, const kit::PageArray<float>& data,
                       int reps) {
  const std::size_t n = data.all().size();
  Measured m;
  TensorPlan plan = engine.plan(n, cfg.options);
  cfg.label = fmt::format("{}{} {} K={}{}", plan.hierarchical ? "hosts+" : "",
                          to_string(plan.strategy), cfg.options.codec.substr(0, 14),
                          plan.partitions, cfg.options.partitions == 0 ? " (auto)" : "");
  // Warm-up: the first use, then extra_warm_ups() more, judged by the first run's time.
  std::copy(input.begin(), input.end(), data.begin());
  const auto warm = std::chrono::steady_clock::now();
  engine.allreduce(name, data, cfg.options).wait();
  const double first = max_of(gather(
      comm, std::chrono::duration<double>(std::chrono::steady_clock::now() - warm).count()));
  for (int w = extra_warm_ups(plan.partitions, first); w > 0; --w) {
    std::copy(input.begin(), input.end(), data.begin());
    engine.allreduce(name, data, cfg.options).wait();
  }
  const auto before = engine.bytes_sent();
  const auto across = engine.bytes_sent_across_hosts();
  m.times = time_allreduce(engine, comm, name, data, input, cfg.options, reps, &m.cpu);
  m.bytes_per_rank =
      max_of(gather(comm, static_cast<double>(engine.bytes_sent() - before) / reps));
  m.bytes_across = static_cast<double>(engine.bytes_sent_across_hosts() - across) / reps;
  return m;
}

// One of Gloo's own rings, on gloo_comm's connections; comm carries the barriers and gathers.
Measured measure_gloo(Communicator& comm, Communicator& gloo_comm, const Config& cfg,
                      const kit::PageArray<float>& input, const kit::PageArray<float>& data,
                      int reps, const std::vector<int>& host_of) {
  const std::size_t n = data.all().size();
  const int n_ranks = comm.size();
  Measured m;
  auto ctx = gloo_context(gloo_comm);
  float* ptr = data.data();
  std::unique_ptr<gloo::Algorithm> algo;
  if (cfg.kind == "gloo-ring") {
    algo = std::make_unique<gloo::AllreduceRing<float>>(ctx, std::vector<float*>{ptr},
                                                        static_cast<int>(n));
    m.bytes_per_rank = static_cast<double>(n_ranks - 1) * n * 4;
  } else {
    algo = std::make_unique<gloo::AllreduceRingChunked<float>>(ctx, std::vector<float*>{ptr},
                                                               static_cast<int>(n));
    m.bytes_per_rank = 2.0 * (n_ranks - 1) / n_ranks * n * 4;
  }
  // Both rings send to the next rank only.
  const int r = comm.rank();
  if (host_of[(r + 1) % n_ranks] != host_of[r]) m.bytes_across = m.bytes_per_rank;
  std::copy(input.begin(), input.end(), data.begin());
  algo->run();  // warm-up
  for (int rep = 0; rep < reps; ++rep) {
    std::copy(input.begin(), input.end(), data.begin());
    comm.barrier("bench");
    const double c0 = kit::process_cpu_seconds();
    const auto t0 = Clock::now();
    algo->run();
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    m.cpu += kit::process_cpu_seconds() - c0;
    m.times.push_back(max_of(gather(comm, t)));
  }
  return m;
}

void run_rank(const Options& opt) {
  const CommunicatorOptions comm_options = communicator_options_from_environment();
  Bootstrap boot = bootstrap_from_env(
      comm_options.timeout.count() > 0 ? comm_options.timeout : default_timeout(),
      comm_options.secret);
  std::shared_ptr<Communicator> comm =
      Communicator::create(boot.rank, boot.size, boot.store, comm_options);
  // Gloo's algorithms run on connections of their own, so that neither side inherits the
  // other's socket state (Gloo resizes SO_SNDBUF per message size).
  CommunicatorOptions gloo_options = comm_options;
  gloo_options.prefix = "gloo-baseline";
  std::shared_ptr<Communicator> gloo_comm =
      Communicator::create(boot.rank, boot.size, boot.store, gloo_options);
  const int r = comm->rank(), n_ranks = comm->size();
  const std::size_t n = parse_size(opt.size) / sizeof(float);
  const double rate = opt.link.empty() ? 0 : parse_rate(opt.link);
  EngineOptions eo;
  eo.threads = opt.threads;
  Engine engine(comm, engine_options_from_environment(eo));
  const auto& hosts = engine.hosts();
  std::vector<int> host_of(static_cast<std::size_t>(n_ranks));
  std::size_t most = 1;
  for (std::size_t h = 0; h < hosts.size(); ++h) {
    for (int rank : hosts[h]) host_of[rank] = static_cast<int>(h);
    most = std::max(most, hosts[h].size());
  }
  const bool two_level = hosts.size() > 1 && most > 1;
  // The busiest host link's bytes: the most that the ranks of one host send to other hosts.
  auto busiest_link = [&](double mine) {
    const std::vector<double> all = gather(*comm, mine);
    std::vector<double> per_host(hosts.size(), 0.0);
    for (int i = 0; i < n_ranks; ++i) per_host[host_of[i]] += all[i];
    return *std::max_element(per_host.begin(), per_host.end());
  };

  // A gradient-like input, different on every rank: normal values with rare large outliers.
  auto input = touched<float>(n), data = touched<float>(n);
  testing::GradientShape shape = testing::kBenchmarkGradient;
  shape.first_outlier = static_cast<std::size_t>(r);
  testing::fill_gradient(input.all(), 1000 + r, shape);
  if (r == 0) {
    fmt::print("terse bench allreduce: {} ranks on {} hosts ({}), {} floats ({:.1f} MB) fp32, "
               "median of {} runs{}\n",
               n_ranks, hosts.size(), hosts_text(hosts), n, n * 4 / 1e6, opt.reps,
               rate > 0 ? fmt::format(", links {} ({:.0f} Mbit/s)", opt.link, rate / 1e6) : "");
    fmt::print("{:<40} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8}\n",
               "configuration", "median s", "min s", "CPU s", "MB/rank", "MB/link", "ideal s",
               "x ideal", "vs gloo", "vs raw", "vs flat");
    std::fflush(stdout);
  }

  nlohmann::json report;
  report["ranks"] = n_ranks;
  report["elements"] = n;
  report["bytes"] = n * 4;
  report["reps"] = opt.reps;
  report["link"] = opt.link;
  report["link_bits_per_second"] = rate;
  report["hosts"] = hosts;
  report["configs"] = nlohmann::json::array();
  double best_gloo = 0, raw = 0;
  std::map<std::string, double> flat;  // flat medians by codec, strategy and K requested

  std::uint64_t tensor = 0;
  for (Config& cfg : configs(opt, two_level)) {
    Measured m;
    if (cfg.kind == "terse") {
      const std::string name = fmt::format("gradient{}", tensor++);
      m = measure_terse(engine, *comm, cfg, name, input, data, opt.reps);
    } else {
      m = measure_gloo(*comm, *gloo_comm, cfg, input, data, opt.reps, host_of);
    }
    const std::vector<double>& times = m.times;
    const double bytes_per_rank = m.bytes_per_rank;
    bool identical = true;
    // Every rank must hold the same result.
    const double d = static_cast<double>(
        fnv1a64(std::string_view(reinterpret_cast<const char*>(data.data()), n * 4)) >> 12);
    for (double v : gather(*comm, d)) identical &= v == d;

    const double med = median(times);
    // CPU seconds per allreduce of the busiest rank (includes the Gloo loop thread's work).
    const double cpu = max_of(gather(*comm, m.cpu / opt.reps));
    const double link_bytes = busiest_link(m.bytes_across);
    const double ideal = rate > 0 ? link_bytes * 8 / rate : 0;
    const std::string same = fmt::format("{}|{}|{}", cfg.options.codec,
                                         to_string(cfg.options.strategy), cfg.options.partitions);
    const bool hierarchical = cfg.label.rfind("hosts+", 0) == 0;
    if (cfg.kind == "terse" && !hierarchical) flat[same] = med;
    const double vs_flat = hierarchical && flat.count(same) ? flat[same] / med : 0;
    if (cfg.kind != "terse" && (best_gloo == 0 || med < best_gloo)) best_gloo = med;
    if (cfg.kind == "terse" && cfg.options.codec == "none" && (raw == 0 || med < raw)) raw = med;
    if (r == 0) {
      fmt::print("{:<40} {:>9.4f} {:>9.4f} {:>8.4f} {:>9.2f} {:>9.2f} {:>9} {:>8} {:>9} {:>9} "
                 "{:>8}{}\n",
                 cfg.label, med, *std::min_element(times.begin(), times.end()), cpu,
                 bytes_per_rank / 1e6, link_bytes / 1e6,
                 ideal > 0 ? fmt::format("{:.4f}", ideal) : "-",
                 ideal > 0 ? fmt::format("{:.2f}", med / ideal) : "-",
                 best_gloo > 0 ? fmt::format("{:.2f}x", best_gloo / med) : "-",
                 raw > 0 ? fmt::format("{:.2f}x", raw / med) : "-",
                 vs_flat > 0 ? fmt::format("{:.2f}x", vs_flat) : "-",
                 identical ? "" : "  RESULTS DIFFER ACROSS RANKS");
      std::fflush(stdout);
    }
    report["configs"].push_back({{"label", cfg.label},
                                 {"kind", cfg.kind},
                                 {"codec", cfg.options.codec},
                                 {"strategy", std::string(to_string(cfg.options.strategy))},
                                 {"partitions_requested", cfg.options.partitions},
                                 {"times_s", times},
                                 {"median_s", med},
                                 {"cpu_s_per_rank", cpu},
                                 {"bytes_per_rank", bytes_per_rank},
                                 {"hierarchical", hierarchical},
                                 {"bytes_busiest_link", link_bytes},
                                 {"vs_flat", vs_flat},
                                 {"ideal_s", ideal},
                                 {"identical_across_ranks", identical}});
  }
  if (r == 0) {
    report["best_gloo_median_s"] = best_gloo;
    report["terse_raw_median_s"] = raw;
    if (!opt.json.empty()) {
      std::ofstream(opt.json) << report.dump(2) << "\n";
      fmt::print("wrote {}\n", opt.json);
    }
  }
  engine.synchronize();
  comm->barrier("end");
}

}  // namespace

void add_bench_allreduce_command(CLI::App& bench) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "allreduce", "Allreduce time: Gloo's rings, terse raw and compressed strategies");
  cmd->add_option("--ranks", opt->ranks, "Local ranks to start when not under a launcher")
      ->capture_default_str();
  cmd->add_option("--size", opt->size, "Gradient size (B, KB, MB, GB, KiB, MiB, GiB)")
      ->capture_default_str();
  cmd->add_option("--codec", opt->codecs, "Codec specs (default: a standard suite)");
  cmd->add_option("--strategy", opt->strategies, "Strategies (auto raw allgather sharded ring "
                                                 "summable)");
  cmd->add_option("--partitions", opt->partitions, "Partition counts K (0: the engine's choice)");
  cmd->add_option("--hierarchy", opt->hierarchies,
                  "Hierarchies to run each terse configuration in (auto flat hosts; default: "
                  "flat and hosts on hosts of several ranks, else auto)");
  cmd->add_option("--reps", opt->reps, "Timed runs per configuration (median)")
      ->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Engine worker threads (0: default)");
  cmd->add_option("--link", opt->link, "Link rate of the emulated cluster, e.g. 1gbit (for "
                                       "the ideal time)");
  cmd->add_option("--json", opt->json, "Write results as JSON to this file (rank 0)");
  cmd->add_flag("--no-gloo", opt->no_gloo, "Skip Gloo's own algorithms");
  cmd->callback([opt] {
    if (!relaunch_unless_launched(opt->ranks, "bench allreduce")) run_rank(*opt);
  });
}

}  // namespace terse::tools
