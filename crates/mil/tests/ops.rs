//! Every op against hand-computed values, broadcasting, and the error paths
//! of type inference (errors must name the op, the argument and the shapes).

use mil::builder::{ArgRef, FunctionBuilder, Value};
use mil::{DType, Executable, Precision, Tensor, Ty};

const F32: DType = DType::Fp32;

/// Builds a one-input-per-tensor function with `body`, runs it in fp32 mode.
fn eval(
    inputs: &[(&str, Vec<usize>, Vec<f32>)],
    body: impl FnOnce(&mut FunctionBuilder, &[Value]) -> Value,
) -> Tensor {
    let mut b = FunctionBuilder::new("main", "ios18");
    let vals: Vec<Value> = inputs
        .iter()
        .map(|(n, s, _)| b.input(n, Ty::tensor(F32, s.clone())))
        .collect();
    let out = body(&mut b, &vals);
    b.output(&out);
    let f = b.finish().unwrap();
    // Also exercise the text path: print, parse, and run what was parsed.
    let text = mil::print(&mil::Program::new(vec![f.clone()]));
    let parsed = mil::parse_and_validate(&text).unwrap();
    assert_eq!(parsed.functions[0], f);
    let exe = Executable::new(&parsed.functions[0], None).unwrap();
    let ts = inputs
        .iter()
        .map(|(_, s, d)| Tensor::float(F32, s.clone(), d.clone()))
        .collect();
    exe.run(ts, Precision::Fp32).unwrap().remove(0)
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.f32s().unwrap().to_vec()
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
}

fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

#[test]
fn slice_by_size_with_minus_one() {
    let t = eval(&[("x", vec![2, 3], iota(6))], |b, v| {
        let begin = b.ints("b", &[0, 1]).unwrap();
        let size = b.ints("s", &[2, -1]).unwrap();
        b.slice_by_size("y", &v[0], &begin, &size).unwrap()
    });
    assert_eq!(t.shape, vec![2, 2]);
    close(&vals(&t), &[1.0, 2.0, 4.0, 5.0]);
}

#[test]
fn reshape_infers_minus_one_and_zero() {
    let t = eval(&[("x", vec![2, 3, 4], iota(24))], |b, v| {
        let s = b.ints("s", &[0, -1]).unwrap();
        b.reshape("y", &v[0], &s).unwrap()
    });
    assert_eq!(t.shape, vec![2, 12]);
    close(&vals(&t), &iota(24));
}

