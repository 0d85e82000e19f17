#pragma once
// ZeRO stage 3 (distributed.sharding: full): each decoder layer's tensors are partitioned
// among the ranks by whole tensors, and a rank keeps only its own, packed into one buffer per
// layer on the group's device. The forward gathers a layer just before it runs (one
// broadcast per owner, into one buffer per owner) and drops the gathered tensors when it
// returns; the layer reruns in backward (it is checkpointed) and gathers again.
//   frozen tensors (NF4 projections with their quantization state, dense projections,
//     biases, norms): partitioned layer by layer (trainer/sharding.h partition_by_numel;
//     owners()); a rank need not even read the others' from the checkpoint (setup_model's
//     skip). The others' are meta tensors: shape and dtype, no storage.
//   trainable tensors (a full fine-tune's weights, LoRA adapters): owned as Sharding owns
//     them (shard_owners over the model's trainable list, the layers' divided among the
//     ranks by themselves), so the rank that keeps one's storage updates it in place and no
//     gather follows the update. Each stays the one leaf
//     the optimizer and Sharding's hooks know: its owner's holds a view of the buffer,
//     another rank's a placeholder (its shape over one NaN). While a layer is gathered the
//     layer computes with the gathered values through a node whose backward passes the
//     gradient to the leaf (whose hooks reduce it to its owner, trainer/sharding.h).
//   Trainable tensors outside the layers (embeddings, head, final norm, modules_to_save)
//   stay whole on every rank, under the `gradients` level's sharding of their gradients and
//   optimizer state.
//
// The next layer's gather starts while a layer computes (gather(); set_prefetch): its
// agreement and allocation happen then, its broadcasts run behind.
//
// Out of memory: a rank that runs out inside the forward or backward leaves it and enters
// the supervisor's agreement (ProcessGroup::agree) while the others run on to their next
// gather. Each gather therefore starts with the same agreement: it allocates the buffers it
// will receive into, then agrees; when some rank ran out, every rank throws an
// out-of-memory error from there and the supervisor takes the agreement as made
// (take_agreed_oom), so the ranks' collectives stay paired and the step is retried.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/causal_lm.h"
#include "runtime/process_group.h"

namespace memtune::trainer {

// DoRA's magnitudes start at the row norms of their projection's whole weight (PEFT's
// DoraLinearLayer.update_layer), which only the weight's owner read (setup_model's skip,
// LayerShards::owners): each owner's norms go to every rank, one broadcast per adapted
// projection in the model's tensor order, before LayerShards takes the layers' trainable
// tensors from rank 0. Every rank calls it. Returns the magnitudes shared.
int share_dora_magnitudes(models::CausalLM& model, ProcessGroup& pg, bool trainable);

class LayerShards : public models::LayerSource {
 public:
  // Shards every decoder layer of `model` over the group's ranks: this rank's tensors are
  // copied (from wherever they were loaded: host memory) into buffers on the group's
  // device, the others' memory is released (they may be meta tensors already, skipped at
  // load; NF4 weights' nested offsets are then learned from their owners here). Call it before placing the model, so the device
  // never holds more than this rank's share; place() leaves sharded tensors where they are.
  // Trainable tensors inside a layer are sharded as above, from rank 0's values (one
  // broadcast per layer). The model's layer source is set to this object, and reset when it
  // is destroyed.
  LayerShards(models::CausalLM& model, ProcessGroup& pg);
  ~LayerShards() override;
  LayerShards(const LayerShards&) = delete;
  LayerShards& operator=(const LayerShards&) = delete;

  // The owner of each of the model's tensors (-1: outside the layers), from their shapes
  // alone, so a loader can skip the others' tensors before reading any (SkipTensors) and the
  // shards agree with it: frozen, each layer's tensors among `world` ranks by whole tensors;
  // `trainable` (a full fine-tune, every tensor trained), the layers' tensors in runs as
  // Sharding owns them (shard_owners).
  static std::vector<int> owners(const models::CausalLM& model, int world, bool trainable = false);

