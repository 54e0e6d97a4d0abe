/* C99 contract test of the public header: it includes nothing but the header and the
 * C library, and runs without a GPU. It checks TE's enum values, the tensor API and
 * every error path that can be reached without a device: each bad input must return
 * the documented status with a message naming the function and argument, and none may
 * abort the process. */
#define _POSIX_C_SOURCE 200112L /* setenv / unsetenv (the environment knobs) */
#include "transformer_engine_comm.h"

#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
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

/* ---- environment knobs: parsed strictly by the call that reads them ---- */

static const char *const KNOBS[] = {"NVTE_COMM_TIMEOUT_MS",        "NVTE_COMM_OVERLAP_NUM_SPLITS",
                                    "NVTE_COMM_OVERLAP_MAX_STREAMS", "NVTE_COMM_OVERLAP_NUM_SM",
                                    "NVTE_COMM_OVERLAP_USE_CE",      "NVTE_COMM_OVERLAP_AGGREGATE",
                                    "NVTE_COMM_OVERLAP_SM_MARGIN",   "NVTE_COMM_TRANSPORT",
                                    "NVTE_COMM_AR_ALGO",             "NVTE_COMM_RS_RING",
                                    "NVTE_COMM_AG_PIECES",           "NVTE_COMM_FUSED_TILES",
                                    "NVTE_COMM_OVERLAP",             "NVTE_COMM_TRACE"};

static void unset_knobs(void) {
  for (size_t i = 0; i < sizeof KNOBS / sizeof KNOBS[0]; ++i) unsetenv(KNOBS[i]);
}

static int all_zero(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; ++i)
    if (b[i]) return 0;
  return 1;
}

/* config_default with `name` = `value`: rejected, naming the variable and the value. */
static void env_rejected(const char *name, const char *value) {
  NVTECommOverlapConfig c;
  char what[160];
  memset(&c, 0x5a, sizeof c);
  setenv(name, value, 1);
  snprintf(what, sizeof what, "%s=\"%s\"", name, value);
  CHECK(nvte_comm_overlap_config_default(&c) == NVTE_COMM_ERROR_INVALID_ARGUMENT, "%s: accepted\n", what);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, what, "nvte_comm_overlap_config_default: environment variable ", name);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, what, value, NULL);
  CHECK(all_zero(&c, sizeof c), "%s: config not zeroed on error\n", what);
  unsetenv(name);
}

static NVTECommOverlapConfig env_config(const char *name, const char *value) {
  NVTECommOverlapConfig c;
  memset(&c, 0, sizeof c);
  setenv(name, value, 1);
  CHECK(nvte_comm_overlap_config_default(&c) == NVTE_COMM_SUCCESS, "%s=\"%s\" rejected\n", name, value);
  unsetenv(name);
  return c;
}

static void test_env_knobs(void) {
  NVTECommOverlapConfig c;
  unset_knobs();
  CHECK(nvte_comm_overlap_config_default(&c) == NVTE_COMM_SUCCESS, "config_default\n");
  CHECK(c.struct_size == sizeof c && c.tp_size == 0 && c.num_splits == 3 && c.num_max_streams == 3 &&
            c.comm_cga_size == 2 && c.num_comm_sm == 16 && c.set_sm_margin && c.use_ce && !c.aggregate &&
            !c.atomic_gemm && c.timeout_ms == 60000 && c.transport == NVTE_COMM_TRANSPORT_AUTO,
        "documented defaults\n");
  CHECK(nvte_comm_overlap_config_default(NULL) == NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL config\n");

  /* Values that do not parse, are out of range or would be truncated. */
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "4294967299");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "abc");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "0");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "65");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "3x");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SPLITS", "-3");
  env_rejected("NVTE_COMM_OVERLAP_MAX_STREAMS", "9");
  env_rejected("NVTE_COMM_OVERLAP_MAX_STREAMS", "2.5");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SM", "0");
  env_rejected("NVTE_COMM_OVERLAP_NUM_SM", "2147483648");
  env_rejected("NVTE_COMM_TIMEOUT_MS", "0");
  env_rejected("NVTE_COMM_TIMEOUT_MS", "-1");
  env_rejected("NVTE_COMM_TIMEOUT_MS", "9223372036854775808");
  env_rejected("NVTE_COMM_TIMEOUT_MS", "60s");
  env_rejected("NVTE_COMM_OVERLAP_USE_CE", "2");
  env_rejected("NVTE_COMM_OVERLAP_USE_CE", "enable");
  env_rejected("NVTE_COMM_OVERLAP_AGGREGATE", "-1");
  env_rejected("NVTE_COMM_OVERLAP_SM_MARGIN", "yes please");
  env_rejected("NVTE_COMM_TRANSPORT", "tcp");
  env_rejected("NVTE_COMM_TRANSPORT", "1");

  /* Accepted values. */
  CHECK(env_config("NVTE_COMM_OVERLAP_NUM_SPLITS", "64").num_splits == 64, "num_splits 64\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_NUM_SPLITS", " 5 ").num_splits == 5, "num_splits with blanks\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_NUM_SPLITS", "").num_splits == 3, "empty = default\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_MAX_STREAMS", "8").num_max_streams == 8, "max_streams 8\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_NUM_SM", "2147483647").num_comm_sm == 2147483647, "num_sm max\n");
  CHECK(env_config("NVTE_COMM_TIMEOUT_MS", "9223372036854775807").timeout_ms == INT64_MAX, "timeout max\n");
  CHECK(!env_config("NVTE_COMM_OVERLAP_USE_CE", "0").use_ce, "use_ce 0\n");
  CHECK(!env_config("NVTE_COMM_OVERLAP_USE_CE", "off").use_ce, "use_ce off\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_USE_CE", "TRUE").use_ce, "use_ce TRUE\n");
  CHECK(env_config("NVTE_COMM_OVERLAP_AGGREGATE", "1").aggregate, "aggregate 1\n");
  CHECK(!env_config("NVTE_COMM_OVERLAP_SM_MARGIN", "no").set_sm_margin, "sm_margin no\n");
  CHECK(env_config("NVTE_COMM_TRANSPORT", "NCCL").transport == NVTE_COMM_TRANSPORT_NCCL, "transport NCCL\n");
  CHECK(env_config("NVTE_COMM_TRANSPORT", "ipc").transport == NVTE_COMM_TRANSPORT_IPC, "transport ipc\n");

  /* The creating calls read them too, before anything is loaded. */
  {
    NVTECommBootstrap bs;
    NVTECommOverlap *o = (NVTECommOverlap *)0x1;
    ncclComm_t fake = (ncclComm_t)0x1000; /* never dereferenced: the environment is checked first */
    memset(&bs, 0, sizeof bs);
    bs.world_size = 1;
    setenv("NVTE_COMM_OVERLAP_MAX_STREAMS", "4294967299", 1);
    CHECK(nvte_comm_overlap_create(&bs, NULL, 8, 8, kNVTEBFloat16, &o) == NVTE_COMM_ERROR_INVALID_ARGUMENT && o == NULL,
          "create (NULL config) with a bad environment\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "create env", "nvte_comm_overlap_create: environment variable NVTE_COMM_OVERLAP_MAX_STREAMS", "4294967299");
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad environment\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx env", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_OVERLAP_MAX_STREAMS", "4294967299");
    unsetenv("NVTE_COMM_OVERLAP_MAX_STREAMS");
    setenv("NVTE_COMM_TRACE", "verbose", 1);
    CHECK(nvte_comm_overlap_create(&bs, NULL, 8, 8, kNVTEBFloat16, &o) == NVTE_COMM_ERROR_INVALID_ARGUMENT, "create with a bad NVTE_COMM_TRACE\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "create trace", "NVTE_COMM_TRACE", "verbose");
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_TRACE\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx trace", "NVTE_COMM_TRACE", "verbose");
    unsetenv("NVTE_COMM_TRACE");
    setenv("NVTE_COMM_AR_ALGO", "fastest", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_AR_ALGO\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx ar_algo", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_AR_ALGO", "fastest");
    unsetenv("NVTE_COMM_AR_ALGO");
    setenv("NVTE_COMM_RS_RING", "sum", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_RS_RING\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx rs_ring", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_RS_RING", "sum");
    unsetenv("NVTE_COMM_RS_RING");
    setenv("NVTE_COMM_AG_PIECES", "columns", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_AG_PIECES\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx ag_pieces", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_AG_PIECES", "columns");
    unsetenv("NVTE_COMM_AG_PIECES");
    setenv("NVTE_COMM_FUSED_TILES", "64", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_FUSED_TILES\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx fused_tiles", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_FUSED_TILES", "64");
    unsetenv("NVTE_COMM_FUSED_TILES");
    setenv("NVTE_COMM_OVERLAP", "sometimes", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_OVERLAP\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx overlap", "nvte_comm_gemm_ctx_create: environment variable NVTE_COMM_OVERLAP", "sometimes");
    unsetenv("NVTE_COMM_OVERLAP");
    setenv("NVTE_COMM_TRANSPORT", "rdma", 1);
    CHECK(nvte_comm_gemm_ctx_create(fake, 2, 0) == NULL, "ctx_create with a bad NVTE_COMM_TRANSPORT\n");
    expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "ctx transport", "NVTE_COMM_TRANSPORT", "rdma");
    unsetenv("NVTE_COMM_TRANSPORT");
  }
  unset_knobs();
}

