//! A model's parameters as plain data: the tensors, the table of one
//! decoder layer's tensor indices, and the seven weight projections (what
//! kernels multiply by and LoRA adapters attach to).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use crate::model::config::ModelConfig;
use crate::model::dtype::StoredDtype;
pub use crate::model::layer::{LayerIds, Projection};

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Hugging Face tensor name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    /// The values in f32; empty when the tensor is [`Param::stored`].
    pub data: Vec<f32>,
    /// A frozen tensor kept as the file stores it (memory-mapped, in its
    /// own dtype) instead of in `data`: read through [`Param::values`] and
    /// [`Param::rows_into`], converted block by block as products need it.
    pub stored: Option<Stored>,
    /// Weight decay applies (matrices and embeddings, never norm weights).
    pub decay: bool,
}

/// A tensor's bytes inside a memory-mapped safetensors file. The mapping is
/// shared by every tensor of the file and lives as long as any of them;
/// pages are read from the file as they are touched and, being clean, the
/// kernel can drop them under memory pressure instead of swapping.
///
/// A quantized matrix (`affine`) keeps its packed words here (`start` is
/// their offset, `len` the count of values they hold, `dtype` that of its
/// scales) and its scales and biases beside them: it is dequantized as it
/// is read, so the base stays at its quantized size.
#[derive(Clone)]
pub struct Stored {
    pub map: Arc<memmap2::Mmap>,
    /// Byte offset of the first element in the mapping.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
    pub dtype: StoredDtype,
    /// MLX's affine quantization of a matrix, when it is stored so.
    pub affine: Option<Arc<Affine>>,
}

/// A little-endian bit stream over a row's bytes, as mlx packs values.
struct BitStream<'a> {
    bytes: &'a [u8],
    /// The next byte to take in.
    at: usize,
    acc: u64,
    /// Bits in `acc` not yet read.
    have: usize,
}

impl<'a> BitStream<'a> {
    /// The stream from bit `bit` on.
    fn at(bytes: &'a [u8], bit: usize) -> BitStream<'a> {
        let mut s = BitStream {
            bytes,
            at: bit / 8,
            acc: 0,
            have: 0,
        };
        if !bit.is_multiple_of(8) {
            s.acc = (bytes[s.at] as u64) >> (bit % 8);
            s.at += 1;
            s.have = 8 - bit % 8;
        }
        s
    }

    fn next(&mut self, bits: usize, mask: u64) -> u32 {
        while self.have < bits {
            self.acc |= (self.bytes[self.at] as u64) << self.have;
            self.at += 1;
            self.have += 8;
        }
        let q = (self.acc & mask) as u32;
        self.acc >>= bits;
        self.have -= bits;
        q
    }
}

/// Wall time spent dequantizing quantized matrices, in nanoseconds, since
/// the process started (`bench` reports its share of a step).
pub static DEQUANTIZING_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`DEQUANTIZING_NS`] in seconds.
pub fn dequantizing_s() -> f64 {
    DEQUANTIZING_NS.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9
}

/// How a quantized matrix's words decode (`crate::model::quant`).
#[derive(Clone, Debug)]
pub struct Affine {
    pub spec: crate::model::quant::QuantSpec,
    /// Values per row.
    pub cols: usize,
    /// `[rows, cols/group_size]` each.
    pub scales: Stored,
    pub biases: Stored,
}

impl std::fmt::Debug for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Stored({} × {} at {})",
            self.len,
            self.dtype.name(),
            self.start
        )
    }
}

impl PartialEq for Stored {
    fn eq(&self, o: &Stored) -> bool {
        Arc::ptr_eq(&self.map, &o.map) && self.start == o.start && self.len == o.len
    }
}

impl Stored {
    /// The raw bytes of elements `range`.
    fn bytes(&self, range: Range<usize>) -> &[u8] {
        let b = self.dtype.bytes();
        &self.map[self.start + range.start * b..self.start + range.end * b]
    }

