//! Operation definitions. Each op declares, in one place, its inputs (name,
//! type domain, const-ness, optionality), its type inference (which rejects
//! bad programs with errors naming the argument and the mismatch) and its
//! evaluation. The validator, the builder and the interpreter all read this
//! table, so they cannot drift apart.

use crate::ir::ConstVal;
use crate::tensor::Tensor;
use crate::types::{shape_str, DType, Ty};
use linalg::{matmul_in_order, MatMut, MatRef};

/// The set of dtypes an input accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// fp16 or fp32.
    Float,
    /// fp16, fp32 or int32.
    Numeric,
    Int,
    Bool,
    Str,
    /// fp16, fp32, int32 or bool.
    Any,
}

impl Domain {
    pub fn accepts(self, d: DType) -> bool {
        match self {
            Domain::Float => d.is_float(),
            Domain::Numeric => d.is_float() || d == DType::Int32,
            Domain::Int => d == DType::Int32,
            Domain::Bool => d == DType::Bool,
            Domain::Str => d == DType::Str,
            Domain::Any => d != DType::Str,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Domain::Float => "fp16 or fp32",
            Domain::Numeric => "fp16, fp32 or int32",
            Domain::Int => "int32",
            Domain::Bool => "bool",
            Domain::Str => "string",
            Domain::Any => "fp16, fp32, int32 or bool",
        }
    }
}

/// One declared input of an op.
#[derive(Clone, Copy, Debug)]
pub struct InputSpec {
    pub name: &'static str,
    pub domain: Domain,
    /// Must be the result of a `const` (its value shapes the output type).
    pub konst: bool,
    pub optional: bool,
    /// A tuple of values, `values=(a,b,c)`.
    pub tuple: bool,
}

const fn input(name: &'static str, domain: Domain) -> InputSpec {
    InputSpec {
        name,
        domain,
        konst: false,
        optional: false,
        tuple: false,
    }
}

const fn konst(name: &'static str, domain: Domain) -> InputSpec {
    InputSpec {
        name,
        domain,
        konst: true,
        optional: false,
        tuple: false,
    }
}

const fn opt_konst(name: &'static str, domain: Domain) -> InputSpec {
    InputSpec {
        name,
        domain,
        konst: true,
        optional: true,
        tuple: false,
    }
}

const fn opt_input(name: &'static str, domain: Domain) -> InputSpec {
    InputSpec {
        optional: true,
        ..input(name, domain)
    }
}

/// A tuple of values (`values=(a, b, c)`).
const fn tuple_input(name: &'static str, domain: Domain) -> InputSpec {
    InputSpec {
        tuple: true,
        ..input(name, domain)
    }
}

/// Argument types (and constant values) handed to type inference, in the
/// op's declared input order.
pub struct InferArgs<'a> {
    pub(crate) args: Vec<(&'static str, Option<InferArg<'a>>)>,
}

pub struct InferArg<'a> {
    pub tys: Vec<&'a Ty>,
    pub konst: Option<&'a ConstVal>,
}

impl<'a> InferArgs<'a> {
    fn get(&self, name: &str) -> Option<&InferArg<'a>> {
        self.args
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, a)| a.as_ref())
    }

    /// Type of a required single-value input.
    pub fn ty(&self, name: &str) -> &'a Ty {
        self.get(name).map(|a| a.tys[0]).expect("validated input")
    }

    pub fn tuple(&self, name: &str) -> Vec<&'a Ty> {
        self.get(name).map(|a| a.tys.clone()).unwrap_or_default()
    }

    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn konst(&self, name: &str) -> Result<Option<&'a ConstVal>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(a) => a
                .konst
                .map(Some)
                .ok_or_else(|| format!("'{name}' must be a const")),
        }
    }

    /// Integer values of a const input (`None` when absent).
    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>, String> {
        match self.konst(name)? {
            None => Ok(None),
            Some(c) => c
                .as_ints()
                .map(|v| Some(v.to_vec()))
                .ok_or_else(|| format!("'{name}' must be an int32 literal")),
        }
    }

    pub fn req_ints(&self, name: &str) -> Result<Vec<i64>, String> {
        self.ints(name)?
            .ok_or_else(|| format!("missing argument '{name}'"))
    }

    pub fn int(&self, name: &str, default: i64) -> Result<i64, String> {
        match self.ints(name)? {
            None => Ok(default),
            Some(v) if v.len() == 1 => Ok(v[0]),
            Some(v) => Err(format!(
                "'{name}' must be a single int32, got {} values",
                v.len()
            )),
        }
    }

    pub fn bool(&self, name: &str, default: bool) -> Result<bool, String> {
        match self.konst(name)? {
            None => Ok(default),
            Some(c) => c
                .as_bool()
                .ok_or_else(|| format!("'{name}' must be a bool literal")),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<String>, String> {
        match self.konst(name)? {
            None => Ok(None),
            Some(c) => c
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| format!("'{name}' must be a string literal")),
        }
    }
}

/// Argument values handed to evaluation, plus the (validated) output type.
pub struct EvalArgs<'a> {
    pub(crate) args: Vec<(&'static str, Vec<&'a Tensor>)>,
    pub out: &'a Ty,
}

