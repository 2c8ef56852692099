//! The `anetrain` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod awake;
mod base_check;
mod cmd_bench;
mod cmd_convert;
mod cmd_doctor;
mod cmd_eval;
mod cmd_export;
mod cmd_generate;
mod cmd_info;
mod cmd_kernels;
mod cmd_merge;
mod cmd_mil;
mod cmd_model;
mod cmd_plot;
mod cmd_quantize;
mod cmd_tokenize;
mod cmd_train;
mod hub_download;
mod plot;
mod progress;

use anetrain::util::choice::Choice;
use anetrain::util::fsutil;

/// A parser for the values of a library [`Choice`], listing them (with
/// their descriptions) in `--help`: any case is accepted, and a value that
/// selects nothing is one line naming the accepted ones, the nearest
/// (`dop` → `dpo`), or why it is not offered ([`Choice::NOT_BUILT`]).
fn choice<T: Choice + Clone + Send + Sync>() -> ChoiceParser<T> {
    ChoiceParser(std::marker::PhantomData)
}

#[derive(Clone)]
struct ChoiceParser<T>(std::marker::PhantomData<T>);

impl<T: Choice + Clone + Send + Sync> clap::builder::TypedValueParser for ChoiceParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let given = value.to_string_lossy();
        let wanted = given.trim().to_lowercase();
        if let Some(v) = T::from_name(&wanted) {
            return Ok(v);
        }
        let names: Vec<&str> = T::CHOICES.iter().map(|&(_, n, _)| n).collect();
        let flag = arg.map_or(String::new(), |a| format!(" for '{a}'"));
        let why = match T::NOT_BUILT.iter().find(|(n, _)| *n == wanted) {
            Some((_, why)) => format!("{why}; "),
            None => String::new(),
        };
        let nearest = names
            .iter()
            .map(|n| (strsim::damerau_levenshtein(n, &wanted), *n))
            .min()
            .filter(|&(d, _)| d <= 2 && why.is_empty())
            .map_or(String::new(), |(_, n)| format!(" (did you mean '{n}'?)"));
        let message = format!(
            "invalid value '{given}'{flag}: {why}expected one of {}{nearest}\n",
            names.join(", ")
        );
        Err(clap::Error::raw(clap::error::ErrorKind::InvalidValue, message).with_cmd(cmd))
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(T::CHOICES.iter().map(|&(_, name, help)| {
            clap::builder::PossibleValue::new(name).help(help)
        })))
    }
}

/// Train Llama and Qwen3 language models on the Apple Neural Engine — or on
/// any CPU, with a simulated ANE that runs the exact MIL programs in fp16.
#[derive(Parser)]
#[command(name = "anetrain", version, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run or check MIL programs (the text the ANE compiler is fed).
    Mil(cmd_mil::Args),
    /// Generate the kernel set for a model, or verify it against the CPU twins.
    Kernels(cmd_kernels::Args),
    /// Train a model (with no arguments: the `tiny` preset on the built-in
    /// story corpus, in a new directory under ./runs/).
    Train(Box<cmd_train::TrainArgs>),
    /// Evaluate a model: mean cross-entropy over token rows or a data file.
    ///
    /// For a token array t[0..n] the model reads t[0..n-1] and predicts
    /// t[1..n]. Prints one JSON line {"loss", "tokens", "ppl"}.
    #[command(allow_negative_numbers = true)]
    Eval(cmd_eval::Args),
    /// Generate text from a prompt, streaming tokens to stdout.
    #[command(allow_negative_numbers = true)]
    Generate(cmd_generate::Args),
    /// Time training steps (forward, backward, AdamW) as `train` runs them;
    /// prints one JSON line last (median/min step time, tokens/s, GFLOP/s,
    /// peak RSS, per-phase medians).
    #[command(allow_negative_numbers = true)]
    Bench(cmd_bench::Args),
    /// Fold a LoRA adapter into its base model (W + α/r·B·A) and write a
    /// plain Hugging Face model directory.
    Merge(cmd_merge::Args),
    /// Quantize a model as `mlx_lm.convert -q` does (MLX's affine format:
    /// mlx-lm runs it; anetrain fine-tunes LoRA adapters on it, with the
    /// base staying at its quantized size).
    Quantize(cmd_quantize::Args),
    /// Write a model for other runtimes (llama.cpp, Ollama, LM Studio).
    Export(cmd_export::Args),
    /// Import a llama2.c checkpoint (stories15M/42M/110M .bin) as a Hugging
    /// Face model directory (q/k rows permuted from interleaved to half-split RoPE).
    Convert(cmd_convert::Args),
    /// Train a tokenizer for your own text.
    Tokenizer(cmd_tokenize::TokenizerArgs),
    /// Tokenize a text file into a raw little-endian token file for --data.
    Tokenize(cmd_tokenize::Args),
    /// Draw a run's train/val loss and learning rate as a PNG (a preference
    /// run: its reward margin, train and validation, in place of the rate).
    Plot(cmd_plot::Args),
    /// Print the platform, Neural Engine availability and versions.
    Info,
    /// Check the Neural Engine on this machine: run it first on a Mac.
    ///
    /// For each kernel of the model: compile time, evaluation time (median)
    /// and the largest relative difference from the simulator (ane-sim) on
    /// the same random inputs; then training steps on the device beside the
    /// same steps on ane-sim. Prints a markdown summary ending in a verdict
    /// (exit status 1 on FAIL); --report writes everything as JSON, to
    /// attach to an issue. Without a Neural Engine the simulator stands in
    /// as the device (and with ANETRAIN_ANE_RUNTIME set, the stand-in
    /// runtime library), so the report says nothing about hardware then.
    #[command(allow_negative_numbers = true)]
    Doctor(cmd_doctor::Args),
}

