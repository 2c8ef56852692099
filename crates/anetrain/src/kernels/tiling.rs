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
use super::{build_unfilled, KernelKind, KernelOptions, Shape, COLUMN_GROUP};
use crate::model::Projection;

/// Forces tiling (see [`KernelOptions::min_tiles`]).
pub const MIN_TILES_ENV: &str = "ANETRAIN_ANE_MIN_TILES";

/// Forces sequence tiling (see [`KernelOptions::min_seq_tiles`]).
pub const SEQ_TILES_ENV: &str = "ANETRAIN_ANE_SEQ_TILES";

/// `ANETRAIN_ANE_MIN_TILES` as a number (1 when unset or unusable).
pub fn min_tiles_from_env() -> usize {
    count_from_env(MIN_TILES_ENV)
}

/// `ANETRAIN_ANE_SEQ_TILES` as a number (1 when unset or unusable).
pub fn min_seq_tiles_from_env() -> usize {
    count_from_env(SEQ_TILES_ENV)
}

fn count_from_env(var: &str) -> usize {
    std::env::var(var)
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
    /// The model dimension, where a kernel only multiplies along it (its
    /// output, or the reduction of a product).
    Dim,
    /// Blocks of positions. Kernels that treat every position alone
    /// (products with weights, elementwise maths) compute a block of
    /// positions, their results the block's columns of the whole. The
    /// attention backward kernels compute a block of queries against every
    /// key (causal: the keys after the block are masked): what runs along
    /// the queries (q, dA, dq, score rows) is cut, what runs along the keys
    /// (k, v) is read whole, and the keys' gradients (dk, dv) are the sum
    /// of the blocks'.
    Seq,
}

impl Axis {
    pub fn name(self) -> &'static str {
        match self {
            Axis::Hidden => "intermediate size",
            Axis::KvGroups => "KV heads",
            Axis::Dim => "model dimension",
            Axis::Seq => "sequence",
        }
    }

    /// The axis in a column of `kernels plan`.
    pub fn short(self) -> &'static str {
        match self {
            Axis::Hidden => "inter",
            Axis::KvGroups => "kv",
            Axis::Dim => "dim",
            Axis::Seq => "seq",
        }
    }

    /// How many units the axis has at `s`.
    pub fn count(self, s: &Shape) -> usize {
        match self {
            Axis::Hidden => s.hidden,
            Axis::KvGroups => s.kv_heads,
            Axis::Dim => s.dim,
            // Query positions: every position, but for attention's blocks.
            Axis::Seq => s.queries,
        }
    }

    /// The block counts the axis may be cut into at `s`: divisors of its
    /// count, and for the sequence only those leaving blocks a multiple of
    /// [`COLUMN_GROUP`] wide.
    fn block_counts(self, s: &Shape) -> Vec<usize> {
        let n = self.count(s);
        divisors(n)
            .into_iter()
            .filter(|&c| self != Axis::Seq || c == 1 || (n / c).is_multiple_of(COLUMN_GROUP))
            .collect()
    }
}

