// A small rendezvous key-value store over TCP, served by rank 0 (the role torch's TCPStore plays
// for torchrun). It carries bootstrap keys only, never tensor data.
//
// Protocol (little-endian): request = op u8, key length u32, key, then
//   SET: value length u64, value     -> reply status u8
//   GET: timeout ms u32              -> reply status u8, and if found: length u64, value
//   WAIT: timeout ms u32             -> reply status u8
// status: 0 found/done, 1 timed out. The server enforces timeouts, so a client never blocks on a
// key forever; the client's socket timeouts bound a vanished server.
//
// Before any request, each connection runs the handshake of store_handshake.h: with a job secret,
// client and server prove it to each other. The server admits no request before the handshake
// ends, refuses (closes and logs) a client that fails it or has not finished within
// min(timeout, 10 s), and serves every other client meanwhile (one thread per connection).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/store_handshake.h"

namespace terse {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum : std::uint8_t { kSet = 1, kGet = 2, kWait = 3, kAdd = 4 };
enum : std::uint8_t { kOk = 0, kTimedOut = 1 };
constexpr std::uint32_t kMaxKey = 4096;
constexpr std::uint64_t kMaxValue = std::uint64_t{1} << 30;
// The longest a connection may take over its handshake: a client that has connected has its
// reply at once, so only one that stalls, or is not a store client, takes longer.
constexpr milliseconds kHandshakeBound{10000};

// Closes a socket descriptor on scope exit.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Socket() { reset(); }
  int fd() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Reads or writes exactly n bytes; false on EOF or error (errno says which, 0 for EOF).
bool read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return false;
    }
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t r = ::send(fd, c, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

template <typename T>
void append(std::vector<char>& out, T v) {
  const auto* p = reinterpret_cast<const char*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void set_timeouts(int fd, milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// "1.2.3.4:5678" or "[::1]:5678", for the log of refused connections.
std::string address_of(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    port = ntohs(v4->sin_port);
    return fmt::format("{}:{}", host, port);
  }
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
  inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
  port = ntohs(v6->sin6_port);
  if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
    inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], host, sizeof(host));
    return fmt::format("{}:{}", host, port);
  }
  return fmt::format("[{}]:{}", host, port);
}

