// What every collective strategy shares: the context of one partition's collective, message tags,
// in-band failure payloads, and traced send/recv/encode/decode helpers.
//
// A strategy reduces one partition: it reads this rank's contribution `input` and writes the sum
// over ranks, divided by `divisor` (1, or the number of ranks to average), to `output`. output
// may alias input: strategies read each part of the input before they write that part.
// Averaging happens once, where a final result is produced (the owner of a shard or chunk
// divides its sum before the final encode), so that it costs a pass over 1/N of the data and
// every rank decodes the same averaged bytes. It runs on one worker thread and
// blocks on the network; the engine runs several partitions at once, which is the pipeline.
// Strategies post every receive of a step before waiting on its sends, so no pair of ranks can
// wait on each other.
//
// In-band failures: when a rank cannot encode (NaN/Inf input, a sum that overflowed) or cannot
// decode what it received, it does not stop the protocol. It sends a failure payload wherever a
// data payload was due, and every rank that receives one records it and forwards failure payloads
// in turn. Every rank thus completes the collective, learns of the failure and reports it, and
// the communicator stays usable.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kit/buffer_pool.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/plan.h"
#include "terse/trace.h"
#include "transport/topology.h"

namespace terse::collectives {

// The most partitions one tensor (or fused message) is split into: the engine clamps
// AllreduceOptions::partitions to it and the planner's cost model prices K as the engine clamps it.
inline constexpr int kMaxPartitions = 256;

// n elements split into `parts` nearly equal pieces whose boundaries are multiples of 64
// elements (cache lines and SIMD blocks), except the end. Pieces may be empty.
class Split {
 public:
  Split(std::size_t n, std::size_t parts) : n_(n), parts_(parts) {}
  std::size_t begin(std::size_t i) const {
    if (i >= parts_) return n_;
    std::size_t b = static_cast<std::size_t>(
        static_cast<unsigned __int128>(n_) * i / parts_);
    return b / 64 * 64;
  }
  std::size_t end(std::size_t i) const { return begin(i + 1); }
  std::size_t size(std::size_t i) const { return end(i) - begin(i); }
  std::size_t max_size() const {
    std::size_t m = 0;
    for (std::size_t i = 0; i < parts_; ++i) m = std::max(m, size(i));
    return m;
  }
  template <typename T>
  std::span<T> piece(std::span<T> s, std::size_t i) const {
    return s.subspan(begin(i), size(i));
  }

 private:
  std::size_t n_, parts_;
};

// Where each rank's chunk of a partition lies in the strategy's input (and, for an allreduce,
// its output). An allreduce cuts its partition evenly (Split); a reduce-scatter's chunk j is rank
// j's shard's piece of the partition, one shard size apart.
class Chunks {
 public:
  // Split(n, parts)'s pieces.
  static Chunks even(std::size_t n, int parts);
  // Chunk j at j * stride + begin, `size` elements each.
  static Chunks strided(std::size_t stride, std::size_t begin, std::size_t size, int parts);
  // Chunk j at begin[j], size[j] elements.
  static Chunks ranges(std::vector<std::size_t> begin, std::vector<std::size_t> size);
  std::size_t begin(int j) const { return begin_[j]; }
  std::size_t size(int j) const { return size_[j]; }
  std::size_t max_size() const;
  template <typename T>
  std::span<T> piece(std::span<T> s, int j) const {
    return s.subspan(begin_[j], size_[j]);
  }

 private:
  std::vector<std::size_t> begin_, size_;
};

// The first failure a partition saw. Ranks may see several; the smallest (kind, origin, index)
// wins, so that every rank reports the same one whatever the arrival order.
struct Failure {
  enum Kind : std::uint32_t {
    kNone = 0,
    kInputNotFinite = 1,  // origin's own input held NaN or Inf at index
    kSumNotFinite = 2,    // a partial sum at origin overflowed (inputs finite)
    kBadPayload = 3,      // origin received a payload it could not decode
    kCountMismatch = 4,   // origin expected a block of another size (all-to-all counts)
  };
  std::uint32_t kind = kNone;
  std::int64_t origin = -1;
  std::uint64_t index = 0;  // element index within the tensor
  std::string detail;       // origin's own message, when this rank is the origin

