// Communicator's internals shared by its files: communicator.cpp (requests, posting, the
// collectives, creation) and communicator_watch.cpp (failure notices and the watchdog).
// Internal to the transport.
#pragma once

#include <fmt/format.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <vector>

#include "terse/communicator.h"
#include "terse/error.h"

namespace terse::transport {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Slot layout: the top byte separates terse's users, its own collectives, the abort probe, the
// watchdog's sentinels, failure notices and the job secret's check of every pair from Gloo's
// algorithms (prefixes 0x01..0x08), the low 56 bits carry the tag. Nobody sends to the abort or
// watch slots.
inline constexpr std::uint64_t kUserSlot = std::uint64_t{0x40} << 56;
inline constexpr std::uint64_t kCollectiveSlot = std::uint64_t{0x41} << 56;
inline constexpr std::uint64_t kAbortSlot = std::uint64_t{0x42} << 56;
inline constexpr std::uint64_t kWatchSlot = std::uint64_t{0x43} << 56;
inline constexpr std::uint64_t kNoticeSlot = std::uint64_t{0x44} << 56;
inline constexpr std::uint64_t kAuthSlot = std::uint64_t{0x45} << 56;

// A failure notice: i32 the rank whose failure started it, u32 length, the first message about
// that failure (truncated to fit).
inline constexpr std::size_t kNoticeBytes = 1024;
// How long a failing rank lets its notices leave before it closes its connections; a peer that
// does not read meanwhile (stalled) gets none.
inline constexpr milliseconds kNoticeGrace{500};

// A wait that must not time out (a Gloo wait that times out closes every connection).
inline constexpr milliseconds kForever = std::chrono::hours(24 * 365);

inline bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

}  // namespace terse::transport

namespace terse {

struct Communicator::Impl {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{60000};
  std::string address;
  std::shared_ptr<Store> store;
  // Declared before the context so that it is destroyed after it.
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;

  std::atomic<bool> failed{false};
  std::mutex fail_mutex;
  std::string first_error;
  int first_cause = -1;  // the rank whose failure the first error follows
  std::uint32_t collective_seq = 0;
  char abort_byte = 0;

  // Requests posted and not yet waited for. Gloo tells a pair's error to the operations still
  // queued on the pair, but not to an unbound-buffer send or recv whose bytes are already
  // moving: that wait would sit out the whole timeout after the peer died. So the communicator
  // keeps its own list and ends those waits itself: every one when it fails (fail), and those
  // on a pair that failed (the watchdog). Guarded by live_mutex, which also orders a request's
  // abort before its destruction.
  std::mutex live_mutex;
  std::unordered_set<Request::State*> live;

  // The watchdog learns of a failed pair without polling: a zero-byte recv that nobody sends
  // to is posted to every peer on one buffer (all_sentinel), and Gloo signals it when any pair
  // fails. One such recv per peer (peer_sentinel) tells which pair it was. Gloo cannot say
  // whether an operation completed before its pair closed without waiting for it, so the
  // watchdog ends a wait on a closed pair only once it has lasted kCloseGrace past the close:
  // a completed operation's wait returns at once.
  static constexpr std::chrono::milliseconds kClosePoll{50};
  static constexpr std::chrono::milliseconds kCloseGrace{200};
  std::thread watchdog;
  std::condition_variable watch_cv;  // wakes the watchdog's polls to stop
  bool stopping = false;                                         // under live_mutex
  std::unique_ptr<gloo::transport::UnboundBuffer> all_sentinel;  // under live_mutex
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> peer_sentinel;
  // Per peer, when the watchdog saw its pair fail, and Gloo's error; both under live_mutex.
  std::vector<transport::Clock::time_point> closed_at;
  std::vector<std::string> closed_error;

  // Failure notices. A rank that fails tells every peer, before it closes its connections, which
  // rank's failure it follows and the first message about it, so that a peer whose connection
  // to it then closes names that rank rather than blaming one that is alive. Each peer's notice
  // lands in notice_in[peer] (a recv posted for the communicator's life); bytes that precede a
  // close on the same connection are read before it, so once a pair has failed its notice is
  // there or was never sent. notice_out is written once, by the first fail().
  std::vector<std::vector<char>> notice_in;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> notice_recv;
  std::vector<char> notice_out;
  std::unique_ptr<gloo::transport::UnboundBuffer> notice_send;

  ~Impl() { stop_watchdog(); }

  std::string failure() {
    std::lock_guard lock(fail_mutex);
    return first_error;
  }
  int failure_cause() {
    std::lock_guard lock(fail_mutex);
    return first_cause;
  }

