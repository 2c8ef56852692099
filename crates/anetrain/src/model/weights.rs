//! Model parameters in Hugging Face names and shapes, loading and saving of
//! Hugging Face model directories (`config.json` + safetensors, single file
//! or sharded), and random initialisation.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::model::config::ModelConfig;
pub use crate::model::dtype::StoredDtype;
use crate::model::hf_config::hf_config_json;
use crate::model::layer::{Role, Sublayer};
use crate::model::lora::Lora;
pub use crate::model::params::{LayerIds, Param, Projection, Stored};
use crate::model::tensor_file;
use crate::util::fsutil::write_atomic;
use crate::util::rng::Rng;

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
    pub lora: Option<Lora>,
    /// A multimodal checkpoint's tensors that are not its text model's
    /// (the vision tower's, the projector's), under their own names:
    /// never trained, written back as they were read.
    pub extras: Vec<Param>,
}

/// The matrices a configuration implies, as `(name, rows, cols)`: the
/// embedding, every layer's projections and an untied head.
pub fn matrix_shapes(cfg: &ModelConfig) -> Vec<(String, usize, usize)> {
    layout(cfg)
        .params
        .into_iter()
        .filter(|p| p.shape.len() == 2)
        .map(|p| (p.name, p.shape[0], p.shape[1]))
        .collect()
}

