// terse plan: before a job runs, what the planner would do with each tensor of a model on N ranks
// and links of a given rate, the predicted time of each, and the predicted communication time of
// one step against raw allreduce. With --scale, the same per-step prediction for each strategy
// over a range of world sizes (docs/planner.md plots it). With --compute-ms, each method's time
// per (inner) step, compute included: raw and codec "auto" every step against DiLoCo's
// pseudo-gradient exchange every H steps (docs/planner.md, "Per-step compression or DiLoCo").
//
// Model of a step: tensors are reduced one after another (no overlap between tensors), and raw
// tensors up to --fuse-bytes travel in one fused message, as the engine does for a group (a DDP
// bucket). The raw baseline reduces every tensor raw with the engine's default partitions,
// fused the same way. A fixed codec reduces every tensor with it as the engine runs the codec
// (strategy auto, the engine's default partitions), as terse.diloco.DiLoCo does with the
// pseudo-gradients. Compute and communication do not overlap, except where Streaming DiLoCo's
// delay hides an exchange behind inner steps.
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
#include "engine/plans.h"  // auto_strategy: the strategy the engine gives a fixed codec
#include "planner/calibration.h"  // Calibration records: this command prints and writes them
#include "planner/cost_model.h"  // per-candidate predictions, beside the measured times
#include "planner/planner_impl.h"  // PlannerAccess: a planner from a given calibration
#include "terse/codec.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/planner.h"
#include "transport/topology.h"  // --hosts: a job's hosts, as the engine agrees them
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
  int ranks_per_host = 0;  // 0: 1, or with --hosts the most ranks on a host
  std::string hosts;       // a topology: "2x2", "3,2" (TERSE_TOPOLOGY's layouts)
  std::string intra_bandwidth = "10gbit";
  double intra_latency = 20e-6;
  std::string calibration;
  std::string fuse = "1MiB";
  std::string partition = "8MiB";
  std::vector<int> scale;
  std::string json;
  std::string write_sizes;
  bool sizes_only = false;
  double compute_ms = 0;
  bool compute_given = false;  // whether --compute-ms was
  std::vector<int> diloco;
  std::vector<std::string> diloco_codecs = {"none", "minmax8:ef=1", "minmax8:bits=4,ef=1"};
  int fragments = 1;
  int delay = 0;
  // DiLoCo's steps to a target loss over synchronous training's, measured by the user (0: not
  // given; time per step only).
  double diloco_steps = 0;
  // DiLoCo's synchronous warm-up: its share of the steps and their gradients' codec.
  double diloco_warmup = 0;
  std::string warmup_codec = "none";
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
  double bytes = 0;  // bytes each rank sends (the step's plans)
  double raw_bytes = 0;
};

// One collective per tensor (and the fused message): its time and the bytes each rank sends,
// which every rank's link carries alike in these collectives.
struct Exchange {
  double seconds = 0;
  double bytes = 0;
};

struct StepModel {
  const Planner& planner;
  int ranks;
  int threads;
  std::size_t fuse_bytes;
  std::size_t partition_bytes;
  Tier tier;
  // --hosts: the job's hosts (null: flat), and the levels codec auto may choose among.
  const transport::Topology* topology = nullptr;
  Hierarchy hierarchy = Hierarchy::kAuto;

  // What the engine asks the planner about n floats (strategy `only`, or any).
  planner::Use use(std::size_t n, Strategy only = Strategy::kAuto) const {
    planner::Use u{n, threads, only, 0, tier};
    u.topology = topology;
    u.hierarchy = hierarchy;
    return u;
  }
  // Whether the engine runs a fixed codec's n floats in k partitions in two levels: its rule
  // for hierarchy auto (Plans::plan), partitions it would not gather on a two-level topology.
  bool engine_two_level(std::size_t n, int k) const {
    const auto parts = static_cast<std::size_t>(k);
    return topology != nullptr && topology->two_level() &&
           !collectives::gathers((n + parts - 1) / parts, ranks, kDefaultGatherBytes);
  }
  Prediction priced(std::size_t n, const std::string& spec, Strategy s, int k, bool two) const {
    const CostModel& m = PlannerAccess::model(planner);
    if (!two) return m.predict(n, spec, s, k, ranks, threads);
    return m.predict_hosts(n, spec, s, k, planner::host_layout(m.calibration(), *topology),
                           threads);
  }

