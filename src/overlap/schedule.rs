//! Schedules: which chunk goes to which peer at which step. Pure functions of the group
//! size, the rank and the shape, used by the algorithms and checked on the host against
//! a simulated group (every rank's schedule together, tp 1..=8, uneven sizes). Lists are
//! [`Small`] (on the stack): computing a call's schedule allocates nothing.
use crate::host::Small;
use crate::transport::MAX_PEERS;

/// Up to one entry per rank of a group.
pub type PerRank<T> = Small<T, MAX_PEERS>;
/// Chunk bounds: at most `MAX_SPLITS` chunks, so `MAX_SPLITS + 1` bounds.
pub type Bounds = Small<usize, { super::policy::MAX_SPLITS as usize + 1 }>;

/// One exchange step of a rank: send chunk `send` to `to`, receive chunk `recv` from
/// `from` (chunks / slots are indices in the buffer, in tp ranks' order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfer {
    pub to: usize,
    pub send: usize,
    pub from: usize,
    pub recv: usize,
}

/// Ring all-gather of `tp` chunks (chunk q starts on rank q): the steps of the forward
/// ring (to r+1, chunks travelling up), those of the backward ring (to r-1; empty unless
/// `bidirectional`), and the order in which rank `r` computes the chunks (its own first,
/// then in arrival order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgRing {
    pub forward: PerRank<Transfer>,
    pub backward: PerRank<Transfer>,
    pub order: PerRank<usize>,
}

pub fn ag_ring(tp: usize, r: usize, bidirectional: bool) -> AgRing {
    let (fwd, bwd) = if bidirectional {
        (tp / 2, tp - 1 - tp / 2)
    } else {
        (tp - 1, 0)
    };
    let (next, prev) = ((r + 1) % tp, (r + tp - 1) % tp);
    // Step s forwards chunk r-s (ours at s = 0, else the one received at step s-1) and
    // receives chunk r-s-1; the backward ring mirrors it.
    let forward = (0..fwd)
        .map(|s| Transfer {
            to: next,
            send: (r + tp - s) % tp,
            from: prev,
            recv: (r + 2 * tp - s - 1) % tp,
        })
        .collect();
    let backward = (0..bwd)
        .map(|s| Transfer {
            to: prev,
            send: (r + s) % tp,
            from: next,
            recv: (r + s + 1) % tp,
        })
        .collect();
    let mut order = PerRank::new();
    order.push(r);
    for s in 1..=fwd.max(bwd) {
        if s <= fwd {
            order.push((r + tp - s) % tp);
        }
        if s <= bwd {
            order.push((r + s) % tp);
        }
    }
    AgRing {
        forward,
        backward,
        order,
    }
}

/// The fused all-gather's ring: the backward ring alone (to r-1, from r+1), so that
/// rank `r` receives chunks r+1, r+2, ... in that order: the order in which our GEMM,
/// its tile rows rotated to start at chunk r, computes them.
pub fn ag_ring_backward(tp: usize, r: usize) -> AgRing {
    let (next, prev) = ((r + 1) % tp, (r + tp - 1) % tp);
    let backward = (0..tp.saturating_sub(1))
        .map(|s| Transfer {
            to: prev,
            send: (r + s) % tp,
            from: next,
            recv: (r + s + 1) % tp,
        })
        .collect();
    AgRing {
        forward: PerRank::new(),
        backward,
        order: (0..tp).map(|s| (r + s) % tp).collect(),
    }
}

/// The reduce-scatter by direct exchange (`split_rs_p2p`): rank `r` computes the partial
/// for destination `gemm_dest[i]` i-th (its own last), and at step i sends the partial for
/// `to` into slot r of `to`'s buffer while the partial of `from` for r lands in slot
/// `from` of its own (`send` / `recv` name those slots).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RsExchange {
    pub gemm_dest: PerRank<usize>,
    pub steps: PerRank<Transfer>,
}

pub fn rs_exchange(tp: usize, r: usize) -> RsExchange {
    RsExchange {
        gemm_dest: (0..tp).map(|i| (r + i + 1) % tp).collect(),
        steps: (0..tp.saturating_sub(1))
            .map(|i| {
                let from = (r + tp - i - 1) % tp;
                Transfer {
                    to: (r + i + 1) % tp,
                    send: r,
                    from,
                    recv: from,
                }
            })
            .collect(),
    }
}