impl KernelKind {
    /// The axes this kernel's tiles may split, preferred first. A kernel
    /// with a nonlinearity across an axis (softmax over heads' scores,
    /// SiLU of a product summed over the model dimension) cannot split it.
    /// Kernels that treat every position alone may also split the
    /// sequence, last: a block re-sends the weights, so weight axes go
    /// first.
    pub fn tile_axes(self) -> &'static [Axis] {
        use Axis::*;
        match self {
            KernelKind::FfnForward => &[Hidden, Seq],
            KernelKind::FfnBackwardW2 | KernelKind::FfnBackwardW13 => &[Hidden, Dim, Seq],
            KernelKind::SdpaForward | KernelKind::SdpaBackward1 | KernelKind::SdpaBackward2 => {
                &[KvGroups, Seq]
            }
            KernelKind::WoForward
            | KernelKind::WoBackward
            | KernelKind::QBackward
            | KernelKind::KvBackward => &[KvGroups, Dim, Seq],
            // The vocabulary is cut into chunks the host walks
            // ([`HeadChunks`]); a chunk's product treats positions alone.
            KernelKind::HeadForward | KernelKind::HeadBackward => &[Seq],
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
    /// A chunk of the vocabulary (the LM head's rows; never cut by a tile).
    Vocab,
    /// Something every tile reads whole (QK-norm weights, LoRA's rank).
    Whole,
}

impl Extent {
    /// Whether `axis` cuts this extent.
    fn split_by(self, axis: Axis) -> bool {
        match axis {
            Axis::Hidden => self == Extent::Hidden,
            Axis::KvGroups => matches!(self, Extent::Q | Extent::Kv | Extent::Scores),
            Axis::Dim => self == Extent::Dim,
            // Positions run along a port's columns, never its channels.
            Axis::Seq => false,
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
        Xnorm | XnormBlock | X2norm | X2 | Dffn | Dy | O | XNext | Dx | Xf | Dxf => Extent::Dim,
        Logits | Dlogits => Extent::Vocab,
        H1 | H3 | Gate | Dgate | Dh1 | Dh3 => Extent::Hidden,
        Attn | QRope | Da | Dq | QRaw => Extent::Q,
        KRope | V | Dk | Dv | KRaw => Extent::Kv,
        Probs | Dp => Extent::Scores,
        Weight(_) | Head | QNorm | KNorm | LoraA(_) | LoraB(_) | Mask | RopeCos | RopeSin => {
            Extent::Whole
        }
    }
}

/// What an activation port's positions are in a kernel, for cutting it
/// into blocks of positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Positions {
    /// The positions a tile computes: its block of columns.
    Computed,
    /// Keys of attention: every tile reads them all and its results along
    /// them are partial sums.
    Keys,
    /// Score rows `[heads·S, S]`: each head's rows are cut to the block.
    ScoreRows,
    /// Results along the keys that every block computes whole
    /// (`sdpa_forward`'s k and v): the first block's are kept.
    Shared,
    /// Not an activation (weights), or made per tile (the mask).
    None,
}

/// Whether `kind` attends: its sequence blocks are blocks of queries
/// against every key.
fn attends(kind: KernelKind) -> bool {
    matches!(
        kind,
        KernelKind::SdpaForward | KernelKind::SdpaBackward1 | KernelKind::SdpaBackward2
    )
}

fn positions(kind: KernelKind, port: Port) -> Positions {
    use Port::*;
    let attention = attends(kind);
    match port {
        Weight(_) | Head | QNorm | KNorm | LoraA(_) | LoraB(_) | Mask | RopeCos | RopeSin => {
            Positions::None
        }
        Probs | Dp => Positions::ScoreRows,
        KRope | V | KRaw if kind == KernelKind::SdpaForward => Positions::Shared,
        Xnorm | KRope | V | Dk | Dv | KRaw if attention => Positions::Keys,
        _ => Positions::Computed,
    }
}

/// One axis of a kernel's tiling and how many blocks it is cut into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Split {
    pub axis: Axis,
    pub blocks: usize,
}

/// One kernel's tiles: a grid of blocks along one or two axes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelTiles {
    pub kind: KernelKind,
    /// The axes cut, in tile order (tile `t` is row-major over them);
    /// empty when the kernel is not tiled.
    pub splits: Vec<Split>,
    /// How many tiles (1: untiled).
    pub tiles: usize,
    /// The shape every tile's program is generated for.
    pub shape: Shape,
    /// `[channels, width]` of a tile's input and output surfaces.
    pub input: [usize; 2],
    pub output: [usize; 2],
    /// FLOPs of one tile's matrix products (counted from its program).
    pub flop: f64,
}

impl KernelTiles {
    /// Bytes of one tile's input and output surfaces (fp16).
    pub fn surface_bytes(&self) -> (usize, usize) {
        (
            2 * self.input[0] * self.input[1],
            2 * self.output[0] * self.output[1],
        )
    }

    /// Bytes of a tile's larger surface: what the tile-size cap bounds.
    pub fn largest_surface(&self) -> usize {
        let (i, o) = self.surface_bytes();
        i.max(o)
    }

    /// Tile `t`'s block index along each split.
    fn indices(&self, t: usize) -> Vec<(Split, usize)> {
        let mut rest = t;
        let mut out: Vec<(Split, usize)> = self
            .splits
            .iter()
            .rev()
            .map(|&sp| {
                let i = rest % sp.blocks;
                rest /= sp.blocks;
                (sp, i)
            })
            .collect();
        out.reverse();
        out
    }

    /// The split cutting `extent` in tile `t`, with the tile's block along it.
    fn cut(&self, extent: Extent, t: usize) -> Option<(Split, usize)> {
        self.indices(t)
            .into_iter()
            .find(|(sp, _)| extent.split_by(sp.axis))
    }

