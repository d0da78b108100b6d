// kvflow C++ CPU kernel: Paged attention over the CPU KV cache: one-token decode and tiled prefill (flash attention) for float caches, every query token for int8 / fp8 caches.
// Python side and documentation: kvflow/attention/cpu_attention.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <algorithm>
#include <vector>
#include <type_traits>
#include <utility>

#include <atomic>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "vec_exp.h"  // exp_neg16, exp8_cephes, exp_neg8

// exp(x) for x <= 0 in float32, vectorizable (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2,
// degree-6 polynomial for e^r, 2^n by exponent bits); relative error ~2e-7. Below -87.3
// (e^x < 1.2e-38) it returns 0, as softmax weights that small are 0 in float32 anyway.
static inline float exp_neg(float x) {
  const float clamped = x < -87.3f ? -87.3f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : p * scale;
}

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Prefetch the first `bytes` of each of `rows` cache rows `stride` elements apart from `p` (the
// next block's rows of a head while the value pass reads the current block).
// Every prefetch of a cache block here asks for L2, not L1 (locality 2: prefetcht1): a block's
// 96 lines requested into L1 at once wait on L1's few miss buffers and hold up the demand
// loads behind them; into L2 they stream. Measured on Zen 4, 2 threads, 32 sequences x 1,024
// tokens of SmolLM2's shape from a scattered pool: 67-79 -> 52-55 ms a step (bf16, AVX-512;
// 1.25-1.4x under the AVX2 build, float32 1.2x, one sequence of 2,000 tokens 1.65x).
// Nor are a block's rows requested in one burst: the prefetch instructions themselves then
// stall on the miss buffers (perf: 15 % of the decode kernel's samples on two prefetcht1), so
// the next block's rows are requested a slice at a time between the current block's products
// (one row per token in the value pass, a third of the block before each KV head's scores).
// Measured on Zen 4, one thread's CPU time, 32 x 160-560 tokens of SmolLM2's shape, 30 layers'
// pools on huge pages: 8.3-9.0 -> 10.4-11.0 GB/s (1.21-1.27x; the AVX2 build 1.10-1.13x, two
// threads 15 -> 17.6 GB/s). Prefetching two blocks ahead measured the same, every second or
// fourth line only slower, and the value rows prefetched during the score pass no better:
// at ~11 GB/s a core the software prefetches fill its miss buffers.
template <typename T>
static inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(c + o * stride * sizeof(T) + x, 0, 2);
}

#if defined(__AVX512F__)
// Sixteen dot-product accumulators in, one vector out whose lane i is the sum of v[i]'s
// lanes: a transpose-and-add tree (45 shuffles and adds for 16 sums, against about 8
// instructions per sum with one horizontal reduction each). v is clobbered.
static inline __m512 reduce16(__m512* v) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's partial sums of a, b, c, d
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Sixteen float32 values from 16 bfloat16 (the top halves of float32) or float32 ones.
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// Scores of up to 16 consecutive tokens of one block against one query head:
// out[t] = scale * (q . k_t) for t < n, with k_t = k + t * stride (HD values each).
// bfloat16 with AVX512-BF16: q and k stay bfloat16 and vdpbf16ps multiplies pairs exactly
// into float32 sums (HD a multiple of 32); otherwise k is widened to float32 and q is qf
// (float32). HD: a multiple of 16.
template <typename T, int HD>
static inline void scores16(const T* q, const float* qf, const T* k, int64_t stride, int64_t n, float scale,
                            float* out) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, c10::BFloat16>::value && HD % 32 == 0) {  // else: widened, as float32
    __m512bh qv[HD / 32];
    for (int j = 0; j < HD / 32; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
    // constant trip counts (the accumulators stay in registers): rows t >= n read row 0
    // again and their sums are not stored
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      const T* kt = k + (t < n ? t : 0) * stride;
#pragma GCC unroll 4
      for (int j = 0; j < HD / 32; ++j)
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(kt + 32 * j), qv[j]);
    }
    const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), r);
    return;
  }
#endif
  (void)q;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {  // as above: rows t >= n read row 0 again, not stored
    const T* kt = k + (t < n ? t : 0) * stride;
#pragma GCC unroll 8
    for (int j = 0; j < HD / 16; ++j)
      acc[t] = _mm512_fmadd_ps(load16(kt + 16 * j), _mm512_loadu_ps(qf + 16 * j), acc[t]);
  }
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), reduce16(acc));
}
#define KVFLOW_HAS_SCORES16 1

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (x86-64-v3) counterparts of the vector passes: 8 float32 lanes, 16 registers.

// Eight dot-product accumulators in, one vector out whose lane i is the sum of v[i]'s lanes
// (two rounds of pairwise adds within 128-bit lanes, then the two halves added).
static inline __m256 reduce8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: [v0..v3 lanes 0-3 | v0..v3 lanes 4-7], cd: the same of v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// out[t] = qf . k_t for t < n <= 8 (qf: the query in float32, already scaled).
template <typename T, int HD>
static inline void scores8(const float* qf, const T* k, int64_t stride, int64_t n, float* out) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  if (n == 8) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t)
#pragma GCC unroll 8
      for (int j = 0; j < HD / 8; ++j)
        acc[t] = _mm256_fmadd_ps(load8(k + t * stride + 8 * j), _mm256_loadu_ps(qf + 8 * j), acc[t]);
    _mm256_storeu_ps(out, reduce8(acc));
    return;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < HD / 8; ++j)
      acc[t] = _mm256_fmadd_ps(load8(k + t * stride + 8 * j), _mm256_loadu_ps(qf + 8 * j), acc[t]);
  float r[8];
  _mm256_storeu_ps(r, reduce8(acc));
  for (int64_t t = 0; t < n; ++t) out[t] = r[t];
}

// scores16's contract (up to 16 tokens, out[t] = scale * q . k_t) as two scores8 (q and scale
// enter through qf).
template <typename T, int HD>
static inline void scores16(const T* q, const float* qf, const T* k, int64_t stride, int64_t n, float scale,
                            float* out) {
  (void)q;
  (void)scale;
  scores8<T, HD>(qf, k, stride, std::min<int64_t>(n, 8), out);
  if (n > 8) scores8<T, HD>(qf, k + 8 * stride, stride, n - 8, out + 8);
}
#define KVFLOW_HAS_SCORES16 1
#endif

// s[t] = exp(s[t] - max(s)) for t < n; returns their sum (float32).
static inline float exp_shifted(float* s, int64_t n) {
  float m = -INFINITY;
#if defined(__AVX512F__)
  int64_t t = 0;
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
  m = _mm512_reduce_max_ps(mv);
  for (; t < n; ++t) m = s[t] > m ? s[t] : m;
  const __m512 m16 = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  for (t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1u);
    const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m16));
    _mm512_mask_storeu_ps(s + t, k, e);
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sv);
#else
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) { s[t] = exp_neg(s[t] - m); sum += s[t]; }
  return sum;
#endif
}

