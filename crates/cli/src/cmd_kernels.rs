//! `anetrain kernels dump`, `anetrain kernels plan` and `anetrain kernels check`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anetrain::device::backend::Backend;
use anetrain::kernels::{self, check, tiling, KernelKind, KernelOptions, Shape};
use anetrain::model::config::ModelConfig;
use anetrain::model::lora::LoraConfig;
use anetrain::plan::memory::{MemoryOptions, RunPlan};
use anetrain::util::choice::Choice;
use anyhow::{bail, Context, Result};

use crate::fsutil::write_atomic;

/// Shape and options for `--model`, `--seq`, `--seed-compat`, built for
/// `family` (`--family`) or else the chip family in force; with
/// `announce`, the family whose limits they are built for is printed.
pub fn setup(
    model: &str,
    seq: usize,
    seed_compat: bool,
    announce: bool,
    family: Option<ane::family::Family>,
) -> Result<(ModelConfig, Shape, KernelOptions)> {
    let cfg = ModelConfig::resolve(model)?;
    let profile = match family {
        Some(f) => ane::family::Profile::asked(f, "asked for with --family")?,
        None => ane::family::Profile::in_force()?,
    };
    if seq == 0 || seq > cfg.max_position_embeddings {
        bail!(
            "--seq {seq} must be between 1 and the model's max_position_embeddings ({})",
            cfg.max_position_embeddings
        );
    }
    let opts = if seed_compat {
        KernelOptions::seed(&cfg)
    } else {
        KernelOptions::hf(&cfg).for_profile(&profile)
    };
    if opts.qk_norm() && cfg.head_dim > cfg.hidden_size {
        bail!(
            "head_dim ({}) larger than hidden_size ({}) is not supported by the kernel layouts",
            cfg.head_dim,
            cfg.hidden_size
        );
    }
    if !seed_compat && announce {
        println!("chip family: {}", profile.describe());
    }
    Ok((cfg.clone(), Shape::new(&cfg, seq), opts))
}

fn selected(only: &[String]) -> Result<Vec<KernelKind>> {
    if only.is_empty() {
        return Ok(KernelKind::ALL.to_vec());
    }
    only.iter()
        .map(|n| {
            KernelKind::from_name(n).with_context(|| {
                let names: Vec<&str> = KernelKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown kernel '{n}' (kernels: {})", names.join(", "))
            })
        })
        .collect()
}

pub fn dump(model: &str, out: &Path, seq: usize, seed_compat: bool, only: &[String]) -> Result<()> {
    let (_, shape, opts) = setup(model, seq, seed_compat, true, None)?;
    let plan = tiling::plan(&shape, &opts)?;
    let weights = out.join("weights");
    std::fs::create_dir_all(&weights)
        .with_context(|| format!("cannot create '{}'", weights.display()))?;
    let mut layouts = serde_json::Map::new();
    for kind in selected(only)? {
        // A tiled kernel is one program at its tile shape.
        let k = kernels::build(kind, &plan.of(kind).shape, &opts)
            .map_err(|e| anyhow::anyhow!("{}: {e}", kind.name()))?;
        // The seed's names where the seed has the kernel.
        let name = match seed_compat {
            true => kind.seed_name().unwrap_or(kind.name()),
            false => kind.name(),
        };
        write_atomic(&out.join(format!("{name}.mil")), k.text().as_bytes())?;
        for (file, bytes) in &k.blobs {
            write_atomic(&weights.join(file), bytes)?;
        }
        layouts.insert(name.to_string(), serde_json::to_value(&k.layout)?);
    }
    let doc =
        serde_json::json!({ "shape": shape, "options": opts, "plan": plan, "kernels": layouts });
    write_atomic(
        &out.join("layout.json"),
        serde_json::to_string_pretty(&doc)?.as_bytes(),
    )?;
    let tiled: Vec<String> = plan
        .kernels
        .iter()
        .filter(|k| k.tiles > 1 && layouts.contains_key(k.kind.name()))
        .map(|k| format!("{} in {} tiles", k.kind.name(), k.tiles))
        .collect();
    println!(
        "wrote {} kernel(s), weights/ and layout.json to {}{}",
        layouts.len(),
        out.display(),
        if tiled.is_empty() {
            String::new()
        } else {
            format!(
                " (tiled: {}; see `anetrain kernels plan`)",
                tiled.join(", ")
            )
        }
    );
    Ok(())
}

