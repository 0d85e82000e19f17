#include "trainer/cuda/adamw_bnb_cuda.h"

#include <algorithm>
#include <exception>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
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

// One run of a host state and where it sits in a slot.
struct Copy {
  void* host;
  void* device;
  size_t bytes;
};

// The 8-bit states: uint8 codes of n elements and fp32 absmax of ceil(n / 256) blocks, twice.
bool eight_bit_states(const std::vector<at::Tensor>& st, int64_t n) {
  const int64_t blocks = (n + kBlock8bit - 1) / kBlock8bit;
  return st.size() == 4 && st[0].defined() && st[1].defined() && st[2].defined() && st[3].defined() &&
         st[0].scalar_type() == at::kByte && st[1].scalar_type() == at::kByte && st[0].numel() == n &&
         st[1].numel() == n && st[2].scalar_type() == at::kFloat && st[3].scalar_type() == at::kFloat &&
         st[2].numel() == blocks && st[3].numel() == blocks;
}

// The 32-bit states: fp32 m and v of n elements (absmax, if listed, undefined).
bool fp32_states(const std::vector<at::Tensor>& st, int64_t n) {
  if (st.size() < 2 || !st[0].defined() || !st[1].defined()) return false;
  for (size_t k = 2; k < st.size(); ++k)
    if (st[k].defined()) return false;
  return st[0].scalar_type() == at::kFloat && st[1].scalar_type() == at::kFloat && st[0].numel() == n &&
         st[1].numel() == n;
}

}  // namespace

struct PagedStates::Impl {
  c10::cuda::CUDAStream side;
  at::Tensor slots[2];
  int next = 0;
  bool started = false;  // the side stream waited for the compute stream's queued work this round
  // The run queued last: its states go back to the host when the next one is queued (so that
  // the next run's copies in are queued before the wait for this run's kernel).
  std::vector<Copy> pending;
  at::cuda::CUDAEvent pending_done;

  explicit Impl(c10::cuda::CUDAStream s) : side(s) {}

  void copy_back_pending() {
    if (pending.empty()) return;
    pending_done.block(side);
    const std::vector<Copy> back = std::move(pending);
    pending.clear();
    for (const Copy& c : back)
      C10_CUDA_CHECK(cudaMemcpyAsync(c.host, c.device, c.bytes, cudaMemcpyDeviceToHost, side.stream()));
  }
};

int64_t PagedStates::slot_bytes(const std::vector<at::Tensor>& host_states) {
  int64_t bytes = 0;
  for (const at::Tensor& t : host_states)
    if (t.defined()) bytes += aligned(t.numel() * static_cast<int64_t>(t.element_size()));
  return bytes;
}

int64_t PagedStates::run_elements(int64_t slot_bytes, bool eight_bit) {
  // A run is whole 256-element blocks: 8-bit, 2 code bytes per element and 2 fp32 absmax per
  // block; 32-bit, 2 fp32 per element; each of the four arrays may round up by 255 bytes.
  const int64_t per_block = eight_bit ? 2 * kBlock8bit + 2 * 4 : 2 * 4 * kBlock8bit;
  return std::max<int64_t>(1, (slot_bytes - 4 * kSlotAlign) / per_block) * kBlock8bit;
}

PagedStates::PagedStates(const c10::Device& device, int64_t slot_bytes)
    : device_(device), slot_bytes_(std::max(slot_bytes, kMinSlotBytes)) {
  TORCH_CHECK(device.is_cuda() && device.has_index(), "PagedStates: ", device, " is not an indexed CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  impl_ = std::make_unique<Impl>(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
  for (at::Tensor& slot : impl_->slots) {
    slot = at::empty({slot_bytes_}, at::TensorOptions(at::kByte).device(device));
    // Written by the side stream: the allocator reuses the block only after its work there.
    c10::cuda::CUDACachingAllocator::recordStream(slot.storage().data_ptr(), impl_->side);
  }
}

PagedStates::~PagedStates() {
  try {
    finish();
  } catch (...) {
    // Reported by the step that queued the copy; the slots are released after the side
    // stream's work either way (recordStream).
  }
}

bool PagedStates::applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& host_states) const {
  if (p.device() != device_ || !bnb_cuda_applies(p, g, {})) return false;
  for (const at::Tensor& t : host_states)
    if (t.defined() && (!t.device().is_cpu() || !t.is_contiguous())) return false;
  return eight_bit_states(host_states, p.numel()) || fp32_states(host_states, p.numel());
}

