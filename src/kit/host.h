// The machine a rank runs on: its cores, its identity, and how many ranks of the job share it.
#pragma once

#include <cstdint>

namespace terse {
class Communicator;
}

namespace terse::kit {

// Cores this process may run on (its affinity mask), at least 1.
int usable_cores();

// Identifies the machine (not the network namespace): ranks with equal ids share its cores.
// From /etc/machine-id and the boot id, else the host name.
std::uint64_t machine_id();

// How the job's ranks share their machines. Collective: every rank calls it (one allgather of
// each rank's machine id and usable cores).
struct MachineShare {
  int ranks_on_host = 1;   // ranks of the job on this rank's machine, itself included
  int cores = 1;           // this rank's usable cores
  int cores_per_rank = 1;  // the least, over every rank, of max(1, its cores / its machine's
                           // ranks): the same figure on every rank
  // Over every rank (the same on every rank): the most ranks on one machine, the fewest cores.
  int most_ranks_on_host = 1;
  int fewest_cores = 1;
};
MachineShare machine_share(Communicator& comm);

}  // namespace terse::kit
