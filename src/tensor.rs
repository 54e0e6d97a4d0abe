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
    /// The high-precision types a quantization reads and a dequantization writes.
    pub fn is_high_precision(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
    /// Largest finite value of an FP8 type (TE's `TypeInfo::max_finite_value`).
    pub fn fp8_max(self) -> Option<f32> {
        match self {
            DType::E4M3 => Some(448.0),
            DType::E5M2 => Some(57344.0),
            _ => None,
        }
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
    /// Block scaling: the scale format to assume where the buffers' shapes fit both (set
    /// by a quantization that wrote the compact format).
    pub block_format: ScaleFormat,
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

// ------------------------------------------------------------------ FP8 block scaling

/// TE's FP8 block scaling (its `Float8BlockScaling` recipe): one float32 scale per 1x128
/// values along a row (1D, NVTE_BLOCK_SCALING_1D) or per 128x128 tile (2D,
/// NVTE_BLOCK_SCALING_2D) of the tensor flattened to 2-D ([rows, cols], rows the product
/// of the leading dimensions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockMode {
    /// 1x128 blocks (rowwise) / 128x1 blocks (columnwise), NVTE_BLOCK_SCALING_1D.
    OneD,
    /// 128x128 blocks in both directions, NVTE_BLOCK_SCALING_2D.
    TwoD,
}

/// Which copy of a block-scaled tensor: the rowwise data (blocks along rows) or the
/// columnwise data (blocks along columns, usually stored transposed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Rowwise,
    Columnwise,
}

/// Layout of a block-scaled tensor's data and scale inverses (TE's
/// `Float8BlockScaleTensorFormat`): GEMM-ready (columnwise data transposed, 1D scales
/// transposed and padded to a multiple of 4, as cuBLASLt reads them) or compact
/// (columnwise data as the input, scales neither transposed nor padded; 1D only: 2D
/// tensors are the same in both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ScaleFormat {
    #[default]
    GemmReady,
    Compact,
}

impl BlockMode {
    /// The block length of both modes (TE's `block_len`).
    pub(crate) const LEN: usize = 128;

    /// The block mode of a TE scaling mode value (None: not a block-scaling mode).
    pub fn from_scaling_mode(mode: u32) -> Option<BlockMode> {
        match mode {
            2 => Some(BlockMode::OneD),
            3 => Some(BlockMode::TwoD),
            _ => None,
        }
    }
    /// TE's NVTEScalingMode value.
    pub fn scaling_mode(self) -> u32 {
        match self {
            BlockMode::OneD => 2,
            BlockMode::TwoD => 3,
        }
    }
    /// TE's name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            BlockMode::OneD => "NVTE_BLOCK_SCALING_1D",
            BlockMode::TwoD => "NVTE_BLOCK_SCALING_2D",
        }
    }
    /// One block's extent (rows, cols) over the logical [rows, cols] matrix.
    pub fn block_dims(self, dir: Direction) -> (usize, usize) {
        match (self, dir) {
            (BlockMode::OneD, Direction::Rowwise) => (1, Self::LEN),
            (BlockMode::OneD, Direction::Columnwise) => (Self::LEN, 1),
            (BlockMode::TwoD, _) => (Self::LEN, Self::LEN),
        }
    }
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Rowwise => "rowwise",
            Direction::Columnwise => "columnwise",
        }
    }
}

impl ScaleFormat {
    /// From TE's `Float8BlockScaleTensorFormat` value (0 GEMM_READY, 1 COMPACT).
    pub fn from_value(v: i32) -> Result<ScaleFormat> {
        match v {
            0 => Ok(ScaleFormat::GemmReady),
            1 => Ok(ScaleFormat::Compact),
            v => invalid!(
                "Float8BlockScaleTensorFormat {v} is not valid (expected 0 GEMM_READY or 1 COMPACT)"
            ),
        }
    }
    pub fn value(self) -> i32 {
        match self {
            ScaleFormat::GemmReady => 0,
            ScaleFormat::Compact => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ScaleFormat::GemmReady => "GEMM_READY",
            ScaleFormat::Compact => "COMPACT",
        }
    }
}

