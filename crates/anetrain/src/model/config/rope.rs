//! How a checkpoint scales RoPE's frequencies (transformers'
//! `rope_type`): read from `rope_scaling` or `rope_parameters`, written
//! back in both spellings.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// How a checkpoint scales RoPE's inverse frequencies (transformers'
/// `rope_type`, in `rope_scaling` or transformers 5's `rope_parameters`;
/// `kernels::inv_freqs` computes them as `modeling_rope_utils` does).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// θ^(−2i/HD).
    #[default]
    Default,
    /// Every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's: wavelengths past `original / low_freq_factor` divided
    /// by `factor`, those under `original / high_freq_factor` kept, a
    /// smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN: frequencies blended between θ's and θ's over `factor` along a
    /// ramp between the dimensions that turn `beta_fast` and `beta_slow`
    /// times over the original context; cos and sin scaled by
    /// `attention_factor` (resolved from `mscale`s when not given).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// LongRoPE (Phi-3's 128k checkpoints, Phi-4-mini): θ's frequency i
    /// divided by `short_factor[i]` while a sequence stays within
    /// `original_max_position_embeddings`, by `long_factor[i]` past it
    /// (transformers decides per forward, by its last position); cos and
    /// sin scaled by `attention_factor` (√(1 + ln s / ln original) for
    /// s = max / original, when not given).
    Longrope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

/// YaRN's `mscale` (the paper's Eq. 21; transformers' `yarn_get_mscale`).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * scale.ln() + 1.0,
    }
}

impl RopeScaling {
    /// What cos and sin are multiplied by (YaRN's attention factor; 1
    /// elsewhere).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::Longrope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    pub fn is_default(&self) -> bool {
        *self == RopeScaling::Default
    }

    /// The sequence length past which the frequencies change (LongRoPE's
    /// original context); `None` when they never do.
    pub fn switches_after(&self) -> Option<usize> {
        match self {
            RopeScaling::Longrope {
                original_max_position_embeddings,
                ..
            } => Some(*original_max_position_embeddings),
            _ => None,
        }
    }

    /// The scaling a config's `rope_scaling` or `rope_parameters` object
    /// describes (its `rope_type`, or the older `type`); a type not built
    /// is refused by name. `max_positions` and `original` are the config's
    /// own `max_position_embeddings` and `original_max_position_embeddings`
    /// (Phi-3 keeps the latter beside the scaling's keys).
    pub(super) fn from_hf(
        v: &serde_json::Map<String, serde_json::Value>,
        max_positions: Option<usize>,
        original: Option<usize>,
    ) -> Result<RopeScaling> {
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let num = |k: &str| -> Result<f64> {
            v.get(k)
                .and_then(|x| x.as_f64())
                .filter(|x| x.is_finite() && *x > 0.0)
                .with_context(|| format!("rope_type \"{kind}\" needs a positive \"{k}\""))
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: num("factor")?,
            },
            "llama3" => {
                let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
                if high <= low {
                    bail!("rope_type \"llama3\" needs high_freq_factor above low_freq_factor");
                }
                RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: num("original_max_position_embeddings")?
                        as usize,
                }
            }
            "yarn" => {
                let factor = num("factor")?;
                let opt = |k: &str| v.get(k).and_then(|x| x.as_f64()).filter(|x| *x != 0.0);
                let attention_factor = match (opt("attention_factor"), opt("mscale"), opt("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                    _ => yarn_mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: num("original_max_position_embeddings")?
                        as usize,
                    beta_fast: opt("beta_fast").unwrap_or(32.0),
                    beta_slow: opt("beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate: v.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
                }
            }
            // Phi3Config reads the older "su" and "yarn" names of its own
            // scaling as longrope.
            "longrope" | "su" => {
                let factors = |k: &str| -> Result<Vec<f64>> {
                    v.get(k)
                        .and_then(|f| f.as_array())
                        .and_then(|f| f.iter().map(|x| x.as_f64()).collect::<Option<Vec<f64>>>())
                        .filter(|f| f.iter().all(|x| x.is_finite() && *x > 0.0))
                        .with_context(|| {
                            format!("rope_type \"longrope\" needs \"{k}\", a list of positive numbers")
                        })
                };
                let (short_factor, long_factor) = (factors("short_factor")?, factors("long_factor")?);
                if short_factor.len() != long_factor.len() {
                    bail!("rope_type \"longrope\": short_factor and long_factor differ in length");
                }
                let original = match v.get("original_max_position_embeddings") {
                    Some(_) => num("original_max_position_embeddings")? as usize,
                    None => original.context(
                        "rope_type \"longrope\" needs \"original_max_position_embeddings\"",
                    )?,
                };
                let factor = match v.get("factor") {
                    Some(_) => num("factor")?,
                    None => max_positions.unwrap_or(original) as f64 / original as f64,
                };
                let attention_factor = match v.get("attention_factor").and_then(|x| x.as_f64()) {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
                };
                RopeScaling::Longrope {
                    short_factor,
                    long_factor,
                    original_max_position_embeddings: original,
                    attention_factor,
                }
            }
            other => bail!(
                "rope_type \"{other}\" is not built yet; anetrain reads RoPE of type default, linear, llama3, yarn and longrope"
            ),
        };
        Ok(scaling)
    }

    /// The keys transformers writes for it (`rope_parameters` beside θ).
    pub fn hf_keys(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}