#if defined(__AVX512F__)
// acc[g][d] = sum_t p[g * p_stride + t] * v_t[d] for one KV head: g < G, d < HD, the values
// v_t read through the block table (row t at (table[t / bs] * bs + t % bs) * stride + off).
// HD is split into chunks whose G x chunk accumulators fit the 32 vector registers.
template <typename T, int HD, int G>
static inline void values_head(const T* v_cache, const int64_t* table, int64_t bs, int64_t ctx, int64_t stride,
                               int64_t off, const float* p, int64_t p_stride, float* acc, int64_t prefetch_bytes) {
  static_assert(HD % 16 == 0 && G > 0, "values_head: HD a multiple of 16, G > 0");
  // G * DC / 16 <= 24 accumulators; DC divides HD
  constexpr int DC = (HD % 64 == 0 && G <= 6) ? 64 : HD % 32 == 0 ? 32 : 16;
  for (int dc = 0; dc < HD; dc += DC) {
    __m512 a[G][DC / 16];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < DC / 16; ++j) a[g][j] = _mm512_setzero_ps();
    for (int64_t b = 0, t = 0; t < ctx; ++b) {
      const T* base = v_cache + table[b] * bs * stride + off + dc;
      const int64_t n = std::min(bs, ctx - t);
      // the next block's rows, one with each row of this block (see prefetch_rows)
      const int64_t next_rows = prefetch_bytes > 0 && t + n < ctx ? std::min(bs, ctx - t - n) : 0;
      const T* next = next_rows > 0 ? v_cache + table[b + 1] * bs * stride + off : nullptr;
      for (int64_t o = 0; o < n; ++o, ++t) {
        if (o < next_rows) prefetch_rows(next + o * stride, 1, stride, prefetch_bytes);
        __m512 v[DC / 16];
        for (int j = 0; j < DC / 16; ++j) v[j] = load16(base + o * stride + 16 * j);
        for (int g = 0; g < G; ++g) {
          const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
          for (int j = 0; j < DC / 16; ++j) a[g][j] = _mm512_fmadd_ps(pg, v[j], a[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < DC / 16; ++j) _mm512_storeu_ps(acc + g * HD + dc + 16 * j, a[g][j]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// values_head above with 8-lane vectors and 16 registers: HD in chunks of DC so that the
// G * DC / 8 accumulators, DC / 8 value vectors and a broadcast fit (spilling a little at G = 7).
template <typename T, int HD, int G>
static inline void values_head(const T* v_cache, const int64_t* table, int64_t bs, int64_t ctx, int64_t stride,
                               int64_t off, const float* p, int64_t p_stride, float* acc, int64_t prefetch_bytes) {
  static_assert(HD % 16 == 0 && G > 0, "values_head: HD a multiple of 16, G > 0");
  constexpr int DC = G >= 5 ? 8 : G >= 3 ? 16 : HD % 32 == 0 ? 32 : 16;  // divides HD
  for (int dc = 0; dc < HD; dc += DC) {
    __m256 a[G][DC / 8];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < DC / 8; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t b = 0, t = 0; t < ctx; ++b) {
      const T* base = v_cache + table[b] * bs * stride + off + dc;
      const int64_t n = std::min(bs, ctx - t);
      // the next block's rows, one with each row of this block (see prefetch_rows)
      const int64_t next_rows = prefetch_bytes > 0 && t + n < ctx ? std::min(bs, ctx - t - n) : 0;
      const T* next = next_rows > 0 ? v_cache + table[b + 1] * bs * stride + off : nullptr;
      for (int64_t o = 0; o < n; ++o, ++t) {
        if (o < next_rows) prefetch_rows(next + o * stride, 1, stride, prefetch_bytes);
        __m256 v[DC / 8];
        for (int j = 0; j < DC / 8; ++j) v[j] = load8(base + o * stride + 8 * j);
        for (int g = 0; g < G; ++g) {
          const __m256 pg = _mm256_set1_ps(p[g * p_stride + t]);
          for (int j = 0; j < DC / 8; ++j) a[g][j] = _mm256_fmadd_ps(pg, v[j], a[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < DC / 8; ++j) _mm256_storeu_ps(acc + g * HD + dc + 8 * j, a[g][j]);
  }
}
#endif

// Float32 vectors of the machine's width (VecF::L lanes): the prefill kernel's tiles and
// values_multi's chains are written once over them.
#if defined(__AVX512F__)
struct VecF {  // 16 float32 lanes
  static constexpr int L = 16;
  __m512 v;
  static inline VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  static inline VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static inline VecF mul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static inline VecF add(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  static inline VecF sub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static inline VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  // e^x for x <= 0, 0 below -87.3 (and for -inf): the decode kernel's exp_neg16.
  static inline VecF exp_neg(VecF x) { return {exp_neg16(x.v)}; }
  // x where x is finite (> -inf), else 0 (a row with no visible key so far).
  static inline VecF finite_or_zero(VecF x) {
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ), x.v)};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct VecF {  // 8 float32 lanes
  static constexpr int L = 8;
  __m256 v;
  static inline VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  inline void store(float* p) const { _mm256_storeu_ps(p, v); }
  static inline VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static inline VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static inline VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  static inline VecF sub(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  static inline VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  // e^x for x <= 0 (Cephes expf, as exp_neg above; 2^n through the exponent bits); 0 below -87.3.
  static inline VecF exp_neg(VecF xv) { return {exp_neg8(xv.v)}; }  // a NaN stays NaN
  static inline VecF finite_or_zero(VecF x) {
    return {_mm256_and_ps(x.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ))};
  }
};
#else
struct VecF {  // portable: 8 lanes as plain loops (the compiler vectorizes what it can)
  static constexpr int L = 8;
  float v[8];
  static inline VecF load(const float* p) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = p[i]; return r; }
  inline void store(float* p) const { for (int i = 0; i < L; ++i) p[i] = v[i]; }
  static inline VecF set1(float x) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = x; return r; }
  static inline VecF fma(VecF a, VecF b, VecF c) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  static inline VecF mul(VecF a, VecF b) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static inline VecF add(VecF a, VecF b) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
  static inline VecF sub(VecF a, VecF b) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
  static inline VecF max(VecF a, VecF b) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
  static inline VecF exp_neg(VecF x) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = ::exp_neg(x.v[i]); return r; }
  static inline VecF finite_or_zero(VecF x) { VecF r; for (int i = 0; i < L; ++i) r.v[i] = x.v[i] > -INFINITY ? x.v[i] : 0.f; return r; }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// values_head over contiguous rows (v_t at v + t * HD) for NQ query tokens at once, token q
// with its own context ctx[q] (ascending) and weights p + q * p_stride_q (G rows p_stride_g
// apart): acc[q * acc_stride_q + g * HD + d] = sum_{t < ctx[q]} p_q[g, t] v_t[d]. Every lane's
// chain is values_head's (acc = fma(p, v, acc) for t = 0, 1, ... in order, from zero): how the
// head dim is chunked and how many tokens share a loaded row change no sum, so each token's
// result equals values_head's for it alone, bit for bit. A row loaded once feeds NQ x G.
#if defined(__AVX512F__)
constexpr int VEC_ACCS = 24;  // of 32 registers: accumulators, the rest rows + a broadcast
#else
constexpr int VEC_ACCS = 12;  // of 16 registers
#endif

// The widest head-dim chunk (64, 32, 16, then 8) that HD splits into and whose NQ x G x
// chunk accumulators fit VEC_ACCS registers; 0 if none.
template <int HD, int G, int NQ>
constexpr int multi_chunk() {
  for (int dc = 64; dc >= VecF::L; dc /= 2)
    if (HD % dc == 0 && NQ * G * (dc / VecF::L) <= VEC_ACCS) return dc;
  return 0;
}

// Where values_multi / quantized_item read row t's float32 values: FloatRows from contiguous
// rows (v_t at v + t * HD), CodeRows (below) from an int8 / fp8 cache's codes.
struct FloatRows {
  const float* v;
  int64_t stride;
  inline VecF load(int64_t t, int64_t off) const { return VecF::load(v + t * stride + off); }
};

template <int HD, int G, int NQ, class Rows>
static inline void values_multi(const Rows& v, const float* p, int64_t p_stride_q, int64_t p_stride_g,
                                const int64_t* ctx, float* acc, int64_t acc_stride_q) {
  constexpr int DC = multi_chunk<HD, G, NQ>();
  static_assert(DC > 0, "values_multi: no chunk of the head dim fits the registers");
  constexpr int NV = DC / VecF::L;
  for (int dc = 0; dc < HD; dc += DC) {
    VecF a[NQ][G][NV];
    for (int q = 0; q < NQ; ++q)
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) a[q][g][j] = VecF::set1(0.f);
    auto step = [&](int64_t t, int q_first) {
      VecF x[NV];
      for (int j = 0; j < NV; ++j) x[j] = v.load(t, dc + VecF::L * j);
      for (int q = q_first; q < NQ; ++q)
        for (int g = 0; g < G; ++g) {
          const VecF pg = VecF::set1(p[q * p_stride_q + g * p_stride_g + t]);
          for (int j = 0; j < NV; ++j) a[q][g][j] = VecF::fma(pg, x[j], a[q][g][j]);
        }
    };
    int64_t t = 0;
    for (; t < ctx[0]; ++t) step(t, 0);  // every token sees these rows
    for (int q = 1; q < NQ; ++q)          // the later tokens' further rows
      for (; t < ctx[q]; ++t) step(t, q);
    for (int q = 0; q < NQ; ++q)
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) a[q][g][j].store(acc + q * acc_stride_q + g * HD + dc + VecF::L * j);
  }
}
#define KVFLOW_HAS_VALUES_MULTI 1
#endif

// The codes of a quantized cache (paged_attention_quantized's `code_format`).
enum CodeFormat : int64_t { CODES_LUT = 0, CODES_INT8 = 1, CODES_FP8_E4M3 = 2 };

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// VecF::L int8 / fp8 (e4m3fn) codes at c as float32 code values times s: an int8 code converts
// exactly; an e4m3fn code's sign, exponent and mantissa bits, moved into a float16's places
// (bits 7-14), make exactly its value times 2^-8 (e4m3's exponent bias is 7, float16's 15;
// subnormals map to subnormals), and s times 2^8 is exact too, so the one rounding is that of
// value * s: the floats of the 256-entry table times s. (The NaN codes 0x7f / 0xff would read
// as +-480; quantize_kv never writes them: its codes stay within +-448.)
#define KVFLOW_HAS_CODE_VECTORS 1
template <int FMT>
static inline VecF convert_codes(const uint8_t* c, float s) {
  static_assert(FMT == CODES_INT8 || FMT == CODES_FP8_E4M3, "convert_codes: int8 or fp8 codes");
#if defined(__AVX512F__)
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  if constexpr (FMT == CODES_INT8) {
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)), _mm512_set1_ps(s))};
  } else {
    const __m256i w = _mm256_cvtepu8_epi16(x);
    const __m256i h16 = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return {_mm512_mul_ps(_mm512_cvtph_ps(h16), _mm512_set1_ps(s * 256.f))};
  }
#else
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  if constexpr (FMT == CODES_INT8) {
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), _mm256_set1_ps(s))};
  } else {
    const __m128i w = _mm_cvtepu8_epi16(x);
    const __m128i h16 = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                     _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return {_mm256_mul_ps(_mm256_cvtph_ps(h16), _mm256_set1_ps(s * 256.f))};
  }
