//! Parser for the MIL text dialect the printer writes (and the seed's
//! hand-formatted programs). Every error carries line:column; no input makes
//! it panic (it is fuzzed).
//!
//! ```text
//! program   := "program" "(" VERSION ")" [ "[" "buildInfo" "=" dict "]" ] "{" function* "}"
//! dict      := "dict" "<" "string" "," "string" ">" "(" "{" ( "{" STR "," STR "}" ),* "}" ")"
//! function  := "func" IDENT "<" IDENT ">" "(" ( type IDENT ),* ")" "{" stmt* "}" "->" "(" IDENT,* ")" ";"
//! stmt      := type IDENT "=" IDENT "(" ( IDENT "=" arg ),* ")" [ "[" attr,* "]" ] ";"
//! arg       := IDENT | "(" IDENT,* ")"
//! attr      := "name" "=" "string" "(" STR ")" | "val" "=" const
//! const     := type "(" ( literal | "[" literal,* "]" | BLOBFILE ) ")" | "string" "(" STR ")"
//! blobfile  := "BLOBFILE" "(" "path" "=" "string" "(" STR ")" "," "offset" "=" "uint64" "(" INT ")" ")"
//! type      := DTYPE | "tensor" "<" DTYPE "," "[" INT,* "]" ">"
//! ```

use crate::error::{MilError, Result};
use crate::ir::{Arg, ConstData, ConstVal, Function, Operation, Program, Span, Var};
use crate::types::{DType, Ty};

/// Largest element count a declared type may have (2^32).
pub const MAX_ELEMS: usize = 1 << 32;
const MAX_RANK: usize = 16;
const MAX_NESTING: usize = 16;

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Number(String),
    Str(String),
    Punct(char),
    Arrow,
    Eof,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("'{s}'"),
            Tok::Number(s) => format!("number {s}"),
            Tok::Str(s) => format!("string \"{s}\""),
            Tok::Punct(c) => format!("'{c}'"),
            Tok::Arrow => "'->'".into(),
            Tok::Eof => "end of input".into(),
        }
    }
}

struct Lexed {
    tok: Tok,
    line: usize,
    col: usize,
}

