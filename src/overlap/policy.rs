//! How an overlap object (or a comm-GEMM context's engine) runs its calls: one immutable
//! value, [`Policy`], resolved when the object is created — the C API's
//! `NVTECommOverlapConfig` (or TE's defaults), then the environment ([`crate::env`]),
//! then, per tuned key, the autotuner (`crate::tune`, which enumerates policies) — and
//! replaced only whole, between calls ([`super::Overlap::set_policy`]). A call's
//! algorithm is a value of its own, [`Algo`]: the planner resolves it from the policy,
//! the transport's capabilities and the call's arguments (`plan::Planner::algo_of`), plans
//! it (`plan::Planner::plan`, one method per variant), and NVTE_COMM_REPORT prints it.
//!
//! Adding an algorithm: a variant of [`Algo`], the planner method it dispatches to, the
//! rule that chooses it (`Planner::algo_of`), and its protocol tests (`protocol.rs`; a
//! test-only no-op variant shows the path).
use crate::env;
use crate::error::Result;
use crate::transport::MAX_PEERS;
use crate::{invalid, unsupported};

/// The transport of the policy (C: `NVTECommTransport`, whose values ffi checks against
/// these). A `u32` rather than an enum: any value a C caller writes is a valid Rust value,
/// and [`Policy::check`] refuses the undeclared ones.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TransportChoice(pub u32);

pub const TRANSPORT_AUTO: TransportChoice = TransportChoice(0);
pub const TRANSPORT_IPC: TransportChoice = TransportChoice(1);
pub const TRANSPORT_NCCL: TransportChoice = TransportChoice(2);
/// Upper bounds of the GEMM splits, the compute streams and the pieces.
pub(super) const MAX_SPLITS: i32 = 64;
const MAX_STREAMS: i32 = 8;
const MAX_PIECES: i32 = 16;

/// The engine's streams (fixed at creation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Streams {
    /// compute streams for chunk GEMMs (TE default 3)
    pub compute: i32,
    /// accepted for TE compatibility (default 2); kernels are not cluster-launched
    pub cga_size: i32,
    /// stream priorities, clamped to the device's range (lower = higher priority)
    pub gemm_priority: i32,
    pub comm_priority: i32,
}

/// How the bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Comm {
    /// copy-engine puts (true, default) or SM-kernel puts (false)
    pub use_ce: bool,
    /// SMs for communication kernels: SM puts and reductions (TE default 16)
    pub sms: i32,
    /// GEMMs leave `sms` SMs free while SM kernels communicate (default true)
    pub sm_margin: bool,
}

/// The tile width of the fused algorithms' GEMM (`sm90::Hooks::narrow`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    /// the tile rule's width
    Rule,
    /// 128-wide tiles
    Narrow,
}

/// How a ring reduce-scatter sums the partials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sum {
    /// a closing reduction of the landed partials
    Closing,
    /// the accumulating ring: each step's GEMM adds the running sum
    Accumulating,
}

/// The ring all-gather's direction (config `aggregate`: both ways at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// one way round the ring (TE's default)
    OneWay,
    /// both ways at once, each half of the remote chunks from one neighbour
    BothWays,
}

/// How the reductions run (the reduce-scatter of a comm-GEMM context and the
/// all-reduce): the choice of algorithm, with the ring's parameter. One value serves
/// both operations: a tuned policy is one operation's, and an object's default is the
/// ring for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// chunks, each reduced as the next computes: the pipelined reduce-scatter (where
    /// the transport has peer memory, else the ring), the chunked all-reduce; the
    /// policy's `splits` chunks
    Chunks,
    /// the rings: the reduce-scatter's, and the all-reduce's where it fits; `sum`: how
    /// the ring sums where it can accumulate (unless NVTE_COMM_RS_RING pins it)
    Ring { sum: Sum },
}

/// An environment knob that pins a choice the tuner would otherwise make: unset or
/// `auto` (None here), or the choice's index in the knob's list (`crate::env`).
pub type Pin = Option<usize>;

