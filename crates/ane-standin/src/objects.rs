//! The object table: every Objective-C/CoreFoundation object the stand-in
//! hands out, with its reference count, and the autorelease pools.
//!
//! Handles are opaque numbers, never reused, so a message to a released
//! object is caught (the real runtime would crash or worse) instead of
//! reaching a new object that happens to share the address.

use std::collections::BTreeMap;

use mil::Executable;

/// An object handle as the caller sees it (`id`, `CFTypeRef`, `IOSurfaceRef`).
pub type Handle = usize;

/// First handle given to an object; classes, selectors and the constant
/// strings live below it and are never released.
pub const FIRST_OBJECT: Handle = 0x7a00_0000_0000;

/// An IOSurface: a flat byte buffer (width = bytes, height 1, one byte per
/// element, as the references create it) and its lock state.
pub struct Surface {
    /// Heap memory the caller writes through `IOSurfaceGetBaseAddress`,
    /// owned here (from `Box::into_raw`) and freed when the surface is.
    pub base: *mut u8,
    pub len: usize,
    /// Options of each lock currently held (locks nest).
    pub locks: Vec<u32>,
    /// Every lock taken, over the surface's life.
    pub locks_taken: u64,
    /// Checksum when the outermost read-only lock was taken: a change by
    /// unlock time means the caller wrote under a read-only lock.
    pub read_only_sum: Option<u64>,
}

impl Surface {
    pub fn new(len: usize) -> Surface {
        let base = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
        Surface {
            base,
            len,
            locks: vec![],
            locks_taken: 0,
            read_only_sum: None,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: base/len come from a boxed slice this surface owns; the
        // caller is single-threaded and not inside an IOSurface call.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    pub fn checksum(&self) -> u64 {
        // FNV-1a over the bytes; only compared with itself.
        self.bytes().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

impl Drop for Surface {
    fn drop(&mut self) {
        // SAFETY: base/len are the boxed slice created in `new`, freed once.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.base, self.len,
            )))
        };
    }
}

/// What a handle refers to.
pub enum Obj {
    Str(String),
    Data(Vec<u8>),
    Number(i64),
    /// Keys and values, each retained by the dictionary.
    Dict(Vec<(Handle, Handle)>),
    /// Items, each retained by the array.
    Array(Vec<Handle>),
    /// An NSError (toll-free bridged to CFError); the domain string is
    /// retained by the error.
    Error {
        domain: Handle,
        code: isize,
        description: String,
    },
    Surface(Surface),
    /// `_ANEIOSurfaceObject`, retaining its surface.
    SurfaceObject(Handle),
    Descriptor(Descriptor),
    Model(Box<Model>),
    Request(Request),
}

impl Obj {
    pub fn kind(&self) -> &'static str {
        match self {
            Obj::Str(_) => "CFString",
            Obj::Data(_) => "CFData",
            Obj::Number(_) => "CFNumber",
            Obj::Dict(_) => "CFDictionary",
            Obj::Array(_) => "CFArray",
            Obj::Error { .. } => "NSError",
            Obj::Surface(_) => "IOSurface",
            Obj::SurfaceObject(_) => "_ANEIOSurfaceObject",
            Obj::Descriptor(_) => "_ANEInMemoryModelDescriptor",
            Obj::Model(_) => "_ANEInMemoryModel",
            Obj::Request(_) => "_ANERequest",
        }
    }

    /// The objects this one holds a reference to.
    fn children(&self) -> Vec<Handle> {
        match self {
            Obj::Dict(pairs) => pairs.iter().flat_map(|&(k, v)| [k, v]).collect(),
            Obj::Array(items) => items.clone(),
            Obj::Error { domain, .. } => vec![*domain],
            Obj::SurfaceObject(s) => vec![*s],
            Obj::Descriptor(d) => d.retained(),
            Obj::Model(m) => vec![m.descriptor],
            Obj::Request(r) => r.retained(),
            _ => vec![],
        }
    }
}

