// A prototype, not on the serving path: decode attention that reads the paged KV cache in place
// (no gather), for issue 16's question "how much of the decode step would a kernel save?".
// Built and measured by tools/paged_attention/bench.py against the engine's gather + decode_attend.
//
// q [B, H, D]; one layer of the cache [num_blocks, 2, block_size, KVH, D] (K then V per block, as
// engine/kv_cache.py lays it out); block tables [B, max_blocks] int64; ctx [B] (tokens in context)
// and start [B] (first position attended: 0, or p - window + 1) -> [B, H, D].
// Per (sequence, KV head): each block's K is transposed into a [D][block_size] tile so the scores
// of the block's tokens for one query head are block_size-wide vertical FMAs (no horizontal sums);
// softmax over the whole context in float32; then V is accumulated token by token.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>
#include <algorithm>

template <typename T, int D, int BS>
static void run(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables, const at::Tensor& ctx,
                const at::Tensor& start, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t KVH = layer.size(3), G = H / KVH, NBT = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* cache = layer.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* sp = start.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = KVH * D, half = BS * row, blk = 2 * half;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores, qf(G * D), acc(G * D);
    alignas(64) float kt[D][BS];
    for (int64_t bg = lo; bg < hi; ++bg) {
      const int64_t b = bg / KVH, g = bg % KVH;
      const int64_t n0 = sp[b], n1 = cp[b];
      const int64_t nb0 = n0 / BS, nb1 = (n1 + BS - 1) / BS, span = (nb1 - nb0) * BS;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qp[(b * H + g * G) * D + i]) * sc;
      scores.assign(std::max<int64_t>(span, 1) * G, -INFINITY);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const T* kb = cache + tp[b * NBT + nb] * blk + g * D;
        for (int t = 0; t < BS; ++t)
          for (int d = 0; d < D; ++d) kt[d][t] = static_cast<float>(kb[t * row + d]);
        const int64_t off = (nb - nb0) * BS;
        for (int64_t h = 0; h < G; ++h) {
          alignas(64) float s[BS] = {0.f};
          const float* qh = qf.data() + h * D;
          for (int d = 0; d < D; ++d) {
            const float qd = qh[d];
#pragma omp simd
            for (int t = 0; t < BS; ++t) s[t] += qd * kt[d][t];
          }
          float* dst = scores.data() + h * span + off;
          for (int t = 0; t < BS; ++t) {
            const int64_t pos = nb * BS + t;
            dst[t] = (pos >= n0 && pos < n1) ? s[t] : -INFINITY;
          }
        }
      }
      std::vector<float> sum(G);
      for (int64_t h = 0; h < G; ++h) {
        float* sh = scores.data() + h * span;
        float m = -INFINITY;
        for (int64_t j = 0; j < span; ++j) m = std::max(m, sh[j]);
        float tsum = 0.f;
        for (int64_t j = 0; j < span; ++j) { sh[j] = std::exp(sh[j] - m); tsum += sh[j]; }
        sum[h] = tsum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const T* vb = cache + tp[b * NBT + nb] * blk + half + g * D;
        const int64_t off = (nb - nb0) * BS;
        const int tmax = static_cast<int>(std::min<int64_t>(BS, n1 - nb * BS));
        for (int t = 0; t < tmax; ++t) {
          const T* v = vb + t * row;
          for (int64_t h = 0; h < G; ++h) {
            const float p = scores[h * span + off + t];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        const float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;
        for (int d = 0; d < D; ++d) op[(b * H + g * G + h) * D + d] = static_cast<T>(acc[h * D + d] * inv);
      }
    }
  });
}

template <typename T, int D>
static void by_bs(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables, const at::Tensor& ctx,
                  const at::Tensor& start, double scale, at::Tensor& out) {
  switch (layer.size(2)) {
    case 16: return run<T, D, 16>(q, layer, tables, ctx, start, scale, out);
    case 32: return run<T, D, 32>(q, layer, tables, ctx, start, scale, out);
    default: TORCH_CHECK(false, "block_size");
  }
}
template <typename T>
static void by_dim(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables, const at::Tensor& ctx,
                   const at::Tensor& start, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return by_bs<T, 64>(q, layer, tables, ctx, start, scale, out);
    case 128: return by_bs<T, 128>(q, layer, tables, ctx, start, scale, out);
    case 16: return by_bs<T, 16>(q, layer, tables, ctx, start, scale, out);
    default: TORCH_CHECK(false, "head_dim");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables,
                                  const at::Tensor& ctx, const at::Tensor& start, double scale) {
  TORCH_CHECK(q.dim() == 3 && layer.dim() == 5 && tables.dim() == 2, "q [B, H, D], layer [NB, 2, BS, KVH, D], tables [B, NB]");
  TORCH_CHECK(q.scalar_type() == layer.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(layer.is_contiguous() && tables.scalar_type() == at::kLong, "a contiguous layer, int64 tables");
  auto qc = q.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) by_dim<float>(qc, layer, tables, ctx, start, scale, out);
  else by_dim<c10::BFloat16>(qc, layer, tables, ctx, start, scale, out);
  return out;
}

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor layer, Tensor tables, Tensor ctx, Tensor start, float scale) -> Tensor",
        &paged_decode_attention);
}
