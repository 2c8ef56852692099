//! Checkpoints with exact resume.
//!
//! A run directory holds the latest model in Hugging Face layout at its top
//! level (`config.json`, `model.safetensors`, `tokenizer.json`) and the
//! trainer's own state in `trainer/`:
//!
//! ```text
//! trainer/model-<step>.safetensors   weights (the top-level file is a hard link to it)
//! trainer/optim-<step>.safetensors   AdamW moments
//! trainer/state.json                 step, RNG and data position, settings, checksums
//! ```
//!
//! Saving writes the two step files (each: temp file, fsync, rename), then
//! commits by replacing `state.json` the same way, then links the new weights
//! to the top level and deletes the previous step's files. A kill at any
//! instant leaves `state.json` naming a complete pair whose checksums verify;
//! a resume re-links the top level to that pair, in case the kill came
//! between the commit and the links.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::model::config::ModelConfig;
use crate::model::tensor_file;
use crate::model::{Model, Param};
use crate::train::optim::{AdamW, AdamWConfig};
use crate::util::fsutil::{write_atomic, write_atomic_with};

/// Everything besides tensors needed to continue a run bit for bit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// Sampling RNG state after `step` steps.
    pub rng: u64,
    /// Next window index for sequential sampling.
    pub cursor: u64,
    /// Steps skipped for non-finite loss or gradients so far.
    pub skipped: u64,
    /// The run's configured total (`--steps`), which the learning-rate
    /// schedule spans; 0 in checkpoints written before it was recorded.
    #[serde(default)]
    pub total_steps: u64,
    pub config: ModelConfig,
    /// Loss-scaler state (fp16 backends).
    pub scaler: crate::train::optim::LossScaler,
    pub adamw: AdamWConfig,
    /// The run's settings, which a resume must repeat (see `train`).
    pub settings: serde_json::Value,
    pub model_file: String,
    pub model_hash: String,
    pub optim_file: String,
    pub optim_hash: String,
}

pub const FORMAT: u32 = 1;

/// A checkpoint file's checksum: SHA-256 in hex, so `sha256sum` verifies
/// the files of `trainer/` against `state.json` too.
pub fn content_hash(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `bytes` match `hash`: SHA-256, or for checkpoints written before
/// SHA-256 (16 hex digits) the 64-bit hash they were written with.
fn hash_matches(bytes: &[u8], hash: &str) -> bool {
    if hash.len() == 16 {
        legacy_hash(bytes) == hash
    } else {
        content_hash(bytes) == hash
    }
}

/// The checksum of earlier checkpoints (FNV-1a over 8-byte words, then
/// mixed), kept only so their runs still resume.
fn legacy_hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap_or_default());
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= bytes.len() as u64;
    h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    format!("{:016x}", h ^ (h >> 33))
}

pub(crate) fn trainer_dir(out: &Path) -> PathBuf {
    out.join("trainer")
}

pub fn state_path(out: &Path) -> PathBuf {
    trainer_dir(out).join("state.json")
}

/// Writes `tensors` to `path` atomically (see [`write_atomic_with`]),
/// returning the SHA-256 of the bytes written.
fn write_tensors(
    path: &Path,
    tensors: &[(&str, &[usize], &[f32])],
    metadata: &[(&str, &str)],
) -> Result<String> {
    use sha2::Digest;
    struct Hashing<'a> {
        inner: &'a mut dyn Write,
        hash: sha2::Sha256,
    }
    impl Write for Hashing<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = self.inner.write(buf)?;
            self.hash.update(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.inner.flush()
        }
    }
    let mut digest = None;
    write_atomic_with(path, |w| {
        let mut h = Hashing {
            inner: w,
            hash: sha2::Sha256::new(),
        };
        tensor_file::write_to(&mut h, tensors, metadata)?;
        digest = Some(h.hash.finalize());
        Ok(())
    })?;
    Ok(digest
        .map(|d| d.iter().map(|b| format!("{b:02x}")).collect())
        .unwrap_or_default())
}

