//! A training step on the Neural Engine path played through a cost model
//! ([`ane::cost::Rates`]): each evaluation in the order the runner issues
//! it, what the host does between them, and what overlaps.
//!
//!   evaluation = stage activations (+ weights when streamed) → dispatch →
//!                compute → read outputs, all on the calling thread
//!   overlap    = a layer's weight gradients queued on the worker as their
//!                upstream gradients appear, beside the rest of the layer's
//!                kernels; the layer waits for the queue at its end (the
//!                LM head's: beside each chunk's backward)
//!
//! The schedule is `Engine::forward`/`backward` and `head_loss` as they run
//! (see `engine`): per layer the attention and FFN kernels, the LM head's
//! chunks (statistics, then forward again and backward; a frozen head's
//! backward beside the statistics), the layers'
//! backward from the last, and AdamW. The seed's step (maderix/ANE
//! `training/training_dynamic/train.m`) is played too, as its programs and
//! host work are, to validate the model against its published times.

use serde::Serialize;

use ane::cost::Rates;

use crate::device::DeviceBuffers;
use crate::kernels::tiling::{KernelTiles, Plan};
use crate::kernels::KernelKind;
use crate::model::config::ModelConfig;
use crate::model::layer::{Mixer, Mlp, Norms};
use crate::model::lora::LoraConfig;
use crate::model::params::Projection;
use crate::plan::memory::PairStep;

/// What the step trains and how the device keeps its buffers.
#[derive(Clone, Debug)]
pub struct StepSetup {
    /// Tokens per row (the plan's compiled length may be longer).
    pub seq: usize,
    pub batch: usize,
    /// Adapters, or `None` when every weight trains.
    pub lora: Option<LoraConfig>,
    pub grad_checkpoint: bool,
    pub buffers: DeviceBuffers,
    /// Forward-only sequences a step runs besides its rows (DPO's
    /// reference: two a pair).
    pub reference_forwards: usize,
    /// Of a row's `seq` positions, how many hold the data's tokens on
    /// average (records shorter than `seq` leave the rest padding, which
    /// the device computes all the same); `seq` unless told.
    pub row_tokens: f64,
}

impl StepSetup {
    /// The step of `examples` examples (or pairs, with `pair` the
    /// preference step's extra work) at `seq`: a pair runs its two
    /// sequences, and DPO's reference forwards unless precomputed. `train`
    /// and `kernels plan` predict from this one setup.
    pub fn new(
        seq: usize,
        examples: usize,
        pair: Option<PairStep>,
        lora: Option<LoraConfig>,
        grad_checkpoint: bool,
        buffers: DeviceBuffers,
    ) -> StepSetup {
        let (rows, reference) = pair.map_or((1, 0), |p| (2, p.reference_forwards));
        StepSetup {
            seq,
            batch: examples * rows,
            reference_forwards: examples * reference,
            lora,
            grad_checkpoint,
            buffers,
            row_tokens: seq as f64,
        }
    }

    /// The step with rows holding `mean` tokens of data each on average
    /// (at most `seq`): its tokens per second count those, not padding.
    pub fn with_row_tokens(mut self, mean: f64) -> StepSetup {
        self.row_tokens = mean.min(self.seq as f64);
        self
    }
}

/// Where the seed's step differs from ours (maderix/ANE's dynamic
/// pipeline): the LM head on the host over a vocabulary compacted to the
/// tokens its data uses, weight gradients queued for the whole backward,
/// no optimizer in its `ms/step` (AdamW runs every `accum_steps`).
#[derive(Clone, Copy, Debug)]
pub struct SeedStep {
    /// The compacted vocabulary (maderix/ANE `training/README.md`: "32K–152K
    /// → 9.2K active tokens").
    pub vocab: usize,
    /// Count AdamW in the step (rustane's `ms/step` includes its update).
    pub optimizer: bool,
    /// Multi-head models run six fused kernels per layer, not ten
    /// (maderix/ANE README, "MHA models (Stories110M) — 6 kernels per
    /// layer": the o-projection inside `sdpaFwd` and, transposed, inside
    /// `sdpaBwd1`; the q/k/v input gradients inside `sdpaBwd2`).
    pub fused_mha: bool,
}

/// The seed's six-kernel multi-head schedule as groups of ours.
const SEED_MHA_FUSED: &[&[KernelKind]] = &[
    &[KernelKind::SdpaForward, KernelKind::WoForward],
    &[KernelKind::WoBackward, KernelKind::SdpaBackward1],
    &[
        KernelKind::SdpaBackward2,
        KernelKind::QBackward,
        KernelKind::KvBackward,
    ],
];