fn blocks(n: usize) -> usize {
    n.div_ceil(BlockMode::LEN)
}

fn pad4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// The scale-inverse shapes of TE's definitions (`Float8BlockQuantizer.get_scale_shape`),
/// one function per mode / direction / format, over the logical [rows, cols].
pub mod scale_shape {
    use super::{blocks, pad4};
    /// 1D rowwise, GEMM-ready: [ceil(cols/128), pad4(rows)], transposed: entry (col
    /// block, row).
    pub fn one_d_rowwise_gemm_ready(rows: usize, cols: usize) -> [usize; 2] {
        [blocks(cols), pad4(rows)]
    }
    /// 1D rowwise, compact: [rows, ceil(cols/128)]: entry (row, col block).
    pub fn one_d_rowwise_compact(rows: usize, cols: usize) -> [usize; 2] {
        [rows, blocks(cols)]
    }
    /// 1D columnwise, GEMM-ready: [ceil(rows/128), pad4(cols)]: entry (row block, col).
    pub fn one_d_columnwise_gemm_ready(rows: usize, cols: usize) -> [usize; 2] {
        [blocks(rows), pad4(cols)]
    }
    /// 1D columnwise, compact: [ceil(rows/128), cols]: entry (row block, col).
    pub fn one_d_columnwise_compact(rows: usize, cols: usize) -> [usize; 2] {
        [blocks(rows), cols]
    }
    /// 2D rowwise (both formats): [ceil(rows/128), pad4(ceil(cols/128))]: entry (row
    /// block, col block).
    pub fn two_d_rowwise(rows: usize, cols: usize) -> [usize; 2] {
        [blocks(rows), pad4(blocks(cols))]
    }
    /// 2D columnwise (both formats): [ceil(cols/128), pad4(ceil(rows/128))]: entry (col
    /// block, row block), the rowwise scales transposed.
    pub fn two_d_columnwise(rows: usize, cols: usize) -> [usize; 2] {
        [blocks(cols), pad4(blocks(rows))]
    }
}

/// One direction of a block-scaled tensor: where its data's and scales' entries are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    pub mode: BlockMode,
    pub direction: Direction,
    pub format: ScaleFormat,
    /// The logical (high-precision) matrix: rows = product of the leading dimensions.
    pub rows: usize,
    pub cols: usize,
    /// The data is stored transposed ([cols, rows]): the GEMM-ready columnwise copy.
    pub transposed: bool,
    /// The scale inverse's shape (float32 entries).
    pub scale_shape: [usize; 2],
    /// Offset of the scale of logical block (row block, col block) = `rb * scale_strides.0
    /// + cb * scale_strides.1` (blocks of `block_dims()`).
    pub scale_strides: (usize, usize),
}