impl<'a> EvalArgs<'a> {
    fn get(&self, name: &str) -> Option<&Vec<&'a Tensor>> {
        self.args
            .iter()
            .find(|(n, v)| *n == name && !v.is_empty())
            .map(|(_, v)| v)
    }

    pub fn t(&self, name: &str) -> Result<&'a Tensor, String> {
        self.get(name)
            .map(|v| v[0])
            .ok_or_else(|| format!("missing argument '{name}'"))
    }

    pub fn tuple(&self, name: &str) -> Vec<&'a Tensor> {
        self.get(name).cloned().unwrap_or_default()
    }

    pub fn opt(&self, name: &str) -> Option<&'a Tensor> {
        self.get(name).map(|v| v[0])
    }

    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>, String> {
        self.opt(name).map(|t| t.ints()).transpose()
    }

    pub fn int(&self, name: &str, default: i64) -> Result<i64, String> {
        Ok(self
            .ints(name)?
            .and_then(|v| v.first().copied())
            .unwrap_or(default))
    }

    pub fn bool(&self, name: &str, default: bool) -> Result<bool, String> {
        self.opt(name)
            .map(|t| t.scalar_bool())
            .transpose()
            .map(|b| b.unwrap_or(default))
    }

    pub fn float(&self, name: &str, default: f32) -> Result<f32, String> {
        match self.opt(name) {
            None => Ok(default),
            Some(t) => t.f32s().map(|v| v.first().copied().unwrap_or(default)),
        }
    }
}

/// A MIL operation: signature, type inference and evaluation together.
pub trait OpDef: Sync {
    fn name(&self) -> &'static str;
    /// One line: what the op computes.
    fn summary(&self) -> &'static str;
    /// Inputs in the order the printer writes them.
    fn inputs(&self) -> &'static [InputSpec];
    /// The output type, or an error naming the offending argument.
    fn infer(&self, a: &InferArgs) -> Result<Ty, String>;
    /// Computes the result in f32 (fp16 rounding is the interpreter's job).
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String>;
}

/// Every op the dialect supports except `const`, which has no inputs and is
/// handled by the validator and interpreter directly.
pub fn registry() -> &'static [&'static dyn OpDef] {
    static OPS: &[&dyn OpDef] = &[
        &SliceBySize,
        &Reshape,
        &Transpose,
        &Matmul,
        &Binary::ADD,
        &Binary::SUB,
        &Binary::MUL,
        &Binary::REAL_DIV,
        &Binary::POW,
        &Unary::SIGMOID,
        &Unary::SQRT,
        &Unary::EXP,
        &Unary::SILU,
        &Unary::TANH,
        &Rsqrt,
        &Softmax,
        &Concat,
        &Reduce::SUM,
        &Reduce::MEAN,
        &Reduce::MAX,
        &Tile,
        &Cast,
        &Conv,
    ];
    OPS
}

pub fn lookup(name: &str) -> Option<&'static dyn OpDef> {
    registry().iter().copied().find(|o| o.name() == name)
}

/// Names of all ops including `const`, for messages and docs.
pub fn op_names() -> Vec<&'static str> {
    let mut v = vec!["const"];
    v.extend(registry().iter().map(|o| o.name()));
    v
}

// ---------------------------------------------------------------- helpers

fn norm_axis(axis: i64, rank: usize, what: &str) -> Result<usize, String> {
    let r = rank as i64;
    if axis < -r || axis >= r.max(1) {
        return Err(format!("{what} {axis} is out of range for rank {rank}"));
    }
    Ok(if axis < 0 { axis + r } else { axis } as usize)
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// numpy/MIL broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Strides of `shape` viewed as broadcast to `out` (0 where broadcast).
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(shape);
    let off = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < off || shape[i - off] == 1 {
                0
            } else {
                s[i - off]
            }
        })
        .collect()
}

/// Calls `f(outer_index_offsets...)` over all positions of `out` except the
/// last dimension, giving the starting offsets in each operand.
fn for_each_row(out: &[usize], operand_strides: &[&[usize]], mut f: impl FnMut(usize, &[usize])) {
    let rank = out.len();
    let rows: usize = out[..rank.saturating_sub(1)].iter().product();
    let mut idx = vec![0usize; rank.saturating_sub(1)];
    let mut offs = vec![0usize; operand_strides.len()];
    let row_len = if rank == 0 { 1 } else { out[rank - 1] };
    for r in 0..rows {
        f(r * row_len, &offs);
        // advance the odometer
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            for (o, s) in offs.iter_mut().zip(operand_strides) {
                *o += s[d];
            }
            if idx[d] < out[d] {
                break;
            }
            for (o, s) in offs.iter_mut().zip(operand_strides) {
                *o -= s[d] * out[d];
            }
            idx[d] = 0;
        }
    }
}

fn same_dtype(op: &str, x: &Ty, y: &Ty) -> Result<(), String> {
    if x.dtype != y.dtype {
        return Err(format!(
            "x is {} but y is {}; {op} needs both of one dtype",
            x.dtype, y.dtype
        ));
    }
    Ok(())
}

// ------------------------------------------------------------ slice_by_size

/// `slice_by_size(x, begin, size)`: the block of `x` starting at `begin`
/// with extent `size` (-1: to the end).
struct SliceBySize;

fn slice_extent(
    x: &[usize],
    begin: &[i64],
    size: &[i64],
) -> Result<(Vec<usize>, Vec<usize>), String> {
    if begin.len() != x.len() || size.len() != x.len() {
        return Err(format!(
            "begin has {} and size has {} entries but x {} has rank {}",
            begin.len(),
            size.len(),
            shape_str(x),
            x.len()
        ));
    }
    let mut b = Vec::with_capacity(x.len());
    let mut s = Vec::with_capacity(x.len());
    for d in 0..x.len() {
        let dim = x[d] as i64;
        let start = if begin[d] < 0 {
            begin[d] + dim
        } else {
            begin[d]
        };
        if start < 0 || start > dim {
            return Err(format!(
                "begin[{d}] = {} is outside x's dim {dim}",
                begin[d]
            ));
        }
        let len = if size[d] == -1 { dim - start } else { size[d] };
        if len < 0 || start + len > dim {
            return Err(format!(
                "begin[{d}] + size[{d}] = {} + {} exceeds x's dim {dim} (x {})",
                start,
                size[d],
                shape_str(x)
            ));
        }
        b.push(start as usize);
        s.push(len as usize);
    }
    Ok((b, s))
}

