// Which ranks of a job share a host: a cluster is hosts of ranks, with a fast path inside a host
// and a slower network between hosts. The hierarchical collectives (collectives/) reduce inside
// each host first and cross the network once per host's shard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace terse {
class Communicator;
}

namespace terse::transport {

struct Topology {
  // The ranks of each host in increasing order; hosts ordered by their lowest rank.
  std::vector<std::vector<int>> hosts;
  // Per rank: its host's index and its index within that host (its local rank).
  std::vector<int> host_of, local_of;
  // Set by agree_direct_reads (transport/direct_read.h); empty otherwise. Per rank: its process
  // id. Per host: 1 where its ranks read each other's memory directly, 0 where they send.
  std::vector<std::int64_t> pid;
  std::vector<char> direct;

  int size() const { return static_cast<int>(host_of.size()); }
  int most_ranks_on_a_host() const;
  // Two levels that differ: several hosts and a host of several ranks. Hierarchical collectives
  // only pay then (one host or one rank a host is the flat collective with extra steps).
  bool two_level() const;
  // Every host holds the same number of ranks.
  bool even() const;
  // Whether host h's ranks read each other's memory directly (see `direct`).
  bool reads_directly(int h) const {
    return h >= 0 && static_cast<std::size_t>(h) < direct.size() && direct[h] != 0;
  }
  // "2 hosts: 0-1 | 2-3" for logs and errors.
  std::string describe() const;
};

// The topology of `size` ranks named by spec (see EngineOptions::topology): "flat" (a host per
// rank), "A,B,..." (ranks per host, hosts of consecutive ranks), or "HxR" (H hosts of R ranks).
// Throws InvalidArgument naming the spec and what is allowed, or a count that does not add up to
// size. "auto" is not a layout: see agree_topology.
Topology topology_from_spec(const std::string& spec, int size);

// The topology of `size` ranks whose hosts are `hosts` (each host's ranks, as Topology::hosts
// and Engine::hosts() give them): for callers that hold an engine's hosts and need its
// host_of. Throws InvalidArgument unless every rank below size is on exactly one host.
Topology topology_of_hosts(std::vector<std::vector<int>> hosts, int size);

// The job's topology, agreed by every rank (a collective: one allgather). With spec "auto", ranks
// share a host when their machine (kit::machine_id), network namespace and `host` name are
// equal; otherwise the spec's layout. Every rank must pass the same spec: a rank whose spec
// differs makes every rank throw MismatchError naming both ranks and their specs. Under "auto",
// with local_ranks > 0 (torchrun's LOCAL_WORLD_SIZE), this rank's host must hold that many ranks
// (MismatchError on every rank otherwise, naming the host and its ranks); a layout given
// explicitly is taken as the user's word.
Topology agree_topology(Communicator& comm, const std::string& spec, const std::string& host,
                        int local_ranks = 0);

}  // namespace terse::transport
