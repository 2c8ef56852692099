//! The chip families on the simulated device: each family's documented
//! faults have teeth (a program written the seed's way, slicing regions out
//! of its input at width offsets, turns a residual outlier into inf on a
//! simulated M1 and not on an M5), and every kernel of our layouts stays
//! within fp16 tolerance of its CPU twin under every family, outliers
//! above the 4094 clamp included.

use crate::common;

use ane::family::Family;
use ane::SimDevice;
use anetrain::kernels::check::{check_on_device, FP16_TOL};
use anetrain::kernels::tiling;
use anetrain::kernels::{KernelKind, KernelOptions, Shape};
use anetrain::model::config::{Arch, ModelConfig};

/// Residual values beyond the M1's width-slice clamp of 4094.
const OUTLIER: f32 = 6000.0;

/// A small Qwen3-style config with grouped-query attention and QK-norm,
/// every extent a multiple of 32.
fn gqa() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        hidden_size: 128,
        intermediate_size: 320,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: 32,
        vocab_size: 64,
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        max_position_embeddings: 128,
        qk_norm: true,
        bos_token_id: None,
        eos_token_id: None,
        pad_token_id: None,
        quantization: None,
        scales: Default::default(),
        sliding_window: None,
        no_rope_layers: vec![],
        full_attention_layers: vec![],
        local_rope_theta: None,
        rope_scaling: Default::default(),
        partial_rotary: None,
        multimodal: None,
    }
}

#[test]
fn a_seed_layout_overflows_on_a_simulated_m1_and_not_on_an_m5() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let s = Shape::new(&cfg, 64);
    let seed = KernelOptions::seed(&cfg);
    // The seed's programs are not padded to the device's surface minimum:
    // let the simulated chips compile them anyway, faults kept.
    let device = |f: Family| SimDevice::for_family(f).with_rules(ane::rules::RuleSet::none());
    let m1 = check_on_device(
        &mut device(Family::M1),
        KernelKind::FfnForward,
        &s,
        &seed,
        1,
        Some(OUTLIER),
    )
    .unwrap();
    let m5 = check_on_device(
        &mut device(Family::M5),
        KernelKind::FfnForward,
        &s,
        &seed,
        1,
        Some(OUTLIER),
    )
    .unwrap();
    assert!(m1.is_infinite(), "seed layout on m1: {m1}");
    assert!(m5 <= FP16_TOL, "seed layout on m5: {m5}");
    // Our layout cuts the same region along column groups: exact on both.
    let ours = KernelOptions::hf(&cfg);
    for f in [Family::M1, Family::M5] {
        let r = check_on_device(
            &mut SimDevice::for_family(f),
            KernelKind::FfnForward,
            &s,
            &ours,
            1,
            Some(OUTLIER),
        )
        .unwrap();
        assert!(r <= FP16_TOL, "{f}: {r}");
    }
}

