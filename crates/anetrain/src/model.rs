//! Model parameters in Hugging Face names and shapes, loading and saving of
//! Hugging Face model directories (`config.json` + safetensors, single file
//! or sharded), and random initialisation.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::config::{Arch, ModelConfig};
use crate::fsutil::write_atomic;
use crate::rng::Rng;
use crate::safetensors;

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Hugging Face tensor name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    /// Weight decay applies (matrices and embeddings, never norm weights).
    pub decay: bool,
}

/// Indices into [`Model::params`] of one layer's tensors.
#[derive(Clone, Copy, Debug)]
pub struct LayerIds {
    pub attn_norm: usize,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub ffn_norm: usize,
    pub w1: usize,
    pub w3: usize,
    pub w2: usize,
}

/// Parameters in a fixed order: embedding, layers, final norm, lm_head.
#[derive(Clone, Debug)]
pub struct Model {
    pub cfg: ModelConfig,
    pub params: Vec<Param>,
    pub embed: usize,
    pub layers: Vec<LayerIds>,
    pub final_norm: usize,
    /// `None` when tied to the embedding.
    pub lm_head: Option<usize>,
    /// Bumped whenever the weights change (devices restage on a new value).
    pub version: u64,
    /// LoRA adapters; when present they are the only trainable parameters.
    pub lora: Option<crate::lora::Lora>,
}

/// The parameter list (names and shapes) a configuration implies.
fn layout(cfg: &ModelConfig) -> Model {
    let (d, h, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let mut params = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, decay: bool| {
        params.push(Param {
            name,
            shape,
            data: vec![],
            decay,
        });
        params.len() - 1
    };
    let embed = add("model.embed_tokens.weight".into(), vec![v, d], true);
    let mut layers = Vec::new();
    for i in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let attn_norm = add(p("input_layernorm.weight"), vec![d], false);
        let wq = add(p("self_attn.q_proj.weight"), vec![q, d], true);
        let wk = add(p("self_attn.k_proj.weight"), vec![kv, d], true);
        let wv = add(p("self_attn.v_proj.weight"), vec![kv, d], true);
        let wo = add(p("self_attn.o_proj.weight"), vec![d, q], true);
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(add(p("self_attn.q_norm.weight"), vec![hd], false)),
                Some(add(p("self_attn.k_norm.weight"), vec![hd], false)),
            )
        } else {
            (None, None)
        };
        let ffn_norm = add(p("post_attention_layernorm.weight"), vec![d], false);
        let w1 = add(p("mlp.gate_proj.weight"), vec![h, d], true);
        let w3 = add(p("mlp.up_proj.weight"), vec![h, d], true);
        let w2 = add(p("mlp.down_proj.weight"), vec![d, h], true);
        layers.push(LayerIds {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            ffn_norm,
            w1,
            w3,
            w2,
        });
    }
    let final_norm = add("model.norm.weight".into(), vec![d], false);
    let lm_head =
        (!cfg.tie_word_embeddings).then(|| add("lm_head.weight".into(), vec![v, d], true));
    Model {
        cfg: cfg.clone(),
        params,
        embed,
        layers,
        final_norm,
        lm_head,
        version: 0,
        lora: None,
    }
}

impl Model {
    /// Random initialisation: matrices N(0, 0.02), the two projections that
    /// write into the residual stream (o_proj, down_proj) N(0, 0.02/√(2·layers))
    /// as in GPT-2, norm weights 1.
    pub fn init(cfg: &ModelConfig, seed: u64) -> Result<Model> {
        cfg.validate()?;
        let mut m = layout(cfg);
        let mut rng = Rng::new(seed);
        let residual_std = 0.02 / (2.0 * cfg.num_hidden_layers as f64).sqrt();
        for p in &mut m.params {
            let n: usize = p.shape.iter().product();
            p.data = if p.shape.len() == 1 {
                vec![1.0; n]
            } else if p.name.ends_with("o_proj.weight") || p.name.ends_with("down_proj.weight") {
                rng.normals(n, residual_std)
            } else {
                rng.normals(n, 0.02)
            };
        }
        Ok(m)
    }

