"""GgufMatMul's group kernels at two revisions, interleaved in one process.

    python bench/kernel_ab.py [--base HEAD~1] [--shapes 1536x8960,8960x1536]
                              [--types Q4_K,Q6_K,Q4_0,Q4_1] [--sizes 1,4,5,8] [--repeats 9]
                              [--threads 2] [--hot] [--cflags=-mno-avx512f] [--min]
                              [--cpu-time]

This machine's timings drift by 10-20% between runs, more than a kernel change is worth,
so two builds of `ort_models/kernels/gguf_matmul.c` (the one at git revision `--base`
and the working tree's) are compiled into one C program (`$CC`, else cc, with the flags
specd builds with) that calls them alternately on the same threads, matrices streamed
from memory (512 MiB of weight copies, far past the caches) and the same quantized
activations. Prints the median ms per matrix of each build and their ratio. The weights
are random bytes: the timing does not depend on their values, only on their size, which
both layouts share. `--hot` times the kernels' arithmetic instead: one copy of the
matrix, multiplied 64 times in a row, so it stays in the caches (pick a shape that fits
them, e.g. 1536x1024 for the L2 of two cores); a verify block of several rows is
compute-bound, and there the instructions per row decide its time. Each call starts its
own threads (tens of microseconds), which dilutes the ratios of small shapes. `--cflags`
adds flags to both builds: `-mno-avx512f` times the AVX2 kernels (machines without
AVX-512), `-mno-avx512bw` the 256-bit VNNI ones. `--min` reports the fastest round of
each build instead of the median: on a host busy with other work, the least disturbed.
`--cpu-time` times a call by the CPU time of its busiest thread instead of the wall clock,
so that the time other processes take the cores from it does not count (it still counts
their load on the caches and on memory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "ort_models/kernels"

WRAPPER = r"""
#define _POSIX_C_SOURCE 199309L
#include "gguf_matmul.c"
#include <pthread.h>
#include <time.h>
typedef struct {
  const uint8_t *w;
  size_t g0, g1, gb, nb;
  const Act *a;
  size_t m;
  GroupFn fn;
  double cpu; /* seconds of CPU time the thread spent on its part */
} Part;
static double seconds(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}
static void *run_part(void *p) {
  Part *t = (Part *)p;
  float acc[ROW_TILE][GROUP];
  const double t0 = seconds(CLOCK_THREAD_CPUTIME_ID);
  for (size_t g = t->g0; g < t->g1; g++) {
    memset(acc, 0, sizeof acc);
    t->fn(t->w + g * t->gb, t->nb, t->a, 0, t->m, acc);
  }
  t->cpu = seconds(CLOCK_THREAD_CPUTIME_ID) - t0;
  return NULL;
}
/* type 0 Q4_K, 1 Q6_K, 2 Q4_0, 3 Q4_1 (k a multiple of 256): this build's group function,
   the units of K it takes and the bytes of a row group of 16 */
static GroupFn layout(int type, size_t k, size_t *nb, size_t *gb) {
  *nb = k / QK_K;
#ifdef HAS_Q4_LEGACY
  if (type == 2 || type == 3) {
    *nb = k / 32;
    *gb = *nb * (type == 2 ? Q4_0_BLOCK_BYTES : Q4_1_BLOCK_BYTES);
    return type == 2 ? group_q4_0 : group_q4_1;
  }
#endif
  *gb = *nb * (type == 1 ? Q6_K_GROUP_BYTES : Q4_K_GROUP_BYTES);
  return type == 1 ? group_q6_k : group_q4_k;
}
/* bytes of an [n, k] matrix in this build's layout */
size_t SIDE_matrix_bytes(int type, size_t n, size_t k) {
  size_t nb, gb;
  layout(type, k, &nb, &gb);
  return (n + GROUP - 1) / GROUP * gb;
}
/* seconds for one [m, k] x [n, k]^T product over `threads` threads: wall-clock, or (cpu)
   the most CPU time one of the threads spent */
