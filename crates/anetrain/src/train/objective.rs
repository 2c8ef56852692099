//! Preference tuning: DPO (Rafailov et al. 2023, with IPO's loss, Azar et
//! al. 2023) and ORPO (Hong et al. 2024), as TRL 1.16's `DPOTrainer` and
//! `ORPOTrainer` compute them. Per pair, with π the policy's log-probability
//! of an answer summed over its tokens, ρ the reference's, N its answer
//! tokens, a = π/N, and the batch's mean over pairs:
//!   DPO sigmoid:  ℓ = −log σ(β·((π_c − ρ_c) − (π_r − ρ_r)))
//!   DPO IPO:      ℓ = ((π_c − ρ_c)/N_c − (π_r − ρ_r)/N_r − 1/(2β))²
//!   ORPO:         ℓ = NLL_c − λ·log σ(log(a_c odds) − log(a_r odds)),  odds(a) = e^a/(1 − e^a)
//! where ORPO's NLL is the mean cross-entropy over every target of the
//! chosen sequences, prompt included (as `ORPOTrainer` counts it).
//!
//! The loss is a function of two sums per pair, so its gradient is one
//! weight per sequence on the SFT gradient of its tokens (ORPO's chosen
//! adds the NLL's weight on every position). A pair runs as: the
//! reference's two forwards (DPO, unless precomputed); the rejected
//! answer's forward and backward with a nominal weight into a scratch
//! gradient; the chosen answer's forward, after which every weight is
//! known, and its backward straight into the step's gradients; then the
//! scratch added in, scaled to the rejected answer's true weight. One
//! forward and one backward per sequence, as SFT, plus one gradient buffer
//! of the trainable parameters (the adapters, with LoRA).

use std::time::Instant;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::step::Backward;
use crate::data::preference::Pair;
use crate::data::records::Example;
use crate::device::KernelRunner;
use crate::engine::{zero_grads, Engine, Forward, Grads, HeadStatistics};
use crate::model::params::Param;
use crate::model::Model;
use crate::plan::memory::PairStep;
use crate::util::choice::Choice;

/// What a run optimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Objective {
    Sft,
    Dpo,
    Orpo,
}

impl Choice for Objective {
    const NOT_BUILT: &'static [(&'static str, &'static str)] = &[
        ("kto", "KTO (unpaired preferences) is not built yet"),
        ("simpo", "SimPO (no reference model) is not built yet"),
        ("cpo", "CPO is not built yet"),
        ("ipo", "IPO is DPO's --dpo-loss ipo"),
    ];
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Objective::Sft,
            "sft",
            "Supervised: cross-entropy on the records' tokens",
        ),
        (
            Objective::Dpo,
            "dpo",
            "Direct preference optimisation on prompt/chosen/rejected pairs, against a frozen reference",
        ),
        (
            Objective::Orpo,
            "orpo",
            "Odds-ratio preference optimisation: SFT on the chosen answer plus an odds-ratio term, no reference",
        ),
    ];
}

/// DPO's loss types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DpoLoss {
    Sigmoid,
    Ipo,
}

impl Choice for DpoLoss {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            DpoLoss::Sigmoid,
            "sigmoid",
            "The DPO paper's −log σ(β·margin)",
        ),
        (
            DpoLoss::Ipo,
            "ipo",
            "IPO's squared loss on the per-token margin, (margin − 1/(2β))²",
        ),
    ];
}

/// TRL's other DPO loss types, refused by name until they are built.
pub const PLANNED_LOSSES: &[&str] = &[
    "hinge",
    "robust",
    "bco_pair",
    "sppo_hard",
    "nca_pair",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "exo_pair",
    "sigmoid_norm",
];

/// A preference run's settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreferenceSettings {
    /// `Dpo` or `Orpo`.
    pub objective: Objective,
    pub loss: DpoLoss,
    /// DPO's β (IPO's τ), ORPO's λ.
    pub beta: f64,
    /// The reference's log-probabilities computed once, before training.
    pub precompute_ref: bool,
}

