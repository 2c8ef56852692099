//! Cutting: a tile's blocks of weights, activations, mask and RoPE tables,
//! and its results combined (concatenated or summed) into the whole.

use super::*;
use crate::kernels::io::Tensors;
use crate::kernels::LayerWeights;

/// Block `i` of `n` equal row blocks of a row-major `[rows, cols]` tensor.
pub(super) fn row_block(data: &[f32], rows: usize, i: usize, n: usize) -> Vec<f32> {
    let cols = data.len() / rows.max(1);
    let per = rows / n;
    data[i * per * cols..(i + 1) * per * cols].to_vec()
}

/// Block `i` of `n` equal column blocks of a row-major `[rows, cols]` tensor.
pub(super) fn col_block(data: &[f32], cols: usize, i: usize, n: usize) -> Vec<f32> {
    let per = cols / n;
    data.chunks(cols)
        .flat_map(|row| &row[i * per..(i + 1) * per])
        .copied()
        .collect()
}

/// `[rows, cols]` cut by the splits of `k` in tile `t` along its rows
/// (extent `re`) and columns (extent `ce`).
pub(super) fn block(
    k: &KernelTiles,
    t: usize,
    data: &[f32],
    rows: usize,
    re: Extent,
    ce: Extent,
) -> Vec<f32> {
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
pub fn tile_weights(k: &KernelTiles, full: &Shape, w: &LayerWeights, t: usize) -> Tensors {
    let mut out = Tensors::new();
    for &(p, _) in k.kind.projections() {
        let (oe, ie) = projection_extents(p);
        let (rows, cols) = full.projection(p);
        let base = w.projection(p);
        if !base.is_empty() {
            out.insert(Port::Weight(p), block(k, t, base, rows, oe, ie));
        }
        if let Some(b) = w.biases[p.index()] {
            out.insert(Port::Bias(p), bias_block(k, full, t, p, b));
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

/// Tile `t`'s block of projection `p`'s bias `[out]`: the rows of its
/// output block.
pub fn bias_block(k: &KernelTiles, full: &Shape, t: usize, p: Projection, b: &[f32]) -> Vec<f32> {
    let (oe, _) = projection_extents(p);
    let (rows, _) = full.projection(p);
    block(k, t, b, rows, oe, Extent::Whole)
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
    if positions(k.kind, port) == Positions::Keys && k.shape.seq < seq {
        // A key class's tile: the keys up to its width.
        v = v
            .chunks(seq)
            .flat_map(|row| &row[..k.shape.seq])
            .copied()
            .collect();
    }
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
/// `seq` keys, `[queries, seq]`: query `lo + r` sees keys `0..=lo + r`,
/// within the attention window if there is one (as
/// [`crate::kernels::causal_mask`] for the whole).
pub fn tile_mask(k: &KernelTiles, t: usize, window: Option<usize>) -> Vec<f32> {
    let (qb, seq) = (k.shape.queries, k.shape.seq);
    let lo = k.query_block(t) * qb;
    let mut m = vec![0f32; qb * seq];
    for (r, row) in m.chunks_mut(seq).enumerate() {
        crate::kernels::mask_row(row, lo + r, window);
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
/// into the full result `acc` over `seq` positions (zeros of the full size
/// on the first tile): at its channel block when a split cuts the port, at
/// its block of positions when the sequence is split — concatenation along
/// cut axes, a sum over the others; a key class's partial sums over the
/// first `w` keys.
pub fn combine(
    k: &KernelTiles,
    port: Port,
    acc: &mut Vec<f32>,
    part: Vec<f32>,
    t: usize,
    seq: usize,
) {
    let rows_cut = k.cut(activation_extent(port), t);
    let pos_cut = k.cut_positions(port, t);
    let (nr, np) = (
        rows_cut.map_or(1, |(sp, _)| sp.blocks),
        pos_cut.map_or(1, |(sp, _)| sp.blocks),
    );
    let along = positions(k.kind, port);
    let scores = along == Positions::ScoreRows;
    // The part as `[rows, w]` placed at row r0, column c0 of the whole
    // `[.., width]`; score rows go head by head.
    let w = match along {
        Positions::ScoreRows | Positions::Keys | Positions::Shared => k.shape.seq,
        _ => k.shape.queries,
    };
    let width = match along {
        Positions::ScoreRows => w,
        Positions::Keys | Positions::Shared => seq,
        _ => w * np,
    };
    let c = part.len() / w;
    if t == 0 {
        *acc = vec![0.0; c * nr * if scores { w * np } else { width }];
    }
    // Every block computes the shared k and v over its keys: the last
    // block's, which reads them all, are kept.
    if along == Positions::Shared && k.query_block(t) + 1 < k.query_blocks() {
        return;
    }
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
