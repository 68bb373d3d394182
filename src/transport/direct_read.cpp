#include "transport/direct_read.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include "kit/host.h"
#include "terse/communicator.h"
#include "terse/error.h"

namespace terse::transport {

namespace {

// Read by the other ranks of the host to show that reading works; its value is sent with its
// address, so that a read of another process (another PID namespace) is not taken for it.
const std::uint64_t& probe_word() {
  static const std::uint64_t word = [] {
    std::random_device device;
    return (static_cast<std::uint64_t>(device()) << 32 | device()) | 1;
  }();
  return word;
}

std::uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

struct Offer {
  std::int64_t pid = 0;
  std::uint64_t machine = 0, pid_ns = 0;
  std::uint64_t address = 0, value = 0;
  std::int64_t wants = 0;  // mode "auto"
};

}  // namespace

std::string read_process(std::int64_t pid, std::uint64_t address, std::span<std::byte> dst) {
  std::size_t done = 0;
  while (done < dst.size()) {
    const iovec local{dst.data() + done, dst.size() - done};
    const iovec remote{reinterpret_cast<void*>(address + done), dst.size() - done};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return fmt::format("process {}: {}", pid,
                         got < 0 ? std::strerror(errno) : "read nothing");
    }
    done += static_cast<std::size_t>(got);
  }
  return {};
}

void agree_direct_reads(Communicator& comm, Topology& t, const std::string& mode) {
  if (mode != "auto" && mode != "tcp") {
    throw InvalidArgument(fmt::format(
        "intra_host '{}' (TERSE_INTRA_HOST): allowed: auto (ranks of a host read each other's "
        "memory where they can), tcp (messages through the host's network stack)",
        mode));
  }
  const int n = comm.size(), me = comm.rank();
  t.pid.assign(static_cast<std::size_t>(n), 0);
  t.direct.assign(t.hosts.size(), 0);
  if (n == 1 || t.most_ranks_on_a_host() < 2) return;

  Offer mine;
  mine.pid = ::getpid();
  mine.machine = kit::machine_id();
  mine.pid_ns = pid_namespace();
  mine.address = reinterpret_cast<std::uint64_t>(&probe_word());
  mine.value = probe_word();
  mine.wants = mode == "auto" ? 1 : 0;
  std::vector<Offer> all(static_cast<std::size_t>(n));
  std::vector<std::size_t> sizes(static_cast<std::size_t>(n), sizeof(Offer));
  comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)), sizes,
                  "intra-host reads");

  // Whether this rank can read every other rank of its host.
  std::int64_t ok = mine.wants;
  for (const int j : t.hosts[static_cast<std::size_t>(t.host_of[me])]) {
    const Offer& o = all[static_cast<std::size_t>(j)];
    if (j == me || ok == 0) continue;
    std::uint64_t got = 0;
    ok = o.wants != 0 && o.machine == mine.machine && o.pid_ns == mine.pid_ns &&
         read_process(o.pid, o.address, std::as_writable_bytes(std::span(&got, 1))).empty() &&
         got == o.value;
  }
  std::vector<std::int64_t> oks(static_cast<std::size_t>(n));
  std::vector<std::size_t> small(static_cast<std::size_t>(n), sizeof(std::int64_t));
  comm.allgatherv(std::as_bytes(std::span(&ok, 1)), std::as_writable_bytes(std::span(oks)), small,
                  "intra-host reads");
  for (std::size_t h = 0; h < t.hosts.size(); ++h) {
    bool all_ok = t.hosts[h].size() > 1;
    for (const int j : t.hosts[h]) all_ok = all_ok && oks[static_cast<std::size_t>(j)] != 0;
    t.direct[h] = all_ok ? 1 : 0;
  }
  for (int j = 0; j < n; ++j) t.pid[static_cast<std::size_t>(j)] = all[static_cast<std::size_t>(j)].pid;
}

}  // namespace terse::transport
