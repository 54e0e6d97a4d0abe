//! The NCCL transport: works for any placement of the group's ranks (across nodes too).
//! Exchange steps are grouped ncclSend / ncclRecv on the comm stream; algorithms that
//! need loads from peers' buffers use NCCL collectives instead (see `crate::overlap`).
//! The group gets its own communicator (a unique id exchanged through the bootstrap),
//! so the caller's communicator is never used concurrently, and never aborted.
//!
//! No hang (the IPC transport's timeout contract): the group's communicator is
//! non-blocking (NCCL calls that must wait for peers return `ncclInProgress`; the host
//! polls them for at most the timeout), and a watchdog thread per object follows each
//! call on the GPU through a host-mapped progress record (call started / finished,
//! written by tiny kernels, so captured CUDA-graph replays are followed too). A call
//! that does not finish within the timeout, an NCCL asynchronous error, or a cross-rank
//! mismatch (NVTE_COMM_CHECK) makes the watchdog abort the group's communicator: NCCL's
//! kernels exit, the streams drain, and every later call reports the failure. Every call
//! starts with an arrival exchange (a 16-byte token {call descriptor, call number} sent
//! to and received from every peer, copied to the progress record after it), so a
//! timeout names the peers that never entered the call.
pub mod api;
pub mod channel;

use super::{
    Collectives, Constructor, ErrorRecord, ExchangePart, FailureKind, FlagSlot, FlagSlots, Group,
    MAX_PEERS, PeerSet, RecvOp, SendOp, Timeout, Transport, TwoSided, WaitInfo,
};
use crate::bootstrap::Bootstrap;
use crate::cuda::dynlib::nccl_sys as nc;
use crate::cuda::resources::{DeviceMem, HostMapped};
use crate::cuda::{
    self, Binding, ContextGuard, DevPtr, DeviceInfo, Kernel, Lib, Signature, nccl_check as check,
    nvrtc,
};
use crate::cuda::{NcclComm, StreamHandle};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::unsupported;
use api::{IN_PROGRESS, async_state, check_nb, nonblocking_config, result_name, wait_ready};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// NCCL's element type for a reduction of `d`.
pub fn nccl_type(d: DType) -> Result<nc::ncclDataType_t> {
    Ok(match d {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::F16 => nc::ncclDataType_t::ncclFloat16,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        other => unsupported!("NCCL cannot reduce {} data", other.name()),
    })
}

/// The per-call progress record (kernels/comm.cu `Progress`), host-mapped.
#[repr(C)]
struct Progress {
    started: u64,
    finished: u64,
    op: u64,
    arrived: u64,
    tokens: [[u64; 2]; MAX_PEERS],
}

/// The group communicator, behind a lock: the object's thread enqueues with it, the
/// watchdog polls and aborts it.
struct Comm {
    raw: NcclComm,
    aborted: bool,
}

/// What the object's thread and its watchdog share.
struct Shared {
    comm: Mutex<Comm>,
    progress: HostMapped,
    error: HostMapped,
    /// The failure the watchdog recorded (it aborted the communicator).
    failure: Mutex<Option<Timeout>>,
    timeout: Duration,
    world_ranks: Vec<usize>,
    tp_rank: usize,
    stop: AtomicBool,
    /// Set while the watchdog, having recorded a failure and aborted the communicator,
    /// finds out which peers entered the call: readers wait for that account (bounded)
    /// rather than report the failure without it.
    refining: AtomicBool,
}

/// How long a reader of a failure waits for the watchdog's account of the absent peers
/// (`Shared::absent_peers` waits up to 500 ms after the abort, which itself may take a
/// while).
const REFINE_WAIT: Duration = Duration::from_millis(2000);

