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
                // At once, without the process's exit handlers: exit()
                // from this thread runs OpenBLAS's, which joins its idle
                // workers and was seen to hang there for good while the
                // run's thread waited on the checkpoint lock this one
                // holds. Nothing is left to flush: stderr is unbuffered,
                // and the run writes its files by rename.
                // SAFETY: `_exit` ends the process; it takes no pointers.
                unsafe { libc::_exit(130) };
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
                pairs,
                objective,
                base,
                resumed_at,
                steps,
            } => {
                let data = match pairs {
                    Some((t, v)) => {
                        format!("{t} train / {v} val pairs ({train_tokens} / {val_tokens} tokens)")
                    }
                    None => format!("{train_tokens} train / {val_tokens} val tokens"),
                };
                say!(
                    "training {model} ({:.2}M parameters) on {data} -> {}",
                    *params as f64 / 1e6,
                    out.display()
                );
                for line in [base, objective].into_iter().flatten() {
                    say!("{line}");
                }
                if let Some((rank, alpha, names, trainable, layers)) = lora {
                    let of = match layers {
                        Some((first, n)) => format!(
                            " of layers {first}–{} (the last {} of {n}: the backward stops at layer {first})",
                            n - 1,
                            n - first
                        ),
                        None => String::new(),
                    };
                    say!(
                        "LoRA rank {rank} alpha {alpha} on {}{of}: {:.3}M trainable parameters ({:.2}% of the base)",
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
                preference,
                val_preference,
                tokens_per_s,
                eta_s,
            } => {
                // A preference run: the reward margin and accuracy beside
                // the loss (TRL's rewards/margins, rewards/accuracies).
                let rewards = |p: &Option<anetrain::train::objective::PreferenceMetrics>| {
                    p.map(|p| format!(" margin {:.3} acc {:.2}", p.margins, p.accuracies))
                        .unwrap_or_default()
                };
                let val_txt = val
                    .map(|v| format!(" val {v:.4}{}", rewards(val_preference)))
                    .unwrap_or_default();
                let loss = format!("{loss:.4}{}", rewards(preference));
                let eta = fmt_duration(*eta_s);
                if self.tty {
                    // Step, loss and validation stay whole; the learning
                    // rate, speed and ETA go first when the line is short.
                    let essential = format!("{step}/{steps} loss {loss}{val_txt}");
                    let optional = [
                        format!("lr {lr:.2e}"),
                        format!("{tokens_per_s:.0} tok/s"),
                        format!("ETA {eta}"),
                    ];
                    let line = bar_line(
                        terminal_columns(),
                        *step as f64 / *steps as f64,
                        &essential,
                        &optional,
                    );
                    to_stderr(format_args!("\r{line}"));
                    self.bar_open = true;
                    if val.is_some() || step == steps {
                        self.close_bar();
                    }
                } else if step.is_multiple_of(self.log_every) || step == steps || val.is_some() {
                    say!(
                        "step {step}/{steps} loss {loss}{val_txt} lr {lr:.2e} {tokens_per_s:.0} tok/s ETA {eta}"
                    );
                }
            }
            Event::Finished { steps, out, chat } => {
                self.close_bar();
                let adapter = std::fs::read_to_string(out.join("adapter_config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
                let what = match adapter {
                    Some(_) => format!("LoRA adapter in {}", out.display()),
                    None => format!("model in {}", out.display()),
                };
                say!(
                    "done: {steps} steps, {what} (use it: {})",
                    generate_command(out, adapter.as_ref(), *chat)
                );
            }
        }
    }
}

/// The `anetrain generate` command that prompts what a run wrote, ready
/// to paste: the adapter on its base (`BASE[@REVISION]` as the adapter
/// names it), or the model itself; `--chat` for a run trained on chat
/// records.
fn generate_command(
    out: &std::path::Path,
    adapter: Option<&serde_json::Value>,
    chat: bool,
) -> String {
    let quoted = |s: &str| match s.contains(|c: char| c.is_whitespace() || "'\"$`\\".contains(c)) {
        true => format!("'{}'", s.replace('\'', r"'\''")),
        false => s.to_string(),
    };
    let run = quoted(&out.display().to_string());
    let model = match adapter {
        Some(a) => format!(
            "--model {}{} --adapter {run}",
            quoted(a["base_model_name_or_path"].as_str().unwrap_or("BASE")),
            a["revision"]
                .as_str()
                .map(|r| format!("@{r}"))
                .unwrap_or_default()
        ),
        None => format!("--model {run}"),
    };
    match chat {
        true => format!("anetrain generate {model} --chat --prompt \"Hello\""),
        false => format!("anetrain generate {model} --prompt \"Once upon a time\""),
    }
}

/// Columns of the terminal stderr draws on: its window size, else
/// `$COLUMNS`, else 80.
fn terminal_columns() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: `winsize` is plain integers, for which all-zero is valid.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ fills the `winsize` it is given and reads
        // nothing else; a failure leaves it zero.
        let ok = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
        if ok && ws.ws_col > 0 {
            return ws.ws_col as usize;
        }
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(80)
}

