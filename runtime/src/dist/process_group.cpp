// dist/process_group.cpp — rendezvous from the environment, c10d TCPStore + ProcessGroupGloo,
// collectives with errors that say which rank and which collective failed, and the bucketed
// data-parallel gradient all-reduce.
#include "dist/process_group.h"

#include <dlfcn.h>
#include <signal.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <array>
#include <charconv>
#include <functional>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "memrt/error.h"

namespace memrt {

namespace {

// ---- environment --------------------------------------------------------------------------------

// One launcher's names for rank, world size and local rank, and who sets them.
struct EnvFamily {
  const char* name;  // for DistEnvironment::source and messages
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* set_by;
};

constexpr EnvFamily kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                              "torchrun, the deepspeed launcher and `launcher --num_procs N`"};
constexpr EnvFamily kOpenMpi{"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun (Open MPI)"};
constexpr EnvFamily kSlurm{"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                           "srun (Slurm)"};

const char* kMasterHint =
    "torchrun, the deepspeed launcher and `launcher --num_procs N` set it; under srun or mpirun "
    "export it yourself, e.g. MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
    "head -n1) MASTER_PORT=29500";

std::optional<std::string> env_value(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

[[noreturn]] void env_error(const std::string& name, const std::string& message) {
  throw ConfigError("environment", name, message);
}

// A non-negative decimal integer, the whole string (surrounding blanks allowed).
int parse_env_int(const char* name, const std::string& text, const char* set_by) {
  size_t b = text.find_first_not_of(" \t");
  size_t e = text.find_last_not_of(" \t");
  long long v = -1;
  bool ok = false;
  if (b != std::string::npos) {
    const char* first = text.data() + b;
    const char* last = text.data() + e + 1;
    auto [ptr, ec] = std::from_chars(first, last, v);
    ok = ec == std::errc() && ptr == last && v >= 0 && v <= 0x7fffffff;
  }
  if (!ok) {
    env_error(name, "value '" + text + "' is not a non-negative integer (it is normally set by " +
                        set_by + ")");
  }
  return static_cast<int>(v);
}

int require_env_int(const char* name, const char* set_by, const std::string& why) {
  auto v = env_value(name);
  if (!v) {
    env_error(name, "is not set, but " + why + ". It is set by " + set_by +
                        "; set it, or start the job through one of those");
  }
  return parse_env_int(name, *v, set_by);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::chrono::seconds effective_timeout(std::chrono::seconds requested) {
  auto v = env_value("MEMRT_DIST_TIMEOUT");
  if (!v) return requested;
  int s = parse_env_int("MEMRT_DIST_TIMEOUT", *v, "the user (seconds to wait for a peer)");
  if (s <= 0) env_error("MEMRT_DIST_TIMEOUT", "must be a positive number of seconds, not " + *v);
  return std::chrono::seconds(s);
}

// The backend's own message, without a C++ backtrace.
std::string backend_message(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << "a " << c10::toString(t.scalar_type()) << " tensor of shape " << t.sizes() << " ("
    << t.nbytes() << " bytes)";
  return s.str();
}

// 64-bit FNV-1a, folded to 62 bits so that both h and -h fit in an int64 max-reduction.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  int64_t value() const { return static_cast<int64_t>(h & ((uint64_t{1} << 62) - 1)); }
};

}  // namespace

DistEnvironment read_dist_environment() {
  const EnvFamily* fam = nullptr;
  if (env_value(kTorchrun.rank) || env_value(kTorchrun.world_size)) {
    fam = &kTorchrun;
  } else if (env_value(kOpenMpi.rank) || env_value(kOpenMpi.world_size)) {
    fam = &kOpenMpi;
  } else if (env_value(kSlurm.rank) || env_value(kSlurm.world_size)) {
    fam = &kSlurm;
  }
  DistEnvironment env;
  if (fam == nullptr) {
    env.source = "none";
    return env;  // a single process
  }
  env.source = fam->name;
  const std::string both = std::string(fam->rank) + " and " + fam->world_size;
  env.world_size = require_env_int(fam->world_size, fam->set_by,
                                   both + " go together (" + fam->rank + " is set)");
  env.rank = require_env_int(fam->rank, fam->set_by,
                             both + " go together (" + fam->world_size + " is set)");
  if (env.world_size < 1) {
    env_error(fam->world_size, "must be at least 1, not " + std::to_string(env.world_size));
  }
  if (env.rank >= env.world_size) {
    env_error(fam->rank, "is " + std::to_string(env.rank) + " but " + fam->world_size + " is " +
                             std::to_string(env.world_size) + "; ranks run from 0 to " +
                             std::to_string(env.world_size - 1));
  }
  if (env.world_size == 1) {
    if (auto lr = env_value(fam->local_rank)) env.local_rank = parse_env_int(fam->local_rank, *lr, fam->set_by);
    return env;  // no rendezvous for one rank
  }

  const std::string multi = std::string(fam->world_size) + " is " +
                            std::to_string(env.world_size) + " (several ranks)";
  env.local_rank = require_env_int(fam->local_rank, fam->set_by, multi);
  if (env.local_rank > env.rank) {
    env_error(fam->local_rank, "is " + std::to_string(env.local_rank) + ", larger than the global " +
                                   fam->rank + " " + std::to_string(env.rank) +
                                   "; a local rank counts the ranks on this host only");
  }
  auto addr = env_value("MASTER_ADDR");
  if (!addr || addr->empty()) {
    env_error("MASTER_ADDR", "is not set, but " + multi +
                                 " and the ranks meet at a store on rank 0's host. " + kMasterHint);
  }
  env.master_addr = *addr;
  auto port = env_value("MASTER_PORT");
  if (!port) {
    env_error("MASTER_PORT", "is not set, but " + multi +
                                 " and the ranks meet at a store on rank 0's host. " + kMasterHint);
  }
  env.master_port = parse_env_int("MASTER_PORT", *port, kMasterHint);
  if (env.master_port < 1 || env.master_port > 65535) {
    env_error("MASTER_PORT", "must be a TCP port between 1 and 65535, not " + *port);
  }
  return env;
}

// ---- the context --------------------------------------------------------------------------------

struct DistContext::Impl {
  int rank = 0;
  int world_size = 1;
  std::chrono::seconds timeout{60};
  std::string backend_name;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string broken;  // the first failure; non-empty: every later collective fails at once

  // ---- gradient buckets ----
  struct Segment {
    size_t grad;          // index into the list of defined grads
    int64_t offset;       // first element within that grad
    int64_t numel;
    int64_t bucket_offset;
  };
  struct Bucket {
    at::ScalarType dtype;
    c10::Device device{c10::kCPU};
    int64_t numel = 0;
    std::vector<Segment> segments;
  };
  struct Plan {
    std::vector<int64_t> key;  // what it was built for: (index, dtype, numel) per grad, bucket size
    std::vector<Bucket> buckets;
  };
  Plan plan;
  // Two staging buffers per (dtype, device): bucket k uses slot k % 2 of its group.
  std::map<std::pair<int, std::string>, std::array<at::Tensor, 2>> staging;

  [[noreturn]] void fail(const std::string& what, const std::string& message) {
    std::ostringstream s;
    s << "rank " << rank << " of " << world_size << ": " << what << " failed: " << message;
    broken = s.str();
    throw DistributedError(broken);
  }

  void check_usable(const std::string& what) const {
    if (!broken.empty()) {
      throw DistributedError("rank " + std::to_string(rank) + ": " + what +
                             " refused: an earlier collective failed, the process group is "
                             "unusable and the job must stop. First failure: " + broken);
    }
  }

  // Waits for `work` (bounded) and turns any backend failure into a DistributedError. With Gloo,
  // then waits for the backend to let go of it: Gloo's worker thread marks a work complete and only
  // then drops its own reference (and with it the work's tensors), so without this a buffer memrt
  // drops after a collective would be freed a moment later on another thread, and the memory
  // report's peak would depend on which thread got there first. The worker lets go within
  // microseconds of completing; the bound only keeps a slow one from stalling training. (NCCL's
  // watchdog keeps works longer, and its tensors live in the caching allocator anyway.)
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    try {
      // Gloo's own timeout fires first with its message; ours is the backstop.
      work->wait(std::chrono::duration_cast<std::chrono::milliseconds>(timeout) +
                 std::chrono::seconds(5));
    } catch (const std::exception& e) {
      fail(what, peer_message(e));
    }
    if (backend_name != "Gloo") return;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    while (work.use_count() > 1 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  }

  // Runs `launch` (which starts a collective) and turns a synchronous failure into an error.
  template <class F>
  c10::intrusive_ptr<c10d::Work> start(const std::string& what, F&& launch) {
    check_usable(what);
    try {
      return launch();
    } catch (const std::exception& e) {
      fail(what, peer_message(e));
    }
  }

  std::string peer_message(const std::exception& e) const {
    return "a peer rank probably died or stopped responding (each collective waits at most " +
           std::to_string(timeout.count()) + " s; look for the first error in the other ranks' " +
           "output). " + backend_name + " said: " + backend_message(e);
  }

  // A collective on `t` in place, waited for: `launch(ts)` starts it on ts = {t, or a contiguous
  // copy of t}; with `result_here`, a copy's result goes back into t.
  template <class F>
  void in_place(at::Tensor& t, const std::string& what, bool result_here, F&& launch) {
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    std::vector<at::Tensor> ts{buf};
    wait(start(what, [&] { return launch(ts); }), what);
    if (result_here && !buf.is_same(t)) t.copy_(buf);
  }

  void all_reduce(at::Tensor& t, c10d::ReduceOp::RedOpType op, const char* name) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp(op);
    in_place(t, std::string(name) + " of " + describe(t), true,
             [&](std::vector<at::Tensor>& ts) { return backend->allreduce(ts, opts); });
  }
};

DistContext::DistContext(DistEnvironment env, std::chrono::seconds timeout)
    : env_(std::move(env)), timeout_(timeout) {}

DistContext::~DistContext() = default;

namespace {

// c10d's NCCL backend, from libmemrt_nccl.so beside the library holding this code (built where
// LibTorch has CUDA and NCCL's header was found; see nccl_backend.cpp for why it stands apart).
c10::intrusive_ptr<c10d::Backend> nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                               const DistEnvironment& env, std::chrono::milliseconds timeout) {
  Dl_info self{};
  dladdr(reinterpret_cast<void*>(&nccl_backend), &self);
  const std::string self_path = self.dli_fname ? std::string(self.dli_fname) : std::string();
  const std::string path = self_path.substr(0, self_path.rfind('/') + 1) + "libmemrt_nccl.so";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);  // never closed: LibTorch's CUDA stays
  using Make = c10d::Backend* (*)(const c10::intrusive_ptr<c10d::Store>*, int, int, int64_t);
  const auto make = lib ? reinterpret_cast<Make>(dlsym(lib, "memrt_nccl_backend")) : nullptr;
  if (!make) {
    const char* why = dlerror();
    throw DistributedError("rank " + std::to_string(env.rank) + ": CUDA tensors need the NCCL backend, and " + path +
                           " cannot be loaded (" + (why ? why : "no memrt_nccl_backend in it") +
                           "): this memrt was built without NCCL (a CUDA LibTorch and nccl.h) or the "
                           "library was moved; train on the CPU or rebuild against a CUDA LibTorch");
  }
  return c10::intrusive_ptr<c10d::Backend>::reclaim(make(&store, env.rank, env.world_size, timeout.count()));
}

