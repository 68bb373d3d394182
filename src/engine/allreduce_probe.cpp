#include "engine/allreduce_probe.h"

#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/trace.h"

namespace terse {

namespace {

class EngineProbe final : public AllreduceProbe {
 public:
  EngineProbe(Communicator& comm, int threads)
      : engine_(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), options(threads)) {}
  ~EngineProbe() override { engine_.synchronize(); }

  void allreduce(const std::string& name, std::span<float> x, const TensorPlan& plan) override {
    AllreduceOptions o;
    o.codec = plan.codec;
    o.strategy = plan.strategy;
    o.partitions = plan.partitions;
    // As planned: calibration's probes are flat (the engine's rule would take a large raw probe
    // to two levels on a job of hosts, whose bytes and rounds are not what the probe prices).
    o.hierarchy = plan.hierarchical ? Hierarchy::kHosts : Hierarchy::kFlat;
    engine_.allreduce(name, x, o).wait();
  }
  int threads() const override {
    const int t = engine_.options().threads;
    return t > 0 ? t : kDefaultEngineThreads;
  }

 private:
  static EngineOptions options(int threads) {
    EngineOptions eo;
    eo.threads = threads;
    eo.tracer = std::make_shared<TraceRecorder>();  // a probe: not TERSE_TRACE's timeline
    eo.gather_bytes = 0;                            // raw probes on the ring
    return eo;
  }
  Engine engine_;
};

}  // namespace

std::unique_ptr<AllreduceProbe> make_allreduce_probe(Communicator& comm, int threads) {
  return std::make_unique<EngineProbe>(comm, threads);
}

MakeAllreduceProbe allreduce_probes(int threads) {
  return [threads](Communicator& comm) { return make_allreduce_probe(comm, threads); };
}

}  // namespace terse
