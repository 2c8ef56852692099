//! `anetrain train`.

use std::path::PathBuf;

use anetrain::data::tokens::TokenDtype;
use anetrain::device::backend::Backend;
use anetrain::device::DeviceBuffers;
use anetrain::model::lora::LoraConfig;
use anetrain::model::Projection;
use anetrain::train::objective::{self, DpoLoss, Objective, ObjectiveKind};
use anetrain::train::optim::AdamWConfig;
use anetrain::train::{self, MemoryOptions, Sample, TrainRequest, TrainSettings};
use anyhow::{bail, Result};

/// How JSONL records are read (`train` and `eval`).
#[derive(clap::Args, Debug)]
pub struct RecordArgs {
    /// Records: the loss on the completion only (the last message of a
    /// chat, the completion of a prompt/completion record).
    #[arg(long)]
    pub mask_prompt: bool,
    /// Records: the field holding the prompt.
    #[arg(long, default_value = "prompt", value_name = "NAME")]
    pub prompt_key: String,
    /// Records: the field holding the completion.
    #[arg(long, default_value = "completion", value_name = "NAME")]
    pub completion_key: String,
}

impl RecordArgs {
    pub fn keys(&self) -> anetrain::data::records::Keys {
        anetrain::data::records::Keys {
            prompt: self.prompt_key.clone(),
            completion: self.completion_key.clone(),
        }
    }
}

#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// A preset (tiny, stories15m, stories42m, stories110m, qwen3-0.6b) to
    /// train from scratch, or a model to fine-tune: a Hub id
    /// ORG/NAME[@REVISION] (e.g. Qwen/Qwen3-0.6B, downloaded into the
    /// Hugging Face cache), a model directory, or a run directory.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Training data [default: the built-in story corpus]: a raw token file
    /// (see --token-dtype), a .txt file (tokenized), a .jsonl file of
    /// records, or a directory with train.jsonl (and optionally valid.jsonl,
    /// used for validation, and test.jsonl). Records are {"text": ...},
    /// {"prompt": ..., "completion": ...} or {"messages": [...]}, the last
    /// two rendered with the tokenizer's chat template; one record per
    /// sequence, truncated to --seq + 1 tokens, shuffled every epoch.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    #[command(flatten)]
    records: RecordArgs,
    /// tokenizer.json (or a Hub id: its tokenizer) for text data
    /// [default: the model's; for a
    /// preset, one trained on the --data text (or on the built-in corpus),
    /// saved in the run; `anetrain tokenizer train` makes one ahead].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Entry width of raw token files.
    #[arg(long, value_parser = crate::choice::<TokenDtype>(), default_value = "u16")]
    token_dtype: TokenDtype,
    /// Engine that runs the kernels [default: ane where available, else cpu].
    #[arg(long, value_parser = crate::choice::<Backend>())]
    backend: Option<Backend>,
    /// Optimizer steps in all. With --resume it may grow, to extend a run
    /// (finished or not): the learning-rate schedule is a function of this
    /// total, so from the resumed step on the cosine decay (and the default
    /// warmup, a tenth of it) follows the new total; with --warmup 0
    /// --min-lr-frac 1 the rate is constant and nothing changes.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Tokens per sequence (the longest a record may be, plus one).
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Sequences (windows or records) per micro-batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Peak learning rate [default: 3e-3 for tiny, 5e-4 for other presets,
    /// 2e-5 when fine-tuning a model directory, 2e-4 with LoRA].
    #[arg(long)]
    lr: Option<f64>,
    /// Linear warmup steps [default: steps/10].
    #[arg(long)]
    warmup: Option<u64>,
    /// Cosine decay floor as a fraction of the peak learning rate.
    #[arg(long, default_value_t = 0.1)]
    min_lr_frac: f64,
    /// AdamW β1.
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    /// AdamW β2.
    #[arg(long, default_value_t = 0.95)]
    beta2: f64,
    /// AdamW ε.
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// Weight decay (matrices and embeddings only, never norm weights).
    #[arg(long, default_value_t = 0.1)]
    wd: f64,
    /// Global gradient-norm clip (0 disables).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Seed for initialisation and data sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Window sampling.
    #[arg(long, value_parser = crate::choice::<Sample>(), default_value = "random")]
    sample: Sample,
    /// Fraction of the data (from the end) held out for validation, when
    /// there is no valid.jsonl.
    #[arg(long, default_value_t = anetrain::train::DEFAULT_VAL_FRAC)]
    val_frac: f64,
    /// Validate every N steps (0 disables).
    #[arg(long, default_value_t = 50)]
    eval_every: u64,
    /// Validation windows (or records) per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_windows: usize,
    /// Checkpoint every N steps (and always at the end).
    #[arg(long, default_value_t = 100)]
    save_every: u64,
    /// Run directory [default: a new directory under ./runs/].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in --out up to --steps (same flags otherwise); also
    /// a run written by scripts/continue_in_torch.py.
    #[arg(long, requires = "out")]
    resume: bool,
    /// Initial loss scale of the Neural Engine backends (a power of two;
    /// halved after a step whose gradients overflow fp16, doubled after
    /// 100 clean steps up to 8192) [default: 1024].
    #[arg(long, value_name = "F", value_parser = loss_scale)]
    loss_scale: Option<f64>,
    /// Print a progress line every N steps when stderr is not a terminal
    /// [default: steps/20].
    #[arg(long)]
    log_every: Option<u64>,
    /// Train LoRA adapters of this rank instead of every weight: the base
    /// model is frozen and the run directory becomes a PEFT adapter
    /// (adapter_config.json + adapter_model.safetensors).
    #[arg(long, value_name = "R", help_heading = "LoRA")]
    lora_rank: Option<usize>,
    /// LoRA α; the adapter branch is scaled by α/r [default: 2·rank].
    #[arg(long, value_name = "A", requires = "lora_rank", help_heading = "LoRA")]
    lora_alpha: Option<f64>,
    /// Dropout on the adapters' inputs (CPU backend only).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0.0,
        requires = "lora_rank",
        help_heading = "LoRA"
    )]
    lora_dropout: f64,
    /// Projections that get adapters.
    #[arg(
        long,
        value_parser = crate::choice::<Projection>(),
        value_delimiter = ',',
        default_value = "q,k,v,o,gate,up,down",
        requires = "lora_rank",
        help_heading = "LoRA"
    )]
    lora_targets: Vec<Projection>,
    /// Adapt the last N layers only (mlx-lm's --num-layers): the backward
    /// stops below them, so a step costs less [default: every layer].
    #[arg(long, value_name = "N", requires = "lora_rank", help_heading = "LoRA")]
    lora_layers: Option<usize>,
    /// Quantize the frozen base to this many bits as it loads (MLX's affine
    /// format, as `anetrain quantize` writes it: 2, 3, 4, 5, 6 or 8), so a
    /// bf16 base trains LoRA at a quarter of its size or less (QLoRA).
    #[arg(long, value_name = "BITS", help_heading = "LoRA")]
    quantize_base: Option<u32>,
    /// Weights per quantization group with --quantize-base: 32, 64 or 128.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 64,
        requires = "quantize_base",
        help_heading = "LoRA"
    )]
    q_group_size: usize,
    /// Start LoRA from this adapter directory (a LoRA run, or any PEFT
    /// adapter of --model) instead of fresh adapters: its rank, α,
    /// dropout and projections, its weights as step 0. The adapter must
    /// name --model as its base (--any-base to apply it anyway).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "lora_rank",
        help_heading = "LoRA"
    )]
    init_adapter: Option<PathBuf>,
    #[command(flatten)]
    any_base: crate::base_check::AnyBase,
    #[command(flatten)]
    preference: PreferenceArgs,
    /// Not a train flag: `--init-adapter` starts from an adapter.
    #[arg(long, hide = true)]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    memory: MemoryArgs,
}

