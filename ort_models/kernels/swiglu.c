/* specd.SwiGlu: the gated activation of a SwiGLU feed-forward block in one pass.
 *
 *   X  float32 [..., 2F]   gate (columns 0 .. F-1) and up (F .. 2F-1), as one matrix
 *                          product over the concatenated gate and up weights gives them
 *   Y  float32 [..., F]    silu(gate) * up
 *
 * It replaces Split + Sigmoid/Mul (ORT fuses them to QuickGelu) + Mul: one read of X, one
 * write of Y and no intermediate tensors. Per element, with e = exp(-|g|) (<= 1, so the
 * exp never overflows): silu(g) = (g >= 0 ? g : g * e) / (1 + e), times up. Each element
 * takes the same operations whatever the row count, on every path (the AVX2 lanes run the
 * scalar code's operations), so rows of a block equal rows alone, bit for bit.
 */
#include <stdint.h>

#include "specd_math.h" /* SPECD_AVX2 */
#include "specd_ops.h"

enum { CHUNK = 16384 }; /* elements of Y per parallel task */

typedef struct {
  const float *x;
  float *y;
  size_t f, n; /* F, and rows * F elements of Y */
} Job;

static inline float silu_mul(float g, float u) {
  float e = exp_scalar(-fabsf(g));
  float num = g >= 0.0f ? g : g * e;
  return num / (1.0f + e) * u;
}

void specd_swiglu_row(const float *g, const float *u, float *y, size_t n) {
  size_t c = 0;
#if SPECD_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  for (; c + 8 <= n; c += 8) {
    __m256 gv = _mm256_loadu_ps(g + c);
    __m256 e = exp8(_mm256_or_ps(gv, sign)); /* -|g| */
    __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, e), neg);
    __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
  }
#endif
  for (; c < n; c++) y[c] = silu_mul(g[c], u[c]);
}

/* Y[j0 .. j1) (flat indices; a range may span rows) */
static void swiglu_range(const Job *job, size_t j0, size_t j1) {
  const size_t f = job->f;
  while (j0 < j1) {
    const size_t row = j0 / f, col = j0 % f;
    const size_t end = (j1 - j0 < f - col) ? col + (j1 - j0) : f;
    const float *g = job->x + row * 2 * f, *u = g + f;
    specd_swiglu_row(g + col, u + col, job->y + row * f + col, end - col);
    j0 += end - col;
  }
}

static void run_task(void *p, size_t t) {
  const Job *job = (const Job *)p;
  const size_t j0 = t * CHUNK, j1 = j0 + CHUNK < job->n ? j0 + CHUNK : job->n;
  swiglu_range(job, j0, j1);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  const OrtValue *x_val;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &x_val));
  int64_t dims[8];
  size_t rank;
  CHECK(specd_tensor_shape(x_val, dims, &rank));
  if (rank < 1 || dims[rank - 1] % 2)
    return specd_fail("SwiGlu: the last dimension of X (gate and up) must be even");
  size_t rows = 1;
  for (size_t i = 0; i + 1 < rank; i++) rows *= (size_t)dims[i];
  dims[rank - 1] /= 2;
  OrtValue *y_val;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, dims, rank, &y_val));
  Job job = {NULL, NULL, (size_t)dims[rank - 1], 0};
  job.n = rows * job.f;
  CHECK(g_api->GetTensorMutableData((OrtValue *)x_val, (void **)&job.x));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&job.y));
  specd_parallel_for(run_task, &job, (job.n + CHUNK - 1) / CHUNK);
  return NULL;
}

static const ONNXTensorElementDataType INPUTS[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const SpecdOpDef specd_swiglu = {"SwiGlu", 1, INPUTS, specd_create_stateless, compute, 0,
                                 NULL};
