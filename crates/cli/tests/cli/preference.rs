//! `anetrain train --objective dpo|orpo` end to end: the same per-step
//! metrics as TRL's `DPOTrainer`/`ORPOTrainer` from the same adapter and
//! data (`testdata/preference`, written by
//! `scripts/make_preference_fixtures.py`), on the CPU and the simulated
//! Neural Engine; exact resume; precomputed references; checkpointing and
//! streamed buffers changing nothing; SFT then DPO on a toy task; and
//! one-line errors for bad pairs and flags.

use crate::common;

use common::{bin, fails, records, resume_runs, run, tmp};

use std::path::{Path, PathBuf};

fn preference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/preference")
}

fn chat_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat/model")
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// The flags of the TRL runs (`runs.json` "settings"): the fixture's
/// adapter, AdamW with TRL's defaults and no weight decay, a constant
/// learning rate, both training pairs in every step, the validation pairs
/// after the last.
fn trl_flags(data: &str, backend: &str) -> Vec<String> {
    let dir = preference_dir();
    [
        "train",
        "--model",
        &s(&chat_model()),
        "--init-adapter",
        &s(&dir.join("adapter")),
        "--data",
        &s(&dir.join("data").join(data)),
        "--lr",
        "5e-3",
        "--warmup",
        "0",
        "--min-lr-frac",
        "1",
        "--beta1",
        "0.9",
        "--beta2",
        "0.999",
        "--eps",
        "1e-8",
        "--wd",
        "0",
        "--batch",
        "2",
        "--steps",
        "5",
        "--clip",
        "1",
        "--eval-every",
        "5",
        "--eval-windows",
        "2",
        "--seq",
        "511",
        "--backend",
        backend,
    ]
    .map(String::from)
    .to_vec()
}

fn run_strings(args: &[String], out: &Path) -> Vec<serde_json::Value> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(&args, out);
    records(out)
}

/// TRL's metric names this test compares (the gradient norm is compared
/// by the losses of the steps after it).
const COMPARED: &[&str] = &[
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "log_odds_ratio",
];

/// Every run of `runs.json` — DPO sigmoid on conversational and standard
/// pairs, IPO, ORPO — five steps and the validation pairs after them:
/// * `cpu`: each metric within 1e-4 relative of TRL's (f32 both sides;
///   measured worst 4.8e-5, on IPO's loss near its minimum);
/// * `ane-sim`: the fp16 kernels' errors on log-probabilities summed over
///   tens of tokens: logps within 2e-3 relative; rewards and margins (β
///   times differences of those sums) and the loss within 2e-2 absolute,
///   or relative above 1 (IPO's loss near 25: measured 2.7e-3 relative;
///   rewards 2.5e-3 absolute); accuracies equal wherever |margin| > 2e-2.
#[test]
fn dpo_and_orpo_steps_equal_trl() {
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(preference_dir().join("runs.json")).unwrap())
            .unwrap();
    let dir = tmp();
    for (i, r) in fixture["runs"].as_array().unwrap().iter().enumerate() {
        for backend in ["cpu", "ane-sim"] {
            let mut args = trl_flags(r["data"].as_str().unwrap(), backend);
            args.extend([
                "--objective".into(),
                r["objective"].as_str().unwrap().into(),
            ]);
            if let Some(loss) = r["loss"].as_str() {
                if r["objective"] == "dpo" {
                    args.extend(["--dpo-loss".into(), loss.into()]);
                }
            }
            let out = dir.path().join(format!("{i}-{backend}"));
            let got = run_strings(&args, &out);
            let train: Vec<_> = got.iter().filter(|g| g["split"] == "train").collect();
            let val = got
                .iter()
                .rfind(|g| g["split"] == "val")
                .expect("a validation line");
            let expected = r["steps"].as_array().unwrap();
            assert_eq!(train.len(), expected.len());
            let pairs = expected
                .iter()
                .zip(&train)
                .map(|(e, g)| (format!("step {}", g["step"]), e, *g))
                .chain([("eval".to_owned(), &r["eval"], val)]);
            for (at, e, g) in pairs {
                for &k in COMPARED {
                    let Some(want) = e[k].as_f64() else { continue };
                    let have = g[k].as_f64().unwrap_or_else(|| panic!("{at}: no {k}"));
                    let ok = match backend {
                        "cpu" => (have - want).abs() <= 1e-4 * want.abs().max(1e-3),
                        _ if k.starts_with("logps") => (have - want).abs() <= 2e-3 * want.abs(),
                        _ if k == "rewards/accuracies" => {
                            have == want || e["rewards/margins"].as_f64().unwrap().abs() <= 2e-2
                        }
                        _ => (have - want).abs() <= 2e-2 * want.abs().max(1.0),
                    };
                    assert!(
                        ok,
                        "run {i} ({r}) on {backend}, {at}: {k} {have} vs TRL {want}"
                    );
                }
            }
        }
    }
}

