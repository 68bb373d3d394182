// One rank of the multi-process transport tests, started by `terse run` or scripts/cluster.sh.
// Bootstraps from the environment (TCP store or TERSE_FILE_STORE) and runs one scenario:
//   basic                   tagged send/recv of many sizes, FIFO per tag, allgatherv, broadcast,
//                           barrier; prints "OK rank R" on success
//   die VICTIM kill|stop    VICTIM kills (SIGKILL) or stops (SIGSTOP) itself mid-exchange; the
//                           others must fail: they print "EXPECTED-FAILURE ..." and exit 3
//   die VICTIM midway       every rank joins an allgatherv of large blocks and VICTIM kills
//                           itself once the first megabyte of a block has reached it, so that
//                           its neighbours' send and recv are cut off with their bytes moving
//   bandwidth BYTES REPS    rank 0 sends BYTES to rank 1 REPS times; prints seconds per transfer
//   share                   transport::machine_share: prints "SHARE rank=R cpus=LIST cores=C
//                           ranks_on_host=H cores_per_rank=P fewest_cores=F most_ranks=M"
//   again                   more communicators from the environment in this process: one with
//                           another prefix and one with the same prefix while the first lives,
//                           then one more after those are gone; each gathers every rank's
//                           number; prints "AGAIN-OK rank R"
//   join                    only creates the communicator (and passes a barrier): prints
//                           "JOINED rank R", or "JOIN-FAILED type=TYPE: MESSAGE" and exits 3
//   intruded                the job's ranks rendezvous and allreduce while rank 1 sets three
//                           intruders on the store (the `intrude` modes below): with a wrong
//                           secret, with none, and a half-open connection, which it waits for
//                           before it joins; prints "RENDEZVOUS rank 1 ms=MS" (since it started
//                           them), "INTRUDED-OK rank R sum=S", and on rank 0 "STORE admitted=A
//                           refused=R" once every intruder is done
//   intrude store           (not a rank) connects to MASTER_ADDR:MASTER_PORT with the
//                           environment's secret: prints "INTRUDER-REFUSED with a wrong
//                           secret|without a secret: MESSAGE", or "INTRUDER-ADMITTED" and exits 1
//   intrude half-open FD    (not a rank) connects and sends nothing; writes a byte to FD once
//                           connected, then prints "HALF-OPEN closed after ms=MS" when the store
//                           closes the connection
#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kit/host.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "transport/machine_share.h"
#include "transport/store_handshake.h"
#include "worker_check.h"

namespace {

using Clock = std::chrono::steady_clock;
using terse::Communicator;
using terse::Request;

std::byte pattern(int src, int dst, std::uint64_t tag, std::size_t k) {
  return static_cast<std::byte>((src * 131 + dst * 31 + tag * 7 + k * 13 + (k >> 12)) & 0xff);
}

std::vector<std::byte> filled(int src, int dst, std::uint64_t tag, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t k = 0; k < n; ++k) v[k] = pattern(src, dst, tag, k);
  return v;
}

using terse::testing::check;

void verify(const std::vector<std::byte>& got, int src, int dst, std::uint64_t tag) {
  for (std::size_t k = 0; k < got.size(); ++k) {
    if (got[k] != pattern(src, dst, tag, k)) {
      check(false, "payload from " + std::to_string(src) + " tag " + std::to_string(tag) +
                       " wrong at byte " + std::to_string(k) + " of " +
                       std::to_string(got.size()));
    }
  }
}