impl Shared {
    fn progress(&self) -> (u64, u64, u64, u64) {
        let p = self.progress.host as *const Progress;
        // SAFETY: live host-mapped record written by the device: volatile loads.
        unsafe {
            (
                std::ptr::read_volatile(&(*p).started),
                std::ptr::read_volatile(&(*p).finished),
                std::ptr::read_volatile(&(*p).op),
                std::ptr::read_volatile(&(*p).arrived),
            )
        }
    }
    fn token_seq(&self, peer: usize) -> u64 {
        let p = self.progress.host as *const Progress;
        // SAFETY: as above; peer < MAX_PEERS.
        unsafe { std::ptr::read_volatile(&(*p).tokens[peer][1]) }
    }
    fn device_failure(&self) -> Option<Timeout> {
        // SAFETY: this object's live host-mapped record.
        unsafe { ErrorRecord::read(self.error.host as *const ErrorRecord) }
    }
    /// The recorded failure: the watchdog's, else the device's (a mismatch not yet seen
    /// by the watchdog).
    fn failure(&self) -> Option<Timeout> {
        let read = || {
            self.failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        };
        let f = read();
        if f.is_some() && self.refining.load(Ordering::Acquire) {
            // The watchdog is naming the absent peers: wait for it (bounded), then read
            // the refined record.
            let t0 = Instant::now();
            while self.refining.load(Ordering::Acquire) && t0.elapsed() < REFINE_WAIT {
                std::thread::sleep(Duration::from_millis(1));
            }
            return read();
        }
        f.or_else(|| self.device_failure())
    }
    /// Abort the communicator (once): NCCL's kernels of the group exit. `aborted` is set
    /// under the lock (from then on nobody else calls NCCL with it), the abort itself runs
    /// outside it: it may block (NCCL waits for CUDA graphs that captured its operations
    /// to be destroyed), and the owner must meanwhile fail fast instead of waiting for the
    /// lock. Record the failure before calling this: once the kernels exit, the streams
    /// drain and a synchronize must already see the failure.
    fn abort_comm(&self) {
        let raw = {
            let mut c = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            if c.aborted {
                return;
            }
            c.aborted = true;
            c.raw
        };
        // SAFETY: the live communicator; `aborted` (set above, under the lock) makes this
        // the only and last use of it. (Relaxed: see NcclTransport's drop.)
        let _relaxed = crate::cuda::resources::RelaxedCapture::new();
        unsafe { nc::ncclCommAbort(raw.raw()) };
    }
    /// Record `f` unless a failure is recorded already.
    fn record(&self, f: Timeout) {
        let mut g = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(f);
        }
    }
    /// Replace the recorded failure's peer and note (the account refined after an abort).
    fn refine(&self, peer: u32, note: String) {
        let mut g = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = g.as_mut() {
            f.peer_world_rank = peer;
            f.note = Some(note);
        }
    }
    /// Record `f`, then abort the communicator.
    fn abort(&self, f: Timeout) {
        self.record(f);
        self.abort_comm();
    }
    /// Record `f` for call `seq`, abort the communicator, then refine the record with
    /// the peers that never entered the call (`note` says what happened). Readers of the
    /// failure wait for the refined record (`refining`, set before the record appears).
    fn abort_and_name(&self, f: Timeout, seq: u64, note: &str) {
        self.refining.store(true, Ordering::Release);
        self.abort(f);
        let (peer, who) = self.name_absent(seq);
        self.refine(peer, format!("{who}; {note}"));
        self.refining.store(false, Ordering::Release);
    }
    /// After an abort in call `seq`: the first absent peer (u32::MAX: none known) and an
    /// account of who entered the call.
    fn name_absent(&self, seq: u64) -> (u32, String) {
        match self.absent_peers(seq) {
            Some(a) if !a.is_empty() => (
                a[0] as u32,
                format!(
                    "world rank(s) {a:?} did not confirm entering the call (their arrival tokens did not come; a rank listed after the first may only have been queued behind it)"
                ),
            ),
            Some(_) => (
                u32::MAX,
                "every peer entered the call, which then did not complete: a peer failed or hangs inside it (or waits for one that does)".into(),
            ),
            None => (
                u32::MAX,
                "the arrival exchange did not finish even after the abort: which peer is missing is unknown".into(),
            ),
        }
    }
    /// After aborting for a timeout of call `seq`: the peers whose arrival token for it
    /// never came (once the aborted exchange exits, the kernel behind it copies what did
    /// arrive into the progress record; waited for briefly).
    fn absent_peers(&self, seq: u64) -> Option<Vec<usize>> {
        let t0 = Instant::now();
        while self.progress().3 < seq {
            if t0.elapsed() > Duration::from_millis(500) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(
            (0..self.world_ranks.len())
                .filter(|&p| p != self.tp_rank && self.token_seq(p) < seq)
                .map(|p| self.world_ranks[p])
                .collect(),
        )
    }
}

