// The planner: per tensor size, the candidate with the least expected time (measured where the
// engine has reported it, else predicted), raw unless compression clearly pays; calibration or
// the agreed cache on first use; periodic re-checks against the engine's measured times.
#include "terse/planner.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "planner/exchange.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/error.h"

namespace terse {

namespace {

constexpr int kMaxPartitions = 256;  // the engine's limit
// Observations kept per (size, plan) between exchanges, all of which an exchange sends: the
// first ones, the same runs on every rank (a re-check's median needs no more).
constexpr std::size_t kMaxObservations = 256;

std::vector<std::string> default_allowed() {
  const char* v = std::getenv("TERSE_PLAN_CODECS");
  if (v == nullptr || *v == '\0') return {"fp16", "onebit:ef=1"};
  // Specs hold commas ("onebit:ef=1,scale=max"), so the list is separated by ';' or spaces.
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = v;; ++p) {
    if (*p == '\0' || *p == ';' || *p == ' ') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == '\0') break;
    } else {
      cur += *p;
    }
  }
  return out;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

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

int clamp_partitions(int k, std::size_t n) {
  return static_cast<int>(std::clamp<std::size_t>(
      static_cast<std::size_t>(std::max(k, 1)), 1,
      std::min<std::size_t>(kMaxPartitions, std::max<std::size_t>(1, (n + 63) / 64))));
}

}  // namespace

std::string plan_key(const TensorPlan& p) {
  return fmt::format("{}/{}/{}", p.codec, to_string(p.strategy), p.partitions);
}

Planner::Planner(PlannerOptions options) : options_(std::move(options)) {
  if (options_.allowed.empty()) options_.allowed = default_allowed();
  for (const auto& spec : options_.allowed) {
    auto codec = make_codec(spec);  // throws SpecError for unknown codecs
    if (codec->name() == "none") continue;
    if (std::find(allowed_.begin(), allowed_.end(), codec->spec()) == allowed_.end()) {
      allowed_.push_back(codec->spec());
    }
  }
  if (options_.partitions.empty()) options_.partitions = {1};
  if (env_flag("TERSE_PLAN_LOG")) options_.log = true;
  if (const char* v = std::getenv("TERSE_PLAN_EXPLORE"); v != nullptr && *v != '\0') {
    options_.explore_candidates = std::max(1, std::atoi(v));  // 0 or 1: off
  }
  options_.calibration.codecs = allowed_;
}

Planner::Planner(PlannerOptions options, Calibration calibration) : Planner(std::move(options)) {
  for (const auto& spec : allowed_) {
    if (calibration.find(spec) == nullptr) {
      throw InvalidArgument(
          fmt::format("planner: the calibration has no costs for codec {}", spec));
    }
  }
  model_ = std::make_unique<CostModel>(std::move(calibration));
}

std::vector<std::string> Planner::allowed() const { return allowed_; }

bool Planner::calibrated() const {
  std::lock_guard lock(mu_);
  return model_ != nullptr;
}

const CostModel& Planner::model() const {
  std::lock_guard lock(mu_);
  if (!model_) throw InvalidArgument("planner: not calibrated yet");
  return *model_;
}

const Calibration& Planner::calibration(Communicator& comm) {
  ensure_calibrated(comm);
  return model().calibration();
}

