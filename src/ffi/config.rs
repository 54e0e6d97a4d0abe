//! The C API's engine settings, `NVTECommOverlapConfig`: the `repr(C)` struct the header
//! declares (cbindgen exports [`Config`] under that name). It lives at the C boundary
//! only: the engine takes `overlap::config::EngineConfig`.
use crate::overlap::config::{EngineConfig, TransportChoice};

/// Engine settings. Fill with nvte_comm_overlap_config_default() (TE's defaults plus the
/// environment overrides), then change fields. `struct_size` must be sizeof(the struct).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub struct_size: usize,
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
    /// NVTE_COMM_TRANSPORT_AUTO (default: IPC when the group is on one node, else NCCL),
    /// NVTE_COMM_TRANSPORT_IPC or NVTE_COMM_TRANSPORT_NCCL (env NVTE_COMM_TRANSPORT)
    pub transport: TransportChoice,
}

impl Config {
    /// The engine's config of these settings.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            tp_size: self.tp_size,
            num_splits: self.num_splits,
            num_max_streams: self.num_max_streams,
            comm_cga_size: self.comm_cga_size,
            num_comm_sm: self.num_comm_sm,
            set_sm_margin: self.set_sm_margin,
            use_ce: self.use_ce,
            aggregate: self.aggregate,
            atomic_gemm: self.atomic_gemm,
            gemm_priority: self.gemm_priority,
            comm_priority: self.comm_priority,
            timeout_ms: self.timeout_ms,
            transport: self.transport,
        }
    }

    /// The C struct of the engine's settings `e` (`struct_size` set).
    pub fn of(e: &EngineConfig) -> Config {
        Config {
            struct_size: std::mem::size_of::<Config>(),
            tp_size: e.tp_size,
            num_splits: e.num_splits,
            num_max_streams: e.num_max_streams,
            comm_cga_size: e.comm_cga_size,
            num_comm_sm: e.num_comm_sm,
            set_sm_margin: e.set_sm_margin,
            use_ce: e.use_ce,
            aggregate: e.aggregate,
            atomic_gemm: e.atomic_gemm,
            gemm_priority: e.gemm_priority,
            comm_priority: e.comm_priority,
            timeout_ms: e.timeout_ms,
            transport: e.transport,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Config;
    use crate::overlap::config::EngineConfig;

    #[test]
    fn the_c_config_round_trips_through_the_engine_config() {
        let e = EngineConfig {
            tp_size: 2,
            num_splits: 5,
            timeout_ms: 1234,
            use_ce: false,
            ..EngineConfig::from_env().unwrap()
        };
        let c = Config::of(&e);
        assert_eq!(c.struct_size, std::mem::size_of::<Config>());
        assert_eq!(c.engine(), e);
    }
}
