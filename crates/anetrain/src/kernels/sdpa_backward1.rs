//! `sdpa_backward1`: attention recomputed, then the gradients that need
//! only the probabilities,
//!
//!   P = softmax(qᵀk/√HD + causal),   dV_g = Σ_{h in g} P_hᵀ·dA_h,   dP = dAᵀ·V
//!
//! P and dP are passed on to `sdpa_backward2` (`[heads·S, S]` each).
//!
//! Tiled into query blocks (`queries < S`), a tile computes its queries'
//! rows of P and dP against every key, with the block's causal mask as an
//! input, and a partial dV that the tiles sum; q and dA arrive as the
//! block's `[C, queries]`, laid out as whole rows of the surface.

use super::prelude::*;
use rayon::prelude::*;

use super::maths::{causal_blocks, head_probs, masked_head_probs, Scores};
use linalg::{matmul_serial, MatMut, MatRef};

pub struct SdpaBackward1;

activations! {
    /// Roped queries and keys, values and the attention output's gradient;
    /// for a block of queries, their additive mask `[queries, S]`.
    Acts {
        q_rope: Port::QRope, k_rope: Port::KRope, v: Port::V, da: Port::Da;
        optional mask: Port::Mask
    }
}

outputs! {
    /// dV `[KV·HD, S]`, probabilities and their gradient `[heads·S, S]`.
    Out { dv: Port::Dv, probs: Port::Probs, dp: Port::Dp }
}

impl Kernel for SdpaBackward1 {
    const KIND: KernelKind = KernelKind::SdpaBackward1;
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        inputs(b, s);
        b.output(Port::Dv, s.kv_dim())
            .output(Port::Probs, s.score_channels())
            .output(Port::Dp, s.score_channels());
    }

    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let a = recompute(g, s, o)?;
        let dvc = g.heads_rows_to_channels("dv", &a.dv)?;
        let sc = s.score_channels();
        let pf = g.reshape("probs_out", &a.probs, &[1, sc, 1, s.seq])?;
        let dpf = g.reshape("dp_out", &a.dp, &[1, sc, 1, s.seq])?;
        Ok(vec![dvc, pf, dpf])
    }

    fn cpu(s: &Shape, o: &KernelOptions, _: &LayerWeights, a: &Acts) -> Out {
        if s.query_block() {
            return query_block(s, o, a);
        }
        let (kv, seq, hd, r) = (s.kv_dim(), s.seq, s.head_dim, s.ratio());
        let scores = Scores::of(o);
        let (qr, kr, v, da) = (a.q_rope, a.k_rope, a.v, a.da);
        let mut dv = vec![0f32; kv * seq];
        let mut probs = vec![0f32; s.heads * seq * seq];
        let mut dp = vec![0f32; s.heads * seq * seq];
        // One KV group per task, its heads in order (so dV sums in the
        // same order whatever the thread count).
        dv.par_chunks_mut(hd * seq)
            .zip(probs.par_chunks_mut(r * seq * seq))
            .zip(dp.par_chunks_mut(r * seq * seq))
            .enumerate()
            .for_each(|(g, ((dv_g, probs_g), dp_g))| {
                for j in 0..r {
                    let h = g * r + j;
                    let p = &mut probs_g[j * seq * seq..(j + 1) * seq * seq];
                    head_probs(
                        &qr[h * hd * seq..][..hd * seq],
                        &kr[g * hd * seq..][..hd * seq],
                        hd,
                        seq,
                        scores,
                        o.class.window,
                        p,
                    );
                    // dV_g [HD, S] += dA_h [HD, S] · P; key block
                    // lo..hi is seen by queries lo..S.
                    for (lo, hi) in causal_blocks(seq) {
                        matmul_serial(
                            MatRef::row_major(da, h * hd * seq, hd, seq).cols_range(lo, seq),
                            MatRef::row_major(p, 0, seq, seq)
                                .rows_range(lo, seq)
                                .cols_range(lo, hi),
                            MatMut::strided(dv_g, lo, hd, hi - lo, seq),
                            true,
                        );
                    }
                    // dP_h [S, S] = dA_hᵀ · V_g
                    matmul_serial(
                        MatRef::row_major(da, h * hd * seq, hd, seq).t(),
                        MatRef::row_major(v, g * hd * seq, hd, seq),
                        MatMut::row_major(dp_g, j * seq * seq, seq, seq),
                        false,
                    );
                }
            });
        Out { dv, probs, dp }
    }
}

