// One rank of the multi-process engine tests, started by `terse run` or scripts/cluster.sh.
// Every rank can generate every rank's input, so each checks its results on its own against a
// single-process simulation (tests/collectives/simulate.h) and against the exact sum, and the
// ranks compare digests of their results to prove them bit-identical. Scenarios:
//   matrix [CODEC...]   every codec (default: all registered, with and without ef=1) x every
//                       strategy it is valid for x sizes x partitions, two steps each
//   group               a DDP-like bucket of small raw (fused) and compressed tensors over
//                       several steps; save_state/load_state resumes bit for bit
//   nonfinite [keep]    one rank's input holds NaN or Inf: every rank gets a clear error naming
//                       the rank and element, and the engine keeps working; with keep
//                       (keep_input_on_error) the tensors stay unchanged
//   mismatch KIND       ranks submit different sizes / names / codecs on first use
//   die VICTIM          VICTIM kills itself mid-collective; the others must fail within the
//                       timeout naming the tensor and the peer (they exit 3)
//   stress              hundreds of concurrent submissions on few worker threads
//   channel             point-to-point compressed messages along a chain of ranks, forward
//                       and backward, alongside engine traffic; NaN input and codec mismatch
//   half                fp16 and bf16 tensors: every strategy with the codecs that read half input
//                       directly and some that widen it, and raw; results are the simulation's on
//                       the widened inputs, rounded once, bit-identical on every rank; a NaN in one
//                       rank's half input fails every rank naming the rank and element
//   blas                the engine left OpenBLAS this rank's share of the cores (cores over
//                       LOCAL_WORLD_SIZE, at least 1), or the user's choice where one is set,
//                       and destroying it restored the count it found
//   reduce_scatter      every codec x strategy: raw is the rank-order sum bit for bit, sharded,
//                       ring and summable are the allreduce's slice bit for bit where the
//                       chunks are the shards, lossy ones within the allreduce's error bound
//   all_gather          every codec, in place too, fp32 and half: bit-identical on every rank,
//                       raw exact, lossy within the codec's bound
//   all_to_all          even and uneven (changing) splits: raw exact, lossy within the bound
//   collective_errors   NaN in a shard, mismatched first use, disagreeing all_to_all counts:
//                       an error on every rank naming rank, tensor and operation
//   all_to_all_errors   all_to_all counts that disagree (more, fewer) and NaN
//                       in a block, small blocks and blocks larger than a first message: an
//                       error on every rank within 5 s, and the engine keeps working
//   die_collective V    V dies during reduce-scatters; the others fail naming the operation
//   hierarchy           allreduces in two levels over the hosts the environment gives
//                       (TERSE_TOPOLOGY, TERSE_HOST, namespaces): every codec family x strategy,
//                       bit-identical on every rank and within bounds of the exact average;
//                       hierarchy auto's rule; NaN on one rank fails every rank naming it
//   hierarchy_collectives  reduce_scatter and all_gather in two levels over the hosts the
//                       environment gives: every strategy with codecs of each kind, fp32 and
//                       half; raw is the host-order sum of exact host sums bit for bit, lossy
//                       ones within the flat bound; all-gathers bit-identical on every rank;
//                       the bytes each rank puts on its host's link are exactly the two-level
//                       amount (raw) and below the flat one; hierarchy auto's rule; grouped
//                       strategies refused on uneven hosts; NaN, a sum that overflows and a
//                       hierarchy that differs between ranks fail every rank naming them
//   topology_error      the engine's construction fails (the test gives the ranks topologies
//                       that disagree or do not fit): prints EXPECTED-FAILURE and the error
//   slowpeer            rank 1 submits a tensor's first use late: while rank 0's submission
//                       waits for it in the first-use check, rank 0's other threads wait for
//                       an earlier handle, save state, plan and read bytes_sent without waiting
// Prints "OK rank R ..." on success; "CHECK FAILED: ..." and exit 2 on a wrong result.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../simulate.h"
#include "worker_check.h"
#include "kit/basic.h"
#include "kit/blas.h"
#include "kit/hash.h"
#include "kit/host.h"
#include "terse/channel.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"

namespace {

using namespace terse;
using Clock = std::chrono::steady_clock;
using testing::Inputs;

constexpr std::uint64_t kSeed = 1234;

using testing::check;
using testing::fail;

// Roughly normal values, different per (rank, tensor, step, element).
std::vector<float> make_input(int rank, const std::string& name, std::uint64_t step,
                              std::size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  const std::uint64_t key = kit::combine_keys(kit::combine_keys(fnv1a64(name), step), rank);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = kit::mix64(key + i * 0x9e3779b97f4a7c15ull);
    const float u1 = static_cast<float>(h & 0xffffff) / 16777216.0f;
    const float u2 = static_cast<float>((h >> 24) & 0xffffff) / 16777216.0f;
    const float u3 = static_cast<float>((h >> 48) & 0xffff) / 65536.0f;
    v[i] = (u1 + u2 + u3 - 1.5f) * 2.0f * scale;
  }
  return v;
}

Inputs all_inputs(int ranks, const std::string& name, std::uint64_t step, std::size_t n) {
  Inputs x;
  for (int i = 0; i < ranks; ++i) x.push_back(make_input(i, name, step, n));
  return x;
}

std::uint64_t digest(std::span<const std::byte> y) {
  return fnv1a64(std::string_view(reinterpret_cast<const char*>(y.data()), y.size()));
}

// Every rank's digest must equal every other's. y: fp32 results, or the 16-bit values of half
// ones (any contiguous range).
template <typename Values>
void check_identical(Communicator& comm, const Values& y, const std::string& what) {
  std::uint64_t mine = digest(std::as_bytes(std::span(y)));
  std::vector<std::uint64_t> all(comm.size());
  std::vector<std::size_t> sizes(comm.size(), 8);
  comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)),
                  sizes, "digest");
  for (int i = 0; i < comm.size(); ++i) {
    check(all[i] == mine, fmt::format("{}: rank {} and rank {} ended with different results",
                                      what, comm.rank(), i));
  }
}

void check_equal(std::span<const float> got, std::span<const float> want,
                 const std::string& what) {
  check(got.size() == want.size(), what + ": size");
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0) {
      fail(fmt::format("{}: element {} is {} but the simulation gives {}", what, i, got[i],
                       want[i]));
    }
  }
}

double relative_error(std::span<const float> y, std::span<const float> exact) {
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    err += (double(y[i]) - exact[i]) * (double(y[i]) - exact[i]);
    norm += double(exact[i]) * exact[i];
  }
  return norm == 0 ? std::sqrt(err) : std::sqrt(err / norm);
}

std::vector<float> exact_sum(const Inputs& x) {
  std::vector<double> s(x[0].size());
  for (const auto& v : x) {
    for (std::size_t i = 0; i < v.size(); ++i) s[i] += v[i];
  }
  return {s.begin(), s.end()};
}

// Relative L2 error of one encode/decode of x with a fresh context.
double round_trip_error(const Codec& codec, const std::vector<float>& x) {
  std::vector<std::byte> out(codec.max_encoded_bytes(x.size()));
  auto state = codec.make_state(x.size());
  EncodeContext ec;
  ec.seed = kSeed;
  ec.state = state.get();
  std::vector<float> y(x.size());
  if (const auto* rc = dynamic_cast<const RoundCodec*>(&codec); codec.traits().multi_round) {
    // One rank: the rounds' sums are its own contributions.
    for (int round = 0; round < rc->rounds(); ++round) {
      std::vector<float> c(rc->round_elements(round, x.size()));
      rc->encode_round(round, x, c, ec);
      rc->absorb_round(round, c, ec);
    }
    rc->finish(y, ec);
  } else {
    out.resize(codec.encode(x, out, ec));
    codec.decode(out, y);
  }
  return relative_error(y, x);
}

std::vector<float> averaged(std::vector<float> sum, int ranks, bool average) {
  if (average && ranks > 1) {
    for (float& v : sum) v /= static_cast<float>(ranks);
  }
  return sum;
}

// ---- matrix -------------------------------------------------------------------------------

// One case of the codec x strategy x size x K matrices: averaging on about half the cases.
AllreduceOptions matrix_options(const std::string& spec, Strategy strategy, std::size_t n, int k) {
  AllreduceOptions o;
  o.codec = spec;
  o.strategy = strategy;
  o.partitions = k;
  o.average = (n + k) % 2 == 0;
  return o;
}

int matrix(Communicator& comm, Engine& engine, std::vector<std::string> specs) {
  const int n_ranks = comm.size(), r = comm.rank();
  if (specs.empty()) {
    for (const auto& info : registered_codecs()) {
      specs.push_back(info.name);
      auto c = make_codec(info.name);
      const CodecTraits t = c->traits();
      if (!t.lossless && !t.multi_round && !t.builtin_feedback) specs.push_back(info.name + ":ef=1");
      if (info.name == "powersgd") specs.push_back("powersgd:wire=fp16");  // 16-bit round sums
    }
  }
  const std::size_t sizes[] = {0, 1, 63, 1000, 65537, 262147};
  const Strategy strategies[] = {Strategy::kRaw, Strategy::kAllgather, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable};
  testing::Simulator sim(n_ranks, kSeed);
  int cases = 0;
  for (const auto& spec : specs) {
    auto codec = make_codec(spec);
    for (Strategy strategy : strategies) {
      for (std::size_t n : sizes) {
        for (int k : {1, 3}) {
          const AllreduceOptions o = matrix_options(spec, strategy, n, k);
          TensorPlan plan;
          try {
            plan = engine.plan(n, o);
          } catch (const InvalidArgument&) {
            continue;  // not a valid combination (checked by the single-process tests)
          }
          const std::string name = fmt::format("{}/{}/{}/{}", spec, to_string(strategy), n, k);
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, n);
            std::vector<float> y = x[r];
            engine.allreduce(name, y, o).wait();
            const Codec* c = plan.strategy == Strategy::kRaw ? nullptr : codec.get();
            auto want = sim.run(name, step, plan.strategy, c, plan.partitions, x,
                                o.average ? n_ranks : 1);
            check_equal(y, want, what);
            check_identical(comm, y, what);
            auto exact = averaged(exact_sum(x), n_ranks, o.average);
            if (n > 0 && (codec->traits().lossless || plan.strategy == Strategy::kRaw)) {
              // The fp32 sum in the strategy's fixed order: close to the exact sum.
              check(relative_error(y, exact) < 1e-6, what + ": lossless result is not the sum");
            } else if (n >= 1000 && step == 0) {  // large enough for a stable error measure
              // The documented bound (docs/design.md): the relative error of the result is at
              // most 2N times that of one round trip of one rank's input (each of the at most N
              // encodings on a path adds at most its own error, partial sums grow with N).
              const double one = round_trip_error(*codec, x[0]);
              check(relative_error(y, exact) <= 2.0 * n_ranks * one + 1e-6,
                    fmt::format("{}: error {} exceeds 2N x the round-trip error {}", what,
                                relative_error(y, exact), one));
            }
            ++cases;
          }
        }
      }
    }
  }
  std::printf("OK rank %d matrix %d cases\n", r, cases);
  return 0;
}

