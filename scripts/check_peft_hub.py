#!/usr/bin/env python3
"""Checks that an adapter trained from a Hub id loads in PEFT by that id.

Serves testdata/chat/model as the Hub repository `test-org/chat-tiny` (the
server of check_hub_cache.py), trains a LoRA adapter with
`anetrain train --model test-org/chat-tiny` into a fresh HF_HOME, then, with
the server gone and HF_HUB_OFFLINE=1, in a working directory where no path
of that name exists, loads the run directory with PEFT's
`AutoPeftModelForCausalLM.from_pretrained(run_dir)`: PEFT reads
`base_model_name_or_path` from adapter_config.json and must find the base
by its id in the cache alone. The logits of a few tokens are compared with
`anetrain eval --adapter --logits-out` on the same tokens.

Needs Python with torch, transformers, peft and huggingface_hub, and a
release build (cargo build --release). Run by hand:

    python3 scripts/check_peft_hub.py
"""

import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_hub_cache as hub  # noqa: E402

TOLERANCE = 1e-4  # f32 on both sides; measured differences are ~1e-6


def main():
    import numpy as np

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), hub.Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = "http://127.0.0.1:%d" % server.server_address[1]
    with tempfile.TemporaryDirectory() as tmp:
        home, run_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "run")
        env = dict(os.environ, HF_HOME=home, HF_ENDPOINT=endpoint)
        env.pop("HF_HUB_CACHE", None)
        env.pop("HF_HUB_OFFLINE", None)
        train = [hub.BINARY, "train", "--model", hub.REPO, "--data", hub.DATA]
        train += ["--lora-rank", "4", "--steps", "3", "--seq", "64", "--lr", "1e-2"]
        train += ["--eval-every", "0", "--backend", "cpu", "--out", run_dir]
        done = subprocess.run(train, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit("anetrain train failed: " + done.stderr)
        server.shutdown()
        config = json.load(open(os.path.join(run_dir, "adapter_config.json")))
        print("adapter_config.json base_model_name_or_path:", config["base_model_name_or_path"])
        assert config["base_model_name_or_path"] == hub.REPO, config

        tokens = np.array([[1, 5, 9, 17, 33, 65, 129, 200]], dtype=np.int64)
        tok_path, logits_path = os.path.join(tmp, "t.npy"), os.path.join(tmp, "l.npy")
        np.save(tok_path, tokens)
        env["HF_HUB_OFFLINE"] = "1"
        ev = [hub.BINARY, "eval", "--model", hub.REPO, "--adapter", run_dir]
        ev += ["--tokens", tok_path, "--logits-out", logits_path, "--backend", "cpu"]
        done = subprocess.run(ev, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit("anetrain eval failed: " + done.stderr)
        ours = np.load(logits_path)

        # huggingface_hub reads these when it is imported; a working
        # directory with nothing named test-org/ in it.
        os.environ.update(HF_HOME=home, HF_HUB_OFFLINE="1")
        os.environ.pop("HF_HUB_CACHE", None)
        os.chdir(tmp)
        import torch
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32)
        with torch.no_grad():
            theirs = model(torch.from_numpy(tokens)).logits.float().numpy()
        # eval predicts from t[0..n-1]: n-1 positions.
        theirs = theirs[:, :-1]
        ours = ours.reshape(theirs.shape)
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        print(f"PEFT loaded the adapter, base {hub.REPO} from the cache; logits max relative difference {err:.2e}")
        assert err < TOLERANCE, err


if __name__ == "__main__":
    main()
