// Codec specs: "name:key=value,key=value". A spec is parsed once, its parameters read with
// their types, defaults and ranges, and anything left unread is an error that lists what the
// codec accepts. The canonical form (every parameter, defaults included, sorted by key) is what
// ranks compare and what the payload header's parameter digest is computed from.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "terse/export.h"

namespace terse {

class TERSE_API Spec {
 public:
  // Throws SpecError on a malformed spec (empty name, missing '=', duplicate key).
  static Spec parse(std::string_view text);

  const std::string& name() const { return name_; }
  const std::map<std::string, std::string, std::less<>>& params() const { return params_; }
  // name:key=value,... as given (keys sorted).
  std::string str() const;

 private:
  std::string name_;
  std::map<std::string, std::string, std::less<>> params_;
};

// Typed access to a Spec's parameters. Each accessor records the key, its default and its
// range, so finish() can reject unknown keys with the list of accepted ones, and canonical()
// can print the full parameter set.
class TERSE_API SpecReader {
 public:
  explicit SpecReader(const Spec& spec);

  const std::string& name() const { return spec_.name(); }

  // Which ends of a number's range belong to it: [lo, hi], (lo, hi], [lo, hi) or (lo, hi).
  enum class Ends { kClosed, kLeftOpen, kRightOpen, kOpen };
  // A finite real number in the range lo..hi with the given ends; error messages and the list
  // of accepted parameters print the interval as it is checked.
  double number(std::string_view key, double def, double lo, double hi, Ends ends = Ends::kClosed);
  // An integer in [lo, hi].
  std::int64_t integer(std::string_view key, std::int64_t def, std::int64_t lo, std::int64_t hi);
  // 0/1, true/false, yes/no, on/off.
  bool flag(std::string_view key, bool def);
  // One of the allowed words.
  std::string choice(std::string_view key, std::string_view def,
                     const std::vector<std::string>& allowed);
  // Removes a key from the spec before the codec sees it (used by wrappers such as ef=1).
  bool take_flag(std::string_view key, bool def);
  // The same for a number, checked as number() checks it (error feedback's momentum=).
  double take_number(std::string_view key, double def, double lo, double hi,
                     Ends ends = Ends::kClosed);

  // Throws SpecError if the spec holds keys no accessor asked for.
  void finish() const;
  // name:key=value,... with every parameter asked for, defaults included, keys sorted.
  std::string canonical() const;

 private:
  const std::string* find(std::string_view key);
  void erase(std::string_view key);
  void record(std::string_view key, std::string value, std::string allowed);

  Spec spec_;
  std::map<std::string, std::string, std::less<>> used_;     // key -> canonical value
  std::map<std::string, std::string, std::less<>> allowed_;  // key -> description of range
};

// 32-bit FNV-1a, used for parameter digests and tensor ids.
TERSE_API std::uint32_t fnv1a32(std::string_view text);
TERSE_API std::uint64_t fnv1a64(std::string_view text);

}  // namespace terse
