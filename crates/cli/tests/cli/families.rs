//! Chip families from the command line: `doctor` probes a simulated M1 and
//! M5 and saves no profile (the simulator measures no chip); training on a
//! simulated M1 tracks the CPU engine, on `tiny` and on a model whose
//! residual stream carries values above the M1's 4094 width-slice clamp.

use crate::common;

use std::path::Path;

use common::{bin, records, run, tmp};

fn losses(out: &Path) -> Vec<f64> {
    records(out)
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn doctor_probes_each_simulated_family_and_leaves_no_profile_behind() {
    let d = tmp();
    let config = d.path().join("config");
    for (family, clamp) in [("m1", true), ("m5", false)] {
        let report = d.path().join(format!("{family}.json"));
        let o = bin()
            .env("ANETRAIN_CONFIG_DIR", &config)
            .args([
                "doctor",
                "--sim-family",
                family,
                "--seq",
                "32",
                "--steps",
                "0",
                "--evals",
                "1",
            ])
            .arg("--report")
            .arg(&report)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let probes = r["probes"]["results"].as_array().unwrap();
        assert_eq!(probes.len(), 7, "{r}");
        assert!(r["probes"]["compiles"].as_u64().unwrap() <= 16);
        let slice = probes.iter().find(|p| p["probe"] == "width-slice").unwrap();
        assert_eq!(
            slice["measured"].as_str().unwrap().contains("4094"),
            clamp,
            "{slice}"
        );
        assert!(probes.iter().all(|p| p["agrees"] == true), "{family}: {r}");
        assert_eq!(r["ok"], true, "{r}");
        let md = String::from_utf8_lossy(&o.stdout);
        assert!(md.contains("nothing about hardware is shown"), "{md}");
        // No timing is measured on the simulator: the report shows the
        // table's constants and says so.
        assert!(r["timing"]["measured"].is_null(), "{r}");
        assert!(r["timing"]["note"]
            .as_str()
            .unwrap()
            .contains("not measured"));
        assert_eq!(
            r["timing"]["table"]["dispatch_ms"],
            ane::cost::Rates::of(ane::family::Family::parse(family).unwrap()).dispatch_ms
        );
        assert!(md.contains("| dispatch per evaluation (ms) |") && md.contains("not measured"));
        // The simulator plays the table back: nothing is saved for later
        // runs to take as a measurement of this machine.
        assert!(!config.join("device-profile.json").exists());
        assert!(r["profile"].as_str().unwrap().contains("not saved"), "{r}");
    }
    // A profile an older build saved on the simulator is not taken as
    // measured either.
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("device-profile.json"),
        serde_json::json!({
            "format": 1, "family": "m5", "chip": "simulated", "device": "ane-sim",
            "limits": serde_json::to_value(ane::family::Family::M5.limits()).unwrap(),
            "measured_at": 1
        })
        .to_string(),
    )
    .unwrap();
    let out = d.path().join("run");
    let o = bin()
        .env("ANETRAIN_CONFIG_DIR", &config)
        .args([
            "train",
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "ane-sim",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(
        !e.contains("measured by `anetrain doctor`") && e.contains("no Apple chip detected"),
        "{e}"
    );
    // The predicted step, for the measured families when none is known.
    assert!(
        e.contains("predicted on the Neural Engine (no chip family known): m1 ")
            && e.contains("; m4 ")
            && e.contains("docs/benchmarks.md"),
        "{e}"
    );
}

/// `kernels check --seed-compat` and `mil check --strict` give one verdict
/// under a family: the seed's head slices its weights at a width offset,
/// which M1–M3 clamp.
#[test]
fn seed_compatible_programs_get_the_verdict_mil_check_gives() {
    let d = tmp();
    let dump = d.path().join("dump");
    let args = [
        "--model",
        "tiny",
        "--seq",
        "32",
        "--seed-compat",
        "--kernel",
        "head_forward",
    ];
    let o = bin()
        .env("ANETRAIN_ANE_FAMILY", "m1")
        .args(["kernels", "check"])
        .args(args)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("width-offset-slice"),
        "{e}"
    );
    let o = bin()
        .env("ANETRAIN_ANE_FAMILY", "m1")
        .args(["kernels", "dump", "--out"])
        .arg(&dump)
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (family, fails) in [("m1", true), ("m4", false)] {
        let o = bin()
            .args(["mil", "check", "--strict", "--family", family])
            .arg(dump.join("head_forward.mil"))
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            out.contains("FAIL width-offset-slice"),
            fails,
            "{family}: {out}"
        );
        if fails {
            assert!(!o.status.success());
        }
    }
}