/// A command-line error as one line: clap's first paragraph (the error
/// and, for missing arguments, their list), without the usage block.
fn one_line(rendered: &str) -> String {
    let first: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    // clap's suggestion ("tip: a similar argument exists: '--steps'").
    let tips: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("tip:"))
        .collect();
    let tips = match tips.is_empty() {
        true => String::new(),
        false => format!("; {}", tips.join("; ")),
    };
    format!("{}{tips} (see --help)", first.join(" "))
}

fn run_cli(cli: Cli) -> anyhow::Result<()> {
    if let Command::Doctor(args) = &cli.command {
        if let Some(f) = args.sim_family() {
            let f =
                ane::family::Family::parse(f).map_err(|e| anyhow::anyhow!("--sim-family: {e}"))?;
            // Before any thread starts: the simulator reads it where it opens.
            std::env::set_var(ane::family::SIM_FAMILY_ENV, f.name());
        }
    }
    if !matches!(cli.command, Command::Info) {
        // The device limits shape every kernel: a typo must not pass silently.
        ane::family::Profile::in_force()?;
        ane::family::sim_family_from_env()?;
    }
    // Long computations keep the CPUs from halting between parallel regions
    // (see `awake`): on virtual machines a halted CPU comes back late.
    let _awake = matches!(
        cli.command,
        Command::Train(_) | Command::Bench(_) | Command::Eval(_) | Command::Doctor(_)
    )
    .then(awake::KeepAwake::start);
    match cli.command {
        Command::Info => cmd_info::run(),
        Command::Doctor(a) => cmd_doctor::run_args(a)?,
        Command::Convert(a) => cmd_convert::run(a)?,
        Command::Tokenizer(a) => cmd_tokenize::run_tokenizer(a)?,
        Command::Tokenize(a) => cmd_tokenize::run(a)?,
        Command::Bench(a) => cmd_bench::run(a)?,
        Command::Merge(a) => cmd_merge::run(a)?,
        Command::Export(a) => cmd_export::run(a)?,
        Command::Quantize(a) => cmd_quantize::run(a)?,
        Command::Plot(a) => cmd_plot::run(a)?,
        Command::Train(a) => cmd_train::run(*a)?,
        Command::Eval(a) => cmd_eval::run(a)?,
        Command::Generate(a) => cmd_generate::run(a)?,
        Command::Kernels(a) => cmd_kernels::run(a)?,
        Command::Mil(a) => cmd_mil::run_command(a)?,
    }
    Ok(())
}

fn main() -> ExitCode {
    anetrain::util::mem::keep_freed_memory();
    // A panic is a bug in anetrain, never the user's fault: report it in one
    // line, without a backtrace, and exit with a distinct status.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        progress::say!("internal error: {msg}{at} (this is a bug in anetrain; please report it)");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version: printed as clap lays them out.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // `anetrain kernels`: the subcommand's help is the answer.
            let _ = e.print();
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("{}", one_line(&e.render().to_string()));
            return ExitCode::from(1);
        }
    };
    // A printing command whose reader goes away ends as Unix tools do,
    // killed by SIGPIPE (status 141) without a message; Rust ignores the
    // signal, so every write would fail and panic instead. A training run
    // keeps it ignored: its progress stops printing, the run goes on.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Train(_)) {
        // SAFETY: restores the default disposition of one signal before the
        // command starts any thread; no handler is involved.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if let Err(e) = linalg::check_env() {
        eprintln!("error: {e}");
        return ExitCode::from(1);
    }
    if let Err(e) = anetrain::kernels::tiling::fuse_attention_backward_from_env() {
        eprintln!("error: {e}");
        return ExitCode::from(1);
    }
    // `--model ORG/NAME` downloads what the Hugging Face cache lacks.
    hub_download::register();
    // Run the command on a worker of the thread pool the matrix multiply
    // and the elementwise passes share: each parallel region then starts by
    // handing work to an already-awake sibling, not by waking the pool from
    // outside and sleeping until it is done (thousands of times per step).
    // Worker stacks match the main thread's.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    match std::panic::catch_unwind(|| rayon::scope(|_| run_cli(cli))) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) if e.downcast_ref::<anetrain::train::Interrupted>().is_some() => {
            // Stopped as asked, the last step saved: a plain line, not an error.
            progress::say!("{e}");
            ExitCode::from(130)
        }
        Ok(Err(e)) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            progress::say!("error: {}", chain.join(": "));
            ExitCode::from(1)
        }
        Err(_) => ExitCode::from(101),
    }
}