/// The environment knobs that pin algorithm choices, read once when an object or a
/// comm-GEMM context is created ([`Pins::from_env`]): NVTE_COMM_AR_ALGO (auto, ring,
/// chunked), NVTE_COMM_RS_RING (auto, reduce, accumulate), NVTE_COMM_AG_PIECES (auto,
/// rows, k), NVTE_COMM_FUSED_TILES (auto, rule, narrow), NVTE_COMM_OVERLAP (auto, on,
/// off). Each wins over the tuner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Pins {
    pub ar_algo: Pin,
    pub rs_ring: Pin,
    pub ag_pieces: Pin,
    pub fused_tiles: Pin,
    pub overlap: Pin,
}

pub(super) const AR_RING: usize = 1;
pub(super) const AR_CHUNKED: usize = 2;
pub(super) const RS_REDUCE: usize = 1;
pub(super) const RS_ACCUMULATE: usize = 2;
pub(super) const AG_PIECES_K: usize = 2;
const TILES_RULE: usize = 1;
const TILES_NARROW: usize = 2;
pub(super) const OVERLAP_ON: usize = 1;
pub(super) const OVERLAP_OFF: usize = 2;

impl Pins {
    /// Parse the knobs (strictly: a bad value is an error naming it); `auto` is unset.
    pub fn from_env() -> Result<Pins> {
        let pin = |v: Option<usize>| v.filter(|&i| i != 0);
        Ok(Pins {
            ar_algo: pin(env::AR_ALGO.get()?),
            rs_ring: pin(env::RS_RING.get()?),
            ag_pieces: pin(env::AG_PIECES.get()?),
            fused_tiles: pin(env::FUSED_TILES.get()?),
            overlap: pin(env::OVERLAP.get()?),
        })
    }
}

/// Everything about how an object's calls run: the group and transport, the streams, how
/// bytes move, and the algorithms' parameters (module doc). The fields after `pins` are
/// the ones the autotuner chooses per call shape; the others are fixed at creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// ranks per tensor-parallel group; 0 = the whole world. Must divide the world size.
    pub tp_size: i32,
    /// auto, IPC or NCCL (config `transport`, env NVTE_COMM_TRANSPORT)
    pub transport: TransportChoice,
    /// timeout of every wait for a peer, ms (default 60000; env NVTE_COMM_TIMEOUT_MS)
    pub timeout_ms: i64,
    pub streams: Streams,
    /// config `atomic_gemm` (TE's atomic GEMM algorithms, default false): the fused
    /// algorithms wherever they apply, whatever the tuning (see [`Algo::FusedAg`] and
    /// [`Ring::fused`])
    pub atomic_gemm: bool,
    pub pins: Pins,
    pub comm: Comm,
    /// GEMM chunks of the pipelined reduce-scatter and the chunked all-reduce (TE
    /// default 3; config `num_splits`)
    pub splits: i32,
    /// the ring all-gather's direction (config `aggregate`, default one way)
    pub direction: Direction,
    /// pieces per remote chunk of the ring all-gather, per chunk of the accumulating ring,
    /// per destination of the fused ring (1..=16, default 1)
    pub pieces: i32,
    /// the reductions' algorithm: the ring (default) or chunks; the all-reduce's unless
    /// NVTE_COMM_AR_ALGO pins it
    pub reduce: Reduction,
    /// the fused algorithms for this call shape (as `atomic_gemm`), their GEMM's tiles
    /// (unless NVTE_COMM_FUSED_TILES pins them); None: the unfused ones
    pub fused: Option<Tiles>,
    /// no overlap (unless NVTE_COMM_OVERLAP pins it): the collective and the GEMM one
    /// after the other, where the tuner measured that overlapping loses ([`Policy::serial`])
    pub no_overlap: bool,
}

/// The ring reduce-scatter's parameters (split_rs_p2p, and the ring all-reduce's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ring {
    /// how the ring sums where it can accumulate (plain sums of the buffer's type)
    pub sum: Sum,
    /// pieces per chunk (accumulating) or per destination (fused)
    pub pieces: usize,
    /// one launch of our GEMM computing every destination's partial, each piece exchanged
    /// once it is signalled done (where our GEMM takes the call), with these tiles
    pub fused: Option<Tiles>,
}