/// The predicted time of one optimizer step, by phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Predicted {
    pub family: String,
    pub step_ms: f64,
    /// Σ dispatch over the step's evaluations.
    pub dispatch_ms: f64,
    /// Σ the engine's compute.
    pub device_ms: f64,
    /// Copies into and out of surfaces (activations; weights when
    /// streamed, or re-staged after the update when persistent).
    pub staging_ms: f64,
    /// Host work on the critical path: norms and the loss between
    /// kernels, weight gradients the device did not hide, AdamW.
    pub host_ms: f64,
    /// The data's tokens a second (padding not counted).
    pub tokens_per_s: f64,
    /// Positions a second, padding included (`tokens_per_s` when the
    /// rows are full).
    pub positions_per_s: f64,
    /// Energy of a step at the family's published package power
    /// ([`Rates::joules`]), and per token of data.
    pub joules_per_step: f64,
    pub mj_per_token: f64,
    pub evaluations: usize,
    /// Compiling the plan's programs, once per run (not in `step_ms`).
    pub compile_ms: f64,
    /// The phase that takes the most time.
    pub dominant: &'static str,
    /// The same step by pass, as `bench` measures it.
    pub passes: Passes,
    /// Table constants no source measured on this family.
    pub unmeasured: Vec<&'static str>,
    /// The same step on another published curve of the family, where the
    /// sources disagree (the M1's two): its name and ms a step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other_curve: Option<(&'static str, f64)>,
}

impl Predicted {
    /// `m4: 412 ms/step (dispatch 27, device 290, staging 40, host 55 ms), 621 tok/s`.
    pub fn describe(&self) -> String {
        format!(
            "{}: {:.0} ms/step (dispatch {:.0}, device {:.0}, staging {:.0}, host {:.0} ms; {} dominates), {}{}",
            self.family,
            self.step_ms,
            self.dispatch_ms,
            self.device_ms,
            self.staging_ms,
            self.host_ms,
            self.dominant,
            self.throughput(),
            match self.unmeasured.is_empty() {
                true => String::new(),
                false => format!(" (unmeasured: {})", self.unmeasured.join(", ")),
            }
        ) + &match self.other_curve {
            Some((name, ms)) => format!("; {ms:.0} ms/step on {name}"),
            None => String::new(),
        }
    }
}

impl Predicted {
    /// `384 tok/s, 12.1 mJ/token`, or with padding in the rows `41 tok/s
    /// of data (384 positions/s with the padding), 113 mJ/token`.
    pub fn throughput(&self) -> String {
        let energy = match self.mj_per_token {
            e if e < 10.0 => format!("{e:.1} mJ/token"),
            e => format!("{e:.0} mJ/token"),
        };
        match self.positions_per_s > self.tokens_per_s * 1.005 {
            false => format!("{:.0} tok/s, {energy}", self.tokens_per_s),
            true => format!(
                "{:.0} tok/s of data ({:.0} positions/s with the padding), {energy}",
                self.tokens_per_s, self.positions_per_s
            ),
        }
    }

    /// The watt-hours of `steps` steps.
    pub fn watt_hours(&self, steps: u64) -> f64 {
        self.joules_per_step * steps as f64 / 3600.0
    }
}

/// A predicted step by pass: the layers' forward (without the recompute
/// `--grad-checkpoint` adds to the backward), the LM head and loss, the
/// layers' backward with the weight gradients the device does not hide,
/// and the optimizer (with re-staging of persistent weights).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Passes {
    pub forward_ms: f64,
    pub loss_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
}

/// The step's clock: phases summed along the critical path.
#[derive(Clone, Default)]
struct Clock {
    dispatch: f64,
    device: f64,
    staging: f64,
    host: f64,
    evaluations: usize,
}

impl Clock {
    fn total(&self) -> f64 {
        self.dispatch + self.device + self.staging + self.host
    }

    /// Adds `other` `n` times.
    fn add(&mut self, other: &Clock, n: f64) {
        self.dispatch += n * other.dispatch;
        self.device += n * other.device;
        self.staging += n * other.staging;
        self.host += n * other.host;
        self.evaluations += n as usize * other.evaluations;
    }
}

