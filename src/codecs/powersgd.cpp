// PowerSGD: Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
// for Distributed Optimization", NeurIPS 2019 (rank-r power iteration, warm start, built-in EF).
// Wire format (Codec path): header, u64 rows, u64 cols, u32 rank (0 = raw), f32 scale (a power of
// two >= 1), then P_hat^T (rank x rows fp32) and Q^T / scale (rank x cols fp32); raw: n fp32.
//
// The tensor of n elements is viewed as a row-major matrix M of rows x cols (rows*cols == n):
// `rows` given explicitly (e.g. a parameter's first dimension), or automatically the largest
// divisor of n not above sqrt(n), the most nearly square factorization. With r = min(rank, rows,
// cols), a tensor is compressed only when r * (rows + cols) < n; otherwise it travels raw
// (exact fp32) in round 0 and round 1 is empty.
//
// As a RoundCodec (the distributed protocol; see docs/codecs/powersgd.md):
//   round 0: M = x + residual; contribution P = M Q           (rows x r; Q shared by all ranks)
//            absorb: P_hat = orthonormalize(sum over ranks of P)
//   round 1: contribution Q_w = M^T P_hat                     (cols x r)
//            absorb: Q_sum = sum over ranks of Q_w
//   finish:  y = P_hat Q_sum^T, the SUM over ranks of the approximations P_hat P_hat^T M_w;
//            residual = M - P_hat Q_w^T (this rank's own share); Q <- orthonormalize(Q_sum)
//            for the next step's warm start.
// wire=fp16 or bf16 makes the round sums travel in 16 bits (round_wire): half the bytes and
// N message steps instead of 2(N-1), at the cost of rounding P's sum (absorbed by the
// orthonormalization and the residual, which uses P_hat) and Q's sum (not compensated: a
// relative error of 2^-11 or 2^-8 of the approximation sent). Tensors sent raw stay fp32.
// Every matrix is stored transposed (r x rows, r x cols, row-major) so that each column of P
// and Q is contiguous for the orthonormalization; contributions use the same layout.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/blas.h"
#include "kit/hash.h"
#include "kit/memory.h"
#include "terse/codec.h"

namespace terse {
namespace {

constexpr std::uint32_t kStateMagic = 0x53505354;  // "TSPS"
constexpr std::size_t kMetaBytes = 8 + 8 + 4 + 4;   // rows, cols, rank, scale
constexpr std::size_t kStateHeadBytes = 4 + 8 + 8 + 8 + 4 + 4 + 8;
// Bounds the decoder enforces: columns of P_hat are unit vectors, and |Q / scale| <= the
// column norm of M / scale <= 2 sqrt(rows). The slack covers fp32 rounding.
constexpr float kSlack = 1.001f;
constexpr std::uint64_t kInitTag = 0x5053474451494e49ull;
constexpr std::uint64_t kReseedTag = 0x5053474452534544ull;

struct Layout {
  std::size_t n = 0, rows = 0, cols = 0;
  std::size_t rank = 0;  // effective rank; 0 = raw
  bool valid = true;     // false: an explicit `rows` does not divide n
  bool raw() const { return rank == 0; }
  std::size_t p_len() const { return rank * rows; }
  std::size_t q_len() const { return rank * cols; }
  std::size_t payload_floats() const { return raw() ? n : rank * (rows + cols); }
};

std::size_t largest_divisor_up_to_sqrt(std::size_t n) {
  if (n == 0) return 0;
  auto d = static_cast<std::size_t>(std::sqrt(static_cast<double>(n)));
  while (d > 0 && d * d > n) --d;
  while ((d + 1) * (d + 1) <= n) ++d;
  for (; d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

// Uniform values in (-1, 1) from the counter-based mix: the same on every rank for a key.
void fill_random(std::span<float> v, std::uint64_t key) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint64_t u = kit::mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
    v[i] = (static_cast<float>(u >> 40) + 0.5f) * 0x1p-23f - 1.0f;
  }
}

class PowerSgdState final : public CodecState {
 public:
  explicit PowerSgdState(const Layout& l)
      : layout(l), residual(l.raw() ? 0 : l.n), q(l.q_len(), 0.0f) {}

