//! The transformer, forward and backward, over the kernel contract: the
//! matmul-heavy work goes through a [`KernelRunner`] (the CPU twins, or the
//! programs on a Neural Engine device), the rest — embedding, RMSNorm, residuals, RoPE and
//! QK-norm backward, cross-entropy, weight gradients — runs on the CPU.
//! Activations are channel-first `[C, S]` per sequence.
//!
//! A layer is composed as its description says ([`LayerSpec`]: the token
//! mixer, the MLP, where the norms sit); each part's forward and backward
//! sit side by side. Today's parts, forward (α is the residual scale, 1
//! for HF models):
//!   pre-norm:       xn = rmsnorm(x)·w₁;  x2 = x + α·mixer(xn);  x2n = rmsnorm(x2)·w₂;  x' = x2 + α·mlp(x2n)
//!   sandwich:       x2 = x + rmsnorm(mixer(xn))·v₁;  x' = x2 + rmsnorm(mlp(x2n))·v₂
//!   attention:      attn, q, k, v = sdpa_forward(xn);  mixer = Wo·attn
//!   SwiGLU, GeGLU:  mlp = W_down(act(W_gate x2n)·W_up x2n),  act = silu or gelu (tanh form)
//! and backward runs the same list in reverse, each piece beside its maths.

pub mod generate;
pub mod grads;
mod head;
mod layer;
mod queue;

pub use head::{head_grad_scale, HeadStatistics};
use queue::{projection_grad_ids, GradJob, GradQueue};

use std::sync::Arc;

use anyhow::{bail, Result};
use linalg::{matmul, MatMut, MatRef};

use crate::device::backend::{AnyRunner, OpenDevice};
use crate::device::{CpuKernels, Dropout, KernelRunner, NeuralKernels};
pub use crate::engine::grads::{zero_grads, Grads};
use crate::kernels::{self, maths, KernelOptions, Shape};
use crate::model::layer::{LayerSpec, Mixer, Mlp};
use crate::model::{LayerIds, Model, Projection};
use crate::util::rng::Rng;

/// A kernel output kept for the backward: in f16 when every value is an
/// f16 already (what a device kernel returns, read from its fp16 output
/// surface), which halves what the device path keeps and loses nothing;
/// else as computed (the CPU engine's f32 outputs, or tile partials
/// summed in f32).
enum Kept {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
}

impl Kept {
    fn new(v: Vec<f32>) -> Kept {
        use half::f16;
        if v.iter()
            .all(|&x| f16::from_f32(x).to_f32().to_bits() == x.to_bits())
        {
            let mut h = vec![f16::ZERO; v.len()];
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut h[..], &v);
            Kept::F16(h)
        } else {
            Kept::F32(v)
        }
    }

    /// The values in f32, exactly as the kernel returned them.
    fn get(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            Kept::F32(v) => v.into(),
            Kept::F16(h) => {
                let mut v = vec![0f32; h.len()];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&h[..], &mut v);
                v.into()
            }
        }
    }
}

/// What one layer's backward needs from its forward: the host's values in
/// f32 (each sublayer's input and normed input), the parts' kernel outputs
/// [`Kept`] (`LayerSpec::kept_per_position` counts them for the memory
/// plan).
struct LayerActs {
    x: Vec<f32>,
    xn: Vec<f32>,
    mixer: MixerActs,
    /// The mixer's output before the norm after it (empty without one).
    mixer_out: Vec<f32>,
    x2: Vec<f32>,
    x2n: Vec<f32>,
    mlp: MlpActs,
    /// The MLP's output before the norm after it (empty without one).
    mlp_out: Vec<f32>,
    /// LoRA dropout masks per projection, when training with dropout.
    masks: Dropout,
}

/// What a token mixer's backward needs from its forward.
enum MixerActs {
    /// The attention output, roped queries and keys, values, and (with
    /// QK-norm) queries and keys before their norms.
    Attention {
        attn: Kept,
        q_rope: Kept,
        k_rope: Kept,
        v: Kept,
        q_raw: Kept,
        k_raw: Kept,
    },
}

