//! NVTE_COMM_CHECK's host-side agreement of a comm-GEMM call: before any collective step
//! of the call (engine creation, autotuning, the engine's own exchanges), every rank
//! gathers every rank's [`Record`] of the call through the context's bootstrap and
//! compares them. Ranks that called differently would otherwise take different
//! host-side paths (one rank tunes a new key or grows an engine while its peers run the
//! call), so the in-kernel check at the arrival barrier would never be reached: the
//! ranks would wait for each other in different places until the timeout. Compared
//! first, every rank sees the same records and returns the same verdict: the mismatch,
//! with nothing enqueued on any rank (the context stays usable).
//!
//! Eager calls only: a captured call cannot wait for its peers on the host (the
//! in-kernel check at the arrival barrier applies to it, and to every replay).
use super::{GemmCall, Kind};
use crate::error::{Error, ErrorKind, Result};
use crate::tensor::DType;

/// Bytes of a record on the wire.
pub(crate) const RECORD_BYTES: usize = 48;

/// The element types, by their index in a record (`DType as u8`).
const DTYPES: [DType; 11] = [
    DType::Byte,
    DType::Int16,
    DType::Int32,
    DType::Int64,
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::E4M3,
    DType::E5M2,
    DType::E8M0,
    DType::E2M1,
];
/// "No tensor" in a record's type list.
const NONE: u8 = 0xff;

const FLAG_NAMES: [&str; 7] = [
    "transa",
    "transb",
    "grad",
    "accumulate",
    "algo default (autotuned)",
    "prepare",
    "b_gathered",
];

/// What every rank's call must agree on: the call's number on the context, the
/// operation, the global sizes, the element types (a, b, d, bias, pre_act_out), the
/// flags, and the host path the context will take for it (it autotunes; the context's
/// NVTE_COMM_TUNE), plus whether this rank's own argument checks failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub seq: u64,
    pub failed: bool,
    pub kind: u8,
    pub dims: [i64; 3],
    pub types: [u8; 5],
    pub flags: u8,
    pub path: u8,
}

fn kind_of(k: u8) -> Option<Kind> {
    [Kind::AllGather, Kind::ReduceScatter, Kind::AllReduce]
        .get(k as usize)
        .copied()
}

impl Record {
    /// The record of call `seq` of a context (`tunes`: this call autotunes;
    /// `tune_mode`: the context's NVTE_COMM_TUNE as 0 / 1 / 2).
    pub fn of(c: &GemmCall, seq: u64, failed: bool, preparing: bool, path: (bool, u8)) -> Record {
        let t = |x: Option<&crate::tensor::Tensor>| x.map_or(NONE, |t| t.data.dtype as u8);
        let bits = [
            c.transa,
            c.transb,
            c.grad,
            c.accumulate,
            c.tune,
            preparing,
            c.b_gathered.is_some(),
        ];
        Record {
            seq,
            failed,
            kind: c.kind as u8,
            dims: [c.m, c.n, c.k],
            types: [
                t(Some(c.a)),
                t(Some(c.b)),
                t(Some(c.d)),
                t(c.bias),
                t(c.pre_act_out),
            ],
            flags: bits
                .iter()
                .enumerate()
                .fold(0u8, |f, (i, &b)| f | ((b as u8) << i)),
            path: path.0 as u8 | (path.1 << 1),
        }
    }

    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[..8].copy_from_slice(&self.seq.to_le_bytes());
        for (i, d) in self.dims.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&d.to_le_bytes());
        }
        b[32] = self.failed as u8;
        b[33] = self.kind;
        b[34..39].copy_from_slice(&self.types);
        b[39] = self.flags;
        b[40] = self.path;
        b
    }

    pub fn decode(b: &[u8]) -> Record {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Record {
            seq: word(0),
            dims: [word(8) as i64, word(16) as i64, word(24) as i64],
            failed: b[32] != 0,
            kind: b[33],
            types: b[34..39].try_into().unwrap(),
            flags: b[39],
            path: b[40],
        }
    }

    /// Everything but this rank's own verdict on its arguments.
    fn same_call(&self, o: &Record) -> bool {
        Record {
            failed: false,
            ..*self
        } == Record {
            failed: false,
            ..*o
        }
    }

    /// The call as its C function with its arguments (for messages).
    pub fn describe(&self) -> String {
        let name = kind_of(self.kind).map_or("an unknown operation", |k| k.api_name());
        let ty = |t: u8| {
            DTYPES
                .get(t as usize)
                .map_or("none".to_string(), |d| d.name().to_string())
        };
        let [m, n, k] = self.dims;
        let mut s = format!(
            "{name}(m = {m}, n = {n}, k = {k}, a {}, b {}, d {}",
            ty(self.types[0]),
            ty(self.types[1]),
            ty(self.types[2])
        );
        for (i, what) in [(3, "bias"), (4, "pre_act_out")] {
            if self.types[i] != NONE {
                s += &format!(", {what} {}", ty(self.types[i]));
            }
        }
        for (i, f) in FLAG_NAMES.iter().enumerate() {
            if self.flags & (1 << i) != 0 {
                s += &format!(", {f}");
            }
        }
        s += &format!(
            "; {}NVTE_COMM_TUNE={})",
            if self.path & 1 != 0 {
                "autotunes now, "
            } else {
                ""
            },
            ["0", "1", "force"]
                .get((self.path >> 1) as usize)
                .unwrap_or(&"?")
        );
        s
    }
}

