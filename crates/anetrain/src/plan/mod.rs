//! What a run will need before it starts: memory ([`memory`]) and the
//! arithmetic of a step, on the device and on the host ([`work`]).

pub mod calibration;
pub mod memory;
pub mod timeline;
pub mod work;
