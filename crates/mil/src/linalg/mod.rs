//! Dense f32 matrix multiply: the one place the crate multiplies matrices.
//! Four implementations sit behind [`sgemm`], chosen once per process in
//! this order of preference (docs/benchmarks.md has the measurements):
//!
//! * [`Library::Mkl`]: Intel MKL's `cblas_sgemm`, when it can be loaded at
//!   run time (`mkl.rs`; `ANETRAIN_MKL` or the loader's search path) — the
//!   fastest measured at a training step's shapes;
//! * [`Library::Avx512`]: our own packed, cache-blocked kernel
//!   (`avx512.rs`), on CPUs with AVX-512 — level with OpenBLAS;
//! * [`Library::OpenBlas`]: the system OpenBLAS's `cblas_sgemm`, when the
//!   build found it (`build.rs`);
//! * [`Library::GemmCrate`]: the pure-Rust `gemm` crate, always built.
//!
//! Two more are only used when asked for: our Intel AMX kernel (`amx.rs`),
//! which multiplies f32 matrices as sums of bf16 tile products, either to
//! f32 working precision ([`Library::Amx`]) or with about 16 bits per
//! operand ([`Library::AmxBf16x3`], which changes results at the 1e-5
//! level). Neither was faster than MKL in a whole training step on the
//! 2-vCPU machine we measured (where two threads of tile products ran no
//! faster than one), so neither is a default.
//!
//! `ANETRAIN_MATMUL=mkl|avx512|openblas|gemm|amx|amx-bf16x3` overrides the
//! choice (for measurements); [`check_env`] validates it. Matrices are
//! described by a pointer-free view (slice, offset, row and column strides)
//! so transposed operands cost nothing.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod mkl;

use std::sync::OnceLock;

/// A read-only strided matrix view: element (r, c) is
/// `data[offset + r * row_stride + c * col_stride]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// Row-major `rows × cols` matrix starting at `offset`.
    pub fn row_major(data: &'a [f32], offset: usize, rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            offset,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of this view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Index one past the last element the view can touch.
    fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.offset;
        }
        self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
    }
}

/// A matrix-multiply implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Amx,
    AmxBf16x3,
    Mkl,
    Avx512,
    OpenBlas,
    GemmCrate,
}

impl Library {
    /// Every implementation, in order of preference.
    pub const ALL: [Library; 6] = [
        Library::Mkl,
        Library::Avx512,
        Library::OpenBlas,
        Library::GemmCrate,
        Library::Amx,
        Library::AmxBf16x3,
    ];

    /// The name `ANETRAIN_MATMUL` accepts.
    pub fn key(self) -> &'static str {
        match self {
            Library::Amx => "amx",
            Library::AmxBf16x3 => "amx-bf16x3",
            Library::Mkl => "mkl",
            Library::Avx512 => "avx512",
            Library::OpenBlas => "openblas",
            Library::GemmCrate => "gemm",
        }
    }

    /// A human-readable description.
    pub fn describe(self) -> &'static str {
        match self {
            Library::Amx => "anetrain AMX kernel (f32 as three bf16 pieces, six tile products)",
            Library::AmxBf16x3 => {
                "anetrain AMX kernel (two bf16 pieces, three tile products: about 16 bits)"
            }
            Library::Mkl => "Intel MKL (loaded at run time, sequential, one call per thread)",
            Library::Avx512 => "anetrain AVX-512 kernel (packed, cache-blocked)",
            Library::OpenBlas => "OpenBLAS (system library)",
            Library::GemmCrate => "gemm crate (pure Rust)",
        }
    }

    /// Whether this build, on this CPU, can use it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
            Library::Mkl => mkl::sgemm().is_some(),
            #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
            Library::Mkl => false,
            #[cfg(target_arch = "x86_64")]
            Library::Amx | Library::AmxBf16x3 => amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Library::Amx | Library::AmxBf16x3 => false,
            #[cfg(target_arch = "x86_64")]
            Library::Avx512 => avx512::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Library::Avx512 => false,
            Library::OpenBlas => cfg!(openblas),
            Library::GemmCrate => true,
        }
    }
}

