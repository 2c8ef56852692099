//! What a run is asked to do: its settings (saved with every checkpoint
//! and compared on resume), the request around them, and their checks.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::optim::AdamWConfig;
use crate::data::records::{self};
use crate::data::tokens::TokenDtype;
use crate::device::backend::Backend;
use crate::model::adapter_base::{self, BaseMatch};
use crate::model::config::ModelConfig;
use crate::model::hub;
use crate::model::lora::{Lora, LoraConfig};
use crate::train::objective::Objective;
use crate::util::choice::Choice;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sample {
    /// Windows at uniformly random offsets.
    Random,
    /// Window k starts at k·seq (wrapping around).
    Sequential,
}

impl crate::util::choice::Choice for Sample {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Sample::Random,
            "random",
            "Windows at uniformly random offsets",
        ),
        (
            Sample::Sequential,
            "sequential",
            "Window k starts at k·seq (wrapping around)",
        ),
    ];
}

/// Settings that define a run; a resume must repeat them (except `steps`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    /// The model's directory (a Hub id resolved to its cached snapshot),
    /// or a preset's name.
    pub model: String,
    /// The Hub id `ORG/NAME[@REVISION]` the model was given as, if it was:
    /// an adapter records it as its base (as PEFT does), so it is portable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_id: Option<String>,
    pub backend: Backend,
    pub data: Option<PathBuf>,
    pub token_dtype: TokenDtype,
    pub seq: usize,
    pub batch: usize,
    pub accum: usize,
    pub lr: f64,
    /// `None`: a tenth of `--steps`.
    pub warmup: Option<u64>,
    pub min_lr_frac: f64,
    pub clip: f64,
    pub seed: u64,
    pub sample: Sample,
    pub val_frac: f64,
    pub eval_every: u64,
    pub eval_windows: usize,
    /// LoRA adapters instead of full training.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// The adapter LoRA starts from (`--init-adapter`) instead of fresh
    /// adapters; `lora` is then its configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_adapter: Option<PathBuf>,
    /// The frozen base quantized on load (`--quantize-base`), as MLX's
    /// affine quantization with this spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize_base: Option<crate::model::quant::QuantSpec>,
    /// JSONL records: the loss counts only the completion.
    #[serde(default)]
    pub mask_prompt: bool,
    /// JSONL records: the prompt/completion field names.
    #[serde(default)]
    pub keys: records::Keys,
    /// The device paths' initial loss scale (dynamic; 1024 unless given).
    #[serde(default)]
    pub loss_scale: Option<f64>,
    /// What the run optimises (`--objective`): SFT, or preference tuning
    /// with its loss's settings. Saved under `"preference"`, absent for
    /// SFT, as runs have always saved it.
    #[serde(
        rename = "preference",
        default,
        skip_serializing_if = "Objective::is_sft",
        with = "crate::train::objective::saved"
    )]
    pub objective: Objective,
}

/// The share of the data held out for validation when there is no
/// `valid.jsonl` (`train --val-frac`'s default).
pub const DEFAULT_VAL_FRAC: f64 = 0.02;

impl TrainSettings {
    /// A run of `model` at `seq` reading its data as `train` does by
    /// default (`--val-frac`, the record keys, the objective), every other
    /// setting neutral (one sequence a step, no learning rate, the CPU):
    /// for the library's own runs and reads of data (`doctor`'s short
    /// runs, `kernels plan --data`), each setting what it needs.
    pub fn neutral(model: &str, seq: usize) -> TrainSettings {
        TrainSettings {
            model: model.to_string(),
            hub_id: None,
            backend: Backend::Cpu,
            data: None,
            token_dtype: TokenDtype::U16,
            seq,
            batch: 1,
            accum: 1,
            lr: 0.0,
            warmup: None,
            min_lr_frac: 0.0,
            clip: 0.0,
            seed: 0,
            sample: Sample::Random,
            val_frac: DEFAULT_VAL_FRAC,
            eval_every: 0,
            eval_windows: 0,
            lora: None,
            init_adapter: None,
            quantize_base: None,
            mask_prompt: false,
            keys: Default::default(),
            loss_scale: None,
            objective: Default::default(),
        }
    }

    /// The model as a person names it: the Hub id it was given as, else
    /// the preset or directory (never a snapshot's path in the cache).
    pub fn model_name(&self) -> &str {
        self.hub_id.as_deref().unwrap_or(&self.model)
    }

    /// The learning rate a run takes unless given one: 2e-4 for LoRA
    /// (mlx-lm's and PEFT's usual), 3e-3 for the `tiny` preset, 5e-4 for
    /// the other presets trained from scratch, 2e-5 to fine-tune every
    /// weight of a pretrained model.
    pub fn default_lr(model: &str, lora: bool) -> f64 {
        match model {
            _ if lora => 2e-4,
            "tiny" => 3e-3,
            m if ModelConfig::preset(m).is_some() => 5e-4,
            _ => 2e-5,
        }
    }

