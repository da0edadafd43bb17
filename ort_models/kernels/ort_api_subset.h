/*
 * ort_api_subset.h -- minimal hand-written C declarations of the ONNX Runtime C API
 * needed by the custom-op shared library in this folder.
 *
 * This file is a TRANSCRIPTION OF A SUBSET of ONNX Runtime's public header
 *   include/onnxruntime/core/session/onnxruntime_c_api.h
 * from https://github.com/microsoft/onnxruntime
 *   Copyright (c) Microsoft Corporation. All rights reserved.
 *   Licensed under the MIT License.
 * (The onnxruntime Python wheel ships no C headers, so the few declarations we
 * need are transcribed here instead of vendoring the 370 kB original.)
 *
 * Source read:
 *   - onnxruntime_c_api.h with `#define ORT_API_VERSION 24` (ORT 1.24 line, main-branch
 *     text; its OrtApi ends ...RunOptionsSetSyncStream, GetTensorElementTypeAndShapeDataReference).
 *     Read in full from a stored copy in a code-search index; that index did not
 *     report the exact commit of this copy.
 *   - Cross-checked slot by slot against the OrtApi initializer `ort_api_1_to_25` and its
 *     static_asserts in onnxruntime/core/session/onnxruntime_c_api.cc at
 *     microsoft/onnxruntime@003d03582b884c750c3b8832dde0a9a9cd1c7670 (ORT_VERSION "1.25.0").
 *     The 275 names CreateStatus .. KernelContext_ParallelFor match the header, in order, one for one.
 *   - Runtime-checked: a probe custom op built against this header, which calls every typed
 *     OrtApi member, gave exact results in the onnxruntime 1.22.0 and 1.30.0 Python wheels.
 *
 * LAYOUT RULE: struct OrtApi below lists EVERY member of the real OrtApi, in the header's
 * order, from slot 0 (CreateStatus) through slot 275
 * (SessionOptionsAppendExecutionProvider_OpenVINO_V2, the last member of API version 17),
 * so each slot index matches the real ABI. ORT keeps OrtApi append-only: members are
 * never removed or reordered after a version ships (see the "Rules on how to add a new
 * Ort API version" comment in onnxruntime_c_api.cc). So a prefix of the struct is
 * ABI-correct for every runtime whose API version is >= 17.
 * Members we call have their real function-pointer type. Every other member is a
 * `void*` placeholder. Each member, including ORT_CLASS_RELEASE(X) (member ReleaseX),
 * non-status members (GetErrorCode, GetErrorMessage, ClearBoundInputs,
 * GetTrainingApi, GetBuildInfoString, ...) and deprecated members (RegisterCustomOpsLibrary, CreateArenaCfg),
 * takes exactly one pointer-sized slot. OrtApi contains no #ifdef-guarded members.
 * Never instantiate OrtApi; only use the pointer returned by OrtApiBase::GetApi.
 *
 * Entry point: ORT's RegisterCustomOpsLibrary / RegisterCustomOpsLibrary_V2 (which the
 * Python SessionOptions.register_custom_ops_library calls) dlopen()s the library and
 * looks up the symbol "RegisterCustomOps" with type RegisterCustomOpsFn:
 *     OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api);
 * It returns NULL on success, or an OrtStatus created with api->GetApi(..)->CreateStatus.
 * The library defines and exports that function itself; it is not declared here.
 */
#ifndef ORT_MODELS_KERNELS_ORT_API_SUBSET_H
#define ORT_MODELS_KERNELS_ORT_API_SUBSET_H

#ifdef ORT_API_VERSION
#error "ort_api_subset.h must not be mixed with the real onnxruntime_c_api.h"
#endif

#include <stddef.h>
#include <stdint.h>

/* ORT_API_VERSION of the header transcribed. Slots only need API >= 17, so a library
 * should pass ORT_API_VERSION_SUBSET_MIN, not this value, to GetApi() and
 * OrtCustomOp.version: GetApi(N) returns NULL (and prints an error) on a runtime older
 * than N, and a custom op whose .version is above the runtime's API version is
 * rejected at kernel creation. */
#define ORT_API_VERSION_SUBSET 24
/* Lowest API version whose OrtApi has every typed member below
 * (KernelContext_ParallelFor, slot 274, appeared in API 17 / ORT 1.17). */