void Planner::ensure_calibrated(Communicator& comm) {
  if (calibrated()) return;
  const std::string path =
      options_.cache_path.empty() ? default_calibration_path(comm.size()) : options_.cache_path;
  // Use the cache only if every rank holds the same usable one; otherwise every rank measures.
  std::string text = path == "-" ? std::string() : read_file(path);
  Calibration cached;
  bool usable = false;
  if (!text.empty()) {
    try {
      // One measured against the model before stop 37 is rebased onto this one's pricing.
      cached = rebase_host_factor(Calibration::from_json(text), CostModel::kTensorRates);
      usable = cached.world_size == comm.size();
      for (const auto& spec : allowed_) usable &= cached.find(spec) != nullptr;
    } catch (const DecodeError&) {
      usable = false;
    }
  }
  const double digest = usable ? static_cast<double>(fnv1a64(text) >> 12) : 0.0;
  bool agreed = true;
  for (const auto& v : planner::gather(comm, std::span(&digest, 1))) agreed &= v[0] == digest;
  Calibration c;
  bool save = true;
  const bool log = options_.log && comm.rank() == 0;
  if (agreed && usable) {
    c = std::move(cached);
    save = false;
    // Links change (another network, another shaping) where the machine does not: check them.
    const double ratio = planner::probe_links(comm, c, options_.calibration);
    if (ratio > 1.3 || ratio < 1 / 1.3) {
      if (log) {
        std::fprintf(stderr, "terse plan: cached links off by %.2fx; measuring them again\n",
                     ratio);
      }
      planner::measure_links(comm, options_.calibration, c);
      const bool paced = planner::measure_engine_beta(comm, c);
      planner::check_link_probes(comm, options_.calibration, c, paced);
      save = true;
    }
    if (log) std::fprintf(stderr, "terse plan: calibration from %s\n", path.c_str());
  } else {
    c = calibrate(comm, options_.calibration);
  }
  if (save && path != "-") write_file(path, c.to_json(), comm.rank());
  if (log) {
    std::fprintf(stderr,
                 "terse plan: calibrated in %.2f s: alpha %.1f us, beta %.3f ns/B (%.0f MB/s; "
                 "in the engine %.0f MB/s), %d ranks on %d cores, slowdown x%.2f at 4 threads\n",
                 c.seconds, c.alpha * 1e6, c.beta * 1e9, c.beta > 0 ? 1e-6 / c.beta : 0.0,
                 c.engine_beta > 0 ? 1e-6 / c.engine_beta : 0.0,
                 c.ranks_on_host, c.cores, c.slowdown(4));
  }
  std::lock_guard lock(mu_);
  model_ = std::make_unique<CostModel>(std::move(c));
}

