// Helpers for tests that start real processes: run a shell command and capture its output,
// make a temporary directory.
#pragma once

#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>

#include <sched.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

namespace terse::testing {

struct Result {
  int code = -1;
  std::string output;
  double seconds = 0;
};

// Runs a shell command, capturing stdout and stderr together.
inline Result shell(const std::string& command) {
  Result r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

inline std::string temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "terse-test-XXXXXX").string();
  char* d = ::mkdtemp(pattern.data());
  return d != nullptr ? std::string(d) : std::string();
}

// True if this process may create network namespaces (root, iproute2 present).
inline bool can_emulate_cluster() {
  return ::geteuid() == 0 && shell("ip netns list").code == 0;
}

// The scheduling policy (SCHED_OTHER, SCHED_BATCH, ...) of every thread of this process, by
// thread id.
inline std::map<pid_t, int> thread_policies() {
  std::map<pid_t, int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const pid_t tid = static_cast<pid_t>(std::stol(e.path().filename().string()));
    const int policy = ::sched_getscheduler(tid);
    if (policy >= 0) out[tid] = policy;  // a thread that ended meanwhile is left out
  }
  return out;
}

}  // namespace terse::testing
