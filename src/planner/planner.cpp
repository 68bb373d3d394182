// The planner: per tensor size, the candidate with the least expected time (measured where the
// engine has reported it, else predicted), raw unless compression clearly pays; calibration or
// the agreed cache on first use; exploration of a new size's best few plans
// (planner/explorer.h); periodic re-checks against the engine's measured times.
#include "terse/planner.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kit/hash.h"
#include "planner/exchange.h"
#include "planner/planner_impl.h"
#include "planner/protocol.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/topology.h"

namespace terse {

namespace {

// Tensors of at most this size go raw: a small tensor's precision is not worth losing for the
// message rounds a compressed strategy saves, and in a group the engine fuses small raw
// tensors into one message, which saves them anyway. Two exceptions, where raw costs real
// time even for small tensors: slow links (raw's bytes alone take more than kSmallTensorSlack
// seconds over the best plan) and long rings (more than kSmallTensorMaxRanks ranks: a ring has
// 2(N-1) rounds). Neither depends on the measured latency, which outside load makes noisy.
constexpr std::size_t kRawBelowBytes = std::size_t{16} << 10;
constexpr double kSmallTensorSlack = 1e-3;
constexpr int kSmallTensorMaxRanks = 32;
// Every this many planned submissions the measured times are compared with the decisions'
// expectations, and a decision off by more than kRecheckThreshold (relative) is made again: the
// conditions a calibration saw (load, links) change during a job.
constexpr int kRecheckInterval = 200;
constexpr double kRecheckThreshold = 0.25;
// Observations kept per (size, plan) between exchanges, all of which an exchange sends: the
// first ones, the same runs on every rank (a median needs no more).
constexpr std::size_t kMaxObservations = 256;

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return {};
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Writes atomically (temporary file + rename): ranks sharing a host write the same file.
void write_file(const std::string& path, const std::string& text, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = fmt::format("{}.tmp{}-{}", path, rank, ::getpid());
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) return;  // a cache that cannot be written only costs the next run a calibration
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp, ec);
}

// Measured K of a codec, strategy and levels correct the predictions of its other K
// (geometric mean of the measured / predicted ratios): a model error of the configuration
// carries over to its other partition counts, not to the other level's.
void correct_by_family(std::vector<PlanCandidate>& candidates) {
  std::map<std::string, std::pair<double, int>> family;
  auto family_of = [](const TensorPlan& p) {
    return fmt::format("{}/{}{}", p.codec, to_string(p.strategy), p.hierarchical ? "/hosts" : "");
  };
  for (const auto& c : candidates) {
    if (!c.measured || c.predicted.seconds <= 0) continue;
    auto& [log_sum, count] = family[family_of(c.plan)];
    log_sum += std::log(*c.measured / c.predicted.seconds);
    ++count;
  }
  for (auto& c : candidates) {
    auto it = family.find(family_of(c.plan));
    if (!c.measured && it != family.end()) {
      c.correction = std::exp(it->second.first / it->second.second);
    }
  }
}

// The hosts of a topology (empty: unknown) and, where a host's ranks read each other's memory,
// their process ids (CalibrationOptions::direct_pid: such links are measured that way).
std::vector<int> hosts_of(const transport::Topology* t) {
  return t != nullptr ? t->host_of : std::vector<int>{};
}
std::vector<std::int64_t> direct_pids_of(const transport::Topology* t, int size) {
  std::vector<std::int64_t> out;
  if (t == nullptr || t->size() != size || static_cast<int>(t->pid.size()) != size) return out;
  for (int r = 0; r < size; ++r) out.push_back(t->reads_directly(t->host_of[r]) ? t->pid[r] : 0);
  return out;
}

}  // namespace

std::string plan_key(const TensorPlan& p) {
  return fmt::format("{}/{}/{}{}", p.codec, to_string(p.strategy), p.partitions,
                     p.hierarchical ? "/hosts" : "");
}

