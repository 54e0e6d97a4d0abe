//! Kernel entry points: TE's quantization API (cast.h, recipe.h, transpose.h and the
//! NVTEQuantizationConfig functions of transformer_engine.h) and a random fill used by
//! tests and benchmarks.
use super::enums::NVTEQuantizationConfigAttribute;
use super::enums::NVTEQuantizationConfigAttribute as Attr;
use super::handles::{TENSORS, Table};
use super::{NVTECommStatus, NVTEDType, NVTETensor, cudaStream_t};
use crate::cuda::{Checked, DevPtr};
use crate::error::Result;
use crate::invalid;
use crate::kernels::block::BlockQuantConfig;
use crate::kernels::{self, AmaxAlgo, QuantConfig};
use crate::tensor::{DType, ScaleFormat, Tensor};
use std::ffi::{CStr, c_char, c_void};

/// Opaque quantization config handle (TE: `typedef void *NVTEQuantizationConfig;`).
pub type NVTEQuantizationConfig = *mut c_void;

/// The stored attributes of a config, as TE's QuantizationConfig holds them.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ConfigAttrs {
    force_pow_2_scales: bool,
    amax_epsilon: f32,
    /// NVTETensor handle value (0: none).
    noop_tensor: usize,
    rng_state: usize,
    nvfp4_2d_quantization: bool,
    stochastic_rounding: bool,
    use_fast_math: bool,
    nvfp4_4over6_mode: u8,
    nvfp4_4over6_err_use_fast_math: bool,
    mxfp8_2d_quantization: bool,
    /// Float8BlockScaleTensorFormat of a block-scaled quantization (None: TE's INVALID,
    /// read as GEMM_READY).
    block_format: Option<ScaleFormat>,
}

/// `NVTEQuantizationConfig` handles.
static QCONFIGS: Table<ConfigAttrs> = Table::new(
    "quantization config",
    "NVTEQuantizationConfig",
    "never created by nvte_create_quantization_config",
);

const PTR: usize = std::mem::size_of::<usize>();

impl ConfigAttrs {
    /// Size in bytes of attribute `a` (TE's QuantizationConfig::attr_sizes).
    pub(crate) fn size(a: Attr) -> Result<usize> {
        Ok(match a {
            Attr::kNVTEQuantizationConfigAmaxEpsilon => 4,
            Attr::kNVTEQuantizationConfigNoopTensor | Attr::kNVTEQuantizationConfigRNGState => PTR,
            Attr::kNVTEQuantizationConfigFloat8BlockScaleTensorFormat => 4,
            a if a.0 < Attr::kNVTEQuantizationConfigNumAttributes.0 => 1,
            a => invalid!(
                "argument `attr` = {a} is not a valid NVTEQuantizationConfigAttribute (expected 0..=10)"
            ),
        })
    }

