// kvflow C++ CPU kernels: e^x on float32 vectors (Cephes expf: the exponent split by ln 2 in
// two parts, a degree-6 polynomial on [-ln2/2, ln2/2], within 2 ulp), shared by
// paged_attention.cpp (softmax), activation.cpp (SiLU) and, through paged_attention.cpp,
// fused_decode.cpp. Each kernel that includes it names it in its CppKernel's ``includes``
// (kvflow/ops/__init__.py), so a change here rebuilds them.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// e^x on 16 lanes for x <= 0 (2^n by vscalefps): 0 below -87.3 (ordered), NaN stays NaN.
static inline __m512 exp_neg16(__m512 x) {
  const __m512 c = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // x second: a NaN x stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  // unless x < -87.3 (ordered): a NaN score stays NaN and poisons the row, as elsewhere
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// e^c on 8 lanes for -87.3 <= c <= 88 (Cephes expf: the exponent split by ln 2 in two parts, a
// degree-6 polynomial on [-ln2/2, ln2/2], 2^n through the exponent bits; within 2 ulp); the
// callers clamp or mask outside that range. Also the fused decode step's SiLU (fused_decode.cpp).
static inline __m256 exp8_cephes(__m256 c) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// e^x on 8 lanes for x <= 0: 0 below -87.3 (ordered), NaN stays NaN (exp_neg16's contract).
static inline __m256 exp_neg8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 y = exp8_cephes(_mm256_max_ps(lo, x));  // x second: a NaN x stays NaN
  return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_NLT_UQ));
}
#endif
