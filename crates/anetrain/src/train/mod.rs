//! The training loop: data windows, micro-batches with gradient
//! accumulation, clipping, AdamW with warmup and cosine decay, validation,
//! metrics, and checkpoints with exact resume. Progress is reported as
//! [`Event`]s; the caller decides how to show them and when to stop.

pub mod checkpoint;
pub mod optim;
pub mod step;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::corpus;
use crate::data::records::{self, Example};
use crate::data::tokenizer::Tokenizer;
use crate::data::tokens::{self, TokenDtype};
use crate::device::backend::{self, Backend};
use crate::device::KernelRunner;
use crate::engine::{zero_grads, Engine};
use crate::model::config::ModelConfig;
use crate::model::lora::{Lora, LoraConfig};
use crate::model::Model;
use crate::plan::memory::RunPlan;
use crate::util::choice::Choice;
use crate::util::fsutil::write_atomic;
use crate::util::rng::Rng;
use checkpoint::TrainerState;
use optim::{AdamW, AdamWConfig, LossScaler};

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
    pub model: String,
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
    /// JSONL records: the loss counts only the completion.
    #[serde(default)]
    pub mask_prompt: bool,
    /// JSONL records: the prompt/completion field names.
    #[serde(default)]
    pub keys: records::Keys,
    /// The device paths' initial loss scale (dynamic; 1024 unless given).
    #[serde(default)]
    pub loss_scale: Option<f64>,
}

/// A run stopped because the user asked (a signal), its last completed
/// step saved: not a failure, so the command line reports it as a plain
/// line and exits with 130, as a shell does for an interrupted command.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Interrupted {}

/// Everything `anetrain train` was asked to do.
#[derive(Clone, Debug)]
pub struct TrainRequest {
    pub settings: TrainSettings,
    pub adamw: AdamWConfig,
    pub steps: u64,
    pub out: PathBuf,
    pub resume: bool,
    pub tokenizer: Option<PathBuf>,
    pub save_every: u64,
    /// How (and whether) memory is traded for time; none of it changes a
    /// result, so a resume may change it.
    pub memory: MemoryOptions,
}

pub use crate::plan::memory::MemoryOptions;

/// What a run reports as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Before the first step.
    Started {
        model: String,
        params: usize,
        train_tokens: usize,
        val_tokens: usize,
        out: PathBuf,
        /// `(rank, alpha, projections, trainable parameters)` with LoRA.
        lora: Option<(usize, f64, Vec<&'static str>, usize)>,
        /// The step a resumed run continues from.
        resumed_at: Option<u64>,
        steps: u64,
    },
    /// Something the user should know, in one line.
    Note(String),
    /// Something that is probably a mistake, in one line; the run goes on.
    Warning(String),
    /// Step `step` (1-based) was skipped: its loss or gradients were not
    /// finite.
    Skipped { step: u64, reason: String },
    /// Step `step` (1-based) of `steps` finished; `val` is the validation
    /// loss when this step evaluated it.
    Step {
        step: u64,
        steps: u64,
        loss: f64,
        val: Option<f64>,
        lr: f64,
        tokens_per_s: f64,
        /// Seconds left at this run's pace.
        eta_s: f64,
    },
    /// Every step ran and the last checkpoint is saved.
    Finished { steps: u64, out: PathBuf },
}

/// Stories in the built-in corpus.
const BUILTIN_STORIES: usize = 4000;

/// Where the data comes from and how it is tokenized.
struct Corpus {
    source: Source,
    tokenizer: Option<Tokenizer>,
}

/// Training data: one token stream cut into windows, or records (JSONL),
/// one example each.
enum Source {
    Stream {
        tokens: tokens::Tokens,
        /// Tokens `..train_end` train; the rest is the validation split.
        train_end: usize,
        val: Vec<u32>,
    },
    Records {
        train: Vec<Example>,
        val: Vec<Example>,
    },
}

impl Source {
    /// Tokens in the training and the validation split.
    fn sizes(&self) -> (usize, usize) {
        match self {
            Source::Stream { train_end, val, .. } => (*train_end, val.len()),
            Source::Records { train, val } => {
                let n = |v: &[Example]| v.iter().map(|e| e.tokens.len()).sum();
                (n(train), n(val))
            }
        }
    }
}

