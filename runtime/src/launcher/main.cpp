// launcher — memrt's command line: parse, build, run, close.
//
//   launcher --deepspeed ds_config.json train.yaml [--key=value ...]      train
//   launcher --num_procs N --deepspeed ds_config.json train.yaml          N local ranks
//   launcher --print-config --deepspeed ds_config.json train.yaml         resolved config, exit
//   launcher --estimate [--num_procs N] --deepspeed ds_config.json train.yaml   memory plan, exit
//   launcher ... --resume | --resume=TAG                                  continue from a checkpoint
//   launcher eval --deepspeed ds_config.json train.yaml [--eval_file=F] [--resume[=TAG]]
//                                                                         eval_file's loss, eval.json
//   launcher export CHECKPOINT DIR [--merge] [--dtype D] [--model_name_or_path BASE]  HF directory
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <boost/program_options.hpp>
#include <c10/util/Exception.h>

#include "config/load_config.h"
#include "dist/hostfile.h"
#include "dist/local_launch.h"
#include "dist/process_group.h"
#include "engine/engine.h"
#include "engine/preflight.h"
#include "memrt/safetensors.h"
#include "memory/report.h"
#include "memory/tracking_allocator.h"
#include "memrt/build_info.h"
#include "plugin/plugin_host.h"

namespace po = boost::program_options;