/// The verdict on the gathered records `all` (every rank's, in rank order) of world rank
/// `me`: Ok when every rank made the same call and none failed its own argument checks.
/// Every rank computes it from the same records, so every rank returns an error when one
/// does.
pub(crate) fn verdict(all: &[u8], me: usize) -> Result<()> {
    let recs: Vec<Record> = all.chunks_exact(RECORD_BYTES).map(Record::decode).collect();
    let Some(mine) = recs.get(me) else {
        return Err(Error::internal(format!(
            "the cross-rank check's exchange returned {} records for world rank {me}",
            recs.len()
        )));
    };
    if let Some((q, other)) = recs
        .iter()
        .enumerate()
        .find(|(q, r)| *q != me && !r.same_call(mine))
    {
        let which = if other.seq != mine.seq {
            " (their calls on this context are numbered differently: a rank made more or fewer calls, or captured a call its peers made eagerly)"
        } else {
            ""
        };
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "cross-rank check (NVTE_COMM_CHECK): world rank {q} called {} as call {} but this rank (world rank {me}) called {} as call {}{which}: every rank of the group must make the same calls with the same global sizes, types and flags, and its context the same choices (NVTE_COMM_TUNE). Compared on the host before any collective step: nothing was enqueued on any rank, and the context stays usable",
                other.describe(),
                other.seq,
                mine.describe(),
                mine.seq
            ),
        ));
    }
    if !mine.failed
        && let Some(q) = recs.iter().position(|r| r.failed)
    {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "cross-rank check (NVTE_COMM_CHECK): world rank {q} called {} as call {} like this rank, but its arguments failed its own checks (its error says why): nothing was enqueued on any rank, and the context stays usable",
                recs[q].describe(),
                recs[q].seq
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(m: i64) -> Record {
        Record {
            seq: 31,
            failed: false,
            kind: Kind::AllGather as u8,
            dims: [m, 512, 256],
            types: [
                DType::BF16 as u8,
                DType::BF16 as u8,
                DType::BF16 as u8,
                NONE,
                NONE,
            ],
            flags: 0b1_0001,
            path: 2,
        }
    }

    fn gather(rs: &[Record]) -> Vec<u8> {
        rs.iter().flat_map(|r| r.encode()).collect()
    }

    #[test]
    fn records_round_trip() {
        let mut r = rec(-3);
        r.failed = true;
        r.path = 5;
        assert_eq!(Record::decode(&r.encode()), r);
        assert!(DTYPES.iter().enumerate().all(|(i, d)| *d as usize == i));
    }

    #[test]
    fn every_rank_names_a_peer_when_the_last_rank_differs() {
        for np in [2usize, 4] {
            let mut rs = vec![rec(512); np];
            rs[np - 1] = rec(1024);
            let all = gather(&rs);
            for me in 0..np {
                let e = verdict(&all, me).unwrap_err();
                assert_eq!(e.kind, ErrorKind::InvalidArgument);
                assert!(e.msg.contains("cross-rank check"), "{}", e.msg);
                let peer = if me == np - 1 { 0 } else { np - 1 };
                assert!(
                    e.msg.contains(&format!(
                        "world rank {peer} called nvte_all_gather_gemm(m = "
                    )),
                    "{}",
                    e.msg
                );
            }
        }
    }

    #[test]
    fn agreeing_ranks_pass_and_a_failed_peer_is_reported() {
        let rs = vec![rec(512); 4];
        for me in 0..4 {
            verdict(&gather(&rs), me).unwrap();
        }
        let mut rs2 = rs.clone();
        rs2[2].failed = true;
        let all = gather(&rs2);
        // The failed rank returns its own error (the caller's); the others name it.
        verdict(&all, 2).unwrap();
        for me in [0, 1, 3] {
            let e = verdict(&all, me).unwrap_err();
            assert!(e.msg.contains("world rank 2 called"), "{}", e.msg);
        }
    }

    #[test]
    fn the_host_path_and_the_call_number_count() {
        let mut rs = vec![rec(512); 2];
        rs[1].path = 3; // rank 1 autotunes this call, rank 0 does not
        assert!(
            verdict(&gather(&rs), 0)
                .unwrap_err()
                .msg
                .contains("autotunes now")
        );
        let mut rs = vec![rec(512); 2];
        rs[0].seq = 30;
        assert!(
            verdict(&gather(&rs), 1)
                .unwrap_err()
                .msg
                .contains("numbered differently")
        );
    }
}
