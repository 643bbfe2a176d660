// Decode attention over the paged KV cache, read in place: no gather of the context first.
// Built by engine/native.py (g++ against the installed torch) and registered as the torch op
// pdserve_native::paged_decode_attention; engine/model.py calls it for the decode rows on CPU.
//
// q [B, H, D]; one layer of the cache [num_blocks, 2, block_size, KVH, row] (K then V per block,
// engine/kv_cache.py's layout): row = D values in q's dtype, or an fp8 cache's uint8 rows of D + 2
// bytes (D float8_e4m3fn values, then the row's bfloat16 scale: engine/kv_quant.py); block tables
// [B, max_blocks] int64; start [B] and end [B] int64: each sequence attends to the positions
// start <= p < end (start > 0 under a sliding window).
// -> [B, H, D], in q's dtype (float32 or bfloat16; arithmetic in float32).
//
// fp8 rows are widened to float32 as bfloat16 ones are, times their scale: an e4m3fn byte b is the
// float16 with bits (b & 0x7F) << 7 | (b & 0x80) << 8 times 2^8 (its 4 exponent bits land in the low
// ones of float16's 5, bias 7 against 15; subnormals map to subnormals), converted 16 (AVX-512) or 8
// (F16C) at a time; the plain-loop build reads a 256-entry table.
//
// Per sequence, 16 tokens at a time: each token's K row (all KV heads, contiguous) is read in place
// (float32) or widened to float32 once (bfloat16), dotted with the query heads that share it, and the
// 16 dot products of a head are summed lane-wise in one shuffle tree (sum16); the scores are soft-maxed
// in float32 with a vectorized exp (terms below e^-80 are 0); then each V row is accumulated into
// those heads' outputs. The cache is read front to back, each K/V byte of the context once per layer:
// measured 0.12x (32 x 160 tokens, 16 / 8 heads) and 0.38x (12 x 640, 16 / 2 heads) of the torch
// path's gather + decode_attend, float32, one thread (bench/tools/native_attention.py); the 16-token
// scores and the vectorized exp took 0.74-0.90x of the time of the token-by-token version before them
// (16 / 2 heads of 64, blocks of 16 and 64, 1 x 2300 to 32 x 160 tokens, float32 and bfloat16).
// AVX-512 where the compiler targets it (-march=native), else AVX2 + FMA (8 tokens at a time in the
// scores, the same exp), else plain loops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_AVX2 1
#endif

namespace {

// A row of D values widened to float32 (bfloat16 is the high half of a float32).
template <typename T, int D>
inline void widen(const T* src, float* dst) {
#if defined(__AVX512F__)
  for (int c = 0; c < D; c += 16) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_store_ps(dst + c, _mm512_loadu_ps(src + c));
    } else {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
      _mm512_store_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
  }
#else
  for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
#endif
}

// The value of each float8_e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0:
// subnormal; 0x7F / 0xFF: NaN, which engine/kv_quant.py never writes).
constexpr float fp8_value(int b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v = e == 0 ? m / 8.f : 1.f + m / 8.f;
  for (int i = 0; i < (e == 0 ? 6 : 0); ++i) v /= 2.f;  // 2^-6 for subnormals
  for (int i = 7; i < e; ++i) v *= 2.f;
  for (int i = e; i < 7 && e != 0; ++i) v /= 2.f;
  return (b & 0x80) ? -v : v;
}

constexpr std::array<float, 256> make_fp8_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = fp8_value(b);
  return t;
}

// The scale after a row's D fp8 bytes: bfloat16, the high half of a float32.
inline float fp8_row_scale(const uint8_t* scale_bytes) {
  uint16_t raw;
  std::memcpy(&raw, scale_bytes, 2);
  const uint32_t bits = static_cast<uint32_t>(raw) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// An fp8 row (D bytes, then its scale) widened to float32 values.
template <int D>
inline void widen_fp8(const uint8_t* src, float* dst) {
  const float scale = fp8_row_scale(src + D);
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(scale * 256.f);
  const __m256i low7 = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
  for (int c = 0; c < D; c += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, low7), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, sign), 8));
    _mm512_store_ps(dst + c, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
  }
#elif defined(PDSERVE_AVX2) && defined(__F16C__)
  const __m256 sv = _mm256_set1_ps(scale * 256.f);
  const __m128i low7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
  for (int c = 0; c < D; c += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, low7), 7), _mm_slli_epi16(_mm_and_si128(b, sign), 8));
    _mm256_store_ps(dst + c, _mm256_mul_ps(_mm256_cvtph_ps(h), sv));
  }
#else
  static constexpr std::array<float, 256> table = make_fp8_table();
  for (int d = 0; d < D; ++d) dst[d] = table[src[d]] * scale;
