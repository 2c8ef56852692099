//! Parity with Hugging Face `transformers` on the committed fixtures
//! (`scripts/make_fixtures.py`): logits and loss (1e-5 relative), every
//! parameter gradient (1e-4 of its largest entry), one AdamW step (1e-6
//! absolute), and loading errors.

use crate::common;

use common::{fixture, max_abs, max_diff, tokens};

use std::path::Path;

use anetrain::engine::{zero_grads, Engine};
use anetrain::model::Model;
use anetrain::train::optim::{AdamW, AdamWConfig};
use anetrain::train::step;

fn json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("fixture.json")).unwrap()).unwrap()
}

#[test]
fn logits_loss_and_gradients_match_transformers() {
    for kind in common::FAMILIES {
        let dir = fixture(kind);
        let model = Model::load(&dir.join("model")).unwrap();
        let rows = tokens(&dir);
        let mut eng = Engine::cpu(&model);
        // logits
        let want = npy::read(&dir.join("logits.npy")).unwrap();
        let npy::NpyData::Float(want) = want.data else {
            panic!()
        };
        let v = model.cfg.vocab_size;
        for (b, row) in rows.iter().enumerate() {
            let n = row.len() - 1;
            let fwd = eng.forward(&model, &row[..n], None).unwrap();
            let got = eng.logits(&model, &fwd.xf).unwrap();
            let w = &want[b * n * v..(b + 1) * n * v];
            let rel = max_diff(&got, w) / max_abs(w);
            eprintln!("{kind} row {b}: logits rel err {rel:.2e}");
            assert!(rel <= 1e-5, "{kind}: logits rel err {rel:e}");
        }
        // loss and gradients
        let mut grads = zero_grads(&model);
        let (loss, _) = common::batch_loss(&mut eng, &model, &rows, Some(&mut grads)).unwrap();
        let want_loss = json(&dir)["loss"].as_f64().unwrap();
        assert!(
            ((loss - want_loss) / want_loss).abs() <= 1e-5,
            "{kind}: loss {loss} vs {want_loss}"
        );
        let want_g = anetrain::model::tensor_file::read(&dir.join("grads.safetensors")).unwrap();
        let ours: Vec<Vec<f32>> = grads.iter().cloned().collect();
        for (name, g) in common::hf_layout(&model, &ours) {
            // tied: transformers reports the embedding gradient once
            let w = &want_g[&name].data;
            let rel = max_diff(&g, w) / max_abs(w);
            assert!(rel <= 1e-4, "{kind}: gradient of {name} rel err {rel:e}");
        }
        // one AdamW step
        let j = json(&dir);
        let cfg = AdamWConfig {
            beta1: j["beta1"].as_f64().unwrap(),
            beta2: j["beta2"].as_f64().unwrap(),
            eps: j["eps"].as_f64().unwrap(),
            weight_decay: j["weight_decay"].as_f64().unwrap(),
        };
        // Use transformers' own gradients so the check isolates the optimizer.
        let hf_grads = common::per_param(&model, &want_g);
        let mut m2 = model.clone();
        let mut opt = AdamW::new(&m2, cfg);
        // The trainer's update (no clipping, no loss scale).
        let u = step::apply_update(
            &mut m2,
            &mut opt,
            &hf_grads.into(),
            0.0,
            1.0,
            0.0,
            j["lr"].as_f64().unwrap(),
        );
        assert!(u.finite);
        let after = anetrain::model::tensor_file::read(&dir.join("adamw.safetensors")).unwrap();
        // (As Hugging Face stores them: Gemma's norms without their offset,
        // Phi-3's projections fused.)
        for t in m2.hf_tensors() {
            let d = max_diff(&m2.hf_tensor_values(&t), &after[&t.name].data);
            assert!(
                d <= 1e-6,
                "{kind}: AdamW update of {} differs by {d:e}",
                t.name
            );
        }
    }
}

