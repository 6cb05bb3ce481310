// The store under 8 threads of random calls on a pool that runs full (tests/service/
// kv_store_stress.h), on the CUDA backend: its appends run asynchronously on several lanes, so a
// lease's layers and a decode step's append and attention meet there as they do in service.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "service/store/clock.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"
#include "service/store/namespace_config.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/service/kv_store_stress.h"

namespace kvpool::testing {
namespace {

TEST(CudaStore, ConcurrentCallsKeepThePoolAndCountersConsistent) {
  KVPOOL_SKIP_WITHOUT_GPU();
  auto backend = NewCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  NamespaceConfig c;
  c.name = "main";
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.block_tokens = 16;
  c.layer_dtypes = {KvDtype::kInt4, KvDtype::kFp8E4M3};
  FakeClock clock;
  KvStore::Options o;
  o.pool_bytes = BytesPerBlock(c) * 20;
  o.backend = backend->get();
  o.clock = &clock;
  o.quality_sample_every = 1;
  auto store = KvStore::Create(o);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->CreateNamespace(c).ok());
  for (const std::string& u : RunConcurrentCalls(**store, c, clock, 8, 250)) ADD_FAILURE() << u;
  ExpectSettled(**store, c, clock);
}

}  // namespace
}  // namespace kvpool::testing