c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                               const DistEnvironment& env,
                                               std::chrono::seconds timeout,
                                               c10::DeviceType device, std::string& name) {
  auto timeout_ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  if (device == c10::DeviceType::CUDA) {
    // The NCCL seam: one CUDA device per rank (LOCAL_RANK), chosen by the caller before this.
    name = "NCCL";
    return nccl_backend(store, env, timeout_ms);
  }
  if (device != c10::DeviceType::CPU) {
    throw DistributedError("rank " + std::to_string(env.rank) + ": no process-group backend for " +
                           c10::DeviceTypeName(device) + " tensors; use CPU (Gloo) or CUDA (NCCL)");
  }
  name = "Gloo";
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout_ms);
  // Which local address Gloo listens on: GLOO_SOCKET_IFNAME as in PyTorch; loopback when the
  // whole job is on this host; otherwise the address this host's name resolves to.
  if (auto ifname = env_value("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
  } else if (is_loopback(env.master_addr)) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
}

}  // namespace

std::shared_ptr<DistContext> DistContext::from_environment(std::chrono::seconds timeout,
                                                           c10::DeviceType device) {
  return create(read_dist_environment(), timeout, device);
}

std::shared_ptr<DistContext> DistContext::create(const DistEnvironment& env,
                                                 std::chrono::seconds timeout,
                                                 c10::DeviceType device) {
  timeout = effective_timeout(timeout);
  std::shared_ptr<DistContext> ctx(new DistContext(env, timeout));
  if (env.world_size <= 1) return ctx;
  // A peer that dies closes its sockets, and the next write to one raises SIGPIPE, whose default
  // action ends this process without a word (exit 141) before Gloo can report the broken pipe and
  // this rank say what happened. Python ignores SIGPIPE at start-up, so PyTorch's ranks get the
  // error; so do memrt's, unless the program installed a handler of its own.
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);

  auto impl = std::make_unique<Impl>();
  impl->rank = env.rank;
  impl->world_size = env.world_size;
  impl->timeout = timeout;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = true;
    so.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    throw DistributedError(
        "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
        ": rendezvous at MASTER_ADDR:MASTER_PORT = " + where + " failed within " +
        std::to_string(timeout.count()) + " s. " +
        (env.rank == 0 ? "Rank 0 hosts the store there: is the port free on this host, and did "
                         "all " + std::to_string(env.world_size) + " ranks start? "
                       : "Is rank 0 running, and is " + where + " reachable from this host? ") +
        "Every rank needs the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE. c10d said: " +
        backend_message(e));
  }
  try {
    impl->backend = make_backend(impl->store, env, timeout, device, impl->backend_name);
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistributedError("rank " + std::to_string(env.rank) + " of " +
                           std::to_string(env.world_size) + ": connecting the " +
                           (impl->backend_name.empty() ? std::string("process group")
                                                       : impl->backend_name) +
                           " process group (store at " + where + ") failed within " +
                           std::to_string(timeout.count()) +
                           " s; a peer rank probably died during start-up. c10d said: " +
                           backend_message(e));
  }
  ctx->impl_ = std::move(impl);
  // Every rank has finished connecting before any may leave (rank 0's store must outlive the
  // others' use of it).
  ctx->barrier();
  return ctx;
}

