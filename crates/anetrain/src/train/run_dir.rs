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
        let created = Self::missing(dir);
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create '{}'", dir.display()))?;
        Ok(Self::made(dir, created))
    }

    /// Creates `dir` itself only if it does not exist (its parents as
    /// needed): `None` when another run has it already.
    fn create_new(dir: &Path) -> Result<Option<NewRunDir>> {
        let created = Self::missing(dir);
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create '{}'", parent.display()))?;
        }
        match std::fs::create_dir(dir) {
            Ok(()) => Ok(Some(Self::made(dir, created))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot create '{}'", dir.display())),
        }
    }

    /// The outermost of `dir` and its ancestors that does not exist yet.
    fn missing(dir: &Path) -> Option<PathBuf> {
        dir.ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .last()
            .map(Path::to_path_buf)
    }

    fn made(dir: &Path, created: Option<PathBuf>) -> NewRunDir {
        if let Some(top) = &created {
            *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((dir.to_path_buf(), top.clone()));
        }
        NewRunDir {
            dir: dir.to_path_buf(),
            created,
        }
    }

    /// Never removed: the directory turned out to be another run's.
    fn keep(mut self) {
        self.created = None;
    }
}

impl Drop for NewRunDir {
    fn drop(&mut self) {
        *FRESH_RUN.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(top) = &self.created {
            if !checkpoint::state_path(&self.dir).exists() {
                remove_created(&self.dir, top);
            }
        }
    }
}

/// Removes `dir`, then each parent up to `top` that is left empty (a
/// parent such as `runs/` may hold another run's directory by now).
fn remove_created(dir: &Path, top: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    for a in dir.ancestors().skip(1) {
        if !a.starts_with(top) || std::fs::remove_dir(a).is_err() {
            break;
        }
    }
}

/// The file in a run directory whose lock the training process holds for
/// the run's life (its pid inside, for the message of the run refused).
pub const LOCK_FILE: &str = ".lock";

/// An exclusive lock on a run directory, held until dropped (or the
/// process ends): a second run into the same directory is refused. A run
/// that ends removes the file (still holding the lock as it does), so a
/// finished run directory holds only the run; one killed leaves it
/// unlocked, with its pid.
pub(super) struct RunLock {
    #[allow(dead_code)]
    file: std::fs::File,
    path: PathBuf,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl RunLock {
    pub(super) fn acquire(dir: &Path) -> Result<RunLock> {
        use std::io::{Read, Write};
        let path = dir.join(LOCK_FILE);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open '{}'", path.display()))?;
        match f.try_lock() {
            Ok(()) => {
                f.set_len(0)
                    .and_then(|()| writeln!(f, "{}", std::process::id()))
                    .with_context(|| format!("cannot write '{}'", path.display()))?;
                Ok(RunLock { file: f, path })
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                anyhow::bail!(
                    "'{}' is in use by another training run (pid {}); wait for it to finish, or choose another --out",
                    dir.display(),
                    pid.trim()
                )
            }
            Err(std::fs::TryLockError::Error(e)) => {
                Err(e).with_context(|| format!("cannot lock '{}'", path.display()))
            }
        }
    }
}

/// Claims the run directory `out` for this process: created if it does
/// not exist and locked for the run's life. With `default_name`, a name
/// another run has taken gets the first free suffix (`-2`, `-3`, …), so
/// runs started in the same second never share a directory; returns the
/// directory claimed. A directory another process is training in is
/// refused; so is a fresh run into one that holds a run by the time the
/// lock is taken.
pub(super) fn claim(
    out: &Path,
    default_name: bool,
    resume: bool,
) -> Result<(PathBuf, NewRunDir, RunLock)> {
    let (dir, made) = if default_name && !resume {
        let mut n = 1;
        loop {
            let dir = match n {
                1 => out.to_path_buf(),
                _ => PathBuf::from(format!("{}-{n}", out.display())),
            };
            if let Some(made) = NewRunDir::create_new(&dir)? {
                break (dir, made);
            }
            n += 1;
        }
    } else {
        (out.to_path_buf(), NewRunDir::create(out)?)
    };
    let lock = match RunLock::acquire(&dir) {
        Ok(l) => l,
        Err(e) => {
            made.keep();
            return Err(e);
        }
    };
    if !resume && checkpoint::state_path(&dir).exists() {
        made.keep();
        anyhow::bail!(
            "'{}' already holds a training run; pass --resume to continue it or choose another --out",
            dir.display()
        );
    }
    Ok((dir, made, lock))
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

    /// [`FRESH_RUN`] is the process's: tests that create run directories
    /// take turns, or one's removal could take the other's directory.
    static FRESH_RUN_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        FRESH_RUN_TESTS.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A default name another run has taken gets a suffix; a directory
    /// another process holds is refused in one line naming its pid and
    /// left in place; a created directory is removed with only the parents
    /// left empty.
    #[test]
    fn run_directories_are_claimed_once() {
        let _turn = one_at_a_time();
        let d = tempfile::tempdir().unwrap();
        let base = d.path().join("runs/tiny-20261206-031500");
        let (a, _made_a, _lock_a) = claim(&base, true, false).unwrap();
        assert_eq!(a, base);
        let (b, made_b, lock_b) = claim(&base, true, false).unwrap();
        assert_eq!(b, d.path().join("runs/tiny-20261206-031500-2"));
        // The same directory, asked for by name while its run holds it.
        let e = claim(&base, false, false).err().unwrap().to_string();
        assert!(
            e.contains("in use by another training run")
                && e.contains(&std::process::id().to_string()),
            "{e}"
        );
        assert!(base.is_dir(), "the holder's directory stays");
        // A failed run's directory goes; `runs/` stays for the other run.
        drop((made_b, lock_b));
        assert!(!b.exists() && base.is_dir());
    }

    /// What a second signal's immediate exit does to a fresh run: removes
    /// the directories the run created while no checkpoint exists, keeps
    /// them once one does, and touches nothing when no run is fresh.
    #[test]
    fn abandoning_a_fresh_run_removes_only_what_holds_no_checkpoint() {
        let _turn = one_at_a_time();
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
