//! Token data: raw little-endian u16/u32 token files, `.npy` integer arrays,
//! and text files tokenized on the fly. Every id is checked against the
//! vocabulary with an error naming the file and the position.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::data::tokenizer::Tokenizer;

/// Width of a raw token file's entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TokenDtype {
    U16,
    U32,
}

impl crate::util::choice::Choice for TokenDtype {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (TokenDtype::U16, "u16", "2-byte little-endian token ids"),
        (TokenDtype::U32, "u32", "4-byte little-endian token ids"),
    ];
}

/// A token stream: in memory (tokenized text, the built-in corpus) or
/// memory-mapped from a raw token file, so multi-gigabyte datasets are
/// paged in on demand.
pub enum Tokens {
    Owned(Vec<u32>),
    Mapped {
        map: memmap2::Mmap,
        dtype: TokenDtype,
    },
}

impl Tokens {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Mapped { map, dtype } => map.len() / width(*dtype),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::Owned(v) => v[i],
            Tokens::Mapped {
                map,
                dtype: TokenDtype::U16,
            } => u16::from_le_bytes([map[2 * i], map[2 * i + 1]]) as u32,
            Tokens::Mapped {
                map,
                dtype: TokenDtype::U32,
            } => u32::from_le_bytes([map[4 * i], map[4 * i + 1], map[4 * i + 2], map[4 * i + 3]]),
        }
    }

    /// Tokens `start..end` as a vector.
    pub fn range(&self, start: usize, end: usize) -> Vec<u32> {
        match self {
            Tokens::Owned(v) => v[start..end].to_vec(),
            Tokens::Mapped { .. } => (start..end).map(|i| self.get(i)).collect(),
        }
    }
}

fn width(dtype: TokenDtype) -> usize {
    match dtype {
        TokenDtype::U16 => 2,
        TokenDtype::U32 => 4,
    }
}

/// Maps a raw little-endian token file.
pub fn map_token_file(path: &Path, dtype: TokenDtype) -> Result<Tokens> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot read '{}'", path.display()))?
        .len();
    let w = width(dtype) as u64;
    if len % w != 0 {
        bail!(
            "'{}' is {len} bytes, not a whole number of {w}-byte tokens (wrong --token-dtype?)",
            path.display()
        );
    }
    if len == 0 {
        return Ok(Tokens::Owned(vec![]));
    }
    // SAFETY: the map is read-only and lives as long as `Tokens`; the file
    // must not be truncated while training reads it (as for any reader of
    // a memory-mapped dataset), which the docs of `--data` state.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map '{}'", path.display()))?;
    Ok(Tokens::Mapped { map, dtype })
}

/// Reads a raw little-endian token file.
pub fn read_token_file(path: &Path, dtype: TokenDtype) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    let width = match dtype {
        TokenDtype::U16 => 2,
        TokenDtype::U32 => 4,
    };
    if bytes.len() % width != 0 {
        bail!(
            "'{}' is {} bytes, not a whole number of {}-byte tokens (wrong --token-dtype?)",
            path.display(),
            bytes.len(),
            width
        );
    }
    Ok(match dtype {
        TokenDtype::U16 => bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect(),
        TokenDtype::U32 => bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    })
}

/// Checks every id is below `vocab`.
pub fn check_ids(ids: &[u32], vocab: usize, what: &str) -> Result<()> {
    if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
        bail!(
            "{what}: token id {} at index {i} is outside the model's vocabulary ({vocab} ids)",
            ids[i]
        );
    }
    Ok(())
}

/// Token rows from an integer `.npy` (1-D: one row; 2-D: one row each).
pub fn read_npy_rows(path: &Path, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let a = npy::read(path)?;
    let npy::NpyData::Int(v) = a.data else {
        bail!(
            "'{}' holds {} values; token arrays must be integers",
            path.display(),
            a.descr
        );
    };
    let row_len = match a.shape.len() {
        1 => a.shape[0],
        2 => a.shape[1],
        n => bail!(
            "'{}' has {n} dimensions; expected [n] or [batch, n]",
            path.display()
        ),
    };
    if row_len < 2 {
        bail!("'{}': each row needs at least 2 tokens (the model reads t[0..n-1] and predicts t[1..n])", path.display());
    }
    if let Some(i) = v.iter().position(|&t| t < 0 || t as u64 >= vocab as u64) {
        bail!(
            "'{}': token id {} at index {i} is outside the model's vocabulary ({vocab} ids)",
            path.display(),
            v[i]
        );
    }
    Ok(v.chunks(row_len)
        .map(|r| r.iter().map(|&t| t as u32).collect())
        .collect())
}

/// Opens training data: a text file (`.txt`, tokenized into memory) or a
/// raw token file (memory-mapped); every id is checked against `vocab`.
pub fn open_tokens(
    path: &Path,
    dtype: TokenDtype,
    tokenizer: Option<&Tokenizer>,
    vocab: usize,
) -> Result<Tokens> {
    if is_text(path) {
        return Ok(Tokens::Owned(load_tokens(path, dtype, tokenizer, vocab)?));
    }
    refuse_non_tokens(path)?;
    let t = map_token_file(path, dtype)?;
    if let Some(i) = (0..t.len()).find(|&i| t.get(i) as usize >= vocab) {
        bail!(
            "'{}': token id {} at index {i} is outside the model's vocabulary ({vocab} ids)",
            path.display(),
            t.get(i)
        );
    }
    Ok(t)
}

