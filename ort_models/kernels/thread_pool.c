/* The kernels' own workers: a parallel-for whose idle workers spin briefly, then sleep.
 *
 * ONNX Runtime's intra-op pool either spins all the time a run lasts (which loses badly
 * when other programs share the cores) or puts its workers to sleep after every parallel
 * section; on a virtual machine waking a sleeping core then costs about as long as a
 * small matrix product takes (a chain of 1536 x 1536 Q4_K products: 57.7 us each on one
 * thread, 64.5 us on two with ORT's sleeping worker, 49.3 us on this pool's two). Here a
 * worker spins for SPIN_NS after its last task, which covers the gaps between one
 * forward pass's kernels, and sleeps in the gaps between passes.
 *
 * A job's n tasks are split into one contiguous run per thread, the caller's first. Each
 * thread claims tasks from the front of its own run, about 1/16 of it at a time, and
 * when its run is empty takes tasks from the back of the others' runs, in claims of the
 * same size. So each thread streams its share of a matrix's rows in order (a product's
 * tasks are consecutive row groups), and a worker still asleep, or paused by the system,
 * holds up no more than the claim it is running: the others take the rest of its run.
 * (One shared run claimed in turns gave each thread a stream broken at every claim:
 * in-engine, 2 threads, steps of the 0.5B draft took 1.03-1.04x the time, the 1.5B's
 * single-token and 4-row steps 1.02-1.04x; with a busy process beside them, even.)
 * Each run's claim word holds (generation, front, back), each on its own cache line, so a
 * claim can only succeed while its job is live, and the job's function and data do not
 * change until every claimed task is done.
 *
 * Waiting, the caller and the workers yield their core every 64 pauses: with another
 * program busy on the cores, a worker paused by the system holding a claim then gets a
 * core back soon (measured with one busy process beside the 0.5B and 1.5B models: within
 * 0.85-1.2x of ONNX Runtime's pool, about even on average; without the yields 1.1-1.8x).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "specd_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

enum { MAX_WORKERS = 63, IDX_BITS = 20, GEN_SHIFT = 2 * IDX_BITS };
#define SPIN_NS 150000L /* spin this long after a job before sleeping */
#define IDX_MASK ((UINT64_C(1) << IDX_BITS) - 1)

/* a thread's run of the live job's tasks */
typedef struct {
  _Alignas(64) _Atomic uint64_t word; /* generation << 40 | front << 20 | back */
} Run;

static struct {
  Run run[MAX_WORKERS + 1];                /* run i: the caller's (0) or worker i's */
  _Alignas(64) _Atomic uint32_t published; /* the generation workers wait for */
  _Alignas(64) _Atomic size_t done;        /* tasks of the live job finished */
  _Alignas(64) _Atomic size_t per_claim;   /* tasks taken per claim */
  _Atomic int runs; /* threads the live job is split over (a late worker may read it) */
  uint32_t generation;                     /* the last job's (the caller's counter) */
  _Atomic int sleepers;
  _Atomic int busy; /* a job is live: a concurrent caller runs its tasks alone */
  void (*fn)(void *, size_t);
  void *data;
  _Atomic int wanted, started; /* workers asked for, running */
  pthread_mutex_t mu;
  pthread_cond_t cv;
} g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* up to per_claim tasks [*t0, *t1) of run r in generation gen: from its front (its own
   thread) or from its back (a thread done with its own run); 0 when none is left */
static int claim(int r, uint32_t gen, int from_back, uint64_t *t0, uint64_t *t1) {
  _Atomic uint64_t *word = &g_pool.run[r].word;
  uint64_t s = atomic_load(word);
  for (;;) {
    if ((uint32_t)(s >> GEN_SHIFT) != gen) return 0;
    const uint64_t front = (s >> IDX_BITS) & IDX_MASK, back = s & IDX_MASK;
    if (front >= back) return 0;
    const uint64_t per = atomic_load_explicit(&g_pool.per_claim, memory_order_relaxed);
    const uint64_t take = back - front < per ? back - front : per;
    if (atomic_compare_exchange_weak(word, &s, from_back ? s - take : s + (take << IDX_BITS))) {
      *t0 = from_back ? back - take : front;
      *t1 = *t0 + take;
      return 1;
    }
  }
}

/* thread `me`'s run of generation `gen`, then whatever the other runs still hold */
static void run_claims(uint32_t gen, int me) {
  const int runs = atomic_load_explicit(&g_pool.runs, memory_order_relaxed);
  if (me >= runs) return; /* started after the job was split */
  uint64_t t0, t1;
  for (int k = 0; k < runs; k++) {
    const int r = (me + k) % runs;
    while (claim(r, gen, k != 0, &t0, &t1)) {
      for (uint64_t t = t0; t < t1; t++) g_pool.fn(g_pool.data, (size_t)t);
      atomic_fetch_add(&g_pool.done, (size_t)(t1 - t0));
    }
  }
}

