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
// Promises:
// - Thread safety: every member may be called from any thread; the collectives below from one
//   thread at a time, in the same order on every rank.
// - Collectives: the first plan() on a communicator (calibration, or agreement on a cached
//   one) and before_submission() at the points where it exchanges measured times. Every rank
//   must call them at the same points with the same arguments, which an engine does when its
//   ranks submit the same sequence. decide(), observe(), exploring(), calibrated(),
//   allowed() and heavy() are local.
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

#include "terse/plan.h"
#include "terse/export.h"

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

struct PlannerOptions {
  // The light tier: codecs the planner may choose besides raw for codec "auto" (specs; "ef=1"
  // variants allowed). Lossy codecs change what training computes, so this is the user's
  // decision. Empty: fp16, minmax8 with error feedback and PowerSGD rank 8 with fp32 or fp16
  // sums, which kept DDP's fp32 accuracy on the training benchmark (PowerSGD with each weight
  // viewed as its own rows: AllreduceOptions::rows). {"none"}: raw only.
  std::vector<std::string> allowed;
  // The heavy tier: codecs the planner may also choose for codec "auto:heavy" (a codec in both
  // lists is light). Empty: onebit with error feedback and PowerSGD (rank 4). {"none"}: no heavy
  // codec ("auto:heavy" then plans as "auto"). terse/environment.h: TERSE_PLAN_CODECS and
  // TERSE_PLAN_HEAVY_CODECS fill in either list.
  std::vector<std::string> heavy;
  // A compressed plan must be this much faster than the best raw plan (relative) to be chosen,
  // predicted and measured alike: predictions err, and raw is exact.
  double min_gain = 0.05;
  // Calibration cache: "" for cache_directory/calibration-HOST-nN.json; "-" for none (calibrate
  // every time).
  std::string cache_path;
  // The default cache's directory; empty: /tmp/terse. The environment's
  // (planner_options_from_environment): $XDG_CACHE_HOME/terse, else ~/.cache/terse.
  std::string cache_directory;
  // Exploration budget: seconds of expected run time that exploring one tensor size may spend
  // on its contenders (0: no exploration, the model's choice stands). The choice and the best
  // raw plan (where it is expected within 1.5x of the choice) run a first round even where it
  // costs more. TERSE_PLAN_EXPLORE sets it (terse/environment.h).
  double explore_seconds = 2.0;
  // Print the calibration and every decision on rank 0 (TERSE_PLAN_LOG=1 sets it).
  bool log = false;

  // Most clients should leave this alone: an engine that makes its planner sets it.
  // Raw is also tried at the engine's own partitioning, one partition per this many bytes
  // (EngineOptions::partition_bytes), so the settled raw plan is never worse than the raw
  // plan the job would run without the planner. 0: not tried.
  std::size_t raw_partition_bytes = std::size_t{8} << 20;
};

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
  // A planner that calibrates (or loads the cache) on its first plan() through a communicator.
  explicit Planner(PlannerOptions options = {});
  ~Planner();
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // The decision for n floats on `ranks` ranks, run by an engine with `threads` worker threads,
  // without communication (`terse plan` asks it what-if questions). strategy/partitions other
  // than kAuto/0 restrict the search to them; `tier` says which codecs it may choose (the
  // light tier's, or both tiers'). op: the collective (n: its input for a reduce-scatter, its
  // output for an all-gather, a multiple of ranks); only the strategies it has are candidates,
  // and its decisions and measured times are its own. Needs a calibration (after the first
  // plan(), or a planner made with one).
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

  // ---- called by the engine -------------------------------------------------------------

  // What the engine does with n floats now (while a size is explored, its current contender).
  // Collective on the first call (calibration, or agreement on a cached one). Each tier decides
  // and explores a size apart from the other.
  TensorPlan plan(Communicator& comm, std::size_t n, int threads,
                  Strategy strategy = Strategy::kAuto, int partitions = 0,
                  Tier tier = Tier::kLight, Operation op = Operation::kAllreduce);

  // The engine reports the wall time of a planned collective of n floats (first task start to
  // last task end on this rank). Local and cheap.
  void observe(std::size_t n, const TensorPlan& plan, double seconds,
               Operation op = Operation::kAllreduce);

  // Called by the engine before each submission that has planned tensors (at the same points
  // on every rank), with the plan() arguments of its planned tensors. Where an explored size
  // has finished a round, and at a periodic re-check, it exchanges the observations (a
  // collective) and agrees on measured times; explorations move on or settle, and decisions
  // whose measured time is far off their expectation are dropped, to be decided again. Then
  // each explored size that this submission uses moves on to its next contender. Returns the
  // number of sizes whose plan changed.
  struct Use {
    std::size_t n = 0;
    int threads = 0;
    Strategy strategy = Strategy::kAuto;
    int partitions = 0;
    Tier tier = Tier::kLight;
    Operation op = Operation::kAllreduce;
  };
  int before_submission(Communicator& comm, std::span<const Use> uses = {});

  // Whether a size's plan is still being explored (local, the same on every rank). While it
  // is, the engine keeps each contender's codec state; once settled, it drops the losers'.
  bool exploring(std::size_t n, int threads, Strategy strategy = Strategy::kAuto,
                 int partitions = 0, Tier tier = Tier::kLight,
                 Operation op = Operation::kAllreduce) const;

 private:
  // The internals (src/planner/planner_impl.h): calibration, cost model, explorations.
  struct Impl;
  friend struct PlannerAccess;
  std::unique_ptr<Impl> impl_;
};

// A stable text for a plan's configuration: "codec/strategy/K".
TERSE_API std::string plan_key(const TensorPlan& plan);

}  // namespace terse
