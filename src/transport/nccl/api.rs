//! The thin typed layer over NCCL's C API that the NCCL transport ([`super`]) and the
//! library's own exchange channel ([`super::channel`]) share: result names and checks
//! of non-blocking calls, the bounded wait for a non-blocking communicator, its config,
//! its creation from a unique id exchanged through the bootstrap, and the unique id /
//! init / destroy behind the C ABI's `nvte_comm_nccl_*` functions. Every call goes
//! through the bound NCCL ([`crate::cuda::dynlib::nccl_sys`]).
use crate::bootstrap::Bootstrap;
use crate::cuda::dynlib::nccl_sys as nc;
use crate::cuda::{self, Lib, NcclComm, nccl_check as check};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
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
pub fn async_state(comm: NcclComm) -> Result<u32> {
    let mut st = 0u32;
    // SAFETY: live communicator; out pointer (a u32: NCCL may return codes newer than
    // the bindings' enum).
    check(
        unsafe { nc::ncclCommGetAsyncError(comm.raw(), &mut st) },
        "ncclCommGetAsyncError",
    )?;
    Ok(st)
}

/// Poll a non-blocking communicator until its pending operation is done, for at most
/// `limit`. Err(TIMEOUT) when it is still in progress then (the caller aborts the
/// communicator), Err(NCCL) on an NCCL error.
pub fn wait_ready(comm: NcclComm, limit: Duration, what: &str) -> Result<()> {
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

/// A non-blocking communicator of `nranks` ranks, this one joining as `rank`, made from
/// the unique id of world rank `leader`, which goes through `bs` (collective over `bs`'s
/// world: every rank contributes, the others' ids are ignored); ready, waited for at
/// most `timeout` (on failure it is aborted). `what` names it in errors.
pub fn init_nonblocking(
    bs: &Bootstrap,
    leader: usize,
    (nranks, rank): (usize, usize),
    config: &mut nc::ncclConfig_t,
    timeout: Duration,
    what: &str,
) -> Result<NcclComm> {
    // SAFETY: zeroed POD id; filled by NCCL on the leader.
    let mut id: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
    let made = if bs.rank == leader {
        // SAFETY: out pointer.
        check(unsafe { nc::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")
    } else {
        Ok(())
    };
    // (a leader that cannot make the id says so, instead of leaving the others waiting
    // for it in the exchange below)
    bs.agree(made, &format!("make the unique id of {what}"))?;
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
    let raw = NcclComm::from_raw(comm);
    if raw.is_null() {
        return Err(Error::new(
            K::Nccl,
            format!("creating {what} returned no communicator"),
        ));
    }
    if pending && let Err(e) = wait_ready(raw, timeout, &format!("creating {what}")) {
        // SAFETY: the communicator created above, used nowhere else yet.
        unsafe { nc::ncclCommAbort(raw.raw()) };
        return Err(e);
    }
    Ok(raw)
}

/// A new NCCL unique id (128 bytes) from the bound NCCL: the seed of a communicator that
/// a framework creates for this library (the id is then broadcast by the framework).
pub fn unique_id() -> Result<[u8; 128]> {
    cuda::require(Lib::Nccl)?;
    // SAFETY: zeroed POD id, filled by NCCL.
    let mut id: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
    check(unsafe { nc::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    let mut out = [0u8; 128];
    for (o, c) in out.iter_mut().zip(id.internal.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

/// ncclCommInitRank through the bound NCCL on the calling thread's current device
/// (collective over the `nranks` callers of the same id).
pub fn comm_init_rank(id: &[u8; 128], nranks: i32, rank: i32) -> Result<NcclComm> {
    if nranks <= 0 || rank < 0 || rank >= nranks {
        crate::invalid!(
            "`nranks` = {nranks} and `rank` = {rank} are inconsistent (need 0 <= rank < nranks)"
        );
    }
    cuda::require(Lib::Nccl)?;
    // NCCL needs a device: without one (or without a driver) fail here, cleanly.
    cuda::init_driver()?;
    // SAFETY: zeroed POD id, then filled from the caller's bytes.
    let mut uid: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
    for (c, b) in uid.internal.iter_mut().zip(id.iter()) {
        *c = *b as std::ffi::c_char;
    }
    let mut comm: nc::ncclComm_t = std::ptr::null_mut();
    // SAFETY: out pointer; the id came from ncclGetUniqueId on one of the ranks.
    check(
        unsafe { nc::ncclCommInitRank(&mut comm, nranks, uid, rank) },
        "ncclCommInitRank",
    )?;
    Ok(NcclComm::from_raw(comm))
}

/// ncclCommDestroy of a communicator created by [`comm_init_rank`].
pub fn comm_destroy(comm: NcclComm) -> Result<()> {
    if comm.is_null() {
        crate::invalid!("argument `comm` is NULL");
    }
    cuda::require(Lib::Nccl)?;
    // SAFETY: the caller passes a live communicator it owns.
    check(
        unsafe { nc::ncclCommDestroy(comm.raw()) },
        "ncclCommDestroy",
    )
}
