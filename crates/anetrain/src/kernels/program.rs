//! The MIL building blocks the kernels are written with ([`Gen`], over the
//! typed builder). Slice offsets come from the kernel's layout; shape-like
//! constants are named after their values (`sh_1_4_16_32`), so equal
//! constants are declared once.
//!
//! The matmul pattern (reshape, transpose, matmul, transpose, reshape around
//! `[1, C, 1, S]` activations) is the one the seed's programs use and the
//! ANE compiler is known to accept.

use mil::builder::{FunctionBuilder, Value};
use mil::ir::Function;
use mil::{DType, Result, Ty};

use super::io::Port;
use super::layout::KernelLayout;
use super::{KernelOptions, Product, Rope, Shape, BLOB_MASK};
use crate::model::Projection;

const F16: DType = DType::Fp16;

/// A kernel program under construction: its one packed input `x`, the
/// layout that says where each region is, and the blobs it reads.
pub struct Gen<'a> {
    pub b: FunctionBuilder,
    x: Value,
    layout: &'a KernelLayout,
    blobs: Vec<String>,
    regions: std::collections::HashMap<Port, Value>,
    /// The input viewed as `[1, C, W/view, view]`, once made.
    grouped: Option<Value>,
    /// Matmul contractions are padded with zeros to a multiple of this
    /// (1: as they are; see [`Gen::matmul`]).
    contraction_multiple: usize,
}

fn key(v: &[i64]) -> String {
    v.iter()
        .map(|d| d.to_string().replace('-', "m"))
        .collect::<Vec<_>>()
        .join("_")
}

impl<'a> Gen<'a> {
    pub fn new(layout: &'a KernelLayout) -> Gen<'a> {
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
            grouped: None,
            contraction_multiple: 1,
        }
    }

