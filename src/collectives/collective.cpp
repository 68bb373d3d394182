// Shared machinery of the strategies: state slots, tracing, traced transfers, failure payloads.
#include "collectives/collective.h"

#include <fmt/format.h>

#include <cstring>
#include <tuple>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/hash.h"
#include "transport/direct_read.h"

namespace terse::collectives {

// A failure payload is a header with this codec id, the kind in the digest field, the origin
// rank in the element-count field, and an 8-byte payload holding the element index.
namespace {

void write_failure(const Failure& f, std::span<std::byte> out) {
  wire::Writer w(out);
  w.put(wire::kMagic);
  w.put(wire::kVersion);
  w.put(wire::kFailureId);
  w.put(f.kind);
  w.put(static_cast<std::uint64_t>(f.origin));
  w.put(std::uint64_t{8});
  w.put(f.index);
}
}  // namespace

void Failure::merge(const Failure& other) {
  if (!other.any()) return;
  if (!any() || std::tie(other.kind, other.origin, other.index) < std::tie(kind, origin, index)) {
    *this = other;
  }
}

std::string PartitionContext::label() const {
  if (partitions <= 1) return tensor;
  return fmt::format("{} (partition {}/{})", tensor, partition + 1, partitions);
}

// ---- chunks ---------------------------------------------------------------------------------

Chunks Chunks::even(std::size_t n, int parts) {
  const Split split(n, static_cast<std::size_t>(parts));
  Chunks c;
  for (int j = 0; j < parts; ++j) {
    c.begin_.push_back(split.begin(j));
    c.size_.push_back(split.size(j));
  }
  return c;
}

Chunks Chunks::ranges(std::vector<std::size_t> begin, std::vector<std::size_t> size) {
  Chunks c;
  c.begin_ = std::move(begin);
  c.size_ = std::move(size);
  return c;
}

Chunks Chunks::strided(std::size_t stride, std::size_t begin, std::size_t size, int parts) {
  Chunks c;
  for (int j = 0; j < parts; ++j) {
    c.begin_.push_back(stride * static_cast<std::size_t>(j) + begin);
    c.size_.push_back(size);
  }
  return c;
}

std::size_t Chunks::max_size() const {
  std::size_t m = 0;
  for (std::size_t s : size_) m = std::max(m, s);
  return m;
}

// ---- state slots ----------------------------------------------------------------------------

CodecState* StateSlots::get(const Codec& codec, int slot, std::size_t n) {
  if (!codec.traits().stateful) return nullptr;
  if (slot < 0) throw InvalidArgument("state slot < 0");
  if (static_cast<std::size_t>(slot) >= slots_.size()) slots_.resize(slot + 1);
  Slot& s = slots_[slot];
  if (!s.state || s.n != n) {
    s.state = codec.make_state(n);
    s.n = n;
  }
  return s.state.get();
}

std::vector<StateSlots::Saved> StateSlots::save() const {
  std::vector<Saved> out;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].state) continue;
    Saved s{static_cast<int>(i), slots_[i].n, {}};
    slots_[i].state->save(s.bytes);
    out.push_back(std::move(s));
  }
  return out;
}

void StateSlots::load(const Codec& codec, const std::vector<Saved>& saved) {
  std::vector<Slot> fresh;
  for (const auto& s : saved) {
    if (s.slot < 0 || s.slot > (1 << 20)) throw DecodeError("engine state: bad state slot");
    if (static_cast<std::size_t>(s.slot) >= fresh.size()) fresh.resize(s.slot + 1);
    auto state = codec.make_state(s.elements);
    if (!state) {
      throw DecodeError(fmt::format("engine state: codec {} keeps no state", codec.spec()));
    }
    state->load(s.bytes);
    fresh[s.slot] = Slot{s.elements, std::move(state)};
  }
  slots_ = std::move(fresh);
}

void StateSlots::adopt(const Codec& codec, StateSlots& previous) {
  slots_.clear();
  if (!codec.traits().stateful) return;
  slots_.resize(previous.slots_.size());
  for (std::size_t i = 0; i < previous.slots_.size(); ++i) {
    Slot& old = previous.slots_[i];
    if (!old.state) continue;
    auto state = codec.make_state(old.n);
    if (state && state->adopt(*old.state)) slots_[i] = Slot{old.n, std::move(state)};
  }
}

// ---- tracing and transfers ------------------------------------------------------------------

Stage::Stage(PartitionContext& ctx, const char* stage, int peer, std::uint64_t bytes)
    : ctx_(ctx), stage_(stage), peer_(peer), bytes_(bytes),
      begin_(ctx.tracer != nullptr ? trace_now_ns() : 0) {}