  bool any() const { return kind != kNone; }
  void merge(const Failure& other);
};

// Per-tensor codec state (error-feedback residuals, DGC momentum, PowerSGD's Q), one slot per
// piece a rank encodes (see each strategy for its slot numbering).
class StateSlots {
 public:
  // The slot's state, created for n elements on first use; null for stateless codecs.
  CodecState* get(const Codec& codec, int slot, std::size_t n);
  // Every created slot: (slot, n, saved bytes).
  struct Saved {
    int slot;
    std::uint64_t elements;
    std::vector<std::byte> bytes;
  };
  std::vector<Saved> save() const;
  // Creates and loads the listed slots (throws DecodeError; then nothing changes).
  void load(const Codec& codec, const std::vector<Saved>& saved);
  // Replaces these slots with states of `codec` that take over from `previous`'s (a change of
  // the tensor's spec, CodecState::adopt); a slot whose state hands nothing over starts fresh.
  void adopt(const Codec& codec, StateSlots& previous);
  void clear() { slots_.clear(); }

 private:
  struct Slot {
    std::size_t n = 0;
    std::unique_ptr<CodecState> state;
  };
  std::vector<Slot> slots_;
};

struct PartitionContext {
  Communicator* comm = nullptr;
  // The ranks this collective runs among, as ranks of comm in the group's order; empty: every
  // rank of comm. Strategies see the group only: rank(), size() and the peers they name are
  // group ranks, which post_send and post_recv map to comm's (a hierarchical collective runs
  // strategies inside a host and across hosts this way). Failure origins are comm's ranks.
  std::span<const int> group;
  int group_rank = 0;
  // Added to the state slot a strategy names: pieces that one rank reduces in several groups
  // keep their codec states apart.
  int state_base = 0;
  std::string tensor;    // tensor name (or the fused group's label)
  int partition = 0;
  int partitions = 1;
  std::size_t offset = 0;  // of this partition within the tensor
  // Where a gathered input came from, for a hierarchical reduce-scatter, whose phases reduce
  // the shards reordered by host: with gathered_piece > 0, input element q is the tensor's
  // element gathered_origins[q / gathered_piece] + q % gathered_piece. Failures name tensor
  // elements through element(), so that every phase reports the same index for one element.
  std::size_t gathered_piece = 0;
  std::span<const std::size_t> gathered_origins;
  std::uint64_t tag_base = 0;  // message tags are tag_base | index, index < 2^16

  std::span<const float> input;
  std::span<float> output;
  int divisor = 1;
  // A half-precision tensor's input (16-bit values of `dtype`; empty for fp32). Strategies then
  // read their input only through encode_or_fail and add_input, which read these values without
  // an fp32 copy, and `input` is the partition's fp32 scratch (its size is what they use). Not
  // for round codecs: the engine gives those a widened fp32 input.
  std::span<const std::uint16_t> half_input;
  DType dtype = DType::kFloat32;

  const Codec* codec = nullptr;        // null: raw fp32
  const RoundCodec* rounds = nullptr;  // multi-round codecs (PowerSGD)
  StateSlots* states = nullptr;
  EncodeContext encode;  // seed, step, tensor id of this partition, rank

  kit::BufferPool* pool = nullptr;
  Workspace* workspace = nullptr;
  Tracer* tracer = nullptr;
  std::uint32_t thread = 0;
  std::atomic<std::uint64_t>* bytes_sent = nullptr;
  // With both: bytes sent to ranks on other hosts (host_of: comm rank -> host) are counted in
  // bytes_across too.
  std::span<const int> host_of;
  std::atomic<std::uint64_t>* bytes_across = nullptr;
  // Per comm rank, its process id, where the group's ranks read each other's memory directly
  // (a hierarchical collective's phases inside a host whose ranks can, transport/direct_read.h):
  // raw_reduce_scatter and all_gather_bytes then send each peer where its bytes are and the
  // peer copies them itself. Empty: messages carry the bytes.
  std::span<const std::int64_t> direct_pids;

