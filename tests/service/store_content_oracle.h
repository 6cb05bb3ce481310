// The content oracle of tests/service/kv_store_content_stress_test.cc: every token's K/V is a
// fixed function of the hash of its id prefix, so that whatever a lease reads has exactly one
// right value, computed here with the CPU kernels (quantized, or exact for sink positions).
#ifndef KVPOOL_TESTS_SERVICE_STORE_CONTENT_ORACLE_H_
#define KVPOOL_TESTS_SERVICE_STORE_CONTENT_ORACLE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp16.h"
#include "kernels/kv_kernels.h"
#include "kernels/page_layout.h"
#include "service/store/namespace_config.h"

namespace kvpool::testing {

inline uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline std::vector<uint64_t> PrefixHashes(const std::vector<int32_t>& ids) {
  std::vector<uint64_t> h(ids.size());
  uint64_t x = 0x1234;
  for (size_t i = 0; i < ids.size(); ++i) h[i] = x = Mix(x ^ (static_cast<uint64_t>(ids[i]) + 77));
  return h;
}

class Oracle {
 public:
  explicit Oracle(const NamespaceConfig& c) : c_(c), pt_(size_t(c.num_kv_heads) * c.head_dim) {}
  size_t pt() const { return pt_; }
  // Input fp16 row (K and V) of the token whose prefix hash is h.
  void Input(uint64_t h, int layer, uint16_t* k, uint16_t* v) const {
    std::mt19937_64 g(Mix(h * 31 + layer));
    std::normal_distribution<float> n(0.f, 1.f);
    for (size_t i = 0; i < pt_; ++i) k[i] = FloatToHalf(n(g));
    for (size_t i = 0; i < pt_; ++i) v[i] = FloatToHalf(n(g));
  }
  // Input rows of n tokens, K and V each [n][pt()], token i's prefix hash hashes[i].
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> InputRows(const uint64_t* hashes,
                                                                    size_t n, int layer) const {
    std::vector<uint16_t> k(n * pt_), v(n * pt_);
    for (size_t i = 0; i < n; ++i) Input(hashes[i], layer, k.data() + i * pt_, v.data() + i * pt_);
    return {std::move(k), std::move(v)};
  }
  // How a read row (K and V, pt() values each) of the token whose prefix hash is h differs from
  // Expected: "" when it does not, else "zeros" or the relative L2 error of its K.
  std::string RowDifference(uint64_t h, int layer, bool sink_exact, const uint16_t* k,
                            const uint16_t* v) const {
    std::vector<uint16_t> ek(pt_), ev(pt_);
    Expected(h, layer, sink_exact, ek.data(), ev.data());
    if (std::equal(ek.begin(), ek.end(), k) && std::equal(ev.begin(), ev.end(), v)) return "";
    auto zero = [](uint16_t x) { return x == 0; };
    if (std::all_of(k, k + pt_, zero) && std::all_of(v, v + pt_, zero)) return "zeros";
    double err = 0, norm = 0;
    for (size_t i = 0; i < pt_; ++i) {
      const double d = HalfToFloat(k[i]) - HalfToFloat(ek[i]);
      err += d * d;
      norm += double(HalfToFloat(ek[i])) * HalfToFloat(ek[i]);
    }
    return "other data, K rel err " + std::to_string(std::sqrt(err / norm));
  }
  // The first of `rows` rows read from a sequence's start (K and V, [rows][pt()] each) that
  // differs from the oracle's, as "row R: <its difference>"; "" when none does. Rows from
  // `written` on may also be zeros. hash(row) is the row's token's prefix hash.
  template <typename Hash>
  std::string ReadDifference(const uint16_t* k, const uint16_t* v, uint32_t rows, uint32_t written,
                             int layer, Hash&& hash) const {
    for (uint32_t row = 0; row < rows; ++row) {
      const std::string d = RowDifference(hash(row), layer, static_cast<int>(row) < c_.sink_tokens,
                                          k + row * pt_, v + row * pt_);
      if (!d.empty() && (row < written || d != "zeros"))
        return "row " + std::to_string(row) + ": " + d;
    }
    return "";
  }
  // What a read returns for it: quantized, or exact for a sink position read from block 0.
  void Expected(uint64_t h, int layer, bool sink_exact, uint16_t* k, uint16_t* v) const {
    std::vector<uint16_t> ik(pt_), iv(pt_);
    Input(h, layer, ik.data(), iv.data());
    if (sink_exact) {
      std::copy(ik.begin(), ik.end(), k);
      std::copy(iv.begin(), iv.end(), v);
      return;
    }
    const PageLayout l = LayerLayout(c_, layer);
    std::vector<uint8_t> page(l.layer_page_bytes());
    std::vector<uint8_t> sink(std::max<size_t>(1, l.sink_page_bytes()));
    int64_t slot = 0;
    int32_t pos = 1 << 20;
    QuantizeAppendParams p;
    p.layout = l;
    p.k = ik.data();
    p.v = iv.data();
    p.slot_mapping = &slot;
    p.positions = &pos;
    p.num_tokens = 1;
    p.pages = page.data();
    p.sink_pages = l.sink_tokens > 0 ? sink.data() : nullptr;
    p.num_blocks = 1;
    p.num_sink_blocks = l.sink_tokens > 0 ? 1 : 0;
    EXPECT_EQ(cpu::QuantizeAppend(p), KernelStatus::kOk);
    std::vector<uint16_t> ko(size_t(c_.block_tokens) * pt_), vo(ko.size());
    int32_t id = 0;
    DequantizeParams d;
    d.layout = l;
    d.pages = page.data();
    d.block_ids = &id;
    d.num_out_blocks = 1;
    d.head_begin = 0;
    d.head_end = c_.num_kv_heads;
    d.k_out = ko.data();
    d.v_out = vo.data();
    d.num_blocks = 1;
    EXPECT_EQ(cpu::Dequantize(d), KernelStatus::kOk);
    std::copy(ko.begin(), ko.begin() + pt_, k);
    std::copy(vo.begin(), vo.begin() + pt_, v);
  }

