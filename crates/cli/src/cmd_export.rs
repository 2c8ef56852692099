//! `anetrain export gguf`: a model for llama.cpp, Ollama and LM Studio.

use std::path::PathBuf;

use crate::{base_check, cmd_model};
use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ExportCommand,
}

#[derive(clap::Subcommand)]
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

pub fn run(a: Args) -> anyhow::Result<()> {
    let ExportCommand::Gguf {
        model,
        adapter,
        any_base,
        out,
        ty,
        force,
    } = a.command;
    base_check::check(&model, adapter.as_deref(), any_base)?;
    cmd_model::export_gguf(
        &hub::resolve_path(&model, hub::Need::Model)?,
        adapter.as_deref(),
        &out,
        anetrain::tools::gguf::ExportType::parse(&ty)?,
        force,
    )
}
