// terse calibrate: measures this job's links and this machine's codec costs (what the planner
// uses for codec "auto"), prints them with the fits' errors and writes the cache file.
//
// Run under a launcher (scripts/cluster.sh, `terse run`, torchrun), or alone: without RANK in
// the environment it starts --ranks local ranks of itself through `terse run`.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
// Internal headers: the calibration record and its measuring are no part of the public API;
// this command is their front end.
#include "engine/allreduce_probe.h"  // the probe calibration times the engine with
#include "launch.h"
#include "planner/calibration.h"  // Calibration records: this command prints and writes them
#include "terse/communicator.h"
#include "terse/environment.h"
#include "terse/planner.h"
#include "transport/topology.h"  // the job's hosts, recorded with its links

namespace terse::tools {
namespace {

struct Options {
  int ranks = 2;
  std::vector<std::string> codecs;
  std::vector<std::string> heavy;
  std::string out;
  std::size_t max_elements = std::size_t{1} << 22;
};

std::string fit_row(const std::string& what, const LinearFit& f) {
  std::string knee = "-";
  if (f.knee > 0) knee = fmt::format("{:.0f}:{:.4f}", f.knee, f.b2 * 1e9);
  return fmt::format("  {:<26} {:>9.2f} {:>11.4f} {:>9.2f} {:>18} {:>7.1f} {:>7.1f} {:>4}\n", what,
                     f.a * 1e6, f.b * 1e9, f.b > 0 ? 4e-9 / f.b : 0.0, knee,
                     f.rms_relative_error * 100, f.max_relative_error * 100, f.outliers);
}

void print(const Calibration& c, const std::string& path) {
  std::string t;
  t += fmt::format("terse calibrate: {} ranks ({} on this machine, {} cores), host {}, {:.2f} s\n",
                   c.world_size, c.ranks_on_host, c.cores, c.host, c.seconds);
  if (!c.host_of.empty()) {
    t += fmt::format("hosts of the ranks (TERSE_TOPOLOGY): {}\n", fmt::join(c.host_of, " "));
  }
  if (c.world_size > 1) {
    t += "links (measured with every rank exchanging with a partner at once):\n";
    t += fmt::format("  {:<8} {:>12} {:>12}\n", "pair", "latency us", "MB/s");
    for (int i = 0; i < c.world_size; ++i) {
      for (int j = i + 1; j < c.world_size; ++j) {
        const double b = c.peer_beta[i][j];
        t += fmt::format("  {:<8} {:>12.1f} {:>12.1f}\n", fmt::format("{}-{}", i, j),
                         c.peer_alpha[i][j] * 1e6, b > 0 ? 1e-6 / b : 0.0);
      }
    }
    t += fmt::format(
        "  model: alpha {:.1f} us (a message round inside the engine), beta {:.4f} ns/B "
        "({:.1f} MB/s, the slowest pair; {:.1f} MB/s in a raw allreduce of the engine)\n",
        c.alpha * 1e6, c.beta * 1e9, c.beta > 0 ? 1e-6 / c.beta : 0.0,
        c.engine_beta > 0 ? 1e-6 / c.engine_beta : 0.0);
    if (const LinkClasses k = link_classes(c, c.host_of);
        k.intra.pairs > 0 && k.cross.pairs > 0) {
      // The hierarchical allreduce's two classes of links, each its slowest pair's.
      auto line = [](const char* what, const LinkClass& l) {
        return fmt::format(
            "  {}: {} pairs, the slowest {:.1f} us, {:.1f} MB/s; a round {:.1f} us in the "
            "engine, bytes at {:.3f}x the model's\n",
            what, l.pairs, l.pair_alpha * 1e6, l.pair_beta > 0 ? 1e-6 / l.pair_beta : 0.0,
            l.alpha * 1e6, l.scale);
      };
      t += line("inside hosts", k.intra) + line("across hosts", k.cross);
    }
    if (const LinearFit& l = c.engine_link; l.points > 0) {
      t += fmt::format(
          "  the cores pace the links: a byte costs {:.3f} ns in a raw allreduce's partition up "
          "to {:.0f} KB sent, {:.3f} ns beyond (the model's links)\n",
          l.b * 1e9, l.knee / 1e3, l.b2 * 1e9);
    }
    const LinearFit& x = c.transport_cpu;
    t += fmt::format(
        "  host CPU (median rank, every thread): {:.1f} us a message; the transport {:.3f} ns/B "
        "sent up to {:.0f} KB, {:.3f} ns/B beyond; allreduces take {:.2f}x the CPU the bound "
        "counts over the cores (the process's CPU is {:.2f}x the model's{})\n",
        c.cpu_per_message * 1e6, x.b * 1e9, x.knee / 1e3, x.b2 * 1e9, c.host_efficiency,
        c.host_cpu_ratio,
        c.host_share() > 1 ? "" : "; the bound counts the process's: a core a rank");
  }
  t += "CPU costs t(n) = A + B*n, n floats, every rank of the machine at once (fit error on the "
       "measured sizes):\n";
  t += fmt::format("  {:<26} {:>9} {:>11} {:>9} {:>18} {:>7} {:>7} {:>4}\n", "operation", "A us",
                   "B ns/elem", "GB/s", "knee n:B2 ns/elem", "rms %", "max %", "out");
  t += fit_row("fp32 add", c.add);
  t += fit_row("fp32 divide", c.divide);
  for (const auto& k : c.codecs) {
    const std::string name = k.spec.size() > 16 ? k.spec.substr(0, 16) : k.spec;
    if (k.multi_round) {  // no payload: every round and finish() on one rank
      t += fit_row(name + " rounds", k.encode);
    } else {
      t += fit_row(name + " encode", k.encode);
      t += fit_row(name + " decode", k.decode);
      t += fit_row(name + " accumulate", k.accumulate);
    }
    if (k.summable) t += fit_row(name + " combine", k.combine);
    t += fmt::format("  {:<26} {:>9.0f} {:>11.4f}  bytes = A + B*n\n", name + " bytes", k.bytes.a,
                     k.bytes.b);
  }
  t += "  CPU slowdown with t busy threads per rank:";
  for (std::size_t i = 0; i < c.cpu_slowdown.size(); ++i) {
    t += fmt::format(" t={} x{:.2f}", i + 1, c.cpu_slowdown[i]);
  }
  t += fmt::format(
      "\nengine fixed costs (measured on tiny raw tensors): {:.1f} us per allreduce, "
      "{:.1f} us per partition task\n",
      c.job_overhead * 1e6, c.task_overhead * 1e6);
  t += fmt::format("wrote {}\n", path);
  std::fputs(t.c_str(), stdout);
  std::fflush(stdout);
}

void run_rank(const Options& opt) {
  std::shared_ptr<Communicator> comm =
      Communicator::from_env(communicator_options_from_environment());
  PlannerOptions po;
  po.allowed = opt.codecs;
  po.heavy = opt.heavy;
  po = planner_options_from_environment(po);
  const Planner defaults(po);  // resolves the default codec lists and checks the specs
  const EngineOptions eo = engine_options_from_environment();
  const int threads = eo.threads;
  // The job's hosts, as its engines will agree them: the cache holds the topology its links
  // were measured under (an engine of another topology measures again).
  const transport::Topology topology =
      transport::agree_topology(*comm, eo.topology, eo.host,
                                eo.launched_ranks == comm->size() ? eo.local_ranks : 0);
  CalibrationOptions co;
  co.codecs = defaults.allowed();
  for (const auto& spec : defaults.heavy()) co.codecs.push_back(spec);
  co.codec_max_elements = opt.max_elements;
  co.quiet = false;
  co.host_of = topology.host_of;
  const Calibration c = calibrate(*comm, co, allreduce_probes(threads));
  const std::string path =
      opt.out.empty() ? default_calibration_path(comm->size(), po.cache_directory) : opt.out;
  std::error_code ec;
  // Every rank writes its own machine's cache (the same agreed numbers); the last rename wins.
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = fmt::format("{}.tmp{}", path, comm->rank());
  std::ofstream(tmp) << c.to_json() << "\n";
  std::filesystem::rename(tmp, path, ec);
  if (comm->rank() == 0) print(c, path);
  comm->barrier("end");
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "Measure links and codec costs for the planner (codec auto); write the cache");
  cmd->add_option("--ranks", opt->ranks, "Local ranks to start when not under a launcher")
      ->capture_default_str();
  cmd->add_option("--codecs", opt->codecs,
                  "The light tier's codecs to measure (default: TERSE_PLAN_CODECS, else fp16 "
                  "minmax8:ef=1)");
  cmd->add_option("--heavy", opt->heavy,
                  "The heavy tier's codecs to measure (default: TERSE_PLAN_HEAVY_CODECS, else "
                  "onebit:ef=1 powersgd; none: none)");
  cmd->add_option("--out", opt->out,
                  "Cache file (default: ~/.cache/terse/calibration-HOST-nN.json)");
  cmd->add_option("--max-elements", opt->max_elements, "Largest tensor of the codec fits")
      ->capture_default_str();
  cmd->callback([opt] {
    if (!relaunch_unless_launched(opt->ranks, "calibrate")) run_rank(*opt);
  });
}

}  // namespace terse::tools