/// Held while a checkpoint is written: a process exiting at once takes it
/// first (see [`crate::train::abandon_fresh_run`]), so it never removes a
/// run directory under a save in progress, nor lets one start after.
pub static SAVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Saves a checkpoint of `model` and `opt` after `state.step` steps.
/// Refuses non-finite weights (a NaN never reaches a checkpoint).
///
/// With LoRA only the adapters are checkpointed, and the top level is a
/// PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
/// that is also mlx-lm's (`adapters.safetensors`, its keys in the config).
pub fn save(out: &Path, model: &Model, opt: &AdamW, mut state: TrainerState) -> Result<()> {
    let _saving = SAVING.lock().unwrap_or_else(|e| e.into_inner());
    for p in model.trainable() {
        if let Some(i) = p.data.iter().position(|v| !v.is_finite()) {
            bail!(
                "refusing to checkpoint: '{}' holds {} at index {i}",
                p.name,
                p.data[i]
            );
        }
    }
    let dir = trainer_dir(out);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create '{}'", dir.display()))?;
    let previous = read_state(out).ok();
    state.format = FORMAT;
    state.model_file = format!("model-{}.safetensors", state.step);
    state.optim_file = format!("optim-{}.safetensors", state.step);
    // Each file is written as it is encoded, and hashed as it is written.
    // A full run's file also holds a multimodal checkpoint's other
    // tensors (its vision tower), frozen, so a resume writes them back.
    let extras: Vec<_> = match model.lora {
        Some(_) => vec![],
        None => model.extras.iter().map(|p| (p, p.values())).collect(),
    };
    let weights: Vec<(&str, &[usize], &[f32])> = model
        .trainable()
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice(), p.data.as_slice()))
        .chain(
            extras
                .iter()
                .map(|(p, v)| (p.name.as_str(), p.shape.as_slice(), &v[..])),
        )
        .collect();
    state.model_hash = write_tensors(&dir.join(&state.model_file), &weights, &[("format", "pt")])?;
    let names: Vec<(String, String)> = model
        .trainable()
        .iter()
        .map(|p| (format!("m.{}", p.name), format!("v.{}", p.name)))
        .collect();
    let mut moments: Vec<(&str, &[usize], &[f32])> = Vec::new();
    for (i, (p, (m, v))) in model.trainable().iter().zip(&names).enumerate() {
        moments.push((m, &p.shape, &opt.m[i]));
        moments.push((v, &p.shape, &opt.v[i]));
    }
    state.optim_hash = write_tensors(&dir.join(&state.optim_file), &moments, &[])?;
    // Commit point.
    write_atomic(
        &state_path(out),
        serde_json::to_string_pretty(&state)?.as_bytes(),
    )?;
    publish_latest(out, model, &state)?;
    if let Some(prev) = previous {
        for f in [prev.model_file, prev.optim_file] {
            if f != state.model_file && f != state.optim_file {
                let _ = std::fs::remove_file(dir.join(f));
            }
        }
    }
    Ok(())
}

/// Makes the top level of `out` (the Hugging Face layout) show the
/// committed checkpoint `state`: its weights or adapter, and their config.
/// `save` calls it after the commit point; a resume calls it again, so a run
/// killed between the commit and these links still ends with its newest
/// weights at the top level.
pub fn publish_latest(out: &Path, model: &Model, state: &TrainerState) -> Result<()> {
    let dir = trainer_dir(out);
    match &model.lora {
        Some(lora) => {
            publish(
                out,
                &dir.join(&state.model_file),
                "adapter_model.safetensors",
            )?;
            // The same adapter as mlx-lm reads it, beside PEFT's.
            write_atomic_with(&out.join("adapters.safetensors"), |w| {
                lora.write_mlx_safetensors(w)
            })?;
            write_atomic(
                &out.join("adapter_config.json"),
                serde_json::to_string_pretty(&lora.peft_config(&adapter_base(state)))?.as_bytes(),
            )?;
        }
        // The checkpoint holds the weights as training does (a resume is
        // bit-exact); a model Hugging Face stores otherwise (Gemma's norm
        // weights without the offset they apply, Phi's fused projections)
        // is written out as Hugging Face stores it instead of linked.
        None if model.cfg.stored_otherwise() => {
            write_atomic(&out.join("model.safetensors"), &model.safetensors_bytes()?)?;
            write_atomic(
                &out.join("config.json"),
                crate::model::hf_config_json(&model.cfg, crate::model::StoredDtype::F32).as_bytes(),
            )?;
        }
        None => {
            publish(out, &dir.join(&state.model_file), "model.safetensors")?;
            write_atomic(
                &out.join("config.json"),
                crate::model::hf_config_json(&model.cfg, crate::model::StoredDtype::F32).as_bytes(),
            )?;
        }
    }
    Ok(())
}

