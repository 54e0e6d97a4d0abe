//! The autotuner of the comm-GEMM API (`NVTE_COMM_TUNE=0|1|force`, default 1): on the
//! first eager call of each (operation, dtype, m, n, k, tp, transport) with algo Default,
//! the context runs the call with each candidate policy (`overlap::Policy`: the context's,
//! with other per-call choices: algorithm, GEMM splits, copy-engine vs SM puts, comm SMs,
//! ring direction, all-gather pieces, the accumulating ring and its pieces, the fused
//! algorithms and their tiles), 1 warm-up and 3
//! timed runs each, in `ROUNDS` interleaved rounds, and keeps the fastest (median of its
//! rounds) by the slowest rank when it beats the defaults by `MARGIN`: every rank's times
//! are gathered through the context's bootstrap, so all ranks pick the same (the rank-0
//! decision, made everywhere from the same data). At most `MAX_KEYS` keys per context. The call then runs with that choice, as do later calls of that
//! key. Choices are cached on disk (the kernel cache's folder; one file per device model,
//! SM count, driver, cuBLASLt and library version) and agreed across ranks before use: a
//! key runs tuned from the cache only when every rank has the same entry.
//!
//! Bounds: the candidates run within `NVTE_COMM_TUNE_BUDGET_MS` (default 3000) per key,
//! counted from the first candidate's slowest rank (so every rank stops at the same one).
//! Not tuned: tp 1, calls captured into a graph (they run the key's choice if it was
//! tuned eagerly before, else the defaults), calls that accumulate into D, explicit algos.
//! `force` ignores (and rewrites) the disk cache. Every rank must use the same mode.
//!
//! Candidate generation, the encoding and the pick are pure functions tested here.
use crate::error::{Error, Result};
use crate::overlap::policy::{Direction, Reduction, Sum, Tiles};
use crate::overlap::{Pins, Policy};
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Off,
    On,
    Force,
}

/// NVTE_COMM_TUNE: 0 / 1 / force (default 1).
pub fn mode() -> Result<Mode> {
    if let Some(i) = crate::env::TUNE.get()? {
        return Ok([Mode::Off, Mode::On, Mode::Force][i]);
    }
    Ok(Mode::On)
}

/// NVTE_COMM_TUNE_BUDGET_MS: time for the candidates of one key (default 3000).
pub fn budget_ms() -> Result<f64> {
    Ok(crate::env::TUNE_BUDGET_MS.get()?.unwrap_or(3000) as f64)
}

/// NVTE_COMM_TUNE_PICK (tests): use candidate PICK mod (candidates measured) instead of
/// the fastest, so that every candidate's results can be checked.
pub fn forced_pick() -> Result<Option<i32>> {
    crate::env::TUNE_PICK.get()
}

/// The operation a choice is for: the comm-GEMM calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl Op {
    /// The C function of the call (for messages).
    pub fn api_name(self) -> &'static str {
        match self {
            Op::AllGather => "nvte_all_gather_gemm",
            Op::ReduceScatter => "nvte_gemm_reduce_scatter",
            Op::AllReduce => "nvte_gemm_all_reduce",
        }
    }
}

/// The per-call part of a policy (what the tuner chooses) in 8 bytes, for the
/// cross-rank exchange and the disk cache: flags, comm SMs, splits, pieces.
pub fn encode(p: &Policy) -> [u8; 8] {
    let flags = (p.comm.use_ce as u8)
        | (p.bidirectional() as u8) << 1
        | (p.rs_ring() as u8) << 2
        | (p.accumulates() as u8) << 3
        | (p.fused.is_some() as u8) << 4
        | ((p.fused == Some(Tiles::Narrow)) as u8) << 5
        | (p.no_overlap as u8) << 6;
    let mut b = [0u8; 8];
    b[0] = 1; // present
    b[1] = flags;
    b[2..4].copy_from_slice(&(p.comm.sms.clamp(0, u16::MAX as i32) as u16).to_le_bytes());
    b[4..6].copy_from_slice(&(p.splits.clamp(0, u16::MAX as i32) as u16).to_le_bytes());
    b[6] = p.pieces.clamp(0, 255) as u8;
    b
}

/// `base` (its fixed part: group, transport, streams, pins) with the per-call choices of
/// `b` ([`encode`]), or None where `b` holds none.
pub fn decode(b: &[u8], base: &Policy) -> Option<Policy> {
    if b.len() < 8 || b[0] != 1 {
        return None;
    }
    let mut p = *base;
    p.comm.use_ce = b[1] & 1 != 0;
    let bit = |i: u8| b[1] & (1 << i) != 0;
    p.direction = if bit(1) {
        Direction::BothWays
    } else {
        Direction::OneWay
    };
    // (the bits the encoder never sets apart are read as it sets them: accumulating only
    // with the ring, narrow tiles only with the fused algorithms)
    p.reduce = match (bit(2), bit(3)) {
        (false, _) => Reduction::Chunks,
        (true, false) => Reduction::Ring { sum: Sum::Closing },
        (true, true) => Reduction::Ring {
            sum: Sum::Accumulating,
        },
    };
    p.fused = match (bit(4), bit(5)) {
        (false, _) => None,
        (true, false) => Some(Tiles::Rule),
        (true, true) => Some(Tiles::Narrow),
    };
    p.no_overlap = bit(6);
    p.comm.sms = u16::from_le_bytes([b[2], b[3]]) as i32;
    p.splits = u16::from_le_bytes([b[4], b[5]]) as i32;
    p.pieces = (b[6] as i32).max(1);
    Some(p)
}

