#pragma once
// ZeRO across data-parallel ranks (distributed.sharding), stages 1 and 2 (and the trainable
// part of 3: the frozen base's part is trainer/layer_shards.h).
//
// The trainable tensors are partitioned by whole tensors among the W ranks (balanced by
// element count, the same on every rank): rank r owns its part's optimizer state and updates
// only those tensors (Optimizer's `owned` flags). The trainer's step then runs:
//   backward          each micro-batch's backward. gradients (with the gradients on the
//                     device): each bucket reduced to its owner as backward completes it (a
//                     reduce-scatter), so a rank holds the sums of its own tensors and the
//                     bucket in flight, never every gradient (ZeRO-2); otherwise backward alone
//   reduce_gradients  none, optimizer: every gradient all-reduced (as without sharding);
//                     gradients: what backward did not reduce (gradients in host memory,
//                     trainer/gradient_offload.h) reduced to the owners bucket by bucket and
//                     dropped on the other ranks once reduced; then each rank unscales its
//                     own and their squared norms are all-reduced
//   check_gradients   unscaled, inf/nan on any rank, and the global L2 norm, for clipping
// No collective follows a point where one rank alone may run out of memory without the
// others learning it in that collective: the supervisor agrees on an out-of-memory error
// after the stage, and a rank that left early would pair its agreement with another rank's
// collective. backward's reductions run inside the stage, so each starts with that same
// agreement (as a sharded layer's gather does, trainer/layer_shards.h): when some rank ran
// out of memory, every rank throws an out-of-memory error from there and the supervisor
// takes the agreement as made (take_agreed_oom).
//   step              the optimizer's update of this rank's tensors, then each tensor sent
//                     from its owner to every rank (an all-gather), so all ranks hold the
//                     same weights
// Sharded collectives pass through one fp32 buffer of distributed.bucket_size_mb, made here,
// so the update allocates nothing. Without a process group, or with one rank, every level
// acts as none.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace memtune {
class ProcessGroup;
}

namespace memtune::trainer {

class GradScaler;
class Optimizer;

// full: gradients, and the layers' frozen base (trainer/layer_shards.h); here it acts as
// gradients.
enum class ShardLevel { none, optimizer, gradients, full };

// distributed.sharding's value (the config maps zero1/2/3 to optimizer/gradients/full);
// anything else: UserError.
ShardLevel shard_level(const std::string& name);
const char* shard_level_name(ShardLevel level);

// The owner of each of tensors of these element counts among `world` ranks: whole tensors,
// the largest first (ties: the lower index), each to the rank with the fewest elements so
// far (ties: the lower rank). Deterministic, so every rank computes the same partition.
std::vector<int> partition_by_numel(const std::vector<int64_t>& numels, int world);
// The owner of each of tensors of these element counts among `world` ranks, each rank a run
// of the list (rank 0 the first): run r ends at the tensor boundary nearest (r + 1) / W of
// the elements (the earlier on a tie). Deterministic; a rank may own nothing.
std::vector<int> partition_contiguous(const std::vector<int64_t>& numels, int world);
// The owners of the trainable tensors of these element counts (in the order every rank lists
// them) under a sharded level: runs of the reversed list (backward's order, roughly the order
// backward produces their gradients), so that a bucket has one owner and fills up as backward
// goes. `separate` (optional, per tensor): those marked (a sharded layer's, kept by their
// owners only) are divided among the ranks by themselves and the others by themselves, so
// that each rank keeps about 1/W of the marked ones whatever the size of the rest.
std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world, const std::vector<bool>& separate = {});

class Sharding {
 public:
  using Params = std::vector<std::pair<std::string, at::Tensor>>;

  // `params`: the trainable tensors in the order every rank lists them (fp32, contiguous);
  // their owners are shard_owners', and the buckets runs of the reversed list.
  // `bucket_bytes`: the size of the buffer sharded collectives pass through. `on_demand`
  // (per tensor, optional): tensors whose storage only their owner keeps (a sharded layer's,
  // trainer/layer_shards.h, owned by the same rule): the update sends them to no rank, and
  // on the other ranks they are placeholders, never read.
  Sharding(ShardLevel level, ProcessGroup* pg, const Params& params, int64_t bucket_bytes,
           std::vector<bool> on_demand = {});
  ~Sharding();  // removes backward's hooks
  Sharding(const Sharding&) = delete;
  Sharding& operator=(const Sharding&) = delete;

