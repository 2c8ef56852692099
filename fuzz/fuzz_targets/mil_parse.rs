//! Any text into the MIL parser and validator: errors are fine, panics are
//! not. Programs that validate are printed, re-parsed (must be equal) and run
//! through the interpreter when small.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(p) = mil::parse(text) else { return };
    let printed = mil::print(&p);
    let again = mil::parse(&printed).expect("printed program must parse");
    // NaN literals are the one value not equal to themselves.
    if !printed.contains("nan") {
        assert_eq!(again, p, "parse(print(p)) != p");
    }
    if mil::validate::validate(&p).is_err() {
        return;
    }
    let _ = ane::rules::check_all(&p);
    for f in &p.functions {
        let small = f.inputs.iter().all(|v| v.ty.elems() <= 4096)
            && f.ops.iter().all(|o| o.output.ty.elems() <= 1 << 16);
        if !small {
            continue;
        }
        if let Ok(exe) = mil::Executable::new(f, None) {
            let inputs = f
                .inputs
                .iter()
                .map(|v| match v.ty.dtype {
                    mil::DType::Int32 => mil::Tensor::int(v.ty.dims().to_vec(), vec![1; v.ty.elems()]),
                    mil::DType::Bool => mil::Tensor::bool(v.ty.dims().to_vec(), vec![true; v.ty.elems()]),
                    d => mil::Tensor::float(d, v.ty.dims().to_vec(), vec![0.5; v.ty.elems()]),
                })
                .collect();
            let _ = exe.run(inputs, mil::Precision::Fp16);
        }
    }
});
