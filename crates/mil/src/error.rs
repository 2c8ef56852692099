//! The crate's error type: a message, with the source position when the
//! problem is in program text.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MilError {
    /// 1-based line and column; 0 when the error has no position.
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl MilError {
    pub fn new(msg: impl Into<String>) -> MilError {
        MilError {
            line: 0,
            col: 0,
            msg: msg.into(),
        }
    }

    pub fn at(line: usize, col: usize, msg: impl Into<String>) -> MilError {
        MilError {
            line,
            col,
            msg: msg.into(),
        }
    }
}

impl fmt::Display for MilError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "line {}:{}: {}", self.line, self.col, self.msg)
        } else {
            f.write_str(&self.msg)
        }
    }
}

impl std::error::Error for MilError {}

pub type Result<T> = std::result::Result<T, MilError>;
