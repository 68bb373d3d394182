// Error feedback (Seide et al., "1-Bit Stochastic Gradient Descent", 2014; Karimireddy et al.,
// "Error Feedback Fixes SignSGD", 2019): compress x + r and keep r' = (x + r) - decode(...).
// With momentum m > 0, DGC's momentum correction and factor masking (Lin et al., "Deep
// Gradient Compression", ICLR 2018) around any codec: u = m u + x, compress r + u, and clear u
// wherever something was sent; the optimizer then runs without momentum of its own.
// Wire format: exactly the wrapped codec's (same id and digest), so receivers need not know.
#include <fmt/format.h>

#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/memory.h"
#include "terse/codec.h"

namespace terse {

namespace {

constexpr std::uint32_t kStateMagic = 0x46455354;     // "TSEF"
constexpr std::uint32_t kMomentumMagic = 0x4d455354;  // "TSEM": with the momentum u after r

class ErrorFeedbackState final : public CodecState {
 public:
  ErrorFeedbackState(std::size_t n, bool momentum, std::unique_ptr<CodecState> inner)
      : momentum(momentum), residual(n), velocity(momentum ? n : 0), inner(std::move(inner)) {}

  void save(std::vector<std::byte>& out) const override {
    std::vector<std::byte> inner_bytes;
    if (inner) inner->save(inner_bytes);
    std::size_t head = 4 + 8 + 8;
    std::size_t start = out.size();
    out.resize(start + head + (residual.size() + velocity.size()) * 4 + inner_bytes.size());
    wire::Writer w(std::span<std::byte>(out).subspan(start));
    w.put(momentum ? kMomentumMagic : kStateMagic);
    w.put(static_cast<std::uint64_t>(residual.size()));
    w.put(static_cast<std::uint64_t>(inner_bytes.size()));
    std::memcpy(w.take(residual.size() * 4).data(), residual.data(), residual.size() * 4);
    if (momentum && velocity.size() != 0) {
      std::memcpy(w.take(velocity.size() * 4).data(), velocity.data(), velocity.size() * 4);
    }
    if (!inner_bytes.empty()) {
      std::memcpy(w.take(inner_bytes.size()).data(), inner_bytes.data(), inner_bytes.size());
    }
  }

  void load(std::span<const std::byte> in) override {
    wire::Reader r(in, "error-feedback state");
    const auto magic = r.get<std::uint32_t>();
    if (magic != kStateMagic && magic != kMomentumMagic) {
      throw DecodeError("terse: not an error-feedback state");
    }
    if ((magic == kMomentumMagic) != momentum) {
      throw DecodeError(fmt::format("terse: an error-feedback state {} momentum, this codec {}",
                                    magic == kMomentumMagic ? "with" : "without",
                                    momentum ? "keeps one" : "has none"));
    }
    auto n = r.get<std::uint64_t>();
    auto inner_size = r.get<std::uint64_t>();
    if (n != residual.size()) {
      throw DecodeError(fmt::format("terse: error-feedback state holds {} elements, tensor has {}",
                                    n, residual.size()));
    }
    auto res = r.take(n * 4);
    auto vel = r.take(momentum ? n * 4 : 0);
    auto inner_bytes = r.take(inner_size);
    r.expect_end();
    if ((inner_size != 0) != (inner != nullptr)) {
      throw DecodeError("terse: error-feedback state does not match the wrapped codec's state");
    }
    if (inner) inner->load(inner_bytes);  // may throw; residual untouched until it succeeds
    std::memcpy(residual.data(), res.data(), n * 4);
    if (momentum && n != 0) std::memcpy(velocity.data(), vel.data(), n * 4);
  }

  bool adopt(CodecState& previous) override {
    auto* p = dynamic_cast<ErrorFeedbackState*>(&previous);
    if (p == nullptr || p->residual.size() != residual.size()) return false;
    std::swap(residual, p->residual);
    // The momentum carries over where both keep one; one kept anew starts at zero.
    if (momentum && p->momentum) {
      std::swap(velocity, p->velocity);
    }
    if (inner && p->inner) inner->adopt(*p->inner);
    return true;
  }