/// A DPO run resumed after 2 of 4 steps ends with the adapter and metrics
/// of the straight run, bit for bit (LoRA and full fine-tuning, whose
/// reference is the initial model loaded again); with `--precompute-ref` the reference
/// is the same, so are the losses; on `ane-sim`, `--grad-checkpoint` and
/// streamed device buffers change nothing either.
#[test]
fn dpo_resumes_exactly_and_precomputing_the_reference_changes_nothing() {
    let dir = tmp();
    let flags = |steps: &str, backend: &str| {
        let mut a = trl_flags("chat", backend);
        for (flag, value) in [("--steps", steps), ("--eval-every", "2")] {
            let at = a.iter().position(|x| x == flag).unwrap();
            a[at + 1] = value.into();
        }
        a.extend(["--objective", "dpo", "--save-every", "2"].map(String::from));
        a
    };
    let lora = resume_runs(&dir.path().join("lora"), |n| flags(n, "cpu"), "2", "4");
    lora.assert_same("adapter_model.safetensors");
    let (full, after) = (records(&lora.straight), records(&lora.resumed));
    let strip = |v: &[serde_json::Value]| -> Vec<serde_json::Value> {
        v.iter()
            .map(|r| {
                let mut r = r.clone();
                let o = r.as_object_mut().unwrap();
                o.remove("time");
                o.remove("tokens_per_s");
                r
            })
            .collect()
    };
    assert_eq!(strip(&full), strip(&after));

    // Full fine-tuning: the reference is a copy of the initial model,
    // loaded again on resume.
    let full_flags = |steps: &str| {
        let mut a = flags(steps, "cpu");
        let at = a.iter().position(|x| x == "--init-adapter").unwrap();
        a.drain(at..at + 2);
        a
    };
    let whole = resume_runs(&dir.path().join("full"), full_flags, "2", "4");
    let full_straight = records(&whole.straight);
    assert_eq!(strip(&full_straight), strip(&records(&whole.resumed)));
    assert_ne!(
        strip(&full_straight),
        strip(&full),
        "full fine-tuning is another run"
    );

    let mut pre = flags("4", "cpu");
    pre.push("--precompute-ref".into());
    let precomputed = run_strings(&pre, &dir.path().join("pre"));
    assert_eq!(strip(&full), strip(&precomputed));

    let sim = |extra: &[&str], name: &str| {
        let mut a = flags("2", "ane-sim");
        a.extend(extra.iter().map(|x| x.to_string()));
        strip(&run_strings(&a, &dir.path().join(name)))
    };
    let plain = sim(&[], "sim");
    assert_eq!(plain, sim(&["--grad-checkpoint"], "sim-ckpt"));
    assert_eq!(
        plain,
        sim(&["--device-buffers", "streamed"], "sim-streamed")
    );
}