struct Entry {
    obj: Obj,
    refs: usize,
}

/// Every live object, the pools, and what went wrong.
pub struct Table {
    objects: BTreeMap<Handle, Entry>,
    next: Handle,
    pools: Vec<Vec<Handle>>,
    /// Strings that live for the process (the `kIOSurface*` keys, and
    /// strings the runtime owns such as a model's identifier).
    pub constants: BTreeMap<Handle, String>,
    /// Misuses a real runtime would crash on, or that break the call
    /// pattern of the working implementations. Any entry fails the tests.
    pub violations: Vec<String>,
}

impl Default for Table {
    fn default() -> Self {
        Table::new()
    }
}

impl Table {
    pub const fn new() -> Table {
        Table {
            objects: BTreeMap::new(),
            next: FIRST_OBJECT,
            pools: Vec::new(),
            constants: BTreeMap::new(),
            violations: Vec::new(),
        }
    }

    pub fn violation(&mut self, what: String) {
        if self.violations.len() < 1000 {
            self.violations.push(what);
        }
    }

    /// A new object with one reference (the caller owns it: a `Create` or
    /// `Copy` function's result).
    pub fn create(&mut self, obj: Obj) -> Handle {
        for c in obj.children() {
            self.retain(c);
        }
        let h = self.next;
        self.next += 16;
        self.objects.insert(h, Entry { obj, refs: 1 });
        h
    }

    /// A new object owned by the innermost autorelease pool (a `+0` result,
    /// as factory methods and `NSTemporaryDirectory` return).
    pub fn autoreleased(&mut self, obj: Obj) -> Handle {
        let h = self.create(obj);
        self.autorelease(h);
        h
    }

    pub fn autorelease(&mut self, h: Handle) {
        match self.pools.last_mut() {
            Some(pool) => pool.push(h),
            // Objective-C logs "autoreleased with no pool in place - just
            // leaking" and the object is never released.
            None => self.violation(format!(
                "{} {h:#x} autoreleased with no autorelease pool in place (it leaks)",
                self.kind(h)
            )),
        }
    }

    pub fn get(&self, h: Handle) -> Option<&Obj> {
        self.objects.get(&h).map(|e| &e.obj)
    }

    pub fn get_mut(&mut self, h: Handle) -> Option<&mut Obj> {
        self.objects.get_mut(&h).map(|e| &mut e.obj)
    }