/// What an MLP's backward needs from its forward.
enum MlpActs {
    /// `h1 = W_gate·x`, `h3 = W_up·x`, `gate = act(h1)·h3` (SwiGLU, GeGLU).
    Glu { h1: Kept, h3: Kept, gate: Kept },
}

/// What a forward pass keeps of one layer for the backward.
enum Saved {
    /// Everything the backward reads.
    Acts(Box<LayerActs>),
    /// Only the layer's input (and its dropout masks): with activation
    /// checkpointing the backward recomputes the rest with the same
    /// kernels in the same order, so gradients are bit-identical.
    Input(Vec<f32>, Dropout),
}

/// A forward pass over one sequence.
pub struct Forward {
    tokens: Vec<u32>,
    layers: Vec<Saved>,
    x_last: Vec<f32>,
    /// The LM head's input `[D, S]`: the final-normed hidden state (over
    /// the model's logits_scaling, [`scale_head_input`]).
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
    let Some((a, b)) = lora.adapter(layer, t) else {
        return;
    };
    let mut bt_dy = maths::wt_x(b, dy, out, r, seq);
    bt_dy.iter_mut().for_each(|v| *v *= s);
    let mut ax = maths::w_x(a, x, r, inp, seq);
    ax.iter_mut().for_each(|v| *v *= s);
    // A fused module's A gathers every part's gradient (the first
    // product overwrites, the others add); its B's rows are each part's
    // own, written into a buffer zeroed at the step's first write.
    weight_grad(grads.product_target(ids.a), &bt_dy, x, r, inp, seq);
    match ids.whole_b(out) {
        true => weight_grad(grads.product_target(ids.b), dy, &ax, out, r, seq),
        false => {
            let rows = &mut grads.accumulator(ids.b)[ids.b_rows.0 * r..ids.b_rows.1 * r];
            weight_grad((rows, true), dy, &ax, out, r, seq);
        }
    }
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
        // The parts of a fused module share its input and so its mask (PEFT
        // drops out the fused module's input once).
        let first = model.cfg.fused_of(t).map_or(t, |f| f.parts[0]);
        let mut rng = Rng::new(
            key ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (first.index() as u64) << 56,
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
pub(super) fn weight_grad(
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
    /// Activation checkpointing: the forward keeps each layer's input
    /// only and the backward recomputes the layer.
    pub grad_checkpoint: bool,
    /// The LM head's largest |value| by (model version, parameter), for
    /// [`head_grad_scale`].
    head_max: Option<((u64, usize), f32)>,
}

/// Nanoseconds spent in weight-gradient gemms, on any thread (for `bench`
/// breakdowns).
static WEIGHT_GRAD_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Takes and resets the time spent in weight-gradient gemms.
pub fn take_weight_grad_secs() -> f64 {
    WEIGHT_GRAD_NANOS.swap(0, std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
}

impl<R: KernelRunner> Engine<R> {
    /// An engine over `runner` with options `opts`, no dropout, no
    /// checkpointing.
    pub fn with_runner(runner: R, opts: KernelOptions) -> Engine<R> {
        Engine {
            runner,
            opts,
            grad_checkpoint: false,
            head_max: None,
        }
    }
}

impl Engine<CpuKernels> {
    /// The CPU engine with Hugging Face semantics for `model`.
    pub fn cpu(model: &Model) -> Engine<CpuKernels> {
        let opts = KernelOptions::for_model(model);
        Engine::with_runner(CpuKernels::new(opts.clone()), opts)
    }
}

impl Engine<AnyRunner> {
    /// The engine of an opened backend (see [`Backend::open`]) with
    /// Hugging Face semantics for `model`.
    ///
    /// [`Backend::open`]: crate::device::backend::Backend::open
    pub fn on(model: &Model, device: OpenDevice) -> Self {
        let opts = KernelOptions::for_model(model);
        Engine::with_runner(AnyRunner::new(device, opts.clone()), opts)
    }

    /// With device buffers kept as `mode` says (the CPU has none).
    pub fn buffers(mut self, mode: crate::device::DeviceBuffers) -> Self {
        self.runner = self.runner.with_buffers(mode);
        self
    }
}

impl<D: ane::Device> Engine<NeuralKernels<D>> {
    /// The Neural Engine path on `device` with Hugging Face semantics.
    pub fn neural(model: &Model, device: D) -> Self {
        let opts = KernelOptions::for_model(model);
        Engine::with_runner(NeuralKernels::new(device, opts.clone()), opts)
    }

    /// With device buffers kept as `mode` says.
    pub fn buffers(mut self, mode: crate::device::DeviceBuffers) -> Self {
        self.runner = self.runner.with_buffers(mode);
        self
    }
}

impl<R: KernelRunner> Engine<R> {
    /// With activation checkpointing on or off (see [`Engine::grad_checkpoint`]).
    pub fn checkpointing(mut self, on: bool) -> Self {
        self.grad_checkpoint = on;
        self
    }

    /// Forward over `tokens` for its output alone (an evaluation, DPO's
    /// reference): it keeps each layer's input only, as a checkpointed
    /// forward does (the same values, bit for bit), never the activations
    /// a backward would read.
    pub fn forward_only(&mut self, model: &Model, tokens: &[u32]) -> Result<Forward> {
        let keep = std::mem::replace(&mut self.grad_checkpoint, true);
        let out = self.forward(model, tokens, None);
        self.grad_checkpoint = keep;
        out
    }

    /// Forward over `tokens` (one sequence), keeping what backward needs.
    /// With `dropout_key`, LoRA dropout draws its masks from it (training);
    /// `None` is no dropout (evaluation, generation).
    pub fn forward(
        &mut self,
        model: &Model,
        tokens: &[u32],
        dropout_key: Option<u64>,
    ) -> Result<Forward> {
        let cfg = &model.cfg;
        let (d, seq) = (cfg.hidden_size, tokens.len());
        if seq == 0 {
            bail!("cannot run the model on an empty sequence");
        }
        let shape = Shape::new(cfg, seq);
        let eps = cfg.rms_norm_eps as f32;
        // x[c, s] = m_e·E[token_s, c]
        let m_e = cfg.scales.embedding as f32;
        let emb = &model.params[model.embed];
        let mut x = vec![0f32; d * seq];
        let mut row = Vec::new();
        for (s, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= cfg.vocab_size {
                bail!(
                    "token id {t} at position {s} is outside the vocabulary ({} ids)",
                    cfg.vocab_size
                );
            }
            for (c, v) in emb.rows(t..t + 1, &mut row).iter().enumerate() {
                x[c * seq + s] = m_e * v;
            }
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let key = dropout_key.map(|k| k.wrapping_add(i as u64));
            let masks = dropout_masks(model, i, seq, key);
            let (acts, x_next) = self.layer_forward(model, i, &shape, x, masks)?;
            layers.push(match self.grad_checkpoint {
                true => Saved::Input(acts.x, acts.masks),
                false => Saved::Acts(Box::new(acts)),
            });
            x = x_next;
        }
        // The head's input: the final norm's output, over logits_scaling.
        let mut xf = maths::rms_norm(&x, &model.params[model.final_norm].data, d, seq, eps);
        scale_head_input(cfg, &mut xf);
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
        // Each layer class's RoPE tables (a NoPE class's are the identity).
        let ropes: Vec<_> = cfg
            .layer_classes()
            .into_iter()
            .map(|class| {
                let opts = KernelOptions {
                    class,
                    ..self.opts.clone()
                };
                (class, opts.rope_tables(seq, cfg.head_dim))
            })
            .collect();
        let mut scratch = Vec::new();
        // xf = rmsnorm(x)·w_final / s
        // (copied only when the model divides its logits: Granite)
        let dxf = match cfg.scales.logits == 1.0 {
            true => std::borrow::Cow::Borrowed(dxf),
            false => {
                let mut scaled = dxf.to_vec();
                scale_head_input(cfg, &mut scaled);
                std::borrow::Cow::Owned(scaled)
            }
        };
        let mut dx = maths::rms_norm_backward(
            &fwd.x_last,
            &model.params[model.final_norm].data,
            &dxf,
            d,
            seq,
            eps,
            base_grad(model, grads, model.final_norm, &mut scratch),
        );
        let shape = Shape::new(cfg, seq);
        // With LoRA nothing below the first adapted layer trains: the
        // backward stops there (mlx-lm's `num_layers`).
        let first = match &model.lora {
            Some(l) => l.cfg.first_layer(cfg.num_hidden_layers),
            None => 0,
        };
        for (i, (l, saved)) in model.layers.iter().zip(&fwd.layers).enumerate().rev() {
            if i < first {
                return Ok(());
            }
            let recomputed;
            let a = match saved {
                Saved::Acts(a) => a,
                Saved::Input(x, masks) => {
                    self.runner.recomputing(true);
                    let out = self.layer_forward(model, i, &shape, x.clone(), masks.clone());
                    self.runner.recomputing(false);
                    recomputed = out?.0;
                    &recomputed
                }
            };
            let class = cfg.layer_class(i);
            let rope = &ropes.iter().find(|(k, _)| *k == class).expect("a class").1;
            let c = LayerCtx {
                model,
                layer: i,
                ids: l,
                acts: a,
                shape,
                eps,
            };
            if !self.runner.overlaps_host() {
                let queue = GradQueue::Inline;
                self.layer_backward(&c, rope, &mut dx, grads, &mut scratch, &queue)?;
                continue;
            }
            // The layer's weight gradients on one worker thread, queued as
            // their upstream gradients appear, beside every kernel of the
            // layer's backward; joined when the layer ends (its
            // activations, which they read, are dropped then).
            let ids = projection_grad_ids(model, i);
            let mut theirs = grads.take(&ids);
            std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel::<GradJob>();
                let worker = s.spawn(move || {
                    for job in rx {
                        job(&mut theirs);
                    }
                    theirs
                });
                let queue = GradQueue::Worker(tx);
                let out = self.layer_backward(&c, rope, &mut dx, grads, &mut scratch, &queue);
                drop(queue);
                match worker.join() {
                    Ok(theirs) => grads.put_back(theirs, &ids),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
                out
            })?;
        }
        if model.lora.is_some() {
            return Ok(()); // the embedding is frozen
        }
        // x[c, s] = m_e·E[token_s, c]; the padding token's row takes no
        // gradient from the lookup (torch's `nn.Embedding(padding_idx)`,
        // which every family's embedding is built with).
        let m_e = cfg.scales.embedding as f32;
        let pad = cfg.padding_idx();
        let de = grads.accumulator(model.embed);
        for (s, &t) in fwd.tokens.iter().enumerate() {
            if Some(t) == pad {
                continue;
            }
            for c in 0..d {
                de[t as usize * d + c] += m_e * dx[c * seq + s];
            }
        }
        Ok(())
    }

    /// One layer's backward, `dx` from its output to its input: its parts
    /// in reverse, each sublayer's norm backward after the sublayer's.
    ///   pre-norm:  dx2 = dx' + rmsnorm'(mlp'(α·dx')),  dx = dx2 + rmsnorm'(mixer'(α·dx2))
    fn layer_backward<'q>(
        &mut self,
        c: &'q LayerCtx<'q>,
        rope: &(Vec<f32>, Vec<f32>),
        dx: &mut [f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
        queue: &GradQueue<'q>,
    ) -> Result<()> {
        let (a, spec) = (c.acts, self.opts.layer);
        let dmlp = c.through_post_norm(dx, &a.mlp_out, c.ids.post_norms[1], grads, scratch);
        let dx2n = self.mlp_backward(&spec, c, &dmlp, grads, queue)?;
        let dnorm = c.norm_backward(&a.x2, c.ids.mlp_norm, dx2n, grads, scratch);
        add_scaled(dx, &dnorm, 1.0);
        let dmix = c.through_post_norm(dx, &a.mixer_out, c.ids.post_norms[0], grads, scratch);
        let dxn = self.mixer_backward(&spec, c, rope, &dmix, grads, scratch, queue)?;
        let dnorm = c.norm_backward(&a.x, c.ids.mixer_norm, dxn, grads, scratch);
        add_scaled(dx, &dnorm, 1.0);
        Ok(())
    }

    /// The MLP's backward: the gradient of its normed input from the
    /// layer's output gradient `dx`.
    ///   SwiGLU:  dgate = W_downᵀ·α·dx',  dh1, dh3 = swiglu'(dgate),  dx2n = W_gateᵀ·dh1 + W_upᵀ·dh3
    /// Each group of weight gradients goes to `queue` as soon as its
    /// upstream gradient exists, before the kernel that needs the same
    /// gradient (on a device, the worker runs it beside the kernels).
    fn mlp_backward<'q>(
        &mut self,
        spec: &LayerSpec,
        c: &'q LayerCtx<'q>,
        dx: &[f32],
        grads: &mut Grads,
        queue: &GradQueue<'q>,
    ) -> Result<Vec<f32>> {
        let alpha = self.opts.residual_scale as f32;
        match (spec.mlp, &c.acts.mlp) {
            (mlp @ (Mlp::SwiGlu | Mlp::GeGlu), MlpActs::Glu { h1, h3, gate }) => {
                let dffn: Arc<Vec<f32>> = Arc::new(dx.iter().map(|v| alpha * v).collect());
                let dy = dffn.clone();
                queue.push(grads, move |g| {
                    c.grad(g, Projection::Down, &dy, &gate.get())
                });
                let acts = kernels::ffn_backward_w2::Acts { dffn: &dffn };
                let dgate = self.run::<kernels::FfnBackwardW2>(c, &acts)?.dgate;
                let (dh1, dh3) = match mlp {
                    Mlp::SwiGlu => maths::swiglu_backward(&h1.get(), &h3.get(), &dgate),
                    Mlp::GeGlu => maths::geglu_backward(&h1.get(), &h3.get(), &dgate),
                };
                let (dh1, dh3) = (Arc::new(dh1), Arc::new(dh3));
                let (dy1, dy3) = (dh1.clone(), dh3.clone());
                queue.push(grads, move |g| {
                    c.grad(g, Projection::Gate, &dy1, &c.acts.x2n);
                    c.grad(g, Projection::Up, &dy3, &c.acts.x2n);
                });
                let acts = kernels::ffn_backward_w13::Acts {
                    dh1: &dh1,
                    dh3: &dh3,
                };
                Ok(self.run::<kernels::FfnBackwardW13>(c, &acts)?.dx)
            }
        }
    }

    /// The token mixer's backward: the gradient of its normed input from
    /// the sublayer's output gradient `dx` (at `x2`).
    ///   attention:  da = Woᵀ·α·dx2 → dq, dk, dv (device kernels) → unrope, QK-norm'
    ///               dxn = Wqᵀ·dq + Wkᵀ·dk + Wvᵀ·dv
    #[allow(clippy::too_many_arguments)]
    fn mixer_backward<'q>(
        &mut self,
        spec: &LayerSpec,
        c: &'q LayerCtx<'q>,
        (cos, sin): &(Vec<f32>, Vec<f32>),
        dx: &[f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
        queue: &GradQueue<'q>,
    ) -> Result<Vec<f32>> {
        let (hd, seq) = (c.shape.head_dim, c.shape.seq);
        let alpha = self.opts.residual_scale as f32;
        match (spec.mixer, &c.acts.mixer) {
            (
                Mixer::Attention { .. },
                MixerActs::Attention {
                    attn,
                    q_rope,
                    k_rope,
                    v,
                    q_raw,
                    k_raw,
                },
            ) => {
                let dout: Arc<Vec<f32>> = Arc::new(dx.iter().map(|v| alpha * v).collect());
                let dy = dout.clone();
                queue.push(grads, move |g| c.grad(g, Projection::O, &dy, &attn.get()));
                let acts = kernels::wo_backward::Acts { dy: &dout };
                let da = self.run::<kernels::WoBackward>(c, &acts)?.da;
                let (q_rope, k_rope) = (q_rope.get(), k_rope.get());
                let g = self.runner.attention_backward(
                    c.model,
                    c.layer,
                    &c.shape,
                    &c.acts.masks,
                    &kernels::sdpa_backward1::Acts {
                        q_rope: &q_rope,
                        k_rope: &k_rope,
                        v: &v.get(),
                        da: &da,
                        // Made per tile by the device runner for blocks of queries.
                        mask: None,
                    },
                )?;
                // RoPE is a rotation: its backward is the inverse rotation.
                let unrope =
                    |g: &[f32]| maths::apply_rope(g, hd, seq, cos, sin, self.opts.rope, -1.0);
                let (mut dq, mut dk) = (unrope(&g.dq), unrope(&g.dk));
                let dv = g.dv;
                // QK-norm over each head (a weight [HD]) or the whole
                // projection (a weight [heads·HD]): groups of the weight's width.
                if let (Some(qn), Some(kn)) = (c.ids.q_norm, c.ids.k_norm) {
                    let (w, eps) = (|id: usize| c.model.params[id].data.as_slice(), c.eps);
                    let (wq, wk) = (w(qn), w(kn));
                    let gq = base_grad(c.model, grads, qn, scratch);
                    dq = maths::rms_norm_backward(&q_raw.get(), wq, &dq, wq.len(), seq, eps, gq);
                    let gk = base_grad(c.model, grads, kn, scratch);
                    dk = maths::rms_norm_backward(&k_raw.get(), wk, &dk, wk.len(), seq, eps, gk);
                }
                // y = W·x + b: db = Σ_s dy (a frozen base's biases stay).
                if c.model.lora.is_none() {
                    let pairs = [
                        (Projection::Q, &dq),
                        (Projection::K, &dk),
                        (Projection::V, &dv),
                    ];
                    for (p, dy) in pairs {
                        if let Some(id) = c.ids.biases[p.index()] {
                            let db = grads.accumulator(id);
                            for (g, row) in db.iter_mut().zip(dy.chunks(seq)) {
                                *g += row.iter().sum::<f32>();
                            }
                        }
                    }
                }
                let (dq, dk, dv) = (Arc::new(dq), Arc::new(dk), Arc::new(dv));
                let (gq, gk, gv) = (dq.clone(), dk.clone(), dv.clone());
                queue.push(grads, move |g| {
                    c.grad(g, Projection::Q, &gq, &c.acts.xn);
                    c.grad(g, Projection::K, &gk, &c.acts.xn);
                    c.grad(g, Projection::V, &gv, &c.acts.xn);
                });
                let mut dxn = self
                    .run::<kernels::QBackward>(c, &kernels::q_backward::Acts { dq: &dq })?
                    .dx;
                let acts = kernels::kv_backward::Acts { dk: &dk, dv: &dv };
                let dxkv = self.run::<kernels::KvBackward>(c, &acts)?.dx;
                add_scaled(&mut dxn, &dxkv, 1.0);
                Ok(dxn)
            }
        }
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

    /// The gradient of a sublayer's output `out` from `dx`, the gradient
    /// after the residual add: through the norm after the sublayer where
    /// it has one (Gemma), else `dx` itself (no copy).
    fn through_post_norm<'d>(
        &self,
        dx: &'d [f32],
        out: &[f32],
        norm: Option<usize>,
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
    ) -> std::borrow::Cow<'d, [f32]> {
        match norm {
            Some(v) => self.rms_backward(out, v, dx, grads, scratch).into(),
            None => dx.into(),
        }
    }

    /// The gradient of a sublayer's input `x` from that of its normed
    /// input `dy`, through the norm before it where the layer has one.
    fn norm_backward(
        &self,
        x: &[f32],
        norm: Option<usize>,
        dy: Vec<f32>,
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
    ) -> Vec<f32> {
        match norm {
            Some(norm) => self.rms_backward(x, norm, &dy, grads, scratch),
            None => dy,
        }
    }

    /// Backward of `rmsnorm(x)·w` (w = parameter `norm`) for `dy`; the
    /// weight's gradient accumulates into `grads`.
    fn rms_backward(
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
        maths::rms_norm_backward(x, w, dy, d, seq, self.eps, g)
    }
}

/// The LM head reads the final norm's output divided by the model's
/// `logits_scaling` (Granite's; 1 elsewhere, an exact no-op): logits
/// = W·(x_f/s) = (W·x_f)/s, and the same factor on its gradient.
pub(crate) fn scale_head_input(cfg: &crate::model::config::ModelConfig, x: &mut [f32]) {
    let inv = (1.0 / cfg.scales.logits) as f32;
    if inv != 1.0 {
        x.iter_mut().for_each(|v| *v *= inv);
    }
}