namespace {

struct Args {
  std::string ds_config;
  std::string train_yaml;
  std::vector<std::string> overrides;
  int num_procs = 1;
  std::string hostfile;
  std::string include, exclude;
  int num_nodes = -1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool print_config = false;
  bool estimate = false;
  std::optional<std::string> resume;  // --resume ("": newest) or --resume=TAG
  bool trace_hooks = false;
  bool eval = false;  // `launcher eval ...`
};

const char* kUsage =
    "usage: launcher [eval] [options] --deepspeed DS_CONFIG.json TRAIN.yaml [--key=value | --key value ...]\n"
    "       launcher export CHECKPOINT DIR [--merge] [--dtype fp32|bf16|fp16] [--model_name_or_path BASE]\n"
    "\n"
    "Trains the model TRAIN.yaml describes with the strategy DS_CONFIG.json describes. Words after\n"
    "TRAIN.yaml override its keys (e.g. --max_steps=20). `launcher eval` trains nothing: it prints the\n"
    "mean next-token loss of the model as configured (add --resume for the newest checkpoint of\n"
    "output_dir) on eval_file (--eval_file=F) and writes output_dir/eval.json.\n";

// Options of the launcher itself that take a value; needed to find where TRAIN.yaml is.
bool takes_value(const std::string& word) {
  for (const char* o : {"--deepspeed", "--deepspeed_config", "--num_procs", "--num_gpus",
                        "--hostfile", "--include", "--exclude", "--num_nodes", "--master_addr",
                        "--master_port"}) {
    if (word == o) return true;
  }
  return false;
}

// Returns false when the program should exit right away (help, version).
bool parse_args(int argc, char** argv, Args& args) {
  // Everything up to the first bare word (TRAIN.yaml) is the launcher's; everything after it
  // overrides train.yaml keys and is parsed by the config loader.
  std::vector<std::string> own;
  // --resume[=TAG] may stand anywhere (users append it to the training command).
  std::vector<char*> rest{argv[0]};
  for (int k = 1; k < argc; ++k) {
    const std::string w = argv[k];
    if (w == "--resume") {
      args.resume = "";
    } else if (w.rfind("--resume=", 0) == 0) {
      args.resume = w.substr(9);
      if (args.resume->empty()) throw memrt::Error("--resume= needs a tag, e.g. --resume=global_step40");
    } else {
      rest.push_back(argv[k]);
    }
  }
  argc = static_cast<int>(rest.size());
  argv = rest.data();
  int i = 1;
  for (; i < argc; ++i) {
    std::string w = argv[i];
    if (w.rfind("-", 0) != 0) {
      args.train_yaml = w;
      ++i;
      break;
    }
    own.push_back(w);
    if (takes_value(w) && i + 1 < argc) own.push_back(argv[++i]);
  }
  for (; i < argc; ++i) args.overrides.emplace_back(argv[i]);

  po::options_description desc("options");
  desc.add_options()
      ("help,h", "print this help")
      ("version", "print versions")
      ("deepspeed", po::value(&args.ds_config), "the DeepSpeed-style config (JSON)")
      ("deepspeed_config", po::value(&args.ds_config), "alias of --deepspeed")
      ("num_procs", po::value(&args.num_procs), "ranks to start on this machine")
      ("num_gpus", po::value(&args.num_procs), "alias of --num_procs (DeepSpeed's name)")
      ("hostfile", po::value(&args.hostfile), "DeepSpeed hostfile: one 'host slots=N' per line; ranks start over ssh")
      ("include", po::value(&args.include), "hostfile hosts/slots to use: host[:slot,...][@host...]")
      ("exclude", po::value(&args.exclude), "hostfile hosts/slots to leave out (same syntax)")
      ("num_nodes", po::value(&args.num_nodes), "use the first N hosts of the hostfile")
      ("master_addr", po::value(&args.master_addr), "rendezvous address (default 127.0.0.1)")
      ("master_port", po::value(&args.master_port), "rendezvous port (default 29500)")
      ("print-config", po::bool_switch(&args.print_config), "print the resolved configuration and exit")
      ("estimate", po::bool_switch(&args.estimate), "print the memory plan per rank for 1..num_procs ranks, write output_dir/memory_estimate.json, check it against this host's limits and --memory_budget (exit code 2, with the changes that fit, when it does not), and exit")
      ("trace-hooks", po::bool_switch(&args.trace_hooks), "print every plugin hook call");
  po::variables_map vm;
  po::store(po::command_line_parser(own).options(desc).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << desc;
    return false;
  }
  if (vm.count("version")) {
    std::cout << "memrt " << MEMRT_VERSION_STRING << " (LibTorch " << MEMRT_TORCH_VERSION_STRING
              << ", CUDA " << (MEMRT_TORCH_HAS_CUDA ? "on" : "off") << ", plugin ABI "
              << MEMRT_PLUGIN_ABI_MAJOR << "." << MEMRT_PLUGIN_ABI_MINOR << ")\n";
    return false;
  }
  if (args.ds_config.empty() || args.train_yaml.empty()) {
    throw memrt::Error(std::string("missing ") +
                       (args.ds_config.empty() ? "--deepspeed DS_CONFIG.json" : "TRAIN.yaml") +
                       "\n" + kUsage);
  }
  if (args.num_procs < 1) throw memrt::Error("--num_procs must be at least 1");
  return true;
}

// Options that decide how ranks are spawned; a rank's own command line goes without them.
const char* const kSpawnOptions[] = {"--num_procs", "--num_gpus", "--hostfile", "--include",
                                     "--exclude", "--num_nodes", "--master_addr", "--master_port"};

// The command line a rank runs: this one without the options that spawn ranks.
std::vector<std::string> worker_args(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string w = argv[i];
    if (w.rfind("-", 0) != 0) {  // TRAIN.yaml: the rest belongs to the rank as it is
      out.insert(out.end(), argv + i, argv + argc);
      break;
    }
    bool spawn_option = false;
    for (const char* o : kSpawnOptions) {
      const std::string opt(o);
      if (w == opt) {
        ++i;  // and its value
        spawn_option = true;
      } else if (w.rfind(opt + "=", 0) == 0) {
        spawn_option = true;
      }
    }
    if (!spawn_option) {
      out.push_back(w);
      if (takes_value(w) && i + 1 < argc) out.push_back(argv[++i]);
    }
  }
  return out;
}