    /// The sequence split cutting activation `port`'s positions in tile
    /// `t`, with the tile's block of positions.
    fn cut_positions(&self, port: Port, t: usize) -> Option<(Split, usize)> {
        if matches!(
            positions(self.kind, port),
            Positions::None | Positions::Keys | Positions::Shared
        ) {
            return None;
        }
        self.indices(t)
            .into_iter()
            .find(|(sp, _)| sp.axis == Axis::Seq)
    }

    /// Tile `t`'s block of queries (0 when the sequence is not split).
    fn query_block(&self, t: usize) -> usize {
        self.indices(t)
            .iter()
            .find(|(sp, _)| sp.axis == Axis::Seq)
            .map_or(0, |&(_, i)| i)
    }

    /// Whether tile `t` is at block 0 of every split a sum runs over (every
    /// split but the sequence's, whose blocks hold other positions).
    fn first_of_sums(&self, t: usize) -> bool {
        self.indices(t)
            .iter()
            .all(|&(sp, i)| i == 0 || sp.axis == Axis::Seq)
    }
}

/// The tiling of every kernel for one model shape and device limits.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub shape: Shape,
    /// The device limits planned for.
    pub limits: ane::family::Limits,
    /// The LM head's vocabulary chunks.
    pub head: HeadChunks,
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

    /// How many units `kind` runs for in a model of `layers` layers: the
    /// layers, or for the head kernels the vocabulary chunks.
    pub fn units(&self, kind: KernelKind, layers: usize) -> usize {
        match kind.is_head() {
            true => self.head.chunks,
            false => layers,
        }
    }

    /// Distinct programs to compile for one sequence length (one per
    /// kernel: tiles share theirs).
    pub fn programs(&self) -> usize {
        self.kernels.len()
    }

    /// Device evaluations per layer for one forward and backward pass.
    pub fn evaluations_per_layer(&self) -> usize {
        self.work_per_layer(false).1
    }

    /// FLOPs and evaluations on the device per layer for one forward and
    /// backward pass; `recompute` (activation checkpointing) runs the
    /// forward kernels twice.
    pub fn work_per_layer(&self, recompute: bool) -> (f64, usize) {
        self.work(|k| match (k.is_head(), recompute && k.is_forward()) {
            (true, _) => 0,
            (false, true) => 2,
            (false, false) => 1,
        })
    }

    /// FLOPs and evaluations of the LM head on the device for one
    /// sequence: each chunk's forward once, and with a `gradient` its
    /// backward once and (over several chunks) its forward again — the
    /// first pass gathers the softmax statistics, the second forms the
    /// logits' gradient (see `engine::head_loss`).
    pub fn head_work(&self, gradient: bool) -> (f64, usize) {
        let c = self.head.chunks;
        self.work(|k| match (k, gradient) {
            (KernelKind::HeadForward, true) if c > 1 => 2 * c,
            (KernelKind::HeadForward, _) | (KernelKind::HeadBackward, true) => c,
            _ => 0,
        })
    }

    /// Σ over kernels of `runs(kind)` × tiles × one tile's FLOPs, and the
    /// evaluations; the layer kernels and the head's are counted apart.
    fn work(&self, runs: impl Fn(KernelKind) -> usize) -> (f64, usize) {
        self.kernels.iter().fold((0.0, 0), |(f, n), k| {
            let r = runs(k.kind) * k.tiles;
            (f + r as f64 * k.flop, n + r)
        })
    }
}

/// The tile shape for `splits` of `full`: a block of the sequence is a
/// block of the positions computed, and for attention a block of queries
/// against every key.
pub fn tile_shape(kind: KernelKind, full: &Shape, splits: &[Split]) -> Shape {
    let mut s = *full;
    for sp in splits {
        match sp.axis {
            Axis::Hidden => s.hidden /= sp.blocks,
            Axis::KvGroups => {
                s.heads /= sp.blocks;
                s.kv_heads /= sp.blocks;
            }
            Axis::Dim => s.dim /= sp.blocks,
            Axis::Seq => {
                s.queries /= sp.blocks;
                if !attends(kind) {
                    s.seq /= sp.blocks;
                }
            }
        }
    }
    s
}

/// The divisors of `n`, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|t| n.is_multiple_of(*t)).collect()
}