int basic(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  const std::vector<std::size_t> sizes = {0, 1, 3, 4096, 65537, 1000003};
  // Every pair of ranks exchanges every size under its own tag, all in flight at once; the
  // receives are posted in reverse tag order, so matching must go by tag, not by arrival.
  struct Message {
    int peer;
    std::uint64_t tag;
    std::vector<std::byte> data;
    Request request;
  };
  std::vector<Message> sends, recvs;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::uint64_t tag = 1000 + i * 17;
      recvs.push_back({p, tag, std::vector<std::byte>(sizes[i]), {}});
      sends.push_back({p, tag, filled(r, p, tag, sizes[i]), {}});
    }
    // The largest tag allowed, and three messages on one tag that must arrive in order.
    recvs.push_back({p, Communicator::kMaxTag, std::vector<std::byte>(5), {}});
    sends.push_back({p, Communicator::kMaxTag, filled(r, p, Communicator::kMaxTag, 5), {}});
  }
  for (auto it = recvs.rbegin(); it != recvs.rend(); ++it) {
    it->request = comm.recv(it->peer, it->tag, it->data, "basic");
  }
  for (auto& m : sends) m.request = comm.send(m.peer, m.tag, m.data, "basic");
  for (auto& m : sends) m.request.wait();
  for (auto& m : recvs) {
    m.request.wait();
    verify(m.data, m.peer, r, m.tag);
  }

  // FIFO on one tag.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (n > 1) {
    std::vector<std::vector<std::byte>> in(3, std::vector<std::byte>(100)), out;
    std::vector<Request> reqs;
    for (int k = 0; k < 3; ++k) reqs.push_back(comm.recv(prev, 7, in[k], "fifo"));
    for (int k = 0; k < 3; ++k) out.push_back(filled(r, next, 50 + k, 100));
    for (int k = 0; k < 3; ++k) reqs.push_back(comm.send(next, 7, out[k], "fifo"));
    for (auto& q : reqs) q.wait();
    for (int k = 0; k < 3; ++k) verify(in[k], prev, r, 50 + k);
  }

  // 64 MiB around the ring; a receive buffer larger than the message is allowed.
  if (n > 1) {
    const std::size_t big = std::size_t{64} << 20;
    std::vector<std::byte> out = filled(r, next, 9, big), in(big + 100);
    auto rx = comm.recv(prev, 9, in, "big");
    auto tx = comm.send(next, 9, out, "big");
    tx.wait();
    rx.wait();
    in.resize(big);
    verify(in, prev, r, 9);
  }

  // allgatherv with uneven sizes, rank 1 contributing nothing; then in place.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::size_t> counts(n);
    for (int i = 0; i < n; ++i) counts[i] = i == 1 ? 0 : (i + 1) * 1000 + 13 + round * 70000;
    std::size_t total = 0;
    std::vector<std::size_t> offset(n);
    for (int i = 0; i < n; ++i) {
      offset[i] = total;
      total += counts[i];
    }
    std::vector<std::byte> mine = filled(r, -1, round, counts[r]);
    std::vector<std::byte> out(total);
    if (round == 0) {
      comm.allgatherv(mine, out, counts, "gather");
    } else {
      std::copy(mine.begin(), mine.end(), out.begin() + static_cast<std::ptrdiff_t>(offset[r]));
      comm.allgatherv(std::span(out).subspan(offset[r], counts[r]), out, counts, "gather");
    }
    for (int i = 0; i < n; ++i) {
      std::vector<std::byte> part(out.begin() + static_cast<std::ptrdiff_t>(offset[i]),
                                  out.begin() + static_cast<std::ptrdiff_t>(offset[i] + counts[i]));
      verify(part, i, -1, round);
    }
  }

  // broadcast from the last rank.
  std::vector<std::byte> b = r == n - 1 ? filled(n - 1, -2, 3, 12345) : std::vector<std::byte>(12345);
  comm.broadcast(n - 1, b, "bcast");
  verify(b, n - 1, -2, 3);

  for (int k = 0; k < 5; ++k) comm.barrier();
  std::printf("OK rank %d of %d (%s)\n", r, n, comm.address().c_str());
  return 0;
}

int die(Communicator& comm, int victim, const std::string& how) {
  const int r = comm.rank(), n = comm.size();
  // The launcher sends SIGTERM to the survivors as soon as the victim dies; ignore it, so that
  // what is tested is the survivors failing by themselves (SIGKILL after the grace period
  // remains the launcher's backstop).
  signal(SIGTERM, SIG_IGN);
  comm.barrier();
  const bool midway = how == "midway";
  if (r == victim && !midway) {
    raise(how == "stop" ? SIGSTOP : SIGKILL);
    pause();
    return 5;
  }
  // The survivors start an allgatherv the victim never joins, or (midway) one it dies in.
  std::vector<std::size_t> counts(n, (midway ? std::size_t{64} : std::size_t{4}) << 20);
  std::vector<std::byte> mine(counts[r], std::byte{1}), out(counts[r] * n);
  if (midway && r == victim) {
    // The first block the ring brings here is the previous rank's; die once a megabyte of it
    // has arrived (a zero byte becomes 1), while the rest is still on the wire both ways.
    const volatile std::byte* watched = out.data() + counts[0] * ((r + n - 1) % n) + (1 << 20);
    std::thread([watched] {
      while (*watched == std::byte{0}) std::this_thread::yield();
      raise(SIGKILL);
    }).detach();
  }
  const auto start = Clock::now();
  try {
    for (int k = 0; k < 3; ++k) comm.allgatherv(mine, out, counts, "layer.weight");
  } catch (const terse::Error& e) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    const char* type = dynamic_cast<const terse::TimeoutError*>(&e) != nullptr ? "TimeoutError"
                                                                              : "TransportError";
    std::printf("EXPECTED-FAILURE rank %d elapsed_ms=%lld type=%s: %s\n", r,
                static_cast<long long>(ms), type, e.what());
    std::fflush(stdout);
    // A later call must fail at once, not hang.
    try {
      comm.barrier();
      std::printf("UNEXPECTED-SUCCESS of a barrier after failure\n");
      return 4;
    } catch (const terse::TransportError&) {
    }
    return 3;
  }
  std::printf("UNEXPECTED-SUCCESS rank %d\n", r);
  return 4;
}

