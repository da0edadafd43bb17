/* specd.TokenLogprobs: the logprobs of the tokens SampleTokens emitted, in the graph, so
 * that a request asking for them needs no logits row out of the session. It mirrors the
 * host reference daemon/spec/sampling.py's token_logprob: log softmax of the row's raw
 * logits (before any sampler setting) at the emitted token, and the n most likely tokens.
 *
 *   0 logits       float32 [R, V]
 *   1 plan         int64   [C, 10]  SampleTokens' plan (mode 1: decided; first_row)
 *   2 tokens       int64   [C, D1]  SampleTokens' emitted tokens
 *   3 counts       int64   [C, 3]   SampleTokens' counts (n_emitted first)
 *   4 n_top        int64   [C]      a decided call's top tokens per emitted token (-1: none)
 * Outputs (0 / -1 / 0 where no logprob was asked for):
 *   0 logprobs     double  [C, D1]     log p(tokens[c, j]) under logits[first_row + j]
 *   1 top_ids      int64   [C, D1, N]  the n_top largest logits' ids, descending, ties by
 *   2 top_logprobs double  [C, D1, N]  lower id, -1 past n_top; N = max(1, largest n_top)
 *
 * log p(t) = x[t] - (max + log sum exp(x - max)), the sum in double of float32 exps of the
 * float differences (exp8), in blocks of 8 lanes added in a fixed order (the same bits on
 * every path). NaN logits count as -inf. Emitted token j of a call is row first_row + j:
 * row i of a block decided draft i (or the block's last token), which is what it emits.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specd_math.h" /* exp8, exp_scalar, SPECD_AVX2 */
#include "specd_ops.h"

enum { PLAN_W = 10, N_IN = 5, N_OUT = 3, MAX_TOP = 1024 };
enum { IN_LOGITS, IN_PLAN, IN_TOKENS, IN_COUNTS, IN_NTOP };

typedef struct {
  size_t c, j; /* a call and its emitted token */
} Task;

typedef struct {
  const float *logits;
  size_t V, D1, N;
  const int64_t *plan, *tokens, *n_top;
  const Task *tasks;
  double *logprobs, *top_lp;
  int64_t *top_ids;
} Job;

/* the n largest of x [V] by (value descending, id ascending), NaN as -inf */
static size_t top_n(const float *x, size_t V, size_t n, int32_t *ids, float *vals) {
  size_t m = 0;
  float floor_v = -INFINITY; /* a value enters a full list only above the last kept */
  size_t i = 0;
  while (i < V) {
#if SPECD_AVX2
    if (m == n) { /* skip 8 at a time while none beats the floor */
      const __m256 f = _mm256_set1_ps(floor_v);
      while (i + 8 <= V && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), f,
                                                             _CMP_GT_OQ)))
        i += 8;
      if (i >= V) break;
    }
#endif
    const float v = x[i] != x[i] ? -INFINITY : x[i];
    if (m < n || v > floor_v) {
      size_t at = m < n ? m++ : n - 1; /* the slot freed: the last one */
      while (at > 0 && v > vals[at - 1]) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
      }
      vals[at] = v;
      ids[at] = (int32_t)i;
      if (m == n) floor_v = vals[n - 1];
    }
    i++;
  }
  return m;
}

