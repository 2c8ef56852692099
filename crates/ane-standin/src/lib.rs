//! A stand-in for Apple's runtime, so `ane::AneDevice` — the macOS Neural
//! Engine device — runs end to end on Linux. **A testing aid, never
//! shipped**: `ANETRAIN_ANE_RUNTIME=path/to/libane_standin.so` makes the
//! device load this one library in place of libobjc, CoreFoundation,
//! Foundation, IOSurface and AppleNeuralEngine.framework.
//!
//! It exports exactly the C symbols the device resolves (the Objective-C
//! runtime entry points, the CoreFoundation/Foundation/IOSurface functions
//! and constants) and answers the `_ANE*` messages sent through
//! `objc_msgSend`. Its behaviour comes from the working implementations,
//! cited where each check is made ([`ane`]); it keeps every object in a
//! table with reference counts ([`objects`]) and records each misuse a real
//! runtime would crash on or that departs from the references' call
//! pattern as a *violation*. [`report`] (and, at exit, the file named by
//! `ANE_STANDIN_REPORT`) says what is still alive, what is still locked,
//! how many locks, compiles and evaluations there were, and every
//! violation.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, MutexGuard};

pub mod ane;
pub mod objects;

use objects::{Handle, Obj, Surface, Table};

// SAFETY: a surface's base pointer is only touched by
// the single thread that drives the device, under the table's mutex or
// between IOSurfaceLock and IOSurfaceUnlock, as on macOS.
unsafe impl Send for Surface {}

struct State {
    table: Table,
    /// Interned selector names; a selector is its index + SEL_BASE.
    selectors: Vec<String>,
    compiles: usize,
    evaluations: u64,
    exit_hook: bool,
    /// Every model directory name handed out (`hexStringIdentifier`).
    hexes: std::collections::BTreeSet<String>,
}

static STATE: Mutex<State> = Mutex::new(State {
    table: Table::new(),
    selectors: Vec::new(),
    compiles: 0,
    hexes: std::collections::BTreeSet::new(),
    evaluations: 0,
    exit_hook: false,
});

fn state() -> MutexGuard<'static, State> {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if !s.exit_hook {
        s.exit_hook = true;
        // SAFETY: registers a plain extern "C" function with libc.
        unsafe { atexit(write_report_at_exit) };
    }
    s
}

extern "C" {
    fn atexit(f: extern "C" fn()) -> i32;
}

const SEL_BASE: Handle = 0x5e1_0000;
const CLASS_BASE: Handle = 0xc1a_0000;

/// The classes the framework registers (maderix training/ane_runtime.h
/// ane_init, Orion core/ane_runtime.m orion_ane_init).
const CLASSES: [&str; 4] = [
    "_ANEInMemoryModelDescriptor",
    "_ANEInMemoryModel",
    "_ANERequest",
    "_ANEIOSurfaceObject",
];

/// The methods the references call: (class, selector, class method?).
const METHODS: [(usize, &str, bool); 9] = [
    (0, "modelWithMILText:weights:optionsPlist:", true),
    (1, "inMemoryModelWithDescriptor:", true),
    (1, "hexStringIdentifier", false),
    (1, "compileWithQoS:options:error:", false),
    (1, "loadWithQoS:options:error:", false),
    (1, "evaluateWithQoS:options:request:error:", false),
    (1, "unloadWithQoS:error:", false),
    (
        2,
        "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:",
        true,
    ),
    (3, "objectWithIOSurface:", true),
];

/// The QoS maderix/ANE and Orion pass (21, QOS_CLASS_DEFAULT, as
/// `compileWithQoS:21`: maderix training/ane_runtime.h ane_compile, Orion
/// core/ane_runtime.m orion_compile_mil).
const QOS: u32 = 21;

