// The job secret's check of every Gloo pair (Communicator::Impl::authenticate_peers says what
// it does and why). Wire format, on kAuthSlot:
//   round 0, hello   "tpar" | version u8 | has secret u8 | nonce (32)
//   round 1, proof   HMAC-SHA256(secret, "terse-pair" || prover rank i32 || verifier rank i32 ||
//                    the verifier's nonce), only between two ranks that both have a secret
// The ranks in the proof keep an answer from being reflected back to the rank that asked, and
// nonces fresh per communicator keep one recorded from an earlier connection from passing.
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "transport/auth.h"
#include "transport/communicator_impl.h"

namespace terse {

using namespace transport;

namespace {

constexpr char kMagic[4] = {'t', 'p', 'a', 'r'};
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kHelloBytes = 4 + 1 + 1 + kNonceBytes;
using Hello = std::array<std::byte, kHelloBytes>;
constexpr std::string_view kLabel = "terse-pair";
constexpr std::string_view kWhat = "job secret check";

Proof pair_proof(std::string_view secret, int prover, int verifier,
                 std::span<const std::byte> nonce) {
  const std::int32_t ranks[2] = {prover, verifier};  // little-endian, as every host terse runs on
  return prove(secret, {bytes_of(kLabel), std::as_bytes(std::span(ranks)), nonce});
}

}  // namespace

void Communicator::Impl::authenticate_peers(std::string_view secret) {
  if (size == 1) return;
  const bool has_secret = !secret.empty();
  std::vector<Hello> mine(size), theirs(size);
  std::vector<Proof> answers(size), claimed(size);
  auto exchange = [&](std::uint64_t round, auto&& recv_into, auto&& send_from, auto&& with) {
    std::vector<Request> recvs, sends;
    for (int p = 0; p < size; ++p) {
      if (p == rank || !with(p)) continue;
      auto in = recv_into(p);
      recvs.push_back(post(false, p, kAuthSlot | round, round, in.data(), in.size(), kWhat,
                           "job secret check recv"));
    }
    for (int p = 0; p < size; ++p) {
      if (p == rank || !with(p)) continue;
      auto out = send_from(p);
      sends.push_back(post(true, p, kAuthSlot | round, round, out.data(), out.size(), kWhat,
                           "job secret check send"));
    }
    for (auto& r : recvs) r.wait();
    for (auto& s : sends) s.wait();
  };

  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const Nonce nonce = fresh_nonce(fmt::format("rank {}: job secret check", rank));
    std::memcpy(mine[p].data(), kMagic, 4);
    mine[p][4] = std::byte{kVersion};
    mine[p][5] = std::byte{has_secret ? std::uint8_t{1} : std::uint8_t{0}};
    std::memcpy(mine[p].data() + 6, nonce.data(), kNonceBytes);
  }
  exchange(
      0, [&](int p) { return std::span<std::byte>(theirs[p]); },
      [&](int p) { return std::span<std::byte>(mine[p]); }, [](int) { return true; });

  // What each peer's hello says; a peer with a problem here takes no part in the proofs (an
  // honest peer finds the same problem with this rank and skips them too).
  std::vector<std::string> problem(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const Hello& h = theirs[p];
    const auto version = static_cast<unsigned>(h[4]), mode = static_cast<unsigned>(h[5]);
    if (std::memcmp(h.data(), kMagic, 4) != 0 || version != kVersion || mode > 1) {
      problem[p] = fmt::format(
          "peer {} sent no valid hello (version {}, mode {}; not a rank of this terse version)", p,
          version, mode);
    } else if (has_secret && mode == 0) {
      problem[p] = fmt::format("peer {} has no job secret and this rank has one", p);
    } else if (!has_secret && mode == 1) {
      problem[p] = fmt::format(
          "peer {} has a job secret and this rank has none (set the job's TERSE_JOB_SECRET on "
          "every rank)",
          p);
    }
  }
  if (has_secret) {
    auto proving = [&](int p) { return problem[p].empty(); };
    for (int p = 0; p < size; ++p) {
      if (p != rank && proving(p)) {
        answers[p] = pair_proof(secret, rank, p, std::span(theirs[p]).subspan(6, kNonceBytes));
      }
    }
    exchange(
        1, [&](int p) { return std::span<std::byte>(claimed[p]); },
        [&](int p) { return std::span<std::byte>(answers[p]); }, proving);
    for (int p = 0; p < size; ++p) {
      if (p == rank || !proving(p)) continue;
      const Proof expected =
          pair_proof(secret, p, rank, std::span(mine[p]).subspan(6, kNonceBytes));
      if (!same_proof(claimed[p], expected)) {
        problem[p] = fmt::format(
            "peer {} did not prove the job secret (its answer to this rank's challenge does not "
            "match: another TERSE_JOB_SECRET, or not a rank of this job)",
            p);
      }
    }
  }

  int first = -1;
  std::string list;
  for (int p = 0; p < size; ++p) {
    if (problem[p].empty()) continue;
    if (first < 0) first = p;
    list += (list.empty() ? "" : "; ") + problem[p];
  }
  if (first < 0) return;
  const std::string msg = fmt::format(
      "rank {} ({}): the connections to its peers did not all pass the job secret check: {}. The "
      "communicator is not created: a connection that cannot prove the secret is not let in, "
      "whoever holds it",
      rank, address, list);
  fail(msg, first, msg);
  throw AuthenticationError(msg);
}

}  // namespace terse
