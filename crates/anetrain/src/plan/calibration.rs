//! The cost model's calibration: the published whole steps it is checked
//! against (maderix/ANE, rustane), the seed's own step played through the
//! timeline ([`predict_seed`]), the fit of [`ane::cost::FITTED`] to the
//! M4's two steps, and the validation on the held-out ones.

use serde::Serialize;

use ane::cost::Rates;

use super::timeline::{predict, Predicted, SeedStep, StepSetup};
use crate::device::DeviceBuffers;
use crate::kernels::tiling::Plan;
use crate::model::config::ModelConfig;

/// A published whole-step time to check the model against.
#[derive(Clone, Debug, Serialize)]
pub struct Published {
    pub name: &'static str,
    pub family: ane::family::Family,
    /// Milliseconds per step, as published.
    pub ms: f64,
    pub source: &'static str,
    /// Used to fit [`ane::cost::FITTED`] (else held out).
    pub fitted: bool,
    /// The curves the row is costed on: its own chip's.
    pub curve: &'static str,
    /// A held-out row the model misses by more than ±35%: which constant
    /// and what `doctor` would measure to settle it.
    pub known_miss: Option<&'static str>,
    #[serde(skip)]
    pub rates: fn() -> Rates,
}

/// The published steps the model is validated on, with their shapes:
/// maderix/ANE's dynamic pipeline, Stories110M and Qwen3-0.6B at seq 256
/// (M4: `training/README.md`, whose 20-step table measures Stories at 111
/// ms — "~115" in its text; the top README's 91 ms beside "6 kernels" is
/// the static pipeline's; M5 Max: PR #50), and rustane's 600M at seq 512
/// (M4 Max, README's "wide+shallow (14L)",
/// `crates/engine/tests/bench_param_sweep.rs` `sweep_600m_c`: 1792/4864,
/// 14 heads of 128, vocabulary 8192). Each is costed on its own chip's
/// curves.
pub fn published() -> Vec<(Published, ModelConfig, usize, SeedStep)> {
    use ane::family::Family::*;
    let stories = ModelConfig::preset("stories110m").expect("preset");
    let qwen = ModelConfig::preset("qwen3-0.6b").expect("preset");
    let mut rustane = stories.clone();
    (rustane.hidden_size, rustane.intermediate_size) = (1792, 4864);
    (rustane.num_attention_heads, rustane.num_key_value_heads) = (14, 14);
    (
        rustane.head_dim,
        rustane.num_hidden_layers,
        rustane.vocab_size,
    ) = (128, 14, 8192);
    // The dynamic pipeline runs ten evaluations a layer for every model
    // (`training/training_dynamic/train.m`: eight `ane_eval_req`, two
    // `ane_eval`; "10 shared kernels across all layers", its README).
    let maderix = SeedStep {
        vocab: 9200,
        optimizer: false,
        fused_mha: false,
    };
    let table = |family| -> (&'static str, fn() -> Rates) {
        match family {
            M4 => ("the M4's table", || Rates::of(M4)),
            _ => ("the M5's table (the M4's engine: PR #50)", || Rates::of(M5)),
        }
    };
    let row = |name, family, ms, source, fitted| {
        let (curve, rates) = table(family);
        Published {
            name,
            family,
            ms,
            source,
            fitted,
            curve,
            rates,
            known_miss: None,
        }
    };
    vec![
        (
            row(
                "Stories110M",
                M4,
                111.0,
                "maderix/ANE training/README.md (M4)",
                true,
            ),
            stories.clone(),
            256,
            maderix,
        ),
        (
            row(
                "Qwen3-0.6B",
                M4,
                412.0,
                "maderix/ANE training/README.md (M4)",
                true,
            ),
            qwen.clone(),
            256,
            maderix,
        ),
        (
            Published {
                known_miss: Some(
                    "the host's rates: staging and the host's elementwise passes run at one M3 Max figure on every chip, where PR #50 puts the M5 Max's gain in its CPU (12 P-cores); `doctor` measures this chip's surface-write bandwidth",
                ),
                ..row(
                    "Stories110M",
                    M5,
                    73.5,
                    "maderix/ANE PR #50 (M5 Max)",
                    false,
                )
            },
            stories,
            256,
            maderix,
        ),
        (
            row(
                "Qwen3-0.6B",
                M5,
                320.0,
                "maderix/ANE PR #50 (M5 Max)",
                false,
            ),
            qwen,
            256,
            maderix,
        ),
        (
            Published {
                curve: "the M4 Max's curves (ANEForge)",
                rates: Rates::m4_max,
                known_miss: Some(
                    "η, fitted to maderix/ANE's programs (0.563): rustane's leave less of the compiled curve (the one direct measurement of a dynamic-weight matmul, maderix/ANE PR #35, is 0.23–0.24 of it at 4096), and its AdamW on the Metal GPU (55 ms) is not costed; `doctor` measures η at our own shapes",
                ),
                ..row("rustane 600M", M4, 865.0, "rustane README (M4 Max)", false)
            },
            rustane,
            512,
            // Ten kernels, multi-head too (rustane README, "ANE kernels
            // (10)"). Its update runs on the Metal GPU (55 ms of 958 in the
            // README's 600m-A run), which this model has no rates for: the
            // step is predicted without it.
            SeedStep {
                vocab: 8192,
                optimizer: false,
                fused_mha: false,
            },
        ),
    ]
}

