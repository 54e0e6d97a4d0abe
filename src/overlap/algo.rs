//! A call's algorithm: chosen from the policy, the transport's capabilities and the
//! call's arguments ([`Planner::algo_of`], each operation's rule in its module), then
//! planned by the variant's method ([`Planner::plan`]). Adding an algorithm is a variant
//! of [`Algo`], its method here and in its module, its rule, and its protocol tests.
use super::ag::AgArgs;
use super::ar::ArArgs;
use super::bulk::BulkArgs;
use super::plan::Planner;
use super::policy::Algo;
use super::rs::RsArgs;
use crate::error::{Error, Result};

/// A call's operation and its arguments.
#[derive(Clone, Copy)]
pub enum Call<'a> {
    /// split_ag: all-gather + GEMM
    Ag(&'a AgArgs<'a>),
    /// split_rs: GEMM + reduce-scatter, pipelined where it can be
    Rs(&'a RsArgs<'a>),
    /// split_rs_p2p: GEMM + reduce-scatter by the ring
    RsP2p(&'a RsArgs<'a>),
    /// split_ar: GEMM + all-reduce
    Ar(&'a ArArgs<'a>),
    /// bulk all-gather / reduce-scatter beside a GEMM
    Bulk(&'a BulkArgs<'a>),
}

impl Call<'_> {
    fn name(&self) -> &'static str {
        match self {
            Call::Ag(_) => "split_ag",
            Call::Rs(_) => "split_rs",
            Call::RsP2p(_) => "split_rs_p2p",
            Call::Ar(_) => "split_ar",
            Call::Bulk(_) => "bulk",
        }
    }
}

impl Planner<'_> {
    /// The algorithm of `call` (its arguments' checks that the choice needs come first).
    pub fn algo_of(&self, call: &Call) -> Result<Algo> {
        match call {
            Call::Ag(x) => Ok(self.ag_algo(x)),
            Call::Rs(x) => self.rs_algo(x),
            Call::RsP2p(x) => self.rs_p2p_algo(x),
            Call::Ar(x) => self.ar_algo(x),
            Call::Bulk(_) => Ok(Algo::Bulk {
                use_ce: self.e.policy.comm.use_ce,
            }),
        }
    }

    /// The call with its own algorithm ([`Self::algo_of`]).
    pub fn plan_call(&mut self, call: &Call) -> Result<()> {
        let algo = self.algo_of(call)?;
        self.plan(algo, call)
    }

    /// Plan `call` with `algo` (an algorithm of another operation is an internal error),
    /// and note the algorithm in the plan (NVTE_COMM_REPORT prints it).
    pub fn plan(&mut self, algo: Algo, call: &Call) -> Result<()> {
        self.plan.algo = Some(algo);
        match (algo, *call) {
            (
                Algo::RingAg {
                    bidirectional,
                    pieces,
                },
                Call::Ag(x),
            ) => self.ring_ag(x, bidirectional, pieces),
            (
                Algo::FusedAg {
                    pieces,
                    k_slices,
                    tiles,
                },
                Call::Ag(x),
            ) => self.fused_ag(x, pieces, k_slices, tiles),
            (Algo::GatherThenGemm, Call::Ag(x)) => self.gather_then_gemm(x),
            (Algo::PipelinedRs { splits }, Call::Rs(x) | Call::RsP2p(x)) => {
                self.pipelined_rs(x, splits)
            }
            (Algo::CollectiveRs { splits }, Call::Rs(x) | Call::RsP2p(x)) => {
                self.collective_rs(x, splits)
            }
            (Algo::RingRs(ring), Call::Rs(x) | Call::RsP2p(x)) => self.ring_rs_call(x, ring),
            (Algo::RingAr(ring), Call::Ar(x)) => self.ring_ar_call(x, ring),
            (Algo::ChunkedAr { splits }, Call::Ar(x)) => self.chunked_ar_call(x, splits),
            (Algo::GemmOnly, Call::Ar(x)) => self.gemm_only_ar(x),
            (Algo::Bulk { use_ce }, Call::Bulk(x)) => self.bulk_call(x, use_ce),
            #[cfg(test)]
            (Algo::Noop, _) => self.noop(),
            (a, c) => Err(Error::internal(format!(
                "algorithm {a} cannot run a {} call",
                c.name()
            ))),
        }
    }

    /// split_ag: [`Self::plan_call`] of an all-gather + GEMM.
    pub fn split_ag(&mut self, x: &AgArgs) -> Result<()> {
        self.plan_call(&Call::Ag(x))
    }
    /// split_rs: [`Self::plan_call`] of a GEMM + reduce-scatter (pipelined).
    pub fn split_rs(&mut self, x: &RsArgs) -> Result<()> {
        self.plan_call(&Call::Rs(x))
    }
    /// split_rs_p2p: [`Self::plan_call`] of a GEMM + reduce-scatter (ring).
    pub fn split_rs_p2p(&mut self, x: &RsArgs) -> Result<()> {
        self.plan_call(&Call::RsP2p(x))
    }
    /// split_ar: [`Self::plan_call`] of a GEMM + all-reduce.
    pub fn split_ar(&mut self, x: &ArArgs) -> Result<()> {
        self.plan_call(&Call::Ar(x))
    }
    /// [`Self::plan_call`] of a bulk collective beside a GEMM.
    pub fn bulk(&mut self, x: &BulkArgs) -> Result<()> {
        self.plan_call(&Call::Bulk(x))
    }

    /// [`Algo::Noop`] (test fixture): a call that begins and finishes with nothing
    /// between, on any transport and at any tp.
    #[cfg(test)]
    fn noop(&mut self) -> Result<()> {
        self.begin(super::Op::SplitAg, false, &[0], None);
        self.finish();
        Ok(())
    }
}