/* ---- nvte_comm_overlap_create: every argument check comes before CUDA is loaded ---- */

static int g_callback_calls = 0;

static int32_t test_allgather(void *user, void *global, size_t global_bytes, const void *local, size_t local_bytes) {
  (void)user;
  ++g_callback_calls;
  if (global_bytes < local_bytes) return 1;
  memcpy(global, local, local_bytes);
  return 0;
}

static int32_t test_barrier(void *user) {
  (void)user;
  ++g_callback_calls;
  return 0;
}

static NVTECommBootstrap callbacks(int32_t rank, int32_t size) {
  NVTECommBootstrap b;
  memset(&b, 0, sizeof b);
  b.world_rank = rank;
  b.world_size = size;
  b.allgather = test_allgather;
  b.barrier = test_barrier;
  return b;
}

/* create(bs, cfg, rows, cols, dtype) fails with `status` and a message containing w1 and w2;
 * `*out` is NULL afterwards. */
static void create_fails(const char *what, const NVTECommBootstrap *bs, const NVTECommOverlapConfig *cfg, size_t rows,
                         size_t cols, NVTEDType dt, NVTECommStatus status, const char *w1, const char *w2) {
  NVTECommOverlap *o = (NVTECommOverlap *)0x1;
  NVTECommStatus s = nvte_comm_overlap_create(bs, cfg, rows, cols, dt, &o);
  CHECK(s == status, "%s: status %s, expected %s\n", what, nvte_comm_status_string(s), nvte_comm_status_string(status));
  CHECK(o == NULL, "%s: *out not NULL\n", what);
  expect_error(status, what, "nvte_comm_overlap_create: ", w1);
  if (w2) expect_error(status, what, w2, NULL);
}

/* Invalid engine configs: the field (offset, size), its value, the status and the words the
 * message must contain. */
typedef struct {
  const char *what;
  size_t off, size;
  int64_t value;
  NVTECommStatus status;
  const char *w1, *w2;
} ConfigCase;

#define CFG_FIELD(f) offsetof(NVTECommOverlapConfig, f), sizeof(((NVTECommOverlapConfig *)0)->f)
static const ConfigCase bad_configs[] = {
    {"struct_size", CFG_FIELD(struct_size), 8, NVTE_COMM_ERROR_INVALID_ARGUMENT, "struct_size = 8", NULL},
    {"transport 7", CFG_FIELD(transport), 7, NVTE_COMM_ERROR_INVALID_ARGUMENT, "transport = 7", NULL},
    {"transport -1", CFG_FIELD(transport), -1, NVTE_COMM_ERROR_INVALID_ARGUMENT, "transport", NULL},
    {"num_splits 0", CFG_FIELD(num_splits), 0, NVTE_COMM_ERROR_INVALID_ARGUMENT, "num_splits = 0", NULL},
    {"num_splits 65", CFG_FIELD(num_splits), 65, NVTE_COMM_ERROR_INVALID_ARGUMENT, "num_splits = 65", NULL},
    {"num_max_streams 0", CFG_FIELD(num_max_streams), 0, NVTE_COMM_ERROR_INVALID_ARGUMENT, "num_max_streams = 0", NULL},
    {"comm_cga_size 9", CFG_FIELD(comm_cga_size), 9, NVTE_COMM_ERROR_INVALID_ARGUMENT, "comm_cga_size = 9", NULL},
    {"num_comm_sm 0", CFG_FIELD(num_comm_sm), 0, NVTE_COMM_ERROR_INVALID_ARGUMENT, "num_comm_sm = 0", NULL},
    {"timeout 0", CFG_FIELD(timeout_ms), 0, NVTE_COMM_ERROR_INVALID_ARGUMENT, "timeout_ms = 0", NULL},
    {"tp_size -2", CFG_FIELD(tp_size), -2, NVTE_COMM_ERROR_INVALID_ARGUMENT, "tp_size = -2", NULL},
    {"tp_size 17", CFG_FIELD(tp_size), 17, NVTE_COMM_ERROR_UNSUPPORTED, "tp_size = 17", NULL},
    {"bool byte 7", CFG_FIELD(use_ce), 7, NVTE_COMM_ERROR_INVALID_ARGUMENT, "use_ce = 7", "not a bool"},
};

/* Store `v` into the `size`-byte field at `off` (its low bytes: a bool field may get any
 * byte value, as a C caller could write). */
static void set_field(NVTECommOverlapConfig *c, size_t off, size_t size, int64_t v) {
  unsigned char *p = (unsigned char *)c + off;
  if (size == 8) {
    memcpy(p, &v, 8);
  } else if (size == 4) {
    int32_t x = (int32_t)v;
    memcpy(p, &x, 4);
  } else {
    unsigned char x = (unsigned char)v;
    memcpy(p, &x, 1);
  }
}