/// Preference tuning on prompt/chosen/rejected pairs.
#[derive(clap::Args, Debug, Clone)]
pub struct PreferenceArgs {
    /// What the run optimises: sft (cross-entropy on the data's tokens),
    /// dpo (preference pairs against a frozen reference: with LoRA, the
    /// base plus the run's initial adapter) or orpo (SFT on the chosen
    /// answer plus an odds-ratio term; no reference). Pairs are JSONL
    /// records in TRL's layouts: {"prompt", "chosen", "rejected"} as
    /// strings or as lists of messages, or "chosen"/"rejected"
    /// conversations that begin with the same prompt.
    #[arg(
        long,
        value_parser = crate::choice::<ObjectiveKind>(),
        default_value = "sft",
        help_heading = "Preference tuning"
    )]
    objective: ObjectiveKind,
    /// DPO's β (how far the policy may move from the reference; IPO's τ),
    /// or ORPO's λ (the odds-ratio term's weight). TRL's default for both.
    #[arg(
        long,
        value_name = "B",
        default_value_t = objective::DEFAULT_BETA,
        help_heading = "Preference tuning"
    )]
    beta: f64,
    /// DPO's loss: sigmoid (the DPO paper's) or ipo. TRL's other types
    /// (hinge, robust, bco_pair, sppo_hard, nca_pair, aot, apo_zero, ...)
    /// are planned.
    #[arg(
        long,
        value_name = "TYPE",
        value_parser = crate::choice::<DpoLoss>(),
        default_value = "sigmoid",
        help_heading = "Preference tuning"
    )]
    dpo_loss: DpoLoss,
    /// Compute the reference's log-probabilities of every pair once
    /// before training (as TRL's precompute_ref_log_probs) instead of two
    /// reference forwards per pair and step.
    #[arg(long, help_heading = "Preference tuning")]
    precompute_ref: bool,
}

impl PreferenceArgs {
    fn objective(&self) -> Result<Objective> {
        Objective::new(
            self.objective,
            self.dpo_loss,
            self.beta,
            self.precompute_ref,
        )
    }
}

