//! Kernel layouts: where every activation and weight lives in a kernel's
//! packed `[1, C, 1, SP]` input, and every result in its `[1, C_out, 1, S]`
//! output. Packing, unpacking, the MIL generators (slice offsets), the docs
//! (`layout.json`) and the tests all read these; offsets are computed here
//! and nowhere else.

use std::ops::Range;

use serde::Serialize;

use super::io::Port;

/// How a logical tensor is laid into a region of the packed input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Encoding {
    /// An activation `[C, S]` (or a vector `[C]` in one column): `region[c][s] = a[c][s]`.
    Activation,
    /// A weight `W [out, in]` with `in` along channels: `region[c][j] = W[j][c]`.
    Transposed,
    /// A weight `W [rows, cols]` with rows along channels: `region[c][j] = W[c][j]`.
    AsIs,
}

/// A named rectangle of the packed input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Region {
    #[serde(rename = "name")]
    pub port: Port,
    pub channels: Range<usize>,
    pub spatial: Range<usize>,
    pub encoding: Encoding,
    /// `[rows, cols]` of the tensor the region holds, when smaller than the
    /// region: the rest of the region is zeros (a LoRA rank padded to a
    /// multiple of 32, so every matmul contraction is one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds: Option<[usize; 2]>,
}

impl Region {
    /// Shape of the logical tensor this region holds (`[rows, cols]`).
    pub fn tensor_shape(&self) -> [usize; 2] {
        self.holds.unwrap_or_else(|| self.padded_shape())
    }

    /// Shape of the tensor the whole region encodes, padding included.
    pub fn padded_shape(&self) -> [usize; 2] {
        let (c, s) = (self.channels.len(), self.spatial.len());
        match self.encoding {
            Encoding::Transposed => [s, c],
            Encoding::Activation | Encoding::AsIs => [c, s],
        }
    }

    /// `[0, c0, 0, s0]` and `[1, C, 1, S]` for `slice_by_size`.
    pub fn begin_size(&self) -> ([i64; 4], [i64; 4]) {
        (
            [0, self.channels.start as i64, 0, self.spatial.start as i64],
            [1, self.channels.len() as i64, 1, self.spatial.len() as i64],
        )
    }
}

/// A named channel block of the output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Block {
    #[serde(rename = "name")]
    pub port: Port,
    pub channels: Range<usize>,
}

/// The packed input and output of one kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelLayout {
    pub kernel: String,
    /// Regions start at multiples of this many columns (0: anywhere, the
    /// seed's layouts), so the program can cut them out of the input
    /// viewed as `[1, C, W/view, view]` without a width-offset slice.
    pub view: usize,
    pub in_channels: usize,
    pub in_spatial: usize,
    pub out_channels: usize,
    pub out_spatial: usize,
    pub inputs: Vec<Region>,
    pub outputs: Vec<Block>,
}

impl KernelLayout {
    pub fn input_elems(&self) -> usize {
        self.in_channels * self.in_spatial
    }

    pub fn output_elems(&self) -> usize {
        self.out_channels * self.out_spatial
    }

    /// Output channels below the last block that only pad the surface.
    pub fn out_padding(&self) -> usize {
        let used = self
            .outputs
            .iter()
            .map(|b| b.channels.end)
            .max()
            .unwrap_or(0);
        self.out_channels - used
    }

    /// The input region of `port`; a kernel asking its own layout for a
    /// region it did not declare is a bug in that kernel's module.
    pub fn region(&self, port: Port) -> &Region {
        self.inputs
            .iter()
            .find(|r| r.port == port)
            .unwrap_or_else(|| {
                panic!(
                    "kernel {} has no input region '{}'",
                    self.kernel,
                    port.name()
                )
            })
    }

    /// The output block of `port` (see [`KernelLayout::region`]).
    pub fn block(&self, port: Port) -> &Block {
        self.outputs
            .iter()
            .find(|b| b.port == port)
            .unwrap_or_else(|| {
                panic!(
                    "kernel {} has no output block '{}'",
                    self.kernel,
                    port.name()
                )
            })
    }

    /// Tensor `data` (row-major, the region's `tensor_shape`) as the
    /// region's rows: `[channels, width]`, row c holding what goes to input
    /// channel `channels.start + c`.
    pub fn region_values(&self, port: Port, data: &[f32]) -> Vec<f32> {
        let r = self.region(port);
        let [rows, cols] = r.tensor_shape();
        assert_eq!(
            data.len(),
            rows * cols,
            "{}: '{}' has the wrong length",
            self.kernel,
            port.name()
        );
        let [prows, pcols] = r.padded_shape();
        let padded;
        let data = if [prows, pcols] == [rows, cols] {
            data
        } else {
            let mut v = vec![0f32; prows * pcols];
            for (dst, src) in v.chunks_mut(pcols).zip(data.chunks(cols)) {
                dst[..cols].copy_from_slice(src);
            }
            padded = v;
            &padded[..]
        };
        let cols = pcols;
        match r.encoding {
            Encoding::Activation | Encoding::AsIs => data.to_vec(),
            Encoding::Transposed => {
                let (channels, width) = (r.channels.len(), r.spatial.len());
                let mut v = vec![0f32; channels * width];
                for c in 0..channels {
                    for j in 0..width {
                        v[c * width + j] = data[j * cols + c];
                    }
                }
                v
            }
        }
    }

