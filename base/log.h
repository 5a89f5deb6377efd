// porter's one logger (spdlog). Every line carries the rank of the thread that wrote it, so
// that ranks running as threads in one process (the tests) and as processes read the same.
#pragma once

#include <memory>

#include <spdlog/formatter.h>
#include <spdlog/logger.h>

namespace porter::log {

// The process-wide porter logger. Created on first use with the rank from $RANK (or
// $OMPI_COMM_WORLD_RANK), level from $PORTER_LOG_LEVEL (trace..off, default info).
spdlog::logger& logger();

// The rank printed on lines written by the calling thread; overrides the process rank.
void set_thread_rank(int rank);
// The rank printed on lines of threads that did not set their own.
void set_process_rank(int rank);
int current_rank();

void set_level(spdlog::level::level_enum level);

// porter's line format ("[time] [porter rank R] [level] message"), for extra sinks.
std::unique_ptr<spdlog::formatter> make_formatter();

}  // namespace porter::log

#define PORTER_LOG_TRACE(...) ::porter::log::logger().trace(__VA_ARGS__)
#define PORTER_LOG_DEBUG(...) ::porter::log::logger().debug(__VA_ARGS__)
#define PORTER_LOG_INFO(...) ::porter::log::logger().info(__VA_ARGS__)
#define PORTER_LOG_WARN(...) ::porter::log::logger().warn(__VA_ARGS__)
#define PORTER_LOG_ERROR(...) ::porter::log::logger().error(__VA_ARGS__)