void DistContext::all_reduce_sum(at::Tensor& t) {
  if (!impl_) return;
  impl_->all_reduce(t, c10d::ReduceOp::SUM, "all_reduce_sum");
}

void DistContext::all_reduce_max(at::Tensor& t) {
  if (!impl_) return;
  impl_->all_reduce(t, c10d::ReduceOp::MAX, "all_reduce_max");
}

namespace {

// A started c10d work: waited for once, by wait() (through the context, which turns a failure into
// a DistributedError) or by the destructor (bounded by `timeout`, touching only the work: the
// context may be gone when a handle is dropped while unwinding).
class PendingWork final : public Communicator::Pending {
 public:
  using Wait = std::function<void(const c10::intrusive_ptr<c10d::Work>&)>;
  PendingWork(c10::intrusive_ptr<c10d::Work> work, Wait wait, std::chrono::milliseconds timeout)
      : work_(std::move(work)), wait_(std::move(wait)), timeout_(timeout) {}
  ~PendingWork() override {
    if (!work_) return;
    try {
      work_->wait(timeout_);
    } catch (const std::exception&) {  // the job is failing already; its first error is reported
    }
  }
  void wait() override {
    if (!work_) return;
    const c10::intrusive_ptr<c10d::Work> work = std::move(work_);
    work_.reset();
    wait_(work);
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Wait wait_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<Communicator::Pending> DistContext::broadcast_async(at::Tensor& t, int root) {
  if (!impl_ || !t.is_contiguous()) return Communicator::broadcast_async(t, root);  // one rank: nothing to do
  if (root < 0 || root >= world_size()) broadcast(t, root);  // the blocking call's error
  std::string what = "broadcast from rank " + std::to_string(root) + " of " + describe(t);
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  c10::intrusive_ptr<c10d::Work> work = impl_->start(what, [&] { return impl_->backend->broadcast(ts, opts); });
  Impl* impl = impl_.get();
  return std::make_unique<PendingWork>(
      std::move(work), [impl, what](const c10::intrusive_ptr<c10d::Work>& w) { impl->wait(w, what); },
      std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
}

namespace {

void check_root(const char* what, int root, int rank, int world_size) {
  if (root < 0 || root >= world_size) {
    throw DistributedError("rank " + std::to_string(rank) + ": " + what + " root " + std::to_string(root) +
                           " is impossible with " + std::to_string(world_size) +
                           " rank(s); the root must be in [0, " + std::to_string(world_size - 1) + "]");
  }
}

}  // namespace

void DistContext::broadcast(at::Tensor& t, int root) {
  check_root("broadcast from", root, rank(), world_size());
  if (!impl_) return;
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->in_place(t, "broadcast from rank " + std::to_string(root) + " of " + describe(t), true,
                  [&](std::vector<at::Tensor>& ts) { return impl_->backend->broadcast(ts, opts); });
}

namespace {

void check_sizes(const char* what, const at::Tensor& out, const at::Tensor& in, int64_t out_numel,
                 int rank) {
  if (out.numel() != out_numel || out.scalar_type() != in.scalar_type()) {
    throw DistributedError("rank " + std::to_string(rank) + ": " + what + ": out is " +
                           describe(out) + " but in is " + describe(in) + "; expected out of " +
                           std::to_string(out_numel) + " elements of the same dtype");
  }
}

}  // namespace

void DistContext::all_gather(at::Tensor& out, const at::Tensor& in) {
  check_sizes("all_gather", out, in, in.numel() * world_size(), rank());
  if (!impl_) {
    out.view({-1}).copy_(in.reshape({-1}));
    return;
  }
  std::string what = "all_gather of " + describe(in);
  at::Tensor src = in.contiguous().view({-1});                                 // (n,)
  at::Tensor dst = out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());  // (N * n,)
  impl_->wait(impl_->start(what, [&] { return impl_->backend->_allgather_base(dst, src); }), what);
  if (!out.is_contiguous()) out.copy_(dst.view(out.sizes()));
}

void DistContext::reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  // in must hold exactly world_size slices of out's size.
  check_sizes("reduce_scatter_sum", out, in,
              in.numel() % world_size() == 0 ? in.numel() / world_size() : -1, rank());
  if (!impl_) {
    out.view({-1}).copy_(in.reshape({-1}));
    return;
  }
  std::string what = "reduce_scatter_sum of " + describe(in);
  at::Tensor dst = out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());  // (n,)
  if (impl_->backend_name == "Gloo") {
    // Gloo's reduce-scatter is an all-reduce of a copy of the input followed by a copy of this
    // rank's slice (ProcessGroupGloo::reduce_scatter_tensor_coalesced), with the copy held by works
    // its worker threads release on their own time. The same steps here, on a copy memrt owns:
    // the same bytes on the wire and in memory, freed when this function returns.
    at::Tensor sum = in.reshape({-1}).clone();  // (N * n,)
    std::vector<at::Tensor> ts{sum};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    impl_->wait(impl_->start(what, [&] { return impl_->backend->allreduce(ts, opts); }), what);
    dst.copy_(sum.narrow(0, rank() * dst.numel(), dst.numel()));
  } else {
    at::Tensor src = in.contiguous().view({-1});  // (N * n,)
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    impl_->wait(impl_->start(what, [&] { return impl_->backend->_reduce_scatter_base(dst, src, opts); }),
                what);
  }
  if (!out.is_contiguous()) out.copy_(dst.view(out.sizes()));
}

void DistContext::reduce_sum(at::Tensor& t, int root) {
  check_root("reduce_sum to", root, rank(), world_size());
  if (!impl_) return;
  c10d::ReduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.rootRank = root;
  impl_->in_place(t, "reduce_sum to rank " + std::to_string(root) + " of " + describe(t), rank() == root,
                  [&](std::vector<at::Tensor>& ts) { return impl_->backend->reduce(ts, opts); });
}

void DistContext::barrier() {
  if (!impl_) return;
  impl_->wait(impl_->start("barrier", [&] { return impl_->backend->barrier(); }), "barrier");
}

int64_t DistContext::comm_buffer_bytes() const {
  if (!impl_) return 0;
  int64_t n = 0;
  for (const auto& kv : impl_->staging) {
    for (const auto& t : kv.second) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  }
  return n;
}

void DistContext::all_reduce_gradients(const std::vector<at::Tensor>& params,
                                       const GradReduceOptions& options) {
  if (!impl_) return;  // the mean over one rank is the gradient itself
  // The defined grads, made dense and contiguous in place so buckets can copy back into them.
  std::vector<at::Tensor> grads;
  std::vector<int64_t> ids;
  grads.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor p = params[i];
    if (!p.defined() || !p.grad().defined()) continue;
    if (p.grad().is_sparse()) {
      throw DistributedError("rank " + std::to_string(rank()) + ": all_reduce_gradients: parameter " +
                             std::to_string(i) + " has a sparse gradient; only dense gradients "
                             "are averaged (use a dense embedding)");
    }
    if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
    grads.push_back(p.grad());
    ids.push_back(static_cast<int64_t>(i));
  }
  reduce_in_buckets(grads, ids, options);
}