Stage::~Stage() {
  if (ctx_.tracer == nullptr) return;
  TraceEvent e;
  e.stage = stage_;
  e.tensor = ctx_.tensor;
  e.partition = ctx_.partition;
  e.peer = ctx_.comm_rank(peer_);
  e.bytes = bytes_;
  e.begin_ns = begin_;
  e.end_ns = trace_now_ns();
  e.thread = ctx_.thread;
  ctx_.tracer->record(std::move(e));
}

Request post_send(PartitionContext& ctx, int peer, std::uint32_t index,
                  std::span<const std::byte> data) {
  const int to = ctx.comm_rank(peer);
  if (ctx.bytes_sent != nullptr) ctx.bytes_sent->fetch_add(data.size(), std::memory_order_relaxed);
  if (ctx.bytes_across != nullptr && ctx.host_of[to] != ctx.host_of[ctx.comm->rank()]) {
    ctx.bytes_across->fetch_add(data.size(), std::memory_order_relaxed);
  }
  return ctx.comm->send(to, ctx.tag(index), data, ctx.label());
}

Request post_recv(PartitionContext& ctx, int peer, std::uint32_t index,
                  std::span<std::byte> data) {
  return ctx.comm->recv(ctx.comm_rank(peer), ctx.tag(index), data, ctx.label());
}

void wait(PartitionContext& ctx, Request& request, bool is_send, int peer, std::uint64_t bytes) {
  Stage s(ctx, is_send ? "send" : "recv", peer, bytes);
  request.wait();
}

void direct_exchange(PartitionContext& ctx, std::uint32_t index, std::uint64_t at,
                     const std::function<std::span<const std::byte>(int)>& offer,
                     const std::function<std::span<std::byte>(int)>& into,
                     const std::function<void(int)>& arrived) {
  const int n = ctx.size(), r = ctx.rank();
  struct Where {
    std::uint64_t address, bytes;
  };
  std::vector<Where> theirs(n), ours(n);
  std::vector<std::uint64_t> read_marks(n);
  static constexpr std::uint64_t kRead = 1;  // the "read" message's content
  std::vector<Request> where_rx(n), where_tx(n), read_rx(n), read_tx(n);
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    where_rx[j] = post_recv(ctx, j, index, std::as_writable_bytes(std::span(&theirs[j], 1)));
    read_rx[j] = post_recv(ctx, j, index + 1, std::as_writable_bytes(std::span(&read_marks[j], 1)));
  }
  for (int k = 1; k < n; ++k) {
    const int j = (r + k) % n;
    const std::span<const std::byte> mine = offer(j);
    ours[j] = {reinterpret_cast<std::uint64_t>(mine.data()), mine.size()};
    // Counted as sent: these bytes reach j as a message's would, through j's read.
    if (ctx.bytes_sent != nullptr) ctx.bytes_sent->fetch_add(mine.size(), std::memory_order_relaxed);
    where_tx[j] = post_send(ctx, j, index, std::as_bytes(std::span(&ours[j], 1)));
  }
  for (int i = 0; i < n; ++i) {
    if (i == r) {
      arrived(i);
      continue;
    }
    wait(ctx, where_rx[i], false, i, sizeof(Where));
    const std::span<std::byte> dst = into(i);
    std::string error;
    if (theirs[i].bytes != dst.size()) {
      error = fmt::format("it offers {} bytes where {} were expected", theirs[i].bytes, dst.size());
    } else if (!dst.empty()) {
      Stage s(ctx, "recv", i, dst.size());
      error = transport::read_process(ctx.direct_pids[ctx.comm_rank(i)], theirs[i].address, dst);
    }
    read_tx[i] = post_send(ctx, i, index + 1, std::as_bytes(std::span(&kRead, 1)));
    if (error.empty()) {
      arrived(i);
    } else if (!ctx.failure.any()) {
      ctx.failure.merge({Failure::kBadPayload, ctx.comm->rank(), at,
                         fmt::format("rank {}: cannot read rank {}'s bytes for {} directly: {}",
                                     ctx.comm->rank(), ctx.comm_rank(i), ctx.label(), error)});
    }
  }
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    wait(ctx, where_tx[j], true, j, sizeof(Where));
    wait(ctx, read_tx[j], true, j, sizeof(std::uint64_t));
    wait(ctx, read_rx[j], false, j, sizeof(std::uint64_t));  // j has read ours
  }
}

