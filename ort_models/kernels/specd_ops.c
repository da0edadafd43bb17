/* The "specd" custom-op domain for ONNX Runtime: registration and the OrtCustomOp glue
 * shared by every op (one SpecdOpDef per op, see specd_ops.h). */
#include "specd_ops.h"

#include <stdlib.h>
#include <string.h>

const OrtApi *g_api;

/* 1 where the kernels were built with their vector paths (AVX2), 0 for plain C: the
 * plain paths give the same bits but run slower than ONNX Runtime's own ops. */
int specd_kernels_vectorized(void) {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

float specd_f16_to_f32(const void *ptr) {
  const uint8_t *p = (const uint8_t *)ptr;
  uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { /* subnormal half: normalise */
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      exp--;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

OrtStatus *specd_fail(const char *msg) { return g_api->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

OrtStatus *specd_new_state(const void *state, size_t size, void **out) {
  void *p = malloc(size);
  if (!p) return g_api->CreateStatus(ORT_FAIL, "specd op: out of memory");
  memcpy(p, state, size);
  *out = p;
  return NULL;
}

OrtStatus *specd_create_stateless(const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  (void)api;
  (void)info;
  static const char none = 0;
  return specd_new_state(&none, 1, kernel);
}

int64_t specd_int64_attribute_or(const OrtApi *api, const OrtKernelInfo *info, const char *name,
                                 int64_t fallback) {
  int64_t v;
  OrtStatus *absent = api->KernelInfoGetAttribute_int64(info, name, &v);
  if (!absent) return v;
  api->ReleaseStatus(absent);
  return fallback;
}

OrtStatus *specd_tensor_shape(const OrtValue *v, int64_t *dims, size_t *rank) {
  OrtTensorTypeAndShapeInfo *info;
  CHECK(g_api->GetTensorTypeAndShape(v, &info));
  OrtStatus *st = g_api->GetDimensionsCount(info, rank);
  if (!st && *rank > 8) st = specd_fail("specd op: input rank above 8");
  if (!st) st = g_api->GetDimensions(info, dims, *rank);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

/* OrtCustomOp first, so that ORT's op pointer leads back to the definition */
typedef struct {
  OrtCustomOp op;
  const SpecdOpDef *def;
} Op;

static const SpecdOpDef *def_of(const OrtCustomOp *op) { return ((const Op *)op)->def; }

static const char *ORT_API_CALL op_name(const OrtCustomOp *op) { return def_of(op)->name; }
static const char *ORT_API_CALL op_provider(const OrtCustomOp *op) {
  (void)op;
  return "CPUExecutionProvider";
}
static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
  return i < def_of(op)->n_inputs ? def_of(op)->input_types[i]
                                  : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static size_t ORT_API_CALL input_count(const OrtCustomOp *op) { return def_of(op)->n_inputs; }
static ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp *op, size_t i) {
  const SpecdOpDef *def = def_of(op);
  if (!def->n_outputs) return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                                     : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  return i < def->n_outputs ? def->output_types[i] : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static size_t ORT_API_CALL output_count(const OrtCustomOp *op) {
  return def_of(op)->n_outputs ? def_of(op)->n_outputs : 1;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_required(const OrtCustomOp *op,
                                                                         size_t i) {
  const size_t req = def_of(op)->n_outputs_required;
  return req && i >= req ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_required(const OrtCustomOp *op,
                                                                        size_t i) {
  const size_t req = def_of(op)->n_required;
  return req && i >= req ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ORT_API_CALL input_mem(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return OrtMemTypeDefault;
}
static int ORT_API_CALL one(const OrtCustomOp *op) {
  (void)op;
  return 1;
}
static int ORT_API_CALL end_version(const OrtCustomOp *op) {
  (void)op;
  return 2147483647;
}

/* which definition a kernel belongs to travels in a small header before its state */
typedef struct {
  const SpecdOpDef *def;
  void *state;
} Kernel;

static OrtStatus *ORT_API_CALL create_any(const OrtCustomOp *op, const OrtApi *api,
                                          const OrtKernelInfo *info, void **kernel) {
  Kernel *k = (Kernel *)malloc(sizeof *k);
  if (!k) return api->CreateStatus(ORT_FAIL, "specd op: out of memory");
  k->def = def_of(op);
  OrtStatus *st = k->def->create(api, info, &k->state);
  if (st) {
    free(k);
    return st;
  }
  *kernel = k;
  return NULL;
}

static OrtStatus *ORT_API_CALL compute_kernel(void *kernel, OrtKernelContext *ctx) {
  Kernel *k = (Kernel *)kernel;
  return k->def->compute(k->state, ctx);
}

static void ORT_API_CALL destroy_any(void *kernel) {
  Kernel *k = (Kernel *)kernel;
  if (k) free(k->state);
  free(k);
}

static const SpecdOpDef *const DEFS[] = {&specd_gguf_matmul, &specd_causal_attention,
                                          &specd_causal_attention_f16, &specd_cached_attention,
                                          &specd_cached_attention_f16, &specd_swiglu,
                                          &specd_sample_tokens, &specd_token_logprobs,
                                          &specd_gguf_experts, &specd_moe_router};
enum { N_OPS = sizeof DEFS / sizeof DEFS[0] };
static Op g_ops[N_OPS];
static OrtCustomOpDomain *g_domain;

/* The entry point SessionOptions.register_custom_ops_library looks up. */
OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  g_api = base->GetApi(SPECD_ORT_API_VERSION);
  if (!g_api) { /* the first slots are the same in every version */
    const OrtApi *v1 = base->GetApi(1);
    return v1 ? v1->CreateStatus(ORT_FAIL, "specd kernels need ONNX Runtime 1.17 or newer")
              : NULL;
  }
  if (!g_domain) {
    OrtCustomOpDomain *domain;
    CHECK(g_api->CreateCustomOpDomain("specd", &domain));
    for (int i = 0; i < N_OPS; i++) {
      OrtCustomOp *op = &g_ops[i].op;
      memset(op, 0, sizeof *op);
      g_ops[i].def = DEFS[i];
      op->version = SPECD_ORT_API_VERSION;
      op->GetName = op_name;
      op->GetExecutionProviderType = op_provider;
      op->GetInputType = input_type;
      op->GetInputTypeCount = input_count;
      op->GetOutputType = output_type;
      op->GetOutputTypeCount = output_count;
      op->KernelDestroy = destroy_any;
      op->GetInputCharacteristic = input_required;
      op->GetOutputCharacteristic = output_required;
      op->GetInputMemoryType = input_mem;
      op->GetVariadicInputMinArity = one;
      op->GetVariadicInputHomogeneity = one;
      op->GetVariadicOutputMinArity = one;
      op->GetVariadicOutputHomogeneity = one;
      op->CreateKernelV2 = create_any;
      op->KernelComputeV2 = compute_kernel;
      op->GetStartVersion = one;
      op->GetEndVersion = end_version;
      CHECK(g_api->CustomOpDomain_Add(domain, op));
    }
    g_domain = domain;
  }
  return g_api->AddCustomOpDomain(options, g_domain);
}
