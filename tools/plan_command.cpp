// terse plan: before a job runs, what the planner would do with each tensor of a model on N ranks
// and links of a given rate, the predicted time of each, and the predicted communication time of
// one step against raw allreduce. With --scale, the same per-step prediction for each strategy
// over a range of world sizes (docs/planner.md plots it).
//
// Model of a step: tensors are reduced one after another (no overlap between tensors), and raw
// tensors up to --fuse-bytes travel in one fused message, as the engine does for a group (a DDP
// bucket). The raw baseline reduces every tensor raw with the engine's default partitions,
// fused the same way.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
// Internal headers: the calibration and the cost model are no part of the public API; this
// command asks them what-if questions (other rates, other world sizes).
#include "engine/allreduce_probe.h"  // the probe calibration times the engine with
#include "planner/calibration.h"  // Calibration records: this command prints and writes them
#include "planner/cost_model.h"  // per-candidate predictions, beside the measured times
#include "planner/planner_impl.h"  // PlannerAccess: a planner from a given calibration
#include "terse/codec.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/planner.h"
#include "units.h"

namespace terse::tools {

std::string_view builtin_models_json();  // generated from bench/terse_harness/models.json

namespace {

struct TensorSize {
  std::string name;
  std::size_t elements = 0;
};

struct Options {
  std::string sizes;
  std::string model;
  int ranks = 0;
  std::string bandwidth;
  double latency = -1;
  std::vector<std::string> codecs;
  std::vector<std::string> heavy;
  std::string codec = "auto";
  std::vector<int> partitions;
  int threads = 4;
  int ranks_per_host = 1;
  std::string calibration;
  std::string fuse = "1MiB";
  std::string partition = "8MiB";
  std::vector<int> scale;
  std::string json;
  std::string write_sizes;
  bool sizes_only = false;
};

// ---- tensor sizes -----------------------------------------------------------------------------

// The built-in models: bench/terse_harness/models.json, compiled in (CMakeLists.txt). Each
// model lists its gradient tensors in order as [name, shape]; the benchmark harness's torch
// models follow it (tests/python/test_models.py).
nlohmann::ordered_json builtin_models() {
  return nlohmann::ordered_json::parse(builtin_models_json());
}

std::string builtin_model_names() {
  const nlohmann::ordered_json models = builtin_models();
  std::string names;
  for (auto it = models.begin(); it != models.end(); ++it) {
    names += (names.empty() ? "" : ", ") + it.key();
  }
  return names;
}

std::vector<TensorSize> builtin_model(const std::string& name) {
  const nlohmann::ordered_json models = builtin_models();
  const auto model = models.find(name);
  if (model == models.end()) {
    throw InvalidArgument(
        fmt::format("--model '{}': built-in models are {} (or pass --sizes FILE from "
                    "python/terse/model_sizes.py)",
                    name, builtin_model_names()));
  }
  std::vector<TensorSize> out;
  for (const auto& tensor : model->at("tensors")) {
    std::size_t elements = 1;
    for (const auto& extent : tensor.at(1)) elements *= extent.get<std::size_t>();
    out.push_back({tensor.at(0).get<std::string>(), elements});
  }
  return out;
}

std::vector<TensorSize> read_sizes(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InvalidArgument(fmt::format("--sizes: cannot read {}", path));
  std::vector<TensorSize> out;
  try {
    for (const auto& e : nlohmann::json::parse(f)) {
      out.push_back({e.at("name").get<std::string>(), e.at("elements").get<std::size_t>()});
    }
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(
        fmt::format("--sizes {}: expected [{{\"name\": ..., \"elements\": ...}}, "
                    "...]: {}",
                    path, e.what()));
  }
  return out;
}

// ---- one step -------------------------------------------------------------------------------

struct Row {
  TensorSize tensor;
  TensorPlan plan;
  double seconds = 0;
  double raw_seconds = 0;  // 0 where raw_fused
  // A small tensor compressed on its own whose raw allreduce would travel in the fused message
  // (its raw time is in the step's, not a time of its own).
  bool raw_fused = false;
};

struct Step {
  std::vector<Row> rows;          // tensors reduced on their own
  std::vector<TensorSize> fused;  // small raw tensors, one fused message
  double fused_seconds = 0;
  double seconds = 0;
  double raw_seconds = 0;
};

struct StepModel {
  const Planner& planner;
  int ranks;
  int threads;
  std::size_t fuse_bytes;
  std::size_t partition_bytes;
  Tier tier;

