//! `--backend ane` — the macOS device — run end to end on Linux against
//! the stand-in runtime (`crates/ane-standin`): training, eval and
//! generation print what `--backend ane-sim` prints, and at exit nothing
//! is leaked, nothing is locked and no call broke the references' pattern.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{bin, records, tmp};

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

/// Runs `anetrain args` on the stand-in; returns its output and the
/// stand-in's exit report.
fn on_standin(args: &[&str], report: &Path) -> (Output, serde_json::Value) {
    let o = bin()
        .args(args)
        .env("ANETRAIN_ANE_RUNTIME", library())
        .env("ANE_STANDIN_REPORT", report)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{args:?} on the stand-in failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r = std::fs::read_to_string(report).expect("the stand-in writes its report at exit");
    (o, serde_json::from_str(&r).unwrap())
}

fn on_sim(args: &[&str]) -> Output {
    let o = bin().args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// No object alive, no surface locked, no violation; evaluations happened
/// and each locked its buffers a bounded number of times (one lock per
/// region written or block read; a kernel has at most 16).
fn assert_clean(r: &serde_json::Value) {
    assert_eq!(r["live_objects"], serde_json::json!({}), "{r}");
    assert_eq!(r["locked_surfaces"], 0, "{r}");
    assert_eq!(r["open_pools"], 0, "{r}");
    assert_eq!(r["violations"], serde_json::json!([]), "{r}");
    let evals = r["evaluations"].as_u64().unwrap();
    assert!(evals > 0, "{r}");
    assert!(r["locks_taken"].as_u64().unwrap() <= 16 * evals, "{r}");
}

fn losses(dir: &Path) -> Vec<String> {
    records(dir)
        .iter()
        .filter_map(|r| r.get("loss").map(|l| l.to_string()))
        .collect()
}

#[test]
fn train_eval_and_generate_on_the_standin_match_the_simulator() {
    let d = tmp();
    let (ane_run, sim_run) = (d.path().join("ane"), d.path().join("sim"));
    let report = d.path().join("report.json");
    let train = |backend: &str, out: &Path| -> Vec<String> {
        let out = out.to_str().unwrap().to_string();
        let mut args = vec![
            "train",
            "--model",
            "tiny",
            "--steps",
            "20",
            "--seed",
            "3",
            "--backend",
        ];
        args.push(backend);
        args.extend(["--out", &out]);
        args.iter().map(|s| s.to_string()).collect()
    };
    let ane_args = train("ane", &ane_run);
    let args: Vec<&str> = ane_args.iter().map(String::as_str).collect();
    let (_, r) = on_standin(&args, &report);
    assert_clean(&r);
    let sim_args = train("ane-sim", &sim_run);
    on_sim(&sim_args.iter().map(String::as_str).collect::<Vec<_>>());

    let (a, s) = (losses(&ane_run), losses(&sim_run));
    assert!(a.len() >= 20, "{a:?}");
    assert_eq!(
        a, s,
        "losses differ between --backend ane (stand-in) and ane-sim"
    );
    assert_eq!(
        std::fs::read(ane_run.join("model.safetensors")).unwrap(),
        std::fs::read(sim_run.join("model.safetensors")).unwrap()
    );

    let model = ane_run.to_str().unwrap();
    let text = d.path().join("text.txt");
    std::fs::write(
        &text,
        "Once upon a time there was a little dog. ".repeat(20),
    )
    .unwrap();
    let text = text.to_str().unwrap();
    let eval = ["eval", "--model", model, "--data", text, "--seq", "64"];
    let (e_ane, r) = on_standin(&[&eval[..], &["--backend", "ane"]].concat(), &report);
    assert_clean(&r);
    let e_sim = on_sim(&[&eval[..], &["--backend", "ane-sim"]].concat());
    assert_eq!(
        String::from_utf8_lossy(&e_ane.stdout),
        String::from_utf8_lossy(&e_sim.stdout)
    );

    let generate = [
        "generate",
        "--model",
        model,
        "--prompt",
        "Once upon",
        "--max-tokens",
        "24",
        "--seed",
        "1",
    ];
    let (g_ane, r) = on_standin(&[&generate[..], &["--backend", "ane"]].concat(), &report);
    assert_clean(&r);
    let g_sim = on_sim(&[&generate[..], &["--backend", "ane-sim"]].concat());
    assert_eq!(
        String::from_utf8_lossy(&g_ane.stdout),
        String::from_utf8_lossy(&g_sim.stdout)
    );
    assert!(!g_ane.stdout.is_empty());
}

#[test]
fn a_missing_runtime_library_is_one_clear_line() {
    let d = tmp();
    let o = bin()
        .args(["train", "--backend", "ane", "--steps", "1", "--out"])
        .arg(d.path().join("run"))
        .env("ANETRAIN_ANE_RUNTIME", d.path().join("nope.so"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("nope.so"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

fn report_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn doctor_reports_the_simulator_the_standin_and_failures() {
    let d = tmp();
    let json = d.path().join("doctor.json");
    let args = |model: &str| -> Vec<String> {
        [
            "doctor", "--model", model, "--seq", "32", "--steps", "3", "--evals", "2", "--report",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([json.to_str().unwrap().to_string()])
        .collect()
    };

    // No Neural Engine here: the simulator stands in, and the verdict says
    // nothing about hardware was shown.
    let o = bin().args(args("tiny")).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = report_json(&json);
    assert_eq!(r["device"], "ane-sim");
    // Every kernel, the fused attention backward among them.
    let every = anetrain::kernels::KernelKind::ALL.len();
    assert_eq!(r["kernels"].as_array().unwrap().len(), every);
    assert_eq!(r["training"]["device_losses"].as_array().unwrap().len(), 3);
    assert!(
        r["verdict"]
            .as_str()
            .unwrap()
            .starts_with("PASS on the simulator only"),
        "{r}"
    );
    let md = String::from_utf8_lossy(&o.stdout);
    assert!(
        md.contains("| sdpa_forward |") && md.contains("**PASS"),
        "{md}"
    );

    // AneDevice over the stand-in runtime: every kernel and the training
    // steps agree with the simulator, and nothing is left behind.
    let standin_report = d.path().join("standin.json");
    let argv = args("tiny");
    let (_, s) = on_standin(
        &argv.iter().map(String::as_str).collect::<Vec<_>>(),
        &standin_report,
    );
    assert_clean(&s);
    let r = report_json(&json);
    assert_eq!(r["device"], "ane");
    assert_eq!(r["ok"], true, "{r}");
    for k in r["kernels"].as_array().unwrap() {
        assert_eq!(k["max_rel_error"], 0.0, "{k}");
        assert!(k["compile_ms"].as_f64().is_some(), "{k}");
    }
    assert_eq!(r["training"]["device_losses"], r["training"]["sim_losses"]);
    assert!(r["verdict"].as_str().unwrap().contains("stand-in"), "{r}");

    // A model whose FFN is wider than the device allows: each failure is a
    // line naming the kernel, the run still finishes, the report is written
    // and the exit status is 1.
    // (Wider than a device whose limit no tiling of this model meets.)
    let wide = common::fixture("llama/model");
    std::fs::remove_file(&json).unwrap();
    let o = bin()
        .args(args(wide.to_str().unwrap()))
        .env("ANETRAIN_ANE_RUNTIME", library())
        .env("ANETRAIN_ANE_MAX_DIM", "100")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        !e.contains("panicked") && !e.contains("internal error"),
        "{e}"
    );
    assert!(
        e.lines().last().unwrap().starts_with("error: doctor found"),
        "{e}"
    );
    let r = report_json(&json);
    assert_eq!(r["ok"], false);
    let failures: Vec<&str> = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("tiling: ") && f.contains("100")),
        "{failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("kernel ffn_forward: compile:") && f.contains("max-dim")),
        "{failures:?}"
    );
    assert!(r["verdict"].as_str().unwrap().starts_with("FAIL"), "{r}");
}