static void test_overlap_create_args(void) {
  const NVTECommStatus INV = NVTE_COMM_ERROR_INVALID_ARGUMENT, UNS = NVTE_COMM_ERROR_UNSUPPORTED;
  NVTECommBootstrap one = callbacks(0, 1), four = callbacks(1, 4), bad;
  NVTECommOverlapConfig base, c;
  const NVTEDType BF = kNVTEBFloat16;
  unset_knobs();
  CHECK(nvte_comm_overlap_config_default(&base) == NVTE_COMM_SUCCESS, "config_default\n");
  g_callback_calls = 0;

  CHECK(nvte_comm_overlap_create(&one, &base, 8, 8, BF, NULL) == INV, "NULL out\n");
  expect_error(INV, "NULL out", "nvte_comm_overlap_create", "`out` is NULL");
  create_fails("NULL bootstrap", NULL, &base, 8, 8, BF, INV, "`bootstrap` is NULL", NULL);
  /* config: one field changed each */
  for (size_t i = 0; i < sizeof bad_configs / sizeof bad_configs[0]; ++i) {
    const ConfigCase *k = &bad_configs[i];
    c = base;
    set_field(&c, k->off, k->size, k->value);
    create_fails(k->what, &one, &c, 8, 8, BF, k->status, k->w1, k->w2);
  }
  /* shape and dtype */
  create_fails("rows 0", &one, &base, 0, 8, BF, INV, "[0, 8] is empty", NULL);
  create_fails("cols 0", &one, &base, 8, 0, BF, INV, "[8, 0] is empty", NULL);
  create_fails("shape overflow", &one, &base, SIZE_MAX / 2, 4, BF, INV, "overflows", NULL);
  create_fails("bytes overflow", &one, &base, (size_t)1 << 32, (size_t)1 << 31, BF, INV, "overflows", NULL);
  create_fails("dtype 99", &one, &base, 8, 8, (NVTEDType)99, INV, "argument `dtype`", "99");
  create_fails("dtype -1", &one, &base, 8, 8, (NVTEDType)-1, INV, "argument `dtype`", NULL);
  create_fails("dtype int32", &one, &base, 8, 8, kNVTEInt32, UNS, "kNVTEInt32 is not supported", NULL);
  create_fails("dtype fp4", &one, &base, 8, 8, kNVTEFloat4E2M1, UNS, "not supported", NULL);
  /* bootstrap */
  bad = callbacks(2, 2);
  create_fails("rank 2 of 2", &bad, &base, 8, 8, BF, INV, "world_rank = 2 and world_size = 2", NULL);
  bad = callbacks(0, 0);
  create_fails("size 0", &bad, &base, 8, 8, BF, INV, "world_size = 0", NULL);
  bad = callbacks(-1, 4);
  create_fails("rank -1", &bad, &base, 8, 8, BF, INV, "world_rank = -1", NULL);
  bad = callbacks(0, -5);
  create_fails("size -5", &bad, &base, 8, 8, BF, INV, "world_size = -5", NULL);
  bad = callbacks(0, 1); bad.allgather = NULL;
  create_fails("no allgather", &bad, &base, 8, 8, BF, INV, "allgather is NULL", NULL);
  bad = callbacks(0, 1); bad.barrier = NULL;
  create_fails("no barrier", &bad, &base, 8, 8, BF, INV, "barrier is NULL", NULL);
  CHECK(g_callback_calls == 0, "the callbacks were called %d times during argument checks\n", g_callback_calls);
  /* against the world size: checked once the bootstrap is known, and then told to the
   * peers in one allgather (so that they fail with this rank instead of waiting for it) */
  c = base; c.tp_size = 3;
  create_fails("tp 3 of 4", &four, &c, 12, 8, BF, INV, "tp_size = 3", "world size 4");
  create_fails("rows 6 over tp 4", &four, &base, 6, 8, BF, INV, "rows = 6", "tp_size = 4");
  CHECK(g_callback_calls == 2, "a failed check against the world size: %d callback calls, expected one allgather each\n",
        g_callback_calls);

  /* Valid arguments: without a GPU the failure names what is missing (never a crash). */
  if (nvte_comm_device_count() == 0) {
    NVTECommOverlap *o = (NVTECommOverlap *)0x1;
    NVTECommStatus s = nvte_comm_overlap_create(&one, &base, 8, 8, BF, &o);
    CHECK((s == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || s == NVTE_COMM_ERROR_CUDA) && o == NULL,
          "valid create without a GPU: %s\n", nvte_comm_status_string(s));
    CHECK(strncmp(nvte_comm_last_error(), "nvte_comm_overlap_create: ", 26) == 0, "message prefix\n");
  }
}

/* ---- handles of the overlap engine, comm-GEMM contexts and NCCL helpers ---- */

