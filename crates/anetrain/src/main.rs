//! The `anetrain` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd_mil;
mod fsutil;

/// Train Llama and Qwen3 language models on the Apple Neural Engine — or on
/// any CPU, with a simulated ANE that runs the exact MIL programs in fp16.
#[derive(Parser)]
#[command(name = "anetrain", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run or check MIL programs (the text the ANE compiler is fed).
    Mil {
        #[command(subcommand)]
        command: MilCommand,
    },
    /// Print the platform, Neural Engine availability and versions.
    Info,
}

#[derive(Subcommand)]
enum MilCommand {
    /// Evaluate a MIL program on .npy inputs with the reference interpreter.
    ///
    /// fp16 mode (the default) rounds the input and every fp16 result to
    /// half precision, accumulating matmuls and reductions in f32, as the
    /// ANE does; --fp32 keeps full precision. Outputs are written as float32.
    Run {
        /// The MIL program (program(1.3) text).
        program: PathBuf,
        /// Directory that `@model_path/weights/` refers to [default: the
        /// `weights/` directory beside the program, if any].
        #[arg(long, value_name = "DIR")]
        weights: Option<PathBuf>,
        /// Input array (.npy, float16 or float32, exactly the input's shape);
        /// repeat once per function input, in order.
        #[arg(long, value_name = "X.npy", required = true)]
        input: Vec<PathBuf>,
        /// Where to write each output (float32 .npy); repeat once per output.
        #[arg(long, value_name = "Y.npy", required = true)]
        output: Vec<PathBuf>,
        /// Evaluate without fp16 rounding.
        #[arg(long)]
        fp32: bool,
        /// Function to run [default: main].
        #[arg(long)]
        function: Option<String>,
    },
    /// Parse and type-check a MIL program and report the ANE constraint rules.
    ///
    /// Prints inputs, outputs and op counts, then every ANE rule with its
    /// findings. Rules marked [off] are reported hypotheses; --strict makes
    /// a broken enabled rule an error.
    Check {
        /// The MIL program.
        program: PathBuf,
        /// Exit non-zero when an enabled ANE rule is broken.
        #[arg(long)]
        strict: bool,
        /// Switch a rule on (repeatable), e.g. --rule min-surface.
        #[arg(long = "rule", value_name = "ID")]
        enable: Vec<String>,
        /// Switch a rule off (repeatable).
        #[arg(long = "no-rule", value_name = "ID")]
        disable: Vec<String>,
    },
}

fn info() {
    println!("anetrain {}", env!("CARGO_PKG_VERSION"));
    println!(
        "platform: {}-{}",
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    println!("cpu threads: {}", mil::linalg::threads());
    if cfg!(target_os = "macos") {
        println!("neural engine: macOS detected; the private-API device is not built yet (use --backend ane-sim)");
    } else {
        println!("neural engine: not available on this platform (the simulated device, ane-sim, runs anywhere)");
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Info => info(),
        Command::Mil { command } => match command {
            MilCommand::Run {
                program,
                weights,
                input,
                output,
                fp32,
                function,
            } => cmd_mil::run(cmd_mil::RunArgs {
                program,
                weights,
                inputs: input,
                outputs: output,
                fp32,
                function,
            })?,
            MilCommand::Check {
                program,
                strict,
                enable,
                disable,
            } => cmd_mil::check(cmd_mil::CheckArgs {
                program,
                strict,
                enable,
                disable,
            })?,
        },
    }
    Ok(())
}

fn main() -> ExitCode {
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
        eprintln!("internal error: {msg}{at} (this is a bug in anetrain; please report it)");
    }));
    let cli = Cli::parse();
    match std::panic::catch_unwind(|| dispatch(cli)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            ExitCode::from(1)
        }
        Err(_) => ExitCode::from(101),
    }
}
