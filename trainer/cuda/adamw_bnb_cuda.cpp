#include "trainer/cuda/adamw_bnb_cuda.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/adamw8bit_kernels.h"
#include "trainer/cuda/adamw_bnb_cuda_kernels.h"

namespace memtune::trainer {

bool bnb_cuda_applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& states) {
  if (!p.is_cuda() || p.scalar_type() != at::kFloat || !p.is_contiguous()) return false;
  if (!g.defined() || g.device() != p.device() || g.scalar_type() != at::kFloat || !g.is_contiguous()) return false;
  for (const at::Tensor& t : states)
    if (t.defined() && (t.device() != p.device() || !t.is_contiguous())) return false;
  return true;
}

void bnb_adam8_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& c1,
                    const at::Tensor& c2, const at::Tensor& absmax1, const at::Tensor& absmax2) {
  TORCH_CHECK(bnb_cuda_applies(p, g, {c1, c2, absmax1, absmax2}) && c1.scalar_type() == at::kByte &&
                  c2.scalar_type() == at::kByte && absmax1.scalar_type() == at::kFloat &&
                  absmax2.scalar_type() == at::kFloat && c1.numel() == p.numel() && c2.numel() == p.numel() &&
                  absmax1.numel() == (p.numel() + kBlock8bit - 1) / kBlock8bit &&
                  absmax2.numel() == absmax1.numel(),
              "bnb_adam8_cuda: the parameter, gradient and 8-bit states disagree (device, dtype or size)");
  const c10::cuda::CUDAGuard guard(p.device());
  C10_CUDA_CHECK(bnb_cuda::adam8(s, dynamic_map(true).data_ptr<float>(), dynamic_map(false).data_ptr<float>(),
                                 p.data_ptr<float>(), g.data_ptr<float>(), c1.data_ptr<uint8_t>(),
                                 c2.data_ptr<uint8_t>(), absmax1.data_ptr<float>(), absmax2.data_ptr<float>(),
                                 p.numel(), c10::cuda::getCurrentCUDAStream(p.device().index()).stream()));
}

void bnb_adam32_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v) {
  TORCH_CHECK(bnb_cuda_applies(p, g, {m, v}) && m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  m.numel() == p.numel() && v.numel() == p.numel(),
              "bnb_adam32_cuda: the parameter, gradient and states disagree (device, dtype or size)");
  const c10::cuda::CUDAGuard guard(p.device());
  C10_CUDA_CHECK(bnb_cuda::adam32(s, p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                                  v.data_ptr<float>(), p.numel(),
                                  c10::cuda::getCurrentCUDAStream(p.device().index()).stream()));
}

}  // namespace memtune::trainer

namespace memtune::trainer {
namespace {

constexpr int64_t kSlotAlign = 256;

int64_t aligned(int64_t bytes) { return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

// One host state and where it sits in a slot.
struct Copy {
  void* host;
  void* device;
  size_t bytes;
};

}  // namespace

struct PagedStates::Impl {
  c10::cuda::CUDAStream side;
  at::Tensor slots[2];
  int next = 0;
  bool started = false;  // the side stream waits for the compute stream's queued work once per round
  // The update queued last: its states go back to the host when the next one is queued (so
  // that the copy in of the next parameter is queued before the wait for this one's kernel).
  std::vector<Copy> pending;
  at::cuda::CUDAEvent pending_done;

  explicit Impl(c10::cuda::CUDAStream s) : side(s) {}