static void test_handles_and_out_params(void) {
  const NVTECommStatus INV = NVTE_COMM_ERROR_INVALID_ARGUMENT;
  NVTECommOverlap *fake_ov = (NVTECommOverlap *)(uintptr_t)0xABC0C;
  NVTECommGemmCtx *fake_ctx = (NVTECommGemmCtx *)(uintptr_t)0x5EED;
  NVTETensor t = NULL, a;
  int32_t tp = 77, rank = 77;
  uint8_t id[128];
  size_t two[2] = {8, 8};
  CHECK(nvte_comm_tensor_create_simple((void *)0x1000, kNVTEBFloat16, two, 2, &a) == NVTE_COMM_SUCCESS, "tensor\n");

  CHECK(nvte_comm_overlap_tp(fake_ov, &tp, &rank) == INV && tp == 0 && rank == 0, "tp on a dead object: out-params 0\n");
  expect_error(INV, "tp dead", "nvte_comm_overlap_tp", "not a live overlap object");
  tp = rank = 77;
  CHECK(nvte_comm_overlap_tp(NULL, &tp, &rank) == INV && tp == 0 && rank == 0, "tp on NULL\n");
  t = (NVTETensor)0x1;
  CHECK(nvte_comm_overlap_get_buffer(fake_ov, true, &t) == INV && t == NULL, "get_buffer on a dead object\n");
  CHECK(nvte_comm_overlap_get_buffer(fake_ov, true, NULL) == INV, "get_buffer NULL out\n");
  CHECK(nvte_comm_overlap_copy_into_buffer(fake_ov, a, true, NULL) == INV, "copy_into_buffer on a dead object\n");
  CHECK(nvte_comm_overlap_synchronize(NULL) == INV, "synchronize NULL\n");
  expect_error(INV, "synchronize NULL", "nvte_comm_overlap_synchronize", "`overlap` is NULL");
  CHECK(nvte_comm_overlap_destroy(fake_ov) == INV, "destroy a dead object\n");
  expect_error(INV, "destroy dead", "nvte_comm_overlap_destroy", "not a live overlap object");
  CHECK(nvte_comm_overlap_destroy(NULL) == NVTE_COMM_SUCCESS, "destroy NULL is a no-op\n");
  CHECK(nvte_comm_overlap_split_rs(fake_ov, a, true, a, false, NULL, NULL, NULL, false, NULL, false, false, a, NULL) == INV,
        "split_rs on a dead object\n");
  CHECK(nvte_comm_overlap_split_rs_p2p(NULL, a, true, a, false, NULL, NULL, NULL, false, NULL, false, false, a, NULL) == INV,
        "split_rs_p2p on NULL\n");
  CHECK(nvte_comm_overlap_bulk(fake_ov, (NVTECommOverlapType)5, a, true, a, false, a, NULL, NULL, false, NULL, false, false,
                               NULL, NULL, NULL) == INV,
        "bulk with comm_type 5\n");
  expect_error(INV, "bulk type", "nvte_comm_overlap_bulk", "comm_type");

  /* comm-GEMM contexts */
  CHECK(nvte_comm_gemm_numroc(NULL, 10) == 0, "numroc NULL ctx\n");
  expect_error(INV, "numroc NULL", "nvte_comm_gemm_numroc", "`ctx` is NULL");
  CHECK(nvte_comm_gemm_numroc(fake_ctx, 10) == 0, "numroc dead ctx\n");
  expect_error(INV, "numroc dead", "nvte_comm_gemm_numroc", "not a live context");
  nvte_all_gather_gemm(fake_ctx, 8, 8, 8, a, a, a, NULL, NULL, true, false, false, false, 0, NULL, kNVTECommGemmAlgoDefault);
  expect_error(INV, "ag dead ctx", "nvte_all_gather_gemm", "not a live context");
  nvte_gemm_reduce_scatter(NULL, 8, 8, 8, a, a, a, NULL, NULL, true, false, false, false, 0, NULL, kNVTECommGemmAlgoDefault);
  expect_error(INV, "rs NULL ctx", "nvte_gemm_reduce_scatter", "`ctx` is NULL");
  nvte_gemm_all_reduce(fake_ctx, -1, 8, 8, a, a, a, NULL, NULL, true, false, false, false, -1, NULL, (NVTECommGemmAlgoType)9);
  expect_error(INV, "ar dead ctx", "nvte_gemm_all_reduce", "not a live context");
  nvte_comm_gemm_ctx_destroy(fake_ctx);
  expect_error(INV, "ctx destroy dead", "nvte_comm_gemm_ctx_destroy", "not a live context");
  nvte_comm_gemm_ctx_destroy(NULL);
  expect_ok("ctx destroy NULL");

  /* NCCL helpers: arguments, and only communicators of nvte_comm_nccl_comm_init_rank are destroyed */
  CHECK(nvte_comm_nccl_comm_destroy((ncclComm_t)(uintptr_t)0xDEAD0) == INV, "destroy a foreign communicator\n");
  expect_error(INV, "comm destroy foreign", "nvte_comm_nccl_comm_destroy", "not a live communicator");
  CHECK(nvte_comm_nccl_comm_destroy(NULL) == INV, "destroy a NULL communicator\n");
  memset(id, 0x77, sizeof id);
  CHECK(nvte_comm_nccl_get_unique_id(id, 16) == INV && all_zero(id, 16) && id[16] == 0x77, "unique id, short buffer\n");
  {
    ncclComm_t comm = (ncclComm_t)0x1;
    CHECK(nvte_comm_nccl_comm_init_rank(id, 128, 2, 2, &comm) == INV && comm == NULL, "init_rank rank 2 of 2\n");
    comm = (ncclComm_t)0x1;
    CHECK(nvte_comm_nccl_comm_init_rank(NULL, 128, 1, 0, &comm) == INV && comm == NULL, "init_rank NULL id\n");
  }
  {
    NVTEBasicTensor got;
    size_t written = 9;
    memset(&got, 0x33, sizeof got);
    nvte_get_tensor_param_v2((NVTETensor)(uintptr_t)0x1234, kNVTERowwiseData, &got, sizeof got, &written);
    CHECK(nvte_comm_last_status() == INV && written == 0 && got.data_ptr == NULL && got.shape.ndim == 0,
          "get_tensor_param_v2 out-params on error\n");
  }
  nvte_destroy_tensor(a);
}

/* nvte_comm_gemm_call_packed: every bad input is refused with INVALID_ARGUMENT and a
 * message naming the argument, before any device work (a one-rank context over
 * callbacks needs no GPU to exist). */
static int32_t one_rank_allgather(void *user, void *global, size_t global_bytes, const void *local, size_t local_bytes) {
  (void)user;
  if (global_bytes != local_bytes) return 1;
  memcpy(global, local, local_bytes);
  return 0;
}
static int32_t one_rank_barrier(void *user) {
  (void)user;
  return 0;
}

static NVTECommGemmOperand packed_operand(uintptr_t data, NVTEDType t, uint32_t ndim, size_t d0, size_t d1) {
  NVTECommGemmOperand o;
  memset(&o, 0, sizeof o);
  o.data = (void *)data;
  o.dtype = t;
  o.ndim = ndim;
  o.shape[0] = d0;
  o.shape[1] = d1;
  return o;
}

