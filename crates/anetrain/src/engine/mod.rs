//! The transformer, forward and backward, over the kernel contract: the
//! matmul-heavy work goes through a [`KernelRunner`] (the CPU twins, or the
//! programs on a Neural Engine device), the rest — embedding, RMSNorm, residuals, RoPE and
//! QK-norm backward, cross-entropy, weight gradients — runs on the CPU.
//! Activations are channel-first `[C, S]` per sequence.
//!
//! One layer, forward (α is the residual scale, 1 for HF models):
//!   xn = rmsnorm(x)·w_attn;  attn, q, k, v = sdpa_forward(xn);  x2 = x + α·Wo·attn
//!   x2n = rmsnorm(x2)·w_ffn;  x' = x2 + α·W2(silu(W1 x2n)·W3 x2n)
//! and backward runs the same list in reverse, each piece beside its maths.

pub mod generate;
pub mod grads;

use std::sync::Arc;

use anyhow::{bail, Result};
use linalg::{matmul, MatMut, MatRef};

use crate::device::{CpuKernels, Dropout, KernelRunner, NeuralKernels};
pub use crate::engine::grads::{zero_grads, Grads};
use crate::kernels::{self, maths, KernelOptions, Shape};
use crate::model::{LayerIds, Model, Projection};
use crate::util::rng::Rng;

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

/// A group of weight gradients of one layer's backward.
type GradJob<'q> = Box<dyn FnOnce(&mut Grads) + Send + 'q>;

/// Where a layer's weight gradients run: at once, on this thread (the
/// CPU engine, whose kernels use every core), or queued for the worker
/// thread that computes them beside a device's kernels, in order.
enum GradQueue<'q> {
    Inline,
    Worker(std::sync::mpsc::Sender<GradJob<'q>>),
}

impl<'q> GradQueue<'q> {
    /// Runs `job` on `grads` now, or queues it for the worker (which
    /// holds the layer's projection gradients, see [`Grads::take`]).
    fn push(&self, grads: &mut Grads, job: impl FnOnce(&mut Grads) + Send + 'q) {
        match self {
            GradQueue::Inline => job(grads),
            GradQueue::Worker(tx) => {
                // The worker only stops when the queue is dropped or a
                // job panics; the panic is resumed where it is joined.
                let _ = tx.send(Box::new(job));
            }
        }
    }
}

