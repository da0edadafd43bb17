/* GgufMatMul's Q4_0 and Q4_1 row-group kernels (AVX2, plain C). Part of gguf_matmul.c,
 * which includes it after its Act, layout constants and vector helpers: not a standalone
 * header. group_q4_0 / group_q4_1: y[m][r] += a row group of W (nb blocks of 32 columns,
 * see gguf_matmul.c for the layout) . rows m0 .. m0+mt-1 of A.
 *
 * Per superblock i of 256 columns (A is quantized per 256 values, as for the K-quants),
 * over its blocks j of 32 (the last superblock has only those K reaches), in float32:
 *   Q4_0: t = t + d[j] * (s[j] - 8 * sum_{l in j} a[l])           t starts at 0
 *   Q4_1: t = t + (d[j] * s[j] + m[j] * sum_{l in j} a[l])
 *   y += da * t,   s[j] = sum_{l in j} q4[l] a[l]  (exact integers)
 *
 * The vector code is the same 256-bit code in every build (AVX-512 ones too): 8 maddubs
 * of a block summed in 16 bits (codes32_dot, which Q4_K's sub-blocks use too) and
 * widened by one madd, as the K-quant kernels do without VNNI. */

#if SPECD_AVX2
enum { LEGACY_ROWS = 4 }; /* rows of A a pass: 2 registers of state each */

/* y[m][8h + r] += rows 8h .. 8h+7 of superblock i of the row group (its nsub blocks at
   w) . rows m0 .. m0+mt-1 of A; with_min: Q4_1 (d and m a block), else Q4_0 (d, codes
   - 8) */
ALWAYS_INLINE void sb_half_q4_legacy(const uint8_t *w, size_t i, size_t nsub, const Act *a,
                                     size_t m0, const int mt, const int h,
                                     const int with_min, float (*y)[GROUP]) {
  const size_t k = a->k, block = with_min ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 t[LEGACY_ROWS];
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) t[m] = _mm256_setzero_ps();
  for (size_t j = 0; j < nsub; j++, w += block) {
    if (h == 0) prefetch_lines(w + PF_AHEAD * 8 * block, 5);
    const int8_t *xj[LEGACY_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) xj[m] = a->q + (m0 + m) * k + QK_K * i + 32 * j;
    __m256i s16[LEGACY_ROWS];
    codes32_dot(w + (with_min ? 64 : 32) + 32 * h, xj, mt, 0, s16, NULL);
    const __m256 d = LOAD_F16X8(w + 2 * HALF * h);
    const __m256 mn = with_min ? LOAD_F16X8(w + 32 + 2 * HALF * h) : d;
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const int bs = a->sum32[(m0 + m) * (k / 32) + 8 * i + j];
      const __m256i s = _mm256_madd_epi16(s16[m], ones);
      __m256 u;
      if (with_min)
        u = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(s)),
                          _mm256_mul_ps(mn, _mm256_set1_ps((float)bs)));
      else
        u = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(s, _mm256_set1_epi32(8 * bs))));
      t[m] = _mm256_add_ps(t[m], u);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < mt; m++) {
    const __m256 da = _mm256_set1_ps(a->d[(m0 + m) * (k / QK_K) + i]);
    float *ym = y[m] + HALF * h;
    _mm256_storeu_ps(ym, _mm256_add_ps(_mm256_loadu_ps(ym), _mm256_mul_ps(da, t[m])));
  }
}

/* superblock by superblock, both halves in turn (as the K-quants' passes) */
ALWAYS_INLINE void pass_q4_legacy(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                                  const int mt, const int with_min, float (*y)[GROUP]) {
  const size_t block = with_min ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  for (size_t i = 0; 8 * i < nb; i++, w += 8 * block) {
    const size_t nsub = nb - 8 * i < 8 ? nb - 8 * i : 8;
    for (int h = 0; h < 2; h++) sb_half_q4_legacy(w, i, nsub, a, m0, mt, h, with_min, y);
  }
}

#define LEGACY_PASS(n) pass_q4_legacy(w, nb, a, m0 + m, n, with_min, y + m)

ALWAYS_INLINE void group_q4_legacy(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                                   size_t mt, const int with_min, float (*y)[GROUP]) {
  for (size_t m = 0; m < mt; m += LEGACY_ROWS) {
    switch (mt - m < LEGACY_ROWS ? mt - m : LEGACY_ROWS) {
      case 1: LEGACY_PASS(1); break;
      case 2: LEGACY_PASS(2); break;
      case 3: LEGACY_PASS(3); break;
      default: LEGACY_PASS(4); break;
    }
  }
}

#else /* plain C: the same integer sums and the same float operations */

static void group_q4_legacy(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                            size_t mt, const int with_min, float (*y)[GROUP]) {
  const size_t k = a->k, block = with_min ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  for (size_t m = 0; m < mt; m++) {
    const size_t row = m0 + m;
    for (int r = 0; r < GROUP; r++) {
      for (size_t i = 0; 8 * i < nb; i++) {
        const size_t nsub = nb - 8 * i < 8 ? nb - 8 * i : 8;
        float t = 0.0f;
        for (size_t j = 0; j < nsub; j++) {
          const uint8_t *blk = w + (8 * i + j) * block;
          const uint8_t *qs = blk + (with_min ? 64 : 32);
          const int8_t *x = a->q + row * k + QK_K * i + 32 * j;
          int s = 0;
          for (int p = 0; p < 4; p++)
            for (int e = 0; e < 4; e++) {
              const uint8_t b = qs[64 * p + 4 * r + e];
              s += (b & 0xF) * x[8 * p + e] + (b >> 4) * x[8 * p + 4 + e];
            }
          const int bs = a->sum32[row * (k / 32) + 8 * i + j];
          const float d = specd_f16_to_f32(blk + 2 * r);
          if (with_min)
            t = t + (d * (float)s + specd_f16_to_f32(blk + 32 + 2 * r) * (float)bs);
          else
            t = t + d * (float)(s - 8 * bs);
        }
        y[m][r] += a->d[row * (k / QK_K) + i] * t;
      }
    }
  }
}
#endif

static void group_q4_0(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  group_q4_legacy(w, nb, a, m0, mt, 0, y);
}

static void group_q4_1(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  group_q4_legacy(w, nb, a, m0, mt, 1, y);
}
