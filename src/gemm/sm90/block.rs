//! Block-scaled FP8 GEMMs (TE's `Float8BlockScaling`: NVTE_BLOCK_SCALING_1D / 2D) on our
//! kernel's `_block` variants (kernels/gemm_sm90.cu): TN e4m3 x e4m3 in 128 x 128 tiles,
//! each 128-deep K stage's partial sums promoted into the accumulators with the product of
//! the stage's row (B) and column (A) block scales, D bf16 / f16 / f32 with the bias and
//! accumulate epilogues. NVTE_COMM_BLOCK_GEMM (`src/gemm/block.rs`) chooses it over
//! cuBLASLt's block scale modes.
//!
//! The descriptor is `gemm::block::block_desc`'s: the GEMM TN (D[n, m] = B[n, k] . A[m,
//! k]^T), `a_scale_inv` / `b_scale_inv` TE A's / B's scales in the GEMM-ready layouts
//! (1D [ceil(k / 128), roundup(rows, 4)], 2D [ceil(rows / 128), roundup(ceil(k / 128),
//! 4)]), `blocks` = [A's, B's] modes. The kernel's A is TE's A (the columns of D), its B
//! TE's B (the rows), so TE's "2D x 1D" (a 2D-scaled weight as A) is BLOCK_A_2D.
use super::*;
use crate::tensor::BlockMode;

/// The kernel's epilogue bits (kernels/gemm_sm90.cu: EPI_BIAS, EPI_ACCUM, BLOCK_A_2D,
/// BLOCK_B_2D).
const EPI_BIAS: i32 = 1;
const EPI_ACCUM: i32 = 4;
const BLOCK_A_2D: i32 = 8;
const BLOCK_B_2D: i32 = 16;

/// The `_block` kernels' tile width (BN; rows are [`TILE_ROWS`]).
const BLOCK_BN: usize = 128;

// SAFETY: gemm_sm90_tn_e4m3_e4m3_<out>_128_block(GemmTmaDesc tmap_b, GemmTmaDesc tmap_a,
// Gemm90Args args) of kernels/gemm_sm90.cu, all three by value (`__grid_constant__`).
pub(super) const GEMM90_BLOCK: Binding<Gemm90Params> = unsafe {
    Binding::new(
        &nvrtc::GEMM_SM90_BLOCK,
        "gemm_sm90_tn_e4m3_e4m3_{}_128_block",
        "gemm_sm90 block",
    )
};

/// The `_block` kernels' output types, in [`Sm90Gemm`]'s order.
pub(super) const BLOCK_OUTS: [(DType, &str); 3] = [
    (DType::BF16, "bf16"),
    (DType::F16, "f16"),
    (DType::F32, "f32"),
];

/// Why the `_block` kernels cannot compute the block-scaled GEMM `g` with `alpha` and
/// `beta` (D = alpha B . A^T (+ bias) + beta D; None: they can). Exactly the kernel's
/// constraints: e4m3 both, not 2D x 2D, TN and packed, bf16 / f16 / f32 D, bias of D's
/// type or none, no GELU, alpha 1, m % 8 and k % 16 (TMA row strides), 16-byte aligned
/// data, D, bias and scales. A partial last K block is fine (TMA zero-fills it).
pub fn supports_block(g: &GemmDesc, alpha: f32, beta: f32) -> Option<&'static str> {
    let Some(modes) = g.blocks else {
        return Some("not block-scaled");
    };
    let checks: [(bool, &'static str); 12] = [
        (
            modes != [BlockMode::TwoD, BlockMode::TwoD],
            "both operands 2D-scaled",
        ),
        (
            g.a_type == DType::E4M3 && g.b_type == DType::E4M3,
            "inputs not both e4m3",
        ),
        (g.transa && !g.transb, "layout is not TN"),
        (
            BLOCK_OUTS.iter().any(|(t, _)| *t == g.d_type),
            "output is not bf16, f16 or fp32",
        ),
        (
            matches!(g.epilogue, Epilogue::None | Epilogue::Bias) && g.aux.is_null(),
            "a GELU / DGELU epilogue",
        ),
        (
            g.bias.is_null() || (g.bias_type == g.d_type && g.bias.is_aligned(16)),
            "a bias not of D's type or not 16-byte aligned",
        ),
        (alpha == 1.0, "alpha other than 1"),
        (
            g.c.is_null()
                && g.accumulate == (beta != 0.0)
                && g.d_scale.is_null()
                && g.d_amax.is_null(),
            "a separate C, or D scaling / amax",
        ),
        (
            g.m > 0 && g.n > 0 && g.k > 0 && g.m.max(g.n).max(g.k) <= i32::MAX as usize,
            "an empty dimension or one beyond 32 bits",
        ),
        (
            g.m.is_multiple_of(8) && g.k.is_multiple_of(16),
            "m not a multiple of 8 or k not of 16",
        ),
        (
            g.lda == g.k && g.ldb == g.k && g.ldd == g.m,
            "leading dimensions not packed",
        ),
        (
            [g.a, g.b, g.d, g.a_scale_inv, g.b_scale_inv]
                .iter()
                .all(|p| !p.is_null() && p.is_aligned(16)),
            "A, B, D or a scale_inv not 16-byte aligned",
        ),
    ];
    checks.iter().find(|c| !c.0).map(|c| c.1)
}

