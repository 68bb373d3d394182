#include "transport/auth.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <sys/random.h>

#include <cerrno>
#include <climits>
#include <cstring>
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

// OpenSSL without its exit-time cleanup. The cleanup runs at exit() and drops the thread-local
// keys; a thread that used HMAC and ends after it (a connection thread that a failing rank's
// exit overtakes) then loses its per-thread error state, which LeakSanitizer reports. Without
// it, each thread's state is freed when the thread ends, and the process's when it ends.
void openssl_once() {
  static const int ready = OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  (void)ready;
}

}  // namespace

Nonce fresh_nonce(std::string_view what) {
  // From the kernel (getrandom), not OpenSSL's RAND_bytes: no random generator per thread.
  Nonce n;
  auto* out = reinterpret_cast<unsigned char*>(n.data());
  std::size_t filled = 0;
  while (filled < n.size()) {
    const ssize_t got = ::getrandom(out + filled, n.size() - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw TransportError(
          fmt::format("{}: no random bytes for a nonce: getrandom: {}", what, std::strerror(errno)));
    }
    filled += static_cast<std::size_t>(got);
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
  openssl_once();
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
