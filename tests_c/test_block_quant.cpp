// FP8 block scaling (TE's Float8BlockScaling recipe) on one GPU: nvte_quantize /
// nvte_quantize_v2 / nvte_quantize_noop into NVTE_BLOCK_SCALING_1D and _2D tensors checked
// bit for bit (FP8 data and float32 scale inverses, TE's GEMM-ready and compact layouts,
// padding left untouched) against a CPU reference written from TE's definitions; refused
// shapes leave the output untouched; nvte_dequantize back to float32 / bfloat16 / float16
// bit for bit; and the quantization's bandwidth (8192 x 8192 bf16, f16 and f32, 4096 x 4096
// and 16384 x 16384 bf16) against a D2D copy measured in the same run, under each value of
// NVTE_COMM_BLOCK_QUANT (their outputs checked bit for bit against the default's).
//
//   test_block_quant [--seed N] [--no-bench] [--bench-only] [--quick]
//
// --quick leaves out the large cases (4096 x 7168), for runs under compute-sanitizer
// (scripts/gpu-test.sh's sanitizer stage): every mode, layout, type and option still runs.
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <memory>

#include "test_util.hpp"

using namespace tu;

namespace {

constexpr size_t kBlock = 128;

// ----------------------------------------------------------------- host number formats

uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// float -> bfloat16 / float16, round to nearest even (what cvt.rn does on the GPU).
uint16_t f2bf(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
uint16_t f2h(float f) {
  uint32_t x = f2u(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520: infinity
  if (ax < 0x38800000u) return (uint16_t)(sign | (uint32_t)std::nearbyint((double)u2f(ax) * 16777216.0));
  uint32_t r = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return (uint16_t)(sign | r);
}

// float -> FP8, round to nearest even, saturating to the largest finite value (TE's
// static_cast of __nv_fp8_e4m3 / e5m2: cvt.rn.satfinite); NaN -> the canonical NaN.
uint8_t f2fp8(float x, NVTEDType t) {
  const bool e4 = t == kNVTEFloat8E4M3;
  const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15;
  const double maxv = e4 ? 448.0 : 57344.0;
  const uint8_t maxcode = e4 ? 0x7e : 0x7b;
  if (std::isnan(x)) return e4 ? 0x7f : 0x7f;
  const uint8_t s = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs((double)x);
  if (a >= maxv) return s | maxcode;
  const double min_normal = std::ldexp(1.0, 1 - bias);
  if (a < min_normal) return s | (uint8_t)std::nearbyint(a / std::ldexp(1.0, 1 - bias - mbits));
  int e = 0;
  std::frexp(a, &e);
  int E = e - 1;
  double q = std::nearbyint((a / std::ldexp(1.0, E) - 1.0) * (1 << mbits));
  if (q == (1 << mbits)) { q = 0; ++E; }
  int code = ((E + bias) << mbits) | (int)q;
  if (code > maxcode) code = maxcode;
  return s | (uint8_t)code;
}

double fp8_value(uint8_t b, NVTEDType t) { return t == kNVTEFloat8E4M3 ? decode_e4m3(b) : decode_e5m2(b); }

float in_max(NVTEDType t) {
  switch (t) {
    case kNVTEFloat16: return 65504.0f;
    case kNVTEBFloat16: return u2f(0x7f7f0000u);
    default: return u2f(0x7f7fffffu);
  }
}

// TE's compute_scale_from_amax (recipe_common.cuh) for FP8 type `t` and input type `in`.
float ref_scale(float amax, float eps, bool pow2, NVTEDType t, NVTEDType in) {
  if (amax < eps) amax = eps;
  if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
  float s = (t == kNVTEFloat8E4M3 ? 448.0f : 57344.0f) / amax;
  if (std::isinf(s)) s = in_max(in);
  if (pow2) s = u2f(f2u(s) & 0xff800000u);
  return s;
}

// ------------------------------------------------------------------------ inputs

struct Input {
  NVTEDType dt;
  size_t rows, cols;
  std::vector<uint8_t> raw;  // the device bytes
  std::vector<float> val;    // their exact values
};

// Values of varied magnitude: each 128x128 tile its own exponent range, rows within a tile
// differing too, so 1D and 2D scales all differ. `specials`: tile (0, 0) zeros, tile (0, 1)
// tiny (the scale overflows float32 for float32 / bf16 inputs), one infinity in tile (1, 0).
Input make_input(NVTEDType dt, size_t rows, size_t cols, Rng &rng, bool specials) {
  Input in{dt, rows, cols, std::vector<uint8_t>(rows * cols * dtype_bytes(dt)), std::vector<float>(rows * cols)};
  const size_t tc = cols / kBlock;
  std::vector<int> tile_exp((rows / kBlock) * tc);
  for (auto &e : tile_exp) e = rng.range(-8, 8);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) {
      const size_t t = (r / kBlock) * tc + c / kBlock;
      int e = tile_exp[t] + (int)((r * 7 + (c / kBlock) * 3) % 5) - 2;
      float v = (float)(std::ldexp(1.0 + rng.uniform(0.0, 1.0), e) * (rng.next() & 1 ? -1.0 : 1.0));
      if (specials && t == 0) v = 0.0f;
      if (specials && t == 1) v = (float)std::ldexp(1.0 + rng.uniform(0.0, 1.0), dt == kNVTEFloat16 ? -20 : -130);
      if (specials && r == kBlock + 5 && c == 17) v = INFINITY;
      const size_t i = r * cols + c;
      if (dt == kNVTEFloat32) {
        std::memcpy(&in.raw[4 * i], &v, 4);
        in.val[i] = v;
      } else {
        uint16_t h = dt == kNVTEBFloat16 ? f2bf(v) : f2h(v);
        std::memcpy(&in.raw[2 * i], &h, 2);
        in.val[i] = (float)(dt == kNVTEBFloat16 ? decode_bf16(h) : decode_f16(h));
      }
    }
  return in;
}

// -------------------------------------------------------------------- the reference

size_t pad4(size_t n) { return (n + 3) / 4 * 4; }

// One direction of a block-scaled tensor as TE lays it out.
struct Layout {
  std::vector<size_t> data_shape, scale_shape;
};

// TE's Float8BlockQuantizer.get_scale_shape / get_columnwise_shape (compact: the format of
// its all-gather usage) for an [M, K] input.
Layout te_layout(int mode, bool columnwise, bool compact, size_t M, size_t K) {
  const size_t bm = (M + kBlock - 1) / kBlock, bk = (K + kBlock - 1) / kBlock;
  if (mode == 2) return columnwise ? Layout{{K, M}, {bk, pad4(bm)}} : Layout{{M, K}, {bm, pad4(bk)}};
  if (columnwise) return Layout{compact ? std::vector<size_t>{M, K} : std::vector<size_t>{K, M}, {bm, compact ? K : pad4(K)}};
  return Layout{{M, K}, compact ? std::vector<size_t>{M, bk} : std::vector<size_t>{bk, pad4(M)}};
}

struct Expected {
  std::vector<uint8_t> data;
  std::vector<float> sinv;
  std::vector<bool> sinv_set;  // padding entries stay as they were
};

struct Opts {
  int mode;  // 1 or 2
  bool pow2;
  float eps;
  bool compact;
  NVTEDType out;
};

// The reference quantization of one direction.
Expected reference(const Input &in, const Opts &o, bool columnwise) {
  const size_t M = in.rows, K = in.cols;
  const Layout L = te_layout(o.mode, columnwise, o.compact && o.mode == 1, M, K);
  Expected x{std::vector<uint8_t>(M * K), std::vector<float>(L.scale_shape[0] * L.scale_shape[1]),
             std::vector<bool>(L.scale_shape[0] * L.scale_shape[1], false)};
  const size_t pitch = L.scale_shape[1];
  // The block of element (r, c): its rows [r0, r1) and columns [c0, c1), and where its
  // scale inverse goes.
  auto block_of = [&](size_t r, size_t c, size_t &r0, size_t &r1, size_t &c0, size_t &c1) -> size_t {
    if (o.mode == 2) {
      r0 = r / kBlock * kBlock; r1 = r0 + kBlock; c0 = c / kBlock * kBlock; c1 = c0 + kBlock;
      return columnwise ? (c / kBlock) * pitch + r / kBlock : (r / kBlock) * pitch + c / kBlock;
    }
    if (columnwise) {
      r0 = r / kBlock * kBlock; r1 = r0 + kBlock; c0 = c; c1 = c + 1;
      return (r / kBlock) * pitch + c;
    }
    r0 = r; r1 = r + 1; c0 = c / kBlock * kBlock; c1 = c0 + kBlock;
    return o.compact ? r * pitch + c / kBlock : (c / kBlock) * pitch + r;
  };
  std::vector<float> scale_of(x.sinv.size(), 0.0f);
  for (size_t r = 0; r < M; ++r)
    for (size_t c = 0; c < K; ++c) {
      size_t r0, r1, c0, c1;
      const size_t si = block_of(r, c, r0, r1, c0, c1);
      if (!x.sinv_set[si]) {
        float amax = 0.0f;
        for (size_t i = r0; i < r1; ++i)
          for (size_t j = c0; j < c1; ++j) amax = std::fmax(amax, std::fabs(in.val[i * K + j]));
        const float s = ref_scale(amax, o.eps, o.pow2, o.out, in.dt);
        scale_of[si] = s;
        x.sinv[si] = 1.0f / s;
        x.sinv_set[si] = true;
      }
      const uint8_t q = f2fp8(in.val[r * K + c] * scale_of[si], o.out);
      const bool transposed = columnwise && !(o.mode == 1 && o.compact);
      x.data[transposed ? c * M + r : r * K + c] = q;
    }
  return x;
}

// ------------------------------------------------------------------- device tensors

size_t numel(const std::vector<size_t> &s) {
  size_t n = 1;
  for (size_t d : s) n *= d;
  return n;
}

// A block-scaled output: rowwise and / or columnwise FP8 data with their scale inverses,
// every buffer poisoned (0xff) first.
struct BlockOut {
  NVTETensor h = nullptr;
  DevBuf data, sinv, cdata, csinv;
  Layout row, col;
  BlockOut(int mode, NVTEDType t, size_t M, size_t K, bool rowwise, bool columnwise, bool compact) {
    h = nvte_create_tensor(mode == 1 ? NVTE_BLOCK_SCALING_1D : NVTE_BLOCK_SCALING_2D);
    if (rowwise) {
      row = te_layout(mode, false, compact, M, K);
      data = DevBuf(M * K);
      sinv = DevBuf(4 * numel(row.scale_shape));
      set(kNVTERowwiseData, data.p, t, row.data_shape);
      set(kNVTERowwiseScaleInv, sinv.p, kNVTEFloat32, row.scale_shape);
    }
    if (columnwise) {
      col = te_layout(mode, true, compact, M, K);
      cdata = DevBuf(M * K);
      csinv = DevBuf(4 * numel(col.scale_shape));
      set(kNVTEColumnwiseData, cdata.p, t, col.data_shape);
      set(kNVTEColumnwiseScaleInv, csinv.p, kNVTEFloat32, col.scale_shape);
    }
    for (DevBuf *b : {&data, &sinv, &cdata, &csinv})
      if (b->p) b->poison();
  }
  void set(NVTETensorParam p, void *ptr, NVTEDType t, const std::vector<size_t> &shape) {
    NVTEBasicTensor b = basic(ptr, t, shape);
    nvte_set_tensor_param_v2(h, p, &b, sizeof(b));
  }
  BlockOut(const BlockOut &) = delete;
  BlockOut &operator=(const BlockOut &) = delete;
  ~BlockOut() { if (h) nvte_destroy_tensor(h); }
};

struct HostTensor {
  NVTETensor h = nullptr;
  DevBuf buf;
  HostTensor(NVTEDType t, const std::vector<size_t> &shape, const void *host) : buf(numel(shape) * dtype_bytes(t)) {
    h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
    NVTEBasicTensor b = basic(buf.p, t, shape);
    nvte_set_tensor_param_v2(h, kNVTERowwiseData, &b, sizeof(b));
    if (host) buf.upload(host);
  }
  HostTensor(const HostTensor &) = delete;
  HostTensor &operator=(const HostTensor &) = delete;
  ~HostTensor() { if (h) nvte_destroy_tensor(h); }
};

// Compare one direction: data bytes exactly, scale inverses bit for bit, padding untouched.
std::string compare(const Expected &x, const DevBuf &data, const DevBuf &sinv) {
  char msg[256];
  auto d = data.download();
  for (size_t i = 0; i < x.data.size(); ++i)
    if (d[i] != x.data[i]) {
      size_t bad = 0;
      for (size_t j = i; j < x.data.size(); ++j) bad += d[j] != x.data[j];
      std::snprintf(msg, sizeof msg, "data[%zu] = 0x%02x, expected 0x%02x (%zu of %zu bytes differ)", i, d[i],
                    x.data[i], bad, x.data.size());
      return msg;
    }
  auto s = sinv.download();
  for (size_t i = 0; i < x.sinv.size(); ++i) {
    uint32_t got;
    std::memcpy(&got, &s[4 * i], 4);
    const uint32_t want = x.sinv_set[i] ? f2u(x.sinv[i]) : 0xffffffffu;
    if (got != want) {
      std::snprintf(msg, sizeof msg, "scale_inv[%zu] = %a (0x%08x), expected %s%a (0x%08x)", i, u2f(got), got,
                    x.sinv_set[i] ? "" : "untouched padding ", u2f(want), want);
      return msg;
    }
  }
  return "";
}

const char *status_text() { return nvte_comm_last_error(); }

// --------------------------------------------------------------------------- cases

struct Case {
  size_t rows, cols;
  NVTEDType in;
  Opts o;
  bool rowwise, columnwise;
  bool specials;
  int entry;  // 0: nvte_quantize_v2, 1: nvte_quantize (no config), 2: nvte_quantize_noop (flag 0)
};

std::string describe(const Case &c) {
  char b[256];
  std::snprintf(b, sizeof b, "%zux%zu %s->%s %dD%s%s%s pow2=%d eps=%g%s via %s", c.rows, c.cols, dtype_name(c.in),
                dtype_name(c.o.out), c.o.mode, c.rowwise ? " rowwise" : "", c.columnwise ? " columnwise" : "",
                c.o.compact ? " COMPACT" : " GEMM_READY", c.o.pow2, c.o.eps, c.specials ? " specials" : "",
                c.entry == 0 ? "nvte_quantize_v2" : c.entry == 1 ? "nvte_quantize" : "nvte_quantize_noop");
  return b;
}

NVTEQuantizationConfig make_config(const Opts &o) {
  NVTEQuantizationConfig cfg = nvte_create_quantization_config();
  uint8_t p = o.pow2;
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigForcePow2Scales, &p, 1);
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigAmaxEpsilon, &o.eps, 4);
  int32_t fmt = o.compact ? 1 : 0;
  nvte_set_quantization_config_attribute(cfg, kNVTEQuantizationConfigFloat8BlockScaleTensorFormat, &fmt, 4);
  return cfg;
}