impl BlockLayout {
    /// The layout TE defines for `mode`, `direction` and `format` over [rows, cols].
    pub fn new(
        mode: BlockMode,
        direction: Direction,
        format: ScaleFormat,
        rows: usize,
        cols: usize,
    ) -> BlockLayout {
        use Direction::*;
        use ScaleFormat::*;
        let (transposed, scale_shape, scale_strides) = match (mode, direction, format) {
            (BlockMode::OneD, Rowwise, GemmReady) => {
                let s = scale_shape::one_d_rowwise_gemm_ready(rows, cols);
                (false, s, (1, s[1]))
            }
            (BlockMode::OneD, Rowwise, Compact) => {
                let s = scale_shape::one_d_rowwise_compact(rows, cols);
                (false, s, (s[1], 1))
            }
            (BlockMode::OneD, Columnwise, GemmReady) => {
                let s = scale_shape::one_d_columnwise_gemm_ready(rows, cols);
                (true, s, (s[1], 1))
            }
            (BlockMode::OneD, Columnwise, Compact) => {
                let s = scale_shape::one_d_columnwise_compact(rows, cols);
                (false, s, (s[1], 1))
            }
            (BlockMode::TwoD, Rowwise, _) => {
                let s = scale_shape::two_d_rowwise(rows, cols);
                (false, s, (s[1], 1))
            }
            (BlockMode::TwoD, Columnwise, _) => {
                let s = scale_shape::two_d_columnwise(rows, cols);
                (true, s, (1, s[1]))
            }
        };
        let format = if mode == BlockMode::TwoD {
            GemmReady
        } else {
            format
        };
        BlockLayout {
            mode,
            direction,
            format,
            rows,
            cols,
            transposed,
            scale_shape,
            scale_strides,
        }
    }
    /// One block's extent (rows, cols) over the logical matrix.
    pub fn block_dims(&self) -> (usize, usize) {
        self.mode.block_dims(self.direction)
    }
    /// Number of blocks (row blocks, col blocks) over the logical matrix.
    pub fn block_counts(&self) -> (usize, usize) {
        let (br, bc) = self.block_dims();
        (self.rows.div_ceil(br), self.cols.div_ceil(bc))
    }
    /// The 2-D shape the data is stored in.
    pub fn data_shape_2d(&self) -> [usize; 2] {
        if self.transposed {
            [self.cols, self.rows]
        } else {
            [self.rows, self.cols]
        }
    }
    /// Index into scale_inv of the scale of logical element (row, col).
    pub fn scale_index(&self, row: usize, col: usize) -> usize {
        let (br, bc) = self.block_dims();
        (row / br) * self.scale_strides.0 + (col / bc) * self.scale_strides.1
    }
    /// Number of float32 entries of the scale inverse.
    pub fn scale_numel(&self) -> usize {
        self.scale_shape[0] * self.scale_shape[1]
    }
}

impl Tensor {
    /// The block mode of a block-scaled tensor (None: another scaling mode).
    pub fn block_mode(&self) -> Option<BlockMode> {
        BlockMode::from_scaling_mode(self.scaling_mode)
    }

    /// The data and scale-inverse buffers of one direction.
    pub fn direction_buffers(&self, dir: Direction) -> (&Buffer, &Buffer) {
        match dir {
            Direction::Rowwise => (&self.data, &self.scale_inv),
            Direction::Columnwise => (&self.columnwise_data, &self.columnwise_scale_inv),
        }
    }

    /// The logical (high-precision) dimensions of a block-scaled tensor: the rowwise
    /// data's, else the columnwise data's read in `format` (transposed unless 1D compact).
    fn block_logical_dims(&self, mode: BlockMode, format: ScaleFormat) -> Vec<usize> {
        if !self.data.ptr.is_null() {
            return self.data.shape.as_slice().to_vec();
        }
        let c = self.columnwise_data.shape.as_slice();
        if (mode, format) == (BlockMode::OneD, ScaleFormat::Compact) || c.is_empty() {
            c.to_vec()
        } else {
            c[1..].iter().chain(&c[..1]).copied().collect()
        }
    }

    /// TE's logical shape of a block-scaled tensor (Tensor::shape()): the rowwise data's,
    /// else the columnwise data's untransposed (as stored in the 1D compact format). None
    /// for another scaling mode.
    pub fn block_logical_shape(&self) -> Option<Shape> {
        let mode = self.block_mode()?;
        Shape::new(&self.block_logical_dims(mode, self.block_format)).ok()
    }

