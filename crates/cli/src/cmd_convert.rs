//! `anetrain convert`: a llama2.c checkpoint as a Hugging Face model.

use std::path::PathBuf;

use anetrain::data::tokenizer::Tokenizer;

use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
    /// The llama2.c .bin checkpoint.
    input: PathBuf,
    /// Output model directory.
    #[arg(long)]
    out: PathBuf,
    /// tokenizer.json to copy beside the model (or a Hub id: its tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let model = anetrain::tools::convert::load_llama2c(&a.input)?;
    model.save(&a.out)?;
    if let Some(t) = a.tokenizer {
        Tokenizer::load(&hub::resolve_tokenizer(&t)?)?
            .save_to_dir(&a.out, model.cfg.max_position_embeddings)?;
    }
    println!(
        "converted {} ({:.1}M parameters) to {}",
        a.input.display(),
        model.num_params() as f64 / 1e6,
        a.out.display()
    );
    Ok(())
}
