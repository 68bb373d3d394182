// The engine: plans submissions, checks them across ranks on first use, splits them into
// partition tasks run in submission order by a worker pool, and completes them.
//
// Why tasks cannot deadlock: every rank assigns tasks the same sequence numbers (submissions
// arrive in the same order) and starts them in that order, and a task only waits on the task of
// the same number on other ranks. The smallest unfinished task is therefore running (or about
// to run) on every rank where it is unfinished, and it can always make progress.
#include "terse/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "codecs/wire.h"
#include "collectives/collective.h"
#include "engine/allreduce_probe.h"
#include "engine/handle_access.h"
#include "kit/basic.h"
#include "kit/blas.h"
#include "kit/buffer_pool.h"
#include "kit/hash.h"
#include "kit/host.h"
#include "planner/planner_impl.h"
#include "terse/codec.h"
#include "terse/planner.h"
#include "terse/trace.h"
#include "transport/machine_share.h"
#include "transport/scheduling.h"
#include "transport/tags.h"

namespace terse {

using collectives::Failure;
using collectives::PartitionContext;
using collectives::StateSlots;

// ---- handles --------------------------------------------------------------------------------

struct Handle::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;

  void complete(std::exception_ptr e) {
    std::vector<std::function<void(std::exception_ptr)>> run;
    {
      std::lock_guard lock(mu);
      done = true;
      error = e;
      run.swap(callbacks);
    }
    cv.notify_all();
    for (auto& f : run) f(e);
  }
};

void Handle::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Handle::ready() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

void Handle::on_complete(std::function<void(std::exception_ptr)> f) const {
  if (!state_) {
    f(nullptr);
    return;
  }
  std::unique_lock lock(state_->mu);
  if (!state_->done) {
    state_->callbacks.push_back(std::move(f));
    return;
  }
  auto e = state_->error;
  lock.unlock();
  f(e);
}

std::pair<Handle, std::function<void(std::exception_ptr)>> HandleAccess::make() {
  auto state = std::make_shared<Handle::State>();
  return {Handle(state), [state](std::exception_ptr e) { state->complete(e); }};
}

// ---- the engine -----------------------------------------------------------------------------

namespace {

using tags::kVerifySignature;
constexpr int kMaxPartitions = 256;

// A tensor's state under one configuration.
struct ConfigState {
  std::uint64_t step = 0;
  bool verified = false;
  std::vector<StateSlots> partitions;
};

// What the engine remembers of a tensor between submissions: the state of its current
// configuration, and more.
struct TensorRecord : ConfigState {
  std::string config;  // elements, codec, strategy, partitions, average: a change resets state
  bool in_flight = false;
  // While the planner explores a planned tensor's size, its contenders take turns: each one's
  // state waits here, by config, for its next turn (its residuals, its step, its first-use
  // check). Dropped once the size is settled.
  std::map<std::string, ConfigState> parked;

  bool verified_for(const std::string& c) const {
    if (c == config) return verified;
    auto p = parked.find(c);
    return p != parked.end() && p->second.verified;
  }
  // Makes `c` the current configuration: its parked state if any, fresh otherwise. The state
  // left is parked if `keep`; without it, every parked state is dropped too.
  void use(const std::string& c, bool keep) {
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
};

struct Item {
  TensorRef ref;
  TensorPlan plan;
  const Codec* codec = nullptr;  // null for raw
  const RoundCodec* rounds = nullptr;
  TensorRecord* record = nullptr;
  std::uint64_t step = 0;
  std::size_t staging = 0;  // offset of its result in the job's staging buffer, if staged
  bool staged = false;      // result goes to staging first (fused, or keep_input_on_error)
  // Raw, unfused: the first element of its sum that is NaN or Inf, as its partitions' tasks
  // found it (under the job's mu; SIZE_MAX: none). A fused item's sum is scanned in finish().
  std::size_t not_finite = SIZE_MAX;
};

struct Job {
  std::vector<Item> items;
  std::vector<int> fused;  // indices of items travelling in the fused message
  std::size_t fused_elements = 0;
  // Results that are not written in place: the fused message (gathered inputs, reduced in
  // place) first, then, with keep_input_on_error, every other item.
  kit::Buffer staging;
  bool fused_gathered = false;
  std::atomic<int> remaining{0};

  std::mutex mu;
  std::exception_ptr error;
  Failure failure;
  int failure_item = -1;
  std::shared_ptr<Handle::State> handle;
  std::int64_t submitted_ns = 0;  // for the "allreduce" trace event
  // Per item: first task start and last task end (trace_now_ns), for the planner; empty when no
  // item was planned by it.
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;
};

struct Task {
  std::shared_ptr<Job> job;
  int item = -1;  // -1: the fused raw message
  int partition = 0;
  int partitions = 1;
  std::uint64_t tag_base = 0;
};

// A submitted tensor's view: `typed` once submit() has checked it (fp32 ones too).
std::size_t elements(const TensorRef& t) {
  return t.typed.dtype == DType::kFloat32 && t.typed.data == nullptr ? t.data.size()
                                                                     : t.typed.elements;
}

std::string config_of(const TensorRef& t, const TensorPlan& p) {
  // fp32 tensors keep the description they always had (it names saved state and message tags).
  const std::string values =
      t.typed.dtype == DType::kFloat32
          ? fmt::format("{} floats", elements(t))
          : fmt::format("{} {} values", elements(t), to_string(t.typed.dtype));
  return fmt::format("{}, codec {}, strategy {}, {} partition{}, {}", values, p.codec,
                     to_string(p.strategy), p.partitions, p.partitions == 1 ? "" : "s",
                     t.options.average ? "average" : "sum");
}

int env_threads() {
  const char* v = std::getenv("TERSE_THREADS");
  if (v == nullptr || *v == '\0') return 4;
  char* end = nullptr;
  long t = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || t < 1 || t > 256) {
    throw InvalidArgument(fmt::format("TERSE_THREADS='{}' is not a number of threads in 1..256", v));
  }
  return static_cast<int>(t);
}

}  // namespace

