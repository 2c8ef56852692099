//! `anetrain quantize` and quantized bases through the binary: the files
//! mlx-lm's `convert -q` writes (testdata/mlx, `scripts/make_mlx_fixtures.py`),
//! LoRA on them on both engines, and what is refused.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anetrain::model::tensor_file::{self, Mapped};
use common::{bin, one_line_error, tmp};

fn testdata(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata")
        .join(p)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every tensor of a safetensors file as its dtype's name, shape and raw
/// bytes.
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    tensor_file::map(path)
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let entry = match t {
                Mapped::Values(shape, st) => {
                    let bytes = st.file_bytes();
                    let raw = st.map[st.start..st.start + bytes].to_vec();
                    (st.dtype.name().to_string(), shape, raw)
                }
                Mapped::Words(shape, map, start) => {
                    let n = shape.iter().product::<usize>() * 4;
                    ("u32".to_string(), shape, map[start..start + n].to_vec())
                }
            };
            (name, entry)
        })
        .collect()
}

/// The same tensors, byte for byte, as `mlx_lm.convert -q` wrote for the
/// same source, widths and dtypes; the config says how.
#[test]
fn quantize_writes_what_mlx_lm_writes() {
    let t = tmp();
    for (variant, bits, group, dtype) in [
        ("q4-g32-f32", "4", "32", "f32"),
        ("q3-g32-bf16", "3", "32", "bf16"),
    ] {
        let out = t.path().join(variant);
        let o = bin()
            .args(["quantize", "--model", s(&testdata("chat/model"))])
            .args([
                "--bits",
                bits,
                "--group-size",
                group,
                "--dtype",
                dtype,
                "--out",
                s(&out),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let ours = tensors(&out.join("model.safetensors"));
        let theirs = tensors(&testdata(&format!("mlx/{variant}/model.safetensors")));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>()
        );
        for (name, t) in &theirs {
            assert!(ours[name] == *t, "{variant} {name} differs from mlx-lm's");
        }
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["quantization"]["bits"], bits.parse::<u32>().unwrap());
        assert_eq!(cfg["quantization_config"], cfg["quantization"]);
    }
    // Over files, already quantized, a width mlx lacks: one line each.
    let out = t.path().join("q4-g32-f32");
    let quantize = |model: &Path, extra: &[&str]| {
        bin()
            .args(["quantize", "--model", s(model), "--out", s(&out)])
            .args(extra)
            .output()
            .unwrap()
    };
    one_line_error(
        &quantize(&testdata("chat/model"), &[]),
        "over files",
        &["already holds files", "--force"],
    );
    one_line_error(
        &quantize(&out, &["--force"]),
        "quantized twice",
        &["already quantized"],
    );
    one_line_error(
        &quantize(&testdata("chat/model"), &["--force", "--bits", "7"]),
        "7 bits",
        &["7-bit", "2, 3, 4, 5, 6 or 8"],
    );
}

