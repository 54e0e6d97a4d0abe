// Probe: does cuBLASLt honour the atomic-synchronisation counters on this GPU (issue 13's
// question before any atomic GEMM is built on them)? For bf16 and FP8 (e4m3) TN GEMMs:
//  1. the heuristic's answer when the matmul descriptor asks for atomic sync
//     (CUBLASLT_MATMUL_DESC_ATOMIC_SYNC_NUM_CHUNKS_D_ROWS / _COLS with IN_ or OUT_COUNTERS_POINTER),
//     and each returned algorithm's CUBLASLT_ALGO_CAP_ATOMIC_SYNC capability;
//  2. OUT counters (what a GEMM + reduce-scatter needs): a watcher kernel on a second stream
//     records when each counter changes, and to what, relative to the GEMM's start and end;
//  3. IN counters (what an all-gather + GEMM needs): counters start at 1 and a releaser kernel
//     sets them to 0 one by one, 2 ms apart; if the GEMM honours them it cannot end before
//     the last release (the releaser always releases: no hang either way). A run with the
//     counters at 0 (set to 1 later, in case the semantics are the other way) is the control. Results are compared with the same GEMM without
//     counters.
// Build and run on the GPU machine:
//   nvcc -O2 -arch=native -o /tmp/atomic_probe bench/atomic_gemm_probe.cu -lcublasLt && /tmp/atomic_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));          \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define LT(x)                                                                                  \
  do {                                                                                         \
    cublasStatus_t s_ = (x);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
      std::printf("%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_);           \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// cuBLAS 13's header no longer declares the atomic-sync attributes (cuBLAS 12's values:
// matmul descriptor 27..30, algorithm capability 20; the enums skip exactly these numbers).
// The probe passes cuBLAS 12's values and reports what the library answers.
static const auto kRows = (cublasLtMatmulDescAttributes_t)27, kCols = (cublasLtMatmulDescAttributes_t)28,
                  kIn = (cublasLtMatmulDescAttributes_t)29, kOut = (cublasLtMatmulDescAttributes_t)30;
static const auto kCapAtomic = (cublasLtMatmulAlgoCapAttributes_t)20;
static cublasStatus_t g_set_status[4];

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void stamp(uint64_t *t) { *t = now_ns(); }

template <class T>
__global__ void fill(T *p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    float u = (h & 0xffffff) / float(0xffffff) - 0.5f;
    p[i] = T(u * scale);
  }
}

// Watch `n` counters: record the first time each differs from its initial value, and the value.
__global__ void watch(volatile int32_t *c, int n, uint64_t *when, int32_t *val, uint64_t limit_ns) {
  int i = threadIdx.x;
  if (i >= n) return;
  int32_t init = c[i];
  uint64_t t0 = now_ns();
  while (true) {
    int32_t v = c[i];
    uint64_t t = now_ns();
    if (v != init) {
      when[i] = t;
      val[i] = v;
      return;
    }
    if (t - t0 > limit_ns) {
      when[i] = 0;
      val[i] = init;
      return;
    }
  }
}

// Set `n` counters to `value` one by one, `gap_ns` apart after a first `gap_ns`.
__global__ void release(int32_t *c, int n, uint64_t gap_ns, uint64_t *when, int32_t value) {
  uint64_t t0 = now_ns();
  for (int i = 0; i < n; ++i) {
    while (now_ns() - t0 < (uint64_t)(i + 1) * gap_ns) {
    }
    __threadfence_system();
    atomicExch(c + i, value);
    __threadfence_system();
    when[i] = now_ns();
  }
}

struct Gemm {
  cublasLtHandle_t lt;
  cudaDataType_t in_type;
  int m, n, k;
  void *a, *b, *d, *d_ref, *ws;
  size_t ws_bytes = 64u << 20;
  float *scale;  // 1.0 on the device (FP8 A/B scale)
};

// Descriptor (with optional atomic sync); returns heuristic algos.
static cublasLtMatmulDesc_t make_desc(Gemm &g, int rows, int cols, int32_t *in_ctr, int32_t *out_ctr) {
  cublasLtMatmulDesc_t desc;
  LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (g.in_type == CUDA_R_8F_E4M3) {
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.scale, sizeof g.scale));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.scale, sizeof g.scale));
  }
  if (rows > 0) {
    int32_t r = rows, c = cols;
    g_set_status[0] = cublasLtMatmulDescSetAttribute(desc, kRows, &r, sizeof r);
    g_set_status[1] = cublasLtMatmulDescSetAttribute(desc, kCols, &c, sizeof c);
    g_set_status[2] = in_ctr ? cublasLtMatmulDescSetAttribute(desc, kIn, &in_ctr, sizeof in_ctr) : CUBLAS_STATUS_SUCCESS;
    g_set_status[3] = out_ctr ? cublasLtMatmulDescSetAttribute(desc, kOut, &out_ctr, sizeof out_ctr) : CUBLAS_STATUS_SUCCESS;
  }
  return desc;
}