impl OpDef for SliceBySize {
    fn name(&self) -> &'static str {
        "slice_by_size"
    }
    fn summary(&self) -> &'static str {
        "block of x at begin with extent size (-1 = to the end)"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            input("x", Domain::Any),
            konst("begin", Domain::Int),
            konst("size", Domain::Int),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let (_, size) = slice_extent(x.dims(), &a.req_ints("begin")?, &a.req_ints("size")?)?;
        Ok(Ty::tensor(x.dtype, size))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let (begin, size) = slice_extent(&x.shape, &a.t("begin")?.ints()?, &a.t("size")?.ints()?)?;
        let xs = strides(&x.shape);
        let start: usize = begin.iter().zip(&xs).map(|(b, s)| b * s).sum();
        // Each output row starts at `start + Σ idx·stride` in x.
        macro_rules! gather {
            ($v:expr, $mk:expr) => {{
                let v = $v;
                let n: usize = size.iter().product();
                let mut out = Vec::with_capacity(n);
                let row = *size.last().unwrap_or(&1);
                for_each_row(&size, &[&xs], |_, offs| {
                    let s = start + offs[0];
                    out.extend_from_slice(&v[s..s + row]);
                });
                $mk(out)
            }};
        }
        let shape = size.clone();
        Ok(match &x.data {
            crate::tensor::Data::F32(v) => gather!(v, |o| Tensor::float(x.dtype, shape.clone(), o)),
            crate::tensor::Data::I32(v) => gather!(v, |o| Tensor::int(shape.clone(), o)),
            crate::tensor::Data::Bool(v) => gather!(v, |o| Tensor::bool(shape.clone(), o)),
            crate::tensor::Data::Str(_) => return Err("cannot slice a string".into()),
        })
    }
}

// ------------------------------------------------------------------ reshape

/// `reshape(x, shape)`: same elements, new shape (one -1 infers a dim,
/// 0 copies x's dim).
struct Reshape;

impl OpDef for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn summary(&self) -> &'static str {
        "same elements in a new shape (-1 infers one dim, 0 keeps x's)"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[konst("shape", Domain::Int), input("x", Domain::Any)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let shape = a.req_ints("shape")?;
        let mut dims = Vec::with_capacity(shape.len());
        let mut infer_at = None;
        for (i, &d) in shape.iter().enumerate() {
            match d {
                -1 if infer_at.is_none() => {
                    infer_at = Some(i);
                    dims.push(1)
                }
                -1 => return Err("shape has more than one -1".into()),
                0 => dims.push(
                    *x.dims()
                        .get(i)
                        .ok_or_else(|| format!("shape[{i}] = 0 but x has rank {}", x.rank()))?,
                ),
                d if d < 0 => return Err(format!("shape[{i}] = {d} is negative")),
                d => dims.push(d as usize),
            }
        }
        let known: usize = dims.iter().product();
        if let Some(i) = infer_at {
            if known == 0 || !x.elems().is_multiple_of(known) {
                return Err(format!(
                    "cannot infer shape[{i}]: x {} has {} elements",
                    shape_str(x.dims()),
                    x.elems()
                ));
            }
            dims[i] = x.elems() / known;
        }
        if dims.iter().product::<usize>() != x.elems() {
            return Err(format!(
                "shape {} has {} elements but x {} has {}",
                shape_str(&dims),
                dims.iter().product::<usize>(),
                shape_str(x.dims()),
                x.elems()
            ));
        }
        Ok(Ty::tensor(x.dtype, dims))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        Ok(a.t("x")?.reshaped(a.out.dims().to_vec()))
    }
}

// ---------------------------------------------------------------- transpose

/// `transpose(x, perm)`: out.shape[i] = x.shape[perm[i]].
struct Transpose;

fn check_perm(perm: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    if perm.len() != rank {
        return Err(format!(
            "perm has {} entries for x of rank {rank}",
            perm.len()
        ));
    }
    let mut seen = vec![false; rank];
    let mut p = Vec::with_capacity(rank);
    for &v in perm {
        let d = norm_axis(v, rank, "perm entry")?;
        if seen[d] {
            return Err(format!("perm repeats axis {d}"));
        }
        seen[d] = true;
        p.push(d);
    }
    Ok(p)
}

/// Permutes a dense tensor's storage.
pub fn permute<T: Copy>(v: &[T], shape: &[usize], perm: &[usize]) -> Vec<T> {
    let xs = strides(shape);
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let src_strides: Vec<usize> = perm.iter().map(|&p| xs[p]).collect();
    let n = v.len();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let rank = out_shape.len();
    if rank == 0 {
        out.push(v[0]);
        return out;
    }
    let row = out_shape[rank - 1];
    let inner = src_strides[rank - 1];
    for_each_row(&out_shape, &[&src_strides], |_, offs| {
        let base = offs[0];
        if inner == 1 {
            out.extend_from_slice(&v[base..base + row]);
        } else {
            out.extend((0..row).map(|j| v[base + j * inner]));
        }
    });
    out
}