#endif
}

// A cache row of D values widened to float32: C is the cache's element (q's dtype, or uint8 for fp8 rows).
template <typename C, int D>
inline void widen_row(const C* src, float* dst) {
  if constexpr (std::is_same_v<C, uint8_t>) {
    widen_fp8<D>(src, dst);
  } else {
    widen<C, D>(src, dst);
  }
}

template <int D>
inline float dot(const float* a, const float* b) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_mul_ps(_mm512_load_ps(a), _mm512_load_ps(b));
  for (int c = 16; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_load_ps(a + c), _mm512_load_ps(b + c), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
#endif
}

template <int D>
inline void axpy(float p, const float* x, float* y) {
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (int c = 0; c < D; c += 16)
    _mm512_store_ps(y + c, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + c), _mm512_load_ps(y + c)));
#else
  for (int d = 0; d < D; ++d) y[d] += p * x[d];
#endif
}

// The vectorized exp's facts, shared by the AVX-512 and AVX2 versions: e^x for x <= 0, and 0 below
// kExpFloor (no denormals in the V sums, slow on x86): Cody-Waite reduction by ln 2 (split in a high
// part exact in float and the rest) and a degree-7 polynomial on |r| <= ln(2)/2 (error below 1e-8
// relative, coefficients highest first), scaled by 2^n.
constexpr float kExpFloor = -80.f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

#if defined(__AVX512F__)
// 16 vectors -> one vector whose lane t is the sum of v[t]'s lanes: a tree of 128-bit-lane and
// in-lane shuffles (46 instructions for 16 sums, against ~8 per horizontal reduce on its own).
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int t = 0; t < 8; ++t)  // lanes 0-7 of w[t] sum to s[t], lanes 8-15 to s[t + 8]
    w[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[t], v[t + 8], 0x44), _mm512_shuffle_f32x4(v[t], v[t + 8], 0xEE));
  for (int t = 0; t < 4; ++t)  // each 128-bit lane of x[t] sums to s[t], s[t + 8], s[t + 4], s[t + 12]
    x[t] = _mm512_add_ps(_mm512_shuffle_f32x4(w[t], w[t + 4], 0x88), _mm512_shuffle_f32x4(w[t], w[t + 4], 0xDD));
  for (int t = 0; t < 2; ++t) y[t] = _mm512_add_ps(_mm512_unpacklo_ps(x[t], x[t + 2]), _mm512_unpackhi_ps(x[t], x[t + 2]));
  const __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  return _mm512_shuffle_f32x4(z, z, 0xD8);  // [s0-3, s8-11, s4-7, s12-15] -> s0-15
}

// e^x for x <= 0 (the constants above), 2^n applied with scalef.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor = _mm512_set1_ps(kExpFloor);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ);
  x = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline __mmask16 first(int64_t count) { return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }

// sh[0..n) -> exp(sh - max); returns their sum.
inline float softmax_numerators(float* sh, int64_t n) {
  __m512 mv = _mm512_set1_ps(sh[0]);
  for (int64_t j = 0; j < n; j += 16) mv = _mm512_mask_max_ps(mv, first(n - j), mv, _mm512_maskz_loadu_ps(first(n - j), sh + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = first(n - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + j), m)));
    _mm512_mask_storeu_ps(sh + j, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(PDSERVE_AVX2)
// 8 vectors -> one vector whose lane t is the sum of v[t]'s lanes (6 hadd, 2 permutes, 1 add).
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [s0-3 low halves | s0-3 high], s4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// e^x for x <= 0 (the constants above), 2^n built in the exponent bits (n >= -116 here, so a
// normal float).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(kExpFloor);
  const __m256 keep = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// sh[0..n) -> exp(sh - max); returns their sum. The last partial vector goes through a padded copy.
inline float softmax_numerators(float* sh, int64_t n) {
  const int64_t full = n & ~int64_t{7};
  float m = sh[0];
  __m256 mv = _mm256_set1_ps(m);
  for (int64_t j = 0; j < full; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sh + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (const float x : lanes) m = std::max(m, x);
  for (int64_t j = full; j < n; ++j) m = std::max(m, sh[j]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mb));
    _mm256_storeu_ps(sh + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (full < n) {
    for (int t = 0; t < 8; ++t) lanes[t] = full + t < n ? sh[full + t] : m - 100.f;  // e^-100: 0
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(lanes), mb));
    sum = _mm256_add_ps(sum, e);
    _mm256_store_ps(lanes, e);
    for (int64_t j = full; j < n; ++j) sh[j] = lanes[j - full];
  }
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (const float x : lanes) total += x;
  return total;
}
#else
inline float softmax_numerators(float* sh, int64_t n) {
  float m = sh[0], sum = 0.f;  // no infinities: the build uses -ffast-math
  for (int64_t j = 0; j < n; ++j) m = std::max(m, sh[j]);
  for (int64_t j = 0; j < n; ++j) {  // below e^-80 is 0: no denormals in the V sums (slow on x86)
    const float z = sh[j] - m;
    sh[j] = z < kExpFloor ? 0.f : std::exp(z);
    sum += sh[j];
  }
  return sum;
}
#endif