  Failure failure;

  int rank() const { return group.empty() ? comm->rank() : group_rank; }
  int size() const { return group.empty() ? comm->size() : static_cast<int>(group.size()); }
  // Group rank j as a rank of comm (for messages, failures and the transport).
  int comm_rank(int j) const { return group.empty() || j < 0 ? j : group[j]; }
  std::uint64_t tag(std::uint32_t index) const { return tag_base | index; }
  // The tensor element at position `at` of this partition's input (for failures).
  std::uint64_t element(std::size_t at) const {
    if (gathered_piece == 0) return offset + at;
    return gathered_origins[at / gathered_piece] + at % gathered_piece;
  }
  // "fc1.weight (partition 2/4)", for error messages and transport labels.
  std::string label() const;
};

// Records a traced stage from construction to destruction (no-op without a tracer).
class Stage {
 public:
  Stage(PartitionContext& ctx, const char* stage, int peer = -1, std::uint64_t bytes = 0);
  ~Stage();
  void set_bytes(std::uint64_t b) { bytes_ = b; }

 private:
  PartitionContext& ctx_;
  const char* stage_;
  int peer_;
  std::uint64_t bytes_;
  std::int64_t begin_;
};

Request post_send(PartitionContext& ctx, int peer, std::uint32_t index,
                  std::span<const std::byte> data);
Request post_recv(PartitionContext& ctx, int peer, std::uint32_t index, std::span<std::byte> data);
// Waits for a request, traced as "wait" (sends) or "recv" (receives).
void wait(PartitionContext& ctx, Request& request, bool is_send, int peer, std::uint64_t bytes);

// Bytes of a failure message: a header and the element index.
inline constexpr std::size_t kFailureBytes = Codec::kHeaderBytes + 8;

// Bytes a receive area needs for any message about n elements (a payload or a failure).
std::size_t message_capacity(const Codec& codec, std::size_t n);

// Encodes x, the slice at `offset` elements into this partition, with state slot `slot`, into
// out (message_capacity bytes). `piece` (the chunk or shard index) is mixed into the RNG key:
// every rank encodes piece c with the same shared key (random-k picks the same indices) and
// its own pieces with independent noise. Writes a failure payload instead when the partition has already
// failed or x holds NaN/Inf (the failure is recorded; `sum` says whether x is a partial sum of
// several ranks rather than this rank's input; without it, x is the input at `offset`, read from
// ctx.half_input for a half tensor). Returns the message.
std::span<const std::byte> encode_or_fail(PartitionContext& ctx, std::span<const float> x,
                                          std::size_t offset, int piece, int slot,
                                          std::span<std::byte> out, bool sum = false);
// acc = (accumulate ? acc + : ) this rank's input at `offset` (acc.size() elements), widened from
// ctx.half_input for a half tensor. Records kInputNotFinite and returns false for NaN or Inf.
bool add_input(PartitionContext& ctx, std::size_t offset, std::span<float> acc, bool accumulate);
// The EncodeContext a strategy uses for piece `piece` with state slot `slot`.
EncodeContext piece_context(PartitionContext& ctx, int piece, int slot, std::size_t n);

// The message at the start of a receive area (its length comes from its header).
std::span<const std::byte> received_message(PartitionContext& ctx, std::span<const std::byte> area,
                                            int peer);

// Writes a failure payload for the partition's recorded failure into out; returns the message.
std::span<const std::byte> failure_message(const PartitionContext& ctx, std::span<std::byte> out);

// Checks the kind of a received message: false (recording the failure) for a failure payload,
// true for a data payload (not yet validated: the codec's decode or combine does that).
bool accept_message(PartitionContext& ctx, std::span<const std::byte> message, int peer);

// Decodes a received message into y. Returns false, recording the failure, for a failure
// payload or a payload that does not decode (y is then unspecified).
bool decode_or_record(PartitionContext& ctx, std::span<const std::byte> message,
                      std::span<float> y, DecodeMode mode, int peer);

// The end of a ring's reduce-scatter (ring and summable): this rank's final payload, the
// complete sum of the next rank's chunk, goes to that rank, its owner, and the final payload of
// this rank's own chunk, received from the previous rank into `area` (the receive `final_rx`,
// message `index`, at most `capacity` bytes), is decoded into `shard`. A single rank decodes its
// own payload.
void hand_to_owners(PartitionContext& ctx, std::span<const std::byte> payload, Request& final_rx,
                    std::span<const std::byte> area, std::size_t capacity, std::uint32_t index,
                    std::span<float> shard);

// The last phase of sharded, ring and summable: every rank owns one piece of the partition
// and sends that piece's final payload to every other rank; every rank, the owner included,
// decodes every final payload, so all end with the same bytes decoded the same way.
class FinalExchange {
 public:
  // Posts the receives from every other rank (message `index`) into n areas of `capacity`
  // bytes each, taken from the pool.
  FinalExchange(PartitionContext& ctx, std::size_t capacity, std::uint32_t index);
  // Sends our final payload to every other rank (the next rank first), decodes it into
  // out(rank), then waits for and decodes owner j's payload into out(j) (the previous rank
  // first, as it sent to us first), and waits for the sends.
  template <typename Out>
  void finish(std::span<const std::byte> mine, Out&& out) {
    start(mine);
    decode_or_record(ctx_, mine, out(ctx_.rank()), DecodeMode::kOverwrite, ctx_.rank());
    const int n = ctx_.size();
    for (int k = 1; k < n; ++k) {
      const int j = (ctx_.rank() + n - k) % n;
      decode_or_record(ctx_, receive(j), out(j), DecodeMode::kOverwrite, j);
    }
    end(mine.size());
  }

