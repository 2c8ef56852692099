//! The `anetrain` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod awake;
mod base_check;
mod cmd_doctor;
mod cmd_kernels;
mod cmd_mil;
mod cmd_model;
mod cmd_train;
mod hub;
mod plot;
mod progress;

use anetrain::util::choice::Choice;
use anetrain::util::fsutil;

/// A parser for the values of a library [`Choice`], listing them (with
/// their descriptions) in `--help`.
fn choice<T: Choice + Clone + Send + Sync>() -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    let values = T::CHOICES
        .iter()
        .map(|&(_, name, help)| PossibleValue::new(name).help(help));
    PossibleValuesParser::new(values).try_map(|name| {
        T::from_name(&name).ok_or_else(|| format!("'{name}' is not one of the listed values"))
    })
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
    Mil {
        #[command(subcommand)]
        command: MilCommand,
    },
    /// Generate the kernel set for a model, or verify it against the CPU twins.
    Kernels {
        #[command(subcommand)]
        command: KernelsCommand,
    },
    /// Train a model (with no arguments: the `tiny` preset on the built-in
    /// story corpus, in a new directory under ./runs/).
    Train(Box<cmd_train::TrainArgs>),
    /// Evaluate a model: mean cross-entropy over token rows or a data file.
    ///
    /// For a token array t[0..n] the model reads t[0..n-1] and predicts
    /// t[1..n]. Prints one JSON line {"loss", "tokens", "ppl"}.
    #[command(allow_negative_numbers = true)]
    Eval {
        /// A model directory (config.json + safetensors) or a Hub id
        /// ORG/NAME[@REVISION], downloaded into the Hugging Face cache.
        #[arg(long)]
        model: PathBuf,
        /// Integer .npy of token ids, [n+1] or [batch, n+1].
        #[arg(long, value_name = "FILE.npy", conflicts_with = "data")]
        tokens: Option<PathBuf>,
        /// Token file (raw u16/u32) or text file (.txt, tokenized), evaluated
        /// in windows of --seq + 1 tokens; or JSONL records (a .jsonl file,
        /// or a data directory and --split), one sequence each, loss over
        /// all their target tokens.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        /// Records: the file of a data directory to evaluate
        /// (train, valid or test) [default: test].
        #[arg(long, value_name = "SPLIT")]
        split: Option<String>,
        #[command(flatten)]
        records: cmd_train::RecordArgs,
        /// Window length for --data [default: min(256, max_position_embeddings);
        /// for records, max_position_embeddings (longer records are truncated)].
        #[arg(long)]
        seq: Option<usize>,
        /// Write float32 logits [n, vocab] (or [batch, n, vocab]) here.
        #[arg(long, value_name = "FILE.npy")]
        logits_out: Option<PathBuf>,
        /// Entry width of raw token files.
        #[arg(long, value_parser = crate::choice::<anetrain::data::tokens::TokenDtype>(), default_value = "u16")]
        token_dtype: anetrain::data::tokens::TokenDtype,
        /// tokenizer.json for text data (or a Hub id: its tokenizer)
        /// [default: the model's].
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Evaluate at most this many windows of --data.
        #[arg(long)]
        max_windows: Option<usize>,
        /// A LoRA adapter directory (PEFT format) to apply to --model.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        #[command(flatten)]
        any_base: base_check::AnyBase,
        /// Engine [default: ane where available, else cpu].
        #[arg(long, value_parser = crate::choice::<anetrain::device::backend::Backend>())]
        backend: Option<anetrain::device::backend::Backend>,
    },
    /// Generate text from a prompt, streaming tokens to stdout.
    #[command(allow_negative_numbers = true)]
    Generate {
        /// A model directory or a Hub id ORG/NAME[@REVISION].
        #[arg(long)]
        model: PathBuf,
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Treat the prompt as a user message: render it with the model's
        /// chat template (add_generation_prompt) and print only the reply,
        /// which ends at the template's end-of-turn token.
        #[arg(long)]
        chat: bool,
        /// Maximum number of new tokens.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy [default: the model's
        /// generation_config.json, else 0.8].
        #[arg(long)]
        temperature: Option<f64>,
        /// Nucleus sampling mass, 1 disables [default: the model's
        /// generation_config.json, else 0.95].
        #[arg(long)]
        top_p: Option<f64>,
        /// Draw only from the K likeliest tokens, 0 disables [default: the
        /// model's generation_config.json, else 0].
        #[arg(long, value_name = "K")]
        top_k: Option<usize>,
        /// Random seed for sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// tokenizer.json (or a Hub id: its tokenizer) [default: the model's].
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// A LoRA adapter directory (PEFT format) to apply to --model.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        #[command(flatten)]
        any_base: base_check::AnyBase,
        /// Engine [default: ane where available, else cpu]. The CPU engine
        /// decodes with a KV cache; the Neural Engine paths rerun the
        /// compiled kernels over the whole (padded) sequence per token.
        #[arg(long, value_parser = crate::choice::<anetrain::device::backend::Backend>())]
        backend: Option<anetrain::device::backend::Backend>,
    },
    /// Time training steps (forward, backward, AdamW) as `train` runs them;
    /// prints one JSON line last (median/min step time, tokens/s, GFLOP/s,
    /// peak RSS, per-phase medians).
    #[command(allow_negative_numbers = true)]
    Bench {
        /// A preset (random initialisation), a model directory or a Hub id
        /// ORG/NAME[@REVISION].
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Sequences per step.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Timed steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Engine [default: ane where available, else cpu].
        #[arg(long, value_parser = crate::choice::<anetrain::device::backend::Backend>())]
        backend: Option<anetrain::device::backend::Backend>,
        /// Time LoRA training with adapters of this rank on every projection
        /// (base frozen) instead of full training.
        #[arg(long, value_name = "R")]
        lora_rank: Option<usize>,
        #[command(flatten)]
        memory: cmd_train::MemoryArgs,
    },
    /// Fold a LoRA adapter into its base model (W + α/r·B·A) and write a
    /// plain Hugging Face model directory.
    Merge {
        /// The base: a model directory or a Hub id ORG/NAME[@REVISION].
        #[arg(long)]
        model: PathBuf,
        /// The adapter directory (adapter_config.json + adapter_model.safetensors).
        #[arg(long)]
        adapter: PathBuf,
        #[command(flatten)]
        any_base: base_check::AnyBase,
        /// Output model directory.
        #[arg(long)]
        out: PathBuf,
        /// Tensor type of the merged weights: f32, f16 or bf16 [default:
        /// the base's]. The merge itself is computed in f32.
        #[arg(long, value_parser = ["f32", "f16", "bf16"])]
        dtype: Option<String>,
        /// Write into --out even if it already holds files.
        #[arg(long)]
        force: bool,
    },
    /// Quantize a model as `mlx_lm.convert -q` does (MLX's affine format:
    /// mlx-lm runs it; anetrain fine-tunes LoRA adapters on it, with the
    /// base staying at its quantized size).
    Quantize {
        /// The model: a directory or a Hub id ORG/NAME[@REVISION].
        #[arg(long)]
        model: PathBuf,
        /// Bits per weight: 2, 3, 4, 5, 6 or 8.
        #[arg(long, default_value_t = 4)]
        bits: u32,
        /// Weights per group, each with its own scale and bias: 32, 64 or 128.
        #[arg(long, alias = "q-group-size", default_value_t = 64)]
        group_size: usize,
        /// dtype of the scales, biases and unquantized tensors [default:
        /// the model's].
        #[arg(long, value_parser = ["f32", "f16", "bf16"])]
        dtype: Option<String>,
        /// Output model directory.
        #[arg(long)]
        out: PathBuf,
        /// Write into --out even if it already holds files.
        #[arg(long)]
        force: bool,
    },
    /// Write a model for other runtimes (llama.cpp, Ollama, LM Studio).
    Export {
        #[command(subcommand)]
        command: ExportCommand,
    },
    /// Import a llama2.c checkpoint (stories15M/42M/110M .bin) as a Hugging
    /// Face model directory (q/k rows permuted from interleaved to half-split RoPE).
    Convert {
        /// The llama2.c .bin checkpoint.
        input: PathBuf,
        /// Output model directory.
        #[arg(long)]
        out: PathBuf,
        /// tokenizer.json to copy beside the model (or a Hub id: its tokenizer).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// Train a tokenizer for your own text.
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
    },
    /// Tokenize a text file into a raw little-endian token file for --data.
    Tokenize {
        /// A Hugging Face tokenizer.json.
        #[arg(long)]
        tokenizer: PathBuf,
        /// UTF-8 text to tokenize.
        #[arg(long)]
        input: PathBuf,
        /// Output token file.
        #[arg(long)]
        output: PathBuf,
        /// Entry width (u16 holds ids below 65536).
        #[arg(long, value_parser = crate::choice::<anetrain::data::tokens::TokenDtype>(), default_value = "u16")]
        token_dtype: anetrain::data::tokens::TokenDtype,
    },
    /// Draw a run's train/val loss and learning rate as a PNG.
    Plot {
        /// The run directory (holding metrics.jsonl).
        run: PathBuf,
        /// Output image [default: RUN/loss.png].
        #[arg(long)]
        out: Option<PathBuf>,
    },
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
    Doctor {
        /// A preset, a model directory with config.json, or a Hub id.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Sequence length the kernels are built and trained at.
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Training steps on each of the device and ane-sim (0: skip).
        #[arg(long, default_value_t = 10)]
        steps: u64,
        /// Timed evaluations per kernel.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
        evals: u64,
        /// Write the full report here as JSON.
        #[arg(long, value_name = "FILE")]
        report: Option<PathBuf>,
        /// Without a Neural Engine: the chip family the simulator plays
        /// (m1 … m5; as ANETRAIN_SIM_FAMILY).
        #[arg(long, value_name = "FAMILY")]
        sim_family: Option<String>,
    },
}

