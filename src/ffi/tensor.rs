//! TE's tensor API (transformer_engine.h): same names, signatures and enum values.
use super::enums::{NVTEDType, NVTEScalingMode, NVTETensorParam};
use super::handles;

use crate::cuda::DevPtr;
use crate::error::Result;
use crate::invalid;
use crate::tensor::{BlockMode, Buffer, DType, MAX_DIMS, Shape, Tensor};
use std::ffi::c_void;

/// Opaque tensor handle (TE: `typedef void *NVTETensor;`).
pub type NVTETensor = *mut c_void;

/// Shape of a tensor (TE's NVTEShape).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NVTEShape {
    pub data: [usize; 15],
    pub ndim: usize,
}

/// One buffer of a tensor: device pointer, element type and shape (TE's NVTEBasicTensor).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NVTEBasicTensor {
    pub data_ptr: *mut c_void,
    pub dtype: NVTEDType,
    pub shape: NVTEShape,
}

const _: () = assert!(MAX_DIMS == 15);

impl NVTEShape {
    fn empty() -> Self {
        NVTEShape {
            data: [0; 15],
            ndim: 0,
        }
    }
    fn from_shape(s: &Shape) -> Self {
        NVTEShape {
            data: s.dims,
            ndim: s.ndim,
        }
    }
    fn to_shape(self, what: &str) -> Result<Shape> {
        if self.ndim > MAX_DIMS {
            invalid!(
                "{what}: ndim {} exceeds the maximum of {MAX_DIMS}",
                self.ndim
            );
        }
        Shape::new(&self.data[..self.ndim])
    }
}

impl NVTEBasicTensor {
    fn empty() -> Self {
        NVTEBasicTensor {
            data_ptr: std::ptr::null_mut(),
            dtype: NVTEDType::kNVTEFloat32,
            shape: NVTEShape::empty(),
        }
    }
    fn from_buffer(b: &Buffer) -> Self {
        NVTEBasicTensor {
            data_ptr: b.ptr.as_void(),
            dtype: b.dtype.to_c(),
            shape: NVTEShape::from_shape(&b.shape),
        }
    }
    fn to_buffer(self, what: &str) -> Result<Buffer> {
        let dtype = DType::from_c(self.dtype).map_err(|e| e.context(what))?;
        let shape = self.shape.to_shape(what)?;
        Buffer::new(DevPtr::from_c(self.data_ptr), dtype, shape).map_err(|e| e.context(what))
    }
}

fn h(t: NVTETensor) -> usize {
    t as usize
}

/// Create a tensor with the given scaling mode. Returns NULL (error recorded) for an
/// invalid or unsupported mode; NVTE_DELAYED_TENSOR_SCALING and NVTE_BLOCK_SCALING_1D /
/// _2D are implemented.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_create_tensor(scaling_mode: NVTEScalingMode) -> NVTETensor {
    entry!(or std::ptr::null_mut(), {
        create(scaling_mode).map(|id| id as NVTETensor)
    })
}

/// Destroy a tensor handle (the device memory it points to is the caller's). NULL is a
/// no-op, as in TE; a handle that is not live records an error.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_destroy_tensor(tensor: NVTETensor) {
    entry!(void, {
        if tensor.is_null() {
            Ok(())
        } else {
            handles::TENSORS.remove(h(tensor), "tensor").map(|_| ())
        }
    })
}

/// Build a shape from `ndim` sizes. ndim > 15 or a NULL `data` with ndim > 0 records an
/// error and returns an empty shape.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_make_shape(data: *const usize, ndim: usize) -> NVTEShape {
    entry!(or NVTEShape::empty(), {
        if ndim > MAX_DIMS {
            invalid!("argument `ndim` = {ndim} exceeds the maximum of {MAX_DIMS}");
        }
        if ndim > 0 && data.is_null() {
            invalid!("argument `data` is NULL with ndim = {ndim}");
        }
        let mut s = NVTEShape::empty();
        if ndim > 0 {
            // SAFETY: non-null and the caller promises `ndim` readable elements.
            let src = unsafe { std::slice::from_raw_parts(data, ndim) };
            s.data[..ndim].copy_from_slice(src);
        }
        s.ndim = ndim;
        Ok(s)
    })
}

fn with_param(tensor: NVTETensor, param: NVTETensorParam, value: &NVTEBasicTensor) -> Result<()> {
    let b = value.to_buffer("argument `param`")?;
    handles::TENSORS.update(h(tensor), "tensor", |t| t.set_param(param, b))
}