 private:
  void start(std::span<const std::byte> mine);
  std::span<const std::byte> receive(int owner);
  void end(std::size_t bytes);
  PartitionContext& ctx_;
  std::size_t capacity_;
  std::uint32_t index_;
  kit::Buffer areas_;
  std::vector<Request> rx_, tx_;
};

// The status round that ends a reduce-scatter partition, or an all-to-all partition whose
// counts disagree, where a failure (NaN input, a bad payload, mismatched counts) reaches only
// some ranks: every rank sends its
// recorded failure (or none) to every other rank and merges theirs (message `index`), so that
// every rank ends with the same failure.
void agree_on_failure(PartitionContext& ctx, std::uint32_t index);
// Moves bytes among the group's ranks by direct reads of each other's memory (ctx.direct_pids):
// every rank tells each peer j where offer(j) lies (message `index`), reads each peer i's offer
// into into(i) in rank order, calling arrived(i) for each rank i in rank order (itself
// included, without a read) once its bytes are in, and tells i it has read them (message
// index + 1). Returns once every peer has read this rank's offers, which must stay unchanged
// until then. A read that fails (a dead peer, a size that does not match) is recorded as a bad
// payload at element `at`, and arrived(i) is skipped; the protocol still completes.
void direct_exchange(PartitionContext& ctx, std::uint32_t index, std::uint64_t at,
                     const std::function<std::span<const std::byte>(int)>& offer,
                     const std::function<std::span<std::byte>(int)>& into,
                     const std::function<void(int)>& arrived);

// The message index of that round: above every index a strategy uses.
inline constexpr std::uint32_t kStatusIndex = 0xfff0;

// y /= ctx.divisor (in place; nothing when averaging is off or there is one rank).
void apply_divisor(PartitionContext& ctx, std::span<float> y);

// ---- the strategies (one file each) ---------------------------------------------------------

// fp32 ring allreduce of ctx.input into ctx.output: reduce-scatter, then allgather.
void raw_allreduce(PartitionContext& ctx);
// The same ring on explicit spans with message indices from `first_index` (2(N-1) of them);
// divides by `divisor` like the strategies do.
void raw_ring(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
              std::uint32_t first_index, int divisor);
// Whether the engine gathers a raw partition of `elements` floats on `ranks` ranks
// (EngineOptions::gather_bytes): when the (ranks - 1) copies it sends fit in gather_bytes.
inline bool gathers(std::size_t elements, int ranks, std::size_t gather_bytes) {
  return ranks > 1 && static_cast<std::size_t>(ranks - 1) * elements * sizeof(float) <= gather_bytes;
}
// The same sum gathered: one message step (index), every rank's whole input to every other rank,
// summed in rank order; for small messages (see allreduce/raw.cpp).
void raw_gather(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                std::uint32_t index, int divisor);
void allgather_allreduce(PartitionContext& ctx);
// The sums these strategies are built on, of ctx.codec's encodings of `input` into `output`
// (which may alias it; not divided), with message indices from `first_index`:
// every rank's whole encoding sent to every other rank, summed in rank order (one step) ...
void gather_sum(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                std::uint32_t first_index);
// ... or the summable ring (N - 1 steps and the final exchange: N indices).
void summable_ring(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                   std::uint32_t first_index);
// A multi-round codec (ctx.rounds): each round's sum on a ring (summable) or gathered
// (allgather); see allreduce/rounds.cpp.
void rounds_allreduce(PartitionContext& ctx, bool gather);
void sharded_allreduce(PartitionContext& ctx);
void ring_allreduce(PartitionContext& ctx);
void summable_allreduce(PartitionContext& ctx);

// ---- hierarchical: exact inside a host, any strategy across hosts (allreduce/hierarchical.cpp)
//
// An allreduce of ctx's partition (ctx spans every rank of comm) in three phases: an fp32
// reduce-scatter among the ranks of each host, the allreduce of each host shard across hosts
// among the ranks holding the same shard (`cross` runs the strategy on that group's context),
// and an all-gather inside each host. The partition is cut into `slots` slots (as many as the
// largest host has ranks; 1 for a codec that needs the whole partition); a host of fewer ranks
// gives some ranks several consecutive slots (each then crosses in its own group, in slot
// order, with codec states apart) and some none. Results are bit-identical
// on every rank; a failure anywhere reaches every rank. `status_round`: the cross strategy does
// not carry every failure in band (raw fp32, a multi-round codec's fp32 round sums), so its
// group ends with a status round.
void hierarchical_allreduce(PartitionContext& ctx, const transport::Topology& topology, int slots,
                            bool status_round,
                            const std::function<void(PartitionContext&)>& cross);
// The slots rank `local` of a host of `ranks` ranks owns when the largest host has `slots`
// ranks: [first, end).
inline int first_slot(int local, int ranks, int slots) { return local * slots / ranks; }

// ---- reduce-scatter, all-gather, all-to-all (one file each) ---------------------------------
//
// The reduce-scatter halves of the strategies above: chunk j of the partition (chunks, in
// ctx.input) is reduced into rank j's shard; `shard` (this rank's piece of its output,
// chunks.size(rank) elements) receives this rank's, divided by ctx.divisor. Each ends with
// agree_on_failure. Strategy kRaw: fp32 sent once to its owner, summed in rank order;
// kAllToAll: every rank encodes each other owner's chunk once, the owner sums the decoded
// contributions and its own fp32 input in rank order (one quantization per contribution);
// kSharded, kRing, kSummable: the allreduce's own reduce-scatter half and its final encoding,
// decoded by the chunk's owner alone, so that the shard is the allreduce's result for the chunk.
// `finish`, if given, runs after the shard is complete and before the status round, so that a
// failure it records (a half tensor's sum that overflows when rounded) reaches every rank.
void reduce_scatter(PartitionContext& ctx, Strategy strategy, const Chunks& chunks,
                    std::span<float> shard, const std::function<void()>& finish = {});
// The halves themselves (ring: the owner of chunk c is rank c - 1, and sends its final payload
// on to rank c; summable leaves dividing to the caller).
void raw_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard);
void sharded_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard,
                            bool final_encode);