#[derive(Subcommand)]
enum ExportCommand {
    /// One GGUF file (the adapter merged in, the tokenizer and chat
    /// template embedded) that llama.cpp, Ollama and LM Studio load:
    /// `llama-cli -m FILE.gguf -cnv`.
    Gguf {
        /// The model: a model directory, a run directory or a Hub id
        /// ORG/NAME[@REVISION].
        #[arg(long)]
        model: PathBuf,
        /// A LoRA adapter directory (a LoRA run) to merge in first.
        #[arg(long)]
        adapter: Option<PathBuf>,
        #[command(flatten)]
        any_base: base_check::AnyBase,
        /// The file to write.
        #[arg(long, value_name = "FILE.gguf")]
        out: PathBuf,
        /// Tensor type of the matrices (norms stay f32): f16, bf16, or q8_0
        /// (8-bit blocks of 32 with an fp16 scale, about half of f16's size).
        #[arg(long = "type", value_name = "TYPE", default_value = "f16",
              value_parser = ["f16", "bf16", "q8_0"])]
        ty: String,
        /// Overwrite --out if it exists.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer (the kind the built-in corpus
    /// uses, with an <|endoftext|> token) on UTF-8 text files, one training
    /// sequence per line, and write it as a Hugging Face tokenizer.json.
    Train {
        /// Text files to learn from (repeatable).
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<PathBuf>,
        /// Entries in the vocabulary (at most; a small text may yield fewer).
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        /// Output tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum KernelsCommand {
    /// Write every kernel's .mil, its blobs under weights/, and layout.json.
    Dump {
        /// A preset (qwen3-0.6b, stories15m, stories42m, stories110m, tiny),
        /// a model directory with config.json, or a Hub id ORG/NAME.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Sequence length the kernels are built for.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Use the seed's conventions (interleaved RoPE, θ=10000, no QK-norm,
        /// DeepNet residual scale) and its file names.
        #[arg(long)]
        seed_compat: bool,
        /// Only these kernels (repeatable), e.g. --kernel sdpa_forward.
        #[arg(long = "kernel", value_name = "NAME")]
        kernels: Vec<String>,
    },
    /// Show how each kernel is tiled for a model under the device limits in
    /// force: kernels whose input or output would pass the device's largest
    /// dimension (16384, or ANETRAIN_ANE_MAX_DIM) run as several programs
    /// of one smaller shape, split along the intermediate size or groups of
    /// KV heads, their results concatenated or summed.
    Plan {
        /// A preset, a model directory with config.json, or a Hub id.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Sequence length.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Plan for LoRA adapters of this rank on all seven projections.
        #[arg(long, value_name = "R")]
        lora_rank: Option<usize>,
        /// The engine whose memory plan to show.
        #[arg(long, value_parser = choice::<anetrain::device::backend::Backend>(), default_value = "ane")]
        backend: anetrain::device::backend::Backend,
        #[command(flatten)]
        memory: cmd_train::MemoryArgs,
        /// Print the plan (tiles, predicted step per chip family, memory)
        /// as JSON.
        #[arg(long)]
        json: bool,
        /// Show the predicted step of this chip family (m1 … m5; default:
        /// the family in force, or every family when none is known).
        #[arg(long, value_parser = parse_family)]
        family: Option<ane::family::Family>,
        /// Plan a preference step (one pair: two sequences, and DPO's two
        /// reference forwards) instead of one SFT sequence.
        #[arg(long, value_parser = choice::<anetrain::train::preference::Objective>(), default_value = "sft")]
        objective: anetrain::train::preference::Objective,
        /// DPO with the reference's log-probabilities precomputed (no
        /// reference forwards in the step).
        #[arg(long)]
        precompute_ref: bool,
    },
    /// Run every kernel through the interpreter (fp32 and fp16) against its
    /// CPU twin on random inputs; exit non-zero when one is out of tolerance.
    Check {
        /// A preset, a model directory, or a Hub id ORG/NAME[@REVISION].
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Sequence length.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Use the seed's conventions.
        #[arg(long)]
        seed_compat: bool,
        /// Only these kernels (repeatable).
        #[arg(long = "kernel", value_name = "NAME")]
        kernels: Vec<String>,
        /// Random seed for the inputs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
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
        /// Switch a rule on (repeatable), e.g. --rule no-concat.
        #[arg(long = "rule", value_name = "ID")]
        enable: Vec<String>,
        /// Switch a rule off (repeatable), e.g. --no-rule min-surface.
        #[arg(long = "no-rule", value_name = "ID")]
        disable: Vec<String>,
        /// Check against a chip family's rules and limits (m1 … m5)
        /// instead of the default rules.
        #[arg(long, value_name = "FAMILY")]
        family: Option<String>,
    },
}

