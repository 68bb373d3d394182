// How the ranks of a job share their machines: which ranks run on one machine and how many cores
// each may count on (the engine sizes its BLAS threads by it; the calibration records it).
#pragma once

namespace terse {
class Communicator;
}

namespace terse::transport {

// How the job's ranks share their machines. Collective: every rank calls it (one allgather of
// each rank's machine id and usable cores).
// A machine's cores are the union of its ranks' affinity masks: ranks bound to one core each
// (`terse run`'s binding) share all of them between them, as unbound ranks do.
struct MachineShare {
  int ranks_on_host = 1;   // ranks of the job on this rank's machine, itself included
  int cores = 1;           // this rank's usable cores
  int cores_per_rank = 1;  // the least, over every rank, of max(1, min(its cores, its
                           // machine's cores / its machine's ranks)): the same on every rank
  // Over every machine (the same on every rank): the most ranks on one, the fewest cores.
  int most_ranks_on_host = 1;
  int fewest_cores = 1;
};
MachineShare machine_share(Communicator& comm);

}  // namespace terse::transport
