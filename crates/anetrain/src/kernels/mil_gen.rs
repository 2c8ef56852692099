//! MIL generators for the kernel set, written with the typed builder. Slice
//! offsets come from the kernel's layout; shape-like constants are named
//! after their values (`sh_1_4_16_32`), so equal constants are declared once.
//!
//! The matmul pattern (reshape, transpose, matmul, transpose, reshape around
//! `[1, C, 1, S]` activations) is the one the seed's programs use and the
//! ANE compiler is known to accept.

use mil::builder::{FunctionBuilder, Value};
use mil::ir::Function;
use mil::{DType, Result, Ty};

use super::layout::KernelLayout;
use super::{KernelKind, KernelOptions, Product, Rope, Shape, BLOB_COS, BLOB_MASK, BLOB_SIN};
use crate::lora::Target;

const F16: DType = DType::Fp16;

struct Gen<'a> {
    b: FunctionBuilder,
    x: Value,
    layout: &'a KernelLayout,
    blobs: Vec<&'static str>,
    regions: std::collections::HashMap<String, Value>,
}

fn key(v: &[i64]) -> String {
    v.iter()
        .map(|d| d.to_string().replace('-', "m"))
        .collect::<Vec<_>>()
        .join("_")
}

impl<'a> Gen<'a> {
    fn new(layout: &'a KernelLayout) -> Gen<'a> {
        let mut b = FunctionBuilder::new("main", "ios18");
        let x = b.input(
            "x",
            Ty::tensor(F16, [1, layout.in_channels, 1, layout.in_spatial]),
        );
        Gen {
            b,
            x,
            layout,
            blobs: vec![],
            regions: Default::default(),
        }
    }

    fn ints(&mut self, prefix: &str, v: &[i64]) -> Result<Value> {
        self.b.ints(&format!("{prefix}_{}", key(v)), v)
    }

    fn flag(&mut self, v: bool) -> Result<Value> {
        self.b.bool(if v { "bT" } else { "bF" }, v)
    }

    /// The input region `name` as `[1, C, 1, W]`.
    fn region(&mut self, name: &str) -> Result<Value> {
        if let Some(v) = self.regions.get(name) {
            return Ok(v.clone());
        }
        let (begin, size) = self.layout.region(name).begin_size();
        let bv = self.ints("begin", &begin)?;
        let sv = self.ints("size", &size)?;
        let x = self.x.clone();
        let v = self.b.slice_by_size(name, &x, &bv, &sv)?;
        self.regions.insert(name.into(), v.clone());
        Ok(v)
    }

    fn reshape(&mut self, out: &str, x: &Value, dims: &[usize]) -> Result<Value> {
        let d: Vec<i64> = dims.iter().map(|&v| v as i64).collect();
        let s = self.ints("sh", &d)?;
        self.b.reshape(out, x, &s)
    }

    fn transpose(&mut self, out: &str, x: &Value, perm: &[i64]) -> Result<Value> {
        let p = self.ints("perm", perm)?;
        self.b.transpose(out, x, &p)
    }

    fn matmul(&mut self, out: &str, x: &Value, y: &Value, tx: bool, ty: bool) -> Result<Value> {
        let (fx, fy) = (self.flag(tx)?, self.flag(ty)?);
        self.b.matmul(out, x, y, &fx, &fy)
    }

    fn scalar(&mut self, name: &str, v: f64) -> Result<Value> {
        self.b.float(name, F16, v)
    }

    fn concat(&mut self, out: &str, values: &[&Value], axis: i64) -> Result<Value> {
        let ax = self.b.int(&format!("axis_{}", key(&[axis])), axis)?;
        let il = self.flag(false)?;
        self.b.concat(out, values, &ax, &il)
    }

    fn blob(&mut self, name: &str, dims: [usize; 4], file: &'static str) -> Result<Value> {
        if !self.blobs.contains(&file) {
            self.blobs.push(file);
        }
        self.b.blob(name, Ty::tensor(F16, dims), file)
    }

    /// An activation region `[1, C, 1, S]` as the matmul left operand `[1, 1, S, C]`.
    fn act_rows(&mut self, name: &str) -> Result<Value> {
        let a = self.region(name)?;
        let (c, s) = (a.dims()[1], a.dims()[3]);
        let a2 = self.reshape(&format!("{name}_2d"), &a, &[1, 1, c, s])?;
        self.transpose(&format!("{name}_t"), &a2, &[0, 1, 3, 2])
    }

    /// `act_t [1,1,S,C] · region(w) [C, N]` → `[1, 1, S, N]`.
    fn project(&mut self, out: &str, act_t: &Value, w: &str) -> Result<Value> {
        let wr = self.region(w)?;
        let (c, n) = (wr.dims()[1], wr.dims()[3]);
        let w2 = self.reshape(&format!("{w}_2d"), &wr, &[1, 1, c, n])?;
        self.matmul(out, act_t, &w2, false, false)
    }

    /// Adds projection `t`'s LoRA branch, if it has one, to the
    /// projection `y [1, 1, S, N]` of `act_t [1, 1, S, C]`:
    /// forward y + s·(x·Aᵀ)·Bᵀ, backward y + s·(dy·B)·A.
    fn with_adapter(
        &mut self,
        y: Value,
        act_t: &Value,
        t: Target,
        product: Product,
        o: &KernelOptions,
    ) -> Result<Value> {
        let Some((_, scale)) = o.adapter(t) else {
            return Ok(y);
        };
        let w = t.region();
        let (a, b) = t.adapter_regions();
        let low = match product {
            // A and B stored transposed: [in, r] and [r, out].
            Product::Forward => {
                let xa = self.project(&format!("{w}_lora_xa"), act_t, a)?;
                self.project(&format!("{w}_lora_y"), &xa, b)?
            }
            // A [r, in] and B [out, r] as is.
            Product::ForwardRows => {
                let ar = self.region(a)?;
                let (r, inp) = (ar.dims()[1], ar.dims()[3]);
                let a2 = self.reshape(&format!("{a}_2d"), &ar, &[1, 1, r, inp])?;
                let xa = self.matmul(&format!("{w}_lora_xa"), act_t, &a2, false, true)?;
                let br = self.region(b)?;
                let out = br.dims()[1];
                let b2 = self.reshape(&format!("{b}_2d"), &br, &[1, 1, out, r])?;
                self.matmul(&format!("{w}_lora_y"), &xa, &b2, false, true)?
            }
            Product::Backward => {
                let yb = self.project(&format!("{w}_lora_yb"), act_t, b)?;
                self.project(&format!("{w}_lora_y"), &yb, a)?
            }
        };
        let sc = self.scalar("lora_scale", scale)?;
        let scaled = self.b.mul(&format!("{w}_lora_ys"), &low, &sc)?;
        self.b.add(&format!("{w}_plus_lora"), &y, &scaled)
    }

    /// `[1, 1, S, N]` → channel-first `[1, N, 1, S]`.
    fn rows_to_channels(&mut self, out: &str, y: &Value) -> Result<Value> {
        let (s, n) = (y.dims()[2], y.dims()[3]);
        let t = self.transpose(&format!("{out}_t"), y, &[0, 1, 3, 2])?;
        self.reshape(out, &t, &[1, n, 1, s])
    }

    /// `[1, 1, S, heads·HD]` → `[1, heads, S, HD]`.
    fn rows_to_heads(&mut self, out: &str, y: &Value, heads: usize) -> Result<Value> {
        let (s, n) = (y.dims()[2], y.dims()[3]);
        let r = self.reshape(&format!("{out}_r"), y, &[1, s, heads, n / heads])?;
        self.transpose(out, &r, &[0, 2, 1, 3])
    }

    /// Channel-first `[1, heads·HD, 1, S]` → `[1, heads, S, HD]`.
    fn channels_to_heads(&mut self, out: &str, x: &Value, heads: usize) -> Result<Value> {
        let (n, s) = (x.dims()[1], x.dims()[3]);
        let r = self.reshape(&format!("{out}_r"), x, &[1, heads, n / heads, s])?;
        self.transpose(out, &r, &[0, 1, 3, 2])
    }

    /// `[1, heads, S, HD]` → channel-first `[1, heads·HD, 1, S]`.
    fn heads_rows_to_channels(&mut self, out: &str, x: &Value) -> Result<Value> {
        let (h, s, hd) = (x.dims()[1], x.dims()[2], x.dims()[3]);
        let t = self.transpose(&format!("{out}_t"), x, &[0, 1, 3, 2])?;
        self.reshape(out, &t, &[1, h * hd, 1, s])
    }

    /// Per-head RMSNorm over the last axis with weight region `w` (`[HD]`):
    /// y = x · rsqrt(mean(x²) + eps) · w.
    fn head_rms_norm(&mut self, out: &str, x: &Value, w: &str, eps: f64) -> Result<Value> {
        let hd = x.dims()[3];
        let sq = self.b.mul(&format!("{out}_sq"), x, x)?;
        let axes = self.ints("axes", &[-1])?;
        let keep = self.flag(true)?;
        let ms = self
            .b
            .reduce("reduce_mean", &format!("{out}_ms"), &sq, &axes, &keep)?;
        let e = self.scalar(&format!("{out}_eps"), eps)?;
        let r = self.b.op(
            "rsqrt",
            &format!("{out}_rs"),
            &[("x", (&ms).into()), ("epsilon", (&e).into())],
        )?;
        let xn = self.b.mul(&format!("{out}_n"), x, &r)?;
        let wr = self.region(w)?;
        let w4 = self.reshape(&format!("{w}_4d"), &wr, &[1, 1, 1, hd])?;
        self.b.mul(out, &xn, &w4)
    }

    /// x·cos + rotate(x)·sin for `x [1, heads, S, HD]`.
    fn rope(
        &mut self,
        out: &str,
        x: &Value,
        cos: &Value,
        sin: &Value,
        rope: Rope,
    ) -> Result<Value> {
        let (h, s, hd) = (x.dims()[1], x.dims()[2], x.dims()[3]);
        let neg = self.scalar("neg1", -1.0)?;
        let rot = match rope {
            Rope::HalfSplit => {
                // rotate_half(x) = concat(-x[..., HD/2:], x[..., :HD/2])
                let half = (hd / 2) as i64;
                let size = self.ints("size", &[1, h as i64, s as i64, half])?;
                let b0 = self.ints("begin", &[0, 0, 0, 0])?;
                let b1 = self.ints("begin", &[0, 0, 0, half])?;
                let x1 = self.b.slice_by_size(&format!("{out}_x1"), x, &b0, &size)?;
                let x2 = self.b.slice_by_size(&format!("{out}_x2"), x, &b1, &size)?;
                let nx2 = self.b.mul(&format!("{out}_nx2"), &x2, &neg)?;
                self.concat(&format!("{out}_rot"), &[&nx2, &x1], 3)?
            }
            Rope::Interleaved => {
                // pairs (2i, 2i+1) → (-x[2i+1], x[2i])
                let pairs = (s * hd / 2) as i64;
                let p = self.reshape(&format!("{out}_p"), x, &[1, h, s * hd / 2, 2])?;
                let size = self.ints("size", &[1, h as i64, pairs, 1])?;
                let b0 = self.ints("begin", &[0, 0, 0, 0])?;
                let b1 = self.ints("begin", &[0, 0, 0, 1])?;
                let even = self.b.slice_by_size(&format!("{out}_e"), &p, &b0, &size)?;
                let odd = self.b.slice_by_size(&format!("{out}_o"), &p, &b1, &size)?;
                let nodd = self.b.mul(&format!("{out}_no"), &odd, &neg)?;
                let r = self.concat(&format!("{out}_rp"), &[&nodd, &even], 3)?;
                self.reshape(&format!("{out}_rot"), &r, &[1, h, s, hd])?
            }
        };
        let xc = self.b.mul(&format!("{out}_c"), x, cos)?;
        let xs = self.b.mul(&format!("{out}_s"), &rot, sin)?;
        self.b.add(out, &xc, &xs)
    }

    /// softmax(q·kᵀ/√HD + mask) for folded queries `q [1, KV, R·S, HD]`,
    /// keys `k [1, KV, S, HD]`.
    fn attention_probs(&mut self, q: &Value, k: &Value, s: &Shape) -> Result<Value> {
        let scores = self.matmul("scores", q, k, false, true)?;
        let sc = self.scalar("scale", 1.0 / (s.head_dim as f64).sqrt())?;
        let scaled = self.b.mul("scaled", &scores, &sc)?;
        let mask = self.blob("mask", [1, 1, s.ratio() * s.seq, s.seq], BLOB_MASK)?;
        let masked = self.b.add("masked", &scaled, &mask)?;
        let ax = self.b.int("axis_m1", -1)?;
        self.b.softmax("probs", &masked, &ax)
    }

    fn finish(mut self, out: &Value) -> Result<(Function, Vec<&'static str>)> {
        self.b.output(out);
        Ok((self.b.finish()?, self.blobs))
    }
}

/// Builds kernel `kind`; returns the function and the blob files it reads.
pub fn generate(
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
    layout: &KernelLayout,
) -> Result<(Function, Vec<&'static str>)> {
    let mut g = Gen::new(layout);
    let (kvh, r, seq, hd) = (s.kv_heads, s.ratio(), s.seq, s.head_dim);
    let out = match kind {
        KernelKind::SdpaForward => {
            let xt = g.act_rows("xnorm")?;
            let qm = g.project("q_mm", &xt, "wq")?;
            let qm = g.with_adapter(qm, &xt, Target::Q, Product::Forward, o)?;
            let km = g.project("k_mm", &xt, "wk")?;
            let km = g.with_adapter(km, &xt, Target::K, Product::Forward, o)?;
            let vm = g.project("v_mm", &xt, "wv")?;
            let vm = g.with_adapter(vm, &xt, Target::V, Product::Forward, o)?;
            let mut q = g.rows_to_heads("q", &qm, s.heads)?;
            let mut k = g.rows_to_heads("k", &km, kvh)?;
            let v = g.rows_to_heads("v", &vm, kvh)?;
            if o.qk_norm {
                q = g.head_rms_norm("q_normed", &q, "q_norm", o.eps)?;
                k = g.head_rms_norm("k_normed", &k, "k_norm", o.eps)?;
            }
            let cos = g.blob("rope_cos", [1, 1, seq, hd], BLOB_COS)?;
            let sin = g.blob("rope_sin", [1, 1, seq, hd], BLOB_SIN)?;
            let q_rope = g.rope("q_rope", &q, &cos, &sin, o.rope)?;
            let k_rope = g.rope("k_rope", &k, &cos, &sin, o.rope)?;
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
                outs.push(g.region("xnorm")?);
            }
            if o.qk_norm {
                outs.push(g.rows_to_channels("q_raw", &qm)?);
                outs.push(g.rows_to_channels("k_raw", &km)?);
            }
            let refs: Vec<&Value> = outs.iter().collect();
            g.concat("out", &refs, 1)?
        }
        KernelKind::WoForward => {
            let at = g.act_rows("attn")?;
            let y = g.project("o_mm", &at, "wo")?;
            let y = g.with_adapter(y, &at, Target::O, Product::Forward, o)?;
            g.rows_to_channels("o", &y)?
        }
        KernelKind::FfnForward => {
            let xt = g.act_rows("x2norm")?;
            let h1m = g.project("h1_mm", &xt, "w1")?;
            let h1m = g.with_adapter(h1m, &xt, Target::Gate, Product::Forward, o)?;
            let h3m = g.project("h3_mm", &xt, "w3")?;
            let h3m = g.with_adapter(h3m, &xt, Target::Up, Product::Forward, o)?;
            let h1 = g.rows_to_channels("h1", &h1m)?;
            let h3 = g.rows_to_channels("h3", &h3m)?;
            // silu(h1)·h3 with silu = h1·sigmoid(h1)
            let sig = g.b.sigmoid("sig", &h1)?;
            let silu = g.b.mul("silu", &h1, &sig)?;
            let gate = g.b.mul("gate", &silu, &h3)?;
            let hid = s.hidden;
            let g2 = g.reshape("gate_2d", &gate, &[1, 1, hid, seq])?;
            let gt = g.transpose("gate_t", &g2, &[0, 1, 3, 2])?;
            let w2 = g.region("w2")?;
            let w22 = g.reshape("w2_2d", &w2, &[1, 1, s.dim, hid])?;
            let fm = g.matmul("ffn_mm", &gt, &w22, false, true)?;
            let fm = g.with_adapter(fm, &gt, Target::Down, Product::ForwardRows, o)?;
            let ffn = g.rows_to_channels("ffn", &fm)?;
            let x2 = g.region("x2")?;
            let branch = if o.residual_scale == 1.0 {
                ffn
            } else {
                let a = g.scalar("res_alpha", o.residual_scale)?;
                g.b.mul("ffn_scaled", &ffn, &a)?
            };
            let x_next = g.b.add("x_next", &x2, &branch)?;
            g.concat("out", &[&x_next, &h1, &h3, &gate], 1)?
        }
        KernelKind::FfnBackwardW2 | KernelKind::WoBackward | KernelKind::QBackward => {
            let (act, w, out) = match kind {
                KernelKind::FfnBackwardW2 => ("dffn", Target::Down, "dgate"),
                KernelKind::WoBackward => ("dy", Target::O, "da"),
                _ => ("dq", Target::Q, "dx"),
            };
            let at = g.act_rows(act)?;
            let y = g.project(&format!("{out}_mm"), &at, w.region())?;
            let y = g.with_adapter(y, &at, w, Product::Backward, o)?;
            g.rows_to_channels(out, &y)?
        }
        KernelKind::FfnBackwardW13 | KernelKind::KvBackward => {
            let (a1, a2, w1, w2) = match kind {
                KernelKind::FfnBackwardW13 => ("dh1", "dh3", Target::Gate, Target::Up),
                _ => ("dk", "dv", Target::K, Target::V),
            };
            let t1 = g.act_rows(a1)?;
            let t2 = g.act_rows(a2)?;
            let y1 = g.project(&format!("{a1}_mm"), &t1, w1.region())?;
            let y1 = g.with_adapter(y1, &t1, w1, Product::Backward, o)?;
            let y2 = g.project(&format!("{a2}_mm"), &t2, w2.region())?;
            let y2 = g.with_adapter(y2, &t2, w2, Product::Backward, o)?;
            let y = g.b.add("dx_mm", &y1, &y2)?;
            g.rows_to_channels("dx", &y)?
        }
        KernelKind::SdpaBackward1 => {
            let qc = g.region("q_rope")?;
            let kc = g.region("k_rope")?;
            let vc = g.region("v")?;
            let dac = g.region("da")?;
            let q = g.channels_to_heads("q", &qc, s.heads)?;
            let k = g.channels_to_heads("k", &kc, kvh)?;
            let v = g.channels_to_heads("v_h", &vc, kvh)?;
            let da = g.channels_to_heads("da_h", &dac, s.heads)?;
            let qf = g.reshape("q_fold", &q, &[1, kvh, r * seq, hd])?;
            let daf = g.reshape("da_fold", &da, &[1, kvh, r * seq, hd])?;
            let probs = g.attention_probs(&qf, &k, s)?;
            // dV = Pᵀ·dA (summed over the folded group), dP = dA·Vᵀ
            let dv = g.matmul("dv_h", &probs, &daf, true, false)?;
            let dp = g.matmul("dp_fold", &daf, &v, false, true)?;
            let dvc = g.heads_rows_to_channels("dv", &dv)?;
            let sc = s.score_channels();
            let pf = g.reshape("probs_out", &probs, &[1, sc, 1, seq])?;
            let dpf = g.reshape("dp_out", &dp, &[1, sc, 1, seq])?;
            g.concat("out", &[&dvc, &pf, &dpf], 1)?
        }
        KernelKind::SdpaBackward2 => {
            let pf = g.region("probs")?;
            let dpf = g.region("dp")?;
            let qc = g.region("q_rope")?;
            let kc = g.region("k_rope")?;
            let probs = g.reshape("probs_fold", &pf, &[1, kvh, r * seq, seq])?;
            let dp = g.reshape("dp_fold", &dpf, &[1, kvh, r * seq, seq])?;
            let q = g.channels_to_heads("q", &qc, s.heads)?;
            let k = g.channels_to_heads("k", &kc, kvh)?;
            let qf = g.reshape("q_fold", &q, &[1, kvh, r * seq, hd])?;
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
            let dqh = g.reshape("dq_h", &dq, &[1, s.heads, seq, hd])?;
            let dqc = g.heads_rows_to_channels("dq", &dqh)?;
            let dkc = g.heads_rows_to_channels("dk", &dk)?;
            g.concat("out", &[&dqc, &dkc], 1)?
        }
    };
    g.finish(&out)
}
