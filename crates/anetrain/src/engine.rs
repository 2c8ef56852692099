//! The transformer, forward and backward, over the kernel contract: the
//! matmul-heavy work goes through a [`KernelRunner`] (the CPU twins here; the
//! Neural Engine later), the rest — embedding, RMSNorm, residuals, RoPE and
//! QK-norm backward, cross-entropy, weight gradients — runs on the CPU.
//! Activations are channel-first `[C, S]` per sequence.
//!
//! One layer, forward (α is the residual scale, 1 for HF models):
//!   xn = rmsnorm(x)·w_attn;  attn, q, k, v = sdpa_forward(xn);  x2 = x + α·Wo·attn
//!   x2n = rmsnorm(x2)·w_ffn;  x' = x2 + α·W2(silu(W1 x2n)·W3 x2n)
//! and backward runs the same list in reverse, each piece beside its maths.

use anyhow::{bail, Result};
use linalg::{matmul, MatMut, MatRef};

pub use crate::grads::{zero_grads, Grads};
use crate::kernels::{self, maths, KernelOptions, Shape};
use crate::model::{LayerIds, Model, Projection};
use crate::rng::Rng;
use crate::runner::{CpuKernels, Dropout, KernelRunner, NeuralKernels};

/// Runs `job` (weight gradients) on a worker thread beside `kernel` (device
/// work) when `overlap` is set, else one after the other; both have
/// finished when this returns.
fn overlapped<T>(
    overlap: bool,
    job: impl FnOnce() + Send,
    kernel: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if !overlap {
        job();
        return kernel();
    }
    std::thread::scope(|s| {
        let worker = s.spawn(job);
        let out = kernel();
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
        out
    })
}

/// What one layer's backward needs from its forward.
struct LayerActs {
    x: Vec<f32>,
    xn: Vec<f32>,
    attn: Vec<f32>,
    q_rope: Vec<f32>,
    k_rope: Vec<f32>,
    v: Vec<f32>,
    q_raw: Vec<f32>,
    k_raw: Vec<f32>,
    x2: Vec<f32>,
    x2n: Vec<f32>,
    h1: Vec<f32>,
    h3: Vec<f32>,
    gate: Vec<f32>,
    /// LoRA dropout masks per projection, when training with dropout.
    masks: Dropout,
}

/// A forward pass over one sequence.
pub struct Forward {
    tokens: Vec<u32>,
    layers: Vec<LayerActs>,
    x_last: Vec<f32>,
    /// Final-normed hidden state `[D, S]`.
    pub xf: Vec<f32>,
}

/// Where a base parameter's gradient accumulates: its slot in `grads`, or
/// a scratch buffer when LoRA freezes the base.
fn base_grad<'a>(
    model: &Model,
    grads: &'a mut Grads,
    id: usize,
    scratch: &'a mut Vec<f32>,
) -> &'a mut [f32] {
    if model.lora.is_some() {
        scratch.clear();
        scratch.resize(model.params[id].data.len(), 0.0);
        scratch
    } else {
        grads.accumulator(id)
    }
}

/// Gradient of projection `t` in `layer` given its output gradient
/// `dy [out, S]` and input `x [in, S]`: the base weight's, or with LoRA
/// only the adapter's (y = W·x + s·B·A·(m⊙x)):
///   dA = s·(Bᵀ·dy)·(m⊙x)ᵀ,   dB = s·dy·(A·(m⊙x))ᵀ.
fn projection_grad(
    model: &Model,
    grads: &mut Grads,
    layer: usize,
    t: Projection,
    dy: &[f32],
    x: &[f32],
    mask: Option<&[f32]>,
) {
    let base = &model.params[t.base(&model.layers[layer])];
    let (out, inp, seq) = (base.shape[0], base.shape[1], x.len() / base.shape[1]);
    let Some(lora) = &model.lora else {
        let target = grads.product_target(t.base(&model.layers[layer]));
        weight_grad(target, dy, x, out, inp, seq);
        return;
    };
    let Some(ids) = lora.slots[layer][t.index()] else {
        return;
    };
    let r = lora.cfg.rank;
    let s = lora.cfg.scale() as f32;
    let x = &maths::masked(x, mask)[..];
    let (a, b) = (&lora.params[ids.a].data, &lora.params[ids.b].data);
    let mut bt_dy = maths::wt_x(b, dy, out, r, seq);
    bt_dy.iter_mut().for_each(|v| *v *= s);
    let mut ax = maths::w_x(a, x, r, inp, seq);
    ax.iter_mut().for_each(|v| *v *= s);
    weight_grad(grads.product_target(ids.a), &bt_dy, x, r, inp, seq);
    weight_grad(grads.product_target(ids.b), dy, &ax, out, r, seq);
}

