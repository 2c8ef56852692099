//! `anetrain bench`: training steps timed as `train` runs them.

use anetrain::device::backend::Backend;
use anetrain::tools::bench::{bench, BenchArgs};

use crate::cmd_train;
use anetrain::model::hub;

#[derive(clap::Args)]
pub struct Args {
    /// A preset (random initialisation), a model directory or a Hub id
    /// ORG/NAME[@REVISION].
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Engine [default: ane where available, else cpu].
    #[arg(long, value_parser = crate::choice::<Backend>())]
    backend: Option<Backend>,
    /// Time LoRA training with adapters of this rank on every projection
    /// (base frozen) instead of full training.
    #[arg(long, value_name = "R")]
    lora_rank: Option<usize>,
    #[command(flatten)]
    memory: cmd_train::MemoryArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let args = BenchArgs {
        lora_rank: a.lora_rank,
        memory: a.memory.options(),
        model: hub::resolve(&a.model, hub::Need::Model)?,
        seq: a.seq,
        batch: a.batch,
        steps: a.steps,
        warmup: a.warmup,
        backend: a.backend.unwrap_or_else(Backend::platform_default),
    };
    let r = bench(&args, &mut |line| eprintln!("{line}"))?;
    println!("{r}");
    Ok(())
}
