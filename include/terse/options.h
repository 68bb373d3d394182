// The options a user sets, in one place: what each collective call takes (AllreduceOptions,
// CollectiveOptions), what an engine runs with (EngineOptions) and what the planner behind codec
// "auto" may do (PlannerOptions). Every field has a default that works; the fields under "most
// clients should leave this alone" are tuning knobs. terse/environment.h fills in the fields the
// environment sets (TERSE_*). engine.h and planner.h describe what the calls promise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "terse/plan.h"

namespace terse {

class Planner;
class Tracer;

// ---- one collective call --------------------------------------------------------------------

// What every collective call says: the codec, the strategy, the partitions, and whether a sum
// is averaged.
struct CommonOptions {
  // A codec spec ("none", "onebit:ef=1", "topk:ratio=0.01", ...), "auto" or "auto:heavy": the
  // planner's choice of raw or a codec of the light tier (auto) or of either tier (auto:heavy),
  // strategy and K for this operation and size (include/terse/planner.h); a strategy or
  // partitions given with "auto" restrict its search. all_to_all refuses "auto"
  // (InvalidArgument).
  std::string codec = "none";
  // allreduce: see Strategy. reduce_scatter: raw (codec none), alltoall (the default for
  // codecs), sharded, ring, summable. all_gather: raw (codec none) or allgather. all_to_all: raw
  // (codec none) or alltoall. auto picks the first valid one.
  Strategy strategy = Strategy::kAuto;
  // Partitions K (1 .. 256), pipelined; 0 lets the engine choose from the tensor's size
  // (all_to_all: 1, since the ranks' sizes differ and K must agree).
  int partitions = 0;
  // Divide the sum by the number of ranks (DDP's convention); false leaves the sum. Only
  // allreduce and reduce_scatter sum.
  bool average = true;
};

// Options of allreduce and allreduce_group.
struct AllreduceOptions : CommonOptions {
  // The tensor's rows as a matrix (a weight's first dimension; 0: not given). With "auto", a
  // matrix codec the planner chooses (PowerSGD) views the tensor as rows x n/rows instead of
  // its most nearly square default, as an explicit "powersgd:rows=R" would. It must divide the
  // tensor's elements. A codec named explicitly takes its own rows= parameter instead.
  std::size_t rows = 0;
  // Flat, or in two levels over the job's hosts (EngineOptions::topology): exact inside each
  // host, this call's codec and strategy across hosts. See Hierarchy. With codec "auto", kAuto
  // lets the planner price both levels and choose; kFlat and kHosts restrict it.
  Hierarchy hierarchy = Hierarchy::kAuto;
};

// Options of reduce_scatter, all_gather and all_to_all (see Engine::reduce_scatter).
struct CollectiveOptions : CommonOptions {
  // reduce_scatter and all_gather: flat, or in two levels over the job's hosts
  // (EngineOptions::topology, docs/topology.md). A reduce-scatter sums exactly inside each host,
  // then crosses with this call's codec and strategy; an all-gather crosses with each shard
  // encoded once by its owner, then hands the payloads on inside each host. Auto decides as for
  // an allreduce (see Hierarchy). Strategies sharded, ring and summable of a reduce-scatter
  // cross in groups of one rank per host and need hosts of equal size (auto: flat on uneven
  // hosts; hosts: InvalidArgument). all_to_all runs flat (hosts: InvalidArgument).
  Hierarchy hierarchy = Hierarchy::kAuto;
};

// ---- the planner (codec "auto") -------------------------------------------------------------

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
  // Calibration cache: "" for cache_directory/calibration-HOST-nN.json; "-" for none (calibrate
  // every time).
  std::string cache_path;
  // The default cache's directory; empty: /tmp/terse. The environment's
  // (planner_options_from_environment): $XDG_CACHE_HOME/terse, else ~/.cache/terse.
  std::string cache_directory;
  // Print the calibration and every decision on rank 0 (TERSE_PLAN_LOG=1 sets it).
  bool log = false;

  // Most clients should leave these alone.
  // A compressed plan must be this much faster than the best raw plan (relative) to be chosen,
  // predicted and measured alike: predictions err, and raw is exact.
  double min_gain = 0.05;
  // Exploration budget: seconds of expected run time that exploring one tensor size may spend
  // on its contenders (0: no exploration, the model's choice stands). The choice and the best
  // raw plan (where it is expected within 1.5x of the choice) run a first round even where it
  // costs more. TERSE_PLAN_EXPLORE sets it (terse/environment.h).
  double explore_seconds = 2.0;
};

