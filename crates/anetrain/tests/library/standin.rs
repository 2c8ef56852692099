//! The macOS device, `ane::AneDevice`, executed on Linux against the
//! stand-in runtime (`crates/ane-standin`, loaded as `libane_standin.so`):
//! every kernel gives the simulator's bits, nothing leaks, no surface stays
//! locked, and a too-small surface fails the way the references report.
//!
//! The stand-in's state is per process, so the tests here take turns.

use std::path::PathBuf;
use std::sync::Mutex;

use ane::rules::RuleSet;
use ane::{AneDevice, Device, SimDevice};
use anetrain::kernels::{build, KernelKind, KernelOptions, LoraKernel, Shape};
use anetrain::model::config::{Arch, ModelConfig};
use anetrain::model::Projection;
use anetrain::util::rng::Rng;

static TURN: Mutex<()> = Mutex::new(());

/// The stand-in library cargo builds beside this test (a dev-dependency).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        let p = dir.join("libane_standin.so");
        if p.exists() {
            return p;
        }
    }
    panic!(
        "libane_standin.so is not next to {} (cargo builds it as a dev-dependency)",
        exe.display()
    );
}

/// The stand-in's report (see `ane_standin::report`).
fn report() -> serde_json::Value {
    // SAFETY: the stand-in's initialisers only set up Rust statics; the
    // symbol has the declared prototype.
    let text = unsafe {
        let lib = libloading::Library::new(library()).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(*mut u8, usize) -> usize> =
            lib.get(b"ane_standin_report").unwrap();
        let n = f(std::ptr::null_mut(), 0);
        let mut buf = vec![0u8; n];
        f(buf.as_mut_ptr(), n);
        String::from_utf8(buf).unwrap()
    };
    serde_json::from_str(&text).unwrap()
}

fn device() -> AneDevice {
    AneDevice::with_runtime(&library()).unwrap()
}

/// Nothing alive, nothing locked, no pool open, no violation.
fn assert_clean(r: &serde_json::Value) {
    assert_eq!(r["live_objects"], serde_json::json!({}), "{r}");
    assert_eq!(r["locked_surfaces"], 0, "{r}");
    assert_eq!(r["open_pools"], 0, "{r}");
    assert_eq!(r["violations"], serde_json::json!([]), "{r}");
}

/// A small Qwen3-style config with grouped-query attention.
fn gqa() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        hidden_size: 64,
        intermediate_size: 160,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 24,
        vocab_size: 64,
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        max_position_embeddings: 64,
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

/// Compiles `text` on both devices, evaluates both on the same input and
/// returns both outputs.
fn both(
    ane: &mut AneDevice,
    sim: &mut SimDevice,
    text: &str,
    blobs: &[(String, Vec<u8>)],
    input: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let pa = ane.compile(text, blobs).unwrap();
    let ps = sim.compile(text, blobs).unwrap();
    let (ni, no) = ane.io_elems(&pa);
    assert_eq!((ni, no), sim.io_elems(&ps));
    let (mut ia, mut oa) = (ane.buffer(ni).unwrap(), ane.buffer(no).unwrap());
    let (mut is, mut os) = (sim.buffer(ni).unwrap(), sim.buffer(no).unwrap());
    ane.write(&mut ia, 0, input).unwrap();
    sim.write(&mut is, 0, input).unwrap();
    ane.eval(&pa, &ia, &mut oa).unwrap();
    sim.eval(&ps, &is, &mut os).unwrap();
    let (mut ya, mut ys) = (vec![0f32; no], vec![0f32; no]);
    ane.read(&oa, 0, &mut ya).unwrap();
    sim.read(&os, 0, &mut ys).unwrap();
    (ya, ys)
}

