//! Host protocol tests of every algorithm (tests only): each rank of a group of tp 1..8
//! plans its call exactly as the engine does (`plan::Planner`), the plan is enqueued
//! through `plan::enqueue` into a recording device and the fake transport
//! (`crate::transport::fake`), and the ranks' logs are then run together on the host:
//! a scheduler runs each stream in order, a step only when what it waits for (events,
//! flags, the matching receive, every rank's collective or barrier) has happened; the
//! GEMMs, copies, reductions and collectives compute on f32 data in host memory. Checked:
//! - no deadlock (every rank runs to its end), hence every wait has its signal, and every
//!   signal is waited for;
//! - every access lies inside one allocation (the buffers, staging, the operands), and
//!   reads only bytes that were written (or are inputs), by a step that happens before
//!   the read (vector clocks over the streams and ranks: a race is an error even where
//!   this schedule happened to run the writer first); two writes of a byte are ordered,
//!   and a write comes after every read of the value it replaces (the source of a
//!   transfer or a collective counted as read by the sending rank's own step);
//! - every byte of the outputs is written exactly once, with the exact sums (small
//!   integers: f32 sums are exact).
use super::algo;
use super::ar::ArArgs;
use super::bulk::{BulkArgs, BulkKind};
use super::plan::{self, AlgoSlots, Device, Env, Lane, Plan, Planner, Reduce, Scratch};
use super::policy::{
    Algo, Direction, OVERLAP_OFF, OVERLAP_ON, Pins, Policy, Reduction, Sum, Tiles,
};
use super::rs::RsArgs;
use super::{Op, ag::AgArgs};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::Result;
use crate::gemm::sm90::Hooks;
use crate::gemm::{Epilogue, GemmDesc, TeGemm};
use crate::tensor::{Buffer, DType, Shape, Tensor};
use crate::transport::fake::{Call, Coll, FakeTransport, Flavour, Log, Rec, SharedLog};
use crate::transport::{Caps, FlagSlot, Transport};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// A device step as the recording device logs it.
#[derive(Clone, Debug)]
pub(crate) enum Dev {
    Gemm(GemmDesc),
    Copy(DevPtr, DevPtr, usize),
    Copy2d {
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
    },
    Memset(DevPtr, usize),
    Reduce(Reduce),
    Segments(Vec<(DevPtr, DevPtr, usize)>),
    AmaxMax,
    /// a call's start: its operation and the key every rank's must equal (the
    /// NVTE_COMM_CHECK descriptor is made of it)
    Begin(u32, Vec<u64>),
    Record(usize),
    WaitEvent(usize),
    /// a flag written (cuStreamWriteValue32) / waited for (cuStreamWaitValue32 GEQ)
    WriteFlag(DevPtr, u32),
    WaitFlag(DevPtr, u32),
    /// our own GEMM: runs once every flag of its rows has reached the value
    Fused(GemmDesc, Hooks),
}

type L = Log<Dev>;

// Streams of the recording device, and the engine's own events (fork / join).
pub(crate) const CALLER: usize = 0;
const COMPUTE: usize = 100;
const COMM: usize = 200;
const EV_START: usize = 10_000;
const EV_ARRIVED: usize = 10_001;
const EV_END: usize = 10_002;
const EV_JOIN: usize = 10_100;

/// The recording device of one rank: mirrors the engine's fork / join of its streams
/// (`Overlap::begin`, `compute_stream`, `comm_stream`, `finish`) as event records and
/// waits, and logs every other step.
struct RecDevice {
    rank: usize,
    t: FakeTransport<Dev>,
    log: SharedLog<Dev>,
    inline: bool,
    gate: Cell<bool>,
    forked: Cell<u64>,
}

/// Simulated stream number `s` (the caller's, a compute or a comm stream) as the stream
/// handle the engine is given.
fn sim(s: usize) -> StreamHandle {
    StreamHandle::from_raw(s)
}

impl RecDevice {
    fn push(&self, stream: StreamHandle, d: Dev) {
        let mut l = self.log.lock().unwrap();
        l.ranks[self.rank].push((stream.raw(), Rec::Device(d)));
    }
    fn fork(&self, stream: StreamHandle, after: usize) {
        let bit = 1u64 << (stream.raw() % 64);
        if self.forked.get() & bit == 0 {
            self.push(stream, Dev::WaitEvent(after));
            self.forked.set(self.forked.get() | bit);
        }
    }
}

impl Device for RecDevice {
    fn transport(&self) -> &dyn Transport {
        &self.t
    }
    fn begin(&mut self, op: Op, gate: bool, key: &[u64], _full: Option<&GemmDesc>) -> Result<()> {
        self.push(sim(CALLER), Dev::Begin(op as u32, key.to_vec()));
        if self.inline {
            return Ok(());
        }
        self.gate.set(gate);
        self.push(sim(CALLER), Dev::Record(EV_START));
        self.push(sim(COMM), Dev::WaitEvent(EV_START));
        let info = crate::transport::WaitInfo {
            op: op as u32,
            step: 0,
        };
        self.t
            .begin_call(1, StreamHandle::from_raw(COMM), info, 0)?;
        self.push(sim(COMM), Dev::Record(EV_ARRIVED));
        Ok(())
    }
    fn finish(&mut self) -> Result<()> {
        if self.inline {
            return Ok(());
        }
        for s in (COMPUTE..COMPUTE + 8).chain(COMM + 1..COMM + 3) {
            if self.forked.get() & (1 << (s % 64)) != 0 {
                self.push(sim(s), Dev::Record(EV_JOIN + s));
                self.push(sim(COMM), Dev::WaitEvent(EV_JOIN + s));
            }
        }
        self.t.end_call(1, StreamHandle::from_raw(COMM))?;
        self.push(sim(COMM), Dev::Record(EV_END));
        self.push(sim(CALLER), Dev::WaitEvent(EV_END));
        Ok(())
    }
    fn lane(&self, lane: Lane) -> Result<StreamHandle> {
        if self.inline {
            return Ok(StreamHandle::from_raw(CALLER));
        }
        let s = match lane {
            Lane::Caller => CALLER,
            Lane::Compute(i) => {
                let after = if self.gate.get() {
                    EV_ARRIVED
                } else {
                    EV_START
                };
                self.fork(sim(COMPUTE + i), after);
                COMPUTE + i
            }
            Lane::Comm(0) => COMM,
            Lane::Comm(j) => {
                self.fork(sim(COMM + j), EV_ARRIVED);
                COMM + j
            }
        };
        Ok(StreamHandle::from_raw(s))
    }
    fn gemm(
        &self,
        g: &GemmDesc,
        index: usize,
        _concurrent: bool,
        side: crate::gemm::sm90::SideCopy,
    ) -> Result<()> {
        let s = self.lane(Lane::Compute(index))?;
        // The side copy runs beside the GEMM in one launch: independent of it (its caller's
        // promise). Copied both before and after the GEMM here, so that a copy into the
        // GEMM's input (before) or out of its output (after) shows in the results.
        if side.bytes != 0 {
            self.push(s, Dev::Copy(side.dst, side.src, side.bytes));
        }
        self.push(s, Dev::Gemm(*g));
        if side.bytes != 0 {
            self.push(s, Dev::Copy(side.dst, side.src, side.bytes));
        }
        Ok(())
    }
    fn record(&self, ev: usize, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::Record(ev));
        Ok(())
    }
    fn wait_event(&self, ev: usize, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::WaitEvent(ev));
        Ok(())
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::Copy(dst, src, bytes));
        Ok(())
    }
    fn copy_2d(
        &self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let d = Dev::Copy2d {
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
        };
        self.push(stream, d);
        Ok(())
    }
    fn memset(&self, dst: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::Memset(dst, bytes));
        Ok(())
    }
    fn reduce(&self, r: &Reduce, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::Reduce(*r));
        Ok(())
    }
    fn write_flag(&self, dst: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::WriteFlag(dst, value));
        Ok(())
    }
    fn wait_flag(&self, ptr: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
        self.push(stream, Dev::WaitFlag(ptr, value));
        Ok(())
    }
    fn fused_gemm(&self, g: &GemmDesc, hooks: &Hooks, _sms: usize, index: usize) -> Result<()> {
        let s = self.lane(Lane::Compute(index))?;
        self.push(s, Dev::Fused(*g, *hooks));
        Ok(())
    }
    fn copy_segments(
        &self,
        segs: &[(DevPtr, DevPtr, usize)],
        stream: StreamHandle,
        _tail: bool,
    ) -> Result<()> {
        self.push(stream, Dev::Segments(segs.to_vec()));
        Ok(())
    }
    fn amax_max(&self, _out: DevPtr, _slots: DevPtr, _n: usize) -> Result<()> {
        self.push(sim(CALLER), Dev::AmaxMax);
        Ok(())
    }
    fn nvtx(&self, _name: &str) {}
    fn mark(&mut self, _stream: StreamHandle, _name: &str) -> Result<()> {
        Ok(())
    }
}

/// Who wrote a byte: nobody yet, the test's input, or step i of the run.
const NEVER: u32 = 0;
const INPUT: u32 = u32::MAX;

#[derive(Clone)]
struct Alloc {
    name: String,
    base: u64,
    data: Vec<u8>,
    writer: Vec<u32>,
    writes: Vec<u16>,
}

/// Host memory behind the fake device addresses: allocations 4 GiB apart.
#[derive(Clone, Default)]
pub(crate) struct Mem {
    allocs: Vec<Alloc>,
}

impl Mem {
    /// A new allocation of `bytes`, never written (poisoned: NaN bytes).
    pub(crate) fn alloc(&mut self, name: &str, bytes: usize) -> DevPtr {
        let base = (self.allocs.len() as u64 + 16) << 32;
        self.allocs.push(Alloc {
            name: name.into(),
            base,
            data: vec![0xff; bytes],
            writer: vec![NEVER; bytes],
            writes: vec![0; bytes],
        });
        DevPtr::new(base)
    }
    /// A new input allocation holding `v`.
    pub(crate) fn input(&mut self, name: &str, v: &[f32]) -> DevPtr {
        let p = self.alloc(name, v.len() * 4);
        let a = self.allocs.last_mut().unwrap();
        for (i, x) in v.iter().enumerate() {
            a.data[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
        }
        a.writer.fill(INPUT);
        p
    }
    fn find(&self, p: DevPtr, len: usize) -> std::result::Result<(usize, usize), String> {
        let addr = p.raw();
        for (i, a) in self.allocs.iter().enumerate() {
            if addr >= a.base && addr < a.base + (1 << 32) {
                let off = (addr - a.base) as usize;
                if off + len > a.data.len() {
                    return Err(format!(
                        "{len} bytes at offset {off} of `{}` ({} bytes): out of bounds",
                        a.name,
                        a.data.len()
                    ));
                }
                return Ok((i, off));
            }
        }
        Err(format!("address {addr:#x} is in no allocation"))
    }
    /// The allocation called `name`, if any.
    fn named(&self, name: &str) -> Option<DevPtr> {
        self.allocs
            .iter()
            .find(|a| a.name == name)
            .map(|a| DevPtr::new(a.base))
    }
    fn f32_at(&self, p: DevPtr) -> f32 {
        let (i, o) = self.find(p, 4).unwrap();
        f32::from_le_bytes(self.allocs[i].data[o..o + 4].try_into().unwrap())
    }
}

/// Happens-before: `a` <= `b` component-wise.
fn before(a: &[u32], b: &[u32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x <= y)
}

fn join(a: &mut [u32], b: &[u32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = (*x).max(*y);
    }
}

/// One logged step.
struct Step {
    rank: usize,
    stream: StreamHandle,
    rec: Rec<Dev>,
    /// WaitEvent: the record it waits for (the last before it on the rank)
    dep: Option<usize>,
}

/// The run of every rank's log.
struct Sim {
    steps: Vec<Step>,
    clock: Vec<Vec<u32>>,
    done: Vec<bool>,
    posted: Vec<Option<Vec<u32>>>,
    mem: Mem,
    tp: usize,
    buffers: Vec<DevPtr>,
    /// (rank, stream) -> clock index
    lanes: HashMap<(usize, usize), usize>,
    /// flags: (receiver, slot, sender) -> (tag, clock of the signal)
    flags: HashMap<(usize, FlagSlot, usize), (u64, Vec<u32>)>,
    signalled: HashSet<(usize, FlagSlot, usize, u64)>,
    waited: HashSet<(usize, FlagSlot, usize, u64)>,
    /// per rank: its barrier / collective / send / receive steps in issue order
    arrivals: Vec<Vec<usize>>,
    colls: Vec<Vec<usize>>,
    coll_done: HashSet<usize>,
    /// each rank's step of a computed collective: (its output, the bytes)
    coll_out: HashMap<usize, (DevPtr, Vec<u8>)>,
    /// (from, to): the sends from `from` to `to` (step, index in it), in order; and the
    /// receives of `to` from `from`
    sends: HashMap<(usize, usize), Vec<usize>>,
    recvs: HashMap<(usize, usize), Vec<usize>>,
    /// per allocation (index) and byte: the steps that read its current value (a write
    /// must happen after each of them: write-after-read races)
    readers: std::cell::RefCell<HashMap<usize, Vec<Vec<u32>>>>,
    /// one hardware queue per rank (`CUDA_DEVICE_MAX_CONNECTIONS=1`): see `dispatch`
    one_queue: bool,
    /// one-queue mode: each rank's GEMMs as they started and transfers as they ran
    ran: Vec<(usize, Ran)>,
    /// one-queue mode: the timed steps running, with the scheduler rounds each has left
    /// and its rank's GEMM rounds when it started
    timed: HashMap<usize, (u32, u64)>,
    /// one-queue mode: per rank, the GEMMs running and the rounds its GEMMs have run
    busy: Vec<u32>,
    gemm_rounds: Vec<u64>,
}

/// One-queue mode: the scheduler rounds a GEMM runs, and a transfer of data, so that what
/// the queue lets run beside a GEMM shows (see `Sim::timed_runs`).
const GEMM_ROUNDS: u32 = 4;
const MOVE_ROUNDS: u32 = 2;

impl Sim {
    fn new(log: &L, mem: Mem, buffers: Vec<DevPtr>) -> Sim {
        let tp = log.ranks.len();
        let mut steps = Vec::new();
        let mut lanes = HashMap::new();
        let (mut arrivals, mut colls) = (vec![Vec::new(); tp], vec![Vec::new(); tp]);
        let (mut sends, mut recvs) = (HashMap::new(), HashMap::new());
        for (r, entries) in log.ranks.iter().enumerate() {
            let mut last: HashMap<usize, usize> = HashMap::new();
            for (s, rec) in entries {
                let n = lanes.len();
                lanes.entry((r, *s)).or_insert(n);
                let i = steps.len();
                let mut dep = None;
                match rec {
                    Rec::Device(Dev::Record(ev)) => {
                        last.insert(*ev, i);
                    }
                    Rec::Device(Dev::WaitEvent(ev)) => dep = last.get(ev).copied(),
                    Rec::Transport(Call::Arrive) => arrivals[r].push(i),
                    Rec::Transport(Call::Collective { .. }) => colls[r].push(i),
                    Rec::Transport(Call::SendRecv {
                        sends: ss,
                        recvs: rr,
                    }) => {
                        for &(q, _, _) in ss {
                            sends.entry((r, q)).or_insert_with(Vec::new).push(i);
                        }
                        for &(q, _, _) in rr {
                            recvs.entry((q, r)).or_insert_with(Vec::new).push(i);
                        }
                    }
                    _ => {}
                }
                steps.push(Step {
                    rank: r,
                    stream: sim(*s),
                    rec: rec.clone(),
                    dep,
                });
            }
        }
        let n = steps.len();
        Sim {
            steps,
            clock: vec![Vec::new(); n],
            done: vec![false; n],
            posted: vec![None; n],
            mem,
            tp,
            buffers,
            lanes,
            flags: HashMap::new(),
            signalled: HashSet::new(),
            waited: HashSet::new(),
            arrivals,
            colls,
            coll_done: HashSet::new(),
            coll_out: HashMap::new(),
            sends,
            recvs,
            readers: Default::default(),
            one_queue: false,
            ran: Vec::new(),
            timed: HashMap::new(),
            busy: vec![0; tp],
            gemm_rounds: vec![0; tp],
        }
    }

