//! ANE constraints as named, switchable rules. Public reports about what the
//! ANE compiler accepts conflict in places, so each constraint is a
//! hypothesis with an id: `mil check` reports them all, a device compiles
//! with the enabled set and refuses programs that break one.
//!
//! Sources and conflicts are collected in the project's ANE runtime notes.

use std::collections::BTreeSet;

use mil::ir::{ConstData, Function, Program};
use mil::types::DType;

/// One constraint.
pub struct Rule {
    pub id: &'static str,
    pub summary: &'static str,
    /// Enabled unless switched off: the constraints our kernels must meet.
    pub default_on: bool,
    check: fn(&Function, &Limits, &mut Vec<String>),
}

pub use crate::family::Limits;

/// A rule broken by a program.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub rule: &'static str,
    pub function: String,
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{}] func {}: {}",
            self.rule, self.function, self.message
        )
    }
}

/// Smallest IOSurface the runtime reportedly accepts, in bytes: 768
/// channels × 16 positions of fp16 (Orion `docs/ane_constraints.md` §4).
pub const MIN_SURFACE_BYTES: usize = 49_152;
/// Largest extent every family accepts on every axis (the spatial cap of
/// M1–M3, see [`crate::family`]).
pub const MAX_DIM: usize = 16_384;

fn io_types(f: &Function) -> Vec<(String, mil::types::Ty)> {
    let mut v: Vec<_> = f
        .inputs
        .iter()
        .map(|i| (format!("input '{}'", i.name), i.ty.clone()))
        .collect();
    for o in &f.outputs {
        if let Some(t) = f.var_type(o) {
            v.push((format!("output '{o}'"), t.clone()));
        }
    }
    v
}

/// The value of an int constant named `name`.
fn const_ints(f: &Function, name: &str) -> Option<Vec<i64>> {
    let c = f
        .ops
        .iter()
        .find(|o| o.op == "const" && o.output.name == name)?;
    match &c.val.as_ref()?.data {
        ConstData::Ints(v) => Some(v.clone()),
        _ => None,
    }
}

/// The contracted extent of a matmul (its `x`'s last axis, or the one
/// before when `transpose_x` is a true constant).
fn matmul_contraction(f: &Function, op: &mil::ir::Operation) -> Option<usize> {
    let Some(mil::ir::Arg::Var(x)) = op.arg("x") else {
        return None;
    };
    let tx = matches!(op.arg("transpose_x"), Some(mil::ir::Arg::Var(n))
        if f.ops.iter().any(|c| &c.output.name == n
            && c.val.as_ref().and_then(|v| v.as_bool()) == Some(true)));
    let d = f.var_type(x)?.dims();
    if d.len() < 2 {
        return None;
    }
    Some(if tx { d[d.len() - 2] } else { d[d.len() - 1] })
}

