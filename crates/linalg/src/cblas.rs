//! The `cblas_sgemm` interface, shared by every BLAS we call (OpenBLAS
//! linked at build time, MKL loaded at run time, Accelerate on macOS).

use crate::MatRef;

/// The `cblas_sgemm` signature (row-major order, transpose flags, sizes,
/// alpha, A, lda, B, ldb, beta, C, ldc).
pub type CblasSgemm = unsafe extern "C" fn(
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

/// The system OpenBLAS's `cblas_sgemm`, when `build.rs` linked it.
#[cfg(openblas)]
pub const OPENBLAS: Option<CblasSgemm> = Some(openblas_sgemm);
#[cfg(not(openblas))]
pub const OPENBLAS: Option<CblasSgemm> = None;

#[cfg(openblas)]
extern "C" {
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

/// Calls a `cblas_sgemm` for `c (row stride ldc) = (accumulate ? c : 0) +
/// a·b` when both views are BLAS-shaped (one stride 1) and every size fits
/// an `i32`; returns false (nothing done) otherwise.
///
/// # Safety
/// `f` is a `cblas_sgemm`; both views lie inside their slices and `c`
/// points at an `m × n` block with row stride `ldc` that nothing else reads
/// or writes during the call.
pub unsafe fn call(
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
