//! The Apple Neural Engine through `AppleNeuralEngine.framework`'s private
//! in-memory model API, called from Rust via the Objective-C runtime (see
//! [`ffi`]): no Objective-C compiler, no link-time dependency, so this
//! module builds everywhere and, where the frameworks do not exist, opening
//! the device fails with one clear line.
//!
//! Per program: `_ANEInMemoryModelDescriptor modelWithMILText:weights:optionsPlist:`
//! → `_ANEInMemoryModel inMemoryModelWithDescriptor:` → the MIL text and blob
//! files written under `NSTemporaryDirectory()/<hexStringIdentifier>/` →
//! `compileWithQoS:options:error:` → `loadWithQoS:options:error:`; per call
//! `_ANERequest` over `_ANEIOSurfaceObject`-wrapped IOSurfaces →
//! `evaluateWithQoS:options:request:error:`; on drop `unloadWithQoS:error:`.
//! Every BOOL result is checked and its NSError reported.
//!
//! Unsafe code is confined to the calls into the resolved symbols; each
//! block states what it relies on. **This device has not been run on Apple
//! hardware**: it follows the call sequence of the public reverse-engineered
//! projects. On Linux every line of it runs against `crates/ane-standin`, a
//! stand-in of Apple's runtime whose behaviour is taken from those projects
//! (`ANETRAIN_ANE_RUNTIME`, [`AneDevice::with_runtime`]).

pub mod ffi;

use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::rules::RuleSet;
use half::f16;
use half::slice::HalfFloatSliceExt;

use self::ffi::{msg, Api, CfRef, Id, Sel, LOCK_READ_ONLY, SINT64, UTF8};
use crate::{check_program, io_elems, Device, DeviceError, Result, DEFAULT_COMPILE_BUDGET};

/// `QOS_CLASS_DEFAULT` (21), what maderix/ANE (training/ane_runtime.h) and
/// Orion (core/ane_runtime.m; docs/ane_api_reference.md "QoS = 21") pass
/// to every compile, load, evaluate and unload.
const QOS: u32 = 21;

/// The classes the device uses and, per selector, whether it is a class
/// method of the given class (`true`) or an instance method.
const CLASSES: [&str; 4] = [
    "_ANEInMemoryModelDescriptor",
    "_ANEInMemoryModel",
    "_ANERequest",
    "_ANEIOSurfaceObject",
];
const SELECTORS: [(&str, usize, bool); 9] = [
    ("modelWithMILText:weights:optionsPlist:", 0, true),
    ("inMemoryModelWithDescriptor:", 1, true),
    ("hexStringIdentifier", 1, false),
    ("compileWithQoS:options:error:", 1, false),
    ("loadWithQoS:options:error:", 1, false),
    ("evaluateWithQoS:options:request:error:", 1, false),
    ("unloadWithQoS:error:", 1, false),
    (
        "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:",
        2,
        true,
    ),
    ("objectWithIOSurface:", 3, true),
];

/// Indices into [`SELECTORS`].
enum S {
    Descriptor,
    Model,
    HexId,
    Compile,
    Load,
    Evaluate,
    Unload,
    Request,
    SurfaceObject,
}

/// The resolved runtime: symbols, classes, selectors.
struct Runtime {
    api: Api,
    classes: [Id; 4],
    sels: [Sel; 9],
}

/// A CoreFoundation object we own (+1), released on drop.
struct Cf<'a> {
    rt: &'a Runtime,
    p: CfRef,
}

impl Drop for Cf<'_> {
    fn drop(&mut self) {
        if !self.p.is_null() {
            // SAFETY: p is a +1 CF object created by this runtime.
            unsafe { (self.rt.api.CFRelease)(self.p) }
        }
    }
}

