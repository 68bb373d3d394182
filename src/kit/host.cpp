#include "kit/host.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "terse/communicator.h"
#include "terse/error.h"
#include "terse/spec.h"

namespace terse::kit {

int usable_cores() { return static_cast<int>(allowed_cpus().size()); }

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) {
    const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int c = 0; c < n; ++c) cpus.push_back(c);
  }
  return cpus;
}

std::vector<int> binding(int rank, int ranks, const std::vector<int>& cpus) {
  const int n = static_cast<int>(cpus.size());
  if (ranks <= 1 || n <= 1 || rank < 0 || rank >= ranks) return {};
  if (n % ranks == 0) {
    const int block = n / ranks;
    return {cpus.begin() + rank * block, cpus.begin() + (rank + 1) * block};
  }
  return {};
}

void bind_to(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) throw Error(fmt::format("cannot bind to CPU {}", c));
    CPU_SET(c, &set);
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    throw Error(
        fmt::format("cannot bind to CPUs {}: {}", fmt::join(cpus, ","), std::strerror(errno)));
  }
}

std::uint64_t machine_id() {
  std::string text;
  for (const char* path : {"/etc/machine-id", "/proc/sys/kernel/random/boot_id"}) {
    std::ifstream f(path);
    std::string line;
    if (std::getline(f, line)) text += line;
  }
  if (text.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    text = host;
  }
  return fnv1a64(text);
}

MachineShare machine_share(Communicator& comm) {
  MachineShare out;
  out.cores = usable_cores();
  const int n = comm.size();
  if (n <= 1) {
    out.cores_per_rank = out.fewest_cores = out.cores;
    return out;
  }
  // Each rank's machine id, then its affinity mask (CPUs 0 to 1023 in 16 words).
  constexpr std::size_t kWords = 1 + CPU_SETSIZE / 64;
  using Row = std::array<std::uint64_t, kWords>;
  Row mine{};
  mine[0] = machine_id();
  for (int c : allowed_cpus()) mine[1 + c / 64] |= std::uint64_t{1} << (c % 64);
  std::vector<Row> all(n);
  std::vector<std::size_t> sizes(n, sizeof(mine));
  comm.allgatherv(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)), sizes,
                  "machine share");
  auto ranks_on = [&](std::uint64_t id) {
    return static_cast<int>(
        std::count_if(all.begin(), all.end(), [&](const Row& r) { return r[0] == id; }));
  };
  auto cores_of = [](const Row& mask) {  // mask's CPUs, at least 1
    int count = 0;
    for (std::size_t w = 1; w < kWords; ++w) count += std::popcount(mask[w]);
    return std::max(1, count);
  };
  auto machine_cores = [&](std::uint64_t id) {  // the union of its ranks' masks
    Row u{};
    for (const Row& r : all) {
      if (r[0] != id) continue;
      for (std::size_t w = 1; w < kWords; ++w) u[w] |= r[w];
    }
    return cores_of(u);
  };
  out.ranks_on_host = ranks_on(mine[0]);
  out.cores_per_rank = out.fewest_cores = machine_cores(mine[0]);
  for (const Row& r : all) {
    const int machine = machine_cores(r[0]), ranks = ranks_on(r[0]);
    out.cores_per_rank =
        std::min(out.cores_per_rank, std::max(1, std::min(cores_of(r), machine / ranks)));
    out.most_ranks_on_host = std::max(out.most_ranks_on_host, ranks);
    out.fewest_cores = std::min(out.fewest_cores, machine);
  }
  return out;
}

}  // namespace terse::kit