    /// Writes tensor `data` (row-major, the region's `tensor_shape`) into the
    /// packed input `buf` (`[in_channels, in_spatial]`).
    pub fn pack(&self, port: Port, data: &[f32], buf: &mut [f32]) {
        assert_eq!(buf.len(), self.input_elems());
        let values = self.region_values(port, data);
        let r = self.region(port);
        let width = r.spatial.len();
        for (ci, c) in r.channels.clone().enumerate() {
            buf[c * self.in_spatial + r.spatial.start..][..width]
                .copy_from_slice(&values[ci * width..][..width]);
        }
    }

    /// Reads output block `port` (`[channels, out_spatial]`) from `buf`.
    pub fn unpack<'a>(&self, port: Port, buf: &'a [f32]) -> &'a [f32] {
        let b = self.block(port);
        &buf[b.channels.start * self.out_spatial..b.channels.end * self.out_spatial]
    }
}

/// Lays out a kernel's input either along the spatial axis (fixed channel
/// count, regions appended left to right) or along channels (fixed spatial
/// width, regions stacked top to bottom), and its output along channels.
pub struct LayoutBuilder {
    kernel: String,
    view: usize,
    channels: usize,
    spatial: usize,
    seq: usize,
    inputs: Vec<Region>,
    outputs: Vec<Block>,
    out_channels: usize,
}

impl LayoutBuilder {
    pub fn new(kernel: &str, seq: usize) -> LayoutBuilder {
        LayoutBuilder {
            kernel: kernel.into(),
            view: 0,
            channels: 0,
            spatial: 0,
            seq,
            inputs: vec![],
            outputs: vec![],
            out_channels: 0,
        }
    }

    /// Starts every region at a multiple of `view` columns, and keeps the
    /// width a multiple of it (see [`KernelLayout::view`]).
    pub fn aligned(&mut self, view: usize) -> &mut Self {
        self.view = view;
        self
    }

    /// Spatial stacking: a region `width` columns wide over `channels`
    /// channels (starting at channel 0) to the right of the previous ones.
    pub fn columns(
        &mut self,
        port: Port,
        channels: usize,
        width: usize,
        encoding: Encoding,
    ) -> &mut Self {
        self.columns_holding(port, channels, width, encoding, None)
    }

    /// [`LayoutBuilder::columns`] for a region holding a smaller tensor
    /// (`[rows, cols]`, zeros elsewhere).
    pub fn columns_holding(
        &mut self,
        port: Port,
        channels: usize,
        width: usize,
        encoding: Encoding,
        holds: Option<[usize; 2]>,
    ) -> &mut Self {
        self.pad_spatial_to(1);
        self.channels = self.channels.max(channels);
        self.inputs.push(Region {
            port,
            channels: 0..channels,
            spatial: self.spatial..self.spatial + width,
            encoding,
            holds,
        });
        self.spatial += width;
        self
    }

    /// Spatial stacking of a `[rows, cols]` tensor wrapped row-major into
    /// whole rows of a region as tall as the input already is (or the
    /// largest power of two under that, dividing the tensor and leaving a
    /// width a multiple of 16): a block's mask `[queries, S]` beside a
    /// whole sequence takes `queries·S/D` columns, not `S`. The program
    /// reshapes it back.
    pub fn columns_wrapped(&mut self, port: Port, rows: usize, cols: usize) -> &mut Self {
        let n = rows * cols;
        let mut c = 1;
        while 2 * c <= self.channels.max(1)
            && n.is_multiple_of(2 * c)
            && (n / (2 * c)).is_multiple_of(16)
        {
            c *= 2;
        }
        self.columns(port, c, n / c, Encoding::Activation)
    }

    /// Pads the spatial width with unused columns up to a multiple of `m`
    /// (and of the view, when aligned).
    pub fn pad_spatial_to(&mut self, m: usize) -> &mut Self {
        let m = m.max(self.view).max(1);
        self.spatial = self.spatial.div_ceil(m) * m;
        self
    }

