// The tracking allocator behind memrt/memory.h: LibTorch's CPU allocator, counted per cell.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include "memrt/memory.h"

namespace memrt::memory {

// Installs the tracker as LibTorch's CPU allocator (idempotent). Allocations made before stay with
// the allocator that made them and are not counted. Never uninstalled: blocks it handed out may
// outlive everything else.
void install_tracking_allocator();

struct AllocatorStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;
  int64_t frees = 0;
  Table at_peak;  // the cells at the instant live bytes last reached peak_bytes
  // With MEMRT_PEAK_BACKTRACE set (to anything but 0): the size and C++ call stack of the
  // allocation that set the peak (c10::get_backtrace, taken each time the peak rises); else empty.
  int64_t peak_allocation_bytes = 0;
  std::string peak_backtrace;
};
AllocatorStats allocator_stats();

// A window of interest (a micro-step, a step): the largest value each cell, and the total, reached
// since the window was opened. Opening a new window starts from the live values.
struct WindowPeaks {
  int64_t total = 0;
  Table cells;
};
void open_window();
WindowPeaks window_peaks();

// The CUDA caching allocator's own figures for one device (a CUDA device; none otherwise):
// allocated bytes now and at their peak. Device tensors are attributed to cells by the same
// claims; these figures are the allocator total they reconcile with.
struct DeviceAllocatorStats {
  bool available = false;
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};
DeviceAllocatorStats device_allocator_stats(const c10::Device& device);

// Forgets the peak (peak := live now). Tests and per-phase measurements use it.
void reset_peak();

}  // namespace memrt::memory