// The scores of up to 16 consecutive tokens (rows[t]: token t's K row, all KV heads, float32) for
// every query head: sh[h * n + t] = qf[h] . K[t, h / G].
template <int D>
inline void score_chunk(const float* const* rows, int64_t count, const float* qf, int64_t H, int64_t G,
                        float* sh, int64_t n) {
#if defined(__AVX512F__)
  __m512 v[16];
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = qf + h * D;
    const int64_t off = (h / G) * D;
    for (int t = 0; t < 16; ++t) {
      const float* k = rows[t < count ? t : 0] + off;
      __m512 acc = _mm512_mul_ps(_mm512_load_ps(qh), _mm512_loadu_ps(k));
      for (int c = 16; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_load_ps(qh + c), _mm512_loadu_ps(k + c), acc);
      v[t] = acc;
    }
    _mm512_mask_storeu_ps(sh + h * n, first(count), sum16(v));
  }
#elif defined(PDSERVE_AVX2)
  __m256 v[8];
  alignas(32) float part[8];
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = qf + h * D;
    const int64_t off = (h / G) * D;
    for (int64_t base = 0; base < count; base += 8) {  // the chunk's tokens, 8 at a time
      for (int t = 0; t < 8; ++t) {
        const float* k = rows[base + t < count ? base + t : 0] + off;
        __m256 acc = _mm256_mul_ps(_mm256_load_ps(qh), _mm256_loadu_ps(k));
        for (int c = 8; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_load_ps(qh + c), _mm256_loadu_ps(k + c), acc);
        v[t] = acc;
      }
      const __m256 s = sum8(v);
      if (count - base >= 8) {
        _mm256_storeu_ps(sh + h * n + base, s);
      } else {
        _mm256_store_ps(part, s);
        for (int64_t t = 0; t < count - base; ++t) sh[h * n + base + t] = part[t];
      }
    }
  }
#else
  for (int64_t t = 0; t < count; ++t)
    for (int64_t h = 0; h < H; ++h) sh[h * n + t] = dot<D>(qf + h * D, rows[t] + (h / G) * D);
#endif
}

// T: q's (and the output's) dtype; C: the cache's element, T or uint8_t (fp8 rows of D + 2 bytes).
template <typename T, typename C, int D>
void attend(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables, const at::Tensor& start,
            const at::Tensor& end, double scale, at::Tensor& out) {
  constexpr bool wide = std::is_same_v<C, float>;  // float32 rows are read in place, the others widened
  constexpr int RW = std::is_same_v<C, uint8_t> ? D + 2 : D;  // a cache row's elements (fp8: + its scale)
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t BS = layer.size(2), KVH = layer.size(3), G = H / KVH, NBT = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* cache = layer.data_ptr<C>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = start.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // a token's K (or V) of every KV head: `row` widened floats, `crow` cache elements
  const int64_t row = KVH * D, crow = KVH * RW, half = BS * crow, block = 2 * half;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores, inv(H);
    // q (H * D), the output sums (H * D), 16 widened K rows (16 * row), one widened V row (row)
    std::unique_ptr<float[], decltype(&std::free)> buf(
        static_cast<float*>(std::aligned_alloc(64, sizeof(float) * (2 * H * D + 17 * row))), &std::free);
    float *qf = buf.get(), *acc = qf + H * D, *krows = acc + H * D, *x = krows + 16 * row;
    const float* rows[16];
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n0 = sp[b], n = ep[b] - n0;
      for (int64_t h = 0; h < H; ++h) {
        widen<T, D>(qp + (b * H + h) * D, qf + h * D);
        for (int d = 0; d < D; ++d) qf[h * D + d] *= sc;
      }
      scores.resize(std::max<int64_t>(n, 1) * H);
      // 16 tokens at a time, every KV head of a token (one contiguous row of KVH * D): the cache is
      // read front to back, once.
      for (int64_t j = 0; j < n; j += 16) {
        const int64_t count = std::min<int64_t>(16, n - j);
        for (int64_t t = 0; t < count; ++t) {
          const int64_t pos = n0 + j + t;
          const C* k = cache + tp[b * NBT + pos / BS] * block + (pos % BS) * crow;
          if constexpr (wide) {
            rows[t] = reinterpret_cast<const float*>(k);
          } else {
            for (int64_t g = 0; g < KVH; ++g) widen_row<C, D>(k + g * RW, krows + t * row + g * D);
            rows[t] = krows + t * row;
          }
        }
        score_chunk<D>(rows, count, qf, H, G, scores.data() + j, n);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float sum = n > 0 ? softmax_numerators(scores.data() + h * n, n) : 0.f;
        inv[h] = sum > 0.f ? 1.f / sum : 0.f;
      }
      std::fill(acc, acc + H * D, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = n0 + j;
        const C* v = cache + tp[b * NBT + pos / BS] * block + half + (pos % BS) * crow;
        for (int64_t g = 0; g < KVH; ++g) {
          const float* vg;
          if constexpr (wide) {
            vg = reinterpret_cast<const float*>(v + g * RW);
          } else {
            widen_row<C, D>(v + g * RW, x);
            vg = x;
          }
          for (int64_t h = g * G; h < (g + 1) * G; ++h) axpy<D>(scores[h * n + j], vg, acc + h * D);
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) op[(b * H + h) * D + d] = static_cast<T>(acc[h * D + d] * inv[h]);
    }
  });
}

