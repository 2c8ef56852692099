//! Autoregressive generation with a KV cache: one position at a time
//! through the layer the sequence's forward composes (`compose_layer`:
//! the same norms, residuals and MLP forward, at one position), its
//! attention the new position's against the cached keys and values —
//! with greedy, temperature and nucleus (top-p) sampling.

use std::borrow::Cow;

use anyhow::{bail, Result};

use super::layer::{compose_layer, Sublayers};
use super::{dropout_masks, Engine};
use crate::device::CpuKernels;
use crate::kernels::maths::{apply_rope, rms_norm, w_x};
use crate::kernels::{KernelOptions, Shape};
use crate::model::generation::Sampling;
use crate::model::layer::Mixer;
use crate::model::{LayerIds, Model, Projection};
use crate::util::rng::Rng;

/// Decoding state: cached keys and values per layer (position-major).
pub struct Decoder<'a> {
    /// The model as plain f32 tensors: borrowed, or (a mapped base, an
    /// adapter) its [`Model::merged`] copy.
    model: Cow<'a, Model>,
    /// The CPU engine whose layer parts run at one position.
    engine: Engine<CpuKernels>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    pos: usize,
    /// The tokens fed so far (replayed when LongRoPE's frequencies change).
    tokens: Vec<u32>,
}

impl<'a> Decoder<'a> {
    pub fn new(model: &'a Model) -> Decoder<'a> {
        let n = model.cfg.num_hidden_layers;
        let plain = model.lora.is_none() && model.params.iter().all(|p| p.stored.is_none());
        let model = match plain {
            true => Cow::Borrowed(model),
            false => Cow::Owned(model.merged()),
        };
        Decoder {
            engine: Engine::cpu(&model),
            model,
            keys: vec![vec![]; n],
            values: vec![vec![]; n],
            pos: 0,
            tokens: vec![],
        }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    /// Feeds one token; returns the next-token logits `[V]`: those of a
    /// full forward over every token fed. Where RoPE's frequencies follow
    /// the length (LongRoPE), the sequence that passes the switch is
    /// computed again with the new ones, as transformers' Phi-3 does
    /// (`Phi3ForCausalLM.prepare_inputs_for_generation` drops its cache
    /// there).
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let vocab = self.model.cfg.vocab_size;
        if token as usize >= vocab {
            bail!("token id {token} is outside the vocabulary ({vocab} ids)");
        }
        self.tokens.push(token);
        let len = self.tokens.len();
        if self.model.cfg.rope_scaling.switches_after() == Some(len - 1) && len > 1 {
            self.keys
                .iter_mut()
                .chain(&mut self.values)
                .for_each(Vec::clear);
            self.pos = 0;
            for i in 0..len - 1 {
                self.advance(self.tokens[i], len)?;
            }
        }
        self.advance(token, len)
    }

    /// Runs `token` at the next position of a sequence of `len` positions.
    fn advance(&mut self, token: u32, len: usize) -> Result<Vec<f32>> {
        let Decoder {
            model,
            engine,
            keys,
            values,
            pos,
            ..
        } = self;
        let m: &Model = model;
        let c = &m.cfg;
        let d = c.hidden_size;
        if *pos >= c.max_position_embeddings {
            bail!(
                "reached the model's max_position_embeddings ({})",
                c.max_position_embeddings
            );
        }
        let eps = c.rms_norm_eps as f32;
        let (alpha, spec) = (engine.opts.residual_scale as f32, engine.opts.layer);
        let w = |i: usize| m.params[i].data.as_slice();
        let t = token as usize;
        let m_e = c.scales.embedding as f32;
        let mut x: Vec<f32> = m.params[m.embed].data[t * d..(t + 1) * d]
            .iter()
            .map(|v| m_e * v)
            .collect();
        let one = Shape::new(c, 1);
        // Each layer as the sequence's forward composes it, its attention
        // the new position's against the cache.
        for (i, l) in m.layers.iter().enumerate() {
            let mut parts = CachedToken {
                engine,
                model: m,
                layer: (i, l),
                one: &one,
                at: (*pos, len),
                cache: (&mut keys[i], &mut values[i]),
            };
            x = compose_layer(&spec, m, l, 1, alpha, x, &mut parts)?.x_next;
        }
        let mut xf = rms_norm(&x, w(m.final_norm), d, 1, eps);
        super::scale_head_input(c, &mut xf);
        *pos += 1;
        let mut z = w_x(&m.lm_head(), &xf, c.vocab_size, d, 1);
        super::head::cap_logits(c, &mut z);
        Ok(z)
    }
}

/// One cached token's sublayers for layer `i`: the attention against the
/// layer's cache, the engine's MLP at one position.
struct CachedToken<'d, 'm> {
    engine: &'d mut Engine<CpuKernels>,
    model: &'m Model,
    layer: (usize, &'m LayerIds),
    one: &'m Shape,
    /// The position and the sequence's length.
    at: (usize, usize),
    cache: (&'d mut Vec<f32>, &'d mut Vec<f32>),
}

impl Sublayers for CachedToken<'_, '_> {
    type Mixer = ();
    type Mlp = ();

