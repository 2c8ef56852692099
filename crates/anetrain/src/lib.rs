//! anetrain: training Llama and Qwen3 models on the Apple Neural Engine.
//!
//! The folders follow the data flow, each importing only the ones before
//! it (docs/architecture.md has the picture and the rules):
//!
//! * [`util`] — small helpers that know nothing of models.
//! * [`model`] — configs, parameters, LoRA adapters and Hugging Face
//!   directories.
//! * [`data`] — tokenizers, chat templates, corpora, token files, records.
//! * [`kernels`] — one module per Neural Engine kernel: layout, MIL and CPU
//!   twin; tiling.
//! * [`device`] — who runs the kernels: the CPU twins or the programs on a
//!   Neural Engine device.
//! * [`engine`] — the transformer's forward and backward over a runner, the
//!   LM head and its loss, weight gradients, generation.
//! * [`plan`] — what a run will need: memory and work.
//! * [`train`] — the training step, the optimizer, runs and checkpoints;
//!   reports [`train::Event`]s and prints nothing.
//! * [`tools`] — bench, doctor, conversion and export.
//!
//! The command line is the `anetrain-cli` crate.

pub mod util;

pub mod data;
pub mod model;

pub mod kernels;

pub mod device;

pub mod engine;

pub mod plan;

pub mod train;

pub mod tools;
