// A single-process simulation of every strategy: what the engine must produce (the sum over
// ranks, before averaging) for inputs of all ranks, following each strategy's documented order
// of summation, encodings and state slots. The multi-process tests compare the engine's results
// with it bit for bit.
#pragma once

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"
#include "kit/hash.h"
#include "terse/codec.h"
#include "terse/engine.h"
#include "terse/spec.h"

namespace terse::testing {

using Inputs = std::vector<std::vector<float>>;  // one input per rank

class Simulator {
 public:
  Simulator(int ranks, std::uint64_t seed) : ranks_(ranks), seed_(seed) {}

  // The result the engine computes for tensor `name` at `step`: the sum over ranks, divided by
  // `divisor` where the strategy divides. codec is null for raw.
  std::vector<float> run(const std::string& name, std::uint64_t step, Strategy strategy,
                         const Codec* codec, int partitions, const Inputs& x, int divisor = 1) {
    divisor_ = divisor;
    const std::size_t n = x[0].size();
    std::vector<float> y(n);
    const collectives::Split parts(n, partitions);
    for (int p = 0; p < partitions; ++p) {
      std::vector<std::span<const float>> in;
      for (int i = 0; i < ranks_; ++i) in.push_back(parts.piece(std::span<const float>(x[i]), p));
      Piece piece{name, p, step, codec};
      std::span<float> out = parts.piece(std::span<float>(y), p);
      switch (strategy) {
        case Strategy::kRaw:
          if (collectives::gathers(out.size(), ranks_, EngineOptions{}.gather_bytes)) {
            gathered(in, out);  // small: every input to every rank, summed in rank order
          } else {
            raw(in, out);
          }
          break;
        case Strategy::kAllgather:
          if (codec->traits().multi_round) {
            rounds(piece, in, out, /*gather=*/true);
          } else {
            allgather(piece, in, out);
          }
          break;
        case Strategy::kSharded: sharded(piece, in, out); break;
        case Strategy::kRing: ring(piece, in, out); break;
        case Strategy::kSummable:
          if (codec->traits().multi_round) {
            rounds(piece, in, out);
          } else {
            summable(piece, in, out);
          }
          break;
        default: throw std::logic_error("simulate: unresolved strategy");
      }
    }
    return y;
  }

 private:
  struct Piece {
    std::string name;
    int partition;
    std::uint64_t step;
    const Codec* codec;
  };

  EncodeContext context(const Piece& p, int rank, int piece, int slot, std::size_t n) {
    EncodeContext ec;
    ec.seed = seed_;
    ec.step = p.step;
    ec.tensor = kit::combine_keys(kit::combine_keys(fnv1a64(p.name), p.partition), piece);
    ec.rank = rank;
    if (p.codec->traits().stateful) {
      auto& s = states_[{p.name, p.partition, rank, slot}];
      if (!s.second || s.first != n) s = {n, p.codec->make_state(n)};
      ec.state = s.second.get();
    }
    return ec;
  }

  std::vector<std::byte> encode(const Piece& p, std::span<const float> x, int rank, int piece,
                                int slot) {
    std::vector<std::byte> out(p.codec->max_encoded_bytes(x.size()));
    EncodeContext ec = context(p, rank, piece, slot, x.size());
    out.resize(p.codec->encode(x, out, ec));
    return out;
  }

  int mod(int v) const { return ((v % ranks_) + ranks_) % ranks_; }
  void divide(std::span<float> y) const {
    if (divisor_ > 1) kit::divide_to(y, static_cast<float>(divisor_), y);
  }

  void raw(const std::vector<std::span<const float>>& in, std::span<float> out,
           bool average = true) {
    const collectives::Split chunks(out.size(), ranks_);
    for (int c = 0; c < ranks_; ++c) {
      std::span<float> acc = chunks.piece(out, c);
      std::span<const float> first = chunks.piece(in[c], c);
      std::copy(first.begin(), first.end(), acc.begin());
      for (int h = 1; h < ranks_; ++h) kit::add_to(chunks.piece(in[mod(c + h)], c), acc, acc);
      if (average) divide(acc);
    }
  }

  void gathered(const std::vector<std::span<const float>>& in, std::span<float> out) {
    std::copy(in[0].begin(), in[0].end(), out.begin());
    for (int i = 1; i < ranks_; ++i) kit::add_to(in[i], out, out);
    divide(out);
  }

