// all-to-all: block q of every rank's input goes to rank q, in one message round when nothing
// fails. Each block travels behind a header (its element count, the sender's own failure, and two
// digests of the sender's counts) in one message per peer (message 1): raw as it is, or encoded
// once by its sender (state slot q, piece q) and decoded once by its receiver; a rank's own block
// is copied exactly. A receiver posts, before it knows a block's size, an area of
// first_message_bytes() per peer; a block whose message would not fit sends its header alone and
// its payload as a second message (message 2), received once the header said its size.
//
// Failures travel in-band. A sender checks every block before it sends any (NaN or Inf, found by
// the caller or by encoding), so its failure reaches every peer in its headers. A count mismatch is
// seen by the block's receiver alone, which drains the block (it never receives into an area too
// small for it); the digests tell every rank that some pair disagrees, without a round of its own:
// rank a's headers carry sum_q h(a, q, send[q]) and sum_q h(q, a, recv[q]), whose totals over all
// ranks are equal when every send count matches its receiver's (but for a 2^-64 chance). Every rank
// sums the same headers, so all see the same totals; when they differ, every rank runs the status
// round (agree_on_failure) to learn which pair it was. A payload that does not decode (a peer
// running the same codec cannot send one: the codec is checked across ranks on first use) fails its
// receiver alone.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collective.h"
#include "kit/hash.h"

namespace terse::collectives {

namespace {

constexpr std::uint32_t kBlockIndex = 1;  // the header and, when it fits, the payload
constexpr std::uint32_t kTailIndex = 2;   // a payload too large to come with its header

struct BlockHeader {
  static constexpr std::uint32_t kMagic = 0x41324154;  // "TA2A"
  static constexpr std::uint32_t kTail = 1;            // flags: the payload is message 2
  std::uint32_t magic = kMagic;
  std::uint32_t flags = 0;
  std::uint32_t kind = Failure::kNone;  // the sender's failure, if any (then no payload)
  std::uint32_t pad = 0;
  std::int64_t origin = -1;
  std::uint64_t index = 0;
  std::uint64_t elements = 0;  // the block's size as the sender sends it
  std::uint64_t payload = 0;   // bytes of payload
  std::uint64_t sent = 0;      // sum over q of pair_key(sender, q, send_size[q])
  std::uint64_t expected = 0;  // sum over q of pair_key(q, sender, recv_size[q])
};
constexpr std::size_t kHeaderBytes = sizeof(BlockHeader);
static_assert(kHeaderBytes == 64);

std::uint64_t pair_key(int from, int to, std::size_t elements) {
  return kit::combine_keys(
      kit::combine_keys(static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to)),
      elements);
}

// The most bytes a block's first message may have: every receiver posts this much per peer before
// it knows what comes, so it is bounded per partition to 16 MiB over all peers. A larger block
// costs one more message latency, small beside its own transfer time.
std::size_t first_message_bytes(int n) {
  return std::clamp<std::size_t>((std::size_t{16} << 20) / static_cast<std::size_t>(n),
                                 std::size_t{16} << 10, std::size_t{256} << 10);
}

// One partition's messages: posts the first-message receives at construction; send() sends a block
// behind its header; receive() waits for every peer's header and payload and hands each payload to
// a callback; finish() waits for the sends and runs the status round when the digests say that some
// counts disagree.
class BlockExchange {
 public:
  BlockExchange(PartitionContext& ctx, const AllToAllBlocks& b)
      : ctx_(ctx),
        b_(b),
        n_(ctx.size()),
        r_(ctx.rank()),
        first_(first_message_bytes(n_)),
        areas_(ctx.pool->acquire(std::max<std::size_t>(first_ * (n_ - 1), 1))),
        rx_(n_),
        tx_(n_),
        tail_rx_(n_),
        tail_tx_(n_),
        tails_(n_),
        sent_bytes_(n_, 0),
        tail_bytes_(n_, 0) {
    for (int q = 0; q < n_; ++q) {
      sent_ += pair_key(r_, q, b.send_size[q]);
      expected_ += pair_key(q, r_, b.recv_size[q]);
    }
    mine_sent_ = sent_;
    mine_expected_ = expected_;
    for (int q = 0; q < n_; ++q) {
      if (q != r_) rx_[q] = post_recv(ctx, q, kBlockIndex, area(q));
    }
  }

  // Whether a payload of `bytes` comes with its header (else it is message 2).
  bool fits(std::size_t bytes) const { return kHeaderBytes + bytes <= first_; }

