//! Whether a LoRA adapter is applied to the base it was trained on.
//!
//! PEFT records the base in `adapter_config.json`'s
//! `base_model_name_or_path`, mlx-lm in its `model`, as the user named it:
//! a Hub id, a directory, or (for our random presets) a preset's name. A
//! model `anetrain quantize` wrote names its source in
//! `quantized_from.json`, and counts as that base too (SFT, then QLoRA
//! from the SFT adapter). A matching shape is not a
//! matching base — Qwen3-0.6B and Qwen3-0.6B-Base have the same tensors —
//! so every command that applies an adapter (and `train --init-adapter`)
//! compares what the adapter names with the model given, and refuses a
//! different model in one line (the command line's `--any-base` skips
//! the check).

use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Result};

use crate::model::hub::HubId;

/// What a model spec names, so two specs of one model compare equal.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Identity {
    /// A preset (random initialisation) by name.
    Preset(String),
    /// A Hub repository, named by its id or found as a snapshot directory
    /// of the cache (`…/models--ORG--NAME/snapshots/COMMIT`); the revision
    /// does not count, and case does not either (the Hub ignores it).
    Hub(String),
    /// A directory on this machine, made absolute.
    Directory(PathBuf),
    /// A path that is not on this machine (an adapter from elsewhere).
    Elsewhere(PathBuf),
}

impl Identity {
    fn of(spec: &str) -> Identity {
        if crate::model::config::ModelConfig::preset(spec).is_some() {
            return Identity::Preset(spec.to_string());
        }
        let path = Path::new(spec);
        if let Ok(abs) = path.canonicalize() {
            return match snapshot_repo(&abs) {
                Some(repo) => Identity::Hub(repo),
                None => Identity::Directory(abs),
            };
        }
        match HubId::parse(spec) {
            Some(id) => Identity::Hub(id.repo.to_lowercase()),
            None => Identity::Elsewhere(path.to_path_buf()),
        }
    }

    /// The last name: a directory's, or a Hub repository's after `ORG/`.
    fn name(&self) -> String {
        let last = |p: &Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().to_lowercase())
                .unwrap_or_default()
        };
        match self {
            Identity::Preset(n) => n.clone(),
            Identity::Hub(r) => r.rsplit('/').next().unwrap_or(r).to_string(),
            Identity::Directory(p) | Identity::Elsewhere(p) => last(p),
        }
    }
}

/// `ORG/NAME` (lower case) when `dir` is a snapshot of the Hub cache, as
/// `huggingface_hub` lays it out.
fn snapshot_repo(dir: &Path) -> Option<String> {
    let parts: Vec<&str> = dir
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect();
    let at = parts.iter().rposition(|p| *p == "snapshots")?;
    let folder = parts.get(at.checked_sub(1)?)?.strip_prefix("models--")?;
    let (org, name) = folder.split_once("--")?;
    Some(format!("{org}/{name}").to_lowercase())
}

/// The base `adapter`'s config names, if it names one: PEFT's
/// `base_model_name_or_path`, else mlx-lm's `model`.
fn recorded_base(adapter: &Path) -> Option<String> {
    let text = std::fs::read_to_string(adapter.join("adapter_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let base = v["base_model_name_or_path"]
        .as_str()
        .or_else(|| v["model"].as_str())?
        .trim();
    (!base.is_empty()).then(|| base.to_string())
}

/// What a model directory `anetrain quantize` wrote was quantized from
/// (`quantized_from.json`'s `source`); nothing for a Hub id.
fn quantized_from(model: &str) -> Option<String> {
    let text = std::fs::read_to_string(Path::new(model).join(QUANTIZED_FROM)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["source"].as_str().map(String::from)
}

/// The file `anetrain quantize` records its source in.
pub const QUANTIZED_FROM: &str = "quantized_from.json";

/// What [`check`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum BaseMatch {
    /// The adapter names the model (or names no base).
    Same,
    /// The adapter names a path this machine does not have, under another
    /// last name: it cannot be checked (the caller warns).
    Unchecked { recorded: String },
}

/// Refuses `adapter` on `model` (the spec as given, before a Hub id is
/// resolved) when its config names another base. A base recorded as a
/// path this machine does not have cannot be checked: the same last name
/// passes, another is [`BaseMatch::Unchecked`]. A Hub id's repository
/// name matching a local directory's passes (a clone of that repository).
pub fn check(model: &str, adapter: &Path) -> Result<BaseMatch> {
    let Some(recorded) = recorded_base(adapter) else {
        return Ok(BaseMatch::Same);
    };
    let (was, now) = (Identity::of(&recorded), Identity::of(model));
    let same_name = was.name() == now.name();
    // A quantized copy of the adapter's base is that base.
    let source = quantized_from(model).map(|src| Identity::of(&src));
    match (&was, &now) {
        _ if was == now || source.as_ref() == Some(&was) => Ok(BaseMatch::Same),
        (Identity::Elsewhere(_), _) if same_name => Ok(BaseMatch::Same),
        (Identity::Elsewhere(_), _) => Ok(BaseMatch::Unchecked { recorded }),
        (Identity::Hub(_), Identity::Directory(_)) if same_name => Ok(BaseMatch::Same),
        _ => bail!(
            "adapter '{}' was trained on '{recorded}' (its adapter_config.json), not on '{model}': use --model {recorded}, or --any-base to apply it anyway",
            adapter.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_of_one_model_compare_equal() {
        let t = tempfile::tempdir().unwrap();
        let snap = t
            .path()
            .join("hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd");
        std::fs::create_dir_all(&snap).unwrap();
        assert_eq!(
            Identity::of(snap.to_str().unwrap()),
            Identity::of("qwen/Qwen3-0.6B@main")
        );
        assert_ne!(
            Identity::of("Qwen/Qwen3-0.6B"),
            Identity::of("Qwen/Qwen3-0.6B-Base")
        );
        assert_eq!(Identity::of("tiny"), Identity::Preset("tiny".into()));
        let rel = t.path().join("hub/./models--Qwen--Qwen3-0.6B/../x");
        assert!(matches!(
            Identity::of(rel.to_str().unwrap()),
            Identity::Elsewhere(_)
        ));
        assert_eq!(
            Identity::of("/nowhere/at/all/Qwen3-0.6B").name(),
            Identity::of("Qwen/Qwen3-0.6B").name()
        );
    }
}
