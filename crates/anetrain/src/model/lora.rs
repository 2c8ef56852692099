//! LoRA adapters: for a frozen projection `W [out, in]`,
//!   y = W·x + s·B·(A·x),   A [r, in] (Kaiming-uniform), B [out, r] (zeros), s = α/r,
//! stored under Hugging Face PEFT's names and files (`adapter_config.json`,
//! `adapter_model.safetensors`), so `peft.PeftModel.from_pretrained` loads
//! what we write and we load what PEFT writes.
//!
//! Adapters ride inside the kernels as extra dynamic-weight regions (see
//! `docs/kernels.md`): the base weights are staged once and never change,
//! only the small A/B regions are restaged after a step, and the low-rank
//! path keeps its own precision instead of vanishing into an fp16 rounding
//! of W + s·BA.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::model::config::ModelConfig;
use crate::model::params::{Param, Projection};
use crate::model::tensor_file;
use crate::util::fsutil::write_atomic;
use crate::util::rng::Rng;

/// Adapter hyper-parameters (PEFT's `r`, `lora_alpha`, `lora_dropout`,
/// `target_modules`, `use_rslora`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<Projection>,
    /// Scale α/√r instead of α/r.
    #[serde(default)]
    pub rslora: bool,
}

impl LoraConfig {
    /// Rank `rank` on all seven projections, α = 2·rank, no dropout: the
    /// adapters `kernels plan --lora-rank` and `bench --lora-rank` assume.
    pub fn every_projection(rank: usize) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
            rslora: false,
        }
    }

    /// The branch scale s.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 || self.rank > 4096 {
            bail!("--lora-rank must be between 1 and 4096 (got {})", self.rank);
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            bail!(
                "--lora-alpha must be a positive number (got {})",
                self.alpha
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--lora-dropout must be in [0, 1) (got {})", self.dropout);
        }
        if self.targets.is_empty() {
            bail!("--lora-targets needs at least one of q,k,v,o,gate,up,down");
        }
        Ok(())
    }
}

/// PEFT's `adapter_config.json`, as far as anetrain reads it.
#[derive(Deserialize)]
struct PeftConfig {
    peft_type: Option<String>,
    r: Option<u64>,
    lora_alpha: Option<f64>,
    lora_dropout: Option<f64>,
    target_modules: Option<TargetModules>,
    use_rslora: Option<bool>,
    // Refused when set: variants of LoRA we do not train or load.
    use_dora: Option<bool>,
    fan_in_fan_out: Option<bool>,
    bias: Option<String>,
    rank_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    modules_to_save: Option<serde_json::Value>,
    layers_to_transform: Option<serde_json::Value>,
}

/// `target_modules`: a list of module names, or PEFT's `"all-linear"`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TargetModules {
    List(Vec<String>),
    One(String),
}

/// A and B of one adapted projection, as indices into [`Lora::params`].
/// The base model an adapter records in its config, as PEFT records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterBase {
    /// `base_model_name_or_path`: a Hub id, a directory or a preset.
    pub name: String,
    /// `revision`: the Hub revision, when not the default branch.
    pub revision: Option<String>,
}

