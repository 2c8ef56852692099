//! `anetrain train --lora-rank` end to end: the simulated Neural Engine
//! tracks the CPU engine, resumed LoRA runs (with dropout) are bit-identical,
//! the run directory is a PEFT adapter that `eval`/`generate --adapter` and
//! `merge` read, and bad LoRA flags fail with one line.

use crate::common;

use common::{bin, records, run};

/// 50 LoRA steps (rank 8) on a saved `tiny` from the same adapters and data:
/// the fp16 device path stays within 0.05 of the f32 CPU loss at every step.
#[test]
fn ane_sim_lora_training_tracks_the_cpu_run() {
    let mut losses = vec![];
    let base = common::tiny_base();
    for backend in ["cpu", "ane-sim"] {
        let out_tmp = common::tmp();
        let out = out_tmp.path().join(backend);
        let args = [
            "train",
            "--model",
            base.to_str().unwrap(),
            "--lora-rank",
            "8",
            "--lr",
            "1e-3",
            "--steps",
            "50",
            "--eval-every",
            "0",
            "--backend",
            backend,
        ];
        run(&args, &out);
        let recs = records(&out);
        assert_eq!(recs.len(), 50);
        assert!(recs.iter().all(|r| r["loss"].as_f64().unwrap().is_finite()));
        assert!(out.join("adapter_model.safetensors").is_file());
        assert!(out.join("adapter_config.json").is_file());
        assert!(
            !out.join("model.safetensors").exists(),
            "LoRA runs save adapters only"
        );
        losses.push(
            recs.iter()
                .map(|r| r["loss"].as_f64().unwrap())
                .collect::<Vec<_>>(),
        );
        let _ = std::fs::remove_dir_all(out);
    }
    let first = losses[0][0];
    let last = *losses[0].last().unwrap();
    assert!(last < first - 0.1, "the adapters learn: {first} -> {last}");
    for (step, (c, s)) in losses[0].iter().zip(&losses[1]).enumerate() {
        assert!(
            (c - s).abs() < 0.05,
            "step {}: cpu {c} vs ane-sim {s}",
            step + 1
        );
    }
}

/// A LoRA run's flags after `train --model BASE`.
const FLAGS: &[&str] = &[
    "--seq",
    "32",
    "--batch",
    "2",
    "--seed",
    "3",
    "--save-every",
    "3",
    "--eval-every",
    "0",
    "--backend",
    "cpu",
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--lora-dropout",
    "0.1",
    "--lora-targets",
    "q,v,down",
    // A constant learning rate, so runs of different --steps share a schedule.
    "--warmup",
    "0",
    "--min-lr-frac",
    "1",
];

#[test]
fn resumed_lora_runs_are_bit_identical_and_adapters_are_usable() {
    let base = common::tiny_base();
    let train = ["train", "--model", base.to_str().unwrap()];
    let dir = common::tmp();
    let args = |steps: &str| -> Vec<String> {
        [&train, FLAGS, &["--steps", steps]]
            .concat()
            .iter()
            .map(|a| a.to_string())
            .collect()
    };
    let runs = common::resume_runs(dir.path(), args, "5", "8");
    runs.assert_same("adapter_model.safetensors");
    let (full, part) = (runs.straight, runs.resumed);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8.0);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );
    // A different flag on resume is refused.
    let o = bin()
        .args(
            [
                &train,
                FLAGS,
                &["--steps", "9", "--resume", "--lora-rank", "8"],
            ]
            .concat(),
        )
        .arg("--out")
        .arg(&part)
        .output()
        .unwrap();
    assert!(!o.status.success());

    // The adapter on its base, fine-tuned further.
    let tuned_tmp = common::tmp();
    let tuned = tuned_tmp.path().join("tuned");
    let base_s = base.to_str().unwrap();
    run(
        &[
            "train",
            "--model",
            base_s,
            "--seq",
            "32",
            "--batch",
            "2",
            "--steps",
            "6",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
            "--lora-rank",
            "4",
            "--lr",
            "1e-2",
        ],
        &tuned,
    );
    let tokens = tuned.join("t.npy");
    let ids: Vec<i64> = (0..17).map(|i| (i * 37 % 500) as i64).collect();
    std::fs::write(&tokens, npy::encode_i64(&[17], &ids)).unwrap();
    let eval = |extra: &[&str]| -> f64 {
        let o = bin()
            .args([
                "eval",
                "--backend",
                "cpu",
                "--tokens",
                tokens.to_str().unwrap(),
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let tuned_s = tuned.to_str().unwrap();
    let plain = eval(&["--model", base_s]);
    let adapted = eval(&["--model", base_s, "--adapter", tuned_s]);
    assert!(
        (plain - adapted).abs() > 1e-4,
        "the adapter changes nothing"
    );
    let merged_tmp = common::tmp();
    let merged = merged_tmp.path().join("merged");
    let o = bin()
        .args(["merge", "--model", base_s, "--adapter", tuned_s, "--out"])
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = eval(&["--model", merged.to_str().unwrap()]);
    assert!(
        (m - adapted).abs() < 1e-5,
        "merged {m} vs adapted {adapted}"
    );
    let gen = |extra: &[&str]| {
        let o = bin()
            .args([
                "generate",
                "--backend",
                "cpu",
                "--prompt",
                "Once",
                "--max-tokens",
                "12",
            ])
            .args(["--temperature", "0"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    assert_eq!(
        gen(&["--model", base_s, "--adapter", tuned_s]),
        gen(&["--model", merged.to_str().unwrap()])
    );
    for d in [full, part, tuned, merged] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn bad_lora_flags_fail_with_one_line() {
    for (args, needle) in [
        (vec!["--lora-rank", "0"], "--lora-rank"),
        (
            vec!["--lora-rank", "4", "--lora-alpha", "-1"],
            "--lora-alpha",
        ),
        (
            vec!["--lora-rank", "4", "--lora-dropout", "1.5"],
            "--lora-dropout",
        ),
        (
            vec![
                "--lora-rank",
                "4",
                "--lora-dropout",
                "0.1",
                "--backend",
                "ane-sim",
            ],
            "only supported with --backend cpu",
        ),
    ] {
        let out_tmp = common::tmp();
        let out = out_tmp.path().join("bad");
        let base = common::tiny_base();
        let o = bin()
            .args(["train", "--steps", "1", "--model", base.to_str().unwrap()])
            .args(&args)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
        assert!(e.contains(needle), "{args:?}: {e}");
        let _ = std::fs::remove_dir_all(out);
    }
    // LoRA on a preset: nothing to adapt, nothing created.
    let d = common::tmp();
    let out = d.path().join("run");
    common::fails(
        &["train", "--lora-rank", "4", "--out", out.to_str().unwrap()],
        &[
            "LoRA adapts a pretrained model, and 'tiny' is a preset",
            "Qwen/Qwen3-0.6B",
        ],
    );
    assert!(!out.exists());
    let o = bin()
        .args([
            "eval",
            "--model",
            "/nonexistent-base",
            "--adapter",
            "/nonexistent",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
}
