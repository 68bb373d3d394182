// The TCP store's handshake: the wire format is in store_handshake.h.
#include "transport/store_handshake.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "terse/error.h"
#include "transport/auth.h"

namespace terse::transport {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::uint8_t kVersion = 1;
constexpr char kServerMagic[4] = {'t', 's', 't', 'o'};
constexpr char kClientMagic[4] = {'t', 's', 't', 'c'};
constexpr std::size_t kServerHelloBytes = 4 + 1 + 1 + kNonceBytes;
constexpr std::size_t kClientHelloBytes = 4 + 1 + 1 + kNonceBytes + kProofBytes;
constexpr std::size_t kVerdictBytes = 1 + kProofBytes;
// What the server tells the client at the end.
enum Verdict : std::uint8_t {
  kAdmitted = 0,
  kBadSecret = 1,
  kSecretRequired = 2,  // the client has no secret, the server one
  kNoSecretHere = 3,    // the client has a secret, the server none
  kMalformed = 4,
};
constexpr std::string_view kClientLabel = "terse-store-client";
constexpr std::string_view kServerLabel = "terse-store-server";
// How long a refused client is given to read its verdict; it only improves its message.
constexpr milliseconds kVerdictGrace{500};

enum class Io { kDone, kClosed, kTimedOut };

// Waits until fd is ready for `events` or deadline; false once deadline has passed.
bool ready_by(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 60000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return true;  // the recv or send that follows reports it
  }
}

// Reads exactly buffer.size() bytes by deadline. kClosed leaves errno set (0: an orderly close).
Io read_by(int fd, std::span<std::byte> buffer, Clock::time_point deadline) {
  std::size_t done = 0;
  while (done < buffer.size()) {
    if (!ready_by(fd, POLLIN, deadline)) return Io::kTimedOut;
    const ssize_t r = ::recv(fd, buffer.data() + done, buffer.size() - done, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return Io::kClosed;
    }
    done += static_cast<std::size_t>(r);
  }
  return Io::kDone;
}

Io write_by(int fd, std::span<const std::byte> buffer, Clock::time_point deadline) {
  std::size_t done = 0;
  while (done < buffer.size()) {
    if (!ready_by(fd, POLLOUT, deadline)) return Io::kTimedOut;
    const ssize_t r =
        ::send(fd, buffer.data() + done, buffer.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) return Io::kClosed;
    done += static_cast<std::size_t>(r);
  }
  return Io::kDone;
}

std::string closed_reason() { return errno == 0 ? "closed by the other end" : strerror(errno); }

template <std::size_t N>
std::span<const std::byte> part(const std::array<std::byte, N>& a, std::size_t offset,
                                std::size_t length) {
  return std::span<const std::byte>(a).subspan(offset, length);
}

void send_verdict(int fd, Verdict verdict, const Proof& proof) {
  std::array<std::byte, kVerdictBytes> out{};
  out[0] = static_cast<std::byte>(verdict);
  std::memcpy(out.data() + 1, proof.data(), proof.size());
  write_by(fd, out, Clock::now() + kVerdictGrace);  // a refused client may be gone already
}

}  // namespace