impl OpDef for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }
    fn summary(&self) -> &'static str {
        "permutes axes: out.shape[i] = x.shape[perm[i]]"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[konst("perm", Domain::Int), input("x", Domain::Any)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let perm = check_perm(&a.req_ints("perm")?, x.rank())?;
        Ok(Ty::tensor(
            x.dtype,
            perm.iter().map(|&p| x.dims()[p]).collect::<Vec<_>>(),
        ))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let perm = check_perm(&a.t("perm")?.ints()?, x.shape.len())?;
        let shape = a.out.dims().to_vec();
        Ok(match &x.data {
            crate::tensor::Data::F32(v) => {
                Tensor::float(x.dtype, shape, permute(v, &x.shape, &perm))
            }
            crate::tensor::Data::I32(v) => Tensor::int(shape, permute(v, &x.shape, &perm)),
            crate::tensor::Data::Bool(v) => Tensor::bool(shape, permute(v, &x.shape, &perm)),
            crate::tensor::Data::Str(_) => return Err("cannot transpose a string".into()),
        })
    }
}

// ------------------------------------------------------------------- matmul

/// `matmul(x, y, transpose_x, transpose_y)`: batched x·y over the last two
/// axes, batch axes broadcast; accumulates in f32.
struct Matmul;

struct MatmulShape {
    batch: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
}

fn matmul_shape(x: &[usize], y: &[usize], tx: bool, ty: bool) -> Result<MatmulShape, String> {
    if x.len() < 2 || y.len() < 2 {
        return Err(format!(
            "x {} and y {} must both have rank >= 2",
            shape_str(x),
            shape_str(y)
        ));
    }
    let (xr, xc) = (x[x.len() - 2], x[x.len() - 1]);
    let (yr, yc) = (y[y.len() - 2], y[y.len() - 1]);
    let (m, kx) = if tx { (xc, xr) } else { (xr, xc) };
    let (ky, n) = if ty { (yc, yr) } else { (yr, yc) };
    if kx != ky {
        return Err(format!(
            "inner dimensions differ: x {} (transpose_x={tx}) gives K={kx}, y {} (transpose_y={ty}) gives K={ky}",
            shape_str(x),
            shape_str(y)
        ));
    }
    let batch = broadcast_shapes(&x[..x.len() - 2], &y[..y.len() - 2]).ok_or_else(|| {
        format!(
            "batch dimensions of x {} and y {} are not broadcastable",
            shape_str(x),
            shape_str(y)
        )
    })?;
    Ok(MatmulShape { batch, m, k: kx, n })
}

impl OpDef for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn summary(&self) -> &'static str {
        "batched matrix product over the last two axes (batch axes broadcast)"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            opt_konst("transpose_x", Domain::Bool),
            opt_konst("transpose_y", Domain::Bool),
            input("x", Domain::Float),
            input("y", Domain::Float),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let (x, y) = (a.ty("x"), a.ty("y"));
        same_dtype("matmul", x, y)?;
        let s = matmul_shape(
            x.dims(),
            y.dims(),
            a.bool("transpose_x", false)?,
            a.bool("transpose_y", false)?,
        )?;
        let mut dims = s.batch;
        dims.extend([s.m, s.n]);
        Ok(Ty::tensor(x.dtype, dims))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let (x, y) = (a.t("x")?, a.t("y")?);
        let (tx, ty) = (a.bool("transpose_x", false)?, a.bool("transpose_y", false)?);
        let s = matmul_shape(&x.shape, &y.shape, tx, ty)?;
        let (xv, yv) = (x.f32s()?, y.f32s()?);
        let (xb, yb) = (&x.shape[..x.shape.len() - 2], &y.shape[..y.shape.len() - 2]);
        let (xm, ym) = (
            x.shape[x.shape.len() - 2..].iter().product::<usize>(),
            y.shape[y.shape.len() - 2..].iter().product::<usize>(),
        );
        let xbs: Vec<usize> = broadcast_strides(xb, &s.batch)
            .iter()
            .map(|v| v * xm)
            .collect();
        let ybs: Vec<usize> = broadcast_strides(yb, &s.batch)
            .iter()
            .map(|v| v * ym)
            .collect();
        let nb: usize = s.batch.iter().product();
        let mut out = vec![0f32; nb * s.m * s.n];
        // Walk batch positions (treat the batch shape plus a dummy last axis
        // of 1 as the "rows" of an odometer).
        let mut bshape = s.batch.clone();
        bshape.push(1);
        let mut xs2 = xbs.clone();
        xs2.push(0);
        let mut ys2 = ybs.clone();
        ys2.push(0);
        let (xcols, ycols) = (x.shape[x.shape.len() - 1], y.shape[y.shape.len() - 1]);
        for_each_row(&bshape, &[&xs2, &ys2], |b, offs| {
            let xa = MatRef::row_major(xv, offs[0], if tx { s.k } else { s.m }, xcols);
            let ya = MatRef::row_major(yv, offs[1], if ty { s.n } else { s.k }, ycols);
            let xa = if tx { xa.t() } else { xa };
            let ya = if ty { ya.t() } else { ya };
            matmul_in_order(
                xa,
                ya,
                MatMut::row_major(&mut out, b * s.m * s.n, s.m, s.n),
                false,
            );
        });
        Ok(Tensor::float(x.dtype, a.out.dims().to_vec(), out))
    }
}

// -------------------------------------------------- elementwise binary ops

/// Elementwise `f(x, y)` with MIL (numpy) broadcasting; x and y share a dtype.
struct Binary {
    name: &'static str,
    summary: &'static str,
    domain: Domain,
    f: fn(f32, f32) -> f32,
    i: Option<fn(i32, i32) -> i32>,
}

