//! The built-in corpus for `anetrain train` with no arguments: short
//! children's stories generated from a small grammar (readable, so a
//! model's generations can be judged by eye), and a byte-level BPE tokenizer
//! trained on them and saved as a Hugging Face `tokenizer.json`.

use std::collections::HashSet;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::data::tokenizer::Tokenizer;
use crate::util::rng::Rng;

/// Separates stories in the token stream.
pub const END_OF_TEXT: &str = "<|endoftext|>";

const NAMES: &[&str] = &[
    "Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Sam", "Lucy", "Tim", "Zoe", "Leo",
];
const ANIMALS: &[&str] = &[
    "cat", "dog", "bird", "rabbit", "fox", "duck", "bear", "frog", "mouse", "horse",
];
const ADJS: &[&str] = &[
    "little", "happy", "small", "brave", "kind", "silly", "sleepy", "curious",
];
const PLACES: &[&str] = &[
    "park", "garden", "forest", "beach", "farm", "river", "hill", "house",
];
const THINGS: &[&str] = &[
    "ball", "kite", "hat", "box", "cake", "book", "boat", "flower", "toy", "apple",
];
const COLORS: &[&str] = &[
    "red", "blue", "green", "yellow", "big", "shiny", "soft", "pretty",
];
const LIKES: &[&str] = &[
    "play", "run", "jump", "sing", "dance", "read", "swim", "draw",
];
const FEELINGS: &[&str] = &[
    "happy",
    "sad",
    "scared",
    "excited",
    "surprised",
    "proud",
    "tired",
];

fn pick<'a>(rng: &mut Rng, list: &[&'a str]) -> &'a str {
    list[rng.below(list.len())]
}

/// One story, a few sentences long.
pub fn story(rng: &mut Rng) -> String {
    let name = pick(rng, NAMES);
    let friend = pick(rng, NAMES);
    let animal = pick(rng, ANIMALS);
    let adj = pick(rng, ADJS);
    let place = pick(rng, PLACES);
    let thing = pick(rng, THINGS);
    let color = pick(rng, COLORS);
    let like = pick(rng, LIKES);
    let feel = pick(rng, FEELINGS);
    let mut s = String::new();
    match rng.below(3) {
        0 => s.push_str(&format!(
            "Once upon a time, there was a {adj} {animal} named {name}. "
        )),
        1 => s.push_str(&format!(
            "One day, a {adj} {animal} named {name} went to the {place}. "
        )),
        _ => s.push_str(&format!(
            "{name} was a {adj} {animal} who lived near the {place}. "
        )),
    }
    s.push_str(&format!("{name} liked to {like} every day. "));
    match rng.below(3) {
        0 => s.push_str(&format!(
            "At the {place}, {name} found a {color} {thing}. {name} was very {feel}. "
        )),
        1 => s.push_str(&format!(
            "{name} saw {friend} at the {place}. {friend} had a {color} {thing}. "
        )),
        _ => s.push_str(&format!(
            "{name} lost a {color} {thing} at the {place}. {name} felt {feel}. "
        )),
    }
    match rng.below(3) {
        0 => s.push_str(&format!(
            "\"Can we {like} together?\" asked {friend}. \"Yes!\" said {name}. They played all day. "
        )),
        1 => s.push_str(&format!(
            "{friend} helped {name} look for the {thing}. They looked under a tree and found it. "
        )),
        _ => s.push_str(&format!(
            "{name} shared the {thing} with {friend}. Sharing made them both {feel}. "
        )),
    }
    match rng.below(3) {
        0 => s.push_str(&format!(
            "In the end, {name} and {friend} became best friends."
        )),
        1 => s.push_str(&format!("{name} went home and told mom about the {thing}.")),
        _ => s.push_str(&format!(
            "From that day on, {name} always went to the {place} to {like}."
        )),
    }
    s
}

/// `n` stories from `seed`.
pub fn stories(n: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| story(&mut rng)).collect()
}

/// Trains a byte-level BPE tokenizer of `vocab` entries (including the
/// end-of-text token) on `texts`.
pub fn train_tokenizer(texts: &[String], vocab: usize) -> Result<Tokenizer> {
    let mut tok = tokenizers::Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(alphabet)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build()
        .into();
    tok.train(&mut trainer, texts.iter())
        .map_err(|e| anyhow!("training the built-in tokenizer failed: {e}"))?;
    Ok(Tokenizer::from_inner(tok))
}

/// Trains the built-in corpus's kind of tokenizer (byte-level BPE with an
/// end-of-text token) on text files, one training sequence per line.
pub fn train_tokenizer_on_files(files: &[&std::path::Path], vocab: usize) -> Result<Tokenizer> {
    if vocab <= 257 {
        bail!("--vocab-size {vocab}: a byte-level tokenizer needs more than 257 entries (256 bytes and the end-of-text token)");
    }
    let mut lines = vec![];
    for f in files {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("cannot read '{}' as UTF-8 text", f.display()))?;
        lines.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if lines.is_empty() {
        bail!(
            "no text to train a tokenizer on in {}",
            files
                .iter()
                .map(|f| format!("'{}'", f.display()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    train_tokenizer(&lines, vocab)
}

/// Token stream of `texts`, each followed by the end-of-text token.
pub fn encode_all(tok: &Tokenizer, texts: &[String]) -> Result<Vec<u32>> {
    let eot = tok
        .token_id(END_OF_TEXT)
        .ok_or_else(|| anyhow!("the tokenizer has no {END_OF_TEXT} token"))?;
    let mut ids = Vec::new();
    for t in texts {
        ids.extend(tok.encode(t)?);
        ids.push(eot);
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_and_tokenizer_are_deterministic_and_roundtrip() {
        let s = stories(200, 1);
        assert_eq!(s, stories(200, 1));
        assert!(s[0].starts_with("Once") || s[0].starts_with("One") || s[0].contains(" was a "));
        let tok = train_tokenizer(&s, 300).unwrap();
        assert_eq!(tok.vocab_size(), 300);
        let ids = tok.encode(&s[3]).unwrap();
        assert!(ids.len() < s[3].len(), "BPE should compress");
        assert_eq!(tok.decode(&ids).unwrap(), s[3]);
        let tok2 = train_tokenizer(&s, 300).unwrap();
        assert_eq!(tok2.encode(&s[5]).unwrap(), tok.encode(&s[5]).unwrap());
    }
}
