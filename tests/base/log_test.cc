// Every log line carries the rank of the thread that wrote it.
#include "base/log.h"

#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

namespace porter::log {
namespace {

TEST(LogTest, LinesCarryTheThreadRank) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_formatter(make_formatter());
  auto& lg = logger();
  lg.sinks().push_back(sink);
  std::vector<std::thread> threads;
  for (int r = 5; r < 8; ++r) {
    threads.emplace_back([r] {
      set_thread_rank(r);
      PORTER_LOG_INFO("hello from {}", r);
    });
  }
  for (auto& t : threads) t.join();
  lg.sinks().pop_back();
  std::string text = out.str();
  for (int r = 5; r < 8; ++r) {
    std::string want = "[porter rank " + std::to_string(r) + "] [info] hello from " + std::to_string(r);
    EXPECT_THAT(text, ::testing::HasSubstr(want));
  }
}

}  // namespace
}  // namespace porter::log