#[test]
fn every_kernel_stays_within_fp16_tolerance_under_every_family() {
    let lora = |cfg: &ModelConfig| {
        let mut o = KernelOptions::hf(cfg);
        o.lora = Some(anetrain::kernels::LoraKernel {
            rank: 8,
            scale: 2.0,
            targets: anetrain::model::Projection::ALL.to_vec(),
            layers: None,
        });
        o
    };
    for (name, cfg) in [
        ("tiny", ModelConfig::preset("tiny").unwrap()),
        ("gqa", gqa()),
    ] {
        for f in Family::ALL {
            for (what, mut o) in [("plain", KernelOptions::hf(&cfg)), ("lora", lora(&cfg))] {
                o.limits = f.limits();
                let full = Shape::new(&cfg, 64);
                let plan = tiling::plan(&full, &o).unwrap();
                let mut dev = SimDevice::for_family(f);
                for kind in KernelKind::ALL {
                    let s = plan.of(kind).shape;
                    for outlier in [None, Some(OUTLIER)] {
                        let r = check_on_device(&mut dev, kind, &s, &o, 7, outlier)
                            .unwrap_or_else(|e| panic!("{name} {what} on {f}: {kind:?}: {e}"));
                        assert!(
                            r <= FP16_TOL,
                            "{name} {what} on {f}: {kind:?} outlier {outlier:?}: rel {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_outputs_past_the_cliff_become_inf_on_every_family() {
    // The probe programs measure what the simulator plays: every family
    // saturates matmul outputs above 32752; M1–M3 clamp width slices.
    for f in Family::ALL {
        let r = ane::probes::run(&mut SimDevice::for_family(f), &f.limits());
        let get = |p: &str| {
            r.results
                .iter()
                .find(|x| x.probe == p)
                .unwrap()
                .measured
                .clone()
        };
        assert!(get("matmul-cliff").contains("32752"), "{f}: {r:?}");
        assert_eq!(
            get("width-slice").contains("4094"),
            f < Family::M4,
            "{f}: {r:?}"
        );
        assert!(r.results.iter().all(|x| x.agrees), "{f}: {r:?}");
    }
}

/// The runtime keys compiled programs on the MIL text and the weight keys
/// (Orion core/ane_runtime.m: "Same hexId as donor (same MIL text + weight
/// dict keys)"), so a constant's bytes must show in the text: RoPE tables
/// for two values of `rope_theta` give two texts.
#[test]
fn programs_differing_only_in_a_constant_differ_in_text() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let s = Shape::new(&cfg, 32);
    let mut o = KernelOptions::hf(&cfg);
    let a = anetrain::kernels::build(KernelKind::SdpaForward, &s, &o).unwrap();
    o.rope_theta *= 2.0;
    let b = anetrain::kernels::build(KernelKind::SdpaForward, &s, &o).unwrap();
    assert_ne!(a.text(), b.text());
    // Same constants, same text and names.
    o.rope_theta /= 2.0;
    let c = anetrain::kernels::build(KernelKind::SdpaForward, &s, &o).unwrap();
    assert_eq!(a.text(), c.text());
}

/// A chip whose compiler rejects `concat` (Orion docs/ane_constraints.md
/// §1): the kernels are built without it — each output block an output of
/// its own, in name order — the simulator refuses any program that still
/// uses it, and every kernel, the loss and the gradients hold the same
/// tolerances as with `concat`.
#[test]
fn kernels_without_concat_compute_the_same() {
    use anetrain::engine::{zero_grads, Engine};
    let no_concat = ane::family::Limits {
        concat: false,
        ..Family::M4.limits()
    };
    for (name, cfg) in [
        ("tiny", ModelConfig::preset("tiny").unwrap()),
        ("gqa", gqa()),
    ] {
        let mut o = KernelOptions::hf(&cfg);
        o.limits = no_concat;
        let full = Shape::new(&cfg, 64);
        let plan = tiling::plan(&full, &o).unwrap();
        let mut dev = SimDevice::new().with_limits(no_concat);
        for kind in KernelKind::ALL {
            let k = anetrain::kernels::build(kind, &plan.of(kind).shape, &o).unwrap();
            assert!(!k.text().contains("concat("), "{name} {kind:?}");
            let r = check_on_device(&mut dev, kind, &plan.of(kind).shape, &o, 3, None)
                .unwrap_or_else(|e| panic!("{name} {kind:?}: {e}"));
            assert!(r <= FP16_TOL, "{name} {kind:?}: {r}");
        }
        // The same chip refuses a program joined with concat.
        let mut joined = KernelOptions::hf(&cfg);
        joined.limits.concat = true;
        let k = anetrain::kernels::build(KernelKind::FfnForward, &full, &joined).unwrap();
        let e = ane::Device::compile(&mut dev, &k.text(), &k.blob_paths())
            .err()
            .unwrap();
        assert!(e.0.contains("no-concat"), "{e}");
    }
    // Training maths end to end on that chip: loss and gradients track the
    // CPU engine as with concat.
    let model = anetrain::model::Model::init(&ModelConfig::preset("tiny").unwrap(), 5).unwrap();
    let rows = vec![(0..40).map(|i| (i * 37 % 200) as u32).collect::<Vec<u32>>()];
    let mut cpu = Engine::cpu(&model);
    let mut sim = Engine::neural(&model, SimDevice::new().with_limits(no_concat));
    let (mut gc, mut gs) = (zero_grads(&model), zero_grads(&model));
    let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
    let (ls, _) = common::batch_loss(&mut sim, &model, &rows, Some(&mut gs)).unwrap();
    assert!((lc - ls).abs() < 2e-2, "loss {lc} vs {ls}");
    for (p, (a, b)) in model.params.iter().zip(gc.iter().zip(&gs)) {
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst / scale < 5e-2,
            "{}: gradient rel err {}",
            p.name,
            worst / scale
        );
    }
}

/// A residual branch whose product lands between the matmul cliff (32752)
/// and fp16's largest value (65504): pre-scaled by ½ inside the product
/// and by 2 after, it is finite and right on a chip with the cliff; the
/// same program without the pre-scale turns it into inf there.
#[test]
fn residual_products_past_the_matmul_cliff_are_prescaled() {
    use anetrain::kernels::check::pack_all;
    use anetrain::kernels::{build, Port, Tensors};
    use anetrain::model::Projection;
    let cfg = ModelConfig::preset("tiny").unwrap();
    let s = Shape::new(&cfg, 64);
    let (q, d) = (s.q_dim(), s.dim);
    let mut t = Tensors::new();
    t.insert(Port::Attn, vec![100.0; q * s.seq]);
    // Row 0 of Wo [D, Q] sums 128 × 100 × 4 = 51200 into o[0].
    let mut wo = vec![0.001f32; d * q];
    wo[..q].fill(4.0);
    t.insert(Port::Weight(Projection::O), wo);
    let run = |prescaled: bool| -> Vec<f32> {
        let mut o = KernelOptions::hf(&cfg);
        o.limits = Family::M4.limits();
        if !prescaled {
            o.limits.matmul_cliff = None;
        }
        assert_eq!(o.cliff_prescale().is_some(), prescaled);
        let k = build(KernelKind::WoForward, &s, &o).unwrap();
        let mut dev = SimDevice::for_family(Family::M4);
        let p = ane::Device::compile(&mut dev, &k.text(), &k.blob_paths()).unwrap();
        let (ni, no) = ane::Device::io_elems(&dev, &p);
        let mut x = ane::Device::buffer(&mut dev, ni).unwrap();
        let mut y = ane::Device::buffer(&mut dev, no).unwrap();
        ane::Device::write(&mut dev, &mut x, 0, &pack_all(&k, &t)).unwrap();
        ane::Device::eval(&mut dev, &p, &x, &mut y).unwrap();
        let mut out = vec![0f32; no];
        ane::Device::read(&dev, &y, 0, &mut out).unwrap();
        k.layout.unpack(Port::O, &out).to_vec()
    };
    let with = run(true);
    assert!((with[0] - 51200.0).abs() <= 64.0, "{}", with[0]);
    let without = run(false);
    assert!(without[0].is_infinite(), "{}", without[0]);
}
