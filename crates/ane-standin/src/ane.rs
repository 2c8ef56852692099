//! The `_ANE*` classes' behaviour: descriptor, in-memory model (compile,
//! load, evaluate, unload), request and IOSurface wrapper. Each check cites
//! where the working implementations show the behaviour:
//!
//! * maderix/ANE `training/ane_runtime.h` and
//!   `training/training_dynamic/io.h` (the seed's project, run on M-series
//!   hardware),
//! * Orion (mechramc/Orion) `core/ane_runtime.m`, `core/iosurface_tensor.m`
//!   and `docs/ane_constraints.md` (§N below is its numbered constraint),
//! * ncdrone/ane `crates/ane/src/io_surface.rs` (the Rust FFI rustane uses).
//!
//! Compilation parses the MIL text with our parser and evaluation runs our
//! interpreter in fp16, so results can be compared bit for bit with the
//! simulated device; everything around that (files, surfaces, requests,
//! states, errors) follows the references, not our own device code.

use std::path::{Path, PathBuf};

use half::f16;
use half::slice::HalfFloatSliceExt;
use mil::{DType, Executable, Precision, Tensor};

use crate::objects::{Descriptor, Handle, Model, Obj, Table};

/// Smallest IOSurface an evaluation accepts: `[768, 16]` fp16 = 49152
/// bytes worked, smaller surfaces compile but fail at eval with status 0x1d
/// (Orion docs/ane_constraints.md §4).
pub const MIN_SURFACE_BYTES: usize = 49_152;

/// Smallest width (last axis) of a runtime surface
/// (apple-neural-engine-field-guide README.md, "The SP=32 Constraint").
pub const MIN_WIDTH: usize = 32;

/// Compiles per process before the compiler fails (maderix, Orion
/// docs/ane_constraints.md §5: "After approximately 119 calls").
pub const COMPILE_BUDGET: usize = 119;

/// The eval failure Orion reports for surface size problems
/// (docs/ane_constraints.md §2, §4, §12).
pub const STATUS_0X1D: &str =
    "ANEProgramProcessRequestDirect() Failed with status=0x1d : Program Inference error";

/// An NSError to hand back through an `NSError **` argument.
pub struct Failure {
    pub code: isize,
    pub description: String,
}

pub type Outcome = Result<(), Failure>;

fn fail(code: isize, description: impl Into<String>) -> Outcome {
    Err(Failure {
        code,
        description: description.into(),
    })
}

/// `NSTemporaryDirectory()`: `$TMPDIR` (as on macOS), with the trailing
/// slash Foundation returns.
pub fn temporary_directory() -> String {
    let mut s = std::env::temp_dir().to_string_lossy().into_owned();
    if !s.ends_with('/') {
        s.push('/');
    }
    s
}

/// A live NSData's bytes.
fn data(t: &Table, h: Handle) -> Option<&[u8]> {
    match t.get(h)? {
        Obj::Data(d) => Some(d),
        _ => None,
    }
}

fn number(t: &Table, h: Handle) -> Option<i64> {
    match t.get(h)? {
        Obj::Number(n) => Some(*n),
        _ => None,
    }
}

fn items(t: &Table, h: Handle) -> Option<Vec<Handle>> {
    match t.get(h)? {
        Obj::Array(v) => Some(v.clone()),
        _ => None,
    }
}

fn dict_get(t: &Table, dict: Handle, key: &str) -> Option<Handle> {
    match t.get(dict)? {
        Obj::Dict(pairs) => pairs
            .iter()
            .find(|(k, _)| t.text(*k).as_deref() == Some(key))
            .map(|&(_, v)| v),
        _ => None,
    }
}