/// The parameter list (names and shapes) a configuration implies: the
/// embedding, each layer's as its description lists them, the final norm
/// and an untied head.
fn layout(cfg: &ModelConfig) -> Model {
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut params = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, decay: bool| {
        params.push(Param {
            name,
            shape,
            data: vec![],
            stored: None,
            decay,
        });
        params.len() - 1
    };
    let embed = add("model.embed_tokens.weight".into(), vec![v, d], true);
    let mut layers = Vec::new();
    let (spec, dims) = (cfg.layer(), cfg.layer_dims());
    for i in 0..cfg.num_hidden_layers {
        let mut ids = LayerIds {
            mixer_norm: None,
            mlp_norm: None,
            post_norms: [None; 2],
            projections: [0; 7],
            q_norm: None,
            k_norm: None,
            biases: [None; 7],
        };
        for p in spec.params(&dims) {
            let id = add(format!("model.layers.{i}.{}", p.name), p.shape, p.decay);
            match p.role {
                Role::Norm(Sublayer::Mixer) => ids.mixer_norm = Some(id),
                Role::Norm(Sublayer::Mlp) => ids.mlp_norm = Some(id),
                Role::PostNorm(sub) => ids.post_norms[sub as usize] = Some(id),
                Role::Projection(t) => ids.projections[t.index()] = id,
                Role::QNorm => ids.q_norm = Some(id),
                Role::KNorm => ids.k_norm = Some(id),
                Role::Bias(t) => ids.biases[t.index()] = Some(id),
            }
        }
        layers.push(ids);
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
        extras: vec![],
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

    /// Every RMSNorm weight: the layers' (before and after their
    /// sublayers, QK-norm's) and the final norm.
    pub fn norm_ids(&self) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .layers
            .iter()
            .flat_map(|l| {
                [l.mixer_norm, l.mlp_norm, l.q_norm, l.k_norm]
                    .into_iter()
                    .chain(l.post_norms)
                    .flatten()
            })
            .collect();
        out.push(self.final_norm);
        out
    }

    /// Parameter `id`'s values as Hugging Face stores them: a Gemma norm
    /// weight is held as the scale `1 + w` it applies
    /// ([`ModelConfig::norm_offset`]) and stored as `w`.
    pub fn hf_values(&self, id: usize) -> std::borrow::Cow<'_, [f32]> {
        let offset = self.cfg.norm_offset();
        let p = &self.params[id];
        match offset != 0.0 && self.norm_ids().contains(&id) {
            true => p.data.iter().map(|v| v - offset).collect::<Vec<_>>().into(),
            false => p.values(),
        }
    }

    /// Reads parameter values stored as Hugging Face stores them (see
    /// [`Model::hf_values`]): each norm weight becomes the scale it
    /// applies.
    pub fn fold_norm_offsets(&mut self) {
        let offset = self.cfg.norm_offset();
        if offset != 0.0 {
            for id in self.norm_ids() {
                self.params[id].data.iter_mut().for_each(|v| *v += offset);
            }
        }
    }

    /// The LM head's parameter index: its own, or the tied embedding's.
    pub fn lm_head_id(&self) -> usize {
        self.lm_head.unwrap_or(self.embed)
    }

    /// The output projection's parameter (the embedding when tied).
    pub fn lm_head_param(&self) -> &Param {
        &self.params[self.lm_head_id()]
    }

    /// The output projection in f32 (converted whole when the model keeps
    /// it in the file's dtype; the training loss reads it in chunks).
    pub fn lm_head(&self) -> std::borrow::Cow<'_, [f32]> {
        self.lm_head_param().values()
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
        self.params.iter().map(Param::numel).sum()
    }

    /// Loads a Hugging Face model directory (config.json plus
    /// model.safetensors or sharded model-*.safetensors with an index),
    /// every tensor decoded to f32.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_with(dir, false)
    }

    /// Loads a model whose weights stay frozen (a LoRA base, evaluation):
    /// its matrices stay in the file, memory-mapped in the file's dtype
    /// ([`Param::stored`]), and only the norm weights are decoded. Every
    /// value is still checked to be finite.
    pub fn load_frozen(dir: &Path) -> Result<Model> {
        Model::load_with(dir, true)
    }

    /// [`Model::load`] or [`Model::load_frozen`]: every tensor of the
    /// directory's files read, checked against the config's names and
    /// shapes, decoded or mapped. (Long because every check names the file
    /// and the tensor where it fails.)
    fn load_with(dir: &Path, frozen: bool) -> Result<Model> {
        let dir = &crate::model::config::model_directory(dir)?;
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let files = safetensor_files(dir)?;
        let mut found: BTreeMap<String, (Source, String)> = BTreeMap::new();
        // A quantized checkpoint is always read mapped, dequantized as it
        // is used (or, loaded in full, once below).
        let quantized = cfg.quantization.is_some();
        for f in &files {
            let file = f.display().to_string();
            if frozen || quantized {
                for (name, t) in tensor_file::map(f)? {
                    let source = match t {
                        tensor_file::Mapped::Values(shape, s) => Source::Mapped(shape, s),
                        tensor_file::Mapped::Words(shape, map, start) => {
                            Source::Words(shape, map, start)
                        }
                    };
                    found.insert(name, (source, file.clone()));
                }
            } else {
                for (name, t) in tensor_file::read(f)? {
                    found.insert(name, (Source::Decoded(t), file.clone()));
                }
            }
        }
        fold_quantized(&mut found, cfg.quantization.as_ref())?;
        // A multimodal checkpoint: the text model's tensors by their own
        // names, the others kept aside.
        let prefix = cfg.tensor_prefix();
        let mut extras = BTreeMap::new();
        if !prefix.is_empty() {
            found = std::mem::take(&mut found)
                .into_iter()
                .filter_map(|(k, v)| match k.strip_prefix(prefix) {
                    Some(rest) => Some((rest.to_string(), v)),
                    None => {
                        extras.insert(k, v);
                        None
                    }
                })
                .collect();
        }
        split_fused(&mut found, &cfg)?;
        let mut m = layout(&cfg);
        for (name, (t, file)) in extras {
            m.extras.push(extra_param(name, t, &file)?);
        }
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
            if t.shape() != p.shape {
                bail!(
                    "'{file}': tensor '{}' has shape {:?}, the config implies {:?}",
                    p.name,
                    t.shape(),
                    p.shape
                );
            }
            let bad = |i: usize, v: f32| {
                anyhow::anyhow!(
                    "'{file}': tensor '{}' holds a non-finite value ({v}) at index {i}",
                    p.name
                )
            };
            match t {
                Source::Decoded(t) => {
                    if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
                        return Err(bad(i, t.data[i]));
                    }
                    p.data = t.data;
                }
                Source::Mapped(_, s) => {
                    if let Some(i) = s.first_non_finite() {
                        let mut v = [0f32];
                        s.convert(i..i + 1, &mut v);
                        return Err(bad(i, v[0]));
                    }
                    if p.shape.len() == 1 || !frozen {
                        p.data = vec![0f32; s.len];
                        s.convert(0..s.len, &mut p.data);
                    } else {
                        // The check read every page; give them back, so a
                        // base is resident only as far as a step uses it
                        // (and `quantize` holds one tensor at a time).
                        s.release();
                        p.stored = Some(s);
                    }
                }
                Source::Words(..) => bail!(
                    "'{file}': tensor '{}' holds packed uint32 words without the \".scales\" and \".biases\" of MLX's quantization",
                    p.name
                ),
            }
        }
        m.fold_norm_offsets();
        Ok(m)
    }

    /// Quantizes the frozen base in memory (`--quantize-base`): every
    /// stored matrix whose rows fill whole groups becomes MLX's affine
    /// words, scales and biases in its file's dtype, as `anetrain quantize`
    /// would write them, and the file's pages are given back as each is
    /// done. The rest stays as it was.
    pub fn quantize_frozen(&mut self, spec: crate::model::quant::QuantSpec) -> Result<()> {
        for p in &mut self.params {
            let (Some(s), &[_, cols]) = (&p.stored, &p.shape[..]) else {
                continue;
            };
            if !spec.fits(cols) || s.affine.is_some() {
                continue;
            }
            let values = p.values();
            let q = crate::model::params::quantized_stored(&values, cols, spec, s.dtype)
                .context("cannot allocate the quantized base")?;
            s.release();
            p.stored = Some(q);
        }
        self.cfg.quantization = Some(crate::model::quant::Quantization {
            default: spec,
            modules: Default::default(),
        });
        Ok(())
    }

    /// Bytes of the weights kept in the file's dtype, and that dtype (the
    /// first matrix's), when the model was loaded with
    /// [`Model::load_frozen`].
    pub fn stored_bytes(&self) -> Option<(usize, StoredDtype)> {
        let stored: Vec<&Stored> = self
            .params
            .iter()
            .filter_map(|p| p.stored.as_ref())
            .collect();
        let dtype = stored.first()?.dtype;
        Some((stored.iter().map(|s| s.file_bytes()).sum(), dtype))
    }

    /// The weights as a Hugging Face `model.safetensors` (f32, HF names).
    pub fn safetensors_bytes(&self) -> Result<Vec<u8>> {
        self.safetensors_bytes_as(StoredDtype::F32)
    }

    /// The tensors Hugging Face stores, in order: each parameter under its
    /// name, but a family's fused projections as one (Phi-3's `qkv_proj`,
    /// `gate_up_proj`: their parts' rows stacked).
    pub fn hf_tensors(&self) -> Vec<HfTensor> {
        let prefix = self.cfg.tensor_prefix();
        let mut out = Vec::new();
        for (id, p) in self.params.iter().enumerate() {
            let fused = self.layers.iter().enumerate().find_map(|(i, l)| {
                let f = Projection::ALL
                    .into_iter()
                    .find(|t| t.base(l) == id)
                    .and_then(|t| self.cfg.fused_of(t))?;
                Some((i, f))
            });
            match fused {
                None => out.push(HfTensor {
                    name: format!("{prefix}{}", p.name),
                    shape: p.shape.clone(),
                    parts: vec![id],
                    extra: None,
                }),
                // The fused matrix where its first part stands.
                Some((i, f)) if f.parts[0].base(&self.layers[i]) == id => {
                    let parts: Vec<usize> =
                        f.parts.iter().map(|t| t.base(&self.layers[i])).collect();
                    let rows = parts.iter().map(|&j| self.params[j].shape[0]).sum();
                    out.push(HfTensor {
                        name: format!("{prefix}model.layers.{i}.{}.weight", f.path),
                        shape: vec![rows, p.shape[1]],
                        parts,
                        extra: None,
                    })
                }
                Some(_) => {}
            }
        }
        out.extend(self.extras.iter().enumerate().map(|(i, p)| HfTensor {
            name: p.name.clone(),
            shape: p.shape.clone(),
            parts: vec![],
            extra: Some(i),
        }));
        out
    }

    /// A [`HfTensor`]'s values as Hugging Face stores them
    /// ([`Model::hf_values`] of each part, stacked).
    pub fn hf_tensor_values(&self, t: &HfTensor) -> Cow<'_, [f32]> {
        if let Some(i) = t.extra {
            return self.extras[i].values();
        }
        match t.parts[..] {
            [id] => self.hf_values(id),
            _ => Cow::Owned(
                t.parts
                    .iter()
                    .flat_map(|&id| self.hf_values(id).into_owned())
                    .collect(),
            ),
        }
    }

    /// [`Model::safetensors_bytes`] with the weights stored as `dtype`.
    fn safetensors_bytes_as(&self, dtype: StoredDtype) -> Result<Vec<u8>> {
        let layout = self.hf_tensors();
        let values: Vec<_> = layout.iter().map(|t| self.hf_tensor_values(t)).collect();
        let tensors: Vec<(&str, &[usize], &[f32])> = layout
            .iter()
            .zip(&values)
            .map(|(t, v)| (t.name.as_str(), t.shape.as_slice(), &v[..]))
            .collect();
        tensor_file::encode_as(&tensors, &[("format", "pt")], dtype)
    }

    /// An error naming the first weight that is not finite: nothing that
    /// writes a model (`action`: "save", "export") writes NaN or inf.
    pub fn check_finite(&self, action: &str) -> Result<()> {
        for p in &self.params {
            if let Some(i) = p.data.iter().position(|v| !v.is_finite()) {
                bail!(
                    "refusing to {action}: tensor '{}' holds {} at index {i}",
                    p.name,
                    p.data[i]
                );
            }
        }
        Ok(())
    }

    /// Saves as a Hugging Face model directory (f32 safetensors) that
    /// `transformers` loads unchanged. Refuses to write non-finite weights.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_as(dir, StoredDtype::F32)
    }

    /// [`Model::save`] with the weights stored as `dtype` (and the config's
    /// `torch_dtype` saying so).
    pub fn save_as(&self, dir: &Path, dtype: StoredDtype) -> Result<()> {
        self.check_finite("save")?;
        let bytes = self.safetensors_bytes_as(dtype)?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        write_atomic(&dir.join("model.safetensors"), &bytes)?;
        write_atomic(
            &dir.join("config.json"),
            hf_config_json(&self.cfg, dtype).as_bytes(),
        )?;
        Ok(())
    }
}

