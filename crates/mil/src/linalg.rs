//! Dense f32 matrix multiply: the one place the crate calls into `gemm`.
//! Matrices are described by a pointer-free view (slice, offset, row and
//! column strides) so transposed operands cost nothing.

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
