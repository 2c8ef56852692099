//! The CPU engine's kernel runner: the native f32 twins, the LM head in
//! chunks of vocabulary rows.

use anyhow::Result;

use crate::kernels::tiling::HeadChunks;
use crate::kernels::{Kernel, KernelOptions, LayerWeights, Shape};
use crate::model::Model;

use super::{layer_weights, projections_of, Dropout, KernelRunner, WeightScratch};

/// Vocabulary rows of one LM head chunk on the CPU engine: the loss never
/// holds the `[V, S]` logits in f32, only `[HEAD_CHUNK_ROWS, S]` (16.8 MB
/// at 256 positions), and a head kept in the file's dtype is converted a
/// chunk at a time.
pub const HEAD_CHUNK_ROWS: usize = 16384;

/// The CPU engine's kernels: the native twins.
pub struct CpuKernels {
    pub opts: KernelOptions,
    /// Frozen projections converted from the file's dtype.
    pub scratch: WeightScratch,
    /// A head chunk converted from the file's dtype.
    head: Vec<f32>,
    /// Rows of a head chunk ([`HEAD_CHUNK_ROWS`] unless set for tests).
    pub head_rows: usize,
}

impl CpuKernels {
    pub fn new(opts: KernelOptions) -> CpuKernels {
        CpuKernels {
            opts,
            scratch: WeightScratch::default(),
            head: Vec::new(),
            head_rows: HEAD_CHUNK_ROWS,
        }
    }
}

impl KernelRunner for CpuKernels {
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out> {
        if K::KIND.is_head() {
            let range = self
                .head_chunks(model, shape.seq)?
                .range(layer, model.cfg.vocab_size);
            let w = LayerWeights {
                head: model.lm_head_param().rows(range, &mut self.head),
                ..LayerWeights::default()
            };
            return Ok(K::cpu(shape, &self.opts, &w, acts));
        }
        self.scratch.prepare(model, layer, &projections_of::<K>());
        let mut w = layer_weights(model, layer, &self.scratch);
        for (m, d) in w.dropout.iter_mut().zip(dropout) {
            *m = d.as_deref();
        }
        Ok(K::cpu(
            shape,
            &self.opts.of_layer(&model.cfg, layer),
            &w,
            acts,
        ))
    }

    fn head_chunks(&mut self, model: &Model, _seq: usize) -> Result<HeadChunks> {
        Ok(HeadChunks::of(model.cfg.vocab_size, self.head_rows))
    }
}
