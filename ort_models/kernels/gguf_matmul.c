/* specd.GgufMatMul: Y = A @ W^T with W kept in GGUF's own block layout.
 *
 *   A  float32 [..., K]        activations
 *   W  uint8   [ceil(N/16), nb * group bytes] GGUF rows (a row is an output channel) in
 *                                            groups of 16, see below and gguf_layouts.py
 *   B  float32 [N]             optional bias, added to each row of Y (as an Add would)
 *   G  float32 [K]             prologue 1: the RMS norm's weight
 *   S  float32 [..., K]        prologue 1, optional: the residual added to A first
 *   Y  float32 [..., N]
 *   A+S float32 [..., K]       prologue 1 with S, optional output: the sum (the residual
 *                              stream the next block adds to)
 *   H  float32 [..., K]        prologue 1, optional output: the normed rows (for other
 *                              products of the same input)
 *   attributes: ggml_type (2 = Q4_0, 3 = Q4_1, 12 = Q4_K, 14 = Q6_K), K, N (rows of W
 *               hold ceil(K/256) superblocks, a Q4_K row's last one only its sub-blocks
 *               of 32 up to K; Q4_0 / Q4_1 rows their K/32 blocks; A's values past K
 *               count as zeros); prologue (default 0): what A goes through before the
 *               product, in the same pass that quantizes it, instead of a node of its own
 *               (each node costs ~10 us of dispatch, ~5% of a 0.5B draft step):
 *                 1  RMS norm: h = x * (1 / sqrt(sum(x^2) / K + epsilon)) * G, x = A (+ S),
 *                    the sum of squares in double, in a fixed order per row
 *                 2  SwiGlu: A is [..., 2K], gate then up; h = silu(gate) * up with
 *                    SwiGlu's arithmetic (swiglu.c)
 *               epsilon: prologue 1's (float attribute)
 *
 * Arithmetic (the contract tests/numpy_reference.py's gguf_matmul reproduces bit for bit):
 * each row of A is quantized per 256 values to int8, q = rint(a * (127 / amax)),
 * da = amax / 127 (da = 0 and q = 0 where 127 / amax is not finite: amax = 0, or so
 * small that the quotient overflows). Per superblock the integer dot
 * products are exact; the float32 combination, in superblock order, is
 *   Q4_K: y += da * (d * isum - dmin * imin)
 *         isum = sum_j sc[j] * sum_{i in j} q4[i] a[i]     (8 sub-blocks of 32)
 *         imin = sum_j  m[j] * sum_{i in j} a[i]
 *   Q6_K: y += da * (d * isum)
 *         isum = sum_j sc[j] * sum_{i in j} (q6[i] - 32) a[i]   (16 sub-blocks of 16)
 *   Q4_0 / Q4_1: y += da * t, t a float32 sum over the blocks of 32 (gguf_legacy.h)
 * Every (row of A, row of W) pair runs the same sequence of float operations whatever
 * the number of rows in the call, the tiling or the thread that computes it, so a row of
 * a multi-token call equals a single-token call bit for bit (speculative verification
 * relies on it). Built with -ffp-contract=off so that no FMA changes the rounding.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specd_ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define SPECD_AVX2 1
#endif

enum { QK_K = 256, TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q4_K = 12, TYPE_Q6_K = 14 };
enum { ROW_TILE = 16, COL_TILE = 4, MAX_TASKS = 256, PREP_VALUES = 16384 };

/* ---------------------------------------------------------------------------------- */
/* numbers                                                                             */

/* Activations of a call, quantized: q [M, K], d [M, K/256], sums of 16 and of 32
   (|sum| <= 32 * 127 fits 16 bits); and how W ends: Q4_K rows whose K stops short of a
   whole superblock hold only the sub-blocks of 32 that K reaches in their last one
   (`trim` sub-blocks fewer; the values past K are zeros in A, so the integer sums are
   the same as over zero-padded blocks, without reading their codes). */
typedef struct {
  int8_t *q;
  float *d;
  int16_t *sum16;
  int16_t *sum32;
  size_t k;
  int trim; /* Q4_K: sub-blocks of 32 missing from the last superblock of each row group */
  const float *x; /* GgufExperts' F32 weights: A's float rows [M, K] instead */
} Act;