  // The engine's default partitions for a raw tensor of n floats.
  int default_partitions(std::size_t n) const {
    return static_cast<int>(std::clamp<std::size_t>(
        (n * sizeof(float) + partition_bytes - 1) / partition_bytes, 1, 256));
  }
  // Raw as the engine runs it (fused: the group's one message, which is flat).
  Prediction raw(std::size_t n, bool fused = false) const {
    const int k = default_partitions(n);
    return priced(n, "none", Strategy::kRaw, k, !fused && engine_two_level(n, k));
  }
  // Codec c (not none) on n floats as the engine runs it with strategy auto and partitions 0:
  // the engine's strategy for it, multi-round codecs on one partition.
  Prediction fixed(std::size_t n, const Codec& c) const {
    const int k =
        c.traits().multi_round ? 1 : planner::clamp_partitions(default_partitions(n), n);
    return priced(n, c.spec(), engine::auto_strategy(c), k, engine_two_level(n, k));
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
        const Prediction r = raw(t.elements);
        step.raw_seconds += r.seconds;
        step.raw_bytes += r.bytes_sent;
      }
      const PlanDecision d = planner::decide(planner, use(t.elements, only), ranks);
      if (small && d.chosen.plan.strategy == Strategy::kRaw) {
        step.fused.push_back(t);
        fused_elements += t.elements;
        continue;
      }
      Row row{t, d.chosen.plan, d.chosen.predicted.seconds, small ? 0.0 : raw(t.elements).seconds,
              small};
      step.seconds += row.seconds;
      step.bytes += d.chosen.predicted.bytes_sent;
      step.rows.push_back(std::move(row));
    }
    if (fused_elements > 0) {
      const Prediction f = raw(fused_elements, true);
      step.fused_seconds = f.seconds;
      step.bytes += f.bytes_sent;
    }
    step.seconds += step.fused_seconds;
    if (raw_fused_elements > 0) {
      const Prediction f = raw(raw_fused_elements, true);
      step.raw_seconds += f.seconds;
      step.raw_bytes += f.bytes_sent;
    }
    return step;
  }

  // Every tensor with codec spec: none is the raw baseline (small tensors fused), auto and
  // auto:heavy the planner's plans of that tier, any other codec every tensor on its own with
  // it, small ones too (DiLoCo's default min_bytes 0).
  Exchange exchange(const std::vector<TensorSize>& tensors, const std::string& spec) const {
    if (const std::optional<Tier> t = auto_tier(spec)) {
      StepModel other = *this;
      other.tier = *t;
      const Step s = other.predict(tensors);
      return {s.seconds, s.bytes};
    }
    const std::unique_ptr<Codec> c = make_codec(spec);
    if (c->name() == "none") {
      const Step s = predict(tensors, Strategy::kRaw);
      return {s.raw_seconds, s.raw_bytes};
    }
    Exchange e;
    for (const auto& t : tensors) {
      const Prediction p = fixed(t.elements, *c);
      e.seconds += p.seconds;
      e.bytes += p.bytes_sent;
    }
    return e;
  }
};

std::string short_plan(const TensorPlan& p) {
  std::string codec = p.codec;
  const auto colon = codec.find(':');
  if (colon != std::string::npos) {
    codec = codec.substr(0, colon) + (codec.find("ef=1") != std::string::npos ? "+ef" : "");
  }
  return fmt::format("{} {} K={}{}", to_string(p.strategy), codec, p.partitions,
                     p.hierarchical ? " hosts" : "");
}

