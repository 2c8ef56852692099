//! A cache-blocked f32 matrix multiply for x86-64 CPUs with AVX-512, in the
//! classic packed-panel form (Goto/BLIS):
//!
//! ```text
//! for each NC-wide column block of B
//!   for each KC-deep slice of the inner dimension
//!     pack B[KC × NC] into NR-wide panels          (block: KC·NC floats, L2)
//!     for each MC-tall row block of A
//!       pack A[MC × KC] into MR-tall panels        (panel: MR·KC floats, L1)
//!       for each A panel, for each B panel:
//!         C[MR × NR] (+)= A panel · B panel        (the micro-kernel)
//! ```
//!
//! (A is the broadcast operand and stays in L1 for a sweep over the B
//! block; B is the vector operand and streams from L2, prefetched.)
//!
//! The micro-kernel keeps a 14 × 32 tile of C in 28 of the 32 vector
//! registers and, per step of the inner dimension, loads two vectors of B
//! and broadcasts 14 values of A: 28 fused multiply-adds per 16 loads, so
//! the FMA units, not the loads, set the pace. Packing turns every operand
//! layout (plain or transposed, any stride) into the one layout the kernel
//! reads, which is why transposed operands cost nothing extra here either.
//!
//! Threads split C into disjoint column (or row) ranges, each a complete
//! serial multiply with its own packing buffers, so no synchronisation is
//! needed inside a multiply and every thread packs only the part of the
//! larger operand it uses.

use crate::MatRef;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows of C one micro-kernel call produces (broadcast from packed A).
const MR: usize = 14;
/// Columns of C one micro-kernel call produces (two 16-lane vectors).
const NR: usize = 32;
/// Depth of a packed slice: one MR × KC panel of A is 14 KB, held in L1
/// while it sweeps the B block. The slices fix the order of each element's
/// sum, which `crate::in_order` defines and also computes elsewhere.
const KC: usize = crate::in_order::SLICE;
/// Rows of A packed together (MC × KC floats = 336 KB).
const MC: usize = MR * 24;
/// Columns of B packed together: the KC × NC block (1 MB) stays in L2
/// while every A panel sweeps across it.
const NC: usize = NR * 32;

/// How far ahead (in floats of packed B) the micro-kernel prefetches.
const B_AHEAD: usize = NR * 8;

/// Whether this CPU can run the kernel.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// The C tile a thread's part is made of (`linalg::in_parts` splits in
/// whole tiles).
pub const PART_TILE: (usize, usize) = (MR, NR);

