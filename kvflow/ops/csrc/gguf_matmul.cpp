// kvflow C++ CPU kernel: y = x W^T with W stored as GGUF quantized blocks (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), computed as llama.cpp does: activations quantized once per
// call to int8 blocks of 32 (Q8_0 style, one float32 scale per block, block sums kept), then
// integer dot products of the activation block with the weight block's quantized values and
// float32 accumulation with the product of the scales.
// Python side and documentation (block layouts, accuracy, measurements): kvflow/layers/gguf_kernels.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).
//
// Integer products: every format's weight values are made unsigned bytes u (Q4: 0..15, Q5:
// 0..31, Q6_K: 0..63; Q8_0's signed values use llama.cpp's sign trick |w| * sign(a, w)), so one
// u8 x s8 product instruction serves all: AVX-512 VNNI vpdpbusd (256-bit, AVX512VL), AVX2
// vpmaddubsw + vpmaddwd (no saturation: |u| <= 63 or |w| <= 128 against |a| <= 127), else a
// portable loop. A format's constant offset (Q4_0's -8, Q5_0's -16, Q6_K's -32) and the
// minimums (Q4_1, Q5_1, Q4_K, Q5_K) multiply the activation block's sum (kept per 16 elements,
// times its scale), so that term is one scalar multiply-add per block.

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GG_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define GG_VNNI 1
#endif
#endif

namespace {

// n elements, not initialized (new T[n] default-initializes: no zero fill).
template <typename T>
std::unique_ptr<T[]> uninit(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
}

// GGML type ids (ggml.h's enum ggml_type).
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(GG_AVX2)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The quantized activations of M rows: q int8 [M, K]; d the block scales [M, K/32]; s16 the
// scaled sums d * sum(q) per 16 elements [M, K/16]; s32 the same per 32 [M, K/32]; where
// asked for, i16 the integer sums sum(q) per 16 elements [M, K/16].
struct Act {
  const int8_t* q;
  const float* d;
  const float* s16;
  const float* s32;
  int64_t K;
};

#if defined(GG_AVX2)
// Eight consecutive values as float32 (bfloat16: the upper half of a float32, exact).
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#endif

// One activation row per task of 8 rows; per 32-block the largest magnitude, the scale
// amax / 127 and round(x 127 / amax) (round to nearest even), vectorized where the CPU has
// AVX2 (the same values as the scalar loop: a maximum and the same float operations).
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s16, float* s32,
                   int32_t* i16 = nullptr) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] float buf[32];  // the scalar loop's copy of a block
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * ldx;
      for (int64_t b = 0; b < nb; ++b) {
#if defined(GG_AVX2)
        // The block's 32 values in four vectors, their largest magnitude (exact: a maximum).
        __m256 xv[4];
        for (int c = 0; c < 4; ++c) xv[c] = load8f(xr + b * 32 + 8 * c);
        const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(xv[0], nosign), _mm256_and_ps(xv[1], nosign)),
                                  _mm256_max_ps(_mm256_and_ps(xv[2], nosign), _mm256_and_ps(xv[3], nosign)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
#else
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) {
          buf[i] = static_cast<float>(xr[b * 32 + i]);
          amax = std::max(amax, std::fabs(buf[i]));
        }
#endif
        const float db = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* qb = q + m * K + b * 32;
        int sum[2] = {0, 0};
#if defined(GG_AVX2)
        __m256i iv[4];
        for (int c = 0; c < 4; ++c)
          iv[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(xv[c], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (int h = 0; h < 2; ++h) {
          const __m256i s = _mm256_add_epi32(iv[2 * h], iv[2 * h + 1]);
          __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
          t = _mm_hadd_epi32(t, t);
          t = _mm_hadd_epi32(t, t);
          sum[h] = _mm_cvtsi128_si32(t);
        }
        const __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]), p23 = _mm256_packs_epi32(iv[2], iv[3]);
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
#else
        for (int i = 0; i < 32; ++i) {
          const int v = static_cast<int>(std::nearbyint(buf[i] * id));
          qb[i] = static_cast<int8_t>(v);
          sum[i / 16] += v;
        }
#endif
        d[m * nb + b] = db;
        s16[m * 2 * nb + 2 * b] = db * static_cast<float>(sum[0]);
        s16[m * 2 * nb + 2 * b + 1] = db * static_cast<float>(sum[1]);
        s32[m * nb + b] = db * static_cast<float>(sum[0] + sum[1]);
        if (i16) {
          i16[m * 2 * nb + 2 * b] = sum[0];
          i16[m * 2 * nb + 2 * b + 1] = sum[1];
        }
      }
    }
  });
}

#if defined(GG_AVX2)
using U32 = __m256i;
inline __m256i nib_lo_hi(const uint8_t* p) {  // 16 bytes -> 16 low nibbles, then 16 high nibbles
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
}
inline __m256i bits32(const uint8_t* p) {  // 32 bits -> 32 bytes, 0x10 where the bit is set
  uint32_t v;
  std::memcpy(&v, p, 4);
#if defined(GG_VNNI)
  return _mm256_maskz_set1_epi8(static_cast<__mmask32>(v), 0x10);
#else
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(v)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}
#define GG_LOAD(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#define GG_AND(a, b) _mm256_and_si256(a, b)
#define GG_OR(a, b) _mm256_or_si256(a, b)
#define GG_SRL(a, s) _mm256_srli_epi16(a, s)
#define GG_SLL(a, s) _mm256_slli_epi16(a, s)
#define GG_SET1(v) _mm256_set1_epi8(static_cast<char>(v))
#else
struct U32 {
  uint8_t v[32];
};
inline U32 nib_lo_hi(const uint8_t* p) {
  U32 r;
  for (int i = 0; i < 16; ++i) {
    r.v[i] = p[i] & 0x0F;
    r.v[i + 16] = p[i] >> 4;
  }
  return r;
}
inline U32 bits32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  U32 r;
  for (int i = 0; i < 32; ++i) r.v[i] = ((v >> i) & 1) << 4;
  return r;
}
inline U32 GG_LOAD_(const uint8_t* p) {
  U32 r;
  std::memcpy(r.v, p, 32);
  return r;
}
inline U32 GG_AND(U32 a, U32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] &= b.v[i];
  return a;
}
inline U32 GG_OR(U32 a, U32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
  return a;
}
inline U32 GG_SRL(U32 a, int s) {  // per byte (the callers mask what crosses bytes in SIMD)
  for (int i = 0; i < 32; ++i) a.v[i] = static_cast<uint8_t>(a.v[i] >> s);
  return a;
}
inline U32 GG_SLL(U32 a, int s) {
  for (int i = 0; i < 32; ++i) a.v[i] = static_cast<uint8_t>(a.v[i] << s);
  return a;
}
inline U32 GG_SET1(int v) {
  U32 r;
  std::memset(r.v, v, 32);
  return r;
}
#define GG_LOAD(p) GG_LOAD_(reinterpret_cast<const uint8_t*>(p))
#endif

// ---------------------------------------------------------------------------------------
// Per format: block(w, b, u, s0, s1, c0, c1) decodes the 32-element sub-block b of one stored
// row w: u its unsigned quantized values (or, SIGNED, Q8_0's int8 values), s0 / s1 the weight
// scale of its two 16-element halves (equal unless PER16) and c0 / c1 their offset
// coefficients. The row's dot product with an activation row is
//   sum_b [ da_b (s0 <u, a>_0..15 + s1 <u, a>_16..31) + c0 s16_2b + c1 s16_2b+1 ]   (PER16)
//   sum_b [ da_b s0 <u, a> + c0 s32_b ]                                                (else)
// ---------------------------------------------------------------------------------------
struct FQ4_0 {
  static constexpr bool SIGNED = false, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    w += b * 18;
    s0 = s1 = fp16(w);
    c0 = c1 = -8.f * s0;
    u = nib_lo_hi(w + 2);
  }
};
struct FQ4_1 {
  static constexpr bool SIGNED = false, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    w += b * 20;
    s0 = s1 = fp16(w);
    c0 = c1 = fp16(w + 2);
    u = nib_lo_hi(w + 4);
  }
};
struct FQ5_0 {
  static constexpr bool SIGNED = false, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    w += b * 22;
    s0 = s1 = fp16(w);
    c0 = c1 = -16.f * s0;
    u = GG_OR(nib_lo_hi(w + 6), bits32(w + 2));
  }
};
struct FQ5_1 {
  static constexpr bool SIGNED = false, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    w += b * 24;
    s0 = s1 = fp16(w);
    c0 = c1 = fp16(w + 2);
    u = GG_OR(nib_lo_hi(w + 8), bits32(w + 4));
  }
};
struct FQ8_0 {
  static constexpr bool SIGNED = true, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    w += b * 34;
    s0 = s1 = fp16(w);
    c0 = c1 = 0.f;
    u = GG_LOAD(w + 2);
  }
};
template <bool FIVE>
struct FQK {  // Q4_K (FIVE = false) and Q5_K
  static constexpr bool SIGNED = false, PER16 = false;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    const int j = static_cast<int>(b & 7);
    w += (b >> 3) * (FIVE ? 176 : 144);
    int sc, mn;
    scale_min_k4(j, w + 4, sc, mn);
    s0 = s1 = fp16(w) * static_cast<float>(sc);
    c0 = c1 = -fp16(w + 2) * static_cast<float>(mn);
    const U32 v = GG_LOAD(w + (FIVE ? 48 : 16) + 32 * (j >> 1));
    u = GG_AND(j & 1 ? GG_SRL(v, 4) : v, GG_SET1(0x0F));
    if constexpr (FIVE) u = GG_OR(u, GG_SLL(GG_AND(GG_SRL(GG_LOAD(w + 16), j), GG_SET1(1)), 4));
  }
};
struct FQ6_K {
  static constexpr bool SIGNED = false, PER16 = true;
  static inline void block(const uint8_t* w, int64_t b, U32& u, float& s0, float& s1, float& c0, float& c1) {
    const int j = static_cast<int>(b & 7), h = j >> 2, jj = j & 3;
    w += (b >> 3) * 210;
    const float d = fp16(w + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192) + 2 * j;
    s0 = d * static_cast<float>(sc[0]);
    s1 = d * static_cast<float>(sc[1]);
    c0 = -32.f * s0;
    c1 = -32.f * s1;
    const U32 l = GG_LOAD(w + 64 * h + 32 * (jj & 1));
    const U32 lo = GG_AND(jj >= 2 ? GG_SRL(l, 4) : l, GG_SET1(0x0F));
    u = GG_OR(lo, GG_SLL(GG_AND(GG_SRL(GG_LOAD(w + 128 + 32 * h), 2 * jj), GG_SET1(3)), 4));
  }
};

// ---------------------------------------------------------------------------------------
// R weight rows against MR activation rows: res[r * MR + m] = <W row r, x row m0 + m>. The R x
// MR products are independent accumulation chains (one would wait on the latency of its
// multiply-add every block); each activation block is loaded once for the R rows.
// ---------------------------------------------------------------------------------------
#if defined(GG_AVX2)
inline __m256i dot_u8s8(__m256i u, __m256i a) {  // lane i: sum of the products of bytes 4i..4i+3
#if defined(GG_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <typename Fmt, int R, int MR>
inline void rows_dot(const uint8_t* const* w, const Act& a, int64_t m0, float* res) {
  const int64_t K = a.K, nb = K / 32;
  float off[R * MR];
  for (int i = 0; i < R * MR; ++i) off[i] = 0.f;
#if defined(GG_AVX2)
  __m256 acc[R * MR];
  for (int i = 0; i < R * MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i u[R];
    float s0[R], s1[R], c0[R], c1[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) Fmt::block(w[r], b, u[r], s0[r], s1[r], c0[r], c1[r]);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * K + b * 32));
      const float da = a.d[row * nb + b];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i p;
        if constexpr (Fmt::SIGNED) p = dot_u8s8(_mm256_sign_epi8(u[r], u[r]), _mm256_sign_epi8(av, u[r]));
        else p = dot_u8s8(u[r], av);
        __m256 sv;
        if constexpr (Fmt::PER16) sv = _mm256_set_m128(_mm_set1_ps(s1[r] * da), _mm_set1_ps(s0[r] * da));
        else sv = _mm256_set1_ps(s0[r] * da);
        acc[r * MR + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc[r * MR + m]);
        if constexpr (Fmt::PER16)
          off[r * MR + m] += c0[r] * a.s16[row * 2 * nb + 2 * b] + c1[r] * a.s16[row * 2 * nb + 2 * b + 1];
        else if constexpr (!Fmt::SIGNED)
          off[r * MR + m] += c0[r] * a.s32[row * nb + b];
      }
    }
  }
  for (int i = 0; i < R * MR; ++i) res[i] = hsum(acc[i]) + off[i];
#else
  float acc[R * MR];
  for (int i = 0; i < R * MR; ++i) acc[i] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      U32 u;
      float s0, s1, c0, c1;
      Fmt::block(w[r], b, u, s0, s1, c0, c1);
      for (int m = 0; m < MR; ++m) {
        const int64_t row = m0 + m;
        const int8_t* ap = a.q + row * K + b * 32;
        int32_t p0 = 0, p1 = 0;
        for (int i = 0; i < 16; ++i) {
          const int w0 = Fmt::SIGNED ? static_cast<int8_t>(u.v[i]) : u.v[i];
          const int w1 = Fmt::SIGNED ? static_cast<int8_t>(u.v[i + 16]) : u.v[i + 16];
          p0 += w0 * ap[i];
          p1 += w1 * ap[i + 16];
        }
        const float da = a.d[row * nb + b];
        acc[r * MR + m] += da * (s0 * static_cast<float>(p0) + s1 * static_cast<float>(p1));
        if constexpr (Fmt::PER16)
          off[r * MR + m] += c0 * a.s16[row * 2 * nb + 2 * b] + c1 * a.s16[row * 2 * nb + 2 * b + 1];
        else if constexpr (!Fmt::SIGNED)
          off[r * MR + m] += c0 * a.s32[row * nb + b];
      }
    }
  }
  for (int i = 0; i < R * MR; ++i) res[i] = acc[i] + off[i];
