//! # linalg
//!
//! Dense f32 matrix products: the one place anetrain multiplies matrices.
//! A product is `c (+)= a·b` over strided views ([`MatRef`], [`MatMut`]),
//! so transposed operands and sub-blocks cost nothing. Several
//! implementations ([`Backend`]) sit behind [`matmul`]; one is chosen per
//! process, in this order of preference (docs/benchmarks.md has the
//! measurements that put each one here):
//!
//! | backend | when | measured |
//! |---|---|---|
//! | [`Backend::Mkl`] | Intel MKL's `cblas_sgemm` loads at run time (`ANETRAIN_MKL` or the loader's path) | fastest at training shapes on x86 (Qwen3-0.6B step 7–8% faster than the next) |
//! | [`Backend::Accelerate`] | macOS: Apple's Accelerate framework loads at run time | the BLAS Apple tunes for its CPUs (not measured by us: no Mac in our loop) |
//! | [`Backend::Avx512`] | the CPU has AVX-512 | level with OpenBLAS, no system library |
//! | [`Backend::OpenBlas`] | the build found the system OpenBLAS (`build.rs`) | about 1.6× the `gemm` crate in a training step |
//! | [`Backend::GemmCrate`] | always (feature `backends`) | the portable fallback |
//! | [`Backend::Naive`] | always | plain loops; only chosen in builds without the `backends` feature (the MIL parser's fuzz target) |
//!
//! With the `amx` feature, two more are available but never chosen unless
//! asked for: our Intel AMX kernel, which multiplies f32 matrices as sums of
//! bf16 tile products to f32 precision ([`Backend::Amx`]) or with about 16
//! bits per operand ([`Backend::AmxBf16x3`]); neither beat MKL in a whole
//! training step on the machines measured.
//!
//! `ANETRAIN_MATMUL=<key>` overrides the choice; [`check_env`] validates it.
//!
//! Threading: MKL (sequential layer), our AVX-512 and AMX kernels run one
//! serial product per part of C, split over the rayon pool by [`matmul`]
//! (the split is in whole tiles, so results do not depend on the thread
//! count); OpenBLAS and the `gemm` crate thread themselves.

#[cfg(all(feature = "backends", unix))]
mod accelerate;
#[cfg(all(feature = "amx", target_arch = "x86_64"))]
mod amx;
#[cfg(all(feature = "backends", target_arch = "x86_64"))]
mod avx512;
#[cfg(feature = "backends")]
mod cblas;
#[cfg(feature = "backends")]
mod gemm_crate;
mod in_order;
#[cfg(all(feature = "backends", target_os = "linux", target_arch = "x86_64"))]
mod mkl;
mod view;

use std::sync::OnceLock;

pub use view::{MatMut, MatRef};

/// A matrix-product implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Mkl,
    Accelerate,
    Avx512,
    OpenBlas,
    GemmCrate,
    Naive,
    #[cfg(feature = "amx")]
    Amx,
    #[cfg(feature = "amx")]
    AmxBf16x3,
}

