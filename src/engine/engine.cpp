// The engine: parts with one job each, composed here.
//
//   plans.h           plan resolution: fixed codecs, codec "auto" through the Planner (every
//                     call into it is there), per-tensor records
//   submission.h      submission building: checks, the first-use check across ranks, fusion,
//                     staging, task numbers and tags; the submission order
//   worker_pool.h     the worker threads (a Channel runs another instance of the same type)
//   partition_task.h  one partition task: its view of the tensor, the strategy, its outcome
//   completion.h      handles, a job's outcome, keep_input_on_error's copy back, the
//                     completion thread, synchronize()
//
// Why tasks cannot deadlock: every rank assigns tasks the same sequence numbers (submissions
// arrive in the same order) and starts them in that order, and a task only waits on the task of
// the same number on other ranks. The smallest unfinished task is therefore running (or about
// to run) on every rank where it is unfinished, and it can always make progress.
//
// Locks, in order. The submission order (Submissions::order_mu_) comes first: it is held for a
// whole submission, across its cross-rank exchanges (the first-use check, the planner's
// calibration and re-checks), and is taken only by submissions, Engine::plan with codec "auto"
// and load_state (submission.h says why it must serialize submissions). A thread holding it may
// take any lock below. Every other lock of the engine is a leaf among them, held for a few local
// steps and never while another engine lock is taken: Plans' records_mu_ and codecs_mu_,
// WorkerPool's mu_, Completion's mu_, each Job's mu, each Handle::State's mu (callbacks run after
// it is released), BufferPool's own and BlasShare's. Under them only locks of the layers below
// are taken (the codec registry's, under codecs_mu_). So completion, the workers, handles,
// synchronize(), bytes_sent() (an atomic) and save_state() never wait for a submission's
// exchanges.
#include "terse/engine.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

#include "codecs/wire.h"
#include "collectives/collective.h"
#include "engine/completion.h"
#include "engine/job.h"
#include "engine/partition_task.h"
#include "engine/plans.h"
#include "engine/submission.h"
#include "engine/worker_pool.h"
#include "kit/blas.h"
#include "kit/buffer_pool.h"
#include "transport/machine_share.h"
#include "transport/direct_read.h"
#include "transport/topology.h"
#include "terse/codec.h"
#include "terse/trace.h"

namespace terse {

using collectives::StateSlots;
using engine::kMaxPartitions;
using engine::TensorRecord;

// ---- the engine -----------------------------------------------------------------------------

namespace {

const std::shared_ptr<Communicator>& checked(const std::shared_ptr<Communicator>& comm) {
  if (!comm) throw InvalidArgument("engine: no communicator");
  return comm;
}

EngineOptions checked(EngineOptions options) {
  if (options.partition_bytes < 4096) {
    throw InvalidArgument("engine: partition_bytes must be at least 4096");
  }
  return options;
}

// The job's hosts, and which of them read their ranks' memory directly (two collectives).
transport::Topology agreed_topology(Communicator& comm, const EngineOptions& options) {
  transport::Topology t = transport::agree_topology(
      comm, options.topology, options.host,
      options.launched_ranks == comm.size() ? options.local_ranks : 0);
  transport::agree_direct_reads(comm, t, options.intra_host);
  return t;
}

// A trace_directory DIR without a tracer of the caller's: the engine records its own trace and
// writes DIR/rank-R.json when destroyed, with its clock offset to rank 0 (for `terse trace
// merge`) measured at construction, a collective (launchers give every rank the same
// environment, which sets it: TERSE_TRACE).
class EnvTrace {
 public:
  EnvTrace(Communicator& comm, EngineOptions& options) : comm_(comm) {
    if (options.tracer || options.trace_directory.empty()) return;
    recorder_ = std::make_shared<TraceRecorder>();
    dir_ = options.trace_directory;
    options.tracer = recorder_;
    offset_ = measure_clock_offset(comm);
  }
  ~EnvTrace() {
    if (!recorder_) return;
    try {
      std::filesystem::create_directories(dir_);
      recorder_->write_chrome_json(fmt::format("{}/rank-{}.json", dir_, comm_.rank()),
                                   comm_.rank(), offset_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "terse: cannot write the trace to %s: %s\n", dir_.c_str(), e.what());
    }
  }
  EnvTrace(const EnvTrace&) = delete;
  EnvTrace& operator=(const EnvTrace&) = delete;