/// What is not a raw token file, given where token ids are read: a `.json`
/// file (or one that starts like JSON), whose records go in JSONL, one per
/// line; and any other text (a CSV or TSV table, a text file of another
/// extension), which read as ids would be numbers out of the vocabulary.
/// Text is told by its first 4 KiB: UTF-8 without a NUL byte. A token
/// file of u16 or u32 ids has NULs (every id below 256 or 65536) or bytes
/// that are not UTF-8 long before that.
fn refuse_non_tokens(path: &Path) -> Result<()> {
    const FORMATS: &str = "--data takes JSONL records (one JSON object per line, in a .jsonl file or a directory of train.jsonl/valid.jsonl), text (.txt/.md), or a raw token file";
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let mut head = vec![0u8; 4096];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    let head = &head[..n];
    let first = head.iter().find(|b| !b.is_ascii_whitespace());
    let utf8 = match std::str::from_utf8(head) {
        Ok(_) => true,
        // A character cut by the 4 KiB boundary.
        Err(e) => e.error_len().is_none(),
    };
    let text = n > 0 && utf8 && !head.contains(&0);
    let looks_json = matches!(first, Some(b'[' | b'{'))
        && std::str::from_utf8(head).is_ok_and(|s| s.contains('"') || s.trim() == "[]");
    if ext == "json" || looks_json {
        bail!("'{}' is JSON, not token ids: {FORMATS}", path.display());
    }
    if ["csv", "tsv", "parquet", "arrow"].contains(&ext.as_str()) || text {
        let what = match ext.as_str() {
            "csv" | "tsv" | "parquet" | "arrow" => format!("a {} table", ext.to_uppercase()),
            _ => "text".to_string(),
        };
        bail!(
            "'{}' is {what}, not token ids: {FORMATS}; write each row as a JSONL record such as {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}}, or name a text file .txt",
            path.display()
        );
    }
    Ok(())
}

/// A text file's contents, past a byte-order mark if it starts with one
/// (as Python's `utf-8-sig` reads).
fn read_text(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read '{}' as UTF-8 text", path.display()))?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// Whether `path` is read as text (tokenized) rather than as token ids.
pub fn is_text(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e == "txt" || e == "text" || e == "md")
}

/// Loads training/eval tokens: a text file (`.txt`, tokenized) or a raw
/// token file.
pub fn load_tokens(
    path: &Path,
    dtype: TokenDtype,
    tokenizer: Option<&Tokenizer>,
    vocab: usize,
) -> Result<Vec<u32>> {
    let ids = if is_text(path) {
        let tok = tokenizer.with_context(|| {
            format!(
                "'{}' is text; pass --tokenizer (or use a model directory with tokenizer.json)",
                path.display()
            )
        })?;
        tok.encode(&read_text(path)?)?
    } else {
        refuse_non_tokens(path)?;
        read_token_file(path, dtype)?
    };
    check_ids(&ids, vocab, &format!("'{}'", path.display()))?;
    Ok(ids)
}

/// Non-overlapping windows of `seq + 1` tokens with stride `seq`
/// (consecutive windows share one boundary token).
pub fn windows(tokens: &[u32], seq: usize) -> Vec<Vec<u32>> {
    if tokens.len() < seq + 1 {
        return vec![];
    }
    (0..=(tokens.len() - seq - 1) / seq)
        .map(|k| tokens[k * seq..k * seq + seq + 1].to_vec())
        .collect()
}

/// Tokenizes a text file into a raw token file; returns the token count.
pub fn tokenize_file(
    tok: &Tokenizer,
    input: &Path,
    output: &Path,
    dtype: TokenDtype,
) -> Result<usize> {
    let ids = tok.encode(&read_text(input)?)?;
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for &t in &ids {
        match dtype {
            TokenDtype::U16 => {
                let v = u16::try_from(t).map_err(|_| {
                    anyhow::anyhow!("token id {t} does not fit u16; use --token-dtype u32 (and pass it to train/eval)")
                })?;
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            TokenDtype::U32 => bytes.extend_from_slice(&t.to_le_bytes()),
        }
    }
    crate::util::fsutil::write_atomic(output, &bytes)?;
    Ok(ids.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_file_roundtrips_through_the_token_reader() {
        let texts = crate::data::corpus::stories(50, 2);
        let tok = crate::data::corpus::train_tokenizer(&texts, 300).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let input = dir.join("in.txt");
        std::fs::write(&input, texts.join("\n")).unwrap();
        for dtype in [TokenDtype::U16, TokenDtype::U32] {
            let out = dir.join("out.bin");
            let n = tokenize_file(&tok, &input, &out, dtype).unwrap();
            let ids = read_token_file(&out, dtype).unwrap();
            assert_eq!(ids.len(), n);
            assert_eq!(ids, tok.encode(&texts.join("\n")).unwrap());
            assert_eq!(load_tokens(&input, dtype, Some(&tok), 300).unwrap(), ids);
            let mapped = open_tokens(&out, dtype, None, 300).unwrap();
            assert!(matches!(mapped, Tokens::Mapped { .. }));
            assert_eq!(mapped.range(0, mapped.len()), ids);
        }
        assert_eq!(
            windows(&[1, 2, 3, 4, 5], 2),
            vec![vec![1, 2, 3], vec![3, 4, 5]]
        );
    }
}
