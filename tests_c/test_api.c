/* C99 contract test of the public header: it includes nothing but the header and the
 * C library, and runs without a GPU. It checks TE's enum values, the tensor API and
 * every error path that can be reached without a device: each bad input must return
 * the documented status with a message naming the function and argument, and none may
 * abort the process. */
#include "transformer_engine_comm.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed = 0, failed = 0;

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (cond) {                                           \
      ++passed;                                           \
    } else {                                              \
      ++failed;                                           \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);         \
      printf(__VA_ARGS__);                                \
      printf("  [last error: %s]\n", nvte_comm_last_error()); \
    }                                                     \
  } while (0)

/* The last call failed with `status` and a message that contains each of `words`. */
static void expect_error(NVTECommStatus status, const char *what, const char *w1, const char *w2) {
  NVTECommStatus got = nvte_comm_last_status();
  const char *msg = nvte_comm_last_error();
  CHECK(msg != NULL, "%s: last_error is NULL\n", what);
  if (msg == NULL) return;
  CHECK(got == status, "%s: status %s, expected %s\n", what, nvte_comm_status_string(got), nvte_comm_status_string(status));
  CHECK(w1 == NULL || strstr(msg, w1) != NULL, "%s: message lacks \"%s\": %s\n", what, w1, msg);
  CHECK(w2 == NULL || strstr(msg, w2) != NULL, "%s: message lacks \"%s\": %s\n", what, w2, msg);
}

static void expect_ok(const char *what) {
  CHECK(nvte_comm_last_status() == NVTE_COMM_SUCCESS && strcmp(nvte_comm_last_error(), "") == 0,
        "%s: expected success, got %s\n", what, nvte_comm_status_string(nvte_comm_last_status()));
}

static NVTEBasicTensor basic(void *p, NVTEDType t, size_t ndim, const size_t *dims) {
  NVTEBasicTensor b;
  b.data_ptr = p;
  b.dtype = t;
  b.shape = nvte_make_shape(dims, ndim);
  return b;
}

static void test_enums(void) {
  /* TE's values, and both spellings of the type names. */
  enum NVTEDType a = kNVTEFloat8E5M2;
  NVTEDType b = kNVTEBFloat16;
  CHECK(kNVTEByte == 0 && kNVTEInt16 == 1 && kNVTEInt32 == 2 && kNVTEInt64 == 3 && kNVTEFloat32 == 4 &&
            kNVTEFloat16 == 5 && kNVTEBFloat16 == 6 && kNVTEFloat8E4M3 == 7 && kNVTEFloat8E5M2 == 8 &&
            kNVTEFloat8E8M0 == 9 && kNVTEFloat4E2M1 == 10 && a == 8 && b == 6,
        "NVTEDType values\n");
  CHECK(kNVTERowwiseData == 0 && kNVTEColumnwiseData == 1 && kNVTEScale == 2 && kNVTEAmax == 3 &&
            kNVTERowwiseScaleInv == 4 && kNVTEColumnwiseScaleInv == 5 && kNVTEColumnwiseAmax == 6,
        "NVTETensorParam values\n");
  CHECK(NVTE_DELAYED_TENSOR_SCALING == 0 && NVTE_MXFP8_1D_SCALING == 1 && NVTE_BLOCK_SCALING_1D == 2 &&
            NVTE_BLOCK_SCALING_2D == 3 && NVTE_NVFP4_1D_SCALING == 4 && NVTE_INVALID_SCALING == 100,
        "NVTEScalingMode values\n");
  CHECK(sizeof(NVTEShape) == 16 * sizeof(size_t), "NVTEShape layout\n");
  CHECK(strcmp(nvte_comm_status_string(NVTE_COMM_ERROR_TIMEOUT), "NVTE_COMM_ERROR_TIMEOUT") == 0, "status string\n");
  CHECK(strcmp(nvte_comm_status_string((NVTECommStatus)999), "unknown status") == 0, "unknown status string\n");
  CHECK(strlen(nvte_comm_version()) >= 5, "version\n");
}