    /// One hardware queue per rank: every stream's work enters it in issue order, as with
    /// `CUDA_DEVICE_MAX_CONNECTIONS=1`. The queue's head goes to its stream once that
    /// stream's previous step has finished (in-stream order); a stream wait (an event, or
    /// cuStreamWaitValue32) blocks the head until it is satisfied; any other step (a
    /// kernel, a copy, a transport call) is handed to its stream and the head moves on.
    /// Moves what can go from each rank's queue to its streams; true if anything moved.
    fn dispatch(
        &mut self,
        ranks: &mut [std::collections::VecDeque<usize>],
        lanes: &mut [(usize, std::collections::VecDeque<usize>)],
        by_lane: &HashMap<usize, usize>,
    ) -> bool {
        let mut moved = false;
        for q in ranks.iter_mut() {
            while let Some(&h) = q.front() {
                let s = &self.steps[h];
                let lane = &mut lanes[by_lane[&self.lanes[&(s.rank, s.stream.raw())]]].1;
                let blocks = matches!(s.rec, Rec::Device(Dev::WaitEvent(_) | Dev::WaitFlag(..)));
                if !lane.is_empty() || (blocks && self.ready(h).is_none()) {
                    break;
                }
                lane.push_back(h);
                q.pop_front();
                moved = true;
            }
        }
        moved
    }

    /// One-queue mode, step `h` at its stream's front: false while it still runs, true
    /// when it can complete now. A GEMM runs [`GEMM_ROUNDS`] scheduler rounds from when its
    /// inputs are ready (our fused GEMM from when it reaches its stream: it waits for its
    /// flags itself, computing what arrived, and ends once they are all set); a transfer
    /// of data (a put, exchange, collective, reduction or segment copy) [`MOVE_ROUNDS`],
    /// and is noted as beside a GEMM where one of its rank's GEMMs ran meanwhile; any
    /// other step none. (The step's effects apply when it completes.)
    fn timed_runs(&mut self, h: usize, progress: &mut bool) -> bool {
        let r = self.steps[h].rank;
        let (rounds, gemm, fused) = match &self.steps[h].rec {
            Rec::Device(Dev::Gemm(_)) => (GEMM_ROUNDS, true, false),
            Rec::Device(Dev::Fused(..)) => (GEMM_ROUNDS, true, true),
            Rec::Device(Dev::Reduce(_) | Dev::Segments(_))
            | Rec::Transport(
                Call::Put { .. }
                | Call::Put2d { .. }
                | Call::SendRecv { .. }
                | Call::Collective { .. },
            ) => (MOVE_ROUNDS, false, false),
            _ => return true,
        };
        let Some((left, mark)) = self.timed.get(&h).copied() else {
            if !fused && self.ready(h).is_none() {
                return false;
            }
            self.timed.insert(h, (rounds, self.gemm_rounds[r]));
            if gemm {
                self.busy[r] += 1;
                self.ran.push((r, Ran::Gemm));
            }
            *progress = true;
            return false;
        };
        if left > 1 {
            self.timed.insert(h, (left - 1, mark));
            if gemm {
                self.gemm_rounds[r] += 1;
            }
            *progress = true;
            return false;
        }
        if self.ready(h).is_none() {
            return false; // (fused: the last flags not yet set)
        }
        self.timed.remove(&h);
        if gemm {
            self.busy[r] -= 1;
        } else {
            let beside_gemm = self.gemm_rounds[r] > mark || self.busy[r] > 0;
            self.ran.push((r, Ran::Transfer { beside_gemm }));
        }
        true
    }

    /// Run every stream of every rank to its end; Err on a deadlock or a bad access.
    fn run(&mut self) -> std::result::Result<(), String> {
        let nl = self.lanes.len();
        let mut queues: Vec<(usize, std::collections::VecDeque<usize>)> = Vec::new();
        let mut by_lane: HashMap<usize, usize> = HashMap::new();
        for (i, s) in self.steps.iter().enumerate() {
            let l = self.lanes[&(s.rank, s.stream.raw())];
            let q = *by_lane.entry(l).or_insert_with(|| {
                queues.push((l, Default::default()));
                queues.len() - 1
            });
            queues[q].1.push_back(i);
        }
        let mut ranks = vec![std::collections::VecDeque::new(); self.tp];
        if self.one_queue {
            for (_, q) in queues.iter_mut() {
                q.clear();
            }
            for (i, s) in self.steps.iter().enumerate() {
                ranks[s.rank].push_back(i);
            }
        }
        let mut lane_clock = vec![vec![0u32; nl]; nl];
        loop {
            let mut progress = self.dispatch(&mut ranks, &mut queues, &by_lane);
            for (l, q) in queues.iter_mut() {
                while let Some(&h) = q.front() {
                    if self.posted[h].is_none() {
                        self.posted[h] = Some(lane_clock[*l].clone());
                    }
                    if self.one_queue && !self.timed_runs(h, &mut progress) {
                        break;
                    }
                    let Some(deps) = self.ready(h) else { break };
                    let mut c = lane_clock[*l].clone();
                    for d in deps {
                        join(&mut c, &d);
                    }
                    c[*l] += 1;
                    self.clock[h] = c.clone();
                    lane_clock[*l] = c;
                    self.execute(h)?;
                    self.done[h] = true;
                    q.pop_front();
                    progress = true;
                }
            }
            if queues.iter().all(|(_, q)| q.is_empty()) && ranks.iter().all(|q| q.is_empty()) {
                break;
            }
            if !progress {
                let heads: Vec<String> = queues
                    .iter()
                    .map(|(_, q)| q)
                    .chain(&ranks)
                    .filter_map(|q| q.front())
                    .map(|&h| {
                        let s = &self.steps[h];
                        format!("rank {} stream {}: {:?}", s.rank, s.stream.raw(), s.rec)
                    })
                    .collect();
                return Err(format!("deadlock; blocked:\n{}", heads.join("\n")));
            }
        }
        // Every rank began the same calls with the same keys (else NVTE_COMM_CHECK would
        // report a mismatch where the ranks agree).
        let keys = |r: usize| -> Vec<(u32, Vec<u64>)> {
            self.steps
                .iter()
                .filter(|s| s.rank == r)
                .filter_map(|s| match &s.rec {
                    Rec::Device(Dev::Begin(op, key)) => Some((*op, key.clone())),
                    _ => None,
                })
                .collect()
        };
        for r in 1..self.tp {
            let (k0, kr) = (keys(0), keys(r));
            if k0 != kr {
                return Err(format!("rank {r} began {kr:?}, rank 0 {k0:?}"));
            }
        }
        let unwaited: Vec<_> = self.signalled.difference(&self.waited).collect();
        if !unwaited.is_empty() {
            return Err(format!("signals nobody waited for: {unwaited:?}"));
        }
        Ok(())
    }

    /// The clocks step `h` joins when it can run now; None while it must wait.
    fn ready(&self, h: usize) -> Option<Vec<Vec<u32>>> {
        let s = &self.steps[h];
        let r = s.rank;
        let posted = |i: usize| self.posted[i].clone();
        match &s.rec {
            Rec::Device(Dev::WaitEvent(_)) => match s.dep {
                Some(d) if !self.done[d] => None,
                Some(d) => Some(vec![self.clock[d].clone()]),
                None => Some(vec![]),
            },
            Rec::Transport(Call::Arrive) => {
                let k = self.arrivals[r].iter().position(|&i| i == h)?;
                (0..self.tp)
                    .map(|q| self.arrivals[q].get(k).and_then(|&i| posted(i)))
                    .collect()
            }
            Rec::Transport(Call::Collective { .. }) => {
                let k = self.colls[r].iter().position(|&i| i == h)?;
                (0..self.tp)
                    .map(|q| self.colls[q].get(k).and_then(|&i| posted(i)))
                    .collect()
            }
            Rec::Transport(Call::Wait { peers, slot, tag }) => peers
                .iter()
                .map(|&p| match self.flags.get(&(r, *slot, p)) {
                    Some((t, c)) if t >= tag => Some(c.clone()),
                    _ => None,
                })
                .collect(),
            Rec::Transport(Call::SendRecv { sends, recvs }) => {
                let mut v = Vec::new();
                for &(q, _, _) in sends {
                    v.push(self.counterpart(h, (r, q), true).and_then(posted)?);
                }
                for &(q, _, _) in recvs {
                    v.push(self.counterpart(h, (q, r), false).and_then(posted)?);
                }
                Some(v)
            }
            Rec::Device(Dev::Fused(g, hk)) => self.flags_ready(g, hk),
            Rec::Device(Dev::WaitFlag(p, v)) => self.flag_ready(*p, *v, false),
            _ => Some(vec![]),
        }
    }

    /// Our GEMM's flags: every row block's has reached the value (wrap-around compare, as
    /// the kernel's), joining the clocks of their writers. Flags out of bounds: ready (the
    /// step then reports them).
    fn flags_ready(&self, g: &GemmDesc, hk: &Hooks) -> Option<Vec<Vec<u32>>> {
        if hk.flags.is_null() {
            return Some(vec![]);
        }
        let mut deps = Vec::new();
        for i in 0..hk.n_flags(g.n) {
            deps.extend(self.flag_ready(hk.flags + 4 * i, hk.flag_value, true)?);
        }
        Some(deps)
    }

    /// A u32 flag has reached `value` (`wrap`: the kernel's wrap-around compare, else
    /// cuStreamWaitValue32's GEQ): the clock of its writer; None while it has not.
    /// Out of bounds: ready (the step then reports it).
    fn flag_ready(&self, p: DevPtr, value: u32, wrap: bool) -> Option<Vec<Vec<u32>>> {
        let Ok((a, o)) = self.mem.find(p, 4) else {
            return Some(vec![]);
        };
        let al = &self.mem.allocs[a];
        let v = u32::from_le_bytes(al.data[o..o + 4].try_into().unwrap());
        let w = al.writer[o];
        let reached = if wrap {
            (v.wrapping_sub(value) as i32) >= 0
        } else {
            v >= value
        };
        if w == NEVER || !reached {
            return None;
        }
        Some(if w == INPUT {
            vec![]
        } else {
            vec![self.clock[w as usize - 1].clone()]
        })
    }

    /// The step holding the matching receive (of a send of `h` on `pair` = (from, to)),
    /// or the matching send (of a receive).
    fn counterpart(&self, h: usize, pair: (usize, usize), is_send: bool) -> Option<usize> {
        let (mine, theirs) = if is_send {
            (&self.sends, &self.recvs)
        } else {
            (&self.recvs, &self.sends)
        };
        let k = mine.get(&pair)?.iter().position(|&i| i == h)?;
        theirs.get(&pair)?.get(k).copied()
    }

    /// Read `len` bytes at `p` for step `h`: in bounds, written before, by a step that
    /// happens before `h`.
    fn read(&self, h: usize, p: DevPtr, len: usize) -> std::result::Result<Vec<u8>, String> {
        self.read_for(h, h, p, len)
    }

    /// [`Self::read`], the bytes then counted as read by step `reader` (a collective's
    /// inputs: each rank's own step of it reads its input).
    fn read_for(
        &self,
        h: usize,
        reader: usize,
        p: DevPtr,
        len: usize,
    ) -> std::result::Result<Vec<u8>, String> {
        let (i, o) = self.mem.find(p, len)?;
        let a = &self.mem.allocs[i];
        let mut seen = HashSet::new();
        for b in o..o + len {
            let w = a.writer[b];
            if w == NEVER {
                return Err(format!(
                    "step {h} {:?} reads byte {b} of `{}`, which nothing wrote",
                    self.steps[h].rec, a.name
                ));
            }
            if w != INPUT && seen.insert(w) && !before(&self.clock[w as usize - 1], &self.clock[h])
            {
                return Err(format!(
                    "race: step {h} (rank {}) {:?} reads byte {b} of `{}` written by step {} (rank {}) {:?}, which does not happen before it",
                    self.steps[h].rank,
                    self.steps[h].rec,
                    a.name,
                    w - 1,
                    self.steps[w as usize - 1].rank,
                    self.steps[w as usize - 1].rec
                ));
            }
        }
        let mut readers = self.readers.borrow_mut();
        let bytes = (readers.entry(i)).or_insert_with(|| vec![Vec::new(); a.data.len()]);
        for r in &mut bytes[o..o + len] {
            if r.last() != Some(&(reader as u32)) {
                r.push(reader as u32);
            }
        }
        Ok(a.data[o..o + len].to_vec())
    }

    fn write(&mut self, h: usize, p: DevPtr, v: &[u8]) -> std::result::Result<(), String> {
        let (i, o) = self.mem.find(p, v.len())?;
        if let Some(bytes) = self.readers.get_mut().get_mut(&i) {
            for (j, rs) in bytes[o..o + v.len()].iter_mut().enumerate() {
                // The value being replaced: every step that read it must happen before.
                // (a reader that has not run yet, a send only posted or a rank's step of a
                // collective still queued, cannot be ordered before this write either)
                let (clock, done) = (&self.clock, &self.done);
                let late = (rs.iter().map(|&r| r as usize))
                    .find(|&r| r != h && (!done[r] || !before(&clock[r], &clock[h])));
                rs.clear();
                if let Some(r) = late {
                    return Err(format!(
                        "write-after-read race: step {h} (rank {}) {:?} writes byte {} of `{}`, which step {r} (rank {}) {:?} read and which does not happen before it",
                        self.steps[h].rank,
                        self.steps[h].rec,
                        o + j,
                        self.mem.allocs[i].name,
                        self.steps[r].rank,
                        self.steps[r].rec
                    ));
                }
            }
        }
        for (b, &x) in v.iter().enumerate() {
            let w = self.mem.allocs[i].writer[o + b];
            if w != NEVER
                && w != INPUT
                && w as usize - 1 != h
                && !before(&self.clock[w as usize - 1], &self.clock[h])
            {
                return Err(format!(
                    "race: step {h} {:?} and step {} {:?} write byte {} of `{}` unordered",
                    self.steps[h].rec,
                    w - 1,
                    self.steps[w as usize - 1].rec,
                    o + b,
                    self.mem.allocs[i].name
                ));
            }
            let a = &mut self.mem.allocs[i];
            a.data[o + b] = x;
            a.writer[o + b] = h as u32 + 1;
            a.writes[o + b] += 1;
        }
        Ok(())
    }

    fn read_f32(&self, h: usize, p: DevPtr) -> std::result::Result<f32, String> {
        let b = self.read(h, p, 4)?;
        Ok(f32::from_le_bytes(b.try_into().unwrap()))
    }

    fn copy(&mut self, h: usize, dst: DevPtr, src: DevPtr, bytes: usize) -> Res {
        if bytes == 0 {
            return Ok(());
        }
        let v = self.read(h, src, bytes)?;
        self.write(h, dst, &v)
    }

    fn execute(&mut self, h: usize) -> Res {
        let (r, rec) = (self.steps[h].rank, self.steps[h].rec.clone());
        match rec {
            Rec::Device(d) => self.device(h, d),
            Rec::Transport(c) => self.transport(h, r, c),
        }
    }

    fn device(&mut self, h: usize, d: Dev) -> Res {
        match d {
            Dev::Gemm(g) => self.gemm(h, &g),
            Dev::Copy(dst, src, n) => self.copy(h, dst, src, n),
            Dev::Copy2d {
                dst,
                dpitch,
                src,
                spitch,
                width,
                height,
            } => {
                for row in 0..height {
                    self.copy(h, dst + row * dpitch, src + row * spitch, width)?;
                }
                Ok(())
            }
            Dev::Memset(dst, n) => self.write(h, dst, &vec![0; n]),
            Dev::Reduce(x) => self.reduce(h, &x),
            Dev::Segments(segs) => {
                for (dst, src, n) in segs {
                    self.copy(h, dst, src, n)?;
                }
                Ok(())
            }
            Dev::WriteFlag(dst, v) => self.write(h, dst, &v.to_le_bytes()),
            Dev::WaitFlag(p, _) => self.mem.find(p, 4).map(|_| ()),
            Dev::Fused(g, hk) => {
                if !hk.flags.is_null() {
                    self.mem.find(hk.flags, 4 * hk.n_flags(g.n))?;
                }
                self.gemm(h, &g)?;
                // done signals (then the kernel's own counters: bounds only)
                if !hk.done.is_null() {
                    let nb = g.n.div_ceil(hk.done_rows.max(1));
                    self.mem.find(hk.done, 8 * nb)?;
                    for j in 0..nb {
                        self.write(h, hk.done + 4 * j, &hk.done_value.to_le_bytes())?;
                    }
                }
                Ok(())
            }
            Dev::AmaxMax | Dev::Begin(..) | Dev::Record(_) | Dev::WaitEvent(_) => Ok(()),
        }
    }