/// The base an adapter records, as PEFT's `from_pretrained` reads it: a
/// Hub id as the user gave it (`base_model_name_or_path` the repository,
/// `revision` beside it unless `main`), else a directory by its absolute
/// path (found from any working directory), else a preset's name.
fn adapter_base(state: &TrainerState) -> crate::model::lora::AdapterBase {
    use crate::model::lora::AdapterBase;
    if let Some(id) = state.settings["hub_id"].as_str() {
        return match id.split_once('@') {
            Some((repo, rev)) if rev != "main" => AdapterBase {
                name: repo.to_string(),
                revision: Some(rev.to_string()),
            },
            Some((repo, _)) => AdapterBase::named(repo),
            None => AdapterBase::named(id),
        };
    }
    let given = state.settings["model"].as_str().unwrap_or_default();
    match std::path::Path::new(given).canonicalize() {
        Ok(p) if p.is_dir() => AdapterBase::named(&p.display().to_string()),
        _ => AdapterBase::named(given),
    }
}

/// Makes `src` the top-level file `name` atomically (hard link, or a copy
/// where links are unsupported).
fn publish(out: &Path, src: &Path, name: &str) -> Result<()> {
    let tmp = out.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    if std::fs::hard_link(src, &tmp).is_err() {
        std::fs::copy(src, &tmp).with_context(|| format!("cannot copy '{}'", src.display()))?;
    }
    std::fs::rename(&tmp, out.join(name))
        .with_context(|| format!("cannot update '{}'", out.join(name).display()))
}

pub fn read_state(out: &Path) -> Result<TrainerState> {
    let p = state_path(out);
    let text =
        std::fs::read_to_string(&p).with_context(|| format!("cannot read '{}'", p.display()))?;
    let s: TrainerState = serde_json::from_str(&text).with_context(|| {
        format!(
            "'{}' is corrupt or not an anetrain trainer state",
            p.display()
        )
    })?;
    if s.format != FORMAT {
        bail!(
            "'{}' has format {}, this anetrain reads format {FORMAT}",
            p.display(),
            s.format
        );
    }
    Ok(s)
}

