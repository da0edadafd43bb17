/* specd.GgufMatMul: Y = A @ W^T with W kept in GGUF's own block layout.
 *
 *   A  float32 [..., K]        activations
 *   W  uint8   [ceil(N/16), nb * group bytes] GGUF rows (a row is an output channel) in
 *                                            groups of 16, see below and gguf_layouts.py
 *   B  float32 [N]             optional bias, added to each row of Y (as an Add would)
 *   Y  float32 [..., N]
 *   attributes: ggml_type (12 = Q4_K, 14 = Q6_K), K, N (rows of W hold ceil(K/256)
 *               superblocks, a Q4_K row's last one only its sub-blocks of 32 up to K;
 *               A's values past K count as zeros)
 *
 * Arithmetic (the contract tests/numpy_reference.py's gguf_matmul reproduces bit for bit):
 * each row of A is quantized per 256 values to int8, q = rint(a * (127 / amax)),
 * da = amax / 127 (da = 0 and q = 0 where amax = 0). Per superblock the integer dot
 * products are exact; the float32 combination, in superblock order, is
 *   Q4_K: y += da * (d * isum - dmin * imin)
 *         isum = sum_j sc[j] * sum_{i in j} q4[i] a[i]     (8 sub-blocks of 32)
 *         imin = sum_j  m[j] * sum_{i in j} a[i]
 *   Q6_K: y += da * (d * isum)
 *         isum = sum_j sc[j] * sum_{i in j} (q6[i] - 32) a[i]   (16 sub-blocks of 16)
 * Every (row of A, row of W) pair runs the same sequence of float operations whatever
 * the number of rows in the call, the tiling or the thread that computes it, so a row of
 * a multi-token call equals a single-token call bit for bit (speculative verification
 * relies on it). Built with -ffp-contract=off so that no FMA changes the rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specd_ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define SPECD_AVX2 1
#endif

enum { QK_K = 256, TYPE_Q4_K = 12, TYPE_Q6_K = 14 };
enum { ROW_TILE = 16, COL_TILE = 4, MAX_TASKS = 256 };

/* ---------------------------------------------------------------------------------- */
/* numbers                                                                             */

/* Activations of a call, quantized: q [M, K], d [M, K/256], sums of 16 and of 32
   (|sum| <= 32 * 127 fits 16 bits); and how W ends: Q4_K rows whose K stops short of a
   whole superblock hold only the sub-blocks of 32 that K reaches in their last one
   (`trim` sub-blocks fewer; the values past K are zeros in A, so the integer sums are
   the same as over zero-padded blocks, without reading their codes). */
typedef struct {
  int8_t *q;
  float *d;
  int16_t *sum16;
  int16_t *sum32;
  size_t k;
  int trim; /* Q4_K: sub-blocks of 32 missing from the last superblock of each row group */
} Act;

/* x [k_in] -> k (a multiple of 256, >= k_in) quantized values, zeros past k_in */
static void quantize_row(const float *x, size_t k_in, size_t k, int8_t *q, float *d,
                         int16_t *s16, int16_t *s32) {
  float tail[QK_K];
  for (size_t b = 0; b < k / QK_K; b++) {
    const float *xb = x + b * QK_K;
    if ((b + 1) * QK_K > k_in) { /* the last, partial superblock */
      memset(tail, 0, sizeof tail);
      memcpy(tail, xb, (k_in - b * QK_K) * sizeof(float));
      xb = tail;
    }
    int8_t *qb = q + b * QK_K;
    float amax = 0.0f;
    for (int i = 0; i < QK_K; i++) {
      float v = fabsf(xb[i]);
      amax = v > amax ? v : amax;
    }
    if (amax == 0.0f) {
      d[b] = 0.0f;
      memset(qb, 0, QK_K);
    } else {
      const float id = 127.0f / amax;
      d[b] = amax / 127.0f;
#if SPECD_AVX2
      const __m256 vid = _mm256_set1_ps(id);
      for (int i = 0; i < QK_K; i += 32) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), vid));
        __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);
        __m256i bytes = _mm256_packs_epi16(w01, w23); /* lanes interleaved by 128 bits */
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qb + i), bytes);
      }
#else
      for (int i = 0; i < QK_K; i++) qb[i] = (int8_t)nearbyintf(xb[i] * id);
