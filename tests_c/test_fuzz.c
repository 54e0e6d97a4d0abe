/* C99 fuzz test of the whole C API (include/transformer_engine_comm.h): random calls of
 * every entry point with random handles (live, destroyed, corrupted: flipped bits,
 * neighbours, random values, NULL) and random arguments (enum values in and out of range,
 * shapes up to overflowing ones, NULL out-pointers, short and unaligned buffers, the
 * NVTE_COMM_* environment knobs), checked against a model of the library:
 *   - no crash (the process survives every call);
 *   - a returned status equals nvte_comm_last_status(); SUCCESS <=> nvte_comm_last_error()
 *     is ""; an error message starts with "<function>: "; no caught panic (INTERNAL);
 *   - the tensor API behaves exactly as modelled: a parameter set is what get returns,
 *     every query answers from the model, nvte_comm_live_tensor_count() equals the
 *     model's count of live handles;
 *   - destroyed and corrupted handles (tensors, overlap objects, contexts, communicators)
 *     are rejected as INVALID_ARGUMENT naming the argument, and never act on another live
 *     handle (a sweep compares every live tensor with the model);
 *   - out-parameters have defined values on error (NULL / 0 / empty / zeroed), and a short
 *     buffer is never written;
 *   - argument checks come before anything is loaded: calls with a known-bad argument give
 *     INVALID_ARGUMENT (or UNSUPPORTED where the model says so) on any machine; calls that
 *     pass them need a GPU and fail cleanly here (LIBRARY_NOT_FOUND / CUDA / ...);
 *   - environment knobs: config_default, overlap_create and ctx_create report a bad value
 *     naming the variable, and apply good ones.
 * The GPUs are hidden (CUDA_VISIBLE_DEVICES=""), so the test behaves the same with or
 * without one; where one is usable anyway, calls that could reach the device are always
 * given a bad argument. No NCCL communicator is ever faked where the library would use it.
 *
 * Usage: test_fuzz [seed] [calls]   (defaults: a fixed seed, 1000000 calls)
 * Closing line: "test_fuzz: N passed, M failed" (N: checked invariants). */
#define _POSIX_C_SOURCE 200112L /* setenv, unsetenv, clock_gettime */
#include "transformer_engine_comm.h"

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ checking */

static unsigned long long passed = 0, failed = 0;
static unsigned long long calls = 0;
static const char *cur_fn = "";
static unsigned long long cur_iter = 0;

#define MAX_REPORTED 400
#define CHECK(cond, ...)                                                                             \
  do {                                                                                               \
    if (cond) {                                                                                      \
      ++passed;                                                                                      \
    } else {                                                                                         \
      if (++failed <= MAX_REPORTED) {                                                                \
        printf("FAIL %s:%d (call %llu, %s): ", __FILE__, __LINE__, cur_iter, cur_fn);                \
        printf(__VA_ARGS__);                                                                         \
        printf("  [status %s, last error: %s]\n", nvte_comm_status_string(nvte_comm_last_status()), \
               nvte_comm_last_error());                                                              \
      }                                                                                              \
    }                                                                                                \
  } while (0)

/* ------------------------------------------------------------------ random numbers */

static uint64_t rng_state;

static uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }
static int chance(unsigned percent) { return below(100) < percent; }

/* Sizes: 0, small, medium, or huge (overflowing products). */
static size_t rdim(void) {
  switch (below(10)) {
    case 0: return 0;
    case 1: case 2: case 3: case 4: case 5: return (size_t)(1 + below(64));
    case 6: case 7: return (size_t)(1 + below((uint64_t)1 << 20));
    case 8: return (size_t)1 << (32 + below(31));
    default: return chance(50) ? SIZE_MAX : (size_t)rnd();
  }
}

/* An enum value: mostly in range [0, n), else just outside or random (incl. "negative"). */
static uint32_t renum(uint32_t n) {
  switch (below(10)) {
    case 0: return n + (uint32_t)below(3);
    case 1: return (uint32_t)rnd();
    case 2: return 0xFFFFFFFFu;
    default: return (uint32_t)below(n);
  }
}

static int64_t ri64(void) {
  switch (below(8)) {
    case 0: return 0;
    case 1: return -(int64_t)below(1000) - 1;
    case 2: return INT64_MAX;
    case 3: return INT64_MIN;
    case 4: return (int64_t)rnd();
    default: return (int64_t)below(4096);
  }
}

static int32_t ri32(void) {
  switch (below(8)) {
    case 0: return 0;
    case 1: return -(int32_t)below(100) - 1;
    case 2: return INT32_MAX;
    case 3: return INT32_MIN;
    case 4: return (int32_t)(uint32_t)rnd();
    default: return (int32_t)below(64);
  }
}

static int g_stream_any; /* whether garbage stream values are safe (no usable device) */
static cudaStream_t rstream(void) {
  switch (below(10)) {
    case 0: return (cudaStream_t)(uintptr_t)1; /* cudaStreamLegacy */
    case 1: return (cudaStream_t)(uintptr_t)2; /* cudaStreamPerThread */
    case 2: return g_stream_any ? (cudaStream_t)(uintptr_t)(rnd() | 0x1000) : NULL;
    default: return NULL;
  }
}

static void *rptr(void) {
  switch (below(6)) {
    case 0: return NULL;
    case 1: return (void *)(uintptr_t)rnd();
    default: return (void *)(uintptr_t)(0x10000 + 256 * below(1 << 20));
  }
}

/* ------------------------------------------------------------------ model: tensors */

#define NPARAM 7
#define MAX_LIVE 48
#define MAX_DEAD 512

static const unsigned BITS[11] = {8, 16, 32, 64, 32, 16, 16, 8, 8, 8, 4};

typedef struct {
  NVTETensor h;
  NVTEBasicTensor p[NPARAM];
} TModel;

static TModel live[MAX_LIVE];
static size_t nlive = 0;
static NVTETensor dead[MAX_DEAD];
static size_t ndead = 0, dead_next = 0;

static NVTEShape empty_shape(void) {
  NVTEShape s;
  memset(&s, 0, sizeof s);
  return s;
}

/* What an unset parameter reads as: NULL, float32, shape [0]. */
static NVTEBasicTensor unset_param(void) {
  NVTEBasicTensor b;
  memset(&b, 0, sizeof b);
  b.dtype = kNVTEFloat32;
  b.shape.ndim = 1;
  return b;
}

/* What an error reads as: NULL, float32, no dimensions. */
static NVTEBasicTensor error_param(void) {
  NVTEBasicTensor b;
  memset(&b, 0, sizeof b);
  b.dtype = kNVTEFloat32;
  return b;
}

static int same_shape(const NVTEShape *a, const NVTEShape *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < 15; ++i)
    if (a->data[i] != b->data[i]) return 0;
  return 1;
}

static int same_param(const NVTEBasicTensor *a, const NVTEBasicTensor *b) {
  return a->data_ptr == b->data_ptr && a->dtype == b->dtype && same_shape(&a->shape, &b->shape);
}

static void model_add(NVTETensor h) {
  TModel *m = &live[nlive++];
  m->h = h;
  for (int i = 0; i < NPARAM; ++i) m->p[i] = unset_param();
}

static void model_remove(size_t i) {
  dead[dead_next] = live[i].h;
  dead_next = (dead_next + 1) % MAX_DEAD;
  if (ndead < MAX_DEAD) ++ndead;
  live[i] = live[--nlive];
}

static long find_live(NVTETensor h) {
  if (!h) return -1;
  for (size_t i = 0; i < nlive; ++i)
    if (live[i].h == h) return (long)i;
  return -1;
}

/* A handle and what the model knows of it. */
enum { H_NULL, H_LIVE, H_BAD };
typedef struct {
  NVTETensor h;
  int kind;
  long idx; /* H_LIVE: index in live[] */
} Handle;

static uintptr_t corrupt(uintptr_t v) {
  switch (below(6)) {
    case 0: return v ^ ((uintptr_t)1 << below(64));
    case 1: return v ^ ((uintptr_t)1 << below(64)) ^ ((uintptr_t)1 << below(64));
    case 2: return v + 1;
    case 3: return v - 1;
    case 4: return v + 8 * (1 + below(16));
    default: return v ^ ((uintptr_t)0xFF << (8 * below(8)));
  }
}

static Handle classify(NVTETensor h) {
  Handle r;
  r.h = h;
  r.idx = find_live(h);
  r.kind = h == NULL ? H_NULL : r.idx >= 0 ? H_LIVE : H_BAD;
  return r;
}

static Handle rtensor(void) {
  unsigned k = (unsigned)below(100);
  if (k < 10) return classify(NULL);
  if (k < 62 && nlive) return classify(live[below(nlive)].h);
  if (k < 77 && ndead) return classify(dead[below(ndead)]);
  if (k < 90 && (nlive || ndead)) {
    NVTETensor base = nlive && (chance(70) || !ndead) ? live[below(nlive)].h : dead[below(ndead)];
    return classify((NVTETensor)corrupt((uintptr_t)base));
  }
  if (k < 95) return classify((NVTETensor)(uintptr_t)(1 + below(4096)));
  return classify((NVTETensor)(uintptr_t)rnd());
}

/* An optional tensor: NULL far more often. */
static Handle ropt(void) { return chance(50) ? classify(NULL) : rtensor(); }

/* ------------------------------------------------------------------ model: environment */

enum { K_INT, K_BOOL, K_CHOICE };
typedef struct {
  const char *name;
  int kind;
  int64_t lo, hi, def;       /* K_INT; K_BOOL: def; K_CHOICE: def index */
  const char *const *choices; /* K_CHOICE, NULL-terminated */
  /* state */
  int set, valid;
  int64_t value; /* parsed value when set and valid */
} Knob;

static const char *const TRANSPORTS[] = {"auto", "ipc", "nccl", NULL};
static const char *const AR_ALGOS[] = {"auto", "ring", "chunked", NULL};
static const char *const RS_RINGS[] = {"auto", "reduce", "accumulate", NULL};
static const char *const AG_PIECES[] = {"auto", "rows", "k", NULL};
static const char *const FUSED_TILES[] = {"auto", "rule", "narrow", NULL};
static const char *const OVERLAPS[] = {"auto", "on", "off", NULL};