    /// D = op(A) op(B) (+ C, + bias) in cuBLAS's column-major terms (module `gemm`).
    fn gemm(&mut self, h: usize, g: &GemmDesc) -> Res {
        if g.blocks.is_some() {
            return self.block_gemm(h, g);
        }
        if g.a_type != DType::F32 || !matches!(g.epilogue, Epilogue::None | Epilogue::Bias) {
            return Err(format!(
                "the host GEMM computes f32 without epilogues: {g:?}"
            ));
        }
        let at = |i: usize, l: usize| {
            if g.transa {
                l + i * g.lda
            } else {
                i + l * g.lda
            }
        };
        let bt = |l: usize, j: usize| {
            if g.transb {
                j + l * g.ldb
            } else {
                l + j * g.ldb
            }
        };
        let mut out = Vec::with_capacity(g.m * 4);
        for j in 0..g.n {
            out.clear();
            for i in 0..g.m {
                let mut acc = 0f32;
                for l in 0..g.k {
                    acc += self.read_f32(h, g.a + at(i, l) * 4)?
                        * self.read_f32(h, g.b + bt(l, j) * 4)?;
                }
                if g.accumulate {
                    let c = if g.c.is_null() { g.d } else { g.c };
                    acc += self.read_f32(h, c + (i + j * g.ldd) * 4)?;
                }
                if g.epilogue == Epilogue::Bias {
                    acc += self.read_f32(h, g.bias + i * 4)?;
                }
                out.extend_from_slice(&acc.to_le_bytes());
            }
            self.write(h, g.d + j * g.ldd * 4, &out)?;
        }
        Ok(())
    }

    /// A block-scaled FP8 GEMM (TN, e4m3 data, f32 out, no epilogue): every element read
    /// as its data byte times its block's scale, at the GEMM-ready scale layouts
    /// (`tensor::scale_shape`) from the descriptor's scale pointers; so a chunk whose
    /// scale pointer is off reads another block's scales (a wrong sum) or out of bounds.
    fn block_gemm(&mut self, h: usize, g: &GemmDesc) -> Res {
        use crate::tensor::{BlockMode, scale_shape};
        let Some([ma, mb]) = g.blocks else {
            return Err("not a block-scaled GEMM".into());
        };
        if !g.transa || g.transb || g.a_type != DType::E4M3 || g.b_type != DType::E4M3 {
            return Err(format!("the host block GEMM computes e4m3 TN: {g:?}"));
        }
        if g.d_type != DType::F32 || g.epilogue != Epilogue::None || !g.c.is_null() {
            return Err(format!("the host block GEMM writes f32 alone: {g:?}"));
        }
        // Scale index of element (row, l) of an operand of `rows` rows.
        let at = |mode: BlockMode, rows: usize, row: usize, l: usize| match mode {
            BlockMode::OneD => {
                (l / 128) * scale_shape::one_d_rowwise_gemm_ready(rows, g.k)[1] + row
            }
            BlockMode::TwoD => (row / 128) * scale_shape::two_d_rowwise(rows, g.k)[1] + l / 128,
        };
        // Each row's values, dequantized (its scales read once per 128-value block).
        let deq = |me: &Self, p: DevPtr, ld: usize, s: DevPtr, (mode, rows, row)| {
            let data = me.read(h, p + row * ld, g.k)?;
            let mut v = Vec::with_capacity(g.k);
            let mut scale = 0f32;
            for (l, &byte) in data.iter().enumerate() {
                if l % 128 == 0 {
                    scale = me.read_f32(h, s + at(mode, rows, row, l) * 4)?;
                }
                v.push(e4m3(byte) * scale);
            }
            Ok::<_, String>(v)
        };
        let arows: Vec<Vec<f32>> = (0..g.m)
            .map(|i| deq(self, g.a, g.lda, g.a_scale_inv, (ma, g.m, i)))
            .collect::<std::result::Result<_, _>>()?;
        let mut out = Vec::with_capacity(g.m * 4);
        for j in 0..g.n {
            out.clear();
            let brow = deq(self, g.b, g.ldb, g.b_scale_inv, (mb, g.n, j))?;
            for (i, arow) in arows.iter().enumerate() {
                let mut acc = 0f32;
                for l in 0..g.k {
                    acc += arow[l] * brow[l];
                }
                if g.accumulate {
                    acc += self.read_f32(h, g.d + (i + j * g.ldd) * 4)?;
                }
                out.extend_from_slice(&acc.to_le_bytes());
            }
            self.write(h, g.d + j * g.ldd * 4, &out)?;
        }
        Ok(())
    }

    fn reduce(&mut self, h: usize, x: &Reduce) -> Res {
        if x.out_type != DType::F32 || !x.in_scale.is_null() {
            return Err("the host reduction sums f32 without scaling".into());
        }
        for row in 0..x.rows {
            let mut out = Vec::with_capacity(x.cols * 4);
            for c in 0..x.cols {
                let mut acc = 0f32;
                for &s in x.srcs.iter() {
                    acc += self.read_f32(h, s + (row * x.in_ld + c) * 4)?;
                }
                out.extend_from_slice(&acc.to_le_bytes());
            }
            self.write(h, x.out + row * x.out_ld * 4, &out)?;
        }
        Ok(())
    }

    fn transport(&mut self, h: usize, r: usize, c: Call) -> Res {
        match c {
            Call::Arrive | Call::End | Call::WaitDone => Ok(()),
            Call::Put {
                peer,
                offset,
                src,
                bytes,
            } => {
                let dst = self.buffers[peer] + offset;
                self.copy(h, dst, src, bytes)
            }
            Call::Put2d {
                peer,
                offset,
                src,
                width,
                rows,
                pitch,
            } => {
                let dst = self.buffers[peer] + offset;
                for row in 0..rows {
                    self.copy(h, dst + row * pitch, src + row * pitch, width)?;
                }
                Ok(())
            }
            Call::Signal { peers, slot, tag } => {
                for p in peers {
                    let e = self.flags.entry((p, slot, r)).or_insert((0, Vec::new()));
                    e.0 = e.0.max(tag);
                    e.1 = self.clock[h].clone();
                    self.signalled.insert((p, slot, r, tag));
                }
                Ok(())
            }
            Call::Wait { peers, slot, tag } => {
                for p in peers {
                    self.waited.insert((r, slot, p, tag));
                }
                Ok(())
            }
            Call::SendRecv { recvs, .. } => {
                // The data of each receive moves here (from its sender's source): the j-th
                // receive from a peer in a step is that peer's j-th send here.
                for (i, &(q, dst_offset, bytes)) in recvs.iter().enumerate() {
                    let j = recvs[..i].iter().filter(|x| x.0 == q).count();
                    let s = self
                        .counterpart(h, (q, r), false)
                        .ok_or("no matching send")?;
                    let Rec::Transport(Call::SendRecv { sends, .. }) = &self.steps[s].rec else {
                        return Err("the matching send is no exchange".into());
                    };
                    let &(_, src, sb) =
                        sends.iter().filter(|x| x.0 == r).nth(j).ok_or("no send")?;
                    if sb != bytes {
                        return Err(format!("send of {sb} bytes received as {bytes}"));
                    }
                    // (read by the sender's step: the send reads its source, and its
                    // completion there is what frees the source for reuse)
                    let v = self.read_for(h, s, src, bytes)?;
                    self.write(h, self.buffers[r] + dst_offset, &v)?;
                }
                Ok(())
            }
            Call::Collective { .. } => self.collective(h, r),
        }
    }

    /// Collective k: its results are computed when the first rank's step of it runs
    /// (which joined every rank's clock: it reads every rank's input), and each rank's
    /// step writes its own output.
    fn collective(&mut self, h: usize, r: usize) -> Res {
        let k = self.colls[r].iter().position(|&i| i == h).unwrap();
        if !self.coll_done.contains(&k) {
            self.coll_done.insert(k);
            self.compute_collective(h, k)?;
        }
        let (dst, out) = self
            .coll_out
            .remove(&h)
            .ok_or("a collective without result")?;
        self.write(h, dst, &out)
    }

    fn compute_collective(&mut self, h: usize, k: usize) -> Res {
        let parts = |c: &Rec<Dev>| match *c {
            Rec::Transport(Call::Collective {
                kind,
                src,
                dst,
                count,
                ..
            }) => (kind, src, dst, count),
            _ => unreachable!(),
        };
        let all: Vec<(usize, (Coll, DevPtr, DevPtr, usize))> = (0..self.tp)
            .map(|q| {
                let i = self.colls[q][k];
                (i, parts(&self.steps[i].rec))
            })
            .collect();
        let (kind, _, _, count) = all[0].1;
        if all.iter().any(|(_, x)| (x.0, x.3) != (kind, count)) {
            return Err(format!("collective {k}: the ranks disagree: {all:?}"));
        }
        let tp = self.tp;
        let n = match kind {
            Coll::AllReduce => count * 4,
            Coll::ReduceScatter => tp * count * 4,
            Coll::AllGather => count,
        };
        let inputs: Vec<Vec<u8>> = all
            .iter()
            .map(|&(i, x)| self.read_for(h, i, x.1, n))
            .collect::<std::result::Result<_, _>>()?;
        let f = |b: &[u8], i: usize| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
        for (q, (i, x)) in all.iter().enumerate() {
            let out: Vec<u8> = match kind {
                Coll::AllGather => inputs.concat(),
                Coll::AllReduce => (0..count)
                    .flat_map(|e| inputs.iter().map(|b| f(b, e)).sum::<f32>().to_le_bytes())
                    .collect(),
                Coll::ReduceScatter => (0..count)
                    .flat_map(|e| {
                        let at = q * count + e;
                        inputs.iter().map(|b| f(b, at)).sum::<f32>().to_le_bytes()
                    })
                    .collect(),
            };
            self.coll_out.insert(*i, (x.2, out));
        }
        Ok(())
    }
}

pub(crate) type Res = std::result::Result<(), String>;

/// Small integers in -2..=2 from a seed (f32 sums of them are exact).
pub(crate) fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (seed.wrapping_mul(0x9e37_79b9) ^ i.wrapping_mul(0x85eb_ca6b)) % 5;
            h as f32 - 2.0
        })
        .collect()
}

/// row-major x [n, k] times a [m, k] transposed: [n, m].
pub(crate) fn matmul_nt(x: &[f32], a: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut d = vec![0f32; n * m];
    for t in 0..n {
        for i in 0..m {
            d[t * m + i] = (0..k).map(|l| x[t * k + l] * a[i * k + l]).sum();
        }
    }
    d
}

pub(crate) fn tensor(p: DevPtr, shape: &[usize]) -> Tensor {
    Tensor {
        data: Buffer::new(p, DType::F32, Shape::new(shape).unwrap()).unwrap(),
        ..Default::default()
    }
}

/// The engine of a run: its policy, and the fixture's transport flavour, our GEMM and
/// call number.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cfg {
    flavour: Flavour,
    policy: Policy,
    /// "our GEMM" where loaded: what it refuses (the host GEMM computes every f32 GEMM)
    own_gemm: Option<plan::OwnGemm>,
    /// a rank whose "our GEMM" failed to load (its peers' loaded): as on a device where
    /// NVRTC or memory failed on that rank alone
    own_gemm_missing_on: Option<usize>,
    /// the call's number on its rank (flag values; logs of several calls)
    call: u64,
    /// K of the all-gather checks (f32: 8 is one 128-byte K block of our kernel; 96 is
    /// three, so that the fused all-gather's pieces can be K slices)
    ag_k: usize,
    /// the buffer's element type (f32 but for the block-scaled all-gather's e4m3)
    dtype: DType,
}

impl Cfg {
    pub(crate) fn new(flavour: Flavour) -> Cfg {
        Cfg {
            flavour,
            policy: Policy::te_defaults(),
            own_gemm: Some(|_| None),
            own_gemm_missing_on: None,
            call: 0,
            ag_k: 8,
            dtype: DType::F32,
        }
    }
    /// The fused algorithms (config atomic_gemm); our GEMM refuses odd m (so that ranks
    /// with uneven shares of m differ in which GEMM they run) when `mixed`.
    pub(crate) fn fused(flavour: Flavour, mixed: bool) -> Cfg {
        Cfg {
            own_gemm: if mixed {
                Some(|g| (g.m % 2 == 1).then_some("odd m (test)"))
            } else {
                Some(|_| None)
            },
            ..Cfg::new(flavour).with(|p| p.atomic_gemm = true)
        }
    }
    /// This run with buffers of element type `dtype`.
    pub(crate) fn with_dtype(self, dtype: DType) -> Cfg {
        Cfg { dtype, ..self }
    }
    /// This run with its policy changed by `f`.
    pub(crate) fn with(self, f: impl FnOnce(&mut Policy)) -> Cfg {
        let mut policy = self.policy;
        f(&mut policy);
        Cfg { policy, ..self }
    }
}

struct FakeScratch<'a> {
    mem: &'a mut Mem,
    rank: usize,
    bytes: usize,
    staging: Option<DevPtr>,
}

impl Scratch for FakeScratch<'_> {
    fn staging(&mut self) -> Result<DevPtr> {
        if self.staging.is_none() {
            let name = format!("staging of rank {}", self.rank);
            self.staging = Some(self.mem.alloc(&name, self.bytes));
        }
        Ok(self.staging.unwrap())
    }
    fn amax_slots(&mut self) -> Result<DevPtr> {
        Ok(self.mem.alloc("amax slots", 256))
    }
    /// The rank's flags, made zero once and kept across its calls (as the engine's).
    fn flags(&mut self) -> Result<DevPtr> {
        let name = format!("flags of rank {}", self.rank);
        Ok(match self.mem.named(&name) {
            Some(p) => p,
            None => self.mem.input(&name, &[0.0; 2 * plan::MAX_FLAGS]),
        })
    }
}

/// The engine's view of rank `r` of a group of `tp` with buffers `buffers` of `rows` x
/// `cols` f32, over transport `t`.
fn env_of(
    t: &FakeTransport<Dev>,
    (tp, r): (usize, usize),
    (rows, cols): (usize, usize),
    cfg: Cfg,
) -> Env {
    let caps = Caps::of(t);
    Env {
        tp,
        rank: r,
        dtype: cfg.dtype,
        rows,
        cols,
        buffer: t.buffer(),
        buffer_bytes: rows * cols * (cfg.dtype.bits() / 8),
        peers: match t.peer_memory() {
            Some(pm) => (0..tp).map(|q| pm.peer_buffer(q)).collect(),
            None => Default::default(),
        },
        caps,
        slots: AlgoSlots::take(t.flag_slots()).unwrap(),
        policy: cfg.policy,
        sm_count: 132,
        one_shot_max_bytes: 256,
        events: 128,
        compute_streams: 3,
        inline: tp == 1 && caps.idle_alone,
        own_gemm: match cfg.own_gemm_missing_on {
            Some(q) if q == r => None,
            _ => cfg.own_gemm,
        },
        // (the host GEMM computes every kind of f32 GEMM: where "our GEMM" is loaded it takes
        // every kind, and refuses calls only by `cfg.own_gemm`; as the engine's, the kind's
        // verdict is the device type's, the same on a rank whose load failed)
        own_gemm_kind: cfg.own_gemm.map(|_| (|_| None) as plan::OwnGemm),
        nvtx: false,
        trace: false,
    }
}

/// Rank `r`'s engine call: planned by `plan_call` on its engine (buffers `buffers` of
/// `rows` x `cols` f32), then enqueued into the group's log.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rank_call(
    (tp, r): (usize, usize),
    geometry: (usize, usize),
    cfg: Cfg,
    mem: &mut Mem,
    buffers: &[DevPtr],
    log: &SharedLog<Dev>,
    plan_call: &mut dyn FnMut(&mut Planner) -> Result<()>,
) -> Res {
    let bytes = geometry.0 * geometry.1 * (cfg.dtype.bits() / 8);
    let t = FakeTransport::new(r, buffers, bytes, cfg.flavour, log.clone()).for_call(cfg.call);
    let env = env_of(&t, (tp, r), geometry, cfg);
    let mut plan = Plan::default();
    {
        let mut scratch = FakeScratch {
            mem,
            rank: r,
            bytes,
            staging: None,
        };
        let mut p = Planner {
            e: &env,
            res: &mut scratch,
            plan: &mut plan,
        };
        plan_call(&mut p).map_err(|e| format!("rank {r} planning: {}", e.msg))?;
    }
    let mut dev = RecDevice {
        rank: r,
        t,
        log: log.clone(),
        inline: env.inline,
        gate: Cell::new(false),
        forked: Cell::new(0),
    };
    plan::enqueue(&plan, &mut dev).map_err(|e| format!("rank {r} enqueue: {}", e.msg))
}

