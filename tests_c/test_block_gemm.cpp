// Block-scaled FP8 GEMM (TE's Float8BlockScaling: NVTE_BLOCK_SCALING_1D, one scale per
// 1x128 values; NVTE_BLOCK_SCALING_2D, one per 128x128 tile) through nvte_cublas_gemm,
// nvte_cublas_gemm_scaled and nvte_cublas_gemm_v2, against a float64 reference on the
// dequantized inputs. The operands are quantized on the host (e4m3, power-of-2 scales,
// TE's GEMM-ready scale layout: 1D [ceil(cols/128), pad4(rows)] transposed, 2D
// [ceil(rows/128), pad4(ceil(cols/128))]; columnwise data transposed), so the test
// checks the GEMM alone. Every combination TE takes (1D x 1D, 1D x 2D, 2D x 1D) x every
// layout (the data each reads: rowwise or columnwise by transa / transb) x output type,
// with bias / DGELU epilogues and alpha / beta; shapes with partial blocks and an
// anchor-sized one (sampled outputs). Then the refusals, each with D poisoned and
// checked untouched. The block-scaled cases run once per backend of
// NVTE_COMM_BLOCK_GEMM: cuBLASLt's block scale modes and our sm90 kernel's _block
// variants (`own`: those take every case they compute, cuBLASLt the rest), or only under
// the backend the environment names. `--bench`: block-scaled GEMMs on our kernel and on
// cuBLASLt (2D x 1D, a linear layer's forward, and 1D x 1D) vs per-tensor FP8 vs bf16 on
// the anchor shapes (CUDA events, warm-up, 5 interleaved rounds of 4 runs, median),
// TFLOP/s and ratios, and our kernel's output against cuBLASLt's.
#include <chrono>
#include <cstring>

#include "test_util.hpp"

using namespace tu;

namespace {

constexpr size_t kBlock = 128;
size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
size_t pad4(size_t a) { return ceil_div(a, 4) * 4; }

// float -> e4m3, round to nearest even, saturating at 448 (TE's quantization).
uint8_t encode_e4m3(float v) {
  uint8_t s = std::signbit(v) ? 0x80 : 0;
  float a = std::fabs(v);
  if (std::isnan(a)) return 0x7F;
  if (a >= 448.0f) return s | 0x7E;
  if (a < 0.015625f) return s | (uint8_t)std::nearbyint(a * 512.0f);  // subnormals: 2^-9 steps
  int e;
  float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  int q = (int)std::nearbyint((2.0f * f - 1.0f) * 8.0f), E = e + 6;
  if (q == 8) { q = 0; ++E; }
  if (E > 15 || (E == 15 && q == 7)) return s | 0x7E;
  return s | (uint8_t)(E << 3) | (uint8_t)q;
}

// Quantize row-major x [R, C] with blocks along rows (1x128, or 128x128 tiles when
// two_d) into e4m3 `q` and float32 scale inverses `s` in the GEMM-ready layout; `deq`
// the values the GEMM sees (q times its scale inverse).
void quantize_blocks(const std::vector<float> &x, size_t R, size_t C, bool two_d, std::vector<uint8_t> &q,
                     std::vector<float> &s, std::vector<size_t> &s_shape, std::vector<double> &deq) {
  const size_t nb = ceil_div(C, kBlock);
  const size_t nr = two_d ? ceil_div(R, kBlock) : R;  // row groups sharing a scale
  s_shape = two_d ? std::vector<size_t>{nr, pad4(nb)} : std::vector<size_t>{nb, pad4(R)};
  s.assign(s_shape[0] * s_shape[1], 0.0f);
  q.resize(R * C);
  deq.resize(R * C);
  const size_t rows_per = two_d ? kBlock : 1;
  for (size_t g = 0; g < nr; ++g)
    for (size_t j = 0; j < nb; ++j) {
      size_t r0 = g * rows_per, r1 = std::min(R, r0 + rows_per), c0 = j * kBlock, c1 = std::min(C, c0 + kBlock);
      float amax = 0;
      for (size_t r = r0; r < r1; ++r)
        for (size_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * C + c]));
      // Power-of-2 scale (TE's default for block scaling): the largest 2^e with amax 2^e <= 448.
      float scale = amax > 0 ? std::exp2(std::floor(std::log2(448.0f / amax))) : 1.0f;
      float inv = 1.0f / scale;
      s[two_d ? g * s_shape[1] + j : j * s_shape[1] + g] = inv;
      for (size_t r = r0; r < r1; ++r)
        for (size_t c = c0; c < c1; ++c) {
          uint8_t b = encode_e4m3(x[r * C + c] * scale);
          q[r * C + c] = b;
          deq[r * C + c] = decode_e4m3(b) * (double)inv;
        }
    }
}

enum Mode { k1D = NVTE_BLOCK_SCALING_1D, k2D = NVTE_BLOCK_SCALING_2D };
const char *mode_name(Mode m) { return m == k1D ? "1D" : "2D"; }

// A block-scaled tensor of logical shape [R, C]: rowwise data [R, C] and / or columnwise
// data [C, R] (the transpose), each with its scales; the dequantized values of each
// direction over the logical [R, C].
struct BlockTensor {
  NVTETensor h = nullptr;
  DevBuf data, sinv, cdata, csinv;
  std::vector<double> deq_row, deq_col;
  size_t R = 0, C = 0;
  BlockTensor() = default;
  BlockTensor(const BlockTensor &) = delete;
  ~BlockTensor() { if (h) nvte_destroy_tensor(h); }
};