/// One tensor as Hugging Face stores it ([`Model::hf_tensors`]): its
/// name and shape, and the parameters it holds, rows stacked.
#[derive(Clone, Debug, PartialEq)]
pub struct HfTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub parts: Vec<usize>,
    /// Its index in [`Model::extras`] (a tensor of no parameter's).
    pub extra: Option<usize>,
}

/// A tensor as read from a file: decoded to f32, or mapped in place.
enum Source {
    Decoded(tensor_file::Tensor),
    Mapped(Vec<usize>, Stored),
    /// Packed quantized words (shape, mapping, byte offset), until folded
    /// with their scales and biases.
    Words(Vec<usize>, std::sync::Arc<memmap2::Mmap>, usize),
}

/// Folds each quantized module's `weight` (packed words), `scales` and
/// `biases` into one stored matrix of its dequantized shape `[rows, cols]`,
/// quantized as `config.json` says for that module; every shape and dtype
/// is checked, naming the file and tensor.
fn fold_quantized(
    found: &mut BTreeMap<String, (Source, String)>,
    q: Option<&crate::model::quant::Quantization>,
) -> Result<()> {
    let modules: Vec<String> = found
        .keys()
        .filter_map(|k| k.strip_suffix(".scales").map(str::to_string))
        .collect();
    for module in modules {
        let file = found[&format!("{module}.scales")].1.clone();
        let spec = q.and_then(|q| q.of(&module)).with_context(|| {
            format!(
                "'{file}': '{module}' is quantized (it has .scales), but config.json's \"quantization\" does not say how"
            )
        })?;
        let mut take = |part: &str| {
            found
                .remove(&format!("{module}.{part}"))
                .map(|(s, _)| s)
                .with_context(|| format!("'{file}': '{module}.{part}' is missing"))
        };
        let (words, scales, biases) = (take("weight")?, take("scales")?, take("biases")?);
        let (
            Source::Words(wshape, map, start),
            Source::Mapped(sshape, scales),
            Source::Mapped(bshape, biases),
        ) = (words, scales, biases)
        else {
            bail!("'{file}': '{module}' is not stored as MLX quantizes: uint32 .weight, float .scales and .biases");
        };
        let [rows, words] = wshape[..] else {
            bail!("'{file}': '{module}.weight' has shape {wshape:?}; a quantized matrix is 2-D");
        };
        let cols = words * 32 / spec.bits as usize;
        let groups = cols / spec.group_size;
        if words * 32 % spec.bits as usize != 0
            || !spec.fits(cols)
            || sshape != [rows, groups]
            || bshape != sshape
            || scales.dtype != biases.dtype
        {
            bail!(
                "'{file}': '{module}' does not hold {}-bit groups of {}: .weight {wshape:?}, .scales {sshape:?} ({}), .biases {bshape:?} ({})",
                spec.bits,
                spec.group_size,
                scales.dtype.name(),
                biases.dtype.name()
            );
        }
        let stored = Stored {
            map,
            start,
            len: rows * cols,
            dtype: scales.dtype,
            affine: Some(std::sync::Arc::new(crate::model::params::Affine {
                spec,
                cols,
                scales,
                biases,
            })),
        };
        found.insert(
            format!("{module}.weight"),
            (Source::Mapped(vec![rows, cols], stored), file),
        );
    }
    Ok(())
}

