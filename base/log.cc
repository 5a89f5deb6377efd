// The porter logger: a stderr sink with a custom %R flag that prints the writing thread's rank.
#include "base/log.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace porter::log {
namespace {

constexpr int kNoRank = -1;
thread_local int t_thread_rank = kNoRank;
std::atomic<int> g_process_rank{kNoRank};

int rank_from_env() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
      char* end = nullptr;
      long r = std::strtol(v, &end, 10);
      if (end != nullptr && *end == '\0' && r >= 0) return static_cast<int>(r);
    }
  }
  return 0;
}

class RankFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    std::string s = std::to_string(current_rank());
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<RankFlag>();
  }
};

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("porter", sink);
  logger->set_formatter(make_formatter());
  logger->set_level(spdlog::level::info);
  if (const char* lvl = std::getenv("PORTER_LOG_LEVEL"); lvl != nullptr) {
    logger->set_level(spdlog::level::from_str(lvl));
  }
  logger->flush_on(spdlog::level::warn);
  return logger;
}

}  // namespace

std::unique_ptr<spdlog::formatter> make_formatter() {
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<RankFlag>('R').set_pattern("[%H:%M:%S.%e] [porter rank %R] [%^%l%$] %v");
  return formatter;
}

spdlog::logger& logger() {
  // A function-local static: initialised once, thread-safe, never reassigned.
  static std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}

void set_thread_rank(int rank) { t_thread_rank = rank; }
void set_process_rank(int rank) { g_process_rank.store(rank, std::memory_order_relaxed); }

int current_rank() {
  if (t_thread_rank != kNoRank) return t_thread_rank;
  int r = g_process_rank.load(std::memory_order_relaxed);
  if (r != kNoRank) return r;
  static const int env_rank = rank_from_env();
  return env_rank;
}

void set_level(spdlog::level::level_enum level) { logger().set_level(level); }

}  // namespace porter::log
