// dist/hostfile.cpp — DeepSpeed hostfiles, resource filters and per-rank ssh command lines.
#include "dist/hostfile.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <map>
#include <sstream>

#include "memrt/error.h"

extern char** environ;

namespace memrt {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool parse_int(const std::string& s, int& out) {
  if (s.empty()) return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    size_t p = s.find(sep, start);
    parts.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return parts;
    start = p + 1;
  }
}

// NODE_SPEC[@NODE_SPEC...] -> host -> sorted unique slots (empty: the whole host), in spec order.
std::vector<std::pair<std::string, std::vector<int>>> parse_node_specs(const std::string& spec,
                                                                       const std::string& flag) {
  std::vector<std::pair<std::string, std::vector<int>>> out;
  for (const std::string& node : split(spec, '@')) {
    std::vector<std::string> hs = split(node, ':');
    if (hs.size() > 2 || hs[0].empty()) {
      throw ConfigError(flag, "", "bad node spec '" + node +
                                      "'; expected host or host:slot[,slot...], several joined "
                                      "with '@' (e.g. worker-0@worker-1:0,2)");
    }
    std::vector<int> slots;
    if (hs.size() == 2) {
      for (const std::string& s : split(hs[1], ',')) {
        int v = -1;
        if (!parse_int(s, v) || v < 0) {
          throw ConfigError(flag, "", "bad slot '" + s + "' in node spec '" + node +
                                          "'; slots are non-negative integers such as host:0,2");
        }
        slots.push_back(v);
      }
    }
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == hs[0]; });
    if (it == out.end()) {
      out.emplace_back(hs[0], slots);
    } else {
      it->second.insert(it->second.end(), slots.begin(), slots.end());
    }
  }
  for (auto& [h, s] : out) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
  }
  return out;
}

bool needs_quoting(const std::string& s) {
  if (s.empty()) return true;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || std::string("_-./=:@%+,").find(c) != std::string::npos)) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::string shell_quote(const std::string& s) {
  if (!needs_quoting(s)) return s;
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

std::vector<HostfileEntry> parse_hostfile_text(const std::string& text, const std::string& source) {
  std::vector<HostfileEntry> hosts;
  std::istringstream in(text);
  std::string raw;
  int lineno = 0;
  while (std::getline(in, raw)) {
    ++lineno;
    std::string line = trim(raw);
    if (line.empty() || line[0] == '#') continue;
    // ^(\S+)\s+slots=(\d+)
    size_t host_end = 0;
    while (host_end < line.size() && !std::isspace(static_cast<unsigned char>(line[host_end]))) ++host_end;
    size_t p = host_end;
    while (p < line.size() && std::isspace(static_cast<unsigned char>(line[p]))) ++p;
    size_t digits = p + 6, d = digits;
    bool ok = p > host_end && line.compare(p, 6, "slots=") == 0;
    while (ok && d < line.size() && std::isdigit(static_cast<unsigned char>(line[d]))) ++d;
    int slots = 0;
    ok = ok && d > digits && parse_int(line.substr(digits, d - digits), slots);
    if (!ok) {
      throw FileError(source, "line " + std::to_string(lineno) +
                                  ": Hostfile contains a bad entry: '" + line +
                                  "', unable to proceed with launching. Each line is "
                                  "'<hostname> slots=<N>' (e.g. 'worker-0 slots=4'); '#' starts a "
                                  "comment");
    }
    std::string host = line.substr(0, host_end);
    for (const auto& h : hosts) {
      if (h.host == host) {
        throw FileError(source, "line " + std::to_string(lineno) +
                                    ": Hostfile contains multiple entries for " + host +
                                    " (first on line " + std::to_string(h.line) +
                                    "), unable to proceed with launching. List each host once "
                                    "with its total slots");
      }
    }
    if (slots < 1) {
      throw FileError(source, "line " + std::to_string(lineno) + ": host " + host +
                                  " has slots=0; give it at least one slot or remove the line");
    }
    hosts.push_back({host, slots, lineno});
  }
  if (hosts.empty()) {
    throw FileError(source, "Hostfile is empty or not formatted correctly, unable to proceed with "
                            "launching. Add one line per host: '<hostname> slots=<N>'");
  }
  return hosts;
}

std::vector<HostfileEntry> parse_hostfile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    throw FileError(path, "cannot open the hostfile; check the --hostfile path");
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_hostfile_text(ss.str(), path);
}

