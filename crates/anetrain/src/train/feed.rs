//! What a run feeds its steps: the built-in corpus, token and text
//! files cut into windows, or JSONL records; the examples of each step and
//! the validation loss.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::event::Event;
use super::objective::Objective;
use super::reference::Reference;
use super::settings::{Sample, TrainSettings};
use super::step::Batch;
use crate::data::corpus;
use crate::data::preference::{self, Pair, Tokenization};
use crate::data::records::{self, Example};
use crate::data::tokenizer::Tokenizer;
use crate::data::tokens::{self};
use crate::model::config::ModelConfig;
use crate::model::source::ModelSource;
use crate::util::rng::Rng;

/// Stories in the built-in corpus.
pub(super) const BUILTIN_STORIES: usize = 4000;

/// Where the data comes from and how it is tokenized.
pub(super) struct Corpus {
    pub(super) source: Source,
    pub(super) tokenizer: Option<Tokenizer>,
}

/// Training data: one token stream cut into windows, or records (JSONL),
/// one example each.
pub(super) enum Source {
    Stream {
        tokens: tokens::Tokens,
        /// Tokens `..train_end` train; the rest is the validation split.
        train_end: usize,
        val: Vec<u32>,
    },
    Records {
        train: Vec<Example>,
        val: Vec<Example>,
        /// Rendered through the tokenizer's chat template (chat records,
        /// or prompt/completion records with a template).
        chat: bool,
    },
    /// Preference pairs (`--objective dpo|orpo`).
    Pairs { train: Vec<Pair>, val: Vec<Pair> },
}

impl Source {
    /// Whether the examples were rendered with the chat template, so a
    /// model trained on them is prompted with `generate --chat`.
    pub(super) fn chat(&self) -> bool {
        matches!(self, Source::Records { chat: true, .. })
    }

    /// Pairs in the training and the validation split of a preference
    /// run.
    pub(super) fn pairs(&self) -> Option<(usize, usize)> {
        match self {
            Source::Pairs { train, val } => Some((train.len(), val.len())),
            _ => None,
        }
    }

    /// What a step's rows of `seq` positions hold from the training split.
    pub(super) fn fill(&self, seq: usize) -> DataFill {
        let mean = |lens: &mut dyn Iterator<Item = usize>| {
            let (n, sum) = lens.fold((0usize, 0usize), |(n, s), l| (n + 1, s + l));
            sum as f64 / n.max(1) as f64
        };
        match self {
            Source::Stream { train_end, .. } => DataFill {
                examples: train_end / seq,
                row_tokens: seq as f64,
            },
            // A row reads every token of its example but the last.
            Source::Records { train, .. } => DataFill {
                examples: train.len(),
                row_tokens: mean(&mut train.iter().map(|e| e.tokens.len() - 1)),
            },
            Source::Pairs { train, .. } => DataFill {
                examples: train.len(),
                row_tokens: mean(
                    &mut train
                        .iter()
                        .flat_map(|p| p.sequences())
                        .map(|e| e.tokens.len() - 1),
                ),
            },
        }
    }

    /// Tokens in the training and the validation split.
    pub(super) fn sizes(&self) -> (usize, usize) {
        match self {
            Source::Stream { train_end, val, .. } => (*train_end, val.len()),
            Source::Records { train, val, .. } => {
                let n = |v: &[Example]| v.iter().map(|e| e.tokens.len()).sum();
                (n(train), n(val))
            }
            Source::Pairs { train, val } => {
                let n = |v: &[Pair]| {
                    v.iter()
                        .map(|p| p.chosen.tokens.len() + p.rejected.tokens.len())
                        .sum()
                };
                (n(train), n(val))
            }
        }
    }
}

/// What the training split puts in a step's rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DataFill {
    /// Examples (records, pairs, or windows of a token stream) in an epoch.
    pub examples: usize,
    /// Tokens of data in a row of `--seq` positions on average (a pair's
    /// two sequences counted as two rows); the rest is padding.
    pub row_tokens: f64,
}

/// Reads `s.data` as a run of `s` would (with the model's tokenizer, or
/// `tokenizer`) and says what its training split puts in a step's rows:
/// `kernels plan --data` predicts the run from it.
pub fn data_fill(
    s: &TrainSettings,
    model: &ModelSource,
    tokenizer: Option<&Path>,
) -> Result<DataFill> {
    let tok = run_tokenizer(tokenizer, model)?;
    let mut cfg = model.config.clone();
    let corpus = load_corpus(s, model, &mut cfg, true, tok, &mut |_| {})?;
    Ok(corpus.source.fill(s.seq))
}

/// The tokenizer a fresh run reads its data with: the one given
/// (`--tokenizer`), else the model's, else none.
pub(super) fn run_tokenizer(
    given: Option<&Path>,
    model: &ModelSource,
) -> Result<Option<Tokenizer>> {
    match (given, model.tokenizer_file()) {
        (Some(t), _) => Ok(Some(Tokenizer::load(t)?)),
        (None, Some(t)) => Ok(Some(Tokenizer::load(&t)?)),
        _ => Ok(None),
    }
}

/// Reads JSONL records for training: `train.jsonl` (and `valid.jsonl`) of
/// a directory, or one file whose last `--val-frac` of records validate.
pub(super) fn load_records(
    s: &TrainSettings,
    model: &ModelSource,
    path: &Path,
    tok: &Tokenizer,
    vocab: usize,
    note: &mut dyn FnMut(Event),
) -> Result<Source> {
    let splits = records::splits(path)?;
    if s.objective.is_preference() {
        return load_pairs(s, &splits, tok, vocab, note);
    }
    let mut templated = false;
    let mut read = |file: &Path| -> Result<Vec<Example>> {
        let f = records::read_file(file, tok, &s.keys, s.mask_prompt)?;
        if let Some(w) = f.unmasked_warning(s.mask_prompt) {
            note(Event::Warning(w));
        }
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
    let valid = splits.valid.as_deref().map(&mut read).transpose()?;
    let val = validation(s, &mut train, valid);
    if templated {
        if let Some(w) = end_of_turn_warning(tok, model)? {
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
    Ok(Source::Records {
        train,
        val,
        chat: templated,
    })
}

/// The validation records: `valid.jsonl`'s, else the last `--val-frac` of
/// the training records (at least one left to train on).
fn validation<T>(s: &TrainSettings, train: &mut Vec<T>, valid: Option<Vec<T>>) -> Vec<T> {
    match valid {
        Some(v) => v,
        None if s.val_frac > 0.0 && train.len() > 1 => {
            let n_val = ((train.len() as f64 * s.val_frac).ceil() as usize).min(train.len() - 1);
            train.split_off(train.len() - n_val)
        }
        None => vec![],
    }
}

/// Reads preference pairs for `--objective dpo|orpo`: `train.jsonl` (and
/// `valid.jsonl`) of a directory, or one file whose last `--val-frac` of
/// pairs validate.
fn load_pairs(
    s: &TrainSettings,
    splits: &records::Splits,
    tok: &Tokenizer,
    vocab: usize,
    note: &mut dyn FnMut(Event),
) -> Result<Source> {
    let how = match s.objective {
        Objective::Orpo { .. } => Tokenization::Orpo,
        _ => Tokenization::Dpo,
    };
    let mut read = |file: &Path| -> Result<Vec<Pair>> {
        let pairs = preference::read_file(file, tok, how)?;
        for p in &pairs {
            for e in p.sequences() {
                tokens::check_ids(&e.tokens, vocab, &format!("'{}'", file.display()))?;
            }
        }
        let fitted = preference::fit(pairs, s.seq);
        if let Some(w) = fitted.warning(file, s.seq) {
            note(Event::Note(w));
        }
        Ok(fitted.pairs)
    };
    let mut train = read(&splits.train)?;
    let valid = splits.valid.as_deref().map(&mut read).transpose()?;
    let val = validation(s, &mut train, valid);
    if train.is_empty() {
        bail!(
            "'{}' leaves no training pair with an answer token within --seq {}",
            splits.train.display(),
            s.seq
        );
    }
    Ok(Source::Pairs { train, val })
}

/// A warning when the chat template ends a turn with a token that is not
/// one of the model's declared end tokens (`generation_config.json`'s and
/// `config.json`'s `eos_token_id`, the tokenizer's `eos_token`): the model
/// learns to close its replies with it, but transformers, llama.cpp and
/// Ollama, which stop on the declared ones only, would run past it.
pub(super) fn end_of_turn_warning(tok: &Tokenizer, model: &ModelSource) -> Result<Option<String>> {
    let Some((token, id)) = tok.end_of_turn()? else {
        return Ok(None);
    };
    let mut ends: Vec<u32> = vec![];
    let gen = match model.dir() {
        Some(dir) => crate::model::generation::GenerationConfig::load(dir)?,
        None => None,
    };
    ends.extend(gen.iter().flat_map(|g| g.eos_token_ids.iter().copied()));
    if model.dir().is_some() {
        let ids = match &model.config.eos_token_id {
            Some(serde_json::Value::Array(a)) => a.clone(),
            Some(v) => vec![v.clone()],
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
        model
            .dir()
            .unwrap_or(Path::new(&model.spec))
            .join("generation_config.json")
            .display()
    )))
}

pub(super) fn load_corpus(
    s: &TrainSettings,
    model: &ModelSource,
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
            if fresh && model.is_preset() {
                cfg.vocab_size = tok.vocab_size();
            }
            let source = load_records(s, model, path, &tok, cfg.vocab_size, note)?;
            return Ok(Corpus {
                source,
                tokenizer: Some(tok),
            });
        }
        Some(path) => {
            let preset = model.is_preset();
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

/// Draws the step's next `count` examples — windows of `seq + 1` tokens
/// from a stream (every target counted), or the next records of the
/// epochs' order — or pairs (with their precomputed reference, if any).
pub(super) fn next_batch(
    source: &Source,
    s: &TrainSettings,
    reference: &Reference,
    rng: &mut Rng,
    cursor: &mut u64,
    count: usize,
) -> Batch {
    match source {
        Source::Stream {
            tokens, train_end, ..
        } => Batch::Examples(
            (0..count)
                .map(|_| Example {
                    tokens: next_window(tokens, *train_end, s.seq, s.sample, rng, cursor),
                    offset: 0,
                })
                .collect(),
        ),
        Source::Records { train, .. } => {
            let picks = records::draws(train.len(), s.seed, *cursor, count);
            *cursor += count as u64;
            Batch::Examples(picks.into_iter().map(|i| train[i].clone()).collect())
        }
        Source::Pairs { train, .. } => {
            let picks = records::draws(train.len(), s.seed, *cursor, count);
            *cursor += count as u64;
            Batch::Pairs(
                picks
                    .into_iter()
                    .map(|i| reference.attach(&train[i], i, false))
                    .collect(),
            )
        }
    }
}

/// Draws the next window of `seq + 1` tokens from the first `n_train`.
pub(super) fn next_window(
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

/// The first `n` validation windows, records or pairs (with their
/// precomputed reference, if any); `None` without a validation split.
pub(super) fn val_batch(
    source: &Source,
    seq: usize,
    n: usize,
    reference: &Reference,
) -> Option<Batch> {
    let batch = match source {
        Source::Stream { val, .. } => Batch::Examples(
            tokens::windows(val, seq)
                .into_iter()
                .take(n)
                .map(|tokens| Example { tokens, offset: 0 })
                .collect(),
        ),
        Source::Records { val, .. } => Batch::Examples(val.iter().take(n).cloned().collect()),
        Source::Pairs { val, .. } => Batch::Pairs(
            val.iter()
                .take(n)
                .enumerate()
                .map(|(i, pair)| reference.attach(pair, i, true))
                .collect(),
        ),
    };
    (!batch.is_empty()).then_some(batch)
}
