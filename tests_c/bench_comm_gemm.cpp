// Benchmark of TE's comm_gemm.h API (nvte_all_gather_gemm, nvte_gemm_reduce_scatter,
// nvte_gemm_all_reduce) on the anchor shapes, with the IPC and the NCCL transport,
// against NCCL then GEMM (GEMM then NCCL for RS and AR). All ranks are one tensor-parallel
// group; "no-overlap ms" is the same call in a context made under NVTE_COMM_OVERLAP=off (the
// collective and the GEMM one after the other: the tuner's fallback). Random data, CUDA
// events, warm-up, median of many, the five timed figures of a row
// timed in interleaved rounds; each figure is the maximum over ranks of that rank's median.
// The GEMM alone and NCCL+GEMM compute the GEMM the comm-GEMM calls compute: FP8 with full
// precision accumulation (the calls' default), fast accumulation under
// NVTE_COMM_GEMM_FP8_FAST_ACCUM=1 as the calls then use.
#include <nccl.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace tu;

namespace {
cudaStream_t g_s;
int g_iters = 20;

// GEMM alone, the collective alone, the two in sequence, ours and ours without overlap, in
// interleaved rounds (tu::time_interleaved: drift hits all alike), g_iters runs each in all.
std::vector<double> time_all(const std::vector<std::function<void()>> &fns) {
  const int rounds = 5;
  return tu::time_interleaved(g_s, 3, rounds, std::max(1, g_iters / rounds), fns);
}

// NVTE_COMM_GEMM_FP8_FAST_ACCUM as the library reads it (a boolean; unset: off).
bool fp8_fast_accum() {
  const char *v = std::getenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM");
  if (!v) return false;
  std::string s;
  for (const char *c = v; *c; ++c)
    if (!std::isspace((unsigned char)*c)) s += (char)std::tolower((unsigned char)*c);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

// A comm-GEMM context made with NVTE_COMM_OVERLAP=off (the variable restored after).
NVTECommGemmCtx *ctx_without_overlap(ncclComm_t nccl, int tp, int rank) {
  const char *was = std::getenv("NVTE_COMM_OVERLAP");
  const std::string keep = was ? was : "";
  setenv("NVTE_COMM_OVERLAP", "off", 1);
  NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(nccl, tp, rank);
  if (was) setenv("NVTE_COMM_OVERLAP", keep.c_str(), 1);
  else unsetenv("NVTE_COMM_OVERLAP");
  return ctx;
}

void ok(const char *what) {
  if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, nvte_comm_last_error());
    MPI_Abort(MPI_COMM_WORLD, 5);
  }
}
}  // namespace

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  int rank, tp;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &tp);
  const char *out_path = nullptr;
  std::string ops = "ag,rs,ar", transports = "ipc,nccl";  // --ops / --transports: comma lists
  NVTECommGemmAlgoType algo = kNVTECommGemmAlgoDefault;   // --algo default|atomic (AtomicP2P)
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--algo")) algo = std::strcmp(argv[i + 1], "atomic") ? kNVTECommGemmAlgoDefault : kNVTECommGemmAlgoAtomicP2P;
    if (!std::strcmp(argv[i], "--out")) out_path = argv[i + 1];
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--ops")) ops = argv[i + 1];
    if (!std::strcmp(argv[i], "--transports")) transports = argv[i + 1];
  }
  auto listed = [](const std::string &list, const char *x) { return ("," + list + ",").find("," + std::string(x) + ",") != std::string::npos; };
  int ndev;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
  ncclUniqueId id;
  if (rank == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t nccl;
  if (ncclCommInitRank(&nccl, tp, id, rank) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 3);
  DevBuf wsb(32u << 20);
  Tensor ws;
  ws.h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor wb = basic(wsb.p, kNVTEByte, {wsb.bytes});
  nvte_set_tensor_param_v2(ws.h, kNVTERowwiseData, &wb, sizeof wb);

  std::string table =
      "| tp | transport | op | dtype | M x K x N | GEMM ms | NCCL ms | NCCL+GEMM ms | ours ms | ours/bound | ours/(NCCL+GEMM) | "
      "no-overlap ms |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  struct Shape { size_t M, K, N; };
  std::vector<Shape> ag_shapes = {{8192, 8192, 28672}, {8192, 4096, 16384}, {16384, 8192, 8192}};
  std::vector<Shape> rs_shapes = {{8192, 28672, 8192}, {8192, 16384, 4096}, {16384, 8192, 8192}};
  for (int i = 1; i + 1 < argc; ++i)  // --shapes MxKxN,...: other shapes for every op
    if (!std::strcmp(argv[i], "--shapes")) {
      ag_shapes.clear();
      std::string list = std::string(argv[i + 1]) + ",";
      for (size_t p = 0, q; (q = list.find(',', p)) != std::string::npos; p = q + 1) {
        Shape s{};
        if (std::sscanf(list.substr(p, q - p).c_str(), "%zux%zux%zu", &s.M, &s.K, &s.N) == 3) ag_shapes.push_back(s);
      }
      rs_shapes = ag_shapes;
    }
  for (const char *transport : {"ipc", "nccl"}) {
    if (!listed(transports, transport)) continue;
    setenv("NVTE_COMM_TRANSPORT", transport, 1);
    NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(nccl, tp, rank);
    ok("ctx_create");
    NVTECommGemmCtx *ctx_off = ctx_without_overlap(nccl, tp, rank);
    ok("ctx_create (NVTE_COMM_OVERLAP=off)");
    for (NVTEDType in : {kNVTEBFloat16, kNVTEFloat8E4M3}) {
      const NVTEDType out = kNVTEBFloat16;
      // use_split_accumulator (full precision) unless FP8 with fast accumulation
      const bool split = !(is_fp8(in) && fp8_fast_accum());
      // AG: cuBLAS m = N (split), n = M (split, gathered), k = K. TN: a [m_loc, k], b [n_loc, k], d [n, m_loc].
      for (const Shape &s : ag_shapes) {
        if (!listed(ops, "ag")) break;
        size_t ml = s.N / tp, nl = s.M / tp;
        Tensor A(in, {ml, s.K}), Bl(in, {nl, s.K}), Bf(in, {s.M, s.K}), D(out, {s.M, ml});
        nvte_comm_fill_uniform(A.h, 1 + rank, -1, 1, g_s);
        nvte_comm_fill_uniform(Bl.h, 2 + rank, -1, 1, g_s);
        nvte_comm_fill_uniform(Bf.h, 3, -1, 1, g_s);
        auto gemm = [&] { nvte_cublas_gemm(A.h, Bf.h, D.h, nullptr, nullptr, true, false, false, ws.h, false, split, 0, g_s); };
        auto coll = [&] { ncclAllGather(Bl.data.p, Bf.data.p, nl * s.K * dtype_bytes(in), ncclUint8, nccl, g_s); };
        auto ours_in = [&](NVTECommGemmCtx *c) {
          return [&, c] {
            nvte_all_gather_gemm(c, s.N, s.M, s.K, A.h, Bl.h, D.h, nullptr, nullptr, true, false, false, false, 0, g_s, algo);
          };
        };
        auto ours = ours_in(ctx), ours_off = ours_in(ctx_off);
        ours();
        ok("all_gather_gemm");
        ours_off();
        ok("all_gather_gemm (no overlap)");
        std::vector<double> t = time_all({gemm, coll, [&] { coll(); gemm(); }, ours, ours_off});
        const double tg = t[0], tc = t[1], tq = t[2], to = t[3];
        char b[300];
        std::snprintf(b, sizeof b, "| %d | %s | AG | %s | %zux%zux%zu | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", tp, transport,
                      dtype_name(in), s.M, s.K, s.N, tg, tc, tq, to, to / std::max(tg, tc), to / tq, t[4]);
        table += b;
        if (rank == 0) std::printf("%s", b), std::fflush(stdout);
      }
      // RS and AR: cuBLAS m = N, n = M, k = K (split). TN: a [m, k_loc], b [n, k_loc].
      for (int ar = 0; ar < 2; ++ar)
        for (const Shape &s : rs_shapes) {
          if (!listed(ops, ar ? "ar" : "rs")) break;
          size_t kl = s.K / tp, nl = s.M / tp;
          Tensor A(in, {s.N, kl}), B(in, {s.M, kl}), Dp(out, {s.M, s.N}), D(out, {ar ? s.M : nl, s.N});
          nvte_comm_fill_uniform(A.h, 4 + rank, -1, 1, g_s);
          nvte_comm_fill_uniform(B.h, 5 + rank, -1, 1, g_s);
          auto gemm = [&] { nvte_cublas_gemm(A.h, B.h, Dp.h, nullptr, nullptr, true, false, false, ws.h, false, split, 0, g_s); };
          auto coll = [&] {
            if (ar) ncclAllReduce(Dp.data.p, D.data.p, s.M * s.N, ncclBfloat16, ncclSum, nccl, g_s);
            else ncclReduceScatter(Dp.data.p, D.data.p, nl * s.N, ncclBfloat16, ncclSum, nccl, g_s);
          };
          auto fn = ar ? nvte_gemm_all_reduce : nvte_gemm_reduce_scatter;
          auto ours_in = [&](NVTECommGemmCtx *c) {
            return [&, c] { fn(c, s.N, s.M, s.K, A.h, B.h, D.h, nullptr, nullptr, true, false, false, false, 0, g_s, algo); };
          };
          auto ours = ours_in(ctx), ours_off = ours_in(ctx_off);
          ours();
          ok(ar ? "gemm_all_reduce" : "gemm_reduce_scatter");
          ours_off();
          ok(ar ? "gemm_all_reduce (no overlap)" : "gemm_reduce_scatter (no overlap)");
          std::vector<double> t = time_all({gemm, coll, [&] { gemm(); coll(); }, ours, ours_off});
          const double tg = t[0], tc = t[1], tq = t[2], to = t[3];
          char b[300];
          std::snprintf(b, sizeof b, "| %d | %s | %s | %s | %zux%zux%zu | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", tp,
                        transport, ar ? "AR" : "RS", dtype_name(in), s.M, s.K, s.N, tg, tc, tq, to, to / std::max(tg, tc), to / tq,
                        t[4]);
          table += b;
          if (rank == 0) std::printf("%s", b), std::fflush(stdout);
        }
    }
    nvte_comm_gemm_ctx_destroy(ctx);
    nvte_comm_gemm_ctx_destroy(ctx_off);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0 && out_path) {
    FILE *f = std::fopen(out_path, "w");
    if (f) { std::fputs(table.c_str(), f); std::fclose(f); }
  }
  ncclCommDestroy(nccl);
  MPI_Finalize();
  return 0;
}
