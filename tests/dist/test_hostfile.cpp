// DeepSpeed hostfiles, --include/--exclude, and the per-rank ssh command lines (built, not run:
// test_collectives runs them through a local shell).
#include <gtest/gtest.h>

#include <fstream>

#include "dist/hostfile.h"
#include "dist_test_util.h"
#include "memrt/error.h"

namespace memrt {
namespace {

using test::contains;

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

TEST(DistHostfile, ParsesHostsCommentsAndBlanks) {
  auto hosts = parse_hostfile_text(
      "# two machines\n"
      "\n"
      "worker-0 slots=4\n"
      "   worker-1\tslots=2   max_slots=8\n"  // DeepSpeed ignores what follows the slots
      "  # indented comment\n"
      "10.0.0.7 slots=16",  // no final newline
      "hostfile");
  ASSERT_EQ(hosts.size(), 3u);
  EXPECT_EQ(hosts[0].host, "worker-0");
  EXPECT_EQ(hosts[0].slots, 4);
  EXPECT_EQ(hosts[0].line, 3);
  EXPECT_EQ(hosts[1].host, "worker-1");
  EXPECT_EQ(hosts[1].slots, 2);
  EXPECT_EQ(hosts[2].host, "10.0.0.7");
  EXPECT_EQ(hosts[2].slots, 16);
  EXPECT_EQ(hosts[2].line, 6);
}

TEST(DistHostfile, BadEntryNamesFileAndLine) {
  for (const char* bad : {"worker-1 slot=4", "worker-1", "worker-1 slots=", "worker-1 slots=four",
                          "slots=4", "worker-1 gpus=4"}) {
    std::string text = std::string("worker-0 slots=4\n") + bad + "\n";
    std::string msg = error_of<FileError>([&] { parse_hostfile_text(text, "my_hostfile"); });
    EXPECT_TRUE(contains(msg, "my_hostfile: line 2: Hostfile contains a bad entry: '")) << bad << ": " << msg;
    EXPECT_TRUE(contains(msg, "unable to proceed with launching")) << msg;
    EXPECT_TRUE(contains(msg, "'<hostname> slots=<N>'")) << msg;
  }
}

TEST(DistHostfile, DuplicateHost) {
  std::string msg = error_of<FileError>(
      [] { parse_hostfile_text("a slots=2\nb slots=2\na slots=4\n", "hf"); });
  EXPECT_TRUE(contains(msg, "hf: line 3: Hostfile contains multiple entries for a (first on line 1)")) << msg;
}

TEST(DistHostfile, EmptyFile) {
  for (const char* text : {"", "\n\n", "# only a comment\n"}) {
    std::string msg = error_of<FileError>([&] { parse_hostfile_text(text, "hf"); });
    EXPECT_TRUE(contains(msg, "hf: Hostfile is empty or not formatted correctly")) << msg;
  }
}

TEST(DistHostfile, ZeroSlots) {
  std::string msg = error_of<FileError>([] { parse_hostfile_text("a slots=0\n", "hf"); });
  EXPECT_TRUE(contains(msg, "line 1: host a has slots=0")) << msg;
}

TEST(DistHostfile, ReadsFileAndReportsMissingOne) {
  std::string path = ::testing::TempDir() + "memrt_hostfile_test";
  {
    std::ofstream f(path);
    f << "node-a slots=1\nnode-b slots=3\n";
  }
  auto hosts = parse_hostfile(path);
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[1].slots, 3);
  std::remove(path.c_str());
  std::string msg = error_of<FileError>([&] { parse_hostfile(path); });
  EXPECT_TRUE(contains(msg, path + ": cannot open the hostfile")) << msg;
}

std::vector<HostfileEntry> three_hosts() {
  return parse_hostfile_text("a slots=4\nb slots=4\nc slots=2\n", "hf");
}

std::string show(const std::vector<NodeSlots>& nodes) {
  std::string s;
  for (const auto& n : nodes) {
    s += n.host + ":";
    for (size_t i = 0; i < n.slots.size(); ++i) s += (i ? "," : "") + std::to_string(n.slots[i]);
    s += " ";
  }
  return s;
}

TEST(DistResourceFilter, AllByDefault) {
  EXPECT_EQ(show(select_resources(three_hosts())), "a:0,1,2,3 b:0,1,2,3 c:0,1 ");
}

TEST(DistResourceFilter, IncludeKeepsHostfileOrder) {
  // DeepSpeed's example: all of one host, some slots of another; order stays the hostfile's.
  EXPECT_EQ(show(select_resources(three_hosts(), "b@a:0,2")), "a:0,2 b:0,1,2,3 ");
  EXPECT_EQ(show(select_resources(three_hosts(), "c:1@c:0")), "c:0,1 ");
}

TEST(DistResourceFilter, Exclude) {
  EXPECT_EQ(show(select_resources(three_hosts(), "", "a:1@c")), "a:0,2,3 b:0,1,2,3 ");
}

TEST(DistResourceFilter, CountsNodesAndProcs) {
  EXPECT_EQ(show(select_resources(three_hosts(), "", "", 2)), "a:0,1,2,3 b:0,1,2,3 ");
  EXPECT_EQ(show(select_resources(three_hosts(), "", "", -1, 1)), "a:0 b:0 c:0 ");
}

TEST(DistResourceFilter, Errors) {
  auto hosts = three_hosts();
  std::string msg = error_of<ConfigError>([&] { select_resources(hosts, "a", "b"); });
  EXPECT_TRUE(contains(msg, "mutually exclusive")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "d"); });
  EXPECT_TRUE(contains(msg, "--include: Hostname 'd' not found in hostfile (hosts: a, b, c)")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "", "c:5"); });
  EXPECT_TRUE(contains(msg, "--exclude: No slot '5' specified on host 'c'")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "a:x"); });
  EXPECT_TRUE(contains(msg, "bad slot 'x'")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "a:0:1"); });
  EXPECT_TRUE(contains(msg, "bad node spec 'a:0:1'")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "", "a@b@c"); });
  EXPECT_TRUE(contains(msg, "leaves no host to run on")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "a", "", 2); });
  EXPECT_TRUE(contains(msg, "cannot be combined with --num_nodes")) << msg;
  msg = error_of<ConfigError>([&] { select_resources(hosts, "", "", 4); });
  EXPECT_TRUE(contains(msg, "asks for 4 nodes but the hostfile lists 3")) << msg;
}

