//! The run: preflight checks, a fresh start or a resume, then the step
//! loop with validation, metrics and checkpoints, reported as [`Event`]s.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::checkpoint::{self, TrainerState};
use super::event::{Event, Interrupted, StepRecord};
use super::feed::{load_corpus, next_batch, val_batch, Corpus, Source};
use super::metrics::Metrics;
use super::objective::Objective;
use super::optim::{self, AdamW, LossScaler};
use super::reference::Reference;
use super::settings::{settings_differences, validate, TrainRequest, TrainSettings};
use super::step::{self, BatchLoss, Loss};
use crate::data::tokenizer::Tokenizer;
use crate::device::backend::{self, Backend, OpenDevice};
use crate::device::KernelRunner;
use crate::engine::{zero_grads, Engine};
use crate::kernels::{tiling, KernelOptions, Shape};
use crate::model::config::ModelConfig;
use crate::model::lora::Lora;
use crate::model::source::ModelSource;
use crate::model::Model;
use crate::plan::memory::RunPlan;
use crate::util::choice::Choice;
use crate::util::rng::Rng;

/// Attaches the adapters a LoRA run starts from: `--init-adapter`'s, else
/// fresh ones.
fn with_adapters(mut model: Model, s: &TrainSettings) -> Result<Model> {
    model.lora = match (&s.init_adapter, &s.lora) {
        (Some(dir), _) => Some(Lora::load(&model.cfg, dir)?),
        (None, Some(l)) => Some(Lora::init(&model.cfg, l.clone(), s.seed)?),
        (None, None) => None,
    };
    Ok(model)
}

/// The model a run starts from: a preset initialised from the seed with
/// `cfg`, or a model directory (with LoRA its frozen base, memory-mapped),
/// with fresh adapters when the run trains LoRA.
fn starting_model(source: &ModelSource, cfg: &ModelConfig, s: &TrainSettings) -> Result<Model> {
    with_adapters(source.load(cfg, s.lora.is_some(), s.seed)?, s)
}

/// Runs (or resumes) training; returns the final train loss. `report`
/// receives every [`Event`]; when `stop` becomes true the run abandons the
/// step in progress at the next sequence, saves the last completed step
/// and returns an error saying how to resume.
pub fn train(
    mut r: TrainRequest,
    report: &mut dyn FnMut(&Event),
    stop: &AtomicBool,
) -> Result<f64> {
    let pre = preflight(&r)?;
    // Held by this process for the run's life, and removed again if this
    // run fails before its first checkpoint.
    let (out, _created, _lock) = super::run_dir::claim(&r.out, r.out_is_default, r.resume)?;
    r.out = out;
    let start = match r.resume {
        true => resume(&r, &pre.source, report)?,
        false => fresh(&r, &pre.source, report)?,
    };
    report(&Event::Note(pre.plan.plan.line()));
    if r.settings.backend != Backend::Cpu {
        let fill = start.corpus.source.fill(r.settings.seq);
        report(&Event::Note(predicted_line(&r, &pre, fill)?));
    }
    run_steps(&r, pre, start, report, stop)
}

/// The predicted step and run on the chip family in force (the one the
/// simulator plays, if set) before the first step, its tokens a second
/// those of the data's rows (`fill`).
fn predicted_line(
    r: &TrainRequest,
    pre: &Preflight,
    fill: super::feed::DataFill,
) -> Result<String> {
    let s = &r.settings;
    let setup = crate::plan::timeline::StepSetup::new(
        s.seq,
        s.batch * s.accum,
        s.objective.pair_step(),
        s.lora.clone(),
        r.memory.grad_checkpoint,
        pre.plan.buffers,
    )
    .with_row_tokens(fill.row_tokens);
    let family = backend::predicted_family(s.backend)?;
    let cfg = &pre.source.config;
    crate::plan::timeline::run_estimate(cfg, &setup, &pre.opts, family, r.steps)
}

/// What a run checked before creating anything.
struct Preflight {
    source: ModelSource,
    /// The kernels' options for the run's model and adapters.
    opts: KernelOptions,
    plan: RunPlan,
    /// The backend's device, opened first so an unusable Neural Engine
    /// fails first.
    device: OpenDevice,
}