/// Every rule, in report order.
pub fn all() -> &'static [Rule] {
    static RULES: &[Rule] = &[
        Rule {
            id: "single-input",
            summary: "one input tensor per program (multi-input programs reportedly fail with 0x1d unless sizes are uniform)",
            default_on: true,
            check: |f, _, out| {
                if f.inputs.len() != 1 {
                    out.push(format!("has {} inputs", f.inputs.len()));
                }
            },
        },
        Rule {
            id: "fp16-io",
            summary: "inputs and outputs are fp16",
            default_on: true,
            check: |f, _, out| {
                for (what, t) in io_types(f) {
                    if t.dtype != DType::Fp16 {
                        out.push(format!("{what} is {}", t.dtype));
                    }
                }
            },
        },
        Rule {
            id: "io-layout",
            summary: "inputs and outputs are rank-4 [1, C, 1, S] (the IOSurface layout)",
            default_on: true,
            check: |f, _, out| {
                for (what, t) in io_types(f) {
                    let d = t.dims();
                    if d.len() != 4 || d[0] != 1 || d[2] != 1 {
                        out.push(format!("{what} has shape {:?}", d));
                    }
                }
            },
        },
        Rule {
            id: "max-dim",
            summary: "no axis exceeds the family's cap: the channel axis (axis 1 of a rank-4 tensor) \
                      65536, spatial axes and matmul contractions 16384 on M1-M3 and 65536 on M4/M5 \
                      (ANEForge docs/cross-chip.md \"oversize\"; ANETRAIN_ANE_MAX_DIM sets both)",
            default_on: true,
            check: |f, limits, out| {
                let typed = io_types(f).into_iter().chain(
                    f.ops.iter().map(|o| (format!("'{}'", o.output.name), o.output.ty.clone())),
                );
                for (what, t) in typed {
                    let d = t.dims();
                    for (axis, &n) in d.iter().enumerate() {
                        let (cap, kind) = if d.len() == 4 && axis == 1 {
                            (limits.max_channel, "channel")
                        } else {
                            (limits.max_spatial, "spatial")
                        };
                        if n > cap {
                            out.push(format!(
                                "{what} has a {kind} extent of {n} (axis {axis}), over the limit of {cap}"
                            ));
                            break;
                        }
                    }
                }
                for op in f.ops.iter().filter(|o| o.op == "matmul") {
                    if let Some(k) = matmul_contraction(f, op) {
                        if k > limits.max_spatial {
                            out.push(format!(
                                "matmul '{}' contracts over {k}, over the limit of {}",
                                op.output.name, limits.max_spatial
                            ));
                        }
                    }
                }
            },
        },
        Rule {
            id: "max-rank",
            summary: "no tensor of rank above 5 (ANEForge docs/developer/op-quirks.md, \"Global constraints\")",
            default_on: true,
            check: |f, limits, out| {
                for op in &f.ops {
                    let r = op.output.ty.dims().len();
                    if r > limits.max_rank {
                        out.push(format!("'{}' has rank {r}", op.output.name));
                    }
                }
            },
        },
        Rule {
            id: "min-width",
            summary: "inputs and outputs are at least 32 wide: narrower runtime surfaces gave garbage \
                      or a nonzero status (apple-neural-engine-field-guide README.md, \"The SP=32 Constraint\")",
            default_on: true,
            check: |f, limits, out| {
                for (what, t) in io_types(f) {
                    if let Some(&w) = t.dims().last() {
                        if w < limits.min_width {
                            out.push(format!("{what} is {w} wide, under {}", limits.min_width));
                        }
                    }
                }
            },
        },
        Rule {
            id: "no-tile",
            summary: "no tile op: it leaves the Neural Engine failing with 0x1d until the process exits \
                      (apple-neural-engine-field-guide README.md, \"The tile Poison\")",
            default_on: true,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "tile") {
                    out.push(format!("tile '{}'", op.output.name));
                }
            },
        },
        Rule {
            id: "width-offset-slice",
            summary: "no slice_by_size with a nonzero last-axis begin: before A16 (M1-M3) it clamps \
                      |v| > 4094 to ±inf (ANEForge docs/numeric-cliffs.md, docs/cross-chip.md \"The h13 \
                      slice-saturation warning\"); on for families that clamp",
            default_on: false,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "slice_by_size") {
                    let Some(mil::ir::Arg::Var(b)) = op.arg("begin") else { continue };
                    let Some(begin) = const_ints(f, b) else { continue };
                    if let Some(&last) = begin.last() {
                        if last != 0 {
                            out.push(format!(
                                "slice '{}' begins at width offset {last}",
                                op.output.name
                            ));
                        }
                    }
                }
            },
        },
        Rule {
            id: "const-flags",
            summary: "matmul transpose_x/transpose_y are named bool consts",
            default_on: true,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "matmul") {
                    for flag in ["transpose_x", "transpose_y"] {
                        if op.arg(flag).is_none() {
                            out.push(format!("matmul '{}' leaves {flag} implicit", op.output.name));
                        }
                    }
                }
            },
        },
        Rule {
            id: "no-rsqrt-after-reduce",
            summary: "no rsqrt/sqrt fed by a reduction: working trainers normalise with add(eps) then \
                      pow(-0.5) (maderix/ANE training/stories_mil.h:30-33), and the compiler is \
                      reported to reject rsqrt/sqrt after a reduce",
            default_on: true,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "rsqrt" || o.op == "sqrt") {
                    let Some(mil::ir::Arg::Var(x)) = op.arg("x") else { continue };
                    if let Some(src) = f.ops.iter().find(|o| &o.output.name == x) {
                        if src.op.starts_with("reduce_") {
                            out.push(format!(
                                "{} '{}' takes {} '{}'",
                                op.op, op.output.name, src.op, src.output.name
                            ));
                        }
                    }
                }
            },
        },
        Rule {
            id: "no-subnormal-const",
            summary: "no fp16 constant is subnormal (below 2^-14 = 6.1e-5 in magnitude): a device \
                      that flushes subnormals reads it as 0 (an eps of 0 turns zero padding into \
                      0*inf = NaN)",
            default_on: true,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "const") {
                    let Some(v) = &op.val else { continue };
                    let ConstData::Floats(values) = &v.data else { continue };
                    if v.ty.dtype != DType::Fp16 {
                        continue;
                    }
                    let subnormal = |x: &f64| {
                        let h = half::f16::from_f64(*x);
                        h.is_finite() && h != half::f16::ZERO && h != half::f16::NEG_ZERO && !h.is_normal()
                    };
                    if let Some(x) = values.iter().find(|x| subnormal(x)) {
                        out.push(format!("const '{}' holds {x}, an fp16 subnormal", op.output.name));
                    }
                }
            },
        },
        Rule {
            id: "min-surface",
            summary: "each input/output buffer is at least ~48 KiB (49152 bytes): smaller IOSurfaces \
                      compile but fail at eval with status 0x1d (Orion docs/ane_constraints.md §4, \
                      `[768, 16]` fp16 the smallest that worked); a single output may be smaller \
                      only where the device gives it a surface of at least that size itself, as it \
                      does for several outputs (§2: one size for all; §14: written packed from the \
                      first byte) and for a chip that rejects concat, whose programs cannot pad",
            default_on: true,
            check: |f, limits, out| {
                let device_sized = f.outputs.len() > 1 || !limits.concat;
                for (what, t) in io_types(f) {
                    let bytes = t.elems() * 2;
                    if bytes < MIN_SURFACE_BYTES && !(device_sized && what.starts_with("output")) {
                        out.push(format!("{what} is {bytes} bytes"));
                    }
                }
            },
        },
        Rule {
            id: "spatial-multiple-16",
            summary: "the spatial (last) dimension of inputs/outputs is a multiple of 16 (silent zeros reported otherwise)",
            default_on: false,
            check: |f, _, out| {
                for (what, t) in io_types(f) {
                    if let Some(&s) = t.dims().last() {
                        if s % 16 != 0 {
                            out.push(format!("{what} has spatial width {s}"));
                        }
                    }
                }
            },
        },
        Rule {
            id: "min-spatial-64",
            summary: "the spatial (last) dimension of inputs/outputs is at least 64",
            default_on: false,
            check: |f, _, out| {
                for (what, t) in io_types(f) {
                    if let Some(&s) = t.dims().last() {
                        if s < 64 {
                            out.push(format!("{what} has spatial width {s}"));
                        }
                    }
                }
            },
        },
        Rule {
            id: "matmul-inner-32",
            summary: "matmul contractions are multiples of 32 (silent zeros reported otherwise: \
                      maderix/ANE PR #47); on for the chip families",
            default_on: false,
            check: |f, limits, out| {
                let m = limits.inner_multiple.max(1);
                for op in f.ops.iter().filter(|o| o.op == "matmul") {
                    if let Some(k) = matmul_contraction(f, op) {
                        if k % m != 0 {
                            out.push(format!("matmul '{}' contracts over {k}", op.output.name));
                        }
                    }
                }
            },
        },
        Rule {
            id: "verbose-scalars",
            summary: "scalar consts use the tensor<T, []> form (the int32(1) shorthand reportedly fails on M1-M3)",
            default_on: false,
            check: |f, _, out| {
                for op in f.ops.iter().filter(|o| o.op == "const") {
                    if let Some(v) = &op.val {
                        if v.ty.shape.is_none() && !matches!(v.data, ConstData::Str(_)) {
                            out.push(format!("const '{}' is written {}", op.output.name, v.ty));
                        }
                    }
                }
            },
        },
        Rule {
            id: "no-concat",
            summary: "no concat (Orion docs/ane_constraints.md §1 saw ANECCompile() fail on it; maderix/ANE's \
                      working kernels use it): on for a profile whose probe saw it rejected",
            default_on: false,
            check: |f, _, out| {
                let n = f.ops.iter().filter(|o| o.op == "concat").count();
                if n > 0 {
                    out.push(format!("uses concat {n} time(s)"));
                }
            },
        },
        Rule {
            id: "sorted-outputs",
            summary: "several outputs are listed in name order (the runtime reportedly orders them so)",
            default_on: true,
            check: |f, _, out| {
                let mut sorted = f.outputs.clone();
                sorted.sort();
                if sorted != f.outputs {
                    out.push(format!("outputs {:?} are not in name order", f.outputs));
                }
            },
        },
    ];
    RULES
}