  ShardLevel level() const { return level_; }  // as it acts: none without several ranks
  bool shards_gradients() const { return level_ == ShardLevel::gradients || level_ == ShardLevel::full; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const std::vector<int>& owners() const { return owners_; }  // per tensor
  const std::vector<bool>& owned() const { return owned_; }   // per tensor: this rank's
  // "<param>.<state>" (an optimizer state tensor's checkpoint name) of an owned tensor.
  bool owns_state(const std::string& key) const;
  // This rank's share, for the log.
  std::string describe() const;
  int64_t buffer_bytes() const;

  // One micro-batch's backward of `loss` (nothing when it needs no gradient). Under
  // `gradients` with `host_gradients` false, each bucket of gradients is reduced to its owner
  // as backward completes it (the buckets it leaves incomplete after it, a tensor without a
  // gradient counting as zeros): the owner's tensors then hold the sum over the ranks and the
  // micro-batches so far, the other ranks keep none. Every rank calls it for every
  // micro-batch. An out-of-memory error on any rank before or in a reduction is thrown on
  // every rank; take_agreed_oom() then says the agreement was made.
  void backward(const at::Tensor& loss, bool host_gradients);
  // True once after backward learned of an out-of-memory error in its agreement.
  bool take_agreed_oom();

  // Sums the gradients over the ranks (undefined ones count as zero), and `extra` (a small
  // fp64 CPU tensor: loss sum, stop flag) with them. Under `gradients` only this rank's
  // tensors keep a gradient afterwards, already unscaled by `scaler`, and the check below is
  // agreed here; an out-of-memory error while unscaling on any rank is thrown on every rank.
  // `host_gradients`: the gradients are offloaded (trainer/gradient_offload.h) and the group
  // runs on the CPU: the all-reduce's flat buffers stay outside the device budget too.
  void reduce_gradients(const Params& params, const at::Tensor& extra, const GradScaler& scaler,
                        bool host_gradients = false);
  // {skip, norm}: the gradients unscaled by `scaler`; skip when any rank's hold inf/nan; the
  // L2 norm over every gradient of every rank, NaN when skipped. Unsharded gradients: as a
  // single process computes it (unscale, then grad_norm); sharded: what reduce_gradients
  // agreed, with no collective here.
  std::pair<bool, double> check_gradients(const GradScaler& scaler, const Params& params);
  // The update: `optimizer` steps this rank's tensors, then every rank receives each tensor
  // from its owner (but the on-demand ones). All ranks call it (or none: a skipped step).
  void step(Optimizer& optimizer, double lr, double grad_scale);

  // Checkpoints: under a sharded level every rank writes its optimizer state's shard where
  // save_training_checkpoint takes it (train_state.h, optimizer_shard_path), atomically,
  // then all wait for each other; returns the number of shards (the world size) for
  // save_training_checkpoint, 0 when the state is not sharded (rank 0 saves it whole).
  int write_state_shard(const std::filesystem::path& output_dir, int64_t step, const Optimizer& optimizer);

 private:
  // A run of one tensor's elements [offset, offset + length) in a bucket.
  struct Segment {
    size_t tensor;
    int64_t offset, length;
  };
  struct Bucket {
    int owner;
    std::vector<Segment> segments;
    int64_t numel = 0;
    int tensors = 0;  // distinct tensors with a segment here
  };
  struct Hook;
  void arrive(size_t tensor, const at::Tensor& grad);  // a gradient from backward (Hook)
  void launch(size_t bucket);                          // the agreement, then the bucket's reduce
  // After the reduction: unscale this rank's gradients, then agree on [extra, norm, inf/nan, oom].
  void check_reduced(const Params& params, const at::Tensor& extra, const GradScaler& scaler);

  ShardLevel level_;
  ProcessGroup* pg_;
  Params params_;
  int rank_ = 0, world_ = 1;
  std::vector<int> owners_;
  std::vector<bool> owned_;
  std::vector<bool> on_demand_;
  std::set<std::string> owned_names_;
  std::vector<int64_t> numels_;
  int64_t owned_numel_ = 0, total_numel_ = 0;
  std::vector<Bucket> buckets_;  // in backward's order (the list reversed), one owner each
  std::vector<std::vector<size_t>> tensor_buckets_;  // per tensor: the buckets holding a run of it
  // backward(): the hooks on each tensor's gradient accumulator, and what they collected.
  std::vector<std::shared_ptr<void>> accumulators_;  // torch::autograd::Node, kept alive
  std::vector<void*> hooks_;
  bool collecting_ = false, reduced_in_backward_ = false, agreed_oom_ = false;
  std::vector<at::Tensor> pending_;  // per tensor: its gradient until its last bucket is reduced
  std::vector<bool> accumulated_;    // per tensor: owned, and holding earlier micro-batches' sum
  std::vector<int> arrived_;         // per bucket: its tensors whose gradient arrived
  size_t next_ = 0;                  // the next bucket to reduce (they go in order)
  at::Tensor buffer_;            // fp32 [largest bucket] on the group's device
  // `gradients`: the check agreed in reduce_gradients, for check_gradients.
  bool checked_ = false, skip_ = false;
  double norm_ = 0;
};

}  // namespace memtune::trainer