/// The disk cache's text of the per-call choices `b` ([`encode`]).
fn to_text(b: &[u8; 8]) -> String {
    let f = |bit: u8| (b[1] >> bit) & 1;
    format!(
        "ce={} aggregate={} ring={} comm_sms={} splits={} pieces={} acc={} fused={} narrow={} no_overlap={}",
        f(0),
        f(1),
        f(2),
        u16::from_le_bytes([b[2], b[3]]),
        u16::from_le_bytes([b[4], b[5]]),
        b[6],
        f(3),
        f(4),
        f(5),
        f(6)
    )
}

/// The choices of a disk cache line ([`to_text`]), encoded ([`encode`]); None where a
/// key is missing, repeated or out of range.
fn from_text(s: &str) -> Option<[u8; 8]> {
    const KEYS: [&str; 10] = [
        "ce",
        "aggregate",
        "ring",
        "comm_sms",
        "splits",
        "pieces",
        "acc",
        "fused",
        "narrow",
        "no_overlap",
    ];
    let mut v = [0i32; 10];
    let mut seen = 0u32; // a bit per key: each once
    for kv in s.split_whitespace() {
        let (k, x) = kv.split_once('=')?;
        let n: i32 = x.parse().ok()?;
        let i = KEYS.iter().position(|y| *y == k)?;
        if seen & (1 << i) != 0 {
            return None;
        }
        seen |= 1 << i;
        v[i] = n;
    }
    // (a line of an earlier format, without `narrow` or `no_overlap`, is not taken: its
    // key is tuned again, with the newer candidates)
    let [
        ce,
        aggregate,
        ring,
        comm_sms,
        splits,
        pieces,
        acc,
        fused,
        narrow,
        no_overlap,
    ] = v;
    let ok = seen == (1 << KEYS.len()) - 1
        && comm_sms >= 1
        && (1..=64).contains(&splits)
        && (1..=16).contains(&pieces);
    if !ok {
        return None;
    }
    let flag = |x: i32, bit: u8| ((x != 0) as u8) << bit;
    let mut b = [0u8; 8];
    b[0] = 1;
    b[1] = flag(ce, 0)
        | flag(aggregate, 1)
        | flag(ring, 2)
        | flag(acc, 3)
        | flag(fused, 4)
        | flag(narrow, 5)
        | flag(no_overlap, 6);
    b[2..4].copy_from_slice(&(comm_sms.min(u16::MAX as i32) as u16).to_le_bytes());
    b[4..6].copy_from_slice(&(splits as u16).to_le_bytes());
    b[6] = pieces as u8;
    Some(b)
}

/// The candidates for `op` at `tp` ranks, the defaults first, no overlap second, then
/// roughly the most promising (the budget may cut the list short from the end).
/// `peer_memory`: the transport has peer memory (without it the transfers are the
/// transport's own kernels: no CE/SM put or ring-direction choice, no ring all-reduce,
/// but the SMs the GEMMs leave to those kernels: 0, 16 or 32); `max_sms`: the
/// device's SM count (comm SMs stay well below it); `accumulating`: whether the
/// accumulating ring is a choice (not where NVTE_COMM_RS_RING forces how rings sum);
/// `narrow`: whether the fused algorithms' 128-wide tiles are a choice (not where
/// NVTE_COMM_FUSED_TILES pins the width: they would measure the same as their twins).
pub fn candidates(
    op: Op,
    tp: usize,
    peer_memory: bool,
    default: Policy,
    max_sms: i32,
    (accumulating, narrow): (bool, bool),
) -> Vec<Policy> {
    let mut l = Candidates {
        v: vec![default],
        max_sms,
        narrow,
    };
    // Under NVTE_COMM_OVERLAP=off every candidate would run the same no-overlap
    // algorithms: nothing to measure.
    if default.pins.overlap.is_some() && default.serial() {
        return l.v;
    }
    // No overlap second (the safety net: where overlapping loses, the collective and the
    // GEMM one after the other), unless NVTE_COMM_OVERLAP pins the choice.
    if tp > 1 && default.pins.overlap.is_none() {
        l.add(with(default, |p| p.no_overlap = true));
    }
    match op {
        Op::AllGather => l.all_gather(default, tp, peer_memory),
        Op::ReduceScatter => l.reduce_scatter(default, tp, peer_memory, accumulating),
        Op::AllReduce => l.all_reduce(default, peer_memory, accumulating),
    }
    l.v
}

/// `d` changed by `f`.
fn with(d: Policy, f: impl FnOnce(&mut Policy)) -> Policy {
    let mut p = d;
    f(&mut p);
    p
}

/// A candidate list being made: distinct policies whose comm SMs stay well below the
/// device's.
struct Candidates {
    v: Vec<Policy>,
    max_sms: i32,
    /// 128-wide tiles are a choice
    narrow: bool,
}

impl Candidates {
    fn add(&mut self, c: Policy) {
        if !self.v.contains(&c)
            && c.comm.sms >= 1
            && c.comm.sms < self.max_sms / 2
            && (self.narrow || c.fused != Some(Tiles::Narrow))
        {
            self.v.push(c);
        }
    }

    /// The accumulating ring (copy-engine puts) with its chunks in `pieces`.
    fn accumulating_ring(d: Policy, pieces: i32) -> Policy {
        with(d, |p| {
            p.reduce = Reduction::Ring {
                sum: Sum::Accumulating,
            };
            p.comm.use_ce = true;
            p.pieces = pieces;
        })
    }

    /// The ring with `d`'s sum (closing where `d` runs chunks).
    fn ring_of(d: Policy) -> Reduction {
        match d.reduce {
            Reduction::Chunks => Reduction::Ring { sum: Sum::Closing },
            ring => ring,
        }
    }

