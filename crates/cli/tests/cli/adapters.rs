//! Adapters and their bases, end to end through the binary: an adapter is
//! refused on a base other than the one it names, a run starts from an
//! adapter (`--init-adapter`), and `merge` keeps the base's dtype and
//! never writes over files unasked.

use crate::common;

use std::path::{Path, PathBuf};

use anetrain::model::tensor_file;
use common::{bin, one_line_error, run, tiny_base, tmp};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A LoRA run of rank 4 on `base`, `steps` steps.
fn lora_run(base: &Path, out: &Path, steps: &str) {
    let args = [
        "train",
        "--model",
        s(base),
        "--lora-rank",
        "4",
        "--seq",
        "32",
    ];
    let rest = ["--steps", steps, "--eval-every", "0", "--backend", "cpu"];
    run(&[&args[..], &rest[..]].concat(), out);
}

/// `base` copied to `to`: the same tensors, another model as far as any
/// name says.
fn copy_model(base: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(base.join(f), to.join(f)).unwrap();
    }
    to.to_path_buf()
}

fn adapter_config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
        .unwrap()
}

/// An adapter names its base; every command that applies one refuses
/// another base of the same shapes in one line, and `--any-base` applies
/// it anyway. The base named by a relative path passes.
#[test]
fn an_adapter_is_refused_on_another_base() {
    let t = tmp();
    let base = tiny_base();
    let adapter = t.path().join("sft");
    lora_run(&base, &adapter, "2");
    assert_eq!(
        adapter_config(&adapter)["base_model_name_or_path"],
        s(&base.canonicalize().unwrap())
    );
    let other = copy_model(&base, &t.path().join("other"));
    let prompt = ["--prompt", "Once", "--max-tokens", "2", "--backend", "cpu"];
    let tokens = t.path().join("tokens.bin");
    let ids: Vec<u8> = (0u16..200).flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(&tokens, ids).unwrap();
    let eval = [
        "eval",
        "--backend",
        "cpu",
        "--seq",
        "32",
        "--data",
        s(&tokens),
    ];
    let out = t.path().join("merged");
    let gguf = t.path().join("m.gguf");
    let commands: Vec<Vec<&str>> = vec![
        eval.to_vec(),
        [&["generate"][..], &prompt[..]].concat(),
        vec!["merge", "--out", s(&out)],
        vec!["export", "gguf", "--out", s(&gguf)],
    ];
    for c in &commands {
        let with = |model: &Path, extra: &[&str]| {
            bin()
                .args(c)
                .args(["--model", s(model), "--adapter", s(&adapter)])
                .args(extra)
                .output()
                .unwrap()
        };
        one_line_error(
            &with(&other, &[]),
            &format!("{c:?}"),
            &[
                "adapter",
                "was trained on",
                s(&base.canonicalize().unwrap()),
                "--any-base",
            ],
        );
        let o = with(&other, &["--any-base"]);
        assert!(
            o.status.success(),
            "{c:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_file(&gguf);
    }
    // The base itself, named relative to the working directory: fine.
    let o = bin()
        .current_dir(base.parent().unwrap())
        .args(eval)
        .arg("--model")
        .arg(base.file_name().unwrap())
        .args(["--adapter", s(&adapter)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Starting a run from it checks the same.
    let o = bin()
        .args(["train", "--model", s(&other), "--init-adapter", s(&adapter)])
        .args(["--out", s(&t.path().join("never"))])
        .output()
        .unwrap();
    one_line_error(
        &o,
        "train --init-adapter",
        &["was trained on", "--any-base"],
    );
}

/// `--init-adapter` starts from the adapter's weights and configuration
/// (with a vanishing learning rate the first step leaves them as they
/// were), resumes as any run, and `train --adapter` says what to use.
#[test]
fn a_run_starts_from_an_adapter() {
    let t = tmp();
    let base = tiny_base();
    let sft = t.path().join("sft");
    lora_run(&base, &sft, "3");
    let next = t.path().join("next");
    let args = ["train", "--model", s(&base), "--init-adapter", s(&sft)];
    let rest = ["--seq", "32", "--eval-every", "0", "--backend", "cpu"];
    run(
        &[&args[..], &rest[..], &["--steps", "1", "--lr", "1e-30"][..]].concat(),
        &next,
    );
    let read = |d: &Path| tensor_file::read(&d.join("adapter_model.safetensors")).unwrap();
    assert_eq!(read(&next), read(&sft));
    let (a, b) = (adapter_config(&next), adapter_config(&sft));
    for k in [
        "r",
        "lora_alpha",
        "target_modules",
        "base_model_name_or_path",
    ] {
        assert_eq!(a[k], b[k], "{k}");
    }
    // A fresh adapter's B is zero: a fresh run's adapter differs.
    let fresh = t.path().join("fresh");
    run(
        &[
            &["train", "--model", s(&base), "--lora-rank", "4"][..],
            &rest[..],
            &["--steps", "1", "--lr", "1e-30"][..],
        ]
        .concat(),
        &fresh,
    );
    assert_ne!(read(&fresh), read(&sft));
    // It resumes like any run (the flag repeated, the learning rate too).
    run(
        &[
            &args[..],
            &rest[..],
            &["--resume", "--steps", "2", "--lr", "1e-30"][..],
        ]
        .concat(),
        &next,
    );
    let o = bin()
        .args(["train", "--model", s(&base), "--adapter", s(&sft)])
        .output()
        .unwrap();
    one_line_error(&o, "train --adapter", &["--init-adapter", s(&sft)]);
    let o = bin()
        .args(["train", "--model", s(&base), "--init-adapter", s(&sft)])
        .args(["--lora-rank", "8"])
        .output()
        .unwrap();
    one_line_error(&o, "--init-adapter with --lora-rank", &["--lora-rank"]);
}

/// `merge` writes the base's dtype (bf16 stays bf16, each value the f32
/// merge rounded), `--dtype` overrides it, and a directory that holds
/// files is written only with `--force`.
#[test]
fn merge_keeps_the_base_dtype_and_asks_before_overwriting() {
    let t = tmp();
    let base = tiny_base();
    let adapter = t.path().join("sft");
    lora_run(&base, &adapter, "2");
    let merge = |model: &Path, adapter: &Path, out: &Path, extra: &[&str]| {
        bin()
            .args(["merge", "--model", s(model), "--adapter", s(adapter)])
            .args(["--out", s(out)])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = |o: std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let weights = |d: &Path| tensor_file::read(&d.join("model.safetensors")).unwrap();
    let dtype = |d: &Path| {
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        c["torch_dtype"].as_str().unwrap().to_string()
    };
    // An f32 base merges to f32, or to bf16 when asked.
    let f32_out = t.path().join("m32");
    ok(merge(&base, &adapter, &f32_out, &[]));
    assert_eq!(dtype(&f32_out), "float32");
    let bf16 = t.path().join("m16");
    ok(merge(&base, &adapter, &bf16, &["--dtype", "bf16"]));
    assert_eq!(dtype(&bf16), "bfloat16");
    let (w32, w16) = (weights(&f32_out), weights(&bf16));
    for (name, t32) in &w32 {
        let t16 = &w16[name];
        assert_eq!(t16.dtype, "BF16", "{name}");
        let rounded: Vec<f32> = t32
            .data
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(t16.data, rounded, "{name}");
    }
    // A bf16 base's adapter merges to bf16 unasked: the base's dtype.
    let adapter16 = t.path().join("sft16");
    lora_run(&bf16, &adapter16, "2");
    let out = t.path().join("out16");
    ok(merge(&bf16, &adapter16, &out, &[]));
    assert_eq!(dtype(&out), "bfloat16");
    assert!(weights(&out).values().all(|t| t.dtype == "BF16"));
    let size = std::fs::metadata(out.join("model.safetensors"))
        .unwrap()
        .len();
    let size32 = std::fs::metadata(f32_out.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(size as f64 <= 0.51 * size32 as f64, "{size} vs {size32}");
    // Over existing files: refused, then written with --force.
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    one_line_error(
        &merge(&bf16, &adapter16, &out, &["--dtype", "f32"]),
        "merge over files",
        &["already holds files", "--force"],
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    ok(merge(
        &bf16,
        &adapter16,
        &out,
        &["--dtype", "f32", "--force"],
    ));
    assert_eq!(dtype(&out), "float32");
    one_line_error(
        &merge(&bf16, &adapter16, &out.join("config.json"), &[]),
        "merge into a file",
        &["is a file"],
    );
}

/// mlx-lm names an adapter's base under `model`: another base is refused
/// as for a PEFT adapter. A quantized copy of the base (`anetrain
/// quantize`, which records its source) is that base: the SFT adapter
/// applies to it, and starts a QLoRA run from it.
#[test]
fn mlx_lm_bases_and_quantized_copies_are_checked() {
    let t = tmp();
    let base = tiny_base();
    let adapter = t.path().join("sft");
    lora_run(&base, &adapter, "2");
    let mlx = t.path().join("mlx-adapter");
    std::fs::create_dir_all(&mlx).unwrap();
    for f in std::fs::read_dir(&adapter).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, mlx.join(f.file_name().unwrap())).unwrap();
        }
    }
    let mut cfg = adapter_config(&mlx);
    let named = cfg
        .as_object_mut()
        .unwrap()
        .remove("base_model_name_or_path")
        .unwrap();
    cfg["model"] = named;
    std::fs::write(mlx.join("adapter_config.json"), cfg.to_string()).unwrap();
    let other = copy_model(&base, &t.path().join("other"));
    let generate = |model: &Path, adapter: &Path| {
        bin()
            .args([
                "generate",
                "--prompt",
                "Once",
                "--max-tokens",
                "2",
                "--backend",
                "cpu",
            ])
            .args(["--model", s(model), "--adapter", s(adapter)])
            .output()
            .unwrap()
    };
    one_line_error(
        &generate(&other, &mlx),
        "an mlx-lm adapter on another base",
        &["was trained on", "--any-base"],
    );
    let o = generate(&base, &mlx);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let quantized = t.path().join("q4");
    let o = bin()
        .args([
            "quantize",
            "--model",
            s(&base),
            "--bits",
            "4",
            "--group-size",
            "32",
        ])
        .args(["--out", s(&quantized)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = generate(&quantized, &adapter);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = bin()
        .args([
            "train",
            "--model",
            s(&quantized),
            "--init-adapter",
            s(&adapter),
        ])
        .args([
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ])
        .args(["--out", s(&t.path().join("qlora"))])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