PlanDecision Planner::decide(std::size_t n, int ranks, int threads, Strategy strategy,
                             int partitions) const {
  std::lock_guard lock(mu_);
  if (!model_) throw InvalidArgument("planner: not calibrated yet");
  PlanDecision d;
  d.elements = n;
  std::vector<int> ks;
  if (partitions > 0) {
    ks.push_back(clamp_partitions(partitions, n));
  } else {
    for (int k : options_.partitions) {
      const int c = clamp_partitions(k, n);
      if (std::find(ks.begin(), ks.end(), c) == ks.end()) ks.push_back(c);
    }
  }
  // Raw also at the engine's own partitioning (raw_partition_bytes), where K is the planner's.
  std::vector<int> raw_ks = ks;
  if (partitions <= 0 && options_.raw_partition_bytes > 0) {
    const std::size_t own =
        (n * sizeof(float) + options_.raw_partition_bytes - 1) / options_.raw_partition_bytes;
    const int c = clamp_partitions(static_cast<int>(std::min<std::size_t>(own, 1 << 20)), n);
    if (std::find(raw_ks.begin(), raw_ks.end(), c) == raw_ks.end()) raw_ks.push_back(c);
  }
  auto consider = [&](const std::string& spec, Strategy s, bool whole) {
    if (strategy != Strategy::kAuto && strategy != s) return;
    if (whole && partitions > 1) return;
    for (int k : whole ? std::vector<int>{1} : s == Strategy::kRaw ? raw_ks : ks) {
      PlanCandidate c;
      c.plan.codec = spec;
      c.plan.strategy = s;
      c.plan.partitions = k;
      c.predicted = model_->predict(n, spec, s, k, ranks, threads);
      if (auto m = measured_.find({n, plan_key(c.plan)}); m != measured_.end()) {
        c.measured = m->second;
      }
      d.ranked.push_back(std::move(c));
    }
  };
  consider("none", Strategy::kRaw, false);
  for (const auto& spec : allowed_) {
    const CodecCosts& k = *model_->calibration().find(spec);
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
  // Measured K of a codec and strategy correct the predictions of its other K (geometric mean
  // of the measured / predicted ratios).
  std::map<std::string, std::pair<double, int>> family;
  auto family_of = [](const TensorPlan& p) {
    return fmt::format("{}/{}", p.codec, to_string(p.strategy));
  };
  for (const auto& c : d.ranked) {
    if (!c.measured || c.predicted.seconds <= 0) continue;
    auto& [log_sum, count] = family[family_of(c.plan)];
    log_sum += std::log(*c.measured / c.predicted.seconds);
    ++count;
  }
  for (auto& c : d.ranked) {
    auto it = family.find(family_of(c.plan));
    if (!c.measured && it != family.end()) {
      c.correction = std::exp(it->second.first / it->second.second);
    }
  }
  if (d.ranked.empty()) {
    throw InvalidArgument(
        fmt::format("planner: no allowed codec can use strategy {}", to_string(strategy)));
  }
  // Stable: equal times keep the order above (raw first, then the allowed list's order).
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
    const bool small =
        n * sizeof(float) <= options_.raw_below_bytes && ranks <= options_.small_tensor_max_ranks;
    small_raw = small && raw->predicted.network - best <= options_.small_tensor_slack;
    if (best > (1 - options_.min_gain) * d.raw_seconds || small_raw) d.chosen = *raw;
  }
  // What exploration would run: the choice, then what the model cannot tell from it. A small
  // tensor kept raw for its precision has nothing to explore (its K barely matter, and in a
  // group it travels fused, where no time of its own is measured).
  d.contenders.push_back(d.chosen);
  const double limit = options_.explore_within * PlanDecision::expected(d.chosen);
  for (const auto& c : d.ranked) {
    if (small_raw || static_cast<int>(d.contenders.size()) >= options_.explore_candidates) break;
    if (plan_key(c.plan) == plan_key(d.chosen.plan) || PlanDecision::expected(c) > limit) {
      continue;
    }
    d.contenders.push_back(c);
  }
  // The best plan of each allowed codec the list above left out, where exploring it is cheap:
  // at small sizes the model's error is largest (a link's buffers let a short message through
  // faster than its rate, which the model does not see: at 1 Gbit/s, N = 2, 64 KiB, fp16 ran
  // at 0.42x its prediction and onebit at 1.2x), and the top few are all one codec's K and
  // strategies, so no other codec is measured. Taken when expected within explore_codec_within
  // times the choice and its runs cost at most explore_seconds more than the choice's would.
  const double chosen = PlanDecision::expected(d.chosen);
  auto cheap = [&](const PlanCandidate& c) {
    const double t = PlanDecision::expected(c);
    return t <= options_.explore_codec_within * chosen &&
           runs_for(c) * (t - chosen) <= options_.explore_seconds;
  };
  if (!small_raw && options_.explore_codec_within > 0) {
    std::set<std::string> codecs;
    for (const auto& c : d.contenders) codecs.insert(c.plan.codec);
    for (const auto& c : d.ranked) {  // fastest expected first: a codec's first is its best
      if (c.plan.strategy == Strategy::kRaw || !codecs.insert(c.plan.codec).second) continue;
      if (cheap(c)) d.contenders.push_back(c);
    }
  }
  // Each explored codec at the far end of the K range too: the model's slope over K is its
  // least reliable part (how much of a partition's repeated passes stay in a core's cache, which
  // the fits over whole tensors do not see: on a guest with 4 MiB of L2 a core, unshaped N = 3,
  // 16 MiB, sharded onebit ran 16.4 ms at K = 1 and 12.5 at K = 16 where the model predicted
  // 14.9 and 17.1, and fp16's K barely mattered), so where a codec's contenders all sit at one
  // end, its best (the first listed) is measured at the other end as well, under the same
  // cheapness test as the codec's best plan above.
  if (!small_raw && options_.explore_far_partitions && options_.explore_codec_within > 0 &&
      ks.size() > 1) {
    const auto [lo, hi] = std::minmax_element(ks.begin(), ks.end());
    std::set<std::string> codecs;
    const std::size_t listed = d.contenders.size();
    for (std::size_t i = 0; i < listed; ++i) {
      const TensorPlan p = d.contenders[i].plan;  // a copy: the loop below appends
      if (p.strategy == Strategy::kRaw || !codecs.insert(p.codec).second) continue;
      // The end farther from p's K in factors of two (the larger on a tie).
      const int far =
          static_cast<double>(*hi) / p.partitions >= static_cast<double>(p.partitions) / *lo ? *hi
                                                                                             : *lo;
      if (far == p.partitions) continue;
      auto there = [&](const PlanCandidate& c) {
        return c.plan.codec == p.codec && c.plan.strategy == p.strategy && c.plan.partitions == far;
      };
      const auto c = std::find_if(d.ranked.begin(), d.ranked.end(), there);
      if (c != d.ranked.end() && cheap(*c) &&
          std::none_of(d.contenders.begin(), d.contenders.end(), there)) {
        d.contenders.push_back(*c);
      }
    }
  }
  // Raw as the baseline: a compressed choice whose margin over the best raw plan is within the
  // model's error is measured against that raw plan too, so that do-no-harm (a compressed plan
  // must beat raw by min_gain) is decided on measured times, not on predictions alone.
  if (raw != nullptr && d.chosen.plan.strategy != Strategy::kRaw &&
      PlanDecision::expected(*raw) <=
          options_.explore_raw_within * PlanDecision::expected(d.chosen)) {
    const bool listed = std::any_of(d.contenders.begin(), d.contenders.end(), [](const auto& c) {
      return c.plan.strategy == Strategy::kRaw;
    });
    if (!listed) d.contenders.push_back(*raw);
  }
  return d;
}