#endif
}

constexpr int64_t NTILE = 16;  // weight rows per task: their blocks stay in L2 across the row groups
constexpr int MROWS = 4;       // activation rows per pass over a group of weight rows

template <typename Fmt, int R, int MR, typename OutT>
inline void tile_rows(const uint8_t* w, int64_t ldw, const Act& a, int64_t m0, int64_t n0, int64_t n1,
                      const float* bias, OutT* y, int64_t ldy) {
  float res[R * MR];
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = w + std::min(n + r, n1 - 1) * ldw;  // spare lanes repeat a row
    rows_dot<Fmt, R, MR>(rows, a, m0, res);
    for (int r = 0; r < R && n + r < n1; ++r) {
      const float bn = bias ? bias[n + r] : 0.f;
      for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy + n + r] = static_cast<OutT>(res[r * MR + m] + bn);
    }
  }
}

template <typename Fmt, typename OutT>
void run(const uint8_t* w, int64_t ldw, const Act& a, int64_t M, int64_t N, const float* bias, OutT* y, int64_t ldy) {
  const int64_t tiles = (N + NTILE - 1) / NTILE;
  const int64_t tile_bytes = std::max<int64_t>(1, NTILE * ldw);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / tile_bytes);  // >= ~32 KB of weight per task
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NTILE, n1 = std::min(N, n0 + NTILE);
      for (int64_t m0 = 0; m0 < M; m0 += MROWS) {
        switch (std::min<int64_t>(MROWS, M - m0)) {
          case 1: tile_rows<Fmt, 4, 1>(w, ldw, a, m0, n0, n1, bias, y, ldy); break;
          case 2: tile_rows<Fmt, 4, 2>(w, ldw, a, m0, n0, n1, bias, y, ldy); break;
          case 3: tile_rows<Fmt, 2, 3>(w, ldw, a, m0, n0, n1, bias, y, ldy); break;
          default: tile_rows<Fmt, 2, 4>(w, ldw, a, m0, n0, n1, bias, y, ldy); break;
        }
      }
    }
  });
}

template <typename OutT>
void dispatch(int qtype, const uint8_t* w, int64_t ldw, const Act& a, int64_t M, int64_t N, const float* bias, OutT* y,
              int64_t ldy) {
  switch (qtype) {
    case Q4_0: return run<FQ4_0>(w, ldw, a, M, N, bias, y, ldy);
    case Q4_1: return run<FQ4_1>(w, ldw, a, M, N, bias, y, ldy);
    case Q5_0: return run<FQ5_0>(w, ldw, a, M, N, bias, y, ldy);
    case Q5_1: return run<FQ5_1>(w, ldw, a, M, N, bias, y, ldy);
    case Q8_0: return run<FQ8_0>(w, ldw, a, M, N, bias, y, ldy);
    case Q4_K: return run<FQK<false>>(w, ldw, a, M, N, bias, y, ldy);
    case Q5_K: return run<FQK<true>>(w, ldw, a, M, N, bias, y, ldy);
    case Q6_K: return run<FQ6_K>(w, ldw, a, M, N, bias, y, ldy);
    default: TORCH_CHECK(false, "qtype: GGML type ", qtype, " is not supported");
  }
}

// out [N, K] (float32 or bfloat16, contiguous) = the stored rows raw expanded: per element
// fma(s, u, c) with the block's scale s and offset c, the single rounding of the gguf
// package's float32 expressions (d (q - 8), d q + m, (d sc) q - dmin m, (d sc) (q - 32)): exact.
template <typename Fmt, typename OutT>
inline void dequantize_row(const uint8_t* wr, int64_t K, OutT* o) {
  alignas(32) uint8_t q[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    U32 u;
    float s0, s1, c0, c1;
    Fmt::block(wr, b, u, s0, s1, c0, c1);
#if defined(GG_AVX2)
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), u);
#else
    std::memcpy(q, u.v, 32);
#endif
#pragma omp simd
    for (int i = 0; i < 32; ++i) {
      const float v = Fmt::SIGNED ? static_cast<float>(static_cast<int8_t>(q[i])) : static_cast<float>(q[i]);
      o[b * 32 + i] = static_cast<OutT>(std::fma(i < 16 ? s0 : s1, v, i < 16 ? c0 : c1));
    }
  }
}

template <typename Fmt, typename OutT>
void dequantize_rows(const uint8_t* w, int64_t ldw, int64_t N, int64_t K, OutT* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row<Fmt>(w + n * ldw, K, out + n * K);
  });
}

// One stored row (K elements of GGML type qtype at wr) dequantized into o: dequantize_rows' values.
template <typename OutT>
void dequantize_row_dispatch(int qtype, const uint8_t* wr, int64_t K, OutT* o) {
  switch (qtype) {
    case Q4_0: return dequantize_row<FQ4_0>(wr, K, o);
    case Q4_1: return dequantize_row<FQ4_1>(wr, K, o);
    case Q5_0: return dequantize_row<FQ5_0>(wr, K, o);
    case Q5_1: return dequantize_row<FQ5_1>(wr, K, o);
    case Q8_0: return dequantize_row<FQ8_0>(wr, K, o);
    case Q4_K: return dequantize_row<FQK<false>>(wr, K, o);
    case Q5_K: return dequantize_row<FQK<true>>(wr, K, o);
    case Q6_K: return dequantize_row<FQ6_K>(wr, K, o);
    default: TORCH_CHECK(false, "qtype: GGML type ", qtype, " is not supported");
  }
}

template <typename OutT>
void dequantize_dispatch(int qtype, const uint8_t* w, int64_t ldw, int64_t N, int64_t K, OutT* out) {
  switch (qtype) {
    case Q4_0: return dequantize_rows<FQ4_0>(w, ldw, N, K, out);
    case Q4_1: return dequantize_rows<FQ4_1>(w, ldw, N, K, out);
    case Q5_0: return dequantize_rows<FQ5_0>(w, ldw, N, K, out);
    case Q5_1: return dequantize_rows<FQ5_1>(w, ldw, N, K, out);
    case Q8_0: return dequantize_rows<FQ8_0>(w, ldw, N, K, out);
    case Q4_K: return dequantize_rows<FQK<false>>(w, ldw, N, K, out);
    case Q5_K: return dequantize_rows<FQK<true>>(w, ldw, N, K, out);
    case Q6_K: return dequantize_rows<FQ6_K>(w, ldw, N, K, out);
    default: TORCH_CHECK(false, "qtype: GGML type ", qtype, " is not supported");
  }
}

int64_t block_elems(int qtype) {
  return (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K) ? 256 : 32;
}
int64_t block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}


// =======================================================================================
// The interleaved ("packed") layout, made once at load (gguf_pack) for GEMV and small-M GEMM.
// Rows in groups of G = 16 (the last group padded with zero rows); per group, per super-block
// of SB elements (32; 256 for the K-quants):
//   D[16] fp16 (d of each row), then M[16] fp16 when the format has a minimum (Q4_1, Q5_1:
//   m; Q4_K, Q5_K: dmin), then per 32-element sub-block j:
//     scales: Q4_K / Q5_K SC[16] u8, MN[16] u8 (6-bit); Q6_K SC[32] int8 (half h, row r at 16 h + r)
//     quants: the 16 rows x 32 unsigned values u as eight 64-byte vectors U_t (t = 0..7), byte
//       p = 4 r + e of U_t = element 4 t + e of row r (so U_0..3 hold the first 16-element
//       half, U_4..7 the second), stored as 4 x 64 B of nibbles (N_k = U_k | U_k+4 << 4), plus,
//       for Q5_*, 8 x 64 bits (bit p of word t: the 5th bit of U_t), for Q6_K 2 x 64 B (byte p
//       of H_k, bits 2i, 2i+1: the two high bits of U_4k+i), and for Q8_0 the eight U_t as
//       bytes (w + 128).
// One u8 x s8 dot-product instruction per U_t against the activation block's dword t
// broadcast to all lanes (AVX-512: an embedded {1to16} broadcast of the memory operand, no
// shuffle) adds 4 products to each of the 16 rows: eight instructions do a 32-block of 16
// rows (llama.cpp's ggml-cpu repack.cpp block_q4_0x8 / block_q4_Kx8 interleave rows likewise;
// this layout is kvflow's own). The value of element i is s u_i + c with s = D (legacy),
// D SC (K-quants, Q6_K per half) and c = -K0 s (Q4_0: 8, Q5_0: 16, Q8_0: 128, Q6_K: 32), M
// (Q4_1, Q5_1) or -M MN (Q4_K, Q5_K): the stored blocks' fields, so the packed weight computes
// what the stored one does. The offsets K0 are applied in integers (sum(u q) - K0 sum(q), exact);
// the minimums as M times the activation block's scaled sum. The packed size equals the
// stored one (Q4_K / Q5_K: + 4 bytes per 256 elements).
// =======================================================================================
constexpr int G = 16;

struct PFmt {
  int sb;       // elements per super-block
  int bits;     // 4, 5, 6 or 8
  bool has_m;   // M[16] follows D[16]
  int scales;   // 0: none; 1: SC[16] + MN[16] u8; 2: SC[32] int8 per half
  int k0;       // the derived offset c = -k0 s (0: c from M)
  int sub_bytes() const { return (scales ? 32 : 0) + (bits == 8 ? 512 : 256 + (bits == 5 ? 64 : bits == 6 ? 128 : 0)); }
  int head_bytes() const { return has_m ? 64 : 32; }
  int64_t sb_bytes() const { return head_bytes() + (sb / 32) * sub_bytes(); }
};

inline PFmt pfmt(int qt) {
  switch (qt) {
    case Q4_0: return {32, 4, false, 0, 8};
    case Q4_1: return {32, 4, true, 0, 0};
    case Q5_0: return {32, 5, false, 0, 16};
    case Q5_1: return {32, 5, true, 0, 0};
    case Q8_0: return {32, 8, false, 0, 128};
    case Q4_K: return {256, 4, true, 1, 0};
    case Q5_K: return {256, 5, true, 1, 0};
    case Q6_K: return {256, 6, false, 2, 32};
    default: TORCH_CHECK(false, "qtype: GGML type ", qt, " is not supported");
  }
}

// One stored super-block's fields: D, M (fp16 bits), sc (K4/K5: [8] 6-bit; Q6_K: [16] int8
// bits), mn [8], u [sb] unsigned values.
struct Fields {
  uint16_t D = 0, M = 0;
  uint8_t sc[16] = {0}, mn[8] = {0};
  uint8_t u[256] = {0};
};

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void wr16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void decode_fields(int qt, const uint8_t* b, Fields& f) {
  switch (qt) {
    case Q4_0: case Q4_1: {
      const int off = qt == Q4_0 ? 2 : 4;
      f.D = rd16(b);
      if (qt == Q4_1) f.M = rd16(b + 2);
      for (int i = 0; i < 16; ++i) {
        f.u[i] = b[off + i] & 15;
        f.u[i + 16] = b[off + i] >> 4;
      }
      return;
    }
    case Q5_0: case Q5_1: {
      const int off = qt == Q5_0 ? 2 : 4;
      f.D = rd16(b);
      if (qt == Q5_1) f.M = rd16(b + 2);
      uint32_t qh;
      std::memcpy(&qh, b + off, 4);
      for (int i = 0; i < 16; ++i) {
        f.u[i] = (b[off + 4 + i] & 15) | (((qh >> i) & 1) << 4);
        f.u[i + 16] = (b[off + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      return;
    }
    case Q8_0:
      f.D = rd16(b);
      for (int i = 0; i < 32; ++i) f.u[i] = b[2 + i] ^ 0x80;
      return;
    case Q4_K: case Q5_K: {
      const bool five = qt == Q5_K;
      f.D = rd16(b);
      f.M = rd16(b + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, b + 4, sc, mn);
        f.sc[j] = static_cast<uint8_t>(sc);
        f.mn[j] = static_cast<uint8_t>(mn);
        const uint8_t* q = b + (five ? 48 : 16) + 32 * (j >> 1);
        for (int l = 0; l < 32; ++l) {
          uint8_t v = (j & 1) ? q[l] >> 4 : q[l] & 15;
          if (five) v |= ((b[16 + l] >> j) & 1) << 4;
          f.u[32 * j + l] = v;
        }
      }
      return;
    }
    case Q6_K: {
      f.D = rd16(b + 208);
      std::memcpy(f.sc, b + 192, 16);
      for (int j = 0; j < 8; ++j) {
        const int h = j >> 2, jj = j & 3;
        const uint8_t* ql = b + 64 * h + 32 * (jj & 1);
        const uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; ++l)
          f.u[32 * j + l] = ((jj >= 2 ? ql[l] >> 4 : ql[l] & 15)) | (((qh[l] >> (2 * jj)) & 3) << 4);
      }
      return;
    }
  }
}

void encode_fields(int qt, const Fields& f, uint8_t* b) {
  switch (qt) {
    case Q4_0: case Q4_1: {
      const int off = qt == Q4_0 ? 2 : 4;
      wr16(b, f.D);
      if (qt == Q4_1) wr16(b + 2, f.M);
      for (int i = 0; i < 16; ++i) b[off + i] = (f.u[i] & 15) | ((f.u[i + 16] & 15) << 4);
      return;
    }
    case Q5_0: case Q5_1: {
      const int off = qt == Q5_0 ? 2 : 4;
      wr16(b, f.D);
      if (qt == Q5_1) wr16(b + 2, f.M);
      uint32_t qh = 0;
      for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((f.u[i] >> 4) & 1) << i;
      std::memcpy(b + off, &qh, 4);
      for (int i = 0; i < 16; ++i) b[off + 4 + i] = (f.u[i] & 15) | ((f.u[i + 16] & 15) << 4);
      return;
    }
    case Q8_0:
      wr16(b, f.D);
      for (int i = 0; i < 32; ++i) b[2 + i] = f.u[i] ^ 0x80;
      return;
    case Q4_K: case Q5_K: {
      const bool five = qt == Q5_K;
      wr16(b, f.D);
      wr16(b + 2, f.M);
      uint8_t* q = b + 4;  // inverse of scale_min_k4
      for (int j = 0; j < 4; ++j) {
        q[j] = (f.sc[j] & 63) | ((f.sc[j + 4] >> 4) << 6);
        q[j + 4] = (f.mn[j] & 63) | ((f.mn[j + 4] >> 4) << 6);
        q[j + 8] = (f.sc[j + 4] & 15) | ((f.mn[j + 4] & 15) << 4);
      }
      if (five) std::memset(b + 16, 0, 32);
      uint8_t* qs = b + (five ? 48 : 16);
      std::memset(qs, 0, 128);
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) {
          const uint8_t v = f.u[32 * j + l];
          qs[32 * (j >> 1) + l] |= (v & 15) << ((j & 1) * 4);
          if (five) b[16 + l] |= ((v >> 4) & 1) << j;
        }
      return;
    }
    case Q6_K: {
      wr16(b + 208, f.D);
      std::memcpy(b + 192, f.sc, 16);
      std::memset(b, 0, 192);
      for (int j = 0; j < 8; ++j) {
        const int h = j >> 2, jj = j & 3;
        uint8_t* ql = b + 64 * h + 32 * (jj & 1);
        uint8_t* qh = b + 128 + 32 * h;
        for (int l = 0; l < 32; ++l) {
          const uint8_t v = f.u[32 * j + l];
          ql[l] |= (v & 15) << (jj >= 2 ? 4 : 0);
          qh[l] |= ((v >> 4) & 3) << (2 * jj);
        }
      }
      return;
    }
  }
}