/// Everything that can refuse a run before it writes anything: the
/// settings, the model, the device's tiling, the memory plan, the device,
/// and the run directory against `--resume`.
fn preflight(r: &TrainRequest) -> Result<Preflight> {
    let s = &r.settings;
    validate(s, r)?;
    let mut source = ModelSource::resolve(&s.model)?;
    if let Some(spec) = s.quantize_base {
        if source.is_preset() || s.lora.is_none() {
            bail!("--quantize-base quantizes a pretrained base for LoRA: give --model DIR|ORG/NAME and --lora-rank R");
        }
        if source.config.quantization.is_some() {
            bail!(
                "'{}' is already quantized; drop --quantize-base",
                s.model_name()
            );
        }
        source = source.quantized_on_load(spec);
    }
    if source.base_quantization().is_some() && s.lora.is_none() {
        bail!(
            "'{}' is quantized: a quantized base trains LoRA adapters only (add --lora-rank R); full fine-tuning needs the unquantized weights",
            s.model_name()
        );
    }
    if s.seq > source.config.max_position_embeddings {
        bail!(
            "--seq {} exceeds the model's max_position_embeddings ({})",
            s.seq,
            source.config.max_position_embeddings
        );
    }
    let opts = KernelOptions::for_run(&source.config, s.lora.as_ref());
    if s.backend != Backend::Cpu {
        // A model the device cannot run, even tiled, fails before any work.
        let compiled = crate::kernels::compiled_length(s.seq);
        tiling::plan(&Shape::new(&source.config, compiled), &opts)?;
    }
    // Refused before anything is created; reported once the data is read.
    let plan = RunPlan::new(
        &source,
        s.seq,
        s.lora.as_ref(),
        s.backend,
        &r.memory,
        s.objective.pair_step(),
    )?
    .named(s.model_name())
    .refuse_over_limit()?;
    let device = s.backend.open()?;
    let out = &r.out;
    if r.resume && !checkpoint::state_path(out).is_file() {
        bail!(
            "nothing to resume in '{}': {}",
            out.display(),
            if out.exists() {
                "it holds no checkpoint (trainer/state.json)"
            } else {
                "the directory does not exist"
            }
        );
    }
    if !r.resume && checkpoint::state_path(out).exists() {
        bail!(
            "'{}' already holds a training run; pass --resume to continue it or choose another --out",
            out.display()
        );
    }
    Ok(Preflight {
        source,
        opts,
        plan,
        device,
    })
}

/// Where the step loop starts: the model, its optimizer and trainer state,
/// and the data.
struct Start {
    model: Model,
    opt: AdamW,
    state: TrainerState,
    corpus: Corpus,
    /// DPO's reference: the model as the run began.
    reference: Reference,
}

/// A resumed run: the committed checkpoint (with the same settings), its
/// tokenizer, and the data read again.
fn resume(r: &TrainRequest, source: &ModelSource, report: &mut dyn FnMut(&Event)) -> Result<Start> {
    let (s, out) = (&r.settings, &r.out);
    let committed = checkpoint::read_state(out)?;
    let saved: TrainSettings = serde_json::from_value(committed.settings.clone())
        .context("the checkpoint's settings are unreadable")?;
    let differences = settings_differences(&saved, s, &committed.adamw, &r.adamw);
    if !differences.is_empty() {
        bail!(
            "--resume with different settings than the run in '{}': {}; repeat the run's flags (only --steps, --save-every and --log-every may change on resume)",
            out.display(),
            differences.join(", ")
        );
    }
    let base = match s.lora {
        Some(_) => Some(starting_model(source, &committed.config, s)?),
        None => None,
    };
    // DPO's reference is the model the run started from, not the resumed
    // one: the initial adapters (the base's), or the initial model again.
    let reference = match &base {
        _ if !s.objective.is_preference() => Reference::Unneeded,
        Some(b) => Reference::of(b, &s.objective),
        None => Reference::of(&starting_model(source, &committed.config, s)?, &s.objective),
    };
    let (model, opt, mut state) = checkpoint::load(out, base)?;
    // A run killed after its last commit but before the top-level links
    // were updated shows older weights there until this.
    checkpoint::publish_latest(out, &model, &state)?;
    if r.steps <= state.step {
        bail!(
            "the run in '{}' has done {} steps already; pass a larger --steps to continue it",
            out.display(),
            state.step
        );
    }
    if state.total_steps != 0 && state.total_steps != r.steps {
        report(&Event::Note(format!(
            "the run was set for {} steps and continues to {}: from step {} on, the learning-rate schedule{} spans {} steps",
            state.total_steps,
            r.steps,
            state.step + 1,
            if s.warmup.is_none() { " (and the default warmup, a tenth of it)" } else { "" },
            r.steps
        )));
    }
    state.total_steps = r.steps;
    let tok_path = out.join("tokenizer.json");
    let tok = match tok_path.is_file() {
        true => Some(Tokenizer::load(&tok_path)?),
        false => None,
    };
    let mut cfg = model.cfg.clone();
    let corpus = load_corpus(s, source, &mut cfg, false, tok, &mut |e| report(&e))?;
    Ok(Start {
        model,
        opt,
        state,
        corpus,
        reference,
    })
}

