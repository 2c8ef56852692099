//! `metrics.jsonl`: one line per step and per validation, truncated to the
//! checkpoint on resume.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use super::event::StepRecord;
use super::objective::PreferenceMetrics;
use crate::util::fsutil::write_atomic;

/// Drops metrics lines of steps after `step` (left by a run killed after
/// its last checkpoint), so a resumed run logs each step once.
pub(super) fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .collect();
    let mut body = kept.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    write_atomic(path, body.as_bytes())
}

/// `metrics.jsonl`: one line per step, plus validation lines.
pub(super) struct Metrics {
    pub(super) file: std::fs::File,
}

impl Metrics {
    /// Opens the run's metrics file: a fresh one, or on resume the existing
    /// one with lines after the checkpoint's `step` dropped.
    pub(super) fn open(out: &Path, resume_step: Option<u64>) -> Result<Metrics> {
        let path = out.join("metrics.jsonl");
        match resume_step {
            Some(step) => truncate_metrics(&path, step)?,
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open '{}'", path.display()))?;
        Ok(Metrics { file })
    }

    pub(super) fn log_step(
        &mut self,
        step: u64,
        st: &StepRecord,
        tokens_per_s: f64,
        total: f64,
    ) -> Result<()> {
        let [fwd, loss, bwd, opt] = st.times;
        let mut rec = serde_json::json!({
            "step": step, "split": "train", "loss": st.loss, "lr": st.lr, "grad_norm": st.grad_norm,
            "tokens_per_s": tokens_per_s, "skipped": !st.finite, "loss_scale": st.loss_scale,
            "time": {"forward": fwd, "loss": loss, "backward": bwd, "optimizer": opt, "total": total},
        });
        if let (Some(p), Some(obj)) = (&st.preference, rec.as_object_mut()) {
            obj.extend(p.json());
        }
        writeln!(self.file, "{rec}")?;
        Ok(())
    }

    pub(super) fn val(
        &mut self,
        step: u64,
        loss: f64,
        preference: Option<&PreferenceMetrics>,
    ) -> Result<()> {
        let mut rec = serde_json::json!({"step": step, "split": "val", "loss": loss});
        if let (Some(p), Some(obj)) = (preference, rec.as_object_mut()) {
            obj.extend(p.json());
        }
        writeln!(self.file, "{rec}")?;
        Ok(())
    }

    /// On disk before a checkpoint that covers these lines.
    pub(super) fn sync(&self) -> Result<()> {
        Ok(self.file.sync_all()?)
    }
}
