//! Model configuration: Hugging Face `config.json` (the families in
//! [`FAMILIES`]) or a built-in preset, validated before anything is
//! allocated.

mod hf;
mod rope;

pub use rope::RopeScaling;

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

    /// A published config of testdata/configs/.
    fn published(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../testdata/configs/{name}.json"))
    }

    /// The one-line refusal of config JSON `text`.
    fn refused(text: &str) -> String {
        format!("{:#}", ModelConfig::from_json(text).unwrap_err())
    }
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
            let e = refused(&text);
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
            let e = refused(&text);
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
        let path = published("gemma-2-2b");
        let c = ModelConfig::from_file(&path).unwrap();
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
        let e = refused(&v.to_string());
        assert!(e.contains("must be a positive number"), "{e}");
        let e = refused(&QWEN3.replace(
            "\"rope_scaling\": null",
            "\"final_logit_softcapping\": 30.0",
        ));
        assert!(e.contains("is Gemma 2's"), "{e}");
        let e = refused(&QWEN3.replace(
            "\"rope_scaling\": null",
            "\"rope_local_base_freq\": 10000.0",
        ));
        assert!(e.contains("is Gemma's"), "{e}");
    }

    /// OLMo 2 1B as published: norms after each sublayer only, QK-norm over
    /// the whole projections (weights `[heads·HD]`), 1,484,916,736
    /// parameters (transformers' Olmo2ForCausalLM of that config).
    #[test]
    fn olmo2_configs_are_read_with_post_norms_and_whole_qk_norms() {
        use crate::model::layer::{Role, Sublayer};
        let path = published("olmo-2-1b");
        let c = ModelConfig::from_file(&path).unwrap();
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
        let path = published("phi-4-mini");
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
                    let e = refused(&bad.to_string());
                    assert!(e.contains(want), "{key}: {e}");
                }
            }
        }
        let mut short = v.clone();
        short["rope_scaling"]["short_factor"] = serde_json::json!(vec![1.0; 64]);
        short["rope_scaling"]["long_factor"] = serde_json::json!(vec![1.0; 64]);
        let e = refused(&short.to_string());
        assert!(e.contains("must hold 48 numbers"), "{e}");
        let e = refused(&QWEN3.replace("\"rope_scaling\": null", "\"partial_rotary_factor\": 0.5"));
        assert!(e.contains("is Phi-3's"), "{e}");
    }

    /// Gemma 3 4B as published (`Gemma3ForConditionalGeneration`, a
    /// `text_config` of six keys): the text model with Gemma3TextConfig's
    /// defaults, as transformers reads it (its parameter count equals
    /// transformers' Gemma3ForCausalLM of that text config, 3,880,263,168);
    /// another multimodal type refused by name.
    #[test]
    fn a_multimodal_gemma3_config_is_read_as_its_text_model() {
        let path = published("gemma-3-4b");
        let c = ModelConfig::from_file(&path).unwrap();
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
        let e = refused(other);
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
