#include "kit/host.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kit/hash.h"
#include "terse/error.h"

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

}  // namespace terse::kit