planner::Levels planner::levels_of(const Use& use) {
  if (use.op != Operation::kAllreduce || use.topology == nullptr) return {true, false};
  switch (use.hierarchy) {
    case Hierarchy::kFlat: return {true, false};
    case Hierarchy::kHosts: return {false, true};
    case Hierarchy::kAuto: break;
  }
  // One host, or a rank a host: two levels are the flat collective with extra steps.
  return {true, use.topology->two_level()};
}

Planner::Impl::Key Planner::Impl::key_of(const planner::Use& u) {
  const planner::Levels l = planner::levels_of(u);
  std::uint64_t topology = 0;
  if (l.hosts) {
    // Engines sharing a planner may have other topologies: each prices its own.
    topology = fnv1a64(std::string_view(reinterpret_cast<const char*>(u.topology->host_of.data()),
                                        u.topology->host_of.size() * sizeof(int)));
  }
  return {u.n,  u.threads, u.strategy, u.partitions, u.tier,  u.op, u.raw_partition_bytes,
          l.flat, l.hosts,  topology};
}

std::optional<Tier> auto_tier(std::string_view codec) {
  if (codec == "auto") return Tier::kLight;
  if (codec == "auto:heavy") return Tier::kHeavy;
  return std::nullopt;
}

std::string_view auto_codec(Tier tier) { return tier == Tier::kHeavy ? "auto:heavy" : "auto"; }

std::string planner::run_key(Operation op, const TensorPlan& p) {
  if (op == Operation::kAllreduce) return plan_key(p);
  return fmt::format("{}:{}", to_string(op), plan_key(p));
}

Planner::Planner(PlannerOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = std::move(options);
  // The light tier: the codecs that kept DDP's fp32 accuracy on the training benchmark
  // (docs/planner.md); the heavy tier: those that compress most, at some cost in accuracy.
  if (m.options.allowed.empty()) {
    m.options.allowed = {"fp16", "minmax8:ef=1", "powersgd:rank=8", "powersgd:rank=8,wire=fp16"};
  }
  if (m.options.heavy.empty()) m.options.heavy = {"onebit:ef=1", "powersgd"};
  // Canonical specs, each once, raw left out (it is always a candidate); a codec in both lists
  // is light.
  auto add = [&m](const std::vector<std::string>& specs, std::vector<std::string>& out) {
    for (const auto& spec : specs) {
      auto codec = make_codec(spec);  // throws SpecError for unknown codecs
      if (codec->name() == "none") continue;
      if (std::find(m.allowed.begin(), m.allowed.end(), codec->spec()) == m.allowed.end() &&
          std::find(out.begin(), out.end(), codec->spec()) == out.end()) {
        out.push_back(codec->spec());
      }
    }
  };
  add(m.options.allowed, m.allowed);
  add(m.options.heavy, m.heavy);
  m.options.explore_seconds = std::max(0.0, m.options.explore_seconds);  // 0: off
  m.recheck_interval = kRecheckInterval;
  m.calibration_options.codecs = m.allowed;
  m.calibration_options.codecs.insert(m.calibration_options.codecs.end(), m.heavy.begin(),
                                      m.heavy.end());
}

Planner::~Planner() = default;

std::vector<std::string> Planner::allowed() const { return impl_->allowed; }

std::vector<std::string> Planner::heavy() const { return impl_->heavy; }

const PlannerOptions& Planner::options() const { return impl_->options; }

bool Planner::calibrated() const {
  std::lock_guard lock(impl_->mu);
  return impl_->model != nullptr;
}

