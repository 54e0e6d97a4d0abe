//! transformer_engine_comm: tensor-parallel communication/GEMM overlap for NVIDIA GPUs
//! behind a Transformer-Engine-compatible C ABI.
//!
//! Layout: `ffi` (the only `extern "C"` code), `tensor` (TE tensors and handles),
//! `gemm` (cuBLASLt), `cuda` (driver, NVRTC, contexts), `kernels` (typed launches of
//! `kernels/*.cu`), `error` (status + message model), `env` (the `NVTE_COMM_*` knobs,
//! parsed strictly).
pub mod bootstrap;
pub mod comm_gemm;
pub mod cuda;
pub mod env;
pub mod error;
pub mod ffi;
pub mod gemm;
pub mod handle;
pub mod kernels;
pub mod overlap;
pub mod tensor;
pub mod transport;
