#include "terse/spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "kit/hash.h"
#include "terse/error.h"

namespace terse {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool valid_word(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string format_number(double v) {
  // Shortest form that round-trips, so canonical specs are stable.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  (void)ec;
  return std::string(buf, end);
}

// The interval lo..hi as a reader sees it: "(0, 1]".
std::string interval(double lo, double hi, SpecReader::Ends ends) {
  const bool left_open = ends == SpecReader::Ends::kLeftOpen || ends == SpecReader::Ends::kOpen;
  const bool right_open = ends == SpecReader::Ends::kRightOpen || ends == SpecReader::Ends::kOpen;
  return fmt::format("{}{}, {}{}", left_open ? '(' : '[', format_number(lo), format_number(hi),
                     right_open ? ')' : ']');
}

bool inside(double v, double lo, double hi, SpecReader::Ends ends) {
  const bool left_open = ends == SpecReader::Ends::kLeftOpen || ends == SpecReader::Ends::kOpen;
  const bool right_open = ends == SpecReader::Ends::kRightOpen || ends == SpecReader::Ends::kOpen;
  return (left_open ? v > lo : v >= lo) && (right_open ? v < hi : v <= hi);
}

}  // namespace

Spec Spec::parse(std::string_view text) {
  Spec spec;
  text = trim(text);
  auto colon = text.find(':');
  spec.name_ = std::string(trim(text.substr(0, colon)));
  if (!valid_word(spec.name_)) {
    throw SpecError(fmt::format(
        "terse: bad codec spec '{}': expected name[:key=value,...] with a lower-case name", text));
  }
  if (colon == std::string_view::npos) return spec;
  std::string_view rest = text.substr(colon + 1);
  for (bool more = true; more;) {
    auto comma = rest.find(',');
    std::string_view item = trim(rest.substr(0, comma));
    more = comma != std::string_view::npos;
    if (more) rest = rest.substr(comma + 1);
    auto eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw SpecError(fmt::format("terse: bad codec spec '{}': '{}' is not key=value", text, item));
    }
    std::string key(trim(item.substr(0, eq)));
    std::string value(trim(item.substr(eq + 1)));
    if (!valid_word(key) || value.empty()) {
      throw SpecError(fmt::format("terse: bad codec spec '{}': '{}' is not key=value", text, item));
    }
    if (!spec.params_.emplace(key, value).second) {
      throw SpecError(fmt::format("terse: bad codec spec '{}': key '{}' given twice", text, key));
    }
  }
  return spec;
}

std::string Spec::str() const {
  std::string s = name_;
  char sep = ':';
  for (const auto& [k, v] : params_) {
    s += sep;
    s += k;
    s += '=';
    s += v;
    sep = ',';
  }
  return s;
}

SpecReader::SpecReader(const Spec& spec) : spec_(spec) {}

const std::string* SpecReader::find(std::string_view key) {
  auto it = spec_.params().find(key);
  return it == spec_.params().end() ? nullptr : &it->second;
}

void SpecReader::record(std::string_view key, std::string value, std::string allowed) {
  used_[std::string(key)] = std::move(value);
  allowed_[std::string(key)] = std::move(allowed);
}

double SpecReader::number(std::string_view key, double def, double lo, double hi, Ends ends) {
  double v = def;
  if (const std::string* s = find(key)) {
    const char* b = s->data();
    const char* e = b + s->size();
    auto [p, ec] = std::from_chars(b, e, v);
    if (ec == std::errc::result_out_of_range && p == e) {
      // Beyond a double's range: overflow is as good as infinite, underflow as good as zero.
      const bool overflow = std::isinf(std::strtod(s->c_str(), nullptr));
      throw SpecError(fmt::format("terse: codec '{}': {}={} is {}; allowed: a number in {}",
                                  name(), key, *s,
                                  overflow ? "not finite" : "too close to 0 to represent",
                                  interval(lo, hi, ends)));
    }
    if (ec != std::errc() || p != e || std::isnan(v)) {
      throw SpecError(fmt::format("terse: codec '{}': {}={} is not a number; allowed: a number "
                                  "in {}",
                                  name(), key, *s, interval(lo, hi, ends)));
    }
    if (std::isinf(v)) {
      throw SpecError(fmt::format("terse: codec '{}': {}={} is not finite; allowed: a number in {}",
                                  name(), key, *s, interval(lo, hi, ends)));
    }
  }
  if (!inside(v, lo, hi, ends)) {
    throw SpecError(fmt::format("terse: codec '{}': {}={} is outside {}", name(), key,
                                format_number(v), interval(lo, hi, ends)));
  }
  record(key, format_number(v),
         fmt::format("{} (number in {}, default {})", key, interval(lo, hi, ends),
                     format_number(def)));
  return v;
}