// ---- half ---------------------------------------------------------------------------------

int half(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  // Codecs that read half input directly, some that widen it (error feedback, sparse, rounds).
  const char* specs[] = {"none", "fp16", "bf16", "minmax8", "onebit", "onebit:ef=1",
                         "topk:ratio=0.05,ef=1", "randomk:ratio=0.1", "qsgd", "powersgd"};
  const Strategy strategies[] = {Strategy::kAuto, Strategy::kAllgather, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable};
  testing::Simulator sim(n_ranks, kSeed);
  int cases = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (const char* spec : specs) {
      for (Strategy strategy : strategies) {
        for (std::size_t n : {std::size_t{1000}, std::size_t{65537}}) {
          for (int k : {1, 3}) {
            const AllreduceOptions o = matrix_options(spec, strategy, n, k);
            TensorPlan plan;
            try {
              plan = engine.plan(n, o, dtype);
            } catch (const InvalidArgument&) {
              continue;
            }
            if (std::string(spec) == "none" && strategy == Strategy::kAuto) {
              // Raw on a half tensor sends the tensor's own precision.
              check(plan.codec == (dtype == DType::kFloat16 ? "fp16" : "bf16") &&
                        plan.strategy == Strategy::kSummable,
                    fmt::format("raw {} planned as {} {}", to_string(dtype), plan.codec,
                                to_string(plan.strategy)));
            }
            auto codec = make_codec(plan.codec);
            const std::string name = fmt::format("{}/{}/{}/{}/{}", to_string(dtype), spec,
                                                 to_string(strategy), n, k);
            for (std::uint64_t step = 0; step < 2; ++step) {
              const std::string what = fmt::format("{} step {}", name, step);
              Inputs wide = all_inputs(n_ranks, name, step, n);
              std::vector<std::vector<std::uint16_t>> bits(n_ranks, std::vector<std::uint16_t>(n));
              for (int i = 0; i < n_ranks; ++i) {
                kit::narrow(dtype, wide[i], bits[i].data());
                kit::widen(dtype, bits[i].data(), wide[i], false);
              }
              std::vector<std::uint16_t> y = bits[r];
              engine.allreduce(name, TensorView(y.data(), n, dtype), o).wait();
              auto sum = sim.run(name, step, plan.strategy, codec.get(), plan.partitions, wide,
                                 o.average ? n_ranks : 1);
              std::vector<std::uint16_t> want(n);
              kit::narrow(dtype, sum, want.data());
              for (std::size_t i = 0; i < n; ++i) {
                if (y[i] != want[i]) {
                  fail(fmt::format("{}: element {} is 0x{:04x} but the simulation rounds to "
                                   "0x{:04x}",
                                   what, i, y[i], want[i]));
                }
              }
              check_identical(comm, y, what);
              if (codec->name() == "fp16" || codec->name() == "bf16") {
                std::vector<float> got(n);
                kit::widen(dtype, y.data(), got, false);
                const double bound = codec->name() == "bf16" || dtype == DType::kBFloat16
                                         ? 2e-2 : 2e-3;
                check(relative_error(got, averaged(exact_sum(wide), n_ranks, o.average)) < bound,
                      what + ": 16-bit sum is far from the exact sum");
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  // NaN in one rank's half input: every rank fails naming it, and the engine keeps working.
  for (const char* spec : {"none", "onebit", "fp16"}) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      const std::size_t n = 5000;
      const std::string name = fmt::format("nan/{}/{}", to_string(dtype), spec);
      std::vector<std::uint16_t> y(n);
      kit::narrow(dtype, make_input(r, name, 0, n), y.data());
      if (r == n_ranks - 1) y[4321] = dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0;
      AllreduceOptions o;
      o.codec = spec;
      std::string error;
      try {
        engine.allreduce(name, TensorView(y.data(), n, dtype), o).wait();
      } catch (const InvalidArgument& e) {
        error = e.what();
      }
      check(error.find(fmt::format("rank {}'s input holds NaN or Inf at element 4321",
                                   n_ranks - 1)) != std::string::npos &&
                error.find(name) != std::string::npos,
            fmt::format("{}: expected an error naming rank {} and element 4321, got '{}'", name,
                        n_ranks - 1, error));
      kit::narrow(dtype, make_input(r, name, 1, n), y.data());
      engine.allreduce(name, TensorView(y.data(), n, dtype), o).wait();
    }
  }
  std::printf("OK rank %d half %d cases\n", r, cases);
  return 0;
}

// ---- group --------------------------------------------------------------------------------

struct GroupTensor {
  std::string name;
  std::size_t n;
  std::string codec;
  Strategy strategy;
};

std::vector<GroupTensor> bucket() {
  return {{"fc1.weight", 100000, "onebit:ef=1", Strategy::kSharded},
          {"fc1.bias", 500, "none", Strategy::kAuto},
          {"fc2.weight", 30000, "fp16", Strategy::kSummable},
          {"fc2.bias", 10, "none", Strategy::kAuto},
          {"norm.weight", 1, "none", Strategy::kAuto},
          {"conv.weight", 4608, "powersgd:rank=2,rows=64", Strategy::kAuto},
          {"proj.weight", 8192, "powersgd:rank=3,wire=bf16", Strategy::kAuto},
          {"gate.weight", 6144, "powersgd:rank=2,wire=fp16", Strategy::kAllgather},
          {"up.weight", 6144, "powersgd:rank=2", Strategy::kAllgather},
          {"empty", 0, "none", Strategy::kAuto},
          {"head.weight", 20000, "terngrad", Strategy::kRing}};
}

std::vector<std::vector<float>> run_bucket(Engine& engine, int rank, std::uint64_t step) {
  std::vector<std::vector<float>> data;
  std::vector<TensorRef> refs;
  for (const auto& t : bucket()) data.push_back(make_input(rank, t.name, step, t.n));
  for (std::size_t i = 0; i < data.size(); ++i) {
    AllreduceOptions o;
    o.codec = bucket()[i].codec;
    o.strategy = bucket()[i].strategy;
    refs.push_back({bucket()[i].name, data[i], o});
  }
  engine.allreduce_group(std::move(refs)).wait();
  return data;
}

int group(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  testing::Simulator sim(n_ranks, kSeed);
  std::vector<std::byte> saved;
  std::vector<std::vector<float>> at_step3;
  for (std::uint64_t step = 0; step < 5; ++step) {
    if (step == 3) saved = engine.save_state();
    auto got = run_bucket(engine, r, step);
    if (step == 3) at_step3 = got;
    const auto tensors = bucket();
    // The engine fuses small raw tensors into one message: simulate them as one tensor.
    std::vector<std::vector<float>> want(tensors.size());
    std::vector<std::size_t> fused;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      AllreduceOptions o;
      o.codec = t.codec;
      o.strategy = t.strategy;
      TensorPlan plan = engine.plan(t.n, o);
      if (plan.strategy == Strategy::kRaw && t.n * 4 <= EngineOptions{}.fuse_bytes) {
        fused.push_back(i);
        continue;
      }
      auto codec = make_codec(t.codec);
      Inputs x = all_inputs(n_ranks, t.name, step, t.n);
      const Codec* c = plan.strategy == Strategy::kRaw ? nullptr : codec.get();
      want[i] = sim.run(t.name, step, plan.strategy, c, plan.partitions, x, n_ranks);
    }
    Inputs fx(n_ranks);
    for (std::size_t i : fused) {
      for (int k = 0; k < n_ranks; ++k) {
        auto v = make_input(k, tensors[i].name, step, tensors[i].n);
        fx[k].insert(fx[k].end(), v.begin(), v.end());
      }
    }
    auto fw = sim.run("fused", step, Strategy::kRaw, nullptr, 1, fx, n_ranks);
    std::size_t at = 0;
    for (std::size_t i : fused) {
      want[i].assign(fw.begin() + at, fw.begin() + at + tensors[i].n);
      at += tensors[i].n;
    }
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::string what = fmt::format("group step {} tensor {}", step, tensors[i].name);
      check_equal(got[i], want[i], what);
      check_identical(comm, got[i], what);
    }
  }
  // Resume from the state saved before step 3: steps 3 and 4 repeat bit for bit.
  engine.load_state(saved);
  auto again = run_bucket(engine, r, 3);
  for (std::size_t i = 0; i < again.size(); ++i) {
    check_equal(again[i], at_step3[i], "resumed step 3 tensor " + bucket()[i].name);
  }
  std::printf("OK rank %d group\n", r);
  return 0;
}

// ---- failures -----------------------------------------------------------------------------

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

// keep: the engine stages results (keep_input_on_error), so tensors must stay unchanged.
int nonfinite(Communicator& comm, Engine& engine, bool keep) {
  const int r = comm.rank(), bad_rank = comm.size() - 1;
  int cases = 0;
  // codec spec[@strategy]
  for (const std::string entry : {"none", "onebit", "fp16", "topk", "powersgd:rank=2",
                                  "powersgd:rank=2,wire=fp16", "powersgd:rank=2@allgather",
                                  "terngrad"}) {
    const std::string spec = entry.substr(0, entry.find('@'));
    const Strategy strategy = entry.find('@') == std::string::npos
                                  ? Strategy::kAuto
                                  : parse_strategy(entry.substr(entry.find('@') + 1));
    bool known = true;
    try {
      make_codec(spec);
    } catch (const SpecError&) {
      known = false;
    }
    if (!known) continue;
    for (float bad : {NAN, INFINITY}) {
      const std::string name = fmt::format("nonfinite/{}/{}", entry, bad);
      const std::size_t n = 50000, at = 31337;
      std::vector<float> x = make_input(r, name, 0, n);
      if (r == bad_rank) x[at] = bad;
      const std::vector<float> before = x;
      AllreduceOptions o;
      o.codec = spec;
      o.strategy = strategy;
      o.partitions = spec.rfind("powersgd", 0) == 0 ? 1 : 2;
      std::string error;
      try {
        engine.allreduce(name, x, o).wait();
      } catch (const InvalidArgument& e) {
        error = e.what();
      }
      check(!error.empty(), name + ": no error on rank " + std::to_string(r));
      check(contains(error, keep ? "unchanged" : "partial results"),
            name + ": error does not say what happened to the tensor: " + error);
      // Failures travel in-band, naming the rank and element everywhere, except in PowerSGD's
      // fp32 round sums, where the bad rank's NaN reaches the others as a non-finite sum.
      const bool in_band = spec != "none" && entry != "powersgd:rank=2";
      if (in_band) {
        check(contains(error, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                          bad_rank, at)),
              name + ": error does not name the rank and element: " + error);
      } else if (r == bad_rank) {
        check(contains(error, fmt::format("at element {}", at)),
              name + ": error does not name the element: " + error);
      }
      if (keep) {
        check(std::memcmp(x.data(), before.data(), n * 4) == 0, name + ": tensor was modified");
      }
      // The engine and communicator are still usable: the next allreduce gives the result
      // the simulation does, on every rank.
      const std::string after = name + "/after";
      std::vector<float> ok = make_input(r, after, 0, 1000);
      engine.allreduce(after, ok, o).wait();
      const TensorPlan plan = engine.plan(ok.size(), o);
      auto codec = make_codec(spec);
      testing::Simulator sim(comm.size(), kSeed);
      const auto want =
          sim.run(after, 0, plan.strategy, plan.strategy == Strategy::kRaw ? nullptr : codec.get(),
                  plan.partitions, all_inputs(comm.size(), after, 0, ok.size()),
                  o.average ? comm.size() : 1);
      check_equal(ok, want, after);
      ++cases;
    }
  }
  std::printf("OK rank %d nonfinite%s %d cases\n", r, keep ? " keep" : "", cases);
  return 0;
}

int mismatch(Communicator& comm, Engine& engine, const std::string& kind) {
  const int r = comm.rank();
  std::vector<float> x(1000, 1.0f);
  std::string name = "weights";
  AllreduceOptions o;
  if (r == 1) {
    if (kind == "size") x.resize(999);
    if (kind == "name") name = "bias";
    if (kind == "codec") o.codec = "fp16";
  }
  try {
    engine.allreduce(name, x, o).wait();
  } catch (const MismatchError& e) {
    const std::string msg = e.what();
    check(contains(msg, "rank 1 submitted") || r == 1, "message does not show rank 1: " + msg);
    check(contains(msg, "different tensors"), "message does not explain: " + msg);
    std::printf("EXPECTED-FAILURE rank %d: %s\n", r, msg.c_str());
    // Nothing was submitted: the next, matching submission works.
    std::vector<float> y(10, 1.0f);
    engine.allreduce("after", y).wait();
    check(y[0] == 1.0f, "average of ones is not one");
    std::printf("OK rank %d mismatch %s\n", r, kind.c_str());
    return 0;
  }
  fail("no MismatchError on rank " + std::to_string(r));
}

int die(Communicator& comm, Engine& engine, int victim) {
  const int r = comm.rank();
  // The launcher sends SIGTERM to the survivors as soon as the victim dies; ignore it, so that
  // each survivor must notice the death through the engine.
  signal(SIGTERM, SIG_IGN);
  const std::size_t n = 4 << 20;
  std::vector<float> x = make_input(r, "big", 0, n);
  // One allreduce completes, so every rank is past bootstrap; then the victim dies mid-way.
  engine.allreduce("warm-up", x).wait();
  if (r == victim) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      ::kill(::getpid(), SIGKILL);
    }).detach();
  }
  const auto start = Clock::now();
  try {
    for (int step = 0; step < 1000; ++step) {
      AllreduceOptions o;
      o.codec = step % 2 ? "onebit" : "none";
      engine.allreduce("big", x, o).wait();
    }
  } catch (const Error& e) {
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string msg = e.what();
    check(contains(msg, "'big"), "error does not name the tensor: " + msg);
    check(contains(msg, "peer"), "error does not name a peer: " + msg);
    std::printf("EXPECTED-FAILURE rank %d after %.2f s: %s\n", r, s, msg.c_str());
    std::fflush(stdout);
    std::_Exit(3);
  }
  fail("rank " + std::to_string(r) + " did not notice that rank " + std::to_string(victim) +
       " died");
}