    /// The ring (p2p) with copy-engine puts, or SM puts on `sms` SMs.
    fn ring(d: Policy, sms: Option<i32>) -> Policy {
        with(d, |p| {
            p.reduce = Self::ring_of(d);
            p.comm.use_ce = sms.is_none();
            if let Some(n) = sms {
                p.comm.sms = n;
            }
        })
    }

    /// Without peer memory the transport's own kernels move the bytes (NCCL's run on
    /// SMs, beside the GEMMs): `d` with `use_ce` off, so that the GEMMs leave `sms` SMs
    /// to them ([`crate::overlap::plan`]'s `math_sms`, as NVTE_COMM_OVERLAP_USE_CE=0 does
    /// by hand), for 16 and 32 SMs. None where the SM margin is off
    /// (NVTE_COMM_OVERLAP_SM_MARGIN=0: they would run as `d`).
    fn sm_margins(&mut self, d: Policy) {
        if !d.comm.sm_margin {
            return;
        }
        for sms in [16, 32] {
            self.add(Self::margin(d, sms));
        }
    }

    /// `d` with the GEMMs leaving `sms` SMs to the communication kernels.
    fn margin(d: Policy, sms: i32) -> Policy {
        with(d, |p| {
            p.comm.use_ce = false;
            p.comm.sms = sms;
        })
    }

    fn all_gather(&mut self, d: Policy, tp: usize, peer_memory: bool) {
        if peer_memory {
            for bidirectional in [false, true] {
                if bidirectional && tp < 4 {
                    continue; // a 2-ring has one neighbour each way: nothing to gain
                }
                let b = with(d, |p| {
                    p.direction = if bidirectional {
                        Direction::BothWays
                    } else {
                        Direction::OneWay
                    }
                });
                self.add(with(b, |p| p.comm.use_ce = true));
                for sms in [8, 16, 32] {
                    self.add(with(b, |p| {
                        p.comm.use_ce = false;
                        p.comm.sms = sms;
                    }));
                }
            }
        }
        // Finer pipelines: each remote chunk in 2 or 4 pieces (any transport).
        for pieces in [2, 4] {
            self.add(with(d, |p| p.pieces = pieces));
        }
        if !peer_memory {
            self.sm_margins(d);
        }
        // The fused all-gather (one launch of our GEMM on arrival flags; where our GEMM
        // cannot compute the call, the same ring with cuBLASLt per chunk), whole chunks,
        // in 2 and 8 pieces (with K slices: 8 slices instead of at least 4), and in
        // 128-wide tiles: chosen only where measured faster, as every candidate.
        for pieces in [1, 2, 8] {
            self.add(with(d, |p| {
                p.fused = Some(Tiles::Rule);
                p.pieces = pieces;
            }));
        }
        self.add(with(d, |p| p.fused = Some(Tiles::Narrow)));
    }

    /// The accumulating ring (any transport), its chunks in 2 or 4 pieces; ring (p2p):
    /// CE or SM puts; pipelined: loads from peers with `splits` chunks; without peer
    /// memory, the defaults and the chunks also with SMs left to the transport's kernels.
    fn reduce_scatter(&mut self, d: Policy, tp: usize, peer_memory: bool, accumulating: bool) {
        for pieces in [2, 4] {
            if accumulating {
                self.add(Self::accumulating_ring(d, pieces));
            }
        }
        if peer_memory {
            self.add(Self::ring(d, None));
            for sms in [8, 16, 32] {
                self.add(Self::ring(d, Some(sms)));
            }
        }
        if !peer_memory {
            self.sm_margins(d);
        }
        // (3 splits left out for the fused ring's: 18 candidates with the default comm_sms;
        // the fused ones come last, so a tuning budget cuts them first). Without peer
        // memory the comm SMs matter only as the GEMMs' margin: each split count with
        // and without 16 SMs left to the transport's kernels; at tp 2 there the ring runs
        // whatever the splits (src/overlap/rs.rs rs_p2p_algo): no split candidates.
        let splits: &[i32] = if peer_memory || tp > 2 {
            &[2, 4, 6, 8]
        } else {
            &[]
        };
        for &splits in splits {
            let chunks = with(d, |p| {
                p.reduce = Reduction::Chunks;
                p.comm.use_ce = true;
                p.splits = splits;
                p.comm.sms = 16;
            });
            self.add(chunks);
            if peer_memory {
                self.add(with(chunks, |p| p.comm.sms = 32));
            } else if d.comm.sm_margin {
                self.add(Self::margin(chunks, 16));
            }
        }
        if peer_memory {
            self.fused_ring(d, &[1, 4]);
        }
    }

    /// The fused ring (one launch of our GEMM signalling each piece of a destination's
    /// rows, each piece pushed by copy engine as soon as it is signalled) in `pieces`
    /// pieces per destination, then in 4 pieces of 128-wide tiles: chosen only where
    /// measured faster, as every candidate.
    fn fused_ring(&mut self, d: Policy, pieces: &[i32]) {
        let fused = with(Self::ring(d, None), |p| p.fused = Some(Tiles::Rule));
        for &pieces in pieces {
            self.add(with(fused, |p| p.pieces = pieces));
        }
        self.add(with(fused, |p| {
            p.pieces = 4;
            p.fused = Some(Tiles::Narrow);
        }));
    }