    pub fn kind(&self, h: Handle) -> &'static str {
        self.get(h).map_or("object", Obj::kind)
    }

    pub fn is_constant(&self, h: Handle) -> bool {
        h != 0 && h < FIRST_OBJECT
    }

    pub fn retain(&mut self, h: Handle) {
        if self.is_constant(h) || h == 0 {
            return;
        }
        match self.objects.get_mut(&h) {
            Some(e) => e.refs += 1,
            None => self.violation(format!("retain of {h:#x}, which is not a live object")),
        }
    }

    /// Drops one reference; the last one frees the object and releases
    /// what it holds.
    pub fn release(&mut self, h: Handle, by: &str) {
        if self.is_constant(h) {
            return;
        }
        let Some(e) = self.objects.get_mut(&h) else {
            let what = if h == 0 {
                format!("{by}(NULL)")
            } else {
                format!("{by} of {h:#x}, which is not a live object (over-release)")
            };
            self.violation(what);
            return;
        };
        e.refs -= 1;
        if e.refs > 0 {
            return;
        }
        let e = self.objects.remove(&h).expect("present above");
        if let Obj::Surface(s) = &e.obj {
            surface_freed(s.locks_taken);
        }
        match &e.obj {
            Obj::Surface(s) if !s.locks.is_empty() => {
                self.violation(format!("IOSurface {h:#x} freed while locked"))
            }
            Obj::Model(m) if m.loaded => self.violation(format!(
                "_ANEInMemoryModel {h:#x} freed while loaded (the references call \
                 unloadWithQoS:error: first: maderix/ANE training/ane_runtime.h, ane_free)"
            )),
            _ => {}
        }
        for c in e.obj.children() {
            self.release(c, "release");
        }
    }

    pub fn push_pool(&mut self) -> usize {
        self.pools.push(vec![]);
        self.pools.len()
    }

    pub fn pop_pool(&mut self, token: usize) {
        if token == 0 || token > self.pools.len() {
            self.violation(format!(
                "objc_autoreleasePoolPop({token}) with {} pool(s) pushed",
                self.pools.len()
            ));
            return;
        }
        while self.pools.len() >= token {
            let pool = self.pools.pop().expect("non-empty");
            for h in pool {
                self.release(h, "autorelease pool release");
            }
        }
    }

    /// Live objects by kind.
    pub fn live(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for e in self.objects.values() {
            *m.entry(e.obj.kind()).or_insert(0) += 1;
        }
        m
    }

    /// Every live model.
    pub fn models(&self) -> impl Iterator<Item = &Model> {
        self.objects.values().filter_map(|e| match &e.obj {
            Obj::Model(m) => Some(&**m),
            _ => None,
        })
    }

    pub fn surfaces(&self) -> impl Iterator<Item = (Handle, &Surface)> {
        self.objects.iter().filter_map(|(&h, e)| match &e.obj {
            Obj::Surface(s) => Some((h, s)),
            _ => None,
        })
    }

    pub fn pools(&self) -> usize {
        self.pools.len()
    }

    /// The text of a string handle (object or constant).
    pub fn text(&self, h: Handle) -> Option<String> {
        if let Some(s) = self.constants.get(&h) {
            return Some(s.clone());
        }
        match self.get(h)? {
            Obj::Str(s) => Some(s.clone()),
            _ => None,
        }
    }
}

/// `_ANEInMemoryModelDescriptor modelWithMILText:weights:optionsPlist:`.
pub struct Descriptor {
    /// The MIL text, an NSData (Orion §9: `milText` must be NSData).
    pub mil: Handle,
    /// `{ "@model_path/weights/NAME": { "offset": @0, "data": NSData } }`
    /// (maderix/ANE training/ane_runtime.h, ane_compile); never nil here.
    pub weights: Handle,
}

impl Descriptor {
    pub fn retained(&self) -> Vec<Handle> {
        [self.mil, self.weights]
            .into_iter()
            .filter(|&h| h != 0)
            .collect()
    }
}

/// `_ANEInMemoryModel`.
pub struct Model {
    pub descriptor: Handle,
    /// `hexStringIdentifier`: a hash of the descriptor's text and weights,
    /// so two models of the same program share a temporary directory.
    pub hex: String,
    pub exe: Option<Executable>,
    pub loaded: bool,
}

/// `_ANERequest requestWithInputs:inputIndices:outputs:outputIndices:...`.
pub struct Request {
    pub inputs: Handle,
    pub input_indices: Handle,
    pub outputs: Handle,
    pub output_indices: Handle,
    pub procedure: Handle,
}

impl Request {
    pub fn retained(&self) -> Vec<Handle> {
        [
            self.inputs,
            self.input_indices,
            self.outputs,
            self.output_indices,
            self.procedure,
        ]
        .into_iter()
        .filter(|&h| h != 0)
        .collect()
    }
}

static LOCKS_FREED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts a freed surface's locks (called by the table).
fn surface_freed(locks: u64) {
    LOCKS_FREED.fetch_add(locks, std::sync::atomic::Ordering::Relaxed);
}

/// The locks freed surfaces took over their lives (for the exit report).
pub fn locks_of_freed_surfaces() -> u64 {
    LOCKS_FREED.load(std::sync::atomic::Ordering::Relaxed)
}
