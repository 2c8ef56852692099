//! The memory plan of a training run: what a step holds at its peak, by
//! part, computed from the model's configuration and the run's settings
//! before anything is loaded, so a run that cannot fit is refused with a
//! line saying what would, instead of being killed half-way (or swapping).
//!
//! The parts follow where the bytes are in the code:
//! * base weights — f32 (full training keeps master weights), or for a
//!   frozen base the file's matrices memory-mapped in their own dtype
//!   (`Param::stored`; the page cache holds them and counts in RSS);
//! * trainable state — what training updates, its gradients and AdamW's
//!   two moments (f32 each);
//! * device buffers — every kernel tile's fp16 input surface, once per
//!   layer (persistent) or twice (streamed), plus one output per kernel;
//! * activations — what the forward keeps for the backward (everything, or
//!   with `--grad-checkpoint` each layer's input plus one recomputed layer);
//! * transients — held during part of a step, counted together: a layer's backward temporaries and the
//!   attention scores, the LM head's logits chunk, frozen weights converted
//!   for a kernel (and the next layer's prepared while the device runs),
//!   the simulator's f32 copy of an evaluation. (A checkpoint is written
//!   as it is encoded, `tensor_file::write_to`: it adds nothing.)

use serde::Serialize;

use crate::device::backend::Backend;
use crate::util::choice::Choice;

use crate::device::DeviceBuffers;
use crate::device::HEAD_CHUNK_ROWS;
use crate::kernels::{tiling, KernelKind, KernelOptions, Shape};
use crate::model::config::ModelConfig;
use crate::model::lora::LoraConfig;
use crate::model::quant::{QuantSpec, Quantization};
use crate::model::source::ModelSource;
use crate::model::StoredDtype;

/// How the run holds the base weights.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum BaseWeights {
    /// Decoded to f32 (full training, presets).
    F32,
    /// Memory-mapped in the file's dtype (a frozen LoRA base).
    Mapped(#[serde(serialize_with = "dtype_name")] StoredDtype),
}

fn dtype_name<S: serde::Serializer>(d: &StoredDtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// What a plan is computed for.
#[derive(Clone, Debug)]
pub struct PlanRequest<'a> {
    pub cfg: &'a ModelConfig,
    pub seq: usize,
    pub lora: Option<&'a LoraConfig>,
    pub base: BaseWeights,
    /// `None`: the CPU engine; else how the device keeps its buffers.
    pub device: Option<DeviceBuffers>,
    /// The device is the simulator (its evaluation copies an input to f32).
    pub simulated: bool,
    /// Bytes of the model's `tokenizer.json` (0: none).
    pub tokenizer_file: u64,
    pub grad_checkpoint: bool,
    /// Kernel options (limits, LoRA) the device kernels are built with.
    pub opts: Option<&'a KernelOptions>,
    /// A preference run's step (`--objective dpo|orpo`).
    pub preference: Option<PairStep>,
}

/// What a preference step runs and holds beyond an SFT step of its two
/// sequences a pair (see `train::objective`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PairStep {
    /// Forward-only reference passes a pair (DPO: 2; precomputed or ORPO: 0).
    pub reference_forwards: usize,
    /// The reference model is held (DPO, until precomputed): the initial
    /// adapters with LoRA, else a copy of the model in f32.
    pub reference_held: bool,
}

/// One part of the plan.
#[derive(Clone, Debug, Serialize)]
pub struct Part {
    pub name: &'static str,
    pub bytes: u64,
    pub detail: String,
}

/// A run's peak memory estimate by part.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryPlan {
    /// Held for the whole run.
    pub resident: Vec<Part>,
    /// Held during part of a step; the peak adds the largest.
    pub transient: Vec<Part>,
    pub device_buffers: Option<DeviceBuffers>,
    pub total: u64,
}

/// The process before any model: code, the corpus index, allocator slack;
/// measured on `anetrain train --model tiny`: 45 MB.
const PROCESS_BYTES: u64 = 50 << 20;

/// A loaded tokenizer per byte of its `tokenizer.json`: Qwen3's 11.4 MB
/// file costs about 150 MB once loaded (vocabulary, merges, the
/// pre-tokenizer's tables).
const TOKENIZER_PER_FILE_BYTE: u64 = 13;

