//! TE-compatible tensors: element types, shapes, buffers. The C view (NVTEDType,
//! NVTETensorParam, the handles behind `NVTETensor`) is `ffi`'s.
use crate::cuda::DevPtr;
use crate::error::{Error, Result};
use crate::invalid;

pub const MAX_DIMS: usize = 15;

/// Element type (TE's NVTEDType; the C conversion is in `ffi`).
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
    /// TE's name of the type (its NVTEDType constant).
    pub fn name(self) -> &'static str {
        match self {
            DType::Byte => "kNVTEByte",
            DType::Int16 => "kNVTEInt16",
            DType::Int32 => "kNVTEInt32",
            DType::Int64 => "kNVTEInt64",
            DType::F32 => "kNVTEFloat32",
            DType::F16 => "kNVTEFloat16",
            DType::BF16 => "kNVTEBFloat16",
            DType::E4M3 => "kNVTEFloat8E4M3",
            DType::E5M2 => "kNVTEFloat8E5M2",
            DType::E8M0 => "kNVTEFloat8E8M0",
            DType::E2M1 => "kNVTEFloat4E2M1",
        }
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
    pub ptr: DevPtr,
    pub dtype: DType,
    pub shape: Shape,
}

impl Default for Buffer {
    fn default() -> Self {
        Buffer {
            ptr: DevPtr::NULL,
            dtype: DType::F32,
            shape: Shape::new(&[0]).unwrap(),
        }
    }
}

impl Buffer {
    /// Validated constructor: the element count and byte size must not overflow.
    pub fn new(ptr: DevPtr, dtype: DType, shape: Shape) -> Result<Buffer> {
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
        self.ptr.is_null() || self.numel() == 0
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
    /// TE's scaling mode (NVTEScalingMode value; only delayed scaling is created).
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
    /// Device pointer of a float32 scalar component, if set.
    pub fn scalar_ptr(b: &Buffer) -> Option<DevPtr> {
        if !b.ptr.is_null() && b.numel() >= 1 {
            Some(b.ptr)
        } else {
            None
        }
    }
}
