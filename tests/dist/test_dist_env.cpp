// Rendezvous environment: which variables are read, the errors for missing or malformed ones,
// single-process contexts, and bounded rendezvous failures.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>

#include "dist/local_launch.h"
#include "dist/process_group.h"
#include "dist_test_util.h"
#include "memrt/error.h"

namespace memrt {
namespace {

using test::contains;
using test::dist_variables;
using test::EnvGuard;

// The error message of read_dist_environment() under the current environment ("" if none).
std::string env_error() {
  try {
    read_dist_environment();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(DistEnv, NoVariablesIsOneProcess) {
  EnvGuard g(dist_variables());
  DistEnvironment e = read_dist_environment();
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.source, "none");
}

TEST(DistEnv, TorchrunVariables) {
  EnvGuard g(dist_variables());
  g.set("RANK", "3");
  g.set("WORLD_SIZE", "8");
  g.set("LOCAL_RANK", "1");
  g.set("MASTER_ADDR", "node-0");
  g.set("MASTER_PORT", "29501");
  // torchrun's names win over the MPI and Slurm ones.
  g.set("OMPI_COMM_WORLD_RANK", "5");
  g.set("SLURM_PROCID", "6");
  DistEnvironment e = read_dist_environment();
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node-0");
  EXPECT_EQ(e.master_port, 29501);
  EXPECT_EQ(e.source, "torchrun");
}

TEST(DistEnv, OpenMpiVariables) {
  EnvGuard g(dist_variables());
  g.set("OMPI_COMM_WORLD_RANK", "2");
  g.set("OMPI_COMM_WORLD_SIZE", "4");
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  g.set("MASTER_ADDR", "10.0.0.1");
  g.set("MASTER_PORT", "29500");
  g.set("SLURM_PROCID", "9");
  DistEnvironment e = read_dist_environment();
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.source, "Open MPI");
}

TEST(DistEnv, SlurmVariables) {
  EnvGuard g(dist_variables());
  g.set("SLURM_PROCID", "5");
  g.set("SLURM_NTASKS", "6");
  g.set("SLURM_LOCALID", "2");
  g.set("MASTER_ADDR", "gpu-17");
  g.set("MASTER_PORT", " 29400 ");  // blanks around a number are tolerated
  DistEnvironment e = read_dist_environment();
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 6);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_EQ(e.source, "Slurm");
}

TEST(DistEnv, WorldSizeOneNeedsNoRendezvous) {
  EnvGuard g(dist_variables());
  g.set("RANK", "0");
  g.set("WORLD_SIZE", "1");
  DistEnvironment e = read_dist_environment();
  EXPECT_EQ(e.world_size, 1);
  EXPECT_TRUE(e.master_addr.empty());
  auto ctx = DistContext::from_environment(std::chrono::seconds(1));
  EXPECT_EQ(ctx->world_size(), 1);
  EXPECT_TRUE(ctx->is_main());
}

TEST(DistEnv, MissingWorldSize) {
  EnvGuard g(dist_variables());
  g.set("RANK", "1");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "environment: 'WORLD_SIZE'")) << msg;
  EXPECT_TRUE(contains(msg, "is not set")) << msg;
  EXPECT_TRUE(contains(msg, "torchrun")) << msg;
  EXPECT_TRUE(contains(msg, "launcher --num_procs")) << msg;
}

TEST(DistEnv, MissingRank) {
  EnvGuard g(dist_variables());
  g.set("WORLD_SIZE", "2");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'RANK'")) << msg;
  EXPECT_TRUE(contains(msg, "is not set")) << msg;
}

TEST(DistEnv, MalformedRank) {
  EnvGuard g(dist_variables());
  g.set("RANK", "one");
  g.set("WORLD_SIZE", "2");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'RANK'")) << msg;
  EXPECT_TRUE(contains(msg, "'one' is not a non-negative integer")) << msg;
  EXPECT_TRUE(contains(msg, "torchrun")) << msg;

  g.set("RANK", "-1");
  EXPECT_TRUE(contains(env_error(), "'-1' is not a non-negative integer"));
  g.set("RANK", "1x");
  EXPECT_TRUE(contains(env_error(), "'1x' is not a non-negative integer"));
  g.set("RANK", "");
  EXPECT_TRUE(contains(env_error(), "'' is not a non-negative integer"));
}

