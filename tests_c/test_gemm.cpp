// nvte_cublas_gemm against a float64 host reference for every dtype combination x
// layout x epilogue, on random non-square shapes (including sizes that are not
// multiples of 16). Outputs are poisoned (NaN) before each run; every case draws fresh
// random inputs. Cases are spread over the MPI ranks (one GPU each). At one rank, last:
// the same kinds of GEMM before and after a cudaDeviceReset (device_reset_cases).
#include <algorithm>
#include <chrono>
#include <functional>

#include "test_util.hpp"

using namespace tu;

namespace {

enum class Epi { None, Bias, GeluAuxBias, GeluAux, DGelu, DGeluBGrad, BGrad, Accumulate };
const char *epi_name(Epi e) {
  switch (e) {
    case Epi::None: return "none";
    case Epi::Bias: return "bias";
    case Epi::GeluAuxBias: return "bias+gelu_aux";
    case Epi::GeluAux: return "gelu_aux";
    case Epi::DGelu: return "dgelu";
    case Epi::DGeluBGrad: return "dgelu+bgrad";
    case Epi::BGrad: return "bgrad";
    case Epi::Accumulate: return "accumulate";
  }
  return "?";
}

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double dgelu(double x) {
  double t = std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

struct Case {
  NVTEDType a, b, d;
  bool transa, transb;
  Epi epi;
  bool required;  // must succeed; otherwise cuBLASLt may answer "unsupported"
};

double tolerance(const Case &c) {
  if (is_fp8(c.a) || is_fp8(c.d)) return 6e-2;
  if (c.a == kNVTEFloat32 && c.d == kNVTEFloat32) return 1e-5;
  return 1e-2;
}

std::string describe(const Case &c, size_t m, size_t n, size_t k) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "gemm %s x %s -> %s %c%c %-14s m=%zu n=%zu k=%zu", dtype_name(c.a), dtype_name(c.b),
                dtype_name(c.d), c.transa ? 'T' : 'N', c.transb ? 'T' : 'N', epi_name(c.epi), m, n, k);
  return buf;
}