/// The weights dictionary as `(key, data)` pairs; a malformed entry is a
/// violation (maderix/ANE training/ane_runtime.h, ane_compile, builds
/// `{path: {"offset": @0, "data": NSData}}`; Orion core/ane_runtime.m,
/// orion_compile_mil, reads each entry's `data` back to write the blob
/// files; Orion §8: the offset in the dictionary is 0, the 64 is in the
/// text).
fn weight_entries(t: &mut Table, weights: Handle) -> Vec<(String, Vec<u8>)> {
    if weights == 0 {
        return vec![];
    }
    let pairs = match t.get(weights) {
        Some(Obj::Dict(p)) => p.clone(),
        _ => {
            t.violation("modelWithMILText: weights is not a dictionary".into());
            return vec![];
        }
    };
    let mut out = vec![];
    for (k, v) in pairs {
        let Some(key) = t.text(k) else {
            t.violation("modelWithMILText: a weights key is not a string".into());
            continue;
        };
        let offset = dict_get(t, v, "offset").and_then(|h| number(t, h));
        let bytes = dict_get(t, v, "data").and_then(|h| data(t, h).map(<[u8]>::to_vec));
        match (offset, bytes) {
            (Some(0), Some(b)) => out.push((key, b)),
            _ => t.violation(format!(
                "modelWithMILText: weights entry '{key}' is not {{\"offset\": @0, \"data\": NSData}}"
            )),
        }
    }
    out
}

/// `modelWithMILText:weights:optionsPlist:`; `None` (nil) when the
/// arguments are not what the references pass.
pub fn descriptor(
    t: &mut Table,
    mil: Handle,
    weights: Handle,
    options: Handle,
) -> Option<Descriptor> {
    // Orion docs/ane_constraints.md §9: an NSString here crashes or fails.
    if data(t, mil).is_none() {
        t.violation(format!(
            "modelWithMILText: got a {} for the MIL text; it must be NSData (Orion §9)",
            t.kind(mil)
        ));
        return None;
    }
    // "The weights parameter must be a dictionary, not nil. Pass @{} for
    // weight-free programs" (Orion docs/ane_api_reference.md, "1. Create
    // Descriptor"; Orion core/ane_runtime.m passes `weight_dict ?: @{}`).
    // maderix/ANE training/ane_runtime.h passes nil without weights; the
    // stand-in holds callers to the stricter reading.
    if !matches!(t.get(weights), Some(Obj::Dict(_))) {
        t.violation(format!(
            "modelWithMILText: weights is {}; pass a dictionary (@{{}} without weights)",
            if weights == 0 {
                "nil".to_string()
            } else {
                format!("a {}", t.kind(weights))
            }
        ));
        return None;
    }
    weight_entries(t, weights);
    // The references pass nil options (maderix/ANE training/ane_runtime.h
    // and Orion core/ane_runtime.m, modelWithMILText:weights:optionsPlist:).
    if options != 0 {
        t.violation("modelWithMILText: optionsPlist is not nil, as no reference passes".into());
    }
    Some(Descriptor { mil, weights })
}

/// `inMemoryModelWithDescriptor:`. The model's identifier, and so its
/// temporary directory and compiled program, follows the MIL text and the
/// weight dictionary's keys, not the weights' bytes: Orion
/// core/ane_runtime.m reuses a donor's directory when "Same hexId as donor
/// (same MIL text + weight dict keys)" and only rewrites the weight files.
/// Two programs that differ only in a constant's bytes therefore share a
/// directory: callers must let every constant show in the text.
pub fn model(t: &Table, desc: &Descriptor) -> Model {
    // Only equality matters.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(data(t, desc.mil).unwrap_or_default());
    if let Some(Obj::Dict(pairs)) = t.get(desc.weights) {
        let mut keys: Vec<String> = pairs.iter().filter_map(|&(k, _)| t.text(k)).collect();
        keys.sort();
        for k in keys {
            eat(k.as_bytes());
        }
    }
    Model {
        descriptor: 0,
        hex: format!("{h:016X}{:016X}", h.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15),
        exe: None,
        loaded: false,
    }
}

/// The model's directory under `NSTemporaryDirectory()`.
pub fn model_dir(m: &Model) -> PathBuf {
    Path::new(&temporary_directory()).join(&m.hex)
}