    /// The output projection (the embedding when tied).
    pub fn lm_head(&self) -> &[f32] {
        &self.params[self.lm_head.unwrap_or(self.embed)].data
    }

    /// The parameters training updates: the adapters when LoRA is on,
    /// otherwise every weight. Gradients and optimizer state parallel this.
    pub fn trainable(&self) -> &[Param] {
        match &self.lora {
            Some(l) => &l.params,
            None => &self.params,
        }
    }

    /// Mutable [`Model::trainable`]; marks them changed for devices.
    pub fn trainable_mut(&mut self) -> &mut [Param] {
        match &mut self.lora {
            Some(l) => {
                l.version += 1;
                &mut l.params
            }
            None => {
                self.version += 1;
                &mut self.params
            }
        }
    }

    pub fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.data.len()).sum()
    }

    /// Loads a Hugging Face model directory (config.json plus
    /// model.safetensors or sharded model-*.safetensors with an index).
    pub fn load(dir: &Path) -> Result<Model> {
        if !dir.is_dir() {
            bail!("model directory '{}' does not exist", dir.display());
        }
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let files = safetensor_files(dir)?;
        let mut found: BTreeMap<String, (safetensors::Tensor, String)> = BTreeMap::new();
        for f in &files {
            for (name, t) in safetensors::read(f)? {
                found.insert(name, (t, f.display().to_string()));
            }
        }
        let mut m = layout(&cfg);
        let expected: BTreeSet<&str> = m.params.iter().map(|p| p.name.as_str()).collect();
        for name in found.keys() {
            let harmless = name.ends_with("rotary_emb.inv_freq")
                || (name == "lm_head.weight" && cfg.tie_word_embeddings);
            if !expected.contains(name.as_str()) && !harmless {
                bail!(
                    "'{}': unexpected tensor '{name}' for a {:?} model with {} layers",
                    found[name].1,
                    cfg.arch,
                    cfg.num_hidden_layers
                );
            }
        }
        for p in &mut m.params {
            let (t, file) = found
                .remove(&p.name)
                .with_context(|| format!("'{}': tensor '{}' is missing", dir.display(), p.name))?;
            if t.shape != p.shape {
                bail!(
                    "'{file}': tensor '{}' has shape {:?}, the config implies {:?}",
                    p.name,
                    t.shape,
                    p.shape
                );
            }
            if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
                bail!(
                    "'{file}': tensor '{}' holds a non-finite value ({}) at index {i}",
                    p.name,
                    t.data[i]
                );
            }
            p.data = t.data;
        }
        Ok(m)
    }

    /// The weights as a Hugging Face `model.safetensors` (f32, HF names).
    pub fn safetensors_bytes(&self) -> Vec<u8> {
        let tensors: Vec<(&str, &[usize], &[f32])> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.shape.as_slice(), p.data.as_slice()))
            .collect();
        safetensors::encode(&tensors, &[("format", "pt")])
    }

    /// Saves as a Hugging Face model directory (f32 safetensors) that
    /// `transformers` loads unchanged. Refuses to write non-finite weights.
    pub fn save(&self, dir: &Path) -> Result<()> {
        for p in &self.params {
            if let Some(i) = p.data.iter().position(|v| !v.is_finite()) {
                bail!(
                    "refusing to save: tensor '{}' holds {} at index {i}",
                    p.name,
                    p.data[i]
                );
            }
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        write_atomic(&dir.join("model.safetensors"), &self.safetensors_bytes())?;
        write_atomic(
            &dir.join("config.json"),
            hf_config_json(&self.cfg).as_bytes(),
        )?;
        Ok(())
    }
}