#endif
    }
  }
  for (size_t j = 0; j < k / 16; j++) {
    int s = 0;
    for (int i = 0; i < 16; i++) s += q[j * 16 + i];
    s16[j] = (int16_t)s;
  }
  for (size_t j = 0; j < k / 32; j++) s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
}

/* ---------------------------------------------------------------------------------- */
/* Weights: GGUF blocks of 16 rows interleaved (ort_models/gguf_layouts.py writes them),  */
/* so one 32-bit lane of a 512-bit vector holds one row (two 256-bit vectors: rows 0-7,  */
/* 8-15), the per-block scales of 16 rows load as a vector, and a row group is read as   */
/* one sequential stream.                                                               */
/*                                                                                      */
/* Q4_K, 2368 bytes per superblock of 16 rows:                                          */
/*   d[16] f16 | dmin[16] f16 | sc[8 sub][16 rows] u8 | m[8 sub][16 rows] u8 |         */
/*   codes: per sub-block j, per p < 4, 64 bytes; byte 4r+e holds row r's code          */
/*   32j+8p+e (low nibble) and 32j+8p+4+e (high nibble); where K ends inside a           */
/*   superblock, the group's last one keeps only the codes of the sub-blocks K reaches    */
/* Q6_K, 3360 bytes per superblock of 16 rows:                                          */
/*   d[16] f16 | sc[16 sub][16 rows] i8 | per sub-block j, 192 bytes: low nibbles, per  */
/*   p < 2, 64 bytes, byte 4r+e: code 16j+8p+e (low), 16j+8p+4+e (high) | high 2 bits,  */
/*   64 bytes, byte 4r+e: bits 2t..2t+1 = code 16j+4t+e >> 4                            */

enum { GROUP = 16, HALF = 8, Q4_K_GROUP_BYTES = 2368, Q6_K_GROUP_BYTES = 3360 };
enum { Q4_K_SC = 64, Q4_K_MN = 192, Q4_K_QS = 320, Q4_K_SUB_BYTES = 256, Q6_K_SC = 32,
       Q6_K_QL = 288 };

static inline void load_f16(const uint8_t *p, int n, float *out) {
  for (int r = 0; r < n; r++) out[r] = specd_f16_to_f32(p + 2 * r);
}

