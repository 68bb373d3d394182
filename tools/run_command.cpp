// terse run: the local launcher. Starts N ranks of a program on this host with torchrun's
// environment, prefixes their output by rank, forwards SIGINT/SIGTERM/SIGHUP, and fails as a
// whole when one rank fails (the others get SIGTERM, then SIGKILL after a grace period).
// Binds each rank to its own cores where the ranks divide the cores (kit::binding). Gives the
// job a fresh secret (TERSE_JOB_SECRET) unless the user set one, so that only its ranks get into
// its store and its connections (docs/security.md).
// With --elastic it serves the job's store itself, so that the store outlives every rank, and
// restarts a rank that died (up to --max-restarts times per rank) while the others go on: the
// mode terse.elastic's live recovery runs under.
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "kit/host.h"  // kit::binding: the cores of each rank it starts
#include "terse/communicator.h"
#include "transport/auth.h"  // transport::new_job_secret: the secret of each job it starts

namespace terse::tools {
namespace {

using Clock = std::chrono::steady_clock;

int signal_pipe[2] = {-1, -1};

void on_signal(int signo) {
  const int saved = errno;
  const char c = static_cast<char>(signo);
  [[maybe_unused]] ssize_t r = ::write(signal_pipe[1], &c, 1);
  errno = saved;
}

// A free TCP port for rank 0's store, held for the whole job. The kernel picks it, and this
// socket stays bound (SO_REUSEADDR, never listening) until the launcher exits: rank 0's server,
// which sets SO_REUSEADDR (terse's store and torch's TCPStore both do), can still bind and
// listen on it, while the kernel hands the port to no other socket, not for another bind(0)
// nor as a connection's local port. Released at once (as torchrun does), the port was taken
// in the window before rank 0 bound it by a concurrent job's Gloo listener: seen under ctest
// -j2, where rank 0 failed with "Address already in use" and the other ranks' store requests
// reached the other job's Gloo pair, which failed too.
class PortReservation {
 public:
  PortReservation() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return;
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = 0;
    socklen_t len = sizeof(a);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port_ = ntohs(a.sin_port);
    }
  }
  ~PortReservation() {
    if (fd_ >= 0) ::close(fd_);
  }
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }  // 0 where no port could be bound

 private:
  int fd_ = -1;
  int port_ = 0;
};

void write_all(int fd, const std::string& s) {
  const char* p = s.data();
  std::size_t n = s.size();
  while (n > 0) {
    ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

// One output stream of one rank: complete lines are written with the rank prefix in one
// write(2) each, so lines of different ranks never interleave within a line.
struct Stream {
  int fd = -1;       // read end of the pipe, -1 once closed
  int out = 1;       // where prefixed lines go
  std::string prefix;
  std::string pending;

  void drain(bool eof) {
    std::size_t start = 0;
    while (true) {
      auto nl = pending.find('\n', start);
      if (nl == std::string::npos) break;
      write_all(out, prefix + pending.substr(start, nl - start + 1));
      start = nl + 1;
    }
    pending.erase(0, start);
    if (eof && !pending.empty()) {
      write_all(out, prefix + pending + "\n");
      pending.clear();
    }
  }
};

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  int restarts = 0;  // with --elastic: how often this rank was started again
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return "unknown status";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status) != 0 ? WEXITSTATUS(status) : 1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct Launch {
  int n = 2;
  std::vector<std::string> command;
  double timeout = 0;
  double grace = 5;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string bind = "auto";  // "auto" (kit::binding) or "none"
  bool elastic = false;
  int max_restarts = 0;  // per rank, with elastic
  // The job secret, exported as TERSE_JOB_SECRET: the user's, else one the launcher made.
  std::string secret;
};

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaction(s, &sa, nullptr);
}