#endif
}
#endif

#if defined(KVFLOW_HAS_SCORES16) && defined(KVFLOW_HAS_VALUES_MULTI) && defined(KVFLOW_HAS_CODE_VECTORS)
// Rows of an int8 / fp8 cache read where they are stored: row t's codes at row[t], its scale
// scale[t], converted in registers (convert_codes) to the floats dequant_row writes, so a pass
// over CodeRows computes what the same pass over dequant_rows' buffer does, bit for bit,
// without writing and reading back a float32 copy of the context (4 bytes an element).
#define KVFLOW_HAS_CODE_ROWS 1
template <int FMT>
struct CodeRows {
  const uint8_t* const* row;
  const float* scale;
  inline VecF load(int64_t t, int64_t off) const { return convert_codes<FMT>(row[t] + off, scale[t]); }
};

// The key tile t0 .. t0 + n - 1 (n <= 16) as contiguous float32 rows of HD: converted once
// into buf (16 x HD floats, L1-resident), which every query head and token of the item then
// scores with scores16 (converting per query head cost G conversions of each key).
template <int HD, int FMT>
static inline const float* key_tile(const CodeRows<FMT>& k, int64_t t0, int64_t n, float* buf) {
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < HD / VecF::L; ++j) k.load(t0 + t, VecF::L * j).store(buf + t * HD + VecF::L * j);
  return buf;
}
#endif

#if defined(KVFLOW_HAS_SCORES16)
// Contiguous float32 rows (a dequantized buffer): the tile is where it is.
template <int HD>
static inline const float* key_tile(const FloatRows& k, int64_t t0, int64_t, float*) {
  return k.v + t0 * k.stride;
}
#endif

// A row of head_dim values as float32 (vectorizable: bfloat16 is the top half of a float32).
template <typename T>
static inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
}
template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));  // a bit cast (no float/uint32 aliasing)
    dst[d] = f;
  }
}

// One work item: request r, KV heads [h0, h0 + nh). HD / G > 0 fix the head dim / the query
// heads per KV head at compile time (the inner loops then unroll); 0 means "read it from
// head_dim / group". Keys and values are visited token by token, block by block: the row of
// the item's heads is contiguous in the cache, so a block is read as one stream.
template <typename T, int HD, int G>
static void decode_item(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
                        T* out, int64_t head_dim, int64_t group, int64_t block_size, int64_t slot_stride,
                        int64_t h0, int64_t nh, float scale, int64_t q_stride_h, int64_t o_stride_h,
                        std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& row,
                        std::vector<float>& acc, std::vector<float>& inv_sum) {
  const int64_t D = HD > 0 ? HD : head_dim;
  const int64_t g_n = G > 0 ? G : group;
  const int64_t rows = nh * g_n;
  qf.resize(rows * D);
  acc.assign(rows * D, 0.f);
  row.resize(nh * D);
  scores.resize(rows * ctx);
  for (int64_t i = 0; i < rows; ++i) {
    const T* qp = q + (h0 * g_n + i) * q_stride_h;
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = to_f(qp[d]) * scale;
  }
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  const int64_t head_off = h0 * D;
  const int64_t row_bytes = nh * D * static_cast<int64_t>(sizeof(T));
  // Blocks sit anywhere in the cache: while reading block b, prefetch the same row of block
  // b + 1 so that its first lines are on their way when the stream jumps there.
  auto prefetch_next = [&](const T* cache, int64_t b, int64_t o) {
    if (b + 1 < num_blocks) {
      const char* p = reinterpret_cast<const char*>(cache + (table[b + 1] * block_size + o) * slot_stride + head_off);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
    }
  };
  // Pass 1: scores[i, t] = q_i . k_t.
  const int64_t width = nh * D;
  row.resize(2 * width);
#if defined(KVFLOW_HAS_SCORES16)
  // Vectorized: 16 tokens of a block per call, their 16 sums reduced together (any head dim
  // that is a multiple of 16 and compiled in; the group may be read at run time).
  constexpr bool vector_pass1 = HD > 0 && HD % 16 == 0 &&
                                (std::is_same<T, c10::BFloat16>::value || std::is_same<T, float>::value);
#else
  constexpr bool vector_pass1 = false;
#endif
  if constexpr (vector_pass1) {
#if defined(KVFLOW_HAS_SCORES16)
    constexpr int HDc = HD > 0 ? HD : 32;
    for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
      const int64_t base = table[b] * block_size;
      const int64_t n = std::min(block_size, ctx - b * block_size);
      // The next block's rows of these heads, while this one is scored: a slice of them before
      // each head's scores, not all at once (see prefetch_rows).
      const int64_t next_rows = b + 1 < num_blocks ? std::min(block_size, ctx - (b + 1) * block_size) : 0;
      const T* next = next_rows > 0 ? k_cache + table[b + 1] * block_size * slot_stride + head_off : nullptr;
      for (int64_t o = 0; o < n; o += 16) {
        const int64_t m = std::min<int64_t>(16, n - o);
        for (int64_t h = 0; h < nh; ++h) {
          if (o == 0 && next_rows > 0) {
            const int64_t r0 = next_rows * h / nh, r1 = next_rows * (h + 1) / nh;
            prefetch_rows(next + r0 * slot_stride, r1 - r0, slot_stride, row_bytes);
          }
          const T* kp = k_cache + (base + o) * slot_stride + head_off + h * D;
          for (int64_t g = 0; g < g_n; ++g) {
            const int64_t i = h * g_n + g;
            scores16<T, HDc>(q + (h0 * g_n + i) * q_stride_h, qf.data() + i * D, kp, slot_stride, m, scale,
                             scores.data() + i * ctx + t + o);
          }
        }
      }
      t += n;
    }
#endif
  } else
  for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
    const int64_t base = table[b] * block_size;
    const int64_t n = std::min(block_size, ctx - b * block_size);
    int64_t o = 0;
    for (; o + 1 < n; o += 2, t += 2) {
      prefetch_next(k_cache, b, o);
      prefetch_next(k_cache, b, o + 1);
      load_row(k_cache + (base + o) * slot_stride + head_off, row.data(), width);
      load_row(k_cache + (base + o + 1) * slot_stride + head_off, row.data() + width, width);
      for (int64_t h = 0; h < nh; ++h) {
        const float* ka = row.data() + h * D;
        const float* kb = ka + width;
        for (int64_t g = 0; g < g_n; ++g) {
          const float* qi = qf.data() + (h * g_n + g) * D;
          float sa = 0.f, sb = 0.f;
#pragma omp simd reduction(+ : sa, sb)
          for (int64_t d = 0; d < D; ++d) { sa += qi[d] * ka[d]; sb += qi[d] * kb[d]; }
          scores[(h * g_n + g) * ctx + t] = sa;
          scores[(h * g_n + g) * ctx + t + 1] = sb;
        }
      }
    }
    for (; o < n; ++o, ++t) {
      prefetch_next(k_cache, b, o);
      load_row(k_cache + (base + o) * slot_stride + head_off, row.data(), width);
      for (int64_t h = 0; h < nh; ++h) {
        const float* kr = row.data() + h * D;
        for (int64_t g = 0; g < g_n; ++g) {
          const float* qi = qf.data() + (h * g_n + g) * D;
          float a = 0.f;
#pragma omp simd reduction(+ : a)
          for (int64_t d = 0; d < D; ++d) a += qi[d] * kr[d];
          scores[(h * g_n + g) * ctx + t] = a;
        }
      }
    }
  }
  // Softmax over the context, per query head (float32); the 1 / sum is applied to the output.
  inv_sum.resize(rows);
  for (int64_t i = 0; i < rows; ++i) inv_sum[i] = 1.f / exp_shifted(scores.data() + i * ctx, ctx);
  // Pass 2: out_i = sum_t p[i, t] v_t. With the head dim fixed at compile time the group's
  // accumulators live in registers (one KV head at a time; the request's values are in the L2
  // cache after the first head). A group read at run time goes in chunks of 4, 2 and 1 query
  // heads, each a compile-time group (values_head; the portable loop where there is no vector pass).
  constexpr int HDc = HD > 0 ? HD : 16;
  auto by_group = [&](auto call) {  // call(integral_constant GC, h, first query head g0 of h)
    for (int64_t h = 0; h < nh; ++h) {
      if constexpr (G > 0) {
        call(std::integral_constant<int, G>(), h, int64_t{0});
      } else {
        for (int64_t g0 = 0; g0 < g_n;) {
          const int64_t rem = g_n - g0;
          if (rem >= 4) { call(std::integral_constant<int, 4>(), h, g0); g0 += 4; }
          else if (rem >= 2) { call(std::integral_constant<int, 2>(), h, g0); g0 += 2; }
          else { call(std::integral_constant<int, 1>(), h, g0); g0 += 1; }
        }
      }
    }
  };
  if constexpr (vector_pass1) {
#if defined(KVFLOW_HAS_SCORES16)
    by_group([&](auto gc, int64_t h, int64_t g0) {
      constexpr int GC = decltype(gc)::value;
      values_head<T, HDc, GC>(v_cache, table, block_size, ctx, slot_stride, head_off + h * D,
                              scores.data() + (h * g_n + g0) * ctx, ctx, acc.data() + (h * g_n + g0) * D,
                              h == 0 && g0 == 0 ? row_bytes : 0);  // the first pass brings in the item's rows
    });
#endif
  } else if constexpr (HD > 0) {
    by_group([&](auto gc, int64_t h, int64_t g0) {
      constexpr int GC = decltype(gc)::value;
      float a[GC][HDc] = {};
      const float* ph = scores.data() + (h * g_n + g0) * ctx;
      for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
        const int64_t base = table[b] * block_size;
        const int64_t n = std::min(block_size, ctx - b * block_size);
        for (int64_t o = 0; o < n; ++o, ++t) {
          float vr[HDc];
          load_row(v_cache + (base + o) * slot_stride + head_off + h * D, vr, HDc);
          for (int g = 0; g < GC; ++g) {
            const float p = ph[g * ctx + t];
#pragma omp simd
            for (int d = 0; d < HDc; ++d) a[g][d] += p * vr[d];
          }
        }
      }
      for (int g = 0; g < GC; ++g)
        for (int d = 0; d < HDc; ++d) acc[(h * g_n + g0 + g) * HDc + d] = a[g][d];
    });
  } else {
    for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
      const int64_t base = table[b] * block_size;
      const int64_t n = std::min(block_size, ctx - b * block_size);
      for (int64_t o = 0; o < n; ++o, ++t) {
        prefetch_next(v_cache, b, o);
        load_row(v_cache + (base + o) * slot_stride + head_off, row.data(), nh * D);
        for (int64_t h = 0; h < nh; ++h) {
          const float* vr = row.data() + h * D;
          for (int64_t g = 0; g < g_n; ++g) {
            const float p = scores[(h * g_n + g) * ctx + t];
            float* ai = acc.data() + (h * g_n + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ai[d] += p * vr[d];
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    T* op = out + (h0 * g_n + i) * o_stride_h;
    for (int64_t d = 0; d < D; ++d) op[d] = static_cast<T>(acc[i * D + d] * inv_sum[i]);
  }
}

template <typename T, int HD, int G>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int32_t* ctx_lens, T* out, int64_t num_reqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t max_blocks, float scale, int64_t q_stride_t, int64_t q_stride_h,
                          int64_t o_stride_t, int64_t o_stride_h) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // between consecutive tokens of a block
  // Work items: whole requests, or (request, KV head) pairs when there are too few requests
  // to keep the threads busy.
  const int64_t heads_per_item = num_reqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_req = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_reqs * items_per_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, row, acc, inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / items_per_req, h0 = (item % items_per_req) * heads_per_item;
      decode_item<T, HD, G>(q + r * q_stride_t, k_cache, v_cache, tables + r * max_blocks, ctx_lens[r],
                            out + r * o_stride_t, head_dim, group, block_size, slot_stride, h0, heads_per_item,
                            scale, q_stride_h, o_stride_h, qf, scores, row, acc, inv_sum);
    }
  });
}

