//! Preference pairs: JSONL records of a prompt, a better answer and a
//! worse one, in the layouts TRL documents for its preference datasets
//! (TRL 1.16 `data_utils.py`, `trainer/dpo_trainer.py`), tokenized as its
//! `DPOTrainer` tokenizes them:
//! * standard: `{"prompt": str, "chosen": str, "rejected": str}` — the
//!   tokenizer's EOS text appended to an answer not ending with it, then
//!   `encode(prompt)` and `encode(prompt + answer)` with the
//!   post-processor's special tokens;
//! * conversational: `prompt` a list of messages, `chosen`/`rejected`
//!   lists holding the assistant turn — `render(prompt,
//!   add_generation_prompt)` and `render(prompt + answer)` through the
//!   chat template, with the record's `tools` and `chat_template_kwargs`;
//! * an implicit prompt (`chosen` and `rejected` only): the prompt is
//!   their longest common prefix of messages (or characters), as TRL's
//!   `extract_prompt`.
//!
//! The answer starts where the tokenized prompt stops being a prefix of
//! both tokenized sequences (TRL's `common_prefix_length`), so a prompt
//! whose last token merges with the answer's first is handled as TRL does.
//! ORPO's tokenization (`ORPOTrainer.tokenize_row`) differs in one point
//! this module follows with [`Tokenization::Orpo`]: the EOS id is appended
//! to an answer whose last token is not EOS, rendered conversations too.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

use crate::data::records::{is_pair, Example};
use crate::data::tokenizer::Tokenizer;

/// One preference pair: the same prompt with the better (`chosen`) and
/// the worse (`rejected`) answer; each [`Example`]'s `offset` is where
/// its answer starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub chosen: Example,
    pub rejected: Example,
    /// The reference model's summed log-probabilities of the two answers,
    /// when computed once before training (`--precompute-ref`).
    pub reference: Option<[f64; 2]>,
}

impl Pair {
    /// The two sequences, chosen first.
    pub fn sequences(&self) -> [&Example; 2] {
        [&self.chosen, &self.rejected]
    }
}

/// Which trainer's tokenization to follow (see the module's notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenization {
    Dpo,
    Orpo,
}

/// Whether the records are conversational (TRL's `is_conversational`: a
/// list whose first item is an object with a `role`).
fn is_conversation(v: &Value) -> bool {
    v.as_array()
        .and_then(|l| l.first())
        .and_then(Value::as_object)
        .is_some_and(|m| m.contains_key("role"))
}

/// The explicit `(prompt, chosen, rejected)` of a record: TRL's
/// `maybe_extract_prompt` — a `prompt` of the same kind as the answers is
/// taken as it is; otherwise the prompt is extracted from the answers.
fn split_prompt(obj: &Map<String, Value>) -> Result<(Value, Value, Value)> {
    let (chosen, rejected) = (&obj["chosen"], &obj["rejected"]);
    let conversational = is_conversation(chosen);
    for (key, v) in [("chosen", chosen), ("rejected", rejected)] {
        match v {
            Value::String(_) if !conversational => {}
            Value::Array(_) if conversational => check_messages(key, v)?,
            _ => bail!(
                "\"chosen\" and \"rejected\" must both be strings or both lists of messages ({{\"role\", \"content\"}}); \"{key}\" is {}",
                describe(v)
            ),
        }
    }
    if let Some(prompt) = obj.get("prompt") {
        if is_conversation(prompt) == conversational {
            match prompt {
                Value::String(_) if !conversational => {}
                Value::Array(_) if conversational => check_messages("prompt", prompt)?,
                _ => bail!(
                    "\"prompt\" is {}; a string or a list of messages",
                    describe(prompt)
                ),
            }
            return Ok((prompt.clone(), chosen.clone(), rejected.clone()));
        }
        // TRL extracts the prompt from the answers when its layout is not
        // theirs; where they share none, the layouts are what to fix.
        return extract_prompt(chosen, rejected).map_err(|_| {
            let (p, a) = match conversational {
                true => ("a string", "lists of messages"),
                false => ("a list of messages", "strings"),
            };
            anyhow!(
                "\"prompt\" is {p} but \"chosen\" and \"rejected\" are {a}: give all three as strings, or all three as lists of messages (the prompt as [{{\"role\": \"user\", \"content\": ...}}])"
            )
        });
    }
    extract_prompt(chosen, rejected)
}

