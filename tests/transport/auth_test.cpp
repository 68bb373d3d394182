// The job secret: only processes that hold it get into a TCP store or a communicator. In
// process: the store's handshake against wrong, missing, replayed and half-finished ones, and a
// server that cannot prove it; then real jobs through `terse run`: intruders knocking on a job's
// store while its ranks rendezvous and allreduce, and ranks whose secrets differ failing their
// communicator on both sides. Every test counts what the store admitted: no connection without
// the secret is ever admitted.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "process_testing.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/store_handshake.h"

namespace terse {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::shell;
using testing::temp_dir;
using transport::StoreAdmissions;

constexpr const char* kSecret = "the job's secret";
// The wire format of store_handshake.h, as a foreign program sees it.
constexpr std::size_t kServerHello = 38, kClientHello = 70, kVerdict = 33;

std::vector<std::byte> bytes(std::string_view s) {
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

StoreAdmissions admissions(const Store& server) {
  const auto a = transport::tcp_store_admissions(server);
  EXPECT_TRUE(a.has_value());
  return a.value_or(StoreAdmissions{});
}

// The server counts a refusal once its verdict is sent, which the refused client may see first.
StoreAdmissions admissions_once_refused(const Store& server, std::uint64_t refused) {
  const auto deadline = Clock::now() + 15s;
  while (admissions(server).refused < refused && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  return admissions(server);
}

// A plain TCP connection to 127.0.0.1:port, closed on scope exit.
class Raw {
 public:
  explicit Raw(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ADD_FAILURE() << "connect to port " << port << ": " << strerror(errno);
    }
  }
  ~Raw() { ::close(fd_); }
  int fd() const { return fd_; }

  // Up to n bytes, fewer where the connection closes or `within` passes first.
  std::vector<std::byte> read(std::size_t n, std::chrono::milliseconds within = 5s) {
    std::vector<std::byte> out;
    const auto deadline = Clock::now() + within;
    while (out.size() < n) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      std::byte buf[256];
      const ssize_t r = ::recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (r <= 0) {
        closed_ = true;
        break;
      }
      out.insert(out.end(), buf, buf + r);
    }
    return out;
  }
  void write(std::span<const std::byte> data) {
    ASSERT_EQ(::send(fd_, data.data(), data.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(data.size()));
  }
  // Whether the other end has closed (read everything it sent and saw the end).
  bool closed_within(std::chrono::milliseconds within) {
    while (!closed_) {
      const auto start = Clock::now();
      if (read(4096, within).empty() && !closed_) return false;
      within -= std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    }
    return true;
  }

 private:
  int fd_ = -1;
  bool closed_ = false;
};

// A listening socket on 127.0.0.1 and an ephemeral port.
int listen_loopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 8) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ADD_FAILURE() << "listen: " << strerror(errno);
  }
  port = ntohs(a.sin_port);
  return fd;
}

// Relays one client's connection to the store and keeps every byte the client sent: what an
// eavesdropper on the network records.
class RecordingRelay {
 public:
  explicit RecordingRelay(int store_port) : listen_(listen_loopback(port_)) {
    thread_ = std::thread([this, store_port] { relay(store_port); });
  }
  ~RecordingRelay() {
    stop_ = true;
    thread_.join();
    ::close(listen_);
  }
  int port() const { return port_; }
  std::vector<std::byte> recorded() {
    std::lock_guard lock(mutex_);
    return recorded_;
  }