std::optional<std::string> admit_store_client(int fd, std::string_view secret,
                                              Clock::time_point deadline) {
  const auto bound = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  const bool has_secret = !secret.empty();
  const Nonce server_nonce = fresh_nonce("tcp store server handshake");
  std::array<std::byte, kServerHelloBytes> hello{};
  std::memcpy(hello.data(), kServerMagic, 4);
  hello[4] = std::byte{kVersion};
  hello[5] = std::byte{has_secret ? std::uint8_t{1} : std::uint8_t{0}};
  std::memcpy(hello.data() + 6, server_nonce.data(), kNonceBytes);
  switch (write_by(fd, hello, deadline)) {
    case Io::kDone:
      break;
    case Io::kTimedOut:
      return fmt::format("handshake timed out: the client read nothing within {} ms",
                         bound.count());
    case Io::kClosed:
      return fmt::format("malformed handshake: the connection closed at once ({})",
                         closed_reason());
  }
  // The magic first, so that a foreign client is told apart at once rather than at the bound.
  std::array<std::byte, kClientHelloBytes> in{};
  const Proof none{};
  for (const auto& [from, to] : {std::pair<std::size_t, std::size_t>{0, 4}, {4, in.size()}}) {
    switch (read_by(fd, std::span(in).subspan(from, to - from), deadline)) {
      case Io::kDone:
        break;
      case Io::kTimedOut:
        return fmt::format("handshake timed out: no complete client hello within {} ms",
                           bound.count());
      case Io::kClosed:
        return fmt::format(
            "malformed handshake: the connection closed before the client hello was complete "
            "({})",
            closed_reason());
    }
    if (std::memcmp(in.data(), kClientMagic, 4) != 0) {
      send_verdict(fd, kMalformed, none);
      return std::string(
          "malformed handshake: not a terse store client (its first bytes are "
          "not a client hello)");
    }
  }
  const auto version = static_cast<unsigned>(in[4]);
  const auto client_mode = static_cast<unsigned>(in[5]);
  if (version != kVersion || client_mode > 1) {
    send_verdict(fd, kMalformed, none);
    return fmt::format(
        "malformed handshake: store protocol version {} (mode {}), this server "
        "speaks version {}",
        version, client_mode, kVersion);
  }
  const bool client_has_secret = client_mode == 1;
  if (has_secret && !client_has_secret) {
    send_verdict(fd, kSecretRequired, none);
    return std::string("no secret: the client has no job secret and this store requires it");
  }
  if (!has_secret && client_has_secret) {
    send_verdict(fd, kNoSecretHere, none);
    return std::string(
        "unexpected secret: the client holds a job secret and this store has none, so the "
        "client refuses it");
  }
  Proof answer = none;
  if (has_secret) {
    const auto client_nonce = part(in, 6, kNonceBytes);
    Proof claimed;
    std::memcpy(claimed.data(), in.data() + 6 + kNonceBytes, kProofBytes);
    const Proof expected = prove(secret, {bytes_of(kClientLabel), server_nonce, client_nonce});
    if (!same_proof(claimed, expected)) {
      send_verdict(fd, kBadSecret, none);
      return std::string(
          "bad secret: the client's proof does not match the job secret (another secret, or a "
          "replayed handshake)");
    }
    answer = prove(secret, {bytes_of(kServerLabel), client_nonce, server_nonce});
  }
  std::array<std::byte, kVerdictBytes> verdict{};
  verdict[0] = std::byte{kAdmitted};
  std::memcpy(verdict.data() + 1, answer.data(), kProofBytes);
  if (write_by(fd, verdict, deadline) != Io::kDone) {
    return fmt::format("handshake timed out: the client did not read its verdict within {} ms",
                       bound.count());
  }
  return std::nullopt;
}