static void test_tensor_api(void) {
  size_t dims[3] = {4, 8, 16};
  float fake_scale = 0; /* host address used only as an opaque pointer value */
  NVTETensor t = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor data = basic((void *)0x1000, kNVTEBFloat16, 3, dims), got;
  size_t written = 0;
  CHECK(t != NULL, "create\n");
  expect_ok("create");
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &data, sizeof data);
  expect_ok("set v2");
  CHECK(nvte_tensor_data(t) == (void *)0x1000, "data pointer\n");
  CHECK(nvte_tensor_ndims(t) == 3 && nvte_tensor_size(t, 2) == 16 && nvte_tensor_numel(t) == 512, "shape queries\n");
  CHECK(nvte_tensor_element_size(t) == 2 && nvte_tensor_type(t) == kNVTEBFloat16, "type queries\n");
  CHECK(nvte_tensor_shape(t).ndim == 3 && nvte_tensor_shape(t).data[1] == 8, "nvte_tensor_shape\n");
  CHECK(nvte_tensor_scaling_mode(t) == NVTE_DELAYED_TENSOR_SCALING, "scaling mode\n");
  nvte_get_tensor_param_v2(t, kNVTERowwiseData, &got, sizeof got, &written);
  expect_ok("get v2");
  CHECK(written == sizeof got && got.data_ptr == (void *)0x1000 && got.dtype == kNVTEBFloat16 && got.shape.ndim == 3,
        "get v2 round trip\n");
  written = 0;
  nvte_get_tensor_param_v2(t, kNVTERowwiseData, NULL, 0, &written);
  CHECK(written == sizeof(NVTEBasicTensor), "get v2 size query\n");
  {
    size_t one = 1;
    NVTEBasicTensor s = basic(&fake_scale, kNVTEFloat32, 1, &one);
    nvte_set_tensor_param(&t, kNVTEScale, &s);
    expect_ok("set scale (legacy)");
    CHECK(nvte_tensor_scale(t) == &fake_scale, "scale pointer\n");
    got = nvte_get_tensor_param(t, kNVTEScale);
    CHECK(got.data_ptr == &fake_scale && got.dtype == kNVTEFloat32, "legacy get\n");
    nvte_set_tensor_param_v2(t, kNVTEAmax, &s, sizeof s);
    nvte_set_tensor_param_v2(t, kNVTERowwiseScaleInv, &s, sizeof s);
    CHECK(nvte_tensor_amax(t) == &fake_scale && nvte_tensor_scale_inv(t) == &fake_scale, "amax/scale_inv\n");
    s.dtype = kNVTEBFloat16;
    nvte_set_tensor_param_v2(t, kNVTEScale, &s, sizeof s);
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "bf16 scale", "nvte_set_tensor_param_v2", "kNVTEFloat32");
  }
  nvte_destroy_tensor(t);
  expect_ok("destroy");
  nvte_destroy_tensor(NULL);
  expect_ok("destroy NULL is a no-op");
}

