// Sizes and link rates as people write them on the command line.
#pragma once

#include <cstddef>
#include <string>

namespace terse::tools {

// "100MB", "64MiB", "1e6" (bytes) -> bytes. Throws InvalidArgument naming `option`.
std::size_t parse_size(const std::string& text, const std::string& option = "--size");
// tc rates: "100mbit", "1gbit", "10gbit" -> bits per second. Throws InvalidArgument.
double parse_rate(const std::string& text, const std::string& option = "--link");
// 65536 -> "64KiB", 1e8 -> "95.4MiB": short and exact enough for tables.
std::string format_bytes(double bytes);

}  // namespace terse::tools
