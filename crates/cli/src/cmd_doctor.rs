//! `anetrain doctor`: progress on stderr, the markdown summary on stdout,
//! the JSON report in `--report FILE`.

use std::path::Path;

use anetrain::tools::doctor::{self, DoctorRequest};
use anyhow::{bail, Context, Result};

pub fn run(model: &str, seq: usize, steps: u64, evals: usize, report: Option<&Path>) -> Result<()> {
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