/// Set one component of a tensor (TE's legacy form, tensor passed by pointer).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_set_tensor_param(
    tensor: *mut NVTETensor,
    param_name: NVTETensorParam,
    param: *const NVTEBasicTensor,
) {
    entry!(void, {
        if tensor.is_null() {
            invalid!("argument `tensor` (NVTETensor*) is NULL");
        }
        if param.is_null() {
            invalid!("argument `param` is NULL");
        }
        // SAFETY: both pointers are non-null; the C contract makes them readable.
        let (t, p) = unsafe { (*tensor, &*param) };
        with_param(t, param_name, p)
    })
}

/// Get one component of a tensor; an invalid handle or param gives an empty tensor.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_get_tensor_param(
    tensor: NVTETensor,
    param_name: NVTETensorParam,
) -> NVTEBasicTensor {
    entry!(or NVTEBasicTensor::empty(), {
        let t = handles::TENSORS.get(h(tensor), "tensor")?;
        Ok(NVTEBasicTensor::from_buffer(t.param(param_name)?))
    })
}

/// Set one component; `buf` points to an NVTEBasicTensor of `size_in_bytes` bytes.
/// A NULL `buf` or a size smaller than sizeof(NVTEBasicTensor) is an error.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_set_tensor_param_v2(
    tensor: NVTETensor,
    param: NVTETensorParam,
    buf: *const c_void,
    size_in_bytes: usize,
) {
    entry!(void, {
        let need = std::mem::size_of::<NVTEBasicTensor>();
        if buf.is_null() {
            invalid!("argument `buf` is NULL");
        }
        if size_in_bytes < need {
            invalid!(
                "argument `size_in_bytes` = {size_in_bytes} is smaller than sizeof(NVTEBasicTensor) = {need} for {param}"
            );
        }
        // SAFETY: non-null and at least `need` bytes per the caller; read unaligned.
        let value = unsafe { std::ptr::read_unaligned(buf as *const NVTEBasicTensor) };
        with_param(tensor, param, &value)
    })
}

/// Get one component into `buf` (an NVTEBasicTensor of `size_in_bytes` bytes).
/// `*size_written` (when not NULL) receives the bytes written, or the bytes required when
/// `buf` is NULL (a size query, not an error). A too-small buffer is an error. On error
/// `*size_written` is 0 and a large enough `buf` holds an empty tensor.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_get_tensor_param_v2(
    tensor: NVTETensor,
    param: NVTETensorParam,
    buf: *mut c_void,
    size_in_bytes: usize,
    size_written: *mut usize,
) {
    entry!(void, {
        let write_size = |n: usize| {
            if !size_written.is_null() {
                // SAFETY: non-null output pointer supplied by the caller.
                unsafe { *size_written = n };
            }
        };
        // Defined on every path: 0 unless the value is written (or, with buf NULL, the size needed).
        write_size(0);
        let need = std::mem::size_of::<NVTEBasicTensor>();
        // On error a large enough `buf` holds an empty tensor (as nvte_get_tensor_param returns).
        if !buf.is_null() && size_in_bytes >= need {
            // SAFETY: non-null and at least `need` writable bytes per the caller.
            unsafe {
                std::ptr::write_unaligned(buf as *mut NVTEBasicTensor, NVTEBasicTensor::empty())
            };
        }
        let t = handles::TENSORS.get(h(tensor), "tensor")?;
        let value = NVTEBasicTensor::from_buffer(t.param(param)?);
        if buf.is_null() {
            write_size(need);
            return Ok(());
        }
        if size_in_bytes < need {
            invalid!(
                "argument `size_in_bytes` = {size_in_bytes} is smaller than sizeof(NVTEBasicTensor) = {need} for {param}"
            );
        }
        // SAFETY: non-null and at least `need` writable bytes per the caller.
        unsafe { std::ptr::write_unaligned(buf as *mut NVTEBasicTensor, value) };
        write_size(need);
        Ok(())
    })
}

fn get(tensor: NVTETensor) -> Result<Tensor> {
    handles::TENSORS.get(h(tensor), "tensor")
}

/// Row-wise data pointer (NULL on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_data(tensor: NVTETensor) -> *mut c_void {
    entry!(or std::ptr::null_mut(), {
        Ok(get(tensor)?.data.ptr.as_void())
    })
}