    /// The ring with the accumulating reduce-scatter (the ring needs peer memory) in 2, 4
    /// or 8 pieces (each reduced piece is pushed to the peers as soon as it is computed:
    /// smaller pieces, a shorter tail after the last GEMM); the ring with CE or SM puts;
    /// chunked (without peer memory also with 16 SMs left to the transport's kernels).
    fn all_reduce(&mut self, d: Policy, peer_memory: bool, accumulating: bool) {
        if peer_memory && accumulating {
            for pieces in [2, 4, 8] {
                self.add(Self::accumulating_ring(d, pieces));
            }
        }
        if peer_memory {
            self.add(Self::ring(d, None));
            self.add(Self::ring(d, Some(32)));
        }
        // Without peer memory the defaults run the chunked all-reduce with their splits
        // (src/overlap/ar.rs ar_algo): their margin, then the other split counts with and
        // without one.
        let margins = !peer_memory && d.comm.sm_margin;
        if margins {
            self.add(Self::margin(d, 16));
        }
        for splits in [2, 3, 4, 6] {
            if !peer_memory && splits == d.splits {
                continue; // the defaults themselves
            }
            let chunks = with(d, |p| {
                p.reduce = Reduction::Chunks;
                p.splits = splits;
            });
            self.add(chunks);
            if margins {
                self.add(Self::margin(chunks, 16));
            }
        }
        if peer_memory {
            self.fused_ring(d, &[4]);
        }
    }
}

pub use crate::timing::{MARGIN, MAX_KEYS, ROUNDS, affordable, medians, pick, pick_with_margin};

/// The tuned choices, in memory and on disk.
#[derive(Default)]
pub struct Cache {
    path: Option<PathBuf>,
    /// the per-call choices ([`encode`]) by key
    map: HashMap<String, [u8; 8]>,
    loaded: bool,
}

/// What a choice is for: a call's operation, element types and layout, global m, n, k,
/// tp and transport setting. Hashed as is for the context's map (no per-call text); its
/// text (`Display`) is the disk cache's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub op: Op,
    pub types: [crate::tensor::DType; 3],
    pub trans: [bool; 2],
    pub dims: [i64; 3],
    pub tp: usize,
    /// the transport setting's name (NVTE_COMM_TRANSPORT: auto, ipc, nccl)
    pub transport: &'static str,
    /// The policy's pins that override candidates of `op` ([`Key::pins_for`]): a choice
    /// measured under an override is another key's, never applied without it.
    pub pins: Pins,
    /// FP8 GEMMs run with fast accumulation (NVTE_COMM_GEMM_FP8_FAST_ACCUM, FP8 inputs
    /// only)
    pub fast_accum: bool,
}

impl Key {
    /// The pins that matter to `op`: NVTE_COMM_AR_ALGO (all-reduce), NVTE_COMM_AG_PIECES
    /// (all-gather) or NVTE_COMM_RS_RING (the others), NVTE_COMM_FUSED_TILES,
    /// NVTE_COMM_OVERLAP.
    pub fn pins_for(op: Op, pins: &Pins) -> Pins {
        Pins {
            ar_algo: pins.ar_algo.filter(|_| op == Op::AllReduce),
            ag_pieces: pins.ag_pieces.filter(|_| op == Op::AllGather),
            rs_ring: pins.rs_ring.filter(|_| op != Op::AllGather),
            fused_tiles: pins.fused_tiles,
            overlap: pins.overlap,
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |b: bool| if b { "T" } else { "N" };
        let transport = self.transport;
        write!(
            f,
            "{:?} {}x{}->{}{}{} m={} n={} k={} tp={} {transport}",
            self.op,
            self.types[0].name(),
            self.types[1].name(),
            self.types[2].name(),
            t(self.trans[0]),
            t(self.trans[1]),
            self.dims[0],
            self.dims[1],
            self.dims[2],
            self.tp
        )?;
        // Overrides only (keys without any keep their text; the all-gather's
        // NVTE_COMM_AG_PIECES takes rs_ring's place, as the cache files have it).
        let p = &self.pins;
        for (name, v) in [
            ("ar_algo", p.ar_algo.unwrap_or(0)),
            ("rs_ring", p.ag_pieces.or(p.rs_ring).unwrap_or(0)),
            ("fp8_fast_accum", self.fast_accum as usize),
            ("fused_tiles", p.fused_tiles.unwrap_or(0)),
            ("overlap", p.overlap.unwrap_or(0)),
        ] {
            if v != 0 {
                write!(f, " {name}={v}")?;
            }
        }
        Ok(())
    }
}

impl Cache {
    /// The file for this device and these versions (None: no cache folder).
    fn file(fingerprint: &str) -> Result<Option<PathBuf>> {
        Ok(crate::cuda::nvrtc::cache_dir()?.map(|d| {
            let clean: String = fingerprint
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '.' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            // (v4: lines carry no_overlap; builds before it kept v3's file)
            d.join(format!("tune-v4-{clean}.txt"))
        }))
    }

    /// Load once (a missing or unreadable file is an empty cache; bad lines are skipped).
    /// `fingerprint` names the file; it is computed only on the first load.
    pub fn load(&mut self, fingerprint: impl FnOnce() -> Result<String>) -> Result<()> {
        if self.loaded {
            return Ok(());
        }
        self.loaded = true;
        self.path = Self::file(&fingerprint()?)?;
        if let Some(p) = &self.path
            && let Ok(text) = std::fs::read_to_string(p)
        {
            for line in text.lines() {
                if let Some((k, v)) = line.split_once(" => ")
                    && let Some(c) = from_text(v)
                {
                    self.map.insert(k.to_string(), c);
                }
            }
        }
        Ok(())
    }

    /// The choices cached for `key` ([`encode`]'s bytes).
    pub fn get(&self, key: &str) -> Option<[u8; 8]> {
        self.map.get(key).copied()
    }