/* In the order nvte_comm_overlap_config_default reads them (the first bad one is named). */
enum { KB_TRANSPORT, KB_TIMEOUT, KB_SPLITS, KB_STREAMS, KB_NUM_SM, KB_USE_CE, KB_AGGREGATE, KB_SM_MARGIN, KB_AR_ALGO, KB_RS_RING, KB_AG_PIECES, KB_FUSED_TILES, KB_OVERLAP, KB_TRACE, NKNOBS };
static Knob knobs[NKNOBS] = {
    {"NVTE_COMM_TRANSPORT", K_CHOICE, 0, 0, 0, TRANSPORTS, 0, 0, 0},
    {"NVTE_COMM_TIMEOUT_MS", K_INT, 1, INT64_MAX, 60000, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_NUM_SPLITS", K_INT, 1, 64, 3, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_MAX_STREAMS", K_INT, 1, 8, 3, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_NUM_SM", K_INT, 1, INT32_MAX, 16, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_USE_CE", K_BOOL, 0, 0, 1, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_AGGREGATE", K_BOOL, 0, 0, 0, NULL, 0, 0, 0},
    {"NVTE_COMM_OVERLAP_SM_MARGIN", K_BOOL, 0, 0, 1, NULL, 0, 0, 0},
    {"NVTE_COMM_AR_ALGO", K_CHOICE, 0, 0, 0, AR_ALGOS, 0, 0, 0},
    {"NVTE_COMM_RS_RING", K_CHOICE, 0, 0, 0, RS_RINGS, 0, 0, 0},
    {"NVTE_COMM_AG_PIECES", K_CHOICE, 0, 0, 0, AG_PIECES, 0, 0, 0},
    {"NVTE_COMM_FUSED_TILES", K_CHOICE, 0, 0, 0, FUSED_TILES, 0, 0, 0},
    {"NVTE_COMM_OVERLAP", K_CHOICE, 0, 0, 0, OVERLAPS, 0, 0, 0},
    {"NVTE_COMM_TRACE", K_BOOL, 0, 0, 0, NULL, 0, 0, 0},
};

static void knob_unset(Knob *k) {
  unsetenv(k->name);
  k->set = 0;
  k->valid = 1;
  k->value = k->def;
}

/* Set `k` to a random value whose validity (and parsed value) the model knows. */
static void knob_random(Knob *k) {
  char v[96];
  int valid = 1;
  int64_t value = k->def;
  unsigned c = (unsigned)below(10);
  if (c == 0) { /* blank: the default */
    strcpy(v, chance(50) ? "" : "  ");
  } else if (k->kind == K_INT) {
    if (c <= 4) {
      int64_t span = k->hi - k->lo;
      value = chance(20) ? (chance(50) ? k->lo : k->hi) : k->lo + (int64_t)below((uint64_t)(span < 1000000 ? span + 1 : 1000000));
      sprintf(v, chance(20) ? " %lld " : chance(10) ? "+%lld" : "%lld", (long long)value);
    } else {
      valid = 0;
      switch (c) {
        case 5: sprintf(v, "%lld", (long long)k->lo - 1); break;
        case 6:
          if (k->hi == INT64_MAX) strcpy(v, "9223372036854775808");
          else sprintf(v, "%lld", (long long)k->hi + 1 + (long long)below(1000));
          break;
        case 7: sprintf(v, "%llu", (unsigned long long)(4294967296ull + k->lo + below(64))); valid = k->hi == INT64_MAX; break;
        case 8: strcpy(v, "123456789012345678901234567890"); break;
        default: {
          static const char *const junk[] = {"abc", "3x", "0x10", "1.5", "1e3", "- 3", "--1", "3 4", "\t7q"};
          strcpy(v, junk[below(sizeof junk / sizeof junk[0])]);
        }
      }
      if (valid) value = (int64_t)strtoll(v, NULL, 10);
    }
  } else if (k->kind == K_BOOL) {
    static const char *const yes[] = {"1", "true", "TRUE", "yes", "On", " 1 "};
    static const char *const no[] = {"0", "false", "No", "off", "OFF", "0 "};
    static const char *const junk[] = {"2", "-1", "enable", "y", "10", "01", "truee", "yes please"};
    if (c <= 3) { strcpy(v, yes[below(6)]); value = 1; }
    else if (c <= 6) { strcpy(v, no[below(6)]); value = 0; }
    else { strcpy(v, junk[below(8)]); valid = 0; }
  } else {
    size_t n = 0;
    while (k->choices[n]) ++n;
    if (c <= 6) {
      size_t i = (size_t)below(n);
      strcpy(v, k->choices[i]);
      if (chance(30)) v[0] = (char)(v[0] - 'a' + 'A'); /* any case */
      value = (int64_t)i;
    } else {
      static const char *const junk[] = {"tcp", "1", "fast", "ncc", "auto,ipc", "ipc2"};
      strcpy(v, junk[below(6)]);
      valid = 0;
    }
  }
  setenv(k->name, v, 1);
  k->set = 1;
  k->valid = valid;
  k->value = valid ? value : k->def;
}

/* First invalid knob among [from, to), or -1. */
static int first_bad_knob(int from, int to) {
  for (int i = from; i < to; ++i)
    if (!knobs[i].valid) return i;
  return -1;
}

/* ------------------------------------------------------------------ per-call invariants */

static NVTECommStatus last_st;

/* After every call of the API as `fn`: the universal invariants. `ret` is the returned
 * status (or -1 for a function that returns none). Returns the status. */
static NVTECommStatus after(const char *fn, int ret) {
  NVTECommStatus st = nvte_comm_last_status();
  const char *msg = nvte_comm_last_error();
  size_t n = strlen(fn);
  CHECK(msg != NULL, "last_error is NULL\n");
  if (!msg) msg = "";
  if (ret >= 0) CHECK((int)st == ret, "returned %d but last_status is %d\n", ret, (int)st);
  CHECK((int)st >= 0 && (int)st <= 10, "status %d out of range\n", (int)st);
  CHECK((st == NVTE_COMM_SUCCESS) == (msg[0] == '\0'), "status %s with message \"%s\"\n", nvte_comm_status_string(st), msg);
  if (st != NVTE_COMM_SUCCESS)
    CHECK(strncmp(msg, fn, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ', "message does not start with \"%s: \": %s\n", fn, msg);
  CHECK(st != NVTE_COMM_ERROR_INTERNAL && strstr(msg, "panic") == NULL, "internal error / panic: %s\n", msg);
  CHECK(nvte_comm_live_tensor_count() == nlive, "live tensor count %zu, model %zu\n", nvte_comm_live_tensor_count(), nlive);
  last_st = st;
  return st;
}

static void expect_status(NVTECommStatus want) {
  CHECK(last_st == want, "status %s, expected %s\n", nvte_comm_status_string(last_st), nvte_comm_status_string(want));
}

static void expect_msg(const char *a, const char *b) {
  const char *m = nvte_comm_last_error();
  CHECK(a == NULL || strstr(m, a) != NULL, "message lacks \"%s\": %s\n", a, m);
  CHECK(b == NULL || strstr(m, b) != NULL, "message lacks \"%s\": %s\n", b, m);
}

/* Statuses a call may give once its arguments passed the checks that need nothing loaded. */
static void expect_device_outcome(int may_succeed) {
  int ok = last_st == NVTE_COMM_ERROR_INVALID_ARGUMENT || last_st == NVTE_COMM_ERROR_UNSUPPORTED ||
           last_st == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || last_st == NVTE_COMM_ERROR_CUDA ||
           last_st == NVTE_COMM_ERROR_CUBLAS || last_st == NVTE_COMM_ERROR_NVRTC ||
           last_st == NVTE_COMM_ERROR_OUT_OF_MEMORY || (may_succeed && last_st == NVTE_COMM_SUCCESS);
  CHECK(ok, "unexpected status %s\n", nvte_comm_status_string(last_st));
}

/* The first bad handle among `hs` (required ones may not be NULL): its name, or NULL. */
typedef struct {
  Handle h;
  const char *name;
  int required;
} Arg;

/* One tensor argument of an entry point: its name in messages, and whether it is required
 * (optional ones may be NULL). A function's table lists them in the order the library
 * checks them. */
typedef struct {
  const char *name;
  int required;
} ArgSpec;

static const ArgSpec GEMM_ARGS[] = {{"A", 1}, {"B", 1}, {"D", 1}, {"bias", 0}, {"pre_gelu_out", 0}, {"workspace", 0}};
static const ArgSpec COPY_ARGS[] = {{"input", 1}};
static const ArgSpec CAST_ARGS[] = {{"input", 1}, {"output", 1}};
static const ArgSpec FILL_ARGS[] = {{"tensor", 1}};
static const ArgSpec SPLIT_AG_ARGS[] = {{"A", 1},           {"B", 1},         {"D", 1},     {"bias", 0},
                                        {"pre_gelu_out", 0}, {"workspace", 0}, {"B_copy", 0}};
static const ArgSpec SPLIT_RS_ARGS[] = {{"A", 1},    {"B", 1},            {"rs_output", 1}, {"D", 0},
                                        {"bias", 0}, {"pre_gelu_out", 0}, {"workspace", 0}};
static const ArgSpec BULK_ARGS[] = {{"A", 1},         {"B", 1},      {"D", 1},        {"bias", 0},
                                    {"pre_gelu_out", 0}, {"workspace", 0}, {"buffer", 0}, {"rs_output", 0}};
#define NARGS(spec) (sizeof(spec) / sizeof((spec)[0]))


/* Random handles for the arguments of `spec` (required: rtensor, optional: ropt). */
static size_t draw_args(Arg *a, const ArgSpec *spec, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    a[i].name = spec[i].name;
    a[i].required = spec[i].required;
    a[i].h = spec[i].required ? rtensor() : ropt();
  }
  return n;
}

static const char *first_bad(const Arg *a, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (a[i].h.kind == H_BAD || (a[i].required && a[i].h.kind == H_NULL)) return a[i].name;
  return NULL;
}

/* An argument list with a bad tensor: INVALID_ARGUMENT naming it. */
static void expect_bad_tensor(const char *name) {
  char want[64];
  expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
  snprintf(want, sizeof want, "tensor `%s`", name);
  expect_msg(want, NULL);
}

/* ------------------------------------------------------------------ the entry points */

enum {
  F_CREATE_TENSOR, F_DESTROY_TENSOR, F_MAKE_SHAPE, F_SET_PARAM, F_GET_PARAM, F_SET_PARAM_V2, F_GET_PARAM_V2,
  F_DATA, F_COL_DATA, F_SHAPE, F_COL_SHAPE, F_NDIMS, F_SIZE, F_NUMEL, F_ELEM_SIZE, F_ELEM_BITS, F_TYPE,
  F_SCALING_MODE, F_AMAX, F_SCALE, F_SCALE_INV, F_SCALE_INV_SHAPE, F_LIVE_COUNT, F_CREATE_SIMPLE,
  F_LAST_ERROR, F_LAST_STATUS, F_CLEAR_ERROR, F_STATUS_STRING, F_VERSION, F_CHECK_RUNTIME, F_DEVICE_COUNT,
  F_CUBLAS_GEMM, F_QUANTIZE, F_DEQUANTIZE, F_FILL_UNIFORM,
  F_CONFIG_DEFAULT, F_OV_CREATE, F_OV_DESTROY, F_OV_TP, F_OV_GET_BUFFER, F_OV_COPY, F_OV_SPLIT_AG, F_OV_SPLIT_RS,
  F_OV_SPLIT_RS_P2P, F_OV_BULK, F_OV_SYNC,
  F_CTX_CREATE, F_CTX_DESTROY, F_NUMROC, F_AG_GEMM, F_GEMM_RS, F_GEMM_AR,
  F_LIBRARY_INFO, F_NCCL_UID, F_NCCL_INIT, F_NCCL_DESTROY,
  NFUNCS
};

static const char *const NAMES[NFUNCS] = {
    "nvte_create_tensor", "nvte_destroy_tensor", "nvte_make_shape", "nvte_set_tensor_param", "nvte_get_tensor_param",
    "nvte_set_tensor_param_v2", "nvte_get_tensor_param_v2", "nvte_tensor_data", "nvte_tensor_columnwise_data",
    "nvte_tensor_shape", "nvte_tensor_columnwise_shape", "nvte_tensor_ndims", "nvte_tensor_size", "nvte_tensor_numel",
    "nvte_tensor_element_size", "nvte_tensor_element_size_bits", "nvte_tensor_type", "nvte_tensor_scaling_mode",
    "nvte_tensor_amax", "nvte_tensor_scale", "nvte_tensor_scale_inv", "nvte_tensor_scale_inv_shape",
    "nvte_comm_live_tensor_count", "nvte_comm_tensor_create_simple", "nvte_comm_last_error", "nvte_comm_last_status",
    "nvte_comm_clear_error", "nvte_comm_status_string", "nvte_comm_version", "nvte_comm_check_runtime",
    "nvte_comm_device_count", "nvte_cublas_gemm", "nvte_quantize", "nvte_dequantize", "nvte_comm_fill_uniform",
    "nvte_comm_overlap_config_default", "nvte_comm_overlap_create", "nvte_comm_overlap_destroy", "nvte_comm_overlap_tp",
    "nvte_comm_overlap_get_buffer", "nvte_comm_overlap_copy_into_buffer", "nvte_comm_overlap_split_ag",
    "nvte_comm_overlap_split_rs", "nvte_comm_overlap_split_rs_p2p", "nvte_comm_overlap_bulk",
    "nvte_comm_overlap_synchronize", "nvte_comm_gemm_ctx_create", "nvte_comm_gemm_ctx_destroy", "nvte_comm_gemm_numroc",
    "nvte_all_gather_gemm", "nvte_gemm_reduce_scatter", "nvte_gemm_all_reduce", "nvte_comm_library_info",
    "nvte_comm_nccl_get_unique_id", "nvte_comm_nccl_comm_init_rank", "nvte_comm_nccl_comm_destroy",
};

static unsigned long long fn_calls[NFUNCS], fn_ok[NFUNCS], fn_invalid[NFUNCS], fn_unsupported[NFUNCS];
/* Calls whose arguments passed every check that needs nothing loaded (they then need a device). */
static unsigned long long reached_device[NFUNCS];
static int gpu_usable = 0;
static NVTECommStatus runtime_status, device_count_status;
static int32_t device_count_value;
static const char *version_ptr;

static void begin(int f) {
  cur_fn = NAMES[f];
  ++fn_calls[f];
  ++calls;
}

static NVTECommStatus end(int f, int ret) {
  NVTECommStatus st = after(NAMES[f], ret);
  if (st == NVTE_COMM_SUCCESS) ++fn_ok[f];
  if (st == NVTE_COMM_ERROR_INVALID_ARGUMENT) ++fn_invalid[f];
  if (st == NVTE_COMM_ERROR_UNSUPPORTED) ++fn_unsupported[f];
  return st;
}

/* A random basic tensor and whether the library must accept it for parameter `param`. */
static NVTEBasicTensor rbasic(uint32_t param, int *valid) {
  NVTEBasicTensor b;
  size_t nd;
  int scalar = param >= 2 && param < NPARAM;
  memset(&b, 0, sizeof b);
  b.data_ptr = rptr();
  b.dtype = (NVTEDType)(scalar && chance(70) ? kNVTEFloat32 : renum(11));
  nd = chance(90) ? (size_t)below(5) : chance(50) ? (size_t)below(16) : (size_t)16 + (size_t)below(1000);
  if (chance(2)) nd = SIZE_MAX;
  b.shape.ndim = nd;
  for (int i = 0; i < 15; ++i) b.shape.data[i] = (size_t)i < nd ? (chance(95) ? (size_t)below(64) : rdim()) : (chance(50) ? 0 : rnd());
  *valid = (uint32_t)b.dtype <= 10 && nd <= 15 && param < NPARAM;
  if (*valid) {
    size_t numel = 1;
    for (size_t i = 0; i < nd; ++i) {
      size_t d = b.shape.data[i];
      if (d != 0 && numel > SIZE_MAX / d) { *valid = 0; break; }
      numel *= d;
    }
    if (*valid && numel > SIZE_MAX / BITS[b.dtype]) *valid = 0;
  }
  if (*valid && scalar && b.dtype != kNVTEFloat32) *valid = 0;
  return b;
}

/* The model's value of a stored parameter (dimensions beyond ndim are zero). */
static NVTEBasicTensor stored(NVTEBasicTensor b) {
  for (size_t i = b.shape.ndim; i < 15; ++i) b.shape.data[i] = 0;
  return b;
}

static void do_create_tensor(void) {
  uint32_t mode = chance(80) ? 0 : chance(50) ? (uint32_t)(1 + below(4)) : renum(101);
  /* Block-scaled tensors (modes 2, 3) are created, checked and destroyed again: the model
     holds per-tensor ones. */
  int block = mode == 2 || mode == 3;
  NVTETensor t;
  if (nlive >= MAX_LIVE) mode = 7, block = 0; /* keep the model bounded: an invalid mode */
  begin(F_CREATE_TENSOR);
  t = nvte_create_tensor((NVTEScalingMode)mode);
  {
    int fresh = t != NULL && find_live(t) < 0;
    if (fresh && !block) model_add(t);
    if (block && t != NULL) nvte_destroy_tensor(t); /* before end() counts the live handles */
    end(F_CREATE_TENSOR, -1);
    if (mode == 0 || block) CHECK(fresh, "a new handle %p (NULL or already live)\n", t);
  }
  if (mode == 0 || block) {
    expect_status(NVTE_COMM_SUCCESS);
  } else {
    expect_status(mode <= 4 ? NVTE_COMM_ERROR_UNSUPPORTED : NVTE_COMM_ERROR_INVALID_ARGUMENT);
    CHECK(t == NULL, "handle %p on error\n", t);
  }
}

static void do_destroy_tensor(void) {
  Handle h = nlive > MAX_LIVE / 2 && chance(60) ? classify(live[below(nlive)].h) : rtensor();
  begin(F_DESTROY_TENSOR);
  nvte_destroy_tensor(h.h);
  if (h.kind == H_LIVE) model_remove((size_t)h.idx);
  end(F_DESTROY_TENSOR, -1);
  if (h.kind == H_BAD) {
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    expect_msg("not a live tensor", NULL);
  } else {
    expect_status(NVTE_COMM_SUCCESS);
  }
}

static void do_make_shape(void) {
  size_t dims[16], nd;
  const size_t *p = dims;
  NVTEShape s;
  int valid;
  for (int i = 0; i < 16; ++i) dims[i] = rdim();
  nd = chance(90) ? (size_t)below(16) : chance(50) ? (size_t)below(100) : (size_t)rnd();
  if (chance(10)) p = NULL;
  valid = nd <= 15 && (p != NULL || nd == 0);
  begin(F_MAKE_SHAPE);
  s = nvte_make_shape(p, nd);
  end(F_MAKE_SHAPE, -1);
  if (valid) {
    NVTEShape want = empty_shape();
    want.ndim = nd;
    for (size_t i = 0; i < nd; ++i) want.data[i] = dims[i];
    expect_status(NVTE_COMM_SUCCESS);
    CHECK(same_shape(&s, &want), "make_shape result differs\n");
  } else {
    NVTEShape e = empty_shape();
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    CHECK(same_shape(&s, &e), "make_shape on error is not empty\n");
  }
}

static void apply_set(Handle h, uint32_t param, const NVTEBasicTensor *b, int valid_value) {
  if (h.kind == H_LIVE && valid_value) {
    expect_status(NVTE_COMM_SUCCESS);
    live[h.idx].p[param] = stored(*b);
  } else {
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
  }
}

static void do_set_param(int v2) {
  Handle h = rtensor();
  uint32_t param = renum(NPARAM);
  int valid;
  NVTEBasicTensor b = rbasic(param, &valid);
  if (!v2) {
    int null_t = chance(5), null_p = chance(5);
    NVTETensor hv = h.h;
    begin(F_SET_PARAM);
    nvte_set_tensor_param(null_t ? NULL : &hv, (NVTETensorParam)param, null_p ? NULL : &b);
    end(F_SET_PARAM, -1);
    if (null_t || null_p) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      expect_msg(null_t ? "`tensor`" : "`param`", "NULL");
    } else {
      apply_set(h, param, &b, valid);
    }
  } else {
    /* The value in a possibly unaligned buffer, with a size that may be short or large. */
    unsigned char raw[sizeof(NVTEBasicTensor) + 16];
    size_t off = (size_t)below(8), size;
    const void *buf = raw + off;
    memcpy(raw + off, &b, sizeof b);
    switch (below(8)) {
      case 0: size = (size_t)below(sizeof b); break;
      case 1: size = sizeof b + (size_t)below(8); break;
      case 2: size = SIZE_MAX; break;
      default: size = sizeof b;
    }
    if (chance(4)) buf = NULL;
    begin(F_SET_PARAM_V2);
    nvte_set_tensor_param_v2(h.h, (NVTETensorParam)param, buf, size);
    end(F_SET_PARAM_V2, -1);
    if (buf == NULL || size < sizeof b) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      expect_msg(buf == NULL ? "`buf` is NULL" : "size_in_bytes", NULL);
    } else {
      apply_set(h, param, &b, valid);
    }
  }
}

