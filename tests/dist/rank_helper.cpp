// dist_rank_helper — one rank of a multi-process test, driven by its arguments and by the
// environment a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
// Every mode checks its results against values computed here independently of the code under
// test (closed-form sums, or every rank's inputs regenerated locally), prints "OK <mode> ..." and
// exits 0; any mismatch prints "FAIL ..." to stderr and exits 1.
//
//   dist_rank_helper collectives          all_reduce sum/max, broadcast (and async), reduce to a
//                                         root, all_gather, reduce_scatter, barrier (several
//                                         dtypes, strided tensors)
//   dist_rank_helper grads B1 B2 ...      all_reduce_gradients with bucket sizes B1, B2 ... bytes,
//                                         against the plain mean / sum / DeepSpeed scalings
//   dist_rank_helper dp_equiv             shard-gradient average == full-batch gradient
//   dist_rank_helper die VICTIM N [hang]  all-reduce in a loop; rank VICTIM SIGKILLs itself after
//                                         N rounds (SIGSTOPs itself with "hang"); the others must
//                                         catch DistributedError (exit 3)
//   dist_rank_helper echo CODE FAILRANK [ignore_term [READY_FIFO]]
//                                         print lines to stdout/stderr; FAILRANK exits CODE
//                                         (or SIGKILLs itself if CODE is "kill"); with
//                                         FAILRANK >= 0 the others wait for a signal (ignoring
//                                         SIGTERM with ignore_term); with READY_FIFO FAILRANK
//                                         waits until the others have set up (no start-up race)
//   dist_rank_helper signal_parent        rank 0 sends SIGTERM to its parent (the launcher), then
//                                         every rank waits for a signal
#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "memrt/error.h"