  // Sends block q: `header` (kHeaderBytes) is filled in here; `payload` must follow it in memory
  // when it fits (one message), and may lie anywhere otherwise. With a failure recorded, only the
  // header goes, carrying it.
  void send(int q, std::span<std::byte> header, std::span<const std::byte> payload) {
    BlockHeader h;
    h.elements = b_.send_size[q];
    h.sent = mine_sent_;
    h.expected = mine_expected_;
    if (ctx_.failure.any()) {
      h.kind = ctx_.failure.kind;
      h.origin = ctx_.failure.origin;
      h.index = ctx_.failure.index;
      payload = {};
    }
    h.payload = payload.size();
    const bool tail = !fits(payload.size());
    if (tail) h.flags = BlockHeader::kTail;
    std::memcpy(header.data(), &h, kHeaderBytes);
    sent_bytes_[q] = kHeaderBytes + (tail ? 0 : payload.size());
    tx_[q] =
        post_send(ctx_, q, kBlockIndex, std::span<const std::byte>(header.data(), sent_bytes_[q]));
    if (tail) {
      tail_tx_[q] = post_send(ctx_, q, kTailIndex, payload);
      tail_bytes_[q] = payload.size();
    }
  }

  // Waits for every peer's block (the one that sends to us first first). `tail_area(q, bytes)`
  // gives the area a payload of `bytes` of the expected size sent as a second message lands in
  // (empty: a buffer of the exchange's own); `consume(q, payload)` gets each payload of the
  // expected size (nothing for a peer that sent a failure, or a block of another size, which is
  // drained). `max_payload(elements)` bounds a block's payload (a larger one is malformed).
  template <typename TailArea, typename MaxPayload, typename Consume>
  void receive(TailArea&& tail_area, MaxPayload&& max_payload, Consume&& consume) {
    std::vector<std::span<const std::byte>> payloads(n_);
    std::vector<bool> usable(n_, false);
    for (int k = 1; k < n_; ++k) {
      const int q = (r_ + n_ - k) % n_;
      BlockHeader h;
      {
        Stage s(ctx_, "recv", q);
        rx_[q].wait();
        std::memcpy(&h, area(q).data(), kHeaderBytes);
        s.set_bytes(kHeaderBytes + (h.flags == BlockHeader::kTail ? 0 : h.payload));
      }
      const bool tail = h.flags == BlockHeader::kTail;
      if (h.magic != BlockHeader::kMagic || h.flags > BlockHeader::kTail ||
          h.kind > Failure::kCountMismatch || h.origin < -1 || h.origin >= n_ ||
          h.payload > max_payload(h.elements) || (!tail && h.payload > first_ - kHeaderBytes)) {
        Failure f{Failure::kBadPayload, r_, ctx_.offset, {}};
        f.detail = fmt::format("rank {}: {}: malformed all-to-all header from peer {}", r_,
                               ctx_.label(), q);
        ctx_.failure.merge(f);
        continue;
      }
      sent_ += h.sent;
      expected_ += h.expected;
      if (h.kind != Failure::kNone) ctx_.failure.merge({h.kind, h.origin, h.index, {}});
      const bool match = h.elements == b_.recv_size[q];
      if (!match) {
        Failure f{Failure::kCountMismatch, r_, static_cast<std::uint64_t>(q), {}};
        f.detail = fmt::format(
            "rank {}: {}: rank {} expected a block of {} elements from rank {}, which sends {}: "
            "rank q's send_counts[r] must equal rank r's recv_counts[q]",
            r_, ctx_.label(), r_, b_.recv_size[q], q, h.elements);
        ctx_.failure.merge(f);
      }
      if (tail) {
        std::span<std::byte> to;
        if (match) to = tail_area(q, h.payload);
        if (to.empty()) {
          tails_[q] = ctx_.pool->acquire(std::max<std::size_t>(h.payload, 1));
          to = tails_[q].bytes().first(h.payload);
        }
        tail_rx_[q] = post_recv(ctx_, q, kTailIndex, to);
        payloads[q] = to;
      } else {
        payloads[q] = area(q).subspan(kHeaderBytes, h.payload);
      }
      usable[q] = match && h.kind == Failure::kNone;
    }
    for (int k = 1; k < n_; ++k) {
      const int q = (r_ + n_ - k) % n_;
      if (tail_rx_[q].pending()) wait(ctx_, tail_rx_[q], false, q, payloads[q].size());
      if (usable[q]) consume(q, payloads[q]);
    }
  }

  void finish() {
    for (int q = 0; q < n_; ++q) {
      if (q == r_) continue;
      wait(ctx_, tx_[q], true, q, sent_bytes_[q]);
      if (tail_tx_[q].pending()) wait(ctx_, tail_tx_[q], true, q, tail_bytes_[q]);
    }
    if (sent_ != expected_) agree_on_failure(ctx_, kStatusIndex);
  }

 private:
  std::span<std::byte> area(int q) {
    const int slot = q < r_ ? q : q - 1;
    return areas_.bytes().subspan(first_ * slot, first_);
  }

