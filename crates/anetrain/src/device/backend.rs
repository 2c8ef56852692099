//! Which engine runs the kernels.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    /// Native f32 kernels on the CPU.
    Cpu,
    /// The exact MIL programs on the simulated Neural Engine (fp16 interpreter).
    AneSim,
    /// The Apple Neural Engine (macOS).
    Ane,
}

impl crate::util::choice::Choice for Backend {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (Backend::Cpu, "cpu", "Native f32 kernels on the CPU"),
        (
            Backend::AneSim,
            "ane-sim",
            "The exact MIL programs on the simulated Neural Engine (fp16 interpreter)",
        ),
        (Backend::Ane, "ane", "The Apple Neural Engine (macOS)"),
    ];
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

/// The simulated device for `--backend ane-sim`: playing the chip family
/// `ANETRAIN_SIM_FAMILY` names, if any, with kernels built to the limits
/// in force (see [`ane::SimDevice::from_env`]).
pub fn open_sim() -> Result<ane::SimDevice> {
    ane::SimDevice::from_env().map_err(|e| anyhow::anyhow!("--backend ane-sim: {e}"))
}

/// Which chip family the device kernels are built for (and which one the
/// simulator plays), in one line; `None` on the CPU.
pub fn chip_family_line(backend: Backend) -> Result<Option<String>> {
    if backend == Backend::Cpu {
        return Ok(None);
    }
    let played = ane::family::sim_family_from_env().map_err(anyhow::Error::msg)?;
    Ok(Some(match played {
        Some(f) if backend == Backend::AneSim => format!(
            "chip family: {f}, played by the simulator ({})",
            ane::family::SIM_FAMILY_ENV
        ),
        _ => format!(
            "chip family: {}",
            ane::family::Profile::in_force()
                .map_err(anyhow::Error::msg)?
                .describe()
        ),
    }))
}

/// The chip family a run on `backend` is predicted for: the one the
/// simulator plays (`ANETRAIN_SIM_FAMILY`) on `ane-sim`, else the family
/// in force; `None` when no family is known.
pub fn predicted_family(backend: Backend) -> Result<Option<ane::family::Family>> {
    let played = ane::family::sim_family_from_env().map_err(anyhow::Error::msg)?;
    Ok(match (backend, played) {
        (Backend::AneSim, Some(f)) => Some(f),
        _ => {
            ane::family::Profile::in_force()
                .map_err(anyhow::Error::msg)?
                .family
        }
    })
}

/// Whether the private-API Neural Engine device opens here.
pub fn ane_available() -> bool {
    ane::AneDevice::available()
}

/// Opens the Neural Engine for `--backend ane`, or says in one line why it
/// cannot be used and what to use instead.
pub fn open_ane() -> Result<ane::AneDevice> {
    match ane::AneDevice::open() {
        Ok(d) => Ok(d),
        Err(e) => bail!(
            "--backend ane: {e}; use --backend ane-sim (the same MIL programs, simulated) or cpu"
        ),
    }
}
