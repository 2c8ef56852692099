#!/usr/bin/env python3
"""A straightforward numpy evaluation of a MIL program in the seed's dialect
(fp32, no rounding) — the baseline `anetrain mil run` is timed against, and
an independent check of its fp32 mode.

Usage: python scripts/numpy_mil.py PROGRAM.mil WEIGHTS_DIR X.npy Y.npy
"""
import re
import sys

import numpy as np

STMT = re.compile(r"^\s*(tensor<[^>]*>|\w+)\s+(\w+)\s*=\s*(\w+)\((.*?)\)\[(.*)\];\s*$")


def literal(text):
    m = re.match(r"(tensor<(\w+), \[([\d,\s]*)\]>|\w+)\((.*)\)$", text.strip())
    dtype = m.group(2) or m.group(1)
    body = m.group(4)
    if body.startswith("BLOBFILE"):
        path = re.search(r'@model_path/weights/([^"]+)"', body).group(1)
        off = int(re.search(r"offset=uint64\((\d+)\)", body).group(1))
        return ("blob", path, off, [int(d) for d in m.group(3).split(",")])
    vals = [v for v in body.strip("[]").split(",") if v.strip()]
    if dtype == "bool":
        arr = np.array([v.strip() == "true" for v in vals])
    elif dtype == "int32":
        arr = np.array([int(v) for v in vals], dtype=np.int64)
    else:
        arr = np.array([float(v) for v in vals], dtype=np.float16).astype(np.float32)
    return arr if m.group(3) is not None else arr.reshape(())


def main():
    prog, wdir, xin, yout = sys.argv[1:5]
    env = {}
    lines = open(prog).read().splitlines()
    inp = re.search(r"func main<\w+>\(tensor<\w+, \[[^\]]*\]> (\w+)\)", "\n".join(lines)).group(1)
    env[inp] = np.load(xin).astype(np.float32)
    out = None
    for line in lines:
        r = re.match(r"\s*\} -> \((\w+)\);", line)
        if r:
            out = r.group(1)
            continue
        m = STMT.match(line)
        if not m:
            continue
        _, name, op, args, attrs = m.groups()
        if op == "const":
            lit = literal(re.search(r"val=(.*)$", attrs).group(1))
            if isinstance(lit, tuple):
                _, path, off, shape = lit
                raw = open(f"{wdir}/{path}", "rb").read()
                size = int.from_bytes(raw[off + 8:off + 12], "little")
                data = int.from_bytes(raw[off + 16:off + 20], "little")
                lit = np.frombuffer(raw[data:data + size], dtype=np.float16).astype(np.float32).reshape(shape)
            env[name] = lit
            continue
        a = {}
        for k, v in re.findall(r"(\w+)=(\([^)]*\)|\w+)", args):
            a[k] = [env[x] for x in v.strip("()").split(",")] if v.startswith("(") else env[v]
        if op == "slice_by_size":
            b, s = a["begin"], a["size"]
            idx = tuple(slice(int(bb), int(bb) + (int(ss) if ss != -1 else dd)) for bb, ss, dd in zip(b, s, a["x"].shape))
            env[name] = a["x"][idx]
        elif op == "reshape":
            env[name] = a["x"].reshape([int(d) for d in a["shape"]])
        elif op == "transpose":
            env[name] = np.ascontiguousarray(np.transpose(a["x"], [int(p) for p in a["perm"]]))
        elif op == "matmul":
            x, y = a["x"], a["y"]
            if bool(a.get("transpose_x", False)):
                x = np.swapaxes(x, -1, -2)
            if bool(a.get("transpose_y", False)):
                y = np.swapaxes(y, -1, -2)
            env[name] = np.matmul(x, y)
        elif op in ("mul", "add", "sub", "real_div"):
            f = {"mul": np.multiply, "add": np.add, "sub": np.subtract, "real_div": np.divide}[op]
            env[name] = f(a["x"], a["y"]).astype(np.float32)
        elif op == "sigmoid":
            env[name] = 1.0 / (1.0 + np.exp(-a["x"]))
        elif op == "softmax":
            ax = int(a.get("axis", -1))
            e = np.exp(a["x"] - a["x"].max(axis=ax, keepdims=True))
            env[name] = e / e.sum(axis=ax, keepdims=True)
        elif op == "concat":
            env[name] = np.concatenate(a["values"], axis=int(a["axis"]))
        elif op == "reduce_sum":
            env[name] = a["x"].sum(axis=tuple(int(v) for v in a["axes"]), keepdims=bool(a["keep_dims"]))
        else:
            sys.exit(f"numpy_mil.py: op {op} not supported")
    np.save(yout, env[out].astype(np.float32))


if __name__ == "__main__":
    main()
