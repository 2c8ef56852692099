//! Strided matrix views: element (r, c) is
//! `data[offset + r * row_stride + c * col_stride]`. A transpose or a block
//! of rows or columns is a new view of the same slice, never a copy.

/// A read-only strided matrix view.
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

    /// Element (r, c).
    pub fn at(&self, r: usize, c: usize) -> f32 {
        self.data[self.offset + r * self.row_stride + c * self.col_stride]
    }

    /// Index one past the last element the view can touch.
    pub(crate) fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.offset;
        }
        self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
    }
}

/// A writable matrix view with unit column stride (every backend writes
/// rows of C contiguously): element (r, c) is
/// `data[offset + r * row_stride + c]`.
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

impl<'a> MatMut<'a> {
    /// Row-major `rows × cols` matrix starting at `offset`.
    pub fn row_major(data: &'a mut [f32], offset: usize, rows: usize, cols: usize) -> Self {
        MatMut::strided(data, offset, rows, cols, cols)
    }

    /// `rows × cols` starting at `offset`, rows `row_stride` apart (a block
    /// of a wider matrix).
    pub fn strided(
        data: &'a mut [f32],
        offset: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Self {
        MatMut {
            data,
            offset,
            rows,
            cols,
            row_stride,
        }
    }

    /// Element (r, c), writable.
    pub fn at_mut(&mut self, r: usize, c: usize) -> &mut f32 {
        &mut self.data[self.offset + r * self.row_stride + c]
    }

    /// Sets every element of the view to `v` (the gaps between rows stay).
    pub fn fill(&mut self, v: f32) {
        for r in 0..self.rows {
            self.data[self.offset + r * self.row_stride..][..self.cols].fill(v);
        }
    }

    /// Index one past the last element the view can touch.
    pub(crate) fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.offset;
        }
        self.offset + (self.rows - 1) * self.row_stride + self.cols
    }

    /// Pointer to element (0, 0); the caller keeps to the view's extent.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut f32 {
        self.data[self.offset..].as_mut_ptr()
    }
}