/* x [k_in] -> k (a multiple of 256, >= k_in) quantized values, zeros past k_in */
static void quantize_row(const float *x, size_t k_in, size_t k, int8_t *q, float *d,
                         int16_t *s16, int16_t *s32) {
  float tail[QK_K];
  for (size_t b = 0; b < k / QK_K; b++) {
    const float *xb = x + b * QK_K;
    if ((b + 1) * QK_K > k_in) { /* the last, partial superblock */
      memset(tail, 0, sizeof tail);
      memcpy(tail, xb, (k_in - b * QK_K) * sizeof(float));
      xb = tail;
    }
    int8_t *qb = q + b * QK_K;
    float amax = 0.0f;
    for (int i = 0; i < QK_K; i++) {
      float v = fabsf(xb[i]);
      amax = v > amax ? v : amax;
    }
    const float id = 127.0f / amax;
    if (!(id <= FLT_MAX)) { /* amax 0, or below ~3.7e-37, where 127 / amax overflows */
      d[b] = 0.0f;
      memset(qb, 0, QK_K);
    } else {
      d[b] = amax / 127.0f;
#if SPECD_AVX2
      const __m256 vid = _mm256_set1_ps(id);
      for (int i = 0; i < QK_K; i += 32) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), vid));
        __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);
        __m256i bytes = _mm256_packs_epi16(w01, w23); /* lanes interleaved by 128 bits */
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qb + i), bytes);
      }
#else
      for (int i = 0; i < QK_K; i++) qb[i] = (int8_t)nearbyintf(xb[i] * id);
#endif
    }
  }
  for (size_t j = 0; j < k / 16; j++) {
    int s = 0;
    for (int i = 0; i < 16; i++) s += q[j * 16 + i];
    s16[j] = (int16_t)s;
  }
  for (size_t j = 0; j < k / 32; j++) s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
}

/* ---------------------------------------------------------------------------------- */
/* Weights: GGUF blocks of 16 rows interleaved (ort_models/gguf_layouts.py writes them),  */
/* so one 32-bit lane of a 512-bit vector holds one row (two 256-bit vectors: rows 0-7,  */
/* 8-15), the per-block scales of 16 rows load as a vector, and a row group is read as   */
/* one sequential stream.                                                               */
/*                                                                                      */
/* Q4_K, 2368 bytes per superblock of 16 rows:                                          */
/*   d[16] f16 | dmin[16] f16 | sc[8 sub][16 rows] u8 | m[8 sub][16 rows] u8 |         */
/*   codes: per sub-block j, per p < 4, 64 bytes; byte 4r+e holds row r's code          */
/*   32j+8p+e (low nibble) and 32j+8p+4+e (high nibble); where K ends inside a           */
/*   superblock, the group's last one keeps only the codes of the sub-blocks K reaches    */
/* Q6_K, 3360 bytes per superblock of 16 rows:                                          */
/*   d[16] f16 | sc[16 sub][16 rows] i8 | per sub-block j, 192 bytes: low nibbles, per  */
/*   p < 2, 64 bytes, byte 4r+e: code 16j+8p+e (low), 16j+8p+4+e (high) | high 2 bits,  */
/*   64 bytes, byte 4r+e: bits 2t..2t+1 = code 16j+4t+e >> 4                            */
/* Q4_0, 288 bytes per block of 32 columns of 16 rows: d[16] f16 | codes as a Q4_K      */
/*   sub-block's (byte 4r+e of part p < 4: code 8p+e low, 8p+4+e high nibble)           */
/* Q4_1, 320 bytes per block: d[16] f16 | m[16] f16 | codes                             */

enum { GROUP = 16, HALF = 8, Q4_K_GROUP_BYTES = 2368, Q6_K_GROUP_BYTES = 3360 };
enum { Q4_K_SC = 64, Q4_K_MN = 192, Q4_K_QS = 320, Q4_K_SUB_BYTES = 256, Q6_K_SC = 32,
       Q6_K_QL = 288 };
enum { Q4_0_BLOCK_BYTES = 288, Q4_1_BLOCK_BYTES = 320 };

static inline void load_f16(const uint8_t *p, int n, float *out) {
  for (int r = 0; r < n; r++) out[r] = specd_f16_to_f32(p + 2 * r);
}

