//! The command-line tests, one module per subject, in one test binary (a
//! binary per file would link the same dependencies nineteen times; one
//! harness also spreads every test over the cores instead of running the
//! files one after another).

mod common;

mod adapters;
mod bad_inputs;
mod cli_kernels;
mod cli_mil;
mod families;
mod finetune;
mod first_contact;
mod generation;
mod gguf;
mod hub;
mod memory;
mod model_families;
mod pipes;
mod preference;
mod quantize;
mod run_dirs;
mod standin;
mod train_lora;
mod train_resume;
