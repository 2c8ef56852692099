//! Fine-tuning records: JSONL files, one record per line, in the layout
//! `mlx_lm.lora` made the habit — a directory with `train.jsonl`, and
//! optionally `valid.jsonl` and `test.jsonl` — or a single `.jsonl` file.
//!
//! A file's format is detected from its first record, with `mlx_lm`'s
//! meaning:
//! * `{"text": ...}`: tokenized as `transformers`' `encode` does (with the
//!   post-processor's special tokens), EOS appended when absent;
//! * `{"prompt": ..., "completion": ...}`: a user and an assistant message
//!   rendered with the chat template (or, without one, the two texts
//!   concatenated and EOS appended);
//! * `{"messages": [{"role", "content"}, ...], "tools"?: [...]}`: rendered
//!   with the chat template.
//!
//! With prompt masking the loss counts only the completion: for chat
//! records the tokens from `offset = len(tokens(render(messages[:-1],
//! add_generation_prompt=True)))` on; for prompt/completion records the
//! same with the user message alone (without a template, the prompt's
//! tokens); text records have no prompt.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::data::tokenizer::Tokenizer;

/// The field names of prompt/completion records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Keys {
    pub prompt: String,
    pub completion: String,
}

impl Default for Keys {
    fn default() -> Keys {
        Keys {
            prompt: "prompt".into(),
            completion: "completion".into(),
        }
    }
}

/// What a file's records hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Completion,
    Chat,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Completion => "prompt/completion",
            Format::Chat => "chat",
        }
    }
}

/// One tokenized record; the loss counts `tokens[offset.max(1)..]`, each
/// token predicted from the positions before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub offset: usize,
}

impl Example {
    /// The first counted target among `tokens[1..]`.
    pub fn first_target(&self) -> usize {
        self.offset.max(1) - 1
    }

    /// How many targets the loss counts.
    pub fn n_targets(&self) -> usize {
        self.tokens.len().saturating_sub(self.offset.max(1))
    }

    /// Cuts the example to `seq + 1` tokens, keeping the start; whether
    /// it was longer.
    pub fn cut_to(&mut self, seq: usize) -> bool {
        let longer = self.tokens.len() > seq + 1;
        self.tokens.truncate(seq + 1);
        longer
    }
}

/// A JSONL file's records, tokenized.
pub struct RecordFile {
    pub path: PathBuf,
    pub format: Format,
    pub examples: Vec<Example>,
}

impl RecordFile {
    /// A line saying `--mask-prompt` changes nothing here: text records
    /// have no prompt, so every token of them counts.
    pub fn unmasked_warning(&self, mask_prompt: bool) -> Option<String> {
        (mask_prompt && self.format == Format::Text).then(|| {
            format!(
                "'{}' holds text records, which have no prompt: --mask-prompt changes nothing for them (it masks the prompt of prompt/completion and chat records)",
                self.path.display()
            )
        })
    }
}

/// The files of a dataset: a directory with `train.jsonl` (and optional
/// `valid.jsonl`, `test.jsonl`) or one `.jsonl` file (training only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Splits {
    pub train: PathBuf,
    pub valid: Option<PathBuf>,
    pub test: Option<PathBuf>,
}

/// Whether `--data PATH` names JSONL records (a directory or a `.jsonl`).
pub fn is_records(path: &Path) -> bool {
    path.is_dir() || path.extension().is_some_and(|e| e == "jsonl")
}

/// The split files of `path`.
pub fn splits(path: &Path) -> Result<Splits> {
    if !path.is_dir() {
        if !path.is_file() {
            bail!("--data '{}': the file does not exist", path.display());
        }
        return Ok(Splits {
            train: path.to_path_buf(),
            valid: None,
            test: None,
        });
    }
    let file = |name: &str| {
        let p = path.join(name);
        p.is_file().then_some(p)
    };
    let train = file("train.jsonl").with_context(|| {
        format!(
            "--data '{}' has no train.jsonl; a data directory holds train.jsonl, and optionally valid.jsonl and test.jsonl",
            path.display()
        )
    })?;
    Ok(Splits {
        train,
        valid: file("valid.jsonl"),
        test: file("test.jsonl"),
    })
}