/// Two stages on a toy task: SFT teaches the answer's form ("It is red."
/// three times in four), DPO from the SFT adapter prefers "It is blue.";
/// the validation pairs' reward accuracy reaches 0.9 on both engines, and
/// greedy generation, red after SFT, answers blue after DPO — for a name
/// of the validation split and one in no data at all.
#[test]
fn sft_then_dpo_prefers_the_chosen_answer() {
    let dir = tmp();
    let data = dir.path().join("data");
    let names = [
        "Ada", "Grete", "Søren", "Zoë", "Ramón", "Jürgen", "Ωmega", "Bo", "Kim", "Lu", "Max",
        "Noa", "Ola", "Pia", "Rui", "Sam",
    ];
    let write = |dir: &Path, lines: Vec<String>| {
        std::fs::create_dir_all(dir).unwrap();
        let (valid, train) = lines.split_at(4);
        std::fs::write(dir.join("train.jsonl"), train.join("\n")).unwrap();
        std::fs::write(dir.join("valid.jsonl"), valid.join("\n")).unwrap();
    };
    let user =
        |n: &str| serde_json::json!({"role": "user", "content": format!("Pick a color for {n}.")});
    let reply = |c: &str| serde_json::json!({"role": "assistant", "content": c});
    let (red, blue) = ("It is red.", "It is blue.");
    write(
        &data.join("sft"),
        names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let answer = if i % 4 == 0 { blue } else { red };
                serde_json::json!({"messages": [user(n), reply(answer)]}).to_string()
            })
            .collect(),
    );
    write(
        &data.join("dpo"),
        names
            .iter()
            .map(|n| {
                serde_json::json!({"prompt": [user(n)], "chosen": [reply(blue)], "rejected": [reply(red)]})
                    .to_string()
            })
            .collect(),
    );
    let model = s(&chat_model());
    let answer = |adapter: &Path, name: &str| {
        let o = bin()
            .args([
                "generate",
                "--model",
                &model,
                "--adapter",
                &s(adapter),
                "--chat",
            ])
            .args(["--max-tokens", "16", "--temperature", "0", "--prompt"])
            .arg(format!("Pick a color for {name}."))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let sft = dir.path().join("sft");
    run(
        &[
            "train",
            "--model",
            &model,
            "--data",
            &s(&data.join("sft")),
            "--lora-rank",
            "8",
            "--lr",
            "1e-2",
            "--steps",
            "40",
            "--batch",
            "4",
            "--mask-prompt",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
            "--seq",
            "64",
        ],
        &sft,
    );
    for name in ["Ada", "Xavier"] {
        let text = answer(&sft, name);
        assert!(text.contains(red), "after SFT, {name}: {text}");
    }
    for backend in ["cpu", "ane-sim"] {
        let out = dir.path().join(format!("dpo-{backend}"));
        let recs = run_strings(
            &[
                "train",
                "--model",
                &model,
                "--init-adapter",
                &s(&sft),
                "--data",
                &s(&data.join("dpo")),
                "--objective",
                "dpo",
                "--lr",
                "1e-3",
                "--steps",
                "20",
                "--batch",
                "4",
                "--eval-every",
                "20",
                "--eval-windows",
                "4",
                "--backend",
                backend,
                "--seq",
                "64",
            ]
            .map(String::from),
            &out,
        );
        let val = recs.iter().rfind(|r| r["split"] == "val").unwrap();
        let acc = val["rewards/accuracies"].as_f64().unwrap();
        assert!(
            acc >= 0.9,
            "{backend}: validation reward accuracy {acc}: {val}"
        );
        for name in ["Ada", "Xavier"] {
            let text = answer(&out, name);
            assert!(
                text.contains(blue),
                "after DPO on {backend}, {name}: {text}"
            );
        }
    }
}

