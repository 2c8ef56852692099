//! Dense f32 matrix multiply: the one place the crate calls into a matmul
//! library — the system OpenBLAS's `cblas_sgemm` when the build found it
//! (`build.rs`; 1.2–2× faster than the alternative at training shapes, see
//! docs/benchmarks.md), else the pure-Rust `gemm` crate. Matrices are
//! described by a pointer-free view (slice, offset, row and column strides)
//! so transposed operands cost nothing.

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

/// The matrix-multiply library this build uses.
pub fn library() -> &'static str {
    if cfg!(openblas) {
        "OpenBLAS (system library)"
    } else {
        "gemm crate (pure Rust)"
    }
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
    #[cfg(openblas)]
    if blas::sgemm(&a, &b, dst, dst_offset, dst_rs, accumulate) {
        return;
    }
    let flops = 2 * m * n * k;
    let par = if flops >= 1 << 24 {
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

#[cfg(openblas)]
mod blas {
    use super::MatRef;

    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;

    extern "C" {
        fn cblas_sgemm(
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

    /// A view as a BLAS operand: (transpose flag, leading dimension), if
    /// one of its strides is 1.
    fn operand(v: &MatRef<'_>) -> Option<(i32, usize)> {
        if v.col_stride == 1 && v.row_stride >= v.cols.max(1) {
            Some((NO_TRANS, v.row_stride))
        } else if v.row_stride == 1 && v.col_stride >= v.rows.max(1) {
            Some((TRANS, v.col_stride))
        } else {
            None
        }
    }

    /// `cblas_sgemm` when both views are BLAS-shaped and every size fits an
    /// `i32`; returns false (nothing done) otherwise. The caller has checked
    /// every view lies inside its slice.
    pub fn sgemm(
        a: &MatRef<'_>,
        b: &MatRef<'_>,
        dst: &mut [f32],
        dst_offset: usize,
        dst_rs: usize,
        accumulate: bool,
    ) -> bool {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let (Some((ta, lda)), Some((tb, ldb))) = (operand(a), operand(b)) else {
            return false;
        };
        let fits = |v: usize| i32::try_from(v).is_ok();
        if ![m, n, k, lda, ldb, dst_rs].into_iter().all(fits) || dst_rs < n {
            return false;
        }
        // SAFETY: the views and the destination were bounds-checked by the
        // caller for exactly these sizes and strides; `dst` is a unique
        // borrow, so it cannot alias `a` or `b`.
        unsafe {
            cblas_sgemm(
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
                dst.as_mut_ptr().add(dst_offset),
                dst_rs as i32,
            )
        }
        true
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
}
