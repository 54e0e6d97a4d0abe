//! Non-blocking NCCL communicators (every wait bounded; the shared helpers of the NCCL
//! transport) and [`Channel`]: the library's own exchange channel over the ranks of a
//! caller's communicator.
//!
//! Why a channel of its own: an exchange over the caller's communicator that a peer
//! never joins can only be given up on the host, while its `ncclAllGather` kernel stays
//! on the GPU for good (only the communicator's owner may abort it). Every later
//! operation that waits for the device (a `cudaFree`, a context's destroy, the process's
//! own teardown) then blocks without a limit: a hang. A comm-GEMM context therefore makes
//! one communicator of its own when it is created (the unique id is the last exchange
//! over the caller's communicator) and runs every later exchange (engine creation,
//! autotuning, NVTE_COMM_CHECK's per-call agreement) over it: a wait that runs out
//! aborts it, NCCL's kernels exit, and nothing is left on the GPU.
use crate::cuda::dynlib::nccl_sys as nc;
use crate::cuda::resources::{
    DeviceMem, HostMapped, Stream, copy_from_pinned_async, copy_to_pinned_async,
};
use crate::cuda::{ContextGuard, StreamHandle, nccl_check as check};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const IN_PROGRESS: u32 = nc::ncclResult_t::ncclInProgress as u32;

pub fn result_name(r: u32) -> String {
    match r {
        0 => "success".into(),
        1 => "unhandled CUDA error".into(),
        2 => "system error".into(),
        3 => "internal error".into(),
        4 => "invalid argument".into(),
        5 => "invalid usage".into(),
        6 => "remote error (a peer failed or exited)".into(),
        7 => "in progress".into(),
        8 => "timeout".into(),
        other => format!("error {other}"),
    }
}

/// `r` of a call on a non-blocking communicator: success, or in progress (to be polled).
pub fn check_nb(r: nc::ncclResult_t, call: &str) -> Result<bool> {
    if r == nc::ncclResult_t::ncclInProgress {
        return Ok(true);
    }
    check(r, call).map(|_| false)
}

/// The communicator's asynchronous state (ncclCommGetAsyncError).
pub fn async_state(comm: usize) -> Result<u32> {
    let mut st = 0u32;
    // SAFETY: live communicator; out pointer (a u32: NCCL may return codes newer than
    // the bindings' enum).
    check(
        unsafe { nc::ncclCommGetAsyncError(comm as nc::ncclComm_t, &mut st) },
        "ncclCommGetAsyncError",
    )?;
    Ok(st)
}

