/* specd.CausalAttention: exact, row-invariant causal attention, reading the KV cache in place.
 *
 *   Q         float32 [S, H*hd]            queries of the S new tokens (rotated), at
 *                                          positions pos .. pos+S-1
 *   K, V      float32 [1, Hkv, n_ctx, hd]  the caches, rows 0 .. pos+S-1 already written
 *   position  int64   [1]                  pos
 *   Y         float32 [S, H*hd]
 *   attributes: num_heads (H), kv_num_heads (Hkv, dividing H), scale
 *
 * Every (row, head) is computed on its own numbers, in one fixed order (the heads that share
 * a KV head run in one task, which reads each key and value once for all of them): scores q.k_t * scale over keys
 * t = 0 .. p (p = pos + row; dot products in 8 lanes of fused multiply-adds, summed in a
 * fixed tree; 8 keys at a time where 8 remain, with the same tree), their max,
 * exp(score - max), the sum of those in 8 lanes, the values weighted in key order, and a
 * division by the sum. A row of a block therefore equals the same row computed alone, bit
 * for bit (speculative verification relies on it), and no key past p is ever read. The
 * plain C path follows the same lanes, so it rounds as the AVX2 path does.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "specd_ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECD_AVX2 1
#endif

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
} Attn;

/* exp for x <= 0 (softmax arguments): Cephes' expf polynomial, ~1 ulp; 0 below -87 */
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

typedef struct {
  const float *q;
  const void *k, *v; /* KV_T */
  float *y;
  size_t heads, group, hd, n_ctx, pos;
  float scale;
} Job;

/* w[0..padded) <- exp(w - max) over the first n_keys (0 past them); returns their sum */
static float softmax_weights(float *w, size_t n_keys, size_t padded) {
  float mx = -INFINITY;
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
  return lanes_sum(l);
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
  if (pos[0] < 0 || pos[0] + qd[0] > kd[2])
    return specd_fail("CausalAttention: position + S exceeds the cache");
  OrtValue *y_val;
  float *y;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, qd, 2, &y_val));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  Job job = {q, k, v, y, (size_t)at->heads, (size_t)(at->heads / at->kv_heads), (size_t)hd,
             (size_t)kd[2], (size_t)pos[0], at->scale};
  return g_api->KernelContext_ParallelFor(ctx, task, (size_t)qd[0] * (size_t)at->kv_heads, 0,
                                          &job);
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
const SpecdOpDef specd_causal_attention = {"CausalAttention", 4, INPUTS, create, compute_f32};
const SpecdOpDef specd_causal_attention_f16 = {"CausalAttentionF16", 4, INPUTS_F16, create,
                                               compute_f16};
