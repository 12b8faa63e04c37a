"""bench/torch_reference.py: the PyTorch side of every attnd benchmark table.

Measures, on the GPU it runs on: HBM copy and read bandwidth, PyTorch SDPA (flash
and cuDNN backends) causal prefill at head dims 64/128/256, FlexAttention with
document, sliding-window and offset-causal (chunked prefill over a cached prefix)
masks, SDPA decode over contiguous bf16 KV, and the per-layer variants (FlexAttention
with tanh soft-capping as a score_mod; SDPA decode of a sliding layer over the window's
slice of a 32k cache, beside the same SDPA at the window's length). Run it in the same command as
attnd's own benchmarks (scripts/dev/gpu-round.sh does) so that every ratio in
bench/RESULTS.md comes from one machine at one moment.

Prints one JSON line per row; writes every row to $OUT/reference.json when OUT is
set. ATTND_REF_SECTIONS=copy,read,prefill,flex,decode,shapes,b1,append,variants
(default: all) runs only the named sections, to shorten a round.
"""

import json, os, sys, time, math
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

dev = "cuda"
SECTIONS = set((os.environ.get("ATTND_REF_SECTIONS") or "copy,read,prefill,flex,decode,shapes,b1,append,variants").split(","))
def want(s): return s in SECTIONS
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
def bench(fn, warm=3, iters=20):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2] / 1e3  # median seconds

def row(name, **kv):
    res[name] = kv; print(name, json.dumps(kv), flush=True)

# 1. copy bandwidth
if want("copy"):
    try:
        n = 2 << 30
        a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255); b = torch.empty_like(a)
        t = bench(lambda: b.copy_(a))
        row("copy_bw", GBps=round(2*n/t/1e9, 1))
        del a, b
    except Exception as ex: row("copy_bw", error=str(ex)[:200])

# 1b. read bandwidth (the roof of decode, which reads far more than it writes):
# a reduction over 4 GiB of bf16 reads it once and writes a scalar.
if want("read"):
    try:
        r = torch.randn(2 << 30, device=dev, dtype=torch.bfloat16)
        t = bench(lambda: r.sum(dtype=torch.float32))
        row("read_bw", GBps=round(r.numel() * 2 / t / 1e9, 1))
        del r
    except Exception as ex: row("read_bw", error=str(ex)[:200])

