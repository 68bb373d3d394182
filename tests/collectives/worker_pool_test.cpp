// The worker pool that runs the engine's partition tasks and a Channel's completions.
#include "engine/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace terse::engine {
namespace {

using namespace std::chrono_literals;

TEST(WorkerPool, OneWorkerRunsTasksInTheOrderTheyWereQueued) {
  std::vector<int> order;
  {
    WorkerPool pool(1);
    std::vector<WorkerPool::Task> batch;
    for (int i = 0; i < 50; ++i) {
      batch.push_back([&order, i](std::uint32_t, Workspace&) { order.push_back(i); });
    }
    pool.submit(std::move(batch));
    for (int i = 50; i < 100; ++i) {
      pool.submit([&order, i](std::uint32_t, Workspace&) { order.push_back(i); });
    }
  }  // stop(): every queued task runs first
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(WorkerPool, StopRunsEveryQueuedTaskBeforeTheWorkersEnd) {
  std::atomic<int> ran{0};
  WorkerPool pool(2);
  for (int i = 0; i < 20; ++i) {
    pool.submit([&ran](std::uint32_t, Workspace&) {
      std::this_thread::sleep_for(1ms);
      ++ran;
    });
  }
  pool.stop();
  EXPECT_EQ(ran.load(), 20);
  pool.submit([&ran](std::uint32_t, Workspace&) { ++ran; });  // after stop: never runs
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(ran.load(), 20);
}

// A task that needed a large scratch slot on one worker makes the idle worker grow its own
// ahead of time, so that the next task there does not pay for fresh pages.
TEST(WorkerPool, AnIdleWorkerGrowsItsScratchToWhatAnotherWorkerNeeded) {
  constexpr std::size_t kBytes = std::size_t{4} << 20;
  WorkerPool pool(2);
  pool.submit([](std::uint32_t, Workspace& w) { w.get<std::byte>(3, kBytes); });
  // Two tasks that wait for each other run on different workers: poll with such pairs until
  // both workers' slot 3 has grown (each idle worker catches up between tasks).
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  bool both = false;
  while (!both && std::chrono::steady_clock::now() < deadline) {
    struct Probe {  // shared with the tasks, which may still be unlocking it when this returns
      std::mutex mu;
      std::condition_variable cv;
      int arrived = 0, done = 0;
      std::size_t grown[2] = {0, 0};
      std::uint32_t workers[2] = {0, 0};
    };
    auto probe = std::make_shared<Probe>();
    for (int k = 0; k < 2; ++k) {
      pool.submit([probe, k](std::uint32_t worker, Workspace& w) {
        std::unique_lock lock(probe->mu);
        probe->grown[k] = w.slot_bytes(3);
        probe->workers[k] = worker;
        ++probe->arrived;
        probe->cv.notify_all();
        probe->cv.wait(lock, [&] { return probe->arrived == 2; });
        ++probe->done;
        probe->cv.notify_all();
      });
    }
    std::unique_lock lock(probe->mu);
    probe->cv.wait(lock, [&] { return probe->done == 2; });
    ASSERT_NE(probe->workers[0], probe->workers[1]);
    both = probe->grown[0] >= kBytes && probe->grown[1] >= kBytes;
    lock.unlock();
    if (!both) std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(both);
}

}  // namespace
}  // namespace terse::engine