// Write / read one row's super-block fields at its place in the group's packed super-block.
// Element e (0..31) of a sub-block, row r: vector t = e / 4, byte p = 4 r + e % 4.
void place_fields(const PFmt& pf, const Fields& f, int r, uint8_t* g) {
  wr16(g + 2 * r, f.D);
  if (pf.has_m) wr16(g + 32 + 2 * r, f.M);
  uint8_t* sub = g + pf.head_bytes();
  for (int j = 0; j < pf.sb / 32; ++j, sub += pf.sub_bytes()) {
    uint8_t* q = sub;
    if (pf.scales == 1) {
      q[r] = f.sc[j];
      q[16 + r] = f.mn[j];
      q += 32;
    } else if (pf.scales == 2) {
      q[r] = f.sc[2 * j];
      q[16 + r] = f.sc[2 * j + 1];
      q += 32;
    }
    for (int e = 0; e < 32; ++e) {
      const uint8_t v = f.u[32 * j + e];
      const int t = e >> 2, p = 4 * r + (e & 3);
      if (pf.bits == 8) {
        q[64 * t + p] = v;
        continue;
      }
      uint8_t& lo = q[64 * (t & 3) + p];
      const int sh = 4 * (t >> 2);
      lo = static_cast<uint8_t>((lo & ~(15 << sh)) | ((v & 15) << sh));
      if (pf.bits == 5) {
        uint8_t* word = q + 256 + 8 * t;  // bit p of the little-endian u64 word t
        word[p >> 3] = static_cast<uint8_t>((word[p >> 3] & ~(1 << (p & 7))) | (((v >> 4) & 1) << (p & 7)));
      } else if (pf.bits == 6) {
        uint8_t& hi = q[256 + 64 * (t >> 2) + p];
        const int hs = 2 * (t & 3);
        hi = static_cast<uint8_t>((hi & ~(3 << hs)) | (((v >> 4) & 3) << hs));
      }
    }
  }
}

void gather_fields(const PFmt& pf, const uint8_t* g, int r, Fields& f) {
  f.D = rd16(g + 2 * r);
  f.M = pf.has_m ? rd16(g + 32 + 2 * r) : 0;
  const uint8_t* sub = g + pf.head_bytes();
  for (int j = 0; j < pf.sb / 32; ++j, sub += pf.sub_bytes()) {
    const uint8_t* q = sub;
    if (pf.scales == 1) {
      f.sc[j] = q[r];
      f.mn[j] = q[16 + r];
      q += 32;
    } else if (pf.scales == 2) {
      f.sc[2 * j] = q[r];
      f.sc[2 * j + 1] = q[16 + r];
      q += 32;
    }
    for (int e = 0; e < 32; ++e) {
      const int t = e >> 2, p = 4 * r + (e & 3);
      uint8_t v;
      if (pf.bits == 8) {
        v = q[64 * t + p];
      } else {
        v = (q[64 * (t & 3) + p] >> 4 * (t >> 2)) & 15;
        if (pf.bits == 5) v |= ((q[256 + 8 * t + (p >> 3)] >> (p & 7)) & 1) << 4;
        else if (pf.bits == 6) v |= ((q[256 + 64 * (t >> 2) + p] >> 2 * (t & 3)) & 3) << 4;
      }
      f.u[32 * j + e] = v;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The packed kernel. The activation rows as quantize_rows makes them, plus the integer sums
// of each block's two 16-element halves (the offsets K0 are subtracted in integers).
// ---------------------------------------------------------------------------------------
struct PAct {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32] block scales
  const float* s32;    // [M, K/32] d * sum(q)
  const int32_t* i16;  // [M, K/32, 2] sum(q) per half
  int64_t K;
  // [M, K/32, 2] where the VNNI kernels' format has K0 != 0 (run_packed fills it): -K0 * sum(q)
  // of half h for Q6_K (each half has its own scale), of the whole block at h = 0 otherwise.
  // The vpdpbusd chains start from it instead of zero: the same int32 sums without a subtraction
  // (and a broadcast from a general register) per row and block.
  const int32_t* k0 = nullptr;
};

// The integer product of one 32-block's halves with an activation block needs no K0 term
// where K0 = 0; on AVX2 Q8_0 multiplies the signed values (w = u - 128) directly.
template <int QT>
constexpr int packed_k0() {
#if defined(GG_VNNI)
  return QT == Q4_0 ? 8 : QT == Q5_0 ? 16 : QT == Q8_0 ? 128 : QT == Q6_K ? 32 : 0;
#else
  return QT == Q4_0 ? 8 : QT == Q5_0 ? 16 : QT == Q6_K ? 32 : 0;
#endif
}

inline int32_t ld32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int PREFETCH = 2048;  // bytes ahead of the sub-block read that are prefetched to L1

// The next weights, prefetched while a micro-kernel computes with weights it already holds
// (AVX-512 VNNI paths). Where a 16-row group (or a pair) meets M activation rows in several
// tiles of rows, the first tile reads the group from memory and the later ones from L1: the
// memory bus worked only during the first tiles, the arithmetic waited on it there, and the
// bus idled in the others. The later tiles now each take a slice of the next group (pair),
// `bytes` long from `p`, a few lines per sub-block step (a burst would wait on the miss
// buffers and hold up the products behind it). Where it applies: the small-M path's tiles
// (M 5..15, every format) and the GEMM's pairs of the 4-bit formats below 32 rows (a Q8_0 pair
// and the next one overflow L1 -- a software prefetch fills L1 too on Zen 4 -- and its later
// tiles then read from L2: 0.72-0.96x measured; from 32 rows the weights' reuse hides the
// stream: 0.92-1.05x). Measured on a Zen 4 (one thread, CPU time, weights cycled from memory,
// alternated with the previous kernel in one process): Q4_1 at M = 16 1.11-1.34x, M = 24
// 1.07-1.21x; Q4_K at 16 1.15-1.24x; Q8_0 / Q6_K at 8 1.06-1.47x (docs/benchmarks.md, session 32).
struct Ahead {
  const char* p = nullptr;
  int64_t bytes = 0;
  int per_step = 0;  // lines per sub-block step
  int64_t off = 0;
  // A slice spread over `steps` sub-block steps.
  Ahead(const char* p_, int64_t bytes_, int64_t steps)
      : p(p_), bytes(bytes_), per_step(bytes_ > 0 ? static_cast<int>((bytes_ / 64 + steps) / std::max<int64_t>(1, steps)) : 0) {}
  Ahead() = default;
  inline void step() {
    for (int k = 0; k < per_step && off < bytes; ++k, off += 64) __builtin_prefetch(p + off, 0, 2);  // into L2
  }
  // The slice of tile `tile` (1 .. tiles - 1) of `tiles` of the `total` bytes at p (tile 0
  // reads the current weights from memory and takes none).
  static Ahead slice(const uint8_t* p, int64_t total, int64_t tile, int64_t tiles, int64_t steps) {
    if (tile < 1 || tiles < 2) return Ahead();
    const int64_t per = (total + tiles - 2) / (tiles - 1), begin = (tile - 1) * per;
    return Ahead(reinterpret_cast<const char*>(p) + begin, std::max<int64_t>(0, std::min(per, total - begin)), steps);
  }
};

#if defined(GG_VNNI)

// The 16 rows' unsigned values of one sub-block (q: its quants): u[t], t = 0..7.
template <int QT>
inline void unpack16(const uint8_t* q, __m512i* u) {
  if constexpr (QT == Q8_0) {
    for (int t = 0; t < 8; ++t) u[t] = _mm512_loadu_si512(q + 64 * t);
  } else {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m512i n = _mm512_loadu_si512(q + 64 * k);
      u[k] = _mm512_and_si512(n, lo4);
      u[k + 4] = _mm512_and_si512(_mm512_srli_epi16(n, 4), lo4);
    }
    if constexpr (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int t = 0; t < 8; ++t) {
        uint64_t w;
        std::memcpy(&w, q + 256 + 8 * t, 8);
        u[t] = _mm512_mask_add_epi8(u[t], static_cast<__mmask64>(w), u[t], sixteen);
      }
    } else if constexpr (QT == Q6_K) {
      // u | (h' & 0x30) in one vpternlogd (truth table A | (B & C) = 0xF8)
      const __m512i m30 = _mm512_set1_epi8(0x30);
      for (int k = 0; k < 2; ++k) {
        const __m512i h = _mm512_loadu_si512(q + 256 + 64 * k);
        u[4 * k + 0] = _mm512_ternarylogic_epi32(u[4 * k + 0], _mm512_slli_epi16(h, 4), m30, 0xF8);
        u[4 * k + 1] = _mm512_ternarylogic_epi32(u[4 * k + 1], _mm512_slli_epi16(h, 2), m30, 0xF8);
        u[4 * k + 2] = _mm512_ternarylogic_epi32(u[4 * k + 2], h, m30, 0xF8);
        u[4 * k + 3] = _mm512_ternarylogic_epi32(u[4 * k + 3], _mm512_srli_epi16(h, 2), m30, 0xF8);
      }
    }
  }
}

// 16 floats from 16 fp16 / u8 / int8.
inline __m512 ph16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Where an integer chain of activation row `row`, block b (half h for Q6_K) starts: a.k0's
// -K0 * sum(q) (PAct::k0), or zero for the formats with K0 = 0.
template <int K0>
inline __m512i k0_start(const PAct& a, int64_t row, int64_t b, int h) {
  if constexpr (K0 == 0) return _mm512_setzero_si512();
  else return _mm512_set1_epi32(a.k0[(row * (a.K / 32) + b) * 2 + h]);
}