static void do_get_param(int v2) {
  Handle h = rtensor();
  uint32_t param = renum(NPARAM);
  int ok = h.kind == H_LIVE && param < NPARAM;
  if (!v2) {
    NVTEBasicTensor got, e = error_param();
    begin(F_GET_PARAM);
    got = nvte_get_tensor_param(h.h, (NVTETensorParam)param);
    end(F_GET_PARAM, -1);
    if (ok) {
      expect_status(NVTE_COMM_SUCCESS);
      CHECK(same_param(&got, &live[h.idx].p[param]), "get %u differs from what was set\n", param);
    } else {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      CHECK(same_param(&got, &e), "get on error is not empty\n");
    }
  } else {
    const size_t need = sizeof(NVTEBasicTensor);
    unsigned char raw[sizeof(NVTEBasicTensor) + 32], canary[sizeof raw];
    size_t off = (size_t)below(8), size, written = 0x5A5A, *pw = chance(90) ? &written : NULL;
    void *buf = raw + off;
    int query = chance(8);
    for (size_t i = 0; i < sizeof raw; ++i) raw[i] = canary[i] = (unsigned char)rnd();
    switch (below(8)) {
      case 0: size = (size_t)below(need); break;
      case 1: size = need + (size_t)below(16); break;
      case 2: size = SIZE_MAX; break;
      default: size = need;
    }
    if (query) buf = NULL;
    begin(F_GET_PARAM_V2);
    nvte_get_tensor_param_v2(h.h, (NVTETensorParam)param, buf, size, pw);
    end(F_GET_PARAM_V2, -1);
    /* Never a byte outside [off, off + need). */
    CHECK(memcmp(raw, canary, off) == 0 && memcmp(raw + off + need, canary + off + need, sizeof raw - off - need) == 0,
          "bytes outside the value written\n");
    if (!ok) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      if (pw) CHECK(written == 0, "size_written %zu on error\n", written);
      if (buf && size >= need) {
        NVTEBasicTensor got, e = error_param();
        memcpy(&got, raw + off, need);
        CHECK(same_param(&got, &e), "buf on error is not an empty tensor\n");
      } else if (buf) {
        CHECK(memcmp(raw, canary, sizeof raw) == 0, "a short buffer was written\n");
      }
    } else if (query) {
      expect_status(NVTE_COMM_SUCCESS);
      if (pw) CHECK(written == need, "size query gave %zu\n", written);
    } else if (size < need) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      expect_msg("size_in_bytes", NULL);
      if (pw) CHECK(written == 0, "size_written %zu on a short buffer\n", written);
      CHECK(memcmp(raw, canary, sizeof raw) == 0, "a short buffer was written\n");
    } else {
      NVTEBasicTensor got;
      expect_status(NVTE_COMM_SUCCESS);
      memcpy(&got, raw + off, need);
      CHECK(same_param(&got, &live[h.idx].p[param]), "get_v2 %u differs from what was set\n", param);
      if (pw) CHECK(written == need, "size_written %zu\n", written);
    }
  }
}

