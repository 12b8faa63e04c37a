#!/usr/bin/env python3
"""A small randomly initialised transformers Llama whose attention runs in attnd.

Checks attnd.hf (the transformers attention adapter) against transformers' own
attention. The model: LlamaForCausalLM, 2 layers, hidden 256, 4 q / 2 kv heads,
head_dim 64, vocab 1000, random weights (bf16 by default, --dtype fp32 too). The
same model, same prompts (a batch of 2 rows), runs

  1. "sdpa" with transformers' DynamicCache: the reference; 20 greedy tokens.
  2. "eager" the same way: the noise floor between two exact implementations.
  3. "attnd" with an AttndCache (attnd holds the KV), fed the reference's tokens
     (teacher forcing), so every step's logits compare with the reference's:
     relative L2 and max abs error, greedy tokens equal unless the reference had a
     near-tie there.
  4. "attnd" through model.generate(): greedy tokens equal to the reference's up
     to the first near-tie.
  5. "attnd" without a cache (use_cache=False): all positions' logits of the whole
     sequence in one forward, against sdpa's.
  6. "attnd" generate() twice on 40-token prompts with AttndCache(prefix=True): the
     second finds the first's full blocks in attnd's prefix cache and sends only
     the rest; both runs' tokens against sdpa's.

and checks that attnd, not transformers, holds the KV (session lengths in attnd).

    hf_llama.py --socket PATH            # a daemon started with the shape below, --rope none
    hf_llama.py --spawn build/daemon/attnd [--backend cuda]

Daemon shape: --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 --rope none
(--dtype bf16, --kv-cache bf16). Exit: 0 ok, 1 mismatch or error, 77 skipped
(no torch/transformers, or the daemon's engine answers UNIMPLEMENTED).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import attnd

SKIP = 77
STEPS = 20
PROMPT = 12
BATCH = 2
PREFIX_PROMPT = 40  # two full 16-token blocks for the prefix-cache part
# Logits' relative L2 per step against sdpa. Both sides round q, k, v and the
# attention output to bf16; two layers of that move logits by about 1e-2. A bf16
# model also rounds everything else, so there the bound is at least twice what
# eager's exact attention already differs from sdpa's (the noise floor).
LOGIT_TOL = 3e-2
# A reference top-2 gap below this fraction of the logits' std, or below twice the
# largest logit error at that step, is a near-tie: either token may win there.
TIE_TOL = 5e-2

SHAPE = dict(layers=2, hidden=256, q_heads=4, kv_heads=2, head_dim=64, vocab=1000, inter=512)
DAEMON_SHAPE = ["--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                "--block-size", "16", "--rope", "none", "--dtype", "bf16", "--kv-cache", "bf16",
                "--kv-memory", "64M"]


def build_model(dtype="bf16", device=None, seed=0):
    """The random Llama (weights drawn here, not by transformers' init, so that every
    transformers version builds the same model and attention is peaked enough to matter)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPE
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["q_heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    try:
        cfg._attn_implementation = "sdpa"
    except (AttributeError, ValueError):  # a release that takes it only at load time; sdpa is the default
        pass
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # std 0.1 at width 256: q.k scores of a few units, logits spread ~1.6
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # RMSNorm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=dev, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.eval()
    return model


def greedy(model, ids, steps, cache=None, forced=None):
    """Prefill then `steps` decode forwards; returns (tokens [b, steps], logits [steps+1, b, V] fp32).
    forced: feed these tokens instead of the model's own argmax (teacher forcing)."""
    import torch
    logits, toks = [], []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        for t in range(steps + 1):
            lg = out.logits[:, -1].float()
            logits.append(lg.cpu().numpy())
            if t == steps:
                break
            nxt = lg.argmax(-1) if forced is None else forced[:, t]
            toks.append(nxt.cpu().numpy())
            out = model(input_ids=nxt[:, None].to(ids.device), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    return np.stack(toks, 1), np.stack(logits)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare_logits(got, ref, what, tol):
    """Per step and row: rel L2, max abs error, argmax agreement (near-ties allowed).
    Returns the measurements and abs_err [steps, rows] (for compare_tokens)."""
    worst_rel = worst_abs = 0.0
    agree = ties = 0
    abs_err = np.zeros(ref.shape[:2])
    for t in range(ref.shape[0]):
        for r in range(ref.shape[1]):
            g, f = got[t, r], ref[t, r]
            err = rel_l2(g, f)
            abs_err[t, r] = float(np.max(np.abs(g - f)))
            worst_rel = max(worst_rel, err)
            worst_abs = max(worst_abs, abs_err[t, r])
            if err > tol:
                raise AssertionError(f"{what}: step {t} row {r}: logits rel L2 {err:.3e} > {tol:.3e}")
            a, b = int(np.argmax(g)), int(np.argmax(f))
            if a == b:
                agree += 1
                continue
            gap = float(f[b] - f[a])
            if gap > max(TIE_TOL * float(np.std(f)), 2 * abs_err[t, r]):
                raise AssertionError(f"{what}: step {t} row {r}: argmax {a}, reference {b} (gap {gap:.3e}, "
                                     f"logits' std {np.std(f):.3e}, max abs error {abs_err[t, r]:.3e})")
            ties += 1
    return dict(rel_l2=worst_rel, max_abs=worst_abs, agree=agree, near_ties=ties,
                n=int(ref.shape[0] * ref.shape[1]), tol=tol), abs_err


def compare_tokens(got, ref_tokens, ref_logits, abs_err, what):
    """Free-running greedy tokens: equal to the reference's, or diverging first at a
    step where the reference had a near-tie (after that the sequences differ)."""
    same = 0
    for r in range(ref_tokens.shape[0]):
        for t in range(ref_tokens.shape[1]):
            if got[r, t] == ref_tokens[r, t]:
                same += 1
                continue
            f = ref_logits[t, r]
            gap = float(f[ref_tokens[r, t]] - f[got[r, t]])
            if gap > max(TIE_TOL * float(np.std(f)), 2 * abs_err[t, r]):
                raise AssertionError(f"{what}: row {r} step {t}: token {got[r, t]}, reference "
                                     f"{ref_tokens[r, t]} (gap {gap:.3e}, logits' std {np.std(f):.3e})")
            break  # a near-tie: the rest of this row follows another path
    return same


def set_impl(model, name):
    from attnd.hf import _set_attn_implementation
    _set_attn_implementation(model, name)


def run_check(client, dtype="bf16", steps=STEPS, prompt=PROMPT, batch=BATCH, seed=0, verbose=True,
              device=None):
    """Runs every comparison; returns a dict of measurements, raises AssertionError on a mismatch."""
    import torch
    import transformers
    import attnd.hf

    h = client.health()
    model = build_model(dtype, device, seed)
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, SHAPE["vocab"], (batch, prompt), generator=g).to(dev)
    res = dict(transformers=transformers.__version__, torch=torch.__version__, dtype=dtype,
               device=str(dev), backend=h.backend, attnd_device=h.device)

    def say(msg):  # as each part finishes, so a failure's log shows what passed before it
        if verbose:
            print(msg, flush=True)

    say(f"hf_llama: transformers {res['transformers']}, torch {res['torch']}, model {dtype} on "
        f"{res['device']}; attnd backend {res['backend']} ({res['attnd_device']})")

    # 1, 2: transformers' own attention and cache.
    t0 = time.monotonic()
    set_impl(model, "sdpa")
    ref_tok, ref_logits = greedy(model, ids, steps)
    res["sdpa_s"] = time.monotonic() - t0
    set_impl(model, "eager")
    _, eager_logits = greedy(model, ids, steps, forced=torch.from_numpy(ref_tok).to(dev))
    floor = max(rel_l2(eager_logits[t, r], ref_logits[t, r])
                for t in range(steps + 1) for r in range(batch))
    res["eager_vs_sdpa_rel_l2"] = floor
    tol = LOGIT_TOL if dtype == "fp32" else max(LOGIT_TOL, 2 * floor)
    set_impl(model, "sdpa")
    say(f"  reference (sdpa) tokens: {ref_tok.tolist()}")
    say(f"  eager vs sdpa: logits rel L2 {floor:.2e} (noise floor); attnd's bound {tol:.1e}")

    adapter = attnd.hf.AttndAdapter(client)
    adapter.attach(model)
    try:
        # 3: teacher-forced, logits step by step.
        t0 = time.monotonic()
        with adapter.cache() as cache:
            _, att_logits = greedy(model, ids, steps, cache=cache,
                                   forced=torch.from_numpy(ref_tok).to(dev))
            lens = {s.session: s.len for s in client.list_sessions()}
            held = [lens.get(sid) for sid in cache.sessions]
            if held != [prompt + steps] * batch:
                raise AssertionError(f"attnd holds {held} tokens per session, expected {prompt + steps}")
            if cache.get_seq_length() != prompt + steps:
                raise AssertionError(f"AttndCache counts {cache.get_seq_length()} tokens")
        res["attnd_s"] = time.monotonic() - t0
        res["teacher_forced"], abs_err = compare_logits(att_logits, ref_logits, "attnd vs sdpa", tol)
        res["attnd_sessions_len"] = held
        tf = res["teacher_forced"]
        say(f"  attnd vs sdpa, teacher-forced {steps + 1} steps x {batch} rows: worst logits rel L2 "
            f"{tf['rel_l2']:.2e}, max abs {tf['max_abs']:.3e}, argmax agree {tf['agree']}/{tf['n']} "
            f"(near-ties {tf['near_ties']}); attnd held {held} tokens per session; "
            f"{res['attnd_s']:.2f} s vs sdpa {res['sdpa_s']:.2f} s")

        # 4: model.generate() with an AttndCache.
        with adapter.cache() as cache:
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                     max_new_tokens=steps, do_sample=False, pad_token_id=0)
        gen_tok = gen[:, prompt:].cpu().numpy()
        if gen_tok.shape != ref_tok.shape:
            raise AssertionError(f"generate() made {gen_tok.shape[1]} tokens, expected {steps}")
        res["generate_same_tokens"] = compare_tokens(gen_tok, ref_tok, ref_logits, abs_err, "generate")
        res["generate_tokens"] = gen_tok.tolist()
        say(f"  attnd generate(): {res['generate_same_tokens']}/{batch * steps} tokens as sdpa's")

        # 5: no cache: the whole sequence in one forward, every position's logits.
        full = torch.cat([ids, torch.from_numpy(ref_tok).to(dev)], 1)
        with torch.no_grad():
            before = adapter.runner.steps
            att_full = model(input_ids=full, use_cache=False).logits.float().cpu().numpy()
            if adapter.runner.steps != before + SHAPE["layers"]:  # else sdpa ran: an empty comparison
                raise AssertionError(f"use_cache=False made {adapter.runner.steps - before} attnd steps")
            set_impl(model, "sdpa")
            ref_full = model(input_ids=full, use_cache=False).logits.float().cpu().numpy()
            set_impl(model, adapter.name)
        err = rel_l2(att_full, ref_full)
        if err > tol:
            raise AssertionError(f"use_cache=False: logits rel L2 {err:.3e} > {tol:.3e}")
        res["no_cache_rel_l2"] = err
        say(f"  attnd use_cache=False, {prompt + steps} positions: logits rel L2 {err:.2e}")

        # 6: attnd's prefix cache under generate(): a second cache with the same
        # (longer) prompts finds its full blocks held and sends only the rest.
        long_ids = torch.randint(0, SHAPE["vocab"], (batch, PREFIX_PROMPT), generator=g).to(dev)
        pre_steps = 8
        set_impl(model, "sdpa")
        pre_ref_tok, pre_ref_logits = greedy(model, long_ids, pre_steps)
        set_impl(model, adapter.name)
        salt = os.urandom(8)
        want = (PREFIX_PROMPT - 1) // h.model.block_size * h.model.block_size
        got, cached = [], []
        for _ in range(2):
            with adapter.cache(prefix=True, salt=salt) as cache:
                with torch.no_grad():
                    gen = model.generate(long_ids, attention_mask=torch.ones_like(long_ids),
                                         past_key_values=cache, max_new_tokens=pre_steps, do_sample=False,
                                         pad_token_id=0)
                got.append(gen[:, PREFIX_PROMPT:].cpu().numpy())
                cached.append(cache.cached_len)
        if cached != [[0] * batch, [want] * batch]:
            raise AssertionError(f"prefix cache: cached_len {cached}, expected {[[0] * batch, [want] * batch]}")
        est = np.full((pre_steps + 1, batch), res["teacher_forced"]["max_abs"])
        same = [compare_tokens(t, pre_ref_tok, pre_ref_logits, est, f"prefix run {i}") for i, t in enumerate(got)]
        res["prefix"] = dict(prompt=PREFIX_PROMPT, cached_len=cached[1], same_tokens=same,
                             hit_equals_miss=bool((got[0] == got[1]).all()))
        say(f"  attnd prefix cache: prompt {PREFIX_PROMPT}, second cache found {cached[1]} positions held; "
            f"tokens as sdpa's {same[0]}/{batch * pre_steps} (miss) and {same[1]}/{batch * pre_steps} (hit); "
            f"hit == miss: {res['prefix']['hit_equals_miss']}")
    finally:
        adapter.detach(model)
        adapter.close()
    res["steps"] = adapter.runner.steps
    res["plans"] = adapter.runner.plans
    res["ref_tokens"] = ref_tok.tolist()
    say(f"  {res['steps']} attnd steps under {res['plans']} plans: PASS")
    return res


