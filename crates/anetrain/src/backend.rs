//! Which engine runs the kernels.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Backend {
    /// Native f32 kernels on the CPU.
    Cpu,
    /// The exact MIL programs on the simulated Neural Engine (fp16 interpreter).
    AneSim,
    /// The Apple Neural Engine (macOS).
    Ane,
}

impl Backend {
    /// `ane` where available, else `cpu`.
    pub fn platform_default() -> Backend {
        if ane_available() {
            Backend::Ane
        } else {
            Backend::Cpu
        }
    }

    /// Dynamic loss scaling guards fp16 gradients on the device paths.
    pub fn uses_fp16(self) -> bool {
        !matches!(self, Backend::Cpu)
    }
}

/// Whether the private-API Neural Engine device can be used in this build.
pub fn ane_available() -> bool {
    false
}

/// The error for `--backend ane` where the device cannot be used.
pub fn ane_unavailable() -> Result<()> {
    if cfg!(target_os = "macos") {
        bail!("--backend ane: the macOS Neural Engine device is not part of this build yet; use --backend ane-sim (the same MIL programs, simulated) or cpu")
    }
    bail!(
        "--backend ane: ANE not available on this platform ({}); use --backend ane-sim or cpu",
        std::env::consts::OS
    )
}