  void save(std::vector<std::byte>& out) const override {
    std::size_t start = out.size();
    out.resize(start + kStateHeadBytes + (residual.size() + q.size()) * 4);
    wire::Writer w(std::span<std::byte>(out).subspan(start));
    w.put(kStateMagic);
    w.put(static_cast<std::uint64_t>(layout.n));
    w.put(static_cast<std::uint64_t>(layout.rows));
    w.put(static_cast<std::uint64_t>(layout.cols));
    w.put(static_cast<std::uint32_t>(layout.rank));
    w.put(static_cast<std::uint32_t>(has_q ? 1 : 0));
    w.put(steps);
    if (residual.size() != 0) {
      std::memcpy(w.take(residual.size() * 4).data(), residual.data(), residual.size() * 4);
    }
    if (!q.empty()) std::memcpy(w.take(q.size() * 4).data(), q.data(), q.size() * 4);
  }

  void load(std::span<const std::byte> in) override {
    wire::Reader r(in, "powersgd state");
    if (r.get<std::uint32_t>() != kStateMagic) throw DecodeError("terse: not a powersgd state");
    auto n = r.get<std::uint64_t>();
    auto rows = r.get<std::uint64_t>();
    auto cols = r.get<std::uint64_t>();
    auto rank = r.get<std::uint32_t>();
    auto flag = r.get<std::uint32_t>();
    auto saved_steps = r.get<std::uint64_t>();
    if (n != layout.n || rows != layout.rows || cols != layout.cols || rank != layout.rank) {
      throw DecodeError(fmt::format(
          "terse: powersgd state is for a {}x{} matrix of rank {} ({} elements), this tensor is "
          "{}x{} of rank {} ({} elements)",
          rows, cols, rank, n, layout.rows, layout.cols, layout.rank, layout.n));
    }
    if (flag > 1) throw DecodeError("terse: powersgd state has a bad warm-start flag");
    auto res = r.take(residual.size() * 4);
    auto qb = r.take(q.size() * 4);
    r.expect_end();
    kit::PageArray<float> new_res(residual.size(), kit::PageArray<float>::Init::kNone);
    std::vector<float> new_q(q.size());
    if (!res.empty()) std::memcpy(new_res.data(), res.data(), res.size());
    if (!qb.empty()) std::memcpy(new_q.data(), qb.data(), qb.size());
    if (kit::find_non_finite(new_res) != new_res.size() ||
        kit::find_non_finite(new_q) != new_q.size()) {
      throw DecodeError("terse: powersgd state holds non-finite values");
    }
    residual = std::move(new_res);
    q = std::move(new_q);
    has_q = flag == 1;
    steps = saved_steps;
    phase = 0;
  }

  // Another rank (or wire): the residual carries over; the warm start only if Q keeps its
  // shape (same matrix, same rank), else the next step draws a fresh Q.
  bool adopt(CodecState& previous) override {
    auto* p = dynamic_cast<PowerSgdState*>(&previous);
    if (p == nullptr || p->layout.n != layout.n || p->residual.size() != residual.size()) {
      return false;
    }
    std::swap(residual, p->residual);
    if (p->layout.rows == layout.rows && p->layout.cols == layout.cols && p->q.size() == q.size()) {
      std::swap(q, p->q);
      has_q = p->has_q;
    }
    steps = p->steps;
    return true;
  }

  Layout layout;
  // The two tensor-sized arrays are kit memory (huge pages, freed blocks kept for reuse): in
  // 4 KiB pages a 256 MiB state cost 65,536 page faults on first use, about 0.65 s on the
  // virtual machines this project runs on, and exploration starts several (docs/planner.md).
  kit::PageArray<float> residual;  // n (empty when raw)
  std::vector<float> q;         // Q^T, r x cols: the warm start, orthonormal columns
  bool has_q = false;
  std::uint64_t steps = 0;  // completed steps

  // Between the rounds of one step (not saved; a loaded state starts a new step).
  int phase = 0;                 // next call expected: 0 encode_round(0), 1 absorb(0), ...
  kit::PageArray<float> m;       // M = x + residual, or the raw sum (sized by fit_m)
  std::vector<float> q_first;    // a freshly drawn Q (no warm start yet, or warm=0)
  std::vector<float> p;          // P_hat^T, r x rows
  std::vector<float> q_local;    // this rank's Q_w^T, r x cols
  std::vector<float> q_sum;      // Q_sum^T, r x cols
};

struct Params {
  std::size_t rank = 4;
  std::size_t rows = 0;
  bool warm = true;
  std::string wire = "fp32";  // how the round sums travel: fp32 (exact), fp16 or bf16