/// `compileWithQoS:options:error:`. The compiler reads the program and
/// its weights from the model's temporary directory, which the caller
/// fills first (Orion core/ane_runtime.m orion_compile_mil: "ANE compiler
/// reads from filesystem"; maderix/ANE training/ane_runtime.h ane_compile
/// writes `model.mil` and `weights/…` there before compiling).
pub fn compile(t: &mut Table, model: Handle, compiles: &mut usize) -> Outcome {
    let (desc, dir, compiled) = match t.get(model) {
        Some(Obj::Model(m)) => (m.descriptor, model_dir(m), m.exe.is_some()),
        _ => return fail(1, "compileWithQoS: sent to something that is not a model"),
    };
    if compiled {
        t.violation("compileWithQoS: on a model already compiled".into());
    }
    let (mil_h, weights_h) = match t.get(desc) {
        Some(Obj::Descriptor(d)) => (d.mil, d.weights),
        _ => return fail(1, "the model has no descriptor"),
    };
    let text = data(t, mil_h).unwrap_or_default().to_vec();
    let weights = weight_entries(t, weights_h);
    if *compiles >= COMPILE_BUDGET {
        return fail(
            1,
            format!("ANECCompile() FAILED: {compiles} programs already compiled in this process (the compiler fails after about {COMPILE_BUDGET}: Orion §5)"),
        );
    }
    // maderix/ANE and Orion always create weights/ (maderix
    // training/ane_runtime.h ane_compile, training_dynamic/io.h; Orion
    // core/ane_runtime.m orion_compile_mil).
    if !dir.join("weights").is_dir() {
        t.violation(format!(
            "compileWithQoS: {}/weights does not exist; the references create it for every program",
            dir.display()
        ));
    }
    match std::fs::read(dir.join("model.mil")) {
        Ok(on_disk) if on_disk == text => {}
        Ok(_) => {
            return fail(
                1,
                "ANECCompile() FAILED: model.mil differs from the descriptor's MIL text",
            )
        }
        Err(e) => {
            return fail(
                1,
                format!(
                    "ANECCompile() FAILED: cannot read {}/model.mil: {e}",
                    dir.display()
                ),
            )
        }
    }
    let mut blobs = vec![];
    for (key, bytes) in &weights {
        let Some(rel) = key.strip_prefix("@model_path/") else {
            return fail(
                1,
                format!("ANECCompile() FAILED: weight key '{key}' is not under @model_path/"),
            );
        };
        match std::fs::read(dir.join(rel)) {
            Ok(on_disk) if &on_disk == bytes => blobs.push((key.clone(), on_disk)),
            Ok(_) => {
                return fail(
                    1,
                    format!("ANECCompile() FAILED: {rel} differs from the descriptor's weights"),
                )
            }
            Err(e) => return fail(1, format!("ANECCompile() FAILED: cannot read {rel}: {e}")),
        }
    }
    let text = match String::from_utf8(text) {
        Ok(s) => s,
        Err(_) => return fail(1, "ANECCompile() FAILED: the MIL text is not UTF-8"),
    };
    let exe = mil::parse_and_validate(&text)
        .map_err(|e| e.to_string())
        .and_then(|p| {
            let f = p.main().ok_or("no main function")?;
            Executable::with_blobs(f, &blobs).map_err(|e| e.to_string())
        });
    let exe = match exe {
        Ok(exe) => exe,
        Err(e) => return fail(1, format!("ANECCompile() FAILED: {e}")),
    };
    *compiles += 1;
    if let Some(Obj::Model(m)) = t.get_mut(model) {
        m.exe = Some(exe);
    }
    Ok(())
}

/// `loadWithQoS:options:error:` (after a successful compile).
pub fn load(t: &mut Table, model: Handle) -> Outcome {
    match t.get_mut(model) {
        Some(Obj::Model(m)) if m.exe.is_some() => {
            m.loaded = true;
            Ok(())
        }
        Some(Obj::Model(_)) => fail(2, "loadWithQoS: the model is not compiled"),
        _ => fail(2, "loadWithQoS: sent to something that is not a model"),
    }
}

