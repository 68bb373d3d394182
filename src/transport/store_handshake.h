// The TCP store's handshake, run once per connection before any request (tcp_store.cpp calls it
// on accept and on connect), so that only processes that hold the job secret use the store and
// no process talks to a store that does not hold it.
//
// Wire format (one version byte, so that the protocol can evolve):
//   server hello   "tsto" | version u8 | has secret u8 | server nonce (32)
//   client hello   "tstc" | version u8 | has secret u8 | client nonce (32) | client proof (32)
//   verdict        verdict u8 (Verdict) | server proof (32)
// client proof = HMAC-SHA256(secret, "terse-store-client" || server nonce || client nonce),
// server proof = HMAC-SHA256(secret, "terse-store-server" || client nonce || server nonce); all
// zeros where either side has no secret. Both nonces are fresh per connection, so a recorded
// client hello fails on any other connection, and the labels keep either proof from standing in
// for the other. Without a secret on either side the handshake still checks the magic and the
// version.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace terse {
class Store;
}

namespace terse::transport {

// The server's side. Returns why the client was refused ("bad secret ...", "handshake timed
// out ...", "malformed ..."), or nothing once the client is admitted. A client that has not
// finished by deadline is refused.
std::optional<std::string> admit_store_client(int fd, std::string_view secret,
                                              std::chrono::steady_clock::time_point deadline);

// The client's side, on a connected socket to `where` (host:port, for messages). Throws
// AuthenticationError where the secrets do not match (either side has none, or a different
// one), TimeoutError where the server is silent until deadline, and TransportError where the
// other end is not a terse store of this protocol version or closes the connection.
void join_store(int fd, std::string_view secret, const std::string& where,
                std::chrono::steady_clock::time_point deadline);

// How many connections a TCP store server admitted and refused. Every connection ends up in one
// of the two once its handshake ends; each refused one is also logged on stderr.
struct StoreAdmissions {
  std::uint64_t admitted = 0;
  std::uint64_t refused = 0;
};
// Of the server behind store (made by make_tcp_store with is_server); nothing for other stores
// (tcp_store.cpp).
std::optional<StoreAdmissions> tcp_store_admissions(const Store& store);

}  // namespace terse::transport