/// The seed's programs for `cfg` at `seq` (untiled, as the seed runs
/// them), within `family`'s axis caps.
pub fn seed_plan(
    cfg: &ModelConfig,
    seq: usize,
    family: ane::family::Family,
) -> anyhow::Result<Plan> {
    let mut opts = crate::kernels::KernelOptions::seed(cfg);
    opts.limits = opts.limits.with_max_dim(family.limits().max_spatial);
    Ok(crate::kernels::tiling::plan(
        &crate::kernels::Shape::new(cfg, seq),
        &opts,
    )?)
}

/// The seed's step of `cfg` at `seq` on `rates`' family.
pub fn predict_seed(
    cfg: &ModelConfig,
    seq: usize,
    step: SeedStep,
    rates: &Rates,
) -> anyhow::Result<Predicted> {
    let plan = seed_plan(cfg, seq, rates.family)?;
    let setup = StepSetup::new(seq, 1, None, None, false, DeviceBuffers::Persistent);
    Ok(predict(cfg, &plan, &setup, rates, Some(step)))
}

/// Fits [`ane::cost::Fitted`] to the published steps marked `fitted` (the
/// M4's two): Newton's method on (1/η, per-evaluation overhead), which the
/// step time is nearly linear in; two equations, two unknowns.
pub fn fit() -> anyhow::Result<ane::cost::Fitted> {
    use ane::cost::Fitted;
    let rows: Vec<_> = published().into_iter().filter(|r| r.0.fitted).collect();
    anyhow::ensure!(rows.len() == 2, "the fit takes two published steps");
    let err = |x: f64, y: f64| -> anyhow::Result<[f64; 2]> {
        let f = Fitted {
            dynamic_efficiency: 1.0 / x,
            host_ms_per_eval: y,
        };
        let mut e = [0.0; 2];
        for (i, (p, cfg, seq, sd)) in rows.iter().enumerate() {
            let r = (p.rates)().with_fitted(f);
            e[i] = predict_seed(cfg, *seq, *sd, &r)?.step_ms - p.ms;
        }
        Ok(e)
    };
    let (mut x, mut y) = (2.0, 0.1);
    for _ in 0..20 {
        let e = err(x, y)?;
        let h = 1e-4;
        let (ex, ey) = (err(x + h, y)?, err(x, y + h)?);
        let j = [
            [(ex[0] - e[0]) / h, (ey[0] - e[0]) / h],
            [(ex[1] - e[1]) / h, (ey[1] - e[1]) / h],
        ];
        let det = j[0][0] * j[1][1] - j[0][1] * j[1][0];
        anyhow::ensure!(det.abs() > 1e-12, "the two steps do not determine the fit");
        x -= (j[1][1] * e[0] - j[0][1] * e[1]) / det;
        y -= (j[0][0] * e[1] - j[1][0] * e[0]) / det;
    }
    Ok(Fitted {
        dynamic_efficiency: 1.0 / x,
        host_ms_per_eval: y,
    })
}

