#include "transport/auth.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <vector>

#include "terse/error.h"

namespace terse::transport {

namespace {

std::string openssl_error() {
  const unsigned long code = ERR_get_error();
  if (code == 0) return "no OpenSSL error recorded";
  char buf[256];
  ERR_error_string_n(code, buf, sizeof(buf));
  return buf;
}

}  // namespace

Nonce fresh_nonce(std::string_view what) {
  Nonce n;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    throw TransportError(fmt::format("{}: no random bytes for a nonce: {}", what, openssl_error()));
  }
  return n;
}

Proof prove(std::string_view secret, std::initializer_list<std::span<const std::byte>> parts) {
  std::vector<unsigned char> message;
  for (const auto& part : parts) {
    const auto* p = reinterpret_cast<const unsigned char*>(part.data());
    message.insert(message.end(), p, p + part.size());
  }
  if (secret.size() > INT_MAX) throw InvalidArgument("job secret: longer than 2 GiB");
  Proof out;
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
           message.size(), reinterpret_cast<unsigned char*>(out.data()), &length) == nullptr ||
      length != out.size()) {
    throw TransportError(fmt::format("HMAC-SHA256 of the job secret failed: {}", openssl_error()));
  }
  return out;
}

bool same_proof(const Proof& a, const Proof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string new_job_secret() {
  const Nonce bytes = fresh_nonce("job secret");
  std::string hex;
  hex.reserve(2 * bytes.size());
  for (std::byte b : bytes) hex += fmt::format("{:02x}", static_cast<unsigned>(b));
  return hex;
}

}  // namespace terse::transport