static void test_gemm_call_packed(void) {
  const NVTECommStatus INV = NVTE_COMM_ERROR_INVALID_ARGUMENT;
  NVTECommGemmCtx *fake_ctx = (NVTECommGemmCtx *)(uintptr_t)0x5EED;
  NVTECommGemmCtx *ctx = NULL;
  NVTECommBootstrap bs;
  NVTECommGemmPacked p, q;
  memset(&bs, 0, sizeof bs);
  bs.world_rank = 0;
  bs.world_size = 1;
  bs.allgather = one_rank_allgather;
  bs.barrier = one_rank_barrier;
  CHECK(nvte_comm_gemm_ctx_create_bootstrap(&bs, &ctx) == NVTE_COMM_SUCCESS && ctx != NULL, "one-rank callback context\n");

  memset(&p, 0, sizeof p);
  p.op = NVTE_COMM_GEMM_PACKED_ALL_GATHER;
  p.m = 16;
  p.n = 32;
  p.k = 64;
  p.a = packed_operand(0x1000, kNVTEBFloat16, 2, 16, 64);
  p.b = packed_operand(0x2000, kNVTEBFloat16, 2, 32, 64);
  p.d = packed_operand(0x3000, kNVTEBFloat16, 2, 32, 16);
  p.transa = true;
  p.algo = kNVTECommGemmAlgoDefault;

  CHECK(nvte_comm_gemm_call_packed(ctx, NULL) == INV, "packed: NULL args\n");
  expect_error(INV, "packed NULL args", "nvte_comm_gemm_call_packed", "`args` is NULL");
  CHECK(nvte_comm_gemm_call_packed(NULL, &p) == INV, "packed: NULL ctx\n");
  expect_error(INV, "packed NULL ctx", "nvte_comm_gemm_call_packed", "`ctx` is NULL");
  CHECK(nvte_comm_gemm_call_packed(fake_ctx, &p) == INV, "packed: dead ctx\n");
  expect_error(INV, "packed dead ctx", "nvte_comm_gemm_call_packed", "not a live context");

  q = p;
  q.op = 3;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: op 3\n");
  expect_error(INV, "packed op", "`args->op` = 3", "all-reduce");
  q = p;
  q.algo = (NVTECommGemmAlgoType)9;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: algo 9\n");
  expect_error(INV, "packed algo", "`args->algo`", "NVTECommGemmAlgoType");
  q = p;
  q.a.data = NULL;
  q.a.ndim = 0;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: no A\n");
  expect_error(INV, "packed no a", "operand `a` has ndim = 0", "required");
  q = p;
  q.b.ndim = 3;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: ndim 3\n");
  expect_error(INV, "packed ndim", "operand `b`", "ndim = 3");
  q = p;
  q.d.ndim = 0;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: data with ndim 0\n");
  expect_error(INV, "packed ndim 0", "operand `d`", "ndim = 0");
  q = p;
  q.b.dtype = (NVTEDType)42;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: dtype 42\n");
  expect_error(INV, "packed dtype", "operand `b`", "not a valid NVTEDType");
  q = p;
  q.a.shape[0] = SIZE_MAX;
  q.a.shape[1] = 4;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: overflowing shape\n");
  expect_error(INV, "packed overflow", "nvte_comm_gemm_call_packed", "overflows");
  q = p;
  q.bias = packed_operand(0x4000, kNVTEBFloat16, 3, 16, 1);
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: bias ndim 3\n");
  expect_error(INV, "packed bias", "operand `bias`", "ndim = 3");
  q = p;
  q.op = NVTE_COMM_GEMM_PACKED_ALL_REDUCE;
  q.m = -1;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: m -1\n");
  expect_error(INV, "packed m", "nvte_comm_gemm_call_packed", "m = -1");
  q = p;
  q.op = NVTE_COMM_GEMM_PACKED_REDUCE_SCATTER;
  q.comm_sm_count = -2;
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: comm_sm_count -2\n");
  expect_error(INV, "packed comm_sm_count", "nvte_comm_gemm_call_packed", "comm_sm_count");
  /* Operand shapes are checked before any driver call: on a machine without a GPU a
   * wrong shape is INVALID_ARGUMENT naming the tensor, not "library not found". */
  q = p;
  q.d = packed_operand(0x3000, kNVTEBFloat16, 2, 31, 16);
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: D shape\n");
  expect_error(INV, "packed d shape", "tensor `d` has shape", "must be [32, 16]");
  q = p;
  q.op = NVTE_COMM_GEMM_PACKED_REDUCE_SCATTER;
  q.a = packed_operand(0x1000, kNVTEBFloat16, 2, 16, 63);
  CHECK(nvte_comm_gemm_call_packed(ctx, &q) == INV, "packed: A shape (reduce-scatter)\n");
  expect_error(INV, "packed a shape", "tensor `a` has shape", "k is split");
  {
    /* The TE-API entry: nvte_all_gather_gemm with a B of the wrong shape. */
    size_t da[2] = {16, 64}, db[2] = {32, 60}, dd[2] = {32, 16};
    NVTETensor ta = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING), tb = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING),
               td = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
    NVTEBasicTensor ba = {(void *)0x1000, kNVTEBFloat16, nvte_make_shape(da, 2)};
    NVTEBasicTensor bb = {(void *)0x2000, kNVTEBFloat16, nvte_make_shape(db, 2)};
    NVTEBasicTensor bd = {(void *)0x3000, kNVTEBFloat16, nvte_make_shape(dd, 2)};
    nvte_set_tensor_param_v2(ta, kNVTERowwiseData, &ba, sizeof ba);
    nvte_set_tensor_param_v2(tb, kNVTERowwiseData, &bb, sizeof bb);
    nvte_set_tensor_param_v2(td, kNVTERowwiseData, &bd, sizeof bd);
    nvte_all_gather_gemm(ctx, 16, 32, 64, ta, tb, td, NULL, NULL, true, false, false, false, 0, NULL,
                         kNVTECommGemmAlgoDefault);
    expect_error(INV, "all_gather_gemm b shape", "tensor `b` has shape", "must be [32, 64]");
    nvte_destroy_tensor(ta);
    nvte_destroy_tensor(tb);
    nvte_destroy_tensor(td);
  }
  nvte_comm_gemm_ctx_destroy(ctx);
  expect_ok("packed: ctx destroy");
}

/* nvte_comm_cast_packed: the struct's own checks (steps, dtypes, the pointers a requested
 * step needs, the update's algorithm) refuse with INVALID_ARGUMENT, naming the field,
 * before any device work (no GPU needed). */
static void cast_refused(const NVTECommCastPacked *q, const char *what, const char *w1, const char *w2) {
  CHECK(nvte_comm_cast_packed(q) == NVTE_COMM_ERROR_INVALID_ARGUMENT, "cast packed: %s accepted\n", what);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, what, w1, w2);
}

/* Case i of test_cast_packed: one field of a valid struct made bad. The cases after the
 * overflow are what a later step's kernel would refuse, refused before the first step
 * (on a GPU they would otherwise have written amax, scale or outputs). */
static void cast_bad_case(int i, NVTECommCastPacked *q) {
  switch (i) {
  case 0: q->steps = 0; break;
  case 1: q->steps = 16; break;
  case 2: q->fp8_dtype = kNVTEBFloat16; break;
  case 3: q->input_dtype = (NVTEDType)42; break;
  case 4: q->scale = NULL; break;
  case 5: q->steps = NVTE_COMM_CAST_AMAX; q->amax = NULL; break;
  case 6: q->rowwise = NULL; break;
  case 7: q->history_len = 0; break;
  case 8: q->amax_compute_algo = 2; break;
  case 9: q->rows = SIZE_MAX; q->cols = 4; break;
  case 10: q->input_dtype = kNVTEFloat8E4M3; break;
  case 11: q->input = NULL; break;
  case 12: q->steps = NVTE_COMM_CAST_AMAX | NVTE_COMM_CAST_SCALE; q->amax_epsilon = -1.0f; break;
  case 13: q->margin = NAN; break;
  default: break;
  }
}

static void test_cast_packed(void) {
  static const char *const cases[][3] = {
    {"cast packed steps 0", "`args->steps` = 0x0", "NVTE_COMM_CAST_AMAX"},
    {"cast packed steps 16", "`args->steps` = 0x10", "not a set of steps"},
    {"cast packed fp8_dtype", "`args->fp8_dtype`", "kNVTEFloat8E4M3"},
    {"cast packed input_dtype", "nvte_comm_cast_packed", "not a valid NVTEDType"},
    {"cast packed scale", "`args->scale` is NULL", "step needs it"},
    {"cast packed amax", "`args->amax` is NULL", "step needs it"},
    {"cast packed outputs", "`args->rowwise` and `args->columnwise`", "writes neither"},
    {"cast packed history", "`args->history_len` is 0", "needs the history"},
    {"cast packed algo", "`args->amax_compute_algo` = 2", "most_recent"},
    {"cast packed overflow", "nvte_comm_cast_packed", "overflows"},
    {"cast packed FP8 input", "`args->input_dtype` is kNVTEFloat8E4M3", "bfloat16"},
    {"cast packed NULL input", "`args->input` is NULL", "16 x 64"},
    {"cast packed epsilon", "`args->amax_epsilon` = -1", ">= 0"},
    {"cast packed margin", "`args->margin` = NaN", "finite"},
  };
  size_t i;
  NVTECommCastPacked p, q;
  memset(&p, 0, sizeof p);
  p.steps = NVTE_COMM_CAST_QUANTIZE | NVTE_COMM_CAST_UPDATE;
  p.input = (const void *)0x1000;
  p.input_dtype = kNVTEBFloat16;
  p.rows = 16;
  p.cols = 64;
  p.fp8_dtype = kNVTEFloat8E4M3;
  p.rowwise = (void *)0x2000;
  p.scale = (float *)0x3000;
  p.amax = (float *)0x3010;
  p.scale_inv = (float *)0x3020;
  p.amax_history = (float *)0x3010;
  p.history_len = 16;
  p.amax_compute_algo = 1;

  cast_refused(NULL, "cast packed NULL args", "nvte_comm_cast_packed", "`args` is NULL");
  for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    q = p;
    cast_bad_case((int)i, &q);
    cast_refused(&q, cases[i][0], cases[i][1], cases[i][2]);
  }
}

