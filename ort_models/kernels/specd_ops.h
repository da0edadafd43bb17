/* What specd's custom-op sources share: the ORT API table, errors, shapes, op definitions. */
#ifndef SPECD_OPS_H
#define SPECD_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "ort_api_subset.h"

/* The C API version the kernels need (KernelContext_ParallelFor): ORT 1.17 and newer. */
#define SPECD_ORT_API_VERSION ORT_API_VERSION_SUBSET_MIN

extern const OrtApi *g_api;

/* An IEEE half (2 bytes, little-endian, at p) as float32: exact. */
float specd_f16_to_f32(const void *p);
/* An ORT_INVALID_ARGUMENT status carrying `msg`. */
OrtStatus *specd_fail(const char *msg);
/* *out = a heap copy of the `size` bytes at `state` (a kernel's attributes; freed by the
 * glue when ORT destroys the kernel). */
OrtStatus *specd_new_state(const void *state, size_t size, void **out);
/* A kernel with no attributes: a placeholder state (its `create`). */
OrtStatus *specd_create_stateless(const OrtApi *api, const OrtKernelInfo *info, void **kernel);
/* The int64 attribute `name`, or `fallback` where the node does not set it. */
int64_t specd_int64_attribute_or(const OrtApi *api, const OrtKernelInfo *info, const char *name,
                                 int64_t fallback);
/* dims[0..rank) of a tensor (rank <= 8). */
OrtStatus *specd_tensor_shape(const OrtValue *v, int64_t *dims, size_t *rank);

/* fn(data, t) for t in [0, n), on the calling thread and the kernels' workers
 * (thread_pool.c); returns when every task is done. */
void specd_parallel_for(void (*fn)(void *, size_t), void *data, size_t n);
/* The threads specd_parallel_for may run on, the caller included (thread_pool.c). */
int specd_pool_threads(void);

/* y[i] = silu(g[i]) * u[i] for i < n: SwiGlu's arithmetic (swiglu.c), the same bits
 * on every path and at every offset. */
void specd_swiglu_row(const float *g, const float *u, float *y, size_t n);

/* sum_i w[i] * x[i], i < n, in a fixed order (moe_router.c): 8 lanes over the values in
 * order, lane l += w * x (no FMA), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
float specd_dot_f32(const float *w, const float *x, size_t n);

#define CHECK(expr)          \
  do {                       \
    OrtStatus *st_ = (expr); \
    if (st_) return st_;     \
  } while (0)

/* One op of the "specd" domain: float32 output 0, inputs of the given types. */
typedef struct {
  const char *name;
  size_t n_inputs;
  const ONNXTensorElementDataType *input_types;
  OrtStatus *(*create)(const OrtApi *api, const OrtKernelInfo *info, void **kernel);
  OrtStatus *(*compute)(void *kernel, OrtKernelContext *ctx); /* kernel is freed with free() */
  size_t n_outputs;                                /* 0: one float32 output */
  const ONNXTensorElementDataType *output_types;
  size_t n_required; /* 0: every input required; else inputs from this one on optional */
  size_t n_outputs_required; /* 0: every output required; else outputs from this one on optional */
} SpecdOpDef;

extern const SpecdOpDef specd_gguf_matmul;
extern const SpecdOpDef specd_causal_attention;
extern const SpecdOpDef specd_causal_attention_f16;
extern const SpecdOpDef specd_cached_attention;
extern const SpecdOpDef specd_cached_attention_f16;
extern const SpecdOpDef specd_swiglu;
extern const SpecdOpDef specd_sample_tokens;
extern const SpecdOpDef specd_token_logprobs;
extern const SpecdOpDef specd_gguf_experts;
extern const SpecdOpDef specd_moe_router;

#endif
