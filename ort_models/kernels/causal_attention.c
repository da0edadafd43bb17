/* specd.CausalAttention: exact, row-invariant causal attention, reading the KV cache in place.
 *
 *   Q         float32 [S, H*hd]            queries of the S new tokens (rotated), at
 *                                          positions pos .. pos+S-1
 *   K, V      float32 [1, Hkv, n_ctx, hd]  the caches, rows 0 .. pos+S-1 already written
 *   position  int64   [1]                  pos
 *   Y         float32 [S, H*hd]
 *   attributes: num_heads (H), kv_num_heads (Hkv, dividing H), scale, window (optional,
 *               0): > 0, a query sees its own key and the window - 1 before it (a
 *               sliding-window layer), else every earlier one; with a window the cache
 *               may be a ring shorter than the context, position p in row p % n_ctx,
 *               as long as it holds the window and S - 1 more rows
 *
 * Every (row, head) is computed on its own numbers, in one fixed order (the heads that share
 * a KV head run in one task, which reads each key and value once for all of them): scores q.k_t * scale over keys
 * t = first .. p (p = pos + row, first = 0 or p + 1 - window; dot products in 8 lanes of
 * fused multiply-adds, summed in a
 * fixed tree; 8 keys at a time where 8 remain, with the same tree), their max,
 * exp(score - max), the sum of those in 8 lanes, the values weighted in key order, and a
 * division by the sum. A row of a block therefore equals the same row computed alone, bit
 * for bit (speculative verification relies on it), and no key past p is ever read. The
 * plain C path follows the same lanes, so it rounds as the AVX2 path does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specd_math.h" /* SPECD_AVX2 */
#include "specd_ops.h"

enum { LANES = 8 };

#if SPECD_AVX2
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* query heads per pass: scores 8 keys x S_HEADS heads, values 32 dims x V_HEADS heads of
   accumulators, within the vector registers (32 with AVX-512VL, else 16) */
#if defined(__AVX512VL__)
enum { S_HEADS = 3, V_HEADS = 6 };
#else
enum { S_HEADS = 1, V_HEADS = 2 };
#endif
/* heads for the next pass; the switch cases past the maximum are never taken and compile
   as empty passes (n % (MAX + 1)) */
#define HEADS_LEFT(left, max) ((left) < (size_t)(max) ? (left) : (size_t)(max))
#endif

typedef struct {
  int64_t heads, kv_heads;
  float scale;
  int64_t window; /* > 0: a query sees itself and the window - 1 keys before it */
} Attn;

/* ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): the tree every path sums 8 lanes in (the one
 * _mm256_hadd_ps gives, so that 8 keys can be summed at once) */
static float lanes_sum(const float l[LANES]) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

#if SPECD_AVX2
static inline float hsum8(__m256 v) {
  float l[LANES];
  _mm256_storeu_ps(l, v);
  return lanes_sum(l);
}

#endif

typedef struct {
  const float *q;
  const void *k, *v; /* KV_T */
  float *y;
  size_t heads, group, hd, n_ctx, pos;
  float scale;
  size_t window; /* 0: every earlier key */
  /* CachedAttention, else NULL: row r's last key position (its own, or not causal its
     segment's last row's) and the cache slot its keys are in */
  const size_t *row_pos, *row_slot;
  /* not causal with a window, else NULL: row r's first key position (the window measured
     back from the row's own position, as llama.cpp masks a sliding window) */
  const size_t *row_first;
  /* CachedAttention with sinks, else NULL: per query head, a logit that joins every
     row's softmax without a value (gpt-oss's attention sinks) */
  const float *sinks;
} Job;

/* w[0..padded) <- exp(w - max) over the first n_keys (0 past them); returns their sum.
 * With a sink logit (not NULL): the max is over the keys and the sink, and the sum adds
 * exp(sink - max) after the keys' (a softmax over one more column that has no value). */