impl AdapterBase {
    pub fn named(name: &str) -> AdapterBase {
        AdapterBase {
            name: name.to_string(),
            revision: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdapterIds {
    pub a: usize,
    pub b: usize,
}

/// The adapters of a model.
#[derive(Clone, Debug)]
pub struct Lora {
    pub cfg: LoraConfig,
    /// PEFT names, e.g.
    /// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    pub params: Vec<Param>,
    /// `[layer][Projection::index]`.
    pub slots: Vec<[Option<AdapterIds>; 7]>,
    /// Bumped whenever the adapters change (devices restage only them).
    pub version: u64,
}

/// PEFT's key for layer `i`, target `t`, matrix `ab` ("A" or "B").
fn peft_key(i: usize, t: Projection, ab: &str) -> String {
    format!(
        "base_model.model.model.layers.{i}.{}.lora_{ab}.weight",
        t.path()
    )
}

impl Lora {
    /// Fresh adapters as PEFT initialises them: A ~ U(−1/√in, 1/√in)
    /// (`kaiming_uniform_(a=√5)`), B = 0.
    pub fn init(model: &ModelConfig, cfg: LoraConfig, seed: u64) -> Result<Lora> {
        cfg.validate()?;
        let mut rng = Rng::new(seed ^ 0x4c6f_5241);
        let mut lora = Lora::layout(model, cfg);
        for p in &mut lora.params {
            let n = p.shape[0] * p.shape[1];
            p.data = if p.name.contains(".lora_A.") {
                let bound = 1.0 / (p.shape[1] as f64).sqrt();
                (0..n)
                    .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                    .collect()
            } else {
                vec![0.0; n]
            };
        }
        Ok(lora)
    }

    /// Names and shapes, no data.
    fn layout(model: &ModelConfig, mut cfg: LoraConfig) -> Lora {
        cfg.targets.sort();
        cfg.targets.dedup();
        let r = cfg.rank;
        let mut params = Vec::new();
        let mut slots = Vec::new();
        for i in 0..model.num_hidden_layers {
            let mut slot = [None; 7];
            for &t in &cfg.targets {
                let (out, inp) = t.shape(model);
                let mut add = |ab: &str, shape: Vec<usize>| {
                    params.push(Param {
                        name: peft_key(i, t, ab),
                        shape,
                        data: vec![],
                        stored: None,
                        decay: true,
                    });
                    params.len() - 1
                };
                let a = add("A", vec![r, inp]);
                let b = add("B", vec![out, r]);
                slot[t.index()] = Some(AdapterIds { a, b });
            }
            slots.push(slot);
        }
        Lora {
            cfg,
            params,
            slots,
            version: 0,
        }
    }

    pub fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.data.len()).sum()
    }

    /// A and B of `layer`'s `target`, if adapted.
    pub fn adapter(&self, layer: usize, t: Projection) -> Option<(&[f32], &[f32])> {
        let ids = self.slots[layer][t.index()]?;
        Some((&self.params[ids.a].data, &self.params[ids.b].data))
    }

    /// `adapter_config.json` as PEFT writes it.
    pub fn peft_config(&self, base: &AdapterBase) -> serde_json::Value {
        let modules: Vec<&str> = self.cfg.targets.iter().map(|t| t.module()).collect();
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base.name,
            "revision": base.revision,
            "r": self.cfg.rank,
            "lora_alpha": self.cfg.alpha,
            "lora_dropout": self.cfg.dropout,
            "target_modules": modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": self.cfg.rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        })
    }

    /// `adapter_model.safetensors` bytes (f32); refuses non-finite values.
    pub fn safetensors_bytes(&self) -> Result<Vec<u8>> {
        let mut tensors = Vec::new();
        for p in &self.params {
            if let Some(i) = p.data.iter().position(|v| !v.is_finite()) {
                bail!(
                    "adapter tensor '{}' holds a non-finite value at index {i}; refusing to save it",
                    p.name
                );
            }
            tensors.push((p.name.as_str(), p.shape.as_slice(), p.data.as_slice()));
        }
        tensor_file::encode(&tensors, &[("format", "pt")])
    }

    /// Writes a PEFT adapter directory (each file atomically).
    pub fn save(&self, dir: &Path, base_model: &AdapterBase) -> Result<()> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        let bytes = self.safetensors_bytes()?;
        write_atomic(&dir.join("adapter_model.safetensors"), &bytes)?;
        let cfg = serde_json::to_string_pretty(&self.peft_config(base_model))?;
        write_atomic(&dir.join("adapter_config.json"), cfg.as_bytes())
    }