/// DPO (sigmoid, IPO) and ORPO through the library's one step, as the
/// SFT test above runs it: the fixture's adapter on the chat model, TRL's
/// runs (`testdata/preference/runs.json`, `scripts/make_preference_fixtures.py`:
/// both training pairs each step, AdamW at a constant 5e-3, no weight
/// decay, clipping at 1, fp32 on the CPU), five steps and the validation
/// pairs after them: every logged metric within 1e-4 relative of TRL's
/// (f32 both sides; measured worst 4.8e-5, IPO's loss near its minimum).
#[test]
fn dpo_and_orpo_steps_equal_trl_through_the_library() {
    use anetrain::data::preference::{self, Tokenization};
    use anetrain::train::objective::{DpoLoss, Objective};
    use anetrain::train::reference::Reference;
    use anetrain::train::step::{Batch, Loss, StepOptions};

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
    let dir = root.join("preference");
    let runs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("runs.json")).unwrap()).unwrap();
    let tok = anetrain::data::tokenizer::Tokenizer::load(&root.join("chat/model/tokenizer.json"))
        .unwrap();
    for r in runs["runs"].as_array().unwrap() {
        let objective = match (r["objective"].as_str().unwrap(), r["loss"].as_str()) {
            ("orpo", _) => Objective::Orpo { lambda: 0.1 },
            (_, loss) => Objective::Dpo {
                loss: match loss {
                    Some("ipo") => DpoLoss::Ipo,
                    _ => DpoLoss::Sigmoid,
                },
                beta: 0.1,
                precompute_ref: false,
            },
        };
        let how = match objective {
            Objective::Orpo { .. } => Tokenization::Orpo,
            _ => Tokenization::Dpo,
        };
        let data = dir.join("data").join(r["data"].as_str().unwrap());
        let pairs = |file: &str| {
            let read = preference::read_file(&data.join(file), &tok, how).unwrap();
            Batch::Pairs(preference::fit(read, 511).pairs)
        };
        let (train, val) = (pairs("train.jsonl"), pairs("valid.jsonl"));
        let mut model = Model::load(&root.join("chat/model")).unwrap();
        model.lora =
            Some(anetrain::model::lora::Lora::load(&model.cfg, &dir.join("adapter")).unwrap());
        let mut loss = Loss::new(objective, Reference::of(&model, &objective));
        let adamw = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = AdamW::new(&model, adamw);
        let mut grads = zero_grads(&model);
        let mut eng = Engine::cpu(&model);
        let o = StepOptions {
            lr: 5e-3,
            clip: 1.0,
            loss_scale: 1.0,
            dropout: None,
        };
        let check = |at: &str, want: &serde_json::Value, got: &step::BatchLoss| {
            let mut have = got.preference.unwrap().json();
            have.insert("loss".into(), serde_json::json!(got.loss));
            for (k, w) in want.as_object().unwrap() {
                let (Some(w), Some(h)) = (w.as_f64(), have.get(k).and_then(|h| h.as_f64())) else {
                    continue;
                };
                assert!(
                    (h - w).abs() <= 1e-4 * w.abs().max(1e-3),
                    "{objective:?} on {}, {at}: {k} {h} vs TRL {w}",
                    r["data"]
                );
            }
        };
        for (i, want) in r["steps"].as_array().unwrap().iter().enumerate() {
            let never = || false;
            let st = step::step(
                &mut eng, &mut model, &mut opt, &mut loss, &mut grads, &train, &o, &never,
            )
            .unwrap()
            .expect("never stopped");
            check(&format!("step {}", i + 1), want, &st.batch);
        }
        let eval = step::eval_loss(&mut eng, &mut model, &mut loss, &val).unwrap();
        check("eval", &r["eval"], &eval);
    }
}

/// A training step reuses one gradient buffer: after `reset` the first
/// product into each gradient overwrites it instead of accumulating onto
/// zeros. Stale values from an earlier step must not leak into any
/// gradient (tied and untied heads, a two-row batch that accumulates).
#[test]
fn reused_gradient_buffers_match_fresh_ones() {
    for kind in common::FAMILIES {
        let dir = fixture(kind);
        let model = Model::load(&dir.join("model")).unwrap();
        let rows = tokens(&dir);
        let other: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| r.iter().rev().copied().collect())
            .collect();
        let mut eng = Engine::cpu(&model);
        let mut fresh = zero_grads(&model);
        common::batch_loss(&mut eng, &model, &rows, Some(&mut fresh)).unwrap();
        let mut reused = zero_grads(&model);
        common::batch_loss(&mut eng, &model, &other, Some(&mut reused)).unwrap();
        reused.reset();
        common::batch_loss(&mut eng, &model, &rows, Some(&mut reused)).unwrap();
        for (p, (a, b)) in model.params.iter().zip(fresh.iter().zip(&reused)) {
            let d = max_diff(a, b);
            assert!(
                d <= 1e-6 * max_abs(a),
                "{kind}: {} differs by {d} after reuse",
                p.name
            );
        }
    }
}

#[test]
fn save_then_load_roundtrips_and_bad_checkpoints_fail_clearly() {
    let dir = fixture("qwen3");
    let model = Model::load(&dir.join("model")).unwrap();
    let tmp_dir = tempfile::tempdir().unwrap();
    let tmp = tmp_dir.path().join("model");
    model.save(&tmp).unwrap();
    let back = Model::load(&tmp).unwrap();
    assert_eq!(back.cfg, model.cfg);
    for (a, b) in back.params.iter().zip(&model.params) {
        assert_eq!(a, b);
    }
    // A tensor whose shape disagrees with the config: error names both shapes.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(100);
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let e = format!("{:#}", Model::load(&tmp).unwrap_err());
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("[96, 64]")
            && e.contains("[100, 64]"),
        "{e}"
    );
    // Truncated safetensors.
    model.save(&tmp).unwrap();
    let st = tmp.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let e = format!("{:#}", Model::load(&tmp).unwrap_err());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // NaN refused on save.
    let mut bad = model.clone();
    bad.params[3].data[0] = f32::NAN;
    assert!(format!("{:#}", bad.save(&tmp).unwrap_err()).contains("NaN"));
}

