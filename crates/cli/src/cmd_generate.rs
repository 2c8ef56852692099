//! `anetrain generate`: text from a prompt, streamed.

use std::path::PathBuf;

use anetrain::device::backend::Backend;

use crate::{base_check, cmd_model};
use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
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
    /// A LoRA adapter directory to apply to --model: a LoRA run, a PEFT
    /// adapter or an mlx-lm one.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    any_base: base_check::AnyBase,
    /// Engine [default: ane where available, else cpu]. The CPU engine
    /// decodes with a KV cache; the Neural Engine paths rerun the
    /// compiled kernels over the whole (padded) sequence per token.
    #[arg(long, value_parser = crate::choice::<Backend>())]
    backend: Option<Backend>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    cmd_model::run_generate(cmd_model::GenerateArgs {
        adapter: base_check::checked(&a.model, a.adapter, a.any_base)?,
        backend: a.backend.unwrap_or_else(Backend::platform_default),
        model: hub::resolve_path(&a.model, hub::Need::Model)?,
        prompt: a.prompt,
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        tokenizer: a
            .tokenizer
            .map(|t| hub::resolve_tokenizer(&t))
            .transpose()?,
        chat: a.chat,
    })
}
