//! Every bad-input class ends in exit status 1 with one `error:` line on
//! stderr naming the problem — no panic, no backtrace, nothing half-written.

use crate::common;

use common::{bin, fails};

use std::path::{Path, PathBuf};

/// A copy of the fixture model to break, in `dir`.
fn model_copy(dir: &tempfile::TempDir) -> PathBuf {
    let d = dir.path().to_path_buf();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_model().join(f), d.join(f)).unwrap();
    }
    d
}

fn fixture_model() -> PathBuf {
    common::fixture("llama/model")
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn eval_rejects_broken_models() {
    let tokens = common::fixture("llama/tokens.npy");
    let t = s(&tokens);
    fails(
        &["eval", "--model", "/nonexistent/model", "--tokens", t],
        &["/nonexistent/model", "does not exist"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    std::fs::write(d.join("config.json"), "{\"hidden_size\": 64,").unwrap();
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["config.json", "invalid JSON"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| v["num_key_value_heads"] = 3.into());
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["config.json", "multiple of num_key_value_heads"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| {
        v["vocab_size"] = 5_000_000.into();
        v["hidden_size"] = 8192.into();
    });
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["billion parameters"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| v["head_dim"] = 11.into());
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["head_dim (11) must be even"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    let st = d.join("model.safetensors");
    let b = std::fs::read(&st).unwrap();
    std::fs::write(&st, &b[..b.len() - 100]).unwrap();
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["model.safetensors", "truncated"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| v["intermediate_size"] = 81.into());
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["gate_proj.weight", "[80, 48]", "[81, 48]"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| v["num_hidden_layers"] = 3.into());
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["model.layers.2.", "missing"],
    );

    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    edit_config(&d, |v| v["num_hidden_layers"] = 1.into());
    fails(
        &["eval", "--model", s(&d), "--tokens", t],
        &["unexpected tensor", "model.layers.1."],
    );

    // NaN in the weights.
    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    let st = d.join("model.safetensors");
    let mut b = std::fs::read(&st).unwrap();
    let n = b.len();
    b[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&st, b).unwrap();
    fails(&["eval", "--model", s(&d), "--tokens", t], &["non-finite"]);

    // f16 and unsupported dtypes: a tensor declared I64.
    let d_tmp = common::tmp();
    let d = model_copy(&d_tmp);
    let st = d.join("model.safetensors");
    let b = std::fs::read(&st).unwrap();
    let text = String::from_utf8_lossy(&b).replacen("\"F32\"", "\"I64\"", 1);
    std::fs::write(&st, text.as_bytes()).unwrap_or(());
    let o = bin()
        .args(["eval", "--model", s(&d), "--tokens", t])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn eval_rejects_bad_token_inputs() {
    let m = fixture_model();
    let d_tmp = common::tmp();
    let d = d_tmp.path().to_path_buf();
    let big = d.join("big.npy");
    std::fs::write(&big, npy::encode_i64(&[4], &[1, 2, 96, 3])).unwrap();
    fails(
        &["eval", "--model", s(&m), "--tokens", s(&big)],
        &["big.npy", "96", "vocabulary"],
    );
    let neg = d.join("neg.npy");
    std::fs::write(&neg, npy::encode_i64(&[3], &[1, -2, 3])).unwrap();
    fails(
        &["eval", "--model", s(&m), "--tokens", s(&neg)],
        &["neg.npy", "-2"],
    );
    let floats = d.join("f.npy");
    std::fs::write(&floats, npy::encode_f32(&[3], &[1.0, 2.0, 3.0])).unwrap();
    fails(
        &["eval", "--model", s(&m), "--tokens", s(&floats)],
        &["f.npy", "integers"],
    );
    let short = d.join("short.npy");
    std::fs::write(&short, npy::encode_i64(&[1], &[5])).unwrap();
    fails(
        &["eval", "--model", s(&m), "--tokens", s(&short)],
        &["short.npy", "at least 2 tokens"],
    );
    let junk = d.join("junk.npy");
    std::fs::write(&junk, b"not numpy at all").unwrap();
    fails(
        &["eval", "--model", s(&m), "--tokens", s(&junk)],
        &["junk.npy", "not a .npy"],
    );
    // --data shorter than one window; odd-sized u16 file; ids beyond the vocabulary.
    let tiny = d.join("tiny.bin");
    std::fs::write(&tiny, [1u8, 0, 2, 0, 3, 0]).unwrap();
    fails(
        &["eval", "--model", s(&m), "--data", s(&tiny), "--seq", "8"],
        &["tiny.bin", "fewer than one window"],
    );
    let odd = d.join("odd.bin");
    std::fs::write(&odd, [1u8, 0, 2]).unwrap();
    fails(
        &["eval", "--model", s(&m), "--data", s(&odd)],
        &["odd.bin", "--token-dtype"],
    );
    let oov = d.join("oov.bin");
    std::fs::write(&oov, [1u8, 0, 200, 0, 3, 0]).unwrap();
    fails(
        &["eval", "--model", s(&m), "--data", s(&oov)],
        &["oov.bin", "200"],
    );
    // Logits are not written when evaluation fails.
    let lo = d.join("logits.npy");
    fails(
        &[
            "eval",
            "--model",
            s(&m),
            "--tokens",
            s(&big),
            "--logits-out",
            s(&lo),
        ],
        &["big.npy"],
    );
    assert!(!lo.exists());
}

#[test]
fn train_rejects_bad_inputs_before_writing_a_checkpoint() {
    let d_tmp = common::tmp();
    let d = d_tmp.path().to_path_buf();
    let out = d.join("run");
    fails(
        &[
            "train",
            "--data",
            "/nonexistent/data.bin",
            "--out",
            s(&out),
            "--steps",
            "1",
        ],
        &["/nonexistent/data.bin"],
    );
    let short = d.join("short.bin");
    std::fs::write(&short, [1u8, 0, 2, 0, 3, 0, 4, 0]).unwrap();
    fails(
        &[
            "train",
            "--data",
            s(&short),
            "--out",
            s(&out),
            "--steps",
            "1",
            "--seq",
            "16",
        ],
        &["too few for one training window"],
    );
    let oov = d.join("oov.bin");
    let mut bytes = vec![];
    for i in 0..400u16 {
        bytes.extend_from_slice(&(if i == 77 { 9000u16 } else { i % 300 }).to_le_bytes());
    }
    std::fs::write(&oov, bytes).unwrap();
    fails(
        &[
            "train",
            "--data",
            s(&oov),
            "--out",
            s(&out),
            "--steps",
            "1",
            "--seq",
            "16",
        ],
        &["oov.bin", "9000", "index 77"],
    );
    fails(
        &["train", "--model", "gpt-5", "--out", s(&out)],
        &["gpt-5", "preset"],
    );
    fails(&["train", "--lr", "-1", "--out", s(&out)], &["--lr"]);
    fails(
        &["train", "--seq", "4096", "--out", s(&out), "--steps", "1"],
        &["max_position_embeddings"],
    );
    assert!(!out.join("trainer/state.json").exists());
    // A corrupt trainer state.
    std::fs::create_dir_all(out.join("trainer")).unwrap();
    std::fs::write(out.join("trainer/state.json"), "{\"format\": 1, \"step\": ").unwrap();
    fails(
        &["train", "--resume", "--out", s(&out), "--steps", "2"],
        &["state.json", "corrupt"],
    );
}

/// `anetrain info` with one environment variable set must fail with exit
/// status 1 and a single line naming it; returns that line.
fn info_fails_in_one_line(var: &str, value: &std::ffi::OsStr) -> String {
    let out = bin().args(["info"]).env(var, value).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

#[test]
fn a_bad_matmul_override_is_one_line() {
    let err = info_fails_in_one_line("ANETRAIN_MATMUL", "blas9000".as_ref());
    assert!(
        err.contains("ANETRAIN_MATMUL=blas9000")
            && err.contains("mkl, accelerate, avx512, openblas, gemm"),
        "{err}"
    );
    // The fallback always exists and is reported by `info`.
    let out = bin()
        .args(["info"])
        .env("ANETRAIN_MATMUL", "gemm")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("gemm crate (pure Rust)"));
}

#[test]
fn an_unloadable_mkl_path_is_one_line() {
    let dir_tmp = common::tmp();
    let dir = dir_tmp.path().to_path_buf();
    let fake = dir.join("libmkl_rt.so.3");
    std::fs::write(&fake, b"not a shared library").unwrap();
    for path in [fake, dir.join("missing.so")] {
        let err = info_fails_in_one_line("ANETRAIN_MKL", path.as_os_str());
        assert!(
            err.contains(&format!("ANETRAIN_MKL={}", path.display()))
                && err.contains("cannot be loaded"),
            "{err}"
        );
    }
}

/// What a first-timer gives by mistake gets a line that says what it is
/// and what to give instead, and what is harmless is accepted: a byte-order
/// mark, `config.json` for its directory.
#[test]
fn first_mistakes_are_named_for_what_they_are() {
    let t = tempfile::tempdir().unwrap();
    let chat_model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat/model");
    let m = s(&chat_model);
    let file = |name: &str, text: &[u8]| {
        let p = t.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let out = t.path().join("run");
    let train_on = |model: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--model", model, "--steps", "1", "--seq", "16"]
            .map(String::from)
            .to_vec();
        a.extend(["--out", s(&out)].map(String::from));
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let train = |extra: &[&str]| train_on(m, extra);
    let fails_with = |args: Vec<String>, needles: &[&str]| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&a, needles);
        assert!(!out.exists(), "{args:?} left {}", out.display());
    };
    // Tables and other text are not token ids.
    let csv = file("rows.csv", b"prompt,completion\nhi,there\n");
    fails_with(
        train(&["--data", &csv]),
        &["rows.csv", "CSV table", "JSONL"],
    );
    let log = file("notes.log", b"some notes\nmore notes\n");
    fails_with(train(&["--data", &log]), &["notes.log", "is text", ".txt"]);
    // Chat roles templates do not know, named with the usual ones.
    let roles = file(
        "roles.jsonl",
        br#"{"messages": [{"role": "human", "content": "hi"}, {"role": "bot", "content": "yo"}]}"#,
    );
    fails_with(
        train(&["--data", &roles]),
        &["line 1", "\"human\"", "\"user\""],
    );
    // --mask-prompt: a conversation ends with the reply.
    let ends = file(
        "ends.jsonl",
        br#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]}"#,
    );
    fails_with(
        train(&["--data", &ends, "--mask-prompt"]),
        &["line 1", "ends with a \"user\" message", "--mask-prompt"],
    );
    // The first bad record is reported, every time.
    let mut many = String::new();
    for i in 0..64 {
        let role = if i % 7 == 3 { "bot" } else { "user" };
        many.push_str(&format!(
            "{{\"messages\": [{{\"role\": \"{role}\", \"content\": \"q\"}}, {{\"role\": \"assistant\", \"content\": \"a\"}}]}}\n"
        ));
    }
    let many = file("many.jsonl", many.as_bytes());
    for _ in 0..4 {
        fails_with(train(&["--data", &many]), &["line 4:"]);
    }
    // Paths: a weights file, a directory without a tokenizer, an adapter.
    let weights = chat_model.join("model.safetensors");
    fails_with(train_on(s(&weights), &[]), &["is a file", "give", m]);
    fails_with(
        train(&["--tokenizer", s(t.path())]),
        &["is a directory without tokenizer.json"],
    );
    // Flags: the one that is wrong, the limit as given, the model's length
    // before the device's tiling.
    fails_with(train(&["--accum", "0"]), &["--accum must be at least 1"]);
    fails_with(
        train(&["--backend", "ane-sim", "--max-memory", "1K"]),
        &["the limit is 1 kB"],
    );
    let long = [
        "train",
        "--model",
        m,
        "--seq",
        "20000",
        "--backend",
        "ane-sim",
    ];
    fails_with(
        long.map(String::from).to_vec(),
        &["--seq 20000 exceeds the model's max_position_embeddings"],
    );
    // Accepted: a byte-order mark before JSONL, and config.json naming its
    // directory.
    let bom = file("bom.jsonl", b"\xef\xbb\xbf{\"text\": \"hello there\"}\n");
    let config = chat_model.join("config.json");
    for a in [train(&["--data", &bom]), train_on(s(&config), &[])] {
        let o = bin().args(&a).output().unwrap();
        assert!(
            o.status.success(),
            "{a:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
    // --mask-prompt on text records (no prompt): trains, and says so.
    let a = train(&["--data", &bom, "--mask-prompt"]);
    let o = bin().args(&a).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("text records, which have no prompt: --mask-prompt changes nothing"),
        "{err}"
    );
}