void join_store(int fd, std::string_view secret, const std::string& where,
                Clock::time_point deadline) {
  const auto bound = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  const bool has_secret = !secret.empty();
  // The magic first, so that another service on the port is named at once.
  std::array<std::byte, kServerHelloBytes> hello{};
  for (const auto& [from, to] : {std::pair<std::size_t, std::size_t>{0, 4}, {4, hello.size()}}) {
    switch (read_by(fd, std::span(hello).subspan(from, to - from), deadline)) {
      case Io::kDone:
        break;
      case Io::kTimedOut:
        throw TimeoutError(fmt::format(
            "tcp store {}: no handshake from the server within {} ms (is {} a terse store, and "
            "is its process responsive?)",
            where, bound.count(), where));
      case Io::kClosed:
        throw TransportError(fmt::format(
            "tcp store {}: the server closed the connection before its handshake ({}); is {} a "
            "terse store server (MASTER_ADDR, MASTER_PORT)?",
            where, closed_reason(), where));
    }
    if (std::memcmp(hello.data(), kServerMagic, 4) != 0) {
      throw TransportError(fmt::format(
          "tcp store {}: the server's first bytes are not a terse store's handshake; is {} a "
          "terse store server (MASTER_ADDR, MASTER_PORT)?",
          where, where));
    }
  }
  const auto version = static_cast<unsigned>(hello[4]);
  const auto server_mode = static_cast<unsigned>(hello[5]);
  if (version != kVersion || server_mode > 1) {
    throw TransportError(fmt::format(
        "tcp store {}: the server speaks store protocol version {} (mode {}), this process "
        "version {}: run one version of terse throughout the job",
        where, version, server_mode, kVersion));
  }
  const bool server_has_secret = server_mode == 1;
  const auto server_nonce = part(hello, 6, kNonceBytes);
  const Nonce client_nonce = fresh_nonce(fmt::format("tcp store {}: client handshake", where));
  Proof proof{};
  if (has_secret && server_has_secret) {
    proof = prove(secret, {bytes_of(kClientLabel), server_nonce, client_nonce});
  }
  std::array<std::byte, kClientHelloBytes> out{};
  std::memcpy(out.data(), kClientMagic, 4);
  out[4] = std::byte{kVersion};
  out[5] = std::byte{has_secret ? std::uint8_t{1} : std::uint8_t{0}};
  std::memcpy(out.data() + 6, client_nonce.data(), kNonceBytes);
  std::memcpy(out.data() + 6 + kNonceBytes, proof.data(), kProofBytes);
  if (write_by(fd, out, deadline) != Io::kDone) {
    throw TransportError(
        fmt::format("tcp store {}: the server closed the connection during the handshake ({})",
                    where, closed_reason()));
  }
  std::array<std::byte, kVerdictBytes> verdict{};
  const Io read = read_by(fd, verdict, deadline);
  // Where the two sides disagree on having a secret, this side has its answer already; the
  // server's verdict (read above, so that it logs the refusal before we close) adds nothing.
  if (has_secret && !server_has_secret) {
    throw AuthenticationError(fmt::format(
        "tcp store {}: the server has no job secret and this process has one, so the server "
        "cannot prove it is this job's store: refusing it (give every process of the job the "
        "same secret: TERSE_JOB_SECRET or the secret argument)",
        where));
  }
  if (!has_secret && server_has_secret) {
    throw AuthenticationError(fmt::format(
        "tcp store {}: the server requires the job secret and this process has none (set "
        "TERSE_JOB_SECRET, or pass the job's secret)",
        where));
  }
  if (read == Io::kTimedOut) {
    throw TimeoutError(fmt::format("tcp store {}: no verdict on the handshake within {} ms", where,
                                   bound.count()));
  }
  if (read == Io::kClosed) {
    throw TransportError(
        fmt::format("tcp store {}: the server closed the connection during the handshake ({})",
                    where, closed_reason()));
  }
  switch (static_cast<std::uint8_t>(verdict[0])) {
    case kAdmitted:
      break;
    case kBadSecret:
      throw AuthenticationError(fmt::format(
          "tcp store {}: the server refused this process: its job secret did not match the "
          "server's (give every process of the job the same TERSE_JOB_SECRET or secret)",
          where));
    case kMalformed:
      throw TransportError(fmt::format(
          "tcp store {}: the server refused the handshake as malformed (another version of "
          "terse?)",
          where));
    default:
      throw AuthenticationError(
          fmt::format("tcp store {}: the server refused this process "
                      "(verdict {})",
                      where, static_cast<unsigned>(verdict[0])));
  }
  if (has_secret) {
    Proof claimed;
    std::memcpy(claimed.data(), verdict.data() + 1, kProofBytes);
    const Proof expected = prove(secret, {bytes_of(kServerLabel), client_nonce, server_nonce});
    if (!same_proof(claimed, expected)) {
      throw AuthenticationError(fmt::format(
          "tcp store {}: the server did not prove the job secret (it is not this job's store, "
          "or holds another secret): refusing to use it",
          where));
    }
  }
}

}  // namespace terse::transport
