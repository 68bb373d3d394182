// The job secret's cryptography, shared by the TCP store's handshake (store_handshake.h) and the
// check of every Gloo pair (Communicator::Impl::authenticate_peers): fresh nonces and
// HMAC-SHA256 proofs over them, compared in constant time. A proof binds a label ("terse-pair",
// "terse-store-client", ...) so that one kind can never be replayed as another.
#pragma once

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

namespace terse::transport {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256
using Nonce = std::array<std::byte, kNonceBytes>;
using Proof = std::array<std::byte, kProofBytes>;

// Bytes from the kernel (getrandom); throws TransportError naming `what` if it fails.
Nonce fresh_nonce(std::string_view what);

// HMAC-SHA256 under secret of the parts, concatenated.
Proof prove(std::string_view secret, std::initializer_list<std::span<const std::byte>> parts);

// True if a and b are the same proof; the time taken does not depend on where they differ.
bool same_proof(const Proof& a, const Proof& b);

// A job secret for a launcher to hand its ranks: 32 random bytes as 64 hex digits.
std::string new_job_secret();

inline std::span<const std::byte> bytes_of(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

}  // namespace terse::transport