static float softmax_weights(float *w, size_t n_keys, size_t padded, const float *sink) {
  float mx = sink ? *sink : -INFINITY;
  for (size_t t = 0; t < n_keys; t++) mx = w[t] > mx ? w[t] : mx;
  for (size_t t = n_keys; t < padded; t++) w[t] = -INFINITY;
  float l[LANES] = {0};
#if SPECD_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (size_t t = 0; t < padded; t += LANES) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + t), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(w + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  _mm256_storeu_ps(l, acc);
#else
  for (size_t t = 0; t < padded; t += LANES)
    for (int i = 0; i < LANES; i++) {
      w[t + i] = exp_scalar(w[t + i] - mx);
      l[i] = l[i] + w[t + i];
    }
#endif
  return sink ? lanes_sum(l) + exp_scalar(*sink - mx) : lanes_sum(l);
}

/* Whether S rows from `pos` fit the cache of n_ctx rows: every position below it, or with a
 * window, a ring (position p in row p % n_ctx) that holds a block's window and the block:
 * a row of the block then never overwrites a key that an earlier row of it reads. */
static int fits(int64_t pos, int64_t s_len, int64_t n_ctx, int64_t window) {
  return pos + s_len <= n_ctx || (window && s_len + window - 1 <= n_ctx);
}

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

/* float32 caches */
#define KV_T float
#define KV f32
#define LOAD8(p) _mm256_loadu_ps(p)
#define LOAD1(p) (*(p))
#include "causal_attention_kv.h"
#undef KV_T
#undef KV
#undef LOAD8
#undef LOAD1

/* float16 caches (half the bytes to keep and to read; F16C converts) */
#define KV_T uint16_t
#define KV f16
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD1(p) specd_f16_to_f32(p)
#include "causal_attention_kv.h"
#undef KV_T
#undef KV
#undef LOAD8
#undef LOAD1

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx, void (*task)(void *, size_t)) {
  const Attn *at = (const Attn *)kernel;
  const OrtValue *q_val, *k_val, *v_val, *pos_val;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &q_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 1, &k_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 2, &v_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 3, &pos_val));
  int64_t qd[8], kd[8], vd[8], pd[8];
  size_t qr, kr, vr, pr;
  CHECK(specd_tensor_shape(q_val, qd, &qr));
  CHECK(specd_tensor_shape(k_val, kd, &kr));
  CHECK(specd_tensor_shape(v_val, vd, &vr));
  CHECK(specd_tensor_shape(pos_val, pd, &pr));
  if (qr != 2 || qd[1] % at->heads) return specd_fail("CausalAttention: Q is not [S, H*hd]");
  const int64_t hd = qd[1] / at->heads;
  if (kr != 4 || kd[0] != 1 || kd[1] != at->kv_heads || kd[3] != hd || vr != 4 ||
      memcmp(kd, vd, sizeof(int64_t) * 4) != 0)
    return specd_fail("CausalAttention: K and V are not both [1, Hkv, n_ctx, hd]");
  if (hd % LANES) return specd_fail("CausalAttention: head_dim must be a multiple of 8");
  if (pr != 1 || pd[0] != 1) return specd_fail("CausalAttention: position is not [1]");
  const float *q;
  void *k, *v;
  const int64_t *pos;
  CHECK(g_api->GetTensorMutableData((OrtValue *)q_val, (void **)&q));
  CHECK(g_api->GetTensorMutableData((OrtValue *)k_val, &k));
  CHECK(g_api->GetTensorMutableData((OrtValue *)v_val, &v));
  CHECK(g_api->GetTensorMutableData((OrtValue *)pos_val, (void **)&pos));
  if (pos[0] < 0 || !fits(pos[0], qd[0], kd[2], at->window))
    return specd_fail(at->window ? "CausalAttention: position + S exceeds the cache, and "
                                   "the window and S exceed it as a ring"
                                 : "CausalAttention: position + S exceeds the cache");
  OrtValue *y_val;
  float *y;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, qd, 2, &y_val));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  Job job = {q, k, v, y, (size_t)at->heads, (size_t)(at->heads / at->kv_heads), (size_t)hd,
             (size_t)kd[2], (size_t)pos[0], at->scale, (size_t)at->window, NULL, NULL, NULL,
             NULL};
  specd_parallel_for(task, &job, (size_t)qd[0] * (size_t)at->kv_heads);
  return NULL;
}