/// A call's algorithm, with its parameters: what the planner plans (one method each,
/// `plan::Planner::plan`), chosen by `plan::Planner::algo_of` from the policy, the
/// transport's capabilities and the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// split_ag: the ring all-gather, a GEMM per chunk (piece) as it lands
    RingAg { bidirectional: bool, pieces: usize },
    /// split_ag without overlap: B gathered whole (the transport's collective, else puts
    /// into every peer's buffer), then one GEMM over it
    GatherThenGemm,
    /// split_ag: the backward ring into one launch of our GEMM on arrival flags (with a
    /// two-sided transport; cuBLASLt per chunk where our GEMM cannot take the call);
    /// `k_slices`: the pieces are K slices (NVTE_COMM_AG_PIECES=k) where they can be
    FusedAg {
        pieces: usize,
        k_slices: bool,
        tiles: Tiles,
    },
    /// split_rs: column chunks, each reduced from the peers' buffers once computed
    PipelinedRs { splits: usize },
    /// split_rs without peer memory at tp > 2: the transport's reduce-scatter collective
    /// per column chunk
    CollectiveRs { splits: usize },
    /// split_rs_p2p: the ring
    RingRs(Ring),
    /// split_ar: the ring reduce-scatter, then the reduced rows pushed to every peer
    RingAr(Ring),
    /// split_ar: row chunks, each all-reduced (one-shot, two-shot or the collective)
    /// while the next computes
    ChunkedAr { splits: usize },
    /// split_ar at tp 1 inline: the all-reduce of one partial is the GEMM
    GemmOnly,
    /// bulk all-gather / reduce-scatter (no GEMM)
    Bulk { use_ce: bool },
    /// test fixture: begins and finishes a call with nothing between (`protocol.rs`
    /// shows that a new variant needs only its planner method and its tests)
    #[cfg(test)]
    Noop,
}

impl std::fmt::Display for Algo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tiles = |t: Tiles| match t {
            Tiles::Rule => "rule",
            Tiles::Narrow => "narrow",
        };
        let ring = |f: &mut std::fmt::Formatter<'_>, name: &str, r: &Ring| {
            write!(f, "{name}(sum={:?} pieces={}", r.sum, r.pieces)?;
            match r.fused {
                Some(t) => write!(f, " fused tiles={})", tiles(t)),
                None => write!(f, ")"),
            }
        };
        match self {
            Algo::RingAg {
                bidirectional,
                pieces,
            } => write!(
                f,
                "ring_ag(bidirectional={} pieces={pieces})",
                *bidirectional as u8
            ),
            Algo::FusedAg {
                pieces,
                k_slices,
                tiles: t,
            } => write!(
                f,
                "fused_ag(pieces={pieces} k_slices={} tiles={})",
                *k_slices as u8,
                tiles(*t)
            ),
            Algo::GatherThenGemm => write!(f, "gather_then_gemm"),
            Algo::PipelinedRs { splits } => write!(f, "pipelined_rs(splits={splits})"),
            Algo::CollectiveRs { splits } => write!(f, "collective_rs(splits={splits})"),
            Algo::RingRs(r) => ring(f, "ring_rs", r),
            Algo::RingAr(r) => ring(f, "ring_ar", r),
            Algo::ChunkedAr { splits } => write!(f, "chunked_ar(splits={splits})"),
            Algo::GemmOnly => write!(f, "gemm_only"),
            Algo::Bulk { use_ce } => write!(f, "bulk(ce={})", *use_ce as u8),
            #[cfg(test)]
            Algo::Noop => write!(f, "noop"),
        }
    }
}

impl Policy {
    /// TE's defaults, without the environment: the whole world, transport auto, a
    /// 60 s timeout, 3 compute streams, 16 comm SMs with the SM margin, copy-engine puts,
    /// 3 splits, the one-way ring in whole chunks, the ring all-reduce, no fused
    /// algorithms, no pins.
    pub fn te_defaults() -> Policy {
        Policy {
            tp_size: 0,
            transport: TRANSPORT_AUTO,
            timeout_ms: 60_000,
            streams: Streams {
                compute: 3,
                cga_size: 2,
                gemm_priority: 0,
                comm_priority: -100,
            },
            atomic_gemm: false,
            pins: Pins::default(),
            comm: Comm {
                use_ce: true,
                sms: 16,
                sm_margin: true,
            },
            splits: 3,
            direction: Direction::OneWay,
            pieces: 1,
            reduce: Reduction::Ring { sum: Sum::Closing },
            fused: None,
            no_overlap: false,
        }
    }