  // Records the first error, tells the peers that this rank fails because of rank `cause`
  // (origin: the first message about that failure) and closes every connection, so that waits
  // in other threads here and on peers blocked on this rank end now rather than at their
  // timeouts.
  void fail(const std::string& reason, int cause, const std::string& origin) noexcept {
    {
      std::lock_guard lock(fail_mutex);
      if (failed.exchange(true)) return;
      first_error = reason;
      first_cause = cause;
    }
    if (!context || size == 1) return;
    send_notices(cause, origin);
    // Gloo's public API has one way to fail a whole context: an unbound-buffer wait that times
    // out signals every pair. Probe with a zero timeout on a slot nobody sends to.
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      try {
        auto probe = context->createUnboundBuffer(&abort_byte, 1);
        probe->recv(peer, transport::kAbortSlot);
        probe->waitRecv(nullptr, std::chrono::milliseconds(0));
      } catch (const std::exception& e) {
        if (transport::contains(e.what(), "Timed out")) break;  // every pair is now closed
      }
    }
    // Every pair is closed, so Gloo touches no buffer any more: end every wait now.
    abort_waits();
  }

  void post_notice_recvs();
  // Sends the failure notice to every peer whose pair is open and waits, up to kNoticeGrace, for
  // the sends to complete. Called once, by the first fail().
  void send_notices(int cause, const std::string& origin) noexcept;
  // Why peer's connection closed, for an error message: its notice if it sent one ("peer P
  // aborted because of rank C: ..."), else that it closed. Sets cause and origin to what this
  // rank's own failure then follows (origin empty: this message is the first about it). Only for
  // a peer whose pair has failed (its notice buffer is written no more).
  std::string closed_by(int peer, int& cause, std::string& origin) const;
  // " (rank R is on host ...)" from set_peer_places, or empty.
  std::string place_of(int rank) const;
  mutable std::mutex places_mutex;
  std::vector<std::string> places;

  // Ends the wait of every live request (Request::wait then throws TransportError).
  void abort_waits();
  // Ends s's wait, recording Gloo's error for its pair (empty: the communicator failed).
  // Under live_mutex.
  static void abort_wait(Request::State& s, const std::string& gloo_error);

  void start_watchdog();
  // Posts a fresh all_sentinel to every peer whose pair is not known closed. Returns false if
  // a post threw (that pair failed meanwhile). Under live_mutex once the watchdog runs.
  bool post_all_sentinel();
  void stop_watchdog();
  void watch();
  // Records the pairs found failed since the last call (peer sentinels polled without
  // blocking). Returns true if a pair is still open.
  bool find_closed_pairs();
  // Ends the waits that have lasted kCloseGrace on a closed pair. Returns true while a request
  // on a closed pair is left (not waited for yet, or within the grace). Under live_mutex.
  bool end_stuck_waits();

  // The check of every pair, once connected (peer_auth.cpp): each rank sends every peer a hello
  // (whether it has a job secret, and a fresh nonce); where both have one, each answers the
  // peer's nonce with HMAC-SHA256(secret, "terse-pair" || its rank || the peer's rank || nonce)
  // and checks the peer's answer to its own. Gloo's listener admits any connection that names a
  // pair's sequence number, so this is what keeps a process without the secret out of the job.
  // Throws AuthenticationError naming each peer that did not prove the secret (or whose side
  // has none where this one has one, or the other way round), after failing the communicator:
  // a pair held by an impostor fails the whole communicator rather than let it in.
  void authenticate_peers(std::string_view secret);

  // Posts one unbound-buffer operation; on failure fails the communicator and throws.
  Request post(bool is_send, int peer, std::uint64_t slot, std::uint64_t tag, void* ptr,
               std::size_t bytes, std::string_view label, const char* operation);

  void check_usable() {
    if (failed.load()) {
      throw TransportError(
          fmt::format("rank {}: communicator has failed: {}", rank, failure()));
    }
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size || peer == rank) {
      throw InvalidArgument(fmt::format("rank {}: {}: peer {} is not another rank of 0..{}",
                                        rank, what, peer, size - 1));
    }
  }
};

struct Request::State {
  Communicator::Impl* comm = nullptr;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool is_send = false;
  bool done = false;
  int peer = 0;
  std::uint64_t tag = 0;
  const char* operation = "";  // "send", "recv", "allgatherv", ...
  std::string label;
  // Under the communicator's live_mutex: when wait() began waiting (epoch while not waiting),
  // and whether abort_waits ended the wait, with Gloo's error for this request's pair (empty
  // when the whole communicator failed).
  transport::Clock::time_point waiting_since{};
  bool aborted = false;
  std::string abort_error;

  std::string describe() const {
    return fmt::format("rank {}: {} {} peer {} of '{}' (tag {}, {} bytes)", comm->rank,
                       operation, is_send ? "to" : "from", peer,
                       label.empty() ? "(unnamed)" : label, tag, buffer->size);
  }
};

}  // namespace terse