/// Reads JSONL records for training: `train.jsonl` (and `valid.jsonl`) of
/// a directory, or one file whose last `--val-frac` of records validate.
fn load_records(
    s: &TrainSettings,
    path: &Path,
    tok: &Tokenizer,
    vocab: usize,
    note: &mut dyn FnMut(Event),
) -> Result<Source> {
    let splits = records::splits(path)?;
    let mut templated = false;
    let mut read = |file: &Path| -> Result<Vec<Example>> {
        let f = records::read_file(file, tok, &s.keys, s.mask_prompt)?;
        templated |= f.format != records::Format::Text && tok.chat.is_some();
        for e in &f.examples {
            tokens::check_ids(&e.tokens, vocab, &format!("'{}'", file.display()))?;
        }
        let fitted = records::fit(f.examples, s.seq);
        if let Some(w) = fitted.warning(file, s.seq) {
            note(Event::Note(w));
        }
        Ok(fitted.examples)
    };
    let mut train = read(&splits.train)?;
    let val = match &splits.valid {
        Some(v) => read(v)?,
        None if s.val_frac > 0.0 && train.len() > 1 => {
            let n_val = ((train.len() as f64 * s.val_frac).ceil() as usize).min(train.len() - 1);
            train.split_off(train.len() - n_val)
        }
        None => vec![],
    };
    if templated {
        if let Some(w) = end_of_turn_warning(tok, Path::new(&s.model))? {
            note(Event::Warning(w));
        }
    }
    if train.is_empty() {
        bail!(
            "'{}' leaves no training record with a target token within --seq {}",
            splits.train.display(),
            s.seq
        );
    }
    Ok(Source::Records { train, val })
}

/// A warning when the chat template ends a turn with a token that is not
/// one of the model's declared end tokens (`generation_config.json`'s and
/// `config.json`'s `eos_token_id`, the tokenizer's `eos_token`): the model
/// learns to close its replies with it, but transformers, llama.cpp and
/// Ollama, which stop on the declared ones only, would run past it.
fn end_of_turn_warning(tok: &Tokenizer, model_dir: &Path) -> Result<Option<String>> {
    let Some((token, id)) = tok.end_of_turn()? else {
        return Ok(None);
    };
    let mut ends: Vec<u32> = vec![];
    let gen = match model_dir.is_dir() {
        true => crate::model::generation::GenerationConfig::load(model_dir)?,
        false => None,
    };
    ends.extend(gen.iter().flat_map(|g| g.eos_token_ids.iter().copied()));
    if let Ok(cfg) = ModelConfig::from_file(&model_dir.join("config.json")) {
        let ids = match cfg.eos_token_id {
            Some(serde_json::Value::Array(a)) => a,
            Some(v) => vec![v],
            None => vec![],
        };
        ends.extend(ids.iter().filter_map(|v| v.as_u64()).map(|v| v as u32));
    }
    ends.extend(tok.declared_eos().map(|e| e.1));
    if ends.contains(&id) {
        return Ok(None);
    }
    ends.sort_unstable();
    ends.dedup();
    Ok(Some(format!(
        "the chat template ends each turn with '{token}' (id {id}), which is not one of the model's end tokens ({ends:?}): `anetrain generate` stops on it, but transformers, llama.cpp and Ollama would not; add {id} to eos_token_id in {}",
        model_dir.join("generation_config.json").display()
    )))
}