/// The IOSurface property keys (`extern const CFStringRef`): each holds a
/// constant string handle.
const SURFACE_KEYS: [(&str, Handle); 6] = [
    ("IOSurfaceWidth", 0x1000),
    ("IOSurfaceHeight", 0x1010),
    ("IOSurfaceBytesPerElement", 0x1020),
    ("IOSurfaceBytesPerRow", 0x1030),
    ("IOSurfaceAllocSize", 0x1040),
    ("IOSurfacePixelFormat", 0x1050),
];

#[no_mangle]
pub static kIOSurfaceWidth: Handle = SURFACE_KEYS[0].1;
#[no_mangle]
pub static kIOSurfaceHeight: Handle = SURFACE_KEYS[1].1;
#[no_mangle]
pub static kIOSurfaceBytesPerElement: Handle = SURFACE_KEYS[2].1;
#[no_mangle]
pub static kIOSurfaceBytesPerRow: Handle = SURFACE_KEYS[3].1;
#[no_mangle]
pub static kIOSurfaceAllocSize: Handle = SURFACE_KEYS[4].1;
#[no_mangle]
pub static kIOSurfacePixelFormat: Handle = SURFACE_KEYS[5].1;

/// `kCFType…CallBacks`: only their addresses matter (dictionaries and
/// arrays made with them retain their contents).
#[no_mangle]
pub static kCFTypeDictionaryKeyCallBacks: [usize; 6] = [0; 6];
#[no_mangle]
pub static kCFTypeDictionaryValueCallBacks: [usize; 5] = [0; 5];
#[no_mangle]
pub static kCFTypeArrayCallBacks: [usize; 5] = [0; 5];

fn addr<T>(r: &T) -> usize {
    r as *const T as usize
}

fn constants(t: &mut Table) {
    if t.constants.is_empty() {
        for (name, h) in SURFACE_KEYS {
            t.constants.insert(h, name.to_string());
        }
    }
}

// ------------------------------------------------------------ Objective-C

/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn objc_getClass(name: *const c_char) -> Handle {
    if name.is_null() {
        return 0;
    }
    // SAFETY: the caller passes a C string.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    drop(state());
    CLASSES
        .iter()
        .position(|c| *c == name)
        .map_or(0, |i| CLASS_BASE + 16 * i)
}

/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn sel_registerName(name: *const c_char) -> Handle {
    // SAFETY: the caller passes a C string.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let mut s = state();
    let i = match s.selectors.iter().position(|n| *n == name) {
        Some(i) => i,
        None => {
            s.selectors.push(name);
            s.selectors.len() - 1
        }
    };
    SEL_BASE + 16 * i
}

fn selector_name(s: &State, sel: Handle) -> Option<String> {
    let i = sel.checked_sub(SEL_BASE)? / 16;
    s.selectors.get(i).cloned()
}

fn class_index(h: Handle) -> Option<usize> {
    let i = h.checked_sub(CLASS_BASE)? / 16;
    (i < CLASSES.len() && h == CLASS_BASE + 16 * i).then_some(i)
}

fn method(cls: Handle, sel: Handle, class_method: bool) -> *mut c_void {
    let s = state();
    let (Some(c), Some(name)) = (class_index(cls), selector_name(&s, sel)) else {
        return std::ptr::null_mut();
    };
    match METHODS
        .iter()
        .position(|m| m.0 == c && m.1 == name && m.2 == class_method)
    {
        Some(i) => (addr(&METHODS[i])) as *mut c_void,
        None => std::ptr::null_mut(),
    }
}

#[no_mangle]
pub extern "C" fn class_getClassMethod(cls: Handle, sel: Handle) -> *mut c_void {
    method(cls, sel, true)
}

#[no_mangle]
pub extern "C" fn class_getInstanceMethod(cls: Handle, sel: Handle) -> *mut c_void {
    method(cls, sel, false)
}

#[no_mangle]
pub extern "C" fn objc_retain(h: Handle) -> Handle {
    state().table.retain(h);
    h
}

#[no_mangle]
pub extern "C" fn objc_release(h: Handle) {
    state().table.release(h, "objc_release");
}

#[no_mangle]
pub extern "C" fn objc_autoreleasePoolPush() -> usize {
    state().table.push_pool()
}