/// The watchdog: every 2 ms, look at the device-recorded failure, NCCL's asynchronous
/// error and the progress of the call in flight; abort the communicator on any failure.
/// Ends with the object (or after aborting).
fn watchdog(w: Weak<Shared>) {
    let (mut seen, mut since) = (0u64, Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(2));
        let Some(sh) = w.upgrade() else { return };
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        if let Some(f) = sh.device_failure() {
            sh.abort(f);
            return;
        }
        let st = {
            let c = sh.comm.lock().unwrap_or_else(|e| e.into_inner());
            if c.aborted {
                return;
            }
            async_state(c.raw)
        };
        let (started, finished, op, _) = sh.progress();
        match st {
            Ok(0) | Ok(IN_PROGRESS) => {}
            Ok(e) => {
                let note = format!(
                    "the group's NCCL communicator reported an asynchronous error: {}; the watchdog aborted it",
                    result_name(e)
                );
                let f = Timeout::host(
                    FailureKind::Transport,
                    op as u32,
                    started,
                    0.0,
                    note.clone(),
                );
                if started > finished {
                    sh.abort_and_name(f, started, &note);
                } else {
                    sh.abort(f);
                }
                return;
            }
            Err(_) => {}
        }
        if started > finished {
            if started != seen {
                (seen, since) = (started, Instant::now());
            } else if since.elapsed() > sh.timeout {
                const ABORTED: &str = "the watchdog aborted the group's NCCL communicator";
                // Record, abort (that ends the stuck kernels), then read who arrived.
                let f = Timeout::host(
                    FailureKind::Timeout,
                    op as u32,
                    started,
                    since.elapsed().as_secs_f64() * 1e3,
                    ABORTED.into(),
                );
                sh.abort_and_name(f, started, ABORTED);
                return;
            }
        } else {
            seen = 0;
        }
    }
}

/// The group's own communicator (collective over the world: every member of `group`
/// joins as its group rank `tp_rank`), ready (waited for at most `timeout`).
fn init_group_comm(
    bs: &Bootstrap,
    group: &[usize],
    tp_rank: usize,
    timeout: Duration,
) -> Result<NcclComm> {
    // The group's communicator is made from a unique id of the group's first rank,
    // exchanged through the bootstrap, with ncclCommInitRankConfig (non-blocking, so the
    // wait for the group is bounded by the timeout). Not ncclCommSplit of the caller's
    // communicator: a split follows the parent's blocking mode, so with a blocking
    // parent (the usual case) a rank that never joins would block it without a limit.
    let mut config = nonblocking_config();
    api::init_nonblocking(
        bs,
        group[0],
        (group.len(), tp_rank),
        &mut config,
        timeout,
        "the group's NCCL communicator",
    )
}

/// What [`NcclTransport::create`] allocates: the call counter, this rank's arrival token
/// and the received ones, the buffer, the progress and error records.
type NcclMem = (
    DeviceMem,
    DeviceMem,
    DeviceMem,
    DeviceMem,
    HostMapped,
    HostMapped,
);

pub struct NcclTransport {
    shared: Arc<Shared>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    group: Group,
    /// this rank's call counter (u64), its arrival token {desc, seq}, the received ones
    counter: DeviceMem,
    token: DeviceMem,
    tokens: DeviceMem,
    check: bool,
    /// the module of `k`'s kernels, kept loaded as long as the object
    _module: Arc<nvrtc::Module>,
    k: NcclKernels,
}

/// nccl_arrived's parameters: tokens, the check set, counter, descriptor, do_check, error
/// record, operation, progress record, tp.
type ArrivedParams = (DevPtr, PeerSet, DevPtr, u64, u32, DevPtr, u32, DevPtr, u32);

/// nccl_begin(u64 *counter, u64 *token, u64 desc, u32 op, Progress *p)
// SAFETY (each binding): the kernel's parameter list in kernels/comm.cu (CheckSet is
// PeerSet's layout, pointers are DevPtr, repr(transparent) u64).
const BEGIN: Binding<(DevPtr, DevPtr, u64, u32, DevPtr)> =
    unsafe { Binding::new(&nvrtc::COMM, "nccl_begin", "nccl") };
/// nccl_arrived(const u64 *tokens, CheckSet check, const u64 *counter, u64 desc, u32
/// do_check, ErrorRecord *err, u32 op, Progress *p, u32 tp)
const ARRIVED: Binding<ArrivedParams> =
    unsafe { Binding::new(&nvrtc::COMM, "nccl_arrived", "nccl") };