void run_case(const Case &c, uint64_t seed, cudaStream_t stream, DevBuf &workspace, Report &rep,
              const std::string &prefix = "") {
  Rng rng(seed);
  const bool fp8 = is_fp8(c.a);
  const bool gelu_epi = c.epi == Epi::GeluAuxBias || c.epi == Epi::GeluAux || c.epi == Epi::DGelu || c.epi == Epi::DGeluBGrad;
  // Sizes: FP8 needs m, k multiples of 16; GELU epilogues need m multiple of 8; others arbitrary.
  size_t m = fp8 ? 16 * rng.range(2, 16) : gelu_epi ? 8 * rng.range(3, 30) : rng.range(17, 250);
  size_t k = fp8 ? 16 * rng.range(2, 16) : rng.range(9, 250);
  size_t n = rng.range(5, 200);
  std::string what = prefix + describe(c, m, n, k);
  std::string err;

  const float in_scale = 32.0f;  // FP8 inputs: values in [-1, 1] scaled into e4m3/e5m2 range
  std::vector<size_t> ashape = c.transa ? std::vector<size_t>{m, k} : std::vector<size_t>{k, m};
  std::vector<size_t> bshape = c.transb ? std::vector<size_t>{k, n} : std::vector<size_t>{n, k};
  Tensor A = random_tensor(c.a, ashape, rng, -1, 1, in_scale, stream, &err);
  Tensor B = random_tensor(c.b, bshape, rng, -1, 1, in_scale, stream, &err);
  if (!err.empty()) { rep.fail(what + " (input quantize failed: " + err + ")"); return; }
  auto av = A.values(), bv = B.values();

  Tensor D(c.d, {n, m}, is_fp8(c.d));
  const float d_scale = 8.0f;
  if (is_fp8(c.d)) D.set_scale(d_scale);
  std::vector<double> d_old;
  if (c.epi == Epi::Accumulate) {
    Tensor init = random_tensor(c.d, {n, m}, rng, -1, 1, 1.0f, stream, &err);
    CUDA_OK(cudaMemcpy(D.data.p, init.data.p, D.data.bytes, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaStreamSynchronize(0));  // legacy-stream op: let it land
    d_old = init.values();
  } else {
    D.data.poison();
  }
  // FP8 GEMMs: bias / aux typed like a 16-bit output, else bf16 (cuBLASLt's FP8 table).
  const NVTEDType bias_t = !fp8 || c.d == kNVTEFloat16 || c.d == kNVTEBFloat16 ? c.d : kNVTEBFloat16;
  const NVTEDType aux_t = bias_t;
  Tensor bias, aux;
  std::vector<double> biasv, auxv;
  bool has_bias = c.epi == Epi::Bias || c.epi == Epi::GeluAuxBias || c.epi == Epi::DGeluBGrad || c.epi == Epi::BGrad;
  bool has_aux = gelu_epi;
  bool grad = c.epi == Epi::DGelu || c.epi == Epi::DGeluBGrad || c.epi == Epi::BGrad;
  if (has_bias) {
    size_t len = c.epi == Epi::BGrad ? n : m;
    if (grad) { bias = Tensor(bias_t, {len}); bias.data.poison(); }  // output
    else { bias = random_tensor(bias_t, {len}, rng, -1, 1, 1.0f, stream, &err); biasv = bias.values(); }
  }
  if (has_aux) {
    if (grad) { aux = random_tensor(aux_t, {n, m}, rng, -2, 2, 1.0f, stream, &err); auxv = aux.values(); }  // input
    else { aux = Tensor(aux_t, {n, m}); aux.data.poison(); }  // output
  }
  Tensor ws(kNVTEByte, {workspace.bytes});
  {
    NVTEBasicTensor wb = basic(workspace.p, kNVTEByte, {workspace.bytes});
    nvte_set_tensor_param_v2(ws.h, kNVTERowwiseData, &wb, sizeof(wb));
  }

  nvte_cublas_gemm(A.h, B.h, D.h, has_bias ? bias.h : nullptr, has_aux ? aux.h : nullptr, c.transa, c.transb, grad,
                   ws.h, c.epi == Epi::Accumulate, /*use_split_accumulator=*/true, 0, stream);
  NVTECommStatus st = nvte_comm_last_status();
  std::string msg = nvte_comm_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  if (st != NVTE_COMM_SUCCESS) {
    if (!c.required && st == NVTE_COMM_ERROR_UNSUPPORTED) rep.skip(what + " (unsupported by cuBLASLt: " + msg + ")");
    else rep.fail(what + " (status " + nvte_comm_status_string(st) + ": " + msg + ")");
    return;
  }

  // float64 reference.
  auto opA = [&](size_t i, size_t l) { return c.transa ? av[i * k + l] : av[l * m + i]; };
  auto opB = [&](size_t l, size_t j) { return c.transb ? bv[l * n + j] : bv[j * k + l]; };
  std::vector<double> ref(n * m), aux_ref, bias_ref;
  if (c.epi == Epi::GeluAuxBias || c.epi == Epi::GeluAux) aux_ref.resize(n * m);
  for (size_t j = 0; j < n; ++j)
    for (size_t i = 0; i < m; ++i) {
      double acc = 0;
      for (size_t l = 0; l < k; ++l) acc += opA(i, l) * opB(l, j);
      double &r = ref[j * m + i];
      switch (c.epi) {
        case Epi::None: case Epi::BGrad: r = acc; break;
        case Epi::Bias: r = acc + biasv[i]; break;
        case Epi::GeluAuxBias: aux_ref[j * m + i] = acc + biasv[i]; r = gelu(acc + biasv[i]); break;
        case Epi::GeluAux: aux_ref[j * m + i] = acc; r = gelu(acc); break;
        case Epi::DGelu: case Epi::DGeluBGrad: r = acc * dgelu(auxv[j * m + i]); break;
        case Epi::Accumulate: r = acc + d_old[j * m + i]; break;
      }
    }
  if (c.epi == Epi::BGrad) {
    bias_ref.assign(n, 0.0);
    for (size_t j = 0; j < n; ++j)
      for (size_t l = 0; l < k; ++l) bias_ref[j] += opB(l, j);
  }
  if (c.epi == Epi::DGeluBGrad) {
    bias_ref.assign(m, 0.0);
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < m; ++i) bias_ref[i] += ref[j * m + i];
  }

  const double tol = tolerance(c);
  std::vector<double> out = decode(D.data.download(), c.d, n * m);
  if (is_fp8(c.d))
    for (auto &x : out) x /= d_scale;
  double e = rel_err(out, ref);
  bool ok = e < tol;
  char buf[160];
  std::snprintf(buf, sizeof buf, " rel_err(D)=%.3g", e);
  std::string detail = buf;
  if (!aux_ref.empty()) {
    double ea = rel_err(decode(aux.data.download(), aux_t, n * m), aux_ref);
    ok = ok && ea < tol;
    std::snprintf(buf, sizeof buf, " rel_err(pre_gelu_out)=%.3g", ea);
    detail += buf;
  }
  if (!bias_ref.empty()) {
    double eb = rel_err(decode(bias.data.download(), bias_t, bias_ref.size()), bias_ref);
    ok = ok && eb < tol;
    std::snprintf(buf, sizeof buf, " rel_err(bias_grad)=%.3g", eb);
    detail += buf;
  }
  if (is_fp8(c.d)) {  // amax(D) is the max |D| before scaling
    double amax_ref = 0;
    for (double x : ref) amax_ref = std::max(amax_ref, std::fabs(x));
    double amax = D.get_f32(D.amax);
    bool aok = std::fabs(amax - amax_ref) <= 1e-2 * amax_ref;
    ok = ok && aok;
    std::snprintf(buf, sizeof buf, " amax(D)=%.5g ref=%.5g", amax, amax_ref);
    detail += buf;
  }
  std::snprintf(buf, sizeof buf, " tol=%.0e", tol);
  rep.check(ok, what + detail + buf);
}

