// Host cost of a C call (issue 21, item 4): microseconds of host time per call, back to
// back, for an empty launch (cudaMemsetAsync of 4 bytes: the floor), cudaEventRecord, a
// bare cublasLtMatmul (the GEMM's floor: descriptors, layouts and the heuristic's algorithm
// made once, as nvte_cublas_gemm's cached plan holds them, with the same workspace; what
// nvte_cublas_gemm costs beyond it is what the library adds), nvte_cublas_gemm, the
// comm-GEMM API (nvte_all_gather_gemm, nvte_gemm_reduce_scatter, nvte_gemm_all_reduce)
// and the overlap API (nvte_comm_overlap_split_ag, _split_rs, _split_rs_p2p, _bulk), at
// 256^3 (where the GPU is not the bottleneck) and 4096^3 (for reference), over the IPC
// transport (contexts and objects made from MPI callbacks, so ranks may share one GPU)
// and over NCCL where every rank has its own GPU (NCCL refuses ranks sharing a GPU).
//
// Per op: a warm-up, then batches of back-to-back calls: the wall clock of each batch's
// enqueue loop / calls is the host time, loop + one stream synchronisation / calls the
// GPU time; the median of the batches, then the maximum over ranks. nvte_comm_host_counters
// gives the heap allocations and checked CUDA library calls per call (over every batch).
// The bar: at tp 1, 256^3, IPC, every comm-GEMM and overlap call <= 10 us of host time and
// no allocation. `--strict`: exit 1 when the bar is missed. `--out FILE`: the table too.
// Run: tests_c/run_mpi.sh N build/tests_c/bench_host [--strict] [--out FILE]
#include <nccl.h>

#include <dlfcn.h>
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define TE_BENCH_HAVE_LT 1
#endif

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace tu;

