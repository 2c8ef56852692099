//! Chat templates and fine-tuning records against `transformers`
//! (fixtures from `scripts/make_chat_fixtures.py`).

use std::path::{Path, PathBuf};

use anetrain::data::chat::{self, ChatTemplate};
use anetrain::data::records::{self, Keys};
use anetrain::data::tokenizer::Tokenizer;
use serde_json::Value;

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every render of `renders.json` — the published Qwen3, Llama 3 and
/// ChatML templates over system messages, several turns, empty content,
/// non-ASCII text, reasoning, tools, tool calls and results — equals `apply_chat_template(...,
/// tokenize=False)` byte for byte.
#[test]
fn templates_render_as_transformers_does() {
    let dir = chat_dir();
    let cases = json(&dir.join("renders.json"));
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 48, "{} cases", cases.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, c) in cases.iter().enumerate() {
        let name = c["template"].as_str().unwrap();
        seen.insert(name.to_owned());
        let src =
            std::fs::read_to_string(dir.join("templates").join(format!("{name}.jinja"))).unwrap();
        let special = chat::special_tokens(c["special"].as_object().unwrap());
        let t = ChatTemplate::new(src, special, name.into()).unwrap();
        let tools = (!c["tools"].is_null()).then_some(&c["tools"]);
        let got = t
            .render(
                &c["messages"],
                tools,
                c["add_generation_prompt"].as_bool().unwrap(),
                c["extra"].as_object().unwrap(),
            )
            .unwrap();
        assert_eq!(got, c["expected"].as_str().unwrap(), "case {i} ({name})");
    }
    assert_eq!(seen.len(), 3, "templates covered: {seen:?}");
}

/// A model directory's tokenizer finds its template (`chat_template.jinja`
/// here) and its `eos_token`; the `tokenizer_config.json` forms (a string,
/// a list of named templates) are read too.
#[test]
fn tokenizers_find_their_templates() {
    let tok = Tokenizer::load(&chat_dir().join("model/tokenizer.json")).unwrap();
    assert!(tok.chat.is_some());
    assert_eq!(tok.eos().unwrap().0, "<|im_end|>");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        chat_dir().join("model/tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    for config in [
        serde_json::json!({"chat_template": "A{{ messages[0].content }}"}),
        serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "A{{ messages[0].content }}"}]}),
    ] {
        std::fs::write(tmp.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = Tokenizer::load(&tmp.path().join("tokenizer.json")).unwrap();
        let out = tok
            .chat
            .unwrap()
            .render(&msgs, None, false, &Default::default())
            .unwrap();
        assert_eq!(out, "Ahi");
    }
    std::fs::write(tmp.path().join("tokenizer_config.json"), "{}").unwrap();
    assert!(Tokenizer::load(&tmp.path().join("tokenizer.json"))
        .unwrap()
        .chat
        .is_none());
    std::fs::write(
        tmp.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% if %}"}"#,
    )
    .unwrap();
    let e = Tokenizer::load(&tmp.path().join("tokenizer.json"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("does not parse"),
        "{e}"
    );
}

/// The test splits tokenize to exactly the ids and prompt offsets
/// `transformers` produced, in all three formats.
#[test]
fn records_tokenize_as_transformers_does() {
    let dir = chat_dir();
    let tok = Tokenizer::load(&dir.join("model/tokenizer.json")).unwrap();
    let losses = json(&dir.join("losses.json"));
    for format in ["chat", "completion", "text"] {
        let file = dir.join("data").join(format).join("test.jsonl");
        let got = records::read_file(&file, &tok, &Keys::default(), true).unwrap();
        let want = losses[format]["test"]["records"].as_array().unwrap();
        assert_eq!(got.examples.len(), want.len(), "{format}");
        for (i, (g, w)) in got.examples.iter().zip(want).enumerate() {
            let ids: Vec<u32> = w["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(g.tokens, ids, "{format} record {i}");
            assert_eq!(
                g.offset,
                w["offset"].as_u64().unwrap() as usize,
                "{format} record {i}"
            );
        }
    }
}

/// Conversational preference pairs — explicit prompts (a system message,
/// several turns, non-ASCII text) and an implicit one — tokenize through
/// the Qwen3, Llama 3 and ChatML templates exactly as TRL 1.16's
/// `DPOTrainer` tokenizes them: its `prompt_ids`, `chosen_ids` and
/// `rejected_ids` (testdata/preference/renders.json, from
/// `scripts/make_preference_fixtures.py`).
#[test]
fn preference_pairs_tokenize_as_trl_does() {
    use anetrain::data::preference::{self, Tokenization};
    let cases = json(&chat_dir().join("../preference/renders.json"));
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for (i, c) in cases.iter().enumerate() {
        let name = c["template"].as_str().unwrap();
        let src =
            std::fs::read_to_string(chat_dir().join("templates").join(format!("{name}.jinja")))
                .unwrap();
        let special = chat::special_tokens(c["special"].as_object().unwrap());
        let mut tok = Tokenizer::load(&chat_dir().join("model")).unwrap();
        tok.chat = Some(ChatTemplate::new(src, special, name.into()).unwrap());
        let pair = preference::tokenize(c["record"].as_object().unwrap(), &tok, Tokenization::Dpo)
            .unwrap();
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let at = pair.chosen.offset;
        assert_eq!(pair.rejected.offset, at);
        assert_eq!(
            pair.chosen.tokens[..at],
            ids(&c["prompt_ids"]),
            "case {i} ({name}) prompt"
        );
        assert_eq!(
            pair.chosen.tokens[at..],
            ids(&c["chosen_ids"]),
            "case {i} ({name}) chosen"
        );
        assert_eq!(
            pair.rejected.tokens[at..],
            ids(&c["rejected_ids"]),
            "case {i} ({name}) rejected"
        );
    }
}
