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

/* out[i] = q . k_{t+i} * scale for the 8 keys from t: each key exactly as dot() does */
static void CAT(dot8_, KV)(const float *q, const KV_T *k, size_t hd, float scale, float *out) {
#if SPECD_AVX2
  __m256 a[LANES];
  for (int i = 0; i < LANES; i++)
    a[i] = _mm256_mul_ps(_mm256_loadu_ps(q), LOAD8(k + i * hd));
  for (size_t d = LANES; d < hd; d += LANES) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int i = 0; i < LANES; i++)
      a[i] = _mm256_fmadd_ps(qd, LOAD8(k + i * hd + d), a[i]);
  }
  /* lanes summed as lanes_sum does: pairs, then quads, then the two 128-bit halves */
  const __m256 q01 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 q23 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 lo = _mm256_permute2f128_ps(q01, q23, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(q01, q23, 0x31);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
#else
  for (int i = 0; i < LANES; i++) out[i] = CAT(dot_, KV)(q, k + i * hd, hd) * scale;
#endif
}


/* One row and one KV head: the query heads sharing it go together, so each key and value
 * row is read from memory once for all of them; each head's numbers are its own. */
static void CAT(run_task_, KV)(void *p, size_t task) {
  const Job *job = (const Job *)p;
  const size_t g_n = job->group, kv_heads = job->heads / g_n, hd = job->hd;
  const size_t row = task / kv_heads, kvh = task % kv_heads;
  const size_t n_keys = job->pos + row + 1;
  const float *q = job->q + (row * job->heads + kvh * g_n) * hd; /* heads kvh*G .. +G-1 */
  const KV_T *kc = (const KV_T *)job->k + kvh * job->n_ctx * hd;
  const KV_T *vc = (const KV_T *)job->v + kvh * job->n_ctx * hd;
  float *out = job->y + (row * job->heads + kvh * g_n) * hd;
  const size_t padded = (n_keys + LANES - 1) / LANES * LANES;
  float *w = (float *)malloc((g_n * padded + g_n) * sizeof(float)); /* scores, then sums */
  if (!w) { /* cannot happen short of exhausting memory: NaNs make it visible */
    for (size_t d = 0; d < g_n * hd; d++) out[d] = NAN;
    return;
  }
  float *sum = w + g_n * padded;
  size_t t = 0;
  for (; t + LANES <= n_keys; t += LANES)
    for (size_t g = 0; g < g_n; g++)
      CAT(dot8_, KV)(q + g * hd, kc + t * hd, hd, job->scale, w + g * padded + t);
  for (; t < n_keys; t++)
    for (size_t g = 0; g < g_n; g++)
      w[g * padded + t] = CAT(dot_, KV)(q + g * hd, kc + t * hd, hd) * job->scale;
  for (size_t g = 0; g < g_n; g++) sum[g] = softmax_weights(w + g * padded, n_keys, padded);
  for (size_t d = 0; d < g_n * hd; d++) out[d] = 0.0f;
  for (t = 0; t < n_keys; t++) {
    const KV_T *vt = vc + t * hd;
    for (size_t g = 0; g < g_n; g++) {
      const float wt = w[g * padded + t];
      float *o = out + g * hd;
#if SPECD_AVX2
      const __m256 ww = _mm256_set1_ps(wt);
      for (size_t d = 0; d < hd; d += LANES)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(ww, LOAD8(vt + d), _mm256_loadu_ps(o + d)));
#else
      for (size_t d = 0; d < hd; d++) o[d] = fmaf(wt, LOAD1(vt + d), o[d]);
#endif
    }
  }
  for (size_t g = 0; g < g_n; g++)
    for (size_t d = 0; d < hd; d++) out[g * hd + d] = out[g * hd + d] / sum[g];
  free(w);
}