// --estimate: the memory plan from shapes alone, for world sizes 1..num_procs; nothing trained.
int estimate(const Args& args) {
  memrt::ConfigSources sources;
  sources.ds_config_path = args.ds_config;
  sources.train_yaml_path = args.train_yaml;
  sources.overrides = args.overrides;
  sources.world_size = args.num_procs;
  const memrt::TrainConfig cfg = memrt::load_train_config(sources);
  memrt::PluginHost plugins = memrt::PluginHost::load(cfg.plugins);
  memrt::ConfigDiagnostics diag;
  plugins.configure(memrt::make_run_info(cfg, 0, args.num_procs, 0), diag);

  std::vector<std::vector<memrt::EstimateReport>> by_world_size;
  for (int w = 1; w <= args.num_procs; ++w) {
    std::vector<memrt::EstimateReport> ranks;
    for (int r = 0; r < w; ++r) {
      memrt::RunInfo run = memrt::make_run_info(cfg, r, w, r);
      run.train_batch_size = cfg.micro_batch_size * cfg.grad_accum_steps * w;  // micro-batch fixed
      ranks.push_back(memrt::estimate_memory(cfg, run, plugins));
    }
    by_world_size.push_back(std::move(ranks));
  }
  const memrt::RunInfo run = memrt::make_run_info(cfg, 0, args.num_procs, 0);
  std::cout << "memory estimate for " << args.ds_config << " + " << args.train_yaml << ": "
            << run.shape.arch << ", " << run.shape.n_layer << " blocks, micro-batch "
            << cfg.micro_batch_size << " x " << run.block_size << " tokens, accumulation "
            << cfg.grad_accum_steps << "\n"
            << plugins.describe() << memrt::estimate_table_text(by_world_size);
  for (const std::string& w : diag.warnings) std::cout << "warning: " << w << "\n";
  const std::filesystem::path path = std::filesystem::path(cfg.output_dir) / "memory_estimate.json";
  std::filesystem::create_directories(cfg.output_dir);
  memrt::write_file_atomic(path.string(), memrt::memory_estimate_json(by_world_size));
  std::cout << "written: " << path.string() << "\n";

  // Pre-flight for num_procs ranks on this host (docs/preflight.md), each holding at set-up what
  // this process holds now (LibTorch and the plugins loaded; a run adds its data): the advisor's
  // changes when it would not fit. Exit code 2 then, as the run's refusal.
  memrt::HostMemory host;
  host.world_size = args.num_procs;
  int64_t growth = 0;
  for (int r = 0; r < args.num_procs; ++r) {
    host.ranks.push_back(r);
    growth += memrt::host_growth(by_world_size.back()[static_cast<size_t>(r)].table, run.device);
  }
  host.resident = memrt::current_rss_bytes() * args.num_procs;
  host.limits = memrt::host_limits(cfg.memory_budget);
  const memrt::Verdict v = memrt::judge(host, growth, memrt::device_need(by_world_size.back().front().table, run.device),
                                        by_world_size.back().front().table, 0, cfg.sources);
  if (v.fits) {
    std::cout << v.line << "\n";
    return 0;
  }
  std::cout << "memory pre-flight: this run would not fit in memory: " << v.line << "\n" << v.advice << "\n";
  return 2;
}

