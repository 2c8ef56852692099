//! `anetrain bench`: timed training steps (forward, backward, AdamW) exactly
//! as `train` runs them, on a randomly initialised model.

use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use crate::data::records::Example;
use crate::device::backend::{self, Backend};
use crate::device::KernelRunner;
use crate::engine::{self, zero_grads, Engine, Grads};
use crate::model::config::ModelConfig;
use crate::model::lora::{Lora, LoraConfig};
use crate::model::source::ModelSource;
use crate::model::Model;
use crate::model::Projection;
use crate::plan::memory::RunPlan;
use crate::plan::work::step_flops;
use crate::train::optim::{AdamW, AdamWConfig};
use crate::train::step::{self, Batch, Loss, StepOptions};
use crate::util::choice::Choice;
use crate::util::rng::Rng;

/// Peak resident memory of this process in MiB (Linux), if known.
pub fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The best throughput (GFLOP/s) the matrix-multiply library reaches on
/// this model's three largest products at `tokens` columns: the FFN
/// projection, its weight gradient, and the LM head. Each is timed twice
/// after a warm-up call; the best time counts.
pub fn matmul_reference(c: &ModelConfig, tokens: usize) -> f64 {
    use linalg::{matmul, MatMut, MatRef};
    let (d, h, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let fill =
        |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919) % 997) as f32 * 1e-3).collect() };
    let x = fill(d * tokens);
    let mut best = 0f64;
    let mut time = |flops: f64, f: &mut dyn FnMut()| {
        f();
        for _ in 0..2 {
            let t = Instant::now();
            f();
            best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
        }
    };
    let w = fill(h * d);
    let mut y = vec![0f32; h * tokens];
    let flops = 2.0 * (h * d * tokens) as f64;
    time(flops, &mut || {
        matmul(
            MatRef::row_major(&w, 0, h, d),
            MatRef::row_major(&x, 0, d, tokens),
            MatMut::row_major(&mut y, 0, h, tokens),
            false,
        )
    });
    let mut dw = vec![0f32; h * d];
    time(flops, &mut || {
        matmul(
            MatRef::row_major(&y, 0, h, tokens),
            MatRef::row_major(&x, 0, d, tokens).t(),
            MatMut::row_major(&mut dw, 0, h, d),
            false,
        )
    });
    drop((w, dw));
    let head = fill(v * d);
    let mut lt = vec![0f32; v * tokens];
    time(2.0 * (v * d * tokens) as f64, &mut || {
        matmul(
            MatRef::row_major(&head, 0, v, d),
            MatRef::row_major(&x, 0, d, tokens),
            MatMut::row_major(&mut lt, 0, v, tokens),
            false,
        )
    });
    best
}

