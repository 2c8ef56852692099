//! `sdpa_backward2`: the softmax backward and the query/key gradients,
//!
//!   dS = P ⊙ (dP − Σ_j P⊙dP) / √HD,   dQ_h = dS_h·K_g,   dK_g = Σ_{h in g} dS_hᵀ·Q_h
//!   (soft-capped scores c·tanh(x/c): dS ⊙ (1 − t²), t recomputed from q and k)
//!
//! (on roped q and k; the engine rotates dq and dk back on the CPU).
//!
//! Tiled into query blocks, a tile reads its queries' rows of P and dP
//! and returns their dq and a partial dK that the tiles sum: every row of
//! dS is whole in its tile, so the softmax backward is exact.

use super::prelude::*;
use rayon::prelude::*;

use super::maths::Scores;
use linalg::{matmul_serial, MatMut, MatRef};

pub struct SdpaBackward2;

activations! {
    /// Probabilities and their gradient (from `sdpa_backward1`), roped q and k.
    Acts { probs: Port::Probs, dp: Port::Dp, q_rope: Port::QRope, k_rope: Port::KRope }
}

outputs! {
    /// dq `[heads·HD, S]` and dk `[KV·HD, S]`.
    Out { dq: Port::Dq, dk: Port::Dk }
}

impl Kernel for SdpaBackward2 {
    const KIND: KernelKind = KernelKind::SdpaBackward2;
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.rows(Port::Probs, s.score_channels())
            .rows(Port::Dp, s.score_channels())
            .rows(Port::QRope, s.query_rows(s.q_dim()))
            .rows(Port::KRope, s.kv_dim())
            .output(Port::Dq, s.query_rows(s.q_dim()))
            .output(Port::Dk, s.kv_dim());
    }

    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let (kvh, r, seq, hd, qb) = (s.kv_heads, s.ratio(), s.seq, s.head_dim, s.queries);
        let pf = g.region(Port::Probs)?;
        let dpf = g.region(Port::Dp)?;
        let qc = g.query_channels(Port::QRope, s.q_dim(), s)?;
        let kc = g.region(Port::KRope)?;
        let probs = g.reshape("probs_fold", &pf, &[1, kvh, r * qb, seq])?;
        let dp = g.reshape("dp_fold", &dpf, &[1, kvh, r * qb, seq])?;
        let q = g.channels_to_heads("q", &qc, s.heads)?;
        let k = g.channels_to_heads("k", &kc, kvh)?;
        let qf = g.reshape("q_fold", &q, &[1, kvh, r * qb, hd])?;
        let (dqc, dkc) = softmax_backward(g, s, o, &probs, &dp, &qf, &k, None)?;
        Ok(vec![dqc, dkc])
    }

    fn cpu(s: &Shape, o: &KernelOptions, _: &LayerWeights, a: &Acts) -> Out {
        // `qb` queries (all `seq`, or a block of them) against `seq` keys.
        let (q, kv, seq, hd, r, qb) = (
            s.q_dim(),
            s.kv_dim(),
            s.seq,
            s.head_dim,
            s.ratio(),
            s.queries,
        );
        let scores = Scores::of(o);
        let scale = scores.scale;
        let (p, dp, qr, kr) = (a.probs, a.dp, a.q_rope, a.k_rope);
        let mut dq = vec![0f32; q * qb];
        let mut dk = vec![0f32; kv * seq];
        dq.par_chunks_mut(r * hd * qb)
            .zip(dk.par_chunks_mut(hd * seq))
            .enumerate()
            .for_each(|(g, (dq_g, dk_g))| {
                let mut ds = vec![0f32; qb * seq];
                let mut x = vec![0f32; if scores.capped() { qb * seq } else { 0 }];
                for j in 0..r {
                    let h = g * r + j;
                    let base = h * qb * seq;
                    // dS = P ∘ (dP − rowsum(P ∘ dP)) · scale (over whole
                    // rows, as the kernel does, whatever P holds).
                    for i in 0..qb {
                        let (p, dp) = (&p[base + i * seq..][..seq], &dp[base + i * seq..][..seq]);
                        let dot: f32 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
                        let row = &mut ds[i * seq..(i + 1) * seq];
                        for ((d, &p), &dp) in row.iter_mut().zip(p).zip(dp) {
                            *d = p * (dp - dot) * scale;
                        }
                    }
                    if scores.capped() {
                        // The raw scores q_hᵀk_g [qb, S], for 1 − t².
                        matmul_serial(
                            MatRef::row_major(qr, h * hd * qb, hd, qb).t(),
                            MatRef::row_major(kr, g * hd * seq, hd, seq),
                            MatMut::row_major(&mut x, 0, qb, seq),
                            false,
                        );
                        scores.through_cap(&x, &mut ds);
                    }
                    // dQ_h [HD, qb] = K_g [HD, S] · dSᵀ ; dK_g [HD, S] += Q_h · dS
                    matmul_serial(
                        MatRef::row_major(kr, g * hd * seq, hd, seq),
                        MatRef::row_major(&ds, 0, qb, seq).t(),
                        MatMut::row_major(dq_g, j * hd * qb, hd, qb),
                        false,
                    );
                    matmul_serial(
                        MatRef::row_major(qr, h * hd * qb, hd, qb),
                        MatRef::row_major(&ds, 0, qb, seq),
                        MatMut::row_major(dk_g, 0, hd, seq),
                        true,
                    );
                }
            });
        Out { dq, dk }
    }
}