struct Layouts {
  cublasLtMatrixLayout_t a, b, d;
};

static Layouts layouts(Gemm &g) {
  Layouts l;
  // Column-major views: A is k x m (op T -> m x k), B is k x n, D is m x n.
  LT(cublasLtMatrixLayoutCreate(&l.a, g.in_type, g.k, g.m, g.k));
  LT(cublasLtMatrixLayoutCreate(&l.b, g.in_type, g.k, g.n, g.k));
  LT(cublasLtMatrixLayoutCreate(&l.d, CUDA_R_16BF, g.m, g.n, g.m));
  return l;
}

static int heuristics(Gemm &g, cublasLtMatmulDesc_t desc, Layouts &l, cublasLtMatmulHeuristicResult_t *res, int want,
                      cublasStatus_t *st) {
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g.ws_bytes,
                                          sizeof g.ws_bytes));
  int found = 0;
  *st = cublasLtMatmulAlgoGetHeuristic(g.lt, desc, l.a, l.b, l.d, l.d, pref, want, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  return *st == CUBLAS_STATUS_SUCCESS ? found : 0;
}

static cublasStatus_t run(Gemm &g, cublasLtMatmulDesc_t desc, Layouts &l, const cublasLtMatmulAlgo_t *algo, void *d,
                          cudaStream_t s) {
  float alpha = 1.f, beta = 0.f;
  return cublasLtMatmul(g.lt, desc, &alpha, g.a, l.a, g.b, l.b, &beta, d, l.d, d, l.d, algo, g.ws, g.ws_bytes, s);
}

static double max_abs_diff(const void *x, const void *y, size_t n) {
  std::vector<__nv_bfloat16> hx(n), hy(n);
  CK(cudaMemcpy(hx.data(), x, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hy.data(), y, n * 2, cudaMemcpyDeviceToHost));
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs((double)__bfloat162float(hx[i]) - __bfloat162float(hy[i])));
  return m;
}