/// A layer's backward with its weight gradients on the worker (engine
/// `GradQueue`): a job starts when it is queued or when the worker is
/// done with the one before, whichever is later; the layer ends when
/// both its kernels and the worker are done.
#[derive(Default)]
struct Queued {
    main: Clock,
    worker_done: f64,
}

impl Queued {
    /// Queues `ms` of weight gradients now.
    fn job(&mut self, ms: f64) {
        let start = self.main.total().max(self.worker_done);
        self.worker_done = start + ms;
    }

    /// The layer's own thread does `c`.
    fn then(&mut self, c: &Clock) {
        self.main.add(c, 1.0);
    }

    /// The layer, waiting for the worker at its end.
    fn end(mut self) -> Clock {
        self.main.host += (self.worker_done - self.main.total()).max(0.0);
        self.main
    }
}

/// One step's schedule under a family's rates.
struct Player<'a> {
    rates: &'a Rates,
    plan: &'a Plan,
    streamed: bool,
    /// Kernels run as one program, each group in schedule order.
    fused: &'a [&'a [KernelKind]],
}

impl Player<'_> {
    /// Every tile of kernel `kind` once: stage, dispatch, compute, read;
    /// where the schedule fuses `kind` with the kernels after it, the
    /// fused program once (and nothing for the kernels it absorbed);
    /// nothing for a kernel the plan does not run ([`Plan::in_use`]).
    fn run(&self, kind: KernelKind) -> Clock {
        if !self.plan.in_use(kind) {
            return Clock::default();
        }
        let k = self.plan.of(kind);
        match self.fused.iter().find(|g| g.contains(&kind)) {
            None => self.run_tiles(k),
            Some(g) if g[0] != kind => Clock::default(),
            Some(g) => {
                // One untiled program doing the group's work.
                let ks: Vec<&KernelTiles> = g.iter().map(|&k| self.plan.of(k)).collect();
                let sum = |f: fn(&KernelTiles) -> f64| ks.iter().map(|k| f(k)).sum::<f64>();
                let one = KernelTiles {
                    flop: sum(|k| k.flop),
                    input: [1, (sum(|k| k.surface_bytes().0 as f64) / 2.0) as usize],
                    output: [1, (sum(|k| k.surface_bytes().1 as f64) / 2.0) as usize],
                    weight_bytes: sum(|k| k.weight_bytes as f64) as usize,
                    tiles: 1,
                    ..k.clone()
                };
                self.run_tiles(&one)
            }
        }
    }

    fn run_tiles(&self, k: &KernelTiles) -> Clock {
        let c = k.predicted(self.rates, self.streamed);
        Clock {
            dispatch: c.dispatch_ms,
            device: c.device_ms,
            staging: c.staging_ms,
            host: 0.0,
            evaluations: k.tiles,
        }
    }

    /// Kernels `kinds` one after the other beside `host_gemm` FLOPs of
    /// weight gradients on the worker: the longer of the two.
    fn beside(&self, kinds: &[KernelKind], host_gemm: f64) -> Clock {
        let mut c = Clock::default();
        for &k in kinds {
            c.add(&self.run(k), 1.0);
        }
        let worker = self.rates.host_gemm_ms(host_gemm);
        c.host += (worker - c.total()).max(0.0);
        c
    }

    /// Host elementwise passes over `values` f32 values.
    fn host_passes(&self, values: f64) -> Clock {
        Clock {
            host: self.rates.copy_ms(4.0 * values),
            ..Clock::default()
        }
    }
}