/// Which rules are switched on.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleSet {
    on: BTreeSet<&'static str>,
    /// The limits the rules measure against.
    pub limits: Limits,
}

impl Default for RuleSet {
    fn default() -> Self {
        RuleSet {
            on: all()
                .iter()
                .filter(|r| r.default_on)
                .map(|r| r.id)
                .collect(),
            limits: Limits::default(),
        }
    }
}

impl RuleSet {
    /// No rule enabled.
    pub fn none() -> RuleSet {
        RuleSet {
            on: BTreeSet::new(),
            limits: Limits::default(),
        }
    }

    /// Every rule enabled.
    pub fn all() -> RuleSet {
        RuleSet {
            on: all().iter().map(|r| r.id).collect(),
            limits: Limits::default(),
        }
    }

    /// The rules a chip of `limits` needs: the default set, plus
    /// `width-offset-slice` where width slices clamp, `matmul-inner-32`
    /// where contractions must be multiples, and `no-concat` where concat
    /// is rejected; measured against `limits`.
    pub fn for_limits(limits: Limits) -> RuleSet {
        let mut r = RuleSet::default().with_limits(limits);
        if limits.width_slice_clamp.is_some() {
            r.on.insert("width-offset-slice");
        }
        if limits.inner_multiple > 1 {
            r.on.insert("matmul-inner-32");
        }
        if !limits.concat {
            r.on.insert("no-concat");
        }
        r
    }

