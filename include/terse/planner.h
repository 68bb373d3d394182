// The planner behind codec "auto": per operation (allreduce, reduce-scatter, all-gather) and
// tensor size, raw or an allowed codec, with its strategy and partition count K. A cost model,
// calibrated on this machine and its links, predicts every candidate; then, while a tensor
// size's first collectives run, a budgeted explorer times the model's few best plans against the
// best raw plan and keeps the fastest measured (a compressed plan must beat raw by min_gain).
// docs/planner.md describes the model and its measured accuracy. Codec "auto" chooses among the
// light tier's codecs (PlannerOptions::allowed: those that keep accuracy), "auto:heavy" among
// both tiers' (PlannerOptions::heavy adds those that compress more); docs/planner.md, "What auto
// may choose: accuracy tiers".
//
//   terse::PlannerOptions po;
//   po.allowed = {"fp16", "minmax8:ef=1"};
//   terse::EngineOptions eo;
//   eo.planner = std::make_shared<terse::Planner>(po);
//   terse::Engine engine(comm, eo);
//   terse::AllreduceOptions o;
//   o.codec = "auto";
//   engine.allreduce("grad", data, o).wait();  // the first call calibrates (a collective)
//
// The engine asks a planner what to run and tells it what that took (its protocol is
// internal: src/planner/protocol.h); users set PlannerOptions (terse/options.h), hand the
// planner to an engine, and may ask decide() what-if questions.
//
// Promises:
// - Thread safety: every member may be called from any thread; the engine's collectives below
//   from one thread at a time, in the same order on every rank.
// - Collectives: the engine's first plan of codec "auto" on a communicator (calibration, or
//   agreement on a cached one) and the submissions at which the planner exchanges measured
//   times. Every rank must make them at the same points with the same arguments, which an
//   engine does when its ranks submit the same sequence. decide(), calibrated(), allowed()
//   and heavy() are local.
// - Agreement: decisions are a deterministic function of numbers every rank agrees on
//   (exchanged through the communicator), so every rank settles on the same plan at the same
//   submission.
// - Failures: bad codec specs throw SpecError from the constructor; decide() before a
//   calibration and impossible restrictions throw InvalidArgument; every wait inside
//   calibration and exchanges is bounded by the communicator's timeout (its errors propagate).
//   A calibration cache that is missing, unreadable, of another version or not the same on
//   every rank is measured again; one that cannot be written costs the next run a calibration.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terse/export.h"
#include "terse/options.h"
#include "terse/plan.h"

namespace terse {

class Communicator;

// Which codecs codec "auto" may choose from: the light tier (codec "auto") holds the codecs that
// keep training's accuracy; the heavy tier (codec "auto:heavy") adds those that compress more
// and may cost accuracy, for where the caller allows it (Accordion's regular regimes).
enum class Tier { kLight, kHeavy };

// The tier of an AllreduceOptions codec: "auto" light, "auto:heavy" heavy; nothing for a codec
// spec the planner does not decide.
TERSE_API std::optional<Tier> auto_tier(std::string_view codec);
// "auto" or "auto:heavy".
TERSE_API std::string_view auto_codec(Tier tier);

// The predicted time of one allreduce and where it goes (seconds, per rank).
struct Prediction {
  double seconds = 0;        // the prediction
  double one_partition = 0;  // critical path of one partition running alone
  double network = 0;        // link time of all partitions
  double cpu = 0;            // codec and fp32 work of all partitions, contended
  double host_cpu = 0;       // CPU seconds of all partitions, transport included, uncontended
  double host_bound = 0;     // the host's CPU bound on seconds (where equal, the cores decide)
  double bytes_sent = 0;     // bytes this rank sends
};

// One plan the planner considered.
struct PlanCandidate {
  TensorPlan plan;
  Prediction predicted;
  std::optional<double> measured;  // agreed measured seconds, once exploration or a re-check ran it
  // Where the same codec and strategy were measured at another K: the measured / predicted
  // ratio there (a model error of the strategy carries over to its other K).
  double correction = 1.0;
};

// A decision: the chosen plan, what it beat, and raw's time for reference.
struct PlanDecision {
  std::size_t elements = 0;
  Operation op = Operation::kAllreduce;
  PlanCandidate chosen;
  double raw_seconds = 0;             // the best raw plan's expected seconds
  std::vector<PlanCandidate> ranked;  // every candidate, fastest expected first
  // What exploration runs before settling: the choice first, then the model's next best plans
  // (within a factor of the choice), then the best raw plan. Just the choice when there is
  // nothing to explore (a small tensor kept raw).
  std::vector<PlanCandidate> contenders;

  // Measured time where known, else the (corrected) prediction.
  static double expected(const PlanCandidate& c) {
    return c.measured ? *c.measured : c.predicted.seconds * c.correction;
  }
};

class TERSE_API Planner {
 public:
  // A planner that calibrates (or loads the cache) on an engine's first plan of codec "auto".
  explicit Planner(PlannerOptions options = {});
  ~Planner();
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // The decision for n floats on `ranks` ranks, run by an engine with `threads` worker threads,
  // without communication (`terse plan` asks it what-if questions). strategy/partitions other
  // than kAuto/0 restrict the search to them; `tier` says which codecs it may choose (the
  // light tier's, or both tiers'). op: the collective (n: its input for a reduce-scatter, its
  // output for an all-gather, a multiple of ranks); only the strategies it has are candidates,
  // and its decisions and measured times are its own. Raw is also tried at the engine's default
  // partitioning (kDefaultPartitionBytes a partition); an engine's own plans use its own
  // EngineOptions::partition_bytes. Needs a calibration (after an engine's first plan, or a
  // planner made with one).
  PlanDecision decide(std::size_t n, int ranks, int threads, Strategy strategy = Strategy::kAuto,
                      int partitions = 0, Tier tier = Tier::kLight,
                      Operation op = Operation::kAllreduce) const;

  // Canonical specs of the light tier's codecs.
  std::vector<std::string> allowed() const;
  // Canonical specs of the heavy tier's codecs (none of them light).
  std::vector<std::string> heavy() const;
  const PlannerOptions& options() const;
  // Whether a calibration is held (local).
  bool calibrated() const;

  struct Impl;  // src/planner/planner_impl.h: calibration, cost model, explorations

 private:
  friend struct PlannerAccess;
  std::unique_ptr<Impl> impl_;
};

// A stable text for a plan's configuration: "codec/strategy/K".
TERSE_API std::string plan_key(const TensorPlan& plan);

}  // namespace terse
