#pragma once
// The memtune command line. memtune_main is the whole program; a user who registers their
// own architecture links it with their source file (examples/custom_model/).

namespace memtune::cli {

int memtune_main(int argc, char** argv);

}  // namespace memtune::cli
