#include "kit/host.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "terse/communicator.h"
#include "terse/spec.h"

namespace terse::kit {

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
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

int ranks_on_host(Communicator& comm) {
  const int n = comm.size();
  if (n <= 1) return 1;
  const std::uint64_t mine = machine_id();
  std::vector<std::uint64_t> all(n);
  std::vector<std::size_t> sizes(n, sizeof(mine));
  comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)), sizes,
                  "ranks on host");
  return static_cast<int>(std::count(all.begin(), all.end(), mine));
}

}  // namespace terse::kit
