//! Who runs the kernels: [`KernelRunner`], with the CPU twins
//! ([`CpuKernels`]) or the MIL programs on a Neural Engine device
//! ([`NeuralKernels`]), and the choice between them ([`backend`]).

pub mod backend;
mod buffers;
mod cpu;
mod neural;
mod surface;

pub use buffers::DeviceBuffers;
pub use cpu::{CpuKernels, HEAD_CHUNK_ROWS};
pub use neural::NeuralKernels;

use anyhow::Result;

use crate::kernels::tiling::HeadChunks;
use crate::kernels::{
    sdpa_backward1, sdpa_backward2, Kernel, LayerWeights, SdpaBackward1, SdpaBackward2, Shape,
};
use crate::model::{Model, Projection};

/// LoRA dropout masks of one layer, by [`Projection::index`] (scaled by
/// 1/(1−p); `None` where there is no dropout).
pub type Dropout = [Option<Vec<f32>>; 7];

/// Runs one kernel for one layer, or a head kernel for one vocabulary
/// chunk. Activations come in `acts`; the runner supplies the weights
/// itself.
pub trait KernelRunner {
    /// Runs `K` for `layer` (for the head kernels, the vocabulary chunk
    /// of that index: see [`KernelRunner::head_chunks`]).
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out>;

    /// How the LM head's vocabulary is cut for sequences of `seq` tokens:
    /// the head kernels run chunk by chunk, the host keeping softmax
    /// statistics between them.
    fn head_chunks(&mut self, model: &Model, seq: usize) -> Result<HeadChunks>;

    /// Whether kernels compute in fp16 (a Neural Engine, real or simulated).
    fn computes_in_fp16(&self) -> bool {
        false
    }

    /// Whether kernels run off the host CPU, so the engine computes weight
    /// gradients on a worker thread while they run.
    fn overlaps_host(&self) -> bool {
        false
    }

    /// The engine is (`true`) or is no longer recomputing a layer's forward
    /// inside the backward (activation checkpointing): forward kernels now
    /// walk the layers downwards.
    fn recomputing(&mut self, _on: bool) {}

    /// The attention backward of `layer`: `sdpa_backward1` (dV and the
    /// probabilities P and their gradient dP `[heads·S, S]`), then
    /// `sdpa_backward2` (dQ, dK) on them. A runner whose two kernels share
    /// their tiles runs them tile by tile, so P and dP never exist whole.
    fn attention_backward(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &sdpa_backward1::Acts<'_>,
    ) -> Result<AttentionGrads>
    where
        Self: Sized,
    {
        attention_backward_in_full(self, model, layer, shape, dropout, acts)
    }
}

/// The attention backward's results (see [`KernelRunner::attention_backward`]).
pub struct AttentionGrads {
    /// `[KV·HD, S]`, `[heads·HD, S]`, `[KV·HD, S]`, on roped q and k.
    pub dv: Vec<f32>,
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
}

/// `sdpa_backward1` over the whole layer, then `sdpa_backward2` on its
/// whole P and dP.
pub fn attention_backward_in_full<R: KernelRunner>(
    runner: &mut R,
    model: &Model,
    layer: usize,
    shape: &Shape,
    dropout: &Dropout,
    acts: &sdpa_backward1::Acts<'_>,
) -> Result<AttentionGrads> {
    let b1 = runner.run::<SdpaBackward1>(model, layer, shape, dropout, acts)?;
    let acts2 = sdpa_backward2::Acts {
        probs: &b1.probs,
        dp: &b1.dp,
        q_rope: acts.q_rope,
        k_rope: acts.k_rope,
    };
    let b2 = runner.run::<SdpaBackward2>(model, layer, shape, dropout, &acts2)?;
    Ok(AttentionGrads {
        dv: b1.dv,
        dq: b2.dq,
        dk: b2.dk,
    })
}

/// f32 copies of the projections a kernel multiplies by, for a model whose
/// frozen matrices stay in the file's dtype ([`crate::model::Param::stored`]).
/// [`WeightScratch::prepare`] converts what the next kernel needs and drops
/// the rest, so the scratch never holds more than the largest kernel's
/// projections (the FFN's three) and each projection is converted once per
/// visit of its layer (every kernel of a layer uses different ones).
#[derive(Default)]
pub struct WeightScratch {
    /// `(layer, W)` by [`Projection::index`].
    held: [Option<(usize, Vec<f32>)>; 7],
}

impl WeightScratch {
    /// Holds layer `layer`'s `needed` projections in f32 (those the model
    /// keeps in f32 are read in place).
    pub fn prepare(&mut self, model: &Model, layer: usize, needed: &[Projection]) {
        for t in Projection::ALL {
            let p = &model.params[t.base(&model.layers[layer])];
            let slot = &mut self.held[t.index()];
            if !needed.contains(&t) || p.stored.is_none() {
                *slot = None;
            } else if !matches!(slot, Some((l, _)) if *l == layer) {
                let mut v = slot.take().map(|(_, v)| v).unwrap_or_default();
                p.rows_into(0..p.shape[0], &mut v);
                *slot = Some((layer, v));
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.held.iter().flatten().map(|(_, v)| v.len() * 4).sum()
    }
}

/// The projections kernel `K` multiplies by.
fn projections_of<K: Kernel>() -> Vec<Projection> {
    K::PROJECTIONS.iter().map(|(p, _)| *p).collect()
}

/// Layer `layer`'s weights (and adapters) as the kernels read them; the
/// frozen matrices a model keeps in the file's dtype come from `scratch`
/// (empty unless [`WeightScratch::prepare`] converted them).
pub fn layer_weights<'a>(
    model: &'a Model,
    layer: usize,
    scratch: &'a WeightScratch,
) -> LayerWeights<'a> {
    let l = &model.layers[layer];
    let p = |i: usize| model.params[i].data.as_slice();
    let projection = |t: Projection| {
        let param = &model.params[t.base(l)];
        match (&param.stored, &scratch.held[t.index()]) {
            (None, _) => param.data.as_slice(),
            (Some(_), Some((held, v))) if *held == layer => v.as_slice(),
            (Some(_), _) => &[],
        }
    };
    let mut w = LayerWeights {
        projections: Projection::ALL.map(projection),
        q_norm: l.q_norm.map(p),
        k_norm: l.k_norm.map(p),
        biases: l.biases.map(|b| b.map(p)),
        ..LayerWeights::default()
    };
    if let Some(lora) = &model.lora {
        for t in Projection::ALL {
            w.adapters[t.index()] = lora.adapter(layer, t);
        }
    }
    w
}
