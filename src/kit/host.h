// The machine a process runs on: its cores and its identity. How many ranks of a job share it
// is transport/machine_share.h (it takes a Communicator).
#pragma once

#include <cstdint>
#include <vector>

namespace terse::kit {

// Cores this process may run on (its affinity mask), at least 1.
int usable_cores();

// The CPUs of this process's affinity mask, in increasing order (never empty).
std::vector<int> allowed_cpus();

// Where a launcher binds local rank `rank` of `ranks` given the CPUs it may use, as Open MPI's
// "bind to core" does: with ranks dividing the CPUs, each rank gets its own block of
// cpus.size() / ranks consecutive ones. Empty (no binding) otherwise: for one rank, for more
// ranks than CPUs (Open MPI does not bind an oversubscribed job either: pinned 2 to a core, 4
// ranks on 2 cores measured their links at 1.8-2.0 ns a byte against 1.0-1.4 unbound, and
// the planner's predictions drifted; docs/planner.md), and for counts that do not divide (a
// fixed map would give some cores more work than others, and a collective runs at its slowest
// rank's pace). Bound, a rank's threads stop migrating between cores and its messages'
// wake-ups stay on one core: on 2 cores, a 1 MiB allreduce between 2 ranks took 0.54-0.69 ms
// bound against 0.65-1.13 ms unbound (docs/design.md).
std::vector<int> binding(int rank, int ranks, const std::vector<int>& cpus);

// Restricts this process to `cpus` (threads it starts later inherit it); throws terse::Error.
void bind_to(const std::vector<int>& cpus);

// Identifies the machine (not the network namespace): ranks with equal ids share its cores.
// From /etc/machine-id and the boot id, else the host name.
std::uint64_t machine_id();

}  // namespace terse::kit
