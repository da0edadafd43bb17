/* GgufMatMul's Q4_K and Q6_K row-group kernels (AVX-512 VNNI, AVX2 with or without VNNI,
 * plain C). Part of gguf_matmul.c, which includes it after its Act, layout constants and
 * vector helpers: not a standalone header. Each defines group_q4_k and group_q6_k
 * (y[m][r] += a row group of W . rows m0 .. m0+mt-1 of A). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* ---------------------------------------------------------------------------------- */
/* 512-bit passes: 16 rows per vector                                                   */
#define SPECD_AVX512 1
/* Rows of A a superblock is multiplied with at once: their accumulators (3 a row) stay in
   the 32 registers. A row group is taken superblock by superblock, each against all the
   rows of the call in turn, in chunks of at most ROWS_PER_PASS, as even as possible (8
   rows: one chunk; 12: 6 and 6): the superblock is read from memory once and from L1
   after, and the stream of weights is spread evenly over the compute instead of coming
   all in the first pass over the group. */
enum { ROWS_PER_PASS = 8 };
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
   m0 .. m0+mt-1 of A, r < 16; mt is a constant where this is inlined, so the loops
   over m unroll into registers. pf: the first chunk of rows on this superblock, which
   prefetches the one PF_AHEAD on. */
ALWAYS_INLINE void sb_q4_k(const uint8_t *w, size_t i, const int nsub, const Act *a,
                           size_t m0, const int mt, const int pf, float (*y)[GROUP]) {
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
    /* not for one row of A: there the hardware prefetcher keeps up with the stream on
       its own and the prefetches only cost time (Q6_K's single rows do gain from them);
       from 2 rows on, without them, the rows wait on memory */
    if (pf && mt > 1) prefetch_lines(w + PF_AHEAD * Q4_K_GROUP_BYTES + 320 * j, 5);
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

/* y[m][r] += superblock i of a row group (at w) . rows m0 .. m0+mt-1 of A, r < 16 */
ALWAYS_INLINE void sb_q6_k(const uint8_t *w, size_t i, const Act *a, size_t m0,
                           const int mt, const int pf, float (*y)[GROUP]) {
  const size_t k = a->k;
  const VI m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
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
    if (pf) prefetch_lines(w + PF_AHEAD * Q6_K_GROUP_BYTES + 256 * j, 4);
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

/* sb_<type>(..., m0 + m, n, pf, y + m) for the chunk of n <= ROWS_PER_PASS rows at m,
   n a constant in each case */
#define SB_CHUNK(call)                                                                    \
  switch (n) {                                                                            \
    case 1: call(1); break;                                                               \
    case 2: call(2); break;                                                               \
    case 3: call(3); break;                                                               \
    case 4: call(4); break;                                                               \
    case 5: call(5); break;                                                               \
    case 6: call(6); break;                                                               \
    case 7: call(7); break;                                                               \
    default: call(8); break;                                                              \
  }
/* y[m][r] += row group . rows m0 .. m0+mt-1 of A: superblock by superblock, each against
   the rows in chunks of at most ROWS_PER_PASS, as even as possible; per row, the same
   float operations in the same (superblock) order as a call of any other size */
static void group_q4_k(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  const size_t chunks = (mt + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
  for (size_t i = 0; i < nb; i++, w += Q4_K_GROUP_BYTES) {
    const int nsub = i + 1 < nb ? 8 : 8 - a->trim;
    for (size_t c = 0, m = 0; c < chunks; c++) {
      const size_t n = (mt - m) / (chunks - c);
#define Q4_K_CHUNK(rows) sb_q4_k(w, i, nsub, a, m0 + m, rows, c == 0, y + m)
      SB_CHUNK(Q4_K_CHUNK)
#undef Q4_K_CHUNK
      m += n;
    }
  }
}

static void group_q6_k(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                       float (*y)[GROUP]) {
  const size_t chunks = (mt + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
  for (size_t i = 0; i < nb; i++, w += Q6_K_GROUP_BYTES) {
    for (size_t c = 0, m = 0; c < chunks; c++) {
      const size_t n = (mt - m) / (chunks - c);
#define Q6_K_CHUNK(rows) sb_q6_k(w, i, a, m0 + m, rows, c == 0, y + m)
      SB_CHUNK(Q6_K_CHUNK)
#undef Q6_K_CHUNK
      m += n;
    }
  }
}

#elif SPECD_AVX2
/* ---------------------------------------------------------------------------------- */
/* 256-bit passes: each superblock of a row group in two halves of 8 rows, in turn     */
#if SPECD_DPBUSD256
enum { ROWS_PER_PASS = 3 }; /* 16 registers: 3 rows' state beside the codes */
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
/* Without VNNI, u8 x s8 products come from maddubs: pairs of products summed into 16-bit
   lanes. Several maddubs are added in 16 bits before one madd widens them, with the
   sub-block's scale as the multiplier (lanes r: sc[r] in both halves), so each sum of
   a row's products is scaled and widened in one instruction. The bounds keep the 16-bit
   sums exact: |a| <= 127 and Q4_K codes <= 15 give |lane| <= 2 * 15 * 127 a maddubs and
   8 of them 30480; Q6_K codes <= 63, 2 of them 32004 (< 32768). The integer sums are
   those of the VNNI path, so the results are the same bits. Each code vector is read
   and unpacked once for up to 6 rows of A (a verify block of a draft of 5): their
   accumulators no longer all fit the 16 registers, but the spills cost less than a
   second pass over the superblock did (hot in cache, 5-6 rows: 0.8-0.86x the time of
   passes of 4; 1-4 rows the same). */
enum { ROWS_PER_PASS = 6 };
#endif
#define bcast4 bcast4x8
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
    if (h == 0) prefetch_lines(w + PF_AHEAD * Q4_K_GROUP_BYTES + 320 * j, 5);
    const int8_t *xj[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) xj[m] = x[m] + 32 * j;
    /* VNNI: s0, s1 32-bit sums; else s0 the sub-block's 8 maddubs a row, in 16 bits */
    __m256i s0[ROWS_PER_PASS], s1[ROWS_PER_PASS];
    codes32_dot(qs, xj, mt, SPECD_DPBUSD256, s0, s1);
#if SPECD_DPBUSD256
    const __m256i scj = u8x8(sc + GROUP * j);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++)
      isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(_mm256_add_epi32(s0[m], s1[m]), scj));
#else
    const __m256i scj = pairs_u8(sc + GROUP * j, sc + GROUP * j);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++)
      isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(s0[m], scj));
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