// Dispatch on the head dim / group size compiled in (0: read at run time). decode_item takes
// the vectorized passes for every compiled-in head dim (a multiple of 16), the portable loops
// for the rest (HD = 0).
template <typename T, typename F>
static void with_shape(int64_t head_dim, int64_t group, F&& f) {
  if (head_dim == 64 && group == 1) f(std::integral_constant<int, 64>(), std::integral_constant<int, 1>());
  else if (head_dim == 64 && group == 3) f(std::integral_constant<int, 64>(), std::integral_constant<int, 3>());
  else if (head_dim == 64 && group == 4) f(std::integral_constant<int, 64>(), std::integral_constant<int, 4>());
  else if (head_dim == 64 && group == 7) f(std::integral_constant<int, 64>(), std::integral_constant<int, 7>());
  else if (head_dim == 64 && group == 8) f(std::integral_constant<int, 64>(), std::integral_constant<int, 8>());
  else if (head_dim == 64) f(std::integral_constant<int, 64>(), std::integral_constant<int, 0>());
  else if (head_dim == 128 && group == 1) f(std::integral_constant<int, 128>(), std::integral_constant<int, 1>());
  else if (head_dim == 128 && group == 4) f(std::integral_constant<int, 128>(), std::integral_constant<int, 4>());
  else if (head_dim == 128 && group == 6) f(std::integral_constant<int, 128>(), std::integral_constant<int, 6>());
  else if (head_dim == 128 && group == 7) f(std::integral_constant<int, 128>(), std::integral_constant<int, 7>());
  else if (head_dim == 128) f(std::integral_constant<int, 128>(), std::integral_constant<int, 0>());
  // other head dims with the group read at run time: Gemma 3 (256), Phi-3 (96), Phi-2 (80),
  // small models (16, 32)
  else if (head_dim == 256) f(std::integral_constant<int, 256>(), std::integral_constant<int, 0>());
  else if (head_dim == 96) f(std::integral_constant<int, 96>(), std::integral_constant<int, 0>());
  else if (head_dim == 80) f(std::integral_constant<int, 80>(), std::integral_constant<int, 0>());
  else if (head_dim == 32) f(std::integral_constant<int, 32>(), std::integral_constant<int, 0>());
  else if (head_dim == 16) f(std::integral_constant<int, 16>(), std::integral_constant<int, 0>());
  else f(std::integral_constant<int, 0>(), std::integral_constant<int, 0>());
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1, "layout");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt32, "index dtypes");
  auto tables = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) >= num_reqs && ctx.numel() >= num_reqs,
              "block_tables / context_lens have fewer rows than q");
  // Every block the kernel will read must exist (an out-of-range id is a bug elsewhere: raise
  // instead of reading outside the cache).
  const int64_t width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(cp[r] >= 1 && cp[r] <= width * block_size, "context_lens[", r, "] = ", cp[r],
                " is outside 1 .. block_tables width * block_size = ", width * block_size);
    for (int64_t b = 0; b < (cp[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < num_blocks, "block_tables[", r, ", ", b,
                  "] = ", tp[r * width + b], " is not a block of the cache (", num_blocks, " blocks)");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), ctx.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
             num_reqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
             static_cast<float>(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1));
    };
    with_shape<scalar_t>(head_dim, num_heads / num_kv_heads, [&](auto hd, auto g) {
      run(decode_kernel<scalar_t, decltype(hd)::value, decltype(g)::value>);
    });
  });
  return out;
}

// One row of D codes: o[d] = lut[code] * s (float32), in vectors where the CPU has them.
static inline void dequant_row(const uint8_t* c, float s, const float* lut, int64_t format, int64_t D, float* o) {
#if defined(KVFLOW_HAS_CODE_VECTORS)
  if (D % VecF::L == 0 && (format == CODES_INT8 || format == CODES_FP8_E4M3)) {
    auto run = [&](auto fmt) {
      for (int64_t d = 0; d < D; d += VecF::L) convert_codes<decltype(fmt)::value>(c + d, s).store(o + d);
    };
    if (format == CODES_INT8) run(std::integral_constant<int, CODES_INT8>());
    else run(std::integral_constant<int, CODES_FP8_E4M3>());
    return;
  }
#endif
  (void)format;
  for (int64_t d = 0; d < D; ++d) o[d] = lut[c[d]] * s;
}

// Rows t < n of one KV head, dequantized: dst[t * D + d] = lut[code] * scale (float32), the
// rows read through the block table (slot table[t / bs] * bs + t % bs). int8 and fp8 (e4m3fn)
// codes convert in vectors where the CPU has them (convert_codes: 16 or 8 a step), to the same
// floats as the table; other formats, or head dims off the vector width: the table.
// Block by block, without a division and modulo per row (decode attention over 32 x 400
// tokens: 0.449 -> 0.426 ms a layer for int8; most of this pass is the first read of the codes).
static void dequant_rows(const uint8_t* codes, const c10::Half* scales, const float* lut, int64_t format,
                         const int64_t* table, int64_t block_size, int64_t num_kv_heads, int64_t D, int64_t h,
                         int64_t n, float* dst) {
  for (int64_t b = 0, t0 = 0; t0 < n; ++b, t0 += block_size) {
    if (t0 + block_size < n)  // the next block's rows of the head, into L2
      prefetch_rows(codes + (table[b + 1] * block_size * num_kv_heads + h) * D, block_size, num_kv_heads * D, D);
    const int64_t first_slot = table[b] * block_size, rows = std::min(block_size, n - t0);
    for (int64_t o_ = 0; o_ < rows; ++o_)
      dequant_row(codes + ((first_slot + o_) * num_kv_heads + h) * D,
                  static_cast<float>(scales[(first_slot + o_) * num_kv_heads + h]), lut, format, D,
                  dst + (t0 + o_) * D);
  }
}

