// The `porter` executable: everything happens in porter::cli::run.
#include <iostream>

#include <unistd.h>

#include "cli/app.h"

int main(int argc, char** argv) {
  return porter::cli::run(argc, argv, std::cout, std::cerr, ::isatty(STDERR_FILENO) == 1);
}
