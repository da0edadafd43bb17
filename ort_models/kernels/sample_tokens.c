/* specd.SampleTokens: every sequence's tokens of a pass decided in the graph, after the
 * logits (sampling and speculative verification), so that only token ids and a few
 * probabilities leave the session. It mirrors the host reference exactly: the filter chain
 * of daemon/spec/sampling.py (Sampler._filtered, sample_from_probs) and the verifiers of
 * daemon/spec/verify.py (verify_greedy; verify_rejection with draft_masked=True); only the
 * uniforms differ (Philox4x32-10 below instead of PCG64).
 *
 *   0 logits       float32 [R, V]
 *   1 plan         int64   [C, 10]  per call (sequence): mode (0 skip, 1 decide), first_row,
 *                                   n_draft n (rows first_row .. first_row + n), position,
 *                                   flags (1 temperature last, 2 rejection against q, 4 row i
 *                                   masked by masks[mask_row + i]), mask_row, window (penalty
 *                                   window W: -1 all, 0 off), stop_after (-1, or j: accepting
 *                                   draft j ends the block), n_cand, stream
 *   2 params       float64 [C, 8]   temperature (0 greedy), top_k, top_p, min_p,
 *                                   repeat_penalty, presence_penalty, frequency_penalty, -
 *   3 keys         int64   [C]      Philox keys
 *   4 drafts       int64   [C, D]   -1 padding
 *   5 q_ids        int64   [C, D, K] draft i's distribution, sparse: id -1 unused, ids >= V
 *   6 q_probs      float32 [C, D, K] dropped, a repeated id's probabilities add up
 *   7 history      int64   [C, H]   tokens emitted before row 0, oldest first, -1 padding left
 *   8 bias_ids     int64   [C, NB]  -1 padding, ids >= V ignored
 *   9 bias_values  float64 [C, NB]  added to the logit (-inf: never drawn)
 *  10 masks        int32   [M, ceil(V/32)] token t allowed iff bit t % 32 of word t / 32
 * Outputs (-1 / 0 where a call or row was not decided):
 *   0 tokens       int64   [C, D+1] emitted tokens, -1 after n_emitted
 *   1 counts       int64   [C, 3]   n_emitted, n_accepted, status (0 ok; 1 dead end: the
 *                                   mask of a row i > 0 allows nothing, the block ends on the
 *                                   i drafts so far; 2 no token: nothing drawable at a row)
 *   2 accept_probs float32 [C, D]   alpha_i of each draft decided: sum min(p_i, q_i)
 *                                   (rejection), else p_i(d_i) (greedy: 1 or 0)
 *   3 cand_ids     int64   [R, KC]  a decided row's n_cand most probable tokens of the
 *   4 cand_probs   float32 [R, KC]  distribution it was decided from, probability
 *                                   descending, ties lower id first, none of probability 0;
 *                                   greedy rows: the argmax alone, with 1 / sum exp(x - max)
 *                                   KC = max(1, the largest n_cand of the decided calls)
 *
 * Row i of a call: x = (double)logits[first_row + i], plus the bias, then the penalties over
 * the last W tokens of history + d_0 .. d_{i-1} (v = x[t]; v = v > 0 ? v / rp : v * rp if
 * rp != 1; x[t] = v - (count * frequency + presence)); masked-out tokens count as -inf.
 * Greedy: argmax x, ties to the lowest id. Sampled: top_k, shift by the max, temperature
 * (first unless flag 1), top_p, min_p, temperature (if flag 1), softmax (shift in double, exp
 * in float32, sum in double), inverse CDF in ascending id order; min_p and the softmax
 * measure from the largest value left (top_p cuts the top token where its e ties with
 * lower ids'). Rows i < n verify draft
 * d_i: with flag 2, accept iff u0 * q_i(d_i) < p_i(d_i), else emit a draw from
 * normalise(max(p_i - q_i, 0)) (p_i where that is all zero) with u1 and end the block
 * (under a mask q_i is zeroed off it and renormalised); without, emit the row's own choice
 * and end the block unless it is d_i. Row n (all accepted) emits its own choice.
 * Uniforms: u(position + i, stream, draw) = Philox4x32-10 of the counter (position low,
 * position high, stream, draw) under the key (keys[c] low, high): the top 53 bits of
 * out0:out1 times 2^-53; draw 0 = the coin or plain draw, 1 = the residual draw.
 *
 * Decided here, where the contract is silent: NaN logits count as -inf, and a sampled row
 * whose maximum is +inf has no softmax (status 2); a repeated bias id's biases add up; masks
 * need only cover the rows a call can reach (to stop_after); two decided calls may not share
 * logits rows (their candidates would collide); the outputs after tokens may be left out.
 *
 * How. A row is read in blocks of 1024 tokens (the inverse CDF's blocks, as
 * sample_from_probs has them): the logits themselves, or in a block with a mask or an
 * overridden token a copy with those at -inf; the overridden logits (bias, penalties) are
 * kept aside in double. One pass takes the maximum, one the e = exp(float((x - top) / T))
 * of every token and their block sums (exp8's operations on 8 vectors in lockstep; the
 * temperature as a multiplication by 1/T, a different float only where the double quotient
 * lies within an ulp of a rounding boundary); no array of the vocabulary's size is written
 * but for top_p, and a draw takes its block's e again. top_k bounds the k-th largest logit
 * from below by the k-th largest of the 64-token blocks' maxima and selects among the
 * logits above it. top_p looks through the row's e in bands of a factor 4 from the top
 * down, gathering each band while the mass above it falls short, and finds the cut in the
 * band that reaches top_p by a quickselect that sums as it partitions: no full sort. A
 * short kept set becomes a list of ids handled in plain C, a long one stays dense, masked
 * by a bitmap of it. Calls are independent and run in parallel; a pass that decides one
 * call alone splits its rows' passes over the vocabulary across the threads instead, in
 * tasks of whole blocks whose results are combined in block order (the same bits on any
 * number of threads). A call in mode 0 only has its outputs cleared.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specd_math.h" /* exp8, exp_scalar, SPECD_AVX2 */
#include "specd_ops.h"

enum { BLOCK = 1024, SUB = 64, PLAN_W = 10, PARAM_W = 8, N_IN = 11, N_OUT = 5 };
enum { FLAG_TEMP_LAST = 1, FLAG_REJECT = 2, FLAG_MASKED = 4 };
enum { ST_OK = 0, ST_DEAD_END = 1, ST_NO_TOKEN = 2 };
enum { IN_LOGITS, IN_PLAN, IN_PARAMS, IN_KEYS, IN_DRAFTS, IN_QIDS, IN_QPROBS, IN_HISTORY,
       IN_BIAS_IDS, IN_BIAS_VALUES, IN_MASKS };

/* ---- uniforms: Philox4x32-10 (Salmon et al. 2011, Random123) ---- */

static double philox_uniform(uint64_t key, uint64_t position, uint32_t stream, uint32_t draw) {
  uint32_t c0 = (uint32_t)position, c1 = (uint32_t)(position >> 32), c2 = stream, c3 = draw;
  uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
  for (int r = 0; r < 10; r++) {
    if (r) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
  }
  return (double)((((uint64_t)c0 << 32) | c1) >> 11) * 0x1p-53;
}

/* ---- the job and each task's scratch ---- */

typedef struct {
  const float *logits;
  size_t R, V, nblk, nsub;
  const int64_t *plan, *keys, *drafts, *q_ids, *history, *bias_ids;
  const double *params, *bias_values;
  const float *q_probs;
  size_t D, K, H, NB;
  const uint32_t *masks;
  size_t words; /* ceil(V / 32) per mask row */
  int64_t *tokens, *counts, *cand_ids;
  float *accept, *cand_probs;
  size_t KC;
  const size_t *calls; /* the decided calls, one task each */
  int split;           /* one decided call: its passes over a row split into tasks */
  size_t ntask;        /* a split pass's tasks: ceil(nblk / SPLIT) */
  _Atomic int failed;  /* a task could not allocate its scratch */
} Job;

typedef struct {
  double v;
  int32_t id;
} Cand; /* a token and the value it is ranked by */
typedef struct {
  int32_t id;
  double x;
} Ov; /* a logit the bias or the penalties changed, in double */
typedef struct {
  int32_t id;
  double b;
} Bias;
typedef struct {
  int64_t tok, n;
} Seen; /* a token in the penalty window, and how often */
typedef struct {
  int32_t id, at; /* at: its place in q_ids (a repeated id's probabilities add in order) */
  double q;
} Qe;

typedef struct {
  float *buf, *eb;      /* [BLOCK] a block's logits; their e */
  float *e;             /* [V] a row's e, kept where top_p must look far down */
  double *vals;         /* [BLOCK] the values a draw scans */
  double *bsum, *bsum2; /* [nblk] block sums of e; of the residual */
  Cand *cand, *sub;     /* [V] gathered tokens; [nsub] the 64-token blocks' maxima */
  int32_t *ids;         /* [V] a truncated row: ids ascending */
  double *xv, *ev;      /* [V] their logits (then scaled); their e */
  uint8_t *mark;        /* [V] list positions kept */
  Ov *ov, *ov2;         /* [NB + H + D] the row's overrides; those of a restricted row */
  uint32_t *kept;       /* [words] a restricted row's tokens */
  Bias *bias;           /* [NB] */
  Seen *seen;           /* [H + D] */
  int64_t *seq;         /* [H + D] history tokens, then the accepted drafts */
  Qe *q;                /* [K] */
  double *q_r;          /* [K] */
  float *tbuf;          /* [ntask][2 * BLOCK] a split pass's block buffers, per task */
  float *bmax;          /* [nblk] the blocks' maxima */
  double *bpart;        /* [nblk] the blocks' sums of exp(x - m) (exp_sum_f32) */
  size_t *cnt;          /* [ntask] the tokens each task of a gather found */
  Cand *stage;          /* [V] where a split gather_band's tasks put them */
  void *mem;
} Scratch;

