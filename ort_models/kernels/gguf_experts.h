/* specd.GgufExperts: a mixture-of-experts block's products, each row with only the experts
 * it chose. Part of gguf_matmul.c, which includes it after its kernels (it reuses their
 * activation quantization, prologues and row-group kernels): not a standalone header.
 *
 *   A    float32 [S, Ka]         one row a token, shared by its top_k experts (gate / up), or
 *        float32 [S, top_k, Ka]  one row a (token, slot) (down); Ka = K, or 2K with a
 *                                gated prologue (gate then up)
 *   ids  int64   [S, top_k]      the experts each token chose, in the router's order
 *   W    uint8   [n_expert, groups, group bytes]  each expert's rows, in GgufMatMul's
 *                                16-row layout (Q4_0, Q4_1, Q4_K, Q6_K) or as the GGUF's own
 *                                rows, 16 a group (Q8_0, MXFP4; F32: float32 rows)
 *   B    float32 [n_expert, N]   optional: each expert's bias, added as an Add node would
 *   P    float32 [S, top_k]      optional: the router's weights; then Y [S, N] =
 *                                ((Y_0 * P_0 + Y_1 * P_1) + Y_2 * P_2) + ..., slot order
 *   Y    float32 [S, top_k, N]   (without P) each (token, slot)'s product
 *   attributes: ggml_type (0 F32, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K, 39 MXFP4), K, N,
 *               prologue: 0 none, 2 SwiGlu (silu(gate) * up, swiglu.c's arithmetic),
 *               3 gpt-oss's clamped SwiGlu: x = min(gate, limit), u = clamp(up, -limit,
 *               limit), h = x / (1 + expf(-alpha * x)) * (u + 1) (attributes alpha, limit)
 *
 * Arithmetic: a (token, slot) row is GgufMatMul's row against its expert's matrix: A's row
 * quantized per 256 values, the same integer sums and float32 combination (Q8_0 and MXFP4
 * as Q4_0: per superblock t = t + d[j] * s[j] over its blocks of 32, y += da * t, MXFP4's
 * d[j] the block's power of two 2^(e-128), its codes ggml's kvalues_mxfp4); F32 weights
 * take A's float rows: 8 lanes over K in order, acc[l] = acc[l] + w * a, then
 * ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). The pairs are sorted by expert so each
 * expert's rows stream once for all the rows that chose it, and no other expert is read;
 * the row-group kernels compute every pair the same way whatever the rows beside it, so a
 * row of a verify block equals a single step bit for bit. */

enum { TYPE_F32 = 0, TYPE_Q8_0 = 8, TYPE_MXFP4 = 39 };
enum { Q8_0_BLOCK_BYTES = 34, MXFP4_BLOCK_BYTES = 17 };
enum { PROLOGUE_SWIGLU_OAI = 3 };

static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), exact */
static inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* the exact integer sum of 32 int8 products */
static inline int dot32_i8(const int8_t *w, const int8_t *x) {
#if SPECD_AVX2
  const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
  const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  const __m256i s = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
#else
  int s = 0;
  for (int l = 0; l < 32; l++) s += w[l] * x[l];
  return s;
#endif
}

/* an MXFP4 block's 32 codes as int8 values: element l < 16 the low nibble of byte l,
   element l + 16 its high nibble */
static inline void mxfp4_values(const uint8_t *qs, int8_t *v) {
#if SPECD_AVX2
  const __m128i tbl = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4);
  const __m128i m4 = _mm_set1_epi8(0x0F), q = _mm_loadu_si128((const __m128i *)qs);
  _mm_storeu_si128((__m128i *)v, _mm_shuffle_epi8(tbl, _mm_and_si128(q, m4)));
  _mm_storeu_si128((__m128i *)(v + 16),
                   _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
#else
  for (int l = 0; l < 16; l++) {
    v[l] = KVALUES_MXFP4[qs[l] & 0x0F];
    v[l + 16] = KVALUES_MXFP4[qs[l] >> 4];
  }
#endif
}

/* y[m][r] += row r of a group of 16 GGUF rows (nb blocks of 32 each: Q8_0 d f16 | 32 int8,
   MXFP4 e | 16 bytes of codes) . rows m0 .. m0+mt-1 of A */
