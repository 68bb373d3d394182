// Deep Gradient Compression: Lin et al., "Deep Gradient Compression: Reducing the Communication
// Bandwidth for Distributed Training", ICLR 2018 (momentum correction, factor masking, sampled
// threshold). Wire format: header, u32 count, count u32 indices strictly increasing, count fp32
// values of the accumulated velocity.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "terse/codec_kit.h"
#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/sparse.h"
#include "terse/codec.h"

namespace terse {
namespace {

constexpr std::uint32_t kStateMagic = 0x47445354;  // "TSDG"
// Below this many sampled elements a sample says little: small tensors are cut exactly.
constexpr std::size_t kMinSample = 4096;
constexpr std::size_t kRun = 16;  // kit::dgc_sample reads runs of 16 elements

// Momentum u and the accumulated velocity v (the local gradient accumulation) of one tensor.
class DgcState final : public CodecState {
 public:
  explicit DgcState(std::size_t n) : u(n, 0.0f), v(n, 0.0f) {}

  void save(std::vector<std::byte>& out) const override {
    const std::size_t start = out.size();
    out.resize(start + 4 + 8 + 8 * u.size());
    wire::Writer w(std::span<std::byte>(out).subspan(start));
    w.put(kStateMagic);
    w.put(static_cast<std::uint64_t>(u.size()));
    if (!u.empty()) {
      std::memcpy(w.take(4 * u.size()).data(), u.data(), 4 * u.size());
      std::memcpy(w.take(4 * v.size()).data(), v.data(), 4 * v.size());
    }
  }

  void load(std::span<const std::byte> in) override {
    wire::Reader r(in, "dgc state");
    if (r.get<std::uint32_t>() != kStateMagic) throw DecodeError("terse: not a dgc state");
    const auto n = r.get<std::uint64_t>();
    if (n != u.size()) {
      throw DecodeError(
          fmt::format("terse: dgc state holds {} elements, tensor has {}", n, u.size()));
    }
    auto ub = r.take(4 * n), vb = r.take(4 * n);
    r.expect_end();
    std::vector<float> nu(n), nv(n);
    if (n > 0) {
      std::memcpy(nu.data(), ub.data(), 4 * n);
      std::memcpy(nv.data(), vb.data(), 4 * n);
    }
    if (kit::find_non_finite(nu) != n || kit::find_non_finite(nv) != n) {
      throw DecodeError("terse: dgc state holds non-finite values");
    }
    u = std::move(nu);
    v = std::move(nv);
  }

  // Another ratio or sample: the momentum and the unsent velocity carry over as they are.
  bool adopt(CodecState& previous) override {
    auto* p = dynamic_cast<DgcState*>(&previous);
    if (p == nullptr || p->u.size() != u.size()) return false;
    std::swap(u, p->u);
    std::swap(v, p->v);
    return true;
  }

  std::vector<float> u, v;
};

struct DgcParams {
  double ratio = 0.001;
  double sample = 0.01;
  float momentum = 0.9f;
};

DgcParams read_params(SpecReader& r) {
  DgcParams p;
  p.ratio = sparse::read_ratio(r, "ratio", 0.001);
  p.sample = sparse::read_ratio(r, "sample", 0.01);
  // Momentum 1 would never decay.
  p.momentum =
      static_cast<float>(r.number("momentum", 0.9, 0.0, 1.0, SpecReader::Ends::kRightOpen));
  return p;
}

class DgcCodec final : public sparse::ListCodec {
 public:
  explicit DgcCodec(SpecReader& r) : DgcCodec(read_params(r), r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.stochastic = true;  // the threshold comes from a random sample
    t.stateful = true;
    t.sparse = true;
    t.builtin_feedback = true;
    return t;
  }

  std::unique_ptr<CodecState> make_state(std::size_t n) const override {
    return std::make_unique<DgcState>(n);
  }

 protected:
  sparse::Rules rules(std::size_t n) const override {
    sparse::Rules r;
    r.max_count = cap(n);
    r.min_key = 1;  // zeros are never sent
    return r;
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    const std::size_t n = x.size();
    auto* st = dynamic_cast<DgcState*>(ctx.state);
    if (st == nullptr || st->u.size() != n) {
      throw InvalidArgument(fmt::format(
          "terse: {}: state is not a dgc state for {} elements (use make_state)", spec(), n));
    }
    sparse::check_encodable(n, spec());
    kit::check_finite(x, spec());  // before the state changes: a rejected input loses nothing
    if (n == 0) return sparse::write(out, nullptr, nullptr, 0);

    const std::size_t k = sparse::count_for(p_.ratio, n), limit = cap(n);
    Workspace& ws = ctx.scratch();
    const std::uint32_t min_key = std::max<std::uint32_t>(threshold_key(x, *st, k, ctx), 1);
    kit::DgcCandidates c{ws.get<std::uint32_t>(1, limit + kit::kSelectSlack).data(),
                         ws.get<float>(2, limit + kit::kSelectSlack).data(),
                         ws.get<float>(3, limit + kit::kSelectSlack).data(), limit, k};
    std::size_t count = kit::dgc_accumulate_select(x, st->u, st->v, p_.momentum, min_key, c);
    if (count > limit) count = kit::dgc_cut(c, count, st->u, st->v);
    return sparse::write(out, c.idx, c.v, count);
  }

 private:
  DgcCodec(DgcParams p, SpecReader& r) : ListCodec(r), p_(p) {}

  // At most twice the target: a sampled threshold lets the count wander, and beyond 2k the
  // encoder keeps exactly the k largest.
  std::size_t cap(std::size_t n) const { return std::min(n, 2 * sparse::count_for(p_.ratio, n)); }

  // The key of the k-th largest |v| after this step's update, estimated from a sample of
  // round(sample * n) elements (the whole tensor when that is most of it).
  std::uint32_t threshold_key(std::span<const float> x, const DgcState& st, std::size_t k,
                              EncodeContext& ctx) const {
    const std::size_t n = x.size();
    const auto wanted = static_cast<std::size_t>(std::round(p_.sample * static_cast<double>(n)));
    const std::size_t s = std::max(wanted, std::min(n, kMinSample));
    if (2 * s >= n) {
      auto all = ctx.scratch().get<float>(0, n);
      kit::dgc_preview(x, st.u, st.v, p_.momentum, all.data());
      return kit::magnitude_cut(all, k).key;
    }
    const std::size_t runs = (s + kRun - 1) / kRun, drawn = runs * kRun;
    auto sample = ctx.scratch().get<float>(0, drawn);
    kit::dgc_sample(x, st.u, st.v, p_.momentum, ctx.rank_key(), runs, sample.data());
    const auto ks = static_cast<std::size_t>(
        std::round(static_cast<double>(k) * static_cast<double>(drawn) / static_cast<double>(n)));
    return kit::magnitude_cut(sample, std::clamp<std::size_t>(ks, 1, drawn)).key;
  }

  DgcParams p_;
};

const bool registered = register_codec(
    {"dgc", 11,
     "Deep Gradient Compression: momentum-corrected accumulation, sampled top-k threshold",
     [](SpecReader& r) { return std::make_unique<DgcCodec>(r); }});

}  // namespace
}  // namespace terse