int stress(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  testing::Simulator sim(n_ranks, kSeed);
  const char* specs[] = {"none", "onebit", "fp16", "minmax8"};
  constexpr int kTensors = 200;
  std::vector<std::vector<float>> data(kTensors);
  std::vector<Handle> handles;
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = fmt::format("t{}", i);
    data[i] = make_input(r, name, 0, 100 + 977 * (i % 13));
    AllreduceOptions o;
    o.codec = specs[i % 4];
    o.partitions = 1 + i % 4;
    handles.push_back(engine.allreduce(name, data[i], o));
  }
  for (auto& h : handles) h.wait();
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = fmt::format("t{}", i);
    AllreduceOptions o;
    o.codec = specs[i % 4];
    o.partitions = 1 + i % 4;
    TensorPlan plan = engine.plan(data[i].size(), o);
    auto codec = make_codec(o.codec);
    Inputs x = all_inputs(n_ranks, name, 0, data[i].size());
    auto want = sim.run(name, 0, plan.strategy,
                        plan.strategy == Strategy::kRaw ? nullptr : codec.get(), plan.partitions,
                        x, n_ranks);
    check_equal(data[i], want, "stress " + name);
  }
  std::printf("OK rank %d stress %d tensors\n", r, kTensors);
  return 0;
}

// What rank `from` sends as message number seq of `name`, decoded, for the receiver to check.
std::vector<float> expected_message(const std::string& spec, const std::vector<float>& x,
                                    const std::string& name, std::uint32_t seq, int from) {
  auto codec = make_codec(spec);
  auto state = codec->make_state(x.size());
  EncodeContext ec;
  ec.seed = kSeed;
  ec.step = seq;
  ec.tensor = kit::combine_keys(fnv1a64(name), 0);
  ec.rank = from;
  ec.state = state.get();
  std::vector<std::byte> out(codec->max_encoded_bytes(x.size()));
  out.resize(codec->encode(x, out, ec));
  std::vector<float> y(x.size());
  codec->decode(out, y);
  return y;
}

int channel(Communicator& comm, Engine& engine, std::shared_ptr<Communicator> shared) {
  const int r = comm.rank(), n_ranks = comm.size();
  ChannelOptions co;
  co.seed = kSeed;
  Channel ch(shared, co);
  const char* specs[] = {"none", "fp16", "onebit", "minmax8"};
  const std::size_t sizes[] = {0, 1, 1000, 300001};
  int messages = 0;
  // Engine traffic at the same time, on the same communicator.
  std::vector<float> g = make_input(r, "engine-side", 0, 100000);
  Handle side = engine.allreduce("engine-side", g);
  for (int round = 0; round < 2; ++round) {
    for (const char* spec : specs) {
      for (std::size_t n : sizes) {
        const std::string fwd = fmt::format("act/{}/{}", spec, n);
        const std::string bwd = fmt::format("grad/{}/{}", spec, n);
        const auto seq = static_cast<std::uint32_t>(round);
        std::vector<Handle> pending;
        std::vector<float> act_in(n), grad_in(n);
        auto act_out = make_input(r, fwd, round, n), grad_out = make_input(r, bwd, round, n);
        // Forward along the chain, then backward: post everything, then wait.
        if (r > 0) pending.push_back(ch.recv(r - 1, fwd, act_in, spec));
        if (r + 1 < n_ranks) pending.push_back(ch.send(r + 1, fwd, act_out, spec));
        if (r + 1 < n_ranks) pending.push_back(ch.recv(r + 1, bwd, grad_in, spec));
        if (r > 0) pending.push_back(ch.send(r - 1, bwd, grad_out, spec));
        for (auto& h : pending) h.wait();
        if (r > 0) {
          auto want = expected_message(spec, make_input(r - 1, fwd, round, n), fwd, seq, r - 1);
          check_equal(act_in, want, "channel " + fwd);
          ++messages;
        }
        if (r + 1 < n_ranks) {
          auto want = expected_message(spec, make_input(r + 1, bwd, round, n), bwd, seq, r + 1);
          check_equal(grad_in, want, "channel " + bwd);
          ++messages;
        }
      }
    }
  }
  side.wait();
  // A sender's NaN fails both ends; a codec mismatch fails the receiver.
  if (n_ranks >= 2 && r <= 1) {
    std::vector<float> x(5000, 1.0f), y(5000, 7.0f);
    if (r == 0) {
      x[1234] = NAN;
      try {
        ch.send(1, "bad", x, "fp16").wait();
        fail("send of NaN succeeded");
      } catch (const InvalidArgument& e) {
        check(contains(e.what(), "element 1234"), std::string("send error: ") + e.what());
      }
      ch.send(1, "mismatch", std::vector<float>(5000, 2.0f), "none").wait();
    } else {
      try {
        ch.recv(0, "bad", y, "fp16").wait();
        fail("recv of a NaN message succeeded");
      } catch (const InvalidArgument& e) {
        check(contains(e.what(), "rank 0's input holds NaN or Inf at element 1234"),
              std::string("recv error: ") + e.what());
      }
      check(y[0] == 7.0f, "failed recv wrote its output");
      try {
        ch.recv(0, "mismatch", y, "fp16").wait();
        fail("recv with the wrong codec succeeded");
      } catch (const MismatchError& e) {
        check(contains(e.what(), "mismatch"), std::string("mismatch error: ") + e.what());
      }
    }
  }
  std::printf("OK rank %d channel %d messages\n", r, messages);
  return 0;
}

// `before`: OpenBLAS's threads before the engine started. `terse run` starts every rank on this
// machine and says how many in LOCAL_WORLD_SIZE.
// Rank 1 is the slow peer: it submits "late" kSlowPeerDelay after the others. Rank 0 submits it
// from a thread of its own, which blocks in the first-use check until rank 1 comes, and
// meanwhile its main thread waits for an earlier handle, saves state, plans and reads
// bytes_sent: each must return while that submission still waits.
constexpr auto kSlowPeerDelay = std::chrono::seconds(3);

