//! The product in the order of the inner dimension, in the same bits on
//! every CPU: the inner dimension is cut into slices of [`SLICE`], each
//! element's partial sum over a slice is the chain of fused multiply-adds
//!
//! ```text
//! s_ij = fma(a_i,p+S−1, b_p+S−1,j, … fma(a_i,p+1, b_p+1,j, fma(a_ip, b_pj, 0)))
//! ```
//!
//! and C adds the slices' sums in order: `c = s⁰` (or `c⁰ + s⁰` when
//! accumulating onto C's value `c⁰`), then `c = c + s¹`, `c + s²`, …. This
//! is what our AVX-512 kernel computes (one register per element, one FMA
//! per step, each depth slice's tile added to C), so that kernel serves
//! where it is the selected backend; everywhere else this module's
//! portable kernel computes the same chain, vectorised by the compiler for
//! the CPU it finds (AVX2 with FMA on x86-64, NEON on aarch64; elsewhere
//! `f32::mul_add`, exact but slow). BLAS libraries sum in orders of their
//! own that change with a product's shape (OpenBLAS's small-matrix paths,
//! its K-unrolled kernels), so they cannot give these bits.
//!
//! Why our own kernel and not a library's: the simulated Neural Engine
//! promises the same bits on every machine and for every tiling of a
//! program (a block of 32 queries gives the rows the whole sequence gives),
//! and no BLAS states an order of summation. Where the operands are fp16
//! values, as in every fp16 program, each product is exact in f32 (two
//! 11-bit significands make at most 22 bits), so the chain also equals
//! "round each product, add in order".
//!
//! Layout: A is packed once into MR-row panels, B one NR-column panel at a
//! time; an MR × NR tile of C stays in registers for the whole depth.

use crate::MatRef;

/// Rows of C a tile holds.
const MR: usize = 6;
/// Columns of C a tile holds (two AVX2 vectors, four NEON vectors).
const NR: usize = 16;
/// Depth of a slice of the inner dimension (the AVX-512 kernel's packed
/// depth, which therefore reads it from here).
pub const SLICE: usize = 256;

/// The C tile a thread's part is made of (`linalg::in_parts` splits in
/// whole tiles).
#[cfg(feature = "backends")]
pub const PART_TILE: (usize, usize) = (MR, NR);

/// `c[m×n] (row stride ldc) = (accumulate ? c : 0) + a·b` as the chain in
/// the module comment, on the calling thread.
///
/// # Safety
/// Every element the views describe lies inside their slices, and `c`
/// points at an `m × n` block with row stride `ldc ≥ n` that nothing else
/// reads or writes during the call.
pub unsafe fn serial(a: MatRef<'_>, b: MatRef<'_>, c: *mut f32, ldc: usize, accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA; the caller's contract is passed on.
        return unsafe { serial_avx2_fma(a, b, c, ldc, accumulate) };
    }
    // SAFETY: the caller's contract is passed on.
    unsafe { serial_any(a, b, c, ldc, accumulate) }
}

/// [`serial`] compiled for AVX2 with FMA (the same source, wider vectors).
///
/// # Safety
/// As [`serial`], and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn serial_avx2_fma(a: MatRef<'_>, b: MatRef<'_>, c: *mut f32, ldc: usize, acc: bool) {
    // SAFETY: the caller's contract is passed on.
    unsafe { serial_any(a, b, c, ldc, acc) }
}

/// The kernel, inlined into each compilation of [`serial`].
///
/// # Safety
/// As [`serial`].
#[inline(always)]
unsafe fn serial_any(a: MatRef<'_>, b: MatRef<'_>, c: *mut f32, ldc: usize, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if m == 0 || n == 0 {
        return;
    }
    // A in panels of MR rows: element (i, p) of panel q at (q·k + p)·MR + r.
    let panels = m.div_ceil(MR);
    let mut apack = vec![0f32; panels * k * MR];
    for q in 0..panels {
        for r in 0..MR.min(m - q * MR) {
            for p in 0..k {
                apack[(q * k + p) * MR + r] = a.at(q * MR + r, p);
            }
        }
    }
    let mut bpack = vec![0f32; k * NR];
    for j0 in (0..n).step_by(NR) {
        let nr = NR.min(n - j0);
        for p in 0..k {
            let row = &mut bpack[p * NR..][..NR];
            for (j, v) in row.iter_mut().enumerate() {
                *v = if j < nr { b.at(p, j0 + j) } else { 0.0 };
            }
        }
        for q in 0..panels {
            let (i0, mr) = (q * MR, MR.min(m - q * MR));
            let mut t = [[0f32; NR]; MR];
            if accumulate {
                for (r, row) in t.iter_mut().enumerate().take(mr) {
                    for (j, v) in row.iter_mut().enumerate().take(nr) {
                        // SAFETY: (i0 + r, j0 + j) lies inside the caller's block.
                        *v = unsafe { *c.add((i0 + r) * ldc + j0 + j) };
                    }
                }
            }
            let panel = &apack[q * k * MR..][..k * MR];
            for p0 in (0..k).step_by(SLICE) {
                let depth = SLICE.min(k - p0);
                let s = slice_sum(
                    &panel[p0 * MR..][..depth * MR],
                    &bpack[p0 * NR..][..depth * NR],
                );
                if p0 == 0 && !accumulate {
                    t = s;
                } else {
                    for (row, srow) in t.iter_mut().zip(&s) {
                        for (v, sv) in row.iter_mut().zip(srow) {
                            *v += sv;
                        }
                    }
                }
            }
            for (r, row) in t.iter().enumerate().take(mr) {
                for (j, v) in row.iter().enumerate().take(nr) {
                    // SAFETY: as above.
                    unsafe { *c.add((i0 + r) * ldc + j0 + j) = *v };
                }
            }
        }
    }
}

/// `a_panel · b_panel` over one slice, one fused multiply-add per element
/// per step of the inner dimension, in order, from zero. Padded rows and
/// columns (zeros) only touch elements that are never written back.
#[inline(always)]
fn slice_sum(ap: &[f32], bp: &[f32]) -> [[f32; NR]; MR] {
    let mut acc = [[0f32; NR]; MR];
    for (av, bv) in ap.chunks_exact(MR).zip(bp.chunks_exact(NR)) {
        for r in 0..MR {
            for j in 0..NR {
                acc[r][j] = av[r].mul_add(bv[j], acc[r][j]);
            }
        }
    }
    acc
}
