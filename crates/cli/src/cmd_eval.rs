//! `anetrain eval`: a model's (and adapter's) loss over tokens, a data
//! file or JSONL records, or its preference loss and metrics over pairs.

use std::path::PathBuf;

use anetrain::data::tokens::TokenDtype;
use anetrain::device::backend::Backend;

use crate::{base_check, cmd_model, cmd_train};
use anetrain::model::hub;
use anetrain::train::objective::{self, DpoLoss, Objective, ObjectiveKind};

#[derive(clap::Args)]
pub struct Args {
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
    #[arg(long, value_parser = crate::choice::<TokenDtype>(), default_value = "u16")]
    token_dtype: TokenDtype,
    /// tokenizer.json for text data (or a Hub id: its tokenizer)
    /// [default: the model's].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Evaluate at most this many windows of --data.
    #[arg(long)]
    max_windows: Option<usize>,
    /// A LoRA adapter directory to apply to --model: a LoRA run, a PEFT
    /// adapter or an mlx-lm one.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    any_base: base_check::AnyBase,
    /// Engine [default: ane where available, else cpu].
    #[arg(long, value_parser = crate::choice::<Backend>())]
    backend: Option<Backend>,
    /// Preference pairs (a .jsonl of {"prompt", "chosen", "rejected"}):
    /// the loss to report, dpo (against the base without --adapter's
    /// adapters, as TRL's reference of a PEFT model) or orpo, with TRL's
    /// metrics (rewards, accuracy, margin, log-probabilities).
    #[arg(long, value_parser = crate::choice::<ObjectiveKind>(), help_heading = "Preference pairs")]
    objective: Option<ObjectiveKind>,
    /// DPO's β, or ORPO's λ.
    #[arg(long, value_name = "B", default_value_t = objective::DEFAULT_BETA, help_heading = "Preference pairs")]
    beta: f64,
    /// DPO's loss: sigmoid or ipo.
    #[arg(long, value_name = "TYPE", value_parser = crate::choice::<DpoLoss>(), default_value = "sigmoid", help_heading = "Preference pairs")]
    dpo_loss: DpoLoss,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    // Pairs are scored by DPO unless another objective is named.
    let kind = match a.objective {
        Some(ObjectiveKind::Sft) => {
            anyhow::bail!("--objective applies to preference pairs: dpo or orpo (plain records are scored by their cross-entropy without it)")
        }
        Some(k) => k,
        None => ObjectiveKind::Dpo,
    };
    let objective = Objective::new(kind, a.dpo_loss, a.beta, false)?;
    cmd_model::eval(cmd_model::EvalArgs {
        objective,
        objective_given: a.objective.is_some(),
        adapter: base_check::checked(&a.model, a.adapter, a.any_base)?,
        backend: a.backend.unwrap_or_else(Backend::platform_default),
        model: hub::resolve_path(&a.model, hub::Need::Model)?,
        data: a.data,
        tokens: a.tokens,
        seq: a.seq,
        logits_out: a.logits_out,
        token_dtype: a.token_dtype,
        tokenizer: a
            .tokenizer
            .map(|t| hub::resolve_tokenizer(&t))
            .transpose()?,
        max_windows: a.max_windows,
        split: a.split,
        mask_prompt: a.records.mask_prompt,
        keys: a.records.keys(),
    })
}