// Every query token of a step over an int8 / fp8 paged cache. Request r's query tokens are
// rows query_start[r] .. query_start[r + 1] - 1, at positions ctx - q_len .. ctx - 1; the
// token at position p attends to keys 0 .. p. Each token is computed exactly as a decode of
// one token with context p + 1 over the request's dequantized K/V of one KV head (one
// contiguous block, decode_item), so its result does not depend on the chunk it came in,
// on the other requests of the step or on the block size. int8 and fp8 codes (with the
// vector passes) are read in place (CodeRows: the same floats in registers, no float32 copy
// of the context); the table's formats, and head dims off the vector passes, go through
// dequant_rows' buffer.
static void quantized_attention(const float* qp, const uint8_t* kc, const uint8_t* vc, const c10::Half* ks,
                                const c10::Half* vs, const float* lp, int64_t code_format, const int64_t* tp,
                                int64_t width, const int32_t* sp, const int32_t* cp, int64_t num_reqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size, float scale,
                                float* op);

torch::Tensor paged_attention_quantized(torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes,
                                        torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor lut,
                                        torch::Tensor block_tables, torch::Tensor query_start,
                                        torch::Tensor context_lens, double scale, int64_t code_format) {
  TORCH_CHECK(q.device().is_cpu() && k_codes.device().is_cpu() && v_codes.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: float32 [T, heads, D]");
  TORCH_CHECK(k_codes.dim() == 4 && v_codes.sizes() == k_codes.sizes() && k_codes.scalar_type() == torch::kUInt8 &&
              v_codes.scalar_type() == torch::kUInt8 && k_codes.is_contiguous() && v_codes.is_contiguous(),
              "codes: uint8 [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf &&
              k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.numel() * k_codes.size(3) == k_codes.numel() &&
              v_scale.numel() == k_scale.numel(), "scales: float16 [blocks, block_size, kv_heads]");
  TORCH_CHECK(lut.scalar_type() == torch::kFloat32 && lut.numel() == 256 && lut.is_contiguous(), "lut: float32 [256]");
  TORCH_CHECK(code_format == CODES_LUT || code_format == CODES_INT8 || code_format == CODES_FP8_E4M3,
              "code_format: 0 (the table), 1 (int8) or 2 (fp8 e4m3fn), got ", code_format);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && query_start.scalar_type() == torch::kInt32 &&
              context_lens.scalar_type() == torch::kInt32, "index dtypes");
  auto tables = block_tables.contiguous();
  auto starts = query_start.contiguous();
  auto ctx = context_lens.contiguous();
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_codes.size(0), block_size = k_codes.size(1), num_kv_heads = k_codes.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && k_codes.size(3) == D, "heads");
  const int64_t num_reqs = ctx.numel();
  TORCH_CHECK(starts.numel() == num_reqs + 1 && tables.dim() == 2 && tables.size(0) >= num_reqs, "metadata rows");
  const int64_t width = tables.size(1);
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[num_reqs] <= num_tokens, "query_start");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = sp[r + 1] - sp[r];
    TORCH_CHECK(q_len >= 0 && cp[r] >= q_len && cp[r] <= width * block_size, "context_lens[", r, "] = ", cp[r],
                " does not fit its ", q_len, " query tokens and block table");
    for (int64_t b = 0; b < (cp[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < num_blocks, "block_tables[", r, ", ", b,
                  "] = ", tp[r * width + b], " is not a block of the cache (", num_blocks, " blocks)");
  }
  auto out = torch::empty_like(q);
  quantized_attention(q.data_ptr<float>(), k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                      reinterpret_cast<const c10::Half*>(k_scale.data_ptr<at::Half>()),
                      reinterpret_cast<const c10::Half*>(v_scale.data_ptr<at::Half>()), lut.data_ptr<float>(),
                      code_format, tp, width, sp, cp, num_reqs, num_heads, num_kv_heads, D, block_size,
                      static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

#if defined(KVFLOW_HAS_SCORES16) && defined(KVFLOW_HAS_VALUES_MULTI)
// Query tokens i0 .. i1 - 1 of one request and KV head, token i at position first + i, over
// the head's dequantized K/V rows (kbuf / vbuf, contiguous [n, HD], n = first + i1): each token
// computed with exactly decode_item<float, HD, G>'s operations for a one-token decode of
// context first + i + 1 over those rows (its scores16 calls on the same 16-key tiles, its
// softmax, its value chains: values_multi), so the results equal per-token decode_item's bit
// for bit. Only the order of independent work changes: the scores run tile by tile across the
// tokens (a 16-key tile read from L1 by all of them instead of the whole of K from L2 by each)
// and the values NQ tokens at a time (a value row loaded once for NQ x group query heads).
// HD a multiple of 16 compiled in; G compiled in, or 0: the group read at run time and taken
// in compiled chunks of 4, 2 and 1 query heads (decode_item's by_group).
// K and V come as row sources: FloatRows over a dequantized buffer, or CodeRows over the
// cache's own codes (the same floats, so the same results).
template <int HD, int G, class KRows, class VRows>
static void quantized_item(const float* qp, const KRows& krows, const VRows& vrows, int64_t first, int64_t i0,
                           int64_t i1, int64_t t0, int64_t num_heads, int64_t h, int64_t group, float scale,
                           float* op, std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc,
                           std::vector<float>& inv_sum) {
  static_assert(HD > 0 && HD % 16 == 0, "quantized_item: a compiled head dim, a multiple of 16");
  const int64_t g_n = G > 0 ? G : group;
  const int64_t nt = i1 - i0, n = first + i1;  // tokens; keys of the last one
  const int64_t rows = nt * g_n;                // (token, query head) pairs, token-major
  qf.resize(rows * HD);
  scores.resize(rows * n);
  acc.resize(rows * HD);
  inv_sum.resize(rows);
  auto q_of = [&](int64_t i, int64_t g) { return qp + ((t0 + i) * num_heads + h * group + g) * HD; };
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < g_n; ++g) {
      const float* q = q_of(i, g);
      float* f = qf.data() + (i * g_n + g) * HD;
      for (int64_t d = 0; d < HD; ++d) f[d] = q[d] * scale;
    }
  // Pass 1: scores[(i, g), t] = q . k_t, tile by tile (token i sees keys t < first + i0 + i + 1).
  alignas(64) float tile[16 * HD];
  for (int64_t o = 0; o < n; o += 16) {
    const float* kt = key_tile<HD>(krows, o, std::min<int64_t>(16, n - o), tile);
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t ctx = first + i0 + i + 1;
      if (o >= ctx) continue;
      const int64_t m = std::min<int64_t>(16, ctx - o);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t r = i * g_n + g;
        scores16<float, HD>(q_of(i, g), qf.data() + r * HD, kt, HD, m, scale, scores.data() + r * n + o);
      }
    }
  }
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t r = i * g_n + g;
      inv_sum[r] = 1.f / exp_shifted(scores.data() + r * n, first + i0 + i + 1);
    }
  // Pass 2: the values, NQ tokens at a time, then the rest one at a time.
  auto values = [&](auto gc, int64_t g0) {
    constexpr int GC = decltype(gc)::value;
    // Tokens per pass: 4 for a single query head, else 2 where the head dim still goes in as
    // few chunks as for one token (more chunks = more passes over the rows: slower, measured
    // with Qwen2.5-0.5B's 7 heads per KV head), else 1.
    constexpr int DC1 = multi_chunk<HD, GC, 1>();
    constexpr int NQ = GC == 1 && multi_chunk<HD, GC, 4>() == DC1 ? 4 : multi_chunk<HD, GC, 2>() == DC1 ? 2 : 1;
    static_assert(multi_chunk<HD, GC, 1>() > 0, "quantized_item: a query head's value chunk must fit");
    int64_t i = 0;
    for (; i + NQ <= nt; i += NQ) {
      int64_t ctx[NQ];
      for (int q = 0; q < NQ; ++q) ctx[q] = first + i0 + i + q + 1;
      values_multi<HD, GC, NQ>(vrows, scores.data() + (i * g_n + g0) * n, g_n * n, n, ctx,
                               acc.data() + (i * g_n + g0) * HD, g_n * HD);
    }
    for (; i < nt; ++i) {
      const int64_t ctx = first + i0 + i + 1;
      values_multi<HD, GC, 1>(vrows, scores.data() + (i * g_n + g0) * n, g_n * n, n, &ctx,
                              acc.data() + (i * g_n + g0) * HD, g_n * HD);
    }
  };
  if constexpr (G > 0) {
    values(std::integral_constant<int, G>(), int64_t{0});
  } else {
    for (int64_t g0 = 0; g0 < g_n;) {
      const int64_t rem = g_n - g0;
      if (rem >= 4) { values(std::integral_constant<int, 4>(), g0); g0 += 4; }
      else if (rem >= 2) { values(std::integral_constant<int, 2>(), g0); g0 += 2; }
      else { values(std::integral_constant<int, 1>(), g0); g0 += 1; }
    }
  }
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t r = i * g_n + g;
      float* o = op + ((t0 + i) * num_heads + h * group + g) * HD;
      for (int64_t d = 0; d < HD; ++d) o[d] = acc[r * HD + d] * inv_sum[r];
    }
}
#endif

