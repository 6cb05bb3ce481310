// The store under 8 threads of random calls on a pool that runs full (kv_store_stress.h), on the
// CPU backend. Built with sanitizers, this is also the store's race and lifetime test.
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

}  // namespace
}  // namespace kvpool::testing
