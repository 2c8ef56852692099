//! Hugging Face Hub model ids (`ORG/NAME[@REVISION]`) wherever a model
//! directory is accepted: resolved to a snapshot directory of the Hub cache,
//! laid out exactly as Python's `huggingface_hub` lays it out
//! (`models--ORG--NAME/{blobs,refs,snapshots}`, files in a snapshot are
//! relative symlinks to content-named blobs), so both find each other's
//! downloads. Missing files are fetched by the downloader the program
//! registered ([`set_downloader`]: the command line's uses the `hf-hub`
//! crate); without one, only cached models resolve.
//!
//! The environment is read as `huggingface_hub` reads it: `HF_HUB_CACHE`,
//! else `HF_HOME/hub`, else `~/.cache/huggingface/hub`; `HF_ENDPOINT`;
//! `HF_TOKEN`, else the token file `huggingface-cli login` writes;
//! `HF_HUB_OFFLINE=1` for the cache alone.
//!
//! A cached snapshot that holds what the command needs is used without
//! contacting the Hub (a run never changes model under the user's feet;
//! `@REVISION` or removing the cache entry picks up a newer one). A local
//! path, or a preset name, always wins over a Hub id.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// What a command reads from a model: its `config.json` alone (`kernels`,
/// `doctor`), its tokenizer (`convert --tokenizer`), or the whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Config,
    Tokenizer,
    Model,
}

/// `ORG/NAME` with an optional `@REVISION` (a branch, tag or commit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// Whether `spec` has the shape of a Hub model id: two names of
    /// letters, digits, `-`, `_` and `.` joined by one `/` (not `./x`).
    pub fn parse(spec: &str) -> Option<HubId> {
        let (repo, revision) = match spec.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return None,
            None => (spec, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        (part_ok(org) && part_ok(name)).then(|| HubId {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }

    /// `models--ORG--NAME`, the repository's directory in the cache.
    pub fn folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.revision.as_str() {
            "main" => write!(f, "{}", self.repo),
            rev => write!(f, "{}@{rev}", self.repo),
        }
    }
}

/// The cache directory, as `huggingface_hub` chooses it.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p).join("hub"));
    }
    match std::env::var_os("HOME").filter(|p| !p.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache/huggingface/hub")),
        None => bail!(
            "cannot place the Hugging Face cache: neither HF_HUB_CACHE, HF_HOME nor HOME is set"
        ),
    }
}

/// `HF_HUB_OFFLINE` as `huggingface_hub` reads a boolean variable.
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| ["1", "ON", "YES", "TRUE"].contains(&v.trim().to_uppercase().as_str()))
        .unwrap_or(false)
}

/// `spec` unchanged when it is a preset or an existing path (or not shaped
/// like a Hub id: the command's own error then names it); otherwise the
/// snapshot directory of the Hub model it names, downloaded if needed.
pub fn resolve(spec: &str, need: Need) -> Result<String> {
    let path = Path::new(spec);
    if path.is_file() && path.file_name().is_some_and(|n| n == "config.json") {
        // `DIR/config.json` names the model directory.
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        return Ok(dir.unwrap_or(Path::new(".")).to_string_lossy().into_owned());
    }
    if crate::model::config::ModelConfig::preset(spec).is_some() || path.exists() {
        return Ok(spec.to_string());
    }
    let Some(id) = HubId::parse(spec) else {
        return Ok(spec.to_string());
    };
    let dir = snapshot(&id, need)?;
    Ok(dir.to_string_lossy().into_owned())
}

/// [`resolve`] for arguments that are paths.
pub fn resolve_path(spec: &Path, need: Need) -> Result<PathBuf> {
    match spec.to_str() {
        Some(s) => resolve(s, need).map(PathBuf::from),
        None => Ok(spec.to_path_buf()),
    }
}

/// `--tokenizer ORG/NAME`: the `tokenizer.json` of that Hub model.
pub fn resolve_tokenizer(spec: &Path) -> Result<PathBuf> {
    let resolved = resolve_path(spec, Need::Tokenizer)?;
    Ok(match resolved == spec {
        true => resolved,
        false => resolved.join("tokenizer.json"),
    })
}