void set_param(NVTETensor h, NVTETensorParam p, void *ptr, NVTEDType t, std::vector<size_t> shape) {
  NVTEBasicTensor b = basic(ptr, t, shape);
  nvte_set_tensor_param_v2(h, p, &b, sizeof(b));
}

// Values with a different magnitude per row and per 128-column block, so that every
// block has its own scale and a misread scale layout shows.
std::vector<float> varied(size_t R, size_t C, Rng &rng) {
  std::vector<float> x(R * C);
  std::vector<float> row(R), col(ceil_div(C, kBlock));
  for (auto &v : row) v = std::exp2((float)rng.range(-3, 3));
  for (auto &v : col) v = std::exp2((float)rng.range(-2, 2));
  for (size_t r = 0; r < R; ++r)
    for (size_t c = 0; c < C; ++c) x[r * C + c] = (float)rng.uniform(-1, 1) * row[r] * col[c / kBlock];
  return x;
}

void make_block(BlockTensor &t, Mode mode, size_t R, size_t C, bool rowwise, bool colwise, Rng &rng) {
  t.R = R;
  t.C = C;
  std::vector<float> x = varied(R, C, rng);
  t.h = nvte_create_tensor((NVTEScalingMode)mode);
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<size_t> ss;
  if (rowwise) {
    quantize_blocks(x, R, C, mode == k2D, q, s, ss, t.deq_row);
    t.data = DevBuf(q.size());
    t.data.upload(q.data());
    t.sinv = DevBuf(s.size() * 4);
    t.sinv.upload(s.data());
    set_param(t.h, kNVTERowwiseData, t.data.p, kNVTEFloat8E4M3, {R, C});
    set_param(t.h, kNVTERowwiseScaleInv, t.sinv.p, kNVTEFloat32, ss);
  }
  if (colwise) {
    std::vector<float> xt(R * C);
    for (size_t r = 0; r < R; ++r)
      for (size_t c = 0; c < C; ++c) xt[c * R + r] = x[r * C + c];
    std::vector<double> deq_t;
    quantize_blocks(xt, C, R, mode == k2D, q, s, ss, deq_t);
    t.deq_col.resize(R * C);
    for (size_t r = 0; r < R; ++r)
      for (size_t c = 0; c < C; ++c) t.deq_col[r * C + c] = deq_t[c * R + r];
    t.cdata = DevBuf(q.size());
    t.cdata.upload(q.data());
    t.csinv = DevBuf(s.size() * 4);
    t.csinv.upload(s.data());
    set_param(t.h, kNVTEColumnwiseData, t.cdata.p, kNVTEFloat8E4M3, {C, R});
    set_param(t.h, kNVTEColumnwiseScaleInv, t.csinv.p, kNVTEFloat32, ss);
  }
}

// make_block with the operand quantized on the GPU by nvte_quantize (the library's block
// quantization, GEMM_READY, TE's default non-power-of-2 scales) from the same kind of
// values; the dequantized values are read back from its data and scales (the GEMM-ready
// layout), so the GEMM is checked on what the quantizer wrote. Rows and columns must be
// multiples of 128 (TE's quantizable shapes).
void make_block_gpu(BlockTensor &t, Mode mode, size_t R, size_t C, bool rowwise, bool colwise, Rng &rng,
                    cudaStream_t stream, std::string *err) {
  t.R = R;
  t.C = C;
  std::vector<float> x = varied(R, C, rng);
  Tensor src(kNVTEFloat32, {R, C});
  src.data.upload(x.data());
  t.h = nvte_create_tensor((NVTEScalingMode)mode);
  const bool two_d = mode == k2D;
  auto scale_shape = [&](size_t rows, size_t cols) {
    return two_d ? std::vector<size_t>{ceil_div(rows, kBlock), pad4(ceil_div(cols, kBlock))}
                 : std::vector<size_t>{ceil_div(cols, kBlock), pad4(rows)};
  };
  std::vector<size_t> rs = scale_shape(R, C), cs = scale_shape(C, R);
  if (rowwise) {
    t.data = DevBuf(R * C);
    t.sinv = DevBuf(rs[0] * rs[1] * 4);
    set_param(t.h, kNVTERowwiseData, t.data.p, kNVTEFloat8E4M3, {R, C});
    set_param(t.h, kNVTERowwiseScaleInv, t.sinv.p, kNVTEFloat32, rs);
  }
  if (colwise) {
    t.cdata = DevBuf(R * C);
    t.csinv = DevBuf(cs[0] * cs[1] * 4);
    set_param(t.h, kNVTEColumnwiseData, t.cdata.p, kNVTEFloat8E4M3, {C, R});
    set_param(t.h, kNVTEColumnwiseScaleInv, t.csinv.p, kNVTEFloat32, cs);
  }
  nvte_quantize(src.h, t.h, stream);
  if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) { *err = nvte_comm_last_error(); return; }
  CUDA_OK(cudaStreamSynchronize(stream));
  // Dequantize a buffer [rows, cols] (blocks along rows) with scales s_shape.
  auto deq = [&](const DevBuf &q, const DevBuf &s, size_t rows, size_t cols, const std::vector<size_t> &ss) {
    auto qb = q.download();
    auto sb = s.download();
    std::vector<float> sv(sb.size() / 4);
    std::memcpy(sv.data(), sb.data(), sb.size());
    std::vector<double> out(rows * cols);
    for (size_t r = 0; r < rows; ++r)
      for (size_t c = 0; c < cols; ++c) {
        size_t si = two_d ? (r / kBlock) * ss[1] + c / kBlock : (c / kBlock) * ss[1] + r;
        out[r * cols + c] = decode_e4m3(qb[r * cols + c]) * (double)sv[si];
      }
    return out;
  };
  if (rowwise) t.deq_row = deq(t.data, t.sinv, R, C, rs);
  if (colwise) {
    auto dt = deq(t.cdata, t.csinv, C, R, cs);
    t.deq_col.resize(R * C);
    for (size_t r = 0; r < R; ++r)
      for (size_t c = 0; c < C; ++c) t.deq_col[r * C + c] = dt[c * R + r];
  }
}

