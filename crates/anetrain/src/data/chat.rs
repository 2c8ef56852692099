//! Chat templates: the Jinja program a model directory ships (in
//! `chat_template.jinja` or `tokenizer_config.json`) that turns a list of
//! messages into the text the model was trained on.
//!
//! Rendering follows `transformers`' `apply_chat_template` (its
//! `utils/chat_template_utils.py`): a sandboxed Jinja environment with
//! `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that is
//! Python's `json.dumps(x, ensure_ascii=False, ...)` (not Jinja's HTML-safe
//! one), `raise_exception`, `strftime_now`, and the variables `messages`,
//! `tools`, `documents`, `add_generation_prompt`, the special tokens
//! (`bos_token`, `eos_token`, ...) and any extra keyword arguments (such as
//! Qwen3's `enable_thinking`, undefined unless given). Python string methods
//! (`startswith`, `split`, `strip`, ...) come from `minijinja-contrib`'s
//! `pycompat`. The tests render the published Qwen3, Llama 3 and ChatML
//! templates and compare with `transformers` byte for byte.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

/// A model's chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    /// The environment with the template compiled in, as "chat".
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as strings, from `tokenizer_config.json`.
    special: Map<String, Json>,
    /// Where the template came from, for error messages.
    pub origin: String,
    /// The source, when it was read from a `chat_template.jinja`.
    jinja_file: Option<String>,
    /// The template's Jinja source.
    source: String,
}

/// The special-token names `transformers` passes to every template
/// (`SPECIAL_TOKENS_ATTRIBUTES` in `tokenization_utils_base.py`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl ChatTemplate {
    /// Compiles `source`; a syntax error names `origin`.
    pub fn new(source: String, special: Map<String, Json>, origin: String) -> Result<ChatTemplate> {
        let mut env = environment();
        env.add_template_owned("chat", source.clone())
            .map_err(|e| anyhow!("the chat template in '{origin}' does not parse: {e}"))?;
        Ok(ChatTemplate {
            env,
            special,
            origin,
            jinja_file: None,
            source,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The template's source if it came from a `chat_template.jinja` file
    /// (a model directory then needs that file beside its tokenizer).
    pub fn jinja_file_source(&self) -> Option<&str> {
        self.jinja_file.as_deref()
    }

    /// The template of the tokenizer directory `dir`, whose parsed
    /// `tokenizer_config.json` is `config` (empty when it has none):
    /// `chat_template.jinja` if present (the file `transformers` writes
    /// today), else the config's `chat_template` (a string, or a list of
    /// `{name, template}` of which `default` is used). `None` when there is
    /// neither.
    pub fn find(dir: &Path, config: &Map<String, Json>) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let special = special_tokens(config);
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read '{}' as UTF-8 text", jinja.display()))?;
            let mut t = ChatTemplate::new(source.clone(), special, jinja.display().to_string())?;
            t.jinja_file = Some(source);
            return Ok(Some(t));
        }
        let origin = config_path.display().to_string();
        let source = match config.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(list)) => {
                let named = |name: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name")?.as_str()? == name)
                            .then(|| t.get("template")?.as_str().map(str::to_owned))
                            .flatten()
                    })
                };
                named("default").with_context(|| {
                    format!(
                        "'{origin}': chat_template is a list without a template named 'default'"
                    )
                })?
            }
            Some(_) => {
                bail!("'{origin}': chat_template is neither a string nor a list of named templates")
            }
        };
        ChatTemplate::new(source, special, origin).map(Some)
    }

    /// Renders `messages` (a JSON array of message objects), with `tools`
    /// (a JSON array) when given, and `extra` template variables.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat")?;
        let mut ctx = self.special.clone();
        ctx.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        ctx.insert("messages".into(), alias_reasoning(messages));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| {
                let mut msg = e.to_string();
                if let Some(detail) = e.detail() {
                    msg = format!("{msg} ({detail})");
                }
                anyhow!("the chat template in '{}' failed: {msg}", self.origin)
            })
    }
}

/// The special tokens of a `tokenizer_config.json` as strings (they are
/// stored as strings or as `{"content": ...}` objects); absent and null
/// ones are left out, as `transformers` leaves them out.
pub fn special_tokens(config: &Map<String, Json>) -> Map<String, Json> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|&name| {
            let text = match config.get(name)? {
                Json::String(s) => s.clone(),
                Json::Object(o) => o.get("content")?.as_str()?.to_owned(),
                _ => return None,
            };
            Some((name.to_owned(), Json::String(text)))
        })
        .collect()
}