/// Column-wise data pointer (NULL on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_columnwise_data(tensor: NVTETensor) -> *mut c_void {
    entry!(or std::ptr::null_mut(), {
        Ok(get(tensor)?.columnwise_data.ptr.as_void())
    })
}

/// The shape the size queries report: the row-wise data's; a block-scaled tensor's
/// logical shape (TE's: with only column-wise data, that data's shape untransposed).
fn size_shape(t: &Tensor) -> Shape {
    t.block_logical_shape().unwrap_or(t.data.shape)
}

/// Shape of the row-wise data (of the column-wise data when only that is set; a
/// block-scaled tensor's logical shape, untransposed, as TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_shape(tensor: NVTETensor) -> NVTEShape {
    entry!(or NVTEShape::empty(), {
        let t = get(tensor)?;
        if let Some(s) = t.block_logical_shape() {
            return Ok(NVTEShape::from_shape(&s));
        }
        let b = if t.data.ptr.is_null() && !t.columnwise_data.ptr.is_null() {
            &t.columnwise_data
        } else {
            &t.data
        };
        Ok(NVTEShape::from_shape(&b.shape))
    })
}

/// Shape of the column-wise data.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_columnwise_shape(tensor: NVTETensor) -> NVTEShape {
    entry!(or NVTEShape::empty(), {
        Ok(NVTEShape::from_shape(&get(tensor)?.columnwise_data.shape))
    })
}

/// Number of dimensions (0 on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_ndims(tensor: NVTETensor) -> usize {
    entry!(or 0, { Ok(size_shape(&get(tensor)?).ndim) })
}

/// Size of dimension `dim` (0 with an error recorded when `dim` is out of range).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_size(tensor: NVTETensor, dim: usize) -> usize {
    entry!(or 0, {
        let shape = size_shape(&get(tensor)?);
        let s = shape.as_slice();
        match s.get(dim) {
            Some(&d) => Ok(d),
            None => invalid!(
                "argument `dim` = {dim} is out of range for a tensor of ndim {}",
                s.len()
            ),
        }
    })
}

/// Number of elements (0 on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_numel(tensor: NVTETensor) -> usize {
    entry!(or 0, {
        Ok(size_shape(&get(tensor)?).checked_numel().unwrap_or(0))
    })
}

/// Bytes per element (0 on error, and for sub-byte types: see nvte_tensor_element_size_bits).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_element_size(tensor: NVTETensor) -> usize {
    entry!(or 0, {
        Ok(get(tensor)?.data.dtype.bits() / 8)
    })
}

/// Bits per element (0 on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_element_size_bits(tensor: NVTETensor) -> usize {
    entry!(or 0, {
        Ok(get(tensor)?.data.dtype.bits())
    })
}

/// Element type of the data (kNVTENumTypes on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_type(tensor: NVTETensor) -> NVTEDType {
    entry!(or NVTEDType::kNVTENumTypes, {
        Ok(get(tensor)?.data.dtype.to_c())
    })
}

/// Scaling mode (NVTE_INVALID_SCALING on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_scaling_mode(tensor: NVTETensor) -> NVTEScalingMode {
    entry!(or NVTEScalingMode::NVTE_INVALID_SCALING, {
        Ok(NVTEScalingMode(get(tensor)?.scaling_mode))
    })
}

/// Device pointer of the float32 amax (NULL when unset or on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_amax(tensor: NVTETensor) -> *mut f32 {
    entry!(or std::ptr::null_mut(), {
        Ok(get(tensor)?.amax.ptr.as_void() as *mut f32)
    })
}

/// Device pointer of the float32 scale (NULL when unset or on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_scale(tensor: NVTETensor) -> *mut f32 {
    entry!(or std::ptr::null_mut(), {
        Ok(get(tensor)?.scale.ptr.as_void() as *mut f32)
    })
}

/// Device pointer of the float32 scale inverse (NULL when unset or on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_scale_inv(tensor: NVTETensor) -> *mut f32 {
    entry!(or std::ptr::null_mut(), {
        Ok(get(tensor)?.scale_inv.ptr.as_void() as *mut f32)
    })
}

/// Shape of the row-wise scale inverse.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_tensor_scale_inv_shape(tensor: NVTETensor) -> NVTEShape {
    entry!(or NVTEShape::empty(), {
        Ok(NVTEShape::from_shape(&get(tensor)?.scale_inv.shape))
    })
}

/// Number of live tensor handles (for leak checks in tests).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_live_tensor_count() -> usize {
    entry!(plain, { handles::TENSORS.len() })
}

