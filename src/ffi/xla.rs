//! XLA typed-FFI handlers (api_version 1) for the comm-GEMM operations, written against
//! XLA's stable C API (`xla/ffi/api/c_api.h`, which jaxlib ships under
//! `jax.ffi.include_dir()`). Why Rust and not a C++ companion on `ffi.h`: the handlers stay
//! in this library's one FFI layer (panic firewall, handle table, error mapping), users
//! need no C++ toolchain, and only the few structs below are needed; `tests` compiles a C
//! program against the installed header and checks every offset and size used here.
//!
//! A handler is registered with `jax.ffi.register_ffi_target(name,
//! {"initialize": capsule, "execute": capsule}, platform="CUDA", api_version=1)` (both
//! stages are this same function):
//! - **initialize** (outside any CUDA-graph or command-buffer capture, before each
//!   execution): creates, collectively, the engine and buffers the call needs
//!   (`CommGemmCtx::prepare`); a no-op once they exist;
//! - **execute**: the call on XLA's stream (captured into a command buffer when XLA
//!   records one: the handlers declare `COMMAND_BUFFER_COMPATIBLE`; replays are correct,
//!   see `tests_c/test_graph.cpp` and `python/tests/jax`).
//!
//! Operands (in order): `a`, `b` (TE's A and B: weight and input for Linear), `bias` when
//! attribute `has_bias`, then A's and B's `scale_inv` (f32, one element) when
//! `has_scales` (FP8). Results: `d`, then `pre_act_out` when `gelu`, then B gathered when
//! `gather_b` (all-gather only). Attributes (any integer or bool scalar type): `context`
//! (the key given to `nvte_comm_xla_bind`), `m`, `n`, `k` (global sizes, as in
//! `nvte_all_gather_gemm`), `transa`, `transb`, `comm_sms`, `algo`, `has_bias`,
//! `has_scales`, `gelu`, `gather_b`.
//!
//! `nvte_comm_xla_block_gemm` (no context, no communication) runs the block-scaled FP8
//! GEMM of TE's Float8BlockScaling through nvte_cublas_gemm's entry, and
//! `nvte_comm_xla_block_quantize` its block quantization; see their own docs.
//!
//! The context of a call is looked up by (`context`, the device ordinal of XLA's execution
//! context), so one SPMD program drives one context per local device.
use super::comm_gemm::{NVTECommGemmCtx, Request, ctx as ctx_of};
use super::enums::NVTECommGemmAlgoType;
use super::enums::NVTECommStatus;
use super::{firewall_with, status_of};
use crate::comm_gemm::Kind;
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::cuda::resources::capture_status;
use crate::error::{Error, ErrorKind, Result};
use crate::tensor::{BlockMode, Buffer, DType, Shape, Tensor};
use crate::{invalid, unsupported};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

// ---- the C API's structs (c_api.h), only the fields this module reads or writes ----

#[repr(C)]
pub(crate) struct ExtensionBase {
    struct_size: usize,
    ty: c_int,
    next: *mut ExtensionBase,
}

#[repr(C)]
pub(crate) struct ApiVersion {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    major_version: c_int,
    minor_version: c_int,
}

#[repr(C)]
pub(crate) struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const c_char,
    errc: c_int,
}

#[repr(C)]
pub(crate) struct ErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    error: *mut c_void,
}

#[repr(C)]
pub(crate) struct StreamGetArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    ctx: *mut c_void,
    stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct DeviceOrdinalGetArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    ctx: *mut c_void,
    device_ordinal: i32,
}

type ErrorCreateFn = unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void;
type ErrorDestroyFn = unsafe extern "C" fn(*mut ErrorDestroyArgs);
type StreamGetFn = unsafe extern "C" fn(*mut StreamGetArgs) -> *mut c_void;
type DeviceOrdinalGetFn = unsafe extern "C" fn(*mut DeviceOrdinalGetArgs) -> *mut c_void;
type OtherFn = Option<unsafe extern "C" fn()>;

/// `XLA_FFI_Api`: versioned by `struct_size`; newer XLA versions append fields.
#[repr(C)]
pub(crate) struct Api {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *const c_void,
    error_create: Option<ErrorCreateFn>,
    error_get_message: OtherFn,
    error_destroy: Option<ErrorDestroyFn>,
    handler_register: OtherFn,
    stream_get: Option<StreamGetFn>,
    type_register: OtherFn,
    execution_context_get: OtherFn,
    state_set: OtherFn,
    state_get: OtherFn,
    device_memory_allocate: OtherFn,
    device_memory_free: OtherFn,
    thread_pool_schedule: OtherFn,
    thread_pool_num_threads: OtherFn,
    future_create: OtherFn,
    future_set_available: OtherFn,
    future_set_error: OtherFn,
    run_id_get: OtherFn,
    device_ordinal_get: Option<DeviceOrdinalGetFn>,
}

#[repr(C)]
pub(crate) struct XBuffer {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    dtype: c_int,
    data: *mut c_void,
    rank: i64,
    dims: *mut i64,
}

#[repr(C)]
pub(crate) struct Args {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *mut c_int,
    args: *mut *mut c_void,
}

#[repr(C)]
pub(crate) struct Rets {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *mut c_int,
    rets: *mut *mut c_void,
}

#[repr(C)]
pub(crate) struct ByteSpan {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
pub(crate) struct Scalar {
    dtype: c_int,
    value: *mut c_void,
}

#[repr(C)]
pub(crate) struct Attrs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    size: i64,
    types: *mut c_int,
    names: *mut *mut ByteSpan,
    attrs: *mut *mut c_void,
}

#[repr(C)]
pub(crate) struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api: *const Api,
    ctx: *mut c_void,
    stage: c_int,
    args: Args,
    rets: Rets,
    attrs: Attrs,
}

#[repr(C)]
pub(crate) struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
    state_type_id: i64,
}

#[repr(C)]
pub(crate) struct MetadataExtension {
    extension_base: ExtensionBase,
    metadata: *mut Metadata,
}

/// The C API version these structs follow (c_api.h's XLA_FFI_API_MAJOR / MINOR). XLA
/// keeps older minor versions working; handlers report the version they were built for.
const API_MAJOR: c_int = 0;
const API_MINOR: c_int = 3;
const EXTENSION_METADATA: c_int = 1;
const TRAIT_COMMAND_BUFFER_COMPATIBLE: u32 = 1;
const ARG_BUFFER: c_int = 1;
const ATTR_SCALAR: c_int = 3;
const STAGE_INITIALIZE: c_int = 2;
const STAGE_EXECUTE: c_int = 3;

// XLA_FFI_DataType values.
const XDT_PRED: i32 = 1;
const XDT_S8: i32 = 2;
const XDT_S16: i32 = 3;
const XDT_S32: i32 = 4;
const XDT_S64: i32 = 5;
const XDT_U8: i32 = 6;
const XDT_U16: i32 = 7;
const XDT_U32: i32 = 8;
const XDT_U64: i32 = 9;
const XDT_F16: i32 = 10;
const XDT_F32: i32 = 11;
const XDT_F64: i32 = 12;
const XDT_BF16: i32 = 16;
const XDT_F8E5M2: i32 = 19;
const XDT_F8E4M3FN: i32 = 20;

fn dtype_of(x: i32, what: &str) -> Result<DType> {
    Ok(match x {
        XDT_BF16 => DType::BF16,
        XDT_F16 => DType::F16,
        XDT_F32 => DType::F32,
        XDT_F8E4M3FN => DType::E4M3,
        XDT_F8E5M2 => DType::E5M2,
        XDT_U8 => DType::Byte,
        _ => unsupported!(
            "{what} has XLA element type {x}: the comm-GEMM handlers take bf16, f16, f32, f8e4m3fn and f8e5m2"
        ),
    })
}

// ---- contexts by (key, device ordinal) ----

static BINDINGS: Mutex<Option<HashMap<(u64, i32), usize>>> = Mutex::new(None);

/// Make `ctx` the context of handler calls with attribute `context = key` running on CUDA
/// device `device_ordinal` (XLA's execution-context ordinal; -1: any device without a
/// binding of its own). Replaces an earlier binding. The context must outlive every
/// execution that uses it: unbind before destroying it.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_xla_bind(
    key: u64,
    device_ordinal: i32,
    ctx: *mut NVTECommGemmCtx,
) -> NVTECommStatus {
    entry!(status, {
        if device_ordinal < -1 {
            invalid!("argument `device_ordinal` = {device_ordinal} must be >= -1");
        }
        ctx_of(ctx)?; // a live context
        let mut b = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
        b.get_or_insert_with(HashMap::new)
            .insert((key, device_ordinal), ctx as usize);
        Ok(())
    })
}

/// Remove the binding of (`key`, `device_ordinal`); not bound is an error.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_xla_unbind(key: u64, device_ordinal: i32) -> NVTECommStatus {
    entry!(status, {
        let mut b = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
        match b.as_mut().and_then(|m| m.remove(&(key, device_ordinal))) {
            Some(_) => Ok(()),
            None => invalid!("no context is bound to key {key} on device {device_ordinal}"),
        }
    })
}