/// Poll a non-blocking communicator until its pending operation is done, for at most
/// `limit`. Err(TIMEOUT) when it is still in progress then (the caller aborts the
/// communicator), Err(NCCL) on an NCCL error.
pub fn wait_ready(comm: usize, limit: Duration, what: &str) -> Result<()> {
    let t0 = Instant::now();
    loop {
        match async_state(comm)? {
            0 => return Ok(()),
            IN_PROGRESS => {}
            e => {
                return Err(Error::new(
                    K::Nccl,
                    format!("{what}: NCCL reported {}", result_name(e)),
                ));
            }
        }
        if t0.elapsed() > limit {
            return Err(Error::new(
                K::Timeout,
                format!(
                    "{what}: not done after {:.1} s (a peer of the group did not join: it is absent, failed or hangs)",
                    limit.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// NCCL_CONFIG_INITIALIZER with `blocking = 0` (layout of NCCL 2.28; a newer NCCL reads
/// only the fields of the version given, an older one only those it knows).
pub fn nonblocking_config() -> nc::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    // SAFETY: plain C struct; NULL pointers are NCCL's "undefined" pointers.
    let mut c: nc::ncclConfig_t = unsafe { std::mem::zeroed() };
    c.size = std::mem::size_of::<nc::ncclConfig_t>();
    c.magic = 0xcafe_beef;
    c.version = 22800;
    c.blocking = 0;
    c.cgaClusterSize = UNDEF;
    c.minCTAs = UNDEF;
    c.maxCTAs = UNDEF;
    c.splitShare = UNDEF;
    c.trafficClass = UNDEF;
    c.collnetEnable = UNDEF;
    c.CTAPolicy = UNDEF;
    c.shrinkShare = UNDEF;
    c.nvlsCTAs = UNDEF;
    c.nChannelsPerNetPeer = UNDEF;
    c.nvlinkCentricSched = UNDEF;
    c
}

/// The channel's buffers (device, and pinned host staging), `cap` bytes per rank.
struct Buffers {
    stream: Stream,
    send: DeviceMem,
    recv: DeviceMem,
    host_send: HostMapped,
    host_recv: HostMapped,
    cap: usize,
}

impl Buffers {
    fn new(cap: usize, size: usize) -> Result<Buffers> {
        Ok(Buffers {
            stream: Stream::new(0)?,
            send: DeviceMem::new(cap)?,
            recv: DeviceMem::new(cap * size)?,
            host_send: HostMapped::new(cap)?,
            host_recv: HostMapped::new(cap * size)?,
            cap,
        })
    }
}

struct State {
    /// None once the communicator is aborted: the buffers are then left alone
    bufs: Option<Buffers>,
    aborted: bool,
    /// the failure that aborted the communicator (every later exchange reports it)
    failed: Option<Error>,
}

/// The library's own non-blocking communicator over the ranks of a caller's, with its
/// buffers: an allgather whose every wait is bounded by `timeout`, and which aborts the
/// communicator (so no kernel of it stays on the GPU) when a wait runs out.
pub struct Channel {
    comm: usize,
    rank: usize,
    size: usize,
    timeout: Duration,
    st: Mutex<State>,
}

/// A non-blocking communicator of `nranks` ranks, this one joining as `rank`, made from
/// the unique id of world rank `leader`, which goes through `bs` (collective over `bs`'s
/// world: every rank contributes, the others' ids are ignored); ready, waited for at
/// most `timeout` (on failure it is aborted). `what` names it in errors.
pub fn init_nonblocking(
    bs: &super::Bootstrap,
    leader: usize,
    (nranks, rank): (usize, usize),
    config: &mut nc::ncclConfig_t,
    timeout: Duration,
    what: &str,
) -> Result<usize> {
    // SAFETY: zeroed POD id; filled by NCCL on the leader.
    let mut id: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
    if bs.rank == leader {
        // SAFETY: out pointer.
        check(unsafe { nc::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    }
    let mine: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    let all = bs.allgather(&mine)?;
    for (c, b) in id
        .internal
        .iter_mut()
        .zip(&all[leader * 128..leader * 128 + 128])
    {
        *c = *b as std::ffi::c_char;
    }
    let mut comm: nc::ncclComm_t = std::ptr::null_mut();
    // SAFETY: the leader's id; every member joins with its rank; `config` outlives the
    // call (NCCL copies it).
    let pending = check_nb(
        unsafe { nc::ncclCommInitRankConfig(&mut comm, nranks as i32, id, rank as i32, config) },
        "ncclCommInitRankConfig",
    )?;
    let raw = comm as usize;
    if raw == 0 {
        return Err(Error::new(
            K::Nccl,
            format!("creating {what} returned no communicator"),
        ));
    }
    if pending && let Err(e) = wait_ready(raw, timeout, &format!("creating {what}")) {
        // SAFETY: the communicator created above, used nowhere else yet.
        unsafe { nc::ncclCommAbort(raw as nc::ncclComm_t) };
        return Err(e);
    }
    Ok(raw)
}

impl Channel {
    /// Collective over the caller's communicator (`via`): rank 0's unique id goes through
    /// `via` (its last use), then every rank joins the new communicator and connects it
    /// with one small exchange, each wait bounded by `timeout`.
    pub fn create(via: &super::Bootstrap, timeout: Duration) -> Result<Channel> {
        let _guard = ContextGuard::for_stream(StreamHandle::NULL)?;
        let mut config = nonblocking_config();
        // One channel (CTA) is plenty for these few bytes, and keeps NCCL's buffers small.
        config.minCTAs = 1;
        config.maxCTAs = 1;
        let raw = init_nonblocking(
            via,
            0,
            (via.size, via.rank),
            &mut config,
            timeout,
            "the context's exchange communicator",
        )?;
        let fail = |e: Error| {
            // SAFETY: the communicator created above, used nowhere else yet.
            unsafe { nc::ncclCommAbort(raw as nc::ncclComm_t) };
            e
        };
        let bufs = Buffers::new(256, via.size).map_err(fail)?;
        let ch = Channel {
            comm: raw,
            rank: via.rank,
            size: via.size,
            timeout,
            st: Mutex::new(State {
                bufs: Some(bufs),
                aborted: false,
                failed: None,
            }),
        };
        // NCCL connects a communicator's peers at its first collective: now, while every
        // rank is here (on failure, dropping `ch` aborts the communicator).
        ch.allgather(&[0u8])?;
        Ok(ch)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Gather `local` (same length on every rank) from all ranks, in rank order. Every
    /// wait is bounded by the timeout; one that runs out (or an NCCL error) aborts the
    /// communicator, and this and every later exchange fail with that error.
    pub fn allgather(&self, local: &[u8]) -> Result<Vec<u8>> {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = &st.failed {
            return Err(Error::new(
                e.kind,
                format!("an earlier exchange with the peers failed: {}", e.msg),
            ));
        }
        let n = local.len();
        let r = self.exchange(&mut st, local);
        match r {
            Ok(out) => Ok(out),
            Err(e) => {
                let e = if e.kind == K::Timeout {
                    Error::new(K::Timeout, self.timeout_message(n, &e.msg))
                } else {
                    e
                };
                self.abort(&mut st);
                st.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    fn timeout_message(&self, n: usize, detail: &str) -> String {
        format!(
            "an exchange of {n} bytes with every rank (over the library's own NCCL communicator) did not complete within {:.1} s ({detail}): a rank did not take the same collective step. Most likely the ranks called with different shapes, types or options (a call that autotunes or creates an engine exchanges with its peers, and a peer that called otherwise took another path; NVTE_COMM_CHECK=1 reports such a call as a cross-rank mismatch on every rank), or a rank is absent, failed or hangs. That communicator was aborted (nothing of it is left on the GPU); its context cannot exchange any more: destroy it",
            self.timeout.as_secs_f64()
        )
    }

    /// One allgather on the channel's stream: upload, NCCL, download, each bounded.
    fn exchange(&self, st: &mut State, local: &[u8]) -> Result<Vec<u8>> {
        let n = local.len();
        let fits = st.bufs.as_ref().is_some_and(|b| b.cap >= n);
        if !fits {
            // (dropped after the last exchange completed: nothing of ours is in flight)
            st.bufs = None;
            st.bufs = Some(Buffers::new(n.next_power_of_two(), self.size)?);
        }
        let b = st.bufs.as_ref().expect("buffers made above");
        let _guard = ContextGuard::for_stream_no_device(b.stream.raw())?;
        let stream = b.stream.raw();
        let total = n * self.size;
        // SAFETY: pinned staging buffers of `cap` (send) and `cap * size` (recv) bytes;
        // the copies complete before they are touched again (the stream is polled idle).
        unsafe {
            std::ptr::copy_nonoverlapping(local.as_ptr(), b.host_send.host as *mut u8, n);
            copy_from_pinned_async(b.send.ptr, b.host_send.host, n, stream)?;
        }
        // SAFETY: device buffers of the stated sizes; the live communicator.
        let pending = check_nb(
            unsafe {
                nc::ncclAllGather(
                    b.send.ptr.as_void(),
                    b.recv.ptr.as_void(),
                    n,
                    nc::ncclDataType_t::ncclUint8,
                    self.comm as nc::ncclComm_t,
                    stream.raw() as nc::cudaStream_t,
                )
            },
            "ncclAllGather",
        )?;
        let t0 = Instant::now();
        if pending {
            wait_ready(self.comm, self.timeout, "enqueueing the exchange")?;
        }
        // SAFETY: as above.
        unsafe { copy_to_pinned_async(b.host_recv.host, b.recv.ptr, total, stream)? };
        while !b.stream.idle()? {
            if t0.elapsed() > self.timeout {
                return Err(Error::new(K::Timeout, "a peer never joined it"));
            }
            match async_state(self.comm)? {
                0 | IN_PROGRESS => {}
                e => {
                    return Err(Error::new(
                        K::Nccl,
                        format!(
                            "the exchange with the peers failed: NCCL reported {}",
                            result_name(e)
                        ),
                    ));
                }
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        let mut out = vec![0u8; total];
        // SAFETY: the download completed (the stream is idle).
        unsafe {
            std::ptr::copy_nonoverlapping(b.host_recv.host as *const u8, out.as_mut_ptr(), total)
        };
        Ok(out)
    }

    /// Abort the communicator (once): its kernels exit. The buffers are then dropped
    /// once the stream drained (a copy behind the aborted kernel may still be running),
    /// else leaked.
    fn abort(&self, st: &mut State) {
        if st.aborted {
            return;
        }
        st.aborted = true;
        // SAFETY: the live communicator; `aborted` makes this its last use. (Relaxed: NCCL
        // frees device memory; see NcclTransport's drop.)
        let _relaxed = crate::cuda::resources::RelaxedCapture::new();
        unsafe { nc::ncclCommAbort(self.comm as nc::ncclComm_t) };
        if let Some(b) = st.bufs.take() {
            let t0 = Instant::now();
            let drained = loop {
                match b.stream.idle() {
                    Ok(true) => break true,
                    Ok(false) if t0.elapsed() < Duration::from_secs(1) => {
                        std::thread::sleep(Duration::from_micros(100))
                    }
                    _ => break false,
                }
            };
            if !drained {
                std::mem::forget(b);
            }
        }
    }
}

impl Drop for Channel {
    /// Abort, not finalize: the communicator is idle here (every exchange completed, or
    /// it was aborted already), and aborting it needs no peer, so contexts may be destroyed
    /// in any order and a destroy never waits for a rank that is gone.
    fn drop(&mut self) {
        let _relaxed = crate::cuda::resources::RelaxedCapture::new(); // (see NcclTransport's drop)
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let stream = st.bufs.as_ref().map(|b| b.stream.raw());
        // (the buffers' context, current while they are freed)
        let _guard = stream.map(ContextGuard::for_stream_no_device);
        self.abort(&mut st);
    }
}
