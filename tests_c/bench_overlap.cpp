// The overlap benchmark (README's main job): on the anchor shapes, per algorithm, the
// GEMM alone, the NCCL collective alone, NCCL then GEMM, and ours; ours / max(GEMM,
// NCCL) ("bound") and ours / (NCCL then GEMM). All ranks form one tensor-parallel group
// (tp = number of ranks). Random data, CUDA events, warm-up, median of many; all figures
// of a shape are timed in interleaved rounds (tu::time_interleaved), so drift hits them
// alike; every figure is the maximum over ranks of that rank's median. Prints a markdown table on
// rank 0 (and writes it to --out FILE) and a geomean line per dtype.
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <map>

#include "nccl_util.hpp"
#include "test_util.hpp"

using namespace tu;

namespace {

int g_warmup = 3, g_iters = 20, g_rounds = 5;
cudaStream_t g_s;

// The regions of one shape in interleaved rounds (g_iters runs each in all).
std::vector<double> time_all(const std::vector<std::function<void()>> &fns) {
  return tu::time_interleaved(g_s, g_warmup, g_rounds, std::max(1, g_iters / g_rounds), fns);
}

void check(NVTECommStatus st, const char *what) {
  if (st != NVTE_COMM_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, nvte_comm_last_error());
    MPI_Abort(MPI_COMM_WORLD, 5);
  }
}
void check_last(const char *what) { check(nvte_comm_last_status(), what); }

// A tensor handle over rows [r0, r0 + n) of a 2-D tensor (no copy).
Tensor view_rows(const Tensor &t, size_t r0, size_t n) {
  Tensor v;
  v.h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  size_t cols = t.shape[1];
  NVTEBasicTensor b = basic((char *)t.data.p + r0 * cols * dtype_bytes(t.dtype), t.dtype, {n, cols});
  nvte_set_tensor_param_v2(v.h, kNVTERowwiseData, &b, sizeof b);
  if (t.scale_inv.p) v.set_scalar(kNVTERowwiseScaleInv, t.scale_inv.p);
  return v;
}

// D = X W^T (TN) as tp GEMMs on row chunks of X and D, without communication: what
// splitting the GEMM alone costs. The views live in `keep`.
std::function<void()> chunked(const Tensor &W, const Tensor &X, const Tensor &D, int tp, const Tensor &ws, bool split_acc,
                              std::vector<Tensor> &keep) {
  const size_t rows = X.shape[0] / tp;
  keep.clear();
  for (int c = 0; c < tp; ++c) {
    keep.push_back(view_rows(X, c * rows, rows));
    keep.push_back(view_rows(D, c * rows, rows));
  }
  return [&W, &ws, &keep, tp, split_acc] {
    for (int c = 0; c < tp; ++c)
      nvte_cublas_gemm(W.h, keep[2 * c].h, keep[2 * c + 1].h, nullptr, nullptr, true, false, false, ws.h, false, split_acc, 0, g_s);
  };
}

