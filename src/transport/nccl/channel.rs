//! [`Channel`]: the library's own exchange channel over the ranks of a caller's NCCL
//! communicator (a non-blocking communicator of its own, every wait bounded), and
//! [`Owned`]: a bootstrap's exchanges moved onto it.
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
//!
//! It lives with the NCCL transport, above `bootstrap` (whose [`Bootstrap`] it uses for
//! the unique id), and shares the transport's NCCL wrappers ([`super::api`]); the
//! bootstrap holds it as an [`OwnedExchange`].
use super::api::{
    IN_PROGRESS, async_state, check_nb, init_nonblocking, nonblocking_config, result_name,
    wait_ready,
};
use crate::bootstrap::{Bootstrap, Exchange, OwnedExchange};
use crate::cuda::dynlib::nccl_sys as nc;
use crate::cuda::resources::{
    DeviceMem, HostMapped, Stream, copy_from_pinned_async, copy_to_pinned_async,
};
use crate::cuda::{ContextGuard, NcclComm, StreamHandle};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    comm: NcclComm,
    rank: usize,
    size: usize,
    timeout: Duration,
    st: Mutex<State>,
}

impl Channel {
    /// Collective over the caller's communicator (`via`): rank 0's unique id goes through
    /// `via` (its last use), then every rank joins the new communicator and connects it
    /// with one small exchange, each wait bounded by `timeout`.
    pub fn create(via: &Bootstrap, timeout: Duration) -> Result<Channel> {
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
            unsafe { nc::ncclCommAbort(raw.raw()) };
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
                    self.comm.raw(),
                    stream.rt(),
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
        unsafe { nc::ncclCommAbort(self.comm.raw()) };
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

impl OwnedExchange for Channel {
    fn allgather(&self, local: &[u8]) -> Result<Vec<u8>> {
        Channel::allgather(self, local)
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

/// A bootstrap's exchanges moved onto a [`Channel`] of the library's own.
pub trait Owned: Sized {
    /// This bootstrap with its exchanges over a communicator of the library's own when
    /// it is the caller's NCCL communicator of more than one rank (collective: see
    /// [`Channel::create`]; every wait bounded by `timeout`), else itself.
    fn owned(self, timeout: Duration) -> Result<Bootstrap>;
}

impl Owned for Bootstrap {
    fn owned(self, timeout: Duration) -> Result<Bootstrap> {
        match self.exchange {
            Exchange::Nccl(_) if self.size > 1 => {
                let ch = Channel::create(&self, timeout)?;
                Ok(Bootstrap {
                    rank: self.rank,
                    size: self.size,
                    exchange: Exchange::Owned(Box::new(ch)),
                })
            }
            _ => Ok(self),
        }
    }
}