static size_t numel_of(const NVTEShape *s) {
  size_t n = 1;
  for (size_t i = 0; i < s->ndim; ++i) n *= s->data[i];
  return n;
}

static void do_query(int f) {
  Handle h = rtensor();
  int ok = h.kind == H_LIVE;
  const TModel *m = ok ? &live[h.idx] : NULL;
  size_t dim = chance(80) ? (size_t)below(6) : (size_t)rnd();
  void *p = NULL;
  size_t z = 0;
  NVTEShape s = empty_shape(), want = empty_shape();
  int is_ptr = 0, is_size = 0, is_shape = 0;
  void *want_p = NULL;
  size_t want_z = 0;
  begin(f);
  switch (f) {
    case F_DATA: p = nvte_tensor_data(h.h); is_ptr = 1; if (ok) want_p = m->p[0].data_ptr; break;
    case F_COL_DATA: p = nvte_tensor_columnwise_data(h.h); is_ptr = 1; if (ok) want_p = m->p[1].data_ptr; break;
    case F_AMAX: p = nvte_tensor_amax(h.h); is_ptr = 1; if (ok) want_p = m->p[3].data_ptr; break;
    case F_SCALE: p = nvte_tensor_scale(h.h); is_ptr = 1; if (ok) want_p = m->p[2].data_ptr; break;
    case F_SCALE_INV: p = nvte_tensor_scale_inv(h.h); is_ptr = 1; if (ok) want_p = m->p[4].data_ptr; break;
    case F_SHAPE:
      s = nvte_tensor_shape(h.h); is_shape = 1;
      if (ok) want = m->p[0].data_ptr == NULL && m->p[1].data_ptr != NULL ? m->p[1].shape : m->p[0].shape;
      break;
    case F_COL_SHAPE: s = nvte_tensor_columnwise_shape(h.h); is_shape = 1; if (ok) want = m->p[1].shape; break;
    case F_SCALE_INV_SHAPE: s = nvte_tensor_scale_inv_shape(h.h); is_shape = 1; if (ok) want = m->p[4].shape; break;
    case F_NDIMS: z = nvte_tensor_ndims(h.h); is_size = 1; if (ok) want_z = m->p[0].shape.ndim; break;
    case F_SIZE:
      z = nvte_tensor_size(h.h, dim); is_size = 1;
      if (ok && dim >= m->p[0].shape.ndim) ok = 0; /* dim out of range */
      else if (ok) want_z = m->p[0].shape.data[dim];
      break;
    case F_NUMEL: z = nvte_tensor_numel(h.h); is_size = 1; if (ok) want_z = numel_of(&m->p[0].shape); break;
    case F_ELEM_SIZE: z = nvte_tensor_element_size(h.h); is_size = 1; if (ok) want_z = BITS[m->p[0].dtype] / 8; break;
    case F_ELEM_BITS: z = nvte_tensor_element_size_bits(h.h); is_size = 1; if (ok) want_z = BITS[m->p[0].dtype]; break;
    case F_TYPE: {
      NVTEDType t = nvte_tensor_type(h.h);
      end(f, -1);
      expect_status(ok ? NVTE_COMM_SUCCESS : NVTE_COMM_ERROR_INVALID_ARGUMENT);
      CHECK(t == (ok ? m->p[0].dtype : kNVTENumTypes), "type %d\n", (int)t);
      return;
    }
    case F_SCALING_MODE: {
      NVTEScalingMode sm = nvte_tensor_scaling_mode(h.h);
      end(f, -1);
      expect_status(ok ? NVTE_COMM_SUCCESS : NVTE_COMM_ERROR_INVALID_ARGUMENT);
      CHECK(sm == (ok ? NVTE_DELAYED_TENSOR_SCALING : NVTE_INVALID_SCALING), "scaling mode %d\n", (int)sm);
      return;
    }
    default: break;
  }
  end(f, -1);
  expect_status(ok ? NVTE_COMM_SUCCESS : NVTE_COMM_ERROR_INVALID_ARGUMENT);
  if (!ok && h.kind == H_LIVE) expect_msg("`dim`", NULL);
  if (is_ptr) CHECK(p == want_p, "pointer %p, model %p\n", p, want_p);
  if (is_size) CHECK(z == want_z, "value %zu, model %zu\n", z, want_z);
  if (is_shape) CHECK(same_shape(&s, &want), "shape differs from the model\n");
}

