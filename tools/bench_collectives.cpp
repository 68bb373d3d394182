// terse bench collectives: reduce-scatter, all-gather and all-to-all time of one large tensor,
// in the same processes and the same run, for Gloo's own algorithms
// (ReduceScatterHalvingDoubling, allgather, alltoall) and terse raw and compressed.
//
// Run under a launcher (scripts/cluster.sh or `terse run`), or alone: without RANK in the
// environment it starts --ranks local ranks of itself through `terse run`. --size is the whole
// tensor: a reduce-scatter's input, an all-gather's output, an all-to-all's input (even
// blocks). Every figure is the median over --reps timed runs of the slowest rank's time, each
// after a barrier. With --link RATE it reports the ideal time, the bytes the busiest rank sends
// over the link rate, and the measured time against it (x ideal). Reduce-scatter and all-gather
// also run codec "auto" (the planner choosing among raw and the codecs of the table, after its
// calibration and exploration), with the plan it chose and its time against the best fixed
// configuration of the same run.
#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/reduce_scatter.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "launch.h"
#include "planner/planner_impl.h"  // PlannerAccess: no re-checks while timing
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/testing/gradient.h"
#include "units.h"

namespace terse::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int ranks = 4;
  std::vector<std::string> ops;
  std::vector<std::string> sizes;
  std::vector<std::string> codecs;
  int reps = 5;
  int threads = 0;
  bool no_auto = false;
  std::string link;
  std::string json;
};

struct Config {
  std::string label;
  bool gloo = false;
  CollectiveOptions options;
};

// The codecs of the table: --codec, else a standard suite.
std::vector<std::string> table_codecs(const Options& opt) {
  if (!opt.codecs.empty()) return opt.codecs;
  return {"fp16", "minmax8", "onebit:ef=1"};
}

std::vector<Config> configs(const std::string& op, const Options& opt) {
  std::vector<Config> out;
  out.push_back({"gloo", true, {}});
  auto add = [&](const std::string& codec, Strategy s) {
    CollectiveOptions o;
    o.codec = codec;
    o.strategy = s;
    out.push_back({fmt::format("terse {} {}", to_string(s), codec), false, o});
  };
  add("none", Strategy::kRaw);
  const Strategy compressed = op == "reduce_scatter" ? Strategy::kAllToAll
                              : op == "all_gather"   ? Strategy::kAllgather
                                                     : Strategy::kAllToAll;
  // Codec "auto" chooses among the table's codecs (TERSE_PLAN_CODECS, where set, instead).
  auto add_auto = [&] {
    if (opt.no_auto || op == "all_to_all") return;
    CollectiveOptions o;
    o.codec = "auto";
    out.push_back({"terse auto", false, o});
  };
  if (!opt.codecs.empty()) {
    for (const auto& c : opt.codecs) add(c, compressed);
    add_auto();
    return out;
  }
  add("fp16", compressed);
  add("minmax8", compressed);
  if (op != "all_to_all") add("onebit:ef=1", compressed);
  if (op == "reduce_scatter") {
    add("minmax8", Strategy::kSharded);
    add("fp16", Strategy::kSummable);
  }
  add_auto();
  return out;
}

// One operation at one size: its buffers, shared by all the configurations of its rows.
struct Case {
  std::string op;
  std::string size;
  std::size_t total = 0;  // elements of the whole tensor
  std::size_t shard = 0;  // elements of one rank's block
  std::size_t in_n = 0;   // input and output elements of the operation
  std::size_t out_n = 0;
  kit::PageArray<float> input;
  kit::PageArray<float> output;
  std::vector<std::size_t> counts;
};

Case make_case(const std::string& op, const std::string& size, int r, int n_ranks) {
  Case c;
  c.op = op;
  c.size = size;
  c.total = parse_size(size) / sizeof(float) / n_ranks * n_ranks;
  c.shard = c.total / n_ranks;
  c.in_n = op == "all_gather" ? c.shard : c.total;
  c.out_n = op == "reduce_scatter" ? c.shard : c.total;
  c.input = touched<float>(c.in_n);
  c.output = touched<float>(std::max(c.out_n, c.total));
  testing::fill_gradient(c.input.all(), 1000 + r, testing::kNormalGradient);
  c.counts.assign(n_ranks, c.shard);
  return c;
}

// One run of Gloo's own algorithm for the case's operation.
std::function<void()> gloo_once(const std::shared_ptr<gloo::Context>& ctx, Case& c, int n_ranks) {
  if (c.op == "reduce_scatter") {
    // In place on a copy of the input: rank r's sum lands at its shard.
    auto rs = std::make_shared<gloo::ReduceScatterHalvingDoubling<float>>(
        ctx, std::vector<float*>{c.output.data()}, static_cast<int>(c.total),
        std::vector<int>(n_ranks, static_cast<int>(c.shard)));
    return [&c, rs] {
      std::copy(c.input.begin(), c.input.end(), c.output.begin());
      rs->run();
    };
  }
  if (c.op == "all_gather") {
    return [&c, ctx] {
      gloo::AllgatherOptions o(ctx);
      o.setInput(c.input.data(), c.in_n);
      o.setOutput(c.output.data(), c.total);
      gloo::allgather(o);
    };
  }
  return [&c, ctx] {
    gloo::AlltoallOptions o(ctx);
    o.setInput(c.input.data(), c.total);
    o.setOutput(c.output.data(), c.total);
    gloo::alltoall(o);
  };
}