int slow_peer(Communicator& comm, Engine& engine) {
  const int r = comm.rank();
  std::vector<float> early(1000, 1.0f), late(1000, 2.0f);
  engine.allreduce("early", early).wait();            // its first-use check, with every rank
  Handle earlier = engine.allreduce("early", early);  // no check: its tasks run at once
  if (r != 0) {
    if (r == 1) std::this_thread::sleep_for(kSlowPeerDelay);
    engine.allreduce("late", late).wait();
    earlier.wait();
    check(late[0] == 2.0f && early[0] == 1.0f, "slowpeer: wrong averages");
    std::printf("OK rank %d slowpeer\n", r);
    return 0;
  }
  std::atomic<bool> started{false}, submitted{false};
  std::exception_ptr error;
  std::thread submitter([&] {
    try {
      started = true;
      Handle h = engine.allreduce("late", late);  // blocks in the first-use check
      submitted = true;
      h.wait();
    } catch (...) {
      error = std::current_exception();
    }
  });
  while (!started) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // into the check
  const auto t0 = Clock::now();
  std::vector<std::byte> state;
  TensorPlan plan;
  std::uint64_t sent = 0;
  std::string failed;
  try {
    earlier.wait();
    state = engine.save_state();  // "late" is not in flight until its check passed
    AllreduceOptions o;
    o.codec = "onebit";
    plan = engine.plan(1000, o);
    sent = engine.bytes_sent();
  } catch (const std::exception& e) {
    failed = e.what();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const bool still_waiting = !submitted;
  submitter.join();
  if (error) std::rethrow_exception(error);
  check(still_waiting && failed.empty(),
        fmt::format("slowpeer: the earlier handle, save_state, plan and bytes_sent returned "
                    "only after the slow peer's submission ({:.2f} s{}{})",
                    seconds, failed.empty() ? "" : ", then: ", failed));
  check(!state.empty() && plan.strategy == Strategy::kSharded && sent > 0,
        "slowpeer: wrong state, plan or bytes_sent");
  check(late[0] == 2.0f && early[0] == 1.0f, "slowpeer: wrong averages");
  std::printf("OK rank %d slowpeer: other calls took %.3f s while a submission waited\n", r,
              seconds);
  return 0;
}

int blas(Communicator& comm, int before) {
  bool chosen = false;
  for (const char* name : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* v = std::getenv(name);
    chosen = chosen || (v != nullptr && *v != '\0');
  }
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  check(local != nullptr, "blas: LOCAL_WORLD_SIZE is not set");
  const int share = std::max(1, kit::usable_cores() / std::max(1, std::atoi(local)));
  const int want = chosen ? before : std::min(before, share);
  check(kit::blas_threads() == want,
        fmt::format("blas: rank {} has {} OpenBLAS threads after the engine started, {} before; "
                    "want {} ({} cores, {} local ranks, {})",
                    comm.rank(), kit::blas_threads(), before, want, kit::usable_cores(), local,
                    chosen ? "threads set in the environment" : "none set"));
  return 0;
}

// After the engine was destroyed: the count it found is back.
int blas_restored(Communicator& comm, int before, int during) {
  check(kit::blas_threads() == before,
        fmt::format("blas: rank {} has {} OpenBLAS threads after the engine was destroyed, {} "
                    "before it started",
                    comm.rank(), kit::blas_threads(), before));
  std::printf("OK rank %d blas %d threads (%d before, %d after)\n", comm.rank(), during, before,
              kit::blas_threads());
  return 0;
}

// ---- reduce_scatter, all_gather, all_to_all ------------------------------------------------

// The codecs of the collective matrices: every registered one that is not multi-round, and
// error feedback on one of them.
std::vector<std::string> op_specs() {
  std::vector<std::string> specs;
  for (const auto& info : registered_codecs()) {
    if (make_codec(info.name)->traits().multi_round) continue;
    specs.push_back(info.name);
  }
  specs.push_back("onebit:ef=1");
  specs.push_back("topk:ratio=0.05,ef=1");
  return specs;
}

// Shard j's rank-order fp32 sum, divided as the engine divides.
std::vector<float> rank_order_shard(const Inputs& x, std::size_t shard, int j, bool average) {
  std::vector<float> acc(x[0].begin() + j * shard, x[0].begin() + (j + 1) * shard);
  for (std::size_t i = 1; i < x.size(); ++i) {
    for (std::size_t e = 0; e < shard; ++e) acc[e] += x[i][j * shard + e];
  }
  if (average && x.size() > 1) {
    for (float& v : acc) v /= static_cast<float>(x.size());
  }
  return acc;
}

// A reduce-scatter of half tensors (each rank's input, narrowed to dtype, of shard * ranks
// elements named `name`): this rank's half output, it widened, and the rank-order sum of the
// widened inputs' slice it should approach.
struct HalfReduceScatter {
  std::vector<std::uint16_t> y;
  std::vector<float> got, sum;
};
HalfReduceScatter half_reduce_scatter(Engine& engine, const std::string& name, DType dtype,
                                      const CollectiveOptions& o, int n_ranks, int r,
                                      std::size_t shard) {
  Inputs wide = all_inputs(n_ranks, name, 0, shard * n_ranks);
  std::vector<std::vector<std::uint16_t>> bits(n_ranks,
                                               std::vector<std::uint16_t>(shard * n_ranks));
  for (int i = 0; i < n_ranks; ++i) {
    kit::narrow(dtype, wide[i], bits[i].data());
    kit::widen(dtype, bits[i].data(), wide[i], false);
  }
  HalfReduceScatter out{std::vector<std::uint16_t>(shard), std::vector<float>(shard), {}};
  engine.reduce_scatter(name, TensorView(bits[r].data(), bits[r].size(), dtype),
                        TensorView(out.y.data(), shard, dtype), o)
      .wait();
  kit::widen(dtype, out.y.data(), out.got, false);
  out.sum = rank_order_shard(wide, shard, r, o.average);
  return out;
}

int reduce_scatter_matrix(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  const Strategy strategies[] = {Strategy::kRaw, Strategy::kAllToAll, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable};
  int cases = 0, identical = 0;
  for (const auto& spec : op_specs()) {
    auto codec = make_codec(spec);
    for (Strategy strategy : strategies) {
      for (std::size_t shard : {std::size_t{0}, std::size_t{1}, std::size_t{1000},
                                std::size_t{4096}, std::size_t{40000}}) {
        for (int k : {1, 3}) {
          CollectiveOptions o;
          o.codec = spec;
          o.strategy = strategy;
          o.partitions = k;
          o.average = (shard + k) % 2 == 0;
          const std::string name =
              fmt::format("rs/{}/{}/{}/{}", spec, to_string(strategy), shard, k);
          const std::size_t total = shard * n_ranks;
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, total);
            std::vector<float> y(shard, -7.0f);
            try {
              engine.reduce_scatter(name, TensorView(x[r]), TensorView(std::span(y)), o).wait();
            } catch (const InvalidArgument& e) {
              // Not a valid combination: refused at once, naming the operation.
              check(step == 0 && contains(e.what(), "reduce_scatter of tensor '" + name + "'"),
                    what + ": unexpected error: " + e.what());
              break;
            }
            const auto exact_all = averaged(exact_sum(x), n_ranks, o.average);
            const std::vector<float> exact(exact_all.begin() + r * shard,
                                           exact_all.begin() + (r + 1) * shard);
            if (strategy == Strategy::kRaw) {
              check_equal(y, rank_order_shard(x, shard, r, o.average), what + " (rank order)");
            } else if (codec->traits().lossless) {
              check(relative_error(y, exact) < 1e-6, what + ": lossless result is not the sum");
            } else if (shard >= 1000 && step == 0) {
              // One quantization per contribution (alltoall), or the allreduce's path: within
              // the allreduce's documented bound of 2N round trips.
              const double one = round_trip_error(*codec, x[0]);
              check(relative_error(y, exact) <= 2.0 * n_ranks * one + 1e-6,
                    fmt::format("{}: error {} exceeds 2N x the round-trip error {}", what,
                                relative_error(y, exact), one));
            }
            // The allreduce's own halves: the shard is the allreduce's slice bit for bit when
            // its chunks are the shards (one partition, a multiple of 64 elements).
            if (k == 1 && shard % 64 == 0 && shard > 0 &&
                (strategy == Strategy::kSharded || strategy == Strategy::kRing ||
                 strategy == Strategy::kSummable)) {
              AllreduceOptions a;
              a.codec = spec;
              a.strategy = strategy;
              a.partitions = 1;
              a.average = o.average;
              std::vector<float> full = x[r];
              engine.allreduce(name, full, a).wait();
              check_equal(y, std::span<const float>(full).subspan(r * shard, shard),
                          what + " (the allreduce's slice)");
              ++identical;
            }
            ++cases;
          }
        }
      }
    }
  }
  // Half tensors: widened a partition at a time, reduced in fp32, rounded once. Codec none sends
  // the values in their own format (exactly): the rank-order sum of the widened values, rounded.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (const std::string entry : {"none@auto", "minmax8@alltoall", "minmax8@sharded",
                                    "fp16@ring", "bf16@summable"}) {
      const std::size_t shard = 3000;
      CollectiveOptions o;
      o.codec = entry.substr(0, entry.find('@'));
      o.strategy = parse_strategy(entry.substr(entry.find('@') + 1));
      o.partitions = 2;
      const std::string name = fmt::format("rs/{}/{}", to_string(dtype), entry);
      const auto [y, got, sum] = half_reduce_scatter(engine, name, dtype, o, n_ranks, r, shard);
      if (o.codec == "none") {
        std::vector<std::uint16_t> want(shard);
        kit::narrow(dtype, sum, want.data());
        check(y == want, name + ": not the rank-order sum rounded once");
      } else {
        check(relative_error(got, sum) < 0.05,
              fmt::format("{}: error {} against the sum", name, relative_error(got, sum)));
      }
      ++cases;
    }
  }
  check(identical > 0, "no case compared with the allreduce");
  std::printf("OK rank %d reduce_scatter %d cases, %d identical to the allreduce\n", r, cases,
              identical);
  return 0;
}

// All-gathers of fp16 and bf16 shards with each codec of `specs` under `hierarchy` (tensors
// named PREFIX/DTYPE/SPEC): raw travels as it is, a codec reads the half values and rounds once;
// bit-identical on every rank. Returns the cases run.
int half_all_gathers(Communicator& comm, Engine& engine, std::initializer_list<const char*> specs,
                     const char* prefix, Hierarchy hierarchy) {
  const int n_ranks = comm.size(), r = comm.rank();
  int cases = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (const char* spec : specs) {
      const std::size_t shard = 3000;
      const std::string name = fmt::format("{}/{}/{}", prefix, to_string(dtype), spec);
      std::vector<std::vector<std::uint16_t>> bits(n_ranks, std::vector<std::uint16_t>(shard));
      for (int i = 0; i < n_ranks; ++i) {
        kit::narrow(dtype, make_input(i, name, 0, shard), bits[i].data());
      }
      std::vector<std::uint16_t> y(shard * n_ranks);
      CollectiveOptions o;
      o.codec = spec;
      o.partitions = 2;
      o.hierarchy = hierarchy;
      engine.all_gather(name, TensorView(bits[r].data(), shard, dtype),
                        TensorView(y.data(), y.size(), dtype), o)
          .wait();
      check_identical(comm, y, name);
      for (int j = 0; j < n_ranks; ++j) {
        std::vector<float> got(shard), want(shard);
        kit::widen(dtype, y.data() + j * shard, got, false);
        kit::widen(dtype, bits[j].data(), want, false);
        if (std::string(spec) == "none") {
          check(std::memcmp(y.data() + j * shard, bits[j].data(), shard * 2) == 0,
                name + ": raw half shard changed");
        } else {
          check(relative_error(got, want) < 0.05, name + ": half shard far from its input");
        }
      }
      ++cases;
    }
  }
  return cases;
}

int all_gather_matrix(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  int cases = 0;
  for (const auto& spec : op_specs()) {
    auto codec = make_codec(spec);
    for (std::size_t shard : {std::size_t{0}, std::size_t{1}, std::size_t{1000},
                              std::size_t{40000}}) {
      for (int k : {1, 3}) {
        for (bool in_place : {false, true}) {
          CollectiveOptions o;
          o.codec = spec;
          o.partitions = k;
          const std::string name =
              fmt::format("ag/{}/{}/{}/{}", spec, shard, k, in_place ? "inplace" : "");
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, shard);
            std::vector<float> y(shard * n_ranks, -7.0f);
            std::vector<float> in = x[r];
            std::span<float> input(in);
            if (in_place) {
              std::copy(in.begin(), in.end(), y.begin() + r * shard);
              input = std::span(y).subspan(r * shard, shard);
            }
            engine.all_gather(name, TensorView(input), TensorView(std::span(y)), o).wait();
            check_identical(comm, y, what);
            for (int j = 0; j < n_ranks; ++j) {
              std::span<const float> got = std::span<const float>(y).subspan(j * shard, shard);
              if (codec->traits().lossless) {
                check_equal(got, x[j], fmt::format("{}: rank {}'s shard", what, j));
              } else if (shard >= 1000 && step == 0) {
                const double one = round_trip_error(*codec, x[j]);
                check(relative_error(got, x[j]) <= 2.0 * one + 1e-6,
                      fmt::format("{}: rank {}'s shard: error {} exceeds 2x one round trip {}",
                                  what, j, relative_error(got, x[j]), one));
              }
            }
            ++cases;
          }
        }
      }
    }
  }
  // Half tensors: raw travels as it is; a codec reads the half values and rounds once.
  cases += half_all_gathers(comm, engine, {"none", "minmax8", "fp16"}, "ag", Hierarchy::kAuto);
  std::printf("OK rank %d all_gather %d cases\n", r, cases);
  return 0;
}

