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
//! The plan is data, computed here and only here ([`plan`], in `plan.rs`):
//! for each kernel the tiling whose program passes the device rules (the
//! `max-dim` limit in particular) within the tile cap in the fewest
//! evaluations. Cutting a tile's inputs out of the whole and combining its
//! results is `cut.rs`; this file holds the data both share (axes,
//! extents, splits, the plan, the head's chunks).

mod cut;
mod plan;

pub use cut::*;
pub use plan::*;

use serde::Serialize;

use super::io::Port;
use super::{KernelKind, KernelOptions, Shape, COLUMN_GROUP};
use crate::model::Projection;

/// Forces tiling (see [`KernelOptions::min_tiles`]).
pub const MIN_TILES_ENV: &str = "ANETRAIN_ANE_MIN_TILES";

/// Forces sequence tiling (see [`KernelOptions::min_seq_tiles`]).
pub const SEQ_TILES_ENV: &str = "ANETRAIN_ANE_SEQ_TILES";

/// `pair` runs the attention backward as `sdpa_backward1`/`sdpa_backward2`
/// even where the plan would fuse it (see
/// [`KernelOptions::fuse_attention_backward`]): the two forms compared on a
/// chip, where the cost model's working-set assumption meets the device.
pub const ATTENTION_BACKWARD_ENV: &str = "ANETRAIN_ANE_ATTENTION_BACKWARD";

/// Whether [`ATTENTION_BACKWARD_ENV`] leaves the fused form allowed
/// (`fused`, the default) or asks for the pair, or what is wrong with it.
pub fn fuse_attention_backward_from_env() -> Result<bool, String> {
    match std::env::var(ATTENTION_BACKWARD_ENV) {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "" | "fused" => Ok(true),
            "pair" => Ok(false),
            other => Err(format!(
                "{ATTENTION_BACKWARD_ENV}={other}: use 'fused' (the default: the cost model chooses) or 'pair'"
            )),
        },
    }
}

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
        Weight(_) | Bias(_) | Head | QNorm | KNorm | LoraA(_) | LoraB(_) | Mask | RopeCos
        | RopeSin => Extent::Whole,
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
    /// (`sdpa_forward`'s k and v): the last block's (every key) are kept.
    Shared,
    /// Not an activation (weights), or made per tile (the mask).
    None,
}

/// Whether `kind` attends: its sequence blocks are blocks of queries
/// against every key.
fn attends(kind: KernelKind) -> bool {
    matches!(
        kind,
        KernelKind::SdpaForward
            | KernelKind::SdpaBackward1
            | KernelKind::SdpaBackward2
            | KernelKind::SdpaBackward
    )
}

fn positions(kind: KernelKind, port: Port) -> Positions {
    use Port::*;
    let attention = attends(kind);
    match port {
        Weight(_) | Bias(_) | Head | QNorm | KNorm | LoraA(_) | LoraB(_) | Mask | RopeCos
        | RopeSin => Positions::None,
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
    /// FLOPs of one tile's matrix products (counted from its program; the
    /// whole's where [`KernelTiles::keys`] gives the tiles programs of
    /// their own, see [`KernelTiles::total_flop`]).
    pub flop: f64,
    /// Bytes (fp16) of a tile's input surface that hold weights (staged
    /// once per optimizer step in persistent buffers, per evaluation in
    /// streamed ones); the rest is activations, written per evaluation.
    pub weight_bytes: usize,
    /// Bytes (fp16) of score matrices a tile keeps inside its program
    /// where the program it replaces had them in surfaces: the fused
    /// attention backward's P, dP and dS (`sdpa_backward1` outputs P and
    /// dP, `sdpa_backward2` reads them), so both forms' working sets count
    /// the same matrices against the on-chip memory.
    pub scratch_bytes: usize,
    /// Causal key classes, shortest first (empty: every tile reads every
    /// key, one program): a block of queries reads only the keys up to
    /// the next power-of-two multiple of its end, the rest being masked
    /// for every query in it. The last class is the whole (`shape`).
    pub keys: Vec<KeyClass>,
}

/// The program of the tiles whose blocks of queries read the first
/// `shape.seq` keys (see [`KernelTiles::keys`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeyClass {
    pub shape: Shape,
    pub input: [usize; 2],
    pub output: [usize; 2],
    pub flop: f64,
    pub scratch_bytes: usize,
    /// How many of the kernel's tiles run it.
    pub tiles: usize,
}

