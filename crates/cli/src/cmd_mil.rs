//! `anetrain mil run` and `anetrain mil check`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use ane::rules::{self, RuleSet};
use anyhow::{bail, Context, Result};
use mil::{DType, Executable, Precision, Program, Tensor};
use npy::NpyData;

use crate::fsutil::write_atomic;

/// Reads and type-checks a MIL file; errors carry file:line:col.
pub fn load_program(path: &Path) -> Result<Program> {
    let text = std::fs::read(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    let text = String::from_utf8(text)
        .map_err(|_| anyhow::anyhow!("'{}' is not UTF-8 text", path.display()))?;
    mil::parse_and_validate(&text).map_err(|e| mil_error(path, e))
}

/// `FILE:LINE:COL: message` (or `FILE: message` without a position).
pub fn mil_error(path: &Path, e: mil::MilError) -> anyhow::Error {
    if e.line > 0 {
        anyhow::anyhow!("{}:{}:{}: {}", path.display(), e.line, e.col, e.msg)
    } else {
        anyhow::anyhow!("{}: {}", path.display(), e.msg)
    }
}

/// Converts an `.npy` array into an interpreter input of type `ty`.
fn input_tensor(path: &Path, name: &str, ty: &mil::Ty) -> Result<Tensor> {
    let a = npy::read(path)?;
    if a.shape != ty.dims() {
        bail!(
            "'{}': input '{name}' must have shape {:?}, the file holds {:?}",
            path.display(),
            ty.dims(),
            a.shape
        );
    }
    Ok(match (ty.dtype, a.data) {
        (DType::Fp16 | DType::Fp32, NpyData::Float(v)) => {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                bail!("'{}': element {i} is {} (inputs must be finite)", path.display(), v[i]);
            }
            Tensor::float(ty.dtype, a.shape, v)
        }
        (DType::Int32, NpyData::Int(v)) => {
            let v: Vec<i32> = v
                .iter()
                .map(|&x| i32::try_from(x))
                .collect::<Result<_, _>>()
                .with_context(|| format!("'{}': values do not fit int32", path.display()))?;
            Tensor::int(a.shape, v)
        }
        (DType::Bool, NpyData::Bool(v)) => Tensor::bool(a.shape, v),
        (d, _) => bail!(
            "'{}': input '{name}' is {d} but the file holds {} (use float16 or float32 for fp16 inputs)",
            path.display(),
            a.descr
        ),
    })
}

pub struct RunArgs {
    pub program: PathBuf,
    pub weights: Option<PathBuf>,
    pub inputs: Vec<PathBuf>,
    pub outputs: Vec<PathBuf>,
    pub fp32: bool,
    pub function: Option<String>,
}

