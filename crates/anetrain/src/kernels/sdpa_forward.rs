//! `sdpa_forward`: a layer's attention up to (not including) the output
//! projection, with QK-norm and RoPE.
//!
//!   q = Wq·xn, k = Wk·xn, v = Wv·xn                (+ LoRA on each)
//!   q, k ← rmsnorm_per_head(q)·wq_norm, …          (QK-norm, when on)
//!   attn_h = softmax(rope(q_h)ᵀ·rope(k_g)/√HD + causal)·v_gᵀ,  g = h / ratio
//!
//! The `ratio` query heads that share a KV head are folded along the
//! sequence (`[1, KV, ratio·S, HD]`), so K and V are never duplicated.
//! Outputs keep what the backward needs: roped q and k, v, and (with
//! QK-norm) the pre-norm q and k.

use super::prelude::*;
use rayon::prelude::*;

use super::maths::{add_adapter, apply_rope, causal_blocks, head_probs, head_rms_norm, w_x};
use super::{BLOB_COS, BLOB_SIN};
use linalg::{matmul_serial, MatMut, MatRef};

pub struct SdpaForward;

activations! {
    /// The normed layer input `[D, S]`.
    Acts { xnorm: Port::Xnorm }
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
        b.columns(Port::Xnorm, d, seq, Activation)
            .columns(Port::Weight(Projection::Q), d, q, Transposed)
            .columns(Port::Weight(Projection::K), d, kv, Transposed)
            .columns(Port::Weight(Projection::V), d, kv, Transposed);
        if o.qk_norm {
            // Two [HD] vectors in one column each (each in a column group
            // of its own in aligned layouts), then padding so the input
            // width stays a multiple of 16 like the other kernels'.
            b.columns(Port::QNorm, s.head_dim, 1, Activation)
                .columns(Port::KNorm, s.head_dim, 1, Activation)
                .pad_spatial_to(16);
        }
        b.output(Port::Attn, q)
            .output(Port::QRope, q)
            .output(Port::KRope, kv)
            .output(Port::V, kv);
        if o.seed_compat {
            b.output(Port::Xnorm, d);
        }
        if o.qk_norm {
            b.output(Port::QRaw, q).output(Port::KRaw, kv);
        }
    }

    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let (kvh, r, seq, hd) = (s.kv_heads, s.ratio(), s.seq, s.head_dim);
        let xt = g.act_rows(Port::Xnorm)?;
        let mut projected = vec![];
        for (&(p, product), name) in Self::PROJECTIONS.iter().zip(["q_mm", "k_mm", "v_mm"]) {
            let y = g.project(name, &xt, Port::Weight(p))?;
            projected.push(g.with_adapter(y, &xt, p, product, o)?);
        }
        let [qm, km, vm] = <[Value; 3]>::try_from(projected).expect("three projections");
        let mut q = g.rows_to_heads("q", &qm, s.heads)?;
        let mut k = g.rows_to_heads("k", &km, kvh)?;
        let v = g.rows_to_heads("v", &vm, kvh)?;
        if o.qk_norm {
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
        } else {
            (
                g.rope_by_matrix("q_rope", &q, &cos, &sin)?,
                g.rope_by_matrix("k_rope", &k, &cos, &sin)?,
            )
        };
        // Fold the R query heads of each KV head along the sequence.
        let qf = g.reshape("q_fold", &q_rope, &[1, kvh, r * seq, hd])?;
        let probs = g.attention_probs(&qf, &k_rope, s)?;
        let a = g.matmul("attn_fold", &probs, &v, false, false)?;
        let a = g.reshape("attn_heads", &a, &[1, s.heads, seq, hd])?;
        let attn = g.heads_rows_to_channels("attn", &a)?;
        let qc = g.heads_rows_to_channels("q_rope_out", &q_rope)?;
        let kc = g.heads_rows_to_channels("k_rope_out", &k_rope)?;
        let vc = g.rows_to_channels("v_out", &vm)?;
        let mut outs = vec![attn, qc, kc, vc];
        if o.seed_compat {
            outs.push(g.region(Port::Xnorm)?);
        }
        if o.qk_norm {
            outs.push(g.rows_to_channels("q_raw", &qm)?);
            outs.push(g.rows_to_channels("k_raw", &km)?);
        }
        Ok(outs)
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        let (d, q, kv, seq, hd, r) = (s.dim, s.q_dim(), s.kv_dim(), s.seq, s.head_dim, s.ratio());
        let scale = o.constant(1.0 / (hd as f64).sqrt());
        let eps = o.norm_eps();
        let x = a.xnorm;
        let project = |p: Projection, rows: usize| {
            let mut y = w_x(w.projection(p), x, rows, d, seq);
            add_adapter(&mut y, w, o, s, p, x, Product::Forward);
            y
        };
        let (q_raw, k_raw, v) = (
            project(Projection::Q, q),
            project(Projection::K, kv),
            project(Projection::V, kv),
        );
        let (qn, kn) = if o.qk_norm {
            let norm = |name: &str, x: &[f32], wn: Option<&[f32]>| {
                let wn = wn.unwrap_or_else(|| panic!("QK-norm is on but the layer has no {name}"));
                head_rms_norm(x, wn, hd, seq, eps)
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
                        scale,
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
            q_raw: o.qk_norm.then_some(q_raw),
            k_raw: o.qk_norm.then_some(k_raw),
        }
    }
}