# 2. prefill SDPA, causal, GQA 32/8, d=128, bf16
B, S, Hq, Hkv, D = 4, 8192, 32, 8, 128
q = torch.randn(B, Hq, S, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
ke, ve = k.repeat_interleave(Hq//Hkv, 1), v.repeat_interleave(Hq//Hkv, 1)
flops_causal = 4*B*Hq*S*S*D/2
if want("prefill"):
    for name, be in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel(be):
                t = bench(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
            row(f"prefill_causal_{name}", B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, ms=round(t*1e3,3), TFLOPs=round(flops_causal/t/1e12,1))
        except Exception as ex: row(f"prefill_causal_{name}", error=str(ex)[:200])
    # non-causal full
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t = bench(lambda: F.scaled_dot_product_attention(q, ke, ve))
        row("prefill_full_sdpa_flash", ms=round(t*1e3,3), TFLOPs=round(2*flops_causal/t/1e12,1))
    except Exception as ex: row("prefill_full_sdpa_flash", error=str(ex)[:200])
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t = bench(lambda: F.scaled_dot_product_attention(q, ke, ve))
        row("prefill_full_sdpa_cudnn", ms=round(t*1e3,3), TFLOPs=round(2*flops_causal/t/1e12,1))
    except Exception as ex: row("prefill_full_sdpa_cudnn", error=str(ex)[:200])

# 3. FlexAttention: causal document mask and sliding window
if want("flex"):
    try:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        fa = torch.compile(flex_attention)
        g = torch.Generator().manual_seed(0)
        lens = []; tot = 0
        while tot < S:
            l = int(torch.randint(256, 2048, (1,), generator=g)); l = min(l, S-tot); lens.append(l); tot += l
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
        def doc_causal(b, h, qi, ki): return (doc[qi] == doc[ki]) & (qi >= ki)
        bm = create_block_mask(doc_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device=dev)
        live = sum(l*(l+1)/2 for l in lens)
        t = bench(lambda: fa(q, k, v, block_mask=bm, enable_gqa=True))
        row("flex_doc_causal", docs=len(lens), ms=round(t*1e3,3), TFLOPs_effective=round(4*B*Hq*live*D/t/1e12,1))
        W = 1024
        def swa(b, h, qi, ki): return (qi >= ki) & (qi - ki < W)
        bm2 = create_block_mask(swa, B=None, H=None, Q_LEN=S, KV_LEN=S, device=dev)
        live2 = sum(min(i+1, W) for i in range(S))
        t = bench(lambda: fa(q, k, v, block_mask=bm2, enable_gqa=True))
        row("flex_sliding_1024", ms=round(t*1e3,3), TFLOPs_effective=round(4*B*Hq*live2*D/t/1e12,1))
        def causal(b, h, qi, ki): return qi >= ki
        bm3 = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device=dev)
        t = bench(lambda: fa(q, k, v, block_mask=bm3, enable_gqa=True))
        row("flex_causal", ms=round(t*1e3,3), TFLOPs=round(flops_causal/t/1e12,1))
    except Exception as ex: row("flex", error=str(ex)[:300])
# 3b. soft-capping (Gemma 2: 50 * tanh(s / 50)) as FlexAttention's score_mod, causal
if want("variants"):
    try:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        fa = torch.compile(flex_attention)
        def causal(b, h, qi, ki): return qi >= ki
        bmc = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device=dev)
        CAP = 50.0
        def softcap(score, b, h, qi, ki): return CAP * torch.tanh(score / CAP)
        t = bench(lambda: fa(q, k, v, score_mod=softcap, block_mask=bmc, enable_gqa=True))
        row("flex_causal_softcap50", ms=round(t*1e3,3), TFLOPs=round(flops_causal/t/1e12,1))
    except Exception as ex: row("flex_softcap", error=str(ex)[:300])
del q, k, v, ke, ve

# 4. decode: one query token per sequence over contiguous bf16 KV (SDPA), and naive int8 dequant + SDPA
if want("decode"):
    for (Bd, ctx) in [(64, 4096), (8, 32768), (256, 2048)]:
        try:
            qd = torch.randn(Bd, Hq, 1, D, device=dev, dtype=torch.bfloat16)
            kd = torch.randn(Bd, Hkv, ctx, D, device=dev, dtype=torch.bfloat16)
            vd = torch.randn(Bd, Hkv, ctx, D, device=dev, dtype=torch.bfloat16)
            kvbytes = 2*Bd*Hkv*ctx*D*2
            best = None
            for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
                try:
                    with sdpa_kernel(be):
                        t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
                    row(f"decode_bf16_{name}_B{Bd}_ctx{ctx}", us=round(t*1e6,1), GBps=round(kvbytes/t/1e9,1))
                except Exception as ex: row(f"decode_bf16_{name}_B{Bd}_ctx{ctx}", error=str(ex)[:200])
            k8 = (kd*20).clamp(-127,127).to(torch.int8); v8 = (vd*20).clamp(-127,127).to(torch.int8)
            sc = torch.full((1, Hkv, 1, 1), 0.05, device=dev, dtype=torch.bfloat16)
            def deq():
                return F.scaled_dot_product_attention(qd, k8.to(torch.bfloat16)*sc, v8.to(torch.bfloat16)*sc, enable_gqa=True)
            t = bench(deq)
            row(f"decode_int8_dequant_sdpa_B{Bd}_ctx{ctx}", us=round(t*1e6,1), GBps_of_int8=round(kvbytes/2/t/1e9,1))
            del qd, kd, vd, k8, v8
        except Exception as ex: row(f"decode_B{Bd}_ctx{ctx}", error=str(ex)[:200])
        torch.cuda.empty_cache()

# 5. more shapes: head dims 64/256 (decode and prefill), batch-1 decode, and appending
#    2048 new tokens to 6144 cached ones (the prefix-cache hit shape)
if want("shapes"):
    for D2 in (64, 256):
        try:
            qd = torch.randn(64, Hq, 1, D2, device=dev, dtype=torch.bfloat16)
            kd = torch.randn(64, Hkv, 4096, D2, device=dev, dtype=torch.bfloat16); vd = torch.randn_like(kd)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
            row(f"decode_bf16_cudnn_B64_ctx4096_d{D2}", us=round(t*1e6,1), GBps=round(2*64*Hkv*4096*D2*2/t/1e9,1))
            del qd, kd, vd
            q2 = torch.randn(4, Hq, S, D2, device=dev, dtype=torch.bfloat16)
            k2 = torch.randn(4, Hq, S, D2, device=dev, dtype=torch.bfloat16); v2 = torch.randn_like(k2)
            for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
                try:
                    with sdpa_kernel(be):
                        t = bench(lambda: F.scaled_dot_product_attention(q2, k2, v2, is_causal=True))
                    row(f"prefill_causal_sdpa_{name}_d{D2}", ms=round(t*1e3,3), TFLOPs=round(4*4*Hq*S*S*D2/2/t/1e12,1))
                except Exception as ex: row(f"prefill_causal_sdpa_{name}_d{D2}", error=str(ex)[:200])
            del q2, k2, v2
        except Exception as ex: row(f"shapes_d{D2}", error=str(ex)[:200])
        torch.cuda.empty_cache()
if want("b1"):
    try:
        qd = torch.randn(1, Hq, 1, D, device=dev, dtype=torch.bfloat16)
        kd = torch.randn(1, Hkv, 4096, D, device=dev, dtype=torch.bfloat16); vd = torch.randn_like(kd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), iters=200)
        row("decode_bf16_cudnn_B1_ctx4096", us=round(t*1e6,1))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), iters=200)
        row("decode_bf16_flash_B1_ctx4096", us=round(t*1e6,1))
    except Exception as ex: row("decode_B1", error=str(ex)[:200])
