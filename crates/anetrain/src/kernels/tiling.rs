//! Tiling: kernels too wide for the device run as several programs of one
//! smaller shape.
//!
//! Every weight of a projection rides in its kernel's input, so inputs grow
//! with the model: Qwen3-1.7B's `ffn_forward` input is 18944 columns wide,
//! past the 16384 the device accepts. A kernel is split along one axis —
//! the FFN kernels along the intermediate size, the attention kernels along
//! groups of KV heads (with their query heads) — into `T` equal tiles, each
//! the same kernel at a shape with `hidden / T` (or `heads / T` and
//! `kv_heads / T`). One compiled program serves every tile of every layer.
//!
//! What a tile reads and how results combine follows from what each port's
//! channels run along ([`Extent`]), the maths of the products:
//! * a port along the split axis is cut into `T` channel blocks: tile `t`
//!   reads block `t` of it, and its results are the blocks in order
//!   (concatenation);
//! * a port along the model dimension is read whole by every tile (the
//!   residual `x2` only by tile 0, zeros by the others), and its results
//!   are the sum of the tiles' partial results — a product over a split
//!   reduction axis (`dx = Σₜ W₁ₜᵀ·dh1ₜ + W₃ₜᵀ·dh3ₜ`, `o = Σₜ Woₜ·attnₜ`);
//! * a projection split along its output rows takes its row block (and its
//!   LoRA `B` the same rows, `A` whole); along its input columns, its
//!   column block (and `A` the same columns, `B` whole), so that
//!   `Σₜ Bₜ·(Aₜ·xₜ)` and `Wₜ·x + B·(A·x)` are the untiled adapter's maths.
//!
//! The plan is data, computed here and only here ([`plan`]): for each
//! kernel the smallest tile count whose program passes the device rules
//! (the `max-dim` limit in particular).

use serde::Serialize;

use super::io::{Port, Tensors};
use super::{build, KernelKind, KernelOptions, Shape};
use crate::model::Projection;

/// Forces tiling (see [`KernelOptions::min_tiles`]).
pub const MIN_TILES_ENV: &str = "ANETRAIN_ANE_MIN_TILES";

/// `ANETRAIN_ANE_MIN_TILES` as a number (1 when unset or unusable).
pub fn min_tiles_from_env() -> usize {
    std::env::var(MIN_TILES_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n >= 1)
        .unwrap_or(1)
}

/// What a kernel's tiles split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Axis {
    /// The FFN's intermediate size.
    Hidden,
    /// Groups of KV heads, each with its `ratio` query heads.
    KvGroups,
}

impl Axis {
    pub fn name(self) -> &'static str {
        match self {
            Axis::Hidden => "intermediate size",
            Axis::KvGroups => "KV heads",
        }
    }

    /// How many units the axis has at `s`.
    pub fn count(self, s: &Shape) -> usize {
        match self {
            Axis::Hidden => s.hidden,
            Axis::KvGroups => s.kv_heads,
        }
    }
}

impl KernelKind {
    /// The axis this kernel's tiles split.
    pub fn tile_axis(self) -> Axis {
        match self {
            KernelKind::FfnForward | KernelKind::FfnBackwardW2 | KernelKind::FfnBackwardW13 => {
                Axis::Hidden
            }
            _ => Axis::KvGroups,
        }
    }
}

/// What a port's channels (a weight's rows or columns) run along.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// The model dimension `D`.
    Dim,
    /// The FFN's intermediate size `H`.
    Hidden,
    /// Query heads × head dim.
    Q,
    /// KV heads × head dim.
    Kv,
    /// Score rows, query heads × positions.
    Scores,
    /// Something every tile reads whole (QK-norm weights, LoRA's rank).
    Whole,
}

impl Extent {
    /// Whether `axis` cuts this extent.
    fn split_by(self, axis: Axis) -> bool {
        match axis {
            Axis::Hidden => self == Extent::Hidden,
            Axis::KvGroups => matches!(self, Extent::Q | Extent::Kv | Extent::Scores),
        }
    }
}

/// `(out, in)` extents of projection `p`'s weight `[out, in]`.
fn projection_extents(p: Projection) -> (Extent, Extent) {
    match p {
        Projection::Q => (Extent::Q, Extent::Dim),
        Projection::K | Projection::V => (Extent::Kv, Extent::Dim),
        Projection::O => (Extent::Dim, Extent::Q),
        Projection::Gate | Projection::Up => (Extent::Hidden, Extent::Dim),
        Projection::Down => (Extent::Dim, Extent::Hidden),
    }
}