// Dequantize `out` (its rowwise data, else its columnwise data) into each float type and
// compare with decode(fp8) * scale_inv cast on the host; also the round trip's error.
void check_dequantize(const Case &c, const Input &in, BlockOut &out, const Expected &x, bool from_columnwise,
                      cudaStream_t stream, Report &rep) {
  const size_t M = c.rows, K = c.cols;
  const bool transposed = from_columnwise && !(c.o.mode == 1 && c.o.compact);
  for (NVTEDType t : {kNVTEFloat32, kNVTEBFloat16, kNVTEFloat16}) {
    HostTensor dq(t, {M, K}, nullptr);
    dq.buf.poison();
    nvte_dequantize(out.h, dq.h, stream);
    const std::string what = "dequantize (" + std::string(from_columnwise ? "columnwise" : "rowwise") + " -> " +
                             dtype_name(t) + ") " + describe(c);
    if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) { rep.fail(what + ": " + status_text()); continue; }
    CUDA_OK(cudaStreamSynchronize(stream));
    auto got = dq.buf.download();
    size_t bad = 0, first = 0;
    double num = 0, den = 0;
    for (size_t r = 0; r < M; ++r)
      for (size_t cc = 0; cc < K; ++cc) {
        size_t si;
        // the scale inverse of (r, cc) in the reference's layout
        if (c.o.mode == 2) {
          const size_t pitch = from_columnwise ? pad4(M / kBlock) : pad4(K / kBlock);
          si = from_columnwise ? (cc / kBlock) * pitch + r / kBlock : (r / kBlock) * pitch + cc / kBlock;
        } else if (from_columnwise) {
          si = (r / kBlock) * K + cc;
        } else {
          si = c.o.compact ? r * (K / kBlock) + cc / kBlock : (cc / kBlock) * M + r;
        }
        const uint8_t q = x.data[transposed ? cc * M + r : r * K + cc];
        const float v = (float)fp8_value(q, c.o.out) * x.sinv[si];
        const size_t i = r * K + cc;
        uint32_t want, have = 0;
        if (t == kNVTEFloat32) want = f2u(v);
        else want = t == kNVTEBFloat16 ? f2bf(v) : f2h(v);
        std::memcpy(&have, &got[i * dtype_bytes(t)], dtype_bytes(t));
        if (have != want && bad++ == 0) first = i;
        const double ref = in.val[i];
        // (blocks of scale 1, an infinity's or a zero block's, saturate or underflow: left out)
        if (t == kNVTEFloat32 && x.sinv[si] != 1.0f) { num += (v - ref) * (v - ref); den += ref * ref; }
      }
    if (bad) {
      char b[160];
      std::snprintf(b, sizeof b, ": %zu of %zu differ, first at %zu", bad, M * K, first);
      rep.fail(what + b);
      continue;
    }
    if (t == kNVTEFloat32) {
      const double err = den > 0 ? std::sqrt(num / den) : 0.0;
      const double bound = c.o.out == kNVTEFloat8E4M3 ? 0.04 : 0.08;
      char b[96];
      std::snprintf(b, sizeof b, " (bit-exact; round-trip error %.4f < %.2f)", err, bound);
      rep.check(err < bound, what + b);
    } else {
      rep.pass(what + " (bit-exact)");
    }
  }
}