/// A published step beside the model's prediction.
#[derive(Clone, Debug, Serialize)]
pub struct Validation {
    pub published: Published,
    pub predicted: Predicted,
    /// (predicted − published) / published.
    pub error: f64,
}

/// Every published step predicted with the table's rates.
pub fn validate() -> anyhow::Result<Vec<Validation>> {
    published()
        .into_iter()
        .map(|(p, cfg, seq, sd)| {
            let predicted = predict_seed(&cfg, seq, sd, &(p.rates)())?;
            Ok(Validation {
                error: predicted.step_ms / p.ms - 1.0,
                published: p,
                predicted,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::timeline::rates_for;

    /// What `doctor` measured on this chip replaces the table's row for
    /// its family only.
    #[test]
    fn measured_timing_replaces_the_table_for_its_family() {
        use ane::family::{Family, Profile, Source};
        let mut p = Profile::of(Family::M4, Source::Env);
        p.timing = Some(ane::family::Measured {
            dispatch_ms: 0.5,
            matmuls: vec![],
            write_gbs: 5.0,
            compile_ms: 10.0,
            scratch: None,
        });
        let (m4, m5) = (rates_for(Family::M4, &p), rates_for(Family::M5, &p));
        assert_eq!((m4.dispatch_ms, m4.copy_gbs), (0.5, 5.0));
        assert_eq!(m5.dispatch_ms, Rates::of(Family::M5).dispatch_ms);
        // Slower dispatch and staging: a slower predicted step.
        let cfg = ModelConfig::preset("tiny").unwrap();
        let (sd, seq) = (
            SeedStep {
                vocab: 256,
                optimizer: true,
                fused_mha: false,
            },
            64,
        );
        let table = predict_seed(&cfg, seq, sd, &Rates::of(Family::M4)).unwrap();
        let measured = predict_seed(&cfg, seq, sd, &m4).unwrap();
        assert!(measured.dispatch_ms > table.dispatch_ms && measured.staging_ms > table.staging_ms);
    }

    #[test]
    fn the_fitted_constants_are_the_fit_of_the_m4_steps() {
        let f = fit().unwrap();
        let t = ane::cost::FITTED;
        assert!(
            (f.dynamic_efficiency - t.dynamic_efficiency).abs() < 0.005
                && (f.host_ms_per_eval - t.host_ms_per_eval).abs() < 0.005,
            "fit {f:?}, table {t:?}"
        );
        assert!(
            f.host_ms_per_eval >= 0.0 && f.dynamic_efficiency > 0.0 && f.dynamic_efficiency <= 1.0
        );
    }

    /// The fitted steps are met; the held-out ones (another chip, another
    /// project) within ±35%, but for those said to miss, with the reason.
    #[test]
    fn held_out_steps_are_predicted_within_35_percent() {
        for v in validate().unwrap() {
            eprintln!(
                "{:<14} {} predicted {:>7.1} ms, published {:>6.1} ms ({:+.1}%): {}",
                v.published.name,
                v.published.family.name(),
                v.predicted.step_ms,
                v.published.ms,
                100.0 * v.error,
                v.predicted.describe()
            );
            match (v.published.fitted, v.published.known_miss) {
                (true, _) => assert!(v.error.abs() <= 0.02, "{v:?}"),
                (false, None) => assert!(v.error.abs() <= 0.35, "{v:?}"),
                // Said to miss: the note stays true or goes.
                (false, Some(why)) => {
                    assert!(v.error.abs() > 0.35, "no longer missed ({why}): {v:?}")
                }
            }
        }
    }
}
