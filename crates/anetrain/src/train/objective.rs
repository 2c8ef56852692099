//! What a run optimises: SFT's mean cross-entropy, or preference tuning —
//! DPO (Rafailov et al. 2023, with IPO's loss, Azar et
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

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::plan::memory::PairStep;
use crate::util::choice::Choice;

/// The names `--objective` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ObjectiveKind {
    Sft,
    Dpo,
    Orpo,
}

impl Choice for ObjectiveKind {
    const NOT_BUILT: &'static [(&'static str, &'static str)] = &[
        ("kto", "KTO (unpaired preferences) is not built yet"),
        ("simpo", "SimPO (no reference model) is not built yet"),
        ("cpo", "CPO is not built yet"),
        ("ipo", "IPO is DPO's --dpo-loss ipo"),
    ];
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            ObjectiveKind::Sft,
            "sft",
            "Supervised: cross-entropy on the records' tokens",
        ),
        (
            ObjectiveKind::Dpo,
            "dpo",
            "Direct preference optimisation on prompt/chosen/rejected pairs, against a frozen reference",
        ),
        (
            ObjectiveKind::Orpo,
            "orpo",
            "Odds-ratio preference optimisation: SFT on the chosen answer plus an odds-ratio term, no reference",
        ),
    ];
}

impl ObjectiveKind {
    /// What one pair's step of this objective runs and holds beyond SFT's
    /// two sequences (DPO's reference forwards, unless precomputed; its
    /// reference held): `None` for SFT, which has no pairs.
    pub fn pair_step(self, precompute_ref: bool) -> Option<PairStep> {
        let dpo = self == ObjectiveKind::Dpo;
        (self != ObjectiveKind::Sft).then_some(PairStep {
            reference_forwards: if dpo && !precompute_ref { 2 } else { 0 },
            reference_held: dpo,
        })
    }
}

/// DPO's loss types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DpoLoss {
    Sigmoid,
    Ipo,
}

impl Choice for DpoLoss {
    // TRL's other `loss_type`s, refused by name until they are built.
    const NOT_BUILT: &'static [(&'static str, &'static str)] = &[
        ("hinge", "TRL's hinge loss is not built yet"),
        ("robust", "TRL's robust loss is not built yet"),
        ("bco_pair", "TRL's bco_pair loss is not built yet"),
        ("sppo_hard", "TRL's sppo_hard loss is not built yet"),
        ("nca_pair", "TRL's nca_pair loss is not built yet"),
        ("aot", "TRL's aot loss is not built yet"),
        ("aot_unpaired", "TRL's aot_unpaired loss is not built yet"),
        ("apo_zero", "TRL's apo_zero loss is not built yet"),
        ("apo_down", "TRL's apo_down loss is not built yet"),
        ("discopop", "TRL's discopop loss is not built yet"),
        ("exo_pair", "TRL's exo_pair loss is not built yet"),
        ("sigmoid_norm", "TRL's sigmoid_norm loss is not built yet"),
    ];
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

/// TRL's default β (DPO) and λ (ORPO).
pub const DEFAULT_BETA: f64 = 0.1;

/// What a run optimises, with every setting of its loss. It is the only
/// thing in which an SFT, a DPO and an ORPO step differ
/// (`crate::train::step`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Objective {
    /// Mean cross-entropy over the counted targets of a batch of examples.
    #[default]
    Sft,
    /// DPO over pairs against a frozen reference; `beta` is IPO's τ with
    /// `DpoLoss::Ipo`.
    Dpo {
        loss: DpoLoss,
        beta: f64,
        /// The reference's log-probabilities computed once, before
        /// training (TRL's `precompute_ref_log_probs`).
        precompute_ref: bool,
    },
    /// ORPO over pairs: the chosen answers' NLL plus λ times the
    /// odds-ratio term; no reference.
    Orpo { lambda: f64 },
}

