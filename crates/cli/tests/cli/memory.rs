//! The memory settings change where bytes live, never a result: streamed
//! and persistent device buffers, activation checkpointing on and off give
//! bit-identical losses and saved weights; a run whose memory plan exceeds
//! `--max-memory` is refused in one line before anything is written; and
//! `kernels plan` shows the plan.

use crate::common;

use common::{bin, records, tmp};

use std::path::Path;

/// Trains `args` (plus `--out`) with `env` set; returns every step's loss
/// (as logged: the same decimal text for the same f32) and the bytes of the
/// saved weights file `weights`.
fn train(args: &[&str], env: &[(&str, &str)], out: &Path, weights: &str) -> (Vec<String>, Vec<u8>) {
    let mut cmd = bin();
    cmd.args(args).arg("--out").arg(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{args:?} {env:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let losses = records(out)
        .iter()
        .map(|r| r["loss"].to_string())
        .collect::<Vec<_>>();
    let bytes = std::fs::read(out.join(weights)).unwrap();
    (losses, bytes)
}

/// Every variant of `variants` (extra flags, environment) gives the first's
/// losses and weights, bit for bit.
/// Extra flags and environment variables of one run.
type Variant<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);

fn all_identical(base: &[&str], weights: &str, variants: &[Variant]) {
    let dir = tmp();
    let mut first: Option<(Vec<String>, Vec<u8>)> = None;
    for (i, (flags, env)) in variants.iter().enumerate() {
        let out = dir.path().join(i.to_string());
        let args = [base, flags].concat();
        let got = train(&args, env, &out, weights);
        assert_eq!(got.0.len(), 10, "{args:?}: ten steps logged");
        match &first {
            None => first = Some(got),
            Some(f) => {
                assert_eq!(f.0, got.0, "losses of {flags:?} {env:?}");
                assert!(f.1 == got.1, "{weights} of {flags:?} {env:?} differs");
            }
        }
    }
}

const STEPS: [&str; 8] = [
    "--steps",
    "10",
    "--eval-every",
    "0",
    "--lr",
    "1e-3",
    "--seq",
    "32",
];

/// LoRA on the simulated device: streamed or persistent buffers (also with
/// every kernel cut into two tiles, so a streamed buffer is refilled per
/// tile), checkpointing on or off.
#[test]
fn device_memory_settings_change_no_bit() {
    let base = common::tiny_base();
    let args = [
        &[
            "train",
            "--model",
            base.to_str().unwrap(),
            "--lora-rank",
            "8",
        ][..],
        &["--backend", "ane-sim"][..],
        &STEPS[..],
    ]
    .concat();
    let tiles: &[(&str, &str)] = &[("ANETRAIN_ANE_MIN_TILES", "2")];
    all_identical(
        &args,
        "adapter_model.safetensors",
        &[
            (&["--device-buffers", "persistent"], &[]),
            (&["--device-buffers", "streamed"], &[]),
            (
                &["--device-buffers", "persistent", "--grad-checkpoint"],
                &[],
            ),
            (&["--device-buffers", "streamed", "--grad-checkpoint"], &[]),
        ],
    );
    all_identical(
        &args,
        "adapter_model.safetensors",
        &[
            (&["--device-buffers", "persistent"], tiles),
            (
                &["--device-buffers", "streamed", "--grad-checkpoint"],
                tiles,
            ),
        ],
    );
}

/// The CPU engine: checkpointing on or off, for LoRA adapters and for a
/// full fine-tune (whose master weights are f32, not mapped).
#[test]
fn cpu_checkpointing_changes_no_bit() {
    let base = common::tiny_base();
    let model = base.to_str().unwrap();
    let lora = [
        &[
            "train",
            "--model",
            model,
            "--lora-rank",
            "8",
            "--backend",
            "cpu",
        ][..],
        &STEPS[..],
    ]
    .concat();
    all_identical(
        &lora,
        "adapter_model.safetensors",
        &[(&[], &[]), (&["--grad-checkpoint"], &[])],
    );
    let full = [
        &["train", "--model", model, "--backend", "cpu"][..],
        &STEPS[..],
    ]
    .concat();
    all_identical(
        &full,
        "model.safetensors",
        &[(&[], &[]), (&["--grad-checkpoint"], &[])],
    );
}

/// A plan over `--max-memory` fails in one line naming what would fit, and
/// leaves no run directory behind.
#[test]
fn a_run_over_max_memory_is_refused_before_anything_is_written() {
    let base = common::tiny_base();
    let dir = tmp();
    let out = dir.path().join("run");
    for backend in ["cpu", "ane-sim"] {
        let o = bin()
            .args([
                "train",
                "--model",
                base.to_str().unwrap(),
                "--lora-rank",
                "8",
            ])
            .args(["--backend", backend, "--max-memory", "1M", "--steps", "2"])
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        common::one_line_error(
            &o,
            backend,
            &["memory", "--max-memory", "kernels plan", "1 MB"],
        );
        assert!(!out.exists(), "{backend}: nothing written");
    }
    // A limit the plan fits in trains.
    let (losses, _) = train(
        &[
            "train",
            "--model",
            base.to_str().unwrap(),
            "--lora-rank",
            "8",
            "--max-memory",
            "20G",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ],
        &[],
        &out,
        "adapter_model.safetensors",
    );
    assert_eq!(losses.len(), 2);
}

/// `kernels plan` prints the memory plan by part, and as JSON; the part
/// sizes move with the settings as they should.
#[test]
fn kernels_plan_shows_the_memory_plan() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/configs/qwen3-0.6b.json"
    );
    let plan = |extra: &[&str]| -> serde_json::Value {
        let o = bin()
            .args([
                "kernels", "plan", "--model", config, "--seq", "256", "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let part = |v: &serde_json::Value, name: &str| -> u64 {
        let m = &v["memory"];
        m["resident"]
            .as_array()
            .unwrap()
            .iter()
            .chain(m["transient"].as_array().unwrap())
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no part {name}: {m}"))["bytes"]
            .as_u64()
            .unwrap()
    };
    let persistent = ["--device-buffers", "persistent"];
    let lora = plan(
        &[
            &["--lora-rank", "16", "--backend", "ane-sim"][..],
            &persistent,
        ]
        .concat(),
    );
    let ckpt = plan(
        &[
            &[
                "--lora-rank",
                "16",
                "--backend",
                "ane-sim",
                "--grad-checkpoint",
            ][..],
            &persistent,
        ]
        .concat(),
    );
    let streamed = plan(&[
        "--lora-rank",
        "16",
        "--backend",
        "ane-sim",
        "--device-buffers",
        "streamed",
    ]);
    let full = plan(&["--backend", "cpu"]);
    // A LoRA base is mapped in bf16 (no weights beside the config: the
    // published dtype); full training holds f32 masters.
    let bf16 = part(&lora, "base weights");
    assert!((bf16 as f64 - 1.19e9).abs() < 0.02e9, "{bf16}");
    let f32 = part(&full, "base weights") as f64;
    assert!((f32 / bf16 as f64 - 2.0).abs() < 0.01, "{f32} vs {bf16}");
    // The preset of that shape plans LoRA on the pretrained checkpoint it
    // stands for (bf16), not on f32 random weights `train` would refuse.
    let o = bin()
        .args([
            "kernels",
            "plan",
            "--model",
            "qwen3-0.6b",
            "--seq",
            "256",
            "--json",
        ])
        .args([
            "--lora-rank",
            "16",
            "--backend",
            "ane-sim",
            "--device-buffers",
            "persistent",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let preset: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(part(&preset, "base weights"), bf16);
    assert!(part(&ckpt, "activations") * 5 < part(&lora, "activations"));
    assert!(part(&streamed, "device buffers") * 10 < part(&lora, "device buffers"));
    assert_eq!(streamed["memory"]["device_buffers"], "streamed");
    assert!(full["memory"]
        .get("device_buffers")
        .is_none_or(|b| b.is_null()));
    // The text form: a part per line and the total.
    let o = bin()
        .args(["kernels", "plan", "--model", config, "--lora-rank", "16"])
        .args([
            "--grad-checkpoint",
            "--backend",
            "ane-sim",
            "--max-memory",
            "16G",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for needle in [
        "base weights",
        "bf16",
        "activations",
        "device buffers",
        "peak estimate",
        "within the limit of 16.00 GB",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}
