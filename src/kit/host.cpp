#include "kit/host.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
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

MachineShare machine_share(Communicator& comm) {
  MachineShare out;
  out.cores = usable_cores();
  const int n = comm.size();
  if (n <= 1) {
    out.cores_per_rank = out.fewest_cores = out.cores;
    return out;
  }
  const std::array<std::uint64_t, 2> mine = {machine_id(), static_cast<std::uint64_t>(out.cores)};
  std::vector<std::array<std::uint64_t, 2>> all(n);
  std::vector<std::size_t> sizes(n, sizeof(mine));
  comm.allgatherv(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)), sizes,
                  "machine share");
  auto ranks_on = [&](std::uint64_t id) {
    return static_cast<int>(
        std::count_if(all.begin(), all.end(), [&](const auto& r) { return r[0] == id; }));
  };
  out.ranks_on_host = ranks_on(mine[0]);
  out.cores_per_rank = out.fewest_cores = out.cores;
  for (const auto& r : all) {
    const int cores = static_cast<int>(r[1]), ranks = ranks_on(r[0]);
    out.cores_per_rank = std::min(out.cores_per_rank, std::max(1, cores / ranks));
    out.most_ranks_on_host = std::max(out.most_ranks_on_host, ranks);
    out.fewest_cores = std::min(out.fewest_cores, cores);
  }
  return out;
}

}  // namespace terse::kit
