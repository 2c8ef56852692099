//! Model configuration: Hugging Face `config.json` (the families in
//! [`FAMILIES`]) or a built-in preset, validated before anything is
//! allocated.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::model::layer::{
    Fused, LayerClass, LayerDims, LayerSpec, Mixer, Mlp, Norms, Projection, QkNorm, PHI3_FUSED,
};

/// Architecture family: decides the layer's parts, the config's defaults
/// and the names written to config.json.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    Llama,
    Qwen3,
    /// Llama's layer with biases on q, k and v (Qwen2, Qwen2.5).
    Qwen2,
    /// Llama's layer; attention may be limited to a sliding window.
    Mistral,
    /// Llama's layer with scalar multipliers ([`Scales`]).
    Granite,
    /// Llama's layer; some layers have no RoPE (`no_rope_layers`).
    SmolLM3,
    /// Mistral's layer; `layer_types` says which layers see the window.
    Ministral,
    /// Gemma 3's text model: norms before and after each sublayer (scaling
    /// by `1 + w`), GeGLU, QK-norm, embeddings scaled by √D, windowed
    /// layers with their own RoPE base between full ones.
    Gemma3,
    /// Gemma 2: Gemma 3's layer without QK-norm, windowed and full layers
    /// in turn (one RoPE base), and tanh soft-capping of the attention
    /// scores and of the logits ([`Scales`]).
    Gemma2,
    /// OLMo 2: norms after each sublayer only (none before), and QK-norm
    /// over the whole q and k projections.
    Olmo2,
    /// Phi-3 and Phi-4-mini: Llama's layer with q, k, v stored as one
    /// `qkv_proj` and gate, up as one `gate_up_proj` (split on load, fused
    /// on save), RoPE on part of each head (`partial_rotary_factor`),
    /// `longrope` scaling, and on some checkpoints a window.
    Phi3,
}

/// Every family read: `(arch, model_type, the transformers class)`.
pub const FAMILIES: [(Arch, &str, &str); 11] = [
    (Arch::Qwen3, "qwen3", "Qwen3ForCausalLM"),
    (Arch::Qwen2, "qwen2", "Qwen2ForCausalLM"),
    (Arch::Llama, "llama", "LlamaForCausalLM"),
    (Arch::Mistral, "mistral", "MistralForCausalLM"),
    (Arch::Granite, "granite", "GraniteForCausalLM"),
    (Arch::SmolLM3, "smollm3", "SmolLM3ForCausalLM"),
    (Arch::Ministral, "ministral", "MinistralForCausalLM"),
    (Arch::Gemma3, "gemma3_text", "Gemma3ForCausalLM"),
    (Arch::Gemma2, "gemma2", "Gemma2ForCausalLM"),
    (Arch::Olmo2, "olmo2", "Olmo2ForCausalLM"),
    (Arch::Phi3, "phi3", "Phi3ForCausalLM"),
];

impl Arch {
    /// The family's `model_type`.
    pub fn model_type(self) -> &'static str {
        FAMILIES.iter().find(|f| f.0 == self).map_or("", |f| f.1)
    }

    /// The transformers class its checkpoints load as.
    pub fn class(self) -> &'static str {
        FAMILIES.iter().find(|f| f.0 == self).map_or("", |f| f.2)
    }

    /// Gemma's layer and embedding: `(1 + w)` norms before and after each
    /// sublayer, GeGLU, √D embeddings, `query_pre_attn_scalar`.
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// The family a config names, by `model_type` or else by class.
    fn of(model_type: &str, classes: &[String]) -> Option<Arch> {
        FAMILIES
            .iter()
            .find(|f| f.1 == model_type)
            .or_else(|| FAMILIES.iter().find(|f| classes.iter().any(|c| c == f.2)))
            .map(|f| f.0)
    }
}

/// Scalars some families put on the residual stream, the scores and the
/// logits: Granite's multipliers (`embedding_multiplier`,
/// `residual_multiplier`, `attention_multiplier`, `logits_scaling`),
/// Gemma's √D embedding and `query_pre_attn_scalar`, Gemma 2's tanh
/// soft-capping (`attn_logit_softcapping`, `final_logit_softcapping`);
/// every other family has the defaults.
///   x₀ = m_e·E[t],  x ← x + m_r·sublayer(x),  scores = m_a·qᵀk,  logits = W·x_f / s
///   capped: scores ← c_a·tanh(scores/c_a) (before the mask),  logits ← c_l·tanh(logits/c_l)
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scales {
    pub embedding: f64,
    pub residual: f64,
    /// The attention scores' scale; `None` is 1/√head_dim.
    pub attention: Option<f64>,
    /// The logits are divided by this.
    pub logits: f64,
    /// The attention scores' soft cap c_a, when they have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_cap: Option<f64>,
    /// The logits' soft cap c_l, when they have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logits_cap: Option<f64>,
}

impl Default for Scales {
    fn default() -> Scales {
        Scales {
            embedding: 1.0,
            residual: 1.0,
            attention: None,
            logits: 1.0,
            attention_cap: None,
            logits_cap: None,
        }
    }
}

impl Scales {
    fn is_default(&self) -> bool {
        *self == Scales::default()
    }
}

/// Everything the kernels, engines and weight I/O need to know about a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// `bos_token_id`/`eos_token_id` as config.json has them (an id, or a
    /// list for models with several end tokens); written back unchanged,
    /// or set from the tokenizer when a preset is trained from scratch.
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// `pad_token_id`, written back unchanged (SmolLM3Config's default,
    /// 128004, lies outside a smaller vocabulary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<serde_json::Value>,
    /// MLX's affine quantization of the checkpoint's matrices, when it has
    /// one (`crate::model::quant`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<crate::model::quant::Quantization>,
    /// Granite's multipliers (the defaults elsewhere).
    #[serde(default, skip_serializing_if = "Scales::is_default")]
    pub scales: Scales,
    /// Mistral's attention window: a query sees itself and the
    /// `window − 1` keys before it (`kernels::visible_keys`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// The layers that attend to every earlier key despite the window
    /// (Ministral's `"full_attention"` entries of `layer_types`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub full_attention_layers: Vec<usize>,
    /// The windowed layers' own RoPE base, unscaled (Gemma's
    /// `rope_local_base_freq`); `None`, every layer's is `rope_theta`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rope_theta: Option<f64>,
    /// The layers without rotary positions (SmolLM3's NoPE layers, the
    /// zeros of its `no_rope_layers`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_rope_layers: Vec<usize>,
    /// How RoPE's frequencies are scaled (Llama 3.1/3.2's `llama3`).
    #[serde(default, skip_serializing_if = "RopeScaling::is_default")]
    pub rope_scaling: RopeScaling,
    /// The dimensions RoPE rotates when not all of a head's: the first
    /// `partial_rotary_factor·head_dim` (Phi's), the rest passed through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary: Option<usize>,
    /// The multimodal checkpoint this text model was read from (Gemma 3's
    /// 4B and larger, `Gemma3ForConditionalGeneration`): its own
    /// `config.json`, written back with this model's as its `text_config`;
    /// the text model's tensors sit under [`ModelConfig::tensor_prefix`]
    /// and the others (the vision tower's) are kept as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multimodal: Option<serde_json::Value>,
}

/// Multimodal families whose text model is read: `(model_type, class,
/// the text model's tensor prefix, the text model's own model_type, the
/// decoder layers' module path in transformers — what PEFT names — and in
/// mlx-lm)`.
#[allow(clippy::type_complexity)]
const MULTIMODAL: [(&str, &str, &str, &str, &str, &str); 1] = [(
    "gemma3",
    "Gemma3ForConditionalGeneration",
    "language_model.",
    "gemma3_text",
    "model.language_model.layers",
    "language_model.model.layers",
)];

