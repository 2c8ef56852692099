//! The training step — the only one: `train`, `bench` and the parity tests
//! against transformers and peft all run these functions.
//!   loss = Σ over the batch's counted targets of −log softmax(logits)[target] / count
//!   g ← g / scale,  g ← g · min(1, clip / (‖g‖ + 1e-6)),  θ ← AdamW(θ, g, lr)
//!
//! [`batch_loss`] is forward → loss (→ backward) over a batch of examples,
//! and also the evaluation loss (without a backward); [`apply_update`] is
//! the norm, clipping and AdamW; [`step`] is the two.

use std::time::Instant;

use anyhow::{bail, Result};

use crate::data::records::Example;
use crate::device::KernelRunner;
use crate::engine::{Engine, Grads};
use crate::model::Model;
use crate::train::optim::{self, AdamW};

/// The backward half of [`batch_loss`]: where the gradients go and what
/// they are scaled by.
pub struct Backward<'a> {
    /// Overwritten by the batch (reset here, finished here).
    pub grads: &'a mut Grads,
    /// The factor the loss is multiplied by before its backward (a power
    /// of two for fp16 loss scaling; 1 on the CPU).
    pub loss_scale: f64,
    /// LoRA dropout's keys for the batch (see [`DropoutKeys`]); `None`
    /// without dropout.
    pub dropout: Option<DropoutKeys>,
}

impl<'a> Backward<'a> {
    /// Gradients of the plain mean loss: no loss scale, no dropout.
    pub fn plain(grads: &'a mut Grads) -> Backward<'a> {
        Backward {
            grads,
            loss_scale: 1.0,
            dropout: None,
        }
    }
}

/// Where a step's LoRA dropout masks come from: the run's seed and the
/// step, so a resumed run draws the same masks.
#[derive(Clone, Copy, Debug)]
pub struct DropoutKeys {
    pub seed: u64,
    pub step: u64,
}

impl DropoutKeys {
    /// The key of micro-batch `micro`: a function of (seed, step, micro)
    /// alone.
    pub fn key(&self, micro: usize) -> u64 {
        self.seed
            .wrapping_mul(0x2545_f491_4f6c_dd1d)
            .wrapping_add(self.step.wrapping_mul(1 << 20))
            .wrapping_add(micro as u64)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

/// What [`batch_loss`] measured.
#[derive(Clone, Copy, Debug)]
pub struct BatchLoss {
    /// Mean loss over the batch's counted targets.
    pub loss: f64,
    /// How many targets the loss counted.
    pub targets: usize,
    /// Input tokens read.
    pub tokens: usize,
    /// Seconds in the forward, the loss (the LM head) and the backward.
    pub times: [f64; 3],
}

/// Mean cross-entropy over the counted targets of `examples` — summed over
/// the batch, divided by the count, as PyTorch's `cross_entropy` with
/// `ignore_index` on uncounted positions — and, with `backward`, its
/// gradient into `backward.grads` (times the loss scale). `None` when
/// `stop()` turned true before the last example: the gradients are then
/// incomplete and must not be used.
pub fn batch_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    examples: &[Example],
    mut backward: Option<Backward>,
    stop: &dyn Fn() -> bool,
) -> Result<Option<BatchLoss>> {
    let targets: usize = examples.iter().map(Example::n_targets).sum();
    if targets == 0 {
        bail!("no target tokens to evaluate");
    }
    let tokens = examples.iter().map(|e| e.tokens.len() - 1).sum();
    let grad_scale = backward
        .as_ref()
        .map_or(0.0, |b| b.loss_scale as f32 / targets as f32);
    if let Some(b) = backward.as_mut() {
        b.grads.reset();
    }
    let (mut t_fwd, mut t_loss, mut t_bwd) = (0f64, 0f64, 0f64);
    let mut total = 0f64;
    for (micro, e) in examples.iter().enumerate() {
        if stop() {
            return Ok(None);
        }
        let key = backward
            .as_ref()
            .and_then(|b| b.dropout)
            .map(|d| d.key(micro));
        let n = e.tokens.len() - 1;
        let a = Instant::now();
        let fwd = match backward {
            Some(_) => eng.forward(model, &e.tokens[..n], key)?,
            None => eng.forward_only(model, &e.tokens[..n])?,
        };
        let b = Instant::now();
        let grads = backward.as_mut().map(|b| &mut *b.grads);
        let (loss, dxf) = eng.head_loss(
            model,
            &fwd.xf,
            &e.tokens[1..],
            e.first_target(),
            grad_scale,
            grads,
        )?;
        let c = Instant::now();
        if let Some(bw) = backward.as_mut() {
            eng.backward(model, &fwd, &dxf, bw.grads)?;
        }
        t_fwd += (b - a).as_secs_f64();
        t_loss += (c - b).as_secs_f64();
        t_bwd += c.elapsed().as_secs_f64();
        total += loss;
    }
    if let Some(b) = backward {
        b.grads.finish();
    }
    Ok(Some(BatchLoss {
        loss: total / targets as f64,
        targets,
        tokens,
        times: [t_fwd, t_loss, t_bwd],
    }))
}

/// The evaluation loss of `examples`: [`batch_loss`] without a backward.
pub fn eval_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    examples: &[Example],
) -> Result<BatchLoss> {
    let never = || false;
    Ok(batch_loss(eng, model, examples, None, &never)?.expect("never stopped"))
}

/// What [`apply_update`] did.
#[derive(Clone, Copy, Debug)]
pub struct Update {
    /// The gradients' global norm, loss scale removed, before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied (loss and norm finite).
    pub finite: bool,
}

/// The update from the gradients [`batch_loss`] left, which still carry
/// `loss_scale` (a power of two, so dividing it out of the norm and the
/// update is exact): the norm, PyTorch's `clip_grad_norm_` factor
/// (`clip` 0 or less: none) and AdamW in one pass over the parameters;
/// nothing when `loss` or the norm is not finite.
pub fn apply_update(
    model: &mut Model,
    opt: &mut AdamW,
    grads: &Grads,
    loss: f64,
    loss_scale: f64,
    clip: f64,
    lr: f64,
) -> Update {
    let grad_norm = optim::grad_norm(grads) / loss_scale;
    let coef = optim::clip_coef(grad_norm, clip);
    let finite = loss.is_finite() && grad_norm.is_finite();
    if finite {
        opt.update(model, grads, lr, (coef as f64 / loss_scale) as f32);
    }
    Update { grad_norm, finite }
}

/// What one [`step`] did.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    pub batch: BatchLoss,
    pub update: Update,
    /// Seconds in the norm, clipping and AdamW.
    pub optimizer_s: f64,
}