    /// The model a run trains, named as the user gave it (a preset, a
    /// directory or a Hub id): `(model, hub_id)`, the directory (a Hub
    /// id's snapshot, downloaded if need be) and the id when it was one.
    pub fn resolve_model(spec: &str) -> Result<(String, Option<String>)> {
        let model = hub::resolve(spec, hub::Need::Model)?;
        let hub_id = (model != spec && !Path::new(spec).exists()).then(|| spec.to_string());
        Ok((model, hub_id))
    }

    /// The LoRA of a run started from the adapter in `dir` (its rank, α,
    /// dropout and projections), with `dir` made absolute so a run resumed
    /// from elsewhere still finds it. Refused when the adapter names
    /// another base than `model` (the spec as given) unless `any_base`;
    /// what cannot be checked here comes back as [`BaseMatch::Unchecked`].
    pub fn lora_of_adapter(
        model: &str,
        dir: &Path,
        any_base: bool,
    ) -> Result<(LoraConfig, PathBuf, BaseMatch)> {
        let found = match any_base {
            true => BaseMatch::Same,
            false => adapter_base::check(model, dir)?,
        };
        let cfg = ModelConfig::resolve(&hub::resolve(model, hub::Need::Config)?)?;
        let lora = Lora::config_of(&cfg, dir)?;
        let dir = dir
            .canonicalize()
            .with_context(|| format!("adapter directory '{}' does not exist", dir.display()))?;
        Ok((lora, dir, found))
    }
}

/// Everything `anetrain train` was asked to do.
#[derive(Clone, Debug)]
pub struct TrainRequest {
    pub settings: TrainSettings,
    pub adamw: AdamWConfig,
    pub steps: u64,
    pub out: PathBuf,
    /// `out` is the default name (`default_out`): taken already, it gets
    /// the first free suffix.
    pub out_is_default: bool,
    pub resume: bool,
    pub tokenizer: Option<PathBuf>,
    pub save_every: u64,
    /// How (and whether) memory is traded for time; none of it changes a
    /// result, so a resume may change it.
    pub memory: MemoryOptions,
}

pub use crate::plan::memory::MemoryOptions;

pub(super) fn validate(s: &TrainSettings, r: &TrainRequest) -> Result<()> {
    let counts = [
        ("--seq", s.seq as u64),
        ("--batch", s.batch as u64),
        ("--accum", s.accum as u64),
        ("--steps", r.steps),
    ];
    if let Some((flag, _)) = counts.iter().find(|(_, n)| *n < 1) {
        bail!("{flag} must be at least 1");
    }
    if let Some(d) = &s.data {
        if d.is_dir() && !d.join("train.jsonl").is_file() {
            bail!(
                "--data '{}' is a directory without train.jsonl; name a token file, a .txt or .jsonl file, or a directory holding train.jsonl (and optionally valid.jsonl, test.jsonl)",
                d.display()
            );
        }
        if !d.exists() {
            bail!("--data '{}': the file does not exist", d.display());
        }
    }
    if s.mask_prompt && !s.data.as_deref().is_some_and(records::is_records) {
        bail!("--mask-prompt applies to JSONL records (--data FILE.jsonl or a directory with train.jsonl)");
    }
    if !(s.lr.is_finite() && s.lr > 0.0) {
        bail!("--lr must be a positive number");
    }
    if !(0.0..1.0).contains(&s.val_frac) {
        bail!("--val-frac must be in [0, 1)");
    }
    if !(0.0..=1.0).contains(&s.min_lr_frac) {
        bail!("--min-lr-frac must be in [0, 1]");
    }
    let a = &r.adamw;
    if !(0.0..1.0).contains(&a.beta1)
        || !(0.0..1.0).contains(&a.beta2)
        || a.eps <= 0.0
        || a.weight_decay < 0.0
    {
        bail!("AdamW needs 0 <= beta1, beta2 < 1, eps > 0 and wd >= 0");
    }
    if s.clip < 0.0 || !s.clip.is_finite() {
        bail!("--clip must be >= 0 (0 disables clipping)");
    }
    if s.objective.is_preference() {
        validate_preference(s)?;
    }
    if let Some(l) = &s.lora {
        l.validate()?;
        if l.dropout > 0.0 && s.backend != Backend::Cpu {
            bail!(
                "--lora-dropout is only supported with --backend cpu (the Neural Engine kernels have no dropout); use --lora-dropout 0"
            );
        }
        if ModelConfig::preset(&s.model).is_some() {
            bail!(
                "LoRA adapts a pretrained model, and '{}' is a preset (random weights, never saved); give --model a Hub id (e.g. Qwen/Qwen3-0.6B), a model directory (`anetrain convert` makes one from a llama2.c checkpoint) or a run directory of a full training",
                s.model
            );
        }
    }
    Ok(())
}