// acc[m] (16 rows) = the group's rows . activation row m0 + m, m < MR. The register-blocked
// micro-kernel of both the GEMV / small-M path (MR <= 4) and the prefill GEMM (MR = GEMM_MR):
// a sub-block's 16 x 32 weight values are decoded once into eight zmm registers and meet the
// MR activation rows' blocks there (8 MR vpdpbusd), the MR accumulators stay in registers.
// With MR <= 4 each row's block product runs as two 4-deep chains (their latency would
// otherwise show with so few rows); with more rows one 8-deep chain per row, the rows' chains
// interleaved (the rows are the independent chains), saves an add per row and block. Integer
// sums: the same value either way; the float operations per row are the same, in order.
template <int QT, int MR, bool AHEAD = false>
__attribute__((always_inline)) inline void group_dot(const PFmt& pf, const uint8_t* g, const PAct& a, int64_t m0, __m512* acc, Ahead ahead = Ahead()) {
  constexpr bool TWO_CHAINS = MR <= 4;
  constexpr int K0 = packed_k0<QT>();
  constexpr bool HAS_M = QT == Q4_1 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;
  const int64_t nsb = a.K / pf.sb, nb = a.K / 32;
  const int nsub = pf.sb / 32, subb = pf.sub_bytes();
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const __m512 Dv = ph16(g);
    __m512 Mv = _mm512_setzero_ps();
    if constexpr (HAS_M) Mv = ph16(g + 32);
    const uint8_t* sub = g + pf.head_bytes();
    for (int j = 0; j < nsub; ++j, sub += subb) {
      const int64_t b = s * nsub + j;
      const uint8_t* q = sub;
      __m512 sv = Dv, sv1 = Dv, cv = Mv;
      if constexpr (QT == Q4_K || QT == Q5_K) {
        sv = _mm512_mul_ps(Dv, u8x16(q));
        cv = _mm512_mul_ps(Mv, u8x16(q + 16));  // the minimum's product; subtracted below
        q += 32;
      } else if constexpr (QT == Q6_K) {
        sv = _mm512_mul_ps(Dv, i8x16(q));
        sv1 = _mm512_mul_ps(Dv, i8x16(q + 16));
        q += 32;
      }
      for (int o = 0; o < subb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(sub + PREFETCH + o), _MM_HINT_T0);
      if constexpr (AHEAD) ahead.step();
      __m512i u[8];
      unpack16<QT>(q, u);
      if constexpr (!TWO_CHAINS) {
        // t outer, rows inner: the MR rows' chains interleave in program order (each row's
        // chain alone is 8 dependent vpdpbusd); Q6_K's two halves (their own scales) one
        // after the other, as below.
        constexpr int HALVES = QT == Q6_K ? 2 : 1, T = 8 / HALVES;
        const int8_t* ap = a.q + m0 * a.K + b * 32;
#pragma GCC unroll 2
        for (int h = 0; h < HALVES; ++h) {
          __m512i iv[MR];
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m)
            iv[m] = _mm512_dpbusd_epi32(k0_start<K0>(a, m0 + m, b, h), u[T * h], _mm512_set1_epi32(ld32(ap + m * a.K + 4 * T * h)));
#pragma GCC unroll 8
          for (int t = T * h + 1; t < T * h + T; ++t)
#pragma GCC unroll 16
            for (int m = 0; m < MR; ++m) iv[m] = _mm512_dpbusd_epi32(iv[m], u[t], _mm512_set1_epi32(ld32(ap + m * a.K + 4 * t)));
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
            const int64_t row = m0 + m;
            const __m512 da = _mm512_set1_ps(a.d[row * nb + b]);
            const __m512i i = iv[m];
            if constexpr (QT == Q6_K) {
              acc[m] = _mm512_fmadd_ps(h ? sv1 : sv, _mm512_mul_ps(_mm512_cvtepi32_ps(i), da), acc[m]);
              continue;
            }
            acc[m] = _mm512_fmadd_ps(sv, _mm512_mul_ps(_mm512_cvtepi32_ps(i), da), acc[m]);
            if constexpr (QT == Q4_1 || QT == Q5_1)
              acc[m] = _mm512_fmadd_ps(cv, _mm512_set1_ps(a.s32[row * nb + b]), acc[m]);
            else if constexpr (QT == Q4_K || QT == Q5_K)
              acc[m] = _mm512_fnmadd_ps(cv, _mm512_set1_ps(a.s32[row * nb + b]), acc[m]);
          }
        }
        continue;
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const int64_t row = m0 + m;
        const int8_t* ap = a.q + row * a.K + b * 32;
        const __m512 da = _mm512_set1_ps(a.d[row * nb + b]);
        __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(ld32(ap)));
        __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], _mm512_set1_epi32(ld32(ap + 16)));
        i0 = _mm512_dpbusd_epi32(i0, u[1], _mm512_set1_epi32(ld32(ap + 4)));
        i1 = _mm512_dpbusd_epi32(i1, u[5], _mm512_set1_epi32(ld32(ap + 20)));
        i0 = _mm512_dpbusd_epi32(i0, u[2], _mm512_set1_epi32(ld32(ap + 8)));
        i1 = _mm512_dpbusd_epi32(i1, u[6], _mm512_set1_epi32(ld32(ap + 24)));
        i0 = _mm512_dpbusd_epi32(i0, u[3], _mm512_set1_epi32(ld32(ap + 12)));
        i1 = _mm512_dpbusd_epi32(i1, u[7], _mm512_set1_epi32(ld32(ap + 28)));
        // (the K0 terms added at the end, one vpaddd with a broadcast operand each: as the
        // chains' starting values they measured slower here, where the chains are short)
        if constexpr (QT == Q6_K) {
          i0 = _mm512_add_epi32(i0, k0_start<K0>(a, row, b, 0));
          i1 = _mm512_add_epi32(i1, k0_start<K0>(a, row, b, 1));
          acc[m] = _mm512_fmadd_ps(sv, _mm512_mul_ps(_mm512_cvtepi32_ps(i0), da), acc[m]);
          acc[m] = _mm512_fmadd_ps(sv1, _mm512_mul_ps(_mm512_cvtepi32_ps(i1), da), acc[m]);
        } else {
          __m512i i = _mm512_add_epi32(i0, i1);
          if constexpr (K0 != 0) i = _mm512_add_epi32(i, k0_start<K0>(a, row, b, 0));
          acc[m] = _mm512_fmadd_ps(sv, _mm512_mul_ps(_mm512_cvtepi32_ps(i), da), acc[m]);
          if constexpr (QT == Q4_1 || QT == Q5_1)
            acc[m] = _mm512_fmadd_ps(cv, _mm512_set1_ps(a.s32[row * nb + b]), acc[m]);
          else if constexpr (QT == Q4_K || QT == Q5_K)
            acc[m] = _mm512_fnmadd_ps(cv, _mm512_set1_ps(a.s32[row * nb + b]), acc[m]);
        }
      }
    }
    g += pf.sb_bytes();
  }
}

// Vector t (0..7) of one sub-block's 16 rows (q: its quants), as unpack16 makes it.
template <int QT>
inline __m512i unpack16_t(const uint8_t* q, int t) {
  if constexpr (QT == Q8_0) {
    return _mm512_loadu_si512(q + 64 * t);
  } else {
    const __m512i n = _mm512_loadu_si512(q + 64 * (t & 3));
    __m512i u = _mm512_and_si512(t >= 4 ? _mm512_srli_epi16(n, 4) : n, _mm512_set1_epi8(0x0F));
    if constexpr (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) {
      uint64_t w;
      std::memcpy(&w, q + 256 + 8 * t, 8);
      u = _mm512_mask_add_epi8(u, static_cast<__mmask64>(w), u, _mm512_set1_epi8(16));
    } else if constexpr (QT == Q6_K) {
      const __m512i h = _mm512_loadu_si512(q + 256 + 64 * (t >> 2));
      const int tt = t & 3;
      const __m512i sh = tt == 0 ? _mm512_slli_epi16(h, 4) : tt == 1 ? _mm512_slli_epi16(h, 2) : tt == 2 ? h : _mm512_srli_epi16(h, 2);
      u = _mm512_ternarylogic_epi32(u, sh, _mm512_set1_epi8(0x30), 0xF8);  // u | (sh & 0x30)
    }
    return u;
  }
}

// The prefill GEMM's micro-kernel (VNNI): two groups (32 weight rows: g and g + ldg) against
// MR activation rows, acc[0][m] / acc[1][m] = group 0 / 1 . activation row m0 + m. Each
// broadcast activation dword feeds two vpdpbusd (one per group): the broadcasts, not the
// products, bound group_dot's one-group loop (a broadcast costs a vector-pipe slot here, as a
// vpdpbusd does). Per sub-block and vector t the two groups' values are decoded (once per MR
// rows) and the 2 MR integer chains advance, interleaved; then each row's float operations
// are group_dot's, in the same order: the results equal group_dot's bit for bit.
// DECODED: the two groups' values already decoded by decode_groups at ub, ub_stride bytes
// apart (the prefill GEMM's decoded chunk); a vector t is then one load.
template <int QT, int MR, bool DECODED = false, bool AHEAD = false, bool STREAM = false>
__attribute__((always_inline)) inline void group_dot2(const PFmt& pf, const uint8_t* g, int64_t ldg, const PAct& a, int64_t m0, __m512 (*acc)[MR],
                       const uint8_t* ub = nullptr, int64_t ub_stride = 0, Ahead ahead = Ahead()) {
  constexpr int K0 = packed_k0<QT>();
  constexpr bool HAS_M = QT == Q4_1 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;
  constexpr int HALVES = QT == Q6_K ? 2 : 1, T = 8 / HALVES;
  const int64_t nsb = a.K / pf.sb, nb = a.K / 32;
  const int nsub = pf.sb / 32, subb = pf.sub_bytes();
  for (int m = 0; m < MR; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    __m512 Dv[2], Mv[2];
    for (int k = 0; k < 2; ++k) {
      Dv[k] = ph16(g + k * ldg);
      Mv[k] = HAS_M ? ph16(g + k * ldg + 32) : _mm512_setzero_ps();
    }
    const uint8_t* sub = g + pf.head_bytes();
    for (int j = 0; j < nsub; ++j, sub += subb) {
      const int64_t b = s * nsub + j;
      const uint8_t* q[2] = {sub, sub + ldg};
      if constexpr (STREAM)  // (the small-M path: both groups come from memory, as in group_dot)
        for (int o = 0; o < subb; o += 64)
          for (int k = 0; k < 2; ++k) _mm_prefetch(reinterpret_cast<const char*>(q[k] + PREFETCH + o), _MM_HINT_T0);
      if constexpr (AHEAD) ahead.step();
      __m512 sv[2], sv1[2], cv[2];
      for (int k = 0; k < 2; ++k) {
        sv[k] = sv1[k] = Dv[k];
        cv[k] = Mv[k];
        if constexpr (QT == Q4_K || QT == Q5_K) {
          sv[k] = _mm512_mul_ps(Dv[k], u8x16(q[k]));
          cv[k] = _mm512_mul_ps(Mv[k], u8x16(q[k] + 16));
          q[k] += 32;
        } else if constexpr (QT == Q6_K) {
          sv[k] = _mm512_mul_ps(Dv[k], i8x16(q[k]));
          sv1[k] = _mm512_mul_ps(Dv[k], i8x16(q[k] + 16));
          q[k] += 32;
        }
      }
      const int8_t* ap = a.q + m0 * a.K + b * 32;
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) {
        __m512i iv[2][MR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) iv[0][m] = iv[1][m] = k0_start<K0>(a, m0 + m, b, h);
#pragma GCC unroll 8
        for (int t = T * h; t < T * h + T; ++t) {
          __m512i u0, u1;
          if constexpr (DECODED) {
            u0 = _mm512_load_si512(ub + (b * 8 + t) * 64);
            u1 = _mm512_load_si512(ub + ub_stride + (b * 8 + t) * 64);
          } else {
            u0 = unpack16_t<QT>(q[0], t);
            u1 = unpack16_t<QT>(q[1], t);
          }
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512i bc = _mm512_set1_epi32(ld32(ap + m * a.K + 4 * t));
            iv[0][m] = _mm512_dpbusd_epi32(iv[0][m], u0, bc);
            iv[1][m] = _mm512_dpbusd_epi32(iv[1][m], u1, bc);
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const int64_t row = m0 + m;
          const __m512 da = _mm512_set1_ps(a.d[row * nb + b]);
#pragma GCC unroll 2
          for (int k = 0; k < 2; ++k) {
            const __m512i i = iv[k][m];
            if constexpr (QT == Q6_K) {
              acc[k][m] = _mm512_fmadd_ps(h ? sv1[k] : sv[k], _mm512_mul_ps(_mm512_cvtepi32_ps(i), da), acc[k][m]);
              continue;
            }
            acc[k][m] = _mm512_fmadd_ps(sv[k], _mm512_mul_ps(_mm512_cvtepi32_ps(i), da), acc[k][m]);
            if constexpr (QT == Q4_1 || QT == Q5_1)
              acc[k][m] = _mm512_fmadd_ps(cv[k], _mm512_set1_ps(a.s32[row * nb + b]), acc[k][m]);
            else if constexpr (QT == Q4_K || QT == Q5_K)
              acc[k][m] = _mm512_fnmadd_ps(cv[k], _mm512_set1_ps(a.s32[row * nb + b]), acc[k][m]);
          }
        }
      }
    }
    g += pf.sb_bytes();
  }
}
#endif