fn info() {
    println!("anetrain {}", env!("CARGO_PKG_VERSION"));
    println!(
        "platform: {}-{}",
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    println!("cpu threads: {}", linalg::threads());
    println!("matrix multiply: {}", linalg::selected().describe());
    let others: Vec<&str> = linalg::Backend::ALL
        .iter()
        .filter(|l| l.available() && **l != linalg::selected() && **l != linalg::Backend::Naive)
        .map(|l| l.key())
        .collect();
    if !others.is_empty() {
        println!(
            "  also available (ANETRAIN_MATMUL=NAME): {}",
            others.join(", ")
        );
    }
    let stand_in = std::env::var_os(ane::apple::RUNTIME_ENV).filter(|p| !p.is_empty());
    match ane::AneDevice::open() {
        Ok(_) if stand_in.is_some() => println!(
            "neural engine: AneDevice over the stand-in runtime {} ({} is set: a testing aid, not the ANE)",
            std::path::Path::new(stand_in.as_deref().unwrap_or_default()).display(),
            ane::apple::RUNTIME_ENV
        ),
        Ok(_) => println!(
            "neural engine: the ANE framework loads (AppleNeuralEngine.framework, private API); \
             compile budget {} programs per process",
            ane::DEFAULT_COMPILE_BUDGET
        ),
        Err(e) => println!("neural engine: unavailable — {e}"),
    }
    println!(
        "simulated device (ane-sim): available; compile budget {} programs per process",
        ane::DEFAULT_COMPILE_BUDGET
    );
    match ane::family::Profile::in_force() {
        Ok(p) => {
            println!(
                "chip family: {} ({} sets it; kernels wider than the caps run in tiles, `anetrain kernels plan`){}",
                p.describe(),
                ane::family::FAMILY_ENV,
                match anetrain::kernels::tiling::min_tiles_from_env() {
                    1 => String::new(),
                    n => format!(
                        "; at least {n} tiles per kernel ({} is set: a testing aid)",
                        anetrain::kernels::tiling::MIN_TILES_ENV
                    ),
                }
            );
            for (what, v) in p.limits.describe() {
                println!("  {what:<26} {v}");
            }
            if std::env::var_os(ane::rules::MAX_DIM_ENV).is_some() {
                println!("  (axis caps from {})", ane::rules::MAX_DIM_ENV);
            }
        }
        Err(e) => println!("chip family: {e}"),
    }
    match ane::family::sim_family_from_env() {
        Ok(Some(f)) => println!(
            "simulated chip ({}): {f}, its faults played by ane-sim",
            ane::family::SIM_FAMILY_ENV
        ),
        Ok(None) => {}
        Err(e) => println!("simulated chip: {e}"),
    }
    println!(
        "default backend: {}",
        anetrain::device::backend::Backend::platform_default().name()
    );
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

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Command::Doctor {
        sim_family: Some(f),
        ..
    } = &cli.command
    {
        let f = ane::family::Family::parse(f).map_err(|e| anyhow::anyhow!("--sim-family: {e}"))?;
        // Before any thread starts: the simulator reads it where it opens.
        std::env::set_var(ane::family::SIM_FAMILY_ENV, f.name());
    }
    if !matches!(cli.command, Command::Info) {
        // The device limits shape every kernel: a typo must not pass silently.
        ane::family::Profile::in_force().map_err(anyhow::Error::msg)?;
        ane::family::sim_family_from_env().map_err(anyhow::Error::msg)?;
    }
    // Long computations keep the CPUs from halting between parallel regions
    // (see `awake`): on virtual machines a halted CPU comes back late.
    let _awake = matches!(
        cli.command,
        Command::Train(_) | Command::Bench { .. } | Command::Eval { .. } | Command::Doctor { .. }
    )
    .then(awake::KeepAwake::start);
    match cli.command {
        Command::Info => info(),
        Command::Doctor {
            model,
            seq,
            steps,
            evals,
            report,
            ..
        } => cmd_doctor::run(
            &hub::resolve(&model, hub::Need::Config)?,
            seq,
            steps,
            evals as usize,
            report.as_deref(),
        )?,
        Command::Convert {
            input,
            out,
            tokenizer,
        } => {
            let model = anetrain::tools::convert::load_llama2c(&input)?;
            model.save(&out)?;
            if let Some(t) = tokenizer {
                anetrain::data::tokenizer::Tokenizer::load(&hub::resolve_tokenizer(&t)?)?
                    .save_to_dir(&out, model.cfg.max_position_embeddings)?;
            }
            println!(
                "converted {} ({:.1}M parameters) to {}",
                input.display(),
                model.num_params() as f64 / 1e6,
                out.display()
            );
        }
        Command::Tokenizer {
            command:
                TokenizerCommand::Train {
                    input,
                    vocab_size,
                    out,
                },
        } => {
            let files: Vec<&std::path::Path> = input.iter().map(PathBuf::as_path).collect();
            let tok = anetrain::data::corpus::train_tokenizer_on_files(&files, vocab_size)?;
            tok.save(&out)?;
            println!(
                "wrote a tokenizer of {} tokens to {}",
                tok.vocab_size(),
                out.display()
            );
        }
        Command::Tokenize {
            tokenizer,
            input,
            output,
            token_dtype,
        } => {
            let tok =
                anetrain::data::tokenizer::Tokenizer::load(&hub::resolve_tokenizer(&tokenizer)?)?;
            let n = anetrain::data::tokens::tokenize_file(&tok, &input, &output, token_dtype)?;
            println!("wrote {n} tokens to {}", output.display());
        }
        Command::Bench {
            model,
            seq,
            batch,
            steps,
            warmup,
            backend,
            lora_rank,
            memory,
        } => {
            let args = anetrain::tools::bench::BenchArgs {
                lora_rank,
                memory: memory.options(),
                model: hub::resolve(&model, hub::Need::Model)?,
                seq,
                batch,
                steps,
                warmup,
                backend: backend
                    .unwrap_or_else(anetrain::device::backend::Backend::platform_default),
            };
            let r = anetrain::tools::bench::bench(&args, &mut |line| eprintln!("{line}"))?;
            println!("{r}");
        }
        Command::Merge {
            model,
            adapter,
            any_base,
            out,
            dtype,
            force,
        } => {
            base_check::check(&model, Some(&adapter), any_base)?;
            cmd_model::merge(cmd_model::MergeArgs {
                model: hub::resolve_path(&model, hub::Need::Model)?,
                adapter,
                out,
                dtype,
                force,
            })?
        }
        Command::Export {
            command:
                ExportCommand::Gguf {
                    model,
                    adapter,
                    any_base,
                    out,
                    ty,
                    force,
                },
        } => {
            base_check::check(&model, adapter.as_deref(), any_base)?;
            cmd_model::export_gguf(
                &hub::resolve_path(&model, hub::Need::Model)?,
                adapter.as_deref(),
                &out,
                anetrain::tools::gguf::ExportType::parse(&ty)?,
                force,
            )?
        }
        Command::Quantize {
            model,
            bits,
            group_size,
            dtype,
            out,
            force,
        } => cmd_model::quantize(cmd_model::QuantizeArgs {
            model: hub::resolve_path(&model, hub::Need::Model)?,
            out,
            bits,
            group_size,
            dtype,
            force,
        })?,
        Command::Plot { run, out } => {
            let out = out.unwrap_or_else(|| run.join("loss.png"));
            plot::plot(&run, &out)?;
            println!("wrote {}", out.display());
        }
        Command::Train(args) => cmd_train::run(*args)?,
        Command::Eval {
            model,
            tokens,
            data,
            seq,
            logits_out,
            token_dtype,
            tokenizer,
            max_windows,
            adapter,
            any_base,
            backend,
            split,
            records,
        } => cmd_model::eval(cmd_model::EvalArgs {
            adapter: base_check::checked(&model, adapter, any_base)?,
            backend: backend.unwrap_or_else(anetrain::device::backend::Backend::platform_default),
            model: hub::resolve_path(&model, hub::Need::Model)?,
            data,
            tokens,
            seq,
            logits_out,
            token_dtype,
            tokenizer: tokenizer.map(|t| hub::resolve_tokenizer(&t)).transpose()?,
            max_windows,
            split,
            mask_prompt: records.mask_prompt,
            keys: records.keys(),
        })?,
        Command::Generate {
            model,
            prompt,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            tokenizer,
            adapter,
            any_base,
            backend,
            chat,
        } => cmd_model::run_generate(cmd_model::GenerateArgs {
            adapter: base_check::checked(&model, adapter, any_base)?,
            backend: backend.unwrap_or_else(anetrain::device::backend::Backend::platform_default),
            model: hub::resolve_path(&model, hub::Need::Model)?,
            prompt,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            tokenizer: tokenizer.map(|t| hub::resolve_tokenizer(&t)).transpose()?,
            chat,
        })?,
        Command::Kernels { command } => match command {
            KernelsCommand::Dump {
                model,
                out,
                seq,
                seed_compat,
                kernels,
            } => cmd_kernels::dump(
                &hub::resolve(&model, hub::Need::Config)?,
                &out,
                seq,
                seed_compat,
                &kernels,
            )?,
            KernelsCommand::Check {
                model,
                seq,
                seed_compat,
                kernels,
                seed,
            } => cmd_kernels::run_check(
                &hub::resolve(&model, hub::Need::Config)?,
                seq,
                seed_compat,
                &kernels,
                seed,
            )?,
            KernelsCommand::Plan {
                model,
                seq,
                lora_rank,
                backend,
                memory,
                json,
                family,
                objective,
                precompute_ref,
            } => cmd_kernels::show_plan(cmd_kernels::PlanArgs {
                model: hub::resolve(&model, hub::Need::Config)?,
                seq,
                lora_rank,
                backend,
                memory: memory.options(),
                json,
                family,
                preference: (objective != anetrain::train::preference::Objective::Sft).then_some(
                    anetrain::train::preference::PreferenceSettings {
                        objective,
                        loss: anetrain::train::preference::DpoLoss::Sigmoid,
                        beta: 0.1,
                        precompute_ref,
                    },
                ),
            })?,
        },
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
                family,
            } => cmd_mil::check(cmd_mil::CheckArgs {
                program,
                strict,
                family,
                enable,
                disable,
            })?,
        },
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
    // Run the command on a worker of the thread pool the matrix multiply
    // and the elementwise passes share: each parallel region then starts by
    // handing work to an already-awake sibling, not by waking the pool from
    // outside and sleeping until it is done (thousands of times per step).
    // Worker stacks match the main thread's.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    match std::panic::catch_unwind(|| rayon::scope(|_| dispatch(cli))) {
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

/// `--family m1 … m5`.
fn parse_family(s: &str) -> Result<ane::family::Family, String> {
    ane::family::Family::parse(s)
}