#define ORT_API_VERSION_SUBSET_MIN 17

#ifdef __cplusplus
extern "C" {
#endif

/* ---- calling convention / decoration macros, as in onnxruntime_c_api.h ---- */
#ifdef _WIN32
#define ORT_API_CALL __stdcall
#define ORT_MUST_USE_RESULT
#else
#define ORT_API_CALL
#define ORT_MUST_USE_RESULT __attribute__((warn_unused_result))
#endif

#ifdef __cplusplus
#define NO_EXCEPTION noexcept
#else
#define NO_EXCEPTION
#endif

/* SAL annotations (_In_, _Out_, _Inout_, _Outptr_, _Frees_ptr_opt_ ...) are dropped in this
 * transcription. They expand to nothing on non-MSVC compilers anyway. */

/* ORT_API2_STATUS(NAME, ...) declares one OrtApi member: a function pointer returning OrtStatusPtr. */
#define ORT_API2_STATUS(NAME, ...) \
  OrtStatusPtr(ORT_API_CALL* NAME)(__VA_ARGS__) NO_EXCEPTION ORT_MUST_USE_RESULT
/* ORT_CLASS_RELEASE(X) declares the member `ReleaseX`: void (*)(OrtX*). */
#define ORT_CLASS_RELEASE(X) void(ORT_API_CALL * Release##X)(Ort##X * input)

/* ---- enums (exact values from the header) ---- */

/* Copied from TensorProto::DataType */
typedef enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,     /* float    */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,     /* uint8_t  */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 = 3,      /* int8_t   */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16 = 4,    /* uint16_t */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16 = 5,     /* int16_t  */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 = 6,     /* int32_t  */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,     /* int64_t  */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING = 8,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL = 9,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE = 11,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32 = 12,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64 = 13,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX64 = 14,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX128 = 15,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 = 16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN = 17,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FNUZ = 18,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2 = 19,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2FNUZ = 20,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT4 = 21,    /* 2 packed uint4 per byte */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4 = 22,     /* 2 packed int4 per byte  */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT4E2M1 = 23,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT2 = 24,    /* newest (ONNX 1.20); unknown to older runtimes */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT2 = 25
} ONNXTensorElementDataType;

typedef enum OrtErrorCode {
  ORT_OK = 0,
  ORT_FAIL = 1,
  ORT_INVALID_ARGUMENT = 2,
  ORT_NO_SUCHFILE = 3,
  ORT_NO_MODEL = 4,
  ORT_ENGINE_ERROR = 5,
  ORT_RUNTIME_EXCEPTION = 6,
  ORT_INVALID_PROTOBUF = 7,
  ORT_MODEL_LOADED = 8,
  ORT_NOT_IMPLEMENTED = 9,
  ORT_INVALID_GRAPH = 10,
  ORT_EP_FAIL = 11,
  ORT_MODEL_LOAD_CANCELED = 12,
  ORT_MODEL_REQUIRES_COMPILATION = 13,
  ORT_NOT_FOUND = 14
} OrtErrorCode;

/* Memory types for allocated memory (used by OrtCustomOp::GetInputMemoryType). */
typedef enum OrtMemType {
  OrtMemTypeCPUInput = -2,
  OrtMemTypeCPUOutput = -1,
  OrtMemTypeCPU = OrtMemTypeCPUOutput,
  OrtMemTypeDefault = 0
} OrtMemType;

/* Characteristics of custom-op inputs/outputs. Only the last input/output may be variadic. */
typedef enum OrtCustomOpInputOutputCharacteristic {
  INPUT_OUTPUT_REQUIRED = 0,
  INPUT_OUTPUT_OPTIONAL = 1,
  INPUT_OUTPUT_VARIADIC = 2
} OrtCustomOpInputOutputCharacteristic;

/* ---- opaque types (ORT_RUNTIME_CLASS(X) in the header) ---- */
typedef struct OrtStatus OrtStatus; /* NULL OrtStatus* means success */
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtCustomOp OrtCustomOp;
typedef struct OrtApi OrtApi;

typedef OrtStatus* OrtStatusPtr;

