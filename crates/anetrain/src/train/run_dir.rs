//! The run directory: its default name, and removal of a fresh one that
//! fails or is interrupted before its first checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::checkpoint;

/// A default run directory: `runs/<model>-<UTC date>-<time>`.
pub fn default_out(model: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86400, secs % 86400);
    // civil-from-days (Howard Hinnant)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    let name = Path::new(model)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    PathBuf::from("runs").join(format!(
        "{name}-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

/// A run directory this invocation created: removed on drop (with any
/// parent directories created for it) unless a checkpoint was written into
/// it, so a run that fails before its first checkpoint — bad data, model,
/// device — leaves nothing behind.
pub(super) struct NewRunDir {
    pub(super) dir: PathBuf,
    /// The outermost directory that did not exist before.
    pub(super) created: Option<PathBuf>,
}

/// The directory a fresh run created and the outermost one it made, while
/// that run lives: what [`abandon_fresh_run`] removes.
pub(super) static FRESH_RUN: std::sync::Mutex<Option<(PathBuf, PathBuf)>> =
    std::sync::Mutex::new(None);

impl NewRunDir {
    pub(super) fn create(dir: &Path) -> Result<NewRunDir> {
        let created = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .last()
            .map(Path::to_path_buf);
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        if let Some(top) = &created {
            *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((dir.to_path_buf(), top.clone()));
        }
        Ok(NewRunDir {
            dir: dir.to_path_buf(),
            created,
        })
    }
}

impl Drop for NewRunDir {
    fn drop(&mut self) {
        *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(top) = &self.created {
            if !checkpoint::state_path(&self.dir).exists() {
                let _ = std::fs::remove_dir_all(top);
            }
        }
    }
}

/// For a process about to exit at once (a second signal): removes the
/// directory a fresh run in this process created, if it holds no
/// checkpoint yet, and says whether it did. It waits for a checkpoint
/// being written and keeps any later one from starting (the lock is never
/// released): call it only right before exiting.
pub fn abandon_fresh_run() -> bool {
    std::mem::forget(checkpoint::SAVING.lock().unwrap_or_else(|e| e.into_inner()));
    remove_fresh_run()
}

/// Removes the fresh run's directories if they hold no checkpoint.
pub(super) fn remove_fresh_run() -> bool {
    let fresh = FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match fresh {
        Some((dir, top)) if !checkpoint::state_path(&dir).exists() => {
            let _ = std::fs::remove_dir_all(top);
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a second signal's immediate exit does to a fresh run: removes
    /// the directories the run created while no checkpoint exists, keeps
    /// them once one does, and touches nothing when no run is fresh.
    #[test]
    fn abandoning_a_fresh_run_removes_only_what_holds_no_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("runs/a");
        let run = NewRunDir::create(&dir).unwrap();
        std::fs::write(dir.join("metrics.jsonl"), "").unwrap();
        assert!(remove_fresh_run());
        assert!(!root.path().join("runs").exists());
        drop(run);

        let run = NewRunDir::create(&dir).unwrap();
        std::fs::create_dir_all(checkpoint::trainer_dir(&dir)).unwrap();
        std::fs::write(checkpoint::state_path(&dir), "{}").unwrap();
        assert!(!remove_fresh_run());
        assert!(checkpoint::state_path(&dir).is_file());
        drop(run);
        assert!(!remove_fresh_run());
        assert!(dir.exists());
    }
}
