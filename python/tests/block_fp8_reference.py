"""An independent numpy reference of TE's block-scaled FP8 cast (Float8BlockScaling), shared
by the torch and JAX block tests: per 1 x 128 block of a row (1D) or 128 x 128 tile (2D),
TE's compute_scale_from_amax (amax floored at eps; 1 for 0 / inf / NaN; fp8_max / amax, the
input dtype's max on overflow; mantissa cleared for power-of-2 scales), the saturating e4m3
cast (ml_dtypes), scale_inv = 1 / scale per block."""
import numpy as np

B = 128
E4M3_MAX = 448.0


def np_scales(amax, eps, pow2, vinf):
    a = np.maximum(amax, np.float32(eps)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.float32(E4M3_MAX) / a
    s = np.where(np.isinf(s), np.float32(vinf), s).astype(np.float32)
    s = np.where((a > 0) & np.isfinite(a), s, np.float32(1.0)).astype(np.float32)
    if pow2:
        s = (s.view(np.int32) & np.int32(-8388608)).view(np.float32)
    return s


def np_quantize(x, dim, eps=0.0, pow2=True, vinf=None):
    """-> (q as float32 values of e4m3, scale_inv per block); rows of x are the blocks' rows."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    r, c = x.shape
    mb = -(-r // B) if dim == 2 else r
    nb = -(-c // B)
    q = np.zeros_like(x)
    sinv = np.zeros((mb, nb), np.float32)
    vinf = float(np.finfo(np.float32).max) if vinf is None else vinf
    for i in range(mb):
        rows = slice(i * B, (i + 1) * B) if dim == 2 else slice(i, i + 1)
        for j in range(nb):
            blk = x[rows, j * B:(j + 1) * B]
            s = np_scales(np.float32(np.abs(blk).max()), eps, pow2, vinf)
            q[rows, j * B:(j + 1) * B] = np.clip(blk * s, -E4M3_MAX, E4M3_MAX).astype(
                ml_dtypes.float8_e4m3fn).astype(np.float32)
            sinv[i, j] = np.float32(1.0) / s
    return q, sinv