#[test]
fn greedy_generation_matches_transformers_and_kv_cache_matches_full_forward() {
    use anetrain::engine::generate::{generate, Decoder, GenerateOptions};
    use anetrain::model::generation::Sampling;
    for kind in common::FAMILIES {
        let dir = fixture(kind);
        let model = Model::load(&dir.join("model")).unwrap();
        let j = json(&dir);
        let plen = j["prompt_len"].as_u64().unwrap() as usize;
        let want = npy::read(&dir.join("greedy.npy")).unwrap();
        let npy::NpyData::Int(want) = want.data else {
            panic!()
        };
        let want: Vec<u32> = want.iter().map(|&t| t as u32).collect();
        let greedy = Sampling {
            top_k: 0,
            temperature: 0.0,
            top_p: 1.0,
        };
        let o = GenerateOptions {
            max_new: want.len() - plen,
            sampling: greedy,
            seed: 0,
            stop: &[],
        };
        let got = generate(&model, &want[..plen], &o, |_| Ok(())).unwrap();
        assert_eq!(got, want[plen..].to_vec(), "{kind}: greedy continuation");
        // The cached decoder's logits equal the full forward's at every position.
        let row = &tokens(&dir)[0];
        let mut eng = Engine::cpu(&model);
        let full = common::prefix_logits(&mut eng, &model, row);
        let mut dec = Decoder::new(&model);
        for (p, &t) in row.iter().enumerate() {
            let l = dec.step(t).unwrap();
            let rel = max_diff(&l, &full[p]) / max_abs(&full[p]);
            assert!(rel < 1e-5, "{kind} position {p}: {rel:e}");
        }
    }
}

#[test]
fn sharded_and_half_precision_checkpoints_load() {
    // Re-encode the fixture as two shards with an index, the second shard in
    // bf16 and the first in f16 (values rounded accordingly).
    let dir = fixture("qwen3");
    let model = Model::load(&dir.join("model")).unwrap();
    let tmp_dir = tempfile::tempdir().unwrap();
    let tmp = tmp_dir.path();
    std::fs::copy(dir.join("model/config.json"), tmp.join("config.json")).unwrap();
    let half = model.params.len() / 2;
    let mut map = serde_json::Map::new();
    for (shard, (range, dtype)) in [(0..half, "F16"), (half..model.params.len(), "BF16")]
        .into_iter()
        .enumerate()
    {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for p in &model.params[range] {
            let start = data.len();
            for &v in &p.data {
                let bytes = if dtype == "F16" {
                    half::f16::from_f32(v).to_le_bytes()
                } else {
                    half::bf16::from_f32(v).to_le_bytes()
                };
                data.extend_from_slice(&bytes);
            }
            header.insert(p.name.clone(), serde_json::json!({"dtype": dtype, "shape": p.shape, "data_offsets": [start, data.len()]}));
            map.insert(p.name.clone(), file.clone().into());
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h);
        bytes.extend(data);
        std::fs::write(tmp.join(&file), bytes).unwrap();
    }
    std::fs::write(
        tmp.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let back = Model::load(tmp).unwrap();
    for (i, (a, b)) in back.params.iter().zip(&model.params).enumerate() {
        let tol = if i < half { 1e-3 } else { 8e-3 };
        let d = max_diff(&a.data, &b.data) / max_abs(&b.data).max(1e-6);
        assert!(d <= tol, "{}: {d}", a.name);
    }
}

#[test]
fn llama2c_checkpoints_convert_to_the_same_model() {
    // llama2c.bin is the llama fixture exported by scripts/make_fixtures.py
    // in llama2.c's format (interleaved RoPE rows, separate classifier).
    let dir = fixture("llama");
    let converted = anetrain::tools::convert::load_llama2c(&dir.join("llama2c.bin")).unwrap();
    let hf = Model::load(&dir.join("model")).unwrap();
    assert_eq!(converted.cfg.vocab_size, hf.cfg.vocab_size);
    assert!(!converted.cfg.tie_word_embeddings);
    for (a, b) in converted.params.iter().zip(&hf.params) {
        assert_eq!(a.name, b.name);
        assert!(
            max_diff(&a.data, &b.data) == 0.0,
            "{} differs after conversion",
            a.name
        );
    }
    let e = format!(
        "{:#}",
        anetrain::tools::convert::load_llama2c(&dir.join("tokens.npy")).unwrap_err()
    );
    assert!(e.contains("tokens.npy"), "{e}");
}