    /// Set attribute `a` from its bytes (at least `size(a)` of them).
    pub(crate) fn set(&mut self, a: Attr, b: &[u8]) -> Result<()> {
        let need = Self::size(a)?;
        if b.len() < need {
            invalid!(
                "argument `size_in_bytes` = {} is too small for {a}: it needs {need} bytes",
                b.len()
            );
        }
        let word = || {
            let mut w = [0u8; PTR];
            w.copy_from_slice(&b[..PTR]);
            usize::from_ne_bytes(w)
        };
        match a {
            Attr::kNVTEQuantizationConfigForcePow2Scales => self.force_pow_2_scales = b[0] != 0,
            Attr::kNVTEQuantizationConfigAmaxEpsilon => {
                let v = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                if !v.is_finite() || v < 0.0 {
                    invalid!("{a} = {v} must be finite and >= 0");
                }
                self.amax_epsilon = v;
            }
            Attr::kNVTEQuantizationConfigNoopTensor => self.noop_tensor = word(),
            Attr::kNVTEQuantizationConfigFloat8BlockScaleTensorFormat => {
                // 0 GEMM_READY, 1 COMPACT, 2 INVALID (what an unset one reads: the default).
                let v = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                self.block_format = match v {
                    2 => None,
                    v => Some(ScaleFormat::from_value(v).map_err(|e| e.context(a.to_string()))?),
                };
            }
            Attr::kNVTEQuantizationConfigRNGState => self.rng_state = word(),
            Attr::kNVTEQuantizationConfigNVFP42DQuantization => {
                self.nvfp4_2d_quantization = b[0] != 0
            }
            Attr::kNVTEQuantizationConfigStochasticRounding => self.stochastic_rounding = b[0] != 0,
            Attr::kNVTEQuantizationConfigUseFastMath => self.use_fast_math = b[0] != 0,
            Attr::kNVTEQuantizationConfigNVFP44Over6Mode => {
                if b[0] > 2 {
                    invalid!(
                        "{a} = {} is not a valid NVTENVFP44Over6Mode (expected 0..=2)",
                        b[0]
                    );
                }
                self.nvfp4_4over6_mode = b[0];
            }
            Attr::kNVTEQuantizationConfigNVFP44Over6ErrUseFastMath => {
                self.nvfp4_4over6_err_use_fast_math = b[0] != 0
            }
            _ => self.mxfp8_2d_quantization = b[0] != 0,
        }
        Ok(())
    }

    /// The bytes of attribute `a` (`size(a)` of them).
    pub(crate) fn get(&self, a: Attr) -> Result<Vec<u8>> {
        let v = match a {
            Attr::kNVTEQuantizationConfigForcePow2Scales => vec![self.force_pow_2_scales as u8],
            Attr::kNVTEQuantizationConfigAmaxEpsilon => self.amax_epsilon.to_ne_bytes().to_vec(),
            Attr::kNVTEQuantizationConfigNoopTensor => self.noop_tensor.to_ne_bytes().to_vec(),
            // Unset: Float8BlockScaleTensorFormat::INVALID (2), as TE reads it.
            Attr::kNVTEQuantizationConfigFloat8BlockScaleTensorFormat => self
                .block_format
                .map_or(2, ScaleFormat::value)
                .to_ne_bytes()
                .to_vec(),
            Attr::kNVTEQuantizationConfigRNGState => self.rng_state.to_ne_bytes().to_vec(),
            Attr::kNVTEQuantizationConfigNVFP42DQuantization => {
                vec![self.nvfp4_2d_quantization as u8]
            }
            Attr::kNVTEQuantizationConfigStochasticRounding => vec![self.stochastic_rounding as u8],
            Attr::kNVTEQuantizationConfigUseFastMath => vec![self.use_fast_math as u8],
            Attr::kNVTEQuantizationConfigNVFP44Over6Mode => vec![self.nvfp4_4over6_mode],
            Attr::kNVTEQuantizationConfigNVFP44Over6ErrUseFastMath => {
                vec![self.nvfp4_4over6_err_use_fast_math as u8]
            }
            a => {
                Self::size(a)?;
                vec![self.mxfp8_2d_quantization as u8]
            }
        };
        Ok(v)
    }

    /// The options a per-tensor FP8 kernel uses, with the noop tensor resolved to its
    /// device float (it must be a live tensor of one float32).
    fn resolve(&self) -> Result<QuantConfig> {
        if self.stochastic_rounding {
            crate::unsupported!(
                "stochastic rounding (kNVTEQuantizationConfigStochasticRounding) is only for NVFP4, which is not implemented"
            );
        }
        let noop = if self.noop_tensor == 0 {
            DevPtr::NULL
        } else {
            let t = TENSORS.get(self.noop_tensor, "noop")?;
            if t.data.ptr.is_null() || t.data.numel() != 1 || t.data.dtype != DType::F32 {
                invalid!(
                    "tensor `noop` (kNVTEQuantizationConfigNoopTensor) must hold one kNVTEFloat32 element, got {} of shape {}{}",
                    t.data.dtype.name(),
                    t.data.shape,
                    if t.data.ptr.is_null() {
                        " with no data"
                    } else {
                        ""
                    }
                );
            }
            t.data.ptr
        };
        Ok(QuantConfig {
            force_pow_2_scales: self.force_pow_2_scales,
            amax_epsilon: self.amax_epsilon,
            noop,
        })
    }
}