std::vector<NodeSlots> select_resources(const std::vector<HostfileEntry>& hosts,
                                        const std::string& include, const std::string& exclude,
                                        int num_nodes, int procs_per_node) {
  if (!include.empty() && !exclude.empty()) {
    throw ConfigError("--include", "", "--include and --exclude are mutually exclusive; use one");
  }
  if ((num_nodes > 0 || procs_per_node > 0) && (!include.empty() || !exclude.empty())) {
    throw ConfigError(include.empty() ? "--exclude" : "--include", "",
                      "cannot be combined with --num_nodes or --num_procs; select hosts and "
                      "slots either by count or by name");
  }
  std::vector<NodeSlots> nodes;
  for (const auto& h : hosts) {
    NodeSlots n{h.host, {}};
    for (int s = 0; s < h.slots; ++s) n.slots.push_back(s);
    nodes.push_back(std::move(n));
  }
  auto find = [&](const std::string& host, const std::string& flag) -> NodeSlots& {
    for (auto& n : nodes) {
      if (n.host == host) return n;
    }
    std::string known;
    for (const auto& n : nodes) known += (known.empty() ? "" : ", ") + n.host;
    throw ConfigError(flag, "", "Hostname '" + host + "' not found in hostfile (hosts: " + known + ")");
  };
  auto check_slots = [&](const NodeSlots& n, const std::vector<int>& slots, const std::string& flag) {
    for (int s : slots) {
      if (std::find(n.slots.begin(), n.slots.end(), s) == n.slots.end()) {
        throw ConfigError(flag, "", "No slot '" + std::to_string(s) + "' specified on host '" +
                                        n.host + "' (it has slots 0-" +
                                        std::to_string(n.slots.size() - 1) + ")");
      }
    }
  };
  if (!include.empty()) {
    std::map<std::string, std::vector<int>> keep;
    for (const auto& [host, slots] : parse_node_specs(include, "--include")) {
      NodeSlots& n = find(host, "--include");
      check_slots(n, slots, "--include");
      keep[host] = slots.empty() ? n.slots : slots;
    }
    std::vector<NodeSlots> out;
    for (const auto& n : nodes) {
      auto it = keep.find(n.host);
      if (it != keep.end() && !it->second.empty()) out.push_back({n.host, it->second});
    }
    nodes = std::move(out);
  } else if (!exclude.empty()) {
    for (const auto& [host, slots] : parse_node_specs(exclude, "--exclude")) {
      NodeSlots& n = find(host, "--exclude");
      check_slots(n, slots, "--exclude");
      if (slots.empty()) {
        n.slots.clear();
      } else {
        for (int s : slots) n.slots.erase(std::find(n.slots.begin(), n.slots.end(), s));
      }
    }
    nodes.erase(std::remove_if(nodes.begin(), nodes.end(), [](const NodeSlots& n) { return n.slots.empty(); }),
                nodes.end());
  }
  if (num_nodes > 0) {
    if (static_cast<size_t>(num_nodes) > nodes.size()) {
      throw ConfigError("--num_nodes", "", "asks for " + std::to_string(num_nodes) +
                                               " nodes but the hostfile lists " +
                                               std::to_string(nodes.size()));
    }
    nodes.resize(static_cast<size_t>(num_nodes));
  }
  if (procs_per_node > 0) {
    for (auto& n : nodes) {
      n.slots.clear();
      for (int s = 0; s < procs_per_node; ++s) n.slots.push_back(s);
    }
  }
  if (nodes.empty()) {
    throw ConfigError(include.empty() ? "--exclude" : "--include", "",
                      "leaves no host to run on; keep at least one slot");
  }
  return nodes;
}

std::vector<SshRankCommand> ssh_rank_commands(const std::vector<NodeSlots>& nodes,
                                              const SshLaunchOptions& opts) {
  if (nodes.empty()) throw Error("ssh launch: no hosts to run on");
  if (opts.program.empty()) throw Error("ssh launch: no program to run on the remote hosts");
  const std::string master = opts.master_addr.empty() ? nodes.front().host : opts.master_addr;
  int world = 0;
  for (const auto& n : nodes) world += static_cast<int>(n.slots.size());

  std::vector<SshRankCommand> out;
  int rank = 0;
  for (size_t node = 0; node < nodes.size(); ++node) {
    const NodeSlots& n = nodes[node];
    bool plain = true;
    for (size_t i = 0; i < n.slots.size(); ++i) plain = plain && n.slots[i] == static_cast<int>(i);
    std::string visible;
    for (int s : n.slots) visible += (visible.empty() ? "" : ",") + std::to_string(s);
    for (size_t local = 0; local < n.slots.size(); ++local, ++rank) {
      std::vector<std::pair<std::string, std::string>> env = {
          {"MASTER_ADDR", master},
          {"MASTER_PORT", std::to_string(opts.master_port)},
          {"WORLD_SIZE", std::to_string(world)},
          {"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_SIZE", std::to_string(n.slots.size())},
          {"CROSS_RANK", std::to_string(node)},
          {"CROSS_SIZE", std::to_string(nodes.size())}};
      if (!plain) env.emplace_back("CUDA_VISIBLE_DEVICES", visible);
      env.insert(env.end(), opts.env.begin(), opts.env.end());

      std::string remote;
      if (!opts.cwd.empty()) remote += "cd " + shell_quote(opts.cwd) + " && ";
      remote += "env";
      for (const auto& [k, v] : env) remote += " " + k + "=" + shell_quote(v);
      remote += " " + shell_quote(opts.program);
      for (const auto& a : opts.args) remote += " " + shell_quote(a);

      SshRankCommand c;
      c.host = n.host;
      c.node_rank = static_cast<int>(node);
      c.local_rank = static_cast<int>(local);
      c.remote_command = remote;
      c.command.rank = rank;
      c.command.argv.push_back("ssh");
      c.command.argv.insert(c.command.argv.end(), opts.ssh_args.begin(), opts.ssh_args.end());
      c.command.argv.push_back(n.host);
      c.command.argv.push_back(remote);
      for (const auto& a : c.command.argv) {
        c.shell_line += (c.shell_line.empty() ? "" : " ") + shell_quote(a);
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> exported_environment() {
  std::vector<std::pair<std::string, std::string>> out;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string k = kv.substr(0, eq);
    if (k.rfind("MEMRT_", 0) == 0 || k.rfind("NCCL_", 0) == 0 || k == "OMP_NUM_THREADS" ||
        k == "GLOO_SOCKET_IFNAME") {
      out.emplace_back(k, kv.substr(eq + 1));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace memrt
