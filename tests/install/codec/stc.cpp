// Sparse ternary compression: Sattler, Wiedemann, Müller and Samek, "Robust and
// Communication-Efficient Federated Learning from Non-IID Data", IEEE TNNLS 2019
// (arXiv:1903.02891). Wire format: header, u32 k, fp32 mu, k u32 indices strictly increasing,
// ceil(k/8) sign bytes.
//
// The k = ratio * n entries of largest magnitude are kept and ternarized: each becomes +-mu, mu
// the mean magnitude of the k, so ||decoded - x||^2 = ||x||^2 - k mu^2. Sign bit j (bit j % 8 of
// byte j / 8) is set iff the j-th kept value is negative; padding bits are 0. (The paper also
// Golomb-codes the index gaps; plain 32-bit indices keep this example short.)
#include <terse/codec.h>
#include <terse/codec_kit.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

namespace {

using namespace terse;

class StcCodec final : public Codec {
 public:
  explicit StcCodec(SpecReader& r) : StcCodec(sparse::read_ratio(r, "ratio", 0.01), r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.sparse = true;  // deterministic, stateless, biased: use with ef=1
    return t;
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    const std::size_t k = sparse::count_for(ratio_, n);
    return 8 + 4 * k + codec_kit::packed_bytes(k, 1);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    sparse::check_encodable(x.size(), spec());
    const std::size_t k = sparse::count_for(ratio_, x.size());
    Workspace& ws = ctx.scratch();  // slots 0-2: top_k's scratch
    auto idx = ws.get<std::uint32_t>(3, k);
    auto val = ws.get<float>(4, k);
    if (!codec_kit::top_k(x, idx, val, ws)) codec_kit::throw_non_finite(x, spec());
    wire::Writer w(out);
    w.put(static_cast<std::uint32_t>(k));
    auto mu_at = w.take(4);
    for (std::uint32_t i : idx) w.put(i);
    double abs_sum = 0;
    codec_kit::sign_pack(val, reinterpret_cast<std::uint8_t*>(w.take(bits(k)).data()), &abs_sum);
    const float mu = k == 0 ? 0.0f : static_cast<float>(abs_sum / static_cast<double>(k));
    std::memcpy(mu_at.data(), &mu, 4);
    return w.size();
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size(), k = sparse::count_for(ratio_, n);
    wire::Reader r(in, spec().c_str());
    if (r.get<std::uint32_t>() != k) fail("the count is not k");
    const auto mu = r.get<float>();
    if (!std::isfinite(mu) || !(mu >= 0)) fail("mu is negative or not finite");
    const auto idx = r.take(4 * k);
    const auto* signs = reinterpret_cast<const std::uint8_t*>(r.take(bits(k)).data());
    r.expect_end();
    // Validate everything before writing y.
    std::uint32_t prev = 0;
    for (std::size_t j = 0; j < k; ++j) {
      std::uint32_t i;
      std::memcpy(&i, idx.data() + 4 * j, 4);
      if (i >= n || (j > 0 && i <= prev)) fail("indices are not strictly increasing below n");
      prev = i;
    }
    if (k % 8 != 0 && (signs[k / 8] >> (k % 8)) != 0) fail("padding bits are set");
    if (mode == DecodeMode::kOverwrite) std::fill(y.begin(), y.end(), 0.0f);
    for (std::size_t j = 0; j < k; ++j) {
      std::uint32_t i;
      std::memcpy(&i, idx.data() + 4 * j, 4);
      y[i] += (signs[j / 8] >> (j % 8)) & 1 ? -mu : mu;
    }
  }

 private:
  StcCodec(double ratio, SpecReader& r) : Codec(r), ratio_(ratio) {}

  static std::size_t bits(std::size_t k) { return codec_kit::packed_bytes(k, 1); }
  [[noreturn]] void fail(const char* what) const {
    throw DecodeError("terse: " + spec() + ": invalid payload (" + what + ")");
  }

  double ratio_;
};

// Ids 128-254 are for codecs from outside terse's tree.
const bool registered = register_codec(
    {"stc", 200, "sparse ternary compression: top-k as +-mean magnitude (4 bytes + 1 bit each)",
     [](SpecReader& r) { return std::make_unique<StcCodec>(r); }});

}  // namespace
