// CPU reference of PagedDecodeAttention, for sequence s, query head h, KV head
// g = h / (num_q_heads / num_kv_heads), n = seq_lens[s], n_sink = min(sink_tokens, n):
//
//   q' = BlockHadamard forward of q (double) when layout.rotated(), else q.
//   Paged segment, tokens t in [n_sink, n), codes and {s_j, z_j} of group j of K's page row:
//     score_t = sm_scale * sum_j (s_j * sum_{c in j} q'_c code_c + z_j * sum_{c in j} q'_c)
//     (double; FP8 codes are the decoded e4m3 values with z = 0; FP16: the plain dot q . k).
//     m_p = max score, l_p = sum exp(score - m_p), acc_p = sum_t exp(score_t - m_p) * v'_t with
//     v'_t = s * code + z per channel (double) in the rotated space; acc_p is un-rotated once.
//   Sink segment, tokens t < n_sink, from the fp16 sink page of the first block (original
//     space): score_t = sm_scale * q . k_t, (m_s, l_s, acc_s) likewise with v_t.
//   The two partial states merge by log-sum-exp: m = max(m_s, m_p),
//     l = l_s e^(m_s - m) + l_p e^(m_p - m), out = (acc_s e^(m_s - m) + acc_p e^(m_p - m)) / l,
//     lse = m + log(l). An empty segment has m = -inf, l = 0 and weighs nothing.
//
// The CUDA kernel follows this structure (split-K partials merged the same way).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "kernels/cpu/page_codec.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/kv_kernels.h"

namespace kvpool::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

KernelStatus Validate(const PagedDecodeAttentionParams& p) {
  const PageLayout& l = p.layout;
  if (ValidatePageLayout(l) != nullptr || p.num_seqs < 0 || p.num_blocks < 0 ||
      p.num_q_heads <= 0 || p.num_q_heads % l.num_kv_heads != 0 ||
      !AttentionTableSpanOk(l, p.max_blocks_per_seq)) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.num_seqs == 0) return KernelStatus::kOk;
  if (p.pages == nullptr || p.q == nullptr || p.block_tables == nullptr || p.seq_lens == nullptr ||
      (p.out == nullptr) == (p.out_fp16 == nullptr) ||
      (l.sink_tokens > 0 && p.sink_pages == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const BadAttentionSequence bad =
      FindBadAttentionSequence(l, p.seq_lens, p.block_tables, p.num_seqs, p.max_blocks_per_seq,
                               p.num_blocks, p.num_sink_blocks);
  return bad.seq < 0 ? KernelStatus::kOk : KernelStatus::kInvalidArgument;
}

// Partial softmax state of one query head over one segment of tokens.
struct Partial {
  double max = kNegInf;
  double sum = 0.0;
  double* acc = nullptr;  // [head_dim], original space once the segment is finished
};

// Exponentiates `scores` [n] against their max, fills `state` (acc = sum p_t v_t is left to the
// caller) and leaves p_t = exp(score_t - max) in `scores`.
void Normalize(double* scores, int n, Partial* state) {
  for (int t = 0; t < n; ++t) state->max = std::max(state->max, scores[t]);
  for (int t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - state->max);
    state->sum += scores[t];
  }
}

// The doubles one call keeps per pass of query heads (scores, queries, accumulators): 32 MiB.
constexpr int64_t kScoreBudget = int64_t{1} << 22;

// Reusable buffers of one call, sized once for its largest sequence and `heads` query heads at a
// time.
struct Scratch {
  Scratch(const PageLayout& l, int heads, int max_len, int num_groups)
      : q(static_cast<size_t>(heads) * l.head_dim),
        q_rot(static_cast<size_t>(heads) * l.head_dim),
        q_sum(static_cast<size_t>(heads) * num_groups),
        scores(static_cast<size_t>(heads) * max_len),
        acc_sink(static_cast<size_t>(heads) * l.head_dim),
        acc_paged(static_cast<size_t>(heads) * l.head_dim),
        codes(l.head_dim),
        row(l.head_dim),
        meta(num_groups),
        sink(heads),
        paged(heads) {}
  std::vector<double> q;          // [heads][head_dim] original space
  std::vector<double> q_rot;      // [heads][head_dim] rotated space
  std::vector<double> q_sum;      // [heads][num_groups] sum of q' over each group
  std::vector<double> scores;     // [heads][max_len]
  std::vector<double> acc_sink;   // [heads][head_dim]
  std::vector<double> acc_paged;  // [heads][head_dim]
  std::vector<float> codes;       // [head_dim] one page row's code values
  std::vector<double> row;        // [head_dim] one token's K or V
  std::vector<GroupMeta> meta;    // [num_groups] one page row's {scale, zero}
  std::vector<Partial> sink;      // [heads] sink segment states
  std::vector<Partial> paged;     // [heads] paged segment states
};

