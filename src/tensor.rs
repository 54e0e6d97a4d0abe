//! TE-compatible tensors: element types, shapes, and the registry behind `NVTETensor`
//! handles. A handle is an opaque id (never a raw pointer), so a handle that was never
//! created or was already destroyed is always detected instead of dereferenced.
use crate::error::{Error, Result};
use crate::ffi::enums::{NVTEDType, NVTEScalingMode, NVTETensorParam};
use crate::invalid;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::RwLock;

pub const MAX_DIMS: usize = 15;

/// Element type (the Rust view of NVTEDType).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Byte,
    Int16,
    Int32,
    Int64,
    F32,
    F16,
    BF16,
    E4M3,
    E5M2,
    E8M0,
    E2M1,
}

impl DType {
    pub fn from_c(t: NVTEDType) -> Result<DType> {
        Ok(match t {
            NVTEDType::kNVTEByte => DType::Byte,
            NVTEDType::kNVTEInt16 => DType::Int16,
            NVTEDType::kNVTEInt32 => DType::Int32,
            NVTEDType::kNVTEInt64 => DType::Int64,
            NVTEDType::kNVTEFloat32 => DType::F32,
            NVTEDType::kNVTEFloat16 => DType::F16,
            NVTEDType::kNVTEBFloat16 => DType::BF16,
            NVTEDType::kNVTEFloat8E4M3 => DType::E4M3,
            NVTEDType::kNVTEFloat8E5M2 => DType::E5M2,
            NVTEDType::kNVTEFloat8E8M0 => DType::E8M0,
            NVTEDType::kNVTEFloat4E2M1 => DType::E2M1,
            other => invalid!("dtype {other} is not a valid NVTEDType (expected 0..=10)"),
        })
    }
    pub fn to_c(self) -> NVTEDType {
        match self {
            DType::Byte => NVTEDType::kNVTEByte,
            DType::Int16 => NVTEDType::kNVTEInt16,
            DType::Int32 => NVTEDType::kNVTEInt32,
            DType::Int64 => NVTEDType::kNVTEInt64,
            DType::F32 => NVTEDType::kNVTEFloat32,
            DType::F16 => NVTEDType::kNVTEFloat16,
            DType::BF16 => NVTEDType::kNVTEBFloat16,
            DType::E4M3 => NVTEDType::kNVTEFloat8E4M3,
            DType::E5M2 => NVTEDType::kNVTEFloat8E5M2,
            DType::E8M0 => NVTEDType::kNVTEFloat8E8M0,
            DType::E2M1 => NVTEDType::kNVTEFloat4E2M1,
        }
    }
    pub fn bits(self) -> usize {
        match self {
            DType::Byte | DType::E4M3 | DType::E5M2 | DType::E8M0 => 8,
            DType::Int16 | DType::F16 | DType::BF16 => 16,
            DType::Int32 | DType::F32 => 32,
            DType::Int64 => 64,
            DType::E2M1 => 4,
        }
    }
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::E4M3 | DType::E5M2)
    }
    pub fn name(self) -> &'static str {
        self.to_c().name().unwrap_or("?")
    }
}

/// Shape with TE's fixed capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub dims: [usize; MAX_DIMS],
    pub ndim: usize,
}

impl Shape {
    pub fn new(dims: &[usize]) -> Result<Shape> {
        if dims.len() > MAX_DIMS {
            invalid!("ndim {} exceeds the maximum of {MAX_DIMS}", dims.len());
        }
        let mut s = Shape {
            dims: [0; MAX_DIMS],
            ndim: dims.len(),
        };
        s.dims[..dims.len()].copy_from_slice(dims);
        Ok(s)
    }
    pub fn as_slice(&self) -> &[usize] {
        &self.dims[..self.ndim.min(MAX_DIMS)]
    }
    /// Number of elements, or an error when the product overflows.
    pub fn checked_numel(&self) -> Result<usize> {
        self.as_slice()
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "shape {:?} overflows: its element count exceeds usize",
                    self.as_slice()
                ))
            })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_slice())
    }
}

/// One buffer of a tensor (TE's SimpleTensor): device pointer, element type, shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Buffer {
    pub ptr: usize,
    pub dtype: DType,
    pub shape: Shape,
}

impl Default for Buffer {
    fn default() -> Self {
        Buffer {
            ptr: 0,
            dtype: DType::F32,
            shape: Shape::new(&[0]).unwrap(),
        }
    }
}

impl Buffer {
    /// Validated constructor: the element count and byte size must not overflow.
    pub fn new(ptr: usize, dtype: DType, shape: Shape) -> Result<Buffer> {
        let numel = shape.checked_numel()?;
        if numel.checked_mul(dtype.bits()).is_none() {
            invalid!(
                "shape {shape} of {} overflows: its byte size exceeds usize",
                dtype.name()
            );
        }
        Ok(Buffer { ptr, dtype, shape })
    }
    pub fn numel(&self) -> usize {
        self.shape.checked_numel().unwrap_or(0)
    }
    pub fn bytes(&self) -> usize {
        (self.numel() * self.dtype.bits()).div_ceil(8)
    }
    pub fn is_empty(&self) -> bool {
        self.ptr == 0 || self.numel() == 0
    }
    /// TE's 2D view: all leading dimensions flattened into rows, the last one is cols.
    pub fn rows_cols(&self) -> Option<(usize, usize)> {
        let s = self.shape.as_slice();
        if s.len() < 2 {
            return None;
        }
        Some((s[..s.len() - 1].iter().product(), s[s.len() - 1]))
    }
}