/// Bytes for people: GB to two places, MB below a GB, kB below a MB.
pub fn size(b: u64) -> String {
    match b {
        0..1_000 => format!("{b} bytes"),
        1_000..1_000_000 => format!("{:.0} kB", b as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.0} MB", b as f64 / 1e6),
        _ => format!("{:.2} GB", b as f64 / 1e9),
    }
}

/// Trainable LoRA parameters: `r·(in + out)` per adapted projection, a
/// fused module's parts sharing one A (Phi-3's `qkv_proj`).
pub fn lora_params(cfg: &ModelConfig, l: &LoraConfig) -> u64 {
    let per_layer: usize = l
        .targets
        .iter()
        .map(|&t| {
            let (out, inp) = t.shape(cfg);
            let shares_a = cfg.fused_of(t).is_some_and(|f| f.parts[0] != t);
            l.rank * (out + if shares_a { 0 } else { inp })
        })
        .sum();
    let n = cfg.num_hidden_layers;
    (per_layer * (n - l.first_layer(n))) as u64
}

/// Bytes one layer's forward keeps for its backward, per position
/// (`LayerActs` in the engine, as the layer's description counts them):
/// the host's values in f32, the kernels' outputs in f16 when a device
/// made them (`Kept`).
fn layer_act_bytes(cfg: &ModelConfig, device: bool) -> u64 {
    let (host, kernels) = cfg.layer().kept_per_position(&cfg.layer_dims());
    host as u64 * 4 + kernels as u64 * if device { 2 } else { 4 }
}

impl MemoryPlan {
    /// The plan of `r`: what stays for the whole run, what one layer's
    /// backward and the head add at their peak, and on a device its
    /// buffers and staging.
    pub fn new(r: &PlanRequest) -> Result<MemoryPlan, tiling::PlanError> {
        // The device's plan, when the kernels run on one.
        let plan = match (r.device, r.opts) {
            (Some(_), Some(opts)) => {
                let compiled = crate::kernels::compiled_length(r.seq);
                Some(tiling::plan(&Shape::new(r.cfg, compiled), opts)?)
            }
            _ => None,
        };
        let mut resident = resident_parts(r);
        let mut transient = transient_parts(r, plan.as_ref());
        match (r.device, &plan) {
            (Some(mode), Some(plan)) => {
                let (buffers, staging) = device_parts(r, mode, plan);
                resident.push(buffers);
                transient.push(staging);
            }
            _ => {
                // The CPU engine: frozen matrices converted for the kernel
                // using them (the FFN's three at most).
                if let BaseWeights::Mapped(_) = r.base {
                    let ffn = 3 * (r.cfg.intermediate_size * r.cfg.hidden_size) as u64 * 4;
                    transient.push(Part {
                        name: "weight conversion",
                        bytes: ffn,
                        detail: "one kernel's frozen projections in f32".into(),
                    });
                }
            }
        }
        let peak_transient = transient.iter().map(|p| p.bytes).sum::<u64>();
        let total = resident.iter().map(|p| p.bytes).sum::<u64>() + peak_transient;
        Ok(MemoryPlan {
            resident,
            transient,
            device_buffers: r.device,
            total,
        })
    }

    fn empty() -> MemoryPlan {
        MemoryPlan {
            resident: Vec::new(),
            transient: Vec::new(),
            device_buffers: None,
            total: 0,
        }
    }

    /// The plan in one line: the total and its largest parts.
    pub fn line(&self) -> String {
        let mut parts: Vec<&Part> = self.resident.iter().chain(&self.transient).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        let top: Vec<String> = parts
            .iter()
            .take(3)
            .map(|p| format!("{} {}", p.name, size(p.bytes)))
            .collect();
        format!(
            "memory plan: {} at peak ({})",
            size(self.total),
            top.join(", ")
        )
    }

