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
use crate::util::choice::Choice;
use crate::util::fsutil::{write_atomic, write_atomic_with};
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
    /// Adapt the last this many layers only (mlx-lm's `num_layers`, PEFT's
    /// `layers_to_transform` as a suffix); `None`, every layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
}

impl LoraConfig {
    /// Rank `rank` on `targets`, with LoRA dropout `dropout` and α as given
    /// or, by default, 2·rank (mlx-lm's `scale` 2 as PEFT's α/r).
    pub fn new(
        rank: usize,
        alpha: Option<f64>,
        dropout: f64,
        targets: Vec<Projection>,
    ) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: alpha.unwrap_or(2.0 * rank as f64),
            dropout,
            targets,
            rslora: false,
            layers: None,
        }
    }

    /// The first adapted layer of a model of `n` layers.
    pub fn first_layer(&self, n: usize) -> usize {
        n - self.layers.unwrap_or(n).min(n)
    }

    /// Rank `rank` on all seven projections, α = 2·rank, no dropout: the
    /// adapters `kernels plan --lora-rank` and `bench --lora-rank` assume.
    pub fn every_projection(rank: usize) -> LoraConfig {
        LoraConfig::new(rank, None, 0.0, Projection::ALL.to_vec())
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

/// A and B of one adapted projection, as indices into [`Lora::params`].
/// A projection stored fused with others (Phi-3's q, k, v in `qkv_proj`)
/// is adapted as PEFT adapts the fused module: one A shared by the parts
/// (its gradient the sum of theirs), one B whose rows `b_rows` are this
/// part's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdapterIds {
    pub a: usize,
    pub b: usize,
    /// The rows of B this projection's output takes.
    pub b_rows: (usize, usize),
}

impl AdapterIds {
    /// Whether this projection has B to itself.
    pub fn whole_b(&self, out: usize) -> bool {
        self.b_rows == (0, out)
    }
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
    /// The modules adapted, as PEFT and mlx-lm name them (`(module,
    /// path)`: `("q_proj", "self_attn.q_proj")`, or a fused module).
    pub modules: Vec<(&'static str, &'static str)>,
    /// The decoder layers' path for PEFT and for mlx-lm
    /// (`ModelConfig::layer_paths`).
    pub layers: (&'static str, &'static str),
    /// Bumped whenever the adapters change (devices restage only them).
    pub version: u64,
}

/// mlx-lm's name for a PEFT adapter tensor of a model whose decoder
/// layers PEFT reaches at `layers` and mlx-lm at `mlx_layers`
/// (`…model.layers.N.self_attn.q_proj.lora_A.weight` →
/// `model.layers.N.self_attn.q_proj.lora_a`).
fn mlx_key(peft: &str, (layers, mlx_layers): (&str, &str)) -> String {
    let name = peft.trim_start_matches("base_model.model.");
    let name = match name.strip_prefix(layers) {
        Some(rest) => format!("{mlx_layers}{rest}"),
        None => name.to_string(),
    };
    name.replace(".lora_A.weight", ".lora_a")
        .replace(".lora_B.weight", ".lora_b")
}

/// The PEFT name of mlx-lm's adapter tensor `name` ([`mlx_key`]'s inverse).
fn peft_from_mlx(name: &str, (layers, mlx_layers): (&str, &str)) -> String {
    let name = match name.strip_prefix(mlx_layers) {
        Some(rest) => format!("{layers}{rest}"),
        None => name.to_string(),
    };
    let peft = name
        .replace(".lora_a", ".lora_A.weight")
        .replace(".lora_b", ".lora_B.weight");
    format!("base_model.model.{peft}")
}

/// PEFT's key for layer `i` of the layers at `layers` (`model.layers`),
/// module path `path` (`self_attn.q_proj`), matrix `ab` ("A" or "B").
fn peft_key(layers: &str, i: usize, path: &str, ab: &str) -> String {
    format!("base_model.model.{layers}.{i}.{path}.lora_{ab}.weight")
}

/// The modules an adapter on `targets` adapts, as PEFT and mlx-lm name
/// them: each projection's, but one fused module for the projections the
/// family stores as one (`(module, path)`, e.g. `("qkv_proj",
/// "self_attn.qkv_proj")`). A fused module's parts are adapted all
/// together or not at all.
fn adapted_modules(
    model: &ModelConfig,
    targets: &[Projection],
) -> Result<Vec<(&'static str, &'static str)>> {
    let mut out = Vec::new();
    for &t in targets {
        let m = match model.fused_of(t) {
            None => (t.module(), t.path()),
            Some(f) => {
                if let Some(missing) = f.parts.iter().find(|p| !targets.contains(p)) {
                    let parts: Vec<&str> = f.parts.iter().map(|p| p.name()).collect();
                    bail!(
                        "a {} model stores {} as one {}: adapt all of them or none (--lora-targets lacks {})",
                        model.arch.model_type(),
                        parts.join(", "),
                        f.module,
                        missing.name()
                    );
                }
                (f.module, f.path)
            }
        };
        if !out.contains(&m) {
            out.push(m);
        }
    }
    Ok(out)
}