/// The tilings `kind` may take, fewest tiles first (and among equals, the
/// fewest cuts of later axes): every combination of block counts that
/// divide their axes.
fn candidates(kind: KernelKind, full: &Shape, o: &KernelOptions) -> Vec<Vec<Split>> {
    if o.seed_compat {
        // Seed-compatible layouts pass values through that tiles would sum.
        return vec![vec![]];
    }
    let axes = kind.tile_axes();
    let mut grids: Vec<Vec<Split>> = vec![vec![]];
    for &axis in axes {
        let mut counts = axis.block_counts(full);
        // Forced tiling: at least `min_tiles` blocks of every weight axis
        // the kernel may split, `min_seq_tiles` of the sequence (or as
        // many as the axis has), so grids of two axes run too.
        let forced = match axis {
            Axis::Seq => o.min_seq_tiles,
            _ => o.min_tiles,
        };
        if forced > 1 {
            let floor = forced.min(*counts.last().unwrap_or(&1));
            counts.retain(|&c| c >= floor);
        }
        grids = grids
            .into_iter()
            .flat_map(|g| {
                counts.iter().map(move |&c| {
                    let mut g = g.clone();
                    if c > 1 {
                        g.push(Split { axis, blocks: c });
                    }
                    g
                })
            })
            .collect();
    }
    let tiles = |g: &Vec<Split>| g.iter().map(|s| s.blocks).product::<usize>();
    grids.sort_by_key(|g| {
        let seq: usize = g
            .iter()
            .filter(|s| s.axis == Axis::Seq)
            .map(|s| s.blocks)
            .product();
        let later: usize = g.iter().skip(1).map(|s| s.blocks).product();
        (tiles(g), seq, later)
    });
    grids.dedup();
    grids
}

/// Plans every kernel: the fewest equal tiles whose program passes every
/// rule the device's limits `o.limits` imply ([`ane::rules::RuleSet::for_limits`]:
/// per-axis caps, contraction multiples, …) with surfaces within
/// `o.max_tile_bytes`; failing the size, the passing tiling with the
/// smallest largest surface; failing the rules, the fewest tiles that at
/// least fit the axis caps. The LM head's kernels are planned with its
/// vocabulary chunks ([`plan_head`]). An error names the kernel, the axes
/// and the caps when no tiling fits.
pub fn plan(full: &Shape, o: &KernelOptions) -> Result<Plan, PlanError> {
    let rules = ane::rules::RuleSet::for_limits(o.limits);
    let mut kernels = Vec::new();
    for kind in KernelKind::ALL.into_iter().filter(|k| !k.is_head()) {
        kernels.push(plan_kernel(kind, full, o, &rules)?.0);
    }
    let (head, head_kernels) = plan_head(full, o, &rules)?;
    kernels.extend(head_kernels);
    Ok(Plan {
        shape: *full,
        limits: o.limits,
        head,
        kernels,
    })
}

/// How the LM head's vocabulary is cut: `chunks` chunks of `rows` rows
/// (a multiple of 32, the contraction multiple `head_backward` needs; the
/// last chunk's rows past the vocabulary are zeros on the device). The
/// host walks the chunks, keeping softmax statistics per position, so no
/// more than one chunk's logits exist at once: maderix/ANE PR #26 ran
/// Qwen3's 151936-token head on the Neural Engine in 16 chunks because it
/// "exceeds ANE's 65536 max dim".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HeadChunks {
    pub rows: usize,
    pub chunks: usize,
}

impl HeadChunks {
    /// `chunks` chunks of at most `rows` rows over `vocab` rows.
    pub fn of(vocab: usize, rows: usize) -> HeadChunks {
        HeadChunks {
            rows,
            chunks: vocab.div_ceil(rows.max(1)),
        }
    }

    /// The vocabulary rows of chunk `c` in a vocabulary of `vocab`.
    pub fn range(&self, c: usize, vocab: usize) -> std::ops::Range<usize> {
        (c * self.rows).min(vocab)..((c + 1) * self.rows).min(vocab)
    }
}