static void group_blocks32(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                           const int mxfp4, float (*y)[GROUP]) {
  const size_t k = a->k, block = mxfp4 ? MXFP4_BLOCK_BYTES : Q8_0_BLOCK_BYTES;
  int8_t v[32];
  for (int r = 0; r < GROUP; r++) {
    const uint8_t *wr = w + (size_t)r * nb * block;
    for (size_t m = 0; m < mt; m++) {
      const size_t row = m0 + m;
      for (size_t i = 0; 8 * i < nb; i++) {
        const size_t nsub = nb - 8 * i < 8 ? nb - 8 * i : 8;
        float t = 0.0f;
        for (size_t j = 0; j < nsub; j++) {
          const uint8_t *blk = wr + (8 * i + j) * block;
          const int8_t *x = a->q + row * k + QK_K * i + 32 * j;
          if (mxfp4) {
            mxfp4_values(blk + 1, v);
            t = t + e8m0_half(blk[0]) * (float)dot32_i8(v, x);
          } else {
            t = t + specd_f16_to_f32(blk) * (float)dot32_i8((const int8_t *)(blk + 2), x);
          }
        }
        y[m][r] += a->d[row * (k / QK_K) + i] * t;
      }
    }
  }
}

static void group_q8_0_rows(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                            float (*y)[GROUP]) {
  group_blocks32(w, nb, a, m0, mt, 0, y);
}

static void group_mxfp4_rows(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                             float (*y)[GROUP]) {
  group_blocks32(w, nb, a, m0, mt, 1, y);
}

/* y[m][r] += row r of a group of 16 float32 rows of K (= nb) values . A's float rows */
static void group_f32_rows(const uint8_t *w, size_t nb, const Act *a, size_t m0, size_t mt,
                           float (*y)[GROUP]) {
  for (int r = 0; r < GROUP; r++) {
    const float *wr = (const float *)w + (size_t)r * nb;
    for (size_t m = 0; m < mt; m++) y[m][r] += specd_dot_f32(wr, a->x + (m0 + m) * nb, nb);
  }
}

typedef struct {
  Kernel kn;
  float alpha, limit; /* prologue 3 */
} ExpertsKernel;

/* the (token, slot) pairs sorted by expert, and what a task of the product needs */
typedef struct {
  const ExpertsKernel *ek;
  GroupFn fn;
  const uint8_t *w;
  size_t expert_bytes, group_bytes, units, n, top_k, k_in, a_width;
  int per_slot, floats;
  const float *a, *bias;
  const int64_t *ids;
  const size_t *start, *pair_of; /* start[e]: first sorted position of expert e; pair_of[s] */
  Act act;
  float *y; /* [S * top_k, N], by pair */
  /* tasks: (expert, first row group, end) */
  const size_t *task_expert, *task_g0, *task_g1;
  size_t rows_per_prep;
  size_t n_pairs;
} ExpertsJob;

static void experts_prep_task(void *p, size_t t) {
  const ExpertsJob *job = (const ExpertsJob *)p;
  const size_t k_in = job->k_in, k = job->act.k, nb = k / QK_K;
  const size_t s0 = t * job->rows_per_prep;
  const size_t s1 = s0 + job->rows_per_prep < job->n_pairs ? s0 + job->rows_per_prep : job->n_pairs;
  const int64_t prologue = job->ek->kn.prologue;
  float *h = (float *)malloc(k_in * sizeof(float));
  if (!h) abort(); /* a few KB: nothing sensible remains to be done without them */
  for (size_t s = s0; s < s1; s++) {
    const size_t pair = job->pair_of[s];
    const float *x = job->a + (job->per_slot ? pair : pair / job->top_k) * job->a_width;
    if (prologue == PROLOGUE_SWIGLU) {
      specd_swiglu_row(x, x + k_in, h, k_in);
      x = h;
    } else if (prologue == PROLOGUE_SWIGLU_OAI) {
      const float alpha = job->ek->alpha, limit = job->ek->limit;
      for (size_t i = 0; i < k_in; i++) {
        const float g = x[i] < limit ? x[i] : limit;
        const float u = x[k_in + i] < -limit ? -limit : x[k_in + i] > limit ? limit : x[k_in + i];
        h[i] = g / (1.0f + expf(alpha * (-g))) * (u + 1.0f);
      }
      x = h;
    }
    if (job->floats) {
      memcpy((float *)job->act.x + s * k_in, x, k_in * sizeof(float));
    } else {
      const Act *act = &job->act;
      quantize_row(x, k_in, k, act->q + s * k, act->d + s * nb, act->sum16 + s * (k / 16),
                   act->sum32 + s * (k / 32));
    }
  }
  free(h);
}

