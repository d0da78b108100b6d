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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GG_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define GG_VNNI 1
#endif
#endif

namespace {

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
// scaled sums d * sum(q) per 16 elements [M, K/16]; s32 the same per 32 [M, K/32].
struct Act {
  const int8_t* q;
  const float* d;
  const float* s16;
  const float* s32;
  int64_t K;
};

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s16, float* s32) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    float buf[32];
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * ldx;
      for (int64_t b = 0; b < nb; ++b) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) {
          buf[i] = static_cast<float>(xr[b * 32 + i]);
          amax = std::max(amax, std::fabs(buf[i]));
        }
        const float db = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* qb = q + m * K + b * 32;
        int sum[2] = {0, 0};
#if defined(GG_AVX2)
        __m256i iv[4];
        for (int c = 0; c < 4; ++c)
          iv[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(buf + 8 * c), _mm256_set1_ps(id)),
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
void dequantize_rows(const uint8_t* w, int64_t ldw, int64_t N, int64_t K, OutT* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    alignas(32) uint8_t q[32];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wr = w + n * ldw;
      OutT* o = out + n * K;
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
  });
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
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb), s16(M * 2 * nb), s32(M * nb);
  if (x.scalar_type() == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, q.data(), d.data(), s16.data(), s32.data());
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, q.data(), d.data(), s16.data(), s32.data());
  const Act a{q.data(), d.data(), s16.data(), s32.data(), K};
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

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_isa", &gguf_isa, "gguf_isa");
  m.def("gguf_linear", &gguf_linear, "gguf_linear", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_dequantize", &gguf_dequantize, "gguf_dequantize", pybind11::call_guard<pybind11::gil_scoped_release>());
}
