//! DPO's reference: the model a run starts from, kept as its initial
//! adapters (LoRA) or a frozen copy, or its log-probabilities of every
//! pair computed once (`--precompute-ref`); and the forwards that measure
//! an answer's log-probability, π = Σ over the answer's targets of
//! log softmax(logits)[target].

use std::time::Instant;

use anyhow::{bail, Result};

use super::objective::Objective;
use crate::data::preference::Pair;
use crate::data::records::Example;
use crate::device::KernelRunner;
use crate::engine::{Engine, Forward, HeadStatistics};
use crate::model::params::Param;
use crate::model::Model;

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
    pub fn of(model: &Model, objective: &Objective) -> Reference {
        if !matches!(objective, Objective::Dpo { .. }) {
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

    /// The base under `model`'s adapters, as TRL takes the reference of
    /// a PEFT model given none (its adapters disabled): the adapters with
    /// every B zeroed, which adds nothing to the base. A model without
    /// adapters is its own reference.
    pub fn base_of(model: &Model) -> Reference {
        match &model.lora {
            Some(l) => {
                let mut params = l.params.clone();
                for ids in l.slots.iter().flatten().flatten() {
                    params[ids.b].data.fill(0.0);
                }
                Reference::Adapter {
                    params,
                    version: REFERENCE_VERSION,
                }
            }
            None => {
                let mut copy = model.clone();
                copy.version = REFERENCE_VERSION;
                Reference::Model(Box::new(copy))
            }
        }
    }

    /// Runs `f` on the reference model: the adapters swapped in and out
    /// again (also when `f` fails), or the frozen copy.
    pub(super) fn with<T>(
        &mut self,
        model: &mut Model,
        f: impl FnOnce(&Model) -> Result<T>,
    ) -> Result<T> {
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
pub(super) fn answer_logp(nll: &[f64], first: usize) -> f64 {
    -nll[first..].iter().sum::<f64>()
}

/// The summed log-probabilities of a pair's two answers under the model
/// `model` (forwards only).
pub(super) fn pair_logps<R: KernelRunner>(
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
pub(super) fn sequence_forward<R: KernelRunner>(
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
