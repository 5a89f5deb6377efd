// Shared by the cli tests: runs the `porter` command line in-process and captures its output.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "cli/app.h"

namespace porter::cli::testing {

struct CliRun {
  int rc;
  std::string out;
  std::string err;
};

// `porter <args...>`; `tty` makes progress output behave as on a terminal.
inline CliRun porter(std::vector<std::string> args, bool tty = false) {
  args.insert(args.begin(), "porter");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int rc = run(static_cast<int>(argv.size()), argv.data(), out, err, tty);
  return CliRun{rc, out.str(), err.str()};
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace porter::cli::testing