/// The JSON objects of a JSONL file with their line numbers: UTF-8 (a
/// byte-order mark, as Windows editors write one, read past as Python's
/// `utf-8-sig` does), blank lines skipped; every problem an error naming
/// the file and the line, and a file without records one too.
pub fn read_jsonl(path: &Path) -> Result<Vec<(usize, Map<String, Value>)>> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{shown}'"))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count();
        anyhow::anyhow!("'{shown}' line {line}: not UTF-8 text")
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut parsed = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .map_err(|e| anyhow!("'{shown}' line {}: not valid JSON: {e}", i + 1))?;
        let Value::Object(obj) = value else {
            bail!("'{shown}' line {}: a record must be a JSON object", i + 1);
        };
        parsed.push((i + 1, obj));
    }
    if parsed.is_empty() {
        bail!("'{shown}' holds no records");
    }
    Ok(parsed)
}

/// Whether the JSONL file `path` holds preference pairs (its first record
/// has "chosen" and "rejected" and is no other layout with `keys`).
pub fn holds_pairs(path: &Path, keys: &Keys) -> Result<bool> {
    let parsed = read_jsonl(path)?;
    let (_, first) = &parsed[0];
    Ok(is_pair(first) && detect(first, keys).is_none())
}

/// Reads and tokenizes the records of `path`. Every problem is an error
/// naming the file (and the line): malformed JSON, a record with none of
/// the known fields or another format than the first, a message without
/// `role`/`content`, chat records for a tokenizer without a template, an
/// empty file.
pub fn read_file(
    path: &Path,
    tok: &Tokenizer,
    keys: &Keys,
    mask_prompt: bool,
) -> Result<RecordFile> {
    use rayon::prelude::*;
    let shown = path.display().to_string();
    let parsed = read_jsonl(path)?;
    let (first_line, first) = &parsed[0];
    if is_pair(first) && detect(first, keys).is_none() {
        bail!(
            "'{shown}' line {first_line} holds preference pairs (\"chosen\", \"rejected\"): train on them with --objective dpo or --objective orpo"
        );
    }
    let format = detect(first, keys).ok_or_else(|| {
        anyhow!(
            "'{shown}' line {first_line}: a record needs \"text\", \"{}\" and \"{}\" (see --prompt-key/--completion-key), or \"messages\"; it has {}",
            keys.prompt,
            keys.completion,
            describe_keys(first)
        )
    })?;
    if format != Format::Completion && *keys != Keys::default() {
        // The keys name a prompt/completion record's fields; given for
        // chat or text records they would be ignored without a word.
        bail!(
            "'{shown}' holds {} records; --prompt-key/--completion-key apply to prompt/completion records only",
            if format == Format::Chat { "chat (\"messages\")" } else { "text" }
        );
    }
    if format == Format::Chat && tok.chat.is_none() {
        bail!(
            "'{shown}' holds chat records, but the tokenizer '{}' has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); use a model whose tokenizer has one, or write the records as {{\"text\": ...}} or {{\"{}\": ..., \"{}\": ...}}",
            tok.path.display(),
            keys.prompt,
            keys.completion
        );
    }
    for (line, obj) in &parsed {
        check(obj, format, keys, mask_prompt).map_err(|e| anyhow!("'{shown}' line {line}: {e}"))?;
    }
    let eos = tok.eos().map(|e| e.1);
    // Tokenized in parallel; the first bad record in the file's order is
    // the one reported, run after run.
    let tokenized: Vec<Result<Example>> = parsed
        .par_iter()
        .map(|(_, obj)| tokenize(obj, format, keys, tok, eos, mask_prompt))
        .collect();
    let examples = tokenized
        .into_iter()
        .zip(&parsed)
        .map(|(r, (line, _))| r.map_err(|e| anyhow!("'{shown}' line {line}: {e}")))
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordFile {
        path: path.to_path_buf(),
        format,
        examples,
    })
}

fn detect(obj: &Map<String, Value>, keys: &Keys) -> Option<Format> {
    if obj.contains_key("messages") {
        Some(Format::Chat)
    } else if obj.contains_key(&keys.prompt) && obj.contains_key(&keys.completion) {
        Some(Format::Completion)
    } else if obj.contains_key("text") {
        Some(Format::Text)
    } else {
        None
    }
}

fn describe_keys(obj: &Map<String, Value>) -> String {
    if obj.is_empty() {
        return "no fields".into();
    }
    let names: Vec<String> = obj.keys().map(|k| format!("\"{k}\"")).collect();
    format!("the fields {}", names.join(", "))
}

/// The roles chat templates know (transformers' chat templating guide;
/// `developer`, `function` and `ipython` are OpenAI's and Llama 3's).
const ROLES: &[&str] = &[
    "system",
    "user",
    "assistant",
    "tool",
    "developer",
    "function",
    "ipython",
];