/// nccl_end(const u64 *counter, Progress *p)
const END: Binding<(DevPtr, DevPtr)> = unsafe { Binding::new(&nvrtc::COMM, "nccl_end", "nccl") };

/// The kernel bindings of this transport (checked against kernels/comm.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![BEGIN.signature(), ARRIVED.signature(), END.signature()]
}

/// The kernels of kernels/comm.cu this transport launches.
#[derive(Clone, Copy)]
struct NcclKernels {
    begin: Kernel<(DevPtr, DevPtr, u64, u32, DevPtr)>,
    arrived: Kernel<ArrivedParams>,
    end: Kernel<(DevPtr, DevPtr)>,
}

impl NcclKernels {
    /// Looked up now, outside any graph capture.
    fn new(m: &nvrtc::Module) -> Result<NcclKernels> {
        // SAFETY: `m` is kernels/comm.cu's module, the bindings' source.
        unsafe {
            Ok(NcclKernels {
                begin: Kernel::new(m, &BEGIN, &[])?,
                arrived: Kernel::new(m, &ARRIVED, &[])?,
                end: Kernel::new(m, &END, &[])?,
            })
        }
    }
}

/// The tracking kernels' shapes: one thread, or one warp (a thread per peer).
const ONE_THREAD: ((u32, u32, u32), (u32, u32, u32)) = ((1, 1, 1), (1, 1, 1));
const ONE_WARP: ((u32, u32, u32), (u32, u32, u32)) = ((1, 1, 1), (32, 1, 1));

// SAFETY: an owned communicator (behind a lock) and device memory, used from one thread
// at a time (plus the watchdog, which only touches `Shared`).
unsafe impl Send for NcclTransport {}

/// What [`NcclTransport::create`] needs besides the bootstrap.
pub struct NcclSettings {
    pub buffer_bytes: usize,
    pub timeout_ms: u64,
    pub check: bool,
}

impl NcclTransport {
    /// This rank's memory of a transport with a buffer of `buffer_bytes`, zeroed.
    fn alloc(buffer_bytes: usize) -> Result<NcclMem> {
        let counter = DeviceMem::new(8)?;
        counter.zero()?;
        let token = DeviceMem::new(16)?;
        token.zero()?;
        let tokens = DeviceMem::new(16 * MAX_PEERS)?;
        tokens.zero()?;
        let buffer = DeviceMem::new(buffer_bytes)?;
        buffer.zero()?;
        let progress = HostMapped::new(std::mem::size_of::<Progress>())?;
        let error = HostMapped::new(std::mem::size_of::<ErrorRecord>())?;
        Ok((counter, token, tokens, buffer, progress, error))
    }

    /// Collective over the world (all ranks, same `tp`): a communicator per group.
    pub fn create(
        bs: &Bootstrap,
        group: &[usize],
        guard: &ContextGuard,
        dev: &DeviceInfo,
        s: &NcclSettings,
    ) -> Result<NcclTransport> {
        if group.len() > MAX_PEERS {
            unsupported!(
                "tensor-parallel size {} exceeds the maximum of {MAX_PEERS}",
                group.len()
            );
        }
        // (every rank's outcome exchanged: one that fails here makes them all fail,
        // instead of leaving them in the exchange of the group's unique id)
        let local = || -> Result<_> {
            cuda::require(Lib::Nccl)?;
            let module = nvrtc::module(&nvrtc::COMM, guard.id, dev)?;
            let k = NcclKernels::new(&module)?;
            Ok((module, k, Self::alloc(s.buffer_bytes)?))
        };
        let (module, k, mem) =
            bs.agree(local(), "make their NCCL transport's kernels and memory")?;
        let timeout = Duration::from_millis(s.timeout_ms);
        let tp_rank = group
            .iter()
            .position(|&w| w == bs.rank)
            .expect("group contains this rank");
        let raw = init_group_comm(bs, group, tp_rank, timeout)?;
        let (counter, token, tokens, buffer, progress, error) = mem;
        let shared = Arc::new(Shared {
            comm: Mutex::new(Comm {
                raw,
                aborted: false,
            }),
            progress,
            error,
            failure: Mutex::new(None),
            timeout,
            world_ranks: group.to_vec(),
            tp_rank,
            stop: AtomicBool::new(false),
            refining: AtomicBool::new(false),
        });
        let w = Arc::downgrade(&shared);
        let watchdog = std::thread::Builder::new()
            .name("te-comm-nccl-watchdog".into())
            .spawn(move || watchdog(w))
            .map_err(|e| {
                Error::new(
                    K::Internal,
                    format!("starting the NCCL watchdog thread: {e}"),
                )
            });
        let mut t = NcclTransport {
            shared,
            watchdog: None,
            group: Group::new(bs.rank, group, buffer),
            counter,
            token,
            tokens,
            check: s.check,
            _module: module,
            k,
        };
        // (Dropping `t` on error finalizes or aborts the communicator.)
        t.watchdog = Some(watchdog?);
        Ok(t)
    }