// D [n, m] before the GEMM: random values (returned) where beta != 0 reads them, else
// poisoned (NaN: every element must be written).
std::vector<double> init_d(Tensor &D, float beta, Rng &rng, cudaStream_t stream, std::string *err) {
  if (beta == 0) {
    D.data.poison();
    return {};
  }
  Tensor init = random_tensor(D.dtype, D.shape, rng, -1, 1, 1.0f, stream, err);
  CUDA_OK(cudaMemcpy(D.data.p, init.data.p, D.data.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaStreamSynchronize(0));
  return init.values();
}

enum class Entry { Gemm, Scaled, V2 };
const char *entry_name(Entry e) { return e == Entry::Gemm ? "nvte_cublas_gemm" : e == Entry::Scaled ? "nvte_cublas_gemm_scaled" : "nvte_cublas_gemm_v2"; }
enum class Epi { None, Bias, DGelu };
const char *epi_name(Epi e) { return e == Epi::None ? "none" : e == Epi::Bias ? "bias" : "dgelu"; }

double dgelu(double x) {
  double t = std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

struct Case {
  Mode a, b;
  bool transa, transb;
  NVTEDType d;
  Entry entry;
  Epi epi;
  float alpha, beta;
  size_t m, n, k;
  size_t samples;  // 0: check every output; else this many random ones
  bool gpu_quant = false;  // operands quantized by nvte_quantize instead of on the host
};

// The NVTE_COMM_BLOCK_GEMM backend the cases run under (set by main).
std::string g_backend = "cublaslt";

std::string describe(const Case &c) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "[%s] %s %s x %s %c%c -> %s epi=%s alpha=%g beta=%g m=%zu n=%zu k=%zu%s",
                g_backend.c_str(), entry_name(c.entry), mode_name(c.a), mode_name(c.b), c.transa ? 'T' : 'N', c.transb ? 'T' : 'N', dtype_name(c.d),
                epi_name(c.epi), c.alpha, c.beta, c.m, c.n, c.k, c.gpu_quant ? " (nvte_quantize operands)" : "");
  return buf;
}

// Norm-wise relative error bounds. The inputs are exact in both computations; what
// remains is the output's rounding (16-bit outputs: 1e-2, as TE's GEMM tests) and, for
// a float32 output, the accumulation: Hopper's FP8 tensor cores add a 128-value block's
// products at reduced precision before cuBLASLt applies that block's scales and promotes
// the partial sum into float32 (TE's block-scaled GEMM test emulates exactly that
// instead of comparing with float64); measured 1.0e-4 .. 2.7e-4 on an H200, so 1e-3.
double tolerance(NVTEDType d) { return d == kNVTEFloat32 ? 1e-3 : 1e-2; }

NVTETensor workspace_tensor(DevBuf &ws, Tensor &holder) {
  holder = Tensor(kNVTEByte, {1});
  set_param(holder.h, kNVTERowwiseData, ws.p, kNVTEByte, {ws.bytes});
  return holder.h;
}

// Run case c's entry point; "" or the recorded error.
std::string launch(const Case &c, NVTETensor A, NVTETensor B, NVTETensor D, NVTETensor bias, NVTETensor aux,
                   NVTETensor ws, cudaStream_t stream) {
  const bool grad = c.epi == Epi::DGelu;
  switch (c.entry) {
    case Entry::Gemm:
      nvte_cublas_gemm(A, B, D, bias, aux, c.transa, c.transb, grad, ws, c.beta != 0, true, 0, stream);
      break;
    case Entry::Scaled:
      nvte_cublas_gemm_scaled(A, B, D, bias, aux, c.transa, c.transb, grad, ws, c.alpha, c.beta, true, 0, stream);
      break;
    case Entry::V2: {
      NVTEMatmulConfig cfg = nvte_create_matmul_config();
      uint8_t yes = 1;
      if (c.epi == Epi::Bias) nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigBiasTensor, &bias, sizeof bias);
      if (c.epi == Epi::DGelu) {
        nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigWithDGELUEpilogue, &yes, 1);
        nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigEpilogueAuxTensor, &aux, sizeof aux);
      }
      nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigUseSplitAccumulator, &yes, 1);
      nvte_cublas_gemm_v2(c.transa, c.transb, &c.alpha, A, B, &c.beta, D, D, ws, cfg, stream);
      std::string msg = nvte_comm_last_error();
      nvte_destroy_matmul_config(cfg);
      return msg;
    }
  }
  return nvte_comm_last_error();
}

