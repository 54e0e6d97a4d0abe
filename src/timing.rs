//! The timing rule shared by the GEMM algorithm choice (`gemm`) and the autotuner
//! (`tune`): candidates timed in interleaved rounds, each one's median, and the fastest
//! by the slowest rank when it beats the defaults by a margin; and how many shapes the
//! autotuner tunes per context. Pure functions and constants.

/// Keys tuned per context at most (then the defaults).
pub const MAX_KEYS: usize = 64;

/// Rounds over the candidates; each candidate's time is the median of its rounds.
pub const ROUNDS: usize = 3;
/// A candidate replaces the defaults only when at least this much faster (measurement
/// noise must not swap a configuration for an equal or worse one).
pub const MARGIN: f32 = 0.03;

/// Each candidate's median time (NaN when a round failed or none ran).
pub fn medians(times: &[Vec<f32>]) -> Vec<f32> {
    times
        .iter()
        .map(|t| {
            if t.is_empty() || t.iter().any(|x| x.is_nan()) {
                return f32::NAN;
            }
            let mut v = t.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        })
        .collect()
}

/// The fastest candidate if it beats the defaults (candidate 0) by `margin`, else 0.
pub fn pick_with_margin(medians: &[f32], margin: f32) -> usize {
    let Some(best) = pick(&[medians.to_vec()]) else {
        return 0;
    };
    let d = medians.first().copied().unwrap_or(f32::NAN);
    if d.is_nan() || medians[best] < d * (1.0 - margin) {
        best
    } else {
        0
    }
}

/// How many candidates fit the budget, from the first candidate's slowest-rank time per
/// run (each candidate makes 4 runs).
pub fn affordable(n: usize, first_ms: f64, budget_ms: f64) -> usize {
    if first_ms.is_nan() || first_ms <= 0.0 {
        return n;
    }
    ((budget_ms / (4.0 * first_ms)).floor() as usize).clamp(1, n)
}

/// The candidate with the smallest slowest-rank time; `times[rank][candidate]` (NaN or
/// missing: not measured). Ties: the earlier candidate (the defaults first).
pub fn pick(times: &[Vec<f32>]) -> Option<usize> {
    let n = times.iter().map(|t| t.len()).min()?;
    let mut best: Option<(usize, f32)> = None;
    for c in 0..n {
        let worst = times.iter().map(|t| t[c]).fold(f32::NEG_INFINITY, f32::max);
        if worst.is_nan() || !worst.is_finite() {
            continue;
        }
        if best.is_none_or(|(_, b)| worst < b) {
            best = Some((c, worst));
        }
    }
    best.map(|(c, _)| c)
}
