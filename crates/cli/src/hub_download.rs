//! Downloads of Hugging Face Hub models for `anetrain::model::hub` (which
//! resolves `ORG/NAME[@REVISION]` to a snapshot of the cache): the files a
//! snapshot lacks, fetched with the `hf-hub` crate (resumable `.part`
//! files, a progress bar on a terminal). [`register`] installs it.

use std::path::{Path, PathBuf};

use anetrain::model::hub::{HubId, Need};
use anyhow::{bail, Result};

/// Makes the library's Hub resolution download what the cache lacks.
pub fn register() {
    anetrain::model::hub::set_downloader(download::snapshot);
}

#[cfg(feature = "hub-download")]
mod download {
    use super::*;
    use anetrain::model::hub::{missing, shards};
    use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
    use hf_hub::{Cache, Repo, RepoType};
    use std::io::IsTerminal;

    const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

    /// The files of a repository listing a command needs: `config.json`, the
    /// tokenizer and generation files that exist, and for a whole model the
    /// safetensors weights (the index first: it names the shards).
    fn wanted(listing: &[String], need: Need) -> Vec<String> {
        const TOKENIZER: [&str; 5] = [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "chat_template.json",
        ];
        let has = |f: &str| listing.iter().any(|l| l == f);
        let mut files = vec!["config.json".to_string()];
        if need != Need::Config {
            files.extend(TOKENIZER.iter().filter(|f| has(f)).map(|f| f.to_string()));
        }
        if need == Need::Model {
            if has("generation_config.json") {
                files.push("generation_config.json".into());
            }
            if has("model.safetensors.index.json") {
                files.push("model.safetensors.index.json".into());
            } else {
                files.push("model.safetensors".into());
            }
        }
        files
    }

    /// Downloads what `need` asks for of `id` into the cache and returns
    /// the snapshot directory.
    pub fn snapshot(cache: &Path, id: &HubId, need: Need) -> Result<PathBuf> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .map(|e| e.trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        let hf_cache = Cache::new(cache.to_path_buf());
        let token = std::env::var("HF_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| hf_cache.token());
        let api = ApiBuilder::from_cache(hf_cache)
            .with_endpoint(endpoint.clone())
            .with_token(token)
            .with_progress(std::io::stderr().is_terminal())
            // A dropped connection resumes from the bytes already written.
            .with_retries(3)
            .build()
            .map_err(|e| anyhow::anyhow!("'{id}': cannot set up downloads: {e}"))?;
        let repo = api.repo(Repo::with_revision(
            id.repo.clone(),
            RepoType::Model,
            id.revision.clone(),
        ));
        let info = repo
            .info()
            .map_err(|e| explain(e, id, need, &endpoint, cache, None))?;
        let listing: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
        let mut files = wanted(&listing, need);
        if need == Need::Model
            && !files
                .iter()
                .any(|f| listing.contains(f) && f.contains("safetensors"))
        {
            bail!(
                "'{id}' has no safetensors weights (model.safetensors or model.safetensors.index.json) on {endpoint}; anetrain reads safetensors only"
            );
        }
        if need == Need::Tokenizer && !listing.iter().any(|f| f == "tokenizer.json") {
            bail!("'{id}' has no tokenizer.json on {endpoint}");
        }
        let mut dir = None;
        let mut i = 0;
        while i < files.len() {
            let f = files[i].clone();
            let path = fetch(&repo, &f, (id, need), &endpoint, cache)?;
            if f == "model.safetensors.index.json" {
                let names = shards(&path).ok_or_else(|| {
                    anyhow::anyhow!("'{id}': model.safetensors.index.json has no weight_map")
                })?;
                files.extend(names);
            }
            dir.get_or_insert_with(|| path.parent().map(Path::to_path_buf));
            i += 1;
        }
        let dir = dir
            .flatten()
            .ok_or_else(|| anyhow::anyhow!("'{id}': the download left no snapshot directory"))?;
        let left = missing(&dir, need);
        if !left.is_empty() {
            bail!(
                "'{id}': the snapshot '{}' still lacks {}",
                dir.display(),
                left.join(", ")
            );
        }
        Ok(dir)
    }

    /// One file, from the cache when there, else downloaded (a line on
    /// stderr for each; a progress bar on a terminal).
    fn fetch(
        repo: &ApiRepo,
        f: &str,
        (id, need): (&HubId, Need),
        endpoint: &str,
        cache: &Path,
    ) -> Result<PathBuf> {
        // `get` looks in the cache first, so only missing files travel.
        let cached = hf_hub::Cache::new(cache.to_path_buf())
            .repo(Repo::with_revision(
                id.repo.clone(),
                RepoType::Model,
                id.revision.clone(),
            ))
            .get(f);
        if let Some(p) = cached {
            return Ok(p);
        }
        eprintln!("downloading {id}: {f}");
        repo.get(f)
            .map_err(|e| explain(e, id, need, endpoint, cache, Some(f)))
    }

    /// One line for a failed Hub request: what failed and what to do.
    fn explain(
        e: ApiError,
        id: &HubId,
        need: Need,
        endpoint: &str,
        cache: &Path,
        file: Option<&str>,
    ) -> anyhow::Error {
        let cached = cache.join(id.folder());
        let e = match e {
            ApiError::TooManyRetries(inner) => *inner,
            e => e,
        };
        let msg = match (&e, file) {
            (ApiError::RequestError(r), _) => match r.as_ref() {
                ureq::Error::Status(404, _) if file.is_none() => format!(
                    "'{id}' is not a model repository on {endpoint} (404): check the name and the revision '{}'",
                    id.revision
                ),
                ureq::Error::Status(401 | 403, _) => format!(
                    "'{id}' refused access on {endpoint}: a gated or private model needs a token with access (set HF_TOKEN, or run `huggingface-cli login`)"
                ),
                ureq::Error::Status(404, _) => format!(
                    "'{id}' has no {} at revision '{}' on {endpoint}",
                    file.unwrap_or_default(),
                    id.revision
                ),
                ureq::Error::Status(code, _) => {
                    format!("'{id}': {endpoint} answered {code}; try again later")
                }
                ureq::Error::Transport(t) => format!(
                    "'{id}': {} ({}) and {endpoint} cannot be reached: {t}",
                    anetrain::model::hub::absence(cache, id, need),
                    cached.display()
                ),
            },
            (e, Some(f)) => format!(
                "'{id}': downloading {f} into '{}' failed: {e}",
                cached.display()
            ),
            (e, None) => format!("'{id}': {e}"),
        };
        anyhow::anyhow!(msg)
    }
}

#[cfg(not(feature = "hub-download"))]
mod download {
    use super::*;

    pub fn snapshot(cache: &Path, id: &HubId, need: Need) -> Result<PathBuf> {
        bail!(
            "'{id}': {} ({}) and this build cannot download (built without the `hub-download` feature); download it with `huggingface-cli download {}`",
            anetrain::model::hub::absence(cache, id, need),
            cache.join(id.folder()).display(),
            id.repo
        )
    }
}
