//! `anetrain quantize`: a model in MLX's affine format.

use std::path::PathBuf;

use crate::cmd_model;
use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(a: Args) -> anyhow::Result<()> {
    cmd_model::quantize(cmd_model::QuantizeArgs {
        model: hub::resolve_path(&a.model, hub::Need::Model)?,
        source: match a.model.canonicalize() {
            Ok(dir) => dir.to_string_lossy().into_owned(),
            Err(_) => a.model.to_string_lossy().into_owned(),
        },
        out: a.out,
        bits: a.bits,
        group_size: a.group_size,
        dtype: a.dtype,
        force: a.force,
    })
}
