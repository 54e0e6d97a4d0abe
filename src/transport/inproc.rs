//! In-process peers: ranks of a group that live in the same process (one process driving
//! several GPUs, one thread per device, as JAX's single-process multi-GPU mode does).
//! CUDA IPC handles cannot be opened in the process that exported them, and need not be:
//! a peer's buffer and flags are reached through its device pointers, with peer access
//! enabled between the two devices' contexts. The peer-memory transport (`ipc.rs`) uses
//! this for every peer whose process identity equals its own, and CUDA IPC for the others;
//! everything else (flags, signals, timed waits, puts) is the same code.
use crate::cuda::resources::IpcMapping;
use crate::cuda::{CtxHandle, DevPtr};
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys as cu;

/// How a peer's memory is reached.
pub enum PeerMem {
    /// mapped from the peer's CUDA IPC handle (another process)
    Ipc(IpcMapping),
    /// the peer's own device pointer (a peer in this process)
    InProcess(DevPtr),
}

impl PeerMem {
    pub fn ptr(&self) -> DevPtr {
        match self {
            PeerMem::Ipc(m) => m.ptr,
            PeerMem::InProcess(p) => *p,
        }
    }
}

/// What a rank publishes about itself for in-process peers: its process (pid and a
/// random per-process nonce, so a pid reused in another container never matches), its
/// CUDA context and device, and the device addresses of its buffer and flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub pid: u32,
    pub nonce: u64,
    pub ctx: CtxHandle,
    pub device: i32,
    pub buffer: DevPtr,
    pub flags: DevPtr,
}

/// Bytes of [`Local::to_bytes`].
pub const LOCAL_BYTES: usize = 40;

impl Local {
    pub fn new(ctx: CtxHandle, device: i32, buffer: DevPtr, flags: DevPtr) -> Local {
        Local {
            pid: std::process::id(),
            nonce: process_nonce(),
            ctx,
            device,
            buffer,
            flags,
        }
    }
    pub fn to_bytes(self) -> [u8; LOCAL_BYTES] {
        let mut b = [0u8; LOCAL_BYTES];
        b[0..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.device.to_le_bytes());
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..24].copy_from_slice(&(self.ctx.addr() as u64).to_le_bytes());
        b[24..32].copy_from_slice(&self.buffer.raw().to_le_bytes());
        b[32..40].copy_from_slice(&self.flags.raw().to_le_bytes());
        b
    }
    pub fn from_bytes(b: &[u8]) -> Local {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Local {
            pid: u32::from_le_bytes(b[0..4].try_into().unwrap()),
            device: i32::from_le_bytes(b[4..8].try_into().unwrap()),
            nonce: u64_at(8),
            // Used only once `same_process` holds: a context of this process.
            ctx: CtxHandle::from_addr(u64_at(16) as usize),
            buffer: DevPtr::new(u64_at(24)),
            flags: DevPtr::new(u64_at(32)),
        }
    }
    /// Whether `other` lives in this process.
    pub fn same_process(&self, other: &Local) -> bool {
        self.pid == other.pid && self.nonce == other.nonce
    }
}

/// A random value fixed for the life of the process.
fn process_nonce() -> u64 {
    static N: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let mut k = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `k`.
        let n = unsafe { libc::getrandom(k.as_mut_ptr().cast(), k.len(), 0) };
        let v = u64::from_ne_bytes(k);
        if n == 8 {
            v
        } else {
            (std::process::id() as u64) << 32 ^ 0x9e37_79b9_7f4a_7c15
        }
    })
}

/// Make `peer`'s memory reachable from `me`'s context (current on this thread): nothing
/// on the same device, else peer access from this context to the peer's.
pub fn enable_access(me: &Local, peer: &Local) -> Result<()> {
    if me.device == peer.device {
        if me.ctx != peer.ctx {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "a peer in this process uses another CUDA context ({:#x}) on the same device {} as this rank ({:#x}): in-process peers on one device must share its context",
                    peer.ctx, me.device, me.ctx
                ),
            ));
        }
        return Ok(());
    }
    let mut can = 0;
    // SAFETY: out pointer; device ordinals of this process's devices.
    let r = unsafe { cu::cuDeviceCanAccessPeer(&mut can, me.device, peer.device) };
    if r != cu::CUresult::CUDA_SUCCESS || can == 0 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "device {} cannot access device {} directly (no peer access between them): in-process peers need it",
                me.device, peer.device
            ),
        ));
    }
    // SAFETY: the peer's context is alive in this process (the peer is creating the same
    // object now); enabling access twice is reported and accepted below.
    let r = unsafe { cu::cuCtxEnablePeerAccess(peer.ctx.raw(), 0) };
    match r {
        cu::CUresult::CUDA_SUCCESS | cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(Error::new(
            ErrorKind::Cuda,
            format!(
                "cuCtxEnablePeerAccess from device {} to device {} failed: {e:?}",
                me.device, peer.device
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_record_round_trips_and_names_this_process() {
        let a = Local::new(
            CtxHandle::from_addr(0x1234),
            3,
            DevPtr::new(0xdead_0000),
            DevPtr::new(0xbeef_0000),
        );
        let b = Local::from_bytes(&a.to_bytes());
        assert_eq!(a, b);
        assert!(a.same_process(&b));
        let other = Local {
            nonce: a.nonce ^ 1,
            ..a
        };
        assert!(!a.same_process(&other));
    }
}