thread_local! {
    /// Packing buffers (A block, B block), kept per thread between calls.
    static BUFFERS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `c[m×n] (row stride ldc) = (accumulate ? c : 0) + a·b` on the calling
/// thread, blocked and packed as in the module comment.
///
/// # Safety
/// The caller has checked that [`available`] is true, that every element
/// the views describe lies inside their slices, and that `c` points at an
/// `m × n` block with row stride `ldc ≥ n` that nothing else reads or
/// writes during the call.
pub unsafe fn serial(a: MatRef<'_>, b: MatRef<'_>, c: *mut f32, ldc: usize, accumulate: bool) {
    let run = |bufs: &mut (Vec<f32>, Vec<f32>)| {
        let (apack, bpack) = bufs;
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let a_len = MC.min(m.div_ceil(MR) * MR) * KC.min(k);
        let b_len = NC.min(n.div_ceil(NR) * NR) * KC.min(k);
        if apack.len() < a_len {
            apack.resize(a_len, 0.0);
        }
        if bpack.len() < b_len {
            bpack.resize(b_len, 0.0);
        }
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let acc = accumulate || pc > 0;
                for (panel, j) in (0..nc).step_by(NR).enumerate() {
                    let dst = &mut bpack[panel * kc * NR..][..kc * NR];
                    // SAFETY: the caller checked the view's extent.
                    unsafe { pack_b(&b, pc, kc, jc + j, NR.min(nc - j), dst) };
                }
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    // SAFETY: as above.
                    unsafe { pack_a(&a, ic, mc, pc, kc, apack) };
                    // The A block packed next: same slice further down, or
                    // the top of the next slice.
                    let calls = mc.div_ceil(MR) * nc.div_ceil(NR);
                    let mut ahead = if ic + MC < m {
                        Lookahead::new(&a, ic + MC, MC.min(m - ic - MC), pc, kc, calls)
                    } else if pc + KC < k {
                        Lookahead::new(&a, 0, MC.min(m), pc + KC, KC.min(k - pc - KC), calls)
                    } else {
                        Lookahead::none()
                    };
                    // Each A panel stays in L1 while it sweeps every B panel.
                    for (ap, i) in (0..mc).step_by(MR).enumerate() {
                        let mr = MR.min(mc - i);
                        let apanel = apack[ap * kc * MR..].as_ptr();
                        for (bp, j) in (0..nc).step_by(NR).enumerate() {
                            let nr = NR.min(nc - j);
                            let bpanel = bpack[bp * kc * NR..].as_ptr();
                            ahead.advance();
                            // SAFETY: (ic+i, jc+j) + (mr, nr) lies inside
                            // the caller's m × n block of C.
                            unsafe {
                                let cp = c.add((ic + i) * ldc + jc + j);
                                if mr == MR && nr == NR {
                                    micro_kernel(kc, apanel, bpanel, cp, ldc, acc);
                                } else {
                                    edge_tile(kc, apanel, bpanel, cp, ldc, acc, mr, nr);
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => run(&mut bufs),
        // Re-entered on this thread (never expected): use fresh buffers.
        Err(_) => run(&mut (Vec::new(), Vec::new())),
    });
}

/// Software prefetch of the A block the loops pack next, spread evenly
/// over the kernel calls of the current block. A is the weight matrix in
/// every large product of a training step and is cold (read from memory
/// once per pass); packing reads it in runs too short for the hardware
/// prefetcher, so without this the pack waits on memory latency.
struct Lookahead {
    base: *const u8,
    strip_bytes: usize,
    lines_per_strip: usize,
    total: usize,
    next: usize,
    per_call: usize,
}

impl Lookahead {
    fn none() -> Self {
        Lookahead {
            base: std::ptr::null(),
            strip_bytes: 0,
            lines_per_strip: 1,
            total: 0,
            next: 0,
            per_call: 0,
        }
    }

    /// Lines of rows `i0..i0+mc` × columns `p0..p0+kc` of A, `calls` steps.
    fn new(a: &MatRef<'_>, i0: usize, mc: usize, p0: usize, kc: usize, calls: usize) -> Self {
        // A "strip" is a contiguous run of the block: a row when rows are
        // contiguous, a column when columns are; other layouts are skipped.
        let (strips, stride, len) = if a.col_stride == 1 {
            (mc, a.row_stride, kc)
        } else if a.row_stride == 1 {
            (kc, a.col_stride, mc)
        } else {
            return Self::none();
        };
        let start = a.offset + i0 * a.row_stride + p0 * a.col_stride;
        let lines_per_strip = (len * 4).div_ceil(64) + 1;
        let total = strips * lines_per_strip;
        Lookahead {
            base: a.data.as_ptr().wrapping_add(start) as *const u8,
            strip_bytes: stride * 4,
            lines_per_strip,
            total,
            next: 0,
            per_call: total.div_ceil(calls.max(1)),
        }
    }

    fn advance(&mut self) {
        let end = (self.next + self.per_call).min(self.total);
        for line in self.next..end {
            let (strip, l) = (line / self.lines_per_strip, line % self.lines_per_strip);
            let p = self.base.wrapping_add(strip * self.strip_bytes + l * 64);
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) };
        }
        self.next = end;
    }
}

/// Packs rows `i0..i0+mc` × columns `p0..p0+kc` of A as MR-tall panels,
/// each `kc` groups of `MR` values (column `p` of panel `q` at
/// `dst[q·kc·MR + p·MR..]`), zero-padding the last panel's missing rows.
///
/// # Safety
/// The CPU has AVX-512; rows `i0..i0+mc` × columns `p0..p0+kc` of `a` lie
/// inside its slice and `dst` holds `mc` rounded up to MR × `kc` floats.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a(a: &MatRef<'_>, i0: usize, mc: usize, p0: usize, kc: usize, dst: &mut [f32]) {
    let src = a
        .data
        .as_ptr()
        .add(a.offset + i0 * a.row_stride + p0 * a.col_stride);
    let d = dst.as_mut_ptr();
    let panels = mc.div_ceil(MR);
    if a.row_stride == 1 {
        // Columns contiguous (a transposed weight): read each column once,
        // across every panel, so each source row is touched in one pass.
        for p in 0..kc {
            let s = src.add(p * a.col_stride);
            for q in 0..panels {
                let rows = MR.min(mc - q * MR);
                let v = _mm512_maskz_loadu_ps(((1u32 << rows) - 1) as u16, s.add(q * MR));
                _mm512_mask_storeu_ps(d.add(q * kc * MR + p * MR), (1 << MR) - 1, v);
            }
        }
        return;
    }
    for q in 0..panels {
        let rows = MR.min(mc - q * MR);
        let src = src.add(q * MR * a.row_stride);
        let d = d.add(q * kc * MR);
        // Rows contiguous (the usual weight layout): 16 × 16 transposes.
        let whole = if a.col_stride == 1 { kc / 16 * 16 } else { 0 };
        for p in (0..whole).step_by(16) {
            transpose16(
                src.add(p),
                a.row_stride,
                rows,
                d.add(p * MR),
                MR,
                (1 << MR) - 1,
            );
        }
        for r in 0..MR {
            let s = src.add(r * a.row_stride);
            for p in whole..kc {
                *d.add(p * MR + r) = if r < rows {
                    *s.add(p * a.col_stride)
                } else {
                    0.0
                };
            }
        }
    }
}

/// Packs rows `p0..p0+kc` × columns `j0..j0+nr` of B as `kc` rows of `NR`
/// values, zero-padding columns past `nr`.
///
/// # Safety
/// The CPU has AVX-512; rows `p0..p0+kc` × columns `j0..j0+nr` of `b` lie
/// inside its slice and `dst` holds `kc` × NR floats.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b(b: &MatRef<'_>, p0: usize, kc: usize, j0: usize, nr: usize, dst: &mut [f32]) {
    let src = b
        .data
        .as_ptr()
        .add(b.offset + p0 * b.row_stride + j0 * b.col_stride);
    let d = dst.as_mut_ptr();
    if b.col_stride == 1 {
        let mask = ((1u64 << nr) - 1) as u32;
        for p in 0..kc {
            let (s, o) = (src.add(p * b.row_stride), d.add(p * NR));
            let lo = _mm512_maskz_loadu_ps(mask as u16, s);
            let hi = _mm512_maskz_loadu_ps((mask >> 16) as u16, s.add(16));
            _mm512_storeu_ps(o, lo);
            _mm512_storeu_ps(o.add(16), hi);
        }
    } else {
        // Columns contiguous (a transposed operand): 16 × 16 transposes.
        let whole = if b.row_stride == 1 { kc / 16 * 16 } else { 0 };
        for p in (0..whole).step_by(16) {
            for c0 in (0..NR).step_by(16) {
                let cols = nr.saturating_sub(c0).min(16);
                let s = src.add(p + c0 * b.col_stride);
                transpose16(s, b.col_stride, cols, d.add(p * NR + c0), NR, 0xFFFF);
            }
        }
        for c in 0..nr {
            let s = src.add(c * b.col_stride);
            for p in whole..kc {
                *d.add(p * NR + c) = *s.add(p * b.row_stride);
            }
        }
        for c in nr..NR {
            for p in whole..kc {
                *d.add(p * NR + c) = 0.0;
            }
        }
    }
}

