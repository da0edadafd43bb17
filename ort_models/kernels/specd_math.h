/* Math the kernels share, the same bits on every path: exp for x <= 0 (softmax arguments,
 * the sigmoid's exp(-|x|)) as Cephes' expf polynomial, ~1 ulp, 0 below -87; the AVX2 form
 * runs the same operations lane by lane (no FMA: the sources build with -ffp-contract=off). */
#ifndef SPECD_MATH_H
#define SPECD_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* SPECD_AVX2: the float vector paths (AVX2, FMA, F16C) of the kernels including this
 * header are compiled; their plain C paths give the same bits */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECD_AVX2 1
#endif

static inline float exp_scalar(float x) {
  if (x < -87.0f) return 0.0f;
  float fx = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  int32_t bits;
  memcpy(&bits, &y, 4);
  bits += (int32_t)fx << 23;
  memcpy(&y, &bits, 4);
  return y;
}

#if SPECD_AVX2
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                            _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_add_epi32(_mm256_castps_si256(y),
                                  _mm256_slli_epi32(_mm256_cvtps_epi32(fx), 23));
  return _mm256_andnot_ps(zero_mask, _mm256_castsi256_ps(bits));
}
#endif

#endif
