// The CPU meter (measuring.h): the strategies' fp32 work and every codec's encode, decode,
// accumulate and combine timed at sizes 8x apart, with every rank of the host busy at once, and
// the slowdown of several threads per rank; all fitted as A + B*n.
//
// Why everything is measured with every rank busy at once: ranks of one job may share a
// machine, and a collective runs as fast as its slowest rank under that load. Measuring one
// rank alone would predict an idle machine.
#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <functional>
#include <memory>
#include <thread>

#include "kit/basic.h"
#include "kit/cpu_time.h"
#include "kit/memory.h"
#include "planner/exchange.h"
#include "planner/measuring.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/testing/gradient.h"

namespace terse::planner {

namespace {

// A gradient-like input: normal values with rare large outliers (the benchmarks' input).
std::vector<float> gradient(std::size_t n) {
  return testing::synthetic_gradient(n, 7, testing::kBenchmarkGradient);
}

// Median seconds of f over at least 5 runs and 3 ms (at most 60 runs), after one warm-up, each
// run after `prepare` (not timed); a run counts as the lesser of its wall time and its
// process's CPU time. Ranks sharing a core take turns on it: a run long enough to span the
// scheduler's turns would count the other ranks' turns too, and the cost model's host bound
// adds up every rank's work over the cores itself. CPU time above the wall time is threads of
// this process working at once (OpenBLAS's), which the wall time counts right.
double time_op(const std::function<void()>& f, const std::function<void()>& prepare = {}) {
  if (prepare) prepare();
  f();
  std::vector<double> t;
  const auto start = Clock::now();
  while (t.size() < 60 && (t.size() < 5 || seconds_since(start) < 0.003)) {
    if (prepare) prepare();
    const double cpu0 = kit::process_cpu_seconds();
    const auto t0 = Clock::now();
    f();
    const double wall = seconds_since(t0);
    t.push_back(std::min(wall, kit::process_cpu_seconds() - cpu0));
  }
  return median(std::move(t));
}

constexpr int kSlowdownThreads = 4;  // the engine's default worker count

// Memory the size of several of the largest tensors measured, zeroed, as huge pages where the
// kernel offers them (first touches of 4 KiB pages would dominate otherwise; kit/memory.h).
using Arena = kit::PageArray<float>;

// A tensor reaches the engine just written (by the backward pass, by a benchmark's copy of its
// input): up to this size its partitions are still in the cache when the codec reads them.
constexpr std::size_t kWrittenBytes = std::size_t{4} << 20;

// A codec's cost per element grows a few times at most from one measured size to the next (8x
// the elements) as its data leave the cache; a step above this factor was disturbed.
constexpr double kImplausibleStep = 5;

// Runs the CPU measurements in lockstep with the other ranks (a barrier before each series),
// so that every series is measured under the load of all ranks of the host. Each call reads
// and writes the next window of arenas four times the largest size, so that no run finds the
// one before it in the cache; a window up to kWrittenBytes is read before its run (not timed),
// as the application's writes leave a small tensor, and a larger one comes from memory.
class CpuMeter {
 public:
  CpuMeter(Communicator* comm, std::size_t max_elements)
      : comm_(comm),
        arena_elements_(4 * std::max<std::size_t>(max_elements, 4096)),
        x_(arena_elements_),
        y_(arena_elements_) {
    for (std::size_t n = 1024; n <= std::max<std::size_t>(max_elements, 8192); n *= 8) {
      sizes_.push_back(n);
    }
    const std::vector<float> g =
        gradient(std::size_t{1} << 16);  // tiled: only its statistics matter
    for (std::size_t at = 0; at < arena_elements_; at += g.size()) {
      std::copy_n(g.begin(), std::min(g.size(), arena_elements_ - at), x_.all().begin() + at);
    }
  }

  const std::vector<std::size_t>& sizes() const { return sizes_; }
  // How many windows of n elements the arenas hold.
  std::size_t windows(std::size_t n) const { return arena_elements_ / std::max<std::size_t>(n, 1); }
  // Moves every window on by n elements (wrapping at the arena's end).
  void advance(std::size_t n) {
    at_ += n;
    if (at_ + n > arena_elements_) at_ = 0;
  }
  std::span<const float> x(std::size_t n) const { return x_.all().subspan(at_, n); }
  std::span<float> y(std::size_t n) { return y_.all().subspan(at_, n); }
  // Reads the windows of n elements (not timed): brings them into the cache.
  void touch(std::size_t n) { sink_ = kit::sum(x(n)) + kit::sum(y(n)); }