static void *worker(void *arg) {
  const int me = (int)(intptr_t)arg; /* its run: 1, 2, ... */
  uint32_t seen = atomic_load(&g_pool.published);
  for (;;) {
    uint32_t gen = atomic_load(&g_pool.published);
    const int64_t t0 = now_ns();
    for (int spin = 0; gen == seen; gen = atomic_load(&g_pool.published)) {
      CPU_RELAX();
      if (++spin % 64) continue;
      sched_yield(); /* a program sharing the cores gets them back at once */
      if (now_ns() - t0 < SPIN_NS) continue;
      pthread_mutex_lock(&g_pool.mu);
      atomic_fetch_add(&g_pool.sleepers, 1);
      while ((gen = atomic_load(&g_pool.published)) == seen)
        pthread_cond_wait(&g_pool.cv, &g_pool.mu);
      atomic_fetch_sub(&g_pool.sleepers, 1);
      pthread_mutex_unlock(&g_pool.mu);
    }
    seen = gen;
    run_claims(gen, me);
  }
  return NULL;
}

static void start_workers(void) {
  pthread_mutex_lock(&g_pool.mu);
  while (g_pool.started < g_pool.wanted) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const int failed =
        pthread_create(&t, &attr, worker, (void *)(intptr_t)(g_pool.started + 1));
    pthread_attr_destroy(&attr);
    if (failed) break; /* fewer workers: the caller takes what they do not claim */
    g_pool.started++;
  }
  pthread_mutex_unlock(&g_pool.mu);
}

/* after fork() the child has no workers: start afresh */
static void forget_workers(void) {
  g_pool.started = 0;
  atomic_store(&g_pool.sleepers, 0);
  atomic_store(&g_pool.busy, 0);
  pthread_mutex_init(&g_pool.mu, NULL);
  pthread_cond_init(&g_pool.cv, NULL);
}

/* Threads the kernels run on, the caller included (the largest any session asked for;
 * exported for native_ops.register). */
void specd_set_threads(int threads) {
  static int atfork_done;
  pthread_mutex_lock(&g_pool.mu);
  if (!atfork_done) atfork_done = !pthread_atfork(NULL, NULL, forget_workers);
  int w = threads - 1;
  if (w > MAX_WORKERS) w = MAX_WORKERS;
  if (w > g_pool.wanted) g_pool.wanted = w;
  pthread_mutex_unlock(&g_pool.mu);
}

void specd_parallel_for(void (*fn)(void *, size_t), void *data, size_t n) {
  if (n == 0) return;
  if (n == 1 || g_pool.wanted == 0 || n > IDX_MASK || atomic_exchange(&g_pool.busy, 1)) {
    for (size_t t = 0; t < n; t++) fn(data, t);
    return;
  }
  if (g_pool.started < g_pool.wanted) start_workers();
  g_pool.fn = fn;
  g_pool.data = data;
  const int runs = g_pool.started + 1; /* workers that failed to start take no run */
  atomic_store_explicit(&g_pool.runs, runs, memory_order_relaxed);
  /* about 16 claims per run: few atomic operations, and a worker the system pauses
     holds up little */
  const size_t per = (n / (size_t)runs + 15) / 16;
  atomic_store_explicit(&g_pool.per_claim, per ? per : 1, memory_order_relaxed);
  atomic_store(&g_pool.done, 0);
  const uint32_t gen = g_pool.generation = (g_pool.generation + 1) & 0xFFFFFF;
  for (int r = 0; r < runs; r++) {
    const uint64_t front = n * (size_t)r / (size_t)runs, back = n * (size_t)(r + 1) / (size_t)runs;
    atomic_store(&g_pool.run[r].word, ((uint64_t)gen << GEN_SHIFT) | (front << IDX_BITS) | back);
  }
  atomic_store(&g_pool.published, gen);
  if (atomic_load(&g_pool.sleepers) > 0) {
    pthread_mutex_lock(&g_pool.mu);
    pthread_cond_broadcast(&g_pool.cv);
    pthread_mutex_unlock(&g_pool.mu);
  }
  run_claims(gen, 0);
  /* tasks workers claimed and run: a worker the system paused finishes sooner when the
     caller yields its core */
  for (int spin = 0; atomic_load(&g_pool.done) < n;)
    if (++spin % 64) CPU_RELAX(); else sched_yield();
  atomic_store(&g_pool.busy, 0);
}

/* Threads a parallel-for may run on, the caller included: what specd_set_threads asked
 * (SampleTokens splits a row's passes only where there is more than one). */
int specd_pool_threads(void) { return atomic_load(&g_pool.wanted) + 1; }

/* Workers running (for tests and benchmarks). */
int specd_pool_workers(void) { return atomic_load(&g_pool.started); }