    /// TE's defaults, then the environment overrides (parsed strictly, see [`crate::env`]):
    /// NVTE_COMM_TIMEOUT_MS, NVTE_COMM_OVERLAP_NUM_SPLITS, NVTE_COMM_OVERLAP_MAX_STREAMS,
    /// NVTE_COMM_OVERLAP_NUM_SM, NVTE_COMM_OVERLAP_USE_CE, NVTE_COMM_OVERLAP_AGGREGATE,
    /// NVTE_COMM_OVERLAP_SM_MARGIN, NVTE_COMM_TRANSPORT (auto | ipc | nccl). A value that
    /// does not parse or is out of range is an error naming the variable. The pins are
    /// not read here ([`Pins::from_env`]: the creator reads them, after its checks).
    pub fn from_env() -> Result<Policy> {
        // Index = the transport's value.
        let transport = env::TRANSPORT.get()?;
        let mut p = Policy {
            transport: transport.map_or(TRANSPORT_AUTO, |t| TransportChoice(t as u32)),
            timeout_ms: env::timeout_ms()?,
            ..Policy::te_defaults()
        };
        // The ranges of `check` (the comm SMs' upper bound is the device's SM count).
        if let Some(v) = env::OVERLAP_NUM_SPLITS.get()? {
            p.splits = v;
        }
        if let Some(v) = env::OVERLAP_MAX_STREAMS.get()? {
            p.streams.compute = v;
        }
        if let Some(v) = env::OVERLAP_NUM_SM.get()? {
            p.comm.sms = v;
        }
        if let Some(v) = env::OVERLAP_USE_CE.get()? {
            p.comm.use_ce = v;
        }
        if let Some(v) = env::OVERLAP_AGGREGATE.get()? {
            p.direction = if v {
                Direction::BothWays
            } else {
                Direction::OneWay
            };
        }
        if let Some(v) = env::OVERLAP_SM_MARGIN.get()? {
            p.comm.sm_margin = v;
        }
        Ok(p)
    }

    /// The checks that need neither the world nor a device: made before anything is
    /// loaded, so a bad policy is INVALID_ARGUMENT (or UNSUPPORTED) on any machine. The
    /// messages name the C config's fields.
    pub fn check(&self) -> Result<()> {
        if self.tp_size < 0 {
            invalid!(
                "config tp_size = {} must be >= 0 (0: the whole world)",
                self.tp_size
            );
        }
        if self.tp_size as usize > MAX_PEERS {
            unsupported!(
                "config tp_size = {} exceeds the maximum of {MAX_PEERS}",
                self.tp_size
            );
        }
        if !(1..=MAX_SPLITS).contains(&self.splits) {
            invalid!(
                "config num_splits = {} must be in 1..={MAX_SPLITS}",
                self.splits
            );
        }
        if !(1..=MAX_STREAMS).contains(&self.streams.compute) {
            invalid!(
                "config num_max_streams = {} must be in 1..={MAX_STREAMS}",
                self.streams.compute
            );
        }
        if !(1..=8).contains(&self.streams.cga_size) {
            invalid!(
                "config comm_cga_size = {} must be in 1..=8",
                self.streams.cga_size
            );
        }
        if self.comm.sms < 1 {
            invalid!(
                "config num_comm_sm = {} must be >= 1 (and less than the device's SM count)",
                self.comm.sms
            );
        }
        if self.timeout_ms <= 0 {
            invalid!("config timeout_ms = {} must be > 0", self.timeout_ms);
        }
        if !crate::transport::is_choice(self.transport.0) {
            invalid!(
                "config transport = {} must be {}",
                self.transport.0,
                crate::transport::choices_text()
            );
        }
        Ok(())
    }

    /// The group size for a world of `world` ranks (after [`Policy::check`]).
    pub fn tp_for(&self, world: usize) -> Result<usize> {
        let tp = if self.tp_size == 0 {
            world
        } else {
            self.tp_size as usize
        };
        if self.tp_size < 0 || tp == 0 || !world.is_multiple_of(tp) {
            invalid!(
                "config tp_size = {} does not divide the world size {world}",
                self.tp_size
            );
        }
        if tp > MAX_PEERS {
            unsupported!("config tp_size = {tp} exceeds the maximum of {MAX_PEERS}");
        }
        Ok(tp)
    }