impl Backend {
    /// Every backend of this build, in order of preference.
    pub const ALL: &'static [Backend] = &[
        Backend::Mkl,
        Backend::Accelerate,
        Backend::Avx512,
        Backend::OpenBlas,
        Backend::GemmCrate,
        Backend::Naive,
        #[cfg(feature = "amx")]
        Backend::Amx,
        #[cfg(feature = "amx")]
        Backend::AmxBf16x3,
    ];

    /// The name `ANETRAIN_MATMUL` accepts.
    pub fn key(self) -> &'static str {
        match self {
            Backend::Mkl => "mkl",
            Backend::Accelerate => "accelerate",
            Backend::Avx512 => "avx512",
            Backend::OpenBlas => "openblas",
            Backend::GemmCrate => "gemm",
            Backend::Naive => "naive",
            #[cfg(feature = "amx")]
            Backend::Amx => "amx",
            #[cfg(feature = "amx")]
            Backend::AmxBf16x3 => "amx-bf16x3",
        }
    }

    /// A human-readable description.
    pub fn describe(self) -> &'static str {
        match self {
            Backend::Mkl => "Intel MKL (loaded at run time, sequential, one call per thread)",
            Backend::Accelerate => "Apple Accelerate (loaded at run time, threads itself)",
            Backend::Avx512 => "anetrain AVX-512 kernel (packed, cache-blocked)",
            Backend::OpenBlas => "OpenBLAS (system library)",
            Backend::GemmCrate => "gemm crate (pure Rust)",
            Backend::Naive => "plain loops (a build without matrix backends)",
            #[cfg(feature = "amx")]
            Backend::Amx => "anetrain AMX kernel (f32 as three bf16 pieces, six tile products)",
            #[cfg(feature = "amx")]
            Backend::AmxBf16x3 => {
                "anetrain AMX kernel (two bf16 pieces, three tile products: about 16 bits)"
            }
        }
    }

    /// Whether this build, on this CPU, can use it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(all(feature = "backends", target_os = "linux", target_arch = "x86_64"))]
            Backend::Mkl => mkl::sgemm().is_some(),
            #[cfg(all(feature = "backends", unix))]
            Backend::Accelerate => accelerate::sgemm().is_some(),
            #[cfg(all(feature = "backends", target_arch = "x86_64"))]
            Backend::Avx512 => avx512::available(),
            #[cfg(feature = "backends")]
            Backend::OpenBlas => cblas::OPENBLAS.is_some(),
            #[cfg(feature = "backends")]
            Backend::GemmCrate => true,
            Backend::Naive => true,
            #[cfg(all(feature = "amx", target_arch = "x86_64"))]
            Backend::Amx | Backend::AmxBf16x3 => amx::available(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// `c (+)= a·b` through this backend, threaded as the backend is (see
    /// the crate documentation); a backend that is not [`available`], or
    /// cannot take these views, hands the product to the portable one.
    ///
    /// [`available`]: Backend::available
    pub fn matmul(self, a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>, accumulate: bool) {
        multiply(self, true, a, b, c, accumulate)
    }
}

/// The first available backend in order of preference.
fn default_backend() -> Backend {
    Backend::ALL
        .iter()
        .copied()
        .find(|b| b.available())
        .unwrap_or(Backend::Naive)
}

/// The backend `ANETRAIN_MATMUL` asks for, or the first available one; an
/// error names the variable and the accepted values.
fn choose() -> Result<Backend, String> {
    let default = default_backend();
    let Ok(wanted) = std::env::var("ANETRAIN_MATMUL") else {
        return Ok(default);
    };
    match Backend::ALL.iter().copied().find(|b| b.key() == wanted) {
        Some(b) if b.available() => Ok(b),
        Some(b) => Err(format!(
            "ANETRAIN_MATMUL={wanted}: {} is not available in this build on this CPU \
             (unset the variable to use {})",
            b.describe(),
            default.key()
        )),
        None => {
            let keys: Vec<&str> = Backend::ALL.iter().map(|b| b.key()).collect();
            Err(format!(
                "ANETRAIN_MATMUL={wanted}: unknown matrix-multiply library (expected one of: {})",
                keys.join(", ")
            ))
        }
    }
}

static SELECTED: OnceLock<Backend> = OnceLock::new();

/// The backend [`matmul`] uses (an invalid `ANETRAIN_MATMUL` falls back to
/// the default; call [`check_env`] first to report it).
pub fn selected() -> Backend {
    *SELECTED.get_or_init(|| choose().unwrap_or_else(|_| default_backend()))
}

/// Validates `ANETRAIN_MATMUL` and `ANETRAIN_MKL`: a one-line error if the
/// first names an unknown or unavailable backend or the second a library
/// that cannot be loaded.
pub fn check_env() -> Result<(), String> {
    #[cfg(all(feature = "backends", target_os = "linux", target_arch = "x86_64"))]
    if let Some(e) = mkl::env_error() {
        return Err(e);
    }
    #[cfg(all(feature = "backends", unix))]
    if let Some(e) = accelerate::env_error() {
        return Err(e);
    }
    choose().map(|_| ())
}

/// Number of threads products use (all available cores).
pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// `c = a·b`, or `c += a·b` when `accumulate`, through the selected
/// backend, on every thread of the pool when the product is large enough.
///
/// Panics if a view reaches outside its slice or the shapes disagree (a
/// caller bug, never user input: shapes are validated before evaluation).
pub fn matmul(a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>, accumulate: bool) {
    multiply(selected(), true, a, b, c, accumulate)
}