    /// The plan as a table, one part per line.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for (title, parts) in [
            ("held for the run", &self.resident),
            ("during a step", &self.transient),
        ] {
            out.push_str(&format!("{title}:\n"));
            for p in parts {
                out.push_str(&format!(
                    "  {:<18} {:>10}  {}\n",
                    p.name,
                    size(p.bytes),
                    p.detail
                ));
            }
        }
        out.push_str(&format!(
            "peak estimate: {} (what is held, and a step's parts together)\n",
            size(self.total)
        ));
        out
    }
}

/// What stays for the whole run: the process, the base weights, the
/// trainable state and the activations kept for the backward.
fn resident_parts(r: &PlanRequest) -> Vec<Part> {
    let cfg = r.cfg;
    let (d, s, layers) = (
        cfg.hidden_size as u64,
        r.seq as u64,
        cfg.num_hidden_layers as u64,
    );
    let params = cfg.num_params() as u64;
    // The norms' weights: each layer's (its description's vectors) and the final one's.
    let layer_norms: u64 = cfg
        .layer()
        .params(&cfg.layer_dims())
        .iter()
        .filter(|p| p.shape.len() == 1)
        .map(|p| p.shape[0] as u64)
        .sum();
    let norms = (layers * layer_norms + d) * 4;
    let mut resident = vec![Part {
        name: "process",
        bytes: PROCESS_BYTES + TOKENIZER_PER_FILE_BYTE * r.tokenizer_file,
        detail: match r.tokenizer_file {
            0 => "code, data index".into(),
            _ => format!(
                "code, data index, the tokenizer {}",
                size(TOKENIZER_PER_FILE_BYTE * r.tokenizer_file)
            ),
        },
    }];
    resident.push(match r.base {
        BaseWeights::F32 => Part {
            name: "base weights",
            bytes: params * 4,
            detail: format!("{params} parameters in f32"),
        },
        BaseWeights::Mapped(dt) => match &cfg.quantization {
            Some(q) => Part {
                name: "base weights",
                bytes: quantized_matrix_bytes(q, cfg, dt) + norms,
                detail: format!(
                    "{params} parameters, {}-bit MLX quantized (groups of {}, {} scales), memory-mapped from the file",
                    q.default.bits,
                    q.default.group_size,
                    dt.name()
                ),
            },
            None => Part {
                name: "base weights",
                bytes: (params * 4 - norms) / 4 * dt.bytes() as u64 + norms,
                detail: format!(
                    "{params} parameters, {} memory-mapped from the file",
                    dt.name()
                ),
            },
        },
    });
    let trainable = match r.lora {
        Some(l) => lora_params(cfg, l),
        None => params,
    };
    resident.push(match r.lora {
        Some(l) => Part {
            name: "trainable state",
            bytes: trainable * 16,
            detail: format!(
                "LoRA rank {} on {} projections: {trainable} parameters, gradients, AdamW moments",
                l.rank,
                l.targets.len()
            ),
        },
        None => Part {
            name: "trainable state",
            bytes: trainable * 12,
            detail: "gradients and AdamW moments of every parameter".into(),
        },
    });
    if let Some(pair) = r.preference {
        // The rejected answer's gradient, kept until the chosen one's
        // forward gives its weight; and the reference.
        let reference = if pair.reference_held {
            trainable * 4
        } else {
            0
        };
        resident.push(Part {
            name: "preference",
            bytes: trainable * 4 + reference,
            detail: match (pair.reference_held, r.lora) {
                (false, _) => "a second gradient buffer".into(),
                (true, Some(_)) => {
                    "a second gradient buffer, the reference's initial adapters".into()
                }
                (true, None) => {
                    "a second gradient buffer, the reference model's copy in f32".into()
                }
            },
        });
    }
    let act = layer_act_bytes(cfg, r.device.is_some()) * s;
    resident.push(match r.grad_checkpoint {
        true => Part {
            name: "activations",
            bytes: layers * d * s * 4 + act,
            detail: format!(
                "each layer's input ({}), one layer recomputed ({})",
                size(layers * d * s * 4),
                size(act)
            ),
        },
        false => Part {
            name: "activations",
            bytes: layers * act,
            detail: format!("{layers} layers × {}", size(act)),
        },
    });
    resident
}