impl Runtime {
    fn load(stand_in: Option<&str>) -> std::result::Result<Runtime, String> {
        let api = Api::load(stand_in)?;
        let mut classes = [std::ptr::null_mut(); 4];
        for (slot, name) in classes.iter_mut().zip(CLASSES) {
            let c = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: objc_getClass takes a C string and returns null or a class.
            *slot = unsafe { (api.objc_getClass)(c.as_ptr()) };
            if slot.is_null() {
                return Err(format!(
                    "the Objective-C class {name} is missing (this macOS has a different ANE framework)"
                ));
            }
        }
        let mut sels = [std::ptr::null_mut(); 9];
        for (slot, (name, class, class_method)) in sels.iter_mut().zip(SELECTORS) {
            let c = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: registering a selector name and looking the method up
            // on a live class are side-effect-free runtime queries.
            let found = unsafe {
                *slot = (api.sel_registerName)(c.as_ptr());
                if class_method {
                    (api.class_getClassMethod)(classes[class], *slot)
                } else {
                    (api.class_getInstanceMethod)(classes[class], *slot)
                }
            };
            if found.is_null() {
                return Err(format!(
                    "{} does not respond to {name} (this macOS has a different ANE framework)",
                    CLASSES[class]
                ));
            }
        }
        Ok(Runtime { api, classes, sels })
    }

    fn sel(&self, s: S) -> Sel {
        self.sels[s as usize]
    }

    fn class(&self, i: usize) -> Id {
        self.classes[i]
    }

    /// `f` inside an autorelease pool.
    fn pool<T>(&self, f: impl FnOnce() -> T) -> T {
        // SAFETY: balanced push/pop around f on this thread.
        let token = unsafe { (self.api.objc_autoreleasePoolPush)() };
        let out = f();
        // SAFETY: pops the pool pushed above, on the same thread.
        unsafe { (self.api.objc_autoreleasePoolPop)(token) };
        out
    }

    fn data(&self, bytes: &[u8]) -> Cf<'_> {
        // SAFETY: CFDataCreate copies `len` bytes from a valid slice.
        let p = unsafe {
            (self.api.CFDataCreate)(std::ptr::null(), bytes.as_ptr(), bytes.len() as isize)
        };
        Cf { rt: self, p }
    }

    fn string(&self, s: &str) -> Cf<'_> {
        // SAFETY: UTF-8 bytes of a valid str.
        let p = unsafe {
            (self.api.CFStringCreateWithBytes)(
                std::ptr::null(),
                s.as_ptr(),
                s.len() as isize,
                UTF8,
                0,
            )
        };
        Cf { rt: self, p }
    }

    fn number(&self, v: i64) -> Cf<'_> {
        // SAFETY: reads one i64 through the pointer.
        let p = unsafe {
            (self.api.CFNumberCreate)(std::ptr::null(), SINT64, &v as *const i64 as *const c_void)
        };
        Cf { rt: self, p }
    }

    fn dict(&self, pairs: &[(CfRef, CfRef)]) -> Cf<'_> {
        let keys: Vec<CfRef> = pairs.iter().map(|p| p.0).collect();
        let vals: Vec<CfRef> = pairs.iter().map(|p| p.1).collect();
        // SAFETY: n keys and values, CF's standard retaining callbacks.
        let p = unsafe {
            (self.api.CFDictionaryCreate)(
                std::ptr::null(),
                keys.as_ptr(),
                vals.as_ptr(),
                pairs.len() as isize,
                self.api.kCFTypeDictionaryKeyCallBacks,
                self.api.kCFTypeDictionaryValueCallBacks,
            )
        };
        Cf { rt: self, p }
    }

    fn array(&self, items: &[CfRef]) -> Cf<'_> {
        // SAFETY: n values, CF's standard retaining callbacks.
        let p = unsafe {
            (self.api.CFArrayCreate)(
                std::ptr::null(),
                items.as_ptr(),
                items.len() as isize,
                self.api.kCFTypeArrayCallBacks,
            )
        };
        Cf { rt: self, p }
    }

    /// A CFString/NSString as Rust text.
    fn text(&self, s: CfRef) -> String {
        if s.is_null() {
            return String::new();
        }
        // SAFETY: s is a live CFString; the buffer holds len·4+1 bytes, the
        // worst case of UTF-8 plus the terminator.
        unsafe {
            let len = (self.api.CFStringGetLength)(s).max(0) as usize;
            let mut buf = vec![0u8; len * 4 + 1];
            if (self.api.CFStringGetCString)(
                s,
                buf.as_mut_ptr() as *mut c_char,
                buf.len() as isize,
                UTF8,
            ) == 0
            {
                return String::new();
            }
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            String::from_utf8_lossy(&buf[..end]).into_owned()
        }
    }

    /// An NSError (toll-free bridged to CFError) as one line.
    fn error_text(&self, err: Id) -> String {
        if err.is_null() {
            return "no error object was returned".into();
        }
        // SAFETY: err is a live NSError/CFError; Copy results are released.
        unsafe {
            let desc = Cf {
                rt: self,
                p: (self.api.CFErrorCopyDescription)(err),
            };
            let domain = self.text((self.api.CFErrorGetDomain)(err));
            let code = (self.api.CFErrorGetCode)(err);
            explain(&domain, code, &self.text(desc.p))
        }
    }
}

