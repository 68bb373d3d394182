// Agreement across ranks (exchange.h): every rank's figures gathered, their median or largest.
#include <algorithm>

#include "planner/exchange.h"

namespace terse::planner {

std::vector<std::vector<double>> gather(Communicator& comm, std::span<const double> mine) {
  const int n = comm.size();
  std::vector<double> all(mine.size() * n);
  std::vector<std::size_t> sizes(n, mine.size_bytes());
  comm.allgatherv(std::as_bytes(mine), std::as_writable_bytes(std::span(all)), sizes, "planner");
  std::vector<std::vector<double>> out(n);
  for (int i = 0; i < n; ++i) {
    out[i].assign(all.begin() + i * mine.size(), all.begin() + (i + 1) * mine.size());
  }
  return out;
}

std::vector<double> agree_median(Communicator& comm, std::vector<double> mine) {
  const auto all = gather(comm, mine);
  std::vector<double> column(all.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    for (std::size_t r = 0; r < all.size(); ++r) column[r] = all[r][i];
    std::sort(column.begin(), column.end());
    const std::size_t h = column.size() / 2;
    mine[i] = column.size() % 2 == 1 ? column[h] : (column[h - 1] + column[h]) / 2;
  }
  return mine;
}

std::vector<double> agree_max(Communicator& comm, std::vector<double> mine) {
  for (const auto& other : gather(comm, mine)) {
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = std::max(mine[i], other[i]);
  }
  return mine;
}

std::vector<std::string> gather_text(Communicator& comm, const std::string& mine) {
  const double length = static_cast<double>(mine.size());
  const auto lengths = gather(comm, std::span(&length, 1));
  std::vector<std::size_t> sizes;
  std::size_t total = 0;
  for (const auto& l : lengths) {
    sizes.push_back(static_cast<std::size_t>(l[0]));
    total += sizes.back();
  }
  std::string all(total, '\0');
  comm.allgatherv(std::as_bytes(std::span(mine.data(), mine.size())),
                  std::as_writable_bytes(std::span(all.data(), all.size())), sizes, "planner");
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t s : sizes) {
    out.push_back(all.substr(at, s));
    at += s;
  }
  return out;
}

}  // namespace terse::planner