/// The inputs of `sdpa_backward1` and of the fused `sdpa_backward`: roped
/// q, k, v and dA as rows of an `S`-wide surface (a block's q and dA in
/// whole rows), and a block's mask.
pub(super) fn inputs(b: &mut LayoutBuilder, s: &Shape) {
    b.rows(Port::QRope, s.query_rows(s.q_dim()))
        .rows(Port::KRope, s.kv_dim())
        .rows(Port::V, s.kv_dim())
        .rows(Port::Da, s.query_rows(s.q_dim()));
    if s.query_block() {
        b.rows(Port::Mask, s.queries);
    }
}

/// The attention recomputed and the gradients that need only P, with the
/// folded operands `sdpa_backward2`'s maths reads next.
pub(super) struct Recomputed {
    /// P and dP, `[1, KV, R·queries, S]`.
    pub probs: Value,
    pub dp: Value,
    /// dV `[1, KV, S, HD]`.
    pub dv: Value,
    /// Roped q folded `[1, KV, R·queries, HD]`, k `[1, KV, S, HD]`.
    pub q_fold: Value,
    pub k: Value,
    /// Soft-capped scores' tanh(x/c), as P (`Gen::attention_probs`).
    pub tanh: Option<Value>,
}

/// P = softmax(qᵀk·scale + mask), dV = Σ_h Pᵀ·dA, dP = dA·Vᵀ from the
/// [`inputs`] regions.
pub(super) fn recompute(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Recomputed> {
    let (kvh, r, hd, qb) = (s.kv_heads, s.ratio(), s.head_dim, s.queries);
    let qc = g.query_channels(Port::QRope, s.q_dim(), s)?;
    let kc = g.region(Port::KRope)?;
    let vc = g.region(Port::V)?;
    let dac = g.query_channels(Port::Da, s.q_dim(), s)?;
    let q = g.channels_to_heads("q", &qc, s.heads)?;
    let k = g.channels_to_heads("k", &kc, kvh)?;
    let v = g.channels_to_heads("v_h", &vc, kvh)?;
    let da = g.channels_to_heads("da_h", &dac, s.heads)?;
    let q_fold = g.reshape("q_fold", &q, &[1, kvh, r * qb, hd])?;
    let daf = g.reshape("da_fold", &da, &[1, kvh, r * qb, hd])?;
    let (probs, tanh) = g.attention_probs(&q_fold, &k, s, o)?;
    // dV = Pᵀ·dA (summed over the folded group), dP = dA·Vᵀ
    let dv = g.matmul("dv_h", &probs, &daf, true, false)?;
    let dp = g.matmul("dp_fold", &daf, &v, false, true)?;
    Ok(Recomputed {
        probs,
        dp,
        dv,
        q_fold,
        k,
        tanh,
    })
}

/// The twin for a block of `queries` (`qb`) against all `S` keys:
///   P_h = softmax(q_hᵀk_g/√HD + mask),  dV_g += Σ_h dA_h·P_h,  dP_h = dA_hᵀ·V_g
/// over whole rows (the mask, an input, says what is causal).
fn query_block(s: &Shape, o: &KernelOptions, a: &Acts) -> Out {
    let (kv, seq, hd, r, qb) = (s.kv_dim(), s.seq, s.head_dim, s.ratio(), s.queries);
    let scores = Scores::of(o);
    let mask = a
        .mask
        .expect("a block of queries reads its mask (the runner makes it)");
    let (qr, kr, v, da) = (a.q_rope, a.k_rope, a.v, a.da);
    let mut dv = vec![0f32; kv * seq];
    let mut probs = vec![0f32; s.heads * qb * seq];
    let mut dp = vec![0f32; s.heads * qb * seq];
    dv.par_chunks_mut(hd * seq)
        .zip(probs.par_chunks_mut(r * qb * seq))
        .zip(dp.par_chunks_mut(r * qb * seq))
        .enumerate()
        .for_each(|(g, ((dv_g, probs_g), dp_g))| {
            for j in 0..r {
                let h = g * r + j;
                let p = &mut probs_g[j * qb * seq..(j + 1) * qb * seq];
                masked_head_probs(
                    &qr[h * hd * qb..][..hd * qb],
                    &kr[g * hd * seq..][..hd * seq],
                    hd,
                    scores,
                    mask,
                    p,
                );
                // dV_g [HD, S] += dA_h [HD, qb] · P_h
                matmul_serial(
                    MatRef::row_major(da, h * hd * qb, hd, qb),
                    MatRef::row_major(p, 0, qb, seq),
                    MatMut::row_major(dv_g, 0, hd, seq),
                    true,
                );
                // dP_h [qb, S] = dA_hᵀ · V_g
                matmul_serial(
                    MatRef::row_major(da, h * hd * qb, hd, qb).t(),
                    MatRef::row_major(v, g * hd * seq, hd, seq),
                    MatMut::row_major(dp_g, j * qb * seq, qb, seq),
                    false,
                );
            }
        });
    Out { dv, probs, dp }
}