/// A fresh run: the tokenizer (given, or the model's), the data, the
/// starting model and optimizer, and the run directory made a Hugging Face
/// model directory (tokenizer, generation config).
fn fresh(r: &TrainRequest, source: &ModelSource, report: &mut dyn FnMut(&Event)) -> Result<Start> {
    let (s, out) = (&r.settings, &r.out);
    let tok = super::feed::run_tokenizer(r.tokenizer.as_deref(), source)?;
    let mut cfg = source.config.clone();
    let corpus = load_corpus(s, source, &mut cfg, true, tok, &mut |e| report(&e))?;
    if let (true, Some(t)) = (source.is_preset(), &corpus.tokenizer) {
        // A preset from scratch: its special tokens are the tokenizer's.
        cfg.bos_token_id = t.begin_token().map(|b| b.1.into());
        cfg.eos_token_id = t.end_tokens().first().map(|e| e.1.into());
    }
    let model = starting_model(source, &cfg, s)?;
    let reference = Reference::of(&model, &s.objective);
    let opt = AdamW::new(&model, r.adamw);
    let state = TrainerState {
        format: checkpoint::FORMAT,
        step: 0,
        rng: Rng::new(s.seed.wrapping_add(1)).state(),
        cursor: 0,
        skipped: 0,
        total_steps: r.steps,
        config: model.cfg.clone(),
        scaler: if s.backend.uses_fp16() {
            LossScaler::dynamic(s.loss_scale)
        } else {
            LossScaler::fixed()
        },
        adamw: r.adamw,
        settings: serde_json::to_value(s)?,
        model_file: String::new(),
        model_hash: String::new(),
        optim_file: String::new(),
        optim_hash: String::new(),
    };
    if let Some(t) = &corpus.tokenizer {
        // The run is a complete Hugging Face model directory: the
        // tokenizer with its tokenizer_config.json (the base model's
        // when it has one).
        t.save_to_dir(out, model.cfg.max_position_embeddings)?;
    }
    // And the base's generation config: where its generation ends.
    if let Some(dir) = source.dir() {
        crate::model::generation::copy_generation_config(dir, out)?;
    }
    Ok(Start {
        model,
        opt,
        state,
        corpus,
        reference,
    })
}

/// The step loop on the run's backend.
fn run_steps(
    r: &TrainRequest,
    pre: Preflight,
    start: Start,
    report: &mut dyn FnMut(&Event),
    stop: &AtomicBool,
) -> Result<f64> {
    let Start {
        mut model,
        mut opt,
        mut state,
        corpus,
        reference,
    } = start;
    let mut run = Run {
        r,
        s: &r.settings,
        out: &r.out,
        resuming: r.resume,
        corpus: &corpus,
        report,
        stop,
        loss: Loss::new(r.settings.objective, reference),
    };
    let e = Engine::on(&model, pre.device)
        .buffers(pre.plan.buffers)
        .checkpointing(r.memory.grad_checkpoint);
    run.go(e, &mut model, &mut opt, &mut state)
}

