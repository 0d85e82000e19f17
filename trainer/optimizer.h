#pragma once
// Optimizers over the trainable tensors only: AdamW (decoupled weight decay, PyTorch's
// semantics, fp32 states), bitsandbytes' AdamW8bit (block-wise 8-bit states, tensors under
// 4096 elements on bitsandbytes' 32-bit kernel) and its AdamW32bit, Adafactor (factored second
// moments: a matrix keeps one value per row and per column) and SGD with momentum.
// `paged` keeps the states in host memory outside the device budget (runtime/offload.h); a
// GPU's parameters update with them passing through two device slots (PagedStates).
// The update allocates nothing on the device: its workspaces are reserved before the first
// parameter changes (reserve_workspaces), so an out-of-memory error never interrupts an
// update half way.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "trainer/adamw8bit_kernels.h"

namespace memtune::trainer {

class PagedStates;  // trainer/cuda/adamw_bnb_cuda.h (CUDA builds)

struct OptimizerOptions {
  // adamw (torch.optim.AdamW) | adamw_8bit (bitsandbytes AdamW8bit) |
  // adamw_32bit (bitsandbytes AdamW32bit's kernel) | adafactor | sgd
  std::string kind = "adamw";
  bool paged = false;          // states in host memory outside the device budget
  bool offloaded = false;      // states made where offload_states() would leave them: never on the device
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;   // not applied to norms and biases (see decays())
  double momentum = 0.0;       // sgd
  // kind adamw_8bit by the memory ladder's optimizer_8bit taken before the first step: the
  // configured kind (adamw, adamw_32bit), which dequantize_states goes back to. Empty otherwise.
  std::string ladder_from;
  // adafactor: transformers' Adafactor as Hugging Face's Trainer builds it for optim: adafactor
  // (scale_parameter and relative_step off: the schedule's learning rate; no first moment;
  // eps (1e-30, 1e-3), of which only the first is read then).
  double adafactor_eps = 1e-30;       // added to the squared gradient
  double adafactor_clip = 1.0;        // the update's RMS is clipped to this
  double adafactor_decay_rate = -0.8; // beta2 at step t: 1 - t^decay_rate
};

// training.optim (Hugging Face's names) as options: adamw_torch|adamw_torch_fused|adamw -> adamw,
// adamw_bnb_8bit|adamw_8bit -> adamw_8bit, paged_adamw_8bit -> adamw_8bit + paged,
// paged_adamw_32bit -> adamw_32bit + paged, adafactor, sgd. Anything else: UserError with the list.
void set_optimizer_kind(const std::string& optim, OptimizerOptions& o);
inline constexpr const char* kOptimNames =
    "adamw_torch, adamw_torch_fused, adamw, adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, paged_adamw_32bit, adafactor, sgd";

// Device bytes of the states of `kind` (OptimizerOptions::kind) for one trainable tensor of
// this shape: 0 when paged; adamw_8bit: uint8 codes and fp32 absmax per kBlock8bit for
// tensors of kMin8bitSize elements or more, else fp32 as adamw; adafactor: fp32, one per row
// and one per column of a matrix (more dimensions: per row of each, and per column), one per
// element of a vector; sgd: one fp32 momentum buffer per element when `sgd_momentum`, none
// without (torch.optim.SGD keeps no buffer at momentum 0).
int64_t optimizer_state_bytes(const std::string& kind, bool paged, at::IntArrayRef shape, bool sgd_momentum);

// bitsandbytes' 8-bit AdamW constants and maps (kMin8bitSize, kBlock8bit, dynamic_map,
// quantize_dynamic): trainer/adamw8bit_kernels.h, included above.

// Weight decay applies to matrices (LoRA A/B, projection and embedding weights), not to
// norm weights or biases.
bool decays(const std::string& name, const at::Tensor& t);

class Optimizer {
 public:
  // `owned` (one flag per parameter; empty: all): the parameters this optimizer keeps state
  // for and updates; the others (owned by other ranks under distributed.sharding) get no
  // state and are left alone by step(), but zero_grad() drops their gradients too.
  Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerOptions options,
            std::vector<bool> owned = {});

  // One update with learning rate `lr`, from the parameters' .grad (scaled by grad_scale,
  // e.g. the clipping coefficient). Parameters without a gradient are left alone.
  void step(double lr, double grad_scale = 1.0);
  // What the next step allocates on the devices, allocated now (step() calls it first): torch's
  // AdamW off its fused kernels (a tensor neither the CPU's nor a GPU's kernel takes: not fp32,
  // not contiguous) a denominator the size of the largest parameter it updates, per device; Adafactor its update (on every device; in host memory
  // outside the budget when the states are there); paged states on a GPU the two slots they
  // pass through. Only where that path runs, for the parameters that have a gradient. The
  // trainer calls it while an out-of-memory error can still be retried.
  void reserve_workspaces();
  void zero_grad();  // drops every .grad
  int64_t steps() const { return steps_; }
  const OptimizerOptions& options() const { return options_; }
  const std::vector<std::pair<std::string, at::Tensor>>& params() const { return params_; }
  bool owns(size_t i) const { return owned_[i]; }
  int64_t state_bytes() const;  // every state tensor and workspace, paged (host) ones included

