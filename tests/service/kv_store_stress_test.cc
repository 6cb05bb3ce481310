// The store under 8 threads of random calls on a pool that runs full (kv_store_stress.h), on the
// CPU backend, without and with sink tokens. Built with sanitizers, this is also the store's race
// and lifetime test.
#include "tests/service/kv_store_stress.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/service/kv_store_test_util.h"

namespace kvpool::testing {
namespace {

TEST_F(StoreTest, ConcurrentCallsKeepThePoolAndCountersConsistent) {
  MakeStore(20);
  for (const std::string& u : RunConcurrentCalls(*store_, config_, clock_, 8, 250)) {
    ADD_FAILURE() << u;
  }
  ExpectSettled(*store_, config_, clock_);
}

// The same with sink tokens and 5 blocks with a sink page among the 20: every new sequence's first
// block must find one (the kernels refuse any other), evicting for it.
TEST_F(StoreTest, ConcurrentCallsWithSinksKeepThePoolAndCountersConsistent) {
  MakeStore(20, /*sink_tokens=*/2, /*blocks_per_sink_page=*/4);
  for (const std::string& u : RunConcurrentCalls(*store_, config_, clock_, 8, 250)) {
    ADD_FAILURE() << u;
  }
  ExpectSettled(*store_, config_, clock_);
  EXPECT_GT(store_->Stats().namespaces[0].evictions, 0u);
}

}  // namespace
}  // namespace kvpool::testing