// paged_attention_quantized's work over raw pointers, its arguments checked (the fused decode
// step calls it too): q float32 [T, num_heads, D] -> out float32 [T, num_heads, D].
static void quantized_attention(const float* qp, const uint8_t* kc, const uint8_t* vc, const c10::Half* ks,
                                const c10::Half* vs, const float* lp, int64_t code_format, const int64_t* tp,
                                int64_t width, const int32_t* sp, const int32_t* cp, int64_t num_reqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size, float scale,
                                float* op) {
  const int64_t group = num_heads / num_kv_heads;
  constexpr int64_t QB = 16;  // query tokens per work item (they share one dequantization)
  // Work items: (request, KV head, block of QB query tokens), longest first (a causal chunk's
  // last block sees its whole context, its first only the cached prefix), handed out one at a
  // time: split into contiguous ranges, one thread got a long prompt's expensive end.
  struct QItem { int64_t r, i0, h, cost; };
  std::vector<QItem> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = sp[r + 1] - sp[r];
    for (int64_t i = 0; i < q_len; i += QB) {
      const int64_t tokens = std::min(QB, q_len - i), keys = cp[r] - q_len + i + tokens;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({r, i, h, tokens * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const QItem& a, const QItem& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  with_shape<float>(D, group, [&](auto hd, auto g) {
    constexpr int HD = decltype(hd)::value, G = decltype(g)::value;
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
      std::vector<float> kbuf, vbuf, qf, scores, row, acc, inv_sum;
      std::vector<const uint8_t*> krow, vrow;
      std::vector<float> kscale, vscale;
      for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
        const int64_t h = items[item].h, r = items[item].r, i0 = items[item].i0;
        const int64_t q_len = sp[r + 1] - sp[r], i1 = std::min(q_len, i0 + QB);
        const int64_t first = cp[r] - q_len;  // position of query token 0
        const int64_t n = first + i1;         // keys the item's last token sees
#if defined(KVFLOW_HAS_CODE_ROWS)
        if constexpr (HD > 0 && HD % 16 == 0) {
          if (code_format == CODES_INT8 || code_format == CODES_FP8_E4M3) {
            // Every token (a decode's one, a prefill chunk's several) straight from the codes:
            // the rows' addresses and scales, then quantized_item over them.
            krow.resize(n); vrow.resize(n); kscale.resize(n); vscale.resize(n);
            const int64_t* table = tp + r * width;
            for (int64_t b = 0, t = 0; t < n; ++b) {
              const int64_t slot0 = table[b] * block_size, rows = std::min(block_size, n - t);
              for (int64_t o = 0; o < rows; ++o, ++t) {
                const int64_t at = (slot0 + o) * num_kv_heads + h;
                krow[t] = kc + at * D; vrow[t] = vc + at * D;
                kscale[t] = static_cast<float>(ks[at]); vscale[t] = static_cast<float>(vs[at]);
              }
            }
            auto run = [&](auto fmt) {
              constexpr int F = decltype(fmt)::value;
              quantized_item<HD, G>(qp, CodeRows<F>{krow.data(), kscale.data()}, CodeRows<F>{vrow.data(), vscale.data()},
                                    first, i0, i1, sp[r] + i0, num_heads, h, group, scale, op, qf, scores, acc, inv_sum);
            };
            if (code_format == CODES_INT8) run(std::integral_constant<int, CODES_INT8>());
            else run(std::integral_constant<int, CODES_FP8_E4M3>());
            continue;
          }
        }
#endif
        kbuf.resize(n * D);
        vbuf.resize(n * D);
        dequant_rows(kc, ks, lp, code_format, tp + r * width, block_size, num_kv_heads, D, h, n, kbuf.data());
        dequant_rows(vc, vs, lp, code_format, tp + r * width, block_size, num_kv_heads, D, h, n, vbuf.data());
#if defined(KVFLOW_HAS_SCORES16) && defined(KVFLOW_HAS_VALUES_MULTI)
        if constexpr (HD > 0 && HD % 16 == 0) {
          if (i1 - i0 > 1) {  // a prefill chunk's tokens together, each as its own decode
            quantized_item<HD, G>(qp, FloatRows{kbuf.data(), HD}, FloatRows{vbuf.data(), HD}, first, i0, i1,
                                  sp[r] + i0, num_heads, h, group, scale, op, qf, scores, acc, inv_sum);
            continue;
          }
        }
#endif
        const int64_t zero = 0;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t t = sp[r] + i;
          decode_item<float, HD, G>(qp + (t * num_heads + h * group) * D, kbuf.data(), vbuf.data(), &zero,
                                    first + i + 1, op + (t * num_heads + h * group) * D, D, group, n, D, 0, 1,
                                    scale, D, D, qf, scores, row, acc, inv_sum);
        }
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Prefill / chunked-prefill attention over a float paged cache (FlashAttention-2 tiling, Dao 2023,
// arXiv 2307.08691, section 3.1: a tile of queries stays resident while the keys stream past in
// tiles, with an online softmax: a running row maximum m, row sum l and unnormalized output O,
// O rescaled by exp(m_old - m_new) whenever m grows, divided by l once at the end).
//
// Work item: (request, KV head, tile of query tokens). The tile's rows are the (token, query head)
// pairs of the `group` query heads sharing the KV head (GQA / MQA), token-major; their queries are
// held transposed, Qt [D, R] (R = rows rounded up to the vector width), so that both products
// vectorize across rows without transposing any key:
//   scores   St[j, r] = sum_d k_j[d] * Qt[d, r]          (a key element broadcast, a Qt row loaded)
//   softmax  per row r, across j: vertical max / exp / sum over St's rows (no horizontal reductions)
//   values   O[r, :] += sum_j St[j, r] * v_j[:]          (a weight broadcast, a value row loaded)
// Keys and values are read straight from the paged cache through the block table (float32: in
// place; bfloat16 with AVX512-BF16: keys in place, scores by vdpbf16ps, and the value product
// two keys per vdpbf16ps, P rounded to bfloat16 as FlashAttention-2 does; other bfloat16: one
// key tile and one value tile widened to float32 per step). Per item the working set is Qt, O
// (R x D each), St (KT x R) and the two tiles: ~80 KB for R = 128, D = 64, inside L2. Sums and
// the softmax are float32; the output is rounded to q's dtype once.
// Causal with the chunk's offset: query token i of a request with q_len new tokens and ctx cached
// tokens (this step's included) sits at position ctx - q_len + i and sees keys j <= that position,
// and, with a sliding window W, only keys j > position - W. Only the tiles that straddle one of
// those edges are masked element by element; a key tile is never loaded beyond the tile's last
// query position or before its first one's window.
// ---------------------------------------------------------------------------------------------
namespace prefill {

constexpr int L = VecF::L;
constexpr int KT = 32;  // keys per tile
constexpr int JB = 4;   // keys per register block of the score product
// Register blocks: the score product holds JB x NV accumulators, the value product RB x DV.
#if defined(__AVX512F__)
constexpr int NV = 2, RB = 4, DV = 4;
#else
constexpr int NV = 2, RB = 2, DV = 4;
#endif

// St[j, r0 + ...] (NVc vectors of rows) for keys j0 .. j0 + JB - 1.
template <int NVc>
static inline void score_block(const float* Qt, int64_t R, int64_t r0, const float* const* kp, int64_t j0,
                               int64_t D, float* St) {
  VecF acc[JB][NVc];
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NVc; ++v) acc[j][v] = VecF::set1(0.f);
  const float* k0 = kp[j0];
  const float* k1 = kp[j0 + 1];
  const float* k2 = kp[j0 + 2];
  const float* k3 = kp[j0 + 3];
  for (int64_t d = 0; d < D; ++d) {
    VecF qv[NVc];
    for (int v = 0; v < NVc; ++v) qv[v] = VecF::load(Qt + d * R + r0 + v * L);
    const VecF b0 = VecF::set1(k0[d]), b1 = VecF::set1(k1[d]), b2 = VecF::set1(k2[d]), b3 = VecF::set1(k3[d]);
    for (int v = 0; v < NVc; ++v) {
      acc[0][v] = VecF::fma(b0, qv[v], acc[0][v]);
      acc[1][v] = VecF::fma(b1, qv[v], acc[1][v]);
      acc[2][v] = VecF::fma(b2, qv[v], acc[2][v]);
      acc[3][v] = VecF::fma(b3, qv[v], acc[3][v]);
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NVc; ++v) acc[j][v].store(St + (j0 + j) * R + r0 + v * L);
}

#if defined(__AVX512BF16__)
// score_block for bfloat16 q and k with AVX512-BF16: Qp [D / 2, R] the query rows' bfloat16
// pairs (q[2p], q[2p + 1]) as dwords, unscaled; kp the keys' bfloat16 rows in the cache (no
// widened copy); vdpbf16ps multiplies the pairs exactly into float32 sums, scaled at the end.
// St[j, r] = scale * (q_r . k_j): the products as the float32 path's, added in another order.
template <int NVc>
static inline void score_block_bf16(const uint32_t* Qp, int64_t R, int64_t r0, const uint16_t* const* kp, int64_t j0,
                                    int64_t D, float scale, float* St) {
  __m512 acc[JB][NVc];
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NVc; ++v) acc[j][v] = _mm512_setzero_ps();
  const uint16_t* k0 = kp[j0];
  const uint16_t* k1 = kp[j0 + 1];
  const uint16_t* k2 = kp[j0 + 2];
  const uint16_t* k3 = kp[j0 + 3];
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh qv[NVc];
    for (int v = 0; v < NVc; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(Qp + p * R + r0 + v * L);
    uint32_t w0, w1, w2, w3;
    std::memcpy(&w0, k0 + 2 * p, 4);
    std::memcpy(&w1, k1 + 2 * p, 4);
    std::memcpy(&w2, k2 + 2 * p, 4);
    std::memcpy(&w3, k3 + 2 * p, 4);
    const __m512bh b0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w0));
    const __m512bh b1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w1));
    const __m512bh b2 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2));
    const __m512bh b3 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w3));
    for (int v = 0; v < NVc; ++v) {
      acc[0][v] = _mm512_dpbf16_ps(acc[0][v], qv[v], b0);
      acc[1][v] = _mm512_dpbf16_ps(acc[1][v], qv[v], b1);
      acc[2][v] = _mm512_dpbf16_ps(acc[2][v], qv[v], b2);
      acc[3][v] = _mm512_dpbf16_ps(acc[3][v], qv[v], b3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < JB; ++j)
    for (int v = 0; v < NVc; ++v) _mm512_storeu_ps(St + (j0 + j) * R + r0 + v * L, _mm512_mul_ps(acc[j][v], sc));
}
#endif

