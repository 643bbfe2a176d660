// FP8 (e4m3) weights on the CPU, read in place: y = x @ (w * scale).T + bias without widening the weight
// matrix in memory. Built by engine/native.py (g++ against the installed torch) and registered as the
// torch ops pdserve_fp8::fp8_linear and pdserve_fp8::fp8_dequantize; engine/fp8.py calls them.
//
// x [M, K] float32 or bfloat16; w [N, K] uint8 (the bits of float8_e4m3fn); scale [N] float32 (one per
// output row: a per-tensor scale is the same value N times); bias [N] or None -> [M, N] in x's dtype.
// Arithmetic in float32: each weight byte is widened exactly, products summed in float32, the row's
// scale applied once to the sum (exact up to the order of the sums against x @ dequantize(w).T).
//
// Widening an e4m3 byte: its 7 low bits shifted left by 7 are a float16 with the same exponent and
// mantissa bits but a bias of 15 instead of 7 (subnormals included), so half(bits) = value / 2^8; the
// sign goes to bit 15. The 2^8 is folded into the row's scale. (0x7F/0xFF, e4m3fn's NaN, would read
// as 480: checkpoints hold no NaN, and fp8.quantize clamps to +-448.) AVX-512 (16 weights per step,
// vcvtph2ps) where the compiler targets it (-march=native), else AVX2 + F16C (8), else a table.
//
// fp8_linear is for the few rows of a decode step (engine/fp8.py sends larger M to fp8_dequantize +
// a GEMM): tiles of 4 output rows x up to 4 input rows, the weight bytes read once per 4 input rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_FP8_AVX2 1
#endif

namespace {

constexpr float kUnbias = 256.f;  // half(bits) * 2^8 = the e4m3 value
constexpr int kNT = 4;            // output rows per tile
constexpr int kMT = 4;            // input rows per tile

// The 256 e4m3fn values, for the plain-loop path and the tails.
const std::array<float, 256>& table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float mag = e == 0 ? m / 512.f : (1.f + m / 8.f) * static_cast<float>(1 << e) / 128.f;
      v[b] = (b & 0x80) ? -mag : mag;
    }
    return v;
  }();
  return t;
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
// 16 weight bytes -> 16 floats / 2^8.
inline Vec widen(const uint8_t* w) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_cvtph_ps(h);
}
inline Vec load(const float* x) { return _mm512_loadu_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline void store_scaled(float* out, const uint8_t* w, Vec s) { _mm512_storeu_ps(out, _mm512_mul_ps(widen(w), s)); }
// round to nearest even, as c10::BFloat16 does (no NaN here: widened bytes are finite)
inline void store_scaled(c10::BFloat16* out, const uint8_t* w, Vec s) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(widen(w), s));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
inline Vec splat(float s) { return _mm512_set1_ps(s); }
#elif defined(PDSERVE_FP8_AVX2)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec widen(const uint8_t* w) {
  int64_t raw;
  std::memcpy(&raw, w, 8);
  const __m128i b = _mm_cvtepi8_epi16(_mm_cvtsi64_si128(raw));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_cvtph_ps(h);
}
inline Vec load(const float* x) { return _mm256_loadu_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline void store_scaled(float* out, const uint8_t* w, Vec s) { _mm256_storeu_ps(out, _mm256_mul_ps(widen(w), s)); }
inline void store_scaled(c10::BFloat16* out, const uint8_t* w, Vec s) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, _mm256_mul_ps(widen(w), s));
  for (int i = 0; i < 8; ++i) out[i] = c10::BFloat16(tmp[i]);
}
inline Vec splat(float s) { return _mm256_set1_ps(s); }
#else
constexpr int kLanes = 0;  // plain loops over the table
#endif

