//! Out-of-band exchange among the ranks of the world at setup time: an allgather and a
//! barrier, either through an NCCL communicator or through the caller's callbacks (the
//! analog of TE's ExtAllgatherOp / ExtBarrierOp, so a framework can use its own process
//! group). Used while creating objects, by a comm-GEMM context's engine creation and
//! autotuning, and under NVTE_COMM_CHECK once per eager comm-GEMM call (a debug mode);
//! never in the hot path otherwise. A comm-GEMM context moves its exchanges from the
//! caller's NCCL communicator to one of its own (an [`OwnedExchange`]: the NCCL
//! transport's `crate::transport::nccl::channel`, above this layer, makes it).
use crate::cuda::dynlib::nccl_sys as nccl;
use crate::cuda::resources::{DeviceMem, Stream, copy_to_host};
use crate::cuda::{self, Lib, NcclComm, nccl_check};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use crate::invalid;
use std::ffi::c_void;

/// allgather(user, global, global_bytes, local, local_bytes): gather `local_bytes` from
/// every rank into `global` in rank order; returns 0 on success.
pub type AllgatherFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *const c_void, usize) -> i32;
/// barrier(user): returns 0 on success.
pub type BarrierFn = unsafe extern "C" fn(*mut c_void) -> i32;

pub enum Exchange {
    /// the caller's communicator (not owned)
    Nccl(NcclComm),
    Callbacks {
        allgather: AllgatherFn,
        barrier: BarrierFn,
        user: usize,
    },
    /// the library's own communicator over the ranks of the caller's
    /// (`crate::transport::nccl::channel::Owned`)
    Owned(Box<dyn OwnedExchange>),
}

/// An exchange channel of the library's own over the ranks of the caller's NCCL
/// communicator (`crate::transport::nccl::channel::Channel`, which the layer above
/// makes): an allgather whose every wait is bounded.
pub trait OwnedExchange: Send + Sync {
    /// Gather `local` (same length on every rank) from all ranks, in rank order.
    fn allgather(&self, local: &[u8]) -> Result<Vec<u8>>;
}

pub struct Bootstrap {
    pub rank: usize,
    pub size: usize,
    pub exchange: Exchange,
}

impl Bootstrap {
    /// Rank and size from an NCCL communicator (the caller's; not owned).
    pub fn from_nccl(comm: NcclComm) -> Result<Bootstrap> {
        if comm.is_null() {
            invalid!("argument `nccl_comm` is NULL");
        }
        cuda::require(Lib::Nccl)?;
        let (mut rank, mut size) = (0, 0);
        // SAFETY: the caller passes a live communicator.
        nccl_check(
            unsafe { nccl::ncclCommUserRank(comm.raw(), &mut rank) },
            "ncclCommUserRank",
        )?;
        nccl_check(
            // SAFETY: as above.
            unsafe { nccl::ncclCommCount(comm.raw(), &mut size) },
            "ncclCommCount",
        )?;
        Ok(Bootstrap {
            rank: rank as usize,
            size: size as usize,
            exchange: Exchange::Nccl(comm),
        })
    }

    pub fn from_callbacks(
        rank: i32,
        size: i32,
        allgather: Option<AllgatherFn>,
        barrier: Option<BarrierFn>,
        user: usize,
    ) -> Result<Bootstrap> {
        if size <= 0 || rank < 0 || rank >= size {
            invalid!(
                "world_rank = {rank} and world_size = {size} are inconsistent (need 0 <= rank < size)"
            );
        }
        let (Some(allgather), Some(barrier)) = (allgather, barrier) else {
            invalid!(
                "bootstrap->{} is NULL: with a NULL nccl_comm, the allgather and barrier callbacks must both be set",
                if allgather.is_none() {
                    "allgather"
                } else {
                    "barrier"
                }
            );
        };
        Ok(Bootstrap {
            rank: rank as usize,
            size: size as usize,
            exchange: Exchange::Callbacks {
                allgather,
                barrier,
                user,
            },
        })
    }

