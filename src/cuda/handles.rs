//! Typed driver and library handles. Every CUDA driver, cuBLASLt, NVRTC, NCCL and
//! dynamic-loader handle the library holds is one of these values, never a bare
//! integer: a stream cannot be passed where an event is expected, a context's address
//! where its id is, or a communicator where a graph is. They are plain values (`Copy`,
//! `Send`, `Sync`: the handle's address, not ownership; the owning types, e.g.
//! `resources::Stream`, free them). The C boundary (`src/ffi/`) makes them from its
//! arguments; the calls into the libraries take them back with `raw()`.
//!
//! `tests/handle_types.rs` checks that no struct field or function parameter of `src/`
//! named like a handle has a bare `usize` / `u64` type (the `extern "C"` signatures of
//! `src/ffi/` excepted); it lists these types.
use super::dynlib::cublaslt_sys as lt;
use super::dynlib::nccl_sys as nc;
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// Defines a handle newtype over the library's pointer type `$raw`, stored as its
/// address (so that the value is `Send` and `Sync`, as the libraries allow for these
/// handles; every use goes back through `raw()`).
macro_rules! handle_type {
    ($(#[$doc:meta])* $name:ident => $raw:ty) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct $name(usize);

        impl $name {
            /// No handle (NULL).
            pub const NULL: $name = $name(0);
            /// The handle a library call returned (or the C API was given).
            pub fn from_raw(h: $raw) -> $name {
                $name(h as usize)
            }
            /// The handle a C argument holds (an opaque pointer of the C API, e.g. the
            /// header's `ncclComm_t`): the conversion at the C boundary.
            pub fn from_c<T>(p: *const T) -> $name {
                $name(p as usize)
            }
            /// As the C API's opaque pointer (the other direction of [`Self::from_c`]).
            pub fn as_c<T>(self) -> *mut T {
                self.0 as *mut T
            }
            /// As the library's handle type, for a call into it.
            pub fn raw(self) -> $raw {
                self.0 as $raw
            }
            pub const fn is_null(self) -> bool {
                self.0 == 0
            }
            /// The handle at address `a`: one this process handed out before (e.g.
            /// published to an in-process peer as bytes); checked by the library call
            /// that uses it.
            pub const fn from_addr(a: usize) -> $name {
                $name(a)
            }
            /// The handle's address (messages, hashing into caches).
            pub const fn addr(self) -> usize {
                self.0
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.0)
            }
        }

        /// The address in hex (messages name a handle by it).
        impl std::fmt::LowerHex for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

handle_type!(
    /// A CUDA context (`CUcontext`). Its address may be reused by a later context (the
    /// primary context after `cudaDeviceReset`): caches key by [`CtxId`] instead.
    CtxHandle => cu::CUcontext
);
handle_type!(
    /// A CUDA event (`CUevent` / `cudaEvent_t`).
    EventHandle => cu::CUevent
);
handle_type!(
    /// A CUDA graph (`CUgraph`), e.g. the one a stream capture ended with.
    GraphHandle => cu::CUgraph
);
handle_type!(
    /// An instantiated CUDA graph (`CUgraphExec`).
    GraphExecHandle => cu::CUgraphExec
);
handle_type!(
    /// A module loaded into a context (`CUmodule`).
    ModuleHandle => cu::CUmodule
);
handle_type!(
    /// A kernel of a loaded module (`CUfunction`).
    FunctionHandle => cu::CUfunction
);
handle_type!(
    /// An NCCL communicator (`ncclComm_t`), the caller's or the library's own.
    NcclComm => nc::ncclComm_t
);
handle_type!(
    /// A cuBLASLt library handle (`cublasLtHandle_t`), one per context.
    LtHandle => lt::cublasLtHandle_t
);
handle_type!(
    /// A handle of the dynamic loader (`dlopen`'s result).
    DlHandle => *mut c_void
);

/// A CUDA stream handle (`cudaStream_t` / `CUstream`) the library was given or owns,
/// as a value: not owned (the owning type is `resources::Stream`). NULL and the special
/// handles cudaStreamLegacy (1) and cudaStreamPerThread (2) are valid values.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamHandle(usize);

impl StreamHandle {
    /// The legacy default stream (NULL).
    pub const NULL: StreamHandle = StreamHandle(0);
    /// A handle from its raw value (the C API's `cudaStream_t`, a framework's integer).
    pub const fn from_raw(raw: usize) -> StreamHandle {
        StreamHandle(raw)
    }
    /// The driver's handle a library call returned.
    pub fn from_cu(s: cu::CUstream) -> StreamHandle {
        StreamHandle(s as usize)
    }
    pub const fn raw(self) -> usize {
        self.0
    }
    /// As the driver API's `CUstream`.
    pub fn cu(self) -> cu::CUstream {
        self.0 as cu::CUstream
    }
    /// As the runtime API's `cudaStream_t` that NCCL and cuBLASLt take (each binding
    /// declares its own `CUstream_st`: the pointee is the caller's).
    pub fn rt<T>(self) -> *mut T {
        self.0 as *mut T
    }
}

/// A context's process-unique id (`cuCtxGetId`): the key of every per-context cache
/// (modules, cuBLASLt handles and plans, our GEMM's backend). A context made at the
/// address of a destroyed one gets a new id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtxId(pub(crate) u64);

impl CtxId {
    /// The id's value (reports, trace output).
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for CtxId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A context as the owner of a resource: its handle and its id, both needed to tell
/// whether that context still exists (`cuda::context_alive`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtxRef {
    pub handle: CtxHandle,
    pub id: CtxId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_their_library_type_and_print_as_their_kind() {
        let raw = 0x7f00_1234usize as cu::CUstream;
        assert_eq!(StreamHandle::from_cu(raw).cu(), raw);
        let e = EventHandle::from_raw(0x40usize as cu::CUevent);
        assert_eq!(e.raw() as usize, 0x40);
        assert_eq!(format!("{e:?}"), "EventHandle(0x40)");
        assert!(NcclComm::NULL.is_null() && !e.is_null());
        // As the library's pointer: one machine word, passed as is.
        assert_eq!(std::mem::size_of::<GraphExecHandle>(), 8);
        assert_eq!(CtxId(7).to_string(), "7");
    }
}
