//! Owned CUDA resources (streams, events, device / host-mapped memory, IPC mappings).
//! Each frees itself on drop; every creation names the call that failed. Every release
//! runs with the thread's stream-capture mode relaxed ([`release_relaxed`]): an object
//! dropped on one thread (a garbage collector's, an autograd worker's) while another
//! thread captures a CUDA graph in global mode must not invalidate that capture.
use super::{DevPtr, check};
use crate::cuda::{CtxRef, EventHandle, StreamHandle};
use crate::error::Result;
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// A non-blocking stream with a priority (clamped to the device's range).
/// (the handle, and the context it was made in: released only while that context
/// exists, as [`DeviceMem`])
pub struct Stream(StreamHandle, Option<CtxRef>);

impl Stream {
    pub fn new(priority: i32) -> Result<Stream> {
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: out pointers; a context is current.
        check(
            unsafe { cu::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) },
            "cuCtxGetStreamPriorityRange",
        )?;
        // Numerically lower is higher priority: greatest <= p <= least.
        let p = priority.clamp(greatest, least);
        let mut s: cu::CUstream = std::ptr::null_mut();
        // SAFETY: out pointer.
        check(
            unsafe {
                cu::cuStreamCreateWithPriority(
                    &mut s,
                    cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    p,
                )
            },
            "cuStreamCreateWithPriority",
        )?;
        Ok(Stream(StreamHandle::from_cu(s), super::current_context()))
    }
    pub fn raw(&self) -> StreamHandle {
        self.0
    }
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: valid stream.
        check(
            unsafe { cu::cuStreamSynchronize(self.0.cu()) },
            "cuStreamSynchronize",
        )
    }

    /// Whether everything enqueued on the stream has completed (cuStreamQuery).
    pub fn idle(&self) -> Result<bool> {
        // SAFETY: valid stream.
        let r = unsafe { cu::cuStreamQuery(self.0.cu()) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuStreamQuery").map(|_| true)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by Stream::new (released only while that context exists).
        release_owned(self.1, || unsafe { cu::cuStreamDestroy_v2(self.0.cu()) });
    }
}

/// [`release_relaxed`] of a resource made in the context `owner` (see
/// [`DeviceMem::owner`]): only while that context still exists (None: no owner recorded,
/// released as always). A context gone (destroyed, or reset) took the resource with it,
/// and its handle or address may name the new context's by now. The liveness query runs
/// in the relaxed capture window too.
fn release_owned(owner: Option<CtxRef>, f: impl FnOnce() -> cu::CUresult) {
    release_relaxed(|| {
        if owner.is_none_or(super::context_alive) {
            f()
        } else {
            cu::CUresult::CUDA_SUCCESS
        }
    });
}

/// A CUDA event: without timing for cross-stream ordering ([`Event::new`]), or timed.
/// (the handle, and the context it was made in: released only while that context
/// exists, as [`DeviceMem`])
pub struct Event(EventHandle, Option<CtxRef>);