  static Params read(SpecReader& r) {
    Params p;
    p.rank = static_cast<std::size_t>(r.integer("rank", 4, 1, 64));
    p.rows = static_cast<std::size_t>(r.integer("rows", 0, 0, INT_MAX));
    p.warm = r.flag("warm", true);
    r.choice("orth", "gram-schmidt", {"gram-schmidt"});
    p.wire = r.choice("wire", "fp32", {"fp32", "fp16", "bf16"});
    return p;
  }
};

class PowerSgdCodec final : public Codec, public RoundCodec {
 public:
  // (r after Params::read(r): the canonical spec holds what was read.)
  PowerSgdCodec(const Params& p, const SpecReader& r)
      : Codec(r), rank_(p.rank), rows_(p.rows), warm_(p.warm),
        wire_(p.wire == "fp32" ? nullptr : make_codec(p.wire)) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.stateful = true;
    t.multi_round = true;
    return t;
  }

  std::unique_ptr<CodecState> make_state(std::size_t n) const override {
    return std::make_unique<PowerSgdState>(checked_layout(n));
  }

  // ---- RoundCodec ---------------------------------------------------------------------------

  int rounds() const override { return 2; }

  std::size_t round_elements(int r, std::size_t n) const override {
    Layout l = checked_layout(n);
    if (r == 0) return l.raw() ? l.n : l.p_len();
    if (r == 1) return l.raw() ? 0 : l.q_len();
    throw InvalidArgument(fmt::format("terse: {} has rounds 0 and 1, not {}", spec(), r));
  }

  // The factors' sums in 16 bits (wire=fp16/bf16); a tensor sent raw stays exact fp32.
  const Codec* round_wire(int r, std::size_t n) const override {
    (void)r;
    return wire_ && !checked_layout(n).raw() ? wire_.get() : nullptr;
  }

  void encode_round(int r, std::span<const float> x, std::span<float> contribution,
                    EncodeContext& ctx) const override {
    PowerSgdState& st = state_for(ctx, x.size());
    const Layout& l = st.layout;
    check_length("contribution", contribution.size(), round_elements(r, l.n));
    if (r == 0) {
      st.phase = 0;  // round 0 (re)starts a step whatever came before
      if (l.raw()) {
        if (!kit::copy_finite(x, contribution.data())) kit::throw_non_finite(x, spec());
      } else {
        fit_m(st, l.n);
        kit::add_to(x, st.residual, st.m);
        st.q_first.resize(l.q_len());
        const float* q = start_q(st, st.q_first, ctx);
        // P^T = Q^T M^T (r x rows)
        kit::sgemm(false, true, l.rank, l.rows, l.cols, 1.0f, q, l.cols, st.m.data(), l.cols,
                   0.0f, contribution.data(), l.rows);
        // A non-finite input (or M overflowing) poisons P: check the small product, not M.
        if (kit::find_non_finite(contribution) != contribution.size()) reject(x);
      }
      st.phase = 1;
    } else {
      expect_phase(st, 2, "encode_round(1)");
      if (!l.raw()) {
        // Q_w^T = P_hat^T M (r x cols)
        kit::sgemm(false, false, l.rank, l.cols, l.rows, 1.0f, st.p.data(), l.rows,
                   st.m.data(), l.cols, 0.0f, contribution.data(), l.cols);
        st.q_local.assign(contribution.begin(), contribution.end());
      }
      st.phase = 3;
    }
  }

  void absorb_round(int r, std::span<const float> sum, EncodeContext& ctx) const override {
    PowerSgdState& st = state_for(ctx, std::nullopt);
    const Layout& l = st.layout;
    check_length("sum", sum.size(), round_elements(r, l.n));
    expect_phase(st, r == 0 ? 1 : 3, r == 0 ? "absorb_round(0)" : "absorb_round(1)");
    if (kit::find_non_finite(sum) != sum.size()) {
      throw InvalidArgument(fmt::format(
          "terse: {}: the sum of round {} holds NaN or Inf at element {} (a rank's input "
          "overflowed?)", spec(), r, kit::find_non_finite(sum)));
    }
    if (r == 0) {
      if (l.raw()) {
        fit_m(st, sum.size());
        if (!sum.empty()) std::memcpy(st.m.data(), sum.data(), sum.size_bytes());
      } else {
        st.p.assign(sum.begin(), sum.end());
        kit::orthonormalize(st.p.data(), l.rank, l.rows, nullptr);
      }
      st.phase = 2;
    } else {
      st.q_sum.assign(sum.begin(), sum.end());
      st.phase = 4;
    }
  }