/// Convenience for C callers: create a delayed-scaling tensor over `data` with the
/// given dtype and shape in one call. Returns a status; `*out` is NULL on failure.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_tensor_create_simple(
    data: *mut c_void,
    dtype: NVTEDType,
    shape: *const usize,
    ndim: usize,
    out: *mut NVTETensor,
) -> super::NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        // SAFETY: non-null output pointer.
        unsafe { *out = std::ptr::null_mut() };
        if ndim > 0 && shape.is_null() {
            invalid!("argument `shape` is NULL with ndim = {ndim}");
        }
        if ndim > MAX_DIMS {
            invalid!("argument `ndim` = {ndim} exceeds the maximum of {MAX_DIMS}");
        }
        // SAFETY: non-null with ndim readable elements per the caller.
        let dims = if ndim == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(shape, ndim) }
        };
        let b = Buffer::new(
            DevPtr::from_c(data),
            DType::from_c(dtype)?,
            Shape::new(dims)?,
        )?;
        let id = create(NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING)?;
        handles::TENSORS.update(id, "tensor", |t| {
            t.set_param(NVTETensorParam::kNVTERowwiseData, b)
        })?;
        // SAFETY: non-null output pointer.
        unsafe { *out = id as NVTETensor };
        Ok(())
    })
}

// ---------------------------------------------------------------- the C view of the core types

