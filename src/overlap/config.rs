//! The engine's settings: [`EngineConfig`] (what the C API's `NVTECommOverlapConfig`
//! holds, below the C boundary), its defaults and environment overrides, and its checks.
use crate::env;
use crate::error::Result;
use crate::transport::MAX_PEERS;
use crate::{invalid, unsupported};

/// The engine's settings, as the engine takes them: the C API's `NVTECommOverlapConfig`
/// (`crate::ffi::config::Config`, which exists only at the C boundary) without its
/// size field, or TE's defaults and the environment ([`EngineConfig::from_env`]). Checked
/// before anything is loaded ([`EngineConfig::check`]) and against the world and the
/// device when an engine is made (`EngineConfig::validate`); not changed afterwards
/// (the per-call settings are the engine's `plan::Settings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// ranks per tensor-parallel group; 0 = the whole world. Must divide the world size.
    pub tp_size: i32,
    /// GEMM chunks of the pipelined reduce-scatter (TE default 3)
    pub num_splits: i32,
    /// compute streams for chunk GEMMs (TE default 3)
    pub num_max_streams: i32,
    /// accepted for TE compatibility (default 2); kernels are not cluster-launched
    pub comm_cga_size: i32,
    /// SMs for communication kernels: SM puts and reductions (TE default 16)
    pub num_comm_sm: i32,
    /// GEMMs leave num_comm_sm SMs free while SM kernels communicate (default true)
    pub set_sm_margin: bool,
    /// copy-engine puts (true, default) or SM-kernel puts (false)
    pub use_ce: bool,
    /// bidirectional ring all-gather (default false)
    pub aggregate: bool,
    /// TE's atomic GEMM algorithms (default false): true makes the all-gather + GEMM
    /// (split_ag) the fused one: the chunks travel the backward ring as in the split
    /// all-gather, and one launch of our own Hopper GEMM (kernels/gemm_sm90.cu) computes
    /// all of D, waiting on a per-chunk arrival flag that the ring's stream writes after
    /// each chunk has landed (every wait on a peer stays bounded by the timeout). Our GEMM
    /// runs where it can: an sm_90 device, TN, bf16 or e4m3 inputs (e4m3 with fast
    /// accumulation), bf16 or fp32 output, no bias / GELU / accumulate / FP8 output, k *
    /// the input size a multiple of 16 bytes, m a multiple of 8, 16-byte aligned operands;
    /// elsewhere the same ring feeds cuBLASLt GEMMs per chunk (the reason is the call's
    /// NVTX step). While it runs our GEMM leaves num_comm_sm SMs to communication (2 where
    /// copy engines move the bytes: use_ce, peers on other devices, no B_copy). The ring
    /// reduce-scatter (split_rs_p2p, and the ring all-reduce's reduce-scatter) runs our
    /// GEMM too where it can: one launch computing every destination's partial, each
    /// piece of a destination's rows exchanged once it is signalled done (the tuning's
    /// pieces; 1 by default); the pipelined reduce-scatter, the accumulating ring and the
    /// chunked all-reduce are unchanged. Not TE's cuBLAS atomic-counter GEMMs, which
    /// cuBLASLt 13 removed (bench/atomic_gemm_probe.cu).
    pub atomic_gemm: bool,
    /// stream priorities, clamped to the device's range (lower = higher priority)
    pub gemm_priority: i32,
    pub comm_priority: i32,
    /// timeout of every wait for a peer, ms (default 60000; env NVTE_COMM_TIMEOUT_MS)
    pub timeout_ms: i64,
    /// auto, IPC or NCCL (env NVTE_COMM_TRANSPORT)
    pub transport: TransportChoice,
}

/// The transport field of the config (C: `NVTECommTransport`, whose values ffi checks
/// against these). A `u32` rather than an enum: any value a C caller writes is a valid
/// Rust value, and [`EngineConfig::check`] refuses the undeclared ones.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TransportChoice(pub u32);

pub const TRANSPORT_AUTO: TransportChoice = TransportChoice(0);
pub const TRANSPORT_IPC: TransportChoice = TransportChoice(1);
pub const TRANSPORT_NCCL: TransportChoice = TransportChoice(2);
/// Upper bounds of num_splits and num_max_streams.
pub(super) const MAX_SPLITS: i32 = 64;
const MAX_STREAMS: i32 = 8;

