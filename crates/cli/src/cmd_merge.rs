//! `anetrain merge`: an adapter folded into its base.

use std::path::PathBuf;

use crate::{base_check, cmd_model};
use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(a: Args) -> anyhow::Result<()> {
    base_check::check(&a.model, Some(&a.adapter), a.any_base)?;
    cmd_model::merge(cmd_model::MergeArgs {
        model: hub::resolve_path(&a.model, hub::Need::Model)?,
        adapter: a.adapter,
        out: a.out,
        dtype: a.dtype,
        force: a.force,
    })
}