/// `unloadWithQoS:error:`.
pub fn unload(t: &mut Table, model: Handle) -> Outcome {
    match t.get_mut(model) {
        Some(Obj::Model(m)) if m.loaded => {
            m.loaded = false;
            Ok(())
        }
        Some(Obj::Model(_)) => fail(3, "unloadWithQoS: the model is not loaded"),
        _ => fail(3, "unloadWithQoS: sent to something that is not a model"),
    }
}

/// The surfaces of a request's input or output array, in index order;
/// indices are NSNumbers 0..n (maderix training/ane_runtime.h ane_compile,
/// training_dynamic/io.h `@[@0]`).
fn request_surfaces(
    t: &mut Table,
    arr: Handle,
    idx: Handle,
    what: &str,
) -> Result<Vec<Handle>, Failure> {
    let (Some(objs), Some(idx)) = (items(t, arr), items(t, idx)) else {
        return Err(Failure {
            code: 4,
            description: format!("the request's {what} are not arrays"),
        });
    };
    let numbers: Vec<Option<i64>> = idx.iter().map(|&h| number(t, h)).collect();
    if numbers.len() != objs.len()
        || numbers
            .iter()
            .enumerate()
            .any(|(i, n)| *n != Some(i as i64))
    {
        t.violation(format!(
            "the request's {what} indices are not @0..@{}",
            objs.len()
        ));
    }
    let mut out = vec![];
    for o in objs {
        match t.get(o) {
            Some(Obj::SurfaceObject(s)) => out.push(*s),
            _ => {
                return Err(Failure {
                    code: 4,
                    description: format!(
                        "the request's {what} hold a {}, not an _ANEIOSurfaceObject",
                        t.kind(o)
                    ),
                })
            }
        }
    }
    Ok(out)
}