/// A preference run's first lines say what it trains on (pairs, not only
/// tokens), what it optimises against which reference, and how a
/// quantized base is held.
#[test]
fn the_start_lines_name_the_pairs_the_objective_and_a_quantized_base() {
    let dir = tmp();
    let data = preference_dir().join("data");
    let data = std::fs::read_dir(&data)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut args = trl_flags(data.file_name().unwrap().to_str().unwrap(), "cpu");
    let steps = args.iter().position(|a| a == "--steps").unwrap();
    args[steps + 1] = "1".into();
    args.extend(
        [
            "--objective",
            "dpo",
            "--quantize-base",
            "4",
            "--q-group-size",
            "32",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&args, &dir.path().join("dpo"));
    let text = String::from_utf8_lossy(&o.stderr);
    let first = text.lines().find(|l| l.starts_with("training ")).unwrap();
    assert!(
        first.contains(" train / ") && first.contains(" val pairs ("),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l
            .starts_with("DPO (sigmoid loss, β 0.1) against the base with the starting adapter (")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("quantized to 4-bit groups of 32 as it loads")),
        "{text}"
    );
}

/// Bad pairs and flags: one line naming the file, the line and the fix.
#[test]
fn bad_pairs_and_flags_are_named() {
    let dir = tmp();
    let model = s(&chat_model());
    let file = |name: &str, body: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        s(&p)
    };
    let good = r#"{"prompt": "Q: 1+1?", "chosen": " 2", "rejected": " 3"}"#;
    let missing = file(
        "missing.jsonl",
        &format!("{good}\n{{\"prompt\": \"Q\", \"chosen\": \"A\"}}\n"),
    );
    let same = file(
        "same.jsonl",
        &format!("{good}\n{{\"prompt\": \"Q\", \"chosen\": \"A\", \"rejected\": \"A\"}}\n"),
    );
    let mixed = file(
        "mixed.jsonl",
        r#"{"prompt": "Q", "chosen": "A", "rejected": [{"role": "assistant", "content": "B"}]}"#,
    );
    let pairs = file("pairs.jsonl", good);
    let train = |data: &str, extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            &model,
            "--lora-rank",
            "2",
            "--steps",
            "1",
            "--data",
        ];
        a.push(data);
        a.extend_from_slice(extra);
        a.iter().map(|x| x.to_string()).collect::<Vec<_>>()
    };
    let check = |args: Vec<String>, needles: &[&str]| {
        let out = dir.path().join("out");
        let mut args = args;
        args.extend(["--out".into(), s(&out)]);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&refs, needles);
        assert!(!out.exists(), "a refused run leaves nothing behind");
    };
    // Pairs longer than --seq are cut, keeping the start, and said so.
    let o = bin()
        .args([
            "train",
            "--model",
            &model,
            "--steps",
            "1",
            "--objective",
            "dpo",
            "--seq",
            "24",
        ])
        .arg("--data")
        .arg(preference_dir().join("data/chat"))
        .arg("--out")
        .arg(dir.path().join("cut"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("2 pairs longer than --seq 24 + 1 tokens cut") && e.contains("keep_start"),
        "{e}"
    );
    check(
        train(&missing, &["--objective", "dpo"]),
        &["missing.jsonl' line 2", "\"rejected\""],
    );
    check(
        train(&same, &["--objective", "dpo"]),
        &["same.jsonl' line 2", "the same answer"],
    );
    check(
        train(&mixed, &["--objective", "orpo"]),
        &["mixed.jsonl' line 1", "must both be strings"],
    );
    check(train(&pairs, &[]), &["preference pairs", "--objective dpo"]);
    check(
        train(&pairs, &["--beta", "0.2"]),
        &["--beta applies to preference tuning"],
    );
    check(
        train(&pairs, &["--objective", "dpo", "--dpo-loss", "hinge"]),
        &["hinge", "not built yet"],
    );
    check(
        train(&pairs, &["--objective", "orpo", "--precompute-ref"]),
        &["ORPO has no reference"],
    );
    check(
        train(&pairs, &["--objective", "dpo", "--mask-prompt"]),
        &["--mask-prompt is implied"],
    );
    check(
        vec![
            "train",
            "--model",
            &model,
            "--objective",
            "dpo",
            "--steps",
            "1",
        ]
        .into_iter()
        .map(String::from)
        .collect(),
        &["--objective dpo trains on preference pairs"],
    );
}