  // The engine's default partitions for a raw tensor of n floats.
  int default_partitions(std::size_t n) const {
    return static_cast<int>(std::clamp<std::size_t>(
        (n * sizeof(float) + partition_bytes - 1) / partition_bytes, 1, 256));
  }
  double raw(std::size_t n) const {
    return PlannerAccess::model(planner)
        .predict(n, "none", Strategy::kRaw, default_partitions(n), ranks, threads)
        .seconds;
  }

  // only: every tensor with this strategy (its best codec and K); kAuto: the planner's choice.
  Step predict(const std::vector<TensorSize>& tensors, Strategy only = Strategy::kAuto) const {
    Step step;
    std::size_t fused_elements = 0, raw_fused_elements = 0;
    for (const auto& t : tensors) {
      const bool small = t.elements * sizeof(float) <= fuse_bytes;
      if (small) {
        raw_fused_elements += t.elements;
      } else {
        step.raw_seconds += raw(t.elements);
      }
      const PlanDecision d = planner.decide(t.elements, ranks, threads, only, 0, tier);
      if (small && d.chosen.plan.strategy == Strategy::kRaw) {
        step.fused.push_back(t);
        fused_elements += t.elements;
        continue;
      }
      Row row{t, d.chosen.plan, d.chosen.predicted.seconds, small ? 0.0 : raw(t.elements), small};
      step.seconds += row.seconds;
      step.rows.push_back(std::move(row));
    }
    if (fused_elements > 0) step.fused_seconds = raw(fused_elements);
    step.seconds += step.fused_seconds;
    if (raw_fused_elements > 0) step.raw_seconds += raw(raw_fused_elements);
    return step;
  }
};

std::string short_plan(const TensorPlan& p) {
  std::string codec = p.codec;
  const auto colon = codec.find(':');
  if (colon != std::string::npos) {
    codec = codec.substr(0, colon) + (codec.find("ef=1") != std::string::npos ? "+ef" : "");
  }
  return fmt::format("{} {} K={}", to_string(p.strategy), codec, p.partitions);
}

// ---- the command ----------------------------------------------------------------------------

// The tensors named by --sizes or --model, written to --write-sizes where given.
std::vector<TensorSize> tensors_of(const Options& opt) {
  if (opt.sizes.empty() == opt.model.empty()) {
    throw InvalidArgument("give the tensor sizes with either --sizes FILE or --model NAME");
  }
  std::vector<TensorSize> tensors =
      opt.model.empty() ? read_sizes(opt.sizes) : builtin_model(opt.model);
  if (!opt.write_sizes.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& t : tensors) j.push_back({{"name", t.name}, {"elements", t.elements}});
    std::ofstream(opt.write_sizes) << j.dump(1) << "\n";
  }
  return tensors;
}

// CPU costs: a calibration file (from `terse calibrate`), else measured here and now. source:
// where they came from, for the report's header.
Calibration cpu_costs(const Options& opt, const Planner& defaults, std::string& source) {
  Calibration cal;
  if (!opt.calibration.empty()) {
    std::ifstream f(opt.calibration);
    std::stringstream text;
    text << f.rdbuf();
    if (!f) throw InvalidArgument(fmt::format("--calibration: cannot read {}", opt.calibration));
    cal = Calibration::from_json(text.str());
    source = opt.calibration;
  } else {
    CalibrationOptions co;
    co.codecs = defaults.allowed();
    for (const auto& spec : defaults.heavy()) co.codecs.push_back(spec);
    cal = calibrate_local(co, opt.ranks, opt.ranks_per_host,
                          allreduce_probes(engine_options_from_environment().threads));
    source =
        fmt::format("measured now, {} rank(s) per host on {} cores", cal.ranks_on_host, cal.cores);
  }
  return cal;
}

// Links: the rate given; the latency given, else the calibration's, else 50 us.
void set_links(const Options& opt, Calibration& cal) {
  if (!opt.bandwidth.empty()) {
    cal.beta = 8.0 / parse_rate(opt.bandwidth, "--bandwidth");
    cal.engine_beta = 0;  // measured on other links
    cal.engine_link = LinearFit{};
    cal.transport_cpu = LinearFit{};
    cal.host_efficiency = 1;
  } else if (cal.beta <= 0) {
    throw InvalidArgument("--bandwidth: the link rate, e.g. 1gbit (the calibration has none)");
  }
  if (opt.latency >= 0) {
    cal.alpha = opt.latency;
  } else if (cal.alpha <= 0) {
    cal.alpha = 50e-6;
  }
}

// The header and the per-tensor table of one step on opt.ranks ranks, into report too.
void report_step(const Options& opt, const std::vector<TensorSize>& tensors,
                 const StepModel& model, const std::string& source, nlohmann::json& report) {
  const Calibration& c = PlannerAccess::model(model.planner).calibration();
  std::size_t total = 0;
  for (const auto& t : tensors) total += t.elements;
  fmt::print(
      "terse plan: {} ({} tensors, {} floats, {}), {} ranks, links {:.0f} Mbit/s and "
      "{:.1f} us, {} threads\n  CPU costs: {}\n",
      opt.model.empty() ? opt.sizes : "model " + opt.model, tensors.size(), total,
      format_bytes(total * 4.0), opt.ranks, 8e-6 / c.beta, c.alpha * 1e6, opt.threads, source);
  const Step step = model.predict(tensors);
  fmt::print("{:<28} {:>11} {:<30} {:>12} {:>10} {:>8}\n", "tensor", "elements", "decision",
             "predicted ms", "raw ms", "speedup");
  report["ranks"] = opt.ranks;
  report["beta"] = c.beta;
  report["alpha"] = c.alpha;
  report["tensors"] = nlohmann::json::array();
  for (const auto& r : step.rows) {
    const bool ratio = !r.raw_fused && r.seconds > 0 && r.raw_seconds > 0;
    fmt::print("{:<28} {:>11} {:<30} {:>12.3f} {:>10} {:>8}\n", r.tensor.name, r.tensor.elements,
               short_plan(r.plan), r.seconds * 1e3,
               r.raw_fused ? std::string("(fused)") : fmt::format("{:.3f}", r.raw_seconds * 1e3),
               ratio ? fmt::format("{:.2f}x", r.raw_seconds / r.seconds) : std::string("-"));
    report["tensors"].push_back(
        {{"name", r.tensor.name},
         {"elements", r.tensor.elements},
         {"plan", plan_key(r.plan)},
         {"predicted_s", r.seconds},
         {"raw_s", r.raw_fused ? nlohmann::json() : nlohmann::json(r.raw_seconds)},
         {"raw_fused", r.raw_fused}});
  }
  if (!step.fused.empty()) {
    std::size_t n = 0;
    for (const auto& t : step.fused) n += t.elements;
    fmt::print("{:<28} {:>11} {:<30} {:>12.3f}\n",
               fmt::format("(fused: {} small tensors)", step.fused.size()), n, "raw, one message",
               step.fused_seconds * 1e3);
  }
  fmt::print(
      "per step: predicted {:.3f} ms of communication, raw allreduce {:.3f} ms: speedup "
      "{:.2f}x (tensors one after another)\n",
      step.seconds * 1e3, step.raw_seconds * 1e3, step.raw_seconds / step.seconds);
  report["step_s"] = step.seconds;
  report["raw_step_s"] = step.raw_seconds;
}

// --scale: the step's time under each strategy at each world size, into report too.
void report_scale(const Options& opt, const std::vector<TensorSize>& tensors,
                  const StepModel& model, nlohmann::json& report) {
  const Strategy strategies[] = {Strategy::kRaw,  Strategy::kAllgather, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable,  Strategy::kAuto};
  fmt::print(
      "\nper-step ms by world size (each tensor: the strategy's best codec and K; auto: "
      "the planner's choice)\n{:>6}",
      "ranks");
  for (Strategy s : strategies) fmt::print(" {:>11}", to_string(s));
  fmt::print("\n");
  report["scale"] = nlohmann::json::array();
  for (int n : opt.scale) {
    const StepModel at{model.planner,         n,         opt.threads, model.fuse_bytes,
                       model.partition_bytes, model.tier};
    nlohmann::json row;
    row["ranks"] = n;
    fmt::print("{:>6}", n);
    for (Strategy s : strategies) {
      double seconds = 0;
      try {
        seconds = at.predict(tensors, s).seconds;
      } catch (const InvalidArgument&) {
        seconds = -1;  // no allowed codec can use this strategy
      }
      row[std::string(to_string(s))] = seconds;
      fmt::print(" {:>11}", seconds < 0 ? std::string("-") : fmt::format("{:.3f}", seconds * 1e3));
    }
    fmt::print("\n");
    report["scale"].push_back(row);
  }
}

void run(const Options& opt) {
  if (opt.ranks < 1) throw InvalidArgument("--ranks: the number of ranks of the job (1 or more)");
  const std::vector<TensorSize> tensors = tensors_of(opt);
  if (opt.sizes_only) return;

  const std::optional<Tier> tier = auto_tier(opt.codec);
  if (!tier) throw InvalidArgument(fmt::format("--codec {}: give auto or auto:heavy", opt.codec));
  PlannerOptions po;
  po.allowed = opt.codecs;
  po.heavy = opt.heavy;
  po = planner_options_from_environment(po);
  const Planner defaults(po);  // resolves the codec lists

  std::string source;
  Calibration cal = cpu_costs(opt, defaults, source);
  set_links(opt, cal);
  cal.world_size = opt.ranks;
  const std::unique_ptr<Planner> made = PlannerAccess::with_calibration(po, std::move(cal));
  Planner& planner = *made;
  if (!opt.partitions.empty()) PlannerAccess::set_partitions(planner, opt.partitions);
  const StepModel model{planner,
                        opt.ranks,
                        opt.threads,
                        parse_size(opt.fuse, "--fuse-bytes"),
                        parse_size(opt.partition, "--partition-bytes"),
                        *tier};

  nlohmann::json report;
  report_step(opt, tensors, model, source, report);
  if (!opt.scale.empty()) report_scale(opt, tensors, model, report);
  if (!opt.json.empty()) {
    std::ofstream(opt.json) << report.dump(1) << "\n";
    fmt::print("wrote {}\n", opt.json);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Predict per-tensor decisions and the step's communication time before a run");
  cmd->add_option("--sizes", opt->sizes,
                  "JSON list of {\"name\", \"elements\"} (python/terse/model_sizes.py writes it)");
  cmd->add_option("--model", opt->model, "A built-in model: " + builtin_model_names());
  cmd->add_option("--ranks", opt->ranks, "Ranks of the job")->required();
  cmd->add_option("--bandwidth", opt->bandwidth, "Link rate, e.g. 100mbit, 1gbit, 10gbit");
  cmd->add_option("--latency", opt->latency,
                  "One-way link latency in seconds (default: the calibration's, else 50e-6)");
  cmd->add_option("--codecs", opt->codecs,
                  "The light tier's codecs, what codec auto chooses from (default: "
                  "TERSE_PLAN_CODECS, else fp16 minmax8:ef=1)");
  cmd->add_option("--heavy", opt->heavy,
                  "The heavy tier's codecs, which codec auto:heavy adds (default: "
                  "TERSE_PLAN_HEAVY_CODECS, else onebit:ef=1 powersgd; none: no heavy codec)");
  cmd->add_option("--codec", opt->codec, "auto (the light tier) or auto:heavy (both tiers)")
      ->capture_default_str();
  cmd->add_option("--partitions", opt->partitions, "Partition counts the planner tries");
  cmd->add_option("--threads", opt->threads, "Engine worker threads")->capture_default_str();
  cmd->add_option("--ranks-per-host", opt->ranks_per_host,
                  "Ranks sharing one machine's cores (for CPU costs measured here)")
      ->capture_default_str();
  cmd->add_option("--calibration", opt->calibration,
                  "CPU costs (and links) from this file of `terse calibrate`");
  cmd->add_option("--fuse-bytes", opt->fuse, "Raw tensors up to this size are fused")
      ->capture_default_str();
  cmd->add_option("--partition-bytes", opt->partition, "The engine's default partition size")
      ->capture_default_str();
  cmd->add_option("--scale", opt->scale, "World sizes for a per-strategy scaling table");
  cmd->add_option("--json", opt->json, "Write the predictions as JSON");
  cmd->add_option("--write-sizes", opt->write_sizes, "Write the tensor sizes used as JSON");
  cmd->add_flag("--sizes-only", opt->sizes_only, "Stop after --write-sizes (no calibration)");
  cmd->callback([opt] { run(*opt); });
}

}  // namespace terse::tools