namespace {

int mpi_allgather(void *, void *global, size_t, const void *local, size_t local_bytes) {
  return MPI_Allgather(local, (int)local_bytes, MPI_BYTE, global, (int)local_bytes, MPI_BYTE, MPI_COMM_WORLD);
}
int mpi_barrier(void *) { return MPI_Barrier(MPI_COMM_WORLD); }

struct Row {
  std::string op;
  int size;
  int tp;
  std::string transport;
  double host_us, gpu_us, allocs, calls;
  std::string error;
};

cudaStream_t g_s;
int g_rank, g_tp;
std::vector<Row> g_rows;

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Time `fn` (one call; returns false on failure with the error recorded by the library).
void measure(const std::string &op, int size, const std::string &transport, const std::function<bool()> &fn) {
  const int batches = size >= 4096 ? 5 : 20, per = size >= 4096 ? 20 : 100, warm = size >= 4096 ? 3 : 20;
  Row r{op, size, g_tp, transport, 0, 0, 0, 0, ""};
  bool ok = true;
  for (int i = 0; i < warm && ok; ++i) ok = fn();
  CUDA_OK(cudaStreamSynchronize(g_s));
  std::vector<double> host, gpu;
  uint64_t a0 = 0, c0 = 0, a1 = 0, c1 = 0;
  nvte_comm_host_counters(&a0, &c0);
  for (int b = 0; b < batches && ok; ++b) {
    double t0 = now_us();
    for (int i = 0; i < per && ok; ++i) ok = fn();
    double t1 = now_us();
    CUDA_OK(cudaStreamSynchronize(g_s));
    double t2 = now_us();
    host.push_back((t1 - t0) / per);
    gpu.push_back((t2 - t0) / per);
  }
  nvte_comm_host_counters(&a1, &c1);
  if (!ok) r.error = nvte_comm_last_error();
  // Every rank reports whether it failed (a failed rank stopped calling: its peers' calls
  // may have timed out too).
  int mine = ok ? 0 : 1, any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any && r.error.empty()) r.error = "failed on another rank";
  double med[2] = {0, 0}, worst[2] = {0, 0};
  if (!host.empty()) {
    std::sort(host.begin(), host.end());
    std::sort(gpu.begin(), gpu.end());
    med[0] = host[host.size() / 2];
    med[1] = gpu[gpu.size() / 2];
  }
  MPI_Allreduce(med, worst, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  r.host_us = worst[0];
  r.gpu_us = worst[1];
  double n = (double)batches * per, cnt[2] = {(a1 - a0) / n, (c1 - c0) / n}, cmax[2];
  MPI_Allreduce(cnt, cmax, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  r.allocs = cmax[0];
  r.calls = cmax[1];
  g_rows.push_back(r);
  MPI_Barrier(MPI_COMM_WORLD);
}

bool ok_status() { return nvte_comm_last_status() == NVTE_COMM_SUCCESS; }

Tensor bf16(std::vector<size_t> shape) {
  Tensor t(kNVTEBFloat16, shape);
  CUDA_OK(cudaMemset(t.data.p, 0, t.data.bytes));  // zeros: any values do for timing
  CUDA_OK(cudaStreamSynchronize(0));
  return t;
}

// The comm-GEMM and overlap ops at global size N (m = n = k = N) over `transport`.
void bench_ops(size_t N, const char *transport, ncclComm_t nccl, Tensor &ws) {
  const size_t tp = (size_t)g_tp, Nl = N / tp;
  const bool over_nccl = !std::strcmp(transport, "nccl");
  // comm-GEMM context.
  setenv("NVTE_COMM_TRANSPORT", transport, 1);
  NVTECommGemmCtx *ctx = nullptr;
  if (over_nccl) {
    ctx = nvte_comm_gemm_ctx_create(nccl, g_tp, g_rank);
  } else {
    NVTECommBootstrap bs{};
    bs.world_rank = g_rank;
    bs.world_size = g_tp;
    bs.allgather = mpi_allgather;
    bs.barrier = mpi_barrier;
    nvte_comm_gemm_ctx_create_bootstrap(&bs, &ctx);
  }
  unsetenv("NVTE_COMM_TRANSPORT");
  if (!ctx) {
    g_rows.push_back(Row{"comm-GEMM context", (int)N, g_tp, transport, 0, 0, 0, 0, nvte_comm_last_error()});
  } else {
    const int64_t m = N, n = N, k = N;
    const NVTECommGemmAlgoType algo = kNVTECommGemmAlgoSplitP2P;  // the defaults, no autotuning
    {  // all-gather GEMM: A [m/tp, k] (T), B [n/tp, k], D [n, m/tp]
      Tensor A = bf16({Nl, N}), B = bf16({Nl, N}), D = bf16({N, Nl});
      measure("nvte_all_gather_gemm", (int)N, transport, [&] {
        nvte_all_gather_gemm(ctx, m, n, k, A.h, B.h, D.h, nullptr, nullptr, true, false, false, false, 0, g_s, algo);
        return ok_status();
      });
    }
    {  // reduce-scatter / all-reduce: A [m, k/tp] (T), B [n, k/tp], D [n/tp, m] / [n, m]
      Tensor A = bf16({N, Nl}), B = bf16({N, Nl}), Drs = bf16({Nl, N}), Dar = bf16({N, N});
      measure("nvte_gemm_reduce_scatter", (int)N, transport, [&] {
        nvte_gemm_reduce_scatter(ctx, m, n, k, A.h, B.h, Drs.h, nullptr, nullptr, true, false, false, false, 0, g_s, algo);
        return ok_status();
      });
      measure("nvte_gemm_all_reduce", (int)N, transport, [&] {
        nvte_gemm_all_reduce(ctx, m, n, k, A.h, B.h, Dar.h, nullptr, nullptr, true, false, false, false, 0, g_s, algo);
        return ok_status();
      });
    }
    nvte_comm_gemm_ctx_destroy(ctx);
  }
  // Overlap object: buffer [N, N] bf16 (the gathered B, or the GEMM output to scatter).
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  cfg.tp_size = g_tp;
  cfg.transport = over_nccl ? NVTE_COMM_TRANSPORT_NCCL : NVTE_COMM_TRANSPORT_IPC;
  NVTECommBootstrap bs{};
  if (over_nccl) {
    bs.nccl_comm = nccl;
  } else {
    bs.world_rank = g_rank;
    bs.world_size = g_tp;
    bs.allgather = mpi_allgather;
    bs.barrier = mpi_barrier;
  }
  NVTECommOverlap *o = nullptr;
  if (nvte_comm_overlap_create(&bs, &cfg, N, N, kNVTEBFloat16, &o) != NVTE_COMM_SUCCESS) {
    g_rows.push_back(Row{"overlap object", (int)N, g_tp, transport, 0, 0, 0, 0, nvte_comm_last_error()});
    return;
  }
  {  // split_ag: D [N, N] = gather(B [N/tp, N]) x A [N, N]^T
    Tensor A = bf16({N, N}), B = bf16({Nl, N}), D = bf16({N, N});
    measure("nvte_comm_overlap_split_ag", (int)N, transport, [&] {
      return nvte_comm_overlap_split_ag(o, A.h, true, B.h, false, D.h, nullptr, nullptr, false, ws.h, false, false,
                                        nullptr, g_s) == NVTE_COMM_SUCCESS;
    });
  }
  {  // split_rs / split_rs_p2p: partial [N, N] = B [N, N/tp] x A [N, N/tp]^T, rows scattered
    Tensor A = bf16({N, Nl}), B = bf16({N, Nl}), out = bf16({Nl, N});
    measure("nvte_comm_overlap_split_rs", (int)N, transport, [&] {
      return nvte_comm_overlap_split_rs(o, A.h, true, B.h, false, nullptr, nullptr, nullptr, false, ws.h, false, false,
                                        out.h, g_s) == NVTE_COMM_SUCCESS;
    });
    measure("nvte_comm_overlap_split_rs_p2p", (int)N, transport, [&] {
      return nvte_comm_overlap_split_rs_p2p(o, A.h, true, B.h, false, nullptr, nullptr, nullptr, false, ws.h, false,
                                            false, out.h, g_s) == NVTE_COMM_SUCCESS;
    });
  }
  {  // bulk all-gather of the buffer beside an unrelated GEMM [N, N] x [N, N]
    Tensor A = bf16({N, N}), B = bf16({N, N}), D = bf16({N, N});
    measure("nvte_comm_overlap_bulk (AG)", (int)N, transport, [&] {
      return nvte_comm_overlap_bulk(o, NVTE_COMM_OVERLAP_AG, A.h, true, B.h, false, D.h, nullptr, nullptr, false, ws.h,
                                    false, false, nullptr, nullptr, g_s) == NVTE_COMM_SUCCESS;
    });
  }
  nvte_comm_overlap_destroy(o);
}

#ifdef TE_BENCH_HAVE_LT
// A bare cublasLtMatmul of D [N, N] = B [N, N] x A [N, N]^T (bf16, fp32 compute: nvte_cublas_gemm's
// TN call above in cuBLAS terms), its functions taken from the cuBLASLt the library loaded
// (no link-time dependency): descriptors, layouts and the heuristic's first algorithm made
// once, then only cublasLtMatmul per call.
struct BareLt {
  decltype(&cublasLtMatmul) matmul = nullptr;
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> algos;  // the heuristic's top candidates (algos[0] = algo)
  std::vector<std::string> names;           // each one's configuration, for the table
  std::string error;

  BareLt(size_t N, size_t ws_bytes) {
    void *lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcublasLt.so.13", RTLD_NOW);
    if (!lib) { error = "libcublasLt.so.13 not loaded"; return; }
#define TE_LT(f) auto f##_ = (decltype(&f))dlsym(lib, #f)
    TE_LT(cublasLtCreate); TE_LT(cublasLtMatmulDescCreate); TE_LT(cublasLtMatmulDescSetAttribute);
    TE_LT(cublasLtMatrixLayoutCreate); TE_LT(cublasLtMatmulPreferenceCreate); TE_LT(cublasLtMatmulPreferenceSetAttribute);
    TE_LT(cublasLtMatmulAlgoGetHeuristic); TE_LT(cublasLtMatmulPreferenceDestroy); TE_LT(cublasLtMatmulAlgoConfigGetAttribute);
#undef TE_LT
    matmul = (decltype(&cublasLtMatmul))dlsym(lib, "cublasLtMatmul");
    if (!cublasLtCreate_ || !matmul || !cublasLtMatmulAlgoGetHeuristic_ || !cublasLtMatmulPreferenceDestroy_) { error = "symbols missing"; return; }
    cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    uint64_t wsb = ws_bytes;
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulHeuristicResult_t res[8] = {};
    int count = 0;
    bool ok = cublasLtCreate_(&h) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescCreate_(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute_(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulDescSetAttribute_(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate_(&la, CUDA_R_16BF, N, N, N) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate_(&lb, CUDA_R_16BF, N, N, N) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatrixLayoutCreate_(&ld, CUDA_R_16BF, N, N, N) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceCreate_(&pref) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulPreferenceSetAttribute_(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb) ==
                  CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmulAlgoGetHeuristic_(h, desc, la, lb, ld, ld, pref, 8, res, &count) == CUBLAS_STATUS_SUCCESS && count > 0;
    if (pref) cublasLtMatmulPreferenceDestroy_(pref);
    if (!ok) { error = "setup failed"; return; }
    algo = res[0].algo;
    for (int i = 0; i < count; ++i) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
      auto get = [&](cublasLtMatmulAlgoConfigAttributes_t a) {
        uint32_t v = 0;
        size_t w = 0;
        if (cublasLtMatmulAlgoConfigGetAttribute_) cublasLtMatmulAlgoConfigGetAttribute_(&res[i].algo, a, &v, sizeof v, &w);
        return v;
      };
      char b[160];
      std::snprintf(b, sizeof b, "heuristic #%d (algo %u, tile %u, stages %u, split-K %u, reduction %u, cluster %u)", i,
                    get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
                    get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                    get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
      algos.push_back(res[i].algo);
      names.push_back(b);
    }
  }
  bool run(const void *A, const void *B, void *D, void *ws, size_t ws_bytes, cudaStream_t s, int i = 0) const {
    const float alpha = 1.0f, beta = 0.0f;
    return matmul(h, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &algos[i], ws, ws_bytes, s) == CUBLAS_STATUS_SUCCESS;
  }
};
#endif

bool in_bar(const Row &r) {
  return r.tp == 1 && r.size == 256 && r.transport == "ipc" && r.op.rfind("nvte_", 0) == 0 && r.op != "nvte_cublas_gemm";
}

}  // namespace

int main(int argc, char **argv) {
  probe_one_gpu_or_continue(argc, argv);  // ranks may share GPUs
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_tp);
  bool strict = false;
  const char *out_path = nullptr;
  std::vector<size_t> sizes = {256, 4096};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--strict")) strict = true;
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[i + 1];
    if (!std::strcmp(argv[i], "--small-only")) sizes = {256};
  }
  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(g_rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
  // NCCL only where every rank has its own GPU.
  int shared_local = g_tp > ndev ? 1 : 0, shared = 0;
  MPI_Allreduce(&shared_local, &shared, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  ncclComm_t nccl = nullptr;
  if (!shared) {
    ncclUniqueId id;
    if (g_rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (ncclCommInitRank(&nccl, g_tp, id, g_rank) != ncclSuccess) nccl = nullptr;
  }
  Tensor ws(kNVTEByte, {(size_t)32 << 20});
  DevBuf tiny(4);
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  // The driver API from the loaded libcuda (no link-time dependency).
  void *cuda_drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  using GetCur = int (*)(void **);
  using GetCtx = int (*)(cudaStream_t, void **);
  GetCur ctx_get_current = cuda_drv ? (GetCur)dlsym(cuda_drv, "cuCtxGetCurrent") : nullptr;
  GetCtx stream_get_ctx = cuda_drv ? (GetCtx)dlsym(cuda_drv, "cuStreamGetCtx") : nullptr;
  for (size_t N : sizes) {
    measure("cudaMemsetAsync 4 B (launch floor)", (int)N, "-", [&] { return cudaMemsetAsync(tiny.p, 0, 4, g_s) == cudaSuccess; });
    measure("cudaEventRecord (floor)", (int)N, "-", [&] { return cudaEventRecord(ev, g_s) == cudaSuccess; });
    if (ctx_get_current && stream_get_ctx) {  // the driver calls of the library's context lookup
      void *c0 = nullptr, *c1 = nullptr;
      measure("cuCtxGetCurrent + cuStreamGetCtx (floor)", (int)N, "-",
              [&] { return ctx_get_current(&c0) == 0 && stream_get_ctx(g_s, &c1) == 0; });
    }
    {
      Tensor A = bf16({N, N}), B = bf16({N, N}), D = bf16({N, N});
      measure("nvte_cublas_gemm", (int)N, "-", [&] {
        nvte_cublas_gemm(A.h, B.h, D.h, nullptr, nullptr, true, false, false, ws.h, false, false, 0, g_s);
        return ok_status();
      });
#ifdef TE_BENCH_HAVE_LT
      // (after nvte_cublas_gemm: the library has loaded cuBLASLt)
      BareLt lt(N, ws.data.bytes);
      if (lt.error.empty()) {
        measure("cublasLtMatmul bare (GEMM floor)", (int)N, "-", [&] { return lt.run(A.data.p, B.data.p, D.data.p, ws.data.p, ws.data.bytes, g_s); });
        // Each of the heuristic's candidates (what a launch of each costs the host).
        for (size_t i = 1; i < lt.algos.size() && N <= 256; ++i)
          measure("cublasLtMatmul bare, " + lt.names[i], (int)N, "-",
                  [&] { return lt.run(A.data.p, B.data.p, D.data.p, ws.data.p, ws.data.bytes, g_s, (int)i); });
        if (g_rank == 0 && N <= 256) std::printf("bare cublasLtMatmul floor: %s\n", lt.names[0].c_str());
      } else
        g_rows.push_back(Row{"cublasLtMatmul bare (GEMM floor)", (int)N, g_tp, "-", 0, 0, 0, 0, lt.error});
#endif
    }
    bench_ops(N, "ipc", nullptr, ws);
    if (nccl) bench_ops(N, "nccl", nccl, ws);
  }
  cudaEventDestroy(ev);
  bool pass = true;
  int in = 0;
  std::string table = "| op | size | tp | transport | host us/call (median) | GPU us/call | allocs/call | CUDA lib calls/call |\n"
                      "|---|---|---|---|---|---|---|---|\n";
  for (const Row &r : g_rows) {
    char b[512];
    if (!r.error.empty()) {
      std::snprintf(b, sizeof b, "| %s | %d^3 | %d | %s | error: %s | | | |\n", r.op.c_str(), r.size, r.tp, r.transport.c_str(),
                    r.error.c_str());
    } else {
      std::snprintf(b, sizeof b, "| %s | %d^3 | %d | %s | %.2f | %.2f | %.2f | %.1f |\n", r.op.c_str(), r.size, r.tp,
                    r.transport.c_str(), r.host_us, r.gpu_us, r.allocs, r.calls);
    }
    table += b;
    if (in_bar(r)) {
      ++in;
      pass = pass && r.error.empty() && r.host_us <= 10.0 && r.allocs == 0;
    }
  }
  if (g_rank == 0) {
    std::printf("\n%s", table.c_str());
    for (size_t N : sizes) {
      const Row *bare = nullptr, *gemm = nullptr;
      for (const Row &r : g_rows)
        if (r.size == (int)N && r.error.empty()) {
          if (r.op == "cublasLtMatmul bare (GEMM floor)") bare = &r;
          if (r.op == "nvte_cublas_gemm") gemm = &r;
        }
      if (bare && gemm)
        std::printf("%zu^3: nvte_cublas_gemm costs %.2f us of host time beyond the bare cublasLtMatmul (%.2f vs %.2f)\n", N,
                    gemm->host_us - bare->host_us, gemm->host_us, bare->host_us);
    }
    if (!nccl) std::printf("(nccl: not measured: %s)\n", shared ? "ranks share a GPU, which NCCL refuses" : "no communicator");
    if (g_tp == 1)
      std::printf("host-cost bar (tp 1, 256^3, ipc, %d comm-GEMM / overlap ops: <= 10 us/call and 0 allocations): %s\n", in,
                  pass && in == 7 ? "PASS" : "FAIL");
    else
      std::printf("tp %d: no bar (ranks sharing a GPU time-slice; the bar is at tp 1)\n", g_tp);
    if (out_path) {
      FILE *f = std::fopen(out_path, "w");
      if (f) {
        std::fputs(table.c_str(), f);
        std::fclose(f);
      }
    }
  }
  if (nccl) ncclCommDestroy(nccl);
  MPI_Finalize();
  return strict && g_tp == 1 && !(pass && in == 7) ? 1 : 0;
}