/// The `_block` kernel's arguments for `g` (which [`supports_block`] accepts) with `beta`,
/// `tiles_m` tiles a tile row, on `sms` SMs.
fn block_args(g: &GemmDesc, beta: f32, tiles_m: usize, sms: usize) -> Gemm90Args {
    let [a, b] = g.blocks.unwrap_or([BlockMode::OneD; 2]);
    let mut epilogue = 0;
    if !g.bias.is_null() {
        epilogue |= EPI_BIAS;
    }
    if beta != 0.0 {
        epilogue |= EPI_ACCUM;
    }
    if a == BlockMode::TwoD {
        epilogue |= BLOCK_A_2D;
    }
    if b == BlockMode::TwoD {
        epilogue |= BLOCK_B_2D;
    }
    Gemm90Args {
        d: g.d,
        bias: g.bias,
        a_scale_inv: g.a_scale_inv,
        b_scale_inv: g.b_scale_inv,
        // (supports_block: every dimension fits in 32 bits)
        m: g.m as i32,
        n: g.n as i32,
        k: g.k as i32,
        group_n: group_n(&Hooks::default(), tiles_m, sms) as i32,
        beta,
        epilogue,
        ..Default::default()
    }
}

impl Sm90Gemm {
    /// [`Sm90Gemm::get`] with the `_block` kernels loaded too (their own module,
    /// nvrtc::GEMM_SM90_BLOCK, compiled and loaded at the first block-scaled GEMM that
    /// asks for our kernel; a failure refuses that GEMM only, never the plain kernels).
    pub fn get_with_block(guard: &ContextGuard) -> Result<Arc<Sm90Gemm>> {
        let b = Self::get(guard)?;
        if b.block.get().is_none() {
            let kernels = with_relaxed_capture(|| b.load_block(guard))?;
            // (a concurrent first call may have set it: the same kernels either way)
            let _ = b.block.set(kernels);
        }
        Ok(b)
    }

    fn load_block(&self, guard: &ContextGuard) -> Result<[Kernel<Gemm90Params>; 3]> {
        let dev = device_info(guard_device(guard)?)?;
        let m = nvrtc::module(&nvrtc::GEMM_SM90_BLOCK, guard.id, &dev)?;
        let k = |o: &str| -> Result<Kernel<Gemm90Params>> {
            // SAFETY: `m` is kernels/gemm_sm90.cu's _block module, the binding's source.
            let kern = unsafe { Kernel::new(&m, &GEMM90_BLOCK, &[o])? };
            set_dynamic_smem(&kern, self.smem[0])?;
            Ok(kern)
        };
        Ok([
            k(BLOCK_OUTS[0].1)?,
            k(BLOCK_OUTS[1].1)?,
            k(BLOCK_OUTS[2].1)?,
        ])
    }

