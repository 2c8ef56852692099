//! A run directory belongs to one process: two runs into the same `--out`
//! never both report success, and runs under default names never share a
//! directory.

use crate::common;

use std::process::Stdio;

use common::{bin, records, tmp};

#[test]
fn two_runs_into_one_directory_one_runs_the_other_is_refused() {
    let d = tmp();
    let out = d.path().join("twin");
    let spawn = |lr: &str| {
        bin()
            .args([
                "train",
                "--steps",
                "60",
                "--seq",
                "32",
                "--eval-every",
                "0",
                "--lr",
                lr,
                "--out",
            ])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn("1e-3"), spawn("2e-3"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let ok: Vec<bool> = [&a, &b].iter().map(|o| o.status.success()).collect();
    assert_eq!(
        ok.iter().filter(|x| **x).count(),
        1,
        "{}\n---\n{}",
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr)
    );
    let (winner_lr, loser) = if ok[0] { (1e-3, &b) } else { (2e-3, &a) };
    let e = String::from_utf8_lossy(&loser.stderr);
    let last = e.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: ")
            && (last.contains("in use by another training run (pid ")
                || last.contains("already holds a training run")),
        "{e}"
    );
    // The directory's metrics are the winner's: 60 steps at its peak rate.
    let r = records(&out);
    assert_eq!(r.len(), 60);
    let peak = r
        .iter()
        .map(|x| x["lr"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        (peak - winner_lr).abs() < 1e-12,
        "peak lr {peak}, winner {winner_lr}"
    );
}

#[test]
fn runs_under_default_names_get_directories_of_their_own() {
    let d = tmp();
    let spawn = || {
        bin()
            .current_dir(d.path())
            .args(["train", "--steps", "2", "--seq", "32", "--eval-every", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let runs: Vec<_> = (0..3).map(|_| spawn()).collect();
    for r in runs {
        let o = r.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let dirs: Vec<_> = std::fs::read_dir(d.path().join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    for dir in dirs {
        assert_eq!(records(&dir).len(), 2, "{}", dir.display());
    }
}