impl Binary {
    const ADD: Binary = Binary {
        name: "add",
        summary: "x + y (broadcast)",
        domain: Domain::Numeric,
        f: |a, b| a + b,
        i: Some(|a, b| a.wrapping_add(b)),
    };
    const SUB: Binary = Binary {
        name: "sub",
        summary: "x - y (broadcast)",
        domain: Domain::Numeric,
        f: |a, b| a - b,
        i: Some(|a, b| a.wrapping_sub(b)),
    };
    const MUL: Binary = Binary {
        name: "mul",
        summary: "x * y (broadcast)",
        domain: Domain::Numeric,
        f: |a, b| a * b,
        i: Some(|a, b| a.wrapping_mul(b)),
    };
    const REAL_DIV: Binary = Binary {
        name: "real_div",
        summary: "x / y (broadcast)",
        domain: Domain::Float,
        f: |a, b| a / b,
        i: None,
    };
    const POW: Binary = Binary {
        name: "pow",
        summary: "x ^ y (broadcast)",
        domain: Domain::Float,
        f: f32::powf,
        i: None,
    };
}

fn broadcast_apply<T: Copy>(
    x: &[T],
    xs: &[usize],
    y: &[T],
    ys: &[usize],
    out_shape: &[usize],
    f: impl Fn(T, T) -> T,
) -> Vec<T> {
    let n: usize = out_shape.iter().product();
    if xs == ys {
        return x.iter().zip(y).map(|(&a, &b)| f(a, b)).collect();
    }
    if y.len() == 1 && x.len() == n {
        let b = y[0];
        return x.iter().map(|&a| f(a, b)).collect();
    }
    if x.len() == 1 && y.len() == n {
        let a0 = x[0];
        return y.iter().map(|&b| f(a0, b)).collect();
    }
    let sx = broadcast_strides(xs, out_shape);
    let sy = broadcast_strides(ys, out_shape);
    let rank = out_shape.len();
    let row = out_shape[rank - 1];
    let (ix, iy) = (sx[rank - 1], sy[rank - 1]);
    let mut out = Vec::with_capacity(n);
    for_each_row(out_shape, &[&sx, &sy], |_, offs| {
        let (ox, oy) = (offs[0], offs[1]);
        out.extend((0..row).map(|j| f(x[ox + j * ix], y[oy + j * iy])));
    });
    out
}

impl OpDef for Binary {
    fn name(&self) -> &'static str {
        self.name
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn inputs(&self) -> &'static [InputSpec] {
        match self.domain {
            Domain::Float => {
                const I: &[InputSpec] = &[input("x", Domain::Float), input("y", Domain::Float)];
                I
            }
            _ => {
                const I: &[InputSpec] = &[input("x", Domain::Numeric), input("y", Domain::Numeric)];
                I
            }
        }
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let (x, y) = (a.ty("x"), a.ty("y"));
        same_dtype(self.name, x, y)?;
        let dims = broadcast_shapes(x.dims(), y.dims()).ok_or_else(|| {
            format!(
                "x {} and y {} are not broadcastable",
                shape_str(x.dims()),
                shape_str(y.dims())
            )
        })?;
        if x.shape.is_none() && y.shape.is_none() {
            return Ok(Ty::scalar(x.dtype));
        }
        Ok(Ty::tensor(x.dtype, dims))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let (x, y) = (a.t("x")?, a.t("y")?);
        let shape = a.out.dims().to_vec();
        match (&x.data, &y.data) {
            (crate::tensor::Data::F32(xv), crate::tensor::Data::F32(yv)) => Ok(Tensor::float(
                x.dtype,
                shape.clone(),
                broadcast_apply(xv, &x.shape, yv, &y.shape, &shape, self.f),
            )),
            (crate::tensor::Data::I32(xv), crate::tensor::Data::I32(yv)) => {
                let f = self
                    .i
                    .ok_or_else(|| format!("{} is not defined on int32", self.name))?;
                Ok(Tensor::int(
                    shape.clone(),
                    broadcast_apply(xv, &x.shape, yv, &y.shape, &shape, f),
                ))
            }
            _ => Err(format!("{}: unsupported operand dtypes", self.name)),
        }
    }
}

// --------------------------------------------------- elementwise unary ops

/// Elementwise float function of x.
struct Unary {
    name: &'static str,
    summary: &'static str,
    f: fn(f32) -> f32,
}

impl Unary {
    const SIGMOID: Unary = Unary {
        name: "sigmoid",
        summary: "1 / (1 + exp(-x))",
        f: |v| 1.0 / (1.0 + (-v).exp()),
    };
    const SQRT: Unary = Unary {
        name: "sqrt",
        summary: "sqrt(x)",
        f: f32::sqrt,
    };
    const EXP: Unary = Unary {
        name: "exp",
        summary: "exp(x)",
        f: f32::exp,
    };
    const SILU: Unary = Unary {
        name: "silu",
        summary: "x * sigmoid(x)",
        f: |v| v / (1.0 + (-v).exp()),
    };
    const TANH: Unary = Unary {
        name: "tanh",
        summary: "tanh(x)",
        f: f32::tanh,
    };
}

fn map_float(x: &Tensor, out: &Ty, f: impl Fn(f32) -> f32) -> Result<Tensor, String> {
    Ok(Tensor::float(
        x.dtype,
        out.dims().to_vec(),
        x.f32s()?.iter().map(|&v| f(v)).collect(),
    ))
}

impl OpDef for Unary {
    fn name(&self) -> &'static str {
        self.name
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[input("x", Domain::Float)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        Ok(a.ty("x").clone())
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        map_float(a.t("x")?, a.out, self.f)
    }
}

/// `rsqrt(x, epsilon=1e-12)`: 1 / sqrt(x + epsilon).
struct Rsqrt;