// counts[i][j]: what rank i sends rank j at a step (uneven, zeros included), or even.
std::vector<std::vector<std::size_t>> a2a_counts(int n, std::uint64_t step, bool even) {
  std::vector<std::vector<std::size_t>> c(n, std::vector<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      c[i][j] = even ? 3000 : ((i * 7 + j * 3 + step) % 5) * 1100 + (i + j) % 3;
    }
  }
  return c;
}

int all_to_all_matrix(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  int cases = 0;
  for (const std::string spec : {"none", "fp16", "minmax8", "onebit:ef=1", "topk:ratio=0.1",
                                 "qsgd"}) {
    auto codec = make_codec(spec);
    for (bool even : {true, false}) {
      for (int k : {1, 2}) {
        const std::string name = fmt::format("a2a/{}/{}/{}", spec, even ? "even" : "uneven", k);
        for (std::uint64_t step = 0; step < 3; ++step) {
          const std::string what = fmt::format("{} step {}", name, step);
          const auto counts = a2a_counts(n_ranks, step, even);
          std::vector<std::size_t> send(n_ranks), recv(n_ranks);
          Inputs x;
          for (int i = 0; i < n_ranks; ++i) {
            std::size_t total = 0;
            for (int j = 0; j < n_ranks; ++j) total += counts[i][j];
            x.push_back(make_input(i, name, step, total));
          }
          std::size_t out_total = 0;
          for (int j = 0; j < n_ranks; ++j) {
            send[j] = counts[r][j];
            recv[j] = counts[j][r];
            out_total += recv[j];
          }
          std::vector<float> y(out_total, -7.0f);
          CollectiveOptions o;
          o.codec = spec;
          o.partitions = k;
          engine.all_to_all(name, TensorView(x[r]), send, TensorView(std::span(y)), recv, o)
              .wait();
          std::size_t at = 0;
          for (int j = 0; j < n_ranks; ++j) {
            std::size_t from = 0;  // rank j's block for us starts after its blocks for 0..r-1
            for (int q = 0; q < r; ++q) from += counts[j][q];
            std::span<const float> want = std::span<const float>(x[j]).subspan(from, recv[j]);
            std::span<const float> got = std::span<const float>(y).subspan(at, recv[j]);
            const std::string block = fmt::format("{}: block from rank {}", what, j);
            if (j == r || codec->traits().lossless) {
              check_equal(got, want, block);
            } else if (recv[j] >= 1000) {
              const std::vector<float> w(want.begin(), want.end());
              const double one = round_trip_error(*codec, w);
              check(relative_error(got, want) <= 2.0 * one + 1e-6,
                    fmt::format("{}: error {} exceeds 2x one round trip {}", block,
                                relative_error(got, want), one));
            }
            at += recv[j];
          }
          ++cases;
        }
      }
    }
  }
  // Half blocks with a codec: read from the tensor's values, decoded and rounded once; a rank's
  // block to itself is exact.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (const std::string spec : {"minmax8", "fp16"}) {
      const std::string name = fmt::format("a2a/{}/{}", to_string(dtype), spec);
      const auto counts = a2a_counts(n_ranks, 1, false);
      std::vector<std::vector<std::uint16_t>> x;
      for (int i = 0; i < n_ranks; ++i) {
        std::size_t total = 0;
        for (int j = 0; j < n_ranks; ++j) total += counts[i][j];
        x.emplace_back(total);
        kit::narrow(dtype, make_input(i, name, 0, total), x.back().data());
      }
      std::vector<std::size_t> send(n_ranks), recv(n_ranks);
      std::size_t out_total = 0;
      for (int j = 0; j < n_ranks; ++j) {
        send[j] = counts[r][j];
        recv[j] = counts[j][r];
        out_total += recv[j];
      }
      std::vector<std::uint16_t> y(out_total);
      CollectiveOptions o;
      o.codec = spec;
      o.partitions = 2;
      engine.all_to_all(name, TensorView(x[r].data(), x[r].size(), dtype), send,
                        TensorView(y.data(), y.size(), dtype), recv, o)
          .wait();
      std::size_t at = 0;
      for (int j = 0; j < n_ranks; ++j) {
        std::size_t from = 0;
        for (int q = 0; q < r; ++q) from += counts[j][q];
        std::vector<float> got(recv[j]), want(recv[j]);
        kit::widen(dtype, y.data() + at, got, false);
        kit::widen(dtype, x[j].data() + from, want, false);
        if (j == r) {
          check(std::memcmp(y.data() + at, x[j].data() + from, recv[j] * 2) == 0,
                name + ": own block not exact");
        } else if (recv[j] > 0) {
          check(relative_error(got, want) < 0.05,
                fmt::format("{}: block from rank {}: error {}", name, j,
                            relative_error(got, want)));
        }
        at += recv[j];
      }
      ++cases;
    }
  }
  // bf16 blocks travel raw, bit for bit.
  {
    const DType dtype = DType::kBFloat16;
    const std::size_t per = 777;
    std::vector<std::uint16_t> in(per * n_ranks), out(per * n_ranks);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint16_t>(r * 1000 + i);
    std::vector<std::size_t> counts(n_ranks, per);
    engine.all_to_all("a2a/bf16", TensorView(in.data(), in.size(), dtype), counts,
                      TensorView(out.data(), out.size(), dtype), counts)
        .wait();
    for (int j = 0; j < n_ranks; ++j) {
      for (std::size_t e = 0; e < per; ++e) {
        check(out[j * per + e] == static_cast<std::uint16_t>(j * 1000 + r * per + e),
              "a2a/bf16: wrong value");
      }
    }
    ++cases;
  }
  std::printf("OK rank %d all_to_all %d cases\n", r, cases);
  return 0;
}

// Runs f, which must throw terse::Error on this rank (within `limit` seconds, when given) with
// every needle in its message; prints the message for the test's log.
void expect_error(int r, const std::string& what, const std::function<void()>& f,
                  const std::vector<std::string>& needles, double limit = 0) {
  std::string error;
  const auto start = Clock::now();
  try {
    f();
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  check(!error.empty(), what + ": no error on rank " + std::to_string(r));
  if (limit > 0) check(seconds < limit, fmt::format("{}: the error took {} s", what, seconds));
  for (const auto& needle : needles) {
    check(contains(error, needle), what + ": error lacks '" + needle + "': " + error);
  }
  std::printf("EXPECTED-FAILURE rank %d: %s\n", r, error.c_str());
}

// Errors that every rank must see: NaN in one rank's shard, mismatched first use, counts that
// disagree. The engine keeps working after each.
int collective_errors(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank(), bad = n_ranks - 1;
  int cases = 0;
  auto expect = [&](const std::string& what, const std::function<void()>& f,
                    const std::vector<std::string>& needles) {
    expect_error(r, what, f, needles);
    ++cases;
  };
  const std::size_t shard = 5000, at = 4321;
  // NaN in the bad rank's input, in the shard of rank 0.
  for (const std::string entry : {"none@raw", "minmax8@alltoall", "onebit@sharded",
                                  "minmax8@ring", "fp16@summable"}) {
    CollectiveOptions o;
    o.codec = entry.substr(0, entry.find('@'));
    o.strategy = parse_strategy(entry.substr(entry.find('@') + 1));
    o.partitions = 2;
    const std::string name = "rs-nan/" + entry;
    std::vector<float> x = make_input(r, name, 0, shard * n_ranks);
    if (r == bad) x[at] = NAN;
    std::vector<float> y(shard);
    expect(name, [&] { engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"reduce_scatter", name, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                                bad, at)});
    x = make_input(r, name, 1, shard * n_ranks);
    engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait();
  }
  // A half tensor's NaN is found in its widened partition and named by its own index.
  for (const std::string spec : {"none", "minmax8"}) {
    const std::string name = "rs-nan/bf16/" + spec;
    CollectiveOptions o;
    o.codec = spec;
    o.partitions = 3;
    std::vector<std::uint16_t> x(shard * n_ranks, 0x3f80), y(shard);  // ones
    if (r == bad) x[shard + at] = 0x7fc0;  // in the shard of rank 1
    const DType bf16 = DType::kBFloat16;
    expect(name, [&] {
      engine.reduce_scatter(name, TensorView(x.data(), x.size(), bf16),
                            TensorView(y.data(), y.size(), bf16), o).wait();
    }, {"reduce_scatter", name, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                            bad, shard + at)});
  }
  for (const std::string spec : {"none", "minmax8"}) {
    const std::string name = "ag-nan/" + spec;
    CollectiveOptions o;
    o.codec = spec;
    std::vector<float> x = make_input(r, name, 0, shard), y(shard * n_ranks);
    if (r == bad) x[at] = INFINITY;
    expect(name, [&] { engine.all_gather(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"all_gather", name, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                            bad, at)});
    x = make_input(r, name, 1, shard);
    engine.all_gather(name, TensorView(x), TensorView(std::span(y)), o).wait();

    const std::string a2a = "a2a-nan/" + spec;
    std::vector<float> in = make_input(r, a2a, 0, shard * n_ranks), out(shard * n_ranks);
    std::vector<std::size_t> counts(n_ranks, shard);
    if (r == bad) in[at] = NAN;  // in the block for rank 0
    expect(a2a, [&] { engine.all_to_all(a2a, TensorView(in), counts, TensorView(std::span(out)), counts, o).wait(); },
           {"all_to_all", a2a, fmt::format("rank {}'s input holds NaN or Inf at element {}", bad,
                                           at)});
  }
  {
    const std::string name = "a2a-nan/bf16/minmax8";
    CollectiveOptions o;
    o.codec = "minmax8";
    const DType bf16 = DType::kBFloat16;
    std::vector<std::uint16_t> in(shard * n_ranks, 0x3f80), out(shard * n_ranks);
    std::vector<std::size_t> counts(n_ranks, shard);
    if (r == bad) in[at] = 0x7f80;  // +Inf, in the block for rank 0
    expect(name, [&] {
      engine.all_to_all(name, TensorView(in.data(), in.size(), bf16), counts,
                        TensorView(out.data(), out.size(), bf16), counts, o).wait();
    }, {"all_to_all", name, fmt::format("rank {}'s input holds NaN or Inf at element {}", bad,
                                        at)});
  }
  // all_to_all counts that disagree across ranks: rank 0 expects one element more from the bad
  // rank than it sends (the others' blocks are fine).
  {
    const std::string name = "a2a-counts";
    std::vector<std::size_t> send(n_ranks, 100), recv(n_ranks, 100);
    if (r == 0) recv[bad] = 101;
    std::size_t in_total = 0, out_total = 0;
    for (int j = 0; j < n_ranks; ++j) {
      in_total += send[j];
      out_total += recv[j];
    }
    std::vector<float> in = make_input(r, name, 0, in_total), out(out_total);
    expect(name, [&] { engine.all_to_all(name, TensorView(in), send, TensorView(std::span(out)), recv).wait(); },
           {"all_to_all", name, fmt::format("rank 0 expected a block of"),
            fmt::format("from rank {}", bad)});
    recv[bad] = 100;
    out.resize(100 * n_ranks);
    engine.all_to_all(name, TensorView(in), send, TensorView(std::span(out)), recv).wait();
  }
  // Mismatched first use: rank 1 gives another shard size or codec.
  for (const std::string kind : {"size", "codec"}) {
    const std::string name = "mismatch/" + kind;
    CollectiveOptions o;
    std::size_t n = 1000;
    if (r == 1 && kind == "size") n = 999;
    if (r == 1 && kind == "codec") o.codec = "fp16";
    std::vector<float> x(n * n_ranks, 1.0f), y(n);
    expect(name, [&] { engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"different tensors", "rank 1 submitted", "reduce_scatter of"});
    std::vector<float> g(n * n_ranks);
    expect(name, [&] { engine.all_gather(name, TensorView(std::span(y)), TensorView(std::span(g)), o).wait(); },
           {"different tensors", "rank 1 submitted", "all_gather of"});
  }
  std::vector<float> ones(10 * n_ranks, 1.0f), y(10);
  engine.reduce_scatter("after", TensorView(ones), TensorView(std::span(y))).wait();
  check(y[0] == 1.0f, "average of ones is not one");
  std::printf("OK rank %d collective errors %d cases\n", r, cases);
  return 0;
}