/// The vocabulary chunks (at least `o.min_tiles`, to exercise chunking on
/// small vocabularies) for which both head kernels find a tiling within
/// the rules and `o.max_tile_bytes` in the fewest evaluations per
/// sequence (a chunk's sequence tiles count too), and those tilings. Only the counts whose rows change are tried, from the fewest the
/// head's weights alone allow under the size cap.
pub fn plan_head(
    full: &Shape,
    o: &KernelOptions,
    rules: &ane::rules::RuleSet,
) -> Result<(HeadChunks, Vec<KernelTiles>), PlanError> {
    let v = full.vocab;
    let rows_of = |chunks: usize| v.div_ceil(chunks).div_ceil(COLUMN_GROUP) * COLUMN_GROUP;
    let most = v.div_ceil(COLUMN_GROUP).max(1);
    // A chunk's weights `[rows, D]` in fp16 must fit the cap by themselves.
    let fewest = o
        .max_tile_bytes
        .map_or(1, |cap| (2 * v * full.dim).div_ceil(cap.max(1)))
        .max(o.min_tiles)
        .clamp(1, most);
    // Failing the cap at every count: the fewest chunks whose tilings pass
    // the rules, else the fewest that fit the axis caps.
    let (mut over_cap, mut fits_dim) = (None, None);
    let mut best: Option<(usize, (HeadChunks, Vec<KernelTiles>))> = None;
    let mut last_error = None;
    let mut tried = 0;
    for chunks in fewest..=most {
        // Past twice the fewest chunks that fit, more chunks only add
        // evaluations.
        if best
            .as_ref()
            .is_some_and(|(_, (h, _))| chunks > 2 * h.chunks)
        {
            break;
        }
        let rows = rows_of(chunks);
        if rows == tried {
            continue;
        }
        tried = rows;
        let shape = full.head_chunk(rows);
        let planned: Result<Vec<_>, PlanError> =
            [KernelKind::HeadForward, KernelKind::HeadBackward]
                .into_iter()
                .map(|kind| plan_kernel(kind, &shape, o, rules))
                .collect();
        let planned = match planned {
            Ok(p) => p,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        let worst = planned
            .iter()
            .map(|(_, fit)| *fit)
            .max()
            .unwrap_or(Fit::Within);
        let found: (HeadChunks, Vec<KernelTiles>) = (
            HeadChunks::of(v, rows),
            planned.into_iter().map(|(t, _)| t).collect(),
        );
        match worst {
            Fit::Within => {
                // Evaluations per sequence with a gradient: each chunk's
                // forward twice and its backward (see `Plan::head_work`).
                let e = found.0.chunks * (2 * found.1[0].tiles + found.1[1].tiles);
                if best.as_ref().is_none_or(|(b, _)| e < *b) {
                    best = Some((e, found));
                }
            }
            Fit::OverCap => _ = over_cap.get_or_insert(found),
            Fit::AxisCaps => _ = fits_dim.get_or_insert(found),
        }
    }
    best.map(|(_, f)| f)
        .or(over_cap)
        .or(fits_dim)
        .ok_or_else(|| last_error.unwrap_or(PlanError::NoHeadChunks { vocab: v }))
}

/// How well a kernel's chosen tiling fits the device (best first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fit {
    /// Every rule passes and the surfaces are within the tile cap.
    Within,
    /// Every rule passes; a surface is over the cap.
    OverCap,
    /// Only the axis caps hold.
    AxisCaps,
}

/// Why a shape cannot be tiled for the device, with the numbers that
/// decide it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A tile's program could not be built.
    #[error("{kernel}: {message}")]
    Build {
        kernel: &'static str,
        message: String,
    },
    /// No split of the kernel's tiled axes fits the device's axis caps.
    #[error(
        "{kernel}: no tiling fits the device's axis caps (spatial {max_spatial}, channel {max_channel}; {env} sets both): split as far as {axes} allow{plural}, {problem}{keys}",
        env = ane::rules::MAX_DIM_ENV,
        axes = .axes.iter().map(|(a, n)| format!("the {a} ({n})")).collect::<Vec<_>>().join(" and "),
        plural = if .axes.len() == 1 { "s" } else { "" },
        keys = .attends_over.map_or(String::new(), |seq| format!("; attention reads all {seq} keys in every tile, so the sequence (and, in sdpa_forward, a tile's weights beside it) must fit the spatial cap: use a shorter --seq")),
    )]
    NoTiling {
        kernel: &'static str,
        max_spatial: usize,
        max_channel: usize,
        /// The axes the kernel tiles, with their extents.
        axes: Vec<(&'static str, usize)>,
        /// The last rule finding (the `max-dim` rule's message).
        problem: String,
        /// The sequence length, for a kernel whose tiles read every key.
        attends_over: Option<usize>,
    },
    /// The vocabulary offers no chunk count to try.
    #[error("lm_head: no vocabulary chunking of {vocab} rows to try")]
    NoHeadChunks { vocab: usize },
}