fn bound(key: u64, ordinal: i32) -> Result<usize> {
    let b = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
    let m = b.as_ref();
    m.and_then(|m| m.get(&(key, ordinal)).or_else(|| m.get(&(key, -1))))
        .copied()
        .ok_or_else(|| {
            Error::invalid(format!(
                "no context is bound to key {key} on device {ordinal} (transformer_engine_comm.jax creates and binds one per TP group and device: was it closed?)"
            ))
        })
}

// ---- decoding the call frame ----

/// The handler's view of one call.
struct Frame<'a> {
    api: &'a Api,
    ctx: *mut c_void,
    stage: c_int,
    args: Vec<&'a XBuffer>,
    rets: Vec<&'a XBuffer>,
    /// integer and bool scalar attributes
    attrs: HashMap<String, i64>,
    /// floating-point scalar attributes (f32, f64)
    floats: HashMap<String, f64>,
}

fn has_field(struct_size: usize, end: usize) -> bool {
    struct_size >= end
}

/// # Safety
/// `f` is XLA's call frame for this call (checked for size before any field is read).
/// # Safety
/// `types` and `ptrs` are XLA's arrays of `size` operand (or result) types and pointers.
unsafe fn buffers<'a>(
    size: i64,
    types: *const c_int,
    ptrs: *const *mut c_void,
    what: &str,
) -> Result<Vec<&'a XBuffer>> {
    let mut v = Vec::new();
    for i in 0..size.max(0) as usize {
        // SAFETY: XLA gives `size` types and pointers.
        let (ty, p) = unsafe { (*types.add(i), *ptrs.add(i)) };
        if ty != ARG_BUFFER || p.is_null() {
            invalid!("{what} {i} is not a buffer (type {ty})");
        }
        // SAFETY: a buffer operand / result points to an XLA_FFI_Buffer.
        v.push(unsafe { &*(p as *const XBuffer) });
    }
    Ok(v)
}

unsafe fn decode<'a>(f: &'a CallFrame, api: &'a Api) -> Result<Frame<'a>> {
    // SAFETY: the frame's operand and result arrays.
    let args = unsafe { buffers(f.args.size, f.args.types, f.args.args, "operand")? };
    // SAFETY: as above.
    let rets = unsafe { buffers(f.rets.size, f.rets.types, f.rets.rets, "result")? };
    let (mut attrs, mut floats) = (HashMap::new(), HashMap::new());
    for i in 0..f.attrs.size.max(0) as usize {
        // SAFETY: XLA gives `size` names, types and attribute pointers.
        let (ty, name, p) = unsafe {
            (
                *f.attrs.types.add(i),
                &**f.attrs.names.add(i),
                *f.attrs.attrs.add(i),
            )
        };
        // SAFETY: a name is `len` bytes at `ptr`.
        let name = unsafe { std::slice::from_raw_parts(name.ptr as *const u8, name.len) };
        let name = String::from_utf8_lossy(name).into_owned();
        if ty != ATTR_SCALAR {
            invalid!("attribute `{name}` must be a scalar (got attribute type {ty})");
        }
        // SAFETY: a scalar attribute points to an XLA_FFI_Scalar whose value has its dtype.
        let v = unsafe {
            let s = &*(p as *const Scalar);
            match s.dtype {
                XDT_PRED | XDT_U8 => *(s.value as *const u8) as i64,
                XDT_S8 => *(s.value as *const i8) as i64,
                XDT_S16 => *(s.value as *const i16) as i64,
                XDT_U16 => *(s.value as *const u16) as i64,
                XDT_S32 => *(s.value as *const i32) as i64,
                XDT_U32 => *(s.value as *const u32) as i64,
                XDT_S64 => *(s.value as *const i64),
                XDT_U64 => *(s.value as *const u64) as i64,
                XDT_F32 => {
                    floats.insert(name, *(s.value as *const f32) as f64);
                    continue;
                }
                XDT_F64 => {
                    floats.insert(name, *(s.value as *const f64));
                    continue;
                }
                d => invalid!("attribute `{name}` has element type {d}: integers, bool or floats"),
            }
        };
        attrs.insert(name, v);
    }
    Ok(Frame {
        api,
        ctx: f.ctx,
        stage: f.stage,
        args,
        rets,
        attrs,
        floats,
    })
}

impl Frame<'_> {
    fn attr(&self, name: &str) -> Result<i64> {
        if self.floats.contains_key(name) {
            invalid!("attribute `{name}` is a float: it must be an integer or bool");
        }
        self.attrs
            .get(name)
            .copied()
            .ok_or_else(|| Error::invalid(format!("attribute `{name}` is missing")))
    }
    /// A floating-point attribute (an integer one is taken as its value); absent: `default`.
    fn float_or(&self, name: &str, default: f64) -> f64 {
        match (self.floats.get(name), self.attrs.get(name)) {
            (Some(&v), _) => v,
            (None, Some(&v)) => v as f64,
            (None, None) => default,
        }
    }
    /// A boolean attribute; absent means `default` (a float one is refused, as by `attr`).
    fn flag_or(&self, name: &str, default: bool) -> Result<bool> {
        if self.floats.contains_key(name) {
            invalid!("attribute `{name}` is a float: it must be an integer or bool");
        }
        Ok(self.attrs.get(name).map_or(default, |&v| v != 0))
    }
    /// A boolean attribute; absent means false.
    fn flag(&self, name: &str) -> Result<bool> {
        self.flag_or(name, false)
    }
    /// Free an error XLA returned to us (we report our own).
    fn drop_error(&self, err: *mut c_void) {
        if let Some(destroy) = self.api.error_destroy {
            let mut a = ErrorDestroyArgs {
                struct_size: size_of::<ErrorDestroyArgs>(),
                extension_start: std::ptr::null_mut(),
                error: err,
            };
            // SAFETY: XLA's function with its argument struct, on an error it created.
            unsafe { destroy(&mut a) };
        }
    }

    fn stream(&self) -> Result<StreamHandle> {
        let Some(get) = self.api.stream_get else {
            invalid!("XLA's API has no XLA_FFI_Stream_Get");
        };
        let mut a = StreamGetArgs {
            struct_size: size_of::<StreamGetArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: XLA's function with its argument struct, for this call's context.
        let err = unsafe { get(&mut a) };
        if !err.is_null() {
            self.drop_error(err);
            return Err(Error::new(
                ErrorKind::Internal,
                "XLA_FFI_Stream_Get failed (no stream in this stage)",
            ));
        }
        Ok(StreamHandle::from_raw(a.stream as usize))
    }
    fn device_ordinal(&self) -> i32 {
        let end = offset_of!(Api, device_ordinal_get) + size_of::<OtherFn>();
        let Some(get) = self
            .api
            .device_ordinal_get
            .filter(|_| has_field(self.api.struct_size, end))
        else {
            return -1;
        };
        let mut a = DeviceOrdinalGetArgs {
            struct_size: size_of::<DeviceOrdinalGetArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            device_ordinal: -1,
        };
        // SAFETY: as for the stream.
        let err = unsafe { get(&mut a) };
        if err.is_null() {
            a.device_ordinal
        } else {
            self.drop_error(err);
            -1
        }
    }
}

fn tensor_of(b: &XBuffer, what: &str, scale_inv: Option<&XBuffer>) -> Result<Tensor> {
    let dt = dtype_of(b.dtype, what)?;
    let rank = b.rank.max(0) as usize;
    // SAFETY: XLA gives `rank` dimensions.
    let dims = unsafe { std::slice::from_raw_parts(b.dims as *const i64, rank) };
    let dims: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    let mut t = Tensor {
        data: Buffer::new(DevPtr::from_c(b.data), dt, Shape::new(&dims)?)?,
        ..Default::default()
    };
    if let Some(s) = scale_inv {
        if s.dtype != XDT_F32 {
            invalid!("the scale_inv of `{what}` must be f32 (one element)");
        }
        t.scale_inv = Buffer::new(DevPtr::from_c(s.data), DType::F32, Shape::new(&[1])?)?;
    }
    Ok(t)
}