  // One time per size: f(n) timed by time_op, agreed over the ranks (their median); `times`
  // collects them in order. A size whose cost per element is implausible against its
  // neighbour's (implausible_steps) is measured again, at most twice, and keeps the lesser
  // time. Every rank decides on the same agreed times, so they measure again together.
  void series(const std::function<void(std::size_t)>& f, std::vector<double>& times) {
    auto measure = [&](std::size_t n) {
      if (comm_ != nullptr) comm_->barrier("calibration");
      return time_op([&] { f(n); },
                     [&] {
                       advance(n);
                       if (n * sizeof(float) <= kWrittenBytes) touch(n);
                     });
    };
    auto agree = [&](std::vector<double> t) {
      return comm_ != nullptr ? planner::agree_median(*comm_, std::move(t)) : t;
    };
    std::vector<double> t;
    for (std::size_t n : sizes_) t.push_back(measure(n));
    t = agree(std::move(t));
    const std::vector<double> xs(sizes_.begin(), sizes_.end());
    for (int retry = 0; retry < 2; ++retry) {
      const std::vector<std::size_t> bad = implausible_steps(xs, t, kImplausibleStep);
      if (bad.empty()) break;
      std::vector<double> again;
      for (std::size_t i : bad) again.push_back(measure(sizes_[i]));
      again = agree(std::move(again));
      for (std::size_t j = 0; j < bad.size(); ++j) t[bad[j]] = std::min(t[bad[j]], again[j]);
      measured_again_ += static_cast<int>(bad.size());
    }
    times.insert(times.end(), t.begin(), t.end());
  }
  // Sizes measured again by series().
  int measured_again() const { return measured_again_; }

 private:
  Communicator* comm_;
  std::size_t arena_elements_;
  std::vector<std::size_t> sizes_;
  Arena x_, y_;
  std::size_t at_ = 0;
  volatile double sink_ = 0;
  int measured_again_ = 0;
};

// Per-tensor state (error-feedback residuals) rotating through as many copies as the input
// arena holds windows (at most 16): in training, a tensor's state is cold when its step comes
// round. A new state is used once (`warm`) before it is timed: in training a tensor's state was
// touched in the step before, and first touches of fresh pages would add the kernel's page
// faults to a cost that training never pays again.
class StateRotation {
 public:
  using Warm = std::function<void(std::size_t, CodecState*)>;
  StateRotation(const Codec& codec, const CpuMeter& meter) : codec_(codec), meter_(meter) {}

  void set_warm(Warm warm) { warm_ = std::move(warm); }
  CodecState* next(std::size_t n) {
    if (state_n_ != n) {
      states_.clear();
      for (std::size_t i = 0; i < std::clamp<std::size_t>(meter_.windows(n), 1, 16); ++i) {
        states_.push_back(codec_.make_state(n));
        warm_(n, states_.back().get());
      }
      state_n_ = n;
    }
    return states_[turn_++ % states_.size()].get();
  }