/// One kernel's tiling at `full` (see [`plan`]), and how well it fits.
fn plan_kernel(
    kind: KernelKind,
    full: &Shape,
    o: &KernelOptions,
    rules: &ane::rules::RuleSet,
) -> Result<(KernelTiles, Fit), PlanError> {
    let mut fits_dim = None;
    let mut passing: Vec<KernelTiles> = vec![];
    let mut last_problem = String::new();
    for splits in candidates(kind, full, o) {
        let shape = tile_shape(kind, full, &splits);
        if !shape.query_rows_whole() {
            continue;
        }
        let k = build_unfilled(kind, &shape, o).map_err(|e| PlanError::Build {
            kernel: kind.name(),
            message: e.to_string(),
        })?;
        let findings = ane::rules::check(&k.program, rules);
        if let Some(f) = findings.iter().find(|f| f.rule == "max-dim") {
            last_problem = f.message.clone();
            continue;
        }
        let l = &k.layout;
        let tiles = KernelTiles {
            kind,
            tiles: splits.iter().map(|s| s.blocks).product(),
            splits,
            shape,
            input: [l.in_channels, l.in_spatial],
            output: [l.out_channels, l.out_spatial],
            flop: k.program.functions.iter().map(|f| f.matmul_flops()).sum(),
        };
        let small_enough = o
            .max_tile_bytes
            .is_none_or(|cap| tiles.largest_surface() <= cap);
        if findings.is_empty() && small_enough {
            return Ok((tiles, Fit::Within));
        }
        if findings.is_empty() {
            // Passes every rule but is larger than asked: a fallback
            // when no tiling meets the cap.
            passing.push(tiles);
            continue;
        }
        fits_dim.get_or_insert(tiles);
    }
    // Failing the cap, the fewest tiles (candidates come fewest
    // first) within a quarter of the smallest surface that passes:
    // where what every tile reads whole dominates (a whole sequence's
    // keys), more tiles would add evaluations and shrink nothing.
    let smallest = passing.iter().map(KernelTiles::largest_surface).min();
    let fallback = smallest.and_then(|m| {
        passing
            .into_iter()
            .find(|t| 4 * t.largest_surface() <= 5 * m)
    });
    if let Some(t) = fallback {
        return Ok((t, Fit::OverCap));
    }
    if let Some(t) = fits_dim {
        return Ok((t, Fit::AxisCaps));
    }
    // Attention reads every key in every tile: the sequence is bounded by
    // the spatial cap, less what a tile lays beside the keys
    // (`sdpa_forward`: its weights).
    Err(PlanError::NoTiling {
        kernel: kind.name(),
        max_spatial: o.limits.max_spatial,
        max_channel: o.limits.max_channel,
        axes: kind
            .tile_axes()
            .iter()
            .map(|a| (a.name(), a.count(full)))
            .collect(),
        problem: last_problem,
        attends_over: attends(kind).then_some(full.seq),
    })
}

/// Block `i` of `n` equal row blocks of a row-major `[rows, cols]` tensor.
fn row_block(data: &[f32], rows: usize, i: usize, n: usize) -> Vec<f32> {
    let cols = data.len() / rows.max(1);
    let per = rows / n;
    data[i * per * cols..(i + 1) * per * cols].to_vec()
}

/// Block `i` of `n` equal column blocks of a row-major `[rows, cols]` tensor.
fn col_block(data: &[f32], cols: usize, i: usize, n: usize) -> Vec<f32> {
    let per = cols / n;
    data.chunks(cols)
        .flat_map(|row| &row[i * per..(i + 1) * per])
        .copied()
        .collect()
}

/// `[rows, cols]` cut by the splits of `k` in tile `t` along its rows
/// (extent `re`) and columns (extent `ce`).
fn block(k: &KernelTiles, t: usize, data: &[f32], rows: usize, re: Extent, ce: Extent) -> Vec<f32> {
    let cols = data.len() / rows.max(1);
    let mut v = match k.cut(re, t) {
        Some((sp, i)) => row_block(data, rows, i, sp.blocks),
        None => data.to_vec(),
    };
    if let Some((sp, i)) = k.cut(ce, t) {
        v = col_block(&v, cols, i, sp.blocks);
    }
    v
}