/// TRL's `extract_prompt`: the longest common prefix of `chosen` and
/// `rejected` (messages, or characters less a trailing space) is the
/// prompt. As there, when one is a prefix of the other the last shared
/// item stays with the answers.
fn extract_prompt(chosen: &Value, rejected: &Value) -> Result<(Value, Value, Value)> {
    let no_prompt = || {
        anyhow!("\"chosen\" and \"rejected\" share no prompt: give it as \"prompt\", or begin both with the same messages")
    };
    match (chosen, rejected) {
        (Value::Array(c), Value::Array(r)) => {
            let n = c.len().min(r.len());
            let at = (0..n)
                .find(|&i| c[i] != r[i])
                .unwrap_or(n.saturating_sub(1));
            if at == 0 {
                return Err(no_prompt());
            }
            Ok((
                Value::Array(c[..at].to_vec()),
                Value::Array(c[at..].to_vec()),
                Value::Array(r[at..].to_vec()),
            ))
        }
        (Value::String(c), Value::String(r)) => {
            let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let n = c.len().min(r.len());
            let at = match (0..n).find(|&i| c[i] != r[i]) {
                // The space before the answers goes with them.
                Some(i) if i > 0 && c[i - 1] == ' ' => i - 1,
                Some(i) => i,
                None => n.saturating_sub(1),
            };
            if at == 0 {
                return Err(no_prompt());
            }
            let s = |v: &[char]| Value::String(v.iter().collect());
            Ok((s(&c[..at]), s(&c[at..]), s(&r[at..])))
        }
        _ => Err(no_prompt()),
    }
}

fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn check_messages(key: &str, v: &Value) -> Result<()> {
    for (i, m) in v.as_array().into_iter().flatten().enumerate() {
        let Some(m) = m.as_object() else {
            bail!("\"{key}\" message {i} is not an object");
        };
        if !m.get("role").is_some_and(Value::is_string) {
            bail!("\"{key}\" message {i} has no \"role\" string");
        }
        if !m.contains_key("content") {
            bail!("\"{key}\" message {i} has no \"content\"");
        }
    }
    Ok(())
}

/// Leading items `a` and `b` have in common (TRL's `common_prefix_length`).
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokenizes one record (see the module's notes); the errors name no
/// file ([`read_file`] adds it).
pub fn tokenize(obj: &Map<String, Value>, tok: &Tokenizer, how: Tokenization) -> Result<Pair> {
    let (prompt, chosen, rejected) = split_prompt(obj)?;
    if chosen == rejected {
        bail!("\"chosen\" and \"rejected\" are the same answer; a preference pair needs two different ones");
    }
    let eos = tok.eos();
    let (p, c, r) = if let Value::Array(prompt) = &prompt {
        let chat = tok.chat.as_ref().with_context(|| {
            format!(
                "the record is conversational, but the tokenizer '{}' has no chat template; write prompt, chosen and rejected as strings",
                tok.path.display()
            )
        })?;
        let tools = obj.get("tools").filter(|t| !t.is_null());
        let kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => bail!("\"chat_template_kwargs\" is not an object"),
        };
        let with = |answer: &Value| {
            let mut all = prompt.clone();
            all.extend(answer.as_array().cloned().unwrap_or_default());
            Value::Array(all)
        };
        let render = |m: &Value, gen: bool| -> Result<Vec<u32>> {
            tok.encode(&chat.render(m, tools, gen, &kwargs)?)
        };
        (
            render(&Value::Array(prompt.clone()), true)?,
            render(&with(&chosen), false)?,
            render(&with(&rejected), false)?,
        )
    } else {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let (prompt, mut chosen, mut rejected) = (text(&prompt), text(&chosen), text(&rejected));
        if let Some((e, _)) = &eos {
            for a in [&mut chosen, &mut rejected] {
                if !a.ends_with(e.as_str()) {
                    a.push_str(e);
                }
            }
        }
        (
            tok.encode_with_special_tokens(&prompt)?,
            tok.encode_with_special_tokens(&format!("{prompt}{chosen}"))?,
            tok.encode_with_special_tokens(&format!("{prompt}{rejected}"))?,
        )
    };
    let offset = common_prefix(&p, &c).min(common_prefix(&p, &r));
    let example = |mut tokens: Vec<u32>| {
        if let (Tokenization::Orpo, Some((_, e))) = (how, &eos) {
            if tokens.last() != Some(e) {
                tokens.push(*e);
            }
        }
        Example { tokens, offset }
    };
    Ok(Pair {
        chosen: example(c),
        rejected: example(r),
        reference: None,
    })
}

/// Reads and tokenizes the pairs of a JSONL file; every problem is an
/// error naming the file and the line.
pub fn read_file(path: &Path, tok: &Tokenizer, how: Tokenization) -> Result<Vec<Pair>> {
    use rayon::prelude::*;
    let shown = path.display().to_string();
    let records = crate::data::records::read_jsonl(path)?;
    if let Some((line, obj)) = records.iter().find(|(_, obj)| !is_pair(obj)) {
        let keys: Vec<String> = obj.keys().map(|k| format!("\"{k}\"")).collect();
        let has = match keys.is_empty() {
            true => "no fields".to_owned(),
            false => format!("the fields {}", keys.join(", ")),
        };
        bail!(
            "'{shown}' line {line}: a preference record needs \"chosen\" and \"rejected\" (and \"prompt\", unless both begin with it); it has {has}"
        );
    }
    let pairs: Vec<Result<Pair>> = records
        .par_iter()
        .map(|(_, obj)| tokenize(obj, tok, how))
        .collect();
    pairs
        .into_iter()
        .zip(&records)
        .map(|(p, (line, _))| p.map_err(|e| anyhow!("'{shown}' line {line}: {e}")))
        .collect()
}