static int scratch_init(Scratch *s, const Job *job) {
  const size_t V = job->V, hd = job->H + job->D, K = job->K;
  size_t off = 0, at[28];
  int n = 0;
#define CARVE(bytes) (at[n++] = off, off += ((bytes) + 63) & ~(size_t)63)
  CARVE(BLOCK * sizeof(float));
  CARVE(BLOCK * sizeof(float));
  CARVE(V * sizeof(float));
  CARVE(BLOCK * sizeof(double));
  CARVE(job->nblk * sizeof(double));
  CARVE(job->nblk * sizeof(double));
  CARVE(V * sizeof(Cand));
  CARVE(job->nsub * sizeof(Cand));
  CARVE(V * sizeof(int32_t));
  CARVE(V * sizeof(double));
  CARVE(V * sizeof(double));
  CARVE(V);
  CARVE((job->NB + hd) * sizeof(Ov));
  CARVE((job->NB + hd) * sizeof(Ov));
  CARVE(job->words * sizeof(uint32_t));
  CARVE(job->NB * sizeof(Bias));
  CARVE(hd * sizeof(Seen));
  CARVE(hd * sizeof(int64_t));
  CARVE(K * sizeof(Qe));
  CARVE(K * sizeof(double));
  CARVE(job->split ? job->ntask * 2 * BLOCK * sizeof(float) : 0);
  CARVE(job->nblk * sizeof(float));
  CARVE(job->nblk * sizeof(double));
  CARVE(job->ntask * sizeof(size_t));
  CARVE(job->split ? V * sizeof(Cand) : 0);
#undef CARVE
  /* the arrays at 64-byte boundaries of the allocation, itself aligned: malloc's 16 bytes
     would leave a block's 32-byte loads and stores across cache lines in some processes
     and not others */
  char *m = (char *)malloc(off + 63);
  if (!m) return 0;
  s->mem = m;
  m += (64 - (uintptr_t)m % 64) % 64;
  n = 0;
  s->buf = (float *)(m + at[n++]);
  s->eb = (float *)(m + at[n++]);
  s->e = (float *)(m + at[n++]);
  s->vals = (double *)(m + at[n++]);
  s->bsum = (double *)(m + at[n++]);
  s->bsum2 = (double *)(m + at[n++]);
  s->cand = (Cand *)(m + at[n++]);
  s->sub = (Cand *)(m + at[n++]);
  s->ids = (int32_t *)(m + at[n++]);
  s->xv = (double *)(m + at[n++]);
  s->ev = (double *)(m + at[n++]);
  s->mark = (uint8_t *)(m + at[n++]);
  s->ov = (Ov *)(m + at[n++]);
  s->ov2 = (Ov *)(m + at[n++]);
  s->kept = (uint32_t *)(m + at[n++]);
  s->bias = (Bias *)(m + at[n++]);
  s->seen = (Seen *)(m + at[n++]);
  s->seq = (int64_t *)(m + at[n++]);
  s->q = (Qe *)(m + at[n++]);
  s->q_r = (double *)(m + at[n++]);
  s->tbuf = (float *)(m + at[n++]);
  s->bmax = (float *)(m + at[n++]);
  s->bpart = (double *)(m + at[n++]);
  s->cnt = (size_t *)(m + at[n++]);
  s->stage = (Cand *)(m + at[n++]);
  return 1;
}

/* ---- ranking: a before b iff its value is larger, or equal with a lower id ---- */

static inline int better(const Cand *a, const Cand *b) {
  return a->v > b->v || (a->v == b->v && a->id < b->id);
}
static int cmp_better(const void *a, const void *b) {
  return better((const Cand *)a, (const Cand *)b) ? -1 : better((const Cand *)b, (const Cand *)a);
}
static inline void swap_cand(Cand *a, Cand *b) {
  const Cand t = *a;
  *a = *b;
  *b = t;
}

/* Quickselect's step over a[lo .. hi) (hi - lo >= 3): a median of three as the pivot;
 * returns its place s, the better ones before it, the worse after */
static size_t partition(Cand *a, size_t lo, size_t hi) {
  const size_t mid = lo + (hi - lo) / 2, last = hi - 1;
  if (better(&a[mid], &a[lo])) swap_cand(&a[mid], &a[lo]);
  if (better(&a[last], &a[lo])) swap_cand(&a[last], &a[lo]);
  if (better(&a[mid], &a[last])) swap_cand(&a[mid], &a[last]); /* the median last */
  size_t s = lo;
  for (size_t i = lo; i < last; i++)
    if (better(&a[i], &a[last])) swap_cand(&a[i], &a[s++]);
  swap_cand(&a[s], &a[last]);
  return s;
}

/* a[0 .. n) <- the n best of a[0 .. m), in no order (n < m) */
static void select_best(Cand *a, size_t m, size_t n) {
  size_t lo = 0, hi = m;
  for (int rounds = 0; hi - lo > 8 && rounds < 64; rounds++) { /* then sort what is left */
    const size_t s = partition(a, lo, hi);
    if (n <= s) hi = s;
    else if (n > s + 1) lo = s + 1;
    else return;
  }
  qsort(a + lo, hi - lo, sizeof *a, cmp_better);
}

/* top_p's cut: the smallest n whose n best of a[0 .. g) have a running sum of v / total,
 * from run0 (what comes before them), reaching top_p; those left in a[0 .. n) with the
 * worst of them last; 0 if all of them fall short. Partitions as quickselect does, summing
 * what comes before the cut, and sorts only the last few: no full sort of a flat row's
 * thousands of tokens. */
static size_t nucleus(Cand *a, size_t g, double total, double top_p, double run0) {
  size_t lo = 0, hi = g, reached = 0; /* reached: a[0 .. reached) is known to reach top_p */
  double run = run0; /* the sum up to a[lo), all better than a[lo .. hi) */
  for (int rounds = 0; hi - lo > 32 && rounds < 64; rounds++) {
    const size_t s = partition(a, lo, hi);
    double left = 0.0;
    for (size_t i = lo; i < s; i++) left += a[i].v / total;
    if (run + left >= top_p) {
      hi = reached = s;
    } else if (run + left + a[s].v / total >= top_p) {
      return s + 1; /* the pivot, the worst of a[0 .. s] */
    } else {
      run += left + a[s].v / total;
      lo = s + 1;
    }
  }
  qsort(a + lo, hi - lo, sizeof *a, cmp_better);
  for (size_t j = lo; j < hi; j++) {
    run += a[j].v / total;
    if (run >= top_p) return j + 1;
  }
  return reached; /* summed in another order, a[lo .. hi) fell short by a rounding */
}

/* ---- a row's logits, block by block ---- */

/* One row as the filters see it: the logits, -inf where the mask forbids (and for NaN);
 * the tokens whose logit the bias or the penalties changed are taken from `ov` in double
 * (and are -inf in the float blocks). */
typedef struct {
  const float *lg;
  const uint32_t *mask; /* or NULL */
  const Ov *ov;         /* ascending ids, allowed tokens only */
  size_t n_ov, V;
} Row;

static inline int allowed(const uint32_t *mask, size_t t) {
  return !mask || ((mask[t >> 5] >> (t & 31)) & 1u);
}
static inline float finite_or_low(float v) { return v > -INFINITY ? v : -INFINITY; } /* NaN */

#if SPECD_AVX2
static inline __m256 load8(const float *p) { /* NaN -> -inf (max returns its second operand) */
  return _mm256_max_ps(_mm256_loadu_ps(p), _mm256_set1_ps(-INFINITY));
}
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
/* the sum of 4 groups of 4 doubles */
static inline double hsum16d(const __m256d acc[4]) {
  const __m256d v = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
/* lanes of 8 tokens from t (a multiple of 8): all ones where the mask allows them */
static inline __m256 mask8(const uint32_t *mask, size_t t) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)(mask[t >> 5] >> (t & 31))), bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
}
#endif

