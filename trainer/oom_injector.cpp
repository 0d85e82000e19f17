#include "trainer/oom_injector.h"

#include "runtime/compat.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/error.h"
#include "trainer/config.h"

namespace memtune::trainer {

OomInjector::OomInjector(const std::string& spec, int rank) {
  const auto parsed = parse_inject_oom(spec);  // validated with the config
  MEMTUNE_INTERNAL_ASSERT(parsed.has_value(), "memory.inject_oom '", spec, "' passed validation");
  for (const OomPoint& p : *parsed)
    if (p.rank < 0 || p.rank == rank) points_.push_back({p.step, p.phase});
}

void OomInjector::at(int64_t step, const char* phase) {
  for (auto& p : points_)
    if (!p.fired && p.step == step && p.phase == phase) {
      p.fired = true;
      if (p.phase == "optimizer")
        compat::throw_out_of_memory(str_cat("out of memory at the optimizer phase of step ", step,
                                            " (injected by memory.inject_oom)"));
      inject_oom_on_next_alloc();
      return;
    }
}

}  // namespace memtune::trainer