impl Event {
    fn create(flags: cu::CUevent_flags) -> Result<Event> {
        let mut e: cu::CUevent = std::ptr::null_mut();
        // SAFETY: out pointer.
        check(
            unsafe { cu::cuEventCreate(&mut e, flags as u32) },
            "cuEventCreate",
        )?;
        Ok(Event(EventHandle::from_raw(e), super::current_context()))
    }
    pub fn new() -> Result<Event> {
        Self::create(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }
    /// An event with timing (for NVTE_COMM_TRACE).
    pub fn timed() -> Result<Event> {
        Self::create(cu::CUevent_flags::CU_EVENT_DEFAULT)
    }
    /// Milliseconds from `start`'s record to this event's (both completed).
    pub fn elapsed_since(&self, start: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: valid events.
        check(
            unsafe { cu::cuEventElapsedTime_v2(&mut ms, start.0.raw(), self.0.raw()) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: valid event; the stream is the caller's or ours.
        check(
            unsafe { cu::cuEventRecord(self.0.raw(), stream.cu()) },
            "cuEventRecord",
        )
    }
    /// Make `stream` wait for this event's latest record.
    pub fn wait_on(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: valid event and stream.
        check(
            unsafe { cu::cuStreamWaitEvent(stream.cu(), self.0.raw(), 0) },
            "cuStreamWaitEvent",
        )
    }
    /// Wait on the host until the latest record completed, polling, for at most
    /// `timeout_ms` (then a TIMEOUT error naming `what`): never an unbounded host wait.
    /// The queries run with this thread's capture mode relaxed, so that they cannot
    /// disturb another thread's global-mode capture.
    pub fn wait_bounded(&self, timeout_ms: i64, what: &str) -> Result<()> {
        let start = std::time::Instant::now();
        let limit = std::time::Duration::from_millis(timeout_ms.max(1) as u64);
        with_relaxed_capture(|| {
            while !self.done()? {
                if start.elapsed() > limit {
                    return Err(crate::error::Error::new(
                        crate::error::ErrorKind::Timeout,
                        format!("{what} did not complete within {timeout_ms} ms"),
                    ));
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
            Ok(())
        })
    }

    /// true when the work before the latest record has completed.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: valid event.
        let r = unsafe { cu::cuEventQuery(self.0.raw()) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|_| true)
    }
}

/// Mean time (ms) of `runs` runs of `run` on `stream` after one warm-up run, between two
/// timed events (a bounded host wait for them: `timeout_ms`, else TIMEOUT naming `what`).
/// `state` is handed to every run.
pub fn mean_time<S>(
    state: &mut S,
    stream: StreamHandle,
    timeout_ms: i64,
    what: &str,
    runs: usize,
    mut run: impl FnMut(&mut S) -> Result<()>,
) -> Result<f32> {
    let (t0, t1) = (Event::timed()?, Event::timed()?);
    run(state)?;
    t0.record(stream)?;
    for _ in 0..runs {
        run(state)?;
    }
    t1.record(stream)?;
    t1.wait_bounded(timeout_ms, what)?;
    Ok(t1.elapsed_since(&t0)? / runs.max(1) as f32)
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by Event::new (released only while that context exists).
        release_owned(self.1, || unsafe { cu::cuEventDestroy_v2(self.0.raw()) });
    }
}

/// Device memory from cuMemAlloc (exportable through legacy CUDA IPC).
pub struct DeviceMem {
    pub ptr: DevPtr,
    pub bytes: usize,
    /// the context it was allocated in (handle and id): freed on drop only while that
    /// context still exists (a device reset frees it, and its addresses may by then belong
    /// to the new context); None: no such check (the host tests' fake buffers, which are
    /// leaked, never freed)
    pub(crate) owner: Option<CtxRef>,
}

impl DeviceMem {
    pub fn new(bytes: usize) -> Result<DeviceMem> {
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: out pointer.
        check(
            unsafe { cu::cuMemAlloc_v2(&mut p, bytes.max(1)) },
            &format!("cuMemAlloc({bytes} bytes)"),
        )?;
        Ok(DeviceMem {
            ptr: DevPtr::new(p),
            bytes,
            owner: super::current_context(),
        })
    }
    /// Zero the allocation and wait for it (setup only). cuMemsetD8 runs on the legacy
    /// stream, which non-blocking streams do not wait for: without the synchronisation a
    /// late memset could overwrite what the first call writes.
    /// Zero the allocation and wait for it, on a private stream: never a context-wide
    /// synchronisation (another rank's thread may have a call in flight on this context,
    /// waiting for this rank: in-process peers on one device).
    pub fn zero(&self) -> Result<()> {
        let s = Stream::new(0)?;
        self.as_slice::<u8>().zero_async(s.raw())?;
        s.synchronize()
    }
    /// The whole allocation as `bytes / size_of::<T>()` elements of `T`.
    pub fn as_slice<T: Copy>(&self) -> DevSlice<'_, T> {
        DevSlice {
            ptr: self.ptr,
            len: self.bytes / std::mem::size_of::<T>().max(1),
            _owner: std::marker::PhantomData,
        }
    }
    /// Elements `offset..offset + len` of the allocation as `T`s: checked against its
    /// size (and `T`'s alignment), an internal error otherwise.
    pub fn slice<T: Copy>(&self, offset: usize, len: usize) -> Result<DevSlice<'_, T>> {
        self.as_slice::<T>().sub(offset, len)
    }
    /// An allocation that may be made while this thread captures a CUDA graph (a lazily
    /// allocated, persistent buffer of an object): made with the thread's capture mode
    /// relaxed, CUDA's documented way for a library to allocate during a capture. The
    /// allocation is not an operation of the graph; the graph only uses its address, which
    /// stays valid as long as the owner keeps the buffer.
    pub fn new_relaxed(bytes: usize) -> Result<DeviceMem> {
        with_relaxed_capture(|| DeviceMem::new(bytes))
    }
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        // SAFETY: zeroed POD handle, filled by the driver.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            unsafe { cu::cuIpcGetMemHandle(&mut h, self.ptr.raw()) },
            "cuIpcGetMemHandle",
        )?;
        let mut out = [0u8; 64];
        for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
            *o = *c as u8;
        }
        Ok(out)
    }
}

