//! Model configuration: Hugging Face `config.json` (Qwen3 and Llama) or a
//! built-in preset, validated before anything is allocated.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Architecture family: decides QK-norm and the names written to config.json.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    Llama,
    Qwen3,
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
}

/// Names accepted by `--model` besides a directory.
pub const PRESETS: &[&str] = &[
    "qwen3-0.6b",
    "stories15m",
    "stories42m",
    "stories110m",
    "tiny",
];

/// Upper bound on parameters we agree to allocate (f32 weights + grads +
/// AdamW state is 16 bytes per parameter): 8 billion.
const MAX_PARAMS: u128 = 8_000_000_000;

/// θ from `rope_theta` (transformers 4) or `rope_parameters.rope_theta`
/// (transformers 5); other RoPE types (scaled, YaRN, ...) are refused.
fn rope_theta(obj: &serde_json::Map<String, serde_json::Value>) -> Result<f64> {
    let mut theta = None;
    if let Some(v) = obj.get("rope_theta").filter(|v| !v.is_null()) {
        theta = Some(
            v.as_f64()
                .with_context(|| format!("\"rope_theta\" must be a number, got {v}"))?,
        );
    }
    if let Some(p) = obj.get("rope_parameters").filter(|v| !v.is_null()) {
        let kind = p
            .get("rope_type")
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if kind != "default" {
            bail!("rope_type \"{kind}\" is not supported; only plain RoPE models can be trained");
        }
        if let Some(v) = p.get("rope_theta").filter(|v| !v.is_null()) {
            theta = Some(v.as_f64().with_context(|| {
                format!("\"rope_parameters.rope_theta\" must be a number, got {v}")
            })?);
        }
    }
    Ok(theta.unwrap_or(10000.0))
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
        if p.is_dir() {
            return ModelConfig::from_file(&p.join("config.json"));
        }
        if p.is_file() {
            return ModelConfig::from_file(p);
        }
        bail!(
            "'{spec}' is neither a preset ({}) nor a model directory",
            PRESETS.join(", ")
        )
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read '{}'", path.display()))?;
        ModelConfig::from_json(&text).with_context(|| format!("'{}'", path.display()))
    }

    /// Parses Hugging Face config JSON (Qwen3 or Llama) and validates it.
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let v: serde_json::Value = serde_json::from_str(text).context("invalid JSON")?;
        let obj = v.as_object().context("expected a JSON object")?;
        let model_type = obj.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
        let archs: Vec<&str> = obj
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        let arch = if model_type == "qwen3" || archs.iter().any(|a| a.starts_with("Qwen3")) {
            Arch::Qwen3
        } else if model_type == "llama" || archs.iter().any(|a| a.starts_with("Llama")) {
            Arch::Llama
        } else {
            bail!("unsupported model_type '{model_type}' (architectures {archs:?}); anetrain trains qwen3 and llama models")
        };
        let uint = |k: &str| -> Result<usize> {
            let val = obj.get(k).with_context(|| format!("missing \"{k}\""))?;
            let n = val
                .as_u64()
                .with_context(|| format!("\"{k}\" must be a positive integer, got {val}"))?;
            usize::try_from(n).with_context(|| format!("\"{k}\" = {n} is too large"))
        };
        let opt_uint = |k: &str| -> Result<Option<usize>> {
            match obj.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(_) => uint(k).map(Some),
            }
        };
        let float = |k: &str, default: f64| -> Result<f64> {
            match obj.get(k) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .with_context(|| format!("\"{k}\" must be a number, got {v}")),
            }
        };
        let hidden = uint("hidden_size")?;
        let heads = uint("num_attention_heads")?;
        if heads == 0 {
            bail!("\"num_attention_heads\" must be at least 1");
        }
        let cfg = ModelConfig {
            arch,
            hidden_size: hidden,
            intermediate_size: uint("intermediate_size")?,
            num_hidden_layers: uint("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: opt_uint("num_key_value_heads")?.unwrap_or(match arch {
                Arch::Qwen3 => 32,
                Arch::Llama => heads,
            }),
            // transformers' defaults when absent: Qwen3Config 128, LlamaConfig hidden/heads.
            head_dim: opt_uint("head_dim")?.unwrap_or(match arch {
                Arch::Qwen3 => 128,
                Arch::Llama => hidden / heads,
            }),
            vocab_size: uint("vocab_size")?,
            rope_theta: rope_theta(obj)?,
            rms_norm_eps: float("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: match obj.get("tie_word_embeddings") {
                None | Some(serde_json::Value::Null) => false,
                Some(v) => v
                    .as_bool()
                    .context("\"tie_word_embeddings\" must be true or false")?,
            },
            max_position_embeddings: opt_uint("max_position_embeddings")?.unwrap_or(match arch {
                Arch::Qwen3 => 32768,
                Arch::Llama => 2048,
            }),
            qk_norm: arch == Arch::Qwen3,
        };
        if let Some(s) = obj.get("rope_scaling") {
            if !s.is_null() {
                bail!("\"rope_scaling\" is not supported (got {s}); only plain RoPE models can be trained");
            }
        }
        if obj.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true) {
            bail!("\"use_sliding_window\": true is not supported (full causal attention only)");
        }
        for k in ["attention_bias", "mlp_bias"] {
            if obj.get(k).and_then(|v| v.as_bool()) == Some(true) {
                bail!("\"{k}\": true is not supported (bias-free projections only)");
            }
        }
        cfg.validate()?;
        Ok(cfg)
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

    /// Parameter count (u128: a hostile config must not overflow).
    pub fn num_params(&self) -> u128 {
        let (d, h, q, kv) = (
            self.hidden_size as u128,
            self.intermediate_size as u128,
            self.q_dim() as u128,
            self.kv_dim() as u128,
        );
        let hd = self.head_dim as u128;
        let per_layer =
            d * q + 2 * d * kv + q * d + 3 * d * h + 2 * d + if self.qk_norm { 2 * hd } else { 0 };
        let emb = self.vocab_size as u128 * d;
        emb * if self.tie_word_embeddings { 1 } else { 2 }
            + per_layer * self.num_hidden_layers as u128
            + d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
