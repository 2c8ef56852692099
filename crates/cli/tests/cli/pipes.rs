//! Readers that go away: a training run outlives the pipe its progress
//! goes to (`| head`, `| tee` killed, a closed terminal) and saves; a
//! printing command whose reader closes ends quietly, as Unix tools do.

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;

use common::{bin, records, tmp};

#[test]
fn a_training_run_finishes_and_saves_after_its_readers_exit() {
    let d = tmp();
    let out = d.path().join("run");
    let mut child = bin()
        .args([
            "train",
            "--steps",
            "40",
            "--seq",
            "32",
            "--eval-every",
            "0",
            "--log-every",
            "1",
            "--out",
        ])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both readers take one line at most, then go away.
    let mut first = String::new();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    err.read_line(&mut first).unwrap();
    drop(err);
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?} after '{first}'");
    assert_eq!(records(&out).len(), 40, "every step is in metrics.jsonl");
    assert!(out.join("model.safetensors").is_file());
    assert!(out.join("trainer").exists());
}

#[test]
fn a_printing_command_ends_quietly_when_its_reader_exits() {
    // The reader is gone before the command prints its first byte (it
    // plans a 4B model first): its first write meets a closed pipe.
    let config = common::fixture("../configs/qwen3-4b.json");
    let mut child = bin()
        .args(["kernels", "plan", "--seq", "4096", "--json", "--model"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    // Killed by SIGPIPE, as `cat` or `grep` would be: status 141 in a shell.
    assert_eq!(status.signal(), Some(13), "{status:?}: {err}");
    assert!(err.is_empty(), "a closed pipe is no error to report: {err}");
}