/// What one layer's backward and the LM head hold at their peak.
fn transient_parts(r: &PlanRequest, plan: Option<&tiling::Plan>) -> Vec<Part> {
    let cfg = r.cfg;
    let (d, v, s) = (cfg.hidden_size as u64, cfg.vocab_size as u64, r.seq as u64);
    // A layer's backward: upstream gradients of every width (one of each
    // alive at once, as when the weight-gradient queue still holds the
    // FFN's while the attention's exist: `engine::GradQueue`), and the
    // attention probabilities and their gradient [heads·S, S] in f32: whole
    // on the CPU; on a device whose two attention-backward kernels share
    // their tiles, one tile's block at a time, handed from one kernel's
    // output to the other's input (`KernelRunner::attention_backward`);
    // none where the fused kernel keeps them on the device.
    let tiled_scores = plan.and_then(|p| {
        let (b1, b2) = (
            p.of(KernelKind::SdpaBackward1),
            p.of(KernelKind::SdpaBackward2),
        );
        match p.attention_backward {
            tiling::AttentionBackward::Fused => Some(0),
            tiling::AttentionBackward::Pair => (b1.splits == b2.splits)
                .then(|| (b1.shape.score_channels() * b1.shape.seq * 4) as u64),
        }
    });
    let scores = tiled_scores.unwrap_or(2 * cfg.num_attention_heads as u64 * s * s * 4);
    let backward = scores + layer_act_bytes(cfg, false) * s;
    // The head: a logits chunk (the device's chunks or the CPU
    // engine's), its head rows converted, xf scaled, dxf and a chunk's
    // part of it.
    let chunk = plan
        .map_or(HEAD_CHUNK_ROWS as u64, |p| p.head.rows as u64)
        .min(v);
    let head_rows = match r.base {
        BaseWeights::Mapped(_) => chunk * d * 4,
        BaseWeights::F32 => 0,
    };
    vec![
        Part {
            name: "layer backward",
            bytes: backward,
            detail: match scores {
                0 => "upstream gradients (the attention scores stay on the device)".into(),
                _ => format!("attention scores {} and upstream gradients", size(scores)),
            },
        },
        Part {
            name: "LM head",
            bytes: chunk * s * 4 + head_rows + 3 * d * s * 4,
            detail: format!("logits in chunks of {chunk} rows"),
        },
    ]
}

/// On a device: its buffers in `mode` (resident) and the staging of a
/// tile (transient).
fn device_parts(r: &PlanRequest, mode: DeviceBuffers, plan: &tiling::Plan) -> (Part, Part) {
    let layers = r.cfg.num_hidden_layers;
    let (mut device_bytes, mut host_bytes) = (0u64, 0u64);
    // Every program's buffers (a kernel in causal key classes has several).
    for k in plan.used().flat_map(|k| k.programs()) {
        let (n, host) = mode.buffers_of(&k, plan.units(k.kind, layers));
        device_bytes += (n * k.surface_bytes().0 + k.surface_bytes().1) as u64;
        host_bytes += (host * k.surface_bytes().0) as u64;
    }
    let largest = plan
        .used()
        .map(|k| k.surface_bytes().0 as u64)
        .max()
        .unwrap_or(0);
    let buffers = Part {
        name: "device buffers",
        bytes: device_bytes + host_bytes,
        detail: match mode {
            DeviceBuffers::Persistent => format!(
                "persistent: every layer's kernel tiles and the head's chunks, {}",
                size(device_bytes)
            ),
            DeviceBuffers::Streamed => format!(
                "streamed: one tile per kernel {} and its next tile prepared on the host {}",
                size(device_bytes),
                size(host_bytes)
            ),
        },
    };
    // Staging a tile: a projection's block and its region in f32 (each
    // at most the tile's input in f32); on the simulator an evaluation's
    // f32 input and the slices its program takes.
    let staging = 2 * largest;
    let sim = if r.simulated { 4 * largest } else { 0 };
    let staging = Part {
        name: "device staging",
        bytes: staging + sim,
        detail: format!(
            "a tile's weights in f32 {}{}",
            size(staging),
            if r.simulated {
                format!(", simulated evaluation {}", size(sim))
            } else {
                String::new()
            }
        ),
    };
    (buffers, staging)
}