// NVTE_COMM_BLOCK_QUANT's values (the library's default first).
const char *const kLaunches[] = {"fast", "shared", "previous", "regs"};
constexpr int kNumLaunches = sizeof(kLaunches) / sizeof(kLaunches[0]);

bool same_bytes(const DevBuf &a, const DevBuf &b) {
  if (a.p == nullptr || b.p == nullptr) return a.p == b.p;
  return a.download() == b.download();
}

bool same_output(const BlockOut &a, const BlockOut &b) {
  return same_bytes(a.data, b.data) && same_bytes(a.sinv, b.sinv) && same_bytes(a.cdata, b.cdata) &&
         same_bytes(a.csinv, b.csinv);
}

// Every other value of NVTE_COMM_BLOCK_QUANT writes the same bytes as the default's
// `out` (checked against the reference), padding included.
void check_launches(const Case &c, const HostTensor &src, const BlockOut &out, cudaStream_t stream, Report &rep,
                    const std::string &what) {
  NVTEQuantizationConfig cfg = make_config(c.o);
  for (int l = 1; l < kNumLaunches; ++l) {
    BlockOut other(c.o.mode, c.o.out, c.rows, c.cols, c.rowwise, c.columnwise, c.o.compact);
    setenv("NVTE_COMM_BLOCK_QUANT", kLaunches[l], 1);
    nvte_quantize_v2(src.h, other.h, cfg, stream);
    const NVTECommStatus st = nvte_comm_last_status();
    unsetenv("NVTE_COMM_BLOCK_QUANT");
    CUDA_OK(cudaStreamSynchronize(stream));
    rep.check(st == NVTE_COMM_SUCCESS && same_output(out, other),
              std::string("NVTE_COMM_BLOCK_QUANT=") + kLaunches[l] + " " + what + ": " +
                  (st == NVTE_COMM_SUCCESS ? "same bytes as " + std::string(kLaunches[0]) : status_text()));
  }
  nvte_destroy_quantization_config(cfg);
}