/* nvte_comm_cublas_gemm_packed: nvte_cublas_gemm's checks, from a packed struct, before
 * any device work; an empty output launches nothing (no GPU needed). */
static void test_cublas_gemm_packed(void) {
  const NVTECommStatus INV = NVTE_COMM_ERROR_INVALID_ARGUMENT;
  NVTECommGemmPacked p, q;
  memset(&p, 0, sizeof p);
  p.op = NVTE_COMM_GEMM_PACKED_GEMM;
  p.a = packed_operand(0x1000, kNVTEBFloat16, 2, 16, 64); /* TN: A [m, k] */
  p.b = packed_operand(0x2000, kNVTEBFloat16, 2, 32, 64); /* B [n, k] */
  p.d = packed_operand(0x3000, kNVTEBFloat16, 2, 32, 16); /* D [n, m] */
  p.transa = true;

  CHECK(nvte_comm_cublas_gemm_packed(NULL, NULL, 0, false, 0) == INV, "gemm packed: NULL args\n");
  expect_error(INV, "gemm packed NULL args", "nvte_comm_cublas_gemm_packed", "`args` is NULL");
  q = p;
  q.op = NVTE_COMM_GEMM_PACKED_ALL_GATHER;
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: op 0\n");
  expect_error(INV, "gemm packed op", "`args->op` = 0", "nvte_comm_gemm_call_packed");
  CHECK(nvte_comm_gemm_call_packed(NULL, &p) == INV, "call_packed: a local GEMM\n");
  expect_error(INV, "call_packed op 3", "`args->op` = 3", "nvte_comm_cublas_gemm_packed");
  CHECK(nvte_comm_cublas_gemm_packed(&p, NULL, 4096, false, 0) == INV, "gemm packed: NULL workspace\n");
  expect_error(INV, "gemm packed workspace", "`workspace` is NULL", "workspace_bytes = 4096");
  q = p;
  q.a.data = NULL;
  q.a.ndim = 0;
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: no A\n");
  expect_error(INV, "gemm packed no a", "operand `a` has ndim = 0", "required");
  q = p;
  q.d = packed_operand(0x3000, kNVTEBFloat16, 2, 31, 16);
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: D shape\n");
  expect_error(INV, "gemm packed d shape", "tensor `D` has shape", "[32, 16]");
  q = p;
  q.b = packed_operand(0x2000, kNVTEBFloat16, 2, 32, 60);
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: k\n");
  expect_error(INV, "gemm packed k", "inner dimensions differ", "k = 60");
  q = p;
  q.bias = packed_operand(0x4000, kNVTEBFloat16, 1, 17, 0);
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: bias length\n");
  expect_error(INV, "gemm packed bias", "tensor `bias` has 17 elements", "16");
  q = p;
  q.transb = true;
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == INV, "gemm packed: TT\n");
  expect_error(INV, "gemm packed TT", "layout TT", NULL);
  CHECK(nvte_comm_cublas_gemm_packed(&p, NULL, 0, false, -1) == INV, "gemm packed: math_sm_count -1\n");
  expect_error(INV, "gemm packed sm", "math_sm_count", ">= 0");
  /* An empty output (n = 0) is a valid call that launches nothing. */
  q = p;
  q.b = packed_operand(0, kNVTEBFloat16, 2, 0, 64);
  q.d = packed_operand(0, kNVTEBFloat16, 2, 0, 16);
  CHECK(nvte_comm_cublas_gemm_packed(&q, NULL, 0, false, 0) == NVTE_COMM_SUCCESS, "gemm packed: empty\n");
  expect_ok("gemm packed: empty output");
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

/* The quantization API (TE's cast.h / recipe.h / transpose.h and NVTEQuantizationConfig):
 * every bad input is reported before any device work. */
static void set(NVTETensor t, NVTETensorParam param, void *p, NVTEDType dt, size_t ndim, const size_t *dims) {
  NVTEBasicTensor b = basic(p, dt, ndim, dims);
  nvte_set_tensor_param_v2(t, param, &b, sizeof b);
}

/* nvte_cublas_gemm_v2's matmul config (TE's attribute values and sizes, the handle table's
   checks) and the argument errors of nvte_cublas_gemm_v2 / _scaled and of block-scaled GEMMs,
   all detected before any device work. */