static void experts_task(void *p, size_t t) {
  const ExpertsJob *job = (const ExpertsJob *)p;
  const size_t e = job->task_expert[t], n = job->n;
  const size_t first = job->start[e], rows = job->start[e + 1] - first;
  const uint8_t *we = job->w + e * job->expert_bytes;
  float acc[ROW_TILE][GROUP];
  for (size_t c0 = job->task_g0[t]; c0 < job->task_g1[t]; c0 += COL_TILE) {
    const size_t c1 = c0 + COL_TILE < job->task_g1[t] ? c0 + COL_TILE : job->task_g1[t];
    for (size_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
      const size_t mt = rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE;
      for (size_t c = c0; c < c1; c++) {
        memset(acc, 0, mt * sizeof acc[0]);
        job->fn(we + c * job->group_bytes, job->units, &job->act, first + m0, mt, acc);
        const size_t cols = n - c * GROUP < GROUP ? n - c * GROUP : GROUP;
        if (job->bias)
          for (size_t m = 0; m < mt; m++)
            for (size_t r = 0; r < cols; r++) acc[m][r] += job->bias[e * n + c * GROUP + r];
        for (size_t m = 0; m < mt; m++)
          memcpy(job->y + job->pair_of[first + m0 + m] * n + c * GROUP, acc[m],
                 cols * sizeof(float));
      }
    }
  }
}