pub(crate) fn new_log(tp: usize) -> SharedLog<Dev> {
    Arc::new(Mutex::new(Log {
        ranks: vec![Vec::new(); tp],
    }))
}

/// Run the group's logs together (the memory after the run replaces `mem`).
pub(crate) fn simulate(log: &SharedLog<Dev>, mem: &mut Mem, buffers: &[DevPtr]) -> Res {
    // Every log also runs with one hardware queue per rank, on a copy of the memory: no
    // deadlock or race there either, and every byte ends the same.
    let mut copy = mem.clone();
    simulate_streams(log, mem, buffers)?;
    simulate_one_queue(log, &mut copy, buffers)
        .map_err(|e| format!("with one hardware queue per rank: {e}"))?;
    for (a, b) in mem.allocs.iter().zip(&copy.allocs) {
        if let Some(i) = (0..a.data.len()).find(|&i| a.data[i] != b.data[i]) {
            return Err(format!(
                "with one hardware queue per rank, byte {i} of `{}` ends different",
                a.name
            ));
        }
    }
    Ok(())
}

/// [`simulate`] with a hardware queue per stream only.
pub(crate) fn simulate_streams(log: &SharedLog<Dev>, mem: &mut Mem, buffers: &[DevPtr]) -> Res {
    let l = log.lock().unwrap();
    let mut sim = Sim::new(&l, std::mem::take(mem), buffers.to_vec());
    let r = sim.run();
    *mem = sim.mem;
    r
}

/// What ran, in order, as [`simulate_one_queue`] reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Ran {
    /// a GEMM (ours fused or a library one) started
    Gemm,
    /// a transfer of data (put, exchange, collective, reduction of peers' data, segment
    /// copy) ended, having run beside a GEMM of its rank or not
    Transfer { beside_gemm: bool },
}

/// [`simulate`] with one hardware queue per rank (`CUDA_DEVICE_MAX_CONNECTIONS=1`, see
/// `Sim::dispatch`; GEMMs and transfers take scheduler rounds, `Sim::timed_runs`): the
/// same checks, and per rank its GEMMs' starts and its transfers' ends in order.
pub(crate) fn simulate_one_queue(
    log: &SharedLog<Dev>,
    mem: &mut Mem,
    buffers: &[DevPtr],
) -> std::result::Result<Vec<Vec<Ran>>, String> {
    let l = log.lock().unwrap();
    let mut sim = Sim::new(&l, std::mem::take(mem), buffers.to_vec());
    sim.one_queue = true;
    let r = sim.run();
    *mem = std::mem::take(&mut sim.mem);
    r?;
    let mut out = vec![Vec::new(); sim.tp];
    for &(r, x) in &sim.ran {
        out[r].push(x);
    }
    Ok(out)
}

/// A group of `tp` ranks with buffers of `rows` x `cols` f32, each rank planning its call
/// with `plan_call(planner, rank)` and enqueueing it; then the run.
fn run_group(
    tp: usize,
    geometry: (usize, usize),
    cfg: Cfg,
    mem: &mut Mem,
    buffers: &[DevPtr],
    plan_call: &mut dyn FnMut(&mut Planner, usize) -> Result<()>,
) -> Res {
    let log = new_log(tp);
    for r in 0..tp {
        rank_call((tp, r), geometry, cfg, mem, buffers, &log, &mut |p| {
            plan_call(p, r)
        })?;
    }
    simulate(&log, mem, buffers)
}

/// Every byte of `len` bytes at `p` was written exactly once, and the values are `want`.
pub(crate) fn expect_once(mem: &Mem, p: DevPtr, want: &[f32], what: &str) -> Res {
    let (i, o) = mem.find(p, want.len() * 4)?;
    let a = &mem.allocs[i];
    if let Some(b) = (o..o + want.len() * 4).find(|&b| a.writes[b] != 1) {
        return Err(format!(
            "{what}: byte {b} of `{}` written {} times",
            a.name, a.writes[b]
        ));
    }
    for (e, w) in want.iter().enumerate() {
        let got = mem.f32_at(p + 4 * e);
        if got != *w {
            return Err(format!("{what}: element {e} is {got}, want {w}"));
        }
    }
    Ok(())
}

/// Buffers of a group.
pub(crate) fn buffers(mem: &mut Mem, tp: usize, bytes: usize) -> Vec<DevPtr> {
    (0..tp)
        .map(|r| mem.alloc(&format!("buffer of rank {r}"), bytes))
        .collect()
}

/// Ring all-gather + GEMM: D = gather(B) A^T on every rank; B_copy and the buffer hold
/// the gathered B. `view`: B is the buffer view (the local chunk filled beforehand).
fn check_ag(tp: usize, cfg: Cfg, view: bool) -> Res {
    check_ag_copy(tp, cfg, view, true)
}

/// [`check_ag`], with a B_copy or without (`b_copy`; without one, at tp 1 the shard's copy
/// into the buffer runs beside the GEMM: Step::Gemm's side copy).
fn check_ag_copy(tp: usize, cfg: Cfg, view: bool, b_copy: bool) -> Res {
    let (nc, k, m) = (4, cfg.ag_k, 16);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, n * k * 4);
    let shards: Vec<Vec<f32>> = (0..tp).map(|r| values(r + 1, nc * k)).collect();
    let gathered = shards.concat();
    let mut ops = Vec::new();
    for r in 0..tp {
        let a = values(100 + r, m * k);
        let pa = mem.input(&format!("A{r}"), &a);
        let pb = if view {
            let (i, o) = mem.find(bufs[r] + r * nc * k * 4, nc * k * 4)?;
            for (e, x) in shards[r].iter().enumerate() {
                let al = &mut mem.allocs[i];
                al.data[o + 4 * e..o + 4 * e + 4].copy_from_slice(&x.to_le_bytes());
                al.writer[o + 4 * e..o + 4 * e + 4].fill(INPUT);
            }
            bufs[r]
        } else {
            mem.input(&format!("B{r}"), &shards[r])
        };
        let pd = mem.alloc(&format!("D{r}"), n * m * 4);
        let pc = mem.alloc(&format!("B_copy{r}"), n * k * 4);
        ops.push((a, pa, pb, pd, pc));
    }
    let mut plan_call = |p: &mut Planner, r: usize| {
        let (_, pa, pb, pd, pc) = &ops[r];
        let (ta, td, tc) = (
            tensor(*pa, &[m, k]),
            tensor(*pd, &[n, m]),
            tensor(*pc, &[n, k]),
        );
        let tb = tensor(*pb, &[if view { n } else { nc }, k]);
        let args = AgArgs {
            g: gemm(&ta, &tb, &td),
            b_copy: b_copy.then_some(&tc),
            key_m: None,
        };
        p.split_ag(&args)
    };
    run_group(tp, (n, k), cfg, &mut mem, &bufs, &mut plan_call)?;
    for (r, (a, _, _, pd, pc)) in ops.iter().enumerate() {
        let want = matmul_nt(&gathered, a, n, k, m);
        expect_once(&mem, *pd, &want, &format!("rank {r}: D"))?;
        if b_copy {
            expect_once(&mem, *pc, &gathered, &format!("rank {r}: B_copy"))?;
        }
        for (e, w) in gathered.iter().enumerate() {
            if mem.f32_at(bufs[r] + 4 * e) != *w {
                return Err(format!("rank {r}: the buffer's element {e} is not B's"));
            }
        }
    }
    Ok(())
}

/// TN operands with no epilogue.
fn gemm<'a>(a: &'a Tensor, b: &'a Tensor, d: &'a Tensor) -> TeGemm<'a> {
    TeGemm {
        a,
        b,
        d,
        bias: None,
        pre_gelu_out: None,
        transa: true,
        transb: false,
        grad: false,
        workspace: None,
        accumulate: false,
        use_split_accumulator: true,
        math_sm_count: 0,
    }
}

/// Every rank's partial [n, m] = B_r A_r^T (k split across ranks).
struct Partials {
    a: Vec<(Vec<f32>, DevPtr)>,
    b: Vec<(Vec<f32>, DevPtr)>,
    sum: Vec<f32>,
}

fn partials(mem: &mut Mem, tp: usize, dims: (usize, usize, usize)) -> Partials {
    partials_seeded(mem, tp, dims, 0)
}

/// [`partials`] from other values (`seed`).
fn partials_seeded(
    mem: &mut Mem,
    tp: usize,
    (n, k, m): (usize, usize, usize),
    seed: usize,
) -> Partials {
    let mut p = Partials {
        a: Vec::new(),
        b: Vec::new(),
        sum: vec![0f32; n * m],
    };
    for r in 0..tp {
        let a = values(seed + 200 + r, m * k);
        let b = values(seed + 300 + r, n * k);
        for (s, x) in p.sum.iter_mut().zip(matmul_nt(&b, &a, n, k, m)) {
            *s += x;
        }
        let pa = mem.input(&format!("A{r}"), &a);
        let pb = mem.input(&format!("B{r}"), &b);
        p.a.push((a, pa));
        p.b.push((b, pb));
    }
    p
}

/// GEMM + reduce-scatter: rank r gets rows [r n/tp, (r+1) n/tp) of the sum of the
/// partials. `ring`: the ring entry point (split_rs_p2p), else the pipelined one.
fn check_rs(tp: usize, cfg: Cfg, ring: bool) -> Res {
    let (nc, k, m) = (4, 8, 48);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, n * m * 4);
    let p = partials(&mut mem, tp, (n, k, m));
    let outs: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("rs_output{r}"), nc * m * 4))
        .collect();
    let mut plan_call = |pl: &mut Planner, r: usize| {
        let (ta, tb, to) = (
            tensor(p.a[r].1, &[m, k]),
            tensor(p.b[r].1, &[n, k]),
            tensor(outs[r], &[nc, m]),
        );
        let args = RsArgs {
            g: gemm(&ta, &tb, &to).with_d(None),
            rs_output: &to,
        };
        if ring {
            pl.split_rs_p2p(&args)
        } else {
            pl.split_rs(&args)
        }
    };
    run_group(tp, (n, m), cfg, &mut mem, &bufs, &mut plan_call)?;
    for (r, &o) in outs.iter().enumerate() {
        let want = &p.sum[r * nc * m..(r + 1) * nc * m];
        expect_once(&mem, o, want, &format!("rank {r}: rs_output"))?;
    }
    Ok(())
}

/// Two fused ring reduce-scatters in a row with other partials, on the same signals: the
/// second call's exchanges wait for its own GEMM's signals (one left set by the first
/// call would send the first call's partials), and every flag is zero after each.
fn check_fused_rs_twice(tp: usize, cfg: Cfg) -> Res {
    let (nc, k, m) = (4, 8, 48);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, n * m * 4);
    let log = new_log(tp);
    let mut want = Vec::new();
    for call in 0..2 {
        let p = partials_seeded(&mut mem, tp, (n, k, m), 1000 * call);
        for r in 0..tp {
            let o = mem.alloc(&format!("rs_output{r}.{call}"), nc * m * 4);
            want.push((o, p.sum[r * nc * m..(r + 1) * nc * m].to_vec()));
            let (ta, tb, to) = (
                tensor(p.a[r].1, &[m, k]),
                tensor(p.b[r].1, &[n, k]),
                tensor(o, &[nc, m]),
            );
            let args = RsArgs {
                g: gemm(&ta, &tb, &to).with_d(None),
                rs_output: &to,
            };
            let cfg = Cfg {
                call: call as u64,
                ..cfg
            };
            rank_call((tp, r), (n, m), cfg, &mut mem, &bufs, &log, &mut |pl| {
                pl.split_rs_p2p(&args)
            })?;
        }
    }
    simulate(&log, &mut mem, &bufs)?;
    for (i, (o, w)) in want.iter().enumerate() {
        expect_once(
            &mem,
            *o,
            w,
            &format!("call {} rank {}: rs_output", i / tp, i % tp),
        )?;
    }
    flags_left_zero(&mem, tp)
}

/// GEMM + all-reduce: every rank gets the sum of the partials in D.
fn check_ar(tp: usize, cfg: Cfg) -> Res {
    let (nc, k, m) = (4, 8, 32);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, 2 * n * m * 4);
    let p = partials(&mut mem, tp, (n, k, m));
    let ds: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
        .collect();
    let mut plan_call = |pl: &mut Planner, r: usize| {
        let (ta, tb, td) = (
            tensor(p.a[r].1, &[m, k]),
            tensor(p.b[r].1, &[n, k]),
            tensor(ds[r], &[n, m]),
        );
        let args: ArArgs = gemm(&ta, &tb, &td);
        pl.split_ar(&args)
    };
    run_group(tp, (2 * n, m), cfg, &mut mem, &bufs, &mut plan_call)?;
    for (r, &d) in ds.iter().enumerate() {
        expect_once(&mem, d, &p.sum, &format!("rank {r}: D"))?;
    }
    Ok(())
}

/// Bulk all-gather / reduce-scatter on the buffer beside an unrelated GEMM.
fn check_bulk(tp: usize, cfg: Cfg, kind: BulkKind) -> Res {
    let (rc, cols, k, m, n) = (4, 16, 8, 16, 8);
    let rows = rc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, rows * cols * 4);
    // Inputs in the buffers: AG the own chunk, RS all of it.
    let data: Vec<Vec<f32>> = (0..tp).map(|r| values(400 + r, rows * cols)).collect();
    for r in 0..tp {
        let (lo, hi) = match kind {
            BulkKind::AllGather => (r * rc * cols, (r + 1) * rc * cols),
            BulkKind::ReduceScatter => (0, rows * cols),
        };
        let (i, o) = mem.find(bufs[r], rows * cols * 4)?;
        let a = &mut mem.allocs[i];
        for (e, x) in data[r].iter().enumerate().take(hi).skip(lo) {
            a.data[o + 4 * e..o + 4 * e + 4].copy_from_slice(&x.to_le_bytes());
            a.writer[o + 4 * e..o + 4 * e + 4].fill(INPUT);
        }
    }
    let g = partials(&mut mem, tp, (n, k, m));
    let ds: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
        .collect();
    let outs: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("rs_output{r}"), rc * cols * 4))
        .collect();
    let mut plan_call = |pl: &mut Planner, r: usize| {
        let (ta, tb, td, to) = (
            tensor(g.a[r].1, &[m, k]),
            tensor(g.b[r].1, &[n, k]),
            tensor(ds[r], &[n, m]),
            tensor(outs[r], &[rc, cols]),
        );
        let args = BulkArgs {
            kind,
            gemm: gemm(&ta, &tb, &td),
            buffer_view: None,
            rs_output: (kind == BulkKind::ReduceScatter).then_some(&to),
        };
        pl.bulk(&args)
    };
    run_group(tp, (rows, cols), cfg, &mut mem, &bufs, &mut plan_call)?;
    for r in 0..tp {
        let want = matmul_nt(&g.b[r].0, &g.a[r].0, n, k, m);
        expect_once(&mem, ds[r], &want, &format!("rank {r}: the GEMM's D"))?;
        match kind {
            BulkKind::AllGather => {
                for q in (0..tp).filter(|&q| q != r) {
                    let at = q * rc * cols;
                    let want = &data[q][at..at + rc * cols];
                    let what = format!("rank {r}: chunk {q} gathered");
                    expect_once(&mem, bufs[r] + at * 4, want, &what)?;
                }
            }
            BulkKind::ReduceScatter => {
                let want: Vec<f32> = (0..rc * cols)
                    .map(|e| data.iter().map(|d| d[r * rc * cols + e]).sum())
                    .collect();
                expect_once(&mem, outs[r], &want, &format!("rank {r}: rs_output"))?;
            }
        }
    }
    Ok(())
}

const FLAVOURS: [Flavour; 2] = [Flavour::PeerMemory, Flavour::Messages];