/// Dropout masks for every adapted target of `layer` (keep with
/// probability 1−p, kept values scaled by 1/(1−p)), drawn from `key`.
fn dropout_masks(model: &Model, layer: usize, seq: usize, key: Option<u64>) -> Dropout {
    let mut masks: Dropout = Default::default();
    let (Some(lora), Some(key)) = (&model.lora, key) else {
        return masks;
    };
    let p = lora.cfg.dropout;
    if p <= 0.0 {
        return masks;
    }
    let keep = (1.0 / (1.0 - p)) as f32;
    for t in Projection::ALL {
        if lora.slots[layer][t.index()].is_none() {
            continue;
        }
        let inp = model.params[t.base(&model.layers[layer])].shape[1];
        let mut rng = Rng::new(
            key ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (t.index() as u64) << 56,
        );
        masks[t.index()] = Some(
            (0..inp * seq)
                .map(|_| if rng.uniform() < p { 0.0 } else { keep })
                .collect(),
        );
    }
    masks
}

/// `dW [out, in] (+)= dY [out, S] · X [in, S]ᵀ` into a
/// [`Grads::product_target`].
fn weight_grad(
    (dw, accumulate): (&mut [f32], bool),
    dy: &[f32],
    x: &[f32],
    out: usize,
    inp: usize,
    seq: usize,
) {
    let t = std::time::Instant::now();
    matmul(
        MatRef::row_major(dy, 0, out, seq),
        MatRef::row_major(x, 0, inp, seq).t(),
        MatMut::row_major(dw, 0, out, inp),
        accumulate,
    );
    WEIGHT_GRAD_NANOS.fetch_add(
        t.elapsed().as_nanos() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

fn add_scaled(dst: &mut [f32], src: &[f32], alpha: f32) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += alpha * s);
}

/// The transformer over a kernel runner.
pub struct Engine<R: KernelRunner> {
    pub runner: R,
    pub opts: KernelOptions,
    /// Training with LoRA dropout: the key the next forward draws its
    /// masks from (`None`: no dropout, as in evaluation).
    pub dropout_key: Option<u64>,
}