struct Engine::Impl {
  std::shared_ptr<Communicator> comm;
  EngineOptions options;
  kit::BufferPool pool;
  std::atomic<std::uint64_t> bytes_sent{0};

  mutable std::mutex codecs_mu;
  std::map<std::string, std::unique_ptr<Codec>, std::less<>> codecs;  // by spec as given

  std::mutex submit_mu;  // one submission at a time: sequence numbers follow call order
  std::map<std::string, TensorRecord, std::less<>> records;  // inserted under submit_mu
  std::mutex flight_mu;  // guards TensorRecord::in_flight (cleared by the workers)
  std::uint32_t task_seq = 0;
  std::uint32_t verify_seq = 0;

  // TERSE_TRACE=DIR: the engine records its own trace and writes DIR/rank-R.json at the end.
  std::shared_ptr<TraceRecorder> env_trace;
  std::string env_trace_dir;
  std::int64_t env_trace_offset = 0;  // to rank 0's clock, for `terse trace merge`

  // Workers wait on queue_cv, the completion thread on completion_cv, synchronize() on idle_cv:
  // a wake-up reaches only threads that can act on it (on cores shared by several ranks, every
  // needless wake-up is a context switch taken from the training).
  std::mutex queue_mu;
  std::condition_variable queue_cv, completion_cv, idle_cv;
  std::deque<Task> queue;
  std::deque<std::pair<std::shared_ptr<Handle::State>, std::exception_ptr>> completions;
  int outstanding_jobs = 0;
  bool stopping = false;
  std::vector<std::thread> workers;
  std::thread completion_thread;

  // The most scratch any worker has needed, per workspace slot. A task runs on whichever worker
  // is free, so each worker's workspace would grow to it in a run of its own, page faults and
  // all (a 256 MiB tensor in one partition: 128 MiB of error-feedback scratch per worker, a
  // few hundred ms on this VM); an idle worker grows its own instead (catch_up_scratch).
  // Workers already waiting when a mark rises are woken for it (scratch_generation, under
  // queue_mu, counts the rises).
  std::mutex scratch_mu;
  std::vector<std::size_t> scratch_marks;
  std::uint64_t scratch_generation = 0;

  const Codec& codec_for(const std::string& spec) const {
    std::lock_guard lock(codecs_mu);
    auto it = codecs.find(spec);
    if (it != codecs.end()) return *it->second;
    auto c = make_codec(spec);
    auto& slot = const_cast<Impl*>(this)->codecs[spec];
    slot = std::move(c);
    return *slot;
  }