double SIDE_matmul(int type, size_t m, size_t n, size_t k, const uint8_t *w, const int8_t *q,
                   const float *d, const int16_t *s16, const int16_t *s32, int threads,
                   int cpu) {
  Act a;
  memset(&a, 0, sizeof a);
  a.k = k; a.q = (int8_t *)q; a.d = (float *)d; a.sum16 = (int16_t *)s16; a.sum32 = (int16_t *)s32;
  size_t nb, gb;
  const GroupFn fn = layout(type, k, &nb, &gb);
  const size_t groups = (n + GROUP - 1) / GROUP;
  Part parts[16];
  pthread_t th[16];
  const double t0 = seconds(CLOCK_MONOTONIC);
  for (int t = 0; t < threads; t++) {
    parts[t] = (Part){w, groups * t / threads, groups * (t + 1) / threads, gb, nb, &a, m, fn, 0};
    pthread_create(&th[t], NULL, run_part, &parts[t]);
  }
  double most = 0;
  for (int t = 0; t < threads; t++) {
    pthread_join(th[t], NULL);
    most = parts[t].cpu > most ? parts[t].cpu : most;
  }
  return cpu ? most : seconds(CLOCK_MONOTONIC) - t0;
}
/* quantize_row of this build (the activations both sides read) */
void SIDE_quantize(const float *x, size_t k, int8_t *q, float *d, int16_t *s16, int16_t *s32) {
  quantize_row(x, k, k, q, d, s16, s32);
}
"""

STUBS = r"""
#include "specd_ops.h"
#include <string.h>
const OrtApi *g_api;
OrtStatus *specd_new_state(const void *s, size_t n, void **k) {
  (void)s; (void)n; (void)k; return 0;
}
OrtStatus *specd_tensor_shape(const OrtValue *v, int64_t *d, size_t *r) {
  (void)v; (void)d; (void)r; return 0;
}
OrtStatus *specd_fail(const char *m) { (void)m; return 0; }
float specd_f16_to_f32(const void *p) { unsigned short h; memcpy(&h, p, 2); return (float)h; }
int64_t specd_int64_attribute_or(const OrtApi *api, const OrtKernelInfo *info, const char *name,
                                 int64_t fallback) {
  (void)api; (void)info; (void)name; return fallback;
}
void specd_swiglu_row(const float *g, const float *u, float *y, size_t n) {
  (void)g; (void)u; (void)y; (void)n;
}
/* the harness runs its own threads over group_*; compute() is never called */
void specd_parallel_for(void (*fn)(void *, size_t), void *data, size_t n) {
  for (size_t t = 0; t < n; t++) fn(data, t);
}
"""

MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef double (*Mm)(int, size_t, size_t, size_t, const uint8_t *, const int8_t *, const float *,
                     const int16_t *, const int16_t *, int, int);
double base_matmul(int, size_t, size_t, size_t, const uint8_t *, const int8_t *, const float *,
                   const int16_t *, const int16_t *, int, int);
double work_matmul(int, size_t, size_t, size_t, const uint8_t *, const int8_t *, const float *,
                   const int16_t *, const int16_t *, int, int);
void work_quantize(const float *, size_t, int8_t *, float *, int16_t *, int16_t *);
size_t base_matrix_bytes(int, size_t, size_t);
size_t work_matrix_bytes(int, size_t, size_t);
static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
int main(int argc, char **argv) {
  const int type = atoi(argv[1]), repeats = atoi(argv[5]), threads = atoi(argv[6]);
  const int hot = atoi(argv[7]), cpu = atoi(argv[8]);
  const size_t k = (size_t)atol(argv[2]), n = (size_t)atol(argv[3]), m = (size_t)atol(argv[4]);
  /* each copy holds either build's matrix (their layouts may differ in size) */
  const size_t base_bytes = base_matrix_bytes(type, n, k);
  const size_t work_bytes = work_matrix_bytes(type, n, k);
  const size_t mat = base_bytes > work_bytes ? base_bytes : work_bytes;
  /* streamed: enough copies to pass the caches; hot: one copy, called `calls` times */
  const size_t copies = hot ? 1 : (512u << 20) / mat + 1, calls = hot ? 64 : copies;
  uint8_t *w = malloc(copies * mat);
  for (size_t i = 0; i < copies * mat; i++) w[i] = (uint8_t)((i * 2654435761u) >> 13);
  int8_t *q = malloc(m * k);
  float *x = malloc(m * k * sizeof(float)), *d = malloc(m * (k / 256) * sizeof(float));
  int16_t *s16 = malloc(m * (k / 16) * 2), *s32 = malloc(m * (k / 32) * 2);
  for (size_t i = 0; i < m * k; i++) x[i] = (float)((i * 13) % 17) - 8.0f;
  for (size_t r = 0; r < m; r++)
    work_quantize(x + r * k, k, q + r * k, d + r * (k / 256), s16 + r * (k / 16),
                  s32 + r * (k / 32));
  const Mm side[2] = {base_matmul, work_matmul};
  double *t[2] = {malloc(repeats * sizeof(double)), malloc(repeats * sizeof(double))};
  for (int r = -1; r < repeats; r++)  /* a first round warms up */
    for (int s = 0; s < 2; s++) {
      double sum = 0;
      for (size_t c = 0; c < calls; c++)
        sum += side[s](type, m, n, k, w + c % copies * mat, q, d, s16, s32, threads, cpu);
      if (r >= 0) t[s][r] = sum / calls;
    }
  for (int s = 0; s < 2; s++) qsort(t[s], repeats, sizeof(double), by_value);
  /* medians, then minima */
  printf("%.4f %.4f %.4f %.4f\n", t[0][repeats / 2] * 1e3, t[1][repeats / 2] * 1e3,
         t[0][0] * 1e3, t[1][0] * 1e3);
  return 0;
}
"""