  void copy_back_pending() {
    if (pending.empty()) return;
    pending_done.block(side);
    for (const Copy& c : pending)
      C10_CUDA_CHECK(cudaMemcpyAsync(c.host, c.device, c.bytes, cudaMemcpyDeviceToHost, side.stream()));
    pending.clear();
  }
};

int64_t PagedStates::slot_bytes(const std::vector<at::Tensor>& host_states) {
  int64_t bytes = 0;
  for (const at::Tensor& t : host_states)
    if (t.defined()) bytes += aligned(t.numel() * static_cast<int64_t>(t.element_size()));
  return bytes;
}

PagedStates::PagedStates(const c10::Device& device, int64_t slot_bytes) : device_(device), slot_bytes_(slot_bytes) {
  TORCH_CHECK(device.is_cuda() && device.has_index(), "PagedStates: ", device, " is not an indexed CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  impl_ = std::make_unique<Impl>(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
  for (at::Tensor& slot : impl_->slots)
    slot = at::empty({std::max<int64_t>(slot_bytes, 1)}, at::TensorOptions(at::kByte).device(device));
}

PagedStates::~PagedStates() {
  try {
    finish();
  } catch (...) {
    // A failed copy was reported by the step that queued it; the slots are released after
    // the side stream's synchronize either way.
  }
}

bool PagedStates::applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& host_states) const {
  if (p.device() != device_ || !bnb_cuda_applies(p, g, {})) return false;
  for (const at::Tensor& t : host_states)
    if (t.defined() && (!t.device().is_cpu() || !t.is_contiguous())) return false;
  return slot_bytes(host_states) <= slot_bytes_;
}

void PagedStates::update(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g,
                         const std::vector<at::Tensor>& host_states) {
  TORCH_CHECK(applies(p, g, host_states), "PagedStates: the parameter or its host states do not fit this stream");
  const bool eight = host_states.size() == 4 && host_states[2].defined();
  TORCH_CHECK(host_states.size() >= 2 && host_states[0].numel() == p.numel() && host_states[1].numel() == p.numel(),
              "PagedStates: states of ", host_states.size() > 0 ? host_states[0].numel() : 0,
              " elements for a parameter of ", p.numel());
  const c10::cuda::CUDAGuard guard(device_);
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device_.index());
  Impl& im = *impl_;
  if (!im.started) {
    // The slots may be blocks the compute stream freed with work still queued on them: the
    // side stream writes them only after that work.
    at::cuda::CUDAEvent queued;
    queued.record(compute);
    queued.block(im.side);
    im.started = true;
  }
  // The copies in, on the side stream: after this slot's previous copies back (queued there
  // one update ago), so the slot is free.
  uint8_t* base = im.slots[im.next].data_ptr<uint8_t>();
  im.next ^= 1;
  std::vector<Copy> copies;
  int64_t offset = 0;
  for (const at::Tensor& t : host_states) {
    if (!t.defined()) continue;
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    copies.push_back({t.data_ptr(), base + offset, bytes});
    offset += aligned(static_cast<int64_t>(bytes));
  }
  for (const Copy& c : copies)
    C10_CUDA_CHECK(cudaMemcpyAsync(c.device, c.host, c.bytes, cudaMemcpyHostToDevice, im.side.stream()));
  at::cuda::CUDAEvent ready;
  ready.record(im.side);
  ready.block(compute);
  // The previous parameter's states go back once its kernel is done; queued after this
  // parameter's copies in, so those overlap that kernel.
  im.copy_back_pending();
  float* p_data = p.data_ptr<float>();
  const float* g_data = g.data_ptr<float>();
  if (eight) {
    C10_CUDA_CHECK(bnb_cuda::adam8(s, dynamic_map(true).data_ptr<float>(), dynamic_map(false).data_ptr<float>(), p_data,
                                   g_data, static_cast<uint8_t*>(copies[0].device),
                                   static_cast<uint8_t*>(copies[1].device), static_cast<float*>(copies[2].device),
                                   static_cast<float*>(copies[3].device), p.numel(), compute.stream()));
  } else {
    C10_CUDA_CHECK(bnb_cuda::adam32(s, p_data, g_data, static_cast<float*>(copies[0].device),
                                    static_cast<float*>(copies[1].device), p.numel(), compute.stream()));
  }
  im.pending = std::move(copies);
  im.pending_done.record(compute);
}

void PagedStates::finish() {
  if (!impl_) return;
  const c10::cuda::CUDAGuard guard(device_);
  impl_->copy_back_pending();
  impl_->side.synchronize();
  impl_->started = false;
}

}  // namespace memtune::trainer
