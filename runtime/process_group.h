#pragma once
// Several processes training one model: a c10d process group (a TCPStore hosted by rank 0;
// Gloo on CPU, NCCL on CUDA) with the few collectives data-parallel training needs.
//
// Every collective has the configured timeout. Before entering one, each rank marks
// "arrived/<seq>/<rank>" in the store; when the collective fails or times out, the
// UserError names the ranks whose mark is missing (the ones that never got there).
// All ranks must call the collectives in the same order with the same shapes.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "runtime/dist_env.h"

namespace memtune {

struct ProcessGroupOptions {
  std::string backend = "auto";  // auto (nccl on CUDA devices, gloo on CPU)|gloo|nccl
  double timeout_s = 300;        // each collective
  double join_timeout_s = 0;     // the rendezvous (ranks start at different times); 0: timeout_s
  int64_t bucket_size_mb = 25;   // allreduce_sum flattens tensors into buckets of this size
  std::string device = "cpu";    // "cpu" or "cuda:<local_rank>": where collectives run
};

enum class ReduceOp { sum, max, min };

class ProcessGroup {
 public:
  // Joins the group described by `env` (blocks until every rank has joined, or throws a
  // UserError after the timeout saying how many joined).
  ProcessGroup(const DistEnv& env, const ProcessGroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Whether this build has the backend: "gloo" when gloo's headers were found at build
  // time, "nccl" in a CUDA build.
  static bool backend_built(const std::string& backend);

  int rank() const;
  int world_size() const;
  const std::string& backend() const;  // "gloo" or "nccl"
  c10::Device device() const;          // where the collectives run

  // Sums the tensors in place over all ranks. Tensors are grouped by dtype and flattened
  // into buckets of about bucket_size_mb (one flat buffer per bucket: copy in, allreduce,
  // copy out); the buckets' reductions run concurrently. The flat buffers are kept while
  // the list's layout stays the same, so later calls allocate nothing. `host_buffers`: the
  // flat buffers in host memory outside the device budget (runtime/offload.h), for tensors
  // that live there (offloaded gradients); the group must run on the CPU.
  void allreduce_sum(const std::vector<at::Tensor>& tensors, bool host_buffers = false);

  // Element-wise reduction of a small vector over all ranks.
  std::vector<int64_t> allreduce(std::vector<int64_t> values, ReduceOp op);
  std::vector<double> allreduce(std::vector<double> values, ReduceOp op);

  // Copies root's tensor into every rank's (in place; same shape and dtype everywhere).
  void broadcast(const at::Tensor& tensor, int root = 0);

  // A collective started and not yet finished. wait() finishes it (the tensor is not read
  // before); a Pending dropped unwaited is waited for then, so a collective every rank started
  // always completes on every rank.
  class Pending {
   public:
    Pending();
    ~Pending();
    Pending(Pending&&) noexcept;
    Pending& operator=(Pending&&) noexcept;
    void wait();

   private:
    friend class ProcessGroup;
    struct State;
    std::unique_ptr<State> state_;
  };
  // broadcast, started: the tensor (contiguous, on the group's device) holds root's values
  // once the returned Pending is waited for. Every rank starts it at the same point.
  Pending broadcast_async(const at::Tensor& tensor, int root);
  // Sums the tensor over all ranks into root's (in place); the other ranks' copies are left
  // unspecified. A contiguous tensor on the group's device.
  void reduce_sum(const at::Tensor& tensor, int root);
  void barrier();

  // One memory decision for all ranks: (any rank ran out of memory, the smallest
  // proposal). A single small allreduce; meant for Supervisor::set_agreement.
  std::pair<bool, int64_t> agree(bool oom, int64_t proposal);

  // Collectives entered so far (the <seq> of the arrival marks).
  int64_t sequence() const;

  // Bytes each rank has sent in the collectives so far, indexed by rank (every rank knows
  // every rank's figure: all run the same collectives on the same sizes). Counted per
  // collective of N bytes by the ring algorithms Gloo and NCCL run: allreduce 2 (W-1)/W N per
  // rank; reduce_sum (a reduce-scatter, then the parts to the root) N per rank, (W-1)/W N
  // from the root; broadcast: the root sends N to each of the W-1 others (Gloo's one-to-all).
  // Barriers and the store's arrival marks count 0. bench/sharding_memory.cpp sets the
  // count beside the bytes Gloo's sockets wrote.
  std::vector<int64_t> sent_bytes() const;

  // Keys in the rendezvous store (rank 0's TCPStore): a fixed number once connected, however
  // many collectives run.
  int64_t store_keys() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune
