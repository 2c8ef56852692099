//! One decoder layer's forward, composed as its description says: the
//! norms and residuals around its two sublayers (`compose_layer`), over
//! a sequence's kernels here and over one cached token when decoding
//! (`generate`); each sublayer's forward beside what its backward keeps.

use anyhow::{bail, Result};

use super::{add_scaled, Engine, Kept, LayerActs, MixerActs, MlpActs};
use crate::device::{Dropout, KernelRunner};
use crate::kernels::{self, maths, Shape};
use crate::model::layer::{LayerSpec, Mixer, Mlp, Norms, QkNorm};
use crate::model::{LayerIds, Model};

/// A layer's two sublayers as a composition runs them: over a sequence
/// (the kernels, keeping what the backward needs) or over one cached
/// token (the decoder's attention against its cache).
pub(super) trait Sublayers {
    /// What the mixer's and the MLP's backward need (nothing when decoding).
    type Mixer;
    type Mlp;
    /// The token mixer over its (normed) input `xn`: its output before
    /// the residual.
    fn mixer(&mut self, xn: &[f32]) -> Result<(Self::Mixer, Vec<f32>)>;
    /// The MLP over its (normed) input `x2n`; given `residual`, the MLP's
    /// kernel adds it (`x2 + α·mlp(x2n)`), else its output alone.
    fn mlp(&mut self, x2n: &[f32], residual: Option<&[f32]>) -> Result<(Self::Mlp, Vec<f32>)>;
}

/// One layer's forward as [`compose_layer`] leaves it.
pub(super) struct Composed<M, A> {
    x: Vec<f32>,
    xn: Vec<f32>,
    mixer: M,
    mixer_out: Vec<f32>,
    x2: Vec<f32>,
    x2n: Vec<f32>,
    mlp: A,
    mlp_out: Vec<f32>,
    pub(super) x_next: Vec<f32>,
}

/// One layer of `seq` positions from its input `x`, composed as its
/// description `spec` says over `parts`: the sequence's forward and the
/// decoder's cached token run this one function.
///   pre-norm:  x2 = x + α·mixer(rmsnorm(x)),  x' = x2 + α·mlp(rmsnorm(x2))
///   sandwich:  x2 = x + α·rmsnorm(mixer(rmsnorm(x))),  x' = x2 + α·rmsnorm(mlp(rmsnorm(x2)))
///   post-norm: x2 = x + α·rmsnorm(mixer(x)),  x' = x2 + α·rmsnorm(mlp(x2))
pub(super) fn compose_layer<S: Sublayers>(
    spec: &LayerSpec,
    model: &Model,
    l: &LayerIds,
    seq: usize,
    alpha: f32,
    x: Vec<f32>,
    parts: &mut S,
) -> Result<Composed<S::Mixer, S::Mlp>> {
    let d = model.cfg.hidden_size;
    let eps = model.cfg.rms_norm_eps as f32;
    let w = |id: usize| model.params[id].data.as_slice();
    // A sublayer's input normed where the layer norms it (not OLMo 2).
    let pre = |x: &[f32], norm: Option<usize>| match norm {
        Some(v) => maths::rms_norm(x, w(v), d, seq, eps),
        None => x.to_vec(),
    };
    // A sublayer's output as the residual adds it: normed (Gemma, OLMo 2),
    // or as is (kept: nothing).
    let post = |out: Vec<f32>, norm: Option<usize>| match norm {
        Some(v) => (maths::rms_norm(&out, w(v), d, seq, eps), out),
        None => (out, vec![]),
    };
    let xn = pre(&x, l.mixer_norm);
    let (mixer, o) = parts.mixer(&xn)?;
    let (o, mixer_out) = post(o, l.post_norms[0]);
    let mut x2 = x.clone();
    add_scaled(&mut x2, &o, alpha);
    let x2n = pre(&x2, l.mlp_norm);
    let (mlp, x_next, mlp_out) = match spec.norms {
        // The kernel adds the residual.
        Norms::Pre => {
            let (mlp, x_next) = parts.mlp(&x2n, Some(&x2))?;
            (mlp, x_next, vec![])
        }
        Norms::Sandwich | Norms::Post => {
            let (mlp, out) = parts.mlp(&x2n, None)?;
            let (m, mlp_out) = post(out, l.post_norms[1]);
            let mut x_next = x2.clone();
            add_scaled(&mut x_next, &m, alpha);
            (mlp, x_next, mlp_out)
        }
    };
    Ok(Composed {
        x,
        xn,
        mixer,
        mixer_out,
        x2,
        x2n,
        mlp,
        mlp_out,
        x_next,
    })
}

/// A sequence's sublayers: the runner's kernels for layer `i`.
struct SequenceParts<'e, 'm, R: KernelRunner> {
    engine: &'e mut Engine<R>,
    model: &'m Model,
    i: usize,
    shape: &'m Shape,
    masks: &'m Dropout,
}

impl<R: KernelRunner> Sublayers for SequenceParts<'_, '_, R> {
    type Mixer = MixerActs;
    type Mlp = MlpActs;

    fn mixer(&mut self, xn: &[f32]) -> Result<(MixerActs, Vec<f32>)> {
        let spec = self.engine.opts.layer;
        let (model, i, shape, masks) = (self.model, self.i, self.shape, self.masks);
        self.engine.mixer_forward(&spec, model, i, shape, masks, xn)
    }

