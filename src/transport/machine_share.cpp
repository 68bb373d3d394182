#include "transport/machine_share.h"

#include <sched.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "kit/host.h"
#include "terse/communicator.h"

namespace terse::transport {

MachineShare machine_share(Communicator& comm) {
  MachineShare out;
  out.cores = kit::usable_cores();
  const int n = comm.size();
  if (n <= 1) {
    out.cores_per_rank = out.fewest_cores = out.cores;
    return out;
  }
  // Each rank's machine id, then its affinity mask (CPUs 0 to 1023 in 16 words).
  constexpr std::size_t kWords = 1 + CPU_SETSIZE / 64;
  using Row = std::array<std::uint64_t, kWords>;
  Row mine{};
  mine[0] = kit::machine_id();
  for (int c : kit::allowed_cpus()) mine[1 + c / 64] |= std::uint64_t{1} << (c % 64);
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

}  // namespace terse::transport
