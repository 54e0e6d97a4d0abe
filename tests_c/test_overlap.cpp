// The overlap engine against references built from NCCL all-gather / reduce-scatter and
// nvte_cublas_gemm: every algorithm x {bf16, fp16, fp8 e4m3 in / bf16 out} x {copy
// engine, SM} puts, for tp = world and (on 4+ GPUs) groups of tp 2. Each combination
// runs 200 back-to-back calls (no host synchronisation between them) with fresh random
// inputs for every call; each call's output is kept and checked. Plus bad inputs, and a
// rank that never enters a call (the others must report a timeout, not hang). The fused
// all-gather (config atomic_gemm: "fused_ag ... atomic_gemm") runs in the split_ag cases'
// harness, checked against the same reference.
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "nccl_util.hpp"
#include "test_util.hpp"

using namespace tu;

namespace {

int g_iters = 200;
NVTECommTransport g_transport = NVTE_COMM_TRANSPORT_IPC;

struct Env {
  int wrank, wsize, tp, tp_rank;
  ncclComm_t world_nccl, tp_nccl;
  cudaStream_t s;
  DevBuf ws;
  Report *rep;
};

int mpi_allgather(void *, void *global, size_t, const void *local, size_t local_bytes) {
  return MPI_Allgather(local, (int)local_bytes, MPI_BYTE, global, (int)local_bytes, MPI_BYTE, MPI_COMM_WORLD);
}
int mpi_barrier(void *) { return MPI_Barrier(MPI_COMM_WORLD); }

ncclComm_t make_nccl(MPI_Comm comm) {
  int r, n;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &n);
  ncclUniqueId id;
  if (r == 0) NCCL_OK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm);
  ncclComm_t c;
  NCCL_OK(ncclCommInitRank(&c, n, id, r));
  return c;
}

ncclDataType_t nccl_type(NVTEDType t) {
  switch (t) {
    case kNVTEFloat32: return ncclFloat32;
    case kNVTEFloat16: return ncclFloat16;
    case kNVTEBFloat16: return ncclBfloat16;
    default: return ncclUint8;
  }
}

Tensor view_of(NVTECommOverlap *o, bool local) {
  Tensor v;
  nvte_comm_overlap_get_buffer(o, local, &v.h);
  return v;  // data not owned: DevBuf stays empty
}

NVTETensor ws_tensor(Env &e, Tensor &holder) {
  holder = Tensor();
  holder.h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor b = basic(e.ws.p, kNVTEByte, {e.ws.bytes});
  nvte_set_tensor_param_v2(holder.h, kNVTERowwiseData, &b, sizeof b);
  return holder.h;
}

void fill(Tensor &t, uint64_t seed, cudaStream_t s) {
  if (nvte_comm_fill_uniform(t.h, seed, -1.0f, 1.0f, s) != NVTE_COMM_SUCCESS) {
    std::fprintf(stderr, "fill: %s\n", nvte_comm_last_error());
    MPI_Abort(MPI_COMM_WORLD, 4);
  }
}

// Per-call outputs kept on the device: slot i of `iters`.
struct Ring {
  DevBuf buf;
  size_t slot;
  Ring(size_t slot_bytes, int iters) : buf(slot_bytes * iters), slot(slot_bytes) {}
  void keep(int i, const void *src, cudaStream_t s) {
    CUDA_OK(cudaMemcpyAsync((char *)buf.p + i * slot, src, slot, cudaMemcpyDeviceToDevice, s));
  }
  std::vector<double> values(int i, NVTEDType t, size_t n) const {
    std::vector<uint8_t> h(slot);
    CUDA_OK(cudaMemcpy(h.data(), (char *)buf.p + i * slot, slot, cudaMemcpyDeviceToHost));
    return decode(h, t, n);
  }
};

struct Combo {
  const char *algo;
  NVTEDType in, out, buf;
  bool use_ce, aggregate;
  bool atomic = false;  // config atomic_gemm: the fused all-gather (fused_ag)
};