  TensorPlan plan(std::size_t n, const AllreduceOptions& o, const Codec** codec_out = nullptr,
                  DType dtype = DType::kFloat32) const {
    if (o.codec == "auto") return plan_auto(n, o, codec_out, dtype);
    if (dtype != DType::kFloat32 && codec_for(o.codec).name() == "none" &&
        (o.strategy == Strategy::kAuto || o.strategy == Strategy::kRaw)) {
      // Raw on a half tensor sends the tensor's own precision (see Engine::allreduce).
      AllreduceOptions own = o;
      own.codec = dtype == DType::kFloat16 ? "fp16" : "bf16";
      own.strategy = Strategy::kSummable;
      return plan(n, own, codec_out, dtype);
    }
    TensorPlan p;
    const std::string spec = o.codec == "auto" ? "none" : o.codec;
    const Codec& codec = codec_for(spec);
    const CodecTraits t = codec.traits();
    p.codec = codec.spec();
    const bool identity = codec.name() == "none";
    p.strategy = o.strategy;
    if (p.strategy == Strategy::kAuto) {
      p.strategy = identity                        ? Strategy::kRaw
                   : t.summable || t.multi_round ? Strategy::kSummable
                                                 : Strategy::kSharded;
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
    if (t.multi_round && p.strategy != Strategy::kSummable &&
        p.strategy != Strategy::kAllgather) {
      throw InvalidArgument(fmt::format("codec {} needs sums across ranks between its rounds: "
                                        "use strategy summable (rings) or allgather (or auto)",
                                        p.codec));
    }
    if (o.partitions < 0 || o.partitions > kMaxPartitions) {
      throw InvalidArgument(
          fmt::format("partitions={} is not in 0..{}", o.partitions, kMaxPartitions));
    }
    std::size_t k = o.partitions;
    if (k == 0) k = (n * sizeof(float) + options.partition_bytes - 1) / options.partition_bytes;
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
    if (codec_out != nullptr) *codec_out = &codec;
    return p;
  }

  // ---- codec "auto": the planner's choice (src/planner/) -------------------------------------

  int threads = 0;  // worker threads, which the planner's model needs
  mutable std::mutex planner_mu;
  mutable std::shared_ptr<Planner> planner;  // options.planner, or created on first use

  Planner& auto_planner() const {
    std::lock_guard lock(planner_mu);
    if (planner) return *planner;
    if (options.planner) {
      planner = options.planner;
    } else {
      PlannerOptions po;  // raw also at this engine's own partitioning
      po.raw_partition_bytes = options.partition_bytes;
      planner = std::make_shared<Planner>(std::move(po));
    }
    // Calibration times allreduces through a probe engine of its own.
    PlannerAccess::set_allreduce_probe(*planner, make_allreduce_probe);
    return *planner;
  }

  TensorPlan plan_auto(std::size_t n, const AllreduceOptions& o, const Codec** codec_out,
                       DType dtype) const {
    Planner& planner = auto_planner();
    if (!planner.calibrated()) {
      // Calibration measures the links: let submitted work finish first (every rank does).
      auto* self = const_cast<Impl*>(this);
      std::unique_lock lock(self->queue_mu);
      self->idle_cv.wait(lock, [&] { return self->outstanding_jobs == 0; });
    }
    AllreduceOptions chosen = o;
    const TensorPlan p = planner.plan(*comm, n, threads, o.strategy, o.partitions);
    chosen.codec = p.codec;
    chosen.strategy = p.strategy;
    chosen.partitions = p.partitions;
    return plan(n, chosen, codec_out, dtype);
  }

  static bool planned(const Item& it) { return it.ref.options.codec == "auto"; }

  // Before planning a submission: lets the planner re-check (a collective at the same point on
  // every rank, since ranks submit the same sequence).
  void before_auto_submission(const std::vector<TensorRef>& tensors) {
    std::vector<Planner::Use> uses;
    for (const auto& t : tensors) {
      if (t.options.codec == "auto") {
        uses.push_back({elements(t), threads, t.options.strategy, t.options.partitions});
      }
    }
    if (!uses.empty()) auto_planner().before_submission(*comm, uses);
  }

  void note_span(Job& job, int item, std::int64_t begin) {
    if (job.spans.empty() || item < 0) return;
    const std::int64_t end = trace_now_ns();
    std::lock_guard lock(job.mu);
    auto& span = job.spans[item];
    span.first = std::min(span.first, begin);
    span.second = std::max(span.second, end);
  }

  // Reports the measured time of every planned, unfused item of a successful job, except the
  // first run of a tensor's configuration: it pays once for what later runs reuse (the
  // cross-rank check, buffers, fresh codec state), which is no part of its steady cost.
  void report_spans(const Job& job) {
    for (std::size_t i = 0; i < job.spans.size(); ++i) {
      const Item& it = job.items[i];
      // The planner's model prices fp32 tensors; half ones are not what it measured.
      if (!planned(it) || it.plan.fused || it.step == 0 ||
          it.ref.typed.dtype != DType::kFloat32 || job.spans[i].second < job.spans[i].first) {
        continue;
      }
      planner->observe(it.ref.typed.elements, it.plan,
                       static_cast<double>(job.spans[i].second - job.spans[i].first) * 1e-9);
    }
  }

  // ---- cross-rank check of a submission's description (first use) --------------------------

  void verify(const std::vector<Item>& items) {
    std::string text;
    for (const auto& it : items) {
      text += fmt::format("'{}': {}\n", it.ref.name, config_of(it.ref, it.plan));
    }
    const int n = comm->size(), r = comm->rank();
    if (n == 1) return;
    const std::string label =
        items.size() == 1
            ? fmt::format("'{}' (first-use check)", items[0].ref.name)
            : fmt::format("'{}' and {} more (first-use check)", items[0].ref.name,
                          items.size() - 1);
    const std::uint64_t base =
        (kVerifySignature << 32) | (static_cast<std::uint64_t>(verify_seq++ & 0xffff) << 16);
    const std::uint64_t mine[2] = {fnv1a64(text), text.size()};
    std::vector<std::array<std::uint64_t, 2>> theirs(n);
    auto exchange = [&](std::uint32_t index, auto&& send_of, auto&& recv_of) {
      std::vector<Request> rx, tx;
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        rx.push_back(comm->recv(p, base | index, recv_of(p), label));
        tx.push_back(comm->send(p, base | index, send_of(p), label));
      }
      for (auto& q : rx) q.wait();
      for (auto& q : tx) q.wait();
    };
    exchange(
        0, [&](int) { return std::as_bytes(std::span(mine)); },
        [&](int p) { return std::as_writable_bytes(std::span(theirs[p])); });
    theirs[r] = {mine[0], mine[1]};
    bool same = true;
    for (int p = 0; p < n; ++p) same &= theirs[p][0] == mine[0] && theirs[p][1] == mine[1];
    if (same) return;
    // Every rank saw the same digests, so every rank takes this path: exchange the texts.
    std::vector<std::string> texts(n);
    for (int p = 0; p < n; ++p) {
      if (theirs[p][1] > (std::uint64_t{16} << 20)) {
        throw MismatchError(fmt::format("rank {}: rank {} describes its submission in {} bytes",
                                        r, p, theirs[p][1]));
      }
      texts[p].resize(theirs[p][1]);
    }
    texts[r] = text;
    exchange(
        1, [&](int) { return std::as_bytes(std::span(text.data(), text.size())); },
        [&](int p) { return std::as_writable_bytes(std::span(texts[p].data(), texts[p].size())); });
    int other = 0;
    while (other < n && texts[other] == text) ++other;
    if (other == n) other = r == 0 ? 1 : 0;
    throw MismatchError(fmt::format(
        "rank {}: ranks submitted different tensors at the same point; every rank must submit "
        "the same tensors, sizes and options in the same order.\n  rank {} submitted:\n{}  rank "
        "{} submitted:\n{}",
        r, r, indent(text), other, indent(texts[other])));
  }