#[no_mangle]
pub extern "C" fn objc_autoreleasePoolPop(token: usize) {
    state().table.pop_pool(token);
}

/// Stores an autoreleased NSError in `*err` (if given) and returns NO.
///
/// # Safety
/// `err` is null or points to an `id`.
unsafe fn fail_with(s: &mut State, err: *mut Handle, f: ane::Failure) -> usize {
    let domain = s
        .table
        .create(Obj::Str("com.apple.appleneuralengine".into()));
    let e = s.table.autoreleased(Obj::Error {
        domain,
        code: f.code,
        description: f.description,
    });
    s.table.release(domain, "release");
    if !err.is_null() {
        // SAFETY: the caller passes NULL or an NSError** slot.
        unsafe { *err = e };
    }
    0
}

/// # Safety
/// `err` is null or points to an `id`.
unsafe fn outcome(s: &mut State, err: *mut Handle, r: ane::Outcome) -> usize {
    match r {
        Ok(()) => 1,
        // SAFETY: forwarded from the caller.
        Err(f) => unsafe { fail_with(s, err, f) },
    }
}

/// Every `_ANE*` message, cast by the caller to the selector's exact
/// prototype (all arguments are pointer- or integer-sized, so they arrive
/// in the registers and stack slots these parameters name; a selector
/// reads only the arguments it has).
///
/// # Safety
/// Called through the prototype of `sel`; pointer arguments are what that
/// selector takes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn objc_msgSend(
    recv: Handle,
    sel: Handle,
    a: usize,
    b: usize,
    c: usize,
    d: usize,
    e: usize,
    f: usize,
    g: usize,
) -> usize {
    let mut s = state();
    constants(&mut s.table);
    let Some(name) = selector_name(&s, sel) else {
        s.table.violation(format!(
            "objc_msgSend with an unregistered selector {sel:#x}"
        ));
        return 0;
    };
    let class = class_index(recv);
    let State {
        table: t, hexes, ..
    } = &mut *s;
    match (class, name.as_str()) {
        (Some(0), "modelWithMILText:weights:optionsPlist:") => {
            match ane::descriptor(t, a, b, c) {
                Some(desc) => t.autoreleased(Obj::Descriptor(desc)),
                None => 0,
            }
        }
        (Some(1), "inMemoryModelWithDescriptor:") => {
            let Some(Obj::Descriptor(desc)) = t.get(a) else {
                t.violation(format!(
                    "inMemoryModelWithDescriptor: got a {}",
                    t.kind(a)
                ));
                return 0;
            };
            let mut m = ane::model(t, desc);
            m.descriptor = a;
            hexes.insert(m.hex.clone());
            t.autoreleased(Obj::Model(Box::new(m)))
        }
        (Some(2), "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:") => {
            // weightsBuffer and perfStats are nil in maderix/ANE and Orion
            // (maderix training/ane_runtime.h ane_compile,
            // training_dynamic/io.h, Orion core/ane_runtime.m orion_eval).
            if e != 0 || f != 0 {
                t.violation("requestWithInputs: weightsBuffer/perfStats are not nil".into());
            }
            t.autoreleased(Obj::Request(objects::Request {
                inputs: a,
                input_indices: b,
                outputs: c,
                output_indices: d,
                procedure: g,
            }))
        }
        (Some(3), "objectWithIOSurface:") => match t.get(a) {
            Some(Obj::Surface(_)) => t.autoreleased(Obj::SurfaceObject(a)),
            _ => {
                t.violation(format!("objectWithIOSurface: got a {}", t.kind(a)));
                0
            }
        },
        (None, _) => {
            // SAFETY: forwarded from the caller: the arguments are those of
            // the selector's prototype.
            unsafe { model_message(&mut s, recv, &name, a, b, c, d) }
        }
        (Some(i), other) => {
            t.violation(format!("unknown message +{other} to {}", CLASSES[i]));
            0
        }
    }
}

