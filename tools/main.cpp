#include "tools/cli.h"

int main(int argc, char** argv) { return memtune::cli::memtune_main(argc, argv); }