impl Objective {
    /// The objective `--objective kind --dpo-loss loss --beta beta
    /// [--precompute-ref]` asks for; a flag the objective does not read,
    /// given a value other than its default, is refused by name.
    pub fn new(
        kind: ObjectiveKind,
        loss: DpoLoss,
        beta: f64,
        precompute_ref: bool,
    ) -> Result<Objective> {
        if kind == ObjectiveKind::Sft {
            let given = [
                ("--beta", beta != DEFAULT_BETA),
                ("--dpo-loss", loss != DpoLoss::Sigmoid),
                ("--precompute-ref", precompute_ref),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                bail!("{flag} applies to preference tuning: add --objective dpo (or orpo)");
            }
            return Ok(Objective::Sft);
        }
        if kind == ObjectiveKind::Orpo && loss != DpoLoss::Sigmoid {
            bail!("--dpo-loss applies to --objective dpo; ORPO has one loss");
        }
        if !(beta.is_finite() && beta > 0.0) {
            bail!("--beta must be a positive number");
        }
        if kind == ObjectiveKind::Orpo && precompute_ref {
            bail!("--precompute-ref applies to DPO; ORPO has no reference model");
        }
        Ok(match kind {
            ObjectiveKind::Dpo => Objective::Dpo {
                loss,
                beta,
                precompute_ref,
            },
            _ => Objective::Orpo { lambda: beta },
        })
    }

    pub fn kind(&self) -> ObjectiveKind {
        match self {
            Objective::Sft => ObjectiveKind::Sft,
            Objective::Dpo { .. } => ObjectiveKind::Dpo,
            Objective::Orpo { .. } => ObjectiveKind::Orpo,
        }
    }

    /// `sft`, `dpo` or `orpo`.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Whether the objective trains on preference pairs.
    pub fn is_preference(&self) -> bool {
        *self != Objective::Sft
    }

    pub fn is_sft(&self) -> bool {
        *self == Objective::Sft
    }

    /// Whether DPO's reference is computed once, before training.
    pub fn precompute_ref(&self) -> bool {
        matches!(
            self,
            Objective::Dpo {
                precompute_ref: true,
                ..
            }
        )
    }

    /// DPO's β or ORPO's λ (`--beta`); `None` for SFT.
    pub fn beta(&self) -> Option<f64> {
        match *self {
            Objective::Sft => None,
            Objective::Dpo { beta, .. } => Some(beta),
            Objective::Orpo { lambda } => Some(lambda),
        }
    }

    /// DPO's loss type (`--dpo-loss`); `None` for SFT and ORPO.
    pub fn dpo_loss(&self) -> Option<DpoLoss> {
        match *self {
            Objective::Dpo { loss, .. } => Some(loss),
            _ => None,
        }
    }

    /// What one pair's step runs and holds beyond SFT's two sequences,
    /// for the memory plan and the predicted step; `None` for SFT.
    pub fn pair_step(&self) -> Option<PairStep> {
        self.kind().pair_step(self.precompute_ref())
    }
}

/// How a run's settings (`trainer/state.json`) store the objective, as
/// they always have: under `"preference"`, absent for SFT — so checkpoints
/// written before [`Objective`] existed resume unchanged.
pub mod saved {
    use super::{DpoLoss, Objective, ObjectiveKind};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Saved {
        objective: ObjectiveKind,
        loss: DpoLoss,
        beta: f64,
        precompute_ref: bool,
    }