static OrtStatus *compute_f32(void *kernel, OrtKernelContext *ctx) {
  return compute(kernel, ctx, run_task_f32);
}
static OrtStatus *compute_f16(void *kernel, OrtKernelContext *ctx) {
  return compute(kernel, ctx, run_task_f16);
}

static OrtStatus *create(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  Attn at;
  CHECK(api->KernelInfoGetAttribute_int64(info, "num_heads", &at.heads));
  CHECK(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &at.kv_heads));
  CHECK(api->KernelInfoGetAttribute_float(info, "scale", &at.scale));
  at.window = specd_int64_attribute_or(api, info, "window", 0);
  if (at.window < 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "CausalAttention: window must be >= 0");
  if (at.heads <= 0 || at.kv_heads <= 0 || at.heads % at.kv_heads)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "CausalAttention: kv_num_heads must divide num_heads");
  return specd_new_state(&at, sizeof at, kernel);
}

static const ONNXTensorElementDataType INPUTS[] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};
static const ONNXTensorElementDataType INPUTS_F16[] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};
const SpecdOpDef specd_causal_attention = {"CausalAttention", 4, INPUTS, create, compute_f32,
                                           0, NULL};
const SpecdOpDef specd_causal_attention_f16 = {"CausalAttentionF16", 4, INPUTS_F16, create,
                                               compute_f16, 0, NULL};

/* ---------------------------------------------------------------------------------- */
/* specd.CachedAttention: rotary embedding, the write of the new keys and values into the
 * cache, and CausalAttention, in one node (one instead of ~14 per layer: the per-node
 * cost of ONNX Runtime is a tenth of a small model's step).
 *
 *   q        float32 [S, H*hd]     projections of the S new tokens at positions
 *   k, v     float32 [S, Hkv*hd]   pos .. pos+S-1, not rotated
 *   past_key, past_value  KV_T [slots, Hkv, n_ctx, hd]  the caches of `slots` sequences
 *   position int64   [1]           pos (one sequence, in cache slot 0), or
 *            int64   [B, 3]        segments: rows of B sequences packed in one call, each
 *                                  (slot, pos, rows): the next `rows` rows of q, k and v
 *                                  are that sequence's tokens at pos .. pos+rows-1 and
 *                                  attend over its own cache slot only
 *   cos, sin float32 [P, rd/2]     rotary tables (P > pos+S-1)
 *   sinks    float32 [H]           optional: a logit per query head that joins each
 *                                  softmax's max and sum with no value (gpt-oss's
 *                                  attention sinks: llama.cpp's soft_max sinks)
 *   Y        float32 [S, H*hd]
 *   present_key, present_value     the caches with rows pos .. pos+S-1 written; in place
 *                                  where they are bound to the past buffers (specd's
 *                                  runner does), else a copy first
 *   attributes: num_heads, kv_num_heads, scale, rotary_dim (rd, even, <= hd),
 *               interleaved (1: pairs (2i, 2i+1) rotate; 0: (i, i + rd/2)),
 *               packed (optional, 0): 1 = q is [S, (H+Hkv)*hd], each row q then k, and
 *               k names the same tensor; 2 = q is [S, (H+2Hkv)*hd], q, k, v, and k and v
 *               name it too (the product over the stacked projections, without a Split),
 *               window (optional, 0): as CausalAttention's,
 *               causal (optional, 1): 0 = each row of a segment attends to every key of
 *               its sequence up to the segment's last row (pos+rows-1), its later rows
 *               included (a drafter head's block, an image's embeddings: not causal
 *               within itself); with a window, a row at p sees no key at or before
 *               p - window (llama.cpp's sliding-window mask, whatever the causality)
 *
 * The rotation of x at a row is, per pair (a, b) and angle i, a*cos - b*sin and
 * b*cos + a*sin in float32 without fused multiply-adds (dims past rd pass through); an
 * f16 cache takes the rotated keys and the values rounded to nearest even (as a Cast).
 * Then the attention is CausalAttention's, on the rotated queries, each row over its own
 * sequence's keys: a row computes the same bits whatever else is packed beside it. */