// acc[m][n] (m < MT, n < NT) = sum_k x[m][k] * w[n][k] / 2^8 (float32; the caller scales). MT and NT are
// compile-time so the MT x NT accumulators stay in registers.
template <int MT, int NT>
inline void tile(const float* x, int64_t K, const uint8_t* w, float (*acc)[kNT]) {
  int64_t k = 0;
#if defined(__AVX512F__) || defined(PDSERVE_FP8_AVX2)
  Vec s[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) s[m][n] = zero();
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = widen(w + n * K + k);
    for (int m = 0; m < MT; ++m) {
      const Vec xv = load(x + m * K + k);
      for (int n = 0; n < NT; ++n) s[m][n] = fma(xv, wv[n], s[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = hsum(s[m][n]);
#else
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = 0.f;
#endif
  const auto& tab = table();
  for (; k < K; ++k)  // the tail (or everything, on the plain path): table values are exact, so / 2^8
    for (int n = 0; n < NT; ++n) {
      const float wv = tab[w[n * K + k]] / kUnbias;
      for (int m = 0; m < MT; ++m) acc[m][n] += x[m * K + k] * wv;
    }
}

template <int MT>
void rows(const float* x, int64_t K, const uint8_t* w, const float* scale, const float* bias, int64_t n0, int64_t n1,
          float* out, int64_t N) {
  float acc[kMT][kNT];
  for (int64_t n = n0; n < n1;) {
    const int nt = n + kNT <= n1 ? kNT : 1;
    if (nt == kNT) {
      tile<MT, kNT>(x, K, w + n * K, acc);
    } else {
      tile<MT, 1>(x, K, w + n * K, acc);
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < nt; ++j)
        out[m * N + n + j] = acc[m][j] * scale[n + j] * kUnbias + (bias ? bias[n + j] : 0.f);
    n += nt;
  }
}

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(), "fp8 ops: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "fp8 ops: w must be a contiguous [N, K] uint8 view of float8_e4m3fn");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.scalar_type() == at::kFloat,
              "fp8 ops: scale must be float32 [N] (one per output row), got ", scale.sizes());
  (void)x;
}

at::Tensor fp8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale_in,
                      const std::optional<at::Tensor>& bias_in) {
  check(x_in, w, scale_in);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.size(1), "fp8_linear: x must be [M, K] with K = ", w.size(1),
              ", got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "fp8_linear: x must be float32 or bfloat16");
  const int64_t M = x_in.size(0), K = w.size(1), N = w.size(0);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor scale = scale_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) bias = bias_in->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + kNT - 1) / kNT, 16, [&](int64_t lo, int64_t hi) {
    const int64_t n0 = lo * kNT, n1 = std::min(N, hi * kNT);
    int64_t m = 0;
    for (; m + kMT <= M; m += kMT) rows<kMT>(xp + m * K, K, wp, sp, bp, n0, n1, op + m * N, N);
    for (; m + 2 <= M; m += 2) rows<2>(xp + m * K, K, wp, sp, bp, n0, n1, op + m * N, N);
    for (; m < M; ++m) rows<1>(xp + m * K, K, wp, sp, bp, n0, n1, op + m * N, N);
  });
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

template <typename T>
void dequantize_rows(const uint8_t* wp, const float* sp, int64_t N, int64_t K, T* op) {
  const auto& tab = table();
  at::parallel_for(0, N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      int64_t k = 0;
#if defined(__AVX512F__) || defined(PDSERVE_FP8_AVX2)
      const Vec s = splat(sp[n] * kUnbias);
      for (; k + kLanes <= K; k += kLanes) store_scaled(op + n * K + k, wp + n * K + k, s);
#endif
      for (; k < K; ++k) op[n * K + k] = static_cast<T>(tab[wp[n * K + k]] * sp[n]);
    }
  });
}

// out = w * scale[row], computed in float32 (exact) and stored as float32 or rounded once to bfloat16: for the
// GEMM of a prefill's many rows (into a buffer kept across calls: a fresh one costs a page fault per 4 KiB).
at::Tensor fp8_dequantize(const at::Tensor& w, const at::Tensor& scale_in, at::Tensor out) {
  check(w, w, scale_in);
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K,
              "fp8_dequantize: out must be a contiguous [", N, ", ", K, "] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "fp8_dequantize: out must be float32 or bfloat16");
  const at::Tensor scale = scale_in.contiguous();
  if (out.scalar_type() == at::kFloat) {
    dequantize_rows(w.data_ptr<uint8_t>(), scale.data_ptr<float>(), N, K, out.data_ptr<float>());
  } else {
    dequantize_rows(w.data_ptr<uint8_t>(), scale.data_ptr<float>(), N, K, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_fp8, m) {
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.def("fp8_dequantize(Tensor w, Tensor scale, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pdserve_fp8, CPU, m) {
  m.impl("fp8_linear", fp8_linear);
  m.impl("fp8_dequantize", fp8_dequantize);
}