void agree_on_failure(PartitionContext& ctx, std::uint32_t index) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) return;
  // kind, origin, index: the detail text stays with the origin.
  struct Status {
    std::uint32_t kind;
    std::uint32_t pad;
    std::int64_t origin;
    std::uint64_t index;
  };
  const Status mine{ctx.failure.kind, 0, ctx.failure.origin, ctx.failure.index};
  std::vector<Status> theirs(n);
  std::vector<Request> rx(n), tx(n);
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    rx[j] = post_recv(ctx, j, index, std::as_writable_bytes(std::span(&theirs[j], 1)));
  }
  for (int k = 1; k < n; ++k) {
    const int j = (r + k) % n;
    tx[j] = post_send(ctx, j, index, std::as_bytes(std::span(&mine, 1)));
  }
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    wait(ctx, rx[j], false, j, sizeof(Status));
    const Status& s = theirs[j];
    if (s.kind == Failure::kNone) continue;
    Failure f;
    if (s.kind > Failure::kCountMismatch || s.origin < -1 || s.origin >= ctx.comm->size()) {
      f = Failure{Failure::kBadPayload, ctx.comm->rank(), ctx.offset, {}};
      f.detail = fmt::format("rank {}: {}: malformed status message from peer {}",
                             ctx.comm->rank(), ctx.label(), ctx.comm_rank(j));
    } else {
      f = Failure{s.kind, s.origin, s.index, {}};
    }
    ctx.failure.merge(f);
  }
  for (int j = 0; j < n; ++j) {
    if (j != r) wait(ctx, tx[j], true, j, sizeof(Status));
  }
}

void apply_divisor(PartitionContext& ctx, std::span<float> y) {
  if (ctx.divisor <= 1 || y.empty()) return;
  Stage s(ctx, "merge", -1, y.size_bytes());
  kit::divide_to(y, static_cast<float>(ctx.divisor), y);
}

// ---- the final exchange -------------------------------------------------------------------

FinalExchange::FinalExchange(PartitionContext& ctx, std::size_t capacity, std::uint32_t index)
    : ctx_(ctx), capacity_(capacity), index_(index),
      areas_(ctx.pool->acquire(capacity * ctx.size())), rx_(ctx.size()), tx_(ctx.size()) {
  for (int j = 0; j < ctx.size(); ++j) {
    if (j != ctx.rank()) {
      rx_[j] = post_recv(ctx, j, index, areas_.bytes().subspan(capacity * j, capacity));
    }
  }
}

void FinalExchange::start(std::span<const std::byte> mine) {
  const int n = ctx_.size();
  for (int k = 1; k < n; ++k) {
    const int j = (ctx_.rank() + k) % n;
    tx_[j] = post_send(ctx_, j, index_, mine);
  }
}

std::span<const std::byte> FinalExchange::receive(int owner) {
  wait(ctx_, rx_[owner], false, owner, capacity_);
  return received_message(ctx_, areas_.bytes().subspan(capacity_ * owner, capacity_), owner);
}

void FinalExchange::end(std::size_t bytes) {
  for (int j = 0; j < ctx_.size(); ++j) {
    if (j != ctx_.rank()) wait(ctx_, tx_[j], true, j, bytes);
  }
}

// ---- payloads -------------------------------------------------------------------------------

std::size_t message_capacity(const Codec& codec, std::size_t n) {
  return std::max(codec.max_encoded_bytes(n), kFailureBytes);
}

EncodeContext piece_context(PartitionContext& ctx, int piece, int slot, std::size_t n) {
  EncodeContext ec = ctx.encode;
  ec.tensor = kit::combine_keys(ctx.encode.tensor, static_cast<std::uint64_t>(piece));
  ec.state = ctx.states->get(*ctx.codec, ctx.state_base + slot, n);
  ec.workspace = ctx.workspace;
  return ec;
}

std::span<const std::byte> encode_or_fail(PartitionContext& ctx, std::span<const float> x,
                                          std::size_t offset, int piece, int slot,
                                          std::span<std::byte> out, bool sum) {
  if (!ctx.failure.any()) {
    const bool half = !sum && !ctx.half_input.empty();
    Stage s(ctx, "encode", -1, x.size() * (half ? 2 : 4));
    EncodeContext ec = piece_context(ctx, piece, slot, x.size());
    std::span<const std::uint16_t> h;
    if (half) h = ctx.half_input.subspan(offset, x.size());
    try {
      const std::size_t n =
          half ? ctx.codec->encode(h, ctx.dtype, out, ec) : ctx.codec->encode(x, out, ec);
      return out.first(n);
    } catch (const InvalidArgument&) {
      const std::size_t bad = half ? kit::find_non_finite(h, ctx.dtype) : kit::find_non_finite(x);
      if (bad == x.size()) throw;  // not a finiteness problem: a bug, fail the whole job
      Failure f;
      f.kind = sum ? Failure::kSumNotFinite : Failure::kInputNotFinite;
      f.origin = ctx.comm->rank();
      f.index = ctx.element(offset + bad);
      ctx.failure.merge(f);
    }
  }
  return failure_message(ctx, out);
}

