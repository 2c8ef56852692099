//! Planning: for each kernel the tiling whose program passes the device's
//! rules within the tile cap in the least predicted time (the cost model
//! of `ane::cost`), and the LM head's vocabulary chunks.

use super::*;
use crate::kernels::{build_unfilled, KernelProgram};

/// The divisors of `n`, ascending.
pub(super) fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|t| n.is_multiple_of(*t)).collect()
}

/// The tilings `kind` may take, fewest tiles first (and among equals, the
/// fewest cuts of later axes): every combination of block counts that
/// divide their axes.
pub(super) fn candidates(kind: KernelKind, full: &Shape, o: &KernelOptions) -> Vec<Vec<Split>> {
    if o.seed_compat {
        // Seed-compatible layouts pass values through that tiles would sum.
        return vec![vec![]];
    }
    // A norm over the whole q and k projections (OLMo 2's) needs every
    // head of a position in one program: sdpa_forward is not cut by heads.
    let whole_rows = kind == KernelKind::SdpaForward
        && o.layer.qk_norm_kind() == crate::model::layer::QkNorm::Whole;
    let axes = kind
        .tile_axes()
        .iter()
        .filter(|&&a| !(whole_rows && a == Axis::KvGroups));
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

/// Plans every kernel: among the equal tilings whose program passes every
/// rule the device's limits `o.limits` imply ([`ane::rules::RuleSet::for_limits`]:
/// per-axis caps, contraction multiples, …) with surfaces within
/// `o.max_tile_bytes`, the one predicted fastest on `o.cost_rates()`
/// (compared from the fewest tiles up, see [`CHOICE_SPAN`]); failing the size, the passing tiling with the
/// smallest largest surface; failing the rules, the fewest tiles that at
/// least fit the axis caps. The LM head's kernels are planned with its
/// vocabulary chunks ([`plan_head`]). An error names the kernel, the axes
/// and the caps when no tiling fits.
pub fn plan(full: &Shape, o: &KernelOptions) -> Result<Plan, PlanError> {
    let rules = ane::rules::RuleSet::for_limits(o.limits);
    let mut kernels = Vec::new();
    for kind in KernelKind::ALL.into_iter().filter(|k| k.serves(&o.layer)) {
        // sdpa_backward2 takes sdpa_backward1's tiles where they pass, so
        // the runner can hand each tile's P and dP straight from one to
        // the other (`KernelRunner::attention_backward`).
        let prefer = match kind {
            KernelKind::SdpaBackward2 => kernels
                .iter()
                .find(|(k, _): &&(KernelTiles, Fit)| k.kind == KernelKind::SdpaBackward1)
                .map(|(k, _)| k.splits.clone()),
            _ => None,
        };
        kernels.push(plan_kernel(kind, full, o, &rules, prefer)?);
    }
    let attention_backward = attention_backward(&kernels, o);
    let (head, head_kernels) = plan_head(full, o, &rules)?;
    let mut kernels: Vec<KernelTiles> = kernels.into_iter().map(|(k, _)| k).collect();
    kernels.extend(head_kernels);
    Ok(Plan {
        shape: *full,
        limits: o.limits,
        head,
        attention_backward,
        kernels,
    })
}

/// The fused attention backward where the pair is tiled, the fused tiling
/// passes every rule within the cap, and the cost model predicts it faster
/// than the pair (on `o.cost_rates()`, every tile staged); else the pair.
/// Untiled layers keep the pair (the programs of a whole layer, as the
/// seed has them).
fn attention_backward(kernels: &[(KernelTiles, Fit)], o: &KernelOptions) -> AttentionBackward {
    let of = |kind| kernels.iter().find(|(k, _)| k.kind == kind);
    let (Some(b1), Some(b2), Some(fused)) = (
        of(KernelKind::SdpaBackward1),
        of(KernelKind::SdpaBackward2),
        of(KernelKind::SdpaBackward),
    ) else {
        return AttentionBackward::Pair;
    };
    let rates = o.cost_rates();
    let cost = |t: &KernelTiles| t.predicted(&rates, true).total();
    match o.fuse_attention_backward
        && b1.0.tiles > 1
        && fused.1 == Fit::Within
        && cost(&fused.0) < cost(&b1.0) + cost(&b2.0)
    {
        true => AttentionBackward::Fused,
        false => AttentionBackward::Pair,
    }
}

/// The vocabulary chunks (at least `o.min_tiles`, to exercise chunking on
/// small vocabularies) for which both head kernels find a tiling within
/// the rules and `o.max_tile_bytes` in the least predicted time per
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
    let mut best: Option<(f64, (HeadChunks, Vec<KernelTiles>))> = None;
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
                .map(|kind| plan_kernel(kind, &shape, o, rules, None))
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
                // Predicted time per sequence with a gradient: each chunk's
                // forward (twice over several chunks when the head trains,
                // once when LoRA freezes it) and its backward (see
                // `Plan::head_work`).
                let rates = o.cost_rates();
                let pass = HeadPass::gradient(o.lora.is_none());
                let forwards = match pass == HeadPass::Gradient && found.0.chunks > 1 {
                    true => 2.0,
                    false => 1.0,
                };
                let cost = |t: &KernelTiles| t.predicted(&rates, true).total();
                let e = found.0.chunks as f64 * (forwards * cost(&found.1[0]) + cost(&found.1[1]));
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
        env = ane::family::MAX_DIM_ENV,
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

/// Tilings within the cap are compared up to this many times the fewest
/// tiles that fit, and at most [`CHOICE_COUNT`] of them: past that, more
/// tiles only add dispatches and shrink products.
const CHOICE_SPAN: usize = 4;
const CHOICE_COUNT: usize = 12;

/// The span for the fused attention backward, whose finer blocks of
/// queries read fewer keys ([`KernelTiles::keys`]) and hold smaller score
/// matrices: tilings up to 32 times the fewest tiles are compared (and
/// four times as many of them).
const CAUSAL_CHOICE_SPAN: usize = 32;

/// The tiling predicted fastest on `o.cost_rates()` (every tile staged,
/// as streamed buffers do); the fewest tiles among equals.
fn cheapest(tilings: Vec<KernelTiles>, o: &KernelOptions) -> Option<KernelTiles> {
    let rates = o.cost_rates();
    let cost = |t: &KernelTiles| t.predicted(&rates, true).total();
    tilings
        .into_iter()
        .reduce(|best, t| if cost(&t) < cost(&best) { t } else { best })
}

/// The tiles of `kind` cut by `splits`, whose program `k` is generated
/// at `shape`: its surfaces, FLOPs and bytes as the cost model reads them.
fn tiles_of(kind: KernelKind, splits: Vec<Split>, shape: Shape, k: &KernelProgram) -> KernelTiles {
    let l = &k.layout;
    KernelTiles {
        kind,
        tiles: splits.iter().map(|s| s.blocks).product(),
        splits,
        shape,
        input: [l.in_channels, l.in_spatial],
        output: [l.out_channels, l.out_spatial],
        flop: k.program.functions.iter().map(|f| f.matmul_flops()).sum(),
        scratch_bytes: match kind {
            KernelKind::SdpaBackward => 3 * 2 * shape.score_channels() * shape.seq,
            _ => 0,
        },
        weight_bytes: l
            .inputs
            .iter()
            .filter(|r| r.port.is_weight())
            .map(|r| 2 * r.channels.len() * r.spatial.len())
            .sum(),
        keys: vec![],
    }
}

/// The causal key classes of an attention kernel cut into blocks of
/// queries (`sdpa_forward`, the fused `sdpa_backward`; the pair hands P
/// and dP between equal tiles) ([`KernelTiles::keys`]): block `i` reads
/// the keys of [`key_class`]`(i, n)`, each class a program of its own; none
/// (every tile reads every key) where the sequence is not cut, or a
/// class's program would break a rule or not lay its queries in whole
/// rows.
fn key_classes(t: &KernelTiles, o: &KernelOptions, rules: &ane::rules::RuleSet) -> Vec<KeyClass> {
    let blocks = t.query_blocks();
    if !matches!(t.kind, KernelKind::SdpaBackward | KernelKind::SdpaForward) || blocks < 2 {
        return vec![];
    }
    let mut classes = vec![];
    for c in 0..=key_class(blocks - 1, blocks) {
        let shape = Shape {
            seq: class_keys(c, blocks, t.shape.queries, t.shape.seq),
            ..t.shape
        };
        if !shape.query_rows_whole() {
            return vec![];
        }
        // A class whose program cannot be laid out or breaks a rule: the
        // tiles read every key.
        let Ok(k) = build_unfilled(t.kind, &shape, o) else {
            return vec![];
        };
        if !ane::rules::check(&k.program, rules).is_empty() {
            return vec![];
        }
        let c_tiles = tiles_of(t.kind, t.splits.clone(), shape, &k);
        let in_class = (0..blocks).filter(|&i| key_class(i, blocks) == c).count();
        classes.push(KeyClass {
            shape,
            input: c_tiles.input,
            output: c_tiles.output,
            flop: c_tiles.flop,
            scratch_bytes: c_tiles.scratch_bytes,
            tiles: t.tiles / blocks * in_class,
        });
    }
    classes
}

/// One kernel's tiling at `full` (see [`plan`]), and how well it fits.
fn plan_kernel(
    kind: KernelKind,
    full: &Shape,
    o: &KernelOptions,
    rules: &ane::rules::RuleSet,
    prefer: Option<Vec<Split>>,
) -> Result<(KernelTiles, Fit), PlanError> {
    let mut fits_dim = None;
    let mut passing: Vec<KernelTiles> = vec![];
    let mut within: Vec<KernelTiles> = vec![];
    let mut last_problem = String::new();
    let preferred = prefer.is_some();
    // Where blocks of queries skip masked keys, more of them remove work.
    let (span, count) = match kind {
        KernelKind::SdpaBackward => (CAUSAL_CHOICE_SPAN, 4 * CHOICE_COUNT),
        _ => (CHOICE_SPAN, CHOICE_COUNT),
    };
    let mut list = candidates(kind, full, o);
    if let Some(p) = prefer {
        list.insert(0, p);
    }
    for (i, splits) in list.into_iter().enumerate() {
        let tiles: usize = splits.iter().map(|s| s.blocks).product();
        if within
            .first()
            .is_some_and(|w| tiles > span * w.tiles || within.len() >= count)
        {
            break;
        }
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
        let mut tiles = tiles_of(kind, splits, shape, &k);
        if findings.is_empty() {
            tiles.keys = key_classes(&tiles, o, rules);
        }
        let small_enough = o
            .max_tile_bytes
            .is_none_or(|cap| tiles.largest_surface() <= cap);
        if findings.is_empty() && small_enough {
            if preferred && i == 0 {
                return Ok((tiles, Fit::Within));
            }
            within.push(tiles);
            continue;
        }
        if findings.is_empty() {
            // Passes every rule but is larger than asked: a fallback
            // when no tiling meets the cap.
            passing.push(tiles);
            continue;
        }
        fits_dim.get_or_insert(tiles);
    }
    if let Some(best) = cheapest(within, o) {
        return Ok((best, Fit::Within));
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