    /// [`Policy::check`], the group size, and the comm SMs against the device's.
    pub(super) fn validate(&self, world: usize, sm_count: i32) -> Result<usize> {
        self.check()?;
        let tp = self.tp_for(world)?;
        if self.comm.sms >= sm_count {
            invalid!(
                "config num_comm_sm = {} must be in 1..{sm_count} (the device's SM count)",
                self.comm.sms
            );
        }
        Ok(tp)
    }

    /// The checks of a policy that replaces `self` between calls: the fields fixed at
    /// creation unchanged, the per-call ones in range (the comm SMs below the device's
    /// `sm_count`).
    pub(super) fn check_replacement(&self, next: &Policy, sm_count: i32) -> Result<()> {
        let fixed = |p: &Policy| {
            (
                p.tp_size,
                p.transport,
                p.timeout_ms,
                p.streams,
                p.atomic_gemm,
                p.pins,
                p.comm.sm_margin,
            )
        };
        if fixed(self) != fixed(next) {
            invalid!(
                "the new policy changes what the object's creation fixed (group, transport, timeout, streams, atomic_gemm, the environment's pins, the SM margin): make a new object for those"
            );
        }
        if !(1..=MAX_SPLITS).contains(&next.splits) {
            invalid!("num_splits = {} must be in 1..={MAX_SPLITS}", next.splits);
        }
        if !(1..=MAX_PIECES).contains(&next.pieces) {
            invalid!("pieces = {} must be in 1..={MAX_PIECES}", next.pieces);
        }
        let n = next.comm.sms;
        if n < 1 || n >= sm_count {
            invalid!("comm_sm_count = {n} must be in 1..{sm_count} (the device's SM count)");
        }
        Ok(())
    }

    /// The fused algorithms where they apply: config `atomic_gemm` or the tuning's.
    pub fn fused_on(&self) -> bool {
        self.atomic_gemm || self.fused.is_some()
    }

    /// The fused algorithms' tiles: NVTE_COMM_FUSED_TILES (`rule`, `narrow`), else the
    /// tuning's.
    pub fn tiles(&self) -> Tiles {
        match self.pins.fused_tiles {
            Some(TILES_RULE) => Tiles::Rule,
            Some(TILES_NARROW) => Tiles::Narrow,
            _ => self.fused.unwrap_or(Tiles::Rule),
        }
    }

    /// How the rings sum where they can accumulate, in a group of `tp` (`inline`: tp 1
    /// on the caller's stream, where the one partial's "sum" is the GEMM into the output):
    /// NVTE_COMM_RS_RING (`reduce`, `accumulate`), else the tuning's, accumulating at tp 1.
    pub fn sum(&self, tp: usize, inline: bool) -> Sum {
        let acc = match self.pins.rs_ring {
            _ if inline => true,
            Some(RS_REDUCE) => false,
            Some(RS_ACCUMULATE) => true,
            _ => self.accumulates() || tp == 1,
        };
        if acc { Sum::Accumulating } else { Sum::Closing }
    }

    /// The all-reduce prefers the ring (where it fits): NVTE_COMM_AR_ALGO (`ring`,
    /// `chunked`), else the tuning's.
    pub fn ar_ring(&self) -> bool {
        match self.pins.ar_algo {
            Some(AR_CHUNKED) => false,
            Some(AR_RING) => true,
            _ => self.rs_ring(),
        }
    }

    /// The comm-GEMM reduce-scatter runs the ring (else the pipelined one): the tuning's.
    pub fn rs_ring(&self) -> bool {
        matches!(self.reduce, Reduction::Ring { .. })
    }

    /// The tuning's rings accumulate.
    pub fn accumulates(&self) -> bool {
        self.reduce
            == Reduction::Ring {
                sum: Sum::Accumulating,
            }
    }

    /// The ring all-gather runs both ways at once.
    pub fn bidirectional(&self) -> bool {
        self.direction == Direction::BothWays
    }

    /// The calls run without overlap, the collective and the GEMM one after the other
    /// ([`Algo::GatherThenGemm`], one chunk of the pipelined or collective reduce-scatter,
    /// of the chunked all-reduce): NVTE_COMM_OVERLAP (`on`, `off`), else the tuning's.
    pub fn serial(&self) -> bool {
        match self.pins.overlap {
            Some(OVERLAP_OFF) => true,
            Some(OVERLAP_ON) => false,
            _ => self.no_overlap,
        }
    }