// O[r0 .. r0 + RB - 1, d0 .. d0 + DVc * L - 1] += sum_j St[j, r] * v_j[d].
template <int DVc>
static inline void value_block(const float* St, int64_t R, int64_t r0, const float* const* vp, int64_t n,
                               float* O, int64_t D, int64_t d0) {
  VecF acc[RB][DVc];
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DVc; ++v) acc[i][v] = VecF::load(O + (r0 + i) * D + d0 + v * L);
  for (int64_t j = 0; j < n; ++j) {
    VecF vv[DVc];
    for (int v = 0; v < DVc; ++v) vv[v] = VecF::load(vp[j] + d0 + v * L);
    const float* p = St + j * R + r0;
    for (int i = 0; i < RB; ++i) {
      const VecF pi = VecF::set1(p[i]);
      for (int v = 0; v < DVc; ++v) acc[i][v] = VecF::fma(pi, vv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DVc; ++v) acc[i][v].store(O + (r0 + i) * D + d0 + v * L);
}

#if defined(__AVX512BF16__)
// value_block for bfloat16 values with AVX512-BF16, two keys per vdpbf16ps: Pp [KT / 2, R] the
// tile's softmax weights of keys (2 i, 2 i + 1) for row r as a bfloat16 pair (rounded to nearest
// even: FlashAttention-2's P in the value product's precision, Dao 2023, algorithm 1 line 10),
// Vp [KT / 2, D] the values of the same two keys for dimension d as a pair (exact: the cache
// holds bfloat16). Products exact, float32 sums. O[r0 .. r0 + RB - 1, d0 ...] += P V.
template <int DVc>
static inline void value_block_bf16(const uint32_t* Pp, int64_t R, int64_t r0, const uint32_t* Vp, int64_t pairs,
                                    float* O, int64_t D, int64_t d0) {
  __m512 acc[RB][DVc];
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DVc; ++v) acc[i][v] = _mm512_loadu_ps(O + (r0 + i) * D + d0 + v * L);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vv[DVc];
    for (int v = 0; v < DVc; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(Vp + jp * D + d0 + v * L);
    const uint32_t* p = Pp + jp * R + r0;
    for (int i = 0; i < RB; ++i) {
      const __m512bh pi = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[i]));
      for (int v = 0; v < DVc; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pi, vv[v]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DVc; ++v) _mm512_storeu_ps(O + (r0 + i) * D + d0 + v * L, acc[i][v]);
}

// dst[d] = a[d] | b[d] << 16 for d < D (16 at a time; D a multiple of 16): two bfloat16 rows
// as the dword pairs vdpbf16ps takes.
static inline void pair_rows(const uint16_t* a, const uint16_t* b, uint32_t* dst, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
    _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// The same for two float32 rows of n values (n a multiple of 16), each rounded to bfloat16.
static inline void pair_rows(const float* a, const float* b, uint32_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + i)));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + i)));
    _mm512_storeu_si512(dst + i, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}
#endif