impl Source {
    fn shape(&self) -> &[usize] {
        match self {
            Source::Decoded(t) => &t.shape,
            Source::Mapped(shape, _) | Source::Words(shape, _, _) => shape,
        }
    }

    /// Row ranges `parts` of this matrix, each a tensor of its own.
    fn split_rows(self, parts: &[Range<usize>], name: &str, file: &str) -> Result<Vec<Source>> {
        let cols = self.shape()[1];
        Ok(match self {
            Source::Decoded(t) => parts
                .iter()
                .map(|r| {
                    Source::Decoded(tensor_file::Tensor {
                        shape: vec![r.len(), cols],
                        dtype: t.dtype.clone(),
                        data: t.data[r.start * cols..r.end * cols].to_vec(),
                    })
                })
                .collect(),
            Source::Mapped(_, st) => parts
                .iter()
                .map(|r| Source::Mapped(vec![r.len(), cols], st.rows(r.clone(), cols)))
                .collect(),
            // Words left unfolded had no scales and biases beside them.
            Source::Words(..) => bail!(
                "'{file}': tensor '{name}' holds packed uint32 words without the \".scales\" and \".biases\" of MLX's quantization"
            ),
        })
    }
}

/// A tensor kept as it was read (a multimodal checkpoint's vision
/// tower's): decoded, or mapped (dequantized as it is read).
fn extra_param(name: String, t: Source, file: &str) -> Result<Param> {
    let shape = t.shape().to_vec();
    let (data, stored) = match t {
        Source::Decoded(t) => (t.data, None),
        Source::Mapped(_, s) => (vec![], Some(s)),
        Source::Words(..) => bail!(
            "'{file}': tensor '{name}' holds packed uint32 words without the \".scales\" and \".biases\" of MLX's quantization"
        ),
    };
    Ok(Param {
        name,
        shape,
        data,
        stored,
        decay: false,
    })
}

