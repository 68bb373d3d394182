// The environment, read at the edge. The library below reads no environment variable (torchrun's
// bootstrap aside: bootstrap_from_env, Communicator::from_env); the front ends (the Python
// module, the torch backend, the `terse` tool) call these functions to turn TERSE_* and the
// few others below into options, so that a job configured by its environment behaves the same
// through each of them. A C++ program that wants the same calls them too:
//
//   terse::set_process_options(terse::process_options_from_environment());
//   auto comm = terse::Communicator::from_env(terse::communicator_options_from_environment());
//   terse::Engine engine(std::move(comm), terse::engine_options_from_environment());
//
// Each *_from_environment(options) starts from `options` and fills in what the environment
// says for the fields left at their "ask the environment" value (documented per variable
// below; a variable unset or empty changes nothing). docs/python.md, "Environment variables",
// is the table for users.
//
// Promises: every variable has one parser; a bad value throws InvalidArgument naming the
// variable, its value and what is allowed, whichever front end read it. The functions read
// the environment when called (nothing is cached) and are safe to call from any thread.
#pragma once

#include <cstddef>
#include <optional>

#include "terse/communicator.h"
#include "terse/export.h"
#include "terse/options.h"

namespace terse {

// Settings of the whole process rather than of one engine or communicator.
struct ProcessOptions {
  // Run terse's threads under SCHED_BATCH (src/transport/scheduling.h says why). Threads
  // started before set_process_options keep their policy. TERSE_SCHED=normal: false;
  // TERSE_SCHED=batch: true.
  bool batch_scheduling = true;
  // Most clients should leave these alone.
  // Bytes of freed large blocks kept for reuse (0: none); nothing: the lesser of 1 GiB and 1/16
  // of the machine's memory. TERSE_RETAIN_MB: a whole number of MiB.
  std::optional<std::size_t> retained_bytes;
  // The user chose OpenBLAS's thread count, so engines leave it alone instead of lowering it to
  // a rank's share of its machine's cores (engine.h). Set when OPENBLAS_NUM_THREADS,
  // GOTO_NUM_THREADS or OMP_NUM_THREADS is (OpenBLAS reads their values itself).
  bool blas_threads_chosen = false;
};

// Applies process-wide settings; later engines and communicators run with them.
TERSE_API void set_process_options(const ProcessOptions& options);

// TERSE_SCHED, TERSE_RETAIN_MB, OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS.
TERSE_API ProcessOptions process_options_from_environment();

// timeout (where zero): TERSE_TIMEOUT, seconds (fractional allowed), above 0 and at most 1e7.
// interface (where empty): TERSE_IFNAME, else GLOO_SOCKET_IFNAME. secret (where empty):
// TERSE_JOB_SECRET, any string (`terse run` sets 64 random hex digits).
TERSE_API CommunicatorOptions communicator_options_from_environment(
    CommunicatorOptions options = {});

// allowed (where empty): TERSE_PLAN_CODECS, codec specs separated by ';' or spaces (specs hold
// commas). heavy (where empty): TERSE_PLAN_HEAVY_CODECS, the same. log: TERSE_PLAN_LOG, 1 sets
// it, 0 leaves it. explore_seconds: TERSE_PLAN_EXPLORE, seconds (0 or more) instead of the
// value given. cache_directory (where empty): $XDG_CACHE_HOME/terse, else $HOME/.cache/terse.
TERSE_API PlannerOptions planner_options_from_environment(PlannerOptions options = {});

// threads (where 0): TERSE_THREADS, a whole number in 1..256. trace_directory (where empty and
// no tracer given): TERSE_TRACE, a directory. topology (where "auto"): TERSE_TOPOLOGY, auto,
// flat, A,B,... or HxR. host (where empty): TERSE_HOST, else "node G" from torchrun's GROUP_RANK
// G. intra_host (where "auto"): TERSE_INTRA_HOST, auto or tcp. local_ranks (where 0):
// LOCAL_WORLD_SIZE. planner_options: as
// planner_options_from_environment (a planner given in `planner` is the caller's).
TERSE_API EngineOptions engine_options_from_environment(EngineOptions options = {});

}  // namespace terse
