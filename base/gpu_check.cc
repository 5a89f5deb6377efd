// The message text of PORTER_GPU_CHECK and PORTER_GPU_WARN, out of line so that the
// macros' users (.cu files among them) need neither <sstream> nor spdlog.
#include "base/gpu_check.h"

#include "base/check.h"
#include "base/log.h"

namespace porter::detail {

std::string gpu_failure_message(std::string_view stmt, int device, std::string_view file,
                                int line, const char* name, const char* detail) {
  return str_cat(stmt, " failed on cuda:", device, " at ", file, ":", line, ": ", name, " (",
                 detail, ")");
}

void log_gpu_failure(std::string_view stmt, std::string_view file, int line, const char* name,
                     const char* detail) {
  PORTER_LOG_ERROR("{} failed at {}:{}: {} ({})", stmt, file, line,
                   name != nullptr ? name : "(null)", detail != nullptr ? detail : "(null)");
}

}  // namespace porter::detail