static void test_matmul_config_and_gemm_v2(void) {
  void *p = (void *)0x10000, *s = (void *)0x20000;
  size_t sz = 0, sd[2], sa[2] = {4, 32}, sb[2] = {4, 16}; /* 1D GEMM-ready scales of [32|16, 512] */
  uint8_t u8 = 1;
  int32_t sm = 8, got = 0;
  float one = 1.0f, zero = 0.0f;
  NVTEMatmulConfig cfg = nvte_create_matmul_config(), dead = nvte_create_matmul_config();
  NVTETensor a = make(p, kNVTEBFloat16, 32, 64), b = make(p, kNVTEBFloat16, 16, 64);
  NVTETensor d = make(p, kNVTEBFloat16, 16, 32), c = make(p, kNVTEBFloat16, 16, 32);
  NVTETensor a1 = nvte_create_tensor(NVTE_BLOCK_SCALING_1D), b2 = nvte_create_tensor(NVTE_BLOCK_SCALING_2D);
  NVTETensor a2 = nvte_create_tensor(NVTE_BLOCK_SCALING_2D), pt = make(p, kNVTEFloat8E4M3, 16, 512);
  NVTETensor a1n = nvte_create_tensor(NVTE_BLOCK_SCALING_1D);
  CHECK(cfg != NULL && dead != NULL && a1 != NULL && b2 != NULL, "create config / block tensors\n");
  CHECK(kNVTEMatmulConfigBiasTensor == 0 && kNVTEMatmulConfigEpilogueAuxTensor == 4 &&
            kNVTEMatmulConfigSMCount == 6 && kNVTEMatmulConfigNumAttributes == 7,
        "NVTEMatmulConfigAttribute values\n");
  nvte_destroy_matmul_config(dead);
  expect_ok("destroy matmul config");

  /* Sizes (a NULL buffer asks for them), round trip, errors. */
  nvte_get_matmul_config_attribute(cfg, kNVTEMatmulConfigBiasTensor, NULL, 0, &sz);
  CHECK(sz == sizeof(NVTETensor), "bias attribute size: %zu\n", sz);
  nvte_get_matmul_config_attribute(cfg, kNVTEMatmulConfigWithGELUEpilogue, NULL, 0, &sz);
  CHECK(sz == 1, "gelu attribute size: %zu\n", sz);
  nvte_get_matmul_config_attribute(cfg, kNVTEMatmulConfigSMCount, NULL, 0, &sz);
  CHECK(sz == sizeof(int32_t), "sm count attribute size: %zu\n", sz);
  nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigSMCount, &sm, sizeof sm);
  expect_ok("set sm count");
  nvte_get_matmul_config_attribute(cfg, kNVTEMatmulConfigSMCount, &got, sizeof got, &sz);
  CHECK(got == 8, "sm count round trip: %d\n", got);
  nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigSMCount, &sm, 2);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "sm count too small buffer", "size_in_bytes", "4 bytes");
  nvte_set_matmul_config_attribute(cfg, (NVTEMatmulConfigAttribute)7, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "bad matmul attribute", "attr", "NVTEMatmulConfigAttribute");
  nvte_set_matmul_config_attribute(NULL, kNVTEMatmulConfigWithGELUEpilogue, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL matmul config", "config", "NULL");
  nvte_set_matmul_config_attribute(dead, kNVTEMatmulConfigWithGELUEpilogue, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "destroyed matmul config", "not a live matmul config", NULL);
  nvte_get_matmul_config_attribute(cfg, kNVTEMatmulConfigSMCount, &got, 1, &sz);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "get too small", "size_in_bytes", NULL);

  /* nvte_cublas_gemm_v2's own arguments. */
  nvte_cublas_gemm_v2(1, 0, &one, a, b, &zero, c, d, NULL, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "v2 C != D", "nvte_cublas_gemm_v2", "`C` and `D` differ");
  nvte_cublas_gemm_v2(1, 0, NULL, a, b, &zero, d, d, NULL, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "v2 NULL alpha", "`alpha` is NULL", NULL);
  nvte_cublas_gemm_v2(1, 0, &one, a, b, &zero, d, d, NULL, dead, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "v2 destroyed config", "not a live matmul config", NULL);
  nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigWithDGELUEpilogue, &u8, 1);
  nvte_cublas_gemm_v2(1, 0, &one, a, b, &zero, d, d, NULL, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "v2 dgelu without aux", "without an aux tensor", NULL);
  nvte_cublas_gemm_v2(0, 0, &one, a, b, &zero, d, d, NULL, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "v2 inner dimensions", "inner dimensions", NULL);
  nvte_cublas_gemm_scaled(a, NULL, d, NULL, NULL, true, false, false, NULL, 2.0f, 0.5f, true, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "scaled NULL B", "nvte_cublas_gemm_scaled", "`B` is NULL");

  /* Block-scaled: [32, 512] 1D and [16, 512] 2D operands (fake addresses: refused first). */
  sd[0] = 32; sd[1] = 512;
  set(a1, kNVTERowwiseData, p, kNVTEFloat8E4M3, 2, sd);
  set(a1, kNVTERowwiseScaleInv, s, kNVTEFloat32, 2, sa);
  set(a2, kNVTERowwiseData, p, kNVTEFloat8E4M3, 2, sd);
  sd[0] = 1; sd[1] = 4;
  set(a2, kNVTERowwiseScaleInv, s, kNVTEFloat32, 2, sd);
  sd[0] = 16; sd[1] = 512;
  set(b2, kNVTERowwiseData, p, kNVTEFloat8E4M3, 2, sd);
  sd[0] = 1; sd[1] = 4;
  set(b2, kNVTERowwiseScaleInv, s, kNVTEFloat32, 2, sd);
  expect_ok("block tensor components");
  nvte_cublas_gemm(a2, b2, d, NULL, NULL, true, false, false, NULL, false, true, 0, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "2D x 2D", "nvte_cublas_gemm", "both NVTE_BLOCK_SCALING_2D");
  nvte_cublas_gemm(a1, pt, d, NULL, NULL, true, false, false, NULL, false, true, 0, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "block x per-tensor", "mix block scaling", NULL);
  /* NN reads A's columnwise data: a [512, 32] A with rowwise data only lacks it. */
  sd[0] = 512; sd[1] = 32;
  set(a1n, kNVTERowwiseData, p, kNVTEFloat8E4M3, 2, sd);
  sd[0] = 1; sd[1] = 512;
  set(a1n, kNVTERowwiseScaleInv, s, kNVTEFloat32, 2, sd);
  nvte_cublas_gemm(a1n, b2, d, NULL, NULL, false, false, false, NULL, false, true, 0, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NN without columnwise data", "missing columnwise data", NULL);
  set(b2, kNVTERowwiseScaleInv, s, kNVTEFloat32, 2, sb);
  nvte_cublas_gemm_v2(1, 0, &one, a1, b2, &zero, d, d, NULL, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "2D operand with 1D scales", "GEMM-ready", "[1, 4]");

  nvte_destroy_matmul_config(cfg);
  nvte_destroy_matmul_config(NULL);
  expect_ok("destroy NULL matmul config");
  CHECK(nvte_comm_live_matmul_config_count() == 0, "leaked matmul configs: %zu\n", nvte_comm_live_matmul_config_count());
  nvte_destroy_tensor(a); nvte_destroy_tensor(b); nvte_destroy_tensor(c); nvte_destroy_tensor(d);
  nvte_destroy_tensor(a1); nvte_destroy_tensor(a2); nvte_destroy_tensor(b2); nvte_destroy_tensor(pt);
  nvte_destroy_tensor(a1n);
}