void run_case(const Case &c, uint64_t seed, cudaStream_t stream, DevBuf &workspace, Report &rep) {
  Rng rng(seed);
  const size_t m = c.m, n = c.n, k = c.k;
  const std::string what = describe(c);
  // A: logical [m, k] with transa (its rowwise data is read), [k, m] without (columnwise).
  BlockTensor A, B;
  std::string err;
  if (c.gpu_quant) {
    // Both directions, as a training step quantizes them; the GEMM picks one.
    if (c.transa) make_block_gpu(A, c.a, m, k, true, true, rng, stream, &err);
    else make_block_gpu(A, c.a, k, m, true, true, rng, stream, &err);
    if (c.transb) make_block_gpu(B, c.b, k, n, true, true, rng, stream, &err);
    else make_block_gpu(B, c.b, n, k, true, true, rng, stream, &err);
    if (!err.empty()) { rep.fail(what + " (nvte_quantize: " + err + ")"); return; }
  } else {
    if (c.transa) make_block(A, c.a, m, k, true, false, rng);
    else make_block(A, c.a, k, m, false, true, rng);
    if (c.transb) make_block(B, c.b, k, n, false, true, rng);
    else make_block(B, c.b, n, k, true, false, rng);
  }
  const auto &av = c.transa ? A.deq_row : A.deq_col;
  const auto &bv = c.transb ? B.deq_col : B.deq_row;

  Tensor D(c.d, {n, m});
  const std::vector<double> d_old = init_d(D, c.beta, rng, stream, &err);
  const NVTEDType side_t = c.d == kNVTEFloat16 ? kNVTEFloat16 : kNVTEBFloat16;  // cuBLASLt's FP8 table
  Tensor bias, aux;
  std::vector<double> biasv, auxv;
  if (c.epi == Epi::Bias) { bias = random_tensor(side_t, {m}, rng, -1, 1, 1.0f, stream, &err); biasv = bias.values(); }
  if (c.epi == Epi::DGelu) { aux = random_tensor(side_t, {n, m}, rng, -2, 2, 1.0f, stream, &err); auxv = aux.values(); }
  if (!err.empty()) { rep.fail(what + " (input setup: " + err + ")"); return; }
  Tensor wsh;
  NVTETensor ws = workspace_tensor(workspace, wsh);

  std::string msg = launch(c, A.h, B.h, D.h, bias.h, aux.h, ws, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  if (!msg.empty()) { rep.fail(what + " (" + msg + ")"); return; }

  // Reference on every output, or on `samples` random ones.
  std::vector<size_t> idx;
  if (c.samples == 0) { idx.resize(n * m); for (size_t i = 0; i < idx.size(); ++i) idx[i] = i; }
  else for (size_t s = 0; s < c.samples; ++s) idx.push_back((size_t)(rng.next() % (n * m)));
  auto got_all = D.values();
  std::vector<double> got, ref;
  for (size_t id : idx) {
    size_t j = id / m, i = id % m;
    double acc = 0;
    for (size_t l = 0; l < k; ++l) {
      double a = c.transa ? av[i * k + l] : av[l * m + i];
      double b = c.transb ? bv[l * n + j] : bv[j * k + l];
      acc += a * b;
    }
    double r = c.alpha * acc;
    if (c.epi == Epi::Bias) r += biasv[i];
    if (c.epi == Epi::DGelu) r *= dgelu(auxv[id]);
    if (c.beta != 0) r += c.beta * d_old[id];
    ref.push_back(r);
    got.push_back(got_all[id]);
  }
  double e = rel_err(got, ref);
  char buf[96];
  std::snprintf(buf, sizeof buf, " rel_err %.2e (tol %.0e%s)", e, tolerance(c.d), c.samples ? ", sampled" : "");
  rep.check(e < tolerance(c.d), what + buf);
}

// nvte_cublas_gemm_scaled and nvte_cublas_gemm_v2 on the inputs nvte_cublas_gemm took
// before block scaling (fp32 / fp16 / bf16, per-tensor FP8), with alpha / beta and the
// config's epilogues (v2: bias, GELU with its aux output).
struct PlainCase {
  NVTEDType in, d;
  Entry entry;
  bool bias, gelu;
  float alpha, beta;
};

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

void run_plain_case(const PlainCase &c, uint64_t seed, cudaStream_t stream, DevBuf &workspace, Report &rep) {
  Rng rng(seed);
  const size_t m = 96, n = 80, k = 64;
  const bool fp8 = is_fp8(c.in);
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s per-tensor %s -> %s TN bias=%d gelu=%d alpha=%g beta=%g m=%zu n=%zu k=%zu",
                entry_name(c.entry), dtype_name(c.in), dtype_name(c.d), c.bias, c.gelu, c.alpha, c.beta, m, n, k);
  std::string what = buf, err;
  Tensor A = random_tensor(c.in, {m, k}, rng, -1, 1, 32.0f, stream, &err);
  Tensor B = random_tensor(c.in, {n, k}, rng, -1, 1, 32.0f, stream, &err);
  Tensor D(c.d, {n, m});
  const std::vector<double> d_old = init_d(D, c.beta, rng, stream, &err);
  const NVTEDType side_t = fp8 && c.d == kNVTEFloat32 ? kNVTEBFloat16 : c.d;
  Tensor bias, aux;
  std::vector<double> biasv;
  if (c.bias) { bias = random_tensor(side_t, {m}, rng, -1, 1, 1.0f, stream, &err); biasv = bias.values(); }
  if (c.gelu) { aux = Tensor(side_t, {n, m}); aux.data.poison(); }
  if (!err.empty()) { rep.fail(what + " (input setup: " + err + ")"); return; }
  Tensor wsh;
  NVTETensor ws = workspace_tensor(workspace, wsh);
  NVTEMatmulConfig cfg = nullptr;
  if (c.entry == Entry::Scaled) {
    nvte_cublas_gemm_scaled(A.h, B.h, D.h, bias.h, aux.h, true, false, false, ws, c.alpha, c.beta, true, 0, stream);
  } else {
    cfg = nvte_create_matmul_config();
    uint8_t yes = 1;
    if (c.bias) nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigBiasTensor, &bias.h, sizeof bias.h);
    if (c.gelu) {
      nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigWithGELUEpilogue, &yes, 1);
      nvte_set_matmul_config_attribute(cfg, kNVTEMatmulConfigEpilogueAuxTensor, &aux.h, sizeof aux.h);
    }
    nvte_cublas_gemm_v2(1, 0, &c.alpha, A.h, B.h, &c.beta, D.h, D.h, ws, cfg, stream);
  }
  NVTECommStatus st = nvte_comm_last_status();
  std::string msg = nvte_comm_last_error();
  nvte_destroy_matmul_config(cfg);
  CUDA_OK(cudaStreamSynchronize(stream));
  if (st != NVTE_COMM_SUCCESS) { rep.fail(what + " (" + msg + ")"); return; }
  auto av = A.values(), bv = B.values(), got = D.values();
  std::vector<double> ref(n * m), aux_ref(n * m);
  for (size_t j = 0; j < n; ++j)
    for (size_t i = 0; i < m; ++i) {
      double acc = 0;
      for (size_t l = 0; l < k; ++l) acc += av[i * k + l] * bv[j * k + l];
      double r = c.alpha * acc + (c.beta != 0 ? c.beta * d_old[j * m + i] : 0.0) + (c.bias ? biasv[i] : 0.0);
      aux_ref[j * m + i] = r;
      ref[j * m + i] = c.gelu ? gelu(r) : r;
    }
  double e = rel_err(got, ref);
  double tol = fp8 ? 6e-2 : c.in == kNVTEFloat32 && c.d == kNVTEFloat32 ? 1e-5 : 1e-2;
  if (c.gelu) e = std::max(e, rel_err(aux.values(), aux_ref));
  std::snprintf(buf, sizeof buf, " rel_err %.2e (tol %.0e)", e, tol);
  rep.check(e < tol, what + buf);
}

