//! `anetrain kernels check` and `kernels dump` end to end: every kernel of
//! Qwen3-0.6B passes its check, and a dumped program runs with `mil run`.

use crate::common;

use std::path::PathBuf;

use common::{bin, tmp};

use anetrain::kernels::{build, KernelKind, KernelOptions, Shape};
use anetrain::model::config::ModelConfig;

#[test]
fn kernels_check_passes_for_qwen3_0_6b_at_seq_256() {
    let o = bin()
        .args(["kernels", "check", "--model", "qwen3-0.6b", "--seq", "256"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        table.lines().filter(|l| l.ends_with(" ok")).count(),
        KernelKind::ALL.len(),
        "{table}"
    );
    assert!(
        table.contains("ANE rules: every kernel meets all"),
        "{table}"
    );
}

#[test]
fn kernels_dump_writes_programs_blobs_and_layouts() {
    let dir = tmp();
    let out = dir.path().join("dump");
    let o = bin()
        .args(["kernels", "dump", "--model", "tiny", "--seq", "32", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for k in KernelKind::ALL {
        let text = std::fs::read_to_string(out.join(format!("{}.mil", k.name()))).unwrap();
        mil::parse_and_validate(&text).unwrap();
    }
    // Blob files are named after their content (`rope_cos.<hash>.bin`), and
    // the programs refer to them by those names.
    let names: Vec<String> = std::fs::read_dir(out.join("weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let sdpa = std::fs::read_to_string(out.join("sdpa_forward.mil")).unwrap();
    for stem in ["mask.", "rope_cos.", "rope_sin.", "rope_rot_"] {
        let name = names
            .iter()
            .find(|n| n.starts_with(stem) && n.ends_with(".bin"))
            .unwrap_or_else(|| panic!("no {stem}* blob in {names:?}"));
        assert!(sdpa.contains(name.as_str()), "{name}");
    }
    let layout: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("layout.json")).unwrap()).unwrap();
    assert_eq!(
        layout["kernels"]["sdpa_forward"]["inputs"][0]["name"],
        "xnorm"
    );
    // mil run executes a dumped kernel with its blobs.
    let k = build(
        KernelKind::SdpaForward,
        &Shape::new(&ModelConfig::preset("tiny").unwrap(), 32),
        &KernelOptions::hf(&ModelConfig::preset("tiny").unwrap()),
    )
    .unwrap();
    let x = out.join("x.npy");
    std::fs::write(
        &x,
        npy::encode_f16(
            &[1, k.layout.in_channels, 1, k.layout.in_spatial],
            &vec![0.01; k.layout.input_elems()],
        ),
    )
    .unwrap();
    let o = bin()
        .args(["mil", "run"])
        .arg(out.join("sdpa_forward.mil"))
        .arg("--input")
        .arg(&x)
        .arg("--output")
        .arg(out.join("y.npy"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `kernels dump` for Qwen3-1.7B-, Qwen3-4B- and Llama-3.2-3B-shaped
/// `config.json` files at seq 256 (and under `ANETRAIN_ANE_MAX_DIM=4096`,
/// Qwen3-1.7B and the Qwen3-0.6B preset) writes tile programs that `mil
/// check --strict` passes under the same limit; `kernels plan` shows the
/// tiles and the compile count.
#[test]
fn larger_models_dump_tile_programs_that_pass_every_rule() {
    let configs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/configs");
    let cases = [
        ("qwen3-1.7b.json", None),
        ("qwen3-4b.json", None),
        ("llama-3.2-3b.json", None),
        ("qwen3-1.7b.json", Some("4096")),
        ("qwen3-0.6b", Some("4096")),
    ];
    for (model, limit) in cases {
        let model = match model.ends_with(".json") {
            true => configs.join(model).display().to_string(),
            false => model.to_string(),
        };
        let dir = tmp();
        let out = dir.path().join("dump");
        let mut c = bin();
        c.args([
            "kernels", "dump", "--model", &model, "--seq", "256", "--out",
        ])
        .arg(&out);
        if let Some(l) = limit {
            c.env("ANETRAIN_ANE_MAX_DIM", l);
        }
        let o = c.output().unwrap();
        assert!(
            o.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let said = String::from_utf8_lossy(&o.stdout);
        assert!(
            said.contains("ffn_forward in "),
            "{model} {limit:?}: {said}"
        );
        for k in KernelKind::ALL {
            let mut c = bin();
            c.args(["mil", "check", "--strict"])
                .arg(out.join(format!("{}.mil", k.name())));
            if let Some(l) = limit {
                c.env("ANETRAIN_ANE_MAX_DIM", l);
            }
            let o = c.output().unwrap();
            assert!(
                o.status.success(),
                "{model} {limit:?} {}: {}{}",
                k.name(),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let mut c = bin();
        c.args(["kernels", "plan", "--model", &model, "--seq", "256"]);
        if let Some(l) = limit {
            c.env("ANETRAIN_ANE_MAX_DIM", l);
        }
        let o = c.output().unwrap();
        let table = String::from_utf8_lossy(&o.stdout);
        // Twelve programs, eleven where the tiled attention backward runs fused.
        let programs = match table.contains("attention backward: sdpa_backward,") {
            true => "11 programs to compile",
            false => "12 programs to compile",
        };
        assert!(o.status.success() && table.contains(programs), "{table}");
    }
    // A limit no tiling meets: one line naming the kernel and the limit,
    // before a run creates anything.
    let dir = tmp();
    let run = dir.path().join("run");
    for args in [
        &["kernels", "plan", "--model", "tiny", "--seq", "128"][..],
        &[
            "train",
            "--backend",
            "ane-sim",
            "--steps",
            "1",
            "--out",
            run.to_str().unwrap(),
        ][..],
    ] {
        let o = bin()
            .env("ANETRAIN_ANE_MAX_DIM", "100")
            .args(args)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains("no tiling fits") && e.contains("100"), "{e}");
    }
    assert!(!run.exists());
}

/// `ANETRAIN_ANE_ATTENTION_BACKWARD`: `pair` keeps the pair where the plan
/// would fuse the attention backward (to compare the two on a chip); a
/// value it does not know stops every command in one line.
#[test]
fn the_attention_backward_form_can_be_pinned_and_a_typo_is_named() {
    let plan = |form: Option<&str>| {
        let mut c = bin();
        c.args(["kernels", "plan", "--model", "qwen3-0.6b", "--seq", "4096"]);
        if let Some(f) = form {
            c.env("ANETRAIN_ANE_ATTENTION_BACKWARD", f);
        }
        c.output().unwrap()
    };
    let said = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let fused = plan(None);
    assert!(fused.status.success());
    assert!(
        said(&fused).contains("attention backward: sdpa_backward, one program per tile"),
        "{}",
        said(&fused)
    );
    let pair = plan(Some("pair"));
    assert!(pair.status.success());
    assert!(
        said(&pair)
            .contains("attention backward: sdpa_backward1 then sdpa_backward2, tile by tile"),
        "{}",
        said(&pair)
    );
    let typo = plan(Some("fsued"));
    let err = String::from_utf8_lossy(&typo.stderr);
    assert_eq!(typo.status.code(), Some(1));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("ANETRAIN_ANE_ATTENTION_BACKWARD=fsued"),
        "{err}"
    );
}

/// `kernels plan --family m4` plans for the M4 whatever this machine is:
/// its header names the family and its tiles obey the M4's axis caps
/// (not the unknown chip's, every family's limits at once).
#[test]
fn a_plan_for_a_family_is_that_familys_plan() {
    let plan = |family: &str| {
        let o = bin()
            .env_remove("ANETRAIN_ANE_FAMILY")
            .env_remove("ANETRAIN_ANE_MAX_DIM")
            .args([
                "kernels",
                "plan",
                "--model",
                "qwen3-0.6b",
                "--seq",
                "256",
                "--family",
                family,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    for (family, caps) in [
        ("m4", ane::family::Family::M4),
        ("m1", ane::family::Family::M1),
    ] {
        let text = plan(family);
        let first = text.lines().next().unwrap();
        assert!(
            first.starts_with(&format!("chip family: {family} ")) && first.contains("--family"),
            "{first}"
        );
        let limits = caps.limits();
        assert!(
            text.contains(&format!(
                "axis caps: spatial {}, channel {}",
                limits.max_spatial, limits.max_channel
            )),
            "{text}"
        );
    }
}

/// `anetrain kernels plan ARGS` with no chip family in force: its
/// standard output, the command having succeeded.
fn plan_output<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let o = bin()
        .env_remove("ANETRAIN_ANE_FAMILY")
        .args(["kernels", "plan"])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// `--steps N` predicts the whole run: N steps of the family's predicted
/// step and the programs' compiles once, in the text and the JSON.
#[test]
fn a_plan_predicts_the_whole_run() {
    let run = |extra: &[&str]| {
        let base = [
            "--model",
            "tiny",
            "--seq",
            "128",
            "--lora-rank",
            "8",
            "--steps",
            "1000",
        ];
        plan_output(&[&base[..], extra].concat())
    };
    let v: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    assert_eq!(v["steps"], 1000);
    let m4 = &v["predicted"]["m4"];
    let (step_ms, compile_ms) = (
        m4["step_ms"].as_f64().unwrap(),
        m4["compile_ms"].as_f64().unwrap(),
    );
    let run_s = v["run_s"]["m4"].as_f64().unwrap();
    assert!(
        (run_s - (1000.0 * step_ms + compile_ms) / 1e3).abs() < 1e-9,
        "{run_s}"
    );
    // Its energy: the steps' joules in watt-hours, each step's per token.
    let (joules, mj) = (
        m4["joules_per_step"].as_f64().unwrap(),
        m4["mj_per_token"].as_f64().unwrap(),
    );
    let wh = v["run_wh"]["m4"].as_f64().unwrap();
    assert!((wh - 1000.0 * joules / 3600.0).abs() < 1e-9, "{wh}");
    let tokens = m4["tokens_per_s"].as_f64().unwrap() * step_ms / 1e3;
    assert!(
        (mj - joules * 1e3 / tokens).abs() < 1e-9 && mj > 0.0,
        "{mj}"
    );
    let text = run(&["--family", "m4"]);
    assert!(
        text.contains("1000 steps ≈ ") && text.contains("with the compiles"),
        "{text}"
    );
    assert!(
        text.contains(" mJ/token") && text.contains("Wh\n"),
        "{text}"
    );
}

/// `kernels plan --data` reads the records as `train` would: the tokens
/// a second it predicts count the records' tokens, not the padding of
/// rows shorter than --seq, and without --steps the run is one epoch;
/// every family's line says what its CPU's products alone would take,
/// and every constant a line calls unmeasured is explained.
#[test]
fn a_plan_counts_the_datas_tokens_and_explains_itself() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/chat");
    let run = |extra: &[&str]| {
        let mut args: Vec<std::ffi::OsString> = ["--seq", "128", "--lora-rank", "8", "--model"]
            .map(Into::into)
            .to_vec();
        args.extend([
            root.join("model").into(),
            "--data".into(),
            root.join("data/chat").into(),
        ]);
        args.extend(extra.iter().map(Into::into));
        plan_output(&args)
    };
    let v: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    let (examples, row_tokens) = (
        v["data"]["examples"].as_u64().unwrap(),
        v["data"]["row_tokens"].as_f64().unwrap(),
    );
    assert!(
        examples > 10 && row_tokens > 5.0 && row_tokens < 100.0,
        "{v}"
    );
    assert_eq!(v["steps"].as_u64(), Some(examples), "one epoch");
    for (family, p) in v["predicted"].as_object().unwrap() {
        let ratio = p["tokens_per_s"].as_f64().unwrap() / p["positions_per_s"].as_f64().unwrap();
        assert!(
            (ratio - row_tokens / 128.0).abs() < 1e-9,
            "{family}: {ratio}"
        );
        assert!(
            v["cpu_products_ms"][family].as_f64().unwrap() > 0.0,
            "{family}"
        );
    }
    let text = run(&[]);
    assert!(text.contains("tok/s of data ("), "{text}");
    assert!(
        text.contains("on its CPU instead (--backend cpu): ≥ "),
        "{text}"
    );
    // Every "(unmeasured: a, b)" has its explanation below.
    let mut names = 0;
    for line in text.lines() {
        if let Some((_, rest)) = line.split_once("(unmeasured: ") {
            for name in rest.split(')').next().unwrap().split(", ") {
                names += 1;
                assert!(
                    text.contains(&format!("unmeasured {name}: ")),
                    "{name}: {text}"
                );
            }
        }
    }
    assert!(
        names > 0,
        "the M2/M3 lines name their unmeasured constants: {text}"
    );
}

/// `kernels plan --batch N` plans N examples a step (run one after
/// another: N times the evaluations, the optimizer once), and
/// `--lora-targets` adapts only the projections named: mlx-lm's recipe
/// (q and v on the last layers) is cheaper than every projection.
#[test]
fn a_plan_takes_the_batch_and_the_adapted_projections() {
    let plan = |extra: &[&str]| -> serde_json::Value {
        let base = [
            "--model",
            "tiny",
            "--seq",
            "128",
            "--lora-rank",
            "8",
            "--json",
        ];
        serde_json::from_str(&plan_output(&[&base[..], extra].concat())).unwrap()
    };
    let (one, four) = (plan(&[]), plan(&["--batch", "4"]));
    let evals = |v: &serde_json::Value| v["work"]["device_evaluations"].as_u64().unwrap();
    assert_eq!(evals(&four), 4 * evals(&one));
    let tps = |v: &serde_json::Value| v["predicted"]["m4"]["tokens_per_s"].as_f64().unwrap();
    assert!(tps(&four) >= tps(&one), "{} vs {}", tps(&four), tps(&one));
    let qv = plan(&["--lora-targets", "q,v"]);
    let flop = |v: &serde_json::Value| v["work"]["device_flop"].as_f64().unwrap();
    assert!(flop(&qv) < flop(&one), "{} vs {}", flop(&qv), flop(&one));
    let o = bin()
        .args(["kernels", "plan", "--model", "tiny", "--lora-rank", "8"])
        .args(["--lora-targets", "q,x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

/// `kernels plan --seed-compat` reproduces the cost model's validation:
/// every published step beside its prediction (the fitted ones met, the
/// rows said to miss with their reason), and the seed's programs for the
/// model asked for on each family.
#[test]
fn the_seed_compat_plan_reproduces_the_validation() {
    let run = |extra: &[&str]| {
        plan_output(&[&["--seed-compat", "--model", "stories110m"][..], extra].concat())
    };
    let v: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    let rows = v["validation"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{v}");
    for r in rows {
        let error = r["error"].as_f64().unwrap();
        match (
            r["published"]["fitted"].as_bool().unwrap(),
            r["published"]["known_miss"].is_null(),
        ) {
            (true, _) => assert!(error.abs() < 0.02, "{r}"),
            (false, true) => assert!(error.abs() <= 0.35, "{r}"),
            (false, false) => assert!(error.abs() > 0.35, "{r}"),
        }
    }
    assert_eq!(v["seed_step"].as_array().unwrap().len(), 5);
    let text = run(&[]);
    assert!(
        text.contains(
            "Stories110M    m4 on the M4's table: predicted 111.0 ms, published 111.0 ms"
        ) && text.contains("; missed: "),
        "{text}"
    );
}
