//! The training step — one for every objective: `train`, `bench`, `eval`
//! and the parity tests against transformers, peft and TRL all run these
//! functions; the [`Objective`] is all that differs.
//!   SFT:   loss = Σ over the batch's counted targets of −log softmax(logits)[target] / count
//!   pairs: loss = mean over pairs of the objective's pair loss (`objective`)
//!   g ← g / scale,  g ← g · min(1, clip / (‖g‖ + 1e-6)),  θ ← AdamW(θ, g, lr)
//!
//! [`batch_loss`] is forward → loss (→ backward) over a [`Batch`], and
//! also the evaluation loss (without a backward); [`apply_update`] is the
//! norm, clipping and AdamW; [`step`] is the two.
//!
//! A preference loss is a function of two sums per pair, so its gradient
//! is one weight per sequence on the SFT gradient of its tokens (ORPO's
//! chosen adds the NLL's weight on every position). A pair runs as: the
//! reference's two forwards (DPO, unless precomputed); the rejected
//! answer's forward and backward with a nominal weight into a scratch
//! gradient; the chosen answer's forward, after which every weight is
//! known, and its backward straight into the step's gradients; then the
//! scratch added in, scaled to the rejected answer's true weight. One
//! forward and one backward per sequence, as SFT, plus one gradient buffer
//! of the trainable parameters (the adapters, with LoRA).

use std::time::Instant;

use anyhow::{bail, Result};

use super::objective::{Objective, PreferenceMetrics};
use super::reference::{answer_logp, pair_logps, sequence_forward, Reference};
use crate::data::preference::Pair;
use crate::data::records::Example;
use crate::device::KernelRunner;
use crate::engine::{zero_grads, Engine, Grads};
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

/// What a step trains on: examples (SFT) or preference pairs.
#[derive(Clone, Debug)]
pub enum Batch {
    Examples(Vec<Example>),
    Pairs(Vec<Pair>),
}

impl Batch {
    /// Input tokens the batch's forwards read.
    pub fn tokens(&self) -> usize {
        match self {
            Batch::Examples(e) => e.iter().map(|e| e.tokens.len() - 1).sum(),
            Batch::Pairs(p) => p
                .iter()
                .map(|p| p.chosen.tokens.len() + p.rejected.tokens.len() - 2)
                .sum(),
        }
    }

    /// Targets the loss counts: every counted target of the examples, or
    /// the pairs' answer tokens.
    pub fn targets(&self) -> usize {
        match self {
            Batch::Examples(e) => e.iter().map(Example::n_targets).sum(),
            Batch::Pairs(p) => p
                .iter()
                .map(|p| p.chosen.n_targets() + p.rejected.n_targets())
                .sum(),
        }
    }