void ring_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard);
void summable_reduce_scatter(PartitionContext& ctx, const Chunks& chunks,
                             std::span<float> shard);

// All-gather of ctx.input (this rank's piece) with ctx.codec: encoded once by its owner (state
// slot 0), and every rank, the owner included, decodes every owner's payload into out(j)
// (chunks.size(j) elements of `output` at chunks.begin(j)). A failure payload reaches every
// rank, so no status round is needed.
void all_gather(PartitionContext& ctx, const Chunks& chunks, std::span<float> output);
// The same for raw bytes (any element type): `mine` goes to every rank as it is, and rank j's
// bytes land in out(j).
void all_gather_bytes(PartitionContext& ctx, std::span<const std::byte> mine,
                      const std::function<std::span<std::byte>(int)>& out);

// ---- two levels over the hosts (reduce_scatter.cpp, all_gather.cpp) ---------------------------
//
// Shard j's contribution from host h (reduce-scatter) or its copy for host h (all-gather)
// crosses the network once, between j and its carrier on h: j itself on its own host, else
// the rank of h whose local rank is j's modulo h's rank count. On hosts of equal size the
// carriers of a local rank's shards are the ranks of that local rank on every host (one group
// per local rank); on uneven ones a host of fewer ranks gives some ranks several shards.
inline int carrier(const transport::Topology& t, int h, int j) {
  if (t.host_of[j] == h) return j;
  const std::vector<int>& host = t.hosts[h];
  return host[static_cast<std::size_t>(t.local_of[j]) % host.size()];
}
// The reduce-scatter of ctx's partition (ctx spans every rank; chunks and shard as for
// reduce_scatter, every chunk of one size) in two levels: an exact fp32 reduce-scatter inside
// each host leaves each rank its host's sums of the shards it carries; then each carrier's sum
// goes to the shard's owner with `strategy`: raw (fp32, summed by the owner in host order) and
// alltoall (encoded once per host sum with state slot = owner, the owner's own host sum exact)
// on any layout; sharded, ring and summable among the group of one local rank (hosts of equal
// size only: InvalidArgument otherwise). Then `finish` and one status round among every rank.
void hierarchical_reduce_scatter(PartitionContext& ctx, const transport::Topology& topology,
                                 Strategy strategy, const Chunks& chunks, std::span<float> shard,
                                 const std::function<void()>& finish = {});