static void do_create_simple(void) {
  size_t dims[16];
  size_t nd = chance(90) ? (size_t)below(5) : chance(50) ? (size_t)below(17) : (size_t)rnd();
  const size_t *sp = dims;
  uint32_t dt = renum(11);
  void *data = rptr();
  NVTETensor out = (NVTETensor)(uintptr_t)0x77, *po = chance(95) ? &out : NULL;
  int valid;
  NVTECommStatus st;
  for (int i = 0; i < 16; ++i) dims[i] = chance(95) ? (size_t)below(64) : rdim();
  if (chance(5)) sp = NULL;
  if (nlive >= MAX_LIVE) po = NULL; /* bounded model */
  valid = po != NULL && !(nd > 0 && sp == NULL) && nd <= 15 && dt <= 10;
  if (valid) {
    size_t numel = 1;
    for (size_t i = 0; i < nd; ++i) {
      if (dims[i] != 0 && numel > SIZE_MAX / dims[i]) { valid = 0; break; }
      numel *= dims[i];
    }
    if (valid && numel > SIZE_MAX / BITS[dt]) valid = 0;
  }
  begin(F_CREATE_SIMPLE);
  st = nvte_comm_tensor_create_simple(data, (NVTEDType)dt, sp, nd, po);
  if (valid && st == NVTE_COMM_SUCCESS && out && find_live(out) < 0) {
    model_add(out);
    live[nlive - 1].p[0].data_ptr = data;
    live[nlive - 1].p[0].dtype = (NVTEDType)dt;
    live[nlive - 1].p[0].shape = empty_shape();
    live[nlive - 1].p[0].shape.ndim = nd;
    for (size_t i = 0; i < nd; ++i) live[nlive - 1].p[0].shape.data[i] = dims[i];
  }
  end(F_CREATE_SIMPLE, (int)st);
  expect_status(valid ? NVTE_COMM_SUCCESS : NVTE_COMM_ERROR_INVALID_ARGUMENT);
  if (po && !valid) CHECK(out == NULL, "*out %p on error\n", out);
  if (valid) CHECK(out != NULL, "*out NULL on success\n");
}

/* Calls that do not touch the thread's last error: it must be unchanged. */
static void do_pure(int f) {
  NVTECommStatus before = nvte_comm_last_status();
  char msg[512];
  strncpy(msg, nvte_comm_last_error(), sizeof msg - 1);
  msg[sizeof msg - 1] = '\0';
  begin(f);
  switch (f) {
    case F_LAST_ERROR: {
      const char *a = nvte_comm_last_error(), *b = nvte_comm_last_error();
      CHECK(a == b, "two last_error calls give different pointers\n");
      break;
    }
    case F_LAST_STATUS: CHECK(nvte_comm_last_status() == before, "last_status changed\n"); break;
    case F_STATUS_STRING: {
      static const char *const names[11] = {
          "NVTE_COMM_SUCCESS", "NVTE_COMM_ERROR_INVALID_ARGUMENT", "NVTE_COMM_ERROR_CUDA", "NVTE_COMM_ERROR_CUBLAS",
          "NVTE_COMM_ERROR_NCCL", "NVTE_COMM_ERROR_NVRTC", "NVTE_COMM_ERROR_TIMEOUT", "NVTE_COMM_ERROR_UNSUPPORTED",
          "NVTE_COMM_ERROR_LIBRARY_NOT_FOUND", "NVTE_COMM_ERROR_OUT_OF_MEMORY", "NVTE_COMM_ERROR_INTERNAL"};
      uint32_t v = renum(11);
      const char *s = nvte_comm_status_string((NVTECommStatus)v);
      CHECK(s != NULL && strcmp(s, v <= 10 ? names[v] : "unknown status") == 0, "status_string(%u)\n", v);
      break;
    }
    case F_VERSION: CHECK(nvte_comm_version() == version_ptr, "version pointer changed\n"); break;
    case F_LIVE_COUNT: CHECK(nvte_comm_live_tensor_count() == nlive, "live count\n"); break;
    default: break;
  }
  ++fn_ok[f];
  CHECK(nvte_comm_last_status() == before && strcmp(nvte_comm_last_error(), msg) == 0,
        "%s changed the last error\n", NAMES[f]);
}

static void do_clear(void) {
  begin(F_CLEAR_ERROR);
  nvte_comm_clear_error();
  end(F_CLEAR_ERROR, -1);
  expect_status(NVTE_COMM_SUCCESS);
}

static void do_runtime(int f) {
  begin(f);
  if (f == F_CHECK_RUNTIME) {
    NVTECommStatus st = nvte_comm_check_runtime();
    end(f, (int)st);
    CHECK(st == runtime_status, "check_runtime changed: %s\n", nvte_comm_status_string(st));
  } else {
    int32_t n = nvte_comm_device_count();
    end(f, -1);
    CHECK(n == device_count_value && last_st == device_count_status, "device_count changed: %d\n", n);
  }
}

/* GPU calls get at least one bad argument when a device is usable (fake pointers). */
static void spoil(Handle *h) {
  if (gpu_usable && h->kind != H_BAD) *h = classify((NVTETensor)(uintptr_t)(1 + below(4096)));
}

/* A live 2-D tensor made with nvte_comm_tensor_create_simple (a counted, checked call). */
static Handle make_live(NVTEDType dt, size_t r, size_t c) {
  size_t dims[2];
  NVTETensor t = NULL;
  NVTECommStatus st;
  void *data = (void *)(uintptr_t)(0x100000 + 256 * below(1 << 16));
  dims[0] = r;
  dims[1] = c;
  begin(F_CREATE_SIMPLE);
  st = nvte_comm_tensor_create_simple(data, dt, dims, 2, &t);
  if (st == NVTE_COMM_SUCCESS && t && find_live(t) < 0) {
    model_add(t);
    live[nlive - 1].p[0].data_ptr = data;
    live[nlive - 1].p[0].dtype = dt;
    live[nlive - 1].p[0].shape = empty_shape();
    live[nlive - 1].p[0].shape.ndim = 2;
    live[nlive - 1].p[0].shape.data[0] = r;
    live[nlive - 1].p[0].shape.data[1] = c;
  }
  end(F_CREATE_SIMPLE, (int)st);
  expect_status(NVTE_COMM_SUCCESS);
  return classify(t);
}

static void do_gemm(void) {
  Arg a[NARGS(GEMM_ARGS)];
  const char *bad;
  draw_args(a, GEMM_ARGS, NARGS(GEMM_ARGS));
  if (chance(25) && nlive + 3 <= MAX_LIVE) { /* coherent shapes (TN): these get past the argument checks */
    static const NVTEDType types[] = {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16};
    NVTEDType t = types[below(3)];
    size_t m = (size_t)(16 * below(8)), n = (size_t)(16 * below(8)), k = (size_t)(16 * (1 + below(8)));
    a[0].h = make_live(t, m, k);
    a[1].h = make_live(t, n, k);
    a[2].h = make_live(t, n, m);
  }
  if (!first_bad(a, 6)) spoil(&a[below(3)].h);
  bad = first_bad(a, 6);
  begin(F_CUBLAS_GEMM);
  nvte_cublas_gemm(a[0].h.h, a[1].h.h, a[2].h.h, a[3].h.h, a[4].h.h, chance(70), chance(30), chance(20), a[5].h.h,
                   chance(50), chance(50), chance(80) ? 0 : ri32(), rstream());
  end(F_CUBLAS_GEMM, -1);
  if (bad) expect_bad_tensor(bad);
  else expect_device_outcome(1), ++reached_device[F_CUBLAS_GEMM];
}

static void do_cast(int f) {
  Arg a[2];
  const char *bad;
  size_t n = f == F_FILL_UNIFORM ? draw_args(a, FILL_ARGS, NARGS(FILL_ARGS)) : draw_args(a, CAST_ARGS, NARGS(CAST_ARGS));
  if (!first_bad(a, n)) spoil(&a[0].h);
  bad = first_bad(a, n);
  begin(f);
  if (f == F_QUANTIZE) {
    nvte_quantize(a[0].h.h, a[1].h.h, rstream());
    end(f, -1);
  } else if (f == F_DEQUANTIZE) {
    nvte_dequantize(a[0].h.h, a[1].h.h, rstream());
    end(f, -1);
  } else {
    float lo = (float)(ri32() % 100), hi = (float)(ri32() % 100);
    NVTECommStatus st = nvte_comm_fill_uniform(a[0].h.h, rnd(), lo, hi, rstream());
    end(f, (int)st);
  }
  if (bad) expect_bad_tensor(bad);
  else expect_device_outcome(1), ++reached_device[f]; /* empty tensors: success without a device */
}

/* ---- overlap engine */

static int g_callbacks = 0;
static int32_t cb_allgather(void *user, void *global, size_t gb, const void *local, size_t lb) {
  (void)user;
  ++g_callbacks;
  if (gb < lb) return 1;
  memcpy(global, local, lb);
  return 0;
}
static int32_t cb_barrier(void *user) {
  (void)user;
  ++g_callbacks;
  return 0;
}

static NVTECommOverlap *rov(void) {
  switch (below(4)) {
    case 0: return NULL;
    case 1: return (NVTECommOverlap *)(uintptr_t)rnd();
    default: return (NVTECommOverlap *)(uintptr_t)(1 + below(1 << 16));
  }
}

static void do_config_default(void) {
  NVTECommOverlapConfig c;
  int null = chance(5), bad = first_bad_knob(KB_TRANSPORT, KB_AR_ALGO);
  NVTECommStatus st;
  memset(&c, 0xA5, sizeof c);
  begin(F_CONFIG_DEFAULT);
  st = nvte_comm_overlap_config_default(null ? NULL : &c);
  end(F_CONFIG_DEFAULT, (int)st);
  if (null) {
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
  } else if (bad >= 0) {
    const unsigned char *b = (const unsigned char *)&c;
    int zero = 1;
    for (size_t i = 0; i < sizeof c; ++i) zero &= b[i] == 0;
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    expect_msg("environment variable ", knobs[bad].name);
    CHECK(zero, "config not zeroed on error\n");
  } else {
    expect_status(NVTE_COMM_SUCCESS);
    CHECK(c.struct_size == sizeof c && c.tp_size == 0 && c.comm_cga_size == 2 && !c.atomic_gemm && c.gemm_priority == 0 &&
              c.comm_priority == -100,
          "config defaults\n");
    CHECK((int64_t)c.transport == knobs[KB_TRANSPORT].value && c.timeout_ms == knobs[KB_TIMEOUT].value &&
              c.num_splits == knobs[KB_SPLITS].value && c.num_max_streams == knobs[KB_STREAMS].value &&
              c.num_comm_sm == knobs[KB_NUM_SM].value && c.use_ce == (knobs[KB_USE_CE].value != 0) &&
              c.aggregate == (knobs[KB_AGGREGATE].value != 0) && c.set_sm_margin == (knobs[KB_SM_MARGIN].value != 0),
          "config differs from the environment model\n");
  }
}

