#include "units.h"

#include <fmt/format.h>

#include <stdexcept>

#include "terse/error.h"

namespace terse::tools {

std::size_t parse_size(const std::string& text, const std::string& option) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw InvalidArgument(
        fmt::format("{} '{}' is not a size such as 100MB or 64MiB", option, text));
  }
  const std::string unit = text.substr(pos);
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  if (unit == "KB" || unit == "kB") scale = 1e3;
  if (unit == "MB") scale = 1e6;
  if (unit == "GB") scale = 1e9;
  if (unit == "KiB") scale = 1024;
  if (unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (scale == 0 || !(v >= 0)) {
    throw InvalidArgument(
        fmt::format("{} '{}': unknown unit (use B, KB, MB, GB, KiB, MiB, GiB)", option, text));
  }
  return static_cast<std::size_t>(v * scale);
}

double parse_rate(const std::string& text, const std::string& option) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = std::string::npos;
  }
  const std::string unit = pos == std::string::npos ? "" : text.substr(pos);
  if (unit == "gbit") return v * 1e9;
  if (unit == "mbit") return v * 1e6;
  if (unit == "kbit") return v * 1e3;
  throw InvalidArgument(
      fmt::format("{} '{}': use a tc rate such as 100mbit or 1gbit", option, text));
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return bytes == static_cast<long long>(bytes) ? fmt::format("{}{}", bytes, units[u])
                                                : fmt::format("{:.1f}{}", bytes, units[u]);
}

}  // namespace terse::tools
