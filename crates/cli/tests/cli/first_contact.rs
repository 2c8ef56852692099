//! What a new user runs into first: resuming the wrong directory, failed
//! runs leaving directories behind, resume mismatches, command-line
//! mistakes, a wrong file given to `convert`.

use crate::common;

use common::{bin, fails, tmp};

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

/// `anetrain tokenizer train` on `text` with 300 entries; the tokenizer.json.
fn tokenizer_train(text: &std::path::Path, out: &std::path::Path) -> serde_json::Value {
    let o = bin()
        .args([
            "tokenizer",
            "train",
            "--input",
            s(text),
            "--vocab-size",
            "300",
        ])
        .args(["--out", s(out)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

#[test]
fn resume_needs_a_checkpoint() {
    let d = tmp();
    let typo = d.path().join("runs/tiny-typo");
    fails(
        &["train", "--resume", "--steps", "1", "--out", s(&typo)],
        &["nothing to resume", "tiny-typo", "does not exist"],
    );
    assert!(!typo.exists() && !d.path().join("runs").exists());
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails(
        &["train", "--resume", "--steps", "1", "--out", s(&empty)],
        &["nothing to resume", "holds no checkpoint"],
    );
    assert!(empty.is_dir(), "a directory the user made stays");
}

#[test]
fn a_failed_run_leaves_no_directory_behind() {
    let d = tmp();
    let out = d.path().join("runs/new");
    let missing = d.path().join("nope.txt");
    let no_model = d.path().join("no-model");
    for (args, needle) in [
        (vec!["--seq", "4096"], "max_position_embeddings"),
        (
            vec!["--data", s(&missing)],
            "nope.txt': the file does not exist",
        ),
        (vec!["--data", s(d.path())], "is a directory"),
        (vec!["--model", s(&no_model)], "no-model"),
    ] {
        let mut a = vec!["train", "--steps", "1", "--out", s(&out)];
        a.extend(args);
        fails(&a, &[needle]);
        assert!(!d.path().join("runs").exists(), "{a:?} left a directory");
    }
    // The default directory under ./runs/ too.
    let o = bin()
        .args(["train", "--steps", "1", "--seq", "4096"])
        .current_dir(d.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(!d.path().join("runs").exists());
}

#[test]
fn a_resume_mismatch_names_the_flags_and_values() {
    let d = tmp();
    let out = d.path().join("run");
    let base = [
        "train",
        "--steps",
        "2",
        "--seq",
        "32",
        "--lr",
        "0.003",
        "--out",
        s(&out),
    ];
    let o = bin().args(base).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = bin()
        .args([
            "train", "--steps", "4", "--seq", "64", "--lr", "0.001", "--resume",
        ])
        .args(["--out", s(&out)])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("--seq 32 in the run, 64 now")
            && e.contains("--lr 0.003 in the run, 0.001 now")
            && e.contains("only --steps"),
        "{e}"
    );
    assert!(!e.contains('{') && !e.contains("AneSim"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    // With the run's flags and more steps, it continues.
    let o = bin()
        .args([
            "train", "--steps", "3", "--seq", "32", "--lr", "0.003", "--resume",
        ])
        .args(["--out", s(&out)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn command_line_mistakes_are_one_line() {
    // Negative numbers reach the range checks.
    fails(
        &[
            "generate",
            "--model",
            "m",
            "--prompt",
            "a",
            "--temperature",
            "-1",
        ],
        &["--temperature", ">= 0"],
    );
    fails(
        &[
            "generate", "--model", "m", "--prompt", "a", "--top-p", "-0.5",
        ],
        &["--top-p"],
    );
    // clap's own errors, without the usage block.
    fails(&["train", "--bogus"], &["--bogus", "--help"]);
    fails(&["generate", "--prompt", "a"], &["required", "--model"]);
    fails(&["bench", "--seq", "-5"], &["--seq", "-5"]);
}

#[test]
fn convert_says_what_is_not_a_llama2c_checkpoint() {
    let d = tmp();
    let text = d.path().join("notes.txt");
    std::fs::write(&text, "some notes that are not a checkpoint at all").unwrap();
    let out = d.path().join("out");
    fails(
        &["convert", s(&text), "--out", s(&out)],
        &["notes.txt", "not a llama2.c checkpoint", "header field"],
    );
    // A plausible header whose file is cut short.
    let header: Vec<u8> = [8i32, 16, 1, 2, 2, 4, 4]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let short = d.path().join("short.bin");
    std::fs::write(&short, &header).unwrap();
    fails(
        &["convert", s(&short), "--out", s(&out)],
        &["not a llama2.c checkpoint", "holds 28", "truncated"],
    );
    fails(
        &["convert", s(d.path()), "--out", s(&out)],
        &["is not a file"],
    );
    assert!(!out.exists());
}

/// SIGTERM in the middle of a long step: the run exits within seconds,
/// having saved the last completed step, and `--resume` then gives the
/// same bits as a run never interrupted.
#[test]
fn a_signal_stops_a_long_step_promptly_and_resume_is_exact() {
    let d = tmp();
    // One step of 800 sequences: 20 s or more on two cores.
    let flags = [
        "train",
        "--backend",
        "cpu",
        "--steps",
        "1",
        "--seq",
        "128",
        "--batch",
        "800",
    ];
    let (stopped, whole) = (d.path().join("stopped"), d.path().join("whole"));
    let mut child = bin()
        .args(flags)
        .args(["--out", s(&stopped)])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Into the step: the run directory and its metrics exist.
    let t0 = std::time::Instant::now();
    while !stopped.join("metrics.jsonl").exists() {
        assert!(t0.elapsed().as_secs() < 120, "the run never started");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the step ended too soon to test"
    );
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let signalled = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            signalled.elapsed().as_secs() < 10,
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(130), "{e}");
    let last = e.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("interrupted during step 1; step 0 is saved") && last.contains("--resume"),
        "{e}"
    );
    assert!(stopped.join("trainer/state.json").is_file());

    let o = bin()
        .args(flags)
        .args(["--resume", "--out", s(&stopped)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = bin()
        .args(flags)
        .args(["--out", s(&whole)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read(stopped.join("model.safetensors")).unwrap(),
        std::fs::read(whole.join("model.safetensors")).unwrap(),
        "resumed after the signal, the weights differ from an uninterrupted run"
    );
}

/// Own text on a preset: `tokenizer train` makes a tokenizer ahead, and
/// `train --data FILE.txt` without one trains one on the file and keeps it
/// in the run, which then generates and resumes.
#[test]
fn own_text_gets_its_own_tokenizer() {
    let d = tmp();
    let words = [
        "the", "a", "cat", "dog", "sat", "ran", "on", "under", "big", "small", "red", "house",
        "tree", "river", "moon", "happy",
    ];
    let text: String = (0..3000)
        .map(|i| {
            let line: Vec<&str> = (0..12)
                .map(|j| words[(i * 7 + j * 5 + i / 3) % words.len()])
                .collect();
            format!("{}.\n", line.join(" "))
        })
        .collect();
    let txt = d.path().join("mine.txt");
    std::fs::write(&txt, text).unwrap();

    let tok = d.path().join("tok.json");
    let t = tokenizer_train(&txt, &tok);
    assert_eq!(t["model"]["type"], "BPE");
    fails(
        &[
            "tokenizer",
            "train",
            "--input",
            s(&txt),
            "--vocab-size",
            "100",
            "--out",
            s(&tok),
        ],
        &["--vocab-size 100"],
    );

    let run = d.path().join("run");
    let flags = [
        "train",
        "--data",
        s(&txt),
        "--steps",
        "2",
        "--seq",
        "32",
        "--out",
        s(&run),
    ];
    let o = bin().args(flags).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("trained a byte-level BPE tokenizer"), "{e}");
    assert!(run.join("tokenizer.json").is_file());
    let o = bin()
        .args([
            "generate",
            "--model",
            s(&run),
            "--prompt",
            "the cat",
            "--max-tokens",
            "5",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = bin()
        .args([
            "train",
            "--data",
            s(&txt),
            "--steps",
            "3",
            "--seq",
            "32",
            "--resume",
            "--out",
            s(&run),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A run directory is a Hugging Face model directory: config.json names
/// the tokenizer's end token, tokenizer_config.json sits beside
/// tokenizer.json (`scripts/check_run_dir.py` loads both with
/// transformers); a fine-tune keeps its base model's special token ids.
#[test]
fn a_run_directory_names_its_special_tokens() {
    let d = tmp();
    let run = d.path().join("run");
    let o = bin()
        .args(["train", "--steps", "1", "--seq", "32", "--out", s(&run)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let cfg = json(run.join("config.json"));
    let tok = json(run.join("tokenizer.json"));
    let eot = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["content"] == "<|endoftext|>")
        .unwrap()["id"]
        .clone();
    assert_eq!(cfg["eos_token_id"], eot, "{cfg}");
    let tc = json(run.join("tokenizer_config.json"));
    assert_eq!(tc["eos_token"], "<|endoftext|>");
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");

    // Fine-tuning a Hugging Face model keeps its ids.
    let fine = d.path().join("fine");
    let base = common::fixture("llama/model");
    // u16 token ids within the fixture's 96-entry vocabulary.
    let data = d.path().join("tokens.bin");
    let ids: Vec<u8> = (0..2000u16)
        .flat_map(|i| (i * 7 % 96).to_le_bytes())
        .collect();
    std::fs::write(&data, ids).unwrap();
    let o = bin()
        .args([
            "train",
            "--model",
            s(&base),
            "--data",
            s(&data),
            "--steps",
            "1",
        ])
        .args(["--seq", "16", "--out", s(&fine)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = json(fine.join("config.json"));
    let base_cfg = json(base.join("config.json"));
    assert_eq!(cfg["bos_token_id"], base_cfg["bos_token_id"]);
    assert_eq!(cfg["eos_token_id"], base_cfg["eos_token_id"]);
}

/// A model that has learned to end at once: `generate` prints the prompt
/// and stops, never the end-of-sequence token's text.
#[test]
fn generate_stops_at_the_end_token_without_printing_it() {
    let d = tmp();
    let text = d.path().join("t.txt");
    std::fs::write(&text, "the cat sat on the mat.\n".repeat(200)).unwrap();
    let tok = d.path().join("tok.json");
    // Training data of nothing but <|endoftext|> (id 0, the first token the
    // tokenizer trainer adds).
    let t = tokenizer_train(&text, &tok);
    assert_eq!(t["added_tokens"][0]["content"], "<|endoftext|>");
    assert_eq!(t["added_tokens"][0]["id"], 0);
    let data = d.path().join("eot.bin");
    std::fs::write(&data, vec![0u8; 2 * 5000]).unwrap();
    let run = d.path().join("run");
    let o = bin()
        .args([
            "train",
            "--data",
            s(&data),
            "--tokenizer",
            s(&tok),
            "--steps",
            "30",
        ])
        .args(["--seq", "32", "--out", s(&run)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for backend in ["cpu", "ane-sim"] {
        let o = bin()
            .args([
                "generate",
                "--model",
                s(&run),
                "--prompt",
                "the cat",
                "--temperature",
                "0",
            ])
            .args(["--max-tokens", "20", "--backend", backend])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "the cat\n", "{backend}");
    }
}

/// `info` names backends as `--backend` spells them.
#[test]
fn info_spells_backends_as_the_flag_does() {
    let o = bin().arg("info").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    let line = out
        .lines()
        .find(|l| l.starts_with("default backend: "))
        .unwrap_or_else(|| panic!("{out}"));
    let name = line.trim_start_matches("default backend: ");
    assert!(["cpu", "ane-sim", "ane"].contains(&name), "{line}");
}

/// The top-level `--help` says what the tool does, not how the crate is
/// built.
#[test]
fn the_top_level_help_describes_the_tool() {
    let o = bin().arg("--help").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let first = out.lines().next().unwrap_or("");
    assert!(
        first.contains("Train Llama and Qwen3") && first.contains("Neural Engine"),
        "{out}"
    );
    assert!(!out.contains("over the anetrain library"), "{out}");
}