#if SPECD_AVX2
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#if defined(__F16C__)
#define LOAD_F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
static inline __m256 LOAD_F16X8(const uint8_t *p) {
  float f[HALF];
  load_f16(p, HALF, f);
  return _mm256_loadu_ps(f);
}
#endif
static inline __m256i u8x8(const uint8_t *p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256i i8x8(const uint8_t *p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* The first half's pass over a superblock (or block of 32) fetches the one PF_AHEAD
   superblocks on (the next row group's, near a group's end; it follows in memory), a
   few lines a sub-block: the hardware prefetcher alone falls behind, most of all in
   verify blocks of several rows, which are compute-bound. kernel_ab, 2 threads, the
   Zen 3 host: 3-4 rows 0.84-0.93x the time, one row 0.97-1.01x; 6 superblocks on
   instead of 2: the same. */
enum { PF_AHEAD = 2 };
ALWAYS_INLINE void prefetch_lines(const uint8_t *p, const int lines) {
  for (int l = 0; l < lines; l++) _mm_prefetch((const char *)p + 64 * l, _MM_HINT_T0);
}
/* An empty asm statement that claims to read and change v: the sums before it must be
   done here. Without it GCC (12, -O3) unrolls a sub-block's loop over 4 rows of A by
   computing all 32 maddubs first and adding them up afterwards, which leaves 20 of them
   spilled to the stack; with it each row's sum stays in one register. */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
ALWAYS_INLINE __m256i bcast4x8(const void *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECD_DPBUSD256 1 /* vpdpbusd on 256-bit vectors */
#else
#define SPECD_DPBUSD256 0
#endif
/* One sub-block of 32 4-bit codes, Q4_K's and Q4_0 / Q4_1's layout (4 parts of 64 bytes
   at qs, of which this half's 32: byte 4r+e of part p holds row r's codes 8p+e, low
   nibble, and 8p+4+e, high), against A's 32 int8 values at x[m], rows m < mt. vnni (a
   constant; only where vpdpbusd on 256 bits exists): s0[m], s1[m] the 32-bit sums of the
   low and the high nibbles' products. Else s0[m] the 16-bit sums of the 8 maddubs, each
   a pair of u8 x s8 products: exact, |lane| <= 8 * 2 * 15 * 127 = 30480. */
ALWAYS_INLINE void codes32_dot(const uint8_t *qs, const int8_t *const *x, const int mt,
                               const int vnni, __m256i *s0, __m256i *s1) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  (void)vnni, (void)s1;
#pragma GCC unroll 4
  for (int p = 0; p < 4; p++) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * p));
    const __m256i lo = _mm256_and_si256(v, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
      const int8_t *xp = x[m] + 8 * p;
#if SPECD_DPBUSD256
      if (vnni) {
        s0[m] = _mm256_dpbusd_epi32(p ? s0[m] : _mm256_setzero_si256(), lo, bcast4x8(xp));
        s1[m] = _mm256_dpbusd_epi32(p ? s1[m] : _mm256_setzero_si256(), hi, bcast4x8(xp + 4));
        continue;
      }
#endif
      const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4x8(xp)),
                                         _mm256_maddubs_epi16(hi, bcast4x8(xp + 4)));
      s0[m] = p ? _mm256_add_epi16(s0[m], t) : t;
      KEEP_IN_REGISTER(s0[m]);
    }
  }
}
#endif

#include "gguf_kquants.h"
#include "gguf_legacy.h"

/* ---------------------------------------------------------------------------------- */
/* the call: quantize A, then columns of Y in tasks over ORT's intra-op thread pool     */

typedef void (*GroupFn)(const uint8_t *, size_t, const Act *, size_t, size_t,
                        float (*)[GROUP]);

typedef struct {
  GroupFn fn;
  const uint8_t *w;
  size_t group_bytes, nb, m, n, groups_per_task;
  Act act;
  const float *bias; /* [N] added to each row of Y, or NULL */
  float *y;
} Job;