/// The instance methods of `_ANEInMemoryModel`.
///
/// # Safety
/// The arguments are those of `name`'s prototype; the `NSError **` one is
/// null or writable.
unsafe fn model_message(
    s: &mut State,
    recv: Handle,
    name: &str,
    a: usize,
    b: usize,
    c: usize,
    d: usize,
) -> usize {
    let t = &mut s.table;
    let hex = match t.get(recv) {
        Some(Obj::Model(m)) => m.hex.clone(),
        other => {
            let what = if other.is_some() {
                t.kind(recv)
            } else {
                "object that is not alive"
            };
            t.violation(format!("-{name} sent to a {what} ({recv:#x})"));
            return 0;
        }
    };
    let qos = a as u32;
    let (result, err) = match name {
        "hexStringIdentifier" => return t.autoreleased(Obj::Str(hex)),
        "compileWithQoS:options:error:" => {
            check_qos_options(t, name, qos, b);
            (ane::compile(t, recv, &mut s.compiles), c)
        }
        "loadWithQoS:options:error:" => {
            check_qos_options(t, name, qos, b);
            (ane::load(t, recv), c)
        }
        "evaluateWithQoS:options:request:error:" => {
            check_qos_options(t, name, qos, b);
            s.evaluations += 1;
            (ane::evaluate(t, recv, c), d)
        }
        "unloadWithQoS:error:" => {
            if qos != QOS {
                t.violation(format!("-{name} with QoS {qos}, not {QOS}"));
            }
            (ane::unload(t, recv), b)
        }
        other => {
            t.violation(format!("unknown message -{other} to a model"));
            return 0;
        }
    };
    // SAFETY: err is the selector's NSError** argument.
    unsafe { outcome(s, err as *mut Handle, result) }
}

/// QoS 21 and an empty options dictionary (`@{}`), as maderix/ANE and
/// Orion pass them (maderix training/ane_runtime.h ane_compile and ane_eval;
/// Orion core/ane_runtime.m orion_compile_mil and orion_eval).
fn check_qos_options(t: &mut Table, sel: &str, qos: u32, options: Handle) {
    if qos != QOS {
        t.violation(format!("-{sel} with QoS {qos}, not {QOS}"));
    }
    if !matches!(t.get(options), Some(Obj::Dict(p)) if p.is_empty()) {
        t.violation(format!("-{sel} options is not an empty dictionary"));
    }
}

// --------------------------------------------------------- CoreFoundation

/// `kCFStringEncodingUTF8`.
const UTF8: u32 = 0x0800_0100;
/// `kCFNumberSInt64Type`.
const SINT64: isize = 4;

/// # Safety
/// `bytes` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn CFDataCreate(_alloc: usize, bytes: *const u8, len: isize) -> Handle {
    let v = if len > 0 {
        // SAFETY: the caller passes len readable bytes.
        unsafe { std::slice::from_raw_parts(bytes, len as usize) }.to_vec()
    } else {
        vec![]
    };
    state().table.create(Obj::Data(v))
}

/// # Safety
/// `value` points to a number of type `kind`.
#[no_mangle]
pub unsafe extern "C" fn CFNumberCreate(
    _alloc: usize,
    kind: isize,
    value: *const c_void,
) -> Handle {
    let mut s = state();
    if kind != SINT64 || value.is_null() {
        s.table.violation(format!(
            "CFNumberCreate with type {kind}, not kCFNumberSInt64Type"
        ));
        return 0;
    }
    // SAFETY: a kCFNumberSInt64Type value is an i64.
    let v = unsafe { *(value as *const i64) };
    s.table.create(Obj::Number(v))
}

/// # Safety
/// `bytes` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn CFStringCreateWithBytes(
    _alloc: usize,
    bytes: *const u8,
    len: isize,
    encoding: u32,
    _external: u8,
) -> Handle {
    let mut s = state();
    if encoding != UTF8 {
        s.table.violation(format!(
            "CFStringCreateWithBytes with encoding {encoding:#x}"
        ));
        return 0;
    }
    let v = if len > 0 {
        // SAFETY: the caller passes len readable bytes.
        unsafe { std::slice::from_raw_parts(bytes, len as usize) }
    } else {
        &[]
    };
    match std::str::from_utf8(v) {
        Ok(text) => s.table.create(Obj::Str(text.into())),
        Err(_) => 0,
    }
}