    /// The layout of direction `dir` of a block-scaled tensor, checked against its
    /// buffers: None when that direction has no data; an error when the tensor is not
    /// block-scaled, or its data or (FP8 data) scale inverse fits no layout TE defines.
    /// Where the shapes fit both 1D formats, `block_format` decides.
    pub fn block_layout(&self, dir: Direction) -> Result<Option<BlockLayout>> {
        let Some(mode) = self.block_mode() else {
            invalid!(
                "tensor of scaling mode {} is not block-scaled",
                self.scaling_mode
            );
        };
        let (data, sinv) = self.direction_buffers(dir);
        if data.ptr.is_null() {
            return Ok(None);
        }
        let formats: &[ScaleFormat] = match mode {
            BlockMode::OneD => &[ScaleFormat::GemmReady, ScaleFormat::Compact],
            BlockMode::TwoD => &[ScaleFormat::GemmReady],
        };
        let mut fits = Vec::with_capacity(2);
        let mut expected = Vec::with_capacity(2);
        for &f in formats {
            let dims = self.block_logical_dims(mode, f);
            let Some((&cols, lead)) = dims.split_last() else {
                invalid!(
                    "{} data of a block-scaled tensor has no dimensions",
                    dir.name()
                );
            };
            let l = BlockLayout::new(mode, dir, f, lead.iter().product(), cols);
            let want: Vec<usize> = if l.transposed {
                dims[dims.len() - 1..].iter().chain(lead).copied().collect()
            } else {
                dims.clone()
            };
            let scale_ok = !data.dtype.is_fp8()
                || (!sinv.ptr.is_null() && sinv.shape.as_slice() == l.scale_shape);
            if data.shape.as_slice() == want && scale_ok {
                fits.push(l);
            }
            expected.push(format!(
                "{}: data {want:?}, scale_inv {:?}",
                f.name(),
                l.scale_shape
            ));
        }
        match fits.as_slice() {
            [l] => Ok(Some(*l)),
            [a, b] => Ok(Some(if b.format == self.block_format {
                *b
            } else {
                *a
            })),
            _ => invalid!(
                "{} {} data of shape {} with scale_inv of shape {}{} fits no layout of TE's (expected {})",
                mode.name(),
                dir.name(),
                data.shape,
                sinv.shape,
                if sinv.ptr.is_null() { " (not set)" } else { "" },
                expected.join("; or ")
            ),
        }
    }
}

#[cfg(test)]
mod block_tests {
    use super::*;

    /// TE's `Float8BlockQuantizer.get_scale_shape` (with the compact format of its
    /// all-gather usage), written out as TE states it over [M, K].
    fn te_scale_shape(dim: u32, columnwise: bool, compact: bool, m: usize, k: usize) -> [usize; 2] {
        let ceil = |a: usize| a.div_ceil(128);
        let round4 = |a: usize| a.div_ceil(4) * 4;
        if dim == 2 {
            return if columnwise {
                [ceil(k), round4(ceil(m))]
            } else {
                [ceil(m), round4(ceil(k))]
            };
        }
        if columnwise {
            [ceil(m), if compact { k } else { round4(k) }]
        } else if compact {
            [m, ceil(k)]
        } else {
            [ceil(k), round4(m)]
        }
    }

    const SIZES: &[(usize, usize)] = &[
        (128, 128),
        (256, 384),
        (1152, 640),
        (4096, 7168),
        (1, 1),
        (3, 129),
        (130, 4),
        (127, 1000),
        (8192, 8192),
    ];

    #[test]
    fn scale_shapes_are_te_definitions() {
        for &(m, k) in SIZES {
            for (dim, mode) in [(1, BlockMode::OneD), (2, BlockMode::TwoD)] {
                for (col, dir) in [(false, Direction::Rowwise), (true, Direction::Columnwise)] {
                    for (compact, f) in [
                        (false, ScaleFormat::GemmReady),
                        (true, ScaleFormat::Compact),
                    ] {
                        let l = BlockLayout::new(mode, dir, f, m, k);
                        assert_eq!(
                            l.scale_shape,
                            te_scale_shape(dim, col, compact, m, k),
                            "{mode:?} {dir:?} {f:?} {m}x{k}"
                        );
                    }
                }
            }
        }
        // A few spelled out.
        assert_eq!(scale_shape::one_d_rowwise_gemm_ready(130, 300), [3, 132]);
        assert_eq!(scale_shape::one_d_columnwise_gemm_ready(130, 302), [2, 304]);
        assert_eq!(scale_shape::one_d_rowwise_compact(130, 300), [130, 3]);
        assert_eq!(scale_shape::one_d_columnwise_compact(130, 302), [2, 302]);
        assert_eq!(scale_shape::two_d_rowwise(1152, 640), [9, 8]);
        assert_eq!(scale_shape::two_d_columnwise(1152, 640), [5, 12]);
    }

