//! An f32 matrix multiply on Intel AMX tiles (Sapphire Rapids and later),
//! exact to f32 working precision by splitting every operand into bf16
//! pieces ("bf16×N"):
//!
//! ```text
//! x = x₀ + x₁ + x₂ + e     x₀ = bf16(x), x₁ = bf16(x − x₀), x₂ = bf16(x − x₀ − x₁)
//! a·b ≈ a₀b₀ + a₀b₁ + a₁b₀ + a₀b₂ + a₁b₁ + a₂b₀     (|e| ≤ 2⁻²⁴|x|; the dropped
//!                                                     products are ≤ 2⁻²⁴|ab| too)
//! ```
//!
//! Each piece carries 8 significant bits, so three pieces hold all 24 of an
//! f32 and the six kept products are exact in the tiles' f32 accumulators;
//! what remains is the rounding of f32 accumulation, as in any f32 product
//! (measured against f64 in the tests). With [`Pieces::Two`] only
//! `a₀b₀ + a₀b₁ + a₁b₀` are kept: 16 bits per operand, a relative error
//! near 2⁻¹⁶ per product, twice as fast.
//!
//! A tile product (`tdpbf16ps`) multiplies a 16 × 32 bf16 tile of A by a
//! 32 × 16 tile of B (stored as 16 rows of (k, k+1) pairs) into a 16 × 16
//! f32 tile of C. The micro-kernel keeps a 32 × 32 block of C in four of
//! the eight tile registers and two tiles each of A and B in the other
//! four; per 32-deep step it runs one tile product per kept piece pair and
//! quadrant, loading a piece only when the next pair needs a different one,
//! and issues each load between products that do not read its register
//! (tiles are not renamed, so a load waits for the last product reading
//! the register it overwrites).
//!
//! Blocking and threading are those of the AVX-512 kernel (`avx512.rs`):
//! packed KC-deep slices of an NC-wide block of B and an MC-tall block of
//! A, disjoint parts of C per thread.

use crate::MatRef;
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// How many bf16 pieces each operand is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pieces {
    /// Three pieces, six products: f32 working precision.
    Three,
    /// Two pieces, three products: about 16 bits.
    Two,
}

/// Rows (and columns) of the C block one micro-kernel call produces.
const BLOCK: usize = 32;
/// Inner-dimension depth of one tile product.
const KB: usize = 32;
/// bf16 values in one tile (16 rows of 64 bytes).
const TILE: usize = 512;
/// Depth of a packed slice.
const KC: usize = 256;
/// Rows of A packed together.
const MC: usize = 256;
/// Columns of B packed together.
const NC: usize = 1024;

/// The products kept for each piece count, in the order the micro-kernel
/// runs them (chosen so consecutive pairs share a piece: 5 piece loads per
/// step for two pieces, 8 for three).
const PRODUCTS_TWO: [(usize, usize); 3] = [(0, 0), (0, 1), (1, 0)];
const PRODUCTS_THREE: [(usize, usize); 6] = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 0), (2, 0)];

/// The tile configuration: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Whether this CPU and kernel can run the AMX kernel: the CPU reports
/// AMX-TILE, AMX-BF16 and AVX-512 BF16, and Linux grants this process the
/// tile state (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
            && cpu_has_amx_bf16()
            && request_tile_state()
    })
}

fn cpu_has_amx_bf16() -> bool {
    // Leaf 7 exists on every CPU with AVX-512 (checked first).
    let leaf7 = __cpuid_count(7, 0);
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    leaf7.edx & AMX_BF16 != 0 && leaf7.edx & AMX_TILE != 0
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    extern "C" {
        fn syscall(number: std::ffi::c_long, ...) -> std::ffi::c_long;
    }
    const SYS_ARCH_PRCTL: std::ffi::c_long = 158;
    const ARCH_REQ_XCOMP_PERM: std::ffi::c_long = 0x1023;
    const XFEATURE_XTILEDATA: std::ffi::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes which register
    // state the kernel saves for this process; it returns 0 when granted.
    unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The C tile a thread's part is made of (`linalg::in_parts` splits in
/// whole tiles).
pub const PART_TILE: (usize, usize) = (BLOCK, BLOCK);

/// `c[m×n] (row stride ldc) = (accumulate ? c : 0) + a·b` on the calling
/// thread.
///
/// # Safety
/// The caller has checked that [`available`] is true, that every element
/// the views describe lies inside their slices, and that `c` points at an
/// `m × n` block with row stride `ldc ≥ n` that nothing else reads or
/// writes during the call.
pub unsafe fn serial(
    pieces: Pieces,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match pieces {
            Pieces::Three => split_serial::<3>(&PRODUCTS_THREE, a, b, c, ldc, accumulate),
            Pieces::Two => split_serial::<2>(&PRODUCTS_TWO, a, b, c, ldc, accumulate),
        }
    }
}