/// The gradients a layer's weight-gradient jobs write: every projection's
/// weight, or with LoRA its adapters.
fn projection_grad_ids(model: &Model, layer: usize) -> Vec<usize> {
    match &model.lora {
        None => Projection::ALL
            .iter()
            .map(|t| t.base(&model.layers[layer]))
            .collect(),
        Some(l) => l.slots[layer]
            .iter()
            .flatten()
            .flat_map(|ids| [ids.a, ids.b])
            .collect(),
    }
}

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
/// f32, the kernels' outputs [`Kept`].
struct LayerActs {
    x: Vec<f32>,
    xn: Vec<f32>,
    attn: Kept,
    q_rope: Kept,
    k_rope: Kept,
    v: Kept,
    q_raw: Kept,
    k_raw: Kept,
    x2: Vec<f32>,
    x2n: Vec<f32>,
    h1: Kept,
    h3: Kept,
    gate: Kept,
    /// LoRA dropout masks per projection, when training with dropout.
    masks: Dropout,
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
        // x[c, s] = E[token_s, c]
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
                x[c * seq + s] = *v;
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
        let xf = maths::head_rms_norm(&x, &model.params[model.final_norm].data, d, seq, eps);
        Ok(Forward {
            tokens: tokens.to_vec(),
            layers,
            x_last: x,
            xf,
        })
    }

    /// One layer's forward from its input `x`: what its backward needs, and
    /// the layer's output.
    fn layer_forward(
        &mut self,
        model: &Model,
        i: usize,
        shape: &Shape,
        x: Vec<f32>,
        masks: Dropout,
    ) -> Result<(LayerActs, Vec<f32>)> {
        let (d, seq) = (shape.dim, shape.seq);
        let eps = model.cfg.rms_norm_eps as f32;
        let alpha = self.opts.residual_scale as f32;
        let l = &model.layers[i];
        let w = |id: usize| model.params[id].data.as_slice();
        let xn = maths::head_rms_norm(&x, w(l.attn_norm), d, seq, eps);
        let a = self.runner.run::<kernels::SdpaForward>(
            model,
            i,
            shape,
            &masks,
            &kernels::sdpa_forward::Acts {
                xnorm: &xn,
                // A block of queries reads its columns too; its angles and
                // mask the device runner makes per tile.
                xnorm_block: Some(&xn),
                rope_cos: None,
                rope_sin: None,
                mask: None,
            },
        )?;
        let o = self.runner.run::<kernels::WoForward>(
            model,
            i,
            shape,
            &masks,
            &kernels::wo_forward::Acts { attn: &a.attn },
        )?;
        let mut x2 = x.clone();
        add_scaled(&mut x2, &o.o, alpha);
        let x2n = maths::head_rms_norm(&x2, w(l.ffn_norm), d, seq, eps);
        let f = self.runner.run::<kernels::FfnForward>(
            model,
            i,
            shape,
            &masks,
            &kernels::ffn_forward::Acts {
                x2norm: &x2n,
                x2: &x2,
            },
        )?;
        let acts = LayerActs {
            x,
            xn,
            attn: Kept::new(a.attn),
            q_rope: Kept::new(a.q_rope),
            k_rope: Kept::new(a.k_rope),
            v: Kept::new(a.v),
            q_raw: Kept::new(a.q_raw.unwrap_or_default()),
            k_raw: Kept::new(a.k_raw.unwrap_or_default()),
            x2,
            x2n,
            h1: Kept::new(f.h1),
            h3: Kept::new(f.h3),
            gate: Kept::new(f.gate),
            masks,
        };
        Ok((acts, f.x_next))
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
        let shape = Shape::new(cfg, seq);
        for (i, (l, saved)) in model.layers.iter().zip(&fwd.layers).enumerate().rev() {
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
                self.ffn_backward(&c, &mut dx, grads, &mut scratch, &queue)?;
                self.attention_backward(&c, &rope, &mut dx, grads, &mut scratch, &queue)?;
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
                let mut layer = || -> Result<()> {
                    self.ffn_backward(&c, &mut dx, grads, &mut scratch, &queue)?;
                    self.attention_backward(&c, &rope, &mut dx, grads, &mut scratch, &queue)
                };
                let out = layer();
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
    /// Each group of weight gradients goes to `queue` as soon as its
    /// upstream gradient exists, before the kernel that needs the same
    /// gradient (on a device, the worker runs it beside the kernels).
    fn ffn_backward<'q>(
        &mut self,
        c: &'q LayerCtx<'q>,
        dx: &mut [f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
        queue: &GradQueue<'q>,
    ) -> Result<()> {
        let a = c.acts;
        let alpha = self.opts.residual_scale as f32;
        let dffn: Arc<Vec<f32>> = Arc::new(dx.iter().map(|v| alpha * v).collect());
        let dy = dffn.clone();
        queue.push(grads, move |g| {
            c.grad(g, Projection::Down, &dy, &c.acts.gate.get())
        });
        let acts = kernels::ffn_backward_w2::Acts { dffn: &dffn };
        let dgate = self.run::<kernels::FfnBackwardW2>(c, &acts)?.dgate;
        let (dh1, dh3) = maths::swiglu_backward(&a.h1.get(), &a.h3.get(), &dgate);
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
        let dx2n = self.run::<kernels::FfnBackwardW13>(c, &acts)?.dx;
        let dnorm = c.norm_backward(&a.x2, c.ids.ffn_norm, &dx2n, grads, scratch);
        add_scaled(dx, &dnorm, 1.0);
        Ok(())
    }

    /// The attention block backward, `dx` from the block's output to its
    /// input:
    ///   x2 = x + α·Wo·attn(q, k, v),  q = rope(qknorm(Wq·xn)), … ,  xn = rmsnorm(x)·w_attn
    ///   da = Woᵀ·α·dx2 → dq, dk, dv (two device kernels) → unrope, QK-norm'
    ///   dx = dx2 + rmsnorm'(Wqᵀ·dq + Wkᵀ·dk + Wvᵀ·dv)
    fn attention_backward<'q>(
        &mut self,
        c: &'q LayerCtx<'q>,
        (cos, sin): &(Vec<f32>, Vec<f32>),
        dx: &mut [f32],
        grads: &mut Grads,
        scratch: &mut Vec<f32>,
        queue: &GradQueue<'q>,
    ) -> Result<()> {
        let a = c.acts;
        let (hd, seq) = (c.shape.head_dim, c.shape.seq);
        let alpha = self.opts.residual_scale as f32;
        let dout: Arc<Vec<f32>> = Arc::new(dx.iter().map(|v| alpha * v).collect());
        let dy = dout.clone();
        queue.push(grads, move |g| {
            c.grad(g, Projection::O, &dy, &c.acts.attn.get())
        });
        let acts = kernels::wo_backward::Acts { dy: &dout };
        let da = self.run::<kernels::WoBackward>(c, &acts)?.da;
        let (q_rope, k_rope) = (a.q_rope.get(), a.k_rope.get());
        let g = self.runner.attention_backward(
            c.model,
            c.layer,
            &c.shape,
            &c.acts.masks,
            &kernels::sdpa_backward1::Acts {
                q_rope: &q_rope,
                k_rope: &k_rope,
                v: &a.v.get(),
                da: &da,
                // Made per tile by the device runner for blocks of queries.
                mask: None,
            },
        )?;
        // RoPE is a rotation: its backward is the inverse rotation.
        let unrope = |g: &[f32]| maths::apply_rope(g, hd, seq, cos, sin, self.opts.rope, -1.0);
        let (mut dq, mut dk) = (unrope(&g.dq), unrope(&g.dk));
        let dv = g.dv;
        if let (Some(qn), Some(kn)) = (c.ids.q_norm, c.ids.k_norm) {
            let (w, eps) = (|id: usize| c.model.params[id].data.as_slice(), c.eps);
            let gq = base_grad(c.model, grads, qn, scratch);
            dq = maths::head_rms_norm_backward(&a.q_raw.get(), w(qn), &dq, hd, seq, eps, gq);
            let gk = base_grad(c.model, grads, kn, scratch);
            dk = maths::head_rms_norm_backward(&a.k_raw.get(), w(kn), &dk, hd, seq, eps, gk);
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

/// Rows of a block [`column_max`] and [`exp_shifted`] hand to one thread.
const BLOCK_ROWS: usize = 512;

/// The softmax statistics of the LM head's logits per position: the
/// running maximum m_s, Σ_v exp(z_vs − m_s) and the target's logit.
struct SoftmaxStats {
    max: Vec<f32>,
    sum: Vec<f64>,
    target_logit: Vec<f32>,
}

impl SoftmaxStats {
    /// m_s + ln Σ_s − z_{t_s,s} of every position s.
    fn nll(&self) -> Vec<f64> {
        (0..self.max.len())
            .map(|s| self.max[s] as f64 + self.sum[s].ln() - self.target_logit[s] as f64)
            .collect()
    }
}

/// [`Engine::head_statistics`] of one sequence, kept for its
/// [`Engine::head_backward`].
pub struct HeadStatistics {
    /// −log p of each position's target.
    pub nll: Vec<f64>,
    stats: SoftmaxStats,
    ranges: Vec<std::ops::Range<usize>>,
    /// The last chunk's exp(z − m), which a one-chunk vocabulary reuses.
    last: Vec<f32>,
    /// A frozen head's input gradient gathered beside the statistics
    /// (see [`FrozenHeadGradient`]), when a gradient was asked for over
    /// several chunks.
    frozen: Option<FrozenHeadGradient>,
}

/// The input gradient of a frozen LM head (LoRA), gathered in the
/// statistics pass, so each chunk's logits are computed once, not twice:
///   u_s = Σ_v exp(z_vs − m_s)·E_v  (rescaled by exp(m_old − m_new) as m_s grows)
///   dxf_s = w_s·(u_s/Σ_s − E_{t_s})  once the weights w_s are known
/// A head that trains needs each chunk's normalised gradient for its own
/// weight gradient dE_c = dz_c·xfᵀ, so it keeps the second pass.
struct FrozenHeadGradient {
    /// u, `[D, S]`.
    u: Vec<f32>,
}

/// Whether the LM head's weights train (they are frozen under LoRA).
fn head_trains(model: &Model) -> bool {
    model.lora.is_none()
}

/// What the head's gradient pass reads.
struct GradientPass<'a> {
    xf: &'a [f32],
    targets: &'a [u32],
    /// The gradient's weight on each position's −log p.
    weights: &'a [f32],
    ranges: &'a [std::ops::Range<usize>],
    stats: &'a SoftmaxStats,
}

/// Column maxima of `lt [rows, S]`.
fn column_max(lt: &[f32], seq: usize) -> Vec<f32> {
    use rayon::prelude::*;
    lt.par_chunks(BLOCK_ROWS * seq)
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
        )
}

/// `lt [rows, S]` ← exp(lt − max) per column, in place; returns the column
/// sums (f64, per-block sums added in block order, so the result does not
/// depend on the thread count). One exp per logit.
fn exp_shifted(lt: &mut [f32], max: &[f32], seq: usize) -> Vec<f64> {
    use rayon::prelude::*;
    let partial: Vec<Vec<f64>> = lt
        .par_chunks_mut(BLOCK_ROWS * seq)
        .map(|b| {
            let mut sum = vec![0f64; seq];
            for row in b.chunks_mut(seq) {
                crate::util::simd::exp_shifted_accumulate(row, max, &mut sum);
            }
            sum
        })
        .collect();
    let mut sum = vec![0f64; seq];
    for p in &partial {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sum
}

/// `lt [rows, S]` ← lt·scale per column, in place.
fn scale_columns(lt: &mut [f32], scale: &[f32], seq: usize) {
    use rayon::prelude::*;
    lt.par_chunks_mut(BLOCK_ROWS * seq).for_each(|b| {
        for row in b.chunks_mut(seq) {
            row.iter_mut().zip(scale).for_each(|(z, c)| *z *= c);
        }
    });
}

/// dxf `[D, S]` of a frozen head from its gathered u (see
/// [`FrozenHeadGradient`]): w_s·(u_s/Σ_s − E_{t_s}), the target's row in f32.
fn frozen_head_input_gradient(
    model: &Model,
    f: &FrozenHeadGradient,
    stats: &SoftmaxStats,
    targets: &[u32],
    weights: &[f32],
) -> Vec<f32> {
    let (d, seq) = (model.cfg.hidden_size, targets.len());
    let head = model.lm_head_param();
    let mut dxf = vec![0f32; d * seq];
    let mut scratch = Vec::new();
    for (s, (&t, &w)) in targets.iter().zip(weights).enumerate() {
        if w == 0.0 {
            continue;
        }
        let row = head.rows(t as usize..t as usize + 1, &mut scratch);
        let inv = 1.0 / stats.sum[s];
        for (c, &e) in row.iter().enumerate() {
            let p = (f.u[c * seq + s] as f64 * inv) as f32;
            dxf[c * seq + s] = w * (p - e);
        }
    }
    dxf
}

/// The power of two the logits' gradient is sent to the head's backward
/// kernel in, as `2ᵏ·(softmax − one-hot)` per counted position instead of
/// `grad_scale·(…)`: with `grad_scale = 1/targets` most probabilities
/// would be fp16 zeros (below 6e-8), the scaled ones keep 11 bits down to
/// 2⁻²⁴/2ᵏ. Every output of the product is bounded by
/// `max|E|·Σ_v|dz_v| ≤ 2ᵏ·2·max|E|`: 2ᵏ is the largest power of two (at
/// most 2¹⁴, so dz fits fp16) keeping that bound at 16384, half the
/// matmul output cliff of 32752 (ANEForge docs/numeric-cliffs.md, "Matmul
/// output saturation": "Scale activations or weights before the matmul
/// and undo the scale afterwards"). Powers of two scale exactly.
pub fn head_grad_scale(head_max_abs: f32) -> f32 {
    let mut k = 16384f32; // 2¹⁴
    while k > 1.0 && 2.0 * k * head_max_abs > 16384.0 {
        k /= 2.0;
    }
    k
}

/// The largest |value| of the LM head, read a block of rows at a time.
fn head_max_abs(model: &Model) -> f32 {
    let head = model.lm_head_param();
    let (rows, mut scratch) = (head.shape[0], Vec::new());
    (0..rows)
        .step_by(4096)
        .map(|r| {
            let block = head.rows(r..(r + 4096).min(rows), &mut scratch);
            block.iter().fold(0f32, |m, x| m.max(x.abs()))
        })
        .fold(0f32, f32::max)
}

impl<R: KernelRunner> Engine<R> {
    /// One vocabulary chunk's logits `z_c = E_c·xf`, `[rows, S]`.
    fn head_chunk(&mut self, model: &Model, xf: &[f32], c: usize, rows: usize) -> Result<Vec<f32>> {
        let seq = xf.len() / model.cfg.hidden_size;
        let shape = Shape::new(&model.cfg, seq).head_chunk(rows);
        let acts = kernels::head_forward::Acts { xf };
        let out = self.runner.run::<kernels::HeadForward>(
            model,
            c,
            &shape,
            &Default::default(),
            &acts,
        )?;
        Ok(out.logits)
    }

    /// Logits `[S, V]` for a final-normed state `xf [D, S]`, chunk by chunk
    /// (tests and `anetrain logits`; training never holds them whole).
    pub fn logits(&mut self, model: &Model, xf: &[f32]) -> Result<Vec<f32>> {
        let (d, v) = (model.cfg.hidden_size, model.cfg.vocab_size);
        let seq = xf.len() / d;
        let chunks = self.runner.head_chunks(model, seq)?;
        let mut out = vec![0f32; seq * v];
        for c in 0..chunks.chunks {
            let r = chunks.range(c, v);
            let z = self.head_chunk(model, xf, c, r.len())?;
            for (i, row) in z.chunks(seq).enumerate() {
                for (s, &x) in row.iter().enumerate() {
                    out[s * v + r.start + i] = x;
                }
            }
        }
        Ok(out)
    }

    /// The logits `[V]` at the last position of `xf [D, S]` (generation):
    /// the head runs on that position alone.
    pub fn last_logits(&mut self, model: &Model, xf: &[f32]) -> Result<Vec<f32>> {
        let d = model.cfg.hidden_size;
        let seq = xf.len() / d;
        let last: Vec<f32> = (0..d).map(|c| xf[c * seq + seq - 1]).collect();
        self.logits(model, &last)
    }

    /// Cross-entropy summed over the targets `first..` of one sequence
    /// (the others, a masked prompt, add nothing and get zero gradient),
    /// and with `grads` the gradient of `grad_scale · loss` into the LM
    /// head (unless LoRA freezes it) and the returned `dxf`: the SFT loss,
    /// [`Engine::head_statistics`] then [`Engine::head_backward`] with one
    /// weight on the counted positions.
    pub fn head_loss(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        first: usize,
        grad_scale: f32,
        grads: Option<&mut Grads>,
    ) -> Result<(f64, Vec<f32>)> {
        let head = self.head_statistics(model, xf, targets, grads.is_some())?;
        let loss = head.nll[first..].iter().sum();
        let Some(grads) = grads else {
            return Ok((loss, vec![]));
        };
        let weights: Vec<f32> = (0..targets.len())
            .map(|s| if s < first { 0.0 } else { grad_scale })
            .collect();
        let dxf = self.head_backward(model, xf, targets, head, &weights, grads)?;
        Ok((loss, dxf))
    }

    /// The LM head over one sequence: −log p of each target, per position.
    /// The head runs in the runner's vocabulary chunks (on a device, its
    /// kernels), the statistics on the host in f32/f64; per position s,
    /// with z = E·xf (`[Vc, S]` a chunk):
    ///   nll_s = m_s + ln Σ_v exp(z_vs − m_s) − z_{t_s,s},   m_s, Σ kept running
    /// With `gradient` (an [`Engine::head_backward`] follows) and a frozen
    /// head over several chunks, the input gradient is gathered in the
    /// same pass ([`FrozenHeadGradient`]).
    pub fn head_statistics(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        gradient: bool,
    ) -> Result<HeadStatistics> {
        let v = model.cfg.vocab_size;
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
            bail!("target token id {t} is outside the vocabulary ({v} ids)");
        }
        let chunks = self.runner.head_chunks(model, targets.len())?;
        let ranges: Vec<_> = (0..chunks.chunks).map(|c| chunks.range(c, v)).collect();
        let gather = gradient && ranges.len() > 1 && !head_trains(model);
        let (stats, last, frozen) = self.softmax_statistics(model, xf, targets, &ranges, gather)?;
        Ok(HeadStatistics {
            nll: stats.nll(),
            stats,
            ranges,
            last,
            frozen,
        })
    }

    /// The gradient of Σ_s w_s·nll_s (`weights` per position, of one sign
    /// or zero) into the LM head (unless LoRA freezes it) and the returned
    /// `dxf`, from [`Engine::head_statistics`] of the same sequence:
    ///   dz_vs = w_s·(exp(z_vs − m_s)/Σ_s − [v = t_s]),  dxf = Σ_c E_cᵀ·dz_c,  dE_c = dz_c·xfᵀ
    /// Over several chunks, a head that trains computes each chunk's
    /// logits twice (once for the statistics, once for the gradient): one
    /// more head forward per sequence, where keeping them would hold the
    /// whole `[V, S]`; a frozen head's dxf was gathered with the
    /// statistics ([`FrozenHeadGradient`]) and is only finished here.
    pub fn head_backward(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        head: HeadStatistics,
        weights: &[f32],
        grads: &mut Grads,
    ) -> Result<Vec<f32>> {
        if let Some(f) = &head.frozen {
            return Ok(frozen_head_input_gradient(
                model,
                f,
                &head.stats,
                targets,
                weights,
            ));
        }
        let pass = GradientPass {
            xf,
            targets,
            weights,
            ranges: &head.ranges,
            stats: &head.stats,
        };
        self.head_gradient(model, &pass, head.last, grads)
    }

    /// Pass 1 of [`Engine::head_statistics`]: the softmax statistics, chunk by
    /// chunk; also the last chunk's exp(z − m), which a one-chunk
    /// vocabulary reuses in pass 2; with `gather`, a frozen head's input
    /// gradient u ([`FrozenHeadGradient`]): each chunk's exp(z_c − m) is
    /// sent to the head's backward kernel as 2ᵏ·exp(z_c − m)/Σ_c (its
    /// columns sum to 2ᵏ, the bound of [`head_grad_scale`]) and the
    /// product scaled back by Σ_c/2ᵏ on the host.
    fn softmax_statistics(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        ranges: &[std::ops::Range<usize>],
        gather: bool,
    ) -> Result<(SoftmaxStats, Vec<f32>, Option<FrozenHeadGradient>)> {
        let seq = targets.len();
        let mut st = SoftmaxStats {
            max: vec![f32::NEG_INFINITY; seq],
            sum: vec![0f64; seq],
            target_logit: vec![0f32; seq],
        };
        let d = model.cfg.hidden_size;
        let k = match gather {
            true => head_grad_scale(self.head_max_abs(model)),
            false => 1.0,
        };
        let mut frozen = gather.then(|| FrozenHeadGradient {
            u: vec![0f32; d * seq],
        });
        let shape = Shape::new(&model.cfg, seq);
        let mut lt = Vec::new();
        for (c, r) in ranges.iter().enumerate() {
            lt = self.head_chunk(model, xf, c, r.len())?;
            for (s, &t) in targets.iter().enumerate() {
                if r.contains(&(t as usize)) {
                    st.target_logit[s] = lt[(t as usize - r.start) * seq + s];
                }
            }
            let chunk_max = column_max(&lt, seq);
            let mut rescale = vec![1f32; seq];
            for (s, &cm) in chunk_max.iter().enumerate() {
                if cm > st.max[s] {
                    let f = ((st.max[s] - cm) as f64).exp();
                    st.sum[s] *= f;
                    rescale[s] = f as f32;
                    st.max[s] = cm;
                }
            }
            let part = exp_shifted(&mut lt, &st.max, seq);
            st.sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            if let Some(f) = frozen.as_mut() {
                let to_device: Vec<f32> = part
                    .iter()
                    .map(|&p| if p > 0.0 { (k as f64 / p) as f32 } else { 0.0 })
                    .collect();
                scale_columns(&mut lt, &to_device, seq);
                let acts = kernels::head_backward::Acts { dlogits: &lt };
                let shape = shape.head_chunk(r.len());
                let out = self.runner.run::<kernels::HeadBackward>(
                    model,
                    c,
                    &shape,
                    &Default::default(),
                    &acts,
                )?;
                // u_s ← u_s·exp(m_old − m_new) + (Σ_c/2ᵏ)·E_cᵀ·dz_c
                let back: Vec<f32> = part.iter().map(|&p| (p / k as f64) as f32).collect();
                for (u, o) in f.u.chunks_mut(seq).zip(out.dxf.chunks(seq)) {
                    for s in 0..seq {
                        u[s] = u[s] * rescale[s] + o[s] * back[s];
                    }
                }
            }
        }
        Ok((st, lt, frozen))
    }

    /// Pass 2, [`Engine::head_backward`]: the gradient, chunk by chunk (the
    /// one chunk of a small vocabulary still holds exp(z − m) from pass 1,
    /// given as `last`), sent as 2ᵏ·(p − one-hot) and scaled back by
    /// g/2ᵏ after the product (g the largest weight); the head's gradient on the host's
    /// worker beside the device. Returns dxf.
    fn head_gradient(
        &mut self,
        model: &Model,
        p: &GradientPass,
        mut lt: Vec<f32>,
        grads: &mut Grads,
    ) -> Result<Vec<f32>> {
        let (d, seq) = (model.cfg.hidden_size, p.targets.len());
        let k = head_grad_scale(self.head_max_abs(model));
        // The weights as g·r_s with g the largest |w_s| and |r_s| ≤ 1, so
        // the bound of `head_grad_scale` holds; one weight gives r_s = 1
        // exactly.
        let g = p.weights.iter().fold(0f32, |m, w| m.max(w.abs()));
        let relative: Vec<f32> = p
            .weights
            .iter()
            .map(|&w| if g > 0.0 { w / g } else { 0.0 })
            .collect();
        let undo = g / k;
        let scale: Vec<f32> = (0..seq)
            .map(|s| (k as f64 * relative[s] as f64 / p.stats.sum[s]) as f32)
            .collect();
        let xf_undone: Vec<f32> = p.xf.iter().map(|x| x * undo).collect();
        // The head's gradient buffer, written (or accumulated into, after
        // an earlier sequence) chunk by chunk; frozen with LoRA.
        let head_id = model.lm_head_id();
        let mut dhead = model.lora.is_none().then(|| grads.product_target(head_id));
        let overlap = self.runner.overlaps_host();
        let mut dxf = vec![0f32; d * seq];
        let shape = Shape::new(&model.cfg, seq);
        for (c, r) in p.ranges.iter().enumerate() {
            if p.ranges.len() > 1 {
                lt = self.head_chunk(model, p.xf, c, r.len())?;
                exp_shifted(&mut lt, &p.stats.max, seq);
            }
            scale_columns(&mut lt, &scale, seq);
            for (s, &t) in p.targets.iter().enumerate() {
                if r.contains(&(t as usize)) && relative[s] != 0.0 {
                    lt[(t as usize - r.start) * seq + s] -= k * relative[s];
                }
            }
            let dz = &lt;
            // dE_c [Vc, D] (+)= dz_c [Vc, S] · (undo·xf)ᵀ [S, D], on the
            // host's worker beside the device.
            let x = &xf_undone;
            let dh = dhead
                .as_mut()
                .map(|(dh, accumulate)| (&mut dh[r.start * d..r.end * d], *accumulate));
            let job = move || {
                if let Some(target) = dh {
                    weight_grad(target, dz, x, r.len(), d, seq);
                }
            };
            let runner = &mut self.runner;
            let part = overlapped(overlap, job, || {
                let shape = shape.head_chunk(r.len());
                let acts = kernels::head_backward::Acts { dlogits: dz };
                runner.run::<kernels::HeadBackward>(model, c, &shape, &Default::default(), &acts)
            })?;
            // dxf [D, S] += undo · E_cᵀ·dz_c
            dxf.iter_mut()
                .zip(&part.dxf)
                .for_each(|(a, p)| *a += undo * p);
        }
        Ok(dxf)
    }

    /// The head's largest |value|, kept while the model's weights stay
    /// the same version.
    fn head_max_abs(&mut self, model: &Model) -> f32 {
        let key = (model.version, model.lm_head_id());
        match self.head_max {
            Some((k, m)) if k == key => m,
            _ => {
                let m = head_max_abs(model);
                self.head_max = Some((key, m));
                m
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked head gives the whole-vocabulary loss to 1e-6 relative
    /// (measured from scratch in f64), counts only targets `first..`, and
    /// its input and head gradients do not depend on the chunk size.
    #[test]
    fn chunked_head_loss_matches_the_whole_vocabulary() {
        let mut cfg = crate::model::config::ModelConfig::preset("tiny").unwrap();
        cfg.vocab_size = 700;
        cfg.tie_word_embeddings = false;
        let model = Model::init(&cfg, 3).unwrap();
        let (d, v, seq, first) = (cfg.hidden_size, cfg.vocab_size, 9, 4);
        let mut rng = Rng::new(5);
        let xf = rng.normals(d * seq, 3.0);
        let targets: Vec<u32> = (0..seq).map(|_| rng.below(v) as u32).collect();
        let head = model.lm_head();
        let mut expect = 0f64;
        for (s, &t) in targets.iter().enumerate().skip(first) {
            let z: Vec<f64> = (0..v)
                .map(|r| {
                    (0..d)
                        .map(|c| head[r * d + c] as f64 * xf[c * seq + s] as f64)
                        .sum()
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            expect += m + z.iter().map(|z| (z - m).exp()).sum::<f64>().ln() - z[t as usize];
        }
        let run = |chunk: usize| {
            let mut g = zero_grads(&model);
            g.reset();
            let mut eng = Engine::cpu(&model);
            eng.runner.head_rows = chunk;
            let (loss, dxf) = eng
                .head_loss(&model, &xf, &targets, first, 0.5, Some(&mut g))
                .unwrap();
            g.finish();
            let id = model.lm_head.unwrap();
            (loss, dxf, g[id].clone())
        };
        let (whole, dxf, dhead) = run(v);
        for chunk in [7, 256, 699] {
            let (loss, dx, dh) = run(chunk);
            assert!(
                (loss - expect).abs() < 1e-6 * expect,
                "{chunk}: {loss} vs {expect}"
            );
            let close = |a: &[f32], b: &[f32]| {
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale)
            };
            assert!(close(&dx, &dxf), "dxf differs at chunk {chunk}");
            assert!(close(&dh, &dhead), "dhead differs at chunk {chunk}");
        }
        assert!((whole - expect).abs() < 1e-6 * expect);
        // Uncounted positions get no gradient.
        for c in 0..d {
            for s in 0..first {
                assert_eq!(dxf[c * seq + s], 0.0);
            }
        }
    }

    /// The CPU engine's kernels, counting the LM head's forward runs.
    struct CountingHeads {
        inner: CpuKernels,
        head_forwards: usize,
    }

    impl KernelRunner for CountingHeads {
        fn run<K: kernels::Kernel>(
            &mut self,
            model: &Model,
            layer: usize,
            shape: &Shape,
            dropout: &Dropout,
            acts: &K::Acts<'_>,
        ) -> Result<K::Out> {
            self.head_forwards += (K::KIND == kernels::KernelKind::HeadForward) as usize;
            self.inner.run::<K>(model, layer, shape, dropout, acts)
        }

        fn head_chunks(
            &mut self,
            model: &Model,
            seq: usize,
        ) -> Result<kernels::tiling::HeadChunks> {
            self.inner.head_chunks(model, seq)
        }
    }

    /// A frozen head (LoRA) gathers its input gradient in the statistics
    /// pass: each chunk's logits are computed once, where a head that
    /// trains computes them twice, and dxf is the two-pass one (the
    /// trained head's, the same maths) to 1e-5 of its largest value, with
    /// per-position weights given after the statistics (as DPO does).
    #[test]
    fn a_frozen_head_computes_each_chunk_once_for_the_same_input_gradient() {
        let mut cfg = crate::model::config::ModelConfig::preset("tiny").unwrap();
        cfg.vocab_size = 700;
        let mut model = Model::init(&cfg, 3).unwrap();
        let (d, v, seq) = (cfg.hidden_size, cfg.vocab_size, 9);
        let mut rng = Rng::new(5);
        let xf = rng.normals(d * seq, 3.0);
        let targets: Vec<u32> = (0..seq).map(|_| rng.below(v) as u32).collect();
        let weights: Vec<f32> = (0..seq).map(|s| [0.0, 0.5, -0.25][s % 3]).collect();
        let run = |model: &Model, chunk: usize| {
            let opts = KernelOptions::for_model(model);
            let mut inner = CpuKernels::new(opts.clone());
            inner.head_rows = chunk;
            let runner = CountingHeads {
                inner,
                head_forwards: 0,
            };
            let mut eng = Engine::with_runner(runner, opts);
            let mut g = zero_grads(model);
            g.reset();
            let head = eng.head_statistics(model, &xf, &targets, true).unwrap();
            let nll = head.nll.clone();
            let dxf = eng
                .head_backward(model, &xf, &targets, head, &weights, &mut g)
                .unwrap();
            (nll, dxf, eng.runner.head_forwards)
        };
        let (nll, trained, forwards) = run(&model, 256);
        assert_eq!(forwards, 6, "a head that trains: 3 chunks, twice");
        let lora = crate::model::lora::LoraConfig::every_projection(4);
        model.lora = Some(crate::model::lora::Lora::init(&cfg, lora, 1).unwrap());
        for chunk in [7, 256, 699] {
            let (nll_f, frozen, forwards) = run(&model, chunk);
            assert_eq!(forwards, v.div_ceil(chunk), "chunk {chunk}: once each");
            for (a, b) in nll_f.iter().zip(&nll) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "chunk {chunk}: nll {a} vs {b}"
                );
            }
            let scale = trained.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (i, (a, b)) in frozen.iter().zip(&trained).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "chunk {chunk}: dxf[{i}] {a} vs {b}"
                );
            }
            // Unweighted positions get no gradient.
            assert!((0..d).all(|c| frozen[c * seq] == 0.0));
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