/// Pairs cut to at most `seq + 1` tokens a sequence, keeping the start
/// (TRL's `truncation_mode="keep_start"` with `max_length = seq + 1`), and
/// those left without an answer token dropped (TRL drops a pair whose
/// prompt alone fills `max_length`).
pub struct FittedPairs {
    pub pairs: Vec<Pair>,
    pub truncated: usize,
    pub dropped: usize,
}

pub fn fit(pairs: Vec<Pair>, seq: usize) -> FittedPairs {
    let mut out = FittedPairs {
        pairs: Vec::with_capacity(pairs.len()),
        truncated: 0,
        dropped: 0,
    };
    for mut p in pairs {
        let cut = [&mut p.chosen, &mut p.rejected].map(|e| e.cut_to(seq));
        out.truncated += cut.contains(&true) as usize;
        if p.chosen.n_targets() == 0 || p.rejected.n_targets() == 0 {
            out.dropped += 1;
        } else {
            out.pairs.push(p);
        }
    }
    out
}

impl FittedPairs {
    /// One line about what fitting to `--seq` did to `path`, if anything.
    pub fn warning(&self, path: &Path, seq: usize) -> Option<String> {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let mut parts = Vec::new();
        if self.truncated > 0 {
            parts.push(format!(
                "{} pair{} longer than --seq {seq} + 1 tokens cut to that length, keeping the start (TRL's max_length {}, truncation_mode \"keep_start\")",
                self.truncated,
                plural(self.truncated),
                seq + 1
            ));
        }
        if self.dropped > 0 {
            parts.push(format!(
                "{} pair{} dropped: the prompt alone fills --seq {seq}",
                self.dropped,
                plural(self.dropped)
            ));
        }
        (!parts.is_empty()).then(|| format!("'{}': {}", path.display(), parts.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_implicit_prompt_is_the_common_start_as_trl_extracts_it() {
        let c = json!([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]);
        let r = json!([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]);
        let (p, c2, r2) = extract_prompt(&c, &r).unwrap();
        assert_eq!(p, json!([{"role": "user", "content": "Q"}]));
        assert_eq!(c2, json!([{"role": "assistant", "content": "A"}]));
        assert_eq!(r2, json!([{"role": "assistant", "content": "B"}]));
        // Strings: the space before the answers goes with them.
        let (p, c2, r2) = extract_prompt(&json!("Sky is blue"), &json!("Sky is green")).unwrap();
        assert_eq!(
            (p, c2, r2),
            (json!("Sky is"), json!(" blue"), json!(" green"))
        );
        assert!(extract_prompt(&json!("abc"), &json!("xbc")).is_err());
    }

    /// A string prompt before message-list answers (or the reverse) that
    /// share no start: the error names the layouts, not a missing prompt.
    #[test]
    fn a_prompt_of_another_layout_is_named() {
        let pair = |v: serde_json::Value| v.as_object().unwrap().clone();
        let e = split_prompt(&pair(json!({
            "prompt": "Hi",
            "chosen": [{"role": "assistant", "content": "Hello"}],
            "rejected": [{"role": "assistant", "content": "Go"}],
        })))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "\"prompt\" is a string but \"chosen\" and \"rejected\" are lists of messages"
            ),
            "{e}"
        );
        let e = split_prompt(&pair(json!({
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": "Hello",
            "rejected": "Go",
        })))
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"prompt\" is a list of messages but"), "{e}");
    }

    #[test]
    fn fitting_keeps_the_start_and_drops_pairs_without_an_answer() {
        let e = |n: u32, offset: usize| Example {
            tokens: (0..n).collect(),
            offset,
        };
        let pair = |c, r| Pair {
            chosen: c,
            rejected: r,
            reference: None,
        };
        let f = fit(
            vec![
                pair(e(6, 2), e(12, 2)),
                pair(e(12, 10), e(5, 10)),
                pair(e(4, 1), e(4, 1)),
            ],
            8,
        );
        assert_eq!((f.pairs.len(), f.truncated, f.dropped), (2, 2, 1));
        assert_eq!(f.pairs[0].rejected.tokens.len(), 9);
        let w = f.warning(Path::new("p.jsonl"), 8).unwrap();
        assert!(
            w.contains("2 pairs longer than --seq 8") && w.contains("1 pair dropped"),
            "{w}"
        );
    }
}