/// One cache line of bf16 values: packed panels are built from these so
/// every tile row is 64-byte aligned (a tile load whose rows straddle
/// cache lines runs at a quarter of the speed).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u16; 32]);

thread_local! {
    /// Packing buffers (A block, B block), kept per thread between calls.
    static BUFFERS: RefCell<(Vec<Line>, Vec<Line>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// A buffer of at least `len` bf16 values, as a slice of them.
fn lines(buffer: &mut Vec<Line>, len: usize) -> &mut [u16] {
    let count = len.div_ceil(32);
    if buffer.len() < count {
        buffer.resize(count, Line([0; 32]));
    }
    // SAFETY: `Line` is 32 u16 values with no padding.
    unsafe { std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast::<u16>(), count * 32) }
}

/// bf16 values one packed 32-wide panel holds per 32-deep step: `P`
/// pieces of two tiles.
const fn step_len<const P: usize>() -> usize {
    P * 2 * TILE
}

/// One thread's multiply: blocked and packed as in the module comment.
///
/// # Safety
/// As [`serial`]: [`available`] is true, both views lie inside their
/// slices, and `c` is an `m × n` block with row stride `ldc` that nothing
/// else touches during the call.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn split_serial<const P: usize>(
    products: &[(usize, usize)],
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let run = |bufs: &mut (Vec<Line>, Vec<Line>)| {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let steps_max = KC.min(k).div_ceil(KB);
        let apack = lines(
            &mut bufs.0,
            MC.min(m).div_ceil(BLOCK) * steps_max * step_len::<P>(),
        );
        let bpack = lines(
            &mut bufs.1,
            NC.min(n).div_ceil(BLOCK) * steps_max * step_len::<P>(),
        );
        // SAFETY: the configuration is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let steps = kc.div_ceil(KB);
                let panel_len = steps * step_len::<P>();
                let load_c = accumulate || pc > 0;
                for (panel, j) in (0..nc).step_by(BLOCK).enumerate() {
                    let dst = &mut bpack[panel * panel_len..][..panel_len];
                    // SAFETY: the caller checked the view's extent.
                    unsafe { pack_b::<P>(&b, pc, kc, jc + j, BLOCK.min(nc - j), dst) };
                }
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    for (panel, i) in (0..mc).step_by(BLOCK).enumerate() {
                        let dst = &mut apack[panel * panel_len..][..panel_len];
                        // SAFETY: as above.
                        unsafe { pack_a::<P>(&a, ic + i, BLOCK.min(mc - i), pc, kc, dst) };
                    }
                    for (ap, i) in (0..mc).step_by(BLOCK).enumerate() {
                        let rows = BLOCK.min(mc - i);
                        let apanel = apack[ap * panel_len..].as_ptr();
                        for (bp, j) in (0..nc).step_by(BLOCK).enumerate() {
                            let cols = BLOCK.min(nc - j);
                            let bpanel = bpack[bp * panel_len..].as_ptr();
                            // SAFETY: (ic+i, jc+j) + (rows, cols) lies
                            // inside the caller's m × n block of C; the
                            // panels hold `steps` packed steps.
                            unsafe {
                                let cp = c.add((ic + i) * ldc + jc + j);
                                block::<P>(
                                    products, steps, apanel, bpanel, cp, ldc, load_c, rows, cols,
                                );
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: releasing the tile state is always allowed.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    };
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => run(&mut bufs),
        // Re-entered on this thread (never expected): use fresh buffers.
        Err(_) => run(&mut (Vec::new(), Vec::new())),
    });
}

/// `C[rows × cols] (+)= A panel · B panel` over `steps` packed steps: in
/// place when the block is whole, through a 32 × 32 scratch block at the
/// edges of C.
///
/// # Safety
/// Called within [`split_serial`] (tiles configured); the panels hold
/// `steps` packed steps and `c` (row stride `ldc`) has `rows × cols`
/// writable elements.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block<const P: usize>(
    products: &[(usize, usize)],
    steps: usize,
    apanel: *const u16,
    bpanel: *const u16,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
    rows: usize,
    cols: usize,
) {
    if rows == BLOCK && cols == BLOCK {
        // SAFETY: forwarded: the whole 32 × 32 block lies inside C.
        unsafe { micro_kernel::<P>(products, steps, apanel, bpanel, c, ldc * 4, load_c) };
        return;
    }
    let mut scratch = [0f32; BLOCK * BLOCK];
    if load_c {
        for r in 0..rows {
            for q in 0..cols {
                // SAFETY: (r, q) lies inside the caller's block of C.
                scratch[r * BLOCK + q] = unsafe { *c.add(r * ldc + q) };
            }
        }
    }
    let s = scratch.as_mut_ptr();
    // SAFETY: the scratch block is 32 × 32 with rows of 128 bytes.
    unsafe { micro_kernel::<P>(products, steps, apanel, bpanel, s, BLOCK * 4, true) };
    for r in 0..rows {
        for q in 0..cols {
            // SAFETY: (r, q) lies inside the caller's block of C.
            unsafe { *c.add(r * ldc + q) = scratch[r * BLOCK + q] };
        }
    }
}