/// `kernels plan` counts a preference step: one pair's two sequences, and
/// for DPO the reference's two forwards (each layer's forward kernels and
/// the head's chunks once), which `--precompute-ref` and ORPO drop; the
/// memory plan holds a second gradient buffer and, for DPO, the initial
/// adapters; the predicted step orders DPO > ORPO = precomputed DPO > SFT.
#[test]
fn the_plan_counts_the_reference_pass() {
    let config =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/configs/qwen3-0.6b.json");
    let plan = |extra: &[&str]| -> serde_json::Value {
        let o = bin()
            .args([
                "kernels",
                "plan",
                "--model",
                &s(&config),
                "--seq",
                "256",
                "--lora-rank",
                "16",
            ])
            .args(["--json", "--family", "m4"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (sft, dpo, orpo, pre) = (
        plan(&[]),
        plan(&["--objective", "dpo"]),
        plan(&["--objective", "orpo"]),
        plan(&["--objective", "dpo", "--precompute-ref"]),
    );
    let evals = |p: &serde_json::Value, k: &str| p["work"][k].as_u64().unwrap();
    let (one, reference) = (
        evals(&sft, "device_evaluations"),
        evals(&dpo, "reference_evaluations"),
    );
    assert_eq!(evals(&orpo, "device_evaluations"), 2 * one);
    assert_eq!(evals(&dpo, "device_evaluations"), 2 * one + reference);
    let layers = 28;
    let heads = sft["plan"]["head"]["chunks"].as_u64().unwrap();
    let forward_tiles: u64 = sft["plan"]["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["kind"].as_str().unwrap().ends_with("Forward") && k["kind"] != "HeadForward")
        .map(|k| k["tiles"].as_u64().unwrap())
        .sum();
    assert_eq!(reference, 2 * (layers * forward_tiles + heads));
    assert_eq!(evals(&pre, "reference_evaluations"), 0);
    let part = |p: &serde_json::Value| {
        p["memory"]["resident"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "preference")
            .map(|x| x["bytes"].as_u64().unwrap())
    };
    assert_eq!(part(&sft), None);
    assert_eq!(part(&dpo), Some(2 * part(&orpo).unwrap()));
    let ms = |p: &serde_json::Value| p["predicted"]["m4"]["step_ms"].as_f64().unwrap();
    assert!(
        ms(&dpo) > ms(&orpo) && ms(&orpo) > ms(&sft),
        "{} {} {}",
        ms(&dpo),
        ms(&orpo),
        ms(&sft)
    );
    assert!((ms(&pre) - ms(&orpo)).abs() < 1e-9 * ms(&orpo));
}

/// Ctrl-C while `--precompute-ref` computes the reference over 2,000
/// pairs stops within seconds with one plain line (status 130, no
/// error), and a fresh run leaves no directory behind.
#[test]
fn a_signal_stops_the_reference_precompute_promptly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tmp();
    let data = dir.path().join("pairs");
    std::fs::create_dir_all(&data).unwrap();
    let pairs = std::fs::read_to_string(preference_dir().join("data/strings/train.jsonl")).unwrap();
    let many: String = pairs
        .lines()
        .cycle()
        .take(2000)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(data.join("train.jsonl"), many).unwrap();
    let mut args = trl_flags("strings", "cpu");
    let at = args.iter().position(|x| x == "--data").unwrap();
    args[at + 1] = data.display().to_string();
    args.extend(["--objective", "dpo", "--precompute-ref"].map(String::from));
    let out = dir.path().join("run");
    let mut child = bin()
        .args(&args)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let started = line.contains("computing the reference's log-probabilities of 2000 pairs");
        seen.push(line);
        if started {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains("2000 pairs")),
        "{seen:?}"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let sent = std::time::Instant::now();
    std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    let waited = sent.elapsed().as_secs_f64();
    assert!(waited < 5.0, "took {waited:.1} s to stop: {rest:?}");
    assert_eq!(status.code(), Some(130), "{rest:?}");
    assert_eq!(rest.len(), 1, "{rest:?}");
    assert!(
        rest[0].contains("interrupted while computing the reference") && !rest[0].contains("error"),
        "{rest:?}"
    );
    assert!(
        !out.exists(),
        "the interrupted fresh run left {}",
        out.display()
    );
}

/// An objective is named in any case; a typo gets the nearest name, and
/// the objectives people ask for that are not built say so, in one line.
#[test]
fn objectives_are_named_forgivingly_and_unbuilt_ones_say_so() {
    fails(
        &["train", "--objective", "dop"],
        &[
            "'dop'",
            "expected one of sft, dpo, orpo",
            "did you mean 'dpo'",
        ],
    );
    for (name, says) in [("kto", "KTO"), ("simpo", "SimPO")] {
        fails(
            &["train", "--objective", name],
            &[says, "not built yet", "sft, dpo, orpo"],
        );
    }
    // Upper case selects DPO: what is refused is the data, not the name.
    fails(
        &["train", "--objective", "DPO"],
        &["--objective dpo trains on preference pairs"],
    );
}

/// `eval` on preference pairs scores them as the training step does: a
/// DPO run from fresh adapters (whose reference, the initial adapters, is
/// the base) reports validation metrics that `eval --adapter RUN` on the
/// same pairs gives again (its reference the base without the adapters,
/// as TRL's for a PEFT model), to f64 rounding; ORPO needs no reference;
/// `--objective` on records without pairs, and `sft` on pairs, are
/// refused in one line.
#[test]
fn eval_scores_pairs_as_the_runs_validation() {
    let dir = tmp();
    let out = dir.path().join("dpo");
    let data = preference_dir().join("data/chat");
    let model = s(&chat_model());
    run(
        &[
            "train",
            "--model",
            &model,
            "--lora-rank",
            "4",
            "--data",
            &s(&data),
            "--objective",
            "dpo",
            "--batch",
            "2",
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--eval-windows",
            "8",
            "--seq",
            "511",
            "--backend",
            "cpu",
        ],
        &out,
    );
    let val = records(&out)
        .into_iter()
        .rfind(|r| r["split"] == "val")
        .expect("a validation line");
    let eval = |objective: &str| {
        let o = bin()
            .args(["eval", "--model", &model, "--adapter"])
            .arg(&out)
            .arg("--data")
            .arg(&data)
            .args([
                "--split",
                "valid",
                "--backend",
                "cpu",
                "--objective",
                objective,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let got = eval("dpo");
    assert_eq!(got["pairs"], 2);
    for k in COMPARED {
        let Some(want) = val[*k].as_f64() else {
            continue;
        };
        let have = got[*k]
            .as_f64()
            .unwrap_or_else(|| panic!("no {k} in {got}"));
        assert!(
            (have - want).abs() <= 1e-9 * want.abs().max(1.0),
            "{k}: eval {have} vs the run's validation {want}"
        );
    }
    let orpo = eval("orpo");
    assert!(orpo["nll_loss"].as_f64().is_some() && orpo["log_odds_ratio"].as_f64().is_some());
    fails(
        &[
            "eval",
            "--model",
            &model,
            "--data",
            &s(&chat_model().join("../data/chat")),
            "--objective",
            "dpo",
        ],
        &["--objective scores preference pairs", "holds none"],
    );
    fails(
        &[
            "eval",
            "--model",
            &model,
            "--data",
            &s(&data),
            "--objective",
            "sft",
        ],
        &["--objective applies to preference pairs"],
    );
}