int bandwidth(Communicator& comm, std::size_t bytes, int reps) {
  const int r = comm.rank();
  std::vector<std::byte> buf(bytes, std::byte{7});
  std::vector<double> seconds;
  for (int k = 0; k <= reps; ++k) {  // the first round warms up (connections, page faults)
    comm.barrier();
    const auto start = Clock::now();
    if (r == 0) comm.send(1, 1, buf, "bandwidth").wait();
    if (r == 1) comm.recv(0, 1, buf, "bandwidth").wait();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (k > 0) seconds.push_back(s);
  }
  comm.barrier();
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::printf("BANDWIDTH rank=%d bytes=%zu median_seconds=%.6f min_seconds=%.6f gbit_per_s=%.3f\n",
              r, bytes, median, seconds.front(), bytes * 8 / median / 1e9);
  return 0;
}

// Gathers every rank's number over comm and checks it.
void gather_ranks(Communicator& comm, const std::string& what) {
  const int n = comm.size();
  std::vector<std::size_t> sizes(n, sizeof(int));
  std::vector<int> all(n, -1);
  const int mine = comm.rank();
  comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)), sizes,
                  what);
  for (int i = 0; i < n; ++i)
    check(all[i] == i, what + ": rank " + std::to_string(i) + " sent " + std::to_string(all[i]));
}

int again(Communicator& first) {
  gather_ranks(first, "first");
  {
    terse::CommunicatorOptions other;
    other.prefix = "other";
    auto second = Communicator::from_env(terse::communicator_options_from_environment(other));
    // The first one's prefix, the first one alive.
    auto third = Communicator::from_env(terse::communicator_options_from_environment());
    gather_ranks(*second, "second");
    gather_ranks(*third, "third");
    gather_ranks(first, "first again");
    second->barrier();
    third->barrier();
  }
  auto fourth = Communicator::from_env(terse::communicator_options_from_environment());
  gather_ranks(*fourth, "fourth");
  fourth->barrier();
  first.barrier();
  std::printf("AGAIN-OK rank %d\n", first.rank());
  return 0;
}

int share(Communicator& comm) {
  const terse::transport::MachineShare s = terse::transport::machine_share(comm);
  std::string cpus;
  for (int c : terse::kit::allowed_cpus()) {
    if (!cpus.empty()) cpus.push_back(',');
    cpus.append(std::to_string(c));
  }
  std::printf(
      "SHARE rank=%d cpus=%s cores=%d ranks_on_host=%d cores_per_rank=%d fewest_cores=%d "
      "most_ranks=%d\n",
      comm.rank(), cpus.c_str(), s.cores, s.ranks_on_host, s.cores_per_rank, s.fewest_cores,
      s.most_ranks_on_host);
  return 0;
}

const char* type_of(const terse::Error& e) {
  if (dynamic_cast<const terse::AuthenticationError*>(&e) != nullptr) return "AuthenticationError";
  if (dynamic_cast<const terse::TimeoutError*>(&e) != nullptr) return "TimeoutError";
  if (dynamic_cast<const terse::TransportError*>(&e) != nullptr) return "TransportError";
  return "Error";
}

int join() {
  // Every rank fails at about the same time here; the launcher's SIGTERM to the others must not
  // cut their report short.
  signal(SIGTERM, SIG_IGN);
  try {
    auto comm = Communicator::from_env(terse::communicator_options_from_environment());
    comm->barrier();
    std::printf("JOINED rank %d\n", comm->rank());
    return 0;
  } catch (const terse::Error& e) {
    std::printf("JOIN-FAILED type=%s: %s\n", type_of(e), e.what());
    return 3;
  }
}

std::string variable(const char* name) {
  const char* v = std::getenv(name);
  check(v != nullptr, std::string(name) + " is not set");
  return v;
}