static void test_tensor_errors(void) {
  size_t dims[16] = {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  size_t huge[2] = {(size_t)1 << 62, 64};
  NVTETensor t = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING), dead;
  NVTEBasicTensor b;
  NVTEShape s;
  size_t written = 123;

  /* handles */
  CHECK(nvte_tensor_data(NULL) == NULL, "NULL handle data\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL handle", "nvte_tensor_data", "NULL");
  dead = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  nvte_destroy_tensor(dead);
  CHECK(nvte_tensor_numel(dead) == 0, "destroyed handle numel\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "destroyed handle", "nvte_tensor_numel", "already destroyed");
  nvte_destroy_tensor(dead);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "double destroy", "nvte_destroy_tensor", "not a live tensor");
  CHECK(nvte_tensor_type((NVTETensor)0x12345678) == kNVTENumTypes, "garbage handle type\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "garbage handle", "0x12345678", "not a live tensor");

  /* scaling modes */
  CHECK(nvte_create_tensor(NVTE_MXFP8_1D_SCALING) == NULL, "mxfp8 tensor\n");
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "mxfp8", "NVTE_MXFP8_1D_SCALING", "not supported");
  CHECK(nvte_create_tensor((NVTEScalingMode)42) == NULL, "bad scaling mode\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "bad scaling mode", "42", NULL);

  /* shapes */
  s = nvte_make_shape(dims, 16);
  CHECK(s.ndim == 0, "ndim 16 rejected\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ndim 16", "ndim", "16");
  s = nvte_make_shape(NULL, 2);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL dims", "data", "NULL");
  s = nvte_make_shape(NULL, 0);
  expect_ok("empty shape");
  CHECK(s.ndim == 0, "empty shape ndim\n");

  /* parameters */
  b = basic((void *)0x1000, (NVTEDType)42, 2, dims);
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &b, sizeof b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "dtype 42", "42", "NVTEDType");
  b = basic((void *)0x1000, kNVTEFloat32, 2, dims);
  b.shape.ndim = 99;
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &b, sizeof b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ndim 99", "99", NULL);
  b = basic((void *)0x1000, kNVTEFloat32, 2, huge);
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &b, sizeof b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "size overflow", "overflow", NULL);
  b = basic((void *)0x1000, kNVTEFloat32, 2, dims);
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &b, sizeof b - 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "short v2 buffer", "size_in_bytes", "sizeof(NVTEBasicTensor)");
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, NULL, sizeof b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL v2 buffer", "buf", "NULL");
  nvte_set_tensor_param_v2(t, (NVTETensorParam)77, &b, sizeof b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "param 77", "77", "NVTETensorParam");
  nvte_get_tensor_param_v2(t, kNVTERowwiseData, &b, 3, &written);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "short get buffer", "size_in_bytes", NULL);
  CHECK(written == 0, "size_written 0 on failure\n");
  written = 12345;
  nvte_get_tensor_param_v2(t, (NVTETensorParam)77, &b, sizeof b, &written);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "get param 77", "77", NULL);
  CHECK(written == 0, "size_written 0 on a bad param (was %zu)\n", written);
  written = 12345;
  nvte_get_tensor_param_v2((NVTETensor)((uintptr_t)t ^ 0x100), kNVTERowwiseData, &b, sizeof b, &written);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "corrupted handle", "not a live tensor", NULL);
  CHECK(written == 0, "size_written 0 on a corrupted handle (was %zu)\n", written);
  nvte_set_tensor_param(NULL, kNVTERowwiseData, &b);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "legacy NULL tensor", "tensor", "NULL");
  nvte_set_tensor_param_v2(t, kNVTERowwiseData, &b, sizeof b);
  expect_ok("valid set after errors");
  CHECK(nvte_tensor_size(t, 5) == 0, "dim out of range\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "dim 5", "dim", "5");
  nvte_destroy_tensor(t);
}

static NVTETensor make(void *p, NVTEDType dt, size_t r, size_t c) {
  size_t dims[2];
  NVTETensor t = NULL;
  dims[0] = r;
  dims[1] = c;
  if (nvte_comm_tensor_create_simple(p, dt, dims, 2, &t) != NVTE_COMM_SUCCESS) return NULL;
  return t;
}