/// The weights of tile `t` of `k` from the full layer's weights `w`
/// (tensors by port, as [`super::LayerWeights::from_tensors`] reads): the
/// blocks of the projections the kernel applies, and no others.
pub fn tile_weights(k: &KernelTiles, full: &Shape, w: &super::LayerWeights, t: usize) -> Tensors {
    let mut out = Tensors::new();
    for &(p, _) in k.kind.projections() {
        let (oe, ie) = projection_extents(p);
        let (rows, cols) = full.projection(p);
        let base = w.projection(p);
        if !base.is_empty() {
            out.insert(Port::Weight(p), block(k, t, base, rows, oe, ie));
        }
        if let Some((a, b)) = w.adapters[p.index()] {
            let r = a.len() / cols;
            out.insert(Port::LoraA(p), block(k, t, a, r, Extent::Whole, ie));
            out.insert(Port::LoraB(p), block(k, t, b, rows, oe, Extent::Whole));
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

/// Tile `t`'s block of projection `p`'s weight (`[out, in]` of the full
/// shape `full`), read from `param` — f32, or kept in the file's dtype —
/// converting only the block's rows and columns.
pub fn projection_block(
    k: &KernelTiles,
    full: &Shape,
    t: usize,
    p: Projection,
    param: &crate::model::params::Param,
) -> Vec<f32> {
    let (oe, ie) = projection_extents(p);
    let (rows, cols) = full.projection(p);
    let range = |extent: Extent, n: usize| match k.cut(extent, t) {
        Some((sp, i)) => i * n / sp.blocks..(i + 1) * n / sp.blocks,
        None => 0..n,
    };
    let mut out = Vec::new();
    param.block_into(range(oe, rows), range(ie, cols), &mut out);
    out
}

/// Tile `t`'s blocks of projection `p`'s LoRA `A [r, in]` and `B [out, r]`.
pub fn adapter_blocks(
    k: &KernelTiles,
    full: &Shape,
    t: usize,
    p: Projection,
    (a, b): (&[f32], &[f32]),
) -> (Vec<f32>, Vec<f32>) {
    let (oe, ie) = projection_extents(p);
    let (rows, cols) = full.projection(p);
    let r = a.len() / cols;
    (
        block(k, t, a, r, Extent::Whole, ie),
        block(k, t, b, rows, oe, Extent::Whole),
    )
}

/// Tile `t`'s part of activation `port` (`[C, seq]` row-major, `seq` the
/// whole sequence): its channel block when a split cuts the port, else
/// every channel; its block of positions when the sequence is split, else
/// every position. The residual `x2` enters once: in the tiles at block 0
/// of every split a sum runs over, zeros in the others, whose partial sums
/// must not add it again.
pub fn tile_activation(
    k: &KernelTiles,
    port: Port,
    data: &[f32],
    seq: usize,
    t: usize,
) -> Vec<f32> {
    let mut v = match k.cut(activation_extent(port), t) {
        Some((sp, i)) => row_block(data, data.len() / seq, i, sp.blocks),
        None => data.to_vec(),
    };
    if let Some((sp, i)) = k.cut_positions(port, t) {
        v = match positions(k.kind, port) {
            // Each head's `[S, S]` rows: the block's rows, whole.
            Positions::ScoreRows => v
                .chunks(seq * seq)
                .flat_map(|head| row_block(head, seq, i, sp.blocks))
                .collect(),
            _ => col_block(&v, seq, i, sp.blocks),
        };
    }
    if port == Port::X2 && !k.first_of_sums(t) {
        v.fill(0.0);
    }
    v
}

/// The additive causal mask of tile `t`'s block of queries against all
/// `seq` keys, `[queries, seq]`: query `lo + r` sees keys `0..=lo + r`
/// (as [`super::causal_mask`] for the whole).
pub fn tile_mask(k: &KernelTiles, seq: usize, t: usize) -> Vec<f32> {
    let qb = k.shape.queries;
    let lo = k.query_block(t) * qb;
    let mut m = vec![0f32; qb * seq];
    for (r, row) in m.chunks_mut(seq).enumerate() {
        row[lo + r + 1..].fill(super::MASKED);
    }
    m
}

/// RoPE's angles (cos, sin) at tile `t`'s block of queries, `[queries,
/// HD]` each: rows of the whole `[seq, HD]` tables `(cos, sin)`.
pub fn tile_rope(k: &KernelTiles, (cos, sin): (&[f32], &[f32]), t: usize) -> (Vec<f32>, Vec<f32>) {
    let (qb, hd) = (k.shape.queries, k.shape.head_dim);
    let at = k.query_block(t) * qb * hd;
    (
        cos[at..at + qb * hd].to_vec(),
        sin[at..at + qb * hd].to_vec(),
    )
}

/// Adds tile `t`'s result for `port` (`[c, w]`, `w` the tile's positions)
/// into the full result `acc` (zeros of the full size on the first tile):
/// at its channel block when a split cuts the port, at its block of
/// positions when the sequence is split — concatenation along cut axes, a
/// sum over the others.
pub fn combine(k: &KernelTiles, port: Port, acc: &mut Vec<f32>, part: Vec<f32>, t: usize) {
    let rows_cut = k.cut(activation_extent(port), t);
    let pos_cut = k.cut_positions(port, t);
    let (nr, np) = (
        rows_cut.map_or(1, |(sp, _)| sp.blocks),
        pos_cut.map_or(1, |(sp, _)| sp.blocks),
    );
    if t == 0 {
        *acc = vec![0.0; part.len() * nr * np];
    }
    let along = positions(k.kind, port);
    if along == Positions::Shared && k.query_block(t) > 0 {
        return;
    }
    let scores = along == Positions::ScoreRows;
    // The part as `[rows, w]` placed at row r0, column c0 of the whole
    // `[.., width]`; score rows go head by head.
    let w = match along {
        Positions::ScoreRows | Positions::Keys | Positions::Shared => k.shape.seq,
        _ => k.shape.queries,
    };
    let width = if scores { w } else { w * np };
    let c = part.len() / w;
    let r0 = rows_cut.map_or(0, |(_, i)| i * c * if scores { np } else { 1 });
    let c0 = match scores {
        true => 0,
        false => pos_cut.map_or(0, |(_, i)| i * w),
    };
    let qb = k.shape.queries;
    for (r, src) in part.chunks(w).enumerate() {
        let row = match (scores, pos_cut) {
            (true, Some((_, i))) => r0 + (r / qb) * qb * np + i * qb + r % qb,
            _ => r0 + r,
        };
        acc[row * width + c0..][..w]
            .iter_mut()
            .zip(src)
            .for_each(|(a, p)| *a += p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;

    #[test]
    fn blocks_cut_rows_and_columns() {
        let m: Vec<f32> = (0..12).map(|i| i as f32).collect(); // [3, 4]
        assert_eq!(col_block(&m, 4, 1, 2), vec![2., 3., 6., 7., 10., 11.]);
        let m: Vec<f32> = (0..8).map(|i| i as f32).collect(); // [4, 2]
        assert_eq!(row_block(&m, 4, 1, 2), vec![4., 5., 6., 7.]);
    }

    #[test]
    fn grids_cut_weights_on_both_axes_and_results_concatenate_or_sum() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let full = Shape::new(&cfg, 4);
        let splits = vec![
            Split {
                axis: Axis::Hidden,
                blocks: 2,
            },
            Split {
                axis: Axis::Dim,
                blocks: 4,
            },
        ];
        let k = KernelTiles {
            kind: KernelKind::FfnBackwardW13,
            tiles: 8,
            shape: tile_shape(KernelKind::FfnBackwardW13, &full, &splits),
            splits,
            input: [0, 0],
            output: [0, 0],
            flop: 0.0,
        };
        assert_eq!((k.shape.hidden, k.shape.dim), (192, 32));
        // Tile 5 = hidden block 1, dim block 1.
        assert_eq!(k.indices(5).iter().map(|x| x.1).collect::<Vec<_>>(), [1, 1]);
        let (h, d) = (full.hidden, full.dim);
        let w1: Vec<f32> = (0..h * d).map(|i| i as f32).collect();
        let mut w = crate::kernels::LayerWeights::default();
        let empty: &[f32] = &[];
        w.projections = [empty; 7];
        w.projections[Projection::Gate.index()] = &w1;
        let tw = tile_weights(&k, &full, &w, 5);
        let got = &tw[&Port::Weight(Projection::Gate)];
        assert_eq!(got.len(), 192 * 32);
        // Row 192 (first of hidden block 1), column 32 (first of dim block 1).
        assert_eq!(got[0], (192 * d + 32) as f32);
        // dx is cut along dim and summed over hidden blocks.
        let mut acc = vec![];
        for t in 0..8 {
            combine(&k, Port::Dx, &mut acc, vec![1.0; 32 * 4], t);
        }
        assert_eq!(acc, vec![2.0; d * 4]);
    }

    #[test]
    fn an_untiled_model_plans_one_tile_per_kernel() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let p = plan(&Shape::new(&cfg, 64), &KernelOptions::hf(&cfg)).unwrap();
        assert!(p.kernels.iter().all(|k| k.tiles == 1), "{p:?}");
        // Ten layer kernels and the head's two, its vocabulary one chunk.
        assert_eq!(p.programs(), 12);
        assert_eq!(
            p.head,
            HeadChunks {
                rows: 512,
                chunks: 1
            }
        );
    }
}
