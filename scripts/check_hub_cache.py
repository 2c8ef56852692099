#!/usr/bin/env python3
"""Checks that Python's huggingface_hub finds the models anetrain downloads.

Serves testdata/chat/model as the Hub repository `test-org/chat-tiny` from a
small HTTP server on 127.0.0.1 (the Hub's file API as anetrain's client uses
it), lets `anetrain eval --model test-org/chat-tiny` download it into a fresh
HF_HOME, then asks huggingface_hub for the same repository with
`snapshot_download(..., local_files_only=True)` (no network) and compares
the directory and every file.

Needs Python with `huggingface_hub` (pip install huggingface_hub) and a
release build (cargo build --release). Run by hand:

    python3 scripts/check_hub_cache.py
"""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "testdata", "chat", "model")
DATA = os.path.join(ROOT, "testdata", "chat", "data", "chat", "valid.jsonl")
BINARY = os.path.join(ROOT, "target", "release", "anetrain")
REPO = "test-org/chat-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        parts = self.path.strip("/").split("/")
        files = sorted(os.listdir(MODEL))
        if parts[:2] == ["api", "models"] and "/".join(parts[2:4]) == REPO:
            body = json.dumps(
                {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if "/".join(parts[:2]) == REPO and len(parts) == 5 and parts[2] == "resolve" and parts[4] in files:
            data = open(os.path.join(MODEL, parts[4]), "rb").read()
            start, end = 0, len(data) - 1
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, b = rng[6:].split("-")
                start, end = int(a), (int(b) if b else len(data) - 1)
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end, len(data)))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main():
    import importlib.util

    if importlib.util.find_spec("huggingface_hub") is None:
        sys.exit("needs huggingface_hub: pip install huggingface_hub")
    if not os.path.isfile(BINARY):
        sys.exit(f"needs {BINARY}: cargo build --release")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = "http://127.0.0.1:%d" % server.server_address[1]
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HF_HOME=home, HF_ENDPOINT=endpoint)
        env.pop("HF_HUB_CACHE", None)
        env.pop("HF_HUB_OFFLINE", None)
        run = subprocess.run(
            [BINARY, "eval", "--model", REPO, "--data", DATA, "--backend", "cpu"],
            env=env, capture_output=True, text=True,
        )
        if run.returncode != 0:
            sys.exit("anetrain eval failed: " + run.stderr)
        print(run.stderr.strip())
        server.shutdown()

        # huggingface_hub reads HF_HOME when it is imported.
        os.environ["HF_HOME"] = home
        os.environ.pop("HF_HUB_CACHE", None)
        from huggingface_hub import snapshot_download

        path = snapshot_download(REPO, local_files_only=True)
        expected = os.path.join(home, "hub", "models--test-org--chat-tiny", "snapshots", COMMIT)
        assert os.path.samefile(path, expected), (path, expected)
        found = sorted(os.listdir(path))
        for f in found:
            a = open(os.path.join(path, f), "rb").read()
            b = open(os.path.join(MODEL, f), "rb").read()
            assert a == b, f"{f} differs"
        needed = ["config.json", "model.safetensors", "tokenizer.json"]
        assert all(f in found for f in needed), found
        print(f"huggingface_hub found {REPO} at {path}: {', '.join(found)} (identical bytes)")


if __name__ == "__main__":
    main()
