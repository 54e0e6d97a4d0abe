//! A host fake transport (tests only): the capabilities in host memory terms, recording
//! every call into a log shared by the group's ranks, for the protocol tests
//! (`crate::overlap::protocol`) to replay across ranks. Device addresses are plain
//! numbers there; nothing touches a GPU.
//!
//! Two flavours, so that every algorithm variant is planned and checked:
//! - [`Flavour::PeerMemory`]: peer memory (puts, flags, peer pointers) and two-sided
//!   exchange by puts and flags, as the IPC transport;
//! - [`Flavour::Messages`]: two-sided exchange by matched sends and receives, and
//!   collectives, as the NCCL transport.
use super::{
    Collectives, Constructor, ExchangePart, FlagSlot, Group, PeerMemory, RecvOp, SendOp, Timeout,
    Transport, TwoSided, WaitInfo,
};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::cuda::resources::DeviceMem;
use crate::error::Result;
use crate::tensor::DType;
use std::sync::{Arc, Mutex};

/// What a fake transport can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    PeerMemory,
    Messages,
}

/// A collective's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// One recorded transport call of a rank, on a stream.
#[derive(Clone, Debug)]
pub enum Call {
    /// the call's arrival barrier (every rank of the group)
    Arrive,
    /// the call's end
    End,
    /// wait until every peer finished its last call (nothing to wait for in a log of one
    /// call per rank)
    WaitDone,
    Put {
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
    },
    /// a strided put (an exchange's column slice): `rows` runs of `width` bytes, `pitch`
    /// apart at both ends
    Put2d {
        peer: usize,
        offset: usize,
        src: DevPtr,
        width: usize,
        rows: usize,
        pitch: usize,
    },
    Signal {
        peers: Vec<usize>,
        slot: FlagSlot,
        tag: u64,
    },
    Wait {
        peers: Vec<usize>,
        slot: FlagSlot,
        tag: u64,
    },
    /// grouped sends and receives (the messages flavour's exchange step)
    SendRecv {
        sends: Vec<(usize, DevPtr, usize)>,
        recvs: Vec<(usize, usize, usize)>,
    },
    Collective {
        kind: Coll,
        src: DevPtr,
        dst: DevPtr,
        /// elements (reductions) or bytes (all-gather)
        count: usize,
        dtype: DType,
    },
}

/// What the log holds per rank: transport calls and the engine's device work (the
/// protocol tests' device records those), in issue order.
#[derive(Clone, Debug)]
pub enum Rec<D> {
    Transport(Call),
    Device(D),
}

/// The group's shared log: per rank, (stream, record) in issue order.
pub struct Log<D> {
    pub ranks: Vec<Vec<(usize, Rec<D>)>>,
}

pub type SharedLog<D> = Arc<Mutex<Log<D>>>;

/// Rank `rank`'s fake transport of a group of `tp`; buffers at `buffers[q]` (fake
/// device addresses) of `bytes` each.
pub struct FakeTransport<D: Send + 'static> {
    group: Group,
    flavour: Flavour,
    buffers: Vec<DevPtr>,
    log: SharedLog<D>,
    /// the call number flag values carry (value = (call << 16) + tag, as the IPC
    /// transport's): a log of several calls per rank sets it per call
    call: u64,
}

impl<D: Send + 'static> FakeTransport<D> {
    /// The same transport for call number `call` of its rank (its flag values).
    pub fn for_call(mut self, call: u64) -> FakeTransport<D> {
        self.call = call;
        self
    }
    pub fn new(
        rank: usize,
        buffers: &[DevPtr],
        bytes: usize,
        flavour: Flavour,
        log: SharedLog<D>,
    ) -> FakeTransport<D> {
        let members: Vec<usize> = (0..buffers.len()).collect();
        let buffer = DeviceMem {
            ptr: buffers[rank],
            bytes,
            owner: None,
        };
        FakeTransport {
            group: Group::new(rank, &members, buffer),
            flavour,
            buffers: buffers.to_vec(),
            log,
            call: 0,
        }
    }
    fn record(&self, stream: StreamHandle, c: Call) -> Result<()> {
        let mut l = self.log.lock().unwrap_or_else(|e| e.into_inner());
        l.ranks[self.group.tp_rank].push((stream.raw(), Rec::Transport(c)));
        Ok(())
    }
}

impl<D: Send + 'static> Drop for FakeTransport<D> {
    fn drop(&mut self) {
        self.group.buffer.leak(); // a fake address: nothing to free
    }
}

/// The registry's entry. Never picked by auto; `create` makes a one-rank fake (a group of
/// several ranks shares one log: the protocol tests make them with
/// [`FakeTransport::new`]).
pub const ENTRY: Constructor = Constructor {
    auto: |_| false,
    create: |s| {
        if s.group.len() != 1 {
            crate::unsupported!("the fake transport made through the registry has one rank");
        }
        let log: SharedLog<()> = Arc::new(Mutex::new(Log {
            ranks: vec![Vec::new()],
        }));
        Ok(Box::new(FakeTransport::new(
            0,
            &[DevPtr::new(1 << 40)],
            s.settings.buffer_bytes,
            Flavour::PeerMemory,
            log,
        )))
    },
};

