// The engine: asynchronous, compression-aware allreduce of named fp32, fp16 and bf16 tensors
// across the ranks of a Communicator.
//
// A submission (one tensor, or a group such as a DDP bucket) is planned per tensor: raw fp32 or a
// codec, with a collective strategy and a number of partitions K. Each partition is one task; a
// pool of worker threads runs tasks in submission order, so encode and decode work of one
// partition overlaps the transfer of others. Small raw tensors of a group are fused into one
// message per peer, laid out by name (so that results do not depend on the group's order).
//
// Promises:
// - Every rank ends a collective with bit-identical results: sums run in a fixed order and every
//   final encoding is produced once and decoded by all ranks, its producer included.
// - Results are written into the user's tensor in place. Every error names the rank, the tensor
//   and the peer. After an error the tensor may hold partial results, unless
//   EngineOptions::keep_input_on_error, which stages results and writes the tensor only once the
//   whole submission succeeded (at the cost of one copy).
// - Non-finite input (NaN, +-Inf) is an error on every rank, not a silent NaN: compressed
//   strategies carry the failure in-band (the engine stays usable); the raw strategy detects it
//   in the identical result.
// - Every wait is bounded by the communicator's timeout; a dead or stalled peer fails every
//   later operation with that first error (the communicator is then failed for good).
// - Ranks must submit the same tensors (names, sizes, options) in the same order. The first
//   use of a tensor is checked across ranks and a mismatch raises MismatchError describing both
//   sides; later mismatches cannot be misread as data (message tags carry a digest of what was
//   submitted) and surface as a TimeoutError.
//
// Collective calls: every rank makes them, at the same point of its sequence of submissions.
// - The constructor: the ranks agree on each one's share of its machine's cores (below), and,
//   with a trace_directory, measure their clock offsets to rank 0.
// - allreduce, allreduce_group, reduce_scatter, all_gather and all_to_all on a tensor's first
//   use (or a change of its options): the call returns once every rank has submitted it and
//   the descriptions agree. With codec "auto",
//   the first plan (calibration, or agreement on a cached one; it first waits for the
//   submissions in flight) and the submissions at which the planner exchanges measured times
//   (EngineOptions::planner); a reduce_scatter's or all_gather's first "auto" also checks that
//   every rank asked for "auto" (MismatchError otherwise) before any rank plans.
// - plan() with codec "auto" where Planner::plan is one (its first call calibrates;
//   include/terse/planner.h), and calibrate().
// Local calls, which exchange nothing: later submissions of a tensor under a fixed codec,
// plan() of a fixed codec, synchronize(), save_state(), load_state(), bytes_sent().
//
// Threads: every call may be made from any thread. Submissions are taken one at a time in call
// order: one that waits for peers (a first use, a planner exchange) holds up later submissions,
// plan() with "auto" and load_state(), and nothing else: handles complete, callbacks run and
// synchronize(), save_state() and bytes_sent() return meanwhile. Ranks must still submit in the
// same order: threads of a rank that submit concurrently must be ordered so that every rank
// makes the same sequence.
//
// What an engine changes in its process: it starts its worker threads and a completion thread
// (under SCHED_BATCH; ProcessOptions::batch_scheduling, TERSE_SCHED=normal, opts out), and it
// lowers OpenBLAS's process-wide thread count to a rank's share of its machine's cores (a
// machine's cores over its ranks, the least over all ranks; left alone where
// ProcessOptions::blas_threads_chosen: OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or
// OMP_NUM_THREADS set, terse/environment.h), so that ranks sharing a machine do not
// oversubscribe it in PowerSGD's products, and every rank computes them with the same count
// (their last bits can depend on it). The count it found is restored when the last engine of
// the process is destroyed.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terse/communicator.h"
#include "terse/dtype.h"
#include "terse/error.h"
#include "terse/export.h"
#include "terse/options.h"
#include "terse/plan.h"

namespace terse {

struct HandleAccess;

// One tensor of a submission. `tensor` is read as this rank's contribution and overwritten with
// the result; it must stay valid and untouched until the submission completes.
struct TensorRef {
  TensorRef() = default;
  // An fp32 tensor.
  TensorRef(std::string name, std::span<float> data, AllreduceOptions options = {})
      : name(std::move(name)), tensor(data), options(std::move(options)) {}
  // A tensor of any DType (see Engine::allreduce).
  TensorRef(std::string name, TensorView tensor, AllreduceOptions options = {})
      : name(std::move(name)), tensor(tensor), options(std::move(options)) {}