static void run_task(void *p, size_t t) {
  const Job *job = (const Job *)p;
  const size_t n_groups = (job->n + GROUP - 1) / GROUP;
  const size_t g0 = t * job->groups_per_task;
  const size_t g1 = g0 + job->groups_per_task < n_groups ? g0 + job->groups_per_task : n_groups;
  float acc[ROW_TILE][GROUP];
  for (size_t c0 = g0; c0 < g1; c0 += COL_TILE) { /* these row groups stay in cache ... */
    const size_t c1 = c0 + COL_TILE < g1 ? c0 + COL_TILE : g1;
    for (size_t m0 = 0; m0 < job->m; m0 += ROW_TILE) { /* ... across tiles of A */
      const size_t mt = job->m - m0 < ROW_TILE ? job->m - m0 : ROW_TILE;
      for (size_t c = c0; c < c1; c++) {
        memset(acc, 0, mt * sizeof acc[0]); /* the rows this tile uses */
        job->fn(job->w + c * job->group_bytes, job->nb, &job->act, m0, mt, acc);
        const size_t cols = job->n - c * GROUP < GROUP ? job->n - c * GROUP : GROUP;
        if (job->bias) /* the float32 sums an Add node after the product would make */
          for (size_t m = 0; m < mt; m++)
            for (size_t r = 0; r < cols; r++) acc[m][r] += job->bias[c * GROUP + r];
        for (size_t m = 0; m < mt; m++)
          memcpy(job->y + (m0 + m) * job->n + c * GROUP, acc[m], cols * sizeof(float));
      }
    }
  }
}

typedef struct {
  int64_t type, k, n, prologue;
  float eps;
} Kernel;

enum { PROLOGUE_NONE = 0, PROLOGUE_RMS_NORM = 1, PROLOGUE_SWIGLU = 2 };

/* x [n] (+ skip) -> h = RMSNorm(x + skip) * gamma; sum_out, where given, gets x + skip */
static void rms_norm_row(const float *x, const float *skip, const float *gamma, size_t n,
                         float eps, float *sum_out, float *h) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0}; /* four chains in a fixed order: the same bits at any M */
  for (size_t i = 0; i < n; i++) {
    const float v = skip ? x[i] + skip[i] : x[i];
    h[i] = v;
    acc[i % 4] += (double)v * (double)v;
  }
  if (sum_out) memcpy(sum_out, h, n * sizeof(float));
  const double ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  const float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
  for (size_t i = 0; i < n; i++) h[i] = h[i] * scale * gamma[i];
}

/* Rows of A through the prologue and into the quantized activations, in tasks */
typedef struct {
  const Kernel *kn;
  const float *a, *gamma, *skip;
  float *sum_out, *h_out;
  Act *act;
  size_t m, k_in, nb, rows_per_task;
} Prep;

static void prep_task(void *p, size_t t) {
  const Prep *pp = (const Prep *)p;
  const size_t k_in = pp->k_in, k = pp->act->k, nb = pp->nb;
  const size_t r0 = t * pp->rows_per_task;
  const size_t r1 = r0 + pp->rows_per_task < pp->m ? r0 + pp->rows_per_task : pp->m;
  float *h = NULL;
  if (pp->kn->prologue != PROLOGUE_NONE) {
    h = (float *)malloc(k_in * sizeof(float));
    if (!h) abort(); /* a few KB: nothing sensible remains to be done without them */
  }
  for (size_t r = r0; r < r1; r++) {
    const float *x = pp->a + r * k_in;
    if (pp->kn->prologue == PROLOGUE_RMS_NORM) {
      rms_norm_row(x, pp->skip ? pp->skip + r * k_in : NULL, pp->gamma, k_in, pp->kn->eps,
                   pp->sum_out ? pp->sum_out + r * k_in : NULL, h);
      if (pp->h_out) memcpy(pp->h_out + r * k_in, h, k_in * sizeof(float));
      x = h;
    } else if (pp->kn->prologue == PROLOGUE_SWIGLU) {
      const float *g = pp->a + r * 2 * k_in;
      specd_swiglu_row(g, g + k_in, h, k_in);
      x = h;
    }
    const Act *act = pp->act;
    quantize_row(x, k_in, k, act->q + r * k, act->d + r * nb, act->sum16 + r * (k / 16),
                 act->sum32 + r * (k / 32));
  }
  free(h);
}