fn load_corpus(
    s: &TrainSettings,
    cfg: &mut ModelConfig,
    fresh: bool,
    tokenizer: Option<Tokenizer>,
    note: &mut dyn FnMut(Event),
) -> Result<Corpus> {
    let (tokens, tokenizer) = match &s.data {
        None => {
            let texts = corpus::stories(BUILTIN_STORIES, 0);
            let tok = match tokenizer {
                Some(t) => t,
                None => corpus::train_tokenizer(&texts, cfg.vocab_size)?,
            };
            let ids = corpus::encode_all(&tok, &texts)?;
            (tokens::Tokens::Owned(ids), Some(tok))
        }
        Some(path) if records::is_records(path) => {
            let tok = tokenizer.with_context(|| {
                format!(
                    "'{}' holds JSONL records, which need a tokenizer: train from a model directory with tokenizer.json, or pass --tokenizer",
                    path.display()
                )
            })?;
            if fresh && ModelConfig::preset(&s.model).is_some() {
                cfg.vocab_size = tok.vocab_size();
            }
            let source = load_records(s, path, &tok, cfg.vocab_size, note)?;
            return Ok(Corpus {
                source,
                tokenizer: Some(tok),
            });
        }
        Some(path) => {
            let preset = ModelConfig::preset(&s.model).is_some();
            let mut tokenizer = tokenizer;
            if fresh && preset && tokenizer.is_none() && tokens::is_text(path) {
                // Text for a preset trained from scratch, and no tokenizer:
                // train one on the text (saved in the run directory).
                let tok = corpus::train_tokenizer_on_files(&[path.as_path()], cfg.vocab_size)?;
                note(Event::Note(format!(
                    "trained a byte-level BPE tokenizer of {} tokens on '{}' (saved as tokenizer.json in the run)",
                    tok.vocab_size(),
                    path.display()
                )));
                tokenizer = Some(tok);
            }
            if fresh && preset {
                if let Some(t) = &tokenizer {
                    // Training from scratch: the vocabulary follows the tokenizer.
                    cfg.vocab_size = t.vocab_size();
                }
            }
            let ids = tokens::open_tokens(path, s.token_dtype, tokenizer.as_ref(), cfg.vocab_size)?;
            (ids, tokenizer)
        }
    };
    if let tokens::Tokens::Owned(ids) = &tokens {
        tokens::check_ids(ids, cfg.vocab_size, "training data")?;
    }
    let n = tokens.len();
    let n_val = if s.val_frac > 0.0 {
        ((n as f64 * s.val_frac) as usize).max(s.seq + 1)
    } else {
        0
    };
    if n < n_val + s.seq + 1 {
        bail!(
            "the data holds {n} tokens: too few for one training window of --seq {} + 1{}",
            s.seq,
            if n_val > 0 {
                format!(" plus a validation split of {n_val}")
            } else {
                String::new()
            }
        );
    }
    Ok(Corpus {
        source: Source::Stream {
            val: tokens.range(n - n_val, n),
            train_end: n - n_val,
            tokens,
        },
        tokenizer,
    })
}

/// Draws the next `count` examples: windows of `seq + 1` tokens from a
/// stream (every target counted), or the next records of the epochs' order.
fn next_examples(
    source: &Source,
    s: &TrainSettings,
    rng: &mut Rng,
    cursor: &mut u64,
    count: usize,
) -> Vec<Example> {
    match source {
        Source::Stream {
            tokens, train_end, ..
        } => (0..count)
            .map(|_| Example {
                tokens: next_window(tokens, *train_end, s.seq, s.sample, rng, cursor),
                offset: 0,
            })
            .collect(),
        Source::Records { train, .. } => {
            let picks = records::draws(train.len(), s.seed, *cursor, count);
            *cursor += count as u64;
            picks.into_iter().map(|i| train[i].clone()).collect()
        }
    }
}

/// Draws the next window of `seq + 1` tokens from the first `n_train`.
fn next_window(
    tokens: &tokens::Tokens,
    n_train: usize,
    seq: usize,
    sample: Sample,
    rng: &mut Rng,
    cursor: &mut u64,
) -> Vec<u32> {
    let start = match sample {
        Sample::Random => rng.below(n_train - seq),
        Sample::Sequential => {
            let n_windows = ((n_train - 1) / seq) as u64;
            let k = *cursor % n_windows;
            *cursor += 1;
            k as usize * seq
        }
    };
    tokens.range(start, start + seq + 1)
}

/// A default run directory: `runs/<model>-<UTC date>-<time>`.
pub fn default_out(model: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86400, secs % 86400);
    // civil-from-days (Howard Hinnant)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    let name = Path::new(model)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    PathBuf::from("runs").join(format!(
        "{name}-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