    /// Run NCCL calls `f` with the communicator, under the lock, then wait (bounded) for
    /// them if NCCL reports them in progress. Fails with the recorded failure once the
    /// communicator was aborted; aborts it when the wait runs out.
    fn with_comm(&self, what: &str, f: impl FnOnce(nc::ncclComm_t) -> Result<bool>) -> Result<()> {
        let c = self.shared.comm.lock().unwrap_or_else(|e| e.into_inner());
        if c.aborted {
            drop(c);
            return Err(self.aborted_error());
        }
        let raw = c.raw;
        let pending = f(raw.raw())?;
        if !pending {
            return Ok(());
        }
        match wait_ready(raw, self.shared.timeout, what) {
            Ok(()) => Ok(()),
            Err(e) => {
                drop(c);
                let (started, _, op, _) = self.shared.progress();
                let kind = if e.kind == K::Timeout {
                    FailureKind::Timeout
                } else {
                    FailureKind::Transport
                };
                self.shared.abort(Timeout::host(
                    kind,
                    op as u32,
                    started,
                    self.shared.timeout.as_secs_f64() * 1e3,
                    format!("{} (the group's NCCL communicator was aborted)", e.msg),
                ));
                Err(e)
            }
        }
    }

    fn aborted_error(&self) -> Error {
        let note = self
            .shared
            .failure()
            .and_then(|f| f.note)
            .unwrap_or_else(|| "the group's NCCL communicator was aborted".into());
        Error::new(
            K::Timeout,
            format!(
                "the NCCL transport failed earlier: {note}. The object is unusable now: destroy it."
            ),
        )
    }

    /// A collective on the group communicator, on `stream`.
    fn collective(
        &self,
        what: &str,
        f: impl FnOnce(nc::ncclComm_t) -> nc::ncclResult_t,
    ) -> Result<()> {
        self.with_comm(what, |c| check_nb(f(c), what))
    }

    /// A sum reduction on the group communicator: ncclAllReduce (`count` elements in and
    /// out) or ncclReduceScatter (`count` elements out, tp * `count` in); both have this
    /// signature.
    fn sum(
        &self,
        name: &str,
        f: unsafe fn(
            *const c_void,
            *mut c_void,
            usize,
            nc::ncclDataType_t,
            nc::ncclRedOp_t,
            nc::ncclComm_t,
            nc::cudaStream_t,
        ) -> nc::ncclResult_t,
        (src, dst, count): (DevPtr, DevPtr, usize),
        d: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        let t = nccl_type(d)?;
        // SAFETY: `f` is ncclAllReduce or ncclReduceScatter of the bound NCCL; the device
        // ranges hold what the callers state (validated by the algorithm).
        self.collective(name, |c| unsafe {
            f(
                src.as_void(),
                dst.as_void(),
                count,
                t,
                nc::ncclRedOp_t::ncclSum,
                c,
                stream.rt(),
            )
        })
    }