  // Optimizer offload (DeepSpeed's offload_optimizer: cpu): every state tensor moves to host
  // memory outside the device budget (runtime/offload.h) and stays there; the update is the
  // same, bit for bit (parameters on another device stream their states through it, per
  // tensor). Paged optimizers have theirs there already. Returns the bytes it moved.
  int64_t offload_states();
  // The reverse: the states come back to their parameters' devices (allocated there).
  int64_t restore_states();
  bool states_offloaded() const { return offloaded_ || options_.paged; }

  // The memory ladder's optimizer_8bit rung (it changes the numerics, so only where
  // memory.on_oom.ladder lists it): AdamW's fp32 states (torch's, or bitsandbytes' 32-bit)
  // become bitsandbytes' 8-bit ones, tensor by tensor (quantize_states_8bit: codes and absmax
  // per 256, fp32 kept under kMin8bitSize elements, where they stay), and the update from the
  // next step is adamw_8bit's, as if that state had been made by it. Returns the bytes freed;
  // 0 for another optimizer, or when they are 8-bit already.
  int64_t quantize_states();
  // The reverse (grow-back): fp32 states from the codes, the configured update again.
  // Returns the bytes it allocated.
  int64_t dequantize_states();
  bool states_quantized() const { return options_.kind == "adamw_8bit" && configured_kind_ != "adamw_8bit"; }

  // State for training checkpoints: tensors (named "<param>.exp_avg", "<param>.exp_avg_sq";
  // for 8-bit states the uint8 codes under those names plus "<param>.absmax1/absmax2";
  // adafactor's "<param>.exp_avg_sq_row/exp_avg_sq_col" of a matrix, "<param>.exp_avg_sq" of a
  // vector, as transformers names them) and scalars.
  // Only the owned parameters' tensors: load_state takes theirs and ignores the others.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  nlohmann::json state_scalars() const;
  void load_state(const std::map<std::string, at::Tensor>& tensors, const nlohmann::json& scalars);

 private:
  void bnb_step(size_t i, double lr, double wd, double grad_scale);  // adamw_8bit / adamw_32bit
  void adafactor_step(size_t i, double lr, double wd, double grad_scale);
  // Every device's paged states back in host memory (PagedStates::finish); the first error
  // thrown once all are finished.
  void finish_paged();
  // Where parameter i's update runs with its workspace: "host" (offloaded states, outside the
  // budget) or its device.
  std::string workspace_key(size_t i) const;
  // Parameter i's state tensors that exist, by their checkpoint suffix (".exp_avg", ...).
  std::vector<std::pair<std::string, at::Tensor*>> states(size_t i);
  std::vector<std::pair<std::string, const at::Tensor*>> states(size_t i) const;
  // torch's AdamW or SGD on parameter i's tensors (p, g: the parameter's or their host copies).
  void update(const at::Tensor& p, const at::Tensor& g, size_t i, double lr, double wd, double grad_scale, double bc1,
              double bc2);
  OptimizerOptions options_;
  std::string configured_kind_;  // options_.kind as made (quantize_states changes it)
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<bool> owned_;  // per parameter
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // adamw; exp_avg_ is the momentum buffer for sgd
  // adamw_8bit: per parameter fp32 [blocks] absmax of exp_avg_/exp_avg_sq_ (uint8 codes);
  // undefined where the tensor is under kMin8bitSize and its states are fp32.
  std::vector<at::Tensor> absmax1_, absmax2_;
  // adafactor: a matrix's row and column second moments (exp_avg_sq_ undefined there); a
  // vector's are in exp_avg_sq_ and these are undefined.
  std::vector<at::Tensor> sq_row_, sq_col_;
  // Per device where torch's AdamW path or Adafactor runs: the largest parameter's size there, fp32.
  std::map<std::string, at::Tensor> workspaces_;
  // Per CUDA device where paged states are updated: the two slots they pass through.
  std::map<std::string, std::shared_ptr<PagedStates>> paged_;
  int64_t steps_ = 0;
  bool offloaded_ = false;  // offload_states() ran
};

// Global L2 norm of the gradients (fp32); undefined gradients count as zero.
double grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params);
// Its square before the root, summed in double (per-rank parts of a sharded norm).
double grad_square_sum(const std::vector<std::pair<std::string, at::Tensor>>& params);

}  // namespace memtune::trainer
