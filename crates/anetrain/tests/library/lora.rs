//! LoRA parity with `peft` + PyTorch on the committed fixtures
//! (`scripts/make_lora_fixtures.py`): logits of the adapted model (1e-5
//! relative), loss (1e-5 relative), every adapter gradient (1e-4 of its
//! largest entry), one AdamW step on the adapters (1e-6 absolute); the same
//! through the simulated Neural Engine in fp16 (3e-2); save/load and merge.

use crate::common;

use common::{fixture, floats, max_abs, max_diff, tokens};

use anetrain::device::KernelRunner;
use anetrain::engine::{zero_grads, Engine};
use anetrain::model::lora::Lora;
use anetrain::model::Model;
use anetrain::train::optim::{AdamW, AdamWConfig};
use anetrain::train::step;

/// The fixture's base model with its starting adapter attached.
fn adapted(kind: &str) -> Model {
    let dir = fixture(kind);
    let mut model = Model::load(&dir.join("model")).unwrap();
    model.lora = Some(Lora::load(&model.cfg, &dir.join("lora/adapter")).unwrap());
    model
}

/// Worst relative logits error of `eng` against the adapted model's logits.
fn logits_err<R: KernelRunner>(kind: &str, eng: &mut Engine<R>, model: &Model) -> f32 {
    let dir = fixture(kind);
    let want = floats(&dir.join("lora/logits.npy"));
    let v = model.cfg.vocab_size;
    let mut worst = 0f32;
    for (b, row) in tokens(&dir).iter().enumerate() {
        let n = row.len() - 1;
        let fwd = eng.forward(model, &row[..n], None).unwrap();
        let got = eng.logits(model, &fwd.xf).unwrap();
        let w = &want[b * n * v..(b + 1) * n * v];
        worst = worst.max(max_diff(&got, w) / max_abs(w));
    }
    worst
}

#[test]
fn adapter_logits_gradients_and_adamw_match_peft() {
    for kind in common::FAMILIES {
        let dir = fixture(kind);
        let model = adapted(kind);
        let lora = model.lora.as_ref().unwrap();
        assert!(lora.num_params() > 0);
        let mut eng = Engine::cpu(&model);
        let rel = logits_err(kind, &mut eng, &model);
        eprintln!("{kind}: adapted logits rel err {rel:.2e}");
        assert!(rel <= 1e-5, "{kind}: logits rel err {rel:e}");

        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("lora/fixture.json")).unwrap())
                .unwrap();
        let mut grads = zero_grads(&model);
        assert_eq!(
            grads.len(),
            lora.params.len(),
            "gradients only for adapters"
        );
        let rows = tokens(&dir);
        let (loss, _) = common::batch_loss(&mut eng, &model, &rows, Some(&mut grads)).unwrap();
        let want_loss = j["loss"].as_f64().unwrap();
        assert!(
            ((loss - want_loss) / want_loss).abs() <= 1e-5,
            "{kind}: loss {loss} vs {want_loss}"
        );
        let want_g =
            anetrain::model::tensor_file::read(&dir.join("lora/grads.safetensors")).unwrap();
        assert_eq!(want_g.len(), lora.params.len());
        let mut worst = 0f32;
        for (p, g) in lora.params.iter().zip(&grads) {
            let w = &want_g[&p.name].data;
            assert!(
                max_abs(w) > 0.0,
                "{kind}: fixture gradient of {} is zero",
                p.name
            );
            let rel = max_diff(g, w) / max_abs(w);
            worst = worst.max(rel);
            assert!(
                rel <= 1e-4,
                "{kind}: gradient of {} rel err {rel:e}",
                p.name
            );
        }
        eprintln!("{kind}: adapter gradients worst rel err {worst:.2e}");

        // One AdamW step with peft's own gradients isolates the optimizer.
        let cfg = AdamWConfig {
            beta1: j["beta1"].as_f64().unwrap(),
            beta2: j["beta2"].as_f64().unwrap(),
            eps: j["eps"].as_f64().unwrap(),
            weight_decay: j["weight_decay"].as_f64().unwrap(),
        };
        let peft_grads: Vec<Vec<f32>> = lora
            .params
            .iter()
            .map(|p| want_g[&p.name].data.clone())
            .collect();
        let mut m2 = model.clone();
        let base_before = m2.params.clone();
        let mut opt = AdamW::new(&m2, cfg);
        // The trainer's update (no clipping, no loss scale).
        let u = step::apply_update(
            &mut m2,
            &mut opt,
            &peft_grads.into(),
            0.0,
            1.0,
            0.0,
            j["lr"].as_f64().unwrap(),
        );
        assert!(u.finite);
        let after =
            anetrain::model::tensor_file::read(&dir.join("lora/adamw.safetensors")).unwrap();
        for p in &m2.lora.as_ref().unwrap().params {
            let d = max_diff(&p.data, &after[&p.name].data);
            assert!(
                d <= 1e-6,
                "{kind}: AdamW update of {} differs by {d:e}",
                p.name
            );
        }
        assert_eq!(m2.params, base_before, "{kind}: the base must stay frozen");
    }
}

