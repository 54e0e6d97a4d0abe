//! Typed kernel launches: a kernel's parameter list is a Rust tuple `P`, stated once per
//! kernel (family) in a [`Binding`]; a [`Kernel<P>`] looked up through that binding then
//! takes exactly one value of each type per launch. Every binding records its kernels'
//! source file, name pattern and parameter layouts ([`Signature`]), which
//! `tests/kernel_signatures.rs` checks against the `extern "C" __global__` declarations of
//! `kernels/*.cu`. This module holds the library's only `cuLaunchKernel` calls.
use super::{DevPtr, StreamHandle, check_with, nvrtc};
use crate::error::{Error, Result};
use crate::host::StackStr;
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// The C class of a kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgClass {
    /// a pointer (`T *`), passed as an 8-byte device address
    Pointer,
    /// an integer (`int`, `u32`, `u64`, ...)
    Int,
    /// a floating-point value (`float`)
    Float,
    /// a struct passed by value (`repr(C)` on this side)
    Struct,
}

/// A kernel parameter's class and size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    pub class: ArgClass,
    pub size: usize,
}

impl ParamInfo {
    /// A `repr(C)` struct passed by value: its size.
    pub const fn by_value<T>() -> ParamInfo {
        ParamInfo {
            class: ArgClass::Struct,
            size: std::mem::size_of::<T>(),
        }
    }
}

/// A type a kernel takes as a parameter, with its C class and size.
///
/// # Safety
/// `INFO` states the type's C class truly, and its size is `size_of::<Self>()`.
pub unsafe trait KernelArg: Copy {
    const INFO: ParamInfo;
}

macro_rules! kernel_arg {
    ($($t:ty => $class:ident),+) => {$(
        // SAFETY: the class of a plain integer / float / device address, its own size.
        unsafe impl KernelArg for $t {
            const INFO: ParamInfo = ParamInfo {
                class: ArgClass::$class,
                size: std::mem::size_of::<$t>(),
            };
        }
    )+};
}
kernel_arg!(u32 => Int, i32 => Int, u64 => Int, f32 => Float, DevPtr => Pointer);

/// A kernel's parameter list: a tuple of the kernel's parameter types, in order, whose
/// values a launch passes by pointer.
pub trait Params {
    /// Each parameter's class and size, in order.
    const PARAMS: &'static [ParamInfo];
    /// One pointer per parameter (an array on the stack).
    type Ptrs: AsMut<[*mut c_void]>;
    /// Pointers to each value of `self` (valid while `self` is).
    fn pointers(&mut self) -> Self::Ptrs;
}

macro_rules! params {
    ($n:expr; $($t:ident $i:tt),+) => {
        impl<$($t: KernelArg),+> Params for ($($t,)+) {
            const PARAMS: &'static [ParamInfo] = &[$($t::INFO),+];
            type Ptrs = [*mut c_void; $n];
            fn pointers(&mut self) -> Self::Ptrs {
                [$(arg(&self.$i)),+]
            }
        }
    };
}
params!(1; A 0);
params!(2; A 0, B 1);
params!(3; A 0, B 1, C 2);
params!(4; A 0, B 1, C 2, D 3);
params!(5; A 0, B 1, C 2, D 3, E 4);
params!(6; A 0, B 1, C 2, D 3, E 4, F 5);
params!(7; A 0, B 1, C 2, D 3, E 4, F 5, G 6);
params!(8; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
params!(9; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
params!(10; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
params!(11; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);

/// What a [`Binding`] states about its kernels, for the host test that checks it
/// against the kernel sources.
#[derive(Clone, Copy, Debug)]
pub struct Signature {
    /// the file of `kernels/` that defines the kernels
    pub file: &'static str,
    /// the kernels' names: `{}` stands for one run of letters and digits
    pub pattern: &'static str,
    /// the parameters' classes and sizes, in order
    pub params: &'static [ParamInfo],
}

/// The longest kernel name or launch label a [`Kernel`] holds.
type Label = StackStr<48>;

/// A kernel family of one source file (the kernels whose names fit `pattern`) bound to
/// its parameter list `P`: the one place that states the parameter types.
pub struct Binding<P> {
    sig: Signature,
    /// the name launch errors give ("": the kernel's own name)
    what: &'static str,
    _p: std::marker::PhantomData<fn(P)>,
}

impl<P: Params> Binding<P> {
    /// The kernels of `src` named by `pattern` (`{}`: one run of letters and digits),
    /// launch errors naming them `what` ("": by their own names).
    ///
    /// # Safety
    /// `P` is the parameter list of every such kernel: its types, with their layouts, in
    /// order.
    pub const unsafe fn new(
        src: &nvrtc::Source,
        pattern: &'static str,
        what: &'static str,
    ) -> Self {
        Binding {
            sig: Signature {
                file: src.name,
                pattern,
                params: P::PARAMS,
            },
            what,
            _p: std::marker::PhantomData,
        }
    }

    pub const fn signature(&self) -> Signature {
        self.sig
    }

    /// The kernel name with `parts` in the pattern's `{}`, in order.
    pub(crate) fn name(&self, parts: &[&str]) -> Result<Label> {
        let mut name = Label::new();
        let mut pieces = self.sig.pattern.split("{}");
        let mut ok = true;
        if let Some(first) = pieces.next() {
            ok &= std::fmt::Write::write_str(&mut name, first).is_ok();
        }
        let mut n = 0;
        for piece in pieces {
            let part = parts.get(n).copied().unwrap_or("");
            ok &= !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric());
            ok &= std::fmt::Write::write_str(&mut name, part).is_ok();
            ok &= std::fmt::Write::write_str(&mut name, piece).is_ok();
            n += 1;
        }
        if !ok || n != parts.len() {
            return Err(Error::internal(format!(
                "kernel name pattern {} does not take {parts:?}",
                self.sig.pattern
            )));
        }
        Ok(name)
    }
}

/// Whether `name` fits `pattern` (`{}`: one run of ASCII letters and digits).
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    let mut pieces = pattern.split("{}");
    let Some(rest) = pieces.next().and_then(|first| name.strip_prefix(first)) else {
        return false;
    };
    let mut rest = rest;
    for piece in pieces {
        let run = rest
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric())
            .count();
        if run == 0 {
            return false;
        }
        // The run ends where the next literal piece starts (pieces never begin with a
        // letter or digit in the library's patterns; if one does, the whole run is taken).
        let Some(after) = rest[run..].strip_prefix(piece) else {
            return false;
        };
        rest = after;
    }
    rest.is_empty()
}