/// A training step's weight products alone, on the model's own weights and
/// gradient buffers, back to back with nothing in between: every
/// projection's forward (`W·x`), input-gradient (`Wᵀ·dy`) and
/// weight-gradient (`dy·xᵀ`) product in every layer and the LM head's three,
/// through the library and threads the step uses. Attention's products are
/// left out, so no step through this library can be faster on this machine.
/// Returns the best of two runs in seconds and the FLOPs of one (which
/// [`projection_flops`] counts). Overwrites the gradient buffers.
pub fn products_only(model: &Model, grads: &mut Grads, tokens: usize) -> (f64, f64) {
    use linalg::{matmul, MatMut, MatRef};
    let shape = |id: usize| (model.params[id].shape[0], model.params[id].shape[1]);
    let widest = model
        .layers
        .iter()
        .flat_map(|l| Projection::ALL.map(|t| shape(t.base(l))))
        .map(|(o, i)| o.max(i))
        .fold(model.cfg.hidden_size, usize::max);
    let fill = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i % 61) as f32 - 30.0) * 1e-3).collect() };
    let (x, dy) = (fill(widest * tokens), fill(widest * tokens));
    let mut out = vec![0f32; widest * tokens];
    let (v, d) = (model.cfg.vocab_size, model.cfg.hidden_size);
    let mut logits = vec![0f32; v * tokens];
    let head_id = model.lm_head_id();
    let head_values = model.lm_head();
    let mut flops = 0.0;
    let mut mm = |a: MatRef<'_>, b: MatRef<'_>, dst: &mut [f32], accumulate: bool| {
        flops += 2.0 * (a.rows * a.cols * b.cols) as f64;
        matmul(a, b, MatMut::row_major(dst, 0, a.rows, b.cols), accumulate);
    };
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        grads.reset();
        let t = Instant::now();
        for l in &model.layers {
            for target in Projection::ALL {
                let id = target.base(l);
                let (o, i) = shape(id);
                let w = MatRef::row_major(&model.params[id].data, 0, o, i);
                mm(w, MatRef::row_major(&x, 0, i, tokens), &mut out, false);
            }
        }
        let head = MatRef::row_major(&head_values, 0, v, d);
        mm(
            head,
            MatRef::row_major(&x, 0, d, tokens),
            &mut logits,
            false,
        );
        let dlogits = MatRef::row_major(&logits, 0, v, tokens);
        mm(head.t(), dlogits, &mut out, false);
        let (dhead, accumulate) = grads.product_target(head_id);
        mm(
            dlogits,
            MatRef::row_major(&x, 0, d, tokens).t(),
            dhead,
            accumulate,
        );
        for l in model.layers.iter().rev() {
            for target in Projection::ALL {
                let id = target.base(l);
                let (o, i) = shape(id);
                let w = MatRef::row_major(&model.params[id].data, 0, o, i);
                let g = MatRef::row_major(&dy, 0, o, tokens);
                mm(w.t(), g, &mut out, false);
                let (dw, accumulate) = grads.product_target(id);
                mm(g, MatRef::row_major(&x, 0, i, tokens).t(), dw, accumulate);
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best, flops / 2.0)
}

#[derive(Clone)]
pub struct BenchArgs {
    pub model: String,
    pub seq: usize,
    pub batch: usize,
    pub steps: usize,
    pub warmup: usize,
    pub backend: Backend,
    /// LoRA rank (every projection adapted, base frozen), if any.
    pub lora_rank: Option<usize>,
    /// Checkpointing and device buffers, as `train` takes them.
    pub memory: crate::plan::memory::MemoryOptions,
}

/// Jiffies the hypervisor gave to other guests ("steal") and all jiffies,
/// summed over CPUs, from `/proc/stat` (Linux); `None` elsewhere.
fn cpu_steal() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = s
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    Some((*fields.get(7)?, fields.iter().take(8).sum()))
}