void run_case(const Case &c, Rng &rng, cudaStream_t stream, Report &rep, bool dequant) {
  const std::string what = describe(c);
  Input in = make_input(c.in, c.rows, c.cols, rng, c.specials);
  HostTensor src(c.in, {c.rows, c.cols}, in.raw.data());
  BlockOut out(c.o.mode, c.o.out, c.rows, c.cols, c.rowwise, c.columnwise, c.o.compact);
  // (the status and message are read before any other call: each call replaces them)
  NVTECommStatus st;
  std::string msg;
  if (c.entry == 0) {
    NVTEQuantizationConfig cfg = make_config(c.o);
    nvte_quantize_v2(src.h, out.h, cfg, stream);
    st = nvte_comm_last_status();
    msg = status_text();
    nvte_destroy_quantization_config(cfg);
  } else if (c.entry == 1) {
    nvte_quantize(src.h, out.h, stream);
    st = nvte_comm_last_status();
    msg = status_text();
  } else {
    float zero = 0.0f;
    HostTensor flag(kNVTEFloat32, {1}, &zero);
    nvte_quantize_noop(src.h, out.h, flag.h, stream);
    st = nvte_comm_last_status();
    msg = status_text();
  }
  if (st != NVTE_COMM_SUCCESS) { rep.fail(what + ": " + msg); return; }
  CUDA_OK(cudaStreamSynchronize(stream));
  Expected xr, xc;
  if (c.rowwise) {
    xr = reference(in, c.o, false);
    std::string e = compare(xr, out.data, out.sinv);
    rep.check(e.empty(), "quantize rowwise " + what + (e.empty() ? " (bit-exact)" : ": " + e));
  }
  if (c.columnwise) {
    xc = reference(in, c.o, true);
    std::string e = compare(xc, out.cdata, out.csinv);
    rep.check(e.empty(), "quantize columnwise " + what + (e.empty() ? " (bit-exact)" : ": " + e));
  }
  if (c.entry == 0) check_launches(c, src, out, stream, rep, what);
  if (dequant) check_dequantize(c, in, out, c.rowwise ? xr : xc, !c.rowwise, stream, rep);
}