impl PreferenceSettings {
    /// What a pair's step runs and holds beyond SFT's two sequences, for
    /// the memory plan and the predicted step.
    pub fn pair_step(&self) -> PairStep {
        self.objective
            .pair_step(self.precompute_ref)
            .unwrap_or_default()
    }
}

impl Objective {
    /// What one pair's step of this objective runs and holds beyond SFT's
    /// two sequences (DPO's reference forwards, unless precomputed; its
    /// reference held): `None` for SFT, which has no pairs.
    pub fn pair_step(self, precompute_ref: bool) -> Option<PairStep> {
        let dpo = self == Objective::Dpo;
        (self != Objective::Sft).then_some(PairStep {
            reference_forwards: if dpo && !precompute_ref { 2 } else { 0 },
            reference_held: dpo,
        })
    }
}

/// The metrics TRL logs for a preference batch, under its names.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PreferenceMetrics {
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    pub accuracies: f64,
    pub margins: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
    /// ORPO's `nll_loss` and `log_odds_ratio`.
    pub orpo: Option<(f64, f64)>,
}

impl PreferenceMetrics {
    /// `{"rewards/chosen": …, …}` as TRL writes them.
    pub fn json(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        let mut put = |k: &str, v: f64| {
            m.insert(k.into(), serde_json::json!(v));
        };
        put("rewards/chosen", self.rewards_chosen);
        put("rewards/rejected", self.rewards_rejected);
        put("rewards/accuracies", self.accuracies);
        put("rewards/margins", self.margins);
        put("logps/chosen", self.logps_chosen);
        put("logps/rejected", self.logps_rejected);
        if let Some((nll, ratio)) = self.orpo {
            put("nll_loss", nll);
            put("log_odds_ratio", ratio);
        }
        m
    }
}

/// What [`pair_loss`] measured.
#[derive(Clone, Copy, Debug)]
pub struct PairLoss {
    pub loss: f64,
    /// The factor the gradients carry (the loss scale over a power of two;
    /// see [`pair_loss`]), for [`super::step::apply_update`].
    pub grad_scale: f64,
    pub metrics: PreferenceMetrics,
    /// Input tokens of the policy's sequences.
    pub tokens: usize,
    /// Seconds in forwards (the reference's too), the head, backwards.
    pub times: [f64; 3],
}

/// What a preference run keeps from step to step: the reference, and the
/// rejected answers' gradient buffer (allocated on the first step).
pub struct PairState {
    pub reference: Reference,
    scratch: Option<Grads>,
}

impl PairState {
    pub fn new(reference: Reference) -> PairState {
        PairState {
            reference,
            scratch: None,
        }
    }
}

/// Where the reference model's log-probabilities come from.
pub enum Reference {
    /// ORPO, or SFT.
    Unneeded,
    /// Computed once before training (`--precompute-ref`): per training
    /// pair and per validation pair, in the data's order.
    Precomputed {
        train: Vec<[f64; 2]>,
        val: Vec<[f64; 2]>,
    },
    /// LoRA: the run's initial adapters, swapped in for the reference's
    /// forwards (the base is the policy's own; nothing else is held).
    Adapter { params: Vec<Param>, version: u64 },
    /// Full fine-tuning: a frozen copy of the initial model.
    Model(Box<Model>),
}

/// The reference's adapter version: above any a run reaches, so a device
/// restages for it and never mistakes it for the policy's.
const REFERENCE_VERSION: u64 = u64::MAX;

impl Reference {
    /// The reference for `model` as it starts training (its initial
    /// adapters, or a copy); `Unneeded` unless the objective is DPO.
    pub fn of(model: &Model, p: Option<&PreferenceSettings>) -> Reference {
        if p.is_none_or(|p| p.objective != Objective::Dpo) {
            return Reference::Unneeded;
        }
        match &model.lora {
            Some(l) => Reference::Adapter {
                params: l.params.clone(),
                version: REFERENCE_VERSION,
            },
            None => {
                let mut copy = model.clone();
                copy.version = REFERENCE_VERSION;
                Reference::Model(Box::new(copy))
            }
        }
    }