  static std::string indent(const std::string& text) {
    std::string out;
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      out += "    " + text.substr(start, end - start) + "\n";
      start = end + 1;
    }
    return out.empty() ? "    (nothing)\n" : out;
  }

  // ---- submission ---------------------------------------------------------------------------

  Handle submit(std::vector<TensorRef> tensors) {
    std::lock_guard submit_lock(submit_mu);
    before_auto_submission(tensors);
    auto job = std::make_shared<Job>();
    job->handle = std::make_shared<Handle::State>();
    if (options.tracer) job->submitted_ns = trace_now_ns();
    std::set<std::string> names;
    bool need_verify = false;
    for (auto& t : tensors) {
      if (t.name.empty()) throw InvalidArgument("allreduce: a tensor needs a name");
      if (!names.insert(t.name).second) {
        throw InvalidArgument(fmt::format("allreduce: tensor '{}' appears twice in one "
                                          "submission",
                                          t.name));
      }
      if (t.typed.data != nullptr || t.typed.elements != 0 || t.typed.dtype != DType::kFloat32) {
        if (!t.data.empty()) {
          throw InvalidArgument(fmt::format("allreduce: tensor '{}' has both fp32 data and a "
                                            "typed view; give one",
                                            t.name));
        }
        if (t.typed.data == nullptr && t.typed.elements != 0) {
          throw InvalidArgument(
              fmt::format("allreduce: tensor '{}' has {} elements and no data", t.name,
                          t.typed.elements));
        }
        if (t.typed.dtype == DType::kFloat32) t.data = t.typed.floats();
      } else {
        t.typed = TensorView(t.data);
      }
      Item it;
      const Codec* codec = nullptr;
      it.plan = plan(t.typed.elements, t.options, &codec, t.typed.dtype);
      if (it.plan.strategy != Strategy::kRaw) {
        it.codec = codec;
        if (codec->traits().multi_round) it.rounds = dynamic_cast<const RoundCodec*>(codec);
      }
      auto rec = records.find(t.name);
      if (rec != records.end() && in_flight(rec->second)) {
        throw InvalidArgument(fmt::format("allreduce: tensor '{}' is already in flight; wait for "
                                          "its handle before submitting it again",
                                          t.name));
      }
      const std::string config = config_of(t, it.plan);
      if (rec == records.end() || !rec->second.verified_for(config)) need_verify = true;
      it.ref = std::move(t);
      job->items.push_back(std::move(it));
    }
    if (job->items.empty()) {
      job->handle->complete(nullptr);
      return Handle(job->handle);
    }
    if (need_verify) verify(job->items);  // throws MismatchError: nothing submitted

    // Commit: records, fusion, buffers, tasks.
    for (std::size_t i = 0; i < job->items.size(); ++i) {
      Item& it = job->items[i];
      const std::string config = config_of(it.ref, it.plan);
      TensorRecord& rec = records[it.ref.name];
      // Another size or codec: its old state does not apply, unless exploration comes back to
      // it.
      const AllreduceOptions& o = it.ref.options;
      rec.use(config,
              planned(it) && (rec.config != config || !rec.parked.empty()) &&
                  auto_planner().exploring(it.ref.typed.elements, threads, o.strategy,
                                           o.partitions));
      rec.verified = true;
      rec.partitions.resize(it.plan.partitions);
      set_in_flight(rec, true);
      it.record = &rec;
      it.step = rec.step++;
    }
    std::size_t fusable = 0;
    for (const auto& it : job->items) {
      fusable += fusable_item(it);
    }
    if (fusable >= 2) {
      for (std::size_t i = 0; i < job->items.size(); ++i) {
        Item& it = job->items[i];
        if (fusable_item(it)) {
          it.plan.fused = true;
          job->fused.push_back(static_cast<int>(i));
          job->fused_elements += it.ref.typed.elements;
        }
      }
      // Fused tensors are laid out by name: an element's position in the fused ring decides the
      // order in which its sum is taken, which must not depend on the order of the group.
      std::sort(job->fused.begin(), job->fused.end(), [&](int a, int b) {
        return job->items[a].ref.name < job->items[b].ref.name;
      });
    }
    // Staging layout: the fused items' sums first, contiguous in fused order, then the others.
    std::size_t staging = 0;
    for (int i : job->fused) {
      job->items[i].staging = staging;
      job->items[i].staged = true;
      staging += job->items[i].ref.typed.elements;
    }
    for (auto& it : job->items) {
      if (it.plan.fused || !options.keep_input_on_error) continue;
      it.staging = staging;
      it.staged = true;
      staging += staged_floats(it);
    }
    if (staging > 0) job->staging = pool.acquire(staging * sizeof(float));
    if (std::any_of(job->items.begin(), job->items.end(), planned)) {
      job->spans.assign(job->items.size(), {INT64_MAX, INT64_MIN});
    }

    std::vector<Task> tasks;
    auto add_task = [&](int item, int partition, int partitions, const std::string& what) {
      Task t;
      t.job = job;
      t.item = item;
      t.partition = partition;
      t.partitions = partitions;
      std::uint64_t signature = fnv1a64(fmt::format("{}#{}/{}", what, partition, partitions)) &
                                tags::kSignatureMask;
      if (signature >= tags::kFirstReservedSignature) signature = 0;
      t.tag_base = (signature << 32) | (static_cast<std::uint64_t>(task_seq++ & 0xffff) << 16);
      tasks.push_back(std::move(t));
    };
    if (!job->fused.empty()) {
      std::string what = "fused";
      for (int i : job->fused) {
        what += '|';
        what += job->items[i].ref.name;
        what += config_of(job->items[i].ref, job->items[i].plan);
      }
      const std::size_t k = std::clamp<std::size_t>(
          (job->fused_elements * 4 + options.partition_bytes - 1) / options.partition_bytes, 1,
          kMaxPartitions);
      for (std::size_t p = 0; p < k; ++p) add_task(-1, p, k, what);
    }
    for (std::size_t i = 0; i < job->items.size(); ++i) {
      const Item& it = job->items[i];
      if (it.plan.fused) continue;
      const std::string what = fmt::format("{}|{}", it.ref.name, config_of(it.ref, it.plan));
      for (int p = 0; p < it.plan.partitions; ++p) add_task(i, p, it.plan.partitions, what);
    }
    job->remaining = static_cast<int>(tasks.size());
    {
      std::lock_guard lock(queue_mu);
      ++outstanding_jobs;
      for (auto& t : tasks) queue.push_back(std::move(t));
    }
    if (tasks.size() >= static_cast<std::size_t>(threads)) {
      queue_cv.notify_all();
    } else {
      for (std::size_t i = 0; i < tasks.size(); ++i) queue_cv.notify_one();
    }
    return Handle(job->handle);
  }

  // Small raw tensors that average (DDP's case) travel together in one message.
  bool fusable_item(const Item& it) const {
    return it.plan.strategy == Strategy::kRaw && it.ref.options.average &&
           it.ref.typed.dtype == DType::kFloat32 && it.ref.data.size_bytes() <= options.fuse_bytes;
  }

  // ---- running tasks ------------------------------------------------------------------------

  void worker(std::uint32_t id) {
    Workspace workspace;
    std::uint64_t published = 0;  // workspace.growths() at its last publish_scratch
    std::uint64_t seen = 0;       // scratch_generation at its last catch_up_scratch
    for (;;) {
      Task task;
      {
        std::unique_lock lock(queue_mu);
        while (queue.empty() && !stopping && seen != scratch_generation) {
          seen = scratch_generation;
          lock.unlock();
          catch_up_scratch(workspace);
          published = workspace.growths();
          lock.lock();
        }
        queue_cv.wait(lock,
                      [&] { return stopping || !queue.empty() || seen != scratch_generation; });
        if (stopping && queue.empty()) return;
        if (queue.empty()) continue;  // woken to catch up
        task = std::move(queue.front());
        queue.pop_front();
      }
      run(task, id, workspace);
      if (workspace.growths() != published) {
        publish_scratch(workspace);
        published = workspace.growths();
      }
    }
  }

  // Raises the marks to this workspace's slots; wakes the idle workers if any rose.
  void publish_scratch(const Workspace& w) {
    bool rose = false;
    {
      std::lock_guard lock(scratch_mu);
      if (scratch_marks.size() < w.slots()) scratch_marks.resize(w.slots());
      for (std::size_t slot = 0; slot < w.slots(); ++slot) {
        if (w.slot_bytes(slot) <= scratch_marks[slot]) continue;
        scratch_marks[slot] = w.slot_bytes(slot);
        rose = true;
      }
    }
    if (!rose) return;
    {
      std::lock_guard lock(queue_mu);
      ++scratch_generation;
    }
    queue_cv.notify_all();
  }

  // Grows an idle worker's workspace to the marks (nothing queued: off every run's path).
  void catch_up_scratch(Workspace& w) {
    std::vector<std::size_t> marks;
    {
      std::lock_guard lock(scratch_mu);
      marks = scratch_marks;
    }
    for (std::size_t slot = 0; slot < marks.size(); ++slot) {
      if (w.slot_bytes(slot) >= marks[slot]) continue;
      try {
        w.reserve(slot, marks[slot]);
      } catch (const std::bad_alloc&) {  // it grows in a run, as it would have anyway
        return;
      }
    }
  }

  void run(Task& task, std::uint32_t thread, Workspace& workspace) {
    Job& job = *task.job;
    const std::int64_t begin = trace_now_ns();
    PartitionContext ctx;
    ctx.comm = comm.get();
    ctx.partition = task.partition;
    ctx.partitions = task.partitions;
    ctx.tag_base = task.tag_base;
    ctx.pool = &pool;
    ctx.workspace = &workspace;
    ctx.tracer = options.tracer.get();
    ctx.thread = thread;
    ctx.bytes_sent = &bytes_sent;
    try {
      if (task.item < 0) {
        ctx.tensor = fmt::format("fused group of {} tensors", job.fused.size());
        run_fused(task, ctx);
      } else {
        const Item& it = job.items[task.item];
        const collectives::Split split(it.ref.typed.elements, task.partitions);
        ctx.tensor = it.ref.name;
        ctx.offset = split.begin(task.partition);
        const DType dtype = it.ref.typed.dtype;
        kit::Buffer wide;  // a half tensor's partition in fp32: sums and decoded results
        if (dtype == DType::kFloat32) {
          ctx.input = split.piece(std::span<const float>(it.ref.data), task.partition);
          ctx.output = split.piece(result(job, task.item), task.partition);
        } else {
          const auto half = split.piece(std::span<const std::uint16_t>(it.ref.typed.half()),
                                        task.partition);
          wide = pool.acquire(half.size() * sizeof(float));
          ctx.output = wide.as<float>(half.size());
          ctx.input = ctx.output;
          if (it.rounds != nullptr) {
            // Round codecs read their input as fp32 arrays: widen it (exactly; NaN and Inf
            // included, which the codec then reports).
            kit::widen(dtype, half.data(), ctx.output, false);
          } else {
            ctx.half_input = half;
            ctx.dtype = dtype;
          }
        }
        ctx.divisor = it.ref.options.average ? comm->size() : 1;
        ctx.codec = it.codec;
        ctx.rounds = it.rounds;
        ctx.states = &it.record->partitions[task.partition];
        ctx.encode.seed = options.seed;
        ctx.encode.step = it.step;
        ctx.encode.tensor = kit::combine_keys(fnv1a64(it.ref.name), task.partition);
        ctx.encode.rank = static_cast<std::uint64_t>(comm->rank());
        switch (it.plan.strategy) {
          case Strategy::kRaw:
            raw_sum(ctx);
            note_raw_sum(job, task.item, ctx);
            break;
          case Strategy::kAllgather: collectives::allgather_allreduce(ctx); break;
          case Strategy::kSharded: collectives::sharded_allreduce(ctx); break;
          case Strategy::kRing: collectives::ring_allreduce(ctx); break;
          case Strategy::kSummable: collectives::summable_allreduce(ctx); break;
          case Strategy::kAuto: throw InvalidArgument("engine: unresolved strategy");
        }
        if (dtype != DType::kFloat32 && !ctx.failure.any()) {
          // Every rank rounds the same fp32 result the same way.
          auto out = split.piece(half_result(job, task.item), task.partition);
          if (!kit::narrow(dtype, ctx.output, out.data())) {
            throw InvalidArgument(fmt::format("engine: {}: decoded result is not finite",
                                              ctx.label()));
          }
        }
      }
      if (ctx.failure.any()) {
        std::lock_guard lock(job.mu);
        if (job.failure_item < 0 || ctx.failure.kind < job.failure.kind ||
            (ctx.failure.kind == job.failure.kind && task.item < job.failure_item)) {
          job.failure = ctx.failure;
          job.failure_item = task.item;
        }
      }
    } catch (const TimeoutError& e) {
      record_error(job, std::make_exception_ptr(TimeoutError(fmt::format(
                            "{} (if the peer is alive, ranks may have submitted different "
                            "tensors at this point)",
                            e.what()))));
    } catch (const TransportError&) {
      record_error(job, std::current_exception());
    } catch (const std::exception& e) {
      // This rank cannot finish its part: fail the communicator so that peers waiting on this
      // task learn it now rather than at their timeout.
      comm->abort(fmt::format("{}: {}", ctx.label(), e.what()));
      record_error(job, std::current_exception());
    }
    note_span(job, task.item, begin);
    if (job.remaining.fetch_sub(1) == 1) finish(task.job);
  }

  // The fused raw message: the inputs of small raw tensors gathered into one buffer, reduced as
  // one ring. The first partition's task gathers them; partitions only read their own range.
  void run_fused(Task& task, PartitionContext& ctx) {
    Job& job = *task.job;
    {
      std::lock_guard lock(job.mu);
      if (!job.fused_gathered) {
        job.fused_gathered = true;
        auto dst = job.staging.as<float>(job.fused_elements);
        std::size_t at = 0;
        for (int i : job.fused) {
          const auto& src = job.items[i].ref.data;
          if (!src.empty()) std::memcpy(dst.data() + at, src.data(), src.size_bytes());
          at += src.size();
        }
      }
    }
    const collectives::Split split(job.fused_elements, task.partitions);
    std::span<float> out = job.staging.as<float>(job.fused_elements);  // reduced in place
    ctx.offset = split.begin(task.partition);
    ctx.input = split.piece(std::span<const float>(out), task.partition);
    ctx.output = split.piece(out, task.partition);
    ctx.divisor = comm->size();  // only averaging tensors are fused
    raw_sum(ctx);
  }

  // fp32 partitions: small ones gathered (one message step), others on the ring.
  void raw_sum(PartitionContext& ctx) {
    if (collectives::gathers(ctx.input.size(), comm->size(), options.gather_bytes)) {
      collectives::raw_gather(ctx, ctx.input, ctx.output, 0, ctx.divisor);
    } else {
      collectives::raw_allreduce(ctx);
    }
  }

  void record_error(Job& job, std::exception_ptr e) {
    std::lock_guard lock(job.mu);
    if (!job.error) job.error = e;
  }

  // ---- completion ---------------------------------------------------------------------------

  void finish(const std::shared_ptr<Job>& job_ptr) {
    Job& job = *job_ptr;
    std::exception_ptr error = job.error;
    if (!error && job.failure.any()) {
      error = failure_error(job);
    }
    if (!error) {
      try {
        check_raw_sums(job);
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!error) copy_back(job);
    if (!error) report_spans(job);
    for (auto& it : job.items) set_in_flight(*it.record, false);
    job.staging = kit::Buffer();
    if (options.tracer) {
      TraceEvent e;
      e.stage = "allreduce";
      e.tensor = job.items.size() == 1 ? job.items[0].ref.name
                                       : fmt::format("group of {}", job.items.size());
      for (const auto& it : job.items) e.bytes += it.ref.typed.bytes();
      e.begin_ns = job.submitted_ns;
      e.end_ns = trace_now_ns();
      e.thread = 1000;  // a track of its own
      options.tracer->record(std::move(e));
    }
    // Callbacks run on the completion thread, so that one which blocks (a Python callback
    // waiting for the GIL) cannot hold up a worker that other partitions need.
    {
      std::lock_guard lock(queue_mu);
      completions.emplace_back(job.handle, error);
    }
    completion_cv.notify_one();
  }

  void completer() {
    for (;;) {
      std::pair<std::shared_ptr<Handle::State>, std::exception_ptr> done;
      {
        std::unique_lock lock(queue_mu);
        completion_cv.wait(lock, [&] {
          return !completions.empty() || (stopping && queue.empty() && outstanding_jobs == 0);
        });
        if (completions.empty()) return;
        done = std::move(completions.front());
        completions.pop_front();
      }
      done.first->complete(done.second);
      {
        std::lock_guard lock(queue_mu);
        --outstanding_jobs;
      }
      idle_cv.notify_all();
    }
  }

  // What an error did to the user's tensors.
  std::string outcome() const {
    return options.keep_input_on_error ? " and left the tensors unchanged"
                                       : " (the tensors may hold partial results)";
  }

  // Where item i's result is written: its own tensor, or the staging buffer.
  static std::span<float> result(const Job& job, int i) {
    const Item& it = job.items[i];
    if (!it.staged) return it.ref.data;
    return job.staging.as<float>(it.staging + it.ref.data.size()).subspan(it.staging);
  }
  // The same for a half tensor: its 16-bit values.
  static std::span<std::uint16_t> half_result(const Job& job, int i) {
    const Item& it = job.items[i];
    if (!it.staged) return it.ref.typed.half();
    auto area = job.staging.as<float>(it.staging + staged_floats(it)).subspan(it.staging);
    return {reinterpret_cast<std::uint16_t*>(area.data()), it.ref.typed.elements};
  }
  // Floats of staging an item's result takes.
  static std::size_t staged_floats(const Item& it) {
    return (it.ref.typed.bytes() + sizeof(float) - 1) / sizeof(float);
  }

  bool in_flight(const TensorRecord& rec) {
    std::lock_guard lock(flight_mu);
    return rec.in_flight;
  }
  void set_in_flight(TensorRecord& rec, bool v) {
    std::lock_guard lock(flight_mu);
    rec.in_flight = v;
  }

  std::exception_ptr failure_error(Job& job) {
    const Failure& f = job.failure;
    const std::string what =
        job.failure_item < 0 ? std::string("the fused group")
                             : fmt::format("tensor '{}'", job.items[job.failure_item].ref.name);
    std::string cause;
    switch (f.kind) {
      case Failure::kInputNotFinite:
        cause = fmt::format("rank {}'s input holds NaN or Inf at element {}", f.origin, f.index);
        break;
      case Failure::kSumNotFinite:
        cause = f.origin >= 0
                    ? fmt::format("the partial sum at rank {} overflowed to Inf at element {}",
                                  f.origin, f.index)
                    : std::string("a sum across ranks holds NaN or Inf (some rank's input was "
                                  "not finite, or the sum overflowed)");
        break;
      default:
        cause = f.detail.empty()
                    ? fmt::format("rank {} received a payload it could not decode", f.origin)
                    : f.detail;
    }
    const std::string msg = fmt::format("rank {}: allreduce of {} failed on every rank{}: {}",
                                        comm->rank(), what, outcome(), cause);
    if (f.kind == Failure::kBadPayload) return std::make_exception_ptr(DecodeError(msg));
    return std::make_exception_ptr(InvalidArgument(msg));
  }

  // A raw partition's sum is checked for NaN and Inf by its own task, right after it is
  // computed: on that task's worker, while the workers still have other partitions to run, and
  // inside the time the planner measures. Scanned after the last task, as it was until stop
  // 41, a 256 MiB sum took one core 25-65 ms that no span counted (exploration timed raw at
  // about 0.9 of what the benchmark measured, compressed plans at 1.0-1.06).
  static void note_raw_sum(Job& job, int item, const PartitionContext& ctx) {
    if (item < 0) return;  // the fused message: finish() scans its items
    const std::size_t bad = kit::find_non_finite(ctx.output);
    if (bad == ctx.output.size()) return;
    std::lock_guard lock(job.mu);
    auto& first = job.items[static_cast<std::size_t>(item)].not_finite;
    first = std::min(first, ctx.offset + bad);
  }

  // Raw sums are identical on every rank, so this check fails on all of them or on none.
  void check_raw_sums(Job& job) {
    for (std::size_t i = 0; i < job.items.size(); ++i) {
      const Item& it = job.items[i];
      if (it.plan.strategy != Strategy::kRaw) continue;
      std::span<float> sum = result(job, static_cast<int>(i));
      const std::size_t bad = it.plan.fused ? kit::find_non_finite(sum) : it.not_finite;
      if (bad >= sum.size()) continue;
      // The input survives only when the result was staged.
      const std::size_t own = it.staged ? kit::find_non_finite(it.ref.data) : it.ref.data.size();
      throw InvalidArgument(fmt::format(
          "rank {}: allreduce of tensor '{}' failed on every rank{}: the sum holds NaN or Inf at "
          "element {} ({})",
          comm->rank(), it.ref.name, outcome(), bad,
          own < it.ref.data.size()
              ? fmt::format("this rank's input holds NaN or Inf at element {}", own)
              : std::string("some rank's input was not finite, or the sum overflowed")));
    }
  }

  void copy_back(Job& job) {
    for (std::size_t i = 0; i < job.items.size(); ++i) {
      Item& it = job.items[i];
      if (!it.staged || it.ref.typed.elements == 0) continue;
      const void* from = it.ref.typed.dtype == DType::kFloat32
                             ? static_cast<const void*>(result(job, static_cast<int>(i)).data())
                             : half_result(job, static_cast<int>(i)).data();
      std::memcpy(it.ref.typed.data, from, it.ref.typed.bytes());
    }
  }
};