/// Splits each fused projection the family stores (Phi-3's `qkv_proj`,
/// `gate_up_proj`) into its parts' tensors, by rows in order; a stored
/// matrix whose rows are not the parts' is refused naming both.
fn split_fused(found: &mut BTreeMap<String, (Source, String)>, cfg: &ModelConfig) -> Result<()> {
    for i in 0..cfg.num_hidden_layers {
        for f in cfg.fused() {
            let name = format!("model.layers.{i}.{}.weight", f.path);
            let Some((source, file)) = found.remove(&name) else {
                continue;
            };
            let shapes: Vec<(usize, usize)> = f.parts.iter().map(|t| t.shape(cfg)).collect();
            let rows: usize = shapes.iter().map(|s| s.0).sum();
            if source.shape() != [rows, shapes[0].1] {
                bail!(
                    "'{file}': tensor '{name}' has shape {:?}, the config implies {:?} ({} stacked)",
                    source.shape(),
                    [rows, shapes[0].1],
                    f.parts.iter().map(|t| t.module()).collect::<Vec<_>>().join(", ")
                );
            }
            let mut ranges = Vec::new();
            for (out, _) in &shapes {
                let start = ranges.last().map_or(0, |r: &Range<usize>| r.end);
                ranges.push(start..start + out);
            }
            for (t, part) in f
                .parts
                .iter()
                .zip(source.split_rows(&ranges, &name, &file)?)
            {
                let part_name = format!("model.layers.{i}.{}", t.weight_name());
                found.insert(part_name, (part, file.clone()));
            }
        }
    }
    Ok(())
}