  void allgather(const Piece& p, const std::vector<std::span<const float>>& in,
                 std::span<float> out, bool average = true) {
    for (int i = 0; i < ranks_; ++i) {
      p.codec->decode(encode(p, in[i], i, 0, 0), out,
                      i == 0 ? DecodeMode::kOverwrite : DecodeMode::kAccumulate);
    }
    if (average) divide(out);
  }

  void sharded(const Piece& p, const std::vector<std::span<const float>>& in,
               std::span<float> out) {
    const collectives::Split shards(out.size(), ranks_);
    for (int j = 0; j < ranks_; ++j) {
      std::span<float> acc = shards.piece(out, j);
      for (int i = 0; i < ranks_; ++i) {
        if (i == j) {
          kit::store_or_add(shards.piece(in[j], j).data(), acc, i != 0);
        } else {
          p.codec->decode(encode(p, shards.piece(in[i], j), i, j, j), acc,
                          i == 0 ? DecodeMode::kOverwrite : DecodeMode::kAccumulate);
        }
      }
      divide(acc);
      auto final_payload = encode(p, acc, j, j, ranks_);
      p.codec->decode(final_payload, acc);
    }
  }

  void ring(const Piece& p, const std::vector<std::span<const float>>& in, std::span<float> out) {
    const collectives::Split chunks(out.size(), ranks_);
    for (int c = 0; c < ranks_; ++c) {
      std::span<float> acc = chunks.piece(out, c);
      p.codec->decode(encode(p, chunks.piece(in[c], c), c, c, c), acc);
      for (int h = 1; h < ranks_; ++h) {
        const int k = mod(c + h);
        kit::store_or_add(chunks.piece(in[k], c).data(), acc, true);
        if (h == ranks_ - 1) divide(acc);
        p.codec->decode(encode(p, acc, k, c, c), acc);
      }
    }
  }

  void summable(const Piece& p, const std::vector<std::span<const float>>& in,
                std::span<float> out, bool average = true) {
    const collectives::Split chunks(out.size(), ranks_);
    for (int c = 0; c < ranks_; ++c) {
      auto partial = encode(p, chunks.piece(in[c], c), c, c, c);
      for (int h = 1; h < ranks_; ++h) {
        const int k = mod(c + h);
        p.codec->combine(encode(p, chunks.piece(in[k], c), k, c, c), partial);
      }
      p.codec->decode(partial, chunks.piece(out, c));
      if (average) divide(chunks.piece(out, c));
    }
  }

  void rounds(const Piece& p, const std::vector<std::span<const float>>& in,
              std::span<float> out, bool gather = false) {
    const auto& rc = dynamic_cast<const RoundCodec&>(*p.codec);
    const std::size_t n = out.size();
    std::vector<EncodeContext> ctx;
    for (int i = 0; i < ranks_; ++i) ctx.push_back(context(p, i, 0, 0, n));
    for (int round = 0; round < rc.rounds(); ++round) {
      const std::size_t m = rc.round_elements(round, n);
      std::vector<std::vector<float>> contribution(ranks_, std::vector<float>(m));
      for (int i = 0; i < ranks_; ++i) rc.encode_round(round, in[i], contribution[i], ctx[i]);
      std::vector<std::span<const float>> views(contribution.begin(), contribution.end());
      std::vector<float> sum(m);
      // Round sums are plain sums: the raw ring's, or the summable ring's on the wire codec,
      // or gathered payloads of the wire codec (else exact fp32 ones) summed in rank order.
      const Codec* wire = rc.round_wire(round, n);
      if (gather) {
        allgather(Piece{p.name, p.partition, p.step, wire != nullptr ? wire : none_.get()}, views,
                  sum, /*average=*/false);
      } else if (wire != nullptr) {
        summable(Piece{p.name, p.partition, p.step, wire}, views, sum, /*average=*/false);
      } else {
        raw(views, sum, /*average=*/false);
      }
      for (int i = 0; i < ranks_; ++i) rc.absorb_round(round, sum, ctx[i]);
    }
    std::vector<float> other(n);
    for (int i = 0; i < ranks_; ++i) rc.finish(i == 0 ? out : std::span<float>(other), ctx[i]);
    divide(out);
  }

  int ranks_;
  std::uint64_t seed_;
  std::unique_ptr<Codec> none_ = make_codec("none");
  int divisor_ = 1;
  std::map<std::tuple<std::string, int, int, int>, std::pair<std::size_t, std::unique_ptr<CodecState>>>
      states_;
};

}  // namespace terse::testing
