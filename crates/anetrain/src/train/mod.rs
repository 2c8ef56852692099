//! Training: the step (`step`), the optimizer (`optim`), checkpoints with
//! exact resume (`checkpoint`), and the run around them — settings, data
//! sources, the run directory, metrics and the loop (`train`). Progress is
//! reported as [`Event`]s; the caller decides how to show them and when to
//! stop.

pub mod checkpoint;
mod event;
mod feed;
mod metrics;
pub mod objective;
pub mod optim;
pub mod reference;
mod run;
mod run_dir;
mod settings;
pub mod step;

pub use event::{Event, Interrupted};
pub use feed::{data_fill, DataFill};
pub use run::train;
pub use run_dir::{abandon_fresh_run, default_out};
pub use settings::{
    settings_differences, MemoryOptions, Sample, TrainRequest, TrainSettings, DEFAULT_VAL_FRAC,
};