  void finish(std::span<float> y, EncodeContext& ctx) const override {
    PowerSgdState& st = state_for(ctx, y.size());
    const Layout& l = st.layout;
    expect_phase(st, 4, "finish");
    if (l.raw()) {
      if (l.n) std::memcpy(y.data(), st.m.data(), l.n * sizeof(float));
    } else {
      // y = P_hat Q_sum^T; residual = M - P_hat Q_w^T (in M's buffer, then swapped in).
      kit::sgemm(true, false, l.rows, l.cols, l.rank, 1.0f, st.p.data(), l.rows,
                 st.q_sum.data(), l.cols, 0.0f, y.data(), l.cols);
      kit::sgemm(true, false, l.rows, l.cols, l.rank, -1.0f, st.p.data(), l.rows,
                 st.q_local.data(), l.cols, 1.0f, st.m.data(), l.cols);
      std::swap(st.m, st.residual);
      if (warm_) keep_warm_start(st, st.q_sum, ctx);
    }
    ++st.steps;
    st.phase = 0;
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    Layout l = layout(n);
    return kMetaBytes + 4 * (l.valid ? l.payload_floats() : n);
  }

  // The single-rank path: the rounds run back to back with the sums being this rank's own
  // contributions, and M scaled by a power of two so that no product can overflow.
  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    PowerSgdState& st = state_for(ctx, x.size());
    const Layout& l = st.layout;
    wire::Writer w(out);
    w.put(static_cast<std::uint64_t>(l.rows));
    w.put(static_cast<std::uint64_t>(l.cols));
    w.put(static_cast<std::uint32_t>(l.rank));
    if (l.raw()) {
      w.put(1.0f);
      auto dst = w.take(l.n * 4);
      if (!kit::copy_finite(x, reinterpret_cast<float*>(dst.data()))) {
        kit::throw_non_finite(x, spec());
      }
      ++st.steps;
      return w.size();
    }
    Workspace& ws = ctx.scratch();
    std::span<float> m = ws.get<float>(0, l.n);
    kit::add_to(x, st.residual, m);
    float top = kit::abs_max(m);
    if (!std::isfinite(top)) reject(x);
    const float scale = top >= 2.0f ? std::ldexp(1.0f, std::ilogb(top)) : 1.0f;
    // BLAS applies alpha after accumulating, so M itself is scaled (exact: a power of two;
    // only values already near the subnormal range lose bits). Gradients rarely reach 2.
    if (scale != 1.0f) kit::scale(m, 1.0f / scale);
    w.put(scale);

    std::span<float> fresh = ws.get<float>(1, l.q_len());
    const float* q = start_q(st, fresh, ctx);
    std::span<float> p = ws.get<float>(2, l.p_len());
    kit::sgemm(false, true, l.rank, l.rows, l.cols, 1.0f, q, l.cols, m.data(), l.cols, 0.0f,
               p.data(), l.rows);
    // kit::abs_max may miss a NaN (x86 max drops it); the product cannot: NaN spreads into P.
    if (kit::find_non_finite(p) != p.size()) reject(x);
    kit::orthonormalize(p.data(), l.rank, l.rows, nullptr);
    std::span<float> qs = ws.get<float>(3, l.q_len());
    kit::sgemm(false, false, l.rank, l.cols, l.rows, 1.0f, p.data(), l.rows, m.data(), l.cols,
               0.0f, qs.data(), l.cols);
    std::memcpy(w.take(p.size() * 4).data(), p.data(), p.size() * 4);
    std::memcpy(w.take(qs.size() * 4).data(), qs.data(), qs.size() * 4);

