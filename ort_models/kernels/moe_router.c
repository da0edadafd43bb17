/* specd.MoeRouter: which experts each token of a mixture-of-experts block wakes, and their
 * weights, as llama.cpp's build_moe_ffn chooses them.
 *
 *   X    float32 [S, E]          the block's normed input
 *   W    float32 [n_expert, E]   the router (ffn_gate_inp)
 *   B    float32 [n_expert]      optional: its bias (gpt-oss), added to the logits
 *   ids  int64   [S, top_k]      out: the chosen experts, the largest first
 *   P    float32 [S, top_k]      out: their weights
 *   attributes: top_k; gating: 0 softmax over all the logits, then the top k of the
 *               probabilities (qwen3moe); 1 the top k of the logits, then a softmax over
 *               those k (gpt-oss); norm (0/1): the weights divided by their sum (clamped
 *               below at 2^-14, as llama.cpp does); scale (float, 0 or 1: none): times it
 *
 * Arithmetic: logit e = specd_dot_f32(W[e], x) (+ B[e]); a softmax subtracts the max,
 * takes exp (the kernels' Cephes polynomial, specd_math.h) of each, sums them in double in
 * order and multiplies each by float(1 / sum); ties in the top k go to the lower id. Each
 * row is computed alone in this fixed order, so a row of a verify block equals a single
 * step bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specd_math.h"
#include "specd_ops.h"

float specd_dot_f32(const float *w, const float *x, size_t n) {
  size_t i = 0;
#if SPECD_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i)));
  float l[8];
  _mm256_storeu_ps(l, acc);
#else
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; i + 8 <= n; i += 8)
    for (int e = 0; e < 8; e++) l[e] = l[e] + w[i + e] * x[i + e];
#endif
  for (int e = 0; i < n; i++, e++) l[e] = l[e] + w[i] * x[i];
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

typedef struct {
  int64_t top_k, gating, norm;
  float scale;
} Router;

enum { GATING_SOFTMAX = 0, GATING_SOFTMAX_WEIGHT = 1 };

/* v[0..n) -> their softmax, in place */
static void softmax(float *v, size_t n) {
  float mx = -INFINITY;
  for (size_t i = 0; i < n; i++) mx = v[i] > mx ? v[i] : mx;
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    v[i] = exp_scalar(v[i] - mx);
    sum += (double)v[i];
  }
  const float inv = (float)(1.0 / sum);
  for (size_t i = 0; i < n; i++) v[i] = v[i] * inv;
}

typedef struct {
  const Router *r;
  const float *x, *w, *b;
  int64_t *ids;
  float *p;
  size_t e, n_expert;
} Job;

static void route_row(void *data, size_t s) {
  const Job *job = (const Job *)data;
  const Router *r = job->r;
  const size_t n_expert = job->n_expert, k = (size_t)r->top_k;
  float *logits = (float *)malloc(n_expert * sizeof(float));
  if (!logits) abort(); /* a few hundred bytes */
  const float *x = job->x + s * job->e;
  for (size_t i = 0; i < n_expert; i++) {
    logits[i] = specd_dot_f32(job->w + i * job->e, x, job->e);
    if (job->b) logits[i] = logits[i] + job->b[i];
  }
  if (r->gating == GATING_SOFTMAX) softmax(logits, n_expert);
  int64_t *ids = job->ids + s * k;
  float *p = job->p + s * k;
  for (size_t j = 0; j < k; j++) { /* the largest not taken yet, the lower id on ties */
    size_t best = n_expert;
    for (size_t i = 0; i < n_expert; i++) {
      int taken = 0;
      for (size_t t = 0; t < j; t++) taken |= (size_t)ids[t] == i;
      if (!taken && (best == n_expert || logits[i] > logits[best])) best = i;
    }
    ids[j] = (int64_t)best;
    p[j] = logits[best];
  }
  if (r->gating == GATING_SOFTMAX_WEIGHT) softmax(p, k);
  if (r->norm) {
    float sum = 0.0f;
    for (size_t j = 0; j < k; j++) sum = sum + p[j];
    sum = sum < 6.103515625e-5f ? 6.103515625e-5f : sum;
    for (size_t j = 0; j < k; j++) p[j] = p[j] / sum;
  }
  if (r->scale != 0.0f && r->scale != 1.0f)
    for (size_t j = 0; j < k; j++) p[j] = p[j] * r->scale;
  free(logits);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  const Router *r = (const Router *)kernel;
  const OrtValue *x_val, *w_val, *b_val = NULL;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &x_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 1, &w_val));
  size_t n_in = 0;
  CHECK(g_api->KernelContext_GetInputCount(ctx, &n_in));
  if (n_in > 2) CHECK(g_api->KernelContext_GetInput(ctx, 2, &b_val));
  int64_t xd[8], wd[8], bd[8];
  size_t xr, wr, br;
  CHECK(specd_tensor_shape(x_val, xd, &xr));
  CHECK(specd_tensor_shape(w_val, wd, &wr));
  if (xr != 2 || wr != 2 || xd[1] != wd[1])
    return specd_fail("MoeRouter: X is not [S, E] or W not [n_expert, E]");
  if (r->top_k > wd[0]) return specd_fail("MoeRouter: top_k is larger than n_expert");
  if (b_val) {
    CHECK(specd_tensor_shape(b_val, bd, &br));
    if (br != 1 || bd[0] != wd[0]) return specd_fail("MoeRouter: B is not [n_expert]");
  }
  const int64_t odims[2] = {xd[0], r->top_k};
  OrtValue *ids_val, *p_val;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, odims, 2, &ids_val));
  CHECK(g_api->KernelContext_GetOutput(ctx, 1, odims, 2, &p_val));
  Job job = {r, NULL, NULL, NULL, NULL, NULL, (size_t)xd[1], (size_t)wd[0]};
  CHECK(g_api->GetTensorMutableData((OrtValue *)x_val, (void **)&job.x));
  CHECK(g_api->GetTensorMutableData((OrtValue *)w_val, (void **)&job.w));
  if (b_val) CHECK(g_api->GetTensorMutableData((OrtValue *)b_val, (void **)&job.b));
  CHECK(g_api->GetTensorMutableData(ids_val, (void **)&job.ids));
  CHECK(g_api->GetTensorMutableData(p_val, (void **)&job.p));
  specd_parallel_for(route_row, &job, (size_t)xd[0]);
  return NULL;
}

static OrtStatus *create(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  Router r = {0, 0, 0, 0.0f};
  CHECK(api->KernelInfoGetAttribute_int64(info, "top_k", &r.top_k));
  r.gating = specd_int64_attribute_or(api, info, "gating", GATING_SOFTMAX);
  r.norm = specd_int64_attribute_or(api, info, "norm", 0);
  CHECK(api->KernelInfoGetAttribute_float(info, "scale", &r.scale));
  if (r.top_k < 1)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "MoeRouter: top_k must be at least 1");
  if (r.gating != GATING_SOFTMAX && r.gating != GATING_SOFTMAX_WEIGHT)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "MoeRouter: gating must be 0 (softmax) or 1 (softmax of the top k)");
  return specd_new_state(&r, sizeof r, kernel);
}

static const ONNXTensorElementDataType INPUTS[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                   ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                   ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
static const ONNXTensorElementDataType OUTPUTS[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
                                                    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const SpecdOpDef specd_moe_router = {"MoeRouter", 3, INPUTS, create, compute, 2, OUTPUTS, 2, 0};
