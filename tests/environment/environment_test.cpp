// The edge (terse/environment.h): each variable resolves into its option, leaves a value the
// caller gave alone, and a bad value of any of them is one error naming the variable, its
// value and what is allowed.
#include "terse/environment.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "terse/error.h"

namespace terse {
namespace {

using namespace std::chrono_literals;

// Sets an environment variable for one scope (unsets it where `value` is null).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The message of what `read` throws with `name` set to `value`: it must be InvalidArgument.
std::string rejection(const char* name, const char* value, const std::function<void()>& read) {
  const ScopedEnv env(name, value);
  try {
    read();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << name << "='" << value << "' threw another error: " << e.what();
    return {};
  }
  ADD_FAILURE() << name << "='" << value << "' was accepted";
  return {};
}

TEST(Environment, ABadValueOfAnyVariableNamesTheVariableItsValueAndWhatIsAllowed) {
  const auto engine = [] { engine_options_from_environment(); };
  const auto planner = [] { planner_options_from_environment(); };
  const auto comm = [] { communicator_options_from_environment(); };
  const auto process = [] { process_options_from_environment(); };
  struct Case {
    const char* name;
    const char* value;
    std::function<void()> read;
    const char* allowed;  // a piece of what the message says is allowed
  };
  const Case cases[] = {
      {"TERSE_THREADS", "many", engine, "1..256"},
      {"TERSE_THREADS", "0", engine, "1..256"},
      {"TERSE_THREADS", "257", engine, "1..256"},
      {"TERSE_THREADS", "4x", engine, "1..256"},
      {"TERSE_TIMEOUT", "soon", comm, "seconds above 0"},
      {"TERSE_TIMEOUT", "0", comm, "seconds above 0"},
      {"TERSE_TIMEOUT", "-1", comm, "seconds above 0"},
      {"TERSE_TIMEOUT", "inf", comm, "seconds above 0"},
      {"TERSE_PLAN_CODECS", "nosuchcodec", planner, "codec specs"},
      {"TERSE_PLAN_CODECS", ";", planner, "codec specs"},
      {"TERSE_PLAN_HEAVY_CODECS", "topk:ratio=inf", planner, "codec specs"},
      {"TERSE_PLAN_LOG", "yes please", planner, "1"},
      {"TERSE_PLAN_EXPLORE", "-1", planner, "0 (no exploration) or more"},
      {"TERSE_PLAN_EXPLORE", "long", planner, "0 (no exploration) or more"},
      {"TERSE_SCHED", "fast", process, "normal"},
      {"TERSE_RETAIN_MB", "-5", process, "MiB"},
      {"TERSE_RETAIN_MB", "lots", process, "MiB"},
  };
  for (const Case& c : cases) {
    const std::string error = rejection(c.name, c.value, c.read);
    EXPECT_NE(error.find(std::string(c.name) + "='" + c.value + "'"), std::string::npos) << error;
    EXPECT_NE(error.find("allowed"), std::string::npos) << error;
    EXPECT_NE(error.find(c.allowed), std::string::npos) << error;
  }
  // The planner's variables are the engine's too (the planner it makes), and a bad value is
  // an error even where the caller's own value stands.
  EXPECT_NE(rejection("TERSE_PLAN_LOG", "2", engine).find("TERSE_PLAN_LOG='2'"),
            std::string::npos);
  EngineOptions threads;
  threads.threads = 2;
  EXPECT_NE(rejection("TERSE_THREADS", "x", [&] { engine_options_from_environment(threads); })
                .find("TERSE_THREADS='x'"),
            std::string::npos);
}

TEST(Environment, EachVariableSetsItsOptionWhereTheCallerLeftIt) {
  {
    const ScopedEnv threads("TERSE_THREADS", "3"), trace("TERSE_TRACE", "/tmp/t");
    const EngineOptions o = engine_options_from_environment();
    EXPECT_EQ(o.threads, 3);
    EXPECT_EQ(o.trace_directory, "/tmp/t");
    EngineOptions given;
    given.threads = 5;
    given.trace_directory = "/elsewhere";
    const EngineOptions kept = engine_options_from_environment(given);
    EXPECT_EQ(kept.threads, 5);
    EXPECT_EQ(kept.trace_directory, "/elsewhere");
  }
  {
    const ScopedEnv threads("TERSE_THREADS", nullptr), trace("TERSE_TRACE", "");
    const EngineOptions o = engine_options_from_environment();
    EXPECT_EQ(o.threads, 0);  // the engine's default
    EXPECT_TRUE(o.trace_directory.empty());
  }
  {
    const ScopedEnv timeout("TERSE_TIMEOUT", "2.5"), ifname("TERSE_IFNAME", "eth7"),
        gloo("GLOO_SOCKET_IFNAME", "eth9");
    const CommunicatorOptions o = communicator_options_from_environment();
    EXPECT_EQ(o.timeout, 2500ms);
    EXPECT_EQ(o.interface, "eth7");
    CommunicatorOptions given;
    given.timeout = 3s;
    given.interface = "lo";
    EXPECT_EQ(communicator_options_from_environment(given).timeout, 3s);
    EXPECT_EQ(communicator_options_from_environment(given).interface, "lo");
  }
  {
    const ScopedEnv ifname("TERSE_IFNAME", nullptr), gloo("GLOO_SOCKET_IFNAME", "eth9");
    EXPECT_EQ(communicator_options_from_environment().interface, "eth9");
  }
  {
    const ScopedEnv secret("TERSE_JOB_SECRET", "3f2a");
    EXPECT_EQ(communicator_options_from_environment().secret, "3f2a");
    CommunicatorOptions given;
    given.secret = "mine";
    EXPECT_EQ(communicator_options_from_environment(given).secret, "mine");
  }
  {
    const ScopedEnv secret("TERSE_JOB_SECRET", "");
    EXPECT_TRUE(communicator_options_from_environment().secret.empty());
  }
  {
    const ScopedEnv light("TERSE_PLAN_CODECS", "fp16;minmax8:ef=1"),
        heavy("TERSE_PLAN_HEAVY_CODECS", "onebit:ef=1 powersgd"), log("TERSE_PLAN_LOG", "1"),
        explore("TERSE_PLAN_EXPLORE", "0.5"), xdg("XDG_CACHE_HOME", "/xdg");
    const PlannerOptions o = planner_options_from_environment();
    EXPECT_EQ(o.allowed, (std::vector<std::string>{"fp16", "minmax8:ef=1"}));
    EXPECT_EQ(o.heavy, (std::vector<std::string>{"onebit:ef=1", "powersgd"}));
    EXPECT_TRUE(o.log);
    EXPECT_EQ(o.explore_seconds, 0.5);
    EXPECT_EQ(o.cache_directory, "/xdg/terse");
    EXPECT_EQ(engine_options_from_environment().planner_options.allowed, o.allowed);
    PlannerOptions given;
    given.allowed = {"bf16"};
    EXPECT_EQ(planner_options_from_environment(given).allowed,
              (std::vector<std::string>{"bf16"}));
  }
  {
    const ScopedEnv xdg("XDG_CACHE_HOME", nullptr), home("HOME", "/home/u");
    EXPECT_EQ(planner_options_from_environment().cache_directory, "/home/u/.cache/terse");
  }
  {
    const ScopedEnv sched("TERSE_SCHED", "normal"), retain("TERSE_RETAIN_MB", "3"),
        omp("OMP_NUM_THREADS", "1");
    const ProcessOptions o = process_options_from_environment();
    EXPECT_FALSE(o.batch_scheduling);
    EXPECT_EQ(o.retained_bytes, std::size_t{3} << 20);
    EXPECT_TRUE(o.blas_threads_chosen);
  }
  {
    const ScopedEnv sched("TERSE_SCHED", "batch"), retain("TERSE_RETAIN_MB", nullptr),
        omp("OMP_NUM_THREADS", nullptr), openblas("OPENBLAS_NUM_THREADS", nullptr),
        gotoblas("GOTO_NUM_THREADS", nullptr);
    const ProcessOptions o = process_options_from_environment();
    EXPECT_TRUE(o.batch_scheduling);
    EXPECT_FALSE(o.retained_bytes.has_value());
    EXPECT_FALSE(o.blas_threads_chosen);
  }
}

}  // namespace
}  // namespace terse