#if SPECD_AVX2
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#if defined(__F16C__)
#define LOAD_F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
static inline __m256 LOAD_F16X8(const uint8_t *p) {
  float f[HALF];
  load_f16(p, HALF, f);
  return _mm256_loadu_ps(f);
}
#endif
static inline __m256i u8x8(const uint8_t *p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256i i8x8(const uint8_t *p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* ---------------------------------------------------------------------------------- */
/* 512-bit passes: 16 rows per vector                                                   */
#define SPECD_AVX512 1
enum { ROWS_PER_PASS = 6 }; /* rows of A whose accumulators stay in the 32 registers */
typedef __m512i VI;

ALWAYS_INLINE VI bcast4(const void *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
ALWAYS_INLINE VI u8x16(const uint8_t *p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
ALWAYS_INLINE VI i8x16(const uint8_t *p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* lanes r: lo[r] | hi[r] << 16, two sub-blocks' factors as the 16-bit pairs madd takes */
ALWAYS_INLINE VI pairs_u8(const uint8_t *lo, const uint8_t *hi) {
  return _mm512_or_si512(u8x16(lo), _mm512_slli_epi32(u8x16(hi), 16));
}
ALWAYS_INLINE VI pairs_i8(const uint8_t *lo, const uint8_t *hi) {
  return _mm512_or_si512(_mm512_and_si512(i8x16(lo), _mm512_set1_epi32(0xFFFF)),
                         _mm512_slli_epi32(i8x16(hi), 16));
}

/* y[m][r] += superblock i of a row group (at w, its first nsub sub-blocks) . rows
   m0 .. m0+mt-1 of A, r < 16; mt and nsub are constants where this is inlined, so the
   loops over m unroll into registers */
ALWAYS_INLINE void sb_q4_k(const uint8_t *w, size_t i, const int nsub, const Act *a,
                           size_t m0, const int mt, float (*y)[GROUP]) {
  const size_t k = a->k;
  const VI m4 = _mm512_set1_epi8(0x0F);
  const uint8_t *sc = w + Q4_K_SC, *mn = w + Q4_K_MN, *qs = w + Q4_K_QS;
  const int8_t *x[ROWS_PER_PASS];
  VI isum[ROWS_PER_PASS];
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) {
    isum[m] = _mm512_setzero_si512();
    x[m] = a->q + (m0 + m) * k + i * QK_K;
  }
  for (int j = 0; j < nsub; j++, qs += 4 * 64) {
    /* the rows' dot products interleaved: consecutive instructions are independent */
    VI s0[ROWS_PER_PASS], s1[ROWS_PER_PASS];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
      const VI v = _mm512_loadu_si512(qs + 64 * p);
      const VI lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
#pragma GCC unroll 8
      for (int m = 0; m < mt; m++) {
        const int8_t *xp = x[m] + 32 * j + 8 * p;
        s0[m] = _mm512_dpbusd_epi32(p ? s0[m] : _mm512_setzero_si512(), lo, bcast4(xp));
        s1[m] = _mm512_dpbusd_epi32(p ? s1[m] : _mm512_setzero_si512(), hi, bcast4(xp + 4));
      }
    }
    const VI scj = u8x16(sc + GROUP * j);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++)
      isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_add_epi32(s0[m], s1[m]), scj));
  }
  /* y += da * (d * isum - dmin * imin), imin = sum_j m[j] * (sum of A's 32 values of
     sub-block j), two sub-blocks a madd */
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
  VI mp[4];
  for (int t = 0; t < 4; t++) mp[t] = pairs_u8(mn + 32 * t, mn + 32 * t + GROUP);
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) {
    const int16_t *bs = a->sum32 + (m0 + m) * (k / 32) + i * 8;
    VI imin = _mm512_madd_epi16(mp[0], bcast4(bs));
    for (int t = 1; t < 4; t++)
      imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mp[t], bcast4(bs + 2 * t)));
    const __m512 da = _mm512_set1_ps(a->d[(m0 + m) * (k / QK_K) + i]);
    const __m512 t = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[m])),
                                   _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(imin)));
    _mm512_storeu_ps(y[m], _mm512_add_ps(_mm512_loadu_ps(y[m]), _mm512_mul_ps(da, t)));
  }
}

/* y[m][r] += row group (nb superblocks at w) . rows m0 .. m0+mt-1 of A, r < 16 */
ALWAYS_INLINE void pass_q4_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, float (*y)[GROUP]) {
  for (size_t i = 0; i + 1 < nb; i++, w += Q4_K_GROUP_BYTES) sb_q4_k(w, i, 8, a, m0, mt, y);
  if (a->trim == 0) sb_q4_k(w, nb - 1, 8, a, m0, mt, y);
  else sb_q4_k(w, nb - 1, 8 - a->trim, a, m0, mt, y);
}

ALWAYS_INLINE void pass_q6_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, float (*y)[GROUP]) {
  const size_t k = a->k;
  const VI m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (size_t i = 0; i < nb; i++, w += Q6_K_GROUP_BYTES) {
    const uint8_t *sc = w + Q6_K_SC, *ql = w + Q6_K_QL;
    VI isum[ROWS_PER_PASS];
    /* codes are stored + 32: isum starts at -32 * sum_j sc[j] * (sum of A's 16 values of
       sub-block j), two sub-blocks a madd */
    VI sp[8];
    for (int t = 0; t < 8; t++) sp[t] = pairs_i8(sc + 32 * t, sc + 32 * t + GROUP);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const int16_t *bs = a->sum16 + (m0 + m) * (k / 16) + i * 16;
      VI off = _mm512_madd_epi16(sp[0], bcast4(bs));
      for (int t = 1; t < 8; t++) off = _mm512_add_epi32(off, _mm512_madd_epi16(sp[t], bcast4(bs + 2 * t)));
      isum[m] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(off, 5));
    }
    for (int j = 0; j < 16; j++, ql += 192) {
      const VI l0 = _mm512_loadu_si512(ql), l1 = _mm512_loadu_si512(ql + 64);
      const VI h = _mm512_loadu_si512(ql + 128);
      /* bits 2t..2t+1 of each byte of h moved to bits 4..5 (16-bit shifts: the bits that
         cross into the next byte land outside the mask) */
      const VI c0 = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
      const VI c1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                    _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
      const VI c2 = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(h, m30));
      const VI c3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                    _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
      const VI scj = i8x16(sc + GROUP * j);