/// Run `check` for tp 1..=8 on both flavours; every failure is reported.
pub(crate) fn all(name: &str, check: impl Fn(usize, Flavour) -> Res) {
    let mut failed = Vec::new();
    for f in FLAVOURS {
        for tp in 1..=8 {
            if let Err(e) = check(tp, f) {
                failed.push(format!("{name} {f:?} tp {tp}: {e}"));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

#[test]
fn ring_all_gather_gemm() {
    all("split_ag", |tp, f| check_ag(tp, Cfg::new(f), false));
    // Without B_copy (at tp 1 the shard's copy into the buffer rides on the GEMM's step).
    all("split_ag (no B_copy)", |tp, f| {
        check_ag_copy(tp, Cfg::new(f), false, false)
    });
    all("split_ag (buffer view)", |tp, f| {
        check_ag(tp, Cfg::new(f), true)
    });
    all("split_ag (bidirectional, 2 pieces)", |tp, f| {
        let cfg = Cfg::new(f).with(|p| {
            p.direction = Direction::BothWays;
            p.pieces = 2;
        });
        check_ag(tp, cfg, false)
    });
    all("split_ag (SM puts, 3 pieces)", |tp, f| {
        let cfg = Cfg::new(f).with(|p| {
            p.comm.use_ce = false;
            p.pieces = 3;
        });
        check_ag(tp, cfg, false)
    });
}

/// The fused all-gather + GEMM: the ring's arrivals as flags and one GEMM waiting on
/// them (or, without our GEMM, cuBLASLt per chunk on the same ring); selected through
/// split_ag by the policy's fused algorithms wherever the transport has a two-sided
/// exchange.
#[test]
fn fused_all_gather_gemm() {
    let fused = |f| Cfg::fused(f, false);
    all("fused_ag", |tp, f| check_ag(tp, fused(f), false));
    all("fused_ag (buffer view)", |tp, f| {
        check_ag(tp, fused(f), true)
    });
    all("fused_ag (2 pieces)", |tp, f| {
        check_ag(tp, fused(f).with(|p| p.pieces = 2), false)
    });
    all("fused_ag (3 pieces: 1 divides the chunk)", |tp, f| {
        check_ag(tp, fused(f).with(|p| p.pieces = 3), false)
    });
    all("fused_ag (SM puts, bidirectional asked)", |tp, f| {
        let cfg = fused(f).with(|p| {
            p.comm.use_ce = false;
            p.direction = Direction::BothWays;
        });
        check_ag(tp, cfg, false)
    });
    all(
        "fused_ag (our GEMM not loaded: cuBLASLt per chunk)",
        |tp, f| {
            let cfg = Cfg {
                own_gemm: None,
                ..fused(f).with(|p| p.pieces = 2)
            };
            check_ag(tp, cfg, false)
        },
    );
    all("fused_ag (two calls, new data)", |tp, f| {
        check_ag_twice(tp, fused(f), true)
    });
    all("fused_ag (tuned: 128-wide tiles, 2 pieces)", |tp, f| {
        let cfg = fused(f).with(|p| {
            p.fused = Some(Tiles::Narrow);
            p.pieces = 2;
        });
        check_ag(tp, cfg, false)
    });
}

/// The fused all-gather's pieces as K slices of each chunk (NVTE_COMM_AG_PIECES=k) or as
/// row slices (`rows`, unset), on a K of three or six 128-byte blocks.
#[test]
fn fused_all_gather_k_slices() {
    let fused = |f| Cfg::fused(f, false);
    // Pieces as K slices (NVTE_COMM_AG_PIECES=k; the peer-memory flavour's exchange moves
    // strided slices, the messages flavour keeps row pieces), with a B_copy and from the
    // buffer view.
    let k_slices = Pins {
        ag_pieces: Some(2),
        ..Pins::default()
    };
    // (K slices: 4, or the tuned count where larger, at most one a K block: 3 of 3
    // blocks, 4 and 6 of 6; the tuned pieces here 1 or 6.)
    for (blocks, pieces) in [(3, 1), (6, 1), (6, 6)] {
        let cfg = |f| Cfg {
            ag_k: 32 * blocks,
            ..fused(f).with(|p| {
                p.pieces = pieces;
                p.pins = k_slices;
            })
        };
        all(
            &format!("fused_ag (K of {blocks} blocks, tuned pieces {pieces})"),
            |tp, f| check_ag(tp, cfg(f), false),
        );
        all(
            &format!("fused_ag (K of {blocks} blocks, tuned pieces {pieces}, buffer view)"),
            |tp, f| check_ag(tp, cfg(f), true),
        );
    }
    // Our GEMM failed to load on the last rank alone: K slices on every rank still (the
    // kind's verdict is the device type's), that rank multiplying each chunk whole on
    // cuBLASLt.
    all(
        "fused_ag (K slices, our GEMM not loaded on one rank)",
        |tp, f| {
            let cfg = Cfg {
                ag_k: 96,
                own_gemm_missing_on: Some(tp - 1),
                ..fused(f).with(|p| {
                    p.pieces = 2;
                    p.pins = k_slices;
                })
            };
            check_ag(tp, cfg, false)
        },
    );
    // K slices with cuBLASLt per chunk (our GEMM takes the kind of call but refuses this
    // rank's m: each remote chunk whole after its last slice), then row pieces although K
    // slices could (NVTE_COMM_AG_PIECES=rows, and unset).
    all("fused_ag (K slices, cuBLASLt per chunk)", |tp, f| {
        let cfg = Cfg {
            ag_k: 96,
            own_gemm: Some(|_| Some("this rank's m (test)")),
            ..fused(f).with(|p| {
                p.pieces = 2;
                p.pins = k_slices;
            })
        };
        check_ag(tp, cfg, false)
    });
    all("fused_ag (NVTE_COMM_AG_PIECES=rows)", |tp, f| {
        let cfg = Cfg {
            ag_k: 96,
            ..fused(f).with(|p| {
                p.pieces = 2;
                p.pins = Pins {
                    ag_pieces: Some(1),
                    ..Pins::default()
                };
            })
        };
        check_ag(tp, cfg, false)
    });
    all(
        "fused_ag (NVTE_COMM_AG_PIECES unset: row pieces)",
        |tp, f| {
            let cfg = Cfg {
                ag_k: 96,
                ..fused(f).with(|p| p.pieces = 2)
            };
            check_ag(tp, cfg, false)
        },
    );
}

/// Two all-gather calls in a row on the same buffers and flags, the second with other
/// shards: its GEMM sees only its own arrivals (a flag or a signal left set by the first
/// call would let it read the first call's rows, and D would be wrong), and every flag is
/// zero after each. `fused`: one launch of our GEMM per rank and call (else none).
fn check_ag_twice(tp: usize, cfg: Cfg, fused: bool) -> Res {
    let (nc, k, m) = (4, 8, 16);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, n * k * 4);
    let log = new_log(tp);
    let mut want = Vec::new();
    for call in 0..2 {
        let shards: Vec<Vec<f32>> = (0..tp).map(|r| values(10 * call + r + 1, nc * k)).collect();
        let gathered = shards.concat();
        for (r, shard) in shards.iter().enumerate() {
            let a = values(100 + r, m * k);
            let (pa, pb) = (
                mem.input(&format!("A{r}.{call}"), &a),
                mem.input(&format!("B{r}.{call}"), shard),
            );
            let pd = mem.alloc(&format!("D{r}.{call}"), n * m * 4);
            want.push((pd, matmul_nt(&gathered, &a, n, k, m)));
            let (ta, tb, td) = (
                tensor(pa, &[m, k]),
                tensor(pb, &[nc, k]),
                tensor(pd, &[n, m]),
            );
            let args = AgArgs {
                g: gemm(&ta, &tb, &td),
                b_copy: None,
                key_m: None,
            };
            let cfg = Cfg {
                call: call as u64,
                ..cfg
            };
            rank_call((tp, r), (n, k), cfg, &mut mem, &bufs, &log, &mut |p| {
                p.split_ag(&args)
            })?;
        }
    }
    let launches = log
        .lock()
        .unwrap()
        .ranks
        .iter()
        .flatten()
        .filter(|(_, x)| matches!(x, Rec::Device(Dev::Fused(..))))
        .count();
    if launches != if fused { 2 * tp } else { 0 } {
        return Err(format!(
            "{launches} launches of our GEMM, want {} per rank and call",
            fused as usize
        ));
    }
    simulate(&log, &mut mem, &bufs)?;
    for (i, (pd, w)) in want.iter().enumerate() {
        expect_once(&mem, *pd, w, &format!("call {} rank {}: D", i / tp, i % tp))?;
    }
    flags_left_zero(&mem, tp)
}

/// Every rank's fused-algorithm flags are zero (after its calls).
fn flags_left_zero(mem: &Mem, tp: usize) -> Res {
    for r in 0..tp {
        if let Some(f) = mem.named(&format!("flags of rank {r}")) {
            let (a, o) = mem.find(f, 8 * plan::MAX_FLAGS)?;
            if mem.allocs[a].data[o..o + 8 * plan::MAX_FLAGS]
                .iter()
                .any(|&b| b != 0)
            {
                return Err(format!("rank {r}: flags left set after the calls"));
            }
        }
    }
    Ok(())
}

#[test]
fn pipelined_and_ring_reduce_scatter() {
    all("split_rs (pipelined)", |tp, f| {
        check_rs(tp, Cfg::new(f), false)
    });
    all("split_rs (pipelined, 1 split)", |tp, f| {
        check_rs(tp, Cfg::new(f).with(|p| p.splits = 1), false)
    });
    all("split_rs_p2p (ring)", |tp, f| {
        check_rs(tp, Cfg::new(f), true)
    });
    // The fused ring: one launch of our GEMM signalling each destination's rows; mixed:
    // our GEMM refusing odd m (m is even here: every rank fuses), and not loaded.
    all("split_rs_p2p (fused ring)", |tp, f| {
        check_rs(tp, Cfg::fused(f, false), true)
    });
    all(
        "split_rs_p2p (fused asked, our GEMM not loaded)",
        |tp, f| {
            let cfg = Cfg {
                own_gemm: None,
                ..Cfg::fused(f, false)
            };
            check_rs(tp, cfg, true)
        },
    );
    all(
        "split_rs_p2p (fused ring, our GEMM not loaded on one rank)",
        |tp, f| {
            let cfg = Cfg {
                own_gemm_missing_on: Some(tp - 1),
                ..Cfg::fused(f, false)
            };
            check_rs(tp, cfg, true)
        },
    );
    all("split_rs_p2p (fused ring, two calls, new data)", |tp, f| {
        check_fused_rs_twice(tp, Cfg::fused(f, false))
    });
    // In pieces: a done signal and an exchange per piece (3: the largest count that
    // divides the rows is taken).
    for pieces in [2, 3] {
        all(
            &format!("split_rs_p2p (fused ring, {pieces} pieces)"),
            |tp, f| {
                let cfg = Cfg::fused(f, false).with(|p| p.pieces = pieces);
                check_rs(tp, cfg, true)
            },
        );
    }
    all(
        "split_rs_p2p (fused ring in 2 pieces, our GEMM not loaded)",
        |tp, f| {
            let cfg = Cfg {
                own_gemm: None,
                ..Cfg::fused(f, false).with(|p| p.pieces = 2)
            };
            check_rs(tp, cfg, true)
        },
    );
    all(
        "split_rs_p2p (fused ring in 2 pieces, two calls, new data)",
        |tp, f| {
            let cfg = Cfg::fused(f, false).with(|p| p.pieces = 2);
            check_fused_rs_twice(tp, cfg)
        },
    );
    all(
        "split_rs_p2p (fused ring, tuned: 128-wide tiles, 2 pieces)",
        |tp, f| {
            let cfg = Cfg::fused(f, false).with(|p| {
                p.fused = Some(Tiles::Narrow);
                p.pieces = 2;
            });
            check_rs(tp, cfg, true)
        },
    );
    all("split_rs (pipelined, fused asked: unchanged)", |tp, f| {
        check_rs(tp, Cfg::fused(f, false), false)
    });
}

#[test]
fn accumulating_ring_reduce_scatter() {
    for pieces in [1, 2, 3] {
        all(
            &format!("split_rs_p2p (accumulating, {pieces} pieces)"),
            |tp, f| {
                let cfg = Cfg::new(f).with(|p| {
                    p.reduce = Reduction::Ring {
                        sum: Sum::Accumulating,
                    };
                    p.pieces = pieces;
                });
                check_rs(tp, cfg, true)
            },
        );
    }
    all("split_rs_p2p (NVTE_COMM_RS_RING=accumulate)", |tp, f| {
        let knobs = Pins {
            rs_ring: Some(2),
            ..Default::default()
        };
        check_rs(tp, Cfg::new(f).with(|p| p.pins = knobs), true)
    });
}

#[test]
fn all_reduce_variants() {
    all("split_ar (ring)", |tp, f| check_ar(tp, Cfg::new(f)));
    all("split_ar (ring, fused reduce-scatter)", |tp, f| {
        check_ar(tp, Cfg::fused(f, false))
    });
    all(
        "split_ar (ring, fused reduce-scatter in 2 pieces)",
        |tp, f| {
            let cfg = Cfg::fused(f, false).with(|p| p.pieces = 2);
            check_ar(tp, cfg)
        },
    );
    all("split_ar (ring, accumulating)", |tp, f| {
        let cfg = Cfg::new(f).with(|p| {
            p.reduce = Reduction::Ring {
                sum: Sum::Accumulating,
            };
            p.pieces = 2;
        });
        check_ar(tp, cfg)
    });
    // Chunked: one-shot chunks (small), two-shot (more than 256 bytes per chunk here).
    for splits in [8, 2] {
        all(&format!("split_ar (chunked, {splits} splits)"), |tp, f| {
            let cfg = Cfg::new(f).with(|p| {
                p.reduce = Reduction::Chunks;
                p.splits = splits;
            });
            check_ar(tp, cfg)
        });
    }
}

/// No overlap (the tuner's no-overlap candidate, or NVTE_COMM_OVERLAP=off): B gathered
/// whole, then one GEMM; the GEMM whole, then the reduce-scatter or the all-reduce. Both
/// flavours, tp 1..8, checked as every algorithm is.
#[test]
fn no_overlap_algorithms() {
    let serial = |f| Cfg::new(f).with(|p| p.no_overlap = true);
    all("split_ag (no overlap)", |tp, f| {
        check_ag(tp, serial(f), false)
    });
    all("split_ag (no overlap, buffer view)", |tp, f| {
        check_ag(tp, serial(f), true)
    });
    all("split_ag (no overlap, no B_copy)", |tp, f| {
        check_ag_copy(tp, serial(f), false, false)
    });
    all("split_rs (no overlap)", |tp, f| {
        check_rs(tp, serial(f), false)
    });
    all("split_rs_p2p (no overlap)", |tp, f| {
        check_rs(tp, serial(f), true)
    });
    all("split_ar (no overlap)", |tp, f| check_ar(tp, serial(f)));
    all("split_ag (no overlap, two calls, new data)", |tp, f| {
        check_ag_twice(tp, serial(f), false)
    });
    all("split_ag (NVTE_COMM_OVERLAP=off)", |tp, f| {
        let pins = Pins {
            overlap: Some(OVERLAP_OFF),
            ..Default::default()
        };
        check_ag(tp, Cfg::new(f).with(|p| p.pins = pins), false)
    });
}

/// The rule: no overlap where the policy says so (the tuning's choice, or
/// NVTE_COMM_OVERLAP, which wins over it), and then one GEMM over all of B.
/// Rank 0's operands of one call of each operation on the group's buffers (f32): A [m, k];
/// the all-gather's shard [n/tp, k] into D [n, m]; B [n, k] reduce-scattered into
/// [n/tp, m] or all-reduced into D.
struct OneOfEach {
    mem: Mem,
    bufs: Vec<DevPtr>,
    t: [Tensor; 5],
}

impl OneOfEach {
    fn new(tp: usize, (nc, k, m): (usize, usize, usize)) -> OneOfEach {
        let n = nc * tp;
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, tp, 2 * n * m * 4);
        let (pa, pb) = (
            mem.input("A", &values(1, m * k)),
            mem.input("B", &values(2, n * k)),
        );
        let pd = mem.alloc("D", n * m * 4);
        let t = [
            tensor(pa, &[m, k]),
            tensor(pb, &[nc, k]),
            tensor(pb, &[n, k]),
            tensor(pd, &[n, m]),
            tensor(pd, &[nc, m]),
        ];
        OneOfEach { mem, bufs, t }
    }
    fn ag(t: &[Tensor; 5]) -> AgArgs<'_> {
        AgArgs {
            g: gemm(&t[0], &t[1], &t[3]),
            b_copy: None,
            key_m: None,
        }
    }
    fn rs(t: &[Tensor; 5]) -> RsArgs<'_> {
        RsArgs {
            g: gemm(&t[0], &t[2], &t[4]).with_d(None),
            rs_output: &t[4],
        }
    }
    fn ar(t: &[Tensor; 5]) -> ArArgs<'_> {
        gemm(&t[0], &t[2], &t[3])
    }
    /// Plan rank 0's call with `plan_call` (the other ranks are not simulated).
    fn plan(&mut self, tp: usize, cfg: Cfg, plan_call: &mut dyn FnMut(&mut Planner) -> Result<()>) {
        let geometry = (
            2 * self.t[2].data.shape.dims[0],
            self.t[0].data.shape.dims[0],
        );
        let log = new_log(tp);
        rank_call(
            (tp, 0),
            geometry,
            cfg,
            &mut self.mem,
            &self.bufs,
            &log,
            plan_call,
        )
        .unwrap();
    }
}