    /// Pads the input with unused columns (keeping the width a multiple of
    /// 16) and the output with unused channels until each holds at least
    /// `min` elements: the device rejects smaller surfaces. When the columns
    /// needed would make the input wider than `max_dim`, it gains unused
    /// channels instead. Call last.
    pub fn pad_to_min_elems(&mut self, min: usize, max_dim: usize) -> &mut Self {
        if min == 0 {
            return self;
        }
        if self.channels * self.spatial < min {
            let m = self.view.max(16);
            let width = min.div_ceil(self.channels).div_ceil(m) * m;
            if width <= max_dim {
                self.spatial = self.spatial.max(width);
            } else {
                self.channels = self.channels.max(min.div_ceil(self.spatial));
            }
        }
        self.out_channels = self.out_channels.max(min.div_ceil(self.seq));
        self
    }

    /// Drops the output's padding channels: a program with several outputs
    /// has its surfaces sized by the device instead.
    pub fn unpadded_output(&mut self) -> &mut Self {
        self.out_channels = self
            .outputs
            .iter()
            .map(|b| b.channels.end)
            .max()
            .unwrap_or(0);
        self
    }

    /// Channel stacking: an activation `[channels, seq]` below the previous ones.
    pub fn rows(&mut self, port: Port, channels: usize) -> &mut Self {
        self.spatial = self.seq;
        self.inputs.push(Region {
            port,
            channels: self.channels..self.channels + channels,
            spatial: 0..self.seq,
            encoding: Encoding::Activation,
            holds: None,
        });
        self.channels += channels;
        self
    }

    /// An output block of `channels` channels below the previous ones.
    pub fn output(&mut self, port: Port, channels: usize) -> &mut Self {
        self.outputs.push(Block {
            port,
            channels: self.out_channels..self.out_channels + channels,
        });
        self.out_channels += channels;
        self
    }

    pub fn build(&self) -> KernelLayout {
        let m = self.view.max(1);
        KernelLayout {
            kernel: self.kernel.clone(),
            view: self.view,
            in_channels: self.channels,
            in_spatial: self.spatial.div_ceil(m) * m,
            out_channels: self.out_channels,
            out_spatial: self.seq,
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Projection;

    #[test]
    fn pack_places_each_encoding() {
        let mut b = LayoutBuilder::new("t", 2);
        b.columns(Port::Xnorm, 3, 2, Encoding::Activation)
            .columns(Port::Weight(Projection::Q), 3, 2, Encoding::Transposed)
            .columns(Port::QNorm, 3, 1, Encoding::AsIs)
            .output(Port::Attn, 2);
        let l = b.build();
        assert_eq!((l.in_channels, l.in_spatial), (3, 5));
        let mut buf = vec![0.0; 15];
        l.pack(Port::Xnorm, &[1., 2., 3., 4., 5., 6.], &mut buf); // [3, 2]
        let wt = Port::Weight(Projection::Q);
        l.pack(wt, &[10., 11., 12., 20., 21., 22.], &mut buf); // W [2 out, 3 in]
        l.pack(Port::QNorm, &[7., 8., 9.], &mut buf); // [3, 1]
        assert_eq!(
            buf,
            vec![1., 2., 10., 20., 7., 3., 4., 11., 21., 8., 5., 6., 12., 22., 9.]
        );
        let out = [1., 2., 3., 4.];
        assert_eq!(l.unpack(Port::Attn, &out), &out);
    }

    #[test]
    fn padding_reaches_the_minimum_on_both_sides() {
        let mut b = LayoutBuilder::new("t", 16);
        b.columns(Port::Xnorm, 8, 16, Encoding::Activation)
            .output(Port::Attn, 8)
            .pad_to_min_elems(1000, 16384);
        let l = b.build();
        // 1000 / 8 channels = 125 columns, rounded up to a multiple of 16
        assert_eq!((l.in_channels, l.in_spatial), (8, 128));
        // 1000 / 16 positions = 63 channels, 55 of them padding
        assert_eq!((l.out_channels, l.out_padding()), (63, 55));
        assert_eq!(l.region(Port::Xnorm).spatial, 0..16);
        let big = LayoutBuilder::new("t", 16)
            .columns(Port::Xnorm, 8, 16, Encoding::Activation)
            .output(Port::Attn, 8)
            .pad_to_min_elems(64, 16384)
            .build();
        assert_eq!((big.in_spatial, big.out_padding()), (16, 0));
        // Under a width limit of 64 the input grows in channels instead:
        // 1000 / 16 columns = 63 channels.
        let narrow = LayoutBuilder::new("t", 16)
            .columns(Port::Xnorm, 8, 16, Encoding::Activation)
            .output(Port::Attn, 8)
            .pad_to_min_elems(1000, 64)
            .build();
        assert_eq!((narrow.in_channels, narrow.in_spatial), (63, 16));
    }
}