#pragma GCC unroll 8
      for (int m = 0; m < mt; m++) {
        const int8_t *x = a->q + (m0 + m) * k + i * QK_K + 16 * j;
        VI s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, bcast4(x));
        VI s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1, bcast4(x + 4));
        s0 = _mm512_dpbusd_epi32(s0, c2, bcast4(x + 8));
        s1 = _mm512_dpbusd_epi32(s1, c3, bcast4(x + 12));
        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scj));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const __m512 da = _mm512_set1_ps(a->d[(m0 + m) * (k / QK_K) + i]);
      const __m512 t = _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[m]));
      _mm512_storeu_ps(y[m], _mm512_add_ps(_mm512_loadu_ps(y[m]), _mm512_mul_ps(da, t)));
    }
  }
}
#define HALF_PASSES(pass, n) pass_##pass(w, nb, a, m0 + m, n, y + m)

#elif SPECD_AVX2
/* ---------------------------------------------------------------------------------- */
/* 256-bit passes: each row group in two halves of 8 rows (the second pass over a group */
/* finds it in the cache)                                                               */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
enum { ROWS_PER_PASS = 3 }; /* 16 registers: 3 rows' state beside the codes */
#define SPECD_VNNI256 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
/* Without VNNI, u8 x s8 products come from maddubs: pairs of products summed into 16-bit
   lanes. Several maddubs are added in 16 bits before one madd widens them, with the
   sub-block's scale as the multiplier (lanes r: sc[r] in both halves), so each sum of
   a row's products is scaled and widened in one instruction. The bounds keep the 16-bit
   sums exact: |a| <= 127 and Q4_K codes <= 15 give |lane| <= 2 * 15 * 127 a maddubs and
   8 of them 30480; Q6_K codes <= 63, 2 of them 32004 (< 32768). The integer sums are
   those of the VNNI path, so the results are the same bits. One 16-bit sum a row
   instead of two 32-bit ones leaves registers for 4 rows a pass: a verify block of a
   draft of 3 reads and unpacks each code vector once. */
enum { ROWS_PER_PASS = 4 };
#endif
ALWAYS_INLINE __m256i bcast4(const void *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
ALWAYS_INLINE __m256i pairs_u8(const uint8_t *lo, const uint8_t *hi) {
  return _mm256_or_si256(u8x8(lo), _mm256_slli_epi32(u8x8(hi), 16));
}
ALWAYS_INLINE __m256i pairs_i8(const uint8_t *lo, const uint8_t *hi) {
  return _mm256_or_si256(_mm256_and_si256(i8x8(lo), _mm256_set1_epi32(0xFFFF)),
                         _mm256_slli_epi32(i8x8(hi), 16));
}

/* y[m][8h + r] += rows 8h .. 8h+7 of superblock i of the row group (at w, its first nsub
   sub-blocks) . rows m0 .. m0+mt-1 of A */
ALWAYS_INLINE void sb_half_q4_k(const uint8_t *w, size_t i, const int nsub, const Act *a,
                                size_t m0, const int mt, const int h, float (*y)[GROUP]) {
  const size_t k = a->k;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const uint8_t *sc = w + Q4_K_SC + HALF * h, *mn = w + Q4_K_MN + HALF * h;
  const uint8_t *qs = w + Q4_K_QS + 32 * h;
  const int8_t *x[ROWS_PER_PASS];
  __m256i isum[ROWS_PER_PASS];
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) {
    isum[m] = _mm256_setzero_si256();
    x[m] = a->q + (m0 + m) * k + i * QK_K;
  }
  for (int j = 0; j < nsub; j++, qs += 4 * 64) {
#if SPECD_VNNI256
    __m256i s0[ROWS_PER_PASS], s1[ROWS_PER_PASS];
#else
    __m256i s16[ROWS_PER_PASS]; /* the sub-block's 8 maddubs a row, summed in 16 bits */
#endif
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * p));
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 8
      for (int m = 0; m < mt; m++) {
        const int8_t *xp = x[m] + 32 * j + 8 * p;
#if SPECD_VNNI256
        s0[m] = DPBUSD(p ? s0[m] : _mm256_setzero_si256(), lo, bcast4(xp));
        s1[m] = DPBUSD(p ? s1[m] : _mm256_setzero_si256(), hi, bcast4(xp + 4));
#else
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)),
                                           _mm256_maddubs_epi16(hi, bcast4(xp + 4)));
        s16[m] = p ? _mm256_add_epi16(s16[m], t) : t;