// One run of terse's operation with the configuration's options, as tensor `name`.
std::function<void()> terse_once(Engine& engine, Case& c, const std::string& name,
                                 const Config& cfg) {
  const TensorView in(c.input.data(), c.in_n, DType::kFloat32);
  const TensorView out(c.output.data(), c.out_n, DType::kFloat32);
  return [&engine, &c, &name, &cfg, in, out] {
    if (c.op == "reduce_scatter") {
      engine.reduce_scatter(name, in, out, cfg.options).wait();
    } else if (c.op == "all_gather") {
      engine.all_gather(name, in, out, cfg.options).wait();
    } else {
      engine.all_to_all(name, in, c.counts, out, c.counts, cfg.options).wait();
    }
  };
}

// The state every row of the table shares.
struct Bench {
  const Options& opt;
  Communicator& comm;
  std::shared_ptr<gloo::Context> ctx;
  Engine& engine;
  Planner& planner;
  int threads;
  double rate;
  nlohmann::json& report;
  std::uint64_t tensor = 0;  // names each configuration's tensor
};

// Codec auto: runs until the planner has settled (calibration was the first call's), and
// returns the plan it chose.
std::string settle_auto(Bench& b, const Case& c, const std::function<void()>& once) {
  const Operation operation =
      c.op == "reduce_scatter" ? Operation::kReduceScatter : Operation::kAllGather;
  int runs = 0;
  while (planner::exploring(b.planner,
                            {c.total, b.threads, Strategy::kAuto, 0, Tier::kLight, operation}) &&
         ++runs < 1000) {
    once();
  }
  return plan_key(planner::plan(
      b.planner, b.comm, {c.total, b.threads, Strategy::kAuto, 0, Tier::kLight, operation}));
}

// The rows of one operation at one size: each configuration warmed up, timed, printed (rank 0)
// and added to the report.
void run_case(Bench& b, Case& c) {
  const int r = b.comm.rank(), n_ranks = b.comm.size();
  double gloo_median = 0, best_fixed = 0;
  std::string best_label;
  for (Config& cfg : configs(c.op, b.opt)) {
    const std::string name = fmt::format("{}{}", c.op, b.tensor++);
    double bytes_per_rank = 0;
    std::function<void()> once;
    if (cfg.gloo) {
      bytes_per_rank = static_cast<double>(n_ranks - 1) * c.shard * 4;
      once = gloo_once(b.ctx, c, n_ranks);
    } else {
      once = terse_once(b.engine, c, name, cfg);
    }
    for (int w = 0; w < 3; ++w) once();  // first use, buffers, every worker thread
    const bool automatic = cfg.options.codec == "auto";
    std::string chosen;
    if (automatic) chosen = settle_auto(b, c, once);
    std::vector<double> times;
    const auto before = b.engine.bytes_sent();
    for (int rep = 0; rep < b.opt.reps; ++rep) {
      b.comm.barrier("bench");
      const auto t0 = Clock::now();
      once();
      times.push_back(
          max_of(gather(b.comm, std::chrono::duration<double>(Clock::now() - t0).count())));
    }
    if (!cfg.gloo) {
      bytes_per_rank = max_of(
          gather(b.comm, static_cast<double>(b.engine.bytes_sent() - before) / b.opt.reps));
    }
    const double med = median(times);
    if (cfg.gloo) gloo_median = med;
    if (!cfg.gloo && !automatic && (best_fixed == 0 || med < best_fixed)) {
      best_fixed = med;
      best_label = cfg.label;
    }
    const double ideal = b.rate > 0 ? bytes_per_rank * 8 / b.rate : 0;
    if (r == 0) {
      fmt::print("{:<15} {:>7} {:<28} {:>9.4f} {:>9.4f} {:>10.2f} {:>9} {:>8} {:>8}\n", c.op,
                 c.size, cfg.label, med, *std::min_element(times.begin(), times.end()),
                 bytes_per_rank / 1e6, ideal > 0 ? fmt::format("{:.4f}", ideal) : "-",
                 ideal > 0 ? fmt::format("{:.2f}", med / ideal) : "-",
                 gloo_median > 0 ? fmt::format("{:.2f}x", gloo_median / med) : "-");
      if (automatic) {
        fmt::print(
            "{:<15} {:>7}   auto chose {}; best fixed: {} ({:.4f} s), auto / best "
            "{:.2f}\n",
            "", "", chosen, best_label, best_fixed, med / best_fixed);
      }
      std::fflush(stdout);
    }
    b.report["results"].push_back({{"op", c.op},
                                   {"size", c.size},
                                   {"elements", c.total},
                                   {"label", cfg.label},
                                   {"gloo", cfg.gloo},
                                   {"codec", cfg.options.codec},
                                   {"strategy", std::string(to_string(cfg.options.strategy))},
                                   {"times_s", times},
                                   {"median_s", med},
                                   {"bytes_per_rank", bytes_per_rank},
                                   {"ideal_s", ideal},
                                   {"chosen", chosen}});
  }
}