/// Gemma3TextConfig's defaults for the keys published multimodal Gemma 3
/// configs leave out of their `text_config` (transformers 5.25
/// `configuration_gemma3.py`); the others are the family's defaults below.
const GEMMA3_TEXT_DEFAULTS: [(&str, u64); 5] = [
    ("vocab_size", 262_208),
    ("hidden_size", 2304),
    ("intermediate_size", 9216),
    ("num_hidden_layers", 26),
    ("num_attention_heads", 8),
];

/// Names accepted by `--model` besides a directory.
pub const PRESETS: &[&str] = &[
    "qwen3-0.6b",
    "stories15m",
    "stories42m",
    "stories110m",
    "tiny",
];

/// Upper bound on the parameters a configuration may describe: 16
/// billion, a guard against corrupt configs (the 8B models, 8.0–8.2
/// billion, are within it). What a run can hold is the memory plan's to
/// say: full training needs 16 bytes a parameter, a LoRA base its
/// file's size, a 4-bit one about 0.56 bytes a parameter.
const MAX_PARAMS: u128 = 16_000_000_000;

/// A Hugging Face `config.json`, as far as anetrain reads it (other keys
/// are ignored). [`ModelConfig::from_json`] turns it into a [`ModelConfig`]
/// with transformers' defaults and validates the result.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    architectures: Option<Vec<String>>,
    hidden_size: Count,
    intermediate_size: Count,
    num_hidden_layers: Count,
    num_attention_heads: Count,
    num_key_value_heads: Option<Count>,
    head_dim: Option<Count>,
    vocab_size: Count,
    /// θ (transformers 4); transformers 5 writes `rope_parameters`.
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<Count>,
    /// Refused unless null: scaled RoPE variants are not supported.
    rope_scaling: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<serde_json::Value>,
    /// Mistral's window (null: none; absent: 4096, transformers' default).
    sliding_window: Option<Count>,
    /// Ministral's per-layer attention: `"sliding_attention"` or
    /// `"full_attention"`.
    layer_types: Option<Vec<String>>,
    /// SmolLM3's per-layer RoPE flags (1: RoPE, 0: none), or the
    /// interval its default puts a NoPE layer at.
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<Count>,
    /// Gemma's: the scores' scale is its inverse square root; the windowed
    /// layers' RoPE base; the window's period when `layer_types` is
    /// absent; its activation; soft-capping (null in Gemma 3).
    query_pre_attn_scalar: Option<f64>,
    rope_local_base_freq: Option<f64>,
    sliding_window_pattern: Option<Count>,
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
    /// Granite's multipliers.
    embedding_multiplier: Option<f64>,
    residual_multiplier: Option<f64>,
    attention_multiplier: Option<f64>,
    logits_scaling: Option<f64>,
    /// Phi-3's: the context RoPE was trained at (beside `rope_scaling`),
    /// the share of each head RoPE rotates, and its dropouts.
    original_max_position_embeddings: Option<Count>,
    partial_rotary_factor: Option<f64>,
    resid_pdrop: Option<f64>,
    embd_pdrop: Option<f64>,
}

/// transformers 5's `rope_parameters`: θ, and the scaling's own keys.
#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    #[serde(flatten)]
    scaling: serde_json::Map<String, serde_json::Value>,
}

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
    fn from_hf(
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

/// A size in a config: a non-negative integer that fits a `usize`.
struct Count(usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Count, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Count, E> {
                usize::try_from(v)
                    .map(Count)
                    .map_err(|_| E::custom(format!("{v} is too large")))
            }
        }
        d.deserialize_u64(Visitor)
    }
}

/// The model directory `path` names: a directory holding `config.json`,
/// or `config.json` itself (its directory is meant). Anything else is a
/// one-line error saying what to give: a weights file, a LoRA run (its
/// base and how to use it), a directory without a config.
pub fn model_directory(path: &Path) -> Result<std::path::PathBuf> {
    let parent = || {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    };
    if path.is_file() {
        if path.file_name().is_some_and(|n| n == "config.json") {
            return Ok(parent());
        }
        bail!(
            "'{}' is a file; a model is the directory holding config.json and the weights: give '{}'",
            path.display(),
            parent().display()
        );
    }
    if !path.is_dir() {
        bail!("model directory '{}' does not exist", path.display());
    }
    let adapter = path.join("adapter_config.json");
    if !path.join("config.json").is_file() && adapter.is_file() {
        // A LoRA run directory: say so, and how to use it.
        let base = std::fs::read_to_string(&adapter)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["base_model_name_or_path"].as_str().map(str::to_string))
            .unwrap_or_else(|| "BASE".into());
        bail!(
            "'{}' is a LoRA adapter, not a model: use --model {base} --adapter {} (train: --init-adapter {} to continue training it)",
            path.display(),
            path.display(),
            path.display()
        );
    }
    if !path.join("config.json").is_file() {
        bail!(
            "'{}' has no config.json: a model directory holds config.json and its safetensors weights (a Hugging Face model directory)",
            path.display()
        );
    }
    Ok(path.to_path_buf())
}

impl ModelConfig {
    /// A built-in configuration by name.
    pub fn preset(name: &str) -> Option<ModelConfig> {
        let llama2c = |dim, hidden, layers, heads, max_pos| ModelConfig {
            arch: Arch::Llama,
            hidden_size: dim,
            intermediate_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: heads,
            head_dim: dim / heads,
            vocab_size: 32000,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            max_position_embeddings: max_pos,
            qk_norm: false,
            bos_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
            quantization: None,
            scales: Scales::default(),
            sliding_window: None,
            no_rope_layers: vec![],
            full_attention_layers: vec![],
            local_rope_theta: None,
            rope_scaling: RopeScaling::Default,
            partial_rotary: None,
            multimodal: None,
        };
        Some(match name {
            "qwen3-0.6b" => ModelConfig {
                arch: Arch::Qwen3,
                hidden_size: 1024,
                intermediate_size: 3072,
                num_hidden_layers: 28,
                num_attention_heads: 16,
                num_key_value_heads: 8,
                head_dim: 128,
                vocab_size: 151936,
                rope_theta: 1_000_000.0,
                rms_norm_eps: 1e-6,
                tie_word_embeddings: true,
                max_position_embeddings: 40960,
                qk_norm: true,
                bos_token_id: None,
                eos_token_id: None,
                pad_token_id: None,
                quantization: None,
                scales: Scales::default(),
                sliding_window: None,
                no_rope_layers: vec![],
                full_attention_layers: vec![],
                local_rope_theta: None,
                rope_scaling: RopeScaling::Default,
                partial_rotary: None,
                multimodal: None,
            },
            "stories15m" => llama2c(288, 768, 6, 6, 256),
            "stories42m" => llama2c(512, 1376, 8, 8, 1024),
            "stories110m" => llama2c(768, 2048, 12, 12, 1024),
            "tiny" => ModelConfig {
                arch: Arch::Qwen3,
                hidden_size: 128,
                intermediate_size: 384,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 32,
                vocab_size: 512,
                rope_theta: 10000.0,
                rms_norm_eps: 1e-6,
                tie_word_embeddings: true,
                max_position_embeddings: 512,
                qk_norm: true,
                bos_token_id: None,
                eos_token_id: None,
                pad_token_id: None,
                quantization: None,
                scales: Scales::default(),
                sliding_window: None,
                no_rope_layers: vec![],
                full_attention_layers: vec![],
                local_rope_theta: None,
                rope_scaling: RopeScaling::Default,
                partial_rotary: None,
                multimodal: None,
            },
            _ => return None,
        })
    }