// The same sums without AVX-512 (AVX2 or portable): acc[m][16] floats, one per row.
template <int QT, int MR>
inline void group_dot_generic(const PFmt& pf, const uint8_t* g, const PAct& a, int64_t m0, float (*acc)[16]) {
  constexpr int K0 = packed_k0<QT>();
  constexpr bool HAS_M = QT == Q4_1 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;
  const int64_t nsb = a.K / pf.sb, nb = a.K / 32;
  for (int m = 0; m < MR; ++m)
    for (int l = 0; l < 16; ++l) acc[m][l] = 0.f;
#if defined(GG_AVX2)
  __m256 accv[MR][2];
  for (int m = 0; m < MR; ++m) accv[m][0] = accv[m][1] = _mm256_setzero_ps();
#endif
  for (int64_t s = 0; s < nsb; ++s) {
    alignas(32) float D[16], Mm[16] = {0};
    for (int r = 0; r < 16; ++r) {
      D[r] = fp16(g + 2 * r);
      if (HAS_M) Mm[r] = fp16(g + 32 + 2 * r);
    }
    const uint8_t* sub = g + pf.head_bytes();
    for (int j = 0; j < pf.sb / 32; ++j, sub += pf.sub_bytes()) {
      const int64_t b = s * (pf.sb / 32) + j;
      const uint8_t* q = sub;
      alignas(32) float sv[2][16], cv[16];
      for (int r = 0; r < 16; ++r) {
        float sc0 = 1.f, sc1 = 1.f;
        if (QT == Q4_K || QT == Q5_K) sc0 = sc1 = static_cast<float>(q[r]);
        else if (QT == Q6_K) {
          sc0 = static_cast<float>(static_cast<int8_t>(q[r]));
          sc1 = static_cast<float>(static_cast<int8_t>(q[16 + r]));
        }
        sv[0][r] = D[r] * sc0;
        sv[1][r] = D[r] * sc1;
        cv[r] = (QT == Q4_K || QT == Q5_K) ? Mm[r] * static_cast<float>(q[16 + r]) : Mm[r];
      }
      if (pf.scales) q += 32;
#if defined(GG_AVX2)
      // u[t][R]: vector t's rows 8R .. 8R + 7.
      __m256i u[8][2];
      for (int t = 0; t < 8; ++t)
        for (int R = 0; R < 2; ++R) {
          if constexpr (QT == Q8_0) {
            u[t][R] = _mm256_xor_si256(GG_LOAD(q + 64 * t + 32 * R), _mm256_set1_epi8(static_cast<char>(0x80)));  // w = u - 128
          } else {
            const __m256i p = GG_LOAD(q + 64 * (t & 3) + 32 * R);
            u[t][R] = _mm256_and_si256(t >= 4 ? _mm256_srli_epi16(p, 4) : p, _mm256_set1_epi8(0x0F));
            if constexpr (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) u[t][R] = _mm256_or_si256(u[t][R], bits32(q + 256 + 8 * t + 4 * R));
            if constexpr (QT == Q6_K) {
              const __m256i hb = GG_LOAD(q + 256 + 64 * (t >> 2) + 32 * R);
              const int tt = t & 3;
              const __m256i sh = tt == 3 ? _mm256_srli_epi16(hb, 2) : tt == 2 ? hb : _mm256_slli_epi16(hb, 4 - 2 * tt);
              u[t][R] = _mm256_or_si256(u[t][R], _mm256_and_si256(sh, _mm256_set1_epi8(0x30)));
            }
          }
        }
      for (int m = 0; m < MR; ++m) {
        const int64_t row = m0 + m;
        const int8_t* ap = a.q + row * a.K + b * 32;
        const float da = a.d[row * nb + b];
        const int32_t* is = a.i16 + (row * nb + b) * 2;
        for (int R = 0; R < 2; ++R) {
          __m256i ih[2];
          for (int h = 0; h < 2; ++h) {
            __m256i i = _mm256_setzero_si256();
            for (int tt = 0; tt < 4; ++tt) {
              const int t = 4 * h + tt;
              const __m256i av = _mm256_set1_epi32(ld32(ap + 4 * t));
              if constexpr (QT == Q8_0) i = _mm256_add_epi32(i, dot_u8s8(_mm256_sign_epi8(u[t][R], u[t][R]), _mm256_sign_epi8(av, u[t][R])));
              else i = _mm256_add_epi32(i, dot_u8s8(u[t][R], av));
            }
            ih[h] = i;
          }
          const __m256 dav = _mm256_set1_ps(da);
          if constexpr (QT == Q6_K) {
            for (int h = 0; h < 2; ++h) {
              const __m256i i = _mm256_sub_epi32(ih[h], _mm256_set1_epi32(K0 * is[h]));
              accv[m][R] = _mm256_fmadd_ps(_mm256_load_ps(sv[h] + 8 * R), _mm256_mul_ps(_mm256_cvtepi32_ps(i), dav), accv[m][R]);
            }
          } else {
            __m256i i = _mm256_add_epi32(ih[0], ih[1]);
            if constexpr (K0 != 0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(K0 * (is[0] + is[1])));
            accv[m][R] = _mm256_fmadd_ps(_mm256_load_ps(sv[0] + 8 * R), _mm256_mul_ps(_mm256_cvtepi32_ps(i), dav), accv[m][R]);
            if constexpr (QT == Q4_1 || QT == Q5_1)
              accv[m][R] = _mm256_fmadd_ps(_mm256_load_ps(cv + 8 * R), _mm256_set1_ps(a.s32[row * nb + b]), accv[m][R]);
            else if constexpr (QT == Q4_K || QT == Q5_K)
              accv[m][R] = _mm256_fnmadd_ps(_mm256_load_ps(cv + 8 * R), _mm256_set1_ps(a.s32[row * nb + b]), accv[m][R]);
          }
        }
      }
#else
      for (int m = 0; m < MR; ++m) {
        const int64_t row = m0 + m;
        const int8_t* ap = a.q + row * a.K + b * 32;
        const float da = a.d[row * nb + b];
        const int32_t* is = a.i16 + (row * nb + b) * 2;
        for (int r = 0; r < 16; ++r) {
          int32_t ih[2] = {0, 0};
          for (int e = 0; e < 32; ++e) {
            const int t = e >> 2, p = 4 * r + (e & 3);
            int v;
            if (QT == Q8_0) v = static_cast<int>(q[64 * t + p]) - 128;
            else {
              v = (q[64 * (t & 3) + p] >> 4 * (t >> 2)) & 15;
              if (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) v |= ((q[256 + 8 * t + (p >> 3)] >> (p & 7)) & 1) << 4;
              if (QT == Q6_K) v |= ((q[256 + 64 * (t >> 2) + p] >> 2 * (t & 3)) & 3) << 4;
            }
            ih[e >> 4] += v * ap[e];
          }
          if (QT == Q6_K) {
            acc[m][r] += sv[0][r] * (static_cast<float>(ih[0] - K0 * is[0]) * da);
            acc[m][r] += sv[1][r] * (static_cast<float>(ih[1] - K0 * is[1]) * da);
          } else {
            acc[m][r] += sv[0][r] * (static_cast<float>(ih[0] + ih[1] - K0 * (is[0] + is[1])) * da);
            if (QT == Q4_1 || QT == Q5_1) acc[m][r] += cv[r] * a.s32[row * nb + b];
            else if (QT == Q4_K || QT == Q5_K) acc[m][r] -= cv[r] * a.s32[row * nb + b];
          }
        }
      }
#endif
    }
    g += pf.sb_bytes();
  }
#if defined(GG_AVX2)
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(acc[m], accv[m][0]);
    _mm256_storeu_ps(acc[m] + 8, accv[m][1]);
  }
#endif
}

#if defined(GG_AVX2) && !defined(GG_VNNI)
// The AVX2 micro-kernel of the small-M path and the prefill GEMM: acc[h MR + m] (8 rows:
// 8 R .. 8 R + 7 of the group, R = R0 + h, h < NH) = those rows . activation row m0 + m, m < MR;
// NH = 2 does both halves of each sub-block before the next (one pass over the group). Per
// sub-block, vector t of each half (4 values of each of its 8 rows) is decoded into one ymm
// register just before it meets the MR activation rows (vpmaddubsw against the broadcast
// dword t, one broadcast for the NH halves, then vpmaddwd to 32 bits): t outer, rows inner, so
// only the rows' 16-bit partial sums stay live, not the eight decoded vectors of a half (which,
// held for the rows' loop, spilled to the stack from MR = 2 on). Against that layout (one half
// after the other, eight vectors held), same machine, one thread, weights in cache: M = 1
// 1.0-1.3x, M = 2-4 1.2-1.6x, the GEMM (M 32-256) 1.0-1.25x. vpmaddubsw's 16-bit pair sums are added in 16 bits before one vpmaddwd where
// they cannot overflow (|a| <= 127: a pair is at most 2 * 15 * 127 = 3810 for 4-bit values, so
// all eight; 5-bit values four (4 * 7874), 6-bit two (2 * 16002)): the integer sum is the same
// in any order. The scales of the 8 rows are converted together (F16C). The float operations
// per row and block are group_dot_generic's, in its order: the results are the same bits. Keep
// the minimum's product in the same chain, right after its block's scaled sum: where
// activations are large (SmolLM2's outlier features) the two cancel block by block; summed in
// a chain of their own and subtracted at the end, SmolLM2's 79-token perplexity moved from
// +0.3 % to +2.7 % of the float32 model's (tests/quantization/test_gguf_native.py), for no speed.
template <int QT, int MR, int NH = 1>
inline void group_dot_avx2(const PFmt& pf, const uint8_t* g, const PAct& a, int64_t m0, int R0, __m256* acc) {
  static_assert(QT != Q8_0, "Q8_0 takes group_dot_generic on AVX2");
  constexpr int K0 = packed_k0<QT>();
  constexpr bool HAS_M = QT == Q4_1 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;
  constexpr bool FIVE = QT == Q5_0 || QT == Q5_1 || QT == Q5_K;
  constexpr int L = QT == Q6_K ? 2 : FIVE ? 4 : 8;  // vectors t whose pair sums share 16 bits
  constexpr int HALVES = QT == Q6_K ? 2 : 1;         // Q6_K: the two 16-element halves' own scales
  const int64_t nsb = a.K / pf.sb, nb = a.K / 32;
  const int nsub = pf.sb / 32, subb = pf.sub_bytes();
  const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F);
  __m256 accl[NH][MR];
  for (int h = 0; h < NH; ++h)
    for (int m = 0; m < MR; ++m) accl[h][m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    __m256 Dvh[NH], Mvh[NH];
    for (int h = 0; h < NH; ++h) {
      Dvh[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16 * (R0 + h))));
      Mvh[h] = HAS_M ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 32 + 16 * (R0 + h))))
                     : _mm256_setzero_ps();
    }
    const uint8_t* sub = g + pf.head_bytes();
    for (int j = 0; j < nsub; ++j, sub += subb) {
      const int64_t b = s * nsub + j;
      if (R0 == 0)  // the pass over the first 8 rows brings the whole lines in (as group_dot)
        for (int o = 0; o < subb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(sub + PREFETCH + o), _MM_HINT_T0);
      const uint8_t* q = sub + (pf.scales ? 32 : 0);
      const int8_t* ap = a.q + m0 * a.K + b * 32;
      // Integer sums: vector t of each half meets each row's broadcast dword t (one broadcast
      // for the NH halves).
      __m256i isum[NH][MR][HALVES], p16[NH][MR];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        __m256i u[NH];
#pragma GCC unroll 2
        for (int hh = 0; hh < NH; ++hh) {
          const int R = R0 + hh;
          const __m256i p = GG_LOAD(q + 64 * (t & 3) + 32 * R);
          u[hh] = _mm256_and_si256(t >= 4 ? _mm256_srli_epi16(p, 4) : p, lo4);
          if constexpr (FIVE) u[hh] = _mm256_or_si256(u[hh], bits32(q + 256 + 8 * t + 4 * R));
          if constexpr (QT == Q6_K) {
            const __m256i hb = GG_LOAD(q + 256 + 64 * (t >> 2) + 32 * R);
            const int tt = t & 3;
            const __m256i sh = tt == 3 ? _mm256_srli_epi16(hb, 2) : tt == 2 ? hb : _mm256_slli_epi16(hb, 4 - 2 * tt);
            u[hh] = _mm256_or_si256(u[hh], _mm256_and_si256(sh, _mm256_set1_epi8(0x30)));
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i bc = _mm256_set1_epi32(ld32(ap + m * a.K + 4 * t));
#pragma GCC unroll 2
          for (int hh = 0; hh < NH; ++hh) {
            const __m256i P = _mm256_maddubs_epi16(u[hh], bc);
            p16[hh][m] = t % L == 0 ? P : _mm256_add_epi16(p16[hh][m], P);
            if (t % L == L - 1) {
              const __m256i w = _mm256_madd_epi16(p16[hh][m], ones);
              const int h = HALVES == 2 ? t / 4 : 0, first = HALVES == 2 ? 4 * h + L - 1 : L - 1;
              isum[hh][m][h] = t == first ? w : _mm256_add_epi32(isum[hh][m][h], w);
            }
          }
        }
      }
      // The float operations per row and block, group_dot_generic's in its order.
#pragma GCC unroll 2
      for (int hh = 0; hh < NH; ++hh) {
        const int R = R0 + hh;
        __m256 sv = Dvh[hh], sv1 = Dvh[hh], cv = Mvh[hh];
        if constexpr (QT == Q4_K || QT == Q5_K) {
          sv = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * R)))));
          cv = _mm256_mul_ps(cv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 16 + 8 * R)))));
        } else if constexpr (QT == Q6_K) {
          sv = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * R)))));
          sv1 = _mm256_mul_ps(sv1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 16 + 8 * R)))));
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const int64_t row = m0 + m;
          const int32_t* is = a.i16 + (row * nb + b) * 2;
          const __m256 dav = _mm256_set1_ps(a.d[row * nb + b]);
          if constexpr (QT == Q6_K) {
            for (int h = 0; h < 2; ++h) {
              const __m256i i = _mm256_sub_epi32(isum[hh][m][h], _mm256_set1_epi32(K0 * is[h]));
              accl[hh][m] = _mm256_fmadd_ps(h ? sv1 : sv, _mm256_mul_ps(_mm256_cvtepi32_ps(i), dav), accl[hh][m]);
            }
            continue;
          }
          __m256i i = isum[hh][m][0];
          if constexpr (K0 != 0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(K0 * (is[0] + is[1])));
          accl[hh][m] = _mm256_fmadd_ps(sv, _mm256_mul_ps(_mm256_cvtepi32_ps(i), dav), accl[hh][m]);
          if constexpr (QT == Q4_1 || QT == Q5_1)
            accl[hh][m] = _mm256_fmadd_ps(cv, _mm256_set1_ps(a.s32[row * nb + b]), accl[hh][m]);
          else if constexpr (QT == Q4_K || QT == Q5_K)
            accl[hh][m] = _mm256_fnmadd_ps(cv, _mm256_set1_ps(a.s32[row * nb + b]), accl[hh][m]);
        }
      }
    }
    g += pf.sb_bytes();
  }
  for (int h = 0; h < NH; ++h)
    for (int m = 0; m < MR; ++m) acc[h * MR + m] = accl[h][m];
}
#endif

// Work split: each thread of the intra-op pool owns one contiguous range of the groups and
// walks it front to back in chunks of >= ~32 KB of weight, so every thread streams its weights
// in one run (the hardware prefetchers follow it; chunks dealt round-robin from one shared
// counter made each thread's reads jump every 32 KB and halved the read rate of matrices
// streamed from DRAM). A thread that finishes its range takes the next chunks of the others'
// ranges from their cursors, so a thread the OS deschedules on a busy machine does not hold
// back the rest of the call.
struct alignas(64) Cursor {
  std::atomic<int64_t> next;
  int64_t end;
};

template <typename F>
void for_each_chunk(int64_t groups, int64_t chunk, const F& body) {
  const int64_t chunks = (groups + chunk - 1) / chunk;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(chunks, at::get_num_threads()));
  std::vector<Cursor> cur(static_cast<size_t>(workers));
  for (int64_t t = 0; t < workers; ++t) {
    // Range t: chunks [t * chunks / workers, (t + 1) * chunks / workers), in groups.
    cur[t].next.store(std::min(groups, (t * chunks / workers) * chunk), std::memory_order_relaxed);
    cur[t].end = std::min(groups, ((t + 1) * chunks / workers) * chunk);
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < workers; ++k) {
        Cursor& c = cur[(t + k) % workers];
        for (int64_t g0 = c.next.fetch_add(chunk); g0 < c.end; g0 = c.next.fetch_add(chunk))
          body(g0, std::min(c.end, g0 + chunk));
      }
    }
  });
}

template <int QT, typename OutT>
void run_packed_gemm(const PFmt& pf, const uint8_t* w, int64_t ldg, const PAct& a, int64_t M, int64_t N,
                     const float* bias, OutT* y, int64_t ldy);