impl<D: Send + 'static> Transport for FakeTransport<D> {
    fn group(&self) -> &Group {
        &self.group
    }
    fn name(&self) -> &'static str {
        "fake"
    }
    fn begin_call(
        &self,
        _calls: u64,
        stream: StreamHandle,
        _info: WaitInfo,
        _desc: u64,
    ) -> Result<()> {
        if self.idle_alone() && self.size() == 1 {
            return Ok(());
        }
        self.record(stream, Call::Arrive)
    }
    fn end_call(&self, _calls: u64, stream: StreamHandle) -> Result<()> {
        self.record(stream, Call::End)
    }
    fn wait_done(&self, _calls: u64, stream: StreamHandle, _info: WaitInfo) -> Result<()> {
        self.record(stream, Call::WaitDone)
    }
    fn idle_alone(&self) -> bool {
        self.flavour == Flavour::PeerMemory
    }
    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        (self.flavour == Flavour::PeerMemory).then_some(self as &dyn PeerMemory)
    }
    fn two_sided(&self) -> Option<&dyn TwoSided> {
        Some(self)
    }
    fn collectives(&self) -> Option<&dyn Collectives> {
        (self.flavour == Flavour::Messages).then_some(self as &dyn Collectives)
    }
    fn timeout(&self) -> Option<Timeout> {
        None
    }
    fn comm_sms(&self) -> u32 {
        0
    }
}

impl<D: Send + 'static> PeerMemory for FakeTransport<D> {
    fn peer_buffer(&self, peer: usize) -> DevPtr {
        self.buffers[peer]
    }
    fn put(
        &self,
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.record(
            stream,
            Call::Put {
                peer,
                offset,
                src,
                bytes,
            },
        )
    }
    fn signal(
        &self,
        peers: &[usize],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let peers = peers.to_vec();
        let tag = (self.call << 16) + tag;
        self.record(stream, Call::Signal { peers, slot, tag })
    }
    fn wait(
        &self,
        peers: &[usize],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        _info: WaitInfo,
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let peers = peers.to_vec();
        let tag = (self.call << 16) + tag;
        self.record(stream, Call::Wait { peers, slot, tag })
    }
}

impl<D: Send + 'static> FakeTransport<D> {
    /// The messages flavour's exchange step: one grouped send / receive.
    fn send_recv(&self, sends: &[SendOp], recvs: &[RecvOp], stream: StreamHandle) -> Result<()> {
        if sends.iter().any(|s| s.rows > 1) || recvs.iter().any(|r| r.rows > 1) {
            return Err(crate::error::Error::unsupported(
                "fake transport (messages): strided exchange",
            ));
        }
        let sends = sends.iter().map(|s| (s.peer, s.src, s.bytes)).collect();
        let recvs = recvs
            .iter()
            .map(|r| (r.peer, r.dst_offset, r.bytes))
            .collect();
        self.record(stream, Call::SendRecv { sends, recvs })
    }
}

impl<D: Send + 'static> TwoSided for FakeTransport<D> {
    /// As the IPC transport (peer memory: the puts, then a signal per destination and a
    /// wait for the sources); messages: the grouped sends and receives at the start.
    fn exchange(
        &self,
        part: ExchangePart,
        sends: &[SendOp],
        recvs: &[RecvOp],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        info: WaitInfo,
    ) -> Result<()> {
        if self.flavour != Flavour::PeerMemory {
            return match part {
                ExchangePart::Finish => Ok(()),
                _ => self.send_recv(sends, recvs, stream),
            };
        }
        if part != ExchangePart::Finish {
            for s in sends {
                if s.rows > 1 {
                    self.record(
                        stream,
                        Call::Put2d {
                            peer: s.peer,
                            offset: s.dst_offset,
                            src: s.src,
                            width: s.bytes,
                            rows: s.rows,
                            pitch: s.pitch,
                        },
                    )?;
                } else {
                    self.put(s.peer, s.dst_offset, s.src, s.bytes, stream)?;
                }
            }
        }
        if part == ExchangePart::Start {
            return Ok(());
        }
        let dsts: Vec<usize> = sends.iter().map(|s| s.peer).collect();
        self.signal(&dsts, slot, tag, stream)?;
        let srcs: Vec<usize> = recvs.iter().map(|r| r.peer).collect();
        self.wait(&srcs, slot, tag, stream, info)
    }
    fn concurrent_streams(&self) -> bool {
        self.flavour == Flavour::PeerMemory
    }
    fn strided(&self) -> bool {
        self.flavour == Flavour::PeerMemory
    }
}

impl<D: Send + 'static> Collectives for FakeTransport<D> {
    fn all_reduce(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        let c = Call::Collective {
            kind: Coll::AllReduce,
            src,
            dst,
            count,
            dtype,
        };
        self.record(stream, c)
    }
    fn reduce_scatter(
        &self,
        src: DevPtr,
        dst: DevPtr,
        recv_count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        let c = Call::Collective {
            kind: Coll::ReduceScatter,
            src,
            dst,
            count: recv_count,
            dtype,
        };
        self.record(stream, c)
    }
    fn all_gather_bytes(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let c = Call::Collective {
            kind: Coll::AllGather,
            src,
            dst,
            count: bytes,
            dtype: DType::Byte,
        };
        self.record(stream, c)
    }
}