fn run(kind: Kind, f: &Frame) -> Result<()> {
    let prepare = match f.stage {
        STAGE_INITIALIZE => true,
        STAGE_EXECUTE => false,
        _ => return Ok(()), // instantiate / prepare: nothing to do
    };
    let (has_bias, has_scales, gelu, gather_b) = (
        f.flag("has_bias")?,
        f.flag("has_scales")?,
        f.flag("gelu")?,
        f.flag("gather_b")?,
    );
    let want_args = 2 + has_bias as usize + 2 * has_scales as usize;
    let want_rets = 1 + gelu as usize + gather_b as usize;
    if f.args.len() != want_args || f.rets.len() != want_rets {
        invalid!(
            "{} operands and {} results given, the attributes (has_bias = {has_bias}, has_scales = {has_scales}, gelu = {gelu}, gather_b = {gather_b}) ask for {want_args} and {want_rets}",
            f.args.len(),
            f.rets.len()
        );
    }
    // The frame's shape (which operands and results the attributes ask for) picks the
    // call, as the C function a caller picks; then the context, before the other
    // arguments, as every comm-GEMM entry point (`super::comm_gemm::Request`): the one
    // bound to the call's key on this device.
    let key = f.attr("context")? as u64;
    let ctx = ctx_of(bound(key, f.device_ordinal())? as *mut NVTECommGemmCtx)?;
    let scales = if has_scales {
        let i = 2 + has_bias as usize;
        (Some(f.args[i]), Some(f.args[i + 1]))
    } else {
        (None, None)
    };
    let a = tensor_of(f.args[0], "operand a", scales.0)?;
    let b = tensor_of(f.args[1], "operand b", scales.1)?;
    let bias = if has_bias {
        Some(tensor_of(f.args[2], "operand bias", None)?)
    } else {
        None
    };
    let d = tensor_of(f.rets[0], "result d", None)?;
    let pre = if gelu {
        Some(tensor_of(f.rets[1], "result pre_act_out", None)?)
    } else {
        None
    };
    let bg = if gather_b {
        Some(tensor_of(
            f.rets[1 + gelu as usize],
            "result b_gathered",
            None,
        )?)
    } else {
        None
    };
    let algo = f.attrs.get("algo").copied().unwrap_or(0);
    // An enum value is a C int: one outside u32 is refused here, the others by `run`.
    let Ok(algo) = u32::try_from(algo).or_else(|_| i32::try_from(algo).map(|a| a as u32)) else {
        invalid!("attribute `algo` = {algo} is not a valid NVTECommGemmAlgoType");
    };
    let stream = f.stream()?;
    super::comm_gemm::run(&Request {
        kind,
        ctx,
        m: f.attr("m")?,
        n: f.attr("n")?,
        k: f.attr("k")?,
        a,
        b,
        d,
        bias,
        pre_act_out: pre,
        b_gathered: bg,
        transa: f.flag("transa")?,
        transb: f.flag("transb")?,
        grad: false,
        accumulate: false,
        comm_sm_count: i32::try_from(f.attrs.get("comm_sms").copied().unwrap_or(0))
            .map_err(|_| Error::invalid("attribute `comm_sms` out of range"))?,
        algo: NVTECommGemmAlgoType(algo),
        algo_arg: "attribute `algo`",
        stream,
        prepare,
    })?;
    if prepare {
        COUNTERS[2].fetch_add(1, Ordering::Relaxed);
    } else {
        COUNTERS[0].fetch_add(1, Ordering::Relaxed);
        if capture_status(stream)?.active() {
            COUNTERS[1].fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Handler calls that succeeded: executed, of which enqueued into a capture (a command
/// buffer), and initialize stages.
static COUNTERS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];

/// Counts of the handlers' successful calls since the library was loaded: execute stages
/// (`executed`), those of them that XLA captured into a command buffer (`captured`), and
/// initialize stages (`initialized`). Each out-pointer may be NULL.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_xla_counters(
    executed: *mut u64,
    captured: *mut u64,
    initialized: *mut u64,
) -> NVTECommStatus {
    entry!(status, {
        for (p, c) in [executed, captured, initialized].into_iter().zip(&COUNTERS) {
            if !p.is_null() {
                // SAFETY: the caller's out-pointer.
                unsafe { *p = c.load(Ordering::Relaxed) };
            }
        }
        Ok(())
    })
}

fn xla_error(api: &Api, func: &str, e: &Error) -> *mut c_void {
    let code = match e.kind {
        ErrorKind::InvalidArgument => 3,
        ErrorKind::Timeout => 4,
        ErrorKind::Unsupported => 12,
        _ => 13,
    };
    let msg = format!("{func}: {}: {}", status_of(e.kind), e.msg);
    let msg = std::ffi::CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let Some(create) = api.error_create else {
        return std::ptr::null_mut();
    };
    let mut a = ErrorCreateArgs {
        struct_size: size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: msg.as_ptr(),
        errc: code,
    };
    // SAFETY: XLA's function with its argument struct; it copies the message.
    unsafe { create(&mut a) }
}

/// The handler's API version and traits into XLA's metadata extension of `fr`.
fn fill_metadata(fr: &CallFrame) -> Result<()> {
    // SAFETY: the caller saw a metadata extension: its layout.
    let ext = unsafe { &*(fr.extension_start as *const MetadataExtension) };
    // SAFETY: XLA's metadata struct (checked for size before any write).
    let Some(md) = (unsafe { ext.metadata.as_mut() }) else {
        invalid!("the metadata extension has no metadata");
    };
    if md.struct_size < offset_of!(Metadata, traits) + size_of::<u32>() {
        invalid!("XLA's metadata struct is smaller than XLA FFI 0.3's");
    }
    md.api_version = ApiVersion {
        struct_size: size_of::<ApiVersion>(),
        extension_start: std::ptr::null_mut(),
        major_version: API_MAJOR,
        minor_version: API_MINOR,
    };
    md.traits = TRAIT_COMMAND_BUFFER_COMPATIBLE;
    if md.struct_size >= size_of::<Metadata>() {
        md.state_type_id = 0; // XLA_FFI_UNKNOWN_TYPE_ID: no state
    }
    Ok(())
}

/// # Safety
/// `frame` is the call frame XLA passes to a handler.
unsafe fn handle(
    func: &'static str,
    body: fn(&Frame) -> Result<()>,
    frame: *mut c_void,
) -> *mut c_void {
    let f = frame as *mut CallFrame;
    if f.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: XLA's call frame; its size is checked before the fields past `api` are read.
    let fr = unsafe { &*f };
    // The metadata query made at registration (XLA may pass it without an API table):
    // report version and traits.
    // SAFETY: an extension starts with its base.
    if !fr.extension_start.is_null() && unsafe { (*fr.extension_start).ty } == EXTENSION_METADATA {
        let res = firewall_with(func, |e| Err(e.clone()), || fill_metadata(fr).map(Ok));
        // SAFETY: the frame's API table, when XLA passed one.
        return match (res, unsafe { fr.api.as_ref() }) {
            (Ok(()), _) => std::ptr::null_mut(),
            (Err(e), Some(api)) => xla_error(api, func, &e),
            (Err(_), None) => std::ptr::null_mut(), // no way to report it: the error is recorded
        };
    }
    // SAFETY: the frame's API table.
    let Some(api) = (unsafe { fr.api.as_ref() }) else {
        return std::ptr::null_mut();
    };
    firewall_with(
        func,
        |e| xla_error(api, func, e),
        || {
            if !has_field(fr.struct_size, size_of::<CallFrame>()) {
                invalid!(
                    "XLA's call frame has {} bytes, fewer than the {} of XLA FFI {API_MAJOR}.{API_MINOR}",
                    fr.struct_size,
                    size_of::<CallFrame>()
                );
            }
            // SAFETY: size checked above.
            let frame = unsafe { decode(fr, api)? };
            body(&frame)?;
            Ok(std::ptr::null_mut())
        },
    )
}

/// XLA FFI handler (`XLA_FFI_Handler`, `call_frame` is an `XLA_FFI_CallFrame *`; returns
/// an `XLA_FFI_Error *`, NULL on success) of `nvte_all_gather_gemm`, for the initialize and
/// execute stages. See the module documentation for operands, results and attributes.
///
/// # Safety
/// Called by XLA with its call frame.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvte_comm_xla_all_gather_gemm(call_frame: *mut c_void) -> *mut c_void {
    entry!(named, |name| {
        // SAFETY: forwarded from XLA.
        unsafe { handle(name, |f| run(Kind::AllGather, f), call_frame) }
    })
}

/// XLA FFI handler of `nvte_gemm_reduce_scatter` (as `nvte_comm_xla_all_gather_gemm`).
///
/// # Safety
/// Called by XLA with its call frame.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvte_comm_xla_gemm_reduce_scatter(call_frame: *mut c_void) -> *mut c_void {
    entry!(named, |name| {
        // SAFETY: forwarded from XLA.
        unsafe { handle(name, |f| run(Kind::ReduceScatter, f), call_frame) }
    })
}

/// XLA FFI handler of `nvte_gemm_all_reduce` (as `nvte_comm_xla_all_gather_gemm`).
///
/// # Safety
/// Called by XLA with its call frame.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvte_comm_xla_gemm_all_reduce(call_frame: *mut c_void) -> *mut c_void {
    entry!(named, |name| {
        // SAFETY: forwarded from XLA.
        unsafe { handle(name, |f| run(Kind::AllReduce, f), call_frame) }
    })
}

// ---- the block-scaled FP8 GEMM (no communication, no context) ----

/// One decoded call of [`nvte_comm_xla_block_gemm`], in TE's terms: A = operand `b`
/// ([N, K], transa), B = operand `a` ([M, K]), D = [M, N] (TE's [n, m]).
struct BlockCall {
    a: Tensor,
    b: Tensor,
    d: Tensor,
    bias: Option<Tensor>,
    pre_gelu: Option<Tensor>,
    workspace: Option<Tensor>,
    split_accumulator: bool,
}