/* GEMM argument errors are detected before any device work, so they run anywhere. */
static void test_gemm_errors(void) {
  void *p = (void *)0x10000;
  NVTETensor a = make(p, kNVTEBFloat16, 32, 64); /* TN: m = 32, k = 64 */
  NVTETensor b = make(p, kNVTEBFloat16, 48, 64); /* n = 48 */
  NVTETensor d = make(p, kNVTEBFloat16, 48, 32);
  NVTETensor dbad = make(p, kNVTEBFloat16, 32, 48);
  NVTETensor bbad = make(p, kNVTEBFloat16, 48, 63);
  NVTETensor i32 = make(p, kNVTEInt32, 48, 64);
  NVTETensor nullp = make(NULL, kNVTEBFloat16, 48, 64);
  NVTETensor zero_m = make(p, kNVTEBFloat16, 0, 64), zero_d = make(p, kNVTEBFloat16, 48, 0);
  NVTETensor dead = make(p, kNVTEBFloat16, 48, 64);
  NVTETensor one_d;
  size_t n1 = 64;
  CHECK(nvte_comm_tensor_create_simple(p, kNVTEBFloat16, &n1, 1, &one_d) == NVTE_COMM_SUCCESS, "1-D tensor\n");
  nvte_destroy_tensor(dead);

  nvte_cublas_gemm(NULL, b, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm NULL A", "nvte_cublas_gemm", "`A` is NULL");
  nvte_cublas_gemm(a, dead, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm destroyed B", "`B`", "already destroyed");
  nvte_cublas_gemm(a, b, dbad, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm wrong D shape", "`D`", "[48, 32]");
  nvte_cublas_gemm(a, bbad, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm k mismatch", "inner dimensions", "63");
  nvte_cublas_gemm(a, b, d, NULL, NULL, true, true, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm TT", "TT", NULL);
  nvte_cublas_gemm(a, i32, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "gemm int32 input", "kNVTEInt32", NULL);
  nvte_cublas_gemm(a, one_d, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm 1-D B", "at least 2 dimensions", "ndim 1");
  nvte_cublas_gemm(a, nullp, d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm NULL data", "`B`", "NULL data pointer");
  nvte_cublas_gemm(a, b, d, NULL, NULL, true, false, false, NULL, false, false, -3, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "gemm negative sm count", "math_sm_count", "-3");
  /* m = 0: nothing to compute, succeeds without touching a device */
  nvte_cublas_gemm(zero_m, b, zero_d, NULL, NULL, true, false, false, NULL, false, false, 0, NULL);
  expect_ok("gemm m = 0");

  nvte_quantize(a, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize NULL output", "nvte_quantize", "`output` is NULL");
  nvte_quantize(i32, d, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize size mismatch", "elements", NULL);
  CHECK(nvte_comm_fill_uniform(a, 1, 2.0f, 1.0f, NULL) == NVTE_COMM_ERROR_INVALID_ARGUMENT, "fill lo > hi\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "fill lo > hi", "nvte_comm_fill_uniform", "lo");
  CHECK(nvte_comm_fill_uniform(i32, 1, 0.0f, 1.0f, NULL) == NVTE_COMM_ERROR_UNSUPPORTED, "fill int32\n");

  nvte_destroy_tensor(a); nvte_destroy_tensor(b); nvte_destroy_tensor(d); nvte_destroy_tensor(dbad);
  nvte_destroy_tensor(bbad); nvte_destroy_tensor(i32); nvte_destroy_tensor(nullp); nvte_destroy_tensor(zero_m);
  nvte_destroy_tensor(zero_d); nvte_destroy_tensor(one_d);
}

/* Argument checks of the comm-GEMM context come before any library is loaded, so
 * they give INVALID_ARGUMENT (not LIBRARY_NOT_FOUND) on a machine without CUDA too. */
static void test_ctx_args(void) {
  ncclComm_t fake = (ncclComm_t)0x1000;
  struct { int32_t nranks, rank; } bad[] = {{0, 0}, {-4, 0}, {2, 2}, {4, -1}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    CHECK(nvte_comm_gemm_ctx_create(fake, bad[i].nranks, bad[i].rank) == NULL, "ctx with nranks %d rank %d\n", bad[i].nranks, bad[i].rank);
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx nranks/rank", "nranks", "rank");
  }
  CHECK(nvte_comm_gemm_ctx_create(NULL, 2, 0) == NULL, "ctx with a NULL comm\n");
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx NULL comm", "NULL", NULL);
}

static void test_runtime(void) {
  NVTECommStatus s = nvte_comm_check_runtime();
  if (s == NVTE_COMM_SUCCESS) {
    printf("runtime: CUDA driver, cuBLASLt, NVRTC and NCCL load; %d device(s)\n", nvte_comm_device_count());
    CHECK(nvte_comm_device_count() > 0, "device count\n");
  } else {
    /* No GPU here: the reason must be reported, not crash. */
    printf("runtime: not usable here (%s): %s\n", nvte_comm_status_string(s), nvte_comm_last_error());
    CHECK(s == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || s == NVTE_COMM_ERROR_CUDA, "runtime status\n");
    CHECK(strlen(nvte_comm_last_error()) > 20, "runtime message\n");
    CHECK(nvte_comm_device_count() == 0, "no devices\n");
  }
}

int main(void) {
  test_enums();
  test_tensor_api();
  test_tensor_errors();
  test_gemm_errors();
  test_ctx_args();
  test_runtime();
  CHECK(nvte_comm_live_tensor_count() == 0, "leaked tensor handles: %zu\n", nvte_comm_live_tensor_count());
  printf("test_api: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