    /// Pad every matmul contraction with zeros to a multiple of `m`.
    pub fn with_contraction_multiple(mut self, m: usize) -> Gen<'a> {
        self.contraction_multiple = m.max(1);
        self
    }

    pub fn ints(&mut self, prefix: &str, v: &[i64]) -> Result<Value> {
        self.b.ints(&format!("{prefix}_{}", key(v)), v)
    }

    pub fn flag(&mut self, v: bool) -> Result<Value> {
        self.b.bool(if v { "bT" } else { "bF" }, v)
    }

    /// The input region of `port` as `[1, C, 1, W]`.
    ///
    /// A region at width offset 0 is one `slice_by_size`. Elsewhere, in an
    /// aligned layout (`view` columns per group), the input is viewed as
    /// `[1, C, W/view, view]` and the region's column groups are cut along
    /// axis 2, then reshaped back (and trimmed from width offset 0 when
    /// narrower than its groups): no slice begins at a nonzero offset on
    /// the last axis, which M1–M3 compute through a crop that turns
    /// |v| > 4094 into ±inf (ANEForge docs/numeric-cliffs.md, "Width-offset
    /// slice saturation": "moving the offset to another axis" avoids it).
    /// Reshapes of a contiguous tensor move no value, so the region's
    /// values are exactly the input's. Seed layouts (`view` 0) slice at
    /// their width offsets as the seed does.
    pub fn region(&mut self, port: Port) -> Result<Value> {
        if let Some(v) = self.regions.get(&port) {
            return Ok(v.clone());
        }
        let r = self.layout.region(port).clone();
        let view = self.layout.view;
        let v = if r.spatial.start == 0 || view == 0 {
            let (begin, size) = r.begin_size();
            let bv = self.ints("begin", &begin)?;
            let sv = self.ints("size", &size)?;
            let x = self.x.clone();
            self.b.slice_by_size(port.name(), &x, &bv, &sv)?
        } else {
            let l = self.layout;
            let grouped = match self.grouped.clone() {
                Some(g) => g,
                None => {
                    let x = self.x.clone();
                    let g = self.reshape(
                        "x_groups",
                        &x,
                        &[1, l.in_channels, l.in_spatial / view, view],
                    )?;
                    self.grouped = Some(g.clone());
                    g
                }
            };
            let (c, w) = (r.channels.len(), r.spatial.len());
            let groups = w.div_ceil(view);
            let bv = self.ints(
                "begin",
                &[
                    0,
                    r.channels.start as i64,
                    (r.spatial.start / view) as i64,
                    0,
                ],
            )?;
            let sv = self.ints("size", &[1, c as i64, groups as i64, view as i64])?;
            let name = port.name();
            let cut = self
                .b
                .slice_by_size(&format!("{name}_groups"), &grouped, &bv, &sv)?;
            if groups * view == w {
                self.reshape(name, &cut, &[1, c, 1, w])?
            } else {
                let flat =
                    self.reshape(&format!("{name}_wide"), &cut, &[1, c, 1, groups * view])?;
                let b0 = self.ints("begin", &[0, 0, 0, 0])?;
                let sz = self.ints("size", &[1, c as i64, 1, w as i64])?;
                self.b.slice_by_size(name, &flat, &b0, &sz)?
            }
        };
        self.regions.insert(port, v.clone());
        Ok(v)
    }

    pub fn reshape(&mut self, out: &str, x: &Value, dims: &[usize]) -> Result<Value> {
        let d: Vec<i64> = dims.iter().map(|&v| v as i64).collect();
        let s = self.ints("sh", &d)?;
        self.b.reshape(out, x, &s)
    }

    pub fn transpose(&mut self, out: &str, x: &Value, perm: &[i64]) -> Result<Value> {
        let p = self.ints("perm", perm)?;
        self.b.transpose(out, x, &p)
    }

    /// `x·y` (either transposed). A contraction that is not a multiple of
    /// the device's (32 on every family: a head dimension of 48 or 16)
    /// gave silent zeros (maderix/ANE PR #47): both operands are extended
    /// along it with zero columns, which adds exact zeros to every sum.
    pub fn matmul(&mut self, out: &str, x: &Value, y: &Value, tx: bool, ty: bool) -> Result<Value> {
        let (rx, ry) = (x.dims().len(), y.dims().len());
        let (ax, ay) = (
            if tx { rx - 2 } else { rx - 1 },
            if ty { ry - 1 } else { ry - 2 },
        );
        let k = x.dims()[ax];
        let m = self.contraction_multiple;
        let (fx, fy) = (self.flag(tx)?, self.flag(ty)?);
        if k.is_multiple_of(m) || rx != 4 || ry != 4 {
            return self.b.matmul(out, x, y, &fx, &fy);
        }
        let to = k.next_multiple_of(m);
        let xp = self.pad_with_zeros(&format!("{out}_xk"), x, ax, to)?;
        let yp = self.pad_with_zeros(&format!("{out}_yk"), y, ay, to)?;
        self.b.matmul(out, &xp, &yp, &fx, &fy)
    }

    /// `x` extended along `axis` to `to` with zeros (a constant blob).
    fn pad_with_zeros(&mut self, out: &str, x: &Value, axis: usize, to: usize) -> Result<Value> {
        let mut dims = [0usize; 4];
        dims.copy_from_slice(x.dims());
        dims[axis] = to - dims[axis];
        let file = format!(
            "{}{}.bin",
            super::BLOB_ZEROS,
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("x")
        );
        let zeros = self.blob(&format!("{out}_zeros"), dims, &file)?;
        self.concat(out, &[x, &zeros], axis as i64)
    }

    pub fn scalar(&mut self, name: &str, v: f64) -> Result<Value> {
        self.b.float(name, F16, v)
    }

    pub fn concat(&mut self, out: &str, values: &[&Value], axis: i64) -> Result<Value> {
        let ax = self.b.int(&format!("axis_{}", key(&[axis])), axis)?;
        let il = self.flag(false)?;
        self.b.concat(out, values, &ax, &il)
    }

    pub fn blob(&mut self, name: &str, dims: [usize; 4], file: &str) -> Result<Value> {
        if !self.blobs.iter().any(|b| b == file) {
            self.blobs.push(file.to_string());
        }
        self.b.blob(name, Ty::tensor(F16, dims), file)
    }

    /// An activation region `[1, C, 1, S]` as the matmul left operand `[1, 1, S, C]`.
    pub fn act_rows(&mut self, port: Port) -> Result<Value> {
        let name = port.name();
        let a = self.region(port)?;
        let (c, s) = (a.dims()[1], a.dims()[3]);
        let a2 = self.reshape(&format!("{name}_2d"), &a, &[1, 1, c, s])?;
        self.transpose(&format!("{name}_t"), &a2, &[0, 1, 3, 2])
    }

    /// `act_t [1,1,S,C] · region(w) [C, N]` → `[1, 1, S, N]`.
    pub fn project(&mut self, out: &str, act_t: &Value, w: Port) -> Result<Value> {
        let wr = self.region(w)?;
        let w = w.name();
        let (c, n) = (wr.dims()[1], wr.dims()[3]);
        let w2 = self.reshape(&format!("{w}_2d"), &wr, &[1, 1, c, n])?;
        self.matmul(out, act_t, &w2, false, false)
    }

    /// Adds projection `t`'s bias, if the layer has one, to its projection
    /// `y [1, 1, S, N]` (the bias a column `[N, 1]` of the input).
    pub fn with_bias(&mut self, y: Value, t: Projection, o: &KernelOptions) -> Result<Value> {
        if !o.layer.biased().contains(&t) {
            return Ok(y);
        }
        let port = Port::Bias(t);
        let b = self.region(port)?;
        let n = b.dims()[1];
        let row = self.reshape(&format!("{}_row", port.name()), &b, &[1, 1, 1, n])?;
        let out = format!("{}_biased", t.region());
        self.b.add(&out, &y, &row)
    }

    /// Adds projection `t`'s LoRA branch, if it has one, to the
    /// projection `y [1, 1, S, N]` of `act_t [1, 1, S, C]`:
    /// forward y + s·(x·Aᵀ)·Bᵀ, backward y + s·(dy·B)·A.
    pub fn with_adapter(
        &mut self,
        y: Value,
        act_t: &Value,
        t: Projection,
        product: Product,
        o: &KernelOptions,
    ) -> Result<Value> {
        let Some((_, scale)) = o.adapter(t) else {
            return Ok(y);
        };
        let w = t.region();
        let (a, b) = (Port::LoraA(t), Port::LoraB(t));
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
                let a2 = self.reshape(&format!("{}_2d", a.name()), &ar, &[1, 1, r, inp])?;
                let xa = self.matmul(&format!("{w}_lora_xa"), act_t, &a2, false, true)?;
                let br = self.region(b)?;
                let out = br.dims()[1];
                let b2 = self.reshape(&format!("{}_2d", b.name()), &br, &[1, 1, out, r])?;
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

    /// `x` times [`KernelOptions::cliff_prescale`] ahead of a product, and
    /// the factor that undoes it (`None`: no pre-scale, `x` unchanged).
    pub fn prescale(
        &mut self,
        out: &str,
        x: &Value,
        o: &KernelOptions,
    ) -> Result<(Value, Option<f64>)> {
        let Some(k) = o.cliff_prescale() else {
            return Ok((x.clone(), None));
        };
        let c = self.scalar("prescale", k)?;
        Ok((self.b.mul(out, x, &c)?, Some(1.0 / k)))
    }

    /// Undoes [`Gen::prescale`] on a product's output.
    pub fn unscale(&mut self, out: &str, y: Value, undo: Option<f64>) -> Result<Value> {
        match undo {
            None => Ok(y),
            Some(u) => {
                let c = self.scalar("unscale", u)?;
                self.b.mul(out, &y, &c)
            }
        }
    }

    /// `[1, 1, S, N]` → channel-first `[1, N, 1, S]`.
    pub fn rows_to_channels(&mut self, out: &str, y: &Value) -> Result<Value> {
        let (s, n) = (y.dims()[2], y.dims()[3]);
        let t = self.transpose(&format!("{out}_t"), y, &[0, 1, 3, 2])?;
        self.reshape(out, &t, &[1, n, 1, s])
    }

    /// `[1, 1, S, heads·HD]` → `[1, heads, S, HD]`.
    pub fn rows_to_heads(&mut self, out: &str, y: &Value, heads: usize) -> Result<Value> {
        let (s, n) = (y.dims()[2], y.dims()[3]);
        let r = self.reshape(&format!("{out}_r"), y, &[1, s, heads, n / heads])?;
        self.transpose(out, &r, &[0, 2, 1, 3])
    }

    /// A query block's region `[1, C·queries/S, 1, S]` (whole rows of the
    /// surface, see [`Shape::query_rows`]) as channel-first `[1, C, 1,
    /// queries]`; a whole sequence's region as it is.
    pub fn query_channels(&mut self, port: Port, channels: usize, s: &Shape) -> Result<Value> {
        let v = self.region(port)?;
        if !s.query_block() {
            return Ok(v);
        }
        self.reshape(
            &format!("{}_block", port.name()),
            &v,
            &[1, channels, 1, s.queries],
        )
    }

    /// Channel-first `[1, C, 1, queries]` laid out as whole rows of an
    /// output `S` wide, `[1, C·queries/S, 1, S]` (the inverse of
    /// [`Gen::query_channels`]).
    pub fn query_rows_out(&mut self, out: &str, v: &Value, s: &Shape) -> Result<Value> {
        if !s.query_block() {
            return Ok(v.clone());
        }
        let c = v.dims()[1];
        self.reshape(out, v, &[1, s.query_rows(c), 1, s.seq])
    }

    /// Channel-first `[1, heads·HD, 1, S]` → `[1, heads, S, HD]`.
    pub fn channels_to_heads(&mut self, out: &str, x: &Value, heads: usize) -> Result<Value> {
        let (n, s) = (x.dims()[1], x.dims()[3]);
        let r = self.reshape(&format!("{out}_r"), x, &[1, heads, n / heads, s])?;
        self.transpose(out, &r, &[0, 1, 3, 2])
    }

    /// `[1, heads, S, HD]` → channel-first `[1, heads·HD, 1, S]`.
    pub fn heads_rows_to_channels(&mut self, out: &str, x: &Value) -> Result<Value> {
        let (h, s, hd) = (x.dims()[1], x.dims()[2], x.dims()[3]);
        let t = self.transpose(&format!("{out}_t"), x, &[0, 1, 3, 2])?;
        self.reshape(out, &t, &[1, h * hd, 1, s])
    }

    /// RMSNorm over the last axis (a head's `[HD]`, or a whole
    /// projection's) with weight region `w`:
    ///   y = x · (mean(x²) + eps)^(−1/2) · w
    /// in the pattern working ANE trainers run on hardware — add eps, then
    /// `pow(·, −0.5)` (maderix/ANE training/stories_mil.h lines 30–33) —
    /// never `rsqrt`/`sqrt` straight after a reduction. `eps` is given as
    /// `(k·ε, k)`, k·ε an fp16 normal value ([`KernelOptions::device_eps`],
    /// [`KernelOptions::whole_norm_eps`]): with k > 1 the program computes
    /// (k·mean(x²) + k·ε)^(−1/2)·√k, the same value.
    pub fn head_rms_norm(
        &mut self,
        out: &str,
        x: &Value,
        w: Port,
        (eps, k): (f64, f64),
    ) -> Result<Value> {
        let hd = x.dims()[3];
        let sq = self.b.mul(&format!("{out}_sq"), x, x)?;
        let axes = self.ints("axes", &[-1])?;
        let keep = self.flag(true)?;
        let mut ms = self
            .b
            .reduce("reduce_mean", &format!("{out}_ms"), &sq, &axes, &keep)?;
        if k != 1.0 {
            let kv = self.scalar("norm_k", k)?;
            ms = self.b.mul(&format!("{out}_kms"), &ms, &kv)?;
        }
        let e = self.scalar("norm_eps", eps)?;
        let mse = self.b.add(&format!("{out}_mse"), &ms, &e)?;
        let nh = self.scalar("neg_half", -0.5)?;
        let mut r = self.b.op(
            "pow",
            &format!("{out}_rs"),
            &[("x", (&mse).into()), ("y", (&nh).into())],
        )?;
        if k != 1.0 {
            let rk = self.scalar("norm_root_k", k.sqrt())?;
            r = self.b.mul(&format!("{out}_rsk"), &r, &rk)?;
        }
        let xn = self.b.mul(&format!("{out}_n"), x, &r)?;
        let wr = self.region(w)?;
        let w4 = self.reshape(&format!("{}_4d", w.name()), &wr, &[1, 1, 1, hd])?;
        self.b.mul(out, &xn, &w4)
    }

    /// x·cos + rotate(x)·sin for `x [1, heads, S, HD]`.
    pub fn rope(
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
            Rope::HalfSplit { .. } => {
                // rotate_half over the r rotated dimensions:
                // concat(-x[..., r/2:r], x[..., :r/2], x[..., r:]), the
                // dimensions passed through kept (their sine is 0).
                let r = rope.rotated(hd);
                let half = (r / 2) as i64;
                let size = self.ints("size", &[1, h as i64, s as i64, half])?;
                let b0 = self.ints("begin", &[0, 0, 0, 0])?;
                let b1 = self.ints("begin", &[0, 0, 0, half])?;
                let x1 = self.b.slice_by_size(&format!("{out}_x1"), x, &b0, &size)?;
                let x2 = self.b.slice_by_size(&format!("{out}_x2"), x, &b1, &size)?;
                let nx2 = self.b.mul(&format!("{out}_nx2"), &x2, &neg)?;
                match r < hd {
                    false => self.concat(&format!("{out}_rot"), &[&nx2, &x1], 3)?,
                    true => {
                        let rest = (hd - r) as i64;
                        let size = self.ints("size", &[1, h as i64, s as i64, rest])?;
                        let b2 = self.ints("begin", &[0, 0, 0, r as i64])?;
                        let x3 = self.b.slice_by_size(&format!("{out}_x3"), x, &b2, &size)?;
                        self.concat(&format!("{out}_rot"), &[&nx2, &x1, &x3], 3)?
                    }
                }
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

    /// x·cos + rotate(x)·sin for `x [1, heads, S, HD]`, the rotation a
    /// product with a constant signed permutation `R [1, heads, HD, HD]`
    /// (blob `rope_rot_{heads}.bin`, see [`super::rope_rotation`]): no
    /// slice at a width offset (M1–M3 clamp those, see
    /// [`Gen::region`]) and no `concat`. Every output of the product is one
    /// input times ±1 plus zeros, so it is exact in fp16.
    pub fn rope_by_matrix(
        &mut self,
        out: &str,
        x: &Value,
        cos: &Value,
        sin: &Value,
    ) -> Result<Value> {
        let (h, hd) = (x.dims()[1], x.dims()[3]);
        let file = format!("{}{h}.bin", super::BLOB_ROT);
        let rot_m = self.blob(&format!("rope_rot_{h}"), [1, h, hd, hd], &file)?;
        let rot = self.matmul(&format!("{out}_rot"), x, &rot_m, false, false)?;
        let xc = self.b.mul(&format!("{out}_c"), x, cos)?;
        let xs = self.b.mul(&format!("{out}_s"), &rot, sin)?;
        self.b.add(out, &xc, &xs)
    }

    /// softmax(q·kᵀ·scale + mask) for folded queries `q [1, KV, R·S, HD]`,
    /// keys `k [1, KV, S, HD]` (scale: [`KernelOptions::score_scale`]);
    /// soft-capped scores (Gemma 2's, [`KernelOptions::score_cap`]) are
    /// c·t before the mask, t = tanh(q·kᵀ·scale/c), and t is returned for
    /// the backward's 1 − t².
    pub fn attention_probs(
        &mut self,
        q: &Value,
        k: &Value,
        s: &Shape,
        o: &KernelOptions,
    ) -> Result<(Value, Option<Value>)> {
        let scaled = self.scaled_scores("", q, k, o)?;
        let (scaled, tanh) = match o.score_cap {
            None => (scaled, None),
            Some(c) => {
                let t = self.score_tanh("", &scaled, c)?;
                let cv = self.scalar("cap", c)?;
                (self.b.mul("capped", &t, &cv)?, Some(t))
            }
        };
        let masked = if s.query_block() {
            // A block of queries: its mask is an input `[queries, S]`,
            // added to every head's rows.
            let (qb, seq) = (s.queries, s.seq);
            let m = self.region(Port::Mask)?;
            let m = self.reshape("mask_rows", &m, &[1, 1, qb, seq])?;
            let heads = self.reshape("scaled_heads", &scaled, &[1, s.heads, qb, seq])?;
            let added = self.b.add("masked_heads", &heads, &m)?;
            self.reshape("masked", &added, &[1, s.kv_heads, s.ratio() * qb, seq])?
        } else {
            let mask = self.blob("mask", [1, 1, s.ratio() * s.seq, s.seq], BLOB_MASK)?;
            self.b.add("masked", &scaled, &mask)?
        };
        let ax = self.b.int("axis_m1", -1)?;
        Ok((self.b.softmax("probs", &masked, &ax)?, tanh))
    }

    /// q·kᵀ·scale, its nodes' names prefixed by `pre`.
    pub fn scaled_scores(
        &mut self,
        pre: &str,
        q: &Value,
        k: &Value,
        o: &KernelOptions,
    ) -> Result<Value> {
        let scores = self.matmul(&format!("{pre}scores"), q, k, false, true)?;
        let sc = self.scalar(&format!("{pre}scale"), o.score_scale)?;
        self.b.mul(&format!("{pre}scaled"), &scores, &sc)
    }

    /// t = tanh(x/c) of scaled scores `x` capped at `c`, with MIL's
    /// elementwise `tanh` (coremltools `mil.ops.defs.iOS15.activation`).
    /// The ANE trainers our notes digest never run it, so how the chip
    /// evaluates it is unmeasured here (a first Mac run of a Gemma 2 says;
    /// were it refused, 2σ(2u) − 1 with the SwiGLU programs' sigmoid would
    /// stand in, at the precision cost below). The capped
    /// score c·t keeps fp16's relative precision near zero, where the
    /// 2c·σ(2x/c) − c form would round every score to fp16's steps at c.
    pub fn score_tanh(&mut self, pre: &str, x: &Value, c: f64) -> Result<Value> {
        let inv = self.scalar(&format!("{pre}inv_cap"), 1.0 / c)?;
        let u = self.b.mul(&format!("{pre}over_cap"), x, &inv)?;
        self.b.unary("tanh", &format!("{pre}scores_tanh"), &u)
    }

    /// dx = Σᵢ Wᵢᵀ·dyᵢ (plus each projection's adapter) for the kernel's
    /// `projections`, projection i reading the activation region `acts[i]`,
    /// as channel-first `[1, in, 1, S]` named `out`.
    pub fn projections_backward(
        &mut self,
        projections: &[(Projection, Product)],
        acts: &[Port],
        out: &str,
        o: &KernelOptions,
    ) -> Result<Value> {
        let rows = acts
            .iter()
            .map(|&act| self.act_rows(act))
            .collect::<Result<Vec<_>>>()?;
        let mut sum: Option<Value> = None;
        for ((&(w, product), &act), at) in projections.iter().zip(acts).zip(&rows) {
            let name = if projections.len() == 1 {
                format!("{out}_mm")
            } else {
                format!("{}_mm", act.name())
            };
            let y = self.project(&name, at, Port::Weight(w))?;
            let y = self.with_adapter(y, at, w, product, o)?;
            sum = Some(match sum {
                None => y,
                Some(acc) => self.b.add(&format!("{out}_mm"), &acc, &y)?,
            });
        }
        let y = sum.expect("a backward kernel applies at least one projection");
        self.rows_to_channels(out, &y)
    }

    /// The finished function with `outputs` and the blob files it reads.
    pub fn finish(mut self, outputs: &[Value]) -> Result<(Function, Vec<String>)> {
        for out in outputs {
            self.b.output(out);
        }
        Ok((self.b.finish()?, self.blobs))
    }
}