/* the first override at or after token t */
static size_t ov_from(const Row *r, size_t t) {
  size_t lo = 0, hi = r->n_ov;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if ((size_t)r->ov[mid].id < t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* The row's logits over [b0, b1) (masked and overridden ones -inf; NaN left to the loads):
 * the logits themselves where the block has neither a mask nor an override, else a copy in
 * buf. *o: the first override at or after b0; left at the first after the block. */
static const float *block_x(const Row *r, size_t b0, size_t b1, size_t *o, float *buf) {
  size_t o1 = *o;
  while (o1 < r->n_ov && (size_t)r->ov[o1].id < b1) o1++;
  if (!r->mask && o1 == *o) return r->lg + b0;
  size_t t = b0;
  if (!r->mask) {
    memcpy(buf, r->lg + b0, (b1 - b0) * sizeof *buf);
    t = b1;
  }
#if SPECD_AVX2
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= b1; t += 8)
    _mm256_storeu_ps(buf + (t - b0),
                     _mm256_blendv_ps(ninf, _mm256_loadu_ps(r->lg + t), mask8(r->mask, t)));
#endif
  for (; t < b1; t++) buf[t - b0] = allowed(r->mask, t) ? r->lg[t] : -INFINITY;
  for (; *o < o1; (*o)++) buf[(size_t)r->ov[*o].id - b0] = -INFINITY;
  return buf;
}

/* e = exp(float(a)), a = (x - top) * scale, or 0 unless (pre ? a : x - top) >= lo (min_p):
 * the softmax numerators of a row (top: the maximum, so e <= 1) */
typedef struct {
  double top, scale, lo;
  int pre;
} Temp;

/* ---- a row's passes over the vocabulary, split across the kernels' threads ----
 *
 * A pass that decides one call alone (one stream decoding: its rows one after another)
 * would leave the other threads idle, so there (given more than one thread) the passes
 * over the whole vocabulary (maximum, e and block sums, gathers) run as tasks of SPLIT
 * whole blocks on the kernels' threads, each task with its own block buffers. Every
 * block's result (its maximum, its sums, the tokens it gathered) is kept apart and
 * combined afterwards in block order by the one-thread pass's own operations in its
 * order: the same bits for any thread count. With several calls the calls run in parallel
 * instead, each row on one thread (a parallel-for inside another's task would run inline;
 * a single call's own parallel-for runs inline, leaving the workers to its passes). */
enum { SPLIT = 4 }; /* blocks per task: 38 tasks at V = 151936, for balance */

typedef struct Pass Pass;
struct Pass {
  /* the pass over blocks [k0, k1) of the row, as task `task` (task 0 has all the blocks
     when the pass is not split); buf and eb: the task's block buffers */
  void (*blocks)(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb);
  const Job *job;
  Scratch *s;
  const Row *r;
  const Temp *tp;   /* exp passes */
  double *bsum;     /* exp_pass: the block sums */
  float *keep;      /* exp_pass: the row's e, or NULL */
  float m;          /* exp_sum_f32: the shift */
  float lo, hi;     /* gathers: the bounds */
  const float *e;   /* gather_band: the row's e */
  Cand *out;        /* gathers: where the tokens go */
  int staged;       /* a split gather's tasks write to s->stage, not to out */
  int split;        /* run_pass: the pass runs as tasks */
};

static void pass_task(void *data, size_t t) {
  Pass *p = (Pass *)data;
  const size_t k0 = t * SPLIT, k1 = k0 + SPLIT < p->job->nblk ? k0 + SPLIT : p->job->nblk;
  float *buf = p->s->tbuf + t * 2 * BLOCK;
  p->blocks(p, t, k0, k1, buf, buf + BLOCK);
}

/* p->blocks over the whole row: as tasks where the row is decided alone (job->split), else
   in one go on this thread with the scratch's buffers; returns how many tasks */
static size_t run_pass(Pass *p) {
  const size_t tasks = p->job->split ? p->job->ntask : 1;
  p->split = tasks > 1;
  if (p->split) specd_parallel_for(pass_task, p, tasks);
  else p->blocks(p, 0, 0, p->job->nblk, p->s->buf, p->s->eb);
  return tasks;
}

/* where a gather's task puts the tokens of the blocks from k0 on: a place of its own, as
   many entries as its blocks have tokens (out itself when the pass is not split) */
static Cand *gather_dst(const Pass *p, size_t k0) {
  return (p->split && p->staged ? p->s->stage : p->out) + k0 * BLOCK;
}

/* after a gather: the tasks' tokens moved to out one task after another (so in the order
   of the one-thread pass); returns how many */
static size_t gather_join(const Pass *p, size_t tasks) {
  if (tasks == 1) return p->s->cnt[0];
  size_t m = 0;
  for (size_t t = 0; t < tasks; t++) {
    memmove(p->out + m, gather_dst(p, t * SPLIT), p->s->cnt[t] * sizeof *p->out);
    m += p->s->cnt[t];
  }
  return m;
}

/* the end of block k: the next one's start, or V */
static inline size_t block_end(const Row *r, size_t k) {
  return (k + 1) * BLOCK < r->V ? (k + 1) * BLOCK : r->V;
}

/* s->bmax[k]: the largest float logit of block k (NaN skipped; -inf if none) */
static void max_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)task, (void)eb;
  const Row *r = p->r;
  size_t o = ov_from(r, k0 * BLOCK);
  for (size_t k = k0; k < k1; k++) {
    const size_t b0 = k * BLOCK, n = block_end(r, k) - b0;
    const float *x = block_x(r, b0, b0 + n, &o, buf);
    float bm = -INFINITY;
    size_t t = 0;
#if SPECD_AVX2
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx[4] = {ninf, ninf, ninf, ninf};
    for (; t + 32 <= n; t += 32)
      for (int j = 0; j < 4; j++) /* x first: a NaN keeps the maximum so far */
        mx[j] = _mm256_max_ps(_mm256_loadu_ps(x + t + 8 * j), mx[j]);
    bm = hmax8(_mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
#endif
    for (; t < n; t++) bm = x[t] > bm ? x[t] : bm;
    p->s->bmax[k] = bm;
  }
}

/* the largest float logit (overrides aside; -inf if none), and the first block holding it */
static float row_max(const Job *job, Scratch *s, const Row *r, size_t *at) {
  Pass p = {.blocks = max_blocks, .job = job, .s = s, .r = r};
  run_pass(&p);
  float best = -INFINITY;
  *at = 0;
  for (size_t k = 0; k < job->nblk; k++)
    if (s->bmax[k] > best) {
      best = s->bmax[k];
      *at = k * BLOCK;
    }
  return best;
}

/* the first token of block b0 whose float logit is v (one there is) */
static size_t first_equal(const Row *r, size_t b0, float v, float *buf) {
  const size_t b1 = b0 + BLOCK < r->V ? b0 + BLOCK : r->V;
  size_t o = ov_from(r, b0), t = 0;
  const float *x = block_x(r, b0, b1, &o, buf);
  while (t < b1 - b0 && x[t] != v) t++;
  return b0 + t;
}

static inline float e_of(double x, const Temp *tp) {
  const double d = x - tp->top, a = d * tp->scale;
  return (tp->lo > -INFINITY && !((tp->pre ? a : d) >= tp->lo)) ? 0.0f : exp_scalar((float)a);
}

/* e of one token of the row */
static float e_at(const Row *r, const Temp *tp, size_t t) {
  const size_t o = ov_from(r, t);
  if (o < r->n_ov && (size_t)r->ov[o].id == t) return e_of(r->ov[o].x, tp);
  if (!allowed(r->mask, t)) return 0.0f;
  return e_of(finite_or_low(r->lg[t]), tp);
}

#if SPECD_AVX2
enum { G = 8 }; /* groups of 8 tokens in lockstep */
#define EACH for (int j = 0; j < G; j++)

/* exp8 of x[0 .. G), step by step across the groups: exp8's operations lane by lane (so
 * the same bits), but exp8 is one long chain of dependent operations, and one group at a
 * time leaves the vector units mostly waiting on it (1.6x the time at V = 151936) */
static inline void exp8_lockstep(__m256 x[G]) {
#define K(v) _mm256_set1_ps(v)
  __m256 z[G], fx[G], r[G], y[G];
  EACH z[j] = _mm256_cmp_ps(x[j], K(-87.0f), _CMP_LT_OQ);
  EACH x[j] = _mm256_max_ps(x[j], K(-87.0f));
  EACH fx[j] = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x[j], K(1.44269504088896341f)), K(0.5f)));
  EACH r[j] = _mm256_sub_ps(x[j], _mm256_mul_ps(fx[j], K(0.693359375f)));
  EACH r[j] = _mm256_sub_ps(r[j], _mm256_mul_ps(fx[j], K(-2.12194440e-4f)));
  EACH y[j] = _mm256_add_ps(_mm256_mul_ps(K(1.9875691500e-4f), r[j]), K(1.3981999507e-3f));
  EACH y[j] = _mm256_add_ps(_mm256_mul_ps(y[j], r[j]), K(8.3334519073e-3f));
  EACH y[j] = _mm256_add_ps(_mm256_mul_ps(y[j], r[j]), K(4.1665795894e-2f));
  EACH y[j] = _mm256_add_ps(_mm256_mul_ps(y[j], r[j]), K(1.6666665459e-1f));
  EACH y[j] = _mm256_add_ps(_mm256_mul_ps(y[j], r[j]), K(5.0000001201e-1f));
  EACH y[j] = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y[j], _mm256_mul_ps(r[j], r[j])), r[j]),
                            K(1.0f));
  EACH {
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(y[j]),
                                          _mm256_slli_epi32(_mm256_cvtps_epi32(fx[j]), 23));
    x[j] = _mm256_andnot_ps(z[j], _mm256_castsi256_ps(bits));
  }
#undef K
}

/* a[j] <- float(v * scale) of 8 tokens each, v = x - top in double, -inf unless
 * (pre ? v * scale : v) >= lo where cut */
static inline void args_lockstep(const float *x, __m256d vt, __m256d vs, int cut, int pre,
                                 __m256d vlo, __m256 a[G]) {
  __m256d d0[G], d1[G], a0[G], a1[G];
  EACH {
    const __m256 v = load8(x + 8 * j);
    d0[j] = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), vt);
    d1[j] = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), vt);
  }
  EACH {
    a0[j] = _mm256_mul_pd(d0[j], vs);
    a1[j] = _mm256_mul_pd(d1[j], vs);
  }
  if (cut) {
    const __m256d ninf = _mm256_set1_pd(-INFINITY);
    EACH {
      a0[j] = _mm256_blendv_pd(ninf, a0[j], _mm256_cmp_pd(pre ? a0[j] : d0[j], vlo, _CMP_GE_OQ));
      a1[j] = _mm256_blendv_pd(ninf, a1[j], _mm256_cmp_pd(pre ? a1[j] : d1[j], vlo, _CMP_GE_OQ));
    }
  }
  EACH a[j] = _mm256_set_m128(_mm256_cvtpd_ps(a1[j]), _mm256_cvtpd_ps(a0[j]));
}

/* acc[j % 4] += the 8 floats of v[j], in double */
static inline void widen_add(const __m256 v[G], __m256d acc[4]) {
  EACH acc[j % 4] = _mm256_add_pd(acc[j % 4],
                                  _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v[j])),
                                                _mm256_cvtps_pd(_mm256_extractf128_ps(v[j], 1))));
}
#undef EACH
#endif

/* eb <- e of block [b0, b1) (overrides included); returns their sum in double */
static double block_e(const Row *r, size_t b0, size_t b1, size_t *o, const Temp *tp,
                      float *buf, float *eb) {
  const size_t o0 = *o, n = b1 - b0;
  const float *x = block_x(r, b0, b1, o, buf);
  double sum = 0.0;
  size_t t = 0;
#if SPECD_AVX2
  const int cut = tp->lo > -INFINITY;
  const __m256d vt = _mm256_set1_pd(tp->top), vs = _mm256_set1_pd(tp->scale),
                vlo = _mm256_set1_pd(tp->lo);
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  for (; t + 8 * G <= n; t += 8 * G) {
    __m256 a[G];
    args_lockstep(x + t, vt, vs, cut, tp->pre, vlo, a);
    exp8_lockstep(a);
    for (int j = 0; j < G; j++) _mm256_storeu_ps(eb + t + 8 * j, a[j]);
    widen_add(a, acc);
  }
  sum = hsum16d(acc);
#endif
  for (; t < n; t++) sum += eb[t] = e_of(finite_or_low(x[t]), tp);
  for (size_t k = o0; k < *o; k++) { /* the overridden tokens (0 in the pass) */
    const float e = e_of(r->ov[k].x, tp);
    eb[(size_t)r->ov[k].id - b0] = e;
    sum += e;
  }
  return sum;
}