    /// Every scale index lands inside the scale tensor, every block has one distinct
    /// entry, and each entry sits where TE's kernels write it.
    #[test]
    fn scale_indices_cover_each_block_once_where_te_writes_them() {
        for &(m, k) in &[(256, 384), (130, 300), (1, 129)] {
            for mode in [BlockMode::OneD, BlockMode::TwoD] {
                for dir in [Direction::Rowwise, Direction::Columnwise] {
                    for f in [ScaleFormat::GemmReady, ScaleFormat::Compact] {
                        let l = BlockLayout::new(mode, dir, f, m, k);
                        let (br, bc) = l.block_dims();
                        let (nr, nc) = l.block_counts();
                        let mut seen = std::collections::HashSet::new();
                        for rb in 0..nr {
                            for cb in 0..nc {
                                let i = l.scale_index(rb * br, cb * bc);
                                assert!(i < l.scale_numel());
                                assert!(
                                    seen.insert(i),
                                    "{mode:?} {dir:?} {f:?}: block ({rb},{cb}) twice"
                                );
                                // TE: 1D GEMM-ready rowwise scale (col block, row); the columnwise
                                // one (row block, col); 2D (row block, col block) and its transpose.
                                let s1 = l.scale_shape[1];
                                let te = match (mode, dir, l.format) {
                                    (
                                        BlockMode::OneD,
                                        Direction::Rowwise,
                                        ScaleFormat::GemmReady,
                                    ) => cb * s1 + rb,
                                    (BlockMode::OneD, Direction::Rowwise, ScaleFormat::Compact) => {
                                        rb * s1 + cb
                                    }
                                    (BlockMode::OneD, Direction::Columnwise, _) => rb * s1 + cb,
                                    (BlockMode::TwoD, Direction::Rowwise, _) => rb * s1 + cb,
                                    (BlockMode::TwoD, Direction::Columnwise, _) => cb * s1 + rb,
                                };
                                assert_eq!(i, te, "{mode:?} {dir:?} {f:?} block ({rb},{cb})");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn data_layouts() {
        let l = BlockLayout::new(
            BlockMode::OneD,
            Direction::Columnwise,
            ScaleFormat::GemmReady,
            256,
            384,
        );
        assert!(l.transposed);
        assert_eq!(l.data_shape_2d(), [384, 256]);
        let l = BlockLayout::new(
            BlockMode::OneD,
            Direction::Columnwise,
            ScaleFormat::Compact,
            256,
            384,
        );
        assert!(!l.transposed);
        assert_eq!(l.data_shape_2d(), [256, 384]);
        let l = BlockLayout::new(
            BlockMode::TwoD,
            Direction::Columnwise,
            ScaleFormat::Compact,
            256,
            384,
        );
        assert!(
            l.transposed,
            "2D columnwise data is the transpose in both formats"
        );
        assert_eq!(l.format, ScaleFormat::GemmReady);
        assert_eq!(BlockMode::OneD.block_dims(Direction::Rowwise), (1, 128));
        assert_eq!(BlockMode::OneD.block_dims(Direction::Columnwise), (128, 1));
        assert_eq!(
            BlockMode::TwoD.block_dims(Direction::Columnwise),
            (128, 128)
        );
        assert_eq!(BlockMode::from_scaling_mode(2), Some(BlockMode::OneD));
        assert_eq!(BlockMode::from_scaling_mode(3), Some(BlockMode::TwoD));
        assert_eq!(BlockMode::from_scaling_mode(0), None);
        assert!(ScaleFormat::from_value(2).is_err());
    }

    fn buf(dtype: DType, dims: &[usize]) -> Buffer {
        Buffer::new(
            DevPtr::from_c(0x1000 as *mut std::ffi::c_void),
            dtype,
            Shape::new(dims).unwrap(),
        )
        .unwrap()
    }

    fn block_tensor(mode: BlockMode) -> Tensor {
        Tensor {
            scaling_mode: mode.scaling_mode(),
            ..Default::default()
        }
    }

    #[test]
    fn block_layout_reads_the_buffers() {
        // 1D, [2, 128, 384] = [256, 384]: both directions GEMM-ready.
        let mut t = block_tensor(BlockMode::OneD);
        t.data = buf(DType::E4M3, &[2, 128, 384]);
        t.scale_inv = buf(DType::F32, &[3, 256]);
        t.columnwise_data = buf(DType::E4M3, &[384, 2, 128]);
        t.columnwise_scale_inv = buf(DType::F32, &[2, 384]);
        let r = t.block_layout(Direction::Rowwise).unwrap().unwrap();
        assert_eq!(
            (r.rows, r.cols, r.format),
            (256, 384, ScaleFormat::GemmReady)
        );
        let c = t.block_layout(Direction::Columnwise).unwrap().unwrap();
        assert_eq!(
            (c.rows, c.cols, c.format, c.transposed),
            (256, 384, ScaleFormat::GemmReady, true)
        );
        // Compact: rowwise scales [rows, cols/128], columnwise data untransposed.
        t.scale_inv = buf(DType::F32, &[256, 3]);
        t.columnwise_data = buf(DType::E4M3, &[2, 128, 384]);
        assert_eq!(
            t.block_layout(Direction::Rowwise).unwrap().unwrap().format,
            ScaleFormat::Compact
        );
        let c = t.block_layout(Direction::Columnwise).unwrap().unwrap();
        assert_eq!((c.format, c.transposed), (ScaleFormat::Compact, false));
        // Columnwise only: the data is read in the recorded format.
        t.data = Buffer::default();
        t.scale_inv = Buffer::default();
        assert!(t.block_layout(Direction::Rowwise).unwrap().is_none());
        t.columnwise_data = buf(DType::E4M3, &[384, 256]);
        let c = t.block_layout(Direction::Columnwise).unwrap().unwrap();
        assert_eq!((c.rows, c.cols), (256, 384));
        // A wrong scale shape names what fits.
        t.columnwise_scale_inv = buf(DType::F32, &[3, 384]);
        let e = t
            .block_layout(Direction::Columnwise)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fits no layout") && e.contains("[2, 384]"),
            "{e}"
        );
        // Not block-scaled.
        assert!(Tensor::default().block_layout(Direction::Rowwise).is_err());
    }

    #[test]
    fn ambiguous_shapes_follow_the_recorded_format() {
        // [128, 16384]: GEMM-ready [128, 128] and compact [128, 128] rowwise scales.
        let mut t = block_tensor(BlockMode::OneD);
        t.data = buf(DType::E4M3, &[128, 16384]);
        t.scale_inv = buf(DType::F32, &[128, 128]);
        assert_eq!(
            t.block_layout(Direction::Rowwise).unwrap().unwrap().format,
            ScaleFormat::GemmReady
        );
        t.block_format = ScaleFormat::Compact;
        assert_eq!(
            t.block_layout(Direction::Rowwise).unwrap().unwrap().format,
            ScaleFormat::Compact
        );
        // 2D: one layout.
        let mut t = block_tensor(BlockMode::TwoD);
        t.data = buf(DType::E4M3, &[1152, 640]);
        t.scale_inv = buf(DType::F32, &[9, 8]);
        t.columnwise_data = buf(DType::E4M3, &[640, 1152]);
        t.columnwise_scale_inv = buf(DType::F32, &[5, 12]);
        assert!(t.block_layout(Direction::Rowwise).unwrap().is_some());
        assert!(
            t.block_layout(Direction::Columnwise)
                .unwrap()
                .unwrap()
                .transposed
        );
        // High-precision data needs no scale.
        let mut t = block_tensor(BlockMode::TwoD);
        t.data = buf(DType::BF16, &[256, 256]);
        assert!(t.block_layout(Direction::Rowwise).unwrap().is_some());
    }
}