fn validate(s: &TrainSettings, r: &TrainRequest) -> Result<()> {
    if s.seq < 1 || s.batch < 1 || s.accum < 1 || r.steps < 1 {
        bail!("--seq, --batch, --accum and --steps must all be at least 1");
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

/// The model a run starts from: a model directory, or a preset initialised
/// from the seed. With LoRA it is the frozen base (always a directory),
/// loaded again on resume.
fn starting_model(s: &TrainSettings, cfg: &ModelConfig) -> Result<Model> {
    if ModelConfig::preset(&s.model).is_none() && s.lora.is_some() {
        Model::load_frozen(Path::new(&s.model))
    } else if ModelConfig::preset(&s.model).is_none() {
        Model::load(Path::new(&s.model))
    } else {
        Model::init(cfg, s.seed)
    }
}

/// Attaches fresh adapters when the run trains LoRA.
fn with_adapters(mut model: Model, s: &TrainSettings) -> Result<Model> {
    if let Some(l) = &s.lora {
        model.lora = Some(Lora::init(&model.cfg, l.clone(), s.seed)?);
    }
    Ok(model)
}

/// Mean loss over the first `n` validation windows (or records).
fn val_loss<R: KernelRunner>(
    eng: &mut Engine<R>,
    model: &Model,
    source: &Source,
    seq: usize,
    n: usize,
) -> Result<Option<f64>> {
    let examples: Vec<Example> = match source {
        Source::Stream { val, .. } => tokens::windows(val, seq)
            .into_iter()
            .take(n)
            .map(|tokens| Example { tokens, offset: 0 })
            .collect(),
        Source::Records { val, .. } => val.iter().take(n).cloned().collect(),
    };
    if examples.is_empty() {
        return Ok(None);
    }
    Ok(Some(step::eval_loss(eng, model, &examples)?.loss))
}

/// Drops metrics lines of steps after `step` (left by a run killed after
/// its last checkpoint), so a resumed run logs each step once.
fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .collect();
    let mut body = kept.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    write_atomic(path, body.as_bytes())
}

/// A run directory this invocation created: removed on drop (with any
/// parent directories created for it) unless a checkpoint was written into
/// it, so a run that fails before its first checkpoint — bad data, model,
/// device — leaves nothing behind.
struct NewRunDir {
    dir: PathBuf,
    /// The outermost directory that did not exist before.
    created: Option<PathBuf>,
}

/// The directory a fresh run created and the outermost one it made, while
/// that run lives: what [`abandon_fresh_run`] removes.
static FRESH_RUN: std::sync::Mutex<Option<(PathBuf, PathBuf)>> = std::sync::Mutex::new(None);

impl NewRunDir {
    fn create(dir: &Path) -> Result<NewRunDir> {
        let created = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .last()
            .map(Path::to_path_buf);
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        if let Some(top) = &created {
            *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((dir.to_path_buf(), top.clone()));
        }
        Ok(NewRunDir {
            dir: dir.to_path_buf(),
            created,
        })
    }
}

impl Drop for NewRunDir {
    fn drop(&mut self) {
        *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(top) = &self.created {
            if !checkpoint::state_path(&self.dir).exists() {
                let _ = std::fs::remove_dir_all(top);
            }
        }
    }
}

/// For a process about to exit at once (a second signal): removes the
/// directory a fresh run in this process created, if it holds no
/// checkpoint yet, and says whether it did. It waits for a checkpoint
/// being written and keeps any later one from starting (the lock is never
/// released): call it only right before exiting.
pub fn abandon_fresh_run() -> bool {
    std::mem::forget(checkpoint::SAVING.lock().unwrap_or_else(|e| e.into_inner()));
    remove_fresh_run()
}

/// Removes the fresh run's directories if they hold no checkpoint.
fn remove_fresh_run() -> bool {
    let fresh = FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match fresh {
        Some((dir, top)) if !checkpoint::state_path(&dir).exists() => {
            let _ = std::fs::remove_dir_all(top);
            true
        }
        _ => false,
    }
}

/// A setting as its flag shows it.
type Shown = fn(&TrainSettings, &AdamWConfig) -> String;

fn lora_shown(s: &TrainSettings, f: fn(&LoraConfig) -> String) -> String {
    s.lora.as_ref().map_or_else(|| "(none)".into(), f)
}

/// Every setting fixed for a run's life, by its flag.
const RUN_FLAGS: &[(&str, Shown)] = &[
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

/// Runs (or resumes) training; returns the final train loss. `report`
/// receives every [`Event`]; when `stop` becomes true the run abandons the
/// step in progress at the next sequence, saves the last completed step
/// and returns an error saying how to resume.
pub fn train(r: TrainRequest, report: &mut dyn FnMut(&Event), stop: &AtomicBool) -> Result<f64> {
    let s = r.settings.clone();
    validate(&s, &r)?;
    if s.backend != Backend::Cpu {
        // A model the device cannot run, even tiled, fails before any work.
        let cfg = ModelConfig::resolve(&s.model)?;
        let mut o = crate::kernels::KernelOptions::hf(&cfg);
        o.lora = s.lora.as_ref().map(crate::kernels::LoraKernel::of);
        let compiled = crate::kernels::compiled_length(s.seq);
        crate::kernels::tiling::plan(&crate::kernels::Shape::new(&cfg, compiled), &o)
            .map_err(anyhow::Error::msg)?;
    }
    // Refused before anything is created; reported once the data is read.
    let RunPlan { buffers, plan, .. } =
        RunPlan::new(&s.model, s.seq, s.lora.as_ref(), s.backend, &r.memory)?
            .refuse_over_limit()?;
    // Open the device before any work, so an unusable one fails first.
    let ane_device = match s.backend {
        Backend::Ane => Some(backend::open_ane()?),
        _ => None,
    };
    let out = r.out.clone();
    let resuming = r.resume;
    if resuming && !checkpoint::state_path(&out).is_file() {
        bail!(
            "nothing to resume in '{}': {}",
            out.display(),
            if out.exists() {
                "it holds no checkpoint (trainer/state.json)"
            } else {
                "the directory does not exist"
            }
        );
    }
    if !r.resume && checkpoint::state_path(&out).exists() {
        bail!(
            "'{}' already holds a training run; pass --resume to continue it or choose another --out",
            out.display()
        );
    }
    // Removed again if this run fails before its first checkpoint.
    let _created = NewRunDir::create(&out)?;

    let (mut model, mut opt, mut state, corpus) = if resuming {
        let committed = checkpoint::read_state(&out)?;
        let saved: TrainSettings = serde_json::from_value(committed.settings.clone())
            .context("the checkpoint's settings are unreadable")?;
        let differences = settings_differences(&saved, &s, &committed.adamw, &r.adamw);
        if !differences.is_empty() {
            bail!(
                "--resume with different settings than the run in '{}': {}; repeat the run's flags (only --steps, --save-every and --log-every may change on resume)",
                out.display(),
                differences.join(", ")
            );
        }
        let base = match s.lora {
            Some(_) => Some(with_adapters(starting_model(&s, &committed.config)?, &s)?),
            None => None,
        };
        let (model, opt, mut state) = checkpoint::load(&out, base)?;
        // A run killed after its last commit but before the top-level links
        // were updated shows older weights there until this.
        checkpoint::publish_latest(&out, &model, &state)?;
        if r.steps <= state.step {
            bail!(
                "the run in '{}' has done {} steps already; pass a larger --steps to continue it",
                out.display(),
                state.step
            );
        }
        if state.total_steps != 0 && state.total_steps != r.steps {
            report(&Event::Note(format!(
                "the run was set for {} steps and continues to {}: from step {} on, the learning-rate schedule{} spans {} steps",
                state.total_steps,
                r.steps,
                state.step + 1,
                if s.warmup.is_none() { " (and the default warmup, a tenth of it)" } else { "" },
                r.steps
            )));
        }
        state.total_steps = r.steps;
        let tok_path = out.join("tokenizer.json");
        let tok = if tok_path.is_file() {
            Some(Tokenizer::load(&tok_path)?)
        } else {
            None
        };
        let mut cfg = model.cfg.clone();
        let corpus = load_corpus(&s, &mut cfg, false, tok, &mut |e| report(&e))?;
        (model, opt, state, corpus)
    } else {
        let dir = Path::new(&s.model);
        let from_dir = ModelConfig::preset(&s.model).is_none();
        let tok = match (&r.tokenizer, from_dir) {
            (Some(t), _) => Some(Tokenizer::load(t)?),
            (None, true) if dir.join("tokenizer.json").is_file() => {
                Some(Tokenizer::load(&dir.join("tokenizer.json"))?)
            }
            _ => None,
        };
        let mut cfg = ModelConfig::resolve(&s.model)?;
        let corpus = load_corpus(&s, &mut cfg, true, tok, &mut |e| report(&e))?;
        if let (false, Some(t)) = (from_dir, &corpus.tokenizer) {
            // A preset from scratch: its special tokens are the tokenizer's.
            cfg.bos_token_id = t.begin_token().map(|b| b.1.into());
            cfg.eos_token_id = t.end_tokens().first().map(|e| e.1.into());
        }
        let model = with_adapters(starting_model(&s, &cfg)?, &s)?;
        if s.seq > model.cfg.max_position_embeddings {
            bail!(
                "--seq {} exceeds the model's max_position_embeddings ({})",
                s.seq,
                model.cfg.max_position_embeddings
            );
        }
        let opt = AdamW::new(&model, r.adamw);
        let state = TrainerState {
            format: checkpoint::FORMAT,
            step: 0,
            rng: Rng::new(s.seed.wrapping_add(1)).state(),
            cursor: 0,
            skipped: 0,
            total_steps: r.steps,
            config: model.cfg.clone(),
            scaler: if s.backend.uses_fp16() {
                LossScaler::dynamic(s.loss_scale)
            } else {
                LossScaler::fixed()
            },
            adamw: r.adamw,
            settings: serde_json::to_value(&s)?,
            model_file: String::new(),
            model_hash: String::new(),
            optim_file: String::new(),
            optim_hash: String::new(),
        };
        if let Some(t) = &corpus.tokenizer {
            // The run is a complete Hugging Face model directory: the
            // tokenizer with its tokenizer_config.json (the base model's
            // when it has one).
            t.save_to_dir(&out, model.cfg.max_position_embeddings)?;
        }
        // And the base's generation config: where its generation ends.
        crate::model::generation::copy_generation_config(Path::new(&s.model), &out)?;
        (model, opt, state, corpus)
    };

    report(&Event::Note(plan.line()));
    let mut run = Run {
        r: &r,
        s: &s,
        out: &out,
        resuming,
        corpus: &corpus,
        report,
        stop,
    };
    let ckpt = r.memory.grad_checkpoint;
    match (s.backend, ane_device) {
        (Backend::Ane, Some(d)) => {
            let e = Engine::neural(&model, d)
                .buffers(buffers)
                .checkpointing(ckpt);
            run.go(e, &mut model, &mut opt, &mut state)
        }
        (Backend::AneSim, _) => {
            let e = Engine::neural(&model, crate::device::backend::open_sim()?)
                .buffers(buffers)
                .checkpointing(ckpt);
            run.go(e, &mut model, &mut opt, &mut state)
        }
        _ => {
            let e = Engine::cpu(&model).checkpointing(ckpt);
            run.go(e, &mut model, &mut opt, &mut state)
        }
    }
}

/// The parts of a run the step loop reads.
struct Run<'a> {
    r: &'a TrainRequest,
    s: &'a TrainSettings,
    out: &'a Path,
    resuming: bool,
    corpus: &'a Corpus,
    report: &'a mut dyn FnMut(&Event),
    stop: &'a AtomicBool,
}

/// What one optimizer step did.
struct StepStats {
    /// Mean loss over the step's targets.
    loss: f64,
    /// Tokens the step read.
    tokens: usize,
    lr: f64,
    grad_norm: f64,
    /// Whether the update was applied (loss and gradients finite).
    finite: bool,
    loss_scale: f64,
    /// Seconds in forward, loss, backward and the optimizer.
    times: [f64; 4],
}

/// `metrics.jsonl`: one line per step, plus validation lines.
struct Metrics {
    file: std::fs::File,
}

impl Metrics {
    /// Opens the run's metrics file: a fresh one, or on resume the existing
    /// one with lines after the checkpoint's `step` dropped.
    fn open(out: &Path, resume_step: Option<u64>) -> Result<Metrics> {
        let path = out.join("metrics.jsonl");
        match resume_step {
            Some(step) => truncate_metrics(&path, step)?,
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open '{}'", path.display()))?;
        Ok(Metrics { file })
    }

    fn step(&mut self, step: u64, st: &StepStats, tokens_per_s: f64, total: f64) -> Result<()> {
        let [fwd, loss, bwd, opt] = st.times;
        let rec = serde_json::json!({
            "step": step, "split": "train", "loss": st.loss, "lr": st.lr, "grad_norm": st.grad_norm,
            "tokens_per_s": tokens_per_s, "skipped": !st.finite, "loss_scale": st.loss_scale,
            "time": {"forward": fwd, "loss": loss, "backward": bwd, "optimizer": opt, "total": total},
        });
        writeln!(self.file, "{rec}")?;
        Ok(())
    }

    fn val(&mut self, step: u64, loss: f64) -> Result<()> {
        let rec = serde_json::json!({"step": step, "split": "val", "loss": loss});
        writeln!(self.file, "{rec}")?;
        Ok(())
    }

    /// On disk before a checkpoint that covers these lines.
    fn sync(&self) -> Result<()> {
        Ok(self.file.sync_all()?)
    }
}

impl Run<'_> {
    fn go<R: KernelRunner>(
        &mut self,
        mut eng: Engine<R>,
        model: &mut Model,
        opt: &mut AdamW,
        state: &mut TrainerState,
    ) -> Result<f64> {
        let (r, s, out) = (self.r, self.s, self.out);
        let mut metrics = Metrics::open(out, self.resuming.then_some(state.step))?;
        let mut rng = Rng::from_state(state.rng);
        let (train_tokens, val_tokens) = self.corpus.source.sizes();
        if let Some(line) = crate::device::backend::chip_family_line(s.backend)? {
            (self.report)(&Event::Note(line));
        }
        (self.report)(&Event::Started {
            model: s.model.clone(),
            params: model.num_params(),
            train_tokens,
            val_tokens,
            out: out.to_path_buf(),
            lora: model.lora.as_ref().map(|l| {
                let names = l.cfg.targets.iter().map(|t| t.module()).collect();
                (l.cfg.rank, l.cfg.alpha, names, l.num_params())
            }),
            resumed_at: self.resuming.then_some(state.step),
            steps: r.steps,
        });
        let run_start = Instant::now();
        let start_step = state.step;
        let mut last_loss = f64::NAN;
        let mut consecutive_skips = 0;
        // One gradient buffer for the whole run, overwritten each step.
        let mut grads = zero_grads(model);
        while state.step < r.steps {
            let t0 = Instant::now();
            let Some(st) = self.step(&mut eng, model, opt, state, &mut rng, &mut grads)? else {
                // Stopped mid-step: nothing of the step was kept, so the
                // state is the last completed step's; save it.
                metrics.sync()?;
                state.rng = rng.state();
                checkpoint::save(out, model, opt, state.clone())?;
                return Err(Interrupted(format!(
                    "interrupted during step {}; step {} is saved in '{}' — continue with the same flags plus --resume",
                    state.step + 1,
                    state.step,
                    out.display()
                ))
                .into());
            };
            if st.finite {
                consecutive_skips = 0;
                last_loss = st.loss;
            } else {
                // An fp16 overflow with a finite loss is the loss scaler's
                // business; only other failures count towards divergence.
                let overflow =
                    state.scaler.dynamic && st.loss.is_finite() && state.scaler.scale >= 1.0;
                if !overflow {
                    consecutive_skips += 1;
                }
                self.report_skip(state, &st);
                if consecutive_skips >= 3 {
                    bail!(
                        "training diverged: {consecutive_skips} consecutive steps with non-finite loss or gradients at step {}; \
                         the last checkpoint is intact — resume with a lower --lr or stronger --clip",
                        state.step + 1
                    );
                }
            }
            state.step += 1;
            let dt = t0.elapsed().as_secs_f64();
            let tps = st.tokens as f64 / dt;
            metrics.step(state.step, &st, tps, dt)?;
            let mut val = None;
            if s.eval_every > 0
                && (state.step.is_multiple_of(s.eval_every) || state.step == r.steps)
            {
                val = val_loss(&mut eng, model, &self.corpus.source, s.seq, s.eval_windows)?;
                if let Some(v) = val {
                    metrics.val(state.step, v)?;
                }
            }
            let done = (state.step - start_step) as f64;
            (self.report)(&Event::Step {
                step: state.step,
                steps: r.steps,
                loss: st.loss,
                val,
                lr: st.lr,
                tokens_per_s: tps,
                eta_s: run_start.elapsed().as_secs_f64() / done * (r.steps - state.step) as f64,
            });
            let stop = self.stop.load(Ordering::SeqCst);
            if stop || state.step.is_multiple_of(r.save_every.max(1)) || state.step == r.steps {
                metrics.sync()?;
                state.rng = rng.state();
                checkpoint::save(out, model, opt, state.clone())?;
            }
            if stop && state.step < r.steps {
                return Err(Interrupted(format!(
                    "interrupted after step {}; the checkpoint in '{}' is saved — continue with the same flags plus --resume",
                    state.step,
                    out.display()
                ))
                .into());
            }
        }
        (self.report)(&Event::Finished {
            steps: state.step,
            out: out.to_path_buf(),
        });
        Ok(last_loss)
    }

    /// One optimizer step over the next `accum · batch` examples (see
    /// [`step::step`]), the loss scaler told whether it was finite. `None`
    /// when a stop was requested before the step's last example: the data
    /// position is put back and nothing else was changed, so the state is
    /// exactly the previous step's.
    fn step<R: KernelRunner>(
        &self,
        eng: &mut Engine<R>,
        model: &mut Model,
        opt: &mut AdamW,
        state: &mut TrainerState,
        rng: &mut Rng,
        grads: &mut crate::engine::Grads,
    ) -> Result<Option<StepStats>> {
        let (r, s, corpus) = (self.r, self.s, self.corpus);
        let lr = optim::lr_at(
            state.step,
            r.steps,
            s.warmup.unwrap_or(r.steps / 10),
            s.lr,
            s.min_lr_frac,
        );
        let loss_scale = state.scaler.scale;
        let (rng_before, cursor_before) = (rng.clone(), state.cursor);
        // The step's examples first: the loss is the mean over all their
        // counted targets, however they split into micro-batches.
        let examples = next_examples(&corpus.source, s, rng, &mut state.cursor, s.accum * s.batch);
        let o = step::StepOptions {
            lr,
            clip: s.clip,
            loss_scale,
            dropout: s.lora.as_ref().is_some_and(|l| l.dropout > 0.0).then_some(
                step::DropoutKeys {
                    seed: s.seed,
                    step: state.step,
                },
            ),
        };
        let stop = || self.stop.load(Ordering::SeqCst);
        let Some(st) = step::step(eng, model, opt, grads, &examples, &o, &stop)? else {
            *rng = rng_before;
            state.cursor = cursor_before;
            return Ok(None);
        };
        state.scaler.update(st.update.finite);
        if !st.update.finite {
            state.skipped += 1;
        }
        let [t_fwd, t_loss, t_bwd] = st.batch.times;
        Ok(Some(StepStats {
            loss: st.batch.loss,
            tokens: st.batch.tokens,
            lr,
            grad_norm: st.update.grad_norm,
            finite: st.update.finite,
            loss_scale,
            times: [t_fwd, t_loss, t_bwd, st.optimizer_s],
        }))
    }

    /// Reports a skipped step: what was not finite and the loss scale now.
    fn report_skip(&mut self, state: &TrainerState, st: &StepStats) {
        let reason = format!(
            "non-finite {}; step skipped{}",
            if st.loss.is_finite() {
                format!("gradients (norm {})", st.grad_norm)
            } else {
                format!("loss ({})", st.loss)
            },
            if state.scaler.dynamic {
                format!(", loss scale now {}", state.scaler.scale)
            } else {
                String::new()
            }
        );
        (self.report)(&Event::Skipped {
            step: state.step + 1,
            reason,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a second signal's immediate exit does to a fresh run: removes
    /// the directories the run created while no checkpoint exists, keeps
    /// them once one does, and touches nothing when no run is fresh.
    #[test]
    fn abandoning_a_fresh_run_removes_only_what_holds_no_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("runs/a");
        let run = NewRunDir::create(&dir).unwrap();
        std::fs::write(dir.join("metrics.jsonl"), "").unwrap();
        assert!(remove_fresh_run());
        assert!(!root.path().join("runs").exists());
        drop(run);

        let run = NewRunDir::create(&dir).unwrap();
        std::fs::create_dir_all(checkpoint::trainer_dir(&dir)).unwrap();
        std::fs::write(checkpoint::state_path(&dir), "{}").unwrap();
        assert!(!remove_fresh_run());
        assert!(checkpoint::state_path(&dir).is_file());
        drop(run);
        assert!(!remove_fresh_run());
        assert!(dir.exists());
    }
}