impl OpDef for Rsqrt {
    fn name(&self) -> &'static str {
        "rsqrt"
    }
    fn summary(&self) -> &'static str {
        "1 / sqrt(x + epsilon), epsilon defaults to 1e-12"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            input("x", Domain::Float),
            opt_konst("epsilon", Domain::Float),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        if a.has("epsilon") {
            let e = a.tuple("epsilon")[0];
            if e.rank() != 0 || e.dtype != x.dtype {
                return Err(format!("epsilon must be a {} scalar, got {e}", x.dtype));
            }
        }
        Ok(x.clone())
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let eps = a.float("epsilon", 1e-12)?;
        map_float(a.t("x")?, a.out, |v| 1.0 / (v + eps).sqrt())
    }
}

// ------------------------------------------------------------------ softmax

/// `softmax(x, axis=-1)`: exp(x - max) / Σ exp(x - max) along axis.
struct Softmax;

/// (outer, n, inner) sizes of `shape` around `axis`.
fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

impl OpDef for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn summary(&self) -> &'static str {
        "exp(x - max) / sum(exp(x - max)) along axis (default -1)"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[opt_konst("axis", Domain::Int), input("x", Domain::Float)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        if x.rank() == 0 {
            return Err("x must have rank >= 1".into());
        }
        norm_axis(a.int("axis", -1)?, x.rank(), "axis")?;
        Ok(x.clone())
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let axis = norm_axis(a.int("axis", -1)?, x.shape.len(), "axis")?;
        let (outer, n, inner) = split_at_axis(&x.shape, axis);
        let v = x.f32s()?;
        let mut out = vec![0f32; v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: usize| o * n * inner + j * inner + i;
                let max = (0..n).map(|j| v[at(j)]).fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for j in 0..n {
                    let e = (v[at(j)] - max).exp();
                    out[at(j)] = e;
                    sum += e;
                }
                for j in 0..n {
                    out[at(j)] /= sum;
                }
            }
        }
        Ok(Tensor::float(x.dtype, x.shape.clone(), out))
    }
}

// ------------------------------------------------------------------- concat

/// `concat(values, axis, interleave=false)`: joins values along axis; with
/// interleave, takes one slice from each value in turn.
struct Concat;

impl OpDef for Concat {
    fn name(&self) -> &'static str {
        "concat"
    }
    fn summary(&self) -> &'static str {
        "joins values along axis (interleave: one slice of each in turn)"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            konst("axis", Domain::Int),
            opt_konst("interleave", Domain::Bool),
            tuple_input("values", Domain::Any),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let vals = a.tuple("values");
        let first = vals.first().ok_or("values is empty")?;
        let rank = first.rank();
        if rank == 0 {
            return Err("values must have rank >= 1".into());
        }
        let axis = norm_axis(a.int("axis", 0)?, rank, "axis")?;
        let interleave = a.bool("interleave", false)?;
        let mut dims = first.dims().to_vec();
        dims[axis] = 0;
        for (i, v) in vals.iter().enumerate() {
            if v.dtype != first.dtype {
                return Err(format!(
                    "values[{i}] is {} but values[0] is {}",
                    v.dtype, first.dtype
                ));
            }
            let ok = v.rank() == rank
                && (0..rank).all(|d| d == axis || v.dims()[d] == first.dims()[d])
                && (!interleave || v.dims() == first.dims());
            if !ok {
                return Err(format!(
                    "values[{i}] {} does not match values[0] {} off axis {axis}{}",
                    shape_str(v.dims()),
                    shape_str(first.dims()),
                    if interleave {
                        " (interleave needs equal shapes)"
                    } else {
                        ""
                    }
                ));
            }
            dims[axis] += v.dims()[axis];
        }
        Ok(Ty::tensor(first.dtype, dims))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let vals = a.tuple("values");
        let first = vals[0];
        let axis = norm_axis(a.int("axis", 0)?, first.shape.len(), "axis")?;
        let interleave = a.bool("interleave", false)?;
        let out_shape = a.out.dims().to_vec();
        let (outer, _, inner) = split_at_axis(&out_shape, axis);
        macro_rules! join {
            ($get:ident, $mk:expr) => {{
                let srcs: Vec<&[_]> = vals.iter().map(|t| t.$get()).collect::<Result<_, _>>()?;
                let mut out = Vec::with_capacity(out_shape.iter().product());
                for o in 0..outer {
                    if interleave {
                        let n = first.shape[axis];
                        for j in 0..n {
                            for s in &srcs {
                                out.extend_from_slice(&s[(o * n + j) * inner..][..inner]);
                            }
                        }
                    } else {
                        for (s, t) in srcs.iter().zip(&vals) {
                            let block = t.shape[axis] * inner;
                            out.extend_from_slice(&s[o * block..][..block]);
                        }
                    }
                }
                $mk(out)
            }};
        }
        Ok(match first.dtype {
            DType::Fp16 | DType::Fp32 => {
                join!(f32s, |o| Tensor::float(first.dtype, out_shape.clone(), o))
            }
            DType::Int32 => join!(i32s, |o| Tensor::int(out_shape.clone(), o)),
            DType::Bool => join!(bools, |o| Tensor::bool(out_shape.clone(), o)),
            DType::Str => return Err("cannot concat strings".into()),
        })
    }
}

// -------------------------------------------------------------- reductions

#[derive(Clone, Copy)]
enum ReduceKind {
    Sum,
    Mean,
    Max,
}

/// `reduce_{sum,mean,max}(x, axes=all, keep_dims=false)`, accumulated in f32.
struct Reduce {
    name: &'static str,
    summary: &'static str,
    kind: ReduceKind,
}