// ---- public API -----------------------------------------------------------------------------

Engine::Engine(std::shared_ptr<Communicator> comm, EngineOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!comm) throw InvalidArgument("engine: no communicator");
  impl_->comm = std::move(comm);
  impl_->options = std::move(options);
  if (impl_->options.partition_bytes < 4096) {
    throw InvalidArgument("engine: partition_bytes must be at least 4096");
  }
  if (!impl_->options.tracer) {
    const char* dir = std::getenv("TERSE_TRACE");
    if (dir != nullptr && *dir != '\0') {
      impl_->env_trace = std::make_shared<TraceRecorder>();
      impl_->env_trace_dir = dir;
      impl_->options.tracer = impl_->env_trace;
      // A collective: launchers give every rank the same environment.
      impl_->env_trace_offset = measure_clock_offset(*impl_->comm);
    }
  }
  // OpenBLAS (PowerSGD's products) gets each rank's share of its machine's cores: with its
  // default of a thread per core in every rank, 2 and 4 ranks on 2 cores ran PowerSGD 25-30%
  // slower and its calibrated cost varied 2x (kit/blas.h). A collective, like the above.
  kit::blas_limit_threads(transport::machine_share(*impl_->comm).cores_per_rank);
  const int threads = impl_->options.threads > 0 ? impl_->options.threads : env_threads();
  impl_->threads = threads;
  for (int i = 0; i < threads; ++i) {
    impl_->workers.emplace_back([this, i] {
      transport::enter_batch_scheduling();
      impl_->worker(static_cast<std::uint32_t>(i));
    });
  }
  impl_->completion_thread = std::thread([this] {
    transport::enter_batch_scheduling();
    impl_->completer();
  });
}