impl DType {
    pub(crate) fn from_c(t: NVTEDType) -> Result<DType> {
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
    pub(crate) fn to_c(self) -> NVTEDType {
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
}

impl Tensor {
    pub(crate) fn param(&self, p: NVTETensorParam) -> Result<&Buffer> {
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
    pub(crate) fn param_mut(&mut self, p: NVTETensorParam) -> Result<&mut Buffer> {
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
    /// Set a component, checking what TE's delayed scaling requires of it, or (a
    /// block-scaled tensor) what TE's FP8 block scaling does.
    pub(crate) fn set_param(&mut self, p: NVTETensorParam, b: Buffer) -> Result<()> {
        let is_scalar_param = matches!(
            p,
            NVTETensorParam::kNVTEScale
                | NVTETensorParam::kNVTEAmax
                | NVTETensorParam::kNVTERowwiseScaleInv
                | NVTETensorParam::kNVTEColumnwiseScaleInv
                | NVTETensorParam::kNVTEColumnwiseAmax
        );
        if let Some(mode) = self.block_mode() {
            check_block_param(mode, p, &b)?;
        } else if is_scalar_param
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
}

/// What TE's FP8 block scaling accepts for a component: data FP8 (quantized) or high
/// precision (float32 / bfloat16 / float16); scale inverses float32 of 2 dimensions (their
/// exact shape is checked against the data where the tensor is used); scale and amax
/// (unused by block scaling) float32.
fn check_block_param(mode: BlockMode, p: NVTETensorParam, b: &Buffer) -> Result<()> {
    let set = !b.ptr.is_null();
    match p {
        NVTETensorParam::kNVTERowwiseData | NVTETensorParam::kNVTEColumnwiseData => {
            if !(b.dtype.is_fp8() || b.dtype.is_high_precision()) {
                invalid!(
                    "{p} of a {} tensor must be FP8 (kNVTEFloat8E4M3 / kNVTEFloat8E5M2) or float32 / bfloat16 / float16, got {}",
                    mode.name(),
                    b.dtype.name()
                );
            }
        }
        NVTETensorParam::kNVTERowwiseScaleInv | NVTETensorParam::kNVTEColumnwiseScaleInv => {
            if b.dtype != DType::F32 {
                invalid!(
                    "{p} of a {} tensor must be kNVTEFloat32, got {}",
                    mode.name(),
                    b.dtype.name()
                );
            }
            if set && b.shape.ndim != 2 {
                invalid!(
                    "{p} of a {} tensor must have 2 dimensions, got shape {}",
                    mode.name(),
                    b.shape
                );
            }
        }
        _ => {
            if b.dtype != DType::F32 {
                invalid!(
                    "{p} of a {} tensor must be kNVTEFloat32, got {}",
                    mode.name(),
                    b.dtype.name()
                );
            }
        }
    }
    Ok(())
}

/// A new tensor (no components) in the handle table: delayed (per-tensor) scaling or FP8
/// block scaling (1D / 2D).
pub(crate) fn create(scaling_mode: NVTEScalingMode) -> Result<usize> {
    match scaling_mode {
        NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING
        | NVTEScalingMode::NVTE_BLOCK_SCALING_1D
        | NVTEScalingMode::NVTE_BLOCK_SCALING_2D => {}
        m if m.name().is_some() && m != NVTEScalingMode::NVTE_INVALID_SCALING => {
            crate::unsupported!(
                "scaling mode {m} is not supported: NVTE_DELAYED_TENSOR_SCALING (per-tensor) and NVTE_BLOCK_SCALING_1D / _2D (FP8 block scaling) are implemented"
            )
        }
        m => invalid!("scaling_mode {m} is not a valid NVTEScalingMode"),
    }
    Ok(handles::TENSORS.insert(Tensor {
        scaling_mode: scaling_mode.0,
        ..Default::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(dtype: NVTEDType, dims: &[usize]) -> NVTEBasicTensor {
        let mut shape = NVTEShape::empty();
        shape.data[..dims.len()].copy_from_slice(dims);
        shape.ndim = dims.len();
        NVTEBasicTensor {
            data_ptr: 0x1000 as *mut c_void,
            dtype,
            shape,
        }
    }

    #[test]
    fn block_tensors_are_created_and_their_components_checked() {
        for mode in [
            NVTEScalingMode::NVTE_BLOCK_SCALING_1D,
            NVTEScalingMode::NVTE_BLOCK_SCALING_2D,
        ] {
            let id = create(mode).unwrap();
            let t = id as NVTETensor;
            let ok = |p, b: NVTEBasicTensor| with_param(t, p, &b);
            ok(
                NVTETensorParam::kNVTERowwiseData,
                basic(NVTEDType::kNVTEFloat8E4M3, &[256, 384]),
            )
            .unwrap();
            ok(
                NVTETensorParam::kNVTEColumnwiseData,
                basic(NVTEDType::kNVTEFloat8E4M3, &[384, 256]),
            )
            .unwrap();
            ok(
                NVTETensorParam::kNVTERowwiseData,
                basic(NVTEDType::kNVTEBFloat16, &[256, 384]),
            )
            .unwrap();
            ok(
                NVTETensorParam::kNVTERowwiseScaleInv,
                basic(NVTEDType::kNVTEFloat32, &[3, 256]),
            )
            .unwrap();
            let e = ok(
                NVTETensorParam::kNVTERowwiseData,
                basic(NVTEDType::kNVTEInt32, &[256, 384]),
            )
            .unwrap_err();
            assert!(e.to_string().contains("must be FP8"), "{e}");
            let e = ok(
                NVTETensorParam::kNVTEColumnwiseScaleInv,
                basic(NVTEDType::kNVTEFloat8E8M0, &[2, 384]),
            )
            .unwrap_err();
            assert!(e.to_string().contains("must be kNVTEFloat32"), "{e}");
            let e = ok(
                NVTETensorParam::kNVTERowwiseScaleInv,
                basic(NVTEDType::kNVTEFloat32, &[768]),
            )
            .unwrap_err();
            assert!(e.to_string().contains("2 dimensions"), "{e}");
            let got = handles::TENSORS.get(id, "tensor").unwrap();
            assert_eq!(
                got.scale_inv.shape.as_slice(),
                [3, 256],
                "a refused value changes nothing"
            );
            assert_eq!(got.data.dtype, DType::BF16);
            assert_eq!(got.block_mode().unwrap().scaling_mode(), mode.0);
            handles::TENSORS.remove(id, "tensor").unwrap();
        }
        // Columnwise data only: the sizes are the logical (untransposed) shape's, as TE's.
        let id = create(NVTEScalingMode::NVTE_BLOCK_SCALING_1D).unwrap();
        let t = id as NVTETensor;
        let cw = basic(NVTEDType::kNVTEFloat8E4M3, &[384, 2, 128]);
        with_param(t, NVTETensorParam::kNVTEColumnwiseData, &cw).unwrap();
        let s = nvte_tensor_shape(t);
        assert_eq!(&s.data[..s.ndim], [2, 128, 384]);
        assert_eq!(nvte_tensor_ndims(t), 3);
        assert_eq!(nvte_tensor_size(t, 2), 384);
        assert_eq!(nvte_tensor_numel(t), 256 * 384);
        let s = nvte_tensor_columnwise_shape(t);
        assert_eq!(&s.data[..s.ndim], [384, 2, 128]);
        handles::TENSORS.remove(id, "tensor").unwrap();
        let e = create(NVTEScalingMode::NVTE_MXFP8_1D_SCALING).unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
    }
}