template <typename T, typename C>
void by_dim(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables, const at::Tensor& start,
            const at::Tensor& end, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend<T, C, 64>(q, layer, tables, start, end, scale, out);
    case 128: return attend<T, C, 128>(q, layer, tables, start, end, scale, out);
    case 256: return attend<T, C, 256>(q, layer, tables, start, end, scale, out);
    case 32: return attend<T, C, 32>(q, layer, tables, start, end, scale, out);
    case 16: return attend<T, C, 16>(q, layer, tables, start, end, scale, out);
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " (this kernel has 16, 32, 64, 128, 256)");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer, const at::Tensor& tables,
                                  const at::Tensor& start, const at::Tensor& end, double scale) {
  TORCH_CHECK(q.dim() == 3 && layer.dim() == 5 && tables.dim() == 2,
              "q [B, H, D], layer [num_blocks, 2, block_size, KVH, D (fp8: D + 2)], tables [B, max_blocks]");
  TORCH_CHECK(q.device().is_cpu() && layer.device().is_cpu(), "CPU tensors only");
  const bool fp8 = layer.scalar_type() == at::kByte;  // engine/kv_quant.py's rows: D fp8 bytes + a bfloat16 scale
  TORCH_CHECK(fp8 || q.scalar_type() == layer.scalar_type(), "q and the cache must share a dtype (or an fp8 cache)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(layer.is_contiguous() && layer.size(1) == 2 && layer.size(4) == q.size(2) + (fp8 ? 2 : 0),
              "a contiguous layer of rows of head_dim", fp8 ? " + 2 bytes (fp8)" : "");
  TORCH_CHECK(q.size(1) % layer.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.scalar_type() == at::kLong && start.scalar_type() == at::kLong && end.scalar_type() == at::kLong,
              "int64 tables, start and end");
  TORCH_CHECK(tables.size(0) == q.size(0) && start.numel() == q.size(0) && end.numel() == q.size(0),
              "one row per sequence");
  auto qc = q.contiguous();
  auto tc = tables.contiguous(), s = start.contiguous(), e = end.contiguous();
  const int64_t B = q.size(0), BS = layer.size(2), NBT = tables.size(1), blocks = layer.size(0);
  const int64_t *sp = s.data_ptr<int64_t>(), *ep = e.data_ptr<int64_t>(), *tp = tc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // every block the kernel will read: in the table, and in the layer
    TORCH_CHECK(0 <= sp[b] && sp[b] <= ep[b] && ep[b] <= NBT * BS, "sequence ", b,
                ": positions outside its block table");
    for (int64_t i = sp[b] / BS; i * BS < ep[b]; ++i)
      TORCH_CHECK(0 <= tp[b * NBT + i] && tp[b * NBT + i] < blocks, "sequence ", b, ": a block id outside the layer");
  }
  auto out = at::empty(q.sizes(), q.options());
  const bool f32 = q.scalar_type() == at::kFloat;
  if (fp8) {
    if (f32) by_dim<float, uint8_t>(qc, layer, tc, s, e, scale, out);
    else by_dim<c10::BFloat16, uint8_t>(qc, layer, tc, s, e, scale, out);
  } else if (f32) {
    by_dim<float, float>(qc, layer, tc, s, e, scale, out);
  } else {
    by_dim<c10::BFloat16, c10::BFloat16>(qc, layer, tc, s, e, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_native, m) {
  m.def("paged_decode_attention(Tensor q, Tensor layer, Tensor tables, Tensor start, Tensor end, float scale)"
        " -> Tensor", &paged_decode_attention);
}