/// Settings that trade memory for time without changing any result.
#[derive(Clone, Debug, Default)]
pub struct MemoryOptions {
    /// Recompute each layer's forward in the backward.
    pub grad_checkpoint: bool,
    /// Device input buffers [default: from the memory plan].
    pub device_buffers: Option<DeviceBuffers>,
    /// Refuse a run whose plan exceeds this many bytes [default on a device
    /// backend: physical memory less 2 GB; on the CPU: no limit].
    pub max_memory: Option<u64>,
}

/// A training run's plan: the device buffer mode it settles and the limit
/// it is held to.
#[derive(Clone)]
pub struct RunPlan {
    pub buffers: DeviceBuffers,
    pub plan: MemoryPlan,
    pub limit: Option<u64>,
    /// The limit is `--max-memory`'s, not the default.
    explicit_limit: bool,
    /// What the run is: to plan its alternatives.
    model: String,
    cfg: ModelConfig,
    seq: usize,
    lora: Option<LoraConfig>,
    backend: Backend,
    base: BaseWeights,
    tokenizer_file: u64,
    grad_checkpoint: bool,
    preference: Option<PairStep>,
}

impl RunPlan {
    /// The plan of training `model` (a preset or a model directory) at
    /// `seq` on `backend`: device buffers as forced, or persistent when the
    /// whole plan with them fits in a quarter of the limit, else streamed.
    /// Persistent buffers save re-staging the weights of every layer for
    /// every kernel call (a frozen base is staged once), but hold the
    /// weights a second time, in fp16, per kernel that reads them; that
    /// is worth it only while the run leaves most of the machine free.
    pub fn new(
        model: &ModelSource,
        seq: usize,
        lora: Option<&LoraConfig>,
        backend: Backend,
        m: &MemoryOptions,
        preference: Option<PairStep>,
    ) -> anyhow::Result<RunPlan> {
        // The configuration of the base as the run holds it: quantized
        // when its files are, or when it is quantized on load.
        let cfg = ModelConfig {
            quantization: model.base_quantization(),
            ..model.config.clone()
        };
        let base = match (lora, model.dir()) {
            (Some(_), Some(dir)) => BaseWeights::Mapped(crate::model::file_dtype(dir)?),
            // A preset's shape stands for the pretrained checkpoint (LoRA
            // on the preset itself is refused by `train`), published in bf16.
            (Some(_), None) => BaseWeights::Mapped(StoredDtype::BF16),
            (None, _) => BaseWeights::F32,
        };
        let device = backend != Backend::Cpu;
        let limit = m
            .max_memory
            .or_else(|| device.then(default_max_memory).flatten());
        let mut run = RunPlan {
            buffers: m.device_buffers.unwrap_or(DeviceBuffers::Persistent),
            plan: MemoryPlan::empty(),
            limit,
            explicit_limit: m.max_memory.is_some(),
            model: model.spec.clone(),
            cfg,
            seq,
            lora: lora.cloned(),
            backend,
            base,
            tokenizer_file: model
                .tokenizer_file()
                .and_then(|p| std::fs::metadata(p).ok())
                .map_or(0, |m| m.len()),
            grad_checkpoint: m.grad_checkpoint,
            preference,
        };
        run.plan = run.with(seq, lora, m.grad_checkpoint, run.buffers)?;
        if m.device_buffers.is_none() {
            // Persistent buffers hold a quantized base's weights a second
            // time as fp16 copies, undoing what its quantization saves (a
            // 4-bit Qwen3-0.6B's 335 MB base would plan 4.65 GB of them):
            // streamed, staged from the quantized words per call, unless
            // persistent costs no more (small models).
            let over = limit.is_some_and(|l| run.plan.total > l / 4);
            let quantized = device && lora.is_some() && run.cfg.quantization.is_some();
            if over || quantized {
                let streamed = run.with(seq, lora, m.grad_checkpoint, DeviceBuffers::Streamed)?;
                if over || streamed.total < run.plan.total {
                    run.buffers = DeviceBuffers::Streamed;
                    run.plan = streamed;
                }
            }
        }
        Ok(run)
    }