// Rows from which run_packed takes the prefill GEMM (run_packed_gemm); speculative verification
// and smaller decode batches stay on the small-M path. VNNI (two threads, the weights cycled
// from memory, `benchmarks/gguf_kernels.py --shapes qwen0.5b smollm2 heads`, against the
// small-M path): at 16 rows the GEMM measured 1.10-1.21x for Q8_0 on the large shapes (the LM
// heads among them), 1.0-1.17x for Q4_1 / Q4_K, 0.97-1.05x for Q5_0, 0.96-0.97x for Q6_K; at
// 24 rows 1.02-1.22x for all but Q8_0 on 192 x 576 (0.88x). AVX2 and portable: 32 (at 16 rows
// 0.86-1.33x, Q6_K / Q8_0 slower, when it was chosen).
template <int QT>
constexpr int64_t gemm_min_rows() {
#if defined(GG_VNNI)
  return QT == Q6_K ? 24 : 16;
#else
  return 32;
#endif
}

// The GEMV and small-M GEMM: per 16-row group all M rows in tiles of 4 (group_dot; on AVX2
// group_dot_avx2 over both 8-row halves in one pass: its scales converted 8 rows at a time
// and its 16-bit partial sums made the GEMV 1.1-2.2x group_dot_generic's speed with the
// weight in cache, Q4_K 2.2x, one thread. A pass per half had left the DRAM stream idle while
// the second half re-read the group from L2; one pass, streamed from memory, 2 threads, the
// AVX2 caps, against the pass per half: M = 1 1.2-1.5x on the 1.5B's and 0.5B's large shapes
// (Q4_K 35.9 against 24.6 GB/s), M = 4 1.03-1.3x (benchmarks/gguf_kernels.py --baseline-repo).
// Q8_0 keeps group_dot_generic: its sign trick per row left group_dot_avx2 no faster.
template <int QT, typename OutT>
void run_packed(const PFmt& pf, const uint8_t* w, int64_t ldg, const PAct& a, int64_t M, int64_t N, const float* bias,
                OutT* y, int64_t ldy) {
#if defined(GG_VNNI)
  constexpr int K0 = packed_k0<QT>();
  if constexpr (K0 != 0) {
    if (a.k0 == nullptr) {  // the chains' starting values (PAct::k0), once per call
      const int64_t nb = a.K / 32;
      const auto k0 = uninit<int32_t>(M * nb * 2);
      for (int64_t i = 0; i < M * nb; ++i) {
        const int32_t* is = a.i16 + 2 * i;
        k0[2 * i] = -K0 * (QT == Q6_K ? is[0] : is[0] + is[1]);
        k0[2 * i + 1] = -K0 * is[1];
      }
      PAct ak = a;
      ak.k0 = k0.get();
      return run_packed<QT>(pf, w, ldg, ak, M, N, bias, y, ldy);
    }
  }
#endif
  if (M >= gemm_min_rows<QT>()) return run_packed_gemm<QT>(pf, w, ldg, a, M, N, bias, y, ldy);
  const int64_t groups = (N + G - 1) / G;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, ldg));
  for_each_chunk(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
    int64_t gi = g_begin;
#if defined(GG_VNNI)
    // From 8 rows, pairs of groups (group_dot2): one broadcast activation dword feeds both
    // groups' vpdpbusd, as in the GEMM (group_dot2's results equal group_dot's bit for bit);
    // from the second tile of rows on a slice of the next pair is prefetched (Ahead). Measured
    // against group_dot per group (two threads, weights streamed from memory, Q4_K / Q5_0 /
    // Q8_0 / Q4_1): 8-12 rows 1.06-1.13x; 2-4 rows 0.66-0.86x (one tile reads both groups from
    // memory through 8-deep chains; group_dot's two 4-deep chains per block keep up), so fewer
    // rows keep group_dot.
    if (M >= 8) {
      const int64_t tiles = (M + 3) / 4;
      for (; gi + 1 < g_end; gi += 2) {
        const uint8_t* g = w + gi * ldg;
        const int64_t next_bytes = std::min<int64_t>(2, groups - gi - 2) * ldg;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const Ahead next = next_bytes > 0 ? Ahead::slice(g + 2 * ldg, next_bytes, m0 / 4, tiles, a.K / 32) : Ahead();
          auto pair = [&](auto mrc) {
            constexpr int MR = decltype(mrc)::value;
            __m512 acc[2][MR];
            if (next.bytes > 0) group_dot2<QT, MR, false, true, true>(pf, g, ldg, a, m0, acc, nullptr, 0, next);
            else group_dot2<QT, MR, false, false, true>(pf, g, ldg, a, m0, acc);
            const int64_t n0 = gi * G, rows = std::min<int64_t>(2 * G, N - n0);
            alignas(64) float res[2 * G];
            for (int m = 0; m < MR; ++m) {
              _mm512_store_ps(res, acc[0][m]);
              _mm512_store_ps(res + G, acc[1][m]);
              for (int r = 0; r < rows; ++r) y[(m0 + m) * ldy + n0 + r] = static_cast<OutT>(res[r] + (bias ? bias[n0 + r] : 0.f));
            }
          };
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: pair(std::integral_constant<int, 1>()); break;
            case 2: pair(std::integral_constant<int, 2>()); break;
            case 3: pair(std::integral_constant<int, 3>()); break;
            default: pair(std::integral_constant<int, 4>()); break;
          }
        }
      }
    }
#endif
    for (; gi < g_end; ++gi) {
      const uint8_t* g = w + gi * ldg;
      const int64_t n0 = gi * G, rows = std::min<int64_t>(G, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, M - m0));
        alignas(64) float res[4][16];
#if defined(GG_VNNI)
        __m512 acc[4];
        // the next group (Ahead) from the second tile of rows on
        const Ahead next = gi + 1 < groups ? Ahead::slice(g + ldg, ldg, m0 / 4, (M + 3) / 4, a.K / 32) : Ahead();
        auto rows_of = [&](auto ahead) {  // (the prefetching instantiation only where it prefetches)
          constexpr bool A = decltype(ahead)::value;
          switch (mr) {
            case 1: group_dot<QT, 1, A>(pf, g, a, m0, acc, next); break;
            case 2: group_dot<QT, 2, A>(pf, g, a, m0, acc, next); break;
            case 3: group_dot<QT, 3, A>(pf, g, a, m0, acc, next); break;
            default: group_dot<QT, 4, A>(pf, g, a, m0, acc, next); break;
          }
        };
        if (next.bytes > 0) rows_of(std::true_type());
        else rows_of(std::false_type());
        for (int m = 0; m < mr; ++m) _mm512_store_ps(res[m], acc[m]);
#elif defined(GG_AVX2)
        if constexpr (QT != Q8_0) {
          // Both 8-row halves in one pass over the group (two passes, the second from L2,
          // left the DRAM stream idle during the second: Q4_K streamed at 25 GB/s, 45 from cache)
          __m256 acc[8];
          const int nh = rows > 8 ? 2 : 1;
          if (nh == 2) {
            switch (mr) {
              case 1: group_dot_avx2<QT, 1, 2>(pf, g, a, m0, 0, acc); break;
              case 2: group_dot_avx2<QT, 2, 2>(pf, g, a, m0, 0, acc); break;
              case 3: group_dot_avx2<QT, 3, 2>(pf, g, a, m0, 0, acc); break;
              default: group_dot_avx2<QT, 4, 2>(pf, g, a, m0, 0, acc); break;
            }
          } else {
            switch (mr) {
              case 1: group_dot_avx2<QT, 1>(pf, g, a, m0, 0, acc); break;
              case 2: group_dot_avx2<QT, 2>(pf, g, a, m0, 0, acc); break;
              case 3: group_dot_avx2<QT, 3>(pf, g, a, m0, 0, acc); break;
              default: group_dot_avx2<QT, 4>(pf, g, a, m0, 0, acc); break;
            }
          }
          for (int h = 0; h < nh; ++h)
            for (int m = 0; m < mr; ++m) _mm256_store_ps(res[m] + 8 * h, acc[h * mr + m]);
        } else {
          switch (mr) {
            case 1: group_dot_generic<QT, 1>(pf, g, a, m0, res); break;
            case 2: group_dot_generic<QT, 2>(pf, g, a, m0, res); break;
            case 3: group_dot_generic<QT, 3>(pf, g, a, m0, res); break;
            default: group_dot_generic<QT, 4>(pf, g, a, m0, res); break;
          }
        }
#else
        switch (mr) {
          case 1: group_dot_generic<QT, 1>(pf, g, a, m0, res); break;
          case 2: group_dot_generic<QT, 2>(pf, g, a, m0, res); break;
          case 3: group_dot_generic<QT, 3>(pf, g, a, m0, res); break;
          default: group_dot_generic<QT, 4>(pf, g, a, m0, res); break;
        }
#endif
        for (int m = 0; m < mr; ++m)
          for (int r = 0; r < rows; ++r)
            y[(m0 + m) * ldy + n0 + r] = static_cast<OutT>(res[m][r] + (bias ? bias[n0 + r] : 0.f));
      }
    }
  });
}

#if defined(GG_VNNI)
// The unsigned values of `ngroups` consecutive groups (from w, ldg bytes apart), decoded once
// (unpack16) into dst [ngroups][K / 32][8][64 B]: the values group_dot2 would decode from the
// packed bytes for every GEMM_MR2 activation rows, decoded once per work item instead (the
// B-packing step of a GEMM). The scales stay in the packed group.
template <int QT>
inline void decode_groups(const PFmt& pf, const uint8_t* w, int64_t ldg, int64_t ngroups, int64_t K, uint8_t* dst) {
  const int64_t nsb = K / pf.sb, nb = K / 32;
  const int nsub = pf.sb / 32, subb = pf.sub_bytes();
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const uint8_t* g = w + gi * ldg;
    for (int64_t s = 0; s < nsb; ++s, g += pf.sb_bytes()) {
      const uint8_t* sub = g + pf.head_bytes();
      for (int j = 0; j < nsub; ++j, sub += subb) {
        __m512i u[8];
        unpack16<QT>(sub + (pf.scales ? 32 : 0), u);
        uint8_t* d = dst + ((gi * nb + s * nsub + j) * 8) * 64;
        for (int t = 0; t < 8; ++t) _mm512_storeu_si512(d + 64 * t, u[t]);
      }
    }
  }
}
#endif

// The prefill GEMM (M >= gemm_min_rows): work items are (chunk of >= ~32 KB of weight groups,
// block of GEMM_MC activation rows), dealt to the threads by for_each_chunk in N-major order (a
// thread's items share their weight chunk, which stays in L2 while the activation blocks stream
// from L2/L3); within an item each group is decoded once per GEMM_MR activation rows (VNNI:
// 8 rows, 8 zmm accumulators; AVX2: 4 rows, both 8-row halves of the group; portable: 4), the
// remainder rows in tiles of 4 or fewer. Each output element is computed by the same
// micro-kernel operations, in the same order, as the small-M path, so the results equal it
// bit for bit.
constexpr int64_t GEMM_MC = 128;       // activation rows per work item
#if defined(GG_VNNI)
constexpr int GEMM_MR = 8;   // one group (an odd last group of a chunk)
constexpr int GEMM_MR2 = 4;  // a pair of groups: group_dot2
#elif defined(GG_AVX2)
constexpr int GEMM_MR = 4;  // x both 8-row halves of the group: 8 rows' broadcasts feed 16 vpmaddubsw
#else
constexpr int GEMM_MR = 4;
#endif

template <int QT, int MR, typename OutT>
inline void gemm_tile(const PFmt& pf, const uint8_t* g, const PAct& a, int64_t m0, int64_t n0, int64_t rows,
                      const float* bias, OutT* y, int64_t ldy) {
  alignas(64) float res[MR][16];
#if defined(GG_VNNI)
  __m512 acc[MR];
  group_dot<QT, MR>(pf, g, a, m0, acc);
  for (int m = 0; m < MR; ++m) _mm512_store_ps(res[m], acc[m]);
#elif defined(GG_AVX2)
  if constexpr (QT == Q8_0) {  // (its sign trick per row left group_dot_avx2 no faster: measured)
    group_dot_generic<QT, MR>(pf, g, a, m0, res);
  } else if (rows > 8) {  // both halves in one pass: each activation broadcast feeds both
    __m256 acc[2 * MR];
    group_dot_avx2<QT, MR, 2>(pf, g, a, m0, 0, acc);
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MR; ++m) _mm256_store_ps(res[m] + 8 * h, acc[h * MR + m]);
  } else {
    __m256 acc[MR];
    group_dot_avx2<QT, MR>(pf, g, a, m0, 0, acc);
    for (int m = 0; m < MR; ++m) _mm256_store_ps(res[m], acc[m]);
  }
#else
  group_dot_generic<QT, MR>(pf, g, a, m0, res);
#endif
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < rows; ++r) y[(m0 + m) * ldy + n0 + r] = static_cast<OutT>(res[m][r] + (bias ? bias[n0 + r] : 0.f));
}

template <int QT, typename OutT>
void run_packed_gemm(const PFmt& pf, const uint8_t* w, int64_t ldg, const PAct& a, int64_t M, int64_t N,
                     const float* bias, OutT* y, int64_t ldy) {
  const int64_t groups = (N + G - 1) / G;
  const int64_t chunk = (std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, ldg)) + 1) / 2 * 2;  // even: pairs
  const int64_t nchunks = (groups + chunk - 1) / chunk, mblocks = (M + GEMM_MC - 1) / GEMM_MC;