/* bsum[k] = block k's sum of e (its e written to keep, or to the task's eb) */
static void exp_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)task;
  const Row *r = p->r;
  size_t o = ov_from(r, k0 * BLOCK);
  for (size_t k = k0; k < k1; k++) {
    const size_t b0 = k * BLOCK;
    p->bsum[k] = block_e(r, b0, block_end(r, k), &o, p->tp, buf, p->keep ? p->keep + b0 : eb);
  }
}

/* The row's e block by block: bsum[b] = block b's sum; returns the total (the blocks'
 * sums added in order). Nothing of the vocabulary's size is written (a draw takes its
 * block's e again) unless `keep` asks for the row's e. */
static double exp_pass(const Job *job, Scratch *s, const Row *r, const Temp *tp, double *bsum,
                       float *keep) {
  Pass p = {.blocks = exp_blocks, .job = job, .s = s, .r = r, .tp = tp, .bsum = bsum,
            .keep = keep};
  run_pass(&p);
  double total = 0.0;
  for (size_t k = 0; k < job->nblk; k++) total += bsum[k];
  return total;
}

/* out <- (e, id) of the tokens t in [t0, t1) with tau <= e[t] < below; returns how many */
static size_t band_range(const float *e, size_t t0, size_t t1, float tau, float below,
                         Cand *out) {
  size_t g = 0, t = t0;
#if SPECD_AVX2
  const __m256 vt = _mm256_set1_ps(tau), vb = _mm256_set1_ps(below);
  /* up to the last whole group, a bound computed once: a loop gcc shapes with one branch
     per group (with t + 8 <= t1, two: 1.07x the time of a top_p row) */
  for (const size_t t8 = t0 + (t1 - t0) / 8 * 8; t < t8; t += 8) {
    const __m256 v = _mm256_loadu_ps(e + t);
    unsigned bits = (unsigned)_mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(v, vt, _CMP_GE_OQ), _mm256_cmp_ps(v, vb, _CMP_LT_OQ)));
    for (; bits; bits &= bits - 1) {
      const size_t j = t + (size_t)__builtin_ctz(bits);
      out[g].v = e[j];
      out[g++].id = (int32_t)j;
    }
  }
#endif
  for (; t < t1; t++)
    if (e[t] >= tau && e[t] < below) {
      out[g].v = e[t];
      out[g++].id = (int32_t)t;
    }
  return g;
}

/* the tokens of blocks [k0, k1) with lo <= e[t] < hi */
static void band_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)buf, (void)eb;
  p->s->cnt[task] = band_range(p->e, k0 * BLOCK, block_end(p->r, k1 - 1), p->lo, p->hi,
                               gather_dst(p, k0));
}

/* out <- (e, id) of the tokens with tau <= e[t] < below, in id order; returns how many */
static size_t gather_band(const Job *job, Scratch *s, const Row *r, const float *e, float tau,
                          float below, Cand *out) {
  Pass p = {.blocks = band_blocks, .job = job, .s = s, .r = r, .lo = tau, .hi = below, .e = e,
            .out = out, .staged = 1}; /* out: a list after others, not the row's room */
  return gather_join(&p, run_pass(&p));
}

#if SPECD_AVX2
/* s->bpart[k]: the sum of block k's exp(x - m) over its whole groups of 64 (a tail of the
   last block is left to exp_sum_f32) */
static void exp_f32_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)task, (void)eb;
  const Row *r = p->r;
  const __m256 vm = _mm256_set1_ps(p->m);
  size_t o = ov_from(r, k0 * BLOCK);
  for (size_t k = k0; k < k1; k++) {
    const size_t b0 = k * BLOCK, n = block_end(r, k) - b0;
    const float *x = block_x(r, b0, b0 + n, &o, buf);
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    for (size_t t = 0; t + 8 * G <= n; t += 8 * G) {
      __m256 a[G];
      for (int j = 0; j < G; j++) a[j] = _mm256_sub_ps(load8(x + t + 8 * j), vm);
      exp8_lockstep(a);
      widen_add(a, acc);
    }
    p->s->bpart[k] = hsum16d(acc);
  }
}
#endif

/* sum of exp(x - m) in float32 arithmetic, summed in double (top_probability's): per block
 * the vector sum, then the block's tail one by one (only the last block has one), then the
 * overrides */
static double exp_sum_f32(const Job *job, Scratch *s, const Row *r, float m) {
  double sum = 0.0;
  size_t o = 0;
#if SPECD_AVX2
  Pass p = {.blocks = exp_f32_blocks, .job = job, .s = s, .r = r, .m = m};
  run_pass(&p);
  for (size_t k = 0; k < job->nblk; k++) sum += s->bpart[k];
  const size_t b0 = (job->nblk - 1) * BLOCK, n = r->V - b0, t0 = n / (8 * G) * (8 * G);
  if (t0 < n) { /* the last block's tail */
    o = ov_from(r, b0);
    const float *x = block_x(r, b0, r->V, &o, s->buf);
    for (size_t t = t0; t < n; t++) sum += exp_scalar(finite_or_low(x[t]) - m);
  }
#else
  (void)job;
  for (size_t b0 = 0; b0 < r->V; b0 += BLOCK) { /* one running sum: not split */
    const size_t b1 = b0 + BLOCK < r->V ? b0 + BLOCK : r->V;
    const float *x = block_x(r, b0, b1, &o, s->buf);
    for (size_t t = 0; t < b1 - b0; t++) sum += exp_scalar(finite_or_low(x[t]) - m);
  }
#endif
  for (size_t k = 0; k < r->n_ov; k++) sum += exp_scalar((float)r->ov[k].x - m);
  return sum;
}

/* s->sub: the maximum logit of each 64-token block of blocks [k0, k1) (overrides aside) */
static void sub_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)task, (void)eb;
  const Row *r = p->r;
  Cand *out = p->s->sub;
  size_t o = ov_from(r, k0 * BLOCK), j = k0 * (BLOCK / SUB);
  for (size_t k = k0; k < k1; k++) {
    const size_t b0 = k * BLOCK, b1 = block_end(r, k);
    const float *x = block_x(r, b0, b1, &o, buf);
    for (size_t s0 = b0; s0 < b1; s0 += SUB, j++) {
      const size_t s1 = s0 + SUB < b1 ? s0 + SUB : b1;
      float mx = -INFINITY;
      size_t t = s0;
#if SPECD_AVX2
      if (s1 - s0 == SUB) {
        __m256 a = load8(x + (t - b0));
        for (t += 8; t < s1; t += 8) a = _mm256_max_ps(load8(x + (t - b0)), a);
        mx = hmax8(a);
      }
#endif
      for (; t < s1; t++) mx = x[t - b0] > mx ? x[t - b0] : mx;
      out[j].v = mx;
      out[j].id = (int32_t)j;
    }
  }
}

/* s->sub <- the maximum logit of each 64-token block (overrides aside) */
static void sub_maxima(const Job *job, Scratch *s, const Row *r) {
  Pass p = {.blocks = sub_blocks, .job = job, .s = s, .r = r};
  run_pass(&p);
}

/* the finite tokens of blocks [k0, k1) with logit >= p->lo */
static void x_blocks(Pass *p, size_t task, size_t k0, size_t k1, float *buf, float *eb) {
  (void)eb;
  const Row *r = p->r;
  const float tau = p->lo;
  Cand *out = gather_dst(p, k0);
  size_t o = ov_from(r, k0 * BLOCK), m = 0;
  for (size_t k = k0; k < k1; k++) {
    const size_t b0 = k * BLOCK, n = block_end(r, k) - b0;
    const float *x = block_x(r, b0, b0 + n, &o, buf);
    size_t t = 0;
#if SPECD_AVX2
    const __m256 vt = _mm256_set1_ps(tau);
    for (; t + 32 <= n; t += 32) { /* 32 at a time: most groups have none */
      __m256 hit[4];
      for (int j = 0; j < 4; j++)
        hit[j] = _mm256_cmp_ps(_mm256_loadu_ps(x + t + 8 * j), vt, _CMP_GE_OQ);
      if (!_mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(hit[0], hit[1]),
                                           _mm256_or_ps(hit[2], hit[3]))))
        continue;
      for (int j = 0; j < 4; j++)
        for (unsigned bits = (unsigned)_mm256_movemask_ps(hit[j]); bits; bits &= bits - 1) {
          const size_t i = t + 8 * (size_t)j + (size_t)__builtin_ctz(bits);
          out[m].v = x[i];
          out[m++].id = (int32_t)(b0 + i);
        }
    }
    for (; t + 8 <= n; t += 8)
      for (unsigned bits = (unsigned)_mm256_movemask_ps(
               _mm256_cmp_ps(_mm256_loadu_ps(x + t), vt, _CMP_GE_OQ));
           bits; bits &= bits - 1) {
        const size_t i = t + (size_t)__builtin_ctz(bits);
        out[m].v = x[i];
        out[m++].id = (int32_t)(b0 + i);
      }
#endif
    for (; t < n; t++)
      if (x[t] >= tau) {
        out[m].v = x[t];
        out[m++].id = (int32_t)(b0 + t);
      }
  }
  p->s->cnt[task] = m;
}

/* out <- (logit, id) of the finite tokens with logit >= bound (> -inf: all of them), the
 * overrides' in double, after the others; returns how many. out has room for the row
 * (overridden tokens are -inf in the blocks): a split pass's tasks gather in place. */
static size_t gather_x(const Job *job, Scratch *s, const Row *r, float bound, Cand *out) {
  const float tau = bound > -FLT_MAX ? bound : -FLT_MAX;
  Pass p = {.blocks = x_blocks, .job = job, .s = s, .r = r, .lo = tau, .out = out};
  size_t m = gather_join(&p, run_pass(&p));
  for (size_t k = 0; k < r->n_ov; k++)
    if (r->ov[k].x >= (double)tau && r->ov[k].x > -INFINITY) {
      out[m].v = r->ov[k].x;
      out[m++].id = r->ov[k].id;
    }
  return m;
}

/* cand <- the finite tokens with (x - top) * scale >= a_min (all for -inf), valued by their
 * e; returns how many. *edge: an e that no token left out exceeds (e grows with x; the
 * factor covers a last-bit wobble of the exp polynomial), 0 when none is left out. */