/// [`matmul`] on the calling thread only, for callers that already run
/// independent products in parallel (attention heads): our AVX-512 kernel
/// where the CPU has it, Accelerate on macOS, else the portable backend
/// without threads (OpenBLAS cannot be told to keep one call on one
/// thread).
pub fn matmul_serial(a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>, accumulate: bool) {
    let backend = if Backend::Avx512.available() {
        Backend::Avx512
    } else if cfg!(target_os = "macos") && Backend::Accelerate.available() {
        Backend::Accelerate
    } else {
        portable()
    };
    multiply(backend, false, a, b, c, accumulate)
}

/// `c = a·b`, or `c += a·b` when `accumulate`, with every element the
/// chain of fused multiply-adds over the inner dimension in order (the
/// `in_order` module): the same bits on every CPU and whatever the other
/// rows and columns of the product, so a program split into blocks gives
/// the rows the whole program gives. Our AVX-512 kernel computes it where
/// it is the selected backend, a portable kernel everywhere else; threaded
/// as [`matmul`]. The simulated Neural Engine's products go through it.
///
/// Panics as [`matmul`] does.
pub fn matmul_in_order(a: MatRef<'_>, b: MatRef<'_>, mut c: MatMut<'_>, accumulate: bool) {
    if !check_shapes(&a, &b, &mut c, accumulate) {
        return;
    }
    let ptr = c.as_mut_ptr();
    let ldc = c.row_stride;
    #[cfg(feature = "backends")]
    {
        let parts = part_count(a.rows, b.cols, a.cols);
        #[cfg(target_arch = "x86_64")]
        if selected() == Backend::Avx512 && avx512::available() {
            let (tm, tn) = avx512::PART_TILE;
            // SAFETY: `check_shapes` proved both views and the m × n block
            // of `c` lie inside their slices; `c` is a unique borrow; the
            // CPU has AVX-512.
            unsafe {
                in_parts(a, b, ptr, ldc, parts, tm, tn, |a, b, c| {
                    avx512::serial(a, b, c, ldc, accumulate)
                })
            };
            return;
        }
        let (tm, tn) = in_order::PART_TILE;
        // SAFETY: as above.
        unsafe {
            in_parts(a, b, ptr, ldc, parts, tm, tn, |a, b, c| {
                in_order::serial(a, b, c, ldc, accumulate)
            })
        };
    }
    #[cfg(not(feature = "backends"))]
    // SAFETY: as above.
    unsafe {
        in_order::serial(a, b, ptr, ldc, accumulate)
    };
}

/// The backend every build has that takes any views.
fn portable() -> Backend {
    if cfg!(feature = "backends") {
        Backend::GemmCrate
    } else {
        Backend::Naive
    }
}

fn multiply(
    backend: Backend,
    threaded: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    mut c: MatMut<'_>,
    accumulate: bool,
) {
    if !check_shapes(&a, &b, &mut c, accumulate) {
        return;
    }
    #[cfg(feature = "backends")]
    through_backend(backend, threaded, a, b, c, accumulate);
    #[cfg(not(feature = "backends"))]
    {
        let _ = (backend, threaded);
        naive(a, b, c, accumulate);
    }
}

/// Panics if a view reaches outside its slice or the shapes disagree;
/// finishes an empty product (zeroing C for a zero inner dimension unless
/// accumulating) and returns whether a product remains to be computed.
fn check_shapes(a: &MatRef<'_>, b: &MatRef<'_>, c: &mut MatMut<'_>, accumulate: bool) -> bool {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: inner dimensions differ");
    assert_eq!(
        (c.rows, c.cols),
        (m, n),
        "matmul: the product's shape differs"
    );
    assert!(a.extent() <= a.data.len() && b.extent() <= b.data.len());
    assert!(c.extent() <= c.data.len() && c.row_stride >= n);
    if m == 0 || n == 0 {
        return false;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return false;
    }
    true
}