#endif
      }
    }
#if SPECD_VNNI256
    const __m256i scj = u8x8(sc + GROUP * j);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++)
      isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(_mm256_add_epi32(s0[m], s1[m]), scj));
#else
    const __m256i scj = pairs_u8(sc + GROUP * j, sc + GROUP * j);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++)
      isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(s16[m], scj));
#endif
  }
  const __m256 d = LOAD_F16X8(w + 2 * HALF * h), dmin = LOAD_F16X8(w + 32 + 2 * HALF * h);
  __m256i mp[4];
  for (int t = 0; t < 4; t++) mp[t] = pairs_u8(mn + 32 * t, mn + 32 * t + GROUP);
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) {
    const int16_t *bs = a->sum32 + (m0 + m) * (k / 32) + i * 8;
    __m256i imin = _mm256_madd_epi16(mp[0], bcast4(bs));
    for (int t = 1; t < 4; t++)
      imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mp[t], bcast4(bs + 2 * t)));
    const __m256 da = _mm256_set1_ps(a->d[(m0 + m) * (k / QK_K) + i]);
    const __m256 t = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[m])),
                                   _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(imin)));
    float *ym = y[m] + HALF * h;
    _mm256_storeu_ps(ym, _mm256_add_ps(_mm256_loadu_ps(ym), _mm256_mul_ps(da, t)));
  }
}

/* y[m][8h + r] += rows 8h .. 8h+7 of the row group . rows m0 .. m0+mt-1 of A */
ALWAYS_INLINE void half_q4_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, const int h, float (*y)[GROUP]) {
  for (size_t i = 0; i + 1 < nb; i++, w += Q4_K_GROUP_BYTES)
    sb_half_q4_k(w, i, 8, a, m0, mt, h, y);
  if (a->trim == 0) sb_half_q4_k(w, nb - 1, 8, a, m0, mt, h, y);
  else sb_half_q4_k(w, nb - 1, 8 - a->trim, a, m0, mt, h, y);
}

ALWAYS_INLINE void half_q6_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, const int h, float (*y)[GROUP]) {
  const size_t k = a->k;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (size_t i = 0; i < nb; i++, w += Q6_K_GROUP_BYTES) {
    const uint8_t *sc = w + Q6_K_SC + HALF * h, *ql = w + Q6_K_QL + 32 * h;
    __m256i isum[ROWS_PER_PASS];
    __m256i sp[8];
    for (int t = 0; t < 8; t++) sp[t] = pairs_i8(sc + 32 * t, sc + 32 * t + GROUP);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const int16_t *bs = a->sum16 + (m0 + m) * (k / 16) + i * 16;
      __m256i off = _mm256_madd_epi16(sp[0], bcast4(bs));
      for (int t = 1; t < 8; t++) off = _mm256_add_epi32(off, _mm256_madd_epi16(sp[t], bcast4(bs + 2 * t)));
      isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
    }
    for (int j = 0; j < 16; j++, ql += 192) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
      const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64));
      const __m256i hb = _mm256_loadu_si256((const __m256i *)(ql + 128));
      const __m256i c0 =
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
      const __m256i c1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
      const __m256i c2 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(hb, m30));
      const __m256i c3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
#if SPECD_VNNI256
      const __m256i scj = i8x8(sc + GROUP * j);
#pragma GCC unroll 8
      for (int m = 0; m < mt; m++) {
        const int8_t *x = a->q + (m0 + m) * k + i * QK_K + 16 * j;
        __m256i s0 = DPBUSD(_mm256_setzero_si256(), c0, bcast4(x));
        __m256i s1 = DPBUSD(_mm256_setzero_si256(), c1, bcast4(x + 4));
        s0 = DPBUSD(s0, c2, bcast4(x + 8));
        s1 = DPBUSD(s1, c3, bcast4(x + 12));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), scj));
      }
#else
      const __m256i scj = pairs_i8(sc + GROUP * j, sc + GROUP * j);