void run_rank(const Options& opt) {
  const CommunicatorOptions comm_options = communicator_options_from_environment();
  Bootstrap boot = bootstrap_from_env(
      comm_options.timeout.count() > 0 ? comm_options.timeout : default_timeout(),
      comm_options.secret);
  std::shared_ptr<Communicator> comm =
      Communicator::create(boot.rank, boot.size, boot.store, comm_options);
  CommunicatorOptions gloo_options = comm_options;
  gloo_options.prefix = "gloo-baseline";
  std::shared_ptr<Communicator> gloo_comm =
      Communicator::create(boot.rank, boot.size, boot.store, gloo_options);
  auto ctx = gloo_context(*gloo_comm);
  const int r = comm->rank(), n_ranks = comm->size();
  const double rate = opt.link.empty() ? 0 : parse_rate(opt.link);
  EngineOptions eo;
  eo.threads = opt.threads;
  eo = engine_options_from_environment(eo);
  PlannerOptions po;
  po.heavy = {"none"};  // the auto row is codec "auto": the light tier alone
  po = planner_options_from_environment(po);
  if (po.allowed.empty()) po.allowed = table_codecs(opt);  // TERSE_PLAN_CODECS where set
  auto planner = std::make_shared<Planner>(po);
  PlannerAccess::set_recheck_interval(*planner, 0);  // no exchanges among the timed runs
  eo.planner = planner;
  Engine engine(comm, eo);
  const int threads = eo.threads > 0 ? eo.threads : kDefaultEngineThreads;
  const std::vector<std::string> ops =
      opt.ops.empty() ? std::vector<std::string>{"reduce_scatter", "all_gather", "all_to_all"}
                      : opt.ops;
  const std::vector<std::string> sizes =
      opt.sizes.empty() ? std::vector<std::string>{"4MiB", "32MiB"} : opt.sizes;
  if (r == 0) {
    fmt::print("terse bench collectives: {} ranks, median of {} runs{}\n", n_ranks, opt.reps,
               rate > 0 ? fmt::format(", links {} ({:.0f} Mbit/s)", opt.link, rate / 1e6) : "");
    fmt::print("{:<15} {:>7} {:<28} {:>9} {:>9} {:>10} {:>9} {:>8} {:>8}\n", "operation", "size",
               "configuration", "median s", "min s", "MB/rank", "ideal s", "x ideal", "vs gloo");
    std::fflush(stdout);
  }
  nlohmann::json report;
  report["ranks"] = n_ranks;
  report["reps"] = opt.reps;
  report["link"] = opt.link;
  report["link_bits_per_second"] = rate;
  report["results"] = nlohmann::json::array();
  Bench b{opt, *comm, ctx, engine, *planner, threads, rate, report, 0};
  for (const auto& op : ops) {
    if (op != "reduce_scatter" && op != "all_gather" && op != "all_to_all") {
      throw InvalidArgument(
          fmt::format("bench collectives: unknown --op {} (reduce_scatter, "
                      "all_gather, all_to_all)",
                      op));
    }
    for (const auto& size : sizes) {
      Case c = make_case(op, size, r, n_ranks);
      run_case(b, c);
    }
  }
  if (r == 0 && !opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(2) << "\n";
    fmt::print("wrote {}\n", opt.json);
  }
  engine.synchronize();
  comm->barrier("end");
}

}  // namespace

void add_bench_collectives_command(CLI::App& bench) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd =
      bench.add_subcommand("collectives",
                           "Reduce-scatter, all-gather and all-to-all time: Gloo's, terse raw and "
                           "compressed, same processes");
  cmd->add_option("--ranks", opt->ranks, "Local ranks to start when not under a launcher")
      ->capture_default_str();
  cmd->add_option("--op", opt->ops,
                  "Operations: reduce_scatter, all_gather, all_to_all (default: all three)");
  cmd->add_option("--size", opt->sizes, "Whole tensor sizes (default: 4MiB 32MiB)");
  cmd->add_option("--codec", opt->codecs, "Codec specs (default: a standard suite)");
  cmd->add_option("--reps", opt->reps, "Timed runs per configuration (median)")
      ->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Engine worker threads (0: default)");
  cmd->add_flag("--no-auto", opt->no_auto,
                "Leave out codec auto (it calibrates first: a few seconds, or the cache)");
  cmd->add_option("--link", opt->link,
                  "Link rate of the emulated cluster, e.g. 1gbit (for "
                  "the ideal time)");
  cmd->add_option("--json", opt->json, "Write results as JSON to this file (rank 0)");
  cmd->callback([opt] {
    if (!relaunch_unless_launched(opt->ranks, "bench collectives")) run_rank(*opt);
  });
}

}  // namespace terse::tools
