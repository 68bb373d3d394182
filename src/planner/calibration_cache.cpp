// The calibration cache (calibration.h): the record as JSON, read back only whole and of this
// version, and the file it is kept in.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "planner/calibration.h"
#include "terse/error.h"

namespace terse {

// field (a cache written by another version is measured again, never patched up).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LinearFit, a, b, knee, b2, rms_relative_error,
                                   max_relative_error, points, outliers, xs, ys)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CodecCosts, spec, summable, multi_round, encode, decode,
                                   accumulate, combine, bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Calibration, host, world_size, host_of, direct_reads,
                                   ranks_on_host, cores,
                                   peer_alpha, peer_beta, alpha, beta, engine_beta, engine_link,
                                   transport_cpu, cpu_per_message, host_efficiency,
                                   host_cpu_ratio, add, divide, codecs, cpu_slowdown,
                                   task_overhead, job_overhead, seconds)

std::string Calibration::to_json() const {
  nlohmann::json j = *this;
  j["version"] = kVersion;
  return j.dump(1);
}

Calibration Calibration::from_json(std::string_view text) {
  try {
    const auto j = nlohmann::json::parse(text);
    const int version = j.at("version").get<int>();
    if (version != kVersion) {
      throw DecodeError(
          fmt::format("calibration: version {} (this build reads {})", version, kVersion));
    }
    auto c = j.get<Calibration>();
    if (c.world_size < 1 || c.cpu_slowdown.empty()) throw DecodeError("calibration: bad values");
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw DecodeError(fmt::format("calibration: {}", e.what()));
  }
}

std::string default_calibration_path(int world_size, const std::string& directory) {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  return fmt::format("{}/calibration-{}-n{}.json", directory.empty() ? "/tmp/terse" : directory,
                     host, world_size);
}

}  // namespace terse