static inline void widen_row(const float* src, float* dst, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
static inline void widen_row(const c10::BFloat16* src, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Scratch {
  std::vector<float> qt, o, st, m, l, alpha, kbuf, vbuf;
  std::vector<const float*> kp, vp;
  std::vector<uint32_t> qp;         // bfloat16 query pairs (score_block_bf16)
  std::vector<const uint16_t*> kb, vb;  // bfloat16 key / value rows in the cache
  std::vector<uint32_t> pp, vpair;       // bfloat16 pairs of P and V (value_block_bf16)
};

struct Item {
  int64_t req, head, t0, t1, cost;
};

// One work item: query tokens t0 .. t1 - 1 of request `req` (rows of q from `q_first`), KV head h.
template <typename T>
static void prefill_item(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k_cache, const T* v_cache,
                         const int64_t* table, int64_t ctx, int64_t q_len, int64_t t0, int64_t t1, int64_t h,
                         int64_t group, int64_t D, int64_t block_size, int64_t num_kv_heads, int64_t window,
                         float scale, T* out, int64_t o_stride_t, int64_t o_stride_h, Scratch& s) {
  const int64_t rows = (t1 - t0) * group;
  const int64_t R = (rows + L - 1) / L * L;
#if defined(__AVX512BF16__)
  // bfloat16 scores by vdpbf16ps (score_block_bf16): the keys read from the cache as stored
  constexpr bool BF = std::is_same<T, c10::BFloat16>::value;
#else
  constexpr bool BF = false;
#endif
  if constexpr (BF) {
    s.qp.assign(D / 2 * R, 0u);
    s.kb.resize(KT);
    s.vb.resize(KT);
    s.pp.resize(KT / 2 * R);
    s.vpair.resize(KT / 2 * D);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* qr = reinterpret_cast<const uint16_t*>(q + (t0 + r / group) * q_stride_t + (h * group + r % group) * q_stride_h);
      for (int64_t p = 0; p < D / 2; ++p)
        s.qp[p * R + r] = static_cast<uint32_t>(qr[2 * p]) | static_cast<uint32_t>(qr[2 * p + 1]) << 16;
    }
  } else {
    s.qt.assign(D * R, 0.f);
  }
  s.o.assign(R * D, 0.f);
  s.st.resize(KT * R);
  s.m.assign(R, -INFINITY);
  s.l.assign(R, 0.f);
  s.alpha.resize(R);
  s.kp.resize(KT);
  s.vp.resize(KT);
  constexpr bool widen = !std::is_same<T, float>::value && !BF;
  if (widen) {
    s.kbuf.resize(KT * D);
    s.vbuf.resize(KT * D);
  }
  for (int64_t r = 0; r < rows && !BF; ++r) {
    const T* qr = q + (t0 + r / group) * q_stride_t + (h * group + r % group) * q_stride_h;
    for (int64_t d = 0; d < D; ++d) s.qt[d * R + r] = static_cast<float>(qr[d]) * scale;
  }
  const int64_t first_pos = ctx - q_len + t0;  // position of the tile's first query token
  const int64_t last_pos = ctx - q_len + t1 - 1;
  const int64_t key_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t key_end = last_pos + 1;
  const int64_t slot_stride = num_kv_heads * D;
  float* St = s.st.data();
  for (int64_t kt = key_begin; kt < key_end; kt += KT) {
    const int64_t n = std::min<int64_t>(KT, key_end - kt);
    const int64_t npad = (n + JB - 1) / JB * JB;
    for (int64_t j = 0; j < npad; ++j) {
      const int64_t key = kt + std::min(j, n - 1);  // padding keys repeat the last one (masked)
      const int64_t offset = (table[key / block_size] * block_size + key % block_size) * slot_stride + h * D;
      if constexpr (BF) {
        s.kb[j] = reinterpret_cast<const uint16_t*>(k_cache + offset);
        s.vb[j] = reinterpret_cast<const uint16_t*>(v_cache + offset);
      } else if constexpr (widen) {
        if (j < n) {
          widen_row(k_cache + offset, s.kbuf.data() + j * D, D);
          widen_row(v_cache + offset, s.vbuf.data() + j * D, D);
        }
        s.kp[j] = s.kbuf.data() + std::min(j, n - 1) * D;
        s.vp[j] = s.vbuf.data() + std::min(j, n - 1) * D;
      } else {
        s.kp[j] = reinterpret_cast<const float*>(k_cache + offset);
        s.vp[j] = reinterpret_cast<const float*>(v_cache + offset);
      }
    }
    // Scores of the tile.
    for (int64_t j0 = 0; j0 < npad; j0 += JB) {
      int64_t r0 = 0;
#if defined(__AVX512BF16__)
      if constexpr (BF) {
        for (; r0 + NV * L <= R; r0 += NV * L) score_block_bf16<NV>(s.qp.data(), R, r0, s.kb.data(), j0, D, scale, St);
        for (; r0 < R; r0 += L) score_block_bf16<1>(s.qp.data(), R, r0, s.kb.data(), j0, D, scale, St);
        continue;
      }
#endif
      for (; r0 + NV * L <= R; r0 += NV * L) score_block<NV>(s.qt.data(), R, r0, s.kp.data(), j0, D, St);
      for (; r0 < R; r0 += L) score_block<1>(s.qt.data(), R, r0, s.kp.data(), j0, D, St);
    }
    // Masks: causal (key > query position), window (key <= position - W), padding keys.
    const bool causal_edge = kt + n - 1 > first_pos;
    const bool window_edge = window > 0 && kt <= last_pos - window;
    // Rows are token-major (row r is token t0 + r / group), so for key `key` the rows that
    // may not see it are a prefix (causal: first_pos + r / group < key) and a suffix (window:
    // first_pos + r / group >= key + W): two fills, no division per element.
    if (causal_edge || window_edge || npad > n) {
      for (int64_t j = 0; j < npad; ++j) {
        const int64_t key = kt + j;
        float* sj = St + j * R;
        if (j >= n) {
          std::fill(sj, sj + rows, -INFINITY);
          continue;
        }
        const int64_t causal_end = std::clamp<int64_t>((key - first_pos) * group, 0, rows);
        std::fill(sj, sj + causal_end, -INFINITY);
        if (window > 0) {
          const int64_t window_begin = std::clamp<int64_t>((key + window - first_pos) * group, 0, rows);
          std::fill(sj + window_begin, sj + rows, -INFINITY);
        }
      }
    }
    // Online softmax, vertically across the tile's keys for each vector of rows.
    for (int64_t r0 = 0; r0 < R; r0 += L) {
      VecF mx = VecF::load(St + r0);
      for (int64_t j = 1; j < npad; ++j) mx = VecF::max(mx, VecF::load(St + j * R + r0));
      const VecF m_old = VecF::load(s.m.data() + r0);
      const VecF m_new = VecF::max(m_old, mx);
      const VecF m_use = VecF::finite_or_zero(m_new);
      const VecF alpha = VecF::exp_neg(VecF::sub(m_old, m_use));
      VecF sum = VecF::set1(0.f);
      for (int64_t j = 0; j < npad; ++j) {
        const VecF p = VecF::exp_neg(VecF::sub(VecF::load(St + j * R + r0), m_use));
        p.store(St + j * R + r0);
        sum = VecF::add(sum, p);
      }
      VecF::fma(VecF::load(s.l.data() + r0), alpha, sum).store(s.l.data() + r0);
      m_new.store(s.m.data() + r0);
      alpha.store(s.alpha.data() + r0);
    }
    // O *= alpha (per row), then O += P V.
    for (int64_t r = 0; r < rows; ++r) {
      const VecF a = VecF::set1(s.alpha[r]);
      float* orow = s.o.data() + r * D;
      for (int64_t d = 0; d < D; d += L) VecF::mul(VecF::load(orow + d), a).store(orow + d);
    }
    const int64_t rows_rb = (rows + RB - 1) / RB * RB;  // <= R: R is a multiple of L, L of RB
#if defined(__AVX512BF16__)
    if constexpr (BF) {  // keys in pairs (npad is even; a padding key's weight is 0)
      const int64_t pairs = npad / 2;
      for (int64_t jp = 0; jp < pairs; ++jp) {
        pair_rows(St + 2 * jp * R, St + (2 * jp + 1) * R, s.pp.data() + jp * R, R);
        pair_rows(s.vb[2 * jp], s.vb[2 * jp + 1], s.vpair.data() + jp * D, D);
      }
      for (int64_t r0 = 0; r0 < rows_rb; r0 += RB) {
        int64_t d0 = 0;
        for (; d0 + DV * L <= D; d0 += DV * L) value_block_bf16<DV>(s.pp.data(), R, r0, s.vpair.data(), pairs, s.o.data(), D, d0);
        for (; d0 < D; d0 += L) value_block_bf16<1>(s.pp.data(), R, r0, s.vpair.data(), pairs, s.o.data(), D, d0);
      }
      continue;
    }
#endif
    for (int64_t r0 = 0; r0 < rows_rb; r0 += RB) {
      int64_t d0 = 0;
      for (; d0 + DV * L <= D; d0 += DV * L) value_block<DV>(St, R, r0, s.vp.data(), npad, s.o.data(), D, d0);
      for (; d0 < D; d0 += L) value_block<1>(St, R, r0, s.vp.data(), npad, s.o.data(), D, d0);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* orow = out + (t0 + r / group) * o_stride_t + (h * group + r % group) * o_stride_h;
    const float inv = 1.f / s.l[r];
    const float* src = s.o.data() + r * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(src[d] * inv);
  }
}

}  // namespace prefill

// Causal attention of every query token of one or more requests (prefill chunks) over the float
// paged cache; writes `out` and returns it. See kvflow/layers/cpu_attention.py,
// paged_prefill_attention, for the contract.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor context_lens, double scale, int64_t sliding_window,
                                      torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q: [T, heads, D], caches: [blocks, block_size, kv_heads, D]");
  TORCH_CHECK((q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16) &&
              k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "q, the caches and out must share a dtype, float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1 && out.stride(2) == 1 &&
              out.sizes() == q.sizes(), "layout: contiguous caches, q and out [T, heads, D] with contiguous rows");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && query_start_loc.scalar_type() == torch::kInt32 &&
              context_lens.scalar_type() == torch::kInt32, "index dtypes: int64 block_tables, int32 query_start_loc "
              "and context_lens");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && k_cache.size(3) == D, "heads");
  TORCH_CHECK(D % prefill::L == 0, "head_dim must be a multiple of ", prefill::L);
  auto tables = block_tables.contiguous();
  auto starts = query_start_loc.contiguous();
  auto ctx = context_lens.contiguous();
  const int64_t num_reqs = ctx.numel();
  TORCH_CHECK(starts.numel() == num_reqs + 1 && tables.dim() == 2 && tables.size(0) >= num_reqs, "metadata rows");
  const int64_t width = tables.size(1);
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[num_reqs] <= num_tokens, "query_start_loc must start at 0 and end within q");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = sp[r + 1] - sp[r];
    TORCH_CHECK(q_len >= 0 && cp[r] >= q_len && cp[r] <= width * block_size, "context_lens[", r, "] = ", cp[r],
                " does not fit its ", q_len, " query tokens and block table");
    for (int64_t b = 0; b < (cp[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < num_blocks, "block_tables[", r, ", ", b,
                  "] = ", tp[r * width + b], " is not a block of the cache (", num_blocks, " blocks)");
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t threads = at::get_num_threads();
  // Query tokens per tile: about 128 rows (token x group head), fewer when the items would not
  // keep the threads busy (at least 4 items per thread), never under 8 tokens.
  int64_t tile = std::max<int64_t>(8, std::min<int64_t>(64, 128 / group));
  auto count_items = [&](int64_t t) {
    int64_t n = 0;
    for (int64_t r = 0; r < num_reqs; ++r) n += (sp[r + 1] - sp[r] + t - 1) / t;
    return n * num_kv_heads;
  };
  while (tile > 8 && count_items(tile) < 4 * threads) tile /= 2;
  std::vector<prefill::Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = sp[r + 1] - sp[r];
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t t1 = std::min(q_len, t0 + tile);
      const int64_t last = cp[r] - q_len + t1;  // keys the tile's last token sees
      const int64_t keys = sliding_window > 0 ? std::min(last, sliding_window + t1 - t0) : last;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({r, h, t0, t1, keys * (t1 - t0)});
    }
  }
  // Longest first, handed out one at a time (causal tiles differ in cost by up to the context length).
  std::stable_sort(items.begin(), items.end(), [](const prefill::Item& a, const prefill::Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const float fscale = static_cast<float>(scale);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const T* kc = reinterpret_cast<const T*>(k_cache.data_ptr());
    const T* vc = reinterpret_cast<const T*>(v_cache.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
      prefill::Scratch scratch;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const prefill::Item& it = items[i];
        const int64_t q_len = sp[it.req + 1] - sp[it.req];
        prefill::prefill_item<T>(qp + sp[it.req] * q.stride(0), q.stride(0), q.stride(1), kc, vc, tp + it.req * width,
                        cp[it.req], q_len, it.t0, it.t1, it.head, group, D, block_size, num_kv_heads,
                        sliding_window, fscale, op + sp[it.req] * out.stride(0), out.stride(0), out.stride(1),
                        scratch);
      }
    });
  };
  if (q.scalar_type() == torch::kFloat32) run(float{});
  else run(c10::BFloat16{});
  return out;
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py);
// left out where fused_decode.cpp includes this file for its routines.
#ifndef KVFLOW_NO_BINDINGS
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", torch::wrap_pybind_function_no_gil(paged_decode_attention), "paged_decode_attention");
  m.def("paged_attention_quantized", torch::wrap_pybind_function_no_gil(paged_attention_quantized), "paged_attention_quantized");
  m.def("paged_prefill_attention", torch::wrap_pybind_function_no_gil(paged_prefill_attention), "paged_prefill_attention");
}
#endif  // KVFLOW_NO_BINDINGS