std::string name_of(const Combo &c, const Env &e) {
  char b[200];
  std::snprintf(b, sizeof b, "%s %s->%s buf=%s %s%s%s tp=%d", c.algo, dtype_name(c.in), dtype_name(c.out), dtype_name(c.buf),
                g_transport == NVTE_COMM_TRANSPORT_NCCL ? "NCCL" : c.use_ce ? "CE" : "SM", c.aggregate ? " bidirectional" : "",
                c.atomic ? " atomic_gemm" : "", e.tp);
  return b;
}

NVTECommOverlap *create(Env &e, const Combo &c, size_t rows, size_t cols, bool nccl_bootstrap, int64_t timeout_ms = 0) {
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  cfg.tp_size = e.tp;
  cfg.use_ce = c.use_ce;
  cfg.aggregate = c.aggregate;
  cfg.atomic_gemm = c.atomic;
  cfg.transport = g_transport;
  if (timeout_ms) cfg.timeout_ms = timeout_ms;
  NVTECommBootstrap bs{};
  if (nccl_bootstrap) {
    bs.nccl_comm = e.world_nccl;
  } else {
    bs.world_rank = e.wrank;
    bs.world_size = e.wsize;
    bs.allgather = mpi_allgather;
    bs.barrier = mpi_barrier;
  }
  NVTECommOverlap *o = nullptr;
  if (nvte_comm_overlap_create(&bs, &cfg, rows, cols, c.buf, &o) != NVTE_COMM_SUCCESS) {
    e.rep->fail(name_of(c, e) + ": create: " + nvte_comm_last_error());
    return nullptr;
  }
  return o;
}

bool status_ok(Env &e, NVTECommStatus st, const std::string &what) {
  if (st == NVTE_COMM_SUCCESS) return true;
  e.rep->fail(what + ": " + nvte_comm_status_string(st) + ": " + nvte_comm_last_error());
  return false;
}

// Check kept outputs against kept references; one report line per combination.
void judge(Env &e, const std::string &what, const Ring &ours, NVTEDType ot, const Ring &ref, NVTEDType rt, size_t n, double tol,
           int iters, double ref_scale = 1.0) {
  double worst = 0;
  int bad = 0;
  for (int i = 0; i < iters; ++i) {
    auto a = ours.values(i, ot, n), b = ref.values(i, rt, n);
    if (ref_scale != 1.0)
      for (auto &x : b) x *= ref_scale;
    double err = rel_err(a, b);
    if (!(err < tol)) ++bad;
    if (!(err <= worst)) worst = err;  // NaN sticks
  }
  char b[160];
  std::snprintf(b, sizeof b, ": %d calls, worst rel_err=%.3g (tol %.0e), %d bad", iters, worst, tol, bad);
  e.rep->check(bad == 0, what + b);
}