/// How a run trades memory for time (`train`, `bench`); none of these
/// changes a result.
#[derive(clap::Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Activation checkpointing: keep only each layer's input during the
    /// forward and recompute the layer during the backward (about a third
    /// more kernel work; the same losses and weights, bit for bit).
    #[arg(long, help_heading = "Memory")]
    pub grad_checkpoint: bool,
    /// Device input buffers: one per layer, kernel and tile, staged once
    /// per step (persistent), or one per kernel refilled tile by tile and
    /// layer by layer while a host thread prepares the next (streamed)
    /// [default: persistent when the run's memory plan with them fits in a
    /// quarter of --max-memory, else streamed].
    #[arg(long, value_parser = crate::choice::<DeviceBuffers>(), help_heading = "Memory")]
    pub device_buffers: Option<DeviceBuffers>,
    /// Refuse to start a run whose memory plan exceeds this (e.g. 14G,
    /// 800M) and say what would fit [default on ane and ane-sim: physical
    /// memory less 2 GB; on cpu: no limit]. `anetrain kernels plan` shows
    /// the plan by part.
    #[arg(long, value_name = "BYTES", value_parser = max_memory, help_heading = "Memory")]
    pub max_memory: Option<u64>,
}

impl MemoryArgs {
    pub fn options(&self) -> MemoryOptions {
        MemoryOptions {
            grad_checkpoint: self.grad_checkpoint,
            device_buffers: self.device_buffers,
            max_memory: self.max_memory,
        }
    }
}

fn max_memory(v: &str) -> Result<u64, String> {
    anetrain::util::mem::parse_bytes(v).map_err(|e| e.to_string())
}

pub fn run(a: TrainArgs) -> Result<()> {
    let lora_run = a.lora_rank.is_some() || a.init_adapter.is_some();
    let lr =
        a.lr.unwrap_or_else(|| TrainSettings::default_lr(&a.model, lora_run));
    if let Some(dir) = &a.adapter {
        bail!(
            "train starts from an adapter with --init-adapter {} (--adapter applies one in eval, generate, merge and export)",
            dir.display()
        );
    }
    let (lora, init_adapter) = match &a.init_adapter {
        Some(dir) => {
            let (lora, dir, found) =
                TrainSettings::lora_of_adapter(&a.model, dir, a.any_base.any_base)?;
            crate::base_check::warn_unchecked(&a.model, &dir, found);
            (Some(lora), Some(dir))
        }
        None => {
            let lora = a.lora_rank.map(|rank| LoraConfig {
                layers: a.lora_layers,
                ..LoraConfig::new(rank, a.lora_alpha, a.lora_dropout, a.lora_targets.clone())
            });
            (lora, None)
        }
    };
    // The run is named after the model as given; a Hub id is read from its
    // snapshot in the Hugging Face cache (downloaded first if need be).
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| train::default_out(&a.model));
    let (model, hub_id) = TrainSettings::resolve_model(&a.model)?;
    let settings = TrainSettings {
        hub_id,
        model,
        backend: a.backend.unwrap_or_else(Backend::platform_default),
        data: a.data.clone(),
        token_dtype: a.token_dtype,
        seq: a.seq,
        batch: a.batch,
        accum: a.accum,
        lr,
        warmup: a.warmup,
        min_lr_frac: a.min_lr_frac,
        clip: a.clip,
        seed: a.seed,
        sample: a.sample,
        val_frac: a.val_frac,
        eval_every: a.eval_every,
        eval_windows: a.eval_windows,
        lora,
        init_adapter,
        quantize_base: a
            .quantize_base
            .map(|b| anetrain::model::quant::QuantSpec::new(b, a.q_group_size))
            .transpose()?,
        mask_prompt: a.records.mask_prompt,
        keys: a.records.keys(),
        loss_scale: a.loss_scale,
        objective: a.preference.objective()?,
    };
    let mut progress = crate::progress::Progress::new(a.log_every.unwrap_or((a.steps / 20).max(1)));
    let request = TrainRequest {
        settings,
        adamw: AdamWConfig {
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.wd,
        },
        steps: a.steps,
        out,
        out_is_default: a.out.is_none(),
        resume: a.resume,
        tokenizer: a
            .tokenizer
            .map(|t| anetrain::model::hub::resolve_tokenizer(&t))
            .transpose()?,
        save_every: a.save_every,
        memory: a.memory.options(),
    };
    let stop = crate::progress::stop_flag();
    train::train(request, &mut |e| progress.event(e), stop)?;
    Ok(())
}

/// `--loss-scale`: a power of two from 1 to 2^30, so scaling and unscaling
/// the gradients is exact.
fn loss_scale(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|_| format!("'{v}' is not a number"))?;
    if !(1.0..=1073741824.0).contains(&x) || x.log2().fract() != 0.0 {
        return Err(format!("{v} is not a power of two between 1 and 2^30"));
    }
    Ok(x)
}