#pragma GCC unroll 8
      for (int m = 0; m < mt; m++) {
        const int8_t *x = a->q + (m0 + m) * k + i * QK_K + 16 * j;
        const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(x)),
                                            _mm256_maddubs_epi16(c2, bcast4(x + 8)));
        const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(c1, bcast4(x + 4)),
                                            _mm256_maddubs_epi16(c3, bcast4(x + 12)));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(_mm256_madd_epi16(s0, scj),
                                                             _mm256_madd_epi16(s1, scj)));
      }
#endif
    }
    const __m256 d = LOAD_F16X8(w + 2 * HALF * h);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const __m256 da = _mm256_set1_ps(a->d[(m0 + m) * (k / QK_K) + i]);
      const __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[m]));
      float *ym = y[m] + HALF * h;
      _mm256_storeu_ps(ym, _mm256_add_ps(_mm256_loadu_ps(ym), _mm256_mul_ps(da, t)));
    }
  }
}
#define HALF_PASSES(pass, n)                                \
  (half_##pass(w, nb, a, m0 + m, n, 0, y + m),              \
   half_##pass(w, nb, a, m0 + m, n, 1, y + m))
#endif

#if SPECD_AVX2
/* mt rows in passes of ROWS_PER_PASS, each pass with a constant row count (the cases
   past ROWS_PER_PASS are never taken: n % (ROWS_PER_PASS + 1) compiles them empty) */
#define ROW_PASS(pass, n) HALF_PASSES(pass, (n) % (ROWS_PER_PASS + 1))
#define ROW_PASSES(pass)                                                                  \
  static void group_##pass(const uint8_t *w, size_t nb, const Act *a, size_t m0,           \
                           size_t mt, float (*y)[GROUP]) {                                \
    for (size_t m = 0; m < mt; m += ROWS_PER_PASS) {                                      \
      switch (mt - m < ROWS_PER_PASS ? mt - m : ROWS_PER_PASS) {                          \
        case 1: ROW_PASS(pass, 1); break;                                                 \
        case 2: ROW_PASS(pass, 2); break;                                                 \
        case 3: ROW_PASS(pass, 3); break;                                                 \
        case 4: ROW_PASS(pass, 4); break;                                                 \
        case 5: ROW_PASS(pass, 5); break;                                                 \
        default: ROW_PASS(pass, 6); break;                                                \
      }                                                                                   \
    }                                                                                     \
  }
ROW_PASSES(q4_k)
ROW_PASSES(q6_k)

#else /* plain C: the same integer sums and the same float epilogue */

static void group_q4_k(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  const size_t k = a->k;
  for (size_t i = 0; i < nb; i++, w += Q4_K_GROUP_BYTES) {
    const uint8_t *sc = w + Q4_K_SC, *mn = w + Q4_K_MN, *qs = w + Q4_K_QS;
    const int nsub = i + 1 < nb ? 8 : 8 - a->trim;
    float d[GROUP], dmin[GROUP];
    load_f16(w, GROUP, d);
    load_f16(w + 32, GROUP, dmin);
    for (size_t m = 0; m < mt; m++) {
      const size_t row = m0 + m;
      const int8_t *x = a->q + row * k + i * QK_K;
      const int16_t *bs = a->sum32 + row * (k / 32) + i * 8;
      for (int r = 0; r < GROUP; r++) {
        int isum = 0, imin = 0;
        for (int j = 0; j < 8; j++) {
          int s = 0;
          for (int p = 0; p < 4 && j < nsub; p++) {
            for (int e = 0; e < 4; e++) {
              const uint8_t b = qs[256 * j + 64 * p + 4 * r + e];
              s += (b & 0xF) * x[32 * j + 8 * p + e] + (b >> 4) * x[32 * j + 8 * p + 4 + e];
            }
          }
          isum += sc[GROUP * j + r] * s;
          imin += mn[GROUP * j + r] * bs[j];
        }
        const float da = a->d[row * (k / QK_K) + i];
        y[m][r] += da * (d[r] * (float)isum - dmin[r] * (float)imin);
      }
    }
  }
}

