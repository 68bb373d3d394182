// terse bench codecs: each codec's single-thread encode and decode throughput on a synthetic
// gradient, against a memory copy of the same data measured in the same run. With --dtype
// float16 or bfloat16 the gradient is given in that type (Codec::encode of 16-bit values) and
// GB/s count its 2-byte elements; Melem/s compares the types.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "kit/basic.h"  // kit::narrow: the half inputs, as the engine rounds them
#include "terse/codec.h"
#include "terse/testing/gradient.h"

namespace terse::tools {
namespace {

// Issue targets, as a fraction of the memory-copy throughput, by codec name.
double target_fraction(const std::string& name) {
  static const std::map<std::string, double> targets = {
      {"none", 0.5},     {"fp16", 0.5},     {"bf16", 0.5},    {"onebit", 0.5},
      {"minmax8", 0.5},  {"tbq", 0.5},      {"threelc", 0.5}, {"terngrad", 0.25},
      {"qsgd", 0.25},    {"natural", 0.25}, {"threshold", 0.3}, {"dgc", 0.3},
      {"randomk", 0.3},  {"topk", 0.1}};
  auto it = targets.find(name);
  return it == targets.end() ? 0.0 : it->second;
}

std::vector<std::string> default_specs() {
  std::vector<std::string> specs;
  for (const auto& info : registered_codecs()) {
    if (info.name == "powersgd") continue;  // a RoundCodec: reported by bench powersgd
    specs.push_back(info.name);
  }
  return specs;
}

struct Options {
  std::size_t elements = 25'000'000;
  int reps = 5;
  std::vector<std::string> codecs;
  std::string json;
  std::string dtype = "float32";
};

void run(const Options& opt) {
  const std::size_t n = opt.elements;
  std::vector<std::string> specs = opt.codecs.empty() ? default_specs() : opt.codecs;

  // A gradient-like input: normal values with a few large outliers.
  auto x = touched<float>(n);
  testing::fill_gradient(x.all(), 42, testing::kBenchmarkGradient);
  const DType dtype = opt.dtype == "float16"    ? DType::kFloat16
                      : opt.dtype == "bfloat16" ? DType::kBFloat16
                                                : DType::kFloat32;
  std::vector<std::uint16_t> half;
  if (dtype != DType::kFloat32) {
    half = std::vector<std::uint16_t>(n);
    kit::narrow(dtype, x, half.data());
  }

  auto copy = touched<float>(n);
  const double bytes_in = static_cast<double>(n) * element_bytes(dtype);
  double t_copy = median_seconds(opt.reps, [&] {
    std::memcpy(copy.data(), x.data(), bytes_in);
  });
  double copy_gbs = bytes_in / t_copy / 1e9;

  fmt::print("terse bench codecs: {} {} ({:.1f} MB), median of {} runs, single thread\n", n,
             to_string(dtype), bytes_in / 1e6, opt.reps);
  fmt::print("memory copy (reference): {:.2f} GB/s\n\n", copy_gbs);
  fmt::print("{:<28} {:>12} {:>8} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7}  {}\n", "codec", "bytes",
             "ratio", "enc GB/s", "enc Me/s", "dec GB/s", "enc %", "dec %", "target", "verdict");

  nlohmann::json report;
  report["elements"] = n;
  report["reps"] = opt.reps;
  report["memcpy_gbs"] = copy_gbs;
  report["dtype"] = to_string(dtype);
  report["codecs"] = nlohmann::json::array();

  auto y = touched<float>(n);
  for (const auto& text : specs) {
    auto codec = make_codec(text);
    auto out = touched<std::byte>(codec->max_encoded_bytes(n));
    auto state = codec->make_state(n);
    Workspace ws;
    EncodeContext ctx;
    ctx.seed = 7;
    ctx.tensor = 1;
    ctx.state = state.get();
    ctx.workspace = &ws;
    std::size_t bytes = 0;
    double t_enc = median_seconds(opt.reps, [&] {
      bytes = dtype == DType::kFloat32 ? codec->encode(x, out, ctx)
                                       : codec->encode(half, dtype, out, ctx);
      ++ctx.step;
    });
    std::span<const std::byte> payload(out.data(), bytes);
    double t_dec = median_seconds(opt.reps, [&] { codec->decode(payload, y); });
    double enc = bytes_in / t_enc / 1e9, dec = bytes_in / t_dec / 1e9;
    double target = target_fraction(codec->name());
    bool met = enc >= target * copy_gbs && dec >= target * copy_gbs;
    fmt::print("{:<28} {:>12} {:>8.2f} {:>9.2f} {:>9.0f} {:>9.2f} {:>6.0f}% {:>6.0f}% "
               "{:>6.0f}%  {}\n",
               codec->spec().substr(0, 28), bytes, bytes_in / bytes, enc, n / t_enc / 1e6, dec,
               100 * enc / copy_gbs, 100 * dec / copy_gbs, 100 * target,
               target == 0 ? "-" : (met ? "meets" : "MISSES"));
    report["codecs"].push_back({{"spec", codec->spec()},
                                {"bytes", bytes},
                                {"ratio", bytes_in / bytes},
                                {"encode_gbs", enc},
                                {"encode_elements_per_s", n / t_enc},
                                {"decode_gbs", dec},
                                {"encode_s", t_enc},
                                {"decode_s", t_dec},
                                {"target_fraction", target},
                                {"meets_target", met}});
  }
  if (!opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(2) << "\n";
    fmt::print("\nwrote {}\n", opt.json);
  }
}

}  // namespace

void add_bench_codecs_command(CLI::App& bench) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = bench.add_subcommand("codecs", "Codec throughput against a memory copy");
  cmd->add_option("--elements,-n", opt->elements, "Floats per tensor")->capture_default_str();
  cmd->add_option("--reps", opt->reps, "Timed runs per figure (median)")->capture_default_str();
  cmd->add_option("--codec,--codecs", opt->codecs, "Codec specs (default: all registered)");
  cmd->add_option("--json", opt->json, "Write results as JSON to this file");
  cmd->add_option("--dtype", opt->dtype, "Element type of the input")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}))
      ->capture_default_str();
  cmd->callback([opt] { run(*opt); });
}

void add_codecs_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("codecs", "List the registered codecs");
  cmd->callback([] {
    for (const auto& info : registered_codecs()) {
      fmt::print("{:<10} id {:>3}  {}\n", info.name, info.id, info.summary);
    }
  });
}

}  // namespace terse::tools
