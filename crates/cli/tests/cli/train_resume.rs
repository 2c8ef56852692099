//! `anetrain train` end to end: the loss falls, checkpoints load in the
//! generator, and resumed runs — after a clean stop or a SIGKILL at an
//! arbitrary moment — end bit-identical to an uninterrupted run.

use crate::common;

use common::bin;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const FLAGS: &[&str] = &[
    "train",
    "--model",
    "tiny",
    "--seq",
    "32",
    "--batch",
    "2",
    "--accum",
    "2",
    "--seed",
    "5",
    "--save-every",
    "4",
    "--eval-every",
    "6",
];

fn train(out: &Path, steps: u64, resume: bool) -> std::process::Output {
    let mut c = bin();
    c.args(FLAGS)
        .arg("--steps")
        .arg(steps.to_string())
        .arg("--out")
        .arg(out);
    if resume {
        c.arg("--resume");
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn weights(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("model.safetensors")).unwrap()
}

/// The step of the run's committed checkpoint, if it has one.
fn committed_step(out: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(out.join("trainer/state.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["step"].as_u64()
}

fn train_losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["split"] == "train")
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn resumed_runs_are_bit_identical() {
    let full_tmp = common::tmp();
    let full = full_tmp.path().join("full");
    train(&full, 24, false);
    let reference = weights(&full);
    let losses = train_losses(&full);
    assert_eq!(losses.len(), 24);
    assert!(losses[23].1 < losses[0].1, "loss should fall: {losses:?}");

    // Clean interrupt (SIGINT: the last completed step is saved, exit
    // status 1), then resume.
    let part_tmp = common::tmp();
    let part = part_tmp.path().join("clean");
    let mut child = bin()
        .args(FLAGS)
        .args(["--steps", "24", "--out"])
        .arg(&part)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until a few steps are logged, then interrupt.
    for _ in 0..400 {
        let logged = std::fs::read_to_string(part.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if logged >= 5 || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let interrupted = child.try_wait().unwrap().is_none();
    eprintln!("SIGINT sent mid-run: {interrupted}");
    if interrupted {
        Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
    }
    let o = child.wait_with_output().unwrap();
    if interrupted {
        let e = String::from_utf8_lossy(&o.stderr);
        // A stop the user asked for: a plain line and 130, not an error.
        assert_eq!(o.status.code(), Some(130), "{e}");
        assert!(!e.contains("error:"), "{e}");
        // Stopped between steps or during one (then the step in progress
        // is abandoned): either way the last completed step is saved.
        assert!(
            e.contains("interrupted") && e.contains("is saved") && e.contains("--resume"),
            "{e}"
        );
        train(&part, 24, true);
    }
    assert!(weights(&part) == reference, "clean resume differs");
    assert_eq!(train_losses(&part), losses, "metrics after resume differ");

    // Extending a finished run continues from its checkpoint.
    train(&part, 26, true);
    assert_eq!(train_losses(&part).len(), 26);

    // SIGKILL at several moments, resuming each time, until done.
    let killed_tmp = common::tmp();
    let killed = killed_tmp.path().join("kill");
    let mut delays = [700u64, 1500, 400, 2500].into_iter().cycle();
    let mut done = false;
    for _ in 0..12 {
        // A kill can land after the last step's commit: the run is done,
        // and its resume is refused as finished (and re-links the top level).
        if committed_step(&killed) == Some(24) {
            break;
        }
        let resume = killed.join("trainer/state.json").exists();
        let mut c = bin();
        c.args(FLAGS)
            .arg("--steps")
            .arg("24")
            .arg("--out")
            .arg(&killed);
        if resume {
            c.arg("--resume");
        }
        let mut child = c
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delays.next().unwrap()));
        if child.try_wait().unwrap().is_some_and(|s| s.success()) {
            done = true;
            break;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    if !done && committed_step(&killed) == Some(24) {
        let o = bin()
            .args(FLAGS)
            .args(["--steps", "24", "--resume", "--out"])
            .arg(&killed)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("has done 24 steps already"), "{e}");
    } else if !done {
        train(&killed, 24, killed.join("trainer/state.json").exists());
    }
    assert!(
        weights(&killed) == reference,
        "resume after SIGKILL differs"
    );
    assert_eq!(train_losses(&killed), losses);

    // The result loads in the generator.
    let g = bin()
        .args([
            "generate",
            "--prompt",
            "Once",
            "--max-tokens",
            "5",
            "--model",
        ])
        .arg(&full)
        .output()
        .unwrap();
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    for d in [full, part, killed] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn resume_refuses_different_flags_and_corrupt_state() {
    let out_tmp = common::tmp();
    let out = out_tmp.path().join("flags");
    train(&out, 4, false);
    let o = bin()
        .args(FLAGS)
        .args(["--steps", "8", "--lr", "0.01", "--resume", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("different settings"));
    // A fresh run into an existing run directory is refused.
    let o = bin()
        .args(FLAGS)
        .args(["--steps", "8", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("already holds a training run"));
    // Corrupt weights are detected by the checksum.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trainer/state.json")).unwrap())
            .unwrap();
    let f = out
        .join("trainer")
        .join(state["model_file"].as_str().unwrap());
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::remove_file(&f).unwrap(); // break the hard link to the top-level copy
    std::fs::write(&f, bytes).unwrap();
    let o = bin()
        .args(FLAGS)
        .args(["--steps", "8", "--resume", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("checksum") && !e.contains("panicked"), "{e}");
    let _ = std::fs::remove_dir_all(out);
}

/// 50 steps of `tiny` with the default flags, from the same initialization
/// and data: the fp16 device path stays within 0.05 of the f32 CPU loss,
/// untiled, with every kernel tiled (`ANETRAIN_ANE_MIN_TILES=2`: two
/// blocks of every axis a kernel may split), and with the sequence tiled
/// (`ANETRAIN_ANE_SEQ_TILES=2`: two blocks of positions, or of queries in
/// the attention backward).
#[test]
fn ane_sim_training_tracks_the_cpu_run() {
    let mut losses = vec![];
    for (backend, knob, tiles) in [
        ("cpu", "ANETRAIN_ANE_MIN_TILES", "1"),
        ("ane-sim", "ANETRAIN_ANE_MIN_TILES", "1"),
        ("ane-sim", "ANETRAIN_ANE_MIN_TILES", "2"),
        ("ane-sim", "ANETRAIN_ANE_SEQ_TILES", "2"),
    ] {
        let out_tmp = common::tmp();
        let out = out_tmp.path().join(backend);
        let o = bin()
            .env(knob, tiles)
            .args([
                "train",
                "--model",
                "tiny",
                "--steps",
                "25",
                "--eval-every",
                "0",
                "--backend",
                backend,
                "--out",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let recs: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(recs.iter().all(|r| r["loss"].as_f64().unwrap().is_finite()));
        if backend == "ane-sim" {
            assert!(
                recs.iter()
                    .all(|r| r["loss_scale"].as_f64().unwrap() >= 1.0),
                "loss scale logged"
            );
        }
        losses.push(
            recs.iter()
                .map(|r| r["loss"].as_f64().unwrap())
                .collect::<Vec<_>>(),
        );
        let _ = std::fs::remove_dir_all(out);
    }
    for sim in &losses[1..] {
        for (step, (c, s)) in losses[0].iter().zip(sim).enumerate() {
            assert!(
                (c - s).abs() < 0.05,
                "step {}: cpu {c} vs ane-sim {s}",
                step + 1
            );
        }
    }
}

#[test]
fn backend_ane_fails_cleanly_off_macos() {
    if cfg!(target_os = "macos") {
        return;
    }
    let ane_tmp = common::tmp();
    let o = bin()
        .args(["train", "--backend", "ane", "--steps", "1", "--out"])
        .arg(ane_tmp.path().join("ane"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("ANE not available on this platform"), "{e}");
}

#[test]
fn trains_on_a_memory_mapped_token_file_sequentially() {
    let out_tmp = common::tmp();
    let out = out_tmp.path().join("mapped");
    std::fs::create_dir_all(&out).unwrap();
    let data = out.join("data.bin");
    let bytes: Vec<u8> = (0..3000u32)
        .flat_map(|i| ((i * 7 % 500) as u16).to_le_bytes())
        .collect();
    std::fs::write(&data, bytes).unwrap();
    let run = out.join("run");
    let o = bin()
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "3",
            "--seq",
            "16",
            "--batch",
            "2",
            "--sample",
            "sequential",
            "--data",
        ])
        .arg(&data)
        .arg("--out")
        .arg(&run)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("trainer/state.json")).unwrap())
            .unwrap();
    assert_eq!(
        state["cursor"], 6,
        "sequential sampling advances one window per sequence"
    );
    let _ = std::fs::remove_dir_all(out);
}

/// `--resume` with a larger `--steps` extends a finished run, saying the
/// schedule now spans the new total; with constant learning rate the
/// extended run equals a run set for the larger total from the start. A
/// `--steps` the run has already reached is refused.
#[test]
fn resume_extends_a_finished_run() {
    let tmp = common::tmp();
    let constant = ["--warmup", "0", "--min-lr-frac", "1"];
    let run = |out: &Path, steps: &str, resume: bool| {
        let mut c = bin();
        c.args(FLAGS)
            .args(constant)
            .args(["--steps", steps, "--out"])
            .arg(out);
        if resume {
            c.arg("--resume");
        }
        c.output().unwrap()
    };
    let straight = tmp.path().join("straight");
    assert!(run(&straight, "6", false).status.success());
    let extended = tmp.path().join("extended");
    assert!(run(&extended, "4", false).status.success());
    let o = run(&extended, "6", true);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("set for 4 steps and continues to 6"), "{e}");
    assert_eq!(train_losses(&extended), train_losses(&straight));
    assert!(
        weights(&extended) == weights(&straight),
        "the extended run differs"
    );
    let o = run(&extended, "6", true);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("has done 6 steps already") && e.contains("larger --steps"),
        "{e}"
    );
}