    /// Runs `f` on the reference model: the adapters swapped in and out
    /// again (also when `f` fails), or the frozen copy.
    fn with<T>(&mut self, model: &mut Model, f: impl FnOnce(&Model) -> Result<T>) -> Result<T> {
        match self {
            Reference::Unneeded | Reference::Precomputed { .. } => {
                bail!("no reference model in this run")
            }
            Reference::Model(m) => f(m),
            Reference::Adapter { params, version } => {
                let swap =
                    |l: &mut crate::model::lora::Lora, params: &mut Vec<Param>, v: &mut u64| {
                        std::mem::swap(&mut l.params, params);
                        std::mem::swap(&mut l.version, v);
                    };
                let Some(l) = model.lora.as_mut() else {
                    bail!("the reference is an adapter, but the model has none");
                };
                swap(l, params, version);
                let out = f(model);
                if let Some(l) = model.lora.as_mut() {
                    swap(l, params, version);
                }
                out
            }
        }
    }
}

impl Reference {
    /// Whether this reference is still a model (to precompute from).
    pub fn is_model(&self) -> bool {
        matches!(self, Reference::Adapter { .. } | Reference::Model(_))
    }

    /// Computes the reference's log-probabilities of every pair once
    /// (`--precompute-ref`, as TRL's `precompute_ref_log_probs`) and
    /// becomes [`Reference::Precomputed`], releasing the reference model.
    /// `progress(done, total)` follows each pair; when `stop()` turns true
    /// it returns `Ok(false)` at the next pair, the reference unchanged.
    pub fn precompute<R: KernelRunner>(
        &mut self,
        eng: &mut Engine<R>,
        model: &mut Model,
        (train, val): (&[Pair], &[Pair]),
        stop: &dyn Fn() -> bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<bool> {
        let total = train.len() + val.len();
        let mut logps = Vec::with_capacity(total);
        let stopped = self.with(model, |m| -> Result<bool> {
            for p in train.iter().chain(val) {
                if stop() {
                    return Ok(true);
                }
                logps.push(pair_logps(eng, m, p)?);
                progress(logps.len(), total);
            }
            Ok(false)
        })?;
        if stopped {
            return Ok(false);
        }
        let val = logps.split_off(train.len());
        *self = Reference::Precomputed { train: logps, val };
        Ok(true)
    }

    /// `pair` (the `index`th of the training or validation pairs) with
    /// its precomputed reference, if there is one.
    pub fn attach(&self, pair: &Pair, index: usize, validation: bool) -> Pair {
        let mut p = pair.clone();
        if let Reference::Precomputed { train, val } = self {
            let table = if validation { val } else { train };
            p.reference = table.get(index).copied();
        }
        p
    }
}

/// Σ of −nll over the answer's targets: the log-probability of the answer.
fn answer_logp(nll: &[f64], first: usize) -> f64 {
    -nll[first..].iter().sum::<f64>()
}

/// The summed log-probabilities of a pair's two answers under the model
/// `model` (forwards only).
fn pair_logps<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    pair: &Pair,
) -> Result<[f64; 2]> {
    let mut out = [0f64; 2];
    for (o, e) in out.iter_mut().zip(pair.sequences()) {
        let (_, head, _) = sequence_forward(eng, model, e, false, None, &mut 0.0)?;
        *o = answer_logp(&head.nll, e.first_target());
    }
    Ok(out)
}

/// One sequence's forward — kept for its backward when `training`, else
/// forward-only — and its head's statistics; the forward's seconds added
/// to `t_forward`, and the instant the head began.
fn sequence_forward<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    e: &Example,
    training: bool,
    dropout_key: Option<u64>,
    t_forward: &mut f64,
) -> Result<(Forward, HeadStatistics, Instant)> {
    let t = Instant::now();
    let inputs = &e.tokens[..e.tokens.len() - 1];
    let fwd = match training {
        true => eng.forward(model, inputs, dropout_key)?,
        false => eng.forward_only(model, inputs)?,
    };
    let t1 = Instant::now();
    *t_forward += (t1 - t).as_secs_f64();
    let head = eng.head_statistics(model, &fwd.xf, &e.tokens[1..], training)?;
    Ok((fwd, head, t1))
}

