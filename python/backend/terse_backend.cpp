// terse._backend: terse as a torch.distributed backend (a c10d::Backend), so that
// init_process_group(backend="cpu:terse") hands DDP without a hook, FSDP and all_to_all to terse's
// engine. python/terse/backend.py registers it with Backend.register_backend.
//
// Unlike terse._C, this module links libtorch and is built against one torch (the venv's): its C++
// ABI is that torch's. It uses torch's bundled pybind11, so that the Backend class it binds derives
// from the one torch._C registered.
//
// Execution: every operation is checked when it is called (unsupported operations, reduce ops,
// devices and dtypes throw there, naming the operation), then queued to one worker thread per
// backend that runs the operations in call order, each to completion, and completes the Work's
// future with the output tensors (what DDP's reducer reads). Every rank calls the same operations
// in the same order (c10d's contract), so every rank's worker runs the same sequence.
//
// Two terse communicators over the group's store: one for the engine (float reductions), one for
// byte-moving collectives (broadcast, gathers of other dtypes, all-to-all, barrier), so that the
// engine's messages and these never share a Gloo slot.
//
// Policy (BackendOptions): a float32/float16/bfloat16 reduction (allreduce, reduce_scatter) of at
// least min_bytes that the caller did not mark exact is compressed with `codec`; every other
// reduction travels raw (engine codec "none"; other dtypes gathered and summed in rank order, the
// same on every rank). all-gathers use `all_gather_codec` under the same rule ("none" by default).
// An all-to-all of such a dtype uses `all_to_all_codec` for each block of at least min_bytes
// (a block's size is known alike to its sender and its receiver, so both make the same choice
// without a word): those blocks go through the engine's all_to_all (each encoded once by its
// sender and decoded by its receiver, a rank's own block exact), the smaller ones as they are
// through the byte communicator, at the same time. Broadcast and barrier move bytes unchanged.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"

namespace terse::backend {
namespace {

using std::chrono::milliseconds;

// ---- the group's store as a terse store ---------------------------------------------------------

class C10dStore : public terse::Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, std::span<const std::byte> value) override {
    const auto* p = reinterpret_cast<const std::uint8_t*>(value.data());
    store_->set(key, std::vector<std::uint8_t>(p, p + value.size()));
  }
  std::vector<std::byte> get(const std::string& key, milliseconds timeout) override {
    wait_for({key}, timeout);
    const std::vector<std::uint8_t> v = store_->get(key);
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    return std::vector<std::byte>(p, p + v.size());
  }
  void wait(std::span<const std::string> keys, milliseconds timeout) override {
    wait_for(std::vector<std::string>(keys.begin(), keys.end()), timeout);
  }