    /// Remember, and rewrite the file (atomically: a temporary file renamed over it).
    pub fn put(&mut self, key: &str, c: &Policy) {
        self.map.insert(key.to_string(), encode(c));
        let Some(p) = &self.path else { return };
        let mut lines: Vec<String> = self
            .map
            .iter()
            .map(|(k, c)| format!("{k} => {}", to_text(c)))
            .collect();
        lines.sort();
        // (a name of its own per write, renamed into place: ranks of one process, one per
        // GPU, write at once; the cache is an optimisation only)
        crate::cuda::nvrtc::write_cached(p, (lines.join("\n") + "\n").as_bytes());
    }

    /// Clear the in-memory entries (force mode keeps the file's others).
    pub fn forget(&mut self, key: &str) {
        self.map.remove(key);
    }
}

/// Device model, SM count, driver, cuBLASLt and library version.
pub fn fingerprint(dev_name: &str, sm_count: i32) -> Result<String> {
    let drv = crate::cuda::library_info(crate::cuda::Lib::Driver)?.version;
    let lt = crate::cuda::library_info(crate::cuda::Lib::CublasLt)
        .map(|i| i.version)
        .unwrap_or(0);
    Ok(format!(
        "{dev_name}-{sm_count}sm-drv{drv}-cublaslt{lt}-te_comm{}",
        env!("CARGO_PKG_VERSION")
    ))
}

/// What each rank brings to a key's tuning: its cached choice, its defaults, its device's
/// SM count, its budget and forced pick. All ranks gather everyone's and follow rank 0's
/// settings (the cache only when every rank has the same entry; the SM count: the
/// smallest), so a difference in environments cannot make ranks diverge.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    pub cached: [u8; 8],
    pub default: Policy,
    pub sm_count: i32,
    pub budget_ms: f64,
    pub pick: Option<i32>,
}

/// The agreed settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agreed {
    pub cached: Option<Policy>,
    pub default: Policy,
    pub sm_count: i32,
    pub budget_ms: f64,
    pub pick: Option<i32>,
}

impl Settings {
    pub const BYTES: usize = 32;
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&self.cached);
        b[8..16].copy_from_slice(&encode(&self.default));
        b[16..20].copy_from_slice(&self.sm_count.to_le_bytes());
        b[20..24]
            .copy_from_slice(&(self.budget_ms.clamp(0.0, u32::MAX as f64) as u32).to_le_bytes());
        b[24..28].copy_from_slice(&self.pick.unwrap_or(-1).to_le_bytes());
        b
    }

    /// Every rank's settings (rank order) to the agreed ones: rank 0's choices on this
    /// rank's `base` policy (its fixed part).
    pub fn agree(all: &[u8], base: &Policy) -> Result<Agreed> {
        if all.is_empty() || !all.len().is_multiple_of(Self::BYTES) {
            return Err(Error::internal(format!(
                "tuning exchange: {} bytes, not a multiple of {}",
                all.len(),
                Self::BYTES
            )));
        }
        let ranks: Vec<&[u8]> = all.chunks(Self::BYTES).collect();
        let i32_at = |r: &[u8], o: usize| i32::from_le_bytes([r[o], r[o + 1], r[o + 2], r[o + 3]]);
        let first = decode(&ranks[0][..8], base);
        let cached = first.filter(|_| ranks.iter().all(|r| decode(&r[..8], base) == first));
        let default = decode(&ranks[0][8..16], base)
            .ok_or_else(|| Error::internal("tuning exchange: rank 0 sent no defaults"))?;
        let sm_count = ranks.iter().map(|r| i32_at(r, 16)).min().unwrap_or(0);
        let budget_ms =
            u32::from_le_bytes([ranks[0][20], ranks[0][21], ranks[0][22], ranks[0][23]]) as f64;
        let pick = Some(i32_at(ranks[0], 24)).filter(|p| *p >= 0);
        Ok(Agreed {
            cached,
            default,
            sm_count,
            budget_ms,
            pick,
        })
    }
}