/// One pair's loss and d loss/d π of its two answers (each already
/// divided by the batch's pair count `b`); `nll` the chosen's summed
/// cross-entropy over all its targets and `n_nll` the batch's count of
/// them (ORPO).
struct PairTerms {
    loss: f64,
    /// d loss / d π_chosen, d loss / d π_rejected.
    dlogp: [f64; 2],
    rewards: [f64; 2],
    logps: [f64; 2],
    /// ORPO's log σ(log odds ratio).
    log_odds_ratio: f64,
}

/// log(1 − eᵃ) for a < 0, stable on both sides of −ln 2 (TRL's `log1mexp`).
fn log1mexp(a: f64) -> f64 {
    if a < -std::f64::consts::LN_2 {
        (-a.exp()).ln_1p()
    } else {
        (-a.exp_m1()).ln()
    }
}

/// log σ(x), stable for large |x|.
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl PreferenceSettings {
    /// The terms of one pair: `logp` the policy's answers' summed
    /// log-probabilities, `reference` the reference's, `answer` the
    /// answers' token counts (`targets` for the averages, `tokens` for
    /// IPO's normalisation, which TRL takes from the unshifted mask), `b`
    /// the batch's pairs.
    fn terms(
        &self,
        logp: [f64; 2],
        reference: [f64; 2],
        targets: [usize; 2],
        tokens: [usize; 2],
        b: f64,
    ) -> PairTerms {
        let beta = self.beta;
        match self.objective {
            Objective::Dpo => {
                let ratio = [logp[0] - reference[0], logp[1] - reference[1]];
                let (loss, dlogp) = match self.loss {
                    DpoLoss::Sigmoid => {
                        let h = beta * (ratio[0] - ratio[1]);
                        let s = sigmoid(-h);
                        (-log_sigmoid(h), [-beta * s, beta * s])
                    }
                    DpoLoss::Ipo => {
                        let (nc, nr) = (tokens[0].max(1) as f64, tokens[1].max(1) as f64);
                        let d = ratio[0] / nc - ratio[1] / nr - 1.0 / (2.0 * beta);
                        (d * d, [2.0 * d / nc, -2.0 * d / nr])
                    }
                };
                PairTerms {
                    loss,
                    dlogp: [dlogp[0] / b, dlogp[1] / b],
                    rewards: [beta * ratio[0], beta * ratio[1]],
                    logps: logp,
                    log_odds_ratio: 0.0,
                }
            }
            _ => {
                let n = [targets[0] as f64, targets[1] as f64];
                let a = [logp[0] / n[0], logp[1] / n[1]];
                let log_odds = (a[0] - a[1]) - (log1mexp(a[0]) - log1mexp(a[1]));
                let ratio = log_sigmoid(log_odds);
                // d log σ(x)/dx = σ(−x); d log_odds/da_c = 1/(1 − e^{a_c}),
                // d log_odds/da_r = −1/(1 − e^{a_r}).
                let outer = -beta * sigmoid(-log_odds);
                let da = [outer / (-a[0].exp_m1()), -outer / (-a[1].exp_m1())];
                PairTerms {
                    loss: -beta * ratio,
                    dlogp: [da[0] / n[0] / b, da[1] / n[1] / b],
                    rewards: [beta * a[0], beta * a[1]],
                    logps: a,
                    log_odds_ratio: ratio,
                }
            }
        }
    }

    /// The scratch backward's weight per rejected token, of the true
    /// weight's sign and size order (it is rescaled exactly after): a
    /// sequence's gradient reaches a device's fp16 kernels in range.
    fn nominal_rejected(&self, targets: usize, b: f64) -> f64 {
        match (self.objective, self.loss) {
            (Objective::Dpo, DpoLoss::Sigmoid) => -self.beta / b,
            (Objective::Dpo, DpoLoss::Ipo) => -1.0 / (self.beta * targets.max(1) as f64 * b),
            _ => -self.beta / (targets.max(1) as f64 * b),
        }
    }
}