/// The projections module `name` (`q_proj`, or a fused `qkv_proj`) of a
/// `model` stands for.
fn module_targets(model: &ModelConfig, name: &str) -> Option<Vec<Projection>> {
    if let Some(f) = model
        .fused()
        .iter()
        .find(|f| f.module == name || f.path == name)
    {
        return Some(f.parts.to_vec());
    }
    let t = Projection::ALL
        .into_iter()
        .find(|t| t.module() == name || t.path() == name)?;
    // A part of a fused matrix is not a module of the model.
    model.fused_of(t).is_none().then(|| vec![t])
}

/// The last-layers count PEFT's `layers_to_transform` names (null, one
/// index or a list): adapters on the last layers only are read, any other
/// set is refused naming it.
fn peft_layers(model: &ModelConfig, v: Option<&serde_json::Value>) -> Result<Option<usize>> {
    let n = model.num_hidden_layers;
    let mut layers: Vec<u64> = match v {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Number(i)) => i.as_u64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|i| i.as_u64()).collect(),
        Some(other) => {
            bail!("'layers_to_transform' must be a layer index or a list of them (got {other})")
        }
    };
    layers.sort_unstable();
    layers.dedup();
    let k = layers.len();
    let suffix: Vec<u64> = ((n - k.min(n)) as u64..n as u64).collect();
    if k == 0 || layers != suffix {
        bail!(
            "'layers_to_transform' {layers:?}: anetrain reads adapters on the last layers of the {n} (such as {:?})",
            (n.saturating_sub(2)..n).collect::<Vec<_>>()
        );
    }
    Ok((k < n).then_some(k))
}

/// The modules a PEFT `target_modules` pattern (a regular expression the
/// whole module name must match) names in `model`: a module counts if the
/// pattern matches it in every decoder layer, and one matched in some
/// layers only is refused (adapters on a subset of layers are not read).
fn pattern_modules(model: &ModelConfig, pattern: &str) -> Result<Vec<String>> {
    let re = regex::Regex::new(&format!("^(?:{pattern})$"))
        .map_err(|e| anyhow::anyhow!("'target_modules' is not a valid pattern: {e}"))?;
    let layers = model.layer_paths().0;
    let mut out = Vec::new();
    for (module, path) in adapted_modules(model, &Projection::ALL)? {
        let hits = (0..model.num_hidden_layers)
            .filter(|i| re.is_match(&format!("{layers}.{i}.{path}")))
            .count();
        match hits {
            0 => {}
            n if n == model.num_hidden_layers => out.push(module.to_string()),
            n => bail!(
                "'target_modules' adapts {module} in {n} of {} layers; anetrain reads adapters on every layer",
                model.num_hidden_layers
            ),
        }
    }
    if out.is_empty() {
        bail!("'target_modules' pattern '{pattern}' names none of this model's projections");
    }
    Ok(out)
}