/// `evaluateWithQoS:options:request:error:`: reads each input surface as
/// packed fp16 `[1, C, 1, S]` from its first byte, runs the program, and
/// writes each output the same way.
pub fn evaluate(t: &mut Table, model: Handle, request: Handle) -> Outcome {
    let (ins, in_idx, outs, out_idx, procedure) = match t.get(request) {
        Some(Obj::Request(r)) => (
            r.inputs,
            r.input_indices,
            r.outputs,
            r.output_indices,
            r.procedure,
        ),
        _ => return fail(4, "evaluateWithQoS: the request is not an _ANERequest"),
    };
    // procedureIndex @0 (maderix training/ane_runtime.h ane_compile, Orion
    // core/ane_runtime.m orion_eval).
    if number(t, procedure) != Some(0) {
        t.violation("the request's procedureIndex is not @0".into());
    }
    let inputs = request_surfaces(t, ins, in_idx, "inputs")?;
    let outputs = request_surfaces(t, outs, out_idx, "outputs")?;
    let (in_types, out_types) = match t.get(model) {
        Some(Obj::Model(m)) if m.loaded => {
            let exe = m.exe.as_ref().expect("a loaded model is compiled");
            (exe.input_types(), exe.output_types())
        }
        Some(Obj::Model(_)) => return fail(5, "evaluateWithQoS: the model is not loaded"),
        _ => return fail(5, "evaluateWithQoS: sent to something that is not a model"),
    };
    if inputs.len() != in_types.len() || outputs.len() != out_types.len() {
        return fail(
            5,
            format!(
                "{STATUS_0X1D} ({} input and {} output surfaces for a program of {} and {})",
                inputs.len(),
                outputs.len(),
                in_types.len(),
                out_types.len()
            ),
        );
    }
    // Surfaces map to the program's inputs and outputs in name order
    // (Orion §3 and §13).
    let sorted = |types: &[(String, mil::Ty)]| {
        let mut v: Vec<(String, mil::Ty)> = types.to_vec();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (in_sorted, out_sorted) = (sorted(&in_types), sorted(&out_types));
    let mut sizes = vec![];
    for (&s, (name, ty)) in inputs
        .iter()
        .zip(&in_sorted)
        .chain(outputs.iter().zip(&out_sorted))
    {
        let Some(Obj::Surface(surf)) = t.get(s) else {
            return fail(5, format!("the surface for '{name}' was freed"));
        };
        let (locked, len) = (!surf.locks.is_empty(), surf.len);
        // The references unlock every surface before evaluating
        // (maderix training_dynamic/io.h:53-96, Orion
        // core/iosurface_tensor.m:50-62).
        if locked {
            t.violation(format!(
                "evaluateWithQoS: the surface for '{name}' is locked by the CPU"
            ));
        }
        let need = ty.elems() * 2;
        if len < MIN_SURFACE_BYTES || len < need || ty.dtype != DType::Fp16 {
            return fail(
                5,
                format!(
                    "{STATUS_0X1D} ('{name}': a {}-byte surface for {} {:?}; at least {MIN_SURFACE_BYTES} bytes needed, Orion §4)",
                    len,
                    ty.dtype,
                    ty.dims()
                ),
            );
        }
        // Runtime surfaces narrower than 32 "compile without error and the
        // eval call returns, but the output contains garbage or the eval
        // returns a non-zero status" (apple-neural-engine-field-guide
        // README.md, "The SP=32 Constraint"): the stand-in fails them.
        let width = ty.dims().last().copied().unwrap_or(0);
        if width < MIN_WIDTH {
            return fail(
                5,
                format!(
                    "{STATUS_0X1D} ('{name}' is {width} wide; runtime surfaces need a width of at least {MIN_WIDTH}, field guide \"The SP=32 Constraint\")"
                ),
            );
        }
        sizes.push(len);
    }
    // Several inputs or outputs must all be allocated alike (Orion §2, §12).
    let (n_in, n_out) = (inputs.len(), outputs.len());
    let uniform = |s: &[usize]| s.windows(2).all(|w| w[0] == w[1]);
    if (n_in > 1 && !uniform(&sizes[..n_in])) || (n_out > 1 && !uniform(&sizes[n_in..n_in + n_out]))
    {
        return fail(5, format!("{STATUS_0X1D} (surfaces of different sizes)"));
    }
    // Inputs in the program's declaration order.
    let mut xs = vec![];
    let exe_inputs: Vec<String> = in_types.iter().map(|(n, _)| n.clone()).collect();
    for name in &exe_inputs {
        let k = in_sorted
            .iter()
            .position(|(n, _)| n == name)
            .expect("same names");
        let ty = &in_sorted[k].1;
        let Some(Obj::Surface(surf)) = t.get(inputs[k]) else {
            unreachable!("checked above")
        };
        // Packed from the first byte whatever the surface's size (Orion §14).
        let mut v = vec![0f32; ty.elems()];
        let halves: Vec<f16> = surf.bytes()[..ty.elems() * 2]
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        halves.convert_to_f32_slice(&mut v);
        xs.push(Tensor::float(DType::Fp16, ty.dims().to_vec(), v));
    }
    let Some(Obj::Model(m)) = t.get(model) else {
        unreachable!("checked above")
    };
    let results = match m.exe.as_ref().expect("loaded").run(xs, Precision::Fp16) {
        Ok(r) => r,
        Err(e) => return fail(6, format!("evaluation failed: {e}")),
    };
    for ((name, _), y) in out_types.iter().zip(results) {
        let k = out_sorted
            .iter()
            .position(|(n, _)| n == name)
            .expect("same names");
        let values = match y.f32s() {
            Ok(v) => v.to_vec(),
            Err(e) => return fail(6, e),
        };
        let mut halves = vec![f16::ZERO; values.len()];
        halves.convert_from_f32_slice(&values);
        let Some(Obj::Surface(surf)) = t.get_mut(outputs[k]) else {
            unreachable!("checked above")
        };
        for (dst, h) in surf.bytes_mut().chunks_exact_mut(2).zip(&halves) {
            dst.copy_from_slice(&h.to_le_bytes());
        }
    }
    Ok(())
}