 private:
  Communicator& comm_;
  std::shared_ptr<TraceRecorder> recorder_;
  std::string dir_;
  std::int64_t offset_ = 0;
};

// OpenBLAS (PowerSGD's products) gets each rank's share of its machine's cores: with its default
// of a thread per core in every rank, 2 and 4 ranks on 2 cores ran PowerSGD 25-30% slower and
// its calibrated cost varied 2x (kit/blas.h). The share is the same on every rank (a product's
// last bits can depend on the thread count); finding it is a collective. The count is
// process-wide: the first live engine of the process saves the count it found, and the last
// one destroyed restores it.
class BlasShare {
 public:
  explicit BlasShare(Communicator& comm) {
    const int share = transport::machine_share(comm).cores_per_rank;
    std::lock_guard lock(mu_);
    if (engines_++ == 0) saved_ = kit::blas_threads();
    kit::blas_limit_threads(share);
  }
  ~BlasShare() {
    std::lock_guard lock(mu_);
    if (--engines_ == 0 && kit::blas_threads() != saved_) kit::blas_set_threads(saved_);
  }
  BlasShare(const BlasShare&) = delete;
  BlasShare& operator=(const BlasShare&) = delete;

 private:
  static inline std::mutex mu_;  // guards engines_ and saved_
  static inline int engines_ = 0;
  static inline int saved_ = 0;
};

}  // namespace

// The members are built in the order of the constructor's checks and collectives (communicator
// and options, the trace clock, the BLAS share, the threads), then the parts. ~Engine stops
// the threads before any member is destroyed.
struct TERSE_HIDDEN Engine::Impl {
  Impl(const std::shared_ptr<Communicator>& c, EngineOptions o)
      : comm(checked(c)),
        options(checked(std::move(o))),
        env_trace(*comm, options),
        blas(*comm),
        topology(agreed_topology(*comm, options)),
        threads(options.threads > 0 ? options.threads : kDefaultEngineThreads),
        plans(*comm, options, topology, threads, [this] { completion.wait_idle(); }),
        completion(*comm, options,
                   [this](const engine::Job& job, bool ok) { plans.release(job, ok); }),
        tasks(*comm, options, topology, buffers, bytes_sent,
              [this](const std::shared_ptr<engine::Job>& job) { completion.finish(job); }),
        workers(threads),
        submissions(*comm, options, buffers, plans, tasks, workers, completion) {
    // Errors that name a dead or stalled peer say which host it was on.
    if (topology.hosts.size() > 1) {
      std::vector<std::string> places(topology.size());
      for (int r = 0; r < topology.size(); ++r) {
        places[r] = fmt::format("host {} of {}, with ranks {}", topology.host_of[r],
                                topology.hosts.size(),
                                fmt::join(topology.hosts[topology.host_of[r]], ","));
      }
      comm->set_peer_places(std::move(places));
    }
  }

