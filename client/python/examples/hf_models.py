#!/usr/bin/env python3
"""Random-weight transformers models of the architectures with per-layer attention
variants, their attention in attnd, against the model's own eager attention.

    hf_models.py --spawn build/daemon/attnd [--backend cuda] [--arch gpt_oss,...]
                 [--dtype bf16|fp32] [--json FILE]

Architectures (a few layers, hidden 256, 4 q / 2 kv heads, head_dim 64, vocab 1000):

  gpt_oss   sliding (window 8) and full layers alternating, a learned sink logit per
            head (uploaded with SetSinks by attnd.hf), YaRN RoPE, MoE feed-forward
  gemma2    local (window 8) / global alternation, attention logit soft-capping (3.0,
            low enough to matter at these scores), query_pre_attn_scalar 48
  gemma3    three local layers (window 8) per global one, q/k norms, local and
            global RoPE bases that differ, query_pre_attn_scalar 48
  mistral   one window (8) on every layer

Each runs with a daemon started with the flags attnd.model_shape_from_config()
derives from the model's own config (--rope none: transformers rotates q and k with
the model's rotary embedding, whatever it is, and attnd computes the rest). Per
architecture: "eager" with DynamicCache is the reference (20 greedy tokens after a
12-token prompt, a batch of 2, so the windows slide); "sdpa" (where the model runs
it) gives the noise floor; attnd, teacher-forced on the reference's tokens, must
match the reference's logits within max(3e-2, 2x floor) at every step (fp32
weights: the floor is the model's eager attention over bf16-rounded q, k, v and
output, attnd's activation dtype, since sdpa and eager agree to ~1e-6 there), and
model.generate() through attnd must give the reference's tokens (up to a near-tie).
The last line is a one-line summary. Exit 0 ok, 1 a mismatch, 77 skipped (no
torch/transformers)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import attnd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (its comparison helpers)

SKIP = 77
STEPS = 20
PROMPT = 12
BATCH = 2
WINDOW = 8
LOGIT_TOL = 3e-2
ARCHS = ("gpt_oss", "gemma2", "gemma3", "mistral")
COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_config(arch):
    import transformers as tf
    if arch == "gpt_oss":
        return tf.GptOssConfig(**COMMON, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                               layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "gemma2":
        return tf.Gemma2Config(**COMMON, sliding_window=WINDOW, attn_logit_softcapping=3.0,
                               final_logit_softcapping=None, query_pre_attn_scalar=48)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=48,
                                   rope_theta=1e6, rope_local_base_freq=1e4,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"])
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=WINDOW)
    raise ValueError(arch)


def build_model(arch, dtype, device, seed=0):
    """The random model (weights drawn here, as hf_llama does: every transformers
    version builds the same one, with attention peaked enough to matter)."""
    import torch
    import transformers as tf
    cfg = make_config(arch)
    try:
        cfg._attn_implementation = "eager"
    except (AttributeError, ValueError):
        pass
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg) if arch == "gemma3" else tf.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))  # sinks around the scores' range
            elif "norm" in name:
                p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:  # biases, router
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=dev, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.eval()
    return model


def daemon_flags(model):
    """What the daemon must run with for this model (the adapter checks it too)."""
    cfg = model.config.to_dict()
    shape = attnd.model_shape_from_config(cfg, rope="none")
    return shape.flags() + ["--block-size", "16", "--dtype", "bf16", "--kv-cache", "bf16",
                            "--kv-memory", "64M", "--max-context", "1024"]


def spawn(binary, backend, flags):
    tmp = tempfile.mkdtemp(prefix="hf-models-")
    sock = os.path.join(tmp, "attnd.sock")
    log = open(os.path.join(tmp, "attnd.log"), "wb")
    proc = subprocess.Popen([binary, "--socket", sock, "--listen", "", "--metrics", "", "--state-dir", tmp,
                             "--backend", backend] + flags, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            with open(log.name, "rb") as f:
                raise RuntimeError(f"attnd {' '.join(flags)} exited with {proc.returncode}:\n"
                                   f"{f.read().decode(errors='replace')[-2000:]}")
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


BF16_EAGER = "attnd_bf16_eager_floor"


def register_bf16_eager():
    """Registers the model's own eager attention over bf16-rounded q, k, v and
    output (attnd's activation dtype) as BF16_EAGER: the noise floor of fp32
    weights served by a bf16 daemon."""
    import torch
    from transformers import AttentionInterface

    def bf16_eager(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward

        def r(t):
            return t.to(torch.bfloat16).to(t.dtype)

        out, weights = eager(module, r(query), r(key), r(value), attention_mask, **kwargs)
        return r(out), weights

    AttentionInterface.register(BF16_EAGER, bf16_eager)
    # Masks are built per implementation name too: the eager ones (additive).
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionMaskInterface.register(BF16_EAGER, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def check_arch(binary, backend, arch, dtype, device=None, seed=0, say=print):
    import torch
    import attnd.hf
    model = build_model(arch, dtype, device, seed)
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, COMMON["vocab_size"], (BATCH, PROMPT), generator=g).to(dev)
    res = dict(arch=arch, dtype=dtype, backend=backend, flags=daemon_flags(model))
    hf_llama.set_impl(model, "eager")
    ref_tok, ref_logits = hf_llama.greedy(model, ids, STEPS)
    forced = torch.from_numpy(ref_tok).to(dev)
    try:
        hf_llama.set_impl(model, "sdpa")
        _, sdpa_logits = hf_llama.greedy(model, ids, STEPS, forced=forced)
        floor = max(hf_llama.rel_l2(sdpa_logits[t, r], ref_logits[t, r])
                    for t in range(STEPS + 1) for r in range(BATCH))
    except Exception as e:  # noqa: BLE001  (a model without sdpa support: no floor)
        say(f"  {arch}: sdpa not available ({type(e).__name__}: {e}); floor from eager alone")
        floor = 0.0
    hf_llama.set_impl(model, "eager")
    res["sdpa_vs_eager_rel_l2"] = floor
    tol = LOGIT_TOL if dtype == "fp32" else max(LOGIT_TOL, 2 * floor)
    if dtype == "fp32":
        # fp32 weights: sdpa and eager agree to ~1e-6, but attnd computes over
        # bf16 activations. The floor that applies is the model's own eager
        # attention over bf16-rounded q, k, v and output; a mixture of experts
        # (gpt-oss) amplifies it through its routing.
        try:
            register_bf16_eager()
            hf_llama.set_impl(model, BF16_EAGER)
            _, b16_logits = hf_llama.greedy(model, ids, STEPS, forced=forced)
            b16 = max(hf_llama.rel_l2(b16_logits[t, r], ref_logits[t, r])
                      for t in range(STEPS + 1) for r in range(BATCH))
            res["bf16_eager_vs_eager_rel_l2"] = b16
            tol = max(LOGIT_TOL, 2 * b16)
        except Exception as e:  # noqa: BLE001  (no registry: the plain bound)
            say(f"  {arch}: no bf16-eager floor ({type(e).__name__}: {e})")
        hf_llama.set_impl(model, "eager")
    proc, sock, tmp = spawn(binary, backend, res["flags"])
    try:
        with attnd.Client(sock, timeout=120) as client:
            adapter = attnd.hf.AttndAdapter(client)
            adapter.attach(model)
            try:
                with adapter.cache() as cache:
                    _, att_logits = hf_llama.greedy(model, ids, STEPS, cache=cache, forced=forced)
                res["teacher_forced"], abs_err = hf_llama.compare_logits(att_logits, ref_logits,
                                                                         f"{arch} attnd vs eager", tol)
                with adapter.cache() as cache:
                    with torch.no_grad():
                        gen = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                             max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
                gen_tok = gen[:, PROMPT:].cpu().numpy()
                if gen_tok.shape != ref_tok.shape:
                    raise AssertionError(f"{arch}: generate() made {gen_tok.shape[1]} tokens")
                res["generate_same_tokens"] = hf_llama.compare_tokens(gen_tok, ref_tok, ref_logits, abs_err,
                                                                      f"{arch} generate")
                res["steps"] = adapter.runner.steps
            finally:
                adapter.detach(model)
                adapter.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    tf = res["teacher_forced"]
    b16 = res.get("bf16_eager_vs_eager_rel_l2")
    say(f"  {arch} {dtype} {backend}: teacher-forced logits rel L2 {tf['rel_l2']:.2e} (bound {tol:.1e}, "
        f"sdpa-vs-eager floor {floor:.1e}" + (f", bf16-eager floor {b16:.1e}" if b16 is not None else "") +
        f"), argmax {tf['agree'] + tf['near_ties']}/{tf['n']}, "
        f"generate {res['generate_same_tokens']}/{BATCH * STEPS} tokens as eager's")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spawn", metavar="ATTND", required=True, help="the attnd binary to start per model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"SKIP: hf_models needs torch and transformers ({e})")
        return SKIP
    results, line, rc = [], [], 0
    for arch in a.arch.split(","):
        try:
            r = check_arch(a.spawn, a.backend, arch, a.dtype, a.device)
            results.append(r)
            tf = r["teacher_forced"]
            line.append(f"{arch}:PASS({tf['rel_l2']:.1e}/{r['sdpa_vs_eager_rel_l2']:.1e} "
                        f"gen {r['generate_same_tokens']}/{BATCH * STEPS})")
        except Exception as e:  # noqa: BLE001  (report every architecture, then fail)
            import traceback
            traceback.print_exc()
            results.append(dict(arch=arch, error=f"{type(e).__name__}: {e}"))
            line.append(f"{arch}:FAIL({type(e).__name__})")
            rc = 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"hf_models {a.backend}/{a.dtype}: " + " ".join(line))
    return rc


if __name__ == "__main__":
    sys.exit(main())