std::vector<PlainCase> plain_cases() {
  std::vector<PlainCase> cs;
  for (Entry e : {Entry::Scaled, Entry::V2}) {
    cs.push_back({kNVTEFloat32, kNVTEFloat32, e, false, false, 0.5f, 0.75f});
    cs.push_back({kNVTEFloat16, kNVTEFloat16, e, true, false, 2.0f, 0.0f});
    cs.push_back({kNVTEBFloat16, kNVTEBFloat16, e, false, false, 1.0f, 1.0f});
    cs.push_back({kNVTEBFloat16, kNVTEBFloat16, e, true, true, 0.5f, 0.0f});
    cs.push_back({kNVTEFloat8E4M3, kNVTEBFloat16, e, false, false, 0.25f, 0.5f});
    cs.push_back({kNVTEFloat8E4M3, kNVTEFloat32, e, true, false, 1.0f, 0.0f});
  }
  return cs;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const Mode combos[3][2] = {{k1D, k1D}, {k1D, k2D}, {k2D, k1D}};
  const bool layouts[4][2] = {{true, false}, {false, false}, {true, true}, {false, true}};
  const NVTEDType outs[3] = {kNVTEBFloat16, kNVTEFloat32, kNVTEFloat16};
  // Every combination x layout x output through nvte_cublas_gemm, full and partial blocks.
  int v = 0;
  for (auto &cb : combos)
    for (auto &l : layouts) {
      NVTEDType d = outs[v++ % 3];
      cases.push_back({cb[0], cb[1], l[0], l[1], d, Entry::Gemm, Epi::None, 1, 0, 256, 128, 384, 0});
      cases.push_back({cb[0], cb[1], l[0], l[1], d, Entry::Gemm, Epi::None, 1, 0, 200, 72, 336, 0});
    }
  // Epilogues, alpha / beta and the other entry points (TN and NN, the forward and
  // backward layouts of a linear layer).
  for (auto &cb : combos)
    for (Entry e : {Entry::Gemm, Entry::Scaled, Entry::V2}) {
      for (Epi epi : {Epi::Bias, Epi::DGelu})
        cases.push_back({cb[0], cb[1], true, false, kNVTEBFloat16, e, epi, 1, 0, 384, 256, 512, 0});
      float alpha = e == Entry::Gemm ? 1.0f : 0.5f;
      cases.push_back({cb[0], cb[1], false, false, kNVTEFloat32, e, Epi::None, alpha, 1.0f, 256, 136, 512, 0});
      if (e != Entry::Gemm)
        cases.push_back({cb[0], cb[1], true, false, kNVTEBFloat16, e, Epi::None, 2.0f, 0.25f, 128, 264, 256, 0});
    }
  // Operands from the library's own block quantization (both directions quantized):
  // forward (TN), data gradient (NN) and weight gradient (NT) of a linear layer.
  for (auto &cb : combos)
    for (auto &l : {std::pair<bool, bool>{true, false}, {false, false}, {false, true}}) {
      Case c{cb[0], cb[1], l.first, l.second, kNVTEBFloat16, Entry::Gemm, Epi::None, 1, 0, 256, 384, 512, 0};
      c.gpu_quant = true;
      cases.push_back(c);
    }
  // Anchor-sized (the all-gather GEMM of 8192 tokens, hidden 8192, 28672/8 columns):
  // weight 2D, activation 1D, sampled outputs.
  cases.push_back({k2D, k1D, true, false, kNVTEBFloat16, Entry::Gemm, Epi::None, 1, 0, 3584, 8192, 8192, 4096});
  cases.push_back({k2D, k1D, true, false, kNVTEBFloat16, Entry::V2, Epi::None, 1, 0, 3584, 8192, 8192, 4096});
  return cases;
}