namespace {

using memrt::Communicator;
using memrt::DistContext;

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL " << what << std::endl;
    ++g_failures;
  }
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what,
                  double rtol = 1e-6, double atol = 1e-7) {
  bool ok = got.sizes() == want.sizes() && at::allclose(got.to(at::kDouble), want.to(at::kDouble), rtol, atol);
  if (!ok) {
    double diff = got.sizes() == want.sizes()
                      ? (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>()
                      : -1.0;
    expect(false, what + ": max abs difference " + std::to_string(diff));
  }
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  expect(got.sizes() == want.sizes() && at::equal(got, want), what);
}

// ---- collectives ----------------------------------------------------------------------------------

void run_collectives(DistContext& d) {
  const int r = d.rank(), w = d.world_size();
  const double tri = w * (w + 1) / 2.0;  // sum over ranks of (rank + 1)

  // all_reduce_sum, float: t = (rank + 1) * [0, 1, ..., 999] -> tri * [0, ..., 999]
  at::Tensor base = at::arange(1000, at::kFloat);  // (1000,)
  at::Tensor t = base * static_cast<float>(r + 1);
  d.all_reduce_sum(t);
  expect_close(t, base * static_cast<float>(tri), "all_reduce_sum float32");

  // int64 and double
  at::Tensor ti = at::full({7}, static_cast<int64_t>(r + 1), at::kLong);  // (7,)
  d.all_reduce_sum(ti);
  expect_equal(ti, at::full({7}, static_cast<int64_t>(tri), at::kLong), "all_reduce_sum int64");
  at::Tensor td = at::full({3, 5}, 0.5 * (r + 1), at::kDouble);  // (3, 5)
  d.all_reduce_sum(td);
  expect_close(td, at::full({3, 5}, 0.5 * tri, at::kDouble), "all_reduce_sum float64");

  // A strided (non-contiguous) view is reduced in place too.
  at::Tensor m = at::arange(12, at::kFloat).view({3, 4}) * static_cast<float>(r + 1);  // (3, 4)
  at::Tensor mt = m.t();                                                            // (4, 3) view
  d.all_reduce_sum(mt);
  expect_close(m, at::arange(12, at::kFloat).view({3, 4}) * static_cast<float>(tri),
               "all_reduce_sum strided view");

  // all_reduce_max: t[i] = (7 i + 3 rank) mod 11; the max over ranks computed here.
  at::Tensor idx = at::arange(50, at::kLong);  // (50,)
  at::Tensor mx = ((idx * 7 + 3 * r) % 11).to(at::kFloat);
  at::Tensor want = ((idx * 7) % 11).to(at::kFloat);
  for (int q = 1; q < w; ++q) want = at::maximum(want, ((idx * 7 + 3 * q) % 11).to(at::kFloat));
  d.all_reduce_max(mx);
  expect_equal(mx, want, "all_reduce_max");

  // broadcast from the last rank and from rank 0
  for (int root : {w - 1, 0}) {
    at::Tensor b = at::full({4, 4}, static_cast<float>(100 * r + 1), at::kFloat);  // (4, 4)
    d.broadcast(b, root);
    expect_equal(b, at::full({4, 4}, static_cast<float>(100 * root + 1), at::kFloat),
                 "broadcast from rank " + std::to_string(root));
  }

  // reduce_sum to the last rank and to rank 0, the second into a strided view: the root holds the
  // sum (the others' values are the backend's).
  for (int root : {w - 1, 0}) {
    at::Tensor sum = at::arange(12, at::kFloat).view({3, 4}) * static_cast<float>(r + 1);  // (3, 4)
    at::Tensor target = root == 0 ? sum.t() : sum;                                        // (4, 3) view or (3, 4)
    d.reduce_sum(target, root);
    if (r == root)
      expect_close(sum, at::arange(12, at::kFloat).view({3, 4}) * static_cast<float>(tri),
                   "reduce_sum to rank " + std::to_string(root));
  }

  // broadcast_async: one broadcast from every rank in flight at once, a blocking collective issued
  // meanwhile (ZeRO-3's prefetch beside a bucket's reduction), then each waited for.
  {
    std::vector<at::Tensor> parts;
    std::vector<std::unique_ptr<Communicator::Pending>> pending;
    for (int root = 0; root < w; ++root) {
      parts.push_back(at::full({1000}, static_cast<float>(r == root ? 10 * root + 7 : -1), at::kFloat));  // (1000,)
      pending.push_back(d.broadcast_async(parts.back(), root));
    }
    at::Tensor meanwhile = at::ones({8}, at::kFloat);  // (8,)
    d.all_reduce_sum(meanwhile);
    expect_equal(meanwhile, at::full({8}, static_cast<float>(w), at::kFloat), "all_reduce_sum beside broadcast_async");
    for (int root = 0; root < w; ++root) {
      pending[static_cast<size_t>(root)]->wait();
      expect_equal(parts[static_cast<size_t>(root)], at::full({1000}, static_cast<float>(10 * root + 7), at::kFloat),
                   "broadcast_async from rank " + std::to_string(root));
    }
  }

  // all_gather: every rank contributes [rank, rank + 0.5, rank + 0.25]
  at::Tensor in = at::tensor({0.0f, 0.5f, 0.25f}) + static_cast<float>(r);  // (3,)
  at::Tensor gathered = at::empty({3 * w}, at::kFloat);                   // (3 W,)
  d.all_gather(gathered, in);
  std::vector<float> expect_g;
  for (int q = 0; q < w; ++q) {
    for (float o : {0.0f, 0.5f, 0.25f}) expect_g.push_back(static_cast<float>(q) + o);
  }
  expect_equal(gathered, at::tensor(expect_g), "all_gather");

  // reduce_scatter_sum: in = (rank + 1) * [0, ..., 4W-1]; this rank keeps slice [4r, 4r + 4)
  at::Tensor rs_in = at::arange(4 * w, at::kFloat) * static_cast<float>(r + 1);  // (4 W,)
  at::Tensor rs_out = at::empty({4}, at::kFloat);                                // (4,)
  d.reduce_scatter_sum(rs_out, rs_in);
  expect_close(rs_out, at::arange(4 * r, 4 * r + 4, at::kFloat) * static_cast<float>(tri),
               "reduce_scatter_sum");

  // When a collective returns, the backend holds none of its tensors: a buffer memrt drops right
  // after is freed then, on this thread (Gloo's worker thread used to drop its reference a moment
  // later, so the memory report's peak depended on which thread got there first).
  int held = 0;
  for (int i = 0; i < 200; ++i) {
    at::Tensor x = at::ones({1 << 14}, at::kFloat);  // (16384,)
    d.all_reduce_sum(x);
    held += x.use_count() > 1 ? 1 : 0;
  }
  expect(held == 0, "all_reduce_sum: the backend still held the tensor after " + std::to_string(held) +
                        " of 200 collectives returned");

  d.barrier();
}

// ---- gradients ------------------------------------------------------------------------------------

// The parameters every rank holds: float32 tensors of several shapes (one larger than any small
// bucket), a float64 one, a scalar, and one without a gradient.
std::vector<at::Tensor> make_params() {
  std::vector<at::Tensor> ps = {
      at::zeros({64, 33}, at::kFloat),  // (64, 33) 8448 B
      at::zeros({33}, at::kFloat),      // (33,)
      at::zeros({}, at::kFloat),        // ()
      at::zeros({7, 3}, at::kDouble),   // (7, 3) float64: its own buckets
      at::zeros({5}, at::kFloat),       // (5,) no gradient
      at::zeros({300}, at::kFloat),     // (300,)
  };
  for (auto& p : ps) p.set_requires_grad(true);
  return ps;
}

// Rank q's gradient of parameter i: normal values from a generator seeded by (q, i).
at::Tensor grad_of(int q, size_t i, const at::Tensor& p) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + 97 * q + static_cast<uint64_t>(i));
  return at::normal(0.0, 1.0, p.sizes(), gen, at::TensorOptions().dtype(p.scalar_type()));
}