static size_t gather_e(const Job *job, Scratch *s, const Row *r, const Temp *tp, double a_min,
                       Cand *cand, double *edge) {
  float bound = -INFINITY;
  if (a_min > -INFINITY) {
    const double x = tp->top + a_min / tp->scale;
    bound = x > -FLT_MAX ? (float)x : -INFINITY;
  }
  const size_t g = gather_x(job, s, r, bound, cand);
  for (size_t j = 0; j < g; j++) cand[j].v = e_of(cand[j].v, tp);
  *edge = bound > -INFINITY ? e_of(bound, tp) * (1.0 + 0x1p-20) : 0.0;
  return g;
}

/* ---- a row's distribution ---- */

typedef struct {
  double temperature, top_p, min_p, rp, presence, frequency;
  size_t top_k;
  int temp_last;
} Params;

typedef struct {
  int dense;      /* e over the vocabulary (tp, bsum); else the list ids / ev of m tokens */
  size_t m;       /* the list's length */
  double total;   /* sum of e */
  Temp tp;
  int32_t argmax; /* greedy rows */
} Dist;

/* where a dense row's candidates are looked for: (x - top) * scale at least these, lowered
   until enough are found */
static const double A_LEVELS[] = {-6.0, -12.0, -24.0, -INFINITY};
enum { N_LEVELS = sizeof A_LEVELS / sizeof A_LEVELS[0] };

static ptrdiff_t find_id(const int32_t *ids, size_t m, int64_t id) {
  size_t lo = 0, hi = m;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (ids[mid] < id) lo = mid + 1;
    else hi = mid;
  }
  return lo < m && ids[lo] == id ? (ptrdiff_t)lo : -1;
}

static double list_max(const double *v, size_t m) {
  double mx = -INFINITY;
  for (size_t j = 0; j < m; j++) mx = v[j] > mx ? v[j] : mx;
  return mx;
}

/* Steps 4 on (top_p, min_p, temperature last, softmax) over the list ids / xv of m tokens
 * (their logits); leaves the survivors' e in ids / ev; returns how many. The maximum is
 * taken again at each step, as the host does: top_p may have cut the top token (its e
 * tied with lower ids') and left vals below 0. */
static size_t list_filters(Scratch *s, size_t m, double top, const Params *p, double *total) {
  const double T = p->temperature;
  for (size_t j = 0; j < m; j++) { /* vals: x - top, over T now unless temperature last */
    s->xv[j] -= top;
    if (!p->temp_last) s->xv[j] /= T;
  }
  if (p->top_p < 1.0 && m > 1) {
    const double mx = list_max(s->xv, m);
    double sum = 0.0;
    for (size_t j = 0; j < m; j++) {
      s->cand[j].v = exp_scalar((float)(s->xv[j] - mx));
      s->cand[j].id = (int32_t)j; /* positions in the list, in id order as the ids */
      sum += s->cand[j].v;
    }
    const size_t keep = nucleus(s->cand, m, sum, p->top_p, 0.0);
    if (keep && keep < m) { /* the first `keep` by probability, back in id order */
      memset(s->mark, 0, m);
      for (size_t j = 0; j < keep; j++) s->mark[s->cand[j].id] = 1;
      size_t k = 0;
      for (size_t j = 0; j < m; j++)
        if (s->mark[j]) {
          s->ids[k] = s->ids[j];
          s->xv[k++] = s->xv[j];
        }
      m = k;
    }
  }
  if (p->min_p > 0.0 && m > 1) { /* vals - max(vals) >= log(min_p) */
    const double lo = log(p->min_p), mx = list_max(s->xv, m);
    size_t k = 0;
    for (size_t j = 0; j < m; j++)
      if (s->xv[j] - mx >= lo) {
        s->ids[k] = s->ids[j];
        s->xv[k++] = s->xv[j];
      }
    m = k;
  }
  if (p->temp_last)
    for (size_t j = 0; j < m; j++) s->xv[j] /= T;
  const double mx = list_max(s->xv, m);
  double sum = 0.0;
  for (size_t j = 0; j < m; j++) {
    s->ev[j] = exp_scalar((float)(s->xv[j] - mx));
    sum += s->ev[j];
  }
  *total = sum;
  return m;
}

enum { LIST_MAX = 8192 }; /* kept sets longer than this stay dense */

/* The tokens cand[0 .. n) are what is kept of row r. A short set becomes the list ids / xv
 * (in id order by a bitmap of them, with their logits); a long one stays dense, as the row
 * restricted to it: the bitmap as its mask, its overrides among them, *top its largest
 * logit. Returns 1 for a list (of n). */
static int keep_set(Scratch *s, const Job *job, Row *r, size_t n, double *top) {
  uint32_t *bits = s->kept;
  memset(bits, 0, job->words * sizeof *bits);
  for (size_t j = 0; j < n; j++) bits[(size_t)s->cand[j].id >> 5] |= 1u << (s->cand[j].id & 31);
  if (n <= LIST_MAX) {
    size_t m = 0, o = 0;
    for (size_t w = 0; w < job->words; w++)
      for (uint32_t b = bits[w]; b; b &= b - 1) {
        const size_t id = w * 32 + (size_t)__builtin_ctz(b);
        while (o < r->n_ov && (size_t)r->ov[o].id < id) o++;
        s->ids[m] = (int32_t)id;
        s->xv[m++] = o < r->n_ov && (size_t)r->ov[o].id == id ? r->ov[o].x : (double)r->lg[id];
      }
    return 1;
  }
  size_t k = 0;
  for (size_t o = 0; o < r->n_ov; o++)
    if (allowed(bits, (size_t)r->ov[o].id)) s->ov2[k++] = r->ov[o];
  r->mask = bits;
  r->ov = s->ov2;
  r->n_ov = k;
  *top = -INFINITY; /* top_p may have cut the top token (its e tied with lower ids') */
  for (size_t j = 0; j < n; j++) {
    const int32_t id = s->cand[j].id;
    const size_t o = ov_from(r, (size_t)id);
    const double x = o < k && r->ov[o].id == id ? r->ov[o].x : (double)r->lg[id];
    *top = x > *top ? x : *top;
  }
  return 0;
}

/* The distribution of a sampled row whose float maximum is top_w: dense (tp, bsum) or a
 * list (ids, ev). Returns ST_OK or ST_NO_TOKEN. */
static int sampled_dist(Scratch *s, const Job *job, Row *r, float top_w, const Params *p,
                        Dist *dist) {
  double top = top_w;
  for (size_t o = 0; o < r->n_ov; o++) top = r->ov[o].x > top ? r->ov[o].x : top;
  if (!(top > -INFINITY) || top == INFINITY) return ST_NO_TOKEN; /* +inf: no softmax */
  double inv_t = 1.0 / p->temperature;
  if (inv_t > DBL_MAX) inv_t = DBL_MAX; /* 0 * inv_t stays 0 */
  size_t m = 0;
  int listed = 0, top_p_done = 0;

  /* 1. top_k among the finite tokens (one of logit -inf never has probability): the k-th
     largest of the 64-token blocks' maxima bounds the k-th largest logit from below */
  if (p->top_k > 0) {
    const size_t k = p->top_k;
    float bound = -INFINITY;
    if (k <= job->nsub) {
      sub_maxima(job, s, r);
      if (k < job->nsub) select_best(s->sub, job->nsub, k);
      bound = INFINITY;
      for (size_t j = 0; j < k; j++)
        bound = (float)s->sub[j].v < bound ? (float)s->sub[j].v : bound;
    }
    m = gather_x(job, s, r, bound, s->cand);
    if (m > k) {
      select_best(s->cand, m, k);
      m = k;
    }
    listed = keep_set(s, job, r, m, &top);
  }
  /* 4. top_p over a dense row: its e (kept) looked through in bands of a factor 4 from the
     top's 1 down (one compare each, no exp), each band's tokens gathered while the mass
     above it falls short of top_p (all of those are kept): the cut lies in the band that
     reaches it. Most rows stop at the first bands. */
  if (!listed && p->top_p < 1.0) {
    const Temp t1 = {top, p->temp_last ? 1.0 : inv_t, -INFINITY, 1};
    const double sum = exp_pass(job, s, r, &t1, s->bsum, s->e);
    size_t above = 0, keep = 0;
    double mass = 0.0; /* of cand[0 .. above), in e */
    for (float hi = INFINITY, lo = 0x1p-8f;; hi = lo, lo *= 0x1p-2f) {
      const int last = lo < 0x1p-60f; /* then all the rest: e > 0 */
      const size_t g =
          gather_band(job, s, r, s->e, last ? FLT_TRUE_MIN : lo, hi, s->cand + above);
      double band = 0.0;
      for (size_t j = above; j < above + g; j++) band += s->cand[j].v;
      const size_t cut = last || (mass + band) / sum >= p->top_p - 1e-9
                             ? nucleus(s->cand + above, g, sum, p->top_p, mass / sum) : 0;
      if (cut || last) { /* none at the last: every token is kept */
        keep = cut ? above + cut : 0;
        break;
      }
      above += g;
      mass += band;
    }
    if (keep) listed = keep_set(s, job, r, m = keep, &top);
    top_p_done = 1;
  }
  if (listed) {
    Params rest = *p;
    if (top_p_done) rest.top_p = 1.0;
    dist->dense = 0;
    dist->m = list_filters(s, m, top, &rest, &dist->total);
    return ST_OK;
  }
  /* dense: min_p and the temperature in one pass (top: the largest logit left) */
  const Temp tp = {top, inv_t, p->min_p > 0.0 ? log(p->min_p) : -INFINITY, !p->temp_last};
  dist->dense = 1;
  dist->tp = tp;
  dist->total = exp_pass(job, s, r, &tp, s->bsum, NULL);
  return ST_OK;
}

static double prob_of(const Scratch *s, const Row *r, const Dist *d, int64_t t) {
  if (t < 0 || (size_t)t >= r->V) return 0.0;
  if (d->dense) return e_at(r, &d->tp, (size_t)t) / d->total;
  const ptrdiff_t at = find_id(s->ids, d->m, t);
  return at < 0 ? 0.0 : s->ev[at] / d->total;
}

/* the position in v[0 .. n) where a running sum first passes `target` (the last if none),
 * moved to a nonzero value (the next, else the last before) as sample_from_probs does; -1
 * if all are zero */