/// The cached snapshot of `id` holding what `need` asks for, downloading
/// what is missing unless offline.
fn snapshot(id: &HubId, need: Need) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let cached = cached_snapshot(&cache, id);
    if let Some(dir) = &cached {
        if missing(dir, need).is_empty() {
            return Ok(dir.clone());
        }
    }
    if offline() {
        let what = absence(&cache, id, need);
        bail!(
            "'{id}': {what} ({}) and HF_HUB_OFFLINE is set; run once with network access, or unset HF_HUB_OFFLINE",
            cache.join(id.folder()).display()
        );
    }
    match DOWNLOADER.get() {
        Some(download) => download(&cache, id, need),
        None => bail!(
            "'{id}': {} ({}) and this program cannot download; download it with `huggingface-cli download {}`",
            absence(&cache, id, need),
            cache.join(id.folder()).display(),
            id.repo
        ),
    }
}

/// Why the cache at `cache` cannot serve `need` of `id`: "it is not in
/// the Hugging Face cache", or what its cached snapshot lacks (a download
/// cut short, or one made for a command that needed less).
pub fn absence(cache: &Path, id: &HubId, need: Need) -> String {
    match cached_snapshot(cache, id) {
        Some(dir) => format!(
            "its cached snapshot lacks {}",
            missing(&dir, need).join(", ")
        ),
        None => "it is not in the Hugging Face cache".into(),
    }
}

/// Fetches what a cached snapshot of `id` lacks for `need` into the cache
/// at `cache`; returns the snapshot directory.
pub type Download = fn(cache: &Path, id: &HubId, need: Need) -> Result<PathBuf>;

static DOWNLOADER: std::sync::OnceLock<Download> = std::sync::OnceLock::new();

/// Registers the program's downloader (once; later calls change nothing).
pub fn set_downloader(download: Download) {
    let _ = DOWNLOADER.set(download);
}

/// The snapshot directory `id`'s revision points to in the cache, if any:
/// `refs/REVISION` holds a commit, or the revision is itself a commit.
fn cached_snapshot(cache: &Path, id: &HubId) -> Option<PathBuf> {
    let repo = cache.join(id.folder());
    let commit = std::fs::read_to_string(repo.join("refs").join(&id.revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| id.revision.clone());
    let dir = repo.join("snapshots").join(commit);
    dir.is_dir().then_some(dir)
}

/// What `need` requires that `dir` lacks: `config.json`, `tokenizer.json`,
/// the safetensors weights (one file, or every shard an index names).
pub fn missing(dir: &Path, need: Need) -> Vec<String> {
    let mut files = vec![];
    match need {
        Need::Config => files.push("config.json".to_string()),
        Need::Tokenizer => files.push("tokenizer.json".to_string()),
        Need::Model => {
            files.push("config.json".to_string());
            let index = dir.join("model.safetensors.index.json");
            match shards(&index) {
                Some(names) => files.extend(names),
                None => files.push("model.safetensors".to_string()),
            }
        }
    }
    files.retain(|f| !dir.join(f).is_file());
    files
}

/// The shard files a `model.safetensors.index.json` names, if it reads.
pub fn shards(index: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(index).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut names: Vec<String> = v["weight_map"]
        .as_object()?
        .values()
        .filter_map(|f| f.as_str().map(String::from))
        .collect();
    names.sort();
    names.dedup();
    Some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_and_what_is_not_one() {
        let id = HubId::parse("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("Qwen/Qwen3-0.6B", "main")
        );
        assert_eq!(id.folder(), "models--Qwen--Qwen3-0.6B");
        let id = HubId::parse("meta-llama/Llama-3.2-1B@v1.0").unwrap();
        assert_eq!(id.revision, "v1.0");
        assert_eq!(id.to_string(), "meta-llama/Llama-3.2-1B@v1.0");
        for not in [
            "tiny",
            "./x/y",
            "../a/b",
            "a/b/c",
            "/abs/path",
            "a/",
            "a/b@",
            "a b/c",
        ] {
            assert_eq!(HubId::parse(not), None, "{not}");
        }
    }

    #[test]
    fn a_sharded_model_needs_every_shard_its_index_names() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), "{}").unwrap();
        assert_eq!(missing(d.path(), Need::Config), Vec::<String>::new());
        assert_eq!(missing(d.path(), Need::Model), vec!["model.safetensors"]);
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(d.path().join("m-1.safetensors"), "").unwrap();
        assert_eq!(missing(d.path(), Need::Model), vec!["m-2.safetensors"]);
        assert_eq!(missing(d.path(), Need::Tokenizer), vec!["tokenizer.json"]);
    }
}
