//! MLX-quantized checkpoints against mlx itself (fixtures by
//! `scripts/make_mlx_fixtures.py`: `mlx_lm.convert -q` of the chat test
//! model in six widths, group sizes and dtypes, one with mlx-lm's mixed
//! 3/6-bit recipe): the dequantized matrices equal `mx.dequantize`'s bit
//! for bit, the logits track mlx-lm's model, and quantizing the source
//! weights gives the very words, scales and biases mlx-lm wrote.

use crate::common;

use std::path::PathBuf;

use anetrain::engine::Engine;
use anetrain::model::dtype::round_to;
use anetrain::model::dtype::StoredDtype;
use anetrain::model::quant::quantize;
use anetrain::model::tensor_file::{self, Mapped};
use anetrain::model::Model;

/// The float tensors of a mapped file, in f32.
fn float_values(
    mapped: &std::collections::BTreeMap<String, Mapped>,
) -> std::collections::BTreeMap<String, Vec<f32>> {
    mapped
        .iter()
        .filter_map(|(name, t)| match t {
            Mapped::Values(_, s) => {
                let mut v = vec![0f32; s.len];
                s.convert(0..s.len, &mut v);
                Some((name.clone(), v))
            }
            Mapped::Words(..) => None,
        })
        .collect()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("mlx/expected.json")).unwrap())
        .unwrap()
}