 private:
  void relay(int store_port) {
    pollfd a{listen_, POLLIN, 0};
    while (!stop_ && ::poll(&a, 1, 50) == 0) {
    }
    if (stop_) return;
    const int client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    Raw store(store_port);
    while (!stop_) {
      pollfd p[2] = {{client, POLLIN, 0}, {store.fd(), POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      std::byte buf[4096];
      if (p[0].revents != 0) {
        const ssize_t r = ::recv(client, buf, sizeof(buf), 0);
        if (r <= 0) break;
        {
          std::lock_guard lock(mutex_);
          recorded_.insert(recorded_.end(), buf, buf + r);
        }
        ::send(store.fd(), buf, static_cast<std::size_t>(r), MSG_NOSIGNAL);
      }
      if (p[1].revents != 0) {
        const ssize_t r = ::recv(store.fd(), buf, sizeof(buf), 0);
        if (r <= 0) break;
        ::send(client, buf, static_cast<std::size_t>(r), MSG_NOSIGNAL);
      }
    }
    ::close(client);
  }

  int port_ = 0;
  int listen_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mutex_;
  std::vector<std::byte> recorded_;
};

// ---- the store, in process --------------------------------------------------------------------

TEST(StoreSecret, ClientsWithTheSecretUseTheStoreAndEachIsAdmittedOnce) {
  auto server = make_tcp_store("127.0.0.1", 0, true, 5s, kSecret);
  const int port = tcp_store_port(*server);
  auto a = make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
  auto b = make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
  a->set("k", bytes("v"));
  EXPECT_EQ(b->get("k", 1s), bytes("v"));
  server->set("s", {});
  const std::string keys[] = {"k", "s"};
  b->wait(keys, 1s);
  const StoreAdmissions got = admissions(*server);
  EXPECT_EQ(got.admitted, 3u);  // the server's own client, a and b
  EXPECT_EQ(got.refused, 0u);
  EXPECT_FALSE(transport::tcp_store_admissions(*a).has_value());  // a client serves nothing
}

TEST(StoreSecret, AWrongSecretIsRefusedAtOnceWithAClearErrorAndTheServerGoesOn) {
  auto server = make_tcp_store("127.0.0.1", 0, true, 5s, kSecret);
  const int port = tcp_store_port(*server);
  ::testing::internal::CaptureStderr();
  const auto start = Clock::now();
  try {
    make_tcp_store("127.0.0.1", port, false, 5s, "not the job's secret");
    ADD_FAILURE() << "admitted with a wrong secret";
  } catch (const AuthenticationError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(contains(m, fmt::format("127.0.0.1:{}", port))) << m;
    EXPECT_TRUE(contains(m, "job secret did not match")) << m;
  }
  EXPECT_LT(Clock::now() - start, 2s);
  const StoreAdmissions got = admissions_once_refused(*server, 1);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(got.refused, 1u);
  EXPECT_EQ(got.admitted, 1u);  // the server's own client only
  EXPECT_TRUE(contains(log, fmt::format("terse tcp store (port {}): refused a connection from "
                                        "127.0.0.1:",
                                        port)))
      << log;
  EXPECT_TRUE(contains(log, "bad secret")) << log;
  // The job goes on: the right secret still gets in.
  auto good = make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
  good->set("after", bytes("x"));
  EXPECT_EQ(server->get("after", 1s), bytes("x"));
  EXPECT_EQ(admissions(*server).admitted, 2u);
}

TEST(StoreSecret, ASecretOnOneSideOnlyIsRefusedWithClearErrorsOnBoth) {
  {
    auto server = make_tcp_store("127.0.0.1", 0, true, 5s, kSecret);
    const int port = tcp_store_port(*server);
    ::testing::internal::CaptureStderr();
    try {
      make_tcp_store("127.0.0.1", port, false, 5s);
      ADD_FAILURE() << "admitted without a secret";
    } catch (const AuthenticationError& e) {
      EXPECT_TRUE(contains(e.what(), "requires the job secret and this process has none"))
          << e.what();
      EXPECT_TRUE(contains(e.what(), std::to_string(port))) << e.what();
    }
    const StoreAdmissions got = admissions_once_refused(*server, 1);
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(got.refused, 1u);
    EXPECT_EQ(got.admitted, 1u);
    EXPECT_TRUE(contains(log, "no secret: the client has no job secret")) << log;
  }
  {
    auto open = make_tcp_store("127.0.0.1", 0, true, 5s);
    const int port = tcp_store_port(*open);
    ::testing::internal::CaptureStderr();
    try {
      make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
      ADD_FAILURE() << "a client with a secret used a server without one";
    } catch (const AuthenticationError& e) {
      EXPECT_TRUE(contains(e.what(), "the server has no job secret and this process has one"))
          << e.what();
    }
    const StoreAdmissions got = admissions_once_refused(*open, 1);
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(got.refused, 1u);
    EXPECT_TRUE(contains(log, "unexpected secret")) << log;
  }
}

// An eavesdropper records a genuine client's whole conversation (its handshake and a request)
// and plays it back on a connection of its own: the server's nonce is fresh, so the recorded
// proof is worthless and the request is never served.
TEST(StoreSecret, AReplayedHandshakeIsRefused) {
  auto server = make_tcp_store("127.0.0.1", 0, true, 5s, kSecret);
  const int port = tcp_store_port(*server);
  std::vector<std::byte> recorded;
  {
    RecordingRelay relay(port);
    auto genuine = make_tcp_store("127.0.0.1", relay.port(), false, 5s, kSecret);
    genuine->set("genuine", bytes("1"));
    EXPECT_EQ(server->get("genuine", 1s), bytes("1"));
    recorded = relay.recorded();
  }
  ASSERT_GT(recorded.size(), kClientHello);  // the client hello, then the set request
  EXPECT_EQ(admissions(*server).admitted, 2u);

  ::testing::internal::CaptureStderr();
  Raw replay(port);
  ASSERT_EQ(replay.read(kServerHello).size(), kServerHello);
  replay.write(recorded);
  const auto verdict = replay.read(kVerdict);
  ASSERT_FALSE(verdict.empty());
  EXPECT_EQ(verdict[0], std::byte{1});  // bad secret
  EXPECT_TRUE(replay.closed_within(5s));
  const StoreAdmissions got = admissions_once_refused(*server, 1);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(got.refused, 1u);
  EXPECT_EQ(got.admitted, 2u);
  EXPECT_TRUE(contains(log, "bad secret")) << log;
}

// A connection that never finishes its handshake (nothing sent, or half a hello) holds only its
// own thread: clients that come after it are served at once, and it is closed after the bound,
// min(timeout, 10 s), here 3 s.
TEST(StoreSecret, HalfOpenConnectionsBlockNobodyAndAreClosedAfterTheBound) {
  auto server = make_tcp_store("127.0.0.1", 0, true, 3s, kSecret);
  const int port = tcp_store_port(*server);
  ::testing::internal::CaptureStderr();
  const auto start = Clock::now();
  Raw silent(port);
  Raw half(port);
  ASSERT_EQ(half.read(kServerHello).size(), kServerHello);
  std::vector<std::byte> part(kClientHello / 2, std::byte{7});  // a hello's magic, then half
  std::memcpy(part.data(), "tstc\x01\x01", 6);
  half.write(part);

  std::vector<std::thread> clients;
  std::atomic<int> served{0};
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&, i] {
      auto c = make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
      c->set(fmt::format("client-{}", i), bytes("x"));
      ++served;
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(served.load(), 4);
  EXPECT_LT(Clock::now() - start, 2s) << "the clients waited for the half-open connections";

  EXPECT_TRUE(silent.closed_within(6s));
  EXPECT_TRUE(half.closed_within(6s));
  const auto closed_after = Clock::now() - start;
  EXPECT_GE(closed_after, 2900ms);
  EXPECT_LT(closed_after, 6s);
  const StoreAdmissions got = admissions_once_refused(*server, 2);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(got.refused, 2u);
  EXPECT_EQ(got.admitted, 5u);  // the server's own client and the 4
  std::size_t timed_out = 0;
  for (std::size_t at = 0; (at = log.find("handshake timed out", at)) != std::string::npos; ++at) {
    ++timed_out;
  }
  EXPECT_EQ(timed_out, 2u) << log;
}

// A client checks the server too: one that speaks the protocol but cannot prove the secret
// (here it admits everyone with a made-up proof) is refused, so a rank never hands its keys to a
// store that took the real one's port.
TEST(StoreSecret, AClientRefusesAServerThatDoesNotProveTheSecret) {
  int port = 0;
  const int listener = listen_loopback(port);
  std::thread fake([listener] {
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    std::array<std::byte, kServerHello> hello{};
    std::memcpy(hello.data(), "tsto", 4);
    hello[4] = std::byte{1};
    hello[5] = std::byte{1};
    ::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
    std::array<std::byte, kClientHello> in{};
    ::recv(fd, in.data(), in.size(), MSG_WAITALL);
    std::array<std::byte, kVerdict> admitted{};  // verdict 0, a proof of zeros
    ::send(fd, admitted.data(), admitted.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(200ms);
    ::close(fd);
  });
  try {
    make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
    ADD_FAILURE() << "used a server that did not prove the secret";
  } catch (const AuthenticationError& e) {
    EXPECT_TRUE(contains(e.what(), "the server did not prove the job secret")) << e.what();
  }
  fake.join();
  ::close(listener);
}

// Not a terse store at all (the first bytes are something else): a clear error, not a hang.
TEST(StoreSecret, SomethingElseOnThePortIsNamedNotWaitedFor) {
  int port = 0;
  const int listener = listen_loopback(port);
  std::thread other([listener] {
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    const char banner[] = "SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n";
    ::send(fd, banner, sizeof(banner) - 1, MSG_NOSIGNAL);
    std::this_thread::sleep_for(500ms);
    ::close(fd);
  });
  const auto start = Clock::now();
  try {
    make_tcp_store("127.0.0.1", port, false, 5s, kSecret);
    ADD_FAILURE() << "took something else for a store";
  } catch (const TransportError& e) {
    EXPECT_TRUE(contains(e.what(), "not a terse store's handshake")) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 2s);
  other.join();
  ::close(listener);
}

// ---- real jobs ---------------------------------------------------------------------------------

const std::string kCli = TERSE_CLI;
const std::string kWorker = TERSE_WORKER;

TEST(JobSecret, TerseRunGivesEachJobAFreshSecretUnlessOneIsSet) {
  const std::regex line(R"(\[rank (\d)\] secret=([^\n]*)\n)");
  auto secrets = [&](const std::string& env) {
    auto r = shell(env + kCli + " run -n 2 -- sh -c 'echo secret=$TERSE_JOB_SECRET'");
    EXPECT_EQ(r.code, 0) << r.output;
    std::set<std::string> seen;
    for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it) {
      seen.insert((*it)[2]);
    }
    EXPECT_EQ(seen.size(), 1u) << "every rank of a job has the same secret: " << r.output;
    return seen.empty() ? std::string() : *seen.begin();
  };
  const std::string first = secrets("env -u TERSE_JOB_SECRET ");
  const std::string second = secrets("env -u TERSE_JOB_SECRET ");
  EXPECT_TRUE(std::regex_match(first, std::regex("[0-9a-f]{64}"))) << first;
  EXPECT_NE(first, second);
  EXPECT_EQ(secrets("TERSE_JOB_SECRET=chosen-by-me "), "chosen-by-me");
}

// Intruders knock on a job's store while its 3 ranks rendezvous and allreduce (started by rank
// 1, see transport_worker's `intruded`): one with a wrong secret, one with none, and one that
// connects and says nothing until the store closes it (after min(4 s, 10 s)). The job completes;
// the store admitted its 3 ranks and refused the 3 intruders, each with a clear error.
TEST(JobSecret, IntrudersAreRefusedWhileTheJobRendezvousesAndAllreduces) {
  auto r = shell(kCli + " run -n 3 --timeout 4 -- " + kWorker + " intruded");
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(contains(r.output, fmt::format("[rank {}] INTRUDED-OK rank {} sum=6", i, i)))
        << r.output;
  }
  EXPECT_TRUE(contains(r.output, "[rank 0] STORE admitted=3 refused=3\n")) << r.output;
  EXPECT_FALSE(contains(r.output, "INTRUDER-ADMITTED")) << r.output;
  const std::regex refused(R"(INTRUDER-REFUSED (with a wrong secret|without a secret): )"
                           R"(tcp store 127\.0\.0\.1:\d+: ([^\n]*))");
  std::set<std::string> kinds;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), refused), end; it != end; ++it) {
    kinds.insert((*it)[1]);
    const std::string why = (*it)[2];
    EXPECT_TRUE(contains(
        why, (*it)[1] == "without a secret" ? "this process has none" : "job secret did not match"))
        << why;
  }
  EXPECT_EQ(kinds.size(), 2u) << r.output;
  // The store's log names each refused connection once, and why.
  EXPECT_TRUE(contains(r.output, "bad secret")) << r.output;
  EXPECT_TRUE(contains(r.output, "no secret: the client has no job secret")) << r.output;
  EXPECT_TRUE(contains(r.output, "handshake timed out")) << r.output;
  // The ranks got through while the silent connection was still open.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(RENDEZVOUS rank 1 ms=(\d+))")))
      << r.output;
  const long rendezvous_ms = std::stol(m[1]);
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(HALF-OPEN closed after ms=(\d+))")))
      << r.output;
  const long closed_ms = std::stol(m[1]);
  EXPECT_LT(rendezvous_ms, closed_ms) << r.output;
  EXPECT_GE(closed_ms, 3500) << r.output;
  EXPECT_LT(closed_ms, 8000) << r.output;
}

