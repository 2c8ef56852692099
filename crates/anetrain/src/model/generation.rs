//! What a model directory's `generation_config.json` says about generation
//! (end tokens, sampling defaults), and the sampling settings it yields.

use anyhow::{bail, Result};

/// Sampling settings.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f64,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f64,
    /// Only the `top_k` likeliest tokens are drawn from (0 disables), before
    /// the nucleus is cut, as transformers applies them.
    pub top_k: usize,
}

/// What a model directory's `generation_config.json` says about
/// generation, as transformers reads it: the tokens that end it
/// (`eos_token_id`, one id or a list) and the sampling defaults.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// `do_sample: false` means greedy whatever the temperature says.
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
}

impl GenerationConfig {
    /// `dir/generation_config.json`, or `None` when there is none; a file
    /// that does not parse is an error naming it.
    pub fn load(dir: &std::path::Path) -> Result<Option<GenerationConfig>> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Ids {
            One(u32),
            Many(Vec<u32>),
        }
        #[derive(serde::Deserialize)]
        struct Raw {
            eos_token_id: Option<Ids>,
            bos_token_id: Option<u32>,
            do_sample: Option<bool>,
            temperature: Option<f64>,
            top_p: Option<f64>,
            top_k: Option<usize>,
        }
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => bail!("cannot read '{}': {e}", path.display()),
        };
        let raw: Raw = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("'{}' is not a generation config: {e}", path.display()))?;
        Ok(Some(GenerationConfig {
            eos_token_ids: match raw.eos_token_id {
                None => vec![],
                Some(Ids::One(i)) => vec![i],
                Some(Ids::Many(v)) => v,
            },
            bos_token_id: raw.bos_token_id,
            do_sample: raw.do_sample,
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
        }))
    }

    /// The sampling to use: the user's values where given, else this
    /// config's, else `fallback`; `do_sample: false` makes the default
    /// greedy (as transformers' `generate`).
    pub fn sampling(
        cfg: Option<&GenerationConfig>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<usize>,
        fallback: Sampling,
    ) -> Sampling {
        let greedy = cfg.and_then(|c| c.do_sample) == Some(false);
        let default_t = if greedy {
            0.0
        } else {
            cfg.and_then(|c| c.temperature)
                .unwrap_or(fallback.temperature)
        };
        Sampling {
            temperature: temperature.unwrap_or(default_t),
            top_p: top_p
                .or(cfg.and_then(|c| c.top_p))
                .unwrap_or(fallback.top_p),
            top_k: top_k
                .or(cfg.and_then(|c| c.top_k))
                .unwrap_or(fallback.top_k),
        }
    }
}

/// Copies `from/generation_config.json`, if there is one, into `to`
/// (atomically): a run or merged model ends its generation where its base
/// does.
pub fn copy_generation_config(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    let src = from.join("generation_config.json");
    if !src.is_file() {
        return Ok(());
    }
    let bytes =
        std::fs::read(&src).map_err(|e| anyhow::anyhow!("cannot read '{}': {e}", src.display()))?;
    crate::util::fsutil::write_atomic(&to.join("generation_config.json"), &bytes)
}