fn lex(text: &str) -> Result<Vec<Lexed>> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line, mut col) = (0usize, 1usize, 1usize);
    while i < chars.len() {
        let c = chars[i];
        let (l0, c0) = (line, col);
        let advance = |n: usize, i: &mut usize, col: &mut usize| {
            *i += n;
            *col += n;
        };
        if c == '\n' {
            i += 1;
            line += 1;
            col = 1;
            continue;
        }
        if c.is_whitespace() {
            advance(1, &mut i, &mut col);
            continue;
        }
        // `//` comments to end of line
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        let tok = if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            col += i - start;
            Tok::Ident(chars[start..i].iter().collect())
        } else if c.is_ascii_digit()
            || ((c == '-' || c == '+' || c == '.')
                && chars
                    .get(i + 1)
                    .is_some_and(|n| n.is_ascii_digit() || *n == '.' || *n == 'i' || *n == 'n'))
        {
            let start = i;
            i += 1;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || ((chars[i] == '-' || chars[i] == '+') && matches!(chars[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            col += i - start;
            Tok::Number(chars[start..i].iter().collect())
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            col += 1;
            loop {
                match chars.get(i) {
                    None | Some('\n') => {
                        return Err(MilError::at(l0, c0, "unterminated string literal"))
                    }
                    Some('"') => {
                        i += 1;
                        col += 1;
                        break;
                    }
                    Some('\\') => {
                        let e = match chars.get(i + 1) {
                            Some('n') => '\n',
                            Some('t') => '\t',
                            Some('"') => '"',
                            Some('\\') => '\\',
                            _ => {
                                return Err(MilError::at(
                                    line,
                                    col,
                                    "unknown escape in string literal",
                                ))
                            }
                        };
                        s.push(e);
                        i += 2;
                        col += 2;
                    }
                    Some(&ch) => {
                        s.push(ch);
                        i += 1;
                        col += 1;
                    }
                }
            }
            Tok::Str(s)
        } else if c == '-' && chars.get(i + 1) == Some(&'>') {
            advance(2, &mut i, &mut col);
            Tok::Arrow
        } else if "()[]{}<>,=;".contains(c) {
            advance(1, &mut i, &mut col);
            Tok::Punct(c)
        } else {
            return Err(MilError::at(
                l0,
                c0,
                format!("unexpected character '{}'", c.escape_debug()),
            ));
        };
        out.push(Lexed {
            tok,
            line: l0,
            col: c0,
        });
    }
    out.push(Lexed {
        tok: Tok::Eof,
        line,
        col,
    });
    Ok(out)
}

struct Parser {
    toks: Vec<Lexed>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> &Tok {
        &self.toks[self.pos.min(self.toks.len() - 1)].tok
    }

    fn here(&self) -> (usize, usize) {
        let t = &self.toks[self.pos.min(self.toks.len() - 1)];
        (t.line, t.col)
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T> {
        let (l, c) = self.here();
        Err(MilError::at(l, c, msg))
    }

    fn next(&mut self) -> Tok {
        let t = self.peek().clone();
        if self.pos < self.toks.len() - 1 {
            self.pos += 1;
        }
        t
    }

    fn punct(&mut self, c: char) -> Result<()> {
        if *self.peek() == Tok::Punct(c) {
            self.next();
            Ok(())
        } else {
            self.err(format!("expected '{c}', found {}", self.peek().describe()))
        }
    }

    fn eat(&mut self, c: char) -> bool {
        if *self.peek() == Tok::Punct(c) {
            self.next();
            true
        } else {
            false
        }
    }

    fn ident(&mut self, what: &str) -> Result<String> {
        match self.peek().clone() {
            Tok::Ident(s) => {
                self.next();
                Ok(s)
            }
            t => self.err(format!("expected {what}, found {}", t.describe())),
        }
    }

    fn keyword(&mut self, kw: &str) -> Result<()> {
        match self.peek() {
            Tok::Ident(s) if s == kw => {
                self.next();
                Ok(())
            }
            t => self.err(format!("expected '{kw}', found {}", t.describe())),
        }
    }

    fn string(&mut self) -> Result<String> {
        match self.peek().clone() {
            Tok::Str(s) => {
                self.next();
                Ok(s)
            }
            t => self.err(format!("expected a string literal, found {}", t.describe())),
        }
    }

    /// `string("...")`
    fn string_call(&mut self) -> Result<String> {
        self.keyword("string")?;
        self.punct('(')?;
        let s = self.string()?;
        self.punct(')')?;
        Ok(s)
    }

    fn unsigned(&mut self, what: &str) -> Result<u64> {
        match self.peek().clone() {
            Tok::Number(s) => match s.parse::<u64>() {
                Ok(v) => {
                    self.next();
                    Ok(v)
                }
                Err(_) => self.err(format!("{what} must be a non-negative integer, found {s}")),
            },
            t => self.err(format!("expected {what}, found {}", t.describe())),
        }
    }

    fn program(&mut self) -> Result<Program> {
        self.keyword("program")?;
        self.punct('(')?;
        let version = match self.next() {
            Tok::Number(v) | Tok::Ident(v) => v,
            t => {
                self.pos -= 1;
                return self.err(format!(
                    "expected a program version, found {}",
                    t.describe()
                ));
            }
        };
        self.punct(')')?;
        let mut build_info = Vec::new();
        if self.eat('[') {
            self.keyword("buildInfo")?;
            self.punct('=')?;
            self.keyword("dict")?;
            self.punct('<')?;
            self.keyword("string")?;
            self.punct(',')?;
            self.keyword("string")?;
            self.punct('>')?;
            self.punct('(')?;
            self.punct('{')?;
            if !self.eat('}') {
                loop {
                    self.punct('{')?;
                    let k = self.string()?;
                    self.punct(',')?;
                    let v = self.string()?;
                    self.punct('}')?;
                    build_info.push((k, v));
                    if self.eat('}') {
                        break;
                    }
                    self.punct(',')?;
                }
            }
            self.punct(')')?;
            self.punct(']')?;
        }
        self.punct('{')?;
        let mut functions = Vec::new();
        while !self.eat('}') {
            functions.push(self.function()?);
        }
        if *self.peek() != Tok::Eof {
            return self.err(format!(
                "unexpected {} after the end of the program",
                self.peek().describe()
            ));
        }
        Ok(Program {
            version,
            build_info,
            functions,
        })
    }

    fn function(&mut self) -> Result<Function> {
        self.keyword("func")?;
        let name = self.ident("a function name")?;
        self.punct('<')?;
        let opset = self.ident("an opset name such as ios18")?;
        self.punct('>')?;
        self.punct('(')?;
        let mut inputs = Vec::new();
        if !self.eat(')') {
            loop {
                let ty = self.ty()?;
                let n = self.ident("an input name")?;
                inputs.push(Var { name: n, ty });
                if self.eat(')') {
                    break;
                }
                self.punct(',')?;
            }
        }
        self.punct('{')?;
        let mut ops = Vec::new();
        while !self.eat('}') {
            ops.push(self.statement()?);
        }
        if self.next() != Tok::Arrow {
            self.pos -= 1;
            return self.err(format!(
                "expected '->' after the function body, found {}",
                self.peek().describe()
            ));
        }
        self.punct('(')?;
        let mut outputs = Vec::new();
        if !self.eat(')') {
            loop {
                outputs.push(self.ident("an output name")?);
                if self.eat(')') {
                    break;
                }
                self.punct(',')?;
            }
        }
        self.punct(';')?;
        Ok(Function {
            name,
            opset,
            inputs,
            ops,
            outputs,
        })
    }

    fn ty(&mut self) -> Result<Ty> {
        let (l, c) = self.here();
        let head = self.ident("a type")?;
        if head != "tensor" {
            return match DType::from_name(&head) {
                Some(d) => Ok(Ty::scalar(d)),
                None => Err(MilError::at(
                    l,
                    c,
                    format!("unknown type '{head}' (expected fp16, fp32, int32, bool, string or tensor<...>)"),
                )),
            };
        }
        self.punct('<')?;
        let (l, c) = self.here();
        let dn = self.ident("a dtype")?;
        let dtype = DType::from_name(&dn)
            .filter(|d| *d != DType::Str)
            .ok_or_else(|| {
                MilError::at(
                    l,
                    c,
                    format!("unknown tensor dtype '{dn}' (expected fp16, fp32, int32 or bool)"),
                )
            })?;
        self.punct(',')?;
        self.punct('[')?;
        let mut dims = Vec::new();
        if !self.eat(']') {
            loop {
                if dims.len() == MAX_RANK {
                    return self.err(format!("tensor rank exceeds {MAX_RANK}"));
                }
                dims.push(self.unsigned("a dimension")? as usize);
                if self.eat(']') {
                    break;
                }
                self.punct(',')?;
            }
        }
        self.punct('>')?;
        let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elems.is_none_or(|e| e > MAX_ELEMS) {
            return Err(MilError::at(
                l,
                c,
                format!("tensor of shape {dims:?} is too large"),
            ));
        }
        Ok(Ty::tensor(dtype, dims))
    }

    fn statement(&mut self) -> Result<Operation> {
        let (line, col) = self.here();
        let ty = self.ty()?;
        let out = self.ident("a variable name")?;
        self.punct('=')?;
        let op = self.ident("an op name")?;
        self.punct('(')?;
        let mut args = Vec::new();
        if !self.eat(')') {
            loop {
                let k = self.ident("an argument name")?;
                self.punct('=')?;
                let a = if self.eat('(') {
                    let mut vs = Vec::new();
                    if !self.eat(')') {
                        loop {
                            vs.push(self.ident("a variable name")?);
                            if self.eat(')') {
                                break;
                            }
                            self.punct(',')?;
                        }
                    }
                    Arg::Tuple(vs)
                } else {
                    Arg::Var(self.ident("a variable name or a tuple")?)
                };
                args.push((k, a));
                if self.eat(')') {
                    break;
                }
                self.punct(',')?;
            }
        }
        let mut name = None;
        let mut val = None;
        if self.eat('[') {
            loop {
                let (l, c) = self.here();
                let key = self.ident("an attribute name")?;
                self.punct('=')?;
                match key.as_str() {
                    "name" if name.is_none() => name = Some(self.string_call()?),
                    "val" if val.is_none() => val = Some(self.const_val()?),
                    "name" | "val" => {
                        return Err(MilError::at(
                            l,
                            c,
                            format!("attribute '{key}' is given twice"),
                        ))
                    }
                    _ => {
                        return Err(MilError::at(
                            l,
                            c,
                            format!("unknown attribute '{key}' (expected name or val)"),
                        ))
                    }
                }
                if self.eat(']') {
                    break;
                }
                self.punct(',')?;
            }
        }
        self.punct(';')?;
        Ok(Operation {
            op,
            name: name.unwrap_or_else(|| out.clone()),
            output: Var { name: out, ty },
            args,
            val,
            span: Span { line, col },
        })
    }

    fn const_val(&mut self) -> Result<ConstVal> {
        let (l, c) = self.here();
        let ty = self.ty()?;
        self.punct('(')?;
        let data = if ty.dtype == DType::Str {
            ConstData::Str(self.string()?)
        } else if matches!(self.peek(), Tok::Ident(s) if s == "BLOBFILE") {
            self.next();
            self.punct('(')?;
            self.keyword("path")?;
            self.punct('=')?;
            let path = self.string_call()?;
            self.punct(',')?;
            self.keyword("offset")?;
            self.punct('=')?;
            self.keyword("uint64")?;
            self.punct('(')?;
            let offset = self.unsigned("a blob offset")?;
            self.punct(')')?;
            self.punct(')')?;
            if ty.shape.is_none() || !ty.dtype.is_float() {
                return Err(MilError::at(
                    l,
                    c,
                    format!("BLOBFILE constants must be fp16 or fp32 tensors, not {ty}"),
                ));
            }
            ConstData::Blob { path, offset }
        } else {
            let mut raw = Vec::new();
            self.literals(&mut raw, 0)?;
            self.convert(&ty, raw, l, c)?
        };
        self.punct(')')?;
        Ok(ConstVal { ty, data })
    }

    /// Flattens a literal or a (nested) bracketed list of literals.
    fn literals(&mut self, out: &mut Vec<(Tok, usize, usize)>, depth: usize) -> Result<()> {
        if depth > MAX_NESTING {
            return self.err("literal nesting is too deep");
        }
        if self.eat('[') {
            if self.eat(']') {
                return Ok(());
            }
            loop {
                self.literals(out, depth + 1)?;
                if self.eat(']') {
                    return Ok(());
                }
                self.punct(',')?;
            }
        }
        let (l, c) = self.here();
        match self.next() {
            t @ (Tok::Number(_) | Tok::Ident(_)) => {
                out.push((t, l, c));
                Ok(())
            }
            t => Err(MilError::at(
                l,
                c,
                format!("expected a literal value, found {}", t.describe()),
            )),
        }
    }

    fn convert(
        &self,
        ty: &Ty,
        raw: Vec<(Tok, usize, usize)>,
        l: usize,
        c: usize,
    ) -> Result<ConstData> {
        if raw.len() != ty.elems() {
            return Err(MilError::at(
                l,
                c,
                format!("{ty} needs {} values, found {}", ty.elems(), raw.len()),
            ));
        }
        let text = |t: &Tok| match t {
            Tok::Number(s) | Tok::Ident(s) => s.clone(),
            _ => String::new(),
        };
        match ty.dtype {
            DType::Fp16 | DType::Fp32 => raw
                .iter()
                .map(|(t, l, c)| {
                    parse_float(&text(t)).ok_or_else(|| {
                        MilError::at(
                            *l,
                            *c,
                            format!("'{}' is not a {} number", text(t), ty.dtype),
                        )
                    })
                })
                .collect::<Result<_>>()
                .map(ConstData::Floats),
            DType::Int32 => {
                raw.iter()
                    .map(|(t, l, c)| {
                        text(t).parse::<i32>().map(|v| v as i64).map_err(|_| {
                            MilError::at(*l, *c, format!("'{}' is not an int32", text(t)))
                        })
                    })
                    .collect::<Result<_>>()
                    .map(ConstData::Ints)
            }
            DType::Bool => raw
                .iter()
                .map(|(t, l, c)| match text(t).as_str() {
                    "true" => Ok(true),
                    "false" => Ok(false),
                    s => Err(MilError::at(
                        *l,
                        *c,
                        format!("'{s}' is not a bool (true or false)"),
                    )),
                })
                .collect::<Result<_>>()
                .map(ConstData::Bools),
            DType::Str => Err(MilError::at(l, c, "string constants take string(\"...\")")),
        }
    }
}

/// Parses a float literal: decimal/exponent forms, `inf`, `-inf`, `nan`.
fn parse_float(s: &str) -> Option<f64> {
    let lower = s.to_ascii_lowercase();
    match lower.trim_start_matches(['+', '-']) {
        "inf" | "infinity" => Some(if lower.starts_with('-') {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        }),
        "nan" => Some(f64::NAN),
        _ => {
            // Rust accepts "inf"/"nan" spellings too; those are handled above,
            // so insist on a digit here.
            if !s.chars().any(|c| c.is_ascii_digit()) {
                return None;
            }
            s.parse::<f64>().ok()
        }
    }
}

/// Parses MIL text into a program (syntax only; see [`crate::validate`]).
pub fn parse(text: &str) -> Result<Program> {
    let toks = lex(text)?;
    Parser { toks, pos: 0 }.program()
}

/// Parses and type-checks MIL text.
pub fn parse_and_validate(text: &str) -> Result<Program> {
    let p = parse(text)?;
    crate::validate::validate(&p)?;
    Ok(p)
}