/// The block dimensionality in attribute `name` (1 or 2).
fn block_mode_attr(f: &Frame, name: &str) -> Result<BlockMode> {
    match f.attr(name)? {
        1 => Ok(BlockMode::OneD),
        2 => Ok(BlockMode::TwoD),
        v => invalid!(
            "attribute `{name}` = {v}: the block dimensionality is 1 (1 x 128 blocks) or 2 (128 x 128)"
        ),
    }
}

/// `tensor_of` for a block-scaled operand: FP8 `data` with its float32 `scale_inv` at its
/// real 2-D shape (TE's GEMM-ready layout; the GEMM checks the shape against the data's).
fn block_tensor_of(data: &XBuffer, scale: &XBuffer, mode: BlockMode, what: &str) -> Result<Tensor> {
    let mut t = tensor_of(data, what, None)?;
    if !t.data.dtype.is_fp8() {
        unsupported!(
            "{what} is {}: the block-scaled GEMM takes f8e4m3fn (or f8e5m2) data",
            t.data.dtype.name()
        );
    }
    let s = tensor_of(scale, &format!("the scale_inv of {what}"), None)?.data;
    if s.dtype != DType::F32 || s.shape.as_slice().len() != 2 {
        invalid!(
            "the scale_inv of {what} is {} of shape {}: it must be f32 and 2-D (TE's GEMM-ready layout: [ceil(K/128), roundup(rows, 4)] for 1D blocks, [ceil(rows/128), roundup(ceil(K/128), 4)] for 2D)",
            s.dtype.name(),
            s.shape
        );
    }
    t.scaling_mode = mode.scaling_mode();
    t.scale_inv = s;
    Ok(t)
}

/// The operands and results the attributes ask for, as TE tensors (no device work).
/// Operands: a, a_scale_inv, b, b_scale_inv, then bias when `has_bias`, then the GELU
/// pre-activation when `dgelu`. Results: d, then the workspace (u8) when given.
fn decode_block(f: &Frame) -> Result<BlockCall> {
    let (has_bias, dgelu) = (f.flag("has_bias")?, f.flag("dgelu")?);
    let want = 4 + has_bias as usize + dgelu as usize;
    if f.args.len() != want || !(1..=2).contains(&f.rets.len()) {
        invalid!(
            "{} operands and {} results given: the attributes (has_bias = {has_bias}, dgelu = {dgelu}) ask for {want} operands (a, a_scale_inv, b, b_scale_inv[, bias][, pre_gelu]) and d[, workspace]",
            f.args.len(),
            f.rets.len()
        );
    }
    if has_bias && dgelu {
        unsupported!(
            "has_bias with dgelu: block-scaled GEMMs take a forward bias or the GELU backward (DGELU), not both (cuBLASLt's block scale modes)"
        );
    }
    let (am, bm) = (
        block_mode_attr(f, "a_block_dim")?,
        block_mode_attr(f, "b_block_dim")?,
    );
    let a = block_tensor_of(f.args[0], f.args[1], am, "operand a")?;
    let b = block_tensor_of(f.args[2], f.args[3], bm, "operand b")?;
    let d = tensor_of(f.rets[0], "result d", None)?;
    if !matches!(d.data.dtype, DType::BF16 | DType::F32 | DType::F16) {
        unsupported!(
            "result d is {}: the block-scaled GEMM writes bf16, f16 or f32",
            d.data.dtype.name()
        );
    }
    let extra = |i: usize, what| tensor_of(f.args[i], what, None);
    let bias = has_bias.then(|| extra(4, "operand bias")).transpose()?;
    let pre_gelu = dgelu.then(|| extra(4, "operand pre_gelu")).transpose()?;
    let workspace = match f.rets.get(1) {
        Some(w) => Some(tensor_of(w, "result workspace", None)?),
        None => None,
    };
    Ok(BlockCall {
        a,
        b,
        d,
        bias,
        pre_gelu,
        workspace,
        split_accumulator: f.attrs.get("split_accumulator").is_none_or(|&v| v != 0),
    })
}

/// The execute stage of a block GEMM: D = a b^T (+ bias | * gelu'(pre)) through the GEMM
/// entry of nvte_cublas_gemm (`gemm::block::cublas_gemm_scaled`), TN with TE's A = b.
fn run_block(f: &Frame) -> Result<()> {
    if f.stage != STAGE_EXECUTE {
        return Ok(()); // nothing to prepare: the GEMM's plans are made at execution
    }
    let c = decode_block(f)?;
    let stream = f.stream()?;
    let args = crate::gemm::Operands {
        a: &c.b,
        b: &c.a,
        d: &c.d,
        bias: c.bias.as_ref(),
        pre_gelu_out: c.pre_gelu.as_ref(),
        transa: true,
        transb: false,
        grad: c.pre_gelu.is_some(),
        workspace: c.workspace.as_ref(),
        accumulate: false,
        use_split_accumulator: c.split_accumulator,
        math_sm_count: 0,
    };
    // SAFETY: XLA's operand and result buffers of this call, device memory of the shapes
    // and element types XLA gives, alive until the work on XLA's stream completes; the
    // GEMM validates them against each other before any device work.
    let checked = unsafe { crate::cuda::Checked::vouched(&args) };
    crate::gemm::block::cublas_gemm_scaled(checked, 1.0, 0.0, stream)
}

/// XLA FFI handler (as `nvte_comm_xla_all_gather_gemm`) of the block-scaled FP8 GEMM
/// `d = a b^T` (TE's Float8BlockScaling), without communication or context. Operands:
/// `a` f8 [M, K] with `a_scale_inv` f32 2-D, `b` f8 [N, K] with `b_scale_inv`, the scales
/// in TE's GEMM-ready layout (1D blocks: [ceil(K/128), roundup(rows, 4)], entry (K block,
/// row); 2D: [ceil(rows/128), roundup(ceil(K/128), 4)]); then `bias` [N] when `has_bias`,
/// or the GELU pre-activation [M, N] when `dgelu` (d = (a b^T) * gelu'(pre)). Results:
/// `d` [M, N] bf16 / f16 / f32, optionally a u8 workspace for cuBLASLt. Attributes:
/// `a_block_dim`, `b_block_dim` (1 or 2; not both 2), `has_bias`, `dgelu`,
/// `split_accumulator` (default true). Hopper only; command-buffer compatible (captured,
/// the GEMM keeps cuBLASLt's heuristic's first algorithm: NVTE_COMM_GEMM_TUNE times
/// candidates on eager runs only; in the JAX block step on an H200 the eager runs' timed
/// choices measured no faster).
///
/// # Safety
/// Called by XLA with its call frame.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvte_comm_xla_block_gemm(call_frame: *mut c_void) -> *mut c_void {
    entry!(named, |name| {
        // SAFETY: forwarded from XLA.
        unsafe { handle(name, run_block, call_frame) }
    })
}

// ---- the block quantization of FP8 block scaling (no communication, no context) ----

/// One decoded call of [`nvte_comm_xla_block_quantize`]: the input, the block-scaled
/// output (rowwise and / or columnwise buffers, TE's GEMM-ready layout) and the options.
struct QuantizeCall {
    input: Tensor,
    output: Tensor,
    /// the FP8 type written (the first FP8 result's)
    out_dtype: DType,
    cfg: crate::kernels::block::BlockQuantConfig,
}

/// A result of a block quantization: FP8 data or its f32 scale inverse (2-D), as a buffer.
fn quantize_result(b: &XBuffer, what: &str, scale: bool) -> Result<Buffer> {
    let t = tensor_of(b, what, None)?.data;
    if scale && (t.dtype != DType::F32 || t.shape.as_slice().len() != 2) {
        invalid!(
            "{what} is {} of shape {}: it must be f32 and 2-D (TE's GEMM-ready layout)",
            t.dtype.name(),
            t.shape
        );
    }
    if !scale && !t.dtype.is_fp8() {
        unsupported!(
            "{what} is {}: a block quantization writes f8e4m3fn or f8e5m2",
            t.dtype.name()
        );
    }
    Ok(t)
}

