#include <iostream>
#include "runtime/compat.h"
#include "runtime/threads.h"
int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  std::cout << memtune::configure_threads(0) << " torch " << memtune::compat::torch_version() << "\n";
}
