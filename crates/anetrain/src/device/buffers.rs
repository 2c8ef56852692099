//! How a kernel set keeps its input buffers on the device: one per layer
//! and tile (persistent), or two a kernel, restaged every call (streamed).

use crate::kernels::tiling;

/// How a kernel set keeps its input buffers (weights and activations of
/// one kernel call) on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceBuffers {
    /// One buffer per layer, kernel and tile: weights staged once per
    /// optimizer step (adapters only, when only they changed).
    Persistent,
    /// One buffer per kernel, refilled for every (layer, tile) it runs;
    /// while the device evaluates one, a host thread prepares the next
    /// one's weights (double buffering: the second buffer is host memory,
    /// fp16). A buffer holds one tile, at most
    /// [`crate::kernels::MAX_TILE_BYTES`].
    Streamed,
}

impl crate::util::choice::Choice for DeviceBuffers {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            DeviceBuffers::Persistent,
            "persistent",
            "One device buffer per layer, kernel and tile, staged once per step",
        ),
        (
            DeviceBuffers::Streamed,
            "streamed",
            "One device buffer per kernel, refilled tile by tile, layer by layer",
        ),
    ];
}

impl DeviceBuffers {
    /// Device input buffers of kernel tiles `k` run for `units` layers (or
    /// head chunks), and (streamed) the host's staging copies beside them.
    /// A kernel without weights (the attention backward's) holds nothing
    /// between evaluations: one buffer in either mode.
    pub fn buffers_of(self, k: &tiling::KernelTiles, units: usize) -> (usize, usize) {
        match self {
            DeviceBuffers::Persistent if k.weight_bytes > 0 => (units * k.tiles, 0),
            DeviceBuffers::Persistent => (1, 0),
            DeviceBuffers::Streamed => (1, 1),
        }
    }
}