/// The largest of the ranks' times (each 4 bytes, f32), NaN when any is NaN (a rank failed).
pub fn slowest(all: &[u8]) -> f32 {
    let mut w = f32::NEG_INFINITY;
    for x in all.chunks(4) {
        let t = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
        if t.is_nan() {
            return f32::NAN;
        }
        w = w.max(t);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overlap::policy::Comm;

    fn d() -> Policy {
        Policy::te_defaults()
    }

    #[test]
    fn candidates_start_with_the_defaults_and_are_distinct() {
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            for tp in [2, 4, 8] {
                for peer_memory in [true, false] {
                    let c = candidates(op, tp, peer_memory, d(), 132, (true, true));
                    assert_eq!(c[0], d());
                    for (i, a) in c.iter().enumerate() {
                        assert!(!c[i + 1..].contains(a), "{op:?} tp {tp}: duplicate {a:?}");
                        assert!(a.comm.sms >= 1 && a.comm.sms < 66);
                    }
                    if !peer_memory {
                        // The transport moves its own bytes: use_ce off only as the
                        // GEMMs' margin for its kernels, 16 SMs (and 32 for the defaults
                        // of AG and RS), and none without the SM margin.
                        let margins: Vec<i32> = c
                            .iter()
                            .filter(|x| !x.comm.use_ce)
                            .map(|x| x.comm.sms)
                            .collect();
                        assert!(margins.contains(&16), "{op:?} tp {tp}: {margins:?}");
                        assert!(margins.iter().all(|s| [16, 32].contains(s)));
                        assert_eq!(margins.contains(&32), op != Op::AllReduce);
                        let off = Policy {
                            comm: Comm {
                                sm_margin: false,
                                ..d().comm
                            },
                            ..d()
                        };
                        let c = candidates(op, tp, false, off, 132, (true, true));
                        assert!(c.iter().all(|x| x.comm.use_ce), "{op:?}: no margin asked");
                    }
                    assert!(c.len() <= 18, "{op:?}: {} candidates", c.len());
                    // No overlap second, the defaults' other choices kept.
                    assert_eq!(
                        c[1],
                        Policy {
                            no_overlap: true,
                            ..d()
                        }
                    );
                    // NVTE_COMM_OVERLAP=off: every candidate would run the same algorithms;
                    // =on: no no-overlap candidate.
                    let pinned = |v| Policy {
                        pins: Pins {
                            overlap: Some(v),
                            ..Default::default()
                        },
                        ..d()
                    };
                    let off = candidates(op, tp, peer_memory, pinned(2), 132, (true, true));
                    assert_eq!(off, vec![pinned(2)]);
                    let on = candidates(op, tp, peer_memory, pinned(1), 132, (true, true));
                    assert!(on.len() > 1 && !on.iter().any(|x| x.no_overlap));
                }
            }
        }
        // The accumulating ring: reduce-scatter on both transports, all-reduce over IPC.
        for (op, peer_memory, want) in [
            (Op::ReduceScatter, true, true),
            (Op::ReduceScatter, false, true),
            (Op::AllReduce, true, true),
            (Op::AllReduce, false, false),
            (Op::AllGather, true, false),
        ] {
            let c = candidates(op, 2, peer_memory, d(), 132, (true, true));
            let acc: Vec<&Policy> = c.iter().filter(|x| x.accumulates()).collect();
            assert_eq!(!acc.is_empty(), want, "{op:?} peer memory {peer_memory}");
            assert!(acc.iter().all(|x| x.rs_ring() && x.pieces >= 2));
        }
        // Where NVTE_COMM_RS_RING forces how rings sum: no accumulating candidates.
        for op in [Op::ReduceScatter, Op::AllReduce] {
            assert!(
                !candidates(op, 2, true, d(), 132, (false, true))
                    .iter()
                    .any(|c| c.accumulates())
            );
        }
        for op in [Op::ReduceScatter, Op::AllReduce] {
            assert!(
                !candidates(op, 2, false, d(), 132, (true, true))
                    .iter()
                    .any(|c| c.fused.is_some())
            );
        }
        // The bidirectional ring only from tp 4.
        assert!(
            !candidates(Op::AllGather, 2, true, d(), 132, (true, true))
                .iter()
                .any(|c| c.bidirectional())
        );
        assert!(
            candidates(Op::AllGather, 4, true, d(), 132, (true, true))
                .iter()
                .any(|c| c.bidirectional())
        );
    }

    /// python/tests/jax/test_jax_gpu.py forces picks 1, 2, 3, 5, 6, 7 (each is taken mod
    /// the candidates measured: all of them at its small shapes) at tp 2 over IPC with the
    /// default configuration; together they must run every kind of candidate.
    #[test]
    fn the_forced_picks_run_every_kind_of_candidate() {
        let ag = candidates(Op::AllGather, 2, true, d(), 132, (true, true));
        let rs = candidates(Op::ReduceScatter, 2, true, d(), 132, (true, true));
        let ar = candidates(Op::AllReduce, 2, true, d(), 132, (true, true));
        let picks = [1, 2, 3, 5, 6, 7];
        let run =
            |c: &[Policy], f: &dyn Fn(&Policy) -> bool| picks.iter().any(|p| f(&c[p % c.len()]));
        for x in [&ag, &rs, &ar] {
            assert!(run(x, &|c| c.no_overlap), "no overlap");
        }
        assert!(run(&ag, &|c| c.pieces == 2) && run(&ag, &|c| c.pieces == 4));
        assert!(run(&ag, &|c| !c.comm.use_ce));
        for x in [&rs, &ar] {
            assert!(run(x, &|c| c.accumulates() && c.pieces == 2));
            assert!(run(x, &|c| c.accumulates() && c.pieces == 4));
            assert!(
                run(x, &|c| c.rs_ring() && !c.accumulates() && !c.comm.use_ce),
                "SM puts"
            );
        }
        assert!(run(&rs, &|c| !c.rs_ring() && c.splits == 2), "pipelined");
        assert!(run(&ar, &|c| !c.rs_ring()), "chunked");
        // The fused all-gather: all-gather candidates only, among the forced picks.
        assert!(run(&ag, &|c| c.fused.is_some()));
        // The fused ring (reduce-scatter and the ring all-reduce's): after the other
        // candidates (the forced picks above stay where they were), ring and copy engine
        // only, with peer memory only.
        for x in [&rs, &ar] {
            let f: Vec<_> = x.iter().filter(|c| c.fused.is_some()).collect();
            assert!(
                !f.is_empty()
                    && f.iter()
                        .all(|c| c.rs_ring() && c.comm.use_ce && !c.accumulates())
            );
            assert!(
                x.iter()
                    .skip_while(|c| c.fused.is_none())
                    .all(|c| c.fused.is_some())
            );
        }
        assert!(rs.iter().any(|c| c.fused.is_some() && c.pieces == 4));
    }

    /// 128-wide tiles (fused candidates only) and 8 all-gather pieces for the fused
    /// algorithms; no narrow candidates where NVTE_COMM_FUSED_TILES pins the width.
    #[test]
    fn fused_candidates_offer_narrow_tiles_unless_pinned() {
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            for tp in [2, 4, 8] {
                let c = candidates(op, tp, true, d(), 132, (true, true));
                // (narrow tiles without the fused algorithms: the type has no such value)
                let narrow = Some(Tiles::Narrow);
                assert!(c.iter().any(|x| x.fused == narrow), "{op:?} tp {tp}");
                let pinned = candidates(op, tp, true, d(), 132, (true, false));
                assert!(!pinned.iter().any(|x| x.fused == narrow));
                assert!(pinned.iter().any(|x| x.fused.is_some()));
            }
        }
        let ag = candidates(Op::AllGather, 4, true, d(), 132, (true, true));
        assert!(
            ag.iter()
                .any(|c| c.fused == Some(Tiles::Rule) && c.pieces == 8)
        );
    }

    #[test]
    fn encoding_round_trips() {
        let all = candidates(Op::ReduceScatter, 4, true, d(), 132, (true, true))
            .into_iter()
            .chain(candidates(Op::AllGather, 4, true, d(), 132, (true, true)));
        for c in all {
            assert_eq!(decode(&encode(&c), &d()), Some(c));
            assert_eq!(from_text(&to_text(&encode(&c))), Some(encode(&c)));
        }
        // The fixed part is the base's: a choice applies to this rank's own policy.
        let base = Policy { tp_size: 4, ..d() };
        let c = Policy {
            comm: Comm {
                sms: 32,
                use_ce: false,
                ..d().comm
            },
            ..d()
        };
        let got = decode(&encode(&c), &base).unwrap();
        assert_eq!((got.tp_size, got.comm.sms, got.comm.use_ce), (4, 32, false));
        assert_eq!(decode(&[0u8; 8], &d()), None);
        assert_eq!(from_text("ce=1 aggregate=0"), None);
        assert_eq!(
            from_text("ce=1 aggregate=0 ring=1 comm_sms=0 splits=3"),
            None
        );
        // A key twice (and another missing) is not taken.
        assert_eq!(
            from_text(
                "ce=1 aggregate=0 ring=1 comm_sms=16 splits=3 pieces=1 acc=0 fused=1 fused=0"
            ),
            None
        );
        // Lines of previous formats (no acc; no fused; no narrow; no no_overlap) are not
        // taken.
        assert_eq!(
            from_text(
                "ce=1 aggregate=0 ring=1 comm_sms=16 splits=3 pieces=1 acc=0 fused=1 narrow=0"
            ),
            None
        );
        assert_eq!(
            from_text("ce=1 aggregate=0 ring=1 comm_sms=16 splits=3 pieces=1 acc=0 fused=1"),
            None
        );
        assert_eq!(
            from_text("ce=1 aggregate=0 ring=1 comm_sms=16 splits=3 pieces=1 acc=0"),
            None
        );
        assert_eq!(
            from_text("ce=1 aggregate=0 ring=1 comm_sms=16 splits=3 pieces=1"),
            None
        );
    }

    /// The typed choices keep the encoding's bits and the disk cache's words: cache files
    /// and the cross-rank exchange written before them read the same.
    #[test]
    fn typed_choices_keep_the_bytes_and_the_text() {
        let all_on = Policy {
            direction: Direction::BothWays,
            reduce: Reduction::Ring {
                sum: Sum::Accumulating,
            },
            fused: Some(Tiles::Narrow),
            splits: 6,
            pieces: 4,
            ..d()
        };
        assert_eq!(encode(&all_on), [1, 63, 16, 0, 6, 0, 4, 0]);
        assert_eq!(
            to_text(&encode(&all_on)),
            "ce=1 aggregate=1 ring=1 comm_sms=16 splits=6 pieces=4 acc=1 fused=1 narrow=1 no_overlap=0"
        );
        let serial = Policy {
            no_overlap: true,
            ..d()
        };
        assert_eq!(encode(&serial)[1], 1 | 4 | 64);
        assert_eq!(decode(&encode(&serial), &d()), Some(serial));
        assert!(to_text(&encode(&serial)).ends_with(" no_overlap=1"));
        assert_eq!(from_text(&to_text(&encode(&serial))), Some(encode(&serial)));
        let chunks = Policy {
            reduce: Reduction::Chunks,
            ..d()
        };
        assert_eq!(encode(&chunks), [1, 1, 16, 0, 3, 0, 1, 0]);
        assert_eq!(encode(&d())[1], 1 | 4, "ce and the ring: TE's defaults");
        let fused_rule = Policy {
            fused: Some(Tiles::Rule),
            ..d()
        };
        assert_eq!(encode(&fused_rule)[1], 1 | 4 | 16);
        // Bits the encoder never sets apart read as it sets them.
        let odd = decode(&[1, 1 | 8 | 32, 16, 0, 3, 0, 1, 0], &d()).unwrap();
        assert_eq!((odd.reduce, odd.fused), (Reduction::Chunks, None));
    }

    #[test]
    fn pick_takes_the_best_slowest_rank() {
        // rank 0 likes candidate 1, rank 1 is slow on it: candidate 2 wins on the max.
        let t = vec![vec![3.0, 1.0, 2.0], vec![3.0, 5.0, 2.5]];
        assert_eq!(pick(&t), Some(2));
        assert_eq!(pick(&[vec![1.0, 1.0]]), Some(0), "ties: the earlier");
        assert_eq!(pick(&[vec![f32::NAN, 2.0]]), Some(1));
        assert_eq!(pick(&[vec![f32::NAN]]), None);
    }

    #[test]
    fn ranks_agree_on_rank_0s_settings_and_the_common_cache() {
        let mk = |cached: Option<Policy>, sms: i32, budget: f64, pick: Option<i32>| Settings {
            cached: cached.map(|c| encode(&c)).unwrap_or([0; 8]),
            default: d(),
            sm_count: sms,
            budget_ms: budget,
            pick,
        };
        let other = Policy {
            splits: 4,
            reduce: Reduction::Chunks,
            ..d()
        };
        let all = [
            mk(Some(d()), 132, 3000.0, None).encode(),
            mk(Some(d()), 114, 10.0, Some(3)).encode(),
        ]
        .concat();
        let a = Settings::agree(&all, &d()).unwrap();
        assert_eq!(a.cached, Some(d()));
        assert_eq!(
            (a.sm_count, a.budget_ms, a.pick),
            (114, 3000.0, None),
            "rank 0's budget and pick, the smallest SM count"
        );
        let all = [
            mk(Some(d()), 132, 3000.0, Some(2)).encode(),
            mk(Some(other), 132, 3000.0, None).encode(),
        ]
        .concat();
        let a = Settings::agree(&all, &d()).unwrap();
        assert_eq!(a.cached, None, "different cache entries: tune");
        assert_eq!(a.pick, Some(2));
        let all = [
            mk(None, 132, 3000.0, None).encode(),
            mk(Some(d()), 132, 3000.0, None).encode(),
        ]
        .concat();
        assert_eq!(
            Settings::agree(&all, &d()).unwrap().cached,
            None,
            "a rank without the entry: tune"
        );
        assert!(Settings::agree(&[0u8; 5], &d()).is_err());
        let t = [1.0f32.to_le_bytes(), 3.0f32.to_le_bytes()].concat();
        assert_eq!(slowest(&t), 3.0);
        let t = [1.0f32.to_le_bytes(), f32::NAN.to_le_bytes()].concat();
        assert!(slowest(&t).is_nan());
    }

    #[test]
    fn medians_and_the_margin_keep_the_defaults_against_noise() {
        let t = vec![
            vec![1.00, 1.02, 0.99],
            vec![0.99, 0.98, 1.5],
            vec![0.80, f32::NAN],
        ];
        let m = medians(&t);
        assert_eq!(m[0], 1.00);
        assert_eq!(m[1], 0.99);
        assert!(m[2].is_nan());
        assert_eq!(
            pick_with_margin(&m, 0.03),
            0,
            "1% faster is noise: the defaults stay"
        );
        assert_eq!(pick_with_margin(&[1.0, 0.9, 0.95], 0.03), 1);
        assert_eq!(pick_with_margin(&[f32::NAN, 0.9], 0.03), 1);
        // What the GEMM algorithm selection relies on too: a failed candidate (NaN) is
        // never chosen, and when everything failed the default is kept.
        assert_eq!(pick_with_margin(&[1.0, f32::NAN], 0.03), 0);
        assert_eq!(pick_with_margin(&[f32::NAN, f32::NAN], 0.03), 0);
        assert_eq!(pick_with_margin(&[1.0, 0.98, 0.95], 0.03), 2);
    }

    #[test]
    fn the_budget_bounds_the_candidates() {
        assert_eq!(affordable(10, 100.0, 3000.0), 7);
        assert_eq!(affordable(10, 1.0, 3000.0), 10);
        assert_eq!(affordable(10, 10_000.0, 3000.0), 1);
        assert_eq!(affordable(4, f64::NAN, 3000.0), 4);
    }

    #[test]
    fn the_disk_cache_survives_a_reload() {
        let dir = std::env::temp_dir().join(format!("te_comm_tune_{}", std::process::id()));
        let p = dir.join("tune-v3-test.txt");
        let mut c = Cache {
            path: Some(p.clone()),
            map: HashMap::new(),
            loaded: true,
        };
        let k = Key {
            op: Op::AllGather,
            types: [crate::tensor::DType::BF16; 3],
            trans: [true, false],
            dims: [1, 2, 3],
            tp: 4,
            transport: "ipc",
            pins: Pins::default(),
            fast_accum: false,
        };
        let forced = Key {
            pins: Pins {
                rs_ring: Some(2),
                ..Pins::default()
            },
            ..k
        };
        // The all-gather's NVTE_COMM_AG_PIECES takes rs_ring's place (the files' keys).
        let ag_pieces = Key {
            pins: Key::pins_for(
                Op::AllGather,
                &Pins {
                    ag_pieces: Some(2),
                    rs_ring: Some(1),
                    ar_algo: Some(1),
                    fused_tiles: Some(2),
                    overlap: Some(2),
                },
            ),
            fast_accum: true,
            ..k
        };
        assert_eq!(
            ag_pieces.to_string(),
            format!("{k} rs_ring=2 fp8_fast_accum=1 fused_tiles=2 overlap=2")
        );
        assert_eq!(
            forced.to_string(),
            format!("{k} rs_ring=2"),
            "an override is its own key"
        );
        let k = k.to_string();
        assert_eq!(
            k,
            "AllGather kNVTEBFloat16xkNVTEBFloat16->kNVTEBFloat16TN m=1 n=2 k=3 tp=4 ipc"
        );
        c.put(&k, &d());
        let mut c2 = Cache {
            path: Some(p.clone()),
            map: HashMap::new(),
            loaded: false,
        };
        // load() recomputes the path from the fingerprint; read the file directly here.
        c2.loaded = true;
        for line in std::fs::read_to_string(&p).unwrap().lines() {
            let (kk, v) = line.split_once(" => ").unwrap();
            c2.map.insert(kk.into(), from_text(v).unwrap());
        }
        assert_eq!(c2.get(&k).and_then(|b| decode(&b, &d())), Some(d()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
