//! The host cost of a call: fixed-capacity lists for the hot path, and per-thread
//! counters of heap allocations and checked CUDA library calls.
//!
//! A call of the overlap and comm-GEMM APIs in steady state (its engine, plans and
//! buffers made by an earlier call) allocates nothing on the host heap: its schedules,
//! chunk bounds, peer lists and reduction sources are [`Small`] lists on the stack.
//! [`counters`] lets a test or benchmark check that (and count the driver / cuBLASLt
//! calls a call makes): the library's global allocator counts the allocations each
//! thread makes (a thread-local increment; nothing else changes), and every checked
//! library call (`cuda::check`, cuBLASLt's and NCCL's checks) counts one call.
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static LIB_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting the allocations (and reallocations) of each thread.
pub struct CountingAlloc;

#[inline]
fn count_alloc() {
    // try_with: during thread teardown the slot may be gone; never fail an allocation.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every request to `System` unchanged; the counter is a const-initialised
// thread-local Cell (no allocation, no lock).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_alloc();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_alloc();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_alloc();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Count one checked CUDA library call (driver, cuBLASLt, NCCL) of this thread.
#[inline]
pub fn count_lib_call() {
    let _ = LIB_CALLS.try_with(|c| c.set(c.get() + 1));
}

/// This thread's running totals: (heap allocations, checked CUDA library calls), both
/// since the thread started. Differences around a call are the call's cost.
pub fn counters() -> (u64, u64) {
    (
        ALLOCS.try_with(|c| c.get()).unwrap_or(0),
        LIB_CALLS.try_with(|c| c.get()).unwrap_or(0),
    )
}

/// FxHash (rustc's hasher): a multiply-rotate hash of machine words, for the hot path's
/// maps keyed by small plain values (the GEMM plans). Not DoS-resistant; its keys come
/// from this library, never from untrusted input.
#[derive(Clone, Copy, Default)]
pub struct FxHasher {
    hash: u64,
}

impl FxHasher {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    #[inline]
    fn add(&mut self, w: u64) {
        self.hash = (self.hash.rotate_left(5) ^ w).wrapping_mul(Self::SEED);
    }
}

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn write_isize(&mut self, i: isize) {
        self.add(i as u64);
    }
    #[inline]
    fn write_i32(&mut self, i: i32) {
        self.add(i as u32 as u64);
    }
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// `HashMap<K, V, FxBuild>`: a map hashed with [`FxHasher`].
pub type FxBuild = std::hash::BuildHasherDefault<FxHasher>;

/// A list of at most `N` `Copy` values, on the stack (no heap allocation). Pushing past
/// `N` panics (caught by the C firewall as an internal error); every list of the hot
/// path has a capacity its inputs are validated against (tp <= `MAX_PEERS`, splits <=
/// `MAX_SPLITS`).
#[derive(Clone, Copy)]
pub struct Small<T: Copy + Default, const N: usize> {
    len: usize,
    buf: [T; N],
}

impl<T: Copy + Default, const N: usize> Small<T, N> {
    pub fn new() -> Self {
        Small {
            len: 0,
            buf: [T::default(); N],
        }
    }
    pub fn push(&mut self, v: T) {
        assert!(self.len < N, "a fixed-capacity list of {N} overflowed");
        self.buf[self.len] = v;
        self.len += 1;
    }
    /// Remove consecutive repeated values (as `Vec::dedup`).
    pub fn dedup(&mut self)
    where
        T: PartialEq,
    {
        let mut w = 0;
        for i in 0..self.len {
            if w == 0 || self.buf[i] != self.buf[w - 1] {
                self.buf[w] = self.buf[i];
                w += 1;
            }
        }
        self.len = w;
    }
}

impl<T: Copy + Default, const N: usize> Default for Small<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy + Default, const N: usize> std::ops::Deref for Small<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[..self.len]
    }
}

impl<T: Copy + Default, const N: usize> std::ops::DerefMut for Small<T, N> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[..self.len]
    }
}

impl<'a, T: Copy + Default, const N: usize> IntoIterator for &'a Small<T, N> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: Copy + Default, const N: usize> FromIterator<T> for Small<T, N> {
    fn from_iter<I: IntoIterator<Item = T>>(it: I) -> Self {
        let mut s = Small::new();
        for v in it {
            s.push(v);
        }
        s
    }
}