/// The extent an activation or result port's channels run along.
pub fn activation_extent(port: Port) -> Extent {
    use Port::*;
    match port {
        Xnorm | X2norm | X2 | Dffn | Dy | O | XNext | Dx => Extent::Dim,
        H1 | H3 | Gate | Dgate | Dh1 | Dh3 => Extent::Hidden,
        Attn | QRope | Da | Dq | QRaw => Extent::Q,
        KRope | V | Dk | Dv | KRaw => Extent::Kv,
        Probs | Dp => Extent::Scores,
        Weight(_) | QNorm | KNorm | LoraA(_) | LoraB(_) => Extent::Whole,
    }
}

/// One kernel's tiles.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelTiles {
    pub kind: KernelKind,
    pub axis: Axis,
    /// How many tiles (1: untiled).
    pub tiles: usize,
    /// The shape every tile's program is generated for.
    pub shape: Shape,
    /// `[channels, width]` of a tile's input and output surfaces.
    pub input: [usize; 2],
    pub output: [usize; 2],
}

impl KernelTiles {
    /// Bytes of one tile's input and output surfaces (fp16).
    pub fn surface_bytes(&self) -> (usize, usize) {
        (
            2 * self.input[0] * self.input[1],
            2 * self.output[0] * self.output[1],
        )
    }
}

/// The tiling of every kernel for one model shape and device limits.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub shape: Shape,
    pub max_dim: usize,
    pub kernels: Vec<KernelTiles>,
}

impl Plan {
    /// The tiles of `kind`.
    pub fn of(&self, kind: KernelKind) -> &KernelTiles {
        self.kernels
            .iter()
            .find(|k| k.kind == kind)
            .expect("a plan covers every kernel")
    }

    /// Distinct programs to compile for one sequence length (one per
    /// kernel: tiles share theirs).
    pub fn programs(&self) -> usize {
        self.kernels.len()
    }

    /// Device evaluations per layer for one forward and backward pass.
    pub fn evaluations_per_layer(&self) -> usize {
        self.kernels.iter().map(|k| k.tiles).sum()
    }
}

/// The tile shape of `kind` at `tiles` tiles.
pub fn tile_shape(full: &Shape, axis: Axis, tiles: usize) -> Shape {
    let mut s = *full;
    match axis {
        Axis::Hidden => s.hidden /= tiles,
        Axis::KvGroups => {
            s.heads /= tiles;
            s.kv_heads /= tiles;
        }
    }
    s
}

/// Plans every kernel: the fewest equal tiles whose program passes every
/// enabled device rule at `o.max_dim`; failing that, the fewest that at
/// least fit the dimension limit. An error names the kernel, the axis and
/// the limit when no tiling fits.
pub fn plan(full: &Shape, o: &KernelOptions) -> Result<Plan, String> {
    let limits = ane::rules::Limits { max_dim: o.max_dim };
    let rules = ane::rules::RuleSet::default().with_limits(limits);
    let mut kernels = Vec::new();
    for kind in KernelKind::ALL {
        let axis = kind.tile_axis();
        let n = axis.count(full);
        // Seed-compatible layouts pass values through that tiles would sum.
        let mut counts: Vec<usize> = match o.seed_compat {
            true => vec![1],
            false => (1..=n).filter(|t| n % t == 0).collect(),
        };
        // Forced tiling: at least `min_tiles` (or as many as the axis has).
        let floor = o.min_tiles.min(*counts.last().unwrap_or(&1));
        let forced = counts.iter().position(|&t| t >= floor).unwrap_or(0);
        counts.drain(..forced);
        let mut fits_dim = None;
        let mut chosen = None;
        let mut last_problem = String::new();
        for &t in &counts {
            let shape = tile_shape(full, axis, t);
            let k = build(kind, &shape, o).map_err(|e| format!("{}: {e}", kind.name()))?;
            let findings = ane::rules::check(&k.program, &rules);
            let over = findings.iter().find(|f| f.rule == "max-dim");
            if let Some(f) = over {
                last_problem = f.message.clone();
                continue;
            }
            let l = &k.layout;
            let tiles = KernelTiles {
                kind,
                axis,
                tiles: t,
                shape,
                input: [l.in_channels, l.in_spatial],
                output: [l.out_channels, l.out_spatial],
            };
            if findings.is_empty() {
                chosen = Some(tiles);
                break;
            }
            fits_dim.get_or_insert(tiles);
        }
        match chosen.or(fits_dim) {
            Some(t) => kernels.push(t),
            None => {
                return Err(format!(
                    "{}: no tiling fits the device's largest dimension of {} ({} set it): even {} tile{} along the {} ({n}) leave{} {last_problem}",
                    kind.name(),
                    o.max_dim,
                    ane::rules::MAX_DIM_ENV,
                    counts.last().copied().unwrap_or(1),
                    if counts.last() == Some(&1) { "" } else { "s" },
                    axis.name(),
                    if counts.last() == Some(&1) { "s" } else { "" },
                ))
            }
        }
    }
    Ok(Plan {
        shape: *full,
        max_dim: o.max_dim,
        kernels,
    })
}