 private:
  void wait_for(const std::vector<std::string>& keys, milliseconds timeout) {
    try {
      store_->wait(keys, timeout);
    } catch (const c10::Error& e) {
      throw TimeoutError("terse backend: waiting for store key '" + keys.front() +
                         "': " + e.what_without_backtrace());
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
};

// ---- options ------------------------------------------------------------------------------------

struct BackendOptions {
  std::string codec = "fp16";
  std::string all_gather_codec = "none";
  std::string all_to_all_codec = "fp16";
  std::size_t min_bytes = std::size_t{64} << 10;
  int threads = 0;
  double timeout_seconds = 0;  // 0: the process group's timeout
};

// Set by terse.backend.exact() on the calling thread: the operations it calls travel raw.
thread_local bool exact_calls = false;

// ---- work ---------------------------------------------------------------------------------------

class TerseWork : public c10d::Work {
 public:
  TerseWork(c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(milliseconds /*timeout*/) override {
    // Bounded already: every terse wait is bounded by the communicator's timeout.
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  void complete() { future_->markCompleted(c10::IValue(outputs_)); }
  void fail(std::exception_ptr error) { future_->setError(std::move(error)); }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ---- checks -------------------------------------------------------------------------------------

bool engine_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

DType to_dtype(at::ScalarType t) {
  if (t == at::kHalf) return DType::kFloat16;
  if (t == at::kBFloat16) return DType::kBFloat16;
  return DType::kFloat32;
}

void check_tensor(const char* op, const at::Tensor& t) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.device().is_cpu(), "terse backend: ", op, ": tensor is on ",
                              t.device().str(),
                              "; terse reduces CPU tensors (use 'cpu:terse' "
                              "with another backend for other devices)");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, "terse backend: ", op,
                              ": sparse tensors are not supported");
  TORCH_CHECK(t.is_contiguous(), "terse backend: ", op, ": tensor is not contiguous");
  TORCH_CHECK_NOT_IMPLEMENTED(!t.is_complex(), "terse backend: ", op,
                              ": complex tensors are not supported");
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_NOT_IMPLEMENTED(tensors.size() == 1, "terse backend: ", op, ": ", tensors.size(),
                              " tensors per call; terse takes one (one device per process)");
  check_tensor(op, tensors[0]);
  return tensors[0];
}

// true for AVG, false for SUM; anything else is refused.
bool is_average(const char* op, const c10d::ReduceOp& reduce) {
  if (reduce.op_ == c10d::ReduceOp::SUM) return false;
  if (reduce.op_ == c10d::ReduceOp::AVG) return true;
  const char* name = "this reduce op";
  switch (reduce.op_) {
    case c10d::ReduceOp::PRODUCT:
      name = "PRODUCT";
      break;
    case c10d::ReduceOp::MIN:
      name = "MIN";
      break;
    case c10d::ReduceOp::MAX:
      name = "MAX";
      break;
    case c10d::ReduceOp::BAND:
      name = "BAND";
      break;
    case c10d::ReduceOp::BOR:
      name = "BOR";
      break;
    case c10d::ReduceOp::BXOR:
      name = "BXOR";
      break;
    case c10d::ReduceOp::PREMUL_SUM:
      name = "PREMUL_SUM";
      break;
    default:
      break;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "terse backend: ", op, " with ", name,
                              " is not supported: terse reduces with SUM and AVG only");
  return false;
}

std::span<std::byte> bytes_of(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes())};
}

// ---- the backend --------------------------------------------------------------------------------