/* optional float32 input i, checked to have the shape dims[0..rank); NULL if absent */
static OrtStatus *optional_input(OrtKernelContext *ctx, size_t n_in, size_t i,
                                 const int64_t *dims, size_t rank, const char *what,
                                 const float **out) {
  *out = NULL;
  const OrtValue *v = NULL;
  if (n_in > i) CHECK(g_api->KernelContext_GetInput(ctx, i, &v));
  if (!v) return NULL;
  int64_t got[8];
  size_t got_rank;
  CHECK(specd_tensor_shape(v, got, &got_rank));
  if (got_rank != rank || memcmp(got, dims, rank * sizeof(int64_t)) != 0)
    return specd_fail(what);
  return g_api->GetTensorMutableData((OrtValue *)v, (void **)out);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  const Kernel *kn = (const Kernel *)kernel;
  const OrtValue *a_val, *w_val;
  CHECK(g_api->KernelContext_GetInput(ctx, 0, &a_val));
  CHECK(g_api->KernelContext_GetInput(ctx, 1, &w_val));
  int64_t adims[8], wdims[8];
  size_t arank, wrank;
  CHECK(specd_tensor_shape(a_val, adims, &arank));
  CHECK(specd_tensor_shape(w_val, wdims, &wrank));
  const size_t k_in = (size_t)kn->k, n = (size_t)kn->n, nb = (k_in + QK_K - 1) / QK_K;
  const size_t k = nb * QK_K; /* A is quantized in whole superblocks, zero-padded */
  /* Q4_K: the last superblock holds the sub-blocks of 32 that K reaches; Q6_K: whole
     superblocks (GGUF files only have Q6_K rows of whole superblocks); Q4_0 / Q4_1: the
     K/32 blocks of 32, which the group kernels take as their `nb` */
  const int trim = kn->type == TYPE_Q4_K ? (int)((k - k_in) / 32) : 0;
  size_t units = nb, group_bytes;
  GroupFn fn;
  switch (kn->type) {
    case TYPE_Q4_0:
      fn = group_q4_0, units = k_in / 32, group_bytes = units * Q4_0_BLOCK_BYTES;
      break;
    case TYPE_Q4_1:
      fn = group_q4_1, units = k_in / 32, group_bytes = units * Q4_1_BLOCK_BYTES;
      break;
    case TYPE_Q4_K:
      fn = group_q4_k, group_bytes = nb * Q4_K_GROUP_BYTES - (size_t)trim * Q4_K_SUB_BYTES;
      break;
    default:
      fn = group_q6_k, group_bytes = nb * Q6_K_GROUP_BYTES;
  }
  const size_t n_groups = (n + GROUP - 1) / GROUP;
  const int64_t a_width = kn->prologue == PROLOGUE_SWIGLU ? 2 * kn->k : kn->k;
  if (arank < 1 || adims[arank - 1] != a_width)
    return specd_fail(kn->prologue == PROLOGUE_SWIGLU
                          ? "GgufMatMul: the last dimension of A is not 2K (gate and up)"
                          : "GgufMatMul: the last dimension of A is not K");
  if (wrank != 2 || (size_t)wdims[0] != n_groups || (size_t)wdims[1] != group_bytes)
    return specd_fail("GgufMatMul: W is not [ceil(N/16), group bytes] of its GGUF type's 16-row layout");
  size_t n_in = 0;
  const float *bias = NULL;
  CHECK(g_api->KernelContext_GetInputCount(ctx, &n_in));
  CHECK(optional_input(ctx, n_in, 2, &kn->n, 1, "GgufMatMul: bias is not [N]", &bias));
  const float *gamma = NULL, *skip = NULL;
  float *sum_out = NULL, *h_out = NULL;
  if (kn->prologue == PROLOGUE_RMS_NORM) {
    adims[arank - 1] = kn->k;
    CHECK(optional_input(ctx, n_in, 3, &kn->k, 1, "GgufMatMul: G is not [K]", &gamma));
    if (!gamma) return specd_fail("GgufMatMul: prologue 1 (RMS norm) needs its weight G");
    CHECK(optional_input(ctx, n_in, 4, adims, arank,
                         "GgufMatMul: S does not have the shape of A", &skip));
    size_t n_out = 0;
    CHECK(g_api->KernelContext_GetOutputCount(ctx, &n_out));
    float **outs[2] = {&sum_out, &h_out};
    for (size_t o = 1; o < n_out && o < 3; o++) { /* absent ones come back NULL */
      OrtValue *val = NULL;
      CHECK(g_api->KernelContext_GetOutput(ctx, o, adims, arank, &val));
      if (val) CHECK(g_api->GetTensorMutableData(val, (void **)outs[o - 1]));
    }
  }
  size_t m = 1;
  for (size_t i = 0; i + 1 < arank; i++) m *= (size_t)adims[i];
  adims[arank - 1] = kn->n;
  OrtValue *y_val;
  CHECK(g_api->KernelContext_GetOutput(ctx, 0, adims, arank, &y_val));
  const float *a;
  const uint8_t *w;
  float *y;
  CHECK(g_api->GetTensorMutableData((OrtValue *)a_val, (void **)&a));
  CHECK(g_api->GetTensorMutableData((OrtValue *)w_val, (void **)&w));
  CHECK(g_api->GetTensorMutableData(y_val, (void **)&y));
  if (m == 0) return NULL;

  /* one allocation: q [M, K] | d [M, K/256] | sum32 [M, K/32] | sum16 [M, K/16] */
  const size_t bytes = m * k + m * nb * 4 + m * (k / 32) * 2 + m * (k / 16) * 2;
  uint8_t *scratch = (uint8_t *)malloc(bytes);
  if (!scratch) return g_api->CreateStatus(ORT_FAIL, "GgufMatMul: out of memory");
  Job job = {fn, w, group_bytes, units, m, n, 0,
             {(int8_t *)scratch, (float *)(scratch + m * k), NULL, NULL, k, trim}, bias, y};
  job.act.sum32 = (int16_t *)(scratch + m * k + m * nb * 4);
  job.act.sum16 = job.act.sum32 + m * (k / 32);
  /* the rows' prologue and quantization, in tasks of whole rows (a row's arithmetic does
     not depend on which thread runs it) of at least PREP_VALUES values, at most 8: a
     task costs the pool a few microseconds, a value ~1 ns (4 rows of a 1.5B's down
     product: 2 tasks) */
  Prep prep = {kn, a, gamma, skip, sum_out, h_out, &job.act, m, k_in, nb, 0};
  size_t prep_tasks = m * k_in / PREP_VALUES;
  prep_tasks = prep_tasks < 1 ? 1 : prep_tasks > 8 ? 8 : prep_tasks > m ? m : prep_tasks;
  prep.rows_per_task = (m + prep_tasks - 1) / prep_tasks;
  specd_parallel_for(prep_task, &prep, (m + prep.rows_per_task - 1) / prep.rows_per_task);
  size_t per = (n_groups + MAX_TASKS - 1) / MAX_TASKS;
  job.groups_per_task = per;
  specd_parallel_for(run_task, &job, (n_groups + per - 1) / per);
  free(scratch);
  return NULL;
}