int run(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "export") {
    memrt::memory::install_tracking_allocator();  // the export's peak, reported below
    bool merge = false, usage = argc < 4;
    std::string dtype = "fp32", base;
    for (int i = 4; i < argc && !usage; ++i) {
      const std::string a = argv[i];
      if (a == "--merge") {
        merge = true;
      } else if (a == "--dtype" && i + 1 < argc) {
        dtype = argv[++i];
      } else if (a.rfind("--dtype=", 0) == 0) {
        dtype = a.substr(8);
      } else if (a == "--model_name_or_path" && i + 1 < argc) {
        base = argv[++i];
      } else if (a.rfind("--model_name_or_path=", 0) == 0) {
        base = a.substr(21);
      } else {
        usage = true;
      }
    }
    if (usage) {
      throw memrt::Error("usage: launcher export CHECKPOINT DIR [--merge] [--dtype fp32|bf16|fp16] [--model_name_or_path "
                         "BASE]\n  CHECKPOINT: a global_step* folder, or an output_dir (its newest checkpoint); DIR: "
                         "the Hugging Face directory to write; --merge: LoRA adapters folded into their base weights "
                         "(PEFT's merge_and_unload); --dtype: the dtype of the written weights (default fp32); "
                         "--model_name_or_path: where the base model a checkpoint leaves its frozen parameters in "
                         "is now (default: where its run read it)");
    }
    std::cout << memrt::export_checkpoint(argv[2], argv[3], merge, dtype, base) << "\n";
    // What converting the model held at once, beyond the mapped checkpoint files it reads.
    std::cout << "export held at most " << memrt::memory::allocator_stats().peak_bytes
              << " bytes allocated at once (peak)\n";
    return 0;
  }
  // `launcher eval ...` is the training command line with one word in front: drop it here (ranks get
  // it back in front of their own command line).
  const bool eval = argc >= 2 && std::string(argv[1]) == "eval";
  std::vector<char*> shifted(argv, argv + argc);
  if (eval) shifted.erase(shifted.begin() + 1);
  argc = static_cast<int>(shifted.size());
  argv = shifted.data();
  Args args;
  args.eval = eval;
  if (!parse_args(argc, argv, args)) return 0;
  auto rank_args = [&] {
    std::vector<std::string> out = worker_args(argc, argv);
    if (eval) out.insert(out.begin(), "eval");
    return out;
  };

  if (!args.hostfile.empty()) {  // several machines: one ssh per rank, DeepSpeed's rank order
    auto hosts = memrt::parse_hostfile(args.hostfile);
    auto nodes = memrt::select_resources(hosts, args.include, args.exclude, args.num_nodes,
                                         args.num_procs > 1 ? args.num_procs : -1);
    memrt::SshLaunchOptions ssh;
    if (args.master_addr != "127.0.0.1") ssh.master_addr = args.master_addr;
    ssh.master_port = args.master_port;
    ssh.cwd = std::filesystem::current_path().string();
    ssh.program = std::filesystem::read_symlink("/proc/self/exe").string();
    ssh.args = rank_args();
    ssh.env = memrt::exported_environment();
    std::vector<memrt::RankCommand> commands;
    for (const auto& c : memrt::ssh_rank_commands(nodes, ssh)) {
      std::cout << "[launcher] " << c.shell_line << "\n";
      commands.push_back(c.command);
    }
    std::cout << std::flush;
    return memrt::run_rank_processes(commands);
  }
  if (args.estimate) {
    if (args.eval) throw memrt::Error("launcher eval and --estimate do not go together: --estimate plans training");
    return estimate(args);
  }
  if (args.num_procs > 1 && std::getenv("RANK") == nullptr) {
    memrt::LocalLaunchOptions opts;
    opts.num_procs = args.num_procs;
    opts.executable = "/proc/self/exe";
    opts.args = rank_args();
    opts.master_addr = args.master_addr;
    opts.master_port = args.master_port;
    return memrt::run_local_ranks(opts);
  }

  // A rank not started by run_local_ranks (one process, or one of a hostfile's) picks its threads
  // the same way: the usable cores shared by the ranks of this host, never more than LibTorch's
  // own choice (which leaves SMT siblings out).
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const char* local_size = std::getenv("LOCAL_SIZE");
    const int ranks = std::max(1, local_size ? std::atoi(local_size) : 1);
    const memrt::ThreadPlan plan = memrt::plan_threads(ranks, memrt::usable_cores(), nullptr);
    if (plan.threads < at::get_num_threads()) at::set_num_threads(plan.threads);
  }
  auto dist = memrt::DistContext::from_environment();
  memrt::ConfigSources sources;
  sources.ds_config_path = args.ds_config;
  sources.train_yaml_path = args.train_yaml;
  sources.overrides = args.overrides;
  sources.world_size = dist->world_size();
  memrt::TrainConfig cfg = memrt::load_train_config(sources);
  memrt::PluginHost plugins = memrt::PluginHost::load(cfg.plugins);
  if (args.print_config) {  // valid only if every plugin accepts its options too
    memrt::ConfigDiagnostics diag;
    plugins.configure(
        memrt::make_run_info(cfg, dist->rank(), dist->world_size(), dist->local_rank()), diag);
    if (dist->rank() == 0) {  // the JSON's warnings: the loader's, then the plugins' notes
      cfg.warnings.insert(cfg.warnings.end(), diag.warnings.begin(), diag.warnings.end());
      std::cout << memrt::resolved_config_json(cfg) << "\n" << plugins.describe() << std::flush;
    }
    return 0;
  }
  if (args.trace_hooks) plugins.set_trace(true);
  memrt::Engine engine(std::move(cfg), dist, std::move(plugins), std::cout);
  if (args.resume) engine.resume_from(*args.resume);
  if (args.eval) {
    engine.evaluate_only();
    return 0;
  }
  memrt::install_stop_signal_handlers();
  engine.train();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  memrt::memory::install_tracking_allocator();  // before LibTorch allocates anything
  try {
    return run(argc, argv);
  } catch (const po::error& e) {
    std::cerr << "error: " << e.what() << "\n" << kUsage;
  } catch (const memrt::PreflightError& e) {  // refused before allocating: the caller may retry changed
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  } catch (const memrt::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
  } catch (const c10::Error& e) {
    std::cerr << "error (LibTorch): " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
  }
  return 1;
}