  bool covers(int layer) const override;
  // Gathers layer `layer`, then starts gathering the next one in the same direction (forward
  // and evaluation, without grad mode: layer + 1; backward's reruns: layer - 1) while this one
  // computes, unless prefetch is off: one more layer on the device for the overlap (ZeRO-3's
  // prefetch, FSDP's backward_prefetch). A gather of the prefetched layer waits for it; a
  // gather of another drops it (every rank does the same) and gathers at once.
  void gather(int layer) override;
  void release(int layer) override;
  void set_prefetch(bool on) { prefetch_enabled_ = on; }  // distributed.prefetch
  int prefetched_layer() const { return prefetch_.layer; }  // -1: none

  // Whether trainable tensor `t` is one of the layers' (its storage on its owner only).
  bool holds(const at::Tensor& t) const;
  int64_t trainable_tensors() const { return trainable_pieces_; }
  // Runs `fn` with every trainable tensor of the layers whole on rank `root`: the layers are
  // gathered one by one and the root's modules point at host copies of their trainable
  // tensors (outside the device budget) until `fn` returns, for writing a checkpoint or the
  // adapter or model. Every rank calls it (the gathers are collectives); `fn` runs on every
  // rank, on the others with the tensors as they are.
  void with_trainable_whole(int root, const std::function<void()>& fn);

  // True once after a gather learned that another rank ran out of memory (the agreement
  // for the stage has been made in that collective).
  bool take_agreed_oom();

  int64_t owned_bytes() const { return owned_bytes_; }    // this rank's shards, all layers
  int64_t total_bytes() const { return total_bytes_; }    // every layer's sharded tensors
  int64_t largest_layer_bytes() const;                    // a gathered layer at most
  std::string describe() const;

 private:
  // One tensor of a layer: a dense slot's tensor, or one of an NF4 weight's tensors.
  struct Piece {
    at::Tensor* dense = nullptr;          // the module's tensor (a slot's, or a LoRA adapter's), or
    models::Linear* linear = nullptr;     // the NF4 weight's owner, and
    int field = 0;                        // which of its tensors (packed, absmax, nested absmax, map)
    at::Tensor meta;                      // shape and dtype
    int64_t offset = 0, bytes = 0;        // in its owner's buffer
    at::Tensor leaf;                      // trainable: the tensor itself (the module's between gathers)
    bool from_rank0 = false;              // trainable, drawn (an adapter): rank 0's value at the start
  };
  struct Layer {
    std::vector<std::vector<Piece>> pieces;  // by owner
    std::vector<int64_t> owner_bytes;        // buffer size per owner
    int64_t bytes = 0;                       // the whole layer
    at::Tensor own;                          // this rank's buffer (holds its pieces)
    std::vector<at::Tensor> received;        // while gathered: the other owners' buffers
    bool gathered = false;
  };
  // The gather's agreement and broadcasts into new receive buffers (one per other owner):
  // waited for here, or (pending) started.
  std::vector<at::Tensor> start_gather(int layer, std::vector<ProcessGroup::Pending>* pending);
  void drop_prefetch();
  // Points the frozen pieces of `owner` in `layer` at `buffer`, or at their meta tensors.
  void point(Layer& layer, int owner, const at::Tensor& buffer);
  // The modules' trainable tensors of `owner`'s pieces: gathered values from `buffer`, or (undefined) the leaves.
  void point_trainable(Layer& layer, int owner, const at::Tensor& buffer);

  models::CausalLM& model_;
  ProcessGroup& pg_;
  int rank_ = 0, world_ = 1;
  std::vector<Layer> layers_;
  int64_t owned_bytes_ = 0, total_bytes_ = 0;
  bool agreed_oom_ = false;
  int64_t trainable_pieces_ = 0;
  struct Prefetch {
    int layer = -1;
    std::vector<at::Tensor> received;
    std::vector<ProcessGroup::Pending> pending;
  };
  Prefetch prefetch_;
  bool prefetch_enabled_ = true;
};

}  // namespace memtune::trainer