    /// Reads PEFT's `adapter_config.json`.
    pub fn read_config(path: &Path) -> Result<LoraConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read '{}'", path.display()))?;
        let bad = |what: &str| anyhow::anyhow!("'{}': {what}", path.display());
        let j: PeftConfig =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(&text))
                .map_err(|e| bad(&format!("'{}': {}", e.path(), e.inner())))?;
        if j.peft_type.as_deref().unwrap_or("LORA") != "LORA" {
            return Err(bad("only LORA adapters are supported"));
        }
        if j.use_dora == Some(true) {
            return Err(bad("DoRA adapters are not supported"));
        }
        if j.fan_in_fan_out == Some(true) {
            return Err(bad("fan_in_fan_out adapters are not supported"));
        }
        if j.bias.as_deref().unwrap_or("none") != "none" {
            return Err(bad("adapters with trained biases are not supported"));
        }
        for (k, pattern) in [
            ("rank_pattern", &j.rank_pattern),
            ("alpha_pattern", &j.alpha_pattern),
        ] {
            if pattern.as_ref().is_some_and(|o| !o.is_empty()) {
                return Err(bad(&format!("'{k}' (per-module ranks) is not supported")));
            }
        }
        for (k, v) in [
            ("modules_to_save", &j.modules_to_save),
            ("layers_to_transform", &j.layers_to_transform),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(bad(&format!("'{k}' is not supported")));
            }
        }
        let rank =
            j.r.ok_or_else(|| bad("'r' is missing or not a positive integer"))? as usize;
        let alpha = j.lora_alpha.unwrap_or(8.0);
        let dropout = j.lora_dropout.unwrap_or(0.0);
        let modules: Vec<String> = match j.target_modules {
            Some(TargetModules::List(list)) => list,
            Some(TargetModules::One(s)) if s == "all-linear" => Projection::ALL
                .iter()
                .map(|t| t.module().to_string())
                .collect(),
            _ => return Err(bad("'target_modules' must be a list of module names")),
        };
        let mut targets = Vec::new();
        for m in &modules {
            let t = Projection::from_module(m).ok_or_else(|| {
                bad(&format!(
                    "unsupported target module '{m}' (supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                ))
            })?;
            targets.push(t);
        }
        let cfg = LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
            rslora: j.use_rslora.unwrap_or(false),
        };
        cfg.validate().map_err(|e| bad(&e.to_string()))?;
        Ok(cfg)
    }

    /// Loads a PEFT adapter directory for a model of configuration `model`.
    pub fn load(model: &ModelConfig, dir: &Path) -> Result<Lora> {
        if !dir.is_dir() {
            bail!("adapter directory '{}' does not exist", dir.display());
        }
        let cfg = Lora::read_config(&dir.join("adapter_config.json"))?;
        let file = dir.join("adapter_model.safetensors");
        let found = tensor_file::read(&file)?;
        Lora::from_tensors(model, cfg, found, &file.display().to_string())
    }

    /// Adapters from named tensors (PEFT keys, with or without the
    /// `.default` adapter name).
    pub fn from_tensors(
        model: &ModelConfig,
        cfg: LoraConfig,
        tensors: BTreeMap<String, tensor_file::Tensor>,
        file: &str,
    ) -> Result<Lora> {
        let mut found: BTreeMap<String, tensor_file::Tensor> = tensors
            .into_iter()
            .map(|(k, t)| (k.replace(".default.weight", ".weight"), t))
            .collect();
        let mut lora = Lora::layout(model, cfg);
        for p in &mut lora.params {
            let t = found.remove(&p.name).with_context(|| {
                format!(
                    "'{file}': adapter tensor '{}' is missing (does the adapter belong to this model?)",
                    p.name
                )
            })?;
            if t.shape != p.shape {
                bail!(
                    "'{file}': adapter tensor '{}' has shape {:?}, the model and rank imply {:?}: an adapter of another base model (its adapter_config.json names the base it was trained on)",
                    p.name,
                    t.shape,
                    p.shape
                );
            }
            if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
                bail!(
                    "'{file}': adapter tensor '{}' holds a non-finite value at index {i}",
                    p.name
                );
            }
            p.data = t.data;
        }
        if let Some(extra) = found.keys().next() {
            bail!("'{file}': unexpected tensor '{extra}' for this model and adapter config");
        }
        Ok(lora)
    }
}