std::vector<Case> all_cases(bool quick) {
  std::vector<Case> v;
  const NVTEDType E4 = kNVTEFloat8E4M3;
  const std::pair<size_t, size_t> sizes[] = {{128, 128}, {256, 384}, {1152, 640}};
  for (auto [m, k] : sizes)
    for (NVTEDType in : {kNVTEFloat32, kNVTEBFloat16})
      for (int mode : {1, 2})
        for (bool pow2 : {false, true}) {
          const bool specials = m >= 256 && k >= 256;
          // both directions, rowwise only, columnwise only
          v.push_back({m, k, in, {mode, pow2, 0.0f, false, E4}, true, true, specials, 0});
          v.push_back({m, k, in, {mode, pow2, 0.0f, false, E4}, true, false, specials, 0});
          v.push_back({m, k, in, {mode, pow2, 0.0f, false, E4}, false, true, specials, 0});
          if (mode == 1) v.push_back({m, k, in, {mode, pow2, 0.0f, true, E4}, true, true, specials, 0});
        }
  // Epsilon (raises small blocks' amax: the tiles of exponent -8 lie below 0.05), fp16
  // input, e5m2 output, the entry points without a config (TE's defaults: no pow-2, eps 0,
  // GEMM_READY) and with a noop flag of 0.
  for (int mode : {1, 2}) {
    v.push_back({256, 384, kNVTEBFloat16, {mode, false, 0.05f, false, E4}, true, true, true, 0});
    v.push_back({256, 384, kNVTEFloat32, {mode, true, 0.05f, mode == 1, E4}, true, true, true, 0});
    v.push_back({1152, 640, kNVTEFloat16, {mode, true, 0.0f, false, E4}, true, true, true, 0});
    v.push_back({256, 384, kNVTEBFloat16, {mode, false, 0.0f, false, kNVTEFloat8E5M2}, true, true, true, 0});
    v.push_back({1152, 640, kNVTEBFloat16, {mode, false, 0.0f, false, E4}, true, true, true, 1});
    v.push_back({256, 384, kNVTEFloat32, {mode, false, 0.0f, false, E4}, false, true, false, 2});
  }
  if (quick) return v;
  // Large: both directions.
  for (int mode : {1, 2}) v.push_back({4096, 7168, kNVTEBFloat16, {mode, true, 0.0f, false, E4}, true, true, true, 0});
  v.push_back({4096, 7168, kNVTEFloat32, {1, false, 0.0f, true, E4}, true, true, false, 0});
  return v;
}