typedef struct {
  Attn at;
  int64_t rotary_dim, interleaved, packed;
  int64_t causal; /* 0: a segment's rows see all its keys (up to its last row) */
} Cached;

/* float32 -> float16 bits, rounded to nearest even (F16C's vcvtps2ph, ONNX's Cast) */
static uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) /* inf, nan (quieted, top mantissa bits kept) */
    return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0));
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
  if (ax < 0x38800000u) { /* below 2^-14: subnormal or zero */
    if (ax < 0x33000000u) return (uint16_t)sign;           /* below 2^-25 */
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - (ax >> 23);
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  const uint32_t r = ax - 0x38000000u; /* exponent rebiased from 127 to 15 */
  uint32_t q = r >> 13;
  const uint32_t rem = r & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}

/* out[h*hd ..] = x[h*hd ..] rotated by the angles of one position, for `heads` heads */
static void rotate(const float *x, float *out, size_t heads, size_t hd, size_t rd,
                   int interleaved, const float *cs, const float *sn) {
  const size_t half = rd / 2;
  for (size_t h = 0; h < heads; h++) {
    const float *xh = x + h * hd;
    float *oh = out + h * hd;
    for (size_t i = 0; i < half; i++) {
      const size_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
      const float a = xh[ia], b = xh[ib];
      oh[ia] = a * cs[i] - b * sn[i];
      oh[ib] = b * cs[i] + a * sn[i];
    }
    for (size_t d = rd; d < hd; d++) oh[d] = xh[d];
  }
}

static void store_row(const float *x, float *dst, size_t n) { memcpy(dst, x, n * sizeof(float)); }
static void store_row_f16(const float *x, uint16_t *dst, size_t n) {
  size_t d = 0;
#if SPECD_AVX2
  for (; d + LANES <= n; d += LANES)
    _mm_storeu_si128((__m128i *)(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; d < n; d++) dst[d] = f32_to_f16(x[d]);
}

/* A run of consecutive rows of one sequence: its cache slot and first position. */
typedef struct {
  int64_t slot, pos, rows;
} Segment;

/* The call's segments from `position`: [1] (one sequence: slot 0, pos, all S rows) or
 * [B, 3] (slot, pos, rows), rows >= 1 summing to S, slots below n_slots, each run fitting
 * the cache and the rotary tables. NULL and *err set where they do not. */
static Segment *read_segments(const OrtValue *pos_val, int64_t s_len, int64_t n_slots,
                              int64_t n_ctx, int64_t window, int64_t positions, size_t *n_seg,
                              const char **err) {
  int64_t pd[8];
  size_t pr;
  if (specd_tensor_shape(pos_val, pd, &pr) != NULL || !((pr == 1 && pd[0] == 1) ||
                                                        (pr == 2 && pd[1] == 3 && pd[0] >= 1))) {
    *err = "CachedAttention: position is not [1] or segments [B, 3]";
    return NULL;
  }
  const int64_t *pos;
  if (g_api->GetTensorMutableData((OrtValue *)pos_val, (void **)&pos) != NULL) {
    *err = "CachedAttention: position cannot be read";
    return NULL;
  }
  const size_t n = pr == 1 ? 1 : (size_t)pd[0];
  Segment *seg = (Segment *)malloc(n * sizeof(Segment));
  if (!seg) {
    *err = "CachedAttention: out of memory";
    return NULL;
  }
  int64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    seg[i] = pr == 1 ? (Segment){0, pos[0], s_len} : (Segment){pos[3 * i], pos[3 * i + 1], pos[3 * i + 2]};
    total += seg[i].rows;
    *err = seg[i].slot < 0 || seg[i].slot >= n_slots ? "CachedAttention: a segment's slot is not a cache slot"
           : seg[i].rows < 1 ? "CachedAttention: a segment holds no rows"
           : seg[i].pos < 0 || !fits(seg[i].pos, seg[i].rows, n_ctx, window)
               ? (window ? "CachedAttention: position + S exceeds the cache, and the window "
                           "and S exceed it as a ring"
                         : "CachedAttention: position + S exceeds the cache")
           : seg[i].pos + seg[i].rows > positions
               ? "CachedAttention: cos and sin are not [positions, rotary_dim/2] covering "
                 "position + S"
               : NULL;
    if (*err) break;
  }
  if (!*err && total != s_len) *err = "CachedAttention: the segments' rows do not sum to S";
  if (*err) {
    free(seg);
    return NULL;
  }
  *n_seg = n;
  return seg;
}