    /// A preset name, or a model directory holding `config.json`.
    pub fn resolve(spec: &str) -> Result<ModelConfig> {
        if let Some(c) = ModelConfig::preset(spec) {
            return Ok(c);
        }
        let p = Path::new(spec);
        let weights = p.extension().is_some_and(|e| {
            ["safetensors", "bin", "gguf", "pt", "pth"].contains(&&*e.to_string_lossy())
        });
        if p.is_dir() || (p.is_file() && weights) {
            return ModelConfig::from_file(&model_directory(p)?.join("config.json"));
        }
        if p.is_file() {
            return ModelConfig::from_file(p);
        }
        let near = PRESETS
            .iter()
            .map(|p| (strsim::levenshtein(&spec.to_lowercase(), p), *p))
            .filter(|(d, _)| *d <= 2)
            .min();
        let hint = match near {
            // `Qwen3-0.6B` for `qwen3-0.6b`: the name of a pretrained model.
            Some((0, p)) => {
                let id = match p.starts_with("qwen3") {
                    true => format!("Qwen/{spec}"),
                    false => "ORG/NAME".into(),
                };
                format!(
                    "; the preset '{p}' is that shape randomly initialised — for the pretrained model give its Hub id ({id}), a model directory, or `anetrain convert` a llama2.c checkpoint"
                )
            }
            Some((_, p)) => format!("; did you mean '{p}'?"),
            None => String::new(),
        };
        bail!(
            "'{spec}' is neither a preset ({}) nor a model directory{hint}",
            PRESETS.join(", ")
        )
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read '{}'", path.display()))?;
        ModelConfig::from_json(&text).with_context(|| format!("'{}'", path.display()))
    }