/// A kernel of a loaded module, typed by its parameter list `P` (a [`Params`] tuple):
/// looked up through its [`Binding`] once; every launch then passes exactly one value of
/// each type.
pub struct Kernel<P> {
    f: cu::CUfunction,
    /// the name launch errors give
    what: Label,
    _p: std::marker::PhantomData<fn(P)>,
}

impl<P> Clone for Kernel<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for Kernel<P> {}
// SAFETY: a CUfunction is a handle of the driver's, usable from any thread (the driver
// API is thread-safe); the module it belongs to stays loaded (the loaded-module cache
// never unloads).
unsafe impl<P> Send for Kernel<P> {}
// SAFETY: as above (launching through `&Kernel` only reads the handle).
unsafe impl<P> Sync for Kernel<P> {}

impl<P: Params> Kernel<P> {
    /// The kernel of `b` named with `parts` in its pattern's `{}`, from `m`.
    ///
    /// # Safety
    /// `m` is compiled from `b`'s source.
    pub unsafe fn new(m: &nvrtc::Module, b: &Binding<P>, parts: &[&str]) -> Result<Kernel<P>> {
        let name = b.name(parts)?;
        Self::lookup(m, b, name.as_str())
    }

    /// The kernel of `b` called `name` (which must fit its pattern), from `m`.
    ///
    /// # Safety
    /// As [`Kernel::new`].
    pub unsafe fn named(m: &nvrtc::Module, b: &Binding<P>, name: &str) -> Result<Kernel<P>> {
        if !pattern_matches(b.sig.pattern, name) {
            return Err(Error::internal(format!(
                "kernel {name} is not one of {}",
                b.sig.pattern
            )));
        }
        Self::lookup(m, b, name)
    }

    fn lookup(m: &nvrtc::Module, b: &Binding<P>, name: &str) -> Result<Kernel<P>> {
        let mut what = Label::new();
        let label = if b.what.is_empty() { name } else { b.what };
        std::fmt::Write::write_str(&mut what, label)
            .map_err(|_| Error::internal(format!("kernel label {label} is too long")))?;
        Ok(Kernel {
            f: m.function(name)?,
            what,
            _p: std::marker::PhantomData,
        })
    }

    /// The driver's handle (for attribute queries).
    pub fn raw(&self) -> cu::CUfunction {
        self.f
    }

    /// Launch with `params` on `stream`, without dynamic shared memory.
    ///
    /// # Safety
    /// The kernel's module stays loaded and belongs to the context of `stream` (the
    /// current context); the device memory `params` point to is valid for everything the
    /// kernel reads and writes until it has run on `stream`; `grid` and `block` are a
    /// shape the kernel takes.
    pub unsafe fn launch(
        &self,
        (grid, block): ((u32, u32, u32), (u32, u32, u32)),
        stream: StreamHandle,
        mut params: P,
    ) -> Result<()> {
        let mut ptrs = params.pointers();
        // SAFETY: `f` takes `P` (the binding's contract), `ptrs` point to the values of
        // `params`, which live until this call returns; the rest is the caller's.
        unsafe { launch(self.f, (grid, block, 0), stream, ptrs.as_mut(), &self.what) }
    }

    /// Launch with `params` on `stream` and `smem` bytes of dynamic shared memory (beyond
    /// 48 KiB the kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES must allow it).
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_shared(
        &self,
        (grid, block): ((u32, u32, u32), (u32, u32, u32)),
        smem: u32,
        stream: StreamHandle,
        mut params: P,
    ) -> Result<()> {
        let mut ptrs = params.pointers();
        // SAFETY: as in `launch`.
        unsafe {
            launch(
                self.f,
                (grid, block, smem),
                stream,
                ptrs.as_mut(),
                &self.what,
            )
        }
    }