// The child's side of fork(): its environment, its cores, then the program. Never returns.
[[noreturn]] void exec_rank(const Launch& opt, int i, int restart, int port,
                            const std::vector<int>& cores, pid_t launcher, const int out[2],
                            const int err[2]) {
  // Each rank leads its own process group, so signals reach its children too and a
  // terminal's Ctrl-C reaches the ranks only through us (once, not twice).
  ::setpgid(0, 0);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaction(s, &dfl, nullptr);
  // A rank outlives no launcher: killed (SIGKILL, or SIGPIPE once the reader of its
  // output is gone, as with `terse run ... | head`), it takes its ranks with it rather than
  // leave them computing (and holding ports and cores) for minutes. The check after
  // prctl catches a launcher that died before it; set after the default dispositions, so
  // that the signal is not caught by the launcher's handler this process inherited.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != launcher) ::_exit(1);
  ::dup2(out[1], 1);
  ::dup2(err[1], 2);
  ::setenv("MASTER_ADDR", opt.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("RANK", std::to_string(i).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(opt.n).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(i).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(opt.n).c_str(), 1);
  ::setenv("GROUP_RANK", "0", 1);
  ::setenv("ROLE_RANK", std::to_string(i).c_str(), 1);
  ::setenv("ROLE_WORLD_SIZE", std::to_string(opt.n).c_str(), 1);
  if (opt.n > 1) ::setenv("OMP_NUM_THREADS", "1", 0);  // as torchrun does
  if (opt.timeout > 0) ::setenv("TERSE_TIMEOUT", fmt::format("{}", opt.timeout).c_str(), 1);
  ::setenv("TERSE_JOB_SECRET", opt.secret.c_str(), 1);
  if (opt.elastic) {
    ::setenv("TERSE_STORE_SERVED", "1", 1);
    ::setenv("TERSE_ELASTIC", "1", 1);
    ::setenv("TERSE_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  }
  if (!cores.empty()) {
    try {
      kit::bind_to(cores);
    } catch (const std::exception& e) {  // the rank still runs, unbound
      write_all(2, fmt::format("terse run: rank {} runs unbound: {}\n", i, e.what()));
    }
  }
  std::vector<char*> argv;
  for (const auto& a : opt.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::string msg = fmt::format("terse run: cannot execute {}: {}\n", argv[0], strerror(errno));
  write_all(2, msg);
  ::_exit(127);
}

// A started job: its ranks, their output streams, and how it is being stopped.
struct Job {
  std::vector<Rank> ranks;
  std::vector<Stream> streams;
  std::chrono::milliseconds grace{0};
  int first_failed = -1;
  int interrupted_by = 0;
  std::optional<Clock::time_point> kill_at;
  std::optional<Clock::time_point> reaped_at;
  bool killed = false;
  // With --elastic: the store the launcher serves, and what restarting a rank needs.
  std::shared_ptr<Store> store;
  const Launch* opt = nullptr;
  int port = 0;
  const std::vector<std::vector<int>>* binding = nullptr;
  int gave_up = -1;  // a rank that failed past its restarts

  void signal_all(int signo) {
    for (auto& r : ranks) {
      if (r.running) ::kill(-r.pid, signo);
    }
  }
};

// Forks rank i (again, after a restart); 0, or the launcher's exit code where a pipe or a fork
// failed.
int start_rank(const Launch& opt, int i, int port, const std::vector<int>& cores, Job& job) {
  const pid_t launcher = ::getpid();  // each rank's parent, checked after PR_SET_PDEATHSIG
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    fmt::print(stderr, "terse run: pipe: {}\n", strerror(errno));
    return 1;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid < 0) {
    fmt::print(stderr, "terse run: fork: {}\n", strerror(errno));
    return 1;
  }
  if (pid == 0) exec_rank(opt, i, job.ranks[i].restarts, port, cores, launcher, out, err);
  ::setpgid(pid, pid);
  ::close(out[1]);
  ::close(err[1]);
  job.ranks[i].pid = pid;
  job.ranks[i].running = true;
  job.streams.push_back(Stream{out[0], 1, fmt::format("[rank {}] ", i), {}});
  job.streams.push_back(Stream{err[0], 2, fmt::format("[rank {}] ", i), {}});
  return 0;
}

// Forks the N ranks; 0, or the launcher's exit code where a pipe or a fork failed.
int start_ranks(const Launch& opt, int port, const std::vector<std::vector<int>>& binding,
                Job& job) {
  job.ranks.resize(opt.n);
  job.streams.reserve(2 * opt.n);
  std::fflush(stdout);
  std::fflush(stderr);

  for (int i = 0; i < opt.n; ++i) {
    if (const int code = start_rank(opt, i, port, binding[i], job); code != 0) return code;
  }
  return 0;
}

// Forwards the signals the launcher got (read from the self-pipe) to every rank.
void forward_signals(Job& job) {
  char sigs[64];
  ssize_t got = ::read(signal_pipe[0], sigs, sizeof(sigs));
  for (ssize_t k = 0; k < got; ++k) {
    const int signo = sigs[k];
    if (signo == SIGCHLD) continue;  // reaped below in every iteration
    if (job.interrupted_by == 0) job.interrupted_by = signo;
    fmt::print(stderr, "terse run: got signal {}, forwarding it to the ranks\n", signo);
    job.signal_all(signo);
    if (!job.kill_at) job.kill_at = Clock::now() + job.grace;
  }
}

// Reads what each ready stream has and writes out its complete lines; closes it at EOF.
void pump_streams(const std::vector<pollfd>& fds, const std::vector<Stream*>& polled) {
  for (std::size_t k = 0; k < polled.size(); ++k) {
    if (!(fds[k + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Stream& s = *polled[k];
    char buf[65536];
    ssize_t r = ::read(s.fd, buf, sizeof(buf));
    if (r > 0) {
      s.pending.append(buf, static_cast<std::size_t>(r));
      s.drain(false);
    } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
      s.drain(true);
      ::close(s.fd);
      s.fd = -1;
    }
  }
}

// --elastic: a rank failed. Its death is recorded in the store (terse.elastic's members stop
// waiting for it at once), then it starts again with TERSE_RESTART_COUNT one higher, or, past
// --max-restarts, the others go on without it and the job's exit code reports it at the end.
void restart_or_give_up(Job& job, int i) {
  Rank& rank = job.ranks[i];
  try {
    job.store->add(fmt::format("terse-elastic/dead/{}/{}", i, rank.restarts), 1);
  } catch (const std::exception& e) {
    fmt::print(stderr, "terse run: cannot record rank {}'s death in the store: {}\n", i,
               e.what());
  }
  if (rank.restarts >= job.opt->max_restarts) {
    fmt::print(stderr, "terse run: rank {} failed ({}) after {} restarts; the others go on\n", i,
               describe_status(rank.status), rank.restarts);
    if (job.gave_up < 0) job.gave_up = i;
    return;
  }
  ++rank.restarts;
  fmt::print(stderr, "terse run: rank {} failed ({}); starting it again (restart {} of {})\n",
             i, describe_status(rank.status), rank.restarts, job.opt->max_restarts);
  if (start_rank(*job.opt, i, job.port, (*job.binding)[i], job) != 0 && job.gave_up < 0) {
    job.gave_up = i;
  }
}

// Reaps the ranks that ended; the first one that failed stops the others.
void reap_ranks(Job& job) {
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    for (std::size_t i = 0; i < job.ranks.size(); ++i) {
      Rank& rank = job.ranks[i];
      if (rank.pid != pid) continue;
      rank.running = false;
      rank.status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && job.store && job.interrupted_by == 0) {
        restart_or_give_up(job, static_cast<int>(i));
        continue;
      }
      if (!ok && job.first_failed < 0 && job.interrupted_by == 0) {
        job.first_failed = static_cast<int>(i);
        fmt::print(stderr, "terse run: rank {} failed ({}); stopping the other ranks\n", i,
                   describe_status(status));
        job.signal_all(SIGTERM);
        job.signal_all(SIGCONT);  // a stopped rank only sees SIGTERM once it runs again
        job.kill_at = Clock::now() + job.grace;
      }
    }
  }
}

// Runs until every rank has ended and their output is written (or a straggler's pipe has
// been waited on long enough).
void supervise(Job& job) {
  while (true) {
    int running = 0;
    for (auto& r : job.ranks) running += r.running ? 1 : 0;
    bool open_streams = false;
    for (auto& s : job.streams) open_streams |= s.fd >= 0;
    if (running == 0) {
      if (!job.reaped_at) job.reaped_at = Clock::now();
      // A rank's own children may keep a pipe open; do not wait for them for long.
      if (!open_streams || Clock::now() - *job.reaped_at > std::chrono::seconds(2)) break;
    }
    if (job.kill_at && !job.killed && Clock::now() >= *job.kill_at) {
      job.signal_all(SIGKILL);
      job.killed = true;
    }

    std::vector<pollfd> fds;
    fds.push_back({signal_pipe[0], POLLIN, 0});
    std::vector<Stream*> polled;
    for (auto& s : job.streams) {
      if (s.fd >= 0) {
        fds.push_back({s.fd, POLLIN, 0});
        polled.push_back(&s);
      }
    }
    ::poll(fds.data(), fds.size(), 100);

    if (fds[0].revents & POLLIN) forward_signals(job);
    pump_streams(fds, polled);
    reap_ranks(job);
  }
  for (auto& s : job.streams) {
    if (s.fd >= 0) {
      s.drain(true);
      ::close(s.fd);
    }
  }
}

int run(Launch opt) {
  if (opt.n < 1) {
    fmt::print(stderr, "terse run: -n must be at least 1\n");
    return 2;
  }
  if (opt.command.empty()) {
    fmt::print(stderr, "terse run: no program given (terse run -n N -- PROGRAM ARGS...)\n");
    return 2;
  }
  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return 1;
  install_signal_handlers();

  if (opt.bind != "auto" && opt.bind != "none") {
    fmt::print(stderr, "terse run: --bind must be auto or none, not {}\n", opt.bind);
    return 2;
  }
  const std::vector<int> cpus = kit::allowed_cpus();
  std::vector<std::vector<int>> binding(opt.n);
  if (opt.bind == "auto") {
    for (int i = 0; i < opt.n; ++i) binding[i] = kit::binding(i, opt.n, cpus);
  }

  std::optional<PortReservation> reserved;
  if (opt.master_port <= 0) reserved.emplace();
  const int port = opt.master_port > 0 ? opt.master_port : reserved->port();
  if (port <= 0) {
    fmt::print(stderr, "terse run: no free TCP port for rank 0's store: {}\n", strerror(errno));
    return 1;
  }
  // One secret per job, never printed: the ranks learn it from their environment only, and
  // the store the launcher serves (--elastic) takes it too.
  if (const char* given = std::getenv("TERSE_JOB_SECRET"); given != nullptr && *given != '\0') {
    opt.secret = given;
  } else {
    try {
      opt.secret = transport::new_job_secret();
    } catch (const std::exception& e) {
      fmt::print(stderr, "terse run: cannot make the job's secret: {}\n", e.what());
      return 1;
    }
  }
  Job job;
  job.grace = std::chrono::milliseconds(static_cast<long>(opt.grace * 1000));
  job.opt = &opt;
  job.port = port;
  job.binding = &binding;
  if (opt.elastic) {
    try {
      job.store = make_tcp_store(
          opt.master_addr, port, true,
          std::chrono::milliseconds(static_cast<long>((opt.timeout > 0 ? opt.timeout : 60) * 1000)),
          opt.secret);
    } catch (const std::exception& e) {
      fmt::print(stderr, "terse run: cannot serve the job's store on port {}: {}\n", port,
                 e.what());
      return 1;
    }
  } else if (opt.max_restarts > 0) {
    fmt::print(stderr, "terse run: --max-restarts needs --elastic\n");
    return 2;
  }
  if (const int code = start_ranks(opt, port, binding, job); code != 0) return code;
  supervise(job);
  if (job.gave_up >= 0 && job.interrupted_by == 0) {
    fmt::print(stderr, "terse run: failed: rank {} {} (after {} restarts)\n", job.gave_up,
               describe_status(job.ranks[job.gave_up].status), job.ranks[job.gave_up].restarts);
    return exit_code_of(job.ranks[job.gave_up].status);
  }
  if (job.first_failed >= 0) {
    fmt::print(stderr, "terse run: failed: rank {} {}\n", job.first_failed,
               describe_status(job.ranks[job.first_failed].status));
    return exit_code_of(job.ranks[job.first_failed].status);
  }
  if (job.interrupted_by != 0) return 128 + job.interrupted_by;
  return 0;
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto opt = std::make_shared<Launch>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Start N local ranks of a program with torchrun's environment (MASTER_ADDR, MASTER_PORT, "
      "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and a fresh TERSE_JOB_SECRET (unless one "
      "is set): terse run -n N -- PROGRAM ARGS...");
  cmd->add_option("-n,--nproc", opt->n, "Number of ranks")->required();
  cmd->add_option("--timeout", opt->timeout,
                  "Communication timeout in seconds, passed to the ranks as TERSE_TIMEOUT");
  cmd->add_option("--grace", opt->grace,
                  "Seconds between SIGTERM and SIGKILL when stopping the ranks")
      ->capture_default_str();
  cmd->add_option("--master-addr", opt->master_addr, "MASTER_ADDR for the ranks")
      ->capture_default_str();
  cmd->add_option("--master-port", opt->master_port, "MASTER_PORT (default: a free port)");
  if (const char* env = std::getenv("TERSE_BIND"); env != nullptr && *env != '\0') opt->bind = env;
  cmd->add_option("--bind", opt->bind,
                  "auto: each rank on its own block of cores where the ranks divide the cores "
                  "(else unbound); none: leave placement to the kernel (default: TERSE_BIND, "
                  "else auto)")
      ->capture_default_str();
  cmd->add_flag("--elastic", opt->elastic,
                 "Serve the job's store from the launcher (it outlives every rank) and restart "
                 "a rank that fails while the others go on (terse.elastic's live recovery)");
  cmd->add_option("--max-restarts", opt->max_restarts,
                  "With --elastic: how often each rank may be started again")
      ->capture_default_str();
  cmd->add_option("program", opt->command, "PROGRAM ARGS... (after --)")->expected(-1);
  cmd->prefix_command();
  cmd->callback([opt, cmd] {
    // Without "--", parsing stops at the program and its own options arrive as leftovers;
    // with it, CLI11 files the "--" itself among the leftovers.
    bool separator_seen = false;
    for (auto& extra : cmd->remaining()) {
      if (extra == "--" && !separator_seen) {
        separator_seen = true;
        continue;
      }
      opt->command.push_back(extra);
    }
    const int code = run(*opt);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace terse::tools