/* y[m][r] += the row group . rows m0 .. m0+mt-1 of A: superblock by superblock, its two
   halves in turn (the second finds the superblock in L1), so the group streams from
   memory once while both halves compute (one row: 0.8x the time of a pass over the
   whole group per half, which left the second half's compute without memory traffic) */
ALWAYS_INLINE void pass_q4_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, float (*y)[GROUP]) {
  for (size_t i = 0; i + 1 < nb; i++, w += Q4_K_GROUP_BYTES)
    for (int h = 0; h < 2; h++) sb_half_q4_k(w, i, 8, a, m0, mt, h, y);
  for (int h = 0; h < 2; h++) {
    if (a->trim == 0) sb_half_q4_k(w, nb - 1, 8, a, m0, mt, h, y);
    else sb_half_q4_k(w, nb - 1, 8 - a->trim, a, m0, mt, h, y);
  }
}

/* y[m][8h + r] += rows 8h .. 8h+7 of superblock i of the row group (at w) . rows m0 ..
   m0+mt-1 of A */
ALWAYS_INLINE void sb_half_q6_k(const uint8_t *w, size_t i, const Act *a, size_t m0,
                                const int mt, const int h, float (*y)[GROUP]) {
  const size_t k = a->k;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
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
    if (h == 0) prefetch_lines(w + PF_AHEAD * Q6_K_GROUP_BYTES + 256 * j, 4);
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
#if SPECD_DPBUSD256
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

ALWAYS_INLINE void pass_q6_k(const uint8_t *w, size_t nb, const Act *a, size_t m0,
                             const int mt, float (*y)[GROUP]) {
  for (size_t i = 0; i < nb; i++, w += Q6_K_GROUP_BYTES)
    for (int h = 0; h < 2; h++) sb_half_q6_k(w, i, a, m0, mt, h, y);
}
#define HALF_PASSES(pass, n) pass_##pass(w, nb, a, m0 + m, n, y + m)
#endif

#if SPECD_AVX512
/* group_q4_k and group_q6_k: above */
#elif SPECD_AVX2
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
