//! One-call form of the comm-GEMM API for bindings whose every foreign call is costly
//! (Python's ctypes): `nvte_comm_gemm_call_packed` takes the whole call — operation,
//! sizes, each operand's data pointer, dtype, shape and scaling pointers, flags and
//! stream — in one struct the caller fills once and updates per call, and returns a
//! status. No tensor handles are created or looked up; the arguments become the same
//! request value the C functions make (`super::comm_gemm::Request`) and take the same
//! path (`super::comm_gemm::run`): the checks, errors and core call of
//! `nvte_all_gather_gemm`, `nvte_gemm_reduce_scatter` and `nvte_gemm_all_reduce`.
use super::comm_gemm::NVTECommGemmCtx;
use super::comm_gemm::Request;
use super::cudaStream_t;
use super::enums::{NVTECommGemmAlgoType, NVTECommStatus, NVTEDType};
use crate::comm_gemm::Kind;
use crate::cuda::DevPtr;
use crate::error::Result;
use crate::invalid;
use crate::tensor::{Buffer, DType, Shape, Tensor};
use std::ffi::c_void;

/// `NVTECommGemmPacked::op` of the all-gather GEMM (`nvte_all_gather_gemm`).
pub const NVTE_COMM_GEMM_PACKED_ALL_GATHER: i32 = 0;
/// `NVTECommGemmPacked::op` of the GEMM reduce-scatter (`nvte_gemm_reduce_scatter`).
pub const NVTE_COMM_GEMM_PACKED_REDUCE_SCATTER: i32 = 1;
/// `NVTECommGemmPacked::op` of the GEMM all-reduce (`nvte_gemm_all_reduce`).
pub const NVTE_COMM_GEMM_PACKED_ALL_REDUCE: i32 = 2;
/// `NVTECommGemmPacked::op` of a local GEMM (`nvte_comm_cublas_gemm_packed`, i.e.
/// `nvte_cublas_gemm`).
pub const NVTE_COMM_GEMM_PACKED_GEMM: i32 = 3;

/// One operand of a packed call: a row-major device array with TE's per-tensor
/// (delayed) scaling. An operand with `data` NULL and no elements is absent (optional
/// operands only: bias, pre_act_out), as TE's empty tensors are.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NVTECommGemmOperand {
    /// device address of the elements (row-major, contiguous)
    pub data: *mut c_void,
    pub dtype: NVTEDType,
    /// 1 or 2 (0 only for an absent operand)
    pub ndim: u32,
    /// the sizes of the `ndim` dimensions (the rest ignored)
    pub shape: [usize; 2],
    /// device float32 scalars (NULL: none): 1/scale of FP8 data (inputs), and the scale
    /// and amax of an FP8 output
    pub scale_inv: *mut f32,
    pub scale: *mut f32,
    pub amax: *mut f32,
}

/// The arguments of one comm-GEMM call, with `nvte_all_gather_gemm`'s meanings (global
/// m, n, k; A, B, D local with nvte_cublas_gemm's layouts and this rank's shares).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NVTECommGemmPacked {
    /// NVTE_COMM_GEMM_PACKED_ALL_GATHER, _REDUCE_SCATTER or _ALL_REDUCE
    /// (nvte_comm_gemm_call_packed); NVTE_COMM_GEMM_PACKED_GEMM (nvte_comm_cublas_gemm_packed)
    pub op: i32,
    pub comm_sm_count: i32,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub a: NVTECommGemmOperand,
    pub b: NVTECommGemmOperand,
    pub d: NVTECommGemmOperand,
    pub bias: NVTECommGemmOperand,
    pub pre_act_out: NVTECommGemmOperand,
    pub transa: bool,
    pub transb: bool,
    pub grad: bool,
    pub accumulate: bool,
    pub algo: NVTECommGemmAlgoType,
    pub stream: cudaStream_t,
}