static ptrdiff_t scan(const double *v, size_t n, double target) {
  if (!n) return -1;
  double run = 0.0;
  size_t idx = n - 1;
  for (size_t j = 0; j < n; j++) {
    run += v[j];
    if (run > target) {
      idx = j;
      break;
    }
  }
  if (v[idx] > 0.0) return (ptrdiff_t)idx;
  for (size_t j = idx + 1; j < n; j++)
    if (v[j] > 0.0) return (ptrdiff_t)j;
  for (size_t j = idx; j-- > 0;)
    if (v[j] > 0.0) return (ptrdiff_t)j;
  return -1;
}

/* Inverse CDF of a dense row at u, as sample_from_probs: the block by the block sums, then
 * the running sum inside it. The values are e, except at the ids of q (ascending), which
 * are qr (bsum includes them). */
static int64_t draw_dense(Scratch *s, const Row *r, const Temp *tp, const double *bsum,
                          size_t nblk, const Qe *q, const double *qr, size_t nq, double u) {
  double total = 0.0;
  for (size_t b = 0; b < nblk; b++) total += bsum[b];
  if (!(total > 0.0)) return -1;
  const double point = u * total;
  size_t b = 0;
  double before = 0.0; /* the running sum of the blocks before b */
  while (b + 1 < nblk && before + bsum[b] <= point) before += bsum[b++];
  if (!(bsum[b] > 0.0)) { /* rounded past empty blocks: the last nonempty one before */
    while (b > 0 && !(bsum[b] > 0.0)) b--;
    before = 0.0;
    for (size_t k = 0; k < b; k++) before += bsum[k];
  }
  const size_t b0 = b * BLOCK, b1 = b0 + BLOCK < r->V ? b0 + BLOCK : r->V;
  size_t o = ov_from(r, b0);
  block_e(r, b0, b1, &o, tp, s->buf, s->eb);
  for (size_t t = 0; t < b1 - b0; t++) s->vals[t] = s->eb[t];
  for (size_t j = 0; j < nq; j++)
    if ((size_t)q[j].id >= b0 && (size_t)q[j].id < b1) s->vals[(size_t)q[j].id - b0] = qr[j];
  const ptrdiff_t j = scan(s->vals, b1 - b0, point - before);
  return j < 0 ? -1 : (int64_t)(b0 + (size_t)j);
}

static int64_t draw(Scratch *s, const Job *job, const Row *r, const Dist *d, double u) {
  if (d->dense) return draw_dense(s, r, &d->tp, s->bsum, job->nblk, NULL, NULL, 0, u);
  if (!d->m || !(d->total > 0.0)) return -1;
  const ptrdiff_t j = scan(s->ev, d->m, u * d->total);
  return j < 0 ? -1 : s->ids[j];
}

/* the n most probable tokens of a sampled row (descending, ties lower id first, none of
 * probability 0) into ids / probs: a dense row's from the tokens above a bound, lowered
 * until n of them are (and the n-th lies above it) */
static void write_cands(const Job *job, Scratch *s, const Row *r, const Dist *d, size_t n,
                        int64_t *ids, float *probs) {
  size_t g = 0;
  for (size_t level = 0; d->dense && level < N_LEVELS; level++) {
    double edge;
    const size_t all = gather_e(job, s, r, &d->tp, A_LEVELS[level], s->cand, &edge);
    g = 0;
    for (size_t j = 0; j < all; j++)
      if (s->cand[j].v > 0.0) s->cand[g++] = s->cand[j];
    if (g < n && edge > 0.0) continue;
    if (g > n) select_best(s->cand, g, n);
    size_t worst = 0; /* the n-th: above the bound, or look further */
    for (size_t j = 1; j < (g < n ? g : n); j++)
      worst = better(&s->cand[worst], &s->cand[j]) ? j : worst;
    if (!g || s->cand[worst].v > edge) break;
  }
  if (!d->dense)
    for (size_t j = 0; j < d->m; j++)
      if (s->ev[j] > 0.0) {
        s->cand[g].v = s->ev[j];
        s->cand[g++].id = s->ids[j];
      }
  if (g > n) {
    select_best(s->cand, g, n);
    g = n;
  }
  qsort(s->cand, g, sizeof *s->cand, cmp_better);
  for (size_t j = 0; j < g; j++) {
    ids[j] = s->cand[j].id;
    probs[j] = (float)(s->cand[j].v / d->total);
  }
}

/* ---- rejection sampling against the draft's q ---- */

static int cmp_qe(const void *a, const void *b) {
  const Qe *x = (const Qe *)a, *y = (const Qe *)b;
  if (x->id != y->id) return (x->id > y->id) - (x->id < y->id);
  return (x->at > y->at) - (x->at < y->at);
}

/* draft i's q: ids in [0, V) ascending, a repeated id's probabilities added in their order;
 * masked: zeroed off the mask and renormalised (all zero where no mass is left) */
static size_t build_q(const int64_t *ids, const float *probs, size_t K, size_t V,
                      const uint32_t *mask, Qe *q) {
  size_t n = 0, u = 0;
  for (size_t j = 0; j < K; j++)
    if (ids[j] >= 0 && (size_t)ids[j] < V) {
      q[n].id = (int32_t)ids[j];
      q[n].at = (int32_t)j;
      q[n++].q = probs[j];
    }
  qsort(q, n, sizeof *q, cmp_qe);
  for (size_t j = 0; j < n; j++) {
    if (u && q[u - 1].id == q[j].id) q[u - 1].q += q[j].q;
    else q[u++] = q[j];
  }
  if (!mask) return u;
  size_t k = 0;
  double total = 0.0;
  for (size_t j = 0; j < u; j++)
    if (allowed(mask, (size_t)q[j].id)) {
      q[k++] = q[j];
      total += q[j].q;
    }
  for (size_t j = 0; j < k; j++) q[j].q = total > 0.0 ? q[j].q / total : 0.0;
  return k;
}

/* a draw from normalise(max(p - q, 0)), or from p where that is all zero */
static int64_t draw_residual(Scratch *s, const Job *job, const Row *r, const Dist *d,
                             size_t nq, double u) {
  const Qe *q = s->q;
  const double S = d->total;
  if (!d->dense) {
    for (size_t j = 0; j < d->m; j++) s->xv[j] = s->ev[j];
    for (size_t j = 0; j < nq; j++) {
      const ptrdiff_t at = find_id(s->ids, d->m, q[j].id);
      if (at < 0) continue;
      const double res = s->ev[at] / S - q[j].q; /* in p, as the host */
      s->xv[at] = res > 0.0 ? res * S : 0.0;
    }
    double total = 0.0;
    for (size_t j = 0; j < d->m; j++) total += s->xv[j];
    const ptrdiff_t j = total > 0.0 ? scan(s->xv, d->m, u * total) : scan(s->ev, d->m, u * S);
    return j < 0 ? -1 : s->ids[j];
  }
  /* dense: the q tokens' residuals stand in for their e, and their blocks are summed again */
  memcpy(s->bsum2, s->bsum, job->nblk * sizeof *s->bsum2);
  for (size_t j = 0; j < nq; j++) {
    const double res = e_at(r, &d->tp, (size_t)q[j].id) / S - q[j].q;
    s->q_r[j] = res > 0.0 ? res * S : 0.0;
  }
  for (size_t j = 0; j < nq; j++) {
    const size_t b = (size_t)q[j].id / BLOCK, b0 = b * BLOCK;
    if (j && (size_t)q[j - 1].id / BLOCK == b) continue;
    const size_t b1 = b0 + BLOCK < r->V ? b0 + BLOCK : r->V;
    size_t o = ov_from(r, b0), k = j;
    block_e(r, b0, b1, &o, &d->tp, s->buf, s->eb);
    for (; k < nq && (size_t)q[k].id < b1; k++) s->eb[(size_t)q[k].id - b0] = 0.0f;
    double sum = 0.0;
    for (size_t t = 0; t < b1 - b0; t++) sum += s->eb[t];
    for (k = j; k < nq && (size_t)q[k].id < b1; k++) sum += s->q_r[k];
    s->bsum2[b] = sum;
  }
  double total = 0.0;
  for (size_t b = 0; b < job->nblk; b++) total += s->bsum2[b];
  if (total > 0.0) return draw_dense(s, r, &d->tp, s->bsum2, job->nblk, q, s->q_r, nq, u);
  return draw_dense(s, r, &d->tp, s->bsum, job->nblk, NULL, NULL, 0, u);
}

/* ---- penalties: the window's tokens with their counts, sorted ---- */

static int cmp_seen(const void *a, const void *b) {
  const int64_t x = ((const Seen *)a)->tok, y = ((const Seen *)b)->tok;
  return (x > y) - (x < y);
}
static size_t seen_find(const Seen *v, size_t n, int64_t tok) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (v[mid].tok < tok) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
static void seen_add(Seen *v, size_t *n, int64_t tok) {
  const size_t at = seen_find(v, *n, tok);
  if (at < *n && v[at].tok == tok) {
    v[at].n++;
    return;
  }
  memmove(v + at + 1, v + at, (*n - at) * sizeof *v);
  v[at].tok = tok;
  v[at].n = 1;
  (*n)++;
}
static void seen_remove(Seen *v, size_t *n, int64_t tok) {
  const size_t at = seen_find(v, *n, tok);
  if (at >= *n || v[at].tok != tok) return;
  if (--v[at].n == 0) {
    memmove(v + at, v + at + 1, (*n - at - 1) * sizeof *v);
    (*n)--;
  }
}

/* ov <- the row's biased and penalised logits (allowed tokens only; NaN as -inf), in
 * ascending ids: x + bias, then v = x (/ rp if > 0, else * rp, when rp != 1) and
 * x = v - (count * frequency + presence), all in double as the host does */
static size_t overrides(const float *lg, size_t V, const uint32_t *mask, const Bias *bias,
                        size_t nb, const Seen *seen, size_t n_seen, const Params *p, Ov *ov) {
  size_t n = 0, i = 0, j = 0;
  while (i < nb || (j < n_seen && (size_t)seen[j].tok < V)) {
    const int64_t bi = i < nb ? bias[i].id : INT64_MAX;
    const int64_t sj = j < n_seen && (size_t)seen[j].tok < V ? seen[j].tok : INT64_MAX;
    const int64_t t = bi < sj ? bi : sj;
    double x = lg[t];
    for (; i < nb && bias[i].id == t; i++) x += bias[i].b;
    if (sj == t) {
      double v = x;
      if (p->rp != 1.0) v = v > 0.0 ? v / p->rp : v * p->rp;
      x = v - ((double)seen[j].n * p->frequency + p->presence);
      j++;
    }
    if (!allowed(mask, (size_t)t)) continue;
    ov[n].id = (int32_t)t;
    ov[n++].x = x == x ? x : -INFINITY;
  }
  return n;
}