    pub fn serialize<S: Serializer>(o: &Objective, s: S) -> Result<S::Ok, S::Error> {
        let saved = o.beta().map(|beta| Saved {
            objective: o.kind(),
            loss: o.dpo_loss().unwrap_or(DpoLoss::Sigmoid),
            beta,
            precompute_ref: o.precompute_ref(),
        });
        saved.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Objective, D::Error> {
        Ok(match Option::<Saved>::deserialize(d)? {
            None => Objective::Sft,
            Some(p) => match p.objective {
                ObjectiveKind::Sft => Objective::Sft,
                ObjectiveKind::Dpo => Objective::Dpo {
                    loss: p.loss,
                    beta: p.beta,
                    precompute_ref: p.precompute_ref,
                },
                ObjectiveKind::Orpo => Objective::Orpo { lambda: p.beta },
            },
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

/// One pair's loss and d loss/d π of its two answers (each already
/// divided by the batch's pair count `b`).
pub(super) struct PairTerms {
    pub(super) loss: f64,
    /// d loss / d π_chosen, d loss / d π_rejected.
    pub(super) dlogp: [f64; 2],
    pub(super) rewards: [f64; 2],
    pub(super) logps: [f64; 2],
    /// ORPO's log σ(log odds ratio).
    pub(super) log_odds_ratio: f64,
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

impl Objective {
    /// The terms of one pair: `logp` the policy's answers' summed
    /// log-probabilities, `reference` the reference's, `answer` the
    /// answers' token counts (`targets` for the averages, `tokens` for
    /// IPO's normalisation, which TRL takes from the unshifted mask), `b`
    /// the batch's pairs.
    pub(super) fn terms(
        &self,
        logp: [f64; 2],
        reference: [f64; 2],
        targets: [usize; 2],
        tokens: [usize; 2],
        b: f64,
    ) -> PairTerms {
        match *self {
            Objective::Dpo { loss, beta, .. } => {
                let ratio = [logp[0] - reference[0], logp[1] - reference[1]];
                let (loss, dlogp) = match loss {
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
            Objective::Orpo { lambda: beta } => {
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
            Objective::Sft => unreachable!("SFT has no pairs"),
        }
    }

    /// The scratch backward's weight per rejected token, of the true
    /// weight's sign and size order (it is rescaled exactly after): a
    /// sequence's gradient reaches a device's fp16 kernels in range.
    pub(super) fn nominal_rejected(&self, targets: usize, b: f64) -> f64 {
        match *self {
            Objective::Dpo {
                loss: DpoLoss::Sigmoid,
                beta,
                ..
            } => -beta / b,
            Objective::Dpo {
                loss: DpoLoss::Ipo,
                beta,
                ..
            } => -1.0 / (beta * targets.max(1) as f64 * b),
            Objective::Orpo { lambda } => -lambda / (targets.max(1) as f64 * b),
            Objective::Sft => unreachable!("SFT has no pairs"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dpo(loss: DpoLoss) -> Objective {
        Objective::Dpo {
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
            dpo(DpoLoss::Sigmoid),
            dpo(DpoLoss::Ipo),
            Objective::Orpo { lambda: 0.1 },
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

    /// The flags build only what the type admits, a flag the objective
    /// does not read is refused by name, and the settings file keeps the
    /// shape runs have always saved (so an older run resumes): absent for
    /// SFT, `{"objective", "loss", "beta", "precompute_ref"}` otherwise.
    #[test]
    fn objectives_are_built_from_their_flags_and_saved_as_before() {
        use ObjectiveKind::*;
        let new = |k, l, b, p| Objective::new(k, l, b, p);
        assert_eq!(
            new(Sft, DpoLoss::Sigmoid, 0.1, false).unwrap(),
            Objective::Sft
        );
        assert_eq!(
            new(Orpo, DpoLoss::Sigmoid, 0.5, false).unwrap(),
            Objective::Orpo { lambda: 0.5 }
        );
        for (k, l, b, p, flag) in [
            (Sft, DpoLoss::Sigmoid, 0.2, false, "--beta"),
            (Sft, DpoLoss::Ipo, 0.1, false, "--dpo-loss"),
            (Sft, DpoLoss::Sigmoid, 0.1, true, "--precompute-ref"),
            (Orpo, DpoLoss::Ipo, 0.1, false, "--dpo-loss"),
            (Orpo, DpoLoss::Sigmoid, 0.1, true, "--precompute-ref"),
            (Dpo, DpoLoss::Sigmoid, 0.0, false, "--beta"),
            (Dpo, DpoLoss::Sigmoid, f64::NAN, false, "--beta"),
        ] {
            let e = new(k, l, b, p).unwrap_err().to_string();
            assert!(e.starts_with(flag), "{k:?} {l:?} {b} {p}: {e}");
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct S {
            #[serde(
                default,
                skip_serializing_if = "Objective::is_sft",
                with = "saved",
                rename = "preference"
            )]
            objective: Objective,
        }
        let saved =
            r#"{"preference":{"objective":"Dpo","loss":"Ipo","beta":0.25,"precompute_ref":true}}"#;
        let dpo = S {
            objective: new(Dpo, DpoLoss::Ipo, 0.25, true).unwrap(),
        };
        assert_eq!(serde_json::from_str::<S>(saved).unwrap(), dpo);
        assert_eq!(serde_json::to_string(&dpo).unwrap(), saved);
        let orpo = r#"{"preference":{"objective":"Orpo","loss":"Sigmoid","beta":0.5,"precompute_ref":false}}"#;
        let o = serde_json::from_str::<S>(orpo).unwrap();
        assert_eq!(o.objective, Objective::Orpo { lambda: 0.5 });
        assert_eq!(serde_json::to_string(&o).unwrap(), orpo);
        let sft = S {
            objective: Objective::Sft,
        };
        assert_eq!(serde_json::to_string(&sft).unwrap(), "{}");
        assert_eq!(serde_json::from_str::<S>("{}").unwrap(), sft);
    }
}
