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

// How many ranks of `comm` run on this rank's machine, itself included. Collective: every rank
// calls it (one allgather of the machine ids).
int ranks_on_host(Communicator& comm);

}  // namespace terse::kit