// all_to_all's failures in its one message round, with blocks that come with their header and
// blocks too large for it (sent as a second message): a receiver that expects fewer or more
// elements than its peer sends, NaN in one block of a
// codec's partition. Each fails every rank within 5 s, naming the operation, the tensor
// and the ranks; the same tensor then succeeds with its exact blocks (the engine stays usable).
int all_to_all_errors(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank(), bad = n_ranks - 1;
  int cases = 0;
  auto expect = [&](const std::string& what, const std::function<void()>& f,
                    const std::vector<std::string>& needles) {
    expect_error(r, what, f, needles, 5.0);
    ++cases;
  };
  // Runs an all_to_all of `per` elements per block (rank 0 expecting `from_bad` more from the
  // bad rank) and checks every block when it succeeds.
  auto run = [&](const std::string& name, const std::string& codec, int k, std::size_t per,
                 long from_bad, bool nan) {
    std::vector<std::size_t> send(n_ranks, per), recv(n_ranks, per);
    if (r == 0) recv[bad] = per + from_bad;
    std::size_t in_total = 0, out_total = 0;
    for (int j = 0; j < n_ranks; ++j) {
      in_total += send[j];
      out_total += recv[j];
    }
    std::vector<float> in = make_input(r, name, 0, in_total), out(out_total, -7.0f);
    if (nan && r == bad) in[per / 2] = NAN;  // in the block for rank 0
    CollectiveOptions o;
    o.codec = codec;
    o.partitions = k;
    engine.all_to_all(name, TensorView(in), send, TensorView(std::span(out)), recv, o).wait();
    for (int j = 0; j < n_ranks; ++j) {
      const std::vector<float> x = make_input(j, name, 0, per * n_ranks);
      std::span<const float> want = std::span<const float>(x).subspan(r * per, per);
      std::span<const float> got = std::span<const float>(out).subspan(j * per, per);
      const std::string block = fmt::format("{}: block from rank {}", name, j);
      if (j == r || codec == "none") {
        check_equal(got, want, block);
      } else {
        check(relative_error(got, want) < 0.05,
              fmt::format("{}: error {}", block, relative_error(got, want)));
      }
    }
  };
  // 1000 floats come with their header; 200000 (800 KB raw, 200 KB in minmax8 and more than
  // any first message with its header at 4 ranks) follow it.
  for (const std::size_t per : {std::size_t{1000}, std::size_t{200000}}) {
    for (const std::string codec : {"none", "minmax8"}) {
      for (const long delta : {1L, -1L}) {
        const std::string name = fmt::format("a2a-errors/counts/{}/{}/{}", codec, per, delta);
        expect(name, [&] { run(name, codec, 1, per, delta, false); },
               {"all_to_all", name, "rank 0 expected a block of", fmt::format("from rank {}", bad)});
        run(name, codec, 1, per, 0, false);
      }
      const std::string nan = fmt::format("a2a-errors/nan/{}/{}", codec, per);
      expect(nan, [&] { run(nan, codec, 2, per, 0, true); },
             {"all_to_all", nan, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                             bad, per / 2)});
      run(nan, codec, 2, per, 0, false);
    }
  }
  std::printf("OK rank %d all_to_all errors %d cases\n", r, cases);
  return 0;
}

// VICTIM dies during a loop of reduce-scatters: the others fail within the timeout, naming
// the operation, the tensor and a peer.
int die_collective(Communicator& comm, Engine& engine, int victim) {
  const int r = comm.rank();
  signal(SIGTERM, SIG_IGN);
  const std::size_t shard = 1 << 20;
  std::vector<float> x = make_input(r, "big", 0, shard * comm.size()), y(shard);
  engine.reduce_scatter("warm-up", TensorView(x), TensorView(std::span(y))).wait();
  if (r == victim) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      ::kill(::getpid(), SIGKILL);
    }).detach();
  }
  const auto start = Clock::now();
  try {
    for (int step = 0; step < 1000; ++step) {
      CollectiveOptions o;
      o.codec = step % 2 ? "minmax8" : "none";
      engine.reduce_scatter("big", TensorView(x), TensorView(std::span(y)), o).wait();
    }
  } catch (const Error& e) {
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string msg = e.what();
    check(contains(msg, "reduce_scatter of") && contains(msg, "big"),
          "error does not name the operation and tensor: " + msg);
    check(contains(msg, "peer"), "error does not name a peer: " + msg);
    std::printf("EXPECTED-FAILURE rank %d after %.2f s: %s\n", r, s, msg.c_str());
    std::fflush(stdout);
    std::_Exit(3);
  }
  fail("rank " + std::to_string(r) + " did not notice that rank " + std::to_string(victim) +
       " died");
}

}  // namespace

// ---- hierarchy ----------------------------------------------------------------------------

// The job's hosts as the engine agreed on them: "0-1|2-3".
std::string hosts_text(const Engine& engine) {
  std::string out;
  for (const auto& h : engine.hosts()) {
    if (!out.empty()) out += "|";
    out += h.size() == 1 ? std::to_string(h[0]) : fmt::format("{}-{}", h.front(), h.back());
  }
  return out + (engine.reads_directly_inside_host() ? " (reads inside the host)"
                                                     : " (messages inside the host)");
}

// Allreduces in two levels over the hosts the environment gives (TERSE_TOPOLOGY, or TERSE_HOST,
// or network namespaces under scripts/cluster.sh -l): every codec family x strategy x size x K
// for two steps (error feedback per slot), bit-identical on every rank, lossless ones within
// fp32 rounding of the exact average, lossy ones within the flat strategies' documented bound;
// codec "auto"'s hierarchy rule; NaN on one rank fails every rank naming the rank and element,
// and the engine keeps working. Prints the hosts it ran on.
int hierarchy(Communicator& comm, Engine& engine) {
  const int n_ranks = comm.size(), r = comm.rank();
  const std::vector<std::string> specs = {"none",        "fp16",          "minmax8:ef=1",
                                          "onebit:ef=1", "topk:ratio=0.05,ef=1",
                                          "randomk:ratio=0.1", "qsgd",   "powersgd",
                                          "dgc"};
  const Strategy strategies[] = {Strategy::kAuto, Strategy::kAllgather, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable};
  int cases = 0;
  for (const auto& spec : specs) {
    auto codec = make_codec(spec);
    for (Strategy strategy : strategies) {
      for (std::size_t n : {std::size_t{1}, std::size_t{63}, std::size_t{1000},
                            std::size_t{65537}, std::size_t{200003}}) {
        for (int k : {1, 3}) {
          AllreduceOptions o = matrix_options(spec, strategy, n, k);
          o.hierarchy = Hierarchy::kHosts;
          TensorPlan plan;
          try {
            plan = engine.plan(n, o);
          } catch (const InvalidArgument&) {
            continue;
          }
          check(plan.hierarchical, fmt::format("{} {}: hierarchy hosts planned flat", spec, n));
          const std::string name = fmt::format("h/{}/{}/{}/{}", spec, to_string(strategy), n, k);
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, n);
            std::vector<float> y = x[r];
            engine.allreduce(name, y, o).wait();
            check_identical(comm, y, what);
            const auto exact = averaged(exact_sum(x), n_ranks, o.average);
            if (codec->traits().lossless || plan.strategy == Strategy::kRaw) {
              check(relative_error(y, exact) < 1e-6, what + ": lossless result is not the sum");
            } else if (n >= 1000 && step == 0) {
              const double one = round_trip_error(*codec, x[0]);
              check(relative_error(y, exact) <= 2.0 * n_ranks * one + 1e-6,
                    fmt::format("{}: error {} exceeds 2N x the round-trip error {}", what,
                                relative_error(y, exact), one));
            }
            ++cases;
          }
        }
      }
    }
  }
  // Codec "none" under hierarchy auto: two levels for large partitions where the hosts differ
  // and one holds several ranks, flat otherwise and for partitions the engine gathers.
  bool two_level = engine.hosts().size() > 1;
  bool several = false;
  for (const auto& h : engine.hosts()) several = several || h.size() > 1;
  two_level = two_level && several;
  AllreduceOptions automatic;
  check(engine.plan(1 << 20, automatic).hierarchical == two_level,
        fmt::format("hierarchy auto on hosts {}: a 4 MiB tensor planned {}", hosts_text(engine),
                    two_level ? "flat" : "in two levels"));
  check(!engine.plan(16, automatic).hierarchical, "hierarchy auto: 16 floats planned in two levels");
  automatic.hierarchy = Hierarchy::kFlat;
  check(!engine.plan(1 << 20, automatic).hierarchical, "hierarchy flat planned in two levels");

  // NaN on the last rank: every rank fails naming it and the element; the engine goes on.
  for (const char* spec : {"none", "onebit:ef=1", "minmax8", "powersgd:rank=2"}) {
    const std::string name = fmt::format("h/nan/{}", spec);
    const std::size_t n = 50000, at = 31337;
    std::vector<float> x = make_input(r, name, 0, n);
    if (r == n_ranks - 1) x[at] = NAN;
    AllreduceOptions o;
    o.codec = spec;
    o.hierarchy = Hierarchy::kHosts;
    o.partitions = std::string(spec).rfind("powersgd", 0) == 0 ? 1 : 2;
    std::string error;
    try {
      engine.allreduce(name, x, o).wait();
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
    check(contains(error, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                      n_ranks - 1, at)),
          fmt::format("{}: error on rank {} does not name the rank and element: '{}'", name, r,
                      error));
    std::vector<float> ok = make_input(r, name + "/after", 0, 1000);
    const std::vector<float> mine = ok;
    engine.allreduce(name + "/after", ok, o).wait();
    check_identical(comm, ok, name + "/after");
    ++cases;
  }
  std::printf("OK rank %d hierarchy %d cases on hosts %s\n", r, cases, hosts_text(engine).c_str());
  return 0;
}