/// The parts of a run the step loop reads.
pub(super) struct Run<'a> {
    pub(super) r: &'a TrainRequest,
    pub(super) s: &'a TrainSettings,
    pub(super) out: &'a Path,
    pub(super) resuming: bool,
    pub(super) corpus: &'a Corpus,
    pub(super) report: &'a mut dyn FnMut(&Event),
    pub(super) stop: &'a AtomicBool,
    /// What the steps minimise, and what that keeps from step to step.
    pub(super) loss: Loss,
}

impl Run<'_> {
    fn go<R: KernelRunner>(
        &mut self,
        mut eng: Engine<R>,
        model: &mut Model,
        opt: &mut AdamW,
        state: &mut TrainerState,
    ) -> Result<f64> {
        let (r, s, out) = (self.r, self.s, self.out);
        let mut metrics = Metrics::open(out, self.resuming.then_some(state.step))?;
        let mut rng = Rng::from_state(state.rng);
        self.report_start(model, state)?;
        self.precompute_reference(&mut eng, model)?;
        let run_start = Instant::now();
        let start_step = state.step;
        let mut last_loss = f64::NAN;
        let mut consecutive_skips = 0;
        // One gradient buffer for the whole run, overwritten each step.
        let mut grads = zero_grads(model);
        while state.step < r.steps {
            let t0 = Instant::now();
            let Some(st) = self.advance(&mut eng, model, opt, state, &mut rng, &mut grads)? else {
                // Stopped mid-step: nothing of the step was kept, so the
                // state is the last completed step's; save it.
                metrics.sync()?;
                state.rng = rng.state();
                checkpoint::save(out, model, opt, state.clone())?;
                return Err(Interrupted(format!(
                    "interrupted during step {}; step {} is saved in '{}' — continue with the same flags plus --resume",
                    state.step + 1,
                    state.step,
                    out.display()
                ))
                .into());
            };
            if st.finite {
                consecutive_skips = 0;
                last_loss = st.loss;
            } else {
                self.skipped(state, &st, &mut consecutive_skips)?;
            }
            state.step += 1;
            let dt = t0.elapsed().as_secs_f64();
            let tps = st.tokens as f64 / dt;
            metrics.log_step(state.step, &st, tps, dt)?;
            let mut val = None;
            if s.eval_every > 0
                && (state.step.is_multiple_of(s.eval_every) || state.step == r.steps)
            {
                val = self.validate(&mut eng, model)?;
                if let Some(v) = &val {
                    metrics.val(state.step, v.loss, v.preference.as_ref())?;
                }
            }
            let done = (state.step - start_step) as f64;
            (self.report)(&Event::Step {
                step: state.step,
                steps: r.steps,
                loss: st.loss,
                val: val.map(|v| v.loss),
                lr: st.lr,
                preference: st.preference,
                val_preference: val.and_then(|v| v.preference),
                tokens_per_s: tps,
                eta_s: run_start.elapsed().as_secs_f64() / done * (r.steps - state.step) as f64,
            });
            let stop = self.stop.load(Ordering::SeqCst);
            if stop || state.step.is_multiple_of(r.save_every.max(1)) || state.step == r.steps {
                metrics.sync()?;
                state.rng = rng.state();
                checkpoint::save(out, model, opt, state.clone())?;
            }
            if stop && state.step < r.steps {
                return Err(Interrupted(format!(
                    "interrupted after step {}; the checkpoint in '{}' is saved — continue with the same flags plus --resume",
                    state.step,
                    out.display()
                ))
                .into());
            }
        }
        (self.report)(&Event::Finished {
            steps: state.step,
            out: out.to_path_buf(),
            chat: self.corpus.source.chat(),
        });
        Ok(last_loss)
    }

    /// The run's first reports: the chip family in force (on a device)
    /// and what is trained on what.
    fn report_start(&mut self, model: &Model, state: &TrainerState) -> Result<()> {
        let (s, out) = (self.s, self.out);
        let (train_tokens, val_tokens) = self.corpus.source.sizes();
        if let Some(line) = crate::device::backend::chip_family_line(s.backend)? {
            (self.report)(&Event::Note(line));
        }
        (self.report)(&Event::Started {
            model: s.model_name().to_string(),
            params: model.num_params(),
            train_tokens,
            val_tokens,
            out: out.to_path_buf(),
            lora: model.lora.as_ref().map(|l| {
                let names = l.modules.iter().map(|m| m.0).collect();
                let n = model.cfg.num_hidden_layers;
                let layers = l.cfg.layers.map(|_| (l.cfg.first_layer(n), n));
                (l.cfg.rank, l.cfg.alpha, names, l.num_params(), layers)
            }),
            pairs: self.corpus.source.pairs(),
            objective: objective_line(
                &s.objective,
                s.init_adapter.as_deref(),
                model.lora.is_some(),
            ),
            base: base_line(model, s.quantize_base),
            resumed_at: self.resuming.then_some(state.step),
            steps: self.r.steps,
        });
        Ok(())
    }

    /// A skipped step: reported, and counted towards divergence unless it
    /// was an fp16 overflow the loss scaler handles; three in a row stop
    /// the run.
    fn skipped(
        &mut self,
        state: &TrainerState,
        st: &StepRecord,
        consecutive_skips: &mut u32,
    ) -> Result<()> {
        let overflow = state.scaler.dynamic && st.loss.is_finite() && state.scaler.scale >= 1.0;
        if !overflow {
            *consecutive_skips += 1;
        }
        self.report_skip(state, st);
        if *consecutive_skips >= 3 {
            bail!(
                "training diverged: {consecutive_skips} consecutive steps with non-finite loss or gradients at step {}; \
                 the last checkpoint is intact — resume with a lower --lr or stronger --clip",
                state.step + 1
            );
        }
        Ok(())
    }

    /// One optimizer step over the next `accum · batch` examples or pairs
    /// (see [`step::step`]), the loss scaler told whether it was finite.
    /// `None` when a stop was requested before the step's last sequence:
    /// the data position is put back and nothing else was changed, so the
    /// state is exactly the previous step's.
    pub(super) fn advance<R: KernelRunner>(
        &mut self,
        eng: &mut Engine<R>,
        model: &mut Model,
        opt: &mut AdamW,
        state: &mut TrainerState,
        rng: &mut Rng,
        grads: &mut crate::engine::Grads,
    ) -> Result<Option<StepRecord>> {
        let (r, s, corpus) = (self.r, self.s, self.corpus);
        let lr = optim::lr_at(
            state.step,
            r.steps,
            s.warmup.unwrap_or(r.steps / 10),
            s.lr,
            s.min_lr_frac,
        );
        let loss_scale = state.scaler.scale;
        let (rng_before, cursor_before) = (rng.clone(), state.cursor);
        let o = step::StepOptions {
            lr,
            clip: s.clip,
            loss_scale,
            dropout: s.lora.as_ref().is_some_and(|l| l.dropout > 0.0).then_some(
                step::DropoutKeys {
                    seed: s.seed,
                    step: state.step,
                },
            ),
        };
        let stop_flag = self.stop;
        let stop = || stop_flag.load(Ordering::SeqCst);
        // The step's examples first: the loss is the mean over all their
        // counted targets (or pairs), however they split into micro-batches.
        let count = s.accum * s.batch;
        let reference = &self.loss.reference;
        let batch = next_batch(&corpus.source, s, reference, rng, &mut state.cursor, count);
        let loss = &mut self.loss;
        let Some(st) = step::step(eng, model, opt, loss, grads, &batch, &o, &stop)? else {
            *rng = rng_before;
            state.cursor = cursor_before;
            return Ok(None);
        };
        state.scaler.update(st.update.finite);
        if !st.update.finite {
            state.skipped += 1;
        }
        let [t_fwd, t_loss, t_bwd] = st.batch.times;
        Ok(Some(StepRecord {
            loss: st.batch.loss,
            tokens: st.batch.tokens,
            lr,
            grad_norm: st.update.grad_norm,
            finite: st.update.finite,
            loss_scale,
            times: [t_fwd, t_loss, t_bwd, st.optimizer_s],
            preference: st.batch.preference,
        }))
    }

    /// The validation loss (and a preference run's metrics) over the
    /// first `--eval-windows` windows, records or pairs; `None` without a
    /// validation split.
    fn validate<R: KernelRunner>(
        &mut self,
        eng: &mut Engine<R>,
        model: &mut Model,
    ) -> Result<Option<BatchLoss>> {
        let (source, s) = (&self.corpus.source, self.s);
        let Some(batch) = val_batch(source, s.seq, s.eval_windows, &self.loss.reference) else {
            return Ok(None);
        };
        Ok(Some(step::eval_loss(eng, model, &mut self.loss, &batch)?))
    }

    /// `--precompute-ref`: the reference's log-probabilities of every
    /// training and validation pair, once, before the first step.
    fn precompute_reference<R: KernelRunner>(
        &mut self,
        eng: &mut Engine<R>,
        model: &mut Model,
    ) -> Result<()> {
        let Source::Pairs { train, val } = &self.corpus.source else {
            return Ok(());
        };
        if !self.loss.objective.precompute_ref() || !self.loss.reference.is_model() {
            return Ok(());
        }
        let total = train.len() + val.len();
        (self.report)(&Event::Note(format!(
            "computing the reference's log-probabilities of {total} pairs once (--precompute-ref)"
        )));
        // A line every ten seconds: pairs done and the time left.
        let (start, mut shown) = (Instant::now(), Instant::now());
        let report = &mut *self.report;
        let mut progress = |done: usize, total: usize| {
            if shown.elapsed().as_secs_f64() >= 10.0 && done < total {
                shown = Instant::now();
                let left = start.elapsed().as_secs_f64() / done as f64 * (total - done) as f64;
                report(&Event::Note(format!(
                    "reference log-probabilities: {done}/{total} pairs, about {left:.0} s left"
                )));
            }
        };
        let stop_flag = self.stop;
        let stop = || stop_flag.load(Ordering::SeqCst);
        let done =
            self.loss
                .reference
                .precompute(eng, model, (train, val), &stop, &mut progress)?;
        if !done {
            return Err(Interrupted(
                "interrupted while computing the reference's log-probabilities (--precompute-ref), before any step of this run: nothing new is saved".into(),
            )
            .into());
        }
        Ok(())
    }

    /// Reports a skipped step: what was not finite and the loss scale now.
    fn report_skip(&mut self, state: &TrainerState, st: &StepRecord) {
        let reason = format!(
            "non-finite {}; step skipped{}",
            if st.loss.is_finite() {
                format!("gradients (norm {})", st.grad_norm)
            } else {
                format!("loss ({})", st.loss)
            },
            if state.scaler.dynamic {
                format!(", loss scale now {}", state.scaler.scale)
            } else {
                String::new()
            }
        );
        (self.report)(&Event::Skipped {
            step: state.step + 1,
            reason,
        });
    }
}