    /// Grouped sends and receives of raw device ranges.
    fn p2p(
        &self,
        sends: &[(usize, DevPtr, usize)],
        recvs: &[(usize, DevPtr, usize)],
        stream: StreamHandle,
    ) -> Result<()> {
        let u8t = nc::ncclDataType_t::ncclUint8;
        let st = stream.rt();
        let timeout = self.shared.timeout;
        self.with_comm("ncclSend/ncclRecv", |c| {
            // SAFETY: grouped point-to-point calls on device ranges validated by the caller.
            check(unsafe { nc::ncclGroupStart() }, "ncclGroupStart")?;
            let mut r = Ok(());
            for &(peer, src, bytes) in sends {
                r = r.and(check(
                    // SAFETY: `src` holds `bytes` (the caller's validated range).
                    unsafe { nc::ncclSend(src.as_void(), bytes, u8t, peer as i32, c, st) },
                    "ncclSend",
                ));
            }
            for &(peer, dst, bytes) in recvs {
                r = r.and(check(
                    // SAFETY: `dst` holds `bytes` (inside this rank's buffer or tokens).
                    unsafe { nc::ncclRecv(dst.as_void(), bytes, u8t, peer as i32, c, st) },
                    "ncclRecv",
                ));
            }
            // SAFETY: closes the group opened above, on this thread.
            let pending = check_nb(unsafe { nc::ncclGroupEnd() }, "ncclGroupEnd")?;
            if r.is_err() && pending {
                // Nothing may be issued on a non-blocking communicator with a job pending.
                let _ = wait_ready(
                    NcclComm::from_raw(c),
                    timeout,
                    "ncclGroupEnd after a failed call",
                );
            }
            r.map(|_| pending)
        })
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // NCCL frees its device memory here: not refused (and no other thread's global
        // capture invalidated) when this runs on a thread beside a capture.
        let _relaxed = crate::cuda::resources::RelaxedCapture::new();
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if self.shared.failure().is_some() {
            // A failed group: no finalize (it would wait for peers that may be gone).
            self.shared.abort_comm();
            return;
        }
        let mut c = self.shared.comm.lock().unwrap_or_else(|e| e.into_inner());
        if c.aborted {
            return;
        }
        let raw = c.raw;
        // Finalize (bounded: a peer that is gone must not hang the destroy), then destroy;
        // abort when finalizing fails or runs out of time.
        // SAFETY: the live communicator created in `create`, released once, here.
        let finalized = match check_nb(
            unsafe { nc::ncclCommFinalize(raw.raw()) },
            "ncclCommFinalize",
        ) {
            Ok(false) => true,
            Ok(true) => wait_ready(raw, self.shared.timeout, "ncclCommFinalize").is_ok(),
            Err(_) => false,
        };
        // SAFETY: as above: the communicator is released exactly once.
        unsafe {
            if finalized {
                nc::ncclCommDestroy(raw.raw());
            } else {
                nc::ncclCommAbort(raw.raw());
            }
        }
        c.aborted = true;
    }
}

impl Transport for NcclTransport {
    fn group(&self) -> &Group {
        &self.group
    }
    fn name(&self) -> &'static str {
        "nccl"
    }
    /// Increment the call counter and record "started" (one kernel), exchange arrival
    /// tokens {desc, call number} with every peer (one grouped NCCL launch), then copy
    /// them to the progress record and, with NVTE_COMM_CHECK, compare them (one kernel).
    /// Alone (a group of one rank) nothing: no peer to wait for, watch or compare with.
    fn begin_call(
        &self,
        _calls: u64,
        stream: StreamHandle,
        info: WaitInfo,
        desc: u64,
    ) -> Result<()> {
        if self.shared.failure().is_some() {
            return Err(self.aborted_error());
        }
        if self.group.world_ranks.len() == 1 {
            return Ok(());
        }
        let (counter, token, tokens) = (self.counter.ptr, self.token.ptr, self.tokens.ptr);
        let progress = self.shared.progress.device;
        let op = info.op;
        // SAFETY: nccl_begin of this object's module (its device's context); the counter,
        // token and host-mapped progress record are this object's, live as long as it.
        unsafe {
            self.k
                .begin
                .launch(ONE_THREAD, stream, (counter, token, desc, op, progress))?
        };
        let others = self.group.others();
        if !others.is_empty() {
            let sends: Vec<_> = others.iter().map(|&p| (p, self.token.ptr, 16)).collect();
            let recvs: Vec<_> = others
                .iter()
                .map(|&p| (p, self.tokens.ptr + 16 * p, 16))
                .collect();
            self.p2p(&sends, &recvs, stream)?;
        }
        let slots = PeerSet::new(&others, &self.group.world_ranks, |p| {
            self.tokens.ptr + 16 * p
        });
        let err = self.shared.error.device;
        let do_check = self.check as u32;
        let tp = self.group.world_ranks.len() as u32;
        let params = (
            tokens, slots, counter, desc, do_check, err, op, progress, tp,
        );
        // SAFETY: nccl_arrived of this object's module; the tokens, counter and host-mapped
        // records are this object's, live as long as it.
        unsafe { self.k.arrived.launch(ONE_WARP, stream, params) }
    }
    fn end_call(&self, _seq: u64, stream: StreamHandle) -> Result<()> {
        if self.group.world_ranks.len() == 1 {
            return Ok(());
        }
        let counter = self.counter.ptr;
        let progress = self.shared.progress.device;
        // SAFETY: nccl_end of this object's module; its counter and host-mapped progress
        // record live as long as it.
        unsafe { self.k.end.launch(ONE_THREAD, stream, (counter, progress)) }
    }
    fn wait_done(&self, _seq: u64, _stream: StreamHandle, _info: WaitInfo) -> Result<()> {
        Ok(())
    }
    /// begin_call and end_call enqueue nothing alone, and wait_done never does: a group
    /// of one rank runs its calls inline (tp 1 over NCCL cost 22-26 us of host per
    /// overlap call and 18 CUDA calls, against 9-13 us inline over IPC; H100, 2026-11-26).
    fn idle_alone(&self) -> bool {
        true
    }
    fn two_sided(&self) -> Option<&dyn TwoSided> {
        Some(self)
    }
    fn collectives(&self) -> Option<&dyn Collectives> {
        Some(self)
    }
    /// No flags: the exchanges are ordered by NCCL itself.
    fn flag_slots(&self) -> FlagSlots {
        FlagSlots::new(super::ALGO_SLOTS)
    }
    fn timeout(&self) -> Option<Timeout> {
        self.shared.failure()
    }
    fn comm_sms(&self) -> u32 {
        0
    }
}