/// Length in UTF-16 code units, as CoreFoundation counts.
#[no_mangle]
pub extern "C" fn CFStringGetLength(h: Handle) -> isize {
    let mut s = state();
    constants(&mut s.table);
    match s.table.text(h) {
        Some(t) => t.encode_utf16().count() as isize,
        None => {
            let msg = format!("CFStringGetLength of a {}", s.table.kind(h));
            s.table.violation(msg);
            0
        }
    }
}

/// # Safety
/// `buf` points to `size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn CFStringGetCString(
    h: Handle,
    buf: *mut c_char,
    size: isize,
    encoding: u32,
) -> u8 {
    let mut s = state();
    constants(&mut s.table);
    let Some(text) = s.table.text(h) else {
        let msg = format!("CFStringGetCString of a {}", s.table.kind(h));
        s.table.violation(msg);
        return 0;
    };
    if encoding != UTF8 || size <= text.len() as isize || buf.is_null() {
        return 0;
    }
    // SAFETY: size > text.len() bytes are writable at buf.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, text.len());
        *buf.add(text.len()) = 0;
    }
    1
}

/// # Safety
/// `keys` and `values` point to `n` handles each.
#[no_mangle]
pub unsafe extern "C" fn CFDictionaryCreate(
    _alloc: usize,
    keys: *const Handle,
    values: *const Handle,
    n: isize,
    key_callbacks: usize,
    value_callbacks: usize,
) -> Handle {
    let mut s = state();
    if key_callbacks != addr(&kCFTypeDictionaryKeyCallBacks)
        || value_callbacks != addr(&kCFTypeDictionaryValueCallBacks)
    {
        s.table.violation(
            "CFDictionaryCreate without the kCFType callbacks (contents not retained)".into(),
        );
    }
    let n = n.max(0) as usize;
    let pairs = if n == 0 {
        vec![]
    } else {
        // SAFETY: the caller passes n keys and n values.
        let (k, v) = unsafe {
            (
                std::slice::from_raw_parts(keys, n),
                std::slice::from_raw_parts(values, n),
            )
        };
        k.iter().copied().zip(v.iter().copied()).collect()
    };
    s.table.create(Obj::Dict(pairs))
}

/// # Safety
/// `items` points to `n` handles.
#[no_mangle]
pub unsafe extern "C" fn CFArrayCreate(
    _alloc: usize,
    items: *const Handle,
    n: isize,
    callbacks: usize,
) -> Handle {
    let mut s = state();
    if callbacks != addr(&kCFTypeArrayCallBacks) {
        s.table.violation(
            "CFArrayCreate without kCFTypeArrayCallBacks (contents not retained)".into(),
        );
    }
    let n = n.max(0) as usize;
    let v = if n == 0 {
        vec![]
    } else {
        // SAFETY: the caller passes n items.
        unsafe { std::slice::from_raw_parts(items, n) }.to_vec()
    };
    s.table.create(Obj::Array(v))
}

/// A +1 copy of the error's description.
#[no_mangle]
pub extern "C" fn CFErrorCopyDescription(h: Handle) -> Handle {
    let mut s = state();
    let text = match s.table.get(h) {
        Some(Obj::Error { description, .. }) => description.clone(),
        _ => {
            let msg = format!("CFErrorCopyDescription of a {}", s.table.kind(h));
            s.table.violation(msg);
            return 0;
        }
    };
    s.table.create(Obj::Str(text))
}

#[no_mangle]
pub extern "C" fn CFErrorGetCode(h: Handle) -> isize {
    match state().table.get(h) {
        Some(Obj::Error { code, .. }) => *code,
        _ => 0,
    }
}