/// The operand, results and attributes as TE tensors (no device work). Operands: `x`
/// [R, C] (f32 / bf16 / f16), then the GELU's input `pre` (x's shape and type) when
/// `dgelu`. Results: `q` [R, C] and its `scale_inv` when `rowwise`
/// (default true), then `q_t` [C, R] and its `scale_inv_t` when `columnwise`, then the
/// bias-gradient partials `dbias_parts` f32 [R / 128, C] when `dbias`.
fn decode_quantize(f: &Frame) -> Result<QuantizeCall> {
    let rowwise = f.flag_or("rowwise", true)?;
    let columnwise = f.flag("columnwise")?;
    let dbias = f.flag("dbias")?;
    let dgelu = f.flag("dgelu")?;
    let dirs = 2 * (rowwise as usize + columnwise as usize);
    let want = dirs + dbias as usize;
    let args = 1 + dgelu as usize;
    if f.args.len() != args || f.rets.len() != want || dirs == 0 {
        invalid!(
            "{} operands and {} results given: a block quantization takes the input x (and the GELU's input pre when dgelu = {dgelu}) and writes q, scale_inv (rowwise = {rowwise}) then q_t, scale_inv_t (columnwise = {columnwise}) then dbias_parts (dbias = {dbias}): {args} operand{} and {want} results, at least one direction",
            f.args.len(),
            f.rets.len(),
            if args == 1 { "" } else { "s" }
        );
    }
    let mode = block_mode_attr(f, "block_dim")?;
    let eps = f.float_or("amax_epsilon", 0.0);
    if !(eps >= 0.0 && eps <= f32::MAX as f64) {
        invalid!("attribute `amax_epsilon` = {eps}: a finite value >= 0");
    }
    let input = tensor_of(f.args[0], "operand x", None)?;
    let mut output = Tensor {
        scaling_mode: mode.scaling_mode(),
        ..Default::default()
    };
    if rowwise {
        output.data = quantize_result(f.rets[0], "result q", false)?;
        output.scale_inv = quantize_result(f.rets[1], "result scale_inv", true)?;
    }
    if columnwise {
        let i = 2 * rowwise as usize;
        output.columnwise_data = quantize_result(f.rets[i], "result q_t", false)?;
        output.columnwise_scale_inv = quantize_result(f.rets[i + 1], "result scale_inv_t", true)?;
    }
    let dbias_parts = match dbias {
        true => tensor_of(f.rets[dirs], "result dbias_parts", None)?.data,
        false => Buffer::default(),
    };
    let cfg = crate::kernels::block::BlockQuantConfig {
        force_pow_2_scales: f.flag("power_2_scale")?,
        amax_epsilon: eps as f32,
        noop: DevPtr::NULL,
        format: crate::tensor::ScaleFormat::GemmReady,
        gelu: f.flag("gelu")?,
        dbias_parts,
        dgelu_input: match dgelu {
            true => tensor_of(f.args[1], "operand pre", None)?.data,
            false => Buffer::default(),
        },
    };
    let out_dtype = if rowwise {
        output.data.dtype
    } else {
        output.columnwise_data.dtype
    };
    Ok(QuantizeCall {
        input,
        output,
        out_dtype,
        cfg,
    })
}

/// Initialize: the kernel loaded (outside any capture); execute: the quantization on
/// XLA's stream (`kernels::block::quantize`, nvte_quantize's block path: its checks of
/// shapes, layouts and alignment come before any device work).
fn run_quantize(f: &Frame) -> Result<()> {
    if f.stage != STAGE_INITIALIZE && f.stage != STAGE_EXECUTE {
        return Ok(());
    }
    let c = decode_quantize(f)?;
    let stream = f.stream()?;
    let k = (c.input.data.dtype, c.out_dtype);
    let prepare = || crate::kernels::block::prepare_quantize(k.0, k.1, stream);
    if f.stage == STAGE_INITIALIZE {
        return prepare();
    }
    // SAFETY: XLA's operand and result buffers of this call, device memory of the shapes
    // and element types XLA gives, alive until the work on XLA's stream completes; the
    // quantization checks them against each other before any device work.
    let (i, o) = unsafe {
        (
            crate::cuda::Checked::vouched(&c.input),
            crate::cuda::Checked::vouched(&c.output),
        )
    };
    // The call's checks first (no device work); then the kernel's module, loaded by the
    // initialize stage (a cache look-up here): where XLA ran none before a captured
    // execution, the module load (no stream work) is made with this thread's capture mode
    // relaxed, outside the graph being captured.
    crate::kernels::block::check_quantize(i, o, &c.cfg)?;
    {
        let _relaxed = crate::cuda::resources::RelaxedCapture::new();
        prepare()?;
    }
    // The memset on XLA's stream runs in that stream's context (the thread's current one
    // need not be it where a thread serves several devices).
    let _guard = crate::cuda::ContextGuard::for_stream_no_device(stream)?;
    zero_scale_padding(&c, stream)?;
    crate::kernels::block::quantize(i, o, &c.cfg, stream).map(|_| ())
}

/// XLA's results are defined to the last byte: a 2D scale_inv whose block count is not a
/// multiple of 4 (TE's GEMM-ready padding, which the kernel leaves as it is, as
/// nvte_quantize does) is zeroed first, so the padding reads 0 and not what the memory
/// held before. Called after the call's checks (the buffers' shapes are XLA's own).
fn zero_scale_padding(c: &QuantizeCall, stream: StreamHandle) -> Result<()> {
    for &(ptr, bytes) in padded_scales(c).iter() {
        // SAFETY: an XLA result of this call (f32, `bytes` of it: decode_quantize's
        // tensor), written only by this call's work on `stream`, which follows.
        unsafe { crate::cuda::resources::memset_async(ptr, bytes, stream)? };
    }
    Ok(())
}

/// The scale_inv results of a call with padding entries, as (address, bytes): 2D ones
/// with more entries than the input has 128 x 128 blocks (1D ones have none: R and C are
/// multiples of 128).
fn padded_scales(c: &QuantizeCall) -> crate::host::Small<(DevPtr, usize), 2> {
    let mut out = crate::host::Small::new();
    if c.output.scaling_mode != BlockMode::TwoD.scaling_mode() {
        return out;
    }
    let dims = c.input.data.shape.as_slice();
    let blocks = dims.iter().map(|d| d.div_ceil(128)).product::<usize>();
    for s in [&c.output.scale_inv, &c.output.columnwise_scale_inv] {
        if !s.ptr.is_null() && s.numel() > blocks {
            out.push((s.ptr, s.bytes()));
        }
    }
    out
}

/// XLA FFI handler (as `nvte_comm_xla_all_gather_gemm`; initialize and execute stages) of
/// the block quantization of TE's Float8BlockScaling (the kernel of nvte_quantize into an
/// NVTE_BLOCK_SCALING_1D / _2D tensor), without communication or context: one read of
/// each 128x128 tile of `x` writes the rowwise and / or columnwise FP8 data with their
/// scale inverses in TE's GEMM-ready layout, what [`nvte_comm_xla_block_gemm`] takes.
/// Operand: `x` [R, C] f32 / bf16 / f16, R and C multiples of 128. Results: when
/// `rowwise` (default true) `q` [R, C] f8e4m3fn / f8e5m2 and `scale_inv` f32 (1D: [C/128,
/// R], entry (column block, row); 2D: [R/128, roundup(C/128, 4)]); then when `columnwise`
/// `q_t` [C, R] (the transpose, quantized along its rows: 1D blocks are 128 x 1 of `x`)
/// and `scale_inv_t` (1D: [R/128, C]; 2D: [C/128, roundup(R/128, 4)], the rowwise scales
/// transposed). Padding entries of a scale_inv (2D, block counts not multiples of 4) are
/// zeroed (the GEMM never reads them; nvte_quantize leaves them as they are). Attributes: `block_dim` (1 or 2),
/// `power_2_scale` (bool, default false: each scale rounded down to a power of 2),
/// `amax_epsilon` (float, default 0), `rowwise`, `columnwise`; `gelu` (bool, default
/// false: quantize GELU(x), tanh approximation, rounded to x's type, instead of x: the
/// activation fused into its cast); `dbias` (bool: one more result `dbias_parts` f32
/// [R/128, C], each 128-row tile's column sums of the values quantized, whose sum over
/// the first dimension is a bias gradient); `dgelu` (bool: a second operand `pre`, x's
/// shape and type; quantize x * GELU'(pre), the GELU's backward, rounded to x's type;
/// not with `gelu`). The initialize stage
/// compiles and loads the kernel; the execute stage launches it (command-buffer
/// compatible: where no initialize stage ran first, it loads the kernel with the capture
/// mode relaxed, outside any graph being captured).
///
/// # Safety
/// Called by XLA with its call frame.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvte_comm_xla_block_quantize(call_frame: *mut c_void) -> *mut c_void {
    entry!(named, |name| {
        // SAFETY: forwarded from XLA.
        unsafe { handle(name, run_quantize, call_frame) }
    })
}