class TcpStoreServer {
 public:
  TcpStoreServer(int port, std::string secret, milliseconds handshake_bound)
      : secret_(std::move(secret)), handshake_bound_(handshake_bound) {
    Socket s(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
    bool v6 = s.fd() >= 0;
    if (!v6) s = Socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd() < 0) throw TransportError(fmt::format("tcp store: socket: {}", strerror(errno)));
    int one = 1, zero = 0;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<std::uint16_t>(port));
      rc = ::bind(s.fd(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<std::uint16_t>(port));
      rc = ::bind(s.fd(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc != 0 || ::listen(s.fd(), 128) != 0) {
      throw TransportError(
          fmt::format("tcp store: cannot listen on port {}: {}", port, strerror(errno)));
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    listen_ = std::move(s);
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~TcpStoreServer() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      for (auto& c : connections_) ::shutdown(c.socket.fd(), SHUT_RDWR);
    }
    changed_.notify_all();
    acceptor_.join();
    for (auto& c : connections_) c.thread.join();
  }

  int port() const { return port_; }

  transport::StoreAdmissions admissions() const { return {admitted_.load(), refused_.load()}; }

 private:
  struct Connection {
    Socket socket;
    std::thread thread;
    bool done = false;  // under mutex_: its thread has returned from serve
  };

  void accept_loop() {
    while (true) {
      pollfd p{listen_.fd(), POLLIN, 0};
      int r = ::poll(&p, 1, 100);
      std::lock_guard lock(mutex_);
      if (stop_) return;
      // Connections that ended (refused ones included) give back their thread and socket, so
      // that strangers connecting again and again do not pile them up.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (!it->done) {
          ++it;
          continue;
        }
        it->thread.join();
        it = connections_.erase(it);
      }
      if (r <= 0) continue;
      sockaddr_storage peer{};
      socklen_t peer_len = sizeof(peer);
      int fd = ::accept4(listen_.fd(), reinterpret_cast<sockaddr*>(&peer), &peer_len, SOCK_CLOEXEC);
      if (fd < 0) continue;
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto& c = connections_.emplace_back();
      c.socket = Socket(fd);
      c.thread = std::thread([this, fd, &c, from = address_of(peer)] {
        if (admit(fd, from)) serve(fd);
        std::lock_guard done_lock(mutex_);
        c.done = true;
      });
    }
  }

  // The handshake, bounded so that a client that never finishes it (half-open, or not a store
  // client) holds only its own thread. A refusal is logged once, here.
  bool admit(int fd, const std::string& from) {
    std::optional<std::string> refused;
    try {
      refused = transport::admit_store_client(fd, secret_, Clock::now() + handshake_bound_);
    } catch (const std::exception& e) {
      refused = e.what();
    }
    if (!refused) {
      ++admitted_;
      return true;
    }
    {
      std::lock_guard lock(mutex_);
      if (stop_) return false;  // closed by our own shutdown, not refused
    }
    // Logged, then counted, then closed: whoever sees one of them sees the ones before.
    fmt::print(stderr, "terse tcp store (port {}): refused a connection from {}: {}\n", port_, from,
               *refused);
    std::fflush(stderr);
    ++refused_;
    ::shutdown(fd, SHUT_RDWR);
    return false;
  }

  // One thread per client: the world is small and requests block on keys.
  void serve(int fd) {
    std::vector<char> reply;
    while (true) {
      std::uint8_t op;
      std::uint32_t key_len;
      if (!read_all(fd, &op, 1) || !read_all(fd, &key_len, 4) || key_len > kMaxKey) return;
      std::string key(key_len, '\0');
      if (!read_all(fd, key.data(), key_len)) return;
      reply.clear();
      if (op == kSet) {
        std::uint64_t n;
        if (!read_all(fd, &n, 8) || n > kMaxValue) return;
        std::vector<std::byte> value(n);
        if (!read_all(fd, value.data(), n)) return;
        {
          std::lock_guard lock(mutex_);
          data_[key] = std::move(value);
        }
        changed_.notify_all();
        append<std::uint8_t>(reply, kOk);
      } else if (op == kGet || op == kWait) {
        std::uint32_t timeout_ms;
        if (!read_all(fd, &timeout_ms, 4)) return;
        std::unique_lock lock(mutex_);
        bool found = changed_.wait_for(lock, milliseconds(timeout_ms),
                                       [&] { return stop_ || data_.count(key) > 0; });
        if (stop_) return;
        append<std::uint8_t>(reply, found ? kOk : kTimedOut);
        if (found && op == kGet) {
          const auto& v = data_[key];
          append<std::uint64_t>(reply, v.size());
          const auto* p = reinterpret_cast<const char*>(v.data());
          reply.insert(reply.end(), p, p + v.size());
        }
      } else if (op == kAdd) {
        std::int64_t delta;
        if (!read_all(fd, &delta, 8)) return;
        std::int64_t value;
        {
          std::lock_guard lock(mutex_);
          value = counters_[key] += delta;
        }
        append<std::uint8_t>(reply, kOk);
        append<std::int64_t>(reply, value);
      } else {
        return;  // A foreign client: drop it.
      }
      if (!write_all(fd, reply.data(), reply.size())) return;
    }
  }

  Socket listen_;
  int port_ = 0;
  const std::string secret_;
  const milliseconds handshake_bound_;
  std::atomic<std::uint64_t> admitted_{0};
  std::atomic<std::uint64_t> refused_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stop_ = false;
  std::map<std::string, std::vector<std::byte>> data_;
  std::map<std::string, std::int64_t> counters_;
  std::list<Connection> connections_;
  std::thread acceptor_;
};

class TcpStore final : public Store {
 public:
  TcpStore(std::string host, int port, bool is_server, milliseconds timeout, std::string secret)
      : host_(std::move(host)), timeout_(timeout), secret_(std::move(secret)) {
    if (port < 0 || port > 65535 || (!is_server && port == 0)) {
      throw InvalidArgument(fmt::format("tcp store: bad port {}", port));
    }
    if (is_server) {
      server_ = std::make_unique<TcpStoreServer>(port, secret_, std::min(timeout, kHandshakeBound));
      port = server_->port();
    }
    port_ = port;
    connect();
  }

  int port() const { return port_; }

  std::optional<transport::StoreAdmissions> admissions() const {
    if (!server_) return std::nullopt;
    return server_->admissions();
  }

  void set(const std::string& key, std::span<const std::byte> value) override {
    std::vector<char> req;
    header(req, kSet, key);
    append<std::uint64_t>(req, value.size());
    const auto* p = reinterpret_cast<const char*>(value.data());
    req.insert(req.end(), p, p + value.size());
    std::lock_guard lock(mutex_);
    exchange(req, key, timeout_);
  }