/// The sequence the fixtures' logits were computed on.
fn tokens() -> Vec<u32> {
    expected()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn variants() -> Vec<String> {
    expected()["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

/// The checkpoint dtype of a variant (named in its directory name).
fn dtype_of(variant: &str) -> StoredDtype {
    match variant.rsplit('-').next().unwrap() {
        "f32" => StoredDtype::F32,
        "bf16" => StoredDtype::BF16,
        "f16" => StoredDtype::F16,
        d => panic!("{d}"),
    }
}

#[test]
fn quantized_matrices_dequantize_as_mlx_does() {
    for v in variants() {
        let dir = root().join("mlx").join(&v);
        let model = Model::load_frozen(&dir).unwrap();
        let want = tensor_file::read(&dir.join("expected.safetensors")).unwrap();
        let mut checked = 0;
        for (name, t) in &want {
            let Some(module) = name.strip_suffix(".dequantized") else {
                continue;
            };
            let p = model
                .params
                .iter()
                .find(|p| p.name == format!("{module}.weight"))
                .unwrap();
            assert!(p.stored.as_ref().unwrap().affine.is_some(), "{v} {module}");
            let got = p.values();
            assert_eq!(got.len(), t.data.len());
            let differ = got.iter().zip(&t.data).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "{v} {module}: {differ} values differ from mx.dequantize"
            );
            checked += 1;
        }
        assert!(checked >= 1, "{v}");
        // The base counts at its quantized size.
        let (bytes, _) = model.stored_bytes().unwrap();
        let file = std::fs::metadata(dir.join("model.safetensors"))
            .unwrap()
            .len() as usize;
        assert!(bytes < file, "{v}: {bytes} stored bytes, file {file}");
    }
}

/// The same quantized model (its weights dequantized by mlx, run in f32:
/// `dequantize_model`) and our CPU engine: equal to f32 rounding (1e-5 of
/// the logits' range; measured ≤ 1.4e-6); the simulated Neural Engine
/// within its fp16 bound (3e-2). mlx-lm's own forward computes in the
/// checkpoint's dtype: f32 checkpoints agree as closely; bf16 and f16
/// ones round every activation to 8 or 11 bits, which moves their logits
/// by up to 0.14 of the range on these 2-layer models (measured 4.1e-2 to
/// 0.135 for bf16, 6.6e-3 for f16): ours may differ from that forward by
/// as much as mlx's own f32 forward does, and 1e-5 more.
#[test]
fn logits_track_mlx_lm() {
    let tokens = tokens();
    for v in variants() {
        let dir = root().join("mlx").join(&v);
        let model = Model::load_frozen(&dir).unwrap();
        let want = tensor_file::read(&dir.join("expected.safetensors")).unwrap();
        let mut eng = Engine::cpu(&model);
        let fwd = eng.forward(&model, &tokens, None).unwrap();
        let got = eng.logits(&model, &fwd.xf).unwrap();
        let rel = |got: &[f32], w: &[f32]| common::max_diff(got, w) / common::max_abs(w);
        let f32_rel = rel(&got, &want["logits_f32"].data);
        let native_rel = rel(&got, &want["logits"].data);
        // The simulated Neural Engine (fp16) on the same quantized base.
        let mut sim = Engine::neural(&model, ane::SimDevice::new());
        let fwd = sim.forward(&model, &tokens, None).unwrap();
        let sim_rel = rel(
            &sim.logits(&model, &fwd.xf).unwrap(),
            &want["logits_f32"].data,
        );
        let bound = rel(&want["logits_f32"].data, &want["logits"].data) + 1e-5;
        eprintln!(
            "{v}: logits vs mlx in f32 {f32_rel:.2e}, vs mlx-lm's quantized model {native_rel:.2e}, ane-sim {sim_rel:.2e}"
        );
        assert!(sim_rel <= 3e-2, "{v}: ane-sim {sim_rel:e}");
        assert!(f32_rel <= 1e-5, "{v}: {f32_rel:e}");
        assert!(native_rel <= bound, "{v}: {native_rel:e} (bound {bound:e})");
    }
}

/// The source weights, in the variant's dtype, quantized module by module
/// with the spec its config.json names: the same words, scales and biases
/// `mlx_lm.convert -q` wrote; what it left unquantized, the same values.
#[test]
fn quantizing_gives_the_words_mlx_lm_wrote() {
    for v in variants() {
        let from = expected()["sources"][&v].as_str().unwrap().to_string();
        let source = tensor_file::read(&root().join(from).join("model.safetensors")).unwrap();
        let dir = root().join("mlx").join(&v);
        let dtype = dtype_of(&v);
        let cfg =
            anetrain::model::config::ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let q = cfg.quantization.unwrap();
        let written = tensor_file::map(&dir.join("model.safetensors")).unwrap();
        let floats = float_values(&written);
        let mut quantized = 0;
        for (name, t) in &source {
            let w: Vec<f32> = t.data.iter().map(|x| round_to(*x, dtype)).collect();
            let module = name.strip_suffix(".weight").unwrap_or(name);
            if floats.contains_key(&format!("{module}.scales")) {
                let spec = q.of(module).unwrap();
                let cols = t.shape[1];
                let ours = quantize(&w, cols, spec, dtype);
                let Mapped::Words(shape, map, start) = &written[name] else {
                    panic!("{v} {name}: not packed");
                };
                let bytes = &map[*start..*start + shape[0] * shape[1] * 4];
                let words: Vec<u32> = bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let first = ours.packed.iter().zip(&words).position(|(a, b)| a != b);
                assert!(
                    ours.packed == words,
                    "{v} {name}: packed words differ (first at {first:?} of {}: {:?} vs {:?})",
                    words.len(),
                    first.map(|i| ours.packed[i]),
                    first.map(|i| words[i])
                );
                assert_eq!(
                    ours.scales,
                    floats[&format!("{module}.scales")],
                    "{v} {name}"
                );
                assert_eq!(
                    ours.biases,
                    floats[&format!("{module}.biases")],
                    "{v} {name}"
                );
                quantized += 1;
            } else {
                assert_eq!(floats[name], w, "{v} {name}: unquantized values");
            }
        }
        assert!(quantized >= 8, "{v}: {quantized} modules quantized");
    }
}

/// The point of a quantized base: Qwen3-8B in 4 bits (mlx-community's
/// Qwen3-8B-4bit shape: groups of 64, bf16 scales) with LoRA rank 16 and
/// `--grad-checkpoint` plans within a 16 GB Mac's memory up to 2048 tokens
/// on the Neural Engine path, its base counted at its quantized size (a
/// plan estimate: no 8B run was measured here). The bf16 base alone would
/// be 16.4 GB.
#[test]
fn an_8b_4bit_base_plans_within_16_gb() {
    use anetrain::device::backend::Backend;
    use anetrain::model::lora::LoraConfig;
    use anetrain::model::source::ModelSource;
    use anetrain::plan::memory::{MemoryOptions, RunPlan};
    let path = root().join("configs/qwen3-8b-4bit.json");
    let source = ModelSource::resolve(path.to_str().unwrap()).unwrap();
    let lora = LoraConfig {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        targets: anetrain::model::Projection::ALL.to_vec(),
        rslora: false,
        layers: None,
    };
    let memory = MemoryOptions {
        grad_checkpoint: true,
        device_buffers: None,
        max_memory: Some(16_000_000_000),
    };
    let run = RunPlan::new(&source, 2048, Some(&lora), Backend::AneSim, &memory, None).unwrap();
    let base = run
        .plan
        .resident
        .iter()
        .find(|p| p.name == "base weights")
        .unwrap()
        .bytes;
    eprintln!(
        "Qwen3-8B 4-bit LoRA r16 at 2048: base {base}, peak {}",
        run.plan.total
    );
    assert!(base < 5_000_000_000, "{base}");
    assert!(run.plan.total < 16_000_000_000, "{}", run.plan.total);
}

/// An adapter trained by mlx-lm (`mlx_lm.lora` on the 4-bit base, every
/// layer, rank 8, scale 20; `scripts/make_mlx_adapter_fixture.py`) loads
/// from mlx-lm's layout, and the model with it gives mlx-lm's logits to f32
/// rounding (1e-5 of the range).
#[test]
fn an_mlx_lm_adapter_gives_mlx_lms_logits() {
    let tokens = tokens();
    let dir = root().join("mlx/adapter");
    let mut model = Model::load_frozen(&root().join("mlx/q4-g32-f32")).unwrap();
    let lora = anetrain::model::lora::Lora::load(&model.cfg, &dir).unwrap();
    assert_eq!(lora.cfg.rank, 8);
    assert!(
        (lora.cfg.scale() - 20.0).abs() < 1e-12,
        "{}",
        lora.cfg.scale()
    );
    model.lora = Some(lora);
    let want = &tensor_file::read(&dir.join("expected.safetensors")).unwrap()["logits"];
    let mut eng = Engine::cpu(&model);
    let fwd = eng.forward(&model, &tokens, None).unwrap();
    let got = eng.logits(&model, &fwd.xf).unwrap();
    let rel = common::max_diff(&got, &want.data) / common::max_abs(&want.data);
    eprintln!("mlx-lm adapter: logits vs mlx-lm {rel:.2e}");
    assert!(rel <= 1e-5, "{rel:e}");
    // Its adapters do change the logits: the comparison can fail.
    model.lora = None;
    let mut eng = Engine::cpu(&model);
    let fwd = eng.forward(&model, &tokens, None).unwrap();
    let plain = eng.logits(&model, &fwd.xf).unwrap();
    assert!(common::max_diff(&plain, &want.data) / common::max_abs(&want.data) > 1e-3);
}

/// `--quantize-base` on a bf16 checkpoint (the fixture Llama): the frozen
/// matrices quantized in memory are the very words, scales and biases
/// `mlx_lm.convert -q` wrote for it (4-bit groups of 64, 8-bit groups of
/// 32), and dequantize as they do.
#[test]
fn quantizing_on_load_gives_mlx_lms_base() {
    use anetrain::model::quant::QuantSpec;
    let source = root().join("mlx/llama-source");
    for (v, bits, group) in [("llama-q4-g64-bf16", 4, 64), ("llama-q8-g32-bf16", 8, 32)] {
        let mut ours = Model::load_frozen(&source).unwrap();
        ours.quantize_frozen(QuantSpec::new(bits, group).unwrap())
            .unwrap();
        let theirs = Model::load_frozen(&root().join("mlx").join(v)).unwrap();
        let mut quantized = 0;
        for (a, b) in ours.params.iter().zip(&theirs.params) {
            assert_eq!(a.name, b.name);
            let (Some(sa), Some(sb)) = (&a.stored, &b.stored) else {
                assert_eq!(a.data, b.data, "{v} {}", a.name);
                continue;
            };
            assert_eq!(sa.affine.is_some(), sb.affine.is_some(), "{v} {}", a.name);
            if let (Some(qa), Some(qb)) = (&sa.affine, &sb.affine) {
                assert_eq!(qa.spec, qb.spec, "{v} {}", a.name);
                let bytes = sa.file_bytes() - qa.scales.file_bytes() - qa.biases.file_bytes();
                assert!(
                    sa.map[sa.start..sa.start + bytes] == sb.map[sb.start..sb.start + bytes],
                    "{v} {}: words",
                    a.name
                );
                quantized += 1;
            }
            assert!(a.values() == b.values(), "{v} {}: values", a.name);
        }
        assert_eq!(quantized, 16, "{v}");
        assert_eq!(
            ours.cfg.quantization,
            theirs.cfg.quantization.map(|mut q| {
                q.modules.clear();
                q
            })
        );
    }
}