/// One line for an ANE error, with what the known status codes have been
/// reported to mean.
pub fn explain(domain: &str, code: isize, description: &str) -> String {
    let mut line = format!("{domain} code {code}: {}", description.replace('\n', " "));
    let hint = if description.contains("status=0x1d") {
        Some(
            "status 0x1d has been reported for IOSurfaces that are too small or of mismatched sizes",
        )
    } else if description.contains("ANECCompile() FAILED") {
        Some("the ANE compiler rejected the program; `anetrain mil check --strict` lists the ANE rules it breaks")
    } else if description.contains("0x20004") {
        Some("program load failure; too many programs may be loaded in this process")
    } else {
        None
    };
    if let Some(h) = hint {
        line.push_str(" (");
        line.push_str(h);
        line.push(')');
    }
    line
}

/// Where the compiler expects a blob written in the text as
/// `@model_path/weights/NAME`: the relative path under the model's
/// temporary directory. Refuses anything that would leave it.
pub fn blob_file(key: &str) -> Result<PathBuf> {
    let rel = key.strip_prefix("@model_path/").ok_or_else(|| {
        DeviceError(format!(
            "blob path '{key}' does not start with @model_path/"
        ))
    })?;
    let p = Path::new(rel);
    if rel.is_empty()
        || p.is_absolute()
        || p.components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(DeviceError(format!(
            "blob path '{key}' must name a file inside the model directory"
        )));
    }
    Ok(p.to_path_buf())
}

/// Bytes of the IOSurface backing `elems` fp16 values, as the references
/// size theirs: exactly the tensor's bytes (maderix/ANE
/// training/ane_runtime.h ane_create_surface; Orion
/// docs/ane_api_reference.md "6. Create IOSurface Tensors").
pub fn surface_bytes(elems: usize) -> usize {
    (elems * 2).max(1)
}

/// The Apple Neural Engine.
pub struct AneDevice {
    rt: Rc<Runtime>,
    profile: crate::family::Profile,
    rules: RuleSet,
    budget: usize,
    compiles: usize,
}

/// A compiled and loaded program.
pub struct AneProgram {
    rt: Rc<Runtime>,
    model: Id,
    /// Its share of the model's temporary directory (removed with the last
    /// program that uses it).
    #[allow(dead_code)]
    dir: DirClaim,
    input_elems: usize,
    output_elems: usize,
    /// Elements of each output, in the program's (name) order.
    outputs: Vec<usize>,
    /// Output surfaces the device sizes itself — one per output, all of
    /// one size, at least 48 KiB (Orion docs/ane_constraints.md §2:
    /// several outputs need surfaces of one allocation size; §4: at least
    /// 49152 bytes; §14: the ANE writes each output packed from the
    /// surface's first byte) — for a program with several outputs or a
    /// small one; empty when the caller's buffer is the output surface.
    surfaces: Vec<AneBuffer>,
}

/// An IOSurface holding fp16 values.
pub struct AneBuffer {
    rt: Rc<Runtime>,
    surface: Id,
    elems: usize,
}

/// Environment variable naming a library to load in place of Apple's
/// runtime (the `ane-standin` crate's `libane_standin.so`): a testing aid
/// that runs this device on Linux.
pub const RUNTIME_ENV: &str = "ANETRAIN_ANE_RUNTIME";

