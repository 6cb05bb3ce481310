// Random K/V/q generators for tests and benchmarks: N(0,1) data with outlier channels, the
// shapes real KV caches show (never zeros). Header-only; used by CPU, GPU and service tests.
#ifndef KVPOOL_TESTS_COMMON_KV_TEST_DATA_H_
#define KVPOOL_TESTS_COMMON_KV_TEST_DATA_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/fp16.h"

namespace kvpool::testing {

enum class Outliers {
  kNone,      // plain N(0,1)
  kOffset,    // K[:, c] += 12 * (random sign)
  kRope,      // K[:, c] += 12 cos(t theta_c), K[:, c + D/2] += 12 sin(t theta_c)
  kVariance,  // K[:, c] *= 10
  kSpikes,    // 8 random tokens get K[t, c] += 60
};

inline const char* OutliersName(Outliers o) {
  switch (o) {
    case Outliers::kNone: return "none";
    case Outliers::kOffset: return "offset";
    case Outliers::kRope: return "rope";
    case Outliers::kVariance: return "variance";
    case Outliers::kSpikes: return "spikes";
  }
  return "?";
}

// K and V of one sequence, [tokens][heads][head_dim] fp32. Every head gets three outlier
// channels c among the first head_dim/2 (the same for all heads); in every outlier case V's
// first two of those channels are scaled by 5.
struct KvData {
  std::vector<float> k, v;
};

inline KvData MakeKv(int tokens, int heads, int head_dim, Outliers kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  KvData d;
  const size_t n = static_cast<size_t>(tokens) * heads * head_dim;
  d.k.resize(n);
  d.v.resize(n);
  for (auto& x : d.k) x = normal(rng);
  for (auto& x : d.v) x = normal(rng);
  if (kind == Outliers::kNone) return d;
  std::uniform_int_distribution<int> pick(0, head_dim / 2 - 1);
  int ch[3];
  for (int i = 0; i < 3; ++i) {
    bool again;
    do {
      ch[i] = pick(rng);
      again = false;
      for (int j = 0; j < i; ++j) again |= ch[j] == ch[i];
    } while (again);
  }
  std::vector<int> spike_tokens;
  std::uniform_int_distribution<int> pick_t(0, tokens - 1);
  for (int i = 0; i < 8; ++i) spike_tokens.push_back(pick_t(rng));
  float sign[3];
  for (float& s : sign) s = (rng() & 1) ? 1.f : -1.f;
  auto at = [&](std::vector<float>& x, int t, int h, int c) -> float& {
    return x[(static_cast<size_t>(t) * heads + h) * head_dim + c];
  };
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < 3; ++i) {
      const int c = ch[i];
      const double theta = std::pow(10000.0, -2.0 * c / head_dim);
      for (int t = 0; t < tokens; ++t) {
        switch (kind) {
          case Outliers::kOffset: at(d.k, t, h, c) += 12.f * sign[i]; break;
          case Outliers::kRope:
            at(d.k, t, h, c) += static_cast<float>(12.0 * std::cos(t * theta));
            at(d.k, t, h, c + head_dim / 2) += static_cast<float>(12.0 * std::sin(t * theta));
            break;
          case Outliers::kVariance: at(d.k, t, h, c) *= 10.f; break;
          default: break;
        }
        if (i < 2) at(d.v, t, h, c) *= 5.f;
      }
      if (kind == Outliers::kSpikes) {
        for (int t : spike_tokens) at(d.k, t, h, c) += 60.f;
      }
    }
  }
  return d;
}

// n values drawn N(0,1) (queries).
inline std::vector<float> MakeNormal(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

inline std::vector<uint16_t> ToHalf(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = FloatToHalf(x[i]);
  return h;
}

inline std::vector<float> FromHalf(const std::vector<uint16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = HalfToFloat(h[i]);
  return x;
}

}  // namespace kvpool::testing

#endif  // KVPOOL_TESTS_COMMON_KV_TEST_DATA_H_