static OrtStatus *experts_compute(void *kernel, OrtKernelContext *ctx) {
  const ExpertsKernel *ek = (const ExpertsKernel *)kernel;
  const Kernel *kn = &ek->kn;
  const OrtValue *a_val, *ids_val, *w_val;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &a_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 1, &ids_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 2, &w_val));
  int64_t adims[8], idims[8], wdims[8];
  size_t arank, irank, wrank;
  CHECK(specd_tensor_shape(a_val, adims, &arank));
  CHECK(specd_tensor_shape(ids_val, idims, &irank));
  CHECK(specd_tensor_shape(w_val, wdims, &wrank));
  if (irank != 2) return specd_fail("GgufExperts: ids is not [S, top_k]");
  const size_t s_tok = (size_t)idims[0], top_k = (size_t)idims[1], n_pairs = s_tok * top_k;
  const size_t k_in = (size_t)kn->k, n = (size_t)kn->n, nb = (k_in + QK_K - 1) / QK_K;
  const size_t k = nb * QK_K;
  const int gated = kn->prologue == PROLOGUE_SWIGLU || kn->prologue == PROLOGUE_SWIGLU_OAI;
  const size_t a_width = gated ? 2 * k_in : k_in;
  const int per_slot = arank == 3;
  if (!(arank == 2 || arank == 3) || (size_t)adims[0] != s_tok ||
      (per_slot && (size_t)adims[1] != top_k) || (size_t)adims[arank - 1] != a_width)
    return specd_fail(gated ? "GgufExperts: A is not [S, 2K] or [S, top_k, 2K] (gate and up)"
                            : "GgufExperts: A is not [S, K] or [S, top_k, K]");
  const int trim = kn->type == TYPE_Q4_K ? (int)((k - k_in) / 32) : 0;
  size_t units = nb, group_bytes;
  GroupFn fn;
  switch (kn->type) {
    case TYPE_Q4_0: fn = group_q4_0, units = k_in / 32, group_bytes = units * Q4_0_BLOCK_BYTES; break;
    case TYPE_Q4_1: fn = group_q4_1, units = k_in / 32, group_bytes = units * Q4_1_BLOCK_BYTES; break;
    case TYPE_Q4_K:
      fn = group_q4_k, group_bytes = nb * Q4_K_GROUP_BYTES - (size_t)trim * Q4_K_SUB_BYTES;
      break;
    case TYPE_Q6_K: fn = group_q6_k, group_bytes = nb * Q6_K_GROUP_BYTES; break;
    case TYPE_Q8_0: fn = group_q8_0_rows, units = k_in / 32, group_bytes = GROUP * units * Q8_0_BLOCK_BYTES; break;
    case TYPE_MXFP4: fn = group_mxfp4_rows, units = k_in / 32, group_bytes = GROUP * units * MXFP4_BLOCK_BYTES; break;
    default: fn = group_f32_rows, units = k_in, group_bytes = GROUP * k_in * sizeof(float);
  }
  const size_t n_groups = (n + GROUP - 1) / GROUP;
  if (wrank != 3 || (size_t)wdims[1] != n_groups || (size_t)wdims[2] != group_bytes)
    return specd_fail("GgufExperts: W is not [n_expert, ceil(N/16), group bytes] of its type's 16-row layout");
  const size_t n_expert = (size_t)wdims[0];
  size_t n_in = 0;
  CHECK(g_api->KernelContext_GetInputCount(ctx, &n_in));
  const int64_t bdims[2] = {(int64_t)n_expert, kn->n};
  const float *bias = NULL, *weights = NULL;
  CHECK(optional_input(ctx, n_in, 3, bdims, 2, "GgufExperts: B is not [n_expert, N]", &bias));
  CHECK(optional_input(ctx, n_in, 4, idims, 2, "GgufExperts: P is not [S, top_k]", &weights));
  int64_t ydims[3] = {(int64_t)s_tok, weights ? kn->n : (int64_t)top_k, kn->n};
  OrtValue *y_val;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, ydims, weights ? 2 : 3, &y_val));
  const float *a;
  const int64_t *ids;
  const uint8_t *w;
  float *y;
  CHECK(g_api->GetTensorMutableData((OrtValue *)a_val, (void **)&a));
  CHECK(g_api->GetTensorMutableData((OrtValue *)ids_val, (void **)&ids));
  CHECK(g_api->GetTensorMutableData((OrtValue *)w_val, (void **)&w));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  if (n_pairs == 0) return NULL;
  for (size_t p = 0; p < n_pairs; p++)
    if (ids[p] < 0 || (size_t)ids[p] >= n_expert)
      return specd_fail("GgufExperts: an expert id is outside [0, n_expert)");

  const int floats = kn->type == TYPE_F32;
  /* one allocation: start [n_expert + 1] | pair_of [P] | tasks 3 x [P * n_groups] at most |
     the quantized rows (or the float rows) | the products [P, N] where P weighs them */
  const size_t max_tasks = n_pairs * n_groups;
  const size_t idx_bytes = (n_expert + 1 + n_pairs + 3 * max_tasks) * sizeof(size_t);
  const size_t act_bytes = floats ? n_pairs * k_in * sizeof(float)
                                  : n_pairs * k + n_pairs * nb * 4 + n_pairs * (k / 32) * 2 +
                                        n_pairs * (k / 16) * 2;
  const size_t out_bytes = weights ? n_pairs * n * sizeof(float) : 0;
  uint8_t *scratch = (uint8_t *)malloc(idx_bytes + act_bytes + out_bytes);
  if (!scratch) return g_api->CreateStatus(ORT_FAIL, "GgufExperts: out of memory");
  size_t *start = (size_t *)scratch, *pair_of = start + n_expert + 1;
  size_t *task_expert = pair_of + n_pairs, *task_g0 = task_expert + max_tasks,
         *task_g1 = task_g0 + max_tasks;
  uint8_t *act_mem = scratch + idx_bytes;
  float *products = weights ? (float *)(act_mem + act_bytes) : y;

  /* counting sort of the pairs by expert (stable: a token's rows stay in order) */
  memset(start, 0, (n_expert + 1) * sizeof(size_t));
  for (size_t p = 0; p < n_pairs; p++) start[ids[p] + 1]++;
  for (size_t e = 0; e < n_expert; e++) start[e + 1] += start[e];
  {
    size_t *fill = task_g0; /* scratch for the sort: a copy of start */
    memcpy(fill, start, n_expert * sizeof(size_t));
    for (size_t p = 0; p < n_pairs; p++) pair_of[fill[ids[p]]++] = p;
  }
  /* tasks of a few row groups of one expert: about 128 in all, at least one per expert */
  size_t used = 0;
  for (size_t e = 0; e < n_expert; e++) used += start[e + 1] > start[e];
  size_t per = (used * n_groups + 127) / 128;
  per = per < 1 ? 1 : per;
  size_t n_tasks = 0;
  for (size_t e = 0; e < n_expert; e++) {
    if (start[e + 1] == start[e]) continue;
    for (size_t g = 0; g < n_groups; g += per) {
      task_expert[n_tasks] = e, task_g0[n_tasks] = g;
      task_g1[n_tasks++] = g + per < n_groups ? g + per : n_groups;
    }
  }

  ExpertsJob job = {ek, fn, w, n_groups * group_bytes, group_bytes, units, n, top_k, k_in,
                    a_width, per_slot, floats, a, bias, ids, start, pair_of,
                    {NULL, NULL, NULL, NULL, k, trim, NULL}, products, task_expert, task_g0,
                    task_g1, 0, n_pairs};
  if (floats) {
    job.act.x = (const float *)act_mem;
  } else {
    job.act.q = (int8_t *)act_mem;
    job.act.d = (float *)(act_mem + n_pairs * k);
    job.act.sum32 = (int16_t *)(act_mem + n_pairs * k + n_pairs * nb * 4);
    job.act.sum16 = job.act.sum32 + n_pairs * (k / 32);
  }
  size_t prep_tasks = n_pairs * k_in / PREP_VALUES;
  prep_tasks = prep_tasks < 1 ? 1 : prep_tasks > 8 ? 8 : prep_tasks > n_pairs ? n_pairs : prep_tasks;
  job.rows_per_prep = (n_pairs + prep_tasks - 1) / prep_tasks;
  specd_parallel_for(experts_prep_task, &job, (n_pairs + job.rows_per_prep - 1) / job.rows_per_prep);
  specd_parallel_for(experts_task, &job, n_tasks);
  if (weights) /* the weighted sum over a token's slots, in slot order */
    for (size_t s = 0; s < s_tok; s++) {
      float *out = y + s * n;
      const float *src = products + s * top_k * n, *pw = weights + s * top_k;
      for (size_t c = 0; c < n; c++) out[c] = src[c] * pw[0];
      for (size_t j = 1; j < top_k; j++)
        for (size_t c = 0; c < n; c++) out[c] = out[c] + src[j * n + c] * pw[j];
    }
  free(scratch);
  return NULL;
}

