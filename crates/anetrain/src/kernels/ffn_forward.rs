//! `ffn_forward`: the gated feed-forward block and its residual,
//!
//!   h1 = W1·x2n,  h3 = W3·x2n,  gate = act(h1)·h3,  x' = x2 + α·W2·gate
//!
//! (+ LoRA on each projection); act is silu (SwiGLU) or GELU's tanh form
//! (GeGLU, as x·σ(2β(x + κx³))); h1, h3 and gate are kept for the
//! backward. A layer that norms the MLP's output before the residual
//! (`Norms::Sandwich`) has no x2: the program returns W2·gate.

use super::prelude::*;

use super::maths::{add_adapter, geglu_forward, swiglu_forward, w_x, GELU_2BETA, GELU_KAPPA};
use crate::model::layer::Mlp;

pub struct FfnForward;

activations! {
    /// The normed input and the residual stream, each `[D, S]` (no
    /// residual where a norm follows the MLP).
    Acts { x2norm: Port::X2norm; optional x2: Port::X2 }
}

outputs! {
    /// The next layer's input `[D, S]` and the hidden activations `[H, S]`.
    Out {
        x_next: Port::XNext,
        h1: Port::H1,
        h3: Port::H3,
        gate: Port::Gate,
    }
}

impl Kernel for FfnForward {
    const KIND: KernelKind = KernelKind::FfnForward;
    const PROJECTIONS: &'static [(Projection, Product)] = &[
        (Projection::Gate, Product::Forward),
        (Projection::Up, Product::Forward),
        (Projection::Down, Product::ForwardRows),
    ];
    type Acts<'a> = Acts<'a>;
    type Out = Out;

    fn layout(b: &mut LayoutBuilder, s: &Shape, o: &KernelOptions) {
        let (d, h, seq) = (s.dim, s.hidden, s.seq);
        b.columns(Port::X2norm, d, seq, Activation);
        if !o.layer.norms.after() {
            b.columns(Port::X2, d, seq, Activation);
        }
        b.columns(Port::Weight(Projection::Gate), d, h, Transposed)
            .columns(Port::Weight(Projection::Up), d, h, Transposed)
            .columns(Port::Weight(Projection::Down), d, h, AsIs)
            .output(Port::XNext, d)
            .output(Port::H1, h)
            .output(Port::H3, h)
            .output(Port::Gate, h);
    }

    fn mil(g: &mut Gen, s: &Shape, o: &KernelOptions) -> mil::Result<Vec<Value>> {
        let xt = g.act_rows(Port::X2norm)?;
        let h1m = g.project("h1_mm", &xt, Port::Weight(Projection::Gate))?;
        let h1m = g.with_adapter(h1m, &xt, Projection::Gate, Product::Forward, o)?;
        let h3m = g.project("h3_mm", &xt, Port::Weight(Projection::Up))?;
        let h3m = g.with_adapter(h3m, &xt, Projection::Up, Product::Forward, o)?;
        let h1 = g.rows_to_channels("h1", &h1m)?;
        let h3 = g.rows_to_channels("h3", &h3m)?;
        let act = match o.layer.mlp {
            // silu(h1) = h1·σ(h1)
            Mlp::SwiGlu => {
                let sig = g.b.sigmoid("sig", &h1)?;
                g.b.mul("silu", &h1, &sig)?
            }
            // gelu(h1) = h1·σ(2β·h1·(1 + κ·h1²)): the device has no gelu
            // (Orion issue #10: "No gelu"; digested in the ANE runtime
            // notes, "Ops"), its sigmoid is SwiGLU's.
            Mlp::GeGlu => {
                let sq = g.b.mul("h1_sq", &h1, &h1)?;
                let k = g.scalar("gelu_kappa", GELU_KAPPA as f64)?;
                let one = g.scalar("gelu_one", 1.0)?;
                let beta = g.scalar("gelu_2beta", GELU_2BETA as f64)?;
                let ksq = g.b.mul("gelu_ksq", &sq, &k)?;
                let poly = g.b.add("gelu_poly", &ksq, &one)?;
                let inner = g.b.mul("gelu_inner", &h1, &poly)?;
                let z = g.b.mul("gelu_z", &inner, &beta)?;
                let sig = g.b.sigmoid("gelu_sig", &z)?;
                g.b.mul("gelu", &h1, &sig)?
            }
        };
        let gate = g.b.mul("gate", &act, &h3)?;
        let hid = s.hidden;
        let g2 = g.reshape("gate_2d", &gate, &[1, 1, hid, s.seq])?;
        let gt = g.transpose("gate_t", &g2, &[0, 1, 3, 2])?;
        // The down projection feeds the residual stream: pre-scaled past
        // the matmul output cliff (KernelOptions::cliff_prescale).
        let (gt, undo) = g.prescale("gate_scaled", &gt, o)?;
        let w2 = g.region(Port::Weight(Projection::Down))?;
        let w22 = g.reshape("w2_2d", &w2, &[1, 1, s.dim, hid])?;
        let fm = g.matmul("ffn_mm", &gt, &w22, false, true)?;
        let fm = g.with_adapter(fm, &gt, Projection::Down, Product::ForwardRows, o)?;
        let ffn = g.rows_to_channels("ffn", &fm)?;
        // α and the pre-scale's inverse in one product.
        let alpha = o.residual_scale * undo.unwrap_or(1.0);
        let branch = if alpha == 1.0 {
            ffn
        } else {
            let a = g.scalar("res_alpha", alpha)?;
            g.b.mul("ffn_scaled", &ffn, &a)?
        };
        let x_next = match o.layer.norms.after() {
            false => {
                let x2 = g.region(Port::X2)?;
                g.b.add("x_next", &x2, &branch)?
            }
            true => branch,
        };
        Ok(vec![x_next, h1, h3, gate])
    }

    fn cpu(s: &Shape, o: &KernelOptions, w: &LayerWeights, a: &Acts) -> Out {
        let (d, hid, seq) = (s.dim, s.hidden, s.seq);
        let x = a.x2norm;
        let mut h1 = w_x(w.projection(Projection::Gate), x, hid, d, seq);
        add_adapter(&mut h1, w, o, s, Projection::Gate, x, Product::Forward);
        let mut h3 = w_x(w.projection(Projection::Up), x, hid, d, seq);
        add_adapter(&mut h3, w, o, s, Projection::Up, x, Product::Forward);
        let mut gate = vec![0f32; h1.len()];
        match o.layer.mlp {
            Mlp::SwiGlu => swiglu_forward(&h1, &h3, &mut gate),
            Mlp::GeGlu => {
                let (b, k) = (o.constant(GELU_2BETA as f64), o.constant(GELU_KAPPA as f64));
                geglu_forward(&h1, &h3, &mut gate, b, k)
            }
        }
        let mut ffn = w_x(w.projection(Projection::Down), &gate, d, hid, seq);
        add_adapter(
            &mut ffn,
            w,
            o,
            s,
            Projection::Down,
            &gate,
            Product::ForwardRows,
        );
        let alpha = o.constant(o.residual_scale);
        let x_next = match a.x2 {
            Some(x2) => x2
                .iter()
                .zip(&ffn)
                .map(|(&x2, &f)| x2 + alpha * f)
                .collect(),
            None => ffn.iter().map(|&f| alpha * f).collect(),
        };
        Out {
            x_next,
            h1,
            h3,
            gate,
        }
    }
}