/// `transformers` copies a message's reasoning, given under any of
/// `reasoning_content`, `thinking` or `reasoning`, to both `thinking` and
/// `reasoning_content` (`_alias_reasoning_fields`).
fn alias_reasoning(messages: &Json) -> Json {
    let Json::Array(list) = messages else {
        return messages.clone();
    };
    let fields = ["reasoning_content", "thinking", "reasoning"];
    Json::Array(
        list.iter()
            .map(|m| {
                let Json::Object(o) = m else { return m.clone() };
                let Some(r) = fields
                    .iter()
                    .find_map(|f| o.get(*f).filter(|v| !v.is_null()))
                else {
                    return m.clone();
                };
                // {"thinking": r, **message, "reasoning_content": r}
                let mut out = Map::new();
                out.insert("thinking".into(), r.clone());
                for (k, v) in o {
                    out.insert(k.clone(), v.clone());
                }
                out.insert("reasoning_content".into(), r.clone());
                Json::Object(out)
            })
            .collect(),
    )
}

/// The Jinja environment `transformers` renders chat templates in.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |format: String| -> Result<Value, Error> {
        strftime_now(&format)
            .map(Value::from)
            .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strftime_now failed"))
    });
    env
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps` with those arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                )
            })?),
        }),
    };
    let (item, key) = match separators {
        Some(s) if !s.is_none() => {
            let a: Vec<String> = s
                .try_iter()?
                .map(|v| v.as_str().map(str::to_owned).unwrap_or_default())
                .collect();
            match a.as_slice() {
                [i, k] => (i.clone(), k.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        // json.dumps: (', ', ': ') without indent, (',', ': ') with it.
        _ => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
    };
    let style = PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from(out))
}

/// Python's `json.dumps` output format.
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&py_number(n)),
            Json::String(s) => self.string(s, out),
            Json::Array(a) if a.is_empty() => out.push_str("[]"),
            Json::Object(o) if o.is_empty() => out.push_str("{}"),
            Json::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            Json::Object(o) => {
                let mut entries: Vec<(&String, &Json)> = o.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
        }
    }

    /// Before item `i` of a container at `depth`.
    fn separator(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A JSON number as Python prints it: integers as they are, floats in
/// `repr` form (`1.0`, `1e-05`, `1e+16`).
fn py_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Shortest round-trip digits, then Python's layout: positional for
    // exponents in [-4, 16), scientific with a two-digit exponent otherwise.
    let sci = format!("{f:e}"); // e.g. "1.5e-7"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// `datetime.now().strftime(format)`, in local time.
fn strftime_now(format: &str) -> Option<String> {
    let fmt = std::ffi::CString::new(format).ok()?;
    // SAFETY: `time(NULL)` and `localtime_r` write only into `now` and `tm`,
    // which live on this stack frame; `strftime` writes at most `buf.len()`
    // bytes into `buf` and returns how many it wrote (0 when it did not fit).
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return None;
        }
        let mut buf = vec![0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), &tm);
        buf.truncate(n);
        String::from_utf8(buf).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: Json) -> String {
        ChatTemplate::new(src.into(), Map::new(), "test".into())
            .unwrap()
            .render(&messages, None, false, &Map::new())
            .unwrap()
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let msgs = serde_json::json!([{"content": {"b": 1, "a": [1.5, "é<>&\n", null, true, 1e-5, 1e16]}}]);
        assert_eq!(
            render("{{ messages[0].content | tojson }}", msgs.clone()),
            r#"{"b": 1, "a": [1.5, "é<>&\n", null, true, 1e-05, 1e+16]}"#
        );
        assert_eq!(
            render("{{ messages[0].content | tojson(indent=2, sort_keys=true) }}", msgs),
            "{\n  \"a\": [\n    1.5,\n    \"é<>&\\n\",\n    null,\n    true,\n    1e-05,\n    1e+16\n  ],\n  \"b\": 1\n}"
        );
    }

    #[test]
    fn python_string_methods_and_trimmed_blocks() {
        let src = "{% for m in messages %}\n  {{- m.content.split('</think>')[-1].lstrip('\\n') }}\n{% endfor %}";
        assert_eq!(
            render(
                src,
                serde_json::json!([{"content": "<think>x</think>\n\nyes"}])
            ),
            "yes\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error_naming_the_template() {
        let t = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}".into(),
            Map::new(),
            "dir/tokenizer_config.json".into(),
        )
        .unwrap();
        let e = t
            .render(&serde_json::json!([]), None, false, &Map::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dir/tokenizer_config.json") && e.contains("roles must alternate"),
            "{e}"
        );
    }
}
