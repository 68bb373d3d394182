#include "engine/plans.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

#include "engine/allreduce_probe.h"
#include "planner/planner_impl.h"
#include "planner/protocol.h"
#include "terse/error.h"
#include "terse/spec.h"

namespace terse::engine {

namespace {

// `spec` with its `rows` parameter set to `rows`, where it has one (a matrix codec's view); other
// specs as they are. With only_default, a rows= already chosen (not 0) stays.
std::string with_rows(const std::string& spec, std::size_t rows, bool only_default) {
  const Spec s = Spec::parse(spec);
  const auto at = s.params().find("rows");
  if (at == s.params().end() || (only_default && at->second != "0")) return spec;
  std::string out = s.name();
  char sep = ':';
  for (const auto& [key, value] : s.params()) {
    out += fmt::format("{}{}={}", sep, key, key == "rows" ? std::to_string(rows) : value);
    sep = ',';
  }
  return out;
}

}  // namespace

Strategy auto_strategy(const Codec& c) {
  const CodecTraits t = c.traits();
  // A codec with feedback state of its own (DGC's momentum and velocity) encodes each rank's
  // gradient once and the ranks gather the payloads, as its paper does: under sharded, a
  // shard's owner would feed the average through that state again (DGC's momentum twice).
  return c.name() == "none"             ? Strategy::kRaw
         : t.summable || t.multi_round ? Strategy::kSummable
         : t.builtin_feedback          ? Strategy::kAllgather
                                       : Strategy::kSharded;
}

bool TensorRecord::verified_for(const std::string& c) const {
  if (c == config) return verified;
  auto p = parked.find(c);
  return p != parked.end() && p->second.verified;
}

void TensorRecord::use(const std::string& c, bool keep) {
  if (c != config) {
    ConfigState& current = *this;
    if (keep && !config.empty()) parked[config] = std::move(current);
    ConfigState next;
    if (auto p = parked.find(c); p != parked.end()) {
      next = std::move(p->second);
      parked.erase(p);
    }
    config = c;
    current = std::move(next);
  }
  if (!keep) parked.clear();
}

Plans::Plans(Communicator& comm, const EngineOptions& options,
             const transport::Topology& topology, int threads, std::function<void()> drain)
    : comm_(comm),
      options_(options),
      topology_(topology),
      threads_(threads),
      drain_(std::move(drain)) {}

const Codec& Plans::codec(const std::string& spec) const {
  std::lock_guard lock(codecs_mu_);
  auto it = codecs_.find(spec);
  if (it != codecs_.end()) return *it->second;
  auto& slot = codecs_[spec];
  slot = make_codec(spec);
  return *slot;
}

TensorPlan Plans::plan(std::size_t n, const AllreduceOptions& o, const Codec** codec_out,
                       DType dtype) const {
  if (const auto tier = auto_tier(o.codec)) return plan_auto(n, o, *tier, codec_out, dtype);
  if (dtype != DType::kFloat32 && codec(o.codec).name() == "none" &&
      (o.strategy == Strategy::kAuto || o.strategy == Strategy::kRaw)) {
    // Raw on a half tensor sends the tensor's own precision (see Engine::allreduce).
    AllreduceOptions own = o;
    own.codec = dtype == DType::kFloat16 ? "fp16" : "bf16";
    own.strategy = Strategy::kSummable;
    return plan(n, own, codec_out, dtype);
  }
  TensorPlan p;
  const Codec& c = codec(o.codec);
  const CodecTraits t = c.traits();
  p.codec = c.spec();
  const bool identity = c.name() == "none";
  p.strategy = o.strategy == Strategy::kAuto ? auto_strategy(c) : o.strategy;
  if (p.strategy == Strategy::kAllToAll) {
    throw InvalidArgument("strategy alltoall reduces a reduce_scatter or all_to_all, not an "
                          "allreduce; use allgather, sharded, ring or summable");
  }
  if (p.strategy == Strategy::kRaw && !identity) {
    throw InvalidArgument(fmt::format("strategy raw sends fp32 and cannot use codec {}; use "
                                      "allgather, sharded, ring or summable",
                                      p.codec));
  }
  if (p.strategy == Strategy::kSummable && !t.summable && !t.multi_round) {
    throw InvalidArgument(fmt::format("strategy summable needs a codec whose encodings add "
                                      "(fp16, bf16, randomk, powersgd); {} is not summable",
                                      p.codec));
  }
  if (t.multi_round && p.strategy != Strategy::kSummable && p.strategy != Strategy::kAllgather) {
    throw InvalidArgument(fmt::format("codec {} needs sums across ranks between its rounds: "
                                      "use strategy summable (rings) or allgather (or auto)",
                                      p.codec));
  }
  if (o.partitions < 0 || o.partitions > kMaxPartitions) {
    throw InvalidArgument(
        fmt::format("partitions={} is not in 0..{}", o.partitions, kMaxPartitions));
  }
  std::size_t k = o.partitions;
  if (k == 0) k = (n * sizeof(float) + options_.partition_bytes - 1) / options_.partition_bytes;
  if (t.multi_round) {
    if (o.partitions > 1) {
      throw InvalidArgument(fmt::format("codec {} compresses the whole matrix: partitions must "
                                        "be 1 (or 0)",
                                        p.codec));
    }
    k = 1;
  }
  // Partition boundaries fall on multiples of 64 elements: more partitions would be empty.
  k = std::clamp<std::size_t>(k, 1, std::max<std::size_t>(1, (n + 63) / 64));
  k = std::min<std::size_t>(k, kMaxPartitions);
  p.partitions = static_cast<int>(k);
  switch (o.hierarchy) {
    case Hierarchy::kFlat: p.hierarchical = false; break;
    case Hierarchy::kHosts: p.hierarchical = true; break;
    case Hierarchy::kAuto:
      // Two levels pay where a host's link would carry several ranks' traffic, for partitions
      // whose bytes outweigh the extra message steps (those the engine gathers do not).
      p.hierarchical = topology_.two_level() &&
                       !collectives::gathers((n + k - 1) / k, comm_.size(), options_.gather_bytes);
      break;
  }
  if (codec_out != nullptr) *codec_out = &c;
  return p;
}

TensorPlan Plans::plan_collective(Operation op, const std::string& name, std::size_t shard,
                                  std::size_t total, const CollectiveOptions& o,
                                  const Codec** codec_out, DType dtype) const {
  const std::string_view what = to_string(op);
  auto refuse = [&](const std::string& why) {
    return InvalidArgument(fmt::format("rank {}: {} of tensor '{}': {}", comm_.rank(), what, name,
                                       why));
  };
  if (const auto tier = auto_tier(o.codec)) {
    if (op == Operation::kAllToAll) {
      throw refuse(fmt::format("codec {} is not supported for all_to_all (the planner prices "
                               "allreduce, reduce_scatter and all_gather); name a codec",
                               o.codec));
    }
    // A restriction the operation has no strategy for is refused as a fixed codec's would be.
    if (op == Operation::kReduceScatter && o.strategy == Strategy::kAllgather) {
      throw refuse(
          "strategy allgather has no reduce-scatter; use raw (codec none), alltoall, "
          "sharded, ring or summable");
    }
    if (op == Operation::kAllGather && o.strategy != Strategy::kAuto &&
        o.strategy != Strategy::kRaw && o.strategy != Strategy::kAllgather) {
      throw refuse(fmt::format("strategy {} does not apply; use raw (codec none) or allgather",
                               to_string(o.strategy)));
    }
    if (o.partitions < 0 || o.partitions > kMaxPartitions) {
      throw refuse(fmt::format("partitions={} is not in 0..{}", o.partitions, kMaxPartitions));
    }
    CollectiveOptions chosen = o;
    chosen.codec = "none";
    if (total > 0) {  // an empty tensor has nothing to plan: raw
      TensorPlan decided;
      try {
        decided = decide_auto(use(total, o.strategy, o.partitions, *tier, op));
      } catch (const InvalidArgument& e) {
        throw refuse(e.what());  // a restriction no allowed codec can use
      }
      chosen.codec = decided.codec;
      chosen.strategy = decided.strategy;
      chosen.partitions = decided.partitions;
    }
    return plan_collective(op, name, shard, total, chosen, codec_out, dtype);
  }
  const Codec& c = codec(o.codec);
  const CodecTraits t = c.traits();
  const bool identity = c.name() == "none";
  if (t.multi_round) {
    throw refuse(fmt::format("codec {} compresses a whole matrix over rounds of sums; no shard "
                             "or block of it can be sent alone",
                             c.spec()));
  }
  TensorPlan p;
  p.codec = c.spec();
  p.strategy = o.strategy;
  std::string allowed;
  switch (op) {
    case Operation::kReduceScatter:
      if (p.strategy == Strategy::kAuto) p.strategy = identity ? Strategy::kRaw : Strategy::kAllToAll;
      allowed = "raw (codec none), alltoall, sharded, ring or summable";
      if (p.strategy == Strategy::kAllgather || p.strategy == Strategy::kAuto) {
        throw refuse(fmt::format("strategy {} has no reduce-scatter; use {}",
                                 to_string(p.strategy), allowed));
      }
      if (p.strategy == Strategy::kSummable && !t.summable) {
        throw refuse(fmt::format("strategy summable needs a codec whose encodings add (fp16, "
                                 "bf16, randomk); {} is not summable",
                                 p.codec));
      }
      if (dtype != DType::kFloat32 && identity &&
          (o.strategy == Strategy::kAuto || o.strategy == Strategy::kRaw)) {
        // Raw on a half tensor sends its own precision, as an allreduce does: each value sent
        // exactly in its format, summed in fp32 in rank order by the owner, rounded once.
        CollectiveOptions own = o;
        own.codec = dtype == DType::kFloat16 ? "fp16" : "bf16";
        own.strategy = Strategy::kAllToAll;
        return plan_collective(op, name, shard, total, own, codec_out, dtype);
      }
      break;
    case Operation::kAllGather:
    case Operation::kAllToAll: {
      const Strategy compressed =
          op == Operation::kAllGather ? Strategy::kAllgather : Strategy::kAllToAll;
      if (p.strategy == Strategy::kAuto) p.strategy = identity ? Strategy::kRaw : compressed;
      if (p.strategy != Strategy::kRaw && p.strategy != compressed) {
        throw refuse(fmt::format("strategy {} does not apply; use raw (codec none) or {}",
                                 to_string(p.strategy), to_string(compressed)));
      }
      break;
    }
    case Operation::kAllreduce: throw refuse("not a collective of its own");
  }
  if (p.strategy == Strategy::kRaw && !identity) {
    throw refuse(fmt::format("strategy raw sends the values as they are and cannot use codec {}",
                             p.codec));
  }
  if (o.partitions < 0 || o.partitions > kMaxPartitions) {
    throw refuse(fmt::format("partitions={} is not in 0..{}", o.partitions, kMaxPartitions));
  }
  std::size_t k = o.partitions;
  if (k == 0) {
    k = op == Operation::kAllToAll
            ? 1
            : (total * sizeof(float) + options_.partition_bytes - 1) / options_.partition_bytes;
  }
  // Partition boundaries within a shard fall on multiples of 64 elements.
  if (op != Operation::kAllToAll) {
    k = std::clamp<std::size_t>(k, 1, std::max<std::size_t>(1, (shard + 63) / 64));
  }
  p.partitions = static_cast<int>(std::clamp<std::size_t>(k, 1, kMaxPartitions));
  p.hierarchical = hierarchical_collective(op, p, shard, o.hierarchy, refuse);
  if (codec_out != nullptr) *codec_out = &c;
  return p;
}

bool Plans::hierarchical_collective(
    Operation op, const TensorPlan& p, std::size_t shard, Hierarchy h,
    const std::function<InvalidArgument(const std::string&)>& refuse) const {
  if (h == Hierarchy::kFlat) return false;
  if (op == Operation::kAllToAll) {
    if (h == Hierarchy::kHosts) throw refuse("hierarchy hosts does not apply; all_to_all is flat");
    return false;
  }
  // sharded, ring and summable cross in groups of one rank per host, which hosts of unequal
  // size cannot form; raw, alltoall and the all-gather cross rank to rank on any layout.
  const bool grouped = op == Operation::kReduceScatter && p.strategy != Strategy::kRaw &&
                       p.strategy != Strategy::kAllToAll;
  if (grouped && !topology_.even()) {
    if (h == Hierarchy::kAuto) return false;
    throw refuse(fmt::format("strategy {} across hosts needs hosts of equal size ({}); use "
                             "alltoall or raw, or hierarchy flat",
                             to_string(p.strategy), topology_.describe()));
  }
  if (h == Hierarchy::kHosts) return true;
  // As for an allreduce: two levels pay where a host's link would carry several ranks' traffic,
  // for pieces whose bytes outweigh the extra message step (those the engine would gather raw
  // in one step do not).
  const std::size_t piece = (shard + p.partitions - 1) / p.partitions;
  return topology_.two_level() && !collectives::gathers(piece, comm_.size(), options_.gather_bytes);
}

// ---- codec "auto": the planner's choice (src/planner/) ---------------------------------------

Planner& Plans::planner() const {
  if (planner_) return *planner_;
  if (options_.planner) {
    planner_ = options_.planner;
  } else {
    planner_ = std::make_shared<Planner>(options_.planner_options);
  }
  // Calibration times allreduces through a probe engine of its own; the model prices this
  // engine's raw partitions as it sends them.
  PlannerAccess::set_allreduce_probe(*planner_, allreduce_probes(threads_));
  PlannerAccess::set_gather_bytes(*planner_, options_.gather_bytes);
  return *planner_;
}

planner::Use Plans::use(std::size_t n, Strategy strategy, int partitions, Tier tier, Operation op,
                        Hierarchy hierarchy) const {
  planner::Use u{n, threads_, strategy, partitions, tier, op, options_.partition_bytes};
  u.topology = &topology_;
  u.hierarchy = hierarchy;
  return u;
}

TensorPlan Plans::decide_auto(const planner::Use& u) const {
  Planner& p = planner();
  // Calibration measures the links: let submitted work finish first (every rank does).
  if (!p.calibrated()) drain_();
  return planner::plan(p, comm_, u);
}

TensorPlan Plans::plan_auto(std::size_t n, const AllreduceOptions& o, Tier tier,
                            const Codec** codec_out, DType dtype) const {
  if (o.rows > 0 && (o.rows > n || n % o.rows != 0)) {
    throw InvalidArgument(fmt::format("rows={} does not divide the tensor's {} elements into a "
                                      "matrix",
                                      o.rows, n));
  }
  AllreduceOptions chosen = o;
  const TensorPlan decided =
      decide_auto(use(n, o.strategy, o.partitions, tier, Operation::kAllreduce, o.hierarchy));
  // The planner priced a matrix codec's most nearly square view; the tensor's own is sent.
  chosen.codec = o.rows > 0 ? with_rows(decided.codec, o.rows, true) : decided.codec;
  chosen.strategy = decided.strategy;
  chosen.partitions = decided.partitions;
  // The planner priced both levels (or the one o.hierarchy allows): its choice, not the rule.
  chosen.hierarchy = decided.hierarchical ? Hierarchy::kHosts : Hierarchy::kFlat;
  return plan(n, chosen, codec_out, dtype);
}

void Plans::before_collective(Operation op, std::size_t total, const CollectiveOptions& o) {
  const auto tier = auto_tier(o.codec);
  if (!tier || op == Operation::kAllToAll || total == 0) return;
  const planner::Use u = use(total, o.strategy, o.partitions, *tier, op);
  planner::before_submission(planner(), comm_, std::span(&u, 1));
}

planner::Use Plans::use_of(const Item& it) const {
  const AllreduceOptions& o = it.ref.options;
  const Tier tier = auto_tier(o.codec).value_or(Tier::kLight);
  if (it.op == Operation::kAllreduce) {
    return use(it.ref.tensor.elements, o.strategy, o.partitions, tier, Operation::kAllreduce,
               o.hierarchy);
  }
  // A collective's size is the larger of input and output (N shards).
  return use(std::max(it.ref.tensor.elements, it.output.elements), o.strategy, o.partitions, tier,
             it.op);
}

void Plans::before_submission(const std::vector<TensorRef>& tensors) {
  std::vector<planner::Use> uses;
  for (const auto& t : tensors) {
    if (const auto tier = auto_tier(t.options.codec)) {
      uses.push_back(use(t.tensor.elements, t.options.strategy, t.options.partitions, *tier,
                         Operation::kAllreduce, t.options.hierarchy));
    }
  }
  if (!uses.empty()) planner::before_submission(planner(), comm_, uses);
}

// ---- records --------------------------------------------------------------------------------

bool Plans::needs_check(const std::string& name, const std::string& config) const {
  std::lock_guard lock(records_mu_);
  auto rec = records_.find(name);
  if (rec == records_.end()) return true;
  if (rec->second.in_flight) {
    // Records of other operations are keyed "op:name" (record_key).
    const auto colon = name.find(':');
    const bool other_op = colon != std::string::npos && rec->second.config.rfind(
                                                            name.substr(0, colon) + " of ", 0) == 0;
    throw InvalidArgument(fmt::format(
        "{}: tensor '{}' is already in flight; wait for its handle before submitting it again",
        other_op ? name.substr(0, colon) : std::string("allreduce"),
        other_op ? name.substr(colon + 1) : name));
  }
  return !rec->second.verified_for(config);
}

namespace {

// Whether two configurations ("N floats, codec SPEC, strategy S, K partitions, average") differ
// in the codec's spec alone: the same slots hold the same pieces of the tensor under both.
bool only_codec_differs(const std::string& a, const std::string& b) {
  if (a.empty() || a == b) return false;
  auto split = [](const std::string& c) {
    const auto at = c.find(", codec "), end = c.find(", strategy ");
    if (at == std::string::npos || end == std::string::npos || end < at) {
      return std::pair<std::string, std::string>{c, ""};
    }
    return std::pair{c.substr(0, at), c.substr(end)};
  };
  return split(a) == split(b) && !split(a).second.empty();
}

}  // namespace

void Plans::commit(Job& job) {
  // Which planned sizes are being explored, asked before records_mu_ is taken (a leaf).
  std::vector<char> exploring(job.items.size(), 0);
  for (std::size_t i = 0; i < job.items.size(); ++i) {
    if (!auto_tier(job.items[i].ref.options.codec)) continue;
    exploring[i] = planner::exploring(planner(), use_of(job.items[i]));
  }
  std::lock_guard lock(records_mu_);
  for (std::size_t i = 0; i < job.items.size(); ++i) {
    Item& it = job.items[i];
    const std::string config = config_of(it);
    TensorRecord& rec = records_[record_key(it)];
    // Another size or codec: its old state does not apply, unless exploration comes back to it,
    // or only the codec's spec changed (a ratio, a rank: Accordion's levels, a warm-up's
    // schedule): then what the new codec's state can take over (error-feedback residuals,
    // accumulators) carries over, and so does the step count.
    const bool keep = (rec.config != config || !rec.parked.empty()) && exploring[i];
    const bool carry = !keep && it.codec != nullptr && only_codec_differs(rec.config, config);
    std::vector<collectives::StateSlots> previous;
    const std::uint64_t previous_step = rec.step;
    if (carry) previous = std::move(rec.partitions);
    rec.use(config, keep);
    if (carry) {
      rec.partitions.resize(previous.size());
      for (std::size_t p = 0; p < previous.size(); ++p) {
        rec.partitions[p].adopt(*it.codec, previous[p]);
      }
      rec.step = previous_step;
    }
    rec.verified = true;
    rec.partitions.resize(it.plan.partitions);
    rec.in_flight = true;
    it.record = &rec;
    it.step = rec.step++;
  }
}

// Reports the measured time of every planned, unfused item of a successful job, except the
// first run of a tensor's configuration: it pays once for what later runs reuse (the
// cross-rank check, buffers, fresh codec state), which is no part of its steady cost.
void Plans::release(const Job& job, bool succeeded) {
  if (succeeded) {
    for (std::size_t i = 0; i < job.spans.size(); ++i) {
      const Item& it = job.items[i];
      // The planner's model prices fp32 tensors; half ones are not what it measured.
      if (!auto_tier(it.ref.options.codec) || it.plan.fused || it.step == 0 ||
          it.ref.tensor.dtype != DType::kFloat32 || job.spans[i].second < job.spans[i].first) {
        continue;
      }
      const planner::Use u = use_of(it);
      TensorPlan priced = it.plan;  // as the planner named it: a matrix at its default view
      if (it.ref.options.rows > 0) priced.codec = with_rows(priced.codec, 0, false);
      planner::observe(*planner_, u.n, priced,
                       static_cast<double>(job.spans[i].second - job.spans[i].first) * 1e-9, u.op);
    }
  }
  std::lock_guard lock(records_mu_);
  for (const auto& it : job.items) it.record->in_flight = false;
}

}  // namespace terse::engine