impl AneDevice {
    /// Loads the frameworks and checks the private API is what this code
    /// expects. Off macOS, or where anything is missing, the error says so
    /// in one line. With `ANETRAIN_ANE_RUNTIME` set, loads that library
    /// instead ([`AneDevice::with_runtime`]).
    pub fn open() -> Result<AneDevice> {
        if let Some(path) = std::env::var_os(RUNTIME_ENV).filter(|p| !p.is_empty()) {
            return AneDevice::with_runtime(Path::new(&path));
        }
        if !cfg!(target_os = "macos") {
            return Err(DeviceError(format!(
                "ANE not available on this platform ({})",
                std::env::consts::OS
            )));
        }
        AneDevice::load(None)
    }

    /// The device over the library at `path`, which exports every symbol
    /// of Apple's runtime the device uses (a stand-in for testing).
    pub fn with_runtime(path: &Path) -> Result<AneDevice> {
        let path = path.to_str().ok_or_else(|| {
            DeviceError(format!("{RUNTIME_ENV}: '{}' is not UTF-8", path.display()))
        })?;
        AneDevice::load(Some(path))
    }

    fn load(stand_in: Option<&str>) -> Result<AneDevice> {
        let rt =
            Runtime::load(stand_in).map_err(|e| DeviceError(format!("ANE not available: {e}")))?;
        let profile = crate::family::Profile::in_force()?;
        // Contractions that are not multiples of 32 rest on one report
        // (maderix/ANE PR #47): kernel plans prefer multiples, `doctor`
        // probes it, and Apple's compiler, not this check, has the last word.
        let mut rules = RuleSet::for_limits(profile.limits);
        rules.set("matmul-inner-32", false).expect("a known rule");
        Ok(AneDevice {
            rt: Rc::new(rt),
            rules,
            profile,
            budget: DEFAULT_COMPILE_BUDGET,
            compiles: 0,
        })
    }

    /// The chip family and limits the device checks programs against.
    pub fn profile(&self) -> &crate::family::Profile {
        &self.profile
    }

    /// Whether [`AneDevice::open`] succeeds here.
    pub fn available() -> bool {
        AneDevice::open().is_ok()
    }

    /// Sets which ANE constraint rules `compile` checks before handing the
    /// text to Apple's compiler.
    pub fn with_rules(mut self, rules: RuleSet) -> AneDevice {
        self.rules = rules;
        self
    }

    pub fn with_compile_budget(mut self, budget: usize) -> AneDevice {
        self.budget = budget;
        self
    }

    /// `f` on a locked surface's fp16 values.
    fn with_surface<T>(
        &self,
        buf: &AneBuffer,
        read_only: bool,
        f: impl FnOnce(&mut [f16]) -> T,
    ) -> Result<T> {
        let api = &self.rt.api;
        let opts = if read_only { LOCK_READ_ONLY } else { 0 };
        // SAFETY: the surface is live and at least surface_bytes(elems)
        // long (checked at creation); the slice lives only while locked.
        unsafe {
            if (api.IOSurfaceLock)(buf.surface, opts, std::ptr::null_mut()) != 0 {
                return Err(DeviceError("IOSurfaceLock failed".into()));
            }
            let base = (api.IOSurfaceGetBaseAddress)(buf.surface) as *mut f16;
            let out = if base.is_null() {
                None
            } else {
                Some(f(std::slice::from_raw_parts_mut(base, buf.elems)))
            };
            (api.IOSurfaceUnlock)(buf.surface, opts, std::ptr::null_mut());
            out.ok_or_else(|| DeviceError("IOSurface has no base address".into()))
        }
    }
}

impl Drop for AneProgram {
    fn drop(&mut self) {
        let rt = &self.rt;
        rt.pool(|| {
            let mut err: Id = std::ptr::null_mut();
            // SAFETY: model is a retained, loaded _ANEInMemoryModel; the
            // prototype is unloadWithQoS:error:'s.
            unsafe {
                let unload: msg::QosError = std::mem::transmute(rt.api.objc_msgSend);
                unload(self.model, rt.sel(S::Unload), QOS, &mut err);
                (rt.api.objc_release)(self.model);
            }
        });
    }
}