/// The AMX micro-kernel: C (32 × 32, row stride `c_bytes` bytes) (+)= the
/// kept piece products of an A panel and a B panel over `steps` steps.
///
/// Registers: tmm0..3 hold C's quadrants (00, 01, 10, 11), tmm4/tmm5 the
/// top/bottom tiles of the current A piece, tmm6/tmm7 the left/right
/// tiles of the current B piece. Each piece pair is four tile products;
/// the last (tmm3 += tmm5·tmm7) is deferred past the next pair's first
/// load so that the load does not wait for it.
///
/// # Safety
/// The tiles are configured (as in [`split_serial`]); the panels hold the
/// packed steps `products` reads; `c` points at a whole 32 × 32 block with
/// row stride `ldc`.
#[inline(always)]
unsafe fn micro_kernel<const P: usize>(
    products: &[(usize, usize)],
    steps: usize,
    apanel: *const u16,
    bpanel: *const u16,
    c: *mut f32,
    c_bytes: usize,
    load_c: bool,
) {
    let half_down = c.cast::<u8>().wrapping_add(16 * c_bytes);
    // SAFETY: (all asm blocks) the tile configuration is loaded; every
    // address read lies inside a packed panel (two 1 KB tiles per piece
    // and step) or inside the 32 × 32 block of C the caller owns.
    unsafe {
        if load_c {
            asm!(
                "tileloadd tmm0, [{c} + {s}*1]",
                "tileloadd tmm1, [{c} + {s}*1 + 64]",
                "tileloadd tmm2, [{d} + {s}*1]",
                "tileloadd tmm3, [{d} + {s}*1 + 64]",
                c = in(reg) c, d = in(reg) half_down, s = in(reg) c_bytes,
                options(nostack, readonly),
            );
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
        let mut first = true;
        for step in 0..steps {
            let a_step = apanel.add(step * step_len::<P>());
            let b_step = bpanel.add(step * step_len::<P>());
            let mut held: Option<(usize, usize)> = None;
            for &(pa, pb) in products {
                let a = a_step.add(pa * 2 * TILE);
                let b = b_step.add(pb * 2 * TILE);
                let (new_a, new_b) = match held {
                    None => (true, true),
                    Some((ha, hb)) => (ha != pa, hb != pb),
                };
                held = Some((pa, pb));
                match (first, new_a, new_b) {
                    (true, _, _) => asm!(
                        "tileloadd tmm4, [{a} + {s}*1]",
                        "tileloadd tmm6, [{b} + {s}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b} + {s}*1 + 1024]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a} + {s}*1 + 1024]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        a = in(reg) a, b = in(reg) b, s = in(reg) 64usize,
                        options(nostack, readonly),
                    ),
                    (false, true, true) => asm!(
                        "tileloadd tmm4, [{a} + {s}*1]",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        "tileloadd tmm6, [{b} + {s}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b} + {s}*1 + 1024]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a} + {s}*1 + 1024]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        a = in(reg) a, b = in(reg) b, s = in(reg) 64usize,
                        options(nostack, readonly),
                    ),
                    (false, true, false) => asm!(
                        "tileloadd tmm4, [{a} + {s}*1]",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a} + {s}*1 + 1024]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        a = in(reg) a, s = in(reg) 64usize,
                        options(nostack, readonly),
                    ),
                    (false, false, _) => asm!(
                        "tileloadd tmm6, [{b} + {s}*1]",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b} + {s}*1 + 1024]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        b = in(reg) b, s = in(reg) 64usize,
                        options(nostack, readonly),
                    ),
                }
                first = false;
            }
        }
        asm!(
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tilestored [{c} + {s}*1], tmm0",
            "tilestored [{c} + {s}*1 + 64], tmm1",
            "tilestored [{d} + {s}*1], tmm2",
            "tilestored [{d} + {s}*1 + 64], tmm3",
            c = in(reg) c, d = in(reg) half_down, s = in(reg) c_bytes,
            options(nostack),
        );
    }
}