std::unique_ptr<Planner> PlannerAccess::with_calibration(PlannerOptions options,
                                                         Calibration calibration) {
  auto p = std::make_unique<Planner>(std::move(options));
  const Planner::Impl& m = *p->impl_;
  for (const auto& spec : m.calibration_options.codecs) {
    if (calibration.find(spec) == nullptr) {
      const bool light = std::find(m.allowed.begin(), m.allowed.end(), spec) != m.allowed.end();
      throw InvalidArgument(fmt::format(
          "planner: the calibration has no costs for codec {} of the {} tier (a tier given as "
          "{{\"none\"}} holds no codec)",
          spec, light ? "light" : "heavy"));
    }
  }
  p->impl_->model = std::make_unique<CostModel>(std::move(calibration));
  return p;
}

const CostModel& PlannerAccess::model(const Planner& planner) {
  const Planner::Impl& m = *planner.impl_;
  std::lock_guard lock(m.mu);
  if (!m.model) throw InvalidArgument("planner: not calibrated yet");
  return *m.model;
}

const Calibration& PlannerAccess::calibration(Planner& planner, Communicator& comm,
                                              const transport::Topology* topology) {
  planner.impl_->ensure_calibrated(comm, hosts_of(topology),
                                   direct_pids_of(topology, comm.size()));
  return model(planner).calibration();
}

void PlannerAccess::set_allreduce_probe(Planner& planner, MakeAllreduceProbe make_probe) {
  std::lock_guard lock(planner.impl_->mu);
  planner.impl_->make_probe = std::move(make_probe);
}

void PlannerAccess::set_partitions(Planner& planner, std::vector<int> partitions) {
  std::lock_guard lock(planner.impl_->mu);
  planner.impl_->partitions = partitions.empty() ? std::vector<int>{1} : std::move(partitions);
}

void PlannerAccess::set_recheck_interval(Planner& planner, int interval) {
  std::lock_guard lock(planner.impl_->mu);
  planner.impl_->recheck_interval = interval;
}

void PlannerAccess::set_gather_bytes(Planner& planner, std::size_t bytes) {
  std::lock_guard lock(planner.impl_->mu);
  planner.impl_->gather_bytes = bytes;
  if (planner.impl_->model) planner.impl_->model->set_gather_bytes(bytes);
}