 private:
  const Codec& codec_;
  const CpuMeter& meter_;
  Warm warm_;
  std::vector<std::unique_ptr<CodecState>> states_;
  std::size_t state_n_ = 0, turn_ = 0;
};

// A multi-round codec's series: all rounds and finish() as one rank runs them (its sum is its
// own contribution; the sums between rounds are raw rings, which the cost model prices from the
// links). Returns what one rank's contributions take on the wire at each size.
std::vector<double> measure_rounds(CpuMeter& meter, const RoundCodec& rounds, Workspace& ws,
                                   StateRotation& states, std::vector<double>& times) {
  const auto& sizes = meter.sizes();
  auto contribution_elements = [&](std::size_t n) {
    std::size_t total = 0;
    for (int r = 0; r < rounds.rounds(); ++r) total += rounds.round_elements(r, n);
    return total;
  };
  std::vector<float> contribution(contribution_elements(sizes.back()));
  auto all_rounds = [&](std::size_t n, CodecState* state) {
    EncodeContext ctx;
    ctx.state = state;
    ctx.workspace = &ws;
    for (int r = 0; r < rounds.rounds(); ++r) {
      std::span<float> sum = std::span(contribution).first(rounds.round_elements(r, n));
      rounds.encode_round(r, meter.x(n), sum, ctx);
      rounds.absorb_round(r, sum, ctx);
    }
    rounds.finish(meter.y(n), ctx);
  };
  states.set_warm(all_rounds);
  meter.series([&](std::size_t n) { all_rounds(n, states.next(n)); }, times);
  std::vector<double> encoded_bytes;
  for (std::size_t n : sizes) {
    double bytes = 0;
    for (int r = 0; r < rounds.rounds(); ++r) {
      const std::size_t m = rounds.round_elements(r, n);
      const Codec* wire = rounds.round_wire(r, n);
      bytes += static_cast<double>(wire != nullptr ? wire->max_encoded_bytes(m) : m * 4);
    }
    encoded_bytes.push_back(bytes);
  }
  return encoded_bytes;
}

// One codec's series, appended to `times`: encode, decode (overwrite and accumulate), and
// combine for a summable codec; a multi-round codec's rounds alone. Returns its encoded bytes
// at each size.
std::vector<double> measure_codec(CpuMeter& meter, const Codec& codec, Workspace& ws,
                                  std::vector<double>& times) {
  const auto& sizes = meter.sizes();
  std::vector<std::byte> payload(codec.max_encoded_bytes(sizes.back()));
  std::vector<std::byte> other(payload.size());
  StateRotation states(codec, meter);
  if (const auto* rounds = dynamic_cast<const RoundCodec*>(&codec);
      rounds != nullptr && codec.traits().multi_round) {
    return measure_rounds(meter, *rounds, ws, states, times);
  }
  std::size_t length = 0;
  auto encode_with = [&](std::size_t n, CodecState* state) {
    EncodeContext ctx;
    ctx.state = state;
    ctx.workspace = &ws;
    length = codec.encode(meter.x(n), payload, ctx);
  };
  states.set_warm(encode_with);
  auto encode = [&](std::size_t n) { encode_with(n, states.next(n)); };
  meter.series(encode, times);
  std::vector<double> encoded_bytes;
  for (std::size_t n : sizes) {
    encode(n);
    encoded_bytes.push_back(static_cast<double>(length));
  }
  // Decoders read a payload of the size being timed: encode it first (not timed).
  auto decode_with = [&](DecodeMode mode) {
    return [&, mode](std::size_t n) {
      if (Codec::peek(std::span(payload).first(length)).elements != n) encode(n);
      codec.decode(std::span(payload).first(length), meter.y(n), mode);
    };
  };
  meter.series(decode_with(DecodeMode::kOverwrite), times);
  meter.series(decode_with(DecodeMode::kAccumulate), times);
  if (codec.traits().summable) {
    meter.series(
        [&](std::size_t n) {
          if (Codec::peek(std::span(payload).first(length)).elements != n) {
            encode(n);
            std::copy(payload.begin(), payload.begin() + length, other.begin());
          }
          codec.combine(std::span(payload).first(length), std::span(other).first(length));
        },
        times);
  }
  return encoded_bytes;
}

// Wall time for `threads` threads of this rank to run `iterations` encode+decode passes over n
// elements each, all at once: on free cores as long as one thread's passes, on a saturated
// machine `threads` times as long.
double parallel_work_seconds(const Codec& codec, int threads, std::size_t n, int iterations) {
  std::barrier start(threads);
  std::vector<Clock::time_point> began(threads), ended(threads);
  auto body = [&](int t) {
    std::vector<float> x = gradient(n), y(n);
    std::vector<std::byte> payload(codec.max_encoded_bytes(n));
    Workspace ws;
    auto state = codec.make_state(n);
    EncodeContext ctx;
    ctx.state = state.get();
    ctx.workspace = &ws;
    auto once = [&] {
      const std::size_t b = codec.encode(x, payload, ctx);
      codec.decode(std::span(payload).first(b), y);
    };
    once();
    start.arrive_and_wait();
    began[t] = Clock::now();
    for (int i = 0; i < iterations; ++i) once();
    ended[t] = Clock::now();
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(*std::max_element(ended.begin(), ended.end()) -
                                       *std::min_element(began.begin(), began.end()))
      .count();
}

// The codecs of `specs` that send a payload ("none" has no costs of its own).
std::vector<std::unique_ptr<Codec>> payload_codecs(const std::vector<std::string>& specs) {
  std::vector<std::unique_ptr<Codec>> codecs;
  for (const auto& spec : specs) {
    auto codec = make_codec(spec);
    if (codec->name() == "none") continue;
    codecs.push_back(std::move(codec));
  }
  return codecs;
}

// CPU contention: encode+decode with 1..kSlowdownThreads threads per rank at once, appended to
// `times` (one time per count), on the first codec with a payload (multi-round codecs have no
// encode+decode pass to run), else fp16. Three series, each count's median kept: a spell of
// outside load lasting one series moves no figure.
void measure_contention(Communicator* comm, const std::vector<std::unique_ptr<Codec>>& codecs,
                        std::vector<double>& times) {
  auto first = std::find_if(codecs.begin(), codecs.end(),
                            [](const auto& codec) { return !codec->traits().multi_round; });
  const Codec* probe = first == codecs.end() ? nullptr : first->get();
  std::unique_ptr<Codec> fallback;
  if (probe == nullptr) {
    fallback = make_codec("fp16");
    probe = fallback.get();
  }
  // About 20 ms of one thread's work, so that threads sharing a core do interleave.
  constexpr std::size_t kProbeElements = std::size_t{1} << 18;
  const double pass = parallel_work_seconds(*probe, 1, kProbeElements, 3) / 3;
  const int iterations = static_cast<int>(std::clamp(0.02 / std::max(pass, 1e-6), 4.0, 200.0));
  constexpr int kSlowdownSeries = 3;
  std::vector<std::vector<double>> trials(kSlowdownThreads);
  for (int series = 0; series < kSlowdownSeries; ++series) {
    for (int threads = 1; threads <= kSlowdownThreads; ++threads) {
      if (comm != nullptr) comm->barrier("calibration");
      trials[threads - 1].push_back(
          parallel_work_seconds(*probe, threads, kProbeElements, iterations));
    }
  }
  for (auto& t : trials) times.push_back(median(std::move(t)));
}

// Fits the agreed `times` into `out`, in the order measure_cpu measured them.
void fit_cpu(const std::vector<double>& times, const std::vector<std::size_t>& sizes,
             const std::vector<std::unique_ptr<Codec>>& codecs,
             const std::vector<std::vector<double>>& encoded_bytes, Calibration& out) {
  std::size_t at = 0;
  std::vector<double> xs(sizes.begin(), sizes.end());
  auto next_fit = [&] {
    std::vector<double> ys(times.begin() + at, times.begin() + at + sizes.size());
    at += sizes.size();
    for (auto& v : ys) v = std::max(v, 1e-9);  // a clock tick: never zero
    return fit_cost(xs, ys);
  };
  out.add = next_fit();
  out.divide = next_fit();
  out.codecs.clear();
  for (std::size_t c = 0; c < codecs.size(); ++c) {
    CodecCosts k;
    k.spec = codecs[c]->spec();
    k.summable = codecs[c]->traits().summable;
    k.multi_round = codecs[c]->traits().multi_round;
    k.encode = next_fit();
    if (!k.multi_round) {
      k.decode = next_fit();
      k.accumulate = next_fit();
    }
    if (k.summable) k.combine = next_fit();
    k.bytes = fit_linear(xs, encoded_bytes[c]);
    out.codecs.push_back(std::move(k));
  }
  out.cpu_slowdown.clear();
  for (int t = 0; t < kSlowdownThreads; ++t) {
    out.cpu_slowdown.push_back(std::max(1.0, times[at + t] / times[at]));
  }
}

}  // namespace

void measure_cpu(Communicator* comm, const CalibrationOptions& options, Calibration& out) {
  const auto start = Clock::now();
  const int rank = comm != nullptr ? comm->rank() : 0;
  CpuMeter meter(comm, options.codec_max_elements);
  log_line(options.quiet, rank, fmt::format("  memory set up in {:.2f} s", seconds_since(start)));
  std::vector<double> times;  // every series, concatenated

  // The strategies' fp32 work: a received chunk added to one's own (in place), a division.
  meter.series([&](std::size_t n) { kit::add_to(meter.x(n), meter.y(n), meter.y(n)); }, times);
  meter.series([&](std::size_t n) { kit::divide_to(meter.x(n), 3.0f, meter.y(n)); }, times);

  const std::vector<std::unique_ptr<Codec>> codecs = payload_codecs(options.codecs);
  std::vector<std::vector<double>> encoded_bytes;
  Workspace ws;
  for (const auto& codec : codecs) encoded_bytes.push_back(measure_codec(meter, *codec, ws, times));
  log_line(options.quiet, rank,
           fmt::format("  series measured at {:.2f} s ({} sizes measured again: implausible "
                       "steps)",
                       seconds_since(start), meter.measured_again()));

  measure_contention(comm, codecs, times);
  // The median over ranks: ranks of a host share its cores and see the same costs, so a rank
  // far from the others was disturbed by something outside the job.
  log_line(options.quiet, rank,
           fmt::format("  contention measured at {:.2f} s", seconds_since(start)));
  if (comm != nullptr) times = agree_median(*comm, std::move(times));
  fit_cpu(times, meter.sizes(), codecs, encoded_bytes, out);
}

}  // namespace terse::planner