std::int64_t SpecReader::integer(std::string_view key, std::int64_t def, std::int64_t lo,
                                 std::int64_t hi) {
  std::int64_t v = def;
  if (const std::string* s = find(key)) {
    const char* b = s->data();
    const char* e = b + s->size();
    auto [p, ec] = std::from_chars(b, e, v);
    if (ec != std::errc() || p != e) {
      throw SpecError(fmt::format(
          "terse: codec '{}': {}={} is not an integer; allowed: an integer in [{}, {}]", name(),
          key, *s, lo, hi));
    }
  }
  if (v < lo || v > hi) {
    throw SpecError(
        fmt::format("terse: codec '{}': {}={} is outside [{}, {}]", name(), key, v, lo, hi));
  }
  record(key, std::to_string(v),
         fmt::format("{} (integer in [{}, {}], default {})", key, lo, hi, def));
  return v;
}

namespace {
bool parse_flag(std::string_view codec, std::string_view key, const std::string& s) {
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw SpecError(fmt::format("terse: codec '{}': {}={} is not a flag (use 0 or 1)", codec, key, s));
}
}  // namespace

bool SpecReader::flag(std::string_view key, bool def) {
  bool v = def;
  if (const std::string* s = find(key)) v = parse_flag(name(), key, *s);
  record(key, v ? "1" : "0", fmt::format("{} (0 or 1, default {})", key, def ? 1 : 0));
  return v;
}

bool SpecReader::take_flag(std::string_view key, bool def) {
  bool v = def;
  if (const std::string* s = find(key)) v = parse_flag(name(), key, *s);
  erase(key);
  return v;
}

double SpecReader::take_number(std::string_view key, double def, double lo, double hi,
                               Ends ends) {
  const double v = number(key, def, lo, hi, ends);
  used_.erase(std::string(key));
  allowed_.erase(std::string(key));
  erase(key);
  return v;
}

void SpecReader::erase(std::string_view key) {
  auto params = spec_.params();
  params.erase(std::string(key));
  std::string text = spec_.name();
  char sep = ':';
  for (const auto& [k, val] : params) {
    text += sep + k + "=" + val;
    sep = ',';
  }
  spec_ = Spec::parse(text);
}

std::string SpecReader::choice(std::string_view key, std::string_view def,
                               const std::vector<std::string>& allowed) {
  std::string v(def);
  if (const std::string* s = find(key)) v = *s;
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
    throw SpecError(fmt::format("terse: codec '{}': {}={} is not one of {}", name(), key, v,
                                fmt::join(allowed, ", ")));
  }
  record(key, v, fmt::format("{} (one of {}, default {})", key, fmt::join(allowed, "|"), def));
  return v;
}

void SpecReader::finish() const {
  std::vector<std::string> unknown;
  for (const auto& [k, v] : spec_.params()) {
    if (!used_.count(k)) unknown.push_back(k);
  }
  if (unknown.empty()) return;
  std::vector<std::string> accepted;
  for (const auto& [k, d] : allowed_) accepted.push_back(d);
  if (accepted.empty()) accepted.push_back("none");
  throw SpecError(fmt::format("terse: codec '{}' has no parameter {}; it accepts: {}", name(),
                              fmt::join(unknown, ", "), fmt::join(accepted, "; ")));
}

std::string SpecReader::canonical() const {
  std::string s = name();
  char sep = ':';
  for (const auto& [k, v] : used_) {
    s += sep;
    s += k;
    s += '=';
    s += v;
    sep = ',';
  }
  return s;
}

std::uint32_t fnv1a32(std::string_view text) {
  std::uint32_t h = 2166136261u;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  return h;
}

std::uint64_t fnv1a64(std::string_view text) { return kit::fnv1a64(text); }

}  // namespace terse