    fn mlp(&mut self, x2n: &[f32], residual: Option<&[f32]>) -> Result<(MlpActs, Vec<f32>)> {
        let spec = self.engine.opts.layer;
        let (model, i, shape, masks) = (self.model, self.i, self.shape, self.masks);
        self.engine
            .mlp_forward(&spec, model, i, shape, masks, x2n, residual)
    }
}

impl<R: KernelRunner> Engine<R> {
    /// One layer's forward from its input `x` over the sequence's kernels,
    /// composed as its description says ([`compose_layer`]): what its
    /// backward needs, and the layer's output.
    pub(super) fn layer_forward(
        &mut self,
        model: &Model,
        i: usize,
        shape: &Shape,
        x: Vec<f32>,
        masks: Dropout,
    ) -> Result<(LayerActs, Vec<f32>)> {
        let spec = self.opts.layer;
        let alpha = self.opts.residual_scale as f32;
        let mut parts = SequenceParts {
            engine: self,
            model,
            i,
            shape,
            masks: &masks,
        };
        let c = compose_layer(
            &spec,
            model,
            &model.layers[i],
            shape.seq,
            alpha,
            x,
            &mut parts,
        )?;
        let acts = LayerActs {
            x: c.x,
            xn: c.xn,
            mixer: c.mixer,
            mixer_out: c.mixer_out,
            x2: c.x2,
            x2n: c.x2n,
            mlp: c.mlp,
            mlp_out: c.mlp_out,
            masks,
        };
        Ok((acts, c.x_next))
    }

    /// The token mixer over the normed input `xn`: what its backward needs,
    /// and its output (before the residual).
    pub(super) fn mixer_forward(
        &mut self,
        spec: &LayerSpec,
        model: &Model,
        i: usize,
        shape: &Shape,
        masks: &Dropout,
        xn: &[f32],
    ) -> Result<(MixerActs, Vec<f32>)> {
        match spec.mixer {
            Mixer::Attention { .. } => {
                let a = self.runner.run::<kernels::SdpaForward>(
                    model,
                    i,
                    shape,
                    masks,
                    &kernels::sdpa_forward::Acts {
                        xnorm: xn,
                        // A block of queries reads its columns too; its
                        // angles and mask the device runner makes per tile.
                        xnorm_block: Some(xn),
                        rope_cos: None,
                        rope_sin: None,
                        mask: None,
                    },
                )?;
                if spec.qk_norm_kind() == QkNorm::Whole && self.runner.computes_in_fp16() {
                    self.check_whole_norm(i, shape, &a)?;
                }
                let o = self.runner.run::<kernels::WoForward>(
                    model,
                    i,
                    shape,
                    masks,
                    &kernels::wo_forward::Acts { attn: &a.attn },
                )?;
                let acts = MixerActs::Attention {
                    attn: Kept::new(a.attn),
                    q_rope: Kept::new(a.q_rope),
                    k_rope: Kept::new(a.k_rope),
                    v: Kept::new(a.v),
                    q_raw: Kept::new(a.q_raw.unwrap_or_default()),
                    k_raw: Kept::new(a.k_raw.unwrap_or_default()),
                };
                Ok((acts, o.o))
            }
        }
    }

    /// Refuses layer `i`'s attention where the device's norm over a whole
    /// projection left fp16 (a mean square past
    /// [`KernelOptions::whole_norm_bound`]: the program's k·mean(x²)
    /// overflows, and the normed queries or keys are zero), rather than
    /// train on it.
    fn check_whole_norm(
        &self,
        i: usize,
        shape: &Shape,
        a: &kernels::sdpa_forward::Out,
    ) -> Result<()> {
        let bound = self.opts.whole_norm_bound();
        for (name, raw) in [("query", &a.q_raw), ("key", &a.k_raw)] {
            let Some(raw) = raw else { continue };
            let ms = maths::max_mean_square(raw, shape.seq);
            if ms.is_nan() || ms > bound {
                bail!(
                    "layer {i}: the {name} projection's mean square reaches {ms:.0} at a position, past the {bound:.0} the Neural Engine's fp16 norm over a whole projection holds with ε {} (OLMo 2's QK-norm); train this model with --backend cpu",
                    self.opts.eps
                );
            }
        }
        Ok(())
    }

    /// The MLP over the normed input `x2n`: what its backward needs, and
    /// `x2 + α·mlp(x2n)` (its kernel adds the residual `x2`), or without a
    /// residual the MLP's output.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp_forward(
        &mut self,
        spec: &LayerSpec,
        model: &Model,
        i: usize,
        shape: &Shape,
        masks: &Dropout,
        x2n: &[f32],
        x2: Option<&[f32]>,
    ) -> Result<(MlpActs, Vec<f32>)> {
        match spec.mlp {
            Mlp::SwiGlu | Mlp::GeGlu => {
                let f = self.runner.run::<kernels::FfnForward>(
                    model,
                    i,
                    shape,
                    masks,
                    &kernels::ffn_forward::Acts { x2norm: x2n, x2 },
                )?;
                let acts = MlpActs::Glu {
                    h1: Kept::new(f.h1),
                    h3: Kept::new(f.h3),
                    gate: Kept::new(f.gate),
                };
                Ok((acts, f.x_next))
            }
        }
    }
}