impl Reduce {
    const SUM: Reduce = Reduce {
        name: "reduce_sum",
        summary: "sum over axes (all when absent)",
        kind: ReduceKind::Sum,
    };
    const MEAN: Reduce = Reduce {
        name: "reduce_mean",
        summary: "mean over axes (all when absent)",
        kind: ReduceKind::Mean,
    };
    const MAX: Reduce = Reduce {
        name: "reduce_max",
        summary: "maximum over axes (all when absent)",
        kind: ReduceKind::Max,
    };
}

fn reduce_axes(axes: Option<Vec<i64>>, rank: usize) -> Result<Vec<bool>, String> {
    let mut mask = vec![axes.is_none(); rank];
    for a in axes.unwrap_or_default() {
        let d = norm_axis(a, rank, "axes entry")?;
        if mask[d] {
            return Err(format!("axes repeats axis {d}"));
        }
        mask[d] = true;
    }
    Ok(mask)
}

impl OpDef for Reduce {
    fn name(&self) -> &'static str {
        self.name
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            input("x", Domain::Float),
            opt_konst("axes", Domain::Int),
            opt_konst("keep_dims", Domain::Bool),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let mask = reduce_axes(a.ints("axes")?, x.rank())?;
        let keep = a.bool("keep_dims", false)?;
        let dims: Vec<usize> = x
            .dims()
            .iter()
            .zip(&mask)
            .filter_map(|(&d, &m)| match (m, keep) {
                (false, _) => Some(d),
                (true, true) => Some(1),
                (true, false) => None,
            })
            .collect();
        Ok(Ty::tensor(x.dtype, dims))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let mask = reduce_axes(a.ints("axes")?, x.shape.len())?;
        let kept: Vec<usize> = x
            .shape
            .iter()
            .zip(&mask)
            .map(|(&d, &m)| if m { 1 } else { d })
            .collect();
        let n_out: usize = kept.iter().product();
        let count = (x.len() / n_out.max(1)) as f32;
        // Strides into the output for each input axis (0 on reduced axes).
        let ks = strides(&kept);
        let os: Vec<usize> = ks
            .iter()
            .zip(&mask)
            .map(|(&s, &m)| if m { 0 } else { s })
            .collect();
        let init = match self.kind {
            ReduceKind::Max => f32::NEG_INFINITY,
            _ => 0.0,
        };
        let mut acc = vec![init; n_out];
        let v = x.f32s()?;
        if x.shape.is_empty() {
            acc[0] = v[0];
        } else {
            let rank = x.shape.len();
            let row = x.shape[rank - 1];
            let inner = os[rank - 1];
            let kind = self.kind;
            for_each_row(&x.shape, &[&os], |start, offs| {
                let src = &v[start..start + row];
                match (kind, inner) {
                    (ReduceKind::Max, 0) => {
                        let m = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        acc[offs[0]] = acc[offs[0]].max(m);
                    }
                    (_, 0) => acc[offs[0]] += src.iter().sum::<f32>(),
                    (ReduceKind::Max, _) => {
                        for (j, &s) in src.iter().enumerate() {
                            let o = &mut acc[offs[0] + j * inner];
                            *o = o.max(s);
                        }
                    }
                    _ => {
                        for (j, &s) in src.iter().enumerate() {
                            acc[offs[0] + j * inner] += s;
                        }
                    }
                }
            });
        }
        if let ReduceKind::Mean = self.kind {
            acc.iter_mut().for_each(|v| *v /= count);
        }
        Ok(Tensor::float(x.dtype, a.out.dims().to_vec(), acc))
    }
}

// --------------------------------------------------------------------- tile

/// `tile(x, reps)`: repeats x reps[i] times along axis i.
struct Tile;

impl OpDef for Tile {
    fn name(&self) -> &'static str {
        "tile"
    }
    fn summary(&self) -> &'static str {
        "repeats x reps[i] times along axis i"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[input("x", Domain::Any), konst("reps", Domain::Int)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let reps = a.req_ints("reps")?;
        if reps.len() != x.rank() {
            return Err(format!(
                "reps has {} entries for x of rank {}",
                reps.len(),
                x.rank()
            ));
        }
        if let Some(r) = reps.iter().find(|&&r| r < 1) {
            return Err(format!("reps entries must be >= 1, got {r}"));
        }
        Ok(Ty::tensor(
            x.dtype,
            x.dims()
                .iter()
                .zip(&reps)
                .map(|(&d, &r)| d * r as usize)
                .collect::<Vec<_>>(),
        ))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let out = a.out.dims().to_vec();
        let xs = strides(&x.shape);
        let n: usize = out.iter().product();
        let mut idx = vec![0usize; out.len()];
        let gather = |idx: &[usize]| -> usize {
            idx.iter()
                .zip(&x.shape)
                .zip(&xs)
                .map(|((&i, &d), &s)| (i % d) * s)
                .sum()
        };
        let mut order = Vec::with_capacity(n);
        for _ in 0..n {
            order.push(gather(&idx));
            for d in (0..out.len()).rev() {
                idx[d] += 1;
                if idx[d] < out[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(match &x.data {
            crate::tensor::Data::F32(v) => {
                Tensor::float(x.dtype, out, order.iter().map(|&i| v[i]).collect())
            }
            crate::tensor::Data::I32(v) => Tensor::int(out, order.iter().map(|&i| v[i]).collect()),
            crate::tensor::Data::Bool(v) => {
                Tensor::bool(out, order.iter().map(|&i| v[i]).collect())
            }
            crate::tensor::Data::Str(_) => return Err("cannot tile a string".into()),
        })
    }
}

// --------------------------------------------------------------------- cast

/// `cast(x, dtype)`: converts elements to dtype (floats to int32 truncate).
struct Cast;

impl OpDef for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }
    fn summary(&self) -> &'static str {
        "converts x to dtype (\"fp16\", \"fp32\", \"int32\", \"bool\")"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[konst("dtype", Domain::Str), input("x", Domain::Any)];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let x = a.ty("x");
        let name = a.str("dtype")?.unwrap_or_default();
        let d = DType::from_name(&name)
            .filter(|d| *d != DType::Str)
            .ok_or_else(|| format!("dtype \"{name}\" is not one of fp16, fp32, int32, bool"))?;
        Ok(Ty {
            dtype: d,
            shape: x.shape.clone(),
        })
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let x = a.t("x")?;
        let shape = a.out.dims().to_vec();
        let as_f32: Vec<f32> = match &x.data {
            crate::tensor::Data::F32(v) => v.to_vec(),
            crate::tensor::Data::I32(v) => v.iter().map(|&i| i as f32).collect(),
            crate::tensor::Data::Bool(v) => v.iter().map(|&b| b as u8 as f32).collect(),
            crate::tensor::Data::Str(_) => return Err("cannot cast a string".into()),
        };
        Ok(match a.out.dtype {
            DType::Fp16 | DType::Fp32 => Tensor::float(a.out.dtype, shape, as_f32),
            DType::Int32 => Tensor::int(shape, as_f32.iter().map(|&f| f as i32).collect()),
            DType::Bool => Tensor::bool(shape, as_f32.iter().map(|&f| f != 0.0).collect()),
            DType::Str => return Err("cannot cast to string".into()),
        })
    }
}

