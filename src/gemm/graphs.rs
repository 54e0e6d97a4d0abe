//! CUDA graphs of cuBLASLt matmuls (NVTE_COMM_GEMM_GRAPHS, default on).
//!
//! Inside a training step, where Python and the framework run between the library's calls,
//! a `cublasLtMatmul` costs 27-34 us of host time (about 5 us back to back), and one GEMM
//! through torch or the library 47-75 us after a few torch ops, against 7.5-11.7 us for the
//! replay of a one-GEMM CUDA graph (one H100, `bench/cold_host.py`, bench/RESULTS.md,
//! 2026-11-26, seventh session). A plan therefore keeps, per call whose pointers it has seen
//! before, the matmul captured as a graph, and replays it: the same kernel with the same
//! arguments, so the same result, for one `cuGraphLaunch`.
//!
//! The policy ([`Graphs`]) is a value, tested on the host: a pointer set is captured on
//! its second call (a workload whose buffers change every call never pays for a capture);
//! a plan keeps at most [`MAX_CALLS`] pointer sets, the least recently used one making
//! room; a capture that fails turns the plan's graphs off, and so does a plan whose
//! graphs are seldom replayed (its pointer sets cycle through more than it keeps: at
//! [`CAPTURE_LIMIT`] captures, fewer than [`MIN_REPLAYS`] replays a capture). Streams
//! being captured (the user's own CUDA graphs) always take the direct call.
use crate::cuda::resources::Stream;
use crate::cuda::{GraphExecHandle, StreamHandle, check};
use crate::error::Result;
use cudarc::driver::sys as cu;

/// Pointer sets (calls) a plan keeps graphs or sightings for.
const MAX_CALLS: usize = 8;
/// Captures after which a plan's graphs must have paid: see [`MIN_REPLAYS`].
const CAPTURE_LIMIT: u64 = 16;
/// Replays a capture a plan must average by [`CAPTURE_LIMIT`] captures, else its calls go
/// direct (a capture and an instantiation cost far more host time than a direct call).
const MIN_REPLAYS: u64 = 4;

/// What, besides the plan, fixes a matmul launch: every pointer it is given (A, B, C, D,
/// workspace, bias, aux, the four FP8 scale / amax pointers) and beta (accumulate); and
/// the stream it is launched on: the driver orders each launch of a graph behind its
/// previous launch, so a graph replayed on several streams would tie them together (an
/// order the direct calls do not have; with the overlap engines' device-side waits, a
/// possible deadlock). One graph per stream keeps that order the stream's own.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CallKey {
    pub ptrs: [u64; 11],
    pub accumulate: bool,
    pub stream: StreamHandle,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// seen once, not captured
    Seen,
    /// an instantiated graph (CUgraphExec)
    Exec(GraphExecHandle),
}

/// What [`Graphs::decide`] says to do with a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// replay this graph
    Launch(GraphExecHandle),
    /// capture the call (then [`Graphs::captured`] or [`Graphs::failed`])
    Capture,
    /// call cuBLASLt directly
    Direct,
    /// call cuBLASLt directly, now and from now on: the plan's graphs are seldom replayed
    /// (the caller destroys them: [`Graphs::take`])
    TurnedOff,
}

/// A plan's graphs: the policy's state (host-testable; the graphs themselves are opaque
/// handles that the caller creates and destroys).
#[derive(Default)]
pub struct Graphs {
    calls: Vec<(CallKey, Slot, u64)>,
    clock: u64,
    off: bool,
    captures: u64,
    replays: u64,
}