// all_gather in two levels: each owner encodes its piece once (state slot 0) and sends it to its
// carrier on every other host; each rank hands its own payload and the ones it carries to the
// other ranks of its host, unchanged. Every rank decodes every owner's same bytes: outputs are
// bit-identical, and a failure payload reaches every rank.
void hierarchical_all_gather(PartitionContext& ctx, const transport::Topology& topology,
                             const Chunks& chunks, std::span<float> output);
// The same for raw bytes: `mine` crosses to each carrier and is handed on inside each host; rank
// j's bytes land in out(j).
void hierarchical_all_gather_bytes(PartitionContext& ctx, const transport::Topology& topology,
                                   std::span<const std::byte> mine,
                                   const std::function<std::span<std::byte>(int)>& out);

// All-to-all of one partition. Block q of this rank's input (ctx.input, or `input` raw) goes to
// rank q and lands at recv_begin[q] of the receiver's output: raw bytes, or encoded once by
// their sender with state slot q and decoded by the receiver. One message per peer carries a
// header (the block's size, the sender's failure, digests of its counts) and the block (message
// 1; a block too large to come with it follows as message 2), so that a block of another size
// than the receiver expects is drained and reported instead of misread, and a sender's NaN
// reaches every rank without a round of its own. When the digests show that some counts
// disagree, every rank ends with agree_on_failure. A failure recorded before the call (the
// caller's NaN scan) is sent in place of the blocks. `element_bytes`: 4 for fp32, 2 for a half
// tensor sent raw.
struct AllToAllBlocks {
  std::vector<std::size_t> send_begin, send_size;  // elements of ctx.input (or the raw tensor)
  std::vector<std::size_t> recv_begin, recv_size;  // elements of the output
};
void all_to_all(PartitionContext& ctx, const AllToAllBlocks& blocks, std::span<float> output);
void all_to_all_bytes(PartitionContext& ctx, const AllToAllBlocks& blocks,
                      std::span<const std::byte> input, std::span<std::byte> output,
                      std::size_t element_bytes);

}  // namespace terse::collectives
