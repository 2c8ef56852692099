//! Where a run's model comes from, resolved once: a preset (a known shape,
//! randomly initialised) or a Hugging Face model directory (a Hub id is
//! resolved to its snapshot directory first, by `model::hub::resolve`),
//! and how its frozen base is held (quantized on load or not).

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::model::config::ModelConfig;
use crate::model::quant::{QuantSpec, Quantization};
use crate::model::Model;

/// A resolved model: what the user named, its configuration, and its
/// directory unless it is a preset.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSource {
    /// As given: a preset name or a path.
    pub spec: String,
    /// The directory holding `config.json` and the weights; `None` for a
    /// preset.
    pub dir: Option<PathBuf>,
    /// The checkpoint's configuration, as its files say.
    pub config: ModelConfig,
    /// A frozen base quantized as it loads (`--quantize-base`), as MLX's
    /// affine quantization with this spec.
    pub quantize_on_load: Option<QuantSpec>,
}

impl ModelSource {
    /// A preset name, or a model directory holding `config.json` (errors
    /// as [`ModelConfig::resolve`]'s, with its suggestions).
    pub fn resolve(spec: &str) -> Result<ModelSource> {
        let config = ModelConfig::resolve(spec)?;
        let dir = match ModelConfig::preset(spec) {
            Some(_) => None,
            // `…/config.json` names its directory.
            None if Path::new(spec).ends_with("config.json") => {
                Some(crate::model::config::model_directory(Path::new(spec))?)
            }
            None => Some(PathBuf::from(spec)),
        };
        Ok(ModelSource {
            spec: spec.to_string(),
            dir,
            config,
            quantize_on_load: None,
        })
    }

    /// This model with its frozen base quantized as it loads.
    pub fn quantized_on_load(self, spec: QuantSpec) -> ModelSource {
        ModelSource {
            quantize_on_load: Some(spec),
            ..self
        }
    }

    /// How the frozen base is held quantized: the checkpoint's own MLX
    /// quantization, or the one applied on load; `None` for a plain base.
    pub fn base_quantization(&self) -> Option<Quantization> {
        self.config.quantization.clone().or_else(|| {
            self.quantize_on_load.map(|spec| Quantization {
                default: spec,
                modules: Default::default(),
            })
        })
    }

    /// Whether this is a preset (random weights of a known shape).
    pub fn is_preset(&self) -> bool {
        self.dir.is_none()
    }

    /// `tokenizer.json` beside the weights, when the directory has one.
    pub fn tokenizer_file(&self) -> Option<PathBuf> {
        self.dir
            .as_deref()
            .map(|d| d.join("tokenizer.json"))
            .filter(|p| p.is_file())
    }

    /// The starting weights: a preset initialised from `seed` with `cfg`
    /// (the preset's, or adjusted: special tokens); a directory loaded in
    /// f32, or memory-mapped in its file dtype when the base is `frozen`
    /// (LoRA), and quantized as it loads when asked.
    pub fn load(&self, cfg: &ModelConfig, frozen: bool, seed: u64) -> Result<Model> {
        match (&self.dir, frozen) {
            (None, _) => Model::init(cfg, seed),
            (Some(d), true) => {
                let mut m = Model::load_frozen(d)?;
                if let (Some(spec), None) = (self.quantize_on_load, &m.cfg.quantization) {
                    m.quantize_frozen(spec)?;
                }
                Ok(m)
            }
            (Some(d), false) => Model::load(d),
        }
    }

    /// The directory, or `None` for a preset.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_no_directory_and_directories_their_config() {
        let p = ModelSource::resolve("tiny").unwrap();
        assert!(p.is_preset() && p.tokenizer_file().is_none());
        assert_eq!(p.config, ModelConfig::preset("tiny").unwrap());

        let tmp = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::preset("tiny").unwrap();
        std::fs::write(
            tmp.path().join("config.json"),
            crate::model::hf_config_json(&cfg, crate::model::StoredDtype::F32),
        )
        .unwrap();
        let spec = tmp.path().to_str().unwrap();
        let d = ModelSource::resolve(spec).unwrap();
        assert_eq!(d.dir(), Some(tmp.path()));
        assert_eq!(d.config.hidden_size, cfg.hidden_size);
        assert!(d.tokenizer_file().is_none());
        std::fs::write(tmp.path().join("tokenizer.json"), "{}").unwrap();
        assert_eq!(d.tokenizer_file(), Some(tmp.path().join("tokenizer.json")));

        let e = ModelSource::resolve("qwen3-0.6").unwrap_err().to_string();
        assert!(e.contains("did you mean 'qwen3-0.6b'"), "{e}");
    }
}