/// LoRA trains on a quantized base on the CPU engine and the simulated
/// Neural Engine, and their losses agree; full fine-tuning is refused;
/// `merge` writes the dequantized base in its scales' dtype and says that
/// quantizing it again loses accuracy.
#[test]
fn lora_trains_on_a_quantized_base() {
    let t = tmp();
    let base = testdata("mlx/q4-g32-f32");
    let tok = testdata("chat/model/tokenizer.json");
    let data = testdata("chat/data/chat");
    let train = |backend: &str, out: &Path, extra: &[&str]| {
        bin()
            .args([
                "train",
                "--model",
                s(&base),
                "--tokenizer",
                s(&tok),
                "--data",
                s(&data),
            ])
            .args([
                "--steps",
                "4",
                "--seq",
                "64",
                "--eval-every",
                "0",
                "--backend",
                backend,
            ])
            .args(["--out", s(out)])
            .args(extra)
            .output()
            .unwrap()
    };
    let losses = |out: &Path| -> Vec<f64> {
        common::records(out)
            .iter()
            .filter_map(|r| r["loss"].as_f64())
            .collect()
    };
    let (cpu, sim) = (t.path().join("cpu"), t.path().join("sim"));
    for (backend, out) in [("cpu", &cpu), ("ane-sim", &sim)] {
        let o = train(backend, out, &["--lora-rank", "4", "--lr", "1e-2"]);
        assert!(
            o.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let (a, b) = (losses(&cpu), losses(&sim));
    assert_eq!(a.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 2e-2 * x.abs(),
            "cpu {a:?} vs ane-sim {b:?}"
        );
    }
    assert!(a[3] < a[0], "{a:?}");
    // The run is mlx-lm's adapter too; mlx-lm's adapter continues here.
    assert!(cpu.join("adapters.safetensors").is_file());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cpu.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["lora_parameters"]["rank"], 4);
    assert_eq!(cfg["lora_parameters"]["scale"], 2.0);
    let mlx = testdata("mlx/adapter");
    let o = train("cpu", &t.path().join("more"), &["--init-adapter", s(&mlx)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let more: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(t.path().join("more/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(more["r"], 8);
    assert_eq!(more["lora_parameters"]["scale"], 20.0);
    one_line_error(
        &train("cpu", &t.path().join("full"), &[]),
        "full fine-tuning",
        &["quantized", "--lora-rank"],
    );
    let merged = t.path().join("merged");
    let o = bin()
        .args([
            "merge",
            "--model",
            s(&base),
            "--adapter",
            s(&cpu),
            "--out",
            s(&merged),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("4-bit quantized") && err.contains("loses accuracy"),
        "{err}"
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["torch_dtype"], "float32");
    assert!(cfg.get("quantization").is_none(), "{cfg}");
}

/// QLoRA on the simulated Neural Engine is as exact as LoRA: streamed and
/// persistent device buffers give the same adapter bit for bit, and a run
/// stopped and resumed ends with the adapter of one that was not (a
/// quantized checkpoint, and a bf16 base quantized on load).
#[test]
fn qlora_buffers_and_resume_are_exact() {
    let t = tmp();
    let tok = testdata("chat/model/tokenizer.json");
    let data = testdata("chat/data/text");
    let flags = |base: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "train",
            "--model",
            s(base),
            "--tokenizer",
            s(&tok),
            "--data",
            s(&data),
        ]
        .map(String::from)
        .to_vec();
        a.extend(
            [
                "--lora-rank",
                "4",
                "--seq",
                "64",
                "--eval-every",
                "0",
                "--backend",
                "ane-sim",
                "--lr",
                "1e-2",
                // A constant learning rate, so runs of different --steps
                // share a schedule.
                "--warmup",
                "0",
                "--min-lr-frac",
                "1",
            ]
            .map(String::from),
        );
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let run = |args: Vec<String>, out: &Path| {
        let o = bin().args(&args).arg("--out").arg(out).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let adapter = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    let q4 = testdata("mlx/q4-g32-f32");
    let llama = testdata("mlx/llama-source");
    for (name, base, extra) in [
        ("q4", &q4, &[][..]),
        ("otf", &llama, &["--quantize-base", "4"][..]),
    ] {
        let dir = t.path().join(name);
        let with = |more: &[&str]| flags(base, &[extra, more].concat());
        run(
            with(&["--steps", "6", "--device-buffers", "streamed"]),
            &dir.join("streamed"),
        );
        run(
            with(&["--steps", "6", "--device-buffers", "persistent"]),
            &dir.join("persistent"),
        );
        assert!(
            adapter(&dir.join("streamed")) == adapter(&dir.join("persistent")),
            "{name}: streamed and persistent buffers differ"
        );
        let streamed = |n: &str| with(&["--steps", n, "--device-buffers", "streamed"]);
        let runs = common::resume_runs(&dir.join("resume"), streamed, "3", "6");
        runs.assert_same("adapter_model.safetensors");
        assert!(
            adapter(&runs.straight) == adapter(&dir.join("streamed")),
            "{name}: the straight streamed runs differ"
        );
    }
}

/// A quantized base plans streamed device buffers by default, below the
/// persistent plan (whose buffers would hold its weights again as fp16
/// copies); a run refused for memory on a plain base names
/// `--quantize-base 4` when the quantized base would fit.
#[test]
fn quantized_bases_stream_and_memory_refusals_offer_quantize_base() {
    let d = tmp();
    let base = common::tiny_base();
    let q4 = d.path().join("q4");
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
        .args(["--out", s(&q4)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan = |model: &Path, extra: &[&str]| {
        let o = bin()
            .args(["kernels", "plan", "--model", s(model), "--lora-rank", "8"])
            .args(["--seq", "256", "--backend", "ane-sim", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (
            v["memory"]["total"].as_u64().unwrap(),
            v["memory"]["device_buffers"].as_str().unwrap().to_owned(),
        )
    };
    let (streamed, mode) = plan(&q4, &[]);
    assert_eq!(mode, "streamed");
    let (persistent, _) = plan(&q4, &["--device-buffers", "persistent"]);
    assert!(streamed < persistent, "{streamed} vs {persistent}");
    // The plain base over a limit a quantized copy fits under (1% above
    // the 4-bit plan: `--quantize-base 4` groups by 64, a little smaller).
    let (plain, _) = plan(&base, &[]);
    assert!(streamed < plain, "{streamed} vs {plain}");
    let limit = format!("{}B", streamed + streamed / 100);
    let out = d.path().join("refused");
    let o = bin()
        .args([
            "train",
            "--model",
            s(&base),
            "--lora-rank",
            "8",
            "--seq",
            "256",
            "--steps",
            "1",
        ])
        .args([
            "--backend",
            "ane-sim",
            "--max-memory",
            &limit,
            "--out",
            s(&out),
        ])
        .output()
        .unwrap();
    common::one_line_error(
        &o,
        "a run over the limit",
        &["would fit:", "--quantize-base 4"],
    );
}
