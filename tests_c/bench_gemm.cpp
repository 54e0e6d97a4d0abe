// GEMM throughput through nvte_cublas_gemm on every rank's GPU (one rank per GPU):
// bf16 and FP8 (e4m3 x e4m3 -> bf16, fast accumulation) on the square 8192 problem and
// the GEMM shapes of the overlap anchors. Random inputs, CUDA events, warm-up, median
// of many runs. Prints a table (rank 0) and writes it to --out FILE if given.
#include <algorithm>
#include <vector>

#include "test_util.hpp"

using namespace tu;

struct Shape { const char *name; size_t m, n, k; };  // cuBLAS terms: D[n, m] = B[n, k] . A[m, k]^T

static double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  int rank, size, ndev;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(rank % ndev));
  const char *out_path = nullptr;
  int iters = 50;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--out")) out_path = argv[i + 1];
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (nvte_comm_check_runtime() != NVTE_COMM_SUCCESS) {
    std::fprintf(stderr, "rank %d: %s\n", rank, nvte_comm_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  // M tokens x K x N (out features), TN: A = weight [N, K], B = input [M, K], D = [M, N].
  const Shape shapes[] = {
      {"square 8192", 8192, 8192, 8192},
      {"AG1 tp1 8192x8192x28672", 28672, 8192, 8192},
      {"AG2 tp1 8192x4096x16384", 16384, 8192, 4096},
      {"AG3 tp1 16384x8192x8192", 8192, 16384, 8192},
  };
  const NVTEDType types[] = {kNVTEBFloat16, kNVTEFloat8E4M3};
  DevBuf workspace(32u << 20);
  Tensor ws(kNVTEByte, {workspace.bytes});
  {
    NVTEBasicTensor wb = basic(workspace.p, kNVTEByte, {workspace.bytes});
    nvte_set_tensor_param_v2(ws.h, kNVTERowwiseData, &wb, sizeof wb);
  }
  std::string table;
  char line[256];
  std::snprintf(line, sizeof line, "| rank | dtype | shape (m x n x k) | ms (median of %d) | TFLOP/s |\n|---|---|---|---|---|\n", iters);
  table += line;
  bool ok = true;
  for (NVTEDType t : types)
    for (const Shape &s : shapes) {
      Tensor A(t, {s.m, s.k}), B(t, {s.n, s.k}), D(kNVTEBFloat16, {s.n, s.m});
      if (is_fp8(t)) { A.set_scale(1.0f); B.set_scale(1.0f); }
      nvte_comm_fill_uniform(A.h, 1 + rank, -1.0f, 1.0f, stream);
      nvte_comm_fill_uniform(B.h, 1001 + rank, -1.0f, 1.0f, stream);
      auto gemm = [&] {
        nvte_cublas_gemm(A.h, B.h, D.h, nullptr, nullptr, true, false, false, ws.h, false, /*split_acc=*/!is_fp8(t), 0, stream);
      };
      gemm();
      if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) {
        std::fprintf(stderr, "rank %d: %s\n", rank, nvte_comm_last_error());
        ok = false;
        continue;
      }
      for (int i = 0; i < 10; ++i) gemm();
      std::vector<cudaEvent_t> ev(2 * iters);
      for (auto &e : ev) CUDA_OK(cudaEventCreate(&e));
      for (int i = 0; i < iters; ++i) {
        CUDA_OK(cudaEventRecord(ev[2 * i], stream));
        gemm();
        CUDA_OK(cudaEventRecord(ev[2 * i + 1], stream));
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      std::vector<float> ms(iters);
      for (int i = 0; i < iters; ++i) CUDA_OK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
      for (auto &e : ev) cudaEventDestroy(e);
      double med = median(ms);
      double tflops = 2.0 * s.m * s.n * s.k / (med * 1e-3) / 1e12;
      std::snprintf(line, sizeof line, "| %d | %s | %s (%zux%zux%zu) | %.3f | %.1f |\n", rank, dtype_name(t), s.name, s.m, s.n, s.k, med, tflops);
      table += line;
    }
  // Gather the rows on rank 0 in rank order.
  for (int r = 1; r < size; ++r) {
    if (rank == r) {
      int len = (int)table.size();
      MPI_Send(&len, 1, MPI_INT, 0, 0, MPI_COMM_WORLD);
      MPI_Send(table.data(), len, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
    } else if (rank == 0) {
      int len;
      MPI_Recv(&len, 1, MPI_INT, r, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      std::string part(len, '\0');
      MPI_Recv(&part[0], len, MPI_CHAR, r, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      table += part.substr(part.find("|---|---|---|---|---|\n") + 22);
    }
  }
  int all_ok = 0, mine = ok;
  MPI_Allreduce(&mine, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("%s", table.c_str());
    if (out_path) {
      FILE *f = std::fopen(out_path, "w");
      if (f) { std::fputs(table.c_str(), f); std::fclose(f); }
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
