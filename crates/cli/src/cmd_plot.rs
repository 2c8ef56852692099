//! `anetrain plot`: a run's curves as a PNG.

use std::path::PathBuf;

use crate::plot;

#[derive(clap::Args)]
pub struct Args {
    /// The run directory (holding metrics.jsonl).
    run: PathBuf,
    /// Output image [default: RUN/loss.png].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let out = a.out.unwrap_or_else(|| a.run.join("loss.png"));
    plot::plot(&a.run, &out)?;
    println!("wrote {}", out.display());
    Ok(())
}