#[test]
fn transpose_permutes() {
    let t = eval(&[("x", vec![2, 3], iota(6))], |b, v| {
        let p = b.ints("p", &[1, 0]).unwrap();
        b.transpose("y", &v[0], &p).unwrap()
    });
    assert_eq!(t.shape, vec![3, 2]);
    close(&vals(&t), &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let t = eval(&[("x", vec![2, 2, 2], iota(8))], |b, v| {
        let p = b.ints("p", &[2, 0, 1]).unwrap();
        b.transpose("y", &v[0], &p).unwrap()
    });
    // y[i,j,k] = x[j,k,i]
    close(&vals(&t), &[0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]);
}

#[test]
fn matmul_with_transposes_and_batch_broadcast() {
    // x [2,2,3] (two batches), y [3,2] broadcast over the batch.
    let x = vec![1., 2., 3., 4., 5., 6., 1., 0., 0., 0., 1., 0.];
    let y = vec![1., 0., 0., 1., 1., 1.];
    let t = eval(
        &[
            ("x", vec![2, 2, 3], x.clone()),
            ("y", vec![3, 2], y.clone()),
        ],
        |b, v| {
            let f = b.bool("f", false).unwrap();
            b.matmul("z", &v[0], &v[1], &f, &f).unwrap()
        },
    );
    assert_eq!(t.shape, vec![2, 2, 2]);
    close(&vals(&t), &[4., 5., 10., 11., 1., 0., 0., 1.]);
    // transpose_y: y given as [2,3] = yᵀ.
    let yt = vec![1., 0., 1., 0., 1., 1.];
    let t = eval(&[("x", vec![2, 2, 3], x), ("y", vec![2, 3], yt)], |b, v| {
        let f = b.bool("f", false).unwrap();
        let tr = b.bool("t", true).unwrap();
        b.matmul("z", &v[0], &v[1], &f, &tr).unwrap()
    });
    close(&vals(&t), &[4., 5., 10., 11., 1., 0., 0., 1.]);
    // transpose_x: xᵀ·x for x [3,2]
    let t = eval(
        &[("x", vec![3, 2], vec![1., 2., 3., 4., 5., 6.])],
        |b, v| {
            let f = b.bool("f", false).unwrap();
            let tr = b.bool("t", true).unwrap();
            b.matmul("z", &v[0], &v[0], &tr, &f).unwrap()
        },
    );
    close(&vals(&t), &[35., 44., 44., 56.]);
}

#[test]
fn binary_ops_broadcast() {
    let x = vec![1., 2., 3., 4., 5., 6.];
    let cases: [(&str, [f32; 6]); 5] = [
        ("add", [11., 22., 33., 14., 25., 36.]),
        ("sub", [-9., -18., -27., -6., -15., -24.]),
        ("mul", [10., 40., 90., 40., 100., 180.]),
        ("real_div", [0.1, 0.1, 0.1, 0.4, 0.25, 0.2]),
        (
            "pow",
            [
                1.,
                2f32.powf(20.),
                3f32.powf(30.),
                4f32.powf(10.),
                5f32.powf(20.),
                6f32.powf(30.),
            ],
        ),
    ];
    for (op, want) in cases {
        let t = eval(
            &[
                ("x", vec![2, 3], x.clone()),
                ("y", vec![3], vec![10., 20., 30.]),
            ],
            |b, v| b.binary(op, "z", &v[0], &v[1]).unwrap(),
        );
        assert_eq!(t.shape, vec![2, 3], "{op}");
        close(&vals(&t), &want);
    }
    // [2,1] with [1,3] -> [2,3]; and a scalar operand.
    let t = eval(
        &[
            ("x", vec![2, 1], vec![1., 2.]),
            ("y", vec![1, 3], vec![10., 20., 30.]),
        ],
        |b, v| b.add("z", &v[0], &v[1]).unwrap(),
    );
    close(&vals(&t), &[11., 21., 31., 12., 22., 32.]);
    let t = eval(&[("x", vec![3], vec![1., 2., 3.])], |b, v| {
        let s = b.float("s", F32, -1.0).unwrap();
        b.mul("z", &v[0], &s).unwrap()
    });
    close(&vals(&t), &[-1., -2., -3.]);
}

#[test]
fn unary_ops() {
    let x = vec![-2.0f32, 0.0, 0.5, 4.0];
    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
    type Reference = Box<dyn Fn(f32) -> f32>;
    let cases: [(&str, Reference); 5] = [
        ("sigmoid", Box::new(sig)),
        ("tanh", Box::new(f32::tanh)),
        ("exp", Box::new(f32::exp)),
        ("silu", Box::new(move |v| v * sig(v))),
        ("sqrt", Box::new(f32::sqrt)),
    ];
    for (op, f) in cases {
        let xs: Vec<f32> = if op == "sqrt" {
            vec![0.0, 1.0, 2.25, 4.0]
        } else {
            x.clone()
        };
        let t = eval(&[("x", vec![4], xs.clone())], |b, v| {
            b.unary(op, "y", &v[0]).unwrap()
        });
        let want: Vec<f32> = xs.iter().map(|&v| f(v)).collect();
        close(&vals(&t), &want);
    }
    let t = eval(&[("x", vec![2], vec![4.0, 0.25])], |b, v| {
        b.unary("rsqrt", "y", &v[0]).unwrap()
    });
    close(&vals(&t), &[0.5, 2.0]);
    let t = eval(&[("x", vec![1], vec![3.0])], |b, v| {
        let e = b.float("e", F32, 1.0).unwrap();
        b.op(
            "rsqrt",
            "y",
            &[("x", (&v[0]).into()), ("epsilon", (&e).into())],
        )
        .unwrap()
    });
    close(&vals(&t), &[0.5]);
}

#[test]
fn softmax_on_last_and_middle_axis() {
    let x = vec![1., 2., 3., 1., 1., 1.];
    let t = eval(&[("x", vec![2, 3], x.clone())], |b, v| {
        let a = b.int("a", -1).unwrap();
        b.softmax("y", &v[0], &a).unwrap()
    });
    let e: Vec<f32> = [1f32, 2., 3.].iter().map(|v| v.exp()).collect();
    let s: f32 = e.iter().sum();
    close(
        &vals(&t),
        &[e[0] / s, e[1] / s, e[2] / s, 1. / 3., 1. / 3., 1. / 3.],
    );
    let t = eval(&[("x", vec![2, 3], x)], |b, v| {
        let a = b.int("a", 0).unwrap();
        b.softmax("y", &v[0], &a).unwrap()
    });
    let p = |a: f32, c: f32| a.exp() / (a.exp() + c.exp());
    close(
        &vals(&t),
        &[
            p(1., 1.),
            p(2., 1.),
            p(3., 1.),
            p(1., 1.),
            p(1., 2.),
            p(1., 3.),
        ],
    );
}

#[test]
fn concat_plain_and_interleaved() {
    let ins = [
        ("a", vec![2, 1], vec![1., 2.]),
        ("c", vec![2, 2], vec![3., 4., 5., 6.]),
    ];
    let t = eval(&ins, |b, v| {
        let ax = b.int("ax", 1).unwrap();
        let il = b.bool("il", false).unwrap();
        b.concat("y", &[&v[0], &v[1]], &ax, &il).unwrap()
    });
    assert_eq!(t.shape, vec![2, 3]);
    close(&vals(&t), &[1., 3., 4., 2., 5., 6.]);
    let ins = [("a", vec![2], vec![1., 2.]), ("c", vec![2], vec![3., 4.])];
    let t = eval(&ins, |b, v| {
        let ax = b.int("ax", 0).unwrap();
        let il = b.bool("il", true).unwrap();
        b.concat("y", &[&v[0], &v[1]], &ax, &il).unwrap()
    });
    close(&vals(&t), &[1., 3., 2., 4.]);
}

#[test]
fn reductions_with_and_without_keep_dims() {
    let x = vec![1., 2., 3., 4., 5., 6.];
    for (op, axes, keep, shape, want) in [
        ("reduce_sum", vec![-1], true, vec![2, 1], vec![6., 15.]),
        ("reduce_sum", vec![0], false, vec![3], vec![5., 7., 9.]),
        ("reduce_mean", vec![1], false, vec![2], vec![2., 5.]),
        ("reduce_max", vec![0, 1], false, vec![], vec![6.]),
        ("reduce_max", vec![0], true, vec![1, 3], vec![4., 5., 6.]),
    ] {
        let t = eval(&[("x", vec![2, 3], x.clone())], |b, v| {
            let ax = b.ints(&format!("ax{}", axes.len()), &axes).unwrap();
            let k = b.bool("k", keep).unwrap();
            b.reduce(op, "y", &v[0], &ax, &k).unwrap()
        });
        assert_eq!(t.shape, shape, "{op} {axes:?}");
        close(&vals(&t), &want);
    }
}

#[test]
fn tile_repeats() {
    let t = eval(&[("x", vec![1, 2], vec![1., 2.])], |b, v| {
        let r = b.ints("r", &[2, 2]).unwrap();
        b.tile("y", &v[0], &r).unwrap()
    });
    assert_eq!(t.shape, vec![2, 4]);
    close(&vals(&t), &[1., 2., 1., 2., 1., 2., 1., 2.]);
}

#[test]
fn cast_between_dtypes() {
    let mut b = FunctionBuilder::new("main", "ios18");
    let x = b.input("x", Ty::tensor(F32, [3]));
    let d = b.string("d", "int32").unwrap();
    let i = b.cast("i", &x, &d).unwrap();
    let h = b.string("h", "fp16").unwrap();
    let y = b.cast("y", &i, &h).unwrap();
    b.output(&y);
    let f = b.finish().unwrap();
    let exe = Executable::new(&f, None).unwrap();
    let out = exe
        .run(
            vec![Tensor::float(F32, vec![3], vec![1.7, -2.2, 3.0])],
            Precision::Fp16,
        )
        .unwrap();
    assert_eq!(out[0].dtype, DType::Fp16);
    close(&vals(&out[0]), &[1., -2., 3.]);
}

#[test]
fn conv_1x1_is_a_channel_matmul_plus_bias() {
    // x [1, 2, 1, 3], weight [2 out, 2 in, 1, 1], bias [2]
    let t = eval(
        &[
            ("x", vec![1, 2, 1, 3], vec![1., 2., 3., 4., 5., 6.]),
            ("w", vec![2, 2, 1, 1], vec![1., 1., 0., 2.]),
            ("bias", vec![2], vec![0.5, -1.]),
        ],
        |b, v| {
            b.op(
                "conv",
                "y",
                &[
                    ("x", (&v[0]).into()),
                    ("weight", (&v[1]).into()),
                    ("bias", (&v[2]).into()),
                ],
            )
            .unwrap()
        },
    );
    assert_eq!(t.shape, vec![1, 2, 1, 3]);
    close(&vals(&t), &[5.5, 7.5, 9.5, 7., 9., 11.]);
}

#[test]
fn fp16_mode_rounds_every_result() {
    let mut b = FunctionBuilder::new("main", "ios18");
    let x = b.input("x", Ty::tensor(DType::Fp16, [2]));
    let c = b.float("c", DType::Fp16, 1.0).unwrap();
    let y = b.add("y", &x, &c).unwrap();
    let z = b.sub("z", &y, &c).unwrap();
    b.output(&z);
    let exe = Executable::new(&b.finish().unwrap(), None).unwrap();
    let input = Tensor::float(DType::Fp16, vec![2], vec![1e-4, 3.0]);
    let h = exe.run(vec![input.clone()], Precision::Fp16).unwrap();
    // 1 + 1e-4 rounds to 1 in fp16 (ulp at 1 is 2^-10), so z = 0.
    assert_eq!(vals(&h[0]), vec![0.0, 3.0]);
    let f = exe.run(vec![input], Precision::Fp32).unwrap();
    assert!((vals(&f[0])[0] - 1e-4).abs() < 1e-7);
}

// ------------------------------------------------------------ error paths

fn build_err(body: impl FnOnce(&mut FunctionBuilder, &Value) -> mil::Result<Value>) -> String {
    let mut b = FunctionBuilder::new("main", "ios18");
    let x = b.input("x", Ty::tensor(DType::Fp16, [1, 4, 1, 8]));
    body(&mut b, &x).unwrap_err().to_string()
}

#[test]
fn type_errors_name_op_argument_and_shapes() {
    let e = build_err(|b, x| {
        let y = b.input("y", Ty::tensor(DType::Fp16, [1, 3, 1, 8]));
        b.add("z", x, &y)
    });
    assert!(
        e.contains("add 'z'")
            && e.contains("[1, 4, 1, 8]")
            && e.contains("[1, 3, 1, 8]")
            && e.contains("broadcastable"),
        "{e}"
    );

    let e = build_err(|b, x| {
        let f = b.bool("f", false)?;
        b.matmul("m", x, x, &f, &f)
    });
    assert!(
        e.contains("matmul 'm'") && e.contains("inner dimensions"),
        "{e}"
    );

    let e = build_err(|b, x| {
        let y = b.input("y", Ty::tensor(DType::Fp32, [1, 4, 1, 8]));
        b.mul("z", x, &y)
    });
    assert!(e.contains("fp16") && e.contains("fp32"), "{e}");

    let e = build_err(|b, x| {
        let s = b.ints("s", &[1, 5, 1, 8])?;
        b.reshape("r", x, &s)
    });
    assert!(
        e.contains("reshape 'r'") && e.contains("40 elements") && e.contains("32"),
        "{e}"
    );

    let e = build_err(|b, x| {
        let be = b.ints("be", &[0, 2, 0, 0])?;
        let sz = b.ints("sz", &[1, 3, 1, 8])?;
        b.slice_by_size("s", x, &be, &sz)
    });
    assert!(
        e.contains("slice_by_size 's'") && e.contains("begin[1]"),
        "{e}"
    );

    let e = build_err(|b, x| {
        let p = b.ints("p", &[0, 1, 1, 2])?;
        b.transpose("t", x, &p)
    });
    assert!(e.contains("perm repeats"), "{e}");

    // A computed value where a const is required.
    let e = build_err(|b, x| {
        let shape = b.ints("shape", &[4])?;
        let d = b.string("d", "int32")?;
        let s2 = b.cast("s2", &shape, &d)?;
        b.reshape("r", x, &s2)
    });
    assert!(
        e.contains("argument 'shape'") && e.contains("must be a const"),
        "{e}"
    );

    let e = build_err(|b, x| b.op("gelu", "g", &[("x", ArgRef::One(x))]));
    assert!(e.contains("unknown op 'gelu'"), "{e}");

    let e = build_err(|b, x| b.op("sigmoid", "g", &[("input", ArgRef::One(x))]));
    assert!(
        e.contains("unknown argument 'input'") && e.contains("takes x"),
        "{e}"
    );

    let e = build_err(|b, x| {
        let ax = b.int("ax", 1)?;
        b.op(
            "concat",
            "c",
            &[("axis", (&ax).into()), ("values", ArgRef::One(x))],
        )
    });
    assert!(e.contains("must be a tuple"), "{e}");

    let e = build_err(|b, x| {
        let i = b.ints("i", &[1, 2])?;
        b.sigmoid("s", &i).and(b.sigmoid("t", x))
    });
    assert!(e.contains("must be fp16 or fp32, got int32"), "{e}");
}

#[test]
fn text_errors_carry_line_and_column() {
    let header = "program(1.3)\n{\n func main<ios18>(tensor<fp16, [1, 4, 1, 8]> x) {\n";
    let cases = [
        // undefined variable, line 4
        (" tensor<fp16, [1,4,1,8]> y = sigmoid(x=q)[name=string(\"y\")];\n } -> (y);\n}\n", 4, "undefined variable 'q'"),
        // declared type differs from inferred
        (" tensor<fp16, [1,4,1,9]> y = sigmoid(x=x)[name=string(\"y\")];\n } -> (y);\n}\n", 4, "declared type"),
        // syntax error at column
        (" tensor<fp16, [1,4,1,8]> y = sigmoid(x=x[name=string(\"y\")];\n } -> (y);\n}\n", 4, "expected"),
        // bad literal
        (" tensor<int32, [2]> c = const()[name=string(\"c\"), val=tensor<int32, [2]>([1,2.5])];\n } -> (x);\n}\n", 4, "not an int32"),
        // wrong literal count
        (" tensor<int32, [3]> c = const()[name=string(\"c\"), val=tensor<int32, [3]>([1,2])];\n } -> (x);\n}\n", 4, "needs 3 values"),
    ];
    for (body, line, msg) in cases {
        let e = mil::parse_and_validate(&format!("{header}{body}")).unwrap_err();
        assert_eq!(e.line, line, "{e}");
        assert!(e.col > 0);
        assert!(e.msg.contains(msg), "{e}");
    }
}

#[test]
fn parser_never_panics_on_truncations_of_a_real_program() {
    let text = include_str!("data/small.mil");
    for end in 0..text.len() {
        if text.is_char_boundary(end) {
            let _ = mil::parse_and_validate(&text[..end]);
        }
    }
    assert!(mil::parse_and_validate(text).is_ok());
}

/// `x·pow(mean(x²) + eps, −½)` on a zero row (a padded position): finite
/// in fp16 mode, but with an fp16-subnormal eps (1e-6) a device that
/// flushes subnormals computes 0·pow(0, −½) = 0·∞ = NaN; with eps = 2⁻¹⁴
/// (fp16's smallest normal value) both modes stay finite.
#[test]
fn flushing_subnormals_turns_a_subnormal_eps_into_nan_on_zero_rows() {
    let run = |eps: f64, precision: Precision| -> Vec<f32> {
        let mut b = FunctionBuilder::new("main", "ios18");
        let x = b.input("x", Ty::tensor(DType::Fp16, [1, 1, 2, 4]));
        let sq = b.mul("sq", &x, &x).unwrap();
        let axes = b.ints("axes", &[-1]).unwrap();
        let keep = b.bool("keep", true).unwrap();
        let ms = b.reduce("reduce_mean", "ms", &sq, &axes, &keep).unwrap();
        let e = b.float("eps", DType::Fp16, eps).unwrap();
        let mse = b.add("mse", &ms, &e).unwrap();
        let nh = b.float("nh", DType::Fp16, -0.5).unwrap();
        let r = b
            .op("pow", "r", &[("x", (&mse).into()), ("y", (&nh).into())])
            .unwrap();
        let y = b.mul("y", &x, &r).unwrap();
        b.output(&y);
        let f = b.finish().unwrap();
        let exe = Executable::new(&f, None).unwrap();
        // Row 0 real, row 1 zero padding.
        let input = vec![1., -2., 0.5, 3., 0., 0., 0., 0.];
        let out = exe
            .run(
                vec![Tensor::float(DType::Fp16, vec![1, 1, 2, 4], input)],
                precision,
            )
            .unwrap();
        vals(&out[0])
    };
    let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
    assert!(finite(&run(1e-6, Precision::Fp16)));
    assert!(!finite(&run(1e-6, Precision::Fp16FlushSubnormals)));
    let normal_eps = 6.103515625e-5;
    let (kept, flushed) = (
        run(normal_eps, Precision::Fp16),
        run(normal_eps, Precision::Fp16FlushSubnormals),
    );
    assert!(finite(&kept) && finite(&flushed));
    assert_eq!(kept, flushed);
}
