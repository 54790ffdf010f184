// Progress lines on a terminal (data/progress.h).
#include "data/progress.h"

#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <utility>

namespace memrt {

bool stdout_is_terminal() { return isatty(STDOUT_FILENO) != 0; }

void draw_progress(const std::string& label, int64_t done, int64_t total, const std::string& tail) {
  constexpr int64_t kWidth = 30;
  const int64_t filled = std::clamp<int64_t>(kWidth * done / std::max<int64_t>(1, total), 0, kWidth);
  std::cout << "\r" << label << "[" << std::string(static_cast<size_t>(filled), '#')
            << std::string(static_cast<size_t>(kWidth - filled), '.') << "] " << tail << std::flush;
}

ProgressCounter::ProgressCounter(std::string label, int64_t total, bool show)
    : label_(std::move(label)), total_(std::max<int64_t>(1, total)), show_(show && stdout_is_terminal()) {}

ProgressCounter::~ProgressCounter() {
  if (show_ && percent_ >= 0) std::cout << "\r\033[K" << std::flush;
}

void ProgressCounter::add(int64_t units) {
  if (!show_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  done_ += units;
  const int64_t percent = std::min<int64_t>(100, 100 * done_ / total_);
  if (percent == percent_) return;
  percent_ = percent;
  draw_progress(label_, done_, total_, std::to_string(percent) + "%");
}

}  // namespace memrt