#if defined(GG_VNNI)
  // The formats whose values take more than a mask and a shift to decode (Q5_*: a masked add
  // per vector, Q6_K: a shift and a ternary-logic op) read the pairs' values decoded once per
  // chunk (decode_groups) when the item has a full tile of rows; for Q4_* the extra stores and
  // loads cost what the decode saves (0.92-1.09x measured), Q8_0's are stored as used.
  constexpr bool DECODE = QT == Q5_0 || QT == Q5_1 || QT == Q5_K || QT == Q6_K;
  // Ahead for the pairs of 4-bit formats only: a Q8_0 pair and the next one overflow L1 (a
  // software prefetch fills L1 too on Zen 4), and its later tiles then read from L2: 0.72-0.96x
  // at 16-32 rows where the 4-bit formats gain 1.02-1.25x.
  constexpr bool AHEAD2 = QT == Q4_0 || QT == Q4_1 || QT == Q4_K;
  const int64_t ub_stride = (a.K / 32) * 8 * 64;  // one group's decoded values
  static std::atomic<int64_t> calls{0};
  const int64_t call = calls.fetch_add(1, std::memory_order_relaxed);
#endif
  for_each_chunk(nchunks * mblocks, 1, [&](int64_t i_begin, int64_t i_end) {
    for (int64_t item = i_begin; item < i_end; ++item) {
      const int64_t g_begin = item / mblocks * chunk, g_end = std::min(groups, g_begin + chunk);
      const int64_t m_begin = item % mblocks * GEMM_MC, m_end = std::min(M, m_begin + GEMM_MC);
      int64_t gi = g_begin;
#if defined(GG_VNNI)
      const uint8_t* ub = nullptr;
      const int64_t pairs_end = g_begin + (g_end - g_begin) / 2 * 2;
      if (DECODE && pairs_end > g_begin && m_end - m_begin >= GEMM_MR2) {
        // this thread's buffer, kept while its items share the chunk (items go N-major)
        thread_local std::vector<uint8_t> buf;
        thread_local int64_t buf_call = -1, buf_chunk = -1;
        const size_t need = static_cast<size_t>((pairs_end - g_begin) * ub_stride) + 64;
        if (buf.size() < need) {
          buf.resize(need);
          buf_call = -1;
        }
        uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
        if (buf_call != call || buf_chunk != g_begin) {
          decode_groups<QT>(pf, w + g_begin * ldg, ldg, pairs_end - g_begin, a.K, base);
          buf_call = call;
          buf_chunk = g_begin;
        }
        ub = base;
      }
      for (; gi + 2 <= g_end; gi += 2) {  // pairs of groups: group_dot2
        const uint8_t* g = w + gi * ldg;
        const uint8_t* ubg = ub ? ub + (gi - g_begin) * ub_stride : nullptr;
        const int64_t n0 = gi * G, rows = std::min<int64_t>(2 * G, N - n0);
        int64_t m0 = m_begin;
        // tiles of MRc activation rows against the pair, its values decoded once (decode_groups;
        // 6 rows a tile measured no faster than 4) or per tile
        auto tiles = [&](auto mr, auto decoded) {
          constexpr int MRc = decltype(mr)::value;
          // the next pair (Ahead; the next chunk of a thread's range is contiguous with this
          // one), not where the values come decoded from the chunk buffer
          constexpr bool may_ahead = AHEAD2 && !decltype(decoded)::value;
          const int64_t tiles = (m_end - m0) / MRc;
          const bool ahead = may_ahead && tiles < 8 && gi + 4 <= groups;
          for (int64_t tile = 0; m0 + MRc <= m_end; m0 += MRc, ++tile) {
            __m512 acc[2][MRc];
            if constexpr (may_ahead) {
              if (ahead && tile > 0)
                group_dot2<QT, MRc, false, true>(pf, g, ldg, a, m0, acc, ubg, ub_stride,
                                                 Ahead::slice(g + 2 * ldg, 2 * ldg, tile, tiles, a.K / 32));
              else
                group_dot2<QT, MRc, false>(pf, g, ldg, a, m0, acc, ubg, ub_stride);
            } else {
              group_dot2<QT, MRc, decltype(decoded)::value>(pf, g, ldg, a, m0, acc, ubg, ub_stride);
            }
            alignas(64) float res[32];
            for (int m = 0; m < MRc; ++m) {
              _mm512_store_ps(res, acc[0][m]);
              _mm512_store_ps(res + 16, acc[1][m]);
              for (int r = 0; r < rows; ++r) y[(m0 + m) * ldy + n0 + r] = static_cast<OutT>(res[r] + (bias ? bias[n0 + r] : 0.f));
            }
          }
        };
        if constexpr (DECODE) {
          if (ubg) tiles(std::integral_constant<int, GEMM_MR2>(), std::true_type());
        }
        tiles(std::integral_constant<int, GEMM_MR2>(), std::false_type());  // (values not decoded: no chunk buffer)
        for (; m0 < m_end; m0 += 4) {  // the remainder rows, one group at a time
          for (int k = 0; k < 2; ++k) {
            const int64_t rk = std::min<int64_t>(G, N - n0 - k * G);
            switch (std::min<int64_t>(4, m_end - m0)) {
              case 1: gemm_tile<QT, 1>(pf, g + k * ldg, a, m0, n0 + k * G, rk, bias, y, ldy); break;
              case 2: gemm_tile<QT, 2>(pf, g + k * ldg, a, m0, n0 + k * G, rk, bias, y, ldy); break;
              case 3: gemm_tile<QT, 3>(pf, g + k * ldg, a, m0, n0 + k * G, rk, bias, y, ldy); break;
              default: gemm_tile<QT, 4>(pf, g + k * ldg, a, m0, n0 + k * G, rk, bias, y, ldy); break;
            }
          }
        }
      }
#endif
      for (; gi < g_end; ++gi) {
        const uint8_t* g = w + gi * ldg;
        const int64_t n0 = gi * G, rows = std::min<int64_t>(G, N - n0);
        int64_t m0 = m_begin;
        for (; m0 + GEMM_MR <= m_end; m0 += GEMM_MR) gemm_tile<QT, GEMM_MR>(pf, g, a, m0, n0, rows, bias, y, ldy);
        for (; m0 < m_end; m0 += 4) {
          switch (std::min<int64_t>(4, m_end - m0)) {
            case 1: gemm_tile<QT, 1>(pf, g, a, m0, n0, rows, bias, y, ldy); break;
            case 2: gemm_tile<QT, 2>(pf, g, a, m0, n0, rows, bias, y, ldy); break;
            case 3: gemm_tile<QT, 3>(pf, g, a, m0, n0, rows, bias, y, ldy); break;
            default: gemm_tile<QT, 4>(pf, g, a, m0, n0, rows, bias, y, ldy); break;
          }
        }
      }
    }
  });
}

template <typename OutT>
void dispatch_packed(int qt, const uint8_t* w, int64_t ldg, const PAct& a, int64_t M, int64_t N, const float* bias,
                     OutT* y, int64_t ldy) {
  const PFmt pf = pfmt(qt);
  switch (qt) {
    case Q4_0: return run_packed<Q4_0>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q4_1: return run_packed<Q4_1>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q5_0: return run_packed<Q5_0>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q5_1: return run_packed<Q5_1>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q8_0: return run_packed<Q8_0>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q4_K: return run_packed<Q4_K>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q5_K: return run_packed<Q5_K>(pf, w, ldg, a, M, N, bias, y, ldy);
    case Q6_K: return run_packed<Q6_K>(pf, w, ldg, a, M, N, bias, y, ldy);
    default: TORCH_CHECK(false, "qtype: GGML type ", qt, " is not supported");
  }
}

}  // namespace

// The instruction set the integer products use: "avx512_vnni", "avx2" or "scalar".
std::string gguf_isa() {
#if defined(GG_VNNI)
  return "avx512_vnni";
#elif defined(GG_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// out[M, N] (row stride out.stride(0), in x's dtype) = x[M, K] W^T + bias, W the stored rows
// raw uint8 [N, K / block * bytes] (row stride raw.stride(0)) of GGML type qtype.
void gguf_linear(torch::Tensor x, torch::Tensor raw, int64_t qtype, int64_t N, int64_t K,
                 c10::optional<torch::Tensor> bias, torch::Tensor out) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(block_bytes(qt) > 0, "qtype: GGML type ", qtype, " is not supported");
  TORCH_CHECK(K > 0 && K % block_elems(qt) == 0, "K: a positive multiple of ", block_elems(qt));
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1, "x: CPU [M, K], contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(0) == N &&
                  raw.size(1) == K / block_elems(qt) * block_bytes(qt) && raw.stride(1) == 1,
              "raw: uint8 [N, row bytes], contiguous rows");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  (M == 0 || out.stride(1) == 1),
              "out: [M, N] of x's dtype, contiguous rows");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const int64_t nb = K / 32;
  const auto q = uninit<int8_t>(M * K);
  const auto d = uninit<float>(M * nb), s16 = uninit<float>(M * 2 * nb), s32 = uninit<float>(M * nb);
  if (x.scalar_type() == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, q.get(), d.get(), s16.get(), s32.get());
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, q.get(), d.get(), s16.get(), s32.get());
  const Act a{q.get(), d.get(), s16.get(), s32.get(), K};
  const int64_t ldy = M > 1 ? out.stride(0) : N;
  if (x.scalar_type() == torch::kFloat32)
    dispatch(qt, raw.data_ptr<uint8_t>(), raw.stride(0), a, M, N, bp, out.data_ptr<float>(), ldy);
  else
    dispatch(qt, raw.data_ptr<uint8_t>(), raw.stride(0), a, M, N, bp, out.data_ptr<c10::BFloat16>(), ldy);
}

// out [N, K] (float32 or bfloat16, contiguous) = raw uint8 [N, row bytes] (contiguous rows)
// of GGML type qtype, dequantized (bit-exact with gguf.quants.dequantize in float32).
void gguf_dequantize(torch::Tensor raw, int64_t qtype, int64_t N, int64_t K, torch::Tensor out) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(block_bytes(qt) > 0, "qtype: GGML type ", qtype, " is not supported");
  TORCH_CHECK(K > 0 && K % block_elems(qt) == 0, "K: a positive multiple of ", block_elems(qt));
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(0) == N &&
                  raw.size(1) == K / block_elems(qt) * block_bytes(qt) && raw.stride(1) == 1,
              "raw: uint8 [N, row bytes], contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K &&
                  (out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16),
              "out: contiguous float32 or bfloat16 [N, K]");
  if (N == 0) return;
  if (out.scalar_type() == torch::kFloat32)
    dequantize_dispatch(qt, raw.data_ptr<uint8_t>(), raw.stride(0), N, K, out.data_ptr<float>());
  else
    dequantize_dispatch(qt, raw.data_ptr<uint8_t>(), raw.stride(0), N, K, out.data_ptr<c10::BFloat16>());
}

// The arguments of gguf_pack / gguf_pack_fast checked; returns the GGML type.
int check_pack_args(const torch::Tensor& raw, int64_t qtype, int64_t N, int64_t K) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(block_bytes(qt) > 0, "qtype: GGML type ", qtype, " is not supported");
  TORCH_CHECK(N > 0 && K > 0 && K % block_elems(qt) == 0, "K: a positive multiple of ", block_elems(qt));
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(0) == N &&
                  raw.size(1) == K / block_elems(qt) * block_bytes(qt) && raw.stride(1) == 1,
              "raw: uint8 [N, row bytes], contiguous rows");
  return qt;
}

// packed uint8 [ceil(N / 16), K / SB * group super-block bytes]: raw uint8 [N, row bytes] of
// GGML type qtype (rows contiguous, row stride raw.stride(0)) in the interleaved layout above.
torch::Tensor gguf_pack(torch::Tensor raw, int64_t qtype, int64_t N, int64_t K) {
  const int qt = check_pack_args(raw, qtype, N, K);
  const PFmt pf = pfmt(qt);
  const int64_t groups = (N + G - 1) / G, nsb = K / pf.sb, ldg = nsb * pf.sb_bytes();
  torch::Tensor packed = torch::zeros({groups, ldg}, torch::kUInt8);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t ldr = raw.stride(0), bb = block_bytes(qt);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Fields f;
    for (int64_t gi = begin; gi < end; ++gi)
      for (int r = 0; r < G && gi * G + r < N; ++r)
        for (int64_t s = 0; s < nsb; ++s) {
          decode_fields(qt, src + (gi * G + r) * ldr + s * bb, f);
          place_fields(pf, f, r, dst + gi * ldg + s * pf.sb_bytes());
        }
  });
  return packed;
}

// The arguments of a weight gguf_pack packed (gguf_unpack, gguf_embedding) checked; returns the GGML type.
int check_packed_args(const torch::Tensor& packed, int64_t qtype, int64_t N, int64_t K) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(block_bytes(qt) > 0, "qtype: GGML type ", qtype, " is not supported");
  TORCH_CHECK(N > 0 && K > 0 && K % block_elems(qt) == 0, "K: a positive multiple of ", block_elems(qt));
  const PFmt pf = pfmt(qt);
  const int64_t groups = (N + G - 1) / G, ldg = K / pf.sb * pf.sb_bytes();
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(0) == groups && packed.size(1) == ldg,
              "packed: uint8 [", groups, ", ", ldg, "] (gguf_pack's result)");
  return qt;
}

// The stored rows back: raw uint8 [N, row bytes] from gguf_pack's result (byte-exact).
torch::Tensor gguf_unpack(torch::Tensor packed, int64_t qtype, int64_t N, int64_t K) {
  const int qt = check_packed_args(packed, qtype, N, K);
  const PFmt pf = pfmt(qt);
  const int64_t groups = (N + G - 1) / G, nsb = K / pf.sb, ldg = nsb * pf.sb_bytes(), bb = block_bytes(qt);
  torch::Tensor raw = torch::empty({N, nsb * bb}, torch::kUInt8);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = raw.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Fields f;
    for (int64_t gi = begin; gi < end; ++gi)
      for (int r = 0; r < G && gi * G + r < N; ++r)
        for (int64_t s = 0; s < nsb; ++s) {
          gather_fields(pf, src + gi * ldg + s * pf.sb_bytes(), r, f);
          encode_fields(qt, f, dst + (gi * G + r) * nsb * bb + s * bb);
        }
  });
  return raw;
}