/// A float32 scalar operand (NULL: none).
pub(super) fn scalar(p: *mut f32) -> Result<Buffer> {
    if p.is_null() {
        return Ok(Buffer::default());
    }
    Buffer::new(DevPtr::from_c(p), DType::F32, Shape::new(&[1])?)
}

/// The core tensor of operand `o`, or None when it is optional and absent (NULL data, no
/// elements). A required operand may be empty (NULL data, a zero-sized dimension: a rank
/// whose share is empty); the core checks its shape.
fn operand(o: &NVTECommGemmOperand, what: &str, optional: bool) -> Result<Option<Tensor>> {
    if o.ndim > 2 {
        invalid!(
            "operand `{what}` has ndim = {}: packed operands have 1 or 2 dimensions",
            o.ndim
        );
    }
    let dims = &o.shape[..o.ndim as usize];
    let empty = o.ndim == 0 || dims.contains(&0);
    if optional && o.data.is_null() && empty {
        return Ok(None);
    }
    if o.ndim == 0 {
        invalid!(
            "operand `{what}` has ndim = 0: {}",
            if optional {
                "a present operand has 1 or 2 dimensions (absent: NULL data)"
            } else {
                "it is required (1 or 2 dimensions)"
            }
        );
    }
    let dtype = DType::from_c(o.dtype)
        .map_err(|e| crate::error::Error::invalid(format!("operand `{what}`: {}", e.msg)))?;
    Ok(Some(Tensor {
        data: Buffer::new(DevPtr::from_c(o.data), dtype, Shape::new(dims)?)?,
        scale_inv: scalar(o.scale_inv)?,
        scale: scalar(o.scale)?,
        amax: scalar(o.amax)?,
        ..Default::default()
    }))
}

/// The core tensors of a packed call's operands, in TE's order (the first bad one is
/// the one named): a, b and d (required), bias and pre_act_out (optional).
type CallOperands = (Tensor, Tensor, Tensor, Option<Tensor>, Option<Tensor>);

fn call_operands(p: &NVTECommGemmPacked) -> Result<CallOperands> {
    let required = |o: &NVTECommGemmOperand, what: &str| -> Result<Tensor> {
        operand(o, what, false)?
            .ok_or_else(|| crate::error::Error::invalid(format!("operand `{what}` is required")))
    };
    Ok((
        required(&p.a, "a")?,
        required(&p.b, "b")?,
        required(&p.d, "d")?,
        operand(&p.bias, "bias", true)?,
        operand(&p.pre_act_out, "pre_act_out", true)?,
    ))
}

/// Run the comm-GEMM call `args` describes on `ctx`: the all-gather GEMM, GEMM
/// reduce-scatter or GEMM all-reduce of `args->op`, exactly as the corresponding
/// `nvte_*` function with the same arguments (same checks, same algorithms, same
/// asynchronous work on `args->stream`). Operands are given by pointer, dtype and shape
/// instead of tensor handles. Returns the call's status (its message:
/// nvte_comm_last_error()); `*args` is only read, so the caller may keep one struct and
/// change the pointers and stream between calls.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_call_packed(
    ctx: *mut NVTECommGemmCtx,
    args: *const NVTECommGemmPacked,
) -> NVTECommStatus {
    entry!(status, {
        if args.is_null() {
            invalid!("argument `args` is NULL");
        }
        // SAFETY: non-null, points to the caller's struct (read as is; the enum fields are
        // transparent integers and bools are C bools).
        let p = unsafe { std::ptr::read_unaligned(args) };
        let kind = match p.op {
            NVTE_COMM_GEMM_PACKED_ALL_GATHER => Kind::AllGather,
            NVTE_COMM_GEMM_PACKED_REDUCE_SCATTER => Kind::ReduceScatter,
            NVTE_COMM_GEMM_PACKED_ALL_REDUCE => Kind::AllReduce,
            NVTE_COMM_GEMM_PACKED_GEMM => invalid!(
                "argument `args->op` = 3 is a local GEMM: nvte_comm_cublas_gemm_packed runs it (here: 0: all-gather, 1: reduce-scatter, 2: all-reduce)"
            ),
            v => invalid!(
                "argument `args->op` = {v} is not an operation (0: all-gather, 1: reduce-scatter, 2: all-reduce)"
            ),
        };
        // The operation picks the entry (as calling one of the three C functions); then the
        // context, before the other arguments, as every comm-GEMM entry point
        // (`super::comm_gemm::Request`).
        let ctx = super::comm_gemm::ctx(ctx)?;
        let (a, b, d, bias, pre_act_out) = call_operands(&p)?;
        super::comm_gemm::run(&Request {
            kind,
            ctx,
            m: p.m,
            n: p.n,
            k: p.k,
            a,
            b,
            d,
            bias,
            pre_act_out,
            b_gathered: None,
            transa: p.transa,
            transb: p.transb,
            grad: p.grad,
            accumulate: p.accumulate,
            comm_sm_count: p.comm_sm_count,
            algo: p.algo,
            algo_arg: "argument `args->algo`",
            stream: crate::ffi::stream_of(p.stream),
            prepare: false,
        })
    })
}