// ---------------------------------------------------------------- split_ag
void test_ag(Env &e, const Combo &c, bool nccl_bootstrap, bool with_epilogue) {
  const size_t nc = 128, n = nc * e.tp, k = 256, m = 192;
  std::string what = name_of(c, e) + (with_epilogue ? " +bias+gelu_aux" : "") + (nccl_bootstrap ? " (nccl bootstrap)" : " (callback bootstrap)");
  NVTECommOverlap *o = create(e, c, n, k, nccl_bootstrap);
  if (!o) return;
  Tensor A(c.in, {m, k}), Bs(c.in, {nc, k}), D(c.out, {n, m}), Dref(c.out, {n, m}), Bfull(c.in, {n, k}), Bcopy(c.in, {n, k});
  Tensor bias(c.out, {m}), aux(c.out, {n, m}), auxref(c.out, {n, m}), wsh;
  NVTETensor ws = ws_tensor(e, wsh);
  Ring ro(n * m * dtype_bytes(c.out), g_iters), rr(n * m * dtype_bytes(c.out), g_iters);
  Ring ra(with_epilogue ? n * m * dtype_bytes(c.out) : 1, g_iters), rar(with_epilogue ? n * m * dtype_bytes(c.out) : 1, g_iters);
  const bool split_acc = !is_fp8(c.in);
  bool ok = true;
  for (int it = 0; it < g_iters && ok; ++it) {
    uint64_t seed = 1000003ull * it + 7919ull * e.wrank + 17;
    fill(A, seed, e.s);
    fill(Bs, seed + 1, e.s);
    if (with_epilogue) fill(bias, seed + 2, e.s);
    CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
    ok = status_ok(e, nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, with_epilogue ? bias.h : nullptr,
                                                  with_epilogue ? aux.h : nullptr, false, ws, false, split_acc,
                                                  Bcopy.h, e.s),
                   what + " call " + std::to_string(it));
    ro.keep(it, D.data.p, e.s);
    if (with_epilogue) ra.keep(it, aux.data.p, e.s);
    // Reference: NCCL all-gather, then one GEMM on the gathered B.
    NCCL_OK(ncclAllGather(Bs.data.p, Bfull.data.p, nc * k * dtype_bytes(c.in), ncclUint8, e.tp_nccl, e.s));
    nvte_cublas_gemm(A.h, Bfull.h, Dref.h, with_epilogue ? bias.h : nullptr, with_epilogue ? auxref.h : nullptr, true, false,
                     false, ws, false, split_acc, 0, e.s);
    rr.keep(it, Dref.data.p, e.s);
    if (with_epilogue) rar.keep(it, auxref.data.p, e.s);
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  ok = ok && status_ok(e, nvte_comm_overlap_synchronize(o), what + " synchronize");
  if (ok) {
    double tol = is_fp8(c.in) ? 6e-2 : 1e-2;
    judge(e, what + " D", ro, c.out, rr, c.out, n * m, tol, g_iters);
    if (with_epilogue) judge(e, what + " pre_gelu_out", ra, c.out, rar, c.out, n * m, tol, g_iters);
    // B_copy holds the last call's gathered B, bit for bit.
    e.rep->check(Bcopy.data.download() == Bfull.data.download(), what + " B_copy equals the NCCL all-gather");
  }
  nvte_comm_overlap_destroy(o);
}

