//! `sdpa_backward`: `sdpa_backward1` and `sdpa_backward2` in one program,
//! for a block of queries against every key,
//!
//!   P = softmax(qᵀk/√HD + mask),  dV_g = Σ_h P_hᵀ·dA_h,  dP = dAᵀ·V,
//!   dS = P ⊙ (dP − Σ_j P⊙dP)/√HD,  dQ_h = dS_h·K_g,  dK_g = Σ_h dS_hᵀ·Q_h
//!
//! P and dP stay inside the program: the pair's tile hand-off (P and dP
//! read from one surface, written to the next, a dispatch between) is
//! gone. A tile returns its queries' dq and partial dV and dK that the
//! tiles sum, as the pair's tiles do. Used where the attention backward
//! is cut into query blocks; whole layers keep the pair.

use super::prelude::*;

use super::{sdpa_backward1, sdpa_backward2, SdpaBackward1, SdpaBackward2};

pub struct SdpaBackward;

/// The same activations as `sdpa_backward1`.
pub type Acts<'a> = sdpa_backward1::Acts<'a>;

outputs! {
    /// dV `[KV·HD, S]`, dq `[heads·HD, S]` (the block's queries), dK `[KV·HD, S]`.
    Out { dv: Port::Dv, dq: Port::Dq, dk: Port::Dk }
}

impl Kernel for SdpaBackward {
    const KIND: KernelKind = KernelKind::SdpaBackward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, _: &KernelOptions) {
        b.rows(Port::QRope, s.query_rows(s.q_dim()))
            .rows(Port::KRope, s.kv_dim())
            .rows(Port::V, s.kv_dim())
            .rows(Port::Da, s.query_rows(s.q_dim()));
        if s.query_block() {
            b.rows(Port::Mask, s.queries);
        }
        b.output(Port::Dv, s.kv_dim())
            .output(Port::Dq, s.query_rows(s.q_dim()))
            .output(Port::Dk, s.kv_dim());
    }

    fn mil(g: &mut Gen, s: &Shape, _: &KernelOptions) -> mil::Result<Vec<Value>> {
        let (kvh, r, hd, qb) = (s.kv_heads, s.ratio(), s.head_dim, s.queries);
        let qc = g.query_channels(Port::QRope, s.q_dim(), s)?;
        let kc = g.region(Port::KRope)?;
        let vc = g.region(Port::V)?;
        let dac = g.query_channels(Port::Da, s.q_dim(), s)?;
        let q = g.channels_to_heads("q", &qc, s.heads)?;
        let k = g.channels_to_heads("k", &kc, kvh)?;
        let v = g.channels_to_heads("v_h", &vc, kvh)?;
        let da = g.channels_to_heads("da_h", &dac, s.heads)?;
        let qf = g.reshape("q_fold", &q, &[1, kvh, r * qb, hd])?;
        let daf = g.reshape("da_fold", &da, &[1, kvh, r * qb, hd])?;
        let probs = g.attention_probs(&qf, &k, s)?;
        // dV = Pᵀ·dA (summed over the folded group), dP = dA·Vᵀ
        let dv = g.matmul("dv_h", &probs, &daf, true, false)?;
        let dp = g.matmul("dp_fold", &daf, &v, false, true)?;
        // dS = P ⊙ (dP − Σ_j P⊙dP) / √HD
        let pdp = g.b.mul("pdp", &probs, &dp)?;
        let axes = g.ints("axes", &[-1])?;
        let keep = g.flag(true)?;
        let rs = g.b.reduce("reduce_sum", "pdp_sum", &pdp, &axes, &keep)?;
        let dps = g.b.sub("dp_centered", &dp, &rs)?;
        let ds0 = g.b.mul("ds_raw", &probs, &dps)?;
        let sc = g.scalar("scale", 1.0 / (hd as f64).sqrt())?;
        let ds = g.b.mul("ds", &ds0, &sc)?;
        // dQ = dS·K, dK = dSᵀ·Q (summed over the folded group)
        let dq = g.matmul("dq_fold", &ds, &k, false, false)?;
        let dk = g.matmul("dk_h", &ds, &qf, true, false)?;
        let dvc = g.heads_rows_to_channels("dv", &dv)?;
        let dqh = g.reshape("dq_h", &dq, &[1, s.heads, qb, hd])?;
        let dqc = match s.query_block() {
            false => g.heads_rows_to_channels("dq", &dqh)?,
            true => {
                let c = g.heads_rows_to_channels("dq_block", &dqh)?;
                g.query_rows_out("dq", &c, s)?
            }
        };
        let dkc = g.heads_rows_to_channels("dk", &dk)?;
        Ok(vec![dvc, dqc, dkc])
    }

    /// The pair's twins, one after the other.
    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        let b1 = SdpaBackward1::cpu(s, o, w, a);
        let a2 = sdpa_backward2::Acts {
            probs: &b1.probs,
            dp: &b1.dp,
            q_rope: a.q_rope,
            k_rope: a.k_rope,
        };
        let b2 = SdpaBackward2::cpu(s, o, w, &a2);
        Out {
            dv: b1.dv,
            dq: b2.dq,
            dk: b2.dk,
        }
    }
}