/// The settings of one step.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    pub lr: f64,
    /// Clip the gradients' global norm to this (0: no clipping).
    pub clip: f64,
    pub loss_scale: f64,
    pub dropout: Option<DropoutKeys>,
}

/// One optimizer step over `examples`: [`batch_loss`] with its backward,
/// then [`apply_update`]. `None` when `stop()` turned true mid-batch:
/// nothing of the model or the optimizer was changed.
pub fn step<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    opt: &mut AdamW,
    grads: &mut Grads,
    examples: &[Example],
    o: &StepOptions,
    stop: &dyn Fn() -> bool,
) -> Result<Option<StepStats>> {
    let backward = Backward {
        grads,
        loss_scale: o.loss_scale,
        dropout: o.dropout,
    };
    let Some(batch) = batch_loss(eng, model, examples, Some(backward), stop)? else {
        return Ok(None);
    };
    let t = Instant::now();
    let update = apply_update(model, opt, grads, batch.loss, o.loss_scale, o.clip, o.lr);
    Ok(Some(StepStats {
        batch,
        update,
        optimizer_s: t.elapsed().as_secs_f64(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::zero_grads;
    use crate::model::config::ModelConfig;
    use crate::train::optim::AdamWConfig;

    /// Clipping inside the update is PyTorch's `clip_grad_norm_` followed
    /// by AdamW: the same parameters, to f32 rounding, as clipping the
    /// gradients by max_norm / (norm + 1e-6) first; a norm under the limit
    /// changes nothing, bit for bit; the loss scale is divided out exactly.
    #[test]
    fn the_update_clips_as_pytorch_and_removes_the_loss_scale() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let model = Model::init(&cfg, 1).unwrap();
        let raw: Vec<Vec<f32>> = model
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                (0..p.data.len())
                    .map(|j| ((i * 31 + j) as f32 * 0.013).sin())
                    .collect()
            })
            .collect();
        let norm = raw
            .iter()
            .flatten()
            .map(|&x| x as f64 * x as f64)
            .sum::<f64>()
            .sqrt();
        let run = |grads: Vec<Vec<f32>>, loss_scale: f64, clip: f64| {
            let mut m = model.clone();
            let mut opt = AdamW::new(&m, AdamWConfig::default());
            let u = apply_update(&mut m, &mut opt, &grads.into(), 1.0, loss_scale, clip, 1e-3);
            (u, m)
        };
        // Clipped inside the update vs. clipped beforehand (torch's order).
        let max_norm = norm / 4.0;
        let coef = (max_norm / (norm + 1e-6)) as f32;
        let pre: Vec<Vec<f32>> = raw
            .iter()
            .map(|g| g.iter().map(|x| x * coef).collect())
            .collect();
        let (u, inside) = run(raw.clone(), 1.0, max_norm);
        assert!((u.grad_norm - norm).abs() < 1e-6 * norm);
        let (_, outside) = run(pre, 1.0, 0.0);
        for (a, b) in inside.params.iter().zip(&outside.params) {
            for (x, y) in a.data.iter().zip(&b.data) {
                assert!((x - y).abs() <= 1e-6 * y.abs().max(1e-3), "{x} vs {y}");
            }
        }
        // Under the limit: the same bits as no clipping at all.
        let (_, loose) = run(raw.clone(), 1.0, norm * 2.0);
        let (_, none) = run(raw.clone(), 1.0, 0.0);
        assert!(loose
            .params
            .iter()
            .zip(&none.params)
            .all(|(a, b)| a.data == b.data));
        // A loss scale of 2^10 on the gradients: the same update, bit for bit.
        let scaled: Vec<Vec<f32>> = raw
            .iter()
            .map(|g| g.iter().map(|x| x * 1024.0).collect())
            .collect();
        let (us, s) = run(scaled, 1024.0, 0.0);
        assert_eq!(us.grad_norm, norm_of(&raw));
        assert!(s
            .params
            .iter()
            .zip(&none.params)
            .all(|(a, b)| a.data == b.data));
        // A non-finite gradient skips the update.
        let mut bad = raw;
        bad[0][0] = f32::NAN;
        let (u, m) = run(bad, 1.0, 0.0);
        assert!(!u.finite);
        assert!(m
            .params
            .iter()
            .zip(&model.params)
            .all(|(a, b)| a.data == b.data));
    }

    fn norm_of(g: &[Vec<f32>]) -> f64 {
        optim::grad_norm(&g.to_vec().into())
    }

    /// The loss without a backward equals the loss with one, gradients are
    /// scaled by the loss scale exactly, and a stop before the first
    /// example returns nothing.
    #[test]
    fn evaluation_and_training_share_the_loss() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let model = Model::init(&cfg, 2).unwrap();
        let examples = vec![
            Example {
                tokens: (0..12).map(|i| (i * 7 % cfg.vocab_size) as u32).collect(),
                offset: 0,
            },
            Example {
                tokens: (0..9).map(|i| (i * 5 % cfg.vocab_size) as u32).collect(),
                offset: 4,
            },
        ];
        let mut eng = Engine::cpu(&model);
        let eval = batch_loss(&mut eng, &model, &examples, None, &|| false)
            .unwrap()
            .unwrap();
        assert_eq!(eval.targets, 11 + 5);
        let mut g1 = zero_grads(&model);
        let b1 = batch_loss(
            &mut eng,
            &model,
            &examples,
            Some(Backward::plain(&mut g1)),
            &|| false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(b1.loss, eval.loss);
        let mut g8 = zero_grads(&model);
        let bw = Backward {
            grads: &mut g8,
            loss_scale: 8.0,
            dropout: None,
        };
        batch_loss(&mut eng, &model, &examples, Some(bw), &|| false).unwrap();
        for (a, b) in g1.iter().zip(g8.iter()) {
            assert!(a.iter().zip(b).all(|(x, y)| x * 8.0 == *y));
        }
        assert!(batch_loss(&mut eng, &model, &examples, None, &|| true)
            .unwrap()
            .is_none());
    }
}