/// What a preference run optimises and against what, in one line; `None`
/// for SFT. The reference is what `Reference::of` takes: the starting
/// model, frozen (with LoRA: the base with the starting adapter swapped in).
fn objective_line(
    objective: &Objective,
    init_adapter: Option<&Path>,
    lora: bool,
) -> Option<String> {
    let reference = match (lora, init_adapter) {
        (true, Some(a)) => format!("the base with the starting adapter ({})", a.display()),
        (true, None) => "the base (the new adapter starts at zero)".to_string(),
        (false, _) => "a frozen copy of the starting model".to_string(),
    };
    match objective {
        Objective::Sft => None,
        Objective::Dpo {
            loss,
            beta,
            precompute_ref,
        } => Some(format!(
            "DPO ({} loss, β {beta}) against {reference}{}",
            loss.name(),
            match precompute_ref {
                true => ", its log-probabilities computed once before training",
                false => "",
            }
        )),
        Objective::Orpo { lambda } => Some(format!("ORPO (λ {lambda}), no reference model")),
    }
}

/// How a quantized base is held, in one line; `None` for a float base.
fn base_line(model: &Model, on_load: Option<crate::model::quant::QuantSpec>) -> Option<String> {
    let q =
        |s: crate::model::quant::QuantSpec| format!("{}-bit groups of {}", s.bits, s.group_size);
    match (on_load, &model.cfg.quantization) {
        (Some(s), _) => Some(format!(
            "the base quantized to {} as it loads (--quantize-base), dequantized as each product needs it",
            q(s)
        )),
        (None, Some(c)) => Some(format!(
            "the base is MLX-quantized ({}{}), dequantized as each product needs it",
            q(c.default),
            match c.modules.is_empty() {
                true => "",
                false => ", some modules otherwise",
            }
        )),
        (None, None) => None,
    }
}