static int mask_empty(const uint32_t *mask, size_t V) {
  const size_t full = V / 32;
  for (size_t k = 0; k < full; k++)
    if (mask[k]) return 0;
  return !(V % 32) || !(mask[full] & ((1u << (V % 32)) - 1u));
}

/* ---- one call ---- */

static void decide_call(const Job *job, size_t c, Scratch *s) {
  const size_t V = job->V, D = job->D;
  const int64_t *pl = job->plan + c * PLAN_W;
  const double *pr = job->params + c * PARAM_W;
  const size_t first = (size_t)pl[1], n = (size_t)pl[2], n_cand = (size_t)pl[8];
  const uint64_t pos = (uint64_t)pl[3], key = (uint64_t)job->keys[c];
  const int flags = (int)pl[4];
  const int64_t window = pl[6], stop_after = pl[7];
  const uint32_t stream = (uint32_t)pl[9];
  /* a top_k of V or more keeps every token: off */
  const size_t top_k = pr[1] < (double)V ? (size_t)pr[1] : 0;
  const Params p = {pr[0], pr[2], pr[3], pr[4], pr[5], pr[6], top_k, flags & FLAG_TEMP_LAST};
  const int greedy = p.temperature == 0.0;
  const int reject = (flags & FLAG_REJECT) && !greedy; /* greedy rejection: plain greedy */
  const int64_t *drafts = job->drafts + c * D;
  int64_t *tokens = job->tokens + c * (D + 1), *counts = job->counts + c * 3;
  float *accept = job->accept + c * D;

  /* the bias, ascending ids (insertion sort: stable, and NB is small) */
  size_t nb = 0;
  for (size_t j = 0; j < job->NB; j++) {
    const int64_t id = job->bias_ids[c * job->NB + j];
    if (id < 0 || (size_t)id >= V) continue;
    const Bias b = {(int32_t)id, job->bias_values[c * job->NB + j]};
    size_t k = nb++;
    for (; k > 0 && s->bias[k - 1].id > b.id; k--) s->bias[k] = s->bias[k - 1];
    s->bias[k] = b;
  }

  /* the penalty window: the last W of the history (padding skipped), then accepted drafts */
  const int penalised = window != 0 && (p.rp != 1.0 || p.presence != 0.0 || p.frequency != 0.0);
  size_t len = 0, n_seen = 0, lo = 0;
  if (penalised) {
    for (size_t j = 0; j < job->H; j++) {
      const int64_t t = job->history[c * job->H + j];
      if (t >= 0) s->seq[len++] = t;
    }
    lo = window > 0 && len > (size_t)window ? len - (size_t)window : 0;
    for (size_t j = lo; j < len; j++) s->seen[j - lo].tok = s->seq[j]; /* sorted, counted */
    qsort(s->seen, len - lo, sizeof *s->seen, cmp_seen);
    for (size_t j = 0; j < len - lo; j++) {
      if (n_seen && s->seen[n_seen - 1].tok == s->seen[j].tok) {
        s->seen[n_seen - 1].n++;
      } else {
        s->seen[n_seen].tok = s->seen[j].tok;
        s->seen[n_seen++].n = 1;
      }
    }
  }

  size_t emitted = 0, n_acc = 0;
  int status = ST_OK;
  for (size_t i = 0; i <= n; i++) {
    const size_t row = first + i;
    const uint32_t *mask =
        (flags & FLAG_MASKED) ? job->masks + ((size_t)pl[5] + i) * job->words : NULL;
    if (mask && mask_empty(mask, V)) {
      status = i > 0 ? ST_DEAD_END : ST_NO_TOKEN;
      break;
    }
    const float *lg = job->logits + row * V;
    Row r = {lg, mask, s->ov, overrides(lg, V, mask, s->bias, nb, s->seen, n_seen, &p, s->ov), V};
    size_t top_block;
    const float top_w = row_max(job, s, &r, &top_block);
    Dist dist = {0, 0, 0.0, {0.0, 0.0, 0.0, 0}, -1};
    if (greedy) { /* argmax, ties to the lowest id: the floats' first maximum or an override */
      double best = top_w;
      int64_t at = top_w > -INFINITY ? (int64_t)first_equal(&r, top_block, top_w, s->buf) : -1;
      for (size_t o = 0; o < r.n_ov; o++)
        if (r.ov[o].x > best || (r.ov[o].x == best && r.ov[o].id < at)) {
          best = r.ov[o].x;
          at = r.ov[o].id;
        }
      if (!(best > -INFINITY) || at < 0) {
        status = ST_NO_TOKEN;
        break;
      }
      dist.argmax = (int32_t)at;
      if (n_cand) { /* top_probability of the masked, penalised row, in float32 */
        job->cand_ids[row * job->KC] = at;
        job->cand_probs[row * job->KC] = (float)(1.0 / exp_sum_f32(job, s, &r, (float)best));
      }
    } else {
      if (sampled_dist(s, job, &r, top_w, &p, &dist) != ST_OK) {
        status = ST_NO_TOKEN;
        break;
      }
      if (n_cand)
        write_cands(job, s, &r, &dist, n_cand, job->cand_ids + row * job->KC,
                    job->cand_probs + row * job->KC);
    }

    const double u0 = greedy ? 0.0 : philox_uniform(key, pos + i, stream, 0);
    int64_t choice;
    if (i < n && reject) { /* accept d iff u0 q(d) < p(d), else a draw from the residual */
      const int64_t d = drafts[i];
      const size_t nq = build_q(job->q_ids + (c * D + i) * job->K,
                                job->q_probs + (c * D + i) * job->K, job->K, V, mask, s->q);
      double alpha = 0.0, q_d = 0.0;
      for (size_t j = 0; j < nq; j++) {
        const double pt = prob_of(s, &r, &dist, s->q[j].id);
        alpha += pt < s->q[j].q ? pt : s->q[j].q;
        if (s->q[j].id == d) q_d = s->q[j].q;
      }
      accept[i] = (float)alpha;
      if (u0 * q_d < prob_of(s, &r, &dist, d)) {
        choice = d;
      } else {
        choice = draw_residual(s, job, &r, &dist, nq, philox_uniform(key, pos + i, stream, 1));
        if (choice < 0) {
          status = ST_NO_TOKEN;
          break;
        }
        tokens[emitted++] = choice;
        break;
      }
    } else {
      choice = greedy ? dist.argmax : draw(s, job, &r, &dist, u0);
      if (choice < 0) {
        status = ST_NO_TOKEN;
        break;
      }
      if (i < n)
        accept[i] = greedy ? (choice == drafts[i] ? 1.0f : 0.0f)
                           : (float)prob_of(s, &r, &dist, drafts[i]);
    }
    tokens[emitted++] = choice;
    if (i == n || choice != drafts[i]) break; /* the bonus, or the target's own choice */
    n_acc++;
    if (stop_after >= 0 && (size_t)stop_after == i) break;
    if (penalised) { /* the accepted draft joins the window; the oldest may leave it */
      s->seq[len++] = choice;
      seen_add(s->seen, &n_seen, choice);
      if (window > 0 && len - lo > (size_t)window) seen_remove(s->seen, &n_seen, s->seq[lo++]);
    }
  }
  counts[0] = (int64_t)emitted;
  counts[1] = (int64_t)n_acc;
  counts[2] = status;
}

static void run_task(void *data, size_t t) {
  Job *job = (Job *)data;
  Scratch s;
  if (!scratch_init(&s, job)) {
    atomic_store(&job->failed, 1);
    return;
  }
  decide_call(job, job->calls[t], &s);
  free(s.mem);
}

/* ---- checks, outputs ---- */

static OrtStatus *fail_call(size_t c, const char *what) {
  char msg[256];
  snprintf(msg, sizeof msg, "SampleTokens: call %zu: %s", c, what);
  return specd_fail(msg);
}

/* the plan row, params and bias of decided call c: NULL, or what is wrong */
static const char *check_call(const Job *job, size_t c, size_t M) {
  const int64_t *pl = job->plan + c * PLAN_W;
  const double *pr = job->params + c * PARAM_W;
  const int64_t R = (int64_t)job->R, D = (int64_t)job->D, V = (int64_t)job->V;
  const int64_t first = pl[1], n = pl[2], flags = pl[4], mask_row = pl[5], stop = pl[7];
  if (first < 0 || first >= R) return "plan first_row is outside the logits rows";
  if (n < 0 || n > D) return "plan n_draft is outside [0, D] (D: the drafts' width)";
  if (n >= R - first) return "plan first_row + n_draft is past the logits rows";
  if (pl[3] < 0) return "plan position is negative";
  if (flags & ~(int64_t)7) return "plan flags has bits other than 1, 2 and 4";
  if (pl[6] < -1) return "plan window is below -1";
  if (stop < -1 || stop >= n) return "plan stop_after is neither -1 nor a draft below n_draft";
  if (pl[8] < 0 || pl[8] > V) return "plan n_cand is outside [0, V]";
  if (pl[9] < 0 || pl[9] > (int64_t)UINT32_MAX) return "plan stream is outside [0, 2^32)";
  if (flags & FLAG_MASKED) { /* masks for the rows the call can reach */
    const int64_t last = stop >= 0 ? stop : n;
    if (mask_row < 0 || mask_row >= (int64_t)M || last >= (int64_t)M - mask_row)
      return "plan mask_row (and the rows after it that the call masks) is outside masks";
  }
  if (!(pr[0] >= 0.0 && pr[0] <= DBL_MAX)) return "params temperature is not finite and >= 0";
  if (!(pr[1] >= 0.0 && pr[1] <= DBL_MAX) || pr[1] != floor(pr[1]))
    return "params top_k is not a whole number >= 0";
  if (!(pr[2] > 0.0 && pr[2] <= 1.0)) return "params top_p is outside (0, 1]";
  if (!(pr[3] >= 0.0 && pr[3] <= 1.0)) return "params min_p is outside [0, 1]";
  if (!(pr[4] > 0.0 && pr[4] <= DBL_MAX)) return "params repeat_penalty is not finite and > 0";
  if (!isfinite(pr[5])) return "params presence_penalty is not finite";
  if (!isfinite(pr[6])) return "params frequency_penalty is not finite";
  for (size_t j = 0; j < job->NB; j++) {
    const double b = job->bias_values[c * job->NB + j];
    if (job->bias_ids[c * job->NB + j] >= 0 && (b != b || b == INFINITY))
      return "bias_values has NaN or +inf (finite or -inf only)";
  }
  return NULL;
}