/// Key classes a kernel's blocks of queries are grouped into at most:
/// each is a program, and a process compiles about 119
/// (`ane::DEFAULT_COMPILE_BUDGET`). With three, `eval` over every
/// power-of-two length up to 8192 compiles at most 114 programs for every
/// model shape here (`testdata/configs`), on every family (120 for
/// Qwen3-4B on the M1 with a class per power of two); the shortest
/// blocks then read the first class's keys (at 16 blocks, 0.69 of the
/// keys on average where a class per power of two reads 0.67).
pub const MAX_KEY_CLASSES: usize = 3;

/// The key class of query block `i` of `blocks` (see
/// [`KernelTiles::keys`]): block `i` ends at query `(i + 1)·qb` and reads
/// the keys up to the next power of two of `i + 1` blocks — so that a
/// block's `[C, qb]` still fills whole rows of its `keys`-wide surface
/// (`Shape::query_rows_whole`) — the shortest classes merged into the
/// first of the last [`MAX_KEY_CLASSES`].
pub fn key_class(i: usize, blocks: usize) -> usize {
    let pow2 = |i: usize| (i + 1).next_power_of_two().trailing_zeros() as usize;
    pow2(i).max(first_key_class(blocks)) - first_key_class(blocks)
}

/// Keys read by key class `c` of `blocks` blocks of `qb` queries over
/// `seq` keys.
pub fn class_keys(c: usize, blocks: usize, qb: usize, seq: usize) -> usize {
    (qb << (c + first_key_class(blocks))).min(seq)
}

/// The power of two (in blocks) of the shortest class kept.
fn first_key_class(blocks: usize) -> usize {
    let last = blocks.max(1).next_power_of_two().trailing_zeros() as usize;
    (last + 1).saturating_sub(MAX_KEY_CLASSES)
}

impl KernelTiles {
    /// The tiles' programs: one, or one per key class, each as the
    /// tiles of a kernel of its own shape (the splits and tile count
    /// stay the kernel's, so a tile's blocks are cut as before).
    pub fn programs(&self) -> Vec<KernelTiles> {
        if self.keys.is_empty() {
            return vec![self.clone()];
        }
        (0..self.keys.len()).map(|c| self.program(c)).collect()
    }

    /// Key class `c`'s program as tiles of its shape.
    fn program(&self, c: usize) -> KernelTiles {
        let kc = &self.keys[c];
        KernelTiles {
            shape: kc.shape,
            input: kc.input,
            output: kc.output,
            flop: kc.flop,
            scratch_bytes: kc.scratch_bytes,
            keys: vec![],
            ..self.clone()
        }
    }

    /// FLOPs of every tile once.
    pub fn total_flop(&self) -> f64 {
        match self.keys.is_empty() {
            true => self.tiles as f64 * self.flop,
            false => self.keys.iter().map(|kc| kc.tiles as f64 * kc.flop).sum(),
        }
    }

    /// Which of [`KernelTiles::programs`] tile `t` runs.
    pub fn program_of(&self, t: usize) -> usize {
        match self.keys.is_empty() {
            true => 0,
            false => key_class(self.query_block(t), self.query_blocks()),
        }
    }

    /// Bytes of one tile's input and output surfaces (fp16).
    pub fn surface_bytes(&self) -> (usize, usize) {
        (
            2 * self.input[0] * self.input[1],
            2 * self.output[0] * self.output[1],
        )
    }