// Shapes TE refuses (rows or the last dimension not a multiple of 128, fewer than 2
// dimensions), a wrong layout for the configured format, and a noop flag of 1: each
// leaves the poisoned output as it was.
void refused_cases(cudaStream_t stream, Report &rep) {
  struct R {
    std::vector<size_t> shape;
    int mode;
    bool compact_tensor, compact_config;
    const char *expect;
  };
  const R rs[] = {
      {{100, 128}, 1, false, false, "multiples of 128"},
      {{128, 100}, 1, false, false, "multiples of 128"},
      {{2, 100, 128}, 2, false, false, "multiples of 128"},
      {{384, 130}, 2, false, false, "multiples of 128"},
      {{256}, 1, false, false, "multiples of 128"},
      {{256, 384}, 1, false, true, "COMPACT"},
      {{256, 384}, 1, true, false, "GEMM_READY"},
  };
  Rng rng(7);
  for (const R &r : rs) {
    const size_t K = r.shape.back(), M = numel(r.shape) / K;
    std::vector<float> host(M * K);
    for (auto &x : host) x = (float)rng.uniform(-1, 1);
    HostTensor src(kNVTEFloat32, r.shape, host.data());
    // Output buffers sized for the shape (scale shapes by TE's rules), set as TE would.
    BlockOut out(r.mode, kNVTEFloat8E4M3, M, K, true, true, r.compact_tensor);
    if (r.shape.size() != 2) {
      auto cshape = r.shape;
      std::rotate(cshape.rbegin(), cshape.rbegin() + 1, cshape.rend());
      out.set(kNVTERowwiseData, out.data.p, kNVTEFloat8E4M3, r.shape);
      out.set(kNVTEColumnwiseData, out.cdata.p, kNVTEFloat8E4M3, cshape);
    }
    Opts o{r.mode, true, 0.0f, r.compact_config, kNVTEFloat8E4M3};
    NVTEQuantizationConfig cfg = make_config(o);
    nvte_quantize_v2(src.h, out.h, cfg, stream);
    const NVTECommStatus st = nvte_comm_last_status();
    const std::string msg = nvte_comm_last_error();
    nvte_destroy_quantization_config(cfg);
    CUDA_OK(cudaStreamSynchronize(stream));
    bool untouched = true;
    for (DevBuf *b : {&out.data, &out.sinv, &out.cdata, &out.csinv})
      for (uint8_t x : b->download()) untouched &= x == 0xff;
    std::string shape;
    for (size_t d : r.shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    rep.check(st == NVTE_COMM_ERROR_INVALID_ARGUMENT && msg.find(r.expect) != std::string::npos && untouched,
              "refused " + shape + (r.mode == 1 ? " 1D" : " 2D") + (r.compact_config ? " (config COMPACT)" : "") +
                  (r.compact_tensor ? " (compact tensor)" : "") + ": " + msg + (untouched ? "; output untouched" : "; OUTPUT WRITTEN"));
  }
  // A noop flag of 1: nothing written.
  std::vector<float> host(256 * 256, 1.0f);
  HostTensor src(kNVTEFloat32, {256, 256}, host.data());
  BlockOut out(1, kNVTEFloat8E4M3, 256, 256, true, true, false);
  float one = 1.0f;
  HostTensor flag(kNVTEFloat32, {1}, &one);
  nvte_quantize_noop(src.h, out.h, flag.h, stream);
  const bool ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
  CUDA_OK(cudaStreamSynchronize(stream));
  bool untouched = true;
  for (DevBuf *b : {&out.data, &out.sinv, &out.cdata, &out.csinv})
    for (uint8_t x : b->download()) untouched &= x == 0xff;
  rep.check(ok && untouched, "nvte_quantize_noop with the flag at 1 writes nothing");
}


struct BenchMode {
  const char *name;
  int mode;
  bool rowwise, columnwise, compact;
};
// (the compact format's columnwise output moves the transposed one's bytes in the input's
// layout, without the transpose; its rowwise scales are compact too: 128 scattered 4-byte
// stores a tile instead of 512 contiguous bytes, so the two rows bound the transpose's cost
// by that layout's)
const BenchMode kBenchModes[] = {{"1D rowwise + columnwise", 1, true, true, false},
                                 {"1D rowwise + compact col", 1, true, true, true},
                                 {"1D rowwise", 1, true, false, false},
                                 {"1D columnwise", 1, false, true, false},
                                 {"2D rowwise", 2, true, false, false},
                                 {"2D rowwise + columnwise", 2, true, true, false}};
constexpr int kNumBenchModes = sizeof(kBenchModes) / sizeof(kBenchModes[0]);

// Bytes a quantization moves: the input, the FP8 data and scale inverses written.
double moved_bytes(const BlockOut &o, NVTEDType dt, size_t M, size_t K) {
  double b = (double)(M * K * dtype_bytes(dt));
  if (o.data.p) b += (double)(M * K) + 4.0 * numel(o.row.scale_shape);
  if (o.cdata.p) b += (double)(M * K) + 4.0 * numel(o.col.scale_shape);
  return b;
}

// The device's nominal HBM bandwidth in GB/s, by its name (bench/quantize_bench.py's
// table: H200 4800, H100 NVL 3938, H100 PCIe 2039, H100 SXM 3352), or 0 where the name
// does not tell it (GH200 included: several memory configurations share that name).
double nominal_hbm_gbs() {
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const char *n = prop.name;
  if (std::strstr(n, "GH200")) return 0.0;
  if (std::strstr(n, "H200")) return 4800.0;
  if (std::strstr(n, "H100 NVL")) return 3938.0;
  if (std::strstr(n, "H100 PCIe")) return 2039.0;
  if (std::strstr(n, "H100")) return 3352.0;
  return 0.0;
}

// " xx.x % of N GB/s" for gbs against the nominal bandwidth (empty where it is unknown).
std::string pct_of_nominal(double gbs, double nominal) {
  if (nominal <= 0.0) return "";
  char b[48];
  std::snprintf(b, sizeof(b), " %5.1f %% of %.0f GB/s", 100.0 * gbs / nominal, nominal);
  return b;
}

// Bandwidth of one [M, K] input -> e4m3: every mode under every value of
// NVTE_COMM_BLOCK_QUANT (set around each call), interleaved with a D2D copy of the input,
// as GB/s of the bytes moved, % of the device's nominal HBM bandwidth (nominal_hbm_gbs)
// and % of the copy; and every value's output checked bit for bit against the default's.
void bench_shape(cudaStream_t stream, Report &rep, NVTEDType dt, size_t M, size_t K, double nominal) {
  Rng rng(11);
  Input in = make_input(dt, M, K, rng, false);
  HostTensor src(dt, {M, K}, in.raw.data());
  const size_t in_bytes = M * K * dtype_bytes(dt);
  DevBuf copy_dst(in_bytes);
  std::vector<std::unique_ptr<BlockOut>> outs;
  for (const BenchMode &m : kBenchModes)
    for (int l = 0; l < kNumLaunches; ++l)
      outs.emplace_back(new BlockOut(m.mode, kNVTEFloat8E4M3, M, K, m.rowwise, m.columnwise, m.compact));
  NVTEQuantizationConfig cfg = make_config({1, true, 0.0f, false, kNVTEFloat8E4M3});
  NVTEQuantizationConfig cfg_compact = make_config({1, true, 0.0f, true, kNVTEFloat8E4M3});
  std::vector<std::function<void()>> fns = {
      [&] { CUDA_OK(cudaMemcpyAsync(copy_dst.p, src.buf.p, in_bytes, cudaMemcpyDeviceToDevice, stream)); }};
  for (int i = 0; i < kNumBenchModes * kNumLaunches; ++i)
    fns.push_back([&, i] {
      setenv("NVTE_COMM_BLOCK_QUANT", kLaunches[i % kNumLaunches], 1);
      nvte_quantize_v2(src.h, outs[i]->h, kBenchModes[i / kNumLaunches].compact ? cfg_compact : cfg, stream);
    });
  auto ms = time_interleaved(stream, 3, 10, 5, fns);
  const bool ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
  unsetenv("NVTE_COMM_BLOCK_QUANT");
  nvte_destroy_quantization_config(cfg);
  nvte_destroy_quantization_config(cfg_compact);
  char shape[64];
  std::snprintf(shape, sizeof(shape), "%zux%zu %s -> e4m3", M, K, dtype_name(dt));
  if (!ok) { rep.fail(std::string("bench ") + shape + ": " + status_text()); return; }
  const double copy_gbs = 2.0 * in_bytes / (ms[0] * 1e6);
  std::printf("bench %s %-26s %8.1f us %7.0f GB/s%s\n", shape, "D2D copy (read + write)", ms[0] * 1e3, copy_gbs,
              pct_of_nominal(copy_gbs, nominal).c_str());
  for (int m = 0; m < kNumBenchModes; ++m) {
    std::string ab;
    for (int l = 0; l < kNumLaunches; ++l) {
      const int i = m * kNumLaunches + l;
      const double gbs = moved_bytes(*outs[i], dt, M, K) / (ms[1 + i] * 1e6);
      if (l == 0)
        std::printf("bench %s %-26s %8.1f us %7.0f GB/s%s %6.1f %% of the copy\n", shape, kBenchModes[m].name,
                    ms[1 + i] * 1e3, gbs, pct_of_nominal(gbs, nominal).c_str(), 100.0 * gbs / copy_gbs);
      char part[16];
      std::snprintf(part, sizeof(part), " %5.1f", 100.0 * gbs / (nominal > 0.0 ? nominal : copy_gbs));
      ab += part;
      if (l > 0) {
        rep.check(same_output(*outs[m * kNumLaunches], *outs[i]),
                  std::string("bench ") + shape + " " + kBenchModes[m].name + ": NVTE_COMM_BLOCK_QUANT=" +
                      kLaunches[l] + " writes the same bytes as " + kLaunches[0]);
      }
    }
    std::printf("bench-ab %s %-26s %% of %s:%s\n", shape, kBenchModes[m].name,
                nominal > 0.0 ? "nominal" : "the copy", ab.c_str());
  }
}

// Bandwidth at 8192 x 8192 bf16 (the acceptance shape), then float16, float32, a smaller
// and a larger bf16 input (the launch's last, partly filled wave weighs less there).
void bench(cudaStream_t stream, Report &rep) {
  const double nominal = nominal_hbm_gbs();
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  if (nominal > 0.0)
    std::printf("bench device: %s, nominal HBM %.0f GB/s\n", prop.name, nominal);
  else
    std::printf("bench device: %s, nominal HBM bandwidth unknown: %% of the copy only\n", prop.name);
  std::printf("bench-ab columns: NVTE_COMM_BLOCK_QUANT =");
  for (int l = 0; l < kNumLaunches; ++l) std::printf(" %s", kLaunches[l]);
  std::printf("\n");
  bench_shape(stream, rep, kNVTEBFloat16, 8192, 8192, nominal);
  bench_shape(stream, rep, kNVTEFloat16, 8192, 8192, nominal);
  bench_shape(stream, rep, kNVTEFloat32, 8192, 8192, nominal);
  bench_shape(stream, rep, kNVTEBFloat16, 4096, 4096, nominal);
  bench_shape(stream, rep, kNVTEBFloat16, 16384, 16384, nominal);
}

}  // namespace

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  Report rep;
  MPI_Comm_rank(MPI_COMM_WORLD, &rep.rank);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = (uint64_t)std::chrono::high_resolution_clock::now().time_since_epoch().count();
  bool do_bench = true, do_checks = true, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    if (std::strcmp(argv[i], "--no-bench") == 0) do_bench = false;
    if (std::strcmp(argv[i], "--bench-only") == 0) do_checks = false;
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
  }
  std::printf("test_block_quant: seed %" PRIu64 "\n", seed);
  if (nvte_comm_check_runtime() != NVTE_COMM_SUCCESS) {
    rep.fail(std::string("nvte_comm_check_runtime: ") + nvte_comm_last_error());
    return rep.finish("test_block_quant");
  }
  if (rep.rank == 0 && do_checks) {
    Rng rng(seed);
    auto cases = all_cases(quick);
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case &c = cases[i];
      // Dequantize the smaller cases (from the columnwise data where only that exists).
      run_case(c, rng, stream, rep, c.rows * c.cols <= 1152 * 640);
    }
    refused_cases(stream, rep);
  }
  if (do_bench) bench(stream, rep);
  CUDA_OK(cudaStreamDestroy(stream));
  int rc = rep.finish("test_block_quant");
  MPI_Finalize();
  return rc;
}