impl Graphs {
    /// The action for `key`; `capturing`: the caller's stream is being captured.
    /// A new key may evict the least recently used one: a graph it held is returned
    /// through `evicted` for the caller to destroy.
    pub fn decide(
        &mut self,
        key: &CallKey,
        capturing: bool,
        evicted: &mut Option<GraphExecHandle>,
    ) -> Action {
        if self.off || capturing {
            return Action::Direct;
        }
        self.clock += 1;
        if let Some(c) = self.calls.iter_mut().find(|c| c.0 == *key) {
            c.2 = self.clock;
            return match c.1 {
                Slot::Exec(e) => {
                    self.replays += 1;
                    Action::Launch(e)
                }
                Slot::Seen
                    if self.captures >= CAPTURE_LIMIT
                        && self.replays < MIN_REPLAYS * self.captures =>
                {
                    self.off = true;
                    Action::TurnedOff
                }
                Slot::Seen => {
                    self.captures += 1;
                    Action::Capture
                }
            };
        }
        if self.calls.len() >= MAX_CALLS {
            let lru = (0..self.calls.len())
                .min_by_key(|&i| self.calls[i].2)
                .unwrap_or(0);
            if let Slot::Exec(e) = self.calls.swap_remove(lru).1 {
                *evicted = Some(e);
            }
        }
        self.calls.push((*key, Slot::Seen, self.clock));
        Action::Direct
    }

    /// `key`'s capture succeeded: replay `exec` from now on.
    pub fn captured(&mut self, key: &CallKey, exec: GraphExecHandle) {
        if let Some(c) = self.calls.iter_mut().find(|c| c.0 == *key) {
            c.1 = Slot::Exec(exec);
        }
    }

    /// Whether the plan's calls go direct for good (a failed capture, too few replays).
    #[cfg(test)]
    fn off(&self) -> bool {
        self.off
    }

    /// A capture failed: the plan calls cuBLASLt directly from now on. Returns the graphs
    /// held, for the caller to destroy.
    pub fn failed(&mut self) -> Vec<GraphExecHandle> {
        self.off = true;
        self.take()
    }

    /// Every graph held (the plan is going away), forgetting them.
    pub fn take(&mut self) -> Vec<GraphExecHandle> {
        self.calls
            .drain(..)
            .filter_map(|c| match c.1 {
                Slot::Exec(e) => Some(e),
                Slot::Seen => None,
            })
            .collect()
    }
}