/// A typed view of memory the library owns (a [`DeviceMem`], borrowed, so it cannot
/// outlive it): `len` elements of `T` at a device address, as cudarc's `CudaSlice<T>`.
/// Every write through it stays inside the allocation; the raw-address forms
/// ([`copy_async`], [`memset_async`], [`write_value32`], [`copy_2d`]) are `unsafe`.
#[derive(Clone, Copy, Debug)]
pub struct DevSlice<'a, T> {
    ptr: DevPtr,
    len: usize,
    _owner: std::marker::PhantomData<(&'a DeviceMem, T)>,
}

impl<T: Copy> DevSlice<'_, T> {
    const SIZE: usize = std::mem::size_of::<T>();

    /// The device address of the first element.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.len * Self::SIZE
    }
    /// Elements `offset..offset + len` of this slice (checked: an internal error when
    /// they leave it or the address is not aligned for `T`).
    pub fn sub(&self, offset: usize, len: usize) -> Result<Self> {
        let end = offset.checked_add(len);
        let p = self.ptr + offset.saturating_mul(Self::SIZE).min(self.bytes());
        if end.is_none_or(|e| e > self.len) || !p.is_aligned(std::mem::align_of::<T>()) {
            return Err(crate::error::Error::internal(format!(
                "device range {offset}..{offset}+{len} of {}-byte elements is outside a buffer of {} elements at {} (or misaligned)",
                Self::SIZE,
                self.len,
                self.ptr
            )));
        }
        Ok(DevSlice {
            ptr: p,
            len,
            _owner: std::marker::PhantomData,
        })
    }
    /// Zero the elements on `stream`.
    pub fn zero_async(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: the slice lies inside a live allocation of the library (its borrow).
        unsafe { memset_async(self.ptr, self.bytes(), stream) }
    }
    /// Copy `src` (of the same length) into these elements on `stream`.
    pub fn copy_from(&self, src: &DevSlice<'_, T>, stream: StreamHandle) -> Result<()> {
        self.same_len(src.len)?;
        // SAFETY: both slices lie inside live allocations of the library.
        unsafe { copy_async(self.ptr, src.ptr, self.bytes(), stream) }
    }
    /// Copy `len()` elements from the device address `src` into these on `stream`.
    ///
    /// # Safety
    /// `src` holds `len()` readable elements (e.g. a checked tensor's range).
    pub unsafe fn copy_from_raw(&self, src: DevPtr, stream: StreamHandle) -> Result<()> {
        // SAFETY: the destination is this slice; the source the caller's obligation.
        unsafe { copy_async(self.ptr, src, self.bytes(), stream) }
    }
    /// Copy `src` (of the same length) from the host (synchronous).
    pub fn copy_from_host(&self, src: &[T]) -> Result<()> {
        self.same_len(src.len())?;
        // SAFETY: plain data of `T`s, as bytes, for the copy only.
        let b = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, self.bytes()) };
        // SAFETY: the slice lies inside a live allocation of the library.
        unsafe { copy_from_host(self.ptr, b) }
    }
    fn same_len(&self, n: usize) -> Result<()> {
        if n != self.len {
            return Err(crate::error::Error::internal(format!(
                "a copy of {n} elements into a device slice of {}",
                self.len
            )));
        }
        Ok(())
    }
}