// Code values and {scale, zero} of page row `token`; FP16 rows read as one group {1, 0}.
void LoadRow(const PageLayout& l, const uint8_t* head_page, int token, Scratch* w) {
  UnpackCodes(l, head_page, token, w->codes.data());
  if (!l.quantized()) {
    w->meta[0] = GroupMeta{1.0f, 0.0f};
    return;
  }
  for (int j = 0; j < l.groups(); ++j) w->meta[j] = ReadGroupMeta(l, head_page, token, j);
}

}  // namespace

KernelStatus PagedDecodeAttention(const PagedDecodeAttentionParams& p) {
  const KernelStatus status = Validate(p);
  if (status != KernelStatus::kOk || p.num_seqs == 0) return status;
  const PageLayout& l = p.layout;
  const int dim = l.head_dim;
  const int ratio = p.num_q_heads / l.num_kv_heads;
  const int num_groups = l.quantized() ? l.groups() : 1;
  const int group_size = dim / num_groups;
  const double sm_scale = p.sm_scale;
  std::optional<BlockHadamard> rotation;
  if (l.rotated()) rotation.emplace(dim, l.rot_block, l.sign_seed);
  const int max_len = *std::max_element(p.seq_lens, p.seq_lens + p.num_seqs);
  // A group's query heads are scored `heads` at a time, so that what a pass keeps per head (its
  // scores over max_len tokens, four head_dim rows and its group sums) stays within kScoreBudget
  // doubles whatever the ratio and lengths.
  const int64_t per_head = int64_t{max_len} + 4 * int64_t{dim} + num_groups;
  const int heads = static_cast<int>(std::clamp<int64_t>(kScoreBudget / per_head, 1, ratio));
  Scratch w(l, heads, max_len, num_groups);

  for (int s = 0; s < p.num_seqs; ++s) {
    const int len = p.seq_lens[s];
    const int n_sink = std::min(l.sink_tokens, len);
    const int n_paged = len - n_sink;
    const int32_t* table = p.block_tables + static_cast<size_t>(s) * p.max_blocks_per_seq;
    for (int g = 0; g < l.num_kv_heads; ++g) {
      for (int r0 = 0; r0 < ratio; r0 += heads) {
        const int nr = std::min(heads, ratio - r0);  // query heads g * ratio + r0 + [0, nr)
        // Queries of the group, original and rotated, and the per-group sums of q'.
        for (int r = 0; r < nr; ++r) {
          const uint16_t* q_src =
              p.q + (static_cast<size_t>(s) * p.num_q_heads + g * ratio + r0 + r) * dim;
          double* q = &w.q[static_cast<size_t>(r) * dim];
          double* q_rot = &w.q_rot[static_cast<size_t>(r) * dim];
          for (int c = 0; c < dim; ++c) q[c] = q_rot[c] = HalfToFloat(q_src[c]);
          if (rotation) rotation->Forward(q_rot);
          for (int j = 0; j < num_groups; ++j) {
            double sum = 0.0;
            for (int c = j * group_size; c < (j + 1) * group_size; ++c) sum += q_rot[c];
            w.q_sum[static_cast<size_t>(r) * num_groups + j] = sum;
          }
        }
        std::fill(w.acc_sink.begin(), w.acc_sink.end(), 0.0);
        std::fill(w.acc_paged.begin(), w.acc_paged.end(), 0.0);
        std::vector<Partial>& sink = w.sink;
        std::vector<Partial>& paged = w.paged;

        // Sink segment: fp16 K/V of the first block's sink page, original space.
        const uint8_t* sink_page =
            n_sink > 0 ? p.sink_pages + static_cast<size_t>(table[0]) * l.sink_page_bytes()
                       : nullptr;
        auto load_sink_row = [&](int kv, int t) {
          const uint8_t* src = sink_page + l.sink_offset(kv, g, t);
          for (int c = 0; c < dim; ++c) {
            uint16_t h;
            std::memcpy(&h, src + 2 * c, sizeof(h));
            w.row[c] = HalfToFloat(h);
          }
        };
        for (int t = 0; t < n_sink; ++t) {
          load_sink_row(0, t);
          for (int r = 0; r < nr; ++r) {
            const double* q = &w.q[static_cast<size_t>(r) * dim];
            double dot = 0.0;
            for (int c = 0; c < dim; ++c) dot += q[c] * w.row[c];
            w.scores[static_cast<size_t>(r) * max_len + t] = sm_scale * dot;
          }
        }
        for (int r = 0; r < nr; ++r) {
          sink[r] = Partial{kNegInf, 0.0, &w.acc_sink[static_cast<size_t>(r) * dim]};
          Normalize(&w.scores[static_cast<size_t>(r) * max_len], n_sink, &sink[r]);
        }
        for (int t = 0; t < n_sink; ++t) {
          load_sink_row(1, t);
          for (int r = 0; r < nr; ++r) {
            const double pt = w.scores[static_cast<size_t>(r) * max_len + t];
            for (int c = 0; c < dim; ++c) sink[r].acc[c] += pt * w.row[c];
          }
        }

        // Paged segment: scores on the codes in the rotated space.
        for (int i = 0; i < n_paged; ++i) {
          const int t = n_sink + i;
          LoadRow(l, HeadPage(l, p.pages, table[t / l.block_tokens], 0, g), t % l.block_tokens, &w);
          for (int r = 0; r < nr; ++r) {
            const double* q_rot = &w.q_rot[static_cast<size_t>(r) * dim];
            const double* q_sum = &w.q_sum[static_cast<size_t>(r) * num_groups];
            double score = 0.0;
            for (int j = 0; j < num_groups; ++j) {
              double dot = 0.0;
              for (int c = j * group_size; c < (j + 1) * group_size; ++c)
                dot += q_rot[c] * w.codes[c];
              score += static_cast<double>(w.meta[j].scale) * dot +
                       static_cast<double>(w.meta[j].zero) * q_sum[j];
            }
            w.scores[static_cast<size_t>(r) * max_len + i] = sm_scale * score;
          }
        }
        for (int r = 0; r < nr; ++r) {
          paged[r] = Partial{kNegInf, 0.0, &w.acc_paged[static_cast<size_t>(r) * dim]};
          Normalize(&w.scores[static_cast<size_t>(r) * max_len], n_paged, &paged[r]);
        }
        for (int i = 0; i < n_paged; ++i) {
          const int t = n_sink + i;
          LoadRow(l, HeadPage(l, p.pages, table[t / l.block_tokens], 1, g), t % l.block_tokens, &w);
          for (int j = 0; j < num_groups; ++j) {
            const double scale = w.meta[j].scale;
            const double zero = w.meta[j].zero;
            for (int c = j * group_size; c < (j + 1) * group_size; ++c) {
              w.row[c] = scale * w.codes[c] + zero;
            }
          }
          for (int r = 0; r < nr; ++r) {
            const double pt = w.scores[static_cast<size_t>(r) * max_len + i];
            for (int c = 0; c < dim; ++c) paged[r].acc[c] += pt * w.row[c];
          }
        }

        // Un-rotate the paged accumulators once and merge the two segments.
        for (int r = 0; r < nr; ++r) {
          if (rotation && n_paged > 0) rotation->Inverse(paged[r].acc);
          const double m = std::max(sink[r].max, paged[r].max);
          const double w_sink = std::exp(sink[r].max - m);
          const double w_paged = std::exp(paged[r].max - m);
          const double sum = sink[r].sum * w_sink + paged[r].sum * w_paged;
          const size_t out_row = static_cast<size_t>(s) * p.num_q_heads + g * ratio + r0 + r;
          for (int c = 0; c < dim; ++c) {
            const float o =
                static_cast<float>((sink[r].acc[c] * w_sink + paged[r].acc[c] * w_paged) / sum);
            if (p.out != nullptr) {
              p.out[out_row * dim + c] = o;
            } else {
              p.out_fp16[out_row * dim + c] = FloatToHalf(o);
            }
          }
          if (p.lse != nullptr) p.lse[out_row] = static_cast<float>(m + std::log(sum));
        }
      }
    }
  }
  return KernelStatus::kOk;
}

}  // namespace kvpool::cpu