void Planner::log_decision(const PlanDecision& d, int rank, const char* why) const {
  if (!options_.log || rank != 0) return;
  const auto& c = d.chosen;
  std::fprintf(stderr,
               "terse plan: %s %zu floats -> %s, strategy %s, K=%d: %s %.3f ms (raw %.3f ms, "
               "%.2fx)\n",
               why, d.elements, c.plan.codec.c_str(),
               std::string(to_string(c.plan.strategy)).c_str(), c.plan.partitions,
               c.measured ? "measured" : "predicted", PlanDecision::expected(c) * 1e3,
               d.raw_seconds * 1e3,
               PlanDecision::expected(c) > 0 ? d.raw_seconds / PlanDecision::expected(c) : 0.0);
}

TensorPlan Planner::plan(Communicator& comm, std::size_t n, int threads, Strategy strategy,
                         int partitions) {
  ensure_calibrated(comm);
  const Key key{n, threads, strategy, partitions};
  {
    std::lock_guard lock(mu_);
    auto it = decisions_.find(key);
    if (it != decisions_.end()) return it->second.chosen.plan;
  }
  PlanDecision d = decide(n, comm.size(), threads, strategy, partitions);
  log_decision(d, comm.rank(), "plan");
  std::lock_guard lock(mu_);
  if (d.contenders.size() > 1 && options_.explore_candidates > 1 && options_.explore_runs > 0) {
    // This submission is the first use of the first contender, which is the choice.
    Exploration e;
    e.contenders = d.contenders;
    e.uses.assign(e.contenders.size(), 0);
    e.uses[0] = 1;
    e.start_pass(options_.explore_shuffle, 1);
    for (const auto& c : e.contenders) e.runs.push_back(runs_for(c));
    e.variance.assign(e.contenders.size(), 0.0);
    e.rounds.assign(e.contenders.size(), 0);
    exploring_[key] = std::move(e);
    if (options_.log && comm.rank() == 0) {
      std::string list;
      for (const auto& c : d.contenders) {
        list += fmt::format(" {} ({} runs)", plan_key(c.plan), runs_for(c));
      }
      std::fprintf(stderr, "terse plan: exploring %zu floats:%s\n", n, list.c_str());
    }
  }
  return decisions_.insert_or_assign(key, std::move(d)).first->second.chosen.plan;
}

bool Planner::exploring(std::size_t n, int threads, Strategy strategy, int partitions) const {
  std::lock_guard lock(mu_);
  return exploring_.count(Key{n, threads, strategy, partitions}) > 0;
}

int Planner::runs_for(const PlanCandidate& c) const {
  const int least = std::max(options_.explore_runs, 1);
  const double expected = PlanDecision::expected(c);
  if (options_.explore_seconds <= 0 || expected <= 0) return least;
  const double wanted = std::ceil(options_.explore_seconds / expected);
  return static_cast<int>(
      std::clamp<double>(wanted, least, std::max(least, options_.explore_max_runs)));
}

int Planner::runs_again(const PlanCandidate& c, double seconds) const {
  const int first = runs_for(c);
  if (options_.explore_again_seconds <= 0 || seconds <= 0) return first;
  const double wanted = std::ceil(options_.explore_again_seconds / seconds);
  return static_cast<int>(
      std::clamp<double>(wanted, first, std::max(first, options_.explore_max_runs)));
}

namespace {

// The fastest measured of `contenders` (the first listed among equal times) and its index;
// no time where none is measured.
template <typename Measured>
std::pair<std::optional<double>, std::size_t> fastest_measured(
    const std::vector<PlanCandidate>& contenders, const Measured& measured) {
  std::optional<double> fastest;
  std::size_t first = 0;
  for (std::size_t i = 0; i < contenders.size(); ++i) {
    const auto t = measured(contenders[i]);
    if (t && (!fastest || *t < *fastest)) fastest = t, first = i;
  }
  return {fastest, first};
}

}  // namespace

bool Planner::Exploration::has(const std::string& key) const {
  return std::any_of(contenders.begin(), contenders.end(),
                     [&](const PlanCandidate& c) { return plan_key(c.plan) == key; });
}

void Planner::Exploration::join(const PlanCandidate& c, int runs, std::vector<int>& again) {
  contenders.push_back(c);
  variance.push_back(0);
  rounds.push_back(0);
  again.push_back(runs);
}