    /// Examples or pairs.
    pub fn len(&self) -> usize {
        match self {
            Batch::Examples(e) => e.len(),
            Batch::Pairs(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a run's steps minimise: the objective, and what it keeps from
/// step to step (DPO's reference; the rejected answers' gradient buffer,
/// allocated on the first preference step).
pub struct Loss {
    pub objective: Objective,
    pub reference: Reference,
    scratch: Option<Grads>,
}

impl Loss {
    pub fn new(objective: Objective, reference: Reference) -> Loss {
        Loss {
            objective,
            reference,
            scratch: None,
        }
    }

    /// Supervised fine-tuning's mean cross-entropy.
    pub fn sft() -> Loss {
        Loss::new(Objective::Sft, Reference::Unneeded)
    }
}

/// What [`batch_loss`] measured.
#[derive(Clone, Copy, Debug)]
pub struct BatchLoss {
    /// SFT: the mean loss over the batch's counted targets; pairs: the
    /// mean pair loss (plus ORPO's NLL).
    pub loss: f64,
    /// How many targets the loss counted ([`Batch::targets`]).
    pub targets: usize,
    /// Input tokens read.
    pub tokens: usize,
    /// The factor the gradients carry, for [`apply_update`]: the loss
    /// scale, over a power of two near the answer tokens for pairs (see
    /// [`batch_loss`]).
    pub grad_scale: f64,
    /// A preference batch's metrics, as TRL logs them.
    pub preference: Option<PreferenceMetrics>,
    /// Seconds in the forward (the reference's too), the loss (the LM
    /// head) and the backward.
    pub times: [f64; 3],
}

/// What a batch's units add up while it runs.
#[derive(Default)]
struct Sums {
    /// SFT: summed cross-entropy; pairs: Σ pair loss / pairs.
    loss: f64,
    /// The chosen sequences' summed cross-entropy (ORPO's NLL).
    nll: f64,
    metrics: PreferenceMetrics,
    /// Forward, head, backward.
    times: [f64; 3],
}

/// The loss of `batch` under `loss.objective` — SFT's mean cross-entropy
/// over the counted targets (as PyTorch's `cross_entropy` with
/// `ignore_index` on uncounted positions), or the mean pair loss of DPO
/// or ORPO as TRL's — and, with `backward`, its gradient into
/// `backward.grads` (times [`BatchLoss::grad_scale`]). `None` when
/// `stop()` turned true before the last sequence: the gradients are then
/// incomplete and must not be used.
pub fn batch_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    loss: &mut Loss,
    batch: &Batch,
    mut backward: Option<Backward>,
    stop: &dyn Fn() -> bool,
) -> Result<Option<BatchLoss>> {
    let targets = batch.targets();
    let loss_scale = backward.as_ref().map_or(1.0, |b| b.loss_scale);
    let pairs = match batch {
        Batch::Examples(_) if loss.objective.is_preference() => bail!(
            "--objective {} trains on preference pairs, and the batch holds examples",
            loss.objective.name()
        ),
        Batch::Pairs(_) if loss.objective.is_sft() => {
            bail!("SFT trains on examples, and the batch holds preference pairs")
        }
        Batch::Examples(_) if targets == 0 => bail!("no target tokens to evaluate"),
        Batch::Pairs(p) if p.is_empty() => bail!("no preference pairs to evaluate"),
        Batch::Examples(_) => None,
        Batch::Pairs(p) => Some(PairBatch::new(p, targets, loss_scale)),
    };
    // The gradients' factor: SFT's loss scale; see `PairBatch::scale`.
    let grad_scale = pairs.as_ref().map_or(loss_scale, |p| p.scale);
    if let Some(b) = backward.as_mut() {
        if pairs.is_some() && loss.scratch.is_none() {
            loss.scratch = Some(zero_grads(model));
        }
        b.grads.reset();
    }
    let mut sums = Sums::default();
    for unit in 0..batch.len() {
        if stop() {
            return Ok(None);
        }
        let done = match (batch, &pairs) {
            (Batch::Pairs(p), Some(pb)) => one_pair(
                eng,
                model,
                loss,
                &p[unit],
                unit,
                pb,
                backward.as_mut(),
                stop,
                &mut sums,
            )?,
            (Batch::Examples(e), _) => {
                let per_target = backward
                    .as_ref()
                    .map_or(0.0, |b| b.loss_scale as f32 / targets as f32);
                one_example(
                    eng,
                    model,
                    &e[unit],
                    unit,
                    per_target,
                    backward.as_mut(),
                    &mut sums,
                )?;
                true
            }
            _ => unreachable!("checked above"),
        };
        if !done {
            return Ok(None);
        }
    }
    if let Some(b) = backward {
        b.grads.finish();
    }
    let (mean, preference) = match pairs {
        None => (sums.loss / targets as f64, None),
        Some(pb) => {
            let mut m = sums.metrics;
            let mut mean = sums.loss;
            if let Objective::Orpo { .. } = loss.objective {
                // ORPO's NLL: the mean over every target of the chosen
                // sequences.
                let nll = sums.nll / pb.n_nll as f64;
                mean += nll;
                if let Some((n, _)) = m.orpo.as_mut() {
                    *n = nll;
                }
            }
            (mean, Some(m))
        }
    };
    Ok(Some(BatchLoss {
        loss: mean,
        targets,
        tokens: batch.tokens(),
        grad_scale,
        preference,
        times: sums.times,
    }))
}

/// One example of an SFT batch: forward, the head's loss and (with
/// `backward`) its gradient at `per_target` a counted target, backward.
fn one_example<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    e: &Example,
    micro: usize,
    per_target: f32,
    backward: Option<&mut Backward>,
    sums: &mut Sums,
) -> Result<()> {
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
    let mut backward = backward;
    let grads = backward.as_mut().map(|b| &mut *b.grads);
    let (loss, dxf) = eng.head_loss(
        model,
        &fwd.xf,
        &e.tokens[1..],
        e.first_target(),
        per_target,
        grads,
    )?;
    let c = Instant::now();
    if let Some(bw) = backward {
        eng.backward(model, &fwd, &dxf, bw.grads)?;
    }
    sums.times[0] += (b - a).as_secs_f64();
    sums.times[1] += (c - b).as_secs_f64();
    sums.times[2] += c.elapsed().as_secs_f64();
    sums.loss += loss;
    Ok(())
}

/// What every pair of a batch shares.
struct PairBatch {
    /// The batch's pairs.
    b: f64,
    /// ORPO's NLL counts every target of the chosen sequences.
    n_nll: usize,
    /// The factor the gradients carry: the loss scale over a power of two
    /// near the batch's answer tokens. A pair's weight per token is a
    /// sequence's (not a token's) share of the loss, so this keeps what
    /// reaches a device's fp16 kernels as large as an SFT step of as many
    /// tokens sends; powers of two, so dividing it out again is exact.
    scale: f64,
}

impl PairBatch {
    fn new(pairs: &[Pair], answer_targets: usize, loss_scale: f64) -> PairBatch {
        PairBatch {
            b: pairs.len() as f64,
            n_nll: pairs.iter().map(|p| p.chosen.tokens.len() - 1).sum(),
            scale: loss_scale / (answer_targets.max(1) as f64).log2().ceil().exp2(),
        }
    }
}

/// One pair of a preference batch (the `i`th): the reference's
/// log-probabilities, the rejected answer (its backward into the scratch
/// at a nominal weight), the chosen answer (its backward into the step's
/// gradients), the scratch added at its true weight; the pair's terms
/// into `sums`. `false` when `stop()` turned true between the answers.
#[allow(clippy::too_many_arguments)]
fn one_pair<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    loss: &mut Loss,
    pair: &Pair,
    i: usize,
    pb: &PairBatch,
    backward: Option<&mut Backward>,
    stop: &dyn Fn() -> bool,
    sums: &mut Sums,
) -> Result<bool> {
    let Loss {
        objective,
        reference,
        scratch,
    } = loss;
    let (objective, b, loss_scale) = (*objective, pb.b, pb.scale);
    let orpo = matches!(objective, Objective::Orpo { .. });
    let t = Instant::now();
    let ref_logps = match (objective, pair.reference) {
        (Objective::Orpo { .. }, _) => [0.0; 2],
        (_, Some(r)) => r,
        (_, None) => reference.with(model, |m| pair_logps(eng, m, pair))?,
    };
    sums.times[0] += t.elapsed().as_secs_f64();
    let key = |micro: usize| {
        backward
            .as_ref()
            .and_then(|b| b.dropout)
            .map(|d| d.key(2 * i + micro))
    };
    let (key_chosen, key_rejected) = (key(0), key(1));
    let training = backward.is_some();
    let mut scratch = scratch.as_mut().filter(|_| training);
    // The rejected answer: forward, and backward with the nominal
    // weight into the scratch.
    let (rej, chosen) = (&pair.rejected, &pair.chosen);
    let nominal = objective.nominal_rejected(rej.n_targets(), b);
    let (fwd, head, t1) =
        sequence_forward(eng, model, rej, training, key_rejected, &mut sums.times[0])?;
    let logp_r = answer_logp(&head.nll, rej.first_target());
    if let Some(s) = scratch.as_mut() {
        s.reset();
        let w = (-nominal * loss_scale) as f32;
        let weights = answer_weights(rej.tokens.len() - 1, rej.first_target(), w, 0.0);
        let dxf = eng.head_backward(model, &fwd.xf, &rej.tokens[1..], head, &weights, s)?;
        let t2 = Instant::now();
        eng.backward(model, &fwd, &dxf, s)?;
        s.finish();
        sums.times[2] += t2.elapsed().as_secs_f64();
        sums.times[1] += (t2 - t1).as_secs_f64();
    } else {
        sums.times[1] += t1.elapsed().as_secs_f64();
    }
    drop(fwd);
    if stop() {
        return Ok(false);
    }
    // The chosen answer: forward; every weight is known after it.
    let (fwd, head, t1) =
        sequence_forward(eng, model, chosen, training, key_chosen, &mut sums.times[0])?;
    let logp_c = answer_logp(&head.nll, chosen.first_target());
    let nll_c: f64 = head.nll.iter().sum();
    let answer_tokens = |e: &Example| e.tokens.len() - e.offset;
    let terms = objective.terms(
        [logp_c, logp_r],
        ref_logps,
        [chosen.n_targets(), rej.n_targets()],
        [answer_tokens(chosen), answer_tokens(rej)],
        b,
    );
    if let Some(bw) = backward {
        // d loss/d nll_s = −d loss/d π on the answer's positions, plus
        // ORPO's 1/N on every position.
        let all = if orpo { 1.0 / pb.n_nll as f64 } else { 0.0 };
        let weights = answer_weights(
            chosen.tokens.len() - 1,
            chosen.first_target(),
            ((-terms.dlogp[0] + all) * loss_scale) as f32,
            (all * loss_scale) as f32,
        );
        let dxf = eng.head_backward(
            model,
            &fwd.xf,
            &chosen.tokens[1..],
            head,
            &weights,
            bw.grads,
        )?;
        let t2 = Instant::now();
        eng.backward(model, &fwd, &dxf, bw.grads)?;
        sums.times[2] += t2.elapsed().as_secs_f64();
        sums.times[1] += (t2 - t1).as_secs_f64();
        // The rejected answer's gradient, at its true weight.
        let factor = (terms.dlogp[1] / nominal) as f32;
        if let Some(s) = scratch.as_deref() {
            add_scaled(bw.grads, s, factor);
        }
    } else {
        sums.times[1] += t1.elapsed().as_secs_f64();
    }
    sums.loss += terms.loss / b;
    sums.nll += nll_c;
    let m = &mut sums.metrics;
    m.rewards_chosen += terms.rewards[0] / b;
    m.rewards_rejected += terms.rewards[1] / b;
    m.accuracies += (terms.rewards[0] > terms.rewards[1]) as u8 as f64 / b;
    m.margins += (terms.rewards[0] - terms.rewards[1]) / b;
    m.logps_chosen += terms.logps[0] / b;
    m.logps_rejected += terms.logps[1] / b;
    if orpo {
        let (_, r) = m.orpo.get_or_insert((0.0, 0.0));
        *r += terms.log_odds_ratio / b;
    }
    Ok(true)
}

/// Per-position weights of a sequence of `seq` targets: `answer` from
/// `first` on, `prompt` before.
fn answer_weights(seq: usize, first: usize, answer: f32, prompt: f32) -> Vec<f32> {
    (0..seq)
        .map(|s| if s < first { prompt } else { answer })
        .collect()
}

/// `grads += factor · scratch`, parameter by parameter.
fn add_scaled(grads: &mut Grads, scratch: &Grads, factor: f32) {
    use rayon::prelude::*;
    for id in 0..scratch.len() {
        let src = &scratch[id];
        grads
            .accumulator(id)
            .par_chunks_mut(1 << 14)
            .zip(src.par_chunks(1 << 14))
            .for_each(|(g, s)| g.iter_mut().zip(s).for_each(|(g, s)| *g += factor * s));
    }
}

/// The evaluation loss of `batch`: [`batch_loss`] without a backward.
pub fn eval_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    loss: &mut Loss,
    batch: &Batch,
) -> Result<BatchLoss> {
    let never = || false;
    Ok(batch_loss(eng, model, loss, batch, None, &never)?.expect("never stopped"))
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

/// One optimizer step over `batch`: [`batch_loss`] with its backward,
/// then [`apply_update`]. `None` when `stop()` turned true mid-batch:
/// nothing of the model or the optimizer was changed.
#[allow(clippy::too_many_arguments)]
pub fn step<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    opt: &mut AdamW,
    loss: &mut Loss,
    grads: &mut Grads,
    batch: &Batch,
    o: &StepOptions,
    stop: &dyn Fn() -> bool,
) -> Result<Option<StepStats>> {
    let backward = Backward {
        grads,
        loss_scale: o.loss_scale,
        dropout: o.dropout,
    };
    let Some(batch) = batch_loss(eng, model, loss, batch, Some(backward), stop)? else {
        return Ok(None);
    };
    let t = Instant::now();
    let update = apply_update(
        model,
        opt,
        grads,
        batch.loss,
        batch.grad_scale,
        o.clip,
        o.lr,
    );
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
        let mut model = Model::init(&cfg, 2).unwrap();
        let examples = Batch::Examples(vec![
            Example {
                tokens: (0..12).map(|i| (i * 7 % cfg.vocab_size) as u32).collect(),
                offset: 0,
            },
            Example {
                tokens: (0..9).map(|i| (i * 5 % cfg.vocab_size) as u32).collect(),
                offset: 4,
            },
        ]);
        let sft = &mut Loss::sft();
        let mut eng = Engine::cpu(&model);
        let eval = batch_loss(&mut eng, &mut model, sft, &examples, None, &|| false)
            .unwrap()
            .unwrap();
        assert_eq!(eval.targets, 11 + 5);
        let mut g1 = zero_grads(&model);
        let b1 = batch_loss(
            &mut eng,
            &mut model,
            sft,
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
        batch_loss(&mut eng, &mut model, sft, &examples, Some(bw), &|| false).unwrap();
        for (a, b) in g1.iter().zip(g8.iter()) {
            assert!(a.iter().zip(b).all(|(x, y)| x * 8.0 == *y));
        }
        assert!(
            batch_loss(&mut eng, &mut model, sft, &examples, None, &|| true)
                .unwrap()
                .is_none()
        );
    }
}