    /// Launch as the programmatic dependent of the previous kernel on `stream` (it may
    /// start before that one finishes and waits for it with griddepcontrol.wait); a plain
    /// launch when the driver refuses the attribute. A 1-D grid and block.
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_dependent(
        &self,
        grid: u32,
        block: u32,
        stream: StreamHandle,
        mut params: P,
    ) -> Result<()> {
        let mut ptrs = params.pointers();
        let args = ptrs.as_mut();
        // SAFETY: a plain-old-data union; the field set below is the one the id selects.
        let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = cu::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `launch` (the caller's obligations, `args` point to `params`);
        // `cfg` and `attr` live through the call, which reads the argument values before
        // it returns.
        let r =
            unsafe { cu::cuLaunchKernelEx(&cfg, self.f, args.as_mut_ptr(), std::ptr::null_mut()) };
        if r == cu::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe {
            launch(
                self.f,
                ((grid, 1, 1), (block, 1, 1), 0),
                stream,
                args,
                &self.what,
            )
        }
    }
}

/// Launch a kernel with `smem` bytes of dynamic shared memory. `args` holds pointers to
/// each kernel argument.
///
/// # Safety
///
/// `f` must be a function of a module loaded in the context `stream` belongs to (the
/// current context), and `args` must match its parameter list: one pointer per parameter,
/// each to a live value of that parameter's type and layout (read during this call). The
/// device memory the argument values point to must be valid for everything the kernel
/// reads and writes until it has run on `stream`.
unsafe fn launch(
    f: cu::CUfunction,
    (grid, block, smem): ((u32, u32, u32), (u32, u32, u32), u32),
    stream: StreamHandle,
    args: &mut [*mut c_void],
    name: &Label,
) -> Result<()> {
    // SAFETY: the caller guarantees `f` and `args` (this function's contract);
    // cuLaunchKernel reads the argument values before it returns.
    let r = unsafe {
        cu::cuLaunchKernel(
            f,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            smem,
            stream.cu(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    check_with(r, || format!("cuLaunchKernel({})", name.as_str()))
}

/// Kernel argument helper: a pointer to the value, as cuLaunchKernel wants.
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A typed launch passes a pointer to each parameter value, in order.
    #[test]
    fn params_point_at_each_value_in_order() {
        let mut p = (7u32, 0x1234_5678_9abc_u64, DevPtr::new(0xdead_0000), -3i32);
        let ptrs = p.pointers();
        assert_eq!(ptrs.len(), 4);
        // SAFETY: each pointer is to the field of `p` of that type (alive here).
        unsafe {
            assert_eq!(*(ptrs[0] as *const u32), 7);
            assert_eq!(*(ptrs[1] as *const u64), 0x1234_5678_9abc);
            assert_eq!(*(ptrs[2] as *const DevPtr), DevPtr::new(0xdead_0000));
            assert_eq!(*(ptrs[3] as *const i32), -3);
        }
    }

    #[test]
    fn parameter_lists_state_class_and_size() {
        type P = (DevPtr, u64, u32, i32, f32);
        let c: Vec<(ArgClass, usize)> = P::PARAMS.iter().map(|p| (p.class, p.size)).collect();
        use ArgClass::*;
        assert_eq!(c, [(Pointer, 8), (Int, 8), (Int, 4), (Int, 4), (Float, 4)]);
    }

    #[test]
    fn names_fill_and_fit_patterns() {
        // SAFETY: never used to launch.
        let b: Binding<(DevPtr, u64)> =
            unsafe { Binding::new(&nvrtc::COMM, "reduce_{}_{}_{}", "") };
        assert_eq!(
            b.name(&["bf16", "f32", "v8"]).unwrap().as_str(),
            "reduce_bf16_f32_v8"
        );
        assert!(b.name(&["bf16", "f32"]).is_err());
        assert!(b.name(&["bf16", "f32", "v8", "x"]).is_err());
        assert!(b.name(&["bf_16", "f32", "v8"]).is_err());
        assert!(b.name(&["", "f32", "v8"]).is_err());
        assert!(pattern_matches("reduce_{}_{}_{}", "reduce_bf16_f32_v8"));
        assert!(!pattern_matches("reduce_{}_{}_{}", "reduce_bf16_f32"));
        assert!(!pattern_matches("quantize_{}_{}", "quantize_fp8_bf16_e4m3"));
        assert!(pattern_matches("quantize_{}_{}", "quantize_bf16_e4m3"));
        assert!(pattern_matches("transpose_b{}", "transpose_b4"));
        assert!(!pattern_matches("transpose_b{}", "transpose_vec_b4"));
        assert!(pattern_matches("amax_max", "amax_max"));
        assert!(!pattern_matches("amax_max", "amax_maxx"));
        assert!(pattern_matches(
            "ct2x_tr{}_g{}_pf{}_cs{}_m{}",
            "ct2x_tr64_g0_pf1_cs0_m6"
        ));
    }
}