    /// The plan with some settings changed.
    fn with(
        &self,
        seq: usize,
        lora: Option<&LoraConfig>,
        grad_checkpoint: bool,
        buffers: DeviceBuffers,
    ) -> anyhow::Result<MemoryPlan> {
        let device = self.backend != Backend::Cpu;
        let opts = KernelOptions::for_run(&self.cfg, lora);
        MemoryPlan::new(&PlanRequest {
            cfg: &self.cfg,
            seq,
            lora,
            base: self.base,
            device: device.then_some(buffers),
            simulated: self.backend == Backend::AneSim,
            tokenizer_file: self.tokenizer_file,
            grad_checkpoint,
            opts: Some(&opts),
            preference: self.preference,
        })
        .map_err(anyhow::Error::from)
    }

    /// The plan with the model named `name` in what it prints (a Hub id
    /// in place of its snapshot's path).
    pub fn named(mut self, name: &str) -> RunPlan {
        self.model = name.to_string();
        self
    }

    /// The plan, or an error in one line when it exceeds the limit, naming
    /// the single changes that would fit.
    pub fn refuse_over_limit(self) -> anyhow::Result<RunPlan> {
        let Some(limit) = self.limit.filter(|&l| self.plan.total > l) else {
            return Ok(self);
        };
        let (seq, lora, ckpt, buffers) = (
            self.seq,
            self.lora.as_ref(),
            self.grad_checkpoint,
            self.buffers,
        );
        let mut fits = Vec::new();
        if !ckpt {
            let p = self.with(seq, lora, true, buffers)?;
            if p.total <= limit {
                fits.push(format!("--grad-checkpoint ({})", size(p.total)));
            }
        }
        if self.backend != Backend::Cpu && buffers == DeviceBuffers::Persistent {
            let p = self.with(seq, lora, ckpt, DeviceBuffers::Streamed)?;
            if p.total <= limit {
                fits.push(format!("--device-buffers streamed ({})", size(p.total)));
            }
        }
        if let Some(l) = lora {
            let mut smaller = l.clone();
            while smaller.rank > 1 {
                smaller.rank /= 2;
                let p = self.with(seq, Some(&smaller), ckpt, buffers)?;
                if p.total <= limit {
                    fits.push(format!("--lora-rank {} ({})", smaller.rank, size(p.total)));
                    break;
                }
            }
        }
        // A pretrained base held as it is: quantized on load (4-bit, MLX's
        // groups of 64, streamed as a quantized base is).
        if let (Some(_), BaseWeights::Mapped(_), None) = (lora, self.base, &self.cfg.quantization) {
            let quantized = RunPlan {
                cfg: ModelConfig {
                    quantization: Some(Quantization {
                        default: QuantSpec::new(4, 64)?,
                        modules: Default::default(),
                    }),
                    ..self.cfg.clone()
                },
                ..self.clone()
            };
            let qb = match self.backend {
                Backend::Cpu => buffers,
                _ => DeviceBuffers::Streamed,
            };
            let p = quantized.with(seq, lora, ckpt, qb)?;
            if p.total <= limit {
                fits.push(format!("--quantize-base 4 ({})", size(p.total)));
            }
        }
        let mut shorter = seq;
        while shorter > 32 {
            shorter /= 2;
            let p = self.with(shorter, lora, ckpt, buffers)?;
            if p.total <= limit {
                fits.push(format!("--seq {shorter} ({})", size(p.total)));
                break;
            }
        }
        anyhow::bail!(
            "this run needs about {} of memory at its peak and the limit is {} (--max-memory{}); {}; `anetrain kernels plan --model {} --seq {}{}{} --backend {}` shows the plan by part",
            size(self.plan.total),
            size(limit),
            if self.explicit_limit { "" } else { ", default: physical memory less 2 GB" },
            if fits.is_empty() {
                "nothing one flag changes fits: use a smaller model or a machine with more memory".to_string()
            } else {
                format!("would fit: {}", fits.join(", or "))
            },
            self.model,
            seq,
            lora.map_or(String::new(), |l| format!(" --lora-rank {}", l.rank)),
            if ckpt { " --grad-checkpoint" } else { "" },
            self.backend.name(),
        )
    }
}

