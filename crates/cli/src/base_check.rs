//! `--any-base` and the adapter's base check of every command that takes
//! an adapter (`anetrain::model::adapter_base` holds the rule).

use std::path::{Path, PathBuf};

use anetrain::model::adapter_base::{self, BaseMatch};
use anyhow::Result;

pub use anetrain::model::adapter_base::QUANTIZED_FROM;

/// `--any-base`, shared by every command that takes `--adapter`.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct AnyBase {
    /// Use the adapter (--adapter; train's --init-adapter) even though its
    /// adapter_config.json names another base than --model (the same
    /// model in another place, say).
    #[arg(long)]
    pub any_base: bool,
}

/// Refuses `adapter` on `model` when it names another base, unless
/// `--any-base`; warns when the base it names cannot be checked here.
pub fn check(model: &Path, adapter: Option<&Path>, any: AnyBase) -> Result<()> {
    let (Some(adapter), false) = (adapter, any.any_base) else {
        return Ok(());
    };
    let given = model.to_string_lossy();
    warn_unchecked(&given, adapter, adapter_base::check(&given, adapter)?);
    Ok(())
}

/// The warning for an adapter whose base is not on this machine.
pub fn warn_unchecked(model: &str, adapter: &Path, found: BaseMatch) {
    if let BaseMatch::Unchecked { recorded } = found {
        eprintln!(
            "warning: adapter '{}' was trained on '{recorded}', which is not on this machine; applying it to '{model}' unchecked",
            adapter.display()
        );
    }
}

/// [`check`], passing the adapter on.
pub fn checked(model: &Path, adapter: Option<PathBuf>, any: AnyBase) -> Result<Option<PathBuf>> {
    check(model, adapter.as_deref(), any)?;
    Ok(adapter)
}
