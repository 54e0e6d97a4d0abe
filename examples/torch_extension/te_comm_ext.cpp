// A small PyTorch C++ extension over the C API of libtransformer_engine_comm:
// TE's comm_gemm.h calls (nvte_all_gather_gemm, nvte_gemm_reduce_scatter) on torch
// tensors, on torch's current CUDA stream, with the NCCL communicator of a torch
// ProcessGroupNCCL. Built by build_ext.py (torch.utils.cpp_extension.load), which finds
// the installed library with pkg-config.
//
// Conventions (TE's, "TN"): x is the activation [tokens, k], weight is [out, k], and the
// result is x @ weight.T. The library takes global sizes m (weight rows), n (tokens), k
// and each rank's block-distributed share (numroc: block ceil(global / nranks)).
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// After the CUDA headers: the header then uses their cudaStream_t.
#include <transformer_engine_comm.h>

namespace {

// Throws (as a Python RuntimeError) when the calling thread's last library call failed.
void check_last(const char *what) {
  const NVTECommStatus st = nvte_comm_last_status();
  TORCH_CHECK(st == NVTE_COMM_SUCCESS, what, " failed (", nvte_comm_status_string(st), "): ",
              nvte_comm_last_error());
}

void check_status(NVTECommStatus st, const char *what) {
  TORCH_CHECK(st == NVTE_COMM_SUCCESS, what, " failed (", nvte_comm_status_string(st), "): ",
              nvte_comm_last_error());
}

NVTEDType nvte_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kNVTEFloat32;
    case at::kHalf: return kNVTEFloat16;
    case at::kBFloat16: return kNVTEBFloat16;
    default:
      TORCH_CHECK(false, "te_comm_ext: unsupported dtype ", t,
                  " (this example takes float32, float16 and bfloat16; FP8 needs scale_inv)");
  }
}

// One NVTETensor handle over a torch tensor's memory (the memory stays torch's).
class Handle {
 public:
  explicit Handle(const at::Tensor &t) {
    std::vector<size_t> shape(t.sizes().begin(), t.sizes().end());
    check_status(nvte_comm_tensor_create_simple(t.data_ptr(), nvte_dtype(t.scalar_type()),
                                                shape.data(), shape.size(), &h_),
                 "nvte_comm_tensor_create_simple");
  }
  ~Handle() {
    if (h_ != nullptr) nvte_destroy_tensor(h_);
  }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  NVTETensor get() const { return h_; }

 private:
  NVTETensor h_ = nullptr;
};

void check_matrix(const at::Tensor &t, const char *name, const at::Tensor &like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (row-major)");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(),
              " but x has ", like.scalar_type());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but x is on ",
              like.device());
}

void check_bias(const c10::optional<at::Tensor> &bias, const at::Tensor &x) {
  if (!bias.has_value()) return;
  const at::Tensor &b = *bias;
  TORCH_CHECK(b.is_cuda() && b.dim() == 1 && b.is_contiguous(),
              "bias must be a contiguous 1-D CUDA tensor");
  TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.device() == x.device(),
              "bias must have x's dtype and device");
}

