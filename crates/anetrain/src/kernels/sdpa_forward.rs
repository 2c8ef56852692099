//! `sdpa_forward`: a layer's attention up to (not including) the output
//! projection, with QK-norm and RoPE.
//!
//!   q = Wq·xn + bq, k = Wk·xn + bk, v = Wv·xn + bv (+ LoRA on each; biases: Qwen2)
//!   q, k ← rmsnorm_per_head(q)·wq_norm, …          (QK-norm, when on;
//!          OLMo 2's over the whole projection, every head at once)
//!   attn_h = softmax(rope(q_h)ᵀ·rope(k_g)/√HD + causal)·v_gᵀ,  g = h / ratio
//!   (Gemma 2 caps the scores before the mask: c·tanh(scores/c))
//!
//! The `ratio` query heads that share a KV head are folded along the
//! sequence (`[1, KV, ratio·S, HD]`), so K and V are never duplicated.
//! Outputs keep what the backward needs: roped q and k, v, and (with
//! QK-norm) the pre-norm q and k.
//!
//! Tiled into query blocks (`queries < S`), a tile projects q for its
//! block only (`xnorm_block`, RoPE's angles at the block's positions and
//! the causal mask as inputs) and k, v for every position; its attention
//! and q are the block's, laid out as whole rows of the surface, and every
//! block computes k and v over the keys it reads (the last block's, every
//! key, are kept).

use super::prelude::*;
use rayon::prelude::*;

use super::maths::{
    add_adapter, add_bias, apply_rope, causal_blocks, head_probs, masked_head_probs, rms_norm, w_x,
    Scores,
};
use super::{BLOB_COS, BLOB_SIN};
use crate::model::layer::QkNorm;
use linalg::{matmul_serial, MatMut, MatRef};

pub struct SdpaForward;

activations! {
    /// The normed layer input `[D, S]`; for a block of queries also its
    /// columns, RoPE's angles there `[queries, HD]` and the mask
    /// `[queries, S]` (the runner cuts and makes these per tile).
    Acts {
        xnorm: Port::Xnorm;
        optional
        xnorm_block: Port::XnormBlock,
        rope_cos: Port::RopeCos,
        rope_sin: Port::RopeSin,
        mask: Port::Mask,
    }
}

outputs! {
    /// Attention output and what the backward keeps, each `[C, S]`.
    Out {
        attn: Port::Attn,
        q_rope: Port::QRope,
        k_rope: Port::KRope,
        v: Port::V;
        optional
        xnorm: Port::Xnorm,
        q_raw: Port::QRaw,
        k_raw: Port::KRaw,
    }
}

