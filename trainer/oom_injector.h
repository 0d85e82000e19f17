#pragma once
// memory.inject_oom: out-of-memory errors at chosen points of chosen steps, so the
// supervisor's recovery (and each rung of its ladder) is tested with the real code path.
#include <cstdint>
#include <string>
#include <vector>

namespace memtune::trainer {

// "STEP:PHASE[:RANK],..." with PHASE forward|backward|optimizer (parse_inject_oom). Each
// point fires once, on one attempt: the retry of the same step runs clean, unless the point
// is listed again ("1:forward,1:forward" fails step 1's first two attempts).
class OomInjector {
 public:
  OomInjector(const std::string& spec, int rank);

  // When (step, phase) is a point: forward and backward arm the allocator so that their next
  // allocation fails inside an op, as a real OOM does. The optimizer phase may allocate
  // nothing at all on the CPU (one-pass AdamW, the norm summed in place), so its OOM is
  // raised at the phase's start, with the allocator's error type.
  void at(int64_t step, const char* phase);

 private:
  struct Point {
    int64_t step;
    std::string phase;
    bool fired = false;
  };
  std::vector<Point> points_;
};

}  // namespace memtune::trainer