  std::string name;
  TensorView tensor;
  AllreduceOptions options;
};

// The outcome of a submission. Copyable; all copies share it.
class TERSE_API Handle {
 public:
  Handle() = default;
  // Blocks until the submission completed; rethrows its error, if any. Bounded: every task of
  // a submission fails within the communicator's timeout.
  void wait() const;
  bool ready() const;
  // Runs f(error) once the submission completed (null error on success): immediately if it
  // already has, else on the engine's completion thread (one per engine, so callbacks run one
  // at a time, in completion order). f may submit more work; it must not wait for it.
  // wait() may return before callbacks registered earlier have run.
  void on_complete(std::function<void(std::exception_ptr)> f) const;

  struct State;

 private:
  friend class Engine;
  friend struct HandleAccess;  // Channel and other producers of handles
  explicit Handle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class TERSE_API Engine {
 public:
  // A collective (see above). Throws InvalidArgument for a null communicator or partition_bytes
  // below 4096.
  explicit Engine(std::shared_ptr<Communicator> comm, EngineOptions options = {});
  // Waits for every submitted task (each bounded by the timeout), completes their handles, then
  // stops the threads.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts an allreduce of one tensor. Throws at once (nothing submitted) for invalid options
  // (unknown codec, a strategy the codec cannot use, a name submitted twice in flight).
  Handle allreduce(std::string name, std::span<float> data, AllreduceOptions options = {});
  // The same for a tensor of any DType. A float16 or bfloat16 tensor is reduced a partition at a
  // time: its partition's values are read by the codec (fp16, bf16, minmax8 and onebit read them
  // directly; the others widen the piece they encode), sums and decoding run in the partition's
  // fp32 scratch, and the result is rounded to the tensor's type (nearest even) once, the same
  // on every rank. No fp32 copy of the whole tensor is made beyond one partition
  // (EngineOptions::partition_bytes of fp32) per running task. Codec "none" on a half tensor
  // sends its own precision: the summable ring with the codec of its format (fp16 or bf16),
  // which sums each hop in fp32 and rounds it, as DDP's allreduce of a half bucket sends half
  // values; its plan says so. Error-feedback residuals and codec state stay fp32.
  Handle allreduce(std::string name, TensorView tensor, AllreduceOptions options = {});
  // Starts one submission of several tensors (e.g. a DDP bucket), planned per tensor.
  Handle allreduce_group(std::vector<TensorRef> tensors);

  // ---- reduce-scatter, all-gather, all-to-all ----
  //
  // Collectives of their own, with an allreduce's life cycle: checked across ranks on first use
  // of a name (MismatchError on every rank naming the rank, the tensor and the operation),
  // partitioned and pipelined, bounded waits, NaN or Inf in any rank's input an error on every
  // rank (the engine stays usable), codec state (error feedback) kept per tensor name,
  // operation and shard and saved by save_state. Sizes that do not fit throw InvalidArgument at
  // once, nothing submitted. Input and output must stay valid and untouched until the handle
  // completes; the input is only read. After an error the output may hold partial results.
  // A name's state is its own per operation: reduce_scatter("w") and all_gather("w") do not
  // share error feedback, and may be in flight together.
  //
  // reduce_scatter: input holds size() * n elements, rank r's shard is [r*n, (r+1)*n); output
  // (n elements) receives the sum over ranks of this rank's shard (divided by size() when
  // averaging). A float16 or bfloat16 tensor is widened a partition at a time into fp32 scratch,
  // reduced there and rounded once; codec "none" on it sends its own format (strategy alltoall
  // with codec fp16 or bf16: every value exact, the rank-order fp32 sum rounded once).
  // Strategies (docs/design.md, "As built (reduce-scatter, all-gather, all-to-all)"):
  //   raw       fp32 to the shard's owner, summed in rank order: the exact rank-order sum.
  //   alltoall  every rank encodes each other shard once, the owner decodes and sums in fp32 in
  //             rank order with its own fp32 input (ZeRO++'s qgZ): one quantization per
  //             contribution, the owner's own exact. The default for a codec.
  //   sharded, ring, summable  the allreduce's own reduce-scatter half and final encoding: the
  //             shard is bit for bit the allreduce's result for the same elements when the
  //             allreduce's chunks are the shards (one partition, n a multiple of 64, the same
  //             name); otherwise the same operations on differently cut pieces.
  // In two levels over the job's hosts (CollectiveOptions::hierarchy, docs/topology.md), each
  // host first sums its ranks' contributions exactly in fp32 (in local rank order), then the
  // host sums cross with the strategy: raw is then the host-order sum of those host sums
  // (exact within fp32 rounding, not the rank-order sum), alltoall quantizes each host sum once.
  Handle reduce_scatter(std::string name, TensorView input, TensorView output,
                        CollectiveOptions options = {});
  // all_gather: input holds n elements (this rank's shard); output (size() * n elements)
  // receives rank r's shard at [r*n, (r+1)*n). Raw (codec none), the values travel as they
  // are (any DType). Compressed, each shard is encoded once by its owner and every rank, the
  // owner included, decodes the same bytes: every rank's output is bit-identical. A half tensor
  // is encoded from its own values and its decoded values rounded once. input may be the
  // output's own shard. In two levels each payload crosses once to every other host and is
  // handed on unchanged inside it: outputs stay bit-identical on every rank.
  Handle all_gather(std::string name, TensorView input, TensorView output,
                    CollectiveOptions options = {});
  // all_to_all: input is split into send_counts[p] elements for rank p (in rank order), and
  // output receives recv_counts[p] elements from rank p (in rank order); uneven splits and
  // zeros allowed, and the counts may change from call to call. Rank q's send_counts[r] must
  // equal rank r's recv_counts[q]: a disagreement fails every rank (MismatchError naming the
  // ranks and sizes). Compressed, each block is encoded once by its sender and decoded by its
  // receiver; a rank's block to itself is copied exactly. Any DType: a half tensor's blocks are
  // encoded from its values (widened a partition at a time) and decoded values rounded once.
  // Codec state is kept per peer and restarts when a block's size changes.
  Handle all_to_all(std::string name, TensorView input, std::span<const std::size_t> send_counts,
                    TensorView output, std::span<const std::size_t> recv_counts,
                    CollectiveOptions options = {});

  // What the engine will do with a tensor of n elements under options (validates them). With
  // codec "auto" the first call is a collective (see EngineOptions::planner).
  TensorPlan plan(std::size_t elements, const AllreduceOptions& options,
                  DType dtype = DType::kFloat32) const;

  // Calibrates codec "auto"'s planner now (EngineOptions::planner, or the engine's own): a
  // collective, every rank calls it at the same point of its submissions; it first waits for the
  // submissions in flight. Calibration measures the links and this machine (a few seconds), or
  // the ranks agree on a cached one. Later calls exchange nothing, and "auto" tensors then plan
  // without calibrating. Call it at start-up so that calibration does not run inside the first
  // backward pass, timed with other work on the same cores.
  void calibrate();

  // Blocks until every submission so far has completed and its callbacks have run (errors stay
  // with their handles). Local: it waits for this rank's submissions only.
  void synchronize();

  // Error-feedback residuals, codec state (PowerSGD's Q, DGC momentum) and step counters of
  // every tensor, in a portable byte string. load_state() must be called with no submission in
  // flight; it replaces the state of the tensors it names (their next allreduce continues bit
  // for bit) and throws DecodeError, changing nothing, on bytes it cannot use, and MismatchError,
  // changing nothing, on a state saved by another rank or with another world size (each rank
  // loads its own).
  std::vector<std::byte> save_state() const;
  void load_state(std::span<const std::byte> bytes);

  Communicator& communicator();
  // The options the engine runs with (as given; the tracer of a trace_directory filled in).
  const EngineOptions& options() const;
  int rank() const;
  int size() const;
  // The job's hosts, as agreed at construction (EngineOptions::topology): each host's ranks in
  // increasing order, hosts ordered by their lowest rank.
  const std::vector<std::vector<int>>& hosts() const;
  // Whether the ranks of this rank's host read each other's memory directly in the phases of
  // two-level collectives inside the host (EngineOptions::intra_host), rather than send.
  bool reads_directly_inside_host() const;

  // Bytes this rank has sent (payloads and fp32 chunks, without transport framing) so far.
  std::uint64_t bytes_sent() const;
  // The part of bytes_sent() that went to ranks on other hosts (hosts()): what this rank put on
  // its host's network link.
  std::uint64_t bytes_sent_across_hosts() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace terse