typedef struct {
  int64_t first, last;
  size_t c;
} Span;
static int cmp_span(const void *a, const void *b) {
  const int64_t x = ((const Span *)a)->first, y = ((const Span *)b)->first;
  return (x > y) - (x < y);
}

static OrtStatus *output(OrtKernelContext *ctx, size_t n_out, size_t i, int64_t d0, int64_t d1,
                         size_t elem, void **data, void **own) {
  OrtValue *v = NULL;
  const int64_t dims[2] = {d0, d1};
  *data = *own = NULL;
  if (i < n_out) CHECK(g_api->KernelContext_GetOutput(ctx, i, dims, 2, &v));
  if (v) return g_api->GetTensorMutableData(v, data);
  /* an output the node leaves out: written to a buffer of our own */
  *data = *own = malloc((size_t)(d0 * d1) * elem + 1);
  return *own ? NULL : g_api->CreateStatus(ORT_FAIL, "SampleTokens: out of memory");
}

static OrtStatus *run(OrtKernelContext *ctx, Job *job, size_t C, size_t M, size_t *calls,
                      Span *spans) {
  const size_t D = job->D, R = job->R, V = job->V;
  size_t n_decided = 0;
  int64_t kc = 1;
  for (size_t c = 0; c < C; c++) {
    const int64_t mode = job->plan[c * PLAN_W];
    if (mode == 0) continue;
    if (mode != 1) return fail_call(c, "plan mode is neither 0 (skip) nor 1 (decide)");
    const char *bad = check_call(job, c, M);
    if (bad) return fail_call(c, bad);
    const int64_t *pl = job->plan + c * PLAN_W;
    kc = pl[8] > kc ? pl[8] : kc;
    spans[n_decided].first = pl[1];
    spans[n_decided].last = pl[1] + pl[2];
    spans[n_decided].c = c;
    calls[n_decided++] = c;
  }
  qsort(spans, n_decided, sizeof *spans, cmp_span);
  for (size_t j = 1; j < n_decided; j++)
    if (spans[j].first <= spans[j - 1].last) {
      char msg[160];
      snprintf(msg, sizeof msg, "SampleTokens: calls %zu and %zu share logits rows",
               spans[j - 1].c, spans[j].c);
      return specd_fail(msg);
    }
  (void)V;
  size_t n_out = 0;
  CHECK(g_api->KernelContext_GetOutputCount(ctx, &n_out));
  void *data[N_OUT], *own[N_OUT] = {NULL};
  const int64_t shapes[N_OUT][2] = {{(int64_t)C, (int64_t)D + 1}, {(int64_t)C, 3},
                                    {(int64_t)C, (int64_t)D},     {(int64_t)R, kc},
                                    {(int64_t)R, kc}};
  const size_t elems[N_OUT] = {8, 8, 4, 8, 4};
  OrtStatus *st = NULL;
  for (size_t i = 0; i < N_OUT && !st; i++)
    st = output(ctx, n_out, i, shapes[i][0], shapes[i][1], elems[i], &data[i], &own[i]);
  if (!st) {
    job->tokens = (int64_t *)data[0];
    job->counts = (int64_t *)data[1];
    job->accept = (float *)data[2];
    job->cand_ids = (int64_t *)data[3];
    job->cand_probs = (float *)data[4];
    job->KC = (size_t)kc;
    for (size_t j = 0; j < C * (D + 1); j++) job->tokens[j] = -1;
    memset(job->counts, 0, C * 3 * sizeof(int64_t));
    for (size_t j = 0; j < C * D; j++) job->accept[j] = -1.0f;
    for (size_t j = 0; j < R * (size_t)kc; j++) job->cand_ids[j] = -1;
    memset(job->cand_probs, 0, R * (size_t)kc * sizeof(float));
    job->calls = calls;
    /* one call alone: its rows' passes split into tasks (where there are threads to run
       them); else the calls in parallel */
    job->split = n_decided == 1 && specd_pool_threads() > 1;
    specd_parallel_for(run_task, job, n_decided);
    if (atomic_load(&job->failed))
      st = g_api->CreateStatus(ORT_FAIL, "SampleTokens: out of memory");
  }
  for (size_t i = 0; i < N_OUT; i++) free(own[i]);
  return st;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  static const char *const WHAT[N_IN] = {
      "logits is not [R, V] with V >= 1",  "plan is not [C, 10]",
      "params is not [C, 8]",              "keys is not [C]",
      "drafts is not [C, D] with D >= 1",  "q_ids is not [C, D, K] with K >= 1",
      "q_probs does not have q_ids' shape", "history is not [C, H] with H >= 1",
      "bias_ids is not [C, NB] with NB >= 1", "bias_values does not have bias_ids' shape",
      "masks is not [M, ceil(V / 32)] with M >= 1"};
  const OrtValue *in[N_IN];
  int64_t d[N_IN][8] = {{0}};
  size_t r[N_IN] = {0};
  for (size_t i = 0; i < N_IN; i++) {
    CHECK(g_api->KernelContext_GetInput(ctx, i, &in[i]));
    if (!in[i]) return specd_fail("SampleTokens: an input is missing");
    CHECK(specd_tensor_shape(in[i], d[i], &r[i]));
  }
  const int64_t C = r[IN_PLAN] == 2 ? d[IN_PLAN][0] : -1;
  const int64_t V = r[IN_LOGITS] == 2 ? d[IN_LOGITS][1] : -1;
  const int64_t D = r[IN_DRAFTS] == 2 ? d[IN_DRAFTS][1] : -1;
  const int ok[N_IN] = {
      V >= 1 && V <= INT32_MAX - BLOCK,
      C >= 0 && d[IN_PLAN][1] == PLAN_W,
      r[IN_PARAMS] == 2 && d[IN_PARAMS][0] == C && d[IN_PARAMS][1] == PARAM_W,
      r[IN_KEYS] == 1 && d[IN_KEYS][0] == C,
      D >= 1 && d[IN_DRAFTS][0] == C,
      r[IN_QIDS] == 3 && d[IN_QIDS][0] == C && d[IN_QIDS][1] == D && d[IN_QIDS][2] >= 1,
      r[IN_QPROBS] == 3 && !memcmp(d[IN_QPROBS], d[IN_QIDS], 3 * sizeof(int64_t)),
      r[IN_HISTORY] == 2 && d[IN_HISTORY][0] == C && d[IN_HISTORY][1] >= 1,
      r[IN_BIAS_IDS] == 2 && d[IN_BIAS_IDS][0] == C && d[IN_BIAS_IDS][1] >= 1,
      r[IN_BIAS_VALUES] == 2 && !memcmp(d[IN_BIAS_VALUES], d[IN_BIAS_IDS], 2 * sizeof(int64_t)),
      r[IN_MASKS] == 2 && d[IN_MASKS][0] >= 1 && d[IN_MASKS][1] == (V + 31) / 32};
  for (size_t i = 0; i < N_IN; i++) {
    if (ok[i]) continue;
    char msg[128];
    snprintf(msg, sizeof msg, "SampleTokens: %s", WHAT[i]);
    return specd_fail(msg);
  }
  Job job;
  memset(&job, 0, sizeof job);
  job.R = (size_t)d[IN_LOGITS][0];
  job.V = (size_t)V;
  job.nblk = (job.V + BLOCK - 1) / BLOCK;
  job.nsub = (job.V + SUB - 1) / SUB;
  job.ntask = (job.nblk + SPLIT - 1) / SPLIT;
  job.D = (size_t)D;
  job.K = (size_t)d[IN_QIDS][2];
  job.H = (size_t)d[IN_HISTORY][1];
  job.NB = (size_t)d[IN_BIAS_IDS][1];
  job.words = (size_t)d[IN_MASKS][1];
  void *ptr[N_IN];
  for (size_t i = 0; i < N_IN; i++) CHECK(g_api->GetTensorMutableData((OrtValue *)in[i], &ptr[i]));
  job.logits = (const float *)ptr[IN_LOGITS];
  job.plan = (const int64_t *)ptr[IN_PLAN];
  job.params = (const double *)ptr[IN_PARAMS];
  job.keys = (const int64_t *)ptr[IN_KEYS];
  job.drafts = (const int64_t *)ptr[IN_DRAFTS];
  job.q_ids = (const int64_t *)ptr[IN_QIDS];
  job.q_probs = (const float *)ptr[IN_QPROBS];
  job.history = (const int64_t *)ptr[IN_HISTORY];
  job.bias_ids = (const int64_t *)ptr[IN_BIAS_IDS];
  job.bias_values = (const double *)ptr[IN_BIAS_VALUES];
  job.masks = (const uint32_t *)ptr[IN_MASKS];
  atomic_init(&job.failed, 0);
  size_t *calls = (size_t *)malloc((size_t)C * sizeof(size_t) + 1);
  Span *spans = (Span *)malloc((size_t)C * sizeof(Span) + 1);
  OrtStatus *st = calls && spans ? run(ctx, &job, (size_t)C, (size_t)d[IN_MASKS][0], calls, spans)
                                 : g_api->CreateStatus(ORT_FAIL, "SampleTokens: out of memory");
  free(calls);
  free(spans);
  return st;
}

static const ONNXTensorElementDataType INPUTS[N_IN] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,  ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32};
static const ONNXTensorElementDataType OUTPUTS[N_OUT] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
/* tokens required; the other outputs may be left out of the node */
const SpecdOpDef specd_sample_tokens = {"SampleTokens", N_IN, INPUTS, specd_create_stateless,
                                        compute, N_OUT, OUTPUTS, 0, 1};