/// Loads the committed checkpoint of a run directory, verifying checksums
/// and shapes. `base` is the frozen model with (freshly initialised)
/// adapters attached for a LoRA run, `None` for full training.
pub fn load(out: &Path, base: Option<Model>) -> Result<(Model, AdamW, TrainerState)> {
    let state = read_state(out)?;
    state
        .config
        .validate()
        .context("the checkpoint's model config is invalid")?;
    let dir = trainer_dir(out);
    let read_checked = |file: &str, hash: &str| -> Result<Vec<u8>> {
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            bail!(
                "'{}' names an invalid file '{file}'",
                state_path(out).display()
            );
        }
        let p = dir.join(file);
        let bytes = std::fs::read(&p).with_context(|| format!("cannot read '{}'", p.display()))?;
        if !hash_matches(&bytes, hash) {
            bail!(
                "'{}' does not match the checksum in state.json: the checkpoint is corrupt",
                p.display()
            );
        }
        Ok(bytes)
    };
    let mb = read_checked(&state.model_file, &state.model_hash)?;
    let ob = read_checked(&state.optim_file, &state.optim_hash)?;
    let mut model = match base {
        Some(m) => m,
        None => Model::init(&state.config, 0)?,
    };
    let mut weights = tensor_file::parse(&mb).context("checkpoint weights")?;
    let mut moments = tensor_file::parse(&ob).context("checkpoint optimizer state")?;
    let mut opt = AdamW::new(&model, state.adamw);
    opt.step = state.step - state.skipped;
    for (i, p) in model.trainable_mut().iter_mut().enumerate() {
        let take = |map: &mut std::collections::BTreeMap<String, tensor_file::Tensor>,
                    name: &str|
         -> Result<Vec<f32>> {
            let t = map
                .remove(name)
                .with_context(|| format!("checkpoint lacks tensor '{name}'"))?;
            if t.shape != p.shape {
                bail!(
                    "checkpoint tensor '{name}' has shape {:?}, expected {:?}",
                    t.shape,
                    p.shape
                );
            }
            Ok(t.data)
        };
        p.data = take(&mut weights, &p.name.clone())?;
        opt.m[i] = take(&mut moments, &format!("m.{}", p.name))?;
        opt.v[i] = take(&mut moments, &format!("v.{}", p.name))?;
    }
    if model.lora.is_none() && model.extras.is_empty() {
        // The frozen tensors a full run keeps beside its own (in name
        // order, as a model directory is read).
        model.extras = weights
            .into_iter()
            .map(|(name, t)| Param {
                name,
                shape: t.shape,
                data: t.data,
                stored: None,
                decay: false,
            })
            .collect();
    }
    Ok((model, opt, state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::LossScaler;

    fn state(cfg: &ModelConfig) -> TrainerState {
        TrainerState {
            format: FORMAT,
            step: 3,
            rng: 1,
            cursor: 0,
            skipped: 0,
            total_steps: 3,
            config: cfg.clone(),
            scaler: LossScaler::fixed(),
            adamw: AdamWConfig::default(),
            settings: serde_json::json!({"model": "tiny"}),
            model_file: String::new(),
            model_hash: String::new(),
            optim_file: String::new(),
            optim_hash: String::new(),
        }
    }

    #[test]
    fn checksums_are_sha256() {
        // FIPS 180-2 test vector.
        assert_eq!(
            content_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_resume_relinks_the_top_level_after_a_kill_between_commit_and_links() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("model.safetensors");
        let older = Model::init(&cfg, 1).unwrap();
        let opt = AdamW::new(&older, AdamWConfig::default());
        save(dir.path(), &older, &opt, state(&cfg)).unwrap();
        let older_bytes = std::fs::read(&top).unwrap();
        let newer = Model::init(&cfg, 2).unwrap();
        let mut s = state(&cfg);
        s.step = 4;
        save(dir.path(), &newer, &opt, s).unwrap();
        // The kill: step 4 is committed, the top level still shows step 3.
        // (Removed first: the top-level file is a hard link into trainer/.)
        std::fs::remove_file(&top).unwrap();
        std::fs::write(&top, &older_bytes).unwrap();
        let (loaded, _, committed) = load(dir.path(), None).unwrap();
        assert_eq!(committed.step, 4);
        publish_latest(dir.path(), &loaded, &committed).unwrap();
        let published = std::fs::read(&top).unwrap();
        let step4 = std::fs::read(trainer_dir(dir.path()).join(&committed.model_file)).unwrap();
        assert!(published == step4 && published != older_bytes);
    }

    #[test]
    fn checkpoints_with_the_earlier_checksum_still_load_and_corruption_is_caught() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let model = Model::init(&cfg, 1).unwrap();
        let opt = AdamW::new(&model, AdamWConfig::default());
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &model, &opt, state(&cfg)).unwrap();
        let (loaded, _, _) = load(dir.path(), None).unwrap();
        assert_eq!(loaded.params, model.params);
        // Rewrite the checksums as an earlier anetrain wrote them.
        let mut s = read_state(dir.path()).unwrap();
        let tdir = trainer_dir(dir.path());
        s.model_hash = legacy_hash(&std::fs::read(tdir.join(&s.model_file)).unwrap());
        s.optim_hash = legacy_hash(&std::fs::read(tdir.join(&s.optim_file)).unwrap());
        assert_eq!(s.model_hash.len(), 16);
        let text = serde_json::to_string_pretty(&s).unwrap();
        std::fs::write(state_path(dir.path()), text).unwrap();
        let (loaded, _, _) = load(dir.path(), None).unwrap();
        assert_eq!(loaded.params, model.params);
        // One flipped byte in the weights is refused.
        let f = tdir.join(&s.model_file);
        let mut b = std::fs::read(&f).unwrap();
        let n = b.len() - 1;
        b[n] ^= 1;
        std::fs::write(&f, b).unwrap();
        let e = load(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
    }
}