// ---- the engine -----------------------------------------------------------------------------

inline constexpr int kDefaultEngineThreads = 4;
inline constexpr std::size_t kDefaultPartitionBytes = std::size_t{8} << 20;

struct EngineOptions {
  // Seed shared by all ranks for stochastic codecs (the same on every rank).
  std::uint64_t seed = 0;
  // Worker threads running partition tasks; 0 (or less): kDefaultEngineThreads.
  // engine_options_from_environment: TERSE_THREADS (terse/environment.h).
  int threads = 0;
  // Decides codec "auto" (include/terse/planner.h). Without one, the first "auto" tensor makes
  // the engine create one with planner_options. With "auto", the first plan (and the
  // submissions at which the planner exchanges measured times: the end of each exploration
  // round, periodic re-checks) is a collective: every rank calibrates or agrees on the cached
  // calibration, or exchanges measured times.
  std::shared_ptr<Planner> planner;
  // The options of the planner the engine makes when `planner` is null (the environment's, from
  // engine_options_from_environment: TERSE_PLAN_*).
  PlannerOptions planner_options;
  // Stage results and write the user's tensors only after a submission succeeded, so that a
  // failed submission leaves them unchanged (one more copy of every tensor).
  bool keep_input_on_error = false;
  // Optional per-stage event sink (encode, send, recv, decode, merge, wait). Without one, a
  // trace_directory DIR makes the engine record its own and write DIR/rank-R.json at
  // destruction, with its clock offset to rank 0 measured at construction (then a collective:
  // set it on every rank); `terse trace merge DIR` makes one timeline of them. TERSE_TRACE=DIR
  // sets trace_directory (engine_options_from_environment).
  std::shared_ptr<Tracer> tracer;
  std::string trace_directory;
  // Which ranks share a host (docs/topology.md), agreed by every rank at construction (a
  // collective): "auto" puts ranks on one host when their machine, network namespace and `host`
  // are equal; "A,B,..." gives the ranks per host, hosts of consecutive ranks ("3,2"); "HxR" H
  // hosts of R ranks; "flat" a host per rank. Every rank must give the same value
  // (MismatchError otherwise). engine_options_from_environment: TERSE_TOPOLOGY.
  std::string topology = "auto";
  // This rank's host name under topology "auto"; empty: its machine and network namespace
  // alone. engine_options_from_environment: TERSE_HOST, else torchrun's GROUP_RANK (its node).
  std::string host;
  // How the ranks of a host move bytes in the phases of hierarchical collectives inside it:
  // "auto" reads the other ranks' memory directly (Linux cross-memory attach: one copy, where
  // loopback TCP costs a copy on each side) on hosts where every rank can, and sends messages
  // elsewhere; "tcp" always sends messages. Decided with every rank at construction (docs/
  // topology.md). engine_options_from_environment: TERSE_INTRA_HOST.
  std::string intra_host = "auto";
  // The ranks this rank's launcher put on its host (torchrun's LOCAL_WORLD_SIZE) and in the
  // job (WORLD_SIZE): where the engine's communicator spans the whole job, its topology must
  // give this rank's host local_ranks ranks (MismatchError naming the host); a communicator of
  // a subgroup is not checked. 0: not checked. engine_options_from_environment sets both.
  int local_ranks = 0;
  int launched_ranks = 0;

  // Most clients should leave these alone.
  // Raw tensors of a group up to this many bytes are fused into one message.
  std::size_t fuse_bytes = std::size_t{1} << 20;
  // A raw partition (or fused message) is gathered instead of ringed when (ranks - 1) times its
  // bytes is at most this: one message step instead of 2(N-1), for at most this many bytes
  // sent per rank; every rank sums the N inputs in rank order. 0 always rings. The default
  // bounds the extra bytes against a ring, (N-1)(N-2)/N of the message, below 16 KiB (1.3 ms at
  // 100 Mbit/s) for 2N-3 message steps saved. The planner's cost model assumes the default.
  std::size_t gather_bytes = kDefaultGatherBytes;
  // Target bytes per partition when AllreduceOptions::partitions is 0.
  std::size_t partition_bytes = kDefaultPartitionBytes;
};

}  // namespace terse