impl Kernel for SdpaForward {
    const KIND: KernelKind = KernelKind::SdpaForward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[
        (Projection::Q, Product::Forward),
        (Projection::K, Product::Forward),
        (Projection::V, Product::Forward),
    ];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, o: &KernelOptions) {
        let (d, q, kv, seq) = (s.dim, s.q_dim(), s.kv_dim(), s.seq);
        b.columns(Port::Xnorm, d, seq, Activation);
        if s.query_block() {
            let qb = s.queries;
            b.columns(Port::XnormBlock, d, qb, Activation)
                .columns_wrapped(Port::RopeCos, qb, s.head_dim)
                .columns_wrapped(Port::RopeSin, qb, s.head_dim)
                .columns_wrapped(Port::Mask, qb, seq);
        }
        b.columns(Port::Weight(Projection::Q), d, q, Transposed)
            .columns(Port::Weight(Projection::K), d, kv, Transposed)
            .columns(Port::Weight(Projection::V), d, kv, Transposed);
        // Biases as one column each, `[out, 1]`.
        for &p in o.layer.biased() {
            b.columns(Port::Bias(p), s.projection(p).0, 1, Activation);
        }
        if !o.layer.biased().is_empty() && !o.qk_norm() {
            b.pad_spatial_to(16);
        }
        if o.qk_norm() {
            // Two vectors ([HD] each, or [Q] and [KV] over the whole
            // projections) in one column each (each in a column group of
            // its own in aligned layouts), then padding so the input width
            // stays a multiple of 16 like the other kernels'.
            let (qw, kw) = o.layer.qk_norm_widths(s.head_dim, q, kv);
            b.columns(Port::QNorm, qw, 1, Activation)
                .columns(Port::KNorm, kw, 1, Activation)
                .pad_spatial_to(16);
        }
        let qr = s.query_rows(q);
        b.output(Port::Attn, qr)
            .output(Port::QRope, qr)
            .output(Port::KRope, kv)
            .output(Port::V, kv);
        if o.seed_compat {
            b.output(Port::Xnorm, d);
        }
        if o.qk_norm() {
            b.output(Port::QRaw, qr).output(Port::KRaw, kv);
        }
    }

    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let (kvh, r, seq, hd, qb) = (s.kv_heads, s.ratio(), s.seq, s.head_dim, s.queries);
        let xt = g.act_rows(Port::Xnorm)?;
        // q of the positions computed: every one, or the query block's.
        let xq = match s.query_block() {
            false => xt.clone(),
            true => g.act_rows(Port::XnormBlock)?,
        };
        let mut projected = vec![];
        for (&(p, product), name) in Self::PROJECTIONS.iter().zip(["q_mm", "k_mm", "v_mm"]) {
            let x = if p == Projection::Q { &xq } else { &xt };
            let y = g.project(name, x, Port::Weight(p))?;
            let y = g.with_adapter(y, x, p, product, o)?;
            projected.push(g.with_bias(y, p, o)?);
        }
        let [qm, km, vm] = <[Value; 3]>::try_from(projected).expect("three projections");
        // QK-norm over the last axis: a head's `[…, HD]`, or a position's
        // whole projection `[1, 1, S, Q]` before the split into heads.
        let whole = o.layer.qk_norm_kind() == QkNorm::Whole;
        let (mut q, mut k) = match whole {
            true => (
                g.head_rms_norm("q_normed", &qm, Port::QNorm, o.whole_norm_eps())?,
                g.head_rms_norm("k_normed", &km, Port::KNorm, o.whole_norm_eps())?,
            ),
            false => (qm.clone(), km.clone()),
        };
        q = g.rows_to_heads("q", &q, s.heads)?;
        k = g.rows_to_heads("k", &k, kvh)?;
        let v = g.rows_to_heads("v", &vm, kvh)?;
        if o.qk_norm() && !whole {
            q = g.head_rms_norm("q_normed", &q, Port::QNorm, o.device_eps())?;
            k = g.head_rms_norm("k_normed", &k, Port::KNorm, o.device_eps())?;
        }
        let cos = g.blob("rope_cos", [1, 1, seq, hd], BLOB_COS)?;
        let sin = g.blob("rope_sin", [1, 1, seq, hd], BLOB_SIN)?;
        let (q_rope, k_rope) = if o.seed_compat {
            (
                g.rope("q_rope", &q, &cos, &sin, o.rope)?,
                g.rope("k_rope", &k, &cos, &sin, o.rope)?,
            )
        } else if s.query_block() {
            // The block's angles, `[queries, HD]` as channels × columns.
            let cb = g.region(Port::RopeCos)?;
            let sb = g.region(Port::RopeSin)?;
            let cb = g.reshape("cos_rows", &cb, &[1, 1, qb, hd])?;
            let sb = g.reshape("sin_rows", &sb, &[1, 1, qb, hd])?;
            (
                g.rope_by_matrix("q_rope", &q, &cb, &sb)?,
                g.rope_by_matrix("k_rope", &k, &cos, &sin)?,
            )
        } else {
            (
                g.rope_by_matrix("q_rope", &q, &cos, &sin)?,
                g.rope_by_matrix("k_rope", &k, &cos, &sin)?,
            )
        };
        // Fold the R query heads of each KV head along the sequence.
        let qf = g.reshape("q_fold", &q_rope, &[1, kvh, r * qb, hd])?;
        let (probs, _) = g.attention_probs(&qf, &k_rope, s, o)?;
        let a = g.matmul("attn_fold", &probs, &v, false, false)?;
        let a = g.reshape("attn_heads", &a, &[1, s.heads, qb, hd])?;
        let (attn, qc) = match s.query_block() {
            false => (
                g.heads_rows_to_channels("attn", &a)?,
                g.heads_rows_to_channels("q_rope_out", &q_rope)?,
            ),
            true => {
                let a = g.heads_rows_to_channels("attn_block", &a)?;
                let qc = g.heads_rows_to_channels("q_rope_block", &q_rope)?;
                (
                    g.query_rows_out("attn", &a, s)?,
                    g.query_rows_out("q_rope_out", &qc, s)?,
                )
            }
        };
        let kc = g.heads_rows_to_channels("k_rope_out", &k_rope)?;
        let vc = g.rows_to_channels("v_out", &vm)?;
        let mut outs = vec![attn, qc, kc, vc];
        if o.seed_compat {
            outs.push(g.region(Port::Xnorm)?);
        }
        if o.qk_norm() {
            let q_raw = match s.query_block() {
                false => g.rows_to_channels("q_raw", &qm)?,
                true => {
                    let c = g.rows_to_channels("q_raw_block", &qm)?;
                    g.query_rows_out("q_raw", &c, s)?
                }
            };
            outs.push(q_raw);
            outs.push(g.rows_to_channels("k_raw", &km)?);
        }
        Ok(outs)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        if s.query_block() {
            return query_block(s, o, w, a);
        }
        let (d, q, kv, seq, hd, r) = (s.dim, s.q_dim(), s.kv_dim(), s.seq, s.head_dim, s.ratio());
        let scores = Scores::of(o);
        let eps = o.norm_eps();
        let x = a.xnorm;
        let project = |p: Projection, rows: usize| {
            let mut y = w_x(w.projection(p), x, rows, d, seq);
            add_adapter(&mut y, w, o, s, p, x, Product::Forward);
            add_bias(&mut y, w, o, p, seq);
            y
        };
        let (q_raw, k_raw, v) = (
            project(Projection::Q, q),
            project(Projection::K, kv),
            project(Projection::V, kv),
        );
        let (qn, kn) = if o.qk_norm() {
            // Over groups of the weight's width: a head's, or the whole.
            let norm = |name: &str, x: &[f32], wn: Option<&[f32]>| {
                let wn = wn.unwrap_or_else(|| panic!("QK-norm is on but the layer has no {name}"));
                rms_norm(x, wn, wn.len(), seq, eps)
            };
            (
                norm("q_norm", &q_raw, w.q_norm),
                norm("k_norm", &k_raw, w.k_norm),
            )
        } else {
            (q_raw.clone(), k_raw.clone())
        };
        let (cos, sin) = o.rope_tables(seq, hd);
        let q_rope = apply_rope(&qn, hd, seq, &cos, &sin, o.rope, 1.0);
        let k_rope = apply_rope(&kn, hd, seq, &cos, &sin, o.rope, 1.0);
        // The heads of one KV group share K and V; groups run in
        // parallel, each product on its own thread.
        let mut attn = vec![0f32; q * seq];
        attn.par_chunks_mut(r * hd * seq)
            .enumerate()
            .for_each(|(g, attn_g)| {
                let mut p = vec![0f32; seq * seq];
                for j in 0..r {
                    let h = g * r + j;
                    head_probs(
                        &q_rope[h * hd * seq..][..hd * seq],
                        &k_rope[g * hd * seq..][..hd * seq],
                        hd,
                        seq,
                        scores,
                        o.class.window,
                        &mut p,
                    );
                    // attn_h [HD, S] = V_g [HD, S] · Pᵀ; query block
                    // lo..hi reads values 0..hi.
                    for (lo, hi) in causal_blocks(seq) {
                        matmul_serial(
                            MatRef::row_major(&v, g * hd * seq, hd, seq).cols_range(0, hi),
                            MatRef::row_major(&p, 0, seq, seq)
                                .t()
                                .rows_range(0, hi)
                                .cols_range(lo, hi),
                            MatMut::strided(attn_g, j * hd * seq + lo, hd, hi - lo, seq),
                            false,
                        );
                    }
                }
            });
        Out {
            attn,
            q_rope,
            k_rope,
            v,
            xnorm: o.seed_compat.then(|| x.to_vec()),
            q_raw: o.qk_norm().then_some(q_raw),
            k_raw: o.qk_norm().then_some(k_raw),
        }
    }
}