/// The accumulating ring reduce-scatter (`split_rs_p2p` with the GEMMs summing): at step
/// i rank `r` computes its partial of row chunk `chunk[i]` and adds (GEMM with beta = 1)
/// the running sum of that chunk that `from` (r + 1) sent at step i - 1, which landed in
/// slot i - 1 of r's buffer; before the last step it sends the new running sum to `to`
/// (r - 1), into slot i of `to`'s buffer. The last step's chunk is r's own: the sum of
/// every rank's partial, with no closing reduction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RsChain {
    pub to: usize,
    pub from: usize,
    pub chunk: PerRank<usize>,
}

pub fn rs_chain(tp: usize, r: usize) -> RsChain {
    RsChain {
        to: (r + tp - 1) % tp,
        from: (r + 1) % tp,
        chunk: (0..tp).map(|i| (r + i + 1) % tp).collect(),
    }
}

/// Column bounds of the pipelined reduce-scatter's GEMM chunks (and row bounds of the
/// accumulating ring's pieces): at most `num_splits` chunks of `m` columns, interior
/// bounds on multiples of 16 (aligned chunk starts), none empty. `[0, .., m]`; just `[0]` when `m` is 0.
pub fn column_splits(m: usize, num_splits: usize) -> Bounds {
    let s = num_splits.clamp(1, m.div_ceil(16).max(1));
    let mut b: Bounds = (0..s).map(|i| (i * m / s) / 16 * 16).collect();
    b.push(m);
    b.dedup();
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every rank's ring together, step by step: each send is a chunk the sender holds,
    /// lands as the receiver's `recv` of the same step, and at the end every rank holds
    /// every chunk; each rank computes every chunk once, its own first, and never one
    /// that has not arrived.
    #[test]
    fn ring_all_gather_delivers_every_chunk_to_every_rank() {
        for tp in 1..=8 {
            // 0: forward, 1: bidirectional, 2: backward alone (the fused all-gather's)
            for bidi in [0, 1, 2] {
                let rings: Vec<AgRing> = (0..tp)
                    .map(|r| match bidi {
                        2 => ag_ring_backward(tp, r),
                        b => ag_ring(tp, r, b == 1),
                    })
                    .collect();
                let mut held: Vec<BTreeSet<usize>> = (0..tp).map(|r| BTreeSet::from([r])).collect();
                let mut arrival: Vec<Vec<usize>> = (0..tp).map(|r| vec![r]).collect();
                let steps = rings[0].forward.len().max(rings[0].backward.len());
                for s in 0..steps {
                    let mut landed = vec![];
                    for ring in [0, 1] {
                        for r in 0..tp {
                            let dir = if ring == 0 {
                                &rings[r].forward
                            } else {
                                &rings[r].backward
                            };
                            let Some(t) = dir.get(s) else { continue };
                            assert!(
                                held[r].contains(&t.send),
                                "tp {tp} rank {r} step {s}: sends {} it lacks",
                                t.send
                            );
                            let rx = if ring == 0 {
                                &rings[t.to].forward
                            } else {
                                &rings[t.to].backward
                            };
                            assert_eq!(
                                rx[s].from, r,
                                "tp {tp}: {} receives from {r} at step {s}",
                                t.to
                            );
                            assert_eq!(
                                rx[s].recv, t.send,
                                "tp {tp}: chunk of step {s} from {r} to {}",
                                t.to
                            );
                            landed.push((t.to, t.send));
                        }
                    }
                    for (r, c) in landed {
                        assert!(held[r].insert(c), "tp {tp}: rank {r} got chunk {c} twice");
                        arrival[r].push(c);
                    }
                }
                for r in 0..tp {
                    assert_eq!(
                        held[r].len(),
                        tp,
                        "tp {tp} bidi {bidi}: rank {r} holds {:?}",
                        held[r]
                    );
                    let order = &rings[r].order;
                    assert_eq!(order[0], r);
                    assert_eq!(order.iter().copied().collect::<BTreeSet<_>>().len(), tp);
                    // Computed in arrival order (so no GEMM waits for a later chunk).
                    assert_eq!(order, &arrival[r], "tp {tp} bidi {bidi} rank {r}");
                    if bidi == 2 {
                        // ascending from r: the rotated tile order of our GEMM
                        let want: Vec<usize> = (0..tp).map(|s| (r + s) % tp).collect();
                        assert_eq!(order.iter().copied().collect::<Vec<_>>(), want);
                    }
                }
            }
        }
    }

    /// Every ordered pair of ranks exchanges exactly once, both sides agreeing on the step
    /// and the slots; each partial is computed before the step that sends it.
    #[test]
    fn reduce_scatter_exchange_pairs_every_rank_with_every_other_once() {
        for tp in 1..=8 {
            let all: Vec<RsExchange> = (0..tp).map(|r| rs_exchange(tp, r)).collect();
            let mut pairs = BTreeSet::new();
            for (r, x) in all.iter().enumerate() {
                assert_eq!(
                    x.gemm_dest.iter().copied().collect::<BTreeSet<_>>().len(),
                    tp
                );
                assert_eq!(*x.gemm_dest.last().unwrap(), r, "own partial last");
                for (i, t) in x.steps.iter().enumerate() {
                    assert_ne!(t.to, r);
                    assert_eq!(
                        x.gemm_dest[i], t.to,
                        "partial for {} computed at step {i}",
                        t.to
                    );
                    let peer = &all[t.to].steps[i];
                    assert_eq!(
                        (peer.from, peer.recv),
                        (r, r),
                        "tp {tp}: step {i} {r} -> {}",
                        t.to
                    );
                    assert!(pairs.insert((r, t.to)));
                }
            }
            assert_eq!(pairs.len(), tp * (tp - 1));
        }
    }

    /// Every rank's chain together, step by step with the sums as sets of contributing
    /// ranks: what a rank adds to is exactly what its `from` sent the step before (into
    /// the slot it reads), nobody's partial of a chunk is added twice, and after the last
    /// step every rank holds its own chunk summed over all ranks.
    #[test]
    fn accumulating_ring_sums_every_partial_once_into_its_owner() {
        for tp in 1..=8 {
            let all: Vec<RsChain> = (0..tp).map(|r| rs_chain(tp, r)).collect();
            // in_flight[r]: (slot, chunk, contributors) that landed in r's buffer.
            let mut landed: Vec<Vec<(usize, usize, BTreeSet<usize>)>> = vec![vec![]; tp];
            let mut result: Vec<Option<(usize, BTreeSet<usize>)>> = vec![None; tp];
            for i in 0..tp {
                let mut sent = vec![];
                for (r, x) in all.iter().enumerate() {
                    assert_eq!(all[x.to].from, r, "tp {tp}: {r}'s successor");
                    let c = x.chunk[i];
                    let mut sum = if i == 0 {
                        BTreeSet::new()
                    } else {
                        let (slot, chunk, s) = landed[r]
                            .iter()
                            .find(|(slot, _, _)| *slot == i - 1)
                            .cloned()
                            .expect("the running sum of the step before landed");
                        assert_eq!((slot, chunk), (i - 1, c), "tp {tp} rank {r} step {i}");
                        s
                    };
                    assert!(sum.insert(r), "tp {tp}: {r}'s partial of {c} added twice");
                    if i + 1 == tp {
                        result[r] = Some((c, sum));
                    } else {
                        sent.push((x.to, i, c, sum));
                    }
                }
                for (to, slot, c, sum) in sent {
                    landed[to].push((slot, c, sum));
                }
            }
            for (r, res) in result.into_iter().enumerate() {
                let (c, sum) = res.unwrap();
                assert_eq!(c, r, "tp {tp}: rank {r} ends with its own chunk");
                assert_eq!(sum, (0..tp).collect(), "tp {tp}: rank {r}'s sum");
                // Slots 0..tp-1 of the buffer each written once per call.
                let slots: BTreeSet<usize> = landed[r].iter().map(|x| x.0).collect();
                assert_eq!(slots.len(), tp - 1);
            }
        }
    }

    #[test]
    fn column_splits_cover_the_columns_in_aligned_nonempty_chunks() {
        for m in 0..300 {
            for s in 1..=9 {
                let b = column_splits(m, s);
                assert_eq!(b[0], 0);
                assert_eq!(*b.last().unwrap(), m);
                assert!(b.len() - 1 <= s.max(1));
                assert!(b.windows(2).all(|w| w[0] < w[1]), "m {m} s {s}: {b:?}");
                assert!(
                    b[..b.len() - 1].iter().all(|x| x % 16 == 0),
                    "m {m} s {s}: {b:?}"
                );
            }
        }
    }
}