void Planner::Impl::ensure_calibrated(Communicator& comm, const std::vector<int>& host_of,
                                      const std::vector<std::int64_t>& direct_pid) {
  MakeAllreduceProbe probe_maker;
  {
    std::lock_guard lock(mu);
    if (model) return;
    probe_maker = make_probe;
  }
  const std::vector<int> direct_reads = direct_reads_of(direct_pid, comm.size());
  if (!probe_maker) {
    throw InvalidArgument(
        "planner: calibration times allreduces through an engine, and none gave the planner its "
        "probe (use codec \"auto\" through an Engine)");
  }
  const std::string path =
      options.cache_path.empty()
          ? default_calibration_path(comm.size(), options.cache_directory)
          : options.cache_path;
  const bool log = options.log && comm.rank() == 0;
  // Use the cache only if every rank holds the same usable one; otherwise every rank measures.
  std::string text = path == "-" ? std::string() : read_file(path);
  Calibration cached;
  bool usable = false;
  if (!text.empty()) {
    try {
      cached = Calibration::from_json(text);
      // Its links split into intra-host and cross-host ones by the topology it was measured
      // under: another topology's (the same host name, other emulated hosts or launch) is not
      // this job's.
      usable = cached.world_size == comm.size() && cached.host_of == host_of &&
               cached.direct_reads == direct_reads;
      if (log && cached.world_size == comm.size() &&
          (cached.host_of != host_of || cached.direct_reads != direct_reads)) {
        std::fprintf(stderr,
                     "terse plan: calibration cache %s was measured on other hosts (another "
                     "topology, or another way of moving bytes inside them); calibrating\n",
                     path.c_str());
      }
      for (const auto& spec : calibration_options.codecs) usable &= cached.find(spec) != nullptr;
    } catch (const DecodeError& e) {
      // Another version's cache (or a damaged one) is measured again, never patched up.
      if (comm.rank() == 0) {
        std::fprintf(stderr, "terse plan: calibration cache %s not used (%s); calibrating\n",
                     path.c_str(), e.what());
      }
    }
  }
  const double digest = usable ? static_cast<double>(fnv1a64(text) >> 12) : 0.0;
  bool agreed = true;
  for (const auto& v : planner::gather(comm, std::span(&digest, 1))) agreed &= v[0] == digest;
  Calibration c;
  bool save = true;
  if (agreed && usable) {
    c = std::move(cached);
    save = false;
    // Links change (another network, another shaping) where the machine does not: check them.
    const double ratio = planner::probe_links(comm, c, calibration_options);
    if (ratio > 1.3 || ratio < 1 / 1.3) {
      if (log) {
        std::fprintf(stderr, "terse plan: cached links off by %.2fx; measuring them again\n",
                     ratio);
      }
      CalibrationOptions again = calibration_options;
      again.host_of = host_of;
      again.direct_pid = direct_pid;
      planner::measure_links(comm, again, c);
      const auto probe = probe_maker(comm);
      const bool paced = planner::measure_engine_beta(comm, c, *probe);
      planner::check_link_probes(comm, again, c, paced, *probe);
      save = true;
    }
    if (log) std::fprintf(stderr, "terse plan: calibration from %s\n", path.c_str());
  } else {
    CalibrationOptions measuring = calibration_options;
    measuring.host_of = host_of;  // recorded, and each link judged within its class
    measuring.direct_pid = direct_pid;
    c = calibrate(comm, measuring, probe_maker);
  }
  if (save && path != "-") write_file(path, c.to_json(), comm.rank());
  if (log) {
    std::fprintf(stderr,
                 "terse plan: calibrated in %.2f s: alpha %.1f us, beta %.3f ns/B (%.0f MB/s; "
                 "in the engine %.0f MB/s), %d ranks on %d cores, slowdown x%.2f at 4 threads\n",
                 c.seconds, c.alpha * 1e6, c.beta * 1e9, c.beta > 0 ? 1e-6 / c.beta : 0.0,
                 c.engine_beta > 0 ? 1e-6 / c.engine_beta : 0.0, c.ranks_on_host, c.cores,
                 c.slowdown(4));
    const LinkClasses l = link_classes(c, host_of);
    if (l.intra.pairs > 0 && l.cross.pairs > 0) {
      std::fprintf(stderr,
                   "terse plan: links inside hosts %.1f us, %.3f ns/B (%.0f MB/s); across hosts "
                   "%.1f us, %.3f ns/B (%.0f MB/s)\n",
                   l.intra.alpha * 1e6, l.intra.pair_beta * 1e9,
                   l.intra.pair_beta > 0 ? 1e-6 / l.intra.pair_beta : 0.0, l.cross.alpha * 1e6,
                   l.cross.pair_beta * 1e9,
                   l.cross.pair_beta > 0 ? 1e-6 / l.cross.pair_beta : 0.0);
    }
  }
  std::lock_guard lock(mu);
  model = std::make_unique<CostModel>(std::move(c));
  model->set_gather_bytes(gather_bytes);
}

PlanDecision Planner::decide(std::size_t n, int ranks, int threads, Strategy strategy,
                             int partitions, Tier tier, Operation op) const {
  return planner::decide(*this, {n, threads, strategy, partitions, tier, op}, ranks);
}