impl ConfigAttrs {
    /// The options of a block-scaled quantization: TE's config values as they are (no
    /// config: pow-2 scales off, epsilon 0, GEMM_READY, as TE's QuantizationConfig
    /// defaults), the noop tensor resolved.
    fn resolve_block(&self) -> Result<BlockQuantConfig> {
        let q = self.resolve()?;
        Ok(BlockQuantConfig {
            force_pow_2_scales: q.force_pow_2_scales,
            amax_epsilon: q.amax_epsilon,
            noop: q.noop,
            format: self.block_format.unwrap_or_default(),
            ..Default::default()
        })
    }
}

/// The attributes of `config` (NULL: TE's defaults).
fn config_attrs(config: NVTEQuantizationConfig) -> Result<ConfigAttrs> {
    if config.is_null() {
        return Ok(ConfigAttrs::default());
    }
    QCONFIGS.get(config as usize, "config")
}

/// The resolved options of `config` (NULL: TE's defaults).
fn resolve_config(config: NVTEQuantizationConfig) -> Result<QuantConfig> {
    config_attrs(config)?.resolve()
}

/// A tensor for a per-tensor-scaling kernel: block-scaled ones are refused (their
/// scale_inv is not one float).
fn tensor(t: NVTETensor, what: &str) -> Result<Tensor> {
    per_tensor(TENSORS.get(t as usize, what)?, what)
}

fn per_tensor(t: Tensor, what: &str) -> Result<Tensor> {
    if let Some(m) = t.block_mode() {
        crate::unsupported!(
            "tensor `{what}` is block-scaled ({}): this operation takes per-tensor-scaled tensors",
            m.name()
        );
    }
    Ok(t)
}

/// A tensor the caller described — resolved from its handle ([`tensor`], `TENSORS.get`),
/// or built from a packed call's pointers and extents (`super::packed_cast`) — as the
/// checked operand the kernels take.
pub(super) fn checked(t: &Tensor) -> Checked<&Tensor> {
    // SAFETY: `t` holds the caller's buffers with the shapes and dtypes it gave (a live
    // handle's, or a packed struct's); the kernels check what can be checked (shapes,
    // dtypes, NULL data) before launching, and TE's contract for these functions (and
    // nvte_comm_cast_packed's, which stands for them) is that the buffers are device
    // memory of those extents, alive until the stream runs the work.
    unsafe { Checked::vouched(t) }
}

/// Create a quantization config with TE's defaults (no pow-2 scales, epsilon 0, no noop
/// tensor). Destroy it with nvte_destroy_quantization_config.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_create_quantization_config() -> NVTEQuantizationConfig {
    entry!(or std::ptr::null_mut(), {
        Ok(QCONFIGS.insert(ConfigAttrs::default()) as NVTEQuantizationConfig)
    })
}

/// Read attribute `attr` of `config` into `buf` (`size_in_bytes` bytes). `*size_written`
/// (when not NULL) gets the attribute's size; a NULL `buf` only asks for that size (TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_get_quantization_config_attribute(
    config: NVTEQuantizationConfig,
    attr: NVTEQuantizationConfigAttribute,
    buf: *mut c_void,
    size_in_bytes: usize,
    size_written: *mut usize,
) {
    entry!(void, {
        let size = ConfigAttrs::size(attr)?;
        super::read_config_attribute(attr, size, buf, size_in_bytes, size_written, || {
            QCONFIGS.get(config as usize, "config")?.get(attr)
        })
    })
}