static void test_quantization_errors(void) {
  void *p = (void *)0x10000, *f = (void *)0x20000;
  size_t one = 1, d3[3] = {2, 3, 4}, t_ok[2] = {64, 32}, t_bad[2] = {32, 64}, h2[2] = {16, 4}, h0 = 0, s4 = 4, s3 = 3;
  size_t sz = 0;
  uint8_t u8 = 1;
  float eps = 0.5f, got = 0.0f, neg = -1.0f;
  NVTEQuantizationConfig cfg = nvte_create_quantization_config(), dead_cfg = nvte_create_quantization_config();
  NVTETensor x = make(p, kNVTEBFloat16, 32, 64), xf8 = make(p, kNVTEFloat8E4M3, 32, 64);
  NVTETensor q = make(p, kNVTEFloat8E4M3, 32, 64), qns = make(p, kNVTEFloat8E4M3, 32, 64);
  NVTETensor bf = make(p, kNVTEBFloat16, 32, 64), noop_bad = make(f, kNVTEBFloat16, 1, 1);
  NVTETensor hist = make(p, kNVTEFloat32, 16, 4), hist_bad = make(p, kNVTEFloat32, 8, 4), scale = NULL, scale3 = NULL;
  NVTETensor hist3 = NULL, hist0 = NULL, x64 = make(p, kNVTEInt64, 32, 64), tr = make(p, kNVTEBFloat16, 64, 32);
  NVTETensor trbad = make(p, kNVTEBFloat16, 64, 31), trf8 = make(p, kNVTEFloat8E4M3, 64, 32);
  CHECK(cfg != NULL && dead_cfg != NULL, "create config\n");
  nvte_destroy_quantization_config(dead_cfg);
  expect_ok("destroy config");
  CHECK(kNVTEQuantizationConfigForcePow2Scales == 0 && kNVTEQuantizationConfigAmaxEpsilon == 1 &&
            kNVTEQuantizationConfigNoopTensor == 2 && kNVTEQuantizationConfigMXFP82DQuantization == 10 &&
            kNVTEQuantizationConfigNumAttributes == 11,
        "NVTEQuantizationConfigAttribute values\n");

  /* Config attributes. */
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &eps, sizeof eps);
  expect_ok("set epsilon");
  nvte_get_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, NULL, 0, &sz);
  CHECK(sz == sizeof(float), "epsilon size query: %zu\n", sz);
  nvte_get_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &got, sizeof got, &sz);
  CHECK(got == 0.5f && sz == sizeof(float), "epsilon round trip: %g\n", (double)got);
  nvte_get_quantization_config_attribute(cfg, kNVTEQuantizationConfigNoopTensor, NULL, 0, &sz);
  CHECK(sz == sizeof(NVTETensor), "noop size: %zu\n", sz);
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &eps, 2);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "epsilon too small buffer", "size_in_bytes", "4 bytes");
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &neg, sizeof neg);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "negative epsilon", "AmaxEpsilon", "-1");
  nvte_set_quantization_config_attribute(cfg, (NVTEQuantizationConfigAttribute)99, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "bad attribute", "attr", "99");
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigForcePow2Scales, NULL, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL buf", "buf", "NULL");
  nvte_set_quantization_config_attribute(NULL, kNVTEQuantizationConfigForcePow2Scales, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL config", "config", "NULL");
  nvte_set_quantization_config_attribute(dead_cfg, kNVTEQuantizationConfigForcePow2Scales, &u8, 1);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "destroyed config", "config", "already destroyed");
  nvte_get_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &got, 1, &sz);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "get too small", "size_in_bytes", NULL);
  nvte_destroy_quantization_config(NULL);
  expect_ok("destroy NULL config");

  /* nvte_quantize / _v2. */
  set(q, kNVTEScale, f, kNVTEFloat32, 1, &one);
  nvte_quantize_v2(NULL, q, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize NULL input", "nvte_quantize_v2", "`input` is NULL");
  nvte_quantize_v2(x, q, dead_cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize destroyed config", "config", NULL);
  nvte_quantize_v2(x, qns, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize without scale", "scale", "kNVTEScale");
  nvte_quantize_v2(xf8, q, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "quantize FP8 input", "`input`", "kNVTEFloat8E4M3");
  set(q, kNVTEColumnwiseData, p, kNVTEFloat8E4M3, 2, t_bad);
  nvte_quantize_v2(x, q, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize columnwise not transposed", "columnwise", "[64, 32]");
  set(q, kNVTEColumnwiseData, p, kNVTEFloat8E5M2, 2, t_ok);
  nvte_quantize_v2(x, q, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize columnwise dtype", "kNVTEFloat8E5M2", "same FP8 type");
  set(bf, kNVTEColumnwiseData, p, kNVTEBFloat16, 2, t_ok);
  nvte_quantize(x, bf, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "quantize columnwise bf16", "columnwise", "FP8 only");
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigNoopTensor, &noop_bad, sizeof noop_bad);
  expect_ok("set noop tensor");
  set(q, kNVTEColumnwiseData, p, kNVTEFloat8E4M3, 2, t_ok);
  nvte_quantize_v2(x, q, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize bf16 noop", "noop", "kNVTEFloat32");
  nvte_quantize_noop(x, q, noop_bad, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize_noop bf16 noop", "nvte_quantize_noop", "noop");

  /* nvte_compute_amax(_with_config). */
  nvte_compute_amax(xf8, q, NULL);
  expect_error(NVTE_COMM_ERROR_UNSUPPORTED, "amax FP8 input", "unquantized", NULL);
  nvte_compute_amax(x, q, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "amax without amax", "amax", "kNVTEAmax");
  nvte_compute_amax(x, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "amax NULL output", "nvte_compute_amax", "`output` is NULL");
  set(q, kNVTEAmax, f, kNVTEFloat32, 1, &one);
  nvte_compute_amax_with_config(x, q, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "amax bad noop", "nvte_compute_amax_with_config", "noop");

  /* nvte_compute_scale_from_amax. */
  {
    NVTETensor none = NULL;
    nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigNoopTensor, &none, sizeof none);
    expect_ok("clear noop tensor");
  }
  nvte_compute_scale_from_amax(q, NULL, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "scale NULL config", "`config` is NULL", NULL);
  nvte_compute_scale_from_amax(x, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "scale of bf16", "must be FP8", "kNVTEBFloat16");
  nvte_compute_scale_from_amax(qns, cfg, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "scale without amax", "amax", NULL);

  /* nvte_delayed_scaling_recipe_amax_and_scale_update. */
  scale = make(f, kNVTEFloat32, 1, 4);
  scale3 = make(f, kNVTEFloat32, 1, 3);
  CHECK(nvte_comm_tensor_create_simple(p, kNVTEFloat32, d3, 3, &hist3) == NVTE_COMM_SUCCESS, "3-D history\n");
  CHECK(nvte_comm_tensor_create_simple(p, kNVTEFloat32, &h0, 1, &hist0) == NVTE_COMM_SUCCESS, "empty history\n");
  (void)h2; (void)s4; (void)s3;
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale, hist, scale, NULL, kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed NULL algo", "amax_compute_algo", "NULL");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale, hist, scale, "mean", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed bad algo", "\"mean\"", "most_recent");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist3, scale, hist3, scale, "max", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed 3-D history", "amax_history", "3 dims");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist0, scale, hist0, scale, "max", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed empty history", "history length 0", NULL);
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale3, hist, scale3, "max", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed scale count", "`scale`", "4 kNVTEFloat32");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale, hist_bad, scale, "max", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed history mismatch", "updated_amax_history", "must match");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale, hist, scale, "max", kNVTEBFloat16, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed bf16 dtype", "fp8_dtype", "kNVTEBFloat16");
  nvte_delayed_scaling_recipe_amax_and_scale_update(hist, scale, hist, scale, "max", kNVTEFloat8E4M3, 0.0f / 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed NaN margin", "margin", NULL);
  nvte_delayed_scaling_recipe_amax_and_scale_update(x, scale, x, scale, "max", kNVTEFloat8E4M3, 0.0f, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "delayed bf16 history", "kNVTEFloat32", NULL);

  /* nvte_transpose. */
  nvte_transpose(hist3, hist3, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "transpose 3-D", "2-D", NULL);
  nvte_transpose(x, trbad, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "transpose shape", "[64, 32]", NULL);
  nvte_transpose(x, trf8, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "transpose dtype", "must match", NULL);
  nvte_transpose(x64, x64, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "transpose int64 shape first", "[64, 32]", NULL);
  nvte_transpose(NULL, tr, NULL);
  expect_error(NVTE_COMM_ERROR_INVALID_ARGUMENT, "transpose NULL", "`input` is NULL", NULL);

  nvte_destroy_quantization_config(cfg);
  CHECK(nvte_comm_live_quantization_config_count() == 0, "leaked configs: %zu\n",
        nvte_comm_live_quantization_config_count());
  nvte_destroy_tensor(x); nvte_destroy_tensor(xf8); nvte_destroy_tensor(q); nvte_destroy_tensor(qns);
  nvte_destroy_tensor(bf); nvte_destroy_tensor(noop_bad); nvte_destroy_tensor(hist); nvte_destroy_tensor(hist_bad);
  nvte_destroy_tensor(scale); nvte_destroy_tensor(scale3); nvte_destroy_tensor(hist3); nvte_destroy_tensor(hist0);
  nvte_destroy_tensor(x64); nvte_destroy_tensor(tr); nvte_destroy_tensor(trbad); nvte_destroy_tensor(trf8);
}

int main(void) {
  test_enums();
  test_tensor_api();
  test_tensor_errors();
  test_gemm_errors();
  test_quantization_errors();
  test_matmul_config_and_gemm_v2();
  test_ctx_args();
  test_env_knobs();
  test_overlap_create_args();
  test_handles_and_out_params();
  test_gemm_call_packed();
  test_cast_packed();
  test_cublas_gemm_packed();
  test_runtime();
  CHECK(nvte_comm_live_tensor_count() == 0, "leaked tensor handles: %zu\n", nvte_comm_live_tensor_count());
  printf("test_api: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