/* The status nvte_comm_overlap_create must give, in the order of its checks; 0: the
 * arguments pass every check that needs nothing loaded (then: device errors here). */
static int create_model(const NVTECommBootstrap *bs, const NVTECommOverlapConfig *cfg, const unsigned char *bools,
                        size_t rows, size_t cols, uint32_t dt, int out_null, const char **why, int *pre_bootstrap) {
  static const unsigned EB[11] = {1, 2, 4, 8, 4, 2, 2, 1, 1, 1, 0};
  int64_t tp_size;
  *why = NULL;
  *pre_bootstrap = 1;
  if (out_null) return NVTE_COMM_ERROR_INVALID_ARGUMENT;
  if (!bs) return NVTE_COMM_ERROR_INVALID_ARGUMENT;
  if (!cfg) {
    int bad = first_bad_knob(KB_TRANSPORT, KB_AR_ALGO);
    if (bad >= 0) { *why = knobs[bad].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    tp_size = 0;
  } else {
    if (cfg->struct_size != sizeof *cfg) { *why = "struct_size"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    for (int i = 0; i < 4; ++i)
      if (bools[i] > 1) { *why = "not a bool"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->tp_size < 0) { *why = "tp_size"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->tp_size > 16) { *why = "tp_size"; return NVTE_COMM_ERROR_UNSUPPORTED; }
    if (cfg->num_splits < 1 || cfg->num_splits > 64) { *why = "num_splits"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->num_max_streams < 1 || cfg->num_max_streams > 8) { *why = "num_max_streams"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->comm_cga_size < 1 || cfg->comm_cga_size > 8) { *why = "comm_cga_size"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->num_comm_sm < 1) { *why = "num_comm_sm"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (cfg->timeout_ms <= 0) { *why = "timeout_ms"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if ((uint32_t)cfg->transport > 2) { *why = "transport"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    tp_size = cfg->tp_size;
  }
  if (dt > 10) { *why = "dtype"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!(dt == kNVTEFloat32 || dt == kNVTEFloat16 || dt == kNVTEBFloat16 || dt == kNVTEFloat8E4M3 || dt == kNVTEFloat8E5M2)) {
    *why = "not supported";
    return NVTE_COMM_ERROR_UNSUPPORTED;
  }
  if ((cols != 0 && rows > SIZE_MAX / cols) || (rows * cols != 0 && rows * cols > SIZE_MAX / EB[dt])) {
    *why = "overflows";
    return NVTE_COMM_ERROR_INVALID_ARGUMENT;
  }
  if (rows * cols == 0) { *why = "empty"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!knobs[KB_TRACE].valid) { *why = knobs[KB_TRACE].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  /* The algorithm knobs are read once, at creation (after NVTE_COMM_TRACE). */
  if (!knobs[KB_AR_ALGO].valid) { *why = knobs[KB_AR_ALGO].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!knobs[KB_RS_RING].valid) { *why = knobs[KB_RS_RING].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!knobs[KB_AG_PIECES].valid) { *why = knobs[KB_AG_PIECES].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!knobs[KB_FUSED_TILES].valid) { *why = knobs[KB_FUSED_TILES].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  if (!knobs[KB_OVERLAP].valid) { *why = knobs[KB_OVERLAP].name; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  *pre_bootstrap = 0;
  /* callbacks bootstrap (a non-NULL nccl_comm is only passed when a check above fails) */
  if (bs->world_size <= 0 || bs->world_rank < 0 || bs->world_rank >= bs->world_size) {
    *why = "world_rank";
    return NVTE_COMM_ERROR_INVALID_ARGUMENT;
  }
  if (!bs->allgather || !bs->barrier) { *why = "is NULL"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  {
    int64_t world = bs->world_size, tp = tp_size == 0 ? world : tp_size;
    if (world % tp != 0) { *why = "does not divide"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    if (tp > 16) { *why = "tp_size"; return NVTE_COMM_ERROR_UNSUPPORTED; }
    if (rows % (size_t)tp != 0) { *why = "divisible"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
    /* every rank's outcome of the checks is exchanged: at most 1 GiB, 1 byte a rank */
    if (world > (1 << 30)) { *why = "real world"; return NVTE_COMM_ERROR_INVALID_ARGUMENT; }
  }
  return 0;
}

static void do_overlap_create(void) {
  NVTECommBootstrap bs;
  NVTECommOverlapConfig cfg;
  unsigned char bools[4] = {0, 0, 0, 0};
  const NVTECommOverlapConfig *pc = NULL;
  NVTECommOverlap *out = (NVTECommOverlap *)(uintptr_t)0x99, **po = chance(97) ? &out : NULL;
  size_t rows = chance(70) ? (size_t)(8 * (1 + below(64))) : rdim(), cols = chance(70) ? (size_t)(8 * (1 + below(64))) : rdim();
  uint32_t dt = chance(70) ? (uint32_t)kNVTEBFloat16 : renum(11);
  const char *why;
  int want, pre, callbacks_before = g_callbacks;
  NVTECommStatus st;

  memset(&bs, 0, sizeof bs);
  bs.world_size = chance(70) ? (int32_t)(1 << below(6)) : ri32();
  bs.world_rank = chance(80) && bs.world_size > 0 ? (int32_t)below((uint64_t)bs.world_size) : ri32();
  bs.allgather = chance(95) ? cb_allgather : NULL;
  bs.barrier = chance(95) ? cb_barrier : NULL;
  bs.user_data = rptr();
  if (chance(60)) {
    nvte_comm_overlap_config_default(&cfg); /* a helper call, not counted */
    if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) {
      memset(&cfg, 0, sizeof cfg);
      cfg.struct_size = sizeof cfg;
      cfg.num_splits = cfg.num_max_streams = 3;
      cfg.comm_cga_size = 2;
      cfg.num_comm_sm = 16;
      cfg.timeout_ms = 1000;
    }
    switch (below(14)) {
      case 0: cfg.struct_size = chance(50) ? (size_t)below(sizeof cfg) : sizeof cfg + 8; break;
      case 1: cfg.tp_size = ri32(); break;
      case 2: cfg.num_splits = ri32(); break;
      case 3: cfg.num_max_streams = ri32(); break;
      case 4: cfg.comm_cga_size = ri32(); break;
      case 5: cfg.num_comm_sm = ri32(); break;
      case 6: cfg.timeout_ms = ri64(); break;
      case 7: cfg.transport = (NVTECommTransport)renum(3); break;
      case 8: cfg.atomic_gemm = chance(50); break;
      case 9: cfg.tp_size = (int32_t)(1 << below(6)); break;
      default: break;
    }
    /* The bool fields as bytes (a C caller's struct may hold anything there). */
    {
      const size_t offs[4] = {offsetof(NVTECommOverlapConfig, set_sm_margin), offsetof(NVTECommOverlapConfig, use_ce),
                              offsetof(NVTECommOverlapConfig, aggregate), offsetof(NVTECommOverlapConfig, atomic_gemm)};
      unsigned char *raw = (unsigned char *)&cfg;
      for (int i = 0; i < 4; ++i) {
        if (chance(3)) raw[offs[i]] = (unsigned char)(2 + below(254));
        bools[i] = raw[offs[i]];
      }
    }
    pc = &cfg;
  }
  if (chance(3)) {
    begin(F_OV_CREATE);
    st = nvte_comm_overlap_create(NULL, pc, rows, cols, (NVTEDType)dt, po);
    end(F_OV_CREATE, (int)st);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    if (po) CHECK(out == NULL, "*out on error\n");
    return;
  }
  want = create_model(&bs, pc, bools, rows, cols, dt, po == NULL, &why, &pre);
  /* Where a check before the bootstrap fails, a fake NCCL communicator is never touched. */
  if (want != 0 && pre && chance(30)) bs.nccl_comm = (ncclComm_t)(uintptr_t)(0x1000 + 8 * below(1 << 20));
  if (gpu_usable && want == 0) rows = 0, want = NVTE_COMM_ERROR_INVALID_ARGUMENT, why = "empty";
  begin(F_OV_CREATE);
  st = nvte_comm_overlap_create(&bs, pc, rows, cols, (NVTEDType)dt, po);
  end(F_OV_CREATE, (int)st);
  if (want) {
    /* A rank whose arguments are refused tells its peers through valid callbacks (one
     * allgather, so that they fail with it instead of waiting for it; none in a world of
     * more than 2^30 ranks, whose exchange would not fit 1 GiB); nothing else calls them,
     * and an NCCL communicator is not touched. */
    int told = po != NULL && bs.nccl_comm == NULL && bs.world_size > 1 && bs.world_size <= (1 << 30) &&
               bs.world_rank >= 0 && bs.world_rank < bs.world_size && bs.allgather && bs.barrier;
    expect_status((NVTECommStatus)want);
    if (why) expect_msg(why, NULL);
    CHECK(g_callbacks == callbacks_before + told, "the argument checks called the bootstrap callbacks %d times, expected %d\n",
          g_callbacks - callbacks_before, told);
  } else {
    ++reached_device[F_OV_CREATE];
    expect_device_outcome(1);
    CHECK(last_st != NVTE_COMM_ERROR_INVALID_ARGUMENT && last_st != NVTE_COMM_ERROR_UNSUPPORTED, "valid arguments rejected\n");
  }
  if (po) CHECK(st == NVTE_COMM_SUCCESS || out == NULL, "*out on error\n");
  if (st == NVTE_COMM_SUCCESS && po && out) { /* a usable device after all: clean up */
    CHECK(nvte_comm_overlap_destroy(out) == NVTE_COMM_SUCCESS, "destroy of a created object\n");
  }
}

static void do_overlap_simple(int f) {
  NVTECommOverlap *ov = rov();
  NVTECommStatus st;
  begin(f);
  if (f == F_OV_DESTROY) {
    st = nvte_comm_overlap_destroy(ov);
    end(f, (int)st);
    expect_status(ov ? NVTE_COMM_ERROR_INVALID_ARGUMENT : NVTE_COMM_SUCCESS);
  } else if (f == F_OV_TP) {
    int32_t a = 55, b = 66;
    int na = chance(20), nb = chance(20);
    st = nvte_comm_overlap_tp(ov, na ? NULL : &a, nb ? NULL : &b);
    end(f, (int)st);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    CHECK((na || a == 0) && (nb || b == 0), "tp out-params on error: %d %d\n", a, b);
  } else if (f == F_OV_GET_BUFFER) {
    NVTETensor t = (NVTETensor)(uintptr_t)0x42;
    int nullout = chance(10);
    st = nvte_comm_overlap_get_buffer(ov, chance(50), nullout ? NULL : &t);
    end(f, (int)st);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    if (!nullout) CHECK(t == NULL, "get_buffer *out on error\n");
    else {
      expect_msg("`out` is NULL", NULL);
      return;
    }
  } else {
    st = nvte_comm_overlap_synchronize(ov);
    end(f, (int)st);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
  }
  if (f != F_OV_DESTROY || ov) expect_msg(ov ? "not a live overlap object" : "`overlap`", NULL);
}

static void do_overlap_algo(int f) {
  NVTECommOverlap *ov = rov();
  Arg a[9];
  size_t n = 0;
  uint32_t ct = renum(2);
  NVTECommStatus st;
  const char *bad;
  begin(f);
  switch (f) {
    case F_OV_COPY:
      n = draw_args(a, COPY_ARGS, NARGS(COPY_ARGS));
      st = nvte_comm_overlap_copy_into_buffer(ov, a[0].h.h, chance(50), rstream());
      break;
    case F_OV_SPLIT_AG:
      n = draw_args(a, SPLIT_AG_ARGS, NARGS(SPLIT_AG_ARGS));
      st = nvte_comm_overlap_split_ag(ov, a[0].h.h, chance(50), a[1].h.h, chance(50), a[2].h.h, a[3].h.h, a[4].h.h,
                                      chance(50), a[5].h.h, chance(50), chance(50), a[6].h.h, rstream());
      break;
    case F_OV_SPLIT_RS:
    case F_OV_SPLIT_RS_P2P:
      /* the table's order: A, B, rs_output, D, bias, pre_gelu_out, workspace */
      n = draw_args(a, SPLIT_RS_ARGS, NARGS(SPLIT_RS_ARGS));
      if (f == F_OV_SPLIT_RS)
        st = nvte_comm_overlap_split_rs(ov, a[0].h.h, chance(50), a[1].h.h, chance(50), a[3].h.h, a[4].h.h, a[5].h.h,
                                        chance(50), a[6].h.h, chance(50), chance(50), a[2].h.h, rstream());
      else
        st = nvte_comm_overlap_split_rs_p2p(ov, a[0].h.h, chance(50), a[1].h.h, chance(50), a[3].h.h, a[4].h.h,
                                            a[5].h.h, chance(50), a[6].h.h, chance(50), chance(50), a[2].h.h, rstream());
      break;
    default: /* bulk: comm_type, then the table */
      n = draw_args(a, BULK_ARGS, NARGS(BULK_ARGS));
      st = nvte_comm_overlap_bulk(ov, (NVTECommOverlapType)ct, a[0].h.h, chance(50), a[1].h.h, chance(50), a[2].h.h,
                                  a[3].h.h, a[4].h.h, chance(50), a[5].h.h, chance(50), chance(50), a[6].h.h, a[7].h.h,
                                  rstream());
      break;
  }
  end(f, (int)st);
  expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT); /* no live overlap object exists */
  bad = first_bad(a, n);
  if (f == F_OV_BULK && ct > 1) expect_msg("comm_type", NULL);
  else if (bad) expect_bad_tensor(bad);
  else expect_msg("`overlap`", NULL);
}

/* ---- comm-GEMM */

static void do_ctx_create(void) {
  int32_t nranks = chance(60) ? (int32_t)(1 << below(4)) : ri32();
  int32_t rank = chance(70) && nranks > 0 ? (int32_t)below((uint64_t)nranks) : ri32();
  int consistent = nranks > 0 && rank >= 0 && rank < nranks;
  int env_bad = first_bad_knob(KB_TRANSPORT, KB_AR_ALGO);
  int bad_knob = env_bad >= 0                ? env_bad
                 : !knobs[KB_AR_ALGO].valid ? KB_AR_ALGO
                 : !knobs[KB_RS_RING].valid ? KB_RS_RING
                 : !knobs[KB_AG_PIECES].valid ? KB_AG_PIECES
                 : !knobs[KB_FUSED_TILES].valid ? KB_FUSED_TILES
                 : !knobs[KB_OVERLAP].valid ? KB_OVERLAP
                 : !knobs[KB_TRACE].valid   ? KB_TRACE
                                            : -1;
  /* A fake communicator only where the library must reject the call before using it. */
  ncclComm_t comm = (!consistent || bad_knob >= 0) && chance(70) ? (ncclComm_t)(uintptr_t)(0x1000 + 8 * below(1 << 20)) : NULL;
  NVTECommGemmCtx *c;
  begin(F_CTX_CREATE);
  c = nvte_comm_gemm_ctx_create(comm, nranks, rank);
  end(F_CTX_CREATE, -1);
  expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
  CHECK(c == NULL, "context %p from invalid arguments\n", (void *)c);
  if (!consistent) expect_msg("nranks", NULL);
  else if (bad_knob >= 0) expect_msg("environment variable ", knobs[bad_knob].name);
  else expect_msg("NULL", NULL);
}

static NVTECommGemmCtx *rctx(void) {
  switch (below(3)) {
    case 0: return NULL;
    case 1: return (NVTECommGemmCtx *)(uintptr_t)rnd();
    default: return (NVTECommGemmCtx *)(uintptr_t)(1 + below(1 << 16));
  }
}

static void do_ctx_simple(int f) {
  NVTECommGemmCtx *c = rctx();
  begin(f);
  if (f == F_CTX_DESTROY) {
    nvte_comm_gemm_ctx_destroy(c);
    end(f, -1);
    expect_status(c ? NVTE_COMM_ERROR_INVALID_ARGUMENT : NVTE_COMM_SUCCESS);
    if (c) expect_msg("not a live context", NULL);
  } else {
    int64_t r = nvte_comm_gemm_numroc(c, ri64());
    end(f, -1);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    CHECK(r == 0, "numroc %lld on error\n", (long long)r);
    expect_msg("`ctx`", NULL);
  }
}

static void do_comm_gemm(int f) {
  NVTECommGemmCtx *c = rctx();
  Handle a = rtensor(), b = rtensor(), d = rtensor(), bias = ropt(), pre = ropt();
  int64_t m = ri64(), n = ri64(), k = ri64();
  uint32_t algo = renum(5);
  begin(f);
  if (f == F_AG_GEMM)
    nvte_all_gather_gemm(c, m, n, k, a.h, b.h, d.h, bias.h, pre.h, chance(50), chance(50), chance(50), chance(50), ri32(),
                         rstream(), (NVTECommGemmAlgoType)algo);
  else if (f == F_GEMM_RS)
    nvte_gemm_reduce_scatter(c, m, n, k, a.h, b.h, d.h, bias.h, pre.h, chance(50), chance(50), chance(50), chance(50),
                             ri32(), rstream(), (NVTECommGemmAlgoType)algo);
  else
    nvte_gemm_all_reduce(c, m, n, k, a.h, b.h, d.h, bias.h, pre.h, chance(50), chance(50), chance(50), chance(50), ri32(),
                         rstream(), (NVTECommGemmAlgoType)algo);
  end(f, -1);
  expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT); /* no live context exists: checked first */
  expect_msg("`ctx`", NULL);
}

/* ---- runtime helpers */

static const char *lib_paths[4];

static void do_library_info(void) {
  uint32_t lib = renum(4);
  const char *path = (const char *)(uintptr_t)0x1;
  int32_t version = 77;
  bool pre = true;
  int np = chance(20), nv = chance(20), nb = chance(20);
  NVTECommStatus st;
  begin(F_LIBRARY_INFO);
  st = nvte_comm_library_info((NVTECommLibrary)lib, np ? NULL : &path, nv ? NULL : &version, nb ? NULL : &pre);
  end(F_LIBRARY_INFO, (int)st);
  if (lib > 3) {
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    expect_msg("`lib`", NULL);
  } else {
    CHECK(st == NVTE_COMM_SUCCESS || st == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || st == NVTE_COMM_ERROR_CUDA ||
              st == NVTE_COMM_ERROR_NCCL,
          "library_info(%u): %s\n", lib, nvte_comm_status_string(st));
  }
  if (st != NVTE_COMM_SUCCESS) {
    CHECK((np || path == NULL) && (nv || version == 0) && (nb || !pre), "library_info out-params on error\n");
  } else {
    CHECK(np || (path != NULL && path[0] == '/'), "library_info path\n");
    CHECK(nv || version > 0, "library_info version\n");
    if (!np) {
      if (!lib_paths[lib]) lib_paths[lib] = path;
      CHECK(lib_paths[lib] == path, "library_info path changed\n");
    }
  }
}

static int uid_budget = 2; /* each ncclGetUniqueId starts a bootstrap root in NCCL: keep it rare */

static void do_nccl(int f) {
  begin(f);
  if (f == F_NCCL_UID) {
    uint8_t id[160];
    size_t len = chance(50) ? (size_t)below(128) : 128 + (size_t)below(32);
    int null = chance(20);
    NVTECommStatus st;
    memset(id, 0xEE, sizeof id);
    if (!null && len >= 128 && uid_budget <= 0) len = (size_t)below(128);
    if (!null && len >= 128) --uid_budget;
    st = nvte_comm_nccl_get_unique_id(null ? NULL : id, len);
    end(f, (int)st);
    if (null || len < 128) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
      expect_msg(null ? "`out` is NULL" : "`len`", NULL);
    } else {
      CHECK(st == NVTE_COMM_SUCCESS || st == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || st == NVTE_COMM_ERROR_NCCL,
            "unique id: %s\n", nvte_comm_status_string(st));
    }
    if (!null) {
      size_t w = len < 128 ? len : 128;
      int zero = 1, untouched = 1;
      for (size_t i = 0; i < w; ++i) zero &= id[i] == 0;
      for (size_t i = w; i < sizeof id; ++i) untouched &= id[i] == 0xEE;
      if (st != NVTE_COMM_SUCCESS) CHECK(zero, "unique id buffer not zeroed on error\n");
      CHECK(untouched, "unique id wrote past min(len, 128) bytes\n");
    }
  } else if (f == F_NCCL_INIT) {
    uint8_t id[128];
    size_t len = chance(80) ? 128 : (size_t)below(128);
    int32_t nranks = chance(50) ? 1 : ri32(), rank = chance(70) ? 0 : ri32();
    int nid = chance(10), nout = chance(10);
    ncclComm_t out = (ncclComm_t)(uintptr_t)0x1;
    NVTECommStatus st;
    int consistent = nranks > 0 && rank >= 0 && rank < nranks;
    for (size_t i = 0; i < sizeof id; ++i) id[i] = (uint8_t)rnd();
    if (consistent && (nranks != 1 || gpu_usable)) nranks = -nranks; /* never a real multi-rank init */
    consistent = nranks > 0 && rank >= 0 && rank < nranks;
    st = nvte_comm_nccl_comm_init_rank(nid ? NULL : id, len, nranks, rank, nout ? NULL : &out);
    end(f, (int)st);
    if (nout || nid || len < 128 || !consistent) {
      expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    } else {
      ++reached_device[f];
      CHECK(st == NVTE_COMM_ERROR_LIBRARY_NOT_FOUND || st == NVTE_COMM_ERROR_CUDA,
            "init_rank without a device: %s\n", nvte_comm_status_string(st));
    }
    if (!nout) CHECK(st == NVTE_COMM_SUCCESS || out == NULL, "init_rank *out on error\n");
  } else {
    ncclComm_t c = chance(20) ? NULL : (ncclComm_t)(uintptr_t)(chance(50) ? rnd() : 0x1000 + 8 * below(1 << 16));
    NVTECommStatus st = nvte_comm_nccl_comm_destroy(c);
    end(f, (int)st);
    expect_status(NVTE_COMM_ERROR_INVALID_ARGUMENT);
    expect_msg(c ? "not a live communicator" : "NULL", NULL);
  }
}

/* ------------------------------------------------------------------ sweep and main */

/* Every live tensor still holds exactly what the model says (nothing acted on another). */
static void sweep(void) {
  for (size_t i = 0; i < nlive; ++i)
    for (uint32_t p = 0; p < NPARAM; ++p) {
      NVTEBasicTensor got = nvte_get_tensor_param(live[i].h, (NVTETensorParam)p);
      CHECK(nvte_comm_last_status() == NVTE_COMM_SUCCESS && same_param(&got, &live[i].p[p]),
            "sweep: tensor %zu param %u differs from the model\n", i, p);
    }
  CHECK(nvte_comm_live_tensor_count() == nlive, "sweep: live count\n");
}

static uint64_t g_seed;

/* A crash is the worst failure: say where (the seed and call number reproduce it). */
static void on_crash(int sig) {
  fprintf(stderr, "\ntest_fuzz: CRASH (signal %d) in call %llu (%s), seed %#llx\n", sig, cur_iter, cur_fn,
          (unsigned long long)g_seed);
  signal(sig, SIG_DFL);
  raise(sig);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
  uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 0x7E57F0220001ull;
  unsigned long long target = argc > 2 ? strtoull(argv[2], NULL, 0) : 1000000ull;
  double t0;
  rng_state = g_seed = seed;
  setvbuf(stdout, NULL, _IOLBF, 0); /* failures are seen even if a later call crashes */
  signal(SIGSEGV, on_crash);
  signal(SIGABRT, on_crash);
  signal(SIGFPE, on_crash);
  signal(SIGILL, on_crash);
  /* The same behaviour with or without a GPU: none is visible (the driver, if any,
   * reports no device). NVTE_COMM_DEBUG would print every error. */
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  unsetenv("NVTE_COMM_DEBUG");
  for (int i = 0; i < NKNOBS; ++i) knob_unset(&knobs[i]);
  version_ptr = nvte_comm_version();
  runtime_status = nvte_comm_check_runtime();
  device_count_value = nvte_comm_device_count();
  device_count_status = nvte_comm_last_status();
  gpu_usable = runtime_status == NVTE_COMM_SUCCESS || device_count_value > 0;
  g_stream_any = !gpu_usable;
  printf("test_fuzz: seed %#llx, %llu calls; runtime here: %s (%d device(s)%s)\n", (unsigned long long)seed, target,
         nvte_comm_status_string(runtime_status), device_count_value,
         gpu_usable ? ": calls that could reach it always carry a bad argument" : "");
  fflush(stdout);
  t0 = now();
  for (cur_iter = 0; calls < target; ++cur_iter) {
    int f;
    if (chance(2)) { /* the environment changes now and then */
      Knob *k = &knobs[below(NKNOBS)];
      if (chance(50)) knob_unset(k);
      else knob_random(k);
    }
    f = (int)below(NFUNCS + 12);
    if (f >= NFUNCS) f = (int)(f % 4 == 0 ? F_SET_PARAM_V2 : f % 4 == 1 ? F_GET_PARAM_V2 : f % 4 == 2 ? F_CREATE_TENSOR : F_DESTROY_TENSOR);
    switch (f) {
      case F_CREATE_TENSOR: do_create_tensor(); break;
      case F_DESTROY_TENSOR: do_destroy_tensor(); break;
      case F_MAKE_SHAPE: do_make_shape(); break;
      case F_SET_PARAM: do_set_param(0); break;
      case F_SET_PARAM_V2: do_set_param(1); break;
      case F_GET_PARAM: do_get_param(0); break;
      case F_GET_PARAM_V2: do_get_param(1); break;
      case F_LIVE_COUNT: case F_LAST_ERROR: case F_LAST_STATUS: case F_STATUS_STRING: case F_VERSION: do_pure(f); break;
      case F_DATA: case F_COL_DATA: case F_SHAPE: case F_COL_SHAPE: case F_NDIMS: case F_SIZE: case F_NUMEL:
      case F_ELEM_SIZE: case F_ELEM_BITS: case F_TYPE: case F_SCALING_MODE: case F_AMAX: case F_SCALE:
      case F_SCALE_INV: case F_SCALE_INV_SHAPE: do_query(f); break;
      case F_CREATE_SIMPLE: do_create_simple(); break;
      case F_CLEAR_ERROR: do_clear(); break;
      case F_CHECK_RUNTIME: case F_DEVICE_COUNT: do_runtime(f); break;
      case F_CUBLAS_GEMM: do_gemm(); break;
      case F_QUANTIZE: case F_DEQUANTIZE: case F_FILL_UNIFORM: do_cast(f); break;
      case F_CONFIG_DEFAULT: do_config_default(); break;
      case F_OV_CREATE: do_overlap_create(); break;
      case F_OV_DESTROY: case F_OV_TP: case F_OV_GET_BUFFER: case F_OV_SYNC: do_overlap_simple(f); break;
      case F_OV_COPY: case F_OV_SPLIT_AG: case F_OV_SPLIT_RS: case F_OV_SPLIT_RS_P2P: case F_OV_BULK: do_overlap_algo(f); break;
      case F_CTX_CREATE: do_ctx_create(); break;
      case F_CTX_DESTROY: case F_NUMROC: do_ctx_simple(f); break;
      case F_AG_GEMM: case F_GEMM_RS: case F_GEMM_AR: do_comm_gemm(f); break;
      case F_LIBRARY_INFO: do_library_info(); break;
      case F_NCCL_UID: case F_NCCL_INIT: case F_NCCL_DESTROY: do_nccl(f); break;
      default: CHECK(0, "no such entry point %d\n", f);
    }
    if (cur_iter % 4096 == 0) sweep();
  }
  cur_fn = "end";
  sweep();
  while (nlive) { /* no leak: every model handle destroys cleanly */
    nvte_destroy_tensor(live[nlive - 1].h);
    CHECK(nvte_comm_last_status() == NVTE_COMM_SUCCESS, "final destroy\n");
    --nlive;
  }
  CHECK(nvte_comm_live_tensor_count() == 0, "leaked handles: %zu\n", nvte_comm_live_tensor_count());
  for (int i = 0; i < NKNOBS; ++i) knob_unset(&knobs[i]);
  {
    double dt = now() - t0;
    int uncovered = 0;
    printf("%-35s %8s %8s %8s %8s %8s %8s\n", "entry point", "calls", "success", "invalid", "unsupp.", "other",
           "past arg");
    for (int f = 0; f < NFUNCS; ++f) {
      printf("%-35s %8llu %8llu %8llu %8llu %8llu %8llu\n", NAMES[f], fn_calls[f], fn_ok[f], fn_invalid[f],
             fn_unsupported[f], fn_calls[f] - fn_ok[f] - fn_invalid[f] - fn_unsupported[f], reached_device[f]);
      if (fn_calls[f] < target / (4 * NFUNCS)) ++uncovered;
    }
    printf("(\"past arg\": calls whose arguments passed every check that needs nothing loaded)\n");
    CHECK(uncovered == 0, "%d entry points were called less than %llu times\n", uncovered, target / (4 * NFUNCS));
    if (target >= 100000)
      CHECK(reached_device[F_OV_CREATE] > 0 && reached_device[F_CUBLAS_GEMM] > 0 && reached_device[F_QUANTIZE] > 0,
            "no call got past the argument checks\n");
    printf("test_fuzz: %llu calls over %d entry points in %.1f s (%.2f us/call), seed %#llx\n", calls, NFUNCS, dt,
           1e6 * dt / (double)(calls ? calls : 1), (unsigned long long)seed);
  }
  printf("test_fuzz: %llu passed, %llu failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