/// Trains `model` on the CPU and on a simulated M1 (`steps` steps, the same
/// data and initialisation) and returns both loss sequences.
fn cpu_and_m1(model: &str, steps: &str) -> (Vec<f64>, Vec<f64>) {
    let mut got = cpu_and_families(model, steps, &[], &["m1"]);
    (got.remove(0), got.remove(0))
}

/// Trains `model` on the CPU, then on the simulator playing each of
/// `families`, with `extra` arguments: the loss sequences, CPU first.
fn cpu_and_families(model: &str, steps: &str, extra: &[&str], families: &[&str]) -> Vec<Vec<f64>> {
    let d = tmp();
    let mut got = vec![];
    let runs = std::iter::once(("cpu", "")).chain(families.iter().map(|f| ("ane-sim", *f)));
    for (backend, family) in runs {
        let out = d.path().join(format!("{backend}{family}"));
        let o = bin()
            .env("ANETRAIN_SIM_FAMILY", family)
            .args([
                "train",
                "--model",
                model,
                "--steps",
                steps,
                "--eval-every",
                "0",
                "--backend",
                backend,
            ])
            .args(extra)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{backend} {family}: {e}");
        if backend == "ane-sim" {
            assert!(e.contains(&format!("chip family: {family}")), "{e}");
        }
        got.push(losses(&out));
    }
    got
}

/// A head dimension of 48 (stories15m): the attention's contractions over
/// it are padded with zeros to 64, so every family's rules pass and the
/// model trains on each simulated family as on the CPU.
#[test]
fn a_head_dimension_of_48_trains_on_every_simulated_family() {
    let families = ["m1", "m2", "m3", "m4", "m5"];
    // Two sequences a step: the rules are the programs', not the batch's.
    let extra = ["--seq", "64", "--batch", "2"];
    let got = cpu_and_families("stories15m", "3", &extra, &families);
    let cpu = &got[0];
    assert_eq!(cpu.len(), 3);
    for (family, losses) in families.iter().zip(&got[1..]) {
        for (step, (c, s)) in cpu.iter().zip(losses).enumerate() {
            assert!(
                (c - s).abs() < 0.05,
                "{family} step {}: cpu {c} vs {s}",
                step + 1
            );
        }
    }
}

#[test]
fn training_on_a_simulated_m1_tracks_the_cpu_engine() {
    let (cpu, m1) = cpu_and_m1("tiny", "20");
    assert_eq!(cpu.len(), 20);
    for (step, (c, s)) in cpu.iter().zip(&m1).enumerate() {
        assert!((c - s).abs() < 0.05, "step {}: cpu {c} vs m1 {s}", step + 1);
    }
}