/// Other datasets' names for them (ShareGPT's `from` values and others).
const ROLE_ALIASES: &[(&str, &str)] = &[
    ("human", "user"),
    ("gpt", "assistant"),
    ("bot", "assistant"),
    ("model", "assistant"),
    ("ai", "assistant"),
];

/// Checks a record has its format's fields, of the right types; a chat's
/// roles are ones templates know, and with `mask_prompt` (the loss on the
/// last reply) it ends with the assistant's.
fn check(obj: &Map<String, Value>, format: Format, keys: &Keys, mask_prompt: bool) -> Result<()> {
    let string = |key: &str| match obj.get(key) {
        Some(Value::String(_)) => Ok(()),
        Some(_) => bail!("\"{key}\" is not a string"),
        None => bail!(
            "the record has no \"{key}\" (the file's first record is {}); it has {}",
            format.name(),
            describe_keys(obj)
        ),
    };
    match format {
        Format::Text => string("text"),
        Format::Completion => string(&keys.prompt).and_then(|_| string(&keys.completion)),
        Format::Chat => {
            let Some(messages) = obj.get("messages") else {
                bail!(
                    "the record has no \"messages\" (the file's first record is chat); it has {}",
                    describe_keys(obj)
                );
            };
            let Value::Array(list) = messages else {
                bail!("\"messages\" is not a list");
            };
            if list.is_empty() {
                bail!("\"messages\" is empty");
            }
            for (i, m) in list.iter().enumerate() {
                let Value::Object(m) = m else {
                    bail!("message {i} is not an object");
                };
                let role = match m.get("role") {
                    Some(Value::String(r)) => r.as_str(),
                    Some(_) => bail!("message {i}: \"role\" is not a string"),
                    None => bail!("message {i} has no \"role\""),
                };
                if !ROLES.contains(&role) {
                    let hint = match ROLE_ALIASES.iter().find(|(a, _)| *a == role) {
                        Some((_, r)) => format!(" (write \"{r}\" for \"{role}\")"),
                        None => String::new(),
                    };
                    bail!(
                        "message {i} has the role \"{role}\", which chat templates do not know: use \"system\", \"user\", \"assistant\" or \"tool\"{hint}"
                    );
                }
                if !m.contains_key("content") {
                    bail!("message {i} has no \"content\"");
                }
            }
            let last = list
                .last()
                .and_then(|m| m.get("role"))
                .and_then(Value::as_str);
            if mask_prompt && last != Some("assistant") {
                bail!(
                    "the conversation ends with a \"{}\" message; with --mask-prompt the loss is on the last reply, so a conversation must end with an \"assistant\" message",
                    last.unwrap_or_default()
                );
            }
            match obj.get("tools") {
                None | Some(Value::Null) | Some(Value::Array(_)) => Ok(()),
                Some(_) => bail!("\"tools\" is not a list"),
            }
        }
    }
}

fn tokenize(
    obj: &Map<String, Value>,
    format: Format,
    keys: &Keys,
    tok: &Tokenizer,
    eos: Option<u32>,
    mask_prompt: bool,
) -> Result<Example> {
    let field = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or_default();
    let with_eos = |mut ids: Vec<u32>| {
        if let Some(e) = eos {
            if ids.last() != Some(&e) {
                ids.push(e);
            }
        }
        ids
    };
    let tools = obj.get("tools").filter(|t| !t.is_null());
    let (messages, prompt) = match format {
        Format::Text => {
            let tokens = with_eos(tok.encode_with_special_tokens(field("text"))?);
            return Ok(Example { tokens, offset: 0 });
        }
        Format::Completion if tok.chat.is_none() => {
            let (p, c) = (field(&keys.prompt), field(&keys.completion));
            let tokens = with_eos(tok.encode_with_special_tokens(&format!("{p}{c}"))?);
            let offset = match mask_prompt {
                true => tok.encode_with_special_tokens(p)?.len(),
                false => 0,
            };
            return Ok(Example { tokens, offset });
        }
        Format::Completion => {
            let user = serde_json::json!({"role": "user", "content": field(&keys.prompt)});
            let assistant =
                serde_json::json!({"role": "assistant", "content": field(&keys.completion)});
            (
                Value::Array(vec![user.clone(), assistant]),
                Value::Array(vec![user]),
            )
        }
        Format::Chat => {
            let list = obj["messages"].as_array().cloned().unwrap_or_default();
            let head = list[..list.len() - 1].to_vec();
            (Value::Array(list), Value::Array(head))
        }
    };
    let chat = tok.chat.as_ref().context("no chat template")?;
    let none = Map::new();
    let tokens = tok.encode(&chat.render(&messages, tools, false, &none)?)?;
    let offset = match mask_prompt {
        true => tok
            .encode(&chat.render(&prompt, tools, true, &none)?)?
            .len(),
        false => 0,
    };
    Ok(Example { tokens, offset })
}