impl DevSlice<'_, u32> {
    /// Write `value` into element `index` once `stream`'s earlier work is done
    /// ([`write_value32`]: what the stream wrote before is visible to whoever sees it).
    pub fn write_value(&self, index: usize, value: u32, stream: StreamHandle) -> Result<()> {
        let flag = self.sub(index, 1)?;
        // SAFETY: a 4-byte, 4-aligned element of a live allocation of the library.
        unsafe { write_value32(flag.ptr, value, stream) }
    }
}

impl DeviceMem {
    /// Give up the allocation without freeing it (memory that a failed peer may still
    /// write: freeing it could hand the addresses to an unrelated allocation).
    pub fn leak(&mut self) {
        self.ptr = DevPtr::NULL;
        self.bytes = 0;
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // SAFETY: allocated by DeviceMem::new (released only while that context exists).
        release_owned(self.owner, || unsafe { cu::cuMemFree_v2(self.ptr.raw()) });
    }
}

/// A peer's allocation mapped into this process through CUDA IPC.
pub struct IpcMapping {
    pub ptr: DevPtr,
    /// the context it was opened in (see [`DeviceMem::owner`])
    owner: Option<CtxRef>,
}

impl IpcMapping {
    pub fn open(handle: &[u8; 64]) -> Result<IpcMapping> {
        // SAFETY: zeroed POD handle filled from the peer's bytes.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: out pointer; lazy peer access as CUDA IPC requires.
        check(
            unsafe {
                cu::cuIpcOpenMemHandle_v2(
                    &mut p,
                    h,
                    cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(IpcMapping {
            ptr: DevPtr::new(p),
            owner: super::current_context(),
        })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: opened by IpcMapping::open (released only while that context exists).
        release_owned(self.owner, || unsafe {
            cu::cuIpcCloseMemHandle(self.ptr.raw())
        });
    }
}

/// Pinned host memory mapped into the device address space (error records).
pub struct HostMapped {
    pub host: *mut c_void,
    pub device: DevPtr,
    /// the context it was allocated in (see [`DeviceMem::owner`])
    owner: Option<CtxRef>,
}

// SAFETY: the pointer is owned and only accessed through volatile reads / device writes.
unsafe impl Send for HostMapped {}
unsafe impl Sync for HostMapped {}

impl HostMapped {
    pub fn new(bytes: usize) -> Result<HostMapped> {
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: out pointers; DEVICEMAP | PORTABLE.
        check(
            unsafe { cu::cuMemHostAlloc(&mut h, bytes, 0x01 | 0x02) },
            "cuMemHostAlloc",
        )?;
        // SAFETY: fresh allocation of `bytes`.
        unsafe { std::ptr::write_bytes(h as *mut u8, 0, bytes) };
        let mut d: cu::CUdeviceptr = 0;
        if let Err(e) = check(
            unsafe { cu::cuMemHostGetDevicePointer_v2(&mut d, h, 0) },
            "cuMemHostGetDevicePointer",
        ) {
            release_relaxed(|| unsafe { cu::cuMemFreeHost(h) });
            return Err(e);
        }
        Ok(HostMapped {
            host: h,
            device: DevPtr::new(d),
            owner: super::current_context(),
        })
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        // SAFETY: allocated by HostMapped::new (released only while that context exists).
        release_owned(self.owner, || unsafe { cu::cuMemFreeHost(self.host) });
    }
}

/// cuMemcpyDtoDAsync (copy engine; either side may be a peer's IPC mapping). For memory
/// the library owns, [`DevSlice::copy_from`] is the checked form.
///
/// # Safety
/// `dst` holds `bytes` of device memory (this context's, or a peer's mapped into it) that
/// nothing else uses until the copy completed, and `src` holds `bytes` readable ones
/// (e.g. a range of a tensor whose size the C boundary checked).
pub unsafe fn copy_async(
    dst: DevPtr,
    src: DevPtr,
    bytes: usize,
    stream: StreamHandle,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's obligations.
    check(
        unsafe { cu::cuMemcpyDtoDAsync_v2(dst.raw(), src.raw(), bytes, stream.cu()) },
        "cuMemcpyDtoDAsync",
    )
}

/// cuMemcpyHtoDAsync of `bytes` from pinned host memory `src` (e.g. a [`HostMapped`]'s
/// `host`) on `stream`: asynchronous, no device-wide synchronisation.
///
/// # Safety
/// `src` is pinned host memory holding `bytes`, left alone until the copy completed.
pub unsafe fn copy_from_pinned_async(
    dst: DevPtr,
    src: *const c_void,
    bytes: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: the caller's obligations.
    check(
        unsafe { cu::cuMemcpyHtoDAsync_v2(dst.raw(), src, bytes, stream.cu()) },
        "cuMemcpyHtoDAsync",
    )
}

/// cuMemcpyDtoHAsync of `bytes` into pinned host memory `dst` on `stream`.
///
/// # Safety
/// `dst` is pinned host memory of at least `bytes`, not read until the copy completed.
pub unsafe fn copy_to_pinned_async(
    dst: *mut c_void,
    src: DevPtr,
    bytes: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: the caller's obligations.
    check(
        unsafe { cu::cuMemcpyDtoHAsync_v2(dst, src.raw(), bytes, stream.cu()) },
        "cuMemcpyDtoHAsync",
    )
}

pub fn copy_to_host(dst: &mut [u8], src: DevPtr) -> Result<()> {
    // SAFETY: dst is a host slice of the copied length.
    check(
        unsafe { cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src.raw(), dst.len()) },
        "cuMemcpyDtoH",
    )
}

/// cuMemcpyHtoD of `src` to `dst` (synchronous). For memory the library owns,
/// [`DevSlice::copy_from_host`] is the checked form.
///
/// # Safety
/// `dst` holds `src.len()` bytes of device memory that nothing else uses meanwhile.
pub unsafe fn copy_from_host(dst: DevPtr, src: &[u8]) -> Result<()> {
    // SAFETY: src is a host slice of the copied length; `dst` the caller's.
    check(
        unsafe { cu::cuMemcpyHtoD_v2(dst.raw(), src.as_ptr() as *const c_void, src.len()) },
        "cuMemcpyHtoD",
    )
}

/// Zero `bytes` of device memory on `stream`. For memory the library owns,
/// [`DevSlice::zero_async`] is the checked form.
///
/// # Safety
/// `ptr` holds `bytes` of device memory that nothing else uses until the memset ran.
pub unsafe fn memset_async(ptr: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's obligations.
    check(
        unsafe { cu::cuMemsetD8Async(ptr.raw(), 0, bytes, stream.cu()) },
        "cuMemsetD8Async",
    )
}

/// Write the u32 `value` at `ptr` on `stream` once the stream's earlier work is done
/// (cuStreamWriteValue32, with its default memory barrier: what the stream wrote before is
/// visible to whoever sees the value). For memory the library owns,
/// [`DevSlice::write_value`] is the checked form.
///
/// # Safety
/// `ptr` is a 4-aligned device address (this context's, or a peer's mapped flag) whose 4
/// bytes are a flag the stream may write.
pub unsafe fn write_value32(ptr: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
    // SAFETY: the caller's obligations.
    check(
        unsafe {
            cu::cuStreamWriteValue32_v2(
                stream.cu(),
                ptr.raw(),
                value,
                cu::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        },
        "cuStreamWriteValue32",
    )
}

/// Make `stream` wait until the u32 at `ptr` is >= `value` (cuStreamWaitValue32 GEQ,
/// wrap-around unaware; no timeout: only for flags a kernel of this process that cannot
/// block writes).
pub fn wait_value32_geq(ptr: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
    // SAFETY: a 4-byte, 4-aligned flag owned by the context.
    check(
        unsafe {
            cu::cuStreamWaitValue32_v2(
                stream.cu(),
                ptr.raw(),
                value,
                cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        },
        "cuStreamWaitValue32",
    )
}

/// Copy `rows` rows of `width` bytes between pitched device ranges.
///
/// # Safety
/// `dst` holds `dst_pitch * (rows - 1) + width` bytes of device memory that nothing else
/// uses until the copy completed; `src` holds `src_pitch * (rows - 1) + width` readable.
pub unsafe fn copy_2d(
    dst: DevPtr,
    dst_pitch: usize,
    src: DevPtr,
    src_pitch: usize,
    width: usize,
    rows: usize,
    stream: StreamHandle,
) -> Result<()> {
    if width == 0 || rows == 0 {
        return Ok(());
    }
    // Every field set explicitly (the memory-type enum has no zero value, so a zeroed
    // descriptor is not a valid value).
    let p = cu::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.raw(),
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.raw(),
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: rows,
    };
    // SAFETY: the caller's obligations; `p` is a complete descriptor.
    check(
        unsafe { cu::cuMemcpy2DAsync_v2(&p, stream.cu()) },
        "cuMemcpy2DAsync",
    )
}

/// Where a stream stands with CUDA graph capture (cudaStreamBeginCapture).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capture {
    None,
    /// being captured, in the capture sequence with this id
    Active(u64),
    /// its capture was invalidated by an illegal operation (and not ended yet)
    Invalidated,
}

impl Capture {
    pub fn active(self) -> bool {
        matches!(self, Capture::Active(_))
    }
    pub fn none(self) -> bool {
        self == Capture::None
    }
}

/// The capture status of `stream` (a safe query during any capture). The legacy default
/// stream (handles 0 and 1) cannot be captured and is not queried: using it while another
/// stream captures is itself illegal.
pub fn capture_status(stream: StreamHandle) -> Result<Capture> {
    if stream.raw() <= 1 {
        return Ok(Capture::None);
    }
    let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: cu::cuuint64_t = 0;
    // SAFETY: out pointers; the optional outputs are NULL.
    check(
        unsafe {
            cu::cuStreamGetCaptureInfo_v3(
                stream.cu(),
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
        "cuStreamGetCaptureInfo",
    )?;
    Ok(match status {
        cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Capture::Active(id as u64),
        cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Capture::Invalidated,
        _ => Capture::None,
    })
}

/// Run `f` with this thread's stream-capture interaction mode relaxed, then restore the
/// previous mode (cuThreadExchangeStreamCaptureMode): lets `f` make calls that global or
/// thread-local capture mode refuses (allocations), which must then not be part of, nor
/// depend on, the graph being captured.
pub fn with_relaxed_capture<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: in/out pointer to a mode value.
    check(
        unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) },
        "cuThreadExchangeStreamCaptureMode",
    )?;
    // The previous mode comes back when `f` returns or unwinds.
    let _restore = RelaxedCapture(Some(mode), std::marker::PhantomData);
    f()
}

/// This thread's stream-capture mode relaxed while the guard lives (then restored;
/// nothing happens where the mode cannot be changed, e.g. without a driver). For
/// releases (frees, destroys) in `Drop`s: in global mode a potentially unsafe call
/// (cuMemFree, ...) made by any thread while another thread captures a graph in global
/// mode is refused and invalidates that capture; relaxed, ordering the release is the
/// caller's business (a released resource is no longer used by any graph: buffers a
/// captured graph may use are kept by their owner, see `retired_scratch`).
/// The guard is bound to its thread (not `Send`: the mode it restores is that thread's).
pub struct RelaxedCapture(
    Option<cu::CUstreamCaptureMode>,
    std::marker::PhantomData<*const ()>,
);

impl RelaxedCapture {
    pub fn new() -> RelaxedCapture {
        // Without a driver there is nothing to relax (and no driver call may be made).
        if super::require(super::Lib::Driver).is_err() {
            return RelaxedCapture(None, std::marker::PhantomData);
        }
        let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: in/out pointer to a mode value.
        let ok = unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) }
            == cu::CUresult::CUDA_SUCCESS;
        RelaxedCapture(ok.then_some(mode), std::marker::PhantomData)
    }
}