/* sum exp(x - top) over x [V], exps in float32, the sum in double */
static double exp_sum(const float *x, size_t V, float top) {
  double total = 0.0;
  size_t i = 0;
#if SPECD_AVX2
  const __m256 t = _mm256_set1_ps(top);
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
  for (; i + 8 <= V; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 e = exp8(_mm256_sub_ps(v, t));
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double lanes[8];
  _mm256_storeu_pd(lanes, acc_lo);
  _mm256_storeu_pd(lanes + 4, acc_hi);
#else
  double lanes[8] = {0};
  for (; i + 8 <= V; i += 8)
    for (int l = 0; l < 8; l++) {
      const float v = x[i + l] != x[i + l] ? -INFINITY : x[i + l];
      lanes[l] += (double)exp_scalar(v - top);
    }
#endif
  for (int l = 0; l < 8; l++) total += lanes[l];
  for (; i < V; i++) {
    const float v = x[i] != x[i] ? -INFINITY : x[i];
    total += (double)exp_scalar(v - top);
  }
  return total;
}

static void run_task(void *data, size_t k) {
  const Job *job = (const Job *)data;
  const Task *t = &job->tasks[k];
  const int64_t *pl = job->plan + t->c * PLAN_W;
  const float *x = job->logits + (size_t)(pl[1] + (int64_t)t->j) * job->V;
  const size_t want = (size_t)job->n_top[t->c], n = want ? want : 1;
  int32_t ids[MAX_TOP];
  float vals[MAX_TOP];
  vals[0] = -INFINITY;
  const size_t m = top_n(x, job->V, n, ids, vals);
  const float top = vals[0];
  /* a row without a finite maximum has no softmax */
  const double log_total = isfinite(top) ? (double)top + log(exp_sum(x, job->V, top)) : NAN;
  const size_t at = t->c * job->D1 + t->j;
  const int64_t tok = job->tokens[at];
  const float xt = x[tok] != x[tok] ? -INFINITY : x[tok];
  job->logprobs[at] = (double)xt - log_total;
  for (size_t r = 0; r < want && r < m; r++) {
    job->top_ids[at * job->N + r] = ids[r];
    job->top_lp[at * job->N + r] = (double)vals[r] - log_total;
  }
}

static OrtStatus *output(OrtKernelContext *ctx, size_t i, const int64_t *dims, size_t rank,
                         void **data) {
  OrtValue *v = NULL;
  CHECK(g_api->KernelContext_GetOutput(ctx, i, dims, rank, &v));
  return g_api->GetTensorMutableData(v, data);
}

static OrtStatus *fail_call(size_t c, const char *what) {
  char msg[192];
  snprintf(msg, sizeof msg, "TokenLogprobs: call %zu: %s", c, what);
  return specd_fail(msg);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  const OrtValue *in[N_IN];
  int64_t d[N_IN][8] = {{0}};
  size_t r[N_IN] = {0};
  void *ptr[N_IN];
  for (size_t i = 0; i < N_IN; i++) {
    CHECK(g_api->KernelContext_GetInput(ctx, i, &in[i]));
    if (!in[i]) return specd_fail("TokenLogprobs: an input is missing");
    CHECK(specd_tensor_shape(in[i], d[i], &r[i]));
    CHECK(g_api->GetTensorMutableData((OrtValue *)in[i], &ptr[i]));
  }
  const int64_t R = d[IN_LOGITS][0], V = d[IN_LOGITS][1], C = d[IN_PLAN][0];
  const int64_t D1 = d[IN_TOKENS][1];
  if (r[IN_LOGITS] != 2 || V < 1) return specd_fail("TokenLogprobs: logits is not [R, V]");
  if (r[IN_PLAN] != 2 || d[IN_PLAN][1] != PLAN_W)
    return specd_fail("TokenLogprobs: plan is not [C, 10]");
  if (r[IN_TOKENS] != 2 || d[IN_TOKENS][0] != C || D1 < 1)
    return specd_fail("TokenLogprobs: tokens is not [C, D1] with D1 >= 1");
  if (r[IN_COUNTS] != 2 || d[IN_COUNTS][0] != C || d[IN_COUNTS][1] != 3)
    return specd_fail("TokenLogprobs: counts is not [C, 3]");
  if (r[IN_NTOP] != 1 || d[IN_NTOP][0] != C) return specd_fail("TokenLogprobs: n_top is not [C]");
  Job job = {.logits = (const float *)ptr[IN_LOGITS], .V = (size_t)V, .D1 = (size_t)D1,
             .plan = (const int64_t *)ptr[IN_PLAN], .tokens = (const int64_t *)ptr[IN_TOKENS],
             .n_top = (const int64_t *)ptr[IN_NTOP]};
  const int64_t *counts = (const int64_t *)ptr[IN_COUNTS];
  int64_t N = 1;
  size_t n_tasks = 0;
  for (int64_t c = 0; c < C; c++) {
    const int64_t *pl = job.plan + c * PLAN_W, k = job.n_top[c], n = counts[c * 3];
    if (pl[0] != 1 || k < 0) continue;
    if (k > MAX_TOP) return fail_call((size_t)c, "n_top is above 1024");
    if (n < 0 || n > D1) return fail_call((size_t)c, "n_emitted is outside [0, D1]");
    if (pl[1] < 0 || pl[1] + n > R) return fail_call((size_t)c, "its rows are outside logits");
    for (int64_t j = 0; j < n; j++) {
      const int64_t tok = job.tokens[c * D1 + j];
      if (tok < 0 || tok >= V) return fail_call((size_t)c, "an emitted token is outside [0, V)");
    }
    N = k > N ? k : N;
    n_tasks += (size_t)n;
  }
  if (N > V) N = V;
  const int64_t lp_dims[2] = {C, D1}, top_dims[3] = {C, D1, N};
  void *lp, *ids, *top_lp;
  CHECK(output(ctx, 0, lp_dims, 2, &lp));
  CHECK(output(ctx, 1, top_dims, 3, &ids));
  CHECK(output(ctx, 2, top_dims, 3, &top_lp));
  job.N = (size_t)N;
  job.logprobs = (double *)lp;
  job.top_ids = (int64_t *)ids;
  job.top_lp = (double *)top_lp;
  const size_t cells = (size_t)(C * D1), tops = cells * (size_t)N;
  memset(job.logprobs, 0, cells * sizeof(double));
  for (size_t i = 0; i < tops; i++) job.top_ids[i] = -1;
  memset(job.top_lp, 0, tops * sizeof(double));
  if (!n_tasks) return NULL;
  Task *tasks = (Task *)malloc(n_tasks * sizeof(Task));
  if (!tasks) return g_api->CreateStatus(ORT_FAIL, "TokenLogprobs: out of memory");
  size_t k = 0;
  for (int64_t c = 0; c < C; c++) {
    const int64_t *pl = job.plan + c * PLAN_W;
    if (pl[0] != 1 || job.n_top[c] < 0) continue;
    for (int64_t j = 0; j < counts[c * 3]; j++) tasks[k++] = (Task){(size_t)c, (size_t)j};
  }
  job.tasks = tasks;
  specd_parallel_for(run_task, &job, n_tasks);
  free(tasks);
  return NULL;
}

static const ONNXTensorElementDataType INPUTS[N_IN] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};
static const ONNXTensorElementDataType OUTPUTS[N_OUT] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
                                                         ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
                                                         ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE};
const SpecdOpDef specd_token_logprobs = {"TokenLogprobs", N_IN, INPUTS, specd_create_stateless,
                                         compute, N_OUT, OUTPUTS, 0, 0};