/// Capture what `f` enqueues on a private stream as a graph and instantiate it
/// (CUgraphExec). The capture is thread-local: other threads' calls are not affected. Our
/// own stream creation, instantiation and releases run with this thread's capture mode
/// relaxed (they must neither be refused nor invalidate a global-mode capture another
/// thread makes meanwhile); `f` runs in the caller's mode, so that a call it makes that a
/// capture cannot hold fails the capture (and the caller calls directly) instead of
/// running outside the graph.
pub fn capture(f: impl FnOnce(StreamHandle) -> Result<()>) -> Result<GraphExecHandle> {
    use crate::cuda::resources::with_relaxed_capture;
    let s = with_relaxed_capture(|| Stream::new(0))?;
    let st = s.raw().cu();
    // SAFETY: a stream of ours, not being captured.
    check(
        unsafe {
            cu::cuStreamBeginCapture_v2(
                st,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        },
        "cuStreamBeginCapture",
    )?;
    let r = f(s.raw());
    let mut graph: cu::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above (also when `f` failed: the stream is left clean).
    let end = unsafe { cu::cuStreamEndCapture(st, &mut graph) };
    let inst = r
        .and_then(|_| check(end, "cuStreamEndCapture"))
        .and_then(|_| {
            with_relaxed_capture(|| {
                let mut exec: cu::CUgraphExec = std::ptr::null_mut();
                // SAFETY: a graph just captured; out pointer.
                check(
                    unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
                    "cuGraphInstantiateWithFlags",
                )
                .map(|_| GraphExecHandle::from_raw(exec))
            })
        });
    if !graph.is_null() {
        crate::cuda::resources::release_relaxed(|| {
            // SAFETY: the captured graph; its instantiation (if any) does not need it.
            unsafe { cu::cuGraphDestroy(graph) }
        });
    }
    inst
}

/// Replay `exec` on `stream`.
pub fn launch(exec: GraphExecHandle, stream: StreamHandle) -> Result<()> {
    // SAFETY: an instantiated graph of this context.
    check(
        unsafe { cu::cuGraphLaunch(exec.raw(), stream.cu()) },
        "cuGraphLaunch",
    )
}

/// Destroy graphs (a launch still running completes first: the driver frees it then).
pub fn destroy(execs: impl IntoIterator<Item = GraphExecHandle>) {
    for e in execs {
        crate::cuda::resources::release_relaxed(|| {
            // SAFETY: instantiated by `capture`, destroyed once.
            unsafe { cu::cuGraphExecDestroy(e.raw()) }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph handle for the policy (never launched).
    fn x(i: usize) -> GraphExecHandle {
        GraphExecHandle::from_addr(i)
    }

    fn key(i: usize) -> CallKey {
        CallKey {
            ptrs: [i as u64; 11],
            accumulate: false,
            stream: StreamHandle::from_raw(7),
        }
    }

    #[test]
    fn second_call_captures_then_replays() {
        let mut g = Graphs::default();
        let mut ev = None;
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Direct);
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Capture);
        g.captured(&key(1), x(77));
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Launch(x(77)));
        // Another pointer set, beta or stream is another call.
        let mut acc = key(1);
        acc.accumulate = true;
        assert_eq!(g.decide(&acc, false, &mut ev), Action::Direct);
        let mut other_stream = key(1);
        other_stream.stream = StreamHandle::from_raw(8);
        assert_eq!(g.decide(&other_stream, false, &mut ev), Action::Direct);
        assert_eq!(g.decide(&key(2), false, &mut ev), Action::Direct);
        assert_eq!(ev, None);
    }

    #[test]
    fn capturing_stream_and_failure_go_direct() {
        let mut g = Graphs::default();
        let mut ev = None;
        g.decide(&key(1), false, &mut ev);
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Capture);
        g.captured(&key(1), x(5));
        assert_eq!(g.decide(&key(1), true, &mut ev), Action::Direct);
        g.decide(&key(2), false, &mut ev);
        assert_eq!(g.decide(&key(2), false, &mut ev), Action::Capture);
        assert_eq!(g.failed(), vec![x(5)]);
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Direct);
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Direct);
    }

    #[test]
    fn unreplayed_captures_stop_capturing() {
        // Pointer sets each called twice and never again (a capture each, no replay): at
        // CAPTURE_LIMIT captures the plan goes direct; a plan whose graphs are replayed
        // keeps them.
        let mut g = Graphs::default();
        let mut ev = None;
        let (mut captures, mut turned_off) = (0, 0);
        for i in 0..100 {
            for _ in 0..2 {
                match g.decide(&key(i), false, &mut ev) {
                    Action::Capture => {
                        captures += 1;
                        g.captured(&key(i), x(1000 + i));
                    }
                    Action::TurnedOff => {
                        turned_off += 1;
                        // The caller destroys what the plan holds: the graphs of the other
                        // pointer sets it keeps (this one's was never captured).
                        assert_eq!(g.take().len(), MAX_CALLS - 1);
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(turned_off, 1);
        assert!(g.off() && captures as u64 == CAPTURE_LIMIT, "{captures}");
        let mut h = Graphs::default();
        for round in 0..100 {
            for i in 0..MAX_CALLS {
                match h.decide(&key(i), false, &mut ev) {
                    Action::Capture => h.captured(&key(i), x(i)),
                    Action::Launch(e) => assert_eq!(e, x(i)),
                    Action::Direct => assert!(round == 0),
                    Action::TurnedOff => panic!("a replayed plan turned off"),
                }
            }
        }
        assert!(!h.off());
    }

    #[test]
    fn least_recently_used_call_makes_room() {
        let mut g = Graphs::default();
        let mut ev = None;
        for i in 0..MAX_CALLS {
            g.decide(&key(i), false, &mut ev);
            g.decide(&key(i), false, &mut ev);
            g.captured(&key(i), x(100 + i));
        }
        // key(0) used again: key(1) is now the least recently used.
        assert_eq!(g.decide(&key(0), false, &mut ev), Action::Launch(x(100)));
        assert_eq!(g.decide(&key(99), false, &mut ev), Action::Direct);
        assert_eq!(ev, Some(x(101)));
        ev = None;
        assert_eq!(g.decide(&key(1), false, &mut ev), Action::Direct); // seen again: evicts key(2)
        assert_eq!(ev, Some(x(102)));
        let left = g.take();
        assert_eq!(left.len(), MAX_CALLS - 2);
        assert!(left.contains(&x(100)) && !left.contains(&x(101)) && !left.contains(&x(102)));
    }
}