/// The module names `model` accepts as targets, for an error message.
fn module_names(model: &ModelConfig) -> String {
    adapted_modules(model, &Projection::ALL)
        .unwrap_or_default()
        .iter()
        .map(|m| m.0)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Lora {
    /// Fresh adapters as PEFT initialises them: A ~ U(−1/√in, 1/√in)
    /// (`kaiming_uniform_(a=√5)`), B = 0.
    pub fn init(model: &ModelConfig, cfg: LoraConfig, seed: u64) -> Result<Lora> {
        cfg.validate()?;
        let mut rng = Rng::new(seed ^ 0x4c6f_5241);
        let mut lora = Lora::layout(model, cfg)?;
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

    /// Names and shapes, no data: per layer, an A and a B for each adapted
    /// module (a fused module's shared by its parts, see [`AdapterIds`]).
    fn layout(model: &ModelConfig, mut cfg: LoraConfig) -> Result<Lora> {
        cfg.targets.sort();
        cfg.targets.dedup();
        let modules = adapted_modules(model, &cfg.targets)?;
        let layers = model.layer_paths();
        let r = cfg.rank;
        let mut params = Vec::new();
        let mut slots = Vec::new();
        let n = model.num_hidden_layers;
        if let Some(k) = cfg.layers.filter(|&k| k == 0 || k > n) {
            bail!("--lora-layers {k}: the model has {n} layers (give 1 to {n})");
        }
        let first = cfg.first_layer(n);
        for i in 0..n {
            let mut slot: [Option<AdapterIds>; 7] = [None; 7];
            for &t in cfg.targets.iter().filter(|_| i >= first) {
                if slot[t.index()].is_some() {
                    continue; // a fused module's later part
                }
                let (path, parts) = match model.fused_of(t) {
                    Some(f) => (f.path, f.parts.to_vec()),
                    None => (t.path(), vec![t]),
                };
                let inp = t.shape(model).1;
                let out: usize = parts.iter().map(|p| p.shape(model).0).sum();
                let mut add = |ab: &str, shape: Vec<usize>| {
                    params.push(Param {
                        name: peft_key(layers.0, i, path, ab),
                        shape,
                        data: vec![],
                        stored: None,
                        decay: true,
                    });
                    params.len() - 1
                };
                let a = add("A", vec![r, inp]);
                let b = add("B", vec![out, r]);
                let mut row = 0;
                for p in parts {
                    let rows = p.shape(model).0;
                    slot[p.index()] = Some(AdapterIds {
                        a,
                        b,
                        b_rows: (row, row + rows),
                    });
                    row += rows;
                }
            }
            slots.push(slot);
        }
        Ok(Lora {
            cfg,
            params,
            slots,
            modules,
            layers,
            version: 0,
        })
    }

    pub fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.data.len()).sum()
    }

    /// A and B of `layer`'s `target`, if adapted (B's rows of `target`
    /// alone, where B is a fused module's).
    pub fn adapter(&self, layer: usize, t: Projection) -> Option<(&[f32], &[f32])> {
        let ids = self.slots[layer][t.index()]?;
        let r = self.cfg.rank;
        let b = &self.params[ids.b].data[ids.b_rows.0 * r..ids.b_rows.1 * r];
        Some((&self.params[ids.a].data, b))
    }

    /// `adapter_config.json` as PEFT writes it. In a multimodal model the
    /// modules are named by a pattern of the text model's layers (PEFT
    /// matches a list by name suffix, which would adapt the vision tower's
    /// `q_proj` too).
    pub fn peft_config(&self, base: &AdapterBase) -> serde_json::Value {
        let names: Vec<&str> = self.modules.iter().map(|m| m.0).collect();
        let modules = match self.layers.0 {
            "model.layers" => serde_json::json!(names),
            layers => serde_json::json!(format!(
                r"{}\.\d+\.({})",
                layers.replace('.', r"\."),
                self.modules
                    .iter()
                    .map(|m| m.1.replace('.', r"\."))
                    .collect::<Vec<_>>()
                    .join("|")
            )),
        };
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
            "layers_to_transform": self.cfg.layers.map(|_| {
                (self.cfg.first_layer(self.slots.len())..self.slots.len()).collect::<Vec<_>>()
            }),
            "rank_pattern": {},
            "alpha_pattern": {},
            // mlx-lm reads the same file for its own keys (and PEFT warns
            // of them and goes on): the layers, and the branch's
            // multiplier as `scale` (PEFT's α/r, not α).
            "fine_tune_type": "lora",
            "num_layers": self.cfg.layers.unwrap_or(self.slots.len()),
            "lora_parameters": {
                "rank": self.cfg.rank,
                "scale": self.cfg.scale(),
                "dropout": self.cfg.dropout,
                "keys": self.modules.iter().map(|m| m.1).collect::<Vec<_>>(),
            },
        })
    }

    /// Writes `adapters.safetensors` as mlx-lm reads it (mlx-lm 0.32
    /// `tuner/lora.py` `LoRALinear`: y = W·x + scale·(x·A)·B, with A
    /// `[in, r]` and B `[r, out]`): our A and B transposed, under the
    /// model's own module paths (`model.layers.N.self_attn.q_proj.lora_a`).
    /// Written tensor by tensor through one transposing buffer, so saving
    /// holds one tensor's copy, not the adapter's twice (264 MB at Qwen3-4B
    /// r16, at the end of a run whose device buffers are still held).
    pub fn write_mlx_safetensors(&self, w: &mut dyn std::io::Write) -> Result<()> {
        let entries: Vec<_> = self
            .params
            .iter()
            .map(|p| {
                let shape = vec![p.shape[1], p.shape[0]];
                (
                    mlx_key(&p.name, self.layers),
                    safetensors::Dtype::F32,
                    shape,
                    4 * p.data.len(),
                )
            })
            .collect();
        tensor_file::write_header(w, &entries, &[("format", "mlx")])?;
        let mut t = Vec::new();
        for p in &self.params {
            let (rows, cols) = (p.shape[0], p.shape[1]);
            t.clear();
            t.extend((0..cols * rows).map(|i| p.data[(i % rows) * cols + i / rows]));
            match cfg!(target_endian = "little") {
                true => w.write_all(bytemuck::cast_slice(&t))?,
                false => t.iter().try_for_each(|v| w.write_all(&v.to_le_bytes()))?,
            }
        }
        Ok(())
    }

    /// Whether `dir` holds an adapter as mlx-lm writes it
    /// (`adapters.safetensors`) and not PEFT's.
    fn is_mlx(dir: &Path) -> bool {
        !dir.join("adapter_model.safetensors").is_file()
            && dir.join("adapters.safetensors").is_file()
    }

    /// The configuration of the adapter in `dir`, PEFT's or mlx-lm's.
    pub fn config_of(model: &ModelConfig, dir: &Path) -> Result<LoraConfig> {
        if !dir.is_dir() {
            bail!("adapter directory '{}' does not exist", dir.display());
        }
        match Lora::is_mlx(dir) {
            true => Lora::read_mlx_config(model, dir),
            false => Lora::read_config(model, &dir.join("adapter_config.json")),
        }
    }

    /// mlx-lm's `adapter_config.json` (`fine_tune_type`, `num_layers`,
    /// `lora_parameters`) as a configuration of ours.
    fn read_mlx_config(model: &ModelConfig, dir: &Path) -> Result<LoraConfig> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read '{}'", path.display()))?;
        let bad = |what: &str| anyhow::anyhow!("'{}': {what}", path.display());
        let j: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON: {e}")))?;
        match j["fine_tune_type"].as_str().unwrap_or("lora") {
            "lora" => {}
            other => {
                return Err(bad(&format!(
                    "fine_tune_type '{other}' is not read; LoRA adapters are"
                )))
            }
        }
        // mlx-lm adapts the last `num_layers` layers (all of them when it
        // is -1 or the layer count or more).
        let n = model.num_hidden_layers;
        let layers = match j["num_layers"].as_i64().unwrap_or(-1) {
            k if k < 0 || k as usize >= n => None,
            0 => return Err(bad("num_layers 0 adapts no layer")),
            k => Some(k as usize),
        };
        let l = &j["lora_parameters"];
        let rank = l["rank"]
            .as_u64()
            .ok_or_else(|| bad("lora_parameters.rank is missing"))? as usize;
        let scale = l["scale"]
            .as_f64()
            .ok_or_else(|| bad("lora_parameters.scale is missing"))?;
        let keys: Vec<String> = match l["keys"].as_array() {
            Some(k) => k
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            None => Lora::all_paths(model),
        };
        let mut targets = Vec::new();
        for k in &keys {
            let t = module_targets(model, k).ok_or_else(|| {
                bad(&format!(
                    "unsupported LoRA key '{k}' (supported: {})",
                    Lora::all_paths(model).join(", ")
                ))
            })?;
            targets.extend(t);
        }
        let cfg = LoraConfig {
            rank,
            alpha: scale * rank as f64,
            dropout: l["dropout"].as_f64().unwrap_or(0.0),
            targets,
            rslora: false,
            layers,
        };
        cfg.validate().map_err(|e| bad(&e.to_string()))?;
        Ok(cfg)
    }

    /// The module paths of every projection `model` has (`self_attn.q_proj`,
    /// or a fused `self_attn.qkv_proj`).
    fn all_paths(model: &ModelConfig) -> Vec<String> {
        adapted_modules(model, &Projection::ALL)
            .unwrap_or_default()
            .iter()
            .map(|m| m.1.to_string())
            .collect()
    }

    /// An adapter directory as mlx-lm writes it (`adapters.safetensors`,
    /// `adapter_config.json` with `lora_parameters`), on every layer.
    fn load_mlx(model: &ModelConfig, dir: &Path) -> Result<Lora> {
        let cfg = Lora::read_mlx_config(model, dir)?;
        let file = dir.join("adapters.safetensors");
        let mut found = BTreeMap::new();
        for (name, t) in tensor_file::read(&file)? {
            // mlx-lm's [in, r] and [r, out], back to PEFT's [r, in] and [out, r].
            let (rows, cols) = (t.shape[0], t.shape.get(1).copied().unwrap_or(1));
            let mut data = vec![0f32; t.data.len()];
            for r in 0..rows {
                for c in 0..cols {
                    data[c * rows + r] = t.data[r * cols + c];
                }
            }
            let tensor = tensor_file::Tensor {
                shape: vec![cols, rows],
                dtype: t.dtype,
                data,
            };
            found.insert(peft_from_mlx(&name, model.layer_paths()), tensor);
        }
        Lora::from_tensors(model, cfg, found, &file.display().to_string())
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
        write_atomic_with(&dir.join("adapters.safetensors"), |w| {
            self.write_mlx_safetensors(w)
        })?;
        let cfg = serde_json::to_string_pretty(&self.peft_config(base_model))?;
        write_atomic(&dir.join("adapter_config.json"), cfg.as_bytes())
    }

    /// Reads PEFT's `adapter_config.json` of an adapter on `model`.
    pub fn read_config(model: &ModelConfig, path: &Path) -> Result<LoraConfig> {
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
        if j.modules_to_save.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad("'modules_to_save' is not supported"));
        }
        let layers =
            peft_layers(model, j.layers_to_transform.as_ref()).map_err(|e| bad(&e.to_string()))?;
        let rank =
            j.r.ok_or_else(|| bad("'r' is missing or not a positive integer"))? as usize;
        let alpha = j.lora_alpha.unwrap_or(8.0);
        let dropout = j.lora_dropout.unwrap_or(0.0);
        let modules: Vec<String> = match j.target_modules {
            Some(TargetModules::List(list)) => list,
            Some(TargetModules::One(s)) if s == "all-linear" => {
                adapted_modules(model, &Projection::ALL)?
                    .iter()
                    .map(|m| m.0.to_string())
                    .collect()
            }
            Some(TargetModules::One(pattern)) => {
                pattern_modules(model, &pattern).map_err(|e| bad(&e.to_string()))?
            }
            None => return Err(bad("'target_modules' must be a list of module names")),
        };
        let mut targets = Vec::new();
        for m in &modules {
            let t = module_targets(model, m).ok_or_else(|| {
                bad(&format!(
                    "unsupported target module '{m}' (supported: {})",
                    module_names(model)
                ))
            })?;
            targets.extend(t);
        }
        let cfg = LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
            rslora: j.use_rslora.unwrap_or(false),
            layers,
        };
        cfg.validate().map_err(|e| bad(&e.to_string()))?;
        Ok(cfg)
    }

    /// Loads a PEFT adapter directory for a model of configuration `model`.
    pub fn load(model: &ModelConfig, dir: &Path) -> Result<Lora> {
        if !dir.is_dir() {
            bail!("adapter directory '{}' does not exist", dir.display());
        }
        let file = dir.join("adapter_model.safetensors");
        if Lora::is_mlx(dir) {
            return Lora::load_mlx(model, dir);
        }
        let cfg = Lora::read_config(model, &dir.join("adapter_config.json"))?;
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
        let mut lora = Lora::layout(model, cfg)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// PEFT's `layers_to_transform` read as a count of last layers: a
    /// suffix (or every layer, or none given) is read, any other set is
    /// refused naming it; an adapter of the last layers is written back
    /// with the same list and mlx-lm's `num_layers`.
    #[test]
    fn layer_ranges_are_the_last_layers() {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.num_hidden_layers = 4;
        let read = |v: serde_json::Value| peft_layers(&model, Some(&v));
        assert_eq!(read(serde_json::json!(null)).unwrap(), None);
        assert_eq!(read(serde_json::json!([3, 2])).unwrap(), Some(2));
        assert_eq!(read(serde_json::json!(3)).unwrap(), Some(1));
        assert_eq!(read(serde_json::json!([0, 1, 2, 3])).unwrap(), None);
        for bad in [
            serde_json::json!([0, 1]),
            serde_json::json!([1, 3]),
            serde_json::json!([]),
        ] {
            let e = read(bad.clone()).unwrap_err().to_string();
            assert!(e.contains("the last layers of the 4"), "{bad}: {e}");
        }
        let cfg = LoraConfig {
            layers: Some(2),
            ..LoraConfig::every_projection(4)
        };
        let lora = Lora::init(&model, cfg, 1).unwrap();
        assert!(lora.slots[..2]
            .iter()
            .all(|s| s.iter().all(Option::is_none)));
        assert!(lora.slots[2..]
            .iter()
            .all(|s| s.iter().all(Option::is_some)));
        let j = lora.peft_config(&AdapterBase::named("m"));
        assert_eq!(j["layers_to_transform"], serde_json::json!([2, 3]));
        assert_eq!(j["num_layers"], 2);
        let e = Lora::init(
            &model,
            LoraConfig {
                layers: Some(5),
                ..LoraConfig::every_projection(4)
            },
            1,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("--lora-layers 5: the model has 4 layers"),
            "{e}"
        );
    }
}