static OrtStatus *experts_create(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  ExpertsKernel ek = {{0, 0, 0, PROLOGUE_NONE, 0.0f}, 0.0f, 0.0f};
  CHECK(api->KernelInfoGetAttribute_int64(info, "ggml_type", &ek.kn.type));
  CHECK(api->KernelInfoGetAttribute_int64(info, "K", &ek.kn.k));
  CHECK(api->KernelInfoGetAttribute_int64(info, "N", &ek.kn.n));
  ek.kn.prologue = specd_int64_attribute_or(api, info, "prologue", PROLOGUE_NONE);
  if (ek.kn.prologue != PROLOGUE_NONE && ek.kn.prologue != PROLOGUE_SWIGLU &&
      ek.kn.prologue != PROLOGUE_SWIGLU_OAI)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufExperts: prologue must be 0 (none), "
                                                   "2 (SwiGlu) or 3 (gpt-oss's SwiGlu)");
  if (ek.kn.prologue == PROLOGUE_SWIGLU_OAI) {
    CHECK(api->KernelInfoGetAttribute_float(info, "alpha", &ek.alpha));
    CHECK(api->KernelInfoGetAttribute_float(info, "limit", &ek.limit));
  }
  const int64_t t = ek.kn.type;
  if (t != TYPE_F32 && t != TYPE_Q4_0 && t != TYPE_Q4_1 && t != TYPE_Q8_0 && t != TYPE_Q4_K &&
      t != TYPE_Q6_K && t != TYPE_MXFP4)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "GgufExperts: ggml_type must be 0 (F32), 2 (Q4_0), 3 (Q4_1), "
                             "8 (Q8_0), 12 (Q4_K), 14 (Q6_K) or 39 (MXFP4)");
  if (ek.kn.k <= 0 || ek.kn.n <= 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufExperts: K and N must be positive");
  if ((t == TYPE_Q4_0 || t == TYPE_Q4_1 || t == TYPE_Q8_0 || t == TYPE_MXFP4) && ek.kn.k % 32)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "GgufExperts: K of a matrix of blocks of 32 must be a multiple of 32");
  return specd_new_state(&ek, sizeof ek, kernel);
}

static const ONNXTensorElementDataType EXPERTS_INPUTS[] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const SpecdOpDef specd_gguf_experts = {"GgufExperts", 5, EXPERTS_INPUTS, experts_create,
                                       experts_compute, 0, NULL, 3, 0};