/* ---- OrtApiBase: exactly as in the header (never versioned, never extended) ---- */
struct OrtApiBase {
  /* Returns NULL if `version` is unsupported (runtime accepts 1..its ORT_API_VERSION). */
  const OrtApi*(ORT_API_CALL* GetApi)(uint32_t version) NO_EXCEPTION;
  /* e.g. "1.22.0"; do not free. */
  const char*(ORT_API_CALL* GetVersionString)(void) NO_EXCEPTION;
};
typedef struct OrtApiBase OrtApiBase;

/* Type of the entry point ORT looks up ("RegisterCustomOps") in a custom-op library. */
typedef OrtStatus*(ORT_API_CALL* RegisterCustomOpsFn)(OrtSessionOptions* options, const OrtApiBase* api);

/*
 * ---- struct OrtApi ----
 * Slot index = offsetof(OrtApi, Name) / sizeof(void*).
 * Typed members are tagged  [slot] API <version that added it>.
 *
 * Notes on the typed members (from the header's doc comments):
 *  - CreateStatus copies msg; the caller (or ORT, for a status returned to it) releases it with ReleaseStatus.
 *  - KernelContext_GetInput: out is NULL (with success) for an absent optional input.
 *  - KernelContext_GetOutput allocates output `index` with the given shape; out is NULL
 *    for an absent optional output.
 *  - GetTensorMutableData takes a non-const OrtValue*. Values from KernelContext_GetInput
 *    are const OrtValue*, so callers cast the const away to read input data, as ORT's C++ wrapper does.
 *  - GetTensorTypeAndShape returns a new object: free it with ReleaseTensorTypeAndShapeInfo.
 *  - KernelContext_ParallelFor (API 17): "Run fn in parallel".
 *      fn(usr_data, i) is invoked once for every i in [0, total).
 *      num_batch: "Number of batches by which the 'total' is to be divided in maximum.
 *      When zero, there is no limit."
 *      Runs on the session's intra-op thread pool (OpKernelContext::GetOperatorThreadPool()):
 *      num_batch != 0 -> ThreadPool::TryBatchParallelFor(tp, total, fn, num_batch);
 *      num_batch == 0 -> ThreadPool::TrySimpleParallelFor(tp, total, fn).
 *      Returns after every call has finished. Does nothing if fn is NULL or total is 0. If the pool is absent or single-threaded, the calling
 *      thread runs everything. Returns ORT_RUNTIME_EXCEPTION status if context is NULL.
 */
