//! Hugging Face `tokenizer.json` loading (through the `tokenizers` crate),
//! with errors that name the file.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

use crate::data::chat::{self, ChatTemplate};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub path: PathBuf,
    /// `bos_token`, `eos_token`, ... of the directory's
    /// `tokenizer_config.json`, as strings.
    special: serde_json::Map<String, serde_json::Value>,
    /// The directory's `tokenizer_config.json`, as read.
    config_text: Option<String>,
    /// The directory's chat template, if it has one.
    pub chat: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Loads a `tokenizer.json`, or the one in the directory `path` names
    /// (a model directory), with the chat template and config beside it.
    pub fn load(path: &Path) -> Result<Tokenizer> {
        let inside = path.join("tokenizer.json");
        let path = match path.is_dir() {
            true if inside.is_file() => inside.as_path(),
            true => bail!(
                "tokenizer '{}' is a directory without tokenizer.json; give a tokenizer.json file, a model directory holding one, or a Hub id",
                path.display()
            ),
            false => path,
        };
        if !path.is_file() {
            bail!("tokenizer '{}' does not exist", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("'{}' is not a usable tokenizer.json: {e}", path.display()))?;
        // tokenizer_config.json and the chat template live beside it.
        let dir = path.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config_text = match config_path.is_file() {
            true => Some(
                std::fs::read_to_string(&config_path)
                    .with_context(|| format!("cannot read '{}'", config_path.display()))?,
            ),
            false => None,
        };
        let config = match &config_text {
            Some(text) => serde_json::from_str(text)
                .map_err(|e| anyhow!("'{}' is not a JSON object: {e}", config_path.display()))?,
            None => serde_json::Map::new(),
        };
        let chat = ChatTemplate::find(dir, &config)?;
        let special = chat::special_tokens(&config);
        // A generation that cannot stop is a silent failure: the end token
        // must be one the tokenizer has.
        if let Some(eos) = special.get("eos_token").and_then(|v| v.as_str()) {
            if inner.token_to_id(eos).is_none() {
                bail!(
                    "'{}': eos_token '{eos}' is not in the vocabulary of '{}'",
                    config_path.display(),
                    path.display()
                );
            }
        }
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
            special,
            config_text,
            chat,
        })
    }

    /// `--tokenizer` if given, else the model directory's `tokenizer.json`.
    pub fn find(explicit: Option<&Path>, model_dir: Option<&Path>) -> Result<Tokenizer> {
        if let Some(p) = explicit {
            return Tokenizer::load(p);
        }
        if let Some(d) = model_dir {
            let p = d.join("tokenizer.json");
            if p.is_file() {
                return Tokenizer::load(&p);
            }
            bail!(
                "'{}' has no tokenizer.json; pass --tokenizer FILE",
                d.display()
            );
        }
        bail!("no tokenizer: pass --tokenizer FILE")
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Tokenizer {
        Tokenizer {
            inner,
            path: PathBuf::new(),
            special: serde_json::Map::new(),
            config_text: None,
            chat: None,
        }
    }

    /// Encodes `text` as `transformers`' `tokenizer.encode(text)` does:
    /// with the special tokens the tokenizer's post-processor adds (a
    /// Llama 3 BOS, for instance).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// A special token of `tokenizer_config.json` by its name
    /// (`bos_token`, `eos_token`, `pad_token`, ...), as a string.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).and_then(|v| v.as_str())
    }

    /// A boolean of `tokenizer_config.json` (such as `add_bos_token`).
    pub fn config_flag(&self, key: &str) -> Option<bool> {
        let v: serde_json::Value = serde_json::from_str(self.config_text.as_deref()?).ok()?;
        v.get(key)?.as_bool()
    }

    /// `tokenizer_config.json`'s `eos_token`, when it names one in the
    /// vocabulary.
    pub fn declared_eos(&self) -> Option<(String, u32)> {
        let t = self.special.get("eos_token").and_then(|v| v.as_str())?;
        Some((t.to_owned(), self.token_id(t)?))
    }

    /// The end-of-sequence token: `tokenizer_config.json`'s `eos_token`
    /// when it names one in the vocabulary, else the first of
    /// [`Tokenizer::end_tokens`].
    pub fn eos(&self) -> Option<(String, u32)> {
        if let Some(e) = self.declared_eos() {
            return Some(e);
        }
        self.end_tokens().first().map(|&(t, id)| (t.to_owned(), id))
    }

    /// The token the chat template closes an assistant turn with
    /// (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3): the first token
    /// after a reply in a rendered conversation. `None` without a template
    /// or when nothing follows the reply.
    pub fn end_of_turn(&self) -> Result<Option<(String, u32)>> {
        const REPLY: &str = "Reply-0d6c1e.";
        let Some(chat) = &self.chat else {
            return Ok(None);
        };
        let messages = serde_json::json!([
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": REPLY},
        ]);
        let text = chat.render(&messages, None, false, &serde_json::Map::new())?;
        let Some(at) = text.rfind(REPLY) else {
            return Ok(None);
        };
        let rest = text[at + REPLY.len()..].trim_start_matches([' ', '\t']);
        let Some(&id) = self.encode(rest)?.first() else {
            return Ok(None);
        };
        Ok(self.inner.id_to_token(id).map(|t| (t, id)))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?
            .get_ids()
            .to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding failed: {e}"))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token string (e.g. an end-of-text marker), if present.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The end-of-sequence tokens this vocabulary has, by their usual
    /// names (GPT-2/Qwen, ChatML, SentencePiece, Gemma, Llama 3): a model
    /// emitting one has finished its text.
    pub fn end_tokens(&self) -> Vec<(&'static str, u32)> {
        [
            "<|endoftext|>",
            "<|im_end|>",
            "</s>",
            "<eos>",
            "<|end_of_text|>",
            "<|eot_id|>",
        ]
        .into_iter()
        .filter_map(|t| Some((t, self.token_id(t)?)))
        .collect()
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn begin_token(&self) -> Option<(&'static str, u32)> {
        ["<s>", "<|begin_of_text|>", "<bos>"]
            .into_iter()
            .find_map(|t| Some((t, self.token_id(t)?)))
    }

    /// `tokenizer_config.json` for this tokenizer, so `transformers`'
    /// `AutoTokenizer` loads a directory holding it and `tokenizer.json`.
    pub fn hf_config_json(&self, model_max_length: usize) -> String {
        let v = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.begin_token().map(|t| t.0),
            "eos_token": self.end_tokens().first().map(|t| t.0),
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": false,
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Writes the tokenizer into the model directory `dir` as
    /// `transformers` reads it: `tokenizer.json`, `tokenizer_config.json`
    /// (the one it was loaded with, else [`Tokenizer::hf_config_json`]) and
    /// `chat_template.jinja` when its template came from one.
    pub fn save_to_dir(&self, dir: &Path, model_max_length: usize) -> Result<()> {
        self.save(&dir.join("tokenizer.json"))?;
        let config = match &self.config_text {
            Some(text) => text.clone(),
            None => self.hf_config_json(model_max_length),
        };
        crate::util::fsutil::write_atomic(&dir.join("tokenizer_config.json"), config.as_bytes())?;
        if let Some(source) = self.chat.as_ref().and_then(|c| c.jinja_file_source()) {
            crate::util::fsutil::write_atomic(&dir.join("chat_template.jinja"), source.as_bytes())?;
        }
        Ok(())
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let json = self
            .inner
            .to_string(true)
            .map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))?;
        crate::util::fsutil::write_atomic(path, json.as_bytes())
    }
}
