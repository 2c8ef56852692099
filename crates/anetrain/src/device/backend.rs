//! Which engine runs the kernels: the backend a user names, its device
//! opened ([`OpenDevice`]) and its runner ([`AnyRunner`]).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::{AttentionGrads, CpuKernels, DeviceBuffers, Dropout, KernelRunner, NeuralKernels};
use crate::kernels::tiling::HeadChunks;
use crate::kernels::{sdpa_backward1, Kernel, KernelOptions, Shape};
use crate::model::Model;

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
    let played = ane::family::sim_family_from_env()?;
    Ok(Some(match played {
        Some(f) if backend == Backend::AneSim => format!(
            "chip family: {f}, played by the simulator ({})",
            ane::family::SIM_FAMILY_ENV
        ),
        _ => format!(
            "chip family: {}",
            ane::family::Profile::in_force()?.describe()
        ),
    }))
}

/// The chip family a run on `backend` is predicted for: the one the
/// simulator plays (`ANETRAIN_SIM_FAMILY`) on `ane-sim`, else the family
/// in force; `None` when no family is known.
pub fn predicted_family(backend: Backend) -> Result<Option<ane::family::Family>> {
    let played = ane::family::sim_family_from_env()?;
    Ok(match (backend, played) {
        (Backend::AneSim, Some(f)) => Some(f),
        _ => ane::family::Profile::in_force()?.family,
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

/// The device of a backend, opened before any work, so a Neural Engine
/// that cannot be used is reported before data is read or a model loaded.
pub enum OpenDevice {
    Cpu,
    Sim(ane::SimDevice),
    Ane(ane::AneDevice),
}

impl Backend {
    /// Opens this backend's device (see [`open_sim`], [`open_ane`]).
    pub fn open(self) -> Result<OpenDevice> {
        Ok(match self {
            Backend::Cpu => OpenDevice::Cpu,
            Backend::AneSim => OpenDevice::Sim(open_sim()?),
            Backend::Ane => OpenDevice::Ane(open_ane()?),
        })
    }
}

/// The kernel runner of any backend: code that picks its backend at run
/// time drives this one type, and the one `match` from a backend to its
/// runner is [`AnyRunner::new`]'s.
pub enum AnyRunner {
    Cpu(CpuKernels),
    Sim(NeuralKernels<ane::SimDevice>),
    Ane(NeuralKernels<ane::AneDevice>),
}

/// `$body` with `$r` bound to the runner inside an [`AnyRunner`].
macro_rules! each_runner {
    ($any:expr, $r:ident => $body:expr) => {
        match $any {
            AnyRunner::Cpu($r) => $body,
            AnyRunner::Sim($r) => $body,
            AnyRunner::Ane($r) => $body,
        }
    };
}

impl AnyRunner {
    /// The runner of `device` with kernel options `opts`.
    pub fn new(device: OpenDevice, opts: KernelOptions) -> AnyRunner {
        match device {
            OpenDevice::Cpu => AnyRunner::Cpu(CpuKernels::new(opts)),
            OpenDevice::Sim(d) => AnyRunner::Sim(NeuralKernels::new(d, opts)),
            OpenDevice::Ane(d) => AnyRunner::Ane(NeuralKernels::new(d, opts)),
        }
    }

    /// Device buffers kept as `mode` says (the CPU has none).
    pub fn with_buffers(self, mode: DeviceBuffers) -> AnyRunner {
        match self {
            AnyRunner::Cpu(r) => AnyRunner::Cpu(r),
            AnyRunner::Sim(r) => AnyRunner::Sim(r.with_buffers(mode)),
            AnyRunner::Ane(r) => AnyRunner::Ane(r.with_buffers(mode)),
        }
    }

    /// Device kernels compiled for `seq` whatever the call's length (the
    /// CPU kernels take any length).
    pub fn set_fixed_seq(&mut self, seq: usize) {
        match self {
            AnyRunner::Cpu(_) => {}
            AnyRunner::Sim(r) => r.set_fixed_seq(seq),
            AnyRunner::Ane(r) => r.set_fixed_seq(seq),
        }
    }
}

impl KernelRunner for AnyRunner {
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out> {
        each_runner!(self, r => r.run::<K>(model, layer, shape, dropout, acts))
    }

    fn head_chunks(&mut self, model: &Model, seq: usize) -> Result<HeadChunks> {
        each_runner!(self, r => r.head_chunks(model, seq))
    }

    fn overlaps_host(&self) -> bool {
        each_runner!(self, r => r.overlaps_host())
    }

    fn computes_in_fp16(&self) -> bool {
        each_runner!(self, r => r.computes_in_fp16())
    }

    fn recomputing(&mut self, on: bool) {
        each_runner!(self, r => r.recomputing(on))
    }

    fn attention_backward(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &sdpa_backward1::Acts<'_>,
    ) -> Result<AttentionGrads> {
        each_runner!(self, r => r.attention_backward(model, layer, shape, dropout, acts))
    }
}