int main(int argc, char **argv) {
  int sz = argc > 1 ? std::atoi(argv[1]) : 8192;
  const int chunks = 4;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), cuBLASLt %zu, GEMM %dx%dx%d TN, %d row chunks of D\n", prop.name, prop.major,
              prop.minor, cublasLtGetVersion(), sz, sz, sz, chunks);
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  int32_t *ctr;
  uint64_t *t, *when;
  int32_t *val;
  CK(cudaMalloc(&ctr, 64 * sizeof(int32_t)));
  CK(cudaMallocManaged(&t, 4 * sizeof(uint64_t)));
  CK(cudaMallocManaged(&when, 64 * sizeof(uint64_t)));
  CK(cudaMallocManaged(&val, 64 * sizeof(int32_t)));

  for (cudaDataType_t ty : {CUDA_R_16BF, CUDA_R_8F_E4M3}) {
    const char *tn = ty == CUDA_R_16BF ? "bf16" : "fp8 e4m3";
    Gemm g{};
    LT(cublasLtCreate(&g.lt));
    g.in_type = ty;
    g.m = g.n = g.k = sz;
    size_t e = ty == CUDA_R_16BF ? 2 : 1, mn = (size_t)sz * sz;
    CK(cudaMalloc(&g.a, mn * e));
    CK(cudaMalloc(&g.b, mn * e));
    CK(cudaMalloc(&g.d, mn * 2));
    CK(cudaMalloc(&g.d_ref, mn * 2));
    CK(cudaMalloc(&g.ws, g.ws_bytes));
    CK(cudaMalloc(&g.scale, 4));
    float one = 1.f;
    CK(cudaMemcpy(g.scale, &one, 4, cudaMemcpyHostToDevice));
    if (ty == CUDA_R_16BF) {
      fill<<<1024, 256>>>((__nv_bfloat16 *)g.a, mn, 1, 1.f);
      fill<<<1024, 256>>>((__nv_bfloat16 *)g.b, mn, 2, 1.f);
    } else {
      fill<<<1024, 256>>>((__nv_fp8_e4m3 *)g.a, mn, 1, 4.f);
      fill<<<1024, 256>>>((__nv_fp8_e4m3 *)g.b, mn, 2, 4.f);
    }
    CK(cudaDeviceSynchronize());
    Layouts l = layouts(g);

    // Reference GEMM (no counters) and its time.
    cublasLtMatmulHeuristicResult_t res[16];
    cublasStatus_t st;
    cublasLtMatmulDesc_t plain = make_desc(g, 0, 0, nullptr, nullptr);
    int nplain = heuristics(g, plain, l, res, 16, &st);
    if (nplain == 0) {
      std::printf("[%s] no algorithm for the plain GEMM (status %d)\n", tn, (int)st);
      continue;
    }
    cublasLtMatmulAlgo_t ref_algo = res[0].algo;
    LT(run(g, plain, l, &ref_algo, g.d_ref, s1));
    CK(cudaStreamSynchronize(s1));
    stamp<<<1, 1, 0, s1>>>(t + 0);
    LT(run(g, plain, l, &ref_algo, g.d_ref, s1));
    stamp<<<1, 1, 0, s1>>>(t + 1);
    CK(cudaStreamSynchronize(s1));
    double plain_us = (t[1] - t[0]) / 1e3;
    std::printf("[%s] plain GEMM: %d heuristic algorithms, %.1f us\n", tn, nplain, plain_us);

    for (int mode = 0; mode < 2; ++mode) {  // 0: OUT counters (RS), 1: IN counters (AG)
      const char *mn_ = mode == 0 ? "OUT counters (GEMM sets, for RS)" : "IN counters (GEMM waits, for AG)";
      cublasLtMatmulDesc_t desc =
          make_desc(g, chunks, 1, mode == 1 ? ctr : nullptr, mode == 0 ? ctr : nullptr);
      int nalg = heuristics(g, desc, l, res, 16, &st);
      int with_cap = 0;
      for (int i = 0; i < nalg; ++i) {
        int32_t cap = 0;
        size_t w = 0;
        if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, kCapAtomic, &cap, sizeof cap, &w) ==
                CUBLAS_STATUS_SUCCESS &&
            cap)
          ++with_cap;
      }
      std::printf("[%s] %s: set-attribute status rows %d cols %d in %d out %d; heuristic status %d, %d algorithms, "
                  "%d with the atomic-sync capability (20)\n",
                  tn, mn_, (int)g_set_status[0], (int)g_set_status[1], (int)g_set_status[2], (int)g_set_status[3],
                  (int)st, nalg, with_cap);
      if (nalg == 0) continue;
      // Prefer an algorithm that declares the capability.
      int pick = 0;
      for (int i = 0; i < nalg; ++i) {
        int32_t cap = 0;
        size_t w = 0;
        cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, kCapAtomic, &cap, sizeof cap, &w);
        if (cap) {
          pick = i;
          break;
        }
      }
      for (int init : {1, 0}) {
        std::vector<int32_t> h(chunks, init);
        CK(cudaMemcpy(ctr, h.data(), chunks * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(g.d, 0xff, mn * 2));  // poison
        for (int i = 0; i < chunks; ++i) when[i] = 0, val[i] = -7;
        CK(cudaDeviceSynchronize());
        const uint64_t gap = 2000000;  // 2 ms between releases
        if (mode == 0) {
          watch<<<1, 32, 0, s2>>>(ctr, chunks, when, val, 100000000ull);
        } else {
          // init 1: release to 0 (the documented direction); init 0: set to 1 later, in
          // case the GEMM waits for non-zero instead (so no run can hang).
          release<<<1, 1, 0, s2>>>(ctr, chunks, gap, when, init == 1 ? 0 : 1);
        }
        stamp<<<1, 1, 0, s1>>>(t + 0);
        cublasStatus_t rs = run(g, desc, l, &res[pick].algo, g.d, s1);
        stamp<<<1, 1, 0, s1>>>(t + 1);
        CK(cudaDeviceSynchronize());
        double gemm_us = (t[1] - t[0]) / 1e3;
        double diff = rs == CUBLAS_STATUS_SUCCESS ? max_abs_diff(g.d, g.d_ref, mn) : -1;
        std::vector<int32_t> after(chunks);
        CK(cudaMemcpy(after.data(), ctr, chunks * 4, cudaMemcpyDeviceToHost));
        std::printf("  init %d: matmul status %d, GEMM %.1f us (plain %.1f), max |D - plain D| = %g; counters after:",
                    init, (int)rs, gemm_us, plain_us, diff);
        for (int i = 0; i < chunks; ++i) std::printf(" %d", after[i]);
        std::printf("\n");
        if (mode == 0) {
          std::printf("    watcher: per chunk (us after GEMM start -> value):");
          for (int i = 0; i < chunks; ++i) {
            if (when[i])
              std::printf(" %.1f->%d", ((double)when[i] - (double)t[0]) / 1e3, val[i]);
            else
              std::printf(" unchanged");
          }
          std::printf("  (GEMM end at %.1f us)\n", gemm_us);
        } else {
          std::printf("    counters set to %d at (us after GEMM start):", init == 1 ? 0 : 1);
          for (int i = 0; i < chunks; ++i) std::printf(" %.1f", ((double)when[i] - (double)t[0]) / 1e3);
          double last = ((double)when[chunks - 1] - (double)t[0]) / 1e3;
          std::printf("; GEMM end %.1f us: %s\n", gemm_us,
                      gemm_us > last ? "ended after the last change (it waited)"
                                     : "ended before the last change (it did not wait)");
        }
      }
      cublasLtMatmulDescDestroy(desc);
    }
    cublasLtMatmulDescDestroy(plain);
    cudaFree(g.a);
    cudaFree(g.b);
    cudaFree(g.d);
    cudaFree(g.d_ref);
    cudaFree(g.ws);
    cudaFree(g.scale);
    cublasLtDestroy(g.lt);
  }
  return 0;
}
