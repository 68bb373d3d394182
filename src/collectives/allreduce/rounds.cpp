// Multi-round codecs (PowerSGD, a RoundCodec): for each round every rank encodes its
// contribution, the contributions are summed across ranks, and every rank absorbs the same sum;
// finish() then writes the result. How a round's sum travels:
// - strategy summable: on a ring. fp32 contributions go on the raw ring (raw.cpp, 2(N-1)
//   message steps); with a wire codec (RoundCodec::round_wire: fp16, bf16) on the summable ring
//   of that codec (summable.cpp, N steps, half the bytes).
// - strategy allgather: gathered (allgather.cpp): every rank sends its whole contribution (as
//   the wire codec's encoding, or as exact fp32 payloads of codec none) to every other rank and
//   sums all N in rank order. One message step a round, (N-1) contributions sent per rank:
//   the choice where latency, not bytes, dominates (small matrices, fast links).
// Either way the sum is computed in a fixed order from identical bytes: bit-identical on every
// rank. A rank whose input holds NaN/Inf poisons its fp32 contribution on the raw ring (every
// rank then stops at the non-finite sum), or sends failure payloads on the others.
#include <algorithm>
#include <limits>
#include <memory>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

namespace {

const Codec& exact_payloads() {
  static const std::unique_ptr<Codec> none = make_codec("none");
  return *none;
}

}  // namespace

void rounds_allreduce(PartitionContext& ctx, bool gather) {
  const RoundCodec& codec = *ctx.rounds;
  const std::size_t n = ctx.input.size();
  EncodeContext ec = piece_context(ctx, 0, 0, n);
  const auto stride = static_cast<std::uint32_t>(2 * ctx.size());
  for (int round = 0; round < codec.rounds(); ++round) {
    const std::size_t m = codec.round_elements(round, n);
    kit::Buffer buffer = ctx.pool->acquire(std::max<std::size_t>(m, 1) * sizeof(float));
    std::span<float> contribution = buffer.as<float>(m);
    {
      Stage s(ctx, "encode", -1, n * 4);
      try {
        codec.encode_round(round, ctx.input, contribution, ec);
      } catch (const InvalidArgument&) {
        const std::size_t bad = kit::find_non_finite(ctx.input);
        if (bad == n) throw;
        // Poison the sum so that every rank sees the failure, then finish the round with them.
        ctx.failure.merge({Failure::kInputNotFinite, ctx.comm->rank(), ctx.offset + bad, {}});
        std::fill(contribution.begin(), contribution.end(),
                  std::numeric_limits<float>::quiet_NaN());
      }
    }
    const Codec* wire = codec.round_wire(round, n);
    if (wire == nullptr && !gather) {
      raw_ring(ctx, contribution, contribution, round * stride, 1);
    } else {
      // Payloads of the wire codec (or exact fp32 ones); their state slots are never used
      // (these codecs are stateless), and the failure payloads they forward are the partition's.
      const Codec* own = ctx.codec;
      ctx.codec = wire != nullptr ? wire : &exact_payloads();
      if (gather) {
        gather_sum(ctx, contribution, contribution, round * stride);
      } else {
        summable_ring(ctx, contribution, contribution, round * stride);
      }
      ctx.codec = own;
      if (ctx.failure.any()) return;  // every rank learnt it from the payloads
    }
    const std::size_t bad = kit::find_non_finite(contribution);
    if (bad != m) {  // identical on every rank: all stop here
      ctx.failure.merge({Failure::kSumNotFinite, -1, ctx.offset, {}});
      return;
    }
    Stage s(ctx, "merge", -1, m * 4);
    codec.absorb_round(round, contribution, ec);
  }
  {
    Stage s(ctx, "decode", -1, n * 4);
    codec.finish(ctx.output, ec);
  }
  apply_divisor(ctx, ctx.output);
}

}  // namespace terse::collectives