/// The share of CPU time the host took between two `cpu_steal` readings.
fn steal_fraction(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (before?, after?);
    (t1 > t0).then(|| (s1 - s0) as f64 / (t1 - t0) as f64)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark and returns its JSON summary.
/// Runs the benchmark; `progress` receives one line per step and notes
/// about the measurement.
pub fn bench(a: &BenchArgs, progress: &mut dyn FnMut(String)) -> Result<serde_json::Value> {
    if a.steps == 0 || a.seq == 0 || a.batch == 0 {
        bail!("--steps, --seq and --batch must be at least 1");
    }
    let source = ModelSource::resolve(&a.model)?;
    let cfg = &source.config;
    if a.seq > cfg.max_position_embeddings {
        bail!(
            "--seq {} exceeds max_position_embeddings ({})",
            a.seq,
            cfg.max_position_embeddings
        );
    }
    let lora = a.lora_rank.map(LoraConfig::every_projection);
    // The memory plan of the same run, reported beside the measured peak.
    let plan = RunPlan::new(&source, a.seq, lora.as_ref(), a.backend, &a.memory, None)?
        .refuse_over_limit()?;
    // A frozen base stays mapped in the file's dtype, as in `train`.
    let mut model = source.load(cfg, lora.is_some(), 0)?;
    if let Some(lc) = lora {
        model.lora = Some(Lora::init(&model.cfg, lc, 0)?);
    }
    let engine = Engine::on(&model, a.backend.open()?)
        .buffers(plan.buffers)
        .checkpointing(a.memory.grad_checkpoint);
    run(a, model, &plan, engine, progress)
}

/// What the timed steps measured, per step (seconds).
#[derive(Default)]
struct Timings {
    steps: Vec<f64>,
    forward: Vec<f64>,
    /// The backward less its weight gradients.
    backward: Vec<f64>,
    weight_gradient: Vec<f64>,
    loss: Vec<f64>,
    optimizer: Vec<f64>,
    /// Dequantizing a quantized base (within the phases above).
    dequantize: Vec<f64>,
    /// The share of CPU time the host took over the timed steps.
    steal: Option<f64>,
}

fn run<R: KernelRunner>(
    a: &BenchArgs,
    mut model: Model,
    plan: &RunPlan,
    eng: Engine<R>,
    progress: &mut dyn FnMut(String),
) -> Result<serde_json::Value> {
    let mut grads = zero_grads(&model);
    let t = time_steps(a, &mut model, &mut grads, eng, progress)?;
    report(a, &model, plan, &mut grads, t)
}

/// `a.warmup` steps, then `a.steps` timed ones, each the trainer's own
/// step on random tokens, with one line of progress per step.
fn time_steps<R: KernelRunner>(
    a: &BenchArgs,
    model: &mut Model,
    grads: &mut Grads,
    mut eng: Engine<R>,
    progress: &mut dyn FnMut(String),
) -> Result<Timings> {
    let mut opt = AdamW::new(model, AdamWConfig::default());
    let mut rng = Rng::new(1);
    let v = model.cfg.vocab_size;
    let mut t = Timings::default();
    let mut timed_from = None;
    for i in 0..a.warmup + a.steps {
        let rows: Vec<Vec<u32>> = (0..a.batch)
            .map(|_| (0..=a.seq).map(|_| rng.below(v) as u32).collect())
            .collect();
        if i == a.warmup {
            timed_from = cpu_steal();
        }
        let (t0, steal0) = (Instant::now(), cpu_steal());
        let dq0 = crate::model::params::dequantizing_s();
        engine::take_weight_grad_secs();
        // The trainer's own step, with its defaults: clipping at 1, no
        // loss scale.
        let batch = Batch::Examples(
            rows.into_iter()
                .map(|tokens| Example { tokens, offset: 0 })
                .collect(),
        );
        let o = StepOptions {
            lr: 1e-4,
            clip: 1.0,
            loss_scale: 1.0,
            dropout: None,
        };
        let never = || false;
        let sft = &mut Loss::sft();
        let st = step::step(&mut eng, model, &mut opt, sft, grads, &batch, &o, &never)?
            .expect("never stopped");
        let w = engine::take_weight_grad_secs();
        let [tf, tl, tb] = st.batch.times;
        let to = st.optimizer_s;
        let total = t0.elapsed().as_secs_f64();
        let stolen = match steal_fraction(steal0, cpu_steal()) {
            Some(f) if f >= 0.02 => format!(
                " (the host took {:.0}% of this machine's CPU time)",
                f * 100.0
            ),
            _ => String::new(),
        };
        progress(format!(
            "step {}{}: {:.3} s{stolen}",
            i + 1,
            if i < a.warmup { " (warm-up)" } else { "" },
            total
        ));
        if i >= a.warmup {
            t.steps.push(total);
            t.forward.push(tf);
            t.backward.push(tb - w);
            t.weight_gradient.push(w);
            t.loss.push(tl);
            t.optimizer.push(to);
            t.dequantize
                .push(crate::model::params::dequantizing_s() - dq0);
        }
    }
    t.steal = steal_fraction(timed_from, cpu_steal());
    if let Some(f) = t.steal.filter(|&f| f >= 0.05) {
        progress(format!(
            "note: the host (hypervisor) took {:.0}% of this machine's CPU time during the timed \
             steps; times are inflated by it — compare runs made back to back",
            f * 100.0
        ));
    }
    Ok(t)
}

/// The benchmark's JSON summary: medians, FLOP rates against this
/// machine's matmul, the memory plan beside the peak, the device's work.
fn report(
    a: &BenchArgs,
    model: &Model,
    plan: &RunPlan,
    grads: &mut Grads,
    mut t: Timings,
) -> Result<serde_json::Value> {
    // Without weight gradients (LoRA) a step does two of the three matmul
    // passes; the rank-r adapter products are left out of the count.
    let full = step_flops(&model.cfg, a.seq, a.batch);
    let (flops, flop_count) = if model.lora.is_some() {
        (
            full * 2.0 / 3.0,
            "2 x forward matmul FLOPs (forward and input gradients; LoRA adapter products not counted)",
        )
    } else {
        (
            full,
            "3 x forward matmul FLOPs (all linear layers, LM head, full attention)",
        )
    };
    let med = median(&mut t.steps.clone());
    // Read before the reference products below allocate their own buffers.
    let peak_rss = peak_rss_mb();
    let matmul = matmul_reference(&model.cfg, a.seq * a.batch);
    // The products-only floor is this CPU library's; it says nothing of a
    // device engine, and LoRA steps run other products.
    let products = (a.backend == Backend::Cpu && model.lora.is_none())
        .then(|| products_only(model, grads, a.seq * a.batch).0);
    let min = t.steps.iter().copied().fold(f64::INFINITY, f64::min);
    // Where the arithmetic goes on the device path (none on the CPU).
    let work = match a.backend {
        Backend::Cpu => None,
        _ => Some(crate::plan::work::StepWork::plan(
            &model.cfg,
            a.seq,
            a.batch,
            &crate::kernels::KernelOptions::for_model(model),
            model.lora.is_none(),
            a.memory.grad_checkpoint,
        )?),
    };
    // The cost model's step of the same run, by pass beside the measured
    // phases: on the simulator it describes a chip, not this host.
    let predicted = match a.backend {
        Backend::Cpu => None,
        _ => {
            let setup = crate::plan::timeline::StepSetup::new(
                a.seq,
                a.batch,
                None,
                model.lora.as_ref().map(|l| l.cfg.clone()),
                a.memory.grad_checkpoint,
                plan.buffers,
            );
            let opts = crate::kernels::KernelOptions::for_model(model);
            let all = crate::plan::timeline::predict_families(&model.cfg, &setup, &opts)?;
            let family = backend::predicted_family(a.backend)?;
            let shown: serde_json::Map<String, serde_json::Value> =
                crate::plan::timeline::shown(all, family)
                    .into_iter()
                    .map(|p| Ok((p.family.clone(), serde_json::to_value(&p)?)))
                    .collect::<Result<_>>()?;
            Some(json!({
                "by_family": shown,
                "note": match a.backend {
                    Backend::Ane => "predicted for this chip's family; the measured phases are beside it",
                    _ => "predicted for a chip; the simulator's measured phases describe this host",
                },
            }))
        }
    };
    let gflop = |f: f64| f / 1e9;
    Ok(json!({
        "predicted": predicted,
        "model": a.model, "backend": a.backend.name(),
        "seq": a.seq, "batch": a.batch, "steps": a.steps, "threads": linalg::threads(),
        "median_step_s": med, "min_step_s": min,
        "tokens_per_s": (a.seq * a.batch) as f64 / med,
        "flop_per_step": flops, "gflops": flops / med / 1e9,
        "matmul_library": linalg::selected().describe(), "matmul_gflops": matmul,
        "fraction_of_matmul": flops / med / 1e9 / matmul,
        "flop_count": flop_count, "lora_rank": a.lora_rank,
        "trainable_params": model.trainable().iter().map(|p| p.data.len()).sum::<usize>(),
        "peak_rss_mb": peak_rss, "host_steal_fraction": t.steal,
        "memory_plan_mb": plan.plan.total as f64 / (1 << 20) as f64,
        "plan_over_peak_rss": peak_rss.map(|p| plan.plan.total as f64 / (1 << 20) as f64 / p),
        "grad_checkpoint": a.memory.grad_checkpoint,
        "device_gflop": work.as_ref().map(|w| gflop(w.device_flop)),
        "device_evaluations": work.as_ref().map(|w| w.device_evaluations),
        "host_gflop": work.as_ref().map(|w| gflop(w.host_flop)),
        "host_weight_gradient_gflop": work.as_ref().map(|w| gflop(w.host_weight_gradient_flop)),
        "device_buffers": (a.backend != Backend::Cpu).then_some(plan.buffers),
        "products_only_s": products, "step_over_products": products.map(|p| med / p),
        "phases_median_s": {
            "forward": median(&mut t.forward), "backward": median(&mut t.backward),
            "weight_gradient": median(&mut t.weight_gradient),
            "loss": median(&mut t.loss), "optimizer": median(&mut t.optimizer),
        },
        // A quantized base's dequantization, counted inside the phases
        // (wall time of the conversions, which run on the step's threads).
        "dequantize_median_s": model.cfg.quantization.as_ref().map(|_| median(&mut t.dequantize)),
        "dequantize_share": model.cfg.quantization.as_ref().map(|_| median(&mut t.dequantize) / med),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::work::projection_flops;

    #[test]
    fn products_only_runs_every_weight_product_once() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let model = Model::init(&cfg, 0).unwrap();
        let mut grads = zero_grads(&model);
        let (secs, flops) = products_only(&model, &mut grads, 24);
        assert!(secs > 0.0 && secs.is_finite());
        assert_eq!(flops, projection_flops(&cfg, 24));
    }

    #[test]
    fn bench_reports_the_step_and_its_products_floor() {
        let args = BenchArgs {
            model: "tiny".into(),
            seq: 32,
            batch: 1,
            steps: 2,
            warmup: 1,
            backend: Backend::Cpu,
            lora_rank: None,
            memory: Default::default(),
        };
        let r = bench(&args, &mut |_| {}).unwrap();
        // The plan is reported beside the measured peak (on Linux).
        assert!(r["memory_plan_mb"].as_f64().unwrap() > 0.0, "{r}");
        if cfg!(target_os = "linux") {
            assert!(r["plan_over_peak_rss"].as_f64().unwrap() > 0.0, "{r}");
        }
        let step = r["median_step_s"].as_f64().unwrap();
        let floor = r["products_only_s"].as_f64().unwrap();
        assert!(step > 0.0 && floor > 0.0, "{r}");
        assert_eq!(
            r["flop_per_step"].as_f64(),
            Some(step_flops(&ModelConfig::preset("tiny").unwrap(), 32, 1))
        );
        let lora = bench(
            &BenchArgs {
                lora_rank: Some(2),
                ..args.clone()
            },
            &mut |_| {},
        )
        .unwrap();
        assert!(lora["products_only_s"].is_null(), "{lora}");
        assert!(lora["device_gflop"].is_null(), "{lora}");
        // On the simulated device: the plan's work beside the time, the
        // LM head's products on the device, its softmax on the host's
        // critical path.
        let sim = bench(
            &BenchArgs {
                backend: Backend::AneSim,
                lora_rank: Some(2),
                ..args
            },
            &mut |_| {},
        )
        .unwrap();
        let cfg = ModelConfig::preset("tiny").unwrap();
        let softmax = crate::plan::work::HOST_FLOP_PER_LOGIT * (cfg.vocab_size * 32) as f64;
        let dxf = 2.0 * (cfg.hidden_size * 32) as f64;
        assert_eq!(
            sim["host_gflop"].as_f64(),
            Some((softmax + dxf) / 1e9),
            "{sim}"
        );
        let device = sim["device_gflop"].as_f64().unwrap();
        assert!(device > 0.0, "{sim}");
        let host = sim["host_gflop"].as_f64().unwrap();
        assert!(host <= 0.05 * device, "{sim}");
        assert_eq!(sim["host_weight_gradient_gflop"].as_f64(), Some(0.0));
        // The cost model's step beside the measured phases, by pass.
        let m4 = &sim["predicted"]["by_family"]["m4"];
        let passes = &m4["passes"];
        let sum: f64 = ["forward_ms", "loss_ms", "backward_ms", "optimizer_ms"]
            .iter()
            .map(|k| passes[k].as_f64().unwrap())
            .sum();
        let step = m4["step_ms"].as_f64().unwrap();
        assert!((sum - step).abs() <= 1e-9 * step, "{sim}");
        assert!(sim["phases_median_s"]["forward"].as_f64().is_some());
    }
}