/// The error's domain (+0: owned by the error, the Get rule).
#[no_mangle]
pub extern "C" fn CFErrorGetDomain(h: Handle) -> Handle {
    match state().table.get(h) {
        Some(Obj::Error { domain, .. }) => *domain,
        _ => 0,
    }
}

#[no_mangle]
pub extern "C" fn CFRelease(h: Handle) {
    state().table.release(h, "CFRelease");
}

// --------------------------------------------------------------- Foundation

/// An autoreleased NSString.
#[no_mangle]
pub extern "C" fn NSTemporaryDirectory() -> Handle {
    state()
        .table
        .autoreleased(Obj::Str(ane::temporary_directory()))
}

// ---------------------------------------------------------------- IOSurface

/// `kIOSurfaceLockReadOnly`.
const LOCK_READ_ONLY: u32 = 1;

/// A flat byte surface. The references create every ANE surface with
/// width = bytesPerRow = allocSize = bytes, height 1, one byte per element,
/// pixel format 0 (maderix training/ane_runtime.h ane_create_surface and
/// training_dynamic/io.h:6-11, Orion core/iosurface_tensor.m:18-25); other
/// properties are a violation.
#[no_mangle]
pub extern "C" fn IOSurfaceCreate(props: Handle) -> Handle {
    let mut s = state();
    constants(&mut s.table);
    let t = &mut s.table;
    let Some(Obj::Dict(pairs)) = t.get(props) else {
        t.violation("IOSurfaceCreate without a property dictionary".into());
        return 0;
    };
    let value = |key: Handle| -> Option<i64> {
        pairs
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|&(_, v)| match t.get(v) {
                Some(Obj::Number(n)) => Some(*n),
                _ => None,
            })
    };
    let [w, h, bpe, bpr, alloc, pf] = SURFACE_KEYS.map(|(_, k)| value(k));
    let bytes = match (w, h, bpe, bpr, alloc, pf) {
        (Some(w), Some(1), Some(1), Some(r), Some(a), Some(0)) if w == r && w == a && w > 0 => {
            w as usize
        }
        _ => {
            t.violation(format!(
                "IOSurfaceCreate properties width {w:?} height {h:?} bytes/element {bpe:?} bytes/row {bpr:?} alloc {alloc:?} pixel format {pf:?} are not the references' flat byte surface"
            ));
            return 0;
        }
    };
    t.create(Obj::Surface(Surface::new(bytes)))
}

fn with_surface<T>(
    h: Handle,
    what: &str,
    f: impl FnOnce(&mut Table, &mut Surface) -> T,
) -> Option<T> {
    let mut s = state();
    let t = &mut s.table;
    // Take the surface out while `f` may record violations, then put it back.
    let mut surf = match t.get_mut(h) {
        Some(Obj::Surface(surf)) => std::mem::replace(surf, Surface::new(0)),
        _ => {
            t.violation(format!("{what} on a {} ({h:#x})", t.kind(h)));
            return None;
        }
    };
    let out = f(t, &mut surf);
    if let Some(Obj::Surface(slot)) = t.get_mut(h) {
        *slot = surf;
    }
    Some(out)
}

/// Locks nest; options are 0 (read-write) or `kIOSurfaceLockReadOnly`, and
/// each unlock passes the options of its lock (maderix
/// training_dynamic/io.h:54-61, ncdrone/ane crates/ane/src/io_surface.rs:66-84).
#[no_mangle]
pub extern "C" fn IOSurfaceLock(h: Handle, options: u32, _seed: *mut u32) -> i32 {
    with_surface(h, "IOSurfaceLock", |t, surf| {
        if options != 0 && options != LOCK_READ_ONLY {
            t.violation(format!("IOSurfaceLock with options {options:#x}"));
        }
        if options == LOCK_READ_ONLY && surf.locks.is_empty() {
            surf.read_only_sum = Some(surf.checksum());
        }
        surf.locks.push(options);
        surf.locks_taken += 1;
        0
    })
    .unwrap_or(1)
}