/// The safetensors files of a model directory.
fn safetensor_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read '{}'", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("'{}': invalid JSON", index.display()))?;
        let map = v["weight_map"]
            .as_object()
            .with_context(|| format!("'{}': no \"weight_map\" object", index.display()))?;
        let mut files: BTreeSet<String> = BTreeSet::new();
        for f in map.values() {
            let f = f.as_str().with_context(|| {
                format!(
                    "'{}': weight_map values must be file names",
                    index.display()
                )
            })?;
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                bail!(
                    "'{}': shard name '{f}' must be a plain file name",
                    index.display()
                );
            }
            files.insert(f.to_string());
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    bail!(
        "'{}' holds neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )
}

/// One of a decoder layer's seven weight projections (what a LoRA adapter
/// attaches to, what a kernel multiplies by).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// The names one projection goes by.
struct ProjectionNames {
    /// Hugging Face module name (`q_proj`).
    module: &'static str,
    /// Module path inside a decoder layer (`self_attn.q_proj`).
    path: &'static str,
    /// Kernel weight region of the base projection (`wq`).
    region: &'static str,
    /// Kernel regions of LoRA's A and B (`wq_lora_a`, `wq_lora_b`).
    adapter: (&'static str, &'static str),
}

/// Names by [`Projection::index`].
const PROJECTION_NAMES: [ProjectionNames; 7] = [
    ProjectionNames {
        module: "q_proj",
        path: "self_attn.q_proj",
        region: "wq",
        adapter: ("wq_lora_a", "wq_lora_b"),
    },
    ProjectionNames {
        module: "k_proj",
        path: "self_attn.k_proj",
        region: "wk",
        adapter: ("wk_lora_a", "wk_lora_b"),
    },
    ProjectionNames {
        module: "v_proj",
        path: "self_attn.v_proj",
        region: "wv",
        adapter: ("wv_lora_a", "wv_lora_b"),
    },
    ProjectionNames {
        module: "o_proj",
        path: "self_attn.o_proj",
        region: "wo",
        adapter: ("wo_lora_a", "wo_lora_b"),
    },
    ProjectionNames {
        module: "gate_proj",
        path: "mlp.gate_proj",
        region: "w1",
        adapter: ("w1_lora_a", "w1_lora_b"),
    },
    ProjectionNames {
        module: "up_proj",
        path: "mlp.up_proj",
        region: "w3",
        adapter: ("w3_lora_a", "w3_lora_b"),
    },
    ProjectionNames {
        module: "down_proj",
        path: "mlp.down_proj",
        region: "w2",
        adapter: ("w2_lora_a", "w2_lora_b"),
    },
];

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// Position in [`Projection::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Hugging Face module name (`q_proj`).
    pub fn module(self) -> &'static str {
        PROJECTION_NAMES[self.index()].module
    }

    /// Module path inside a decoder layer (`self_attn.q_proj`).
    pub fn path(self) -> &'static str {
        PROJECTION_NAMES[self.index()].path
    }

    /// The kernel weight region of the base projection (`wq`).
    pub fn region(self) -> &'static str {
        PROJECTION_NAMES[self.index()].region
    }

    /// Kernel regions of A and B (`wq_lora_a`, `wq_lora_b`).
    pub fn adapter_regions(self) -> (&'static str, &'static str) {
        PROJECTION_NAMES[self.index()].adapter
    }

    pub fn from_module(name: &str) -> Option<Projection> {
        Projection::ALL.into_iter().find(|t| t.module() == name)
    }

    /// The base weight's index in [`Model::params`].
    pub fn base(self, l: &LayerIds) -> usize {
        match self {
            Projection::Q => l.wq,
            Projection::K => l.wk,
            Projection::V => l.wv,
            Projection::O => l.wo,
            Projection::Gate => l.w1,
            Projection::Up => l.w3,
            Projection::Down => l.w2,
        }
    }
}

/// A `config.json` `transformers` reads back to the same architecture.
pub fn hf_config_json(c: &ModelConfig) -> String {
    let (arch, model_type) = match c.arch {
        Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Arch::Llama => ("LlamaForCausalLM", "llama"),
    };
    let v = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "torch_dtype": "float32",
        "bos_token_id": null,
        "eos_token_id": null,
        "use_cache": true,
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}