PlanDecision planner::decide(const Planner& self, const Use& use, int ranks) {
  const std::size_t n = use.n, raw_partition_bytes = use.raw_partition_bytes;
  const Operation op = use.op;
  const Planner::Impl& m = PlannerAccess::impl(self);
  std::lock_guard lock(m.mu);
  if (!m.model) throw InvalidArgument("planner: not calibrated yet");
  PlanDecision d;
  d.elements = n;
  d.op = op;
  // What the engine splits into K: an allreduce's tensor, a reduce-scatter's or all-gather's
  // shard.
  const std::size_t split =
      op == Operation::kAllreduce ? n : n / static_cast<std::size_t>(std::max(ranks, 1));
  std::vector<int> ks;
  if (use.partitions > 0) {
    ks.push_back(planner::clamp_partitions(use.partitions, split));
  } else {
    for (int k : m.partitions) {
      const int c = planner::clamp_partitions(k, split);
      if (std::find(ks.begin(), ks.end(), c) == ks.end()) ks.push_back(c);
    }
  }
  // Raw also at the engine's own partitioning (raw_partition_bytes), where K is the planner's.
  std::vector<int> raw_ks = ks;
  if (use.partitions <= 0 && raw_partition_bytes > 0) {
    const std::size_t own = (n * sizeof(float) + raw_partition_bytes - 1) / raw_partition_bytes;
    const int c =
        planner::clamp_partitions(static_cast<int>(std::min<std::size_t>(own, 1 << 20)), split);
    if (std::find(raw_ks.begin(), raw_ks.end(), c) == raw_ks.end()) raw_ks.push_back(c);
  }
  // Each candidate flat, in two levels over the hosts, or both (planner::levels_of).
  const planner::Levels levels = planner::levels_of(use);
  planner::HostLayout hosts;
  if (levels.hosts) {
    if (use.topology->size() != ranks) {
      throw InvalidArgument(fmt::format("planner: a topology of {} ranks for a job of {}",
                                        use.topology->size(), ranks));
    }
    hosts = planner::host_layout(m.model->calibration(), *use.topology);
  }
  auto consider = [&](const std::string& spec, Strategy s, bool whole) {
    if (use.strategy != Strategy::kAuto && use.strategy != s) return;
    if (whole && use.partitions > 1) return;
    for (int k : whole ? std::vector<int>{1} : s == Strategy::kRaw ? raw_ks : ks) {
      for (const bool two : {false, true}) {
        if (!(two ? levels.hosts : levels.flat)) continue;
        PlanCandidate c;
        c.plan.codec = spec;
        c.plan.strategy = s;
        c.plan.partitions = k;
        c.plan.hierarchical = two;
        c.predicted = two ? m.model->predict_hosts(n, spec, s, k, hosts, use.threads)
                          : m.model->predict(n, spec, s, k, ranks, use.threads, op);
        if (auto it = m.measured.find({n, planner::run_key(op, c.plan)}); it != m.measured.end()) {
          c.measured = it->second;
        }
        d.ranked.push_back(std::move(c));
      }
    }
  };
  consider("none", Strategy::kRaw, false);
  std::vector<std::string> codecs = m.allowed;
  if (use.tier == Tier::kHeavy) codecs.insert(codecs.end(), m.heavy.begin(), m.heavy.end());
  for (const auto& spec : codecs) {
    const CodecCosts& k = *m.model->calibration().find(spec);
    if (op != Operation::kAllreduce) {
      if (k.multi_round) continue;  // no shard of a multi-round codec's encoding can travel alone
      if (op == Operation::kAllGather) {
        consider(spec, Strategy::kAllgather, false);
        continue;
      }
      for (Strategy s : {Strategy::kAllToAll, Strategy::kSharded, Strategy::kRing}) {
        consider(spec, s, false);
      }
      if (k.summable) consider(spec, Strategy::kSummable, false);
      continue;
    }
    if (k.multi_round) {  // PowerSGD, on the whole matrix: its rounds' sums on rings or gathered
      consider(spec, Strategy::kSummable, true);
      consider(spec, Strategy::kAllgather, true);
      continue;
    }
    for (Strategy s : {Strategy::kAllgather, Strategy::kSharded, Strategy::kRing}) {
      consider(spec, s, false);
    }
    if (k.summable) consider(spec, Strategy::kSummable, false);
  }
  correct_by_family(d.ranked);
  if (d.ranked.empty()) {
    throw InvalidArgument(fmt::format("planner: no allowed codec can use strategy {} in {}",
                                      to_string(use.strategy), to_string(op)));
  }
  // Stable: equal times keep the order above (raw first, then the light tier's list, then the
  // heavy tier's; each configuration flat before two levels).
  std::stable_sort(d.ranked.begin(), d.ranked.end(), [](const auto& a, const auto& b) {
    return PlanDecision::expected(a) < PlanDecision::expected(b);
  });
  d.chosen = d.ranked.front();
  const PlanCandidate* raw = nullptr;
  for (const auto& c : d.ranked) {
    if (c.plan.strategy == Strategy::kRaw) {
      raw = &c;
      break;
    }
  }
  bool small_raw = false;
  if (raw != nullptr) {
    d.raw_seconds = PlanDecision::expected(*raw);
    const double best = PlanDecision::expected(d.chosen);
    const bool small = n * sizeof(float) <= kRawBelowBytes && ranks <= kSmallTensorMaxRanks;
    small_raw = small && raw->predicted.network - best <= kSmallTensorSlack;
    if (best > (1 - m.options.min_gain) * d.raw_seconds || small_raw) d.chosen = *raw;
  }
  // A small tensor kept raw for its precision has nothing to explore (its K barely matter, and
  // in a group it travels fused, where no time of its own is measured).
  d.contenders = planner::pick_contenders(d, small_raw ? 0.0 : m.options.explore_seconds);
  return d;
}