class TerseBackend : public c10d::Backend {
 public:
  TerseBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
               BackendOptions options)
      : Backend(rank, size), options_(std::move(options)) {
    auto terse_store = std::make_shared<C10dStore>(store);
    CommunicatorOptions comm_options;
    comm_options.timeout = milliseconds(static_cast<std::int64_t>(options_.timeout_seconds * 1000));
    comm_options.prefix = "terse-backend-engine";
    comm_options = communicator_options_from_environment(std::move(comm_options));
    std::shared_ptr<Communicator> engine_comm =
        Communicator::create(rank, size, terse_store, comm_options);
    comm_options.prefix = "terse-backend-bytes";
    bytes_ = Communicator::create(rank, size, terse_store, comm_options);
    EngineOptions engine_options;
    engine_options.threads = options_.threads;
    engine_ = std::make_unique<Engine>(std::move(engine_comm),
                                       engine_options_from_environment(engine_options));
    worker_ = std::thread([this] { run(); });
  }

  ~TerseBackend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    worker_.join();
    engine_.reset();
  }

  const std::string getBackendName() const override { return "terse"; }

  // ---- what terse runs --------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor t = single("allreduce", tensors);
    const bool average = is_average("allreduce", opts.reduceOp);
    const std::string codec = codec_for(t, options_.codec);
    return enqueue(c10d::OpType::ALLREDUCE, {t},
                   [this, t, average, codec] { reduce(t, average, codec, "allreduce"); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const char* op = "allreduce_coalesced";
    const bool average = is_average(op, opts.reduceOp);
    std::vector<std::function<void()>> tasks;
    for (const at::Tensor& t : tensors) {
      check_tensor(op, t);
      const std::string codec = codec_for(t, options_.codec);
      tasks.push_back([this, t, average, codec, op] { reduce(t, average, codec, op); });
    }
    return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors, in_order(std::move(tasks)));
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor t = single("broadcast", tensors);
    const int root = static_cast<int>(opts.rootRank);
    return enqueue(c10d::OpType::BROADCAST, {t},
                   [this, t, root] { bytes_->broadcast(root, bytes_of(t), "broadcast"); });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    const at::Tensor in = single("allgather", inputs);
    TORCH_CHECK_NOT_IMPLEMENTED(outputs.size() == 1, "terse backend: allgather: ", outputs.size(),
                                " output lists; terse takes one");
    std::vector<at::Tensor> outs = outputs[0];
    TORCH_CHECK(static_cast<int>(outs.size()) == size_, "terse backend: allgather: ", outs.size(),
                " outputs for ", size_, " ranks");
    for (const at::Tensor& o : outs) {
      check_tensor("allgather", o);
      TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                  "terse backend: allgather: every output must have the "
                  "input's size and dtype");
    }
    const std::string codec = codec_for(in, options_.all_gather_codec);
    return enqueue(c10d::OpType::ALLGATHER, outs, [this, in, outs, codec] {
      at::Tensor gathered = at::empty({size_ * in.numel()}, in.options());
      gather(in, gathered, codec, "allgather");
      for (int r = 0; r < size_; ++r) {
        outs[r].view(-1).copy_(gathered.narrow(0, r * in.numel(), in.numel()));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    return enqueue(c10d::OpType::_ALLGATHER_BASE, {output},
                   gather_task(output, input, "all_gather_into_tensor"));
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(),
                "terse backend: all_gather_into_tensor "
                "(coalesced): ",
                outputs.size(), " outputs for ", inputs.size(), " inputs");
    std::vector<std::function<void()>> tasks;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      tasks.push_back(gather_task(outputs[i], inputs[i], "all_gather_into_tensor (coalesced)"));
    }
    return enqueue(c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED, outputs,
                   in_order(std::move(tasks)));
  }

  c10::intrusive_ptr<c10d::Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
    return _allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor out = single("reduce_scatter", outputs);
    TORCH_CHECK_NOT_IMPLEMENTED(inputs.size() == 1,
                                "terse backend: reduce_scatter: ", inputs.size(),
                                " input lists; terse takes one");
    TORCH_CHECK(static_cast<int>(inputs[0].size()) == size_,
                "terse backend: reduce_scatter: ", inputs[0].size(), " inputs for ", size_,
                " ranks");
    for (const at::Tensor& t : inputs[0]) {
      check_tensor("reduce_scatter", t);
      TORCH_CHECK(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(),
                  "terse backend: reduce_scatter: every input must have the "
                  "output's size and "
                  "dtype");
    }
    const bool average = is_average("reduce_scatter", opts.reduceOp);
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : inputs[0]) flat.push_back(t.view(-1));
    const at::Tensor in = at::cat(flat);  // a copy, reduced in place
    const std::string codec = codec_for(in, options_.codec);
    return enqueue(c10d::OpType::REDUCE_SCATTER, {out}, [this, in, out, average, codec] {
      scatter_reduced(in, out, average, codec, "reduce_scatter");
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    const bool average = is_average("reduce_scatter_tensor", opts.reduceOp);
    return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                   reduce_scatter_task(output, input, average, "reduce_scatter_tensor"));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    const char* op = "reduce_scatter_tensor (coalesced)";
    TORCH_CHECK(outputs.size() == inputs.size(), "terse backend: ", op, ": ", outputs.size(),
                " outputs for ", inputs.size(), " inputs");
    const bool average = is_average(op, opts.reduceOp);
    std::vector<std::function<void()>> tasks;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      tasks.push_back(reduce_scatter_task(outputs[i], inputs[i], average, op));
    }
    return enqueue(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, outputs,
                   in_order(std::move(tasks)));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    return _reduce_scatter_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    check_tensor("all_to_all_single", input);
    check_tensor("all_to_all_single", output);
    TORCH_CHECK(input.scalar_type() == output.scalar_type(),
                "terse backend: all_to_all_single: input and output dtypes differ");
    const auto row = input.dim() == 0 ? 1 : input.numel() / std::max<int64_t>(1, input.size(0));
    std::vector<std::size_t> send(size_), recv(size_);
    for (int r = 0; r < size_; ++r) {
      send[r] = static_cast<std::size_t>(input_splits.empty() ? input.numel() / size_
                                                              : input_splits[r] * row);
      recv[r] = static_cast<std::size_t>(output_splits.empty() ? output.numel() / size_
                                                               : output_splits[r] * row);
    }
    TORCH_CHECK(std::accumulate(send.begin(), send.end(), std::size_t{0}) ==
                        static_cast<std::size_t>(input.numel()) &&
                    std::accumulate(recv.begin(), recv.end(), std::size_t{0}) ==
                        static_cast<std::size_t>(output.numel()),
                "terse backend: all_to_all_single: split sizes do not add up to the "
                "tensors' "
                "sizes (or the tensors do not divide evenly by the world size)");
    std::vector<at::Tensor> ins, outs;
    std::size_t in_offset = 0, out_offset = 0;
    const at::Tensor in_flat = input.view(-1), out_flat = output.view(-1);
    for (int r = 0; r < size_; ++r) {
      ins.push_back(in_flat.narrow(0, in_offset, send[r]));
      outs.push_back(out_flat.narrow(0, out_offset, recv[r]));
      in_offset += send[r];
      out_offset += recv[r];
    }
    const std::string codec = all_to_all_codec(input);
    return enqueue(c10d::OpType::ALLTOALL_BASE, {output},
                   [this, ins, outs, codec] { exchange(ins, outs, codec, "all_to_all_single"); });
  }

  c10::intrusive_ptr<c10d::Work> all_to_all_single(at::Tensor& output, at::Tensor& input,
                                                   std::vector<int64_t>& output_splits,
                                                   std::vector<int64_t>& input_splits,
                                                   const c10d::AllToAllOptions& opts) override {
    return alltoall_base(output, input, output_splits, input_splits, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    TORCH_CHECK(
        static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
        "terse backend: all_to_all: takes one input and one output "
        "tensor per rank (",
        size_, "), got ", inputs.size(), " and ", outputs.size());
    std::vector<at::Tensor> ins, outs;
    for (int r = 0; r < size_; ++r) {
      check_tensor("all_to_all", inputs[r]);
      check_tensor("all_to_all", outputs[r]);
      TORCH_CHECK(inputs[r].scalar_type() == outputs[r].scalar_type(),
                  "terse backend: all_to_all: input and output dtypes differ");
      TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type(),
                  "terse backend: all_to_all: the tensors' dtypes differ");
      ins.push_back(inputs[r].view(-1));
      outs.push_back(outputs[r].view(-1));
    }
    const std::string codec = all_to_all_codec(inputs[0]);
    return enqueue(c10d::OpType::ALLTOALL, outputs,
                   [this, ins, outs, codec] { exchange(ins, outs, codec, "all_to_all"); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return enqueue(c10d::OpType::BARRIER, {}, [this] { bytes_->barrier("barrier"); });
  }

  // ---- what terse refuses -----------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>&,
                                                  const c10d::AllreduceOptions&) override {
    refuse("allreduce_sparse", "terse reduces dense tensors");
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>&,
                                        const c10d::ReduceOptions&) override {
    refuse("reduce", "use all_reduce");
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>&,
                                        std::vector<at::Tensor>&,
                                        const c10d::GatherOptions&) override {
    refuse("gather", "use all_gather");
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>&,
                                         std::vector<std::vector<at::Tensor>>&,
                                         const c10d::ScatterOptions&) override {
    refuse("scatter", "use broadcast or all_to_all");
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>&,
                                                     std::vector<at::Tensor>&,
                                                     const c10d::AllgatherOptions&) override {
    refuse("allgather_coalesced", "call all_gather per tensor");
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override {
    refuse("send", "terse runs collectives only (point-to-point: terse.Channel)");
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>&, int, int) override {
    refuse("recv", "terse runs collectives only (point-to-point: terse.Channel)");
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    refuse("recv from any source", "terse runs collectives only");
  }

 private:
  [[noreturn]] void refuse(const char* op, const char* why) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "terse backend: ", op, " is not supported (", why,
                                "); use a process group of another backend for it");
    throw;  // unreachable: TORCH_CHECK_NOT_IMPLEMENTED(false, ...) throws
  }

  static std::function<void()> in_order(std::vector<std::function<void()>> tasks) {
    return [tasks = std::move(tasks)] {
      for (const auto& task : tasks) task();
    };
  }

  // Checks an all-gather of input into output (size times its elements) and returns it.
  std::function<void()> gather_task(const at::Tensor& output, const at::Tensor& input,
                                    const char* op) {
    check_tensor(op, input);
    check_tensor(op, output);
    TORCH_CHECK(
        output.numel() == size_ * input.numel() && output.scalar_type() == input.scalar_type(),
        "terse backend: ", op, ": the output must hold ", size_,
        " times the input's elements, of its dtype");
    const std::string codec = codec_for(input, options_.all_gather_codec);
    return [this, in = input, out = output, codec, op] { gather(in, out.view(-1), codec, op); };
  }

  // Checks a reduce-scatter of input (size times output's elements) and returns it; the input is
  // copied now, so the caller may reuse it at once.
  std::function<void()> reduce_scatter_task(const at::Tensor& output, const at::Tensor& input,
                                            bool average, const char* op) {
    check_tensor(op, input);
    check_tensor(op, output);
    TORCH_CHECK(
        input.numel() == size_ * output.numel() && output.scalar_type() == input.scalar_type(),
        "terse backend: ", op, ": the input must hold ", size_,
        " times the output's elements, of its dtype");
    const std::string codec = codec_for(input, options_.codec);
    return [this, in = input.clone(), out = output, average, codec, op] {
      scatter_reduced(in, out, average, codec, op);
    };
  }

  // The codec of an all-to-all's large blocks: none for exact calls and other dtypes.
  std::string all_to_all_codec(const at::Tensor& t) const {
    if (exact_calls || !engine_dtype(t.scalar_type())) return "none";
    return options_.all_to_all_codec;
  }

  std::string codec_for(const at::Tensor& t, const std::string& codec) const {
    if (exact_calls || !engine_dtype(t.scalar_type())) return "none";
    return static_cast<std::size_t>(t.nbytes()) >= options_.min_bytes ? codec : "none";
  }

  static std::string name(const char* op, const at::Tensor& t) {
    return std::string(op) + ":" + c10::toString(t.scalar_type()) + ":" + std::to_string(t.numel());
  }

  // t = the sum (or average) over ranks, in place.
  void reduce(const at::Tensor& t, bool average, const std::string& codec, const char* op) {
    if (engine_dtype(t.scalar_type())) {
      AllreduceOptions o;
      o.codec = codec;
      o.average = average;
      engine_
          ->allreduce(name(op, t), TensorView(t.data_ptr(), t.numel(), to_dtype(t.scalar_type())),
                      o)
          .wait();
      return;
    }
    TORCH_CHECK_NOT_IMPLEMENTED(!average || at::isFloatingType(t.scalar_type()),
                                "terse backend: ", op, " with AVG of ", t.scalar_type(),
                                " tensors is not supported (integers average to fractions)");
    // Other dtypes: gathered raw and summed in rank order, the same on every rank.
    at::Tensor all = at::empty({size_, t.numel()}, t.options());
    gather(t, all.view(-1), "none", op);
    at::Tensor sum = all.sum(0);
    if (average) sum.div_(size_);
    t.view(-1).copy_(sum);
  }

  // out (n elements) = this rank's shard of the reduction of in (size * n elements, a scratch
  // copy): the engine's reduce-scatter for its dtypes (raw: the exact rank-order sum; with a
  // codec, its default strategy, each contribution quantized once); other dtypes are reduced
  // whole and sliced.
  void scatter_reduced(const at::Tensor& in, const at::Tensor& out, bool average,
                       const std::string& codec, const char* op) {
    if (engine_dtype(in.scalar_type())) {
      CollectiveOptions o;
      o.codec = codec;
      o.average = average;
      engine_
          ->reduce_scatter(name(op, in), view_of(in), view_of(out), o)
          .wait();
      return;
    }
    reduce(in, average, codec, op);
    out.view(-1).copy_(in.view(-1).narrow(0, rank_ * out.numel(), out.numel()));
  }

  // out (size * n elements) = every rank's in, in rank order: with a codec, the engine's
  // all-gather (each shard encoded once by its owner, the same bytes decoded by every rank, so
  // out is identical everywhere); raw, the bytes through the byte communicator.
  void gather(const at::Tensor& in, const at::Tensor& out, const std::string& codec,
              const char* op) {
    if (codec != "none" && engine_dtype(in.scalar_type())) {
      CollectiveOptions o;
      o.codec = codec;
      engine_->all_gather(name(op, in), view_of(in), view_of(out), o).wait();
      return;
    }
    const std::vector<std::size_t> sizes(size_, static_cast<std::size_t>(in.nbytes()));
    bytes_->allgatherv(bytes_of(in), bytes_of(out), sizes, op);
  }

  static TensorView view_of(const at::Tensor& t) {
    return TensorView(t.data_ptr(), t.numel(), to_dtype(t.scalar_type()));
  }

  // outs[r] = rank r's ins[this rank]. With a codec, the blocks of at least min_bytes go through
  // the engine's all_to_all (under one name per operation and dtype, so that calls with other
  // splits are the same tensor to it) and the others raw through the byte communicator, both at
  // once; without, every block raw.
  void exchange(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs,
                const std::string& codec, const char* op) {
    TORCH_CHECK(outs[rank_].numel() == ins[rank_].numel(), "terse backend: ", op, ": rank ", rank_,
                " sends itself ", ins[rank_].numel(), " elements into ", outs[rank_].numel());
    // A block's size is known alike to its sender (what it sends) and its receiver (what it
    // expects); where the splits disagree, the engine's all_to_all reports the mismatch.
    auto coded = [&](const at::Tensor& t) {
      return codec != "none" && static_cast<std::size_t>(t.nbytes()) >= options_.min_bytes;
    };
    std::vector<std::size_t> send(size_, 0), recv(size_, 0);
    std::vector<at::Tensor> send_blocks, recv_blocks;
    for (int r = 0; r < size_; ++r) {
      if (coded(ins[r])) {
        send[r] = static_cast<std::size_t>(ins[r].numel());
        send_blocks.push_back(ins[r]);
      }
      if (coded(outs[r])) {
        recv[r] = static_cast<std::size_t>(outs[r].numel());
        recv_blocks.push_back(outs[r]);
      }
    }
    Handle engine_done;
    at::Tensor packed_in, packed_out;
    bool out_in_place = true;
    if (codec != "none") {
      packed_in = packed(send_blocks, ins[0], true);
      packed_out = packed(recv_blocks, outs[0], false);
      out_in_place = recv_blocks.empty() || packed_out.data_ptr() == recv_blocks[0].data_ptr();
      CollectiveOptions o;
      o.codec = codec;
      engine_done = engine_->all_to_all(std::string(op) + ":" + c10::toString(ins[0].scalar_type()),
                                        view_of(packed_in), send, view_of(packed_out), recv, o);
    }
    try {
      const std::uint64_t tag = ++exchanges_;
      std::vector<Request> requests;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) {
          if (send[r] == 0) outs[r].copy_(ins[r]);
          continue;
        }
        if (recv[r] == 0) requests.push_back(bytes_->recv(r, tag, bytes_of(outs[r]), op));
        if (send[r] == 0) requests.push_back(bytes_->send(r, tag, bytes_of(ins[r]), op));
      }
      for (Request& request : requests) request.wait();
    } catch (...) {
      // The engine may still use the packed tensors: let it finish before they go. Its error
      // (splits that disagree) explains a raw block that never came better than the timeout.
      if (codec != "none") engine_done.wait();
      throw;
    }
    if (codec == "none") return;
    engine_done.wait();
    if (out_in_place) return;
    std::int64_t offset = 0;
    for (const at::Tensor& block : recv_blocks) {
      block.copy_(packed_out.narrow(0, offset, block.numel()));
      offset += block.numel();
    }
  }

  // The blocks as one flat tensor: a view of them when they lie one after another in memory (an
  // all_to_all_single whose blocks all take the codec), else a new tensor holding a copy of them
  // (`copy`) or nothing yet; `like` gives the dtype.
  static at::Tensor packed(const std::vector<at::Tensor>& blocks, const at::Tensor& like,
                           bool copy) {
    if (blocks.empty()) return at::empty({0}, like.options());
    std::int64_t total = 0;
    bool adjacent = true;
    const auto* next = static_cast<const std::byte*>(blocks[0].data_ptr());
    for (const at::Tensor& b : blocks) {
      adjacent = adjacent && static_cast<const std::byte*>(b.data_ptr()) == next;
      next = static_cast<const std::byte*>(b.data_ptr()) + b.nbytes();
      total += b.numel();
    }
    if (adjacent) return at::from_blob(blocks[0].data_ptr(), {total}, blocks[0].options());
    return copy ? at::cat(blocks) : at::empty({total}, blocks[0].options());
  }

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<void()> task) {
    auto work = c10::make_intrusive<TerseWork>(type, std::move(outputs));
    std::vector<c10::intrusive_ptr<TerseWork>> finished;  // released here, in a Python thread
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished.swap(finished_);
      queue_.push_back(Queued{work, std::move(task)});
    }
    ready_.notify_one();
    return work;
  }

  // Runs the queued operations. This thread never drops the last reference to a tensor after
  // completing a Work: releasing a tensor that has a Python object takes the GIL, and once the
  // Work completes, the Python thread waiting on it may raise, end the program and finalize the
  // interpreter, which ends any other thread that then asks for the GIL with pthread_exit, whose
  // unwinding through this thread's noexcept frames calls std::terminate. So an operation's
  // captured tensors are dropped before its Work completes, and the Work itself is handed to
  // finished_, which the next enqueue() or the destructor clears.
  void run() {
    for (;;) {
      Queued next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and every queued operation ran
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        next.task();
      } catch (...) {
        error = std::current_exception();
      }
      next.task = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        finished_.push_back(next.work);
      }
      if (error) {
        next.work->fail(error);
      } else {
        next.work->complete();
      }
      next.work.reset();  // finished_ holds it
    }
  }

  BackendOptions options_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Communicator> bytes_;
  std::uint64_t exchanges_ = 0;

  std::mutex mutex_;
  std::condition_variable ready_;
  struct Queued {
    c10::intrusive_ptr<TerseWork> work;
    std::function<void()> task;
  };
  std::deque<Queued> queue_;
  std::vector<c10::intrusive_ptr<TerseWork>> finished_;  // completed; released by Python threads
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace
}  // namespace terse::backend