Engine::~Engine() {
  {
    std::lock_guard lock(impl_->queue_mu);
    impl_->stopping = true;
  }
  impl_->queue_cv.notify_all();
  for (auto& t : impl_->workers) t.join();
  impl_->completion_cv.notify_all();
  impl_->completion_thread.join();
  if (impl_->env_trace) {
    try {
      std::filesystem::create_directories(impl_->env_trace_dir);
      impl_->env_trace->write_chrome_json(
          fmt::format("{}/rank-{}.json", impl_->env_trace_dir, impl_->comm->rank()),
          impl_->comm->rank(), impl_->env_trace_offset);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "terse: cannot write the trace to %s: %s\n",
                   impl_->env_trace_dir.c_str(), e.what());
    }
  }
}

Handle Engine::allreduce(std::string name, std::span<float> data, AllreduceOptions options) {
  std::vector<TensorRef> one;
  one.emplace_back(std::move(name), data, std::move(options));
  return impl_->submit(std::move(one));
}

Handle Engine::allreduce(std::string name, TensorView tensor, AllreduceOptions options) {
  std::vector<TensorRef> one;
  one.emplace_back(std::move(name), tensor, std::move(options));
  return impl_->submit(std::move(one));
}

Handle Engine::allreduce_group(std::vector<TensorRef> tensors) {
  return impl_->submit(std::move(tensors));
}