/// The checked product through `backend`, or the portable backend when
/// `backend` is not available or cannot take these views.
#[cfg(feature = "backends")]
fn through_backend(
    backend: Backend,
    threaded: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    mut c: MatMut<'_>,
    accumulate: bool,
) {
    // Our own kernels and MKL split a product into parts (x86-64 only);
    // the BLAS libraries elsewhere thread themselves.
    #[cfg(target_arch = "x86_64")]
    let parts = if threaded {
        part_count(a.rows, b.cols, a.cols)
    } else {
        1
    };
    let ptr = c.as_mut_ptr();
    let ldc = c.row_stride;
    // SAFETY: (each arm) `multiply` proved both views and the m × n block
    // of `c` lie inside their slices; `c` is a unique borrow, so it cannot
    // alias `a` or `b`; each backend writes only the block it is given;
    // each arm checks its CPU or library support first.
    let done = unsafe {
        match backend {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 if avx512::available() => {
                let (tm, tn) = avx512::PART_TILE;
                in_parts(a, b, ptr, ldc, parts, tm, tn, |a, b, c| {
                    avx512::serial(a, b, c, ldc, accumulate)
                });
                true
            }
            #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
            Backend::Mkl => mkl::sgemm().is_some_and(|f| {
                // Every part has the same operand layout: all or none run.
                let ran = std::sync::atomic::AtomicBool::new(true);
                in_parts(a, b, ptr, ldc, parts, 16, 16, |a, b, c| {
                    if !cblas::call(f, &a, &b, c, ldc, accumulate) {
                        ran.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                ran.into_inner()
            }),
            Backend::OpenBlas if threaded => {
                cblas::OPENBLAS.is_some_and(|f| cblas::call(f, &a, &b, ptr, ldc, accumulate))
            }
            // One call: Accelerate threads itself (and is safe to call
            // from several threads at once, as `matmul_serial` callers do).
            #[cfg(unix)]
            Backend::Accelerate => {
                accelerate::sgemm().is_some_and(|f| cblas::call(f, &a, &b, ptr, ldc, accumulate))
            }
            #[cfg(all(feature = "amx", target_arch = "x86_64"))]
            Backend::Amx | Backend::AmxBf16x3 if amx::available() => {
                let pieces = match backend {
                    Backend::Amx => amx::Pieces::Three,
                    _ => amx::Pieces::Two,
                };
                let (tm, tn) = amx::PART_TILE;
                in_parts(a, b, ptr, ldc, parts, tm, tn, |a, b, c| {
                    amx::serial(pieces, a, b, c, ldc, accumulate)
                });
                true
            }
            _ => false,
        }
    };
    if !done {
        gemm_crate::multiply(threaded, a, b, c, accumulate);
    }
}

/// Plain loops with f32 sums in the order of the inner dimension.
#[cfg(any(not(feature = "backends"), test))]
fn naive(a: MatRef<'_>, b: MatRef<'_>, mut c: MatMut<'_>, accumulate: bool) {
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut sum = 0f32;
            for p in 0..a.cols {
                sum += a.at(i, p) * b.at(p, j);
            }
            let dst = c.at_mut(i, j);
            *dst = if accumulate { *dst + sum } else { sum };
        }
    }
}

#[cfg(feature = "backends")]
/// Below this many multiply-adds a product runs on the calling thread:
/// splitting it would cost more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 21;

#[cfg(feature = "backends")]
/// How many parts [`in_parts`] should split an `m × k · k × n` product
/// into: every thread of the pool when the product is large enough.
fn part_count(m: usize, n: usize, k: usize) -> usize {
    if m * n * k >= PARALLEL_MIN_MACS {
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
#[cfg(feature = "backends")]
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
                // SAFETY: parts cover disjoint column (or row) ranges of C,
                // inside the block the caller vouched for.
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

#[cfg(feature = "backends")]
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the threads of `in_parts` only write disjoint parts of the
// destination through it.
#[cfg(feature = "backends")]
unsafe impl Send for SendPtr {}
// SAFETY: as above.
#[cfg(feature = "backends")]
unsafe impl Sync for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive_with_transposes() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect(); // [n, k]
        let mut out = vec![1.0f32; m * n];
        matmul(
            MatRef::row_major(&a, 0, m, k),
            MatRef::row_major(&bt, 0, n, k).t(),
            MatMut::row_major(&mut out, 0, m, n),
            false,
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-5);
            }
        }
    }

    /// CI names a stand-in library (OpenBLAS) for Accelerate so its loader
    /// and calls run on Linux; the products themselves are checked by the
    /// tests below, which take every available backend.
    #[test]
    #[cfg(unix)]
    fn a_named_accelerate_library_is_loaded() {
        if std::env::var_os("ANETRAIN_ACCELERATE").is_some() {
            assert!(Backend::Accelerate.available(), "{:?}", check_env());
            assert_eq!(default_backend(), Backend::Accelerate);
        }
    }

    #[test]
    fn non_finite_inputs_give_non_finite_outputs() {
        // The trainer skips a step whose loss or gradients are not finite:
        // every backend must carry NaN and ±∞ through a product.
        let (m, k, n) = (40, 70, 36);
        for &backend in Backend::ALL.iter().filter(|b| b.available()) {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut a = vec![0.5f32; m * k];
                a[7 * k + 3] = bad;
                let b = vec![0.25f32; k * n];
                let mut out = vec![0.0f32; m * n];
                let (av, bv) = (
                    MatRef::row_major(&a, 0, m, k),
                    MatRef::row_major(&b, 0, k, n),
                );
                backend.matmul(av, bv, MatMut::row_major(&mut out, 0, m, n), false);
                for (r, row) in out.chunks(n).enumerate() {
                    let finite = row.iter().all(|x| x.is_finite());
                    assert_eq!(finite, r != 7, "{backend:?} with {bad} at row 7: row {r}");
                }
            }
        }
    }

    /// Every available backend (and the serial product, and the plain
    /// loops) against a naive f64 product, over shapes that leave partial
    /// micro-tiles and cross every blocking size (KC = 256 deep, MC = 336
    /// rows, NC = 2048 columns in the AVX-512 kernel), plain and transposed
    /// operands, offsets, a destination row stride wider than the product,
    /// and both overwrite and accumulate. Tolerance: f32 sums of up to 700
    /// products of values in [-1, 1] carry a rounding error far below 1e-4
    /// relative to the sum of |terms|.
    #[test]
    fn every_backend_matches_naive_on_awkward_shapes() {
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
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Way {
            Backend(Backend),
            Serial,
            InOrder,
            Loops,
        }
        let ways = Backend::ALL
            .iter()
            .filter(|b| b.available())
            .map(|&b| Way::Backend(b))
            .chain([Way::Serial, Way::InOrder, Way::Loops]);
        for way in ways {
            for &(m, k, n) in &shapes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    for accumulate in [false, true] {
                        let tol = match way {
                            #[cfg(feature = "amx")]
                            Way::Backend(Backend::AmxBf16x3) => 1e-4,
                            _ => 1e-5,
                        };
                        check_against_naive(
                            &format!("{way:?}"),
                            |a, b, c, acc| match way {
                                Way::Backend(backend) => backend.matmul(a, b, c, acc),
                                Way::Serial => matmul_serial(a, b, c, acc),
                                Way::InOrder => matmul_in_order(a, b, c, acc),
                                Way::Loops => naive(a, b, c, acc),
                            },
                            (m, k, n),
                            (ta, tb),
                            accumulate,
                            tol,
                        );
                    }
                }
            }
        }
    }

    /// The ordered product is, per slice of the inner dimension, the chain
    /// of fused multiply-adds, the slices added in order, bit for bit, through every kernel that computes it
    /// (the portable one; our AVX-512 kernel where the CPU has it): on
    /// fp32 operands (where a fused and an unfused multiply-add differ),
    /// on fp16-valued ones, over shapes with partial tiles on both sides,
    /// transposed operands, and both overwrite and accumulate. A block of
    /// rows gives the rows of the whole product.
    #[test]
    fn the_ordered_product_is_the_fma_chain_in_every_kernel() {
        let shapes = [
            (1, 1, 1),
            (7, 3, 17),
            (13, 300, 31),
            (40, 70, 36),
            (3, 9, 100),
        ];
        let value = |i: usize, salt: f32| ((i as f32 * 0.618 + salt).sin() * 1.3).clamp(-1.0, 1.0);
        for fp16_values in [false, true] {
            let round = |x: f32| {
                if fp16_values {
                    // The nearest value with an 11-bit significand.
                    let bits = x.to_bits();
                    f32::from_bits((bits + 0x0fff + ((bits >> 13) & 1)) & !0x1fff)
                } else {
                    x
                }
            };
            for &(m, k, n) in &shapes {
                for (ta, tb) in [(false, false), (true, true)] {
                    for accumulate in [false, true] {
                        let a_data: Vec<f32> = (0..m * k).map(|i| round(value(i, 0.1))).collect();
                        let b_data: Vec<f32> = (0..k * n).map(|i| round(value(i, 0.7))).collect();
                        let init: Vec<f32> = (0..m * n).map(|i| value(i, 2.0)).collect();
                        let a = if ta {
                            MatRef::row_major(&a_data, 0, k, m).t()
                        } else {
                            MatRef::row_major(&a_data, 0, m, k)
                        };
                        let b = if tb {
                            MatRef::row_major(&b_data, 0, n, k).t()
                        } else {
                            MatRef::row_major(&b_data, 0, k, n)
                        };
                        let want: Vec<u32> = (0..m * n)
                            .map(|e| {
                                let (i, j) = (e / n, e % n);
                                let slices = (0..k).step_by(in_order::SLICE).map(|p0| {
                                    (p0..k.min(p0 + in_order::SLICE))
                                        .fold(0f32, |s, p| a.at(i, p).mul_add(b.at(p, j), s))
                                });
                                let mut c = None;
                                for s in slices {
                                    c = Some(match c {
                                        None if !accumulate => s,
                                        None => init[e] + s,
                                        Some(c) => c + s,
                                    });
                                }
                                c.unwrap().to_bits()
                            })
                            .collect();
                        let label =
                            format!("{m}x{k}x{n} ta={ta} acc={accumulate} fp16={fp16_values}");
                        let mut out = init.clone();
                        // SAFETY: the views lie in their slices; `out` is m × n.
                        unsafe { in_order::serial(a, b, out.as_mut_ptr(), n, accumulate) };
                        for (e, (o, w)) in out.iter().zip(&want).enumerate() {
                            assert_eq!(o.to_bits(), *w, "portable {label} at {e}");
                        }
                        #[cfg(all(feature = "backends", target_arch = "x86_64"))]
                        if avx512::available() {
                            let mut out = init.clone();
                            // SAFETY: as above; the CPU has AVX-512.
                            unsafe { avx512::serial(a, b, out.as_mut_ptr(), n, accumulate) };
                            assert!(
                                out.iter().map(|v| v.to_bits()).eq(want.iter().copied()),
                                "avx512 {label}"
                            );
                        }
                        let mut out = init.clone();
                        matmul_in_order(a, b, MatMut::row_major(&mut out, 0, m, n), accumulate);
                        assert!(
                            out.iter().map(|v| v.to_bits()).eq(want.iter().copied()),
                            "matmul_in_order {label}"
                        );
                        // The last rows alone, as a tiled program computes them.
                        let lo = m / 2;
                        let mut part = init[lo * n..].to_vec();
                        matmul_in_order(
                            a.rows_range(lo, m),
                            b,
                            MatMut::row_major(&mut part, 0, m - lo, n),
                            accumulate,
                        );
                        assert!(
                            part.iter()
                                .map(|v| v.to_bits())
                                .eq(want[lo * n..].iter().copied()),
                            "rows {lo}.. {label}"
                        );
                    }
                }
            }
        }
    }

    fn check_against_naive(
        name: &str,
        product: impl Fn(MatRef<'_>, MatRef<'_>, MatMut<'_>, bool),
        (m, k, n): (usize, usize, usize),
        (ta, tb): (bool, bool),
        accumulate: bool,
        tol: f64,
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
        product(
            a,
            b,
            MatMut::strided(&mut out, dst_off, m, n, ld),
            accumulate,
        );
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut scale) = (0.0f64, 1.0f64);
                for p in 0..k {
                    let t = a.at(i, p) as f64 * b.at(p, j) as f64;
                    want += t;
                    scale += t.abs();
                }
                let idx = dst_off + i * ld + j;
                if accumulate {
                    want += init[idx] as f64;
                }
                let got = out[idx] as f64;
                assert!(
                    (got - want).abs() <= tol * scale,
                    "{name} {m}x{k}x{n} ta={ta} tb={tb} acc={accumulate}: [{i},{j}] {got} vs {want}"
                );
            }
            // Padding between rows is untouched.
            for j in n..ld {
                let idx = dst_off + i * ld + j;
                if idx < out.len() {
                    assert_eq!(out[idx], init[idx], "{name} wrote outside the product");
                }
            }
        }
        assert_eq!(out[..dst_off], init[..dst_off]);
    }
}
