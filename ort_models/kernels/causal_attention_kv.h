/* One KV element type's attention (included by causal_attention.c once per type):
 * KV_T the cache element, KV a name suffix, LOAD8(p) 8 floats from p (vector path),
 * LOAD1(p) one float from p. Every type converts exactly to float32 before any
 * arithmetic, so the f16 cache gives the bits the f32 op gives on the same values. */

/* q . k over hd values (hd a multiple of 8) */
static float CAT(dot_, KV)(const float *q, const KV_T *k, size_t hd) {
#if SPECD_AVX2
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), LOAD8(k));
  for (size_t d = LANES; d < hd; d += LANES)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), LOAD8(k + d), acc);
  return hsum8(acc);
#else
  float l[LANES];
  for (int i = 0; i < LANES; i++) l[i] = q[i] * LOAD1(k + i);
  for (size_t d = LANES; d < hd; d += LANES)
    for (int i = 0; i < LANES; i++) l[i] = fmaf(q[d + i], LOAD1(k + d + i), l[i]);
  return lanes_sum(l);
#endif
}

#if !SPECD_AVX2
/* out[i] = q . k_{t+i} * scale for the 8 keys from t: each key exactly as dot() does */
static void CAT(dot8_, KV)(const float *q, const KV_T *k, size_t hd, float scale, float *out) {
  for (int i = 0; i < LANES; i++) out[i] = CAT(dot_, KV)(q, k + i * hd, hd) * scale;
}
#endif

#if SPECD_AVX2
/* q . k_{t+i} * scale for the 8 keys from t and gn heads (queries hd apart, scores padded
   apart), each as dot() does: 8 lanes of fused multiply-adds, the lanes of the 8 keys
   summed at once in lanes_sum's tree (pairs, quads, then the two 128-bit halves). Each
   key vector is loaded (and widened) once for all the heads. */