// ------------------------------------------------------------------------ refusals

struct Refusal {
  std::string what, expect;  // expect: a piece of the recorded message
  std::function<void(NVTETensor D)> call;
};

void refusal_cases(cudaStream_t stream, DevBuf &workspace, Report &rep) {
  Rng rng(12345);
  const size_t m = 256, n = 128, k = 256;
  BlockTensor a1, a2, b1, b2, a_k, b_k, a_rows_only;
  make_block(a1, k1D, m, k, true, true, rng);
  make_block(a2, k2D, m, k, true, true, rng);
  make_block(b1, k1D, n, k, true, true, rng);
  make_block(b2, k2D, n, k, true, true, rng);
  make_block(a_k, k1D, m, 136, true, true, rng);
  make_block(b_k, k1D, n, 136, true, true, rng);
  make_block(a_rows_only, k1D, k, m, true, false, rng);  // logical [k, m]: NN reads its columnwise data
  std::string err;
  Tensor pt = random_tensor(kNVTEFloat8E4M3, {n, k}, rng, -1, 1, 32.0f, stream, &err);
  Tensor aux(kNVTEBFloat16, {n, m});
  Tensor wsh;
  NVTETensor ws = workspace_tensor(workspace, wsh);
  Tensor other(kNVTEBFloat16, {n, m});
  const float one = 1.0f, zero = 0.0f;
  // A gradient epilogue (dbias) with forward GELU: TE refuses the combination.
  NVTEMatmulConfig bad_cfg = nvte_create_matmul_config();
  {
    uint8_t yes = 1;
    NVTETensor bh = aux.h;
    nvte_set_matmul_config_attribute(bad_cfg, kNVTEMatmulConfigWithGELUEpilogue, &yes, 1);
    nvte_set_matmul_config_attribute(bad_cfg, kNVTEMatmulConfigDBiasTensor, &bh, sizeof bh);
  }
  std::vector<Refusal> rs = {
      {"2D x 2D", "both NVTE_BLOCK_SCALING_2D",
       [&](NVTETensor D) { nvte_cublas_gemm(a2.h, b2.h, D, nullptr, nullptr, true, false, false, ws, false, true, 0, stream); }},
      {"block x per-tensor FP8", "mix block scaling",
       [&](NVTETensor D) { nvte_cublas_gemm(a1.h, pt.h, D, nullptr, nullptr, true, false, false, ws, false, true, 0, stream); }},
      {"per-tensor x block (scaled)", "mix block scaling",
       [&](NVTETensor D) { nvte_cublas_gemm_scaled(pt.h, b1.h, D, nullptr, nullptr, true, false, false, ws, 1, 0, true, 0, stream); }},
      {"forward GELU epilogue", "GeluAux",
       [&](NVTETensor D) { nvte_cublas_gemm(a1.h, b1.h, D, nullptr, aux.h, true, false, false, ws, false, true, 0, stream); }},
      {"k not a multiple of 16", "multiple of 16",
       [&](NVTETensor D) { nvte_cublas_gemm(a_k.h, b_k.h, D, nullptr, nullptr, true, false, false, ws, false, true, 0, stream); }},
      {"missing columnwise data (NN)", "missing columnwise data",
       [&](NVTETensor D) { nvte_cublas_gemm(a_rows_only.h, b1.h, D, nullptr, nullptr, false, false, false, ws, false, true, 0, stream); }},
      {"v2: C differs from D", "C` and `D` differ",
       [&](NVTETensor D) { nvte_cublas_gemm_v2(1, 0, &one, a1.h, b1.h, &zero, other.h, D, ws, nullptr, stream); }},
      {"v2: NULL alpha", "`alpha` is NULL",
       [&](NVTETensor D) { nvte_cublas_gemm_v2(1, 0, nullptr, a1.h, b1.h, &zero, D, D, ws, nullptr, stream); }},
      {"v2: destroyed config", "not a live matmul config",
       [&](NVTETensor D) {
         NVTEMatmulConfig cfg = nvte_create_matmul_config();
         nvte_destroy_matmul_config(cfg);
         nvte_cublas_gemm_v2(1, 0, &one, a1.h, b1.h, &zero, D, D, ws, cfg, stream);
       }},
      {"v2: gelu with dbias", "gradient epilogue",
       [&](NVTETensor D) { nvte_cublas_gemm_v2(1, 0, &one, a1.h, b1.h, &zero, D, D, ws, bad_cfg, stream); }},
  };
  for (auto &r : rs) {
    Tensor D(kNVTEBFloat16, {n, m});
    D.data.poison();
    auto before = D.data.download();
    r.call(D.h);
    NVTECommStatus st = nvte_comm_last_status();
    std::string msg = nvte_comm_last_error();
    CUDA_OK(cudaStreamSynchronize(stream));
    bool untouched = D.data.download() == before;
    bool named = msg.find(r.expect) != std::string::npos;
    rep.check(st != NVTE_COMM_SUCCESS && named && untouched,
              "refused: " + r.what + " (" + nvte_comm_status_string(st) + ": " + msg + (untouched ? "; D untouched)" : "; D CHANGED)"));
  }
  // FP8 output is refused.
  Tensor D8(kNVTEFloat8E4M3, {n, m}, true);
  D8.data.poison();
  auto before = D8.data.download();
  nvte_cublas_gemm(a1.h, b1.h, D8.h, nullptr, nullptr, true, false, false, ws, false, true, 0, stream);
  std::string msg = nvte_comm_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  rep.check(msg.find("output must be") != std::string::npos && D8.data.download() == before,
            "refused: FP8 output (" + msg + ")");
  nvte_destroy_matmul_config(bad_cfg);
  rep.check(nvte_comm_live_matmul_config_count() == 0, "no matmul config leaked");
}