def spawn(binary, backend="cpu"):
    """Starts a daemon of the check's shape in a temporary directory; returns (process, socket, dir)."""
    tmp = tempfile.mkdtemp(prefix="hf-llama-")
    sock = os.path.join(tmp, "attnd.sock")
    log = open(os.path.join(tmp, "attnd.log"), "wb")
    proc = subprocess.Popen([binary, "--socket", sock, "--listen", "", "--metrics", "",
                             "--state-dir", tmp, "--backend", backend] + DAEMON_SHAPE,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            with open(log.name, "rb") as f:
                raise RuntimeError(f"attnd exited with {proc.returncode}:\n{f.read().decode(errors='replace')[-2000:]}")
        if os.path.exists(sock):
            try:
                with attnd.Client(sock, timeout=5) as c:
                    c.health()
                return proc, sock, tmp
            except (attnd.AttndError, OSError):
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("attnd did not answer Health within 30 s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--socket", help="attnd's Unix socket (default: the standard lookup)")
    g.add_argument("--tcp", help="attnd's HOST:PORT")
    g.add_argument("--spawn", metavar="ATTND", help="start this attnd binary with the check's shape")
    ap.add_argument("--backend", default="cpu", help="backend of a --spawn'ed daemon (cpu|cuda)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="model weights")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write the measurements here")
    a = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"SKIP: hf_llama needs torch and transformers ({e})")
        return SKIP
    proc = tmp = None
    addr = a.tcp or a.socket
    if a.spawn:
        if not os.access(a.spawn, os.X_OK):
            print(f"SKIP: {a.spawn} is not built")
            return SKIP
        proc, addr, tmp = spawn(a.spawn, a.backend)
    try:
        with attnd.Client(addr, timeout=120) as c:
            res = run_check(c, a.dtype, a.steps, seed=a.seed, device=a.device)
        if a.json:
            import json
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    except attnd.Unimplemented as e:
        print(f"SKIP: attnd answers UNIMPLEMENTED ({e.message})")
        return SKIP
    except (AssertionError, attnd.AttndError, OSError, RuntimeError, ValueError) as e:
        import traceback
        traceback.print_exc()
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