#[test]
fn no_overlap_is_chosen_where_the_policy_says_so() {
    let (tp, nc, k, m) = (4, 4, 8, 16);
    let n = nc * tp;
    for f in FLAVOURS {
        for (pin, tuned, serial) in [
            (None, true, true),
            (Some(OVERLAP_OFF), false, true),
            (Some(OVERLAP_ON), true, false),
            (None, false, false),
        ] {
            let cfg = Cfg::new(f).with(|p| {
                p.no_overlap = tuned;
                p.pins.overlap = pin;
            });
            let mut ops = OneOfEach::new(tp, (nc, k, m));
            let rs_serial = match f {
                Flavour::PeerMemory => Algo::PipelinedRs { splits: 1 },
                Flavour::Messages => Algo::CollectiveRs { splits: 1 },
            };
            let want = [
                Algo::GatherThenGemm,
                rs_serial,
                rs_serial,
                Algo::ChunkedAr { splits: 1 },
            ];
            let t = ops.t.clone();
            let mut plan_call = |pl: &mut Planner| {
                let (ag, rs, ar) = (OneOfEach::ag(&t), OneOfEach::rs(&t), OneOfEach::ar(&t));
                let calls = [
                    algo::Call::Ag(&ag),
                    algo::Call::Rs(&rs),
                    algo::Call::RsP2p(&rs),
                    algo::Call::Ar(&ar),
                ];
                for (c, w) in calls.iter().zip(want) {
                    let a = pl.algo_of(c)?;
                    assert_eq!(a == w, serial, "{f:?} pin {pin:?} tuned {tuned}: {a}");
                }
                pl.split_ag(&ag)?;
                let gemms: Vec<&GemmDesc> = (pl.plan.steps.iter())
                    .filter_map(|s| match s {
                        plan::Step::Gemm { g, .. } => Some(g),
                        _ => None,
                    })
                    .collect();
                assert!(
                    !serial || (gemms.len() == 1 && gemms[0].n == n),
                    "{f:?}: {} GEMMs",
                    gemms.len()
                );
                Ok(())
            };
            ops.plan(tp, cfg, &mut plan_call);
        }
    }
}

/// Over a transport without peer memory its own kernels move the bytes (NCCL's run on
/// SMs): the chunked algorithms' GEMMs leave them `sms` SMs where the policy turns the
/// copy-engine puts off (the autotuner's margin candidates, NVTE_COMM_OVERLAP_USE_CE=0),
/// and take every SM otherwise or without the SM margin.
#[test]
fn gemms_leave_the_margin_to_a_transport_without_peer_memory() {
    let (tp, nc, k, m) = (4, 4, 8, 48); // m: three 16-column chunks of the RS
    for (use_ce, sm_margin, want) in [(true, true, 0), (false, true, 132 - 24), (false, false, 0)] {
        let cfg = Cfg::new(Flavour::Messages).with(|p| {
            p.comm.use_ce = use_ce;
            p.comm.sms = 24;
            p.comm.sm_margin = sm_margin;
            p.reduce = Reduction::Chunks;
        });
        let mut ops = OneOfEach::new(tp, (nc, k, m));
        let t = ops.t.clone();
        let mut plan_call = |pl: &mut Planner| {
            let (ag, rs, ar) = (OneOfEach::ag(&t), OneOfEach::rs(&t), OneOfEach::ar(&t));
            pl.split_ag(&ag)?;
            pl.split_rs(&rs)?;
            pl.split_ar(&ar)?;
            let sms: Vec<i32> = (pl.plan.steps.iter())
                .filter_map(|s| match s {
                    plan::Step::Gemm { g, .. } => Some(g.sm_count),
                    _ => None,
                })
                .collect();
            assert_eq!(sms.len(), tp + 3 + 3, "AG: one a chunk; RS, AR: 3 splits");
            assert!(
                sms.iter().all(|&s| s == want),
                "use_ce {use_ce} margin {sm_margin}: {sms:?}"
            );
            Ok(())
        };
        ops.plan(tp, cfg, &mut plan_call);
    }
}

/// An operation of the consecutive-calls check: its name, its entry point and the
/// policy it runs under.
#[derive(Clone, Copy)]
enum Entry {
    Ag,
    Rs,
    RsP2p,
    Ar,
}

/// The algorithms of each entry point, as the consecutive-calls check issues them.
fn sequence_cases(f: Flavour) -> Vec<(&'static str, Entry, Cfg)> {
    use super::policy::{AR_CHUNKED, RS_ACCUMULATE, RS_REDUCE};
    let ring = |sum| Cfg::new(f).with(|p| p.pins.rs_ring = Some(sum));
    vec![
        ("ag ring", Entry::Ag, Cfg::new(f)),
        ("ag fused", Entry::Ag, Cfg::fused(f, false)),
        (
            "ag serial",
            Entry::Ag,
            Cfg::new(f).with(|p| p.pins.overlap = Some(OVERLAP_OFF)),
        ),
        ("rs", Entry::Rs, Cfg::new(f)),
        ("rs ring", Entry::RsP2p, ring(RS_REDUCE)),
        ("rs ring accumulating", Entry::RsP2p, ring(RS_ACCUMULATE)),
        (
            "rs fused",
            Entry::RsP2p,
            Cfg::fused(f, false).with(|p| p.pins.rs_ring = Some(RS_REDUCE)),
        ),
        ("ar ring", Entry::Ar, ring(RS_REDUCE)),
        ("ar ring accumulating", Entry::Ar, ring(RS_ACCUMULATE)),
        (
            "ar chunked",
            Entry::Ar,
            Cfg::new(f).with(|p| {
                p.pins.ar_algo = Some(AR_CHUNKED);
                p.splits = 2;
            }),
        ),
    ]
}

/// Issue call number `call` of `entry` on every rank (fresh inputs and outputs, seeded by
/// the call) -> each output with the values it must end with.
fn issue_call(
    (tp, call): (usize, u64),
    entry: Entry,
    cfg: Cfg,
    mem: &mut Mem,
    bufs: &[DevPtr],
    log: &SharedLog<Dev>,
) -> std::result::Result<Vec<(DevPtr, Vec<f32>)>, String> {
    let (nc, k, m) = (4, 8, 48);
    let n = nc * tp;
    let cfg = Cfg { call, ..cfg };
    let seed = 1000 * call as usize;
    let p = partials_seeded(mem, tp, (n, k, m), seed);
    let shards: Vec<Vec<f32>> = (0..tp).map(|r| values(seed + 50 + r, nc * k)).collect();
    let gathered = shards.concat();
    let mut want = Vec::new();
    for (r, shard) in shards.iter().enumerate() {
        let (ta, tb) = (tensor(p.a[r].1, &[m, k]), tensor(p.b[r].1, &[n, k]));
        let plan: &mut dyn FnMut(&mut Planner) -> Result<()> = match entry {
            Entry::Ag => {
                let sh = mem.input(&format!("shard {call}.{r}"), shard);
                let d = mem.alloc(&format!("D {call}.{r}"), n * m * 4);
                want.push((d, matmul_nt(&gathered, &p.a[r].0, n, k, m)));
                let (tsh, td) = (tensor(sh, &[nc, k]), tensor(d, &[n, m]));
                &mut move |pl| {
                    let (g, b_copy, key_m) = (gemm(&ta, &tsh, &td), None, None);
                    pl.split_ag(&AgArgs { g, b_copy, key_m })
                }
            }
            Entry::Rs | Entry::RsP2p => {
                let o = mem.alloc(&format!("rs_output {call}.{r}"), nc * m * 4);
                want.push((o, p.sum[r * nc * m..(r + 1) * nc * m].to_vec()));
                let to = tensor(o, &[nc, m]);
                &mut move |pl| {
                    let args = RsArgs {
                        g: gemm(&ta, &tb, &to).with_d(None),
                        rs_output: &to,
                    };
                    match entry {
                        Entry::Rs => pl.split_rs(&args),
                        _ => pl.split_rs_p2p(&args),
                    }
                }
            }
            Entry::Ar => {
                let d = mem.alloc(&format!("D {call}.{r}"), n * m * 4);
                want.push((d, p.sum.clone()));
                let td = tensor(d, &[n, m]);
                &mut move |pl| pl.split_ar(&gemm(&ta, &tb, &td))
            }
        };
        rank_call((tp, r), (2 * n, m), cfg, mem, bufs, log, plan)?;
    }
    Ok(want)
}

/// Two calls back to back on the same buffers, every pair of algorithms and entry points
/// at tp 2-4 (each followed by the ring all-gather at tp 5-8), on both transports' fakes,
/// with a hardware queue per stream and with one per rank (`CUDA_DEVICE_MAX_CONNECTIONS=1`,
/// TE's and Megatron's setting: no step waits behind work its own signal needs): no race
/// between them (the second call writing a peer's memory, or its own, while a rank still
/// reads it for the first: the simulator's write-after-read check), and both results
/// right. (A fused all-gather once copied its shard into its buffer before the arrival
/// barrier, while peers could still read the partials of a reduce-scatter or all-reduce
/// there.)
#[test]
fn consecutive_calls_do_not_race() {
    for f in FLAVOURS {
        let cases = sequence_cases(f);
        for (x, ex, cx) in &cases {
            for tp in 2..=8 {
                let seconds: &[_] = if tp <= 4 { &cases } else { &cases[..1] };
                for (y, ey, cy) in seconds {
                    if let Err(e) = run_pair(tp, (*ex, *cx), (*ey, *cy)) {
                        panic!("{f:?} tp {tp}, {x} then {y}: {e}");
                    }
                }
            }
        }
    }
}

/// Two calls back to back on every rank of a group of `tp` (fresh buffers), simulated
/// (with a queue per stream and with one per rank), and both results checked.
fn run_pair(tp: usize, (ex, cx): (Entry, Cfg), (ey, cy): (Entry, Cfg)) -> Res {
    let n = 4 * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, 2 * n * 48 * 4);
    let log = new_log(tp);
    let w1 = issue_call((tp, 0), ex, cx, &mut mem, &bufs, &log)?;
    let w2 = issue_call((tp, 1), ey, cy, &mut mem, &bufs, &log)?;
    simulate(&log, &mut mem, &bufs)?;
    for (i, (o, w)) in w1.iter().chain(&w2).enumerate() {
        expect_once(&mem, *o, w, &format!("output {i}"))?;
    }
    Ok(())
}

/// The one-queue cases: the consecutive-calls algorithms, with row pieces and both
/// directions for the ring all-gather and three chunks for the chunked all-reduce.
fn one_queue_cases(f: Flavour) -> Vec<(&'static str, Entry, Cfg)> {
    use super::policy::AR_CHUNKED;
    let mut v: Vec<_> = sequence_cases(f)
        .into_iter()
        .filter(|c| c.0 != "ag serial" && c.0 != "ar chunked")
        .collect();
    v.push((
        "ag ring, 2 pieces",
        Entry::Ag,
        Cfg::new(f).with(|p| p.pieces = 2),
    ));
    v.push((
        "ag ring, bidirectional",
        Entry::Ag,
        Cfg::new(f).with(|p| p.direction = Direction::BothWays),
    ));
    v.push((
        "ar chunked, 3 chunks",
        Entry::Ar,
        Cfg::new(f).with(|p| {
            p.pins.ar_algo = Some(AR_CHUNKED);
            p.splits = 3;
        }),
    ));
    v
}

/// Per rank: the share of its transfers that ran beside one of its GEMMs.
fn beside_shares(ran: &[Vec<Ran>]) -> Vec<f64> {
    ran.iter()
        .map(|seq| {
            let t: Vec<bool> = seq
                .iter()
                .filter_map(|r| match r {
                    Ran::Transfer { beside_gemm } => Some(*beside_gemm),
                    Ran::Gemm => None,
                })
                .collect();
            t.iter().filter(|b| **b).count() as f64 / t.len().max(1) as f64
        })
        .collect()
}

/// With one hardware queue per rank (GEMMs and transfers of data take scheduler rounds,
/// `Sim::timed_runs`), the share of each rank's transfers that run beside one of its
/// GEMMs, at tp 2-6, at least:
/// - every all-gather (ring, with pieces, both ways, fused): all of them. Issued with the
///   whole ring first, none did;
/// - the chunked reduce-scatters and the chunked all-reduce over the collective: half
///   (every chunk's but the last's). Issued with every GEMM first, none did; with a
///   chunk's copy-out between its collective and the next GEMM, none over the collective;
/// - the ring reduce-scatter: half; the ring all-reduce: 0.3 (its closing all-gather
///   follows every GEMM). Each exchange's puts go before the next GEMM, its signal and
///   wait after it (`ExchangePart`); as one step, its signal held
///   the next GEMM until the put had ended, and none ran beside;
/// - the chunked all-reduce over peer memory: some (its two-shot scatter issues tp-1 puts
///   on one stream, the next GEMM behind them).
///
/// Not held to it here: the accumulating rings, and our fused reduce-scatter (its done
/// signals are modelled at the GEMM's end).
#[test]
fn one_hardware_queue_runs_transfers_beside_gemms() {
    for f in FLAVOURS {
        for (x, ex, cx) in one_queue_cases(f) {
            let least = match (x, f) {
                _ if x.starts_with("ag") => 1.0,
                ("rs", _) | ("ar chunked, 3 chunks", Flavour::Messages) => 0.5,
                ("ar chunked, 3 chunks", _) => 0.05,
                ("rs ring", _) => 0.5,
                ("ar ring", _) => 0.3,
                _ => continue,
            };
            for tp in 2..=6 {
                let n = 4 * tp;
                let mut mem = Mem::default();
                let bufs = buffers(&mut mem, tp, 2 * n * 48 * 4);
                let log = new_log(tp);
                issue_call((tp, 0), ex, cx, &mut mem, &bufs, &log).unwrap();
                let ran = simulate_one_queue(&log, &mut mem, &bufs).unwrap();
                for (r, share) in beside_shares(&ran).into_iter().enumerate() {
                    let seq: String = ran[r]
                        .iter()
                        .map(|e| match e {
                            Ran::Gemm => 'G',
                            Ran::Transfer { beside_gemm: true } => 'o',
                            Ran::Transfer { beside_gemm: false } => 't',
                        })
                        .collect();
                    assert!(
                        share >= least,
                        "one queue, {f:?} tp {tp} rank {r}, {x}: {share:.2} of the transfers beside a GEMM, < {least} ({seq}: G a GEMM starts, o / t a transfer ends beside one / not)"
                    );
                }
            }
        }
    }
}

#[test]
fn bulk_collectives() {
    all("bulk all-gather", |tp, f| {
        check_bulk(tp, Cfg::new(f), BulkKind::AllGather)
    });
    all("bulk reduce-scatter", |tp, f| {
        check_bulk(tp, Cfg::new(f), BulkKind::ReduceScatter)
    });
}