/// The default `--max-memory`: physical memory less 2 GB for the system
/// and other programs.
pub fn default_max_memory() -> Option<u64> {
    crate::util::mem::physical_memory().map(|m| m.saturating_sub(2_000_000_000))
}

/// Bytes of a configuration's matrices stored with quantization `q`:
/// packed words plus a scale and a bias per group, in `dtype`; a matrix
/// it leaves unquantized (listed as such, or too narrow for its groups)
/// in `dtype`.
fn quantized_matrix_bytes(q: &Quantization, cfg: &ModelConfig, dtype: StoredDtype) -> u64 {
    let b = dtype.bytes() as u64;
    crate::model::matrix_shapes(cfg)
        .iter()
        .map(|(name, rows, cols)| {
            let (rows, cols) = (*rows as u64, *cols as u64);
            let module = name.strip_suffix(".weight").unwrap_or(name);
            match q.of(module).filter(|s| s.fits(cols as usize)) {
                Some(s) => {
                    rows * cols * s.bits as u64 / 8 + 2 * rows * (cols / s.group_size as u64) * b
                }
                None => rows * cols * b,
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checkpointing keeps one layer's activations instead of all of them;
    /// streamed buffers two sets instead of one per layer; a mapped bf16
    /// base half the bytes of f32.
    #[test]
    fn the_plan_moves_with_the_settings() {
        let cfg = ModelConfig::preset("qwen3-0.6b").unwrap();
        let lora = LoraConfig::every_projection(16);
        let opts = KernelOptions::hf(&cfg);
        let req = PlanRequest {
            cfg: &cfg,
            seq: 256,
            lora: Some(&lora),
            base: BaseWeights::Mapped(StoredDtype::BF16),
            device: None,
            simulated: false,
            tokenizer_file: 0,
            grad_checkpoint: false,
            opts: None,
            preference: None,
        };
        let part = |p: &MemoryPlan, n: &str| {
            p.resident
                .iter()
                .chain(&p.transient)
                .find(|x| x.name == n)
                .unwrap()
                .bytes
        };
        let plain = MemoryPlan::new(&req).unwrap();
        let ckpt = MemoryPlan::new(&PlanRequest {
            grad_checkpoint: true,
            ..req.clone()
        })
        .unwrap();
        assert!(part(&ckpt, "activations") * 10 < part(&plain, "activations"));
        let f32 = MemoryPlan::new(&PlanRequest {
            base: BaseWeights::F32,
            ..req.clone()
        })
        .unwrap();
        let ratio = part(&f32, "base weights") as f64 / part(&plain, "base weights") as f64;
        assert!((ratio - 2.0).abs() < 0.01, "{ratio}");
        // DPO: a second gradient buffer and the initial adapters, LoRA's
        // size each; full fine-tuning: a gradient and a model in f32.
        let dpo = PairStep {
            reference_forwards: 2,
            reference_held: true,
        };
        let with_dpo = MemoryPlan::new(&PlanRequest {
            preference: Some(dpo),
            ..req.clone()
        })
        .unwrap();
        assert_eq!(
            part(&with_dpo, "preference"),
            2 * 4 * lora_params(&cfg, &lora)
        );
        let full = MemoryPlan::new(&PlanRequest {
            preference: Some(dpo),
            lora: None,
            base: BaseWeights::F32,
            ..req.clone()
        })
        .unwrap();
        assert_eq!(part(&full, "preference"), 2 * 4 * cfg.num_params() as u64);
        let dev = |m| {
            let r = PlanRequest {
                device: Some(m),
                opts: Some(&opts),
                ..req.clone()
            };
            part(&MemoryPlan::new(&r).unwrap(), "device buffers")
        };
        assert!(dev(DeviceBuffers::Streamed) * 10 < dev(DeviceBuffers::Persistent));
        assert_eq!(
            lora_params(&cfg, &lora),
            28 * 16 * (3072 + 2048 + 2048 + 3072 + 3 * 4096)
        );
    }
}