#[test]
fn adapters_run_through_the_simulated_neural_engine() {
    for kind in common::FAMILIES {
        let model = adapted(kind);
        let mut eng = Engine::neural(&model, ane::SimDevice::new());
        let rel = logits_err(kind, &mut eng, &model);
        eprintln!("{kind}: ane-sim adapted logits rel err {rel:.2e}");
        assert!(rel <= 3e-2, "{kind}: ane-sim logits rel err {rel:e}");
        // After an adapter-only update the device restages the adapters:
        // its logits follow the CPU engine's for the new adapters.
        let mut m2 = model.clone();
        for p in m2.trainable_mut() {
            p.data.iter_mut().for_each(|v| *v *= 1.5);
        }
        let rows = tokens(&fixture(kind));
        let n = rows[0].len() - 1;
        let want = {
            let mut cpu = Engine::cpu(&m2);
            let f = cpu.forward(&m2, &rows[0][..n], None).unwrap();
            cpu.logits(&m2, &f.xf).unwrap()
        };
        let f = eng.forward(&m2, &rows[0][..n], None).unwrap();
        let got = eng.logits(&m2, &f.xf).unwrap();
        let rel = max_diff(&got, &want) / max_abs(&want);
        assert!(rel <= 3e-2, "{kind}: after restaging, rel err {rel:e}");
        let stale = {
            let mut cpu = Engine::cpu(&model);
            let f = cpu.forward(&model, &rows[0][..n], None).unwrap();
            cpu.logits(&model, &f.xf).unwrap()
        };
        assert!(
            max_diff(&got, &stale) > 10.0 * max_diff(&got, &want),
            "{kind}: the device kept the old adapters"
        );
    }
}