#[test]
fn every_kernel_gives_the_simulators_bits() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(7);
    let before = report();
    {
        let mut ane = device();
        let mut sim = SimDevice::new();
        // A second device for a chip that rejects concat: its programs'
        // small outputs are sized by the device.
        let no_concat = ane::family::Limits {
            concat: false,
            ..ane::family::Limits::conservative()
        };
        let rules_nc = ane::rules::RuleSet::default().with_limits(no_concat);
        let mut ane_nc = device().with_rules(rules_nc.clone());
        let mut sim_nc = SimDevice::new().with_rules(rules_nc);
        for cfg in [ModelConfig::preset("tiny").unwrap(), gqa()] {
            let mut lora = KernelOptions::hf(&cfg);
            lora.lora = Some(LoraKernel {
                rank: 4,
                scale: 2.0,
                targets: Projection::ALL.to_vec(),
                layers: None,
            });
            // Without concat: one output per block, in device-sized
            // surfaces of one size that AneDevice gathers into the buffer.
            let mut separate = KernelOptions::hf(&cfg);
            separate.limits.concat = false;
            for (seq, o) in [(32, KernelOptions::hf(&cfg)), (64, lora), (32, separate)] {
                let s = Shape::new(&cfg, seq);
                for kind in KernelKind::ALL {
                    let k = build(kind, &s, &o).unwrap();
                    let input = rng.normals(k.layout.input_elems(), 0.5);
                    let (ane, sim) = if o.limits.concat {
                        (&mut ane, &mut sim)
                    } else {
                        (&mut ane_nc, &mut sim_nc)
                    };
                    let (ya, ys) = both(ane, sim, &k.text(), &k.blob_paths(), &input);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&ya) == bits(&ys),
                        "{kind:?} seq {seq}: AneDevice on the stand-in differs from SimDevice"
                    );
                    assert!(ya.iter().all(|x| x.is_finite()), "{kind:?}: not finite");
                }
            }
        }
        let r = report();
        let compiled = r["compiles"].as_u64().unwrap() - before["compiles"].as_u64().unwrap();
        assert_eq!(compiled, (ane.compiles() + ane_nc.compiles()) as u64, "{r}");
        assert_eq!(compiled, 2 * 3 * KernelKind::ALL.len() as u64);
    }
    // Every program unloaded and released, every surface freed.
    assert_clean(&report());
}

#[test]
fn a_hundred_evaluations_leak_nothing_and_lock_each_buffer_once_per_access() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let before = report();
    let cfg = ModelConfig::preset("tiny").unwrap();
    let k = build(
        KernelKind::FfnForward,
        &Shape::new(&cfg, 32),
        &KernelOptions::hf(&cfg),
    )
    .unwrap();
    {
        let mut ane = device();
        let p = ane.compile(&k.text(), &k.blob_paths()).unwrap();
        let (ni, no) = ane.io_elems(&p);
        let mut x = ane.buffer(ni).unwrap();
        let mut y = ane.buffer(no).unwrap();
        let mut out = vec![0f32; no];
        let width = k.layout.in_spatial;
        let rows = vec![0.25f32; ni];
        for _ in 0..100 {
            // one write of all rows and one read: one lock each
            ane.write_rows(&mut x, 0, width, width, &rows).unwrap();
            ane.eval(&p, &x, &mut y).unwrap();
            ane.read(&y, 0, &mut out).unwrap();
        }
    }
    let after = report();
    assert_clean(&after);
    let n = |r: &serde_json::Value, k: &str| r[k].as_u64().unwrap();
    assert_eq!(n(&after, "evaluations") - n(&before, "evaluations"), 100);
    // two buffers zeroed at creation, then one write and one read per call
    assert_eq!(
        n(&after, "locks_taken") - n(&before, "locks_taken"),
        2 + 200
    );
}

#[test]
fn a_surface_under_48_kib_fails_as_the_references_report() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    const SMALL: &str = "program(1.3)\n{\n func main<ios18>(tensor<fp16, [1, 2, 1, 4]> x) {\n tensor<fp16, [1,2,1,4]> y = add(x=x,y=x)[name=string(\"y\")];\n } -> (y);\n}\n";
    {
        // Our own rules would refuse it; switch min-surface off to reach
        // the runtime's check.
        let mut rules = RuleSet::default();
        rules.set("min-surface", false).unwrap();
        rules.set("min-width", false).unwrap();
        let mut ane = device().with_rules(rules);
        let p = ane.compile(SMALL, &[]).unwrap();
        let x = ane.buffer(8).unwrap();
        let mut y = ane.buffer(8).unwrap();
        let e = ane.eval(&p, &x, &mut y).unwrap_err().0;
        assert!(e.contains("status=0x1d") && e.contains("too small"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // and the default rules stop it before the runtime sees it
        // (its 4-wide surfaces break min-width first)
        let e = device().compile(SMALL, &[]).err().unwrap().0;
        assert!(e.contains("min-width"), "{e}");
    }
    assert_clean(&report());
}