    /// Gather `local` (same length on every rank) from all ranks, in rank order.
    pub fn allgather(&self, local: &[u8]) -> Result<Vec<u8>> {
        let n = local.len();
        match &self.exchange {
            Exchange::Owned(ch) => ch.allgather(local),
            &Exchange::Callbacks {
                allgather, user, ..
            } => {
                let mut out = gather_buffer(n, self.size)?;
                // SAFETY: buffers sized as the callback contract states.
                let rc = unsafe {
                    allgather(
                        user as *mut c_void,
                        out.as_mut_ptr() as *mut c_void,
                        out.len(),
                        local.as_ptr() as *const c_void,
                        n,
                    )
                };
                if rc != 0 {
                    return Err(Error::new(
                        K::Internal,
                        format!(
                            "the allgather callback failed (returned {rc}; if it timed out: a rank did not take the same collective step, most likely because the ranks called with different shapes, types or options, which NVTE_COMM_CHECK=1 reports as a cross-rank mismatch, or a rank is absent or failed)"
                        ),
                    ));
                }
                Ok(out)
            }
            Exchange::Nccl(comm) => self.allgather_nccl(comm, local),
        }
    }

    /// [`Self::allgather`] over the caller's NCCL communicator.
    fn allgather_nccl(&self, comm: &NcclComm, local: &[u8]) -> Result<Vec<u8>> {
        let n = local.len();
        let mut out = gather_buffer(n, self.size)?;
        // Setup only: a private stream and a host synchronisation are fine here.
        let stream = Stream::new(0)?;
        let send = DeviceMem::new(n)?;
        let recv = DeviceMem::new(n * self.size)?;
        send.as_slice::<u8>().copy_from_host(local)?;
        // SAFETY: device buffers of the stated sizes; live communicator.
        nccl_check(
            unsafe {
                nccl::ncclAllGather(
                    send.ptr.as_void(),
                    recv.ptr.as_void(),
                    n,
                    nccl::ncclDataType_t::ncclUint8,
                    comm.raw(),
                    stream.raw().rt(),
                )
            },
            "ncclAllGather",
        )?;
        // Bounded: a rank that never joins must not hang the caller. On timeout
        // the exchange stays enqueued on the caller's communicator (which only
        // its owner may abort): its stream and buffers are leaked on purpose.
        let limit = setup_timeout()?;
        let t0 = std::time::Instant::now();
        while !stream.idle()? {
            if t0.elapsed() > limit {
                std::mem::forget((stream, send, recv));
                return Err(Error::new(
                    K::Timeout,
                    format!(
                        "the setup exchange (ncclAllGather of {n} bytes) over the caller's NCCL communicator did not complete within {:.1} s: a rank of the communicator did not make the same call (it is absent, failed, or calls something else). The communicator now holds the unfinished exchange: abort it (ncclCommAbort)",
                        limit.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        copy_to_host(&mut out, recv.ptr)?;
        Ok(out)
    }

    pub fn barrier(&self) -> Result<()> {
        match self.exchange {
            Exchange::Callbacks { barrier, user, .. } => {
                // SAFETY: the caller's callback with its user data.
                let rc = unsafe { barrier(user as *mut c_void) };
                if rc != 0 {
                    return Err(Error::new(
                        K::Internal,
                        format!("the barrier callback failed (returned {rc})"),
                    ));
                }
                Ok(())
            }
            Exchange::Nccl(_) | Exchange::Owned(_) => self.allgather(&[0u8]).map(|_| ()),
        }
    }
}

/// The most a setup exchange gathers on the host (a larger one means a world size no
/// real world has, e.g. an uninitialised one: refused instead of allocated).
const MAX_GATHER_BYTES: usize = 1 << 30;

/// A zeroed buffer for `n` bytes from each of `size` ranks, or an error (never an
/// allocation failure, which would abort the process).
fn gather_buffer(n: usize, size: usize) -> Result<Vec<u8>> {
    let total = n.checked_mul(size).filter(|&t| t <= MAX_GATHER_BYTES);
    let Some(total) = total else {
        invalid!(
            "a setup exchange of {n} bytes from each of {size} ranks exceeds {MAX_GATHER_BYTES} bytes: world_size = {size} is not the size of a real world"
        );
    };
    let mut out = Vec::new();
    out.try_reserve_exact(total).map_err(|_| {
        Error::new(
            K::OutOfMemory,
            format!("no host memory for a setup exchange of {total} bytes"),
        )
    })?;
    out.resize(total, 0);
    Ok(out)
}

/// Bytes of a rank's record in [`Bootstrap::agree`]: its outcome (0: success, else
/// [`kind_code`]), then its error message, cut to fit; in worlds of more than
/// [`AGREE_QUOTES`] ranks the outcome alone.
const AGREE_BYTES: usize = 256;
const AGREE_QUOTES: usize = 4096;

/// An error kind's code in [`Bootstrap::agree`]'s records (never 0: success).
fn kind_code(k: K) -> u8 {
    match k {
        K::InvalidArgument => 1,
        K::Cuda => 2,
        K::Cublas => 3,
        K::Nccl => 4,
        K::Nvrtc => 5,
        K::Timeout => 6,
        K::Unsupported => 7,
        K::LibraryNotFound => 8,
        K::OutOfMemory => 9,
        K::Internal => 10,
    }
}

/// [`kind_code`] back (a code from another version of the library: Internal).
fn kind_of_code(code: u8) -> K {
    [
        K::InvalidArgument,
        K::Cuda,
        K::Cublas,
        K::Nccl,
        K::Nvrtc,
        K::Timeout,
        K::Unsupported,
        K::LibraryNotFound,
        K::OutOfMemory,
        K::Internal,
    ]
    .into_iter()
    .find(|&k| kind_code(k) == code)
    .unwrap_or(K::Internal)
}

impl Bootstrap {
    /// Every rank's outcome of a step of a collective setup that may fail on some ranks
    /// only (local allocations, compiles, checks of this rank's arguments), exchanged so
    /// that every rank fails together instead of leaving its peers in the next exchange,
    /// where callbacks such as MPI's would wait forever. A failed rank returns its own
    /// error; the others an error of the first failed rank's kind, naming the failed
    /// ranks and quoting that rank's message (`what`: the step, for the message). The
    /// ranks stay in step: a later collective call on them works.
    pub fn agree<T>(&self, local: Result<T>, what: &str) -> Result<T> {
        if self.size <= 1 {
            return local;
        }
        let rec_bytes = if self.size <= AGREE_QUOTES {
            AGREE_BYTES
        } else {
            1
        };
        let mut mine = [0u8; AGREE_BYTES];
        if let Err(e) = &local {
            mine[0] = kind_code(e.kind);
            let m = e.msg.as_bytes();
            let n = m.len().min(rec_bytes - 1);
            mine[1..1 + n].copy_from_slice(&m[..n]);
        }
        let all = self.allgather(&mine[..rec_bytes]);
        let (v, all) = match (local, all) {
            (Err(e), _) => return Err(e),
            (Ok(_), Err(e)) => return Err(e),
            (Ok(v), Ok(all)) => (v, all),
        };
        let failed: Vec<usize> = (0..self.size)
            .filter(|&w| all[w * rec_bytes] != 0)
            .collect();
        let Some(&first) = failed.first() else {
            return Ok(v);
        };
        let rec = &all[first * rec_bytes..(first + 1) * rec_bytes];
        let kind = kind_of_code(rec[0]);
        let end = rec[1..]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(rec_bytes - 1);
        let ranks = match failed.len() {
            n if n <= 8 => format!("{failed:?}"),
            n => format!("{:?} and {} more", &failed[..8], n - 8),
        };
        Err(Error::new(
            kind,
            format!(
                "world rank(s) {ranks} could not {what}, so no rank of the world does (world rank {first}: {})",
                String::from_utf8_lossy(&rec[1..1 + end])
            ),
        ))
    }
}

/// How long a setup exchange over an NCCL communicator may take: the engine's wait
/// timeout (NVTE_COMM_TIMEOUT_MS).
fn setup_timeout() -> Result<std::time::Duration> {
    Ok(std::time::Duration::from_millis(
        crate::env::timeout_ms()? as u64
    ))
}

/// This host's identity (host name and boot id): ranks that share it can use CUDA IPC.
pub fn host_identity() -> [u8; 128] {
    let mut id = [0u8; 128];
    let mut name = [0u8; 64];
    // SAFETY: buffer of the given length.
    unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len() - 1) };
    id[..64].copy_from_slice(&name);
    let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let k = boot.len().min(64);
    id[64..64 + k].copy_from_slice(&boot[..k]);
    id
}

pub fn host_name(id: &[u8]) -> String {
    let end = id[..64].iter().position(|&b| b == 0).unwrap_or(64);
    String::from_utf8_lossy(&id[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier, Mutex};

    /// The ranks of a world as threads, gathering through one shared table.
    struct World {
        table: Mutex<Vec<u8>>,
        barrier: Barrier,
    }

    struct RankOf {
        world: Arc<World>,
        rank: usize,
    }

    unsafe extern "C" fn gather(
        user: *mut c_void,
        global: *mut c_void,
        global_bytes: usize,
        local: *const c_void,
        local_bytes: usize,
    ) -> i32 {
        // SAFETY: `user` is a live RankOf; the buffers have the stated sizes.
        let r = unsafe { &*(user as *const RankOf) };
        let local = unsafe { std::slice::from_raw_parts(local as *const u8, local_bytes) };
        {
            let mut t = r.world.table.lock().unwrap();
            t.resize(global_bytes, 0);
            t[r.rank * local_bytes..(r.rank + 1) * local_bytes].copy_from_slice(local);
        }
        r.world.barrier.wait();
        let t = r.world.table.lock().unwrap().clone();
        // SAFETY: `global` holds global_bytes.
        unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), global as *mut u8, global_bytes) };
        r.world.barrier.wait();
        0
    }

    unsafe extern "C" fn no_barrier(_user: *mut c_void) -> i32 {
        0
    }

    /// Each of `n` threads agrees on `outcome(rank)`, then agrees once more on success;
    /// their results in rank order.
    fn run(n: usize, outcome: fn(usize) -> Result<usize>) -> Vec<(Result<usize>, Result<usize>)> {
        let world = Arc::new(World {
            table: Mutex::new(Vec::new()),
            barrier: Barrier::new(n),
        });
        let threads: Vec<_> = (0..n)
            .map(|rank| {
                let world = world.clone();
                std::thread::spawn(move || {
                    let me = RankOf { world, rank };
                    let bs = Bootstrap {
                        rank,
                        size: n,
                        exchange: Exchange::Callbacks {
                            allgather: gather,
                            barrier: no_barrier,
                            user: &me as *const RankOf as usize,
                        },
                    };
                    let first = bs.agree(outcome(rank), "make the thing");
                    let again = bs.agree(Ok(rank), "make it again");
                    (first, again)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_fails_together_and_stays_in_step() {
        let out = run(3, |rank| match rank {
            1 => Err(Error::new(K::OutOfMemory, "cuMemAlloc of 1 GiB failed")),
            _ => Ok(rank),
        });
        for (rank, (first, again)) in out.into_iter().enumerate() {
            let e = first.unwrap_err();
            assert_eq!(e.kind, K::OutOfMemory, "rank {rank}");
            if rank == 1 {
                assert_eq!(e.msg, "cuMemAlloc of 1 GiB failed");
            } else {
                assert!(
                    e.msg.contains("world rank(s) [1] could not make the thing")
                        && e.msg.contains("cuMemAlloc of 1 GiB failed"),
                    "{}",
                    e.msg
                );
            }
            assert_eq!(again.unwrap(), rank, "the ranks stay in step");
        }
    }

    #[test]
    fn every_kind_goes_through_its_code() {
        for k in [
            K::InvalidArgument,
            K::Timeout,
            K::OutOfMemory,
            K::Internal,
            K::Nccl,
        ] {
            assert_eq!(kind_of_code(kind_code(k)), k);
        }
        assert_eq!(kind_of_code(200), K::Internal);
    }

    #[test]
    fn success_everywhere_passes_each_ranks_value_through() {
        for (rank, (first, _)) in run(4, Ok).into_iter().enumerate() {
            assert_eq!(first.unwrap(), rank);
        }
        let out = run(2, |rank| {
            Err(Error::invalid(format!("bad {rank}: {}", "x".repeat(400))))
        });
        for (rank, (first, _)) in out.into_iter().enumerate() {
            let e = first.unwrap_err();
            assert_eq!(e.kind, K::InvalidArgument);
            assert!(
                e.msg.starts_with(&format!("bad {rank}")),
                "a failed rank keeps its own error"
            );
        }
    }
}
