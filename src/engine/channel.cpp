// Point-to-point compressed tensor exchange. Encoding and posting happen on the caller's thread
// (so messages of one name leave in call order); waiting, decoding and completing handles
// happen on the channel's two completion threads, a WorkerPool of its own: an engine's workers
// run partition tasks whose progress argument (engine.cpp) a channel wait, which may last until
// the peer's pipeline schedule sends, would break if it held one of them. Payloads and failure
// messages are those of the collectives (collective.h), so a sender's NaN reaches the receiver
// as an error, not a hang.
//
// Each message travels in two parts: its payload header (or a whole failure message) first, then
// the rest. The receiver learns the sender's codec, element count and length before
// it posts the receive for the rest, so it can always take the bytes (Gloo aborts the process
// when a message is longer than the receive posted for it) and report a mismatch precisely.
#include "terse/channel.h"

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#include "collectives/collective.h"
#include "engine/handle_access.h"
#include "engine/worker_pool.h"
#include "kit/buffer_pool.h"
#include "kit/hash.h"

namespace terse {

using collectives::Failure;
using collectives::PartitionContext;

namespace {
// Bit 55 marks channel messages (the engine's tags keep it clear); 23 bits of the name's digest
// and 16 bits of the message number follow.
constexpr std::uint64_t kChannelBit = std::uint64_t{1} << 55;
// Larger announcements cannot come from a terse peer: refuse rather than allocate.
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 36;

std::uint64_t channel_tag(const std::string& name, std::uint32_t seq) {
  return kChannelBit | ((fnv1a64(name) & 0x7fffff) << 32) |
         (static_cast<std::uint64_t>(seq & 0xffff) << 16);
}
}  // namespace

struct Channel::Impl {
  std::shared_ptr<Communicator> comm;
  ChannelOptions options;
  kit::BufferPool pool;
  std::atomic<std::uint64_t> bytes_sent{0};

  std::mutex mu;  // codecs, counters and states
  std::map<std::string, std::unique_ptr<Codec>, std::less<>> codecs;
  std::map<std::tuple<int, std::string>, std::uint32_t> send_seq, recv_seq;
  std::map<std::tuple<int, std::string>, collectives::StateSlots> states;

  // Waits, decodes and completes handles: two threads, so that a send's completion is not
  // queued behind a receive that waits for its peer.
  engine::WorkerPool completions{2};

  const Codec& codec_for(const std::string& spec) {
    auto it = codecs.find(spec);
    if (it == codecs.end()) it = codecs.emplace(spec, make_codec(spec)).first;
    if (it->second->traits().multi_round) {
      throw InvalidArgument(fmt::format(
          "channel: codec {} needs sums across ranks and cannot compress a point-to-point "
          "message",
          spec));
    }
    return *it->second;
  }

  // A context for one message, as the collectives' helpers expect it.
  PartitionContext context(const std::string& name, const Codec& codec, std::uint32_t seq,
                           collectives::StateSlots& slots) {
    PartitionContext ctx;
    ctx.comm = comm.get();
    ctx.tensor = name;
    ctx.tag_base = channel_tag(name, seq);
    ctx.codec = &codec;
    ctx.states = &slots;
    ctx.encode.seed = options.seed;
    ctx.encode.step = seq;
    ctx.encode.tensor = fnv1a64(name);
    ctx.encode.rank = static_cast<std::uint64_t>(comm->rank());
    ctx.pool = &pool;
    ctx.bytes_sent = &bytes_sent;
    return ctx;
  }

  // The context of the next message of `name` with peer in one direction (its counter).
  std::shared_ptr<PartitionContext> next_message(
      int peer, const std::string& name, const std::string& codec_spec,
      std::map<std::tuple<int, std::string>, std::uint32_t>& counters) {
    std::lock_guard lock(mu);
    const Codec& codec = codec_for(codec_spec);
    const std::uint32_t seq = counters[{peer, name}]++;
    return std::make_shared<PartitionContext>(context(name, codec, seq, states[{peer, name}]));
  }

  void enqueue(std::function<void()> f) {
    completions.submit([f = std::move(f)](std::uint32_t, Workspace&) { f(); });
  }

  std::exception_ptr failure_error(const PartitionContext& ctx, const char* what, int peer) {
    const Failure& f = ctx.failure;
    const std::string where = fmt::format("rank {}: {} '{}' {} peer {}", comm->rank(), what,
                                          ctx.tensor, what[0] == 's' ? "to" : "from", peer);
    if (f.kind == Failure::kInputNotFinite) {
      return std::make_exception_ptr(InvalidArgument(fmt::format(
          "{}: rank {}'s input holds NaN or Inf at element {}", where, f.origin, f.index)));
    }
    return std::make_exception_ptr(MismatchError(fmt::format(
        "{}: {} (do both ranks use the same codec and size for it?)", where,
        f.detail.empty() ? "the message could not be decoded" : f.detail)));
  }
};

Channel::Channel(std::shared_ptr<Communicator> comm, ChannelOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!comm) throw InvalidArgument("channel: no communicator");
  impl_->comm = std::move(comm);
  impl_->options = options;
}