struct OrtApi {
  /* slot 0 */
  OrtStatus*(ORT_API_CALL* CreateStatus)(OrtErrorCode code, const char* msg) NO_EXCEPTION;  /* [0] API 1, typed */
  OrtErrorCode(ORT_API_CALL* GetErrorCode)(const OrtStatus* status) NO_EXCEPTION;  /* [1] API 1, typed */
  const char*(ORT_API_CALL* GetErrorMessage)(const OrtStatus* status) NO_EXCEPTION;  /* [2] API 1, typed */
  void* CreateEnv;
  void* CreateEnvWithCustomLogger;
  void* EnableTelemetryEvents;
  void* DisableTelemetryEvents;
  void* CreateSession;
  void* CreateSessionFromArray;
  void* Run;
  /* slot 10 */
  void* CreateSessionOptions;
  void* SetOptimizedModelFilePath;
  void* CloneSessionOptions;
  void* SetSessionExecutionMode;
  void* EnableProfiling;
  void* DisableProfiling;
  void* EnableMemPattern;
  void* DisableMemPattern;
  void* EnableCpuMemArena;
  void* DisableCpuMemArena;
  /* slot 20 */
  void* SetSessionLogId;
  void* SetSessionLogVerbosityLevel;
  void* SetSessionLogSeverityLevel;
  void* SetSessionGraphOptimizationLevel;
  void* SetIntraOpNumThreads;
  void* SetInterOpNumThreads;
  ORT_API2_STATUS(CreateCustomOpDomain, const char* domain, OrtCustomOpDomain** out);  /* [26] API 1, typed */
  ORT_API2_STATUS(CustomOpDomain_Add, OrtCustomOpDomain* custom_op_domain, const OrtCustomOp* op);  /* [27] API 1, typed */
  ORT_API2_STATUS(AddCustomOpDomain, OrtSessionOptions* options, OrtCustomOpDomain* custom_op_domain);  /* [28] API 1, typed */
  void* RegisterCustomOpsLibrary;
  /* slot 30 */
  void* SessionGetInputCount;
  void* SessionGetOutputCount;
  void* SessionGetOverridableInitializerCount;
  void* SessionGetInputTypeInfo;
  void* SessionGetOutputTypeInfo;
  void* SessionGetOverridableInitializerTypeInfo;
  void* SessionGetInputName;
  void* SessionGetOutputName;
  void* SessionGetOverridableInitializerName;
  void* CreateRunOptions;
  /* slot 40 */
  void* RunOptionsSetRunLogVerbosityLevel;
  void* RunOptionsSetRunLogSeverityLevel;
  void* RunOptionsSetRunTag;
  void* RunOptionsGetRunLogVerbosityLevel;
  void* RunOptionsGetRunLogSeverityLevel;
  void* RunOptionsGetRunTag;
  void* RunOptionsSetTerminate;
  void* RunOptionsUnsetTerminate;
  void* CreateTensorAsOrtValue;
  void* CreateTensorWithDataAsOrtValue;
  /* slot 50 */
  void* IsTensor;
  ORT_API2_STATUS(GetTensorMutableData, OrtValue* value, void** out);  /* [51] API 1, typed */
  void* FillStringTensor;
  void* GetStringTensorDataLength;
  void* GetStringTensorContent;
  void* CastTypeInfoToTensorInfo;
  void* GetOnnxTypeFromTypeInfo;
  void* CreateTensorTypeAndShapeInfo;
  void* SetTensorElementType;
  void* SetDimensions;
  /* slot 60 */
  ORT_API2_STATUS(GetTensorElementType, const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out);  /* [60] API 1, typed */
  ORT_API2_STATUS(GetDimensionsCount, const OrtTensorTypeAndShapeInfo* info, size_t* out);  /* [61] API 1, typed */
  ORT_API2_STATUS(GetDimensions, const OrtTensorTypeAndShapeInfo* info, int64_t* dim_values, size_t dim_values_length);  /* [62] API 1, typed */
  void* GetSymbolicDimensions;
  void* GetTensorShapeElementCount;
  ORT_API2_STATUS(GetTensorTypeAndShape, const OrtValue* value, OrtTensorTypeAndShapeInfo** out);  /* [65] API 1, typed */
  void* GetTypeInfo;
  void* GetValueType;
  void* CreateMemoryInfo;
  void* CreateCpuMemoryInfo;
  /* slot 70 */
  void* CompareMemoryInfo;
  void* MemoryInfoGetName;
  void* MemoryInfoGetId;
  void* MemoryInfoGetMemType;
  void* MemoryInfoGetType;
  void* AllocatorAlloc;
  void* AllocatorFree;
  void* AllocatorGetInfo;
  void* GetAllocatorWithDefaultOptions;
  void* AddFreeDimensionOverride;
  /* slot 80 */
  void* GetValue;
  void* GetValueCount;
  void* CreateValue;
  void* CreateOpaqueValue;
  void* GetOpaqueValue;
  ORT_API2_STATUS(KernelInfoGetAttribute_float, const OrtKernelInfo* info, const char* name, float* out);  /* [85] API 1, typed */
  ORT_API2_STATUS(KernelInfoGetAttribute_int64, const OrtKernelInfo* info, const char* name, int64_t* out);  /* [86] API 1, typed */
  void* KernelInfoGetAttribute_string;
  ORT_API2_STATUS(KernelContext_GetInputCount, const OrtKernelContext* context, size_t* out);  /* [88] API 1, typed */
  ORT_API2_STATUS(KernelContext_GetOutputCount, const OrtKernelContext* context, size_t* out);  /* [89] API 1, typed */
  /* slot 90 */
  ORT_API2_STATUS(KernelContext_GetInput, const OrtKernelContext* context, size_t index, const OrtValue** out);  /* [90] API 1, typed */
  ORT_API2_STATUS(KernelContext_GetOutput, OrtKernelContext* context, size_t index, const int64_t* dim_values, size_t dim_count, OrtValue** out);  /* [91] API 1, typed */
  void* ReleaseEnv;
  ORT_CLASS_RELEASE(Status);  /* [93] API 1, typed */
  void* ReleaseMemoryInfo;
  void* ReleaseSession;
  void* ReleaseValue;
  void* ReleaseRunOptions;
  void* ReleaseTypeInfo;
  ORT_CLASS_RELEASE(TensorTypeAndShapeInfo);  /* [99] API 1, typed */
  /* slot 100 */
  void* ReleaseSessionOptions;
  void* ReleaseCustomOpDomain;
  /* ---- end of API version 1: last slot 101 ---- */
  void* GetDenotationFromTypeInfo;
  void* CastTypeInfoToMapTypeInfo;
  void* CastTypeInfoToSequenceTypeInfo;
  void* GetMapKeyType;
  void* GetMapValueType;
  void* GetSequenceElementType;
  void* ReleaseMapTypeInfo;
  void* ReleaseSequenceTypeInfo;
  /* slot 110 */
  void* SessionEndProfiling;
  void* SessionGetModelMetadata;
  void* ModelMetadataGetProducerName;
  void* ModelMetadataGetGraphName;
  void* ModelMetadataGetDomain;
  void* ModelMetadataGetDescription;
  void* ModelMetadataLookupCustomMetadataMap;
  void* ModelMetadataGetVersion;
  void* ReleaseModelMetadata;
  /* ---- end of API version 2: last slot 118 ---- */
  void* CreateEnvWithGlobalThreadPools;
  /* slot 120 */
  void* DisablePerSessionThreads;
  void* CreateThreadingOptions;
  void* ReleaseThreadingOptions;
  void* ModelMetadataGetCustomMetadataMapKeys;
  void* AddFreeDimensionOverrideByName;
  /* ---- end of API version 3: last slot 124 ---- */
  void* GetAvailableProviders;
  void* ReleaseAvailableProviders;
  /* ---- end of API version 4: last slot 126 ---- */
  void* GetStringTensorElementLength;
  void* GetStringTensorElement;
  void* FillStringTensorElement;
  /* slot 130 */
  void* AddSessionConfigEntry;
  void* CreateAllocator;
  void* ReleaseAllocator;
  void* RunWithBinding;
  void* CreateIoBinding;
  void* ReleaseIoBinding;
  void* BindInput;
  void* BindOutput;
  void* BindOutputToDevice;
  void* GetBoundOutputNames;
  /* slot 140 */
  void* GetBoundOutputValues;
  void* ClearBoundInputs;
  void* ClearBoundOutputs;
  void* TensorAt;
  void* CreateAndRegisterAllocator;
  void* SetLanguageProjection;
  void* SessionGetProfilingStartTimeNs;
  void* SetGlobalIntraOpNumThreads;
  void* SetGlobalInterOpNumThreads;
  void* SetGlobalSpinControl;
  /* ---- end of API version 5: last slot 149 ---- */
  /* slot 150 */
  void* AddInitializer;
  void* CreateEnvWithCustomLoggerAndGlobalThreadPools;
  void* SessionOptionsAppendExecutionProvider_CUDA;
  void* SessionOptionsAppendExecutionProvider_ROCM;
  void* SessionOptionsAppendExecutionProvider_OpenVINO;
  void* SetGlobalDenormalAsZero;
  void* CreateArenaCfg;
  void* ReleaseArenaCfg;
  /* ---- end of API version 6: last slot 157 ---- */
  void* ModelMetadataGetGraphDescription;
  void* SessionOptionsAppendExecutionProvider_TensorRT;
  /* slot 160 */
  void* SetCurrentGpuDeviceId;
  void* GetCurrentGpuDeviceId;
  /* ---- end of API version 7: last slot 161 ---- */
  void* KernelInfoGetAttributeArray_float;
  void* KernelInfoGetAttributeArray_int64;
  void* CreateArenaCfgV2;
  void* AddRunConfigEntry;
  void* CreatePrepackedWeightsContainer;
  void* ReleasePrepackedWeightsContainer;
  void* CreateSessionWithPrepackedWeightsContainer;
  void* CreateSessionFromArrayWithPrepackedWeightsContainer;
  /* ---- end of API version 8: last slot 169 ---- */
  /* slot 170 */
  void* SessionOptionsAppendExecutionProvider_TensorRT_V2;
  void* CreateTensorRTProviderOptions;
  void* UpdateTensorRTProviderOptions;
  void* GetTensorRTProviderOptionsAsString;
  void* ReleaseTensorRTProviderOptions;
  void* EnableOrtCustomOps;
  void* RegisterAllocator;
  void* UnregisterAllocator;
  void* IsSparseTensor;
  void* CreateSparseTensorAsOrtValue;
  /* slot 180 */
  void* FillSparseTensorCoo;
  void* FillSparseTensorCsr;
  void* FillSparseTensorBlockSparse;
  void* CreateSparseTensorWithValuesAsOrtValue;
  void* UseCooIndices;
  void* UseCsrIndices;
  void* UseBlockSparseIndices;
  void* GetSparseTensorFormat;
  void* GetSparseTensorValuesTypeAndShape;
  void* GetSparseTensorValues;
  /* slot 190 */
  void* GetSparseTensorIndicesTypeShape;
  void* GetSparseTensorIndices;
  /* ---- end of API version 9: last slot 191 ---- */
  void* HasValue;
  void* KernelContext_GetGPUComputeStream;
  void* GetTensorMemoryInfo;
  void* GetExecutionProviderApi;
  void* SessionOptionsSetCustomCreateThreadFn;
  void* SessionOptionsSetCustomThreadCreationOptions;
  void* SessionOptionsSetCustomJoinThreadFn;
  void* SetGlobalCustomCreateThreadFn;
  /* slot 200 */
  void* SetGlobalCustomThreadCreationOptions;
  void* SetGlobalCustomJoinThreadFn;
  void* SynchronizeBoundInputs;
  void* SynchronizeBoundOutputs;
  /* ---- end of API version 10: last slot 203 ---- */
  void* SessionOptionsAppendExecutionProvider_CUDA_V2;
  void* CreateCUDAProviderOptions;
  void* UpdateCUDAProviderOptions;
  void* GetCUDAProviderOptionsAsString;
  void* ReleaseCUDAProviderOptions;
  void* SessionOptionsAppendExecutionProvider_MIGraphX;
  /* ---- end of API version 11: last slot 209 ---- */
  /* slot 210 */
  void* AddExternalInitializers;
  void* CreateOpAttr;
  void* ReleaseOpAttr;
  void* CreateOp;
  void* InvokeOp;
  void* ReleaseOp;
  void* SessionOptionsAppendExecutionProvider;
  void* CopyKernelInfo;
  void* ReleaseKernelInfo;
  /* ---- end of API version 12: last slot 218 ---- */
  void* GetTrainingApi;
  /* slot 220 */
  void* SessionOptionsAppendExecutionProvider_CANN;
  void* CreateCANNProviderOptions;
  void* UpdateCANNProviderOptions;
  void* GetCANNProviderOptionsAsString;
  void* ReleaseCANNProviderOptions;
  /* ---- end of API version 13: last slot 224 ---- */
  void* MemoryInfoGetDeviceType;
  void* UpdateEnvWithCustomLogLevel;
  void* SetGlobalIntraOpThreadAffinity;
  void* RegisterCustomOpsLibrary_V2;
  void* RegisterCustomOpsUsingFunction;
  /* slot 230 */
  void* KernelInfo_GetInputCount;
  void* KernelInfo_GetOutputCount;
  void* KernelInfo_GetInputName;
  void* KernelInfo_GetOutputName;
  void* KernelInfo_GetInputTypeInfo;
  void* KernelInfo_GetOutputTypeInfo;
  void* KernelInfoGetAttribute_tensor;
  void* HasSessionConfigEntry;
  void* GetSessionConfigEntry;
  /* ---- end of API version 14: last slot 238 ---- */
  void* SessionOptionsAppendExecutionProvider_Dnnl;
  /* slot 240 */
  void* CreateDnnlProviderOptions;
  void* UpdateDnnlProviderOptions;
  void* GetDnnlProviderOptionsAsString;
  void* ReleaseDnnlProviderOptions;
  void* KernelInfo_GetNodeName;
  void* KernelInfo_GetLogger;
  void* KernelContext_GetLogger;
  void* Logger_LogMessage;
  void* Logger_GetLoggingSeverityLevel;
  void* KernelInfoGetConstantInput_tensor;
  /* slot 250 */
  void* CastTypeInfoToOptionalTypeInfo;
  void* GetOptionalContainedTypeInfo;
  void* GetResizedStringTensorElementBuffer;
  void* KernelContext_GetAllocator;
  void* GetBuildInfoString;
  /* ---- end of API version 15: last slot 254 ---- */
  void* CreateROCMProviderOptions;
  void* UpdateROCMProviderOptions;
  void* GetROCMProviderOptionsAsString;
  void* ReleaseROCMProviderOptions;
  void* CreateAndRegisterAllocatorV2;
  /* slot 260 */
  void* RunAsync;
  void* UpdateTensorRTProviderOptionsWithValue;
  void* GetTensorRTProviderOptionsByName;
  void* UpdateCUDAProviderOptionsWithValue;
  void* GetCUDAProviderOptionsByName;
  void* KernelContext_GetResource;
  /* ---- end of API version 16: last slot 265 ---- */
  void* SetUserLoggingFunction;
  void* ShapeInferContext_GetInputCount;
  void* ShapeInferContext_GetInputTypeShape;
  void* ShapeInferContext_GetAttribute;
  /* slot 270 */
  void* ShapeInferContext_SetOutputTypeShape;
  void* SetSymbolicDimensions;
  void* ReadOpAttr;
  void* SetDeterministicCompute;
  ORT_API2_STATUS(KernelContext_ParallelFor, const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, size_t num_batch, void* usr_data);  /* [274] API 17, typed */
  void* SessionOptionsAppendExecutionProvider_OpenVINO_V2;
  /* ---- end of API version 17: last slot 275 ---- */
  /* slot 276 and later (API 18+) exist at runtime but are not transcribed. */
};

