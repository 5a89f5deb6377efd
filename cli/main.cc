// The `porter` executable: everything happens in porter::cli::run.
#include <iostream>

#include "cli/app.h"

int main(int argc, char** argv) { return porter::cli::run(argc, argv, std::cout, std::cerr); }
