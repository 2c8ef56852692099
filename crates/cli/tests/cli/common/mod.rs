//! Helpers shared by the command-line tests: the binary, temporary
//! directories, the one-line-error check, runs and their metrics.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `anetrain` binary under test, reading (and `doctor` writing) its
/// device profile in a fresh directory of the build's for every command,
/// never the user's configuration directory (a test that wants one run to
/// read another's profile sets `ANETRAIN_CONFIG_DIR` itself), and playing
/// no chip family unless a test says.
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_anetrain"));
    c.env("ANETRAIN_CONFIG_DIR", config_dir())
        .env_remove("ANETRAIN_SIM_FAMILY")
        .env_remove("ANETRAIN_ANE_FAMILY");
    c
}

/// A configuration directory no other command uses, under the build's
/// directory for test files.
pub fn config_dir() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("config-{}-{n}", std::process::id()))
}

/// A fresh temporary directory, removed when dropped.
pub fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("anetrain-test-")
        .tempdir()
        .expect("a temporary directory")
}

/// `testdata/fixtures/<path>` (written by `scripts/make_fixtures.py`).
pub fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(path)
}

/// Runs the binary with `args` and asserts it fails with exit status 1 and
/// one clean `error:` line on stderr mentioning every `needle`.
pub fn fails(args: &[&str], needles: &[&str]) {
    let o = bin().args(args).output().unwrap();
    one_line_error(&o, &format!("{args:?}"), needles);
}

/// Asserts `o` is a failure with exit status 1 and one clean `error:` line
/// on stderr mentioning every `needle`; `what` names the command.
pub fn one_line_error(o: &Output, what: &str, needles: &[&str]) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{what}: status {:?}, stderr {e}",
        o.status
    );
    assert!(
        !e.contains("panicked") && !e.contains("internal error") && !e.contains("backtrace"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "one line expected: {e}");
    assert!(e.starts_with("error: "), "{e}");
    for n in needles {
        assert!(e.contains(n), "stderr should mention {n:?}: {e}");
    }
}

/// Runs the binary with `args` plus `--out out`; asserts success.
pub fn run(args: &[&str], out: &Path) -> Output {
    let o = bin().args(args).arg("--out").arg(out).output().unwrap();
    assert!(
        o.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Every line of a run's `metrics.jsonl`.
pub fn records(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A `tiny` model saved as a model directory (one full-training step from
/// the preset's random weights), made once per test binary: the base of
/// LoRA tests, since LoRA needs a saved base.
pub fn tiny_base() -> PathBuf {
    static BASE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tiny-base-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let args = ["train", "--model", "tiny", "--seq", "32", "--batch", "2"];
        let rest = ["--steps", "1", "--eval-every", "0", "--backend", "cpu"];
        run(&[&args[..], &rest[..]].concat(), &dir);
        dir
    })
    .clone()
}

/// The two runs of an exact-resume check, as [`resume_runs`] left them.
pub struct ResumeRuns {
    /// `args(total)` in one go.
    pub straight: PathBuf,
    /// `args(first)`, then `args(total) --resume` in the same directory.
    pub resumed: PathBuf,
}

impl ResumeRuns {
    /// Asserts that `file` holds the same bytes in both runs.
    pub fn assert_same(&self, file: &str) {
        let read = |d: &Path| std::fs::read(d.join(file)).unwrap();
        assert!(
            read(&self.straight) == read(&self.resumed),
            "{file}: the resumed run differs from the straight one"
        );
    }
}

/// Trains `args(total)` into `dir/straight`, and `args(first)` then
/// `args(total)` with `--resume` into `dir/resumed` (`args(n)` being a
/// run's flags for `--steps n`, without `--out`): the runs every
/// exact-resume test compares.
pub fn resume_runs(
    dir: &Path,
    args: impl Fn(&str) -> Vec<String>,
    first: &str,
    total: &str,
) -> ResumeRuns {
    let go = |a: Vec<String>, out: &Path| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run(&a, out);
    };
    let (straight, resumed) = (dir.join("straight"), dir.join("resumed"));
    go(args(total), &straight);
    go(args(first), &resumed);
    let mut again = args(total);
    again.push("--resume".into());
    go(again, &resumed);
    ResumeRuns { straight, resumed }
}