// --------------------------------------------------------------------- conv

/// `conv(x, weight, bias?)` restricted to 1×1 kernels, stride 1, no padding,
/// one group: out[n, o, h, w] = Σ_c weight[o, c] · x[n, c, h, w] + bias[o].
struct Conv;

impl OpDef for Conv {
    fn name(&self) -> &'static str {
        "conv"
    }
    fn summary(&self) -> &'static str {
        "2-D convolution; 1x1 kernels, stride 1, dilation 1, groups 1, no padding"
    }
    fn inputs(&self) -> &'static [InputSpec] {
        const I: &[InputSpec] = &[
            input("x", Domain::Float),
            input("weight", Domain::Float),
            opt_input("bias", Domain::Float),
            opt_konst("strides", Domain::Int),
            opt_konst("pad_type", Domain::Str),
            opt_konst("pad", Domain::Int),
            opt_konst("dilations", Domain::Int),
            opt_konst("groups", Domain::Int),
        ];
        I
    }
    fn infer(&self, a: &InferArgs) -> Result<Ty, String> {
        let (x, w) = (a.ty("x"), a.ty("weight"));
        if w.dtype != x.dtype {
            return Err(format!("weight is {} but x is {}", w.dtype, x.dtype));
        }
        let (xd, wd) = (x.dims(), w.dims());
        if xd.len() != 4 || wd.len() != 4 {
            return Err(format!(
                "x {} and weight {} must both have rank 4",
                shape_str(xd),
                shape_str(wd)
            ));
        }
        if wd[2] != 1 || wd[3] != 1 {
            return Err(format!(
                "only 1x1 kernels are supported, weight is {}",
                shape_str(wd)
            ));
        }
        if wd[1] != xd[1] {
            return Err(format!(
                "weight {} expects {} input channels but x {} has {}",
                shape_str(wd),
                wd[1],
                shape_str(xd),
                xd[1]
            ));
        }
        for (name, want) in [("strides", 1), ("dilations", 1)] {
            if let Some(v) = a.ints(name)? {
                if v.len() != 2 || v.iter().any(|&s| s != want) {
                    return Err(format!("{name} must be [{want}, {want}], got {v:?}"));
                }
            }
        }
        if let Some(p) = a.ints("pad")? {
            if p.iter().any(|&v| v != 0) {
                return Err(format!("pad must be all zeros, got {p:?}"));
            }
        }
        if let Some(t) = a.str("pad_type")? {
            if !matches!(t.as_str(), "valid" | "same" | "custom") {
                return Err(format!("pad_type \"{t}\" is not valid, same or custom"));
            }
        }
        if a.int("groups", 1)? != 1 {
            return Err("only groups = 1 is supported".into());
        }
        if a.has("bias") {
            let b = a.tuple("bias")[0];
            if b.dims() != [wd[0]] || b.dtype != x.dtype {
                return Err(format!("bias must be {} [{}], got {b}", x.dtype, wd[0]));
            }
        }
        Ok(Ty::tensor(x.dtype, [xd[0], wd[0], xd[2], xd[3]]))
    }
    fn eval(&self, a: &EvalArgs) -> Result<Tensor, String> {
        let (x, w) = (a.t("x")?, a.t("weight")?);
        let (n, c, hw) = (x.shape[0], x.shape[1], x.shape[2] * x.shape[3]);
        let o = w.shape[0];
        let (xv, wv) = (x.f32s()?, w.f32s()?);
        let mut out = vec![0f32; n * o * hw];
        for b in 0..n {
            matmul_in_order(
                MatRef::row_major(wv, 0, o, c),
                MatRef::row_major(xv, b * c * hw, c, hw),
                MatMut::row_major(&mut out, b * o * hw, o, hw),
                false,
            );
        }
        if let Some(bias) = a.opt("bias") {
            let bv = bias.f32s()?;
            for (i, chunk) in out.chunks_mut(hw).enumerate() {
                let add = bv[i % o];
                chunk.iter_mut().for_each(|v| *v += add);
            }
        }
        Ok(Tensor::float(x.dtype, a.out.dims().to_vec(), out))
    }
}
