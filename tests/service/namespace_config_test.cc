#include "service/store/namespace_config.h"

#include <cstdio>

#include "gtest/gtest.h"
#include "service/store/compute_backend.h"
#include "service/store/kv_store.h"

namespace kvpool {
namespace {

TEST(NamespaceConfig, DefaultInt4StoresAtLeast3Point7TimesFewerBytesPerTokenThanFp16) {
  const NamespaceConfig int4 = DefaultNamespaceConfig(uint64_t{1} << 30);
  ASSERT_TRUE(ValidateNamespaceConfig(int4).ok());
  NamespaceConfig fp16 = int4;
  fp16.layer_dtypes.assign(fp16.num_layers, KvDtype::kFp16);
  ASSERT_TRUE(ValidateNamespaceConfig(fp16).ok());

  // 32 layers x 2 (K, V) x 8 heads x (64 B codes + 4 B scale/zero) per token.
  EXPECT_DOUBLE_EQ(BytesPerToken(int4), 32.0 * 2 * 8 * 68);
  EXPECT_DOUBLE_EQ(Fp16BytesPerToken(int4), 32.0 * 2 * 8 * 256);
  EXPECT_DOUBLE_EQ(BytesPerToken(fp16), Fp16BytesPerToken(int4));
  const double ratio = Fp16BytesPerToken(int4) / BytesPerToken(int4);
  std::printf("default namespace: %.0f B/token INT4, %.0f B/token fp16, %.3fx fewer\n",
              BytesPerToken(int4), Fp16BytesPerToken(int4), ratio);
  EXPECT_GE(ratio, 3.7);
}

TEST(NamespaceConfig, SamePoolHoldsAtLeast3Point7TimesMoreInt4TokensThanFp16) {
  std::unique_ptr<ComputeBackend> backend = NewCpuBackend();
  KvStore::Options options;
  options.pool_bytes = uint64_t{256} << 20;
  options.backend = backend.get();
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Create(options);
  ASSERT_TRUE(store.ok()) << store.status();
  NamespaceConfig int4 = DefaultNamespaceConfig(uint64_t{128} << 20);
  int4.name = "int4";
  NamespaceConfig fp16 = int4;
  fp16.name = "fp16";
  fp16.layer_dtypes.assign(fp16.num_layers, KvDtype::kFp16);
  absl::StatusOr<NamespaceInfo> a = (*store)->CreateNamespace(int4);
  absl::StatusOr<NamespaceInfo> b = (*store)->CreateNamespace(fp16);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const double tokens_int4 = static_cast<double>(a->num_blocks) * int4.block_tokens;
  const double tokens_fp16 = static_cast<double>(b->num_blocks) * fp16.block_tokens;
  std::printf("128 MiB holds %.0f INT4 tokens vs %.0f fp16 tokens\n", tokens_int4, tokens_fp16);
  EXPECT_GE(tokens_int4 / tokens_fp16, 3.7);
}

}  // namespace
}  // namespace kvpool
