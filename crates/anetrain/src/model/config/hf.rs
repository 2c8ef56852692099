//! Reading a Hugging Face `config.json`: every key that changes the
//! maths, transformers' defaults where one is absent, a key of another
//! family refused by name; a multimodal checkpoint read as its text model.

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use super::{Arch, ModelConfig, RopeScaling, Scales, FAMILIES};

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

impl ModelConfig {
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
}