    /// A tensor held in memory of its own (an anonymous mapping) rather
    /// than a file's: `bytes` hold `len` values of `dtype`, or a quantized
    /// matrix's words when `affine` says so.
    pub fn owned(
        bytes: &[u8],
        len: usize,
        dtype: StoredDtype,
        affine: Option<Affine>,
    ) -> std::io::Result<Stored> {
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1))?;
        map[..bytes.len()].copy_from_slice(bytes);
        Ok(Stored {
            map: Arc::new(map.make_read_only()?),
            start: 0,
            len,
            dtype,
            affine: affine.map(Arc::new),
        })
    }

    /// Rows `rows` of this matrix of `cols` values a row, as a tensor of
    /// its own over the same mapping (a fused projection's part): a
    /// quantized matrix's words, scales and biases sliced alike.
    pub fn rows(&self, rows: Range<usize>, cols: usize) -> Stored {
        let n = rows.len() * cols;
        match &self.affine {
            None => Stored {
                start: self.start + rows.start * cols * self.dtype.bytes(),
                len: n,
                affine: None,
                ..self.clone()
            },
            Some(a) => {
                let groups = a.cols / a.spec.group_size;
                Stored {
                    start: self.start + rows.start * a.spec.words(a.cols) * 4,
                    len: n,
                    affine: Some(Arc::new(Affine {
                        scales: a.scales.rows(rows.clone(), groups),
                        biases: a.biases.rows(rows, groups),
                        ..(**a).clone()
                    })),
                    ..self.clone()
                }
            }
        }
    }

    /// Gives this tensor's pages back to the kernel: a file's are clean
    /// and read again from the file if touched.
    pub fn release(&self) {
        let page = 4096;
        let bytes = match &self.affine {
            Some(a) => self.len / a.cols * a.spec.words(a.cols) * 4,
            None => self.len * self.dtype.bytes(),
        };
        let (lo, hi) = (
            self.start.div_ceil(page) * page,
            (self.start + bytes) / page * page,
        );
        if hi > lo {
            // SAFETY: every mapping here is read-only; dropping pages of a
            // file mapping makes later reads fetch the same contents from
            // the file (and an anonymous one is released only when its
            // tensor is replaced). No reference into the range is held.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
            };
        }
    }

    /// Element `i` in f32 (of a float tensor).
    fn get(&self, i: usize) -> f32 {
        let b = self.dtype.bytes();
        let c = &self.map[self.start + i * b..][..b];
        match self.dtype {
            StoredDtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            StoredDtype::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            StoredDtype::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        }
    }

    /// Elements `range` of a quantized matrix, dequantized into `out`: one
    /// task per row; the row's whole groups through the vectorized
    /// [`crate::model::quant::dequantize_groups`], a group cut by the
    /// range's ends (or with a non-finite scale or bias) value by value,
    /// with the same result.
    fn dequantize(&self, a: &Affine, range: Range<usize>, out: &mut [f32]) {
        use crate::model::quant::{dequantize_groups, dequantize_value};
        use rayon::prelude::*;
        let (cols, spec) = (a.cols, a.spec);
        let (row_bytes, groups) = (spec.words(cols) * 4, cols / spec.group_size);
        let (bits, gs) = (spec.bits as usize, spec.group_size);
        let first_row = range.start / cols;
        let last_row = (range.end - 1) / cols;
        // Each task owns the part of `out` in one row.
        let mut parts: Vec<(usize, &mut [f32])> = Vec::new();
        let mut rest = out;
        for r in first_row..=last_row {
            let lo = range.start.max(r * cols);
            let hi = range.end.min((r + 1) * cols);
            let (part, tail) = rest.split_at_mut(hi - lo);
            parts.push((lo, part));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(lo, part)| {
            let (row, c0) = (lo / cols, lo % cols);
            let bytes = &self.map[self.start + row * row_bytes..][..row_bytes];
            let group = |g: usize| {
                (
                    a.scales.get(row * groups + g),
                    a.biases.get(row * groups + g),
                )
            };
            // Values from column `c` on, one at a time.
            let one_by_one = |c: usize, out: &mut [f32]| {
                let mask = (1u64 << bits) - 1;
                let mut stream = BitStream::at(bytes, c * bits);
                for (i, o) in out.iter_mut().enumerate() {
                    let (scale, bias) = group((c + i) / gs);
                    *o = dequantize_value(stream.next(bits, mask), scale, bias, self.dtype);
                }
            };
            // Whole groups `ga..gb`; a group's values start on a byte.
            let (c1, ga) = (c0 + part.len(), c0.div_ceil(gs));
            let gb = (c1 / gs).max(ga);
            if ga == gb {
                return one_by_one(c0, part);
            }
            let (head, rest) = part.split_at_mut(ga * gs - c0);
            let (whole, tail) = rest.split_at_mut((gb - ga) * gs);
            one_by_one(c0, head);
            const CHUNK: usize = 64;
            let mut params = [(0f32, 0f32); CHUNK];
            for (k, out) in whole.chunks_mut(CHUNK * gs).enumerate() {
                let g0 = ga + k * CHUNK;
                let params = &mut params[..out.len() / gs];
                for (i, p) in params.iter_mut().enumerate() {
                    *p = group(g0 + i);
                }
                if params.iter().all(|(s, b)| s.is_finite() && b.is_finite()) {
                    let from = g0 * gs * bits / 8;
                    dequantize_groups(spec, self.dtype, &bytes[from..], params, out);
                } else {
                    one_by_one(g0 * gs, out);
                }
            }
            one_by_one(gb * gs, tail);
        });
    }

    /// Elements `range` converted to f32 into `out` (same length).
    pub fn convert(&self, range: Range<usize>, out: &mut [f32]) {
        use rayon::prelude::*;
        assert_eq!(
            out.len(),
            range.len(),
            "conversion target of the wrong length"
        );
        if let Some(a) = &self.affine {
            if !range.is_empty() {
                let t = std::time::Instant::now();
                self.dequantize(a, range, out);
                DEQUANTIZING_NS.fetch_add(
                    t.elapsed().as_nanos() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            return;
        }
        // Blocks of 64 Ki elements in parallel: a 4B model's largest
        // projection (25 M values) converts at memory speed.
        const BLOCK: usize = 1 << 16;
        let raw = self.bytes(range);
        let b = self.dtype.bytes();
        out.par_chunks_mut(BLOCK)
            .zip(raw.par_chunks(BLOCK * b))
            .for_each(|(o, r)| match self.dtype {
                StoredDtype::F32 => o
                    .iter_mut()
                    .zip(r.chunks_exact(4))
                    .for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                StoredDtype::F16 => o
                    .iter_mut()
                    .zip(r.chunks_exact(2))
                    .for_each(|(o, c)| *o = f16::from_le_bytes([c[0], c[1]]).to_f32()),
                StoredDtype::BF16 => o
                    .iter_mut()
                    .zip(r.chunks_exact(2))
                    .for_each(|(o, c)| *o = bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            });
    }

    /// The index of the first value that is not finite, if any (checked
    /// on the bits: an all-ones exponent).
    pub fn first_non_finite(&self) -> Option<usize> {
        use rayon::prelude::*;
        if let Some(a) = &self.affine {
            // Every q is finite: a value is bad where its group's scale or
            // bias is; the group's first element is named.
            let g = [a.scales.first_non_finite(), a.biases.first_non_finite()]
                .into_iter()
                .flatten()
                .min()?;
            let groups = a.cols / a.spec.group_size;
            return Some(g / groups * a.cols + g % groups * a.spec.group_size);
        }
        let raw = self.bytes(0..self.len);
        let b = self.dtype.bytes();
        let bad = |c: &[u8]| match self.dtype {
            StoredDtype::F32 => !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite(),
            StoredDtype::F16 => u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00,
            StoredDtype::BF16 => u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80,
        };
        raw.par_chunks(b).position_first(bad)
    }

    /// Bytes of the tensor in the file.
    pub fn file_bytes(&self) -> usize {
        if let Some(a) = &self.affine {
            let rows = self.len / a.cols;
            return rows * a.spec.words(a.cols) * 4 + a.scales.file_bytes() + a.biases.file_bytes();
        }
        self.len * self.dtype.bytes()
    }
}

impl Param {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values in f32: borrowed, or converted from the file's dtype.
    pub fn values(&self) -> Cow<'_, [f32]> {
        match &self.stored {
            None => Cow::Borrowed(&self.data),
            Some(s) => {
                let mut v = vec![0f32; s.len];
                s.convert(0..s.len, &mut v);
                Cow::Owned(v)
            }
        }
    }

    /// Rows `rows` of a matrix (`[rows.len(), shape[1]]`) in f32 into `out`
    /// (resized): a copy of `data`, or converted from the file's dtype.
    pub fn rows_into(&self, rows: Range<usize>, out: &mut Vec<f32>) {
        let cols = self.shape[1..].iter().product::<usize>();
        let range = rows.start * cols..rows.end * cols;
        out.resize(range.len(), 0.0);
        match &self.stored {
            None => out.copy_from_slice(&self.data[range]),
            Some(s) => s.convert(range, out),
        }
    }

    /// The block `rows × cols` of a matrix, row-major, in f32 into `out`
    /// (resized), converting only those values.
    pub fn block_into(&self, rows: Range<usize>, cols: Range<usize>, out: &mut Vec<f32>) {
        let width = self.shape[1..].iter().product::<usize>();
        if cols == (0..width) {
            return self.rows_into(rows, out);
        }
        out.resize(rows.len() * cols.len(), 0.0);
        for (r, dst) in rows.zip(out.chunks_mut(cols.len().max(1))) {
            let range = r * width + cols.start..r * width + cols.end;
            match &self.stored {
                None => dst.copy_from_slice(&self.data[range]),
                Some(s) => s.convert(range, dst),
            }
        }
    }

    /// Rows `rows` borrowed when the tensor is in f32, else converted into
    /// `scratch`.
    pub fn rows<'a>(&'a self, rows: Range<usize>, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        if self.stored.is_none() {
            let cols = self.shape[1..].iter().product::<usize>();
            return &self.data[rows.start * cols..rows.end * cols];
        }
        self.rows_into(rows, scratch);
        scratch
    }
}

impl Projection {
    /// `[out, in]` of this projection in a model of configuration `cfg`.
    pub fn shape(self, cfg: &ModelConfig) -> (usize, usize) {
        self.dims(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.q_dim(),
            cfg.kv_dim(),
        )
    }
}

/// A frozen matrix (`[rows, cols]`, values of `dtype`) quantized into a
/// stored tensor of its own memory, read as any quantized base's.
pub fn quantized_stored(
    values: &[f32],
    cols: usize,
    spec: crate::model::quant::QuantSpec,
    dtype: StoredDtype,
) -> std::io::Result<Stored> {
    use crate::model::dtype::encode;
    use crate::model::quant::quantize;
    let q = quantize(values, cols, spec, dtype);
    let words: Vec<u8> = q.packed.iter().flat_map(|w| w.to_le_bytes()).collect();
    let groups = q.scales.len();
    Stored::owned(
        &words,
        values.len(),
        dtype,
        Some(Affine {
            spec,
            cols,
            scales: Stored::owned(&encode(&q.scales, dtype), groups, dtype, None)?,
            biases: Stored::owned(&encode(&q.biases, dtype), groups, dtype, None)?,
        }),
    )
}