  // The largest |out - ref| over one item's output [heads][head_dim] (one query head per KV
  // head), ref the fp64 attention of q over the rows Expected gives for tokens [0, len), token t's
  // prefix hash hash(t) (sink positions exact).
  template <typename Hash>
  double AttentionError(const uint16_t* q, const float* out, int layer, uint32_t len,
                        Hash&& hash) const {
    const int hd = c_.head_dim;
    const int heads = c_.num_kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    std::vector<uint16_t> ek(pt_), ev(pt_);
    std::vector<std::vector<double>> sc(heads, std::vector<double>(len));
    std::vector<std::vector<double>> vs(len, std::vector<double>(pt_));
    for (uint32_t t = 0; t < len; ++t) {
      Expected(hash(t), layer, static_cast<int>(t) < c_.sink_tokens, ek.data(), ev.data());
      for (int h = 0; h < heads; ++h) {
        double dot = 0;
        for (int c = 0; c < hd; ++c) {
          dot += static_cast<double>(HalfToFloat(q[h * hd + c])) * HalfToFloat(ek[h * hd + c]);
        }
        sc[h][t] = dot * scale;
      }
      for (size_t c = 0; c < pt_; ++c) vs[t][c] = HalfToFloat(ev[c]);
    }
    double worst = 0;
    for (int h = 0; h < heads; ++h) {
      const double mx = *std::max_element(sc[h].begin(), sc[h].end());
      double sum = 0;
      std::vector<double> acc(hd, 0.0);
      for (uint32_t t = 0; t < len; ++t) {
        const double p = std::exp(sc[h][t] - mx);
        sum += p;
        for (int c = 0; c < hd; ++c) acc[c] += p * vs[t][h * hd + c];
      }
      for (int c = 0; c < hd; ++c)
        worst = std::max(worst, std::abs(acc[c] / sum - out[h * hd + c]));
    }
    return worst;
  }

 private:
  const NamespaceConfig c_;
  const size_t pt_;
};

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_SERVICE_STORE_CONTENT_ORACLE_H_