pub fn run(a: RunArgs) -> Result<()> {
    let t0 = Instant::now();
    let p = load_program(&a.program)?;
    let f = match &a.function {
        Some(n) => p
            .function(n)
            .with_context(|| format!("'{}' has no function '{n}'", a.program.display()))?,
        None => p.main().with_context(|| {
            format!(
                "'{}' has several functions and none is 'main'; pick one with --function",
                a.program.display()
            )
        })?,
    };
    if a.inputs.len() != f.inputs.len() {
        bail!(
            "func {} takes {} input(s) ({}); give --input once per input, in order",
            f.name,
            f.inputs.len(),
            f.inputs
                .iter()
                .map(|v| v.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if a.outputs.len() != f.outputs.len() {
        bail!(
            "func {} returns {} output(s) ({}); give --output once per output, in order",
            f.name,
            f.outputs.len(),
            f.outputs.join(", ")
        );
    }
    // Default: the `weights/` directory beside the program, when present.
    let weights = a.weights.clone().or_else(|| {
        a.program
            .parent()
            .map(|d| d.join("weights"))
            .filter(|d| d.is_dir())
    });
    let exe = Executable::new(f, weights.as_deref()).map_err(|e| mil_error(&a.program, e))?;
    let inputs = f
        .inputs
        .iter()
        .zip(&a.inputs)
        .map(|(v, path)| input_tensor(path, &v.name, &v.ty))
        .collect::<Result<Vec<_>>>()?;
    let t_load = t0.elapsed();
    let mode = if a.fp32 {
        Precision::Fp32
    } else {
        Precision::Fp16
    };
    let t1 = Instant::now();
    let outs = exe
        .run(inputs, mode)
        .map_err(|e| mil_error(&a.program, e))?;
    let t_run = t1.elapsed();
    for (t, path) in outs.iter().zip(&a.outputs) {
        let data: Vec<f32> = match &t.data {
            mil::tensor::Data::F32(v) => v.to_vec(),
            mil::tensor::Data::I32(v) => v.iter().map(|&x| x as f32).collect(),
            mil::tensor::Data::Bool(v) => v.iter().map(|&x| x as u8 as f32).collect(),
            mil::tensor::Data::Str(_) => bail!("a string output cannot be written to .npy"),
        };
        write_atomic(path, &npy::encode_f32(&t.shape, &data))?;
    }
    eprintln!(
        "ran func {} ({} ops, {} mode): load {:.1} ms, evaluate {:.1} ms",
        f.name,
        f.ops.len(),
        if a.fp32 { "fp32" } else { "fp16" },
        t_load.as_secs_f64() * 1e3,
        t_run.as_secs_f64() * 1e3
    );
    Ok(())
}

pub struct CheckArgs {
    pub program: PathBuf,
    pub strict: bool,
    /// Check against this chip family's rules and limits.
    pub family: Option<String>,
    pub enable: Vec<String>,
    pub disable: Vec<String>,
}

pub fn check(a: CheckArgs) -> Result<()> {
    let p = load_program(&a.program)?;
    let mut set = match &a.family {
        None => RuleSet::default(),
        Some(f) => {
            let f = ane::family::Family::parse(f).map_err(|e| anyhow::anyhow!("--family: {e}"))?;
            println!("rules and limits of {f}");
            RuleSet::for_limits(f.limits())
        }
    };
    for id in &a.enable {
        set.set(id, true)?;
    }
    for id in &a.disable {
        set.set(id, false)?;
    }
    println!(
        "{}: program({}), {} function(s)",
        a.program.display(),
        p.version,
        p.functions.len()
    );
    for f in &p.functions {
        println!("func {}<{}>", f.name, f.opset);
        for v in &f.inputs {
            println!("  input   {} : {}", v.name, v.ty);
        }
        for o in &f.outputs {
            let ty = f.var_type(o).map(|t| t.to_string()).unwrap_or_default();
            println!("  output  {o} : {ty}");
        }
        let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
        for op in &f.ops {
            *counts.entry(op.op.as_str()).or_default() += 1;
        }
        let list: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("  ops     {} ({})", f.ops.len(), list.join(", "));
    }
    let findings = rules::check_all_within(&p, &set.limits);
    let mut broken_enabled = 0;
    println!("ANE constraint rules:");
    for r in rules::all() {
        let on = set.is_on(r.id);
        let mine: Vec<_> = findings.iter().filter(|f| f.rule == r.id).collect();
        let status = match (mine.is_empty(), on) {
            (true, _) => "ok  ",
            (false, true) => "FAIL",
            (false, false) => "warn",
        };
        println!(
            "  {status} {:<20} {}{}",
            r.id,
            r.summary,
            if on { "" } else { " [off]" }
        );
        for f in &mine {
            println!("         - func {}: {}", f.function, f.message);
        }
        if on && !mine.is_empty() {
            broken_enabled += 1;
        }
    }
    if broken_enabled > 0 {
        let msg = format!("{} enabled ANE rule(s) broken", broken_enabled);
        if a.strict {
            bail!("{}: {msg}", a.program.display());
        }
        println!("{msg} (exit status stays 0 without --strict)");
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: MilCommand,
}

#[derive(clap::Subcommand)]
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

pub fn run_command(a: Args) -> Result<()> {
    match a.command {
        MilCommand::Run {
            program,
            weights,
            input,
            output,
            fp32,
            function,
        } => run(RunArgs {
            program,
            weights,
            inputs: input,
            outputs: output,
            fp32,
            function,
        }),
        MilCommand::Check {
            program,
            strict,
            enable,
            disable,
            family,
        } => check(CheckArgs {
            program,
            strict,
            family,
            enable,
            disable,
        }),
    }
}