/// The twin for a block of `queries` (`qb`) against all `S` keys: q from
/// the block's columns with the block's RoPE angles, k and v from every
/// position, then attention over whole rows with the given mask:
///   attn_h = softmax(q_hᵀk_g/√HD + mask)·v_gᵀ
fn query_block(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
    let (d, q, kv, seq, hd, r, qb) = (
        s.dim,
        s.q_dim(),
        s.kv_dim(),
        s.seq,
        s.head_dim,
        s.ratio(),
        s.queries,
    );
    let need = |v: Option<&'_ [f32]>, what: &str| -> Vec<f32> {
        v.unwrap_or_else(|| panic!("a block of queries reads its {what} (the runner makes it)"))
            .to_vec()
    };
    let (xq, cos_q, sin_q, mask) = (
        need(a.xnorm_block, "columns"),
        need(a.rope_cos, "RoPE angles"),
        need(a.rope_sin, "RoPE angles"),
        need(a.mask, "mask"),
    );
    let scores = Scores::of(o);
    let eps = o.norm_eps();
    let block = Shape {
        seq: qb,
        queries: qb,
        ..*s
    };
    let project = |p: Projection, rows: usize, x: &[f32], sh: &Shape| {
        let mut y = w_x(w.projection(p), x, rows, d, sh.seq);
        add_adapter(&mut y, w, o, sh, p, x, Product::Forward);
        add_bias(&mut y, w, o, p, sh.seq);
        y
    };
    let q_raw = project(Projection::Q, q, &xq, &block);
    let k_raw = project(Projection::K, kv, a.xnorm, s);
    let v = project(Projection::V, kv, a.xnorm, s);
    let norm = |x: &[f32], wn: Option<&[f32]>, n: usize| match (o.qk_norm(), wn) {
        (true, Some(wn)) => rms_norm(x, wn, wn.len(), n, eps),
        (true, None) => panic!("QK-norm is on but the layer has no QK-norm weights"),
        (false, _) => x.to_vec(),
    };
    let (qn, kn) = (norm(&q_raw, w.q_norm, qb), norm(&k_raw, w.k_norm, seq));
    let (cos, sin) = o.rope_tables(seq, hd);
    let q_rope = apply_rope(&qn, hd, qb, &cos_q, &sin_q, o.rope, 1.0);
    let k_rope = apply_rope(&kn, hd, seq, &cos, &sin, o.rope, 1.0);
    let mut attn = vec![0f32; q * qb];
    attn.par_chunks_mut(r * hd * qb)
        .enumerate()
        .for_each(|(g, attn_g)| {
            let mut p = vec![0f32; qb * seq];
            for j in 0..r {
                let h = g * r + j;
                masked_head_probs(
                    &q_rope[h * hd * qb..][..hd * qb],
                    &k_rope[g * hd * seq..][..hd * seq],
                    hd,
                    scores,
                    &mask,
                    &mut p,
                );
                // attn_h [HD, qb] = V_g [HD, S] · P_hᵀ
                matmul_serial(
                    MatRef::row_major(&v, g * hd * seq, hd, seq),
                    MatRef::row_major(&p, 0, qb, seq).t(),
                    MatMut::row_major(attn_g, j * hd * qb, hd, qb),
                    false,
                );
            }
        });
    Out {
        attn,
        q_rope,
        k_rope,
        v,
        xnorm: None,
        q_raw: o.qk_norm().then_some(q_raw),
        k_raw: o.qk_norm().then_some(k_raw),
    }
}