  PartitionContext& ctx_;
  const AllToAllBlocks& b_;
  const int n_, r_;
  const std::size_t first_;
  kit::Buffer areas_;
  std::vector<Request> rx_, tx_, tail_rx_, tail_tx_;
  std::vector<kit::Buffer> tails_;  // drained payloads and codec tails
  std::vector<std::size_t> sent_bytes_, tail_bytes_;
  std::uint64_t mine_sent_ = 0, mine_expected_ = 0;  // this rank's digests
  std::uint64_t sent_ = 0, expected_ = 0;            // summed over this rank and every header
};

}  // namespace

void all_to_all(PartitionContext& ctx, const AllToAllBlocks& b, std::span<float> output) {
  const int n = ctx.size(), r = ctx.rank();
  BlockExchange x(ctx, b);
  const std::size_t h = kHeaderBytes;
  std::vector<std::size_t> send_at(n + 1, 0);
  for (int q = 0; q < n; ++q) {
    send_at[q + 1] = send_at[q] + (q == r ? 0 : h + message_capacity(*ctx.codec, b.send_size[q]));
  }
  kit::Buffer out = ctx.pool->acquire(std::max<std::size_t>(send_at[n], 1));
  auto message = [&](int q) {
    return out.bytes().subspan(send_at[q], send_at[q + 1] - send_at[q]);
  };
  // Every block is checked before any is sent, so that a NaN in one reaches every peer.
  if (b.send_size[r] == b.recv_size[r] && b.send_size[r] > 0) {
    Stage s(ctx, "merge", -1, b.send_size[r] * 4);
    add_input(ctx, b.send_begin[r], output.subspan(b.recv_begin[r], b.recv_size[r]), false);
  }
  std::vector<std::span<const std::byte>> payload(n);
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    payload[q] = encode_or_fail(ctx, ctx.input.subspan(b.send_begin[q], b.send_size[q]),
                                b.send_begin[q], q, q, message(q).subspan(h));
  }
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    x.send(q, message(q).first(h), payload[q]);
  }
  x.receive([](int, std::size_t) { return std::span<std::byte>(); },
            [&](std::uint64_t elements) { return message_capacity(*ctx.codec, elements); },
            [&](int q, std::span<const std::byte> message) {
              decode_or_record(ctx, message, output.subspan(b.recv_begin[q], b.recv_size[q]),
                               DecodeMode::kOverwrite, q);
            });
  x.finish();
}

void all_to_all_bytes(PartitionContext& ctx, const AllToAllBlocks& b,
                      std::span<const std::byte> input, std::span<std::byte> output,
                      std::size_t element_bytes) {
  const int n = ctx.size(), r = ctx.rank();
  BlockExchange x(ctx, b);
  const std::size_t h = kHeaderBytes;
  auto block = [&](auto s, std::size_t begin, std::size_t size) {
    return s.subspan(begin * element_bytes, size * element_bytes);
  };
  // A block that comes with its header is staged behind it (a copy, cheap beside the transfer); a
  // larger one is sent from the input as message 2.
  std::vector<std::size_t> send_at(n + 1, 0);
  for (int q = 0; q < n; ++q) {
    const std::size_t bytes = b.send_size[q] * element_bytes;
    send_at[q + 1] = send_at[q] + (q == r ? 0 : h + (x.fits(bytes) ? bytes : 0));
  }
  kit::Buffer staged = ctx.pool->acquire(std::max<std::size_t>(send_at[n], 1));
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    std::span<const std::byte> bytes = block(input, b.send_begin[q], b.send_size[q]);
    std::span<std::byte> m = staged.bytes().subspan(send_at[q], send_at[q + 1] - send_at[q]);
    if (x.fits(bytes.size()) && !ctx.failure.any()) {
      std::memcpy(m.data() + h, bytes.data(), bytes.size());
      bytes = m.subspan(h, bytes.size());
    }
    x.send(q, m.first(h), bytes);
  }
  if (b.send_size[r] == b.recv_size[r] && b.send_size[r] > 0) {
    std::memcpy(block(output, b.recv_begin[r], b.recv_size[r]).data(),
                block(input, b.send_begin[r], b.send_size[r]).data(),
                b.send_size[r] * element_bytes);
  }
  x.receive(
      [&](int q, std::size_t bytes) {
        // A block of the expected size lands in the output itself.
        auto to = block(output, b.recv_begin[q], b.recv_size[q]);
        return bytes == to.size() ? to : std::span<std::byte>();
      },
      [&](std::uint64_t elements) { return elements * element_bytes; },
      [&](int q, std::span<const std::byte> payload) {
        auto to = block(output, b.recv_begin[q], b.recv_size[q]);
        if (payload.size() != to.size()) {
          Failure f{Failure::kBadPayload, r, ctx.offset, {}};
          f.detail = fmt::format("rank {}: {}: rank {} sent {} bytes for a block of {} elements", r,
                                 ctx.label(), q, payload.size(), b.recv_size[q]);
          ctx.failure.merge(f);
          return;
        }
        if (payload.data() != to.data()) std::memcpy(to.data(), payload.data(), payload.size());
      });
  x.finish();
}

}  // namespace terse::collectives