  std::vector<std::byte> get(const std::string& key, milliseconds timeout) override {
    std::vector<char> req;
    header(req, kGet, key);
    append<std::uint32_t>(req, clamp_ms(timeout));
    std::lock_guard lock(mutex_);
    if (exchange(req, key, timeout) != kOk) timed_out(key, timeout);
    std::uint64_t n;
    if (!read_all(socket_.fd(), &n, 8) || n > kMaxValue) lost(key);
    std::vector<std::byte> value(n);
    if (!read_all(socket_.fd(), value.data(), n)) lost(key);
    return value;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::vector<char> req;
    header(req, kAdd, key);
    append<std::int64_t>(req, delta);
    std::lock_guard lock(mutex_);
    if (exchange(req, key, milliseconds(0)) != kOk) lost(key);
    std::int64_t value;
    if (!read_all(socket_.fd(), &value, 8)) lost(key);
    return value;
  }

  void wait(std::span<const std::string> keys, milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (const auto& key : keys) {
      auto left = std::max(milliseconds(0),
                           std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
      std::vector<char> req;
      header(req, kWait, key);
      append<std::uint32_t>(req, clamp_ms(left));
      std::lock_guard lock(mutex_);
      if (exchange(req, key, left) != kOk) timed_out(key, timeout);
    }
  }

 private:
  static std::uint32_t clamp_ms(milliseconds t) {
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(t.count(), 0, 0x7fffffff));
  }

  static void header(std::vector<char>& req, std::uint8_t op, const std::string& key) {
    if (key.size() > kMaxKey) throw InvalidArgument("tcp store: key too long");
    append<std::uint8_t>(req, op);
    append<std::uint32_t>(req, static_cast<std::uint32_t>(key.size()));
    req.insert(req.end(), key.begin(), key.end());
  }

  // Sends a request and reads the status byte. The socket's timeouts allow the server's own
  // wait plus a margin, so a server that vanished is noticed.
  std::uint8_t exchange(const std::vector<char>& req, const std::string& key, milliseconds wait) {
    set_timeouts(socket_.fd(), wait + timeout_);
    std::uint8_t status;
    if (!write_all(socket_.fd(), req.data(), req.size()) || !read_all(socket_.fd(), &status, 1)) {
      lost(key);
    }
    return status;
  }

  [[noreturn]] void lost(const std::string& key) {
    const int err = errno;
    throw TransportError(fmt::format(
        "tcp store {}:{}: lost the connection to the store server (rank 0) while accessing "
        "key '{}': {}",
        host_, port_, key, err == 0 ? "closed by server" : strerror(err)));
  }

  [[noreturn]] void timed_out(const std::string& key, milliseconds timeout) {
    throw TimeoutError(fmt::format("tcp store {}:{}: waited {} ms for key '{}' to be set",
                                   host_, port_, timeout.count(), key));
  }

  // Ranks start in any order, so refused connections are retried until the timeout.
  void connect() {
    const auto deadline = Clock::now() + timeout_;
    auto backoff = milliseconds(10);
    std::string last_error;
    while (true) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* list = nullptr;
      const std::string port = std::to_string(port_);
      int rc = ::getaddrinfo(host_.c_str(), port.c_str(), &hints, &list);
      if (rc != 0) {
        last_error = gai_strerror(rc);
      } else {
        for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
          Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
          if (s.fd() < 0) continue;
          set_timeouts(s.fd(), timeout_);
          if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) {
            int one = 1;
            setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            socket_ = std::move(s);
            break;
          }
          last_error = strerror(errno);
        }
        ::freeaddrinfo(list);
      }
      if (socket_.fd() >= 0) {
        // A server that answers but fails the handshake is not retried: it is the wrong one.
        transport::join_store(socket_.fd(), secret_, fmt::format("{}:{}", host_, port_),
                              Clock::now() + timeout_);
        return;
      }
      if (Clock::now() + backoff > deadline) {
        throw TimeoutError(fmt::format(
            "tcp store: could not connect to {}:{} within {} ms (is rank 0 running and "
            "MASTER_ADDR/MASTER_PORT right?): {}",
            host_, port_, timeout_.count(), last_error));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, milliseconds(500));
    }
  }

  std::string host_;
  int port_ = 0;
  milliseconds timeout_;
  std::string secret_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;
  Socket socket_;
};

}  // namespace

std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server,
                                      std::chrono::milliseconds timeout, std::string secret) {
  return std::make_shared<TcpStore>(host, port, is_server, timeout, std::move(secret));
}

int tcp_store_port(const Store& store) {
  const auto* tcp = dynamic_cast<const TcpStore*>(&store);
  return tcp != nullptr ? tcp->port() : -1;
}

std::optional<transport::StoreAdmissions> transport::tcp_store_admissions(const Store& store) {
  const auto* tcp = dynamic_cast<const TcpStore*>(&store);
  return tcp != nullptr ? tcp->admissions() : std::nullopt;
}

}  // namespace terse