    // residual = M - scale * P_hat (Q/scale)^T, what decode() reconstructs.
    kit::sgemm(true, false, l.rows, l.cols, l.rank, -1.0f, p.data(), l.rows, qs.data(), l.cols,
               1.0f, m.data(), l.cols);
    if (scale != 1.0f) {
      kit::scale(m, scale);
      if (may_overflow(l, scale)) saturate(m);
    }
    std::memcpy(st.residual.data(), m.data(), l.n * sizeof(float));
    if (warm_) keep_warm_start(st, qs, ctx);
    ++st.steps;
    return w.size();
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    Layout l = layout(y.size());
    if (!l.valid) {
      throw DecodeError(fmt::format("terse: {}: rows={} does not divide {} elements", spec(),
                                    rows_, y.size()));
    }
    wire::Reader r(in, "powersgd");
    auto rows = r.get<std::uint64_t>();
    auto cols = r.get<std::uint64_t>();
    auto rank = r.get<std::uint32_t>();
    auto scale = r.get<float>();
    if (rows != l.rows || cols != l.cols || rank != l.rank) {
      throw DecodeError(fmt::format(
          "terse: {}: payload describes a {}x{} matrix of rank {}; {} elements give {}x{} of "
          "rank {}", spec(), rows, cols, rank, l.n, l.rows, l.cols, l.rank));
    }
    expect_payload_bytes(in, y.size(), kMetaBytes + 4 * l.payload_floats());
    const bool accumulate = mode == DecodeMode::kAccumulate;
    thread_local std::vector<float> aligned;
    const float* data = floats(r.take(4 * l.payload_floats()), aligned);
    if (l.raw()) {
      if (scale != 1.0f) throw DecodeError(fmt::format("terse: {}: raw scale {}", spec(), scale));
      std::span<const float> v(data, l.n);
      if (std::size_t bad = kit::find_non_finite(v); bad != v.size()) {
        throw DecodeError(fmt::format("terse: {}: raw value {} is not finite", spec(), bad));
      }
      if (l.n != 0) kit::store_or_add(data, y, accumulate);  // n == 0: data may be null
      return;
    }
    int e = 0;
    if (!(scale >= 1.0f) || !std::isfinite(scale) || std::frexp(scale, &e) != 0.5f) {
      throw DecodeError(fmt::format("terse: {}: scale {} is not a power of two >= 1", spec(),
                                    scale));
    }
    std::span<const float> p(data, l.p_len());
    std::span<const float> q(data + l.p_len(), l.q_len());
    const float q_bound = 2.0f * std::sqrt(static_cast<float>(l.rows)) * kSlack;
    if (kit::find_non_finite(p) != p.size() || kit::find_non_finite(q) != q.size() ||
        !(kit::abs_max(p) <= kSlack) || !(kit::abs_max(q) <= q_bound)) {
      throw DecodeError(fmt::format("terse: {}: factor values out of range or not finite",
                                    spec()));
    }
    kit::sgemm(true, false, l.rows, l.cols, l.rank, scale, p.data(), l.rows, q.data(), l.cols,
               accumulate ? 1.0f : 0.0f, y.data(), l.cols);
    if (may_overflow(l, scale)) saturate(y);
  }

 private:
  // M's array at n floats (allocated when its size changes; every use overwrites it whole).
  static void fit_m(PowerSgdState& st, std::size_t n) {
    if (st.m.size() != n) st.m = kit::PageArray<float>(n, kit::PageArray<float>::Init::kNone);
  }
  // |scale * P_hat Q^T| <= scale * rank * max|P| * max|Q|: only inputs within a factor of
  // about 2 rank sqrt(rows) of FLT_MAX can overflow, and then results saturate.
  static bool may_overflow(const Layout& l, float scale) {
    double bound = static_cast<double>(scale) * static_cast<double>(l.rank) * kSlack * 2.0 *
                   std::sqrt(static_cast<double>(l.rows)) * kSlack;
    return bound >= static_cast<double>(std::numeric_limits<float>::max()) / 2;
  }
  static void saturate(std::span<float> v) {
    for (float& a : v) {
      if (std::isinf(a)) a = std::copysign(std::numeric_limits<float>::max(), a);
    }
  }

  Layout layout(std::size_t n) const {
    Layout l;
    l.n = n;
    if (rows_ > 0) {
      if (n % rows_ != 0) {
        l.valid = false;
        return l;
      }
      l.rows = rows_;
      l.cols = n / rows_;
    } else {
      l.rows = largest_divisor_up_to_sqrt(n);
      l.cols = l.rows == 0 ? 0 : n / l.rows;
    }
    std::size_t r = std::min({rank_, l.rows, l.cols});
    bool fits = l.rows <= static_cast<std::size_t>(INT_MAX) &&
                l.cols <= static_cast<std::size_t>(INT_MAX);
    l.rank = (r > 0 && fits && r * (l.rows + l.cols) < n) ? r : 0;
    return l;
  }

