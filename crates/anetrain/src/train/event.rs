//! What a run reports: its [`Event`]s, the record of each optimizer step
//! the metrics log is written from, and [`Interrupted`].

use std::path::PathBuf;

use crate::train::objective::PreferenceMetrics;

/// A run stopped because the user asked (a signal), its last completed
/// step saved: not a failure, so the command line reports it as a plain
/// line and exits with 130, as a shell does for an interrupted command.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Interrupted {}

/// What a run reports as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Before the first step.
    Started {
        model: String,
        params: usize,
        train_tokens: usize,
        val_tokens: usize,
        out: PathBuf,
        /// `(rank, alpha, projections, trainable parameters, the layers
        /// adapted when not all: (first, count))` with LoRA.
        #[allow(clippy::type_complexity)]
        lora: Option<(usize, f64, Vec<&'static str>, usize, Option<(usize, usize)>)>,
        /// The training and validation pairs of a preference run.
        pairs: Option<(usize, usize)>,
        /// What a preference run optimises, and against which reference
        /// (one line: "DPO (sigmoid loss, β 0.1) against …").
        objective: Option<String>,
        /// How the frozen base is held when it is quantized (one line).
        base: Option<String>,
        /// The step a resumed run continues from.
        resumed_at: Option<u64>,
        steps: u64,
    },
    /// Something the user should know, in one line.
    Note(String),
    /// Something that is probably a mistake, in one line; the run goes on.
    Warning(String),
    /// Step `step` (1-based) was skipped: its loss or gradients were not
    /// finite.
    Skipped { step: u64, reason: String },
    /// Step `step` (1-based) of `steps` finished; `val` is the validation
    /// loss when this step evaluated it.
    Step {
        step: u64,
        steps: u64,
        loss: f64,
        val: Option<f64>,
        lr: f64,
        /// A preference step's metrics, and the validation pairs' when
        /// this step evaluated them.
        preference: Option<PreferenceMetrics>,
        val_preference: Option<PreferenceMetrics>,
        tokens_per_s: f64,
        /// Seconds left at this run's pace.
        eta_s: f64,
    },
    /// Every step ran and the last checkpoint is saved; `chat` when the
    /// run trained on examples rendered with the chat template.
    Finished {
        steps: u64,
        out: PathBuf,
        chat: bool,
    },
}

/// What one optimizer step did, as the run logs and reports it (the
/// step's own result is [`super::step::StepStats`]).
pub(super) struct StepRecord {
    /// Mean loss over the step's targets.
    pub(super) loss: f64,
    /// Tokens the step read.
    pub(super) tokens: usize,
    pub(super) lr: f64,
    pub(super) grad_norm: f64,
    /// Whether the update was applied (loss and gradients finite).
    pub(super) finite: bool,
    pub(super) loss_scale: f64,
    /// Seconds in forward, loss, backward and the optimizer.
    pub(super) times: [f64; 4],
    /// A preference step's metrics, under TRL's names.
    pub(super) preference: Option<PreferenceMetrics>,
}
