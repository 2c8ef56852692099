//! The pure-Rust `gemm` crate: the backend every build with the `backends`
//! feature has, and the one any other hands a product to when it cannot
//! take the views.

use crate::{threads, MatMut, MatRef};

/// `c (+)= a·b`, on the rayon pool when `threaded` and the product is
/// large enough to gain from it.
pub fn multiply(threaded: bool, a: MatRef<'_>, b: MatRef<'_>, mut c: MatMut<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let par = if threaded && 2 * m * n * k >= 1 << 24 {
        gemm::Parallelism::Rayon(threads())
    } else {
        gemm::Parallelism::None
    };
    let ldc = c.row_stride;
    // SAFETY: `linalg::multiply` checked that every (row, col) index the
    // three views describe lies inside its slice; `c` is borrowed mutably
    // and so cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
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