  Layout checked_layout(std::size_t n) const {
    Layout l = layout(n);
    if (!l.valid) {
      throw InvalidArgument(fmt::format("terse: {}: rows={} does not divide a tensor of {} "
                                        "elements", spec(), rows_, n));
    }
    return l;
  }

  PowerSgdState& state_for(EncodeContext& ctx, std::optional<std::size_t> n) const {
    auto* st = dynamic_cast<PowerSgdState*>(ctx.state);
    if (st == nullptr || (n && st->layout.n != *n)) {
      throw InvalidArgument(fmt::format(
          "terse: {}: EncodeContext::state is not a powersgd state{} (use make_state)", spec(),
          n ? fmt::format(" for {} elements", *n) : std::string()));
    }
    return *st;
  }

  void check_length(const char* what, std::size_t got, std::size_t want) const {
    if (got != want) {
      throw InvalidArgument(
          fmt::format("terse: {}: {} has {} elements, expected {}", spec(), what, got, want));
    }
  }

  void expect_phase(const PowerSgdState& st, int phase, const char* call) const {
    if (st.phase != phase) {
      throw InvalidArgument(fmt::format(
          "terse: {}: {} out of order (run encode_round(0), absorb_round(0), encode_round(1), "
          "absorb_round(1), finish)", spec(), call));
    }
  }

  [[noreturn]] void reject(std::span<const float> x) const {
    if (kit::find_non_finite(x) != x.size()) kit::throw_non_finite(x, spec());
    throw InvalidArgument(fmt::format("terse: {}: input plus error-feedback residual overflows "
                                      "fp32", spec()));
  }

  // The Q this step multiplies by: the warm start, or a fresh draw shared by all ranks.
  const float* start_q(const PowerSgdState& st, std::span<float> buf,
                       const EncodeContext& ctx) const {
    if (warm_ && st.has_q) return st.q.data();
    return draw_q(buf, ctx);
  }
  const float* draw_q(std::span<float> buf, const EncodeContext& ctx) const {
    fill_random(buf, kit::combine_keys(ctx.shared_key(), kInitTag));
    return buf.data();
  }

  // Q for the next step: the summed Q with orthonormal columns (the scale does not matter:
  // P_hat is invariant to it). A column that vanished (zero gradient, rank-deficient M) is
  // drawn afresh from the shared key so the iteration can find new directions.
  void keep_warm_start(PowerSgdState& st, std::span<const float> q_sum,
                       const EncodeContext& ctx) const {
    const Layout& l = st.layout;
    std::copy(q_sum.begin(), q_sum.end(), st.q.begin());
    bool degenerate[64];
    kit::orthonormalize(st.q.data(), l.rank, l.cols, degenerate);
    for (int attempt = 0; attempt < 3; ++attempt) {
      bool any = false;
      for (std::size_t k = 0; k < l.rank; ++k) {
        if (!degenerate[k]) continue;
        any = true;
        fill_random(std::span<float>(st.q).subspan(k * l.cols, l.cols),
                    kit::combine_keys(ctx.shared_key(), kReseedTag + attempt * 64 + k));
      }
      if (!any) break;
      kit::orthonormalize(st.q.data(), l.rank, l.cols, degenerate);
    }
    st.has_q = true;
  }

  static const float* floats(std::span<const std::byte> bytes, std::vector<float>& tmp) {
    if (reinterpret_cast<std::uintptr_t>(bytes.data()) % alignof(float) == 0) {
      return reinterpret_cast<const float*>(bytes.data());
    }
    tmp.resize(bytes.size() / 4);
    if (!bytes.empty()) std::memcpy(tmp.data(), bytes.data(), bytes.size());
    return tmp.data();
  }

  std::size_t rank_;
  std::size_t rows_;
  bool warm_;
  std::unique_ptr<Codec> wire_;
};

const bool registered = register_codec(
    {"powersgd", 14,
     "PowerSGD rank-r power iteration with warm start and built-in error feedback (2 rounds)",
     [](SpecReader& r) { return std::make_unique<PowerSgdCodec>(Params::read(r), r); }});

}  // namespace
}  // namespace terse