/// A preference objective's rules on the other settings (its own are
/// [`Objective::new`]'s).
fn validate_preference(s: &TrainSettings) -> Result<()> {
    let name = s.objective.name();
    if !s.data.as_deref().is_some_and(records::is_records) {
        bail!(
            "--objective {name} trains on preference pairs: give --data a .jsonl file or a directory with train.jsonl of {{\"prompt\", \"chosen\", \"rejected\"}} records"
        );
    }
    if s.mask_prompt {
        bail!("--mask-prompt is implied by --objective {name}: a preference loss counts the answers' tokens only");
    }
    Ok(())
}

/// A setting as its flag shows it.
pub(super) type Shown = fn(&TrainSettings, &AdamWConfig) -> String;

pub(super) fn lora_shown(s: &TrainSettings, f: fn(&LoraConfig) -> String) -> String {
    s.lora.as_ref().map_or_else(|| "(none)".into(), f)
}

/// Every setting fixed for a run's life, by its flag.
pub(super) const RUN_FLAGS: &[(&str, Shown)] = &[
    ("--model", |s, _| s.model.clone()),
    ("--backend", |s, _| s.backend.name().into()),
    ("--data", |s, _| {
        s.data.as_ref().map_or_else(
            || "(the built-in corpus)".into(),
            |p| p.display().to_string(),
        )
    }),
    ("--token-dtype", |s, _| s.token_dtype.name().into()),
    ("--seq", |s, _| s.seq.to_string()),
    ("--batch", |s, _| s.batch.to_string()),
    ("--accum", |s, _| s.accum.to_string()),
    ("--lr", |s, _| s.lr.to_string()),
    ("--warmup", |s, _| {
        s.warmup
            .map_or_else(|| "(default)".into(), |w| w.to_string())
    }),
    ("--min-lr-frac", |s, _| s.min_lr_frac.to_string()),
    ("--clip", |s, _| s.clip.to_string()),
    ("--seed", |s, _| s.seed.to_string()),
    ("--sample", |s, _| s.sample.name().into()),
    ("--val-frac", |s, _| s.val_frac.to_string()),
    ("--eval-every", |s, _| s.eval_every.to_string()),
    ("--eval-windows", |s, _| s.eval_windows.to_string()),
    ("--mask-prompt", |s, _| s.mask_prompt.to_string()),
    ("--prompt-key", |s, _| s.keys.prompt.clone()),
    ("--completion-key", |s, _| s.keys.completion.clone()),
    ("--init-adapter", |s, _| {
        s.init_adapter
            .as_ref()
            .map_or_else(|| "(none)".into(), |p| p.display().to_string())
    }),
    ("--quantize-base", |s, _| {
        s.quantize_base.map_or_else(
            || "(none)".into(),
            |q| format!("{} (--q-group-size {})", q.bits, q.group_size),
        )
    }),
    ("--lora-rank", |s, _| lora_shown(s, |l| l.rank.to_string())),
    ("--lora-alpha", |s, _| {
        lora_shown(s, |l| l.alpha.to_string())
    }),
    ("--lora-dropout", |s, _| {
        lora_shown(s, |l| l.dropout.to_string())
    }),
    ("--lora-targets", |s, _| {
        lora_shown(s, |l| {
            let names: Vec<&str> = l.targets.iter().map(|t| t.name()).collect();
            names.join(",")
        })
    }),
    ("--lora-layers", |s, _| {
        lora_shown(s, |l| {
            l.layers
                .map_or_else(|| "(every layer)".into(), |n| n.to_string())
        })
    }),
    ("--objective", |s, _| s.objective.name().into()),
    ("--beta", |s, _| {
        s.objective
            .beta()
            .map_or_else(|| "(none)".into(), |b| b.to_string())
    }),
    ("--dpo-loss", |s, _| {
        s.objective
            .dpo_loss()
            .map_or_else(|| "(none)".into(), |l| l.name().into())
    }),
    ("--precompute-ref", |s, _| {
        s.objective.precompute_ref().to_string()
    }),
    ("--beta1", |_, a| a.beta1.to_string()),
    ("--beta2", |_, a| a.beta2.to_string()),
    ("--eps", |_, a| a.eps.to_string()),
    ("--wd", |_, a| a.weight_decay.to_string()),
    ("--loss-scale", |s, _| {
        s.loss_scale
            .map_or_else(|| "(default)".into(), |v| v.to_string())
    }),
];

/// How the settings given now differ from the run's, in flag terms:
/// `--lr 0.003 in the run, 0.001 now`.
pub fn settings_differences(
    run: &TrainSettings,
    now: &TrainSettings,
    run_adamw: &AdamWConfig,
    now_adamw: &AdamWConfig,
) -> Vec<String> {
    RUN_FLAGS
        .iter()
        .filter_map(|(flag, show)| {
            let (a, b) = (show(run, run_adamw), show(now, now_adamw));
            (a != b).then(|| format!("{flag} {a} in the run, {b} now"))
        })
        .collect()
}
