// Inside a host, ranks can read each other's memory directly (Linux cross-memory attach,
// process_vm_readv): one copy, made by the reader, where a message through the host's TCP
// stack costs a copy on each side and the stack's work. The hierarchical collectives' phases
// inside a host use it where every rank of the host can (collectives/, direct_pids), and fall
// back to messages otherwise; the small messages that say where the bytes are and when they
// were read still go through the communicator, with its timeouts.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "transport/topology.h"

namespace terse::transport {

// Reads dst.size() bytes at `address` of process `pid` into dst. Returns an empty string, or
// what failed ("process 123: No such process").
std::string read_process(std::int64_t pid, std::uint64_t address, std::span<std::byte> dst);

// Decides with every rank which hosts' ranks read each other's memory, and sets t.pid and
// t.direct. A collective (two small allgathers) where some host holds several ranks; nothing
// otherwise. A host reads directly when every one of its ranks asks for it (`mode` "auto";
// "tcp" declines) and read a probe word from every other rank of the host (same machine and
// PID namespace, and the kernel allows it: same user, no seccomp or Yama rule against it), so
// every rank of the job reaches the same decision. Throws InvalidArgument for another mode.
void agree_direct_reads(Communicator& comm, Topology& t, const std::string& mode);

}  // namespace terse::transport