/// The workspace of a packed GEMM: `bytes` at `ptr` (NULL and 0: none).
fn workspace_tensor(ptr: *mut c_void, bytes: usize) -> Result<Option<Tensor>> {
    if ptr.is_null() {
        if bytes != 0 {
            invalid!("argument `workspace` is NULL with workspace_bytes = {bytes}");
        }
        return Ok(None);
    }
    Ok(Some(Tensor {
        data: Buffer::new(DevPtr::from_c(ptr), DType::Byte, Shape::new(&[bytes])?)?,
        ..Default::default()
    }))
}

/// `nvte_cublas_gemm` with its operands given as in a packed call: `args->op` must be
/// NVTE_COMM_GEMM_PACKED_GEMM; `a`, `b`, `d`, `bias`, `pre_act_out` (nvte_cublas_gemm's
/// pre_gelu_out), `transa`, `transb`, `grad`, `accumulate` and `stream` are read (m, n, k,
/// comm_sm_count and algo are not: the sizes follow from the operands, as there). The
/// workspace is `workspace_bytes` bytes at `workspace` (NULL and 0: none);
/// `use_split_accumulator` and `math_sm_count` are nvte_cublas_gemm's. Same checks,
/// epilogues and asynchronous work on `args->stream` as nvte_cublas_gemm with the same
/// arguments; returns the status (its message: nvte_comm_last_error()). `*args` is only
/// read: a binding keeps one struct per call signature and changes the pointers and the
/// stream between calls, with no tensor handles to create or look up.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_cublas_gemm_packed(
    args: *const NVTECommGemmPacked,
    workspace: *mut c_void,
    workspace_bytes: usize,
    use_split_accumulator: bool,
    math_sm_count: i32,
) -> NVTECommStatus {
    entry!(status, {
        if args.is_null() {
            invalid!("argument `args` is NULL");
        }
        // SAFETY: non-null, points to the caller's struct (read as is).
        let p = unsafe { std::ptr::read_unaligned(args) };
        if p.op != NVTE_COMM_GEMM_PACKED_GEMM {
            invalid!(
                "argument `args->op` = {} is not NVTE_COMM_GEMM_PACKED_GEMM (3): the communicating operations are nvte_comm_gemm_call_packed's",
                p.op
            );
        }
        let (a, b, d, bias, pre) = call_operands(&p)?;
        let ws = workspace_tensor(workspace, workspace_bytes)?;
        let g = crate::gemm::Operands {
            a: &a,
            b: &b,
            d: &d,
            bias: bias.as_ref(),
            pre_gelu_out: pre.as_ref(),
            transa: p.transa,
            transb: p.transb,
            grad: p.grad,
            workspace: ws.as_ref(),
            accumulate: p.accumulate,
            use_split_accumulator,
            math_sm_count,
        };
        // SAFETY: the packed call's pointers with the shapes and dtypes it declares
        // (validated by `call_operands`); its contract: device memory of those extents,
        // alive until the GEMM on its stream completes.
        let g = unsafe { crate::cuda::Checked::vouched(&g) };
        crate::gemm::cublas_gemm(g, crate::ffi::stream_of(p.stream))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(data: usize, dtype: NVTEDType, ndim: u32, shape: [usize; 2]) -> NVTECommGemmOperand {
        NVTECommGemmOperand {
            data: data as *mut c_void,
            dtype,
            ndim,
            shape,
            scale_inv: std::ptr::null_mut(),
            scale: std::ptr::null_mut(),
            amax: std::ptr::null_mut(),
        }
    }

    #[test]
    fn operands_map_to_core_tensors() {
        let bf = NVTEDType::kNVTEBFloat16;
        let mut o = op(0x1000, NVTEDType::kNVTEFloat8E4M3, 2, [4, 8]);
        o.scale_inv = 0x2000 as *mut f32;
        let t = operand(&o, "a", false).unwrap().unwrap();
        assert_eq!(t.data.rows_cols(), Some((4, 8)));
        assert_eq!(t.data.dtype, DType::E4M3);
        assert_eq!(
            Tensor::scalar_ptr(&t.scale_inv),
            Some(DevPtr::from_c(0x2000 as *const f32))
        );
        assert!(Tensor::scalar_ptr(&t.amax).is_none());
        // absent optional operands
        assert!(
            operand(&op(0, bf, 0, [0, 0]), "bias", true)
                .unwrap()
                .is_none()
        );
        assert!(
            operand(&op(0, bf, 1, [0, 7]), "bias", true)
                .unwrap()
                .is_none()
        );
        let e = operand(&op(0, bf, 0, [0, 0]), "a", false).unwrap_err();
        assert!(
            e.msg.contains("`a` has ndim = 0: it is required"),
            "{}",
            e.msg
        );
        // an empty required operand (a rank with no rows) is a tensor, not absent
        let t = operand(&op(0, bf, 2, [0, 64]), "b", false)
            .unwrap()
            .unwrap();
        assert_eq!(t.data.rows_cols(), Some((0, 64)));
        let e = operand(&op(0x10, bf, 3, [1, 1]), "b", false).unwrap_err();
        assert!(e.msg.contains("ndim = 3"), "{}", e.msg);
        let e = operand(&op(0x10, bf, 0, [1, 1]), "d", false).unwrap_err();
        assert!(e.msg.contains("ndim = 0"), "{}", e.msg);
        let e = operand(&op(0x10, NVTEDType(77), 2, [1, 1]), "d", false).unwrap_err();
        assert!(e.msg.contains("operand `d`"), "{}", e.msg);
        let e = operand(&op(0x10, bf, 2, [usize::MAX, 4]), "d", false).unwrap_err();
        assert!(e.msg.contains("overflow"), "{}", e.msg);
        // 1-D bias
        let t = operand(&op(0x10, bf, 1, [16, 99]), "bias", true)
            .unwrap()
            .unwrap();
        assert_eq!(t.data.numel(), 16);
    }

    #[test]
    fn packed_gemm_workspace() {
        assert!(workspace_tensor(std::ptr::null_mut(), 0).unwrap().is_none());
        let e = workspace_tensor(std::ptr::null_mut(), 64).unwrap_err();
        assert!(
            e.msg.contains("NULL with workspace_bytes = 64"),
            "{}",
            e.msg
        );
        let t = workspace_tensor(0x1000 as *mut c_void, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(t.data.dtype, DType::Byte);
        assert_eq!(t.data.numel(), 1 << 20);
    }
}
