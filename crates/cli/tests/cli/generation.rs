//! Where generation ends and how it samples, as transformers decides it:
//! the model's `generation_config.json` (`eos_token_id` as one id or a
//! list, `do_sample`, `temperature`, `top_p`, `top_k`), overridden by the
//! flags; an `eos_token` the vocabulary lacks is refused in one line.

use crate::common;

use common::{bin, fails, run, tmp};

/// A `tiny` model directory (one CPU step of training, with its tokenizer).
fn tiny_model(dir: &std::path::Path) {
    run(
        &[
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ],
        dir,
    );
}

fn generate(model: &std::path::Path, extra: &[&str]) -> String {
    let o = bin()
        .args([
            "generate",
            "--backend",
            "cpu",
            "--prompt",
            "Once",
            "--max-tokens",
            "12",
            "--model",
        ])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn generation_config_ends_generation_and_sets_the_sampling_defaults() {
    let d = tmp();
    let model = d.path().join("model");
    tiny_model(&model);
    let greedy = generate(&model, &["--temperature", "0"]);
    assert!(greedy.trim_end().len() > "Once".len(), "{greedy:?}");
    let sampled = generate(&model, &["--seed", "3"]);

    // do_sample: false makes the default greedy, whatever its temperature.
    let config = model.join("generation_config.json");
    std::fs::write(&config, r#"{"do_sample": false, "temperature": 0.9}"#).unwrap();
    assert_eq!(generate(&model, &["--seed", "3"]), greedy);
    // A flag still wins.
    assert_eq!(
        generate(&model, &["--seed", "3", "--temperature", "0.8"]),
        sampled
    );

    // Every id an end token (a list, as Qwen3's config has two): nothing
    // follows the prompt.
    let all: Vec<String> = (0..4096).map(|i| i.to_string()).collect();
    std::fs::write(
        &config,
        format!(r#"{{"eos_token_id": [{}]}}"#, all.join(",")),
    )
    .unwrap();
    assert_eq!(generate(&model, &["--temperature", "0"]).trim_end(), "Once");
    // One id: the first greedy token's id ends it as well.
    let first = {
        let tok =
            anetrain::data::tokenizer::Tokenizer::load(&model.join("tokenizer.json")).unwrap();
        let full = tok.encode(greedy.trim_end()).unwrap();
        let prompt = tok.encode("Once").unwrap();
        full[prompt.len()]
    };
    std::fs::write(&config, format!(r#"{{"eos_token_id": {first}}}"#)).unwrap();
    assert_eq!(generate(&model, &["--temperature", "0"]).trim_end(), "Once");

    // A run trained from this model carries its generation config.
    let tuned = d.path().join("tuned");
    run(
        &[
            "train",
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ],
        &tuned,
    );
    assert_eq!(
        std::fs::read_to_string(tuned.join("generation_config.json")).unwrap(),
        std::fs::read_to_string(&config).unwrap()
    );

    // A config that does not parse is named.
    std::fs::write(&config, "{").unwrap();
    fails(
        &[
            "generate",
            "--backend",
            "cpu",
            "--prompt",
            "Once",
            "--model",
            model.to_str().unwrap(),
        ],
        &["generation_config.json", "not a generation config"],
    );
}

#[test]
fn an_eos_token_outside_the_vocabulary_is_refused() {
    let d = tmp();
    let model = d.path().join("model");
    tiny_model(&model);
    let path = model.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["eos_token"] = "<|no-such-token|>".into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    fails(
        &[
            "generate",
            "--backend",
            "cpu",
            "--prompt",
            "Once",
            "--model",
            model.to_str().unwrap(),
        ],
        &[
            "tokenizer_config.json",
            "<|no-such-token|>",
            "not in the vocabulary",
        ],
    );
}

/// A LoRA run directory is an adapter, not a model: the run's last line
/// and `generate --model RUN` both say so and show the command to use.
#[test]
fn a_lora_run_is_named_an_adapter_with_the_command_to_use_it() {
    let d = tmp();
    let base = d.path().join("base");
    tiny_model(&base);
    let adapter = d.path().join("adapter");
    let o = run(
        &[
            "train",
            "--model",
            base.to_str().unwrap(),
            "--lora-rank",
            "4",
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ],
        &adapter,
    );
    let e = String::from_utf8_lossy(&o.stderr);
    let done = e.lines().last().unwrap();
    assert!(
        done.contains("LoRA adapter in")
            && done.contains(&format!("--adapter {}", adapter.display())),
        "{e}"
    );
    fails(
        &[
            "generate",
            "--backend",
            "cpu",
            "--prompt",
            "Once",
            "--model",
            adapter.to_str().unwrap(),
        ],
        &["is a LoRA adapter, not a model", "--adapter"],
    );
    // The command it shows works.
    let o = bin()
        .args([
            "generate",
            "--backend",
            "cpu",
            "--prompt",
            "Once",
            "--max-tokens",
            "4",
            "--model",
        ])
        .arg(&base)
        .arg("--adapter")
        .arg(&adapter)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Data a new user gives: a JSON array where JSONL is meant is named JSON
/// (not read as token ids); a JSONL line of invalid UTF-8 is named by its
/// line; a Markdown file is text for `eval` as it is for `train`.
#[test]
fn json_arrays_bad_utf8_and_markdown_data_get_clear_answers() {
    let d = tmp();
    let model = d.path().join("model");
    tiny_model(&model);
    let m = model.to_str().unwrap();
    let json = d.path().join("data.json");
    std::fs::write(&json, r#"[{"text": "Once upon a time"}]"#).unwrap();
    let j = json.to_str().unwrap();
    fails(
        &["eval", "--model", m, "--data", j],
        &["data.json", "is JSON", "JSONL"],
    );
    let out = d.path().join("run");
    fails(
        &[
            "train",
            "--model",
            m,
            "--data",
            j,
            "--steps",
            "1",
            "--out",
            out.to_str().unwrap(),
        ],
        &["data.json", "is JSON", "JSONL"],
    );
    assert!(!out.exists());

    let jsonl = d.path().join("bad.jsonl");
    let mut bytes = b"{\"text\": \"fine\"}\n{\"text\": \"".to_vec();
    bytes.extend([0xff, 0xfe]);
    bytes.extend(b"\"}\n");
    std::fs::write(&jsonl, bytes).unwrap();
    fails(
        &["eval", "--model", m, "--data", jsonl.to_str().unwrap()],
        &["bad.jsonl", "line 2", "not UTF-8"],
    );

    let md = d.path().join("notes.md");
    std::fs::write(&md, "Once upon a time there was a dog. ".repeat(40)).unwrap();
    let o = bin()
        .args([
            "eval",
            "--backend",
            "cpu",
            "--model",
            m,
            "--seq",
            "32",
            "--data",
        ])
        .arg(&md)
        .arg("--tokenizer")
        .arg(model.join("tokenizer.json"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// An adapter trained from a base given by a relative path records the
/// base's absolute path (usable from any working directory); `plot` on a
/// directory without metrics says what it needs in one line.
#[test]
fn adapters_name_their_base_absolutely_and_plot_names_a_missing_run() {
    let d = tmp();
    let base = d.path().join("base");
    tiny_model(&base);
    let adapter = d.path().join("adapter");
    let o = bin()
        .current_dir(d.path())
        .args([
            "train",
            "--model",
            "base",
            "--lora-rank",
            "4",
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
            "--out",
        ])
        .arg(&adapter)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    let recorded = std::path::PathBuf::from(cfg["base_model_name_or_path"].as_str().unwrap());
    assert!(recorded.is_absolute(), "{recorded:?}");
    assert_eq!(recorded, base.canonicalize().unwrap());

    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails(
        &["plot", empty.to_str().unwrap()],
        &["has no metrics.jsonl"],
    );
}

/// Near misses get a suggestion: a misspelt flag (clap's tip, kept in the
/// one-line error), a misspelt preset, and a pretrained model's name that
/// matches a random preset's but for case.
#[test]
fn near_misses_get_suggestions() {
    fails(
        &["train", "--step", "3"],
        &["'--step'", "tip: a similar argument exists: '--steps'"],
    );
    fails(
        &["train", "--model", "qwen3-06b"],
        &["did you mean 'qwen3-0.6b'?"],
    );
    fails(
        &["train", "--model", "Qwen3-0.6B"],
        &["randomly initialised", "give its Hub id (Qwen/Qwen3-0.6B)"],
    );
}

/// `--prompt-key` names a prompt/completion field: given with chat
/// records it is refused in one line instead of being ignored.
#[test]
fn record_keys_on_chat_records_are_refused() {
    let model = common::fixture("../chat/model");
    let data = common::fixture("../chat/data/chat");
    fails(
        &[
            "eval",
            "--backend",
            "cpu",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--prompt-key",
            "question",
        ],
        &[
            "chat",
            "--prompt-key/--completion-key apply to prompt/completion records only",
        ],
    );
}

/// Two signals in quick succession before a run's first checkpoint: the
/// process exits at once with 130, and what it says matches what it
/// leaves — no directory ("nothing was saved"), or, where the first
/// signal's save of step 0 won the race, a checkpoint that `--resume`
/// takes ("intact").
#[test]
fn a_second_signal_before_the_first_checkpoint_leaves_nothing_behind() {
    let d = tmp();
    let out = d.path().join("run");
    let mut child = bin()
        .args([
            "train",
            "--backend",
            "cpu",
            "--steps",
            "1",
            "--seq",
            "128",
            "--batch",
            "800",
            "--out",
        ])
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !out.join("metrics.jsonl").exists() {
        assert!(t0.elapsed().as_secs() < 120, "the run never started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the step ended too soon to test"
    );
    for _ in 0..2 {
        let kill = std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
    }
    let o = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{e}");
    if out.exists() {
        assert!(out.join("trainer/state.json").is_file(), "{e}");
        assert!(e.contains("intact") || e.contains("is saved"), "{e}");
    } else {
        assert!(e.contains("nothing was saved"), "{e}");
    }
}