// "raw" for none, auto or auto:heavy, else the canonical spec.
std::string codec_label(const std::string& spec) {
  if (const std::optional<Tier> t = auto_tier(spec)) return std::string(auto_codec(*t));
  const std::string canonical = make_codec(spec)->spec();
  return canonical == "none" ? "raw" : canonical;
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

// The canonical specs of the compressing fixed codecs of --diloco-codecs (with --compute-ms),
// which the calibration must hold.
std::vector<std::string> diloco_codecs(const Options& opt) {
  std::vector<std::string> out;
  if (!opt.compute_given) return out;
  std::vector<std::string> specs = opt.diloco_codecs;
  if (!opt.diloco.empty() && opt.diloco_warmup > 0) specs.push_back(opt.warmup_codec);
  for (const auto& spec : specs) {
    if (auto_tier(spec)) continue;
    const std::string canonical = make_codec(spec)->spec();
    if (canonical != "none" && std::find(out.begin(), out.end(), canonical) == out.end()) {
      out.push_back(canonical);
    }
  }
  return out;
}

// --compute-ms, --diloco, --fragments, --delay: refused before any calibration.
void check_methods(const Options& opt) {
  if (opt.compute_given && opt.compute_ms < 0) {
    throw InvalidArgument(
        fmt::format("--compute-ms {}: the step's compute time, 0 or more ms", opt.compute_ms));
  }
  if (opt.diloco_steps != 0 && (opt.diloco.empty() || !(opt.diloco_steps > 0))) {
    throw InvalidArgument(fmt::format(
        "--diloco-steps {}: DiLoCo's steps to a target over synchronous training's, more than 0, "
        "with --diloco",
        opt.diloco_steps));
  }
  if (!(opt.diloco_warmup >= 0 && opt.diloco_warmup < 1)) {
    throw InvalidArgument(fmt::format(
        "--diloco-warmup {}: the share of the steps trained synchronously, 0 to less than 1",
        opt.diloco_warmup));
  }
  if (opt.diloco.empty()) return;
  if (!opt.compute_given) {
    throw InvalidArgument(
        "--diloco needs --compute-ms (the step's compute time without communication)");
  }
  for (int h : opt.diloco) {
    if (h < 1) throw InvalidArgument(fmt::format("--diloco {}: H is 1 or more inner steps", h));
    if (opt.fragments < 1 || opt.fragments > h) {
      throw InvalidArgument(
          fmt::format("--fragments {}: P is 1 to H (--diloco {})", opt.fragments, h));
    }
    if (opt.delay < 0 || opt.delay >= h) {
      throw InvalidArgument(
          fmt::format("--delay {}: tau is 0 to H - 1 (--diloco {})", opt.delay, h));
    }
  }
  auto check_spec = [](const char* flag, const std::string& spec) {
    if (auto_tier(spec)) return;
    try {
      make_codec(spec);
    } catch (const Error& e) {
      throw InvalidArgument(fmt::format("{} {}: {}", flag, spec, e.what()));
    }
  };
  for (const auto& spec : opt.diloco_codecs) check_spec("--diloco-codecs", spec);
  check_spec("--warmup-codec", opt.warmup_codec);
}

// CPU costs: a calibration file (from `terse calibrate`), else measured here and now. source:
// where they came from, for the report's header.
Calibration cpu_costs(const Options& opt, const Planner& defaults, int ranks_per_host,
                      std::string& source) {
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
    for (const auto& spec : diloco_codecs(opt)) {
      if (std::find(co.codecs.begin(), co.codecs.end(), spec) == co.codecs.end()) {
        co.codecs.push_back(spec);
      }
    }
    cal = calibrate_local(co, opt.ranks, ranks_per_host,
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

// --hosts: two classes of links, as a calibration of that job would measure them per pair:
// across hosts the links above (--bandwidth, --latency), inside a host --intra-bandwidth and
// --intra-latency. --bandwidth is a host's link, which calibration measures shared by the
// host's ranks (a tournament round has every rank of a host exchange across at once), and so do
// the collectives (flat, or the slots' owners of two levels): a pair across hosts gets 1/R of
// it, R the most ranks on a host. The flat model's links are the slowest pair's
// (planner::link_classes).
void set_host_links(const Options& opt, const transport::Topology& t, Calibration& cal) {
  const double cross_beta = cal.beta * t.most_ranks_on_a_host(), cross_alpha = cal.alpha;
  const double intra_beta = 8.0 / parse_rate(opt.intra_bandwidth, "--intra-bandwidth");
  if (opt.intra_latency < 0) {
    throw InvalidArgument(fmt::format("--intra-latency {}: seconds, 0 or more", opt.intra_latency));
  }
  const auto n = static_cast<std::size_t>(t.size());
  cal.peer_alpha.assign(n, std::vector<double>(n, 0.0));
  cal.peer_beta.assign(n, std::vector<double>(n, 0.0));
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      const bool same = t.host_of[i] == t.host_of[j];
      cal.peer_alpha[i][j] = same ? opt.intra_latency : cross_alpha;
      cal.peer_beta[i][j] = same ? intra_beta : cross_beta;
    }
  }
  cal.alpha = std::max(cross_alpha, opt.intra_latency);
  cal.beta = std::max(cross_beta, intra_beta);
  cal.host_of = t.host_of;
}

// The ranks of a --hosts layout ("2x2": 4, "3,2": 5), to check --ranks against or stand in
// for it; 0 where it is not one (topology_from_spec then says why).
int ranks_of_layout(const std::string& spec) {
  int total = 0;
  std::size_t at = 0;
  while (at <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string part = spec.substr(at, comma - at);
    const std::size_t x = part.find('x');
    try {
      total += x == std::string::npos
                   ? std::stoi(part)
                   : std::stoi(part.substr(0, x)) * std::stoi(part.substr(x + 1));
    } catch (const std::exception&) {
      return 0;
    }
    at = comma + 1;
  }
  return total;
}

// --hosts: each tensor's best flat plan, its best plan in two levels and the planner's choice
// between them (codec auto under hierarchy auto), then the step under each; into report too.
void report_hosts(const std::vector<TensorSize>& tensors, const StepModel& model,
                  nlohmann::json& report) {
  const transport::Topology& t = *model.topology;
  const Calibration& c = PlannerAccess::model(model.planner).calibration();
  const LinkClasses l = link_classes(c, t.host_of);
  auto rate = [](double beta) { return beta > 0 ? 8e-6 / beta : 0.0; };
  fmt::print(
      "\ntwo levels over {} ({} ranks): inside hosts {:.0f} Mbit/s and {:.1f} us a pair, across "
      "hosts {:.0f} Mbit/s and {:.1f} us a pair\n",
      t.describe(), t.size(), rate(l.intra.pair_beta), l.intra.alpha * 1e6,
      rate(l.cross.pair_beta), l.cross.alpha * 1e6);
  StepModel flat = model, hosts = model;
  flat.hierarchy = Hierarchy::kFlat;
  hosts.hierarchy = Hierarchy::kHosts;
  fmt::print("{:<28} {:>11} {:<27} {:>10} {:<33} {:>10}  {}\n", "tensor", "elements",
             "best flat", "ms", "best in two levels", "ms", "choice");
  nlohmann::json rows = nlohmann::json::array();
  std::size_t small = 0;
  for (const auto& tensor : tensors) {
    if (tensor.elements * sizeof(float) <= model.fuse_bytes) {
      ++small;  // decided in the step below (fused raw where raw)
      continue;
    }
    const auto decide = [&](const StepModel& m) {
      return planner::decide(m.planner, m.use(tensor.elements), m.ranks).chosen;
    };
    const PlanCandidate f = decide(flat), h = decide(hosts), a = decide(model);
    fmt::print("{:<28} {:>11} {:<27} {:>10.3f} {:<33} {:>10.3f}  {}\n", tensor.name,
               tensor.elements, short_plan(f.plan), f.predicted.seconds * 1e3, short_plan(h.plan),
               h.predicted.seconds * 1e3, a.plan.hierarchical ? "two levels" : "flat");
    rows.push_back({{"name", tensor.name},
                    {"elements", tensor.elements},
                    {"flat", {{"plan", plan_key(f.plan)}, {"predicted_s", f.predicted.seconds}}},
                    {"hosts", {{"plan", plan_key(h.plan)}, {"predicted_s", h.predicted.seconds}}},
                    {"choice", plan_key(a.plan)}});
  }
  if (small > 0) fmt::print("({} tensors of --fuse-bytes or less: in the steps below)\n", small);
  const double flat_s = flat.predict(tensors).seconds, hosts_s = hosts.predict(tensors).seconds;
  const Step step = model.predict(tensors);
  fmt::print(
      "per step: flat {:.3f} ms, two levels {:.3f} ms, auto's choice per tensor {:.3f} ms; raw "
      "allreduce as the engine runs it {:.3f} ms\n",
      flat_s * 1e3, hosts_s * 1e3, step.seconds * 1e3, step.raw_seconds * 1e3);
  report["hosts"] = {{"topology", t.describe()},
                     {"intra", {{"alpha", l.intra.alpha}, {"beta", l.intra.pair_beta}}},
                     {"cross", {{"alpha", l.cross.alpha}, {"beta", l.cross.pair_beta}}},
                     {"tensors", rows},
                     {"flat_step_s", flat_s},
                     {"hosts_step_s", hosts_s},
                     {"auto_step_s", step.seconds}};
}

// The header and the per-tensor table of one step on opt.ranks ranks, into report too.
void report_step(const Options& opt, const std::vector<TensorSize>& tensors,
                 const StepModel& model, const std::string& source, nlohmann::json& report) {
  const Calibration& c = PlannerAccess::model(model.planner).calibration();
  std::size_t total = 0;
  for (const auto& t : tensors) total += t.elements;
  fmt::print(
      "terse plan: {} ({} tensors, {} floats, {}), {} ranks, links {:.0f} Mbit/s{} and "
      "{:.1f} us, {} threads\n  CPU costs: {}\n",
      opt.model.empty() ? opt.sizes : "model " + opt.model, tensors.size(), total,
      format_bytes(total * 4.0), opt.ranks, 8e-6 / c.beta,
      model.topology != nullptr
          ? fmt::format(" a pair across hosts (a host's link shared by its {} ranks)",
                        model.topology->most_ranks_on_a_host())
          : "",
      c.alpha * 1e6, opt.threads, source);
  const Step step = model.predict(tensors);
  const int w = model.topology != nullptr ? 34 : 30;  // " hosts" on two-level plans
  fmt::print("{:<28} {:>11} {:<{}} {:>12} {:>10} {:>8}\n", "tensor", "elements", "decision", w,
             "predicted ms", "raw ms", "speedup");
  report["ranks"] = opt.ranks;
  report["beta"] = c.beta;
  report["alpha"] = c.alpha;
  report["tensors"] = nlohmann::json::array();
  for (const auto& r : step.rows) {
    const bool ratio = !r.raw_fused && r.seconds > 0 && r.raw_seconds > 0;
    fmt::print("{:<28} {:>11} {:<{}} {:>12.3f} {:>10} {:>8}\n", r.tensor.name, r.tensor.elements,
               short_plan(r.plan), w, r.seconds * 1e3,
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
    fmt::print("{:<28} {:>11} {:<{}} {:>12.3f}\n",
               fmt::format("(fused: {} small tensors)", step.fused.size()), n,
               "raw, one message", w,
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

// --compute-ms: each method's time per (inner) step, compute included, into report too. Every
// step: compute + the step's exchange. DiLoCo every H steps with exchange E: compute + P *
// max(0, E/P - tau * compute) / H (P fragments each exchanging E/P, each hidden by tau inner
// steps; P = 1, tau = 0: compute + E/H).
void report_methods(const Options& opt, const std::vector<TensorSize>& tensors,
                    const StepModel& model, nlohmann::json& report) {
  const double compute = opt.compute_ms * 1e-3;
  struct Method {
    std::string name;
    nlohmann::json json;
    double seconds = 0;
    double bytes = 0;
    double steps = 1;  // steps to the target per synchronous step (--diloco-steps for DiLoCo)
  };
  const bool to_target = opt.diloco_steps > 0;
  // Raw, the planner's tier and the DiLoCo codecs every step, each exchange priced once. A
  // codec is shown as given ("raw" for none) and keyed by its canonical spec.
  struct Priced {
    std::string shown;
    std::string codec;
    Exchange e;
  };
  std::vector<Priced> exchanges;
  auto exchange = [&](const std::string& spec) {
    const std::string codec = codec_label(spec);
    for (const auto& p : exchanges) {
      if (p.codec == codec) return p;
    }
    exchanges.push_back({codec == "raw" ? codec : spec, codec, model.exchange(tensors, spec)});
    return exchanges.back();
  };
  exchange("none");
  exchange(std::string(auto_codec(model.tier)));
  for (const auto& spec : opt.diloco_codecs) exchange(spec);
  // The warm-up's steps (a share W of them) exchange every step with its codec.
  const bool warm = !opt.diloco.empty() && opt.diloco_warmup > 0;
  const double w = warm ? opt.diloco_warmup : 0.0;
  const Exchange warm_e = warm ? exchange(opt.warmup_codec).e : Exchange{};
  std::vector<Method> methods;
  for (const auto& p : exchanges) {
    methods.push_back({p.shown + ", every step",
                       {{"method", "every step"}, {"codec", p.codec}},
                       compute + p.e.seconds,
                       p.e.bytes});
  }
  const std::string settings =
      (opt.fragments > 1 || opt.delay > 0
           ? fmt::format(" P={} tau={}", opt.fragments, opt.delay)
           : std::string()) +
      (warm ? fmt::format(" warm-up {:g}%", 100 * opt.diloco_warmup) : std::string());
  for (const auto& spec : opt.diloco_codecs) {
    const Priced p = exchange(spec);
    const Exchange& e = p.e;
    for (int h : opt.diloco) {
      const double exposed =
          opt.fragments * std::max(0.0, e.seconds / opt.fragments - opt.delay * compute);
      methods.push_back({fmt::format("diloco H={}{} {}", h, settings, p.shown),
                         {{"method", "diloco"},
                          {"codec", p.codec},
                          {"H", h},
                          {"fragments", opt.fragments},
                          {"delay", opt.delay},
                          {"exchange_s", e.seconds}},
                         compute + w * warm_e.seconds + (1 - w) * exposed / h,
                         w * warm_e.bytes + (1 - w) * e.bytes / h,
                         to_target ? opt.diloco_steps : 1.0});
    }
  }
  const Method& raw = methods.front();
  std::size_t width = 0;
  for (const auto& m : methods) width = std::max(width, m.name.size());
  fmt::print(
      "\nper step with {:.1f} ms of compute (every step: compute + exchange, not overlapped; "
      "DiLoCo every H steps: compute + P * max(0, E/P - tau * compute) / H, a warm-up's share W "
      "of the steps exchanging every step){}\n{:<{}} {:>10} "
      "{:>8} {:>11} {:>9}{}\n",
      opt.compute_ms,
      to_target ? fmt::format("; to target: ms/step times the steps to the target per "
                              "synchronous step ({:.2f} for DiLoCo, --diloco-steps)",
                              opt.diloco_steps)
                : std::string(),
      "method", width, "ms/step", "speedup", "sent/step", "of raw",
      to_target ? fmt::format(" {:>10} {:>8}", "to target", "speedup") : std::string());
  report["compute_s"] = compute;
  report["methods"] = nlohmann::json::array();
  const Method* fastest = &raw;
  // a / b, or nothing where b is 0 (no compute and one rank: no time, no bytes).
  auto ratio = [](double a, double b) { return b > 0 ? std::optional(a / b) : std::nullopt; };
  for (const auto& m : methods) {
    if (m.seconds * m.steps < fastest->seconds * fastest->steps) fastest = &m;
    const auto speedup = ratio(raw.seconds, m.seconds), bytes = ratio(m.bytes, raw.bytes);
    const auto target_speedup = ratio(raw.seconds, m.seconds * m.steps);
    fmt::print("{:<{}} {:>10.3f} {:>8} {:>11} {:>9}{}\n", m.name, width, m.seconds * 1e3,
               speedup ? fmt::format("{:.2f}x", *speedup) : "-", format_bytes(m.bytes),
               bytes ? fmt::format("{:.2f}%", 100 * *bytes) : "-",
               !to_target ? std::string()
                          : fmt::format(" {:>10.3f} {:>8}", m.seconds * m.steps * 1e3,
                                        target_speedup ? fmt::format("{:.2f}x", *target_speedup)
                                                       : "-"));
    nlohmann::json j = m.json;
    j["name"] = m.name;
    j["step_s"] = m.seconds;
    j["speedup"] = speedup ? nlohmann::json(*speedup) : nlohmann::json();
    if (to_target) j["target_step_s"] = m.seconds * m.steps;
    j["bytes"] = m.bytes;
    report["methods"].push_back(j);
  }
  if (to_target) {
    fmt::print("fastest to the target: {}, {:.3f} ms per synchronous step ({})\n", fastest->name,
               fastest->seconds * fastest->steps * 1e3,
               fastest == &raw ? "raw"
                               : fmt::format("{:.2f}x raw",
                                             raw.seconds / (fastest->seconds * fastest->steps)));
  } else {
    fmt::print("fastest: {}, {:.3f} ms/step ({}){}\n", fastest->name, fastest->seconds * 1e3,
               fastest == &raw ? "raw" : fmt::format("{:.2f}x raw", raw.seconds / fastest->seconds),
               opt.diloco.empty() ? ""
                                  : "; DiLoCo's loss per step is not synchronous training's: "
                                    "measure its steps to your target and give --diloco-steps "
                                    "(docs/diloco.md)");
  }
  report["fastest"] = fastest->name;
}

void run(Options opt) {
  std::optional<transport::Topology> topology;
  if (!opt.hosts.empty()) {
    if (opt.ranks == 0) opt.ranks = ranks_of_layout(opt.hosts);
    topology = transport::topology_from_spec(opt.hosts, opt.ranks);  // names what is wrong
    if (!opt.scale.empty()) {
      throw InvalidArgument("--scale prices flat jobs of other sizes; --hosts is one job's hosts");
    }
  }
  if (opt.ranks < 1) throw InvalidArgument("--ranks: the number of ranks of the job (1 or more)");
  check_methods(opt);
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
  const int ranks_per_host = opt.ranks_per_host > 0 ? opt.ranks_per_host
                             : topology             ? topology->most_ranks_on_a_host()
                                                    : 1;
  Calibration cal = cpu_costs(opt, defaults, ranks_per_host, source);
  set_links(opt, cal);
  if (topology) set_host_links(opt, *topology, cal);
  for (const auto& spec : diloco_codecs(opt)) {
    if (cal.find(spec) == nullptr) {
      throw InvalidArgument(fmt::format(
          "--diloco-codecs {}: the calibration {} has no costs of it (terse calibrate --heavy "
          "adds codecs)",
          spec, source));
    }
  }
  cal.world_size = opt.ranks;
  const std::unique_ptr<Planner> made = PlannerAccess::with_calibration(po, std::move(cal));
  Planner& planner = *made;
  if (!opt.partitions.empty()) PlannerAccess::set_partitions(planner, opt.partitions);
  StepModel model{planner,
                  opt.ranks,
                  opt.threads,
                  parse_size(opt.fuse, "--fuse-bytes"),
                  parse_size(opt.partition, "--partition-bytes"),
                  *tier};
  if (topology) model.topology = &*topology;

  nlohmann::json report;
  report_step(opt, tensors, model, source, report);
  if (topology) report_hosts(tensors, model, report);
  if (!opt.scale.empty()) report_scale(opt, tensors, model, report);
  if (opt.compute_given) report_methods(opt, tensors, model, report);
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
  cmd->add_option("--ranks", opt->ranks, "Ranks of the job (default with --hosts: its ranks)");
  cmd->add_option("--bandwidth", opt->bandwidth, "Link rate, e.g. 100mbit, 1gbit, 10gbit");
  cmd->add_option("--latency", opt->latency,
                  "One-way link latency in seconds (default: the calibration's, else 50e-6)");
  cmd->add_option("--codecs", opt->codecs,
                  "The light tier's codecs, what codec auto chooses from (default: "
                  "TERSE_PLAN_CODECS, else fp16 minmax8:ef=1 powersgd:rank=8 "
                  "powersgd:rank=8,wire=fp16)");
  cmd->add_option("--heavy", opt->heavy,
                  "The heavy tier's codecs, which codec auto:heavy adds (default: "
                  "TERSE_PLAN_HEAVY_CODECS, else onebit:ef=1 powersgd; none: no heavy codec)");
  cmd->add_option("--codec", opt->codec, "auto (the light tier) or auto:heavy (both tiers)")
      ->capture_default_str();
  cmd->add_option("--partitions", opt->partitions, "Partition counts the planner tries");
  cmd->add_option("--threads", opt->threads, "Engine worker threads")->capture_default_str();
  cmd->add_option("--ranks-per-host", opt->ranks_per_host,
                  "Ranks sharing one machine's cores (for CPU costs measured here; default 1, "
                  "with --hosts the most ranks on a host)");
  cmd->add_option("--hosts", opt->hosts,
                  "The job's hosts, as TERSE_TOPOLOGY: 2x2 (2 hosts of 2 ranks), 3,2: prices "
                  "each tensor flat and in two levels (--bandwidth, --latency: each host's link "
                  "across hosts, which its ranks share)");
  cmd->add_option("--intra-bandwidth", opt->intra_bandwidth,
                  "With --hosts: the link rate between ranks of one host")
      ->capture_default_str();
  cmd->add_option("--intra-latency", opt->intra_latency,
                  "With --hosts: the latency between ranks of one host, in seconds")
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
  CLI::Option* compute =
      cmd->add_option("--compute-ms", opt->compute_ms,
                      "The step's compute time without communication, in ms: adds each method's "
                      "time per step");
  cmd->add_option("--diloco", opt->diloco, "DiLoCo's sync periods H to price, e.g. 25,50,100")
      ->delimiter(',');
  cmd->add_option("--diloco-codecs", opt->diloco_codecs,
                  "Pseudo-gradient codecs, separated by spaces (specs hold commas), auto and "
                  "auto:heavy included (default: none minmax8:ef=1 minmax8:bits=4,ef=1)");
  cmd->add_option("--diloco-steps", opt->diloco_steps,
                  "DiLoCo's steps to a target loss over synchronous training's, measured on a "
                  "short run (e.g. 1.6): ranks the methods by time to the target");
  cmd->add_option("--diloco-warmup", opt->diloco_warmup,
                  "DiLoCo's share of the steps trained synchronously first (terse.diloco's "
                  "warmup over the run's steps), their gradients exchanged with --warmup-codec");
  cmd->add_option("--warmup-codec", opt->warmup_codec,
                  "The codec of DiLoCo's warm-up steps (default none; auto for the planner's)")
      ->capture_default_str();
  cmd->add_option("--fragments", opt->fragments, "Streaming DiLoCo's fragments P (1 to H)")
      ->capture_default_str();
  cmd->add_option("--delay", opt->delay,
                  "Streaming DiLoCo's delay tau: inner steps that hide a fragment's exchange")
      ->capture_default_str();
  cmd->callback([opt, compute] {
    opt->compute_given = compute->count() > 0;
    run(*opt);
  });
}

}  // namespace terse::tools
