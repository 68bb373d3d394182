// The allreduce probe that the planner's calibration times the engine with (planner/calibration.h):
// the engine is the layer above the planner, so it provides the service instead of the
// planner constructing engines.
#pragma once

#include <memory>

#include "planner/calibration.h"

namespace terse {

// A probe running on its own engine of `threads` worker threads (0: the engine's default) over
// `comm` (borrowed: it must outlive the probe), with a private tracer and raw partitions always
// on the ring. A collective, as making an engine is.
std::unique_ptr<AllreduceProbe> make_allreduce_probe(Communicator& comm, int threads);
// A maker of such probes, for PlannerAccess::set_allreduce_probe and calibrate().
MakeAllreduceProbe allreduce_probes(int threads);

}  // namespace terse