    /// Predicted cost of every tile once under `rates` (staging the
    /// activations, and the weights too when `streamed`; dispatch;
    /// compute; reading the outputs): what plans are chosen by, and what
    /// a step's timeline adds up (`plan::timeline`).
    pub fn predicted(&self, rates: &ane::cost::Rates, streamed: bool) -> TileCost {
        if !self.keys.is_empty() {
            // Each key class's tiles at its program's cost.
            return self
                .keys
                .iter()
                .enumerate()
                .map(|(c, kc)| {
                    let one = KernelTiles {
                        tiles: kc.tiles,
                        ..self.program(c)
                    };
                    one.predicted(rates, streamed)
                })
                .fold(TileCost::default(), |a, b| TileCost {
                    dispatch_ms: a.dispatch_ms + b.dispatch_ms,
                    device_ms: a.device_ms + b.device_ms,
                    staging_ms: a.staging_ms + b.staging_ms,
                });
        }
        let (inp, out) = self.surface_bytes();
        let staged = match streamed {
            true => inp,
            false => inp - self.weight_bytes,
        };
        let e = rates.evaluation_of(self.flop, (inp + out) as f64, self.scratch_bytes as f64);
        let n = self.tiles as f64;
        TileCost {
            dispatch_ms: n * e.dispatch_ms,
            device_ms: n * e.device_ms,
            staging_ms: n * (rates.copy_ms((staged + out) as f64) + rates.fitted.host_ms_per_eval),
        }
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

    /// Blocks of queries (or positions) the sequence is cut into.
    fn query_blocks(&self) -> usize {
        self.splits
            .iter()
            .find(|s| s.axis == Axis::Seq)
            .map_or(1, |s| s.blocks)
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

/// Predicted milliseconds of a kernel's tiles (see [`KernelTiles::predicted`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TileCost {
    pub dispatch_ms: f64,
    pub device_ms: f64,
    pub staging_ms: f64,
}

impl TileCost {
    pub fn total(&self) -> f64 {
        self.dispatch_ms + self.device_ms + self.staging_ms
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
    /// Which programs run the attention backward.
    pub attention_backward: AttentionBackward,
    /// Every kernel's tiling, those the step does not run among them
    /// ([`Plan::in_use`]): any kernel can be generated and checked.
    pub kernels: Vec<KernelTiles>,
}

/// How a layer's attention backward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum AttentionBackward {
    /// `sdpa_backward1`, then `sdpa_backward2` on its P and dP (handed
    /// from one output surface to the next input through the host): whole
    /// layers, and the seed's programs.
    Pair,
    /// `sdpa_backward`, one program per tile with P and dP kept on the
    /// device: a tiled attention backward, where the cost model predicts
    /// it faster than the pair.
    Fused,
}

impl Plan {
    /// Whether a training step runs `kind`: the plan has it (the kernels
    /// of the layer's parts and the head's) and it is not the attention
    /// backward's form the plan set aside.
    pub fn in_use(&self, kind: KernelKind) -> bool {
        use KernelKind::*;
        self.kernels.iter().any(|k| k.kind == kind)
            && match kind {
                SdpaBackward1 | SdpaBackward2 => self.attention_backward == AttentionBackward::Pair,
                SdpaBackward => self.attention_backward == AttentionBackward::Fused,
                _ => true,
            }
    }

    /// The tilings of the kernels a step runs, in schedule order.
    pub fn used(&self) -> impl Iterator<Item = &KernelTiles> {
        self.kernels.iter().filter(|k| self.in_use(k.kind))
    }

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
        self.used().map(|k| k.keys.len().max(1)).sum()
    }

    /// [`Plan::programs`] for a model whose layers are of `classes`: a
    /// program holding a constant that differs between classes is
    /// compiled once per distinct value (`NeuralKernels` compiles one per
    /// distinct text). sdpa_forward holds its keys' RoPE tables
    /// ([`LayerClass::rope`](crate::model::layer::LayerClass), its base);
    /// the
    /// attention kernels hold their causal mask, and with it the window,
    /// unless their queries come in blocks (then the mask is an input).
    pub fn programs_for(&self, classes: &[crate::model::layer::LayerClass]) -> usize {
        use KernelKind::*;
        let per_program = |k: &KernelTiles, p: &KernelTiles| {
            let rope = k.kind == SdpaForward;
            let attends = matches!(k.kind, SdpaForward | SdpaBackward1 | SdpaBackward);
            let mask = attends && !p.shape.query_block();
            let mut variants = vec![];
            for c in classes {
                let v = (
                    rope.then_some((c.rope, c.local_rope)),
                    mask.then_some(c.window),
                );
                if !variants.contains(&v) {
                    variants.push(v);
                }
            }
            variants.len().max(1)
        };
        self.used()
            .map(|k| {
                k.programs()
                    .iter()
                    .map(|p| per_program(k, p))
                    .sum::<usize>()
            })
            .sum()
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

    /// FLOPs and evaluations on the device per layer for one forward
    /// alone (an evaluation, or DPO's reference).
    pub fn forward_work_per_layer(&self) -> (f64, usize) {
        self.work(|k| (!k.is_head() && k.is_forward()) as usize)
    }

    /// FLOPs and evaluations of the LM head on the device for one
    /// sequence computing `pass` (see [`HeadPass`]).
    pub fn head_work(&self, pass: HeadPass) -> (f64, usize) {
        let c = self.head.chunks;
        let forwards = match pass {
            HeadPass::Gradient if c > 1 => 2 * c,
            _ => c,
        };
        self.work(|k| match (k, pass) {
            (KernelKind::HeadForward, _) => forwards,
            (KernelKind::HeadBackward, HeadPass::Gradient | HeadPass::FrozenGradient) => c,
            _ => 0,
        })
    }

    /// Σ over kernels of `runs(kind)` × tiles × one tile's FLOPs, and the
    /// evaluations; the layer kernels and the head's are counted apart.
    fn work(&self, runs: impl Fn(KernelKind) -> usize) -> (f64, usize) {
        self.used().fold((0.0, 0), |(f, n), k| {
            let r = runs(k.kind);
            (f + r as f64 * k.total_flop(), n + r * k.tiles)
        })
    }
}

/// What the LM head computes for one sequence, chunk by chunk
/// (`engine::head_loss`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadPass {
    /// Each chunk's forward once: the softmax statistics (an evaluation,
    /// DPO's reference).
    Statistics,
    /// Each chunk's forward and backward once: a frozen head (LoRA)
    /// gathers its input gradient beside the statistics.
    FrozenGradient,
    /// A head that trains: over several chunks each chunk's forward
    /// twice (the statistics, then its normalised gradient, which its own
    /// weight gradient needs) and its backward once.
    Gradient,
}

impl HeadPass {
    /// The pass of a step with a gradient, the head training or not.
    pub fn gradient(trains: bool) -> HeadPass {
        match trains {
            true => HeadPass::Gradient,
            false => HeadPass::FrozenGradient,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;

    #[test]
    fn blocks_of_queries_fall_into_at_most_three_power_of_two_key_classes() {
        let classes = |n: usize| (0..n).map(|i| key_class(i, n)).collect::<Vec<_>>();
        assert_eq!(classes(1), [0]);
        assert_eq!(classes(2), [0, 1]);
        assert_eq!(classes(4), [0, 1, 2, 2]);
        // Sixteen blocks: the shortest four share the first kept class.
        assert_eq!(
            classes(16),
            [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
        );
        let keys = |n: usize| {
            (0..3)
                .map(|c| class_keys(c, n, 256, 256 * n))
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(4), [256, 512, 1024]);
        assert_eq!(keys(16), [1024, 2048, 4096]);
        // Every block reads at least the keys up to its last query.
        for n in [2, 3, 4, 8, 16, 32] {
            for i in 0..n {
                assert!(class_keys(key_class(i, n), n, 32, 32 * n) >= 32 * (i + 1));
            }
        }
    }

    /// A key class's tile: k is cut to its keys, the mask is `[queries,
    /// keys]`, and its partial dK lands in the first `keys` columns.
    #[test]
    fn a_key_class_tile_cuts_and_sums_its_keys() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let full = Shape::new(&cfg, 128);
        let splits = vec![Split {
            axis: Axis::Seq,
            blocks: 4,
        }];
        // Block 1 of 4 (queries 32..64) reads 64 keys.
        let k = KernelTiles {
            kind: KernelKind::SdpaBackward,
            tiles: 4,
            shape: Shape {
                seq: 64,
                ..tile_shape(KernelKind::SdpaBackward, &full, &splits)
            },
            splits,
            input: [0, 0],
            output: [0, 0],
            flop: 0.0,
            weight_bytes: 0,
            scratch_bytes: 0,
            keys: vec![],
        };
        let kv = full.kv_dim();
        let keys: Vec<f32> = (0..kv * 128).map(|i| (i % 128) as f32).collect();
        let cut = tile_activation(&k, Port::KRope, &keys, 128, 1);
        assert_eq!(cut.len(), kv * 64);
        assert_eq!(&cut[..3], &[0., 1., 2.]);
        assert_eq!(cut[64], 0.0, "each row restarts at key 0");
        let mask = tile_mask(&k, 1, None);
        assert_eq!(mask.len(), 32 * 64);
        // Query 32 + r sees keys 0..=32 + r.
        assert_eq!(mask[33], crate::kernels::MASKED);
        assert_eq!(mask[32], 0.0);
        assert_eq!(mask[31 * 64 + 63], 0.0);
        // With a window of 8, query 32 + r sees keys 25 + r..=32 + r only.
        let windowed = tile_mask(&k, 1, Some(8));
        let masked = |m: &[f32], r: usize, j: usize| m[r * 64 + j] == crate::kernels::MASKED;
        assert!(masked(&windowed, 0, 24) && !masked(&windowed, 0, 25));
        assert!(!masked(&windowed, 0, 32) && masked(&windowed, 0, 33));
        assert!(
            masked(&windowed, 31, 55) && !masked(&windowed, 31, 56) && !masked(&windowed, 31, 63)
        );
        let mut acc = vec![];
        for t in 0..2 {
            combine(&k, Port::Dk, &mut acc, vec![1.0; kv * 64], t, 128);
        }
        assert_eq!(acc.len(), kv * 128);
        assert!(acc
            .chunks(128)
            .all(|row| row[..64].iter().all(|&v| v == 2.0) && row[64..].iter().all(|&v| v == 0.0)));
    }

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
            weight_bytes: 0,
            scratch_bytes: 0,
            keys: vec![],
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
            combine(&k, Port::Dx, &mut acc, vec![1.0; 32 * 4], t, full.seq);
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