static OrtStatus *compute_cached(void *kernel, OrtKernelContext *ctx, int f16) {
  const Cached *cd = (const Cached *)kernel;
  const Attn *at = &cd->at;
  const OrtValue *in[9] = {NULL};
  size_t n_in = 0;
  CHECK(g_api->KernelContext_GetInputCount(ctx, &n_in));
  for (size_t i = 0; i < 9 && i < n_in; i++) CHECK(g_api->KernelContext_GetInput(ctx, i, &in[i]));
  int64_t qd[8], kd[8], vd[8], ckd[8], cvd[8], cosd[8], sind[8];
  size_t qr, kr, vr, ckr, cvr, cosr, sinr;
  CHECK(specd_tensor_shape(in[0], qd, &qr));
  CHECK(specd_tensor_shape(in[1], kd, &kr));
  CHECK(specd_tensor_shape(in[2], vd, &vr));
  CHECK(specd_tensor_shape(in[3], ckd, &ckr));
  CHECK(specd_tensor_shape(in[4], cvd, &cvr));
  CHECK(specd_tensor_shape(in[6], cosd, &cosr));
  CHECK(specd_tensor_shape(in[7], sind, &sinr));
  /* heads of hd values in a row of q: H, and Hkv more for each projection packed in */
  const int64_t q_heads = at->heads + cd->packed * at->kv_heads;
  if (qr != 2 || qd[1] % q_heads)
    return specd_fail(cd->packed == 2 ? "CachedAttention: q is not [S, (H+2Hkv)*hd] (packed 2)"
                      : cd->packed  ? "CachedAttention: q is not [S, (H+Hkv)*hd] (packed 1)"
                                    : "CachedAttention: q is not [S, H*hd]");
  const int64_t s_len = qd[0], hd = qd[1] / q_heads, kvw = at->kv_heads * hd;
  const int64_t kw = cd->packed >= 1 ? qd[1] : kvw, vw = cd->packed == 2 ? qd[1] : kvw;
  if (kr != 2 || vr != 2 || kd[0] != s_len || vd[0] != s_len || kd[1] != kw || vd[1] != vw)
    return specd_fail(cd->packed ? "CachedAttention: k and v are not the packed q or [S, Hkv*hd]"
                                 : "CachedAttention: k and v are not [S, Hkv*hd]");
  if (ckr != 4 || ckd[0] < 1 || ckd[1] != at->kv_heads || ckd[3] != hd || cvr != 4 ||
      memcmp(ckd, cvd, sizeof(int64_t) * 4) != 0)
    return specd_fail("CachedAttention: the caches are not both [slots, Hkv, n_ctx, hd]");
  if (hd % LANES) return specd_fail("CachedAttention: head_dim must be a multiple of 8");
  if (cd->rotary_dim > hd) return specd_fail("CachedAttention: rotary_dim exceeds head_dim");
  if (cosr != 2 || sinr != 2 || cosd[1] != cd->rotary_dim / 2 || sind[1] != cosd[1] ||
      sind[0] != cosd[0])
    return specd_fail("CachedAttention: cos and sin are not [positions, rotary_dim/2] "
                      "covering position + S");
  const float *sinks = NULL;
  if (in[8]) { /* optional */
    int64_t sd[8];
    size_t sr;
    CHECK(specd_tensor_shape(in[8], sd, &sr));
    if (sr != 1 || sd[0] != at->heads)
      return specd_fail("CachedAttention: sinks is not [num_heads]");
    CHECK(g_api->GetTensorMutableData((OrtValue *)in[8], (void **)&sinks));
  }
  const int64_t n_ctx = ckd[2];
  size_t n_seg = 0;
  const char *err = NULL;
  Segment *seg = read_segments(in[5], s_len, ckd[0], n_ctx, at->window, cosd[0], &n_seg, &err);
  if (!seg) return specd_fail(err);
  const float *q, *k, *v, *cs, *sn;
  void *past_k, *past_v, *pres_k, *pres_v;
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[0], (void **)&q));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[1], (void **)&k));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[2], (void **)&v));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[3], &past_k));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[4], &past_v));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[6], (void **)&cs));
  CHECK(g_api->GetTensorMutableData((OrtValue *)in[7], (void **)&sn));
  OrtValue *y_val, *pk_val, *pv_val;
  float *y;
  const int64_t yd[2] = {s_len, at->heads * hd};
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, yd, 2, &y_val));
  CHECK(g_api->KernelContext_GetOutput(ctx, 1, ckd, 4, &pk_val));
  CHECK(g_api->KernelContext_GetOutput(ctx, 2, cvd, 4, &pv_val));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  CHECK(g_api->GetTensorMutableData(pk_val, &pres_k));
  CHECK(g_api->GetTensorMutableData(pv_val, &pres_v));
  const size_t elem = f16 ? 2 : 4;
  const size_t cache_bytes = (size_t)(ckd[0] * at->kv_heads * n_ctx * hd) * elem;
  if (pres_k != past_k) memcpy(pres_k, past_k, cache_bytes); /* not bound in place */
  if (pres_v != past_v) memcpy(pres_v, past_v, cache_bytes);

  const size_t heads = (size_t)at->heads, kvh = (size_t)at->kv_heads, d = (size_t)hd;
  const size_t rd = (size_t)cd->rotary_dim, half = rd / 2, rows = (size_t)s_len;
  /* rotated queries [S, H*hd], one rotated key row, and each row's position and slot */
  float *qr_rows = (float *)malloc((rows * heads * d + kvh * d) * sizeof(float));
  size_t *row_pos = (size_t *)malloc(3 * rows * sizeof(size_t));
  if (!qr_rows || !row_pos) {
    free(qr_rows);
    free(row_pos);
    free(seg);
    return g_api->CreateStatus(ORT_FAIL, "CachedAttention: out of memory");
  }
  size_t *row_slot = row_pos + rows;
  size_t *row_first = !cd->causal && at->window ? row_pos + 2 * rows : NULL;
  float *krow = qr_rows + rows * heads * d;
  /* where row s's q, k and v start, and the distance between rows, in floats */
  const size_t q_stride = (size_t)qd[1], k_stride = (size_t)kw, v_stride = (size_t)vw;
  const float *k0 = cd->packed >= 1 ? q + heads * d : k;
  const float *v0 = cd->packed == 2 ? q + (heads + kvh) * d : v;
  const size_t slot_elems = kvh * (size_t)n_ctx * d;
  size_t s = 0;
  for (size_t i = 0; i < n_seg; i++)
    for (int64_t j = 0; j < seg[i].rows; j++, s++) {
      const size_t p = (size_t)(seg[i].pos + j), slot = (size_t)seg[i].slot;
      /* the last key the row sees: itself, or not causal the segment's last row */
      row_pos[s] = cd->causal ? p : (size_t)(seg[i].pos + seg[i].rows - 1);
      if (row_first) row_first[s] = p + 1 > (size_t)at->window ? p + 1 - (size_t)at->window : 0;
      row_slot[s] = slot;
      rotate(q + s * q_stride, qr_rows + s * heads * d, heads, d, rd, (int)cd->interleaved,
             cs + p * half, sn + p * half);
      rotate(k0 + s * k_stride, krow, kvh, d, rd, (int)cd->interleaved, cs + p * half,
             sn + p * half);
      const float *vrow = v0 + s * v_stride;
      for (size_t h = 0; h < kvh; h++) {
        const size_t at_row = slot * slot_elems + (h * (size_t)n_ctx + p % (size_t)n_ctx) * d;
        if (f16) {
          store_row_f16(krow + h * d, (uint16_t *)pres_k + at_row, d);
          store_row_f16(vrow + h * d, (uint16_t *)pres_v + at_row, d);
        } else {
          store_row(krow + h * d, (float *)pres_k + at_row, d);
          store_row(vrow + h * d, (float *)pres_v + at_row, d);
        }
      }
    }
  Job job = {qr_rows, pres_k, pres_v, y, heads, heads / kvh, d, (size_t)n_ctx, 0,
             at->scale, (size_t)at->window, row_pos, row_slot, row_first, sinks};
  specd_parallel_for(f16 ? run_task_f16 : run_task_f32, &job, rows * kvh);
  free(qr_rows);
  free(row_pos);
  free(seg);
  return NULL;
}

