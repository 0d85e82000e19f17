#pragma once
// ZeRO across data-parallel ranks (distributed.sharding), stages 1 and 2 (and the trainable
// part of 3: the frozen base's part is trainer/layer_shards.h).
//
// The trainable tensors are partitioned by whole tensors among the W ranks (balanced by
// element count, the same on every rank): rank r owns its part's optimizer state and updates
// only those tensors (Optimizer's `owned` flags). The trainer's step then runs:
//   reduce_gradients  none, optimizer: every gradient all-reduced (as without sharding);
//                     gradients: each owner's gradients reduced to it, bucket by bucket, and
//                     dropped on the other ranks once reduced (a reduce-scatter); then each
//                     rank unscales its own and their squared norms are all-reduced
//   check_gradients   unscaled, inf/nan on any rank, and the global L2 norm, for clipping
// No collective follows a point where one rank alone may run out of memory without the
// others learning it in that collective: the supervisor agrees on an out-of-memory error
// after the stage, and a rank that left early would pair its agreement with another rank's
// collective.
//   step              the optimizer's update of this rank's tensors, then each tensor sent
//                     from its owner to every rank (an all-gather), so all ranks hold the
//                     same weights
// Sharded collectives pass through one fp32 buffer of distributed.bucket_size_mb, made here,
// so the update allocates nothing. Without a process group, or with one rank, every level
// acts as none.
#include <cstdint>
#include <filesystem>
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

class Sharding {
 public:
  using Params = std::vector<std::pair<std::string, at::Tensor>>;

  // `params`: the trainable tensors in the order every rank lists them (fp32, contiguous).
  // `bucket_bytes`: the size of the buffer sharded collectives pass through.
  Sharding(ShardLevel level, ProcessGroup* pg, const Params& params, int64_t bucket_bytes);

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
  // from its owner. All ranks call it (or none: a skipped step).
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
  };

  ShardLevel level_;
  ProcessGroup* pg_;
  int rank_ = 0, world_ = 1;
  std::vector<int> owners_;
  std::vector<bool> owned_;
  std::set<std::string> owned_names_;
  std::vector<int64_t> numels_;
  int64_t owned_numel_ = 0, total_numel_ = 0;
  std::vector<Bucket> buckets_;  // owner by owner, each owner's tensors in order
  at::Tensor buffer_;            // fp32 [largest bucket] on the group's device
  // `gradients`: the check agreed in reduce_gradients, for check_gradients.
  bool checked_ = false, skip_ = false;
  double norm_ = 0;
};

}  // namespace memtune::trainer