// out [T, K] (float32 or bfloat16, contiguous) = rows ids[t] (int64 [T], each in [0, N)) of the
// weight gguf_pack packed: each row's super-blocks gathered from its 16-row group and
// re-encoded as stored (gather_fields / encode_fields, byte-exact), then dequantized as
// gguf_dequantize does (the same floats). The token embedding's lookup over a packed table:
// only the looked-up rows are touched (unpacking their whole groups took ~0.1 ms a step).
// Raises IndexError (TORCH_CHECK_INDEX) for an id outside [0, N).
void gguf_embedding(torch::Tensor packed, torch::Tensor ids, int64_t qtype, int64_t N, int64_t K, torch::Tensor out) {
  const int qt = check_packed_args(packed, qtype, N, K);
  const PFmt pf = pfmt(qt);
  const int64_t nsb = K / pf.sb, ldg = nsb * pf.sb_bytes(), bb = block_bytes(qt);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "ids: contiguous int64 [T]");
  const int64_t T = ids.size(0);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 && out.size(0) == T && out.size(1) == K &&
                  (out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16),
              "out: contiguous float32 or bfloat16 [T, K]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK_INDEX(id[t] >= 0 && id[t] < N, "ids: values must lie in [0, ", N, "), got ", id[t]);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const bool f32 = out.scalar_type() == torch::kFloat32;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(static_cast<size_t>(nsb * bb));
    Fields f;
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* g = src + (id[t] / G) * ldg;
      const int r = static_cast<int>(id[t] % G);
      for (int64_t s = 0; s < nsb; ++s) {
        gather_fields(pf, g + s * pf.sb_bytes(), r, f);
        encode_fields(qt, f, row.data() + s * bb);
      }
      if (f32) dequantize_row_dispatch(qt, row.data(), K, out.data_ptr<float>() + t * K);
      else dequantize_row_dispatch(qt, row.data(), K, out.data_ptr<c10::BFloat16>() + t * K);
    }
  });
}

// gguf_pack's layout, built at load in one pass: for each group of 16 rows and each
// super-block, the 16 rows' stored blocks are decoded (decode_fields) and every byte of the
// group's packed super-block is written once, in order (gguf_pack places one element at a time
// with a read-modify-write of its byte: ~0.1 GB/s; this writes whole vectors: several GB/s).
// Byte-exact with gguf_pack (tests/layers/test_gguf_kernels.py compares them for each format);
// rows past N (padding of the last group) are zero. The result is not zero-filled first.
void pack_group_sb(const PFmt& pf, const Fields* f, uint8_t* g) {
  for (int r = 0; r < G; ++r) wr16(g + 2 * r, f[r].D);
  if (pf.has_m)
    for (int r = 0; r < G; ++r) wr16(g + 32 + 2 * r, f[r].M);
  uint8_t* sub = g + pf.head_bytes();
  for (int j = 0; j < pf.sb / 32; ++j, sub += pf.sub_bytes()) {
    uint8_t* q = sub;
    if (pf.scales == 1) {
      for (int r = 0; r < G; ++r) {
        q[r] = f[r].sc[j];
        q[16 + r] = f[r].mn[j];
      }
      q += 32;
    } else if (pf.scales == 2) {
      for (int r = 0; r < G; ++r) {
        q[r] = f[r].sc[2 * j];
        q[16 + r] = f[r].sc[2 * j + 1];
      }
      q += 32;
    }
    if (pf.bits == 8) {
      for (int t = 0; t < 8; ++t)
        for (int r = 0; r < G; ++r) std::memcpy(q + 64 * t + 4 * r, f[r].u + 32 * j + 4 * t, 4);
      continue;
    }
    // N_t = U_t | U_t+4 << 4 (t = 0..3): four bytes of row r per vector
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < G; ++r) {
        const uint8_t* u = f[r].u + 32 * j + 4 * t;
        uint32_t lo, hi;
        std::memcpy(&lo, u, 4);
        std::memcpy(&hi, u + 16, 4);
        const uint32_t v = (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
        std::memcpy(q + 64 * t + 4 * r, &v, 4);
      }
    if (pf.bits == 5) {
      for (int t = 0; t < 8; ++t) {  // bit p = 4 r + e of word t: the 5th bit of element 4 t + e of row r
        uint64_t w = 0;
        for (int r = 0; r < G; ++r) {
          const uint8_t* u = f[r].u + 32 * j + 4 * t;
          for (int e = 0; e < 4; ++e) w |= static_cast<uint64_t>((u[e] >> 4) & 1) << (4 * r + e);
        }
        std::memcpy(q + 256 + 8 * t, &w, 8);
      }
    } else if (pf.bits == 6) {
      for (int k = 0; k < 2; ++k)  // byte p of H_k, bits 2i, 2i+1: the two high bits of U_4k+i
        for (int r = 0; r < G; ++r) {
          const uint8_t* u = f[r].u + 32 * j + 16 * k;
          for (int e = 0; e < 4; ++e) {
            uint8_t h = 0;
            for (int i = 0; i < 4; ++i) h |= static_cast<uint8_t>(((u[4 * i + e] >> 4) & 3) << (2 * i));
            q[256 + 64 * k + 4 * r + e] = h;
          }
        }
    }
  }
}

inline uint32_t ld32u(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void st32u(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// The 16 rows' stored super-blocks b[r] straight into the packed super-block g, for the
// formats whose quantized bytes map to the packed vectors with whole-word operations (Q4_0,
// Q4_1, Q8_0, Q4_K, Q6_K; the others go through Fields): returns false for the others.
bool pack_group_sb_direct(int qt, const PFmt& pf, const uint8_t* const* b, uint8_t* g) {
  switch (qt) {
    case Q4_0: case Q4_1: {  // N_t of row r = the stored nibble bytes 4t..4t+3 as they are
      const int off = qt == Q4_0 ? 2 : 4;
      for (int r = 0; r < G; ++r) {
        std::memcpy(g + 2 * r, b[r], 2);
        if (qt == Q4_1) std::memcpy(g + 32 + 2 * r, b[r] + 2, 2);
        for (int t = 0; t < 4; ++t) std::memcpy(g + pf.head_bytes() + 64 * t + 4 * r, b[r] + off + 4 * t, 4);
      }
      return true;
    }
    case Q8_0:
      for (int r = 0; r < G; ++r) {
        std::memcpy(g + 2 * r, b[r], 2);
        for (int t = 0; t < 8; ++t) st32u(g + 32 + 64 * t + 4 * r, ld32u(b[r] + 2 + 4 * t) ^ 0x80808080u);
      }
      return true;
    case Q4_K:
      for (int r = 0; r < G; ++r) {
        std::memcpy(g + 2 * r, b[r], 2);
        std::memcpy(g + 32 + 2 * r, b[r] + 2, 2);
        for (int j = 0; j < 8; ++j) {
          uint8_t* sub = g + 64 + j * pf.sub_bytes();
          int sc, mn;
          scale_min_k4(j, b[r] + 4, sc, mn);
          sub[r] = static_cast<uint8_t>(sc);
          sub[16 + r] = static_cast<uint8_t>(mn);
          const uint8_t* q = b[r] + 16 + 32 * (j >> 1);
          for (int t = 0; t < 4; ++t) {
            const uint32_t lo = ld32u(q + 4 * t), hi = ld32u(q + 16 + 4 * t);
            const uint32_t v = (j & 1) ? ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u)
                                       : (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
            st32u(sub + 32 + 64 * t + 4 * r, v);
          }
        }
      }
      return true;
    case Q6_K:
      for (int r = 0; r < G; ++r) {
        std::memcpy(g + 2 * r, b[r] + 208, 2);
        for (int j = 0; j < 8; ++j) {
          uint8_t* sub = g + 32 + j * pf.sub_bytes();
          sub[r] = b[r][192 + 2 * j];
          sub[16 + r] = b[r][192 + 2 * j + 1];
          const int h = j >> 2, jj = j & 3;
          const uint8_t* ql = b[r] + 64 * h + 32 * (jj & 1);
          const uint8_t* qh = b[r] + 128 + 32 * h;
          for (int t = 0; t < 4; ++t) {
            const uint32_t lo = ld32u(ql + 4 * t), hi = ld32u(ql + 16 + 4 * t);
            const uint32_t v = jj >= 2 ? ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u)
                                       : (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
            st32u(sub + 32 + 64 * t + 4 * r, v);
          }
          for (int k = 0; k < 2; ++k) {  // H_k, bits 2i: the high bits of element 16 k + 4 i + e
            uint32_t hv = 0;
            for (int i = 0; i < 4; ++i) hv |= ((ld32u(qh + 16 * k + 4 * i) >> (2 * jj)) & 0x03030303u) << (2 * i);
            st32u(sub + 32 + 256 + 64 * k + 4 * r, hv);
          }
        }
      }
      return true;
    default:
      return false;
  }
}

// gguf_pack's result (same arguments, same bytes), written in one pass (pack_group_sb_direct,
// else pack_group_sb); a missing row of the last group reads a stored block that decodes to
// zero fields (encode_fields of zeros), so its packed bytes are the zeros gguf_pack leaves.
// out: where to write it (uint8 [ceil(N / 16), group bytes], contiguous; e.g. huge-page
// memory, kvflow/huge_pages.py), or none: a new tensor.
torch::Tensor gguf_pack_fast(torch::Tensor raw, int64_t qtype, int64_t N, int64_t K, c10::optional<torch::Tensor> out) {
  const int qt = check_pack_args(raw, qtype, N, K);
  const PFmt pf = pfmt(qt);
  const int64_t groups = (N + G - 1) / G, nsb = K / pf.sb, ldg = nsb * pf.sb_bytes();
  torch::Tensor packed;
  if (out.has_value()) {
    packed = *out;
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                    packed.dim() == 2 && packed.size(0) == groups && packed.size(1) == ldg,
                "out: contiguous uint8 [", groups, ", ", ldg, "] on the CPU");
  } else {
    packed = torch::empty({groups, ldg}, torch::kUInt8);
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t ldr = raw.stride(0), bb = block_bytes(qt);
  // One stored super-block (sb / block elements blocks) that decodes to zero fields.
  std::vector<uint8_t> zero(static_cast<size_t>(pf.sb / block_elems(qt) * bb));
  for (int64_t i = 0; i < pf.sb / block_elems(qt); ++i) encode_fields(qt, Fields(), zero.data() + i * bb);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Fields f[G];
    const uint8_t* rows[G];
    for (int64_t gi = begin; gi < end; ++gi) {
      const int n = static_cast<int>(std::min<int64_t>(G, N - gi * G));
      for (int64_t s = 0; s < nsb; ++s) {
        // (the stored row's super-block: its sb / block elements blocks, contiguous)
        for (int r = 0; r < G; ++r) rows[r] = r < n ? src + (gi * G + r) * ldr + s * pf.sb / block_elems(qt) * bb : zero.data();
        uint8_t* g = dst + gi * ldg + s * pf.sb_bytes();
        if (pack_group_sb_direct(qt, pf, rows, g)) continue;
        for (int r = 0; r < G; ++r) decode_fields(qt, rows[r], f[r]);
        pack_group_sb(pf, f, g);
      }
    }
  });
  return packed;
}

// out[M, N] (row stride out.stride(0), x's dtype) = x[M, K] W^T + bias with W packed by gguf_pack.
void gguf_linear_packed(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias, torch::Tensor out) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(block_bytes(qt) > 0, "qtype: GGML type ", qtype, " is not supported");
  TORCH_CHECK(K > 0 && K % block_elems(qt) == 0, "K: a positive multiple of ", block_elems(qt));
  const PFmt pf = pfmt(qt);
  const int64_t groups = (N + G - 1) / G, ldg = K / pf.sb * pf.sb_bytes();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1, "x: CPU [M, K], contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(0) == groups && packed.size(1) == ldg,
              "packed: uint8 [", groups, ", ", ldg, "] (gguf_pack's result)");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  (M == 0 || out.stride(1) == 1),
              "out: [M, N] of x's dtype, contiguous rows");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const int64_t nb = K / 32;
  // uninitialized (quantize_rows writes every element): a zero-filled M x K buffer was ~2 % of a prefill
  const auto q = uninit<int8_t>(M * K);
  const auto d = uninit<float>(M * nb), s16 = uninit<float>(M * 2 * nb), s32 = uninit<float>(M * nb);
  const auto i16 = uninit<int32_t>(M * 2 * nb);
  if (x.scalar_type() == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, q.get(), d.get(), s16.get(), s32.get(), i16.get());
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, q.get(), d.get(), s16.get(), s32.get(), i16.get());
  const PAct a{q.get(), d.get(), s32.get(), i16.get(), K};
  const int64_t ldy = M > 1 ? out.stride(0) : N;
  if (x.scalar_type() == torch::kFloat32)
    dispatch_packed(qt, packed.data_ptr<uint8_t>(), ldg, a, M, N, bp, out.data_ptr<float>(), ldy);
  else
    dispatch_packed(qt, packed.data_ptr<uint8_t>(), ldg, a, M, N, bp, out.data_ptr<c10::BFloat16>(), ldy);
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py);
// left out where fused_decode.cpp includes this file for its routines.
#ifndef KVFLOW_NO_BINDINGS
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_isa", &gguf_isa, "gguf_isa");
  m.def("gguf_linear", &gguf_linear, "gguf_linear", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_pack_rows", []() { return static_cast<int64_t>(G); }, "rows per group of the packed layout");
  m.def("gguf_pack", &gguf_pack, "gguf_pack", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_pack_fast", &gguf_pack_fast, "gguf_pack_fast", pybind11::arg("raw"), pybind11::arg("qtype"),
        pybind11::arg("N"), pybind11::arg("K"), pybind11::arg("out") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_unpack", &gguf_unpack, "gguf_unpack", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_linear_packed", &gguf_linear_packed, "gguf_linear_packed", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_embedding", &gguf_embedding, "gguf_embedding");
  m.def("gguf_dequantize", &gguf_dequantize, "gguf_dequantize", pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif  // KVFLOW_NO_BINDINGS
