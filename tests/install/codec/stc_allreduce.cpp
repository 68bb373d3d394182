// Two or more ranks (started by `terse run -n N`) allreduce a tensor with the stc codec through
// the engine. With the allgather strategy the result is the sum of every rank's decoded
// encoding, which each rank recomputes locally; every rank must hold the same bits. Exits
// non-zero on any mismatch.
#include <terse/codec.h>
#include <terse/communicator.h>
#include <terse/engine.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

std::vector<float> input(int rank, std::size_t n) {
  std::mt19937 gen(1000 + rank);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(gen);
  return x;
}

}  // namespace

int main() {
  std::shared_ptr<terse::Communicator> comm = terse::Communicator::from_env();
  terse::Engine engine(comm);
  const int rank = engine.rank(), size = engine.size();
  const std::size_t n = 10000;
  const char* spec = "stc:ratio=0.05";
  int failures = 0;

  for (terse::Strategy strategy : {terse::Strategy::kAllgather, terse::Strategy::kSharded}) {
    terse::AllreduceOptions options;
    options.codec = spec;
    options.strategy = strategy;
    options.partitions = 1;
    options.average = false;
    std::vector<float> y = input(rank, n);
    engine.allreduce(std::string("grad.") + std::string(terse::to_string(strategy)), y, options)
        .wait();

    // Rank 0's result reaches every rank exactly (x + 0 is x): the ranks must agree bit for bit.
    std::vector<float> first(n, 0.0f);
    if (rank == 0) first = y;
    terse::AllreduceOptions raw;
    raw.average = false;
    engine.allreduce(std::string("check.") + std::string(terse::to_string(strategy)), first, raw)
        .wait();
    if (std::memcmp(first.data(), y.data(), n * sizeof(float)) != 0) {
      std::printf("rank %d: %s result differs from rank 0's\n", rank,
                  std::string(terse::to_string(strategy)).c_str());
      ++failures;
    }

    double err = 0, norm = 0;
    std::vector<float> exact(n, 0.0f), reference(n, 0.0f);
    auto codec = terse::make_codec(spec);
    for (int r = 0; r < size; ++r) {
      const std::vector<float> x = input(r, n);
      for (std::size_t i = 0; i < n; ++i) exact[i] += x[i];
      std::vector<std::byte> payload(codec->max_encoded_bytes(n));
      terse::EncodeContext ctx;
      payload.resize(codec->encode(x, payload, ctx));
      codec->decode(payload, reference, terse::DecodeMode::kAccumulate);
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(y[i])) ++failures;
      if (strategy == terse::Strategy::kAllgather &&
          std::fabs(y[i] - reference[i]) > 1e-5f * (1 + std::fabs(reference[i]))) {
        if (failures++ < 5)
          std::printf("rank %d: y[%zu] = %g, expected %g\n", rank, i, y[i], reference[i]);
      }
      err += (y[i] - exact[i]) * (y[i] - exact[i]);
      norm += exact[i] * exact[i];
    }
    std::printf("rank %d of %d: %s %s, relative error %.3f against the exact sum\n", rank, size,
                spec, std::string(terse::to_string(strategy)).c_str(), std::sqrt(err / norm));
    // Keeping 5% of each rank's entries leaves most of the sum's norm out, never more than all.
    if (!(err <= norm * 1.0001)) ++failures;
  }
  engine.synchronize();
  std::printf("rank %d: %s\n", rank, failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