// A plain TCP connection to the job's store, retried until it listens.
int connect_to_store() {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (true) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    if (getaddrinfo(variable("MASTER_ADDR").c_str(), variable("MASTER_PORT").c_str(), &hints,
                    &list) == 0) {
      for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          freeaddrinfo(list);
          return fd;
        }
        if (fd >= 0) ::close(fd);
      }
      freeaddrinfo(list);
    }
    check(Clock::now() < deadline, "no store to connect to");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int intrude(const std::string& how, int ready_fd) {
  if (how == "half-open") {
    const int fd = connect_to_store();
    const auto start = Clock::now();
    const char c = 'c';
    check(::write(ready_fd, &c, 1) == 1, "cannot tell rank 1 the connection is open");
    char buf[256];
    while (true) {
      pollfd p{fd, POLLIN, 0};
      check(::poll(&p, 1, 30000) == 1, "the store kept a half-open connection for 30 s");
      if (::recv(fd, buf, sizeof(buf), 0) <= 0) break;  // the server's hello, then the close
    }
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    std::printf("HALF-OPEN closed after ms=%lld\n", static_cast<long long>(ms));
    return 0;
  }
  const auto options = terse::communicator_options_from_environment();
  const char* kind = options.secret.empty() ? "without a secret" : "with a wrong secret";
  try {
    auto store = terse::make_tcp_store(variable("MASTER_ADDR"), std::stoi(variable("MASTER_PORT")),
                                       false, options.timeout, options.secret);
    std::printf("INTRUDER-ADMITTED %s\n", kind);
    return 1;
  } catch (const terse::AuthenticationError& e) {
    std::printf("INTRUDER-REFUSED %s: %s\n", kind, e.what());
    return 0;
  }
}

pid_t start(std::vector<std::string> args) {
  std::fflush(stdout);
  const pid_t pid = ::fork();
  check(pid >= 0, "fork");
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::_Exit(127);
  }
  return pid;
}

int intruded() {
  const int rank = std::stoi(variable("RANK"));
  const auto options = terse::communicator_options_from_environment();
  check(!options.secret.empty(), "terse run gave the job no secret");
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> intruders;
  const auto start_time = Clock::now();
  if (rank == 1) {
    int ready[2];
    check(::pipe(ready) == 0, "pipe");
    intruders.push_back(start({self, "intrude", "half-open", std::to_string(ready[1])}));
    intruders.push_back(
        start({"env", "TERSE_JOB_SECRET=not-the-job-secret", self, "intrude", "store"}));
    intruders.push_back(start({"env", "-u", "TERSE_JOB_SECRET", self, "intrude", "store"}));
    ::close(ready[1]);
    char c;
    check(::read(ready[0], &c, 1) == 1, "the half-open intruder did not connect");
    ::close(ready[0]);
  }
  std::shared_ptr<Communicator> comm = Communicator::from_env(options);
  if (rank == 1) {
    std::printf("RENDEZVOUS rank 1 ms=%lld\n",
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_time)
                        .count()));
  }
  float sum = 0;
  {
    terse::Engine engine(comm, terse::engine_options_from_environment());
    std::vector<float> x(1000, static_cast<float>(rank + 1));
    terse::AllreduceOptions o;
    o.codec = "none";
    o.average = false;
    engine.allreduce("x", x, o).wait();
    for (float v : x) check(v == x[0], "the allreduce's result differs between elements");
    sum = x[0];
  }
  // The same store, from the process's cache: every rank waits for rank 1's intruders, so that
  // rank 0 counts them all.
  auto store = terse::bootstrap_from_env(comm->timeout(), options.secret).store;
  if (rank == 1) {
    for (pid_t pid : intruders) {
      int status = 0;
      check(::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "an intruder got in, or failed otherwise");
    }
    const std::byte done[1] = {std::byte{1}};
    store->set("intruders-done", done);
  }
  store->get("intruders-done", std::chrono::seconds(60));
  if (rank == 0) {
    // A refused intruder may have read its verdict before the server counted it.
    auto a = terse::transport::tcp_store_admissions(*store);
    check(a.has_value(), "rank 0 serves no store");
    for (int k = 0; k < 500 && a->refused < 3; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      a = terse::transport::tcp_store_admissions(*store);
    }
    std::printf("STORE admitted=%llu refused=%llu\n", static_cast<unsigned long long>(a->admitted),
                static_cast<unsigned long long>(a->refused));
  }
  comm->barrier();
  std::printf("INTRUDED-OK rank %d sum=%g\n", rank, static_cast<double>(sum));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: transport_worker basic|die VICTIM kill|stop|bandwidth BYTES REPS|share\n");
    return 2;
  }
  const std::string mode = argv[1];
  try {
    if (mode == "intrude" && argc >= 3) {
      return intrude(argv[2], argc >= 4 ? std::atoi(argv[3]) : -1);
    }
    terse::set_process_options(terse::process_options_from_environment());
    if (mode == "join") return join();
    if (mode == "intruded") return intruded();
    auto comm = Communicator::from_env(terse::communicator_options_from_environment());
    if (mode == "basic") return basic(*comm);
    if (mode == "share") return share(*comm);
    if (mode == "again") return again(*comm);
    if (mode == "die" && argc == 4) return die(*comm, std::atoi(argv[2]), argv[3]);
    if (mode == "bandwidth" && argc == 4) {
      return bandwidth(*comm, std::strtoull(argv[2], nullptr, 10), std::atoi(argv[3]));
    }
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    return 1;
  }
}