void DistContext::all_reduce_tensors(const std::vector<at::Tensor>& tensors, const GradReduceOptions& options) {
  if (!impl_) return;
  std::vector<int64_t> ids;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].is_contiguous())
      throw DistributedError("rank " + std::to_string(rank()) + ": all_reduce_tensors: tensor " +
                             std::to_string(i) + " is not contiguous");
    ids.push_back(static_cast<int64_t>(i));
  }
  reduce_in_buckets(tensors, ids, options);
}

void DistContext::reduce_in_buckets(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& ids,
                                    const GradReduceOptions& options) {
  Impl& im = *impl_;
  const double n = static_cast<double>(world_size());
  if (options.bucket_bytes <= 0) {
    throw ConfigError("ds_config", "allreduce_bucket_size",
                      "must be positive, got " + std::to_string(options.bucket_bytes) + " bytes");
  }
  std::vector<int64_t> key;
  for (size_t g = 0; g < grads.size(); ++g) {
    key.push_back(ids[g]);
    key.push_back(static_cast<int64_t>(grads[g].scalar_type()));
    key.push_back(grads[g].numel());
  }
  key.push_back(options.bucket_bytes);

  if (key != im.plan.key) {
    // ---- new plan: per (dtype, device) group, cut the grads' concatenation into buckets ----
    Impl::Plan plan;
    plan.key = key;
    std::map<std::pair<int, std::string>, std::vector<size_t>> groups;  // ordered: same on all ranks
    for (size_t g = 0; g < grads.size(); ++g) {
      groups[{static_cast<int>(grads[g].scalar_type()), grads[g].device().str()}].push_back(g);
    }
    for (const auto& [gk, members] : groups) {
      const at::Tensor& first = grads[members.front()];
      const int64_t cap = std::max<int64_t>(1, options.bucket_bytes / static_cast<int64_t>(first.element_size()));
      Impl::Bucket cur{first.scalar_type(), first.device(), 0, {}};
      for (size_t g : members) {
        int64_t off = 0, left = grads[g].numel();
        while (left > 0) {
          int64_t take = std::min(left, cap - cur.numel);
          cur.segments.push_back({g, off, take, cur.numel});
          cur.numel += take;
          off += take;
          left -= take;
          if (cur.numel == cap) {
            plan.buckets.push_back(std::move(cur));
            cur = Impl::Bucket{first.scalar_type(), first.device(), 0, {}};
          }
        }
      }
      if (cur.numel > 0) plan.buckets.push_back(std::move(cur));
    }

    // ---- every rank must hold the same grads, or the buckets would not line up ----
    Fnv h;
    int64_t total = 0;
    for (size_t k = 0; k + 2 < key.size(); k += 3) {
      h.add(static_cast<uint64_t>(key[k]));
      h.add(static_cast<uint64_t>(key[k + 1]));
      h.add(static_cast<uint64_t>(key[k + 2]));
      total += key[k + 2];
    }
    h.add(static_cast<uint64_t>(options.bucket_bytes));
    at::Tensor sig = at::empty({2}, at::kLong);  // (2,): hash, -hash
    sig[0] = h.value();
    sig[1] = -h.value();
    all_reduce_max(sig);
    if (sig[0].item<int64_t>() != h.value() || sig[1].item<int64_t>() != -h.value()) {
      im.fail("all_reduce_gradients",
              "the ranks hold different sets of gradients or bucket sizes (this rank: " +
                  std::to_string(grads.size()) + " gradients, " + std::to_string(total) +
                  " elements, bucket " + std::to_string(options.bucket_bytes) +
                  " bytes). Every rank must produce a gradient for the same parameters "
                  "(a parameter unused on one rank still needs a zero gradient) and use the "
                  "same allreduce_bucket_size");
    }

    // Staging buffers sized for the largest bucket of their group; freed when unused.
    std::map<std::pair<int, std::string>, int64_t> need;
    for (const auto& b : plan.buckets) {
      auto& v = need[{static_cast<int>(b.dtype), b.device.str()}];
      v = std::max(v, b.numel);
    }
    decltype(im.staging) staging;
    for (const auto& [gk, numel] : need) {
      size_t nbuckets = 0;
      for (const auto& b : plan.buckets) {
        nbuckets += (static_cast<int>(b.dtype) == gk.first && b.device.str() == gk.second);
      }
      auto& slots = staging[gk];
      for (size_t s = 0; s < std::min<size_t>(2, nbuckets); ++s) {
        auto old = im.staging.find(gk);
        if (old != im.staging.end() && old->second[s].defined() && old->second[s].numel() == numel) {
          slots[s] = old->second[s];
        } else {
          slots[s] = at::empty({numel}, at::TensorOptions()
                                            .dtype(static_cast<at::ScalarType>(gk.first))
                                            .device(c10::Device(gk.second)));  // (numel,)
        }
      }
    }
    im.staging = std::move(staging);
    im.plan = std::move(plan);
  }

  const double post = 1.0 / n;  // the mean (DeepSpeed §1.3, "postscale")

  // ---- pack, all-reduce, unpack; two slots per group so packing overlaps communication ----
  struct Pending {
    const Impl::Bucket* bucket = nullptr;
    at::Tensor buf;
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<at::Tensor> ts;
  };
  std::map<std::pair<int, std::string>, std::array<Pending, 2>> pending;
  std::map<std::pair<int, std::string>, size_t> counter;
  auto finish = [&](Pending& p) {
    if (!p.bucket) return;
    im.wait(p.work, "all_reduce_gradients (bucket of " + describe(p.buf) + ")");
    p.buf.mul_(post);
    for (const auto& s : p.bucket->segments) {
      grads[s.grad].view({-1}).narrow(0, s.offset, s.numel).copy_(p.buf.narrow(0, s.bucket_offset, s.numel));
    }
    p = Pending{};
  };
  for (const auto& b : im.plan.buckets) {
    std::pair<int, std::string> gk{static_cast<int>(b.dtype), b.device.str()};
    size_t slot = counter[gk]++ % 2;
    Pending& p = pending[gk][slot];
    finish(p);  // the bucket that used this slot two steps ago
    at::Tensor buf = im.staging[gk][slot].narrow(0, 0, b.numel);  // (bucket numel,)
    for (const auto& s : b.segments) {
      buf.narrow(0, s.bucket_offset, s.numel).copy_(grads[s.grad].view({-1}).narrow(0, s.offset, s.numel));
    }
    p.bucket = &b;
    p.buf = buf;
    p.ts = {buf};
    std::string what = "all_reduce_gradients (bucket of " + describe(buf) + ")";
    p.work = im.start(what, [&] { return im.backend->allreduce(p.ts); });
  }
  // Finish in launch order: per group the older of the two pending buckets first.
  for (auto& [gk, slots] : pending) {
    size_t total = counter[gk];
    size_t first = total >= 2 ? total % 2 : 0;
    finish(slots[first]);
    finish(slots[1 - first]);
  }
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.world_size();
  if (n == 1) return {mine};
  at::Tensor len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lens = at::empty({n}, at::kLong);
  comm.all_gather(lens, len);
  const int64_t longest = lens.max().item<int64_t>();
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  comm.all_gather(all, bytes);
  std::vector<std::string> out;
  const auto* p = all.data_ptr<uint8_t>();
  for (int r = 0; r < n; ++r) {
    const char* s = reinterpret_cast<const char*>(p + r * longest);
    out.emplace_back(s, static_cast<size_t>(lens[r].item<int64_t>()));
  }
  return out;
}

}  // namespace memrt