/// Rows `t` of `tiles` equal blocks of a row-major `[rows, cols]` tensor.
fn row_block(data: &[f32], rows: usize, t: usize, tiles: usize) -> Vec<f32> {
    let cols = data.len() / rows.max(1);
    let per = rows / tiles;
    data[t * per * cols..(t + 1) * per * cols].to_vec()
}

/// Columns block `t` of `tiles` of a row-major `[rows, cols]` tensor.
fn col_block(data: &[f32], cols: usize, t: usize, tiles: usize) -> Vec<f32> {
    let per = cols / tiles;
    data.chunks(cols)
        .flat_map(|row| &row[t * per..(t + 1) * per])
        .copied()
        .collect()
}

/// The weights of tile `t` of `k` from the full layer's weights `w`
/// (tensors by port, as [`super::LayerWeights::from_tensors`] reads).
pub fn tile_weights(k: &KernelTiles, full: &Shape, w: &super::LayerWeights, t: usize) -> Tensors {
    let mut out = Tensors::new();
    let n = k.tiles;
    for p in Projection::ALL {
        let (oe, ie) = projection_extents(p);
        let (rows, cols) = full.projection(p);
        let base = w.projection(p);
        let cut_rows = oe.split_by(k.axis);
        let cut_cols = ie.split_by(k.axis);
        if !base.is_empty() {
            let v = match (cut_rows, cut_cols) {
                (true, _) => row_block(base, rows, t, n),
                (_, true) => col_block(base, cols, t, n),
                _ => base.to_vec(),
            };
            out.insert(Port::Weight(p), v);
        }
        if let Some((a, b)) = w.adapters[p.index()] {
            let r = a.len() / cols;
            let a = if cut_cols {
                col_block(a, cols, t, n)
            } else {
                a.to_vec()
            };
            let b = if cut_rows {
                row_block(b, rows, t, n)
            } else {
                b.to_vec()
            };
            debug_assert_eq!(r, b.len() / (rows / if cut_rows { n } else { 1 }));
            out.insert(Port::LoraA(p), a);
            out.insert(Port::LoraB(p), b);
        }
    }
    if let Some(q) = w.q_norm {
        out.insert(Port::QNorm, q.to_vec());
    }
    if let Some(kn) = w.k_norm {
        out.insert(Port::KNorm, kn.to_vec());
    }
    out
}

/// Tile `t`'s part of activation `port` (`[C, seq]` row-major): its
/// channel block when the split cuts the port, else the whole (the
/// residual `x2` only for tile 0; zeros for the others, whose partial sums
/// must not add it again).
pub fn tile_activation(
    k: &KernelTiles,
    port: Port,
    data: &[f32],
    seq: usize,
    t: usize,
) -> Vec<f32> {
    if activation_extent(port).split_by(k.axis) {
        return row_block(data, data.len() / seq, t, k.tiles);
    }
    if port == Port::X2 && t > 0 {
        return vec![0.0; data.len()];
    }
    data.to_vec()
}

/// Adds tile `t`'s result for `port` into the full result `acc`: its
/// channel block in place when the split cuts the port, else summed.
pub fn combine(k: &KernelTiles, port: Port, acc: &mut Vec<f32>, part: Vec<f32>, t: usize) {
    if activation_extent(port).split_by(k.axis) {
        if t == 0 {
            acc.clear();
        }
        acc.extend_from_slice(&part);
    } else if t == 0 {
        *acc = part;
    } else {
        acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn blocks_cut_rows_and_columns() {
        let m: Vec<f32> = (0..12).map(|i| i as f32).collect(); // [3, 4]
        assert_eq!(col_block(&m, 4, 1, 2), vec![2., 3., 6., 7., 10., 11.]);
        let m: Vec<f32> = (0..8).map(|i| i as f32).collect(); // [4, 2]
        assert_eq!(row_block(&m, 4, 1, 2), vec![4., 5., 6., 7.]);
    }

    #[test]
    fn an_untiled_model_plans_one_tile_per_kernel() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let p = plan(&Shape::new(&cfg, 64), &KernelOptions::hf(&cfg)).unwrap();
        assert!(p.kernels.iter().all(|k| k.tiles == 1), "{p:?}");
        assert_eq!(p.programs(), 10);
    }
}