void Planner::Impl::log_decision(const PlanDecision& d, int rank, const char* why) const {
  if (!options.log || rank != 0) return;
  const auto& c = d.chosen;
  const std::string op =
      d.op == Operation::kAllreduce ? "" : fmt::format("{} of ", to_string(d.op));
  std::fprintf(stderr,
               "terse plan: %s %s%zu floats -> %s, strategy %s%s, K=%d: %s %.3f ms (raw %.3f ms, "
               "%.2fx)\n",
               why, op.c_str(), d.elements, c.plan.codec.c_str(),
               std::string(to_string(c.plan.strategy)).c_str(),
               c.plan.hierarchical ? " across hosts" : "", c.plan.partitions,
               c.measured ? "measured" : "predicted", PlanDecision::expected(c) * 1e3,
               d.raw_seconds * 1e3,
               PlanDecision::expected(c) > 0 ? d.raw_seconds / PlanDecision::expected(c) : 0.0);
}

TensorPlan planner::plan(Planner& self, Communicator& comm, const Use& use) {
  const std::size_t n = use.n;
  const Tier tier = use.tier;
  const Operation op = use.op;
  Planner::Impl& m = PlannerAccess::impl(self);
  m.ensure_calibrated(comm, hosts_of(use.topology), direct_pids_of(use.topology, comm.size()));
  const Planner::Impl::Key key = Planner::Impl::key_of(use);
  {
    std::lock_guard lock(m.mu);
    auto it = m.decisions.find(key);
    if (it != m.decisions.end()) return it->second.chosen.plan;
  }
  PlanDecision d = decide(self, use, comm.size());
  m.log_decision(d, comm.rank(), tier == Tier::kHeavy ? "plan auto:heavy" : "plan");
  std::lock_guard lock(m.mu);
  if (d.contenders.size() > 1) {
    planner::Explorer e(d.contenders, m.options.explore_seconds, m.options.min_gain);
    e.next();  // this submission runs the choice, the first contender
    if (m.options.log && comm.rank() == 0) {
      std::string list;
      for (std::size_t i = 0; i < d.contenders.size(); ++i) {
        list += fmt::format(" {} ({} runs)", plan_key(d.contenders[i].plan), e.runs()[i]);
      }
      std::fprintf(stderr, "terse plan: exploring %s %zu floats (%s):%s\n",
                   std::string(to_string(op)).c_str(), n, std::string(auto_codec(tier)).c_str(),
                   list.c_str());
    }
    m.exploring.insert_or_assign(key, std::move(e));
  }
  return m.decisions.insert_or_assign(key, std::move(d)).first->second.chosen.plan;
}

