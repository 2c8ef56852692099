//! Every model family end to end through the binary, on the transformers
//! fixtures (`scripts/make_fixtures.py`, `scripts/make_lora_fixtures.py`):
//! LoRA and full fine-tuning on the simulated Neural Engine track the CPU
//! engine step by step, a saved model keeps its family, and a family not
//! read is refused in one line that names those that are.

use crate::common;

use std::path::Path;

use common::{bin, fails, fixture, records, run, tmp};

const FAMILIES: [&str; 12] = [
    "qwen3",
    "llama",
    "mistral",
    "granite",
    "qwen2",
    "smollm3",
    "ministral",
    "gemma3",
    "phi3",
    "gemma3mm",
    "gemma2",
    "olmo2",
];

/// A raw u16 token file of `n` ids below 90 (every fixture's vocabulary
/// is larger), in a pattern a model can learn a little of in 20 steps.
fn token_file(dir: &Path, n: usize) -> std::path::PathBuf {
    let path = dir.join("tokens.bin");
    let bytes: Vec<u8> = (0..n)
        .flat_map(|i| (((i * 7 + i / 5) % 90) as u16).to_le_bytes())
        .collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The training losses of a run's metrics.
fn losses(out: &Path) -> Vec<f64> {
    records(out)
        .iter()
        .filter(|r| r["split"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

/// `ane-sim` tracks `cpu` within 2e-2 at every one of 20 LoRA steps and 10
/// full fine-tuning steps (fp16 kernels against f32; the learning rates
/// are high enough for the loss to move by more than that).
#[test]
fn every_family_trains_on_the_simulated_device_as_on_the_cpu() {
    let d = tmp();
    let data = token_file(d.path(), 6000);
    for kind in FAMILIES {
        let model = fixture(&format!("{kind}/model"));
        let model = model.to_str().unwrap();
        for (what, extra, steps) in [
            ("LoRA", ["--lora-rank", "4", "--lr", "1e-2"], 20),
            ("full", ["--batch", "2", "--lr", "1e-3"], 10),
        ] {
            let mut curves = vec![];
            for backend in ["cpu", "ane-sim"] {
                let out = d.path().join(format!("{kind}-{what}-{backend}"));
                let steps = steps.to_string();
                let mut args = vec![
                    "train",
                    "--model",
                    model,
                    "--data",
                    data.to_str().unwrap(),
                    "--token-dtype",
                    "u16",
                    "--seq",
                    "32",
                    "--steps",
                    &steps,
                    "--eval-every",
                    "0",
                    "--backend",
                    backend,
                ];
                args.extend(extra);
                run(&args, &out);
                curves.push(losses(&out));
            }
            let (cpu, sim) = (&curves[0], &curves[1]);
            assert_eq!(cpu.len(), steps, "{kind} {what}");
            let moved = (cpu[0] - cpu[steps - 1]).abs();
            assert!(
                moved > 2e-2,
                "{kind} {what}: the loss moved by {moved} only"
            );
            for (i, (a, b)) in cpu.iter().zip(sim).enumerate() {
                assert!(
                    (a - b).abs() < 2e-2,
                    "{kind} {what} step {}: cpu {a} vs ane-sim {b}",
                    i + 1
                );
            }
        }
        // The full run saved a model of its family, which evaluates.
        let saved = d.path().join(format!("{kind}-full-cpu"));
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap())
                .unwrap();
        let fixture_config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("{kind}/model/config.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(config["model_type"], fixture_config["model_type"]);
        let o = bin()
            .args(["eval", "--model", saved.to_str().unwrap()])
            .args([
                "--tokens",
                fixture(&format!("{kind}/tokens.npy")).to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// Full fine-tuning resumes bit-exactly where the stored model is not the
/// checkpoint's file: Phi-3's fused projections (stacked again on save)
/// and the multimodal Gemma 3 (its vision tower, kept in the checkpoint
/// and written back untouched).
#[test]
fn stacked_and_multimodal_models_resume_bit_exactly() {
    let d = tmp();
    let data = token_file(d.path(), 3000);
    for kind in ["phi3", "gemma3mm"] {
        let model = fixture(&format!("{kind}/model"));
        let args = |steps: &str| -> Vec<String> {
            [
                "train",
                "--model",
                model.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--token-dtype",
                "u16",
                "--seq",
                "32",
                "--batch",
                "2",
                "--lr",
                "1e-3",
                "--warmup",
                "0",
                "--min-lr-frac",
                "1",
                "--eval-every",
                "0",
                "--steps",
                steps,
            ]
            .map(String::from)
            .to_vec()
        };
        let runs = common::resume_runs(&d.path().join(kind), args, "2", "4");
        runs.assert_same("model.safetensors");
    }
}

/// A LoRA run on the last layers resumed with another `--lora-layers`
/// is refused naming both counts.
#[test]
fn a_resume_with_other_lora_layers_names_them() {
    let d = tmp();
    let data = token_file(d.path(), 3000);
    let model = fixture("smollm3/model");
    let out = d.path().join("run");
    let args = |steps: &str, layers: &str| -> Vec<String> {
        [
            "train",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--token-dtype",
            "u16",
            "--seq",
            "32",
            "--lora-rank",
            "4",
            "--lora-layers",
            layers,
            "--eval-every",
            "0",
            "--steps",
            steps,
        ]
        .map(String::from)
        .to_vec()
    };
    let first: Vec<String> = args("2", "2");
    run(&first.iter().map(String::as_str).collect::<Vec<_>>(), &out);
    let mut again = args("4", "1");
    again.extend([
        "--resume".into(),
        "--out".into(),
        out.to_str().unwrap().into(),
    ]);
    fails(
        &again.iter().map(String::as_str).collect::<Vec<_>>(),
        &["--lora-layers 2 in the run, 1 now"],
    );
}

#[test]
fn a_family_not_read_is_refused_naming_those_that_are() {
    let d = tmp();
    let dir = d.path().join("olmo");
    std::fs::create_dir(&dir).unwrap();
    let config = std::fs::read_to_string(fixture("llama/model/config.json"))
        .unwrap()
        .replace("\"llama\"", "\"olmo\"")
        .replace("LlamaForCausalLM", "OlmoForCausalLM");
    std::fs::write(dir.join("config.json"), config).unwrap();
    fails(
        &["eval", "--model", dir.to_str().unwrap()],
        &[
            "olmo",
            "qwen3, qwen2, llama, mistral, granite, smollm3, ministral, gemma3_text, gemma2, olmo2, phi3",
        ],
    );
}