// ---- hierarchy_collectives ------------------------------------------------------------------

// What the hierarchical raw reduce-scatter computes for shard j: each host's contributions
// summed in local rank order, the host sums added in host order, divided once.
std::vector<float> host_order_shard(const Inputs& x, const std::vector<std::vector<int>>& hosts,
                                    std::size_t shard, int j, bool average) {
  std::vector<float> acc(shard);
  for (std::size_t g = 0; g < hosts.size(); ++g) {
    std::vector<float> sum(shard);
    for (std::size_t l = 0; l < hosts[g].size(); ++l) {
      const float* from = x[hosts[g][l]].data() + j * shard;
      for (std::size_t e = 0; e < shard; ++e) sum[e] = l == 0 ? from[e] : sum[e] + from[e];
    }
    for (std::size_t e = 0; e < shard; ++e) acc[e] = g == 0 ? sum[e] : acc[e] + sum[e];
  }
  if (average && x.size() > 1) {
    for (float& v : acc) v /= static_cast<float>(x.size());
  }
  return acc;
}

// The layout's facts the byte counts follow from, for rank r.
struct HostFacts {
  int hosts = 0, ranks = 0;  // hosts, ranks on r's host
  int carried_across = 0;    // shards of other hosts whose host sum r carries (its host's)
  bool even = true;
};

HostFacts host_facts(const Engine& engine, int r) {
  const auto& hosts = engine.hosts();
  HostFacts f;
  f.hosts = static_cast<int>(hosts.size());
  int h = 0, local = 0;
  for (std::size_t g = 0; g < hosts.size(); ++g) {
    for (std::size_t l = 0; l < hosts[g].size(); ++l) {
      if (hosts[g][l] == r) h = static_cast<int>(g), local = static_cast<int>(l);
    }
    f.even = f.even && hosts[g].size() == hosts[0].size();
  }
  f.ranks = static_cast<int>(hosts[h].size());
  for (std::size_t g = 0; g < hosts.size(); ++g) {
    if (static_cast<int>(g) == h) continue;
    for (std::size_t l = 0; l < hosts[g].size(); ++l) {
      if (static_cast<int>(l) % f.ranks == local) ++f.carried_across;
    }
  }
  return f;
}

// Partitions the engine gives a collective of `shard` elements a shard asked for k (at most
// one per 64 elements of the shard).
int effective_partitions(std::size_t shard, int k) {
  return static_cast<int>(std::min<std::size_t>(k, std::max<std::size_t>(1, (shard + 63) / 64)));
}

// The bytes a raw fp32 reduce-scatter puts on r's host link: the fp32 pieces (its carried host
// sums in two levels, its contributions to every rank of another host flat) and the status
// round's 24 bytes to every rank of another host, per partition.
std::uint64_t raw_rs_across(const HostFacts& f, int n_ranks, std::size_t shard, int k,
                            bool two_levels) {
  const std::uint64_t far = static_cast<std::uint64_t>(n_ranks - f.ranks);
  const std::uint64_t pieces = two_levels ? static_cast<std::uint64_t>(f.carried_across) : far;
  return pieces * shard * 4 + far * 24 * static_cast<std::uint64_t>(effective_partitions(shard, k));
}

int hierarchy_reduce_scatters(Communicator& comm, Engine& engine, const HostFacts& f) {
  const int n_ranks = comm.size(), r = comm.rank();
  const bool across = f.hosts > 1;
  int cases = 0;
  const std::vector<std::string> specs = {"none", "fp16", "minmax8:ef=1", "onebit:ef=1",
                                          "topk:ratio=0.05,ef=1", "randomk:ratio=0.1"};
  const Strategy strategies[] = {Strategy::kAuto, Strategy::kAllToAll, Strategy::kSharded,
                                 Strategy::kRing, Strategy::kSummable};
  for (const auto& spec : specs) {
    auto codec = make_codec(spec);
    for (Strategy strategy : strategies) {
      for (std::size_t shard : {std::size_t{0}, std::size_t{1}, std::size_t{1000},
                                std::size_t{40000}}) {
        for (int k : {1, 3}) {
          CollectiveOptions o;
          o.codec = spec;
          o.strategy = strategy;
          o.partitions = k;
          o.average = (shard + k) % 2 == 0;
          o.hierarchy = Hierarchy::kHosts;
          const std::string name =
              fmt::format("hrs/{}/{}/{}/{}", spec, to_string(strategy), shard, k);
          const bool grouped = strategy == Strategy::kSharded || strategy == Strategy::kRing ||
                               strategy == Strategy::kSummable;
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, shard * n_ranks);
            std::vector<float> y(shard, -7.0f);
            const std::uint64_t before = engine.bytes_sent_across_hosts();
            try {
              engine.reduce_scatter(name, TensorView(x[r]), TensorView(std::span(y)), o).wait();
            } catch (const InvalidArgument& e) {
              // Invalid combinations are refused at once; grouped strategies on uneven hosts by
              // the hierarchy's rule.
              check(step == 0 && contains(e.what(), "reduce_scatter of tensor '" + name + "'"),
                    what + ": unexpected error: " + e.what());
              if (grouped && !f.even &&
                  (codec->traits().summable || strategy != Strategy::kSummable)) {
                check(contains(e.what(), "needs hosts of equal size"),
                      what + ": uneven hosts refused for another reason: " + e.what());
              }
              break;
            }
            check(!(grouped && !f.even), what + ": a grouped strategy ran on uneven hosts");
            const auto exact_all = averaged(exact_sum(x), n_ranks, o.average);
            const std::vector<float> exact(exact_all.begin() + r * shard,
                                           exact_all.begin() + (r + 1) * shard);
            if (spec == "none" && strategy == Strategy::kAuto) {  // raw
              check_equal(y, host_order_shard(x, engine.hosts(), shard, r, o.average),
                          what + " (host-order sum of host sums)");
              check(engine.bytes_sent_across_hosts() - before ==
                        raw_rs_across(f, n_ranks, shard, k, true),
                    fmt::format("{}: {} bytes across hosts, two levels send {}", what,
                                engine.bytes_sent_across_hosts() - before,
                                raw_rs_across(f, n_ranks, shard, k, true)));
            } else if (codec->traits().lossless) {
              check(relative_error(y, exact) < 1e-6, what + ": lossless result is not the sum");
            } else if (shard >= 1000 && step == 0) {
              // Fewer quantizations than flat (host sums are exact): within the flat bound.
              const double one = round_trip_error(*codec, x[0]);
              check(relative_error(y, exact) <= 2.0 * n_ranks * one + 1e-6,
                    fmt::format("{}: error {} exceeds 2N x the round-trip error {}", what,
                                relative_error(y, exact), one));
            }
            if (shard >= 1000 && across && spec != "none") {
              check(engine.bytes_sent_across_hosts() - before <=
                        raw_rs_across(f, n_ranks, shard, k, false),
                    what + ": more bytes across hosts than a flat raw reduce-scatter");
            }
            ++cases;
          }
        }
      }
    }
  }
  // Half tensors: widened, reduced in two levels in fp32, rounded once. Codec none sends each
  // value exactly in its own format (alltoall with fp16/bf16 across hosts).
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (const std::string spec : {"none", "minmax8"}) {
      const std::size_t shard = 3000;
      CollectiveOptions o;
      o.codec = spec;
      o.partitions = 2;
      o.hierarchy = Hierarchy::kHosts;
      const std::string name = fmt::format("hrs/{}/{}", to_string(dtype), spec);
      const auto [y, got, sum] = half_reduce_scatter(engine, name, dtype, o, n_ranks, r, shard);
      const double bound = spec == "none" ? 0.005 : 0.05;  // rounding once; 8 bits
      check(relative_error(got, sum) < bound,
            fmt::format("{}: error {} against the sum", name, relative_error(got, sum)));
      ++cases;
    }
  }
  return cases;
}

int hierarchy_all_gathers(Communicator& comm, Engine& engine, const HostFacts& f) {
  const int n_ranks = comm.size(), r = comm.rank();
  int cases = 0;
  for (const std::string spec : {"none", "minmax8", "fp16", "onebit:ef=1", "qsgd"}) {
    auto codec = make_codec(spec);
    for (std::size_t shard : {std::size_t{0}, std::size_t{1}, std::size_t{1000},
                              std::size_t{40000}}) {
      for (int k : {1, 3}) {
        for (bool in_place : {false, true}) {
          CollectiveOptions o;
          o.codec = spec;
          o.partitions = k;
          o.hierarchy = Hierarchy::kHosts;
          const std::string name =
              fmt::format("hag/{}/{}/{}/{}", spec, shard, k, in_place ? "inplace" : "");
          for (std::uint64_t step = 0; step < 2; ++step) {
            const std::string what = fmt::format("{} step {}", name, step);
            Inputs x = all_inputs(n_ranks, name, step, shard);
            std::vector<float> y(shard * n_ranks, -7.0f);
            std::vector<float> in = x[r];
            std::span<float> input(in);
            if (in_place) {
              std::copy(in.begin(), in.end(), y.begin() + r * shard);
              input = std::span(y).subspan(r * shard, shard);
            }
            const std::uint64_t before = engine.bytes_sent_across_hosts();
            engine.all_gather(name, TensorView(input), TensorView(std::span(y)), o).wait();
            const std::uint64_t sent = engine.bytes_sent_across_hosts() - before;
            check_identical(comm, y, what);
            for (int j = 0; j < n_ranks; ++j) {
              std::span<const float> got = std::span<const float>(y).subspan(j * shard, shard);
              if (codec->traits().lossless) {
                check_equal(got, x[j], fmt::format("{}: rank {}'s shard", what, j));
              } else if (shard >= 1000 && step == 0) {
                const double one = round_trip_error(*codec, x[j]);
                check(relative_error(got, x[j]) <= 2.0 * one + 1e-6,
                      fmt::format("{}: rank {}'s shard: error {} exceeds 2x one round trip {}",
                                  what, j, relative_error(got, x[j]), one));
              }
            }
            // Raw: this rank's shard crosses once to every other host, nothing else crosses.
            if (spec == "none") {
              check(sent == static_cast<std::uint64_t>(f.hosts - 1) * shard * 4,
                    fmt::format("{}: {} bytes across hosts, two levels send {}", what, sent,
                                (f.hosts - 1) * shard * 4));
            }
            ++cases;
          }
        }
      }
    }
  }
  // Half tensors: raw travels as it is; a codec reads the half values and rounds once.
  cases += half_all_gathers(comm, engine, {"none", "minmax8"}, "hag", Hierarchy::kHosts);
  return cases;
}