/// dS = P ⊙ (dP − Σ_j P⊙dP)/√HD, dQ = dS·K, dK = Σ_h dSᵀ·Q from folded P,
/// dP (`[1, KV, R·queries, S]`), q and k: dq `[Q, queries]` (a block's in
/// whole rows) and dK `[KV, S]` as output channels (this kernel's maths,
/// and the fused `sdpa_backward`'s second half). Soft-capped scores
/// multiply dS by 1 − t², t their tanh: `tanh` where the program has it,
/// else recomputed from q and k.
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax_backward(
    g: &mut Gen,
    s: &Shape,
    o: &KernelOptions,
    probs: &Value,
    dp: &Value,
    qf: &Value,
    k: &Value,
    tanh: Option<Value>,
) -> mil::Result<(Value, Value)> {
    let (hd, qb) = (s.head_dim, s.queries);
    // dS = P ⊙ (dP − Σ_j P⊙dP)·scale
    let pdp = g.b.mul("pdp", probs, dp)?;
    let axes = g.ints("axes", &[-1])?;
    let keep = g.flag(true)?;
    let rs = g.b.reduce("reduce_sum", "pdp_sum", &pdp, &axes, &keep)?;
    let dps = g.b.sub("dp_centered", dp, &rs)?;
    let ds0 = g.b.mul("ds_raw", probs, &dps)?;
    let sc = g.scalar("scale", o.score_scale)?;
    let mut ds = g.b.mul("ds", &ds0, &sc)?;
    if let Some(c) = o.score_cap {
        let t = match tanh {
            Some(t) => t,
            None => {
                let x = g.scaled_scores("cap_", qf, k, o)?;
                g.score_tanh("cap_", &x, c)?
            }
        };
        // dx = dS ⊙ (1 − t²)
        let t2 = g.b.mul("tanh_sq", &t, &t)?;
        let one = g.scalar("one", 1.0)?;
        let slope = g.b.sub("cap_slope", &one, &t2)?;
        ds = g.b.mul("ds_uncapped", &ds, &slope)?;
    }
    // dQ = dS·K, dK = dSᵀ·Q (summed over the folded group)
    let dq = g.matmul("dq_fold", &ds, k, false, false)?;
    let dk = g.matmul("dk_h", &ds, qf, true, false)?;
    let dqh = g.reshape("dq_h", &dq, &[1, s.heads, qb, hd])?;
    let dqc = match s.query_block() {
        false => g.heads_rows_to_channels("dq", &dqh)?,
        true => {
            let c = g.heads_rows_to_channels("dq_block", &dqh)?;
            g.query_rows_out("dq", &c, s)?
        }
    };
    let dkc = g.heads_rows_to_channels("dk", &dk)?;
    Ok((dqc, dkc))
}