/// Offsets and sizes of the structs above, by C name, for the layout test against
/// c_api.h (`python/tests/test_jax_host.py` compares them with a C program's).
pub(crate) fn layout() -> Vec<(&'static str, usize)> {
    macro_rules! off {
        ($t:ty, $c:literal, $($f:ident => $cf:literal),*) => {
            vec![(concat!("sizeof ", $c), size_of::<$t>()), $((concat!($c, ".", $cf), offset_of!($t, $f))),*]
        };
    }
    let mut v = Vec::new();
    v.extend(off!(ExtensionBase, "XLA_FFI_Extension_Base", ty => "type", next => "next"));
    v.extend(off!(ApiVersion, "XLA_FFI_Api_Version", major_version => "major_version", minor_version => "minor_version"));
    v.extend(
        off!(ErrorCreateArgs, "XLA_FFI_Error_Create_Args", message => "message", errc => "errc"),
    );
    v.extend(off!(StreamGetArgs, "XLA_FFI_Stream_Get_Args", ctx => "ctx", stream => "stream"));
    v.extend(off!(DeviceOrdinalGetArgs, "XLA_FFI_DeviceOrdinal_Get_Args", ctx => "ctx", device_ordinal => "device_ordinal"));
    v.extend(off!(Api, "XLA_FFI_Api",
        api_version => "api_version",
        error_create => "XLA_FFI_Error_Create",
        stream_get => "XLA_FFI_Stream_Get",
        device_ordinal_get => "XLA_FFI_DeviceOrdinal_Get"));
    v.extend(off!(XBuffer, "XLA_FFI_Buffer", dtype => "dtype", data => "data", rank => "rank", dims => "dims"));
    v.extend(off!(Args, "XLA_FFI_Args", size => "size", types => "types", args => "args"));
    v.extend(off!(Rets, "XLA_FFI_Rets", size => "size", types => "types", rets => "rets"));
    v.extend(off!(ByteSpan, "XLA_FFI_ByteSpan", ptr => "ptr", len => "len"));
    v.extend(off!(Scalar, "XLA_FFI_Scalar", dtype => "dtype", value => "value"));
    v.extend(off!(Attrs, "XLA_FFI_Attrs", size => "size", types => "types", names => "names", attrs => "attrs"));
    v.extend(off!(CallFrame, "XLA_FFI_CallFrame",
        extension_start => "extension_start", api => "api", ctx => "ctx", stage => "stage",
        args => "args", rets => "rets", attrs => "attrs"));
    v.extend(off!(Metadata, "XLA_FFI_Metadata", api_version => "api_version", traits => "traits", state_type_id => "state_type_id"));
    v.extend(off!(MetadataExtension, "XLA_FFI_Metadata_Extension", metadata => "metadata"));
    v
}

