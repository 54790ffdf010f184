// The SDK's Communicator over the host's process group (or a single process when there is none).
#pragma once

#include <memory>

#include "memrt/comm.h"

namespace memrt {

class DistContext;

// `dist` may be null: then rank 0 of 1 and every collective is a no-op.
std::unique_ptr<Communicator> make_communicator(std::shared_ptr<DistContext> dist);

}  // namespace memrt
