// Error feedback (Seide et al., "1-Bit Stochastic Gradient Descent", 2014; Karimireddy et al.,
// "Error Feedback Fixes SignSGD", 2019): compress x + r and keep r' = (x + r) - decode(...).
// Wire format: exactly the wrapped codec's (same id and digest), so receivers need not know.
#include <fmt/format.h>

#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/memory.h"
#include "terse/codec.h"

namespace terse {

namespace {

constexpr std::uint32_t kStateMagic = 0x46455354;  // "TSEF"

class ErrorFeedbackState final : public CodecState {
 public:
  ErrorFeedbackState(std::size_t n, std::unique_ptr<CodecState> inner)
      : residual(n), inner(std::move(inner)) {}

  void save(std::vector<std::byte>& out) const override {
    std::vector<std::byte> inner_bytes;
    if (inner) inner->save(inner_bytes);
    std::size_t head = 4 + 8 + 8;
    std::size_t start = out.size();
    out.resize(start + head + residual.size() * 4 + inner_bytes.size());
    wire::Writer w(std::span<std::byte>(out).subspan(start));
    w.put(kStateMagic);
    w.put(static_cast<std::uint64_t>(residual.size()));
    w.put(static_cast<std::uint64_t>(inner_bytes.size()));
    std::memcpy(w.take(residual.size() * 4).data(), residual.data(), residual.size() * 4);
    if (!inner_bytes.empty()) {
      std::memcpy(w.take(inner_bytes.size()).data(), inner_bytes.data(), inner_bytes.size());
    }
  }

  void load(std::span<const std::byte> in) override {
    wire::Reader r(in, "error-feedback state");
    if (r.get<std::uint32_t>() != kStateMagic) {
      throw DecodeError("terse: not an error-feedback state");
    }
    auto n = r.get<std::uint64_t>();
    auto inner_size = r.get<std::uint64_t>();
    if (n != residual.size()) {
      throw DecodeError(fmt::format("terse: error-feedback state holds {} elements, tensor has {}",
                                    n, residual.size()));
    }
    auto res = r.take(n * 4);
    auto inner_bytes = r.take(inner_size);
    r.expect_end();
    if ((inner_size != 0) != (inner != nullptr)) {
      throw DecodeError("terse: error-feedback state does not match the wrapped codec's state");
    }
    if (inner) inner->load(inner_bytes);  // may throw; residual untouched until it succeeds
    std::memcpy(residual.data(), res.data(), n * 4);
  }

  bool adopt(CodecState& previous) override {
    auto* p = dynamic_cast<ErrorFeedbackState*>(&previous);
    if (p == nullptr || p->residual.size() != residual.size()) return false;
    std::swap(residual, p->residual);
    if (inner && p->inner) inner->adopt(*p->inner);
    return true;
  }

  kit::PageArray<float> residual;  // zeroed; huge pages when large (first touch, kit/memory.h)
  std::unique_ptr<CodecState> inner;
};

}  // namespace

class ErrorFeedbackCodec final : public Codec {
 public:
  explicit ErrorFeedbackCodec(std::unique_ptr<Codec> inner)
      : Codec(*inner, with_ef(inner->spec())),
        inner_(std::move(inner)) {}

  CodecTraits traits() const override {
    CodecTraits t = inner_->traits();
    t.stateful = true;
    t.unbiased = false;  // per step; the accumulated update is what EF corrects
    // Summability is a property of the wire format, which error feedback does not change: the
    // sum of the ranks' encodings is the sum of their corrected gradients, the same sum every
    // other strategy computes.
    return t;
  }

  std::unique_ptr<CodecState> make_state(std::size_t n) const override {
    return std::make_unique<ErrorFeedbackState>(n, inner_->make_state(n));
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return inner_->max_payload_bytes(n);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    auto* state = dynamic_cast<ErrorFeedbackState*>(ctx.state);
    if (state == nullptr || state->residual.size() != x.size()) {
      throw InvalidArgument(fmt::format(
          "terse: {}: state is not an error-feedback state for {} elements (use make_state)",
          spec(), x.size()));
    }
    std::span<float> corrected = ctx.scratch().get<float>(Workspace::kWrapperSlot, x.size());
    kit::add_to(x, state->residual, corrected);
    EncodeContext inner_ctx = ctx;
    inner_ctx.state = state->inner.get();
    std::size_t bytes = inner_->encode_payload(corrected, out, inner_ctx);
    // The residual is only replaced once encoding succeeded: a rejected input loses nothing.
    inner_->decode_payload(out.first(bytes), state->residual, DecodeMode::kOverwrite);
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
  static std::string with_ef(const std::string& spec) {
    return spec + (spec.find(':') == std::string::npos ? ":ef=1" : ",ef=1");
  }
  std::unique_ptr<Codec> inner_;
};

std::unique_ptr<Codec> wrap_error_feedback(std::unique_ptr<Codec> inner) {
  return std::make_unique<ErrorFeedbackCodec>(std::move(inner));
}

}  // namespace terse
