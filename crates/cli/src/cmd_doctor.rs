//! `anetrain doctor`: progress on stderr, the markdown summary on stdout,
//! the JSON report in `--report FILE`.

use std::path::{Path, PathBuf};

use anetrain::tools::doctor::{self, DoctorRequest};
use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct Args {
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
}

impl Args {
    /// The chip family the simulator plays, if asked for.
    pub fn sim_family(&self) -> Option<&str> {
        self.sim_family.as_deref()
    }
}

pub fn run_args(a: Args) -> Result<()> {
    run(
        &anetrain::model::hub::resolve(&a.model, anetrain::model::hub::Need::Config)?,
        a.seq,
        a.steps,
        a.evals as usize,
        a.report.as_deref(),
    )
}

fn run(model: &str, seq: usize, steps: u64, evals: usize, report: Option<&Path>) -> Result<()> {
    if seq == 0 || !seq.is_multiple_of(16) {
        bail!("--seq {seq}: the kernels are built for a positive multiple of 16");
    }
    // Refuse an unwritable report before spending minutes on the checks.
    if let Some(p) = report {
        if p.is_dir() {
            bail!("--report {}: is a directory; name a file", p.display());
        }
    }
    let request = DoctorRequest {
        model: model.to_string(),
        seq,
        steps,
        evals,
    };
    eprintln!("anetrain doctor: {model} at seq {seq} (this takes a minute or two)");
    let r = doctor::run(&request, &mut |line: &str| eprintln!("  {line}"))?;
    if let Some(p) = report {
        let json = serde_json::to_string_pretty(&r).context("serialising the report")?;
        anetrain::util::fsutil::write_atomic(p, json.as_bytes())?;
        eprintln!("report written to {}", p.display());
    }
    println!("{}", r.markdown());
    if !r.ok {
        bail!(
            "doctor found {} problem(s) (listed above{})",
            r.failures.len(),
            if report.is_some() {
                " and in the report"
            } else {
                ""
            }
        );
    }
    Ok(())
}