/*
 * ---- struct OrtCustomOp ----  (all members of the header read, in order)
 *
 * What ORT does with `version` (onnxruntime/core/session/custom_ops.cc):
 *  - CustomOpKernel ctor: if (op.version > ORT_API_VERSION of the *runtime*) -> throws
 *    "Unsupported version '<v>' in custom op '<name>'". The OrtApi handed to CreateKernel /
 *    CreateKernelV2 is OrtGetApiBase()->GetApi(op.version), and GetApi returns NULL for 0.
 *    So valid values are 1..runtime API version. No other minimum is enforced.
 *    Recommended: ORT_API_VERSION_SUBSET_MIN (17).
 *  - Members added later are read only when op->version is high enough.
 *    Constants in custom_ops.cc:
 *      min_ort_version_with_optional_io_support = 8
 *      min_ort_version_with_variadic_io_support = 14
 *      min_ort_version_with_compute_v2_support  = 16
 *      min_ort_version_with_shape_inference     = 17
 *      min_ort_version_with_custom_version      = 17
 *      GetInputMemoryType: `if (op->version > 12)` (literal, i.e. >= 13)
 *      GetMayInplace: `if (op->version >= 18)` (literal; microsoft/onnxruntime PR #20037,
 *        ORT 1.18). That PR's diff shows no NULL check, but in a runtime probe the
 *        onnxruntime 1.22.0 and 1.30.0 wheels accepted version 22/24 ops whose
 *        GetMayInplace/GetAliasMap/GetStartVersion/GetEndVersion/InferOutputShapeFn were NULL.
 *  - Some reads are not gated at all: IsCompatible() calls Get{Input,Output}Characteristic
 *    for every input/output, and KernelDestroy is always called. So fill EVERY member with
 *    a valid function even when op->version would skip it. A NULL in a non-null-checked member can crash ORT.
 */
