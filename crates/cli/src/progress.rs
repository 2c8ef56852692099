//! How a training run looks on the terminal: the library reports
//! [`Event`]s, this draws them — a progress bar on a terminal, a line every
//! `log_every` steps otherwise (logs, CI) — and turns SIGINT/SIGTERM into a
//! request to stop at the next sequence (a second one exits at once).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use anetrain::train::Event;

/// Set once stderr's reader has gone (a closed pipe: `| head`, a closed
/// terminal): nothing more is printed, and the run goes on.
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

/// Writes to stderr. A write that fails ends printing for the rest of the
/// process, never the process: a training run outlives its reader.
pub fn to_stderr(args: std::fmt::Arguments) {
    if STDERR_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut e = std::io::stderr().lock();
    if e.write_fmt(args).and_then(|()| e.flush()).is_err() {
        STDERR_GONE.store(true, Ordering::Relaxed);
    }
}

/// `eprintln!` through [`to_stderr`].
macro_rules! say {
    () => {
        $crate::progress::to_stderr(format_args!("\n"))
    };
    ($($t:tt)*) => {
        $crate::progress::to_stderr(format_args!("{}\n", format_args!($($t)*)))
    };
}
pub(crate) use say;

/// Set by SIGINT/SIGTERM: abandon the step in progress, checkpoint the last
/// completed one, stop.
static STOP: AtomicBool = AtomicBool::new(false);

/// The stop flag, with the SIGINT/SIGTERM handler installed (once).
pub fn stop_flag() -> &'static AtomicBool {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The first SIGINT/SIGTERM asks the run to stop at the next
        // sequence and save the last completed step; a second one exits at
        // once, writing nothing (the last checkpoint stays valid: each is
        // committed by one rename).
        let _ = ctrlc::set_handler(|| {
            if STOP.swap(true, Ordering::SeqCst) {
                // A fresh run without a checkpoint leaves no directory.
                if anetrain::train::abandon_fresh_run() {
                    say!("\nstopped at once; nothing was saved (the new run directory is removed)");
                } else {
                    say!("\nstopped at once; the last saved checkpoint is intact");
                }
                std::process::exit(130);
            }
        });
    });
    &STOP
}

/// Draws a run's events on stderr.
pub struct Progress {
    tty: bool,
    /// Lines every this many steps when not on a terminal.
    log_every: u64,
    /// A progress bar is on the current line.
    bar_open: bool,
}

impl Progress {
    pub fn new(log_every: u64) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            log_every: log_every.max(1),
            bar_open: false,
        }
    }

    /// Ends an open progress bar's line.
    fn close_bar(&mut self) {
        if std::mem::take(&mut self.bar_open) {
            say!();
        }
    }

    pub fn event(&mut self, e: &Event) {
        match e {
            Event::Started {
                model,
                params,
                train_tokens,
                val_tokens,
                out,
                lora,
                resumed_at,
                steps,
            } => {
                say!(
                    "training {model} ({:.2}M parameters) on {train_tokens} train / {val_tokens} val tokens -> {}",
                    *params as f64 / 1e6,
                    out.display()
                );
                if let Some((rank, alpha, names, trainable)) = lora {
                    say!(
                        "LoRA rank {rank} alpha {alpha} on {}: {:.3}M trainable parameters ({:.2}% of the base)",
                        names.join(","),
                        *trainable as f64 / 1e6,
                        100.0 * *trainable as f64 / *params as f64
                    );
                }
                if let Some(step) = resumed_at {
                    say!("resumed at step {step} of {steps}");
                }
            }
            Event::Note(text) => {
                self.close_bar();
                say!("note: {text}");
            }
            Event::Warning(text) => {
                self.close_bar();
                say!("warning: {text}");
            }
            Event::Skipped { step, reason } => {
                self.close_bar();
                say!("step {step}: {reason}");
            }
            Event::Step {
                step,
                steps,
                loss,
                val,
                lr,
                tokens_per_s,
                eta_s,
            } => {
                let val_txt = val.map(|v| format!(" val {v:.4}")).unwrap_or_default();
                let eta = fmt_duration(*eta_s);
                if self.tty {
                    let width = 24;
                    let filled = (width as f64 * *step as f64 / *steps as f64) as usize;
                    to_stderr(format_args!(
                        "\r[{}{}] {step}/{steps} loss {loss:.4}{val_txt} lr {lr:.2e} {tokens_per_s:.0} tok/s ETA {eta}   ",
                        "#".repeat(filled),
                        "-".repeat(width - filled),
                    ));
                    self.bar_open = true;
                    if val.is_some() || step == steps {
                        self.close_bar();
                    }
                } else if step.is_multiple_of(self.log_every) || step == steps || val.is_some() {
                    say!(
                        "step {step}/{steps} loss {loss:.4}{val_txt} lr {lr:.2e} {tokens_per_s:.0} tok/s ETA {eta}"
                    );
                }
            }
            Event::Finished { steps, out } => {
                self.close_bar();
                let adapter = std::fs::read_to_string(out.join("adapter_config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
                match adapter {
                    Some(a) => say!(
                        "done: {steps} steps, LoRA adapter in {} (use it: anetrain generate --model {} --adapter {})",
                        out.display(),
                        a["base_model_name_or_path"].as_str().unwrap_or("BASE"),
                        out.display()
                    ),
                    None => say!("done: {steps} steps, model in {}", out.display()),
                }
            }
        }
    }
}

impl Drop for Progress {
    /// An error message after an interrupted bar starts on its own line.
    fn drop(&mut self) {
        self.close_bar();
    }
}

fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}