void set_grads(std::vector<at::Tensor>& ps, int q) {
  for (size_t i = 0; i < ps.size(); ++i) {
    if (i == 4) continue;
    ps[i].mutable_grad() = grad_of(q, i, ps[i]);
  }
}

void run_grads(DistContext& d, const std::vector<int64_t>& buckets) {
  const int w = d.world_size();
  auto ps = make_params();
  // sum over ranks, computed from every rank's regenerated inputs in float64
  std::vector<at::Tensor> sum(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    if (i == 4) continue;
    sum[i] = at::zeros(ps[i].sizes(), at::kDouble);
    for (int q = 0; q < w; ++q) sum[i] += grad_of(q, i, ps[i]).to(at::kDouble);
  }
  struct Case {
    const char* name;
    memrt::GradReduceOptions opt;
    double scale;  // expected result = scale * sum
  };
  for (int64_t b : buckets) {
    std::vector<Case> cases;
    memrt::GradReduceOptions o;
    o.bucket_bytes = b;
    cases.push_back({"mean", o, 1.0 / w});
    for (const auto& c : cases) {
      set_grads(ps, d.rank());
      d.all_reduce_gradients(ps, c.opt);
      for (size_t i = 0; i < ps.size(); ++i) {
        std::string what = std::string(c.name) + ", bucket " + std::to_string(b) + " B, param " +
                           std::to_string(i);
        if (i == 4) {
          expect(!ps[i].grad().defined(), what + ": a missing gradient stays missing");
          continue;
        }
        expect(ps[i].grad().scalar_type() == ps[i].scalar_type(), what + ": dtype kept");
        expect_close(ps[i].grad(), sum[i] * c.scale, what, 1e-5, 1e-6);
      }
    }
    // Buffers never exceed two buckets per dtype.
    expect(d.comm_buffer_bytes() <= 2 * 2 * b, "staging buffers bounded by 2 buckets per dtype (bucket " +
                                                   std::to_string(b) + ", have " +
                                                   std::to_string(d.comm_buffer_bytes()) + ")");
  }
}