    /// Parses Hugging Face config JSON (a family of [`FAMILIES`]) and
    /// validates it.
    /// (One field after another, each with its own default and error.)
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let v: serde_json::Value = serde_json::from_str(text).context("invalid JSON")?;
        if !v.is_object() {
            bail!("expected a JSON object");
        }
        let quantization = crate::model::quant::Quantization::from_config(&v)?;
        if let Some(text) = v.get("text_config") {
            return ModelConfig::from_multimodal(&v, text, quantization);
        }
        let window_given = v.get("sliding_window").is_some();
        // Gemma 2's caps: absent is Gemma2Config's default, null is none.
        let cap_given = |k: &str| v.get(k).is_some();
        let caps_given = (
            cap_given("attn_logit_softcapping"),
            cap_given("final_logit_softcapping"),
        );
        let hf: HfConfig = serde_path_to_error::deserialize(v).map_err(|e| {
            let inner = e.inner().to_string();
            match inner.strip_prefix("missing field `") {
                Some(rest) => anyhow::anyhow!("missing \"{}\"", rest.trim_end_matches('`')),
                None => anyhow::anyhow!("\"{}\": {inner}", e.path()),
            }
        })?;
        let model_type = hf.model_type.as_deref().unwrap_or("");
        let archs = hf.architectures.unwrap_or_default();
        let Some(arch) = Arch::of(model_type, &archs) else {
            let known: Vec<&str> = FAMILIES.iter().map(|f| f.1).collect();
            bail!(
                "unsupported model_type '{model_type}' (architectures {archs:?}); anetrain trains {}, and the text model of a multimodal {}",
                known.join(", "),
                MULTIMODAL.map(|m| m.0).join(", ")
            )
        };
        let (hidden, heads) = (hf.hidden_size.0, hf.num_attention_heads.0);
        if heads == 0 {
            bail!("\"num_attention_heads\" must be at least 1");
        }
        let mut rope_theta = hf.rope_theta;
        let mut rope_scaling = RopeScaling::Default;
        let mut rotary_factor = hf.partial_rotary_factor;
        let max_positions = hf.max_position_embeddings.as_ref().map(|c| c.0);
        let original = hf.original_max_position_embeddings.as_ref().map(|c| c.0);
        let mut local_rope_theta = hf.rope_local_base_freq;
        if let Some(p) = hf.rope_parameters {
            match (arch, p.scaling.get("full_attention")) {
                // Gemma 3's, per layer type (transformers 5).
                (Arch::Gemma3, Some(full)) => {
                    let part =
                        |v: Option<&serde_json::Value>| -> Result<(Option<f64>, RopeScaling)> {
                            let mut m = v.and_then(|v| v.as_object()).cloned().unwrap_or_default();
                            let theta = m.remove("rope_theta").and_then(|t| t.as_f64());
                            Ok((theta, RopeScaling::from_hf(&m, max_positions, original)?))
                        };
                    let (theta, scaling) = part(Some(full))?;
                    rope_theta = theta.or(rope_theta);
                    rope_scaling = scaling;
                    let (theta, local) = part(p.scaling.get("sliding_attention"))?;
                    if !local.is_default() {
                        bail!("\"rope_parameters\".sliding_attention: a scaled RoPE on the windowed layers is not supported");
                    }
                    local_rope_theta = theta.or(local_rope_theta);
                }
                _ => {
                    rope_scaling = RopeScaling::from_hf(&p.scaling, max_positions, original)?;
                    rope_theta = p.rope_theta.or(rope_theta);
                    let factor = p.scaling.get("partial_rotary_factor");
                    rotary_factor = factor.and_then(|f| f.as_f64()).or(rotary_factor);
                }
            }
        }
        match hf.rope_scaling {
            Some(serde_json::Value::Object(s)) if rope_scaling.is_default() => {
                rope_scaling = RopeScaling::from_hf(&s, max_positions, original)?;
            }
            Some(serde_json::Value::Object(_)) | Some(serde_json::Value::Null) | None => {}
            Some(s) => bail!("\"rope_scaling\" must be an object or null (got {s})"),
        }
        if hf.use_sliding_window == Some(true) {
            bail!("\"use_sliding_window\": true is not supported (full causal attention only)");
        }
        for (k, v) in [
            ("attention_bias", hf.attention_bias),
            ("mlp_bias", hf.mlp_bias),
        ] {
            if v == Some(true) {
                bail!("\"{k}\": true is not supported (bias-free projections only)");
            }
        }
        // Gemma's keys (Gemma 3's own: a windowed RoPE base and pattern).
        let gemma = [
            (
                "query_pre_attn_scalar",
                hf.query_pre_attn_scalar.is_some(),
                arch.is_gemma(),
            ),
            (
                "rope_local_base_freq",
                hf.rope_local_base_freq.is_some(),
                arch == Arch::Gemma3,
            ),
            (
                "sliding_window_pattern",
                hf.sliding_window_pattern.is_some(),
                arch == Arch::Gemma3,
            ),
        ];
        if let Some((k, _, _)) = gemma.iter().find(|(_, given, read)| *given && !read) {
            bail!("\"{k}\" is Gemma's; a {model_type} model has none (is model_type right?)");
        }
        // Gemma 2's tanh soft-capping (Gemma2Config: 50 and 30 when
        // absent); Gemma 3 sets both to null.
        let mut caps = [
            ("attn_logit_softcapping", hf.attn_logit_softcapping, 50.0),
            ("final_logit_softcapping", hf.final_logit_softcapping, 30.0),
        ];
        for ((k, v, default), given) in caps.iter_mut().zip([caps_given.0, caps_given.1]) {
            match (arch, *v) {
                (Arch::Gemma2, None) if !given => *v = Some(*default),
                (Arch::Gemma2, Some(c)) if !(c.is_finite() && c > 0.0) => {
                    bail!("\"{k}\" must be a positive number or null (got {c})")
                }
                (Arch::Gemma2, _) | (_, None) => {}
                (_, Some(c)) => bail!(
                    "\"{k}\": {c} (tanh soft-capping) is Gemma 2's; a {model_type} model has none (is model_type right?)"
                ),
            }
        }
        if hf.use_bidirectional_attention == Some(true) {
            bail!("\"use_bidirectional_attention\": true is not supported (causal attention only)");
        }
        let activation = hf.hidden_activation.or(hf.hidden_act);
        let wanted = match arch {
            Arch::Gemma2 | Arch::Gemma3 => "gelu_pytorch_tanh",
            _ => "silu",
        };
        if let Some(a) = activation.filter(|a| a != wanted) {
            bail!(
                "the MLP's activation '{a}' is not supported (a {model_type} model's is {wanted})"
            );
        }
        // Each family's own keys; elsewhere refused by name.
        let multipliers = [
            ("embedding_multiplier", hf.embedding_multiplier),
            ("residual_multiplier", hf.residual_multiplier),
            ("attention_multiplier", hf.attention_multiplier),
            ("logits_scaling", hf.logits_scaling),
        ];
        let mut scales = Scales::default();
        if arch == Arch::Granite {
            for (k, v) in multipliers {
                if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                    bail!("\"{k}\" must be a positive number");
                }
            }
            scales = Scales {
                embedding: hf.embedding_multiplier.unwrap_or(1.0),
                residual: hf.residual_multiplier.unwrap_or(1.0),
                attention: Some(hf.attention_multiplier.unwrap_or(1.0)),
                logits: hf.logits_scaling.unwrap_or(1.0),
                ..Scales::default()
            };
        } else if let Some((k, _)) = multipliers.iter().find(|(_, v)| v.is_some()) {
            bail!("\"{k}\" is Granite's; a {model_type} model has none (is model_type right?)");
        }
        scales.attention_cap = caps[0].1;
        scales.logits_cap = caps[1].1;
        if arch.is_gemma() {
            // Gemma3TextScaledWordEmbedding (Gemma 2's likewise) multiplies by √D as an f32
            // tensor; the scores scale by query_pre_attn_scalar^-½.
            let scalar = hf.query_pre_attn_scalar.unwrap_or(256.0);
            if !(scalar.is_finite() && scalar > 0.0) {
                bail!("\"query_pre_attn_scalar\" must be a positive number");
            }
            scales.embedding = (hidden as f64).sqrt() as f32 as f64;
            scales.attention = Some(scalar.powf(-0.5));
            if arch == Arch::Gemma3 {
                local_rope_theta = local_rope_theta.or(Some(10000.0));
            }
        }
        // RoPE on the first `factor·head_dim` dimensions of each head.
        let head_dim = hf.head_dim.as_ref().map_or(
            match arch {
                Arch::Qwen3 => 128,
                Arch::Gemma2 | Arch::Gemma3 => 256,
                _ => hidden / heads,
            },
            |c| c.0,
        );
        let partial_rotary = match rotary_factor.filter(|f| *f != 1.0) {
            None => None,
            Some(f) if arch != Arch::Phi3 => bail!(
                "\"partial_rotary_factor\": {f} is Phi-3's; a {model_type} model rotates whole heads (is model_type right?)"
            ),
            Some(f) if !(f.is_finite() && f > 0.0 && f < 1.0) => {
                bail!("\"partial_rotary_factor\" must be in (0, 1] (got {f})")
            }
            // transformers: int(head_dim · factor).
            Some(f) => match (head_dim as f64 * f) as usize {
                d if d == 0 || d % 2 == 1 => bail!(
                    "\"partial_rotary_factor\" {f} rotates {d} of {head_dim} dimensions a head; RoPE needs an even, non-zero count"
                ),
                d => Some(d),
            },
        };
        if let RopeScaling::Longrope { short_factor, .. } = &rope_scaling {
            let pairs = partial_rotary.unwrap_or(head_dim) / 2;
            if short_factor.len() != pairs {
                bail!(
                    "rope_type \"longrope\": short_factor and long_factor must hold {pairs} numbers, one per rotated pair (got {})",
                    short_factor.len()
                );
            }
        }
        for (k, v) in [
            ("resid_pdrop", hf.resid_pdrop),
            ("embd_pdrop", hf.embd_pdrop),
        ] {
            if let Some(p) = v.filter(|p| *p != 0.0) {
                bail!("\"{k}\": {p} (dropout on the residual stream) is not built; set it to 0.0 to fine-tune this checkpoint");
            }
        }
        let sliding_window = match (arch, hf.sliding_window) {
            // MistralConfig's, MinistralConfig's and Gemma3TextConfig's
            // default when absent.
            (Arch::Mistral | Arch::Ministral | Arch::Gemma2 | Arch::Gemma3, None)
                if !window_given =>
            {
                Some(4096)
            }
            (Arch::Mistral | Arch::Ministral | Arch::Gemma2 | Arch::Gemma3, w) => w.map(|c| c.0),
            // Phi3Config's window applies to every layer when given; one at
            // least as long as the context is none.
            (Arch::Phi3, w) => w
                .map(|c| c.0)
                .filter(|&w| w < max_positions.unwrap_or(4096)),
            (_, None) => None,
            // Qwen's configs carry a window their layers use only with
            // use_sliding_window, refused above.
            (Arch::Qwen3 | Arch::Qwen2, Some(_)) => None,
            (_, Some(_)) => bail!(
                "\"sliding_window\" is not read for a {model_type} model (is model_type right?)"
            ),
        };
        if sliding_window == Some(0) {
            bail!("\"sliding_window\" must be at least 1");
        }
        let layers = hf.num_hidden_layers.0;
        let no_rope_layers = match (arch, hf.no_rope_layers) {
            (Arch::SmolLM3, Some(flags)) => {
                if flags.len() != layers || flags.iter().any(|&f| f > 1) {
                    bail!(
                        "\"no_rope_layers\" must hold a 0 or 1 for each of the {layers} layers (got {flags:?})"
                    );
                }
                (0..layers).filter(|&i| flags[i] == 0).collect()
            }
            // transformers' default: every interval-th layer has no RoPE.
            (Arch::SmolLM3, None) => {
                let every = hf.no_rope_layer_interval.map_or(4, |c| c.0).max(1);
                (0..layers).filter(|i| (i + 1) % every == 0).collect()
            }
            (_, None) if hf.no_rope_layer_interval.is_none() => vec![],
            (_, _) => bail!(
                "\"no_rope_layers\" is SmolLM3's; a {model_type} model has none (is model_type right?)"
            ),
        };
        // Only Ministral's layers read `layer_types` (the other families'
        // configs carry one their attention ignores).
        let full_attention_layers = match (arch, hf.layer_types, sliding_window) {
            // Gemma3TextConfig's default: every sixth layer (the pattern's) full.
            (Arch::Gemma3, None, Some(_)) => {
                let every = hf.sliding_window_pattern.map_or(6, |c| c.0).max(1);
                (0..layers).filter(|i| (i + 1) % every == 0).collect()
            }
            // Gemma2Config's: windowed and full layers in turn, from a
            // windowed one.
            (Arch::Gemma2, None, Some(_)) => (0..layers).filter(|i| i % 2 == 1).collect(),
            (Arch::Ministral | Arch::Gemma2 | Arch::Gemma3, Some(types), Some(_)) => {
                if types.len() != layers {
                    bail!(
                        "\"layer_types\" must name the attention of each of the {layers} layers (it has {})",
                        types.len()
                    );
                }
                let mut full = vec![];
                for (i, t) in types.iter().enumerate() {
                    match t.as_str() {
                        "sliding_attention" => {}
                        "full_attention" => full.push(i),
                        other => bail!(
                            "\"layer_types\"[{i}] is '{other}'; a {model_type} layer is sliding_attention or full_attention"
                        ),
                    }
                }
                full
            }
            _ => vec![],
        };
        // transformers' defaults where a key is absent.
        let cfg = ModelConfig {
            arch,
            hidden_size: hidden,
            intermediate_size: hf.intermediate_size.0,
            num_hidden_layers: hf.num_hidden_layers.0,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.map_or(
                match arch {
                    Arch::Qwen3 | Arch::Qwen2 => 32,
                    Arch::Mistral | Arch::Ministral => 8,
                    Arch::SmolLM3 | Arch::Gemma2 | Arch::Gemma3 => 4,
                    Arch::Llama | Arch::Granite | Arch::Phi3 | Arch::Olmo2 => heads,
                },
                |c| c.0,
            ),
            // Qwen3Config 128, Gemma's 256, the others hidden/heads.
            head_dim,
            vocab_size: hf.vocab_size.0,
            // SmolLM3Config's default_theta 2e6, the others' 10000.
            rope_theta: rope_theta.unwrap_or(match arch {
                Arch::SmolLM3 => 2e6,
                Arch::Gemma3 => 1e6,
                _ => 10000.0,
            }),
            // Olmo2Config's 1e-5, the others' 1e-6.
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(match arch {
                Arch::Olmo2 => 1e-5,
                _ => 1e-6,
            }),
            tie_word_embeddings: hf
                .tie_word_embeddings
                .unwrap_or(matches!(arch, Arch::SmolLM3 | Arch::Gemma2 | Arch::Gemma3)),
            max_position_embeddings: hf.max_position_embeddings.map_or(
                match arch {
                    Arch::Qwen3 | Arch::Qwen2 | Arch::SmolLM3 => 32768,
                    Arch::Mistral | Arch::Ministral | Arch::Gemma3 => 4096 * 32,
                    Arch::Gemma2 => 8192,
                    Arch::Llama | Arch::Granite | Arch::Olmo2 => 2048,
                    Arch::Phi3 => 4096,
                },
                |c| c.0,
            ),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Olmo2),
            bos_token_id: hf.bos_token_id.filter(|v| !v.is_null()),
            eos_token_id: hf.eos_token_id.filter(|v| !v.is_null()),
            pad_token_id: hf.pad_token_id.filter(|v| !v.is_null()),
            quantization,
            scales,
            sliding_window,
            full_attention_layers,
            local_rope_theta: local_rope_theta.filter(|_| arch == Arch::Gemma3),
            no_rope_layers,
            rope_scaling,
            partial_rotary,
            multimodal: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The text model of a multimodal checkpoint's config `outer` (a
    /// family of [`MULTIMODAL`]): its `text_config`, the family's text
    /// defaults where keys are left out, the token ids and quantization
    /// of the outer config where the text one has none.
    fn from_multimodal(
        outer: &serde_json::Value,
        text: &serde_json::Value,
        quantization: Option<crate::model::quant::Quantization>,
    ) -> Result<ModelConfig> {
        let model_type = outer["model_type"].as_str().unwrap_or("");
        let classes: Vec<&str> = outer["architectures"]
            .as_array()
            .map(|a| a.iter().filter_map(|c| c.as_str()).collect())
            .unwrap_or_default();
        let Some(&(_, _, _, text_type, _, _)) = MULTIMODAL
            .iter()
            .find(|m| m.0 == model_type || classes.contains(&m.1))
        else {
            bail!(
                "a multimodal model_type '{model_type}' (it has a text_config): anetrain reads the text model of {} checkpoints only",
                MULTIMODAL.map(|m| m.0).join(", ")
            );
        };
        let Some(text) = text.as_object() else {
            bail!("\"text_config\" must be an object");
        };
        let mut t = text.clone();
        t.insert("model_type".into(), text_type.into());
        t.remove("architectures");
        for (k, v) in GEMMA3_TEXT_DEFAULTS {
            t.entry(k).or_insert(v.into());
        }
        for k in [
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "tie_word_embeddings",
        ] {
            if let (false, Some(v)) = (t.contains_key(k), outer.get(k)) {
                t.insert(k.into(), v.clone());
            }
        }
        let mut cfg = ModelConfig::from_json(&serde_json::Value::Object(t).to_string())
            .context("\"text_config\"")?;
        cfg.quantization = quantization;
        cfg.multimodal = Some(outer.clone());
        Ok(cfg)
    }

    /// Where the text model's tensors sit in the checkpoint: under
    /// `language_model.` in a multimodal one, at the top otherwise.
    pub fn tensor_prefix(&self) -> &'static str {
        match &self.multimodal {
            Some(_) => MULTIMODAL
                .iter()
                .find(|m| m.3 == self.arch.model_type())
                .map_or("", |m| m.2),
            None => "",
        }
    }

    /// The decoder layers' module path as transformers (and so PEFT) and
    /// mlx-lm name it: `model.layers`, or inside a multimodal model.
    pub fn layer_paths(&self) -> (&'static str, &'static str) {
        match &self.multimodal {
            Some(_) => MULTIMODAL
                .iter()
                .find(|m| m.3 == self.arch.model_type())
                .map_or(("model.layers", "model.layers"), |m| (m.4, m.5)),
            None => ("model.layers", "model.layers"),
        }
    }

    /// Rejects configurations that cannot work, before anything is allocated.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        for (k, v) in [
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
            ("vocab_size", c.vocab_size),
            ("max_position_embeddings", c.max_position_embeddings),
        ] {
            if v == 0 {
                bail!("\"{k}\" must be at least 1");
            }
            if v > 1 << 24 {
                bail!("\"{k}\" = {v} is absurdly large");
            }
        }
        if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                c.num_attention_heads,
                c.num_key_value_heads
            );
        }
        if !c.head_dim.is_multiple_of(2) {
            bail!("head_dim ({}) must be even for RoPE", c.head_dim);
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 1.0) {
            bail!(
                "rope_theta ({}) must be a finite number above 1",
                c.rope_theta
            );
        }
        if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0 && c.rms_norm_eps < 1.0) {
            bail!("rms_norm_eps ({}) must be in (0, 1)", c.rms_norm_eps);
        }
        let params = self.num_params();
        if params > MAX_PARAMS {
            bail!(
                "the configuration describes {:.1} billion parameters; anetrain refuses more than {} billion",
                params as f64 / 1e9,
                MAX_PARAMS / 1_000_000_000
            );
        }
        Ok(())
    }

    /// The attention scores' scale: 1/√head_dim, or Granite's
    /// `attention_multiplier`.
    pub fn score_scale(&self) -> f64 {
        self.scales
            .attention
            .unwrap_or(1.0 / (self.head_dim as f64).sqrt())
    }

    /// The padding token: transformers builds every family's embedding as
    /// `nn.Embedding(…, padding_idx=pad_token_id)`, whose row for it
    /// takes no gradient from the lookup.
    pub fn padding_idx(&self) -> Option<u32> {
        let id = self.pad_token_id.as_ref()?.as_u64()?;
        u32::try_from(id)
            .ok()
            .filter(|&i| (i as usize) < self.vocab_size)
    }

    /// The dimensions of a head RoPE rotates (the first ones).
    pub fn rotary_dim(&self) -> usize {
        self.partial_rotary.unwrap_or(self.head_dim)
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn gqa_ratio(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The description of the model's decoder layers (every layer of the
    /// architectures read today is the same): Qwen3's attention normalises
    /// queries and keys per head, Qwen2's has biases on q, k and v,
    /// Llama's (Mistral's, Granite's) neither; all have SwiGLU MLPs and
    /// norms before each sublayer.
    pub fn layer(&self) -> LayerSpec {
        LayerSpec {
            mixer: Mixer::Attention {
                qk_norm: match (self.qk_norm, self.arch) {
                    (false, _) => QkNorm::None,
                    (true, Arch::Olmo2) => QkNorm::Whole,
                    (true, _) => QkNorm::PerHead,
                },
                qkv_bias: self.arch == Arch::Qwen2,
            },
            mlp: match self.arch {
                Arch::Gemma2 | Arch::Gemma3 => Mlp::GeGlu,
                _ => Mlp::SwiGlu,
            },
            norms: match self.arch {
                Arch::Gemma2 | Arch::Gemma3 => Norms::Sandwich,
                Arch::Olmo2 => Norms::Post,
                _ => Norms::Pre,
            },
        }
    }

    /// The projections the family stores as one matrix (Phi-3's).
    pub fn fused(&self) -> &'static [Fused] {
        match self.arch {
            Arch::Phi3 => &PHI3_FUSED,
            _ => &[],
        }
    }

    /// The fused matrix projection `t` is stored in, if any.
    pub fn fused_of(&self, t: Projection) -> Option<&'static Fused> {
        self.fused().iter().find(|f| f.parts.contains(&t))
    }

    /// Whether Hugging Face stores the weights otherwise than training
    /// holds them (Gemma's norm weights without their offset, Phi's fused
    /// projections, a multimodal checkpoint's prefix and vision tower): such a model is written through
    /// `Model::safetensors_bytes`, never as its checkpoint's file.
    pub fn stored_otherwise(&self) -> bool {
        self.norm_offset() != 0.0 || !self.fused().is_empty() || self.multimodal.is_some()
    }

    /// What a stored RMSNorm weight lacks of the scale it applies: 1 for
    /// Gemma (`x·(1 + w)`), 0 elsewhere. Weights are held as the scale
    /// (`Model::fold_norm_offsets`) and stored as Hugging Face stores them
    /// (`Model::hf_values`).
    pub fn norm_offset(&self) -> f32 {
        match self.arch {
            Arch::Gemma2 | Arch::Gemma3 => 1.0,
            _ => 0.0,
        }
    }

    /// What layer `i` has of its own: RoPE or none, its attention window.
    pub fn layer_class(&self, i: usize) -> LayerClass {
        LayerClass {
            rope: !self.no_rope_layers.contains(&i),
            window: self
                .sliding_window
                .filter(|_| !self.full_attention_layers.contains(&i)),
            local_rope: self.local_rope_theta.is_some() && !self.full_attention_layers.contains(&i),
        }
    }

    /// The model's distinct layer classes, in the order layers first have
    /// them.
    pub fn layer_classes(&self) -> Vec<LayerClass> {
        let mut out: Vec<LayerClass> = vec![];
        for i in 0..self.num_hidden_layers {
            let c = self.layer_class(i);
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }

    /// Layer `i`'s class's position in [`ModelConfig::layer_classes`].
    pub fn class_index(&self, i: usize) -> usize {
        let c = self.layer_class(i);
        self.layer_classes()
            .iter()
            .position(|k| *k == c)
            .unwrap_or(0)
    }

    /// The sizes the layers' parts are made of.
    pub fn layer_dims(&self) -> LayerDims {
        LayerDims {
            hidden: self.hidden_size,
            q: self.q_dim(),
            kv: self.kv_dim(),
            head_dim: self.head_dim,
            intermediate: self.intermediate_size,
        }
    }

    /// Parameter count (u128: a hostile config must not overflow).
    pub fn num_params(&self) -> u128 {
        let count = |shape: &[usize]| shape.iter().map(|&n| n as u128).product::<u128>();
        let per_layer: u128 = self
            .layer()
            .params(&self.layer_dims())
            .iter()
            .map(|p| count(&p.shape))
            .sum();
        let d = self.hidden_size as u128;
        let emb = self.vocab_size as u128 * d;
        emb * if self.tie_word_embeddings { 1 } else { 2 }
            + per_layer * self.num_hidden_layers as u128
            + d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layer::Projection;

    const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": true, "max_position_embeddings": 40960, "rope_scaling": null}"#;

    #[test]
    fn qwen3_json_equals_preset() {
        let c = ModelConfig::from_json(QWEN3).unwrap();
        assert_eq!(c, ModelConfig::preset("qwen3-0.6b").unwrap());
        assert_eq!((c.q_dim(), c.kv_dim(), c.gqa_ratio()), (2048, 1024, 2));
        // 596M parameters with tied embeddings (Qwen3-0.6B reports 0.6B).
        assert_eq!(c.num_params() / 1_000_000, 596);
    }

    #[test]
    fn presets_validate() {
        for p in PRESETS {
            ModelConfig::preset(p).unwrap().validate().unwrap();
        }
        assert_eq!(ModelConfig::preset("stories15m").unwrap().head_dim, 48);
    }

    #[test]
    fn bad_configs_are_rejected_with_the_reason() {
        let cases = [
            (
                QWEN3.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
                "multiple of num_key_value_heads",
            ),
            (
                QWEN3.replace("\"head_dim\": 128", "\"head_dim\": 127"),
                "must be even",
            ),
            (
                QWEN3.replace("\"hidden_size\": 1024", "\"hidden_size\": -3"),
                "positive integer",
            ),
            (
                QWEN3.replace("\"vocab_size\": 151936,", ""),
                "missing \"vocab_size\"",
            ),
            (
                QWEN3.replace("\"hidden_size\": 1024", "\"hidden_size\": 16000000"),
                "billion parameters",
            ),
            (
                QWEN3
                    .replace("qwen3\"", "gpt2\"")
                    .replace("Qwen3ForCausalLM", "GPT2"),
                "unsupported model_type",
            ),
            ("[1, 2]".to_string(), "JSON object"),
            ("{\"hidden".to_string(), "invalid JSON"),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", ModelConfig::from_json(&text).unwrap_err());
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    /// Each family's own keys are read for it and refused elsewhere by
    /// name; an unknown model_type is refused naming every family read.
    #[test]
    fn families_read_their_own_keys_and_refuse_the_others() {
        let llama = QWEN3
            .replace("qwen3\"", "llama\"")
            .replace("Qwen3ForCausalLM", "LlamaForCausalLM");
        let granite = llama
            .replace("llama\"", "granite\"")
            .replace("LlamaForCausalLM", "GraniteForCausalLM")
            .replace(
                "\"rope_scaling\": null",
                "\"embedding_multiplier\": 12.0, \"residual_multiplier\": 0.22, \"attention_multiplier\": 0.015625, \"logits_scaling\": 8.0",
            );
        let c = ModelConfig::from_json(&granite).unwrap();
        assert_eq!(c.arch, Arch::Granite);
        assert_eq!(c.score_scale(), 0.015625);
        assert_eq!(
            (c.scales.embedding, c.scales.residual, c.scales.logits),
            (12.0, 0.22, 8.0)
        );
        let e = ModelConfig::from_json(&granite.replace("granite\"", "llama\"")).unwrap_err();
        assert!(
            e.to_string()
                .contains("\"embedding_multiplier\" is Granite's"),
            "{e}"
        );

        let mistral = llama
            .replace("llama\"", "mistral\"")
            .replace("\"rope_scaling\": null", "\"sliding_window\": 64");
        let c = ModelConfig::from_json(&mistral).unwrap();
        assert_eq!((c.arch, c.sliding_window), (Arch::Mistral, Some(64)));
        let e = ModelConfig::from_json(&mistral.replace(": 64", ": 0")).unwrap_err();
        assert!(format!("{e:#}").contains("at least 1"), "{e:#}");
        // Absent, transformers' 4096; null, none.
        let c = ModelConfig::from_json(&llama.replace("llama\"", "mistral\"")).unwrap();
        assert_eq!(c.sliding_window, Some(4096));
        let c = ModelConfig::from_json(&mistral.replace(": 64", ": null")).unwrap();
        assert_eq!(c.layer_class(0).window, None);

        // Ministral: its layer_types say which layers see the window.
        let types = |t: &str| {
            let all = vec![format!("\"{t}\""); 28].join(", ");
            mistral
                .replace("mistral\"", "ministral\"")
                .replace("64", &format!("64, \"layer_types\": [{all}]"))
        };
        let both =
            types("sliding_attention").replacen("\"sliding_attention\"", "\"full_attention\"", 1);
        let c = ModelConfig::from_json(&both).unwrap();
        assert_eq!(
            (c.arch, c.full_attention_layers.clone()),
            (Arch::Ministral, vec![0])
        );
        assert_eq!(
            (c.layer_class(0).window, c.layer_class(1).window),
            (None, Some(64))
        );
        assert_eq!(c.layer_classes().len(), 2);
        let e = ModelConfig::from_json(&types("chunked_attention")).unwrap_err();
        assert!(format!("{e:#}").contains("'chunked_attention'"), "{e:#}");

        let qwen2 = QWEN3
            .replace("qwen3\"", "qwen2\"")
            .replace("Qwen3ForCausalLM", "Qwen2ForCausalLM");
        let c = ModelConfig::from_json(&qwen2).unwrap();
        assert_eq!(
            c.layer().biased(),
            [Projection::Q, Projection::K, Projection::V]
        );
        assert!(ModelConfig::from_json(QWEN3)
            .unwrap()
            .layer()
            .biased()
            .is_empty());

        let e = ModelConfig::from_json(
            &QWEN3
                .replace("qwen3\"", "olmo\"")
                .replace("Qwen3ForCausalLM", "OlmoForCausalLM"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("'olmo'")
                && e.contains(
                    "qwen3, qwen2, llama, mistral, granite, smollm3, ministral, gemma3_text, gemma2, olmo2, phi3"
                ),
            "{e}"
        );

        // SmolLM3: its per-layer flags, or transformers' default of every
        // fourth layer without RoPE (and SmolLM3Config's θ of 2e6).
        let smol = llama
            .replace("llama\"", "smollm3\"")
            .replace("LlamaForCausalLM", "SmolLM3ForCausalLM");
        let c = ModelConfig::from_json(&smol.replace(", \"rope_theta\": 1000000", "")).unwrap();
        assert_eq!((c.arch, c.rope_theta), (Arch::SmolLM3, 2e6));
        assert_eq!(c.no_rope_layers, (3..28).step_by(4).collect::<Vec<_>>());
        assert_eq!(c.layer_classes().len(), 2);
        assert!(c.layer_class(2).rope && !c.layer_class(3).rope);
        assert_eq!(c.class_index(7), 1);
        let flags = |f: &str| {
            smol.replace(
                "\"rope_scaling\": null",
                &format!("\"no_rope_layers\": {f}"),
            )
        };
        let ones = format!("[{}0]", "1, ".repeat(27));
        assert_eq!(
            ModelConfig::from_json(&flags(&ones))
                .unwrap()
                .no_rope_layers,
            [27]
        );
        let e = ModelConfig::from_json(&flags("[1, 0]")).unwrap_err();
        assert!(format!("{e:#}").contains("each of the 28 layers"), "{e:#}");
        let e = ModelConfig::from_json(&flags(&ones).replace("smollm3\"", "llama\"")).unwrap_err();
        assert!(
            format!("{e:#}").contains("\"no_rope_layers\" is SmolLM3's"),
            "{e:#}"
        );
    }

    /// RoPE scaling read from transformers 4's `rope_scaling` (its older
    /// `type` key too) or transformers 5's `rope_parameters`; a type not
    /// built refused by name.
    #[test]
    fn rope_scaling_is_read_in_both_spellings() {
        let llama3 = r#"{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        let want = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let v4 = QWEN3.replace(
            "\"rope_scaling\": null",
            &format!("\"rope_scaling\": {llama3}"),
        );
        assert_eq!(ModelConfig::from_json(&v4).unwrap().rope_scaling, want);
        let v5 = QWEN3.replace(
            "\"rope_scaling\": null",
            &format!(
                "\"rope_parameters\": {}",
                llama3.replace("{", "{\"rope_theta\": 500000.0, ")
            ),
        );
        let c = ModelConfig::from_json(&v5).unwrap();
        assert_eq!((c.rope_scaling, c.rope_theta), (want, 500000.0));
        let linear = QWEN3.replace(
            "\"rope_scaling\": null",
            "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 8.0}",
        );
        let c = ModelConfig::from_json(&linear).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        // YaRN's attention factor from its mscales when not given.
        let yarn = QWEN3.replace(
            "\"rope_scaling\": null",
            "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768, \"mscale\": 1.0, \"mscale_all_dim\": 0.5}",
        );
        let c = ModelConfig::from_json(&yarn).unwrap();
        let want = (0.1 * 4f64.ln() + 1.0) / (0.05 * 4f64.ln() + 1.0);
        assert!((c.rope_scaling.attention_factor() - want).abs() < 1e-12);
        for (bad, want) in [
            (
                "{\"rope_type\": \"dynamic\", \"factor\": 4.0}",
                "\"dynamic\" is not built yet",
            ),
            (
                "{\"rope_type\": \"longrope\", \"long_factor\": [1.0]}",
                "needs \"short_factor\", a list of positive numbers",
            ),
            (
                "{\"rope_type\": \"yarn\", \"factor\": 4.0}",
                "\"original_max_position_embeddings\"",
            ),
            ("{\"rope_type\": \"linear\"}", "needs a positive \"factor\""),
        ] {
            let text = QWEN3.replace(
                "\"rope_scaling\": null",
                &format!("\"rope_scaling\": {bad}"),
            );
            let e = format!("{:#}", ModelConfig::from_json(&text).unwrap_err());
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    /// Every published shape in testdata/configs/ is read as transformers
    /// reads it: its parameter count equals the one transformers builds
    /// (`scripts/count_params.py`, testdata/configs/params.json).
    #[test]
    fn published_configs_have_transformers_parameter_counts() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/configs");
        let counts: std::collections::BTreeMap<String, u64> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("params.json")).unwrap())
                .unwrap();
        assert!(counts.len() >= 17, "{counts:?}");
        for (name, want) in counts {
            let c = ModelConfig::from_file(&dir.join(format!("{name}.json"))).unwrap();
            assert_eq!(c.num_params() as u64, want, "{name}");
        }
    }

    /// Gemma 2 2B as published: windowed and full layers in turn, both
    /// soft caps, √D embeddings and the query scalar, 2,614,341,888
    /// parameters (transformers' Gemma2ForCausalLM of that config); caps
    /// absent are Gemma2Config's 50 and 30, null is none, and a cap on
    /// another family is refused by name.
    #[test]
    fn gemma2_configs_are_read_with_their_soft_caps() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/configs/gemma-2-2b.json"
        );
        let c = ModelConfig::from_file(Path::new(path)).unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.num_params()),
            (Arch::Gemma2, 256, 2_614_341_888)
        );
        assert_eq!(
            (c.scales.attention_cap, c.scales.logits_cap),
            (Some(50.0), Some(30.0))
        );
        assert_eq!(
            c.full_attention_layers,
            (1..26).step_by(2).collect::<Vec<_>>()
        );
        assert_eq!((c.sliding_window, c.local_rope_theta), (Some(4096), None));
        assert_eq!(c.score_scale(), 1.0 / 16.0);
        assert_eq!(c.scales.embedding, (2304f64).sqrt() as f32 as f64);
        assert!(!c.qk_norm && c.tie_word_embeddings && c.norm_offset() == 1.0);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("final_logit_softcapping");
        v["attn_logit_softcapping"] = serde_json::Value::Null;
        let c = ModelConfig::from_json(&v.to_string()).unwrap();
        assert_eq!(
            (c.scales.attention_cap, c.scales.logits_cap),
            (None, Some(30.0))
        );
        v["attn_logit_softcapping"] = serde_json::json!(-1.0);
        let e = format!("{:#}", ModelConfig::from_json(&v.to_string()).unwrap_err());
        assert!(e.contains("must be a positive number"), "{e}");
        let e = format!(
            "{:#}",
            ModelConfig::from_json(&QWEN3.replace(
                "\"rope_scaling\": null",
                "\"final_logit_softcapping\": 30.0"
            ))
            .unwrap_err()
        );
        assert!(e.contains("is Gemma 2's"), "{e}");
        let e = format!(
            "{:#}",
            ModelConfig::from_json(&QWEN3.replace(
                "\"rope_scaling\": null",
                "\"rope_local_base_freq\": 10000.0"
            ))
            .unwrap_err()
        );
        assert!(e.contains("is Gemma's"), "{e}");
    }

    /// OLMo 2 1B as published: norms after each sublayer only, QK-norm over
    /// the whole projections (weights `[heads·HD]`), 1,484,916,736
    /// parameters (transformers' Olmo2ForCausalLM of that config).
    #[test]
    fn olmo2_configs_are_read_with_post_norms_and_whole_qk_norms() {
        use crate::model::layer::{Role, Sublayer};
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/configs/olmo-2-1b.json"
        );
        let c = ModelConfig::from_file(Path::new(path)).unwrap();
        assert_eq!((c.arch, c.num_params()), (Arch::Olmo2, 1_484_916_736));
        let spec = c.layer();
        assert_eq!(
            (spec.norms, spec.qk_norm_kind()),
            (Norms::Post, QkNorm::Whole)
        );
        let params = spec.params(&c.layer_dims());
        assert!(!params.iter().any(|p| matches!(p.role, Role::Norm(_))));
        let named = |role| params.iter().find(|p| p.role == role).unwrap();
        assert_eq!(named(Role::QNorm).shape, vec![2048]);
        assert_eq!(
            named(Role::PostNorm(Sublayer::Mlp)).name,
            "post_feedforward_layernorm.weight"
        );
        assert_eq!(c.norm_offset(), 0.0);
    }

    /// Phi-4-mini's shape: RoPE on 96 of 128 dimensions, LongRoPE with
    /// its attention factor from max / original, a window as long as the
    /// context read as none, the head tied; what does not fit is refused
    /// by name.
    #[test]
    fn phi3_configs_are_read_with_what_changes_the_maths() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/configs/phi-4-mini.json"
        );
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["rope_scaling"] = serde_json::json!({"type": "longrope",
            "short_factor": vec![1.0; 48], "long_factor": vec![2.0; 48]});
        let c = ModelConfig::from_json(&v.to_string()).unwrap();
        assert_eq!((c.arch, c.head_dim, c.rotary_dim()), (Arch::Phi3, 128, 96));
        assert_eq!((c.sliding_window, c.tie_word_embeddings), (None, true));
        assert_eq!(c.rope_scaling.switches_after(), Some(4096));
        let want = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt();
        assert!((c.rope_scaling.attention_factor() - want).abs() < 1e-12);
        // 3.84 B, as published.
        assert_eq!(c.num_params() / 10_000_000, 383);
        assert_eq!(c.fused().len(), 2);
        for (key, value, want) in [
            (
                "partial_rotary_factor",
                serde_json::json!(0.7),
                "an even, non-zero count",
            ),
            (
                "resid_pdrop",
                serde_json::json!(0.1),
                "\"resid_pdrop\": 0.1",
            ),
            ("sliding_window", serde_json::json!(2047), ""),
        ] {
            let mut bad = v.clone();
            bad[key] = value;
            match want {
                "" => {
                    let c = ModelConfig::from_json(&bad.to_string()).unwrap();
                    assert_eq!(
                        c.layer_class(0).window,
                        Some(2047),
                        "a window shorter than the context"
                    );
                }
                want => {
                    let e = format!(
                        "{:#}",
                        ModelConfig::from_json(&bad.to_string()).unwrap_err()
                    );
                    assert!(e.contains(want), "{key}: {e}");
                }
            }
        }
        let mut short = v.clone();
        short["rope_scaling"]["short_factor"] = serde_json::json!(vec![1.0; 64]);
        short["rope_scaling"]["long_factor"] = serde_json::json!(vec![1.0; 64]);
        let e = format!(
            "{:#}",
            ModelConfig::from_json(&short.to_string()).unwrap_err()
        );
        assert!(e.contains("must hold 48 numbers"), "{e}");
        let e = format!(
            "{:#}",
            ModelConfig::from_json(
                &QWEN3.replace("\"rope_scaling\": null", "\"partial_rotary_factor\": 0.5")
            )
            .unwrap_err()
        );
        assert!(e.contains("is Phi-3's"), "{e}");
    }

    /// Gemma 3 4B as published (`Gemma3ForConditionalGeneration`, a
    /// `text_config` of six keys): the text model with Gemma3TextConfig's
    /// defaults, as transformers reads it (its parameter count equals
    /// transformers' Gemma3ForCausalLM of that text config, 3,880,263,168);
    /// another multimodal type refused by name.
    #[test]
    fn a_multimodal_gemma3_config_is_read_as_its_text_model() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/configs/gemma-3-4b.json"
        );
        let c = ModelConfig::from_file(Path::new(path)).unwrap();
        assert_eq!(
            (c.arch, c.vocab_size, c.hidden_size),
            (Arch::Gemma3, 262_208, 2560)
        );
        assert_eq!(
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            (8, 4, 256)
        );
        assert_eq!(
            (c.sliding_window, c.full_attention_layers[0]),
            (Some(1024), 5)
        );
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.local_rope_theta, Some(10000.0));
        assert_eq!(c.num_params(), 3_880_263_168);
        assert_eq!(c.eos_token_id, Some(serde_json::json!([1, 106])));
        assert_eq!(c.tensor_prefix(), "language_model.");
        assert_eq!(c.layer_paths().0, "model.language_model.layers");
        let other = r#"{"model_type": "llava", "text_config": {"model_type": "llama"}}"#;
        let e = format!("{:#}", ModelConfig::from_json(other).unwrap_err());
        assert!(
            e.contains("'llava'") && e.contains("gemma3 checkpoints only"),
            "{e}"
        );
    }

    /// The description yields Hugging Face's parameter names and order
    /// for Qwen3 (QK-norm) and Llama, and the parameter count of the
    /// configuration.
    #[test]
    fn qwen3_and_llama_are_two_descriptions() {
        for (preset, qk) in [("qwen3-0.6b", true), ("stories110m", false)] {
            let cfg = ModelConfig::preset(preset).unwrap();
            let spec = cfg.layer();
            assert_eq!(spec.qk_norm(), qk);
            let names: Vec<&str> = spec
                .params(&cfg.layer_dims())
                .iter()
                .map(|p| p.name)
                .collect();
            let mut want = vec![
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
            ];
            if qk {
                want.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
            }
            want.extend([
                "post_attention_layernorm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ]);
            assert_eq!(names, want, "{preset}");
            // By hand: q, k, v, o, gate, up, down, two norms (+ QK-norm's two).
            let (d, h, q, kv) = (
                cfg.hidden_size as u128,
                cfg.intermediate_size as u128,
                cfg.q_dim() as u128,
                cfg.kv_dim() as u128,
            );
            let qk_norms = if qk { 2 * cfg.head_dim as u128 } else { 0 };
            let per_layer = 2 * d * q + 2 * d * kv + 3 * d * h + 2 * d + qk_norms;
            let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
            let want =
                heads * cfg.vocab_size as u128 * d + cfg.num_hidden_layers as u128 * per_layer + d;
            assert_eq!(cfg.num_params(), want, "{preset}");
        }
    }
}