TensorPlan Engine::plan(std::size_t elements, const AllreduceOptions& options,
                        DType dtype) const {
  return impl_->plan(elements, options, nullptr, dtype);
}

void Engine::synchronize() {
  std::unique_lock lock(impl_->queue_mu);
  impl_->idle_cv.wait(lock, [&] { return impl_->outstanding_jobs == 0; });
}

Communicator& Engine::communicator() { return *impl_->comm; }
const EngineOptions& Engine::options() const { return impl_->options; }
int Engine::rank() const { return impl_->comm->rank(); }
int Engine::size() const { return impl_->comm->size(); }
std::uint64_t Engine::bytes_sent() const { return impl_->bytes_sent.load(); }

// ---- state ----------------------------------------------------------------------------------
//
// Layout (little-endian): u32 magic "TSEN", u32 version, u32 rank, u32 world size, u64 tensors;
// per tensor: u64 name length + name, u64 config length + config, u64 step, u64 partitions; per
// partition: u64 slots; per slot: u32 slot, u64 elements, u64 bytes + the codec state's own bytes.

namespace {
constexpr std::uint32_t kStateMagic = 0x4e455354;  // "TSEN"
// Version 1 had no rank and world size.
constexpr std::uint32_t kStateVersion = 2;

void put_bytes(std::vector<std::byte>& out, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + n);
}
template <typename T>
void put(std::vector<std::byte>& out, T v) {
  put_bytes(out, &v, sizeof(T));
}
void put_string(std::vector<std::byte>& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

// Reads the header of a saved state and refuses one saved by another rank or world size: error
// feedback residuals and codec state are each rank's own, and loading another's would corrupt
// training without a word.
void check_state_origin(wire::Reader& r, int rank, int size) {
  if (r.get<std::uint32_t>() != kStateMagic) throw DecodeError("engine state: bad magic");
  const auto version = r.get<std::uint32_t>();
  if (version == 1) {
    throw DecodeError(fmt::format(
        "rank {}: engine state: version 1 (from an older terse) does not record the rank and "
        "world size it was saved by, so it cannot be checked against this engine (rank {} of "
        "{}) and is refused rather than risk loading another rank's error feedback",
        rank, rank, size));
  }
  if (version != kStateVersion) {
    throw DecodeError(fmt::format("engine state: version {}, expected {}", version, kStateVersion));
  }
  const auto saved_rank = r.get<std::uint32_t>();
  const auto saved_size = r.get<std::uint32_t>();
  if (saved_rank != static_cast<std::uint32_t>(rank) ||
      saved_size != static_cast<std::uint32_t>(size)) {
    throw MismatchError(fmt::format(
        "rank {}: engine state was saved by rank {} of {} ranks, and this engine is rank {} of "
        "{}: error feedback and codec state are per rank, so each rank must load its own state",
        rank, saved_rank, saved_size, rank, size));
  }
}
}  // namespace