/// Set attribute `attr` of `config` from `buf` (`size_in_bytes` bytes, at least the
/// attribute's size: uint8_t for the flags, float for the epsilon, NVTETensor for the
/// noop tensor). The noop tensor is looked up when the config is used.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_set_quantization_config_attribute(
    config: NVTEQuantizationConfig,
    attr: NVTEQuantizationConfigAttribute,
    buf: *const c_void,
    size_in_bytes: usize,
) {
    entry!(void, {
        let size = ConfigAttrs::size(attr)?;
        let bytes = super::config_attribute_bytes(attr, size, buf, size_in_bytes)?;
        QCONFIGS.update(config as usize, "config", |c| c.set(attr, bytes))
    })
}

/// Destroy a quantization config (NULL is a no-op, as in TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_destroy_quantization_config(config: NVTEQuantizationConfig) {
    entry!(void, {
        if !config.is_null() {
            QCONFIGS.remove(config as usize, "config")?;
        }
        Ok(())
    })
}

/// nvte_quantize's three forms: a block-scaled `output` takes the block quantization, any
/// other the per-tensor one (whose tensors must not be block-scaled). A block
/// quantization records the scale format it wrote on `output`.
fn quantize_with(
    input: NVTETensor,
    output: NVTETensor,
    attrs: &ConfigAttrs,
    stream: cudaStream_t,
) -> Result<()> {
    let i = TENSORS.get(input as usize, "input")?;
    let o = TENSORS.get(output as usize, "output")?;
    let stream = crate::ffi::stream_of(stream);
    if o.block_mode().is_some() {
        let cfg = attrs.resolve_block()?;
        let format = kernels::block::quantize(checked(&i), checked(&o), &cfg, stream)?;
        return TENSORS.update(output as usize, "output", |t| {
            t.block_format = format;
            Ok(())
        });
    }
    let (i, o) = (per_tensor(i, "input")?, per_tensor(o, "output")?);
    kernels::quantize(checked(&i), checked(&o), &attrs.resolve()?, stream)
}

/// Quantize `input` (float32/bf16/fp16) into `output`.
///
/// Per-tensor scaling (TE semantics): FP8 rowwise data = cast(input * scale) and / or,
/// when `output` has kNVTEColumnwiseData, its FP8 transpose ([cols, rows] of the input
/// flattened to 2-D), both from one pass; amax = max(amax, max|input|) (an atomic max:
/// zero it first); scale_inv and columnwise scale_inv = 1/scale. A float output is a
/// plain cast.
///
/// FP8 block scaling (`output` created with NVTE_BLOCK_SCALING_1D / _2D): one scale per
/// 1x128 values (1D rowwise), 128x1 (1D columnwise) or 128x128 tile (2D), each block's
/// scale = fp8_max / amax (TE's rules; pow-2 scales off and epsilon 0 without a config),
/// scale_inv in TE's GEMM-ready layout; rows and the last dimension must be multiples of
/// 128.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_quantize(input: NVTETensor, output: NVTETensor, stream: cudaStream_t) {
    entry!(void, {
        quantize_with(input, output, &ConfigAttrs::default(), stream)
    })
}

/// nvte_quantize with the noop flag of TE: nothing happens when `noop` holds 1.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_quantize_noop(
    input: NVTETensor,
    output: NVTETensor,
    noop: NVTETensor,
    stream: cudaStream_t,
) {
    entry!(void, {
        let attrs = ConfigAttrs {
            noop_tensor: noop as usize,
            ..Default::default()
        };
        quantize_with(input, output, &attrs, stream)
    })
}

/// nvte_quantize with a quantization config (NULL: the defaults); the noop tensor is
/// honoured. Per-tensor scaling: force_pow_2_scales and amax_epsilon concern
/// nvte_compute_scale_from_amax. Block scaling: force_pow_2_scales, amax_epsilon and
/// Float8BlockScaleTensorFormat (GEMM_READY, or COMPACT: 1D scales untransposed and
/// unpadded, 1D columnwise data in the input's layout) apply.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_quantize_v2(
    input: NVTETensor,
    output: NVTETensor,
    quant_config: NVTEQuantizationConfig,
    stream: cudaStream_t,
) {
    entry!(void, {
        quantize_with(input, output, &config_attrs(quant_config)?, stream)
    })
}