/// What `anetrain kernels plan` plans for.
pub struct PlanArgs {
    pub model: String,
    pub seq: usize,
    pub lora_rank: Option<usize>,
    /// LoRA on the last this many layers only (`train --lora-layers`).
    pub lora_layers: Option<usize>,
    /// The projections LoRA adapts (`train --lora-targets`).
    pub lora_targets: Vec<anetrain::model::Projection>,
    /// Examples (or pairs) a step (`train --batch` × `--accum`).
    pub batch: usize,
    pub backend: Backend,
    pub memory: MemoryOptions,
    pub json: bool,
    /// The family whose predicted step the text plan shows (default: the
    /// one in force; every family when none is known).
    pub family: Option<ane::family::Family>,
    /// A preference step (one pair) instead of one SFT sequence.
    pub pair: Option<anetrain::plan::memory::PairStep>,
    /// A whole run of this many steps to predict too.
    pub steps: Option<u64>,
    /// The data a run would train on, and the tokenizer to read it with
    /// (the model's unless given): its tokens a step, and an epoch's
    /// steps when `steps` is not given.
    pub data: Option<(PathBuf, Option<PathBuf>)>,
    /// What the step trains (the data is read for it).
    pub objective: anetrain::train::objective::Objective,
}

/// `anetrain kernels plan --seed-compat`: the validation of the cost
/// model (every published step beside its prediction, on its own chip's
/// curves) and the seed's programs for `model` at `seq` on each family,
/// with the seed's host work (maderix/ANE's dynamic pipeline).
pub fn show_seed_plan(model: &str, seq: usize, json: bool) -> Result<()> {
    use anetrain::plan::calibration::{predict_seed, validate};
    use anetrain::plan::timeline::SeedStep;
    let cfg = ModelConfig::resolve(model)?;
    let rows = validate()?;
    let step = SeedStep {
        vocab: 9200.min(cfg.vocab_size),
        optimizer: false,
        fused_mha: false,
    };
    let mine: Vec<_> = ane::family::Family::ALL
        .iter()
        .map(|&f| predict_seed(&cfg, seq, step, &ane::cost::Rates::of(f)))
        .collect::<Result<_>>()?;
    if json {
        let v = serde_json::json!({ "validation": rows, "seed_step": mine });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("the cost model against published steps (the seed's programs and host work; docs/benchmarks.md):");
    for v in &rows {
        println!(
            "  {:<14} {} on {}: predicted {:.1} ms, published {:.1} ms ({:+.1}%){}{}",
            v.published.name,
            v.published.family.name(),
            v.published.curve,
            v.predicted.step_ms,
            v.published.ms,
            100.0 * v.error,
            if v.published.fitted { ", fitted" } else { "" },
            v.published
                .known_miss
                .map_or(String::new(), |why| format!("; missed: {why}"))
        );
        println!("    source: {}", v.published.source);
    }
    println!(
        "\nthe seed's programs for {model} at seq {seq} (its host work: the classifier on the CPU over a {}-token vocabulary, no optimizer counted):",
        step.vocab
    );
    for p in &mine {
        println!("  {}", p.describe());
    }
    Ok(())
}

/// `anetrain kernels plan`: how each kernel is tiled for this model under
/// the device limits in force, what that costs, and the memory plan of a
/// training run with these settings.
pub fn show_plan(a: PlanArgs) -> Result<()> {
    let PlanArgs {
        model,
        seq,
        lora_rank,
        ..
    } = &a;
    let (model, seq, lora_rank) = (model.as_str(), *seq, *lora_rank);
    let (cfg, shape, mut opts) = setup(model, seq, false, !a.json, a.family)?;
    let lora = lora_rank.map(|r| LoraConfig {
        layers: a.lora_layers,
        ..LoraConfig::new(r, None, 0.0, a.lora_targets.clone())
    });
    opts = opts.with_lora(lora.as_ref());
    let source = anetrain::model::source::ModelSource::resolve(model)?;
    let pair = a.pair;
    let memory = RunPlan::new(&source, seq, lora.as_ref(), a.backend, &a.memory, pair)?;
    let plan = tiling::plan(&shape, &opts)?;
    // One example, or one pair: its two sequences and the reference's.
    // The data, read as `train` reads it: its tokens in a row.
    let fill = match &a.data {
        Some((data, tokenizer)) => {
            let s = anetrain::train::TrainSettings {
                data: Some(data.clone()),
                objective: a.objective,
                ..anetrain::train::TrainSettings::neutral(model, seq)
            };
            Some((
                data,
                anetrain::train::data_fill(&s, &source, tokenizer.as_deref())?,
            ))
        }
        None => None,
    };
    let mut setup = anetrain::plan::timeline::StepSetup::new(
        seq,
        a.batch,
        pair,
        lora.clone(),
        a.memory.grad_checkpoint,
        memory.buffers,
    );
    if let Some((_, f)) = &fill {
        setup = setup.with_row_tokens(f.row_tokens);
    }
    // A run of --steps, or one epoch of the data (--batch examples a step).
    let steps = a
        .steps
        .or(fill.map(|(_, f)| f.examples.div_ceil(a.batch) as u64));
    let work = anetrain::plan::work::StepWork::plan(
        &cfg,
        seq,
        setup.batch,
        &opts,
        lora.is_none(),
        a.memory.grad_checkpoint,
    )?
    .with_reference(&cfg, &opts, setup.reference_forwards)?;
    let predicted = anetrain::plan::timeline::predict_families(&cfg, &setup, &opts)?;
    // Each family's CPU instead: the step's products alone (a floor of a
    // cpu step), by family name.
    let cpu: std::collections::BTreeMap<String, f64> = predicted
        .iter()
        .map(|p| {
            let f = ane::family::Family::parse(&p.family)?;
            Ok((
                p.family.clone(),
                work.cpu_products_ms(&ane::cost::Rates::of(f)),
            ))
        })
        .collect::<Result<_>>()?;
    if a.json {
        let by_family: serde_json::Map<String, serde_json::Value> = predicted
            .iter()
            .map(|p| Ok((p.family.clone(), serde_json::to_value(p)?)))
            .collect::<Result<_>>()?;
        // The whole run: its steps and the programs' compiles, once, and
        // the steps' energy.
        let runs: serde_json::Map<String, serde_json::Value> = predicted
            .iter()
            .filter_map(|p| {
                let steps = steps? as f64;
                let s = (p.step_ms * steps + p.compile_ms) / 1e3;
                Some((p.family.clone(), s.into()))
            })
            .collect();
        let run_wh: serde_json::Map<String, serde_json::Value> = predicted
            .iter()
            .filter_map(|p| Some((p.family.clone(), p.watt_hours(steps?).into())))
            .collect();
        let v = serde_json::json!({
            "cpu_products_ms": cpu,
            "steps": steps,
            "run_wh": run_wh,
            "data": fill.map(|(path, f)| serde_json::json!({
                "path": path,
                "examples": f.examples,
                "row_tokens": f.row_tokens,
            })),
            "run_s": runs,
            "shape": shape,
            "plan": plan,
            "work": work,
            "predicted": by_family,
            "memory": memory.plan,
            "max_memory": memory.limit,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{model}: dim {} intermediate {} heads {}/{} head_dim {} layers {} seq {}{}; axis caps: spatial {}, channel {}{}",
        shape.dim,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        cfg.num_hidden_layers,
        seq,
        {
            let on = match lora.as_ref().map(|l| l.targets.len()) {
                Some(7) => "all projections".to_string(),
                _ => a
                    .lora_targets
                    .iter()
                    .map(|p| p.name())
                    .collect::<Vec<_>>()
                    .join(","),
            };
            let batch = match a.batch {
                1 => String::new(),
                b => format!(", {b} examples a step"),
            };
            match (lora_rank, a.lora_layers) {
                (None, _) => batch,
                (Some(r), None) => format!(", LoRA rank {r} on {on}{batch}"),
                (Some(r), Some(n)) => format!(
                    ", LoRA rank {r} on {on} of the last {} layers (the backward stops below them){batch}",
                    n.min(cfg.num_hidden_layers)
                ),
            }
        },
        plan.limits.max_spatial,
        plan.limits.max_channel,
        if std::env::var_os(ane::family::MAX_DIM_ENV).is_some() {
            format!(" (from {})", ane::family::MAX_DIM_ENV)
        } else {
            String::new()
        }
    );
    println!(
        "{:<18} {:>5}  {:<18} {:>16} {:>10} {:>16} {:>10}",
        "kernel", "tiles", "split", "tile input", "KiB", "tile output", "KiB"
    );
    for k in plan.used() {
        let (i, o) = k.surface_bytes();
        let unit = match k.splits.is_empty() {
            true => "-".to_string(),
            false => k
                .splits
                .iter()
                .map(|sp| {
                    format!(
                        "{} {}/{}",
                        sp.axis.short(),
                        sp.axis.count(&k.shape),
                        sp.axis.count(&shape)
                    )
                })
                .collect::<Vec<_>>()
                .join(" x "),
        };
        println!(
            "{:<18} {:>5}  {:<18} {:>16} {:>10.1} {:>16} {:>10.1}",
            k.kind.name(),
            k.tiles,
            unit,
            format!("{}x{}", k.input[0], k.input[1]),
            i as f64 / 1024.0,
            format!("{}x{}", k.output[0], k.output[1]),
            o as f64 / 1024.0
        );
    }
    let budget = ane::DEFAULT_COMPILE_BUDGET;
    println!(
        "{} programs to compile per sequence length (tiles of a kernel share one program, or one per causal key class; {} of the ~{budget} compiles a process gets), {} device evaluations per layer per training step",
        plan.programs_for(&cfg.layer_classes()),
        plan.programs_for(&cfg.layer_classes()),
        plan.evaluations_per_layer()
    );
    let fused = plan.of(KernelKind::SdpaBackward);
    let classes = match fused.keys.is_empty() {
        true => String::new(),
        false => format!(
            "; its blocks of {} queries read only the keys up to the next power of two of their end, {} programs: {} keys",
            fused.shape.queries,
            fused.keys.len(),
            fused
                .keys
                .iter()
                .map(|c| c.shape.seq.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    println!(
        "attention backward: {}{}",
        match plan.attention_backward {
            tiling::AttentionBackward::Fused =>
                "sdpa_backward, one program per tile (P and dP stay on the device; the model predicts it faster than the pair)",
            tiling::AttentionBackward::Pair if plan.of(KernelKind::SdpaBackward1).tiles > 1 =>
                "sdpa_backward1 then sdpa_backward2, tile by tile (P and dP handed through the host)",
            tiling::AttentionBackward::Pair =>
                "sdpa_backward1 then sdpa_backward2 over the whole layer",
        },
        match plan.attention_backward {
            tiling::AttentionBackward::Fused => classes.as_str(),
            tiling::AttentionBackward::Pair => "",
        }
    );
    let how = match lora.is_some() {
        true => "head_forward once a chunk: the frozen head's input gradient is gathered beside the statistics",
        false => "head_forward twice over several chunks: statistics, then the gradient",
    };
    println!(
        "LM head: {} vocabulary chunks of {} rows ({} tokens), {} device evaluations per sequence with a gradient ({how})",
        plan.head.chunks,
        plan.head.rows,
        shape.vocab,
        plan.head_work(tiling::HeadPass::gradient(lora.is_none())).1
    );
    println!("{}", work.describe());
    if let Some((path, f)) = &fill {
        println!(
            "data: '{}', {} training {} of {:.0} tokens on average in rows of {seq} ({:.0}% padding); {}",
            path.display(),
            f.examples,
            match pair {
                Some(_) => "pairs (two rows each)",
                None => "examples",
            },
            f.row_tokens,
            100.0 * (1.0 - f.row_tokens / seq as f64),
            match a.steps {
                Some(_) => "the run's tokens per second count the data's, not the padding",
                None => "the run below is one epoch",
            }
        );
    }
    let family = match a.family {
        Some(f) => Some(f),
        None => ane::family::Profile::in_force()?.family,
    };
    println!(
        "predicted step on the Neural Engine ({} device buffers; a cost model of published measurements, docs/benchmarks.md):",
        memory.buffers.name()
    );
    for p in predicted
        .iter()
        .filter(|p| family.is_none_or(|f| f.name() == p.family))
    {
        println!(
            "  {}; compiling {} programs once: {:.1} s",
            p.describe(),
            plan.programs_for(&cfg.layer_classes()),
            p.compile_ms / 1e3
        );
        let f = ane::family::Family::parse(&p.family)?;
        println!(
            "    on its CPU instead (--backend cpu): ≥ {:.0} ms/step for the matrix products alone (Accelerate's fp32 sgemm as ANEForge measured it{}; the CPU engine's norms, softmax and AdamW come on top)",
            cpu[&p.family],
            match f {
                ane::family::Family::M2 | ane::family::Family::M3 => " on the M1, no other curve published",
                _ => "",
            }
        );
        if let Some(steps) = steps {
            let s = (p.step_ms * steps as f64 + p.compile_ms) / 1e3;
            println!(
                "    {steps} steps ≈ {} with the compiles ({:.0} tokens of data a step), {}",
                duration(s),
                p.tokens_per_s * p.step_ms / 1e3,
                anetrain::plan::timeline::watt_hours(p.watt_hours(steps))
            );
        }
    }
    // What an "unmeasured" in the lines above stands for.
    let mut named: Vec<&str> = vec![];
    for p in predicted
        .iter()
        .filter(|p| family.is_none_or(|f| f.name() == p.family))
    {
        for u in &p.unmeasured {
            if !named.contains(u) {
                named.push(u);
            }
        }
    }
    for (name, what) in ane::cost::UNMEASURED
        .iter()
        .filter(|(n, _)| named.contains(n))
    {
        println!("  unmeasured {name}: {what}");
    }
    println!(
        "\nmemory of a training run on {}{}{}:",
        a.backend.name(),
        lora_rank.map_or(String::new(), |r| format!(", LoRA rank {r}")),
        if a.memory.grad_checkpoint {
            ", --grad-checkpoint"
        } else {
            ""
        }
    );
    print!("{}", memory.plan.table());
    if let Some(limit) = memory.limit {
        let fits = memory.plan.total <= limit;
        println!(
            "{} the limit of {}{}",
            if fits { "within" } else { "OVER" },
            anetrain::plan::memory::size(limit),
            if a.memory.max_memory.is_some() {
                " (--max-memory)"
            } else {
                " (physical memory less 2 GB)"
            }
        );
    }
    Ok(())
}

pub fn run_check(
    model: &str,
    seq: usize,
    seed_compat: bool,
    only: &[String],
    seed: u64,
) -> Result<()> {
    let (_, shape, opts) = setup(model, seq, seed_compat, true, None)?;
    println!(
        "kernel check: dim {} hidden {} heads {}/{} head_dim {} seq {} (rope {:?}, qk_norm {}, residual scale {})",
        shape.dim, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.seq, opts.rope, opts.qk_norm(), opts.residual_scale
    );
    println!(
        "{:<18} {:>12} {:>12} {:>12} {:>12} {:>8}  status",
        "kernel", "fp32 maxabs", "fp32 rel", "fp16 maxabs", "fp16 rel", "time"
    );
    let mut failed = vec![];
    // One rule set, one verdict: the rules and limits of the family in
    // force, as `mil check --family F --strict` applies them, whatever
    // layout (ours or the seed's) the programs follow.
    let profile = ane::family::Profile::in_force()?;
    let rules = ane::rules::RuleSet::for_limits(profile.limits);
    if seed_compat {
        println!("rules and limits: {}", profile.describe());
    }
    let mut broken = vec![];
    let mut broken_rules = std::collections::BTreeSet::new();
    let plan = tiling::plan(&shape, &opts)?;
    for kind in selected(only)? {
        // A tiled kernel is checked at its tile shape (its one program).
        let shape = plan.of(kind).shape;
        let program = anetrain::kernels::build(kind, &shape, &opts)
            .map_err(|e| anyhow::anyhow!("{}: {e}", kind.name()))?;
        for f in ane::rules::check(&program.program, &rules) {
            broken_rules.insert(f.rule);
            broken.push(format!("{}: {f}", kind.name()));
        }
        let t = Instant::now();
        let r = check::check_kernel(kind, &shape, &opts, seed)
            .map_err(|e| anyhow::anyhow!("{}: {e}", kind.name()))?;
        let ok = r.passed();
        println!(
            "{:<18} {:>12.3e} {:>12.3e} {:>12.3e} {:>12.3e} {:>7.2}s  {}",
            kind.name(),
            r.fp32_max_abs,
            r.fp32_rel,
            r.fp16_max_abs,
            r.fp16_rel,
            t.elapsed().as_secs_f64(),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failed.push(kind.name());
        }
    }
    println!(
        "tolerances: fp32 rel <= {:.0e}, fp16 rel <= {:.0e}",
        check::FP32_TOL,
        check::FP16_TOL
    );
    if broken.is_empty() {
        println!(
            "ANE rules: every kernel meets all {} rules in force (`mil check` lists them)",
            ane::rules::all()
                .iter()
                .filter(|r| rules.is_on(r.id))
                .count()
        );
    }
    for b in &broken {
        println!("ANE rule broken: {b}");
    }
    let mut problems = vec![];
    if !failed.is_empty() {
        problems.push(format!(
            "{} kernel(s) out of tolerance: {}",
            failed.len(),
            failed.join(", ")
        ));
    }
    if !broken.is_empty() {
        problems.push(format!(
            "{} ANE rule finding(s) ({}; `mil check --family F --strict` on the dumped programs gives the same verdict)",
            broken.len(),
            broken_rules.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: KernelsCommand,
}

#[derive(clap::Subcommand)]
enum KernelsCommand {
    /// Write every kernel's .mil, its blobs under weights/, and layout.json.
    Dump {
        /// A preset (qwen3-0.6b, stories15m, stories42m, stories110m, tiny),
        /// a model directory with config.json, or a Hub id ORG/NAME.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Sequence length the kernels are built for.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Use the seed's conventions (interleaved RoPE, θ=10000, no QK-norm,
        /// DeepNet residual scale) and its file names.
        #[arg(long)]
        seed_compat: bool,
        /// Only these kernels (repeatable), e.g. --kernel sdpa_forward.
        #[arg(long = "kernel", value_name = "NAME")]
        kernels: Vec<String>,
    },
    /// Predict a training step on the Neural Engine: tiles, work, time per
    /// chip family, and the run's memory plan.
    ///
    /// For the chip family in force (or --family): how each kernel is tiled
    /// (a kernel whose input or output would pass the family's largest
    /// dimension, or ANETRAIN_ANE_MAX_DIM, runs as several programs of one
    /// smaller shape, split along the intermediate size, groups of KV heads
    /// or blocks of queries, their results concatenated or summed); the
    /// programs to compile and the device evaluations and FLOPs of a step;
    /// the predicted step on each chip family, from a cost model of
    /// published measurements (docs/benchmarks.md), not of this machine,
    /// with its energy at the family's published package power and the
    /// same step's matrix products on that Mac's CPU; and the memory plan
    /// of a training run with these settings.
    Plan {
        /// A preset, a model directory with config.json, or a Hub id.
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Sequence length.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Plan for LoRA adapters of this rank on all seven projections.
        #[arg(long, value_name = "R")]
        lora_rank: Option<usize>,
        /// Adapt the last N layers only, as `train --lora-layers` does: the
        /// backward stops below them [default: every layer].
        #[arg(long, value_name = "N", requires = "lora_rank")]
        lora_layers: Option<usize>,
        /// The projections that get adapters, as `train --lora-targets`.
        #[arg(
            long,
            value_parser = crate::choice::<anetrain::model::Projection>(),
            value_delimiter = ',',
            default_value = "q,k,v,o,gate,up,down",
            requires = "lora_rank"
        )]
        lora_targets: Vec<anetrain::model::Projection>,
        /// Examples (or pairs) a step, as `train --batch` × `--accum`: the
        /// step runs them one after another.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
        /// The engine whose memory plan to show.
        #[arg(long, value_parser = crate::choice::<anetrain::device::backend::Backend>(), default_value = "ane")]
        backend: anetrain::device::backend::Backend,
        #[command(flatten)]
        memory: crate::cmd_train::MemoryArgs,
        /// Print the plan (tiles, predicted step per chip family, memory)
        /// as JSON.
        #[arg(long)]
        json: bool,
        /// Show the predicted step of this chip family (m1 … m5; default:
        /// the family in force, or every family when none is known).
        #[arg(long, value_parser = parse_family)]
        family: Option<ane::family::Family>,
        /// Plan a preference step (one pair: two sequences, and DPO's two
        /// reference forwards) instead of one SFT sequence.
        #[arg(long, value_parser = crate::choice::<anetrain::train::objective::ObjectiveKind>(), default_value = "sft")]
        objective: anetrain::train::objective::ObjectiveKind,
        /// DPO with the reference's log-probabilities precomputed (no
        /// reference forwards in the step).
        #[arg(long)]
        precompute_ref: bool,
        /// Also predict a whole run of this many optimizer steps (each of
        /// one sequence at --seq; the programs compiled once).
        #[arg(long, value_name = "N")]
        steps: Option<u64>,
        /// The data a run would train on (as `train --data` reads it): the
        /// predicted tokens a second count its tokens, not the padding of
        /// records shorter than --seq, and without --steps the run shown
        /// is one epoch of it.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        /// The tokenizer.json to read --data with [default: the model's].
        #[arg(long, value_name = "FILE", requires = "data")]
        tokenizer: Option<PathBuf>,
        /// Reproduce the cost model's validation: every published step
        /// (maderix/ANE, rustane) beside its prediction on its own chip's
        /// curves, and the seed's programs for --model at --seq on each
        /// family.
        #[arg(long, conflicts_with_all = ["lora_rank", "data", "steps", "objective"])]
        seed_compat: bool,
    },
    /// Run every kernel through the interpreter (fp32 and fp16) against its
    /// CPU twin on random inputs; exit non-zero when one is out of tolerance.
    Check {
        /// A preset, a model directory, or a Hub id ORG/NAME[@REVISION].
        #[arg(long, default_value = "tiny")]
        model: String,
        /// Sequence length.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Use the seed's conventions.
        #[arg(long)]
        seed_compat: bool,
        /// Only these kernels (repeatable).
        #[arg(long = "kernel", value_name = "NAME")]
        kernels: Vec<String>,
        /// Random seed for the inputs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

pub fn run(a: Args) -> Result<()> {
    use anetrain::model::hub::{resolve, Need};
    match a.command {
        KernelsCommand::Dump {
            model,
            out,
            seq,
            seed_compat,
            kernels,
        } => dump(
            &resolve(&model, Need::Config)?,
            &out,
            seq,
            seed_compat,
            &kernels,
        ),
        KernelsCommand::Check {
            model,
            seq,
            seed_compat,
            kernels,
            seed,
        } => run_check(
            &resolve(&model, Need::Config)?,
            seq,
            seed_compat,
            &kernels,
            seed,
        ),
        KernelsCommand::Plan {
            model,
            seq,
            json,
            seed_compat: true,
            ..
        } => show_seed_plan(&resolve(&model, Need::Config)?, seq, json),
        KernelsCommand::Plan {
            model,
            seq,
            lora_rank,
            lora_layers,
            lora_targets,
            batch,
            backend,
            memory,
            json,
            family,
            objective,
            precompute_ref,
            steps,
            data,
            tokenizer,
            seed_compat: false,
        } => show_plan(PlanArgs {
            model: resolve(&model, Need::Config)?,
            seq,
            lora_rank,
            lora_layers,
            lora_targets,
            batch: batch as usize,
            backend,
            memory: memory.options(),
            json,
            family,
            pair: objective.pair_step(precompute_ref),
            steps,
            data: data.map(|d| (d, tokenizer)),
            objective: anetrain::train::objective::Objective::new(
                objective,
                anetrain::train::objective::DpoLoss::Sigmoid,
                anetrain::train::objective::DEFAULT_BETA,
                precompute_ref,
            )?,
        }),
    }
}

/// `--family m1 … m5`.
fn parse_family(s: &str) -> Result<ane::family::Family, ane::Error> {
    ane::family::Family::parse(s)
}

/// Seconds as a person reads them: 8.4 s, 95 s, 12.5 min, 3.2 h.
fn duration(s: f64) -> String {
    match s {
        s if s < 10.0 => format!("{s:.1} s"),
        s if s < 120.0 => format!("{s:.0} s"),
        s if s < 7200.0 => format!("{:.1} min", s / 60.0),
        s => format!("{:.1} h", s / 3600.0),
    }
}