PYBIND11_MODULE(_backend, m) {
  namespace py = pybind11;
  using terse::backend::BackendOptions;
  using terse::backend::TerseBackend;
  py::module_::import("torch.distributed");
  terse::set_process_options(terse::process_options_from_environment());
  py::class_<TerseBackend, c10d::Backend, c10::intrusive_ptr<TerseBackend>>(m, "TerseBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::string codec, std::string all_gather_codec,
                       std::string all_to_all_codec, std::size_t min_bytes, int threads,
                       double timeout_seconds) {
             BackendOptions o;
             o.codec = std::move(codec);
             o.all_gather_codec = std::move(all_gather_codec);
             o.all_to_all_codec = std::move(all_to_all_codec);
             o.min_bytes = min_bytes;
             o.threads = threads;
             o.timeout_seconds = timeout_seconds;
             return c10::make_intrusive<TerseBackend>(store, rank, size, std::move(o));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("codec"),
           py::arg("all_gather_codec"), py::arg("all_to_all_codec"), py::arg("min_bytes"),
           py::arg("threads"), py::arg("timeout_seconds"),
           py::call_guard<py::gil_scoped_release>());
  m.def(
      "set_exact", [](bool exact) { terse::backend::exact_calls = exact; }, py::arg("exact"),
      "Marks this thread's calls exact (raw) or not.");
  m.def("exact", [] { return terse::backend::exact_calls; });
}