TEST(DistEnv, RankOutOfRange) {
  EnvGuard g(dist_variables());
  g.set("RANK", "2");
  g.set("WORLD_SIZE", "2");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'RANK'")) << msg;
  EXPECT_TRUE(contains(msg, "ranks run from 0 to 1")) << msg;
  g.set("WORLD_SIZE", "0");
  g.set("RANK", "0");
  EXPECT_TRUE(contains(env_error(), "must be at least 1")) << env_error();
}

TEST(DistEnv, MissingLocalRank) {
  EnvGuard g(dist_variables());
  g.set("RANK", "1");
  g.set("WORLD_SIZE", "2");
  g.set("MASTER_ADDR", "127.0.0.1");
  g.set("MASTER_PORT", "29500");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'LOCAL_RANK'")) << msg;
  EXPECT_TRUE(contains(msg, "is not set")) << msg;
  EXPECT_TRUE(contains(msg, "WORLD_SIZE is 2")) << msg;
}

TEST(DistEnv, MissingMpiLocalRankNamesMpirun) {
  EnvGuard g(dist_variables());
  g.set("OMPI_COMM_WORLD_RANK", "0");
  g.set("OMPI_COMM_WORLD_SIZE", "2");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'OMPI_COMM_WORLD_LOCAL_RANK'")) << msg;
  EXPECT_TRUE(contains(msg, "mpirun (Open MPI)")) << msg;
}

TEST(DistEnv, MalformedSlurmVariable) {
  EnvGuard g(dist_variables());
  g.set("SLURM_PROCID", "0");
  g.set("SLURM_NTASKS", "4(x2)");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'SLURM_NTASKS'")) << msg;
  EXPECT_TRUE(contains(msg, "srun (Slurm)")) << msg;
}

TEST(DistEnv, MissingMasterAddrAndPort) {
  EnvGuard g(dist_variables());
  g.set("RANK", "0");
  g.set("WORLD_SIZE", "2");
  g.set("LOCAL_RANK", "0");
  std::string msg = env_error();
  EXPECT_TRUE(contains(msg, "'MASTER_ADDR'")) << msg;
  EXPECT_TRUE(contains(msg, "is not set")) << msg;
  EXPECT_TRUE(contains(msg, "scontrol show hostnames")) << msg;  // how to set it under Slurm

  g.set("MASTER_ADDR", "127.0.0.1");
  msg = env_error();
  EXPECT_TRUE(contains(msg, "'MASTER_PORT'")) << msg;
  EXPECT_TRUE(contains(msg, "is not set")) << msg;

  g.set("MASTER_PORT", "70000");
  msg = env_error();
  EXPECT_TRUE(contains(msg, "'MASTER_PORT'")) << msg;
  EXPECT_TRUE(contains(msg, "between 1 and 65535")) << msg;

  g.set("MASTER_PORT", "http");
  EXPECT_TRUE(contains(env_error(), "'http' is not a non-negative integer")) << env_error();
}

TEST(DistEnv, LocalRankAboveRank) {
  EnvGuard g(dist_variables());
  g.set("RANK", "0");
  g.set("WORLD_SIZE", "2");
  g.set("LOCAL_RANK", "1");
  g.set("MASTER_ADDR", "127.0.0.1");
  g.set("MASTER_PORT", "29500");
  EXPECT_TRUE(contains(env_error(), "'LOCAL_RANK'")) << env_error();
}

TEST(DistEnv, MalformedTimeoutOverride) {
  EnvGuard g(dist_variables());
  g.set("MEMRT_DIST_TIMEOUT", "soon");
  try {
    DistContext::from_environment();
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "'MEMRT_DIST_TIMEOUT'")) << e.what();
  }
}