ALWAYS_INLINE void CAT(dot8_heads_, KV)(const float *q, const KV_T *k, size_t hd, float scale,
                                        float *out, size_t padded, const int gn) {
  __m256 a[S_HEADS][LANES];
#pragma GCC unroll 8
  for (int i = 0; i < LANES; i++) {
    const __m256 kd = LOAD8(k + i * hd);
#pragma GCC unroll 8
    for (int g = 0; g < gn; g++) a[g][i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * hd), kd);
  }
  for (size_t d = LANES; d < hd; d += LANES) {
    __m256 qd[S_HEADS];
#pragma GCC unroll 8
    for (int g = 0; g < gn; g++) qd[g] = _mm256_loadu_ps(q + g * hd + d);
#pragma GCC unroll 8
    for (int i = 0; i < LANES; i++) {
      const __m256 kd = LOAD8(k + i * hd + d);
#pragma GCC unroll 8
      for (int g = 0; g < gn; g++) a[g][i] = _mm256_fmadd_ps(qd[g], kd, a[g][i]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < gn; g++) {
    const __m256 q01 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    const __m256 q23 = _mm256_hadd_ps(_mm256_hadd_ps(a[g][4], a[g][5]), _mm256_hadd_ps(a[g][6], a[g][7]));
    const __m256 lo = _mm256_permute2f128_ps(q01, q23, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(q01, q23, 0x31);
    _mm256_storeu_ps(out + g * padded, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
  }
}

/* out[g][d0 .. d0+32) = sum over keys t, in order, of w[g][t] * v_t[d] for gn heads: the
   accumulators stay in registers across the keys, each value vector is loaded once for
   all heads; per element the same fused multiply-adds in the same order as the plain
   loop (from 0: the first is exactly the product) */
ALWAYS_INLINE void CAT(values_, KV)(const float *w, size_t padded, const KV_T *v, size_t run,
                                    const KV_T *v_wrap, size_t n_keys, size_t hd, size_t d0,
                                    const int gn, float *out) {
  __m256 acc[V_HEADS][4];
#pragma GCC unroll 8
  for (int g = 0; g < gn; g++)
    for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
  for (size_t t = 0; t < n_keys; t++) {
    const KV_T *vt = (t < run ? v + t * hd : v_wrap + (t - run) * hd) + d0;
    const __m256 v0 = LOAD8(vt), v1 = LOAD8(vt + 8), v2 = LOAD8(vt + 16), v3 = LOAD8(vt + 24);
#pragma GCC unroll 8
    for (int g = 0; g < gn; g++) {
      const __m256 ww = _mm256_set1_ps(w[g * padded + t]);
      acc[g][0] = _mm256_fmadd_ps(ww, v0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(ww, v1, acc[g][1]);
      acc[g][2] = _mm256_fmadd_ps(ww, v2, acc[g][2]);
      acc[g][3] = _mm256_fmadd_ps(ww, v3, acc[g][3]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < gn; g++)
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + g * hd + d0 + 8 * c, acc[g][c]);
}
#endif

/* One row and one KV head: the query heads sharing it go together, so each key and value
 * row is read from memory once for all of them; each head's numbers are its own. */
static void CAT(run_task_, KV)(void *p, size_t task) {
  const Job *job = (const Job *)p;
  const size_t g_n = job->group, kv_heads = job->heads / g_n, hd = job->hd;
  const size_t row = task / kv_heads, kvh = task % kv_heads;
  /* the keys this row sees: from `first` (past the window, where there is one) to itself;
     position p is in cache row p % n_ctx (a sliding window's cache is a ring that may be
     shorter than the context), so they are one run of rows from `first`'s row, or two
     where the run reaches the cache's end and goes on from row 0 */
  const size_t upto = (job->row_pos ? job->row_pos[row] : job->pos + row) + 1;
  const size_t slot = job->row_slot ? job->row_slot[row] : 0;
  const size_t first = job->row_first ? job->row_first[row]
                       : job->window && upto > job->window ? upto - job->window : 0;
  const size_t n_keys = upto - first, start = first % job->n_ctx;
  const size_t run = n_keys < job->n_ctx - start ? n_keys : job->n_ctx - start;
  const float *q = job->q + (row * job->heads + kvh * g_n) * hd; /* heads kvh*G .. +G-1 */
  const size_t head_at = (slot * kv_heads + kvh) * job->n_ctx * hd; /* row 0 of this head */
  const KV_T *k0 = (const KV_T *)job->k + head_at;
  const KV_T *v0 = (const KV_T *)job->v + head_at;
  const KV_T *kc = k0 + start * hd, *vc = v0 + start * hd;
  KV_T *straddle = NULL; /* 8 keys copied together where a group spans the ring's end */
  float *out = job->y + (row * job->heads + kvh * g_n) * hd;
  const size_t padded = (n_keys + LANES - 1) / LANES * LANES;
  float *w = (float *)malloc((g_n * padded + g_n) * sizeof(float)); /* scores, then sums */
  if (!w) { /* cannot happen short of exhausting memory: NaNs make it visible */
    for (size_t d = 0; d < g_n * hd; d++) out[d] = NAN;
    return;
  }
  float *sum = w + g_n * padded;
  size_t t = 0;
  for (; t + LANES <= n_keys; t += LANES) {
    const KV_T *kt = kc + t * hd;
    if (t >= run) {
      kt = k0 + (t - run) * hd;
    } else if (t + LANES > run) { /* the group spans the ring's end: its 8 rows together */
      if (!straddle) straddle = (KV_T *)malloc(LANES * hd * sizeof(KV_T));
      if (!straddle) { /* cannot happen short of exhausting memory: NaNs make it visible */
        for (size_t d = 0; d < g_n * hd; d++) out[d] = NAN;
        free(w);
        return;
      }
      for (size_t i = 0; i < LANES; i++)
        memcpy(straddle + i * hd, t + i < run ? kc + (t + i) * hd : k0 + (t + i - run) * hd,
               hd * sizeof(KV_T));
      kt = straddle;
    }
#if SPECD_AVX2
    for (size_t g = 0; g < g_n; g += S_HEADS) {
      const float *qg = q + g * hd;
      float *wg = w + g * padded + t;
      switch (HEADS_LEFT(g_n - g, S_HEADS)) {
        case 1: CAT(dot8_heads_, KV)(qg, kt, hd, job->scale, wg, padded, 1); break;
        case 2: CAT(dot8_heads_, KV)(qg, kt, hd, job->scale, wg, padded, 2 % (S_HEADS + 1)); break;
        default: CAT(dot8_heads_, KV)(qg, kt, hd, job->scale, wg, padded, 3 % (S_HEADS + 1)); break;
      }
    }
#else
    for (size_t g = 0; g < g_n; g++)
      CAT(dot8_, KV)(q + g * hd, kt, hd, job->scale, w + g * padded + t);
#endif
  }
  free(straddle);
  for (; t < n_keys; t++) {
    const KV_T *kt = t < run ? kc + t * hd : k0 + (t - run) * hd;
    for (size_t g = 0; g < g_n; g++)
      w[g * padded + t] = CAT(dot_, KV)(q + g * hd, kt, hd) * job->scale;
  }
  const float *sink = job->sinks ? job->sinks + kvh * g_n : NULL; /* this group's heads */
  for (size_t g = 0; g < g_n; g++)
    sum[g] = softmax_weights(w + g * padded, n_keys, padded, sink ? sink + g : NULL);
  size_t d_done = 0; /* values past it go through the plain loop below */
#if SPECD_AVX2
  for (; d_done + 4 * LANES <= hd; d_done += 4 * LANES)
    for (size_t g = 0; g < g_n; g += V_HEADS) {
      const float *wg = w + g * padded;
      float *og = out + g * hd;
      switch (HEADS_LEFT(g_n - g, V_HEADS)) {
        case 1: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 1, og); break;
        case 2: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 2 % (V_HEADS + 1), og); break;
        case 3: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 3 % (V_HEADS + 1), og); break;
        case 4: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 4 % (V_HEADS + 1), og); break;
        case 5: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 5 % (V_HEADS + 1), og); break;
        default: CAT(values_, KV)(wg, padded, vc, run, v0, n_keys, hd, d_done, 6 % (V_HEADS + 1), og); break;
      }
    }
#endif
  for (size_t g = 0; g < g_n; g++)
    for (size_t d = d_done; d < hd; d++) out[g * hd + d] = 0.0f;
  if (d_done < hd)
    for (t = 0; t < n_keys; t++) {
      const KV_T *vt = t < run ? vc + t * hd : v0 + (t - run) * hd;
      for (size_t g = 0; g < g_n; g++) {
        const float wt = w[g * padded + t];
        float *o = out + g * hd;
#if SPECD_AVX2
        const __m256 ww = _mm256_set1_ps(wt);
        for (size_t d = d_done; d < hd; d += LANES)
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(ww, LOAD8(vt + d), _mm256_loadu_ps(o + d)));
#else
        for (size_t d = d_done; d < hd; d++) o[d] = fmaf(wt, LOAD1(vt + d), o[d]);
#endif
      }
    }
  for (size_t g = 0; g < g_n; g++)
    for (size_t d = 0; d < hd; d++) out[g * hd + d] = out[g * hd + d] / sum[g];
  free(w);
}