/// Weight-gradient FLOPs of projection `p` over `tokens` positions: the
/// whole weight's when full, the adapters' (dA and dB, rank r) with LoRA.
fn gradient_flop(
    cfg: &ModelConfig,
    p: Projection,
    tokens: usize,
    lora: Option<&LoraConfig>,
) -> f64 {
    let (out, inp) = p.dims(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let t = tokens as f64;
    match lora {
        None => 2.0 * (out * inp) as f64 * t,
        Some(l) if l.targets.contains(&p) => 2.0 * 2.0 * (l.rank * (out + inp)) as f64 * t,
        Some(_) => 0.0,
    }
}

/// Parameters AdamW updates.
fn trainable_params(cfg: &ModelConfig, lora: Option<&LoraConfig>) -> f64 {
    let (d, h, q, kv) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let per_layer: usize = Projection::ALL
        .iter()
        .map(|p| {
            let (o, i) = p.dims(d, h, q, kv);
            match lora {
                None => o * i,
                Some(l) if l.targets.contains(p) => l.rank * (o + i),
                Some(_) => 0,
            }
        })
        .sum();
    let embeddings = match (lora, cfg.tie_word_embeddings) {
        (Some(_), _) => 0,
        (None, true) => cfg.vocab_size * d,
        (None, false) => 2 * cfg.vocab_size * d,
    };
    let n = cfg.num_hidden_layers;
    let layers = lora.map_or(n, |l| n - l.first_layer(n));
    (per_layer * layers + embeddings) as f64
}

/// AdamW's passes per parameter: the gradient norm reads g; the update
/// reads p, g, m, v and writes p, m, v (`train::optim::AdamW::update`).
const ADAMW_PASSES: f64 = 8.0;

/// Predicts one optimizer step of `setup` with `plan`'s kernels on the
/// family of `rates` (our schedule), or the seed's with `seed`.
pub fn predict(
    cfg: &ModelConfig,
    plan: &Plan,
    setup: &StepSetup,
    rates: &Rates,
    seed: Option<SeedStep>,
) -> Predicted {
    use KernelKind::*;
    let p = Player {
        rates,
        plan,
        streamed: setup.buffers == DeviceBuffers::Streamed,
        fused: match seed {
            Some(sd) if sd.fused_mha && cfg.num_key_value_heads == cfg.num_attention_heads => {
                SEED_MHA_FUSED
            }
            _ => &[],
        },
    };
    let lora = setup.lora.as_ref();
    let (d, s) = (cfg.hidden_size as f64, plan.shape.seq as f64);
    let (h, qkv) = (
        cfg.intermediate_size as f64,
        (cfg.q_dim() + 2 * cfg.kv_dim()) as f64,
    );
    let tokens = plan.shape.seq;
    let grad = |ps: &[Projection]| -> f64 {
        ps.iter()
            .map(|&pr| gradient_flop(cfg, pr, tokens, lora))
            .sum()
    };

    // One layer's forward as its description composes it (engine
    // `layer_forward`): the norm, the mixer, the residual and the norm,
    // the MLP.
    let spec = cfg.layer();
    // A norm after each sublayer: one more pass over its output each way.
    let post = match spec.norms {
        Norms::Pre => 0.0,
        Norms::Sandwich | Norms::Post => 3.0 * d * s,
    };
    let mut forward = Clock::default();
    forward.add(&p.host_passes(2.0 * d * s), 1.0);
    match spec.mixer {
        Mixer::Attention { .. } => {
            forward.add(&p.run(SdpaForward), 1.0);
            forward.add(&p.run(WoForward), 1.0);
        }
    }
    forward.add(&p.host_passes(5.0 * d * s + post), 1.0);
    match spec.mlp {
        Mlp::SwiGlu | Mlp::GeGlu => forward.add(&p.run(FfnForward), 1.0),
    }
    forward.add(&p.host_passes(post), 1.0);

    // One layer's backward (engine `layer_backward`: the MLP's, its norm's,
    // the mixer's, its norm's): each group of weight gradients queued on
    // the worker when its upstream gradient exists, the kernels going on
    // beside the queue.
    let mut backward = Clock::default();
    if setup.grad_checkpoint {
        backward.add(&forward, 1.0);
    }
    // The seed queues every weight gradient on one serial queue for the
    // whole backward (counted after the layers).
    let job = |ps: &[Projection]| match seed {
        Some(_) => 0.0,
        None => rates.host_gemm_ms(grad(ps)),
    };
    let mut layer = Queued::default();
    match spec.mlp {
        Mlp::SwiGlu | Mlp::GeGlu => {
            layer.then(&p.host_passes(d * s + post));
            layer.job(job(&[Projection::Down]));
            layer.then(&p.run(FfnBackwardW2));
            layer.then(&p.host_passes(5.0 * h * s));
            layer.job(job(&[Projection::Gate, Projection::Up]));
            layer.then(&p.run(FfnBackwardW13));
        }
    }
    layer.then(&p.host_passes(6.0 * d * s + post));
    match spec.mixer {
        Mixer::Attention { .. } => {
            layer.job(job(&[Projection::O]));
            layer.then(&p.run(WoBackward));
            // The pair, or the fused program: the plan runs one of them.
            layer.then(&p.run(SdpaBackward1));
            layer.then(&p.run(SdpaBackward2));
            layer.then(&p.run(SdpaBackward));
            layer.then(&p.host_passes(4.0 * qkv * s));
            layer.job(job(&[Projection::Q, Projection::K, Projection::V]));
            layer.then(&p.run(QBackward));
            layer.then(&p.run(KvBackward));
        }
    }
    layer.then(&p.host_passes(6.0 * d * s));
    backward.add(&layer.end(), 1.0);

    let layers = cfg.num_hidden_layers as f64;
    let full = lora.is_none();
    // One row: the layers' forward, the head and loss, the layers' backward.
    let mut fwd = Clock::default();
    fwd.add(&forward, layers);
    let mut loss = Clock::default();
    match seed {
        None => loss.add(&head(&p, cfg, full), 1.0),
        Some(sd) => {
            // The classifier on the host (train.m): logits, the loss, the
            // input gradient; the embedding's gradient joins the queue.
            let v = sd.vocab as f64;
            loss.host += rates.host_gemm_ms(2.0 * v * d * s) * 2.0;
            loss.add(&p.host_passes(4.0 * v * s), 1.0);
        }
    }
    // LoRA on the last layers only: the backward stops below them.
    let adapted = lora.map_or(cfg.num_hidden_layers, |l| {
        cfg.num_hidden_layers - l.first_layer(cfg.num_hidden_layers)
    });
    let mut bwd = Clock::default();
    bwd.add(&backward, adapted as f64);
    if let Some(sd) = seed {
        // The queue of weight gradients runs beside the whole backward;
        // what it has left when the layers are done is waited for.
        let queue = rates.host_gemm_ms(projection_gradients(cfg, tokens))
            + rates.host_gemm_ms(2.0 * sd.vocab as f64 * d * s);
        bwd.host += (queue - bwd.total()).max(0.0);
    }
    // Once per optimizer step: AdamW, and with persistent buffers the new
    // weights staged again.
    let mut update = Clock::default();
    if seed.is_none_or(|sd| sd.optimizer) {
        update.add(
            &p.host_passes(ADAMW_PASSES * trainable_params(cfg, lora)),
            1.0,
        );
        if full && !p.streamed && seed.is_none() {
            let bytes: usize = plan
                .used()
                .map(|k| k.weight_bytes * k.tiles * plan.units(k.kind, cfg.num_hidden_layers))
                .sum();
            update.staging += rates.copy_ms(bytes as f64);
        }
    }
    // A reference forward: the layers' forward and the head's statistics.
    let mut reference = fwd.clone();
    let (chunks, rows) = (plan.head.chunks as f64, plan.head.rows as f64);
    reference.add(&p.run(KernelKind::HeadForward), chunks);
    reference.add(&p.host_passes(3.0 * rows * plan.shape.seq as f64), chunks);
    let batch = setup.batch as f64;
    let refs = setup.reference_forwards as f64;
    let mut out = Clock::default();
    for (c, n) in [
        (&fwd, batch),
        (&loss, batch),
        (&bwd, batch),
        (&reference, refs),
        (&update, 1.0),
    ] {
        out.add(c, n);
    }
    let passes = Passes {
        forward_ms: batch * fwd.total() + refs * reference.total(),
        loss_ms: batch * loss.total(),
        backward_ms: batch * bwd.total(),
        optimizer_ms: update.total(),
    };
    let step_ms = out.total();
    let joules = rates.joules(out.device + out.dispatch, out.staging + out.host);
    let phases = [
        ("dispatch", out.dispatch),
        ("device", out.device),
        ("staging", out.staging),
        ("host", out.host),
    ];
    let dominant = phases
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or("device", |x| x.0);
    // The seed's LM head runs on the host: no head programs.
    let head_programs = match seed {
        Some(_) => plan.used().filter(|k| k.kind.is_head()).count(),
        None => 0,
    };
    let programs = plan.programs_for(&cfg.layer_classes()) - head_programs;
    Predicted {
        family: rates.family.name().to_string(),
        step_ms,
        dispatch_ms: out.dispatch,
        device_ms: out.device,
        staging_ms: out.staging,
        host_ms: out.host,
        tokens_per_s: setup.row_tokens * setup.batch as f64 / step_ms * 1e3,
        positions_per_s: (setup.seq * setup.batch) as f64 / step_ms * 1e3,
        joules_per_step: joules,
        mj_per_token: joules * 1e3 / (setup.row_tokens * setup.batch as f64),
        evaluations: out.evaluations,
        compile_ms: programs as f64 * rates.compile_ms,
        dominant,
        passes,
        // The scratch share matters only to a plan that keeps scratch.
        unmeasured: rates
            .unmeasured
            .iter()
            .copied()
            .filter(|&u| u != ane::cost::SCRATCH_SHARE || plan.used().any(|k| k.scratch_bytes > 0))
            .collect(),
        other_curve: None,
    }
}

/// Every projection's weight gradient over `tokens` positions (FLOPs).
fn projection_gradients(cfg: &ModelConfig, tokens: usize) -> f64 {
    Projection::ALL
        .iter()
        .map(|&p| gradient_flop(cfg, p, tokens, None))
        .sum::<f64>()
        * cfg.num_hidden_layers as f64
}

/// The LM head and loss of one row (engine `head_loss`): over several
/// chunks, each chunk's forward and the softmax statistics, then — when
/// the head trains — each chunk's forward again, its logits' gradient
/// and backward beside the head's weight gradient; a frozen head's
/// backward follows each chunk's statistics; one chunk runs forward once.
fn head(p: &Player, cfg: &ModelConfig, full: bool) -> Clock {
    let plan = p.plan;
    let (rows, chunks) = (plan.head.rows as f64, plan.head.chunks as f64);
    let (d, s) = (cfg.hidden_size as f64, plan.shape.seq as f64);
    let mut c = Clock::default();
    let forward = p.run(KernelKind::HeadForward);
    // Statistics: the running maximum and Σ exp over each chunk's logits.
    c.add(&forward, chunks);
    c.add(&p.host_passes(3.0 * rows * s), chunks);
    // A head that trains computes each chunk again for its normalised
    // gradient; a frozen one sends the statistics pass's exp(z − m) on.
    let again = full && chunks > 1.0;
    if again {
        c.add(&forward, chunks);
    }
    // The gradient softmax − one-hot, scaled; dE = dz·xfᵀ beside the backward.
    let gathered = !full && chunks > 1.0;
    let passes = if gathered { 1.0 } else { 3.0 };
    c.add(&p.host_passes(passes * rows * s), chunks);
    let dw = if full { 2.0 * rows * d * s } else { 0.0 };
    c.add(&p.beside(&[KernelKind::HeadBackward], dw), chunks);
    c.add(&p.host_passes(2.0 * d * s), chunks);
    c
}

/// Our step of `setup` with `opts`' kernels planned for each family (its
/// limits, its rates), for every family.
pub fn predict_families(
    cfg: &ModelConfig,
    setup: &StepSetup,
    opts: &crate::kernels::KernelOptions,
) -> anyhow::Result<Vec<Predicted>> {
    let shape = crate::kernels::Shape::new(cfg, crate::kernels::compiled_length(setup.seq));
    let profile = ane::family::Profile::in_force()?;
    let mut out = vec![];
    for family in ane::family::Family::ALL {
        // Each family's limits, and its rates choosing among tilings.
        let mut o = opts.clone();
        o.limits = family.limits();
        o.cost_family = family;
        let plan = crate::kernels::tiling::plan(&shape, &o)?;
        let rates = rates_for(family, &profile);
        let mut p = predict(cfg, &plan, setup, &rates, None);
        // Where the family's published curves disagree, the other one too
        // (unless this chip's own measurements replaced the table's).
        if let (Some((name, other)), true) = (
            Rates::other_published(family),
            profile.timing.is_none() || profile.family != Some(family),
        ) {
            let r = Rates {
                fitted: rates.fitted,
                scratch_share: rates.scratch_share,
                ..other
            };
            p.other_curve = Some((name, predict(cfg, &plan, setup, &r, None).step_ms));
        }
        out.push(p);
    }
    Ok(out)
}

/// `family`'s rates: the table's, with what `doctor` measured on this
/// chip in their place when the profile in force carries timing for it.
pub fn rates_for(family: ane::family::Family, profile: &ane::family::Profile) -> Rates {
    let table = Rates::of(family);
    match (&profile.timing, profile.family) {
        (Some(m), Some(f)) if f == family => table.with_measured(m),
        _ => table,
    }
}

/// The predictions a report shows: `family`'s, or when none is known the
/// measured families' (M1, M4, M5).
pub fn shown(all: Vec<Predicted>, family: Option<ane::family::Family>) -> Vec<Predicted> {
    all.into_iter()
        .filter(|p| match family {
            Some(f) => p.family == f.name(),
            None => ["m1", "m4", "m5"].contains(&p.family.as_str()),
        })
        .collect()
}

/// `0.8 Wh`, `35 Wh`, `12 mWh`: energy as a person reads it.
pub fn watt_hours(wh: f64) -> String {
    match wh {
        w if w < 0.1 => format!("{:.0} mWh", w * 1e3),
        w if w < 10.0 => format!("{w:.2} Wh"),
        w => format!("{w:.0} Wh"),
    }
}

/// The line `train` prints before its first step on a device backend:
/// the predicted step on `family` (every measured family when none is
/// known) and the whole run of `steps` optimizer steps.
pub fn run_estimate(
    cfg: &ModelConfig,
    setup: &StepSetup,
    opts: &crate::kernels::KernelOptions,
    family: Option<ane::family::Family>,
    steps: u64,
) -> anyhow::Result<String> {
    let shown = shown(predict_families(cfg, setup, opts)?, family);
    let run = |p: &Predicted| {
        let s = p.step_ms * steps as f64 / 1e3;
        if s < 10.0 {
            format!("{s:.1} s")
        } else if s < 120.0 {
            format!("{s:.0} s")
        } else {
            format!("{:.1} min", s / 60.0)
        }
    };
    let each: Vec<String> = shown
        .iter()
        .map(|p| {
            format!(
                "{} {:.2} s/step ({} dominates, {}), {} steps ≈ {} and {}",
                p.family,
                p.step_ms / 1e3,
                p.dominant,
                p.throughput(),
                steps,
                run(p),
                watt_hours(p.watt_hours(steps))
            )
        })
        .collect();
    Ok(format!(
        "predicted on the Neural Engine{}: {} (a cost model of published measurements and power readings, not of this machine: docs/benchmarks.md)",
        if family.is_none() { " (no chip family known)" } else { "" },
        each.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `doctor` measured on an M4 chooses the M4's plans too: a
    /// scratch probe that ran as fast as its surfaces alone predict (no
    /// intermediate slowing it) gives a share of 0, and the plan for
    /// Qwen3-0.6B at 4096 tokens, chosen and played with it, is faster
    /// than the table's; other families keep the table.
    #[test]
    fn a_measured_scratch_share_chooses_and_costs_the_plan() {
        use crate::kernels::{tiling, KernelOptions, Shape};
        use ane::family::Family;
        let table = Rates::of(Family::M4);
        let (flop, surfaces, scratch) = (8.6e9, 3.1e6, 6.7e7);
        let measured = ane::family::Measured {
            dispatch_ms: table.dispatch_ms,
            matmuls: vec![],
            write_gbs: table.copy_gbs,
            compile_ms: table.compile_ms,
            scratch: Some(ane::family::ScratchTiming {
                flop,
                surface_bytes: surfaces,
                scratch_bytes: scratch,
                ms: table.dispatch_ms + table.evaluation(flop, surfaces).device_ms,
            }),
        };
        let cfg = ModelConfig::preset("qwen3-0.6b").unwrap();
        let step = |measured: Option<ane::family::Measured>, family: Family| {
            let mut o = KernelOptions::hf(&cfg);
            (o.cost_family, o.limits) = (family, family.limits());
            o.cost_measured = measured.map(|m| (Family::M4, m));
            let rates = o.cost_rates();
            let plan = tiling::plan(&Shape::new(&cfg, 4096), &o).unwrap();
            let setup = StepSetup::new(4096, 1, None, None, true, DeviceBuffers::Persistent);
            (
                rates.scratch_share,
                predict(&cfg, &plan, &setup, &rates, None).step_ms,
            )
        };
        let (share, with_table) = step(None, Family::M4);
        let (measured_share, with_measured) = step(Some(measured.clone()), Family::M4);
        assert_eq!((share, measured_share), (1.0, 0.0));
        assert!(
            with_measured < 0.95 * with_table,
            "{with_measured} vs {with_table}"
        );
        assert_eq!(step(Some(measured), Family::M5), step(None, Family::M5));
    }

    /// A step's energy is the engine's package power over its device
    /// time and the CPU's over the host's, as published per family; per
    /// token it counts the data's tokens.
    #[test]
    fn a_steps_energy_is_its_phases_at_the_published_power() {
        use crate::kernels::{tiling, KernelOptions, Shape};
        use ane::family::Family;
        let cfg = ModelConfig::preset("qwen3-0.6b").unwrap();
        let lora = Some(LoraConfig::every_projection(16));
        let mut o = KernelOptions::hf(&cfg).with_lora(lora.as_ref());
        (o.cost_family, o.limits) = (Family::M4, Family::M4.limits());
        let plan = tiling::plan(&Shape::new(&cfg, 256), &o).unwrap();
        let rates = Rates::of(Family::M4);
        let setup = StepSetup::new(256, 1, None, lora, false, DeviceBuffers::Streamed);
        let p = predict(&cfg, &plan, &setup, &rates, None);
        let j = (rates.ane_package_w * (p.device_ms + p.dispatch_ms)
            + rates.cpu_package_w * (p.staging_ms + p.host_ms))
            / 1e3;
        assert!((p.joules_per_step - j).abs() < 1e-12, "{p:?}");
        assert!((p.mj_per_token - j * 1e3 / 256.0).abs() < 1e-9);
        // Rows a quarter full: the same joules over a quarter of the tokens.
        let quarter = predict(
            &cfg,
            &plan,
            &setup.clone().with_row_tokens(64.0),
            &rates,
            None,
        );
        assert!((quarter.mj_per_token - 4.0 * p.mj_per_token).abs() < 1e-9);
    }

    /// A queued job starts when it is queued or when the worker is free,
    /// and the layer waits for the last: jobs of 5 and 20 ms queued
    /// before kernels of 10 and 5 ms end at 30 ms (10 + 20), not 35
    /// (each kernel beside its own job: max(10, 5) + max(5, 20)).
    #[test]
    fn queued_weight_gradients_overlap_every_later_kernel() {
        let kernel = |ms| Clock {
            device: ms,
            ..Clock::default()
        };
        let mut q = Queued::default();
        q.job(5.0);
        q.then(&kernel(10.0));
        q.job(20.0);
        q.then(&kernel(5.0));
        let c = q.end();
        assert_eq!((c.device, c.host, c.total()), (15.0, 15.0, 30.0));
        // A worker with nothing left adds nothing.
        let mut q = Queued::default();
        q.job(5.0);
        q.then(&kernel(10.0));
        assert_eq!(q.end().total(), 10.0);
    }

    /// The timeline plays the evaluations the work count has, full and
    /// LoRA (whose frozen head runs each chunk's forward once), with
    /// and without checkpointing: the schedule and the count agree.
    #[test]
    fn the_timeline_plays_every_counted_evaluation() {
        use crate::kernels::{tiling, KernelOptions, Shape};
        let cfg = ModelConfig::preset("qwen3-0.6b").unwrap();
        let seq = 1024;
        let last_8 = LoraConfig {
            layers: Some(8),
            ..LoraConfig::every_projection(16)
        };
        for lora in [None, Some(LoraConfig::every_projection(16)), Some(last_8)] {
            for grad_checkpoint in [false, true] {
                let mut o = KernelOptions::hf(&cfg).with_lora(lora.as_ref());
                o.cost_family = ane::family::Family::M4;
                o.limits = ane::family::Family::M4.limits();
                let plan = tiling::plan(&Shape::new(&cfg, seq), &o).unwrap();
                assert!(plan.head.chunks > 1);
                let setup = StepSetup::new(
                    seq,
                    1,
                    None,
                    lora.clone(),
                    grad_checkpoint,
                    DeviceBuffers::Persistent,
                );
                let p = predict(&cfg, &plan, &setup, &Rates::of(o.cost_family), None);
                let full = lora.is_none();
                let work =
                    crate::plan::work::StepWork::plan(&cfg, seq, 1, &o, full, grad_checkpoint)
                        .unwrap();
                assert_eq!(
                    p.evaluations, work.device_evaluations,
                    "full {full}, checkpointing {grad_checkpoint}"
                );
                // The last 8 of 28 layers adapted: their backward alone.
                if lora.as_ref().is_some_and(|l| l.layers.is_some()) {
                    let all = LoraConfig::every_projection(16);
                    let every = predict(
                        &cfg,
                        &plan,
                        &StepSetup {
                            lora: Some(all.clone()),
                            ..setup.clone()
                        },
                        &Rates::of(o.cost_family),
                        None,
                    );
                    let r = p.passes.backward_ms / every.passes.backward_ms;
                    assert!((r - 8.0 / 28.0).abs() < 1e-9, "{r}");
                    assert_eq!(p.passes.forward_ms, every.passes.forward_ms);
                }
            }
        }
    }
}
