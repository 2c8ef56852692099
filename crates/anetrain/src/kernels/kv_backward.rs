//! `kv_backward`: the key and value projections backward.

use super::prelude::*;
use super::projections_backward::projections_backward;

projections_backward! {
    /// `dx [D, S] = Wkᵀ·dk + Wvᵀ·dv` (+ LoRA), `dk, dv [KV·HD, S]`.
    KvBackward applies [K, V] to Acts { dk: Port::Dk, dv: Port::Dv } giving Out { dx: Port::Dx }
}
