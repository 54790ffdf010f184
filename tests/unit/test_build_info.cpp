// The build records the LibTorch it compiled against; the library it runs with must be the same.
#include <gtest/gtest.h>
#include <torch/version.h>

#include "memrt/build_info.h"

TEST(BuildInfo, TorchVersionMatchesHeaders) {
  EXPECT_STREQ(MEMRT_TORCH_VERSION_STRING, TORCH_VERSION);
}