  bool momentum;                   // keeps u (momentum correction)
  kit::PageArray<float> residual;  // zeroed; huge pages when large (first touch, kit/memory.h)
  kit::PageArray<float> velocity;  // u, with momentum only (else empty)
  std::unique_ptr<CodecState> inner;
};

}  // namespace

class ErrorFeedbackCodec final : public Codec {
 public:
  ErrorFeedbackCodec(std::unique_ptr<Codec> inner, double momentum)
      : Codec(*inner, with_ef(inner->spec(), momentum)),
        inner_(std::move(inner)),
        momentum_(static_cast<float>(momentum)) {}

  CodecTraits traits() const override {
    CodecTraits t = inner_->traits();
    t.stateful = true;
    t.unbiased = false;  // per step; the accumulated update is what EF corrects
    // With momentum its state holds what was not sent, momentum included: a shard's owner must
    // not feed the average through it again (auto gathers the payloads, as for DGC).
    if (momentum_ > 0) t.builtin_feedback = true;
    // Summability is a property of the wire format, which error feedback does not change: the
    // sum of the ranks' encodings is the sum of their corrected gradients, the same sum every
    // other strategy computes.
    return t;
  }

  std::unique_ptr<CodecState> make_state(std::size_t n) const override {
    return std::make_unique<ErrorFeedbackState>(n, momentum_ > 0, inner_->make_state(n));
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return inner_->max_payload_bytes(n);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    auto* state = dynamic_cast<ErrorFeedbackState*>(ctx.state);
    if (state == nullptr || state->residual.size() != x.size() ||
        state->momentum != (momentum_ > 0)) {
      throw InvalidArgument(fmt::format(
          "terse: {}: state is not an error-feedback state for {} elements (use make_state)",
          spec(), x.size()));
    }
    std::span<float> corrected = ctx.scratch().get<float>(Workspace::kWrapperSlot, x.size());
    std::span<float> velocity;
    if (momentum_ > 0) {
      // u' = m u + x, computed aside: the state changes only once encoding succeeded.
      velocity = ctx.scratch().get<float>(Workspace::kWrapperSlot + 1, x.size());
      if (!x.empty()) std::memcpy(velocity.data(), state->velocity.data(), x.size() * 4);
      kit::scale_add(x, velocity, momentum_);
      kit::add_to(velocity, state->residual, corrected);
    } else {
      kit::add_to(x, state->residual, corrected);
    }
    EncodeContext inner_ctx = ctx;
    inner_ctx.state = state->inner.get();
    std::size_t bytes = inner_->encode_payload(corrected, out, inner_ctx);
    // The residual is only replaced once encoding succeeded: a rejected input loses nothing.
    inner_->decode_payload(out.first(bytes), state->residual, DecodeMode::kOverwrite);
    if (momentum_ > 0) {
      kit::clear_where(state->residual, velocity);  // factor masking: u = 0 where sent
      if (!x.empty()) std::memcpy(state->velocity.data(), velocity.data(), x.size() * 4);
    }
    kit::difference(corrected, state->residual, state->residual);
    return bytes;
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    inner_->decode_payload(in, y, mode);
  }

 public:
  void combine(std::span<const std::byte> in, std::span<std::byte> acc) const override {
    inner_->combine(in, acc);
  }

 private:
  static std::string with_ef(const std::string& spec, double momentum) {
    return spec + (spec.find(':') == std::string::npos ? ":ef=1" : ",ef=1") +
           (momentum > 0 ? fmt::format(",momentum={}", momentum) : std::string());
  }
  std::unique_ptr<Codec> inner_;
  float momentum_ = 0;
};

std::unique_ptr<Codec> wrap_error_feedback(std::unique_ptr<Codec> inner, double momentum) {
  return std::make_unique<ErrorFeedbackCodec>(std::move(inner), momentum);
}

}  // namespace terse