/// The layout table as text, one `name value` line each (for the layout test, which
/// reads it through ctypes). Returns the number of bytes needed (with the NUL); writes
/// at most `cap` bytes.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_xla_layout(out: *mut c_char, cap: usize) -> usize {
    entry!(or 0, {
        let mut s = String::new();
        for (k, v) in layout() {
            s.push_str(&format!("{k} {v}\n"));
        }
        let bytes = s.as_bytes();
        if !out.is_null() && cap > 0 {
            let n = bytes.len().min(cap - 1);
            // SAFETY: the caller's buffer of `cap` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), out as *mut u8, n);
                *out.add(n) = 0;
            }
        }
        Ok(bytes.len() + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One XLA buffer with its own dimensions (fake device addresses: nothing here
    /// reaches the device).
    struct Buf {
        dims: Vec<i64>,
        b: XBuffer,
    }

    fn buf(dtype: i32, dims: &[i64]) -> Buf {
        let mut x = Buf {
            dims: dims.to_vec(),
            b: XBuffer {
                struct_size: size_of::<XBuffer>(),
                extension_start: std::ptr::null_mut(),
                dtype,
                data: 0x1000 as *mut c_void,
                rank: dims.len() as i64,
                dims: std::ptr::null_mut(),
            },
        };
        // The dimensions live on the Vec's heap: moving the Buf keeps them in place.
        x.b.dims = x.dims.as_mut_ptr();
        x
    }

    static MESSAGES: Mutex<Vec<String>> = Mutex::new(Vec::new());

    unsafe extern "C" fn error_create(a: *mut ErrorCreateArgs) -> *mut c_void {
        // SAFETY: the handler's argument struct with a NUL-terminated message.
        let msg = unsafe { std::ffi::CStr::from_ptr((*a).message) };
        MESSAGES
            .lock()
            .unwrap()
            .push(msg.to_string_lossy().into_owned());
        0x1234 as *mut c_void
    }

    unsafe extern "C" fn stream_get(a: *mut StreamGetArgs) -> *mut c_void {
        // SAFETY: the handler's argument struct.
        unsafe { (*a).stream = std::ptr::null_mut() };
        std::ptr::null_mut()
    }

    fn api() -> Box<Api> {
        // SAFETY: every field of Api is an integer, a raw pointer or an Option of a
        // function pointer: all-zero is a valid value of each (0, NULL, None).
        let mut a: Box<Api> = Box::new(unsafe { std::mem::zeroed() });
        a.struct_size = size_of::<Api>();
        a.error_create = Some(error_create);
        a.stream_get = Some(stream_get);
        a
    }

    /// A 1D-scaled a [256, 512] and a 2D-scaled b [128, 512] with GEMM-ready scales, d
    /// bf16 [256, 128].
    fn operands() -> Vec<Buf> {
        vec![
            buf(XDT_F8E4M3FN, &[256, 512]),
            buf(XDT_F32, &[4, 256]),
            buf(XDT_F8E4M3FN, &[128, 512]),
            buf(XDT_F32, &[1, 4]),
        ]
    }

    fn frame<'a>(
        api: &'a Api,
        stage: c_int,
        args: &'a [Buf],
        rets: &'a [Buf],
        attrs: &[(&str, i64)],
    ) -> Frame<'a> {
        Frame {
            api,
            ctx: std::ptr::null_mut(),
            stage,
            args: args.iter().map(|b| &b.b).collect(),
            rets: rets.iter().map(|b| &b.b).collect(),
            attrs: attrs.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
            floats: HashMap::new(),
        }
    }

    const DIMS: [(&str, i64); 2] = [("a_block_dim", 1), ("b_block_dim", 2)];

    #[test]
    fn block_gemm_decodes_block_tensors_at_their_scale_shapes() {
        let api = api();
        let args = operands();
        let rets = vec![buf(XDT_BF16, &[256, 128]), buf(XDT_U8, &[1 << 20])];
        let f = frame(&api, STAGE_EXECUTE, &args, &rets, &DIMS);
        let c = decode_block(&f).unwrap();
        assert_eq!(c.a.scaling_mode, BlockMode::OneD.scaling_mode());
        assert_eq!(c.b.scaling_mode, BlockMode::TwoD.scaling_mode());
        assert_eq!(c.a.scale_inv.shape.as_slice(), &[4, 256]);
        assert_eq!(c.b.scale_inv.shape.as_slice(), &[1, 4]);
        assert_eq!(c.a.data.dtype, DType::E4M3);
        assert_eq!(c.d.data.shape.as_slice(), &[256, 128]);
        assert_eq!(c.workspace.unwrap().data.bytes(), 1 << 20);
        assert!(c.bias.is_none() && c.pre_gelu.is_none() && c.split_accumulator);
        // The optional operands by their flags; split_accumulator off.
        let mut with_bias = operands();
        with_bias.push(buf(XDT_BF16, &[128]));
        let attrs = [DIMS[0], DIMS[1], ("has_bias", 1), ("split_accumulator", 0)];
        let f = frame(&api, STAGE_EXECUTE, &with_bias, &rets[..1], &attrs);
        let c = decode_block(&f).unwrap();
        assert_eq!(c.bias.unwrap().data.shape.as_slice(), &[128]);
        assert!(c.workspace.is_none() && !c.split_accumulator);
        let attrs = [DIMS[0], DIMS[1], ("dgelu", 1)];
        let f = frame(&api, STAGE_EXECUTE, &with_bias, &rets[..1], &attrs);
        assert!(decode_block(&f).unwrap().pre_gelu.is_some());
    }

    fn refused(f: &Frame, kind: ErrorKind, piece: &str) {
        let Err(e) = decode_block(f) else {
            panic!("decoded, expected {piece}")
        };
        assert_eq!(e.kind, kind, "{}", e.msg);
        assert!(e.msg.contains(piece), "{}", e.msg);
    }

    #[test]
    fn block_gemm_refuses_bad_frames() {
        let api = api();
        let rets = vec![buf(XDT_BF16, &[256, 128])];
        let ok = operands();
        let f = |args, rets, attrs| frame(&api, STAGE_EXECUTE, args, rets, attrs);
        refused(
            &f(&ok[..3], &rets, &DIMS),
            ErrorKind::InvalidArgument,
            "ask for 4 operands",
        );
        refused(
            &f(&ok, &rets, &[("a_block_dim", 3), DIMS[1]]),
            ErrorKind::InvalidArgument,
            "`a_block_dim` = 3",
        );
        refused(
            &f(&ok, &rets, &DIMS[..1]),
            ErrorKind::InvalidArgument,
            "`b_block_dim` is missing",
        );
        let mut both = operands();
        both.push(buf(XDT_BF16, &[128]));
        both.push(buf(XDT_BF16, &[256, 128]));
        let attrs = [DIMS[0], DIMS[1], ("has_bias", 1), ("dgelu", 1)];
        refused(&f(&both, &rets, &attrs), ErrorKind::Unsupported, "not both");
        let mut flat = operands();
        flat[1] = buf(XDT_F32, &[1024]);
        refused(&f(&flat, &rets, &DIMS), ErrorKind::InvalidArgument, "2-D");
        let mut half = operands();
        half[3] = buf(XDT_BF16, &[1, 4]);
        refused(&f(&half, &rets, &DIMS), ErrorKind::InvalidArgument, "f32");
        let mut wide = operands();
        wide[0] = buf(XDT_BF16, &[256, 512]);
        refused(&f(&wide, &rets, &DIMS), ErrorKind::Unsupported, "f8e4m3fn");
        let fp8_out = vec![buf(XDT_F8E4M3FN, &[256, 128])];
        refused(
            &f(&ok, &fp8_out, &DIMS),
            ErrorKind::Unsupported,
            "bf16, f16 or f32",
        );
    }

    /// The GEMM entry (nvte_cublas_gemm's) checks the decoded call before any device
    /// work; the initialize stage does nothing.
    #[test]
    fn block_gemm_reaches_the_gemm_checks() {
        let api = api();
        let rets = vec![buf(XDT_BF16, &[256, 128])];
        let mut two = operands();
        two[1] = buf(XDT_F32, &[2, 4]);
        let attrs = [("a_block_dim", 2), ("b_block_dim", 2)];
        let e = run_block(&frame(&api, STAGE_EXECUTE, &two, &rets, &attrs)).unwrap_err();
        assert!(e.msg.contains("both NVTE_BLOCK_SCALING_2D"), "{}", e.msg);
        let mut shape = operands();
        shape[1] = buf(XDT_F32, &[256, 4]); // the compact layout, not GEMM-ready
        let e = run_block(&frame(&api, STAGE_EXECUTE, &shape, &rets, &DIMS)).unwrap_err();
        assert!(e.msg.contains("GEMM-ready layout"), "{}", e.msg);
        let wrong_d = vec![buf(XDT_BF16, &[128, 256])];
        let e = run_block(&frame(&api, STAGE_EXECUTE, &operands(), &wrong_d, &DIMS)).unwrap_err();
        assert!(e.msg.contains("must be [n, m] = [256, 128]"), "{}", e.msg);
        // Initialize: nothing decoded, nothing refused.
        run_block(&frame(&api, STAGE_INITIALIZE, &two[..1], &rets, &[])).unwrap();
    }

    /// x bf16 [256, 384] with both directions' results for `block_dim` (GEMM-ready).
    fn quantize_frame_bufs(dim: i64) -> (Vec<Buf>, Vec<Buf>) {
        let (s, st) = if dim == 1 {
            ([3, 256], [2, 384])
        } else {
            ([2, 4], [3, 4])
        };
        let rets = vec![
            buf(XDT_F8E4M3FN, &[256, 384]),
            buf(XDT_F32, &s),
            buf(XDT_F8E4M3FN, &[384, 256]),
            buf(XDT_F32, &st),
        ];
        (vec![buf(XDT_BF16, &[256, 384])], rets)
    }

    #[test]
    fn block_quantize_decodes_both_directions_and_the_options() {
        let api = api();
        let (args, rets) = quantize_frame_bufs(1);
        let attrs = [("block_dim", 1), ("columnwise", 1), ("power_2_scale", 1)];
        let mut f = frame(&api, STAGE_EXECUTE, &args, &rets, &attrs);
        f.floats.insert("amax_epsilon".into(), 0.25);
        let c = decode_quantize(&f).unwrap();
        assert_eq!(c.output.block_mode(), Some(BlockMode::OneD));
        assert_eq!(c.output.scale_inv.shape.as_slice(), &[3, 256]);
        assert_eq!(c.output.columnwise_data.shape.as_slice(), &[384, 256]);
        assert_eq!(c.output.columnwise_scale_inv.shape.as_slice(), &[2, 384]);
        assert_eq!(
            (c.out_dtype, c.input.data.dtype),
            (DType::E4M3, DType::BF16)
        );
        assert!(c.cfg.force_pow_2_scales && c.cfg.amax_epsilon == 0.25);
        // Rowwise only (the default): two results; columnwise only: the transpose's.
        let f = frame(&api, STAGE_EXECUTE, &args, &rets[..2], &[("block_dim", 2)]);
        let c = decode_quantize(&f).unwrap();
        assert!(c.output.columnwise_data.ptr.is_null() && !c.cfg.force_pow_2_scales);
        assert_eq!(c.cfg.amax_epsilon, 0.0);
        let attrs = [("block_dim", 2), ("rowwise", 0), ("columnwise", 1)];
        let f = frame(&api, STAGE_EXECUTE, &args, &rets[2..], &attrs);
        let c = decode_quantize(&f).unwrap();
        assert!(c.output.data.ptr.is_null());
        assert_eq!(c.output.columnwise_data.shape.as_slice(), &[384, 256]);
    }

    #[test]
    fn block_quantize_zeroes_only_padded_2d_scales() {
        let api = api();
        // [256, 384]: 2 x 3 blocks; 2D scales [2, 4] and [3, 4] both padded, 1D none.
        for (dim, padded) in [(1, 0), (2, 2)] {
            let (args, rets) = quantize_frame_bufs(dim);
            let attrs = [("block_dim", dim), ("columnwise", 1)];
            let f = frame(&api, STAGE_EXECUTE, &args, &rets, &attrs);
            assert_eq!(
                padded_scales(&decode_quantize(&f).unwrap()).len(),
                padded,
                "{dim}D"
            );
        }
        // [256, 512]: 2 x 4 blocks; the rowwise [2, 4] unpadded, the columnwise [4, 4] padded.
        let args = vec![buf(XDT_BF16, &[256, 512])];
        let rets = vec![
            buf(XDT_F8E4M3FN, &[256, 512]),
            buf(XDT_F32, &[2, 4]),
            buf(XDT_F8E4M3FN, &[512, 256]),
            buf(XDT_F32, &[4, 4]),
        ];
        let f = frame(
            &api,
            STAGE_EXECUTE,
            &args,
            &rets,
            &[("block_dim", 2), ("columnwise", 1)],
        );
        let c = decode_quantize(&f).unwrap();
        let p = padded_scales(&c);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0], (c.output.columnwise_scale_inv.ptr, 64));
    }

    fn quantize_refused(f: &Frame, kind: ErrorKind, piece: &str) {
        let Err(e) = run_quantize(f) else {
            panic!("ran, expected {piece}")
        };
        assert_eq!(e.kind, kind, "{}", e.msg);
        assert!(e.msg.contains(piece), "{}", e.msg);
    }

    /// Refusals of the frame (decode) and of the quantization's own checks (shapes,
    /// layouts), all before any device work.
    #[test]
    fn block_quantize_refuses_bad_calls_before_device_work() {
        use ErrorKind::{InvalidArgument as Inv, Unsupported as Uns};
        let api = api();
        let (args, rets) = quantize_frame_bufs(1);
        let both = [("block_dim", 1), ("columnwise", 1)];
        let f = |a, r, at| frame(&api, STAGE_EXECUTE, a, r, at);
        quantize_refused(&f(&args, &rets[..2], &both), Inv, "4 results");
        quantize_refused(
            &f(&args, &[], &[("block_dim", 1), ("rowwise", 0)]),
            Inv,
            "at least one",
        );
        quantize_refused(
            &f(&args, &rets[..2], &[("block_dim", 3)]),
            Inv,
            "`block_dim` = 3",
        );
        quantize_refused(&f(&args, &rets[..2], &[]), Inv, "`block_dim` is missing");
        let mut g = f(&args, &rets[..2], &[("block_dim", 1)]);
        g.floats.insert("amax_epsilon".into(), -1.0);
        quantize_refused(&g, Inv, "`amax_epsilon` = -1");
        g.floats.insert("block_dim".into(), 1.0);
        quantize_refused(&g, Inv, "`block_dim` is a float");
        // A float flag is refused by name, not read as false.
        let mut h = f(&args, &rets[..2], &[("block_dim", 1)]);
        h.floats.insert("columnwise".into(), 1.0);
        quantize_refused(&h, Inv, "`columnwise` is a float");
        let mut b1 = quantize_frame_bufs(1).1;
        b1[0] = buf(XDT_BF16, &[256, 384]);
        quantize_refused(&f(&args, &b1, &both), Uns, "f8e4m3fn or f8e5m2");
        let mut b2 = quantize_frame_bufs(1).1;
        b2[3] = buf(XDT_F32, &[768]);
        quantize_refused(&f(&args, &b2, &both), Inv, "2-D");
        // The quantization's checks: the compact 1D scales are not what this call writes,
        // the columnwise data must be the transpose, the input whole 128 x 128 tiles.
        let mut b3 = quantize_frame_bufs(1).1;
        b3[1] = buf(XDT_F32, &[256, 3]);
        quantize_refused(&f(&args, &b3, &both), Inv, "is COMPACT");
        let mut b4 = quantize_frame_bufs(2).1;
        b4[2] = buf(XDT_F8E4M3FN, &[256, 384]);
        quantize_refused(
            &f(&args, &b4, &[("block_dim", 2), ("columnwise", 1)]),
            Inv,
            "data [384, 256]",
        );
        let odd = vec![buf(XDT_BF16, &[200, 384])];
        let r = vec![buf(XDT_F8E4M3FN, &[200, 384]), buf(XDT_F32, &[3, 200])];
        quantize_refused(&f(&odd, &r, &[("block_dim", 1)]), Inv, "multiples of 128");
        let wide = vec![buf(XDT_F8E4M3FN, &[256, 384])];
        quantize_refused(
            &f(&wide, &rets[..2], &[("block_dim", 1)]),
            Uns,
            "reads kNVTEFloat32",
        );
        // Initialize: the frame is checked before the kernel is loaded.
        let g = frame(
            &api,
            STAGE_INITIALIZE,
            &args,
            &rets[..1],
            &[("block_dim", 1)],
        );
        quantize_refused(&g, Inv, "1 operand and 2 results");
    }

    #[test]
    fn block_quantize_fusions_take_their_operand_and_result() {
        use ErrorKind::InvalidArgument as Inv;
        let api = api();
        let (args, rets) = quantize_frame_bufs(1);
        let f = |a, r, at| frame(&api, STAGE_EXECUTE, a, r, at);
        // The fusions: dgelu takes the GELU's input as a second operand (x's shape and
        // type), dbias writes one more result (f32 [R / 128, C]); gelu and dgelu exclude
        // each other.
        let x = || buf(XDT_BF16, &[256, 384]);
        let with_parts = |p: &[i64]| {
            let mut r = quantize_frame_bufs(1).1;
            r.truncate(2);
            r.push(buf(XDT_F32, p));
            r
        };
        let (pre, parts) = (vec![x(), x()], with_parts(&[2, 384]));
        let one = [("block_dim", 1)];
        quantize_refused(
            &f(
                &args,
                &parts,
                &[("block_dim", 1), ("dbias", 1), ("dgelu", 1)],
            ),
            Inv,
            "2 operands and 3 results",
        );
        quantize_refused(&f(&pre, &rets[..2], &one), Inv, "1 operand and 2 results");
        quantize_refused(&f(&args, &parts, &one), Inv, "1 operand and 2 results");
        let bad_parts = with_parts(&[256, 384]);
        quantize_refused(
            &f(&args, &bad_parts, &[("block_dim", 1), ("dbias", 1)]),
            Inv,
            "kNVTEFloat32 [2, 384]",
        );
        let wrong_pre = vec![x(), buf(XDT_F32, &[256, 384])];
        quantize_refused(
            &f(&wrong_pre, &rets[..2], &[("block_dim", 1), ("dgelu", 1)]),
            Inv,
            "the input's type and shape",
        );
        quantize_refused(
            &f(
                &pre,
                &rets[..2],
                &[("block_dim", 1), ("dgelu", 1), ("gelu", 1)],
            ),
            Inv,
            "not both",
        );
        let g = f(
            &pre,
            &parts,
            &[("block_dim", 1), ("dgelu", 1), ("dbias", 1)],
        );
        let c = decode_quantize(&g).unwrap();
        assert!(
            !c.cfg.gelu && !c.cfg.dgelu_input.ptr.is_null() && !c.cfg.dbias_parts.ptr.is_null()
        );
        assert_eq!(c.cfg.dbias_parts.shape.as_slice(), &[2, 384]);
        let c = decode_quantize(&f(&args, &rets[..2], &[("block_dim", 1), ("gelu", 1)])).unwrap();
        assert!(c.cfg.gelu && c.cfg.dgelu_input.ptr.is_null() && c.cfg.dbias_parts.ptr.is_null());
    }

    /// Call `handler` through its C entry with an execute-stage frame of `args` and `rets`
    /// and one scalar attribute `name` (XLA dtype `dtype`, value at `value`): it must return
    /// XLA's error (the test API's 0x1234); the handler's recorded message (it starts
    /// with `prefix`; other handlers' tests may record theirs meanwhile).
    fn c_entry_message(
        handler: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
        prefix: &str,
        (args, rets): (&[Buf], &[Buf]),
        (name, dtype, value): (&[u8], i32, *mut c_void),
    ) -> String {
        let api = api();
        let mut types = vec![ARG_BUFFER; args.len()];
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|b| &b.b as *const _ as _).collect();
        let mut rtypes = vec![ARG_BUFFER; rets.len()];
        let mut rptrs: Vec<*mut c_void> = rets.iter().map(|b| &b.b as *const _ as _).collect();
        let mut span = ByteSpan {
            ptr: name.as_ptr() as _,
            len: name.len(),
        };
        let mut scalar = Scalar { dtype, value };
        let mut names = [&mut span as *mut ByteSpan];
        let mut atypes = [ATTR_SCALAR];
        let mut aptrs = [&mut scalar as *mut Scalar as *mut c_void];
        let mut cf = CallFrame {
            struct_size: size_of::<CallFrame>(),
            extension_start: std::ptr::null_mut(),
            api: &*api,
            ctx: std::ptr::null_mut(),
            stage: STAGE_EXECUTE,
            args: Args {
                struct_size: size_of::<Args>(),
                extension_start: std::ptr::null_mut(),
                size: args.len() as _,
                types: types.as_mut_ptr(),
                args: ptrs.as_mut_ptr(),
            },
            rets: Rets {
                struct_size: size_of::<Rets>(),
                extension_start: std::ptr::null_mut(),
                size: rets.len() as _,
                types: rtypes.as_mut_ptr(),
                rets: rptrs.as_mut_ptr(),
            },
            attrs: Attrs {
                struct_size: size_of::<Attrs>(),
                extension_start: std::ptr::null_mut(),
                size: 1,
                types: atypes.as_mut_ptr(),
                names: names.as_mut_ptr(),
                attrs: aptrs.as_mut_ptr(),
            },
        };
        // SAFETY: a complete call frame of live buffers and attributes.
        let err = unsafe { handler(&mut cf as *mut CallFrame as _) };
        assert_eq!(err as usize, 0x1234);
        let mut all = MESSAGES.lock().unwrap();
        let at = all.iter().rposition(|m| m.starts_with(prefix));
        all.remove(at.expect("the handler's message"))
    }

    /// Through the C entry: the refusal is XLA's error, named by the handler.
    #[test]
    fn block_quantize_reports_errors_to_xla() {
        let (args, rets) = quantize_frame_bufs(1);
        let mut v = f32::NAN;
        let msg = c_entry_message(
            nvte_comm_xla_block_quantize,
            "nvte_comm_xla_block_quantize",
            (&args, &rets[..2]),
            (b"amax_epsilon", XDT_F32, &mut v as *mut f32 as _),
        );
        assert!(msg.contains("`block_dim` is missing"), "{msg}");
    }

    /// Through the C entry with XLA's call frame: the refusal comes back as XLA's error,
    /// named by the handler.
    #[test]
    fn block_gemm_reports_errors_to_xla() {
        let mut v = 7i32;
        let msg = c_entry_message(
            nvte_comm_xla_block_gemm,
            "nvte_comm_xla_block_gemm",
            (&operands(), &[buf(XDT_BF16, &[256, 128])]),
            (b"a_block_dim", XDT_S32, &mut v as *mut i32 as _),
        );
        assert!(msg.contains("`a_block_dim` = 7"), "{msg}");
    }

    /// XLA's metadata query at registration: each block handler reports API 0.3 and
    /// COMMAND_BUFFER_COMPATIBLE (XLA may capture it into a command buffer / CUDA graph).
    #[test]
    fn block_handlers_declare_command_buffer_compatibility() {
        for handler in [nvte_comm_xla_block_gemm, nvte_comm_xla_block_quantize] {
            let mut md = Metadata {
                struct_size: size_of::<Metadata>(),
                api_version: ApiVersion {
                    struct_size: 0,
                    extension_start: std::ptr::null_mut(),
                    major_version: -1,
                    minor_version: -1,
                },
                traits: 0,
                state_type_id: 7,
            };
            let mut ext = MetadataExtension {
                extension_base: ExtensionBase {
                    struct_size: size_of::<MetadataExtension>(),
                    ty: EXTENSION_METADATA,
                    next: std::ptr::null_mut(),
                },
                metadata: &mut md,
            };
            // SAFETY: all-zero is valid for every field of CallFrame (integers, raw pointers).
            let mut cf: CallFrame = unsafe { std::mem::zeroed() };
            cf.struct_size = size_of::<CallFrame>();
            cf.extension_start = &mut ext as *mut MetadataExtension as *mut ExtensionBase;
            // SAFETY: a call frame carrying the metadata extension, as XLA's query passes it.
            let err = unsafe { handler(&mut cf as *mut CallFrame as _) };
            assert!(err.is_null());
            assert_eq!(md.traits, TRAIT_COMMAND_BUFFER_COMPATIBLE);
            assert_eq!(
                (md.api_version.major_version, md.api_version.minor_version),
                (API_MAJOR, API_MINOR)
            );
            assert_eq!(md.state_type_id, 0);
        }
    }
}