/// output = cast(input * input.scale_inv) from FP8 to float32/bfloat16/float16; a
/// block-scaled input uses each block's scale_inv (its rowwise data, else its columnwise
/// data) and gives the logical (untransposed) matrix.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_dequantize(input: NVTETensor, output: NVTETensor, stream: cudaStream_t) {
    entry!(void, {
        let i = TENSORS.get(input as usize, "input")?;
        let o = TENSORS.get(output as usize, "output")?;
        let stream = crate::ffi::stream_of(stream);
        if i.block_mode().is_some() {
            return kernels::block::dequantize(checked(&i), checked(&o), stream);
        }
        let (i, o) = (per_tensor(i, "input")?, per_tensor(o, "output")?);
        kernels::dequantize(checked(&i), checked(&o), stream)
    })
}

/// output.amax = max|input| (float32/bf16/fp16 input; amax zeroed, then computed).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_compute_amax(input: NVTETensor, output: NVTETensor, stream: cudaStream_t) {
    entry!(void, {
        let i = tensor(input, "input")?;
        let o = tensor(output, "output")?;
        kernels::compute_amax(
            checked(&i),
            checked(&o),
            &QuantConfig::default(),
            crate::ffi::stream_of(stream),
        )
    })
}

/// nvte_compute_amax with a quantization config (its noop tensor skips the call on the
/// device).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_compute_amax_with_config(
    input: NVTETensor,
    output: NVTETensor,
    config: NVTEQuantizationConfig,
    stream: cudaStream_t,
) {
    entry!(void, {
        let i = tensor(input, "input")?;
        let o = tensor(output, "output")?;
        let cfg = resolve_config(config)?;
        kernels::compute_amax(
            checked(&i),
            checked(&o),
            &cfg,
            crate::ffi::stream_of(stream),
        )
    })
}

/// output.scale = fp8_max / max(output.amax, amax_epsilon) (TE's current scaling: amax 0,
/// inf or NaN gives 1, an overflowing scale float max, force_pow_2_scales rounds down to
/// a power of 2). Only the scale is written. `config` must not be NULL (TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_compute_scale_from_amax(
    output: NVTETensor,
    config: NVTEQuantizationConfig,
    stream: cudaStream_t,
) {
    entry!(void, {
        let o = tensor(output, "output")?;
        if config.is_null() {
            invalid!("argument `config` is NULL");
        }
        let cfg = resolve_config(config)?;
        kernels::compute_scale_from_amax(checked(&o), &cfg, crate::ffi::stream_of(stream))
    })
}

/// TE's delayed-scaling update: `amax_history` [history_length, num_scales] (or
/// [history_length]) rolled by -1 into `updated_amax_history` with its first row zeroed;
/// amax = "max" over the history or its "most_recent" (first) row; `updated_scale` =
/// fp8_max * 2^-margin / amax, keeping `scale` when amax is 0, inf or NaN, float max when
/// that overflows. The updated tensors may be the inputs (in place).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn nvte_delayed_scaling_recipe_amax_and_scale_update(
    amax_history: NVTETensor,
    scale: NVTETensor,
    updated_amax_history: NVTETensor,
    updated_scale: NVTETensor,
    amax_compute_algo: *const c_char,
    fp8_dtype: NVTEDType,
    margin: f32,
    stream: cudaStream_t,
) {
    entry!(void, {
        if amax_compute_algo.is_null() {
            invalid!("argument `amax_compute_algo` is NULL");
        }
        // SAFETY: non-null; the caller passes a NUL-terminated string (C contract).
        let algo_s = unsafe { CStr::from_ptr(amax_compute_algo) }.to_string_lossy();
        let algo = AmaxAlgo::parse(&algo_s)?;
        let fp8 = DType::from_c(fp8_dtype)?;
        let h = tensor(amax_history, "amax_history")?;
        let s = tensor(scale, "scale")?;
        let uh = tensor(updated_amax_history, "updated_amax_history")?;
        let us = tensor(updated_scale, "updated_scale")?;
        kernels::delayed_scaling_update(
            checked(&h),
            checked(&s),
            checked(&uh),
            checked(&us),
            algo,
            fp8,
            margin,
            crate::ffi::stream_of(stream),
        )
    })
}

