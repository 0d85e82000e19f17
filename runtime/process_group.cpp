#include "runtime/process_group.h"

#include <chrono>
#include <map>
#include <utility>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef MEMTUNE_GLOO  // gloo's headers were found (CMakeLists.txt)
// ProcessGroupGloo.hpp is guarded by the define LibTorch's own build sets.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include "runtime/compat.h"
#include MEMTUNE_C10D_BACKEND_HEADER  // the collectives' class (compat::C10dBackend)
#include "runtime/error.h"
#include "runtime/offload.h"
#ifdef MEMTUNE_CUDA
#include "runtime/cuda/process_group_nccl.h"
#endif

namespace memtune {
namespace {

using Backend = compat::C10dBackend;
using WorkPtr = decltype(std::declval<Backend&>().barrier());

// c10::Error's what() carries a backtrace in 1.13: keep the message only.
std::string message_of(const std::exception& e) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

#ifdef MEMTUNE_GLOO
bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const DistEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (is_loopback(env.master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}
#endif

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return c10d::ReduceOp::SUM;
    case ReduceOp::max: return c10d::ReduceOp::MAX;
    case ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

struct ProcessGroup::Impl {
  DistEnv env;
  ProcessGroupOptions options;
  std::chrono::milliseconds timeout{0};
  c10::Device device{c10::kCPU};
  std::string backend_name;
  c10::intrusive_ptr<c10d::Store> store;  // the TCPStore; arrival marks live here
  c10::intrusive_ptr<Backend> backend;
  int64_t seq = 0;
  // allreduce_sum's flat buffers, kept while the tensors' layout stays the same (gradients
  // every step): no allocation in the reduction after the first call.
  std::vector<int64_t> flat_layout;
  std::vector<at::Tensor> flats;
  std::vector<int64_t> sent;  // per rank (sent_bytes())

  void count_allreduce(int64_t bytes) {
    const int64_t w = env.world_size;
    for (auto& s : sent) s += 2 * (w - 1) * bytes / w;
  }
  // broadcast: the root sends N to each other rank (Gloo's one-to-all).
  void count_broadcast(int64_t bytes, int root) {
    sent[static_cast<size_t>(root)] += (env.world_size - 1) * bytes;
  }
  // reduce: a ring reduce-scatter, then each rank but the root sends its reduced part to the
  // root: N from each other rank, (W-1)/W N from the root.
  void count_reduce(int64_t bytes, int root) {
    const int64_t w = env.world_size;
    for (int r = 0; r < w; ++r) sent[static_cast<size_t>(r)] += r == root ? (w - 1) * bytes / w : bytes;
  }

  // Rank r's arrival mark for collective s: a slot of kArrivalSlots per rank, reused in turn
  // and holding the collective's number, so the store (rank 0's memory) keeps W x slots keys
  // however long the run (a key per collective grew by millions over a long ZeRO-3 run).
  // Collectives complete in order, so no rank is a whole turn of slots ahead of another.
  static constexpr int64_t kArrivalSlots = 16;
  std::string arrival_key(int64_t s, int r) const { return str_cat("memtune/arrived/", s % kArrivalSlots, "/", r); }
  bool arrived(int64_t s, int r) const {
    const std::string key = arrival_key(s, r);
    if (!store->check({key})) return false;
    const std::vector<uint8_t> v = store->get(key);
    return std::stoll(std::string(v.begin(), v.end())) >= s;
  }

  // Marks this rank's arrival at the next collective, runs it, and turns a failure into an
  // error naming the ranks that never arrived.
  template <class Fn>
  void collective(const char* what, Fn&& fn) {
    const int64_t s = seq++;
    try {
      const std::string mark = std::to_string(s);
      store->set(arrival_key(s, env.rank), std::vector<uint8_t>(mark.begin(), mark.end()));
    } catch (const std::exception& e) {
      fail("distributed: rank ", env.rank, " cannot reach the rendezvous store at ", env.master_addr, ":",
           env.master_port, " before ", what, " #", s, " (rank 0 hosts it; has it exited?): ", message_of(e));
    }
    try {
      fn();
    } catch (const std::exception& e) {
      fail(diagnose(what, s, message_of(e)));
    }
  }

  std::string diagnose(const char* what, int64_t s, const std::string& cause) const {
    std::string missing;
    int n_missing = 0;
    try {
      for (int r = 0; r < env.world_size; ++r) {
        if (!arrived(s, r)) {
          missing += str_cat(n_missing++ ? ", " : "", r);
        }
      }
    } catch (const std::exception& e) {
      missing = str_cat("unknown (the store at ", env.master_addr, ":", env.master_port,
                        " is unreachable, so rank 0 has probably exited)");
      n_missing = -1;
    }
    std::string who = n_missing == 0
                          ? std::string("every rank arrived, so a peer failed or exited during it")
                          : str_cat(n_missing == 1 ? "rank " : "ranks ", missing, " did not arrive");
    return str_cat("distributed: ", what, " (collective #", s, ") failed on rank ", env.rank, " of ",
                   env.world_size, " within distributed.timeout=", options.timeout_s, " s: ", who,
                   ". Cause: ", cause,
                   ". Hint: look at the other ranks' logs; raise distributed.timeout if a rank is just slow");
  }

  void wait(const WorkPtr& work) { work->wait(timeout); }

  at::Tensor small(at::Tensor cpu) { return device.is_cpu() ? cpu : cpu.to(device); }

  template <class T>
  std::vector<T> reduce_small(std::vector<T> values, ReduceOp op, c10::ScalarType dtype) {
    if (values.empty()) return values;
    at::Tensor cpu = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(dtype));
    std::copy(values.begin(), values.end(), cpu.data_ptr<T>());
    at::Tensor t = small(cpu);
    count_allreduce(t.numel() * static_cast<int64_t>(t.element_size()));
    collective("allreduce", [&] {
      c10d::AllreduceOptions opts;
      opts.reduceOp = to_c10d(op);
      opts.timeout = timeout;
      std::vector<at::Tensor> one{t};
      wait(backend->allreduce(one, opts));
    });
    at::Tensor back = t.to(c10::kCPU).contiguous();
    std::copy(back.data_ptr<T>(), back.data_ptr<T>() + values.size(), values.begin());
    return values;
  }
};

ProcessGroup::ProcessGroup(const DistEnv& env, const ProcessGroupOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.env = env;
  m.options = options;
  MEMTUNE_CHECK(options.timeout_s > 0, "distributed.timeout=", options.timeout_s, " must be positive (seconds)");
  MEMTUNE_CHECK(options.bucket_size_mb > 0, "distributed.bucket_size_mb=", options.bucket_size_mb,
                " must be positive");
  MEMTUNE_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "rank ", env.rank,
                " is not in [0, ", env.world_size, ")");
  m.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  m.sent.assign(static_cast<size_t>(env.world_size), 0);
  const double join_s = options.join_timeout_s > 0 ? options.join_timeout_s : options.timeout_s;
  const auto join_timeout = std::chrono::milliseconds(static_cast<int64_t>(join_s * 1000));
  m.device = c10::Device(options.device);
  std::string backend = options.backend;
  if (backend == "auto") backend = m.device.is_cuda() ? "nccl" : "gloo";
  MEMTUNE_CHECK(backend == "gloo" || backend == "nccl", "distributed.backend='", options.backend,
                "' is unknown (use auto, gloo or nccl)");
  MEMTUNE_CHECK(backend != "nccl" || m.device.is_cuda(), "distributed.backend=nccl needs CUDA devices; this run is on ",
                options.device, ". Hint: distributed.backend=gloo (or auto)");
  MEMTUNE_CHECK(backend != "gloo" || m.device.is_cpu(), "distributed.backend=gloo runs collectives on the CPU; this run is on ",
                options.device, ". Hint: distributed.backend=nccl (or auto)");
  MEMTUNE_CHECK(backend_built(backend), "distributed.backend=", backend, ": this memtune was built without it (",
                backend == "gloo" ? "its LibTorch ships no gloo headers. Hint: install them (Debian: libgloo-dev) "
                                    "and rebuild, or train on CUDA devices with nccl"
                                  : "no CUDA. Hint: build against a LibTorch with CUDA",
                ")");
  m.backend_name = backend;

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0;
  store_options.numWorkers = static_cast<std::size_t>(env.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = join_timeout;
  try {
    m.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    const std::string why = message_of(e);
    // Rank 0 cannot listen: the port is taken, found at once (no time-out was waited for).
    MEMTUNE_CHECK(!(env.rank == 0 && why.find("ddress already in use") != std::string::npos),
                  "distributed: rank 0 cannot host the rendezvous: port ", env.master_port, " on ", env.master_addr,
                  " is already in use (another run or program holds it): ", why,
                  ". Hint: choose a free port with --master-port (memtune launch, torchrun) or MASTER_PORT");
    fail("distributed: rank ", env.rank, " of ", env.world_size, " could not join the rendezvous at ", env.master_addr,
         ":", env.master_port, " within ", join_s, " s (", env.rank == 0 ? "hosting it" : "connecting to rank 0",
         "): ", why, ". Hint: every rank must start with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE");
  }
  // Every rank marks itself joined and waits for the others, so a missing one is named.
  std::vector<std::string> joined;
  for (int r = 0; r < env.world_size; ++r) joined.push_back(str_cat("memtune/joined/", r));
  try {
    m.store->set(joined[env.rank], std::vector<uint8_t>{1});
    m.store->wait(joined, join_timeout);
  } catch (const std::exception& e) {
    std::string missing;
    try {
      for (int r = 0; r < env.world_size; ++r)
        if (!m.store->check({joined[r]})) missing += str_cat(missing.empty() ? "" : ", ", r);
    } catch (const std::exception&) {
      missing = "unknown (the store is unreachable)";
    }
    fail("distributed: rank ", env.rank, " of ", env.world_size, " could not join the rendezvous at ", env.master_addr,
         ":", env.master_port, " within ", join_s, " s: rank(s) ", missing,
         " did not join. Hint: start every rank (torchrun, memtune launch or srun) with the same WORLD_SIZE, "
         "MASTER_ADDR and MASTER_PORT");
  }
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>("memtune/pg", m.store);
  try {
    if (backend == "gloo") {
#ifdef MEMTUNE_GLOO
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(m.timeout);
      gloo_options->devices.push_back(gloo_device(env));
      gloo_options->threads = 2;
      m.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, env.rank, env.world_size, gloo_options);
#endif
    } else {
#ifdef MEMTUNE_CUDA
      m.backend = make_nccl_backend(pg_store, env.rank, env.world_size, m.timeout);
#endif
    }
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    fail("distributed: rank ", env.rank, " could not connect the ", backend, " process group of ", env.world_size,
         " ranks within ", options.timeout_s, " s: ", message_of(e));
  }
  spdlog::info("distributed: rank {} of {} (local {} of {}), {} over {}:{}, timeout {} s", env.rank, env.world_size,
               env.local_rank, env.local_world_size, backend, env.master_addr, env.master_port, options.timeout_s);
}

ProcessGroup::~ProcessGroup() = default;

bool ProcessGroup::backend_built(const std::string& backend) {
#ifdef MEMTUNE_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef MEMTUNE_CUDA
  if (backend == "nccl") return true;
#endif
  return false;
}

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::world_size() const { return impl_->env.world_size; }
const std::string& ProcessGroup::backend() const { return impl_->backend_name; }
int64_t ProcessGroup::sequence() const { return impl_->seq; }
c10::Device ProcessGroup::device() const { return impl_->device; }
std::vector<int64_t> ProcessGroup::sent_bytes() const { return impl_->sent; }
int64_t ProcessGroup::store_keys() const { return impl_->store->getNumKeys(); }

void ProcessGroup::allreduce_sum(const std::vector<at::Tensor>& tensors, bool host_buffers) {
  Impl& m = *impl_;
  MEMTUNE_INTERNAL_ASSERT(!host_buffers || m.device.is_cpu(), "allreduce_sum: host buffers for a group on ", m.device);
  const int64_t bucket_bytes = m.options.bucket_size_mb << 20;
  // Buckets of same-dtype tensors, in the given order (the same on every rank).
  std::map<c10::ScalarType, std::vector<std::vector<at::Tensor>>> buckets;
  std::map<c10::ScalarType, int64_t> filled;
  for (const auto& t : tensors) {
    MEMTUNE_INTERNAL_ASSERT(t.defined(), "allreduce_sum: undefined tensor (every rank must pass the same list)");
    MEMTUNE_INTERNAL_ASSERT(t.device() == m.device, "allreduce_sum: tensor on ", t.device(), ", the group runs on ", m.device);
    auto& list = buckets[t.scalar_type()];
    int64_t& bytes = filled[t.scalar_type()];
    if (list.empty() || bytes >= bucket_bytes) {
      list.emplace_back();
      bytes = 0;
    }
    list.back().push_back(t);
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  std::vector<int64_t> layout{host_buffers ? 1 : 0};
  for (const auto& [dtype, list] : buckets)
    for (const auto& bucket : list) {
      layout.push_back(static_cast<int64_t>(dtype));
      for (const auto& t : bucket) layout.push_back(t.numel());
      layout.push_back(-1);
    }
  if (layout != m.flat_layout) {
    m.flats.clear();
    m.flat_layout = layout;
    for (const auto& [dtype, list] : buckets)
      for (const auto& bucket : list) {
        int64_t numel = 0;
        for (const auto& t : bucket) numel += t.numel();
        m.flats.push_back(host_buffers ? offload_zeros({numel}, dtype)
                                       : at::empty({numel}, at::TensorOptions().dtype(dtype).device(m.device)));
      }
  }
  m.collective("allreduce_sum", [&] {
    std::vector<const std::vector<at::Tensor>*> order;
    std::vector<WorkPtr> works;
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = m.timeout;
    for (const auto& [dtype, list] : buckets) {
      for (const auto& bucket : list) {
        at::Tensor& flat = m.flats[order.size()];
        int64_t offset = 0;
        for (const auto& t : bucket) {
          flat.narrow(0, offset, t.numel()).copy_(t.reshape({-1}));
          offset += t.numel();
        }
        std::vector<at::Tensor> one{flat};
        m.count_allreduce(flat.numel() * static_cast<int64_t>(flat.element_size()));
        works.push_back(m.backend->allreduce(one, opts));
        order.push_back(&bucket);
      }
    }
    for (size_t i = 0; i < works.size(); ++i) {
      m.wait(works[i]);
      int64_t offset = 0;
      for (const auto& t : *order[i]) {
        t.copy_(m.flats[i].narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  });
}

std::vector<int64_t> ProcessGroup::allreduce(std::vector<int64_t> values, ReduceOp op) {
  return impl_->reduce_small(std::move(values), op, c10::kLong);
}

std::vector<double> ProcessGroup::allreduce(std::vector<double> values, ReduceOp op) {
  return impl_->reduce_small(std::move(values), op, c10::kDouble);
}

void ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  Impl& m = *impl_;
  MEMTUNE_INTERNAL_ASSERT(root >= 0 && root < m.env.world_size, "broadcast: root ", root, " out of range");
  at::Tensor t = tensor.device() == m.device && tensor.is_contiguous() ? tensor : tensor.to(m.device).contiguous();
  m.count_broadcast(t.numel() * static_cast<int64_t>(t.element_size()), root);
  m.collective("broadcast", [&] {
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = m.timeout;
    std::vector<at::Tensor> one{t};
    m.wait(m.backend->broadcast(one, opts));
  });
  if (!t.is_same(tensor)) tensor.copy_(t);
}

struct ProcessGroup::Pending::State {
  ProcessGroup::Impl* impl = nullptr;
  WorkPtr work;
  at::Tensor tensor;  // kept alive until the collective is done
  int64_t seq = 0;
  const char* what = "";
};

ProcessGroup::Pending::Pending() = default;
ProcessGroup::Pending::Pending(Pending&&) noexcept = default;
ProcessGroup::Pending& ProcessGroup::Pending::operator=(Pending&& other) noexcept {
  if (this != &other) {
    if (state_) {
      try {
        wait();
      } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
      }
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

ProcessGroup::Pending::~Pending() {
  if (!state_) return;
  try {
    wait();
  } catch (const std::exception& e) {  // unwinding already: say it, the first error stands
    spdlog::error("{}", e.what());
  }
}

void ProcessGroup::Pending::wait() {
  if (!state_) return;
  std::unique_ptr<State> s = std::move(state_);
  try {
    s->impl->wait(s->work);
  } catch (const std::exception& e) {
    fail(s->impl->diagnose(s->what, s->seq, message_of(e)));
  }
}

ProcessGroup::Pending ProcessGroup::broadcast_async(const at::Tensor& tensor, int root) {
  Impl& m = *impl_;
  MEMTUNE_INTERNAL_ASSERT(root >= 0 && root < m.env.world_size, "broadcast: root ", root, " out of range");
  MEMTUNE_INTERNAL_ASSERT(tensor.device() == m.device && tensor.is_contiguous(), "broadcast_async: a contiguous tensor on ",
                          m.device, " (got ", tensor.device(), ")");
  m.count_broadcast(tensor.numel() * static_cast<int64_t>(tensor.element_size()), root);
  Pending p;
  p.state_ = std::make_unique<Pending::State>();
  p.state_->impl = &m;
  p.state_->tensor = tensor;
  p.state_->what = "broadcast";
  p.state_->seq = m.seq;  // collective() takes this number
  m.collective("broadcast", [&] {
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = m.timeout;
    std::vector<at::Tensor> one{tensor};
    p.state_->work = m.backend->broadcast(one, opts);
  });
  return p;
}

void ProcessGroup::reduce_sum(const at::Tensor& tensor, int root) {
  Impl& m = *impl_;
  MEMTUNE_INTERNAL_ASSERT(root >= 0 && root < m.env.world_size, "reduce_sum: root ", root, " out of range");
  MEMTUNE_INTERNAL_ASSERT(tensor.device() == m.device && tensor.is_contiguous(), "reduce_sum: a contiguous tensor on ",
                          m.device, " (got ", tensor.device(), ")");
  m.count_reduce(tensor.numel() * static_cast<int64_t>(tensor.element_size()), root);
  m.collective("reduce", [&] {
    c10d::ReduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.rootRank = root;
    opts.rootTensor = 0;
    opts.timeout = m.timeout;
    std::vector<at::Tensor> one{tensor};
    m.wait(m.backend->reduce(one, opts));
  });
}

void ProcessGroup::barrier() {
  Impl& m = *impl_;
  m.collective("barrier", [&] {
    c10d::BarrierOptions opts;
    opts.timeout = m.timeout;
    m.wait(m.backend->barrier(opts));
  });
}

std::pair<bool, int64_t> ProcessGroup::agree(bool oom, int64_t proposal) {
  // max(flag), max(-proposal) = -min(proposal): one collective.
  auto r = allreduce(std::vector<int64_t>{oom ? 1 : 0, -proposal}, ReduceOp::max);
  return {r[0] != 0, -r[1]};
}

}  // namespace memtune