    fn mixer(&mut self, xn: &[f32]) -> Result<((), Vec<f32>)> {
        let (m, (i, l)) = (self.model, self.layer);
        Ok(match self.engine.opts.layer.mixer {
            Mixer::Attention { .. } => {
                let opts = &self.engine.opts.for_layer(&m.cfg, i);
                let cache = (&mut *self.cache.0, &mut *self.cache.1);
                ((), cached_attention(m, l, opts, self.at, xn, cache))
            }
        })
    }

    fn mlp(&mut self, x2n: &[f32], residual: Option<&[f32]>) -> Result<((), Vec<f32>)> {
        let (m, i) = (self.model, self.layer.0);
        let spec = self.engine.opts.layer;
        let masks = dropout_masks(m, i, 1, None);
        let (_, y) = self
            .engine
            .mlp_forward(&spec, m, i, self.one, &masks, x2n, residual)?;
        Ok(((), y))
    }
}

/// The attention mixer at position `pos` of `len`: the new position's
/// query, key and value (QK-norm, RoPE) from its normed input `xn`, its
/// key and value appended to the layer's cache, and its attention over
/// every cached position; `Wo` times that.
fn cached_attention(
    m: &Model,
    l: &LayerIds,
    opts: &KernelOptions,
    (pos, len): (usize, usize),
    xn: &[f32],
    (ks, vs): (&mut Vec<f32>, &mut Vec<f32>),
) -> Vec<f32> {
    let c = &m.cfg;
    let (d, hd, q, kv) = (c.hidden_size, c.head_dim, c.q_dim(), c.kv_dim());
    let eps = c.rms_norm_eps as f32;
    let w = |i: usize| m.params[i].data.as_slice();
    let proj = |t: Projection| w(t.base(l));
    let (cos, sin) = opts.rope_row(pos, len, hd);
    let project = |t: Projection, rows: usize| {
        let mut y = w_x(proj(t), xn, rows, d, 1);
        if let Some(b) = l.biases[t.index()] {
            y.iter_mut().zip(w(b)).for_each(|(y, b)| *y += b);
        }
        y
    };
    let mut qv = project(Projection::Q, q);
    let mut kvec = project(Projection::K, kv);
    let vvec = project(Projection::V, kv);
    // QK-norm over each head or the whole projection (the weight's width).
    if let (Some(qn), Some(kn)) = (l.q_norm, l.k_norm) {
        qv = rms_norm(&qv, w(qn), w(qn).len(), 1, eps);
        kvec = rms_norm(&kvec, w(kn), w(kn).len(), 1, eps);
    }
    let qv = apply_rope(&qv, hd, 1, &cos, &sin, opts.rope, 1.0);
    let kvec = apply_rope(&kvec, hd, 1, &cos, &sin, opts.rope, 1.0);
    ks.extend_from_slice(&kvec);
    vs.extend_from_slice(&vvec);
    let ratio = c.gqa_ratio();
    // The cached keys this position sees (its window's, or all).
    let keys = crate::kernels::visible_keys(pos, opts.class.window);
    let first = *keys.start();
    let scale = opts.score_scale as f32;
    let cap = opts.score_cap.map(|c| c as f32);
    let mut attn = vec![0f32; q];
    let mut scores = vec![0f32; keys.count()];
    for h in 0..c.num_attention_heads {
        let g = h / ratio;
        let qh = &qv[h * hd..(h + 1) * hd];
        for (j, sc) in (first..).zip(scores.iter_mut()) {
            let kj = &ks[j * kv + g * hd..j * kv + (g + 1) * hd];
            *sc = qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
            if let Some(c) = cap {
                *sc = (*sc / c).tanh() * c;
            }
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        scores.iter_mut().for_each(|s| {
            *s = (*s - max).exp();
            sum += *s;
        });
        let out = &mut attn[h * hd..(h + 1) * hd];
        for (j, &p) in (first..).zip(&scores) {
            let vj = &vs[j * kv + g * hd..j * kv + (g + 1) * hd];
            out.iter_mut().zip(vj).for_each(|(o, v)| *o += p / sum * v);
        }
    }
    w_x(proj(Projection::O), &attn, d, q, 1)
}

/// Picks the next token from `logits`.
pub fn sample(logits: &[f32], s: Sampling, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if s.temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i, ((z as f64 - max) / s.temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    if s.top_k > 0 && s.top_k < probs.len() {
        probs.truncate(s.top_k);
        let kept: f64 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= kept);
    }
    if s.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (k, p) in probs.iter().enumerate() {
            acc += p.1;
            if acc >= s.top_p {
                keep = k + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let mass: f64 = probs.iter().map(|p| p.1).sum();
    let mut r = rng.uniform() * mass;
    for &(i, p) in &probs {
        if r < p {
            return i as u32;
        }
        r -= p;
    }
    probs.last().map(|p| p.0 as u32).unwrap_or_else(argmax)
}

/// What to generate after a prompt.
#[derive(Clone, Copy, Debug)]
pub struct GenerateOptions<'a> {
    pub max_new: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// Tokens that end generation (not emitted: they are not text).
    pub stop: &'a [u32],
}

/// Samples from `logits`, emits, and asks `next` for the following logits
/// (`None`: no room left) until `max_new` tokens or a stop token (which is
/// neither emitted nor returned).
fn sample_loop(
    o: &GenerateOptions,
    mut logits: Vec<f32>,
    mut next: impl FnMut(u32) -> Result<Option<Vec<f32>>>,
    mut emit: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let mut rng = Rng::new(o.seed);
    let mut out = Vec::new();
    while out.len() < o.max_new {
        let t = sample(&logits, o.sampling, &mut rng);
        // An end-of-sequence token ends the text; it is not part of it.
        if o.stop.contains(&t) {
            break;
        }
        out.push(t);
        emit(t)?;
        match next(t)? {
            Some(l) => logits = l,
            None => break,
        }
    }
    Ok(out)
}

/// Generates after `prompt` with the KV-cache decoder (CPU).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    o: &GenerateOptions,
    emit: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let mut dec = Decoder::new(model);
    let mut logits = vec![];
    for &t in prompt {
        logits = dec.step(t)?;
    }
    let max_pos = model.cfg.max_position_embeddings;
    sample_loop(
        o,
        logits,
        |t| {
            if dec.position() >= max_pos {
                Ok(None)
            } else {
                dec.step(t).map(Some)
            }
        },
        emit,
    )
}

/// Generation through an engine's full forward (the Neural Engine paths):
/// each new token reruns the whole sequence; causal attention makes the
/// last position's logits exact.
pub fn generate_with_engine<R: crate::device::KernelRunner>(
    mut eng: crate::engine::Engine<R>,
    model: &Model,
    prompt: &[u32],
    o: &GenerateOptions,
    emit: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let max_pos = model.cfg.max_position_embeddings;
    if prompt.len() >= max_pos {
        return Ok(vec![]);
    }
    // The head in the engine's vocabulary chunks (on the device, its
    // kernels), at the last position only.
    let last_logits = |eng: &mut crate::engine::Engine<R>, seq: &[u32]| -> Result<Vec<f32>> {
        let fwd = eng.forward(model, seq, None)?;
        eng.last_logits(model, &fwd.xf)
    };
    let mut seq = prompt.to_vec();
    let first = last_logits(&mut eng, &seq)?;
    sample_loop(
        o,
        first,
        |t| {
            seq.push(t);
            if seq.len() >= max_pos {
                return Ok(None);
            }
            last_logits(&mut eng, &seq).map(Some)
        },
        emit,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy decoding over fixed logits: token `t` is followed by `t + 1`;
    /// the stop token ends the text without being emitted.
    #[test]
    fn a_stop_token_ends_generation_unseen() {
        let logits = |t: usize| {
            let mut l = vec![0f32; 8];
            l[t] = 10.0;
            l
        };
        let o = GenerateOptions {
            max_new: 10,
            sampling: Sampling {
                top_k: 0,
                temperature: 0.0,
                top_p: 1.0,
            },
            seed: 0,
            stop: &[4],
        };
        let mut emitted = vec![];
        let out = sample_loop(
            &o,
            logits(1),
            |t| Ok(Some(logits(t as usize + 1))),
            |t| {
                emitted.push(t);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(emitted, [1, 2, 3]);
    }
}