  std::shared_ptr<Communicator> comm;
  EngineOptions options;
  EnvTrace env_trace;
  BlasShare blas;
  transport::Topology topology;
  int threads;
  kit::BufferPool buffers;
  std::atomic<std::uint64_t> bytes_sent{0};
  engine::Plans plans;
  engine::Completion completion;
  engine::PartitionTasks tasks;
  engine::WorkerPool workers;
  engine::Submissions submissions;
};

// ---- public API -----------------------------------------------------------------------------

Engine::Engine(std::shared_ptr<Communicator> comm, EngineOptions options)
    : impl_(std::make_unique<Impl>(comm, std::move(options))) {}

Engine::~Engine() {
  // Every queued task runs; then every finished job's handle completes.
  impl_->workers.stop();
  impl_->completion.stop();
}

Handle Engine::allreduce(std::string name, std::span<float> data, AllreduceOptions options) {
  std::vector<TensorRef> one;
  one.emplace_back(std::move(name), data, std::move(options));
  return impl_->submissions.submit(std::move(one));
}

Handle Engine::allreduce(std::string name, TensorView tensor, AllreduceOptions options) {
  std::vector<TensorRef> one;
  one.emplace_back(std::move(name), tensor, std::move(options));
  return impl_->submissions.submit(std::move(one));
}

Handle Engine::allreduce_group(std::vector<TensorRef> tensors) {
  return impl_->submissions.submit(std::move(tensors));
}

Handle Engine::reduce_scatter(std::string name, TensorView input, TensorView output,
                              CollectiveOptions options) {
  return impl_->submissions.submit_collective(Operation::kReduceScatter, std::move(name), input,
                                              output, {}, {}, options);
}

Handle Engine::all_gather(std::string name, TensorView input, TensorView output,
                          CollectiveOptions options) {
  return impl_->submissions.submit_collective(Operation::kAllGather, std::move(name), input, output,
                                              {}, {}, options);
}

Handle Engine::all_to_all(std::string name, TensorView input,
                          std::span<const std::size_t> send_counts, TensorView output,
                          std::span<const std::size_t> recv_counts, CollectiveOptions options) {
  return impl_->submissions.submit_collective(
      Operation::kAllToAll, std::move(name), input, output,
      std::vector<std::size_t>(send_counts.begin(), send_counts.end()),
      std::vector<std::size_t>(recv_counts.begin(), recv_counts.end()), options);
}

TensorPlan Engine::plan(std::size_t elements, const AllreduceOptions& options,
                        DType dtype) const {
  if (!auto_tier(options.codec)) return impl_->plans.plan(elements, options, nullptr, dtype);
  // The planner's first plan is a collective: in sequence with the submissions.
  const auto order = impl_->submissions.order();
  return impl_->plans.plan(elements, options, nullptr, dtype);
}

void Engine::calibrate() {
  // The planner calibrates on its first plan; a plan of a 1024 x 1024 matrix asks for one.
  AllreduceOptions options;
  options.codec = "auto";
  const auto order = impl_->submissions.order();
  (void)impl_->plans.plan(std::size_t{1} << 20, options, nullptr, DType::kFloat32);
}

void Engine::synchronize() { impl_->completion.wait_idle(); }

Communicator& Engine::communicator() { return *impl_->comm; }
const EngineOptions& Engine::options() const { return impl_->options; }
int Engine::rank() const { return impl_->comm->rank(); }
int Engine::size() const { return impl_->comm->size(); }
const std::vector<std::vector<int>>& Engine::hosts() const { return impl_->topology.hosts; }
bool Engine::reads_directly_inside_host() const {
  const transport::Topology& t = impl_->topology;
  return t.reads_directly(t.host_of[impl_->comm->rank()]);
}
std::uint64_t Engine::bytes_sent() const { return impl_->bytes_sent.load(); }
std::uint64_t Engine::bytes_sent_across_hosts() const { return impl_->tasks.bytes_across(); }

// ---- state ----------------------------------------------------------------------------------
//
// Layout (little-endian): u32 magic "TSEN", u32 version, u32 rank, u32 world size, u64 tensors;
// per tensor: u64 name length + name, u64 config length + config, u64 step, u64 partitions; per
// partition: u64 slots; per slot: u32 slot, u64 elements, u64 bytes + the codec state's own bytes.

namespace {
constexpr std::uint32_t kStateMagic = 0x4e455354;  // "TSEN"
// Version 1 had no rank and world size.
constexpr std::uint32_t kStateVersion = 2;

// resize and memcpy: GCC 12 misreads vector::insert of a range here as an overflow
// (-Wstringop-overflow, a false positive).
void put_bytes(std::vector<std::byte>& out, const void* p, std::size_t n) {
  const std::size_t at = out.size();
  out.resize(at + n);
  if (n > 0) std::memcpy(out.data() + at, p, n);
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
  const auto lock = impl_->plans.lock_records();
  const auto& records = impl_->plans.records();
  std::vector<std::byte> out;
  put(out, kStateMagic);
  put(out, kStateVersion);
  put<std::uint32_t>(out, static_cast<std::uint32_t>(rank()));
  put<std::uint32_t>(out, static_cast<std::uint32_t>(size()));
  put<std::uint64_t>(out, records.size());
  for (const auto& [name, rec] : records) {
    if (rec.in_flight) {
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
  const auto order = impl_->submissions.order();
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
          slots.load(impl_->plans.codec(spec), saved);
        } catch (const SpecError& e) {
          throw DecodeError(fmt::format("engine state: tensor '{}': {}", name, e.what()));
        }
      }
    }
    loaded[std::move(name)] = std::move(rec);
  }
  r.expect_end();
  const auto lock = impl_->plans.lock_records();
  auto& records = impl_->plans.records();
  for (const auto& [name, rec] : records) {
    if (rec.in_flight) {
      throw InvalidArgument(fmt::format("load_state: tensor '{}' is in flight; synchronize first",
                                        name));
    }
  }
  for (auto& [name, rec] : loaded) records[name] = std::move(rec);
}

}  // namespace terse