impl Default for RelaxedCapture {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take() {
            // SAFETY: restores the mode returned in `new`.
            unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// Run the release call `f` (a free or destroy in a `Drop`: its status is not used) with
/// this thread's capture mode relaxed ([`RelaxedCapture`]).
pub fn release_relaxed(f: impl FnOnce() -> cu::CUresult) {
    let _relaxed = RelaxedCapture::new();
    let _ = f();
}

/// The UUID of device `dev` (this process's ordinal), the same in every process whatever
/// its device numbering; None where the driver does not say.
pub fn device_uuid(dev: i32) -> Option<[u8; 16]> {
    let mut u = cu::CUuuid { bytes: [0; 16] };
    // SAFETY: `u` is a writable CUuuid; `dev` is checked by the driver (an error for an
    // ordinal it does not know).
    let r = unsafe { cu::cuDeviceGetUuid_v2(&mut u, dev) };
    (r == cu::CUresult::CUDA_SUCCESS).then(|| u.bytes.map(|b| b as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_slices_stay_inside_their_allocation() {
        // A made-up allocation (never touched: every case fails before a driver call, or
        // only computes addresses), leaked at the end instead of freed.
        let mut m = DeviceMem {
            ptr: DevPtr::new(0x10_0000),
            bytes: 64,
            owner: None,
        };
        {
            assert_eq!(m.as_slice::<u32>().len(), 16);
            let s = m.slice::<u32>(4, 8).unwrap();
            assert_eq!((s.ptr(), s.bytes()), (DevPtr::new(0x10_0010), 32));
            assert_eq!(s.sub(2, 6).unwrap().ptr(), DevPtr::new(0x10_0018));
            assert!(m.slice::<u32>(10, 7).is_err());
            assert!(s.sub(8, 1).is_err() && s.sub(usize::MAX, 2).is_err());
            assert!(m.slice::<u64>(0, 8).is_ok() && m.slice::<u64>(0, 9).is_err());
            // Misaligned for the element type.
            let odd = m.slice::<u8>(2, 8).unwrap();
            let as_u32 = DevSlice::<u32> {
                ptr: odd.ptr(),
                len: 2,
                _owner: std::marker::PhantomData,
            };
            assert!(as_u32.sub(0, 1).is_err());
            // Writes of the wrong length or outside are refused before the driver is asked.
            assert!(s.copy_from_host(&[0u32; 3]).is_err());
            assert!(s.write_value(8, 1, StreamHandle::NULL).is_err());
            let other = m.slice::<u32>(0, 4).unwrap();
            assert!(s.copy_from(&other, StreamHandle::NULL).is_err());
        }
        m.leak();
    }
}
