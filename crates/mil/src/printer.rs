//! Prints programs in the exact dialect the ANE compiler is fed (the seed's
//! text form): deterministic, one statement per line.

use crate::ir::{Arg, ConstData, ConstVal, Function, Operation, Program};

/// The program as MIL text.
pub fn print(p: &Program) -> String {
    let mut s = String::with_capacity(4096);
    s.push_str("program(");
    s.push_str(&p.version);
    s.push_str(")\n");
    if !p.build_info.is_empty() {
        s.push_str("[buildInfo = dict<string, string>({");
        for (i, (k, v)) in p.build_info.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push('{');
            push_quoted(&mut s, k);
            s.push_str(", ");
            push_quoted(&mut s, v);
            s.push('}');
        }
        s.push_str("})]\n");
    }
    s.push_str("{\n");
    for f in &p.functions {
        print_function(&mut s, f);
    }
    s.push_str("}\n");
    s
}

fn print_function(s: &mut String, f: &Function) {
    s.push_str(" func ");
    s.push_str(&f.name);
    s.push('<');
    s.push_str(&f.opset);
    s.push_str(">(");
    for (i, v) in f.inputs.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        v.ty.write(s, ", ");
        s.push(' ');
        s.push_str(&v.name);
    }
    s.push_str(") {\n");
    for op in &f.ops {
        print_op(s, op);
    }
    s.push_str(" } -> (");
    s.push_str(&f.outputs.join(", "));
    s.push_str(");\n");
}

fn print_op(s: &mut String, op: &Operation) {
    s.push(' ');
    op.output.ty.write(s, ",");
    s.push(' ');
    s.push_str(&op.output.name);
    s.push_str(" = ");
    s.push_str(&op.op);
    s.push('(');
    for (i, (k, a)) in op.args.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(k);
        s.push('=');
        match a {
            Arg::Var(v) => s.push_str(v),
            Arg::Tuple(vs) => {
                s.push('(');
                s.push_str(&vs.join(","));
                s.push(')');
            }
        }
    }
    s.push_str(")[name=string(");
    push_quoted(s, &op.name);
    s.push(')');
    if let Some(v) = &op.val {
        s.push_str(", val=");
        print_const(s, v);
    }
    s.push_str("];\n");
}

/// `tensor<int32, [4]>([0,0,0,1])`, `fp16(-1)`, `string("x")`, or a BLOBFILE.
pub fn print_const(s: &mut String, v: &ConstVal) {
    if let ConstData::Str(x) = &v.data {
        s.push_str("string(");
        push_quoted(s, x);
        s.push(')');
        return;
    }
    v.ty.write(s, ",");
    s.push('(');
    let list = v.ty.shape.is_some();
    let items: Vec<String> = match &v.data {
        ConstData::Floats(x) => x.iter().map(|f| format_float(*f)).collect(),
        ConstData::Ints(x) => x.iter().map(|i| i.to_string()).collect(),
        ConstData::Bools(x) => x.iter().map(|b| b.to_string()).collect(),
        ConstData::Str(_) => return, // printed above
        ConstData::Blob { path, offset } => {
            s.push_str("BLOBFILE(path=string(");
            push_quoted(s, path);
            s.push_str(&format!("), offset=uint64({offset})))"));
            return;
        }
    };
    if list {
        s.push('[');
        s.push_str(&items.join(","));
        s.push(']');
    } else {
        s.push_str(&items.join(","));
    }
    s.push(')');
}

/// Shortest text that parses back to the same f64 (`0.5`, `-1`, `inf`).
pub fn format_float(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{f}")
    }
}

fn push_quoted(s: &mut String, text: &str) {
    s.push('"');
    for c in text.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s.push('"');
}