/// Nanoseconds spent in weight-gradient gemms, on any thread (for `bench`
/// breakdowns).
static WEIGHT_GRAD_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Takes and resets the time spent in weight-gradient gemms.
pub fn take_weight_grad_secs() -> f64 {
    WEIGHT_GRAD_NANOS.swap(0, std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
}

impl Engine<CpuKernels> {
    /// The CPU engine with Hugging Face semantics for `model`.
    pub fn cpu(model: &Model) -> Engine<CpuKernels> {
        let opts = KernelOptions::for_model(model);
        Engine {
            runner: CpuKernels { opts: opts.clone() },
            opts,
            dropout_key: None,
        }
    }
}

impl<D: ane::Device> Engine<NeuralKernels<D>> {
    /// The Neural Engine path on `device` with Hugging Face semantics.
    pub fn neural(model: &Model, device: D) -> Self {
        let opts = KernelOptions::for_model(model);
        Engine {
            runner: NeuralKernels::new(device, opts.clone()),
            opts,
            dropout_key: None,
        }
    }
}

impl<R: KernelRunner> Engine<R> {
    /// Forward over `tokens` (one sequence), keeping what backward needs.
    pub fn forward(&mut self, model: &Model, tokens: &[u32]) -> Result<Forward> {
        let cfg = &model.cfg;
        let (d, seq) = (cfg.hidden_size, tokens.len());
        if seq == 0 {
            bail!("cannot run the model on an empty sequence");
        }
        let shape = Shape::new(cfg, seq);
        let eps = cfg.rms_norm_eps as f32;
        let alpha = self.opts.residual_scale as f32;
        // x[c, s] = E[token_s, c]
        let emb = &model.params[model.embed].data;
        let mut x = vec![0f32; d * seq];
        for (s, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= cfg.vocab_size {
                bail!(
                    "token id {t} at position {s} is outside the vocabulary ({} ids)",
                    cfg.vocab_size
                );
            }
            for c in 0..d {
                x[c * seq + s] = emb[t * d + c];
            }
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, l) in model.layers.iter().enumerate() {
            let w = |id: usize| model.params[id].data.as_slice();
            let key = self.dropout_key.map(|k| k.wrapping_add(i as u64));
            let masks = dropout_masks(model, i, seq, key);
            let xn = maths::head_rms_norm(&x, w(l.attn_norm), d, seq, eps);
            let a = self.runner.run::<kernels::SdpaForward>(
                model,
                i,
                &shape,
                &masks,
                &kernels::sdpa_forward::Acts { xnorm: &xn },
            )?;
            let o = self.runner.run::<kernels::WoForward>(
                model,
                i,
                &shape,
                &masks,
                &kernels::wo_forward::Acts { attn: &a.attn },
            )?;
            let mut x2 = x.clone();
            add_scaled(&mut x2, &o.o, alpha);
            let x2n = maths::head_rms_norm(&x2, w(l.ffn_norm), d, seq, eps);
            let f = self.runner.run::<kernels::FfnForward>(
                model,
                i,
                &shape,
                &masks,
                &kernels::ffn_forward::Acts {
                    x2norm: &x2n,
                    x2: &x2,
                },
            )?;
            layers.push(LayerActs {
                x: std::mem::replace(&mut x, f.x_next),
                xn,
                attn: a.attn,
                q_rope: a.q_rope,
                k_rope: a.k_rope,
                v: a.v,
                q_raw: a.q_raw.unwrap_or_default(),
                k_raw: a.k_raw.unwrap_or_default(),
                x2,
                x2n,
                h1: f.h1,
                h3: f.h3,
                gate: f.gate,
                masks,
            });
        }
        let xf = maths::head_rms_norm(&x, &model.params[model.final_norm].data, d, seq, eps);
        Ok(Forward {
            tokens: tokens.to_vec(),
            layers,
            x_last: x,
            xf,
        })
    }

    /// Backward from `dxf` (gradient of the final-normed state), accumulating
    /// into `grads`: the final norm, each layer from the last (its FFN block,
    /// then its attention block), then the embedding.
    pub fn backward(
        &mut self,
        model: &Model,
        fwd: &Forward,
        dxf: &[f32],
        grads: &mut Grads,
    ) -> Result<()> {
        let cfg = &model.cfg;
        let (d, seq) = (cfg.hidden_size, fwd.tokens.len());
        let eps = cfg.rms_norm_eps as f32;
        let rope = self.opts.rope_tables(seq, cfg.head_dim);
        let mut scratch = Vec::new();
        // xf = rmsnorm(x)·w_final
        let mut dx = maths::head_rms_norm_backward(
            &fwd.x_last,
            &model.params[model.final_norm].data,
            dxf,
            d,
            seq,
            eps,
            base_grad(model, grads, model.final_norm, &mut scratch),
        );
        for (i, (l, a)) in model.layers.iter().zip(&fwd.layers).enumerate().rev() {
            let c = LayerCtx {
                model,
                layer: i,
                ids: l,
                acts: a,
                shape: Shape::new(cfg, seq),
                eps,
            };
            self.ffn_backward(&c, &mut dx, grads, &mut scratch)?;
            self.attention_backward(&c, &rope, &mut dx, grads, &mut scratch)?;
        }
        if model.lora.is_some() {
            return Ok(()); // the embedding is frozen
        }
        // x[c, s] = E[token_s, c]
        let de = grads.accumulator(model.embed);
        for (s, &t) in fwd.tokens.iter().enumerate() {
            for c in 0..d {
                de[t as usize * d + c] += dx[c * seq + s];
            }
        }
        Ok(())
    }

    /// The FFN block backward, `dx` from the block's output to its input:
    ///   x' = x2 + α·W2·(silu(W1·x2n)·W3·x2n),  x2n = rmsnorm(x2)·w_ffn
    ///   dx2 = dx' + rmsnorm'(W1ᵀ·dh1 + W3ᵀ·dh3),  dh1, dh3 = swiglu'(W2ᵀ·α·dx')
    /// Each group of weight gradients runs beside the kernel that needs the
    /// same upstream gradient (on a worker thread when kernels run on a
    /// device).
    fn ffn_backward(
        &mut self,
        c: &LayerCtx,
        dx: &mut [f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let (a, overlap) = (c.acts, self.runner.overlaps_host());
        let alpha = self.opts.residual_scale as f32;
        let dffn: Vec<f32> = dx.iter().map(|v| alpha * v).collect();
        let dgate = overlapped(
            overlap,
            || c.grad(grads, Projection::Down, &dffn, &a.gate),
            || {
                let acts = kernels::ffn_backward_w2::Acts { dffn: &dffn };
                Ok(self.run::<kernels::FfnBackwardW2>(c, &acts)?.dgate)
            },
        )?;
        let (dh1, dh3) = maths::swiglu_backward(&a.h1, &a.h3, &dgate);
        let dx2n = overlapped(
            overlap,
            || {
                c.grad(grads, Projection::Gate, &dh1, &a.x2n);
                c.grad(grads, Projection::Up, &dh3, &a.x2n);
            },
            || {
                let acts = kernels::ffn_backward_w13::Acts {
                    dh1: &dh1,
                    dh3: &dh3,
                };
                Ok(self.run::<kernels::FfnBackwardW13>(c, &acts)?.dx)
            },
        )?;
        let dnorm = c.norm_backward(&a.x2, c.ids.ffn_norm, &dx2n, grads, scratch);
        add_scaled(dx, &dnorm, 1.0);
        Ok(())
    }

    /// The attention block backward, `dx` from the block's output to its
    /// input:
    ///   x2 = x + α·Wo·attn(q, k, v),  q = rope(qknorm(Wq·xn)), … ,  xn = rmsnorm(x)·w_attn
    ///   da = Woᵀ·α·dx2 → dq, dk, dv (two device kernels) → unrope, QK-norm'
    ///   dx = dx2 + rmsnorm'(Wqᵀ·dq + Wkᵀ·dk + Wvᵀ·dv)
    fn attention_backward(
        &mut self,
        c: &LayerCtx,
        (cos, sin): &(Vec<f32>, Vec<f32>),
        dx: &mut [f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let (a, overlap) = (c.acts, self.runner.overlaps_host());
        let (hd, seq) = (c.shape.head_dim, c.shape.seq);
        let alpha = self.opts.residual_scale as f32;
        let dout: Vec<f32> = dx.iter().map(|v| alpha * v).collect();
        let da = overlapped(
            overlap,
            || c.grad(grads, Projection::O, &dout, &a.attn),
            || {
                let acts = kernels::wo_backward::Acts { dy: &dout };
                Ok(self.run::<kernels::WoBackward>(c, &acts)?.da)
            },
        )?;
        let b1 = self.run::<kernels::SdpaBackward1>(
            c,
            &kernels::sdpa_backward1::Acts {
                q_rope: &a.q_rope,
                k_rope: &a.k_rope,
                v: &a.v,
                da: &da,
            },
        )?;
        let dv = b1.dv;
        let b2 = self.run::<kernels::SdpaBackward2>(
            c,
            &kernels::sdpa_backward2::Acts {
                probs: &b1.probs,
                dp: &b1.dp,
                q_rope: &a.q_rope,
                k_rope: &a.k_rope,
            },
        )?;
        // RoPE is a rotation: its backward is the inverse rotation.
        let unrope = |g: &[f32]| maths::apply_rope(g, hd, seq, cos, sin, self.opts.rope, -1.0);
        let (mut dq, mut dk) = (unrope(&b2.dq), unrope(&b2.dk));
        if let (Some(qn), Some(kn)) = (c.ids.q_norm, c.ids.k_norm) {
            let (w, eps) = (|id: usize| c.model.params[id].data.as_slice(), c.eps);
            let gq = base_grad(c.model, grads, qn, scratch);
            dq = maths::head_rms_norm_backward(&a.q_raw, w(qn), &dq, hd, seq, eps, gq);
            let gk = base_grad(c.model, grads, kn, scratch);
            dk = maths::head_rms_norm_backward(&a.k_raw, w(kn), &dk, hd, seq, eps, gk);
        }
        let (mut dxn, dxkv) = overlapped(
            overlap,
            || {
                c.grad(grads, Projection::Q, &dq, &a.xn);
                c.grad(grads, Projection::K, &dk, &a.xn);
                c.grad(grads, Projection::V, &dv, &a.xn);
            },
            || {
                let dxq =
                    self.run::<kernels::QBackward>(c, &kernels::q_backward::Acts { dq: &dq })?;
                let acts = kernels::kv_backward::Acts { dk: &dk, dv: &dv };
                let dxkv = self.run::<kernels::KvBackward>(c, &acts)?;
                Ok((dxq.dx, dxkv.dx))
            },
        )?;
        add_scaled(&mut dxn, &dxkv, 1.0);
        let dnorm = c.norm_backward(&a.x, c.ids.attn_norm, &dxn, grads, scratch);
        add_scaled(dx, &dnorm, 1.0);
        Ok(())
    }

    /// Runs kernel `K` for the layer of `c`, with its dropout masks.
    fn run<K: kernels::Kernel>(&mut self, c: &LayerCtx, acts: &K::Acts<'_>) -> Result<K::Out> {
        self.runner
            .run::<K>(c.model, c.layer, &c.shape, &c.acts.masks, acts)
    }
}

/// What one layer's backward reads besides the gradients.
struct LayerCtx<'a> {
    model: &'a Model,
    layer: usize,
    ids: &'a LayerIds,
    acts: &'a LayerActs,
    shape: Shape,
    eps: f32,
}

impl LayerCtx<'_> {
    /// Projection `t`'s weight gradient from its output gradient `dy` and
    /// input `x` (see [`projection_grad`]).
    fn grad(&self, grads: &mut Grads, t: Projection, dy: &[f32], x: &[f32]) {
        let mask = self.acts.masks[t.index()].as_deref();
        projection_grad(self.model, grads, self.layer, t, dy, x, mask);
    }

    /// Backward of `rmsnorm(x)·w` (w = parameter `norm`) for `dy`; the
    /// weight's gradient accumulates into `grads`.
    fn norm_backward(
        &self,
        x: &[f32],
        norm: usize,
        dy: &[f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
    ) -> Vec<f32> {
        let (d, seq) = (self.shape.dim, self.shape.seq);
        let w = &self.model.params[norm].data;
        let g = base_grad(self.model, grads, norm, scratch);
        maths::head_rms_norm_backward(x, w, dy, d, seq, self.eps, g)
    }
}

/// Logits `[S, V]` for a final-normed state `xf [D, S]`.
pub fn logits(model: &Model, xf: &[f32], seq: usize) -> Vec<f32> {
    let (d, v) = (model.cfg.hidden_size, model.cfg.vocab_size);
    let mut out = vec![0f32; seq * v];
    matmul(
        MatRef::row_major(xf, 0, d, seq).t(),
        MatRef::row_major(model.lm_head(), 0, v, d).t(),
        MatMut::row_major(&mut out, 0, seq, v),
        false,
    );
    out
}

/// Cross-entropy over transposed logits `lt [V, S]` (column s holds
/// position s's logits) against `targets`, counting positions `first..`;
/// returns the summed loss and turns `lt` into dL/dlogitsᵀ scaled by
/// `grad_scale` (softmax − onehot; zero in the uncounted columns):
///   loss_s = max_s + ln Σ_v exp(z_vs − max_s) − z_{t_s, s}
/// The vocabulary is streamed in fixed blocks of rows, in parallel: column
/// maxima, then exp(z − max) in place with per-block column sums (f64,
/// added in block order, so the result does not depend on the thread
/// count), then one scaling pass. One exp per logit.
pub fn cross_entropy_t(
    lt: &mut [f32],
    targets: &[u32],
    first: usize,
    vocab: usize,
    grad_scale: f32,
) -> f64 {
    use rayon::prelude::*;
    let seq = targets.len();
    assert_eq!(lt.len(), vocab * seq);
    const ROWS: usize = 512;
    let block = ROWS * seq;
    let max: Vec<f32> = lt
        .par_chunks(block)
        .map(|b| {
            let mut m = vec![f32::NEG_INFINITY; seq];
            for row in b.chunks(seq) {
                m.iter_mut().zip(row).for_each(|(m, &z)| *m = m.max(z));
            }
            m
        })
        .reduce(
            || vec![f32::NEG_INFINITY; seq],
            |a, b| a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect(),
        );
    let target_logit: Vec<f32> = targets
        .iter()
        .enumerate()
        .map(|(s, &t)| lt[t as usize * seq + s])
        .collect();
    let partial: Vec<Vec<f64>> = lt
        .par_chunks_mut(block)
        .map(|b| {
            let mut sum = vec![0f64; seq];
            for row in b.chunks_mut(seq) {
                crate::simd::exp_shifted_accumulate(row, &max, &mut sum);
            }
            sum
        })
        .collect();
    let mut sum = vec![0f64; seq];
    for p in &partial {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    let scale: Vec<f32> = sum
        .iter()
        .enumerate()
        .map(|(i, &s)| match i < first {
            true => 0.0,
            false => (grad_scale as f64 / s) as f32,
        })
        .collect();
    lt.par_chunks_mut(block).for_each(|b| {
        for row in b.chunks_mut(seq) {
            row.iter_mut().zip(&scale).for_each(|(z, c)| *z *= c);
        }
    });
    let mut loss = 0f64;
    for (s, &t) in targets.iter().enumerate().skip(first) {
        lt[t as usize * seq + s] -= grad_scale;
        loss += max[s] as f64 + sum[s].ln() - target_logit[s] as f64;
    }
    loss
}

/// Loss over one sequence's head, plus (when `grads` is given) the gradient
/// of `grad_scale · loss_sum` into the LM head and the returned `dxf`.
/// Logits are computed transposed, `[V, S]`, the layout all three head
/// products multiply fastest in.
pub fn head_loss(
    model: &Model,
    xf: &[f32],
    targets: &[u32],
    grad_scale: f32,
    grads: Option<&mut Grads>,
) -> Result<(f64, Vec<f32>)> {
    head_loss_from(model, xf, targets, 0, grad_scale, grads)
}

/// [`head_loss`] counting only the targets `first..` (a masked prompt):
/// the others add nothing to the loss and get zero gradient.
pub fn head_loss_from(
    model: &Model,
    xf: &[f32],
    targets: &[u32],
    first: usize,
    grad_scale: f32,
    grads: Option<&mut Grads>,
) -> Result<(f64, Vec<f32>)> {
    let (v, seq) = (model.cfg.vocab_size, targets.len());
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        bail!("target token id {t} is outside the vocabulary ({v} ids)");
    }
    // logitsᵀ [V, S] = head [V, D] · xf [D, S], into a buffer kept between
    // calls: at Qwen3's vocabulary it is 155 MB for 256 positions, and fresh
    // pages of that size cost a page fault and a TLB shootdown each.
    let mut lt = LOGITS.with(|b| std::mem::take(&mut *b.borrow_mut()));
    lt.resize(v * seq, 0.0);
    let out = head_products(model, xf, targets, first, grad_scale, grads, &mut lt);
    LOGITS.with(|b| *b.borrow_mut() = lt);
    out
}

thread_local! {
    /// The transposed logits buffer [`head_loss`] reuses.
    static LOGITS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`head_loss`] on the buffer `lt` (`[V, S]`).
fn head_products(
    model: &Model,
    xf: &[f32],
    targets: &[u32],
    first: usize,
    grad_scale: f32,
    grads: Option<&mut Grads>,
    lt: &mut [f32],
) -> Result<(f64, Vec<f32>)> {
    let (d, v, seq) = (model.cfg.hidden_size, model.cfg.vocab_size, targets.len());
    matmul(
        MatRef::row_major(model.lm_head(), 0, v, d),
        MatRef::row_major(xf, 0, d, seq),
        MatMut::row_major(lt, 0, v, seq),
        false,
    );
    let loss = cross_entropy_t(lt, targets, first, v, grad_scale);
    let Some(grads) = grads else {
        return Ok((loss, vec![]));
    };
    // dxf [D, S] = headᵀ [D, V] · dlogitsᵀ [V, S]
    let mut dxf = vec![0f32; d * seq];
    matmul(
        MatRef::row_major(model.lm_head(), 0, v, d).t(),
        MatRef::row_major(lt, 0, v, seq),
        MatMut::row_major(&mut dxf, 0, d, seq),
        false,
    );
    if model.lora.is_some() {
        return Ok((loss, dxf)); // the head is frozen
    }
    // dhead [V, D] (+)= dlogitsᵀ [V, S] · xfᵀ [S, D]
    let (dhead, accumulate) = grads.product_target(model.lm_head.unwrap_or(model.embed));
    matmul(
        MatRef::row_major(lt, 0, v, seq),
        MatRef::row_major(xf, 0, d, seq).t(),
        MatMut::row_major(dhead, 0, v, d),
        accumulate,
    );
    Ok((loss, dxf))
}

/// Mean cross-entropy over a batch of token rows (each row: inputs
/// `row[..n-1]`, targets `row[1..]`) and, with `grads`, its gradient.
pub fn loss_and_grads<R: KernelRunner>(
    engine: &mut Engine<R>,
    model: &Model,
    rows: &[Vec<u32>],
    mut grads: Option<&mut Grads>,
) -> Result<(f64, usize)> {
    let n_targets: usize = rows.iter().map(|r| r.len().saturating_sub(1)).sum();
    if n_targets == 0 {
        bail!("every sequence needs at least two tokens");
    }
    let scale = 1.0 / n_targets as f32;
    let mut total = 0f64;
    for row in rows {
        let fwd = engine.forward(model, &row[..row.len() - 1])?;
        let (loss, dxf) = head_loss(model, &fwd.xf, &row[1..], scale, grads.as_deref_mut())?;
        total += loss;
        if let Some(g) = grads.as_deref_mut() {
            engine.backward(model, &fwd, &dxf, g)?;
        }
    }
    if let Some(g) = grads {
        g.finish();
    }
    Ok((total / n_targets as f64, n_targets))
}

/// Mean cross-entropy over the counted targets of `examples` (see
/// [`crate::records::Example`]): summed over the batch, divided by the
/// count, as PyTorch's `cross_entropy` with `ignore_index` on the
/// uncounted positions. Returns the loss and the count.
pub fn examples_loss<R: KernelRunner>(
    engine: &mut Engine<R>,
    model: &Model,
    examples: &[crate::records::Example],
) -> Result<(f64, usize)> {
    let mut total = 0f64;
    let mut count = 0usize;
    for e in examples {
        let n = e.tokens.len() - 1;
        let fwd = engine.forward(model, &e.tokens[..n])?;
        total += head_loss_from(model, &fwd.xf, &e.tokens[1..], e.first_target(), 0.0, None)?.0;
        count += e.n_targets();
    }
    if count == 0 {
        bail!("no target tokens to evaluate");
    }
    Ok((total / count as f64, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counting targets `first..` leaves those columns' losses and
    /// gradients exactly as without a mask and zeroes the others.
    #[test]
    fn masked_cross_entropy_counts_only_the_later_targets() {
        let (vocab, seq, first) = (700, 9, 4);
        let mut rng = crate::rng::Rng::new(5);
        let logits = rng.normals(vocab * seq, 3.0);
        let targets: Vec<u32> = (0..seq).map(|_| rng.below(vocab) as u32).collect();
        let mut full = logits.clone();
        let mut masked = logits.clone();
        let _ = cross_entropy_t(&mut full, &targets, 0, vocab, 0.5);
        let lm = cross_entropy_t(&mut masked, &targets, first, vocab, 0.5);
        // The loss of the counted columns alone, from scratch.
        let mut expect = 0f64;
        for (s, &t) in targets.iter().enumerate().skip(first) {
            let col: Vec<f64> = (0..vocab).map(|v| logits[v * seq + s] as f64).collect();
            let m = col.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + col.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
            expect += lse - col[t as usize];
        }
        assert!((lm - expect).abs() < 1e-9 * expect, "{lm} vs {expect}");
        for v in 0..vocab {
            for s in 0..seq {
                let (g, f) = (masked[v * seq + s], full[v * seq + s]);
                assert_eq!(g, if s < first { 0.0 } else { f }, "v {v} s {s}");
            }
        }
    }

    #[test]
    fn grads_overwrite_first_then_accumulate_and_refuse_stale_reads() {
        let mut g = Grads::from(vec![vec![5.0f32; 3], vec![7.0f32; 2], vec![9.0f32; 4]]);
        g.reset();
        let (buf, accumulate) = g.product_target(0);
        assert!(!accumulate);
        buf.fill(1.0);
        assert!(g.product_target(0).1, "a second product accumulates");
        g.accumulator(1)[0] += 2.0;
        assert_eq!(g[1], vec![2.0, 0.0], "an accumulator starts from zero");
        let stale = std::panic::catch_unwind(|| g[2].clone());
        assert!(stale.is_err(), "reading an unwritten gradient is refused");
        g.finish();
        assert_eq!(g[0], vec![1.0; 3]);
        assert_eq!(g[2], vec![0.0; 4], "finish zeroes what nothing wrote");
    }

    #[test]
    fn overlapped_runs_the_job_on_a_worker_and_joins_it() {
        let main = std::thread::current().id();
        let mut job_thread = None;
        let out = overlapped(
            true,
            || job_thread = Some(std::thread::current().id()),
            || Ok(std::thread::current().id()),
        )
        .unwrap();
        assert_eq!(out, main, "the kernel runs on the calling thread");
        assert!(
            job_thread.is_some_and(|t| t != main),
            "the job ran on a worker"
        );
        let mut ran = false;
        overlapped(false, || ran = true, || Ok(())).unwrap();
        assert!(ran);
        let e = overlapped(true, || (), || -> Result<()> { bail!("device failed") });
        assert_eq!(e.unwrap_err().to_string(), "device failed");
    }
}