#[test]
fn adapters_save_load_and_merge() {
    let model = adapted("qwen3");
    let lora = model.lora.as_ref().unwrap();
    let tmp_dir = tempfile::tempdir().unwrap();
    let tmp = tmp_dir.path().join("adapter");
    lora.save(&tmp, &anetrain::model::lora::AdapterBase::named("base"))
        .unwrap();
    let back = Lora::load(&model.cfg, &tmp).unwrap();
    assert_eq!(back.cfg, lora.cfg);
    for (a, b) in back.params.iter().zip(&lora.params) {
        assert_eq!(a, b);
    }
    // The same adapter in mlx-lm's layout (A and B transposed, streamed
    // tensor by tensor) reads back to the same values.
    std::fs::remove_file(tmp.join("adapter_model.safetensors")).unwrap();
    let mlx = Lora::load(&model.cfg, &tmp).unwrap();
    assert_eq!(mlx.params.len(), lora.params.len());
    for (a, b) in mlx.params.iter().zip(&lora.params) {
        assert_eq!((&a.name, &a.shape, &a.data), (&b.name, &b.shape, &b.data));
    }
    lora.save(&tmp, &anetrain::model::lora::AdapterBase::named("base"))
        .unwrap();
    // Merged weights give the adapted model's logits.
    let mut merged = model.clone();
    let l = merged.lora.take().unwrap();
    merged.merge_lora(&l);
    let rows = tokens(&fixture("qwen3"));
    let n = rows[0].len() - 1;
    let a = {
        let mut cpu = Engine::cpu(&model);
        let f = cpu.forward(&model, &rows[0][..n], None).unwrap();
        cpu.logits(&model, &f.xf).unwrap()
    };
    let b = {
        let mut cpu = Engine::cpu(&merged);
        let f = cpu.forward(&merged, &rows[0][..n], None).unwrap();
        cpu.logits(&merged, &f.xf).unwrap()
    };
    let rel = max_diff(&a, &b) / max_abs(&a);
    assert!(rel <= 1e-5, "merged vs adapted rel err {rel:e}");
    // Adapters that do not fit the model fail with the tensor's name.
    let llama = Model::load(&fixture("llama").join("model")).unwrap();
    let err = Lora::load(&llama.cfg, &tmp).unwrap_err().to_string();
    assert!(err.contains("adapter tensor"), "{err}");
    std::fs::write(
        tmp.join("adapter_config.json"),
        "{\"r\": 4, \"use_dora\": true}",
    )
    .unwrap();
    let err = Lora::load(&model.cfg, &tmp).unwrap_err().to_string();
    assert!(err.contains("DoRA"), "{err}");
}

/// The library's `generate` on a memory-mapped base with an adapter reads
/// both: the cached decoder's logits equal the engine's full forward (which
/// applies the adapter) at every position, and differ from the base's.
/// (The decoder used to panic on a mapped base and to drop the adapter.)
#[test]
fn decoding_reads_a_mapped_base_and_applies_its_adapter() {
    use anetrain::engine::generate::{generate, Decoder, GenerateOptions};
    use anetrain::model::generation::Sampling;
    for kind in common::FAMILIES {
        let dir = fixture(kind);
        let mut model = Model::load_frozen(&dir.join("model")).unwrap();
        assert!(
            model.params.iter().any(|p| p.stored.is_some()),
            "{kind}: not mapped"
        );
        let base = {
            let mut eng = Engine::cpu(&model);
            let row = &tokens(&dir)[0];
            let fwd = eng.forward(&model, row, None).unwrap();
            eng.logits(&model, &fwd.xf).unwrap()
        };
        model.lora = Some(Lora::load(&model.cfg, &dir.join("lora/adapter")).unwrap());
        let row = &tokens(&dir)[0];
        let mut eng = Engine::cpu(&model);
        let fwd = eng.forward(&model, row, None).unwrap();
        let full = eng.logits(&model, &fwd.xf).unwrap();
        assert!(
            max_diff(&full, &base) > 1e-3 * max_abs(&base),
            "{kind}: the adapter changes nothing, so this test could not fail"
        );
        let mut dec = Decoder::new(&model);
        let prefixes = common::prefix_logits(&mut eng, &model, row);
        for (p, &t) in row.iter().enumerate() {
            let l = dec.step(t).unwrap();
            let rel = max_diff(&l, &prefixes[p]) / max_abs(&prefixes[p]);
            assert!(rel < 1e-5, "{kind} position {p}: {rel:e}");
        }
        let o = GenerateOptions {
            max_new: 3,
            sampling: Sampling {
                top_k: 0,
                temperature: 0.0,
                top_p: 1.0,
            },
            seed: 0,
            stop: &[],
        };
        let out = generate(&model, &row[..4], &o, |_| Ok(())).unwrap();
        assert_eq!(out.len(), 3, "{kind}");
    }
}