static void group_q6_k(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  const size_t k = a->k;
  for (size_t i = 0; i < nb; i++, w += Q6_K_GROUP_BYTES) {
    const int8_t *sc = (const int8_t *)(w + Q6_K_SC);
    const uint8_t *ql = w + Q6_K_QL;
    float d[GROUP];
    load_f16(w, GROUP, d);
    for (size_t m = 0; m < mt; m++) {
      const size_t row = m0 + m;
      const int8_t *x = a->q + row * k + i * QK_K;
      const int16_t *bs = a->sum16 + row * (k / 16) + i * 16;
      for (int r = 0; r < GROUP; r++) {
        int isum = 0;
        for (int j = 0; j < 16; j++) {
          const uint8_t *run = ql + 192 * j;
          int s = 0;
          for (int e = 0; e < 4; e++) {
            const uint8_t b0 = run[4 * r + e], b1 = run[64 + 4 * r + e];
            const uint8_t h = run[128 + 4 * r + e];
            s += ((b0 & 0xF) | ((h & 3) << 4)) * x[16 * j + e];
            s += ((b0 >> 4) | (((h >> 2) & 3) << 4)) * x[16 * j + 4 + e];
            s += ((b1 & 0xF) | (((h >> 4) & 3) << 4)) * x[16 * j + 8 + e];
            s += ((b1 >> 4) | (((h >> 6) & 3) << 4)) * x[16 * j + 12 + e];
          }
          isum += sc[GROUP * j + r] * (s - 32 * bs[j]);
        }
        const float da = a->d[row * (k / QK_K) + i];
        y[m][r] += da * (d[r] * (float)isum);
      }
    }
  }
}
#endif

/* ---------------------------------------------------------------------------------- */
/* the call: quantize A, then columns of Y in tasks over ORT's intra-op thread pool     */

typedef void (*GroupFn)(const uint8_t *, size_t, const Act *, size_t, size_t,
                        float (*)[GROUP]);

typedef struct {
  GroupFn fn;
  const uint8_t *w;
  size_t group_bytes, nb, m, n, groups_per_task;
  Act act;
  const float *bias; /* [N] added to each row of Y, or NULL */
  float *y;
} Job;

static void run_task(void *p, size_t t) {
  const Job *job = (const Job *)p;
  const size_t n_groups = (job->n + GROUP - 1) / GROUP;
  const size_t g0 = t * job->groups_per_task;
  const size_t g1 = g0 + job->groups_per_task < n_groups ? g0 + job->groups_per_task : n_groups;
  float acc[ROW_TILE][GROUP];
  for (size_t c0 = g0; c0 < g1; c0 += COL_TILE) { /* these row groups stay in cache ... */
    const size_t c1 = c0 + COL_TILE < g1 ? c0 + COL_TILE : g1;
    for (size_t m0 = 0; m0 < job->m; m0 += ROW_TILE) { /* ... across tiles of A */
      const size_t mt = job->m - m0 < ROW_TILE ? job->m - m0 : ROW_TILE;
      for (size_t c = c0; c < c1; c++) {
        memset(acc, 0, sizeof acc);
        job->fn(job->w + c * job->group_bytes, job->nb, &job->act, m0, mt, acc);
        const size_t cols = job->n - c * GROUP < GROUP ? job->n - c * GROUP : GROUP;
        if (job->bias) /* the float32 sums an Add node after the product would make */
          for (size_t m = 0; m < mt; m++)
            for (size_t r = 0; r < cols; r++) acc[m][r] += job->bias[c * GROUP + r];
        for (size_t m = 0; m < mt; m++)
          memcpy(job->y + (m0 + m) * job->n + c * GROUP, acc[m], cols * sizeof(float));
      }
    }
  }
}