if want("append"):
    try:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        fa = torch.compile(flex_attention)
        NQ, NK, OFF = 2048, 8192, 6144
        qa = torch.randn(4, Hq, NQ, D, device=dev, dtype=torch.bfloat16)
        ka = torch.randn(4, Hkv, NK, D, device=dev, dtype=torch.bfloat16); va = torch.randn_like(ka)
        def causal_off(b, h, qi, ki): return ki <= qi + OFF
        bm = create_block_mask(causal_off, B=None, H=None, Q_LEN=NQ, KV_LEN=NK, device=dev)
        live = sum(OFF + i + 1 for i in range(NQ))
        t = bench(lambda: fa(qa, ka, va, block_mask=bm, enable_gqa=True))
        row("append_2048_over_6144_flex", ms=round(t*1e3,3), TFLOPs_effective=round(4*4*Hq*live*D/t/1e12,1))
        # the same with SDPA and an explicit boolean mask (what a plain PyTorch user writes)
        am = torch.ones(NQ, NK, device=dev, dtype=torch.bool).tril(OFF)
        ke, ve = ka.repeat_interleave(Hq//Hkv, 1), va.repeat_interleave(Hq//Hkv, 1)
        t = bench(lambda: F.scaled_dot_product_attention(qa, ke, ve, attn_mask=am))
        row("append_2048_over_6144_sdpa_mask", ms=round(t*1e3,3), TFLOPs_effective=round(4*4*Hq*live*D/t/1e12,1))
    except Exception as ex: row("append", error=str(ex)[:300])

# 6. a sliding layer's decode: B8 rows at 32k of history, SDPA over the window's
#    slice of the cache (what a contiguous-cache server reads), and SDPA over a
#    cache of the window's length (the full layer attnd's windowed row is compared with)
if want("variants"):
    try:
        Bd, ctx = 8, 32768
        qd = torch.randn(Bd, Hq, 1, D, device=dev, dtype=torch.bfloat16)
        kd = torch.randn(Bd, Hkv, ctx, D, device=dev, dtype=torch.bfloat16); vd = torch.randn_like(kd)
        for W in (4096, 128):
            ks, vs = kd[:, :, ctx - W:], vd[:, :, ctx - W:]
            kc, vc = ks.contiguous(), vs.contiguous()
            for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
                try:
                    with sdpa_kernel(be):
                        t = bench(lambda: F.scaled_dot_product_attention(qd, ks, vs, enable_gqa=True), iters=100)
                        t2 = bench(lambda: F.scaled_dot_product_attention(qd, kc, vc, enable_gqa=True), iters=100)
                    row(f"decode_sliding_sdpa_{name}_B{Bd}_ctx{ctx}_w{W}", us=round(t*1e6,1), full_at_window_us=round(t2*1e6,1))
                except Exception as ex: row(f"decode_sliding_sdpa_{name}_w{W}", error=str(ex)[:200])
            del kc, vc
        del qd, kd, vd
    except Exception as ex: row("decode_sliding", error=str(ex)[:200])
    torch.cuda.empty_cache()

if os.environ.get("OUT"):
    json.dump(res, open(os.path.join(os.environ["OUT"], "reference.json"), "w"), indent=1)