bool add_input(PartitionContext& ctx, std::size_t offset, std::span<float> acc, bool accumulate) {
  if (!ctx.half_input.empty()) {
    auto h = ctx.half_input.subspan(offset, acc.size());
    if (kit::widen(ctx.dtype, h.data(), acc, accumulate)) return true;
    ctx.failure.merge({Failure::kInputNotFinite, ctx.comm->rank(),
                       ctx.element(offset + kit::find_non_finite(h, ctx.dtype)), {}});
    return false;
  }
  std::span<const float> own = ctx.input.subspan(offset, acc.size());
  if (kit::store_or_add(own.data(), acc, accumulate)) return true;
  ctx.failure.merge(
      {Failure::kInputNotFinite, ctx.comm->rank(), ctx.element(offset + kit::find_non_finite(own)), {}});
  return false;
}

std::span<const std::byte> received_message(PartitionContext& ctx,
                                            std::span<const std::byte> area, int peer) {
  if (area.size() < Codec::kHeaderBytes) return area;
  std::uint64_t payload = 0;
  std::memcpy(&payload, area.data() + 16, 8);
  if (payload > area.size() - Codec::kHeaderBytes) {
    // Cannot come from a peer that uses the same codec; the decoder will reject it.
    Failure f{Failure::kBadPayload, ctx.comm->rank(), ctx.offset, {}};
    f.detail = fmt::format("rank {}: {}: message from peer {} announces {} payload bytes, more "
                           "than the {} its codec can produce",
                           ctx.comm->rank(), ctx.label(), ctx.comm_rank(peer), payload,
                           area.size());
    ctx.failure.merge(f);
    return area;
  }
  return area.first(Codec::kHeaderBytes + payload);
}

std::span<const std::byte> failure_message(const PartitionContext& ctx,
                                           std::span<std::byte> out) {
  write_failure(ctx.failure, out);
  return out.first(kFailureBytes);
}

bool accept_message(PartitionContext& ctx, std::span<const std::byte> message, int peer) {
  if (message.size() != kFailureBytes || static_cast<std::uint8_t>(message[3]) != wire::kFailureId ||
      message[0] != std::byte{0x54} || message[1] != std::byte{0x53}) {
    return true;
  }
  Failure f;
  std::memcpy(&f.kind, message.data() + 4, 4);
  std::uint64_t origin = 0;
  std::memcpy(&origin, message.data() + 8, 8);
  std::memcpy(&f.index, message.data() + 24, 8);
  if (f.kind < Failure::kInputNotFinite || f.kind > Failure::kCountMismatch ||
      (origin >= static_cast<std::uint64_t>(ctx.comm->size()) && origin != ~std::uint64_t{0})) {
    f = Failure{Failure::kBadPayload, ctx.comm->rank(), ctx.offset, {}};
    f.detail = fmt::format("rank {}: {}: malformed failure message from peer {}",
                           ctx.comm->rank(), ctx.label(), ctx.comm_rank(peer));
  } else {
    f.origin = static_cast<std::int64_t>(origin);
  }
  ctx.failure.merge(f);
  return false;
}

bool decode_or_record(PartitionContext& ctx, std::span<const std::byte> message,
                      std::span<float> y, DecodeMode mode, int peer) {
  if (!accept_message(ctx, message, peer)) return false;
  if (ctx.failure.any()) return false;  // nothing decoded is used once the partition failed
  Stage s(ctx, "decode", peer, y.size() * 4);
  try {
    ctx.codec->decode(message, y, mode);
    return true;
  } catch (const DecodeError& e) {
    Failure f{Failure::kBadPayload, ctx.comm->rank(), ctx.offset, {}};
    f.detail = fmt::format("rank {}: {}: payload from peer {} is invalid: {}", ctx.comm->rank(),
                           ctx.label(), ctx.comm_rank(peer), e.what());
    ctx.failure.merge(f);
    return false;
  }
}

void hand_to_owners(PartitionContext& ctx, std::span<const std::byte> payload, Request& final_rx,
                    std::span<const std::byte> area, std::size_t capacity, std::uint32_t index,
                    std::span<float> shard) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) {
    decode_or_record(ctx, payload, shard, DecodeMode::kOverwrite, r);
    return;
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Request tx = post_send(ctx, next, index, payload);
  wait(ctx, final_rx, false, prev, capacity);
  decode_or_record(ctx, received_message(ctx, area, prev), shard, DecodeMode::kOverwrite, prev);
  wait(ctx, tx, true, next, payload.size());
}

}  // namespace terse::collectives