bool planner::exploring(const Planner& self, const Use& use) {
  const Planner::Impl& m = PlannerAccess::impl(self);
  std::lock_guard lock(m.mu);
  return m.exploring.count(Planner::Impl::key_of(use)) > 0;
}

int Planner::Impl::advance_explorations(
    const std::map<std::pair<std::size_t, std::string>, std::vector<double>>& runs, int rank) {
  int changed = 0;
  for (auto it = exploring.begin(); it != exploring.end();) {
    planner::Explorer& e = it->second;
    if (!e.round_done()) {
      ++it;
      continue;
    }
    const std::size_t n = it->first.n;
    const Operation op = it->first.op;
    std::vector<std::vector<double>> round(e.contenders().size());
    for (std::size_t i = 0; i < round.size(); ++i) {
      if (auto r = runs.find({n, planner::run_key(op, e.contenders()[i].plan)}); r != runs.end()) {
        round[i] = r->second;
      }
    }
    e.end_round(round);
    for (std::size_t i = 0; i < round.size(); ++i) {
      if (const auto t = e.time(i)) {
        measured[{n, planner::run_key(op, e.contenders()[i].plan)}] = *t;
      }
    }
    if (!e.settled()) {
      if (options.log && rank == 0) {
        std::string list;
        for (std::size_t i = 0; i < round.size(); ++i) {
          if (e.runs()[i] > 0) {
            list += fmt::format(" {} {:.3f} ms ({} runs)", plan_key(e.contenders()[i].plan),
                                e.time(i).value_or(0) * 1e3, e.runs()[i]);
          }
        }
        std::fprintf(stderr, "terse plan: exploring %s %zu floats, round %d:%s\n",
                     std::string(to_string(op)).c_str(), n, e.round() + 1, list.c_str());
      }
      ++it;
      continue;
    }
    PlanDecision& d = decisions.at(it->first);
    const std::string before = plan_key(d.chosen.plan);
    d.chosen = e.contenders()[e.winner()];
    d.chosen.measured = e.time(e.winner());
    changed += plan_key(d.chosen.plan) != before;
    if (options.log && rank == 0) {
      std::string list;
      for (std::size_t i = 0; i < round.size(); ++i) {
        const auto t = e.time(i);
        list += t ? fmt::format(" {} {:.3f} ms", plan_key(e.contenders()[i].plan), *t * 1e3)
                  : fmt::format(" {} unmeasured", plan_key(e.contenders()[i].plan));
      }
      std::fprintf(stderr, "terse plan: explored %s %zu floats (%s, %.2f s), measured:%s\n",
                   std::string(to_string(op)).c_str(), n, e.why().c_str(), e.spent(), list.c_str());
    }
    log_decision(d, rank, it->first.tier == Tier::kHeavy ? "explored auto:heavy" : "explored");
    it = exploring.erase(it);
  }
  return changed;
}

void planner::observe(Planner& self, std::size_t n, const TensorPlan& plan, double seconds,
                      Operation op) {
  Planner::Impl& m = PlannerAccess::impl(self);
  std::lock_guard lock(m.mu);
  auto& v = m.observed[{n, planner::run_key(op, plan)}];
  if (v.size() < kMaxObservations) v.push_back(seconds);
}