// Data parallelism is exact: the mean of per-rank shard gradients equals the full-batch gradient
// that a single process computes (a linear layer + tanh, mean squared error).
void run_dp_equiv(DistContext& d) {
  const int w = d.world_size(), r = d.rank();
  const int64_t batch = 12;  // divisible by 1, 2, 3, 4
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor x = at::normal(0.0, 1.0, {batch, 6}, gen);     // (B, 6)
  at::Tensor y = at::normal(0.0, 1.0, {batch, 3}, gen);     // (B, 3)
  at::Tensor w0 = at::normal(0.0, 0.5, {3, 6}, gen);        // (3, 6)
  at::Tensor b0 = at::normal(0.0, 0.5, {3}, gen);           // (3,)
  auto loss_grads = [&](const at::Tensor& xs, const at::Tensor& ys) {
    at::Tensor wt = w0.clone().set_requires_grad(true);
    at::Tensor bt = b0.clone().set_requires_grad(true);
    at::Tensor out = at::tanh(at::linear(xs, wt, bt));      // (b, 3)
    at::Tensor loss = (out - ys).pow(2).mean();
    loss.backward();
    return std::vector<at::Tensor>{wt, bt};
  };
  auto full = loss_grads(x, y);  // the world-size-1 result
  const int64_t shard = batch / w;
  auto mine = loss_grads(x.narrow(0, r * shard, shard), y.narrow(0, r * shard, shard));
  d.all_reduce_gradients(mine, memrt::GradReduceOptions{});
  expect_close(mine[0].grad(), full[0].grad(), "dp weight grad == full-batch grad", 1e-5, 1e-7);
  expect_close(mine[1].grad(), full[1].grad(), "dp bias grad == full-batch grad", 1e-5, 1e-7);
}

// ---- failures -------------------------------------------------------------------------------------

int run_die(DistContext& d, int victim, int rounds, bool hang) {
  at::Tensor t = at::ones({1 << 18}, at::kFloat);  // (262144,) 1 MiB
  for (int i = 0; i < 1000000; ++i) {
    if (d.rank() == victim && i == rounds) {
      std::cout << "rank " << d.rank() << (hang ? " stopping" : " killing") << " itself in round "
                << i << std::endl;
      ::raise(hang ? SIGSTOP : SIGKILL);
    }
    try {
      d.all_reduce_sum(t);
      t.fill_(1.0f);
    } catch (const memrt::DistributedError& e) {
      std::cerr << "caught DistributedError in round " << i << ": " << e.what() << std::endl;
      // A second collective must fail at once, without waiting again.
      try {
        d.barrier();
        std::cerr << "FAIL barrier after a failure succeeded" << std::endl;
      } catch (const memrt::DistributedError& e2) {
        std::cerr << "then: " << e2.what() << std::endl;
      }
      return 3;
    }
  }
  std::cerr << "FAIL no collective failed" << std::endl;
  return 1;
}

// The READY fifo handshake of "echo": the reader holds the fifo open read-write (so read()
// blocks rather than seeing end-of-file between writers) until `writers` bytes have arrived.
void wait_for_ranks(const std::string& fifo, int writers) {
  int fd = ::open(fifo.c_str(), O_RDWR);
  if (fd < 0) throw std::runtime_error("cannot open " + fifo);
  char byte;
  for (int got = 0; got < writers;) {
    ssize_t n = ::read(fd, &byte, 1);
    if (n == 1) ++got;
    else if (n < 0 && errno != EINTR) throw std::runtime_error("cannot read " + fifo);
  }
  ::close(fd);
}

