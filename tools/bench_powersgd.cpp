// terse bench powersgd: time of one full PowerSGD step (round 0, round 1 and finish through the
// RoundCodec interface, on one process) for gradient-shaped matrices and ranks, against the
// BLAS's own sgemm throughput measured on a square product in the same run. OpenBLAS runs on
// one thread (openblas_set_num_threads(1)) so figures compare with `terse bench codecs`.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "kit/blas.h"  // the BLAS calls PowerSGD makes, timed alone
#include "terse/codec.h"
#include "terse/testing/gradient.h"

namespace terse::tools {
namespace {

struct Shape {
  std::size_t rows = 0, cols = 0;
};

Shape parse_shape(const std::string& s) {
  Shape sh;
  char x = 0;
  std::istringstream in(s);
  if (!(in >> sh.rows >> x >> sh.cols) || x != 'x' || sh.rows == 0 || sh.cols == 0) {
    throw InvalidArgument(fmt::format("terse bench powersgd: shape '{}' is not ROWSxCOLS", s));
  }
  return sh;
}

struct Options {
  std::vector<std::string> shapes = {"2048x2048", "4096x4096", "25088x4096", "65536x256"};
  std::vector<int> ranks = {1, 4, 16};
  int reps = 5;
  std::size_t peak_size = 2048;
  int threads = 1;
  std::string json;
};

void run(const Options& opt) {
  kit::blas_set_threads(opt.threads);

  // The BLAS's own throughput on a square product: the peak the step is compared against.
  const std::size_t s = opt.peak_size;
  auto a = touched<float>(s * s), b = touched<float>(s * s), c = touched<float>(s * s);
  std::mt19937_64 gen(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : a) v = normal(gen);
  for (auto& v : b) v = normal(gen);
  double t_peak = median_seconds(opt.reps, [&] {
    kit::sgemm(false, false, s, s, s, 1.0f, a.data(), s, b.data(), s, 0.0f, c.data(), s);
  });
  double peak = 2.0 * s * s * s / t_peak / 1e9;
  a = {};
  b = {};
  c = {};

  fmt::print("terse bench powersgd: one step = round 0 + round 1 + finish (single process), "
             "median of {} runs, OpenBLAS threads {}\n", opt.reps, kit::blas_threads());
  fmt::print("sgemm peak ({}x{}x{}): {:.1f} GFLOP/s\n\n", s, s, s, peak);
  fmt::print("{:>12} {:>5} {:>10} {:>10} {:>9} {:>7} {:>9}\n", "matrix", "rank", "step ms",
             "GFLOP/s", "% peak", "ratio", "M GB/s");

  nlohmann::json report;
  report["reps"] = opt.reps;
  report["blas_threads"] = kit::blas_threads();
  report["sgemm_peak"] = {{"size", s}, {"seconds", t_peak}, {"gflops", peak}};
  report["results"] = nlohmann::json::array();

  for (const auto& text : opt.shapes) {
    Shape sh = parse_shape(text);
    const std::size_t n = sh.rows * sh.cols;
    auto x = touched<float>(n), y = touched<float>(n);
    testing::fill_gradient(x.all(), 1, testing::kNormalGradient);
    for (int rank : opt.ranks) {
      auto codec = make_codec(fmt::format("powersgd:rank={},rows={}", rank, sh.rows));
      auto* rc = dynamic_cast<const RoundCodec*>(codec.get());
      auto state = codec->make_state(n);
      auto c0 = touched<float>(rc->round_elements(0, n));
      auto c1 = touched<float>(rc->round_elements(1, n));
      EncodeContext ctx;
      ctx.seed = 7;
      ctx.tensor = 1;
      ctx.state = state.get();
      double t = median_seconds(opt.reps, [&] {
        // One rank: the sum of the contributions is the contribution itself.
        rc->encode_round(0, x, c0, ctx);
        rc->absorb_round(0, c0, ctx);
        rc->encode_round(1, x, c1, ctx);
        rc->absorb_round(1, c1, ctx);
        rc->finish(y, ctx);
        ++ctx.step;
      });
      bool raw = rc->round_elements(1, n) == 0;
      std::size_t r = raw ? 0 : c1.size() / sh.cols;
      // Four products of 2 n r flops each: P = M Q, Q = M^T P, y = P Q^T, residual -= P Q_w^T.
      double flops = 8.0 * static_cast<double>(n) * static_cast<double>(r);
      double gflops = flops / t / 1e9;
      double ratio = static_cast<double>(n) / static_cast<double>(c0.size() + c1.size());
      double gbs = 4.0 * static_cast<double>(n) / t / 1e9;
      fmt::print("{:>12} {:>5} {:>10.2f} {:>10.1f} {:>8.1f}% {:>7.0f} {:>9.2f}\n", text, rank,
                 1e3 * t, gflops, 100.0 * gflops / peak, ratio, gbs);
      report["results"].push_back({{"rows", sh.rows},
                                   {"cols", sh.cols},
                                   {"rank", rank},
                                   {"effective_rank", r},
                                   {"step_s", t},
                                   {"gflops", gflops},
                                   {"fraction_of_peak", gflops / peak},
                                   {"compression_ratio", ratio},
                                   {"input_gbs", gbs}});
    }
  }
  if (!opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(2) << "\n";
    fmt::print("\nwrote {}\n", opt.json);
  }
}

}  // namespace

void add_bench_powersgd_command(CLI::App& bench) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand(
      "powersgd", "PowerSGD step time against the BLAS's sgemm peak (single thread)");
  cmd->add_option("--shapes", opt->shapes, "Matrices as ROWSxCOLS")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--ranks", opt->ranks, "Ranks")->delimiter(',')->capture_default_str();
  cmd->add_option("--reps", opt->reps, "Timed runs per figure (median)")->capture_default_str();
  cmd->add_option("--peak-size", opt->peak_size, "Side of the square sgemm for the peak")
      ->capture_default_str();
  cmd->add_option("--threads", opt->threads, "OpenBLAS threads (default 1)")
      ->capture_default_str();
  cmd->add_option("--json", opt->json, "Write results as JSON to this file");
  cmd->callback([opt] { run(*opt); });
}

}  // namespace terse::tools