std::vector<Case> all_cases() {
  std::vector<Case> cs;
  struct L { bool ta, tb; };
  const L layouts[] = {{false, false}, {false, true}, {true, false}};  // NN, NT, TN
  // Non-FP8: inputs equal; output the input type or float32.
  const NVTEDType pairs[][2] = {{kNVTEFloat32, kNVTEFloat32}, {kNVTEFloat16, kNVTEFloat16}, {kNVTEFloat16, kNVTEFloat32},
                                {kNVTEBFloat16, kNVTEBFloat16}, {kNVTEBFloat16, kNVTEFloat32}};
  const Epi epis[] = {Epi::None, Epi::Bias, Epi::GeluAuxBias, Epi::GeluAux, Epi::DGelu, Epi::DGeluBGrad, Epi::BGrad, Epi::Accumulate};
  for (auto &p : pairs)
    for (auto &l : layouts)
      for (Epi e : epis) {
        // Required: plain, bias and accumulate everywhere, and the epilogues in the
        // layouts TE uses them (fprop TN: bias+GELU; dgrad NN: DGELU(+bgrad); wgrad NT: bgrad)
        // for the 16-bit types.
        bool sixteen = p[0] != kNVTEFloat32 && p[1] == p[0];
        bool req = e == Epi::None || e == Epi::Bias || e == Epi::Accumulate ||
                   (sixteen && l.ta && !l.tb && (e == Epi::GeluAuxBias || e == Epi::GeluAux)) ||
                   (sixteen && !l.ta && !l.tb && (e == Epi::DGelu || e == Epi::DGeluBGrad)) ||
                   (sixteen && !l.ta && l.tb && e == Epi::BGrad);
        cs.push_back({p[0], p[0], p[1], l.ta, l.tb, e, req});
      }
  // FP8: TN only.
  const NVTEDType f8in[][2] = {{kNVTEFloat8E4M3, kNVTEFloat8E4M3}, {kNVTEFloat8E4M3, kNVTEFloat8E5M2}, {kNVTEFloat8E5M2, kNVTEFloat8E4M3}};
  const NVTEDType f8out[] = {kNVTEFloat32, kNVTEFloat16, kNVTEBFloat16, kNVTEFloat8E4M3, kNVTEFloat8E5M2};
  const Epi f8epis[] = {Epi::None, Epi::Bias, Epi::GeluAuxBias, Epi::Accumulate};
  for (auto &p : f8in)
    for (NVTEDType d : f8out)
      for (Epi e : f8epis) {
        if (is_fp8(d) && e == Epi::Accumulate) continue;  // rejected by design: tested in the error cases
        bool sixteen = d == kNVTEBFloat16 || d == kNVTEFloat16;
        bool req = ((sixteen || d == kNVTEFloat32) && (e == Epi::None || e == Epi::Accumulate)) ||
                   (sixteen && e == Epi::Bias) || (d == kNVTEBFloat16 && e == Epi::GeluAuxBias);
        req = req || (d == kNVTEFloat8E4M3 && p[0] == kNVTEFloat8E4M3 && p[1] == kNVTEFloat8E4M3 && e == Epi::None);
        cs.push_back({p[0], p[1], d, true, false, e, req});
      }
  return cs;
}