static OrtStatus *compute_cached_f32(void *kernel, OrtKernelContext *ctx) {
  return compute_cached(kernel, ctx, 0);
}
static OrtStatus *compute_cached_f16(void *kernel, OrtKernelContext *ctx) {
  return compute_cached(kernel, ctx, 1);
}

static OrtStatus *create_cached(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  Cached cd;
  CHECK(api->KernelInfoGetAttribute_int64(info, "num_heads", &cd.at.heads));
  CHECK(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &cd.at.kv_heads));
  CHECK(api->KernelInfoGetAttribute_float(info, "scale", &cd.at.scale));
  CHECK(api->KernelInfoGetAttribute_int64(info, "rotary_dim", &cd.rotary_dim));
  CHECK(api->KernelInfoGetAttribute_int64(info, "interleaved", &cd.interleaved));
  cd.packed = specd_int64_attribute_or(api, info, "packed", 0); /* 0: q, k, v apart */
  cd.at.window = specd_int64_attribute_or(api, info, "window", 0);
  cd.causal = specd_int64_attribute_or(api, info, "causal", 1);
  if (cd.at.window < 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "CachedAttention: window must be >= 0");
  if (cd.causal != 0 && cd.causal != 1)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "CachedAttention: causal must be 0 or 1");
  if (cd.packed < 0 || cd.packed > 2)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "CachedAttention: packed must be 0, 1 or 2");
  if (cd.at.heads <= 0 || cd.at.kv_heads <= 0 || cd.at.heads % cd.at.kv_heads)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "CachedAttention: kv_num_heads must divide num_heads");
  if (cd.rotary_dim < 0 || cd.rotary_dim % 2)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "CachedAttention: rotary_dim must be even and >= 0");
  return specd_new_state(&cd, sizeof cd, kernel);
}

#define F32 ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
#define F16 ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
#define I64 ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
static const ONNXTensorElementDataType CACHED_IN[] = {F32, F32, F32, F32, F32,
                                                      I64, F32, F32, F32};
static const ONNXTensorElementDataType CACHED_OUT[] = {F32, F32, F32};
static const ONNXTensorElementDataType CACHED_IN_F16[] = {F32, F32, F32, F16, F16,
                                                          I64, F32, F32, F32};
static const ONNXTensorElementDataType CACHED_OUT_F16[] = {F32, F16, F16};
const SpecdOpDef specd_cached_attention = {"CachedAttention", 9, CACHED_IN, create_cached,
                                           compute_cached_f32, 3, CACHED_OUT, 8};
const SpecdOpDef specd_cached_attention_f16 = {"CachedAttentionF16", 9, CACHED_IN_F16,
                                               create_cached, compute_cached_f16, 3,
                                               CACHED_OUT_F16, 8};