// Hierarchy auto's rule, seen in the bytes on this rank's host link: two levels for large
// pieces where the hosts differ and one holds several ranks, flat for pieces the engine would
// gather raw and under hierarchy flat.
int hierarchy_auto_rule(Communicator& comm, Engine& engine, const HostFacts& f) {
  const int n_ranks = comm.size(), r = comm.rank();
  const bool two_level = f.hosts > 1 && [&] {
    for (const auto& h : engine.hosts()) {
      if (h.size() > 1) return true;
    }
    return false;
  }();
  int cases = 0;
  for (const auto& [shard, h, expect_two] :
       {std::tuple{std::size_t{65536}, Hierarchy::kAuto, two_level},
        std::tuple{std::size_t{16}, Hierarchy::kAuto, false},
        std::tuple{std::size_t{65536}, Hierarchy::kFlat, false}}) {
    CollectiveOptions o;
    o.partitions = 1;
    o.hierarchy = h;
    const std::string name = fmt::format("hauto/{}/{}", shard, to_string(h));
    std::vector<float> x = make_input(r, name, 0, shard * n_ranks), y(shard);
    std::uint64_t before = engine.bytes_sent_across_hosts();
    engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait();
    const std::uint64_t rs = engine.bytes_sent_across_hosts() - before;
    check(rs == raw_rs_across(f, n_ranks, shard, 1, expect_two),
          fmt::format("{}: reduce_scatter sent {} bytes across hosts, {} sends {}", name, rs,
                      expect_two ? "two levels" : "flat",
                      raw_rs_across(f, n_ranks, shard, 1, expect_two)));
    std::vector<float> g(shard * n_ranks);
    before = engine.bytes_sent_across_hosts();
    engine.all_gather(name, TensorView(std::span(y)), TensorView(std::span(g)), o).wait();
    const std::uint64_t ag = engine.bytes_sent_across_hosts() - before;
    const std::uint64_t want =
        static_cast<std::uint64_t>(expect_two ? f.hosts - 1 : n_ranks - f.ranks) * shard * 4;
    check(ag == want, fmt::format("{}: all_gather sent {} bytes across hosts, {} sends {}", name,
                                  ag, expect_two ? "two levels" : "flat", want));
    cases += 2;
  }
  return cases;
}

// Failures reach every rank naming rank, tensor and operation; the engine keeps working.
int hierarchy_errors(Communicator& comm, Engine& engine, const HostFacts& f) {
  const int n_ranks = comm.size(), r = comm.rank(), bad = n_ranks - 1;
  int cases = 0;
  auto expect = [&](const std::string& what, const std::function<void()>& fn,
                    const std::vector<std::string>& needles) {
    expect_error(r, what, fn, needles);
    ++cases;
  };
  const std::size_t shard = 5000;
  std::vector<std::string> entries = {"none@raw", "minmax8@alltoall", "onebit:ef=1@alltoall"};
  if (f.even) {
    for (const char* e : {"onebit@sharded", "minmax8@ring", "fp16@summable"}) entries.push_back(e);
  }
  // NaN in the bad rank's input, in the shard of rank 0 and in the last rank's own.
  for (const std::size_t at : {std::size_t{4321}, (n_ranks - 1) * shard + 17}) {
    for (const std::string& entry : entries) {
      CollectiveOptions o;
      o.codec = entry.substr(0, entry.find('@'));
      o.strategy = parse_strategy(entry.substr(entry.find('@') + 1));
      o.partitions = 2;
      o.hierarchy = Hierarchy::kHosts;
      const std::string name = fmt::format("hrs-nan/{}/{}", entry, at);
      std::vector<float> x = make_input(r, name, 0, shard * n_ranks);
      if (r == bad) x[at] = NAN;
      std::vector<float> y(shard);
      expect(name, [&] { engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
             {"reduce_scatter", name,
              fmt::format("rank {}'s input holds NaN or Inf at element {}", bad, at)});
      x = make_input(r, name, 1, shard * n_ranks);
      engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait();
    }
  }
  // A half tensor's NaN is named by its own index.
  for (const std::string spec : {"none", "minmax8"}) {
    const std::string name = "hrs-nan/bf16/" + spec;
    CollectiveOptions o;
    o.codec = spec;
    o.partitions = 3;
    o.hierarchy = Hierarchy::kHosts;
    std::vector<std::uint16_t> x(shard * n_ranks, 0x3f80), y(shard);  // ones
    if (r == bad) x[shard + 4321] = 0x7fc0;  // in the shard of rank 1
    const DType bf16 = DType::kBFloat16;
    expect(name, [&] {
      engine.reduce_scatter(name, TensorView(x.data(), x.size(), bf16),
                            TensorView(y.data(), y.size(), bf16), o).wait();
    }, {"reduce_scatter", name, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                            bad, shard + 4321)});
  }
  // Finite inputs whose sum overflows: named as an overflow on every rank.
  {
    const std::string name = "hrs-overflow";
    CollectiveOptions o;
    o.hierarchy = Hierarchy::kHosts;
    o.average = false;
    std::vector<float> x(shard * n_ranks, 3e38f), y(shard);
    expect(name, [&] { engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"reduce_scatter", name, "overflowed to Inf"});
  }
  for (const std::string spec : {"none", "minmax8"}) {
    const std::string name = "hag-nan/" + spec;
    CollectiveOptions o;
    o.codec = spec;
    o.hierarchy = Hierarchy::kHosts;
    std::vector<float> x = make_input(r, name, 0, shard), y(shard * n_ranks);
    if (r == bad) x[4321] = INFINITY;
    expect(name, [&] { engine.all_gather(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"all_gather", name, fmt::format("rank {}'s input holds NaN or Inf at element {}",
                                            bad, 4321)});
    x = make_input(r, name, 1, shard);
    engine.all_gather(name, TensorView(x), TensorView(std::span(y)), o).wait();
    check_identical(comm, y, name + " after");
  }
  // Ranks that disagree on the hierarchy fail the first use instead of waiting on each other.
  {
    const std::string name = "hierarchy-mismatch";
    CollectiveOptions o;
    o.hierarchy = r == 1 ? Hierarchy::kFlat : Hierarchy::kHosts;
    std::vector<float> x(1000 * n_ranks, 1.0f), y(1000);
    expect(name, [&] { engine.reduce_scatter(name, TensorView(x), TensorView(std::span(y)), o).wait(); },
           {"different tensors", "rank 1 submitted", "reduce_scatter of"});
  }
  // all_to_all has no two levels.
  {
    CollectiveOptions o;
    o.hierarchy = Hierarchy::kHosts;
    std::vector<float> x(n_ranks, 1.0f), y(n_ranks);
    std::vector<std::size_t> counts(n_ranks, 1);
    expect("a2a-hosts", [&] {
      engine.all_to_all("a2a-hosts", TensorView(x), counts, TensorView(std::span(y)), counts, o)
          .wait();
    }, {"all_to_all of tensor 'a2a-hosts'", "hierarchy hosts does not apply"});
  }
  std::vector<float> ones(10 * n_ranks, 1.0f), y(10);
  CollectiveOptions o;
  o.hierarchy = Hierarchy::kHosts;
  engine.reduce_scatter("h-after", TensorView(ones), TensorView(std::span(y)), o).wait();
  check(y[0] == 1.0f, "average of ones is not one");
  return cases;
}

int hierarchy_collectives(Communicator& comm, Engine& engine) {
  const HostFacts f = host_facts(engine, comm.rank());
  int cases = hierarchy_reduce_scatters(comm, engine, f);
  cases += hierarchy_all_gathers(comm, engine, f);
  cases += hierarchy_auto_rule(comm, engine, f);
  cases += hierarchy_errors(comm, engine, f);
  std::printf("OK rank %d hierarchy_collectives %d cases on hosts %s\n", comm.rank(), cases,
              hosts_text(engine).c_str());
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: collectives_worker SCENARIO [ARGS...]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  try {
    set_process_options(process_options_from_environment());
    const int blas_before = kit::blas_threads();
    std::shared_ptr<Communicator> comm =
        Communicator::from_env(communicator_options_from_environment());
    EngineOptions options = engine_options_from_environment();
    options.seed = kSeed;
    if (scenario == "stress") options.threads = 2;
    if (scenario == "matrix" || scenario == "half" || scenario == "reduce_scatter" ||
        scenario == "hierarchy" || scenario == "hierarchy_collectives" ||
        scenario == "all_gather") {
      options.partition_bytes = 64 << 10;
    }
    if (scenario == "topology_error") {
      // The engine's construction must fail on this rank (every rank runs this scenario).
      try {
        Engine engine(comm, options);
      } catch (const Error& e) {
        std::printf("EXPECTED-FAILURE rank %d: %s\n", comm->rank(), e.what());
        std::fflush(stdout);
        return 0;
      }
      std::printf("CHECK FAILED: rank %d built an engine\n", comm->rank());
      return 2;
    }
    const bool keep = argc == 3 && std::string(argv[2]) == "keep";
    options.keep_input_on_error = keep;
    int rc = 0;
    int blas_during = 0;
    {
      Engine engine(comm, options);
      blas_during = kit::blas_threads();
      if (scenario == "matrix") {
        rc = matrix(*comm, engine, std::vector<std::string>(argv + 2, argv + argc));
      } else if (scenario == "half") {
        rc = half(*comm, engine);
      } else if (scenario == "group") {
        rc = group(*comm, engine);
      } else if (scenario == "nonfinite") {
        rc = nonfinite(*comm, engine, keep);
      } else if (scenario == "mismatch" && argc == 3) {
        rc = mismatch(*comm, engine, argv[2]);
      } else if (scenario == "die" && argc == 3) {
        rc = die(*comm, engine, std::atoi(argv[2]));
      } else if (scenario == "channel") {
        rc = channel(*comm, engine, comm);
      } else if (scenario == "stress") {
        rc = stress(*comm, engine);
      } else if (scenario == "reduce_scatter") {
        rc = reduce_scatter_matrix(*comm, engine);
      } else if (scenario == "all_gather") {
        rc = all_gather_matrix(*comm, engine);
      } else if (scenario == "all_to_all") {
        rc = all_to_all_matrix(*comm, engine);
      } else if (scenario == "collective_errors") {
        rc = collective_errors(*comm, engine);
      } else if (scenario == "all_to_all_errors") {
        rc = all_to_all_errors(*comm, engine);
      } else if (scenario == "die_collective" && argc == 3) {
        rc = die_collective(*comm, engine, std::atoi(argv[2]));
      } else if (scenario == "blas") {
        rc = blas(*comm, blas_before);
      } else if (scenario == "hierarchy") {
        rc = hierarchy(*comm, engine);
      } else if (scenario == "hierarchy_collectives") {
        rc = hierarchy_collectives(*comm, engine);
      } else if (scenario == "slowpeer") {
        rc = slow_peer(*comm, engine);
      } else {
        std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
        return 2;
      }
      engine.synchronize();
    }
    if (scenario == "blas" && rc == 0) rc = blas_restored(*comm, blas_before, blas_during);
    comm->barrier("end");
    std::fflush(stdout);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 1;
  }
}