/// Examples cut to at most `seq + 1` tokens, and those left without a
/// counted target dropped.
pub struct Fitted {
    pub examples: Vec<Example>,
    /// Examples longer than `seq + 1` tokens, truncated.
    pub truncated: usize,
    /// Examples skipped: nothing of their completion is left.
    pub skipped: usize,
}

pub fn fit(examples: Vec<Example>, seq: usize) -> Fitted {
    let mut out = Fitted {
        examples: Vec::with_capacity(examples.len()),
        truncated: 0,
        skipped: 0,
    };
    for mut e in examples {
        out.truncated += e.cut_to(seq) as usize;
        if e.n_targets() == 0 {
            out.skipped += 1;
        } else {
            out.examples.push(e);
        }
    }
    out
}

impl Fitted {
    /// One line about what fitting to `--seq` did to `path`, if anything.
    pub fn warning(&self, path: &Path, seq: usize) -> Option<String> {
        if self.truncated == 0 && self.skipped == 0 {
            return None;
        }
        let mut parts = Vec::new();
        if self.truncated > 0 {
            parts.push(format!(
                "{} record{} longer than --seq {seq} + 1 tokens truncated",
                self.truncated,
                if self.truncated == 1 { "" } else { "s" }
            ));
        }
        if self.skipped > 0 {
            parts.push(format!(
                "{} skipped: nothing of {} completion is left within --seq {seq}",
                self.skipped,
                if self.skipped == 1 { "its" } else { "their" }
            ));
        }
        Some(format!("'{}': {}", path.display(), parts.join("; ")))
    }
}

/// The order of `n` records in `epoch`: a Fisher–Yates shuffle seeded by
/// `seed` and the epoch, so a run's data order is a function of the data
/// position alone and resumes exactly.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng =
        crate::util::rng::Rng::new(seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed_da7a);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order
}

/// The record indices of draws `cursor..cursor + count`, each epoch's
/// order shuffled once.
pub fn draws(n: usize, seed: u64, cursor: u64, count: usize) -> Vec<usize> {
    let n64 = n as u64;
    let mut order: Option<(u64, Vec<usize>)> = None;
    (cursor..cursor + count as u64)
        .map(|c| {
            let epoch = c / n64;
            if order.as_ref().map(|o| o.0) != Some(epoch) {
                order = Some((epoch, epoch_order(n, seed, epoch)));
            }
            order.as_ref().map_or(0, |o| o.1[(c % n64) as usize])
        })
        .collect()
}

/// The record index of draw `cursor` (see [`draws`]).
pub fn shuffled_index(n: usize, seed: u64, cursor: u64) -> usize {
    draws(n, seed, cursor, 1)[0]
}

/// Whether a record looks like a preference pair (a `chosen` and a
/// `rejected` answer): what `data::preference` reads, and what SFT's
/// readers refuse with a hint.
pub fn is_pair(obj: &Map<String, Value>) -> bool {
    obj.contains_key("chosen") && obj.contains_key("rejected")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitting_truncates_and_skips_records_without_a_target() {
        let e = |n: usize, offset: usize| Example {
            tokens: (0..n as u32).collect(),
            offset,
        };
        let f = fit(vec![e(5, 0), e(12, 3), e(12, 9), e(1, 0)], 8);
        assert_eq!(f.examples.len(), 2);
        assert_eq!((f.truncated, f.skipped), (2, 2));
        assert_eq!(f.examples[1].tokens.len(), 9);
        assert_eq!(
            (f.examples[1].first_target(), f.examples[1].n_targets()),
            (2, 6)
        );
        let w = f.warning(Path::new("d/train.jsonl"), 8).unwrap();
        assert!(
            w.contains("2 records longer than --seq 8") && w.contains("2 skipped"),
            "{w}"
        );
    }

    #[test]
    fn every_epoch_visits_every_record_once() {
        for n in [1usize, 2, 7, 50] {
            for epoch in 0..3u64 {
                let mut seen: Vec<usize> = (0..n as u64)
                    .map(|k| shuffled_index(n, 11, epoch * n as u64 + k))
                    .collect();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
            }
        }
        let a: Vec<usize> = (0..20).map(|c| shuffled_index(20, 1, c)).collect();
        let b: Vec<usize> = (20..40).map(|c| shuffled_index(20, 1, c)).collect();
        assert_ne!(a, b, "epochs are shuffled differently");
    }
}