    /// The same rules measured against `limits`.
    pub fn with_limits(mut self, limits: Limits) -> RuleSet {
        self.limits = limits;
        self
    }

    pub fn is_on(&self, id: &str) -> bool {
        self.on.contains(id)
    }

    /// Switches a rule on or off; unknown ids are an error listing the known.
    pub fn set(&mut self, id: &str, on: bool) -> Result<(), crate::error::Error> {
        let rule =
            all()
                .iter()
                .find(|r| r.id == id)
                .ok_or_else(|| crate::error::Error::UnknownRule {
                    id: id.into(),
                    known: all().iter().map(|r| r.id).collect(),
                })?;
        if on {
            self.on.insert(rule.id);
        } else {
            self.on.remove(rule.id);
        }
        Ok(())
    }
}

/// Findings of every rule (enabled or not) for every function, against
/// the limits in force.
pub fn check_all(p: &Program) -> Vec<Finding> {
    check_all_within(p, &Limits::default())
}

/// [`check_all`] against `limits`.
pub fn check_all_within(p: &Program, limits: &Limits) -> Vec<Finding> {
    let mut v = Vec::new();
    for f in &p.functions {
        for r in all() {
            let mut msgs = Vec::new();
            (r.check)(f, limits, &mut msgs);
            v.extend(msgs.into_iter().map(|m| Finding {
                rule: r.id,
                function: f.name.clone(),
                message: m,
            }));
        }
    }
    v
}

/// Findings of the enabled rules only.
pub fn check(p: &Program, set: &RuleSet) -> Vec<Finding> {
    check_all_within(p, &set.limits)
        .into_iter()
        .filter(|f| set.is_on(f.rule))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn findings(body: &str) -> Vec<&'static str> {
        let text = format!(
            "program(1.3)\n{{\n func main<ios18>(tensor<fp16, [1, 4, 1, 16]> x) {{\n{body}\n }} -> (y);\n}}\n"
        );
        let p = mil::parse_and_validate(&text).unwrap();
        let mut set = RuleSet::none();
        set.set("no-rsqrt-after-reduce", true).unwrap();
        set.set("no-subnormal-const", true).unwrap();
        check(&p, &set).into_iter().map(|f| f.rule).collect()
    }

    const MEAN: &str =
        " tensor<int32, [1]> ax = const()[name=string(\"ax\"), val=tensor<int32, [1]>([1])];
 bool kd = const()[name=string(\"kd\"), val=bool(true)];
 tensor<fp16, [1,1,1,16]> m = reduce_mean(x=x,axes=ax,keep_dims=kd)[name=string(\"m\")];";

    #[test]
    fn rsqrt_after_a_reduction_is_reported_and_pow_is_not() {
        let rsqrt = format!(
            "{MEAN}\n fp16 e = const()[name=string(\"e\"), val=fp16(0.001)];\n \
             tensor<fp16, [1,1,1,16]> y = rsqrt(x=m,epsilon=e)[name=string(\"y\")];"
        );
        assert_eq!(findings(&rsqrt), ["no-rsqrt-after-reduce"]);
        let pow = format!(
            "{MEAN}\n fp16 e = const()[name=string(\"e\"), val=fp16(0.001)];\n \
             tensor<fp16, [1,1,1,16]> me = add(x=m,y=e)[name=string(\"me\")];\n \
             fp16 nh = const()[name=string(\"nh\"), val=fp16(-0.5)];\n \
             tensor<fp16, [1,1,1,16]> y = pow(x=me,y=nh)[name=string(\"y\")];"
        );
        assert!(findings(&pow).is_empty());
    }

    #[test]
    fn subnormal_fp16_constants_are_reported() {
        let with = |v: &str| {
            format!(
                " fp16 e = const()[name=string(\"e\"), val=fp16({v})];\n \
                 tensor<fp16, [1,4,1,16]> y = add(x=x,y=e)[name=string(\"y\")];"
            )
        };
        assert_eq!(findings(&with("0.000001")), ["no-subnormal-const"]);
        // 2^-14 is fp16's smallest normal value; zero is not subnormal.
        assert!(findings(&with("0.00006103515625")).is_empty());
        assert!(findings(&with("0")).is_empty());
    }
}