/// `out[r][q] = v(r0 + r, c0 + q)` for `r < rows`, `q < cols`, zero
/// elsewhere in the 32 × 32 block; reads along whichever index is
/// contiguous in memory.
///
/// # Safety
/// Every element of `v` in rows `r0..r0+rows` and columns `c0..c0+cols`
/// lies inside its slice.
#[inline(always)]
unsafe fn gather(
    v: &MatRef<'_>,
    r0: usize,
    rows: usize,
    c0: usize,
    cols: usize,
    out: &mut [[f32; 32]; 32],
) {
    let base = v
        .data
        .as_ptr()
        .add(v.offset + r0 * v.row_stride + c0 * v.col_stride);
    if rows < 32 || cols < 32 {
        *out = [[0.0; 32]; 32];
    }
    if v.col_stride == 1 {
        for (r, row) in out.iter_mut().enumerate().take(rows) {
            std::ptr::copy_nonoverlapping(base.add(r * v.row_stride), row.as_mut_ptr(), cols);
        }
    } else if v.row_stride == 1 {
        for q in 0..cols {
            let src = base.add(q * v.col_stride);
            for (r, row) in out.iter_mut().enumerate().take(rows) {
                row[q] = *src.add(r);
            }
        }
    } else {
        for (r, row) in out.iter_mut().enumerate().take(rows) {
            for (q, x) in row.iter_mut().enumerate().take(cols) {
                *x = *base.add(r * v.row_stride + q * v.col_stride);
            }
        }
    }
}

/// The `P` bf16 pieces of 16 values: piece 0 rounds the value to bf16,
/// each next piece rounds what the previous ones left.
///
/// # Safety
/// The CPU has AVX-512 BF16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn split16<const P: usize>(x: __m512) -> [__m256i; P] {
    let mut pieces = [_mm256_setzero_si256(); P];
    let mut rest = x;
    for piece in pieces.iter_mut() {
        let h = _mm512_cvtneps_pbh(rest);
        let h: __m256i = std::mem::transmute(h);
        *piece = h;
        let back = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        rest = _mm512_sub_ps(rest, back);
    }
    pieces
}

/// Packs rows `i0..i0+rows` (≤ 32) × columns `p0..p0+kc` of A as one
/// panel: per 32-deep step, per piece, a top and a bottom 16 × 32 tile.
///
/// # Safety
/// The CPU has AVX-512 BF16; the rows and columns packed lie inside `a`'s
/// slice and `dst` holds a whole panel.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a<const P: usize>(
    a: &MatRef<'_>,
    i0: usize,
    rows: usize,
    p0: usize,
    kc: usize,
    dst: &mut [u16],
) {
    let mut block = [[0f32; 32]; 32];
    let d = dst.as_mut_ptr();
    for step in 0..kc.div_ceil(KB) {
        let depth = KB.min(kc - step * KB);
        gather(a, i0, rows, p0 + step * KB, depth, &mut block);
        let out = d.add(step * step_len::<P>());
        for (r, row) in block.iter().enumerate() {
            let lo = split16::<P>(_mm512_loadu_ps(row.as_ptr()));
            let hi = split16::<P>(_mm512_loadu_ps(row.as_ptr().add(16)));
            // Piece p, tile r / 16, row r % 16: 32 bf16 values.
            let at = |p: usize| out.add(p * 2 * TILE + (r / 16) * TILE + (r % 16) * 32);
            for p in 0..P {
                _mm256_storeu_si256(at(p).cast(), lo[p]);
                _mm256_storeu_si256(at(p).add(16).cast(), hi[p]);
            }
        }
    }
}

/// Packs rows `p0..p0+kc` × columns `j0..j0+cols` (≤ 32) of B as one
/// panel: per 32-deep step, per piece, a left and a right tile of 16 rows
/// of (k, k+1) pairs for 16 columns.
///
/// # Safety
/// The CPU has AVX-512 BF16; the rows and columns packed lie inside `b`'s
/// slice and `dst` holds a whole panel.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b<const P: usize>(
    b: &MatRef<'_>,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    dst: &mut [u16],
) {
    let mut block = [[0f32; 32]; 32];
    let d = dst.as_mut_ptr();
    for step in 0..kc.div_ceil(KB) {
        let depth = KB.min(kc - step * KB);
        // block[k][n] = B(p0 + step·32 + k, j0 + n)
        gather(b, p0 + step * KB, depth, j0, cols, &mut block);
        let out = d.add(step * step_len::<P>());
        for pair in 0..16 {
            let (even, odd) = (&block[2 * pair], &block[2 * pair + 1]);
            for half in 0..2 {
                let e = split16::<P>(_mm512_loadu_ps(even.as_ptr().add(16 * half)));
                let o = split16::<P>(_mm512_loadu_ps(odd.as_ptr().add(16 * half)));
                for p in 0..P {
                    // 16 (k, k+1) pairs: even in the low half of each u32.
                    let lo = _mm512_cvtepu16_epi32(e[p]);
                    let hi = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(o[p]));
                    let row = out.add(p * 2 * TILE + half * TILE + pair * 32);
                    _mm512_storeu_si512(row.cast(), _mm512_or_si512(lo, hi));
                }
            }
        }
    }
}