std::vector<std::byte> Engine::save_state() const {
  std::lock_guard lock(impl_->submit_mu);
  std::vector<std::byte> out;
  put(out, kStateMagic);
  put(out, kStateVersion);
  put<std::uint32_t>(out, static_cast<std::uint32_t>(rank()));
  put<std::uint32_t>(out, static_cast<std::uint32_t>(size()));
  put<std::uint64_t>(out, impl_->records.size());
  for (const auto& [name, rec] : impl_->records) {
    if (impl_->in_flight(rec)) {
      throw InvalidArgument(fmt::format("save_state: tensor '{}' is in flight; synchronize first",
                                        name));
    }
    put_string(out, name);
    put_string(out, rec.config);
    put<std::uint64_t>(out, rec.step);
    put<std::uint64_t>(out, rec.partitions.size());
    for (const auto& slots : rec.partitions) {
      auto saved = slots.save();
      put<std::uint64_t>(out, saved.size());
      for (const auto& s : saved) {
        put<std::uint32_t>(out, static_cast<std::uint32_t>(s.slot));
        put<std::uint64_t>(out, s.elements);
        put<std::uint64_t>(out, s.bytes.size());
        put_bytes(out, s.bytes.data(), s.bytes.size());
      }
    }
  }
  return out;
}

void Engine::load_state(std::span<const std::byte> bytes) {
  std::lock_guard lock(impl_->submit_mu);
  wire::Reader r(bytes, "engine state");
  check_state_origin(r, rank(), size());
  auto get_string = [&] {
    const auto n = r.get<std::uint64_t>();
    auto s = r.take(n);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  };
  std::map<std::string, TensorRecord, std::less<>> loaded;
  const auto count = r.get<std::uint64_t>();
  for (std::uint64_t t = 0; t < count; ++t) {
    std::string name = get_string();
    TensorRecord rec;
    rec.config = get_string();
    rec.step = r.get<std::uint64_t>();
    const auto parts = r.get<std::uint64_t>();
    if (parts > kMaxPartitions) throw DecodeError("engine state: too many partitions");
    // The codec is the one named in the config ("..., codec SPEC, strategy ...").
    const auto at = rec.config.find(", codec "), end = rec.config.find(", strategy ");
    if (at == std::string::npos || end == std::string::npos || end < at) {
      throw DecodeError(fmt::format("engine state: tensor '{}' has a malformed config", name));
    }
    const std::string spec = rec.config.substr(at + 8, end - at - 8);
    rec.partitions.resize(parts);
    for (auto& slots : rec.partitions) {
      const auto n = r.get<std::uint64_t>();
      std::vector<StateSlots::Saved> saved;
      for (std::uint64_t k = 0; k < n; ++k) {
        StateSlots::Saved s;
        s.slot = static_cast<int>(r.get<std::uint32_t>());
        s.elements = r.get<std::uint64_t>();
        auto b = r.take(r.get<std::uint64_t>());
        s.bytes.assign(b.begin(), b.end());
        saved.push_back(std::move(s));
      }
      if (!saved.empty()) {
        try {
          slots.load(impl_->codec_for(spec), saved);
        } catch (const SpecError& e) {
          throw DecodeError(fmt::format("engine state: tensor '{}': {}", name, e.what()));
        }
      }
    }
    loaded[std::move(name)] = std::move(rec);
  }
  r.expect_end();
  for (const auto& [name, rec] : impl_->records) {
    if (impl_->in_flight(rec)) {
      throw InvalidArgument(fmt::format("load_state: tensor '{}' is in flight; synchronize first",
                                        name));
    }
  }
  for (auto& [name, rec] : loaded) impl_->records[name] = std::move(rec);
}

}  // namespace terse