impl TwoSided for NcclTransport {
    fn exchange(
        &self,
        part: ExchangePart,
        sends: &[SendOp],
        recvs: &[RecvOp],
        _slot: FlagSlot,
        _value: u64,
        stream: StreamHandle,
        _info: WaitInfo,
    ) -> Result<()> {
        if part == ExchangePart::Finish {
            return Ok(()); // (one grouped send / recv: the whole step at its start)
        }
        if sends.iter().any(|s| s.rows > 1) || recvs.iter().any(|r| r.rows > 1) {
            return Err(Error::unsupported(
                "NCCL transport: strided exchange (its `strided` capability is false)",
            ));
        }
        let s: Vec<_> = sends.iter().map(|s| (s.peer, s.src, s.bytes)).collect();
        let r: Vec<_> = recvs
            .iter()
            .map(|v| (v.peer, self.group.buffer.ptr + v.dst_offset, v.bytes))
            .collect();
        self.p2p(&s, &r, stream)
    }
    fn concurrent_streams(&self) -> bool {
        false
    }
}

impl Collectives for NcclTransport {
    /// ncclAllReduce (sum) of `count` elements.
    fn all_reduce(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        d: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        self.sum(
            "ncclAllReduce",
            nc::ncclAllReduce,
            (src, dst, count),
            d,
            stream,
        )
    }

    /// ncclReduceScatter (sum): `src` holds tp * `recv_count` elements.
    fn reduce_scatter(
        &self,
        src: DevPtr,
        dst: DevPtr,
        recv_count: usize,
        d: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        self.sum(
            "ncclReduceScatter",
            nc::ncclReduceScatter,
            (src, dst, recv_count),
            d,
            stream,
        )
    }

    fn all_gather_bytes(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: dst holds tp * bytes.
        self.collective("ncclAllGather", |c| unsafe {
            nc::ncclAllGather(
                src.as_void(),
                dst.as_void(),
                bytes,
                nc::ncclDataType_t::ncclUint8,
                c,
                stream.rt(),
            )
        })
    }
}

/// The registry's entry: any placement; picked by auto when peer memory cannot reach the
/// group.
pub const ENTRY: Constructor = Constructor {
    auto: |_| true,
    create: |s| {
        let st = s.settings;
        let settings = NcclSettings {
            buffer_bytes: st.buffer_bytes,
            timeout_ms: st.timeout_ms,
            check: st.check,
        };
        Ok(Box::new(NcclTransport::create(
            s.bs, s.group, s.guard, s.dev, &settings,
        )?))
    },
};

#[cfg(test)]
mod tests {
    /// kernels/comm.cu asserts the same numbers.
    #[test]
    fn progress_has_the_kernels_layout() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<super::Progress>(), 32 + 16 * super::MAX_PEERS);
        assert_eq!(offset_of!(super::Progress, tokens), 32);
    }
}
