// Rank 0's progress on a terminal: one line redrawn in place, "\r<label>[#####.....] <tail>", which
// the next log line clears ("\r\033[K"). Nothing is drawn when stdout is not a terminal (a pipe, a
// file, a rank under the local launcher), so logs and tests read the same lines as before.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace memrt {

bool stdout_is_terminal();

// Draws the line once: `done` of `total` as a 30-character bar, then `tail`.
void draw_progress(const std::string& label, int64_t done, int64_t total, const std::string& tail);

// Work shared by threads, drawn as a percentage: each add() of finished units redraws the line
// when the whole percentage moves; the destructor clears it. Thread-safe.
class ProgressCounter {
 public:
  ProgressCounter(std::string label, int64_t total, bool show);
  ~ProgressCounter();
  ProgressCounter(const ProgressCounter&) = delete;
  ProgressCounter& operator=(const ProgressCounter&) = delete;
  void add(int64_t units);

 private:
  std::string label_;
  int64_t total_;
  bool show_;
  std::mutex mutex_;
  int64_t done_ = 0;
  int64_t percent_ = -1;  // the one drawn last
};

}  // namespace memrt