impl Library {
    /// How many bf16 pieces the AMX kernel splits operands into, for the
    /// two AMX libraries.
    #[cfg(target_arch = "x86_64")]
    fn amx_pieces(self) -> Option<amx::Pieces> {
        match self {
            Library::Amx => Some(amx::Pieces::Three),
            Library::AmxBf16x3 => Some(amx::Pieces::Two),
            _ => None,
        }
    }
}

/// The first available implementation in order of preference.
fn default_library() -> Library {
    Library::ALL
        .into_iter()
        .find(|l| l.available())
        .unwrap_or(Library::GemmCrate)
}

/// The implementation `ANETRAIN_MATMUL` asks for, or the first available
/// one; an error names the variable and the accepted values.
fn choose() -> Result<Library, String> {
    let default = default_library();
    let Ok(wanted) = std::env::var("ANETRAIN_MATMUL") else {
        return Ok(default);
    };
    let keys: Vec<&str> = Library::ALL.iter().map(|l| l.key()).collect();
    match Library::ALL.into_iter().find(|l| l.key() == wanted) {
        Some(l) if l.available() => Ok(l),
        Some(l) => Err(format!(
            "ANETRAIN_MATMUL={wanted}: {} is not available in this build on this CPU \
             (unset the variable to use {})",
            l.describe(),
            default.key()
        )),
        None => Err(format!(
            "ANETRAIN_MATMUL={wanted}: unknown matrix-multiply library (expected one of: {})",
            keys.join(", ")
        )),
    }
}

static SELECTED: OnceLock<Library> = OnceLock::new();

/// The implementation [`sgemm`] uses (an invalid `ANETRAIN_MATMUL` falls
/// back to the default; call [`check_env`] first to report it).
pub fn selected() -> Library {
    *SELECTED.get_or_init(|| choose().unwrap_or_else(|_| default_library()))
}

/// Validates `ANETRAIN_MATMUL` and `ANETRAIN_MKL`: a one-line error if the
/// first names an unknown or unavailable library or the second a library
/// that cannot be loaded.
pub fn check_env() -> Result<(), String> {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    if let Some(e) = mkl::env_error() {
        return Err(e);
    }
    choose().map(|_| ())
}

/// The matrix-multiply library this process uses.
pub fn library() -> &'static str {
    selected().describe()
}

/// Number of threads the matrix multiply uses (all available cores).
pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// `dst[m×n] (row-major, at dst_offset, row stride dst_rs) = beta·dst + a·b`,
/// with `beta` either 0 (overwrite) or 1 (accumulate).
///
/// Panics if a view reaches outside its slice (a caller bug, never user
/// input: shapes are validated before evaluation).
pub fn sgemm(
    a: MatRef<'_>,
    b: MatRef<'_>,
    dst: &mut [f32],
    dst_offset: usize,
    dst_rs: usize,
    accumulate: bool,
) {
    sgemm_with(selected(), a, b, dst, dst_offset, dst_rs, accumulate)
}

/// [`sgemm`] through a given implementation (for tests and benchmarks);
/// one that is not [`Library::available`] falls back to the next.
pub fn sgemm_with(
    library: Library,
    a: MatRef<'_>,
    b: MatRef<'_>,
    dst: &mut [f32],
    dst_offset: usize,
    dst_rs: usize,
    accumulate: bool,
) {
    multiply(library, true, a, b, dst, dst_offset, dst_rs, accumulate)
}

/// [`sgemm`] on the calling thread only, for callers that already run
/// independent products in parallel (attention heads): the AVX-512 kernel
/// where the CPU has it, else the `gemm` crate without threads (OpenBLAS
/// cannot be told to keep one call on one thread).
pub fn sgemm_local(
    a: MatRef<'_>,
    b: MatRef<'_>,
    dst: &mut [f32],
    dst_offset: usize,
    dst_rs: usize,
    accumulate: bool,
) {
    let library = if Library::Avx512.available() {
        Library::Avx512
    } else {
        Library::GemmCrate
    };
    multiply(library, false, a, b, dst, dst_offset, dst_rs, accumulate)
}

