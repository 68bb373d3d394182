#include "transport/topology.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>

#include "kit/hash.h"
#include "kit/host.h"
#include "terse/communicator.h"
#include "terse/error.h"

namespace terse::transport {

namespace {

constexpr const char* kAllowed =
    "allowed: auto, flat, ranks per host as A,B,... (hosts of consecutive ranks) or HxR (H hosts "
    "of R ranks)";

Topology from_hosts(std::vector<std::vector<int>> hosts, int size) {
  Topology t;
  t.hosts = std::move(hosts);
  t.host_of.assign(size, -1);
  t.local_of.assign(size, -1);
  for (std::size_t h = 0; h < t.hosts.size(); ++h) {
    for (std::size_t l = 0; l < t.hosts[h].size(); ++l) {
      t.host_of[t.hosts[h][l]] = static_cast<int>(h);
      t.local_of[t.hosts[h][l]] = static_cast<int>(l);
    }
  }
  return t;
}

bool parse_count(std::string_view s, int& out) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size() && out >= 1;
}

// The network namespace this process runs in ("net:[4026531992]"): emulated hosts on one
// machine are namespaces of their own, and ranks of one namespace share its stack.
std::string network_namespace() {
  char buf[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

// What each rank tells the others: its host key, its spec (digest and text, cut for messages),
// and the ranks its launcher says its host holds.
struct Row {
  std::uint64_t key = 0;
  std::uint64_t spec_digest = 0;
  std::int64_t local_ranks = 0;
  std::array<char, 48> spec{};
};

}  // namespace

int Topology::most_ranks_on_a_host() const {
  std::size_t m = 0;
  for (const auto& h : hosts) m = std::max(m, h.size());
  return static_cast<int>(m);
}

bool Topology::two_level() const {
  return hosts.size() > 1 && most_ranks_on_a_host() > 1;
}

bool Topology::even() const {
  for (const auto& h : hosts) {
    if (h.size() != hosts.front().size()) return false;
  }
  return true;
}

std::string Topology::describe() const {
  std::string out = fmt::format("{} host{}:", hosts.size(), hosts.size() == 1 ? "" : "s");
  for (std::size_t h = 0; h < hosts.size(); ++h) {
    out += h == 0 ? " " : " | ";
    const auto& r = hosts[h];
    const bool consecutive = r.back() - r.front() + 1 == static_cast<int>(r.size());
    if (r.size() == 1) {
      out += std::to_string(r[0]);
    } else if (consecutive) {
      out += fmt::format("{}-{}", r.front(), r.back());
    } else {
      out += fmt::format("{}", fmt::join(r, ","));
    }
  }
  return out;
}

Topology topology_from_spec(const std::string& spec, int size) {
  std::vector<int> counts;
  if (spec == "flat") {
    counts.assign(static_cast<std::size_t>(size), 1);
  } else if (const auto x = spec.find('x'); x != std::string::npos) {
    int h = 0, r = 0;
    if (!parse_count(std::string_view(spec).substr(0, x), h) ||
        !parse_count(std::string_view(spec).substr(x + 1), r)) {
      throw InvalidArgument(fmt::format("topology '{}' is not valid; {}", spec, kAllowed));
    }
    counts.assign(static_cast<std::size_t>(h), r);
  } else {
    std::string_view rest = spec;
    while (true) {
      const auto comma = rest.find(',');
      int c = 0;
      if (!parse_count(rest.substr(0, comma), c)) {
        throw InvalidArgument(fmt::format("topology '{}' is not valid; {}", spec, kAllowed));
      }
      counts.push_back(c);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  long total = 0;
  for (int c : counts) total += c;
  if (total != size) {
    throw InvalidArgument(fmt::format("topology '{}' places {} ranks, but the job has {}", spec,
                                      total, size));
  }
  std::vector<std::vector<int>> hosts;
  int next = 0;
  for (int c : counts) {
    hosts.emplace_back();
    for (int i = 0; i < c; ++i) hosts.back().push_back(next++);
  }
  return from_hosts(std::move(hosts), size);
}

Topology topology_of_hosts(std::vector<std::vector<int>> hosts, int size) {
  std::vector<int> seen(static_cast<std::size_t>(std::max(size, 0)), 0);
  for (const auto& h : hosts) {
    for (int r : h) {
      if (r < 0 || r >= size || seen[r]++ > 0) {
        throw InvalidArgument(
            fmt::format("hosts place rank {} twice or outside 0..{}", r, size - 1));
      }
    }
    if (h.empty()) throw InvalidArgument("hosts: a host of no ranks");
  }
  if (std::find(seen.begin(), seen.end(), 0) != seen.end()) {
    throw InvalidArgument(fmt::format("hosts do not place all {} ranks", size));
  }
  for (auto& h : hosts) std::sort(h.begin(), h.end());
  std::sort(hosts.begin(), hosts.end());  // ordered by their lowest rank, as agree_topology does
  return from_hosts(std::move(hosts), size);
}

Topology agree_topology(Communicator& comm, const std::string& spec, const std::string& host,
                        int local_ranks) {
  const int n = comm.size(), r = comm.rank();
  // A bad layout fails here, before the exchange, on every rank that gave it; a rank that gave
  // another spec fails below.
  if (spec != "auto") (void)topology_from_spec(spec, n);
  Row mine;
  mine.key = kit::fnv1a64(fmt::format("{:016x}|{}|{}", kit::machine_id(), network_namespace(), host));
  mine.spec_digest = kit::fnv1a64(spec);
  mine.local_ranks = local_ranks;
  std::memcpy(mine.spec.data(), spec.data(), std::min(spec.size(), mine.spec.size() - 1));
  std::vector<Row> all(static_cast<std::size_t>(n));
  if (n > 1) {
    std::vector<std::size_t> sizes(static_cast<std::size_t>(n), sizeof(Row));
    comm.allgatherv(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)),
                    sizes, "topology");
  } else {
    all[0] = mine;
  }
  for (int i = 0; i < n; ++i) {
    if (all[i].spec_digest != all[0].spec_digest) {
      throw MismatchError(fmt::format(
          "rank {}: the ranks disagree on the topology: rank 0 gives '{}', rank {} gives '{}' "
          "(every rank must give the same TERSE_TOPOLOGY / EngineOptions::topology)",
          r, all[0].spec.data(), i, all[i].spec.data()));
    }
  }
  Topology t;
  if (spec == "auto") {
    std::map<std::uint64_t, int> host_index;  // key -> host, in order of the hosts' first rank
    std::vector<std::vector<int>> hosts;
    for (int i = 0; i < n; ++i) {
      const auto [it, fresh] = host_index.emplace(all[i].key, static_cast<int>(hosts.size()));
      if (fresh) hosts.emplace_back();
      hosts[it->second].push_back(i);
    }
    t = from_hosts(std::move(hosts), n);
  } else {
    t = topology_from_spec(spec, n);
  }
  for (int i = 0; i < n && spec == "auto"; ++i) {
    const auto& h = t.hosts[t.host_of[i]];
    if (all[i].local_ranks > 0 && all[i].local_ranks != static_cast<std::int64_t>(h.size())) {
      throw MismatchError(fmt::format(
          "rank {}: rank {}'s launcher says its host has {} ranks (LOCAL_WORLD_SIZE), but the "
          "topology ({}) puts it on host {} with {} (ranks {}); set TERSE_TOPOLOGY or TERSE_HOST "
          "to say which ranks share a host",
          r, i, all[i].local_ranks, spec, t.host_of[i], h.size(), fmt::join(h, ",")));
    }
  }
  return t;
}

}  // namespace terse::transport