// Every queued wait runs to its end (each bounded by the timeout) before the threads stop.
Channel::~Channel() { impl_->completions.stop(); }

Handle Channel::send(int peer, const std::string& name, std::span<const float> x,
                     const std::string& codec_spec) {
  Impl& c = *impl_;
  auto ctx = c.next_message(peer, name, codec_spec, c.send_seq);
  const Codec& codec = *ctx->codec;
  Workspace workspace;
  ctx->workspace = &workspace;
  auto buffer =
      std::make_shared<kit::Buffer>(c.pool.acquire(collectives::message_capacity(codec, x.size())));
  std::span<const std::byte> message =
      collectives::encode_or_fail(*ctx, x, 0, 0, 0, buffer->bytes());
  ctx->workspace = nullptr;
  // A failure message goes whole as the first part; a payload as header, then the rest.
  const std::size_t first = ctx->failure.any() ? message.size() : Codec::kHeaderBytes;
  auto head = std::make_shared<Request>(collectives::post_send(*ctx, peer, 0, message.first(first)));
  auto rest = std::make_shared<Request>();
  if (message.size() > first) {
    *rest = collectives::post_send(*ctx, peer, 1, message.subspan(first));
  }
  auto [handle, complete] = HandleAccess::make();
  c.enqueue([&c, ctx, buffer, head, rest, peer, bytes = message.size(), complete = complete] {
    std::exception_ptr error;
    try {
      collectives::wait(*ctx, *head, true, peer, Codec::kHeaderBytes);
      collectives::wait(*ctx, *rest, true, peer, bytes);
      if (ctx->failure.any()) error = c.failure_error(*ctx, "send of", peer);
    } catch (...) {
      error = std::current_exception();
    }
    complete(error);
  });
  return handle;
}

Handle Channel::recv(int peer, const std::string& name, std::span<float> out,
                     const std::string& codec_spec) {
  Impl& c = *impl_;
  auto ctx = c.next_message(peer, name, codec_spec, c.recv_seq);
  const Codec& codec = *ctx->codec;
  const std::size_t cap = collectives::message_capacity(codec, out.size());
  auto area = std::make_shared<kit::Buffer>(c.pool.acquire(cap));
  auto head = std::make_shared<Request>(
      collectives::post_recv(*ctx, peer, 0, area->bytes().first(collectives::kFailureBytes)));
  auto [handle, complete] = HandleAccess::make();
  c.enqueue([&c, ctx, area, head, peer, out, cap, complete = complete] {
    std::exception_ptr error;
    try {
      collectives::wait(*ctx, *head, false, peer, collectives::kFailureBytes);
      std::span<const std::byte> message = area->bytes().first(collectives::kFailureBytes);
      if (collectives::accept_message(*ctx, message, peer)) {
        // A payload header: take the rest whatever it announces, then let the codec judge it.
        std::uint64_t length = 0;
        std::memcpy(&length, area->bytes().data() + 16, 8);
        if (length > kMaxMessageBytes) {
          throw TransportError(fmt::format(
              "rank {}: recv of '{}' from peer {}: the peer announces {} bytes; not a terse "
              "message",
              c.comm->rank(), ctx->tensor, peer, length));
        }
        kit::Buffer big;
        std::span<std::byte> whole = area->bytes();
        if (Codec::kHeaderBytes + length > cap) {
          big = c.pool.acquire(Codec::kHeaderBytes + length);
          std::memcpy(big.bytes().data(), area->bytes().data(), Codec::kHeaderBytes);
          whole = big.bytes();
        }
        if (length > 0) {  // the sender sends no second part for an empty payload
          Request rest =
              collectives::post_recv(*ctx, peer, 1, whole.subspan(Codec::kHeaderBytes, length));
          collectives::wait(*ctx, rest, false, peer, length);
        }
        // Decode into scratch, so that out is written only once the whole message decoded.
        kit::Buffer scratch = c.pool.acquire(std::max<std::size_t>(out.size(), 1) * 4);
        std::span<float> y = scratch.as<float>(out.size());
        if (collectives::decode_or_record(*ctx, whole.first(Codec::kHeaderBytes + length), y,
                                          DecodeMode::kOverwrite, peer)) {
          if (!out.empty()) std::memcpy(out.data(), y.data(), out.size_bytes());
        }
      }
      if (ctx->failure.any()) error = c.failure_error(*ctx, "recv of", peer);
    } catch (...) {
      error = std::current_exception();
    }
    complete(error);
  });
  return handle;
}

std::uint64_t Channel::bytes_sent() const { return impl_->bytes_sent.load(); }
Communicator& Channel::communicator() { return *impl_->comm; }

}  // namespace terse