// Over a store with no secret (a file store), ranks whose secrets differ, or where one rank has
// none, reach each other's Gloo listeners; the check of every pair then fails the communicator
// on every rank, naming the peer. With three ranks, only the pairs with the odd one out fail.
struct PairCase {
  const char* name;
  int ranks;
  const char* setup;  // sh commands that set TERSE_JOB_SECRET per $RANK
};

void PrintTo(const PairCase& c, std::ostream* os) { *os << c.name; }

class PairSecret : public ::testing::TestWithParam<PairCase> {};

TEST_P(PairSecret, FailsTheCommunicatorOnEveryRankNamingThePeer) {
  const PairCase c = GetParam();
  const std::string dir = temp_dir();
  auto r = shell("TERSE_FILE_STORE=" + dir + " " + kCli + " run -n " + std::to_string(c.ranks) +
                 " --timeout 10 --grace 30 -- sh -c '" + c.setup + "; exec " + kWorker + " join'");
  std::filesystem::remove_all(dir);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "JOINED")) << r.output;
  const int odd = c.ranks - 1;
  for (int i = 0; i < c.ranks; ++i) {
    std::smatch m;
    const std::regex failed(fmt::format(R"(\[rank {}\] JOIN-FAILED type=(\w+): ([^\n]*))", i));
    ASSERT_TRUE(std::regex_search(r.output, m, failed)) << "rank " << i << ":\n" << r.output;
    EXPECT_EQ(m[1], "AuthenticationError") << m[2];
    const std::string message = m[2];
    EXPECT_TRUE(contains(message, fmt::format("rank {} (", i))) << message;
    EXPECT_TRUE(contains(message, "job secret check")) << message;
    for (int p = 0; p < c.ranks; ++p) {
      if (p == i) continue;
      const bool bad_pair = i == odd || p == odd;
      EXPECT_EQ(contains(message, fmt::format("peer {} ", p)), bad_pair)
          << "rank " << i << " about peer " << p << ": " << message;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transport, PairSecret,
    ::testing::Values(
        PairCase{"DifferentSecrets", 2, "export TERSE_JOB_SECRET=secret-of-rank-$RANK"},
        PairCase{"OneRankWithoutASecret", 2, "if [ $RANK = 1 ]; then unset TERSE_JOB_SECRET; fi"},
        PairCase{"TheLastOfThreeWithAnother", 3,
                 "if [ $RANK = 2 ]; then export TERSE_JOB_SECRET=another; fi"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace terse