/// The progress line for a terminal of `cols` columns, `done` (0–1) of
/// the run behind `text`: a bar of up to 24 cells where it fits, the text
/// cut at the last column otherwise, padded to clear what a longer line
/// left, and never reaching the last column (where a terminal wraps).
fn bar_line(cols: usize, done: f64, essential: &str, optional: &[String]) -> String {
    let room = cols.saturating_sub(1);
    // The essential words, then each optional field that still fits, whole:
    // a number is never cut.
    let mut text = String::new();
    for word in essential.split(' ') {
        let sep = usize::from(!text.is_empty());
        if text.chars().count() + sep + word.chars().count() > room {
            break;
        }
        if sep == 1 {
            text.push(' ');
        }
        text.push_str(word);
    }
    for field in optional {
        if text.chars().count() + 1 + field.chars().count() <= room {
            text.push(' ');
            text.push_str(field);
        }
    }
    let text_len = text.chars().count();
    // "[" + cells + "] " + text
    let cells = room.saturating_sub(text_len + 3).min(24);
    let mut line = match cells >= 8 {
        true => {
            let filled = ((cells as f64 * done.clamp(0.0, 1.0)) as usize).min(cells);
            format!(
                "[{}{}] {text}",
                "#".repeat(filled),
                "-".repeat(cells - filled)
            )
        }
        false => text,
    };
    let len = line.chars().count();
    line.extend(std::iter::repeat_n(' ', room.saturating_sub(len).min(3)));
    line
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

#[cfg(test)]
mod tests {
    use super::bar_line;

    /// The line fits the terminal, bar and all where there is room; where
    /// there is not, the learning rate, speed and ETA go whole before the
    /// step, loss and validation numbers lose anything, and no number is
    /// cut (a preference run's kept validation line at 80 columns).
    #[test]
    fn the_progress_line_fits_the_terminal() {
        let essential = "102/120 loss 6.3244";
        let optional = ["lr 3.34e-5", "3490 tok/s", "ETA 0m02s"].map(String::from);
        for cols in [20, 40, 60, 80, 120] {
            let l = bar_line(cols, 0.85, essential, &optional);
            assert!(
                l.chars().count() < cols,
                "{cols}: '{l}' ({})",
                l.chars().count()
            );
        }
        let wide = bar_line(120, 0.5, essential, &optional);
        assert!(
            wide.starts_with(
                "[############------------] 102/120 loss 6.3244 lr 3.34e-5 3490 tok/s ETA 0m02s"
            ),
            "{wide}"
        );
        let eighty = bar_line(80, 1.0, essential, &optional);
        assert!(
            eighty.starts_with("[####") && eighty.contains("ETA 0m02s"),
            "{eighty}"
        );
        let dpo = "40/50 loss 0.6412 margin 0.118 acc 0.62 val 0.6533 margin 0.087 acc 0.38";
        let kept = bar_line(80, 0.8, dpo, &optional);
        assert!(kept.trim_end().ends_with("acc 0.38"), "{kept}");
        assert!(kept.chars().count() < 80, "{kept}");
        let narrow = bar_line(30, 0.8, dpo, &optional);
        for word in narrow.split_whitespace() {
            assert!(
                dpo.split(' ').any(|w| w == word),
                "'{word}' cut in '{narrow}'"
            );
        }
    }
}