#[no_mangle]
pub extern "C" fn IOSurfaceUnlock(h: Handle, options: u32, _seed: *mut u32) -> i32 {
    with_surface(h, "IOSurfaceUnlock", |t, surf| {
        let Some(held) = surf.locks.pop() else {
            t.violation(format!("IOSurfaceUnlock of {h:#x}, which is not locked"));
            return 1;
        };
        if held != options {
            t.violation(format!(
                "IOSurfaceUnlock with options {options:#x} of a lock taken with {held:#x}"
            ));
        }
        if surf.locks.is_empty() {
            if let Some(sum) = surf.read_only_sum.take() {
                if held == LOCK_READ_ONLY && sum != surf.checksum() {
                    t.violation(format!("IOSurface {h:#x} written under a read-only lock"));
                }
            }
        }
        0
    })
    .unwrap_or(1)
}

/// The surface's memory; touching it unlocked is a violation (every
/// reference locks around each access, see IOSurfaceLock).
#[no_mangle]
pub extern "C" fn IOSurfaceGetBaseAddress(h: Handle) -> *mut c_void {
    with_surface(h, "IOSurfaceGetBaseAddress", |t, surf| {
        if surf.locks.is_empty() {
            t.violation(format!("IOSurfaceGetBaseAddress of {h:#x} while unlocked"));
        }
        surf.base as *mut c_void
    })
    .unwrap_or(std::ptr::null_mut())
}

#[no_mangle]
pub extern "C" fn IOSurfaceGetAllocSize(h: Handle) -> usize {
    with_surface(h, "IOSurfaceGetAllocSize", |_, surf| surf.len).unwrap_or(0)
}

// ------------------------------------------------------------------ report

/// What the stand-in saw, as JSON: live objects by kind, surfaces still
/// locked, locks taken over all surfaces (live ones and freed ones),
/// compiles, evaluations, open autorelease pools, violations.
pub fn report() -> String {
    let s = state();
    let t = &s.table;
    let locked = t.surfaces().filter(|(_, x)| !x.locks.is_empty()).count();
    // A model's temporary directory must be gone once the model is: the
    // references remove it after a failed compile or load and when they
    // free a program (maderix/ANE training/ane_runtime.h, ane_compile's
    // failure paths and ane_free; Orion core/ane_runtime.m,
    // orion_compile_mil's failure paths and orion_release_program).
    let live_hexes: std::collections::BTreeSet<String> =
        t.models().map(|m| m.hex.clone()).collect();
    let mut violations = t.violations.clone();
    for hex in s.hexes.difference(&live_hexes) {
        let dir = std::path::Path::new(&ane::temporary_directory()).join(hex);
        if dir.exists() {
            violations.push(format!(
                "the temporary directory {} outlived its model",
                dir.display()
            ));
        }
    }
    let live_locks: u64 = t.surfaces().map(|(_, x)| x.locks_taken).sum();
    serde_json::json!({
        "live_objects": t.live(),
        "locked_surfaces": locked,
        "locks_taken_by_live_surfaces": live_locks,
        "locks_taken": objects::locks_of_freed_surfaces() + live_locks,
        "compiles": s.compiles,
        "evaluations": s.evaluations,
        "open_pools": t.pools(),
        "violations": violations,
    })
    .to_string()
}

/// [`report`] for C callers: writes up to `cap` bytes of the JSON into
/// `buf` and returns its full length.
///
/// # Safety
/// `buf` points to `cap` writable bytes (or is null with `cap` 0).
#[no_mangle]
pub unsafe extern "C" fn ane_standin_report(buf: *mut u8, cap: usize) -> usize {
    let r = report();
    let n = r.len().min(cap);
    if n > 0 {
        // SAFETY: the caller gives cap writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(r.as_ptr(), buf, n) };
    }
    r.len()
}

/// At exit, the report goes to the file `ANE_STANDIN_REPORT` names.
extern "C" fn write_report_at_exit() {
    if let Some(path) = std::env::var_os("ANE_STANDIN_REPORT") {
        let _ = std::fs::write(path, report());
    }
}