void PagedStates::update(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g,
                         const std::vector<at::Tensor>& host_states) {
  TORCH_CHECK(applies(p, g, host_states), "PagedStates: the parameter (", p.device(), ", ", p.numel(),
              " elements) and its host states do not match this stream's device or bitsandbytes' states");
  const int64_t n = p.numel();
  const bool eight = eight_bit_states(host_states, n);
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
  float* p_data = p.data_ptr<float>();
  const float* g_data = g.data_ptr<float>();
  auto host = [&](size_t k) { return static_cast<uint8_t*>(host_states[k].data_ptr()); };
  const int64_t run = run_elements(slot_bytes_, eight);
  // The tensor in runs of whole blocks (bitsandbytes' kernels treat each block, or element,
  // on its own: a run's update is the whole tensor's restricted to it).
  for (int64_t e0 = 0; e0 < n; e0 += run) {
    const int64_t m = std::min(run, n - e0);
    uint8_t* base = im.slots[im.next].data_ptr<uint8_t>();
    im.next ^= 1;
    std::vector<Copy> copies;
    int64_t offset = 0;
    auto place = [&](uint8_t* h, int64_t bytes) {
      copies.push_back({h, base + offset, static_cast<size_t>(bytes)});
      offset += aligned(bytes);
    };
    if (eight) {
      const int64_t b0 = e0 / kBlock8bit, blocks = (m + kBlock8bit - 1) / kBlock8bit;
      place(host(0) + e0, m);
      place(host(1) + e0, m);
      place(host(2) + 4 * b0, 4 * blocks);
      place(host(3) + 4 * b0, 4 * blocks);
    } else {
      place(host(0) + 4 * e0, 4 * m);
      place(host(1) + 4 * e0, 4 * m);
    }
    TORCH_INTERNAL_ASSERT(offset <= slot_bytes_, "PagedStates: a run of ", m, " elements overflows the slot");
    // In, on the side stream: after this slot's previous copies back (queued there one run
    // ago), so the slot is free.
    for (const Copy& c : copies)
      C10_CUDA_CHECK(cudaMemcpyAsync(c.device, c.host, c.bytes, cudaMemcpyHostToDevice, im.side.stream()));
    at::cuda::CUDAEvent ready;
    ready.record(im.side);
    ready.block(compute);
    // The previous run's states go back once its kernel is done; queued after this run's
    // copies in, so those overlap that kernel.
    im.copy_back_pending();
    if (eight) {
      C10_CUDA_CHECK(bnb_cuda::adam8(s, dynamic_map(true).data_ptr<float>(), dynamic_map(false).data_ptr<float>(),
                                     p_data + e0, g_data + e0, static_cast<uint8_t*>(copies[0].device),
                                     static_cast<uint8_t*>(copies[1].device), static_cast<float*>(copies[2].device),
                                     static_cast<float*>(copies[3].device), m, compute.stream()));
    } else {
      C10_CUDA_CHECK(bnb_cuda::adam32(s, p_data + e0, g_data + e0, static_cast<float*>(copies[0].device),
                                      static_cast<float*>(copies[1].device), m, compute.stream()));
    }
    im.pending = std::move(copies);
    im.pending_done.record(compute);
  }
}

void PagedStates::finish() {
  if (!impl_) return;
  const c10::cuda::CUDAGuard guard(device_);
  std::exception_ptr failed;
  try {
    impl_->copy_back_pending();
  } catch (...) {
    failed = std::current_exception();
  }
  impl_->started = false;
  impl_->side.synchronize();
  if (failed) std::rethrow_exception(failed);
}

}  // namespace memtune::trainer