typedef struct {
  int64_t type, k, n;
} Kernel;

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  const Kernel *kn = (const Kernel *)kernel;
  const OrtValue *a_val, *w_val;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &a_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 1, &w_val));
  int64_t adims[8], wdims[8];
  size_t arank, wrank;
  CHECK(specd_tensor_shape(a_val, adims, &arank));
  CHECK(specd_tensor_shape(w_val, wdims, &wrank));
  const size_t k_in = (size_t)kn->k, n = (size_t)kn->n, nb = (k_in + QK_K - 1) / QK_K;
  const size_t k = nb * QK_K; /* A is quantized in whole superblocks, zero-padded */
  /* Q4_K: the last superblock holds the sub-blocks of 32 that K reaches; Q6_K: whole
     superblocks (GGUF files only have Q6_K rows of whole superblocks) */
  const int trim = kn->type == TYPE_Q4_K ? (int)((k - k_in) / 32) : 0;
  const size_t group_bytes = kn->type == TYPE_Q4_K
                                 ? nb * Q4_K_GROUP_BYTES - (size_t)trim * Q4_K_SUB_BYTES
                                 : nb * Q6_K_GROUP_BYTES;
  const size_t n_groups = (n + GROUP - 1) / GROUP;
  if (arank < 1 || adims[arank - 1] != kn->k)
    return specd_fail("GgufMatMul: the last dimension of A is not K");
  if (wrank != 2 || (size_t)wdims[0] != n_groups || (size_t)wdims[1] != group_bytes)
    return specd_fail("GgufMatMul: W is not [ceil(N/16), group bytes] of its GGUF type's 16-row layout");
  size_t n_in = 0;
  const OrtValue *b_val = NULL;
  const float *bias = NULL;
  CHECK(g_api->KernelContext_GetInputCount(ctx, &n_in));
  if (n_in > 2) CHECK(g_api->KernelContext_GetInput(ctx, 2, &b_val));
  if (b_val) {
    int64_t bdims[8];
    size_t brank;
    CHECK(specd_tensor_shape(b_val, bdims, &brank));
    if (brank != 1 || bdims[0] != kn->n) return specd_fail("GgufMatMul: bias is not [N]");
    CHECK(g_api->GetTensorMutableData((OrtValue *)b_val, (void **)&bias));
  }
  size_t m = 1;
  for (size_t i = 0; i + 1 < arank; i++) m *= (size_t)adims[i];
  adims[arank - 1] = kn->n;
  OrtValue *y_val;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, adims, arank, &y_val));
  const float *a;
  const uint8_t *w;
  float *y;
  CHECK(g_api->GetTensorMutableData((OrtValue *)a_val, (void **)&a));
  CHECK(g_api->GetTensorMutableData((OrtValue *)w_val, (void **)&w));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  if (m == 0) return NULL;

  /* one allocation: q [M, K] | d [M, K/256] | sum32 [M, K/32] | sum16 [M, K/16] */
  const size_t bytes = m * k + m * nb * 4 + m * (k / 32) * 2 + m * (k / 16) * 2;
  uint8_t *scratch = (uint8_t *)malloc(bytes);
  if (!scratch) return g_api->CreateStatus(ORT_FAIL, "GgufMatMul: out of memory");
  Job job = {kn->type == TYPE_Q4_K ? group_q4_k : group_q6_k, w, group_bytes, nb, m, n, 0,
             {(int8_t *)scratch, (float *)(scratch + m * k), NULL, NULL, k, trim}, bias, y};
  job.act.sum32 = (int16_t *)(scratch + m * k + m * nb * 4);
  job.act.sum16 = job.act.sum32 + m * (k / 32);
  for (size_t r = 0; r < m; r++)
    quantize_row(a + r * k_in, k_in, k, job.act.q + r * k, job.act.d + r * nb,
                 job.act.sum16 + r * (k / 16), job.act.sum32 + r * (k / 32));
  size_t per = (n_groups + MAX_TASKS - 1) / MAX_TASKS;
  job.groups_per_task = per;
  specd_parallel_for(run_task, &job, (n_groups + per - 1) / per);
  free(scratch);
  return NULL;
}

static OrtStatus *create(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  Kernel kn;
  CHECK(api->KernelInfoGetAttribute_int64(info, "ggml_type", &kn.type));
  CHECK(api->KernelInfoGetAttribute_int64(info, "K", &kn.k));
  CHECK(api->KernelInfoGetAttribute_int64(info, "N", &kn.n));
  if (kn.type != TYPE_Q4_K && kn.type != TYPE_Q6_K)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "GgufMatMul: ggml_type must be 12 (Q4_K) or 14 (Q6_K)");
  if (kn.k <= 0 || kn.n <= 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufMatMul: K and N must be positive");
  return specd_new_state(&kn, sizeof kn, kernel);
}


static const ONNXTensorElementDataType INPUTS[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                   ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
                                                   ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const SpecdOpDef specd_gguf_matmul = {"GgufMatMul", 3, INPUTS, create, compute, 0, NULL, 2};