/// Transposes a 16 × 16 block: row `r < rows` is the 16 floats at
/// `src + r·stride` (rows past `rows` read as zero), and column `q` of the
/// block is written to `dst + q·dst_stride`, lanes selected by `mask`.
///
/// # Safety
/// The CPU has AVX-512; `src + r·stride` has 16 readable floats for every
/// `r < rows`, and `dst + q·dst_stride` 16 writable floats (the lanes in
/// `mask`) for every `q < 16`.
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(
    src: *const f32,
    stride: usize,
    rows: usize,
    dst: *mut f32,
    dst_stride: usize,
    mask: u16,
) {
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, v) in r.iter_mut().enumerate().take(rows) {
        *v = _mm512_loadu_ps(src.add(i * stride));
    }
    // Interleave pairs of rows (32-bit), then pairs of pairs (64-bit).
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for i in 0..4 {
        for j in 0..2 {
            let (x, y) = (
                _mm512_castps_pd(t[4 * i + j]),
                _mm512_castps_pd(t[4 * i + j + 2]),
            );
            r[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            r[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    }
    // Now r[4i + k] holds, in its 128-bit lane L, column 4L + k of rows
    // 4i..4i+4. Regroup 128-bit lanes: pairs of row groups first...
    for i in 0..2 {
        for k in 0..4 {
            let (x, y) = (r[8 * i + k], r[8 * i + 4 + k]);
            t[8 * i + k] = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
        }
    }
    // ...then the two halves.
    for k in 0..8 {
        let (x, y) = (t[k], t[8 + k]);
        r[k] = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
        r[8 + k] = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
    }
    // ...then halves: r[k] is now column k, rows 0..16 in order.
    for (k, v) in r.iter().enumerate() {
        _mm512_mask_storeu_ps(dst.add(k * dst_stride), mask, *v);
    }
}

/// `C[MR × NR] = (accumulate ? C : 0) + A panel · B panel` over `kc` steps.
///
/// # Safety
/// The CPU has AVX-512; `a` and `b` are packed panels of `kc` steps (MR and
/// NR floats each); `c` points at an MR × NR block with row stride `ldc`
/// that nothing else touches during the call.
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // Ask for the C tile now; it is needed only after the kc steps below.
    for r in 0..MR {
        let row = c.add(r * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.add(64));
        _mm_prefetch::<_MM_HINT_T0>(row.add(127));
    }
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        // B streams from L2: ask for it a few steps ahead.
        _mm_prefetch::<_MM_HINT_T0>(b.add(B_AHEAD) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(b.add(B_AHEAD + 16) as *const i8);
        let b0 = _mm512_loadu_ps(b);
        let b1 = _mm512_loadu_ps(b.add(16));
        for r in 0..MR {
            let av = _mm512_set1_ps(*a.add(r));
            lo[r] = _mm512_fmadd_ps(av, b0, lo[r]);
            hi[r] = _mm512_fmadd_ps(av, b1, hi[r]);
        }
        a = a.add(MR);
        b = b.add(NR);
    }
    for r in 0..MR {
        let row = c.add(r * ldc);
        let (mut v0, mut v1) = (lo[r], hi[r]);
        if accumulate {
            v0 = _mm512_add_ps(v0, _mm512_loadu_ps(row));
            v1 = _mm512_add_ps(v1, _mm512_loadu_ps(row.add(16)));
        }
        _mm512_storeu_ps(row, v0);
        _mm512_storeu_ps(row.add(16), v1);
    }
}

/// A partial tile (`mr ≤ MR` rows, `nr ≤ NR` columns): the full kernel into
/// a scratch tile, then the valid part into C.
///
/// # Safety
/// As [`micro_kernel`], except that `c` need only have `mr × nr` writable
/// elements.
#[allow(clippy::too_many_arguments)]
unsafe fn edge_tile(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    mr: usize,
    nr: usize,
) {
    let mut tile = [0.0f32; MR * NR];
    micro_kernel(kc, a, b, tile.as_mut_ptr(), NR, false);
    for r in 0..mr {
        for j in 0..nr {
            let dst = c.add(r * ldc + j);
            let v = tile[r * NR + j];
            *dst = if accumulate { *dst + v } else { v };
        }
    }
}
