// SIGTERM and SIGINT ask the engine to finish the step, save a checkpoint and stop (engine.h).
#include <signal.h>

#include <atomic>

#include "engine/engine.h"

namespace memrt {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void memrt_on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) {  // the second one: abort now
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = memrt_on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

int stop_signal_received() { return g_stop_signal.load(); }

}  // namespace memrt