/// A `tiny` model whose residual stream carries ±4500 in one channel from
/// the embedding on (its norms' weights zero there, as the massive
/// activations of Qwen-family models are kept out of the projections):
/// the ffn kernel's residual input holds values the M1 clamps at width
/// offsets. Trained on a simulated M1 it tracks the CPU engine.
#[test]
fn a_model_with_residual_outliers_trains_on_a_simulated_m1() {
    let d = tmp();
    let base = d.path().join("base");
    run(
        &[
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "cpu",
        ],
        &base,
    );
    let mut model = anetrain::model::Model::load(&base).unwrap();
    let (dim, c) = (model.cfg.hidden_size, 5);
    let e = model.embed;
    for (v, x) in model.params[e].data.iter_mut().enumerate() {
        if v % dim == c {
            *x = if (v / dim) % 2 == 0 { 4500.0 } else { -4500.0 };
        }
    }
    let mut norms = vec![model.final_norm];
    for l in &model.layers {
        norms.extend([l.mixer_norm, l.mlp_norm].into_iter().flatten());
    }
    for n in norms {
        model.params[n].data[c] = 0.0;
    }
    model.save(&base).unwrap();
    let (cpu, m1) = cpu_and_m1(base.to_str().unwrap(), "20");
    assert_eq!(cpu.len(), 20);
    for (step, (c, s)) in cpu.iter().zip(&m1).enumerate() {
        assert!(
            s.is_finite() && (c - s).abs() < 0.05,
            "step {}: cpu {c} vs m1 {s}",
            step + 1
        );
    }
}

/// A loss scale far past what fp16 gradients hold: the first steps
/// overflow (on the device, gradients beyond the 32752 matmul cliff and
/// fp16's range), are skipped and the scale halved until steps are clean
/// (near the edge some batches still overflow and are skipped in turn);
/// training then goes on and its losses fall.
#[test]
fn an_overflowing_loss_scale_skips_steps_and_recovers() {
    let d = tmp();
    let out = d.path().join("run");
    let o = bin()
        .env("ANETRAIN_SIM_FAMILY", "m1")
        .args([
            "train",
            "--steps",
            "30",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--backend",
            "ane-sim",
            "--loss-scale",
            "1073741824",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    let recs = records(&out);
    let skipped: Vec<bool> = recs
        .iter()
        .map(|r| r["skipped"].as_bool().unwrap())
        .collect();
    let first_clean = skipped.iter().position(|s| !s).expect("a step recovers");
    assert!(
        first_clean >= 1,
        "the first step should overflow: {skipped:?}"
    );
    let clean: Vec<usize> = (0..recs.len()).filter(|&i| !skipped[i]).collect();
    assert!(clean.len() >= recs.len() / 3, "{skipped:?}");
    let scale = |i: usize| recs[i]["loss_scale"].as_f64().unwrap();
    assert!(scale(first_clean) < scale(0), "the scale fell");
    let loss = |i: usize| recs[i]["loss"].as_f64().unwrap();
    let last = *clean.last().unwrap();
    assert!(
        loss(last).is_finite() && loss(last) < loss(first_clean),
        "training went on after recovery"
    );
}

/// `mil check --family` judges a program by a chip's rules: the seed's FFN
/// program, which cuts its regions at width offsets, breaks the M1's
/// `width-offset-slice` rule and not the M5's; the same kernel as we build
/// it passes every rule of both.
#[test]
fn mil_check_applies_a_familys_rules() {
    let seed = common::fixture("../seed-reference/seed-mil/mha_b/ffnFused.mil");
    let line = |family: &str, p: &Path| -> Option<String> {
        let o = bin()
            .args(["mil", "check", "--family", family])
            .arg(p)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .find(|l| l.contains("width-offset-slice"))
            .map(str::to_string)
    };
    assert!(line("m1", &seed).unwrap().contains("FAIL"));
    assert!(!line("m5", &seed).unwrap().contains("FAIL"));
    let d = tmp();
    for family in ["m1", "m5"] {
        let out = d.path().join(family);
        let o = bin()
            .env("ANETRAIN_ANE_FAMILY", family)
            .args([
                "kernels",
                "dump",
                "--model",
                "qwen3-0.6b",
                "--seq",
                "256",
                "--kernel",
                "ffn_forward",
                "--out",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = bin()
            .args(["mil", "check", "--strict", "--family", family])
            .arg(out.join("ffn_forward.mil"))
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{family}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
}
