//! The NCCL transport: works for any placement of the group's ranks (across nodes too).
//! Exchange steps are grouped ncclSend / ncclRecv on the comm stream; algorithms that
//! need loads from peers' buffers use NCCL collectives instead (see `crate::overlap`).
//! The group gets its own communicator, split from the bootstrap's (or created through
//! the bootstrap's allgather), so the caller's communicator is never used concurrently.
//! NCCL calls cannot time out: a peer that never arrives blocks them (NCCL's own
//! watchdogs apply); the IPC transport is the one with timed waits.
use super::{Group, RecvOp, SendOp, Slot, Timeout, Transport, WaitInfo};
use crate::bootstrap::{Bootstrap, Exchange};
use crate::cuda::dynlib::nccl_sys as nc;
use crate::cuda::resources::DeviceMem;
use crate::cuda::{self, Lib};
use crate::error::{Error, Result};
use crate::ffi::enums::NVTECommStatus as S;
use crate::tensor::DType;
use crate::unsupported;
use std::ffi::c_void;

pub fn check(r: nc::ncclResult_t, call: &str) -> Result<()> {
    if r == nc::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: static string from NCCL.
    let s = unsafe { std::ffi::CStr::from_ptr(nc::ncclGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::new(
        S::NVTE_COMM_ERROR_NCCL,
        format!("{call} failed: {s}"),
    ))
}

/// NCCL's element type for a reduction of `d`.
pub fn nccl_type(d: DType) -> Result<nc::ncclDataType_t> {
    Ok(match d {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::F16 => nc::ncclDataType_t::ncclFloat16,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        other => unsupported!("NCCL cannot reduce {} data", other.name()),
    })
}

pub struct NcclTransport {
    comm: usize,
    group: Group,
}

// SAFETY: an owned communicator and device memory, used from one thread at a time.
unsafe impl Send for NcclTransport {}

impl NcclTransport {
    /// Collective over the world (all ranks, same `tp`): a communicator per group.
    pub fn create(bs: &Bootstrap, group: &[usize], buffer_bytes: usize) -> Result<NcclTransport> {
        cuda::require(Lib::Nccl)?;
        let tp_rank = group
            .iter()
            .position(|&w| w == bs.rank)
            .expect("group contains this rank");
        let color = (group[0] / group.len()) as i32;
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        match bs.exchange {
            Exchange::Nccl(parent) => {
                // SAFETY: live parent communicator; every rank calls with its group's color.
                check(
                    unsafe {
                        nc::ncclCommSplit(
                            parent as nc::ncclComm_t,
                            color,
                            bs.rank as i32,
                            &mut comm,
                            std::ptr::null_mut(),
                        )
                    },
                    "ncclCommSplit",
                )?;
            }
            Exchange::Callbacks { .. } => {
                // SAFETY: zeroed POD id; filled by NCCL on the group leader.
                let mut id: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
                if tp_rank == 0 {
                    check(unsafe { nc::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
                }
                let mine: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                let all = bs.allgather(&mine)?;
                let leader = &all[group[0] * 128..group[0] * 128 + 128];
                for (c, b) in id.internal.iter_mut().zip(leader) {
                    *c = *b as std::ffi::c_char;
                }
                // SAFETY: the leader's id; every member joins with its group rank.
                check(
                    unsafe {
                        nc::ncclCommInitRank(&mut comm, group.len() as i32, id, tp_rank as i32)
                    },
                    "ncclCommInitRank",
                )?;
            }
        }
        let buffer = DeviceMem::new(buffer_bytes)?;
        buffer.zero()?;
        Ok(NcclTransport {
            comm: comm as usize,
            group: Group::new(bs.rank, group, buffer),
        })
    }

    fn c(&self) -> nc::ncclComm_t {
        self.comm as nc::ncclComm_t
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // SAFETY: created in `create`, destroyed once.
        unsafe { nc::ncclCommDestroy(self.c()) };
    }
}

impl Transport for NcclTransport {
    fn group(&self) -> &Group {
        &self.group
    }
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn peer_buffer(&self, peer: usize) -> Option<usize> {
        if peer == self.group.tp_rank {
            Some(self.group.buffer.ptr)
        } else {
            None
        }
    }
    fn exchange(
        &self,
        sends: &[SendOp],
        recvs: &[RecvOp],
        _slot: Slot,
        _value: u64,
        stream: usize,
        _info: WaitInfo,
    ) -> Result<()> {
        let u8t = nc::ncclDataType_t::ncclUint8;
        let st = stream as nc::cudaStream_t;
        // SAFETY: grouped point-to-point calls on device ranges validated by the algorithm.
        check(unsafe { nc::ncclGroupStart() }, "ncclGroupStart")?;
        let mut r = Ok(());
        for s in sends {
            r = r.and(check(
                unsafe {
                    nc::ncclSend(
                        s.src as *const c_void,
                        s.bytes,
                        u8t,
                        s.peer as i32,
                        self.c(),
                        st,
                    )
                },
                "ncclSend",
            ));
        }
        for v in recvs {
            let dst = (self.group.buffer.ptr + v.dst_offset) as *mut c_void;
            r = r.and(check(
                unsafe { nc::ncclRecv(dst, v.bytes, u8t, v.peer as i32, self.c(), st) },
                "ncclRecv",
            ));
        }
        check(unsafe { nc::ncclGroupEnd() }, "ncclGroupEnd")?;
        r
    }
    fn begin_call(&self, _seq: u64, _stream: usize, _info: WaitInfo) -> Result<()> {
        Ok(())
    }
    fn end_call(&self, _seq: u64, _stream: usize) -> Result<()> {
        Ok(())
    }
    fn wait_done(&self, _seq: u64, _stream: usize, _info: WaitInfo) -> Result<()> {
        Ok(())
    }
    fn nccl_comm(&self) -> Option<usize> {
        Some(self.comm)
    }
    fn put(
        &self,
        _peer: usize,
        _offset: usize,
        _src: usize,
        _bytes: usize,
        _stream: usize,
    ) -> Result<()> {
        unsupported!("one-sided puts are not available with the NCCL transport")
    }
    fn signal(&self, _peers: &[usize], _slot: Slot, _value: u64, _stream: usize) -> Result<()> {
        unsupported!("flags are not available with the NCCL transport")
    }
    fn wait(
        &self,
        _peers: &[usize],
        _slot: Slot,
        _value: u64,
        _stream: usize,
        _info: WaitInfo,
    ) -> Result<()> {
        unsupported!("flags are not available with the NCCL transport")
    }
    fn timeout(&self) -> Option<Timeout> {
        None
    }
    fn comm_sms(&self) -> u32 {
        0
    }
}

/// NCCL collectives on the group communicator, on `stream`.
pub fn all_reduce(
    comm: usize,
    src: usize,
    dst: usize,
    count: usize,
    d: DType,
    stream: usize,
) -> Result<()> {
    let t = nccl_type(d)?;
    // SAFETY: device ranges of `count` elements validated by the caller.
    check(
        unsafe {
            nc::ncclAllReduce(
                src as *const c_void,
                dst as *mut c_void,
                count,
                t,
                nc::ncclRedOp_t::ncclSum,
                comm as nc::ncclComm_t,
                stream as nc::cudaStream_t,
            )
        },
        "ncclAllReduce",
    )
}

pub fn reduce_scatter(
    comm: usize,
    src: usize,
    dst: usize,
    recv_count: usize,
    d: DType,
    stream: usize,
) -> Result<()> {
    let t = nccl_type(d)?;
    // SAFETY: as above; src holds tp * recv_count elements.
    check(
        unsafe {
            nc::ncclReduceScatter(
                src as *const c_void,
                dst as *mut c_void,
                recv_count,
                t,
                nc::ncclRedOp_t::ncclSum,
                comm as nc::ncclComm_t,
                stream as nc::cudaStream_t,
            )
        },
        "ncclReduceScatter",
    )
}

pub fn all_gather_bytes(
    comm: usize,
    src: usize,
    dst: usize,
    bytes: usize,
    stream: usize,
) -> Result<()> {
    // SAFETY: dst holds tp * bytes.
    check(
        unsafe {
            nc::ncclAllGather(
                src as *const c_void,
                dst as *mut c_void,
                bytes,
                nc::ncclDataType_t::ncclUint8,
                comm as nc::ncclComm_t,
                stream as nc::cudaStream_t,
            )
        },
        "ncclAllGather",
    )
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
pub fn comm_init_rank(id: &[u8; 128], nranks: i32, rank: i32) -> Result<usize> {
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
    Ok(comm as usize)
}

/// ncclCommDestroy of a communicator created by [`comm_init_rank`].
pub fn comm_destroy(comm: usize) -> Result<()> {
    if comm == 0 {
        crate::invalid!("argument `comm` is NULL");
    }
    cuda::require(Lib::Nccl)?;
    // SAFETY: the caller passes a live communicator it owns.
    check(
        unsafe { nc::ncclCommDestroy(comm as nc::ncclComm_t) },
        "ncclCommDestroy",
    )
}