void Planner::Exploration::start_pass(bool shuffle, std::size_t kept) {
  order.resize(contenders.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  next = std::min(kept, order.size());
  ++passes;
  if (!shuffle) return;
  // Fisher-Yates by the generator's raw output (std::shuffle's use of it is the library's own,
  // and ranks must agree).
  std::mt19937_64 gen(passes);
  for (std::size_t j = order.size(); j > next + 1; --j) {
    std::swap(order[j - 1], order[next + gen() % (j - next)]);
  }
}

std::optional<std::size_t> Planner::Exploration::next_with_runs(bool shuffle) {
  if (done()) return std::nullopt;
  for (;;) {  // a new pass has one: not done
    while (next < order.size()) {
      const std::size_t i = order[next++];
      if (uses[i] < runs[i]) return i;
    }
    start_pass(shuffle, 0);
  }
}

template <typename Measured>
bool Planner::start_second_round(Exploration& e, PlanDecision& d, const Measured& measured,
                                 std::size_t n, int rank) const {
  if (options_.explore_close <= 0) return false;
  const auto [fastest, first] = fastest_measured(e.contenders, measured);
  if (!fastest) return false;
  std::vector<int> again(e.contenders.size(), 0);
  std::string list;
  int close = 0;
  for (std::size_t i = 0; i < e.contenders.size(); ++i) {
    const auto t = measured(e.contenders[i]);
    if (!t || *t > (1 + options_.explore_close) * *fastest) continue;
    again[i] = runs_again(e.contenders[i], *t);
    ++close;
    list += fmt::format(" {} {:.3f} ms", plan_key(e.contenders[i].plan), *t * 1e3);
  }
  // The fastest one's neighbours in K join this round (explore_neighbours).
  if (options_.explore_neighbours) close += add_k_neighbours(e, d, first, *fastest, again, list);
  // And the close ones' codecs and strategies at their other K.
  if (options_.explore_family_seconds > 0) {
    close += add_close_families(e, d, measured, *fastest, again, list);
  }
  if (close < 2) return false;
  e.start_round(std::move(again));
  e.round = 2;
  if (options_.log && rank == 0) {
    std::fprintf(stderr, "terse plan: exploring %zu floats again, within %.0f%%:%s\n", n,
                 options_.explore_close * 100, list.c_str());
  }
  return true;
}

int Planner::add_k_neighbours(Exploration& e, PlanDecision& d, std::size_t first, double fastest,
                              std::vector<int>& again, std::string& list) const {
  // The next smaller and the next larger K of the fastest one's codec and strategy, where no
  // contender has them and they are expected within explore_within of its measured time: the
  // model's slope over K is its least reliable part, so the best K measured may sit next to a
  // better one never run (unshaped N = 4, 16 MiB: sharded onebit K = 4 measured fastest among
  // K = 1, 2, 4 and 16; K = 8 was 8-12% faster re-timed).
  const TensorPlan best = e.contenders[first].plan;  // a copy: contenders grow below
  auto same_family = [&](const TensorPlan& p) {
    return p.codec == best.codec && p.strategy == best.strategy;
  };
  const PlanCandidate* below = nullptr;
  const PlanCandidate* above = nullptr;
  for (const auto& c : d.ranked) {
    if (!same_family(c.plan)) continue;
    const int k = c.plan.partitions;
    if (k < best.partitions && (below == nullptr || k > below->plan.partitions)) below = &c;
    if (k > best.partitions && (above == nullptr || k < above->plan.partitions)) above = &c;
  }
  int added = 0;
  for (const PlanCandidate* c : {below, above}) {  // into d.ranked, which does not grow
    if (c == nullptr || PlanDecision::expected(*c) > options_.explore_within * fastest) continue;
    const std::string key = plan_key(c->plan);
    if (e.has(key)) continue;
    e.join(*c, runs_again(*c, PlanDecision::expected(*c)), again);
    d.contenders.push_back(*c);
    ++added;
    list += fmt::format(" {} (K next to the fastest)", key);
  }
  return added;
}

template <typename Measured>
int Planner::add_close_families(Exploration& e, PlanDecision& d, const Measured& measured,
                                double fastest, std::vector<int>& again, std::string& list) const {
  // Each codec and strategy with a contender measured within explore_close of the fastest:
  // its fastest measured time and that contender's K, fastest first.
  // (Copies of the plans: the contenders grow below.)
  struct Family {
    double seconds;
    TensorPlan plan;
  };
  std::vector<Family> families;
  for (const auto& c : e.contenders) {
    const auto t = measured(c);
    if (!t || *t > (1 + options_.explore_close) * fastest) continue;
    const auto f = std::find_if(families.begin(), families.end(), [&](const Family& x) {
      return x.plan.codec == c.plan.codec && x.plan.strategy == c.plan.strategy;
    });
    if (f == families.end()) {
      families.push_back({*t, c.plan});
    } else if (*t < f->seconds) {
      *f = {*t, c.plan};
    }
  }
  std::stable_sort(families.begin(), families.end(),
                   [](const Family& a, const Family& b) { return a.seconds < b.seconds; });
  double budget = options_.explore_family_seconds;
  int added = 0;
  for (const Family& family : families) {
    const TensorPlan& best = family.plan;  // clang 14 lets no lambda capture a structured binding
    // The family's other K expected within explore_within of the fastest, nearest (in factors
    // of two) to its fastest K first, the smaller first on a tie.
    std::vector<const PlanCandidate*> ks;  // into d.ranked, which does not grow
    for (const auto& c : d.ranked) {
      if (c.plan.codec != best.codec || c.plan.strategy != best.strategy ||
          PlanDecision::expected(c) > options_.explore_within * fastest ||
          e.has(plan_key(c.plan))) {
        continue;
      }
      ks.push_back(&c);
    }
    auto distance = [&](const PlanCandidate* c) {
      return std::abs(std::log2(static_cast<double>(c->plan.partitions) / best.partitions));
    };
    std::stable_sort(ks.begin(), ks.end(), [&](const PlanCandidate* a, const PlanCandidate* b) {
      return std::make_pair(distance(a), a->plan.partitions) <
             std::make_pair(distance(b), b->plan.partitions);
    });
    for (const PlanCandidate* c : ks) {
      if (added >= options_.explore_candidates) return added;
      const int runs = runs_again(*c, PlanDecision::expected(*c));
      const double cost = runs * PlanDecision::expected(*c);
      if (cost > budget) continue;
      budget -= cost;
      e.join(*c, runs, again);
      d.contenders.push_back(*c);
      ++added;
      list += fmt::format(" {} (K of a close one)", plan_key(c->plan));
    }
  }
  return added;
}

template <typename Measured>
bool Planner::start_neighbour_round(Exploration& e, PlanDecision& d, const Measured& measured,
                                    std::size_t n, int rank) const {
  if (!options_.explore_neighbours || e.climbs >= options_.explore_neighbour_rounds) return false;
  const auto [fastest, first] = fastest_measured(e.contenders, measured);
  if (!fastest) return false;
  std::vector<int> again(e.contenders.size(), 0);
  std::string list =
      fmt::format(" {} {:.3f} ms", plan_key(e.contenders[first].plan), *fastest * 1e3);
  if (add_k_neighbours(e, d, first, *fastest, again, list) == 0) return false;
  again[first] = runs_again(e.contenders[first], *fastest);
  e.start_round(std::move(again));
  ++e.round;
  ++e.climbs;
  if (options_.log && rank == 0) {
    std::fprintf(stderr,
                 "terse plan: exploring %zu floats again (round %d), K next to the fastest:%s\n", n,
                 e.round, list.c_str());
  }
  return true;
}

template <typename Measured>
bool Planner::start_tie_round(Exploration& e, const Measured& measured, std::size_t n,
                              int rank) const {
  if (options_.explore_tie_rounds <= 0 || e.ties >= options_.explore_tie_rounds) {
    return false;
  }
  // The two fastest by their fitted times (the first listed among equal times).
  std::vector<std::pair<double, std::size_t>> timed;
  for (std::size_t i = 0; i < e.contenders.size(); ++i) {
    if (const auto t = measured(e.contenders[i])) timed.emplace_back(*t, i);
  }
  if (timed.size() < 2) return false;
  std::partial_sort(timed.begin(), timed.begin() + 2, timed.end());
  const auto [ta, a] = timed[0];
  const auto [tb, b] = timed[1];
  // The standard error of a time over rounds, taken as a mean's: the rounds' medians' errors
  // added in quadrature, over the number of rounds; of the gap: both added in quadrature.
  auto error = [&](std::size_t i) {
    return e.rounds[i] > 0 ? std::sqrt(e.variance[i]) / e.rounds[i] : 0.0;
  };
  const double noise =
      options_.explore_tie_noise * std::sqrt(error(a) * error(a) + error(b) * error(b));
  if (tb - ta > std::max(options_.explore_tie * ta, noise)) return false;
  std::vector<int> again(e.contenders.size(), 0);
  again[a] = runs_again(e.contenders[a], ta);
  again[b] = runs_again(e.contenders[b], tb);
  if (again[a] * ta + again[b] * tb > options_.explore_tie_seconds) return false;
  e.start_round(std::move(again));
  ++e.round;
  ++e.ties;
  if (options_.log && rank == 0) {
    std::fprintf(stderr,
                 "terse plan: exploring %zu floats again (round %d), within %.0f%% or %.1f "
                 "standard errors (%.3f ms): %s %.3f ms %s %.3f ms\n",
                 n, e.round, options_.explore_tie * 100, options_.explore_tie_noise, noise * 1e3,
                 plan_key(e.contenders[a].plan).c_str(), ta * 1e3,
                 plan_key(e.contenders[b].plan).c_str(), tb * 1e3);
  }
  return true;
}

int Planner::advance_explorations(int rank) {
  int changed = 0;
  for (auto it = exploring_.begin(); it != exploring_.end();) {
    Exploration& e = it->second;
    if (!e.done()) {
      ++it;
      continue;
    }
    const std::size_t n = it->first.n;
    auto measured = [&](const PlanCandidate& c) -> std::optional<double> {
      auto m = measured_.find({n, plan_key(c.plan)});
      return m == measured_.end() ? std::nullopt : std::optional<double>(m->second);
    };
    // A contender that ran its runs without a time reaching the exchange (it travelled fused,
    // say) gets one more run; after that it is not waited for. (One sitting this round out is
    // not waited for either.)
    bool missing = false;
    for (std::size_t i = 0; i < e.contenders.size(); ++i) {
      if (e.runs[i] > 0 && !measured(e.contenders[i])) {
        missing = true;
        e.runs[i] = e.uses[i] + 1;
      }
    }
    if (missing && ++e.unmeasured < 2) {
      ++it;
      continue;
    }
    // Each contender's time: fitted over the rounds it ran, each round's conditions taken out
    // (planner::fit_rounds), under round 1's, in which all ran. (One that ran without a time
    // this round counts with its time so far: measured_ still holds it.) A plain mean of its
    // rounds, as until stop 50, favoured the contenders of the later rounds, which have fewer
    // contenders and run faster.
    std::vector<double> row(e.contenders.size(), 0.0);
    for (std::size_t i = 0; i < e.contenders.size(); ++i) {
      const auto t = measured(e.contenders[i]);
      if (e.runs[i] == 0 || !t) continue;
      row[i] = *t;
      const auto err = measured_error_.find({n, plan_key(e.contenders[i].plan)});
      if (err != measured_error_.end()) e.variance[i] += err->second * err->second;
      ++e.rounds[i];
    }
    e.medians.push_back(std::move(row));
    const std::vector<double> fitted = planner::fit_rounds(e.medians, e.contenders.size());
    for (std::size_t i = 0; i < e.contenders.size(); ++i) {
      if (e.rounds[i] > 0) measured_[{n, plan_key(e.contenders[i].plan)}] = fitted[i];
    }
    if (e.round == 1 ? start_second_round(e, decisions_.at(it->first), measured, n, rank)
                     : start_neighbour_round(e, decisions_.at(it->first), measured, n, rank) ||
                           start_tie_round(e, measured, n, rank)) {
      ++it;
      continue;
    }
    PlanDecision& d = decisions_.at(it->first);
    // Settle: the fastest measured. The model's choice stands unless measured times overturn
    // it by explore_displace (unmeasured, it stands), and a compressed plan must beat the raw
    // ones measured by min_gain, as predicted ones must.
    const PlanCandidate* best = &e.contenders.front();
    if (auto first = measured(*best)) {
      double best_time = *first;
      const PlanCandidate* raw = nullptr;
      double raw_time = 0;
      for (const auto& c : e.contenders) {
        const auto t = measured(c);
        if (!t) continue;
        if (*t < best_time) best = &c, best_time = *t;
        if (c.plan.strategy == Strategy::kRaw && (raw == nullptr || *t < raw_time)) {
          raw = &c, raw_time = *t;
        }
      }
      // A gap smaller than explore_displace is no verdict against the model's choice.
      if (best_time > (1 - options_.explore_displace) * *first) {
        best = &e.contenders.front(), best_time = *first;
      }
      if (raw != nullptr && best->plan.strategy != Strategy::kRaw &&
          best_time > (1 - options_.min_gain) * raw_time) {
        best = raw;
      }
    }
    const std::string before = plan_key(d.chosen.plan);
    d.chosen = *best;
    d.chosen.measured = measured(*best);
    changed += plan_key(d.chosen.plan) != before;
    if (options_.log && rank == 0) {
      std::string list;
      for (const auto& c : e.contenders) {
        const auto t = measured(c);
        list += t ? fmt::format(" {} {:.3f} ms", plan_key(c.plan), *t * 1e3)
                  : fmt::format(" {} unmeasured", plan_key(c.plan));
      }
      std::fprintf(stderr, "terse plan: explored %zu floats, measured:%s\n", n, list.c_str());
    }
    log_decision(d, rank, "explored");
    it = exploring_.erase(it);
  }
  return changed;
}

void Planner::observe(std::size_t n, const TensorPlan& plan, double seconds) {
  std::lock_guard lock(mu_);
  auto& v = observed_[{n, plan_key(plan)}];
  if (v.size() < kMaxObservations) v.push_back(seconds);
}

int Planner::before_submission(Communicator& comm, std::span<const Use> uses) {
  std::string mine;
  bool recheck = false;
  // Once the exchange (if any) has settled what it could: each size still explored that this
  // submission uses runs its next contender that has runs left (the same for all of the
  // submission's tensors of that size), and that contender's uses count them.
  auto count_uses = [&] {
    std::map<Key, int> count;
    for (const auto& u : uses) {
      const Key key{u.n, u.threads, u.strategy, u.partitions};
      if (exploring_.count(key) > 0) ++count[key];
    }
    int switched = 0;
    for (const auto& [key, k] : count) {
      Exploration& e = exploring_.at(key);
      if (const auto i = e.next_with_runs(options_.explore_shuffle)) {
        PlanDecision& d = decisions_.at(key);
        switched += plan_key(d.chosen.plan) != plan_key(e.contenders[*i].plan);
        d.chosen = e.contenders[*i];
        e.current = *i;
      }
      e.uses[e.current] += k;
    }
    return switched;
  };
  {
    std::lock_guard lock(mu_);
    ++submissions_;
    recheck = options_.recheck_interval > 0 &&
                         submissions_ % static_cast<std::uint64_t>(options_.recheck_interval) == 0;
    const bool explore = std::any_of(exploring_.begin(), exploring_.end(),
                                     [&](const auto& e) { return e.second.done(); });
    if (!model_ || !(recheck || explore)) return count_uses();
    for (const auto& [key, samples] : observed_) {
      mine += fmt::format("{} {}", key.first, key.second);
      for (const double seconds : samples) mine += fmt::format(" {:.9e}", seconds);
      mine += '\n';
    }
    observed_.clear();
  }
  // Agreed measured time per (size, plan): per run the largest over ranks (a collective
  // completes when its slowest rank does), then the median over runs. The ranks' runs of a
  // size are the same submissions in the same order, so their i-th observations are one run.
  // (A median per rank and then the largest over ranks, as before stop 44, ranks a plan whose
  // ranks take turns being slow by its ranks' typical times, not by the runs' times.)
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
  std::map<std::pair<std::size_t, std::string>, double> agreed, error;
  for (const auto& [key, runs] : slowest) {
    if (runs.empty()) continue;
    agreed[key] = planner::median(runs);
    error[key] = planner::median_standard_error(runs);
  }
  std::vector<PlanDecision> replanned;
  int explored = 0;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, seconds] : agreed) measured_[key] = seconds;
    for (const auto& [key, e] : error) measured_error_[key] = e;
    explored = advance_explorations(comm.rank());
    // Re-checks at their own interval only: an exchange for exploration holds a few runs.
    for (auto it = decisions_.begin(); it != decisions_.end();) {
      if (!recheck || exploring_.count(it->first) > 0) {
        ++it;
        continue;
      }
      const PlanCandidate& c = it->second.chosen;
      auto m = agreed.find({it->first.n, plan_key(c.plan)});
      const double expected = PlanDecision::expected(c);
      if (m != agreed.end() && expected > 0 &&
          std::abs(m->second / expected - 1) > options_.recheck_threshold) {
        replanned.push_back(it->second);
        it = decisions_.erase(it);
      } else {
        ++it;
      }
    }
    explored += count_uses();
  }
  for (const auto& d : replanned) {
    if (options_.log && comm.rank() == 0) {
      const double m = agreed.at({d.elements, plan_key(d.chosen.plan)});
      std::fprintf(stderr,
                   "terse plan: re-check: %zu floats with %s took %.3f ms, expected %.3f ms: "
                   "re-planning\n",
                   d.elements, plan_key(d.chosen.plan).c_str(), m * 1e3,
                   PlanDecision::expected(d.chosen) * 1e3);
    }
  }
  return explored + static_cast<int>(replanned.size());
}

}  // namespace terse