impl<T: Copy + Default + std::fmt::Debug, const N: usize> std::fmt::Debug for Small<T, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Copy + Default + PartialEq, const N: usize> PartialEq for Small<T, N> {
    fn eq(&self, o: &Self) -> bool {
        **self == **o
    }
}
impl<T: Copy + Default + Eq, const N: usize> Eq for Small<T, N> {}

impl<T: Copy + Default + PartialEq, const N: usize> PartialEq<Vec<T>> for Small<T, N> {
    fn eq(&self, o: &Vec<T>) -> bool {
        **self == **o
    }
}

/// A short string formatted on the stack (`write!` into it; text past `N` bytes is an
/// error): kernel names built per call without a heap allocation.
#[derive(Clone, Copy)]
pub struct StackStr<const N: usize> {
    len: usize,
    buf: [u8; N],
}

impl<const N: usize> StackStr<N> {
    pub fn new() -> Self {
        StackStr {
            len: 0,
            buf: [0; N],
        }
    }
    pub fn as_str(&self) -> &str {
        // Only whole `&str`s are ever copied in (`write_str`): valid UTF-8.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl<const N: usize> Default for StackStr<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> std::fmt::Write for StackStr<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end > N {
            return Err(std::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_lists_behave_like_vecs_without_allocating() {
        let before = counters().0;
        let mut s: Small<usize, 8> = (0..5).map(|i| i / 2).collect();
        s.push(2);
        assert_eq!(s, vec![0, 0, 1, 1, 2, 2]);
        s.dedup();
        assert_eq!(&*s, &[0, 1, 2]);
        let e: Small<usize, 8> = Small::new();
        assert!(e.is_empty());
        // Nothing above touched the heap (the comparison's vec! is built first: count
        // only what follows it).
        let v = vec![0usize, 1, 2];
        let mid = counters().0;
        assert!(
            mid > before,
            "the counting allocator counts this thread's Vec"
        );
        let t: Small<usize, 8> = v.iter().copied().collect();
        assert_eq!(t, v);
        assert_eq!(counters().0, mid, "a Small list allocates nothing");
    }

    #[test]
    fn fx_hashed_maps_find_what_they_hold() {
        use std::collections::HashMap;
        let mut m: HashMap<(usize, [u32; 3], bool), usize, FxBuild> = HashMap::default();
        for i in 0..1000usize {
            m.insert((i, [i as u32, 7, 9], i % 2 == 0), i);
        }
        for i in 0..1000usize {
            assert_eq!(m.get(&(i, [i as u32, 7, 9], i % 2 == 0)), Some(&i));
            assert_eq!(m.get(&(i, [i as u32, 7, 9], i % 2 == 1)), None);
        }
        // Different words give different hashes (no trivial collisions of small keys).
        use std::hash::{BuildHasher, Hash, Hasher};
        let h = |v: &dyn Fn(&mut FxHasher)| {
            let mut s = FxBuild::default().build_hasher();
            v(&mut s);
            s.finish()
        };
        assert_ne!(h(&|s| 1u64.hash(s)), h(&|s| 2u64.hash(s)));
        assert_ne!(h(&|s| (1u32, 2u32).hash(s)), h(&|s| (2u32, 1u32).hash(s)));
    }

    #[test]
    fn stack_strings_format_without_allocating() {
        use std::fmt::Write;
        let before = counters().0;
        let mut s: StackStr<32> = StackStr::new();
        let (i, o) = ("bf16", "f32");
        write!(
            s,
            "reduce_{i}_{o}_{}",
            if i.len() == 4 { "v8" } else { "v1" }
        )
        .unwrap();
        assert_eq!(s.as_str(), "reduce_bf16_f32_v8");
        assert_eq!(counters().0, before);
        let mut t: StackStr<4> = StackStr::new();
        assert!(write!(t, "too long").is_err());
    }

    #[test]
    fn overflowing_a_small_list_panics_instead_of_writing_past_it() {
        let r = std::panic::catch_unwind(|| {
            let _s: Small<u8, 2> = [1u8, 2, 3].into_iter().collect();
        });
        assert!(r.is_err());
    }
}