// ---------------------------------------------------------------- split_rs, split_rs_p2p
void test_rs(Env &e, const Combo &c, bool p2p) {
  const size_t nc = 128, n = nc * e.tp, k = 256, m = 192;
  std::string what = name_of(c, e);
  NVTECommOverlap *o = create(e, c, n, m, true);
  if (!o) return;
  Tensor A(c.in, {m, k}), B(c.in, {n, k}), out(c.out, {nc, m}), full(kNVTEFloat32, {n, m}), ref(kNVTEFloat32, {nc, m}), wsh;
  NVTETensor ws = ws_tensor(e, wsh);
  Tensor view = view_of(o, false);
  // FP8 buffer: partials written as e4m3 with scale 8; the reduction uses scale_inv 1/8.
  Tensor dscale(kNVTEFloat32, {1}), dsinv(kNVTEFloat32, {1});
  if (is_fp8(c.buf)) {
    float s = 8.0f, si = 0.125f;
    dscale.data.upload(&s);
    dsinv.data.upload(&si);
    view.set_scalar(kNVTEScale, dscale.data.p);
    view.set_scalar(kNVTERowwiseScaleInv, dsinv.data.p);
  }
  Ring ro(nc * m * dtype_bytes(c.out), g_iters), rr(nc * m * 4, g_iters);
  const bool split_acc = !is_fp8(c.in);
  bool ok = true;
  for (int it = 0; it < g_iters && ok; ++it) {
    uint64_t seed = 1000003ull * it + 7919ull * e.wrank + 99;
    fill(A, seed, e.s);
    fill(B, seed + 1, e.s);
    CUDA_OK(cudaMemsetAsync(out.data.p, 0xFF, out.data.bytes, e.s));
    auto fn = p2p ? nvte_comm_overlap_split_rs_p2p : nvte_comm_overlap_split_rs;
    ok = status_ok(e, fn(o, A.h, true, B.h, false, view.h, nullptr, nullptr, false, ws, false, split_acc, out.h, e.s),
                   what + " call " + std::to_string(it));
    ro.keep(it, out.data.p, e.s);
    // Reference: the full partial GEMM in fp32, then NCCL reduce-scatter (sum) in fp32.
    nvte_cublas_gemm(A.h, B.h, full.h, nullptr, nullptr, true, false, false, ws, false, split_acc, 0, e.s);
    NCCL_OK(ncclReduceScatter(full.data.p, ref.data.p, nc * m, ncclFloat32, ncclSum, e.tp_nccl, e.s));
    rr.keep(it, ref.data.p, e.s);
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  ok = ok && status_ok(e, nvte_comm_overlap_synchronize(o), what + " synchronize");
  if (ok) judge(e, what, ro, c.out, rr, kNVTEFloat32, nc * m, is_fp8(c.buf) || is_fp8(c.in) ? 6e-2 : 1e-2, g_iters);
  nvte_comm_overlap_destroy(o);
}

// ---------------------------------------------------------------- bulk
void test_bulk(Env &e, const Combo &c, bool ag) {
  const size_t nc = 128, n = nc * e.tp, cols = 256, m = 192, k = 256, ng = 320;
  std::string what = name_of(c, e);
  NVTECommOverlap *o = create(e, c, n, cols, false);
  if (!o) return;
  // The unrelated GEMM beside the collective.
  Tensor A(c.in, {m, k}), B(c.in, {ng, k}), D(c.out, {ng, m}), Dref(c.out, {ng, m}), wsh;
  NVTETensor ws = ws_tensor(e, wsh);
  Tensor X(c.buf, ag ? std::vector<size_t>{nc, cols} : std::vector<size_t>{n, cols});
  Tensor Xf(kNVTEFloat32, {X.numel}), gathered(c.buf, {n, cols}), out(c.out, {nc, cols}), ref(kNVTEFloat32, {nc, cols});
  Tensor view = view_of(o, false);
  Tensor one(kNVTEFloat32, {1});
  float f1 = 1.0f;
  one.data.upload(&f1);
  view.set_scalar(kNVTERowwiseScaleInv, one.data.p);  // fill writes unscaled values
  Ring ro(ag ? n * cols * dtype_bytes(c.buf) : nc * cols * dtype_bytes(c.out), g_iters);
  Ring rr(ag ? n * cols * dtype_bytes(c.buf) : nc * cols * 4, g_iters);
  Ring rg(ng * m * dtype_bytes(c.out), g_iters), rgr(ng * m * dtype_bytes(c.out), g_iters);
  const bool split_acc = !is_fp8(c.in);
  bool ok = true;
  for (int it = 0; it < g_iters && ok; ++it) {
    uint64_t seed = 1000003ull * it + 7919ull * e.wrank + 5;
    fill(A, seed, e.s);
    fill(B, seed + 1, e.s);
    fill(X, seed + 2, e.s);
    CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
    if (!ag) CUDA_OK(cudaMemsetAsync(out.data.p, 0xFF, out.data.bytes, e.s));
    ok = status_ok(e, nvte_comm_overlap_copy_into_buffer(o, X.h, ag, e.s), what + " copy_into_buffer");
    ok = ok && status_ok(e, nvte_comm_overlap_bulk(o, ag ? NVTE_COMM_OVERLAP_AG : NVTE_COMM_OVERLAP_RS, A.h, true, B.h, false, D.h,
                                                   nullptr, nullptr, false, ws, false, split_acc, view.h, ag ? nullptr : out.h, e.s),
                         what + " call " + std::to_string(it));
    rg.keep(it, D.data.p, e.s);
    nvte_cublas_gemm(A.h, B.h, Dref.h, nullptr, nullptr, true, false, false, ws, false, split_acc, 0, e.s);
    rgr.keep(it, Dref.data.p, e.s);
    if (ag) {
      Tensor v = view_of(o, false);
      ro.keep(it, nvte_tensor_data(v.h), e.s);
      NCCL_OK(ncclAllGather(X.data.p, gathered.data.p, nc * cols * dtype_bytes(c.buf), ncclUint8, e.tp_nccl, e.s));
      rr.keep(it, gathered.data.p, e.s);
    } else {
      ro.keep(it, out.data.p, e.s);
      if (is_fp8(c.buf)) {
        Tensor Xv(c.buf, {X.numel});  // same bytes, viewed flat with scale_inv 1
        CUDA_OK(cudaMemcpyAsync(Xv.data.p, X.data.p, X.data.bytes, cudaMemcpyDeviceToDevice, e.s));
        nvte_dequantize(Xv.h, Xf.h, e.s);
        CUDA_OK(cudaStreamSynchronize(e.s));
      } else {
        NVTETensor xf = nullptr;
        size_t dims[1] = {X.numel};
        nvte_comm_tensor_create_simple(X.data.p, c.buf, dims, 1, &xf);
        nvte_quantize(xf, Xf.h, e.s);
        nvte_destroy_tensor(xf);
      }
      NCCL_OK(ncclReduceScatter(Xf.data.p, ref.data.p, nc * cols, ncclFloat32, ncclSum, e.tp_nccl, e.s));
      rr.keep(it, ref.data.p, e.s);
    }
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  ok = ok && status_ok(e, nvte_comm_overlap_synchronize(o), what + " synchronize");
  if (ok) {
    double tol = is_fp8(c.in) ? 6e-2 : 1e-2;
    if (ag) judge(e, what + " gathered buffer (exact)", ro, c.buf, rr, c.buf, n * cols, 1e-12, g_iters);
    else judge(e, what + " rs_output", ro, c.out, rr, kNVTEFloat32, nc * cols, 1e-2, g_iters);
    judge(e, what + " concurrent GEMM", rg, c.out, rgr, c.out, ng * m, tol, g_iters);
  }
  nvte_comm_overlap_destroy(o);
}

// ---------------------------------------------------------------- errors
void expect(Env &e, NVTECommStatus got, NVTECommStatus want, const char *what) {
  std::string msg = nvte_comm_last_error();
  e.rep->check(got == want && !msg.empty(), std::string("error: ") + what + " -> " + nvte_comm_status_string(got) + ": " + msg);
}

void test_errors(Env &e) {
  Combo c{"errors", kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false};
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  NVTECommBootstrap bs{};
  bs.nccl_comm = e.world_nccl;
  NVTECommOverlap *o = nullptr;
  cfg.tp_size = e.wsize + 1;
  expect(e, nvte_comm_overlap_create(&bs, &cfg, 256, 256, kNVTEBFloat16, &o), NVTE_COMM_ERROR_INVALID_ARGUMENT, "tp does not divide the world");
  cfg.tp_size = 0;
  cfg.struct_size = 8;
  expect(e, nvte_comm_overlap_create(&bs, &cfg, 256, 256, kNVTEBFloat16, &o), NVTE_COMM_ERROR_INVALID_ARGUMENT, "config struct_size");
  nvte_comm_overlap_config_default(&cfg);
  cfg.atomic_gemm = true;  // accepted (the fused all-gather); tested by test_ag
  {
    NVTECommStatus st = nvte_comm_overlap_create(&bs, &cfg, 256, 256, kNVTEBFloat16, &o);
    e.rep->check(st == NVTE_COMM_SUCCESS, std::string("config atomic_gemm = true is accepted -> ") + nvte_comm_status_string(st));
    if (st == NVTE_COMM_SUCCESS) nvte_comm_overlap_destroy(o);
    o = nullptr;
  }
  if (e.wsize > 1)
    expect(e, nvte_comm_overlap_create(&bs, nullptr, 255, 256, kNVTEBFloat16, &o), NVTE_COMM_ERROR_INVALID_ARGUMENT, "rows not divisible by tp");
  NVTECommBootstrap bad{};
  bad.world_rank = 5;
  bad.world_size = 2;
  expect(e, nvte_comm_overlap_create(&bad, nullptr, 256, 256, kNVTEBFloat16, &o), NVTE_COMM_ERROR_INVALID_ARGUMENT, "bootstrap rank >= size");

  e.tp = e.wsize;
  o = create(e, c, 128 * e.wsize, 256, true);
  if (!o) return;
  const size_t nc = 128, k = 256, m = 192;
  Tensor A(kNVTEBFloat16, {m, k}), Bs(kNVTEBFloat16, {nc, k}), D(kNVTEBFloat16, {nc * e.wsize, m}), wsh;
  Tensor B16(kNVTEFloat16, {nc, k}), Bbig(kNVTEBFloat16, {2 * nc, k}), Dbad(kNVTEBFloat16, {nc * e.wsize + 1, m}), out_bad(kNVTEBFloat16, {nc + 1, m});
  NVTETensor ws = ws_tensor(e, wsh);
  expect(e, nvte_comm_overlap_split_ag(nullptr, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL overlap handle");
  expect(e, nvte_comm_overlap_split_ag(o, A.h, true, B16.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "B dtype differs from the buffer");
  expect(e, nvte_comm_overlap_split_ag(o, A.h, true, Bbig.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "buffer too small");
  expect(e, nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, Dbad.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "D of the wrong shape");
  expect(e, nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, true, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "transb = true with a [n/tp, k] shard (k mismatch)");
  Tensor Bfull(kNVTEBFloat16, {nc * e.wsize, k});
  expect(e, nvte_comm_overlap_split_rs(o, A.h, true, Bfull.h, false, nullptr, nullptr, nullptr, false, ws, false, true, out_bad.h, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "rs_output of the wrong shape");
  expect(e, nvte_comm_overlap_bulk(o, (NVTECommOverlapType)7, A.h, true, Bs.h, false, Dbad.h, nullptr, nullptr, false, ws, false, true,
                                   nullptr, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "comm_type 7");
  // After the bad calls the object still works (no sequence number was consumed).
  NVTECommStatus st = nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s);
  e.rep->check(st == NVTE_COMM_SUCCESS && nvte_comm_overlap_synchronize(o) == NVTE_COMM_SUCCESS, "a good call after the bad ones");
  nvte_comm_overlap_destroy(o);
  expect(e, nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s),
         NVTE_COMM_ERROR_INVALID_ARGUMENT, "destroyed overlap handle");
  expect(e, nvte_comm_overlap_destroy(o), NVTE_COMM_ERROR_INVALID_ARGUMENT, "double destroy");
  MPI_Barrier(MPI_COMM_WORLD);
}

// ---------------------------------------------------------------- a rank that never enters
void test_timeout(Env &e) {
  if (e.wsize < 2) return;
  e.tp = e.wsize;
  Combo c{"timeout", kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false};
  const int64_t timeout_ms = 1000;
  const size_t nc = 128, k = 256, m = 192;
  NVTECommOverlap *o = create(e, c, nc * e.wsize, k, true, timeout_ms);
  if (!o) return;
  Tensor A(kNVTEBFloat16, {m, k}), Bs(kNVTEBFloat16, {nc, k}), D(kNVTEBFloat16, {nc * e.wsize, m}), wsh;
  NVTETensor ws = ws_tensor(e, wsh);
  const int absent = e.wsize - 1;
  if (e.wrank != absent) {
    auto t0 = std::chrono::steady_clock::now();
    NVTECommStatus st = nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s);
    NVTECommStatus sy = nvte_comm_overlap_synchronize(o);
    std::string msg = nvte_comm_last_error();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    CUDA_OK(cudaStreamSynchronize(e.s));
    bool names_peer = msg.find("world rank " + std::to_string(absent)) != std::string::npos;
    char b[128];
    std::snprintf(b, sizeof b, " (after %.0f ms, limit %lld)", ms, (long long)timeout_ms + 1000);
    e.rep->check(st == NVTE_COMM_SUCCESS && sy == NVTE_COMM_ERROR_TIMEOUT && ms <= timeout_ms + 1000 && names_peer,
                 std::string("timeout: rank ") + std::to_string(absent) + " never enters -> " + nvte_comm_status_string(sy) + ": " + msg + b);
    NVTECommStatus again = nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, ws, false, true, nullptr, e.s);
    e.rep->check(again == NVTE_COMM_ERROR_TIMEOUT, "timeout: later calls on the broken object fail fast");
  }
  NVTECommStatus d = nvte_comm_overlap_destroy(o);
  e.rep->check(d == NVTE_COMM_SUCCESS, std::string("timeout: destroy -> ") + nvte_comm_status_string(d));
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
}

void run_all(Env &e) {
  const NVTEDType bf = kNVTEBFloat16, f16 = kNVTEFloat16, e4 = kNVTEFloat8E4M3;
  for (bool ce : {true, false}) {
    // {algo, in, out, buffer}
    std::vector<Combo> ag = {{"split_ag", bf, bf, bf, ce, false}, {"split_ag", f16, f16, f16, ce, false}, {"split_ag", e4, bf, e4, ce, false},
                             {"split_ag", bf, bf, bf, ce, true}, {"split_ag", e4, bf, e4, ce, true}};
    for (auto &c : ag) test_ag(e, c, !c.aggregate, false);
    if (ce) test_ag(e, {"split_ag", bf, bf, bf, ce, false}, false, true);
    // The fused all-gather (config atomic_gemm): our sm90 GEMM on arrival flags, bf16 and
    // e4m3 (bidirectional asked: the fused one gathers one way); with an epilogue our
    // GEMM does not compute, the same ring feeds cuBLASLt per chunk.
    for (const Combo &c : std::vector<Combo>{{"fused_ag", bf, bf, bf, ce, false, true},
                                             {"fused_ag", e4, bf, e4, ce, false, true},
                                             {"fused_ag", e4, bf, e4, ce, true, true}})
      test_ag(e, c, !c.aggregate, false);
    if (ce) test_ag(e, {"fused_ag", bf, bf, bf, ce, false, true}, false, true);
    // The fused ring reduce-scatter (config atomic_gemm): one launch of our GEMM signalling
    // each destination's rows (bf16 partials: bf16 and e4m3 inputs); an FP8 buffer (FP8
    // partials, which our GEMM does not write) runs the GEMMs per destination.
    for (const Combo &c : std::vector<Combo>{{"split_rs_p2p fused", bf, bf, bf, ce, false, true},
                                             {"split_rs_p2p fused", e4, bf, bf, ce, false, true},
                                             {"split_rs_p2p fused", e4, bf, e4, ce, false, true}})
      test_rs(e, c, true);
    for (const char *algo : {"split_rs", "split_rs_p2p"}) {
      bool p2p = std::string(algo) == "split_rs_p2p";
      std::vector<Combo> rs = {{algo, bf, bf, bf, ce, false}, {algo, f16, f16, f16, ce, false}, {algo, e4, bf, e4, ce, false}};
      for (auto &c : rs) test_rs(e, c, p2p);
    }
    // The accumulating ring (NVTE_COMM_RS_RING=accumulate, read at every call): 16-bit
    // buffers, FP8 inputs into a bf16 buffer, and an FP8 buffer (which falls back to the
    // closing reduction).
    setenv("NVTE_COMM_RS_RING", "accumulate", 1);
    for (const Combo &c : std::vector<Combo>{{"split_rs_p2p accumulate", bf, bf, bf, ce, false},
                                             {"split_rs_p2p accumulate", f16, f16, f16, ce, false},
                                             {"split_rs_p2p accumulate", e4, bf, bf, ce, false},
                                             {"split_rs_p2p accumulate", e4, bf, e4, ce, false}})
      test_rs(e, c, true);
    unsetenv("NVTE_COMM_RS_RING");
    for (bool agk : {true, false}) {
      const char *algo = agk ? "bulk_ag" : "bulk_rs";
      std::vector<Combo> bk = {{algo, bf, bf, bf, ce, false}, {algo, f16, f16, f16, ce, false}, {algo, e4, bf, e4, ce, false}};
      for (auto &c : bk) test_bulk(e, c, agk);
    }
  }
}

}  // namespace

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  Report rep;
  Env e{};
  e.rep = &rep;
  MPI_Comm_rank(MPI_COMM_WORLD, &e.wrank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.wsize);
  rep.rank = e.wrank;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
  int ndev;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(e.wrank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&e.s, cudaStreamNonBlocking));
  e.ws = DevBuf(32u << 20);
  e.world_nccl = make_nccl(MPI_COMM_WORLD);
  if (e.wrank == 0) std::printf("test_overlap: %d rank(s), %d calls per combination\n", e.wsize, g_iters);

  // tp = world.
  e.tp = e.wsize;
  e.tp_rank = e.wrank;
  e.tp_nccl = e.world_nccl;
  run_all(e);
  // Two (or more) TP groups of 2 on 4+ GPUs.
  if (e.wsize >= 4 && e.wsize % 2 == 0) {
    MPI_Comm g;
    MPI_Comm_split(MPI_COMM_WORLD, e.wrank / 2, e.wrank, &g);
    e.tp = 2;
    e.tp_rank = e.wrank % 2;
    e.tp_nccl = make_nccl(g);
    int saved = g_iters;
    g_iters = std::min(g_iters, 50);
    Combo groups[] = {{"split_ag", kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false},
                      {"split_rs", kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false},
                      {"split_rs_p2p", kNVTEFloat8E4M3, kNVTEBFloat16, kNVTEFloat8E4M3, false, false},
                      {"bulk_rs", kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, false, false}};
    test_ag(e, groups[0], false, false);
    test_ag(e, {"fused_ag", kNVTEFloat8E4M3, kNVTEBFloat16, kNVTEFloat8E4M3, true, false, true}, false, false);
    test_rs(e, groups[1], false);
    test_rs(e, groups[2], true);
    test_bulk(e, groups[3], false);
    g_iters = saved;
    ncclCommDestroy(e.tp_nccl);
    e.tp_nccl = e.world_nccl;
    MPI_Comm_free(&g);
  }
  // The same algorithms over the NCCL transport (the one used across nodes).
  {
    g_transport = NVTE_COMM_TRANSPORT_NCCL;
    int saved = g_iters;
    g_iters = std::min(g_iters, 50);
    e.tp = e.wsize;
    e.tp_rank = e.wrank;
    e.tp_nccl = e.world_nccl;
    const NVTEDType bf = kNVTEBFloat16, e4 = kNVTEFloat8E4M3;
    test_ag(e, {"split_ag", bf, bf, bf, true, false}, true, false);
    test_ag(e, {"split_ag", e4, bf, e4, true, true}, false, false);
    test_ag(e, {"fused_ag", bf, bf, bf, true, false, true}, true, false);
    test_ag(e, {"fused_ag", e4, bf, e4, true, false, true}, false, false);
    test_rs(e, {"split_rs_p2p fused", bf, bf, bf, true, false, true}, true);
    test_rs(e, {"split_rs_p2p", bf, bf, bf, true, false}, true);
    setenv("NVTE_COMM_RS_RING", "accumulate", 1);
    test_rs(e, {"split_rs_p2p accumulate", bf, bf, bf, true, false}, true);
    unsetenv("NVTE_COMM_RS_RING");
    test_rs(e, {"split_rs", e4, bf, e4, true, false}, false);
    test_bulk(e, {"bulk_ag", bf, bf, bf, true, false}, true);
    test_bulk(e, {"bulk_rs", bf, bf, bf, true, false}, false);
    g_iters = saved;
    g_transport = NVTE_COMM_TRANSPORT_IPC;
  }
  test_errors(e);
  test_timeout(e);
  int rc = rep.finish("test_overlap");
  ncclCommDestroy(e.world_nccl);
  e.ws = DevBuf();
  MPI_Finalize();
  return rc;
}