// Errors detected on a GPU machine: each must be recorded with the right status.
void error_cases(cudaStream_t stream, Report &rep) {
  auto expect = [&](NVTECommStatus want, const char *what) {
    NVTECommStatus st = nvte_comm_last_status();
    std::string msg = nvte_comm_last_error();
    rep.check(st == want && !msg.empty(), std::string("error: ") + what + " -> " + nvte_comm_status_string(st) + ": " + msg);
  };
  Tensor a8(kNVTEFloat8E4M3, {64, 64}), b8(kNVTEFloat8E4M3, {64, 64}), d(kNVTEBFloat16, {64, 64});
  nvte_cublas_gemm(a8.h, b8.h, d.h, nullptr, nullptr, false, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "fp8 NN layout");
  nvte_cublas_gemm(a8.h, b8.h, d.h, nullptr, nullptr, false, true, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "fp8 NT layout");
  Tensor d8(kNVTEFloat8E4M3, {64, 64});
  nvte_cublas_gemm(a8.h, b8.h, d8.h, nullptr, nullptr, true, false, false, nullptr, true, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "fp8 output with accumulate");
  Tensor a5(kNVTEFloat8E5M2, {64, 64}), b5(kNVTEFloat8E5M2, {64, 64});
  nvte_cublas_gemm(a5.h, b5.h, d.h, nullptr, nullptr, true, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "e5m2 x e5m2");
  Tensor a8u(kNVTEFloat8E4M3, {40, 40}), b8u(kNVTEFloat8E4M3, {40, 40}), d8u(kNVTEBFloat16, {40, 40});
  nvte_cublas_gemm(a8u.h, b8u.h, d8u.h, nullptr, nullptr, true, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "fp8 with k not a multiple of 16");
  Tensor ab(kNVTEBFloat16, {64, 64}), bb(kNVTEBFloat16, {64, 64}), aux(kNVTEBFloat16, {64, 60}), d60(kNVTEBFloat16, {64, 60});
  Tensor a60(kNVTEBFloat16, {60, 64});
  nvte_cublas_gemm(a60.h, bb.h, d60.h, nullptr, aux.h, true, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "GELU aux with m not a multiple of 8");
  Tensor a16(kNVTEFloat16, {64, 64});
  nvte_cublas_gemm(a16.h, bb.h, d.h, nullptr, nullptr, true, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_UNSUPPORTED, "mixed f16 x bf16 inputs");
  Tensor f8noscale(kNVTEFloat8E4M3, {64, 64}, false);
  {  // an FP8 tensor without scale_inv
    NVTETensor h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
    NVTEBasicTensor b = basic(f8noscale.data.p, kNVTEFloat8E4M3, {64, 64});
    nvte_set_tensor_param_v2(h, kNVTERowwiseData, &b, sizeof b);
    nvte_cublas_gemm(h, b8.h, d.h, nullptr, nullptr, true, false, false, nullptr, false, false, 0, stream);
    expect(NVTE_COMM_ERROR_INVALID_ARGUMENT, "fp8 input without scale_inv");
    nvte_destroy_tensor(h);
  }
  Tensor biasbad(kNVTEBFloat16, {63});
  nvte_cublas_gemm(ab.h, bb.h, d.h, biasbad.h, nullptr, true, false, false, nullptr, false, false, 0, stream);
  expect(NVTE_COMM_ERROR_INVALID_ARGUMENT, "bias of the wrong length");
  // A kernel-side error: quantize to FP8 with no scale.
  Tensor src(kNVTEFloat32, {64});
  NVTETensor q = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor qb = basic(a8.data.p, kNVTEFloat8E4M3, {64});
  nvte_set_tensor_param_v2(q, kNVTERowwiseData, &qb, sizeof qb);
  nvte_quantize(src.h, q, stream);
  expect(NVTE_COMM_ERROR_INVALID_ARGUMENT, "quantize to fp8 without scale");
  nvte_destroy_tensor(q);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// quantize / dequantize / fill against host arithmetic.
void kernel_cases(cudaStream_t stream, Report &rep, uint64_t seed) {
  Rng rng(seed);
  const size_t n = 100003;  // not a multiple of the block size
  std::vector<float> h(n);
  for (auto &x : h) x = (float)rng.uniform(-3, 3);
  h[17] = 1000.0f;  // saturates e4m3 (max 448) at scale 1
  Tensor src(kNVTEFloat32, {n});
  src.data.upload(h.data());
  double amax_ref = 0;
  for (float x : h) amax_ref = std::max(amax_ref, (double)std::fabs(x));
  struct Q { NVTEDType t; double rel; double maxv; double floor; };
  // rel: half an ulp; floor: half the smallest subnormal.
  const Q qs[] = {{kNVTEBFloat16, 1.0 / 256, 3e38, 1e-38}, {kNVTEFloat16, 1.0 / 2048, 65504, 3e-8},
                  {kNVTEFloat8E4M3, 1.0 / 16, 448, 1.0 / 1024}, {kNVTEFloat8E5M2, 1.0 / 8, 57344, 1.0 / 131072}};
  for (auto &q : qs) {
    Tensor dst(q.t, {n}, true);
    const float scale = is_fp8(q.t) ? 2.0f : 1.0f;
    dst.set_scale(scale);
    CUDA_OK(cudaMemset(dst.amax.p, 0, 4));
    CUDA_OK(cudaMemset(dst.scale_inv.p, 0, 4));
    CUDA_OK(cudaStreamSynchronize(0));  // legacy-stream op: let it land
    dst.data.poison();
    nvte_quantize(src.h, dst.h, stream);
    bool ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
    std::string msg = nvte_comm_last_error();
    CUDA_OK(cudaStreamSynchronize(stream));
    auto v = decode(dst.data.download(), q.t, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      double want = (double)h[i] * scale;
      double clipped = std::max(-q.maxv, std::min(q.maxv, want));
      // nearest representable: relative error within half an ulp (plus the subnormal floor)
      if (!(std::fabs(v[i] - clipped) <= q.rel * std::fabs(clipped) + q.floor)) ++bad;
    }
    float amax = dst.get_f32(dst.amax), sinv = dst.get_f32(dst.scale_inv);
    ok = ok && bad == 0 && amax == (float)amax_ref && sinv == 1.0f / scale;
    char buf[200];
    std::snprintf(buf, sizeof buf, "quantize f32 -> %s n=%zu: %zu bad elements, amax=%g (ref %g), scale_inv=%g %s", dtype_name(q.t), n, bad,
                  amax, amax_ref, sinv, msg.c_str());
    rep.check(ok, buf);
    if (is_fp8(q.t)) {  // dequantize back: exactly decoded * scale_inv
      Tensor back(kNVTEFloat32, {n});
      back.data.poison();
      nvte_dequantize(dst.h, back.h, stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      auto bv = decode(back.data.download(), kNVTEFloat32, n);
      size_t bad2 = 0;
      for (size_t i = 0; i < n; ++i)
        if (bv[i] != (double)(float)(v[i] * (1.0 / scale))) ++bad2;
      std::snprintf(buf, sizeof buf, "dequantize %s -> f32 n=%zu: %zu mismatches", dtype_name(q.t), n, bad2);
      rep.check(bad2 == 0 && nvte_comm_last_status() == NVTE_COMM_SUCCESS, buf);
    }
  }
  // fill_uniform: range, mean, determinism, seed sensitivity.
  for (NVTEDType t : {kNVTEFloat32, kNVTEBFloat16, kNVTEFloat16, kNVTEFloat8E4M3}) {
    Tensor x(t, {n}), y(t, {n}), z(t, {n});
    x.data.poison(); y.data.poison(); z.data.poison();
    NVTECommStatus s1 = nvte_comm_fill_uniform(x.h, seed, -2.0f, 3.0f, stream);
    NVTECommStatus s2 = nvte_comm_fill_uniform(y.h, seed, -2.0f, 3.0f, stream);
    NVTECommStatus s3 = nvte_comm_fill_uniform(z.h, seed + 1, -2.0f, 3.0f, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    auto xv = decode(x.data.download(), t, n), zv = decode(z.data.download(), t, n);
    bool same = x.data.download() == y.data.download();
    size_t differ = 0, out = 0;
    double mean = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!(xv[i] >= -2.0 && xv[i] <= 3.0)) ++out;
      if (xv[i] != zv[i]) ++differ;
      mean += xv[i] / n;
    }
    bool ok = s1 == NVTE_COMM_SUCCESS && s2 == NVTE_COMM_SUCCESS && s3 == NVTE_COMM_SUCCESS && same && out == 0 &&
              differ > n / 2 && std::fabs(mean - 0.5) < 0.05;
    char buf[200];
    std::snprintf(buf, sizeof buf, "fill_uniform %s: out_of_range=%zu deterministic=%d differ_by_seed=%zu mean=%.4f", dtype_name(t), out,
                  (int)same, differ, mean);
    rep.check(ok, buf);
  }
}

}  // namespace