    /// NVTE_COMM_AG_PIECES=k: the fused all-gather's pieces are K slices where they can be.
    pub fn ag_k_slices(&self) -> bool {
        self.pins.ag_pieces == Some(AG_PIECES_K)
    }

    /// The policy's text for the report and the tuner's messages: the per-call choices,
    /// as typed (the reductions' algorithm and the fused algorithms' tiles after the
    /// pins and `atomic_gemm`).
    pub fn summary(&self) -> String {
        // The ring's sum as a group of 2 or more sees it (after NVTE_COMM_RS_RING).
        let reduce = match self.reduce {
            Reduction::Chunks => "chunks".to_string(),
            Reduction::Ring { .. } => format!("ring(sum={:?})", self.sum(2, false)),
        };
        let ar = if self.ar_ring() { "ring" } else { "chunks" };
        let fused = match self.fused_on() {
            true => format!("on(tiles={:?})", self.tiles()),
            false => "off".to_string(),
        };
        format!(
            "ce={} comm_sms={} splits={} direction={:?} pieces={} reduce={reduce} ar={ar} fused={fused} overlap={}",
            self.comm.use_ce as u8,
            self.comm.sms,
            self.splits,
            self.direction,
            self.pieces,
            if self.serial() { "off" } else { "on" },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Kind;

    #[test]
    fn the_knob_table_has_the_policy_ranges() {
        let range = |hi: i32| Kind::Int {
            lo: 1,
            hi: hi as i128,
        };
        assert_eq!(env::OVERLAP_NUM_SPLITS.knob.kind, range(MAX_SPLITS));
        assert_eq!(env::OVERLAP_MAX_STREAMS.knob.kind, range(MAX_STREAMS));
    }

    #[test]
    fn policy_validation_names_the_config_field() {
        let base = Policy {
            transport: TRANSPORT_NCCL,
            ..Policy::from_env().unwrap()
        };
        assert_eq!(base.validate(4, 132).unwrap(), 4);
        let with = |f: &dyn Fn(&mut Policy)| {
            let mut p = base;
            f(&mut p);
            p
        };
        for (p, word) in [
            (with(&|p| p.tp_size = 3), "tp_size"),
            (with(&|p| p.splits = 0), "num_splits"),
            (with(&|p| p.streams.compute = 9), "num_max_streams"),
            (with(&|p| p.comm.sms = 132), "num_comm_sm"),
            (with(&|p| p.timeout_ms = 0), "timeout_ms"),
            (with(&|p| p.transport = TransportChoice(7)), "transport"),
        ] {
            let e = p.validate(4, 132).unwrap_err();
            assert!(e.msg.contains(word), "{word}: {}", e.msg);
        }
        assert_eq!(with(&|p| p.tp_size = 2).validate(4, 132).unwrap(), 2);
    }

    /// The environment's pins win over the tuning; unpinned, the tuning decides.
    #[test]
    fn pins_win_over_the_tuning() {
        let base = Policy::from_env().unwrap();
        let pinned = |pins: Pins, f: &dyn Fn(&mut Policy)| {
            let mut p = Policy { pins, ..base };
            f(&mut p);
            p
        };
        for (knob, tuned, want) in [
            (None, false, Tiles::Rule),
            (None, true, Tiles::Narrow),
            (Some(TILES_RULE), true, Tiles::Rule),
            (Some(TILES_NARROW), false, Tiles::Narrow),
        ] {
            let pins = Pins {
                fused_tiles: knob,
                ..Pins::default()
            };
            let fused = tuned.then_some(Tiles::Narrow);
            assert_eq!(pinned(pins, &|p| p.fused = fused).tiles(), want);
        }
        for (knob, tuned, tp, inline, want) in [
            (None, false, 2, false, Sum::Closing),
            (None, true, 2, false, Sum::Accumulating),
            (None, false, 1, false, Sum::Accumulating),
            (Some(RS_REDUCE), true, 1, false, Sum::Closing),
            (Some(RS_REDUCE), false, 1, true, Sum::Accumulating),
            (Some(RS_ACCUMULATE), false, 4, false, Sum::Accumulating),
        ] {
            let pins = Pins {
                rs_ring: knob,
                ..Pins::default()
            };
            let sum = if tuned {
                Sum::Accumulating
            } else {
                Sum::Closing
            };
            let p = pinned(pins, &|p| p.reduce = Reduction::Ring { sum });
            assert_eq!(p.sum(tp, inline), want, "{knob:?} {tuned} tp {tp}");
        }
        for (knob, tuned, want) in [
            (None, true, true),
            (None, false, false),
            (Some(AR_RING), false, true),
            (Some(AR_CHUNKED), true, false),
        ] {
            let pins = Pins {
                ar_algo: knob,
                ..Pins::default()
            };
            let reduce = if tuned {
                Reduction::Ring { sum: Sum::Closing }
            } else {
                Reduction::Chunks
            };
            assert_eq!(pinned(pins, &|p| p.reduce = reduce).ar_ring(), want);
        }
        let atomic = Policy {
            atomic_gemm: true,
            ..base
        };
        assert!(atomic.fused_on() && !base.fused_on());
    }

    /// NVTE_COMM_REPORT's lines name the algorithm with its parameters.
    #[test]
    fn an_algorithm_prints_its_parameters() {
        let ring = Ring {
            sum: Sum::Accumulating,
            pieces: 4,
            fused: None,
        };
        let fused = Ring {
            sum: Sum::Closing,
            fused: Some(Tiles::Narrow),
            ..ring
        };
        for (a, want) in [
            (
                Algo::RingAg {
                    bidirectional: true,
                    pieces: 2,
                },
                "ring_ag(bidirectional=1 pieces=2)",
            ),
            (
                Algo::FusedAg {
                    pieces: 8,
                    k_slices: true,
                    tiles: Tiles::Rule,
                },
                "fused_ag(pieces=8 k_slices=1 tiles=rule)",
            ),
            (Algo::GatherThenGemm, "gather_then_gemm"),
            (Algo::PipelinedRs { splits: 3 }, "pipelined_rs(splits=3)"),
            (Algo::CollectiveRs { splits: 4 }, "collective_rs(splits=4)"),
            (Algo::RingRs(ring), "ring_rs(sum=Accumulating pieces=4)"),
            (
                Algo::RingAr(fused),
                "ring_ar(sum=Closing pieces=4 fused tiles=narrow)",
            ),
            (Algo::ChunkedAr { splits: 6 }, "chunked_ar(splits=6)"),
            (Algo::GemmOnly, "gemm_only"),
            (Algo::Bulk { use_ce: false }, "bulk(ce=0)"),
            (Algo::Noop, "noop"),
        ] {
            assert_eq!(a.to_string(), want);
        }
        let p = Policy::te_defaults();
        assert_eq!(
            p.summary(),
            "ce=1 comm_sms=16 splits=3 direction=OneWay pieces=1 reduce=ring(sum=Closing) ar=ring fused=off overlap=on"
        );
        let tuned = Policy {
            reduce: Reduction::Chunks,
            fused: Some(Tiles::Narrow),
            direction: Direction::BothWays,
            no_overlap: true,
            ..p
        };
        assert_eq!(
            tuned.summary(),
            "ce=1 comm_sms=16 splits=3 direction=BothWays pieces=1 reduce=chunks ar=chunks fused=on(tiles=Narrow) overlap=off"
        );
        // NVTE_COMM_OVERLAP wins over the tuning's choice.
        let on = Pins {
            overlap: Some(OVERLAP_ON),
            ..Pins::default()
        };
        assert!(!Policy { pins: on, ..tuned }.serial());
        let off = Pins {
            overlap: Some(OVERLAP_OFF),
            ..Pins::default()
        };
        assert!(Policy { pins: off, ..p }.serial());
    }

    #[test]
    fn a_replacement_keeps_what_creation_fixed() {
        let base = Policy::from_env().unwrap();
        let ok = Policy {
            splits: 4,
            pieces: 2,
            fused: Some(Tiles::Rule),
            ..base
        };
        assert!(base.check_replacement(&ok, 132).is_ok());
        for bad in [
            Policy { tp_size: 2, ..ok },
            Policy {
                atomic_gemm: !base.atomic_gemm,
                ..ok
            },
            Policy { pieces: 17, ..ok },
            Policy { splits: 65, ..ok },
        ] {
            assert!(base.check_replacement(&bad, 132).is_err(), "{bad:?}");
        }
        let sms = Policy {
            comm: Comm {
                sms: 132,
                ..ok.comm
            },
            ..ok
        };
        assert!(base.check_replacement(&sms, 132).is_err());
    }
}