/// transposed_output [H, N] = input [N, H]^T (2-D, same dtype; 1-, 2- and 4-byte types).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_transpose(
    input: NVTETensor,
    transposed_output: NVTETensor,
    stream: cudaStream_t,
) {
    entry!(void, {
        let i = tensor(input, "input")?;
        let o = tensor(transposed_output, "transposed_output")?;
        kernels::transpose(checked(&i), checked(&o), crate::ffi::stream_of(stream))
    })
}

/// Fill `tensor` (float32/bf16/fp16/fp8) with uniform values in [lo, hi), determined by
/// `seed` and the element index.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_fill_uniform(
    tensor: NVTETensor,
    seed: u64,
    lo: f32,
    hi: f32,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        let t = TENSORS.get(tensor as usize, "tensor")?;
        kernels::fill_uniform(checked(&t), seed, lo, hi, crate::ffi::stream_of(stream))
    })
}

/// Number of live quantization configs (for leak checks in tests).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_live_quantization_config_count() -> usize {
    entry!(plain, { QCONFIGS.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_sizes_are_te_sizes() {
        let sizes: Vec<usize> = (0..11)
            .map(|a| ConfigAttrs::size(Attr(a)).unwrap())
            .collect();
        assert_eq!(sizes, vec![1, 4, PTR, 4, PTR, 1, 1, 1, 1, 1, 1]);
        assert!(ConfigAttrs::size(Attr::kNVTEQuantizationConfigNumAttributes).is_err());
        assert!(ConfigAttrs::size(Attr(99)).is_err());
    }

    #[test]
    fn attributes_round_trip_and_are_checked() {
        let mut c = ConfigAttrs::default();
        c.set(Attr::kNVTEQuantizationConfigForcePow2Scales, &[1])
            .unwrap();
        c.set(
            Attr::kNVTEQuantizationConfigAmaxEpsilon,
            &1.5f32.to_ne_bytes(),
        )
        .unwrap();
        c.set(
            Attr::kNVTEQuantizationConfigNoopTensor,
            &0x1234usize.to_ne_bytes(),
        )
        .unwrap();
        assert!(c.force_pow_2_scales);
        assert_eq!(c.amax_epsilon, 1.5);
        assert_eq!(c.noop_tensor, 0x1234);
        assert_eq!(
            c.get(Attr::kNVTEQuantizationConfigAmaxEpsilon).unwrap(),
            1.5f32.to_ne_bytes()
        );
        assert_eq!(
            c.get(Attr::kNVTEQuantizationConfigForcePow2Scales).unwrap(),
            [1]
        );
        assert_eq!(
            c.get(Attr::kNVTEQuantizationConfigFloat8BlockScaleTensorFormat)
                .unwrap(),
            2i32.to_ne_bytes()
        );
        // Too small, bad values.
        assert!(
            c.set(Attr::kNVTEQuantizationConfigAmaxEpsilon, &[0, 0])
                .is_err()
        );
        assert!(
            c.set(
                Attr::kNVTEQuantizationConfigAmaxEpsilon,
                &(-1.0f32).to_ne_bytes()
            )
            .is_err()
        );
        assert!(
            c.set(
                Attr::kNVTEQuantizationConfigAmaxEpsilon,
                &f32::NAN.to_ne_bytes()
            )
            .is_err()
        );
        assert!(
            c.set(Attr::kNVTEQuantizationConfigNVFP44Over6Mode, &[3])
                .is_err()
        );
        assert_eq!(c.amax_epsilon, 1.5, "a rejected value changes nothing");
        // A noop handle that is not a live tensor is reported when the config is used.
        let e = c.resolve().unwrap_err();
        assert!(e.to_string().contains("noop"), "{e}");
    }
}