/// The preference loss of `pairs` (their mean, as TRL's), its metrics,
/// and with `backward` its gradient into `backward.grads` (times the loss
/// scale). `None` when `stop()` turned true before the last sequence.
pub fn pair_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &mut Model,
    settings: &PreferenceSettings,
    state: &mut PairState,
    pairs: &[Pair],
    mut backward: Option<Backward>,
    stop: &dyn Fn() -> bool,
) -> Result<Option<PairLoss>> {
    let PairState { reference, scratch } = state;
    if pairs.is_empty() {
        bail!("no preference pairs to evaluate");
    }
    let b = pairs.len() as f64;
    let orpo = settings.objective == Objective::Orpo;
    // ORPO's NLL: the mean over every target of the chosen sequences.
    let n_nll: usize = pairs.iter().map(|p| p.chosen.tokens.len() - 1).sum();
    // The gradients carry the loss scale over a power of two near the
    // batch's answer tokens: a pair's weight per token is a sequence's
    // (not a token's) share of the loss, so this keeps what reaches a
    // device's fp16 kernels as large as an SFT step of as many tokens
    // sends; powers of two, so dividing it out again is exact.
    let answer_targets: usize = pairs
        .iter()
        .map(|p| p.chosen.n_targets() + p.rejected.n_targets())
        .sum();
    let grad_scale = backward.as_ref().map_or(1.0, |bw| bw.loss_scale)
        / (answer_targets.max(1) as f64).log2().ceil().exp2();
    let loss_scale = grad_scale;
    // The rejected answers' gradient buffer, kept from step to step.
    if backward.is_some() && scratch.is_none() {
        *scratch = Some(zero_grads(model));
    }
    let mut scratch = scratch.as_mut().filter(|_| backward.is_some());
    if let Some(bw) = backward.as_mut() {
        bw.grads.reset();
    }
    let (mut t_fwd, mut t_head, mut t_bwd) = (0f64, 0f64, 0f64);
    let (mut loss, mut nll_total) = (0f64, 0f64);
    let mut m = PreferenceMetrics::default();
    let mut tokens = 0;
    for (i, pair) in pairs.iter().enumerate() {
        if stop() {
            return Ok(None);
        }
        let t = Instant::now();
        let ref_logps = match (settings.objective, pair.reference) {
            (Objective::Orpo, _) => [0.0; 2],
            (_, Some(r)) => r,
            (_, None) => reference.with(model, |m| pair_logps(eng, m, pair))?,
        };
        t_fwd += t.elapsed().as_secs_f64();
        let key = |micro: usize| {
            backward
                .as_ref()
                .and_then(|b| b.dropout)
                .map(|d| d.key(2 * i + micro))
        };
        // The rejected answer: forward, and backward with the nominal
        // weight into the scratch.
        let (rej, chosen) = (&pair.rejected, &pair.chosen);
        let nominal = settings.nominal_rejected(rej.n_targets(), b);
        let training = backward.is_some();
        let (fwd, head, t1) = sequence_forward(eng, model, rej, training, key(1), &mut t_fwd)?;
        let logp_r = answer_logp(&head.nll, rej.first_target());
        if let Some(s) = scratch.as_mut() {
            s.reset();
            let w = (-nominal * loss_scale) as f32;
            let weights = answer_weights(rej.tokens.len() - 1, rej.first_target(), w, 0.0);
            let dxf = eng.head_backward(model, &fwd.xf, &rej.tokens[1..], head, &weights, s)?;
            let t2 = Instant::now();
            eng.backward(model, &fwd, &dxf, s)?;
            s.finish();
            t_bwd += t2.elapsed().as_secs_f64();
            t_head += (t2 - t1).as_secs_f64();
        } else {
            t_head += t1.elapsed().as_secs_f64();
        }
        drop(fwd);
        if stop() {
            return Ok(None);
        }
        // The chosen answer: forward; every weight is known after it.
        let (fwd, head, t1) = sequence_forward(eng, model, chosen, training, key(0), &mut t_fwd)?;
        let logp_c = answer_logp(&head.nll, chosen.first_target());
        let nll_c: f64 = head.nll.iter().sum();
        let answer_tokens = |e: &Example| e.tokens.len() - e.offset;
        let terms = settings.terms(
            [logp_c, logp_r],
            ref_logps,
            [chosen.n_targets(), rej.n_targets()],
            [answer_tokens(chosen), answer_tokens(rej)],
            b,
        );
        if let Some(bw) = backward.as_mut() {
            // d loss/d nll_s = −d loss/d π on the answer's positions, plus
            // ORPO's 1/N on every position.
            let all = if orpo { 1.0 / n_nll as f64 } else { 0.0 };
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
            t_bwd += t2.elapsed().as_secs_f64();
            t_head += (t2 - t1).as_secs_f64();
            // The rejected answer's gradient, at its true weight.
            let factor = (terms.dlogp[1] / nominal) as f32;
            if let Some(s) = scratch.as_deref() {
                add_scaled(bw.grads, s, factor);
            }
        } else {
            t_head += t1.elapsed().as_secs_f64();
        }
        loss += terms.loss / b;
        nll_total += nll_c;
        tokens += chosen.tokens.len() + rej.tokens.len() - 2;
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
    }
    if orpo {
        let nll = nll_total / n_nll as f64;
        loss += nll;
        if let Some((n, _)) = m.orpo.as_mut() {
            *n = nll;
        }
    }
    if let Some(bw) = backward {
        bw.grads.finish();
    }
    Ok(Some(PairLoss {
        loss,
        grad_scale,
        metrics: m,
        tokens,
        times: [t_fwd, t_head, t_bwd],
    }))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(objective: Objective, loss: DpoLoss) -> PreferenceSettings {
        PreferenceSettings {
            objective,
            loss,
            beta: 0.1,
            precompute_ref: false,
        }
    }

    /// Each loss's d loss/d π against central differences of the loss
    /// itself (f64; the step 1e-5 leaves errors near 1e-9).
    #[test]
    fn the_pair_terms_differentiate_their_losses() {
        let cases = [
            settings(Objective::Dpo, DpoLoss::Sigmoid),
            settings(Objective::Dpo, DpoLoss::Ipo),
            settings(Objective::Orpo, DpoLoss::Sigmoid),
        ];
        let (reference, targets, tokens) = ([-30.0, -41.0], [7, 9], [7, 9]);
        for s in cases {
            let logp = [-27.5, -44.25];
            let t = s.terms(logp, reference, targets, tokens, 2.0);
            for k in 0..2 {
                let h = 1e-5;
                let mut up = logp;
                up[k] += h;
                let mut down = logp;
                down[k] -= h;
                let numeric = (s.terms(up, reference, targets, tokens, 2.0).loss
                    - s.terms(down, reference, targets, tokens, 2.0).loss)
                    / (2.0 * h)
                    / 2.0;
                assert!(
                    (t.dlogp[k] - numeric).abs() < 1e-8,
                    "{s:?} answer {k}: {} vs {numeric}",
                    t.dlogp[k]
                );
            }
        }
        for x in [-800.0f64, -3.0, 0.0, 2.5, 800.0] {
            let expect = -(1.0 + (-x).exp()).ln();
            assert!((log_sigmoid(x) - expect).abs() < 1e-12 || x.abs() > 700.0);
            assert!(log_sigmoid(x).is_finite());
        }
        for a in [-5.0f64, -0.7, -0.69, -1e-3] {
            assert!((log1mexp(a) - (1.0 - a.exp()).ln()).abs() < 1e-9);
        }
    }
}
