//! Handle values for the C API's opaque objects (tensors, overlap objects, contexts).
//!
//! A handle is a keyed bijection of a sequence number: `mix(seq ^ key)` with a random
//! per-process key. Distinct objects get distinct handles, and a corrupted handle value
//! (a flipped bit, a neighbour, a stale value from another process) is a live handle
//! only with negligible probability, so it is reported as "not live" instead of
//! silently acting on another object.
use std::sync::atomic::{AtomicU64, Ordering};

fn key() -> u64 {
    static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KEY.get_or_init(|| {
        let mut k = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `k`.
        let n = unsafe { libc::getrandom(k.as_mut_ptr().cast(), k.len(), 0) };
        let mut v = u64::from_ne_bytes(k);
        if n != 8 {
            // No getrandom: time and pid still differ between processes and runs.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            v ^= t ^ ((std::process::id() as u64) << 32);
        }
        v
    })
}

/// splitmix64's finaliser: a bijection of u64 that spreads every input bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A fresh handle value, never 0 and never repeated within the process.
pub fn next() -> usize {
    static SEQ: AtomicU64 = AtomicU64::new(1);
    loop {
        let h = mix(SEQ.fetch_add(1, Ordering::Relaxed) ^ key()) as usize;
        if h != 0 {
            return h;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_distinct_and_flipped_bits_are_not_neighbours() {
        let hs: Vec<usize> = (0..10_000).map(|_| next()).collect();
        let set: std::collections::HashSet<usize> = hs.iter().copied().collect();
        assert_eq!(set.len(), hs.len());
        assert!(!set.contains(&0));
        // Every single-bit corruption of every handle misses the whole set.
        let hits = hs
            .iter()
            .flat_map(|h| (0..usize::BITS).map(move |b| h ^ (1usize << b)))
            .filter(|c| set.contains(c))
            .count();
        assert_eq!(hits, 0);
    }
}