static OrtStatus *create(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  Kernel kn = {0, 0, 0, PROLOGUE_NONE, 0.0f};
  CHECK(api->KernelInfoGetAttribute_int64(info, "ggml_type", &kn.type));
  CHECK(api->KernelInfoGetAttribute_int64(info, "K", &kn.k));
  CHECK(api->KernelInfoGetAttribute_int64(info, "N", &kn.n));
  kn.prologue = specd_int64_attribute_or(api, info, "prologue", PROLOGUE_NONE);
  if (kn.prologue < PROLOGUE_NONE || kn.prologue > PROLOGUE_SWIGLU)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufMatMul: prologue must be 0 (none), "
                                                   "1 (RMS norm) or 2 (SwiGlu)");
  if (kn.prologue == PROLOGUE_RMS_NORM)
    CHECK(api->KernelInfoGetAttribute_float(info, "epsilon", &kn.eps));
  if (kn.type != TYPE_Q4_0 && kn.type != TYPE_Q4_1 && kn.type != TYPE_Q4_K &&
      kn.type != TYPE_Q6_K)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufMatMul: ggml_type must be 2 (Q4_0), "
                                                   "3 (Q4_1), 12 (Q4_K) or 14 (Q6_K)");
  if (kn.k <= 0 || kn.n <= 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "GgufMatMul: K and N must be positive");
  if ((kn.type == TYPE_Q4_0 || kn.type == TYPE_Q4_1) && kn.k % 32)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             "GgufMatMul: K of a Q4_0 / Q4_1 matrix must be a multiple of 32");
  return specd_new_state(&kn, sizeof kn, kernel);
}


static const ONNXTensorElementDataType INPUTS[] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
static const ONNXTensorElementDataType OUTPUTS[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const SpecdOpDef specd_gguf_matmul = {"GgufMatMul", 5, INPUTS, create, compute, 3, OUTPUTS, 2, 1};

#include "gguf_experts.h"