struct OrtCustomOp {
  uint32_t version; /* see above; header says "Must be initialized to ORT_API_VERSION" */

  /* [always if CreateKernelV2 unused] returns the kernel state passed to Kernel* below. */
  void*(ORT_API_CALL* CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  /* [always] op type name as used in the model's NodeProto.op_type */
  const char*(ORT_API_CALL* GetName)(const struct OrtCustomOp* op);
  /* [always] NULL -> CPUExecutionProvider */
  const char*(ORT_API_CALL* GetExecutionProviderType)(const struct OrtCustomOp* op);
  /* [always] UNDEFINED = any type */
  ONNXTensorElementDataType(ORT_API_CALL* GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetInputTypeCount)(const struct OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetOutputTypeCount)(const struct OrtCustomOp* op);
  /* [used unless version >= 16 && KernelComputeV2 != NULL] */
  void(ORT_API_CALL* KernelCompute)(void* op_kernel, OrtKernelContext* context);
  /* [always, no NULL check] */
  void(ORT_API_CALL* KernelDestroy)(void* op_kernel);
  /* [version >= 8 in schema building; ALSO called unconditionally by IsCompatible()] */
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  /* [version > 12, no NULL check] */
  OrtMemType(ORT_API_CALL* GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  /* [version >= 14, only for an input/output marked INPUT_OUTPUT_VARIADIC] */
  int(ORT_API_CALL* GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  /* [version >= 16 and non-NULL] preferred over CreateKernel / KernelCompute */
  OrtStatusPtr(ORT_API_CALL* CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api,
                                             const OrtKernelInfo* info, void** kernel);
  OrtStatusPtr(ORT_API_CALL* KernelComputeV2)(void* op_kernel, OrtKernelContext* context);
  /* [version >= 17 and non-NULL] */
  OrtStatusPtr(ORT_API_CALL* InferOutputShapeFn)(const struct OrtCustomOp* op, OrtShapeInferContext* ctx);
  /* [version >= 17, each NULL-checked] opset range of the op (default 1..) */
  int(ORT_API_CALL* GetStartVersion)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetEndVersion)(const struct OrtCustomOp* op);
  /* [version >= 18 (ORT 1.18); return 0 = no entries] outputs that may reuse inputs */
  size_t(ORT_API_CALL* GetMayInplace)(int** input_index, int** output_index);
  void(ORT_API_CALL* ReleaseMayInplace)(int* input_index, int* output_index);
  /* [added with GetMayInplace, ORT 1.18 (PR #20145); same contract] */
  size_t(ORT_API_CALL* GetAliasMap)(int** input_index, int** output_index);
  void(ORT_API_CALL* ReleaseAliasMap)(int* input_index, int* output_index);
};

/* ---- compile-time layout checks: the anchors ORT itself static_asserts in onnxruntime_c_api.cc ---- */
#ifdef __cplusplus
#define ORT_SUBSET_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define ORT_SUBSET_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
#define ORT_SUBSET_SLOT(m) (offsetof(OrtApi, m) / sizeof(void*))
ORT_SUBSET_STATIC_ASSERT(sizeof(void*) == sizeof(void (*)(void)), "slots assume data and function pointers have the same size");
ORT_SUBSET_STATIC_ASSERT(sizeof(OrtApiBase) == 2 * sizeof(void*), "OrtApiBase has exactly 2 slots");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseCustomOpDomain) == 101, "Size of version 1 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseModelMetadata) == 118, "Size of version 2 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(AddFreeDimensionOverrideByName) == 124, "Size of version 3 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseAvailableProviders) == 126, "Size of version 4 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(SetGlobalSpinControl) == 149, "Size of version 5 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseArenaCfg) == 157, "Size of version 6 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(GetCurrentGpuDeviceId) == 161, "Size of version 7 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(CreateSessionFromArrayWithPrepackedWeightsContainer) == 169, "Size of version 8 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(GetSparseTensorIndices) == 191, "Size of version 9 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(SynchronizeBoundOutputs) == 203, "Size of version 10 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(SessionOptionsAppendExecutionProvider_MIGraphX) == 209, "Size of version 11 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseKernelInfo) == 218, "Size of version 12 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(ReleaseCANNProviderOptions) == 224, "Size of version 13 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(GetSessionConfigEntry) == 238, "Size of version 14 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(GetBuildInfoString) == 254, "Size of version 15 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(KernelContext_GetResource) == 265, "Size of version 16 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(SessionOptionsAppendExecutionProvider_OpenVINO_V2) == 275, "Size of version 17 API");
ORT_SUBSET_STATIC_ASSERT(ORT_SUBSET_SLOT(KernelContext_ParallelFor) == 274, "ParallelFor slot");
ORT_SUBSET_STATIC_ASSERT(sizeof(OrtApi) == 276 * sizeof(void*), "OrtApi transcribed through the end of API 17");
ORT_SUBSET_STATIC_ASSERT(sizeof(OrtCustomOp) == 26 * sizeof(void*), "OrtCustomOp: uint32 version (padded) + 25 function pointers");

#ifdef __cplusplus
}
#endif

#endif /* ORT_MODELS_KERNELS_ORT_API_SUBSET_H */
