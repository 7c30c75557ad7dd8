// The simulated interconnect of the distributed benchmarks (OOMLESS_DIST_LINK): one inbound link a rank, which
// the receives in flight share.
#include <gtest/gtest.h>

#include "dist/comm.h"

namespace oomless {
namespace {

TEST(DistLink, ReceivesInFlightShareTheLink) {
  dist::InboundLink link{100e-6, 1e9};  // 100 us, 1 GB/s
  // Three receives of 1 MB posted together: each waits for the ones before it (1 ms of the link apiece).
  EXPECT_DOUBLE_EQ(link.due(0.0, 1000000), 0.001 + 100e-6);
  EXPECT_DOUBLE_EQ(link.due(0.0, 1000000), 0.002 + 100e-6);
  EXPECT_DOUBLE_EQ(link.due(0.0005, 1000000), 0.003 + 100e-6);
  // Posted once the link is idle again: from its own post time.
  EXPECT_DOUBLE_EQ(link.due(0.010, 500000), 0.0105 + 100e-6);
  // A message of no bytes still pays the latency, after what is in flight.
  EXPECT_DOUBLE_EQ(link.due(0.0101, 0), 0.0105 + 100e-6);
}

}  // namespace
}  // namespace oomless