// ------------------------------------------------------------------------ benchmark

// bf16 bits -> double.
double bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void bench(cudaStream_t stream, Report &rep) {
  const bool print = rep.rank == 0;
  // M tokens x N output features x K (TE's forward GEMM D [M, N] = X [M, K] . W [N, K]^T).
  struct Shape { size_t M, N, K; const char *name; };
  const Shape shapes[] = {{8192, 7168, 8192, "8192x7168x8192"},
                          {8192, 4096, 16384, "8192x4096x16384"},
                          {8192, 16384, 4096, "8192x16384x4096"},
                          {16384, 2048, 8192, "16384x2048x8192"}};
  DevBuf workspace(32u << 20);
  Tensor wsh;
  NVTETensor ws = workspace_tensor(workspace, wsh);
  if (print)
    std::printf("%-18s %9s %9s %9s %9s %9s %9s %8s %8s %8s %9s\n", "shape (MxNxK)", "own2Dx1D", "lt2Dx1D", "own1Dx1D",
                "lt1Dx1D", "fp8", "bf16", "own/lt", "own/lt", "own/fp8", "|own-lt|");
  for (const Shape &s : shapes) {
    // TN as a linear layer's forward: A = weight [N, K] (2D blocks, or 1D), B = activation [M, K] (1D), D [M, N].
    Tensor wf(kNVTEFloat8E4M3, {s.N, s.K}, true), xf(kNVTEFloat8E4M3, {s.M, s.K}, true);
    Tensor wb(kNVTEBFloat16, {s.N, s.K}), xb(kNVTEBFloat16, {s.M, s.K}), D(kNVTEBFloat16, {s.M, s.N});
    nvte_comm_fill_uniform(wf.h, 1, -1, 1, stream);
    nvte_comm_fill_uniform(xf.h, 2, -1, 1, stream);
    nvte_comm_fill_uniform(wb.h, 3, -1, 1, stream);
    nvte_comm_fill_uniform(xb.h, 4, -1, 1, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    // Block tensors over the same FP8 bytes, with GEMM-ready scales that differ per block
    // (powers of 2 around 1/64), so that a misapplied scale shows in |own - lt|.
    NVTETensor w2 = nvte_create_tensor(NVTE_BLOCK_SCALING_2D), w1 = nvte_create_tensor(NVTE_BLOCK_SCALING_1D),
               x1 = nvte_create_tensor(NVTE_BLOCK_SCALING_1D);
    std::vector<size_t> w2_shape = {ceil_div(s.N, kBlock), pad4(ceil_div(s.K, kBlock))};
    std::vector<size_t> w1_shape = {ceil_div(s.K, kBlock), pad4(s.N)};
    std::vector<size_t> x1_shape = {ceil_div(s.K, kBlock), pad4(s.M)};
    auto scales = [](size_t count, size_t salt) {
      std::vector<float> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = std::exp2(-6.0f + (float)((i * 7 + salt) % 5) - 2.0f);
      return v;
    };
    std::vector<float> w2v = scales(w2_shape[0] * w2_shape[1], 1), w1v = scales(w1_shape[0] * w1_shape[1], 2),
                       x1v = scales(x1_shape[0] * x1_shape[1], 3);
    DevBuf w2d(w2v.size() * 4), w1d(w1v.size() * 4), x1d(x1v.size() * 4);
    w2d.upload(w2v.data());
    w1d.upload(w1v.data());
    x1d.upload(x1v.data());
    set_param(w2, kNVTERowwiseData, wf.data.p, kNVTEFloat8E4M3, {s.N, s.K});
    set_param(w2, kNVTERowwiseScaleInv, w2d.p, kNVTEFloat32, w2_shape);
    set_param(w1, kNVTERowwiseData, wf.data.p, kNVTEFloat8E4M3, {s.N, s.K});
    set_param(w1, kNVTERowwiseScaleInv, w1d.p, kNVTEFloat32, w1_shape);
    set_param(x1, kNVTERowwiseData, xf.data.p, kNVTEFloat8E4M3, {s.M, s.K});
    set_param(x1, kNVTERowwiseScaleInv, x1d.p, kNVTEFloat32, x1_shape);
    std::string failed;
    // Each recipe's forward GEMM as TE runs it: Float8BlockScaling with the split
    // accumulator (on the backend `be`), per-tensor FP8 (DelayedScaling's fprop) with
    // fast accumulation.
    auto gemm = [&](NVTETensor a, NVTETensor b, bool split, const char *be) {
      setenv("NVTE_COMM_BLOCK_GEMM", be, 1);
      nvte_cublas_gemm(a, b, D.h, nullptr, nullptr, true, false, false, ws, false, split, 0, stream);
      if (nvte_comm_last_status() != NVTE_COMM_SUCCESS && failed.empty()) failed = nvte_comm_last_error();
    };
    // Our kernel's output against cuBLASLt's (2D x 1D, then 1D x 1D): norm-wise.
    double diff[2] = {0, 0};
    for (int c = 0; c < 2; ++c) {
      NVTETensor a = c == 0 ? w2 : w1;
      gemm(a, x1, true, "own");
      CUDA_OK(cudaStreamSynchronize(stream));
      auto own = D.data.download();
      gemm(a, x1, true, "cublaslt");
      CUDA_OK(cudaStreamSynchronize(stream));
      auto lt = D.data.download();
      double num = 0, den = 0;
      for (size_t i = 0; i + 1 < own.size(); i += 2) {
        uint16_t ho, hl;
        std::memcpy(&ho, &own[i], 2);
        std::memcpy(&hl, &lt[i], 2);
        double o = bf16_value(ho), l = bf16_value(hl);
        num += (o - l) * (o - l);
        den += l * l;
      }
      diff[c] = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
    }
    auto t = time_interleaved(stream, 3, 5, 4,
                              {[&] { gemm(w2, x1, true, "own"); }, [&] { gemm(w2, x1, true, "cublaslt"); },
                               [&] { gemm(w1, x1, true, "own"); }, [&] { gemm(w1, x1, true, "cublaslt"); },
                               [&] { gemm(wf.h, xf.h, false, "cublaslt"); }, [&] { gemm(wb.h, xb.h, false, "cublaslt"); }});
    setenv("NVTE_COMM_BLOCK_GEMM", "cublaslt", 1);
    nvte_destroy_tensor(w2);
    nvte_destroy_tensor(w1);
    nvte_destroy_tensor(x1);
    if (!failed.empty()) { rep.fail(std::string("bench ") + s.name + ": " + failed); continue; }
    double flop = 2.0 * s.M * s.N * s.K;
    auto tf = [&](double ms) { return flop / (ms * 1e-3) / 1e12; };
    if (print)
      std::printf("%-18s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %8.3f %8.3f %8.3f %9.1e  TFLOP/s; own/lt: 2Dx1D, 1Dx1D; |own-lt| worst\n",
                  s.name, tf(t[0]), tf(t[1]), tf(t[2]), tf(t[3]), tf(t[4]), tf(t[5]), t[1] / t[0], t[3] / t[2],
                  t[4] / t[0], std::max(diff[0], diff[1]));
    char buf[160];
    std::snprintf(buf, sizeof buf, "bench %s: own vs cuBLASLt block output, rel diff %.1e / %.1e (tol 1e-2)", s.name,
                  diff[0], diff[1]);
    rep.check(diff[0] < 1e-2 && diff[1] < 1e-2, buf);
  }
}

}  // namespace

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
  bool do_bench = false;
  uint64_t base = (uint64_t)std::chrono::high_resolution_clock::now().time_since_epoch().count();
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bench") == 0) do_bench = true;
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) base = std::strtoull(argv[i + 1], nullptr, 10);
  }
  MPI_Bcast(&base, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rep.rank == 0) std::printf("test_block_gemm: %d rank(s), seed %llu\n", size, (unsigned long long)base);
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, rep.rank % ndev));
  if (prop.major != 9 || prop.minor != 0) {
    // Block-scaled GEMMs run on Hopper only: elsewhere every call must refuse cleanly.
    if (rep.rank == 0) std::printf("SKIPPED: block-scaled FP8 GEMM needs Hopper (sm_90), found sm_%d%d\n", prop.major, prop.minor);
    MPI_Finalize();
    return kSkip;
  }
  {
    DevBuf workspace(32u << 20);
    if (do_bench) {
      bench(stream, rep);
    } else {
      auto cases = all_cases();
      // Every backend, or the one the environment names.
      const char *env = std::getenv("NVTE_COMM_BLOCK_GEMM");
      std::vector<std::string> backends = {"cublaslt", "own"};
      if (env != nullptr && *env != 0) backends = {env};
      for (const std::string &b : backends) {
        g_backend = b;
        setenv("NVTE_COMM_BLOCK_GEMM", b.c_str(), 1);
        for (size_t i = 0; i < cases.size(); ++i)
          if ((int)(i % size) == rep.rank) run_case(cases[i], base + i, stream, workspace, rep);
      }
      if (env == nullptr) unsetenv("NVTE_COMM_BLOCK_GEMM");
      auto plain = plain_cases();
      for (size_t i = 0; i < plain.size(); ++i)
        if ((int)((cases.size() + i) % size) == rep.rank) run_plain_case(plain[i], base + 1000 + i, stream, workspace, rep);
      if (rep.rank == 0) refusal_cases(stream, workspace, rep);
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
  int rc = rep.finish("test_block_gemm");
  MPI_Finalize();
  return rc;
}