    /// The block-scaled GEMM `g` (D = B . A^T (+ bias) + beta D, which [`supports_block`]
    /// accepts with alpha 1) on `stream`, on at most `sms` SMs (0: all).
    ///
    /// # Safety
    ///
    /// `g`'s operands as `gemm::run` requires them, its scale_inv pointers TE's GEMM-ready
    /// block scales of A and B (`gemm::block::block_desc`), alive until the launch
    /// completes.
    pub unsafe fn run_block(
        &self,
        g: &GemmDesc,
        beta: f32,
        sms: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        if let Some(why) = supports_block(g, 1.0, beta) {
            return Err(Error::internal(format!(
                "our sm90 block-scaled GEMM cannot compute this GEMM: {why}"
            )));
        }
        let sms = if sms == 0 {
            self.sms
        } else {
            sms.min(self.sms)
        };
        let tb = self.map(g.b, g.n, g.k, TILE_ROWS, true)?;
        let ta = self.map(g.a, g.m, g.k, BLOCK_BN, true)?;
        let tiles_m = g.m.div_ceil(BLOCK_BN);
        let args = block_args(g, beta, tiles_m, sms);
        let tiles = g.n.div_ceil(TILE_ROWS) * tiles_m;
        let grid = tiles.min(sms).max(1) as u32;
        let out = BLOCK_OUTS
            .iter()
            .position(|(t, _)| *t == g.d_type)
            .ok_or_else(|| Error::internal("block GEMM output type".to_string()))?;
        let Some(block) = self.block.get() else {
            return Err(Error::internal(
                "our sm90 block-scaled GEMM's kernels are not loaded (Sm90Gemm::get_with_block)"
                    .to_string(),
            ));
        };
        // SAFETY: the module stays loaded in the current context; the maps and `args`
        // describe memory the caller's GemmDesc validated (`supports_block`: shapes,
        // packing, alignment; `block_desc`: the scales' shapes); grid, block and shared
        // memory are the kernel's documented launch shape (BN 128).
        unsafe {
            block[out].launch_shared(
                ((grid, 1, 1), (THREADS, 1, 1)),
                self.smem[0],
                stream,
                (tb, ta, args),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sm90's test TN e4m3 descriptor (both scale pointers set), full-precision
    /// accumulation as the block GEMMs run.
    fn tests_desc(m: usize, n: usize, k: usize) -> GemmDesc {
        GemmDesc {
            fast_accum: false,
            ..super::super::tests::tn(m, n, k, DType::E4M3)
        }
    }

    fn block(m: usize, n: usize, k: usize, modes: [BlockMode; 2]) -> GemmDesc {
        GemmDesc {
            blocks: Some(modes),
            ..tests_desc(m, n, k)
        }
    }

    #[test]
    fn the_block_kernels_take_exactly_their_cases() {
        use BlockMode::*;
        for modes in [[OneD, OneD], [TwoD, OneD], [OneD, TwoD]] {
            let g = block(8192, 4096, 8192, modes);
            assert_eq!(supports_block(&g, 1.0, 0.0), None, "{modes:?}");
            // A partial last K block (k % 128 != 0) and ragged n are computed.
            assert_eq!(supports_block(&block(520, 300, 400, modes), 1.0, 0.0), None);
        }
        let refused = |g: &GemmDesc, alpha: f32, beta: f32, why: &str| {
            assert_eq!(supports_block(g, alpha, beta), Some(why));
        };
        let g = block(256, 128, 512, [OneD, OneD]);
        refused(&tests_desc(256, 128, 512), 1.0, 0.0, "not block-scaled");
        refused(
            &block(256, 128, 512, [TwoD, TwoD]),
            1.0,
            0.0,
            "both operands 2D-scaled",
        );
        let mut e5 = g;
        e5.b_type = DType::E5M2;
        refused(&e5, 1.0, 0.0, "inputs not both e4m3");
        let mut f8 = g;
        f8.d_type = DType::E4M3;
        refused(&f8, 1.0, 0.0, "output is not bf16, f16 or fp32");
        let mut dgelu = g;
        dgelu.epilogue = Epilogue::DGelu;
        dgelu.aux = DevPtr::new(6 << 20);
        refused(&dgelu, 1.0, 0.0, "a GELU / DGELU epilogue");
        let mut bias = g;
        bias.epilogue = Epilogue::Bias;
        bias.bias = DevPtr::new(7 << 20);
        assert_eq!(supports_block(&bias, 1.0, 0.0), None);
        bias.bias_type = DType::F32;
        refused(
            &bias,
            1.0,
            0.0,
            "a bias not of D's type or not 16-byte aligned",
        );
        refused(&g, 2.0, 0.0, "alpha other than 1");
        let mut acc = g;
        acc.accumulate = true;
        assert_eq!(supports_block(&acc, 1.0, 1.0), None);
        refused(&acc, 1.0, 0.0, "a separate C, or D scaling / amax");
        refused(
            &block(260, 128, 512, [OneD, OneD]),
            1.0,
            0.0,
            "m not a multiple of 8 or k not of 16",
        );
        let mut odd = g;
        odd.b_scale_inv = DevPtr::new((5 << 20) + 4);
        refused(&odd, 1.0, 0.0, "A, B, D or a scale_inv not 16-byte aligned");
    }

    #[test]
    fn the_arguments_name_the_2d_operand_and_the_epilogue() {
        use BlockMode::*;
        let mut g = block(8192, 4096, 8192, [TwoD, OneD]);
        let a = block_args(&g, 0.0, 64, 132);
        assert_eq!(a.epilogue, BLOCK_A_2D);
        assert_eq!((a.m, a.n, a.k), (8192, 4096, 8192));
        assert_eq!(
            (a.a_scale_inv, a.b_scale_inv),
            (g.a_scale_inv, g.b_scale_inv)
        );
        g.blocks = Some([OneD, TwoD]);
        g.bias = DevPtr::new(7 << 20);
        let a = block_args(&g, 1.0, 64, 132);
        assert_eq!(a.epilogue, BLOCK_B_2D | EPI_BIAS | EPI_ACCUM);
        assert_eq!((a.bias, a.beta), (g.bias, 1.0));
        g.blocks = Some([OneD, OneD]);
        assert_eq!(
            block_args(&g, 0.0, 64, 132).epilogue & (BLOCK_A_2D | BLOCK_B_2D),
            0
        );
    }
}