/// A new algorithm is a variant of `Algo`, its planner method and its tests: the
/// test-only `Algo::Noop` (the call's barrier and end, nothing between) is planned through
/// `Planner::plan` as every real algorithm is, recorded in the plan, and runs on the fake
/// transport at tp 1..8 on both flavours without a deadlock or a byte of any buffer
/// written.
#[test]
fn a_new_algorithm_is_a_variant_and_its_planner_method() {
    all("noop", |tp, f| {
        let (rows, cols) = (2 * tp, 4);
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, tp, rows * cols * 4);
        let g = partials(&mut mem, tp, (4, 8, 4));
        let d = mem.alloc("D", 16 * 4);
        let mut plan_call = |pl: &mut Planner, r: usize| {
            let (ta, tb, td) = (
                tensor(g.a[r].1, &[4, 8]),
                tensor(g.b[r].1, &[4, 8]),
                tensor(d, &[4, 4]),
            );
            let args = BulkArgs {
                kind: BulkKind::AllGather,
                gemm: gemm(&ta, &tb, &td),
                buffer_view: None,
                rs_output: None,
            };
            pl.plan(Algo::Noop, &algo::Call::Bulk(&args))?;
            assert_eq!(pl.plan.algo, Some(Algo::Noop));
            Ok(())
        };
        run_group(
            tp,
            (rows, cols),
            Cfg::new(f),
            &mut mem,
            &bufs,
            &mut plan_call,
        )?;
        for (r, &b) in bufs.iter().enumerate() {
            let (i, o) = mem.find(b, rows * cols * 4)?;
            if mem.allocs[i].writes[o..o + rows * cols * 4]
                .iter()
                .any(|&w| w != 0)
            {
                return Err(format!("rank {r}: the no-op call wrote its buffer"));
            }
        }
        Ok(())
    });
}

/// The planner chooses each call's algorithm from the policy, the transport and the call
/// (`Planner::algo_of`), records it in the plan, and refuses an algorithm of another
/// operation (an error, not a panic).
#[test]
fn the_planner_plans_the_algorithm_the_policy_chooses() {
    let (tp, nc, k, m) = (4, 4, 8, 32);
    let n = nc * tp;
    for (f, ring, want_ring) in [
        (Flavour::PeerMemory, true, true),
        (Flavour::PeerMemory, false, false),
        (Flavour::Messages, true, false),
    ] {
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, tp, 2 * n * m * 4);
        let p = partials(&mut mem, tp, (n, k, m));
        let ds: Vec<DevPtr> = (0..tp)
            .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
            .collect();
        let cfg = Cfg::new(f).with(|p| {
            p.reduce = match ring {
                true => Reduction::Ring { sum: Sum::Closing },
                false => Reduction::Chunks,
            }
        });
        let mut plan_call = |pl: &mut Planner, r: usize| {
            let (ta, tb, td) = (
                tensor(p.a[r].1, &[m, k]),
                tensor(p.b[r].1, &[n, k]),
                tensor(ds[r], &[n, m]),
            );
            let args: ArArgs = gemm(&ta, &tb, &td);
            let call = algo::Call::Ar(&args);
            let a = pl.algo_of(&call)?;
            assert_eq!(
                matches!(a, Algo::RingAr(_)),
                want_ring,
                "{f:?} ring {ring}: {a}"
            );
            assert!(
                want_ring || matches!(a, Algo::ChunkedAr { splits: 3 }),
                "{a}"
            );
            let wrong = Algo::RingAg {
                bidirectional: false,
                pieces: 1,
            };
            let e = pl.plan(wrong, &call).unwrap_err();
            assert!(e.msg.contains("cannot run a split_ar call"), "{}", e.msg);
            pl.plan.steps.clear();
            pl.plan(a, &call)?;
            assert_eq!(pl.plan.algo, Some(a));
            Ok(())
        };
        run_group(tp, (2 * n, m), cfg, &mut mem, &bufs, &mut plan_call).unwrap();
        for (r, &d) in ds.iter().enumerate() {
            expect_once(&mem, d, &p.sum, &format!("rank {r}: D")).unwrap();
        }
    }
}

/// The checker itself: a wait nobody signals deadlocks, a read racing its write and a
/// put out of the buffer are reported.
#[test]
fn the_checker_finds_deadlocks_races_and_overruns() {
    let cfg = Cfg::new(Flavour::PeerMemory);
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, 2, 64);
    // Rank 0 waits for a signal rank 1 never sends.
    let mut lonely = |p: &mut Planner, r: usize| {
        p.begin(Op::BulkAg, false, &[], None);
        if r == 0 {
            let info = crate::transport::WaitInfo { op: 0, step: 0 };
            p.wait(&[1], (p.e.slots.bulk, 1), Lane::Comm(0), info)?;
        }
        p.finish();
        Ok(())
    };
    let e = run_group(2, (4, 4), cfg, &mut mem, &bufs, &mut lonely).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
    // Rank 1 reads its buffer, where rank 0 puts with no flag between.
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, 2, 64);
    let src = mem.input("src", &[1.0; 16]);
    let out = mem.alloc("out", 64);
    let mut racy = |p: &mut Planner, r: usize| {
        p.begin(Op::BulkAg, false, &[], None);
        if r == 0 {
            p.put(1, 0, src, 64, Lane::Comm(0))?;
        } else {
            p.copy(out, bufs[1], 64, Lane::Comm(0));
        }
        p.finish();
        Ok(())
    };
    let e = run_group(2, (4, 4), cfg, &mut mem, &bufs, &mut racy).unwrap_err();
    assert!(e.contains("race") || e.contains("nothing wrote"), "{e}");
    // A put past the end of the peer's buffer.
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, 2, 64);
    let src = mem.input("src", &[1.0; 16]);
    let mut over = |p: &mut Planner, r: usize| {
        p.begin(Op::BulkAg, false, &[], None);
        if r == 0 {
            p.put(1, 32, src, 64, Lane::Comm(0))?;
        }
        p.finish();
        Ok(())
    };
    let e = run_group(2, (4, 4), cfg, &mut mem, &bufs, &mut over).unwrap_err();
    assert!(e.contains("out of bounds"), "{e}");
    // Rank 0 signals, then loads data that rank 1 overwrites once signalled: the load is
    // not ordered before the write (a write-after-read race).
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, 2, 64);
    let (data, src) = (mem.input("data", &[1.0; 16]), mem.input("src", &[2.0; 16]));
    let out = mem.alloc("out", 64);
    let mut overwrite = |p: &mut Planner, r: usize| {
        p.begin(Op::BulkAg, false, &[], None);
        let (slot, info) = (
            p.e.slots.bulk,
            crate::transport::WaitInfo { op: 0, step: 0 },
        );
        if r == 0 {
            p.signal(&[1], slot, 1, Lane::Comm(0))?;
            p.copy(out, data, 64, Lane::Comm(0));
        } else {
            p.wait(&[0], (slot, 1), Lane::Comm(0), info)?;
            p.copy(data, src, 64, Lane::Comm(0));
        }
        p.finish();
        Ok(())
    };
    let e = run_group(2, (4, 4), cfg, &mut mem, &bufs, &mut overwrite).unwrap_err();
    assert!(e.contains("write-after-read race"), "{e}");
    // A comm stream waits (cuStreamWaitValue32) for a flag that a compute stream writes,
    // but the wait is issued first: fine on separate hardware queues, a deadlock on one.
    let build = || {
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, 2, 64);
        let flags = [mem.input("flag 0", &[0.0]), mem.input("flag 1", &[0.0])];
        let log = new_log(2);
        for (r, &flag) in flags.iter().enumerate() {
            rank_call((2, r), (4, 4), cfg, &mut mem, &bufs, &log, &mut |p| {
                p.begin(Op::BulkAg, false, &[], None);
                p.wait_flag(flag, 1, Lane::Comm(0));
                p.write_flag(flag, 1, Lane::Compute(0));
                p.finish();
                Ok(())
            })
            .unwrap();
        }
        (mem, bufs, log)
    };
    let (mut mem, bufs, log) = build();
    simulate_streams(&log, &mut mem, &bufs).unwrap();
    let (mut mem, bufs, log) = build();
    let e = simulate_one_queue(&log, &mut mem, &bufs).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
}

/// A capability the transport lacks is a planning error, never a panic.
#[test]
fn a_missing_capability_is_an_error() {
    let cfg = Cfg::new(Flavour::Messages);
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, 2, 64);
    let src = mem.input("src", &[1.0; 16]);
    let mut put = |p: &mut Planner, _r: usize| {
        p.begin(Op::BulkAg, false, &[], None);
        p.put(1, 0, src, 64, Lane::Comm(0))?;
        p.finish();
        Ok(())
    };
    let e = run_group(2, (4, 4), cfg, &mut mem, &bufs, &mut put).unwrap_err();
    assert!(e.contains("peer memory"), "{e}");
}

/// A new transport is one file and a registry line: the fake is made through the
/// registry by name, and auto never picks it.
#[test]
fn the_fake_transport_is_registered() {
    let e = crate::transport::entry("fake").expect("registered");
    let p = crate::transport::Placement {
        one_node: true,
        away: None,
    };
    assert!(!(e.auto)(&p));
    assert_eq!(
        crate::transport::REGISTRY
            .iter()
            .filter(|e| (e.auto)(&p))
            .map(|e| e.name)
            .next(),
        Some("ipc")
    );
    let far = crate::transport::Placement {
        one_node: false,
        away: Some((1, "b".into(), "a".into())),
    };
    assert_eq!(
        crate::transport::REGISTRY
            .iter()
            .find(|e| (e.auto)(&far))
            .map(|e| e.name),
        Some("nccl")
    );
}

// ------------------------------------------------------------ block-scaled FP8 inputs

/// An e4m3 byte's value (normal and subnormal; the tests' bytes are never NaN).
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, f) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
    sign * if e == 0 {
        f / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + f / 8.0) * 2f32.powi(e - 7)
    }
}

/// The e4m3 byte of a small integer in -2..=2 (`values`' range).
fn e4m3_of(x: f32) -> u8 {
    let mag = match x.abs() as u32 {
        0 => 0x00,
        1 => 0x38,
        2 => 0x40,
        v => panic!("{v} is outside the tests' range"),
    };
    if x < 0.0 { mag | 0x80 } else { mag }
}

/// A block-scaled e4m3 operand [rows, k] (rowwise, GEMM-ready scales of `mode`) on the
/// host: its tensor and its dequantized values.
pub(crate) struct BlockInput {
    pub(crate) t: Tensor,
    pub(crate) deq: Vec<f32>,
}

fn block_input(
    mem: &mut Mem,
    name: &str,
    mode: crate::tensor::BlockMode,
    (rows, k): (usize, usize),
    seed: usize,
) -> BlockInput {
    use crate::tensor::{BlockMode, scale_shape};
    let q = values(seed, rows * k);
    let bytes: Vec<u8> = q.iter().map(|&x| e4m3_of(x)).collect();
    let sshape = match mode {
        BlockMode::OneD => scale_shape::one_d_rowwise_gemm_ready(rows, k),
        BlockMode::TwoD => scale_shape::two_d_rowwise(rows, k),
    };
    // Powers of two, different per block (sums stay exact in f32).
    let scales: Vec<f32> = (0..sshape[0] * sshape[1])
        .map(|i| [0.5f32, 1.0, 2.0, 4.0][(i * 7 + seed) % 4])
        .collect();
    let pd = mem.alloc(&format!("{name}.data"), bytes.len());
    {
        let a = mem.allocs.last_mut().unwrap();
        a.data.copy_from_slice(&bytes);
        a.writer.fill(INPUT);
    }
    let ps = mem.input(&format!("{name}.scale_inv"), &scales);
    let deq = (0..rows * k)
        .map(|e| {
            let (r, l) = (e / k, e % k);
            let si = match mode {
                BlockMode::OneD => (l / 128) * sshape[1] + r,
                BlockMode::TwoD => (r / 128) * sshape[1] + l / 128,
            };
            q[e] * scales[si]
        })
        .collect();
    let t = Tensor {
        scaling_mode: mode.scaling_mode(),
        data: Buffer::new(pd, DType::E4M3, Shape::new(&[rows, k]).unwrap()).unwrap(),
        scale_inv: Buffer::new(ps, DType::F32, Shape::new(&sshape).unwrap()).unwrap(),
        ..Default::default()
    };
    BlockInput { t, deq }
}

/// Every rank's block-scaled A_r [m, k] (blocks `ma`) and B_r [n, k] (`mb`), and the sum
/// of the dequantized partials B_r A_r^T.
pub(crate) fn block_partials(
    mem: &mut Mem,
    tp: usize,
    (n, k, m): (usize, usize, usize),
    [ma, mb]: [crate::tensor::BlockMode; 2],
) -> (Vec<(BlockInput, BlockInput)>, Vec<f32>) {
    let mut sum = vec![0f32; n * m];
    let ops: Vec<_> = (0..tp)
        .map(|r| {
            let a = block_input(mem, &format!("A{r}"), ma, (m, k), 200 + r);
            let b = block_input(mem, &format!("B{r}"), mb, (n, k), 300 + r);
            for (s, x) in sum.iter_mut().zip(matmul_nt(&b.deq, &a.deq, n, k, m)) {
                *s += x;
            }
            (a, b)
        })
        .collect();
    (ops, sum)
}

/// The block cases: a 2D-scaled weight A with a 1D-scaled activation B (A cut by whole
/// 128-row tiles), both 1D (the GEMM whole), a 1D A with a 2D B.
fn block_modes() -> [[crate::tensor::BlockMode; 2]; 3] {
    use crate::tensor::BlockMode::{OneD, TwoD};
    [[TwoD, OneD], [OneD, OneD], [OneD, TwoD]]
}

/// GEMM + reduce-scatter with block-scaled inputs (m = 136: two 128-row tiles of A, k =
/// 144: two k blocks, the second partial).
fn check_block_rs(tp: usize, cfg: Cfg, ring: bool, modes: [crate::tensor::BlockMode; 2]) -> Res {
    let (nc, k, m) = (8, 144, 136);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, n * m * 4);
    let (ops, sum) = block_partials(&mut mem, tp, (n, k, m), modes);
    let outs: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("rs_output{r}"), nc * m * 4))
        .collect();
    let mut plan_call = |pl: &mut Planner, r: usize| {
        let to = tensor(outs[r], &[nc, m]);
        let args = RsArgs {
            g: gemm(&ops[r].0.t, &ops[r].1.t, &to).with_d(None),
            rs_output: &to,
        };
        if ring {
            pl.split_rs_p2p(&args)
        } else {
            pl.split_rs(&args)
        }
    };
    run_group(tp, (n, m), cfg, &mut mem, &bufs, &mut plan_call)?;
    for (r, &o) in outs.iter().enumerate() {
        let want = &sum[r * nc * m..(r + 1) * nc * m];
        expect_once(&mem, o, want, &format!("rank {r}: rs_output"))?;
    }
    Ok(())
}

/// GEMM + all-reduce with block-scaled inputs: every rank gets the whole sum.
fn check_block_ar(tp: usize, cfg: Cfg, modes: [crate::tensor::BlockMode; 2]) -> Res {
    let (nc, k, m) = (8, 144, 136);
    let n = nc * tp;
    let mut mem = Mem::default();
    let bufs = buffers(&mut mem, tp, 2 * n * m * 4);
    let (ops, sum) = block_partials(&mut mem, tp, (n, k, m), modes);
    let ds: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
        .collect();
    let mut plan_call = |pl: &mut Planner, r: usize| {
        let td = tensor(ds[r], &[n, m]);
        let args: ArArgs = gemm(&ops[r].0.t, &ops[r].1.t, &td);
        pl.split_ar(&args)
    };
    run_group(tp, (2 * n, m), cfg, &mut mem, &bufs, &mut plan_call)?;
    for (r, &d) in ds.iter().enumerate() {
        expect_once(&mem, d, &sum, &format!("rank {r}: D"))?;
    }
    Ok(())
}

#[test]
fn block_scaled_reduce_scatter_and_all_reduce() {
    for modes in block_modes() {
        let name = format!("{modes:?}");
        all(&format!("split_rs (block {name})"), |tp, f| {
            check_block_rs(tp, Cfg::new(f), false, modes)
        });
        // The ring entry point takes the block-aware algorithm too (never the ring).
        all(&format!("split_rs_p2p (block {name})"), |tp, f| {
            check_block_rs(tp, Cfg::new(f), true, modes)
        });
        all(&format!("split_rs (block {name}, 1 split)"), |tp, f| {
            check_block_rs(tp, Cfg::new(f).with(|p| p.splits = 1), false, modes)
        });
        all(&format!("split_ar (block {name})"), |tp, f| {
            check_block_ar(tp, Cfg::new(f), modes)
        });
    }
}