/// The safetensors files of a model directory.
pub fn safetensor_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
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

impl Model {
    /// This model as plain f32 tensors in memory, its adapter (if any)
    /// folded into the base weights: what code that reads `Param::data`
    /// directly (the decoder) needs from a mapped or adapted model.
    pub fn merged(&self) -> Model {
        let mut m = self.clone();
        for p in &mut m.params {
            if p.stored.is_some() {
                p.data = p.values().into_owned();
                p.stored = None;
            }
        }
        if let Some(lora) = m.lora.take() {
            m.merge_lora(&lora);
        }
        m
    }

    /// Folds `lora` into the base weights: W ← W + s·B·A.
    pub fn merge_lora(&mut self, lora: &Lora) {
        let s = lora.cfg.scale() as f32;
        for (i, slot) in lora.slots.iter().enumerate() {
            for t in Projection::ALL {
                let (Some(ids), Some((a, b))) = (slot[t.index()], lora.adapter(i, t)) else {
                    continue;
                };
                let (r, inp) = (lora.cfg.rank, lora.params[ids.a].shape[1]);
                let out = b.len() / r;
                let mut ba = vec![0f32; out * inp];
                linalg::matmul(
                    linalg::MatRef::row_major(b, 0, out, r),
                    linalg::MatRef::row_major(a, 0, r, inp),
                    linalg::MatMut::row_major(&mut ba, 0, out, inp),
                    false,
                );
                let p = &mut self.params[t.base(&self.layers[i])];
                if p.stored.is_some() {
                    // A mapped base is read into memory before it changes.
                    p.data = p.values().into_owned();
                    p.stored = None;
                }
                p.data.iter_mut().zip(&ba).for_each(|(w, d)| *w += s * d);
            }
        }
        self.version += 1;
    }
}

/// The dtype a model directory's first matrix is stored in (read from the
/// safetensors header; nothing is loaded); for a config without weights
/// beside it, bf16, the dtype Hugging Face checkpoints are published in.
pub fn file_dtype(model: &Path) -> Result<StoredDtype> {
    let has_weights = ["model.safetensors", "model.safetensors.index.json"]
        .iter()
        .any(|f| model.join(f).is_file());
    if !has_weights {
        return Ok(StoredDtype::BF16);
    }
    for f in &safetensor_files(model)? {
        use crate::model::tensor_file::Mapped;
        let first = crate::model::tensor_file::map(f)?
            .into_values()
            .find_map(|t| match t {
                Mapped::Values(shape, s) if shape.len() == 2 => Some(s.dtype),
                _ => None,
            });
        if let Some(dtype) = first {
            return Ok(dtype);
        }
    }
    bail!("'{}' holds no weight matrices", model.display())
}