#[allow(clippy::too_many_arguments)]
fn multiply(
    library: Library,
    threaded: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    dst: &mut [f32],
    dst_offset: usize,
    dst_rs: usize,
    accumulate: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "sgemm: inner dimensions differ");
    assert!(a.extent() <= a.data.len() && b.extent() <= b.data.len());
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_offset + (m - 1) * dst_rs + n <= dst.len());
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[dst_offset + r * dst_rs..][..n].fill(0.0);
            }
        }
        return;
    }
    if dst_rs >= n {
        let c = dst[dst_offset..].as_mut_ptr();
        let threads = part_count(threaded, m, n, k);
        // Our kernels: each thread of the pool multiplies its part of C.
        // SAFETY (both): the asserts above prove both views and the m × n
        // block of `dst` lie inside their slices; `dst` is a unique borrow,
        // so it cannot alias `a` or `b`; each part writes only its own
        // block; the CPU (and, for AMX, kernel) support was just checked.
        #[cfg(target_arch = "x86_64")]
        if let (Some(pieces), true) = (library.amx_pieces(), amx::available()) {
            let (tm, tn) = amx::PART_TILE;
            unsafe {
                in_parts(a, b, c, dst_rs, threads, tm, tn, |a, b, c| {
                    amx::serial(pieces, a, b, c, dst_rs, accumulate)
                })
            };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if library == Library::Avx512 && avx512::available() {
            let (tm, tn) = avx512::PART_TILE;
            unsafe {
                in_parts(a, b, c, dst_rs, threads, tm, tn, |a, b, c| {
                    avx512::serial(a, b, c, dst_rs, accumulate)
                })
            };
            return;
        }
        // MKL's sequential library on each part, split like our kernel.
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        if library == Library::Mkl {
            if let Some(f) = mkl::sgemm() {
                let done = std::sync::atomic::AtomicBool::new(true);
                // SAFETY: the asserts above prove both views and the m × n
                // block of `dst` lie inside their slices; `dst` is a unique
                // borrow; each part writes only its own block.
                unsafe {
                    in_parts(a, b, c, dst_rs, threads, 16, 16, |a, b, c| {
                        if !call_cblas(f, &a, &b, c, dst_rs, accumulate) {
                            done.store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                    })
                };
                // Every part has the same operand layout: all or none ran.
                if done.into_inner() {
                    return;
                }
            }
        }
        // SAFETY: as above.
        #[cfg(openblas)]
        if threaded
            && library != Library::GemmCrate
            && unsafe { call_cblas(openblas_sgemm, &a, &b, c, dst_rs, accumulate) }
        {
            return;
        }
    }
    let flops = 2 * m * n * k;
    let par = if threaded && flops >= 1 << 24 {
        gemm::Parallelism::Rayon(threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above prove every (row, col) index the three views
    // describe lies inside its slice; `dst` is borrowed mutably and so cannot
    // alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr().add(a.offset),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr().add(b.offset),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// The `cblas_sgemm` signature (row-major order, transpose flags, sizes,
/// alpha, A, lda, B, ldb, beta, C, ldc).
type CblasSgemm = unsafe extern "C" fn(
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
);

/// Calls a `cblas_sgemm` for `c (row stride ldc) = (accumulate ? c : 0) +
/// a·b` when both views are BLAS-shaped (one stride 1) and every size fits
/// an `i32`; returns false (nothing done) otherwise.
///
/// # Safety
/// Both views lie inside their slices and `c` points at an `m × n` block
/// with row stride `ldc` that nothing else reads or writes during the call.
unsafe fn call_cblas(
    f: CblasSgemm,
    a: &MatRef<'_>,
    b: &MatRef<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) -> bool {
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;
    // A view as an operand: (transpose flag, leading dimension).
    let operand = |v: &MatRef<'_>| {
        if v.col_stride == 1 && v.row_stride >= v.cols.max(1) {
            Some((NO_TRANS, v.row_stride))
        } else if v.row_stride == 1 && v.col_stride >= v.rows.max(1) {
            Some((TRANS, v.col_stride))
        } else {
            None
        }
    };
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let (Some((ta, lda)), Some((tb, ldb))) = (operand(a), operand(b)) else {
        return false;
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    if ![m, n, k, lda, ldb, ldc].into_iter().all(fits) || ldc < n {
        return false;
    }
    // SAFETY: the caller's contract covers exactly these sizes and strides.
    unsafe {
        f(
            ROW_MAJOR,
            ta,
            tb,
            m as i32,
            n as i32,
            k as i32,
            1.0,
            a.data.as_ptr().add(a.offset),
            lda as i32,
            b.data.as_ptr().add(b.offset),
            ldb as i32,
            if accumulate { 1.0 } else { 0.0 },
            c,
            ldc as i32,
        )
    };
    true
}

#[cfg(openblas)]
extern "C" {
    /// The system OpenBLAS (linked when `build.rs` found it).
    #[link_name = "cblas_sgemm"]
    fn openblas_sgemm(
        order: i32,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const f32,
        lda: i32,
        b: *const f32,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    );
}

/// Below this many multiply-adds a product runs on the calling thread:
/// splitting it would cost more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 21;

/// How many parts [`in_parts`] should split an `m × k · k × n` product
/// into: every thread of the pool when `threaded` and the product is large
/// enough, else one.
fn part_count(threaded: bool, m: usize, n: usize, k: usize) -> usize {
    if threaded && m * n * k >= PARALLEL_MIN_MACS {
        rayon::current_num_threads().max(1)
    } else {
        1
    }
}

/// Runs `part(a_part, b_part, c_part)` over disjoint parts of `c = a·b`
/// (`m × n`, row stride `ldc`) on up to `threads` threads of the pool: the
/// dimension with more `tile_m × tile_n` tiles is split, in whole tiles, so
/// no tile straddles two parts and each part is a complete product (its
/// result does not depend on the number of parts).
///
/// # Safety
/// `c` points at an `m × n` block with row stride `ldc` that nothing else
/// reads or writes during the call, and `part` writes only the block it is
/// given.
#[allow(clippy::too_many_arguments)]
unsafe fn in_parts(
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: *mut f32,
    ldc: usize,
    threads: usize,
    tile_m: usize,
    tile_n: usize,
    part: impl Fn(MatRef<'_>, MatRef<'_>, *mut f32) + Sync,
) {
    let (m, n) = (a.rows, b.cols);
    if threads <= 1 {
        part(a, b, c);
        return;
    }
    let split_cols = n.div_ceil(tile_n) >= m.div_ceil(tile_m);
    let (tiles, tile, len) = if split_cols {
        (n.div_ceil(tile_n), tile_n, n)
    } else {
        (m.div_ceil(tile_m), tile_m, m)
    };
    let parts = threads.min(tiles);
    let c = SendPtr(c);
    let part = &part;
    rayon::scope(|s| {
        for p in 0..parts {
            let lo = (tiles * p / parts * tile).min(len);
            let hi = (tiles * (p + 1) / parts * tile).min(len);
            if lo == hi {
                continue;
            }
            let run = move || {
                let c = c;
                // SAFETY: parts cover disjoint column (or row) ranges of C.
                unsafe {
                    if split_cols {
                        part(a, b.cols_range(lo, hi), c.0.add(lo))
                    } else {
                        part(a.rows_range(lo, hi), b, c.0.add(lo * ldc))
                    }
                }
            };
            if p + 1 == parts {
                run();
            } else {
                s.spawn(move |_| run());
            }
        }
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: threads only write disjoint parts of the destination.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl MatRef<'_> {
    /// Rows `lo..hi` of this view.
    pub fn rows_range(self, lo: usize, hi: usize) -> Self {
        MatRef {
            offset: self.offset + lo * self.row_stride,
            rows: hi - lo,
            ..self
        }
    }

    /// Columns `lo..hi` of this view.
    pub fn cols_range(self, lo: usize, hi: usize) -> Self {
        MatRef {
            offset: self.offset + lo * self.col_stride,
            cols: hi - lo,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgemm_matches_naive_with_transposes() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect(); // [n, k]
        let mut out = vec![1.0f32; m * n];
        sgemm(
            MatRef::row_major(&a, 0, m, k),
            MatRef::row_major(&bt, 0, n, k).t(),
            &mut out,
            0,
            n,
            false,
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-5);
            }
        }
    }

    /// Every available implementation against a naive f64 product, over
    /// shapes that leave partial micro-tiles and cross every blocking size
    /// (KC = 256 deep, MC = 336 rows, NC = 2048 columns in the AVX-512
    /// kernel), plain and transposed operands, offsets, a destination row
    /// stride wider than the product, and both overwrite and accumulate.
    /// Tolerance: f32 sums of up to 700 products of values in [-1, 1]
    /// carry a rounding error far below 1e-4 relative to the sum of |terms|.
    #[test]
    fn non_finite_inputs_give_non_finite_outputs() {
        // The trainer skips a step whose loss or gradients are not finite:
        // every implementation must carry NaN and ±∞ through a product.
        let (m, k, n) = (40, 70, 36);
        for lib in Library::ALL.into_iter().filter(|l| l.available()) {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut a = vec![0.5f32; m * k];
                a[7 * k + 3] = bad;
                let b = vec![0.25f32; k * n];
                let mut out = vec![0.0f32; m * n];
                let (av, bv) = (
                    MatRef::row_major(&a, 0, m, k),
                    MatRef::row_major(&b, 0, k, n),
                );
                sgemm_with(lib, av, bv, &mut out, 0, n, false);
                for (r, row) in out.chunks(n).enumerate() {
                    let finite = row.iter().all(|x| x.is_finite());
                    assert_eq!(finite, r != 7, "{lib:?} with {bad} at row 7: row {r}");
                }
            }
        }
    }

    #[test]
    fn every_library_matches_naive_on_awkward_shapes() {
        let shapes = [
            (1, 1, 1),
            (13, 5, 31),
            (14, 256, 32),
            (15, 257, 33),
            (29, 700, 70),
            (340, 40, 17),
            (3, 9, 2100),
            (600, 300, 100),
        ];
        // `None`: sgemm_local.
        let libs = Library::ALL.into_iter().filter(|l| l.available()).map(Some);
        for lib in libs.chain([None]) {
            for &(m, k, n) in &shapes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    for accumulate in [false, true] {
                        check_against_naive(lib, m, k, n, ta, tb, accumulate);
                    }
                }
            }
        }
    }

    fn check_against_naive(
        lib: Option<Library>,
        m: usize,
        k: usize,
        n: usize,
        ta: bool,
        tb: bool,
        accumulate: bool,
    ) {
        let value = |i: usize, salt: f32| ((i as f32 * 0.618 + salt).sin() * 1.3).clamp(-1.0, 1.0);
        let off = 3;
        let a_data: Vec<f32> = (0..off + m * k).map(|i| value(i, 0.1)).collect();
        let b_data: Vec<f32> = (0..off + k * n).map(|i| value(i, 0.7)).collect();
        let a = if ta {
            MatRef::row_major(&a_data, off, k, m).t()
        } else {
            MatRef::row_major(&a_data, off, m, k)
        };
        let b = if tb {
            MatRef::row_major(&b_data, off, n, k).t()
        } else {
            MatRef::row_major(&b_data, off, k, n)
        };
        let ld = n + 5;
        let dst_off = 2;
        let init: Vec<f32> = (0..dst_off + m * ld).map(|i| value(i, 2.0)).collect();
        let mut out = init.clone();
        match lib {
            Some(lib) => sgemm_with(lib, a, b, &mut out, dst_off, ld, accumulate),
            None => sgemm_local(a, b, &mut out, dst_off, ld, accumulate),
        }
        let at = |v: &MatRef, r: usize, c: usize| {
            v.data[v.offset + r * v.row_stride + c * v.col_stride] as f64
        };
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut scale) = (0.0f64, 1.0f64);
                for p in 0..k {
                    let t = at(&a, i, p) * at(&b, p, j);
                    want += t;
                    scale += t.abs();
                }
                let idx = dst_off + i * ld + j;
                if accumulate {
                    want += init[idx] as f64;
                }
                let got = out[idx] as f64;
                let tol = if lib == Some(Library::AmxBf16x3) {
                    1e-4
                } else {
                    1e-5
                };
                assert!(
                    (got - want).abs() <= tol * scale,
                    "{lib:?} {m}x{k}x{n} ta={ta} tb={tb} acc={accumulate}: [{i},{j}] {got} vs {want}"
                );
            }
            // Padding between rows is untouched.
            for j in n..ld {
                let idx = dst_off + i * ld + j;
                if idx < out.len() {
                    assert_eq!(out[idx], init[idx], "{lib:?} wrote outside the product");
                }
            }
        }
        assert_eq!(out[..dst_off], init[..dst_off]);
    }
}