TEST(DistSshCommands, RanksNodeByNodeSlotBySlot) {
  std::vector<NodeSlots> nodes = {{"a", {0, 1}}, {"b", {0, 1, 2}}};
  SshLaunchOptions o;
  o.master_port = 29511;
  o.cwd = "/home/u/run dir";
  o.program = "/opt/memrt/bin/launcher";
  o.args = {"--deepspeed", "ds.json", "train.yaml", "--max_steps=20", "--run_name", "it's"};
  o.env = {{"MEMRT_DIST_TIMEOUT", "120"}};
  auto cmds = ssh_rank_commands(nodes, o);
  ASSERT_EQ(cmds.size(), 5u);
  const char* hosts[] = {"a", "a", "b", "b", "b"};
  const int locals[] = {0, 1, 0, 1, 2};
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(cmds[r].command.rank, r);
    EXPECT_EQ(cmds[r].host, hosts[r]);
    EXPECT_EQ(cmds[r].local_rank, locals[r]);
    EXPECT_EQ(cmds[r].node_rank, r < 2 ? 0 : 1);
  }
  // Written out by hand from DeepSpeed's rank assignment and POSIX quoting.
  EXPECT_EQ(cmds[3].remote_command,
            "cd '/home/u/run dir' && env MASTER_ADDR=a MASTER_PORT=29511 WORLD_SIZE=5 RANK=3 "
            "LOCAL_RANK=1 LOCAL_SIZE=3 CROSS_RANK=1 CROSS_SIZE=2 MEMRT_DIST_TIMEOUT=120 "
            "/opt/memrt/bin/launcher --deepspeed ds.json train.yaml --max_steps=20 --run_name "
            "'it'\\''s'");
  EXPECT_EQ(cmds[3].command.argv, (std::vector<std::string>{"ssh", "b", cmds[3].remote_command}));
  EXPECT_TRUE(cmds[3].command.env.empty());
  EXPECT_EQ(cmds[0].shell_line.substr(0, 34), "ssh a 'cd '\\''/home/u/run dir'\\'' ");
}

TEST(DistSshCommands, MasterAddrSshArgsAndSlotSubsets) {
  auto nodes = select_resources(three_hosts(), "b:1,3@c");
  SshLaunchOptions o;
  o.master_addr = "10.1.2.3";
  o.program = "launcher";
  o.ssh_args = {"-p", "2222"};
  auto cmds = ssh_rank_commands(nodes, o);
  ASSERT_EQ(cmds.size(), 4u);
  EXPECT_EQ(cmds[1].command.argv[0], "ssh");
  EXPECT_EQ(cmds[1].command.argv[1], "-p");
  EXPECT_EQ(cmds[1].command.argv[2], "2222");
  EXPECT_EQ(cmds[1].command.argv[3], "b");
  // b runs slots 1 and 3: its ranks see those devices; c's slots are plain 0..1.
  EXPECT_EQ(cmds[1].remote_command,
            "env MASTER_ADDR=10.1.2.3 MASTER_PORT=29500 WORLD_SIZE=4 RANK=1 LOCAL_RANK=1 "
            "LOCAL_SIZE=2 CROSS_RANK=0 CROSS_SIZE=2 CUDA_VISIBLE_DEVICES=1,3 launcher");
  EXPECT_EQ(cmds[2].remote_command,
            "env MASTER_ADDR=10.1.2.3 MASTER_PORT=29500 WORLD_SIZE=4 RANK=2 LOCAL_RANK=0 "
            "LOCAL_SIZE=2 CROSS_RANK=1 CROSS_SIZE=2 launcher");
}

TEST(DistShellQuote, Cases) {
  EXPECT_EQ(shell_quote("plain-arg_1.json"), "plain-arg_1.json");
  EXPECT_EQ(shell_quote("--key=value"), "--key=value");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("$HOME"), "'$HOME'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
}

}  // namespace
}  // namespace memrt