int planner::before_submission(Planner& self, Communicator& comm, std::span<const Use> uses) {
  using Impl = Planner::Impl;
  Impl& m = PlannerAccess::impl(self);
  std::string mine;
  bool recheck = false;
  // Once the exchange (if any) has settled what it could: each size still explored that this
  // submission uses runs its next contender (the same for all of the submission's tensors of
  // that size), which counts them as its runs.
  auto count_uses = [&] {
    std::map<Impl::Key, int> count;
    for (const auto& u : uses) {
      const Impl::Key key = Impl::key_of(u);
      if (m.exploring.count(key) > 0) ++count[key];
    }
    int switched = 0;
    for (const auto& [key, k] : count) {
      planner::Explorer& e = m.exploring.at(key);
      const std::size_t i = e.next(k);
      PlanDecision& d = m.decisions.at(key);
      switched += plan_key(d.chosen.plan) != plan_key(e.contenders()[i].plan);
      d.chosen = e.contenders()[i];
    }
    return switched;
  };
  {
    std::lock_guard lock(m.mu);
    ++m.submissions;
    recheck = m.recheck_interval > 0 &&
              m.submissions % static_cast<std::uint64_t>(m.recheck_interval) == 0;
    const bool explore = std::any_of(m.exploring.begin(), m.exploring.end(),
                                     [](const auto& e) { return e.second.round_done(); });
    if (!m.model || !(recheck || explore)) return count_uses();
    for (const auto& [key, samples] : m.observed) {
      mine += fmt::format("{} {}", key.first, key.second);
      for (const double seconds : samples) mine += fmt::format(" {:.9e}", seconds);
      mine += '\n';
    }
    m.observed.clear();
  }
  // Agreed runs per (size, plan): per run the largest over ranks (a collective completes when
  // its slowest rank does). The ranks' runs of a size are the same submissions in the same
  // order, so their i-th observations are one run.
  std::map<std::pair<std::size_t, std::string>, std::vector<double>> slowest;
  for (const auto& text : planner::gather_text(comm, mine)) {
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::size_t n;
      std::string key;
      if (!(fields >> n >> key)) continue;
      std::vector<double> runs;
      for (double seconds; fields >> seconds;) runs.push_back(seconds);
      auto [it, fresh] = slowest.emplace(std::make_pair(n, key), std::move(runs));
      if (fresh) continue;
      // A rank that saw fewer runs of it (one still in flight at the exchange): the runs all
      // ranks saw. (`runs` was not moved from: the key was there.)
      auto& v = it->second;
      v.resize(std::min(v.size(), runs.size()));
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], runs[i]);
    }
  }
  std::vector<PlanDecision> replanned;
  std::map<std::pair<std::size_t, std::string>, double> agreed;
  for (const auto& [key, runs] : slowest) {
    if (!runs.empty()) agreed[key] = planner::median(runs);
  }
  int changed = 0;
  {
    std::lock_guard lock(m.mu);
    for (const auto& [key, seconds] : agreed) m.measured[key] = seconds;
    changed = m.advance_explorations(slowest, comm.rank());
    // Re-checks at their own interval only: an exchange for exploration holds a few runs.
    for (auto it = m.decisions.begin(); it != m.decisions.end();) {
      if (!recheck || m.exploring.count(it->first) > 0) {
        ++it;
        continue;
      }
      const PlanCandidate& c = it->second.chosen;
      auto a = agreed.find({it->first.n, planner::run_key(it->first.op, c.plan)});
      const double expected = PlanDecision::expected(c);
      if (a != agreed.end() && expected > 0 &&
          std::abs(a->second / expected - 1) > kRecheckThreshold) {
        replanned.push_back(it->second);
        it = m.decisions.erase(it);
      } else {
        ++it;
      }
    }
    changed += count_uses();
  }
  for (const auto& d : replanned) {
    if (m.options.log && comm.rank() == 0) {
      const std::string key = planner::run_key(d.op, d.chosen.plan);
      const double t = agreed.at({d.elements, key});
      std::fprintf(stderr,
                   "terse plan: re-check: %zu floats with %s took %.3f ms, expected %.3f ms: "
                   "re-planning\n",
                   d.elements, key.c_str(), t * 1e3, PlanDecision::expected(d.chosen) * 1e3);
    }
  }
  return changed + static_cast<int>(replanned.size());
}

}  // namespace terse
