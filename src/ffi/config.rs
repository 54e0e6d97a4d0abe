//! The C API's engine settings, `NVTECommOverlapConfig`: the `repr(C)` struct the header
//! declares (cbindgen exports [`Config`] under that name). It lives at the C boundary
//! only: the engine runs by the `overlap::Policy` made of it ([`Config::policy`]).
use crate::overlap::TransportChoice;
use crate::overlap::policy::{Comm, Direction, Pins, Policy, Streams};

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
    /// NVTE_COMM_TRANSPORT_AUTO (default: IPC when every group of the world is on one node,
    /// else NCCL: all groups take one transport, as its creation exchanges over the world),
    /// NVTE_COMM_TRANSPORT_IPC or NVTE_COMM_TRANSPORT_NCCL (env NVTE_COMM_TRANSPORT; every
    /// rank must give the same)
    pub transport: TransportChoice,
}

impl Config {
    /// The policy of these settings, with the environment's pins `pins` (read by the
    /// creator: `overlap::Pins::from_env`) and TE's defaults for the per-call choices the
    /// C struct does not hold.
    pub fn policy(&self, pins: Pins) -> Policy {
        Policy {
            tp_size: self.tp_size,
            transport: self.transport,
            timeout_ms: self.timeout_ms,
            streams: Streams {
                compute: self.num_max_streams,
                cga_size: self.comm_cga_size,
                gemm_priority: self.gemm_priority,
                comm_priority: self.comm_priority,
            },
            atomic_gemm: self.atomic_gemm,
            pins,
            comm: Comm {
                use_ce: self.use_ce,
                sms: self.num_comm_sm,
                sm_margin: self.set_sm_margin,
            },
            splits: self.num_splits,
            direction: if self.aggregate {
                Direction::BothWays
            } else {
                Direction::OneWay
            },
            ..Policy::te_defaults()
        }
    }

    /// The C struct of the policy `p`'s config fields (`struct_size` set).
    pub fn of(p: &Policy) -> Config {
        Config {
            struct_size: std::mem::size_of::<Config>(),
            tp_size: p.tp_size,
            num_splits: p.splits,
            num_max_streams: p.streams.compute,
            comm_cga_size: p.streams.cga_size,
            num_comm_sm: p.comm.sms,
            set_sm_margin: p.comm.sm_margin,
            use_ce: p.comm.use_ce,
            aggregate: p.bidirectional(),
            atomic_gemm: p.atomic_gemm,
            gemm_priority: p.streams.gemm_priority,
            comm_priority: p.streams.comm_priority,
            timeout_ms: p.timeout_ms,
            transport: p.transport,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Config;
    use crate::overlap::policy::Direction;
    use crate::overlap::{Pins, Policy};

    #[test]
    fn the_c_config_round_trips_through_the_policy() {
        let p = Policy {
            tp_size: 2,
            splits: 5,
            timeout_ms: 1234,
            direction: Direction::BothWays,
            ..Policy::from_env().unwrap()
        };
        let mut p = p;
        p.comm.use_ce = false;
        let c = Config::of(&p);
        assert_eq!(c.struct_size, std::mem::size_of::<Config>());
        assert_eq!(c.policy(Pins::default()), p);
        let pins = Pins {
            rs_ring: Some(2),
            ..Pins::default()
        };
        assert_eq!(c.policy(pins).pins, pins);
    }
}