/// Without peer memory, block-scaled inputs take the transport's reduce-scatter
/// collective, which sums in the buffer's type into an output of that type only: an FP8
/// rs_output (with its scale) or an accumulating call is refused while planning, before
/// anything is enqueued, instead of a copy of the buffer's element size into it.
#[test]
fn block_scaled_collective_reduce_scatter_takes_plain_sums_only() {
    let (tp, nc, k, m) = (4, 8, 144, 136);
    let n = nc * tp;
    for (fp8_out, accumulate) in [(true, false), (false, true)] {
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, tp, n * m * 4);
        let (ops, _) = block_partials(&mut mem, tp, (n, k, m), block_modes()[0]);
        let out = mem.alloc("rs_output", nc * m * 4);
        let scale = mem.input("rs_output.scale", &[1.0]);
        let mut to = tensor(out, &[nc, m]);
        if fp8_out {
            to.data = Buffer::new(out, DType::E4M3, Shape::new(&[nc, m]).unwrap()).unwrap();
            to.scale = Buffer::new(scale, DType::F32, Shape::new(&[1]).unwrap()).unwrap();
        }
        for ring in [false, true] {
            let mut plan_call = |pl: &mut Planner| {
                let mut g = gemm(&ops[0].0.t, &ops[0].1.t, &to).with_d(None);
                g.accumulate = accumulate;
                let args = RsArgs { g, rs_output: &to };
                let r = if ring {
                    pl.split_rs_p2p(&args)
                } else {
                    pl.split_rs(&args)
                };
                let e = r.expect_err("planned");
                assert!(e.msg.contains("reduce-scatter collective"), "{}", e.msg);
                assert!(pl.plan.steps.is_empty(), "steps planned before the refusal");
                Ok(())
            };
            let log = new_log(tp);
            let cfg = Cfg::new(Flavour::Messages);
            rank_call((tp, 0), (n, m), cfg, &mut mem, &bufs, &log, &mut plan_call).unwrap();
        }
    }
}

#[test]
fn block_scaled_chunks_cut_whole_tiles() {
    use super::rs::block_column_bounds;
    use crate::tensor::BlockMode::{OneD, TwoD};
    assert_eq!(block_column_bounds(136, 3, TwoD).to_vec(), [0, 128, 136]);
    assert_eq!(
        block_column_bounds(1024, 3, TwoD).to_vec(),
        [0, 256, 640, 1024]
    );
    assert_eq!(block_column_bounds(1024, 3, OneD).to_vec(), [0, 1024]);
    assert_eq!(block_column_bounds(100, 4, TwoD).to_vec(), [0, 100]);
}

#[test]
fn block_scaled_inputs_never_take_the_rings() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    // The rings cut the GEMM along n (B's rows, whose 1D scales are columns): planned
    // explicitly with block inputs, they refuse instead of reading the wrong scales.
    for f in FLAVOURS {
        let tp = 2;
        let (n, k, m) = (16, 144, 136);
        let mut mem = Mem::default();
        let bufs = buffers(&mut mem, tp, 2 * n * m * 4);
        let (ops, _) = block_partials(&mut mem, tp, (n, k, m), [TwoD, OneD]);
        let outs: Vec<DevPtr> = (0..tp)
            .map(|r| mem.alloc(&format!("out{r}"), n * m * 4))
            .collect();
        let mut ring_rs = |pl: &mut Planner, r: usize| {
            let to = tensor(outs[r], &[n / tp, m]);
            let args = RsArgs {
                g: gemm(&ops[r].0.t, &ops[r].1.t, &to).with_d(None),
                rs_output: &to,
            };
            let ring = pl.ring_params();
            pl.plan(Algo::RingRs(ring), &algo::Call::RsP2p(&args))
        };
        let e = run_group(tp, (n, m), Cfg::new(f), &mut mem, &bufs, &mut ring_rs)
            .expect_err("the ring reduce-scatter must refuse block inputs");
        assert!(e.contains("ring reduce-scatter"), "{f:?}: {e}");
        let mut ring_ar = |pl: &mut Planner, r: usize| {
            let td = tensor(outs[r], &[n, m]);
            let args: ArArgs = gemm(&ops[r].0.t, &ops[r].1.t, &td);
            let ring = pl.ring_params();
            pl.plan(Algo::RingAr(ring), &algo::Call::Ar(&args))
        };
        let e = run_group(tp, (2 * n, m), Cfg::new(f), &mut mem, &bufs, &mut ring_ar)
            .expect_err("the ring all-reduce must refuse block inputs");
        assert!(e.contains("ring reduce-scatter"), "{f:?}: {e}");
    }
}

/// All-gather + GEMM with block-scaled inputs: every rank's e4m3 shard B_r [8, 144] (1D
/// or 2D scales) and its own A_r [136, 144] (two 128-row tiles, two k blocks, the second
/// partial); D on every rank is the gathered, dequantized B times A_r^T, and every
/// rank's buffer holds every chunk's data and, in its slot, that chunk's scales. The
/// simulation fails a GEMM that reads a slot before the step that fills it.
fn check_block_ag(
    tp: usize,
    cfg: Cfg,
    modes: [crate::tensor::BlockMode; 2],
    plan_with: &dyn Fn(&mut Planner, &AgArgs) -> Result<()>,
) -> Res {
    check_block_ag_copy(tp, cfg, modes, plan_with, (8, false))
}

/// [`check_block_ag`] with shards of `nc` rows and, with `copy`, a B_copy on every rank
/// (B's scaling mode, GEMM-ready scales of all of B), which must hold all of B: the
/// gathered data, dequantized by its own scales to the shards' values.
fn check_block_ag_copy(
    tp: usize,
    cfg: Cfg,
    modes: [crate::tensor::BlockMode; 2],
    plan_with: &dyn Fn(&mut Planner, &AgArgs) -> Result<()>,
    (nc, copy): (usize, bool),
) -> Res {
    let (k, m) = (144, 136);
    let n = nc * tp;
    let mut mem = Mem::default();
    let ops: Vec<_> = (0..tp)
        .map(|r| {
            let a = block_input(&mut mem, &format!("A{r}"), modes[0], (m, k), 200 + r);
            let b = block_input(&mut mem, &format!("B{r}"), modes[1], (nc, k), 300 + r);
            (a, b)
        })
        .collect();
    let sbytes = ops[0].1.t.scale_inv.bytes();
    let (base, slot, need) = super::ag::ag_block_layout(n * k, sbytes, tp);
    let geometry = (need.div_ceil(256), 256);
    let bufs = buffers(&mut mem, tp, geometry.0 * geometry.1);
    let ds: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
        .collect();
    let cfg = cfg.with_dtype(DType::E4M3);
    let copies: Vec<Tensor> = (0..tp * copy as usize)
        .map(|r| block_copy(&mut mem, r, modes[1], (n, k)))
        .collect();
    let mut plan_call = |p: &mut Planner, r: usize| {
        let td = tensor(ds[r], &[n, m]);
        let args = AgArgs {
            g: gemm(&ops[r].0.t, &ops[r].1.t, &td),
            b_copy: copies.get(r),
            key_m: None,
        };
        plan_with(p, &args)
    };
    run_group(tp, geometry, cfg, &mut mem, &bufs, &mut plan_call)?;
    let gathered: Vec<f32> = ops.iter().flat_map(|(_, b)| b.deq.clone()).collect();
    for (r, t) in copies.iter().enumerate() {
        expect_block_values(&mem, t, &gathered, &format!("rank {r}: B_copy"))?;
    }
    for (r, &d) in ds.iter().enumerate() {
        let want = matmul_nt(&gathered, &ops[r].0.deq, n, k, m);
        expect_once(&mem, d, &want, &format!("rank {r}: D"))?;
        for (c, (_, b)) in ops.iter().enumerate() {
            let (i, o) = mem.find(b.t.data.ptr, nc * k)?;
            let (j, p) = mem.find(bufs[r] + c * nc * k, nc * k)?;
            if mem.allocs[i].data[o..o + nc * k] != mem.allocs[j].data[p..p + nc * k] {
                return Err(format!(
                    "rank {r}: the buffer's chunk {c} is not B{c}'s data"
                ));
            }
            let (i, o) = mem.find(b.t.scale_inv.ptr, sbytes)?;
            let (j, p) = mem.find(bufs[r] + base + c * slot, sbytes)?;
            if mem.allocs[i].data[o..o + sbytes] != mem.allocs[j].data[p..p + sbytes] {
                return Err(format!("rank {r}: scale slot {c} is not B{c}'s scales"));
            }
        }
    }
    Ok(())
}

#[test]
fn block_scaled_all_gather() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    // (2D x 1D: the weight 2D, the activation 1D; 1D x 1D; 1D x 2D)
    for modes in [[TwoD, OneD], [OneD, OneD], [OneD, TwoD]] {
        let name = format!("{modes:?}");
        let split = |p: &mut Planner, x: &AgArgs| p.split_ag(x);
        all(&format!("split_ag (block {name})"), |tp, f| {
            check_block_ag(tp, Cfg::new(f), modes, &split)
        });
        // Pieces asked for: each chunk whole all the same (its scales are one matrix).
        all(
            &format!("split_ag (block {name}, both ways, 2 pieces)"),
            |tp, f| {
                let cfg = Cfg::new(f).with(|p| {
                    p.direction = Direction::BothWays;
                    p.pieces = 2;
                });
                check_block_ag(tp, cfg, modes, &split)
            },
        );
        // The fused policy plans the ring (our fused GEMM takes no block scales) ...
        all(
            &format!("split_ag (block {name}, fused policy)"),
            |tp, f| {
                let chosen = |p: &mut Planner, x: &AgArgs| {
                    let algo = p.algo_of(&algo::Call::Ag(x))?;
                    if !matches!(algo, Algo::RingAg { .. }) {
                        return Err(crate::error::Error::internal(format!(
                            "block inputs planned {algo}"
                        )));
                    }
                    p.split_ag(x)
                };
                check_block_ag(tp, Cfg::fused(f, false), modes, &chosen)
            },
        );
        // ... and the fused all-gather planned explicitly runs cuBLASLt GEMMs per chunk.
        all(&format!("fused_ag (block {name}, planned)"), |tp, f| {
            check_block_ag(tp, Cfg::fused(f, false), modes, &plan_fused_ag)
        });
    }
}

/// The fused all-gather planned explicitly (4 K-slice pieces), whatever the policy says.
fn plan_fused_ag(p: &mut Planner, x: &AgArgs) -> Result<()> {
    let algo = Algo::FusedAg {
        pieces: 4,
        k_slices: true,
        tiles: Tiles::Rule,
    };
    p.plan(algo, &algo::Call::Ag(x))
}

/// An unwritten B_copy of block-scaled B [n, k] for rank `r`: e4m3 data and f32 scales of
/// the GEMM-ready shape of `mode`.
pub(crate) fn block_copy(
    mem: &mut Mem,
    r: usize,
    mode: crate::tensor::BlockMode,
    (n, k): (usize, usize),
) -> Tensor {
    let sshape = crate::gemm::block::gemm_ready_scale_shape(mode, n, k);
    let pd = mem.alloc(&format!("B_copy{r}.data"), n * k);
    let ps = mem.alloc(&format!("B_copy{r}.scale_inv"), 4 * sshape[0] * sshape[1]);
    Tensor {
        scaling_mode: mode.scaling_mode(),
        data: Buffer::new(pd, DType::E4M3, Shape::new(&[n, k]).unwrap()).unwrap(),
        scale_inv: Buffer::new(ps, DType::F32, Shape::new(&sshape).unwrap()).unwrap(),
        ..Default::default()
    }
}

/// Block-scaled e4m3 `t` [n, k] (rowwise, GEMM-ready scales), dequantized, equals `want`.
pub(crate) fn expect_block_values(mem: &Mem, t: &Tensor, want: &[f32], what: &str) -> Res {
    use crate::tensor::BlockMode;
    let [n, k] = [t.data.shape.as_slice()[0], t.data.shape.as_slice()[1]];
    let (i, o) = mem.find(t.data.ptr, n * k)?;
    let (j, p) = mem.find(t.scale_inv.ptr, t.scale_inv.bytes())?;
    let bytes = &mem.allocs[i].data[o..o + n * k];
    let scales: Vec<f32> = mem.allocs[j].data[p..p + t.scale_inv.bytes()]
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let cols = t.scale_inv.shape.as_slice()[1];
    for (e, &w) in want.iter().enumerate().take(n * k) {
        let (row, l) = (e / k, e % k);
        let si = match t.block_mode() {
            Some(BlockMode::OneD) => (l / 128) * cols + row,
            _ => (row / 128) * cols + l / 128,
        };
        let got = e4m3(bytes[e]) * scales[si];
        if got != w {
            return Err(format!("{what}: element ({row}, {l}) is {got}, not {w}"));
        }
    }
    Ok(())
}

/// All-gather + GEMM with block-scaled inputs and a B_copy on every rank: it holds all of
/// B (data and GEMM-ready scales) after the call, 1D-scaled B with shards of 8 rows,
/// 2D-scaled B with shards of 128 (whole tiles), by the ring and by the fused all-gather
/// planned explicitly; 2D-scaled shards of 8 rows at tp > 1 are refused (B_copy's scales
/// are the tiles of all of B), at tp 1 copied whole.
#[test]
fn block_scaled_all_gather_fills_b_copy() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    let split = |p: &mut Planner, x: &AgArgs| p.split_ag(x);
    for (modes, nc) in [([TwoD, OneD], 8), ([OneD, OneD], 8), ([OneD, TwoD], 128)] {
        all(&format!("split_ag (block {modes:?}, B_copy)"), |tp, f| {
            check_block_ag_copy(tp, Cfg::new(f), modes, &split, (nc, true))
        });
        all(
            &format!("fused_ag (block {modes:?}, B_copy, planned)"),
            |tp, f| {
                check_block_ag_copy(tp, Cfg::fused(f, false), modes, &plan_fused_ag, (nc, true))
            },
        );
    }
    all(
        "split_ag (block 2D B of 8 rows a rank, B_copy)",
        |tp, f| match check_block_ag_copy(tp, Cfg::new(f), [OneD, TwoD], &split, (8, true)) {
            Ok(()) if tp == 1 => Ok(()),
            Err(e) if tp > 1 && e.contains("whole 128-row tiles") => Ok(()),
            other => Err(format!("tp {tp}: {other:?}")),
        },
    );
}

/// All-gather + GEMM with block-scaled inputs: a pre_gelu_out (the DGELU epilogue's
/// input, read by every chunk's GEMM) that is not [n, m] like D is refused before
/// anything is planned (a per-rank [n/tp, m] would be read past its end).
#[test]
fn block_scaled_all_gather_checks_pre_gelu_out() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    let (tp, nc, k, m) = (2, 8, 144, 136);
    let n = nc * tp;
    let mut mem = Mem::default();
    let ops: Vec<_> = (0..tp)
        .map(|r| {
            let a = block_input(&mut mem, &format!("A{r}"), TwoD, (m, k), 200 + r);
            let b = block_input(&mut mem, &format!("B{r}"), OneD, (nc, k), 300 + r);
            (a, b)
        })
        .collect();
    let bufs = buffers(&mut mem, tp, 64 * 256);
    let ds: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("D{r}"), n * m * 4))
        .collect();
    let pre: Vec<DevPtr> = (0..tp)
        .map(|r| mem.alloc(&format!("P{r}"), nc * m * 2))
        .collect();
    let cfg = Cfg::new(Flavour::PeerMemory).with_dtype(DType::E4M3);
    let mut plan_call = |p: &mut Planner, r: usize| {
        let td = tensor(ds[r], &[n, m]);
        let mut pre_r = tensor(pre[r], &[nc, m]);
        pre_r.data.dtype = DType::BF16;
        let args = AgArgs {
            g: TeGemm {
                pre_gelu_out: Some(&pre_r),
                grad: true,
                ..gemm(&ops[r].0.t, &ops[r].1.t, &td)
            },
            b_copy: None,
            key_m: None,
        };
        p.split_ag(&args)
    };
    let e = run_group(tp, (64, 256), cfg, &mut mem, &bufs, &mut plan_call)
        .expect_err("a per-rank pre_gelu_out must be refused");
    assert!(e.contains("pre_gelu_out") && e.contains("[n, m]"), "{e}");
}