/// A TE tensor: row-wise data plus the optional components of FP8 scaling.
#[derive(Clone, Debug, Default)]
pub struct Tensor {
    pub scaling_mode: u32,
    pub data: Buffer,
    pub columnwise_data: Buffer,
    pub scale: Buffer,
    pub amax: Buffer,
    pub scale_inv: Buffer,
    pub columnwise_scale_inv: Buffer,
    pub columnwise_amax: Buffer,
}

impl Tensor {
    pub fn param(&self, p: NVTETensorParam) -> Result<&Buffer> {
        Ok(match p {
            NVTETensorParam::kNVTERowwiseData => &self.data,
            NVTETensorParam::kNVTEColumnwiseData => &self.columnwise_data,
            NVTETensorParam::kNVTEScale => &self.scale,
            NVTETensorParam::kNVTEAmax => &self.amax,
            NVTETensorParam::kNVTERowwiseScaleInv => &self.scale_inv,
            NVTETensorParam::kNVTEColumnwiseScaleInv => &self.columnwise_scale_inv,
            NVTETensorParam::kNVTEColumnwiseAmax => &self.columnwise_amax,
            other => invalid!("param {other} is not a valid NVTETensorParam (expected 0..=6)"),
        })
    }
    pub fn param_mut(&mut self, p: NVTETensorParam) -> Result<&mut Buffer> {
        Ok(match p {
            NVTETensorParam::kNVTERowwiseData => &mut self.data,
            NVTETensorParam::kNVTEColumnwiseData => &mut self.columnwise_data,
            NVTETensorParam::kNVTEScale => &mut self.scale,
            NVTETensorParam::kNVTEAmax => &mut self.amax,
            NVTETensorParam::kNVTERowwiseScaleInv => &mut self.scale_inv,
            NVTETensorParam::kNVTEColumnwiseScaleInv => &mut self.columnwise_scale_inv,
            NVTETensorParam::kNVTEColumnwiseAmax => &mut self.columnwise_amax,
            other => invalid!("param {other} is not a valid NVTETensorParam (expected 0..=6)"),
        })
    }
    /// Set a component, checking what TE's delayed scaling requires of it.
    pub fn set_param(&mut self, p: NVTETensorParam, b: Buffer) -> Result<()> {
        let is_scalar_param = matches!(
            p,
            NVTETensorParam::kNVTEScale
                | NVTETensorParam::kNVTEAmax
                | NVTETensorParam::kNVTERowwiseScaleInv
                | NVTETensorParam::kNVTEColumnwiseScaleInv
                | NVTETensorParam::kNVTEColumnwiseAmax
        );
        if is_scalar_param
            && self.scaling_mode == NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING.0
            && b.dtype != DType::F32
        {
            invalid!(
                "{p} of a delayed-scaling tensor must be kNVTEFloat32, got {}",
                b.dtype.name()
            );
        }
        *self.param_mut(p)? = b;
        Ok(())
    }
    /// Device pointer of a float32 scalar component, if set.
    pub fn scalar_ptr(b: &Buffer) -> Option<usize> {
        if b.ptr != 0 && b.numel() >= 1 {
            Some(b.ptr)
        } else {
            None
        }
    }
}

/// The handle registry.
static REGISTRY: Lazy<RwLock<HashMap<usize, Tensor>>> = Lazy::new(|| RwLock::new(HashMap::new()));

pub fn create(scaling_mode: NVTEScalingMode) -> Result<usize> {
    match scaling_mode {
        NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING => {}
        m if m.name().is_some() && m != NVTEScalingMode::NVTE_INVALID_SCALING => {
            crate::unsupported!(
                "scaling mode {m} is not supported: only NVTE_DELAYED_TENSOR_SCALING (per-tensor) is implemented"
            )
        }
        m => invalid!("scaling_mode {m} is not a valid NVTEScalingMode"),
    }
    let handle = crate::handle::next();
    let t = Tensor {
        scaling_mode: scaling_mode.0,
        ..Default::default()
    };
    REGISTRY
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(handle, t);
    Ok(handle)
}

fn check_handle(h: usize, what: &str) -> Result<()> {
    if h == 0 {
        invalid!("tensor `{what}` is NULL");
    }
    Ok(())
}

fn not_live(h: usize, what: &str) -> Error {
    Error::invalid(format!(
        "tensor `{what}` (NVTETensor {h:#x}) is not a live tensor: never created by nvte_create_tensor, or already destroyed"
    ))
}

pub fn destroy(h: usize, what: &str) -> Result<()> {
    check_handle(h, what)?;
    match REGISTRY
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&h)
    {
        Some(_) => Ok(()),
        None => Err(not_live(h, what)),
    }
}

/// A snapshot of the tensor behind a handle.
pub fn get(h: usize, what: &str) -> Result<Tensor> {
    check_handle(h, what)?;
    REGISTRY
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&h)
        .cloned()
        .ok_or_else(|| not_live(h, what))
}

/// A snapshot of an optional tensor: NULL gives None.
pub fn get_opt(h: usize, what: &str) -> Result<Option<Tensor>> {
    if h == 0 {
        Ok(None)
    } else {
        get(h, what).map(Some)
    }
}

pub fn update<R>(h: usize, what: &str, f: impl FnOnce(&mut Tensor) -> Result<R>) -> Result<R> {
    check_handle(h, what)?;
    let mut reg = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    let t = reg.get_mut(&h).ok_or_else(|| not_live(h, what))?;
    f(t)
}

pub fn live_count() -> usize {
    REGISTRY.read().unwrap_or_else(|e| e.into_inner()).len()
}