/// The temporary directories of live programs. The framework names a
/// model's directory after a hash of its text and weights
/// (`hexStringIdentifier`), so two live programs with the same text share
/// one: a claim counts its users, and the last one to go removes it.
struct TempDirs;

/// One program's share of a temporary directory.
struct DirClaim(PathBuf);

impl TempDirs {
    fn users() -> &'static std::sync::Mutex<std::collections::BTreeMap<PathBuf, usize>> {
        static USERS: std::sync::OnceLock<
            std::sync::Mutex<std::collections::BTreeMap<PathBuf, usize>>,
        > = std::sync::OnceLock::new();
        USERS.get_or_init(Default::default)
    }

    fn claim(dir: &Path) -> DirClaim {
        let mut users = Self::users().lock().unwrap_or_else(|e| e.into_inner());
        *users.entry(dir.to_path_buf()).or_insert(0) += 1;
        DirClaim(dir.to_path_buf())
    }
}

impl Drop for DirClaim {
    fn drop(&mut self) {
        let mut users = TempDirs::users().lock().unwrap_or_else(|e| e.into_inner());
        let left = users.get_mut(&self.0).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            users.remove(&self.0);
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Drop for AneBuffer {
    fn drop(&mut self) {
        // SAFETY: the surface was created (+1) by IOSurfaceCreate.
        unsafe { (self.rt.api.CFRelease)(self.surface as CfRef) }
    }
}

impl Device for AneDevice {
    type Program = AneProgram;
    type Buffer = AneBuffer;

    fn name(&self) -> &'static str {
        "ane"
    }

    fn compile(&mut self, text: &str, blobs: &[(String, Vec<u8>)]) -> Result<AneProgram> {
        crate::check_budget(self.compiles, self.budget)?;
        let program = check_program(text, &self.rules)?;
        let (input_elems, output_elems) = io_elems(&program);
        let outputs = crate::io_parts(&program).1;
        let files: Vec<(PathBuf, &[u8])> = blobs
            .iter()
            .map(|(k, b)| Ok((blob_file(k)?, b.as_slice())))
            .collect::<Result<_>>()?;
        let rt = self.rt.clone();
        // Every call that reaches the compiler counts, failed or not
        // (Orion docs/ane_constraints.md §5 counts calls to ANECCompile()).
        self.compiles += 1;
        let (model, dir) = rt.pool(|| -> Result<(Id, DirClaim)> {
            let api = &rt.api;
            let mil = rt.data(text.as_bytes());
            let (offset_key, data_key) = (rt.string("offset"), rt.string("data"));
            let zero = rt.number(0);
            let mut keep = Vec::new();
            let mut pairs = Vec::new();
            for (k, b) in blobs {
                let key = rt.string(k);
                let data = rt.data(b);
                let entry = rt.dict(&[(offset_key.p, zero.p), (data_key.p, data.p)]);
                pairs.push((key.p, entry.p));
                keep.push((key, data, entry));
            }
            let weights = rt.dict(&pairs);
            let options = rt.dict(&[]);
            let mut err: Id = std::ptr::null_mut();
            // SAFETY: each objc_msgSend is cast to the selector's prototype
            // (ffi::msg); arguments are live CF/ObjC objects or null where
            // the API takes nil; returned objects are autoreleased and the
            // model is retained before the pool is popped.
            unsafe {
                let send0: msg::Id0 = std::mem::transmute(api.objc_msgSend);
                let send1: msg::Id1 = std::mem::transmute(api.objc_msgSend);
                let send3: msg::Id3 = std::mem::transmute(api.objc_msgSend);
                let qos_opts: msg::QosOptionsError = std::mem::transmute(api.objc_msgSend);
                let desc = send3(
                    rt.class(0),
                    rt.sel(S::Descriptor),
                    mil.p as Id,
                    weights.p as Id,
                    std::ptr::null_mut(),
                );
                if desc.is_null() {
                    return Err(DeviceError(
                        "the ANE framework refused the program description".into(),
                    ));
                }
                let model = send1(rt.class(1), rt.sel(S::Model), desc);
                if model.is_null() {
                    return Err(DeviceError(
                        "the ANE framework refused to create a model".into(),
                    ));
                }
                let hex = rt.text(send0(model, rt.sel(S::HexId)) as CfRef);
                let tmp = rt.text((api.NSTemporaryDirectory)() as CfRef);
                if hex.is_empty() || tmp.is_empty() {
                    return Err(DeviceError(
                        "the ANE model has no temporary directory".into(),
                    ));
                }
                let dir = Path::new(&tmp).join(&hex);
                let write = |rel: &Path, bytes: &[u8]| -> Result<()> {
                    let p = dir.join(rel);
                    if let Some(parent) = p.parent() {
                        std::fs::create_dir_all(parent).map_err(|e| {
                            DeviceError(format!("cannot create '{}': {e}", parent.display()))
                        })?;
                    }
                    std::fs::write(&p, bytes)
                        .map_err(|e| DeviceError(format!("cannot write '{}': {e}", p.display())))
                };
                // `weights/` exists even for a program without weights, as
                // the references create it (maderix/ANE training/ane_runtime.h, ane_compile).
                let weights_dir = dir.join("weights");
                std::fs::create_dir_all(&weights_dir).map_err(|e| {
                    DeviceError(format!("cannot create '{}': {e}", weights_dir.display()))
                })?;
                // Claimed before anything is written: a live program with
                // the same text shares the directory (see `TempDirs`).
                let claim = TempDirs::claim(&dir);
                write(Path::new("model.mil"), text.as_bytes())?;
                for (rel, bytes) in &files {
                    write(rel, bytes)?;
                }
                if qos_opts(model, rt.sel(S::Compile), QOS, options.p as Id, &mut err) == 0 {
                    drop(claim);
                    return Err(DeviceError(format!(
                        "ANE compile failed: {}",
                        rt.error_text(err)
                    )));
                }
                err = std::ptr::null_mut();
                if qos_opts(model, rt.sel(S::Load), QOS, options.p as Id, &mut err) == 0 {
                    drop(claim);
                    return Err(DeviceError(format!(
                        "ANE load failed: {}",
                        rt.error_text(err)
                    )));
                }
                Ok(((api.objc_retain)(model), claim))
            }
        })?;
        let largest = outputs.iter().copied().max().unwrap_or(0);
        let min_elems = crate::rules::MIN_SURFACE_BYTES / 2;
        let mut surfaces = vec![];
        if outputs.len() > 1 || largest < min_elems {
            for _ in &outputs {
                surfaces.push(self.buffer(largest.max(min_elems))?);
            }
        }
        Ok(AneProgram {
            rt,
            model,
            dir,
            input_elems,
            output_elems,
            outputs,
            surfaces,
        })
    }

    fn io_elems(&self, p: &AneProgram) -> (usize, usize) {
        (p.input_elems, p.output_elems)
    }

    fn buffer(&mut self, elems: usize) -> Result<AneBuffer> {
        let rt = &self.rt;
        let bytes = surface_bytes(elems) as i64;
        let k = &rt.api.surface_keys;
        let (n, one, zero) = (rt.number(bytes), rt.number(1), rt.number(0));
        let props = rt.dict(&[
            (k.width, n.p),
            (k.height, one.p),
            (k.bytes_per_element, one.p),
            (k.bytes_per_row, n.p),
            (k.alloc_size, n.p),
            (k.pixel_format, zero.p),
        ]);
        // SAFETY: IOSurfaceCreate takes a property dictionary and returns
        // an owned surface or null.
        let surface = unsafe { (rt.api.IOSurfaceCreate)(props.p) };
        if surface.is_null() {
            return Err(DeviceError(format!(
                "IOSurfaceCreate failed for {bytes} bytes"
            )));
        }
        // SAFETY: surface is live.
        let size = unsafe { (rt.api.IOSurfaceGetAllocSize)(surface) };
        let buf = AneBuffer {
            rt: rt.clone(),
            surface,
            elems,
        };
        if size < elems * 2 {
            return Err(DeviceError(format!(
                "IOSurface of {size} bytes is smaller than the {bytes} requested"
            )));
        }
        self.with_surface(&buf, false, |v| v.fill(f16::ZERO))?;
        Ok(buf)
    }

    fn write(&mut self, buf: &mut AneBuffer, offset: usize, data: &[f32]) -> Result<()> {
        let elems = buf.elems;
        let end = offset
            .checked_add(data.len())
            .filter(|&e| e <= elems)
            .ok_or_else(|| {
                DeviceError(format!(
                    "write of {} values at {offset} overruns a buffer of {elems}",
                    data.len()
                ))
            })?;
        self.with_surface(buf, false, |v| v[offset..end].convert_from_f32_slice(data))
    }

    /// All rows under one lock of the surface.
    fn write_rows(
        &mut self,
        buf: &mut AneBuffer,
        offset: usize,
        stride: usize,
        width: usize,
        data: &[f32],
    ) -> Result<()> {
        let (elems, w) = (buf.elems, width.max(1));
        let rows = data.len().div_ceil(w);
        // One past the last element written: the last row's start plus its length.
        let end = match rows {
            0 => offset,
            n => (n - 1)
                .checked_mul(stride)
                .and_then(|o| o.checked_add(offset))
                .and_then(|o| o.checked_add(data.len() - (n - 1) * w))
                .unwrap_or(usize::MAX),
        };
        if end > elems || (rows > 1 && stride < w) {
            return Err(DeviceError(format!(
                "write of {rows} rows of {w} at {offset} (stride {stride}) overruns a buffer of {elems}"
            )));
        }
        self.with_surface(buf, false, |v| {
            for (r, row) in data.chunks(width.max(1)).enumerate() {
                let o = offset + r * stride;
                v[o..o + row.len()].convert_from_f32_slice(row);
            }
        })
    }

    fn read(&self, buf: &AneBuffer, offset: usize, out: &mut [f32]) -> Result<()> {
        let elems = buf.elems;
        let end = offset
            .checked_add(out.len())
            .filter(|&e| e <= elems)
            .ok_or_else(|| {
                DeviceError(format!(
                    "read of {} values at {offset} overruns a buffer of {elems}",
                    out.len()
                ))
            })?;
        self.with_surface(buf, true, |v| v[offset..end].convert_to_f32_slice(out))
    }

    fn eval(&mut self, p: &AneProgram, input: &AneBuffer, output: &mut AneBuffer) -> Result<()> {
        if input.elems != p.input_elems || output.elems != p.output_elems {
            return Err(DeviceError(format!(
                "buffers of {} and {} elements given to a program taking {} and producing {}",
                input.elems, output.elems, p.input_elems, p.output_elems
            )));
        }
        let rt = &self.rt;
        rt.pool(|| {
            let api = &rt.api;
            let zero = rt.number(0);
            let indices = rt.array(&[zero.p]);
            let numbers: Vec<_> = (0..p.outputs.len().max(1))
                .map(|i| rt.number(i as i64))
                .collect();
            let out_indices = rt.array(&numbers.iter().map(|n| n.p).collect::<Vec<_>>());
            let options = rt.dict(&[]);
            let mut err: Id = std::ptr::null_mut();
            // SAFETY: prototypes from ffi::msg; the surfaces and model are
            // live; wrapped surfaces and the request are autoreleased and
            // used only inside this pool.
            unsafe {
                let send1: msg::Id1 = std::mem::transmute(api.objc_msgSend);
                let send7: msg::Id7 = std::mem::transmute(api.objc_msgSend);
                let evaluate: msg::QosOptionsRequestError = std::mem::transmute(api.objc_msgSend);
                let wi = send1(rt.class(3), rt.sel(S::SurfaceObject), input.surface);
                let targets: Vec<Id> = if p.surfaces.is_empty() {
                    vec![output.surface]
                } else {
                    p.surfaces.iter().map(|s| s.surface).collect()
                };
                let wo: Vec<Id> = targets
                    .iter()
                    .map(|&s| send1(rt.class(3), rt.sel(S::SurfaceObject), s))
                    .collect();
                if wi.is_null() || wo.iter().any(|w| w.is_null()) {
                    return Err(DeviceError("cannot wrap an IOSurface for the ANE".into()));
                }
                let ins = rt.array(&[wi as CfRef]);
                let outs = rt.array(&wo.iter().map(|&w| w as CfRef).collect::<Vec<_>>());
                let request = send7(
                    rt.class(2),
                    rt.sel(S::Request),
                    ins.p as Id,
                    indices.p as Id,
                    outs.p as Id,
                    out_indices.p as Id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    zero.p as Id,
                );
                if request.is_null() {
                    return Err(DeviceError("the ANE framework refused the request".into()));
                }
                if evaluate(
                    p.model,
                    rt.sel(S::Evaluate),
                    QOS,
                    options.p as Id,
                    request,
                    &mut err,
                ) == 0
                {
                    return Err(DeviceError(format!(
                        "ANE evaluation failed: {}",
                        rt.error_text(err)
                    )));
                }
                Ok(())
            }
        })?;
        // Device-sized output surfaces: each output, packed at its
        // surface's start, goes after the previous one in the caller's buffer.
        let mut at = 0;
        for (s, &n) in p.surfaces.iter().zip(&p.outputs) {
            let values = self.with_surface(s, true, |v| v[..n].to_vec())?;
            self.with_surface(output, false, |v| v[at..at + n].copy_from_slice(&values))?;
            at += n;
        }
        Ok(())
    }

    fn limits(&self) -> crate::family::Limits {
        self.profile.limits
    }

    fn compiles(&self) -> usize {
        self.compiles
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two live programs with the same text share one temporary directory:
    /// dropping one leaves it for the other; the last removes it.
    #[test]
    fn a_shared_temporary_directory_outlives_all_but_its_last_program() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("0123abcd");
        std::fs::create_dir_all(dir.join("weights")).unwrap();
        let (a, b) = (TempDirs::claim(&dir), TempDirs::claim(&dir));
        drop(a);
        assert!(dir.join("weights").is_dir());
        drop(b);
        assert!(!dir.exists());
    }

    #[test]
    fn opening_off_macos_fails_with_one_line() {
        if cfg!(target_os = "macos") {
            return;
        }
        let e = AneDevice::open().err().expect("no ANE here");
        assert!(e.0.contains("ANE not available on this platform"), "{e}");
        assert!(!e.0.contains('\n'));
        assert!(!AneDevice::available());
    }

    #[test]
    fn missing_libraries_are_named() {
        if cfg!(target_os = "macos") {
            return;
        }
        let e = Runtime::load(None)
            .err()
            .expect("no Objective-C runtime here");
        assert!(e.contains(ffi::OBJC), "{e}");
    }

    #[test]
    fn blob_keys_map_inside_the_model_directory() {
        assert_eq!(
            blob_file("@model_path/weights/mask.bin").unwrap(),
            PathBuf::from("weights/mask.bin")
        );
        for bad in [
            "weights/mask.bin",
            "@model_path/",
            "@model_path/../x.bin",
            "@model_path//etc/passwd",
        ] {
            assert!(blob_file(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn surfaces_hold_exactly_the_tensor() {
        assert_eq!(surface_bytes(0), 1);
        assert_eq!(surface_bytes(65), 130);
        assert_eq!(surface_bytes(1024 * 256), 1024 * 512);
    }

    #[test]
    fn error_lines_carry_known_hints() {
        let e = explain(
            "com.apple.appleneuralengine",
            8,
            "ANEProgramProcessRequestDirect() Failed with status=0x1d : Program Inference error",
        );
        assert!(e.starts_with("com.apple.appleneuralengine code 8: "), "{e}");
        assert!(e.contains("too small"), "{e}");
        let e = explain(
            "com.apple.appleneuralengine.compiler",
            1,
            "ANECCompile() FAILED\nCompilationFailure",
        );
        assert!(!e.contains('\n') && e.contains("mil check"), "{e}");
        assert!(!explain("d", 3, "other").contains('('));
    }
}