TYPES = ("Q4_K", "Q6_K", "Q4_0", "Q4_1")  # the harness's type numbers
FLAGS = ["-O3", "-std=c11", "-march=native", "-ffp-contract=off", "-fno-math-errno"]


def sources(rev: str | None, out: Path) -> None:
    """The kernel sources at `rev` (None: the working tree) into `out`."""
    out.mkdir(parents=True)
    if rev is None:
        names = [p.name for p in (ROOT / KERNELS).iterdir()]
    else:
        names = [Path(p).name for p in subprocess.run(
            ["git", "ls-tree", "--name-only", rev, f"{KERNELS}/"], cwd=ROOT, check=True,
            capture_output=True, text=True).stdout.split()]
    for name in ["gguf_matmul.c", *(n for n in names if n.endswith(".h"))]:  # and its headers
        path = f"{KERNELS}/{name}"
        text = ((ROOT / path).read_text() if rev is None else subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
            text=True).stdout)
        (out / name).write_text(text)


def build(base: str, tmp: Path, cflags: tuple[str, ...] = ()) -> Path:
    cc = os.environ.get("CC", "cc")
    flags = [*FLAGS, *cflags]
    objs = []
    for side, rev in (("base", base), ("work", None)):
        src = tmp / side
        sources(rev, src)
        (src / "wrap.c").write_text(WRAPPER.replace("SIDE_", f"{side}_"))
        obj = tmp / f"{side}.o"
        # each build's op table gets its own name; nothing else of it is global. Q4_0 /
        # Q4_1 only where the revision has them (a side without times Q4_K in their place)
        legacy = ["-DHAS_Q4_LEGACY"] if (src / "gguf_legacy.h").exists() else []
        subprocess.run([cc, *flags, *legacy, f"-Dspecd_gguf_matmul={side}_op", "-c",
                        str(src / "wrap.c"), "-o", str(obj)], check=True)
        objs.append(str(obj))
    (tmp / "stubs.c").write_text(STUBS)
    (tmp / "main.c").write_text(MAIN)
    exe = tmp / "kernel_ab"
    subprocess.run([cc, *flags, "-I", str(tmp / "work"), str(tmp / "stubs.c"), str(tmp / "main.c"),
                    *objs, "-o", str(exe), "-lpthread", "-lm"], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--shapes", default="1536x8960,8960x1536", help="KxN, comma-separated")
    ap.add_argument("--types", default="Q4_K,Q6_K", help=f"of {','.join(TYPES)}")
    ap.add_argument("--sizes", default="1,4,5,8", help="rows M of the activations")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot", action="store_true",
                    help="the same matrix over and over, in the caches: arithmetic only")
    ap.add_argument("--cpu-time", action="store_true",
                    help="a call's time: its busiest thread's CPU time, not the wall clock")
    ap.add_argument("--min", action="store_true",
                    help="each build's fastest round instead of the median")
    ap.add_argument("--cflags", default="",
                    help="more compiler flags for both builds, space-separated")
    args = ap.parse_args()
    cflags = tuple(args.cflags.split())
    with tempfile.TemporaryDirectory() as d:
        exe = build(args.base, Path(d), cflags)
        where = "hot in the caches" if args.hot else "streamed from memory"
        extra = f", {' '.join(cflags)}" if cflags else ""
        stat = "minima" if args.min else "medians"
        if args.cpu_time:
            stat = f"CPU time (busiest thread), {stat}"
        print(f"GgufMatMul groups, {args.base} (base) against the working tree (work), "
              f"{args.threads} threads, {where}{extra}, {stat} of {args.repeats} "
              "interleaved rounds\n")
        print("| type | K×N | M | base ms | work ms | work / base |")
        print("|---|---|---|---|---|---|")
        for type_name in args.types.split(","):
            for shape in args.shapes.split(","):
                k, n = shape.split("x")
                for m in args.sizes.split(","):
                    out = subprocess.run([str(exe), str(TYPES.index(type_name)), k, n, m,
                                          str(args.repeats), str(args.threads),
                                          str(int(args.hot)), str(int(args.cpu_time))],
                                         check=True, capture_output=True, text=True).stdout
                    med_base, med_work, min_base, min_work = map(float, out.split())
                    base, work = (min_base, min_work) if args.min else (med_base, med_work)
                    print(f"| {type_name} | {k}×{n} | {m} | {base:.3f} | {work:.3f} | "
                          f"{work / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