impl EngineConfig {
    /// TE's defaults, then the environment overrides (parsed strictly, see [`crate::env`]):
    /// NVTE_COMM_TIMEOUT_MS, NVTE_COMM_OVERLAP_NUM_SPLITS, NVTE_COMM_OVERLAP_MAX_STREAMS,
    /// NVTE_COMM_OVERLAP_NUM_SM, NVTE_COMM_OVERLAP_USE_CE, NVTE_COMM_OVERLAP_AGGREGATE,
    /// NVTE_COMM_OVERLAP_SM_MARGIN, NVTE_COMM_TRANSPORT (auto | ipc | nccl). A value that
    /// does not parse or is out of range is an error naming the variable.
    pub fn from_env() -> Result<EngineConfig> {
        // Index = the transport's value.
        let transport = env::TRANSPORT.get()?;
        let mut c = EngineConfig {
            tp_size: 0,
            num_splits: 3,
            num_max_streams: 3,
            comm_cga_size: 2,
            num_comm_sm: 16,
            set_sm_margin: true,
            use_ce: true,
            aggregate: false,
            atomic_gemm: false,
            gemm_priority: 0,
            comm_priority: -100,
            timeout_ms: env::timeout_ms()?,
            transport: transport.map_or(TRANSPORT_AUTO, |t| TransportChoice(t as u32)),
        };
        // The ranges of `check` (num_comm_sm's upper bound is the device's SM count).
        if let Some(v) = env::OVERLAP_NUM_SPLITS.get()? {
            c.num_splits = v;
        }
        if let Some(v) = env::OVERLAP_MAX_STREAMS.get()? {
            c.num_max_streams = v;
        }
        if let Some(v) = env::OVERLAP_NUM_SM.get()? {
            c.num_comm_sm = v;
        }
        if let Some(v) = env::OVERLAP_USE_CE.get()? {
            c.use_ce = v;
        }
        if let Some(v) = env::OVERLAP_AGGREGATE.get()? {
            c.aggregate = v;
        }
        if let Some(v) = env::OVERLAP_SM_MARGIN.get()? {
            c.set_sm_margin = v;
        }
        Ok(c)
    }

    /// The checks that need neither the world nor a device: made before anything is
    /// loaded, so a bad config is INVALID_ARGUMENT (or UNSUPPORTED) on any machine.
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
        if !(1..=MAX_SPLITS).contains(&self.num_splits) {
            invalid!(
                "config num_splits = {} must be in 1..={MAX_SPLITS}",
                self.num_splits
            );
        }
        if !(1..=MAX_STREAMS).contains(&self.num_max_streams) {
            invalid!(
                "config num_max_streams = {} must be in 1..={MAX_STREAMS}",
                self.num_max_streams
            );
        }
        if !(1..=8).contains(&self.comm_cga_size) {
            invalid!(
                "config comm_cga_size = {} must be in 1..=8",
                self.comm_cga_size
            );
        }
        if self.num_comm_sm < 1 {
            invalid!(
                "config num_comm_sm = {} must be >= 1 (and less than the device's SM count)",
                self.num_comm_sm
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

    /// The group size for a world of `world` ranks (after [`EngineConfig::check`]).
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

    pub(super) fn validate(&self, world: usize, sm_count: i32) -> Result<usize> {
        self.check()?;
        let tp = self.tp_for(world)?;
        if self.num_comm_sm >= sm_count {
            invalid!(
                "config num_comm_sm = {} must be in 1..{sm_count} (the device's SM count)",
                self.num_comm_sm
            );
        }
        Ok(tp)
    }
}

#[cfg(test)]
mod tests {
    use super::{EngineConfig as Config, MAX_SPLITS, MAX_STREAMS, TRANSPORT_NCCL};
    use crate::env::{self, Kind};

    #[test]
    fn the_knob_table_has_the_config_ranges() {
        let range = |hi: i32| Kind::Int {
            lo: 1,
            hi: hi as i128,
        };
        assert_eq!(env::OVERLAP_NUM_SPLITS.knob.kind, range(MAX_SPLITS));
        assert_eq!(env::OVERLAP_MAX_STREAMS.knob.kind, range(MAX_STREAMS));
    }

    #[test]
    fn config_validation_names_the_field() {
        let base = Config {
            transport: TRANSPORT_NCCL,
            ..Config::from_env().unwrap()
        };
        assert_eq!(base.validate(4, 132).unwrap(), 4);
        for (cfg, word) in [
            (Config { tp_size: 3, ..base }, "tp_size"),
            (
                Config {
                    num_splits: 0,
                    ..base
                },
                "num_splits",
            ),
            (
                Config {
                    num_max_streams: 9,
                    ..base
                },
                "num_max_streams",
            ),
            (
                Config {
                    num_comm_sm: 132,
                    ..base
                },
                "num_comm_sm",
            ),
            (
                Config {
                    timeout_ms: 0,
                    ..base
                },
                "timeout_ms",
            ),
            (
                Config {
                    transport: super::TransportChoice(7),
                    ..base
                },
                "transport",
            ),
        ] {
            let e = cfg.validate(4, 132).unwrap_err();
            assert!(e.msg.contains(word), "{word}: {}", e.msg);
        }
        assert_eq!(Config { tp_size: 2, ..base }.validate(4, 132).unwrap(), 2);
    }
}