struct Row {
  std::string line;
  double ratio_bound;
  std::string dtype;
};

}  // namespace

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  int rank, tp;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &tp);
  const char *out_path = nullptr;
  std::string only;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--out")) out_path = argv[i + 1];
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) g_rounds = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
  }
  int ndev;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
  ncclUniqueId id;
  if (rank == 0) NCCL_OK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t nccl;
  NCCL_OK(ncclCommInitRank(&nccl, tp, id, rank));
  DevBuf wsbuf(64u << 20);
  Tensor ws;
  ws.h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  {
    NVTEBasicTensor b = basic(wsbuf.p, kNVTEByte, {wsbuf.bytes});
    nvte_set_tensor_param_v2(ws.h, kNVTERowwiseData, &b, sizeof b);
  }
  NVTECommBootstrap bs{};
  bs.nccl_comm = nccl;

  std::vector<Row> rows;
  struct Shape { size_t M, K, N; };  // tokens x input features x output features (global)
  const Shape ag_shapes[] = {{8192, 8192, 28672}, {8192, 4096, 16384}, {16384, 8192, 8192}};
  const Shape rs_shapes[] = {{8192, 28672, 8192}, {8192, 16384, 4096}, {16384, 8192, 8192}};
  for (NVTEDType in : {kNVTEBFloat16, kNVTEFloat8E4M3}) {
    const bool fp8 = is_fp8(in);
    const bool split_acc = !fp8;
    const NVTEDType out = kNVTEBFloat16;
    // ---------------- AG + GEMM: X [M, K] gathered from shards [M/tp, K]; W [N/tp, K]; D [M, N/tp]
    for (const Shape &s : ag_shapes) {
      if (!only.empty() && only != "ag") break;
      const size_t M = s.M, K = s.K, Nl = s.N / tp, Ml = M / tp;
      Tensor W(in, {Nl, K}), Xs(in, {Ml, K}), X(in, {M, K}), D(out, {M, Nl});
      nvte_comm_fill_uniform(W.h, 11 + rank, -1, 1, g_s);
      nvte_comm_fill_uniform(Xs.h, 23 + rank, -1, 1, g_s);
      nvte_comm_fill_uniform(X.h, 29 + rank, -1, 1, g_s);
      auto gemm = [&] { nvte_cublas_gemm(W.h, X.h, D.h, nullptr, nullptr, true, false, false, ws.h, false, split_acc, 0, g_s); };
      auto coll = [&] { NCCL_OK(ncclAllGather(Xs.data.p, X.data.p, Ml * K * dtype_bytes(in), ncclUint8, nccl, g_s)); };
      gemm();
      check_last("gemm");
      struct V { const char *name; bool ce, aggregate; };
      const V vs[] = {{"ring AG (CE)", true, false}, {"ring AG bidir (CE)", true, true}, {"ring AG (SM)", false, false}};
      std::vector<NVTECommOverlap *> objs;
      for (const V &v : vs) {
        NVTECommOverlapConfig cfg;
        nvte_comm_overlap_config_default(&cfg);
        cfg.use_ce = v.ce;
        cfg.aggregate = v.aggregate;
        NVTECommOverlap *o = nullptr;
        check(nvte_comm_overlap_create(&bs, &cfg, M, K, in, &o), "create");
        objs.push_back(o);
      }
      std::vector<Tensor> views;
      std::vector<std::function<void()>> fns = {gemm, coll, [&] { coll(); gemm(); }, chunked(W, X, D, tp, ws, split_acc, views)};
      for (NVTECommOverlap *o : objs)
        fns.push_back([&, o] {
          check(nvte_comm_overlap_split_ag(o, W.h, true, Xs.h, false, D.h, nullptr, nullptr, false, ws.h, false, split_acc, nullptr, g_s), "split_ag");
        });
      std::vector<double> t = time_all(fns);
      const double t_gemm = t[0], t_coll = t[1], t_seq = t[2], t_chunked = t[3], bound = std::max(t_gemm, t_coll);
      for (size_t i = 0; i < objs.size(); ++i) {
        check(nvte_comm_overlap_synchronize(objs[i]), "synchronize");
        nvte_comm_overlap_destroy(objs[i]);
        const double to = t[4 + i];
        char b[400];
        std::snprintf(b, sizeof b, "| %d | %s | AG | %zux%zux%zu | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |", tp, dtype_name(in), M, K,
                      s.N, vs[i].name, t_gemm, t_chunked, t_coll, t_seq, to, to / bound, to / t_seq);
        rows.push_back({b, to / bound, std::string(dtype_name(in)) + " AG " + vs[i].name});
        if (rank == 0) std::printf("%s\n", b), std::fflush(stdout);
      }
    }
    // ---------------- GEMM + RS: X [M, K/tp]; W [N, K/tp]; partial D [M, N]; out [M/tp, N]
    for (const Shape &s : rs_shapes) {
      if (!only.empty() && only != "rs") break;
      const size_t M = s.M, Kl = s.K / tp, N = s.N, Ml = M / tp;
      Tensor W(in, {N, Kl}), X(in, {M, Kl}), D(out, {M, N}), R(out, {Ml, N});
      nvte_comm_fill_uniform(W.h, 31 + rank, -1, 1, g_s);
      nvte_comm_fill_uniform(X.h, 37 + rank, -1, 1, g_s);
      auto gemm = [&] { nvte_cublas_gemm(W.h, X.h, D.h, nullptr, nullptr, true, false, false, ws.h, false, split_acc, 0, g_s); };
      auto coll = [&] { NCCL_OK(ncclReduceScatter(D.data.p, R.data.p, Ml * N, ncclBfloat16, ncclSum, nccl, g_s)); };
      gemm();
      check_last("gemm");
      // rs_ring: NVTE_COMM_RS_RING for the call (the accumulating ring: each GEMM adds
      // to the running sum that arrived, no closing reduction).
      struct V { const char *name; bool p2p, ce; const char *rs_ring; };
      const V vs[] = {{"pipelined RS", false, true, "reduce"},
                      {"ring RS (CE)", true, true, "reduce"},
                      {"ring RS (SM)", true, false, "reduce"},
                      {"ring RS accumulate (CE)", true, true, "accumulate"}};
      std::vector<NVTECommOverlap *> objs;
      for (const V &v : vs) {
        NVTECommOverlapConfig cfg;
        nvte_comm_overlap_config_default(&cfg);
        cfg.use_ce = v.ce;
        NVTECommOverlap *o = nullptr;
        check(nvte_comm_overlap_create(&bs, &cfg, M, N, out, &o), "create");
        objs.push_back(o);
      }
      std::vector<Tensor> views;
      std::vector<std::function<void()>> fns = {gemm, coll, [&] { gemm(); coll(); }, chunked(W, X, D, tp, ws, split_acc, views)};
      for (size_t i = 0; i < objs.size(); ++i)
        fns.push_back([&, i] {
          setenv("NVTE_COMM_RS_RING", vs[i].rs_ring, 1);  // read at every call
          auto fn = vs[i].p2p ? nvte_comm_overlap_split_rs_p2p : nvte_comm_overlap_split_rs;
          check(fn(objs[i], W.h, true, X.h, false, nullptr, nullptr, nullptr, false, ws.h, false, split_acc, R.h, g_s), "split_rs");
        });
      std::vector<double> t = time_all(fns);
      unsetenv("NVTE_COMM_RS_RING");
      const double t_gemm = t[0], t_coll = t[1], t_seq = t[2], t_chunked = t[3], bound = std::max(t_gemm, t_coll);
      for (size_t i = 0; i < objs.size(); ++i) {
        check(nvte_comm_overlap_synchronize(objs[i]), "synchronize");
        nvte_comm_overlap_destroy(objs[i]);
        const double to = t[4 + i];
        char b[400];
        std::snprintf(b, sizeof b, "| %d | %s | RS | %zux%zux%zu | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |", tp, dtype_name(in), M, s.K,
                      N, vs[i].name, t_gemm, t_chunked, t_coll, t_seq, to, to / bound, to / t_seq);
        rows.push_back({b, to / bound, std::string(dtype_name(in)) + " RS " + vs[i].name});
        if (rank == 0) std::printf("%s\n", b), std::fflush(stdout);
      }
    }
  }
  if (rank == 0) {
    std::string table =
        "| tp | dtype | op | M x K x N | algorithm | GEMM ms | GEMM in tp chunks ms | NCCL ms | NCCL+GEMM ms | ours ms | ours/bound | ours/(NCCL+GEMM) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (auto &r : rows) table += r.line + "\n";
    // Geomean of ours/bound per (dtype, op, algorithm).
    std::map<std::string, std::pair<double, int>> gm;
    for (auto &r : rows) {
      auto &g = gm[r.dtype];
      g.first += std::log(r.ratio_bound);
      g.second += 1;
    }
    table += "\n| dtype op algorithm | geomean ours/bound |\n|---|---|\n";
    for (auto &[k, v] : gm) {
      char b[200];
      std::snprintf(b, sizeof b, "| %s | %.3f |\n", k.c_str(), std::exp(v.first / v.second));
      table += b;
    }
    std::printf("\n%s", table.c_str());
    if (out_path) {
      FILE *f = std::fopen(out_path, "w");
      if (f) { std::fputs(table.c_str(), f); std::fclose(f); }
    }
  }
  ncclCommDestroy(nccl);
  MPI_Finalize();
  return 0;
}