// One process: collectives are the identity and gradients are left exactly as they are.
TEST(DistContextSingle, CollectivesAreIdentity) {
  EnvGuard g(dist_variables());
  auto d = DistContext::from_environment();
  ASSERT_EQ(d->world_size(), 1);
  at::Tensor t = at::arange(10, at::kFloat);  // (10,)
  at::Tensor want = t.clone();
  d->all_reduce_sum(t);
  d->all_reduce_max(t);
  d->broadcast(t, 0);
  d->barrier();
  EXPECT_TRUE(at::equal(t, want));
  at::Tensor gathered = at::empty({10}, at::kFloat);  // (10,)
  d->all_gather(gathered, t);
  EXPECT_TRUE(at::equal(gathered, want));
  EXPECT_THROW(d->broadcast(t, 1), DistributedError);

  at::Tensor p = at::zeros({4, 5}, at::kFloat).set_requires_grad(true);  // (4, 5)
  at::Tensor q = at::zeros({3}, at::kFloat).set_requires_grad(true);     // (3,) no grad
  p.mutable_grad() = at::randn({4, 5});
  at::Tensor before = p.grad().clone();
  d->all_reduce_gradients({p, q}, GradReduceOptions());  // the mean over one rank: unchanged
  EXPECT_TRUE(at::equal(p.grad(), before));
  EXPECT_FALSE(q.grad().defined());
  EXPECT_EQ(d->comm_buffer_bytes(), 0);
}

// A rank whose peers never come fails within the timeout with a message naming the store.
TEST(DistRendezvous, PeerNeverArrives) {
  EnvGuard g(dist_variables());
  for (int rank : {0, 1}) {
    DistEnvironment env;
    env.rank = rank;
    env.world_size = 2;
    env.master_addr = "127.0.0.1";
    env.master_port = pick_free_port("127.0.0.1");
    env.source = "test";
    auto t0 = std::chrono::steady_clock::now();
    try {
      DistContext::create(env, std::chrono::seconds(2));
      FAIL() << "rendezvous of rank " << rank << " alone succeeded";
    } catch (const DistributedError& e) {
      std::string msg = e.what();
      EXPECT_TRUE(contains(msg, "rank " + std::to_string(rank) + " of 2")) << msg;
      EXPECT_TRUE(contains(msg, "rendezvous at MASTER_ADDR:MASTER_PORT = 127.0.0.1:" +
                                    std::to_string(env.master_port)))
          << msg;
      EXPECT_TRUE(contains(msg, "within 2 s")) << msg;
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "rank " << rank << " alone gave up after " << s << " s (timeout 2 s)\n";
    EXPECT_LT(s, 20.0);
  }
}

// Rank 0 cannot host the store when the port is taken: a prompt error saying so.
TEST(DistRendezvous, PortInUse) {
  EnvGuard g(dist_variables());
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  DistEnvironment env;
  env.rank = 0;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = ntohs(a.sin_port);
  try {
    DistContext::create(env, std::chrono::seconds(5));
    ADD_FAILURE() << "rank 0 hosted a store on a port in use";
  } catch (const DistributedError& e) {
    EXPECT_TRUE(contains(e.what(), "Rank 0 hosts the store there: is the port free")) << e.what();
    EXPECT_TRUE(contains(e.what(), "c10d said:")) << e.what();
  }
  ::close(fd);
}

#ifdef MEMRT_NCCL_LIBRARY
// NCCL's backend stands in a library of its own, which a CUDA rank opens (libmemrt links only
// LibTorch's CPU libraries): it loads, with LibTorch's CUDA libraries, and exports the factory.
TEST(DistNccl, BackendLibraryLoadsAndExportsItsFactory) {
  void* lib = dlopen(MEMRT_NCCL_LIBRARY, RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  EXPECT_NE(dlsym(lib, "memrt_nccl_backend"), nullptr) << dlerror();
}
#endif

}  // namespace
}  // namespace memrt