// A device reset between uses of the library (cudaDeviceReset: the primary context is
// destroyed, and the next use makes a new one, possibly at the same address): the
// library's per-context caches (kernel modules, cuBLASLt handles and plans, our own GEMM)
// must serve the new context its own, not the old one's handles. The same cases before
// and after the reset, each against the float64 reference: bf16 TN (our own GEMM at
// these sizes), bf16 TN with bias (cuBLASLt), e4m3 TN (the inputs quantized by the
// library's cast kernels). Runs last, on one rank: it ends every CUDA object of the
// process.
void device_reset_cases(Report &rep, uint64_t seed, int device) {
  const Case cases[] = {{kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false, Epi::None, true},
                        {kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false, Epi::Bias, true},
                        {kNVTEFloat8E4M3, kNVTEFloat8E4M3, kNVTEBFloat16, true, false, Epi::None, true}};
  for (bool after : {false, true}) {
    const char *when = after ? "after a device reset: " : "before a device reset: ";
    if (after) {
      CUDA_OK(cudaDeviceReset());
      CUDA_OK(cudaSetDevice(device));
    }
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      DevBuf ws(32u << 20);
      for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) run_case(cases[i], seed + i, s, ws, rep, when);
    }
    CUDA_OK(cudaStreamDestroy(s));
  }
}

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  Report rep;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rep.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(rep.rank % ndev));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // A fresh base seed per run (printed, so a failure can be replayed with --seed).
  uint64_t base = (uint64_t)std::chrono::high_resolution_clock::now().time_since_epoch().count();
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--seed") == 0) base = std::strtoull(argv[i + 1], nullptr, 10);
  MPI_Bcast(&base, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rep.rank == 0) std::printf("test_gemm: %d rank(s), seed %llu\n", size, (unsigned long long)base);

  if (nvte_comm_check_runtime() != NVTE_COMM_SUCCESS) {
    rep.fail(std::string("nvte_comm_check_runtime: ") + nvte_comm_last_error());
    return rep.finish("test_gemm");
  }
  {
    DevBuf workspace(32u << 20);
    auto cases = all_cases();
    for (size_t i = 0; i < cases.size(); ++i)
      if ((int)(i % size) == rep.rank) run_case(cases[i], base + i, stream, workspace, rep);
    if (rep.rank == 0) {
      error_cases(stream, rep);
    }
    if (rep.rank == size - 1) kernel_cases(stream, rep, base);
  }
  CUDA_OK(cudaStreamDestroy(stream));
  if (size == 1) device_reset_cases(rep, base + 7919, rep.rank % ndev);
  int rc = rep.finish("test_gemm");
  MPI_Finalize();
  return rc;
}