// A comm-GEMM context over a torch process group's NCCL communicator.
class CommGemm {
 public:
  // comm_ptr: pg._get_backend(torch.device("cuda"))._comm_ptr(); collective (every rank
  // of the group constructs it). `device`: the CUDA device of this rank.
  CommGemm(int64_t comm_ptr, int64_t nranks, int64_t rank, int64_t device)
      : nranks_(nranks), rank_(rank), device_(static_cast<c10::DeviceIndex>(device)) {
    TORCH_CHECK(comm_ptr != 0, "CommGemm: the communicator pointer is 0 (has the process "
                               "group's NCCL communicator been created yet?)");
    c10::cuda::CUDAGuard guard(device_);
    ctx_ = nvte_comm_gemm_ctx_create(reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comm_ptr)),
                                     static_cast<int32_t>(nranks), static_cast<int32_t>(rank));
    if (ctx_ == nullptr) {
      TORCH_CHECK(false, "nvte_comm_gemm_ctx_create failed (",
                  nvte_comm_status_string(nvte_comm_last_status()), "): ", nvte_comm_last_error());
    }
  }

  ~CommGemm() { close(); }
  CommGemm(const CommGemm &) = delete;
  CommGemm &operator=(const CommGemm &) = delete;

  // Destroys the context (waits, bounded, until the peers are done with its buffers).
  void close() {
    if (ctx_ != nullptr) {
      c10::cuda::CUDAGuard guard(device_);
      nvte_comm_gemm_ctx_destroy(ctx_);
      ctx_ = nullptr;
    }
  }

  int64_t numroc(int64_t global_size) {
    auto *ctx = live();
    const int64_t r = nvte_comm_gemm_numroc(ctx, global_size);
    check_last("nvte_comm_gemm_numroc");
    return r;
  }

  // y [n_global, m_local] = all_gather(x) @ weight.T (+ bias):
  // x [numroc(n_global), k] (this rank's tokens), weight [numroc(m_global), k],
  // bias [numroc(m_global)]. n_global / m_global < 0: x's / weight's rows times nranks.
  at::Tensor all_gather_gemm(const at::Tensor &x, const at::Tensor &weight,
                             const c10::optional<at::Tensor> &bias, int64_t n_global,
                             int64_t m_global) {
    auto *ctx = live();
    check_matrix(x, "x", x);
    check_matrix(weight, "weight", x);
    check_bias(bias, x);
    const int64_t k = x.size(1);
    if (n_global < 0) n_global = x.size(0) * nranks_;
    if (m_global < 0) m_global = weight.size(0) * nranks_;
    c10::cuda::CUDAGuard guard(x.device());
    // D's local shape follows the library's distribution of m (shapes of x and weight are
    // checked by the library, which names the offending argument).
    const int64_t m_local = weight.size(0);
    at::Tensor y = at::empty({n_global, m_local}, x.options());
    Handle a(weight), b(x), d(y);
    std::unique_ptr<Handle> hb;
    if (bias.has_value()) hb = std::make_unique<Handle>(*bias);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
    nvte_all_gather_gemm(ctx, m_global, n_global, k, a.get(), b.get(), d.get(),
                         hb ? hb->get() : nullptr, /*pre_act_out=*/nullptr, /*transa=*/true,
                         /*transb=*/false, /*grad=*/false, /*accumulate=*/false,
                         /*comm_sm_count=*/0, stream, kNVTECommGemmAlgoDefault);
    check_last("nvte_all_gather_gemm");
    return y;
  }

  // y [numroc(n), m] = this rank's rows of sum_over_ranks(x @ weight.T) (+ bias, once):
  // x [n, numroc(k_global)], weight [m, numroc(k_global)], bias [m].
  // k_global < 0: x's columns times nranks.
  at::Tensor gemm_reduce_scatter(const at::Tensor &x, const at::Tensor &weight,
                                 const c10::optional<at::Tensor> &bias, int64_t k_global) {
    auto *ctx = live();
    check_matrix(x, "x", x);
    check_matrix(weight, "weight", x);
    check_bias(bias, x);
    const int64_t n = x.size(0), m = weight.size(0);
    if (k_global < 0) k_global = x.size(1) * nranks_;
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t n_local = nvte_comm_gemm_numroc(ctx, n);
    check_last("nvte_comm_gemm_numroc");
    at::Tensor y = at::empty({n_local, m}, x.options());
    Handle a(weight), b(x), d(y);
    std::unique_ptr<Handle> hb;
    if (bias.has_value()) hb = std::make_unique<Handle>(*bias);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
    nvte_gemm_reduce_scatter(ctx, m, n, k_global, a.get(), b.get(), d.get(),
                             hb ? hb->get() : nullptr, /*pre_act_out=*/nullptr, /*transa=*/true,
                             /*transb=*/false, /*grad=*/false, /*accumulate=*/false,
                             /*comm_sm_count=*/0, stream, kNVTECommGemmAlgoDefault);
    check_last("nvte_gemm_reduce_scatter");
    return y;
  }

  int64_t nranks() const { return nranks_; }
  int64_t rank() const { return rank_; }
  bool closed() const { return ctx_ == nullptr; }

 private:
  NVTECommGemmCtx *live() const {
    TORCH_CHECK(ctx_ != nullptr, "CommGemm is closed");
    return ctx_;
  }

  NVTECommGemmCtx *ctx_ = nullptr;
  int64_t nranks_, rank_;
  c10::DeviceIndex device_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "transformer_engine_comm comm-GEMM calls on torch tensors (example extension)";
  m.def("version", [] { return std::string(nvte_comm_version()); },
        "Version of the linked libtransformer_engine_comm");
  m.def("live_tensor_count", [] { return static_cast<int64_t>(nvte_comm_live_tensor_count()); },
        "Live NVTETensor handles (leak check)");
  py::class_<CommGemm>(m, "CommGemm")
      .def(py::init<int64_t, int64_t, int64_t, int64_t>(), py::arg("comm_ptr"), py::arg("nranks"),
           py::arg("rank"), py::arg("device"))
      .def("close", &CommGemm::close)
      .def("numroc", &CommGemm::numroc, py::arg("global_size"))
      .def("all_gather_gemm", &CommGemm::all_gather_gemm, py::arg("x"), py::arg("weight"),
           py::arg("bias") = py::none(), py::arg("n_global") = -1, py::arg("m_global") = -1)
      .def("gemm_reduce_scatter", &CommGemm::gemm_reduce_scatter, py::arg("x"), py::arg("weight"),
           py::arg("bias") = py::none(), py::arg("k_global") = -1)
      .def_property_readonly("nranks", &CommGemm::nranks)
      .def_property_readonly("rank", &CommGemm::rank)
      .def_property_readonly("closed", &CommGemm::closed);
}