void signal_ready(const std::string& fifo) {
  int fd = ::open(fifo.c_str(), O_WRONLY);  // blocks until the failing rank holds the fifo open
  if (fd < 0 || ::write(fd, "r", 1) != 1) throw std::runtime_error("cannot write " + fifo);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << "usage: dist_rank_helper MODE ...\n";
    return 2;
  }
  const std::string mode = args[0];
  try {
    if (mode == "echo") {
      const char* rank_env = std::getenv("RANK");
      int rank = rank_env ? std::atoi(rank_env) : 0;
      std::cout << "hello from rank " << rank << " of " << std::getenv("WORLD_SIZE") << " at "
                << std::getenv("MASTER_ADDR") << ":" << std::getenv("MASTER_PORT")
                << " local " << std::getenv("LOCAL_RANK") << "/" << std::getenv("LOCAL_SIZE")
                << std::endl;
      std::cerr << "a warning from rank " << rank << std::endl;
      std::cout << "second line of rank " << rank << std::endl;
      std::cout << "no newline at the end" << std::flush;
      // With a READY fifo, the failing rank exits only once every other rank has installed its
      // SIGTERM disposition (each writes one byte after doing so): no race with its start-up.
      const std::string ready = args.size() >= 5 ? args[4] : "";
      if (args.size() >= 3 && std::atoi(args[2].c_str()) == rank) {
        if (!ready.empty()) wait_for_ranks(ready, std::atoi(std::getenv("WORLD_SIZE")) - 1);
        if (args[1] == "kill") ::raise(SIGKILL);
        return std::atoi(args[1].c_str());
      }
      if (args.size() >= 4 && args[3] == "ignore_term") ::signal(SIGTERM, SIG_IGN);
      if (!ready.empty()) signal_ready(ready);
      if (args.size() >= 3 && std::atoi(args[2].c_str()) >= 0) {
        std::cout << std::endl;
        for (;;) ::pause();  // until the launcher stops us
      }
      return 0;
    }
    if (mode == "refuse") {  // pre-flight's refusal: every rank exits 2, rank 1 first (args[1]: a fifo)
      const bool first = std::string(std::getenv("RANK")) == "1";
      if (first) {
        const std::string pid = std::to_string(::getpid()) + "\n";
        int fd = ::open(args[1].c_str(), O_WRONLY);
        if (fd < 0 || ::write(fd, pid.data(), pid.size()) != static_cast<ssize_t>(pid.size())) return 1;
        ::close(fd);
        return 2;
      }
      // Rank 0 refuses once rank 1 is gone and reaped: a launcher that stopped the others on the
      // first exit would have sent its SIGTERM by then.
      std::ifstream in(args[1]);
      pid_t other = 0;
      in >> other;
      while (::kill(other, 0) == 0 || errno != ESRCH) ::sched_yield();
      std::cout << "rank 0 refused too" << std::endl;
      return 2;
    }
    if (mode == "signal_parent") {
      std::cout << "waiting" << std::endl;
      if (std::getenv("RANK") && std::string(std::getenv("RANK")) == "0") ::kill(::getppid(), SIGTERM);
      ::pause();
      return 0;
    }

    auto d = DistContext::from_environment(std::chrono::seconds(30));
    if (mode == "collectives") {
      run_collectives(*d);
    } else if (mode == "grads") {
      std::vector<int64_t> buckets;
      for (size_t i = 1; i < args.size(); ++i) buckets.push_back(std::stoll(args[i]));
      run_grads(*d, buckets);
    } else if (mode == "dp_equiv") {
      run_dp_equiv(*d);
    } else if (mode == "die") {
      return run_die(*d, std::stoi(args.at(1)), std::stoi(args.at(2)),
                     args.size() > 3 && args[3] == "hang");
    } else {
      std::cerr << "unknown mode " << mode << "\n";
      return 2;
    }
    d->barrier();
    if (g_failures > 0) return 1;
    std::cout << "OK " << mode << " rank " << d->rank() << " world " << d->world_size() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "FAIL exception: " << e.what() << std::endl;
    return 1;
  }
}
